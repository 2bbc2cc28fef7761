//! What a replica refuses to count: messages from incarnations that left good standing here
//! (downed, removed, replaced), and answers handled after their operation's deadline.
use super::*;
use std::collections::BTreeSet;

/// Members a (this core), b and c, in good standing, every one reachable.
fn three_members(c: &mut ReplicatorCore<u32>, now: Instant) {
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("b"), true), (peer("c"), true)],
        gossip_targets: vec![peer("b"), peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("b", 1), UniqueAddress::new("c", 1)],
        leaving: vec![],
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
fn write_from(from: PeerAddr, key: &str, member: &'static str) -> ReplicatorInput<u32> {
    let mut set = GSet::default();
    set.insert(member);
    let msg = ReplicatorMsg::WriteDelta { op: 1, entries: vec![], values: vec![(key.into(), set.into_data())] };
    ReplicatorInput::Remote { from, msg }
}

#[test]
fn a_write_from_an_incarnation_this_replica_saw_downed_is_neither_merged_nor_acknowledged() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    // b is downed: listed no longer in good standing (the view drops it from the replicas).
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("c"), true)],
        gossip_targets: vec![peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("c", 1)],
        leaving: vec![],
    };
    c.handle(members, now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, peer("b"), "k", "zombie"), "not acknowledged");
    assert!(c.local_value("k").is_none(), "not merged");
    assert_eq!(c.stats.quarantined.load(std::sync::atomic::Ordering::Relaxed), 1);
    // For good: a later view that no longer lists it at all changes nothing.
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("c"), true)],
        gossip_targets: vec![peer("c")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("c", 1)],
        leaving: vec![],
    };
    c.handle(members, now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, peer("b"), "k", "zombie") && c.local_value("k").is_none());
    assert_eq!(
        c.standing.departed.get(&peer("b").address),
        Some(&2),
        "its drops counted (the log warns at powers of two)"
    );
    // A member in good standing is served as before.
    assert!(acknowledges(&mut c, peer("c"), "k", "fine"));
}

#[test]
fn an_older_incarnation_of_a_member_is_dropped_and_one_never_seen_is_served() {
    let mut c = core("a");
    let now = Instant::now();
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("b"), true)],
        gossip_targets: vec![peer("b")],
        standing: vec![UniqueAddress::new("a", 1), UniqueAddress::new("b", 2)],
        leaving: vec![],
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
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, late, 1, &mut out);
    commit_all(&mut c, &mut out);
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(
        matches!(replies[..], [ReplicatorAction::ReplyUpdate { result: Err(Error::ConsistencyTimeout { .. }), .. }]),
        "{out:?}"
    );
    // In time, the same ack completes it.
    let mut out = Vec::new();
    update(&mut c, "k", Consistency::MAJORITY, add("y"), &mut out);
    let op = write_op(&out);
    let in_time = now + Duration::from_millis(999);
    let out = ack_then_commit(&mut c, op, in_time, in_time);
    assert!(out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { result: Ok(_), .. })), "{out:?}");
}

#[test]
fn a_reply_held_for_the_local_commit_past_the_deadline_fails_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    // A durable key: the reply waits for this node's commit.
    let op = update_at(&mut c, "shard-1", "x", now);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(!out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })), "held for the commit: {out:?}");
    // The node paused (or its disk stalled) until the deadline before the commit was reported
    // (at the deadline is late, as for the write itself).
    let late = now + Duration::from_secs(1);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Persisted { through: u64::MAX, failure: None }, late, 0, &mut out);
    assert!(
        out.iter()
            .any(|a| matches!(a, ReplicatorAction::ReplyUpdate { result: Err(Error::ConsistencyTimeout { .. }), .. })),
        "{out:?}"
    );
    assert!(!out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { result: Ok(_), .. })));
    // Reported a millisecond before the deadline, the same reply succeeds.
    let op = update_at(&mut c, "shard-2", "y", now);
    let out = ack_then_commit(&mut c, op, now, now + Duration::from_millis(999));
    assert!(out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { result: Ok(_), .. })), "{out:?}");
}

#[test]
fn a_read_whose_answers_are_handled_after_its_deadline_fails_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    let mut out = Vec::new();
    let get = ReplicatorInput::Get {
        key: "k".into(),
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 3,
    };
    c.handle(get, now, 1, &mut out);
    let (op, _) = read_op(&out);
    let mut out = Vec::new();
    let answer = ReplicatorMsg::ReadResult { op, values: vec![(0, None)] };
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: answer }, now + Duration::from_millis(1_001), 1, &mut out);
    assert!(
        matches!(&out[..], [ReplicatorAction::ReplyGet { reply: 3, result: Err(Error::ConsistencyTimeout { .. }) }]),
        "{out:?}"
    );
}

