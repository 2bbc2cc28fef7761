//! Durability in the replicator core: acks and replies held until the commit, failures,
//! the snapshot-or-delta choice and the log's trims.
use super::*;
use crate::ddata::replicator::durability::{MAX_LOG_RECORDS, REWRITE_BACKOFF};
fn tickets(out: &[ReplicatorAction<u32>]) -> Vec<(String, u64, bool)> {
    out.iter()
        .filter_map(|a| match a {
            ReplicatorAction::Persist { key, ticket, record } => {
                Some((key.clone(), *ticket, matches!(record, PersistRecord::Snapshot)))
            }
            _ => None,
        })
        .collect()
}

fn delta_write(key: &str, member: &str, op: u64) -> ReplicatorMsg {
    let mut src = core("w");
    local(&mut src, key, or_add(vec![member.to_string()]));
    let entries = std::mem::take(&mut src.pending_deltas).into_iter().collect();
    ReplicatorMsg::WriteDelta { op, entries, values: vec![] }
}

#[test]
fn a_replica_acknowledges_a_durable_write_only_after_its_commit_and_a_plain_key_at_once() {
    let mut b = core("b");
    let mut out = Vec::new();
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: delta_write("shard-t/1/0", "e1", 1) },
        Instant::now(),
        1,
        &mut out,
    );
    assert_eq!(tickets(&out).len(), 1);
    assert!(!out.iter().any(is_ack));
    assert_eq!(b.durability_backlog(), (1, 1));
    let mut out = Vec::new();
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: delta_write("plain", "e1", 2) },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(tickets(&out).is_empty() && out.iter().any(is_ack), "not durable: acknowledged at once");
    let mut out = Vec::new();
    commit_all(&mut b, &mut out);
    assert!(matches!(&out[..], [ReplicatorAction::Send { msg: ReplicatorMsg::WriteAck { op: 1 }, .. }]));
    assert_eq!(b.durability_backlog(), (0, 0));
}

#[test]
fn a_duplicate_delta_is_acknowledged_only_once_its_first_arrival_is_committed() {
    let mut b = core("b");
    let mut out = Vec::new();
    let write = delta_write("shard-t/1/0", "e1", 1);
    let ReplicatorMsg::WriteDelta { entries, .. } = write.clone() else { unreachable!() };
    // First as propagation (persist in flight), then as a majority write that changes nothing.
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: ReplicatorMsg::DeltaPropagation { entries } },
        Instant::now(),
        1,
        &mut out,
    );
    assert_eq!(tickets(&out).len(), 1);
    let mut out = Vec::new();
    b.handle(ReplicatorInput::Remote { from: peer("a"), msg: write }, Instant::now(), 1, &mut out);
    assert!(tickets(&out).is_empty(), "nothing new to write");
    assert!(!out.iter().any(is_ack), "but the first write is not committed yet");
    commit_all(&mut b, &mut out);
    assert!(out.iter().any(is_ack));
}

#[test]
fn a_writer_whose_own_commit_failed_answers_a_storage_error_despite_a_majority_of_acks() {
    let mut a = core_with_replicas("a", vec![(peer("b"), true), (peer("c"), true)]);
    commit_all(&mut a, &mut vec![]);
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::MAJORITY, or_add(vec!["e1".into()]), &mut out);
    let op = write_op(&out);
    let mut out = Vec::new();
    fail_all(&mut a, &mut out);
    assert!(tickets(&out).is_empty(), "the rewrite waits for its backoff");
    // A majority acknowledged, but the key is not on the writer's own disk.
    let mut out = Vec::new();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(
        matches!(&out[..], [ReplicatorAction::ReplyUpdate { result: Err(Error::Storage { .. }), .. }]),
        "a storage error, not a success: {out:?}"
    );
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, Instant::now() + REWRITE_BACKOFF.0, 0, &mut out);
    let rewrite = tickets(&out);
    assert_eq!(rewrite.len(), 1, "the failed key is written again");
    assert!(rewrite[0].2, "as a snapshot");
    let mut out = Vec::new();
    commit_all(&mut a, &mut out);
    assert!(out.is_empty(), "nothing answered twice");
    assert_eq!(a.durability_backlog(), (0, 0));
}

