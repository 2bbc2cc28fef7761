//! Cluster sharding: entities addressed by id, grouped into shards, hosted by regions on the
//! nodes a coordinator (a singleton on the oldest member with the type's role) chooses.
//!
//! The protocol parts are sans-IO state machines ([`allocation`], `coordinator`, `region`,
//! `shard`); `runtime` holds the tokio tasks that drive them.

pub mod allocation;
mod coordinator;
#[allow(missing_docs)] // wire messages; the field names are the documentation
pub mod protocol;
mod region;
mod runtime;
mod shard;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

pub use allocation::{
    ConsistentHashingAllocation, ExternalAllocation, LeastShardAllocation, LegacyLeastShardAllocation,
    RegionAllocation, RegionId, ShardAllocationStrategy, ShardId,
};
pub use runtime::ShardRegion;

use crate::error::{Error, Result};
use crate::node::Node;

/// A sharded entity: one instance per entity id, living on one node at a time.
///
/// Each entity runs in its own task and handles one message at a time. A handler that panics
/// stops only that entity; the next message starts a fresh instance.
pub trait Entity: Send + 'static {
    /// Messages the entity handles.
    type Message: Serialize + DeserializeOwned + Send + 'static;
    /// What `handle` answers (sent back to `ask`, discarded for `tell`).
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// Handles one message.
    fn handle(&mut self, msg: Self::Message, ctx: &mut EntityContext) -> impl Future<Output = Self::Reply> + Send;

    /// Runs once when this incarnation starts, before its first message — also when a
    /// remembered entity is restarted without any message. `ctx.epoch()` is the fencing token
    /// of this activation: the place to load state or to claim external resources. A panic here
    /// stops the incarnation and fails the messages queued for it (they are not handed to a
    /// next incarnation, which would panic the same way). Does nothing by default.
    fn started(&mut self, ctx: &EntityContext) -> impl Future<Output = ()> + Send {
        let _ = ctx;
        async {}
    }
}

/// What an entity knows about itself while handling a message.
#[derive(Debug, Clone)]
pub struct EntityContext {
    pub(crate) entity_id: String,
    pub(crate) shard_id: ShardId,
    pub(crate) epoch: u64,
    pub(crate) passivate: bool,
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
}

/// How the coordinator places shards (see [`allocation`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AllocationSettings {
    /// [`LeastShardAllocation`] (the default).
    LeastShard {
        /// Most shards moved per rebalance round.
        absolute_limit: usize,
        /// Most shards moved per round as a fraction of all shards.
        relative_limit: f64,
    },
    /// [`LegacyLeastShardAllocation`].
    LegacyLeastShard {
        /// Tolerated difference between most and least loaded region.
        threshold: usize,
        /// Shards in hand-off at the same time.
        max_simultaneous: usize,
    },
    /// [`ConsistentHashingAllocation`].
    ConsistentHashing {
        /// Ring points per region.
        virtual_nodes: usize,
        /// Shards moved per round.
        rebalance_limit: usize,
    },
    /// [`ExternalAllocation`]: shards go where an operator says
    /// ([`ShardRegion::set_external_shard_location`]), kept in a replicated, durable LWW-map.
    External {
        /// Shards moved per round.
        rebalance_limit: usize,
    },
}

impl Default for AllocationSettings {
    fn default() -> Self {
        AllocationSettings::LeastShard { absolute_limit: 20, relative_limit: 0.1 }
    }
}