/// A majority update of `key` with a 1 s timeout, started at `now` (returns the write's op).
fn update_at(c: &mut ReplicatorCore<u32>, key: &str, member: &'static str, now: Instant) -> u64 {
    let mut out = Vec::new();
    let input = ReplicatorInput::Update {
        key: key.into(),
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        modify: add(member),
        reply: 0,
    };
    c.handle(input, now, 1, &mut out);
    write_op(&out)
}

/// b acknowledges write `op` at `acked_at`, and this node's commit is reported at
/// `committed_at`: the actions that follow.
fn ack_then_commit(
    c: &mut ReplicatorCore<u32>,
    op: u64,
    acked_at: Instant,
    committed_at: Instant,
) -> Vec<ReplicatorAction<u32>> {
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, acked_at, 1, &mut out);
    c.handle(ReplicatorInput::Persisted { through: u64::MAX, failure: None }, committed_at, 0, &mut out);
    out
}

/// A hand-over of this node (to the members that stay), within a second.
fn hand_over() -> ReplicatorInput<u32> {
    ReplicatorInput::HandOver { timeout: Duration::from_secs(1), reply: 9 }
}

/// The membership input: replica holders `ids` (`reachable` or not), of which `leaving` leave.
fn holders(c: &mut ReplicatorCore<u32>, ids: &[(&str, bool)], leaving: &[&str], now: Instant) {
    let replicas: Vec<(PeerAddr, bool)> = ids.iter().map(|(id, r)| (peer(id), *r)).collect();
    let gossip_targets = replicas.iter().filter(|(_, r)| *r).map(|(p, _)| p.clone()).collect();
    let leaving = leaving.iter().map(|id| UniqueAddress::new(*id, 1)).collect();
    let input = ReplicatorInput::Members { holder: true, replicas, gossip_targets, standing: vec![], leaving };
    c.handle(input, now, 1, &mut vec![]);
}

/// The ops of the hand-over's parts among `out`, with the keys each carries.
fn hand_over_parts(out: &[ReplicatorAction<u32>]) -> Vec<(u64, Vec<String>)> {
    out.iter()
        .filter_map(|a| match a {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { op, entries, values }, .. }
                if entries.is_empty() =>
            {
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
        Arc::new(ReplicatorStatCells::default()),
    );
    let now = Instant::now();
    three_members(&mut c, now);
    for (key, member) in [("shard-1", "x"), ("shard-2", "y"), ("user-key", "z")] {
        local(&mut c, key, add(member));
    }
    let mut out = Vec::new();
    commit_all(&mut c, &mut out);
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    let parts = hand_over_parts(&out);
    let keys: BTreeSet<String> = parts.iter().flat_map(|(_, k)| k.clone()).collect();
    let every = ["shard-1", "shard-2", "user-key", ROSTER_KEY].map(String::from).into();
    assert_eq!(keys, every, "every value, durable or not, and the roster");
    assert!(parts.len() > 1, "in parts capped in bytes: {parts:?}");
    let replied = |out: &[ReplicatorAction<u32>]| {
        out.iter().find(|a| matches!(a, ReplicatorAction::ReplyUpdate { reply: 9, .. })).is_some()
    };
    // Two staying members: a majority is both. One part acked by both, the others by b only.
    for (i, (op, _)) in parts.iter().enumerate() {
        let mut out = Vec::new();
        c.handle(
            ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op: *op } },
            now,
            1,
            &mut out,
        );
        if i == 0 {
            c.handle(
                ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op: *op } },
                now,
                1,
                &mut out,
            );
        }
        assert!(!replied(&out), "not every part has a majority of the staying members yet");
    }
    let mut out = Vec::new();
    for (op, _) in &parts[1..] {
        c.handle(
            ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op: *op } },
            now,
            1,
            &mut out,
        );
    }
    // Every value is safe: last, this node leaves the roster, written to the same majority.
    assert!(!replied(&out), "not done before its own forget is on a majority");
    let forget = hand_over_parts(&out);
    assert!(matches!(&forget[..], [(_, keys)] if keys == &[ROSTER_KEY.to_string()]), "{out:?}");
    let counted = roster_entries(c.local_value(ROSTER_KEY));
    assert!(counted["a"].forgotten && !counted["b"].forgotten, "{counted:?}");
    let mut out = Vec::new();
    for from in ["b", "c"] {
        let ack = ReplicatorMsg::WriteAck { op: forget[0].0 };
        c.handle(ReplicatorInput::Remote { from: peer(from), msg: ack }, now, 1, &mut out);
    }
    assert!(
        matches!(&out[..], [ReplicatorAction::ReplyUpdate { reply: 9, result: Ok(refused) }] if refused.is_empty()),
        "{out:?}"
    );
}

