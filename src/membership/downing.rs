//! The split-brain resolver as a pure decision function over one node's membership view: who
//! is unreachable, by gossip or by the reachability table of message-path heartbeats, and who
//! must therefore be downed. Every node runs it; they agree because they decide from the same
//! gossiped table once it has been stable for `stable_after`.
//!
//! **The picture.** The members that count (Joining, Up, Leaving) that gossip has lost
//! (*silent*), and the table's records: observer → subject, "my heartbeats to it go
//! unanswered", from observers alive in gossip. Any change of the picture restarts the
//! `stable_after` clock.
//!
//! **Indirectly connected members.** A member that both reports and is reported is part of a
//! broken link between members gossip still connects: a one-way cut, a bad firewall rule, a
//! messaging-only failure. Akka downs every such member; here only the fewest that cover every
//! record among them are downed (greedy: the one on most broken links first, ties: the youngest,
//! so the oldest members keep their singletons). A node whose outbound link is broken is on a
//! broken link with every observer, so it alone goes, where Akka's rule would down its observers
//! too (Akka's verdicts travel the broken path; ours travel by gossip and arrive). In a clean
//! partition the other side's records do not arrive, nobody on this side is reported by this
//! side, and the set is empty: the rule never picks a side of a partition.
//!
//! **A strategy over the rest.** Without the covered members, a member is unreachable when
//! gossip lost it or an observer outside the cover reports it. That splits the rest into this
//! node's *reachable* side and the *unreachable* side. When the picture has been stable for
//! `stable_after`, the configured [`Strategy`] names the side that keeps running ([`survivors`],
//! a pure function of the two sides): the surviving side downs the other, with the covered
//! members; a node on a side that does not survive, or in the cover, downs itself.
//!
//! - *keep-majority*: the side with more members (tie: the side holding the lowest address).
//! - *static-quorum*: the side with at least `quorum_size` members; neither when neither has it
//!   (both stop), and every member when the cluster is larger than `quorum_size × 2 − 1`
//!   (both sides could then hold a quorum).
//! - *keep-oldest*: the side holding the oldest member; with `down_if_alone`, when the oldest is
//!   alone on its side and the other side has at least two members, the other side.
//! - *down-all*: no side; every member is downed.
//!
//! With a role set, only members with that role are counted (and only they can be the oldest
//! or break a tie); the others go with their side. Every strategy sees the same picture on
//! both sides of a clean split (each side's reachable set is the other's unreachable set), so
//! the sides reach complementary verdicts without talking to each other.
//!
//! The two sides time their decisions differently on purpose. The winning side waits until its
//! picture has been stable for `stable_after` (any change restarts the clock: that only delays
//! downing others, which is safe). The losing side downs itself once it has been losing for
//! `stable_after`, even if its picture changed meanwhile (say a peer on its own side crashed):
//! restarting its clock there would let it outlive the moment the winners, who saw no change,
//! start its shards elsewhere. For the same reason a brief spell of not losing (one heartbeat
//! that got through a flapping link, seen by the loser only) does not restart the clock: only
//! `stable_after` without losing does.
//!
//! **Down all when unstable.** When the picture has not been stable long enough for any
//! decision within `stable_after + down_all_when_unstable` of its first change (a flapping
//! link), every member is downed, this node included: a cluster held in limbo by a link that
//! never settles is worse than a restart. The window closes after `stable_after` with an empty
//! picture, or with a decision.
//!
//! What remains is the assumption every such resolver makes: the two sides detect the
//! split within `down_removal_margin` of each other, so the losers are gone before the winners
//! move their shards. Keep the margin at least as long as the failure detector's spread.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use crate::clock::Instant;

use super::{Member, MembershipSnapshot, UniqueAddress};

/// What the resolver decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing (yet).
    Wait,
    /// This node is on the winning side: down these members (never this node).
    DownOthers(BTreeSet<UniqueAddress>),
    /// This node is on the losing side or indirectly connected: it must stop and leave.
    DownMyself,
    /// Reachability never settled: down every member, this node included.
    DownAll,
}

/// Which side of a split keeps running (the split-brain strategies of Akka's resolver).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// The side with more members; on a tie the side holding the lowest address.
    KeepMajority { role: Option<String> },
    /// The side with at least `quorum_size` members (counting only `role`'s members).
    StaticQuorum { quorum_size: usize, role: Option<String> },
    /// The side holding the oldest member; with `down_if_alone`, an oldest member alone on its
    /// side against two or more others is the one that goes.
    KeepOldest { down_if_alone: bool, role: Option<String> },
    /// No side: every member is downed.
    DownAll,
}

impl Strategy {
    /// The strategy the membership settings choose, or `None` with automatic downing off.
    pub(crate) fn from_settings(m: &crate::config::MembershipSettings) -> Option<Strategy> {
        use crate::config::DowningStrategy as D;
        let role = m.downing_role.clone();
        match m.downing {
            D::Off => None,
            D::KeepMajority => Some(Strategy::KeepMajority { role }),
            D::StaticQuorum => Some(Strategy::StaticQuorum { quorum_size: m.quorum_size, role }),
            D::KeepOldest => Some(Strategy::KeepOldest { down_if_alone: m.down_if_alone, role }),
            D::DownAll => Some(Strategy::DownAll),
        }
    }
}

/// Which sides of a split keep running, as a [`Strategy`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Survivors {
    /// This node's reachable side; the unreachable side is downed.
    ReachableSide,
    /// The unreachable side; this node's side downs itself.
    UnreachableSide,
    /// Neither side: each downs itself (static-quorum with no quorum on either side).
    NeitherSide,
    /// Every member is downed by every member (down-all; static-quorum in a cluster too large
    /// for its quorum).
    NoMember,
}

/// The two sides of a split as one node's picture draws them, indirectly connected members
/// taken out (they are downed whatever the strategy decides).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sides<'a> {
    /// This node's side: counted members it reaches.
    pub reachable: &'a [&'a Member],
    /// Counted members unreachable from this node.
    pub unreachable: &'a [&'a Member],
    /// Counted members that are indirectly connected (downed whatever the strategy decides).
    pub indirectly_connected: &'a [&'a Member],
}

