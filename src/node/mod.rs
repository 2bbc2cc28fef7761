//! A cluster node: wires membership, transport and the replicator together.

mod builder;
mod data_dir;
mod heartbeat;
mod readiness;
#[cfg(feature = "metrics")]
mod sampling;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn};

pub use builder::NodeBuilder;
pub(crate) use data_dir::lock_data_dir;
pub(crate) use heartbeat::FailureDetectorStatCells;
pub use heartbeat::FailureDetectorStats;
pub use readiness::Readiness;
pub(crate) use readiness::RegionState;

use crate::clock::wall_ms;
use crate::config::NodeConfig;
use crate::ddata::{self, DurableStore, Replicator, ReplicatorParams};
use crate::deadline::DeadlineSweep;
use crate::error::{Error, Result};
use crate::machine::DiskWriter;
use crate::membership::{
    GossipSockets, Member, MemberEvent, MemberStatus, MembershipDriver, MembershipHandle, MembershipSnapshot,
    UniqueAddress,
};
use crate::spawn::Spawner;
use crate::transport::{Endpoint, Transport};

/// What a node runs on top of itself and must reach without knowing its type (a sharding
/// region or proxy): it hands off before the node leaves, counts in the node's readiness and is
/// sampled with the node's metrics. The node layer defines it so it never imports what is
/// attached to it.
pub(crate) trait Attached: Send + Sync + 'static {
    /// Unique on the node (a region's entity type).
    fn name(&self) -> &str;
    /// Hands off its work and stops (before the node leaves).
    fn hand_off(&self) -> futures::future::BoxFuture<'_, ()>;
    /// Its state as a readiness probe sees it.
    fn readiness(&self) -> futures::future::BoxFuture<'_, RegionState>;
    /// Copies its counters and state into the `metrics` facade, labelled with `node_id`.
    #[cfg(feature = "metrics")]
    fn sample_metrics<'a>(&'a self, node_id: &'a str) -> futures::future::BoxFuture<'a, ()>;
    /// For the layer that attached it to find its own type again.
    fn as_any(&self) -> &dyn std::any::Any;
}

struct NodeInner {
    /// Exclusive lock on the data dir while the node runs (released at shutdown).
    data_dir_lock: Mutex<Option<std::fs::File>>,
    config: NodeConfig,
    /// What runs on top of the node (regions, proxies), in start order.
    attached: Mutex<Vec<Arc<dyn Attached>>>,
    /// Handles the layers above keep on the node to find again (daemon processes), each
    /// downcast by the layer that kept it.
    kept: Mutex<Vec<Arc<dyn std::any::Any + Send + Sync>>>,
    /// Readiness once was (probes keep a ready node ready while its coordinator moves).
    readiness: Mutex<readiness::ReadinessLatch>,
    address: UniqueAddress,
    membership: MembershipHandle,
    transport: Transport,
    replicator: Replicator,
    spawner: Spawner,
    failure_detector: Arc<FailureDetectorStatCells>,
    /// Every ask's timeout (one sweeper, not a runtime timer per ask).
    deadlines: DeadlineSweep,
    /// Counters of the admin listener, when one serves this node.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    admin_stats: Arc<AdminStats>,
}

/// Counters of the admin listener (`ddshard::admin::serve`), sampled into the
/// `ddshard_admin_*` metrics.
#[derive(Debug, Default)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) struct AdminStats {
    /// Connections open now.
    pub(crate) connections: std::sync::atomic::AtomicU64,
    /// Connections evicted at the cap (no request in flight).
    pub(crate) connections_evicted: std::sync::atomic::AtomicU64,
    /// Connections refused at the cap (every one serving a request).
    pub(crate) connections_refused: std::sync::atomic::AtomicU64,
    /// Requests refused for a `Host` not allowed.
    pub(crate) requests_refused_host: std::sync::atomic::AtomicU64,
}

/// A running cluster node. Cheap to clone; every clone is the same node.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("address", &self.inner.address).finish()
    }
}

impl Node {
    /// Validates the configuration, opens the durable store under `data_dir` (loading every
    /// durable key before serving), binds messaging and gossip, and joins the cluster through
    /// the seeds. [`Node::builder`] starts a node with seams (a link filter) as well.
    pub async fn start(config: NodeConfig) -> Result<Node> {
        NodeBuilder::new(config).start().await
    }