#[test]
fn a_hand_over_without_a_reachable_majority_of_the_staying_waits_then_fails_and_one_unanswered_times_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    local(&mut c, "shard-1", add("x"));
    // Three stay, one reachable: no majority of them. It waits for the roster or the members
    // to change, and fails at its deadline.
    holders(&mut c, &[("b", true), ("c", false), ("d", false)], &[], now);
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    assert!(out.is_empty(), "waiting: nothing sent, nothing answered: {out:?}");
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now + Duration::from_millis(999), 1, &mut out);
    let started = |a: &ReplicatorAction<u32>| {
        matches!(a, ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { .. }, .. })
    };
    assert!(!out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. }) || started(a)), "{out:?}");
    c.handle(ReplicatorInput::Tick, now + Duration::from_secs(1), 1, &mut out);
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(
        matches!(
            replies[..],
            [ReplicatorAction::ReplyUpdate {
                reply: 9,
                result: Err(Error::NotEnoughReplicas { needed: 2, reachable: 1 })
            }]
        ),
        "{out:?}"
    );
    // Nobody stays (every other holder leaves too): nothing can take it, and nothing waits.
    holders(&mut c, &[("b", true), ("c", true)], &["b", "c"], now);
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    assert!(
        matches!(
            &out[..],
            [ReplicatorAction::ReplyUpdate { result: Err(Error::NotEnoughReplicas { needed: 1, reachable: 0 }), .. }]
        ),
        "{out:?}"
    );
    holders(&mut c, &[("b", true), ("c", true)], &[], now);
    // Reachable, but no answer within the timeout.
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now + Duration::from_millis(999), 1, &mut out);
    assert!(!out.iter().any(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })));
    c.handle(ReplicatorInput::Tick, now + Duration::from_secs(1), 1, &mut out);
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(
        matches!(
            replies[..],
            [ReplicatorAction::ReplyUpdate { reply: 9, result: Err(Error::ConsistencyTimeout { .. }) }]
        ),
        "{out:?}"
    );
}

#[test]
fn a_hand_over_targets_the_up_holders_of_the_view_other_than_this_one_and_counts_the_unreachable() {
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
    let mut c = core("a");
    c.handle(ReplicatorInput::members_of(&snap, None), Instant::now(), 1, &mut vec![]);
    let (to, staying) = c.hand_over_targets();
    assert_eq!(to.iter().map(|p| p.address.node_id.to_string()).collect::<Vec<_>>(), ["b"]);
    let staying: Vec<&str> = staying.iter().map(|a| &*a.node_id).collect();
    assert_eq!(staying, ["b", "c"], "b and c stay; d leaves too, e is not Up yet");
}

