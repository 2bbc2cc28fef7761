//! Reads: multi-key reads (one message per replica, answers split by bytes, refused bad
//! answers), read repair, and reads and writes of every reachable replica.
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
    tell_replicas(&mut a, peers, Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    let get = ReplicatorInput::GetMany {
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
        ReplicatorInput::Remote { from: peer("a"), msg: ReplicatorMsg::Read { op, keys: asked } },
        Instant::now(),
        1,
        &mut answers,
    );
    assert!(answers.len() >= 3, "~2.5 KB per value against a 2 KB budget: one value per part, got {}", answers.len());
    let mut out = Vec::new();
    let last = answers.pop().unwrap();
    for part in answers {
        let ReplicatorAction::Send { msg, .. } = part else { panic!() };
        a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    }
    assert!(!out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { .. })), "not before the last part");
    let ReplicatorAction::Send { msg, .. } = last else { panic!() };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    let values = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::ReplyGetMany { reply: 9, result: Ok(v) } => Some(v.clone()),
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
    let mut a = core_with_replicas("a", vec![(peer("b"), true), (peer("c"), true)]);
    let mut out = Vec::new();
    let keys = vec!["x".to_string(), "y".to_string()];
    a.handle(
        ReplicatorInput::GetMany {
            keys,
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            reply: 1,
        },
        Instant::now(),
        1,
        &mut out,
    );
    let (op, _) = read_op(&out);
    let mut out = Vec::new();
    let bogus = ReplicatorMsg::ReadResult { op, values: vec![(0, None), (0, None), (7, None)] };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg: bogus }, Instant::now(), 1, &mut out);
    assert!(out.is_empty(), "key 1 was never answered: {out:?}");
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 2);
    let mut out = Vec::new();
    let tail = ReplicatorMsg::ReadResult { op, values: vec![(1, None)] };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg: tail }, Instant::now(), 1, &mut out);
    assert!(matches!(&out[..], [ReplicatorAction::ReplyGetMany { reply: 1, result: Ok(v) }] if v == &vec![None, None]));
}

#[test]
fn a_read_of_more_keys_than_the_limit_is_refused_with_a_typed_error() {
    let mut a = core("a");
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS + 1).map(|i| i.to_string()).collect();
    a.handle(
        ReplicatorInput::GetMany { keys, consistency: Consistency::Local, timeout: Duration::from_secs(1), reply: 1 },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(matches!(&out[..], [ReplicatorAction::ReplyGetMany { result: Err(Error::Codec(_)), .. }]));
    let mut out = Vec::new();
    let keys = (0..MAX_READ_KEYS + 1).map(|i| i.to_string()).collect();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::Read { op: 1, keys } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(out.is_empty());
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A read among five replicas (a majority is 3) whose peers never answer but `answering`;
/// returns the replies "a" gives on ticks at `start + timeout / 2` and `start + timeout`.
fn read_until_timeout(
    after_write: bool,
    answering: &[&str],
) -> (Vec<ReplicatorAction<u32>>, Vec<ReplicatorAction<u32>>) {
    let mut a = core_with_replicas("a", ["b", "c", "d", "e"].iter().map(|p| (peer(p), true)).collect());
    let start = Instant::now();
    let timeout = Duration::from_secs(4);
    let mut out = Vec::new();
    let keys = vec!["k".to_string()];
    let input = if after_write {
        ReplicatorInput::UpdateAndGetMany {
            updates: vec![("k".into(), add("x"))],
            consistency: Consistency::MAJORITY,
            timeout,
            reply: 3,
        }
    } else {
        ReplicatorInput::GetMany { keys: keys.clone(), consistency: Consistency::MAJORITY, timeout, reply: 3 }
    };
    a.handle(input, start, 1, &mut out);
    commit_all(&mut a, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg, .. } => Some(msg.clone()),
            _ => None,
        })
        .expect("a read to the replicas");
    for p in answering {
        let mut replica = core(p);
        let mut answer = Vec::new();
        replica.handle(ReplicatorInput::Remote { from: peer("a"), msg: msg.clone() }, start, 1, &mut answer);
        commit_all(&mut replica, &mut answer);
        for x in answer {
            if let ReplicatorAction::Send { msg, .. } = x {
                a.handle(ReplicatorInput::Remote { from: peer(p), msg }, start, 1, &mut vec![]);
            }
        }
    }
    let mut early = Vec::new();
    a.handle(ReplicatorInput::Tick, start + timeout / 2, 1, &mut early);
    let mut late = Vec::new();
    a.handle(ReplicatorInput::Tick, start + timeout, 1, &mut late);
    (early, late)
}

