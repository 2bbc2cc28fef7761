//! Which peers' messages the replicator drops: an incarnation that left good standing in this
//! node's view (downed, removed) is quarantined for good, as the transport refuses it once it
//! is removed; an incarnation older than one of the same node in good standing is refused too
//! (the transport's rule, [`crate::membership::MembershipSnapshot::standing_of`]). A replica
//! that acknowledged a downed member's write could give it a majority its successor's claim
//! never reads (the simulation's seed 11001335: a paused home woke up on the side of a
//! partition whose members had downed it, and they acknowledged its writes).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tracing::warn;

use super::{ReplicatorCore, ReplicatorInput, ReplicatorStatCells};
use crate::membership::{Member, MembershipSnapshot, PeerStanding, UniqueAddress};

/// The incarnations in good standing in the latest view, and those that left it.
#[derive(Debug, Default)]
pub(super) struct Standing {
    /// Incarnations in good standing in the latest view.
    members: HashSet<UniqueAddress>,
    /// Per node id, its newest incarnation in good standing: an older one is refused. Derived
    /// from `members` when a view arrives, so a message costs one lookup.
    newest: HashMap<Arc<str>, u64>,
    /// Incarnations that were in good standing here and no longer are, with the messages
    /// dropped from each (the log warns at the 1st, 2nd, 4th, 8th, …). An entry is forgotten
    /// once a newer incarnation of its node stands (`newest` refuses it then), so the map
    /// holds only nodes that ended for good.
    pub(super) departed: HashMap<UniqueAddress, u64>,
}

impl Standing {
    /// A new view's incarnations in good standing.
    pub(super) fn update(&mut self, members: Vec<UniqueAddress>) {
        let members: HashSet<UniqueAddress> = members.into_iter().collect();
        for gone in self.members.difference(&members) {
            self.departed.entry(gone.clone()).or_default();
        }
        self.newest.clear();
        for m in &members {
            let newest = self.newest.entry(m.node_id.clone()).or_insert(m.generation);
            *newest = (*newest).max(m.generation);
        }
        let newest = &self.newest;
        self.departed.retain(|d, _| newest.get(&d.node_id).is_none_or(|g| *g <= d.generation));
        self.members = members;
    }

    /// Whether messages from `peer` are dropped.
    pub(super) fn refuses(&self, peer: &UniqueAddress) -> bool {
        self.departed.contains_key(peer) || self.newest.get(&peer.node_id).is_some_and(|g| *g > peer.generation)
    }
}

impl<R> ReplicatorInput<R> {
    /// The membership input of a view, for the replicator of the members with `role`: the
    /// replica holders (Up or Leaving with the role, reachable or not), the gossip targets
    /// (reachable and routable with the role, joining ones included: they need the state
    /// before they turn Up), the incarnations in good standing, and the holders that leave.
    pub(crate) fn members_of(snap: &MembershipSnapshot, role: Option<&str>) -> Self {
        let me = &snap.self_address;
        let replicas =
            snap.up_members(role).filter(|m| m.address() != me).map(|m| (m.peer(), m.is_reachable())).collect();
        let gossip_targets = snap
            .members
            .iter()
            .filter(|m| m.address() != me && m.is_reachable() && m.has_role(role) && m.status().is_routable())
            .map(Member::peer)
            .collect();
        let standing = snap
            .members
            .iter()
            .filter(|m| snap.standing_of(m.address()) == PeerStanding::Member)
            .map(|m| m.address().clone())
            .collect();
        let holder = snap.up_members(role).any(|m| m.address() == me);
        let leaving = snap
            .up_members(role)
            .filter(|m| m.address() != me && !m.status().takes_new_shards())
            .map(|m| m.address().clone())
            .collect();
        ReplicatorInput::Members { replicas, gossip_targets, standing, holder, leaving }
    }
}

impl<R> ReplicatorCore<R> {
    /// Drops (counts, and now and then logs) a message from `peer` if it is refused; returns
    /// whether it was.
    pub(super) fn quarantines(&mut self, peer: &UniqueAddress) -> bool {
        if !self.standing.refuses(peer) {
            return false;
        }
        ReplicatorStatCells::inc(&self.stats.quarantined);
        let dropped = self.standing.departed.entry(peer.clone()).or_default();
        *dropped += 1;
        if dropped.is_power_of_two() {
            warn!(peer = %peer, dropped = *dropped, "messages from a downed or removed member dropped");
        }
        true
    }
}
