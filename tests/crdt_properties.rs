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

// ---- The δ-OR-set against two oracles -------------------------------------------------------

/// One step of a three-replica OR-set execution.
#[derive(Debug, Clone)]
enum SetStep {
    Add(usize, u8),
    Remove(usize, u8),
    /// Replica takes its local delta into the network pool.
    TakeDelta(usize),
    /// Pool entry (index mod pool size) is delivered to a replica; it stays in the pool, so it
    /// may be delivered again (duplication) or never (loss), in any order.
    Deliver(usize, usize),
    /// Full-state anti-entropy from one replica to another.
    FullSync(usize, usize),
    /// Replica commits its state to its disk.
    Commit(usize),
    /// Replica crashes and restarts from its disk (what it had not committed is lost, though
    /// deltas it already shipped may still be delivered); its writer's next add jumps to the
    /// floor its store reserved.
    Restart(usize),
}

fn set_step() -> impl Strategy<Value = SetStep> {
    let r = 0usize..3;
    prop_oneof![
        4 => (r.clone(), 0u8..6).prop_map(|(r, x)| SetStep::Add(r, x)),
        2 => (r.clone(), 0u8..6).prop_map(|(r, x)| SetStep::Remove(r, x)),
        2 => r.clone().prop_map(SetStep::TakeDelta),
        3 => (any::<usize>(), r.clone()).prop_map(|(i, to)| SetStep::Deliver(i, to)),
        1 => (r.clone(), r.clone()).prop_map(|(a, b)| SetStep::FullSync(a, b)),
        2 => r.clone().prop_map(SetStep::Commit),
        1 => r.prop_map(SetStep::Restart),
    ]
}

/// One event of the specification: (element, the dot it added if any, the dots it killed, the
/// counter range its writer claimed with it).
type SpecEvent = (String, Option<(usize, u64)>, Vec<(usize, u64)>, Option<(u64, u64)>);

/// Counters a store reserves per process in these runs.
const SPAN: u64 = 1_000;

/// The OR-set specification: an element is present at a replica when the replica knows an add
/// of it whose dot no known event has killed (a remove kills the dots it observed; an add kills
/// the older dots of its element; a writer's first add after a restart also kills every dot of
/// it in the range it claims: adds its crashed process sent and never committed).
#[derive(Default)]
struct Spec {
    events: Vec<SpecEvent>,
    known: [std::collections::BTreeSet<usize>; 3],
    unshipped: [Vec<usize>; 3],
    committed: [std::collections::BTreeSet<usize>; 3],
    floors: [u64; 3],
}

