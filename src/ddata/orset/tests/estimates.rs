//! The OR-set's size estimates against the real figures: the encoding, a counting allocator
//! and the encoders' own lengths.
use super::*;

#[test]
fn heap_bytes_stay_under_64_per_id_and_count_the_cloud_the_writers_and_extra_dots() {
    let mut s = OrSet::default();
    for i in 0..10_000u32 {
        s.add(&ctx("a#1"), format!("{:08x}-entity", i.wrapping_mul(2_654_435_761)));
    }
    let per_id = s.heap_bytes() as f64 / 10_000.0;
    assert!((15.0..=64.0).contains(&per_id), "{per_id} B/id: at least the 15-byte ids, at most the goal");
    assert!(s.heap_bytes() >= s.arena.capacity() + s.index.capacity() * std::mem::size_of::<Slot>());

    let before = (s.heap_bytes(), s.approx_bytes());
    for k in 0..100 {
        s.context_insert_range(0, 20_000 + 3 * k, 20_001 + 3 * k);
    }
    assert_eq!(s.cloud_intervals(), 100);
    let grew = (s.heap_bytes() - before.0, s.approx_bytes() - before.1);
    assert!(grew.0 >= 100 * 40 && grew.0 < 100 * 100, "cloud in memory: {grew:?}");
    assert!(grew.1 >= 100 * 6 && grew.1 < 100 * 20, "cloud encoded: {grew:?}");

    let before = (s.heap_bytes(), s.approx_bytes());
    for w in 0..20 {
        // Twenty concurrent adds of one element: twenty writers, and x holds twenty dots.
        let mut other = OrSet::default();
        other.add(&ctx(&format!("{w:0>100}")), "x");
        s.merge(other);
    }
    assert_eq!(s.extra.len(), 1);
    let grew = (s.heap_bytes() - before.0, s.approx_bytes() - before.1);
    assert!(grew.0 >= 20 * 100 * 2 + 40, "writer names, in the table and its map, and x's extra dots: {grew:?}");
    assert!(grew.1 >= 20 * 100 + 20 * 2, "writer names and x's dots encoded: {grew:?}");
}

#[test]
fn approx_bytes_stays_within_a_quarter_of_the_encoded_size() {
    let mut ids = OrSet::default();
    for i in 0..2_000 {
        ids.add(&ctx("n1#store-0123456789abcdef"), format!("device-{i}"));
    }
    let mut gappy = OrSet::default();
    let mut writer = OrSet::default();
    for i in 0..400 {
        writer.add(&ctx("w#1"), format!("e{i}"));
        let d = writer.take_delta().unwrap();
        if i % 2 == 0 {
            gappy.merge_delta(&d).unwrap();
        }
    }
    let mut many_writers = OrSet::default();
    for w in 0..50 {
        many_writers.add(&ctx(&format!("node-{w}#store-{w:016x}")), format!("id-{w}"));
    }
    for (name, s) in [("ids", &ids), ("gappy", &gappy), ("many writers", &many_writers)] {
        let encoded = rmp_serde::to_vec(s).unwrap().len() as f64;
        let ratio = s.approx_bytes() as f64 / encoded;
        assert!((0.8..=1.25).contains(&ratio), "{name}: approx {} vs encoded {encoded}", s.approx_bytes());
    }
}

#[test]
fn delta_approx_bytes_stays_within_a_quarter_of_the_encoded_size() {
    let mut small = OrSet::default();
    small.add(&ctx("n1#1"), "x");
    let mut many = OrSet::default();
    for i in 0..500 {
        many.add(&store_ctx(0), format!("device-{i:05}"));
    }
    many.take_delta();
    for i in 0..500 {
        many.remove(&format!("device-{i:05}"));
        many.add(&store_ctx(1 << 30), format!("device-{i:05}"));
    }
    let mut writers = OrSet::default();
    for w in 0..40 {
        let mut other = OrSet::default();
        other.add(&ctx(&format!("node-{w}#store-{w:016x}")), "shared");
        writers.merge(other);
    }
    writers.remove("shared");
    // Forty store writers, each restarted twice far along its counters: the delta of the
    // second restart is mostly claims whose both ends are large numbers.
    let mut claims: Option<OrSetDelta> = None;
    for w in 0..40u64 {
        let restarted = |floor: u64| WriteCtx::new("c#1", 1).with_set_writer(format!("c{w}"), floor, floor + 1_000);
        let mut s = OrSet::default();
        s.add(&restarted(1 << 40), "x");
        s.take_delta();
        s.add(&restarted((1 << 41) + w), "x");
        let d = s.take_delta().unwrap();
        assert!(d.claims.iter().all(|&(_, lo, _)| lo > 1 << 32), "{:?}", d.claims);
        match claims.as_mut() {
            Some(all) => all.join_delta(d),
            None => claims = Some(d),
        }
    }
    assert_eq!(claims.as_ref().unwrap().claims.len(), 40);
    for (name, d) in [
        ("one add", small.take_delta()),
        ("re-adds with a claim", many.take_delta()),
        ("many writers", writers.take_delta()),
        ("mostly claims", claims),
    ] {
        let d = d.unwrap();
        let encoded = rmp_serde::to_vec(&d).unwrap().len() as f64;
        let ratio = d.approx_bytes() as f64 / encoded;
        assert!((0.8..=1.25).contains(&ratio), "{name}: approx {} vs encoded {encoded}", d.approx_bytes());
    }
}

