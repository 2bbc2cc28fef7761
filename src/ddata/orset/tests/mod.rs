//! Unit tests of the OR-set: encoding, merges, deltas, limits and store writers.
use super::wire::OrSetWire;
use super::*;

fn ctx(actor: &str) -> WriteCtx {
    WriteCtx::new(actor, 1)
}

fn roundtrip(s: &OrSet) -> OrSet {
    rmp_serde::from_slice(&rmp_serde::to_vec(s).unwrap()).unwrap()
}

#[test]
fn equal_sets_built_in_different_orders_have_equal_digests_and_encodings_decode_equal() {
    let mut a = OrSet::default();
    let mut b = OrSet::default();
    let ids: Vec<String> = (0..200).map(|i| format!("id-{i}")).collect();
    for id in &ids {
        a.add(&ctx("n1#1"), id.clone());
    }
    let mut from_a = a.clone();
    // b learns the same adds by merge, then by delta, in reverse order.
    b.merge(from_a.clone());
    assert_eq!(a.digest(), b.digest());
    let d = from_a.take_delta().unwrap();
    let mut c = OrSet::default();
    c.merge_delta(&d).unwrap();
    assert_eq!(c, a);
    assert_eq!(c.digest(), a.digest());
    let r = roundtrip(&a);
    assert_eq!(r, a);
    assert_eq!(r.digest(), a.digest());
}

#[test]
fn concurrent_add_survives_a_remove_that_did_not_see_it() {
    let mut a = OrSet::default();
    a.add(&ctx("a#1"), "x");
    let mut b = a.clone();
    b.remove("x");
    a.add(&ctx("a#1"), "x");
    let mut m = a.clone();
    m.merge(b.clone());
    assert!(m.contains("x"));
    let mut n = b.clone();
    n.merge(a.clone());
    assert_eq!(m, n);
}

#[test]
fn a_remove_delta_that_arrives_before_the_add_still_removes_it() {
    let mut a = OrSet::default();
    a.add(&ctx("a#1"), "x");
    let add = a.take_delta().unwrap();
    a.remove("x");
    let rm = a.take_delta().unwrap();
    let mut b = OrSet::default();
    b.merge_delta(&rm).unwrap();
    b.merge_delta(&add).unwrap();
    b.merge_delta(&rm).unwrap();
    assert!(!b.contains("x"));
    assert_eq!(b, a);
}

#[test]
fn a_lost_delta_leaves_a_cloud_that_a_full_merge_closes() {
    let mut a = OrSet::default();
    a.add(&ctx("a#1"), "x");
    let _lost = a.take_delta().unwrap();
    a.add(&ctx("a#1"), "y");
    let second = a.take_delta().unwrap();
    let mut b = OrSet::default();
    b.merge_delta(&second).unwrap();
    assert!(b.contains("y") && !b.contains("x"));
    assert_eq!(b.cloud.len(), 1, "dot 2 seen without dot 1");
    b.merge(a.clone());
    assert!(b.cloud.is_empty());
    assert_eq!(b, a);
}

#[test]
fn removing_most_elements_compacts_the_arena_and_keeps_the_rest() {
    let mut s = OrSet::default();
    for i in 0..10_000 {
        s.add(&ctx("a#1"), format!("entity-{i:06}"));
    }
    let full = s.arena.len();
    for i in 0..9_000 {
        s.remove(&format!("entity-{i:06}"));
    }
    assert!(s.arena.len() < full / 2, "{} of {full}", s.arena.len());
    assert_eq!(s.len(), 1_000);
    assert!(s.contains("entity-009999") && !s.contains("entity-000001"));
    assert_eq!(roundtrip(&s), s);
}

