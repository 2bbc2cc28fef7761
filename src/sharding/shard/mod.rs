//! The shards a region hosts: [`core`] is the life cycle of one shard's entities, [`host`]
//! performs it for every hosted shard, [`entity`] runs one entity, [`remember`] reads and
//! writes remembered entity ids, and [`state`] claims, reads and writes durable entity states.

pub(crate) mod batch;
pub(crate) mod core;
mod entity;
mod host;
mod mailbox;
pub(crate) mod passivation;
pub(crate) mod remember;
pub(crate) mod state;

pub(crate) use core::ShardInput;
pub use core::StopReason;
pub(crate) use entity::Factory;
pub(crate) use host::{LocalShards, ShardDirectory};
pub(crate) use state::StateIo;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::ddata::Replicator;
use crate::metrics::TypeMetrics;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::settings::ShardingSettings;
use crate::spawn::Spawner;
use core::ShardCore;
use passivation::PolicySettings;

use crate::sharding::Entity;
use crate::sharding::envelope::Envelope;
use crate::sharding::ids::ShardId;
use crate::sharding::region::RegionInput;

/// What the parts of one entity type's region on a node share: its name, settings, counters
/// and metrics, and the node services its shards, writers and entities use.
#[derive(Clone)]
pub(crate) struct RegionParts {
    pub(crate) type_name: Arc<str>,
    pub(crate) settings: ShardingSettings,
    pub(crate) counters: Arc<RegionCounterCells>,
    pub(crate) metrics: Arc<TypeMetrics>,
    pub(crate) replicator: Replicator,
    pub(crate) spawner: Spawner,
    /// What one replicated slot may hold: the replicator's message budget.
    pub(crate) slot_budget: usize,
}

/// What entity and I/O tasks report to their region.
pub(crate) enum ShardEvent<E: Entity> {
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
    /// Durable entities: a write under `epoch` was refused because a newer allocation (epoch
    /// `fence`) claimed the shard's state: the shard is stale here.
    Fenced {
        shard: ShardId,
        epoch: u64,
        fence: u64,
    },
    /// A failed shard's backoff is over: start it again.
    RestartShard {
        shard: ShardId,
        epoch: u64,
    },
}

/// Outcome of a remembered-entities store operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StoreResult {
    Loaded(BTreeSet<String>),
    /// Written, except the adds in `refused` (their slot is at its byte budget).
    WriteDone {
        refused: BTreeSet<String>,
    },
    Failed,
    MovedAway(String),
}

/// Work for the region's loop: an input for the region core or for one shard core.
pub(crate) enum Work<E: Entity> {
    Region(RegionInput<Envelope<E>>),
    Shard(ShardId, ShardInput<Envelope<E>>),
}

/// What one try of a slot key's update refused for the slot's byte budget, filled by the update
/// as the replicator applies it (each try starts it afresh) and read by the writer afterwards.
#[derive(Clone, Default)]
pub(crate) struct FullSlot(std::sync::Arc<std::sync::Mutex<BTreeSet<String>>>);

impl FullSlot {
    /// Starts a try: forgets what an earlier try refused.
    pub(crate) fn start_try(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        let mut refused = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        refused.clear();
        refused
    }

    /// What the last try refused.
    pub(crate) fn take(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// Counts the `refused` writes of a full slot `key` and warns, at most once a minute per slot
/// (`what` names the slot's kind and what to raise).
pub(crate) fn report_full_slot(
    counters: &crate::sharding::counters::RegionCounterCells,
    log: &mut crate::log_limit::LogLimiter<String>,
    type_name: &str,
    key: &str,
    budget: usize,
    refused: usize,
    what: &str,
) {
    counters.dropped_slot_full.fetch_add(refused as u64, std::sync::atomic::Ordering::Relaxed);
    if let Some(held_back) = log.allow(&key.to_string(), std::time::Instant::now()) {
        tracing::warn!(%type_name, %key, budget, refused, held_back,
            "{what} slot at its byte budget: writes that would grow it are refused (SlotFull)");
    }
}

/// Hand-off stops entities with this much of the hand-off timeout (at least 1 s), leaving the
/// rest for the hand-off messages around it; an entity's stop hook has as long.
pub(crate) fn entity_stop_timeout(handoff_timeout: Duration) -> Duration {
    handoff_timeout.saturating_sub(Duration::from_secs(5)).max(Duration::from_secs(1))
}

/// A new shard's core as its type's settings make it: remembering its entities, loading its
/// durable states first (`durable`), or serving at once; with the type's buffer and
/// remembered limits. `policy` is the shard's passivation (its share of the region's limit).
pub(crate) fn new_shard_core<M, S>(s: &ShardingSettings, durable: bool, policy: PolicySettings) -> ShardCore<M, S> {
    let stop_timeout = entity_stop_timeout(s.handoff_timeout);
    let core = if s.remember.enabled {
        ShardCore::remembering(stop_timeout, s.entity_restart_backoff)
    } else if durable {
        ShardCore::loading(policy, stop_timeout)
    } else {
        ShardCore::new(policy, stop_timeout)
    };
    core.with_buffer_limit(s.buffer_size).with_remembered_limit(s.remember.max_per_shard)
}
