//! The public handle of a region: [`ShardRegion`] sends to entities by id and queries the
//! region and the cluster; [`start_region`] spawns the region task and, where this node may host
//! the coordinator, the coordinator's singleton driver.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use super::attached::{self, RegionControl};
use super::counters::{RegionCounterCells, RegionCounters};
use super::envelope::{Envelope, Lane, Replier, ReplyTo, RoutedInFlight, not_delivered};
use super::ids::{RegionId, ShardId, ShardIdExtractor, ShardNames, check_entity_id, valid_type_name};
use super::protocol::CoordinatorQuery;
use super::query::{EntityIdPage, RegionInfo};
use super::region::{
    Direct, PeerSenders, RegionCmd, RegionCommands, RegionCore, RegionDriver, RegionSettings, RemoteHomes,
    SharedRegion, region_commands,
};
use super::region_ref::{RegionRef, coordinator_request, stand_in_has_no_cluster};
use super::settings::ShardingSettings;
use super::shard::{Factory, LocalShards, RegionParts};
use super::{ClusterShardingStats, Entity, StartOptions, coordinator, keys};
use crate::ddata::{Consistency, LwwMap};
use crate::deadline::DeadlineSweep;
use crate::error::{Error, Result};
use crate::metrics::{TypeMetrics, start_timer};
use crate::node::Node;

/// Waits for an entity's answer up to `timeout` after `started` (when the caller read the
/// clock already; else from its first wait): by the node's deadline sweep, it times out no
/// earlier than `timeout`, and less than `deadline::RESOLUTION` later.
async fn await_answer<T>(
    deadlines: &DeadlineSweep,
    entity_id: &str,
    rx: oneshot::Receiver<Result<T>>,
    (started, timeout): (Option<crate::clock::Instant>, Duration),
) -> Result<T> {
    match deadlines.within_from(started, timeout, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(not_delivered(entity_id, "entity stopped")),
        Err(_) => Err(Error::AskTimeout { entity_id: entity_id.to_string(), timeout }),
    }
}

pub(crate) struct HandleInner<E: Entity> {
    type_name: String,
    /// `None` for a stand-in ([`ShardRegion::stand_in`]): no cluster behind it.
    node: Option<Node>,
    /// The deadlines its asks wait under (the node's, or a stand-in's own).
    deadlines: DeadlineSweep,
    settings: ShardingSettings,
    shard_names: ShardNames,
    commands: RegionCommands<E>,
    buffered: Arc<AtomicUsize>,
    counters: Arc<RegionCounterCells>,
    proxy: bool,
    /// This handle's messages on the routed path, by stripe of entity id (ordering between
    /// the direct and the routed path).
    routed: Arc<RoutedInFlight>,
    /// The region's fast paths: the shards hosted here (none for a proxy) for the local direct
    /// path, and the published remote homes; set before the handle is handed out.
    shared: OnceLock<Arc<SharedRegion<E>>>,
    /// Ask latencies by outcome, hand-off durations (feature `metrics`; nothing without it).
    metrics: Arc<TypeMetrics>,
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

impl<E: Entity> HandleInner<E> {
    /// A handle with no node behind it, its messages going to `commands` (see
    /// [`ShardRegion::stand_in`]).
    pub(crate) fn new_stand_in(
        type_name: &str,
        settings: ShardingSettings,
        extractor: ShardIdExtractor,
        commands: RegionCommands<E>,
        buffered: Arc<AtomicUsize>,
        routed: Arc<RoutedInFlight>,
        deadlines: DeadlineSweep,
    ) -> Self {
        HandleInner {
            type_name: type_name.to_string(),
            node: None,
            deadlines,
            settings,
            shard_names: ShardNames::custom(extractor),
            commands,
            buffered,
            counters: Arc::new(RegionCounterCells::default()),
            proxy: false,
            routed,
            shared: OnceLock::new(),
            metrics: Arc::new(TypeMetrics::new("stand-in", type_name)),
        }
    }

    /// The shard of `entity_id` ([`ShardNames::of`]).
    fn shard_name(&self, entity_id: &str) -> std::borrow::Cow<'_, str> {
        self.shard_names.of(entity_id)
    }

    /// The node behind the region; a stand-in has none.
    fn node(&self) -> Result<&Node> {
        self.node.as_ref().ok_or_else(|| stand_in_has_no_cluster(&self.type_name))
    }
}