#[test]
fn malformed_encodings_are_typed_errors() {
    let bad = |w: OrSetWire| rmp_serde::from_slice::<OrSet>(&rmp_serde::to_vec(&w).unwrap()).is_err();
    let wire = |writers: Vec<&str>, vv: Vec<u64>, entries: Vec<u8>| OrSetWire {
        writers: writers.into_iter().map(String::from).collect(),
        vv,
        cloud: vec![],
        cloud_ranges: vec![],
        entries,
    };
    assert!(bad(wire(vec!["a", "a"], vec![1, 1], vec![])), "duplicate writer");
    assert!(bad(wire(vec!["a"], vec![], vec![])), "vv length");
    assert!(bad(wire(vec!["a"], vec![MAX_COUNTER + 1], vec![])), "counter");
    assert!(bad(wire(vec!["a"], vec![1], vec![1, b'x', 5, 1])), "writer index");
    assert!(bad(wire(vec!["a"], vec![1], vec![1, b'x', 0, 2])), "dot outside context");
    assert!(bad(wire(vec!["a"], vec![1], vec![9, b'x'])), "truncated");
    assert!(bad(wire(vec!["a"], vec![1], vec![1, 0xff, 0, 1])), "not utf-8");
    assert!(!bad(wire(vec!["a"], vec![1], vec![1, b'x', 0, 1])), "valid");
}

#[test]
fn a_peer_state_at_the_largest_counter_merges_without_overflow_and_our_next_add_is_refused_not_corrupt() {
    // A valid state (counter = MAX_COUNTER) naming our own writer, as a hostile or very
    // old peer might send.
    let encoded = rmp_serde::to_vec(&OrSetWire {
        writers: vec!["a#1".into()],
        vv: vec![MAX_COUNTER],
        cloud: vec![],
        cloud_ranges: vec![],
        entries: vec![1, b'x', 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f],
    })
    .unwrap();
    let peer: OrSet = rmp_serde::from_slice(&encoded).expect("valid state");
    let mut s = OrSet::default();
    s.add(&ctx("a#1"), "mine");
    s.merge(peer);
    assert!(s.contains("x"));
    s.add(&ctx("a#1"), "next");
    assert!(!s.contains("next"), "no dot left for this writer: the add is refused");
    assert_eq!(roundtrip(&s), s, "the set stays valid");
}

#[test]
fn merging_past_the_writer_limit_is_refused_and_changes_nothing() {
    let mut big = OrSet { vv: vec![0; MAX_WRITERS], ..OrSet::default() };
    for i in 0..MAX_WRITERS {
        big.writers.intern(&format!("w{i}"));
    }
    let mut other = OrSet::default();
    other.add(&ctx("newcomer#1"), "x");
    let before = big.digest();
    assert_eq!(big.try_merge(&other), Err(OrSetError::TooManyWriters));
    assert_eq!(big.digest(), before);
    assert!(!big.contains("x"));
}

#[test]
fn a_merge_that_brings_the_writers_to_exactly_the_limit_is_accepted() {
    let mut almost = OrSet { vv: vec![0; MAX_WRITERS - 1], ..OrSet::default() };
    for i in 0..MAX_WRITERS - 1 {
        almost.writers.intern(&format!("w{i}"));
    }
    let mut other = OrSet::default();
    other.add(&ctx("last#1"), "x");
    assert_eq!(almost.try_merge(&other), Ok(()));
    assert!(almost.contains("x"));
    assert_eq!(almost.writers().count(), MAX_WRITERS);
}

#[test]
fn a_full_state_merge_removes_what_the_other_side_removed_after_seeing_it() {
    let mut a = OrSet::default();
    a.add_all(&ctx("a#1"), ["x", "y"]);
    let mut b = OrSet::default();
    b.merge(a.clone());
    b.remove("x");
    a.merge(b);
    let expected: BTreeSet<String> = ["y".to_string()].into();
    assert_eq!(a.members(), expected, "the removal wins over the add it saw");
}

#[test]
fn a_writer_continues_above_the_highest_counter_it_ever_saw_of_itself() {
    let mut a = OrSet::default();
    a.add(&ctx("a#1"), "x");
    let mut b = OrSet::default();
    b.merge(a.clone());
    b.add(&ctx("a#1"), "y"); // same writer on another replica: never happens, but stays safe
    assert_eq!(b.max_counter_of("a#1"), 2);
    assert_eq!(a.max_counter_of("a#1"), 1);
    assert_eq!(a.max_counter_of("nobody"), 0);
}