/// The pure rule: which sides keep running under `strategy`, and why (for the log line).
pub(crate) fn survivors(strategy: &Strategy, sides: Sides<'_>) -> (Survivors, String) {
    let with_role =
        |side: &[&Member], role: &Option<String>| side.iter().filter(|m| m.has_role(role.as_deref())).count();
    match strategy {
        Strategy::KeepMajority { role } => {
            let (r, u) = (with_role(sides.reachable, role), with_role(sides.unreachable, role));
            let why = format!("keep-majority: {r} reachable against {u} unreachable members{}", role_note(role));
            let side = match r.cmp(&u) {
                std::cmp::Ordering::Greater => Survivors::ReachableSide,
                std::cmp::Ordering::Less => Survivors::UnreachableSide,
                std::cmp::Ordering::Equal => {
                    // The tie goes to the side holding the lowest address among the counted
                    // members (with the role, when any has it: on a tie, r == u).
                    let counted = |m: &&&Member| r == 0 || m.has_role(role.as_deref());
                    let lowest_reachable = sides.reachable.iter().filter(counted).map(|m| m.address()).min();
                    let lowest_unreachable = sides.unreachable.iter().filter(counted).map(|m| m.address()).min();
                    match (lowest_reachable, lowest_unreachable) {
                        (Some(a), Some(b)) if a < b => Survivors::ReachableSide,
                        (Some(_), None) => Survivors::ReachableSide,
                        _ => Survivors::UnreachableSide,
                    }
                }
            };
            (side, why)
        }
        Strategy::StaticQuorum { quorum_size, role } => {
            let (r, u) = (with_role(sides.reachable, role), with_role(sides.unreachable, role));
            let covered = with_role(sides.indirectly_connected, role);
            let total = r + u + covered;
            let why = format!(
                "static-quorum {quorum_size}: {r} reachable, {u} unreachable, {} indirectly connected members{}",
                covered,
                role_note(role)
            );
            // More than 2q - 1 members: both sides could hold a quorum, so neither may stay.
            let side = if total > quorum_size.saturating_mul(2).saturating_sub(1) {
                Survivors::NoMember
            } else if r >= *quorum_size {
                Survivors::ReachableSide
            } else if u >= *quorum_size {
                Survivors::UnreachableSide
            } else {
                Survivors::NeitherSide
            };
            (side, why)
        }
        Strategy::KeepOldest { down_if_alone, role } => {
            let (r_oldest, u_oldest) =
                (oldest(sides.reachable, role.as_deref()), oldest(sides.unreachable, role.as_deref()));
            // The oldest indirectly connected: the other side may not see it so (its view of a
            // one-way failure lacks our reports) and keep running because it holds it. A side
            // that cannot be sure it holds the oldest never keeps running.
            let c_oldest = oldest(sides.indirectly_connected, role.as_deref());
            if c_oldest.is_some_and(|c| r_oldest.is_none_or(|r| c < r) && u_oldest.is_none_or(|u| c < u)) {
                let why = format!("keep-oldest: the oldest member is indirectly connected{}", role_note(role));
                return (Survivors::NeitherSide, why);
            }
            let oldest_reachable = match (r_oldest, u_oldest) {
                (Some(a), Some(b)) => a < b,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => {
                    return (Survivors::NeitherSide, format!("keep-oldest: no counted member{}", role_note(role)));
                }
            };
            let (r, u) = (with_role(sides.reachable, role), with_role(sides.unreachable, role));
            let (own, other) = if oldest_reachable { (r, u) } else { (u, r) };
            let alone = *down_if_alone && own == 1 && other >= 2;
            let why = format!(
                "keep-oldest: the oldest member is {}{}{}",
                if oldest_reachable { "reachable" } else { "unreachable" },
                if alone { " and alone on its side (down-if-alone)" } else { "" },
                role_note(role)
            );
            let side = if oldest_reachable != alone { Survivors::ReachableSide } else { Survivors::UnreachableSide };
            (side, why)
        }
        Strategy::DownAll => (Survivors::NoMember, "down-all: every member goes on any unreachability".into()),
    }
}

/// The age key of a side's oldest member with the role.
fn oldest<'a>(side: &[&'a Member], role: Option<&str>) -> Option<(u64, u64, &'a str)> {
    side.iter().filter(|m| m.has_role(role)).map(|m| m.age_key()).min()
}

fn role_note(role: &Option<String>) -> String {
    role.as_ref().map(|r| format!(" (counting role {r:?})")).unwrap_or_default()
}

/// What the resolver sees: members gossip lost, and the table's records (observer, subject).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Picture {
    silent: BTreeSet<UniqueAddress>,
    records: BTreeSet<(UniqueAddress, UniqueAddress)>,
}

impl Picture {
    fn is_empty(&self) -> bool {
        self.silent.is_empty() && self.records.is_empty()
    }
}

/// The resolver's state: the picture, since when it is stable, and the losing and unstable
/// clocks.
#[derive(Debug)]
pub(crate) struct Resolver {
    strategy: Strategy,
    stable_after: Duration,
    down_all_when_unstable: Option<Duration>,
    picture: Picture,
    stable_since: Instant,
    /// Since when the picture has been non-empty without a decision.
    unstable_since: Option<Instant>,
    /// Since when this node has been on the losing side (without a break of `stable_after`).
    losing_since: Option<Instant>,
    /// Since when it has not been losing, while `losing_since` is still set.
    not_losing_since: Option<Instant>,
    /// The members the last decision covered as indirectly connected (for the explanation).
    indirectly_connected: BTreeSet<UniqueAddress>,
    /// Why the strategy chose the side it chose last (for the explanation).
    verdict: String,
}

impl Resolver {
    /// A resolver that applies `strategy` once the picture is stable for `stable_after` and,
    /// with `down_all_when_unstable`, downs everyone when it is not within that much more.
    pub(crate) fn new(
        strategy: Strategy,
        stable_after: Duration,
        down_all_when_unstable: Option<Duration>,
        now: Instant,
    ) -> Self {
        Resolver {
            strategy,
            stable_after,
            down_all_when_unstable,
            picture: Picture::default(),
            stable_since: now,
            unstable_since: None,
            losing_since: None,
            not_losing_since: None,
            indirectly_connected: BTreeSet::new(),
            verdict: String::new(),
        }
    }

    /// Feeds the current view; returns the decision once the picture is stable long enough.
    pub(crate) fn decide(&mut self, snap: &MembershipSnapshot, now: Instant) -> Decision {
        let me = &snap.self_address;
        let counted: BTreeMap<&UniqueAddress, &Member> =
            snap.members.iter().filter(|m| m.status().counts_for_downing()).map(|m| (m.address(), m)).collect();
        let live = |m: &Member| m.address() == me || m.gossip_live;
        // Records about members gossip already lost change no decision (they are unreachable
        // either way and their own records do not count): leaving them out keeps the picture
        // from changing again as each observer's verdict arrives after the silence.
        let picture = Picture {
            silent: counted.values().filter(|m| !live(m)).map(|m| m.address().clone()).collect(),
            records: counted
                .values()
                .filter(|s| live(s))
                .flat_map(|s| {
                    s.unreachable_by
                        .iter()
                        .filter(|o| counted.get(o).is_some_and(|o| live(o)))
                        .map(|o| (o.clone(), s.address().clone()))
                })
                .collect(),
        };
        if picture != self.picture {
            self.picture = picture;
            self.stable_since = now;
            if !self.picture.is_empty() && self.unstable_since.is_none() {
                self.unstable_since = Some(now);
            }
        }
        let stable = now.saturating_duration_since(self.stable_since) >= self.stable_after;
        if self.picture.is_empty() {
            self.not_losing(now);
            if stable {
                self.unstable_since = None;
            }
            return Decision::Wait;
        }
        let decision = self.decide_on_picture(me, &counted, stable, now);
        if decision != Decision::Wait {
            self.unstable_since = None;
            return decision;
        }
        let limit = self.down_all_when_unstable.map(|d| self.stable_after + d);
        match (limit, self.unstable_since) {
            (Some(limit), Some(since)) if now.saturating_duration_since(since) >= limit => {
                self.verdict = "reachability did not settle within stable_after + down_all_when_unstable".into();
                Decision::DownAll
            }
            _ => Decision::Wait,
        }
    }

