//! This node's membership life cycle as a sans-IO state machine: when it turns Up, which Down
//! members are still listed (the down-removal margin), and which downing decisions to publish.
//! The driver reads gossip, feeds it here with `now`, and performs the actions in chitchat.
//!
//! - **Joining → Up.** With no seeds (and not its own first seed) at once. Otherwise once a
//!   live member that is Up or Leaving was seen and two more gossip intervals passed, so the
//!   highest up-number in gossip has arrived; the new up-number is one more than the highest
//!   seen (Lamport style, see the age order in [`super`]). A node that is its own first seed
//!   forms the cluster alone after `seed_node_timeout` without an answer.
//! - **Down-removal margin.** A member seen Down stays listed (as Down) for
//!   `down_removal_margin` after this node first saw it so, then it is dropped from the
//!   snapshot: its shards and singletons move only then, giving it time to stop.
//! - **Downing.** While this node is Up or Leaving, the split-brain strategy decides on each snapshot;
//!   each victim's down mark is published once, and a losing node publishes itself Down.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tracing::{info, warn};

use super::downing::{Decision, Resolver, Strategy};
use super::view::{GossipNode, compute_members, highest_up_number, keys};
use super::{MemberStatus, MembershipSnapshot, UniqueAddress};
use crate::clock::Instant;

/// What the driver publishes in gossip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LifecycleAction {
    /// Set this node's status (and up-number, when turning Up), then read gossip again.
    PublishStatus { status: MemberStatus, up_number: Option<u64> },
    /// Publish down marks for these members.
    PublishDowns(Vec<UniqueAddress>),
    /// A newer incarnation of this node id is in gossip: this one is superseded and stops
    /// (emitted once).
    Superseded(UniqueAddress),
    /// A higher generation of this node id was already in gossip while this incarnation was
    /// still joining: this process started with a generation below its predecessor's (on an
    /// empty data dir, with a clock behind the one the predecessor started under). It stops
    /// (emitted once), and its next start must take a generation above this one.
    GenerationBehind(UniqueAddress),
}

/// Settings of the life cycle.
#[derive(Debug, Clone)]
pub(crate) struct LifecycleSettings {
    /// Seeds other than this node's own gossip address.
    pub has_seeds: bool,
    pub self_is_first_seed: bool,
    pub gossip_interval: Duration,
    pub seed_node_timeout: Duration,
    pub down_removal_margin: Duration,
    /// Which side of a split keeps running, and the resolver's `stable_after`; `None` with
    /// downing off.
    pub downing: Option<(Strategy, Duration)>,
    /// How much longer than `stable_after` an unsettled picture may last before every member
    /// is downed (`None`: never).
    pub down_all_when_unstable: Option<Duration>,
}

/// The life cycle of this node's membership.
#[derive(Debug)]
pub(crate) struct LifecycleCore {
    address: UniqueAddress,
    settings: LifecycleSettings,
    status: MemberStatus,
    started: Instant,
    up_member_seen_at: Option<Instant>,
    downing: Option<Resolver>,
    /// Whether this node already published that it downs everyone.
    downed_all: bool,
    down_seen: HashMap<UniqueAddress, Instant>,
    downs_published: HashSet<UniqueAddress>,
    superseded: bool,
}

impl LifecycleCore {
    pub(crate) fn new(address: UniqueAddress, settings: LifecycleSettings, now: Instant) -> Self {
        LifecycleCore {
            address,
            downing: settings
                .downing
                .clone()
                .map(|(strategy, stable)| Resolver::new(strategy, stable, settings.down_all_when_unstable, now)),
            downed_all: false,
            settings,
            status: MemberStatus::Joining,
            started: now,
            up_member_seen_at: None,
            down_seen: HashMap::new(),
            downs_published: HashSet::new(),
            superseded: false,
        }
    }

    /// This node's own status as last published.
    #[cfg(test)]
    pub(crate) fn status(&self) -> MemberStatus {
        self.status
    }

    /// Records a status this node publishes on request (leaving, exiting, removed).
    pub(crate) fn status_published(&mut self, status: MemberStatus) {
        self.status = status;
    }