#[test]
fn the_byte_length_helpers_match_the_encoders_at_every_width_boundary() {
    for v in [
        0,
        1,
        127,
        128,
        200,
        255,
        256,
        16_383,
        16_384,
        65_535,
        65_536,
        (1 << 21) - 1,
        1 << 21,
        0xffff_ffff,
        1 << 32,
        MAX_COUNTER,
        u64::MAX,
    ] {
        let mut varint = Vec::new();
        put_varint(&mut varint, v);
        assert_eq!(varint_len(v), varint.len(), "varint of {v}");
        assert_eq!(rmp_uint_len(v), rmp_serde::to_vec(&v).unwrap().len(), "MessagePack of {v}");
    }
}

/// Builds one set of a shape.
type BuildSet = fn() -> OrSet;

/// Sets of every shape the size estimates must follow: each is dominated by another part of
/// the set (arena and index, writer names, cloud intervals, extra dots).
fn sets_of_every_shape() -> [(&'static str, BuildSet); 7] {
    [
        ("20,000 long ids of one writer", || {
            let mut s = OrSet::default();
            let c = ctx("a#1");
            for i in 0..20_000u32 {
                s.add(&c, format!("{:08x}-entity", i.wrapping_mul(2_654_435_761)));
            }
            s
        }),
        ("20,000 short ids of one writer", || {
            let mut s = OrSet::default();
            let c = ctx("a#1");
            for i in 0..20_000u32 {
                s.add(&c, i.to_string());
            }
            s
        }),
        ("300 writers with long names, one id each", || {
            let mut s = OrSet::default();
            for w in 0..300 {
                let mut other = OrSet::default();
                other.add(&ctx(&format!("{w:0>120}")), format!("id-{w}"));
                s.merge(other);
            }
            s
        }),
        ("2,000 single-dot cloud entries", || {
            let mut s = OrSet::default();
            s.add(&ctx("a#1"), "x");
            for k in 0..2_000 {
                s.context_insert_range(0, 1_000_000 + 3 * k, 1_000_000 + 3 * k);
            }
            s
        }),
        ("2,000 cloud ranges", || {
            let mut s = OrSet::default();
            s.add(&ctx("a#1"), "x");
            for k in 0..2_000 {
                s.context_insert_range(0, 1_000_000 + 5 * k, 1_000_002 + 5 * k);
            }
            s
        }),
        ("1,000 writers with short names, every element removed", || {
            let mut s = OrSet::default();
            for w in 0..1_000 {
                let mut other = OrSet::default();
                other.add(&ctx(&format!("w{w}")), "x");
                s.merge(other);
            }
            s.remove("x");
            s
        }),
        ("500 ids each added concurrently by 6 writers", || {
            let mut s = OrSet::default();
            for w in 0..6 {
                let mut other = OrSet::default();
                let c = ctx(&format!("w{w}#1"));
                for i in 0..500 {
                    other.add(&c, format!("id-{i}"));
                }
                s.merge(other);
            }
            s
        }),
    ]
}

#[test]
fn heap_bytes_is_within_a_third_of_what_the_allocator_holds_for_every_shape_of_set() {
    for (name, shape) in sets_of_every_shape() {
        let (s, allocated) = crate::alloc_count::live_bytes_after(|| {
            let mut s = shape();
            drop(s.take_delta());
            s
        });
        let ratio = s.heap_bytes() as f64 / allocated as f64;
        assert!((0.75..=1.33).contains(&ratio), "{name}: heap_bytes is {ratio:.3} of the allocated bytes");
    }
}

#[test]
fn approx_bytes_is_within_a_quarter_of_the_encoded_size_for_every_shape_of_set() {
    for (name, shape) in sets_of_every_shape() {
        let s = shape();
        let encoded = rmp_serde::to_vec(&s).unwrap().len();
        let ratio = s.approx_bytes() as f64 / encoded as f64;
        assert!((0.8..=1.25).contains(&ratio), "{name}: approx {} vs encoded {encoded}", s.approx_bytes());
    }
}

#[test]
fn delta_approx_bytes_is_within_a_quarter_of_the_encoded_size_for_every_shape_of_set() {
    let readded: (&str, BuildSet) = ("one element re-added 100 times: a delta of dots", || {
        let mut s = OrSet::default();
        for _ in 0..100 {
            s.add(&ctx("a"), "x");
        }
        s
    });
    for (name, shape) in sets_of_every_shape().into_iter().chain([readded]) {
        let Some(d) = shape().take_delta() else { continue };
        let encoded = rmp_serde::to_vec(&d).unwrap().len();
        let ratio = d.approx_bytes() as f64 / encoded as f64;
        assert!((0.8..=1.25).contains(&ratio), "{name}: approx {} vs encoded {encoded}", d.approx_bytes());
    }
}
