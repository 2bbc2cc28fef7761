//! The roster durable quorums are counted over: who enters it, who leaves it, and what a
//! durable write or claim needs once downing has shrunk the membership.
use super::*;

/// Replica holders `ids` (generation 1 unless given as `id#g`), `reachable` or not.
fn holders(ids: &[&str], reachable: bool) -> Vec<(PeerAddr, bool)> {
    ids.iter()
        .map(|id| {
            let (id, generation) = id.split_once('#').map_or((*id, 1), |(i, g)| (i, g.parse().unwrap()));
            let p = PeerAddr {
                address: UniqueAddress::new(id, generation),
                messaging_addr: "127.0.0.1:1".parse().unwrap(),
            };
            (p, reachable)
        })
        .collect()
}

fn members(c: &mut ReplicatorCore<u32>, replicas: Vec<(PeerAddr, bool)>, now: Instant) {
    members_as(c, replicas, true, now);
}

/// The membership input, with this node a replica holder or not.
fn members_as(c: &mut ReplicatorCore<u32>, replicas: Vec<(PeerAddr, bool)>, holder: bool, now: Instant) {
    members_leaving(c, replicas, holder, &[], now);
}

/// The membership input, of which the holders `leaving` leave.
fn members_leaving(
    c: &mut ReplicatorCore<u32>,
    replicas: Vec<(PeerAddr, bool)>,
    holder: bool,
    leaving: &[&str],
    now: Instant,
) {
    let gossip_targets = replicas.iter().filter(|(_, r)| *r).map(|(p, _)| p.clone()).collect();
    let leaving = leaving.iter().map(|id| UniqueAddress::new(*id, 1)).collect();
    c.handle(
        ReplicatorInput::Members { holder, replicas, gossip_targets, standing: vec![], leaving },
        now,
        1,
        &mut vec![],
    );
}

fn counted(c: &ReplicatorCore<u32>) -> Vec<(String, u64)> {
    roster_entries(c.local_value(ROSTER_KEY))
        .into_iter()
        .filter(|(_, e)| !e.forgotten)
        .map(|(id, e)| (id, e.generation))
        .collect()
}

/// The outcome of a majority write of `key` (`None`: waiting for acks).
fn majority_write(c: &mut ReplicatorCore<u32>, key: &str) -> Option<Result<()>> {
    let mut out = Vec::new();
    update(c, key, Consistency::MAJORITY, add("x"), &mut out);
    out.into_iter().find_map(|a| match a {
        ReplicatorAction::ReplyUpdate { result, .. } => Some(result.map(|_| ())),
        _ => None,
    })
}

/// A read of `shard-t/1/0` at `consistency` (reply 5) started on `c`: its op.
fn start_read(
    c: &mut ReplicatorCore<u32>,
    consistency: Consistency,
    now: Instant,
) -> (u64, Vec<ReplicatorAction<u32>>) {
    let mut out = Vec::new();
    let read = ReplicatorInput::GetMany {
        keys: vec!["shard-t/1/0".into()],
        consistency,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    c.handle(read, now, 1, &mut out);
    let op = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::Read { op, .. }, .. } => Some(*op),
            _ => None,
        })
        .unwrap_or(0);
    (op, out)
}

/// `from`'s answer to read `op`: nothing at its one key.
fn empty_answer(op: u64, from: &str) -> ReplicatorInput<u32> {
    ReplicatorInput::Remote { from: peer(from), msg: ReplicatorMsg::ReadResult { op, values: vec![(0, None)] } }
}

/// Whether `out` answers read 5.
fn read_answered(out: &[ReplicatorAction<u32>]) -> bool {
    out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { reply: 5, result: Ok(_) }))
}

fn with_forget_after(id: &str, after: Duration) -> ReplicatorCore<u32> {
    ReplicatorCore::new(
        UniqueAddress::new(id, 1),
        fresh_store(id),
        CoreSettings {
            forget_absent_after: Some(after),
            ..CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1))
        },
        Arc::new(ReplicatorStatCells::default()),
    )
}