impl Spec {
    fn live_dots(&self, r: usize, x: &str) -> Vec<(usize, u64)> {
        let killed: std::collections::BTreeSet<(usize, u64)> =
            self.known[r].iter().flat_map(|e| self.events[*e].2.iter().copied()).collect();
        self.known[r]
            .iter()
            .filter_map(|e| {
                let (el, dot, _, _) = &self.events[*e];
                dot.filter(|d| el == x && !killed.contains(d))
            })
            .collect()
    }
    fn present(&self, r: usize) -> std::collections::BTreeSet<String> {
        (0..6).map(|x| format!("m{x}")).filter(|x| !self.live_dots(r, x).is_empty()).collect()
    }
    /// The highest counter of writer `r` in replica `r`'s causal context.
    fn context_max(&self, r: usize) -> u64 {
        let mut max = 0;
        for e in &self.known[r] {
            let (_, dot, killed, claim) = &self.events[*e];
            for (w, c) in dot.iter().chain(killed) {
                if *w == r {
                    max = max.max(*c);
                }
            }
            if let (Some((_, hi)), Some((w, _))) = (claim, dot)
                && *w == r
            {
                max = max.max(*hi);
            }
        }
        max
    }
    fn event(&mut self, r: usize, x: String, add: bool) {
        let mut killed = self.live_dots(r, &x);
        let mut claim = None;
        let dot = add.then(|| {
            let max = self.context_max(r);
            let next = (max + 1).max(self.floors[r]);
            if next - 1 > max {
                claim = Some((max + 1, next - 1));
                let lost = self.events.iter().filter_map(|e| e.1).filter(|(w, c)| *w == r && *c > max && *c < next);
                killed.extend(lost);
            }
            (r, next)
        });
        if !add && killed.is_empty() {
            return;
        }
        self.events.push((x, dot, killed, claim));
        let e = self.events.len() - 1;
        self.known[r].insert(e);
        self.unshipped[r].push(e);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Full-state replication: the δ-OR-set has the same members as `crdts::Orswot` after every
    /// step, and equal states have equal digests.
    #[test]
    fn or_set_matches_the_crdts_orswot_oracle_under_full_state_sync(
        steps in prop::collection::vec(set_step(), 1..60),
    ) {
        use crdts::{CmRDT, CvRDT, Orswot};
        let ctxs: Vec<WriteCtx> = (0..3).map(|i| WriteCtx::new(format!("n{i}#1"), 1)).collect();
        let mut ours: Vec<OrSet> = vec![OrSet::default(); 3];
        let mut oracle: Vec<Orswot<String, String>> = vec![Orswot::new(); 3];
        for step in steps {
            match step {
                SetStep::Add(r, x) => {
                    ours[r].add(&ctxs[r], format!("m{x}"));
                    let op = oracle[r].add(format!("m{x}"), oracle[r].read_ctx().derive_add_ctx(format!("n{r}#1")));
                    oracle[r].apply(op);
                }
                SetStep::Remove(r, x) => {
                    ours[r].remove(&format!("m{x}"));
                    let m = format!("m{x}");
                    let op = oracle[r].rm(m.clone(), oracle[r].contains(&m).derive_rm_ctx());
                    oracle[r].apply(op);
                }
                SetStep::FullSync(a, b) | SetStep::Deliver(a, b) if a < 3 => {
                    let from = ours[a].clone();
                    ours[b].merge(from);
                    let from = oracle[a].clone();
                    oracle[b].merge(from);
                }
                _ => {}
            }
            for (r, (mine, theirs)) in ours.iter().zip(&oracle).enumerate() {
                let expected: std::collections::BTreeSet<String> = theirs.read().val.into_iter().collect();
                prop_assert_eq!(mine.members(), expected, "replica {}", r);
            }
        }
        for a in 0..3 {
            for b in 0..3 {
                if ours[a] == ours[b] {
                    prop_assert_eq!(ours[a].digest(), ours[b].digest());
                }
            }
        }
    }

    /// δ-replication with loss, duplication and reordering, plus occasional full-state sync:
    /// after every step each replica holds exactly the members the specification gives for the
    /// events it knows; once everything is delivered, all replicas are equal with equal digests,
    /// whatever the order they learnt things in, and so are their decoded copies.
    #[test]
    fn or_set_deltas_lost_duplicated_or_reordered_or_from_crashed_writers_match_the_specification(
        steps in prop::collection::vec(set_step(), 1..80),
    ) {
        let store_ctx = |r: usize, floor: u64| {
            WriteCtx::new(format!("n{r}#1"), 1).with_set_writer(format!("n{r}#store"), floor, floor + SPAN)
        };
        let mut ctxs: Vec<WriteCtx> = (0..3).map(|r| store_ctx(r, 0)).collect();
        let mut ours: Vec<OrSet> = vec![OrSet::default(); 3];
        let mut disks: Vec<OrSet> = vec![OrSet::default(); 3];
        let mut spec = Spec::default();
        let mut pool: Vec<(ddshard::ddata::OrSetDelta, Vec<usize>)> = Vec::new();
        for step in steps {
            match step {
                SetStep::Add(r, x) => {
                    ours[r].add(&ctxs[r], format!("m{x}"));
                    spec.event(r, format!("m{x}"), true);
                }
                SetStep::Remove(r, x) => {
                    ours[r].remove(&format!("m{x}"));
                    spec.event(r, format!("m{x}"), false);
                }
                SetStep::TakeDelta(r) => {
                    let events = std::mem::take(&mut spec.unshipped[r]);
                    match ours[r].take_delta() {
                        Some(d) => pool.push((d, events)),
                        None => prop_assert!(events.is_empty(), "events without a delta"),
                    }
                }
                SetStep::Deliver(i, to) => {
                    if !pool.is_empty() {
                        let (d, events) = &pool[i % pool.len()];
                        ours[to].merge_delta(d).unwrap();
                        spec.known[to].extend(events.iter().copied());
                    }
                }
                SetStep::FullSync(a, b) => {
                    let from = ours[a].clone();
                    ours[b].merge(from);
                    let known = spec.known[a].clone();
                    spec.known[b].extend(known);
                }
                SetStep::Commit(r) => {
                    disks[r] = ours[r].clone();
                    spec.committed[r] = spec.known[r].clone();
                }
                SetStep::Restart(r) => {
                    ours[r] = disks[r].clone();
                    // A loaded value has no local changes to ship: what it committed spreads
                    // by anti-entropy.
                    ours[r].take_delta();
                    spec.known[r] = spec.committed[r].clone();
                    spec.unshipped[r].clear();
                    spec.floors[r] += SPAN;
                    ctxs[r] = store_ctx(r, spec.floors[r]);
                }
            }
            for (r, set) in ours.iter().enumerate() {
                prop_assert_eq!(set.members(), spec.present(r), "replica {}", r);
            }
        }
        // Deliver every delta everywhere (in reverse order), then full-sync around the ring.
        for (d, _) in pool.iter().rev() {
            for s in ours.iter_mut() {
                s.merge_delta(d).unwrap();
            }
        }
        for _ in 0..2 {
            for a in 0..3 {
                let from = ours[a].clone();
                ours[(a + 1) % 3].merge(from);
            }
        }
        for r in 1..3 {
            prop_assert_eq!(&ours[r], &ours[0]);
            prop_assert_eq!(ours[r].digest(), ours[0].digest());
        }
        let decoded: OrSet = rmp_serde::from_slice(&rmp_serde::to_vec(&ours[1]).unwrap()).unwrap();
        prop_assert_eq!(decoded.digest(), ours[0].digest());
        prop_assert_eq!(&decoded, &ours[0]);
    }

    /// A replica that had a writer's state merges the writer's later delta and ends exactly
    /// where merging the writer's full state would leave it (for all three types).
    #[test]
    fn a_delta_on_top_of_the_previous_state_equals_the_full_state(
        base in prop::collection::vec(op(), 0..10),
        more in prop::collection::vec(op(), 1..10),
        other in prop::collection::vec(op(), 0..10),
    ) {
        // LWW-map.
        let mut ctx = WriteCtx::new("w#1", 5);
        let mut writer = LwwMap::default();
        apply_lww(&mut writer, &mut ctx, &base);
        let mut replica = writer.clone();
        apply_lww(&mut replica, &mut WriteCtx::new("r#1", 3), &other);
        writer.take_delta();
        apply_lww(&mut writer, &mut ctx, &more);
        let delta = writer.take_delta();
        let mut by_delta = replica.clone();
        if let Some(d) = delta { by_delta.merge(d); }
        let mut by_full = replica.clone();
        by_full.merge(writer.clone());
        prop_assert_eq!(by_delta.digest(), by_full.digest());
        prop_assert_eq!(by_delta, by_full);

        // OR-set.
        let wctx = WriteCtx::new("w#1", 1);
        let mut writer = OrSet::default();
        apply_orset(&mut writer, &wctx, &base);
        let mut replica = writer.clone();
        apply_orset(&mut replica, &WriteCtx::new("r#1", 1), &other);
        writer.take_delta();
        apply_orset(&mut writer, &wctx, &more);
        let mut by_delta = replica.clone();
        if let Some(d) = writer.take_delta() { by_delta.merge_delta(&d).unwrap(); }
        let mut by_full = replica.clone();
        by_full.merge(writer.clone());
        prop_assert_eq!(by_delta.digest(), by_full.digest());
        prop_assert_eq!(by_delta, by_full);
    }
}