fn timed_out(out: &[ReplicatorAction<u32>]) -> Option<(usize, usize)> {
    out.iter().find_map(|x| match x {
        ReplicatorAction::ReplyGetMany { reply: 3, result: Err(Error::ConsistencyTimeout { needed, acked }) } => {
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

/// A replica "a" with `peers` (all reachable).
fn with_reachable(a: &mut ReplicatorCore<u32>, peers: &[&str]) {
    let replicas = peers.iter().map(|p| (peer(p), true)).collect();
    a.handle(
        ReplicatorInput::Members { holder: true, replicas, gossip_targets: vec![], standing: vec![], leaving: vec![] },
        Instant::now(),
        0,
        &mut vec![],
    );
}

/// What a replica sent after `input` (once everything it wrote is committed).
fn sent_after(c: &mut ReplicatorCore<u32>, input: ReplicatorInput<u32>) -> Vec<ReplicatorAction<u32>> {
    let mut out = Vec::new();
    c.handle(input, Instant::now(), 1, &mut out);
    commit_all(c, &mut out);
    out
}

fn rejected(c: &ReplicatorCore<u32>) -> u64 {
    c.stats.rejected.load(std::sync::atomic::Ordering::Relaxed)
}

/// The `ReadResult`s among `out`, in order: each as its (index, value) pairs.
type ReadValues = Vec<(u32, Option<ReplicatedData>)>;
fn read_results(out: &[ReplicatorAction<u32>]) -> Vec<ReadValues> {
    out.iter()
        .filter_map(|x| match x {
            ReplicatorAction::Send { msg: ReplicatorMsg::ReadResult { values, .. }, .. } => Some(values.clone()),
            _ => None,
        })
        .collect()
}

/// One limit for every way a read names its keys: a local or majority `GetMany`, an
/// `UpdateAndGetMany`, and a peer's `Read` or `MergeThenRead` may name `MAX_READ_KEYS` keys, not
/// one more.
#[test]
fn a_read_of_exactly_max_read_keys_keys_starts_and_one_more_is_refused() {
    let keys = |n: usize| -> Vec<String> { (0..n).map(|i| format!("k{i}")).collect() };
    let timeout = Duration::from_secs(1);
    for (n, allowed) in [(MAX_READ_KEYS - 1, true), (MAX_READ_KEYS, true), (MAX_READ_KEYS + 1, false)] {
        for consistency in [Consistency::Local, Consistency::MAJORITY] {
            // Reads asked here: started (a reply or a Read to the replicas) or refused with a typed error.
            let mut a = core("a");
            with_reachable(&mut a, &["b", "c"]);
            let out = sent_after(&mut a, ReplicatorInput::GetMany { keys: keys(n), consistency, timeout, reply: 1 });
            let refused =
                out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { result: Err(Error::Codec(_)), .. }));
            let started = out.iter().any(|x| match x {
                ReplicatorAction::ReplyGetMany { result: Ok(v), .. } => v.len() == n,
                ReplicatorAction::Broadcast { msg: ReplicatorMsg::Read { keys, .. }, .. } => keys.len() == n,
                _ => false,
            });
            assert_eq!((started, refused), (allowed, !allowed), "GetMany of {n} keys at {consistency:?}");

            let mut a = core("a");
            with_reachable(&mut a, &["b", "c"]);
            let updates = keys(n).into_iter().map(|k| (k, add("x"))).collect();
            let out = sent_after(&mut a, ReplicatorInput::UpdateAndGetMany { updates, consistency, timeout, reply: 1 });
            let refused =
                out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { result: Err(Error::Codec(_)), .. }));
            let started = out.iter().any(|x| match x {
                ReplicatorAction::ReplyGetMany { result: Ok(v), .. } => v.len() == n,
                ReplicatorAction::Broadcast { msg: ReplicatorMsg::MergeThenRead { keys, .. }, .. } => keys.len() == n,
                _ => false,
            });
            assert_eq!((started, refused), (allowed, !allowed), "UpdateAndGetMany of {n} keys at {consistency:?}");
            assert_eq!(a.local_value("k0").is_some(), allowed, "a refused update writes nothing ({n} keys)");
        }
        // Reads asked by a peer: answered, or refused and counted.
        for msg in [
            ReplicatorMsg::Read { op: 1, keys: keys(n) },
            ReplicatorMsg::MergeThenRead { op: 1, keys: keys(n), entries: vec![], values: vec![] },
        ] {
            let what = kind(&msg);
            let mut b = core("b");
            let out = sent_after(&mut b, ReplicatorInput::Remote { from: peer("a"), msg });
            let answered: usize = read_results(&out).iter().map(Vec::len).sum();
            assert_eq!(answered, if allowed { n } else { 0 }, "{what} of {n} keys");
            assert_eq!(rejected(&b), u64::from(!allowed), "{what} of {n} keys");
        }
    }
}

