//! Cluster sharding: entities addressed by id, grouped into shards, hosted by regions on the
//! nodes a coordinator (a singleton on the oldest member with the type's role) chooses.
//!
//! # What is promised
//! - **At most one live incarnation per entity id**, under crashes and partitions, as long as
//!   the downing strategy is on and its assumption holds (both sides of a split detect it
//!   within `down_removal_margin` of each other; see `membership::downing`). Every activation
//!   carries an **epoch** ([`EntityContext::epoch`]), strictly larger for every allocation of
//!   its shard: a fencing token for external side effects when the assumption fails.
//! - **Order per (sender region, entity)**: messages from one region to one entity arrive in
//!   the order sent; a message may be lost on a failure (hand-off, crash), never reordered.
//! - **Every ask ends**: with the reply, or a typed error ([`crate::Error`]) — the same error
//!   whether the entity lives here or on another node.
//! - **Remembered entities come back** after hand-off, crash and full-cluster restart.
//!
//! # Layout
//! Protocol decisions live in sans-IO cores, each beside the driver that performs it:
//! `coordinator/` (core, stored state, singleton driver), `region/` (routing core, ask table,
//! driver), `shard/` (entity life-cycle core, hosting of shards, entity runner, remember I/O),
//! [`allocation`] (strategies). `ids` and `keys` name things; `settings` is a leaf module.

pub mod allocation;
mod attached;
mod cluster_singleton;
pub(crate) mod confirm;
pub(crate) mod coordinator;
mod counters;
pub mod daemon;
mod deferred;
pub(crate) mod delivery;
pub(crate) mod durable;
mod envelope;
mod handle;
pub(crate) mod ids;
pub(crate) mod keys;
pub(crate) mod producer;
pub(crate) mod protocol;
pub mod query;
pub(crate) mod region;
mod region_ref;
pub mod settings;
pub(crate) mod shard;
pub mod stand_in;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;

use serde::{Serialize, de::DeserializeOwned};

pub use allocation::{
    ConsistentHashingAllocation, ExternalAllocation, LeastShardAllocation, LegacyLeastShardAllocation,
    RegionAllocation, ShardAllocationStrategy,
};
pub use cluster_singleton::ClusterSingleton;
pub use confirm::DeferredConfirm;
pub use counters::RegionCounters;
pub use daemon::{DaemonContext, DaemonProcess, DaemonScale};
pub use deferred::DeferredReply;
pub use delivery::{DeliveryInfo, MAX_PRODUCERS_PER_ENTITY};
pub use durable::{Durable, DurableEntity};
pub use handle::{EntityRef, ShardRegion};
pub use ids::{RegionId, ShardId, ShardIdExtractor, default_shard_id};
pub use keys::durable_key_prefix;
pub use producer::{
    Confirmation, DeadLetter, MAX_PRODUCER_ID_LEN, Producer, ProducerInfo, ProducerSettings, ProducerStats,
};
pub use region_ref::RegionRef;
pub use settings::MAX_ENTITY_ID_LEN;
pub use settings::{
    AllocationSettings, DurableStateSettings, PassivationAdmission, PassivationSettings, PassivationStrategy,
    RememberEntitiesSettings, ReplacementPolicy, ShardCoordinatorSettings, ShardingSettings,
};
pub use shard::StopReason;
pub use stand_in::{RegionProbe, Sent};

use crate::error::{Error, Result};
use crate::node::Node;