#[test]
fn seed_520000593_a_durable_write_after_downing_removed_three_of_five_holders_still_needs_three() {
    let mut a = core("a");
    let now = Instant::now();
    members(&mut a, holders(&["b", "c", "d", "e"], true), now);
    assert_eq!(counted(&a).len(), 5);
    // c, d and e are downed and removed: a and b are the whole membership.
    members(&mut a, holders(&["b"], true), now);
    assert!(
        matches!(
            majority_write(&mut a, "shard-t/1/0"),
            Some(Err(Error::NotEnoughReplicas { needed: 3, reachable: 2 }))
        ),
        "a majority of the five holders, not of the two members left"
    );
    // A key that is not durable is counted over the members now, as before.
    assert!(majority_write(&mut a, "user-key").is_none(), "waits for b: two of two");
    // A claim's read (every reachable replica, at least a majority) is refused the same way.
    let mut out = Vec::new();
    let claim = ReplicatorInput::GetMany {
        keys: vec!["shard-t/1/0".into()],
        consistency: Consistency::AllReachable { plus: 0, min_cap: 0 },
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    a.handle(claim, now, 1, &mut out);
    assert!(
        matches!(
            &out[..],
            [ReplicatorAction::ReplyGetMany { result: Err(Error::NotEnoughReplicas { needed: 3, .. }), .. }]
        ),
        "{out:?}"
    );
    // c restarts on its disk (a new incarnation of the same node id): three of five again.
    members(&mut a, holders(&["b", "c#2"], true), now);
    assert!(majority_write(&mut a, "shard-t/1/0").is_none(), "sent, waiting for two acks");
    assert_eq!(counted(&a).len(), 5, "c counts once, in its newest generation: {:?}", counted(&a));
    assert!(counted(&a).contains(&("c".to_string(), 2)));
}

#[test]
fn a_holder_learned_only_from_a_peers_roster_counts_in_the_quorum() {
    // b knew d (since downed and removed); a joined later and never saw it in the membership.
    let mut b = core("b");
    let now = Instant::now();
    members(&mut b, holders(&["a", "c", "d"], true), now);
    members(&mut b, holders(&["a", "c"], true), now);
    let mut a = core("a");
    members(&mut a, holders(&["b", "c"], true), now);
    assert_eq!(a.roster_size(), 3);
    let theirs = b.local_value(ROSTER_KEY).cloned().expect("b's roster");
    a.merge_in(ROSTER_KEY, theirs, &mut vec![]).expect("merges");
    assert_eq!(a.roster_size(), 4, "d's disk counts: a majority is three of four");
}

#[test]
fn an_unreachable_member_counts_in_the_roster_and_an_absent_one_keeps_counting_until_forgotten() {
    let mut a = with_forget_after("a", Duration::from_secs(60));
    let now = Instant::now();
    members(&mut a, holders(&["b", "c", "d", "e"], true), now);
    // d is unreachable (still a member), e is downed and gone.
    let mut now_members = holders(&["b", "c"], true);
    now_members.extend(holders(&["d"], false));
    members(&mut a, now_members.clone(), now);
    a.handle(ReplicatorInput::Tick, now + Duration::from_secs(59), 1, &mut vec![]);
    assert_eq!(a.roster_size(), 5, "absent for 59 s of 60: e still counts");
    let gauges = |a: &ReplicatorCore<u32>| {
        use std::sync::atomic::Ordering::Relaxed;
        (a.stats.roster_holders.load(Relaxed), a.stats.roster_absent.load(Relaxed))
    };
    assert_eq!(gauges(&a), (5, 1), "five holders, e absent");
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, now + Duration::from_secs(60), 1, &mut out);
    assert_eq!(a.roster_size(), 4, "absent for 60 s: e is forgotten; d, unreachable but a member, is not");
    assert!(roster_entries(a.local_value(ROSTER_KEY))["e"].forgotten);
    assert_eq!(gauges(&a), (4, 0));
    let spread = out.iter().any(|x| match x {
        ReplicatorAction::Broadcast { msg: ReplicatorMsg::DeltaPropagation { entries }, .. } => {
            entries.iter().any(|(k, _)| k == ROSTER_KEY)
        }
        _ => false,
    });
    assert!(spread, "the forget spreads with the tick's deltas: {out:?}");
}