    fn decide_on_picture(
        &mut self,
        me: &UniqueAddress,
        counted: &BTreeMap<&UniqueAddress, &Member>,
        stable: bool,
        now: Instant,
    ) -> Decision {
        let records = &self.picture.records;
        let observers: BTreeSet<&UniqueAddress> = records.iter().map(|(o, _)| o).collect();
        let indirect: BTreeSet<&UniqueAddress> =
            records.iter().map(|(_, s)| s).filter(|s| observers.contains(s)).collect();
        let cover: BTreeSet<UniqueAddress> =
            cover_of_broken_links(records, &indirect, counted).into_iter().cloned().collect();
        let unreachable: BTreeSet<UniqueAddress> = counted
            .keys()
            .filter(|m| !cover.contains(**m))
            .filter(|m| {
                self.picture.silent.contains(**m) || records.iter().any(|(o, s)| s == **m && !cover.contains(o))
            })
            .map(|m| (*m).clone())
            .collect();
        self.indirectly_connected = cover.clone();
        if cover.contains(me) {
            self.not_losing(now);
            return if stable { Decision::DownMyself } else { Decision::Wait };
        }
        let on_reachable_side = !unreachable.contains(me);
        let (reachable_side, unreachable_side): (Vec<&Member>, Vec<&Member>) = counted
            .iter()
            .filter(|(a, _)| !cover.contains(**a))
            .map(|(_, m)| *m)
            .partition(|m| !unreachable.contains(m.address()));
        let covered: Vec<&Member> = cover.iter().map(|a| counted[a]).collect();
        let sides =
            Sides { reachable: &reachable_side, unreachable: &unreachable_side, indirectly_connected: &covered };
        let (survivors, verdict) = survivors(&self.strategy, sides);
        self.verdict = verdict;
        let my_side_survives = match survivors {
            Survivors::ReachableSide => on_reachable_side,
            Survivors::UnreachableSide => !on_reachable_side,
            Survivors::NeitherSide | Survivors::NoMember => false,
        };
        if my_side_survives {
            self.not_losing(now);
            if !stable || !on_reachable_side {
                // Reported myself, yet on the surviving side: those who see my side lose act.
                return Decision::Wait;
            }
            let victims: BTreeSet<UniqueAddress> = unreachable.into_iter().chain(cover).filter(|m| m != me).collect();
            return if victims.is_empty() { Decision::Wait } else { Decision::DownOthers(victims) };
        }
        self.not_losing_since = None;
        let since = *self.losing_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.stable_after {
            return Decision::Wait;
        }
        if survivors == Survivors::NoMember { Decision::DownAll } else { Decision::DownMyself }
    }

    fn not_losing(&mut self, now: Instant) {
        if self.losing_since.is_some() {
            let since = *self.not_losing_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= self.stable_after {
                self.losing_since = None;
                self.not_losing_since = None;
            }
        }
    }

    /// The picture the last decision was made from, for the log line that records it.
    pub(crate) fn explain(&self) -> String {
        let mut s = String::new();
        let silent: Vec<String> = self.picture.silent.iter().map(ToString::to_string).collect();
        let _ =
            write!(s, "silent in gossip: [{}]; unreachable by heartbeats (observer -> subject): [", silent.join(", "));
        let records: Vec<String> = self.picture.records.iter().map(|(o, x)| format!("{o} -> {x}")).collect();
        let cover: Vec<String> = self.indirectly_connected.iter().map(ToString::to_string).collect();
        let _ = write!(s, "{}]; indirectly connected, downed: [{}]", records.join(", "), cover.join(", "));
        if !self.verdict.is_empty() {
            let _ = write!(s, "; {}", self.verdict);
        }
        s
    }
}

