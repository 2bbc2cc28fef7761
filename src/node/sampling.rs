//! The node's own counters and state (transport, gossip, membership, replicator, LMDB, admin
//! listener) copied into the `metrics` facade; what is attached to the node samples itself.

use std::sync::atomic::Ordering;

use ::metrics::{counter, gauge};

use super::Node;
use crate::membership::MemberStatus;
use crate::metrics::{set_counter, set_counters_by};

/// Copies the node's own counters and state into the facade.
pub(super) async fn sample(node: &Node) {
    let n = vec![("node", node.node_id().to_string())];
    sample_links(node, &n);
    sample_members(node, &n);
    sample_replicator(node, &n);
    sample_admin(node, &n);
}

/// The transport, gossip socket, heartbeats and discovery.
fn sample_links(node: &Node, n: &[(&'static str, String)]) {
    let ts = node.transport().stats();
    set_counter("ddshard_transport_frames_sent_total", n, ts.frames_sent);
    set_counter("ddshard_transport_frames_received_total", n, ts.frames_received);
    set_counter("ddshard_transport_frames_dropped_total", n, ts.frames_dropped);
    set_counter("ddshard_transport_connections_rejected_total", n, ts.connections_rejected);
    set_counter("ddshard_transport_bytes_sent_total", n, ts.bytes_sent);
    set_counter("ddshard_transport_bytes_received_total", n, ts.bytes_received);
    let gs = node.gossip_stats();
    set_counter("ddshard_downs_published_total", n, gs.downs_published);
    set_counters_by(
        "ddshard_gossip_datagrams_rejected_total",
        n,
        "reason",
        &[
            ("unauthenticated", gs.datagrams_unauthenticated),
            ("malformed", gs.datagrams_malformed),
            ("oversized", gs.datagrams_oversized),
            ("stale", gs.datagrams_stale),
            ("replayed", gs.datagrams_replayed),
            ("unstamped", gs.datagrams_unstamped),
        ],
    );
    set_counter("ddshard_heartbeat_verdict_changes_total", n, node.failure_detector_stats().verdict_changes);
    set_counter("ddshard_discovery_lookups_failed_total", n, gs.discovery_lookups_failed);
    set_counter("ddshard_discovery_addresses_dropped_total", n, gs.discovery_addresses_dropped);
    gauge!("ddshard_discovery_contact_points", n).set(gs.discovery_contact_points as f64);
}

/// Members by status, and how many are unreachable.
fn sample_members(node: &Node, n: &[(&'static str, String)]) {
    let snap = node.membership();
    for status in [
        MemberStatus::Joining,
        MemberStatus::Up,
        MemberStatus::Leaving,
        MemberStatus::Exiting,
        MemberStatus::Removed,
        MemberStatus::Down,
    ] {
        let mut l = n.to_vec();
        l.push(("status", status.as_key().into()));
        let count = snap.members.iter().filter(|m| m.status() == status).count();
        gauge!("ddshard_members", &l).set(count as f64);
    }
    let unreachable = snap.members.iter().filter(|m| !m.is_reachable()).count();
    gauge!("ddshard_unreachable_members", n).set(unreachable as f64);
}

/// The replicator and its LMDB store.
fn sample_replicator(node: &Node, n: &[(&'static str, String)]) {
    let rs = node.replicator().stats();
    set_counter("ddshard_replicator_full_values_sent_total", n, rs.full_values_sent);
    set_counter("ddshard_replicator_deltas_sent_total", n, rs.deltas_sent);
    set_counter("ddshard_replicator_values_merged_total", n, rs.values_merged);
    set_counter("ddshard_replicator_deltas_merged_total", n, rs.deltas_merged);
    set_counter("ddshard_replicator_rejected_total", n, rs.rejected);
    set_counter("ddshard_replicator_quarantined_total", n, rs.quarantined);
    set_counter("ddshard_replicator_fenced_writes_total", n, rs.fenced_writes);
    gauge!("ddshard_replicator_roster_holders", n).set(rs.roster_holders as f64);
    gauge!("ddshard_replicator_roster_absent", n).set(rs.roster_absent as f64);
    for consistency in crate::ddata::stats::UPDATE_CONSISTENCIES {
        for outcome in crate::ddata::stats::UPDATE_OUTCOMES {
            let mut l = n.to_vec();
            l.push(("consistency", consistency.into()));
            l.push(("outcome", outcome.into()));
            counter!("ddshard_replicator_updates_total", &l).absolute(rs.updates(consistency, outcome));
        }
    }
    set_counter("ddshard_lmdb_commits_total", n, rs.durable_commits);
    set_counter("ddshard_lmdb_commit_failures_total", n, rs.durable_failures);
    let healthy = node.replicator().durable_health().is_healthy();
    gauge!("ddshard_lmdb_healthy", n).set(if healthy { 1.0 } else { 0.0 });
    gauge!("ddshard_lmdb_map_used_bytes", n).set(rs.durable_map_used_bytes as f64);
    gauge!("ddshard_lmdb_map_max_bytes", n).set(rs.durable_map_max_bytes as f64);
}

/// The admin listener.
fn sample_admin(node: &Node, n: &[(&'static str, String)]) {
    let admin = node.admin_stats();
    gauge!("ddshard_admin_connections", n).set(admin.connections.load(Ordering::Relaxed) as f64);
    set_counters_by(
        "ddshard_admin_connections_closed_total",
        n,
        "reason",
        &[
            ("evicted", admin.connections_evicted.load(Ordering::Relaxed)),
            ("refused", admin.connections_refused.load(Ordering::Relaxed)),
        ],
    );
    set_counters_by(
        "ddshard_admin_requests_refused_total",
        n,
        "reason",
        &[("host", admin.requests_refused_host.load(Ordering::Relaxed))],
    );
}
