//! Property tests: merging LWW-map, OR-set and G-set states is commutative, associative and
//! idempotent, for states that grew concurrently from a shared history.

use ddshard::ddata::{GSet, LwwMap, OrSet, ReplicatedData, WriteCtx};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Put(u8, u8),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..6, any::<u8>()).prop_map(|(k, v)| Op::Put(k, v)),
        1 => (0u8..6).prop_map(Op::Remove),
    ]
}

fn apply_lww(map: &mut LwwMap, ctx: &mut WriteCtx, ops: &[Op]) {
    for o in ops {
        match o {
            Op::Put(k, v) => map.put(ctx, format!("k{k}"), vec![*v]),
            Op::Remove(k) => map.remove(ctx, &format!("k{k}")),
        }
    }
}

fn apply_orset(set: &mut OrSet, ctx: &WriteCtx, ops: &[Op]) {
    for o in ops {
        match o {
            Op::Put(k, _) => set.add(ctx, format!("m{k}")),
            Op::Remove(k) => set.remove(&format!("m{k}")),
        }
    }
}

fn merged(a: &ReplicatedData, b: &ReplicatedData) -> ReplicatedData {
    let mut x = a.clone();
    x.merge(b.clone()).unwrap();
    x
}

fn check_laws(a: ReplicatedData, b: ReplicatedData, c: ReplicatedData) -> Result<(), TestCaseError> {
    prop_assert_eq!(merged(&a, &b), merged(&b, &a), "commutative");
    prop_assert_eq!(merged(&merged(&a, &b), &c), merged(&a, &merged(&b, &c)), "associative");
    prop_assert_eq!(merged(&a, &a), a.clone(), "idempotent");
    let ab = merged(&a, &b);
    prop_assert_eq!(merged(&ab, &b), ab.clone(), "merging a part again changes nothing");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn lww_map_merge_is_commutative_associative_idempotent(
        base in prop::collection::vec(op(), 0..8),
        ops in prop::collection::vec(prop::collection::vec(op(), 0..10), 3),
        clocks in prop::collection::vec(0u64..5, 3),
    ) {
        let mut shared = LwwMap::default();
        apply_lww(&mut shared, &mut WriteCtx::new("base#1", 1), &base);
        let states: Vec<ReplicatedData> = (0..3).map(|i| {
            let mut m = shared.clone();
            // Small, colliding wall clocks: ties are broken by the actor, never by luck.
            apply_lww(&mut m, &mut WriteCtx::new(format!("n{i}#1"), clocks[i]), &ops[i]);
            ReplicatedData::LwwMap(m)
        }).collect();
        let [a, b, c]: [ReplicatedData; 3] = states.try_into().unwrap();
        check_laws(a, b, c)?;
    }

    #[test]
    fn or_set_merge_is_commutative_associative_idempotent(
        base in prop::collection::vec(op(), 0..8),
        ops in prop::collection::vec(prop::collection::vec(op(), 0..10), 3),
    ) {
        let mut shared = OrSet::default();
        apply_orset(&mut shared, &WriteCtx::new("base#1", 1), &base);
        let states: Vec<ReplicatedData> = (0..3).map(|i| {
            let mut s = shared.clone();
            apply_orset(&mut s, &WriteCtx::new(format!("n{i}#1"), 1), &ops[i]);
            ReplicatedData::OrSet(s)
        }).collect();
        let [a, b, c]: [ReplicatedData; 3] = states.try_into().unwrap();
        check_laws(a, b, c)?;
    }

    #[test]
    fn or_set_keeps_every_add_not_followed_by_a_remove_on_the_same_replica(
        ops in prop::collection::vec(prop::collection::vec(op(), 1..10), 3),
    ) {
        let mut all = OrSet::default();
        let mut expected = std::collections::BTreeSet::new();
        for (i, o) in ops.iter().enumerate() {
            let mut s = OrSet::default();
            apply_orset(&mut s, &WriteCtx::new(format!("n{i}#1"), 1), o);
            expected.extend(s.members());
            all.merge(s);
        }
        // Replicas never saw each other's adds, so no remove can cancel a foreign add.
        prop_assert_eq!(all.members(), expected);
    }

    #[test]
    fn g_set_merge_is_commutative_associative_idempotent(
        xs in prop::collection::vec(prop::collection::btree_set(0u8..20, 0..8), 3),
    ) {
        let states: Vec<ReplicatedData> = xs.iter().map(|x| {
            let mut g = GSet::default();
            for v in x { g.insert(v.to_string()); }
            ReplicatedData::GSet(g)
        }).collect();
        let [a, b, c]: [ReplicatedData; 3] = states.try_into().unwrap();
        check_laws(a, b, c)?;
    }
}