/// A peer's `MergeThenRead` may write only keys it reads, and at most as many writes (deltas
/// and full values) as keys read; otherwise it is refused and counted, and nothing is answered:
/// more writes than keys merge nothing, a key not read is never merged. Fewer writes than keys
/// read is fine.
#[test]
fn merge_then_read_rejects_writes_to_keys_it_does_not_read_and_more_writes_than_keys() {
    // Writes come from a writer's real update of "k", "j" and "other".
    let mut writer = core("w");
    for key in ["k", "j", "other"] {
        local(&mut writer, key, add("x"));
    }
    let delta = |key: &str| (key.to_string(), writer.pending_deltas[key].clone());
    let value = |key: &str| (key.to_string(), writer.local_value(key).cloned().unwrap());
    // (keys read, deltas, values, answered)
    let cases = vec![
        (vec!["k"], vec![], vec![], true),
        (vec!["k"], vec!["k"], vec![], true),
        (vec!["k"], vec![], vec!["k"], true),
        (vec!["k", "j"], vec!["k"], vec!["j"], true),
        (vec!["k", "j"], vec!["j"], vec![], true),
        (vec!["k", "j", "other"], vec!["k", "j"], vec!["other"], true),
        // Writes to a key that is not read.
        (vec!["k"], vec!["other"], vec![], false),
        (vec!["k"], vec![], vec!["other"], false),
        (vec!["k", "j"], vec!["k"], vec!["other"], false),
        // More writes than keys read (the same key twice).
        (vec!["k"], vec!["k", "k"], vec![], false),
        (vec!["k"], vec![], vec!["k", "k"], false),
        (vec!["k"], vec!["k"], vec!["k"], false),
        (vec!["k"], vec!["k", "k"], vec!["k"], false),
        (vec!["k", "j"], vec!["k", "j"], vec!["k"], false),
    ];
    for (keys, deltas, values, answered) in cases {
        let what = format!("read {keys:?}, deltas {deltas:?}, values {values:?}");
        let mut b = core("b");
        let msg = ReplicatorMsg::MergeThenRead {
            op: 1,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            entries: deltas.iter().map(|k| delta(k)).collect(),
            values: values.iter().map(|k| value(k)).collect(),
        };
        let out = sent_after(&mut b, ReplicatorInput::Remote { from: peer("a"), msg });
        let results = read_results(&out);
        assert_eq!(rejected(&b), u64::from(!answered), "{what}: {out:?}");
        let written: Vec<&str> = deltas.iter().chain(&values).copied().collect();
        if answered {
            let [result] = &results[..] else { panic!("{what}: one ReadResult, got {out:?}") };
            let indexes: Vec<u32> = result.iter().map(|(i, _)| *i).collect();
            assert_eq!(indexes, (0..keys.len() as u32).collect::<Vec<_>>(), "{what}");
            for ((_, v), key) in result.iter().zip(&keys) {
                assert_eq!(v.as_ref(), writer.local_value(key).filter(|_| written.contains(key)), "{what}: {key}");
                assert_eq!(v.as_ref(), b.local_value(key), "{what}: {key} answered as stored");
            }
        } else {
            assert!(results.is_empty(), "{what}: {out:?}");
            // Too many writes: nothing is merged; a key not read: never merged.
            let over = written.len() > keys.len();
            for key in written.iter().filter(|k| over || !keys.contains(k)) {
                assert_eq!(b.local_value(key), None, "{what}: {key} was merged");
            }
        }
    }
}

