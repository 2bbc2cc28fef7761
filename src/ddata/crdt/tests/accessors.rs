//! What a caller reads back from each replicated type and from the `ReplicatedData` /
//! `ReplicatedDelta` wrappers (the merge laws are property-tested in `tests/crdt_properties.rs`;
//! these pin the accessors the laws never look at).

use super::*;

fn map_with(entries: &[(&str, &[u8])]) -> LwwMap {
    let mut ctx = WriteCtx::new("a#1", 1);
    let mut m = LwwMap::default();
    for (k, v) in entries {
        m.put(&mut ctx, *k, v.to_vec());
    }
    m
}

fn gset_with(members: &[&str]) -> GSet {
    let mut g = GSet::default();
    for m in members {
        g.insert(*m);
    }
    g
}

fn orset_with(members: &[&str]) -> OrSet {
    let ctx = WriteCtx::new("a#1", 1);
    let mut s = OrSet::default();
    for m in members {
        s.add(&ctx, *m);
    }
    s
}

/// Two keys that fall in different digest buckets.
fn keys_in_two_buckets() -> (String, String) {
    let first = "key-0".to_string();
    let other = (1..).map(|i| format!("key-{i}")).find(|k| bucket_of(k) != bucket_of(&first)).unwrap();
    (first, other)
}

#[test]
fn a_write_context_names_the_writer_it_was_made_for() {
    assert_eq!(WriteCtx::new("n1#7", 0).actor(), "n1#7");
}

#[test]
fn lww_map_reads_back_serde_values_and_counts_live_entries_apart_from_tombstones() {
    let mut ctx = WriteCtx::new("a#1", 1);
    let mut m = LwwMap::default();
    assert!(m.is_empty());
    m.put_as(&mut ctx, "region", &("n1".to_string(), 7u64)).unwrap();
    m.put(&mut ctx, "raw", b"bytes".to_vec());
    assert_eq!(m.get_as::<(String, u64)>("region").unwrap(), Some(("n1".to_string(), 7)));
    assert_eq!(m.get_as::<(String, u64)>("absent").unwrap(), None);
    assert!(m.get_as::<(String, u64)>("raw").is_err(), "bytes that are not the type are an error");
    assert_eq!(m.iter().map(|(k, _)| k).collect::<Vec<_>>(), ["raw", "region"]);
    assert_eq!(m.iter().find(|(k, _)| *k == "raw").map(|(_, v)| v), Some(&b"bytes"[..]));
    assert_eq!((m.len(), m.entry_count(), m.is_empty()), (2, 2, false));
    m.remove(&mut ctx, "raw");
    m.remove(&mut ctx, "never-written");
    assert_eq!((m.len(), m.entry_count(), m.is_empty()), (1, 2, false), "a tombstone is an entry, not a live one");
    m.remove(&mut ctx, "region");
    assert_eq!((m.len(), m.entry_count(), m.is_empty()), (0, 2, true));
}

#[test]
fn lww_map_survives_an_encode_decode_round_trip_with_its_entries_and_digest() {
    let mut m = map_with(&[("a", b"1"), ("b", b"2")]);
    let mut ctx = WriteCtx::new("b#2", 9);
    m.remove(&mut ctx, "a");
    let back: LwwMap = rmp_serde::from_slice(&rmp_serde::to_vec(&m).unwrap()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.get("b"), Some(&b"2"[..]));
    assert_eq!(back.entry_count(), 2);
    assert_eq!(back.digest(), m.digest());
    assert_eq!(back.bucket_digests(), m.bucket_digests());
}

#[test]
fn lww_maps_that_differ_in_one_entry_are_not_equal_and_have_different_digests() {
    let a = map_with(&[("k", b"1")]);
    let b = map_with(&[("k", b"2")]);
    assert_ne!(a, b);
    assert_ne!(a.digest(), b.digest());
    assert_ne!(a, LwwMap::default());
    assert_eq!(a, a.clone());
}

