//! Settings of one sharded entity type, grouped as the `[sharding]` table is: `remember`,
//! `passivation`, `coordinator`, `state`. `config` embeds them; from the rest of `sharding`
//! they take only the passivation policy's types, so no import runs back to `config`
//! (`tests/imports_point_one_way.rs`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The longest `max_entity_id_bytes` may allow: the longest member a remembered-entity set
/// holds (a longer one would make the whole set undecodable on every peer).
pub const MAX_ENTITY_ID_LEN: usize = crate::ddata::orset::MAX_ELEMENT_LEN;

/// How the coordinator places shards (see [`super::allocation`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AllocationSettings {
    /// [`super::LeastShardAllocation`] (the default).
    LeastShard {
        /// Most shards moved per rebalance round.
        absolute_limit: usize,
        /// Most shards moved per round as a fraction of all shards.
        relative_limit: f64,
    },
    /// [`super::LegacyLeastShardAllocation`].
    LegacyLeastShard {
        /// Tolerated difference between most and least loaded region.
        threshold: usize,
        /// Shards in hand-off at the same time.
        max_simultaneous: usize,
    },
    /// [`super::ConsistentHashingAllocation`].
    ConsistentHashing {
        /// Ring points per region.
        virtual_nodes: usize,
        /// Shards moved per round.
        rebalance_limit: usize,
    },
    /// [`super::ExternalAllocation`]: shards go where an operator says
    /// ([`super::ShardRegion::set_external_shard_location`]), kept in a replicated, durable LWW-map.
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

/// Which entities a region passivates by itself (`[sharding.passivation]`). Explicit
/// passivation ([`super::EntityContext::passivate`]) works under every strategy; types with
/// remember-entities never passivate by themselves (as in Akka).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PassivationStrategy {
    /// Entities idle for [`PassivationSettings::idle_timeout`] (the default).
    Idle,
    /// At most [`PassivationSettings::active_entity_limit`] entities run per region (divided
    /// among its shards); a new one passivates the victim of the replacement policy first.
    /// `idle_timeout`, when set, applies too.
    ActiveEntityLimit,
    /// Only explicit passivation.
    None,
}

/// Which entity makes room under an active-entity limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplacementPolicy {
    /// The least recently used.
    Lru,
    /// Segmented LRU: entities used at least twice are protected (80% of the limit) from a
    /// stream of one-off entities.
    Slru,
    /// The most recently used (for cyclic access, where the least recent is needed next).
    Mru,
    /// The least frequently used since it started (ties: the least recent).
    Lfu,
}

/// How new entities are admitted under an active-entity limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PassivationAdmission {
    /// Every new entity is admitted; the replacement policy picks who goes.
    None,
    /// Window-TinyLFU: a new entity first runs in a small window (1% of the limit); leaving it,
    /// it stays only if it was used more often recently (a count-min sketch) than the entity
    /// the replacement policy would passivate for it.
    WindowTinylfu,
}

/// Passivation settings of a type (`[sharding.passivation]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PassivationSettings {
    /// Which strategy.
    pub strategy: PassivationStrategy,
    /// Entities idle this long are passivated (`None`: never), under the `idle` and
    /// `active-entity-limit` strategies of [`Self::strategy`]. An entity stops within a
    /// region tick (about 100 ms) of the timeout after its last message, either side: a
    /// message that reaches a running entity without a hop is dated by the shard's latest
    /// tick or input, not by a clock read of its own.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Option<Duration>,
    /// `active-entity-limit`: entities running at once per region (the region divides it
    /// among its shards, each keeping room for at least one). Changeable at run time with
    /// [`super::ShardRegion::set_passivation_limit`].
    pub active_entity_limit: usize,
    /// `active-entity-limit`: who goes to make room.
    pub replacement: ReplacementPolicy,
    /// `active-entity-limit`: admission of new entities.
    pub admission: PassivationAdmission,
    /// `idle`: a safety net, not a tuning knob — at most this many entities run per region
    /// (divided among its shards); a new one past it passivates the one `replacement` picks
    /// first, so a flood of distinct ids cannot grow memory without bound before the idle
    /// timeout. `None`: no limit. (Remembered entities are never passivated automatically.)
    pub idle_safety_limit: Option<usize>,
}

