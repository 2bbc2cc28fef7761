//! In-process test clusters with fault injection (feature `testkit`).
//!
//! A [`FaultInjector`] shared by the nodes of one process cuts directed links between node ids,
//! for gossip (UDP) and messaging (TCP) alike; [`TestCluster`] starts N nodes on loopback with
//! temporary data dirs, kills them abruptly and restarts them on the same data dir as a new
//! incarnation. [`process`] runs `ddshard node` as real processes (for SIGKILL tests, network
//! namespaces and fail-over benches).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use chitchat::ChitchatEnvelope;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket};
use tempfile::TempDir;

use crate::config::NodeConfig;
use crate::error::Result;
use crate::membership::MemberStatus;
use crate::node::Node;

pub mod dns;
mod ports;
pub mod process;
pub mod sim;
pub mod virtual_time;

pub use crate::activation::{Activation, ActivationGuard, ActivationLog, check_activations};
pub use ports::unused_port;

#[derive(Debug, Default)]
struct FaultState {
    owner_of_addr: HashMap<SocketAddr, String>,
    cut: HashSet<(String, String)>,
    messaging_cut: HashSet<(String, String)>,
}

/// Shared switchboard of cut links between node ids.
#[derive(Debug, Clone, Default)]
pub struct FaultInjector {
    state: Arc<RwLock<FaultState>>,
    /// Whether any link is cut: checked first, so a cluster with every link up pays one atomic
    /// load per check instead of a lock and two `String`s (this filter runs on every batch).
    any_cut: Arc<std::sync::atomic::AtomicBool>,
}

impl FaultInjector {
    /// A switchboard with every link up.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a node whose messaging and gossip go through this switchboard.
    pub async fn start_node(&self, config: NodeConfig) -> Result<Node> {
        self.builder(config).start().await
    }

    /// A builder for a node whose messaging and gossip go through this switchboard.
    pub(crate) fn builder(&self, config: NodeConfig) -> crate::node::NodeBuilder {
        let injector = self.clone();
        let wrap: crate::membership::GossipSocketWrapper = Arc::new(move |socket, address, gossip_addr| {
            // Only the UDP address: messaging is cut by node id, and a TCP port may carry the
            // same number as another node's UDP port.
            injector.register_gossip_addr(&address.node_id, gossip_addr);
            Box::new(FaultySocket::new(socket, address.node_id.clone(), injector.clone()))
        });
        Node::builder(config).link_filter(Arc::new(self.clone())).gossip_socket(wrap)
    }

    /// Records which node owns a gossip (UDP) address; a later owner of the same address (a
    /// restarted node that got a freed port) replaces the earlier one.
    pub(crate) fn register_gossip_addr(&self, node_id: &str, addr: SocketAddr) {
        self.state.write().expect("fault state").owner_of_addr.insert(addr, node_id.to_string());
    }

