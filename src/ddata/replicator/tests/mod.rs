//! Table tests of the replicator core on a fake clock.
use super::*;
use crate::ddata::crdt::{Crdt, GSet, OrSet};

fn peer(id: &str) -> PeerAddr {
    PeerAddr { address: UniqueAddress::new(id, 1), messaging_addr: "127.0.0.1:1".parse().unwrap() }
}

/// A fresh store's writer (nothing reserved before).
fn fresh_store(id: &str) -> StoreWriter {
    let reservation = crate::ddata::durable::CounterReservation { store_id: 7, floor: 0, ceiling: RESERVATION_SPAN };
    StoreWriter::new(id, reservation)
}

fn core(id: &str) -> ReplicatorCore<u32> {
    ReplicatorCore::new(
        UniqueAddress::new(id, 1),
        fresh_store(id),
        CoreSettings::new(vec!["shard-".into()], Duration::from_secs(1)),
        Arc::new(ReplicatorStatCells::default()),
    )
}

/// `core(id)` told its replicas (with whether each is reachable) and nothing else.
fn core_with_replicas(id: &str, replicas: Vec<(PeerAddr, bool)>) -> ReplicatorCore<u32> {
    let mut c = core(id);
    tell_replicas(&mut c, replicas, Instant::now(), 0, &mut vec![]);
    c
}

/// Tells `c` it holds a replica among `replicas` (with whether each is reachable), with no
/// gossip targets, standing or leaving members.
fn tell_replicas(
    c: &mut ReplicatorCore<u32>,
    replicas: Vec<(PeerAddr, bool)>,
    now: Instant,
    wall_ms: u64,
    out: &mut Vec<ReplicatorAction<u32>>,
) {
    let members =
        ReplicatorInput::Members { holder: true, replicas, gossip_targets: vec![], standing: vec![], leaving: vec![] };
    c.handle(members, now, wall_ms, out);
}

fn add(member: &'static str) -> Modify {
    Box::new(move |cur, _ctx| match cur {
        Some(ReplicatedData::GSet(s)) => {
            s.insert(member);
            Ok(None)
        }
        Some(other) => Err(Error::WrongDataType { key: "k".into(), expected: "GSet", found: other.type_name() }),
        None => {
            let mut s = GSet::default();
            s.insert(member);
            Ok(Some(s.into_data()))
        }
    })
}

/// Reports every persist issued so far as committed (as the persist thread does).
fn commit_all(c: &mut ReplicatorCore<u32>, out: &mut Vec<ReplicatorAction<u32>>) {
    c.handle(ReplicatorInput::Persisted { through: u64::MAX, failure: None }, Instant::now(), 0, out);
}

fn fail_all(c: &mut ReplicatorCore<u32>, out: &mut Vec<ReplicatorAction<u32>>) {
    let failure = Some((std::path::PathBuf::from("/data"), "disk on fire".to_string()));
    c.handle(ReplicatorInput::Persisted { through: u64::MAX, failure }, Instant::now(), 0, out);
}

fn is_ack(a: &ReplicatorAction<u32>) -> bool {
    matches!(a, ReplicatorAction::Send { msg: ReplicatorMsg::WriteAck { .. }, .. })
}

fn read_op(out: &[ReplicatorAction<u32>]) -> (u64, Vec<String>) {
    out.iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::Read { op, keys }, .. } => Some((*op, keys.clone())),
            _ => None,
        })
        .expect("a Read")
}

/// The op of the `WriteDelta` among `out`.
fn write_op(out: &[ReplicatorAction<u32>]) -> u64 {
    out.iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { op, .. }, .. } => Some(*op),
            _ => None,
        })
        .expect("a WriteDelta")
}

#[test]
fn majority_formula_matches_akka_plus_and_min_cap() {
    let c = Consistency::Majority { plus: 3, min_cap: 5 };
    assert_eq!(c.needed(1), 1);
    assert_eq!(c.needed(3), 3);
    assert_eq!(c.needed(5), 5);
    assert_eq!(c.needed(10), 9);
    assert_eq!(c.needed(20), 14);
    assert_eq!(Consistency::MAJORITY.needed(5), 3);
    assert_eq!(Consistency::MAJORITY.needed(4), 3);
    assert_eq!(Consistency::All.needed(4), 4);
}