/// The store writer `s` of a process whose reserved counters start at `floor`.
fn store_ctx(floor: u64) -> WriteCtx {
    WriteCtx::new("s#1", 1).with_set_writer("s#store", floor, floor + 1_000)
}

#[test]
fn an_add_sent_but_never_committed_before_a_crash_does_not_swallow_the_next_processes_add() {
    let mut writer = OrSet::default();
    writer.add(&store_ctx(0), "kept");
    let disk = writer.clone();
    let mut peer = writer.clone();
    // Sent to the peer, never committed: the crash loses it on the writer.
    writer.add(&store_ctx(0), "lost");
    peer.merge_delta(&writer.take_delta().unwrap()).unwrap();
    assert!(peer.contains("lost"));

    // Without a floor, the restarted writer reuses the lost add's counter and the peer, which
    // has seen that dot, drops the new add: the hazard the reservation exists for.
    let mut reused = disk.clone();
    reused.take_delta();
    reused.add(&store_ctx(0), "after");
    let mut stale_peer = peer.clone();
    stale_peer.merge_delta(&reused.take_delta().unwrap()).unwrap();
    assert!(!stale_peer.contains("after"), "the dot was taken");

    // With the floor, the new add has a fresh counter and claims the skipped ones dead.
    let mut restarted = disk.clone();
    restarted.take_delta();
    restarted.add(&store_ctx(1_000), "after");
    let delta = restarted.take_delta().unwrap();
    assert_eq!(delta.claims, vec![(0, 2, 999)]);
    peer.merge_delta(&delta).unwrap();
    assert!(peer.contains("after") && peer.contains("kept"));
    assert!(!peer.contains("lost"), "the claim kills the add that was never committed");
    assert_eq!(peer, restarted);
    assert_eq!(peer.digest(), restarted.digest());
    assert_eq!((peer.cloud_intervals(), restarted.cloud_intervals()), (0, 0), "one counter per writer");
}

#[test]
fn a_peer_behind_the_writer_keeps_a_claim_as_one_interval_until_the_gap_fills() {
    let mut writer = OrSet::default();
    writer.add(&store_ctx(0), "a");
    writer.add(&store_ctx(0), "b");
    let mut behind = OrSet::default();
    let first = writer.clone();
    writer.take_delta();
    let mut restarted = writer.clone();
    restarted.add(&store_ctx(1_000_000), "c");
    behind.merge_delta(&restarted.take_delta().unwrap()).unwrap();
    assert!(behind.contains("c") && !behind.contains("a"));
    assert_eq!(behind.cloud_intervals(), 1, "counters 3..=1_000_000 as one interval, not a million dots");
    assert!(behind.approx_bytes() < 100);
    assert_eq!(roundtrip(&behind), behind, "intervals survive the encoding");
    behind.merge(first);
    assert_eq!(behind.cloud_intervals(), 0, "the gap filled: the interval joins the version vector");
    assert_eq!(behind, restarted);
    assert_eq!(behind.digest(), restarted.digest());
}

#[test]
fn an_add_at_the_reserved_ceiling_is_refused_counted_and_changes_nothing() {
    let ctx = WriteCtx::new("s#1", 1).with_set_writer("s#store", 0, 3);
    let mut s = OrSet::default();
    s.add(&ctx, "a");
    s.add(&ctx, "b");
    let before = s.clone();
    s.add(&ctx, "c");
    s.add(&ctx, "d");
    assert_eq!(ctx.refused_adds(), 2);
    assert!(!s.contains("c") && !s.contains("d"));
    assert_eq!(s, before);
    assert_eq!(s.digest(), before.digest());
}

