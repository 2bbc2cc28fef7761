//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`),
//! exported as Prometheus text by [`install_prometheus`].
//!
//! Every series carries a `node` label (the node id: the test kit runs many nodes in one
//! process) and, where it applies, `type` (the entity type); never a shard or entity id, so
//! the number of series stays bounded. [`CATALOG`] is the one list of what is emitted (a test
//! keeps `METRICS.md` and a live cluster's output equal to it).
//!
//! Two sources feed the facade:
//! - the counters the crate keeps anyway (transport, gossip, heartbeats, replicator, regions)
//!   and gauges of the node's state (members, hosted shards and entities) are copied into it by
//!   a sampler once a second and by [`crate::Node::sample_metrics`] (call it before a scrape to
//!   read the latest values), so hot paths pay nothing extra for them;
//! - latencies are recorded where they happen (asks, LMDB commits, coordinator state writes),
//!   only when the feature is on.

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only grows (`_total`).
    Counter,
    /// A value now.
    Gauge,
    /// A distribution (`_seconds` or a size): Prometheus histogram buckets.
    Histogram,
}

/// One metric of [`CATALOG`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricDef {
    /// Its name.
    pub name: &'static str,
    /// Its kind.
    pub kind: MetricKind,
    /// Its labels, comma-separated.
    pub labels: &'static str,
    /// What it counts or measures.
    pub help: &'static str,
}

const fn def(name: &'static str, kind: MetricKind, labels: &'static str, help: &'static str) -> MetricDef {
    MetricDef { name, kind, labels, help }
}

use MetricKind::{Counter as C, Gauge as G, Histogram as H};