    /// A builder for a node with seams beyond its configuration.
    pub fn builder(config: NodeConfig) -> NodeBuilder {
        NodeBuilder::new(config)
    }

    async fn start_built(b: NodeBuilder) -> Result<Node> {
        let config = b.config;
        config.validate_with_sources(!b.discovery.is_empty())?;
        if config.is_exposed_without_secret() {
            tracing::warn!(
                gossip_addr = %config.gossip_addr,
                messaging_addr = %config.messaging_addr,
                "INSECURE: no cluster_secret and a non-loopback address; anyone who can reach these \
                 ports can join this cluster and speak as any member"
            );
        }
        let data_dir_lock = lock_data_dir(&config.data_dir)?;
        let (store, generation) = open_store(&config, b.machine.disk_writer().fsyncs()).await?;
        let address = UniqueAddress::new(config.node_id.as_str(), generation);
        let spawner = Spawner::new(info_span!("node", node = %address), CancellationToken::new());
        let shutdown = spawner.shutdown_token().clone();
        let endpoint = Endpoint {
            bind: config.messaging_addr,
            advertise: config.messaging_advertise,
            local: address.clone(),
            cluster_id: config.cluster_id.clone(),
            secrets: config.secrets(),
            settings: config.transport.clone(),
            machine: b.machine.clone(),
        };
        let transport = Transport::bind_with(endpoint, spawner.clone(), b.link_filter).await?;
        let sockets = GossipSockets { machine: &*b.machine, wrap: b.gossip_socket.as_ref() };
        let started =
            MembershipDriver::start(&config, address.clone(), transport.local().messaging_addr, sockets, b.discovery)
                .await;
        let (membership, mut driver) = or_shut_down(&spawner, started).await?;
        let floor_store = store.clone();
        driver.set_generation_floor(Arc::new(move |generation| floor_store.raise_generation_floor(generation)));
        spawner.spawn_essential("membership", driver.run(spawner.clone()));
        transport.admit_only_members(membership.watch());
        let failure_detector = Arc::new(FailureDetectorStatCells::default());
        spawner.spawn_essential(
            "heartbeats",
            heartbeat::run_heartbeats(
                transport.clone(),
                membership.clone(),
                config.failure_detector.clone(),
                failure_detector.clone(),
                shutdown.clone(),
            ),
        );
        let params = replicator_params(&config, &address, b.machine.disk_writer());
        let started = ddata::start(params, transport.clone(), membership.watch(), store, spawner.clone()).await;
        let replicator = or_shut_down(&spawner, started).await?;
        let deadlines = spawn_housekeeping(&spawner, &membership, &transport);
        info!(node = %address, gossip = %membership.gossip_addr(), messaging = %transport.local().messaging_addr, "node started");
        let node = Node {
            inner: Arc::new(NodeInner {
                data_dir_lock: Mutex::new(Some(data_dir_lock)),
                readiness: Mutex::new(readiness::ReadinessLatch::new(config.readiness.coordinator_grace)),
                config,
                attached: Mutex::new(Vec::new()),
                kept: Mutex::new(Vec::new()),
                address,
                membership,
                transport,
                replicator,
                spawner,
                failure_detector,
                deadlines,
                admin_stats: Arc::default(),
            }),
        };
        node.spawn_node_tasks();
        Ok(node)
    }