/// A sharded entity: one instance per entity id, living on one node at a time.
///
/// An entity handles one message at a time, in the order its messages arrived, on a task
/// that exists only while it has work: between messages the instance is parked in its mailbox
/// (no task, no channel), so an idle entity costs little more than its own size. A handler
/// that panics stops only that entity; the next message starts a fresh instance.
pub trait Entity: Send + 'static {
    /// Messages the entity handles.
    type Message: Serialize + DeserializeOwned + Send + 'static;
    /// What `handle` answers (sent back to `ask`, discarded for `tell`).
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// Handles one message.
    fn handle(&mut self, msg: Self::Message, ctx: &mut EntityContext) -> impl Future<Output = Self::Reply> + Send;

    /// What the entity runner calls: [`Entity::handle`], except for entities whose handling
    /// can fail with a typed error after the handler ran ([`Durable`]: a state write that was
    /// refused or not acknowledged). Not meant to be overridden.
    #[doc(hidden)]
    fn handle_or_fail(
        &mut self,
        msg: Self::Message,
        ctx: &mut EntityContext,
    ) -> impl Future<Output = Result<Self::Reply>> + Send {
        // No async block: its frame would hold the message a second time, in every run task.
        futures::FutureExt::map(self.handle(msg, ctx), Ok)
    }

    /// The marks of reliable deliveries when the entity keeps them with its own state
    /// ([`Durable`]: stored with it); `None`: the runner keeps them for the incarnation. Not
    /// meant to be overridden.
    #[doc(hidden)]
    fn delivery_marks(&mut self) -> Option<&mut delivery::ConsumerMarks> {
        None
    }

    /// Settles the marks [`Entity::delivery_marks`] returns: writes them (with the state they
    /// are stored with) and waits for the write to be acknowledged. Not meant to be overridden.
    #[doc(hidden)]
    fn settle_marks(&mut self, _ctx: &mut EntityContext) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Runs once when this incarnation starts, before its first message — also when a
    /// remembered entity is restarted without any message. `ctx.epoch()` is the fencing token
    /// of this activation: the place to load state or to claim external resources. A panic here
    /// stops the incarnation and fails the messages queued for it (they are not handed to a
    /// next incarnation, which would panic the same way). Does nothing by default.
    fn started(&mut self, ctx: &EntityContext) -> impl Future<Output = ()> + Send {
        let _ = ctx;
        async {}
    }

    /// Runs once when this incarnation stops on purpose, after the last message it took, and
    /// says why: passivation (asked, idle or the active-entity limit) or a hand-off of its
    /// shard (a rebalance, or this node leaving). The place to flush, unsubscribe or release
    /// what [`Entity::started`] claimed, or to run what Akka users send as a stop message.
    ///
    /// Messages that arrive meanwhile wait for the next incarnation. The hook is bounded: one
    /// still running after the entity stop timeout (`handoff_timeout` less 5 s, at least 1 s)
    /// is dropped where it stands, and one that panics is logged; either way the stop goes on
    /// (both are counted: `stop_hook_overruns`, `entity_panics`). Not called when its node
    /// crashes or stops without leaving ([`Node::shutdown`](crate::Node::shutdown)), nor after
    /// a handler panicked. Durable entities implement [`DurableEntity::on_stop`], which may
    /// persist. Does nothing by default.
    fn on_stop(&mut self, reason: StopReason, ctx: &mut EntityContext) -> impl Future<Output = ()> + Send {
        let _ = (reason, ctx);
        async {}
    }
}

/// A message with a reply type of its own, for an entity that answers different messages with
/// different types. The entity keeps one `Message` and one `Reply` type (say two enums); a
/// request converts into the entity's message and picks its answer out of the entity's reply,
/// so callers get a typed answer from [`ShardRegion::request`] and cannot mix requests up:
///
/// ```
/// use ddshard::{Entity, EntityContext, sharding::Request};
///
/// struct Cart { items: Vec<String> }
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// enum CartMsg { Add(String), Count }
/// #[derive(serde::Serialize, serde::Deserialize)]
/// enum CartReply { Added, Count(usize) }
///
/// impl Entity for Cart {
///     type Message = CartMsg;
///     type Reply = CartReply;
///     async fn handle(&mut self, msg: CartMsg, _ctx: &mut EntityContext) -> CartReply {
///         match msg {
///             CartMsg::Add(item) => { self.items.push(item); CartReply::Added }
///             CartMsg::Count => CartReply::Count(self.items.len()),
///         }
///     }
/// }
///
/// /// How many items the cart holds.
/// struct Count;
/// impl From<Count> for CartMsg {
///     fn from(_: Count) -> CartMsg { CartMsg::Count }
/// }
/// impl Request<Cart> for Count {
///     type Reply = usize;
///     fn reply_of(reply: CartReply) -> Option<usize> {
///         match reply { CartReply::Count(n) => Some(n), _ => None }
///     }
/// }
/// // let n: usize = carts.request("cart-1", Count).await?;
/// ```
pub trait Request<E: Entity>: Into<E::Message> {
    /// What the entity answers this request with.
    type Reply;