/// One entity of a [`ShardRegion`], by id ([`ShardRegion::entity_ref`]). Cheap to clone;
/// messages sent through it go the way [`ShardRegion::tell`] and [`ShardRegion::ask`] send
/// them (in order from one region, wherever the entity lives).
pub struct EntityRef<E: Entity> {
    region: ShardRegion<E>,
    entity_id: String,
}

impl<E: Entity> Clone for EntityRef<E> {
    fn clone(&self) -> Self {
        EntityRef { region: self.region.clone(), entity_id: self.entity_id.clone() }
    }
}

impl<E: Entity> std::fmt::Debug for EntityRef<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityRef")
            .field("type_name", &self.region.type_name())
            .field("entity_id", &self.entity_id)
            .finish()
    }
}

impl<E: Entity> EntityRef<E> {
    /// The entity's id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }

    /// [`ShardRegion::tell`] to this entity.
    pub fn tell(&self, msg: E::Message) -> Result<()> {
        self.region.tell(&self.entity_id, msg)
    }

    /// [`ShardRegion::ask`] of this entity.
    pub async fn ask(&self, msg: E::Message) -> Result<E::Reply> {
        self.region.ask(&self.entity_id, msg).await
    }

    /// [`ShardRegion::ask_with_timeout`] of this entity.
    pub async fn ask_with_timeout(&self, msg: E::Message, timeout: Duration) -> Result<E::Reply> {
        self.region.ask_with_timeout(&self.entity_id, msg, timeout).await
    }

    /// [`ShardRegion::request`] of this entity.
    pub async fn request<R: super::Request<E>>(&self, request: R) -> Result<R::Reply> {
        self.region.request(&self.entity_id, request).await
    }
}

