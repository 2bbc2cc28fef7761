//! What a replica refuses to count: messages from incarnations that left good standing here
//! (downed, removed, replaced), and answers handled after their operation's deadline.
use super::*;

/// Members a (this core), b and c, in good standing, every one reachable.
fn three_members(c: &mut ReplicatorCore<u32>, now: Instant) {
    let members = Input::Members {
        replicas: vec![(peer("b"), true), (peer("c"), true)],
        gossip_targets: vec![peer("b"), peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("b", 1), UniqueAddress::new("c", 1)],
    };
    c.handle(members, now, 0, &mut vec![]);
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
    let mut out = Vec::new();
    c.handle(write_from(peer("b"), "k", "zombie"), now, 1, &mut out);
    commit_all(&mut c, &mut out);
    assert!(!out.iter().any(is_ack), "not acknowledged: {out:?}");
    assert!(c.local_value("k").is_none(), "not merged");
    assert_eq!(c.stats.quarantined.load(std::sync::atomic::Ordering::Relaxed), 1);
    // For good: a later view that no longer lists it at all changes nothing.
    let members = Input::Members {
        replicas: vec![(peer("c"), true)],
        gossip_targets: vec![peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("c", 1)],
    };
    c.handle(members, now, 0, &mut vec![]);
    let mut out = Vec::new();
    c.handle(write_from(peer("b"), "k", "zombie"), now, 1, &mut out);
    assert!(out.is_empty() && c.local_value("k").is_none());
    // A member in good standing is served as before.
    let mut out = Vec::new();
    c.handle(write_from(peer("c"), "k", "fine"), now, 1, &mut out);
    commit_all(&mut c, &mut out);
    assert!(out.iter().any(is_ack), "{out:?}");
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
    let mut out = Vec::new();
    // peer("b") is b#1: b#2 replaced it.
    c.handle(write_from(peer("b"), "k", "old"), now, 1, &mut out);
    assert!(out.is_empty() && c.local_value("k").is_none(), "b#1 is quarantined: {out:?}");
    // An incarnation gossip has not brought here yet (a joining node) is not refused here:
    // the transport gives it time to appear, then refuses it.
    let mut out = Vec::new();
    c.handle(write_from(peer("z"), "k", "new"), now, 1, &mut out);
    commit_all(&mut c, &mut out);
    assert!(out.iter().any(is_ack), "{out:?}");
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
