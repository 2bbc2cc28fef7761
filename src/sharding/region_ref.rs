//! [`RegionRef`]: a region of any entity type on this node, for tools that do not know its
//! Rust type (an admin API, a CLI): the region's own view, a page of its entities, and the
//! queries its coordinator answers (allocation table, shard explanation, rebalance plan).

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::attached::RegionControl;
use super::protocol::{CoordinatorQuery, RegionQuery, RegionStatsReply};
use super::query::{AllocationTable, EntityIdPage, EntityLocation, RebalancePlan, RegionInfo, ShardExplanation};
use super::{ClusterShardingStats, ShardId, keys};
use crate::error::{Error, Result};
use crate::node::Node;
use crate::transport::wire;

/// Sends `query` to the coordinator of `region`'s type (on the oldest member with its role)
/// and decodes the answer; [`Error::CoordinatorUnavailable`] when no coordinator answers
/// within the type's ask timeout.
pub(crate) async fn coordinator_request<T: DeserializeOwned>(
    region: &dyn RegionControl,
    node: &Node,
    query: &CoordinatorQuery,
) -> Result<T> {
    let unavailable = || Error::CoordinatorUnavailable(region.type_name().to_string());
    let host = node.membership().singleton_host(region.role()).map(|m| m.peer()).ok_or_else(unavailable)?;
    let body = wire::encode(query)?;
    let topic = keys::coordinator_topic(region.type_name());
    let reply =
        node.transport().request(&host, &topic, &body, region.ask_timeout()).await.map_err(|_| unavailable())?;
    wire::decode(&reply)
}

/// A region (or proxy) of one entity type on this node, without its entity type. Cheap to
/// clone. Get one from [`super::Sharding::region`] or [`super::ShardRegion::erased`].
#[derive(Clone)]
pub struct RegionRef {
    control: Arc<dyn RegionControl>,
    /// `None` for a stand-in region's (no cluster behind it).
    node: Option<Node>,
}

impl std::fmt::Debug for RegionRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionRef").field("type", &self.control.type_name()).finish()
    }
}

impl RegionRef {
    pub(crate) fn new(control: Arc<dyn RegionControl>, node: Option<Node>) -> Self {
        RegionRef { control, node }
    }

    fn node(&self) -> Result<&Node> {
        self.node.as_ref().ok_or_else(|| stand_in_has_no_cluster(self.control.type_name()))
    }

    /// The entity type.
    pub fn type_name(&self) -> &str {
        self.control.type_name()
    }

    /// A proxy routes but hosts nothing.
    pub fn is_proxy(&self) -> bool {
        self.control.is_proxy()
    }

    /// What the region counted since it started (messages by path, drops by reason,
    /// hand-offs, …), as of now.
    pub fn counters(&self) -> super::RegionCounters {
        self.control.counters().snapshot()
    }

    /// The shard of `entity_id` (this node's extractor).
    pub fn shard_of(&self, entity_id: &str) -> ShardId {
        self.control.shard_of(entity_id)
    }

    /// The region's own view: registration, buffered messages, hosted shards and entities.
    pub async fn info(&self) -> Result<RegionInfo> {
        self.control.info().await
    }

    /// Up to `limit` running entity ids (1 ..= 10,000) after `after`, ordered by (shard, id);
    /// pass the page's `next` to read on.
    pub async fn entity_ids(&self, after: Option<(ShardId, String)>, limit: usize) -> Result<EntityIdPage> {
        self.control.entity_ids(after, limit).await
    }

    /// The coordinator's allocation table.
    pub async fn allocation(&self) -> Result<AllocationTable> {
        coordinator_request(&*self.control, self.node()?, &CoordinatorQuery::Allocation).await
    }

    /// Why `shard` is where it is; `None` when the type's extractor cannot produce that id.
    pub async fn explain(&self, shard: &str) -> Result<Option<ShardExplanation>> {
        let query = CoordinatorQuery::Explain { shard: shard.to_string() };
        coordinator_request(&*self.control, self.node()?, &query).await
    }

    /// What the next rebalance round would do now, acting on nothing (a dry run). The
    /// strategy's `rebalance` and `allocate` are called; the built-in strategies are pure.
    pub async fn rebalance_plan(&self) -> Result<RebalancePlan> {
        coordinator_request(&*self.control, self.node()?, &CoordinatorQuery::RebalancePlan).await
    }

    /// Runs a rebalance round now (the periodic rounds go on as scheduled); answers with the
    /// hand-offs it started.
    pub async fn rebalance(&self) -> Result<RebalancePlan> {
        coordinator_request(&*self.control, self.node()?, &CoordinatorQuery::Rebalance).await
    }

    /// Where `entity_id` lives: its shard and that shard's home and epoch.
    pub async fn locate(&self, entity_id: &str) -> Result<EntityLocation> {
        crate::sharding::ids::check_entity_id(entity_id, self.control.max_entity_id_bytes())?;
        let shard = self.shard_of(entity_id);
        let query = CoordinatorQuery::Explain { shard: shard.clone() };
        let explained: Option<ShardExplanation> = coordinator_request(&*self.control, self.node()?, &query).await?;
        Ok(EntityLocation {
            type_name: self.type_name().to_string(),
            entity_id: entity_id.to_string(),
            home: explained.as_ref().and_then(|e| e.home.clone()),
            epoch: explained.map_or(0, |e| e.epoch),
            shard,
        })
    }

    /// Entity counts of every region of the type; regions that do not answer within
    /// `timeout` are listed in `failed`.
    pub async fn cluster_stats(&self, timeout: Duration) -> Result<ClusterShardingStats> {
        let regions: std::collections::BTreeSet<super::RegionId> =
            coordinator_request(&*self.control, self.node()?, &CoordinatorQuery::CurrentRegions).await?;
        let snap = self.node()?.membership();
        let topic = keys::region_topic(self.type_name());
        let body = wire::encode(&RegionQuery::Stats)?;
        let transport = self.node()?.transport().clone();
        let asks = regions.into_iter().map(|region| {
            let peer = snap.peer(&region);
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
}

/// The error of a query a stand-in region cannot answer.
pub(crate) fn stand_in_has_no_cluster(type_name: &str) -> Error {
    Error::BadRequest(format!("region {type_name:?} is a stand-in for tests: it has no cluster to ask"))
}