#[test]
fn absent_holders_are_forgotten_one_per_tick_longest_absent_first() {
    let mut a = with_forget_after("a", Duration::from_secs(60));
    let now = Instant::now();
    members(&mut a, holders(&["b", "c", "d"], true), now);
    members(&mut a, holders(&["c", "d"], true), now);
    members(&mut a, holders(&["d"], true), now + Duration::from_secs(5));
    let later = now + Duration::from_secs(120);
    a.handle(ReplicatorInput::Tick, later, 1, &mut vec![]);
    let forgotten = |a: &ReplicatorCore<u32>| {
        roster_entries(a.local_value(ROSTER_KEY))
            .into_iter()
            .filter(|(_, e)| e.forgotten)
            .map(|(id, _)| id)
            .collect::<Vec<_>>()
    };
    assert_eq!(forgotten(&a), ["b"], "one change at a time: b, absent the longest");
    a.handle(ReplicatorInput::Tick, later, 1, &mut vec![]);
    assert_eq!(forgotten(&a), ["b", "c"]);
    a.handle(ReplicatorInput::Tick, later, 1, &mut vec![]);
    assert_eq!(forgotten(&a), ["b", "c"], "d is a member: never forgotten automatically");
}

#[test]
fn without_forget_absent_after_an_absent_holder_counts_until_an_operator_forgets_it() {
    let mut a = core("a");
    let now = Instant::now();
    members(&mut a, holders(&["b", "c"], true), now);
    members(&mut a, holders(&["b"], true), now);
    a.handle(ReplicatorInput::Tick, now + Duration::from_secs(365 * 24 * 3600), 1, &mut vec![]);
    assert_eq!(a.roster_size(), 3, "no automatic forget");
    let forget = |a: &mut ReplicatorCore<u32>, id: &str| {
        let mut out = Vec::new();
        a.handle(ReplicatorInput::Forget { node_id: id.into(), reply: 1 }, now, 1, &mut out);
        let mut replies = out.iter().filter_map(|x| match x {
            ReplicatorAction::ReplyUpdate { result, .. } => {
                Some(result.as_ref().map(|_| ()).map_err(|e| e.to_string()))
            }
            _ => None,
        });
        let reply = replies.next().expect("a reply");
        assert!(replies.next().is_none(), "one reply: {out:?}");
        reply
    };
    assert!(matches!(forget(&mut a, "a"), Err(e) if e.contains("this node")));
    assert!(matches!(forget(&mut a, "b"), Err(e) if e.contains("replica holder now")));
    assert!(matches!(forget(&mut a, "z"), Err(e) if e.contains("not counted")));
    assert_eq!(forget(&mut a, "c"), Ok(()));
    assert_eq!(a.roster_size(), 2);
    assert!(matches!(forget(&mut a, "c"), Err(e) if e.contains("not counted")), "once");
}

#[test]
fn a_forgotten_incarnation_is_not_added_again_by_a_stale_view_but_its_next_start_is() {
    let mut a = core("a");
    let now = Instant::now();
    members(&mut a, holders(&["b", "c"], true), now);
    members(&mut a, holders(&["b"], true), now);
    a.handle(ReplicatorInput::Forget { node_id: "c".into(), reply: 1 }, now, 1, &mut vec![]);
    // A peer's old roster, from before the forget, merges in: the forget (written later) wins.
    let mut old = core("b");
    members(&mut old, holders(&["a", "c"], true), now);
    let stale = old.local_value(ROSTER_KEY).cloned().expect("roster");
    a.merge_in(ROSTER_KEY, stale, &mut vec![]).expect("merges");
    assert_eq!(a.roster_size(), 2, "c stays forgotten");
    // A view that still lists c#1 does not bring it back.
    members(&mut a, holders(&["b", "c"], true), now);
    assert!(roster_entries(a.local_value(ROSTER_KEY))["c"].forgotten);
    // c's next start does.
    members(&mut a, holders(&["b", "c#2"], true), now);
    assert_eq!(roster_entries(a.local_value(ROSTER_KEY))["c"], RosterEntry { generation: 2, forgotten: false });
}