    /// What runs beside the node's services: leave requests from peers, metrics sampling.
    fn spawn_node_tasks(&self) {
        let leave_requests = self.inner.transport.subscribe(LEAVE_TOPIC, 16);
        self.inner.spawner.spawn_until_shutdown(serve_leave_requests(self.clone(), leave_requests));
        #[cfg(feature = "metrics")]
        {
            let sampled = self.clone();
            self.inner.spawner.spawn_until_shutdown(async move {
                let mut every = tokio::time::interval(crate::metrics::SAMPLE_INTERVAL);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    sampled.sample_metrics().await;
                }
            });
        }
    }

    /// The stable node id.
    pub fn node_id(&self) -> &str {
        &self.inner.address.node_id
    }
    /// This incarnation (node id + generation).
    pub fn address(&self) -> &UniqueAddress {
        &self.inner.address
    }
    /// The bound gossip (UDP) address.
    pub fn gossip_addr(&self) -> SocketAddr {
        self.inner.membership.gossip_addr()
    }
    /// Counters of the gossip socket (datagrams dropped as unauthenticated, malformed or
    /// oversized), as of this call.
    pub fn gossip_stats(&self) -> crate::membership::GossipStats {
        self.inner.membership.stats().snapshot()
    }
    /// The bound messaging (TCP) address.
    pub fn messaging_addr(&self) -> SocketAddr {
        self.inner.transport.local().messaging_addr
    }
    /// The configuration the node started with.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }
    /// Members, oldest first. A member seen unreachable is listed (flagged) until it is removed
    /// or downed.
    pub fn members(&self) -> Vec<Member> {
        self.inner.membership.snapshot().members.clone()
    }
    /// The current membership snapshot.
    pub fn membership(&self) -> Arc<MembershipSnapshot> {
        self.inner.membership.snapshot()
    }
    /// A watch over membership snapshots.
    pub fn watch_membership(&self) -> watch::Receiver<Arc<MembershipSnapshot>> {
        self.inner.membership.watch()
    }
    /// Membership events from now on.
    pub fn subscribe_events(&self) -> broadcast::Receiver<MemberEvent> {
        self.inner.membership.events()
    }
    /// The distributed-data replicator.
    pub fn replicator(&self) -> &Replicator {
        &self.inner.replicator
    }
    /// Counters of the heartbeats over the message path, as of this call.
    pub fn failure_detector_stats(&self) -> FailureDetectorStats {
        self.inner.failure_detector.snapshot()
    }
    /// The messaging layer.
    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    /// Attaches `part` (a region) to this node; [`Error::TypeAlreadyStarted`] when one of its
    /// name is attached already.
    pub(crate) fn attach(&self, part: Arc<dyn Attached>) -> Result<()> {
        let mut attached = self.inner.attached.lock().expect("attached lock");
        if attached.iter().any(|a| a.name() == part.name()) {
            return Err(Error::TypeAlreadyStarted(part.name().to_string()));
        }
        attached.push(part);
        Ok(())
    }

    /// Keeps `handle` on this node for the layer above to find again ([`Node::kept`]).
    pub(crate) fn keep(&self, handle: Arc<dyn std::any::Any + Send + Sync>) {
        self.inner.kept.lock().expect("kept lock").push(handle);
    }

    /// The handles of type `T` kept on this node, in the order kept.
    pub(crate) fn kept<T: Send + Sync + 'static>(&self) -> Vec<Arc<T>> {
        let kept = self.inner.kept.lock().expect("kept lock");
        kept.iter().filter_map(|k| k.clone().downcast::<T>().ok()).collect()
    }

    /// What is attached to this node, in start order.
    pub(crate) fn attached(&self) -> Vec<Arc<dyn Attached>> {
        self.inner.attached.lock().expect("attached lock").clone()
    }

    /// Whether this node is ready to serve, and what is missing when it is not. A node is
    /// ready once it is Up, its storage healthy and every region started here (proxies too)
    /// registered with its type's coordinator; from then on a region without a coordinator
    /// (one that moves after its node failed) is forgiven for `readiness.coordinator_grace`,
    /// so a fail-over does not take every node out of service at once. Not ready while the
    /// node is not Up (leaving, downed, removed), stopped, its storage failing, or a region
    /// refused or not answering. Durable data (LMDB) is loaded before [`Node::start`] returns.
    pub async fn readiness(&self) -> Readiness {
        use readiness::Observation;
        let stopped = match self.stop_reason() {
            Some(reason) => Some(reason),
            None => self.is_shut_down().then(|| "it was shut down".to_string()),
        };
        let snap = self.membership();
        let status = snap.members.iter().find(|m| m.address() == &self.inner.address).map(|m| m.status().as_key());
        let health = self.inner.replicator.durable_health();
        let storage_failing =
            (!health.is_healthy()).then(|| health.last_error().unwrap_or_else(|| "unhealthy".to_string()));
        let mut regions = Vec::new();
        for part in self.attached() {
            regions.push((part.name().to_string(), part.readiness().await));
        }
        let observation = Observation { stopped, status, storage_failing, regions };
        let (ready, not_ready_because) =
            self.inner.readiness.lock().expect("readiness lock").observe(observation, crate::clock::now());
        Readiness { ready, not_ready_because }
    }

    /// Copies this node's counters and state into the `metrics` facade now (a sampler also
    /// does it every second); call it before rendering a scrape.
    #[cfg(feature = "metrics")]
    pub async fn sample_metrics(&self) {
        sampling::sample(self).await;
        for part in self.attached() {
            part.sample_metrics(self.node_id()).await;
        }
    }

    /// The deadlines every ask of this node waits under.
    pub(crate) fn deadlines(&self) -> &DeadlineSweep {
        &self.inner.deadlines
    }

    /// Counters of the admin listener.
    #[cfg(feature = "metrics")]
    pub(crate) fn admin_stats(&self) -> &Arc<AdminStats> {
        &self.inner.admin_stats
    }

    pub(crate) fn shutdown_token(&self) -> CancellationToken {
        self.inner.spawner.shutdown_token().clone()
    }

    /// Spawns the node's tasks (in its tracing span; `shutdown` waits for them).
    pub(crate) fn spawner(&self) -> &Spawner {
        &self.inner.spawner
    }

    /// Leaves gracefully: Leaving in gossip; every region hands off its shards to other nodes
    /// (the coordinator moves too if it ran here); then Exiting → Removed, lingering so every
    /// member sees it; then stops.
    pub async fn leave(&self) -> Result<()> {
        let m = &self.inner.membership;
        m.set_status(MemberStatus::Leaving).await?;
        for part in self.attached() {
            part.hand_off().await;
        }
        // What this node's replica holds goes to the members that stay before it exits: a write
        // acknowledged by it (and others leaving too) must not leave with it.
        let timeout = self.inner.config.membership.leave_hand_over_timeout;
        match self.inner.replicator.hand_over(timeout).await {
            Ok(()) => info!("replica handed over to the members that stay"),
            Err(e) => {
                warn!(error = %e, "replica not handed over to a majority of the members that stay; leaving anyway (its disk keeps the data)")
            }
        }
        m.set_status(MemberStatus::Exiting).await?;
        m.set_status(MemberStatus::Removed).await?;
        tokio::time::sleep(self.inner.config.membership.leave_linger).await;
        self.shutdown().await;
        Ok(())
    }

    /// Downs the member `node_id` (an operator's decision, as a split-brain resolver's
    /// would be): its down mark goes into gossip, every member removes it after the down-removal
    /// margin, and its shards and singletons move. Use it for a node known to be dead; a live
    /// downed node stops itself. [`Error::UnknownMember`] when no member has that id.
    pub async fn down(&self, node_id: &str) -> Result<()> {
        let victim = self.membership().member(node_id).map(|m| m.address().clone());
        let victim = victim.ok_or_else(|| Error::UnknownMember(node_id.to_string()))?;
        self.inner.membership.down(vec![victim]).await
    }

    /// Asks the member `node_id` to leave gracefully (this node too): it hands off its shards,
    /// leaves and stops. Returns once that member has started leaving (a request answered
    /// within `timeout`), not when it is gone; [`Error::UnknownMember`] when no member has that
    /// id.
    pub async fn leave_member(&self, node_id: &str, timeout: std::time::Duration) -> Result<()> {
        let member = self.membership().member(node_id).cloned();
        let member = member.ok_or_else(|| Error::UnknownMember(node_id.to_string()))?;
        if member.address() == &self.inner.address {
            leave_in_background(self.clone());
            return Ok(());
        }
        self.inner.transport.request(&member.peer(), LEAVE_TOPIC, &[], timeout).await.map(|_| ())
    }

    /// Stops at once, without hand-off or goodbye (as a crash would, for the others). Returns
    /// when every task of the node has ended and its store is closed.
    pub async fn shutdown(&self) {
        self.inner.spawner.shut_down().await;
        self.inner.data_dir_lock.lock().expect("lock slot").take();
    }

    /// What a crash leaves of a node once every one of its tasks is gone (the test kit's
    /// whole-node simulation drops the runtime they ran on): its data dir unlocked, as a dead
    /// process holds no lock, and the handles still held elsewhere seeing a stopped node.
    #[cfg(feature = "testkit")]
    pub(crate) fn mark_crashed(&self) {
        self.inner.data_dir_lock.lock().expect("lock slot").take();
        self.inner.spawner.stop("crashed".into());
    }

    /// Whether the node stopped: [`Node::shutdown`] or leave was called, or it stopped by
    /// itself (see [`Node::stop_reason`]).
    pub fn is_shut_down(&self) -> bool {
        self.inner.spawner.shutdown_token().is_cancelled()
    }

    /// Why the node stopped by itself, if it did: it was downed, a newer incarnation of its
    /// node id joined, or an essential task panicked. `None` while running or after a requested
    /// shutdown or leave.
    pub fn stop_reason(&self) -> Option<String> {
        self.inner.spawner.stop_reason()
    }
}