#[test]
fn claims_and_cloud_intervals_survive_encoding_and_older_encodings_still_decode() {
    let mut s = OrSet::default();
    s.add(&store_ctx(0), "a");
    s.take_delta();
    s.add(&store_ctx(500), "b");
    let d = s.take_delta().unwrap();
    let back: OrSetDelta = rmp_serde::from_slice(&rmp_serde::to_vec(&d).unwrap()).unwrap();
    assert_eq!(back, d);
    // A delta written before claims existed: writers and entries only.
    let old = rmp_serde::to_vec(&(vec!["w#1"], vec![("x", (vec![(0u16, 1u64)], Vec::<(u16, u64)>::new()))])).unwrap();
    let old: OrSetDelta = rmp_serde::from_slice(&old).expect("decodes without claims");
    assert_eq!(old.len(), 1);
    assert!(old.claims.is_empty());
    // A set written before intervals existed: no cloud_ranges field.
    let old_set =
        rmp_serde::to_vec(&(vec!["w#1"], vec![1u64], vec![(0u16, 3u64)], serde_bytes::Bytes::new(&[1, b'x', 0, 1])))
            .unwrap();
    let old_set: OrSet = rmp_serde::from_slice(&old_set).expect("decodes without intervals");
    assert!(old_set.contains("x"));
    assert_eq!(old_set.cloud_intervals(), 1);
}

#[test]
fn a_delta_encodes_byte_for_byte_as_its_owned_wire_form() {
    let mut s = OrSet::default();
    s.add(&store_ctx(500), "b");
    s.add(&ctx("w#2"), "a");
    s.add(&ctx("w#2"), "c");
    s.remove("c");
    let d = s.take_delta().unwrap();
    assert!(!d.claims.is_empty() && d.len() == 3, "the delta carries a claim, an add and a remove");
    let owned = super::delta::OrSetDeltaWire {
        writers: d.writers.names.clone(),
        entries: d.entries.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        claims: d.claims.clone(),
    };
    assert_eq!(rmp_serde::to_vec(&d).unwrap(), rmp_serde::to_vec(&owned).unwrap());
}

#[test]
fn malformed_claims_and_cloud_intervals_are_typed_errors() {
    let delta = |claims: Vec<(u16, u64, u64)>| {
        let wire = super::delta::OrSetDeltaWire { writers: vec!["w#1".into()], entries: vec![], claims };
        rmp_serde::from_slice::<OrSetDelta>(&rmp_serde::to_vec(&wire).unwrap())
    };
    assert!(delta(vec![(0, 5, 4)]).is_err(), "empty range");
    assert!(delta(vec![(1, 1, 4)]).is_err(), "writer index");
    assert!(delta(vec![(0, 0, 4)]).is_err(), "counter 0");
    assert!(delta(vec![(0, 1, MAX_COUNTER + 1)]).is_err(), "counter above the maximum");
    assert!(delta(vec![(0, 1, 4); 1025]).is_err(), "too many claims");
    assert!(delta(vec![(0, 1, 4)]).is_ok());
    let set = |cloud_ranges: Vec<(u16, u64, u64)>| {
        let wire = OrSetWire { writers: vec!["w#1".into()], vv: vec![0], cloud: vec![], entries: vec![], cloud_ranges };
        rmp_serde::from_slice::<OrSet>(&rmp_serde::to_vec(&wire).unwrap())
    };
    assert!(set(vec![(0, 9, 3)]).is_err(), "empty interval");
    assert!(set(vec![(2, 3, 9)]).is_err(), "writer index");
    assert!(set(vec![(0, 3, MAX_COUNTER + 1)]).is_err(), "counter above the maximum");
    let ok = set(vec![(0, 3, 9), (0, 5, 12), (0, 13, 20)]).expect("overlapping and touching intervals normalize");
    assert_eq!(ok.cloud_intervals(), 1);
}

#[test]
fn a_writer_may_use_the_largest_counter_itself_and_nothing_above_it() {
    let encoded = rmp_serde::to_vec(&OrSetWire {
        writers: vec!["a#1".into()],
        vv: vec![MAX_COUNTER - 1],
        cloud: vec![],
        entries: vec![],
        cloud_ranges: vec![],
    })
    .unwrap();
    let mut s: OrSet = rmp_serde::from_slice(&encoded).unwrap();
    s.add(&ctx("a#1"), "last");
    assert!(s.contains("last"), "counter 2^48-1 is a valid dot");
    assert_eq!(s.max_counter_of("a#1"), MAX_COUNTER);
    s.add(&ctx("a#1"), "beyond");
    assert!(!s.contains("beyond"));
}

