//! Tokio drivers of the sharding state machines: one task per region (running its shards), one
//! task per entity, and a coordinator task on the oldest member with the type's role.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use super::coordinator::{CoordinatorAction, CoordinatorCore, CoordinatorInput, CoordinatorSettings, CoordinatorState};
use super::protocol::{
    CoordinatorQuery, RegionInbound, RegionQuery, RegionStateReply, RegionStatsReply, RegionToRegion, ToCoordinator,
    coordinator_topic, region_topic,
};
use super::region::{RegionAction, RegionCore, RegionDrop, RegionInput, RegionSettings};
use super::shard::{DropReason, ShardAction, ShardCore, ShardInput};
use super::{
    ClusterShardingStats, Entity, EntityContext, RegionId, ShardId, ShardIdExtractor, ShardingSettings, StartOptions,
};
use crate::ddata::{Consistency, GSet, LwwMap, OrSet, wall_ms};
use crate::error::{Error, Result};
use crate::membership::{MemberStatus, MembershipSnapshot};
use crate::node::{Node, RegionControl};
use crate::transport::{Inbound, PeerAddr, Transport, wire};

pub(crate) type Factory<E> = Arc<dyn Fn(&str) -> E + Send + Sync>;

const TICK: Duration = Duration::from_millis(100);

/// Where the answer to a message goes.
enum ReplyTo<E: Entity> {
    Local(oneshot::Sender<Result<E::Reply>>),
    Remote {
        region: RegionId,
        ask_id: u64,
    },
    /// `start_entity`: answered once the entity runs.
    Started(oneshot::Sender<Result<()>>),
}

/// A message on its way to an entity. `msg: None` only starts the entity.
struct Envelope<E: Entity> {
    msg: Option<E::Message>,
    reply: Option<ReplyTo<E>>,
}

impl<E: Entity> std::fmt::Debug for Envelope<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Envelope")
    }
}

enum EntityCmd<E: Entity> {
    Msg(Envelope<E>),
    Stop,
}

enum EntityEvent<E: Entity> {
    Passivate {
        shard: ShardId,
        entity_id: String,
        incarnation: u64,
    },
    /// The entity task ended; `leftovers` are messages it had not handled (after a panic).
    Terminated {
        shard: ShardId,
        entity_id: String,
        incarnation: u64,
        leftovers: Vec<Envelope<E>>,
    },
    /// Remember-entities: a store operation of shard instance `instance` finished.
    Store {
        shard: ShardId,
        instance: u64,
        input: StoreResult,
    },
    /// Remember-entities: start these remembered ids now (recovery, possibly rate-limited).
    Recover {
        shard: ShardId,
        instance: u64,
        entity_ids: Vec<String>,
    },
    /// Every entity task of a stopped shard has ended: it may be reported stopped.
    ShardTasksEnded {
        shard: ShardId,
    },
    /// A failed shard's backoff is over: start it again.
    RestartShard {
        shard: ShardId,
        epoch: u64,
    },
}

/// Outcome of a remembered-entities store operation.
enum StoreResult {
    Loaded(BTreeSet<String>),
    WriteDone,
    Failed,
    MovedAway(String),
}

enum RegionCmd<E: Entity> {
    Deliver { shard: ShardId, entity_id: String, env: Envelope<E> },
    State(oneshot::Sender<RegionStateReply>),
    Stats(oneshot::Sender<RegionStatsReply>),
    GracefulShutdown(oneshot::Sender<()>),
}

/// Counters of one region.
#[derive(Debug, Default)]
pub struct RegionCounters {
    /// Messages dropped because the buffer was full.
    pub dropped_buffer_full: AtomicU64,
    /// Messages dropped during hand-offs.
    pub dropped_handoff: AtomicU64,
    /// Messages from other nodes that did not decode or had an empty entity id.
    pub dropped_invalid: AtomicU64,
    /// Entity handlers that panicked.
    pub entity_panics: AtomicU64,
    /// Shards stopped because their remembered set could not be loaded or written.
    pub shard_failures: AtomicU64,
}

struct HandleInner<E: Entity> {
    type_name: String,
    node: Node,
    settings: ShardingSettings,
    extractor: ShardIdExtractor,
    commands: mpsc::UnboundedSender<RegionCmd<E>>,
    buffered: Arc<AtomicUsize>,
    counters: Arc<RegionCounters>,
    proxy: bool,
}

/// Handle to the region (or proxy) of one entity type on this node; cheap to clone.
pub struct ShardRegion<E: Entity> {
    inner: Arc<HandleInner<E>>,
}

impl<E: Entity> Clone for ShardRegion<E> {
    fn clone(&self) -> Self {
        ShardRegion { inner: self.inner.clone() }
    }
}

impl<E: Entity> std::fmt::Debug for ShardRegion<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardRegion").field("type", &self.inner.type_name).field("proxy", &self.inner.proxy).finish()
    }
}

impl<E: Entity> ShardRegion<E> {
    /// The entity type's name.
    pub fn type_name(&self) -> &str {
        &self.inner.type_name
    }

    /// Whether this is a proxy (hosts nothing).
    pub fn is_proxy(&self) -> bool {
        self.inner.proxy
    }

    /// The shard an entity id belongs to.
    pub fn shard_id(&self, entity_id: &str) -> ShardId {
        (self.inner.extractor)(entity_id)
    }

    /// Counters of this region.
    pub fn counters(&self) -> &RegionCounters {
        &self.inner.counters
    }

    fn submit(&self, entity_id: &str, env: Envelope<E>) -> Result<()> {
        if entity_id.is_empty() {
            return Err(Error::EmptyEntityId);
        }
        let i = &self.inner;
        if i.buffered.load(Ordering::Relaxed) >= i.settings.buffer_size {
            if i.counters.dropped_buffer_full.fetch_add(1, Ordering::Relaxed) == 0 {
                warn!(type_name = %i.type_name, "region buffer full; dropping messages");
            }
            return Err(Error::BufferFull { type_name: i.type_name.clone(), buffer_size: i.settings.buffer_size });
        }
        let shard = (i.extractor)(entity_id);
        i.commands
            .send(RegionCmd::Deliver { shard, entity_id: entity_id.to_string(), env })
            .map_err(|_| Error::ShutDown)
    }

    /// Sends a message to entity `entity_id`, wherever it lives; no reply. Messages from this
    /// region to one entity arrive in the order sent.
    pub fn tell(&self, entity_id: &str, msg: E::Message) -> Result<()> {
        self.submit(entity_id, Envelope { msg: Some(msg), reply: None })
    }

    /// Sends a message and waits for the entity's reply, up to the settings' `ask_timeout`.
    pub async fn ask(&self, entity_id: &str, msg: E::Message) -> Result<E::Reply> {
        self.ask_with_timeout(entity_id, msg, self.inner.settings.ask_timeout).await
    }