#[test]
fn lww_map_bucket_subsets_hold_only_their_keys_and_only_their_buckets_change() {
    let (k1, k2) = keys_in_two_buckets();
    let m = map_with(&[(&k1, b"1"), (&k2, b"2")]);
    let sub = m.buckets_subset(&[bucket_of(&k1)]);
    assert_eq!(sub.get(&k1), Some(&b"1"[..]));
    assert_eq!(sub.get(&k2), None);
    let nonzero: Vec<usize> = (0..BUCKETS).filter(|b| m.bucket_digests()[*b] != 0).collect();
    let mut expected = vec![bucket_of(&k1), bucket_of(&k2)];
    expected.sort();
    assert_eq!(nonzero, expected);
    assert_eq!(sub.bucket_digests()[bucket_of(&k1)], m.bucket_digests()[bucket_of(&k1)]);
    assert_eq!(sub.bucket_digests()[bucket_of(&k2)], 0);
}

/// Replicas merge a delta they go on to persist by reference: only the newer registers are
/// taken, whichever side holds them, and the set gains only what it lacked.
#[test]
fn merging_a_borrowed_lww_map_or_g_set_takes_what_merging_it_owned_takes() {
    let mut older = WriteCtx::new("a#1", 1);
    let mut newer = WriteCtx::new("b#2", 9);
    let mut mine = LwwMap::default();
    mine.put(&mut older, "a", b"mine-old".to_vec());
    mine.put(&mut newer, "b", b"mine-new".to_vec());
    let mut theirs = LwwMap::default();
    theirs.put(&mut newer, "a", b"theirs-new".to_vec());
    theirs.put(&mut older, "b", b"theirs-old".to_vec());
    theirs.put(&mut older, "c", b"theirs-only".to_vec());
    // Registers of equal order (never two writes in practice): the one held stays.
    mine.put(&mut WriteCtx::new("z#9", 5), "d", b"held".to_vec());
    theirs.put(&mut WriteCtx::new("z#9", 5), "d", b"offered".to_vec());
    let mut owned = mine.clone();
    owned.merge(theirs.clone());
    let mut borrowed = mine;
    borrowed.merge_from(&theirs);
    assert_eq!(borrowed, owned);
    assert_eq!(borrowed.digest(), owned.digest());
    assert_eq!(
        (borrowed.get("a"), borrowed.get("b"), borrowed.get("c")),
        (Some(&b"theirs-new"[..]), Some(&b"mine-new"[..]), Some(&b"theirs-only"[..])),
        "each key's newer register, from either side"
    );
    assert_eq!(borrowed.get("d"), Some(&b"held"[..]));
    let mut set = gset_with(&["x", "y"]);
    set.merge_from(&gset_with(&["y", "z"]));
    let mut owned = gset_with(&["x", "y"]);
    owned.merge(gset_with(&["y", "z"]));
    assert_eq!((set.len(), set.digest()), (3, owned.digest()));
}

#[test]
fn lww_delta_holds_the_entries_written_since_the_last_take_and_merges_into_a_stale_replica() {
    let mut ctx = WriteCtx::new("a#1", 1);
    let mut m = map_with(&[("old", b"0")]);
    let stale = m.clone();
    let _ = m.take_delta();
    assert!(m.take_delta().is_none());
    m.put(&mut ctx, "new", b"1".to_vec());
    m.remove(&mut ctx, "old");
    let delta = m.take_delta().unwrap();
    assert_eq!(delta.entry_count(), 2);
    assert_eq!(delta.get("new"), Some(&b"1"[..]));
    let mut replica = stale;
    replica.merge(delta);
    assert_eq!(replica, m);
    assert_eq!(replica.digest(), m.digest());
}