/// Seeds 720004905, 730021632 and 770019193: a hand-over fixed to the members of its start
/// timed out while a restarted incarnation of a holder was Up and reachable, so the leaver
/// stayed in the roster and the cluster that remained had no durable majority.
#[test]
fn a_hand_over_goes_on_to_a_holder_that_comes_back_and_counts_one_that_starts_leaving_no_more() {
    let mut c = core("a");
    let now = Instant::now();
    holders(&mut c, &[("b", true), ("c", true), ("d", true), ("e", true)], &[], now);
    local(&mut c, "shard-1", add("x"));
    let mut out = Vec::new();
    commit_all(&mut c, &mut out);
    // Four stay, none reachable: it waits (a staying member may come back).
    holders(&mut c, &[("b", false), ("c", false), ("d", false), ("e", false)], &[], now);
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    assert!(out.is_empty(), "waits: {out:?}");
    // b and c come back: two of four is no majority; d too: the parts go to b, c and d.
    holders(&mut c, &[("b", true), ("c", true), ("d", false), ("e", false)], &[], now);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now, 1, &mut out);
    assert!(hand_over_parts(&out).is_empty(), "{out:?}");
    let mut out = Vec::new();
    tell_replicas(
        &mut c,
        vec![(peer("b"), true), (peer("c"), true), (peer("d"), true), (peer("e"), false)],
        now,
        1,
        &mut out,
    );
    let parts = hand_over_parts(&out);
    assert!(!parts.is_empty(), "started on the membership change: {out:?}");
    let sent_to: BTreeSet<String> = out
        .iter()
        .filter_map(|a| match a {
            ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::WriteDelta { entries, .. } }
                if entries.is_empty() =>
            {
                Some(to.iter().map(|p| p.address.node_id.to_string()).collect::<Vec<_>>())
            }
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(sent_to, ["b", "c", "d"].map(String::from).into());
    // b and c acknowledge every part: two of four staying is no majority.
    let mut out = Vec::new();
    for (op, _) in &parts {
        for from in ["b", "c"] {
            c.handle(
                ReplicatorInput::Remote { from: peer(from), msg: ReplicatorMsg::WriteAck { op: *op } },
                now,
                1,
                &mut out,
            );
        }
    }
    assert!(hand_over_parts(&out).is_empty(), "no forget yet: {out:?}");
    // d starts leaving (its own hand-over carries what it holds) and e comes back: e is sent
    // every part, its values read again; the majority is now counted over b, c and e, and b
    // and c already gave it: this node's forget goes out, to every member addressed.
    let stats = c.stats.clone();
    let values_sent = || stats.full_values_sent.load(std::sync::atomic::Ordering::Relaxed);
    let before = values_sent();
    let mut out = Vec::new();
    c.handle(
        ReplicatorInput::Members {
            holder: true,
            replicas: vec![(peer("b"), true), (peer("c"), true), (peer("d"), true), (peer("e"), true)],
            gossip_targets: vec![],
            standing: vec![],
            leaving: vec![UniqueAddress::new("d", 1)],
        },
        now,
        1,
        &mut out,
    );
    let sent = hand_over_parts(&out);
    let (resent, forget) = sent.split_at(parts.len());
    assert_eq!(resent, &parts[..], "the same parts, with the same keys: {out:?}");
    let resent_values: usize = resent.iter().map(|(_, keys)| keys.len()).sum();
    assert_eq!(values_sent() - before, resent_values as u64, "each resent value counted once, for e alone");
    assert!(matches!(forget, [(_, keys)] if keys == &[ROSTER_KEY.to_string()]), "{out:?}");
    let e_only = out.iter().any(|a| {
        matches!(a, ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::WriteDelta { op, .. } }
            if *op == parts[0].0 && to.len() == 1 && &*to[0].address.node_id == "e")
    });
    assert!(e_only, "the parts go only to the member new to them: {out:?}");
    // The forget on two of b, c, e ends the hand-over.
    let mut out = Vec::new();
    c.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op: forget[0].0 } },
        now,
        1,
        &mut out,
    );
    assert!(out.is_empty(), "one of three: {out:?}");
    c.handle(
        ReplicatorInput::Remote { from: peer("e"), msg: ReplicatorMsg::WriteAck { op: forget[0].0 } },
        now,
        1,
        &mut out,
    );
    assert!(matches!(&out[..], [ReplicatorAction::ReplyUpdate { reply: 9, result: Ok(_) }]), "{out:?}");
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
    let ReplicatorInput::Members { replicas, gossip_targets, standing, holder, leaving } =
        ReplicatorInput::<u32>::members_of(&snap, Some("backend"))
    else {
        panic!("a members input")
    };
    assert!(holder, "a is Up with the role: a replica holder");
    let ReplicatorInput::Members { holder, .. } = ReplicatorInput::<u32>::members_of(&snap, Some("frontend")) else {
        panic!("a members input")
    };
    assert!(!holder, "without the role, not a holder");
    let joining = MembershipSnapshot { self_address: UniqueAddress::new("d", 1), ..snap.clone() };
    let ReplicatorInput::Members { holder, .. } = ReplicatorInput::<u32>::members_of(&joining, Some("backend")) else {
        panic!("a members input")
    };
    assert!(!holder, "d is still Joining: not a holder, though others with the role are");
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
    let leaving: Vec<&str> = leaving.iter().map(|a| &*a.node_id).collect();
    assert_eq!(leaving, ["g"], "the holders that leave");
}