    /// [`ShardRegion::ask`] with an explicit timeout.
    pub async fn ask_with_timeout(&self, entity_id: &str, msg: E::Message, timeout: Duration) -> Result<E::Reply> {
        let (tx, rx) = oneshot::channel();
        self.submit(entity_id, Envelope { msg: Some(msg), reply: Some(ReplyTo::Local(tx)) })?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                Err(Error::NotDelivered { entity_id: entity_id.to_string(), reason: "entity stopped".into() })
            }
            Err(_) => Err(Error::AskTimeout { entity_id: entity_id.to_string(), timeout }),
        }
    }

    /// Starts entity `entity_id` without a message; returns once it runs.
    pub async fn start_entity(&self, entity_id: &str) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.submit(entity_id, Envelope { msg: None, reply: Some(ReplyTo::Started(tx)) })?;
        let timeout = self.inner.settings.ask_timeout;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                Err(Error::NotDelivered { entity_id: entity_id.to_string(), reason: "entity stopped".into() })
            }
            Err(_) => Err(Error::AskTimeout { entity_id: entity_id.to_string(), timeout }),
        }
    }

    /// Shards hosted by this region with their live entity ids.
    pub async fn region_state(&self) -> Result<BTreeMap<ShardId, Vec<String>>> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(RegionCmd::State(tx)).map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }

    /// Shards hosted by this region with their live entity counts.
    pub async fn region_stats(&self) -> Result<BTreeMap<ShardId, usize>> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(RegionCmd::Stats(tx)).map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }

    fn coordinator_peer(&self) -> Result<PeerAddr> {
        let snap = self.inner.node.membership();
        let m = snap
            .oldest(self.inner.settings.role.as_deref())
            .ok_or_else(|| Error::CoordinatorUnavailable(self.inner.type_name.clone()))?;
        Ok(PeerAddr { address: m.address().clone(), messaging_addr: m.messaging_addr() })
    }

    /// Every region of this type in the cluster (from the coordinator).
    pub async fn current_regions(&self) -> Result<BTreeSet<RegionId>> {
        let peer = self.coordinator_peer()?;
        let body = wire::encode(&CoordinatorQuery::CurrentRegions)?;
        let topic = coordinator_topic(&self.inner.type_name);
        let reply = self
            .inner
            .node
            .transport()
            .request(&peer, &topic, &body, self.inner.settings.ask_timeout)
            .await
            .map_err(|_| Error::CoordinatorUnavailable(self.inner.type_name.clone()))?;
        wire::decode(&reply)
    }

    /// Entity counts of every region; regions that do not answer within `timeout` are listed in
    /// `failed` instead of failing the whole query.
    pub async fn cluster_stats(&self, timeout: Duration) -> Result<ClusterShardingStats> {
        let regions = self.current_regions().await?;
        let snap = self.inner.node.membership();
        let topic = region_topic(&self.inner.type_name);
        let body = wire::encode(&RegionQuery::Stats)?;
        let transport = self.inner.node.transport().clone();
        let asks = regions.into_iter().map(|region| {
            let peer = snap
                .members
                .iter()
                .find(|m| *m.address() == region)
                .map(|m| PeerAddr { address: region.clone(), messaging_addr: m.messaging_addr() });
            let (transport, topic, body) = (transport.clone(), topic.clone(), body.clone());
            async move {
                let Some(peer) = peer else { return (region, None) };
                let r = transport.request(&peer, &topic, &body, timeout).await.ok();
                (region, r.and_then(|b| wire::decode::<RegionStatsReply>(&b).ok()))
            }
        });
        let mut stats = ClusterShardingStats::default();
        for (region, answer) in futures::future::join_all(asks).await {
            match answer {
                Some(s) => {
                    stats.regions.insert(region, s);
                }
                None => {
                    stats.failed.insert(region);
                }
            }
        }
        Ok(stats)
    }

    /// External allocation: asks for `shard` to live on node `node_id` (majority write to the
    /// replicated, durable table of desired locations). New allocations follow at once;
    /// allocated shards move at the next rebalance.
    pub async fn set_external_shard_location(&self, shard: &str, node_id: &str) -> Result<()> {
        let key = super::external_locations_key(&self.inner.type_name);
        let (shard, node_id) = (shard.to_string(), node_id.to_string());
        self.inner
            .node
            .replicator()
            .update::<LwwMap, _>(&key, Consistency::MAJORITY, self.inner.settings.ask_timeout, move |m, ctx| {
                let _ = m.put_as(ctx, shard, &node_id);
            })
            .await
    }

    /// Hands off every shard of this region to other regions, then stops it (used by
    /// `Node::leave`). Bounded by `handoff_timeout`.
    pub async fn graceful_shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.commands.send(RegionCmd::GracefulShutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

impl<E: Entity> RegionControl for HandleInner<E> {
    fn type_name(&self) -> &str {
        &self.type_name
    }
    fn graceful_shutdown(&self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            if self.commands.send(RegionCmd::GracefulShutdown(tx)).is_ok() {
                let _ = rx.await;
            }
        })
    }
}

