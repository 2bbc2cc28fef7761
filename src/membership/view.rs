//! Pure computation of the member list from gossip state, identical on every node that has the
//! same gossip state.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use super::{Member, MemberStatus, MembershipSnapshot, UniqueAddress};

/// Gossip keys each node publishes about itself.
pub(crate) mod keys {
    pub(crate) const STATUS: &str = "status";
    pub(crate) const UP_NUMBER: &str = "up";
    pub(crate) const ROLES: &str = "roles";
    pub(crate) const MESSAGING: &str = "msg";
    /// The application version it runs ([`crate::app_version::AppVersion`]); absent from older releases.
    pub(crate) const APP_VERSION: &str = "version";
    /// `down:<node_id>#<generation>`: the publishing node downed that incarnation.
    pub(crate) const DOWN_PREFIX: &str = "down:";
    /// The members the publishing node's heartbeats find unreachable: `node#generation`
    /// entries separated by commas (node ids contain neither), empty when it hears everyone.
    pub(crate) const UNREACHABLE: &str = "unreachable";
}

/// Entries of one observer's [`keys::UNREACHABLE`] list that are read; the rest is ignored (an
/// observer watches `failure_detector.monitored_by` members, at most this many).
pub(crate) const MAX_VERDICTS_PER_OBSERVER: usize = 64;

/// Encodes an observer's unreachable list for gossip.
pub(crate) fn encode_unreachable<'a>(subjects: impl IntoIterator<Item = &'a UniqueAddress>) -> String {
    subjects.into_iter().take(MAX_VERDICTS_PER_OBSERVER).map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// Parses an observer's unreachable list: malformed entries are skipped and at most
/// [`MAX_VERDICTS_PER_OBSERVER`] are read (gossip is authenticated, but a bug or a hostile
/// member must not make every node parse an unbounded list).
pub(crate) fn decode_unreachable(value: &str) -> impl Iterator<Item = UniqueAddress> + '_ {
    value.split(',').take(MAX_VERDICTS_PER_OBSERVER).filter_map(|e| {
        let (node, generation) = e.split_once('#')?;
        let generation = generation.parse().ok()?;
        (!node.is_empty()).then(|| UniqueAddress::new(node, generation))
    })
}

/// What gossip knows about one node incarnation.
#[derive(Debug, Clone)]
pub struct GossipNode {
    /// The incarnation.
    pub address: UniqueAddress,
    /// Its gossip address.
    pub gossip_addr: SocketAddr,
    /// Whether chitchat's failure detector considers it alive.
    pub live: bool,
    /// Its published keys.
    pub keys: BTreeMap<String, String>,
}

