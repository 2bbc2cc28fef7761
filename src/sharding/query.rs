//! What operators ask of a sharded type: the coordinator's allocation table, why one shard is
//! where it is, what the next rebalance would move, and a region's own view.
//!
//! Every answer is plain serializable data with string keys (a region is named
//! `node_id#generation`), so the same values travel between nodes (MessagePack) and out of an
//! admin API (JSON). Times are wall-clock milliseconds since the Unix epoch (`*_ms`) or
//! durations from the moment of the answer (`*_in_ms`, `*_ago_ms`).

use serde::{Deserialize, Serialize};

/// The coordinator's view of one entity type: regions, proxies, every shard with its home.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationTable {
    /// The entity type.
    pub type_name: String,
    /// The region whose node runs the coordinator that answered.
    pub coordinator: String,
    /// Regions that host shards, by address.
    pub regions: Vec<RegionSummary>,
    /// Proxies: regions that route but host nothing (a node without the type's role, or
    /// `start_proxy`).
    pub proxies: Vec<String>,
    /// Every shard the coordinator has a record of, by shard id (with no home while its
    /// hand-off finishes or after its region was lost and nobody asked for it since).
    pub shards: Vec<ShardAllocation>,
    /// Whether the periodic rebalance may run, and when it runs next.
    pub rebalance: RebalanceStatus,
}

/// One hosting region as the coordinator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionSummary {
    /// The region (`node_id#generation`).
    pub region: String,
    /// Its node's id.
    pub node_id: String,
    /// Shards it hosts now.
    pub shards: usize,
    /// Its member's status (`joining`, `up`, `leaving`, …), `None` when membership does not
    /// list it (yet).
    pub member_status: Option<String>,
    /// Its region asked to hand off everything (leaving or stopping).
    pub shutting_down: bool,
    /// New and moved shards may go to it now (Up, not shutting down, and of the newest
    /// version among such regions).
    pub takes_new_shards: bool,
    /// The application version its node runs (`app_version`).
    #[serde(default)]
    pub app_version: String,
}

/// A shard and its home.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardAllocation {
    /// The shard id.
    pub shard: String,
    /// The hosting region, if the shard has one now.
    pub region: Option<String>,
    /// The epoch of its latest allocation (fencing token; at least the wall-clock
    /// milliseconds of that allocation).
    pub epoch: u64,
    /// Its hand-off, while one runs.
    pub hand_off: Option<HandOffProgress>,
}

/// A hand-off in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOffProgress {
    /// The hand-off's id (unique across coordinator incarnations).
    pub id: u64,
    /// The region the shard leaves.
    pub from: String,
    /// `waiting-for-acks` (regions are told to stop routing to it) or `stopping` (its
    /// entities stop on the old home).
    pub phase: String,
    /// In `waiting-for-acks`: the regions that have not confirmed yet.
    pub waiting_for: Vec<String>,
    /// Time left before the hand-off is abandoned (the shard then stays where it was).
    pub deadline_in_ms: u64,
}

/// Whether the periodic rebalance runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceStatus {
    /// The next round may move shards.
    pub allowed: bool,
    /// Why it may not, when it may not.
    pub blocked_by: Option<String>,
    /// Time to the next round.
    pub next_round_in_ms: u64,
}

/// What a rebalance round would do now (a dry run) or did (a rebalance on request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalancePlan {
    /// The entity type.
    pub type_name: String,
    /// Whether a round may move shards now; when not, `moves` is empty.
    pub allowed: bool,
    /// Why it may not, when it may not.
    pub blocked_by: Option<String>,
    /// The hand-offs the round starts, in the strategy's order.
    pub moves: Vec<PlannedMove>,
    /// Shards already being handed off (the strategy was told about them).
    pub in_progress: Vec<String>,
    /// True when the round was carried out (a rebalance on request), false for a dry run.
    pub executed: bool,
}

