//! Table tests of the replicated data types (the merge laws are property-tested in
//! `tests/crdt_properties.rs`); `accessors` pins what a caller reads back.

use super::*;

mod accessors;

/// One value and its delta of each type, each with something in it.
fn one_of_each() -> Vec<ReplicatedData> {
    let mut ctx = WriteCtx::new("a#1", 1);
    let mut lww = LwwMap::default();
    lww.put(&mut ctx, "k", vec![1, 2, 3]);
    let mut or = OrSet::default();
    or.add(&ctx, "member-1");
    or.add(&ctx, "member-2");
    let mut g = GSet::default();
    g.insert("a-member-of-the-g-set");
    let mut fenced = FencedMap::default();
    fenced.put("k", 7, vec![9; 40]).unwrap();
    let all = vec![
        ReplicatedData::LwwMap(lww),
        ReplicatedData::OrSet(or),
        ReplicatedData::GSet(g),
        ReplicatedData::FencedMap(fenced),
    ];
    assert_eq!(all.len(), 4, "every type of with_types! is here");
    all
}

/// The enums dispatch to each type's own answer: its name, fence (the fenced map's alone),
/// sizes, counts and empty value, for the value and for the delta it hands out.
#[test]
fn each_type_answers_through_the_enums_with_its_own_name_fence_sizes_and_counts() {
    for mut value in one_of_each() {
        let name = value.type_name();
        let fenced = name == "FencedMap";
        assert_eq!(value.fence(), fenced.then_some(7), "{name}");
        let elements = match &value {
            ReplicatedData::OrSet(s) => s.len(),
            ReplicatedData::GSet(g) => g.len(),
            ReplicatedData::LwwMap(m) => m.entry_count(),
            ReplicatedData::FencedMap(m) => m.entry_count(),
        };
        assert_eq!(value.element_count(), elements, "{name}");
        assert!(value.approx_bytes() > 10, "{name}: its own size, not a constant");
        let delta = value.take_delta().unwrap_or_else(|| panic!("{name} hands out its local changes"));
        assert_eq!(delta.type_name(), name);
        assert_eq!(delta.fence(), fenced.then_some(7), "{name}");
        assert_eq!(delta.len(), elements, "{name}: the delta carries every local change");
        let own_bytes = match &delta {
            ReplicatedDelta::OrSet(d) => d.approx_bytes(),
            ReplicatedDelta::GSet(g) => g.approx_bytes(),
            ReplicatedDelta::LwwMap(m) => m.approx_bytes(),
            ReplicatedDelta::FencedMap(m) => m.approx_bytes(),
        };
        assert_eq!(delta.approx_bytes(), own_bytes, "{name}");
        assert!(own_bytes > 1, "{name}");
        let empty = delta.empty_value();
        assert_eq!(empty.type_name(), name);
        assert_eq!(empty.element_count(), 0, "{name}");
        assert!(value.take_delta().is_none(), "{name}: taken once");
    }
}

#[test]
fn lww_writer_that_read_a_value_overwrites_it_even_with_an_older_clock() {
    let mut a = LwwMap::default();
    let mut fast = WriteCtx::new("a#1", 10_000);
    a.put(&mut fast, "k", b"from-a".to_vec());
    let mut slow = WriteCtx::new("b#1", 5);
    let mut b = a.clone();
    b.put(&mut slow, "k", b"from-b".to_vec());
    a.merge(b);
    assert_eq!(a.get("k"), Some(&b"from-b"[..]));
}

#[test]
fn lww_remove_is_a_tombstone_that_wins_over_the_older_write() {
    let mut ctx = WriteCtx::new("a#1", 1);
    let mut a = LwwMap::default();
    a.put(&mut ctx, "k", vec![1]);
    let old = a.clone();
    a.remove(&mut ctx, "k");
    a.merge(old);
    assert_eq!(a.get("k"), None);
    assert!(a.is_empty());
}

#[test]
fn orset_concurrent_add_wins_over_remove() {
    let c1 = WriteCtx::new("a#1", 1);
    let c2 = WriteCtx::new("b#1", 1);
    let mut a = OrSet::default();
    a.add(&c1, "x");
    let mut b = a.clone();
    b.remove("x");
    a.add(&c1, "x");
    b.add(&c2, "y");
    a.merge(b);
    assert!(a.contains("x"));
    assert!(a.contains("y"));
}

#[test]
fn merging_different_types_is_refused() {
    let mut a = ReplicatedData::GSet(GSet::default());
    assert_eq!(a.merge(ReplicatedData::OrSet(OrSet::default())), Err(("GSet", "OrSet")));
}

#[test]
fn fuzz_replicated_values_deltas_and_replicator_messages() {
    use crate::ddata::replicator::ReplicatorMsg;
    let (c1, c2) = (WriteCtx::new("a#1", 1), WriteCtx::new("b#2", 7));
    let mut set = OrSet::default();
    for id in ["cart-1", "cart-2", "cart-3"] {
        set.add(&c1, id);
    }
    set.remove("cart-2");
    set.add(&c2, "cart-4");
    let set_delta = set.take_delta();
    let mut map = LwwMap::default();
    let mut w = WriteCtx::new("a#1", 3);
    map.put(&mut w, "shard-1", b"region".to_vec());
    map.remove(&mut w, "shard-2");
    let mut gset = GSet::default();
    gset.insert("x");
    let values = [ReplicatedData::OrSet(set), ReplicatedData::LwwMap(map), ReplicatedData::GSet(gset)];
    let mut deltas: Vec<ReplicatedDelta> = set_delta.into_iter().map(ReplicatedDelta::OrSet).collect();
    deltas.extend(values.iter().cloned().filter_map(|mut v| v.take_delta()));
    let mut seeds: Vec<Vec<u8>> = values.iter().map(|v| rmp_serde::to_vec(v).unwrap()).collect();
    seeds.extend(deltas.iter().map(|d| rmp_serde::to_vec(d).unwrap()));
    let msgs = [
        ReplicatorMsg::WriteDelta {
            op: 1,
            entries: vec![("k".into(), deltas[0].clone())],
            values: vec![("v".into(), values[1].clone())],
        },
        ReplicatorMsg::Gossip {
            entries: vec![("g".into(), values[0].clone())],
            want: vec!["w".into()],
            want_buckets: vec![("b".into(), vec![1, 2])],
            value_buckets: vec![("b".into(), vec![3])],
        },
        ReplicatorMsg::ReadResult { op: 2, values: vec![(0, Some(values[2].clone())), (1, None)] },
    ];
    seeds.extend(msgs.iter().map(|m| crate::transport::wire::encode(m).unwrap().to_vec()));
    bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
        let bytes = crate::fuzzing::mutate(&seeds, input);
        if let Ok(value) = rmp_serde::from_slice::<ReplicatedData>(&bytes) {
            // Merged into a replica holding data (of its type or another): a typed refusal
            // leaves the replica as it was.
            for mine in &values {
                let mut replica = mine.clone();
                if replica.try_merge(value.clone()).is_err() {
                    assert_eq!(&replica, mine, "a refused merge changed the replica");
                }
            }
        }
        if let Ok(delta) = rmp_serde::from_slice::<ReplicatedDelta>(&bytes) {
            let _ = delta.empty_value().merge_delta(&delta);
            for mine in &values {
                let mut replica = mine.clone();
                if replica.merge_delta(&delta).is_err() {
                    assert_eq!(&replica, mine, "a refused delta changed the replica");
                }
            }
        }
        let _ = crate::transport::wire::decode::<ReplicatorMsg>(&bytes);
    });
}
