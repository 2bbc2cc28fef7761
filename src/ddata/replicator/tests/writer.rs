//! The store writer of durable OR-sets: one writer per store across restarts, counters used
//! only below a durably reserved ceiling.
use super::super::writer::RESERVE_AHEAD;
use super::*;
use crate::ddata::durable::{CounterReservation, DurableStore, StoreOp};

const KEY: &str = "shard-t/1/0";

fn writer_with(floor: u64, ceiling: u64) -> StoreWriter {
    StoreWriter::new("a", CounterReservation { store_id: 7, floor, ceiling })
}

fn core_with(writer: StoreWriter) -> ReplicatorCore<u32> {
    ReplicatorCore::new(
        UniqueAddress::new("a", 1),
        writer,
        CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1)),
        Arc::new(ReplicatorStatCells::default()),
    )
}

fn reply(out: &[ReplicatorAction<u32>]) -> Option<Result<(), &Error>> {
    out.iter().find_map(|a| match a {
        ReplicatorAction::ReplyUpdate { result, .. } => Some(result.as_ref().map(|fenced| assert!(fenced.is_empty()))),
        _ => None,
    })
}

fn reservation(out: &[ReplicatorAction<u32>]) -> Option<(u64, u64)> {
    out.iter().find_map(|a| match a {
        ReplicatorAction::ReserveCounters { ticket, ceiling } => Some((*ticket, *ceiling)),
        _ => None,
    })
}

fn ids(from: usize, n: usize) -> Vec<String> {
    (from..from + n).map(|i| format!("e{i}")).collect()
}

fn set_of<'a>(c: &'a ReplicatorCore<u32>, key: &str) -> &'a OrSet {
    match c.local_value(key) {
        Some(ReplicatedData::OrSet(s)) => s,
        other => panic!("no OR-set under {key}: {other:?}"),
    }
}

/// Performs persists and reservations against `store` as the driver does, then reports them
/// committed.
fn persist_to(store: &DurableStore, c: &mut ReplicatorCore<u32>, out: Vec<ReplicatorAction<u32>>) {
    let mut ops = Vec::new();
    for a in out {
        match a {
            ReplicatorAction::Persist { key, ticket, record: PersistRecord::Snapshot } => {
                let bytes = rmp_serde::to_vec(c.local_value(&key).unwrap()).unwrap();
                ops.push(StoreOp::Snapshot { key, seq: ticket, bytes });
            }
            ReplicatorAction::Persist { key, ticket, record: PersistRecord::Delta(d) } => {
                ops.push(StoreOp::Delta { key, seq: ticket, bytes: rmp_serde::to_vec(&d).unwrap() });
            }
            ReplicatorAction::ReserveCounters { ceiling, .. } => ops.push(StoreOp::CounterCeiling { ceiling }),
            _ => {}
        }
    }
    store.apply(&ops).unwrap();
    commit_all(c, &mut Vec::new());
}

#[test]
fn fifty_restarts_with_their_disk_leave_one_writer_per_node_in_a_durable_set() {
    let dir = tempfile::tempdir().unwrap();
    let mut store_ids = std::collections::BTreeSet::new();
    for restart in 0..50u64 {
        let store = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let loaded = store.load_all().unwrap();
        let reserved = store.reserve_counters(RESERVATION_SPAN, false).unwrap();
        assert_eq!(reserved.floor, restart * RESERVATION_SPAN, "each process starts where the last reserved");
        store_ids.insert(reserved.store_id);
        let mut c = ReplicatorCore::new(
            UniqueAddress::new("a", restart + 1),
            StoreWriter::new("a", reserved),
            CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1)),
            Arc::new(ReplicatorStatCells::default()),
        );
        let entries = loaded.entries.into_iter().map(|k| (k.key, k.value, KeyLog::default())).collect();
        c.load(entries, loaded.max_seq);
        let mut out = Vec::new();
        update(&mut c, KEY, Consistency::Local, or_add(ids(restart as usize, 1)), &mut out);
        persist_to(&store, &mut c, out);
    }
    let loaded = DurableStore::open(dir.path(), 1 << 24).unwrap().load_all().unwrap();
    let Some(ReplicatedData::OrSet(set)) = loaded.entries.into_iter().find(|k| k.key == KEY).map(|k| k.value) else {
        panic!("the set is on disk");
    };
    assert_eq!(set.len(), 50);
    assert_eq!(store_ids.len(), 1, "the store keeps its id");
    let writer = format!("a#store-{:016x}", store_ids.first().unwrap());
    assert_eq!(set.writers().collect::<Vec<_>>(), vec![writer.as_str()], "fifty incarnations, one writer");
    assert_eq!(set.cloud_intervals(), 0, "every skipped range was claimed: the context is one counter");
    assert_eq!(set.max_counter_of(&writer), 49 * RESERVATION_SPAN);
}

