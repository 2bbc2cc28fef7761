//! Seeded random fault runs: crash / partition / messaging-only cut / heal / restart / leave on
//! a 5-node cluster under traffic, with remembered entities and the activation checker. One
//! scenario, two clusters: in-process nodes in real time on a multi-threaded runtime
//! (`TestCluster`, where a crash is a graceful stop), and whole nodes in virtual time
//! (`VirtualCluster`, where a crash drops every task of the node and what its disk writer had not
//! committed, and a run costs its CPU, not its timers). Every run must end with zero overlapping activations (acknowledged ids or not),
//! epochs that never go back, every acknowledged (hence remembered) entity id running again
//! without a message and then answering an ask with its own id, at least `MIN_ACKED` ids
//! acknowledged, and no ask error of a kind the faults cannot explain (counted by kind).
//!
//! The seed fixes the fault schedule (which fault, which nodes, how long between steps); thread
//! timing and the traffic interleaving still vary from run to run.
//!
//! - CI runs, in real time, seeds 1–3 and the seeds that found real bugs, 14 and 20; in virtual
//!   time, the first seeds of each shape in `VIRTUAL_SHAPES` (3, 5 and 7 nodes; virtual runs
//!   also draw pauses and one-way cuts) (`cargo test --test random_faults`).
//! - Soak: `DDSHARD_FAULT_SEEDS=200 cargo test --release --test random_faults real_time -- --nocapture`
//!   (seeds 1..=200; `DDSHARD_FAULT_SEED_START` moves the range, `DDSHARD_FAULT_STEPS` sets
//!   the faults per run, default 8); the same with `DDSHARD_VFAULT_*` and the filter
//!   `virtual_time` for the virtual-time runs, `DDSHARD_VFAULT_NODES=3|5|7` for one shape.
//! - Replay one: `DDSHARD_FAULT_SEED=<seed>` (or `DDSHARD_VFAULT_SEED`) with `-- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::testkit::{ActivationGuard, ActivationLog, FaultInjector, TestCluster, fast_downing, node_id};
use ddshard::{Durable, DurableEntity, Entity, EntityContext, Node, ShardRegion, ShardingSettings};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// Nodes of the real-time runs and of the virtual-time runs' main shape.
const NODES: usize = 5;
const IDS: usize = 40;

/// Crashes, leaves and partitions are only started while fewer than this many of `nodes` are
/// down (crashed, left, or stopped by downing): fewer than half, so a majority can remain.
/// Combined faults can still take more down — a 2|3 cut then a crash on the majority side
/// downs everyone — and the run then ends with a full-cluster restart from the durable state,
/// which the checks cover as well.
fn max_down(nodes: usize) -> usize {
    nodes.saturating_sub(1) / 2
}
const SETTLE: Duration = Duration::from_secs(60);

/// Records each activation from its start hook (remembered entities start without a message).
struct Tracked {
    log: ActivationLog,
    node: String,
    guard: Option<ActivationGuard>,
}

#[derive(Serialize, Deserialize)]
struct Touch;

impl Entity for Tracked {
    type Message = Touch;
    /// The entity's own id: the right entity answered.
    type Reply = String;
    async fn started(&mut self, ctx: &EntityContext) {
        self.guard = Some(self.log.started(ctx.entity_id(), &self.node, ctx.epoch()));
    }
    async fn handle(&mut self, _msg: Touch, ctx: &mut EntityContext) -> String {
        ctx.entity_id().to_string()
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 10,
        min_nr_of_members: 3,
        retry_interval: Duration::from_millis(400),
        rebalance_interval: Duration::from_millis(700),
        handoff_timeout: Duration::from_secs(10),
        shard_start_timeout: Duration::from_secs(2),
        remember: ddshard::sharding::RememberEntitiesSettings {
            enabled: true,
            slots: 4,
            ..ShardingSettings::default().remember
        },
        ..ShardingSettings::default()
    }
}

/// A ledger of applied operation ids, kept as durable state (written at a majority, fenced by
/// epoch, before the reply): every acknowledged `Apply` must be in it, once, after any faults.
struct Ledger;

#[derive(Clone, Serialize, Deserialize)]
enum LedgerMsg {
    Apply(u64),
    Read,
}

#[derive(Default, Serialize, Deserialize)]
struct LedgerState {
    ops: Vec<u64>,
}

impl DurableEntity for Ledger {
    type Message = LedgerMsg;
    /// `Read`: every applied operation; `Apply`: nothing.
    type Reply = Vec<u64>;
    type State = LedgerState;
    async fn handle(&mut self, state: &mut LedgerState, msg: LedgerMsg, ctx: &mut EntityContext) -> Vec<u64> {
        match msg {
            LedgerMsg::Apply(op) => {
                state.ops.push(op);
                ctx.persist();
                Vec::new()
            }
            LedgerMsg::Read => state.ops.clone(),
        }
    }
}

/// Ledger entities the durable workload writes to.
const LEDGERS: u64 = 20;

/// The regions of one node: the tracked entities and the ledgers.
#[derive(Clone)]
struct NodeRegions {
    tracked: ShardRegion<Tracked>,
    ledger: ShardRegion<Durable<Ledger>>,
}