/// The fewest members (greedily) that touch every record between two indirectly connected
/// members: the one on most such links first, ties to the youngest.
fn cover_of_broken_links<'a>(
    records: &'a BTreeSet<(UniqueAddress, UniqueAddress)>,
    indirect: &BTreeSet<&'a UniqueAddress>,
    counted: &BTreeMap<&UniqueAddress, &Member>,
) -> BTreeSet<&'a UniqueAddress> {
    let mut links: BTreeSet<(&UniqueAddress, &UniqueAddress)> = records
        .iter()
        .filter(|(o, s)| indirect.contains(o) && indirect.contains(s))
        // One undirected link per pair, whichever way it was reported.
        .map(|(o, s)| (o.min(s), o.max(s)))
        .collect();
    let mut cover = BTreeSet::new();
    while !links.is_empty() {
        let mut degree: BTreeMap<&UniqueAddress, usize> = BTreeMap::new();
        for (a, b) in &links {
            *degree.entry(a).or_default() += 1;
            *degree.entry(b).or_default() += 1;
        }
        let age = |m: &UniqueAddress| counted.get(m).map(|m| m.age_key());
        let Some(pick) =
            degree.into_iter().max_by(|(a, da), (b, db)| da.cmp(db).then_with(|| age(a).cmp(&age(b)))).map(|(m, _)| m)
        else {
            break;
        };
        links.retain(|(a, b)| *a != pick && *b != pick);
        cover.insert(pick);
    }
    cover
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::view::{GossipNode, compute_members};
    use std::collections::BTreeMap;

    const KM: Strategy = Strategy::KeepMajority { role: None };

    fn snap(me: &str, members: &[(&str, bool)]) -> MembershipSnapshot {
        table(me, members, &[])
    }

    /// `me`'s view: members in age order (oldest first) with gossip liveness, and the
    /// reachability table's records (observer, subject) as gossiped by the observers.
    fn table(me: &str, members: &[(&str, bool)], records: &[(&str, &str)]) -> MembershipSnapshot {
        let nodes: Vec<GossipNode> = members
            .iter()
            .enumerate()
            .map(|(i, (id, live))| {
                let mut keys = BTreeMap::new();
                keys.insert("status".to_string(), "up".to_string());
                keys.insert("up".to_string(), (i + 1).to_string());
                keys.insert("msg".to_string(), "127.0.0.1:1".to_string());
                let verdicts: Vec<String> =
                    records.iter().filter(|(o, _)| o == id).map(|(_, s)| format!("{s}#1")).collect();
                keys.insert("unreachable".to_string(), verdicts.join(","));
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
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
        let s = snap("a", &[("a", true), ("b", true), ("c", true), ("d", false), ("e", false)]);
        assert_eq!(k.decide(&s, t0), Decision::Wait);
        assert_eq!(k.decide(&s, t0 + Duration::from_secs(4)), Decision::Wait);
        let d = k.decide(&s, t0 + Duration::from_secs(5));
        assert_eq!(d, Decision::DownOthers([UniqueAddress::new("d", 1), UniqueAddress::new("e", 1)].into()));
    }

    #[test]
    fn minority_side_downs_itself() {
        let t0 = Instant::now();
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
        let s = snap("d", &[("a", false), ("b", false), ("c", false), ("d", true), ("e", true)]);
        k.decide(&s, t0);
        assert_eq!(k.decide(&s, t0 + Duration::from_secs(6)), Decision::DownMyself);
    }

    #[test]
    fn a_change_in_the_unreachable_set_restarts_the_clock() {
        let t0 = Instant::now();
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
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
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
        let s = snap("c", &[("a", false), ("b", false), ("c", true), ("d", true), ("e", true)]);
        k.decide(&s, t0);
        let d = k.decide(&s, t0 + Duration::from_secs(5));
        assert_eq!(d, Decision::DownOthers([UniqueAddress::new("a", 1), UniqueAddress::new("b", 1)].into()));
    }

    #[test]
    fn tie_is_won_by_the_side_with_the_lowest_address() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
        let s = snap("a", &[("a", true), ("b", true), ("c", false), ("d", false)]);
        k.decide(&s, t0);
        assert!(matches!(k.decide(&s, later), Decision::DownOthers(_)));
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
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
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
        let cut = cut_seen_by_d();
        assert_eq!(k.decide(&cut, t0), Decision::Wait);
        let crashed = snap("d", &[("a", false), ("b", false), ("c", false), ("d", true), ("e", false)]);
        assert_eq!(k.decide(&crashed, t0 + Duration::from_secs(1)), Decision::Wait);
        assert_eq!(k.decide(&crashed, t0 + Duration::from_secs(5)), Decision::DownMyself);
    }

    #[test]
    fn a_brief_flap_seen_only_by_the_loser_does_not_restart_its_clock() {
        let t0 = Instant::now();
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
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
        let mut k = Resolver::new(KM, Duration::from_secs(5), None, t0);
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
        let mut k = Resolver::new(KM, Duration::from_secs(1), None, t0);
        k.decide(&snap("a", &[("a", true), ("b", false), ("c", true)]), t0);
        let healed = snap("a", &[("a", true), ("b", true), ("c", true)]);
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(5)), Decision::Wait);
        assert_eq!(k.decide(&healed, t0 + Duration::from_secs(9)), Decision::Wait);
    }

    fn a(id: &str) -> UniqueAddress {
        UniqueAddress::new(id, 1)
    }

    const ALL_LIVE: [(&str, bool); 5] = [("c", true), ("p", true), ("q", true), ("x", true), ("y", true)];

    /// Messages from c (the oldest) to x and y are lost, the other direction flows: each
    /// heartbeat round trip between them fails, so both ends report each other.
    const ONE_WAY_CUT: [(&str, &str); 4] = [("c", "x"), ("c", "y"), ("x", "c"), ("y", "c")];

    fn decide_after(me: &str, records: &[(&str, &str)], stable: Duration) -> Decision {
        let t0 = Instant::now();
        let mut r = Resolver::new(KM, stable, None, t0);
        let view = table(me, &ALL_LIVE, records);
        assert_eq!(r.decide(&view, t0), Decision::Wait, "nothing before stable_after");
        assert_eq!(r.decide(&view, t0 + stable - Duration::from_millis(1)), Decision::Wait);
        r.decide(&view, t0 + stable)
    }

    #[test]
    fn a_one_way_cut_from_the_oldest_to_two_members_downs_only_the_oldest() {
        let stable = Duration::from_secs(5);
        for me in ["p", "q", "x", "y"] {
            assert_eq!(decide_after(me, &ONE_WAY_CUT, stable), Decision::DownOthers([a("c")].into()), "seen by {me}");
        }
        assert_eq!(decide_after("c", &ONE_WAY_CUT, stable), Decision::DownMyself);
    }

    #[test]
    fn the_table_row_names_every_observer_that_reports_a_member() {
        let view = table("p", &ALL_LIVE, &ONE_WAY_CUT);
        assert_eq!(view.observed_unreachable_by(&a("c")), [a("x"), a("y")]);
        assert_eq!(view.observed_unreachable_by(&a("x")), [a("c")]);
        assert!(view.observed_unreachable_by(&a("p")).is_empty());
        assert!(!view.get(&a("c")).unwrap().is_reachable(), "reported by an observer");
        assert!(view.get(&a("c")).unwrap().is_alive_in_gossip(), "yet alive in gossip");
        assert!(view.get(&a("p")).unwrap().is_reachable());
    }

    #[test]
    fn a_member_whose_outbound_messages_are_all_lost_is_downed_alone_not_its_observers() {
        // x's answers and requests never leave it: x reports everyone and everyone reports x.
        let mut records = Vec::new();
        for o in ["c", "p", "q", "y"] {
            records.push((o, "x"));
            records.push(("x", o));
        }
        for me in ["c", "p", "q", "y"] {
            assert_eq!(decide_after(me, &records, Duration::from_secs(1)), Decision::DownOthers([a("x")].into()));
        }
        assert_eq!(decide_after("x", &records, Duration::from_secs(1)), Decision::DownMyself);
    }

    #[test]
    fn a_messaging_only_cut_between_two_members_downs_the_younger_of_the_two() {
        // c is older than y (age order is the member order given to `table`).
        let records = [("c", "y"), ("y", "c")];
        assert_eq!(decide_after("p", &records, Duration::from_secs(1)), Decision::DownOthers([a("y")].into()));
        assert_eq!(decide_after("c", &records, Duration::from_secs(1)), Decision::DownOthers([a("y")].into()));
        assert_eq!(decide_after("y", &records, Duration::from_secs(1)), Decision::DownMyself);
    }

    #[test]
    fn a_member_reported_by_one_observer_it_does_not_report_back_is_unreachable_for_keep_majority() {
        // Only c watches x (a ring in a larger cluster): no cycle, x is simply unreachable and the
        // majority downs it.
        assert_eq!(decide_after("p", &[("c", "x")], Duration::from_secs(1)), Decision::DownOthers([a("x")].into()));
        assert_eq!(decide_after("x", &[("c", "x")], Duration::from_secs(1)), Decision::DownMyself);
    }

    #[test]
    fn in_a_clean_partition_this_sides_reports_mark_nobody_indirectly_connected() {
        // {c, p, q} | {x, y}: gossip lost x and y too; c, p, q's heartbeats report them.
        let t0 = Instant::now();
        let stable = Duration::from_secs(1);
        let members = [("c", true), ("p", true), ("q", true), ("x", false), ("y", false)];
        let records = [("c", "x"), ("p", "x"), ("q", "y"), ("c", "y")];
        let mut r = Resolver::new(KM, stable, None, t0);
        let view = table("p", &members, &records);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + stable), Decision::DownOthers([a("x"), a("y")].into()));
        assert!(r.explain().contains("indirectly connected, downed: []"), "{}", r.explain());
        // x's side: its own reports of c, p, q arrive only on its side; gossip lost them.
        let members = [("c", false), ("p", false), ("q", false), ("x", true), ("y", true)];
        let records = [("x", "c"), ("x", "p"), ("y", "q")];
        let mut r = Resolver::new(KM, stable, None, t0);
        let view = table("x", &members, &records);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + stable), Decision::DownMyself);
    }

    #[test]
    fn reports_by_observers_gossip_lost_do_not_count() {
        // c reported x, then crashed: its stale verdict must not keep x unreachable.
        let members = [("c", false), ("p", true), ("q", true), ("x", true), ("y", true)];
        let view = table("p", &members, &[("c", "x")]);
        assert!(view.get(&a("x")).unwrap().is_reachable());
        assert!(view.observed_unreachable_by(&a("x")).is_empty());
        let t0 = Instant::now();
        let mut r = Resolver::new(KM, Duration::from_secs(1), None, t0);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + Duration::from_secs(1)), Decision::DownOthers([a("c")].into()));
    }

    #[test]
    fn a_change_in_the_table_restarts_the_clock() {
        let t0 = Instant::now();
        let stable = Duration::from_secs(5);
        let mut r = Resolver::new(KM, stable, None, t0);
        r.decide(&table("p", &ALL_LIVE, &[("c", "x"), ("x", "c")]), t0);
        let more = table("p", &ALL_LIVE, &ONE_WAY_CUT);
        assert_eq!(r.decide(&more, t0 + Duration::from_secs(3)), Decision::Wait);
        assert_eq!(r.decide(&more, t0 + Duration::from_secs(7)), Decision::Wait);
        assert_eq!(r.decide(&more, t0 + Duration::from_secs(8)), Decision::DownOthers([a("c")].into()));
    }

    /// A picture that changes every second (a flapping link seen by heartbeats).
    fn flapping(i: u64) -> MembershipSnapshot {
        if i.is_multiple_of(2) {
            table("p", &ALL_LIVE, &[("c", "x"), ("x", "c")])
        } else {
            table("p", &ALL_LIVE, &ONE_WAY_CUT)
        }
    }

    #[test]
    fn reachability_that_never_settles_downs_everyone_after_stable_after_plus_the_unstable_margin() {
        let t0 = Instant::now();
        let (stable, extra) = (Duration::from_secs(5), Duration::from_millis(3_750));
        let mut r = Resolver::new(KM, stable, Some(extra), t0);
        for i in 0..=8 {
            assert_eq!(r.decide(&flapping(i), t0 + Duration::from_secs(i)), Decision::Wait, "at {i} s");
        }
        assert_eq!(r.decide(&flapping(8), t0 + Duration::from_millis(8_749)), Decision::Wait);
        assert_eq!(r.decide(&flapping(8), t0 + Duration::from_millis(8_750)), Decision::DownAll);
        // Without the setting, it waits for ever.
        let mut r = Resolver::new(KM, stable, None, t0);
        for i in 0..60 {
            assert_eq!(r.decide(&flapping(i), t0 + Duration::from_secs(i)), Decision::Wait, "at {i} s");
        }
    }

    #[test]
    fn a_settled_empty_picture_closes_the_unstable_window_but_a_brief_one_does_not() {
        let t0 = Instant::now();
        let (stable, extra) = (Duration::from_secs(5), Duration::from_secs(3));
        let at = |s: u64| t0 + Duration::from_secs(s);
        let healed = table("p", &ALL_LIVE, &[]);
        // Unsettled from 0 s; healed for 4 s only (less than stable_after): the window stays open.
        let mut r = Resolver::new(KM, stable, Some(extra), t0);
        r.decide(&flapping(0), at(0));
        r.decide(&flapping(1), at(1));
        r.decide(&healed, at(2));
        r.decide(&healed, at(6));
        r.decide(&flapping(0), at(6));
        assert_eq!(r.decide(&flapping(1), at(8)), Decision::DownAll, "8 s after the first change");
        // Healed for stable_after: a new problem later gets a fresh window.
        let mut r = Resolver::new(KM, stable, Some(extra), t0);
        r.decide(&flapping(0), at(0));
        r.decide(&healed, at(2));
        r.decide(&healed, at(7));
        r.decide(&flapping(0), at(7));
        assert_eq!(r.decide(&flapping(1), at(10)), Decision::Wait, "3 s into the new window");
        assert_eq!(r.decide(&flapping(0), at(15)), Decision::DownAll, "8 s into it");
    }

    #[test]
    fn a_decision_closes_the_unstable_window() {
        let t0 = Instant::now();
        let (stable, extra) = (Duration::from_secs(5), Duration::from_secs(1));
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = Resolver::new(KM, stable, Some(extra), t0);
        let cut = table("p", &ALL_LIVE, &ONE_WAY_CUT);
        r.decide(&cut, at(0));
        assert_eq!(r.decide(&cut, at(5)), Decision::DownOthers([a("c")].into()));
        // The victim's records change as it goes; the clock for giving up starts anew.
        let next = table("p", &ALL_LIVE, &[("c", "x"), ("x", "c")]);
        assert_eq!(r.decide(&next, at(6)), Decision::Wait);
        assert_eq!(r.decide(&next, at(11)), Decision::DownOthers([a("x")].into()), "stable again: decides");
    }

    #[test]
    fn with_only_indirectly_connected_members_reported_the_rest_keeps_running_under_a_role_nobody_has() {
        // A messaging-only cut between c and y: y (the younger) is covered, nobody else is
        // unreachable. With a role no member has, the tie is 0 against 0 and this side, the only
        // one with members, keeps running.
        let km = Strategy::KeepMajority { role: Some("db".into()) };
        let t0 = Instant::now();
        let mut r = Resolver::new(km, Duration::from_secs(1), None, t0);
        let view = table("p", &ALL_LIVE, &[("c", "y"), ("y", "c")]);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + Duration::from_secs(1)), Decision::DownOthers([a("y")].into()));
    }

    #[test]
    fn static_quorum_counts_the_indirectly_connected_when_it_checks_the_cluster_size() {
        // Six members against a quorum of 3 (at most 5 allowed): y is indirectly connected and
        // downed anyway, yet the cluster is too large for the quorum, so every member goes.
        let members = [("c", true), ("p", true), ("q", true), ("x", true), ("y", true), ("z", true)];
        let t0 = Instant::now();
        let stable = Duration::from_secs(1);
        let mut r = Resolver::new(Strategy::StaticQuorum { quorum_size: 3, role: None }, stable, None, t0);
        let view = table("p", &members, &[("c", "y"), ("y", "c")]);
        assert_eq!(r.decide(&view, t0), Decision::Wait);
        assert_eq!(r.decide(&view, t0 + stable), Decision::DownAll);
        assert!(r.explain().contains("5 reachable, 0 unreachable, 1 indirectly connected"), "{}", r.explain());
    }

    #[test]
    fn static_quorum_a_member_reported_with_a_quorum_on_its_side_keeps_running() {
        // c reports p, x and y (they do not report back: no cycle). Seen by x, the reported side
        // {p, x, y} holds the quorum of 3 and the reporting side {c, q} does not: x waits for
        // the others to act; c downs itself.
        let q3 = Strategy::StaticQuorum { quorum_size: 3, role: None };
        let records = [("c", "p"), ("c", "x"), ("c", "y")];
        let t0 = Instant::now();
        let stable = Duration::from_secs(1);
        let mut x = Resolver::new(q3.clone(), stable, None, t0);
        let seen_by_x = table("x", &ALL_LIVE, &records);
        x.decide(&seen_by_x, t0);
        assert_eq!(x.decide(&seen_by_x, t0 + stable), Decision::Wait);
        assert_eq!(x.decide(&seen_by_x, t0 + stable * 5), Decision::Wait, "never downs itself");
        let mut c = Resolver::new(q3, stable, None, t0);
        let seen_by_c = table("c", &ALL_LIVE, &records);
        c.decide(&seen_by_c, t0);
        assert_eq!(c.decide(&seen_by_c, t0 + stable), Decision::DownMyself);
    }

    #[test]
    fn the_cover_spans_only_links_between_indirectly_connected_members_and_the_strategy_takes_the_rest() {
        // c and x report each other (a broken link between two indirectly connected members);
        // p and q report c one way (c does not report them back). The cover takes the younger
        // of c and x; c, reported by p and q from outside the cover, is keep-majority's.
        let records = [("c", "x"), ("x", "c"), ("p", "c"), ("q", "c")];
        let t0 = Instant::now();
        let mut r = Resolver::new(KM, Duration::from_secs(1), None, t0);
        let view = table("p", &ALL_LIVE, &records);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + Duration::from_secs(1)), Decision::DownOthers([a("c"), a("x")].into()));
        assert!(r.explain().contains("indirectly connected, downed: [x#1]"), "{}", r.explain());
    }

    #[test]
    fn keep_oldest_never_keeps_both_sides_when_one_side_sees_the_oldest_indirectly_connected() {
        // A = {p, q, x} loses everything it sends but still receives; B = {y} with the oldest,
        // c. On A's side every member looks alive and every A-B link is reported both ways:
        // the cover takes c and y. On B's side A is silent (a clean split) and c is reachable.
        let ko = Strategy::KeepOldest { down_if_alone: true, role: None };
        let t0 = Instant::now();
        let stable = Duration::from_secs(1);
        let mut records = Vec::new();
        for a_member in ["p", "q", "x"] {
            for b_member in ["c", "y"] {
                records.push((a_member, b_member));
                records.push((b_member, a_member));
            }
        }
        let mut seen_by_p = Resolver::new(ko.clone(), stable, None, t0);
        let view = table("p", &ALL_LIVE, &records);
        seen_by_p.decide(&view, t0);
        assert_eq!(
            seen_by_p.decide(&view, t0 + stable),
            Decision::DownMyself,
            "A cannot be sure it holds the oldest: {}",
            seen_by_p.explain()
        );
        // B's view: A silent, no records from it arrive; B keeps running with the oldest.
        let members = [("c", true), ("p", false), ("q", false), ("x", false), ("y", true)];
        let mut seen_by_y = Resolver::new(ko, stable, None, t0);
        let view = table("y", &members, &[]);
        seen_by_y.decide(&view, t0);
        assert!(matches!(seen_by_y.decide(&view, t0 + stable), Decision::DownOthers(_)));
    }

    #[test]
    fn keep_oldest_stops_a_side_whose_cover_holds_a_member_older_than_both_sides_and_only_then() {
        let ko = Strategy::KeepOldest { down_if_alone: true, role: None };
        let stable = Duration::from_secs(1);
        let decide = |me: &str, members: &[(&str, bool)], records: &[(&str, &str)]| {
            let t0 = Instant::now();
            let mut r = Resolver::new(ko.clone(), stable, None, t0);
            let view = table(me, members, records);
            r.decide(&view, t0);
            (r.decide(&view, t0 + stable), r.explain())
        };
        // c (the oldest) broke its links with p, q and x and is covered; y is silent. The
        // covered c is older than both sides' oldest (p and y): p's side stops.
        let y_silent = [("c", true), ("p", true), ("q", true), ("x", true), ("y", false)];
        let c_broken = [("c", "p"), ("p", "c"), ("c", "q"), ("q", "c"), ("c", "x"), ("x", "c")];
        let (d, why) = decide("p", &y_silent, &c_broken);
        assert_eq!(d, Decision::DownMyself, "{why}");
        assert!(why.ends_with("keep-oldest: the oldest member is indirectly connected"), "{why}");
        // q is covered (most broken links) but c, silent, is older still: the plain rule
        // applies — the oldest is on the unreachable side, so y's side stops for that reason.
        let c_p_silent = [("c", false), ("p", false), ("q", true), ("x", true), ("y", true)];
        let q_broken = [("q", "x"), ("x", "q"), ("q", "y"), ("y", "q")];
        let (d, why) = decide("y", &c_p_silent, &q_broken);
        assert_eq!(d, Decision::DownMyself, "{why}");
        assert!(why.ends_with("keep-oldest: the oldest member is unreachable"), "{why}");
    }

    #[test]
    fn the_explanation_names_the_silent_members_the_records_and_the_indirectly_connected() {
        let t0 = Instant::now();
        let mut r = Resolver::new(KM, Duration::from_secs(1), None, t0);
        let members = [("c", true), ("p", true), ("q", false), ("x", true), ("y", true)];
        let mut records = ONE_WAY_CUT.to_vec();
        records.push(("p", "q"));
        let view = table("p", &members, &records);
        r.decide(&view, t0);
        r.decide(&view, t0 + Duration::from_secs(1));
        let e = r.explain();
        assert!(e.contains("silent in gossip: [q#1]"), "{e}");
        assert!(e.contains("c#1 -> x#1") && e.contains("y#1 -> c#1"), "{e}");
        assert!(e.contains("indirectly connected, downed: [c#1]"), "{e}");
        assert!(!e.contains("-> q#1"), "records about a member gossip lost are left out: {e}");
    }
}