/// Builds the member list (oldest first) from gossip state.
///
/// - only the newest generation of a node id counts (a restart supersedes the old incarnation);
/// - `removed` members, and `exiting`/`down` members that are no longer alive, are dropped;
/// - nodes whose keys are not yet complete are not listed;
/// - an incarnation that any node marked down (`down:<node>#<generation>`) is Down.
pub fn compute_members(self_address: &UniqueAddress, nodes: &[GossipNode]) -> MembershipSnapshot {
    let downed: std::collections::HashSet<&str> =
        nodes.iter().flat_map(|n| n.keys.keys().filter_map(|k| k.strip_prefix(keys::DOWN_PREFIX))).collect();
    let mut newest: BTreeMap<&str, &GossipNode> = BTreeMap::new();
    for n in nodes {
        let slot = newest.entry(&n.address.node_id).or_insert(n);
        if n.address.generation > slot.address.generation {
            *slot = n;
        }
    }
    let mut members: Vec<Member> = newest
        .values()
        .filter_map(|n| {
            let is_self = n.address == *self_address;
            let mut status = MemberStatus::from_key(n.keys.get(keys::STATUS)?)?;
            if status != MemberStatus::Removed && downed.contains(n.address.to_string().as_str()) {
                status = MemberStatus::Down;
            }
            let messaging_addr: SocketAddr = n.keys.get(keys::MESSAGING)?.parse().ok()?;
            let live = is_self || n.live;
            let gone = match status {
                MemberStatus::Removed => true,
                // Down members stay listed until the driver's removal margin has passed.
                MemberStatus::Exiting => !live,
                _ => false,
            };
            if gone {
                return None;
            }
            let up_number = n.keys.get(keys::UP_NUMBER).and_then(|s| s.parse().ok());
            let roles = n
                .keys
                .get(keys::ROLES)
                .map(|r| r.split(',').filter(|s| !s.is_empty()).map(String::from).collect())
                .unwrap_or_default();
            // A version that does not parse (a peer's bug) counts as the oldest.
            let app_version = n
                .keys
                .get(keys::APP_VERSION)
                .and_then(|v| crate::app_version::AppVersion::parse(v).ok())
                .unwrap_or_default();
            Some(Member {
                address: n.address.clone(),
                status,
                up_number: if status == MemberStatus::Joining { None } else { up_number },
                roles,
                app_version,
                reachable: live,
                gossip_live: live,
                unreachable_by: Vec::new(),
                messaging_addr,
                gossip_addr: n.gossip_addr,
            })
        })
        .collect();
    apply_reachability_table(&mut members, |observer| {
        let node = newest.get(&*observer.node_id).filter(|n| n.address == *observer)?;
        Some(decode_unreachable(node.keys.get(keys::UNREACHABLE)?))
    });
    members.sort_by(|a, b| a.age_key().cmp(&b.age_key()));
    MembershipSnapshot { self_address: self_address.clone(), members }
}

/// Merges the observers' verdicts into the members: a member is unreachable when gossip lost it
/// or when any observer that is Up or Leaving and alive in gossip says so. Observers that are
/// not alive do not count: a crashed observer's last verdicts are stale, and counting them
/// would let one dead node make its subjects unreachable for ever. `verdicts_of(observer)` is
/// the list the observer published (the rule is the same wherever the lists come from: gossip
/// here, the simulation's model of it in the test kit).
pub(crate) fn apply_reachability_table<I: IntoIterator<Item = UniqueAddress>>(
    members: &mut [Member],
    verdicts_of: impl Fn(&UniqueAddress) -> Option<I>,
) {
    let counted: Vec<UniqueAddress> =
        members.iter().filter(|m| m.gossip_live && m.status.is_up_or_leaving()).map(|m| m.address.clone()).collect();
    for observer in counted {
        let Some(list) = verdicts_of(&observer) else { continue };
        for subject in list {
            if let Some(m) = members.iter_mut().find(|m| m.address == subject && m.address != observer) {
                m.unreachable_by.push(observer.clone());
            }
        }
    }
    for m in members {
        m.unreachable_by.sort();
        m.unreachable_by.dedup();
        m.reachable = m.gossip_live && m.unreachable_by.is_empty();
    }
}