#[test]
fn all_reachable_needs_every_reachable_replica_but_never_fewer_than_its_majority_floor() {
    let c = Consistency::AllReachable { plus: 1, min_cap: 0 };
    // (members, reachable including this node) -> needed
    for (n, reachable, needed) in [(5, 5, 5), (5, 4, 4), (5, 2, 4), (5, 7, 5), (1, 1, 1), (3, 3, 3), (3, 1, 3)] {
        assert_eq!(c.needed_of(n, reachable), needed, "{n} members, {reachable} reachable");
    }
    assert_eq!(c.needed(5), 4, "alone it is its floor");
    let floor = Consistency::AllReachable { plus: 0, min_cap: 6 };
    assert_eq!(floor.needed_of(9, 2), 6);
    // Other levels ignore reachability.
    assert_eq!(Consistency::MAJORITY.needed_of(5, 5), 3);
    assert_eq!(Consistency::All.needed_of(5, 2), 5);
    assert_eq!(Consistency::Local.needed_of(5, 5), 1);
}

#[test]
fn majority_write_completes_on_enough_acks_and_times_out_otherwise() {
    let mut c =
        core_with_replicas("a", vec![(peer("b"), true), (peer("c"), true), (peer("d"), true), (peer("e"), true)]);
    let now = Instant::now();
    let mut out = Vec::new();
    c.handle(
        ReplicatorInput::Update {
            key: "shard-1".into(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            modify: add("x"),
            reply: 7,
        },
        now,
        1,
        &mut out,
    );
    // Durable key: persisted, then 4 writes.
    assert!(matches!(out[0], ReplicatorAction::Persist { .. }));
    let (op, fanout) = out
        .iter()
        .find_map(|a| match a {
            ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::WriteDelta { op, .. } } => Some((*op, to.len())),
            _ => None,
        })
        .unwrap();
    assert_eq!(fanout, 4);
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(out.is_empty(), "2 of 3");
    c.handle(ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(out.is_empty(), "a duplicate ack does not count");
    c.handle(ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
    assert!(out.is_empty(), "a majority of acks, but the writer's own commit is not reported yet");
    commit_all(&mut c, &mut out);
    assert!(matches!(&out[0], ReplicatorAction::ReplyUpdate { reply: 7, result: Ok(f) } if f.is_empty()));

    let mut out = Vec::new();
    c.handle(
        ReplicatorInput::Update {
            key: "k2".into(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            modify: add("y"),
            reply: 8,
        },
        now,
        1,
        &mut out,
    );
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now + Duration::from_secs(2), 1, &mut out);
    assert!(out.iter().any(|a| matches!(
        a,
        ReplicatorAction::ReplyUpdate { reply: 8, result: Err(Error::ConsistencyTimeout { needed: 3, acked: 1 }) }
    )));
    // The local value stays updated.
    assert!(c.local_value("k2").is_some());
}

#[test]
fn too_few_reachable_replicas_fail_at_once_but_keep_the_local_update() {
    let mut c =
        core_with_replicas("a", vec![(peer("b"), true), (peer("c"), false), (peer("d"), false), (peer("e"), false)]);
    let mut out = Vec::new();
    c.handle(
        ReplicatorInput::Update {
            key: "k".into(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            modify: add("x"),
            reply: 1,
        },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(out.iter().any(|a| matches!(
        a,
        ReplicatorAction::ReplyUpdate { result: Err(Error::NotEnoughReplicas { needed: 3, reachable: 2 }), .. }
    )));
    assert!(c.local_value("k").is_some());
}

#[test]
fn majority_read_merges_answers_and_repairs_stale_replicas() {
    let mut a = core("a");
    let mut b = core("b");
    let peers = vec![(peer("b"), true), (peer("c"), true)];
    tell_replicas(&mut a, peers, Instant::now(), 0, &mut vec![]);
    b.handle(
        ReplicatorInput::Update {
            key: "k".into(),
            consistency: Consistency::Local,
            timeout: Duration::from_secs(1),
            modify: add("from-b"),
            reply: 0,
        },
        Instant::now(),
        1,
        &mut vec![],
    );
    let mut out = Vec::new();
    a.handle(
        ReplicatorInput::Get {
            key: "k".into(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            reply: 5,
        },
        Instant::now(),
        1,
        &mut out,
    );
    let (op, _) = read_op(&out);
    let value = b.local_value("k").cloned();
    let mut out = Vec::new();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::ReadResult { op, values: vec![(0, value)] } },
        Instant::now(),
        1,
        &mut out,
    );
    let got = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::ReplyGet { reply: 5, result: Ok(v) } => Some(v.clone()),
            _ => None,
        })
        .unwrap();
    let set = GSet::from_data(got.unwrap(), "k").unwrap();
    assert!(set.contains("from-b"));
}

fn update(
    c: &mut ReplicatorCore<u32>,
    key: &str,
    consistency: Consistency,
    modify: Modify,
    out: &mut Vec<ReplicatorAction<u32>>,
) {
    c.handle(
        ReplicatorInput::Update { key: key.into(), consistency, timeout: Duration::from_secs(1), modify, reply: 0 },
        Instant::now(),
        1,
        out,
    );
}

fn local(c: &mut ReplicatorCore<u32>, key: &str, modify: Modify) {
    update(c, key, Consistency::Local, modify, &mut Vec::new());
}

fn or_add(members: Vec<String>) -> Modify {
    Box::new(move |cur, ctx| match cur {
        Some(ReplicatedData::OrSet(s)) => {
            s.add_all(ctx, members);
            Ok(None)
        }
        Some(other) => Err(Error::WrongDataType { key: "k".into(), expected: "OrSet", found: other.type_name() }),
        None => {
            let mut s = OrSet::default();
            s.add_all(ctx, members);
            Ok(Some(s.into_data()))
        }
    })
}

fn map_put(entries: Vec<(String, u8)>) -> Modify {
    Box::new(move |cur, ctx| {
        let mut fresh = crate::ddata::LwwMap::default();
        let m = match cur {
            Some(ReplicatedData::LwwMap(m)) => m,
            Some(other) => {
                return Err(Error::WrongDataType { key: "k".into(), expected: "LwwMap", found: other.type_name() });
            }
            None => &mut fresh,
        };
        for (k, v) in entries {
            m.put(ctx, k, vec![v]);
        }
        Ok(if fresh.entry_count() > 0 { Some(fresh.into_data()) } else { None })
    })
}

/// Gives `to` the value `from` holds under `key` (as anti-entropy would).
fn copy_value(from: &ReplicatorCore<u32>, to: &mut ReplicatorCore<u32>, key: &str) {
    let value = from.local_value(key).cloned().unwrap();
    let msg = ReplicatorMsg::Gossip {
        entries: vec![(key.into(), value)],
        want: vec![],
        want_buckets: vec![],
        value_buckets: vec![],
    };
    to.handle(ReplicatorInput::Remote { from: peer("a"), msg }, Instant::now(), 1, &mut vec![]);
}

/// What one anti-entropy exchange between `a` (which starts it) and `b` carried.
#[derive(Debug, Default)]
struct Exchange {
    messages: Vec<&'static str>,
    values: usize,
    value_elements: usize,
    persists: usize,
    largest_message: usize,
}

fn kind(m: &ReplicatorMsg) -> &'static str {
    match m {
        ReplicatorMsg::WriteDelta { .. } => "WriteDelta",
        ReplicatorMsg::WriteAck { .. } => "WriteAck",
        ReplicatorMsg::DeltaPropagation { .. } => "DeltaPropagation",
        ReplicatorMsg::Read { .. } => "Read",
        ReplicatorMsg::ReadResult { .. } => "ReadResult",
        ReplicatorMsg::Status { .. } => "Status",
        ReplicatorMsg::KeyBuckets { .. } => "KeyBuckets",
        ReplicatorMsg::Digests { .. } => "Digests",
        ReplicatorMsg::Gossip { .. } => "Gossip",
        ReplicatorMsg::WriteFenced { .. } => "WriteFenced",
        ReplicatorMsg::MergeThenRead { .. } => "MergeThenRead",
    }
}