/// Settings of one sharded entity type (defaults in `config/default.toml`, section `[sharding]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardingSettings {
    /// Shards per type; entity ids are spread over them by [`default_shard_id`]. Keep it
    /// stable for the life of the data (about 10× the largest node count).
    pub number_of_shards: u32,
    /// Only nodes with this role host the type; elsewhere `start` gives a proxy.
    pub role: Option<String>,
    /// Remember started entities (in replicated OR-sets, durable in LMDB) and start them again
    /// after hand-off, crash or a full-cluster restart. Idle passivation is off for such types.
    pub remember_entities: bool,
    /// OR-set keys per shard for remembered ids (ids spread by hash). More slots keep each
    /// replicated value small: about 60 bytes per id, so 1M ids in 64 slots is ~1 MB per key.
    /// Like `number_of_shards`, keep it stable for the life of the data.
    pub remember_entities_slots: u32,
    /// Remembered entity that stopped without passivating (panic) restarts after this.
    #[serde(with = "humantime_serde")]
    pub entity_restart_backoff: Duration,
    /// A shard whose remembered set could not be loaded or written restarts after this.
    #[serde(with = "humantime_serde")]
    pub shard_failure_backoff: Duration,
    /// Remembered entities a shard starts per `entity_recovery_interval` (0: all at once).
    pub entity_recovery_batch: usize,
    /// See `entity_recovery_batch`.
    #[serde(with = "humantime_serde")]
    pub entity_recovery_interval: Duration,
    /// Messages a region buffers while shard homes are unknown; beyond it `tell` fails with
    /// [`Error::BufferFull`].
    pub buffer_size: usize,
    /// One timeout for a whole hand-off (acks, stopping the entities).
    #[serde(with = "humantime_serde")]
    pub handoff_timeout: Duration,
    /// How often the coordinator considers rebalancing.
    #[serde(with = "humantime_serde")]
    pub rebalance_interval: Duration,
    /// Entities idle this long are passivated (`None`: never).
    #[serde(with = "humantime_serde")]
    pub passivation_idle_timeout: Option<Duration>,
    /// Default timeout of [`ShardRegion::ask`] and of queries.
    #[serde(with = "humantime_serde")]
    pub ask_timeout: Duration,
    /// Regions that must have registered before the first shard is allocated.
    pub min_nr_of_members: usize,
    /// Registration and shard-home retry interval (backoff starts at an eighth of it).
    #[serde(with = "humantime_serde")]
    pub retry_interval: Duration,
    /// `HostShard` is re-sent after this long without `ShardStarted`.
    #[serde(with = "humantime_serde")]
    pub shard_start_timeout: Duration,
    /// Timeout of each coordinator state write (retried until it succeeds).
    #[serde(with = "humantime_serde")]
    pub updating_state_timeout: Duration,
    /// Timeout of each coordinator state read at take-over (retried until it succeeds).
    #[serde(with = "humantime_serde")]
    pub waiting_for_state_timeout: Duration,
    /// Coordinator state writes wait for a majority plus this many more replicas (Akka's
    /// `write-majority-plus`, 3). Majority reads and writes intersect anyway; the extra copies
    /// keep the state safe across membership changes that shift what "majority" means.
    pub coordinator_write_majority_plus: usize,
    /// The take-over read of the coordinator state asks a majority plus this many (Akka's
    /// `read-majority-plus`, 5).
    pub coordinator_read_majority_plus: usize,
    /// Lower bound on those write and read replica counts (capped at the cluster size; Akka's
    /// `majority-min-cap`, 5). With the defaults, a cluster of up to 5 nodes needs every
    /// member for each allocation, so one unreachable node holds new allocations back until it
    /// is downed; lower it (say to 3) to keep allocating in small clusters with one node out.
    pub coordinator_majority_min_cap: usize,
    /// Shard allocation strategy.
    pub allocation: AllocationSettings,
}

impl Default for ShardingSettings {
    fn default() -> Self {
        ShardingSettings {
            number_of_shards: 1000,
            role: None,
            remember_entities: false,
            remember_entities_slots: 16,
            entity_restart_backoff: Duration::from_secs(10),
            shard_failure_backoff: Duration::from_secs(10),
            entity_recovery_batch: 0,
            entity_recovery_interval: Duration::from_millis(100),
            buffer_size: 100_000,
            handoff_timeout: Duration::from_secs(30),
            rebalance_interval: Duration::from_secs(10),
            passivation_idle_timeout: Some(Duration::from_secs(120)),
            ask_timeout: Duration::from_secs(5),
            min_nr_of_members: 1,
            retry_interval: Duration::from_secs(2),
            shard_start_timeout: Duration::from_secs(10),
            updating_state_timeout: Duration::from_secs(5),
            waiting_for_state_timeout: Duration::from_secs(2),
            coordinator_write_majority_plus: 3,
            coordinator_read_majority_plus: 5,
            coordinator_majority_min_cap: 5,
            allocation: AllocationSettings::default(),
        }
    }
}

impl ShardingSettings {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(format!("sharding: {m}")));
        if self.number_of_shards == 0 {
            return bad("number_of_shards must be > 0");
        }
        if self.buffer_size == 0 {
            return bad("buffer_size must be > 0");
        }
        if self.min_nr_of_members == 0 {
            return bad("min_nr_of_members must be >= 1");
        }
        if self.handoff_timeout < Duration::from_millis(100) || self.ask_timeout.is_zero() {
            return bad("handoff_timeout must be >= 100ms and ask_timeout > 0");
        }
        if self.retry_interval.is_zero() || self.rebalance_interval.is_zero() || self.shard_start_timeout.is_zero() {
            return bad("retry_interval, rebalance_interval and shard_start_timeout must be > 0");
        }
        if !(1..=4096).contains(&self.remember_entities_slots) {
            return bad("remember_entities_slots must be between 1 and 4096");
        }
        if self.entity_recovery_batch > 0 && self.entity_recovery_interval.is_zero() {
            return bad("entity_recovery_interval must be > 0 when entity_recovery_batch is set");
        }
        Ok(())
    }

    fn strategy(&self) -> Arc<dyn ShardAllocationStrategy> {
        match &self.allocation {
            AllocationSettings::LeastShard { absolute_limit, relative_limit } => {
                Arc::new(LeastShardAllocation { absolute_limit: *absolute_limit, relative_limit: *relative_limit })
            }
            AllocationSettings::LegacyLeastShard { threshold, max_simultaneous } => {
                Arc::new(LegacyLeastShardAllocation { threshold: *threshold, max_simultaneous: *max_simultaneous })
            }
            AllocationSettings::ConsistentHashing { virtual_nodes, rebalance_limit } => {
                Arc::new(ConsistentHashingAllocation {
                    virtual_nodes: *virtual_nodes,
                    rebalance_limit: *rebalance_limit,
                })
            }
            AllocationSettings::External { rebalance_limit } => {
                // Without the runtime's table (filled from the replicated map) nothing is desired.
                let mut ext = ExternalAllocation::new(Arc::default());
                ext.rebalance_limit = *rebalance_limit;
                Arc::new(ext)
            }
        }
    }
}