#[test]
fn durable_keys_are_written_by_the_store_and_other_keys_by_the_incarnation() {
    let mut c = core_with(writer_with(0, RESERVATION_SPAN));
    local(&mut c, KEY, or_add(ids(0, 2)));
    local(&mut c, "plain", or_add(ids(0, 2)));
    assert_eq!(set_of(&c, KEY).max_counter_of("a#store-0000000000000007"), 2);
    assert_eq!(set_of(&c, KEY).max_counter_of("a#1"), 0);
    assert_eq!(set_of(&c, "plain").max_counter_of("a#1"), 2);
    assert_eq!(set_of(&c, "plain").writers().collect::<Vec<_>>(), vec!["a#1"]);
}

#[test]
fn the_first_add_of_a_restarted_store_writer_starts_at_its_floor() {
    let mut c = core_with(writer_with(5_000, 5_000 + RESERVATION_SPAN));
    local(&mut c, KEY, or_add(ids(0, 1)));
    assert_eq!(set_of(&c, KEY).max_counter_of("a#store-0000000000000007"), 5_000);
    assert_eq!(set_of(&c, KEY).cloud_intervals(), 0);
}

#[test]
fn counters_near_the_ceiling_are_reserved_ahead_and_used_only_once_the_reservation_commits() {
    let mut c = core_with(writer_with(0, 5));
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(ids(0, 3)), &mut out);
    let (ticket, ceiling) = reservation(&out).expect("within the margin of the ceiling: reserve more");
    assert_eq!(ceiling, 5 + RESERVATION_SPAN);
    commit_ticket_below(&mut c, ticket);
    // Counter 4 is below the ceiling; 5 and 6 are not reserved yet.
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(ids(3, 3)), &mut out);
    assert!(reservation(&out).is_none(), "one extension at a time");
    assert!(matches!(reply(&out), Some(Err(Error::Storage { .. }))), "refused adds fail the update: {out:?}");
    assert_eq!(c.stats.refused_adds.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(set_of(&c, KEY).contains("e3") && !set_of(&c, KEY).contains("e4"));
    let mut done = Vec::new();
    c.handle(ReplicatorInput::Persisted { through: ticket, failure: None }, Instant::now(), 0, &mut done);
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(ids(4, 2)), &mut out);
    commit_all(&mut c, &mut out);
    assert!(matches!(reply(&out), Some(Ok(()))), "{out:?}");
    assert!(set_of(&c, KEY).contains("e5"));
}

#[test]
fn a_reservation_whose_commit_failed_is_asked_for_again_by_the_next_update() {
    let mut c = core_with(writer_with(0, 10));
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(ids(0, 1)), &mut out);
    let (first, _) = reservation(&out).unwrap();
    fail_all(&mut c, &mut Vec::new());
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(ids(1, 1)), &mut out);
    let (second, ceiling) = reservation(&out).expect("asked for again");
    assert!(second > first);
    assert_eq!(ceiling, 10 + RESERVATION_SPAN, "the failed one reserved nothing");
}

/// Reports every ticket below `ticket` committed (the reservation's stays in flight).
fn commit_ticket_below(c: &mut ReplicatorCore<u32>, ticket: u64) {
    c.handle(ReplicatorInput::Persisted { through: ticket - 1, failure: None }, Instant::now(), 0, &mut Vec::new());
}

#[test]
fn an_extension_is_asked_for_exactly_when_the_used_counter_comes_within_the_margin_of_the_ceiling() {
    // The first add uses the floor, 1_000.
    for (ceiling, asked) in [(1_000 + RESERVE_AHEAD + 1, false), (1_000 + RESERVE_AHEAD, true)] {
        let mut c = core_with(writer_with(1_000, ceiling));
        let mut out = Vec::new();
        update(&mut c, KEY, Consistency::Local, or_add(ids(0, 1)), &mut out);
        assert_eq!(set_of(&c, KEY).max_counter_of("a#store-0000000000000007"), 1_000);
        assert_eq!(reservation(&out).is_some(), asked, "ceiling {ceiling}: {out:?}");
    }
}

#[test]
fn an_update_adding_a_member_too_long_to_decode_fails_as_a_bad_request_and_keeps_the_rest() {
    let mut c = core_with(writer_with(0, RESERVATION_SPAN));
    let too_long = "x".repeat(crate::ddata::orset::MAX_ELEMENT_LEN + 1);
    let mut out = Vec::new();
    update(&mut c, KEY, Consistency::Local, or_add(vec!["e0".into(), too_long.clone()]), &mut out);
    let answer = reply(&out);
    assert!(matches!(&answer, Some(Err(Error::BadRequest(why))) if why.contains("longer than")), "{out:?}");
    assert_eq!(c.stats.refused_adds.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(set_of(&c, KEY).contains("e0") && !set_of(&c, KEY).contains(&too_long));
}