async fn start_regions(n: Node, log: ActivationLog) -> NodeRegions {
    // The incarnation, so a zombie's activations are told from its successor's.
    let node = n.address().to_string();
    let tracked = n
        .sharding()
        .start("tracked", move |_: &str| Tracked { log: log.clone(), node: node.clone(), guard: None }, settings())
        .await
        .unwrap();
    let ledger_settings = ShardingSettings {
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: false, ..settings().remember },
        ..settings()
    };
    let ledger = n.sharding().start_durable("ledger", |_: &str| Ledger, ledger_settings).await.unwrap();
    NodeRegions { tracked, ledger }
}

/// What the scenario does to a cluster, in real time or in virtual time.
#[async_trait]
trait Faults: Send + Sync {
    /// How many nodes the cluster has (running or not).
    fn nodes(&self) -> usize;
    /// Node `i` if it runs and has not stopped.
    fn live(&self, i: usize) -> Option<Node>;
    /// The incarnation in slot `i` (running, or stopped by itself), as activations name it.
    fn incarnation(&self, i: usize) -> Option<String>;
    /// The switchboard of the cluster's links.
    fn injector(&self) -> &FaultInjector;
    fn partition(&self, a: &[usize], b: &[usize]) {
        self.injector().cut_indexes(a, b);
    }
    fn cut_messaging(&self, a: usize, b: usize) {
        self.injector().cut_messaging(&[node_id(a).as_str()], &[node_id(b).as_str()]);
    }
    fn cut_one_way(&self, from: usize, to: usize) {
        self.injector().cut_one_way(&node_id(from), &node_id(to));
    }
    fn heal(&self) {
        self.injector().heal_all();
    }
    fn is_converged(&self) -> bool;
    async fn await_converged(&self, timeout: Duration);
    async fn crash(&mut self, i: usize);
    /// Starts node `i` again on its data dir; `forming` a new cluster (no seeds).
    async fn restart(&mut self, i: usize, forming: bool);
    /// Starts the regions on node `i` (on that node's runtime).
    async fn start_regions(&self, i: usize, log: &ActivationLog) -> NodeRegions;
    async fn shutdown(&mut self);
    fn caller(&self) -> Caller;
    /// Whether the faults the real-time runs never had — pauses ([`Faults::pause`]) and
    /// one-way cuts — are drawn too (the real-time seeds keep the schedules they were found
    /// with).
    fn whole_node_faults(&self) -> bool;
    /// Pauses node `i` for `duration` (a stopped process).
    fn pause(&self, i: usize, duration: Duration);
}

/// In-process nodes in real time; a crash is a graceful stop (`TestCluster::kill`).
#[async_trait]
impl Faults for TestCluster {
    fn nodes(&self) -> usize {
        self.len()
    }
    fn live(&self, i: usize) -> Option<Node> {
        self.running().find(|(j, n)| *j == i && !n.is_shut_down()).map(|(_, n)| n.clone())
    }
    fn incarnation(&self, i: usize) -> Option<String> {
        self.running().find(|(j, _)| *j == i).map(|(_, n)| n.address().to_string())
    }
    fn injector(&self) -> &FaultInjector {
        TestCluster::injector(self)
    }
    fn is_converged(&self) -> bool {
        TestCluster::is_converged(self)
    }
    async fn await_converged(&self, timeout: Duration) {
        TestCluster::await_converged(self, timeout).await;
    }
    async fn crash(&mut self, i: usize) {
        self.kill(i).await;
    }
    async fn restart(&mut self, i: usize, forming: bool) {
        if forming { self.restart_forming(i).await } else { TestCluster::restart(self, i).await }.unwrap();
    }
    async fn start_regions(&self, i: usize, log: &ActivationLog) -> NodeRegions {
        start_regions(self.node(i).clone(), log.clone()).await
    }
    async fn shutdown(&mut self) {
        TestCluster::shutdown(self).await;
    }
    fn caller(&self) -> Caller {
        Caller::Here
    }
    fn whole_node_faults(&self) -> bool {
        false
    }
    fn pause(&self, _: usize, _: Duration) {
        unreachable!("in-process nodes in real time cannot be paused")
    }
}

/// Whole nodes in virtual time; a crash drops every task of the node.
#[async_trait]
impl Faults for VirtualCluster {
    fn nodes(&self) -> usize {
        self.len()
    }
    fn live(&self, i: usize) -> Option<Node> {
        self.node(i).filter(|n| !n.is_shut_down())
    }
    fn incarnation(&self, i: usize) -> Option<String> {
        self.node(i).map(|n| n.address().to_string())
    }
    fn injector(&self) -> &FaultInjector {
        VirtualCluster::injector(self)
    }
    fn is_converged(&self) -> bool {
        VirtualCluster::is_converged(self)
    }
    async fn await_converged(&self, timeout: Duration) {
        VirtualCluster::await_converged(self, timeout).await;
    }
    async fn crash(&mut self, i: usize) {
        VirtualCluster::crash(self, i).await;
    }
    async fn restart(&mut self, i: usize, forming: bool) {
        if forming { self.restart_forming(i).await } else { VirtualCluster::restart(self, i).await }.unwrap();
    }
    async fn start_regions(&self, i: usize, log: &ActivationLog) -> NodeRegions {
        let log = log.clone();
        self.on_node(i, move |n| start_regions(n, log)).await.expect("the node runs")
    }
    async fn shutdown(&mut self) {
        for i in 0..self.len() {
            VirtualCluster::crash(self, i).await;
        }
    }
    fn caller(&self) -> Caller {
        Caller::OnNode(self.clone())
    }
    fn whole_node_faults(&self) -> bool {
        true
    }
    fn pause(&self, i: usize, duration: Duration) {
        VirtualCluster::pause(self, i, duration);
    }
}