/// Every metric the crate emits.
#[rustfmt::skip]
pub const CATALOG: &[MetricDef] = &[
    def("ddshard_transport_frames_sent_total", C, "node", "Frames written to node-to-node connections."),
    def("ddshard_transport_frames_received_total", C, "node", "Frames read from node-to-node connections."),
    def("ddshard_transport_frames_dropped_total", C, "node", "Frames dropped: no subscriber, a full queue, over the size limit."),
    def("ddshard_transport_bytes_sent_total", C, "node", "Bytes written to node-to-node connections (encrypted, with length prefixes)."),
    def("ddshard_transport_bytes_received_total", C, "node", "Bytes of the frames read from node-to-node connections."),
    def("ddshard_transport_connections_rejected_total", C, "node", "Connections refused: failed handshake or authentication, not a member, over the limit."),
    def("ddshard_gossip_datagrams_rejected_total", C, "node,reason", "Gossip datagrams dropped (reason: unauthenticated, malformed, oversized, stale, replayed, unstamped)."),
    def("ddshard_downs_published_total", C, "node", "Members this node downed: its split-brain resolver's decisions and operators' downs."),
    def("ddshard_discovery_lookups_failed_total", C, "node", "Discovery lookups (seeds, DNS SRV, custom sources) that failed or timed out; the nodes found before are still contacted."),
    def("ddshard_discovery_contact_points", G, "node", "Nodes the last successful discovery lookup found (own address and duplicates left out, at most discovery.max_contact_points)."),
    def("ddshard_discovery_addresses_dropped_total", C, "node", "Discovered addresses left out past discovery.max_contact_points."),
    def("ddshard_heartbeat_verdict_changes_total", C, "node", "Reachability verdicts of the message-path failure detector that changed."),
    def("ddshard_members", G, "node,status", "Members this node sees, by status."),
    def("ddshard_unreachable_members", G, "node", "Members this node sees as unreachable."),
    def("ddshard_replicator_full_values_sent_total", C, "node", "Full replicated values sent to peers."),
    def("ddshard_replicator_deltas_sent_total", C, "node", "Deltas sent to peers."),
    def("ddshard_replicator_values_merged_total", C, "node", "Full values merged from peers."),
    def("ddshard_replicator_deltas_merged_total", C, "node", "Deltas merged from peers."),
    def("ddshard_replicator_updates_total", C, "node,consistency,outcome", "Updates asked of the replicator (consistency: local, majority, all, all_reachable; outcome: ok, timeout, not_enough_replicas, fenced, error)."),
    def("ddshard_replicator_rejected_total", C, "node", "Replicator messages or values refused as invalid."),
    def("ddshard_replicator_quarantined_total", C, "node", "Replicator messages dropped because their sender was downed, removed or replaced by a newer incarnation."),
    def("ddshard_replicator_fenced_writes_total", C, "node", "Writes refused because a newer claim fenced them."),
    def("ddshard_replicator_roster_holders", G, "node", "Replica holders durable quorums are counted over (the roster: members and absent holders not forgotten)."),
    def("ddshard_replicator_roster_absent", G, "node", "Roster holders that are not members now; at half of the roster or more, durable writes and shard starts wait."),
    def("ddshard_lmdb_commits_total", C, "node", "LMDB commits of replicated data."),
    def("ddshard_lmdb_commit_failures_total", C, "node", "LMDB commits that failed."),
    def("ddshard_lmdb_commit_seconds", H, "node", "Time of one LMDB commit (writes and fsync)."),
    def("ddshard_lmdb_healthy", G, "node", "1 while the durable store commits; 0 after a commit failed for good, until one succeeds (the node is not ready meanwhile)."),
    def("ddshard_lmdb_map_used_bytes", G, "node", "Bytes of the LMDB map in use (its highest page written; freed pages below it are reused)."),
    def("ddshard_lmdb_map_max_bytes", G, "node", "Most bytes the LMDB map may grow to (replicator.lmdb_max_map_size)."),
    def("ddshard_region_registered", G, "node,type", "1 once the region is registered with its coordinator."),
    def("ddshard_region_hosted_shards", G, "node,type", "Shards this region hosts."),
    def("ddshard_region_entities", G, "node,type", "Entities running in this region."),
    def("ddshard_remembered_entities", G, "node,type", "With remember-entities: the ids this region's shards remember (running or not)."),
    def("ddshard_shard_home_seconds", H, "node,type", "Time from asking the coordinator for a shard's home to learning it."),
    def("ddshard_shard_load_timeouts_total", C, "node,type", "Tries of a shard's load (remembered ids, state claim) that timed out."),
    def("ddshard_stop_hook_overruns_total", C, "node,type", "Entity stop hooks dropped at their bound (the stop went on)."),
    def("ddshard_shard_home_requests_total", C, "node,type", "Requests for a shard's home sent to the coordinator (retries included)."),
    def("ddshard_region_buffered_messages", G, "node,type", "Messages waiting for a shard's home."),
    def("ddshard_region_messages_total", C, "node,type,path", "Messages from this node's handle by path (local_routed, remote_sent_direct) and from other nodes put straight into a mailbox (remote_direct)."),
    def("ddshard_slot_bytes_high_water", G, "node,type", "The largest replicated slot (remembered ids or entity states) this region wrote since it started, in bytes; starts that would grow a slot past ddshard_slot_budget_bytes are refused (SlotFull)."),
    def("ddshard_slot_budget_bytes", G, "node,type", "The byte budget of one replicated slot (one replicator message)."),
    def("ddshard_region_dropped_total", C, "node,type,reason", "Messages dropped (reason: buffer_full, handoff, invalid, mailbox_full, refused, remembered_limit, slot_full)."),
    def("ddshard_entity_starts_total", C, "node,type", "Entity incarnations started (first messages, restarts, remembered entities)."),
    def("ddshard_entity_stops_total", C, "node,type,reason", "Entities stopped (reason: passivated, idle, limit, handoff)."),
    def("ddshard_entity_handle_seconds", H, "node,type", "Time of one entity handler call (its message's processing, awaits included)."),
    def("ddshard_entity_panics_total", C, "node,type", "Entity handlers that panicked."),
    def("ddshard_deliveries_total", C, "node,type,outcome", "Reliable deliveries that reached this region's entities (outcome: handled, the next message of its stream, taken to be handled; duplicate, confirmed without handling; sent_back, past the next number expected, of a stream the entity's incarnation was not introduced to, or behind a held message; held, handled with its confirmation held back by `confirm_later`)."),
    def("ddshard_producer_messages_total", C, "node,type,producer,event", "Messages of a reliable-delivery producer on this node (event: stored, confirmed, resent, dead_lettered)."),
    def("ddshard_producer_demand_waits_total", C, "node,type,producer", "Sends of a producer that waited for room (its window per entity or its entity limit)."),
    def("ddshard_producer_unconfirmed", G, "node,type,producer", "Messages a producer stored and has not had confirmed."),
    def("ddshard_producer_queued_bytes", G, "node,type,producer", "The encoded bytes of those messages (bounded by its max_queued_bytes)."),
    def("ddshard_producer_oldest_unconfirmed_seconds", G, "node,type,producer", "How long the oldest of those messages has waited (0: none)."),
    def("ddshard_shard_failures_total", C, "node,type", "Shards stopped because their remembered set or state could not be loaded or written."),
    def("ddshard_handoffs_started_total", C, "node,type", "Hand-offs of a local shard the coordinator started."),
    def("ddshard_handoffs_completed_total", C, "node,type", "Of those, the shards whose entities all stopped."),
    def("ddshard_handoff_seconds", H, "node,type", "Time from a local shard's hand-off to all its entities stopped."),
    def("ddshard_remember_batches_total", C, "node,type", "Remembered-entity batches written (one majority update each)."),
    def("ddshard_remember_ids_written_total", C, "node,type", "Entity starts and stops those batches recorded."),
    def("ddshard_remember_batch_size", H, "node,type", "Entity starts and stops per remember batch."),
    def("ddshard_remember_write_seconds", H, "node,type", "Time of one remember batch's majority round, retries included."),
    def("ddshard_ask_seconds", H, "node,type,outcome", "Time from ask to answer (outcome: ok, timeout, error)."),
    def("ddshard_coordinator_active", G, "node,type", "1 while this node runs the type's coordinator."),
    def("ddshard_coordinator_shards_rebalanced_total", C, "node,type", "Hand-offs started by rebalance rounds since this node's coordinator took over."),
    def("ddshard_coordinator_state_write_seconds", H, "node,type", "Time of one acknowledged coordinator state write (majority), retries included."),
    def("ddshard_coordinator_state_write_failures_total", C, "node,type", "Coordinator state write attempts that failed (each is retried)."),
    def("ddshard_admin_connections", G, "node", "Connections open on the admin listener (`ddshard::admin::serve`)."),
    def("ddshard_admin_connections_closed_total", C, "node,reason", "Admin connections the listener closed at its cap (reason: evicted, the oldest with no request in flight; refused, every one serving a request)."),
    def("ddshard_admin_requests_refused_total", C, "node,reason", "Admin requests refused before any route (reason: host, a Host that is neither an IP address, localhost nor an allowed name)."),
];

