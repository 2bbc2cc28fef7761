//! Fenced maps in the replicator: writes refused by a claim (here or at a replica), and the
//! read after a write that a new allocation claims its state with.
use super::super::reads::MAX_READ_KEYS;
use super::*;
use crate::ddata::fenced::{Fenced, FencedMap};

fn put(key: &'static str, epoch: u64, value: u8) -> Modify {
    Box::new(move |cur, ctx| {
        let mut created = None;
        let map = match cur {
            Some(d) => FencedMap::data_mut(d, "k")?,
            None => created.insert(FencedMap::default()),
        };
        if let Err(f) = map.put(key, epoch, vec![value]) {
            ctx.refuse(f);
        }
        Ok(created.map(FencedMap::into_data))
    })
}

fn claim(epoch: u64) -> Modify {
    Box::new(move |cur, ctx| {
        let mut created = None;
        let map = match cur {
            Some(d) => FencedMap::data_mut(d, "k")?,
            None => created.insert(FencedMap::default()),
        };
        if let Err(f) = map.claim(epoch) {
            ctx.refuse(f);
        }
        Ok(created.map(FencedMap::into_data))
    })
}

fn with_peers(c: &mut ReplicatorCore<u32>, ids: &[&str]) {
    let replicas = ids.iter().map(|id| (peer(id), true)).collect();
    c.handle(
        ReplicatorInput::Members { holder: true, replicas, gossip_targets: vec![], standing: vec![], leaving: vec![] },
        Instant::now(),
        0,
        &mut vec![],
    );
}

fn fence_of(c: &ReplicatorCore<u32>, key: &str) -> Option<u64> {
    c.local_value(key)?.fence()
}

fn update_many(c: &mut ReplicatorCore<u32>, updates: Vec<(String, Modify)>, reply: u32) -> Vec<ReplicatorAction<u32>> {
    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateMany {
        updates,
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply,
    };
    c.handle(input, Instant::now(), 1, &mut out);
    out
}

fn write_delta(out: &[ReplicatorAction<u32>]) -> ReplicatorMsg {
    out.iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: m @ ReplicatorMsg::WriteDelta { .. }, .. } => Some(m.clone()),
            _ => None,
        })
        .expect("a WriteDelta")
}

fn update_reply(out: &[ReplicatorAction<u32>], id: u32) -> Option<&Result<Vec<(String, Fenced)>>> {
    out.iter().find_map(|x| match x {
        ReplicatorAction::ReplyUpdate { result, reply } if *reply == id => Some(result),
        _ => None,
    })
}

fn deliver(to: &mut ReplicatorCore<u32>, from: &str, msg: ReplicatorMsg) -> Vec<ReplicatorAction<u32>> {
    let mut out = Vec::new();
    to.handle(ReplicatorInput::Remote { from: peer(from), msg }, Instant::now(), 1, &mut out);
    out
}