    /// Cuts every link between a node of `a` and a node of `b`, both directions.
    pub fn cut(&self, a: &[&str], b: &[&str]) {
        cut_both_ways(&mut self.state.write().expect("fault state").cut, a, b);
        self.any_cut.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Cuts node-to-node messaging (TCP) only, both directions, while gossip keeps flowing:
    /// peers stay "reachable" but messages are lost, as on a half-broken network.
    pub fn cut_messaging(&self, a: &[&str], b: &[&str]) {
        cut_both_ways(&mut self.state.write().expect("fault state").messaging_cut, a, b);
        self.any_cut.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Cuts every link between a node of indexes `a` and a node of indexes `b` (named by
    /// [`node_id`]), both directions.
    pub fn cut_indexes(&self, a: &[usize], b: &[usize]) {
        let (a, b) =
            (a.iter().map(|i| node_id(*i)).collect::<Vec<_>>(), b.iter().map(|i| node_id(*i)).collect::<Vec<_>>());
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let b: Vec<&str> = b.iter().map(String::as_str).collect();
        self.cut(&a, &b);
    }

    /// Cuts traffic from `from` to `to` only.
    pub fn cut_one_way(&self, from: &str, to: &str) {
        self.state.write().expect("fault state").cut.insert((from.to_string(), to.to_string()));
        self.any_cut.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Restores every link.
    pub fn heal_all(&self) {
        let mut s = self.state.write().expect("fault state");
        s.cut.clear();
        s.messaging_cut.clear();
        // Under the write lock: a concurrent cut sets it again after this.
        self.any_cut.store(false, std::sync::atomic::Ordering::Release);
    }

    /// Whether messaging from `from` to `to` is cut.
    pub fn is_messaging_cut(&self, from: &str, to: &str) -> bool {
        if !self.any_cut.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let s = self.state.read().expect("fault state");
        let link = (from.to_string(), to.to_string());
        s.cut.contains(&link) || s.messaging_cut.contains(&link)
    }

    fn is_cut_to_addr(&self, from: &str, to: SocketAddr) -> bool {
        let s = self.state.read().expect("fault state");
        s.owner_of_addr.get(&to).is_some_and(|owner| s.cut.contains(&(from.to_string(), owner.clone())))
    }

    fn is_cut_from_addr(&self, from: SocketAddr, to: &str) -> bool {
        let s = self.state.read().expect("fault state");
        s.owner_of_addr.get(&from).is_some_and(|owner| s.cut.contains(&(owner.clone(), to.to_string())))
    }
}

impl crate::transport::LinkFilter for FaultInjector {
    fn allows(&self, from: &str, to: &str) -> bool {
        !self.is_messaging_cut(from, to)
    }
}

fn cut_both_ways(links: &mut HashSet<(String, String)>, a: &[&str], b: &[&str]) {
    for x in a {
        for y in b {
            links.insert((x.to_string(), y.to_string()));
            links.insert((y.to_string(), x.to_string()));
        }
    }
}

/// A chitchat socket that drops datagrams on cut links.
pub(crate) struct FaultySocket {
    inner: Box<dyn Socket>,
    node_id: Arc<str>,
    injector: FaultInjector,
}

impl FaultySocket {
    pub(crate) fn new(inner: Box<dyn Socket>, node_id: Arc<str>, injector: FaultInjector) -> Self {
        FaultySocket { inner, node_id, injector }
    }
}

#[async_trait]
impl Socket for FaultySocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        self.inner.local_addr()
    }

    async fn send(&mut self, to: SocketAddr, envelope: ChitchatEnvelope) -> anyhow::Result<SendOutcome> {
        if self.injector.is_cut_to_addr(&self.node_id, to) {
            return Ok(SendOutcome { num_bytes_sent: 0 });
        }
        self.inner.send(to, envelope).await
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            let r = self.inner.recv().await?;
            if !self.injector.is_cut_from_addr(r.from_addr, &self.node_id) {
                return Ok(r);
            }
        }
    }
}

/// The slot among `slots` that an entity id's remembered start and durable state are stored
/// in (what the library stores by), for tests that aim ids at one slot.
pub fn remembered_slot(entity_id: &str, slots: u32) -> u32 {
    crate::sharding::ids::remembered_slot(entity_id, slots)
}

/// The body of a region-to-region `Deliver` as a peer sends it on the topic `region/<type>`:
/// for tests that forge broken or hostile messages (the wire protocol itself is crate-private).
pub fn forged_deliver(shard: &str, entity_id: &str, payload: Vec<u8>) -> Vec<u8> {
    use crate::sharding::protocol::{RegionInbound, RegionToRegion};
    let msg = RegionInbound::Region(RegionToRegion::Deliver {
        shard: shard.into(),
        entity_id: entity_id.into(),
        payload,
        reply_to: None,
        epoch: 0,
    });
    crate::transport::wire::encode(&msg).expect("a Deliver encodes").to_vec()
}

/// The node id test clusters give node index `i`: `n1`, `n2`, …
pub fn node_id(i: usize) -> String {
    format!("n{}", i + 1)
}

/// The seeds a node starting beside `nodes` joins through: the running ones that are Up
/// members (a node that is itself still joining cannot let anyone in), else every running one
/// (they are all starting up).
fn seeds_among<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> Vec<crate::config::SeedAddr> {
    let running: Vec<&Node> = nodes.into_iter().filter(|n| !n.is_shut_down()).collect();
    let up: Vec<&Node> = running.iter().copied().filter(|n| TestCluster::is_member(n)).collect();
    if up.is_empty() { running } else { up }.into_iter().map(|n| n.gossip_addr().into()).collect()
}

/// Whether each of `nodes` lists exactly `nodes` as members, all Up and reachable.
fn converged(nodes: &[&Node]) -> bool {
    let mut expected: Vec<&str> = nodes.iter().map(|n| n.node_id()).collect();
    expected.sort_unstable();
    nodes.iter().all(|n| {
        let members = n.members();
        let mut ids: Vec<&str> = members.iter().map(|m| m.node_id()).collect();
        ids.sort_unstable();
        ids == expected && members.iter().all(|m| m.status() == MemberStatus::Up && m.is_reachable())
    })
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Logs through the test harness (shown for failing tests only), filtered by `RUST_LOG`
/// (errors only when unset); `DDSHARD_TEST_LOG=stderr` writes straight to stderr instead.
pub fn init_test_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = if std::env::var("DDSHARD_TEST_LOG").as_deref() == Ok("stderr") {
        builder.with_writer(std::io::stderr).try_init()
    } else {
        builder.with_test_writer().try_init()
    };
}

/// Settings that suit in-process clusters on a small, loaded machine.
pub fn test_config(node_id: &str, data_dir: &std::path::Path, cluster_id: &str) -> NodeConfig {
    let mut c = NodeConfig {
        node_id: node_id.to_string(),
        cluster_id: cluster_id.to_string(),
        data_dir: data_dir.to_path_buf(),
        ..NodeConfig::default()
    };
    c.replicator.gossip_interval = Duration::from_millis(200);
    c.replicator.lmdb_map_size = 64 << 20;
    c.membership.leave_linger = Duration::from_millis(800);
    // Tests that cut links decide themselves when to down; failover tests opt in.
    c.membership.downing = crate::config::DowningStrategy::Off;
    c
}

/// Keep-majority downing with short timers, for failover tests.
pub fn fast_downing(c: &mut NodeConfig) {
    c.membership.downing = crate::config::DowningStrategy::KeepMajority;
    c.membership.stable_after = Duration::from_millis(1500);
    c.membership.down_removal_margin = Duration::from_millis(1000);
}

/// Hook that changes node `i`'s configuration before it starts.
type Customize = dyn Fn(usize, &mut NodeConfig) + Send + Sync;

/// N nodes in this process, on loopback, sharing one [`FaultInjector`].
pub struct TestCluster {
    nodes: Vec<Option<Node>>,
    dirs: Vec<TempDir>,
    injector: FaultInjector,
    cluster_id: String,
    customize: Arc<Customize>,
}

impl TestCluster {
    /// Starts `n` nodes `n1..=nN`; `n1` forms the cluster, the others join through it.
    pub async fn start(n: usize) -> Result<TestCluster> {
        Self::start_with(n, |_, _| {}).await
    }