type Regions = Arc<Mutex<Vec<Option<NodeRegions>>>>;

#[derive(Debug)]
enum Fault {
    Crash(usize),
    Partition(Vec<usize>),
    /// Node-to-node messaging between two nodes is lost while gossip flows: both look
    /// reachable, so nobody is downed, but hand-offs, writes and asks between them fail.
    CutMessaging(usize, usize),
    Heal,
    Restart(usize),
    Leave(usize),
    /// Traffic (gossip and messaging) from the first node to the second is lost; the other way
    /// works.
    CutOneWay(usize, usize),
    /// The node stops running for a while (a stopped process, a long GC pause, a frozen VM),
    /// long enough to be found unreachable and perhaps downed, then goes on where it stood.
    Pause(usize, Duration),
    Quiet,
}

fn is_up(c: &impl Faults, i: usize) -> bool {
    c.live(i).is_some()
}

/// Picks the next fault from what the cluster's state allows.
fn next_fault(rng: &mut StdRng, c: &impl Faults, partitioned: bool) -> Fault {
    let max_down = max_down(c.nodes());
    let up: Vec<usize> = (0..c.nodes()).filter(|i| is_up(c, *i)).collect();
    let down: Vec<usize> = (0..c.nodes()).filter(|i| !is_up(c, *i)).collect();
    let mut options: Vec<u8> = vec![5]; // quiet
    if down.len() < max_down && up.len() > 1 {
        options.extend([0, 0]); // crash
        if !partitioned {
            options.extend([1, 1, 4]); // partition, leave
        }
    }
    if up.len() > 1 {
        options.push(6); // messaging-only cut
    }
    if partitioned {
        options.extend([2, 2, 2]); // heal
    }
    if !down.is_empty() {
        options.extend([3, 3]); // restart
    }
    if c.whole_node_faults() && up.len() > 1 {
        options.push(8); // one-way cut
        if down.len() < max_down {
            options.extend([7, 7]); // pause
        }
    }
    match *options.choose(rng).unwrap() {
        0 => Fault::Crash(*up.choose(rng).unwrap()),
        1 => {
            // A minority (or, with an even count, half) of the running nodes.
            let size = rng.random_range(1..=(up.len() / 2).min(max_down - down.len()));
            let mut side: Vec<usize> = up.sample(rng, size).copied().collect();
            side.sort();
            Fault::Partition(side)
        }
        2 => Fault::Heal,
        3 => Fault::Restart(*down.choose(rng).unwrap()),
        4 => Fault::Leave(*up.choose(rng).unwrap()),
        7 => Fault::Pause(*up.choose(rng).unwrap(), Duration::from_millis(rng.random_range(500..8000))),
        6 => {
            let pair: Vec<usize> = up.sample(rng, 2).copied().collect();
            Fault::CutMessaging(pair[0].min(pair[1]), pair[0].max(pair[1]))
        }
        8 => {
            let pair: Vec<usize> = up.sample(rng, 2).copied().collect();
            Fault::CutOneWay(pair[0], pair[1])
        }
        _ => Fault::Quiet,
    }
}

/// Concurrent traffic workers (an ask through an isolated node blocks its worker for the ask
/// timeout).
const WORKERS: u64 = 4;

/// Fewest distinct ids the recovered cluster must answer (of `IDS`), and so the fewest
/// acknowledged ids a run may end with: a run that serves almost nothing fails even if what
/// little it acknowledged survives. Counted after recovery, because a schedule may keep the
/// cluster without a majority for most of its faults (seed 152 of the soak: two crashes and a
/// partition), and then few acks during the faults are the right outcome.
const MIN_ACKED: usize = 30;

/// What the traffic workers share: the acknowledged ids, those answered after recovery and the ask
/// errors by kind.
#[derive(Clone, Default)]
struct Acks {
    ids: Arc<Mutex<BTreeSet<String>>>,
    /// Ids answered since the cluster converged after the faults (`None` before that).
    ids_after_recovery: Arc<Mutex<Option<BTreeSet<String>>>>,
    errors: Arc<Mutex<BTreeMap<String, u64>>>,
    unexplained: Arc<Mutex<BTreeSet<String>>>,
}

impl Acks {
    fn answered(&self, id: String) {
        if let Some(after) = self.ids_after_recovery.lock().unwrap().as_mut() {
            after.insert(id.clone());
        }
        self.ids.lock().unwrap().insert(id);
    }

    fn answered_after_recovery(&self) -> usize {
        self.ids_after_recovery.lock().unwrap().as_ref().map_or(0, BTreeSet::len)
    }
}

