//! Multi-key reads: one message per replica, answers split by bytes, refused bad answers.
use super::super::reads::MAX_READ_KEYS;
use super::*;

#[test]
fn a_multi_key_read_is_one_message_per_replica_and_a_large_answer_comes_in_parts() {
    let mut a = core("a");
    let mut b = core("b");
    b.settings.max_message_bytes = 2_000;
    let keys: Vec<String> = (0..8).map(|i| format!("shard-t/1/{i}")).collect();
    for k in &keys[..6] {
        let ids = (0..100).map(|i| format!("{k}-entity-{i}")).collect();
        local(&mut b, k, or_add(ids));
    }
    let peers = vec![(peer("b"), true), (peer("c"), true)];
    a.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    let get = Input::GetMany {
        keys: keys.clone(),
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 9,
    };
    a.handle(get, Instant::now(), 1, &mut out);
    assert_eq!(out.len(), 1, "one Read for all keys: {out:?}");
    let (op, asked) = read_op(&out);
    assert_eq!(asked, keys);

    let mut answers = Vec::new();
    b.handle(
        Input::Remote { from: peer("a"), msg: ReplicatorMsg::Read { op, keys: asked } },
        Instant::now(),
        1,
        &mut answers,
    );
    assert!(answers.len() >= 3, "~2.5 KB per value against a 2 KB budget: one value per part, got {}", answers.len());
    let mut out = Vec::new();
    let last = answers.pop().unwrap();
    for part in answers {
        let Action::Send { msg, .. } = part else { panic!() };
        a.handle(Input::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    }
    assert!(!out.iter().any(|x| matches!(x, Action::ReplyGetMany { .. })), "not before the last part");
    let Action::Send { msg, .. } = last else { panic!() };
    a.handle(Input::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    let values = out
        .iter()
        .find_map(|x| match x {
            Action::ReplyGetMany { reply: 9, result: Ok(v) } => Some(v.clone()),
            _ => None,
        })
        .expect("the reply");
    assert_eq!(values.len(), 8);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(v.as_ref().map(ReplicatedData::element_count), (i < 6).then_some(100), "key {i}");
    }
    // The values are now local too (a majority read joins what it saw).
    assert_eq!(a.local_value("shard-t/1/0"), b.local_value("shard-t/1/0"));
}

#[test]
fn a_read_answer_with_indexes_out_of_range_or_repeated_is_refused_and_does_not_complete_the_read() {
    let mut a = core("a");
    let peers = vec![(peer("b"), true), (peer("c"), true)];
    a.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    let keys = vec!["x".to_string(), "y".to_string()];
    a.handle(
        Input::GetMany { keys, consistency: Consistency::MAJORITY, timeout: Duration::from_secs(1), reply: 1 },
        Instant::now(),
        1,
        &mut out,
    );
    let (op, _) = read_op(&out);
    let mut out = Vec::new();
    let bogus = ReplicatorMsg::ReadResult { op, values: vec![(0, None), (0, None), (7, None)] };
    a.handle(Input::Remote { from: peer("b"), msg: bogus }, Instant::now(), 1, &mut out);
    assert!(out.is_empty(), "key 1 was never answered: {out:?}");
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 2);
    let mut out = Vec::new();
    let tail = ReplicatorMsg::ReadResult { op, values: vec![(1, None)] };
    a.handle(Input::Remote { from: peer("b"), msg: tail }, Instant::now(), 1, &mut out);
    assert!(matches!(&out[..], [Action::ReplyGetMany { reply: 1, result: Ok(v) }] if v == &vec![None, None]));
}

#[test]
fn a_read_of_more_keys_than_the_limit_is_refused_with_a_typed_error() {
    let mut a = core("a");
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS + 1).map(|i| i.to_string()).collect();
    a.handle(
        Input::GetMany { keys, consistency: Consistency::Local, timeout: Duration::from_secs(1), reply: 1 },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(matches!(&out[..], [Action::ReplyGetMany { result: Err(Error::Codec(_)), .. }]));
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS + 1).map(|i| i.to_string()).collect();
    a.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::Read { op: 1, keys } }, Instant::now(), 1, &mut out);
    assert!(out.is_empty());
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A read among five replicas (a majority is 3) whose peers never answer but `answering`;
/// returns the replies "a" gives on ticks at `start + timeout / 2` and `start + timeout`.
fn read_until_timeout(after_write: bool, answering: &[&str]) -> (Vec<Action<u32>>, Vec<Action<u32>>) {
    let mut a = core("a");
    let peers = ["b", "c", "d", "e"].iter().map(|p| (peer(p), true)).collect();
    a.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
    let start = Instant::now();
    let timeout = Duration::from_secs(4);
    let mut out = Vec::new();
    let keys = vec!["k".to_string()];
    let input = if after_write {
        Input::UpdateAndGetMany {
            updates: vec![("k".into(), add("x"))],
            consistency: Consistency::MAJORITY,
            timeout,
            reply: 3,
        }
    } else {
        Input::GetMany { keys: keys.clone(), consistency: Consistency::MAJORITY, timeout, reply: 3 }
    };
    a.handle(input, start, 1, &mut out);
    commit_all(&mut a, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            Action::Broadcast { msg, .. } => Some(msg.clone()),
            _ => None,
        })
        .expect("a read to the replicas");
    for p in answering {
        let mut replica = core(p);
        let mut answer = Vec::new();
        replica.handle(Input::Remote { from: peer("a"), msg: msg.clone() }, start, 1, &mut answer);
        commit_all(&mut replica, &mut answer);
        for x in answer {
            if let Action::Send { msg, .. } = x {
                a.handle(Input::Remote { from: peer(p), msg }, start, 1, &mut vec![]);
            }
        }
    }
    let mut early = Vec::new();
    a.handle(Input::Tick, start + timeout / 2, 1, &mut early);
    let mut late = Vec::new();
    a.handle(Input::Tick, start + timeout, 1, &mut late);
    (early, late)
}

fn timed_out(out: &[Action<u32>]) -> Option<(usize, usize)> {
    out.iter().find_map(|x| match x {
        Action::ReplyGetMany { reply: 3, result: Err(Error::ConsistencyTimeout { needed, acked }) } => {
            Some((*needed, *acked))
        }
        _ => None,
    })
}

#[test]
fn a_read_short_of_its_quorum_waits_out_its_timeout_then_names_this_node_and_every_full_answer() {
    for after_write in [false, true] {
        let (early, late) = read_until_timeout(after_write, &["b"]);
        assert_eq!(timed_out(&early), None, "not before its deadline (after_write {after_write}): {early:?}");
        assert_eq!(timed_out(&late), Some((3, 2)), "this node and b (after_write {after_write}): {late:?}");
    }
}