    /// This request's answer out of the entity's reply; `None` when the entity answered with
    /// another kind (a bug in the entity: the caller gets [`crate::Error::UnexpectedReply`]).
    fn reply_of(reply: E::Reply) -> Option<Self::Reply>;
}

/// What an entity knows about itself while handling a message.
#[derive(Debug, Clone)]
pub struct EntityContext {
    pub(crate) entity_id: Arc<str>,
    pub(crate) shard_id: Arc<str>,
    pub(crate) epoch: u64,
    pub(crate) passivate: bool,
    /// Durable entities: what the handler asked to do with the stored state.
    pub(crate) state_change: Option<StateChange>,
    /// Durable entities: the incarnation must end after this message.
    pub(crate) end: Option<EndIncarnation>,
    /// Durable entities: the region's state store.
    pub(crate) state_io: Option<shard::StateIo>,
    /// While an ask is handled and its reply not taken: the entity's `Reply` type.
    pub(crate) reply_type: Option<std::any::TypeId>,
    /// The reply the handler took ([`EntityContext::reply_later`]), until the handler ends.
    pub(crate) taken_reply: Option<deferred::ErasedReply>,
    /// Holds sends of taken replies while a handler runs; made when a reply is first taken.
    pub(crate) reply_gate: Option<std::sync::Arc<deferred::ReplyGate>>,
    /// While a reliable delivery is handled: which one.
    pub(crate) delivery: Option<DeliveryInfo>,
    /// Held confirmations of reliable deliveries: the incarnation's, and the handler's doing.
    pub(crate) confirms: confirm::HandlerConfirms,
}

/// A change of a durable entity's stored state, asked by its handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateChange {
    Persist,
    Delete,
}

/// Why an incarnation ends after the message it handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndIncarnation {
    /// Its state write failed: the next incarnation starts from the stored state, and the
    /// messages queued go to it.
    Restart,
    /// A newer allocation of the shard (epoch `fence`) claimed the state: this incarnation is
    /// stale, and so is its shard here.
    Fenced { fence: u64 },
}

impl EntityContext {
    /// The entity id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }
    /// The shard it belongs to.
    pub fn shard_id(&self) -> &str {
        &self.shard_id
    }
    /// Fencing token: strictly larger for every new allocation of the shard, so an entity can
    /// guard external side effects against an older incarnation elsewhere.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Stops the entity after this message. Messages that arrive meanwhile are kept and
    /// delivered to its next incarnation.
    pub fn passivate(&mut self) {
        self.passivate = true;
    }

    /// Durable entities ([`Sharding::start_durable`]): write the state after this message. The
    /// write is acknowledged by a majority of replicas, each with it in LMDB, before the reply
    /// leaves and before the next message is handled. No effect for entities started with
    /// [`Sharding::start`].
    pub fn persist(&mut self) {
        self.state_change = Some(StateChange::Persist);
    }

    /// Durable entities: delete the stored state after this message (the same guarantees as
    /// [`EntityContext::persist`]); the entity's state is `Default` again. No effect for entities
    /// started with [`Sharding::start`].
    pub fn delete_state(&mut self) {
        self.state_change = Some(StateChange::Delete);
    }