/// An ask error's kind, and whether crashes, partitions, cuts, restarts and leaves explain it.
/// A panic, a codec failure or a wrong type never comes from a fault: it is a bug.
fn error_kind(e: &ddshard::Error) -> (String, bool) {
    use ddshard::Error as E;
    match e {
        E::AskTimeout { .. } => ("AskTimeout".into(), true),
        E::BufferFull { .. } => ("BufferFull".into(), true),
        E::ShutDown => ("ShutDown".into(), true),
        E::PeerUnavailable { .. } => ("PeerUnavailable".into(), true),
        E::SendQueueFull { .. } => ("SendQueueFull".into(), true),
        E::RequestTimeout { .. } => ("RequestTimeout".into(), true),
        E::CoordinatorUnavailable(_) => ("CoordinatorUnavailable".into(), true),
        // A durable write without a majority, or refused as a zombie's: its outcome is unknown.
        E::StateNotPersisted { .. } => ("StateNotPersisted".into(), true),
        E::Fenced { .. } => ("Fenced".into(), true),
        E::NotDelivered { reason, .. } => {
            let explained = [
                "entity stopped",
                "its shard stopped",
                "entity is not running",
                "no reply",
                "not sent to",
                "shard is not hosted here",
                "the shard's home is not routable",
                "the entity's node ",
                "dropped during shard hand-off",
                "its shard moved on from the node it was sent to",
                "region buffer full",
                // Remember-entities: a remember write that found no majority during a partition.
                "its shard failed and restarts after shard_failure_backoff",
                // A restarted node receives a forwarded message before its region started.
                "this node does not host entities of this type",
            ];
            match explained.iter().find(|k| reason.starts_with(*k)) {
                Some(kind) => (format!("NotDelivered({})", kind.trim()), true),
                None => (format!("NotDelivered({reason})"), false),
            }
        }
        other => (format!("{other:?}"), false),
    }
}

/// Where an ask through a node's region runs: here (in-process nodes share the test's runtime),
/// or on that node's runtime, so the caller dies with its node as in a real process.
#[derive(Clone)]
enum Caller {
    Here,
    OnNode(VirtualCluster),
}

impl Caller {
    /// Runs `call` as a caller on node `i` (a caller whose node crashed gets `ShutDown`).
    async fn call<T, F, Fut>(&self, i: usize, call: F) -> Result<T, ddshard::Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, ddshard::Error>> + Send + 'static,
        T: Send + 'static,
    {
        match self {
            Caller::Here => call().await,
            Caller::OnNode(c) => c.on_node(i, move |_| call()).await.unwrap_or(Err(ddshard::Error::ShutDown)),
        }
    }

    async fn ask(&self, i: usize, region: ShardRegion<Tracked>, id: String) -> Result<String, ddshard::Error> {
        self.call(i, move || async move { region.ask_with_timeout(&id, Touch, Duration::from_secs(2)).await }).await
    }
}

async fn traffic(seed: u64, regions: Regions, caller: Caller, acks: Acks, stop: Arc<tokio::sync::Notify>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    loop {
        let id = format!("e{}", rng.random_range(0..IDS));
        let region = {
            let r = regions.lock().unwrap();
            let live: Vec<(usize, &ShardRegion<Tracked>)> =
                r.iter().enumerate().filter_map(|(i, r)| Some((i, &r.as_ref()?.tracked))).collect();
            live.choose(&mut rng).map(|(i, r)| (*i, (*r).clone()))
        };
        if let Some((i, region)) = region {
            let ask = caller.ask(i, region, id.clone());
            tokio::select! {
                _ = stop.notified() => return,
                r = ask => match r {
                    Ok(answer) => {
                        assert_eq!(answer, id, "the entity that answered is the one asked");
                        acks.answered(id);
                    }
                    Err(e) => {
                        let (kind, explained) = error_kind(&e);
                        if !explained {
                            acks.unexplained.lock().unwrap().insert(format!("{e}"));
                        }
                        *acks.errors.lock().unwrap().entry(kind).or_default() += 1;
                    }
                },
            }
        }
        tokio::select! {
            _ = stop.notified() => return,
            _ = tokio::time::sleep(Duration::from_millis(rng.random_range(5..40))) => {}
        }
    }
}

/// Crashes node `i`; its activations end with its process.
async fn crash(c: &mut impl Faults, i: usize, log: &ActivationLog) {
    let incarnation = c.incarnation(i);
    c.crash(i).await;
    if let Some(incarnation) = incarnation {
        log.node_died(&incarnation);
    }
}

/// Incarnations that were paused, with when (wall clock) the pause began, once their peers
/// downed or removed them: zombies until they learn so.
type Zombies = Arc<Mutex<BTreeMap<String, std::time::SystemTime>>>;

