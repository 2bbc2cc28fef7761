//! The heartbeat task: runs the [`HeartbeatCore`] over the transport, so reachability is
//! judged on the connections entities' messages take, and publishes this node's verdicts in
//! gossip (the reachability table, merged by every node's membership view).
//!
//! It only selects, performs and feeds back: which members to watch (the ring), when to ask,
//! which answers count and what the verdicts are all live in the core. Requests go out over this
//! node's connection to the peer and answers come back over the peer's connection to this one,
//! so a cut in either direction silences the heartbeat.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::membership::failure_detector::{HeartbeatAction, HeartbeatCore, HeartbeatInput};
use crate::membership::{FailureDetectorSettings, MembershipHandle, MembershipSnapshot, PeerAddr, UniqueAddress};
use crate::transport::{Transport, wire};

/// The transport topic heartbeats travel on.
pub(crate) const TOPIC: &str = "heartbeat";

/// Inbound heartbeat frames held before the connection's reader waits (they are handled at
/// once; a full queue means this node is too busy to answer, which is what they measure).
const INBOUND_CAPACITY: usize = 1024;

/// One heartbeat frame (a few bytes of rmp).
#[derive(Debug, Serialize, Deserialize)]
enum HeartbeatFrame {
    /// "Are you there?" with the observer's sequence number.
    Request { seq: u64 },
    /// The answer to request `seq`.
    Response { seq: u64 },
}

/// Counters of the message-path failure detector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailureDetectorStats {
    /// Heartbeat requests sent to observed members.
    pub requests_sent: u64,
    /// Requests from observers answered.
    pub requests_answered: u64,
    /// Responses received (the core ignores stale, duplicate and unsolicited ones).
    pub responses_received: u64,
    /// Responses ignored: not the answer to the latest request to that member.
    pub responses_ignored: u64,
    /// Heartbeat frames that did not decode.
    pub malformed: u64,
    /// Heartbeats that could not be queued (peer unavailable, queue full).
    pub send_failures: u64,
    /// Times this node's published verdicts changed.
    pub verdict_changes: u64,
}

/// The live cells behind [`FailureDetectorStats`], one per field (the snapshot names every cell, so the
/// two cannot drift apart).
#[derive(Debug, Default)]
pub(crate) struct FailureDetectorStatCells {
    pub(crate) requests_sent: AtomicU64,
    pub(crate) requests_answered: AtomicU64,
    pub(crate) responses_received: AtomicU64,
    pub(crate) responses_ignored: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) send_failures: AtomicU64,
    pub(crate) verdict_changes: AtomicU64,
}

impl FailureDetectorStatCells {
    /// The counters as of now (each read on its own: a snapshot, not one instant).
    pub(crate) fn snapshot(&self) -> FailureDetectorStats {
        FailureDetectorStats {
            requests_sent: self.requests_sent.load(Ordering::Relaxed),
            requests_answered: self.requests_answered.load(Ordering::Relaxed),
            responses_received: self.responses_received.load(Ordering::Relaxed),
            responses_ignored: self.responses_ignored.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            send_failures: self.send_failures.load(Ordering::Relaxed),
            verdict_changes: self.verdict_changes.load(Ordering::Relaxed),
        }
    }
}