    /// Takes the answer to the ask being handled, to send later through the
    /// [`DeferredReply`] — after other messages, or from a task that asks another entity and
    /// passes its answer on. The value the handler returns is then dropped (return any). `R`
    /// is the entity's `Reply` type. `None` when the message is a tell (nobody waits), the
    /// reply was taken already, or `R` is another type.
    ///
    /// The asker's own timeout still runs. A send made before this handler returns leaves
    /// with its reply. For a durable entity, a send made while any of its handlers runs (this
    /// one, or a later one answering an earlier ask) leaves after that handler's state write,
    /// replaced by an error if the write fails. Dropping the `DeferredReply` unanswered
    /// fails the ask with [`crate::Error::NotDelivered`].
    pub fn reply_later<R: Send + 'static>(&mut self) -> Option<DeferredReply<R>> {
        if self.reply_type != Some(std::any::TypeId::of::<R>()) {
            return None;
        }
        self.reply_type = None;
        let gate = self.reply_gate.get_or_insert_with(Default::default).clone();
        let (later, taken) = deferred::take::<R>(&self.entity_id, gate);
        self.taken_reply = Some(taken);
        Some(later)
    }

    /// The reliable delivery being handled ([`ShardRegion::producer`]): its producer, its number
    /// and whether it was sent before; `None` for a plain `tell` or `ask`.
    pub fn delivery(&self) -> Option<&DeliveryInfo> {
        self.delivery.as_ref()
    }

    /// Holds back the confirmation of the reliable delivery being handled: it is confirmed to
    /// its producer when a later handler of this incarnation gives it
    /// ([`EntityContext::confirm`]), once what the message asked for is done. `None` outside a
    /// reliable delivery's handler, or when this handler holds one already.
    ///
    /// Until it is given, the later messages of its stream wait (other producers' messages and
    /// plain messages do not). Dropped unconfirmed, or when the incarnation ends first
    /// (passivation, hand-off, a crash), the message is delivered and handled again, with
    /// [`DeliveryInfo::redelivery`] set: a durable entity keeps a held message's effect once
    /// only when the confirming handler writes it.
    pub fn confirm_later(&mut self) -> Option<DeferredConfirm> {
        let info = self.delivery.as_ref()?;
        self.confirms.defer(&self.entity_id, info)
    }

    /// Gives a confirmation held back by [`EntityContext::confirm_later`]: its producer hears
    /// the message confirmed once this handler ended (a durable entity's: once its state
    /// write, which a confirm makes as [`EntityContext::persist`] does, is acknowledged), and
    /// the message's stream goes on. False when `confirm` is not of this entity incarnation
    /// (it is let go: its message is delivered again).
    pub fn confirm(&mut self, confirm: DeferredConfirm) -> bool {
        self.confirms.confirm(confirm)
    }

    /// A context for entity `entity_id` of `shard_id` at `epoch`.
    pub(crate) fn new(entity_id: Arc<str>, shard_id: Arc<str>, epoch: u64, state_io: Option<shard::StateIo>) -> Self {
        EntityContext {
            entity_id,
            shard_id,
            epoch,
            passivate: false,
            state_change: None,
            end: None,
            state_io,
            reply_type: None,
            taken_reply: None,
            reply_gate: None,
            delivery: None,
            confirms: confirm::HandlerConfirms::default(),
        }
    }
}

/// Deletes the durable sharding data (remembered entities and shards) of `types` from a
/// stopped node's data dir — Akka's RemoveInternalClusterShardingData. Refuses while a running
/// node holds the data dir. Returns the number of keys deleted per type.
///
/// Every node keeps a replica: run it on the data dir of **every** node while the whole
/// cluster is stopped. A node left out, or still running, holds the data and replication
/// brings it back to the others when they start.
pub fn remove_internal_data(data_dir: &std::path::Path, types: &[String]) -> Result<Vec<(String, usize)>> {
    let _lock = crate::node::lock_data_dir(data_dir)?;
    let dir = data_dir.join("ddata");
    // Room for the deletions' copied pages above what the store uses; LMDB never maps less
    // than the data file, so a store larger than any fixed guess opens too.
    let used = std::fs::metadata(dir.join("data.mdb")).map_or(0, |m| m.len());
    let map_size = usize::try_from(used).unwrap_or(usize::MAX).saturating_add(64 << 20);
    let store = crate::ddata::DurableStore::open(&dir, map_size)?;
    types
        .iter()
        .map(|t| {
            if !ids::valid_type_name(t) {
                return Err(Error::BadRequest(format!("invalid entity type name {t:?}")));
            }
            Ok((t.clone(), store.delete_prefix(&durable_key_prefix(t))?))
        })
        .collect()
}