#[test]
fn lww_map_size_estimate_and_clock_follow_the_writes() {
    let mut ctx = WriteCtx::new("a#1", 500);
    let mut m = LwwMap::default();
    assert_eq!((m.approx_bytes(), m.max_clock()), (0, 0));
    m.put(&mut ctx, "k", vec![0; 100]);
    // Key, value and writer bytes, plus 16 for the clock and framing.
    assert_eq!(m.approx_bytes(), 1 + 100 + "a#1".len() + 16);
    assert_eq!(m.max_clock(), 500);
    m.put(&mut ctx, "k", vec![0; 100]);
    assert_eq!(m.max_clock(), 501, "a writer's next marker is above its last");
}

#[test]
fn gset_reads_back_its_members_and_merges_members_of_other_replicas() {
    let mut g = GSet::default();
    assert!(g.is_empty());
    g.insert("b");
    g.insert("a");
    g.insert("a");
    assert_eq!((g.len(), g.is_empty()), (2, false));
    assert!(g.contains("a") && !g.contains("c"));
    assert_eq!(g.iter().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(g.members(), ["a", "b"].into_iter().map(String::from).collect());
    assert_eq!(g.approx_bytes(), 6);
    let mut other = gset_with(&["c"]);
    other.merge(g.clone());
    assert_eq!(other.len(), 3);
    assert_ne!(other, g);
    assert_ne!(other.digest(), g.digest());
}

#[test]
fn gset_delta_round_trip_and_bucket_subsets_carry_exactly_their_members() {
    let (k1, k2) = keys_in_two_buckets();
    let mut g = gset_with(&[&k1]);
    let _ = g.take_delta();
    g.insert(k2.clone());
    let delta = g.take_delta().unwrap();
    assert_eq!(delta.members(), [k2.clone()].into_iter().collect());
    assert!(g.take_delta().is_none());
    let sub = g.buckets_subset(&[bucket_of(&k1)]);
    assert!(sub.contains(&k1) && !sub.contains(&k2));
    assert_eq!(sub.bucket_digests()[bucket_of(&k1)], g.bucket_digests()[bucket_of(&k1)]);
    let nonzero: Vec<usize> = (0..BUCKETS).filter(|b| g.bucket_digests()[*b] != 0).collect();
    let mut expected = vec![bucket_of(&k1), bucket_of(&k2)];
    expected.sort();
    assert_eq!(nonzero, expected, "only the buckets holding members have a digest");
    let back: GSet = rmp_serde::from_slice(&rmp_serde::to_vec(&g).unwrap()).unwrap();
    assert_eq!(back, g);
    assert_eq!(back.digest(), g.digest());
}

#[test]
fn replicated_data_names_its_type_and_refuses_deltas_of_another_type_unchanged() {
    let values = [
        ReplicatedData::LwwMap(map_with(&[("k", b"v")])),
        ReplicatedData::OrSet(orset_with(&["x"])),
        ReplicatedData::GSet(gset_with(&["g"])),
    ];
    assert_eq!(values.iter().map(ReplicatedData::type_name).collect::<Vec<_>>(), ["LwwMap", "OrSet", "GSet"]);
    let deltas = [
        ReplicatedDelta::LwwMap(map_with(&[("k2", b"w")])),
        ReplicatedDelta::OrSet({
            let mut s = OrSet::default();
            s.add(&WriteCtx::new("b#1", 1), "y");
            s.take_delta().unwrap()
        }),
        ReplicatedDelta::GSet(gset_with(&["h"])),
    ];
    for (i, v) in values.iter().enumerate() {
        for (j, d) in deltas.iter().enumerate() {
            let mut replica = v.clone();
            let result = replica.merge_delta(d);
            if i == j {
                assert_eq!(result, Ok(()));
                assert_ne!(&replica, v, "a delta of the right type is merged");
                assert_eq!(replica.element_count(), 2);
            } else {
                assert_eq!(result, Err(MergeError::WrongType { mine: v.type_name(), theirs: d.type_name() }));
                assert_eq!(&replica, v);
            }
            assert_eq!(d.empty_value().type_name(), d.type_name());
        }
    }
}

#[test]
fn replicated_data_takes_typed_deltas_and_counts_elements() {
    let mut values = [
        ReplicatedData::LwwMap(map_with(&[("k", b"v"), ("l", b"w")])),
        ReplicatedData::OrSet(orset_with(&["x", "y", "z"])),
        ReplicatedData::GSet(gset_with(&["g"])),
    ];
    assert_eq!(values.iter().map(ReplicatedData::element_count).collect::<Vec<_>>(), [2, 3, 1]);
    for v in values.iter_mut() {
        let d = v.take_delta().unwrap();
        assert_eq!(d.type_name(), v.type_name());
        assert_eq!(d.len(), v.element_count());
        assert!(!d.is_empty());
        assert!(d.approx_bytes() > 0);
        assert!(v.approx_bytes() > 0);
        assert!(v.take_delta().is_none());
    }
}

#[test]
fn empty_values_of_different_types_have_different_digests() {
    let digests = [
        ReplicatedData::LwwMap(LwwMap::default()).digest(),
        ReplicatedData::OrSet(OrSet::default()).digest(),
        ReplicatedData::GSet(GSet::default()).digest(),
    ];
    assert_ne!(digests[0], digests[1]);
    assert_ne!(digests[1], digests[2]);
    assert_ne!(digests[0], digests[2]);
    let full = ReplicatedData::GSet(gset_with(&["a"]));
    assert_ne!(full.digest(), digests[2]);
}

#[test]
fn only_maps_and_gsets_split_by_bucket_and_an_orset_subset_is_the_whole_set() {
    let (k1, k2) = keys_in_two_buckets();
    let map = ReplicatedData::LwwMap(map_with(&[(&k1, b"1"), (&k2, b"2")]));
    let gset = ReplicatedData::GSet(gset_with(&[&k1, &k2]));
    let set = ReplicatedData::OrSet(orset_with(&[&k1, &k2]));
    assert!(map.bucket_digests().is_some() && gset.bucket_digests().is_some());
    assert!(set.bucket_digests().is_none());
    let b = [bucket_of(&k1)];
    assert_eq!(map.buckets_subset(&b).element_count(), 1);
    assert_eq!(gset.buckets_subset(&b).element_count(), 1);
    assert_eq!(set.buckets_subset(&b), set);
}

#[test]
fn pending_deltas_of_one_type_join_and_of_two_types_are_refused() {
    let mut d = ReplicatedDelta::GSet(gset_with(&["a"]));
    d.join(ReplicatedDelta::GSet(gset_with(&["b"]))).unwrap();
    assert_eq!(d.len(), 2);
    let mut m = ReplicatedDelta::LwwMap(map_with(&[("a", b"1")]));
    m.join(ReplicatedDelta::LwwMap(map_with(&[("b", b"1")]))).unwrap();
    assert_eq!(m.len(), 2);
    let mut s = ReplicatedDelta::OrSet(orset_with(&["a"]).take_delta().unwrap());
    let ctx = WriteCtx::new("b#1", 1);
    let mut other = OrSet::default();
    other.add(&ctx, "b");
    s.join(ReplicatedDelta::OrSet(other.take_delta().unwrap())).unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(d.join(ReplicatedDelta::LwwMap(LwwMap::default())), Err(("GSet", "LwwMap")));
    assert!(ReplicatedDelta::GSet(GSet::default()).is_empty());
}

#[test]
fn a_value_of_another_type_is_a_typed_error_naming_the_key() {
    let mut data = ReplicatedData::GSet(gset_with(&["a"]));
    let err = LwwMap::data_mut(&mut data, "shard-7").unwrap_err();
    assert!(
        matches!(&err, Error::WrongDataType { key, expected: "LwwMap", found: "GSet" } if key == "shard-7"),
        "{err:?}"
    );
    assert!(OrSet::from_data(data.clone(), "k").is_err());
    assert_eq!(GSet::from_data(data.clone(), "k").unwrap().len(), 1);
    GSet::data_mut(&mut data, "k").unwrap().insert("b");
    assert_eq!(data.element_count(), 2);
    assert_eq!(OrSet::default().into_data().type_name(), "OrSet");
}