/// Records node `i`'s incarnation in `zombies` if a peer sees it downed or removed from now on.
fn watch_downing(c: &impl Faults, i: usize, zombies: &Zombies) {
    let Some(incarnation) = c.incarnation(i) else { return };
    let paused_at = std::time::UNIX_EPOCH + Duration::from_millis(ddshard::clock::wall_ms());
    for peer in (0..c.nodes()).filter(|j| *j != i).filter_map(|j| c.live(j)) {
        let (mut members, zombies, incarnation) = (peer.watch_membership(), zombies.clone(), incarnation.clone());
        tokio::spawn(async move {
            loop {
                let cut_out = {
                    let view = members.borrow_and_update();
                    view.members
                        .iter()
                        .find(|m| m.address().to_string() == incarnation)
                        .is_none_or(|m| m.status() == ddshard::MemberStatus::Down)
                };
                if cut_out {
                    // The earliest pause counts (a paused node paused again stays one zombie).
                    let mut zombies = zombies.lock().unwrap();
                    let since = zombies.entry(incarnation).or_insert(paused_at);
                    *since = (*since).min(paused_at);
                    return;
                }
                if members.changed().await.is_err() {
                    return; // the peer stopped
                }
            }
        });
    }
}

/// Overlapping activations of one id on two incarnations, and epochs going back: violations,
/// but for those a zombie explains (one side is an incarnation paused before the later start
/// and then downed by its peers: without a lease nothing stops a frozen process from running
/// again before it learns so; with durable state the promise is the fence, not this), counted.
fn overlaps(
    acts: &[ddshard::testkit::Activation],
    zombies: &BTreeMap<String, std::time::SystemTime>,
) -> (Vec<String>, usize) {
    let mut by_id: BTreeMap<&str, Vec<&ddshard::testkit::Activation>> = BTreeMap::new();
    for a in acts {
        by_id.entry(&a.entity_id).or_default().push(a);
    }
    let (mut violations, mut excused) = (Vec::new(), 0);
    for (id, mut acts) in by_id {
        acts.sort_by_key(|a| a.start);
        for (k, b) in acts.iter().enumerate() {
            for (j, a) in acts[..k].iter().enumerate() {
                let overlap = a.node != b.node && a.stop.is_none_or(|stop| stop > b.start);
                // Epochs only against the activation just before.
                let epoch_back = j + 1 == k && (b.epoch < a.epoch || (b.node != a.node && b.epoch == a.epoch));
                if !(overlap || epoch_back) {
                    continue;
                }
                let zombie =
                    [&a.node, &b.node].iter().any(|n| zombies.get(*n).is_some_and(|paused| *paused <= b.start));
                if zombie {
                    excused += 1;
                } else if overlap {
                    violations.push(format!(
                        "{id}: activation on {} (epoch {}) still live when {} (epoch {}) started",
                        a.node, a.epoch, b.node, b.epoch
                    ));
                } else {
                    violations
                        .push(format!("{id}: epoch went from {} on {} to {} on {}", a.epoch, a.node, b.epoch, b.node));
                }
            }
        }
    }
    (violations, excused)
}

async fn restart(c: &mut impl Faults, i: usize, regions: &Regions, log: &ActivationLog) {
    regions.lock().unwrap()[i] = None;
    // With no Up member left anywhere, the remaining nodes only wait for each other: the first
    // one back forms the cluster anew (from the durable state on its disk).
    let forming = (0..c.nodes()).filter_map(|j| c.live(j)).all(|n| !TestCluster::is_member(&n));
    crash(c, i, log).await;
    c.restart(i, forming).await;
    let r = c.start_regions(i, log).await;
    regions.lock().unwrap()[i] = Some(r);
}

/// Shards and entities hosted per running node (for the run's log).
async fn shards_per_node(regions: &Regions) -> Vec<(String, usize, usize)> {
    let all: Vec<(usize, ShardRegion<Tracked>)> = regions
        .lock()
        .unwrap()
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((i, r.as_ref()?.tracked.clone())))
        .collect();
    let mut out = Vec::new();
    for (i, r) in all {
        if let Ok(state) = r.region_state().await {
            out.push((TestCluster::node_id(i), state.len(), state.values().map(Vec::len).sum()));
        }
    }
    out
}

/// Workers writing to the ledgers.
const LEDGER_WORKERS: u64 = 2;

/// Fewest ledger writes the recovered cluster must acknowledge (counted after recovery, like
/// `MIN_ACKED`).
const MIN_LEDGER_ACKS: usize = 20;

/// The acknowledged ledger writes (ledger id → operations), shared by the ledger workers.
#[derive(Clone, Default)]
struct LedgerAcks {
    ops: Arc<Mutex<BTreeMap<String, BTreeSet<u64>>>>,
    unexplained: Arc<Mutex<BTreeSet<String>>>,
}

impl LedgerAcks {
    fn count(&self) -> usize {
        self.ops.lock().unwrap().values().map(BTreeSet::len).sum()
    }
}

/// Applies unique operations to random ledgers through random live regions, never retrying
/// one (an operation is applied at most once by the client, so the ledger must hold each
/// acknowledged one exactly once).
async fn ledger_traffic(
    seed: u64,
    worker: u64,
    regions: Regions,
    caller: Caller,
    acks: LedgerAcks,
    stop: Arc<tokio::sync::Notify>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x1ed9e5);
    for n in 0u64.. {
        let (id, op) = (format!("l{}", rng.random_range(0..LEDGERS)), (worker << 32) | n);
        let region = {
            let r = regions.lock().unwrap();
            let live: Vec<(usize, &ShardRegion<Durable<Ledger>>)> =
                r.iter().enumerate().filter_map(|(i, r)| Some((i, &r.as_ref()?.ledger))).collect();
            live.choose(&mut rng).map(|(i, r)| (*i, (*r).clone()))
        };
        if let Some((i, region)) = region {
            let ledger = id.clone();
            let apply = caller.call(i, move || async move {
                region.ask_with_timeout(&ledger, LedgerMsg::Apply(op), Duration::from_secs(2)).await
            });
            tokio::select! {
                _ = stop.notified() => return,
                r = apply => match r {
                    Ok(_) => {
                        acks.ops.lock().unwrap().entry(id).or_default().insert(op);
                    }
                    Err(e) => {
                        if !error_kind(&e).1 {
                            acks.unexplained.lock().unwrap().insert(format!("{e}"));
                        }
                    }
                },
            }
        }
        tokio::select! {
            _ = stop.notified() => return,
            _ = tokio::time::sleep(Duration::from_millis(rng.random_range(5..40))) => {}
        }
    }
}