/// Opens the node's LMDB store (off the async workers) and takes the next generation.
async fn open_store(config: &NodeConfig, fsync: bool) -> Result<(DurableStore, u64)> {
    let dir = config.data_dir.join("ddata");
    let map_size = config.replicator.lmdb_map_size;
    // Read here, not on the blocking thread: the runtime's clock is the node's clock.
    let now_ms = wall_ms();
    tokio::task::spawn_blocking(move || -> Result<(DurableStore, u64)> {
        let store = DurableStore::open_with(&dir, map_size, fsync)?;
        let generation = store.next_generation(now_ms)?;
        Ok((store, generation))
    })
    .await
    .map_err(|e| Error::storage(&config.data_dir, format!("open task failed: {e}")))?
}

/// The node's essential housekeeping: forgetting removed peers, stopping when downed, and the
/// ask deadline sweep (returned: regions register their asks with it).
fn spawn_housekeeping(spawner: &Spawner, membership: &MembershipHandle, transport: &Transport) -> DeadlineSweep {
    let shutdown = spawner.shutdown_token().clone();
    spawner.spawn_essential(
        "forget removed peers",
        forget_removed_peers(membership.events(), membership.watch(), transport.clone(), shutdown.clone()),
    );
    spawner.spawn_essential("stop when downed", stop_when_downed(membership.watch(), spawner.clone()));
    let deadlines = DeadlineSweep::new();
    spawner.spawn_essential("ask deadlines", deadlines.clone().run(shutdown));
    deadlines
}