/// Starts the region (and, where the node may host the coordinator, the coordinator runner).
/// Keeps the External strategy's table equal to the replicated map of desired locations.
async fn follow_external_locations(
    node: Node,
    type_name: String,
    table: Arc<std::sync::RwLock<BTreeMap<ShardId, String>>>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let Ok(mut rx) = node.replicator().subscribe(&super::external_locations_key(&type_name)).await else { return };
    loop {
        let current = rx.borrow_and_update().clone();
        if let Some(crate::ddata::ReplicatedData::LwwMap(m)) = current {
            let next: BTreeMap<ShardId, String> =
                m.iter().filter_map(|(k, _)| Some((k.to_string(), m.get_as::<String>(k).ok()??))).collect();
            *table.write().expect("locations lock") = next;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

pub(crate) async fn start_region<E: Entity>(
    node: &Node,
    type_name: &str,
    factory: Option<Factory<E>>,
    settings: ShardingSettings,
    options: StartOptions,
) -> Result<ShardRegion<E>> {
    if type_name.is_empty() || type_name.contains('/') {
        return Err(Error::Config(format!("entity type name {type_name:?} must be non-empty and without '/'")));
    }
    let n = settings.number_of_shards;
    let extractor: ShardIdExtractor =
        options.shard_id_extractor.clone().unwrap_or_else(|| Arc::new(move |id: &str| super::default_shard_id(id, n)));
    let (tx, rx) = mpsc::unbounded_channel();
    let proxy = factory.is_none();
    let inner = Arc::new(HandleInner {
        type_name: type_name.to_string(),
        node: node.clone(),
        settings: settings.clone(),
        extractor,
        commands: tx,
        buffered: Arc::new(AtomicUsize::new(0)),
        counters: Arc::new(RegionCounters::default()),
        proxy,
    });
    node.register_region(inner.clone())?;
    let me = node.address().clone();
    let transport = node.transport().clone();
    let inbound = transport.subscribe(&region_topic(type_name), 65_536);
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let task = RegionTask {
        type_name: type_name.to_string(),
        me: me.clone(),
        node: node.clone(),
        transport,
        core: RegionCore::new(
            me,
            proxy,
            RegionSettings { buffer_size: settings.buffer_size, retry_interval: settings.retry_interval },
            Instant::now(),
        ),
        shards: HashMap::new(),
        factory,
        settings: settings.clone(),
        pending_asks: HashMap::new(),
        next_ask: 1,
        events_tx,
        buffered: inner.buffered.clone(),
        counters: inner.counters.clone(),
        members: node.membership(),
        shutdown_waiters: Vec::new(),
        shutdown_deadline: None,
        work: VecDeque::new(),
        extractor: inner.extractor.clone(),
        next_shard_instance: 1,
        orphans: HashMap::new(),
        ask_targets: HashMap::new(),
        entity_tasks: TaskTracker::new(),
    };
    let shutdown = node.shutdown_token();
    node.spawn(task.run(rx, inbound, events_rx, node.watch_membership(), shutdown.clone()));
    if !proxy {
        let strategy = match (&options.allocation_strategy, &settings.allocation) {
            (Some(s), _) => s.clone(),
            (None, super::AllocationSettings::External { rebalance_limit }) => {
                let table: Arc<std::sync::RwLock<BTreeMap<ShardId, String>>> = Arc::default();
                node.spawn(follow_external_locations(
                    node.clone(),
                    type_name.to_string(),
                    table.clone(),
                    shutdown.clone(),
                ));
                let mut ext = super::ExternalAllocation::new(table);
                ext.rebalance_limit = *rebalance_limit;
                Arc::new(ext) as Arc<dyn super::ShardAllocationStrategy>
            }
            (None, _) => settings.strategy(),
        };
        let runner = CoordinatorRunner { node: node.clone(), type_name: type_name.to_string(), settings, strategy };
        node.spawn(runner.run(shutdown));
    }
    Ok(ShardRegion { inner })
}

enum PendingAsk<E: Entity> {
    Reply(oneshot::Sender<Result<E::Reply>>),
    Started(oneshot::Sender<Result<()>>),
}

impl<E: Entity> PendingAsk<E> {
    fn is_closed(&self) -> bool {
        match self {
            PendingAsk::Reply(tx) => tx.is_closed(),
            PendingAsk::Started(tx) => tx.is_closed(),
        }
    }
}

struct EntityHandle<E: Entity> {
    tx: mpsc::UnboundedSender<EntityCmd<E>>,
    task: JoinHandle<()>,
    incarnation: u64,
}

struct LocalShard<E: Entity> {
    core: ShardCore<Envelope<E>>,
    epoch: u64,
    entities: HashMap<String, EntityHandle<E>>,
    /// Tells store results of this instance from those of an earlier (failed) one.
    instance: u64,
    /// This shard's entity tasks: a stopped or failed shard is reported (and restarted) only
    /// once all of them have ended, so no entity outlives its shard's hand-over.
    tasks: TaskTracker,
}

enum Work<E: Entity> {
    Region(RegionInput<Envelope<E>>),
    Shard(ShardId, ShardInput<Envelope<E>>),
}

struct RegionTask<E: Entity> {
    type_name: String,
    me: RegionId,
    node: Node,
    transport: Transport,
    core: RegionCore<Envelope<E>>,
    shards: HashMap<ShardId, LocalShard<E>>,
    factory: Option<Factory<E>>,
    settings: ShardingSettings,
    pending_asks: HashMap<u64, PendingAsk<E>>,
    next_ask: u64,
    events_tx: mpsc::UnboundedSender<EntityEvent<E>>,
    buffered: Arc<AtomicUsize>,
    counters: Arc<RegionCounters>,
    members: Arc<MembershipSnapshot>,
    shutdown_waiters: Vec<oneshot::Sender<()>>,
    shutdown_deadline: Option<Instant>,
    work: VecDeque<Work<E>>,
    extractor: ShardIdExtractor,
    next_shard_instance: u64,
    /// Messages sent to an entity task that had already ended, redelivered after its
    /// Terminated event.
    orphans: HashMap<(ShardId, String), Vec<Envelope<E>>>,
    /// The region each pending ask was forwarded to: asks to a region whose node went down
    /// fail at once instead of waiting for their timeout.
    ask_targets: HashMap<u64, RegionId>,
    /// Every entity task of this region: the region task waits for them before it ends, so
    /// `Node::shutdown` returns only when no entity of the node is alive.
    entity_tasks: TaskTracker,
}

fn peer_of(snap: &MembershipSnapshot, addr: &RegionId) -> Option<PeerAddr> {
    snap.members
        .iter()
        .find(|m| m.address() == addr && !matches!(m.status(), MemberStatus::Down | MemberStatus::Removed))
        .map(|m| PeerAddr { address: addr.clone(), messaging_addr: m.messaging_addr() })
}

/// Sends an ask's reply (or failure) to wherever the asker waits.
fn send_reply<E: Entity>(
    transport: &Transport,
    members: &MembershipSnapshot,
    type_name: &str,
    reply: ReplyTo<E>,
    result: Result<Option<E::Reply>>,
) {
    match reply {
        ReplyTo::Local(tx) => {
            let _ = tx.send(result.and_then(|r| {
                r.ok_or_else(|| Error::NotDelivered { entity_id: String::new(), reason: "no reply".into() })
            }));
        }
        ReplyTo::Started(tx) => {
            let _ = tx.send(result.map(|_| ()));
        }
        ReplyTo::Remote { region, ask_id } => {
            let result = match result {
                Ok(Some(r)) => {
                    wire::encode(&r).map(|b| serde_bytes::ByteBuf::from(b.to_vec())).map_err(|e| e.to_string())
                }
                Ok(None) => Ok(serde_bytes::ByteBuf::new()),
                Err(e) => Err(e.to_string()),
            };
            let msg = RegionInbound::Region(RegionToRegion::AskReply { ask_id, result });
            if let (Some(peer), Ok(bytes)) = (peer_of(members, &region), wire::encode(&msg))
                && let Err(e) = transport.send(&peer, &region_topic(type_name), &bytes)
            {
                debug!(%region, error = %e, "ask reply not sent");
            }
        }
    }
}

fn not_delivered(entity_id: &str, reason: impl Into<String>) -> Error {
    Error::NotDelivered { entity_id: entity_id.to_string(), reason: reason.into() }
}

impl<E: Entity> RegionTask<E> {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<RegionCmd<E>>,
        mut inbound: mpsc::Receiver<Inbound>,
        mut events: mpsc::UnboundedReceiver<EntityEvent<E>>,
        mut members: watch::Receiver<Arc<MembershipSnapshot>>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let snap = members.borrow_and_update().clone();
        self.on_members(snap);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => break,
                },
                msg = inbound.recv() => match msg {
                    Some(m) => self.on_inbound(m),
                    None => break,
                },
                Some(ev) = events.recv() => self.on_event(ev),
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    let snap = members.borrow_and_update().clone();
                    self.on_members(snap);
                }
                _ = tick.tick() => {
                    self.work.push_back(Work::Region(RegionInput::Tick));
                    let shards: Vec<ShardId> = self.shards.keys().cloned().collect();
                    for s in shards {
                        self.work.push_back(Work::Shard(s, ShardInput::Tick));
                    }
                    self.pending_asks.retain(|_, p| !p.is_closed());
                    self.ask_targets.retain(|id, _| self.pending_asks.contains_key(id));
                    if self.shutdown_deadline.is_some_and(|d| Instant::now() >= d) {
                        warn!(type_name = %self.type_name, "graceful shutdown timed out; stopping the remaining shards");
                        break;
                    }
                }
            }
            self.process();
            self.buffered.store(self.core.buffered(), Ordering::Relaxed);
            if self.shutdown_deadline.is_some() && self.shutdown_waiters.is_empty() {
                break; // graceful shutdown finished
            }
        }
        self.stop_all_shards();
        self.transport.unsubscribe(&region_topic(&self.type_name));
        // Nobody hears that this region stopped before its entities are gone. `abort` takes
        // effect at an entity's next await; one that never yields cannot be stopped.
        self.entity_tasks.close();
        if tokio::time::timeout(self.settings.handoff_timeout, self.entity_tasks.wait()).await.is_err() {
            error!(
                type_name = %self.type_name,
                still_running = self.entity_tasks.len(),
                "entity tasks did not end within the hand-off timeout after being aborted (a handler that never yields?)"
            );
        }
        self.finish_shutdown();
    }

    fn stop_all_shards(&mut self) {
        for (_, shard) in self.shards.drain() {
            for (_, e) in shard.entities {
                e.task.abort();
            }
        }
    }

    fn finish_shutdown(&mut self) {
        for w in self.shutdown_waiters.drain(..) {
            let _ = w.send(());
        }
    }

    fn on_command(&mut self, cmd: RegionCmd<E>) {
        match cmd {
            RegionCmd::Deliver { shard, entity_id, env } => {
                self.work.push_back(Work::Region(RegionInput::Route { shard, entity_id, msg: env }))
            }
            RegionCmd::State(tx) => {
                let _ = tx.send(self.state_reply());
            }
            RegionCmd::Stats(tx) => {
                let _ = tx.send(self.stats_reply());
            }
            RegionCmd::GracefulShutdown(tx) => {
                self.shutdown_waiters.push(tx);
                if self.shutdown_deadline.is_none() {
                    info!(type_name = %self.type_name, "region shutting down gracefully");
                    self.shutdown_deadline =
                        Some(Instant::now() + self.settings.handoff_timeout + Duration::from_secs(1));
                    self.work.push_back(Work::Region(RegionInput::GracefulShutdown));
                }
            }
        }
    }

    fn state_reply(&self) -> RegionStateReply {
        self.shards
            .iter()
            .map(|(s, sh)| {
                let mut ids: Vec<String> = sh.core.entity_ids().map(String::from).collect();
                ids.sort();
                (s.clone(), ids)
            })
            .collect()
    }

    fn stats_reply(&self) -> RegionStatsReply {
        self.shards.iter().map(|(s, sh)| (s.clone(), sh.core.entity_count())).collect()
    }

    fn on_members(&mut self, snap: Arc<MembershipSnapshot>) {
        let alive = |s: &MembershipSnapshot| -> HashSet<RegionId> {
            s.members
                .iter()
                .filter(|m| !matches!(m.status(), MemberStatus::Down | MemberStatus::Removed | MemberStatus::Exiting))
                .map(|m| m.address().clone())
                .collect()
        };
        let before = alive(&self.members);
        let now_alive = alive(&snap);
        for gone in before.difference(&now_alive) {
            self.work.push_back(Work::Region(RegionInput::RegionGone(gone.clone())));
            let lost: Vec<u64> = self.ask_targets.iter().filter(|(_, r)| *r == gone).map(|(id, _)| *id).collect();
            for id in lost {
                self.ask_targets.remove(&id);
                let reason = format!("the entity's node {gone} left or went down before answering");
                match self.pending_asks.remove(&id) {
                    Some(PendingAsk::Reply(tx)) => {
                        let _ = tx.send(Err(Error::NotDelivered { entity_id: String::new(), reason }));
                    }
                    Some(PendingAsk::Started(tx)) => {
                        let _ = tx.send(Err(Error::NotDelivered { entity_id: String::new(), reason }));
                    }
                    None => {}
                }
            }
        }
        let coordinator = snap.oldest(self.settings.role.as_deref()).map(|m| m.address().clone());
        self.members = snap;
        self.work.push_back(Work::Region(RegionInput::CoordinatorChanged(coordinator)));
    }

    fn on_inbound(&mut self, m: Inbound) {
        if let Some(id) = m.request_id {
            let reply = match wire::decode::<RegionQuery>(&m.body) {
                Ok(RegionQuery::Stats) => wire::encode(&self.stats_reply()),
                Ok(RegionQuery::State) => wire::encode(&self.state_reply()),
                Err(e) => Err(e),
            };
            let r = match &reply {
                Ok(b) => Ok(&b[..]),
                Err(e) => Err(e.to_string()),
            };
            let _ = self.transport.respond(&m.from, id, r);
            return;
        }
        match wire::decode::<RegionInbound>(&m.body) {
            Ok(RegionInbound::Coordinator(msg)) => {
                self.work.push_back(Work::Region(RegionInput::Coordinator { from: m.from.address, msg }))
            }
            Ok(RegionInbound::Region(RegionToRegion::Deliver { shard, entity_id, payload, reply_to })) => {
                let reply = reply_to.map(|(region, ask_id)| ReplyTo::Remote { region, ask_id });
                let msg = if payload.is_empty() {
                    None
                } else {
                    match wire::decode::<E::Message>(&payload) {
                        Ok(msg) => Some(msg),
                        Err(e) => {
                            self.counters.dropped_invalid.fetch_add(1, Ordering::Relaxed);
                            warn!(type_name = %self.type_name, peer = %m.from.address, %entity_id, error = %e, "message payload does not decode; dropped");
                            if let Some(r) = reply {
                                let err = not_delivered(&entity_id, format!("payload does not decode: {e}"));
                                send_reply::<E>(&self.transport, &self.members, &self.type_name, r, Err(err));
                            }
                            return;
                        }
                    }
                };
                if entity_id.is_empty() {
                    self.counters.dropped_invalid.fetch_add(1, Ordering::Relaxed);
                    warn!(type_name = %self.type_name, peer = %m.from.address, "message with an empty entity id dropped");
                    if let Some(r) = reply {
                        send_reply::<E>(&self.transport, &self.members, &self.type_name, r, Err(Error::EmptyEntityId));
                    }
                    return;
                }
                let env = Envelope { msg, reply };
                self.work.push_back(Work::Region(RegionInput::Route { shard, entity_id, msg: env }));
            }
            Ok(RegionInbound::Region(RegionToRegion::AskReply { ask_id, result })) => {
                self.ask_targets.remove(&ask_id);
                match self.pending_asks.remove(&ask_id) {
                    Some(PendingAsk::Reply(tx)) => {
                        let r = match result {
                            Ok(b) => wire::decode::<E::Reply>(&b),
                            Err(reason) => Err(Error::NotDelivered { entity_id: String::new(), reason }),
                        };
                        let _ = tx.send(r);
                    }
                    Some(PendingAsk::Started(tx)) => {
                        let _ = tx.send(
                            result
                                .map(|_| ())
                                .map_err(|reason| Error::NotDelivered { entity_id: String::new(), reason }),
                        );
                    }
                    None => {}
                }
            }
            Err(e) => {
                self.counters.dropped_invalid.fetch_add(1, Ordering::Relaxed);
                warn!(type_name = %self.type_name, peer = %m.from.address, error = %e, "malformed region message dropped");
            }
        }
    }

    fn on_event(&mut self, ev: EntityEvent<E>) {
        match ev {
            EntityEvent::Passivate { shard, entity_id, incarnation } => {
                self.work.push_back(Work::Shard(shard, ShardInput::Passivate { entity_id, incarnation }));
            }
            EntityEvent::ShardTasksEnded { shard } => {
                debug!(type_name = %self.type_name, %shard, "shard stopped (its aborted entities have ended)");
                self.work.push_back(Work::Region(RegionInput::LocalShardStopped(shard)));
            }
            EntityEvent::Terminated { shard, entity_id, incarnation, leftovers } => {
                let current = self
                    .shards
                    .get(&shard)
                    .and_then(|s| s.entities.get(&entity_id))
                    .is_some_and(|h| h.incarnation == incarnation);
                if current {
                    self.shards.get_mut(&shard).expect("shard").entities.remove(&entity_id);
                }
                self.work.push_back(Work::Shard(
                    shard.clone(),
                    ShardInput::Terminated { entity_id: entity_id.clone(), incarnation },
                ));
                let orphans = self.orphans.remove(&(shard.clone(), entity_id.clone())).unwrap_or_default();
                for env in leftovers.into_iter().chain(orphans) {
                    self.work.push_back(Work::Shard(
                        shard.clone(),
                        ShardInput::Deliver { entity_id: entity_id.clone(), msg: env },
                    ));
                }
            }
            EntityEvent::Store { shard, instance, input } => {
                if self.shards.get(&shard).is_none_or(|s| s.instance != instance) {
                    return; // a result for an instance that no longer exists
                }
                let input = match input {
                    StoreResult::Loaded(ids) => ShardInput::Loaded(ids),
                    StoreResult::WriteDone => ShardInput::WriteDone,
                    StoreResult::Failed => ShardInput::StoreFailed,
                    StoreResult::MovedAway(entity_id) => ShardInput::MovedAway { entity_id },
                };
                self.work.push_back(Work::Shard(shard, input));
            }
            EntityEvent::Recover { shard, instance, entity_ids } => {
                if self.shards.get(&shard).is_none_or(|s| s.instance != instance) {
                    return;
                }
                self.recover(&shard, instance, entity_ids);
            }
            EntityEvent::RestartShard { shard, epoch } => {
                if !self.shards.contains_key(&shard) && self.shutdown_deadline.is_none() {
                    info!(type_name = %self.type_name, %shard, "restarting shard after failure backoff");
                    self.start_shard(shard, epoch);
                }
            }
        }
    }

    /// Starts remembered entities: those still in this shard directly, the others (the
    /// extractor changed) through the region, forgetting them here once the new shard has them.
    fn recover(&mut self, shard: &ShardId, instance: u64, entity_ids: Vec<String>) {
        for id in entity_ids {
            let target = (self.extractor)(&id);
            if target == *shard {
                let env = Envelope { msg: None, reply: None };
                self.work.push_back(Work::Shard(shard.clone(), ShardInput::Deliver { entity_id: id, msg: env }));
                continue;
            }
            let (tx, rx) = oneshot::channel();
            let env = Envelope { msg: None, reply: Some(ReplyTo::Started(tx)) };
            self.work.push_back(Work::Region(RegionInput::Route { shard: target, entity_id: id.clone(), msg: env }));
            let events = self.events_tx.clone();
            let origin = shard.clone();
            tokio::spawn(async move {
                if let Ok(Ok(())) = rx.await {
                    let input = StoreResult::MovedAway(id);
                    let _ = events.send(EntityEvent::Store { shard: origin, instance, input });
                }
            });
        }
    }

    fn start_shard(&mut self, shard: ShardId, epoch: u64) {
        let stop_timeout =
            self.settings.handoff_timeout.saturating_sub(Duration::from_secs(5)).max(Duration::from_secs(1));
        let instance = self.next_shard_instance;
        self.next_shard_instance += 1;
        let core = if self.settings.remember_entities {
            ShardCore::remembering(stop_timeout, self.settings.entity_restart_backoff)
        } else {
            ShardCore::new(self.settings.passivation_idle_timeout, stop_timeout)
        };
        self.shards.insert(
            shard.clone(),
            LocalShard { core, epoch, entities: HashMap::new(), instance, tasks: TaskTracker::new() },
        );
        if self.settings.remember_entities {
            self.spawn_load(shard, instance);
        }
    }

    /// Loads the shard's remembered ids with a majority read of every slot.
    fn spawn_load(&self, shard: ShardId, instance: u64) {
        let replicator = self.node.replicator().clone();
        let events = self.events_tx.clone();
        let (type_name, slots) = (self.type_name.clone(), self.settings.remember_entities_slots);
        let timeout = self.settings.waiting_for_state_timeout;
        let (batch, interval) = (self.settings.entity_recovery_batch, self.settings.entity_recovery_interval);
        tokio::spawn(async move {
            let reads = (0..slots).map(|slot| {
                let key = super::remembered_entities_key(&type_name, &shard, slot);
                let replicator = replicator.clone();
                async move { replicator.get::<OrSet>(&key, REMEMBER_CONSISTENCY, timeout).await }
            });
            let mut ids = BTreeSet::new();
            for r in futures::future::join_all(reads).await {
                match r {
                    Ok(set) => ids.extend(set.map(|s| s.members()).unwrap_or_default()),
                    Err(e) => {
                        warn!(%type_name, %shard, error = %e, "loading remembered entities failed");
                        let _ = events.send(EntityEvent::Store { shard, instance, input: StoreResult::Failed });
                        return;
                    }
                }
            }
            debug!(%type_name, %shard, entities = ids.len(), "remembered entities loaded");
            let all: Vec<String> = ids.iter().cloned().collect();
            // The shard takes the set first; recovery starts follow (at the configured rate).
            let _ = events.send(EntityEvent::Store { shard: shard.clone(), instance, input: StoreResult::Loaded(ids) });
            if batch > 0 {
                for chunk in all.chunks(batch) {
                    tokio::time::sleep(interval).await;
                    let ev = EntityEvent::Recover { shard: shard.clone(), instance, entity_ids: chunk.to_vec() };
                    if events.send(ev).is_err() {
                        return;
                    }
                }
            }
        });
    }

    /// Records starts and stops of a shard's entities: one majority update per touched slot.
    fn spawn_write(&self, shard: ShardId, instance: u64, adds: BTreeSet<String>, removes: BTreeSet<String>) {
        let replicator = self.node.replicator().clone();
        let events = self.events_tx.clone();
        let (type_name, slots) = (self.type_name.clone(), self.settings.remember_entities_slots);
        let timeout = (self.settings.updating_state_timeout / 4).max(Duration::from_millis(100));
        tokio::spawn(async move {
            let mut by_slot: BTreeMap<u32, (Vec<String>, Vec<String>)> = BTreeMap::new();
            for id in adds {
                by_slot.entry(super::remembered_slot(&id, slots)).or_default().0.push(id);
            }
            for id in removes {
                by_slot.entry(super::remembered_slot(&id, slots)).or_default().1.push(id);
            }
            let writes = by_slot.into_iter().map(|(slot, (adds, removes))| {
                let key = super::remembered_entities_key(&type_name, &shard, slot);
                let replicator = replicator.clone();
                async move {
                    let mut last = Ok(());
                    // Akka's policy: a few tries with a quarter of the update timeout each.
                    for _ in 0..3 {
                        let (a, r) = (adds.clone(), removes.clone());
                        last = replicator
                            .update::<OrSet, _>(&key, REMEMBER_CONSISTENCY, timeout, move |set, ctx| {
                                if !a.is_empty() {
                                    set.add_all(ctx, a);
                                }
                                for id in &r {
                                    set.remove(id);
                                }
                            })
                            .await;
                        if last.is_ok() {
                            break;
                        }
                    }
                    last
                }
            });
            let mut result = StoreResult::WriteDone;
            for r in futures::future::join_all(writes).await {
                if let Err(e) = r {
                    warn!(%type_name, %shard, error = %e, "recording remembered entities failed");
                    result = StoreResult::Failed;
                }
            }
            let _ = events.send(EntityEvent::Store { shard, instance, input: result });
        });
    }

    fn process(&mut self) {
        let now = Instant::now();
        while let Some(w) = self.work.pop_front() {
            match w {
                Work::Region(input) => {
                    let mut out = Vec::new();
                    self.core.handle(input, now, &mut out);
                    for a in out {
                        self.perform_region(a);
                    }
                }
                Work::Shard(shard, input) => {
                    let Some(s) = self.shards.get_mut(&shard) else {
                        // Shard gone (handed off): fail what was meant for it.
                        if let ShardInput::Deliver { entity_id, msg } = input {
                            self.fail(msg, &entity_id, "shard is not hosted here");
                        }
                        continue;
                    };
                    let mut out = Vec::new();
                    s.core.handle(input, now, &mut out);
                    for a in out {
                        self.perform_shard(&shard, a);
                    }
                }
            }
        }
    }

    fn fail_orphans(&mut self, shard: &ShardId) {
        let keys: Vec<(ShardId, String)> = self.orphans.keys().filter(|(s, _)| s == shard).cloned().collect();
        for k in keys {
            for env in self.orphans.remove(&k).unwrap_or_default() {
                self.fail(env, &k.1, "its shard stopped");
            }
        }
    }

    fn fail(&self, env: Envelope<E>, entity_id: &str, reason: &str) {
        if let Some(r) = env.reply {
            send_reply::<E>(&self.transport, &self.members, &self.type_name, r, Err(not_delivered(entity_id, reason)));
        }
    }

    fn perform_region(&mut self, action: RegionAction<Envelope<E>>) {
        match action {
            RegionAction::ToCoordinator { coordinator, msg } => {
                let Some(peer) = peer_of(&self.members, &coordinator) else { return };
                match wire::encode(&msg) {
                    Ok(b) => {
                        if let Err(e) = self.transport.send(&peer, &coordinator_topic(&self.type_name), &b) {
                            debug!(error = %e, "message to coordinator not sent");
                        }
                    }
                    Err(e) => error!(error = %e, "cannot encode coordinator message"),
                }
            }
            RegionAction::StartShard { shard, epoch } => {
                if self.factory.is_none() {
                    error!(%shard, "a proxy was asked to host a shard; ignored");
                    return;
                }
                debug!(type_name = %self.type_name, %shard, epoch, "starting shard");
                match self.shards.get_mut(&shard) {
                    Some(existing) => existing.epoch = epoch,
                    None => self.start_shard(shard, epoch),
                }
            }
            RegionAction::Deliver { shard, entity_id, msg } => {
                if self.shards.contains_key(&shard) {
                    self.work.push_back(Work::Shard(shard, ShardInput::Deliver { entity_id, msg }));
                } else {
                    self.fail(msg, &entity_id, "this node does not host entities of this type");
                }
            }
            RegionAction::Forward { region, shard, entity_id, msg } => self.forward(region, shard, entity_id, msg),
            RegionAction::HandOffShard { shard } => self.work.push_back(Work::Shard(shard, ShardInput::HandOff)),
            RegionAction::Drop { entity_id, msg, reason } => {
                let why = match reason {
                    RegionDrop::BufferFull => {
                        if self.counters.dropped_buffer_full.fetch_add(1, Ordering::Relaxed) == 0 {
                            warn!(type_name = %self.type_name, "region buffer full; dropping messages");
                        }
                        "region buffer full"
                    }
                    RegionDrop::HandOff => {
                        self.counters.dropped_handoff.fetch_add(1, Ordering::Relaxed);
                        "dropped during shard hand-off"
                    }
                };
                self.fail(msg, &entity_id, why);
            }
            RegionAction::Stopped => {
                info!(type_name = %self.type_name, "region stopped after handing off its shards");
                self.finish_shutdown();
            }
        }
    }

    fn forward(&mut self, region: RegionId, shard: ShardId, entity_id: String, env: Envelope<E>) {
        let Some(peer) = peer_of(&self.members, &region) else {
            // The home is gone: forget it and route again (buffer, ask the coordinator).
            self.work.push_back(Work::Region(RegionInput::RegionGone(region)));
            self.work.push_back(Work::Region(RegionInput::Route { shard, entity_id, msg: env }));
            return;
        };
        let payload = match &env.msg {
            Some(m) => match wire::encode(m) {
                Ok(b) => b.to_vec(),
                Err(e) => {
                    self.fail(env, &entity_id, &format!("message does not encode: {e}"));
                    return;
                }
            },
            None => Vec::new(),
        };
        let (reply_to, pending) = match env.reply {
            None => (None, None),
            Some(ReplyTo::Remote { region, ask_id }) => (Some((region, ask_id)), None),
            Some(ReplyTo::Local(tx)) => {
                let id = self.next_ask;
                self.next_ask += 1;
                (Some((self.me.clone(), id)), Some((id, PendingAsk::Reply(tx))))
            }
            Some(ReplyTo::Started(tx)) => {
                let id = self.next_ask;
                self.next_ask += 1;
                (Some((self.me.clone(), id)), Some((id, PendingAsk::Started(tx))))
            }
        };
        let msg =
            RegionInbound::Region(RegionToRegion::Deliver { shard, entity_id: entity_id.clone(), payload, reply_to });
        let sent = wire::encode(&msg).and_then(|b| self.transport.send(&peer, &region_topic(&self.type_name), &b));
        match (sent, pending) {
            (Ok(()), Some((id, p))) => {
                self.pending_asks.insert(id, p);
                self.ask_targets.insert(id, region.clone());
            }
            (Ok(()), None) => {}
            (Err(e), Some((_, p))) => {
                let err = not_delivered(&entity_id, format!("not sent to {region}: {e}"));
                match p {
                    PendingAsk::Reply(tx) => {
                        let _ = tx.send(Err(err));
                    }
                    PendingAsk::Started(tx) => {
                        let _ = tx.send(Err(err));
                    }
                }
            }
            (Err(e), None) => debug!(%region, error = %e, "message not forwarded"),
        }
    }

    fn perform_shard(&mut self, shard_id: &ShardId, action: ShardAction<Envelope<E>>) {
        match action {
            ShardAction::Start { entity_id, incarnation } => {
                let factory = self.factory.clone().expect("only regions with a factory host shards");
                let shard = self.shards.get_mut(shard_id).expect("shard");
                let (tx, rx) = mpsc::unbounded_channel();
                let ctx = EntityContext {
                    entity_id: entity_id.clone(),
                    shard_id: shard_id.clone(),
                    epoch: shard.epoch,
                    passivate: false,
                };
                let runner = EntityRunner {
                    ctx,
                    incarnation,
                    events: self.events_tx.clone(),
                    transport: self.transport.clone(),
                    members: self.node.watch_membership(),
                    type_name: self.type_name.clone(),
                    counters: self.counters.clone(),
                };
                let task =
                    tokio::spawn(self.entity_tasks.track_future(shard.tasks.track_future(runner.run(factory, rx))));
                shard.entities.insert(entity_id, EntityHandle { tx, task, incarnation });
            }
            ShardAction::Send { entity_id, msg } => {
                let shard = self.shards.get_mut(shard_id).expect("shard");
                match shard.entities.get(&entity_id) {
                    Some(h) => {
                        if let Err(mpsc::error::SendError(EntityCmd::Msg(env))) = h.tx.send(EntityCmd::Msg(msg)) {
                            // The task already ended; its Terminated event is on the way. The
                            // message goes to the next incarnation after it (not back into this
                            // loop, which would spin until the event is read).
                            self.orphans.entry((shard_id.clone(), entity_id)).or_default().push(env);
                        }
                    }
                    None => self.fail(msg, &entity_id, "entity is not running"),
                }
            }
            ShardAction::Stop { entity_id } => {
                if let Some(h) = self.shards.get(shard_id).and_then(|s| s.entities.get(&entity_id)) {
                    let _ = h.tx.send(EntityCmd::Stop);
                }
            }
            ShardAction::ForceStop { entity_id } => {
                if let Some(h) = self.shards.get_mut(shard_id).and_then(|s| s.entities.remove(&entity_id)) {
                    warn!(type_name = %self.type_name, %entity_id, "entity did not stop within the hand-off timeout; aborted");
                    h.task.abort();
                }
            }
            ShardAction::Drop { entity_id, msg, reason } => {
                let why = match reason {
                    DropReason::HandOff => {
                        self.counters.dropped_handoff.fetch_add(1, Ordering::Relaxed);
                        "dropped during shard hand-off"
                    }
                    DropReason::ShardFailed => "its shard failed and restarts after shard_failure_backoff",
                };
                self.fail(msg, &entity_id, why);
            }
            ShardAction::Recover { entity_ids } => {
                let Some(s) = self.shards.get(shard_id) else { return };
                let instance = s.instance;
                if self.settings.entity_recovery_batch == 0 {
                    self.recover(shard_id, instance, entity_ids);
                }
                // Otherwise the load task feeds them in batches.
            }
            ShardAction::WriteRemembered { adds, removes } => {
                if let Some(s) = self.shards.get(shard_id) {
                    self.spawn_write(shard_id.clone(), s.instance, adds, removes);
                }
            }
            ShardAction::Failed => {
                self.fail_orphans(shard_id);
                let Some(s) = self.shards.remove(shard_id) else { return };
                for (_, e) in s.entities {
                    e.task.abort();
                }
                self.counters.shard_failures.fetch_add(1, Ordering::Relaxed);
                warn!(type_name = %self.type_name, shard = %shard_id, backoff = ?self.settings.shard_failure_backoff, "shard failed; restarting after backoff");
                let events = self.events_tx.clone();
                let (shard, epoch, backoff) = (shard_id.clone(), s.epoch, self.settings.shard_failure_backoff);
                let tasks = s.tasks;
                tasks.close();
                tokio::spawn(async move {
                    tasks.wait().await;
                    tokio::time::sleep(backoff).await;
                    let _ = events.send(EntityEvent::RestartShard { shard, epoch });
                });
            }
            ShardAction::Stopped => {
                self.fail_orphans(shard_id);
                let Some(s) = self.shards.remove(shard_id) else {
                    self.work.push_back(Work::Region(RegionInput::LocalShardStopped(shard_id.clone())));
                    return;
                };
                for (_, e) in s.entities {
                    e.task.abort();
                }
                s.tasks.close();
                if s.tasks.is_empty() {
                    debug!(type_name = %self.type_name, shard = %shard_id, "shard stopped");
                    self.work.push_back(Work::Region(RegionInput::LocalShardStopped(shard_id.clone())));
                } else {
                    // Aborted entities end at their next await; report the shard stopped (so it
                    // may start elsewhere) only then.
                    let (events, shard, tasks) = (self.events_tx.clone(), shard_id.clone(), s.tasks);
                    tokio::spawn(async move {
                        tasks.wait().await;
                        let _ = events.send(EntityEvent::ShardTasksEnded { shard });
                    });
                }
            }
        }
    }
}

