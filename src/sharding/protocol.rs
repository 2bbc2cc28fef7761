//! Messages of the sharding protocol between regions and the coordinator, and between regions.
//! All travel over the transport as rmp-serde; entity payloads are already-encoded bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::allocation::{RegionId, ShardId};

/// Transport topic of the regions of a type.
pub(crate) fn region_topic(type_name: &str) -> String {
    format!("region/{type_name}")
}

/// Transport topic of the coordinator of a type.
pub(crate) fn coordinator_topic(type_name: &str) -> String {
    format!("coordinator/{type_name}")
}

/// Region → coordinator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToCoordinator {
    /// A region (or proxy) announces itself.
    Register { region: RegionId, proxy: bool },
    /// Where does this shard live?
    GetShardHome { shard: ShardId, region: RegionId },
    /// The region started the shard it was asked to host.
    ShardStarted { shard: ShardId, region: RegionId },
    /// The region stopped routing to the shard's old home.
    BeginHandOffAck { shard: ShardId, region: RegionId },
    /// The old home stopped the shard's entities, answering the `HandOff` with this id (a late
    /// answer to an earlier, timed-out hand-off must not complete a later one).
    ShardStopped { shard: ShardId, region: RegionId, handoff: u64 },
    /// Hand off every shard of this region; it is shutting down.
    GracefulShutdownReq { region: RegionId },
    /// The region stopped (after a graceful shutdown); forget it.
    RegionStopped { region: RegionId },
}

/// Coordinator → region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToRegion {
    /// Registration accepted.
    RegisterAck { coordinator: RegionId },
    /// The shard lives at `region`, allocated with `epoch`.
    ShardHome { shard: ShardId, region: RegionId, epoch: u64 },
    /// Start hosting the shard (re-sent until `ShardStarted`).
    HostShard { shard: ShardId, epoch: u64 },
    /// Stop routing to the shard's current home; buffer its messages; acknowledge.
    BeginHandOff { shard: ShardId },
    /// Drop the shard's buffered messages, stop its entities, answer `ShardStopped` with the
    /// same hand-off id.
    HandOff { shard: ShardId, handoff: u64 },
}

/// Region → region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RegionToRegion {
    /// A message for an entity (payload is the rmp-encoded `Entity::Message`).
    Deliver {
        shard: ShardId,
        entity_id: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
        /// Set for asks: who waits, and the ask id there.
        reply_to: Option<(RegionId, u64)>,
    },
    /// The answer to an ask (rmp-encoded `Entity::Reply`), or why there is none.
    AskReply { ask_id: u64, result: Result<serde_bytes::ByteBuf, String> },
}

/// Everything on a region topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RegionInbound {
    /// From the coordinator.
    Coordinator(ToRegion),
    /// From another region.
    Region(RegionToRegion),
}

/// Requests answered on the coordinator topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CoordinatorQuery {
    /// Registered regions.
    CurrentRegions,
}

/// Requests answered on a region topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RegionQuery {
    /// Shards hosted by the region with their entity counts.
    Stats,
    /// Shards hosted by the region with their entity ids.
    State,
}

/// Answer to [`RegionQuery::Stats`]: shard id → number of live entities.
pub type RegionStatsReply = BTreeMap<ShardId, usize>;
/// Answer to [`RegionQuery::State`]: shard id → entity ids.
pub type RegionStateReply = BTreeMap<ShardId, Vec<String>>;