/// A start step's result; on an error the tasks spawned so far are stopped first.
async fn or_shut_down<T>(spawner: &Spawner, started: Result<T>) -> Result<T> {
    if started.is_err() {
        spawner.shut_down().await;
    }
    started
}

fn replicator_params(config: &NodeConfig, address: &UniqueAddress, disk_writer: DiskWriter) -> ReplicatorParams {
    let r = &config.replicator;
    ReplicatorParams {
        self_addr: address.clone(),
        role: r.role.clone(),
        durable_prefixes: r.durable_key_prefixes.clone(),
        gossip_interval: r.gossip_interval,
        delta_interval: r.delta_interval,
        max_message_bytes: config.replicator_message_bytes(),
        max_map_size: r.lmdb_max_map_size,
        forget_absent_after: Some(r.forget_absent_after).filter(|d| !d.is_zero()),
        disk_writer,
    }
}

/// Where members ask this node to leave ([`Node::leave_member`]).
const LEAVE_TOPIC: &str = "node/leave";

/// Answers leave requests from other members (only members reach the transport) and leaves.
async fn serve_leave_requests(node: Node, mut requests: tokio::sync::mpsc::Receiver<crate::transport::Inbound>) {
    while let Some(m) = requests.recv().await {
        let Some(id) = m.request_id else { continue };
        info!(from = %m.from.address, "asked to leave by a member");
        let _ = node.inner.transport.respond(&m.from, id, Ok(&[]));
        leave_in_background(node);
        return;
    }
}

/// Leaves on a task the node does not track: `leave` ends with `shutdown`, which waits for
/// every tracked task, so a tracked one could never finish it.
fn leave_in_background(node: Node) {
    let runtime = node.inner.spawner.runtime().clone();
    runtime.spawn(async move {
        if let Err(e) = node.leave().await {
            warn!(error = %e, "leaving on request failed");
        }
    });
}