impl Default for PassivationSettings {
    fn default() -> Self {
        PassivationSettings {
            strategy: PassivationStrategy::Idle,
            idle_timeout: Some(Duration::from_secs(120)),
            active_entity_limit: 100_000,
            replacement: ReplacementPolicy::Lru,
            admission: PassivationAdmission::None,
            idle_safety_limit: Some(1_000_000),
        }
    }
}

/// Remembered entities (`[sharding.remember]`): a type that remembers starts its entities
/// again after a hand-off, a crash or a full-cluster restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RememberEntitiesSettings {
    /// Remember started entities (in replicated OR-sets, durable in LMDB) and start them again
    /// after hand-off, crash or a full-cluster restart. Idle passivation is off for such types.
    pub enabled: bool,
    /// OR-set keys per shard for remembered ids (ids spread by hash). More slots keep each
    /// replicated value small: about 60 bytes per id, so 1M ids in 64 slots is ~1 MB per key.
    /// Like [`ShardingSettings::number_of_shards`], keep it stable for the life of the data.
    pub slots: u32,
    /// Most entities one shard remembers (`None`: no limit but the slot
    /// budget, which bounds each slot's bytes). A start past it fails at once with
    /// [`Error::RememberedLimit`] and the shard serves every
    /// entity it remembers; a remembered entity that passivates makes room. Ids already
    /// remembered all come back after a hand-off or restart, even past a lowered limit.
    pub max_per_shard: Option<usize>,
    /// Remembered entities a shard starts per `recovery_interval` (0: all at once).
    pub recovery_batch: usize,
    /// The pace of `recovery_batch`.
    #[serde(with = "humantime_serde")]
    pub recovery_interval: Duration,
    /// Writes of remembered ids, and of the coordinator's set of remembered shards, wait for a
    /// majority of the replicator's roster plus this many more replicas, each with the write
    /// in LMDB.
    pub write_majority_plus: usize,
    /// A shard's load of its remembered ids, and a coordinator take-over's read of the
    /// remembered shards, read every reachable replica, and never fewer than a majority of the
    /// roster plus this many. Replicas that joined since a write can make up a majority of
    /// their own; the holders that acknowledged it are read as long as they are reachable.
    pub read_majority_plus: usize,
    /// Lower bound on those write and read replica counts (capped at the roster's size).
    pub majority_min_cap: usize,
}

impl ShardingSettings {
    /// The settings every node hosting a type must share, by name and value: a node with
    /// another value would place ids in other shards (`number_of_shards`, a daemon process's
    /// count), or read and write other keys (`remember.*`, `state.*`, whether the type is
    /// durable) and silently miss data. A region sends them when it registers; the coordinator
    /// refuses one whose values differ from its node's, naming the setting.
    pub(crate) fn must_agree(&self, durable: bool) -> Vec<(String, String)> {
        let mut agreed = vec![
            ("number_of_shards".to_string(), self.number_of_shards.to_string()),
            ("remember.enabled".to_string(), self.remember.enabled.to_string()),
            ("durable (start_durable)".to_string(), durable.to_string()),
        ];
        if self.remember.enabled {
            agreed.push(("remember.slots".to_string(), self.remember.slots.to_string()));
        }
        if durable {
            agreed.push(("state.slots".to_string(), self.state.slots.to_string()));
        }
        agreed
    }
}

/// Longest part of a peer's setting value that a disagreement quotes.
const MAX_SETTING_VALUE_SHOWN: usize = 32;

/// The settings of `theirs` that `ours` has with another value, as a sentence naming each
/// (`None` when they agree). Names only one side has are left out: an older or newer node
/// may not know them, and the names both know decide.
pub(crate) fn disagreement(ours: &[(String, String)], theirs: &[(String, String)]) -> Option<String> {
    let differing: Vec<String> = theirs
        .iter()
        .filter_map(|(name, value)| {
            let (_, mine) = ours.iter().find(|(n, _)| n == name)?;
            // A peer's value goes into logs and errors: only as much of it as a setting needs.
            let value: String = value.chars().take(MAX_SETTING_VALUE_SHOWN).collect();
            (*mine != value).then(|| format!("`{name}` is {value} there but {mine} on the coordinator's node"))
        })
        .collect();
    (!differing.is_empty()).then(|| differing.join("; "))
}

