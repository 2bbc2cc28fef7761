//! What a replica refuses to count: messages from incarnations that left good standing here
//! (downed, removed, replaced), and answers handled after their operation's deadline.
use super::*;
use std::collections::BTreeSet;

/// Members a (this core), b and c, in good standing, every one reachable.
fn three_members(c: &mut ReplicatorCore<u32>, now: Instant) {
    let members = Input::Members {
        replicas: vec![(peer("b"), true), (peer("c"), true)],
        gossip_targets: vec![peer("b"), peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("b", 1), UniqueAddress::new("c", 1)],
    };
    c.handle(members, now, 0, &mut vec![]);
}

/// Whether this core acknowledges `from`'s write of `member` into the G-set at `key` (once
/// committed here).
fn acknowledges(c: &mut ReplicatorCore<u32>, from: PeerAddr, key: &str, member: &'static str) -> bool {
    let mut out = Vec::new();
    c.handle(write_from(from, key, member), Instant::now(), 1, &mut out);
    commit_all(c, &mut out);
    out.iter().any(is_ack)
}

/// A write of `member` into the G-set at `key`, as a peer's majority write carries it.
fn write_from(from: PeerAddr, key: &str, member: &'static str) -> Input<u32> {
    let mut set = GSet::default();
    set.insert(member);
    let msg = ReplicatorMsg::WriteDelta { op: 1, entries: vec![], values: vec![(key.into(), set.into_data())] };
    Input::Remote { from, msg }
}

#[test]
fn a_write_from_an_incarnation_this_replica_saw_downed_is_neither_merged_nor_acknowledged() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    // b is downed: listed no longer in good standing (the view drops it from the replicas).
    let members = Input::Members {
        replicas: vec![(peer("c"), true)],
        gossip_targets: vec![peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("c", 1)],
    };
    c.handle(members, now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, peer("b"), "k", "zombie"), "not acknowledged");
    assert!(c.local_value("k").is_none(), "not merged");
    assert_eq!(c.stats.quarantined.load(std::sync::atomic::Ordering::Relaxed), 1);
    // For good: a later view that no longer lists it at all changes nothing.
    let members = Input::Members {
        replicas: vec![(peer("c"), true)],
        gossip_targets: vec![peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("c", 1)],
    };
    c.handle(members, now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, peer("b"), "k", "zombie") && c.local_value("k").is_none());
    assert_eq!(c.departed.get(&peer("b").address), Some(&2), "its drops counted (the log warns at powers of two)");
    // A member in good standing is served as before.
    assert!(acknowledges(&mut c, peer("c"), "k", "fine"));
}

#[test]
fn an_older_incarnation_of_a_member_is_dropped_and_one_never_seen_is_served() {
    let mut c = core("a");
    let now = Instant::now();
    let members = Input::Members {
        replicas: vec![(peer("b"), true)],
        gossip_targets: vec![peer("b")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("b", 2)],
    };
    c.handle(members, now, 0, &mut vec![]);
    // peer("b") is b#1: b#2 replaced it.
    assert!(!acknowledges(&mut c, peer("b"), "k", "old") && c.local_value("k").is_none(), "b#1 is quarantined");
    // An incarnation gossip has not brought here yet (a joining node) is not refused here:
    // the transport gives it time to appear, then refuses it.
    assert!(acknowledges(&mut c, peer("z"), "k", "new"));
}

#[test]
fn acknowledgements_handled_after_the_write_deadline_fail_it_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    let mut out = Vec::new();
    update(&mut c, "k", Consistency::MAJORITY, add("x"), &mut out);
    let op = write_op(&out);
    // The writer paused past the write's 1 s timeout; the ack waiting in its socket is handled
    // before its first tick.
    let late = now + Duration::from_millis(1_001);
    let mut out = Vec::new();
    c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, late, 1, &mut out);
    commit_all(&mut c, &mut out);
    let replies: Vec<&Action<u32>> = out.iter().filter(|a| matches!(a, Action::ReplyUpdate { .. })).collect();
    assert!(
        matches!(replies[..], [Action::ReplyUpdate { result: Err(Error::ConsistencyTimeout { .. }), .. }]),
        "{out:?}"
    );
    // In time, the same ack completes it.
    let mut out = Vec::new();
    update(&mut c, "k", Consistency::MAJORITY, add("y"), &mut out);
    let op = write_op(&out);
    let mut out = Vec::new();
    let in_time = now + Duration::from_millis(999);
    c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, in_time, 1, &mut out);
    c.handle(Input::Persisted { through: u64::MAX, failure: None }, in_time, 0, &mut out);
    assert!(out.iter().any(|a| matches!(a, Action::ReplyUpdate { result: Ok(_), .. })), "{out:?}");
}