/// Runs one entity: creates it, handles its mailbox one message at a time, isolates panics.
struct EntityRunner<E: Entity> {
    ctx: EntityContext,
    incarnation: u64,
    events: mpsc::UnboundedSender<EntityEvent<E>>,
    transport: Transport,
    members: watch::Receiver<Arc<MembershipSnapshot>>,
    type_name: String,
    counters: Arc<RegionCounters>,
}

impl<E: Entity> EntityRunner<E> {
    fn respond(&self, reply: Option<ReplyTo<E>>, result: Result<Option<E::Reply>>) {
        if let Some(r) = reply {
            let members = self.members.borrow().clone();
            send_reply::<E>(&self.transport, &members, &self.type_name, r, result);
        }
    }

    fn terminated(&self, leftovers: Vec<Envelope<E>>) {
        let _ = self.events.send(EntityEvent::Terminated {
            shard: self.ctx.shard_id.clone(),
            entity_id: self.ctx.entity_id.clone(),
            incarnation: self.incarnation,
            leftovers,
        });
    }

    /// Fails every queued message with `reason` and reports the incarnation ended.
    fn fail_queued_and_end(&self, inbox: &mut mpsc::UnboundedReceiver<EntityCmd<E>>, reason: &str) {
        inbox.close();
        while let Ok(cmd) = inbox.try_recv() {
            if let EntityCmd::Msg(env) = cmd {
                self.respond(env.reply, Err(not_delivered(&self.ctx.entity_id, reason)));
            }
        }
        self.terminated(Vec::new());
    }