    /// Feeds the gossip state at `now`. Returns the snapshot to publish, or `None` when this
    /// node just turned Up (the driver publishes that and reads gossip again).
    pub(crate) fn on_gossip(
        &mut self,
        nodes: &[GossipNode],
        now: Instant,
        out: &mut Vec<LifecycleAction>,
    ) -> Option<MembershipSnapshot> {
        // Two incarnations of one node id must not both act as it (two hosts of its shards and
        // singletons): the older one yields, whether or not the newer one is still alive, since
        // the cluster may already have moved this one's work to it.
        let me = &self.address;
        let newer = nodes.iter().find(|n| n.address.node_id == me.node_id && n.address.generation > me.generation);
        if let (Some(newer), false) = (newer, self.superseded) {
            self.superseded = true;
            if self.status == MemberStatus::Joining {
                // Found before this one joined: the other is this node's predecessor, not a
                // successor (review finding S18); yielding for good would loop at every start.
                warn!(node = %me, predecessor = %newer.address, "this generation is below an earlier incarnation's");
                out.push(LifecycleAction::GenerationBehind(newer.address.clone()));
            } else {
                warn!(node = %me, newer = %newer.address, "superseded by a newer incarnation of this node id");
                out.push(LifecycleAction::Superseded(newer.address.clone()));
            }
        }
        if self.status == MemberStatus::Joining && self.ready_to_be_up(nodes, now) {
            // Saturating: the highest up-number comes from gossip.
            let up = highest_up_number(nodes).saturating_add(1);
            info!(node = %self.address, up_number = up, "member is up");
            self.status = MemberStatus::Up;
            out.push(LifecycleAction::PublishStatus { status: MemberStatus::Up, up_number: Some(up) });
            return None;
        }
        let mut snap = compute_members(&self.address, nodes);
        self.apply_down_removal_margin(&mut snap, now);
        self.run_downing(&snap, now, out);
        Some(snap)
    }

    fn apply_down_removal_margin(&mut self, snap: &mut MembershipSnapshot, now: Instant) {
        let down: HashSet<&UniqueAddress> = snap
            .members
            .iter()
            .filter(|m| m.status == MemberStatus::Down && m.address != self.address)
            .map(|m| &m.address)
            .collect();
        self.down_seen.retain(|a, _| down.contains(a));
        for a in down {
            self.down_seen.entry(a.clone()).or_insert(now);
        }
        let (margin, seen) = (self.settings.down_removal_margin, &self.down_seen);
        snap.members.retain(|m| seen.get(&m.address).is_none_or(|t| now.duration_since(*t) < margin));
    }

    fn run_downing(&mut self, snap: &MembershipSnapshot, now: Instant, out: &mut Vec<LifecycleAction>) {
        if !self.status.is_up_or_leaving() {
            return;
        }
        let Some(resolver) = self.downing.as_mut() else { return };
        match resolver.decide(snap, now) {
            Decision::Wait => {}
            Decision::DownOthers(victims) => {
                let new: Vec<UniqueAddress> =
                    victims.into_iter().filter(|v| !self.downs_published.contains(v)).collect();
                if !new.is_empty() {
                    warn!(node = %self.address, downed = ?new.iter().map(ToString::to_string).collect::<Vec<_>>(), picture = %resolver.explain(), "split-brain resolver: downing unreachable or indirectly connected members");
                    self.downs_published.extend(new.iter().cloned());
                    out.push(LifecycleAction::PublishDowns(new));
                }
            }
            Decision::DownMyself => {
                warn!(node = %self.address, picture = %resolver.explain(), "split-brain resolver: this node is on the losing side or indirectly connected; downing itself");
                self.status = MemberStatus::Down;
                out.push(LifecycleAction::PublishStatus { status: MemberStatus::Down, up_number: None });
            }
            Decision::DownAll if !self.downed_all => {
                self.downed_all = true;
                let others: Vec<UniqueAddress> = snap
                    .members
                    .iter()
                    .filter(|m| m.address != self.address && m.status.counts_for_downing())
                    .map(|m| m.address.clone())
                    .filter(|a| self.downs_published.insert(a.clone()))
                    .collect();
                warn!(node = %self.address, picture = %resolver.explain(), "split-brain resolver: downing every member, this one included");
                if !others.is_empty() {
                    out.push(LifecycleAction::PublishDowns(others));
                }
                self.status = MemberStatus::Down;
                out.push(LifecycleAction::PublishStatus { status: MemberStatus::Down, up_number: None });
            }
            Decision::DownAll => {}
        }
    }