/// Runs until `shutdown`.
pub(crate) async fn run_heartbeats(
    transport: Transport,
    membership: MembershipHandle,
    settings: FailureDetectorSettings,
    stats: Arc<FailureDetectorStatCells>,
    shutdown: CancellationToken,
) {
    let mut inbound = transport.subscribe(TOPIC, INBOUND_CAPACITY);
    let mut members = membership.watch();
    let me = transport.local().address.clone();
    // Judging more often than asking keeps detection latency near the formula's.
    let mut tick = tokio::time::interval((settings.heartbeat_interval / 5).max(std::time::Duration::from_millis(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut core = HeartbeatCore::new(me.clone(), settings);
    let mut peers: HashMap<UniqueAddress, PeerAddr> = HashMap::new();
    let mut published: Vec<UniqueAddress> = Vec::new();
    let mut out = Vec::new();
    let on_members = |snap: &MembershipSnapshot, peers: &mut HashMap<UniqueAddress, PeerAddr>| {
        peers.clear();
        peers.extend(snap.members.iter().filter(|m| m.status().is_routable()).map(|m| (m.address().clone(), m.peer())));
        peers.keys().cloned().chain(std::iter::once(me.clone())).collect::<BTreeSet<_>>()
    };
    let initial = on_members(&members.borrow_and_update(), &mut peers);
    core.handle(HeartbeatInput::Members(initial), crate::clock::now(), &mut out);
    loop {
        let mut reply_to = None;
        perform(&transport, &stats, &peers, &mut out, &mut reply_to);
        let verdicts: Vec<UniqueAddress> = core.unreachable().cloned().collect();
        if verdicts != published {
            info!(node = %me, unreachable = ?verdicts.iter().map(ToString::to_string).collect::<Vec<_>>(), "heartbeats: verdicts changed");
            stats.verdict_changes.fetch_add(1, Ordering::Relaxed);
            if membership.publish_unreachable(verdicts.clone()).is_err() {
                return;
            }
            published = verdicts;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => core.handle(HeartbeatInput::Tick, crate::clock::now(), &mut out),
            changed = members.changed() => {
                if changed.is_err() {
                    return;
                }
                let snap: Arc<MembershipSnapshot> = members.borrow_and_update().clone();
                let ring = on_members(&snap, &mut peers);
                core.handle(HeartbeatInput::Members(ring), crate::clock::now(), &mut out);
            }
            msg = inbound.recv() => {
                let Some(msg) = msg else { return };
                let from = msg.from.address.clone();
                match wire::decode::<HeartbeatFrame>(&msg.body) {
                    Ok(HeartbeatFrame::Request { seq }) => {
                        reply_to = Some(msg.from);
                        core.handle(HeartbeatInput::Request { from, seq }, crate::clock::now(), &mut out);
                        perform(&transport, &stats, &peers, &mut out, &mut reply_to);
                    }
                    Ok(HeartbeatFrame::Response { seq }) => {
                        stats.responses_received.fetch_add(1, Ordering::Relaxed);
                        let ignored = core.ignored;
                        core.handle(HeartbeatInput::Response { from, seq }, crate::clock::now(), &mut out);
                        if core.ignored != ignored {
                            stats.responses_ignored.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(e) => {
                        stats.malformed.fetch_add(1, Ordering::Relaxed);
                        debug!(peer = %from, error = %e, "malformed heartbeat frame dropped");
                    }
                }
            }
        }
    }
}

/// Sends what the core asked for. A response goes to the address the request came from (the
/// requester may not be in this node's view yet).
fn perform(
    transport: &Transport,
    stats: &FailureDetectorStatCells,
    peers: &HashMap<UniqueAddress, PeerAddr>,
    out: &mut Vec<HeartbeatAction>,
    reply_to: &mut Option<PeerAddr>,
) {
    for action in out.drain(..) {
        let (to, frame, counter) = match action {
            HeartbeatAction::SendRequest { to, seq } => {
                let Some(peer) = peers.get(&to) else { continue };
                (peer.clone(), HeartbeatFrame::Request { seq }, &stats.requests_sent)
            }
            HeartbeatAction::SendResponse { to, seq } => {
                let Some(peer) = reply_to.take().filter(|p| p.address == to).or_else(|| peers.get(&to).cloned()) else {
                    continue;
                };
                (peer, HeartbeatFrame::Response { seq }, &stats.requests_answered)
            }
            // Verdicts are read from the core as a whole after each step.
            HeartbeatAction::Verdict { .. } => continue,
        };
        let sent = wire::encode(&frame).and_then(|body| transport.send(&to, TOPIC, &body));
        match sent {
            Ok(()) => counter.fetch_add(1, Ordering::Relaxed),
            Err(_) => stats.send_failures.fetch_add(1, Ordering::Relaxed),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the snapshot reads its own cell (distinct values, so two crossed wires
    /// fail).
    #[test]
    fn a_failure_detector_stats_snapshot_reads_each_counter_from_its_own_cell() {
        use std::sync::atomic::Ordering;
        let cells = FailureDetectorStatCells::default();
        cells.requests_sent.store(1, Ordering::Relaxed);
        cells.requests_answered.store(2, Ordering::Relaxed);
        cells.responses_received.store(3, Ordering::Relaxed);
        cells.responses_ignored.store(4, Ordering::Relaxed);
        cells.malformed.store(5, Ordering::Relaxed);
        cells.send_failures.store(6, Ordering::Relaxed);
        cells.verdict_changes.store(7, Ordering::Relaxed);
        let snapshot = cells.snapshot();
        let expected = FailureDetectorStats {
            requests_sent: 1,
            requests_answered: 2,
            responses_received: 3,
            responses_ignored: 4,
            malformed: 5,
            send_failures: 6,
            verdict_changes: 7,
        };
        assert_eq!(snapshot, expected);
    }
}
