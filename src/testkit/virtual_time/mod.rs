//! Whole nodes in virtual time: the shipped node — every driver, the transport, chitchat, the
//! persist worker, the entity tasks — run unchanged on a simulated machine, with time that
//! moves only when every node is idle.
//!
//! **How.** Each node runs on its own current-thread tokio runtime with a paused clock, and so
//! does the test ([`VirtualRun::run`] hands it a [`VirtualCluster`]). One thread steps them
//! together: every runtime runs what is ready, then its clock moves on by one tick, so all
//! clocks read the same instant between steps and a second of timers costs what the nodes do
//! in it, not a second. A commit on the disk (the blocking pool) holds its node's clock — and so
//! everyone's — until it is done. Messaging uses in-memory pipes and gossip chitchat's
//! in-process transport (`network.rs`); links are cut by the same [`FaultInjector`] as in
//! [`super::TestCluster`]. [`crate::clock::wall_ms`] follows the virtual clock on the stepping
//! thread.
//!
//! **Crash.** [`VirtualCluster::crash`] drops the node's runtime: every task of the node ends
//! where it stood, what the persist worker had not committed is lost, its pipes break and its
//! listener and gossip address are freed; a restart opens the same data dir as a new
//! incarnation. That is a process crash, which [`super::TestCluster::kill`] (a graceful stop)
//! is not.
//!
//! **What it is not.** Not byte-for-byte replayable like [`super::sim`]: tasks within one
//! tick interleave as tokio schedules them, hash maps are seeded per process, and a commit's
//! real duration does not count. A seed fixes the faults and the workload; a failure found is
//! made into a named test by its schedule. Gossip is plain (a cluster secret needs the
//! operating system's UDP sockets), and links have no latency of their own beyond a tick.

mod network;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::{mpsc, oneshot};

use super::{FaultInjector, eventually, init_test_tracing, test_config};
use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::node::Node;
use network::SimulatedNetwork;

/// Every runtime's clock is moved this far ahead when it is made, so that one made later (a
/// restarted node's, whose clock starts at the real time) is never ahead of the others and can
/// always be moved to the shared instant.
const HEADROOM: Duration = Duration::from_secs(24 * 3600);

/// Gossip and messaging ports of every simulated node (each node has its own address).
const GOSSIP_PORT: u16 = 7946;
const MESSAGING_PORT: u16 = 7947;

/// Hook that changes node `i`'s configuration before it starts.
type Customize = dyn Fn(usize, &mut NodeConfig) + Send + Sync;

/// A run of whole nodes in virtual time: how many, their configuration, the tick and the
/// virtual-time limit.
pub struct VirtualRun {
    nodes: usize,
    initially: usize,
    customize: Arc<Customize>,
    tick: Duration,
    limit: Duration,
    commit_latency: Duration,
}

impl VirtualRun {
    /// `nodes` nodes `n1..=nN` with [`test_config`] settings; `n1` forms the cluster.
    pub fn new(nodes: usize) -> Self {
        VirtualRun {
            nodes,
            initially: nodes,
            customize: Arc::new(|_, _| {}),
            tick: Duration::from_millis(1),
            limit: Duration::from_secs(3600),
            commit_latency: Duration::from_millis(2),
        }
    }

    /// Starts only the first `k` nodes before the test runs; the test starts the others
    /// ([`VirtualCluster::start`]), to grow the cluster.
    pub fn initially(mut self, k: usize) -> Self {
        self.initially = k.min(self.nodes);
        self
    }

    /// Changes node `i`'s configuration (index from 0) before each of its starts.
    pub fn configure(mut self, customize: impl Fn(usize, &mut NodeConfig) + Send + Sync + 'static) -> Self {
        self.customize = Arc::new(customize);
        self
    }

    /// How far every clock moves per step (default 1 ms, tokio's timer resolution).
    pub fn tick(mut self, tick: Duration) -> Self {
        self.tick = tick.max(Duration::from_millis(1));
        self
    }

    /// How long each commit to a node's disk takes, in virtual time (default 2 ms): a crash
    /// meanwhile loses that commit, as a crash before a disk's `fsync` returned does.
    pub fn commit_latency(mut self, latency: Duration) -> Self {
        self.commit_latency = latency;
        self
    }

    /// The run fails once this much virtual time has passed (default an hour).
    pub fn time_limit(mut self, limit: Duration) -> Self {
        self.limit = limit;
        self
    }