#[test]
fn sets_that_differ_only_in_their_cloud_have_different_digests() {
    // Anti-entropy finds a difference only through the digest, so every part of the context
    // must move it.
    let with_cloud = |writer: &str, ranges: &[(u64, u64)]| {
        let mut s = OrSet::default();
        s.add(&ctx(writer), "x");
        for &(lo, hi) in ranges {
            s.context_insert_range(0, lo, hi);
        }
        s
    };
    let variants = [
        with_cloud("a#1", &[]),
        with_cloud("a#1", &[(5, 5)]),
        with_cloud("a#1", &[(6, 6)]),
        with_cloud("a#1", &[(5, 7)]),
        with_cloud("a#1", &[(5, 8)]),
        with_cloud("a#1", &[(4, 4), (7, 7)]),
        with_cloud("b#1", &[(5, 5)]),
    ];
    for (i, a) in variants.iter().enumerate() {
        for b in &variants[i + 1..] {
            assert_ne!(a.digest(), b.digest(), "{a:?} and {b:?}");
        }
    }
    assert_eq!(with_cloud("a#1", &[(5, 6), (7, 8)]).digest(), variants[4].digest(), "touching intervals are one");
}

#[test]
fn a_delta_is_empty_only_without_elements_and_claims() {
    assert!(OrSetDelta::default().is_empty());
    let mut s = OrSet::default();
    s.add(&ctx("a#1"), "x");
    assert!(!s.take_delta().unwrap().is_empty());
    let claims_only =
        super::delta::OrSetDeltaWire { writers: vec!["w#1".into()], entries: vec![], claims: vec![(0, 1, 9)] };
    let d: OrSetDelta = rmp_serde::from_slice(&rmp_serde::to_vec(&claims_only).unwrap()).unwrap();
    assert!(!d.is_empty(), "a claim alone still says something");
    assert_eq!(d.len(), 0, "and touches no element");
}

#[test]
fn deltas_of_different_writers_are_not_equal_even_with_the_same_indexes() {
    let delta_of = |writer: &str| {
        let mut s = OrSet::default();
        s.add(&ctx(writer), "x");
        s.take_delta().unwrap()
    };
    assert_eq!(delta_of("a#1"), delta_of("a#1"));
    assert_ne!(delta_of("a#1"), delta_of("b#1"));
}

#[test]
fn an_element_longer_than_peers_decode_is_refused_by_add_so_the_set_stays_decodable() {
    let c = ctx("n1#1");
    let mut s = OrSet::default();
    let longest = "x".repeat(MAX_ELEMENT_LEN);
    s.add(&c, &longest);
    assert!(s.contains(&longest));
    assert!(roundtrip(&s).contains(&longest), "the longest element decodes");
    let too_long = "y".repeat(MAX_ELEMENT_LEN + 1);
    s.add(&c, &too_long);
    assert!(!s.contains(&too_long), "a peer would refuse the whole set for it");
    assert_eq!((c.refused_too_long(), c.refused_adds()), (1, 0), "the refusal is counted as what it is");
    assert_eq!(roundtrip(&s), s, "the set still decodes");
    let mut delta_only = OrSet::default();
    delta_only.merge_delta(&s.take_delta().unwrap()).unwrap();
    assert_eq!(delta_only, s);
}

#[test]
fn members_and_iter_list_what_was_added_and_not_removed() {
    let c = ctx("n1#1");
    let mut s = OrSet::default();
    s.add_all(&c, ["a", "b", "c", "b"]);
    s.remove("b");
    assert!(!s.is_empty() && OrSet::default().is_empty());
    let expected: BTreeSet<String> = ["a", "c"].into_iter().map(String::from).collect();
    assert_eq!(s.members(), expected);
    let mut listed: Vec<&str> = s.iter().collect();
    listed.sort_unstable();
    assert_eq!(listed, ["a", "c"]);
    assert_eq!(roundtrip(&s).members(), expected);
}