fn sent(out: &[ReplicatorAction<u32>]) -> Vec<ReplicatorMsg> {
    out.iter()
        .filter_map(|x| match x {
            ReplicatorAction::Send { msg, .. } => Some(msg.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_write_refused_by_the_local_fence_fails_only_its_key_and_the_other_keys_replicate() {
    let mut a = core("a");
    with_peers(&mut a, &["b", "c"]);
    let out = update_many(&mut a, vec![("shard-t/1/s".into(), claim(9))], 1);
    let op = write_op(&out);
    deliver(&mut a, "b", ReplicatorMsg::WriteAck { op });
    let mut out =
        update_many(&mut a, vec![("shard-t/1/s".into(), put("e1", 8, 1)), ("shard-t/2/s".into(), put("e2", 8, 2))], 2);
    let ReplicatorMsg::WriteDelta { op, entries, values } = write_delta(&out) else { unreachable!() };
    let sent_keys: Vec<&str> =
        entries.iter().map(|(k, _)| k.as_str()).chain(values.iter().map(|(k, _)| k.as_str())).collect();
    assert_eq!(sent_keys, vec!["shard-t/2/s"], "the refused key is not sent");
    out.extend(deliver(&mut a, "b", ReplicatorMsg::WriteAck { op }));
    commit_all(&mut a, &mut out);
    let fenced = update_reply(&out, 2).expect("a reply").as_ref().expect("the other key is written");
    assert_eq!(fenced, &vec![("shard-t/1/s".to_string(), Fenced { epoch: 8, fence: 9 })]);
    assert_eq!(a.stats.fenced_writes.load(std::sync::atomic::Ordering::Relaxed), 1);
    let map = FencedMap::from_data(a.local_value("shard-t/1/s").unwrap().clone(), "k").unwrap();
    assert_eq!(map.get("e1"), None, "nothing of the refused write is applied");
}

#[test]
fn a_replica_claimed_by_a_newer_epoch_refuses_the_write_says_so_and_acknowledges_the_rest_after_commit() {
    let mut writer = core("a");
    with_peers(&mut writer, &["b", "c"]);
    let mut replica = core("b");
    local(&mut replica, "shard-t/1/s", claim(9));
    commit_all(&mut replica, &mut vec![]);
    let out = update_many(
        &mut writer,
        vec![("shard-t/1/s".into(), put("e1", 8, 1)), ("shard-t/2/s".into(), put("e2", 8, 2))],
        1,
    );
    let write = write_delta(&out);
    let ReplicatorMsg::WriteDelta { op, .. } = write else { unreachable!() };
    let answer = deliver(&mut replica, "a", write);
    let msgs = sent(&answer);
    assert!(
        matches!(&msgs[..], [ReplicatorMsg::WriteFenced { op: o, keys }]
            if *o == op && keys == &vec![("shard-t/1/s".to_string(), Fenced { epoch: 8, fence: 9 })]),
        "the refusal goes at once, the ack waits for the commit: {answer:?}"
    );
    let map = FencedMap::from_data(replica.local_value("shard-t/1/s").unwrap().clone(), "k").unwrap();
    assert_eq!((map.get("e1"), map.fence()), (None, 9), "the stale write is not merged");
    assert!(replica.local_value("shard-t/2/s").is_some(), "the other key is merged");
    let mut after = Vec::new();
    commit_all(&mut replica, &mut after);
    assert!(after.iter().any(is_ack), "{after:?}");

    // The writer: the refusal, then the ack; the key is reported fenced, the other written.
    let mut out = Vec::new();
    for msg in msgs.into_iter().chain(sent(&after)) {
        out.extend(deliver(&mut writer, "b", msg));
    }
    commit_all(&mut writer, &mut out);
    let fenced = update_reply(&out, 1).expect("a reply").as_ref().expect("written");
    assert_eq!(fenced, &vec![("shard-t/1/s".to_string(), Fenced { epoch: 8, fence: 9 })]);
}

#[test]
fn a_refusal_from_a_replica_not_addressed_or_for_a_key_not_written_changes_nothing() {
    let mut writer = core("a");
    with_peers(&mut writer, &["b", "c"]);
    let out = update_many(&mut writer, vec![("shard-t/1/s".into(), put("e1", 8, 1))], 1);
    let op = write_op(&out);
    let forged = ReplicatorMsg::WriteFenced { op, keys: vec![("shard-t/1/s".into(), Fenced { epoch: 8, fence: 99 })] };
    deliver(&mut writer, "mallory", forged);
    assert_eq!(writer.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
    let other_key =
        ReplicatorMsg::WriteFenced { op, keys: vec![("shard-t/7/s".into(), Fenced { epoch: 8, fence: 99 })] };
    deliver(&mut writer, "b", other_key);
    let mut out = deliver(&mut writer, "c", ReplicatorMsg::WriteAck { op });
    commit_all(&mut writer, &mut out);
    assert!(matches!(update_reply(&out, 1), Some(Ok(f)) if f.is_empty()), "{out:?}");
}

#[test]
fn a_key_refused_twice_is_reported_once() {
    let mut writer = core("a");
    with_peers(&mut writer, &["b", "c", "d", "e"]);
    let out = update_many(&mut writer, vec![("shard-t/1/s".into(), put("e1", 8, 1))], 1);
    let op = write_op(&out);
    let refusal = ReplicatorMsg::WriteFenced { op, keys: vec![("shard-t/1/s".into(), Fenced { epoch: 8, fence: 9 })] };
    deliver(&mut writer, "b", refusal.clone());
    deliver(&mut writer, "c", refusal);
    let mut out = Vec::new();
    for p in ["b", "c"] {
        out.extend(deliver(&mut writer, p, ReplicatorMsg::WriteAck { op }));
    }
    commit_all(&mut writer, &mut out);
    let fenced = update_reply(&out, 1).expect("a reply").as_ref().unwrap();
    assert_eq!(fenced.len(), 1);
}

#[test]
fn update_and_get_answers_only_once_every_counted_replica_and_this_node_committed_the_claim() {
    let mut reader = core("a");
    with_peers(&mut reader, &["b", "c"]);
    let mut replica = core("b");
    // The replica holds a stale incarnation's write, not yet claimed.
    local(&mut replica, "shard-t/1/s", put("e1", 8, 1));
    commit_all(&mut replica, &mut vec![]);
    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateAndGetMany {
        updates: vec![("shard-t/1/s".into(), claim(9))],
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    reader.handle(input, Instant::now(), 1, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: m @ ReplicatorMsg::MergeThenRead { .. }, to } if to.len() == 2 => {
                Some(m.clone())
            }
            _ => None,
        })
        .expect("a MergeThenRead to both replicas");
    let answer = deliver(&mut replica, "a", msg);
    assert!(sent(&answer).is_empty(), "no answer before the claim is committed: {answer:?}");
    assert_eq!(fence_of(&replica, "shard-t/1/s"), Some(9), "but the claim already refuses stale writes");
    let mut committed = Vec::new();
    commit_all(&mut replica, &mut committed);
    let results = sent(&committed);
    assert!(matches!(&results[..], [ReplicatorMsg::ReadResult { .. }]), "{committed:?}");

    let mut out = Vec::new();
    for msg in results {
        out.extend(deliver(&mut reader, "b", msg));
    }
    assert!(
        !out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { .. })),
        "the reader's own claim is not committed yet"
    );
    commit_all(&mut reader, &mut out);
    let values = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::ReplyGetMany { reply: 5, result: Ok(v) } => Some(v.clone()),
            _ => None,
        })
        .expect("the reply");
    let map = FencedMap::from_data(values[0].clone().unwrap(), "k").unwrap();
    assert_eq!((map.fence(), map.get("e1")), (9, Some(&[1u8][..])), "the claim and the older write");
}