#[test]
fn the_roster_is_durable_and_loaded_back() {
    let mut a = core("a");
    let now = Instant::now();
    let mut out = Vec::new();
    tell_replicas(&mut a, holders(&["b"], true), now, 1, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::Persist { key, .. } if key == ROSTER_KEY)), "{out:?}");
    let value = a.local_value(ROSTER_KEY).cloned().expect("roster");
    let mut restarted = core("a");
    restarted.load(vec![(ROSTER_KEY.to_string(), value, KeyLog::default())], 0);
    assert_eq!(restarted.roster_size(), 2, "b counts before any membership is known");
}

#[test]
fn a_node_without_the_replicas_role_never_enters_the_roster_nor_counts_itself_absent() {
    let mut a = with_forget_after("a", Duration::from_secs(60));
    let now = Instant::now();
    members_as(&mut a, holders(&["b", "c"], true), false, now);
    let ids: Vec<String> = counted(&a).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["b", "c"], "only the holders");
    // A holder that stops being one (it leaves, say) is never absent to itself.
    let mut b = with_forget_after("b", Duration::from_secs(60));
    members_as(&mut b, holders(&["a"], true), true, now);
    members_as(&mut b, holders(&["a"], true), false, now);
    b.handle(ReplicatorInput::Tick, now + Duration::from_secs(600), 1, &mut vec![]);
    assert!(!roster_entries(b.local_value(ROSTER_KEY))["b"].forgotten, "b does not forget itself");
}

#[test]
fn a_holder_that_handed_over_and_forgot_itself_counts_while_a_member_and_not_once_gone() {
    let mut a = core("a");
    let now = Instant::now();
    members(&mut a, holders(&["b", "c"], true), now);
    assert_eq!(a.roster_size(), 3);
    // c, leaving, handed over and forgot itself: its roster reaches a.
    let mut c = core("c");
    members(&mut c, holders(&["a", "b"], true), now);
    let mut out = Vec::new();
    assert!(c.forget("c", &mut out), "c forgets itself at the end of its hand-over");
    let theirs = c.local_value(ROSTER_KEY).cloned().expect("c's roster");
    a.merge_in(ROSTER_KEY, theirs, &mut vec![]).expect("merges");
    assert_eq!(a.roster_size(), 3, "still a member: its copies still answer");
    members(&mut a, holders(&["b"], true), now);
    assert_eq!(a.roster_size(), 2, "gone: no longer counted (nor absent)");
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(a.stats.roster_absent.load(Relaxed), 0);
}

#[test]
fn a_leaving_node_hands_over_to_a_majority_of_the_staying_roster_absent_holders_included_other_leavers_not() {
    let mut a = core("a");
    let now = Instant::now();
    members(&mut a, holders(&["b", "c", "d", "e", "f"], true), now);
    // d, e and f are gone (their disks still count); c leaves too; only b stays among members.
    members_leaving(&mut a, holders(&["b", "c"], true), true, &["c"], now);
    local(&mut a, "shard-1", add("x"));
    let mut out = Vec::new();
    a.handle(ReplicatorInput::HandOver { timeout: Duration::from_secs(1), reply: 9 }, now, 1, &mut out);
    a.handle(ReplicatorInput::Tick, now + Duration::from_secs(1), 1, &mut out);
    let replies: Vec<&ReplicatorAction<u32>> =
        out.iter().filter(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. })).collect();
    assert!(
        matches!(
            replies[..],
            [ReplicatorAction::ReplyUpdate { reply: 9, result: Err(Error::NotEnoughReplicas { needed: 3, .. }) }]
        ),
        "b, d, e and f stay in the roster: three of them, not one of b alone: {out:?}"
    );
}