/// Optional parts of [`Sharding::start_with`].
#[derive(Default, Clone)]
pub struct StartOptions {
    /// Custom entity → shard mapping (default: [`default_shard_id`]).
    pub shard_id_extractor: Option<ShardIdExtractor>,
    /// Custom allocation strategy (default: from [`ShardingSettings::allocation`]).
    pub allocation_strategy: Option<Arc<dyn ShardAllocationStrategy>>,
}

/// Per-region entity counts across the cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterShardingStats {
    /// Region → shard → live entities, for regions that answered.
    pub regions: BTreeMap<RegionId, BTreeMap<ShardId, usize>>,
    /// Regions that did not answer in time (Akka would return nothing at all).
    pub failed: BTreeSet<RegionId>,
}

/// Entry point to sharding on a node: `node.sharding()`.
#[derive(Clone)]
pub struct Sharding {
    node: Node,
}

impl Node {
    /// Cluster sharding on this node.
    pub fn sharding(&self) -> Sharding {
        Sharding { node: self.clone() }
    }
}

impl Sharding {
    /// The node's `[sharding]` table ([`crate::NodeConfig::sharding`]): the settings to start
    /// a type with, so what an operator tuned in the node's configuration file applies
    /// (`ShardingSettings::default()` is the built-in defaults, whatever the file says). Change
    /// what one type needs on the copy:
    /// `let mut settings = node.sharding().settings(); settings.remember.enabled = true;`.
    pub fn settings(&self) -> ShardingSettings {
        self.node.config().sharding.clone()
    }

    /// The entity types started on this node (regions and proxies), in start order.
    pub fn type_names(&self) -> Vec<String> {
        attached::regions(&self.node).iter().map(|r| r.type_name().to_string()).collect()
    }

    /// The region of `type_name` on this node, without its entity type (for tools); `None`
    /// when the type was not started here.
    pub fn region(&self, type_name: &str) -> Option<RegionRef> {
        let control = attached::regions(&self.node).into_iter().find(|r| r.type_name() == type_name)?;
        Some(RegionRef::new(control, Some(self.node.clone())))
    }

    /// The daemon process `name` started on this node ([`Sharding::daemon_process`]), for
    /// tools; `None` when it was not started here.
    pub fn daemon(&self, name: &str) -> Option<DaemonProcess> {
        daemon::find(&self.node, name)
    }

    /// The reliable-delivery producers running on this node ([`ShardRegion::producer`]), in
    /// start order, with what each counted and holds.
    pub fn producers(&self) -> Vec<ProducerInfo> {
        producer::producers(&self.node)
    }

    /// Starts hosting entity type `type_name` here (or a proxy if this node lacks the role),
    /// creating entities with `factory(entity_id)`.
    pub async fn start<E, F>(&self, type_name: &str, factory: F, settings: ShardingSettings) -> Result<ShardRegion<E>>
    where
        E: Entity,
        F: Fn(&str) -> E + Send + Sync + 'static,
    {
        self.start_with(type_name, factory, settings, StartOptions::default()).await
    }

    /// [`Sharding::start`] with a custom shard-id extractor and/or allocation strategy.
    pub async fn start_with<E, F>(
        &self,
        type_name: &str,
        factory: F,
        settings: ShardingSettings,
        options: StartOptions,
    ) -> Result<ShardRegion<E>>
    where
        E: Entity,
        F: Fn(&str) -> E + Send + Sync + 'static,
    {
        settings.validate()?;
        let has_role = settings.role.as_deref().is_none_or(|r| self.node.config().roles.iter().any(|x| x == r));
        let factory: Option<shard::Factory<E>> = if has_role { Some(Arc::new(factory)) } else { None };
        handle::start_region(&self.node, type_name, factory, settings, options).await
    }