#[test]
fn a_failed_commit_withholds_the_replicas_ack() {
    let mut b = core("b");
    let mut out = Vec::new();
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: delta_write("shard-t/1/0", "e1", 1) },
        Instant::now(),
        1,
        &mut out,
    );
    let mut out = Vec::new();
    fail_all(&mut b, &mut out);
    assert!(!out.iter().any(is_ack));
    // A retry that changes nothing, while the key waits for its rewrite: still no ack.
    let mut out = Vec::new();
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: delta_write("shard-t/1/0", "e1", 2) },
        Instant::now(),
        1,
        &mut out,
    );
    commit_all(&mut b, &mut out);
    assert!(!out.iter().any(is_ack), "not on this disk yet: {out:?}");
    let mut out = Vec::new();
    b.handle(ReplicatorInput::Tick, Instant::now() + REWRITE_BACKOFF.0, 0, &mut out);
    assert_eq!(tickets(&out).len(), 1, "written again");
    // The writer retries; this time the commit works and the retry is acknowledged.
    let mut out = Vec::new();
    b.handle(
        ReplicatorInput::Remote { from: peer("a"), msg: delta_write("shard-t/1/0", "e1", 3) },
        Instant::now(),
        1,
        &mut out,
    );
    commit_all(&mut b, &mut out);
    assert!(matches!(&out[..], [.., ReplicatorAction::Send { msg: ReplicatorMsg::WriteAck { op: 3 }, .. }]), "{out:?}");
}

#[test]
fn a_local_update_answers_after_its_commit() {
    let mut a = core("a");
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::Local, or_add(vec!["e1".into()]), &mut out);
    assert!(!out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. })));
    commit_all(&mut a, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { result: Ok(f), .. } if f.is_empty())));
}

#[test]
fn deltas_go_to_the_log_until_it_outgrows_the_snapshot_then_a_snapshot_replaces_it() {
    let mut a = core("a");
    let mut out = Vec::new();
    let ids: Vec<String> = (0..2000).map(|i| format!("entity-{i:05}")).collect();
    update(&mut a, "shard-t/1/0", Consistency::Local, or_add(ids), &mut out);
    assert!(tickets(&out)[0].2, "a new key starts with a snapshot");
    let snapshot = a.data.get("shard-t/1/0").map(|e| e.value.approx_bytes()).unwrap();
    let mut kinds: Vec<bool> = Vec::new();
    let mut delta_bytes = 0;
    for i in 0..1000 {
        let mut out = Vec::new();
        update(&mut a, "shard-t/1/0", Consistency::Local, or_add(vec![format!("more-{i:05}")]), &mut out);
        let written = tickets(&out)[0].2;
        if !written && kinds.iter().all(|s| !*s) {
            delta_bytes = a.data.get("shard-t/1/0").map_or(0, |e| e.log.log_bytes);
        }
        kinds.push(written);
    }
    let first_snapshot = kinds.iter().position(|s| *s).expect("the log is compacted");
    // ~2,000 ids make a snapshot of ~30 KB, and the log grows to about as much before the next.
    assert!(delta_bytes <= snapshot && delta_bytes > snapshot * 9 / 10, "{delta_bytes} of {snapshot} bytes");
    assert!(first_snapshot > 300, "compacted after {first_snapshot} deltas");
    assert!(kinds.iter().filter(|s| **s).count() <= 3, "a snapshot per log's worth, not per write");
}

#[test]
fn a_full_value_from_anti_entropy_is_persisted_as_a_snapshot() {
    let mut b = core("b");
    let mut src = core("w");
    local(&mut src, "shard-t/1/0", or_add(vec!["e1".into()]));
    let value = src.local_value("shard-t/1/0").unwrap().clone();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::Gossip {
        entries: vec![("shard-t/1/0".into(), value)],
        want: vec![],
        want_buckets: vec![],
        value_buckets: vec![],
    };
    b.handle(ReplicatorInput::Remote { from: peer("a"), msg }, Instant::now(), 1, &mut out);
    assert!(matches!(&tickets(&out)[..], [(_, _, true)]));
}

#[test]
fn tickets_continue_above_the_highest_loaded_delta_sequence() {
    let mut a = core("a");
    let log = KeyLog { last_ticket: 41, snapshot_bytes: 100, log_bytes: 0, log_records: 0, first_log_seq: 0 };
    a.load(vec![("shard-t/1/0".into(), GSet::default().into_data(), log)], 30);
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::Local, add("x"), &mut out);
    assert_eq!(tickets(&out)[0].1, 42);
    assert!(!out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. })));
    commit_all(&mut a, &mut out);
    assert!(out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { result: Ok(f), .. } if f.is_empty())));
}

fn trims(out: &[ReplicatorAction<u32>]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            ReplicatorAction::TrimLog { below } => Some(*below),
            _ => None,
        })
        .collect()
}