#[test]
fn a_quarantine_is_for_good_and_forgotten_only_once_a_newer_incarnation_of_the_same_node_stands() {
    let mut c = core("a");
    let now = Instant::now();
    let view = |standing: &[(&str, u64)]| ReplicatorInput::Members {
        holder: true,
        replicas: vec![],
        gossip_targets: vec![],
        standing: standing.iter().map(|(id, g)| UniqueAddress::new(*id, *g)).collect(),
        leaving: vec![],
    };
    let b1 = || PeerAddr { address: UniqueAddress::new("b", 1), ..peer("b") };
    c.handle(view(&[("a", 1), ("b", 1), ("c", 1)]), now, 0, &mut vec![]);
    c.handle(view(&[("a", 1), ("c", 1)]), now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, b1(), "k", "x"), "b#1 left good standing");
    // Another node's newer incarnation covers nothing of b's.
    c.handle(view(&[("a", 1), ("c", 5)]), now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, b1(), "k", "x"), "still quarantined");
    // A stale view listing b#1 in good standing again does not lift it.
    c.handle(view(&[("a", 1), ("b", 1), ("c", 5)]), now, 0, &mut vec![]);
    assert!(!acknowledges(&mut c, b1(), "k", "x"), "quarantined for good");
    // Once b#2 stands, b#1's entry is forgotten (the generation rule refuses it from then on).
    c.handle(view(&[("a", 1), ("b", 2), ("c", 5)]), now, 0, &mut vec![]);
    assert!(!c.standing.departed.contains_key(&UniqueAddress::new("b", 1)), "{:?}", c.standing.departed);
    assert!(!acknowledges(&mut c, b1(), "k", "x"), "refused by the newer incarnation");
}

#[test]
fn hand_over_acknowledgements_handled_after_its_deadline_fail_it_as_timed_out() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    local(&mut c, "shard-1", add("x"));
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    let parts = hand_over_parts(&out);
    let late = now + Duration::from_millis(1_001);
    let mut out = Vec::new();
    for from in [peer("b"), peer("c")] {
        for (op, _) in &parts {
            c.handle(
                ReplicatorInput::Remote { from: from.clone(), msg: ReplicatorMsg::WriteAck { op: *op } },
                late,
                1,
                &mut out,
            );
        }
    }
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(
        matches!(
            replies[..],
            [ReplicatorAction::ReplyUpdate { reply: 9, result: Err(Error::ConsistencyTimeout { .. }) }]
        ),
        "{out:?}"
    );
}

#[test]
fn a_hand_over_fills_each_part_up_to_the_message_budget_and_counts_every_value_sent() {
    let keys = ["shard-1", "shard-2", "shard-3", "shard-4", "shard-5", "shard-6"];
    let mut probe = core("a");
    local(&mut probe, keys[0], add("x"));
    // Every key is as long and every value as large: a budget of three holds exactly three.
    let one = keys[0].len() + probe.local_value(keys[0]).expect("value").approx_bytes();
    let mut c = ReplicatorCore::new(
        UniqueAddress::new("a", 1),
        fresh_store("a"),
        CoreSettings { max_message_bytes: 3 * one, ..CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1)) },
        Arc::new(ReplicatorStatCells::default()),
    );
    let now = Instant::now();
    three_members(&mut c, now);
    for key in keys {
        local(&mut c, key, add("x"));
    }
    let sent_before = c.stats.full_values_sent.load(std::sync::atomic::Ordering::Relaxed);
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    let parts = hand_over_parts(&out);
    let shard_parts = parts.iter().filter(|(_, k)| !k.contains(&ROSTER_KEY.to_string()));
    let sizes: Vec<usize> = shard_parts.map(|(_, k)| k.len()).collect();
    assert_eq!(sizes, [3, 3], "parts of three values each (the roster, larger, goes alone): {parts:?}");
    let sent = c.stats.full_values_sent.load(std::sync::atomic::Ordering::Relaxed) - sent_before;
    assert_eq!(sent, 14, "six values and the roster to each of two members");
}

#[test]
fn a_write_acknowledged_in_time_during_a_hand_over_completes_and_leaves_the_hand_over_waiting() {
    let mut c = core("a");
    let now = Instant::now();
    three_members(&mut c, now);
    local(&mut c, "shard-1", add("x"));
    let mut out = Vec::new();
    c.handle(hand_over(), now, 1, &mut out);
    let op = update_at(&mut c, "k", "y", now);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|a| matches!(a, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(matches!(replies[..], [ReplicatorAction::ReplyUpdate { reply: 0, result: Ok(_) }]), "{out:?}");
    assert!(c.hand_over.is_some(), "the hand-over still waits for its own parts");
}