/// How often the sampler copies the crate's counters into the facade.
#[cfg(feature = "metrics")]
pub(crate) const SAMPLE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(not(feature = "metrics"))]
pub(crate) use disabled::*;
#[cfg(feature = "metrics")]
pub use enabled::*;

#[cfg(feature = "metrics")]
mod enabled {

    use ::metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
    #[cfg(feature = "prometheus")]
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

    use super::{CATALOG, MetricKind};
    use crate::clock::Instant;
    use crate::error::{Error, Result};

    /// Latency buckets (seconds): 50 µs to 10 s.
    #[cfg(feature = "prometheus")]
    const SECONDS_BUCKETS: &[f64] = &[
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];

    /// Size buckets (counts of items).
    #[cfg(feature = "prometheus")]
    const SIZE_BUCKETS: &[f64] =
        &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0];

    /// Installs a Prometheus recorder as the process's `metrics` recorder (once per process;
    /// a second call fails) with histogram buckets for every `_seconds` and `_size` metric, and describes
    /// every metric of the catalog. Render with [`PrometheusHandle::render`] after
    /// [`crate::Node::sample_metrics`]. Feature `prometheus`.
    #[cfg(feature = "prometheus")]
    pub fn install_prometheus() -> Result<PrometheusHandle> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_size".into()), SIZE_BUCKETS))
            .map_err(|e| Error::Metrics(format!("histogram buckets: {e}")))?
            .install_recorder()
            .map_err(|e| Error::Metrics(format!("installing the recorder: {e}")))?;
        describe();
        Ok(handle)
    }

    /// Describes every metric of the catalog to the installed recorder (its `# HELP` lines).
    pub fn describe() {
        for m in CATALOG {
            match m.kind {
                MetricKind::Counter => ::metrics::describe_counter!(m.name, m.help),
                MetricKind::Gauge => ::metrics::describe_gauge!(m.name, m.help),
                MetricKind::Histogram => ::metrics::describe_histogram!(m.name, m.help),
            }
        }
    }

    /// The metrics of one entity type on one node, resolved once (no label lookups per event).
    pub(crate) struct TypeMetrics {
        ask_ok: Histogram,
        ask_timeout: Histogram,
        ask_error: Histogram,
        coordinator_active: Gauge,
        state_write: Histogram,
        state_write_failures: Counter,
        handoff: Histogram,
        shards_rebalanced: Counter,
        handle: Histogram,
        shard_home: Histogram,
        remember_batch: Histogram,
        remember_write: Histogram,
    }

    impl TypeMetrics {
        pub(crate) fn new(node: &str, type_name: &str) -> Self {
            // The handler timer's clock calibrates at its first reading (about 1 ms here): at
            // the region's start, not in its first handler.
            let _ = quanta::Instant::now();
            let (n, t) = (node.to_string(), type_name.to_string());
            let ask = |outcome: &'static str| histogram!("ddshard_ask_seconds", "node" => n.clone(), "type" => t.clone(), "outcome" => outcome);
            TypeMetrics {
                ask_ok: ask("ok"),
                ask_timeout: ask("timeout"),
                ask_error: ask("error"),
                coordinator_active: gauge!("ddshard_coordinator_active", "node" => n.clone(), "type" => t.clone()),
                state_write: histogram!("ddshard_coordinator_state_write_seconds", "node" => n.clone(), "type" => t.clone()),
                state_write_failures: counter!("ddshard_coordinator_state_write_failures_total", "node" => n.clone(), "type" => t.clone()),
                handoff: histogram!("ddshard_handoff_seconds", "node" => n.clone(), "type" => t.clone()),
                handle: histogram!("ddshard_entity_handle_seconds", "node" => n.clone(), "type" => t.clone()),
                shard_home: histogram!("ddshard_shard_home_seconds", "node" => n.clone(), "type" => t.clone()),
                remember_batch: histogram!("ddshard_remember_batch_size", "node" => n.clone(), "type" => t.clone()),
                remember_write: histogram!("ddshard_remember_write_seconds", "node" => n.clone(), "type" => t.clone()),
                shards_rebalanced: counter!("ddshard_coordinator_shards_rebalanced_total", "node" => n, "type" => t),
            }
        }

        /// An ask ended: `Ok`, a timeout or another error.
        pub(crate) fn ask_done<T>(&self, started: Option<Instant>, result: &Result<T>) {
            let Some(started) = started else { return };
            let h = match result {
                Ok(_) => &self.ask_ok,
                Err(Error::AskTimeout { .. }) => &self.ask_timeout,
                Err(_) => &self.ask_error,
            };
            h.record(started.elapsed().as_secs_f64());
        }

        pub(crate) fn coordinator_active(&self, active: bool) {
            self.coordinator_active.set(if active { 1.0 } else { 0.0 });
        }

        pub(crate) fn state_written(&self, started: Instant) {
            self.state_write.record(started.elapsed().as_secs_f64());
        }

        pub(crate) fn state_write_failed(&self) {
            self.state_write_failures.increment(1);
        }

        /// A local shard's hand-off (from the first HandOff to all its entities stopped) ended.
        pub(crate) fn handoff_done(&self, started: Instant) {
            self.handoff.record(started.elapsed().as_secs_f64());
        }

        /// The coordinator's count of shards moved by rebalance rounds since it took over.
        pub(crate) fn shards_rebalanced(&self, total: u64) {
            self.shards_rebalanced.absolute(total);
        }

        /// An entity's handler returned (or panicked).
        #[inline]
        pub(crate) fn handled(&self, started: Option<HandlerStart>) {
            if let Some(started) = started {
                self.handle.record(started.elapsed().as_secs_f64());
            }
        }

        /// A shard's home arrived, asked for at `asked`.
        pub(crate) fn shard_home_learnt(&self, asked: Instant) {
            self.shard_home.record(asked.elapsed().as_secs_f64());
        }

        /// A remember batch of `ids` starts and stops was written (or given up), started at
        /// `started`.
        pub(crate) fn remember_batch_written(&self, ids: usize, started: Instant) {
            self.remember_batch.record(ids as f64);
            self.remember_write.record(started.elapsed().as_secs_f64());
        }
    }

    /// When a timed event starts (the feature is on: always).
    pub(crate) fn start_timer() -> Option<Instant> {
        Some(crate::clock::now())
    }

    /// When a handler started: by the CPU's time-stamp counter where it is invariant, else by
    /// the system clock (`quanta`). The reading only times the handler, never a deadline, so it
    /// need not be the runtime's clock; and every message takes two, which cost about 9 ns each
    /// this way against 20 ns or more through the system clock on the VMs measured.
    pub(crate) type HandlerStart = quanta::Instant;

    /// When a handler starts ([`HandlerStart`]).
    pub(crate) fn start_handler_timer() -> Option<HandlerStart> {
        Some(quanta::Instant::now())
    }

    /// Times LMDB commits of one node.
    pub(crate) struct CommitTimer(Histogram);

    impl CommitTimer {
        pub(crate) fn new(node: &str) -> Self {
            CommitTimer(histogram!("ddshard_lmdb_commit_seconds", "node" => node.to_string()))
        }
        pub(crate) fn record(&self, took: std::time::Duration) {
            self.0.record(took.as_secs_f64());
        }
    }

    pub(crate) fn set_counter(name: &'static str, labels: &[(&'static str, String)], value: u64) {
        counter!(name, labels).absolute(value);
    }

    /// One counter per value of label `key`, each with `labels` too.
    pub(crate) fn set_counters_by(
        name: &'static str,
        labels: &[(&'static str, String)],
        key: &'static str,
        values: &[(&'static str, u64)],
    ) {
        for (label, value) in values {
            let mut l = labels.to_vec();
            l.push((key, (*label).into()));
            set_counter(name, &l, *value);
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod disabled {
    use crate::clock::Instant;
    use crate::error::Result;

    /// Without the feature: nothing is recorded and nothing is allocated.
    pub(crate) struct TypeMetrics;

    impl TypeMetrics {
        pub(crate) fn new(_node: &str, _type_name: &str) -> Self {
            TypeMetrics
        }
        #[inline]
        pub(crate) fn ask_done<T>(&self, _started: Option<Instant>, _result: &Result<T>) {}
        #[inline]
        pub(crate) fn coordinator_active(&self, _active: bool) {}
        #[inline]
        pub(crate) fn state_written(&self, _started: Instant) {}
        #[inline]
        pub(crate) fn state_write_failed(&self) {}
        #[inline]
        pub(crate) fn handoff_done(&self, _started: Instant) {}
        #[inline]
        pub(crate) fn shards_rebalanced(&self, _total: u64) {}
        #[inline]
        pub(crate) fn handled(&self, _started: Option<HandlerStart>) {}
        #[inline]
        pub(crate) fn shard_home_learnt(&self, _asked: Instant) {}
        #[inline]
        pub(crate) fn remember_batch_written(&self, _ids: usize, _started: Instant) {}
    }

    /// Without the feature LMDB commits are not timed.
    pub(crate) struct CommitTimer;

    impl CommitTimer {
        pub(crate) fn new(_node: &str) -> Self {
            CommitTimer
        }
        #[inline]
        pub(crate) fn record(&self, _took: std::time::Duration) {}
    }

    /// Without the feature no event is timed.
    #[inline]
    pub(crate) fn start_timer() -> Option<Instant> {
        None
    }

    /// Without the feature no handler is timed.
    pub(crate) type HandlerStart = ();

    /// Without the feature no handler is timed.
    #[inline]
    pub(crate) fn start_handler_timer() -> Option<HandlerStart> {
        None
    }
}