/// Runs one anti-entropy round from `a` to `b` (a tick on `a`) and pumps until quiet.
fn exchange(a: &mut ReplicatorCore<u32>, b: &mut ReplicatorCore<u32>, at: Instant) -> Exchange {
    let (pa, pb) = (peer("a"), peer("b"));
    for (c, other) in [(&mut *a, &pb), (&mut *b, &pa)] {
        let m = ReplicatorInput::Members {
            holder: true,
            replicas: vec![(other.clone(), true)],
            gossip_targets: vec![other.clone()],
            standing: vec![],
            leaving: vec![],
        };
        c.handle(m, at, 0, &mut vec![]);
    }
    // The rosters the membership just wrote are not what these rounds are about: settled.
    let (ra, rb) = (a.local_value(ROSTER_KEY).cloned(), b.local_value(ROSTER_KEY).cloned());
    let settled = ra == rb;
    for (c, theirs) in [(&mut *a, rb), (&mut *b, ra)] {
        if let Some(v) = theirs.filter(|_| !settled) {
            c.merge_in(ROSTER_KEY, v, &mut vec![]).expect("a roster merges");
        }
        c.take_pending(ROSTER_KEY);
    }
    let mut ex = Exchange::default();
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, at, 1, &mut out);
    let mut queue: std::collections::VecDeque<(bool, ReplicatorMsg)> = Default::default();
    loop {
        for act in out.drain(..) {
            match act {
                ReplicatorAction::Send { to, msg } => queue.push_back((to.address == pb.address, msg)),
                ReplicatorAction::Broadcast { to, msg } => {
                    for t in to {
                        queue.push_back((t.address == pb.address, msg.clone()));
                    }
                }
                ReplicatorAction::Persist { .. } => ex.persists += 1,
                _ => {}
            }
        }
        let Some((to_b, msg)) = queue.pop_front() else { break };
        ex.messages.push(kind(&msg));
        ex.largest_message = ex.largest_message.max(rmp_serde::to_vec(&msg).unwrap().len());
        if let ReplicatorMsg::Gossip { entries, .. } = &msg {
            ex.values += entries.len();
            ex.value_elements += entries.iter().map(|(_, v)| v.element_count()).sum::<usize>();
        }
        if to_b {
            b.handle(ReplicatorInput::Remote { from: pa.clone(), msg }, at, 1, &mut out);
        } else {
            a.handle(ReplicatorInput::Remote { from: pb.clone(), msg }, at, 1, &mut out);
        }
        assert!(ex.messages.len() < 100, "anti-entropy does not settle: {:?}", ex.messages);
    }
    ex
}