#[test]
fn a_reply_held_for_the_local_commit_past_the_deadline_fails_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    let mut out = Vec::new();
    // A durable key: the reply waits for this node's commit.
    update(&mut c, "shard-1", Consistency::MAJORITY, add("x"), &mut out);
    let op = write_op(&out);
    let mut out = Vec::new();
    c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(!out.iter().any(|a| matches!(a, Action::ReplyUpdate { .. })), "held for the commit: {out:?}");
    // The node paused (or its disk stalled) past the deadline before the commit was reported.
    let late = now + Duration::from_millis(1_001);
    let mut out = Vec::new();
    c.handle(Input::Persisted { through: u64::MAX, failure: None }, late, 0, &mut out);
    assert!(
        out.iter().any(|a| matches!(a, Action::ReplyUpdate { result: Err(Error::ConsistencyTimeout { .. }), .. })),
        "{out:?}"
    );
    assert!(!out.iter().any(|a| matches!(a, Action::ReplyUpdate { result: Ok(_), .. })));
}

#[test]
fn a_read_whose_answers_are_handled_after_its_deadline_fails_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    let mut out = Vec::new();
    let get =
        Input::Get { key: "k".into(), consistency: Consistency::MAJORITY, timeout: Duration::from_secs(1), reply: 3 };
    c.handle(get, now, 1, &mut out);
    let (op, _) = read_op(&out);
    let mut out = Vec::new();
    let answer = ReplicatorMsg::ReadResult { op, values: vec![(0, None)] };
    c.handle(Input::Remote { from: peer("b"), msg: answer }, now + Duration::from_millis(1_001), 1, &mut out);
    assert!(
        matches!(&out[..], [Action::ReplyGet { reply: 3, result: Err(Error::ConsistencyTimeout { .. }) }]),
        "{out:?}"
    );
}

/// A hand-over to members b and c (both staying and reachable).
fn hand_over_to_b_and_c() -> Input<u32> {
    Input::HandOver { to: vec![peer("b"), peer("c")], staying: 2, timeout: Duration::from_secs(1), reply: 9 }
}

/// The ops of the hand-over's parts among `out`, with the keys each carries.
fn hand_over_parts(out: &[Action<u32>]) -> Vec<(u64, Vec<String>)> {
    out.iter()
        .filter_map(|a| match a {
            Action::Broadcast { msg: ReplicatorMsg::WriteDelta { op, entries, values }, .. } if entries.is_empty() => {
                Some((*op, values.iter().map(|(k, _)| k.clone()).collect()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_leaving_node_hands_every_value_over_and_is_done_once_a_majority_of_those_staying_took_every_part() {
    let mut c = ReplicatorCore::new(
        UniqueAddress::new("a", 1),
        fresh_store("a"),
        // Small messages: the values go in several parts.
        CoreSettings { max_message_bytes: 8, ..CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1)) },
        Arc::new(ReplicatorStats::default()),
    );
    let now = Instant::now();
    three_members(&mut c, now);
    for (key, member) in [("shard-1", "x"), ("shard-2", "y"), ("user-key", "z")] {
        local(&mut c, key, add(member));
    }
    let mut out = Vec::new();
    commit_all(&mut c, &mut out);
    let mut out = Vec::new();
    c.handle(hand_over_to_b_and_c(), now, 1, &mut out);
    let parts = hand_over_parts(&out);
    let keys: BTreeSet<String> = parts.iter().flat_map(|(_, k)| k.clone()).collect();
    assert_eq!(keys, ["shard-1", "shard-2", "user-key"].map(String::from).into(), "every value, durable or not");
    assert!(parts.len() > 1, "in parts capped in bytes: {parts:?}");
    let replied =
        |out: &[Action<u32>]| out.iter().find(|a| matches!(a, Action::ReplyUpdate { reply: 9, .. })).is_some();
    // Two staying members: a majority is both. One part acked by both, the others by b only.
    for (i, (op, _)) in parts.iter().enumerate() {
        let mut out = Vec::new();
        c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op: *op } }, now, 1, &mut out);
        if i == 0 {
            c.handle(Input::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op: *op } }, now, 1, &mut out);
        }
        assert!(!replied(&out), "not every part has a majority of the staying members yet");
    }
    let mut out = Vec::new();
    for (op, _) in &parts[1..] {
        c.handle(Input::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op: *op } }, now, 1, &mut out);
    }
    assert!(
        matches!(&out[..], [Action::ReplyUpdate { reply: 9, result: Ok(refused) }] if refused.is_empty()),
        "{out:?}"
    );
}

