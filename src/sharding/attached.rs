//! A region as the node it runs on sees it: the node layer knows only
//! [`Attached`]; this file turns a region into one (hand-off before a
//! leave, readiness, metrics) and finds the node's regions again.

use std::sync::Arc;

use futures::future::BoxFuture;

use super::ShardId;
use super::counters::RegionCounterCells;
use super::query::{EntityIdPage, RegionInfo};
use crate::error::Result;
use crate::node::{Attached, Node, RegionState};

/// What the node and tools need from a running region, whatever its entity type.
pub(crate) trait RegionControl: Send + Sync {
    fn type_name(&self) -> &str;
    /// Hands off every shard, then stops the region.
    fn graceful_shutdown(&self) -> BoxFuture<'_, ()>;
    /// A proxy routes but hosts nothing.
    fn is_proxy(&self) -> bool;
    /// The role of the nodes that host the type (and its coordinator).
    fn role(&self) -> Option<&str>;
    /// The type's ask timeout (also bounds queries to its coordinator).
    fn ask_timeout(&self) -> std::time::Duration;
    /// The shard of an entity id (the type's extractor on this node).
    fn shard_of(&self, entity_id: &str) -> ShardId;
    /// The type's longest entity id (`max_entity_id_bytes`).
    fn max_entity_id_bytes(&self) -> usize;
    /// The region's counters.
    fn counters(&self) -> &RegionCounterCells;
    /// The region's own view of itself.
    fn info(&self) -> BoxFuture<'_, Result<RegionInfo>>;
    /// A page of the entity ids it runs.
    fn entity_ids(&self, after: Option<(ShardId, String)>, limit: usize) -> BoxFuture<'_, Result<EntityIdPage>>;
}

/// A region attached to its node.
struct AttachedRegion(Arc<dyn RegionControl>);

/// Attaches `region` to `node`; [`crate::Error::TypeAlreadyStarted`] when its type runs there
/// already.
pub(crate) fn attach(node: &Node, region: Arc<dyn RegionControl>) -> Result<()> {
    node.attach(Arc::new(AttachedRegion(region)))
}

/// The regions (and proxies) started on `node`, in start order.
pub(crate) fn regions(node: &Node) -> Vec<Arc<dyn RegionControl>> {
    node.attached()
        .iter()
        .filter_map(|part| part.as_any().downcast_ref::<AttachedRegion>().map(|r| r.0.clone()))
        .collect()
}

impl Attached for AttachedRegion {
    fn name(&self) -> &str {
        self.0.type_name()
    }

    fn hand_off(&self) -> BoxFuture<'_, ()> {
        self.0.graceful_shutdown()
    }

    fn readiness(&self) -> BoxFuture<'_, RegionState> {
        Box::pin(async move {
            match self.0.info().await {
                Ok(info) if info.refused => RegionState::Refused,
                Ok(info) if !info.registered => RegionState::Unregistered,
                Ok(_) => RegionState::Registered,
                Err(e) => RegionState::NotAnswering(e.to_string()),
            }
        })
    }

    #[cfg(feature = "metrics")]
    fn sample_metrics<'a>(&'a self, node_id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(sample(&*self.0, node_id))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Copies the region's counters and state into the `metrics` facade.