/// Seed 660002017 (`three-nodes-many-shards`): n3 and n1 left one after the other while n2
/// restarted; n3 forgot itself on n2 only, and n1, leaving 20 ms later, still counted n3 in the
/// staying roster, failed its hand-over at once and stayed in the roster, so n2 alone could
/// never write a remembered id again. A hand-over now waits, within its deadline, for the
/// roster to allow a majority, and a node that forgets itself ships the forget to every gossip
/// target at once.
#[test]
fn a_hand_over_waits_for_another_leavers_forget_and_then_hands_over_to_the_one_that_stays() {
    let now = Instant::now();
    let mut n1 = core("n1");
    let mut n3 = core("n3");
    members(&mut n1, holders(&["n2", "n3"], true), now);
    members_leaving(&mut n3, holders(&["n1", "n2"], true), true, &["n1"], now);
    local(&mut n1, "shard-1", add("x"));
    // n3 hands over to n2 (n1 leaves too) and forgets itself: the forget goes to n2 as the
    // last part, and to every gossip target, n1 included, at once.
    let mut out = Vec::new();
    let timeout = Duration::from_secs(5);
    n3.handle(ReplicatorInput::HandOver { timeout, reply: 3 }, now, 1, &mut out);
    let ops = |out: &[ReplicatorAction<u32>]| -> Vec<u64> {
        out.iter()
            .filter_map(|x| match x {
                ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { op, .. }, .. } => Some(*op),
                _ => None,
            })
            .collect()
    };
    let mut after_parts = Vec::new();
    for op in ops(&out) {
        n3.handle(
            ReplicatorInput::Remote { from: peer("n2"), msg: ReplicatorMsg::WriteAck { op } },
            now,
            1,
            &mut after_parts,
        );
    }
    let gossiped_to = after_parts.iter().find_map(|x| match x {
        ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::DeltaPropagation { entries } }
            if entries.iter().any(|(k, _)| k == ROSTER_KEY) =>
        {
            Some(to.iter().map(|p| p.address.node_id.to_string()).collect::<Vec<_>>())
        }
        _ => None,
    });
    assert_eq!(gossiped_to, Some(vec!["n1".to_string(), "n2".to_string()]), "{after_parts:?}");
    // n3 is gone; n1 leaves before it heard of n3's forget: n2 of {n2, n3} is no majority.
    members(&mut n1, holders(&["n2"], true), now);
    let mut out = Vec::new();
    n1.handle(ReplicatorInput::HandOver { timeout, reply: 9 }, now, 1, &mut out);
    assert!(ops(&out).is_empty() && out.is_empty(), "waits: {out:?}");
    // n3's forget arrives; the next tick hands everything over to n2 alone.
    let theirs = n3.local_value(ROSTER_KEY).cloned().expect("n3's roster");
    n1.merge_in(ROSTER_KEY, theirs, &mut vec![]).expect("merges");
    let mut out = Vec::new();
    n1.handle(ReplicatorInput::Tick, now + Duration::from_millis(100), 1, &mut out);
    assert!(!ops(&out).is_empty(), "handed over now: {out:?}");
}

#[test]
fn raising_an_entry_to_what_it_already_holds_writes_nothing() {
    use super::super::roster::raise;
    let mut ctx = crate::ddata::crdt::WriteCtx::new("w#1", 1);
    let entry = RosterEntry { generation: 2, forgotten: false };
    let mut value = raise("x".into(), entry)(None, &mut ctx).expect("raised").expect("a new map");
    value.take_delta();
    raise("x".into(), entry)(Some(&mut value), &mut ctx).expect("raised");
    assert!(value.take_delta().is_none(), "the same entry again: no write, nothing to ship");
    raise("x".into(), RosterEntry { generation: 1, ..entry })(Some(&mut value), &mut ctx).expect("raised");
    assert!(value.take_delta().is_none(), "an older generation: no write");
    raise("x".into(), RosterEntry { forgotten: true, ..entry })(Some(&mut value), &mut ctx).expect("raised");
    assert!(value.take_delta().is_some(), "the same generation forgotten: written");
    assert!(roster_entries(Some(&value))["x"].forgotten);
}

#[test]
fn the_absence_clock_runs_from_the_first_view_without_the_holder_and_stops_when_it_is_back() {
    let mut a = with_forget_after("a", Duration::from_secs(60));
    let now = Instant::now();
    let at = |s| now + Duration::from_secs(s);
    members(&mut a, holders(&["b", "c", "d"], true), now);
    // b is absent from t=0 on, through later views; c is absent at t=0 and back at t=30.
    members(&mut a, holders(&["d"], true), now);
    members(&mut a, holders(&["c", "d"], true), at(30));
    members(&mut a, holders(&["c", "d"], true), at(50));
    a.handle(ReplicatorInput::Tick, at(60), 1, &mut vec![]);
    a.handle(ReplicatorInput::Tick, at(61), 1, &mut vec![]);
    let forgotten: Vec<String> =
        roster_entries(a.local_value(ROSTER_KEY)).into_iter().filter(|(_, e)| e.forgotten).map(|(id, _)| id).collect();
    assert_eq!(forgotten, ["b"], "b after 60 s from its first absence; c, back, never");
}

