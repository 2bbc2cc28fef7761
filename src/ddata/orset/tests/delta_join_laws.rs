//! The δ-join laws against sequences of operations on three replicas with store writers that
//! restart (so deltas carry claims), syncing by full merges now and then.

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        replica: usize,
        element: u8,
    },
    Remove {
        replica: usize,
        element: u8,
    },
    /// The replica's store writer starts a new process: its next add jumps to a new floor.
    Restart {
        replica: usize,
    },
    /// As `Restart`, and the replica lost its set (nothing of it was durable): its next add
    /// claims every counter below the new floor, including those of adds it sent before.
    Crash {
        replica: usize,
    },
    Take {
        replica: usize,
    },
    Sync {
        from: usize,
        to: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..6u8).prop_map(|(replica, element)| Op::Add { replica, element }),
        2 => (0..3usize, 0..6u8).prop_map(|(replica, element)| Op::Remove { replica, element }),
        1 => (0..3usize).prop_map(|replica| Op::Restart { replica }),
        1 => (0..3usize).prop_map(|replica| Op::Crash { replica }),
        3 => (0..3usize).prop_map(|replica| Op::Take { replica }),
        1 => (0..3usize, 0..3usize).prop_map(|(from, to)| Op::Sync { from, to }),
    ]
}

/// The deltas the operations produced, in order.
fn deltas_of(ops: &[Op]) -> Vec<OrSetDelta> {
    let mut sets = vec![OrSet::default(), OrSet::default(), OrSet::default()];
    let mut floors = [1u64; 3];
    let mut deltas = Vec::new();
    for op in ops {
        match *op {
            Op::Add { replica, element } => {
                let f = floors[replica];
                let c = WriteCtx::new(format!("r{replica}#1"), 1).with_set_writer(
                    format!("r{replica}#store"),
                    f,
                    f + 1_000_000,
                );
                sets[replica].add(&c, format!("e{element}"));
            }
            Op::Remove { replica, element } => sets[replica].remove(&format!("e{element}")),
            Op::Restart { replica } => floors[replica] += 1_000_000,
            Op::Crash { replica } => {
                floors[replica] += 1_000_000;
                sets[replica] = OrSet::default();
            }
            Op::Take { replica } => deltas.extend(sets[replica].take_delta()),
            Op::Sync { from, to } => {
                let s = sets[from].clone();
                sets[to].merge(s);
            }
        }
    }
    for s in &mut sets {
        deltas.extend(s.take_delta());
    }
    deltas
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn applying_two_joined_deltas_equals_applying_one_after_the_other(
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let deltas = deltas_of(&ops);
        // Bases: nothing, and the first half of the deltas applied.
        let mut half = OrSet::default();
        for d in &deltas[..deltas.len() / 2] {
            half.merge_delta(d).unwrap();
        }
        for base in [OrSet::default(), half] {
            for (i, first) in deltas.iter().enumerate() {
                for second in deltas.iter().skip(i + 1).take(4) {
                    let mut joined = first.clone();
                    joined.join_delta(second.clone());
                    let mut at_once = base.clone();
                    at_once.merge_delta(&joined).unwrap();
                    let mut in_turn = base.clone();
                    in_turn.merge_delta(first).unwrap();
                    in_turn.merge_delta(second).unwrap();
                    prop_assert_eq!(&at_once, &in_turn, "joined {:?}", joined);
                }
            }
        }
    }
}