    /// Starts the nodes (or the first of them, see [`VirtualRun::initially`]) one by one, each
    /// joining those already up, and runs `test` against
    /// them; returns what `test` returns, or panics with its panic or when the time limit is
    /// reached. Call it from a plain `#[test]`, not inside a runtime.
    pub fn run<T, F, Fut>(self, test: F) -> T
    where
        F: FnOnce(VirtualCluster) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        init_test_tracing();
        let dirs: Vec<TempDir> = (0..self.nodes).map(|_| tempfile::tempdir().expect("a temp dir")).collect();
        let (commands, rx) = mpsc::unbounded_channel();
        let cluster = VirtualCluster {
            shared: Arc::new(Shared {
                nodes: Mutex::new(vec![None; self.nodes]),
                dirs: dirs.iter().map(|d| d.path().to_path_buf()).collect(),
                customize: self.customize,
            }),
            commands,
            injector: FaultInjector::new(),
        };
        let net = SimulatedNetwork::with_commit_latency(self.commit_latency);
        let mut world = World::new(self.tick, net, cluster.clone(), rx);
        let nodes = self.initially;
        let starting = cluster.clone();
        let body = test(cluster);
        let task = world.client.spawn(async move {
            for i in 0..nodes {
                starting.start(i).await.unwrap_or_else(|e| panic!("n{} did not start: {e}", i + 1));
            }
            body.await
        });
        while !task.is_finished() {
            assert!(world.elapsed < self.limit, "the run passed its virtual-time limit of {:?}", self.limit);
            world.step();
        }
        let outcome = world.client.block_on(task);
        world.stop();
        drop(dirs);
        match outcome {
            Ok(value) => value,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("the test task ended without an outcome: {e}"),
        }
    }
}

/// What the test and the stepping thread share.
struct Shared {
    /// Each running node with the runtime it runs on.
    nodes: Mutex<Vec<Option<(Node, Handle)>>>,
    dirs: Vec<PathBuf>,
    customize: Arc<Customize>,
}

/// What only the stepping thread can do: make and drop runtimes.
enum Command {
    Start { i: usize, config: Box<NodeConfig>, done: oneshot::Sender<Result<()>> },
    Crash { i: usize, done: oneshot::Sender<()> },
    Pause { i: usize, duration: Duration },
}

/// The test's handle on a [`VirtualRun`]'s nodes. Cheap to clone.
#[derive(Clone)]
pub struct VirtualCluster {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    injector: FaultInjector,
}

impl std::fmt::Debug for VirtualCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualCluster").field("nodes", &self.len()).finish()
    }
}

impl VirtualCluster {
    /// Node id of index `i`.
    pub fn node_id(i: usize) -> String {
        super::node_id(i)
    }

    /// Number of node slots (running or not).
    pub fn len(&self) -> usize {
        self.shared.dirs.len()
    }

    /// True when the run has no nodes.
    pub fn is_empty(&self) -> bool {
        self.shared.dirs.is_empty()
    }

    /// Node `i`, if it runs.
    pub fn node(&self, i: usize) -> Option<Node> {
        self.shared.nodes.lock().expect("nodes").get(i)?.as_ref().map(|(n, _)| n.clone())
    }

    /// Running nodes with their indexes.
    pub fn running(&self) -> Vec<(usize, Node)> {
        let nodes = self.shared.nodes.lock().expect("nodes");
        nodes.iter().enumerate().filter_map(|(i, n)| Some((i, n.as_ref()?.0.clone()))).collect()
    }

    /// Data dir of node `i`.
    pub fn data_dir(&self, i: usize) -> &Path {
        &self.shared.dirs[i]
    }

    /// The shared fault injector.
    pub fn injector(&self) -> &FaultInjector {
        &self.injector
    }

    /// Cuts gossip and messaging between the two sets of node indexes.
    pub fn partition(&self, a: &[usize], b: &[usize]) {
        self.injector.cut_indexes(a, b);
    }

    /// Heals every cut.
    pub fn heal(&self) {
        self.injector.heal_all();
    }