impl<E: Entity> ShardRegion<E> {
    pub(crate) fn from_inner(inner: Arc<HandleInner<E>>) -> Self {
        ShardRegion { inner }
    }

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
        self.inner.shard_name(entity_id).into_owned()
    }

    /// What this region counted since it started (messages by path, drops by reason,
    /// hand-offs, …), as of now.
    pub fn counters(&self) -> RegionCounters {
        self.inner.counters.snapshot()
    }

    /// Sends `env` on its way: straight into the entity's mailbox when it runs here and no
    /// earlier message of this handle to it is still on the routed path; through the region
    /// task otherwise.
    fn submit(&self, entity_id: &str, mut env: Envelope<E>) -> Result<()> {
        let i = &self.inner;
        check_entity_id(entity_id, i.settings.max_entity_id_bytes)?;
        let shard = i.shard_name(entity_id);
        let shard: &str = &shard;
        let stripe = RoutedInFlight::stripe(entity_id);
        if let Some(direct) = i.shared.get().and_then(|f| f.direct.as_ref())
            && i.routed.is_clear(stripe)
        {
            match direct.deliver(shard, entity_id, stripe, env) {
                Ok(()) => return Ok(()),
                Err(back) => env = back,
            }
        }
        if let Some(shared) = i.shared.get() {
            match shared.send_direct(shard, entity_id, stripe, env) {
                Direct::Sent(sent) => return sent,
                Direct::Routed(back) => env = back,
            }
        }
        // Waiting for a home in the task, or for the task itself to take them.
        if i.buffered.load(Ordering::Relaxed) + i.commands.queued() >= i.settings.buffer_size {
            if i.counters.dropped_buffer_full.fetch_add(1, Ordering::Relaxed) == 0 {
                warn!(type_name = %i.type_name, "region buffer full; dropping messages");
            }
            return Err(Error::BufferFull { type_name: i.type_name.clone(), buffer_size: i.settings.buffer_size });
        }
        i.counters.local_routed.fetch_add(1, Ordering::Relaxed);
        env.lane = Lane::Routed { _ticket: i.routed.ticket(stripe) };
        i.commands
            .send(RegionCmd::Deliver { shard: shard.to_string(), entity_id: entity_id.to_string(), env })
            .map_err(|_| Error::ShutDown)
    }

    /// A handle on one entity of this region: [`EntityRef::tell`] and [`EntityRef::ask`]
    /// without naming the id each time (a reference to pass to the code that talks to that
    /// entity only). The id is checked when a message is sent, as by [`ShardRegion::tell`].
    pub fn entity_ref(&self, entity_id: impl Into<String>) -> EntityRef<E> {
        EntityRef { region: self.clone(), entity_id: entity_id.into() }
    }

    /// Sends a message to entity `entity_id`, wherever it lives; no reply. Messages from this
    /// region to one entity arrive in the order sent.
    pub fn tell(&self, entity_id: &str, msg: E::Message) -> Result<()> {
        self.submit(entity_id, Envelope::new(Some(msg), None))
    }

    /// Sends a message and waits for the entity's reply, up to the settings' `ask_timeout`:
    /// [`Error::AskTimeout`] never comes before it, and less than 5 ms (plus scheduling delay)
    /// after it.
    pub async fn ask(&self, entity_id: &str, msg: E::Message) -> Result<E::Reply> {
        self.ask_with_timeout(entity_id, msg, self.inner.settings.ask_timeout).await
    }

    /// [`ShardRegion::ask`] with an explicit timeout.
    pub async fn ask_with_timeout(&self, entity_id: &str, msg: E::Message, timeout: Duration) -> Result<E::Reply> {
        let started = start_timer();
        let (tx, rx) = oneshot::channel();
        let result = match self.submit(entity_id, Envelope::new(Some(msg), Some(ReplyTo::Local(tx)))) {
            Ok(()) => await_answer(&self.inner.deadlines, entity_id, rx, (started, timeout)).await,
            Err(e) => Err(e),
        };
        self.inner.metrics.ask_done(started, &result);
        result
    }

    /// Sends a typed request ([`super::Request`]) and waits for its typed answer, up to the
    /// settings' `ask_timeout`, as [`ShardRegion::ask`] does; an entity that answers with
    /// another kind of reply is [`Error::UnexpectedReply`].
    pub async fn request<R: super::Request<E>>(&self, entity_id: &str, request: R) -> Result<R::Reply> {
        let reply = self.ask(entity_id, request.into()).await?;
        R::reply_of(reply).ok_or_else(|| Error::UnexpectedReply {
            entity_id: entity_id.to_string(),
            request: std::any::type_name::<R>(),
        })
    }

    /// Starts entity `entity_id`, trying again every 200 ms until it runs (a coordinator or
    /// home that is not there yet); false when this node shut down first.
    pub(crate) async fn start_entity_until_running(&self, entity_id: &str) -> bool {
        loop {
            match self.start_entity(entity_id).await {
                Ok(()) => return true,
                Err(Error::ShutDown) => return false,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Sends a reliable delivery: `msg` with its `header`; `sink` gets the entity's outcome (or
    /// why there is none). An error here means it was not sent (the sink's own report of the
    /// drop then follows).
    pub(crate) fn deliver_reliably(
        &self,
        entity_id: &str,
        header: super::delivery::DeliveryHeader,
        msg: E::Message,
        sink: super::envelope::OutcomeSink,
    ) -> Result<()> {
        let to = super::envelope::OutcomeTo::Local(sink);
        let reply = ReplyTo::Delivery(Box::new(super::envelope::DeliveryReply { header, to }));
        self.submit(entity_id, Envelope::new(Some(msg), Some(reply)))
    }

    /// A store of fenced slots in key space `space` for this region's type (a producer's
    /// durable queue), counting into `counters`.
    pub(crate) fn state_store(
        &self,
        space: String,
        counters: Arc<RegionCounterCells>,
    ) -> Result<super::shard::StateIo> {
        let parts = region_parts(self.inner.node()?, &self.inner);
        Ok(super::shard::StateIo::in_space(&parts, space, counters))
    }

    /// The node behind the region (none for a stand-in).
    pub(crate) fn node(&self) -> Result<&Node> {
        self.inner.node()
    }

    /// The type's longest entity id.
    pub(crate) fn max_entity_id_bytes(&self) -> usize {
        self.inner.settings.max_entity_id_bytes
    }

    /// Starts entity `entity_id` without a message; returns once it runs.
    pub async fn start_entity(&self, entity_id: &str) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.submit(entity_id, Envelope::new(None, Some(ReplyTo::Started(tx))))?;
        await_answer(&self.inner.deadlines, entity_id, rx, (None, self.inner.settings.ask_timeout)).await
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

    /// Every region of this type in the cluster (from the coordinator).
    pub async fn current_regions(&self) -> Result<BTreeSet<RegionId>> {
        coordinator_request(&*self.inner, self.inner.node()?, &CoordinatorQuery::CurrentRegions).await
    }

    /// This region without its entity type: what tools query (see [`RegionRef`]).
    pub fn erased(&self) -> RegionRef {
        RegionRef::new(self.inner.clone(), self.inner.node.clone())
    }

    /// Entity counts of every region; regions that do not answer within `timeout` are listed in
    /// `failed` instead of failing the whole query.
    pub async fn cluster_stats(&self, timeout: Duration) -> Result<ClusterShardingStats> {
        self.erased().cluster_stats(timeout).await
    }

    /// External allocation: asks for `shard` to live on node `node_id` (majority write to the
    /// replicated, durable table of desired locations). New allocations follow at once;
    /// allocated shards move at the next rebalance.
    pub async fn set_external_shard_location(&self, shard: &str, node_id: &str) -> Result<()> {
        let key = keys::external_locations(&self.inner.type_name);
        let (shard, node_id) = (shard.to_string(), node_id.to_string());
        self.inner
            .node()?
            .replicator()
            .update::<LwwMap, _>(&key, Consistency::MAJORITY, self.inner.settings.ask_timeout, move |m, ctx| {
                let _ = m.put_as(ctx, shard, &node_id);
            })
            .await
    }

    /// Changes this region's active-entity limit at run time (type started with passivation
    /// strategy `active-entity-limit`): the region divides it among its shards again, and
    /// shards over their new share passivate their replacement policy's victims at once.
    /// [`Error::BadRequest`] when the type has no such limit. Other nodes' regions keep theirs.
    pub async fn set_passivation_limit(&self, limit: usize) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(RegionCmd::SetPassivationLimit(limit, tx)).map_err(|_| Error::ShutDown)?;
        match rx.await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::BadRequest(format!(
                "entity type {} has no active-entity limit (passivation strategy active-entity-limit, no remember-entities)",
                self.inner.type_name
            ))),
            Err(_) => Err(Error::ShutDown),
        }
    }

    /// Hands off every shard of this region to other regions, then stops it (used by
    /// `Node::leave`). Bounded by `handoff_timeout`.
    pub async fn graceful_shutdown(&self) {
        RegionControl::graceful_shutdown(&*self.inner).await
    }
}

