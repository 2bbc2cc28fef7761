//! A leaving node's hand-over: before it exits, it writes every value its replica holds to a
//! majority of the members that stay, so no write it acknowledged leaves with it (seed
//! 160000972: two of three nodes left one after the other, and ids only they held were gone).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::{Action, Input, ReplicatedData, ReplicatorCore, ReplicatorMsg, ReplicatorStats, split_by_bytes};
use crate::clock::Instant;
use crate::error::Error;
use crate::membership::{Member, MembershipSnapshot, UniqueAddress};
use crate::transport::PeerAddr;

/// A leaving node's hand-over in flight: the write of each part, and who acknowledged it.
pub(super) struct HandOver<R> {
    pub(super) parts: BTreeMap<u64, HashSet<UniqueAddress>>,
    addressed: Vec<UniqueAddress>,
    pub(super) needed: usize,
    pub(super) deadline: Instant,
    pub(super) reply: R,
    /// The last part, sent once every value is on a majority: this node's own forget in the
    /// roster (its copies are safe elsewhere, so durable quorums stop counting it).
    forget_sent: bool,
    /// Not started yet: the reachable staying members (`to`) and every staying member, until
    /// `to` is a majority of the staying roster.
    pub(super) waiting: Option<(Vec<PeerAddr>, Vec<UniqueAddress>)>,
}

impl<R> Input<R> {
    /// The hand-over of a leaving node's values to the members that stay: the Up
    /// members with `role` other than this node (Leaving ones leave too).
    pub(crate) fn hand_over_of(snap: &MembershipSnapshot, role: Option<&str>, timeout: Duration, reply: R) -> Self {
        let me = &snap.self_address;
        let staying: Vec<&Member> = snap
            .members
            .iter()
            .filter(|m| m.address() != me && m.has_role(role) && m.status().takes_new_shards())
            .collect();
        let to = staying.iter().filter(|m| m.is_reachable()).map(|m| m.peer()).collect();
        let staying = staying.iter().map(|m| m.address().clone()).collect();
        Input::HandOver { to, staying, timeout, reply }
    }
}

impl<R> ReplicatorCore<R> {
    /// Starts the hand-over: every value, in parts capped in bytes, each written to the
    /// reachable staying members (see [`Input::HandOver`]). A newer hand-over replaces one in
    /// flight (which fails as timed out). When the reachable staying members are no majority
    /// of the staying roster, it waits (until its deadline) for the roster to change: another
    /// leaving node's forget may still be on its way (seed 660002017: n3 forgot itself on n2
    /// only, and n1, leaving 20 ms later, still counted it).
    pub(super) fn on_hand_over(
        &mut self,
        to: Vec<PeerAddr>,
        staying: Vec<UniqueAddress>,
        timeout: Duration,
        reply: R,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        if let Some(old) = self.hand_over.take() {
            let result = Err(Error::ConsistencyTimeout { needed: old.needed, acked: 0 });
            out.push(Action::ReplyUpdate { reply: old.reply, result });
        }
        if staying.is_empty() || to.is_empty() {
            // Nobody stays, or nobody who does is reachable: waiting cannot help.
            let needed = self.roster_staying(&staying) / 2 + 1;
            let result = Err(Error::NotEnoughReplicas { needed, reachable: to.len() });
            out.push(Action::ReplyUpdate { reply, result });
            return;
        }
        let addressed = to.iter().map(|p| p.address.clone()).collect();
        let deadline = now + timeout;
        let waiting = Some((to, staying));
        let parts = BTreeMap::new();
        self.hand_over = Some(HandOver { parts, addressed, needed: 0, deadline, reply, forget_sent: false, waiting });
        self.start_hand_over_parts(out);
    }

    /// Sends the parts of a waiting hand-over once the reachable staying members are a
    /// majority of the staying roster: the members that stay and the absent holders (whose
    /// disks still count), never the other leaving members.
    pub(super) fn start_hand_over_parts(&mut self, out: &mut Vec<Action<R>>) {
        let Some((to, staying)) = self.hand_over.as_mut().and_then(|h| h.waiting.take()) else { return };
        let needed = self.roster_staying(&staying) / 2 + 1;
        if to.len() < needed {
            let h = self.hand_over.as_mut().expect("hand-over");
            (h.needed, h.waiting) = (needed, Some((to, staying)));
            return;
        }
        // Every value, durable or not: a majority write of either may have counted this node.
        let values: Vec<(String, ReplicatedData)> =
            self.data.iter().map(|(key, e)| (key.clone(), e.value.clone())).collect();
        let size = |(k, v): &(String, ReplicatedData)| k.len() + v.approx_bytes();
        let mut parts = BTreeMap::new();
        for values in split_by_bytes(values, self.settings.max_message_bytes, size) {
            let op = self.next_op();
            ReplicatorStats::add(&self.stats.full_values_sent, to.len() * values.len());
            parts.insert(op, HashSet::new());
            let msg = ReplicatorMsg::WriteDelta { op, entries: Vec::new(), values };
            out.push(Action::Broadcast { to: to.clone(), msg });
        }
        let h = self.hand_over.as_mut().expect("hand-over");
        (h.parts, h.needed) = (parts, needed);
        if h.parts.is_empty() {
            self.send_own_forget(out);
        }
    }

    /// Every value is on a majority of the staying roster: this node leaves the roster, in a
    /// last part written to the same majority (until it is, the hand-over is not done).
    fn send_own_forget(&mut self, out: &mut Vec<Action<R>>) {
        let me = self.self_addr.node_id.clone();
        self.forget(&me, out);
        let Some(value) = self.local_value(super::ROSTER_KEY).cloned() else { return };
        let op = self.next_op();
        let Some(h) = self.hand_over.as_mut() else { return };
        h.forget_sent = true;
        h.parts.insert(op, HashSet::new());
        let to =
            self.replicas.iter().filter(|(p, _)| h.addressed.contains(&p.address)).map(|(p, _)| p.clone()).collect();
        let values = vec![(super::ROSTER_KEY.to_string(), value)];
        out.push(Action::Broadcast { to, msg: ReplicatorMsg::WriteDelta { op, entries: Vec::new(), values } });
        // Other leaving nodes count this one until they hear of its forget: it ships to every
        // gossip target now, not on the next interval this node may not live to see.
        self.flush_deltas(out);
    }

    pub(super) fn on_hand_over_ack(&mut self, op: u64, from: UniqueAddress, out: &mut Vec<Action<R>>) {
        let Some(h) = self.hand_over.as_mut() else { return };
        if !h.addressed.contains(&from) {
            ReplicatorStats::inc(&self.stats.rejected);
            return;
        }
        if let Some(acked) = h.parts.get_mut(&op) {
            acked.insert(from);
        }
        if !h.parts.values().all(|acked| acked.len() >= h.needed) {
            return;
        }
        if !h.forget_sent {
            self.send_own_forget(out);
            return;
        }
        let h = self.hand_over.take().expect("hand-over");
        out.push(Action::ReplyUpdate { reply: h.reply, result: Ok(Vec::new()) });
    }
}