/// A node that is downed (by the other side, or by itself on the minority side) stops at once,
/// like a crash: its regions and singletons end before the others move them (they wait the
/// down-removal margin). It must restart as a new incarnation to rejoin.
async fn stop_when_downed(mut members: watch::Receiver<Arc<MembershipSnapshot>>, spawner: Spawner) {
    let shutdown = spawner.shutdown_token().clone();
    loop {
        let downed = members.borrow_and_update().self_member().is_some_and(|m| m.status() == MemberStatus::Down);
        if downed {
            tracing::warn!("this node was downed; stopping");
            spawner.stop("this node was downed".into());
            return;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = members.changed() => if r.is_err() { return },
        }
    }
}

/// Closes the connections and writers of members once they are removed. Events missed to the
/// channel's lag are made up from the membership itself: every peer the transport still holds
/// that is no longer a member is forgotten (review finding S15: a lost `Removed` kept that
/// peer's connections for good).
async fn forget_removed_peers(
    mut events: broadcast::Receiver<MemberEvent>,
    mut members: watch::Receiver<Arc<MembershipSnapshot>>,
    transport: Transport,
    shutdown: CancellationToken,
) {
    loop {
        let ev = tokio::select! {
            _ = shutdown.cancelled() => return,
            ev = events.recv() => ev,
        };
        match ev {
            Ok(MemberEvent::Removed(addr)) => transport.forget_peer(&addr),
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                // The driver sends a refresh's events before it publishes its snapshot: wait
                // for that snapshot (briefly; it may be out already) before reading it.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), members.changed()).await;
                let snapshot = members.borrow_and_update().clone();
                let gone = forget_non_members(&transport, &snapshot);
                warn!(missed, forgotten = gone, "member events lagged; forgot the peers no longer members");
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Forgets every peer `transport` holds connections or writers for that `snapshot` does not
/// list as a member (or lists as removed); returns how many.
fn forget_non_members(transport: &Transport, snapshot: &MembershipSnapshot) -> usize {
    let is_member = |peer: &UniqueAddress| {
        snapshot.members.iter().any(|m| m.address() == peer && m.status() != MemberStatus::Removed)
    };
    let gone: Vec<UniqueAddress> = transport.peers().into_iter().filter(|p| !is_member(p)).collect();
    for peer in &gone {
        transport.forget_peer(peer);
    }
    gone.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransportSettings;
    use crate::transport::PeerAddr;

    async fn transport(id: &str, shutdown: &CancellationToken) -> Transport {
        let local = UniqueAddress::new(id, 1);
        let settings = TransportSettings::default();
        Transport::bind("127.0.0.1:0".parse().unwrap(), local, "c".into(), None, settings, shutdown.clone())
            .await
            .unwrap()
    }

    fn snapshot(me: &str, members: &[&str]) -> MembershipSnapshot {
        MembershipSnapshot {
            self_address: UniqueAddress::new(me, 1),
            members: members.iter().map(|m| Member::for_test(m, MemberStatus::Up, true)).collect(),
        }
    }

    /// Review finding S15: when member events are lost to the channel's lag, the peers that are
    /// no longer members are found from the membership itself, and their connections and
    /// writers closed; members keep theirs.
    #[tokio::test]
    async fn peers_no_longer_members_are_forgotten_from_the_membership_when_their_removal_was_missed() {
        let shutdown = CancellationToken::new();
        let (a, b) = (transport("a", &shutdown).await, transport("b", &shutdown).await);
        let to_b = PeerAddr { address: UniqueAddress::new("b", 1), messaging_addr: b.local().messaging_addr };
        a.send(&to_b, "t", b"hello").unwrap();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while b.peers().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "a's connection never reached b");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(a.peers(), [UniqueAddress::new("b", 1)], "a's writer to b");
        assert_eq!(b.peers(), [UniqueAddress::new("a", 1)], "b's inbound connection from a");
        // Both members: nothing goes.
        assert_eq!(forget_non_members(&a, &snapshot("a", &["a", "b"])), 0);
        assert_eq!(forget_non_members(&b, &snapshot("b", &["a", "b"])), 0);
        assert_eq!(a.peers().len(), 1);
        // Each no longer lists the other: the writer and the inbound connection are closed.
        assert_eq!(forget_non_members(&a, &snapshot("a", &["a"])), 1);
        assert_eq!(forget_non_members(&b, &snapshot("b", &["b"])), 1);
        assert!(a.peers().is_empty() && b.peers().is_empty());
        shutdown.cancel();
    }
}