#[test]
fn a_hand_over_that_cannot_reach_a_majority_of_the_staying_members_fails_at_once_and_one_unanswered_times_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    local(&mut c, "shard-1", add("x"));
    // Three stay, one reachable: no majority of them.
    let mut out = Vec::new();
    let input = Input::HandOver { to: vec![peer("b")], staying: 3, timeout: Duration::from_secs(1), reply: 9 };
    c.handle(input, now, 1, &mut out);
    assert!(
        matches!(&out[..], [Action::ReplyUpdate { reply: 9, result: Err(Error::NotEnoughReplicas { needed: 2, .. }) }]),
        "{out:?}"
    );
    // Nobody stays (every other member leaves too): nothing can take it.
    let mut out = Vec::new();
    c.handle(Input::HandOver { to: vec![], staying: 0, timeout: Duration::from_secs(1), reply: 9 }, now, 1, &mut out);
    assert!(matches!(&out[..], [Action::ReplyUpdate { result: Err(Error::NotEnoughReplicas { .. }), .. }]));
    // Reachable, but no answer within the timeout.
    let mut out = Vec::new();
    c.handle(hand_over_to_b_and_c(), now, 1, &mut out);
    let mut out = Vec::new();
    c.handle(Input::Tick, now + Duration::from_millis(999), 1, &mut out);
    assert!(!out.iter().any(|a| matches!(a, Action::ReplyUpdate { .. })));
    c.handle(Input::Tick, now + Duration::from_secs(1), 1, &mut out);
    let replies: Vec<&Action<u32>> = out.iter().filter(|a| matches!(a, Action::ReplyUpdate { .. })).collect();
    assert!(
        matches!(replies[..], [Action::ReplyUpdate { reply: 9, result: Err(Error::ConsistencyTimeout { .. }) }]),
        "{out:?}"
    );
}

#[test]
fn the_hand_over_input_of_a_view_targets_the_up_members_other_than_this_one_and_counts_the_unreachable() {
    use crate::membership::{Member, MemberStatus, MembershipSnapshot};
    let member = Member::for_test;
    let snap = MembershipSnapshot {
        self_address: UniqueAddress::new("a", 1),
        members: vec![
            member("a", MemberStatus::Leaving, true),
            member("b", MemberStatus::Up, true),
            member("c", MemberStatus::Up, false),
            member("d", MemberStatus::Leaving, true),
            member("e", MemberStatus::Joining, true),
        ],
    };
    let Input::HandOver { to, staying, .. } = Input::hand_over_of(&snap, None, Duration::from_secs(1), 0u32) else {
        panic!("a hand-over")
    };
    assert_eq!(to.iter().map(|p| p.address.node_id.to_string()).collect::<Vec<_>>(), ["b"]);
    assert_eq!(staying, 2, "b and c stay; d leaves too, e is not Up yet");
}

#[test]
fn the_members_input_of_a_view_lists_replicas_gossip_targets_and_the_incarnations_in_good_standing() {
    use crate::membership::{Member, MemberStatus, MembershipSnapshot};
    let with_role = |id: &str, status, reachable| Member {
        roles: vec!["backend".to_string()],
        ..Member::for_test(id, status, reachable)
    };
    let snap = MembershipSnapshot {
        self_address: UniqueAddress::new("a", 1),
        members: vec![
            with_role("a", MemberStatus::Up, true),
            with_role("b", MemberStatus::Up, true),
            with_role("c", MemberStatus::Up, false),
            with_role("d", MemberStatus::Joining, true),
            with_role("e", MemberStatus::Down, true),
            Member::for_test("f", MemberStatus::Up, true),
            with_role("g", MemberStatus::Leaving, true),
        ],
    };
    let Input::Members { replicas, gossip_targets, standing } = Input::<u32>::members_of(&snap, Some("backend")) else {
        panic!("a members input")
    };
    let ids = |peers: Vec<&PeerAddr>| peers.iter().map(|p| p.address.node_id.to_string()).collect::<Vec<_>>();
    let replica_view: Vec<(String, bool)> =
        replicas.iter().map(|(p, reachable)| (p.address.node_id.to_string(), *reachable)).collect();
    assert_eq!(
        replica_view,
        [("b".to_string(), true), ("c".to_string(), false), ("g".to_string(), true)],
        "Up and Leaving with the role, reachable or not, never this node"
    );
    assert_eq!(ids(gossip_targets.iter().collect()), ["b", "d", "g"], "reachable, routable, with the role");
    let standing: Vec<String> = standing.iter().map(|a| a.node_id.to_string()).collect();
    assert_eq!(standing, ["a", "b", "c", "d", "f", "g"], "every listed incarnation but the downed one");
}