    /// Starts hosting durable entity type `type_name`: like [`Sharding::start`], and each
    /// entity's state is loaded before its first message and written when its handler calls
    /// [`EntityContext::persist`] (see [`DurableEntity`] for what is promised).
    pub async fn start_durable<D, F>(
        &self,
        type_name: &str,
        factory: F,
        settings: ShardingSettings,
    ) -> Result<ShardRegion<Durable<D>>>
    where
        D: DurableEntity,
        F: Fn(&str) -> D + Send + Sync + 'static,
    {
        self.start_durable_with(type_name, factory, settings, StartOptions::default()).await
    }

    /// [`Sharding::start_durable`] with a custom shard-id extractor and/or allocation strategy.
    pub async fn start_durable_with<D, F>(
        &self,
        type_name: &str,
        factory: F,
        settings: ShardingSettings,
        options: StartOptions,
    ) -> Result<ShardRegion<Durable<D>>>
    where
        D: DurableEntity,
        F: Fn(&str) -> D + Send + Sync + 'static,
    {
        settings.validate()?;
        let has_role = settings.role.as_deref().is_none_or(|r| self.node.config().roles.iter().any(|x| x == r));
        let factory: Option<shard::Factory<Durable<D>>> =
            if has_role { Some(Arc::new(move |id: &str| Durable::new(factory(id)))) } else { None };
        handle::start_region_of(&self.node, type_name, factory, settings, options, true).await
    }

    /// Starts (or joins, on every node that calls it) sharded daemon process `name`: `count`
    /// workers, indexes `0..count`, each running `worker(context)` on exactly one node at a
    /// time, spread over the nodes that host it (`settings.role`), and started again on
    /// another node after a crash, a leave or a rebalance (see [`daemon`]). The type runs as
    /// `daemon-<name>`, durable, with remember-entities; call it with the same `count` on
    /// every node (a node started with another is refused, its messages failing with an error
    /// naming `number_of_shards`, which holds this count). [`DaemonProcess::set_count`]
    /// rescales it cluster-wide later, up to `settings.number_of_shards` workers; the cluster
    /// then keeps the new count across restarts.
    pub async fn daemon_process<F, Fut>(
        &self,
        name: &str,
        count: usize,
        worker: F,
        settings: ShardingSettings,
    ) -> Result<DaemonProcess>
    where
        F: Fn(DaemonContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        daemon::start(&self.node, name, count, worker, settings).await
    }

    /// Starts (or joins, on every node that calls it) cluster singleton `name`: one instance of
    /// `factory()`'s entity in the whole cluster, running without being asked, moved by a
    /// hand-off when its node leaves and restarted elsewhere when its node crashes (see
    /// [`ClusterSingleton`]). Nodes without `settings.role` route to it and never host it.
    pub async fn singleton<E, F>(
        &self,
        name: &str,
        factory: F,
        settings: ShardingSettings,
    ) -> Result<ClusterSingleton<E>>
    where
        E: Entity,
        F: Fn() -> E + Send + Sync + 'static,
    {
        cluster_singleton::start(&self.node, name, factory, settings).await
    }

    /// [`Sharding::singleton`] of a durable entity: its state survives its moves, crashes and
    /// full-cluster restarts ([`DurableEntity`]).
    pub async fn durable_singleton<D, F>(
        &self,
        name: &str,
        factory: F,
        settings: ShardingSettings,
    ) -> Result<ClusterSingleton<Durable<D>>>
    where
        D: DurableEntity,
        F: Fn() -> D + Send + Sync + 'static,
    {
        cluster_singleton::start_durable(&self.node, name, factory, settings).await
    }

    /// Starts a proxy: routes to the type's entities without hosting any.
    pub async fn start_proxy<E: Entity>(&self, type_name: &str, settings: ShardingSettings) -> Result<ShardRegion<E>> {
        settings.validate()?;
        handle::start_region::<E>(&self.node, type_name, None, settings, StartOptions::default()).await
    }
}