impl Default for RememberEntitiesSettings {
    fn default() -> Self {
        RememberEntitiesSettings {
            enabled: false,
            slots: 16,
            max_per_shard: None,
            recovery_batch: 0,
            recovery_interval: Duration::from_millis(100),
            write_majority_plus: 0,
            read_majority_plus: 0,
            majority_min_cap: 0,
        }
    }
}

/// The coordinator's replicated state (`[sharding.coordinator]`): how long each write and
/// take-over read waits, and how many replicas each needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardCoordinatorSettings {
    /// Timeout of each coordinator state write (retried until it succeeds).
    #[serde(with = "humantime_serde")]
    pub updating_state_timeout: Duration,
    /// Timeout of each coordinator state read at take-over (retried until it succeeds).
    #[serde(with = "humantime_serde")]
    pub waiting_for_state_timeout: Duration,
    /// Coordinator state writes wait for a majority plus this many more replicas (Akka's
    /// `write-majority-plus`, 3). Majority reads and writes intersect anyway; the extra copies
    /// keep the state safe across membership changes that shift what "majority" means.
    pub write_majority_plus: usize,
    /// The take-over read of the coordinator state asks a majority plus this many (Akka's
    /// `read-majority-plus`, 5).
    pub read_majority_plus: usize,
    /// Lower bound on those write and read replica counts (capped at the cluster size; Akka's
    /// `majority-min-cap`, 5). With the defaults, a cluster of up to 5 nodes needs every
    /// member for each allocation, so one unreachable node holds new allocations back until it
    /// is downed; lower it (say to 3) to keep allocating in small clusters with one node out.
    pub majority_min_cap: usize,
    /// Pause before a failed state write is tried again, doubling after each failure up to
    /// `write_retry_backoff_max` (allocations wait meanwhile).
    #[serde(with = "humantime_serde")]
    pub write_retry_backoff_min: Duration,
    /// The longest pause between tries of a failed state write.
    #[serde(with = "humantime_serde")]
    pub write_retry_backoff_max: Duration,
}

impl Default for ShardCoordinatorSettings {
    fn default() -> Self {
        ShardCoordinatorSettings {
            updating_state_timeout: Duration::from_secs(5),
            waiting_for_state_timeout: Duration::from_secs(2),
            write_majority_plus: 3,
            read_majority_plus: 5,
            majority_min_cap: 5,
            write_retry_backoff_min: Duration::from_millis(100),
            write_retry_backoff_max: Duration::from_secs(2),
        }
    }
}

/// Durable entities' replicated states (`[sharding.state]`, types started with
/// [`super::Sharding::start_durable`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DurableStateSettings {
    /// Replicated keys per shard that
    /// hold its entities' states (entities spread by id hash). More slots keep each replicated
    /// value small: a value travels whole in a read, so keep states per slot × state size well
    /// under `transport.max_frame_size`. Keep it stable for the life of the data.
    pub slots: u32,
    /// Largest encoded state; a bigger one fails its write with
    /// [`Error::StateTooLarge`] and nothing is written.
    pub max_bytes: usize,
    /// State writes wait for a majority plus this many more replicas (each
    /// with the write in LMDB).
    pub write_majority_plus: usize,
    /// A shard's start claims and reads its states from every reachable
    /// replica, and from no fewer than a majority of the roster plus this many (0 by default:
    /// majorities of the roster intersect across one roster change, so no extra replica is
    /// needed; each one more makes a claim wait for one more replica).
    pub read_majority_plus: usize,
    /// Lower bound on those write and read replica counts (capped at the
    /// cluster size).
    pub majority_min_cap: usize,
}

impl Default for DurableStateSettings {
    fn default() -> Self {
        DurableStateSettings {
            slots: 16,
            max_bytes: 64 * 1024,
            write_majority_plus: 0,
            read_majority_plus: 0,
            majority_min_cap: 0,
        }
    }
}