/// One shard a rebalance moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedMove {
    /// The shard.
    pub shard: String,
    /// Its home now.
    pub from: String,
    /// Where the strategy places it once its hand-off is done, if every move of the round
    /// finishes in this order and nothing else changes meanwhile.
    pub expected_to: String,
    /// The strategy's reason for moving it.
    pub reason: String,
}

/// Why a shard is where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardExplanation {
    /// The entity type.
    pub type_name: String,
    /// The shard.
    pub shard: String,
    /// Its home now, if any.
    pub home: Option<String>,
    /// The epoch of its latest allocation (0: never allocated).
    pub epoch: u64,
    /// Its hand-off, while one runs.
    pub hand_off: Option<HandOffProgress>,
    /// Regions waiting for its home (they asked while it had none).
    pub waiting_regions: Vec<String>,
    /// Every region and proxy, with whether it could take this shard and why not.
    pub regions: Vec<RegionVerdict>,
    /// Where the strategy would place the shard if it were allocated now (its current home
    /// counted without it), and why; `None` when no region takes shards.
    pub if_allocated_now: Option<AllocationChoice>,
    /// The move the next rebalance round would make of this shard, if any.
    pub next_rebalance: Option<PlannedMove>,
    /// Whether the next round may move shards at all, and why not.
    pub rebalance: RebalanceStatus,
    /// Its allocations and hand-offs since this coordinator took over, oldest first (the
    /// latest 16; the history is not replicated: a new coordinator starts it afresh).
    pub history: Vec<ShardEvent>,
}

/// A region seen from one shard's explanation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionVerdict {
    /// The region.
    pub region: String,
    /// Shards it hosts now.
    pub shards: usize,
    /// It may take this shard now.
    pub eligible: bool,
    /// Why not, when not (a proxy, not Up, shutting down).
    pub not_eligible_because: Option<String>,
}

/// A strategy's choice for a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationChoice {
    /// The region chosen.
    pub region: String,
    /// The strategy's reason.
    pub reason: String,
}

/// An event in a shard's life at the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEvent {
    /// When (wall-clock milliseconds).
    pub at_ms: u64,
    /// `allocated`, `hand-off-started`, `hand-off-done`, `hand-off-timed-out` or `home-lost`.
    pub kind: String,
    /// The region it concerns (the new home, the region left or lost).
    pub region: String,
    /// The epoch of an allocation (0 for other events).
    pub epoch: u64,
    /// Why.
    pub reason: String,
}

/// A region's own view of itself (answered by the region on this node, no network).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// The entity type.
    pub type_name: String,
    /// This region (`node_id#generation`).
    pub region: String,
    /// A proxy routes but hosts nothing.
    pub proxy: bool,
    /// The coordinator acknowledged its registration (it routes and, unless a proxy, hosts).
    pub registered: bool,
    /// The coordinator refused it (its shard-id extractor differs from the coordinator's).
    pub refused: bool,
    /// The coordinator it registers with, when one is known.
    pub coordinator: Option<String>,
    /// Messages waiting for a shard's home.
    pub buffered: usize,
    /// Shards hosted here with their running entity counts, by shard id.
    pub shards: Vec<ShardCount>,
    /// Running entities over all hosted shards.
    pub entities: usize,
    /// With remember-entities, the ids its shards remember (running or not).
    pub remembered_entities: usize,
}

/// A hosted shard's running entity count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardCount {
    /// The shard.
    pub shard: String,
    /// Entities running in it.
    pub entities: usize,
}

/// One page of the entity ids a region runs, ordered by (shard, entity id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntityIdPage {
    /// (shard, entity id) pairs of this page.
    pub entities: Vec<(String, String)>,
    /// Pass this as `after` for the next page; `None` on the last page.
    pub next: Option<(String, String)>,
}

/// Where an entity lives, from the coordinator's table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntityLocation {
    /// The entity type.
    pub type_name: String,
    /// The entity id.
    pub entity_id: String,
    /// Its shard (this node's shard-id extractor).
    pub shard: String,
    /// The shard's home, if it has one.
    pub home: Option<String>,
    /// The epoch of that allocation.
    pub epoch: u64,
}

pub use crate::node::Readiness;
