//! Keep-majority split-brain resolver as a pure decision function: when the set of unreachable
//! members has not changed for `stable_after`, the side with more members downs the other; on a
//! tie the side holding the lowest address wins. A node on the losing side downs itself.
//!
//! The two sides time their decisions differently on purpose. The winning side waits until its
//! unreachable set has been stable for `stable_after` (any change restarts the clock: that only
//! delays downing others, which is safe). The losing side downs itself once it has been losing
//! for `stable_after`, even if its unreachable set changed meanwhile (say a peer on its own side
//! crashed): restarting its clock there would let it outlive the moment the winners, who saw no
//! change, start its shards elsewhere. For the same reason a brief spell of not losing (one
//! heartbeat that got through a flapping link, seen by the loser only) does not restart the
//! clock: only `stable_after` without losing does.
//!
//! What remains is the assumption every keep-majority resolver makes: the two sides detect the
//! split within `down_removal_margin` of each other, so the losers are gone before the winners
//! move their shards. Keep the margin at least as long as the failure detector's spread.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::clock::Instant;

use super::{MembershipSnapshot, UniqueAddress};

/// What the resolver decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing (yet).
    Wait,
    /// This node is on the winning side: down these members.
    DownOthers(BTreeSet<UniqueAddress>),
    /// This node is on the losing side: it must stop and leave.
    DownMyself,
}

/// Keep-majority state: the unreachable set and since when it is stable.
#[derive(Debug)]
pub(crate) struct KeepMajority {
    stable_after: Duration,
    unreachable: BTreeSet<UniqueAddress>,
    stable_since: Instant,
    /// Since when this node has been on the losing side (without a break of `stable_after`).
    losing_since: Option<Instant>,
    /// Since when it has not been losing, while `losing_since` is still set.
    not_losing_since: Option<Instant>,
}

impl KeepMajority {
    pub(crate) fn new(stable_after: Duration, now: Instant) -> Self {
        KeepMajority {
            stable_after,
            unreachable: BTreeSet::new(),
            stable_since: now,
            losing_since: None,
            not_losing_since: None,
        }
    }