/// The strategies beside keep-majority, on every side of every split shape.
#[cfg(test)]
mod strategy_tests {
    use super::*;
    use crate::membership::view::{GossipNode, compute_members};
    use std::collections::BTreeMap;

    const STABLE: Duration = Duration::from_secs(5);

    /// `me`'s view of a clean split: members (oldest first, with roles) on `my_side` are alive
    /// in gossip, the others are silent.
    fn split_view(me: &str, members: &[(&str, &[&str])], my_side: &[&str]) -> MembershipSnapshot {
        let nodes: Vec<GossipNode> = members
            .iter()
            .enumerate()
            .map(|(i, (id, roles))| {
                let mut keys = BTreeMap::new();
                keys.insert("status".to_string(), "up".to_string());
                keys.insert("up".to_string(), (i + 1).to_string());
                keys.insert("msg".to_string(), "127.0.0.1:1".to_string());
                keys.insert("roles".to_string(), roles.join(","));
                GossipNode {
                    address: UniqueAddress::new(*id, 1),
                    gossip_addr: "127.0.0.1:2".parse().unwrap(),
                    live: my_side.contains(id),
                    keys,
                }
            })
            .collect();
        compute_members(&UniqueAddress::new(me, 1), &nodes)
    }

    /// Every member's decision `stable_after` after a clean split into `sides`.
    fn decisions(strategy: &Strategy, members: &[(&str, &[&str])], sides: &[&[&str]]) -> BTreeMap<String, Decision> {
        let t0 = Instant::now();
        let mut out = BTreeMap::new();
        for side in sides {
            for me in *side {
                let view = split_view(me, members, side);
                let mut r = Resolver::new(strategy.clone(), STABLE, None, t0);
                assert_eq!(r.decide(&view, t0), Decision::Wait, "{me}: nothing before stable_after");
                assert_eq!(r.decide(&view, t0 + STABLE - Duration::from_millis(1)), Decision::Wait, "{me}");
                out.insert(me.to_string(), r.decide(&view, t0 + STABLE));
            }
        }
        out
    }