/// Replicator key of one slot of a shard's remembered entity ids (durable: `shard-` prefix).
/// `/` cannot occur in type names, so one type's keys never prefix another's.
pub(crate) fn remembered_entities_key(type_name: &str, shard: &str, slot: u32) -> String {
    format!("shard-{type_name}/{shard}/{slot}")
}

/// Replicator key of the durable set of a type's shards (for a full-cluster restart).
pub(crate) fn remembered_shards_key(type_name: &str) -> String {
    format!("shard-{type_name}/all")
}

/// Replicator key of the operator's desired shard locations (External allocation).
pub(crate) fn external_locations_key(type_name: &str) -> String {
    format!("shard-{type_name}/external-locations")
}

/// Prefix of every durable sharding key of a type.
pub fn durable_key_prefix(type_name: &str) -> String {
    format!("shard-{type_name}/")
}

/// Deletes the durable sharding data (remembered entities and shards) of `types` from a
/// stopped node's data dir — Akka's RemoveInternalClusterShardingData. Refuses while a running
/// node holds the data dir. Returns the number of keys deleted per type.
pub fn remove_internal_data(data_dir: &std::path::Path, types: &[String]) -> Result<Vec<(String, usize)>> {
    let _lock = crate::node::lock_data_dir(data_dir)?;
    let store = crate::ddata::DurableStore::open(&data_dir.join("ddata"), 1 << 30)?;
    types
        .iter()
        .map(|t| {
            if t.is_empty() || t.contains('/') {
                return Err(Error::Config(format!("invalid entity type name {t:?}")));
            }
            Ok((t.clone(), store.delete_prefix(&durable_key_prefix(t))?))
        })
        .collect()
}

/// The slot of an entity id among `slots` remembered-entity keys.
pub(crate) fn remembered_slot(entity_id: &str, slots: u32) -> u32 {
    (xxhash_rust::xxh3::xxh3_64_with_seed(entity_id.as_bytes(), 0x5107) % u64::from(slots.max(1))) as u32
}

/// The default shard of an entity: the XXH3-64 hash (seed 0) of the id's UTF-8 bytes, modulo
/// `number_of_shards`, in decimal. Stable across versions, platforms and processes.
pub fn default_shard_id(entity_id: &str, number_of_shards: u32) -> ShardId {
    (xxhash_rust::xxh3::xxh3_64(entity_id.as_bytes()) % u64::from(number_of_shards.max(1))).to_string()
}

/// Maps an entity id to its shard id.
pub type ShardIdExtractor = Arc<dyn Fn(&str) -> ShardId + Send + Sync>;

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
        let factory: Option<runtime::Factory<E>> = if has_role { Some(Arc::new(factory)) } else { None };
        runtime::start_region(&self.node, type_name, factory, settings, options).await
    }

    /// Starts a proxy: routes to the type's entities without hosting any.
    pub async fn start_proxy<E: Entity>(&self, type_name: &str, settings: ShardingSettings) -> Result<ShardRegion<E>> {
        settings.validate()?;
        runtime::start_region::<E>(&self.node, type_name, None, settings, StartOptions::default()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_shard_id_is_stable_and_spread() {
        // Pinned values: changing the function would move every entity.
        assert_eq!(default_shard_id("c-1", 1000), default_shard_id("c-1", 1000));
        let pinned = default_shard_id("counter-42", 1000);
        assert_eq!(pinned, (xxhash_rust::xxh3::xxh3_64(b"counter-42") % 1000).to_string());
        let used: BTreeSet<ShardId> = (0..10_000).map(|i| default_shard_id(&format!("e{i}"), 100)).collect();
        assert_eq!(used.len(), 100);
    }

    #[test]
    fn settings_validation_gives_typed_errors() {
        assert!(ShardingSettings::default().validate().is_ok());
        for s in [
            ShardingSettings { number_of_shards: 0, ..Default::default() },
            ShardingSettings { buffer_size: 0, ..Default::default() },
            ShardingSettings { min_nr_of_members: 0, ..Default::default() },
        ] {
            assert!(matches!(s.validate(), Err(Error::Config(_))));
        }
    }
}