#[test]
fn anti_entropy_converges_two_replicas_and_then_sends_only_a_root_digest() {
    let mut a = core("a");
    let mut b = core("b");
    let now = Instant::now();
    local(&mut a, "k", add("x"));
    local(&mut b, "k", add("y"));
    // Their deltas were lost: only anti-entropy can repair.
    a.pending_deltas.clear();
    b.pending_deltas.clear();
    let first = exchange(&mut a, &mut b, now);
    assert_eq!(first.messages, ["Status", "KeyBuckets", "Digests", "Gossip", "Gossip"]);
    assert_eq!(a.local_value("k"), b.local_value("k"));
    let again = exchange(&mut a, &mut b, now + Duration::from_secs(2));
    assert_eq!(again.messages, ["Status"], "converged: only the root digest");
    assert_eq!((again.values, again.persists), (0, 0));
}

#[test]
fn or_sets_with_different_histories_converge_to_one_digest_and_a_quiet_cluster() {
    // The bug this replaces: digests of equal OR-sets differed by memory layout, so every round
    // shipped and re-persisted every set.
    let mut a = core("a");
    let mut b = core("b");
    let now = Instant::now();
    let ids: Vec<String> = (0..300).map(|i| format!("entity-{i}")).collect();
    local(&mut a, "shard-t/1/0", or_add(ids[..150].to_vec()));
    local(&mut b, "shard-t/1/0", or_add(ids[150..].to_vec()));
    local(&mut b, "shard-t/1/0", or_add(ids[..10].to_vec()));
    exchange(&mut a, &mut b, now);
    assert_eq!(a.root_digest(), b.root_digest());
    let stats_before = a.stats.values_merged.load(std::sync::atomic::Ordering::Relaxed);
    for round in 1..=5 {
        let ex = exchange(&mut a, &mut b, now + Duration::from_secs(2 * round));
        assert_eq!(ex.messages, ["Status"]);
        assert_eq!((ex.values, ex.persists), (0, 0), "a converged cluster ships and commits nothing");
    }
    assert_eq!(a.stats.values_merged.load(std::sync::atomic::Ordering::Relaxed), stats_before);
}