    fn plain(ids: &[&'static str]) -> Vec<(&'static str, &'static [&'static str])> {
        ids.iter().map(|id| (*id, &[] as &[&str])).collect()
    }

    fn down(ids: &[&str]) -> Decision {
        Decision::DownOthers(ids.iter().map(|id| UniqueAddress::new(*id, 1)).collect())
    }

    /// Asserts each side's members decide `expected` (one decision per side, in order).
    fn assert_sides(strategy: &Strategy, members: &[(&str, &[&str])], sides: &[&[&str]], expected: &[Decision]) {
        let got = decisions(strategy, members, sides);
        for (side, want) in sides.iter().zip(expected) {
            for me in *side {
                assert_eq!(&got[*me], want, "{strategy:?}, split {sides:?}, seen by {me}");
            }
        }
    }

    const FIVE: [&str; 5] = ["a", "b", "c", "d", "e"];

    #[test]
    fn the_membership_settings_choose_the_strategy_and_its_parameters() {
        use crate::config::{DowningStrategy as D, MembershipSettings};
        let m = |downing| MembershipSettings {
            downing,
            downing_role: Some("db".into()),
            quorum_size: 4,
            down_if_alone: false,
            ..MembershipSettings::default()
        };
        let role = Some("db".to_string());
        assert_eq!(Strategy::from_settings(&m(D::Off)), None);
        assert_eq!(Strategy::from_settings(&m(D::KeepMajority)), Some(Strategy::KeepMajority { role: role.clone() }));
        assert_eq!(
            Strategy::from_settings(&m(D::StaticQuorum)),
            Some(Strategy::StaticQuorum { quorum_size: 4, role: role.clone() })
        );
        assert_eq!(
            Strategy::from_settings(&m(D::KeepOldest)),
            Some(Strategy::KeepOldest { down_if_alone: false, role })
        );
        assert_eq!(Strategy::from_settings(&m(D::DownAll)), Some(Strategy::DownAll));
    }