    async fn run(mut self, factory: Factory<E>, mut inbox: mpsc::UnboundedReceiver<EntityCmd<E>>) {
        let id = self.ctx.entity_id.clone();
        let mut entity = match std::panic::catch_unwind(AssertUnwindSafe(|| factory(&id))) {
            Ok(e) => e,
            Err(_) => {
                self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                error!(type_name = %self.type_name, entity_id = %id, "entity factory panicked; failing its messages");
                self.fail_queued_and_end(&mut inbox, "entity factory panicked");
                return;
            }
        };
        if let Err(panic) = AssertUnwindSafe(entity.started(&self.ctx)).catch_unwind().await {
            self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
            let what = panic_text(&*panic);
            error!(type_name = %self.type_name, entity_id = %id, panic = %what, "entity start hook panicked; entity stopped");
            drop(entity);
            // Its queued messages fail (as after a panicking factory): handing them to a fresh
            // instance would spin if the hook always panics, since no message gets consumed.
            self.fail_queued_and_end(&mut inbox, &format!("entity start hook panicked: {what}"));
            return;
        }
        while let Some(cmd) = inbox.recv().await {
            let env = match cmd {
                EntityCmd::Stop => break,
                EntityCmd::Msg(env) => env,
            };
            let Some(msg) = env.msg else {
                self.respond(env.reply, Ok(None));
                continue;
            };
            let outcome = AssertUnwindSafe(entity.handle(msg, &mut self.ctx)).catch_unwind().await;
            match outcome {
                Ok(reply) => self.respond(env.reply, Ok(Some(reply))),
                Err(panic) => {
                    self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                    let what = panic_text(&*panic);
                    drop(entity);
                    error!(type_name = %self.type_name, entity_id = %id, panic = %what, "entity handler panicked; entity stopped");
                    self.respond(env.reply, Err(not_delivered(&id, format!("entity handler panicked: {what}"))));
                    // Messages still queued go to a fresh instance.
                    inbox.close();
                    let mut leftovers = Vec::new();
                    while let Ok(cmd) = inbox.try_recv() {
                        if let EntityCmd::Msg(env) = cmd {
                            leftovers.push(env);
                        }
                    }
                    self.terminated(leftovers);
                    return;
                }
            }
            if std::mem::take(&mut self.ctx.passivate) {
                let _ = self.events.send(EntityEvent::Passivate {
                    shard: self.ctx.shard_id.clone(),
                    entity_id: id.clone(),
                    incarnation: self.incarnation,
                });
            }
        }
        // Gone before anyone hears it terminated: the next incarnation may start elsewhere.
        drop(entity);
        self.terminated(Vec::new());
    }
}