/// The highest up-number in gossip, over every node and generation (live or dead).
pub(crate) fn highest_up_number(nodes: &[GossipNode]) -> u64 {
    nodes.iter().filter_map(|n| n.keys.get(keys::UP_NUMBER)?.parse::<u64>().ok()).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, generation: u64, status: &str, up: Option<u64>, live: bool) -> GossipNode {
        let mut keys = BTreeMap::new();
        keys.insert(keys::STATUS.to_string(), status.to_string());
        keys.insert(keys::MESSAGING.to_string(), "127.0.0.1:1".to_string());
        keys.insert(keys::ROLES.to_string(), "a,b".to_string());
        if let Some(u) = up {
            keys.insert(keys::UP_NUMBER.to_string(), u.to_string());
        }
        GossipNode {
            address: UniqueAddress::new(id, generation),
            gossip_addr: "127.0.0.1:2".parse().unwrap(),
            live,
            keys,
        }
    }

    #[test]
    fn members_are_ordered_by_up_number_then_node_id_and_joining_last() {
        let me = UniqueAddress::new("a", 1);
        let nodes = vec![
            node("c", 5, "up", Some(1), true),
            node("a", 1, "joining", None, true),
            node("b", 9, "up", Some(1), true),
            node("d", 2, "up", Some(2), true),
        ];
        let s = compute_members(&me, &nodes);
        let ids: Vec<_> = s.members.iter().map(|m| m.node_id()).collect();
        assert_eq!(ids, ["b", "c", "d", "a"]);
        assert_eq!(s.oldest(None).unwrap().node_id(), "b");
        assert_eq!(s.members[0].roles(), ["a", "b"]);
    }

    #[test]
    fn a_members_app_version_comes_from_gossip_and_a_missing_or_malformed_one_counts_as_zero() {
        let me = UniqueAddress::new("a", 1);
        let mut nodes = vec![node("a", 1, "up", Some(1), true), node("b", 1, "up", Some(2), true)];
        nodes.push(node("c", 1, "up", Some(3), true));
        nodes[0].keys.insert(keys::APP_VERSION.to_string(), "2.1.0".to_string());
        nodes[1].keys.insert(keys::APP_VERSION.to_string(), "not a version".to_string());
        let s = compute_members(&me, &nodes);
        let versions: Vec<String> = s.members.iter().map(|m| m.app_version().to_string()).collect();
        assert_eq!(versions, ["2.1.0", "0.0.0", "0.0.0"]);
    }

    #[test]
    fn only_listed_live_incarnations_may_send_frames() {
        use crate::membership::PeerStanding;
        let me = UniqueAddress::new("a", 1);
        let nodes = vec![
            node("a", 1, "up", Some(1), true),
            node("b", 5, "up", Some(2), true),
            node("c", 3, "joining", None, true),
            node("d", 4, "down", Some(3), true),
        ];
        let s = compute_members(&me, &nodes);
        assert_eq!(s.standing_of(&UniqueAddress::new("b", 5)), PeerStanding::Member);
        assert_eq!(s.standing_of(&UniqueAddress::new("c", 3)), PeerStanding::Member, "a joining member talks too");
        assert_eq!(s.standing_of(&me), PeerStanding::Member);
        assert!(matches!(s.standing_of(&UniqueAddress::new("d", 4)), PeerStanding::Gone(_)), "downed");
        assert!(matches!(s.standing_of(&UniqueAddress::new("b", 4)), PeerStanding::Gone(_)), "superseded");
        assert_eq!(s.standing_of(&UniqueAddress::new("b", 6)), PeerStanding::Unknown, "a newer one not yet gossiped");
        assert_eq!(s.standing_of(&UniqueAddress::new("z", 1)), PeerStanding::Unknown);
    }

    #[test]
    fn newer_generation_supersedes_older_incarnation() {
        let me = UniqueAddress::new("a", 1);
        let nodes = vec![node("b", 1, "up", Some(1), false), node("b", 2, "up", Some(3), true)];
        let s = compute_members(&me, &nodes);
        assert_eq!(s.members.len(), 1);
        assert_eq!(s.members[0].address().generation, 2);
        assert_eq!(highest_up_number(&nodes), 3);
    }

    #[test]
    fn a_down_mark_from_any_node_makes_the_member_down() {
        let me = UniqueAddress::new("a", 1);
        let mut a = node("a", 1, "up", Some(1), true);
        a.keys.insert(format!("{}b#1", keys::DOWN_PREFIX), "1".into());
        let nodes = vec![a, node("b", 1, "up", Some(2), false), node("c", 1, "up", Some(3), true)];
        let s = compute_members(&me, &nodes);
        assert_eq!(s.member("b").unwrap().status(), MemberStatus::Down);
        assert_eq!(s.member("c").unwrap().status(), MemberStatus::Up);
        assert_eq!(s.up_members(None).count(), 2, "Down members do not count for majorities");
    }

    #[test]
    fn removed_and_dead_exiting_members_are_not_listed_but_unreachable_up_members_are() {
        let me = UniqueAddress::new("a", 1);
        let nodes = vec![
            node("b", 1, "removed", Some(1), true),
            node("c", 1, "exiting", Some(2), false),
            node("d", 1, "up", Some(3), false),
            node("e", 1, "bogus", Some(4), true),
        ];
        let s = compute_members(&me, &nodes);
        assert_eq!(s.members.len(), 1);
        assert_eq!(s.members[0].node_id(), "d");
        assert!(!s.members[0].is_reachable());
    }

    #[test]
    fn only_up_or_leaving_observers_alive_in_gossip_count_and_nobody_reports_itself() {
        let me = UniqueAddress::new("a", 1);
        let reporter = |id: &str, status: &str, live: bool, list: &str| {
            let mut n = node(id, 1, status, Some(1), live);
            n.keys.insert(keys::UNREACHABLE.into(), list.into());
            n
        };
        let nodes = vec![
            reporter("a", "up", true, ""),
            reporter("b", "leaving", true, "e#1"),
            reporter("c", "joining", true, "e#1,f#1"),
            reporter("d", "down", true, "f#1"),
            reporter("e", "up", true, "e#1"),
            reporter("f", "up", true, "g#1"),
            node("g", 1, "up", Some(1), true),
        ];
        let s = compute_members(&me, &nodes);
        assert_eq!(s.observed_unreachable_by(&UniqueAddress::new("e", 1)), [UniqueAddress::new("b", 1)]);
        assert!(s.observed_unreachable_by(&UniqueAddress::new("f", 1)).is_empty(), "joining and down observers");
        assert!(!s.member("g").unwrap().is_reachable(), "f is up and alive: its report counts");
        assert!(s.member("f").unwrap().is_reachable());
    }

    #[test]
    fn an_unreachable_list_is_read_up_to_its_cap_and_malformed_entries_are_skipped() {
        let subjects: Vec<UniqueAddress> = (0..100).map(|i| UniqueAddress::new(format!("n{i}"), 7)).collect();
        let encoded = encode_unreachable(&subjects);
        let decoded: Vec<UniqueAddress> = decode_unreachable(&encoded).collect();
        assert_eq!(decoded, subjects[..MAX_VERDICTS_PER_OBSERVER]);
        let odd: Vec<UniqueAddress> = decode_unreachable("a#1,#2,b#x,,c,d#18446744073709551615,e#1#2").collect();
        assert_eq!(odd, [UniqueAddress::new("a", 1), UniqueAddress::new("d", u64::MAX)]);
        let long = "x#1,".repeat(1_000_000);
        assert_eq!(decode_unreachable(&long).count(), MAX_VERDICTS_PER_OBSERVER, "a huge list costs the cap");
        assert_eq!(decode_unreachable("").count(), 0);
    }

    #[test]
    fn a_new_observer_of_an_unreachable_member_is_an_event_and_the_member_carries_its_observers() {
        use crate::membership::{MemberEvent, diff_snapshots};
        let me = UniqueAddress::new("a", 1);
        let with = |reporters: &[&str]| {
            let mut nodes: Vec<GossipNode> =
                ["a", "b", "c"].iter().map(|id| node(id, 1, "up", Some(1), true)).collect();
            for n in &mut nodes {
                if reporters.contains(&&*n.address.node_id) {
                    n.keys.insert(keys::UNREACHABLE.into(), "d#1".into());
                }
            }
            nodes.push(node("d", 1, "up", Some(2), true));
            compute_members(&me, &nodes)
        };
        let (none, one, two) = (with(&[]), with(&["b"]), with(&["b", "c"]));
        let ev = diff_snapshots(&none, &one);
        assert!(
            matches!(&ev[..], [MemberEvent::Unreachable(m)] if m.observed_unreachable_by() == [UniqueAddress::new("b", 1)]),
            "{ev:?}"
        );
        let ev = diff_snapshots(&one, &two);
        assert!(
            matches!(&ev[..], [MemberEvent::ObserversChanged(m)] if m.observed_unreachable_by().len() == 2),
            "{ev:?}"
        );
        assert!(matches!(&diff_snapshots(&two, &none)[..], [MemberEvent::Reachable(_)]));
    }
}