    /// Runs `f` with node `i` on that node's runtime (so what it spawns is the node's, and ends
    /// with a crash of it); `None` if the node does not run or crashes before `f` ends.
    pub async fn on_node<T, F, Fut>(&self, i: usize, f: F) -> Option<T>
    where
        F: FnOnce(Node) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let (node, handle) = self.shared.nodes.lock().expect("nodes").get(i)?.clone()?;
        handle.spawn(f(node)).await.ok()
    }

    /// Crashes node `i` (see the module doc); nothing if it does not run.
    pub async fn crash(&self, i: usize) {
        let (done, crashed) = oneshot::channel();
        if self.commands.send(Command::Crash { i, done }).is_ok() {
            let _ = crashed.await;
        }
    }

    /// Pauses node `i` for `duration` of virtual time, as a stopped process (`SIGSTOP`), a long
    /// garbage collection or a frozen VM would be: nothing of it runs meanwhile — not its
    /// timers, not its reads of what others send — while everyone else goes on; then its clock
    /// jumps to the others' and what came due fires at once. Returns at once.
    pub fn pause(&self, i: usize, duration: Duration) {
        let _ = self.commands.send(Command::Pause { i, duration });
    }

    /// Stops node `i` gracefully ([`Node::shutdown`]: no leave, no hand-off), then frees its
    /// runtime.
    pub async fn shutdown(&self, i: usize) {
        if let Some(node) = self.node(i) {
            node.shutdown().await;
        }
        self.crash(i).await;
    }

    /// Starts node `i` on its data dir (a new incarnation after a crash), joining through the
    /// Up members (or, while none is Up, every running node).
    pub async fn start(&self, i: usize) -> Result<()> {
        let config = self.config_for(i, true);
        self.start_with(i, config).await
    }

    /// Crashes node `i` if it runs, then starts it again.
    pub async fn restart(&self, i: usize) -> Result<()> {
        self.crash(i).await;
        self.start(i).await
    }

    /// Restarts node `i` with no seeds, so it forms a new cluster (what an operator does when
    /// every member is gone).
    pub async fn restart_forming(&self, i: usize) -> Result<()> {
        self.crash(i).await;
        let config = self.config_for(i, false);
        self.start_with(i, config).await
    }

    async fn start_with(&self, i: usize, config: NodeConfig) -> Result<()> {
        let (done, started) = oneshot::channel();
        let command = Command::Start { i, config: Box::new(config), done };
        self.commands.send(command).map_err(|_| Error::ShutDown)?;
        // A start cut short by a crash of the node: its runtime is gone.
        started.await.unwrap_or(Err(Error::ShutDown))
    }

    fn config_for(&self, i: usize, with_seeds: bool) -> NodeConfig {
        let mut cfg = test_config(&Self::node_id(i), &self.shared.dirs[i], "virtual-cluster");
        cfg.gossip_addr = SocketAddr::new(ip_of(i), GOSSIP_PORT);
        cfg.messaging_addr = SocketAddr::new(ip_of(i), MESSAGING_PORT);
        if with_seeds {
            cfg.seeds = super::seeds_among(self.running().iter().map(|(_, n)| n));
        }
        (self.shared.customize)(i, &mut cfg);
        cfg
    }

    /// Whether every running node lists exactly the running nodes, all Up and reachable.
    pub fn is_converged(&self) -> bool {
        super::converged(&self.running().iter().map(|(_, n)| n).collect::<Vec<_>>())
    }

    /// Waits (in virtual time) until [`VirtualCluster::is_converged`]; panics after `timeout`.
    pub async fn await_converged(&self, timeout: Duration) {
        eventually(timeout, "all running nodes see exactly the running nodes up", || {
            std::future::ready(self.is_converged().then_some(()))
        })
        .await
    }
}

/// Node `i`'s address on the simulated network.
fn ip_of(i: usize) -> IpAddr {
    let host = u8::try_from(i + 1).expect("at most 254 simulated nodes");
    IpAddr::from([127, 0, 0, host])
}

/// The stepping thread's side: the runtimes and the clock they share.
struct World {
    /// The test's runtime.
    client: Runtime,
    /// Each node's runtime while it runs.
    runtimes: Vec<Option<Runtime>>,
    /// When (virtual time since the start) each paused node resumes.
    resumes_at: Vec<Option<Duration>>,
    tick: Duration,
    /// The instant every clock read when the run started.
    origin: std::time::Instant,
    /// Virtual time since the run started.
    elapsed: Duration,
    net: SimulatedNetwork,
    cluster: VirtualCluster,
    commands: mpsc::UnboundedReceiver<Command>,
}

impl World {
    fn new(
        tick: Duration,
        net: SimulatedNetwork,
        cluster: VirtualCluster,
        commands: mpsc::UnboundedReceiver<Command>,
    ) -> World {
        let client = paused_runtime();
        client.block_on(tokio::time::advance(HEADROOM));
        let origin = client.block_on(async { crate::clock::now() });
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        crate::clock::anchor_wall_clock(Some((wall, origin)));
        let runtimes = (0..cluster.len()).map(|_| None).collect();
        World {
            client,
            runtimes,
            resumes_at: vec![None; cluster.len()],
            tick,
            origin,
            elapsed: Duration::ZERO,
            net,
            cluster,
            commands,
        }
    }