#[test]
fn the_log_is_trimmed_below_the_oldest_live_delta_and_a_key_written_once_does_not_pin_it() {
    const MAX_LOG_SPAN: u64 = 3_000;
    let mut a = core("a");
    a.durability.max_log_span = MAX_LOG_SPAN;
    // A key with one live delta (loaded), which nothing writes again.
    let log = KeyLog { last_ticket: 5, snapshot_bytes: 10, log_bytes: 10, log_records: 1, first_log_seq: 5 };
    a.load(vec![("shard-t/quiet/0".into(), GSet::default().into_data(), log)], 5);
    let mut out = Vec::new();
    let mut all_trims = Vec::new();
    let mut quiet_rewritten = false;
    // Hot keys: each write's delta is soon covered by the key's next snapshot.
    for i in 0..(MAX_LOG_SPAN + 3_000) {
        out.clear();
        let key = format!("shard-t/hot/{}", i % 4);
        // Toggles one member, so every write changes the value (and gets a ticket).
        let toggle: Modify = Box::new(|cur, ctx| {
            let Some(ReplicatedData::OrSet(s)) = cur else {
                let mut s = OrSet::default();
                s.add(ctx, "m");
                return Ok(Some(s.into_data()));
            };
            if s.contains("m") {
                s.remove("m")
            } else {
                s.add(ctx, "m")
            }
            Ok(None)
        });
        update(&mut a, &key, Consistency::Local, toggle, &mut out);
        quiet_rewritten |= tickets(&out).iter().any(|(k, _, snap)| k == "shard-t/quiet/0" && *snap);
        assert!(trims(&out).is_empty(), "trims follow commits, never a write");
        commit_all(&mut a, &mut out);
        all_trims.extend(trims(&out));
    }
    assert!(quiet_rewritten, "the key pinning the log was written whole");
    let first_past_pin = all_trims.iter().find(|b| **b > 5).copied();
    assert!(first_past_pin.is_some(), "then the log is trimmed past it: {:?}", &all_trims[..all_trims.len().min(5)]);
    assert!(all_trims.windows(2).all(|w| w[0] < w[1]), "trims only move forward");
    assert!(all_trims.iter().all(|b| *b <= 5) || *all_trims.last().unwrap() > MAX_LOG_SPAN, "{all_trims:?}");
}

#[test]
fn a_failed_snapshot_keeps_the_deltas_it_was_to_cover_until_its_rewrite_commits() {
    let mut a = core("a");
    // A key with live deltas from ticket 5 on, and enough later traffic to trim past it.
    let log = KeyLog { last_ticket: 5, snapshot_bytes: 10, log_bytes: 10, log_records: 1, first_log_seq: 5 };
    a.load(vec![("shard-t/k/0".into(), GSet::default().into_data(), log)], 3_000);
    let mut out = Vec::new();
    // A big change: written whole (the snapshot would cover the delta of ticket 5).
    let ids: Vec<String> = (0..1000).map(|i| format!("id-{i}")).collect();
    a.handle(
        ReplicatorInput::Update {
            key: "shard-t/k/0".into(),
            consistency: Consistency::Local,
            timeout: Duration::from_secs(1),
            modify: Box::new(move |cur, _| {
                let Some(ReplicatedData::GSet(g)) = cur else { unreachable!() };
                for id in ids {
                    g.insert(id);
                }
                Ok(None)
            }),
            reply: 1,
        },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(matches!(&tickets(&out)[..], [(_, 3_001, true)]), "{:?}", tickets(&out));
    assert!(trims(&out).is_empty(), "no trim relies on a snapshot not yet on disk");
    let mut out = Vec::new();
    fail_all(&mut a, &mut out);
    assert!(trims(&out).is_empty(), "nothing trimmed on a failure");
    assert!(tickets(&out).is_empty(), "the rewrite waits for its backoff");
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, Instant::now() + REWRITE_BACKOFF.0, 0, &mut out);
    let rewrite = tickets(&out);
    assert!(matches!(&rewrite[..], [(_, 3_002, true)]));
    let mut out = Vec::new();
    commit_all(&mut a, &mut out);
    assert_eq!(trims(&out), vec![3_003], "the rewrite committed: the log is trimmed past ticket 5");
}