    fn ready_to_be_up(&mut self, nodes: &[GossipNode], now: Instant) -> bool {
        if !self.settings.has_seeds && !self.settings.self_is_first_seed {
            return true;
        }
        let other_up = nodes.iter().any(|n| {
            n.live
                && n.address.node_id != self.address.node_id
                && n.keys
                    .get(keys::STATUS)
                    .and_then(|s| MemberStatus::from_key(s))
                    .is_some_and(MemberStatus::is_up_or_leaving)
        });
        if other_up {
            let seen = *self.up_member_seen_at.get_or_insert(now);
            return now.duration_since(seen) >= self.settings.gossip_interval * 2;
        }
        if self.settings.self_is_first_seed && now.duration_since(self.started) >= self.settings.seed_node_timeout {
            warn!(node = %self.address, "no member answered; forming a new cluster as first seed");
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const GOSSIP: Duration = Duration::from_millis(100);

    fn settings(has_seeds: bool, first_seed: bool, downing: Option<Duration>) -> LifecycleSettings {
        LifecycleSettings {
            has_seeds,
            self_is_first_seed: first_seed,
            gossip_interval: GOSSIP,
            seed_node_timeout: Duration::from_secs(5),
            down_removal_margin: Duration::from_secs(2),
            downing: downing.map(|stable| (Strategy::KeepMajority { role: None }, stable)),
            down_all_when_unstable: None,
        }
    }

    fn node(id: &str, status: &str, up: Option<u64>, live: bool) -> GossipNode {
        let mut keys = BTreeMap::new();
        keys.insert(keys::STATUS.to_string(), status.to_string());
        if let Some(n) = up {
            keys.insert(keys::UP_NUMBER.to_string(), n.to_string());
        }
        keys.insert(keys::MESSAGING.to_string(), "127.0.0.1:1".to_string());
        GossipNode { address: UniqueAddress::new(id, 1), gossip_addr: "127.0.0.1:2".parse().unwrap(), live, keys }
    }

    fn me() -> UniqueAddress {
        UniqueAddress::new("me", 1)
    }

    #[test]
    fn a_newer_incarnation_of_this_node_id_supersedes_it_once_even_if_no_longer_live() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(false, false, None), t0);
        let mut out = Vec::new();
        c.on_gossip(&[node("me", "up", Some(1), true)], t0, &mut out);
        out.clear();
        // Older or other-id incarnations change nothing.
        let mut older = node("me", "up", Some(1), true);
        older.address = UniqueAddress::new("me", 0);
        let other = node("other", "up", Some(2), true);
        c.on_gossip(&[node("me", "up", Some(1), true), older, other], t0, &mut out);
        assert!(out.is_empty(), "{out:?}");
        let mut newer = node("me", "joining", None, false);
        newer.address = UniqueAddress::new("me", 2);
        c.on_gossip(&[node("me", "up", Some(1), true), newer.clone()], t0, &mut out);
        assert_eq!(out, vec![LifecycleAction::Superseded(UniqueAddress::new("me", 2))]);
        out.clear();
        c.on_gossip(&[node("me", "up", Some(1), true), newer], t0, &mut out);
        assert!(out.is_empty(), "emitted once: {out:?}");
    }