    #[test]
    fn keep_majority_with_a_role_no_member_has_breaks_the_tie_by_every_members_address() {
        let km = Strategy::KeepMajority { role: Some("db".into()) };
        // No db member anywhere: 0 against 0, and the lowest address of all (a) decides.
        assert_sides(
            &km,
            &plain(&FIVE),
            &[&["b", "a"], &["c", "d", "e"]],
            &[down(&["c", "d", "e"]), Decision::DownMyself],
        );
    }

    #[test]
    fn static_quorum_keeps_the_side_with_a_quorum_and_downs_the_other() {
        let q3 = Strategy::StaticQuorum { quorum_size: 3, role: None };
        let m = plain(&FIVE);
        assert_sides(&q3, &m, &[&["a", "b", "c"], &["d", "e"]], &[down(&["d", "e"]), Decision::DownMyself]);
        assert_sides(&q3, &m, &[&["a", "b"], &["c", "d", "e"]], &[Decision::DownMyself, down(&["a", "b"])]);
        assert_sides(&q3, &m, &[&["a"], &["b", "c", "d", "e"]], &[Decision::DownMyself, down(&["a"])]);
        // Exactly the quorum after a crash of two: still serving.
        assert_sides(&q3, &m, &[&["a", "b", "c"]], &[down(&["d", "e"])]);
    }

    #[test]
    fn static_quorum_without_a_quorum_on_either_side_stops_both() {
        let q3 = Strategy::StaticQuorum { quorum_size: 3, role: None };
        let m = plain(&["a", "b", "c", "d"]);
        assert_sides(&q3, &m, &[&["a", "b"], &["c", "d"]], &[Decision::DownMyself, Decision::DownMyself]);
        // Two of three crashed: the survivor has no quorum and stops.
        assert_sides(&q3, &plain(&["a", "b", "c"]), &[&["a"]], &[Decision::DownMyself]);
    }

    #[test]
    fn static_quorum_in_a_cluster_larger_than_twice_the_quorum_less_one_downs_every_member() {
        // 4 members with a quorum of 2: a 2|2 split would leave a quorum on both sides.
        let q2 = Strategy::StaticQuorum { quorum_size: 2, role: None };
        let m = plain(&["a", "b", "c", "d"]);
        assert_sides(&q2, &m, &[&["a", "b"], &["c", "d"]], &[Decision::DownAll, Decision::DownAll]);
        assert_sides(&q2, &m, &[&["a", "b", "c"], &["d"]], &[Decision::DownAll, Decision::DownAll]);
        // 3 members is the most a quorum of 2 allows.
        assert_sides(&q2, &plain(&["a", "b", "c"]), &[&["a", "b"], &["c"]], &[down(&["c"]), Decision::DownMyself]);
    }

    #[test]
    fn static_quorum_counts_only_members_with_its_role() {
        let q2 = Strategy::StaticQuorum { quorum_size: 2, role: Some("db".into()) };
        let m: Vec<(&str, &[&str])> = vec![("a", &[]), ("b", &[]), ("c", &["db"]), ("d", &["db"]), ("e", &["db"])];
        // {a, b, c} has more members but one db; {d, e} has two.
        assert_sides(&q2, &m, &[&["a", "b", "c"], &["d", "e"]], &[Decision::DownMyself, down(&["a", "b", "c"])]);
    }

    #[test]
    fn keep_oldest_keeps_the_side_of_the_oldest_member_whatever_its_size() {
        let ko = Strategy::KeepOldest { down_if_alone: true, role: None };
        let m = plain(&FIVE);
        assert_sides(&ko, &m, &[&["a", "b"], &["c", "d", "e"]], &[down(&["c", "d", "e"]), Decision::DownMyself]);
        assert_sides(&ko, &m, &[&["b", "c", "d"], &["a", "e"]], &[Decision::DownMyself, down(&["b", "c", "d"])]);
    }

    #[test]
    fn keep_oldest_with_down_if_alone_lets_the_others_keep_running_without_a_lone_oldest() {
        let m = plain(&FIVE);
        let alone = Strategy::KeepOldest { down_if_alone: true, role: None };
        assert_sides(&alone, &m, &[&["a"], &["b", "c", "d", "e"]], &[Decision::DownMyself, down(&["a"])]);
        // A crashed oldest (silent to everyone) is downed too, and the cluster serves on.
        assert_sides(&alone, &m, &[&["b", "c", "d", "e"]], &[down(&["a"])]);
        let stays = Strategy::KeepOldest { down_if_alone: false, role: None };
        assert_sides(
            &stays,
            &m,
            &[&["a"], &["b", "c", "d", "e"]],
            &[down(&["b", "c", "d", "e"]), Decision::DownMyself],
        );
    }