impl<E: Entity> RegionControl for HandleInner<E> {
    fn type_name(&self) -> &str {
        &self.type_name
    }
    fn is_proxy(&self) -> bool {
        self.proxy
    }
    fn role(&self) -> Option<&str> {
        self.settings.role.as_deref()
    }
    fn ask_timeout(&self) -> Duration {
        self.settings.ask_timeout
    }
    fn shard_of(&self, entity_id: &str) -> ShardId {
        self.shard_name(entity_id).into_owned()
    }
    fn max_entity_id_bytes(&self) -> usize {
        self.settings.max_entity_id_bytes
    }
    fn counters(&self) -> &RegionCounterCells {
        &self.counters
    }
    fn info(&self) -> futures::future::BoxFuture<'_, Result<RegionInfo>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            self.commands.send(RegionCmd::Info(tx)).map_err(|_| Error::ShutDown)?;
            rx.await.map_err(|_| Error::ShutDown)
        })
    }
    fn entity_ids(
        &self,
        after: Option<(ShardId, String)>,
        limit: usize,
    ) -> futures::future::BoxFuture<'_, Result<EntityIdPage>> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.commands.send(RegionCmd::EntityIds { after, limit, reply }).map_err(|_| Error::ShutDown)?;
            rx.await.map_err(|_| Error::ShutDown)
        })
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

/// Starts the region of a type on `node` (a proxy without a factory) and, unless it is a proxy,
/// the coordinator singleton driver of the type.
pub(crate) async fn start_region<E: Entity>(
    node: &Node,
    type_name: &str,
    factory: Option<Factory<E>>,
    settings: ShardingSettings,
    options: StartOptions,
) -> Result<ShardRegion<E>> {
    start_region_of(node, type_name, factory, settings, options, false).await
}