    /// Review finding S18: a restart whose generation is below its predecessor's (an empty data
    /// dir and a clock behind) finds the predecessor in gossip while still joining. That is not
    /// a successor to yield to for good: it says its generation is behind (once) and never
    /// turns Up under it.
    #[test]
    fn a_higher_generation_already_in_gossip_while_joining_is_a_generation_behind_not_a_successor() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, false, None), t0);
        let mut predecessor = node("me", "up", Some(1), true);
        predecessor.address = UniqueAddress::new("me", 9);
        let gossip = [node("me", "joining", None, true), predecessor, node("other", "up", Some(2), true)];
        let mut out = Vec::new();
        c.on_gossip(&gossip, t0, &mut out);
        assert_eq!(out, vec![LifecycleAction::GenerationBehind(UniqueAddress::new("me", 9))]);
        out.clear();
        c.on_gossip(&gossip, t0 + Duration::from_secs(5), &mut out);
        assert!(!out.contains(&LifecycleAction::GenerationBehind(UniqueAddress::new("me", 9))), "once: {out:?}");
    }

    #[test]
    fn a_node_without_seeds_turns_up_at_once_with_up_number_one() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(false, false, None), t0);
        let mut out = Vec::new();
        assert!(c.on_gossip(&[node("me", "joining", None, true)], t0, &mut out).is_none());
        assert_eq!(out, vec![LifecycleAction::PublishStatus { status: MemberStatus::Up, up_number: Some(1) }]);
        assert_eq!(c.status(), MemberStatus::Up);
    }

    #[test]
    fn a_joiner_waits_two_gossip_intervals_after_seeing_an_up_member_and_takes_the_next_up_number() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, false, None), t0);
        let nodes = [node("a", "up", Some(7), true), node("me", "joining", None, true)];
        let mut out = Vec::new();
        assert!(c.on_gossip(&nodes, t0, &mut out).is_some());
        assert!(c.on_gossip(&nodes, t0 + GOSSIP, &mut out).is_some());
        assert!(out.is_empty(), "still joining: {out:?}");
        assert!(c.on_gossip(&nodes, t0 + GOSSIP * 2, &mut out).is_none());
        assert_eq!(out, vec![LifecycleAction::PublishStatus { status: MemberStatus::Up, up_number: Some(8) }]);
    }

    #[test]
    fn a_gossiped_up_number_at_its_maximum_does_not_overflow_the_joiner() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, false, None), t0);
        let nodes = [node("a", "up", Some(u64::MAX), true), node("me", "joining", None, true)];
        let mut out = Vec::new();
        c.on_gossip(&nodes, t0, &mut out);
        c.on_gossip(&nodes, t0 + GOSSIP * 2, &mut out);
        assert_eq!(out, vec![LifecycleAction::PublishStatus { status: MemberStatus::Up, up_number: Some(u64::MAX) }]);
    }

    #[test]
    fn an_unreachable_up_member_does_not_let_a_joiner_in() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, false, None), t0);
        let nodes = [node("a", "up", Some(1), false), node("me", "joining", None, true)];
        let mut out = Vec::new();
        c.on_gossip(&nodes, t0 + Duration::from_secs(60), &mut out);
        assert!(out.is_empty());
        assert_eq!(c.status(), MemberStatus::Joining);
    }

    #[test]
    fn the_first_seed_forms_a_cluster_alone_after_the_seed_node_timeout() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, true, None), t0);
        let nodes = [node("me", "joining", None, true)];
        let mut out = Vec::new();
        c.on_gossip(&nodes, t0 + Duration::from_millis(4900), &mut out);
        assert!(out.is_empty());
        c.on_gossip(&nodes, t0 + Duration::from_secs(5), &mut out);
        assert_eq!(out, vec![LifecycleAction::PublishStatus { status: MemberStatus::Up, up_number: Some(1) }]);
    }

    #[test]
    fn a_down_member_stays_listed_for_the_margin_after_first_seen_down() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(false, false, None), t0);
        c.status_published(MemberStatus::Up);
        let nodes = [node("a", "down", Some(1), true), node("b", "up", Some(3), true), node("me", "up", Some(2), true)];
        let listed = |c: &mut LifecycleCore, at| {
            let snap = c.on_gossip(&nodes, at, &mut Vec::new()).unwrap();
            ["a", "b"].map(|id| snap.members.iter().any(|m| m.node_id() == id))
        };
        assert_eq!(listed(&mut c, t0 + Duration::from_secs(10)), [true, true], "a first seen down now");
        assert_eq!(listed(&mut c, t0 + Duration::from_millis(11_900)), [true, true]);
        assert_eq!(listed(&mut c, t0 + Duration::from_secs(12)), [false, true], "a removed after the margin, b stays");
        assert_eq!(listed(&mut c, t0 + Duration::from_secs(60)), [false, true], "an up member is never removed");
    }

    #[test]
    fn keep_majority_publishes_each_victim_once_and_a_loser_downs_itself() {
        let stable = Duration::from_secs(1);
        let t0 = Instant::now();
        let mut winner = LifecycleCore::new(UniqueAddress::new("a", 1), settings(false, false, Some(stable)), t0);
        winner.status_published(MemberStatus::Up);
        let view = [node("a", "up", Some(1), true), node("b", "up", Some(2), true), node("c", "up", Some(3), false)];
        let mut out = Vec::new();
        winner.on_gossip(&view, t0, &mut out);
        winner.on_gossip(&view, t0 + stable, &mut out);
        winner.on_gossip(&view, t0 + stable * 2, &mut out);
        assert_eq!(out, vec![LifecycleAction::PublishDowns(vec![UniqueAddress::new("c", 1)])]);

        let mut loser = LifecycleCore::new(UniqueAddress::new("c", 1), settings(false, false, Some(stable)), t0);
        loser.status_published(MemberStatus::Up);
        let seen_by_c =
            [node("a", "up", Some(1), false), node("b", "up", Some(2), false), node("c", "up", Some(3), true)];
        let mut out = Vec::new();
        loser.on_gossip(&seen_by_c, t0, &mut out);
        loser.on_gossip(&seen_by_c, t0 + stable, &mut out);
        assert_eq!(out, vec![LifecycleAction::PublishStatus { status: MemberStatus::Down, up_number: None }]);
        assert_eq!(loser.status(), MemberStatus::Down);
    }

    #[test]
    fn a_joining_node_never_downs_anyone() {
        let t0 = Instant::now();
        let mut c = LifecycleCore::new(me(), settings(true, false, Some(Duration::from_millis(1))), t0);
        let view = [node("a", "up", Some(1), false), node("me", "joining", None, true)];
        let mut out = Vec::new();
        c.on_gossip(&view, t0, &mut out);
        c.on_gossip(&view, t0 + Duration::from_secs(10), &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn reachability_that_never_settles_downs_every_member_and_this_node_once() {
        let stable = Duration::from_secs(1);
        let t0 = Instant::now();
        let mut s = settings(false, false, Some(stable));
        s.down_all_when_unstable = Some(Duration::from_millis(500));
        let mut c = LifecycleCore::new(UniqueAddress::new("a", 1), s, t0);
        c.status_published(MemberStatus::Up);
        let mut b_reports_c = node("b", "up", Some(2), true);
        b_reports_c.keys.insert(keys::UNREACHABLE.into(), "c#1".into());
        let flaps = [
            vec![node("a", "up", Some(1), true), node("b", "up", Some(2), true), node("c", "up", Some(3), false)],
            vec![node("a", "up", Some(1), true), b_reports_c, node("c", "up", Some(3), true)],
        ];
        let mut out = Vec::new();
        for i in 0..6u32 {
            c.on_gossip(&flaps[i as usize % 2], t0 + Duration::from_millis(250) * i, &mut out);
        }
        assert!(out.is_empty(), "1.25 s: inside stable_after + 500 ms: {out:?}");
        c.on_gossip(&flaps[0], t0 + Duration::from_millis(1_500), &mut out);
        assert_eq!(
            out,
            vec![
                LifecycleAction::PublishDowns(vec![UniqueAddress::new("b", 1), UniqueAddress::new("c", 1)]),
                LifecycleAction::PublishStatus { status: MemberStatus::Down, up_number: None },
            ]
        );
        assert_eq!(c.status(), MemberStatus::Down);
        out.clear();
        c.on_gossip(&flaps[1], t0 + Duration::from_secs(3), &mut out);
        assert!(out.is_empty(), "once: {out:?}");
    }
}