/// An `UpdateAndGetMany` among replicas sends one `MergeThenRead` to each reachable replica,
/// carrying a delta per changed key and a full value per unchanged key: the stats count each
/// of them once per replica.
#[test]
fn update_and_get_counts_one_delta_and_one_value_per_reachable_replica() {
    // (reachable replicas, changed keys, unchanged keys)
    for (reachable, changed, unchanged) in [(2, 1, 3), (3, 2, 2), (4, 3, 1), (2, 2, 0), (3, 0, 2)] {
        let what = format!("{reachable} replicas, {changed} deltas, {unchanged} values");
        let mut a = core("a");
        let peers: Vec<String> = (0..reachable).map(|i| format!("p{i}")).collect();
        with_reachable(&mut a, &peers.iter().map(String::as_str).collect::<Vec<_>>());
        let same: Vec<String> = (0..unchanged).map(|i| format!("same-{i}")).collect();
        for key in &same {
            local(&mut a, key, add("x"));
        }
        a.pending_deltas.clear(); // Shipped already: the unchanged keys go as full values.
        let mut updates: Vec<(String, Modify)> = (0..changed).map(|i| (format!("new-{i}"), add("x"))).collect();
        updates.extend(same.iter().map(|k| (k.clone(), add("x"))));
        let input = ReplicatorInput::UpdateAndGetMany {
            updates,
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            reply: 1,
        };
        let out = sent_after(&mut a, input);
        let sent = out.iter().find_map(|x| match x {
            ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::MergeThenRead { entries, values, .. } } => {
                Some((to.len(), entries.len(), values.len()))
            }
            _ => None,
        });
        assert_eq!(sent, Some((reachable, changed, unchanged)), "{what}: {out:?}");
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed) as usize;
        assert_eq!(load(&a.stats.deltas_sent), reachable * changed, "{what}: deltas sent");
        assert_eq!(load(&a.stats.full_values_sent), reachable * unchanged, "{what}: full values sent");
    }
}

/// Checks that `parts` (each a list of indexes into `sizes`) are the greedy split of every item
/// in order under `budget`: each part within the budget unless alone, and the first item of
/// each next part would have taken the part before past it.
fn assert_greedy_split(parts: &[Vec<usize>], sizes: &[usize], budget: usize, what: &str) {
    let all: Vec<usize> = parts.concat();
    assert_eq!(all, (0..sizes.len()).collect::<Vec<_>>(), "{what}, budget {budget}: every item once, in order");
    let bytes = |part: &[usize]| part.iter().map(|i| sizes[*i]).sum::<usize>();
    for part in parts {
        assert!(bytes(part) <= budget || part.len() == 1, "{what}, budget {budget}: part {part:?} is over");
    }
    for pair in parts.windows(2) {
        let next = sizes[pair[1][0]];
        assert!(
            bytes(&pair[0]) + next > budget,
            "{what}, budget {budget}: {:?} would have fit in {:?}",
            pair[1][0],
            pair[0]
        );
    }
}

/// Budgets around the edges of `sizes`: 1, each prefix sum and one byte less, and a roomy one.
fn budget_edges_of(sizes: &[usize]) -> Vec<usize> {
    let mut budgets = vec![1, 1 << 20];
    let mut sum = 0;
    for s in sizes {
        sum += s;
        budgets.extend([sum - 1, sum]);
    }
    budgets
}