#[test]
fn merging_a_value_equal_to_the_local_one_persists_and_notifies_nothing() {
    let mut a = core("a");
    local(&mut a, "shard-t/1/0", or_add(vec!["x".into(), "y".into()]));
    let same: ReplicatedData =
        rmp_serde::from_slice(&rmp_serde::to_vec(a.local_value("shard-t/1/0").unwrap()).unwrap()).unwrap();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::WriteDelta { op: 1, entries: vec![], values: vec![("shard-t/1/0".into(), same)] };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    assert!(
        out.iter().all(|x| matches!(x, ReplicatorAction::Send { msg: ReplicatorMsg::WriteAck { .. }, .. })),
        "{out:?}"
    );
}

#[test]
fn a_majority_update_ships_only_its_delta_and_the_follower_ends_equal() {
    let mut a = core("a");
    let mut b = core("b");
    let ids: Vec<String> = (0..1000).map(|i| format!("e{i}")).collect();
    local(&mut a, "shard-t/1/0", or_add(ids));
    // b starts with a's state (as after anti-entropy).
    copy_value(&a, &mut b, "shard-t/1/0");
    tell_replicas(&mut a, vec![(peer("b"), true), (peer("c"), true)], Instant::now(), 0, &mut vec![]);
    a.pending_deltas.clear();
    let mut out = Vec::new();
    update(&mut a, "shard-t/1/0", Consistency::MAJORITY, or_add(vec!["new-one".into()]), &mut out);
    let msg = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: m @ ReplicatorMsg::WriteDelta { .. }, .. } => Some(m.clone()),
            _ => None,
        })
        .expect("a WriteDelta");
    let ReplicatorMsg::WriteDelta { entries, .. } = &msg else { unreachable!() };
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].1.len(), 1, "one element, not the 1,001 of the value");
    assert!(rmp_serde::to_vec(&msg).unwrap().len() < 200);
    let mut out = Vec::new();
    b.handle(ReplicatorInput::Remote { from: peer("a"), msg }, Instant::now(), 1, &mut out);
    assert!(
        out.iter()
            .any(|x| matches!(x, ReplicatorAction::Persist { record: PersistRecord::Delta(d), .. } if d.len() == 1))
    );
    assert!(!out.iter().any(is_ack), "no ack before the commit");
    commit_all(&mut b, &mut out);
    assert!(out.iter().any(is_ack));
    assert_eq!(a.local_value("shard-t/1/0"), b.local_value("shard-t/1/0"));
}

