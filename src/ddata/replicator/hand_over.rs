//! A leaving node's hand-over: before it exits, it writes every value its replica holds to a
//! majority of the members that stay, so no write it acknowledged leaves with it (seed
//! 160000972: two of three nodes left one after the other, and ids only they held were gone).
//!
//! Who stays is read from the membership the core has now, not fixed when the leave began: a
//! member that turns Up (a restarted incarnation, a new node) is sent every part, one that
//! starts leaving too stops counting, and the majority is counted again over the staying
//! roster (seeds 720004905, 730021632, 770019193: a hand-over fixed to the members of its
//! start timed out while a restarted node could have taken it, and the leaver stayed in the
//! roster for good).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::{ReplicatorAction, ReplicatorCore, ReplicatorMsg, ReplicatorStatCells, split_by_bytes};
use crate::clock::Instant;
use crate::error::Error;
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;

/// A leaving node's hand-over in flight: the write of each part, and who acknowledged it.
pub(super) struct HandOver<R> {
    pub(super) parts: BTreeMap<u64, Part>,
    /// Every member a part was sent to (only their acknowledgements count).
    addressed: Vec<UniqueAddress>,
    pub(super) needed: usize,
    pub(super) deadline: Instant,
    pub(super) reply: R,
    /// The last part, sent once every value is on a majority: this node's own forget in the
    /// roster (its copies are safe elsewhere, so durable quorums stop counting it).
    forget_sent: bool,
    /// Not started yet: the reachable staying members are no majority of the staying roster.
    pub(super) waiting: bool,
}

/// One part of a hand-over: the keys it carries (their values are read again when the part
/// goes to a member that turned Up since) and the node ids that acknowledged it (by id, as
/// the roster counts: a restarted incarnation's ack and its predecessor's are one disk's).
pub(super) struct Part {
    keys: Vec<String>,
    pub(super) acked: HashSet<Arc<str>>,
}

impl<R> ReplicatorCore<R> {
    /// The members a hand-over goes to: the reachable replica holders that are not leaving
    /// too, and every staying holder, reachable or not.
    pub(super) fn hand_over_targets(&self) -> (Vec<PeerAddr>, Vec<UniqueAddress>) {
        let staying: Vec<&(PeerAddr, bool)> =
            self.replicas.iter().filter(|(p, _)| !self.leaving.contains(&p.address)).collect();
        let to = staying.iter().filter(|(_, reachable)| *reachable).map(|(p, _)| p.clone()).collect();
        (to, staying.iter().map(|(p, _)| p.address.clone()).collect())
    }

    /// The reachable staying members, whether any member stays at all, and how many
    /// acknowledgements a majority of the staying roster takes.
    fn hand_over_quorum(&mut self) -> (Vec<PeerAddr>, bool, usize) {
        let (to, staying) = self.hand_over_targets();
        let needed = self.roster_staying(&staying) / 2 + 1;
        (to, !staying.is_empty(), needed)
    }

    /// Starts the hand-over: every value, in parts capped in bytes, each written to the
    /// reachable staying members (see [`super::ReplicatorInput::HandOver`]). A newer hand-over replaces one in
    /// flight (which fails as timed out). When the reachable staying members are no majority
    /// of the staying roster, it waits (until its deadline) for the roster or the members to
    /// change: another leaving node's forget may still be on its way (seed 660002017: n3
    /// forgot itself on n2 only, and n1, leaving 20 ms later, still counted it), or a staying
    /// member may come back.
    pub(super) fn on_hand_over(
        &mut self,
        timeout: Duration,
        reply: R,
        now: Instant,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        if let Some(old) = self.hand_over.take() {
            let result = Err(Error::ConsistencyTimeout { needed: old.needed, acked: 0 });
            out.push(ReplicatorAction::ReplyUpdate { reply: old.reply, result });
        }
        let (_, anyone_stays, needed) = self.hand_over_quorum();
        if !anyone_stays {
            // Every other holder leaves too: nobody can take it.
            let result = Err(Error::NotEnoughReplicas { needed, reachable: 0 });
            out.push(ReplicatorAction::ReplyUpdate { reply, result });
            return;
        }
        let deadline = now + timeout;
        let (parts, addressed) = (BTreeMap::new(), Vec::new());
        self.hand_over =
            Some(HandOver { parts, addressed, needed: 0, deadline, reply, forget_sent: false, waiting: true });
        self.start_hand_over_parts(out);
    }