/// Seed 760002057 (`three-nodes-many-shards`): a shard's load read started while the node
/// that had just handed everything over and forgotten itself was still listed; the read
/// counted it, it exited without answering, and the shard stayed down for its restart backoff
/// (past the recovery's asks). A pending read or write now counts the replicas again when the
/// membership changes.
#[test]
fn a_read_and_a_write_waiting_for_a_holder_that_handed_over_and_left_end_when_it_is_removed() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b"], true), now);
    // b's hand-over ended with its forget, which reached a; b is still listed (Exiting).
    let mut b = core("b");
    members(&mut b, holders(&["a"], true), now);
    assert!(b.forget("b", &mut vec![]));
    let theirs = b.local_value(ROSTER_KEY).cloned().expect("b's roster");
    a.merge_in(ROSTER_KEY, theirs, &mut vec![]).expect("merges");
    assert_eq!(a.roster_size(), 2, "still listed: still counted");
    let mut out = Vec::new();
    let read = ReplicatorInput::GetMany {
        keys: vec!["shard-t/1/0".into()],
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    a.handle(read, now, 1, &mut out);
    update(&mut a, "shard-t/1/1", Consistency::MAJORITY, add("x"), &mut out);
    commit_all(&mut a, &mut out);
    let replies = |out: &[ReplicatorAction<u32>]| {
        out.iter()
            .filter(|x| matches!(x, ReplicatorAction::ReplyGetMany { .. } | ReplicatorAction::ReplyUpdate { .. }))
            .count()
    };
    assert_eq!(replies(&out), 0, "both wait for b: {out:?}");
    // b exits and is removed: a alone is the roster, and both end.
    let mut out = Vec::new();
    tell_replicas(&mut a, vec![], now, 1, &mut out);
    commit_all(&mut a, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { reply: 5, result: Ok(_) })), "{out:?}");
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { reply: 0, result: Ok(_) })), "{out:?}");
}

#[test]
fn a_read_waiting_for_holders_that_were_downed_keeps_waiting_their_disks_still_count() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b", "c", "d", "e"], true), now);
    let (op, _) = start_read(&mut a, Consistency::MAJORITY, now);
    // d and e are downed and removed, never forgotten: three of five are still needed.
    let mut out = Vec::new();
    members(&mut a, holders(&["b", "c"], true), now);
    a.handle(ReplicatorInput::Tick, now, 1, &mut out);
    a.handle(empty_answer(op, "b"), now, 1, &mut out);
    assert!(!read_answered(&out), "two of five: {out:?}");
    a.handle(empty_answer(op, "c"), now, 1, &mut out);
    assert!(read_answered(&out), "{out:?}");
}

/// A write's acks are recounted over the ids that count now: a holder that acknowledged and
/// then left (its hand-over may have taken its copies before the write reached it) is not
/// one of the fewer answers the smaller roster needs.
#[test]
fn a_write_acknowledged_by_a_holder_that_then_left_is_not_counted_when_the_quorum_is_recounted() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b", "c", "l"], true), now);
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::MAJORITY, add("x"), &mut out);
    commit_all(&mut a, &mut out);
    let op = write_op(&out);
    a.handle(ReplicatorInput::Remote { from: peer("l"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    // l forgot itself and is removed: the roster is a, b, c; two of three are needed.
    let mut l = core("l");
    members(&mut l, holders(&["a", "b", "c"], true), now);
    assert!(l.forget("l", &mut vec![]));
    let theirs = l.local_value(ROSTER_KEY).cloned().expect("l's roster");
    a.merge_in(ROSTER_KEY, theirs, &mut vec![]).expect("merges");
    let mut out = Vec::new();
    members(&mut a, holders(&["b", "c"], true), now);
    a.handle(ReplicatorInput::Tick, now, 1, &mut out);
    let replied = |out: &[ReplicatorAction<u32>]| out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. }));
    assert!(!replied(&out), "l's ack no longer counts: a alone is one of three: {out:?}");
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { reply: 0, result: Ok(_) })), "{out:?}");
}