#[test]
fn local_updates_accumulate_into_one_delta_shipped_on_the_delta_interval() {
    let mut a = core("a");
    let now = Instant::now();
    a.handle(
        ReplicatorInput::Members {
            holder: true,
            replicas: vec![(peer("b"), true)],
            gossip_targets: vec![peer("b")],
            standing: vec![],
            leaving: vec![],
        },
        now,
        0,
        &mut vec![],
    );
    a.handle(ReplicatorInput::Tick, now, 1, &mut vec![]);
    for i in 0..5 {
        local(&mut a, "k", add(["p", "q", "r", "s", "t"][i]));
    }
    local(&mut a, "m", map_put(vec![("x".into(), 1)]));
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, now + Duration::from_millis(10), 1, &mut out);
    assert!(
        !out.iter()
            .any(|x| matches!(x, ReplicatorAction::Broadcast { msg: ReplicatorMsg::DeltaPropagation { .. }, .. })),
        "not due yet"
    );
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, now + Duration::from_millis(60), 1, &mut out);
    let shipped: Vec<_> = out
        .iter()
        .filter_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::DeltaPropagation { entries }, .. } => {
                Some(entries.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(shipped.len(), 1, "one message");
    let keys: Vec<(&str, usize)> = shipped[0].iter().map(|(k, d)| (k.as_str(), d.len())).collect();
    assert_eq!(keys, [("k", 5), ("m", 1)]);
    // A follower that merges it has both values.
    let mut b = core("b");
    b.handle(
        ReplicatorInput::Remote {
            from: peer("a"),
            msg: ReplicatorMsg::DeltaPropagation { entries: shipped[0].clone() },
        },
        now,
        1,
        &mut vec![],
    );
    assert_eq!(b.local_value("k"), a.local_value("k"));
    assert_eq!(b.local_value("m"), a.local_value("m"));
}

#[test]
fn acks_and_read_results_count_only_from_the_replicas_addressed() {
    let mut a = core("a");
    tell_replicas(&mut a, vec![(peer("b"), true), (peer("c"), true)], Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    update(&mut a, "k", Consistency::All, add("x"), &mut out);
    let op = write_op(&out);
    let mut out = Vec::new();
    for stranger in ["mallory", "eve"] {
        a.handle(
            ReplicatorInput::Remote { from: peer(stranger), msg: ReplicatorMsg::WriteAck { op } },
            Instant::now(),
            1,
            &mut out,
        );
    }
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(out.is_empty(), "strangers' acks do not complete the write: {out:?}");
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 2);
    a.handle(
        ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op } },
        Instant::now(),
        1,
        &mut out,
    );
    assert!(matches!(&out[..], [ReplicatorAction::ReplyUpdate { result: Ok(f), .. }] if f.is_empty()));
}

#[test]
fn a_delta_of_the_wrong_type_is_refused_counted_not_acknowledged_and_the_key_keeps_working() {
    let mut a = core("a");
    local(&mut a, "k", add("x"));
    let mut bogus = OrSet::default();
    bogus.add(&WriteCtx::new("mallory#1", 1), "evil");
    let delta = bogus.take_delta().map(crate::ddata::ReplicatedDelta::OrSet).unwrap();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::WriteDelta { op: 3, entries: vec![("k".into(), delta)], values: vec![] };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    assert!(out.is_empty(), "no ack, no persist: {out:?}");
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
    local(&mut a, "k", add("y"));
    let set = GSet::from_data(a.local_value("k").cloned().unwrap(), "k").unwrap();
    assert!(set.contains("x") && set.contains("y"));
}

#[test]
fn gossip_want_is_deduplicated_and_capped() {
    let mut a = core("a");
    local(&mut a, "k", add("x"));
    let mut out = Vec::new();
    let msg = ReplicatorMsg::Gossip {
        entries: vec![],
        want: vec!["k".to_string(); 100_000],
        want_buckets: vec![],
        value_buckets: vec![],
    };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 1, &mut out);
    let [ReplicatorAction::Send { msg: ReplicatorMsg::Gossip { entries, .. }, .. }] = &out[..] else {
        panic!("{out:?}")
    };
    assert_eq!(entries.len(), 1);
}