#[test]
fn a_failed_commit_of_the_claim_answers_nothing_and_the_reader_times_out() {
    let mut reader = core("a");
    with_peers(&mut reader, &["b", "c"]);
    let mut replica = core("b");
    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateAndGetMany {
        updates: vec![("shard-t/1/s".into(), claim(9))],
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    let now = Instant::now();
    reader.handle(input, now, 1, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: m @ ReplicatorMsg::MergeThenRead { .. }, .. } => Some(m.clone()),
            _ => None,
        })
        .unwrap();
    deliver(&mut replica, "a", msg);
    let mut failed = Vec::new();
    fail_all(&mut replica, &mut failed);
    assert!(sent(&failed).is_empty(), "a replica that may lose the claim must not be counted: {failed:?}");
    let mut out = Vec::new();
    reader.handle(ReplicatorInput::Tick, now + Duration::from_secs(2), 1, &mut out);
    assert!(
        out.iter().any(|x| matches!(
            x,
            ReplicatorAction::ReplyGetMany { reply: 5, result: Err(Error::ConsistencyTimeout { .. }) }
        )),
        "{out:?}"
    );
}

#[test]
fn a_claim_below_the_local_fence_fails_the_read_at_once_with_fenced() {
    let mut reader = core("a");
    local(&mut reader, "shard-t/1/s", claim(10));
    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateAndGetMany {
        updates: vec![("shard-t/1/s".into(), claim(9))],
        consistency: Consistency::Local,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    reader.handle(input, Instant::now(), 1, &mut out);
    assert!(
        matches!(
            &out[..],
            [ReplicatorAction::ReplyGetMany { result: Err(Error::Fenced { epoch: 9, fence: 10, .. }), .. }]
        ),
        "{out:?}"
    );
}

#[test]
fn a_local_update_and_get_answers_after_the_local_commit() {
    let mut reader = core("a");
    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateAndGetMany {
        updates: vec![("shard-t/1/s".into(), claim(3))],
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    reader.handle(input, Instant::now(), 1, &mut out);
    assert!(!out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { .. })), "{out:?}");
    commit_all(&mut reader, &mut out);
    assert!(out.iter().any(
        |x| matches!(x, ReplicatorAction::ReplyGetMany { reply: 5, result: Ok(v) } if v.len() == 1 && v[0].is_some())
    ));
}