/// Settings of one sharded entity type (defaults in `config/default.toml`, section `[sharding]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardingSettings {
    /// Shards per type; entity ids are spread over them by [`super::default_shard_id`]. Keep it
    /// stable for the life of the data (about 10× the largest node count).
    pub number_of_shards: u32,
    /// Only nodes with this role host the type; elsewhere `start` gives a proxy.
    pub role: Option<String>,
    /// Remembered entity that stopped without passivating (panic) restarts after this.
    #[serde(with = "humantime_serde")]
    pub entity_restart_backoff: Duration,
    /// A shard whose remembered set could not be loaded or written restarts after this, plus
    /// up to a quarter more (by a hash of the shard, so shards that failed together restart
    /// spread out).
    #[serde(with = "humantime_serde")]
    pub shard_failure_backoff: Duration,
    /// Messages a region buffers while shard homes are unknown, or that its task has not taken
    /// yet, and messages each shard holds while its data loads or their entities start or stop
    /// (remembered starts waiting for their write, say); beyond it a message fails with
    /// [`Error::BufferFull`] (a flood of distinct ids, or a task that falls behind, cannot grow
    /// memory without bound).
    pub buffer_size: usize,
    /// Longest entity id, in bytes (at most [`MAX_ENTITY_ID_LEN`], 16 KiB): longer ones
    /// are refused with [`Error::EntityIdTooLong`], locally and from peers. Every id costs its
    /// length in each message, in the entity table and, remembered, in its slot, so a client
    /// cannot make any of them cost more than this.
    pub max_entity_id_bytes: usize,
    /// Messages an entity's mailbox holds before it takes them; beyond it a message is dropped
    /// and its ask fails with [`Error::MailboxFull`] (a slow entity cannot grow memory without
    /// bound).
    pub entity_mailbox_capacity: usize,
    /// How long the task running an entity waits for another message once its mailbox is
    /// empty, before it parks the entity and ends: at least this long, at most twice (its timer
    /// is set once per period, not per message). A busy entity then keeps its task (a message
    /// only wakes it; starting a task per message costs several times more); an entity idle
    /// longer costs no task, only its parked value. Zero parks at once. The run that creates
    /// an entity does not linger: most entities started by a message get no other soon, and
    /// their lingering tasks would hold memory the allocator then keeps.
    #[serde(with = "humantime_serde")]
    pub entity_linger: Duration,
    /// One timeout for a whole hand-off (acks, stopping the entities).
    #[serde(with = "humantime_serde")]
    pub handoff_timeout: Duration,
    /// How often the coordinator considers rebalancing.
    #[serde(with = "humantime_serde")]
    pub rebalance_interval: Duration,
    /// Remembered entities (`[sharding.remember]`).
    pub remember: RememberEntitiesSettings,
    /// Passivation: the idle timeout and the strategy (`[sharding.passivation]`).
    pub passivation: PassivationSettings,
    /// The coordinator's replicated state (`[sharding.coordinator]`).
    pub coordinator: ShardCoordinatorSettings,
    /// Durable entities' replicated states (`[sharding.state]`).
    pub state: DurableStateSettings,
    /// Default timeout of [`super::ShardRegion::ask`] and of queries.
    #[serde(with = "humantime_serde")]
    pub ask_timeout: Duration,
    /// Regions that must have registered before the first shard is allocated.
    pub min_nr_of_members: usize,
    /// Shards of a remembering or durable type that one region loads at once (their
    /// remembered ids, their states' claim); the others wait their turn, their messages
    /// buffered. After a full-cluster restart every shard starts at once: without a cap their
    /// reads compete for the same replicas, run past `coordinator.waiting_for_state_timeout`
    /// and fail for `shard_failure_backoff`, and the retries compete again.
    pub max_concurrent_shard_loads: usize,
    /// Registration and shard-home retry interval (backoff starts at an eighth of it).
    #[serde(with = "humantime_serde")]
    pub retry_interval: Duration,
    /// `HostShard` is re-sent after this long without `ShardStarted`.
    #[serde(with = "humantime_serde")]
    pub shard_start_timeout: Duration,
    /// Shard allocation strategy.
    pub allocation: AllocationSettings,
}