#[test]
fn a_large_map_that_differs_in_one_entry_moves_by_bucket_not_whole() {
    let mut a = core("a");
    let mut b = core("b");
    let entries: Vec<(String, u8)> = (0..6400).map(|i| (format!("shard-{i}"), 1)).collect();
    local(&mut a, "coordinator", map_put(entries));
    copy_value(&a, &mut b, "coordinator");
    local(&mut a, "coordinator", map_put(vec![("shard-17".into(), 2)]));
    local(&mut b, "coordinator", map_put(vec![("shard-4242".into(), 3)]));
    let ex = exchange(&mut a, &mut b, Instant::now());
    assert_eq!(a.local_value("coordinator"), b.local_value("coordinator"));
    assert!(ex.value_elements < 6400 / 64 * 4, "moved {} entries of 6,400", ex.value_elements);
    let again = exchange(&mut a, &mut b, Instant::now() + Duration::from_secs(3));
    assert_eq!(again.messages, ["Status"]);
}

#[test]
fn gossip_messages_are_capped_in_bytes() {
    let mut a = core("a");
    a.settings.max_message_bytes = 16 * 1024;
    let mut b = core("b");
    b.settings.max_message_bytes = 16 * 1024;
    for k in 0..200 {
        let ids: Vec<String> = (0..40).map(|i| format!("entity-{k}-{i}")).collect();
        local(&mut b, &format!("key-{k}"), or_add(ids));
    }
    let mut rounds = 0;
    while a.root_digest() != b.root_digest() {
        let ex = exchange(&mut a, &mut b, Instant::now() + Duration::from_secs(2 * rounds + 2));
        assert!(ex.largest_message <= 2 * 16 * 1024, "{} bytes", ex.largest_message);
        rounds += 1;
        assert!(rounds < 200, "does not converge");
    }
    assert!(rounds > 1, "the budget split the transfer");
    for k in 0..200 {
        assert_eq!(a.local_value(&format!("key-{k}")), b.local_value(&format!("key-{k}")));
    }
}

#[test]
fn a_multi_key_update_is_one_message_and_one_ack_and_an_unchanged_key_still_ships_its_value() {
    let mut a = core("a");
    local(&mut a, "g", add("already"));
    a.pending_deltas.clear();
    tell_replicas(&mut a, vec![(peer("b"), true), (peer("c"), true)], Instant::now(), 0, &mut vec![]);
    let mut out = Vec::new();
    let updates: Vec<(String, Modify)> = vec![
        ("shard-t/1/0".into(), or_add(vec!["e1".into()])),
        ("shard-t/2/0".into(), or_add(vec!["e2".into()])),
        // A retried insert that changes nothing locally: its value must still reach the majority.
        ("g".into(), add("already")),
    ];
    a.handle(
        ReplicatorInput::UpdateMany {
            updates,
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(1),
            reply: 4,
        },
        Instant::now(),
        1,
        &mut out,
    );
    let writes: Vec<&ReplicatorMsg> = out
        .iter()
        .filter_map(|x| match x {
            ReplicatorAction::Broadcast { msg, .. } => Some(msg),
            _ => None,
        })
        .collect();
    let [ReplicatorMsg::WriteDelta { op, entries, values }] = &writes[..] else { panic!("{writes:?}") };
    assert_eq!(entries.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["shard-t/1/0", "shard-t/2/0"]);
    assert_eq!(values.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["g"]);
    assert_eq!(out.iter().filter(|x| matches!(x, ReplicatorAction::Persist { .. })).count(), 2, "both durable keys");
    let counted = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (counted(&a.stats.deltas_sent), counted(&a.stats.full_values_sent)),
        (2 * 2, 2),
        "two deltas and one value, each to two replicas"
    );
    let mut out = Vec::new();
    a.handle(
        ReplicatorInput::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op: *op } },
        Instant::now(),
        1,
        &mut out,
    );
    commit_all(&mut a, &mut out);
    assert!(matches!(&out[..], [ReplicatorAction::ReplyUpdate { reply: 4, result: Ok(f) }] if f.is_empty()));
}

mod anti_entropy;
mod durability;
mod fencing;
mod quarantine_and_deadlines;
mod reads;
mod roster;
mod writer;
mod writes;