    #[test]
    fn keep_oldest_in_two_members_keeps_the_oldest_even_alone() {
        // Against a single member, being alone says nothing: the oldest keeps running.
        let ko = Strategy::KeepOldest { down_if_alone: true, role: None };
        assert_sides(&ko, &plain(&["a", "b"]), &[&["a"], &["b"]], &[down(&["b"]), Decision::DownMyself]);
    }

    #[test]
    fn keep_oldest_with_a_role_follows_the_oldest_member_with_that_role() {
        let ko = Strategy::KeepOldest { down_if_alone: false, role: Some("db".into()) };
        let m: Vec<(&str, &[&str])> = vec![("a", &[]), ("b", &[]), ("c", &["db"]), ("d", &["db"]), ("e", &[])];
        assert_sides(&ko, &m, &[&["a", "b"], &["c", "d", "e"]], &[Decision::DownMyself, down(&["a", "b"])]);
        // No member with the role on either side: no side can tell it holds the oldest.
        let none = Strategy::KeepOldest { down_if_alone: false, role: Some("cache".into()) };
        assert_sides(&none, &m, &[&["a", "b"], &["c", "d", "e"]], &[Decision::DownMyself, Decision::DownMyself]);
    }

    #[test]
    fn the_explanation_names_the_role_a_strategy_counts() {
        let km = Strategy::KeepMajority { role: Some("db".into()) };
        let m: Vec<(&str, &[&str])> = vec![("a", &["db"]), ("b", &[]), ("c", &["db"])];
        let t0 = Instant::now();
        let mut r = Resolver::new(km, STABLE, None, t0);
        let view = split_view("a", &m, &["a", "b"]);
        r.decide(&view, t0);
        assert_eq!(r.decide(&view, t0 + STABLE), down(&["c"]));
        assert!(
            r.explain().ends_with("keep-majority: 1 reachable against 1 unreachable members (counting role \"db\")"),
            "{}",
            r.explain()
        );
    }

    #[test]
    fn keep_majority_with_a_role_counts_only_that_roles_members() {
        let km = Strategy::KeepMajority { role: Some("db".into()) };
        let m: Vec<(&str, &[&str])> = vec![("a", &[]), ("b", &[]), ("c", &["db"]), ("d", &["db"]), ("e", &["db"])];
        assert_sides(&km, &m, &[&["a", "b", "c"], &["d", "e"]], &[Decision::DownMyself, down(&["a", "b", "c"])]);
        // A tie among db members goes to the side with the lowest db address (c), not a.
        let m: Vec<(&str, &[&str])> = vec![("a", &[]), ("b", &[]), ("c", &["db"]), ("d", &["db"])];
        assert_sides(&km, &m, &[&["a", "d"], &["b", "c"]], &[Decision::DownMyself, down(&["a", "d"])]);
    }

    #[test]
    fn down_all_downs_every_member_on_every_side_even_for_one_crash() {
        let m = plain(&FIVE);
        assert_sides(&Strategy::DownAll, &m, &[&["a", "b"], &["c", "d", "e"]], &[Decision::DownAll, Decision::DownAll]);
        assert_sides(&Strategy::DownAll, &m, &[&["a", "b", "c", "d"]], &[Decision::DownAll]);
    }

    #[test]
    fn a_losing_side_acts_after_stable_after_of_losing_even_while_its_picture_changes() {
        // 2|3 under static-quorum 3, seen from d: e crashes a second in. d has been losing all
        // along and downs itself on the original schedule.
        let q3 = Strategy::StaticQuorum { quorum_size: 3, role: None };
        let m = plain(&FIVE);
        let t0 = Instant::now();
        let mut r = Resolver::new(q3, STABLE, None, t0);
        assert_eq!(r.decide(&split_view("d", &m, &["d", "e"]), t0), Decision::Wait);
        assert_eq!(r.decide(&split_view("d", &m, &["d"]), t0 + Duration::from_secs(1)), Decision::Wait);
        assert_eq!(r.decide(&split_view("d", &m, &["d"]), t0 + STABLE), Decision::DownMyself);
        assert!(r.explain().contains("static-quorum 3: 1 reachable, 4 unreachable"), "{}", r.explain());
    }

    /// Every split of `n` members into two sides (the first side holds bit-set members).
    fn every_split(n: usize) -> impl Iterator<Item = (Vec<&'static str>, Vec<&'static str>)> {
        const IDS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
        (1..(1u32 << n) - 1).map(move |bits| {
            let on_first = |i: usize| bits & (1 << i) != 0;
            let first = IDS[..n].iter().enumerate().filter(|(i, _)| on_first(*i)).map(|(_, id)| *id).collect();
            let second = IDS[..n].iter().enumerate().filter(|(i, _)| !on_first(*i)).map(|(_, id)| *id).collect();
            (first, second)
        })
    }

    #[test]
    fn no_strategy_ever_keeps_both_sides_of_any_split_of_up_to_six_members() {
        for n in 2..=6 {
            let ids = &["a", "b", "c", "d", "e", "f"][..n];
            let m = plain(ids);
            let strategies = [
                Strategy::KeepMajority { role: None },
                Strategy::StaticQuorum { quorum_size: n / 2 + 1, role: None },
                Strategy::StaticQuorum { quorum_size: 2, role: None },
                Strategy::KeepOldest { down_if_alone: true, role: None },
                Strategy::KeepOldest { down_if_alone: false, role: None },
                Strategy::DownAll,
            ];
            for s in &strategies {
                for (x, y) in every_split(n) {
                    let got = decisions(s, &m, &[&x, &y]);
                    let keeps = |side: &[&str]| side.iter().all(|id| matches!(got[*id], Decision::DownOthers(_)));
                    let stops = |side: &[&str]| {
                        side.iter().all(|id| matches!(got[*id], Decision::DownMyself | Decision::DownAll))
                    };
                    assert!(keeps(&x) || stops(&x), "{s:?} {x:?}|{y:?}: one side decides as one: {got:?}");
                    assert!(keeps(&y) || stops(&y), "{s:?} {x:?}|{y:?}: {got:?}");
                    assert!(!(keeps(&x) && keeps(&y)), "{s:?} {x:?}|{y:?}: both sides keep running: {got:?}");
                    let must_keep_one = matches!(s, Strategy::KeepMajority { .. } | Strategy::KeepOldest { .. });
                    if must_keep_one {
                        assert!(keeps(&x) || keeps(&y), "{s:?} {x:?}|{y:?}: some side keeps running: {got:?}");
                    }
                    if *s == Strategy::DownAll {
                        assert!(got.values().all(|d| *d == Decision::DownAll), "{got:?}");
                    }
                }
            }
        }
    }
}