/// A replica's answer to a `Read` is split in `ReadResult`s of at most `max_message_bytes`
/// (an index costs 8 bytes, a value its approximate size), and a reader repairs a stale replica
/// with `Gossip`s of at most the same budget (each entry its key's length plus its value's size).
#[test]
fn read_results_and_read_repairs_split_at_the_message_budget_counting_key_and_value_bytes() {
    // Values of several sizes, and keys without a value.
    let members = [3, 0, 12, 1, 0, 7, 2];
    let keys: Vec<String> = (0..members.len()).map(|i| format!("a-longer-key-name-{i}")).collect();
    let mut holder = core("b");
    for (key, n) in keys.iter().zip(members) {
        if n > 0 {
            local(&mut holder, key, or_add((0..n).map(|i| format!("entity-{i}")).collect()));
        }
    }
    let value_sizes: Vec<usize> =
        keys.iter().map(|k| holder.local_value(k).map_or(0, ReplicatedData::approx_bytes)).collect();

    // The answer to a Read: 8 bytes per index plus the value.
    let sizes: Vec<usize> = value_sizes.iter().map(|v| 8 + v).collect();
    for budget in budget_edges_of(&sizes) {
        holder.settings.max_message_bytes = budget;
        let read = ReplicatorMsg::Read { op: 1, keys: keys.clone() };
        let out = sent_after(&mut holder, ReplicatorInput::Remote { from: peer("a"), msg: read });
        let parts = read_results(&out);
        for (i, v) in parts.iter().flatten() {
            assert_eq!(v.as_ref(), holder.local_value(&keys[*i as usize]), "budget {budget}: index {i}");
        }
        let parts: Vec<Vec<usize>> = parts.iter().map(|p| p.iter().map(|(i, _)| *i as usize).collect()).collect();
        assert_greedy_split(&parts, &sizes, budget, "ReadResult");
    }
    let total: usize = sizes.iter().sum();
    for (budget, messages) in [(total, 1), (total - 1, 2)] {
        holder.settings.max_message_bytes = budget;
        let read = ReplicatorMsg::Read { op: 1, keys: keys.clone() };
        let out = sent_after(&mut holder, ReplicatorInput::Remote { from: peer("a"), msg: read });
        assert_eq!(read_results(&out).len(), messages, "ReadResult, budget {budget} of {total} bytes");
    }

    // The repair of a replica that answered every key empty: the key's length plus the value.
    let stale: Vec<&String> = keys.iter().filter(|k| holder.local_value(k).is_some()).collect();
    let sizes: Vec<usize> = keys.iter().zip(&value_sizes).filter(|(_, v)| **v > 0).map(|(k, v)| k.len() + v).collect();
    let repairs = |budget: usize| -> Vec<GossipEntriesOf> {
        let mut reader = core("r");
        for k in &stale {
            copy_value(&holder, &mut reader, k);
        }
        reader.settings.max_message_bytes = budget;
        with_reachable(&mut reader, &["b", "c"]);
        let get = ReplicatorInput::GetMany {
            keys: keys.clone(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            reply: 1,
        };
        let (op, _) = read_op(&sent_after(&mut reader, get));
        let values = (0..keys.len() as u32).map(|i| (i, None)).collect();
        let msg = ReplicatorMsg::ReadResult { op, values };
        let out = sent_after(&mut reader, ReplicatorInput::Remote { from: peer("c"), msg });
        assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGetMany { reply: 1, result: Ok(_) })), "{out:?}");
        out.into_iter()
            .filter_map(|x| match x {
                ReplicatorAction::Send { to, msg: ReplicatorMsg::Gossip { entries, .. } } => {
                    assert_eq!(to.address, peer("c").address, "only the replica that answered");
                    Some(entries)
                }
                _ => None,
            })
            .collect()
    };
    for budget in budget_edges_of(&sizes) {
        let parts = repairs(budget);
        for (k, v) in parts.iter().flatten() {
            assert_eq!(Some(v), holder.local_value(k), "budget {budget}: {k}");
        }
        let parts: Vec<Vec<usize>> = parts
            .iter()
            .map(|p| p.iter().map(|(k, _)| stale.iter().position(|s| *s == k).unwrap()).collect())
            .collect();
        assert_greedy_split(&parts, &sizes, budget, "read repair");
    }
    let total: usize = sizes.iter().sum();
    for (budget, messages) in [(total, 1), (total - 1, 2)] {
        assert_eq!(repairs(budget).len(), messages, "read repair, budget {budget} of {total} bytes");
    }
}