#[test]
fn writers_seen_again_past_the_scanned_table_keep_their_index() {
    let mut s = OrSet::default();
    let names: Vec<String> = (0..2 * SCANNED_WRITERS + 3).map(|i| format!("n{i}#1")).collect();
    for round in 0..2 {
        for (i, name) in names.iter().enumerate() {
            s.add(&ctx(name), format!("e{i}-{round}"));
        }
    }
    assert_eq!(s.writers().count(), names.len(), "each writer interned once");
    for name in &names {
        assert_eq!(s.max_counter_of(name), 2, "{name} wrote twice under one index");
    }
    assert_eq!(roundtrip(&s), s, "no duplicate writer for a peer to refuse");
}

#[test]
fn sets_that_differ_only_in_their_version_vector_have_different_digests() {
    // No members on either side: only what each has seen (its version vector) differs.
    let seen = |adds: u64| {
        let mut s = OrSet::default();
        let c = ctx("a#1");
        for _ in 0..adds {
            s.add(&c, "x");
        }
        s.remove("x");
        s
    };
    let (none, one, two) = (OrSet::default(), seen(1), seen(2));
    assert!(none.is_empty() && one.is_empty() && two.is_empty());
    assert_ne!(none.digest(), one.digest(), "a set that saw an add and its remove is not an empty one");
    assert_ne!(one.digest(), two.digest());
    assert_ne!(none.digest(), two.digest());
    // Equal states reached in other ways still agree.
    let mut merged = OrSet::default();
    merged.merge(two.clone());
    assert_eq!(merged.digest(), two.digest());
}

#[test]
fn sets_with_as_many_members_but_other_ones_have_different_digests() {
    let one = |member: &str| {
        let mut s = OrSet::default();
        s.add(&ctx("a#1"), member);
        s
    };
    // Same writer, same counter, same size: only the member differs.
    assert_ne!(one("x").digest(), one("y").digest());
    assert_eq!(one("x").digest(), one("x").digest());
}

#[test]
fn removed_elements_count_exactly_their_arena_bytes_as_garbage() {
    let mut s = OrSet::default();
    let c = ctx("a#1");
    let ids: Vec<String> = (0..100).map(|i| format!("element-{i:03}")).collect();
    s.add_all(&c, &ids);
    for id in &ids[..50] {
        s.remove(id);
    }
    // Each removed element held a one-byte length and its 11 bytes.
    assert_eq!(s.garbage, 50 * 12);
    assert_eq!(s.arena.len() - s.garbage, 50 * 12, "the live part of the arena");
}

#[test]
fn the_arena_is_compacted_once_removed_bytes_reach_4096_and_half_of_it_and_not_before() {
    // Elements of 15 bytes take 16 arena bytes each (a one-byte length first).
    let build = |n: usize| {
        let mut s = OrSet::default();
        s.add_all(&ctx("a#1"), (0..n).map(|i| format!("element-{i:07}")));
        s
    };
    let remove = |s: &mut OrSet, from: usize, to: usize| {
        for i in from..to {
            s.remove(&format!("element-{i:07}"));
        }
    };
    // A small arena: half of it is garbage long before 4096 bytes are.
    let mut small = build(300);
    remove(&mut small, 0, 255);
    assert_eq!((small.garbage, small.arena.len()), (255 * 16, 300 * 16), "4080 bytes of garbage: kept");
    remove(&mut small, 255, 256);
    assert_eq!((small.garbage, small.arena.len()), (0, 44 * 16), "4096 bytes: compacted");
    // A large arena: 4096 bytes of garbage are not yet half of it.
    let mut large = build(600);
    remove(&mut large, 0, 299);
    assert_eq!((large.garbage, large.arena.len()), (299 * 16, 600 * 16), "just under half: kept");
    remove(&mut large, 299, 300);
    assert_eq!((large.garbage, large.arena.len()), (0, 300 * 16), "exactly half: compacted");
    let expected: BTreeSet<String> = (300..600).map(|i| format!("element-{i:07}")).collect();
    assert_eq!(large.members(), expected, "compaction keeps every live element");
}