    /// Like [`TestCluster::start`], with a hook to change each node's config (index from 0).
    pub async fn start_with(
        n: usize,
        customize: impl Fn(usize, &mut NodeConfig) + Send + Sync + 'static,
    ) -> Result<TestCluster> {
        init_test_tracing();
        let mut c = TestCluster {
            nodes: Vec::new(),
            dirs: Vec::new(),
            injector: FaultInjector::new(),
            cluster_id: "test-cluster".into(),
            customize: Arc::new(customize),
        };
        for _ in 0..n {
            c.add_node().await?;
        }
        Ok(c)
    }

    /// Node id of index `i`.
    pub fn node_id(i: usize) -> String {
        node_id(i)
    }

    fn config_for(&self, i: usize) -> NodeConfig {
        let mut cfg = test_config(&Self::node_id(i), self.dirs[i].path(), &self.cluster_id);
        cfg.seeds = seeds_among(self.nodes.iter().flatten());
        (self.customize)(i, &mut cfg);
        cfg
    }

    /// Starts one more node; returns its index.
    pub async fn add_node(&mut self) -> Result<usize> {
        let i = self.nodes.len();
        self.dirs.push(tempfile::tempdir().map_err(|e| crate::Error::io("creating temp dir", e))?);
        let cfg = self.config_for(i);
        let node = self.injector.start_node(cfg).await?;
        self.nodes.push(Some(node));
        Ok(i)
    }

    /// Data dir of node `i`.
    pub fn data_dir(&self, i: usize) -> &std::path::Path {
        self.dirs[i].path()
    }

    /// Node `i` (panics if it is killed).
    pub fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("node is not running")
    }

    /// Running nodes with their indexes.
    pub fn running(&self) -> impl Iterator<Item = (usize, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| Some((i, n.as_ref()?)))
    }

    /// Number of node slots (running or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when no node was ever started.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
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

    /// Stops node `i` abruptly (no leave, no hand-off).
    pub async fn kill(&mut self, i: usize) {
        if let Some(n) = self.nodes[i].take() {
            n.shutdown().await;
        }
    }

    /// Restarts node `i` on its data dir as a new incarnation (kills it first if running).
    pub async fn restart(&mut self, i: usize) -> Result<()> {
        self.kill(i).await;
        let cfg = self.config_for(i);
        self.nodes[i] = Some(self.injector.start_node(cfg).await?);
        Ok(())
    }

    /// Restarts node `i` with no seeds, so it forms a new cluster: what an operator does when
    /// every member is gone and the remaining nodes can only wait for each other to join.
    pub async fn restart_forming(&mut self, i: usize) -> Result<()> {
        self.kill(i).await;
        let mut cfg = self.config_for(i);
        cfg.seeds.clear();
        self.nodes[i] = Some(self.injector.start_node(cfg).await?);
        Ok(())
    }

    /// Whether `node` runs and is an Up member in its own view.
    pub fn is_member(node: &Node) -> bool {
        !node.is_shut_down() && node.membership().self_member().is_some_and(|m| m.status() == MemberStatus::Up)
    }

    /// Whether every running node lists exactly the running nodes, all Up and reachable.
    pub fn is_converged(&self) -> bool {
        converged(&self.running().map(|(_, n)| n).collect::<Vec<_>>())
    }

    /// Waits until [`TestCluster::is_converged`]; panics after `timeout`.
    pub async fn await_converged(&self, timeout: Duration) {
        eventually(timeout, "all running nodes see exactly the running nodes up", || {
            std::future::ready(self.is_converged().then_some(()))
        })
        .await
    }

    /// Shuts every node down.
    pub async fn shutdown(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i).await;
        }
    }
}