/// Starts a region; `durable`: its entities keep state in the replicated store.
pub(crate) async fn start_region_of<E: Entity>(
    node: &Node,
    type_name: &str,
    factory: Option<Factory<E>>,
    settings: ShardingSettings,
    options: StartOptions,
    durable: bool,
) -> Result<ShardRegion<E>> {
    if !valid_type_name(type_name) {
        return Err(Error::BadRequest(format!("entity type name {type_name:?} must be non-empty and without '/'")));
    }
    let shard_names = ShardNames::new(options.shard_id_extractor.clone(), settings.number_of_shards);
    let (tx, rx) = region_commands();
    let proxy = factory.is_none();
    let routed = RoutedInFlight::new();
    let inner = Arc::new(HandleInner {
        type_name: type_name.to_string(),
        node: Some(node.clone()),
        deadlines: node.deadlines().clone(),
        settings: settings.clone(),
        shard_names,
        commands: tx,
        buffered: Arc::new(AtomicUsize::new(0)),
        counters: Arc::new(RegionCounterCells::default()),
        proxy,
        routed: routed.clone(),
        shared: OnceLock::new(),
        metrics: Arc::new(TypeMetrics::new(node.node_id(), type_name)),
    });
    attached::attach(node, inner.clone())?;
    let me = node.address().clone();
    let transport = node.transport().clone();
    let replier = Replier::new(transport.clone(), type_name, node.watch_membership());
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let parts = region_parts(node, &inner);
    inner.counters.slot_budget_bytes.store(parts.slot_budget as u64, std::sync::atomic::Ordering::Relaxed);
    let shards = factory.clone().map(|factory| {
        let extractor = inner.shard_names.extractor().clone();
        LocalShards::new(&parts, factory, extractor, events_tx, replier.clone(), routed.clone(), durable)
    });
    let fingerprint = crate::sharding::ids::extractor_fingerprint(inner.shard_names.extractor());
    let region_settings = RegionSettings::of(&settings, fingerprint, durable);
    let shared = Arc::new(SharedRegion {
        me: me.clone(),
        topic: keys::region_topic(type_name).into(),
        remote: RemoteHomes::default(),
        direct: shards.as_ref().map(|s| s.directory().clone()),
        routed: routed.clone(),
        shard_names: inner.shard_names.clone(),
        max_entity_id_bytes: settings.max_entity_id_bytes,
        counters: inner.counters.clone(),
        asks: Arc::default(),
        senders: Arc::new(PeerSenders::new(transport.clone())),
    });
    let _ = inner.shared.set(shared.clone());
    let task = RegionDriver {
        type_name: type_name.to_string(),
        role: settings.role.clone(),
        transport,
        core: RegionCore::new(me, proxy, region_settings, crate::clock::now()),
        shards,
        settings: settings.clone(),
        shared,
        buffered: inner.buffered.clone(),
        counters: inner.counters.clone(),
        replier,
        members: node.membership(),
        shutdown_waiters: Vec::new(),
        shutting_down: false,
        work: Default::default(),
        shard_names: inner.shard_names.clone(),
        home_asked: Default::default(),
        metrics: inner.metrics.clone(),
    };
    node.spawner().spawn_essential("shard region", task.run(node.clone(), rx, events_rx));
    if !proxy {
        let must_agree = settings.must_agree(durable);
        let registration = coordinator::Registration { extractor_fingerprint: fingerprint, must_agree };
        start_coordinator(node, type_name, settings, options, registration);
    }
    Ok(ShardRegion { inner })
}

/// What the region's shards, writers and entities share; the slot budget is the replicator's
/// message budget.
fn region_parts<E: Entity>(node: &Node, inner: &HandleInner<E>) -> RegionParts {
    let slot_budget = node.config().replicator_message_bytes();
    RegionParts {
        type_name: inner.type_name.as_str().into(),
        settings: inner.settings.clone(),
        counters: inner.counters.clone(),
        metrics: inner.metrics.clone(),
        replicator: node.replicator().clone(),
        spawner: node.spawner().clone(),
        slot_budget,
    }
}

/// Starts the type's coordinator singleton on this node (it runs where the oldest member is).
fn start_coordinator(
    node: &Node,
    type_name: &str,
    settings: ShardingSettings,
    options: StartOptions,
    registration: coordinator::Registration,
) {
    let shard_ids = if options.shard_id_extractor.is_some() {
        crate::sharding::ids::ShardIdRule::Custom
    } else {
        crate::sharding::ids::ShardIdRule::Numbered(settings.number_of_shards)
    };
    coordinator::start_singleton(node, type_name, settings, options.allocation_strategy, registration, shard_ids);
}