    /// Sends the parts of a waiting hand-over once the reachable staying members are a
    /// majority of the staying roster: the members that stay and the absent holders (whose
    /// disks still count), never the other leaving members.
    pub(super) fn start_hand_over_parts(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        if !self.hand_over.as_ref().is_some_and(|h| h.waiting) {
            return;
        }
        let (to, _, needed) = self.hand_over_quorum();
        let h = self.hand_over.as_mut().expect("hand-over");
        h.needed = needed;
        if to.len() < needed {
            return;
        }
        h.waiting = false;
        h.addressed = to.iter().map(|p| p.address.clone()).collect();
        // Every value, durable or not: a majority write of either may have counted this node.
        let values: Vec<(String, super::ReplicatedData)> =
            self.data.iter().map(|(key, e)| (key.clone(), e.value.clone())).collect();
        let size = |(k, v): &(String, super::ReplicatedData)| k.len() + v.approx_bytes();
        for values in split_by_bytes(values, self.settings.max_message_bytes, size) {
            let op = self.next_op();
            ReplicatorStatCells::add(&self.stats.full_values_sent, to.len() * values.len());
            let keys = values.iter().map(|(k, _)| k.clone()).collect();
            let h = self.hand_over.as_mut().expect("hand-over");
            h.parts.insert(op, Part { keys, acked: HashSet::new() });
            let msg = ReplicatorMsg::WriteDelta { op, entries: Vec::new(), values };
            out.push(ReplicatorAction::Broadcast { to: to.clone(), msg });
        }
        self.advance_hand_over(out);
    }

    /// After a membership change: a waiting hand-over is counted again; one under way sends
    /// every part to the staying members that became reachable since, and counts the majority
    /// over the staying roster of now. Acknowledgements already taken stand: the member's disk
    /// holds the values, and one that leaves since hands them over in turn.
    pub(super) fn retarget_hand_over(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let Some(h) = self.hand_over.as_ref() else { return };
        if h.waiting {
            self.start_hand_over_parts(out);
            return;
        }
        let (to, _, needed) = self.hand_over_quorum();
        let h = self.hand_over.as_mut().expect("hand-over");
        h.needed = needed;
        let new: Vec<PeerAddr> = to.into_iter().filter(|p| !h.addressed.contains(&p.address)).collect();
        if !new.is_empty() {
            h.addressed.extend(new.iter().map(|p| p.address.clone()));
            for (op, part) in &h.parts {
                let values: Vec<_> =
                    part.keys.iter().filter_map(|k| self.data.get(k).map(|e| (k.clone(), e.value.clone()))).collect();
                ReplicatorStatCells::add(&self.stats.full_values_sent, new.len() * values.len());
                let msg = ReplicatorMsg::WriteDelta { op: *op, entries: Vec::new(), values };
                out.push(ReplicatorAction::Broadcast { to: new.clone(), msg });
            }
        }
        self.advance_hand_over(out);
    }

    /// Every value is on a majority of the staying roster: this node leaves the roster, in a
    /// last part written to the same majority (until it is, the hand-over is not done).
    fn send_own_forget(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let me = self.self_addr.node_id.clone();
        self.forget(&me, out);
        let Some(value) = self.local_value(super::ROSTER_KEY).cloned() else { return };
        let op = self.next_op();
        let Some(h) = self.hand_over.as_mut() else { return };
        h.forget_sent = true;
        h.parts.insert(op, Part { keys: vec![super::ROSTER_KEY.to_string()], acked: HashSet::new() });
        let to =
            self.replicas.iter().filter(|(p, _)| h.addressed.contains(&p.address)).map(|(p, _)| p.clone()).collect();
        let values = vec![(super::ROSTER_KEY.to_string(), value)];
        out.push(ReplicatorAction::Broadcast {
            to,
            msg: ReplicatorMsg::WriteDelta { op, entries: Vec::new(), values },
        });
        // Other leaving nodes count this one until they hear of its forget: it ships to every
        // gossip target now, not on the next interval this node may not live to see.
        self.flush_deltas(out);
    }

    pub(super) fn on_hand_over_ack(&mut self, op: u64, from: UniqueAddress, out: &mut Vec<ReplicatorAction<R>>) {
        let Some(h) = self.hand_over.as_mut() else { return };
        if !h.addressed.contains(&from) {
            ReplicatorStatCells::inc(&self.stats.rejected);
            return;
        }
        if let Some(part) = h.parts.get_mut(&op) {
            part.acked.insert(from.node_id.clone());
        }
        self.advance_hand_over(out);
    }

    /// Once every part is on a majority: the forget goes out, and once that is too, the
    /// hand-over is done.
    fn advance_hand_over(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let Some(h) = self.hand_over.as_ref() else { return };
        if h.waiting || !h.parts.values().all(|part| part.acked.len() >= h.needed) {
            return;
        }
        if !h.forget_sent {
            self.send_own_forget(out);
            return;
        }
        let h = self.hand_over.take().expect("hand-over");
        out.push(ReplicatorAction::ReplyUpdate { reply: h.reply, result: Ok(Vec::new()) });
    }
}