#[test]
fn a_read_after_a_write_that_writes_keys_it_does_not_read_is_refused() {
    let mut replica = core("b");
    let mut claimed = FencedMap::default();
    claimed.claim(5).unwrap();
    let msg = ReplicatorMsg::MergeThenRead {
        op: 1,
        keys: vec!["shard-t/1/s".into()],
        entries: vec![("shard-t/9/s".into(), ReplicatedDelta::FencedMap(claimed))],
        values: vec![],
    };
    let out = deliver(&mut replica, "a", msg);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(replica.local_value("shard-t/9/s"), None);
    assert_eq!(replica.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
    let too_many = ReplicatorMsg::MergeThenRead {
        op: 2,
        keys: (0..MAX_READ_KEYS + 1).map(|i| i.to_string()).collect(),
        entries: vec![],
        values: vec![],
    };
    assert!(deliver(&mut replica, "a", too_many).is_empty());
    assert_eq!(replica.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 2);
}

#[test]
fn a_read_needing_more_replicas_than_reachable_fails_at_once_naming_both_counts() {
    for (members, consistency, expected) in [
        (vec![true, false], Consistency::MAJORITY, None),
        (vec![true, false], Consistency::All, Some((3, 2))),
        (vec![true, false, false], Consistency::MAJORITY, Some((3, 2))),
        (vec![false, false, false, false], Consistency::MAJORITY, Some((3, 1))),
        (vec![false, false, false, false], Consistency::Local, None),
    ] {
        let mut a = core("a");
        let replicas = members.iter().enumerate().map(|(i, up)| (peer(&format!("p{i}")), *up)).collect();
        a.handle(
            ReplicatorInput::Members {
                holder: true,
                replicas,
                gossip_targets: vec![],
                standing: vec![],
                leaving: vec![],
            },
            Instant::now(),
            0,
            &mut vec![],
        );
        let mut out = Vec::new();
        let get =
            ReplicatorInput::GetMany { keys: vec!["k".into()], consistency, timeout: Duration::from_secs(1), reply: 1 };
        a.handle(get, Instant::now(), 1, &mut out);
        let refused = out.iter().find_map(|x| match x {
            ReplicatorAction::ReplyGetMany { result: Err(Error::NotEnoughReplicas { needed, reachable }), .. } => {
                Some((*needed, *reachable))
            }
            _ => None,
        });
        assert_eq!(refused, expected, "{members:?} {consistency:?}: {out:?}");
    }
}

#[test]
fn a_read_of_exactly_the_key_limit_is_served() {
    let mut a = core("a");
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS).map(|i| i.to_string()).collect();
    a.handle(
        ReplicatorInput::GetMany { keys, consistency: Consistency::Local, timeout: Duration::from_secs(1), reply: 1 },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(matches!(&out[..], [ReplicatorAction::ReplyGetMany { result: Ok(v), .. }] if v.len() == MAX_READ_KEYS));
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS).map(|i| i.to_string()).collect();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::Read { op: 1, keys } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(!out.is_empty());
}