#[cfg(feature = "metrics")]
async fn sample(region: &dyn RegionControl, node_id: &str) {
    use ::metrics::gauge;

    use crate::metrics::{set_counter, set_counters_by};

    let l = vec![("node", node_id.to_string()), ("type", region.type_name().to_string())];
    let c = region.counters().snapshot();
    set_counters_by(
        "ddshard_region_messages_total",
        &l,
        "path",
        &[
            ("local_routed", c.local_routed),
            ("remote_direct", c.remote_direct),
            ("remote_sent_direct", c.remote_sent_direct),
        ],
    );
    set_counters_by(
        "ddshard_region_dropped_total",
        &l,
        "reason",
        &[
            ("buffer_full", c.dropped_buffer_full),
            ("handoff", c.dropped_handoff),
            ("invalid", c.dropped_invalid),
            ("mailbox_full", c.dropped_mailbox_full),
            ("refused", c.dropped_refused),
            ("remembered_limit", c.dropped_remembered_limit),
            ("slot_full", c.dropped_slot_full),
        ],
    );
    set_counter("ddshard_entity_starts_total", &l, c.entity_starts);
    set_counters_by(
        "ddshard_entity_stops_total",
        &l,
        "reason",
        &[
            ("passivated", c.passivations_explicit),
            ("idle", c.passivations_idle),
            ("limit", c.passivations_limit),
            ("handoff", c.handoff_stops),
        ],
    );
    set_counter("ddshard_entity_panics_total", &l, c.entity_panics);
    set_counters_by(
        "ddshard_deliveries_total",
        &l,
        "outcome",
        &[
            ("handled", c.deliveries_handled),
            ("duplicate", c.deliveries_duplicate),
            ("sent_back", c.deliveries_sent_back),
            ("held", c.deliveries_held),
        ],
    );
    set_counter("ddshard_stop_hook_overruns_total", &l, c.stop_hook_overruns);
    set_counter("ddshard_shard_load_timeouts_total", &l, c.shard_load_timeouts);
    set_counter("ddshard_shard_failures_total", &l, c.shard_failures);
    set_counter("ddshard_shard_home_requests_total", &l, c.home_requests);
    set_counter("ddshard_handoffs_started_total", &l, c.handoffs_started);
    set_counter("ddshard_handoffs_completed_total", &l, c.handoffs_completed);
    set_counter("ddshard_remember_batches_total", &l, c.remember_batches);
    set_counter("ddshard_remember_ids_written_total", &l, c.remember_ids_written);
    gauge!("ddshard_slot_bytes_high_water", &l).set(c.slot_bytes_high_water as f64);
    gauge!("ddshard_slot_budget_bytes", &l).set(c.slot_budget_bytes as f64);
    // A region that does not answer (stopping) keeps its last gauges.
    if let Ok(info) = region.info().await {
        gauge!("ddshard_region_registered", &l).set(if info.registered { 1.0 } else { 0.0 });
        gauge!("ddshard_region_hosted_shards", &l).set(info.shards.len() as f64);
        gauge!("ddshard_region_entities", &l).set(info.entities as f64);
        gauge!("ddshard_remembered_entities", &l).set(info.remembered_entities as f64);
        gauge!("ddshard_region_buffered_messages", &l).set(info.buffered as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region that answers with a fixed view of itself (or not at all), no counts and no ids.
    struct Answers(Option<RegionInfo>, RegionCounterCells);

    impl RegionControl for Answers {
        fn type_name(&self) -> &str {
            "t"
        }
        fn graceful_shutdown(&self) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
        fn is_proxy(&self) -> bool {
            false
        }
        fn role(&self) -> Option<&str> {
            None
        }
        fn ask_timeout(&self) -> std::time::Duration {
            std::time::Duration::from_secs(1)
        }
        fn shard_of(&self, _: &str) -> ShardId {
            "0".into()
        }
        fn max_entity_id_bytes(&self) -> usize {
            1
        }
        fn counters(&self) -> &RegionCounterCells {
            &self.1
        }
        fn info(&self) -> BoxFuture<'_, Result<RegionInfo>> {
            Box::pin(async move { self.0.clone().ok_or(crate::Error::ShutDown) })
        }
        fn entity_ids(&self, _: Option<(ShardId, String)>, _: usize) -> BoxFuture<'_, Result<EntityIdPage>> {
            Box::pin(async { Ok(EntityIdPage { entities: Vec::new(), next: None }) })
        }
    }

    fn info(registered: bool, refused: bool) -> RegionInfo {
        RegionInfo {
            type_name: "t".into(),
            region: "n1".into(),
            proxy: false,
            registered,
            refused,
            coordinator: None,
            buffered: 0,
            shards: vec![],
            entities: 0,
            remembered_entities: 0,
        }
    }

    #[tokio::test]
    async fn a_region_is_ready_once_registered_and_not_while_unregistered_refused_or_silent() {
        let state = |i: Option<RegionInfo>| async move {
            AttachedRegion(Arc::new(Answers(i, RegionCounterCells::default()))).readiness().await
        };
        assert_eq!(state(Some(info(true, false))).await, RegionState::Registered);
        assert_eq!(state(Some(info(false, false))).await, RegionState::Unregistered);
        assert_eq!(state(Some(info(false, true))).await, RegionState::Refused);
        assert_eq!(state(Some(info(true, true))).await, RegionState::Refused, "a refusal wins");
        assert!(matches!(state(None).await, RegionState::NotAnswering(_)));
        let region = AttachedRegion(Arc::new(Answers(None, RegionCounterCells::default())));
        assert_eq!(region.name(), "t");
        assert!(region.as_any().downcast_ref::<AttachedRegion>().is_some(), "the node's layer finds its type again");
    }
}