/// Entities the crate's unit tests share.
#[cfg(test)]
pub(crate) mod test_entities {
    use super::{Entity, EntityContext};

    /// Answers each number with itself.
    pub(crate) struct Echo;

    impl Entity for Echo {
        type Message = u32;
        type Reply = u32;
        async fn handle(&mut self, msg: u32, _ctx: &mut EntityContext) -> u32 {
            msg
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_validation_gives_typed_errors() {
        assert!(ShardingSettings::default().validate().is_ok());
        for s in [
            ShardingSettings { number_of_shards: 0, ..Default::default() },
            ShardingSettings { buffer_size: 0, ..Default::default() },
            ShardingSettings { min_nr_of_members: 0, ..Default::default() },
            ShardingSettings {
                remember: RememberEntitiesSettings { slots: 0, ..Default::default() },
                ..Default::default()
            },
            ShardingSettings { handoff_timeout: std::time::Duration::from_millis(10), ..Default::default() },
            ShardingSettings { max_entity_id_bytes: 0, ..Default::default() },
            ShardingSettings { max_entity_id_bytes: MAX_ENTITY_ID_LEN + 1, ..Default::default() },
            ShardingSettings {
                remember: RememberEntitiesSettings { max_per_shard: Some(0), ..Default::default() },
                ..Default::default()
            },
            ShardingSettings { max_concurrent_shard_loads: 0, ..Default::default() },
            ShardingSettings {
                coordinator: ShardCoordinatorSettings {
                    write_retry_backoff_min: std::time::Duration::ZERO,
                    ..Default::default()
                },
                ..Default::default()
            },
            ShardingSettings {
                coordinator: ShardCoordinatorSettings {
                    write_retry_backoff_min: std::time::Duration::from_secs(3),
                    ..Default::default()
                },
                ..Default::default()
            },
        ] {
            assert!(matches!(s.validate(), Err(Error::Config(_))), "{s:?}");
        }
        assert!(
            ShardingSettings {
                remember: RememberEntitiesSettings { max_per_shard: Some(1), ..Default::default() },
                ..Default::default()
            }
            .validate()
            .is_ok()
        );
        let longest = ShardingSettings { max_entity_id_bytes: MAX_ENTITY_ID_LEN, ..Default::default() };
        assert!(longest.validate().is_ok(), "the longest a remembered set holds is allowed");
        let zero = settings::PassivationSettings { idle_safety_limit: Some(0), ..Default::default() };
        assert!(matches!(
            ShardingSettings { passivation: zero, ..Default::default() }.validate(),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn idle_passivation_has_a_safety_net_limit_and_only_remembered_or_unpassivated_types_have_none() {
        use settings::{PassivationSettings, PassivationStrategy};
        let idle = ShardingSettings::default();
        assert_eq!(idle.passivation_limit(), Some(1_000_000), "a flood of distinct ids is capped");
        assert_eq!(idle.passivation_policy(Some(1_000)).limit, Some(1_000), "each shard's share");
        let off = PassivationSettings { idle_safety_limit: None, ..Default::default() };
        assert_eq!(ShardingSettings { passivation: off, ..Default::default() }.passivation_limit(), None);
        let remember = ShardingSettings {
            remember: RememberEntitiesSettings { enabled: true, ..Default::default() },
            ..Default::default()
        };
        assert_eq!(remember.passivation_limit(), None, "remembered entities are never passivated automatically");
        let none = PassivationSettings { strategy: PassivationStrategy::None, ..Default::default() };
        assert_eq!(ShardingSettings { passivation: none, ..Default::default() }.passivation_limit(), None);
        let limited = PassivationSettings { strategy: PassivationStrategy::ActiveEntityLimit, ..Default::default() };
        assert_eq!(ShardingSettings { passivation: limited, ..Default::default() }.passivation_limit(), Some(100_000));
    }
}