/// Keys and values a repair `Gossip` carries.
type GossipEntriesOf = Vec<(String, ReplicatedData)>;

#[test]
fn read_repair_sends_the_merged_value_only_to_the_replicas_that_answered_stale() {
    let mut a = core("a");
    let mut b = core("b");
    local(&mut b, "k", add("from-b"));
    let peers = ["b", "c", "d", "e"].map(|p| (peer(p), true)).to_vec();
    tell_replicas(&mut a, peers, Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    let get = ReplicatorInput::Get {
        key: "k".into(),
        consistency: Consistency::MAJORITY,
        timeout: Duration::from_secs(1),
        reply: 5,
    };
    a.handle(get, Instant::now(), 1, &mut out);
    let (op, _) = read_op(&out);
    let mut out = Vec::new();
    let fresh = b.local_value("k").cloned();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::ReadResult { op, values: vec![(0, fresh)] } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(out.is_empty(), "2 of 3 needed");
    // c has never seen the key: it is stale and must be repaired; b is not.
    a.handle(
        ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::ReadResult { op, values: vec![(0, None)] } },
        Instant::now(),
        1,
        &mut out,
    );
    let repaired: Vec<String> = out
        .iter()
        .filter_map(|x| match x {
            ReplicatorAction::Send { to, msg: ReplicatorMsg::Gossip { entries, .. } } if entries.len() == 1 => {
                Some(to.address.node_id.to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(repaired, ["c"]);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyGet { reply: 5, result: Ok(Some(_)) })));
}

/// "a" among five replicas, all reachable, sends `input`; b, c and d answer, then e. Returns
/// whether "a" replied after the first three, and after all four.
fn replies_after_three_then_four(input: ReplicatorInput<u32>) -> (bool, bool) {
    let mut a = core_with_replicas("a", ["b", "c", "d", "e"].iter().map(|p| (peer(p), true)).collect());
    let mut out = Vec::new();
    a.handle(input, Instant::now(), 1, &mut out);
    commit_all(&mut a, &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg, to } if to.len() == 4 => Some(msg.clone()),
            _ => None,
        })
        .expect("one message to every reachable replica");
    let replied = |out: &[ReplicatorAction<u32>]| {
        out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. } | ReplicatorAction::ReplyGetMany { .. }))
    };
    let mut after = Vec::new();
    for p in ["b", "c", "d", "e"] {
        let mut replica = core(p);
        let mut answer = Vec::new();
        replica.handle(ReplicatorInput::Remote { from: peer("a"), msg: msg.clone() }, Instant::now(), 1, &mut answer);
        commit_all(&mut replica, &mut answer);
        let mut replies = Vec::new();
        for x in answer {
            if let ReplicatorAction::Send { msg, .. } = x {
                a.handle(ReplicatorInput::Remote { from: peer(p), msg }, Instant::now(), 1, &mut replies);
            }
        }
        commit_all(&mut a, &mut replies);
        after.push(replied(&replies));
    }
    (after[..3].iter().any(|r| *r), after[3])
}

#[test]
fn reads_and_writes_at_all_reachable_wait_for_every_reachable_replica() {
    let all_reachable = Consistency::AllReachable { plus: 0, min_cap: 0 };
    let timeout = Duration::from_secs(1);
    let get = |consistency| ReplicatorInput::GetMany { keys: vec!["k".into()], consistency, timeout, reply: 1 };
    let put = |consistency| ReplicatorInput::UpdateMany {
        updates: vec![("k".into(), add("x"))],
        consistency,
        timeout,
        reply: 1,
    };
    assert_eq!(replies_after_three_then_four(get(all_reachable)), (false, true), "a read waits for e");
    assert_eq!(replies_after_three_then_four(put(all_reachable)), (false, true), "a write waits for e");
    // A majority is done after the first two or three.
    assert!(replies_after_three_then_four(get(Consistency::MAJORITY)).0);
    assert!(replies_after_three_then_four(put(Consistency::MAJORITY)).0);
}