    /// Every runtime runs what is ready and moves its clock on by one tick; then the test's
    /// commands are carried out.
    fn step(&mut self) {
        let tick = self.tick;
        for i in 0..self.runtimes.len() {
            match self.resumes_at[i] {
                Some(at) if at > self.elapsed => continue,
                Some(_) => self.resume(i),
                None => {}
            }
            if let Some(rt) = &self.runtimes[i] {
                rt.block_on(async { tokio::time::sleep(tick).await });
            }
        }
        self.client.block_on(async { tokio::time::sleep(tick).await });
        self.elapsed += self.tick;
        while let Ok(command) = self.commands.try_recv() {
            match command {
                Command::Start { i, config, done } => self.start(i, *config, done),
                Command::Crash { i, done } => {
                    self.crash(i);
                    let _ = done.send(());
                }
                Command::Pause { i, duration } => {
                    if self.runtimes.get(i).is_some_and(Option::is_some) {
                        let until = self.elapsed + duration;
                        self.resumes_at[i] = Some(self.resumes_at[i].map_or(until, |at| at.max(until)));
                    }
                }
            }
        }
    }

    /// A paused runtime whose clock reads the shared instant, less than a millisecond behind.
    ///
    /// Whole milliseconds only: tokio's timer counts milliseconds from where the runtime's
    /// clock started, and a clock moved off that grid sleeps a tick too long at every step (it
    /// would run at twice the others' pace).
    fn aligned_runtime(&self) -> Runtime {
        let rt = paused_runtime();
        let now = rt.block_on(async { crate::clock::now() });
        let behind =
            self.shared_now().checked_duration_since(now).expect("a new runtime's clock is behind the shared one");
        rt.block_on(tokio::time::advance(whole_millis(behind)));
        rt
    }

    /// Moves a paused node's clock on to the shared instant (what came due fires as it runs).
    fn resume(&mut self, i: usize) {
        self.resumes_at[i] = None;
        if let Some(rt) = &self.runtimes[i] {
            let now = rt.block_on(async { crate::clock::now() });
            let behind = self.shared_now().saturating_duration_since(now);
            rt.block_on(tokio::time::advance(whole_millis(behind)));
        }
    }

    /// The instant every clock reads between steps.
    fn shared_now(&self) -> std::time::Instant {
        self.origin + self.elapsed
    }

    /// Panics unless every runtime's clock is within a millisecond of the shared instant.
    fn assert_clocks_agree(&self) {
        let shared = self.shared_now();
        let running = |i: usize| self.resumes_at[i].is_none().then_some(self.runtimes[i].as_ref()).flatten();
        let clocks = (0..self.runtimes.len()).filter_map(|i| Some((format!("n{}", i + 1), running(i)?)));
        for (name, rt) in clocks.chain([("the test".to_string(), &self.client)]) {
            let now = rt.block_on(async { crate::clock::now() });
            let off = now.max(shared) - now.min(shared);
            assert!(off < Duration::from_millis(1), "{name}'s clock is {off:?} off the shared one");
        }
    }

    fn start(&mut self, i: usize, config: NodeConfig, done: oneshot::Sender<Result<()>>) {
        self.crash(i);
        self.assert_clocks_agree();
        let rt = self.aligned_runtime();
        let machine = Arc::new(self.net.machine(ip_of(i)));
        let builder = self.cluster.injector.builder(config).machine(machine);
        let (shared, handle) = (self.cluster.shared.clone(), rt.handle().clone());
        rt.spawn(async move {
            let started = builder.start().await.map(|node| {
                shared.nodes.lock().expect("nodes")[i] = Some((node, handle));
            });
            let _ = done.send(started);
        });
        self.runtimes[i] = Some(rt);
    }

    /// Drops node `i`'s runtime, and with it every task of the node.
    fn crash(&mut self, i: usize) {
        self.resumes_at[i] = None;
        let node = self.cluster.shared.nodes.lock().expect("nodes")[i].take();
        // Dropping the runtime waits for a commit in flight on its blocking pool, so the data
        // dir is closed when this returns.
        drop(self.runtimes[i].take());
        if let Some((node, _)) = node {
            node.mark_crashed();
        }
    }

    /// Ends the run: every node crashes (nothing graceful is owed to a finished test).
    fn stop(&mut self) {
        for i in 0..self.runtimes.len() {
            self.crash(i);
        }
    }
}

impl Drop for World {
    /// The thread's wall clock is the system's again, also when a run panicked.
    fn drop(&mut self) {
        crate::clock::anchor_wall_clock(None);
    }
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn paused_runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime")
}