/// Every acknowledged ledger write is in its ledger, and no operation is in one twice; returns
/// how many acknowledged writes were checked.
async fn check_ledgers(
    seed: u64,
    ledgers: &[(usize, ShardRegion<Durable<Ledger>>)],
    caller: &Caller,
    acks: &LedgerAcks,
) -> usize {
    let unexplained = acks.unexplained.lock().unwrap().clone();
    assert!(unexplained.is_empty(), "seed {seed}: ledger write errors no fault explains: {unexplained:?}");
    let acked = acks.ops.lock().unwrap().clone();
    let deadline = tokio::time::Instant::now() + SETTLE;
    for (k, (id, ops)) in acked.iter().enumerate() {
        let (i, region) = ledgers[k % ledgers.len()].clone();
        let held = loop {
            let (region, ledger) = (region.clone(), id.clone());
            let read = caller.call(i, move || async move {
                region.ask_with_timeout(&ledger, LedgerMsg::Read, Duration::from_secs(2)).await
            });
            match read.await {
                Ok(held) => break held,
                Err(e) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "seed {seed}: ledger {id} does not answer after recovery: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let distinct: BTreeSet<u64> = held.iter().copied().collect();
        assert_eq!(distinct.len(), held.len(), "seed {seed}: ledger {id} applied an operation twice: {held:?}");
        let lost: Vec<&u64> = ops.iter().filter(|op| !distinct.contains(op)).collect();
        assert!(lost.is_empty(), "seed {seed}: ledger {id} lost acknowledged writes {lost:?} (holds {held:?})");
    }
    acked.values().map(BTreeSet::len).sum()
}

async fn run_seed(seed: u64, steps: usize, mut c: impl Faults) {
    let nodes = c.nodes();
    println!("seed {seed}: {nodes} nodes, {steps} faults");
    let mut rng = StdRng::seed_from_u64(seed);
    c.await_converged(SETTLE).await;
    let log = ActivationLog::new();
    let regions: Regions = Arc::new(Mutex::new(vec![None; nodes]));
    for i in 0..nodes {
        let r = c.start_regions(i, &log).await;
        regions.lock().unwrap()[i] = Some(r);
    }
    let acks = Acks::default();
    let ledger_acks = LedgerAcks::default();
    let zombies = Zombies::default();
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(traffic(seed * WORKERS + w, regions.clone(), c.caller(), acks.clone(), stop.clone())))
        .collect();
    workers.extend((0..LEDGER_WORKERS).map(|w| {
        let seed = seed * LEDGER_WORKERS + w;
        tokio::spawn(ledger_traffic(seed, w, regions.clone(), c.caller(), ledger_acks.clone(), stop.clone()))
    }));

    let mut partitioned = false;
    for step in 0..steps {
        let pause = Duration::from_millis(rng.random_range(200..4000));
        let fault = next_fault(&mut rng, &c, partitioned);
        println!("seed {seed} step {step}: {fault:?}, then {pause:?}");
        match fault {
            Fault::Crash(i) => {
                regions.lock().unwrap()[i] = None;
                crash(&mut c, i, &log).await;
            }
            Fault::Partition(side) => {
                let rest: Vec<usize> = (0..nodes).filter(|i| !side.contains(i)).collect();
                c.partition(&side, &rest);
                partitioned = true;
            }
            Fault::CutMessaging(a, b) => {
                c.cut_messaging(a, b);
                partitioned = true;
            }
            Fault::Heal => {
                c.heal();
                partitioned = false;
            }
            Fault::Restart(i) => restart(&mut c, i, &regions, &log).await,
            Fault::Leave(i) => {
                regions.lock().unwrap()[i] = None;
                let node = c.live(i).expect("a leave is picked among running nodes");
                let left = tokio::time::timeout(Duration::from_secs(60), node.leave())
                    .await
                    .unwrap_or_else(|_| panic!("seed {seed}: n{} did not leave within 60 s", i + 1));
                match left {
                    Ok(()) => {}
                    // Asked while paused: its peers downed it meanwhile, and it stopped.
                    Err(ddshard::Error::ShutDown) if node.stop_reason().is_some() => {
                        println!(
                            "seed {seed} step {step}: n{} stopped before it left: {:?}",
                            i + 1,
                            node.stop_reason()
                        );
                    }
                    Err(e) => panic!("seed {seed}: n{} failed to leave: {e}", i + 1),
                }
                crash(&mut c, i, &log).await;
            }
            Fault::CutOneWay(from, to) => {
                c.cut_one_way(from, to);
                partitioned = true;
            }
            Fault::Pause(i, duration) => {
                watch_downing(&c, i, &zombies);
                c.pause(i, duration);
            }
            Fault::Quiet => {}
        }
        tokio::time::sleep(pause).await;
        println!("seed {seed} step {step}: shards per node {:?}", shards_per_node(&regions).await);
        // Downed nodes stop themselves; their regions are gone.
        for i in 0..nodes {
            if !is_up(&c, i) {
                regions.lock().unwrap()[i] = None;
            }
        }
    }

    // Heal, let pending downing decisions land, bring every node back, and converge. A node
    // still joining after that (its seeds died meanwhile) restarts too.
    c.heal();
    // Settled: every node still running sees no unreachable and no Down member (a node the
    // others downed while cut has heard it and stopped). Not reaching it is fine: the rounds
    // below restart whatever is left behind.
    let settle = tokio::time::Instant::now() + Duration::from_secs(20);
    let settled = |c: &dyn Faults| {
        (0..nodes)
            .filter_map(|i| c.live(i))
            .all(|n| n.members().iter().all(|m| m.is_reachable() && m.status() != ddshard::MemberStatus::Down))
    };
    while !settled(&c) && tokio::time::Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0.. {
        for i in 0..nodes {
            if c.live(i).is_none_or(|n| round > 0 && !TestCluster::is_member(&n)) {
                restart(&mut c, i, &regions, &log).await;
            }
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !c.is_converged() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if c.is_converged() && (0..nodes).all(|i| is_up(&c, i)) {
            break;
        }
        assert!(round < 3, "seed {seed}: the cluster did not converge after healing and restarting");
    }
    // A converged cluster serves: it answers at least `MIN_ACKED` distinct ids (a run whose
    // faults took every node down early may have answered few before).
    *acks.ids_after_recovery.lock().unwrap() = Some(BTreeSet::new());
    let ledger_writes_before = ledger_acks.count();
    let serve = tokio::time::Instant::now() + SETTLE;
    while acks.answered_after_recovery() < MIN_ACKED || ledger_acks.count() < ledger_writes_before + MIN_LEDGER_ACKS {
        assert!(
            tokio::time::Instant::now() < serve,
            "seed {seed}: the converged cluster acknowledged only {} ledger writes in {SETTLE:?} (floor {MIN_LEDGER_ACKS})",
            ledger_acks.count() - ledger_writes_before
        );
        assert!(
            tokio::time::Instant::now() < serve,
            "seed {seed}: the converged cluster answered only {} distinct ids in {SETTLE:?} (floor {MIN_ACKED} of \
             {IDS}); errors {:?}",
            acks.answered_after_recovery(),
            acks.errors.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.notify_waiters();
    for w in workers {
        w.abort();
        // A worker that panicked (a wrong answer) fails the run; an aborted one is fine.
        if let Err(e) = w.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    // Every acknowledged id runs again, once, without any further message.
    let acked: BTreeSet<String> = acks.ids.lock().unwrap().clone();
    let all: Vec<(usize, ShardRegion<Tracked>)> = regions
        .lock()
        .unwrap()
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((i, r.as_ref()?.tracked.clone())))
        .collect();
    let ledgers: Vec<(usize, ShardRegion<Durable<Ledger>>)> =
        regions.lock().unwrap().iter().enumerate().filter_map(|(i, r)| Some((i, r.as_ref()?.ledger.clone()))).collect();
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        // id -> nodes running it, from every region's state (no message to any entity).
        let mut hosts: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        let mut unanswered = Vec::new();
        for (i, r) in &all {
            match r.region_state().await {
                Ok(state) => {
                    for id in state.into_values().flatten() {
                        hosts.entry(id).or_default().push(TestCluster::node_id(*i));
                    }
                }
                Err(e) => unanswered.push(format!("{}: {e}", TestCluster::node_id(*i))),
            }
        }
        let twice: Vec<(&String, &Vec<String>)> = hosts.iter().filter(|(_, h)| h.len() > 1).collect();
        let lost: Vec<&String> = acked.iter().filter(|id| !hosts.contains_key(*id)).collect();
        if unanswered.is_empty() && twice.is_empty() && lost.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            let overlaps = log.check().err().unwrap_or_default();
            panic!(
                "seed {seed}: after {SETTLE:?}: lost acknowledged ids {lost:?}; ids running on two nodes {twice:?}; \
                 regions not answering {unanswered:?}; overlapping activations so far {overlaps:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Then every acknowledged id answers an ask, with its own id (retried until the deadline:
    // a shard may still be moving after the recovery).
    let deadline = tokio::time::Instant::now() + SETTLE;
    for (k, id) in acked.iter().enumerate() {
        let (_, region) = &all[k % all.len()];
        loop {
            match region.ask_with_timeout(id, Touch, Duration::from_secs(2)).await {
                Ok(answer) => {
                    assert_eq!(&answer, id, "seed {seed}: the entity that answered is the one asked");
                    break;
                }
                Err(e) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "seed {seed}: acknowledged id {id} does not answer after recovery: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    let applied = check_ledgers(seed, &ledgers, &c.caller(), &ledger_acks).await;
    c.shutdown().await;
    let (violations, zombie_overlaps) = overlaps(&log.activations(), &zombies.lock().unwrap());
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violations (any id, acknowledged or not): {violations:#?}",
        violations.len()
    );
    let errors = acks.errors.lock().unwrap().clone();
    println!("seed {seed}: ask errors by kind during the faults {errors:?}");
    let unexplained = acks.unexplained.lock().unwrap().clone();
    assert!(unexplained.is_empty(), "seed {seed}: ask errors no fault explains: {unexplained:?} (all: {errors:?})");
    assert!(
        acked.len() >= MIN_ACKED,
        "seed {seed}: only {} ids acknowledged (floor {MIN_ACKED} of {IDS}); errors {errors:?}",
        acked.len()
    );
    let mut per_node = std::collections::BTreeMap::new();
    for a in log.activations() {
        let id = a.node.split('#').next().unwrap_or_default().to_string();
        *per_node.entry(id).or_insert(0) += 1;
    }
    println!(
        "seed {seed}: ok, {} acknowledged ids; {applied} acknowledged ledger writes all kept once; activations per \
         node {per_node:?}; zombie overlaps {zombie_overlaps}",
        acked.len()
    );
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name} must be a number, got {v:?}")))
}

/// The seeds a run covers: `<prefix>_SEED` alone, or `<prefix>_SEEDS` from `<prefix>_SEED_START`
/// (default 1), or `ci`.
fn seeds(prefix: &str, ci: Vec<u64>) -> Vec<u64> {
    match (env_u64(&format!("{prefix}_SEED")), env_u64(&format!("{prefix}_SEEDS"))) {
        (Some(one), _) => vec![one],
        (None, Some(n)) => {
            let start = env_u64(&format!("{prefix}_SEED_START")).unwrap_or(1);
            (start..start + n).collect()
        }
        (None, None) => ci,
    }
}

/// The panic message of a failed run.
fn why(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Fails with every failed seed and how to replay it (a soak runs all seeds, not to the first).
fn report(failed: &[(u64, String)], prefix: &str, filter: &str) {
    if !failed.is_empty() {
        let lines: Vec<String> = failed
            .iter()
            .map(|(seed, why)| {
                format!("seed {seed}: {why}\n  replay: {prefix}_SEED={seed} cargo test --test random_faults {filter} -- --nocapture")
            })
            .collect();
        panic!("{} random fault run(s) failed:\n{}", failed.len(), lines.join("\n"));
    }
}

fn steps(prefix: &str) -> usize {
    env_u64(&format!("{prefix}_STEPS")).unwrap_or(8) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_time_random_crash_partition_heal_restart_leave_sequences_keep_one_activation_per_id_and_lose_no_remembered_id()
 {
    let steps = steps("DDSHARD_FAULT");
    // 14 and 20 found real bugs (a hand-off race and the coordinator starting after it was no
    // longer oldest).
    let mut failed = Vec::new();
    for seed in seeds("DDSHARD_FAULT", vec![1, 2, 3, 14, 20]) {
        let run = tokio::spawn(async move {
            let c = TestCluster::start_with(NODES, |_, cfg| fast_downing(cfg)).await.unwrap();
            run_seed(seed, steps, c).await;
        });
        if let Err(e) = run.await {
            let why = e.try_into_panic().map(why).unwrap_or_default();
            println!("seed {seed}: FAILED: {why}");
            failed.push((seed, why));
        }
    }
    report(&failed, "DDSHARD_FAULT", "real_time");
}

/// The virtual-time shapes (node counts) and the seeds CI runs of each; `DDSHARD_VFAULT_NODES`
/// picks one shape for a soak.
const VIRTUAL_SHAPES: [(usize, u64); 3] = [(3, 6), (NODES, 16), (7, 6)];

#[test]
fn virtual_time_random_crash_partition_pause_one_way_cut_heal_restart_leave_sequences_keep_one_activation_per_id_and_lose_no_remembered_id_or_durable_write()
 {
    let steps = steps("DDSHARD_VFAULT");
    let only = env_u64("DDSHARD_VFAULT_NODES").map(|n| n as usize);
    let mut failed = Vec::new();
    for (nodes, ci_seeds) in VIRTUAL_SHAPES.into_iter().filter(|(n, _)| only.is_none_or(|o| o == *n)) {
        for seed in seeds("DDSHARD_VFAULT", (1..=ci_seeds).collect()) {
            let real = std::time::Instant::now();
            let run = std::panic::catch_unwind(|| {
                VirtualRun::new(nodes)
                    .configure(|_, cfg| fast_downing(cfg))
                    .time_limit(Duration::from_secs(1800))
                    .run(move |c| run_seed(seed, steps, c))
            });
            println!("seed {seed} ({nodes} nodes): {:?} of real time", real.elapsed());
            if let Err(panic) = run {
                let why = why(panic);
                println!("seed {seed} ({nodes} nodes): FAILED: {why}");
                failed.push((seed, format!("{nodes} nodes (DDSHARD_VFAULT_NODES={nodes}): {why}")));
            }
        }
    }
    report(&failed, "DDSHARD_VFAULT", "virtual_time");
}