    /// Feeds the current view; returns the decision once the view is stable long enough.
    pub(crate) fn decide(&mut self, snap: &MembershipSnapshot, now: Instant) -> Decision {
        let counted: Vec<&super::Member> = snap.members.iter().filter(|m| m.status().counts_for_downing()).collect();
        let unreachable: BTreeSet<UniqueAddress> =
            counted.iter().filter(|m| !m.is_reachable()).map(|m| m.address().clone()).collect();
        if unreachable != self.unreachable {
            self.unreachable = unreachable;
            self.stable_since = now;
        }
        if self.unreachable.is_empty() {
            self.not_losing(now);
            return Decision::Wait;
        }
        let reachable = counted.len() - self.unreachable.len();
        let keep = match reachable.cmp(&self.unreachable.len()) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Equal => {
                let lowest = counted.iter().map(|m| m.address()).min();
                lowest.is_some_and(|l| !self.unreachable.contains(l))
            }
        };
        if keep {
            self.not_losing(now);
            if now.duration_since(self.stable_since) < self.stable_after {
                return Decision::Wait;
            }
            Decision::DownOthers(self.unreachable.clone())
        } else {
            self.not_losing_since = None;
            let since = *self.losing_since.get_or_insert(now);
            if now.duration_since(since) < self.stable_after {
                return Decision::Wait;
            }
            Decision::DownMyself
        }
    }

    fn not_losing(&mut self, now: Instant) {
        if self.losing_since.is_some() {
            let since = *self.not_losing_since.get_or_insert(now);
            if now.duration_since(since) >= self.stable_after {
                self.losing_since = None;
                self.not_losing_since = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::view::{GossipNode, compute_members};
    use std::collections::BTreeMap;

    fn snap(me: &str, members: &[(&str, bool)]) -> MembershipSnapshot {
        let nodes: Vec<GossipNode> = members
            .iter()
            .enumerate()
            .map(|(i, (id, live))| {
                let mut keys = BTreeMap::new();
                keys.insert("status".to_string(), "up".to_string());
                keys.insert("up".to_string(), (i + 1).to_string());
                keys.insert("msg".to_string(), "127.0.0.1:1".to_string());
                GossipNode {
                    address: UniqueAddress::new(*id, 1),
                    gossip_addr: "127.0.0.1:2".parse().unwrap(),
                    live: *live,
                    keys,
                }
            })
            .collect();
        compute_members(&UniqueAddress::new(me, 1), &nodes)
    }

    /// d's view of a 2|3 cut between {a, b, c} and {d, e}.
    fn cut_seen_by_d() -> MembershipSnapshot {
        snap("d", &[("a", false), ("b", false), ("c", false), ("d", true), ("e", true)])
    }

    /// d's view with every link up.
    fn healed_seen_by_d() -> MembershipSnapshot {
        snap("d", &[("a", true), ("b", true), ("c", true), ("d", true), ("e", true)])
    }

    #[test]
    fn majority_side_downs_the_unreachable_minority_after_stable_after() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let s = snap("a", &[("a", true), ("b", true), ("c", true), ("d", false), ("e", false)]);
        assert_eq!(k.decide(&s, t0), Decision::Wait);
        assert_eq!(k.decide(&s, t0 + Duration::from_secs(4)), Decision::Wait);
        let d = k.decide(&s, t0 + Duration::from_secs(5));
        assert_eq!(d, Decision::DownOthers([UniqueAddress::new("d", 1), UniqueAddress::new("e", 1)].into()));
    }

    #[test]
    fn minority_side_downs_itself() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let s = snap("d", &[("a", false), ("b", false), ("c", false), ("d", true), ("e", true)]);
        k.decide(&s, t0);
        assert_eq!(k.decide(&s, t0 + Duration::from_secs(6)), Decision::DownMyself);
    }

    #[test]
    fn a_change_in_the_unreachable_set_restarts_the_clock() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        k.decide(&snap("a", &[("a", true), ("b", true), ("c", false)]), t0);
        let later = snap("a", &[("a", true), ("b", false), ("c", false), ("d", true), ("e", true)]);
        assert_eq!(k.decide(&later, t0 + Duration::from_secs(4)), Decision::Wait);
        assert_eq!(k.decide(&later, t0 + Duration::from_secs(8)), Decision::Wait);
        assert!(matches!(k.decide(&later, t0 + Duration::from_secs(9)), Decision::DownOthers(_)));
    }

    #[test]
    fn a_majority_without_the_lowest_address_still_wins_and_downs_the_minority_holding_it() {
        // 3 reachable against 2 unreachable that include the lowest address: counts decide,
        // the address only breaks ties.
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let s = snap("c", &[("a", false), ("b", false), ("c", true), ("d", true), ("e", true)]);
        k.decide(&s, t0);
        let d = k.decide(&s, t0 + Duration::from_secs(5));
        assert_eq!(d, Decision::DownOthers([UniqueAddress::new("a", 1), UniqueAddress::new("b", 1)].into()));
    }

    #[test]
    fn tie_is_won_by_the_side_with_the_lowest_address() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let s = snap("a", &[("a", true), ("b", true), ("c", false), ("d", false)]);
        k.decide(&s, t0);
        assert!(matches!(k.decide(&s, later), Decision::DownOthers(_)));
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let s = snap("c", &[("a", false), ("b", false), ("c", true), ("d", true)]);
        k.decide(&s, t0);
        assert_eq!(k.decide(&s, later), Decision::DownMyself);
    }

    #[test]
    fn losing_side_keeps_its_clock_when_a_peer_on_its_side_crashes_mid_partition() {
        // 2|3 partition seen from d; 1 s later e (on d's side) crashes: d's unreachable set
        // changes, but d has been losing all along and must down itself on the original
        // schedule, when the majority (which saw no change) downs d and e.
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let cut = cut_seen_by_d();
        assert_eq!(k.decide(&cut, t0), Decision::Wait);
        let crashed = snap("d", &[("a", false), ("b", false), ("c", false), ("d", true), ("e", false)]);
        assert_eq!(k.decide(&crashed, t0 + Duration::from_secs(1)), Decision::Wait);
        assert_eq!(k.decide(&crashed, t0 + Duration::from_secs(5)), Decision::DownMyself);
    }

    #[test]
    fn a_brief_flap_seen_only_by_the_loser_does_not_restart_its_clock() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let cut = cut_seen_by_d();
        k.decide(&cut, t0);
        let healed = healed_seen_by_d();
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(3)), Decision::Wait);
        assert_eq!(k.decide(&cut, t0 + Duration::from_secs(4)), Decision::Wait);
        assert_eq!(k.decide(&cut, t0 + Duration::from_secs(5)), Decision::DownMyself);
    }

    #[test]
    fn losing_clock_restarts_after_stable_after_without_losing() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(5), t0);
        let cut = cut_seen_by_d();
        k.decide(&cut, t0);
        let healed = healed_seen_by_d();
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(3)), Decision::Wait);
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(8)), Decision::Wait);
        assert_eq!(k.decide(&cut, t0 + Duration::from_secs(9)), Decision::Wait);
        assert_eq!(k.decide(&cut, t0 + Duration::from_secs(13)), Decision::Wait);
        assert_eq!(k.decide(&cut, t0 + Duration::from_secs(14)), Decision::DownMyself);
    }

    #[test]
    fn healed_partition_decides_nothing() {
        let t0 = Instant::now();
        let mut k = KeepMajority::new(Duration::from_secs(1), t0);
        k.decide(&snap("a", &[("a", true), ("b", false), ("c", true)]), t0);
        let healed = snap("a", &[("a", true), ("b", true), ("c", true)]);
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(5)), Decision::Wait);
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(9)), Decision::Wait);
    }
}