#[test]
fn a_writer_known_with_nothing_seen_does_not_make_a_set_unequal() {
    let mut plain = OrSet::default();
    plain.add(&ctx("a"), "x");
    // The same state from a peer whose writer table also names a writer it saw nothing of.
    let wire = OrSetWire {
        writers: vec!["a".into(), "ghost".into()],
        vv: vec![1, 0],
        cloud: vec![],
        cloud_ranges: vec![],
        entries: vec![1, b'x', 0, 1],
    };
    let with_ghost: OrSet = rmp_serde::from_slice(&rmp_serde::to_vec(&wire).unwrap()).unwrap();
    assert_eq!(with_ghost, plain);
    assert_eq!(with_ghost.digest(), plain.digest());
}

#[test]
fn a_delta_with_exactly_the_most_claims_decodes_and_one_more_is_refused() {
    let writers = vec!["w".to_string()];
    let wire = |claims: usize| delta::OrSetDeltaWire {
        writers: writers.clone(),
        entries: vec![],
        claims: (0..claims as u64).map(|k| (0, 10 * k + 1, 10 * k + 2)).collect(),
    };
    let decode = |w| rmp_serde::from_slice::<OrSetDelta>(&rmp_serde::to_vec(&w).unwrap());
    assert_eq!(decode(wire(1024)).unwrap().claims.len(), 1024);
    assert!(decode(wire(1025)).is_err());
}

#[test]
fn intervals_of_one_dot_decode_in_claims_and_cloud_ranges_and_reversed_ones_are_refused() {
    let delta = |lo: u64, hi: u64| delta::OrSetDeltaWire {
        writers: vec!["w".into()],
        entries: vec![],
        claims: vec![(0, lo, hi)],
    };
    let decode_delta = |w| rmp_serde::from_slice::<OrSetDelta>(&rmp_serde::to_vec(&w).unwrap());
    assert!(decode_delta(delta(5, 5)).is_ok(), "a claim of one counter");
    assert!(decode_delta(delta(5, 4)).is_err());
    let set = |lo: u64, hi: u64| OrSetWire {
        writers: vec!["w".into()],
        vv: vec![1],
        cloud: vec![],
        cloud_ranges: vec![(0, lo, hi)],
        entries: vec![],
    };
    let decode_set = |w| rmp_serde::from_slice::<OrSet>(&rmp_serde::to_vec(&w).unwrap());
    assert_eq!(decode_set(set(5, 5)).unwrap().cloud_intervals(), 1, "a cloud range of one dot");
    assert!(decode_set(set(5, 4)).is_err());
}

#[test]
fn a_set_with_exactly_the_most_writers_decodes_and_one_more_is_refused() {
    let wire = |writers: usize| OrSetWire {
        writers: (0..writers).map(|i| format!("w{i}")).collect(),
        vv: vec![0; writers],
        cloud: vec![],
        cloud_ranges: vec![],
        entries: vec![],
    };
    let decode = |w| rmp_serde::from_slice::<OrSet>(&rmp_serde::to_vec(&w).unwrap());
    assert_eq!(decode(wire(MAX_WRITERS)).unwrap().writers().count(), MAX_WRITERS);
    assert!(decode(wire(MAX_WRITERS + 1)).is_err());
}

mod delta_join_laws;
mod estimates;

#[test]
fn a_new_member_fits_while_the_set_stays_within_its_budget_and_members_already_in_always_fit() {
    let mut s = OrSet::default();
    let c = ctx("n1#1");
    for i in 0..100 {
        s.add(&c, format!("id-{i:04}"));
    }
    let size = s.approx_bytes();
    let added = element_bytes(7) + 1 + varint_len(u64::MAX);
    assert!(s.fits("id-0100", size + added));
    assert!(!s.fits("id-0100", size + added - 1), "one byte short");
    // What an add really costs is at most what `fits` counts.
    let mut grown = s.clone();
    grown.add(&c, "id-0100");
    assert!(grown.approx_bytes() <= size + added);
    assert!(grown.approx_bytes() > size);
    // At (or past) the budget, a member already in still fits: re-adding it does not grow the set.
    assert!(s.fits("id-0042", 0));
    assert!(!s.fits("id-9999", 0));
    let mut readded = s.clone();
    readded.add(&c, "id-0042");
    assert!(readded.approx_bytes() <= size);
}