/// The message of a caught panic, if it carried one.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// Runs the coordinator of one type while this node is the oldest member with the role.
struct CoordinatorRunner {
    node: Node,
    type_name: String,
    settings: ShardingSettings,
    strategy: Arc<dyn super::ShardAllocationStrategy>,
}

/// Consistency of remembered-entity reads and writes: plain majorities, so a shard keeps working
/// while a minority of nodes is unreachable (majority reads and writes always intersect).
const REMEMBER_CONSISTENCY: Consistency = Consistency::MAJORITY;

/// Consistency of coordinator state writes (Akka's WriteMajorityPlus, 3 and min-cap 5 by default).
fn state_write(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator_write_majority_plus, min_cap: s.coordinator_majority_min_cap }
}

/// Consistency of the state read at take-over (ReadMajorityPlus, 5 and min-cap 5 by default).
fn state_read(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator_read_majority_plus, min_cap: s.coordinator_majority_min_cap }
}

fn state_key(type_name: &str) -> String {
    format!("sharding-coordinator-{type_name}")
}

/// The coordinator runs on the oldest Up/Leaving member with the role; an older member that
/// was downed but is not yet removed (down-removal margin) still blocks the take-over, so the
/// old coordinator has stopped before a new one starts.
fn i_am_coordinator(snap: &MembershipSnapshot, role: Option<&str>) -> bool {
    snap.members
        .iter()
        .find(|m| {
            m.has_role(role) && matches!(m.status(), MemberStatus::Up | MemberStatus::Leaving | MemberStatus::Down)
        })
        .is_some_and(|m| *m.address() == snap.self_address && m.status() != MemberStatus::Down)
}