impl Default for ShardingSettings {
    fn default() -> Self {
        ShardingSettings {
            number_of_shards: 1000,
            role: None,
            entity_restart_backoff: Duration::from_secs(10),
            shard_failure_backoff: Duration::from_secs(10),
            buffer_size: 100_000,
            max_entity_id_bytes: 1024,
            entity_mailbox_capacity: 10_000,
            entity_linger: Duration::from_millis(100),
            handoff_timeout: Duration::from_secs(30),
            rebalance_interval: Duration::from_secs(10),
            remember: RememberEntitiesSettings::default(),
            passivation: PassivationSettings::default(),
            coordinator: ShardCoordinatorSettings::default(),
            state: DurableStateSettings::default(),
            ask_timeout: Duration::from_secs(5),
            max_concurrent_shard_loads: 32,
            min_nr_of_members: 1,
            retry_interval: Duration::from_secs(2),
            shard_start_timeout: Duration::from_secs(10),
            allocation: AllocationSettings::default(),
        }
    }
}

impl ShardingSettings {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(format!("sharding: {m}")));
        crate::config::limits::check_durations(&[
            ("sharding.entity_restart_backoff", self.entity_restart_backoff),
            ("sharding.shard_failure_backoff", self.shard_failure_backoff),
            ("sharding.remember.recovery_interval", self.remember.recovery_interval),
            ("sharding.handoff_timeout", self.handoff_timeout),
            ("sharding.rebalance_interval", self.rebalance_interval),
            ("sharding.passivation.idle_timeout", self.passivation.idle_timeout.unwrap_or_default()),
            ("sharding.ask_timeout", self.ask_timeout),
            ("sharding.retry_interval", self.retry_interval),
            ("sharding.shard_start_timeout", self.shard_start_timeout),
            ("sharding.coordinator.updating_state_timeout", self.coordinator.updating_state_timeout),
            ("sharding.coordinator.waiting_for_state_timeout", self.coordinator.waiting_for_state_timeout),
            ("sharding.coordinator.write_retry_backoff_min", self.coordinator.write_retry_backoff_min),
            ("sharding.coordinator.write_retry_backoff_max", self.coordinator.write_retry_backoff_max),
        ])?;
        let c = &self.coordinator;
        if c.write_retry_backoff_min.is_zero() || c.write_retry_backoff_max < c.write_retry_backoff_min {
            return bad("coordinator.write_retry_backoff_min must be > 0 and at most write_retry_backoff_max");
        }
        if self.number_of_shards == 0 {
            return bad("number_of_shards must be > 0");
        }
        if self.buffer_size == 0 {
            return bad("buffer_size must be > 0");
        }
        if !(1..=MAX_ENTITY_ID_LEN).contains(&self.max_entity_id_bytes) {
            return bad("max_entity_id_bytes must be between 1 and 16384");
        }
        if self.entity_mailbox_capacity == 0 {
            return bad("entity_mailbox_capacity must be > 0");
        }
        if self.min_nr_of_members == 0 {
            return bad("min_nr_of_members must be >= 1");
        }
        if self.max_concurrent_shard_loads == 0 {
            return bad("max_concurrent_shard_loads must be >= 1");
        }
        if self.handoff_timeout < Duration::from_millis(100) || self.ask_timeout.is_zero() {
            return bad("handoff_timeout must be >= 100ms and ask_timeout > 0");
        }
        if self.retry_interval.is_zero() || self.rebalance_interval.is_zero() || self.shard_start_timeout.is_zero() {
            return bad("retry_interval, rebalance_interval and shard_start_timeout must be > 0");
        }
        if !(1..=4096).contains(&self.remember.slots) {
            return bad("remember.slots must be between 1 and 4096");
        }
        if self.remember.max_per_shard == Some(0) {
            return bad("remember.max_per_shard must be >= 1 (unset it for no limit)");
        }
        if !(1..=4096).contains(&self.state.slots) {
            return bad("state.slots must be between 1 and 4096");
        }
        if !(1..=1 << 30).contains(&self.state.max_bytes) {
            return bad("state.max_bytes must be between 1 byte and 1 GiB");
        }
        if self.remember.recovery_batch > 0 && self.remember.recovery_interval.is_zero() {
            return bad("remember.recovery_interval must be > 0 when remember.recovery_batch is set");
        }
        if !(1..=1 << 32).contains(&self.passivation.active_entity_limit) {
            return bad("passivation.active_entity_limit must be between 1 and 2^32");
        }
        if self.passivation.idle_safety_limit.is_some_and(|l| !(1..=1 << 32).contains(&l)) {
            return bad("passivation.idle_safety_limit must be between 1 and 2^32");
        }
        Ok(())
    }

    /// Whether the type runs under the `active-entity-limit` strategy (the limit it tunes).
    pub(crate) fn has_active_entity_limit(&self) -> bool {
        self.passivation.strategy == PassivationStrategy::ActiveEntityLimit && !self.remember.enabled
    }

    /// The region-wide active-entity limit, when the type has one (never with remember-entities):
    /// `active_entity_limit` under that strategy, the safety net under `idle`.
    pub(crate) fn passivation_limit(&self) -> Option<usize> {
        if self.remember.enabled {
            return None;
        }
        match self.passivation.strategy {
            PassivationStrategy::ActiveEntityLimit => Some(self.passivation.active_entity_limit),
            PassivationStrategy::Idle => self.passivation.idle_safety_limit,
            PassivationStrategy::None => None,
        }
    }

    /// The passivation policy of one shard, whose share of the region's limit is `share`.
    pub(crate) fn passivation_policy(&self, share: Option<usize>) -> super::shard::passivation::PolicySettings {
        use super::shard::passivation::{PolicySettings, Replacement};
        let idle_timeout = match self.passivation.strategy {
            PassivationStrategy::None => None,
            _ => self.passivation.idle_timeout,
        };
        let limited = self.passivation_limit().is_some();
        PolicySettings {
            idle_timeout,
            limit: if limited { share } else { None },
            replacement: match self.passivation.replacement {
                ReplacementPolicy::Lru => Replacement::Lru,
                ReplacementPolicy::Slru => Replacement::Slru { protected_per_mille: 800 },
                ReplacementPolicy::Mru => Replacement::Mru,
                ReplacementPolicy::Lfu => Replacement::Lfu,
            },
            window_tinylfu: self.passivation.admission == PassivationAdmission::WindowTinylfu,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_settings_that_must_agree_name_the_keys_and_shards_an_id_maps_to_and_only_those_in_use() {
        let plain = ShardingSettings { number_of_shards: 30, ..ShardingSettings::default() };
        assert_eq!(
            plain.must_agree(false),
            named(&[("number_of_shards", "30"), ("remember.enabled", "false"), ("durable (start_durable)", "false")])
        );
        let remembering = ShardingSettings {
            remember: RememberEntitiesSettings { enabled: true, slots: 8, ..RememberEntitiesSettings::default() },
            state: DurableStateSettings { slots: 4, ..DurableStateSettings::default() },
            ..plain
        };
        assert_eq!(
            remembering.must_agree(true),
            named(&[
                ("number_of_shards", "30"),
                ("remember.enabled", "true"),
                ("durable (start_durable)", "true"),
                ("remember.slots", "8"),
                ("state.slots", "4"),
            ])
        );
    }

    #[test]
    fn a_disagreement_names_each_differing_setting_both_sides_know_and_nothing_else() {
        let ours = named(&[("number_of_shards", "30"), ("state.slots", "16"), ("remember.slots", "8")]);
        assert_eq!(disagreement(&ours, &ours), None);
        assert_eq!(disagreement(&ours, &[]), None, "a node that predates the check");
        let theirs =
            named(&[("number_of_shards", "30"), ("state.slots", "8"), ("remember.slots", "4"), ("new.knob", "x")]);
        let long = named(&[("state.slots", &"9".repeat(10_000))]);
        let said = disagreement(&ours, &long).unwrap();
        assert!(said.len() < 120, "a peer's value is quoted in part: {said}");
        assert_eq!(
            disagreement(&ours, &theirs).as_deref(),
            Some(
                "`state.slots` is 8 there but 16 on the coordinator's node; \
                 `remember.slots` is 4 there but 8 on the coordinator's node"
            )
        );
    }
}