/// Claims `epoch` from "a" among replicas b–e (`e_reachable` says whether "e" is), e holding
/// an acknowledged write b–d lack; b, c and d answer first. Returns whether "a" answered after
/// those three, and the value of e1 it finally answered with.
fn claim_among_five(consistency: Consistency, e_reachable: bool) -> (bool, Option<Vec<u8>>) {
    let mut reader = core("a");
    let replicas =
        [("b", true), ("c", true), ("d", true), ("e", e_reachable)].iter().map(|(id, up)| (peer(id), *up)).collect();
    reader.handle(
        ReplicatorInput::Members { holder: true, replicas, gossip_targets: vec![], standing: vec![], leaving: vec![] },
        Instant::now(),
        0,
        &mut vec![],
    );
    let mut holder = core("e");
    local(&mut holder, "shard-t/1/s", put("e1", 8, 7));
    commit_all(&mut holder, &mut vec![]);

    let mut out = Vec::new();
    let input = ReplicatorInput::UpdateAndGetMany {
        updates: vec![("shard-t/1/s".into(), claim(9))],
        consistency,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    reader.handle(input, Instant::now(), 1, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: m @ ReplicatorMsg::MergeThenRead { .. }, .. } => Some(m.clone()),
            _ => None,
        })
        .expect("a MergeThenRead");
    let answer_of = |replica: &mut ReplicatorCore<u32>| {
        let mut answered = deliver(replica, "a", msg.clone());
        commit_all(replica, &mut answered);
        sent(&answered)
    };
    let mut replies = Vec::new();
    for id in ["b", "c", "d"] {
        for m in answer_of(&mut core(id)) {
            replies.extend(deliver(&mut reader, id, m));
        }
    }
    commit_all(&mut reader, &mut replies);
    let value_of = |out: &[ReplicatorAction<u32>]| {
        out.iter().find_map(|x| match x {
            ReplicatorAction::ReplyGetMany { reply: 5, result: Ok(v) } => {
                let map = FencedMap::from_data(v[0].clone().unwrap(), "k").unwrap();
                Some(map.get("e1").map(<[u8]>::to_vec))
            }
            _ => None,
        })
    };
    if let Some(v) = value_of(&replies) {
        return (true, v);
    }
    for m in answer_of(&mut holder) {
        replies.extend(deliver(&mut reader, "e", m));
    }
    commit_all(&mut reader, &mut replies);
    (false, value_of(&replies).expect("a reply once every reachable replica answered"))
}

#[test]
fn a_claim_at_all_reachable_waits_for_every_reachable_replica_and_so_reads_a_write_a_majority_plus_one_misses() {
    let plus_one = Consistency::Majority { plus: 1, min_cap: 0 };
    let all_reachable = Consistency::AllReachable { plus: 1, min_cap: 0 };
    // A majority plus one of five (a, b, c, d) answers without the only holder: the write is lost.
    assert_eq!(claim_among_five(plus_one, true), (true, None));
    // Every reachable replica: the reader waits for e and loads its write.
    assert_eq!(claim_among_five(all_reachable, true), (false, Some(vec![7])));
    // With e unreachable the floor (a majority plus one) is enough; the claim does not hang.
    assert_eq!(claim_among_five(all_reachable, false), (true, None));
}

#[test]
fn a_write_under_the_epoch_that_claimed_the_replica_is_merged_not_refused() {
    let mut writer = core("a");
    with_peers(&mut writer, &["b", "c"]);
    let mut replica = core("b");
    local(&mut replica, "shard-t/1/s", claim(9));
    commit_all(&mut replica, &mut vec![]);
    let out = update_many(&mut writer, vec![("shard-t/1/s".into(), put("e1", 9, 1))], 1);
    let answer = deliver(&mut replica, "a", write_delta(&out));
    assert!(!sent(&answer).iter().any(|m| matches!(m, ReplicatorMsg::WriteFenced { .. })), "{answer:?}");
    let map = FencedMap::from_data(replica.local_value("shard-t/1/s").unwrap().clone(), "k").unwrap();
    assert_eq!((map.get("e1"), map.fence()), (Some(&[1u8][..]), 9), "the claiming epoch's own write lands");
}