#[test]
fn keys_of_a_failed_commit_are_written_again_after_a_backoff_that_doubles_while_commits_fail() {
    let mut a = core("a");
    let t0 = Instant::now();
    let mut out = Vec::new();
    let add_local = |member: &'static str| ReplicatorInput::Update {
        key: "shard-t/k/0".into(),
        consistency: Consistency::Local,
        timeout: Duration::from_secs(1),
        modify: add(member),
        reply: 0,
    };
    a.handle(add_local("x"), t0, 1, &mut out);
    assert_eq!(tickets(&out).len(), 1);
    let fail = |a: &mut ReplicatorCore<u32>, at: Instant| {
        let mut out = Vec::new();
        let failure = Some((std::path::PathBuf::from("/data"), "map full".to_string()));
        a.handle(ReplicatorInput::Persisted { through: u64::MAX, failure }, at, 0, &mut out);
        assert!(tickets(&out).is_empty(), "no rewrite at once (it would spin on a lasting failure)");
    };
    let rewrites_at = |a: &mut ReplicatorCore<u32>, at: Instant| {
        let mut out = Vec::new();
        a.handle(ReplicatorInput::Tick, at, 0, &mut out);
        tickets(&out).len()
    };
    fail(&mut a, t0);
    let first = REWRITE_BACKOFF.0;
    assert_eq!(rewrites_at(&mut a, t0 + first - Duration::from_millis(1)), 0);
    assert_eq!(rewrites_at(&mut a, t0 + first), 1, "written again once the backoff passed");
    // It fails again: the next rewrite waits twice as long.
    let t1 = t0 + first;
    fail(&mut a, t1);
    assert_eq!(rewrites_at(&mut a, t1 + first), 0, "the backoff doubled");
    assert_eq!(rewrites_at(&mut a, t1 + first * 2), 1);
    // A commit that succeeds resets it.
    let t2 = t1 + first * 2;
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Persisted { through: u64::MAX, failure: None }, t2, 0, &mut out);
    a.handle(add_local("y"), t2, 1, &mut out);
    fail(&mut a, t2);
    assert_eq!(rewrites_at(&mut a, t2 + first), 1, "back to the first backoff after a success");
}

#[test]
fn a_new_change_to_a_key_waiting_for_its_rewrite_is_written_whole_and_is_the_rewrite() {
    let mut a = core("a");
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::Local, or_add(vec!["e1".into()]), &mut out);
    let mut out = Vec::new();
    fail_all(&mut a, &mut out);
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::Local, or_add(vec!["e2".into()]), &mut out);
    let written = tickets(&out);
    assert!(matches!(&written[..], [(_, _, true)]), "a snapshot (it carries e1 too), not a delta: {written:?}");
    let mut out = Vec::new();
    commit_all(&mut a, &mut out);
    assert!(matches!(&out[..], [ReplicatorAction::ReplyUpdate { result: Ok(f), .. }] if f.is_empty()), "{out:?}");
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, Instant::now() + REWRITE_BACKOFF.1, 0, &mut out);
    assert!(tickets(&out).is_empty(), "no second rewrite");
}

#[test]
fn a_key_logs_exactly_max_log_records_deltas_before_a_snapshot_when_bytes_allow_more() {
    let mut a = core("a");
    let mut out = Vec::new();
    // A snapshot of ~300 KB holds far more one-id deltas than the record cap.
    let ids: Vec<String> = (0..20_000).map(|i| format!("entity-{i:05}")).collect();
    update(&mut a, "shard-t/1/0", Consistency::Local, or_add(ids), &mut out);
    let mut kinds = Vec::new();
    for i in 0..MAX_LOG_RECORDS + 50 {
        let mut out = Vec::new();
        update(&mut a, "shard-t/1/0", Consistency::Local, or_add(vec![format!("more-{i:05}")]), &mut out);
        kinds.push(tickets(&out)[0].2);
    }
    assert_eq!(kinds.iter().position(|s| *s), Some(MAX_LOG_RECORDS as usize), "the write after the cap's last delta");
}

#[test]
fn a_quiet_key_with_a_live_delta_is_not_written_whole_within_the_default_log_span() {
    let mut a = core("a");
    let log = KeyLog { last_ticket: 5, snapshot_bytes: 10, log_bytes: 10, log_records: 1, first_log_seq: 5 };
    a.load(vec![("shard-t/quiet/0".into(), GSet::default().into_data(), log)], 5);
    for i in 0..500 {
        let mut out = Vec::new();
        update(&mut a, &format!("shard-t/hot/{i}"), Consistency::Local, or_add(vec!["m".into()]), &mut out);
        assert!(!tickets(&out).iter().any(|(k, _, _)| k == "shard-t/quiet/0"), "rewritten after {i} writes");
        commit_all(&mut a, &mut out);
    }
}