/// A claim's read of every reachable replica keeps waiting for one that turns unreachable or
/// is downed (its disk still counts): only a forgotten holder stops being waited for.
#[test]
fn a_read_of_every_reachable_replica_keeps_waiting_for_one_that_turns_unreachable_or_is_downed() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b", "c", "d", "e"], true), now);
    let (op, _) = start_read(&mut a, Consistency::AllReachable { plus: 0, min_cap: 0 }, now);
    let mut out = Vec::new();
    for from in ["b", "c", "d"] {
        a.handle(empty_answer(op, from), now, 1, &mut out);
    }
    // e turns unreachable, then is downed and removed: still counted, still waited for.
    let mut now_members = holders(&["b", "c", "d"], true);
    now_members.extend(holders(&["e"], false));
    members(&mut a, now_members, now);
    members(&mut a, holders(&["b", "c", "d"], true), now);
    a.handle(ReplicatorInput::Tick, now, 1, &mut out);
    assert!(!read_answered(&out), "four of five: {out:?}");
    a.handle(empty_answer(op, "e"), now, 1, &mut out);
    assert!(read_answered(&out), "{out:?}");
}

/// A hand-over counts node ids, as the roster does: a holder that restarts during the leave is
/// sent every part again, and its new incarnation's ack is the same disk's as the old one's.
#[test]
fn a_restarted_holder_acknowledging_a_hand_over_part_again_counts_once() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b", "c"], true), now);
    local(&mut a, "shard-1", add("x"));
    let mut out = Vec::new();
    a.handle(ReplicatorInput::HandOver { timeout: Duration::from_secs(5), reply: 9 }, now, 1, &mut out);
    let ops: Vec<u64> = out
        .iter()
        .filter_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { op, .. }, .. } => Some(*op),
            _ => None,
        })
        .collect();
    assert!(!ops.is_empty(), "{out:?}");
    let ack = |from: PeerAddr, op: u64| ReplicatorInput::Remote { from, msg: ReplicatorMsg::WriteAck { op } };
    let mut out = Vec::new();
    for op in &ops {
        a.handle(ack(peer("b"), *op), now, 1, &mut out);
    }
    // b restarts: b#2 is sent every part and acknowledges; b is still one of the two needed.
    members(&mut a, holders(&["b#2", "c"], true), now);
    let b2 = holders(&["b#2"], true).remove(0).0;
    for op in &ops {
        a.handle(ack(b2.clone(), *op), now, 1, &mut out);
    }
    let forgets = |out: &[ReplicatorAction<u32>]| {
        out.iter()
            .filter(|x| {
                matches!(x, ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { values, .. }, .. }
                    if values.iter().any(|(k, _)| k == ROSTER_KEY) && values.len() == 1)
            })
            .count()
    };
    assert_eq!(forgets(&out), 0, "b once, not twice: no forget yet: {out:?}");
    for op in &ops {
        a.handle(ack(peer("c"), *op), now, 1, &mut out);
    }
    assert_eq!(forgets(&out), 1, "b and c: the forget goes out: {out:?}");
}

/// A key that is not durable recounts over today's members: a removed member is waited for no
/// more, and the acks of the members still there keep counting.
#[test]
fn a_write_of_a_key_that_is_not_durable_recounts_over_the_members_left_and_keeps_their_acks() {
    let now = Instant::now();
    let mut a = core("a");
    members(&mut a, holders(&["b", "c", "d"], true), now);
    let mut out = Vec::new();
    update(&mut a, "user-key", Consistency::MAJORITY, add("x"), &mut out);
    commit_all(&mut a, &mut out);
    let op = write_op(&out);
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(!out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. })), "two of four: {out:?}");
    // d is downed and removed: two of the three members left, a and b, have it.
    let mut out = Vec::new();
    let replicas = holders(&["b", "c"], true);
    let gossip_targets = replicas.iter().map(|(p, _)| p.clone()).collect();
    let left = ReplicatorInput::Members { holder: true, replicas, gossip_targets, standing: vec![], leaving: vec![] };
    a.handle(left, now, 1, &mut out);
    commit_all(&mut a, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { reply: 0, result: Ok(_) })), "{out:?}");
}