/// A region is terminated once its member is gone or exiting; a downed member's region counts
/// as alive until the down-removal margin removes the member.
fn region_alive(snap: &MembershipSnapshot, region: &RegionId) -> bool {
    snap.members.iter().any(|m| {
        m.address() == region
            && matches!(
                m.status(),
                MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving | MemberStatus::Down
            )
    })
}

fn rebalance_allowed(snap: &MembershipSnapshot) -> bool {
    snap.members.iter().all(|m| m.is_reachable() && m.status() != MemberStatus::Joining)
}

impl CoordinatorRunner {
    async fn run(self, shutdown: tokio_util::sync::CancellationToken) {
        let mut members = self.node.watch_membership();
        let role = self.settings.role.clone();
        loop {
            let me = i_am_coordinator(&members.borrow_and_update(), role.as_deref());
            if me {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.serve(members.clone(), shutdown.clone()) => {}
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = members.changed() => if r.is_err() { return },
            }
        }
    }

    /// Reads the state (majority) and runs the coordinator until this node is no longer oldest.
    async fn serve(
        &self,
        mut members: watch::Receiver<Arc<MembershipSnapshot>>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let role = self.settings.role.as_deref();
        let key = state_key(&self.type_name);
        let replicator = self.node.replicator().clone();
        let mut attempts = 0u32;
        let map = loop {
            match replicator
                .get::<LwwMap>(&key, state_read(&self.settings), self.settings.waiting_for_state_timeout)
                .await
            {
                Ok(m) => break m.unwrap_or_default(),
                Err(e) => {
                    attempts += 1;
                    if attempts < 5 {
                        info!(type_name = %self.type_name, error = %e, "coordinator waiting for its state");
                    } else {
                        warn!(type_name = %self.type_name, error = %e, attempts, "coordinator still cannot read its state");
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            if !i_am_coordinator(&members.borrow(), role) || shutdown.is_cancelled() {
                return;
            }
        };
        // The read may have taken a while: if this node stopped being the oldest meanwhile (it
        // is leaving, say), a coordinator started now would run beside its successor until
        // the next membership change, both allocating shards. Found by random fault seed 20.
        if !i_am_coordinator(&members.borrow_and_update(), role) || shutdown.is_cancelled() {
            info!(type_name = %self.type_name, "no longer the oldest member after reading the state; not starting");
            return;
        }
        let state = CoordinatorState::from_map(&map);
        info!(type_name = %self.type_name, shards = state.shards.len(), regions = state.regions.len(), "coordinator started");
        let cs = CoordinatorSettings {
            min_nr_of_members: self.settings.min_nr_of_members,
            rebalance_interval: self.settings.rebalance_interval,
            handoff_timeout: self.settings.handoff_timeout,
            shard_start_timeout: self.settings.shard_start_timeout,
            eager_reallocation: self.settings.remember_entities,
        };
        let me = self.node.address().clone();
        let strategy: Arc<dyn super::ShardAllocationStrategy> =
            Arc::new(super::allocation::PanicGuardedStrategy(self.strategy.clone()));
        let mut core = CoordinatorCore::new(me, cs, strategy, state, Instant::now());
        let transport = self.node.transport().clone();
        let topic = coordinator_topic(&self.type_name);
        let mut inbound = transport.subscribe(&topic, 65_536);
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<()>();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut out = Vec::new();
        let mut snap = members.borrow_and_update().clone();
        self.check_members(&mut core, &snap, &mut out);
        core.handle(CoordinatorInput::TakeOver, Instant::now(), wall_ms(), &mut out);
        if self.settings.remember_entities {
            let key = super::remembered_shards_key(&self.type_name);
            let shards = loop {
                match replicator
                    .get::<GSet>(&key, state_read(&self.settings), self.settings.waiting_for_state_timeout)
                    .await
                {
                    Ok(s) => break s.map(|s| s.members()).unwrap_or_default(),
                    Err(e) => warn!(type_name = %self.type_name, error = %e, "cannot read the remembered shards yet"),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                if !i_am_coordinator(&members.borrow(), role) || shutdown.is_cancelled() {
                    transport.unsubscribe(&topic);
                    return;
                }
            };
            if !i_am_coordinator(&members.borrow(), role) || shutdown.is_cancelled() {
                transport.unsubscribe(&topic);
                return;
            }
            info!(type_name = %self.type_name, shards = shards.len(), "allocating remembered shards");
            core.handle(CoordinatorInput::RememberedShards(shards), Instant::now(), wall_ms(), &mut out);
        }
        let mut writes: Vec<JoinHandle<()>> = Vec::new();
        loop {
            writes.retain(|w| !w.is_finished());
            writes.extend(self.perform(&mut out, &snap, &done_tx));
            let now = Instant::now();
            let wall = wall_ms();
            tokio::select! {
                _ = shutdown.cancelled() => break,
                m = inbound.recv() => match m {
                    Some(m) => self.on_inbound(&mut core, m, &snap, &mut out),
                    None => break,
                },
                Some(()) = done_rx.recv() => {
                    debug!(type_name = %self.type_name, "coordinator state write acknowledged");
                    core.handle(CoordinatorInput::WriteDone, now, wall, &mut out)
                }
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    snap = members.borrow_and_update().clone();
                    if !i_am_coordinator(&snap, role) {
                        info!(type_name = %self.type_name, "no longer the oldest member; coordinator stops");
                        break;
                    }
                    self.check_members(&mut core, &snap, &mut out);
                }
                _ = tick.tick() => {
                    // Also checked without a membership change: a change consumed while this
                    // coordinator was busy must not leave it running.
                    if !i_am_coordinator(&members.borrow(), role) {
                        info!(type_name = %self.type_name, "no longer the oldest member; coordinator stops");
                        break;
                    }
                    core.handle(CoordinatorInput::Tick, now, wall, &mut out)
                }
            }
        }
        transport.unsubscribe(&topic);
        // A write still retrying must not land after a successor took over.
        for w in writes {
            w.abort();
        }
    }

    fn check_members(&self, core: &mut CoordinatorCore, snap: &MembershipSnapshot, out: &mut Vec<CoordinatorAction>) {
        let now = Instant::now();
        let dead: Vec<RegionId> = core.all_regions().filter(|r| !region_alive(snap, r)).cloned().collect();
        for r in dead {
            core.handle(CoordinatorInput::RegionTerminated(r), now, wall_ms(), out);
        }
        core.handle(CoordinatorInput::RebalanceAllowed(rebalance_allowed(snap)), now, wall_ms(), out);
    }

    fn on_inbound(
        &self,
        core: &mut CoordinatorCore,
        m: Inbound,
        snap: &MembershipSnapshot,
        out: &mut Vec<CoordinatorAction>,
    ) {
        let transport = self.node.transport();
        if let Some(id) = m.request_id {
            let reply = match wire::decode::<CoordinatorQuery>(&m.body) {
                Ok(CoordinatorQuery::CurrentRegions) => {
                    wire::encode(&core.regions().cloned().collect::<BTreeSet<RegionId>>())
                }
                Err(e) => Err(e),
            };
            let r = match &reply {
                Ok(b) => Ok(&b[..]),
                Err(e) => Err(e.to_string()),
            };
            let _ = transport.respond(&m.from, id, r);
            return;
        }
        match wire::decode::<ToCoordinator>(&m.body) {
            Ok(msg) => {
                debug!(type_name = %self.type_name, ?msg, "coordinator received");
                if let ToCoordinator::Register { region, .. } = &msg {
                    // Only members that are up may register (a joining node retries).
                    let up = snap.members.iter().any(|x| x.address() == region && x.status().is_up_or_leaving());
                    if !up {
                        debug!(%region, "registration from a member that is not up yet; ignored");
                        return;
                    }
                }
                core.handle(CoordinatorInput::FromRegion(msg), Instant::now(), wall_ms(), out);
            }
            Err(e) => warn!(peer = %m.from.address, error = %e, "malformed coordinator message dropped"),
        }
    }

    fn perform(
        &self,
        out: &mut Vec<CoordinatorAction>,
        snap: &MembershipSnapshot,
        done: &mpsc::UnboundedSender<()>,
    ) -> Option<JoinHandle<()>> {
        let topic = region_topic(&self.type_name);
        let mut write = None;
        for action in out.drain(..) {
            match action {
                CoordinatorAction::Send { to, msg } => {
                    let Some(peer) = peer_of(snap, &to) else { continue };
                    match wire::encode(&RegionInbound::Coordinator(msg)) {
                        Ok(b) => {
                            if let Err(e) = self.node.transport().send(&peer, &topic, &b) {
                                debug!(region = %to, error = %e, "coordinator message not sent");
                            }
                        }
                        Err(e) => error!(error = %e, "cannot encode region message"),
                    }
                }
                CoordinatorAction::Write(entries) => {
                    debug!(type_name = %self.type_name, entries = entries.len(), "coordinator state write started");
                    let replicator = self.node.replicator().clone();
                    let key = state_key(&self.type_name);
                    let timeout = self.settings.updating_state_timeout;
                    let consistency = state_write(&self.settings);
                    let done = done.clone();
                    let type_name = self.type_name.clone();
                    // Remember-entities: allocated shards also go into the durable set of shards.
                    let remembered: Option<BTreeSet<ShardId>> = self.settings.remember_entities.then(|| {
                        entries
                            .iter()
                            .filter(|(_, v)| v.is_some())
                            .filter_map(|(k, _)| k.strip_prefix("s/").map(String::from))
                            .collect()
                    });
                    let gset_key = super::remembered_shards_key(&self.type_name);
                    write = Some(tokio::spawn(async move {
                        let mut backoff = Duration::from_millis(100);
                        loop {
                            let e2 = entries.clone();
                            let r = replicator
                                .update::<LwwMap, _>(&key, consistency, timeout, move |m, ctx| {
                                    for (k, v) in e2 {
                                        match v {
                                            Some(bytes) => m.put(ctx, k, bytes),
                                            None => m.remove(ctx, &k),
                                        }
                                    }
                                })
                                .await;
                            let r = match (r, &remembered) {
                                (Ok(()), Some(shards)) if !shards.is_empty() => {
                                    let shards = shards.clone();
                                    replicator
                                        .update::<GSet, _>(&gset_key, consistency, timeout, move |g, _| {
                                            for s in shards {
                                                g.insert(s);
                                            }
                                        })
                                        .await
                                }
                                (r, _) => r,
                            };
                            match r {
                                Ok(()) => break,
                                Err(Error::ShutDown) => return,
                                Err(e) => {
                                    warn!(type_name = %type_name, error = %e, "coordinator state write failed; retrying");
                                    tokio::time::sleep(backoff).await;
                                    backoff = (backoff * 2).min(Duration::from_secs(2));
                                }
                            }
                        }
                        let _ = done.send(());
                    }));
                }
            }
        }
        write
    }
}
