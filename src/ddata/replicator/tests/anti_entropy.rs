//! Anti-entropy message budgets: what a `Digests`, a `Gossip` answer and the values a peer
//! wants may carry within `max_message_bytes`, and the caps on wanted keys.

use super::*;

/// A `Digests` answer to `KeyBuckets` lists the keys of the differing buckets, whole buckets at
/// a time, while they fit `max_message_bytes` (each key counts its length plus 10 bytes); the
/// first bucket is always listed, so a bucket larger than the budget still converges.
#[test]
fn a_digests_reply_lists_whole_buckets_within_the_message_budget_and_always_the_first() {
    let mut a = core("a");
    for i in 0..300 {
        local(&mut a, &format!("key-{i:04}"), add("x"));
    }
    let theirs = vec![0u64; KEY_BUCKETS]; // an empty replica: every bucket with a key differs
    let mut keys_of: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (k, e) in &a.data {
        keys_of.entry(e.key_hash as usize % KEY_BUCKETS).or_default().push(k.clone());
    }
    let size_of = |b: &usize| keys_of[b].iter().map(|k| k.len() + 10).sum::<usize>();
    let first_size = size_of(keys_of.keys().next().unwrap());
    // Exactly the first two buckets: the second fits to the byte.
    let two = first_size + size_of(keys_of.keys().nth(1).unwrap());
    for budget in [1, first_size, first_size + 1, two - 1, two, 500, 2_000, 1 << 20] {
        a.settings.max_message_bytes = budget;
        let mut out = Vec::new();
        let msg = ReplicatorMsg::KeyBuckets { digests: theirs.clone() };
        a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
        let (buckets, digests) = out
            .iter()
            .find_map(|x| match x {
                ReplicatorAction::Send { msg: ReplicatorMsg::Digests { buckets, digests }, .. } => {
                    Some((buckets.clone(), digests.clone()))
                }
                _ => None,
            })
            .expect("a Digests reply");
        let listed: Vec<usize> = buckets.iter().map(|b| usize::from(*b)).collect();
        let expected: Vec<usize> = keys_of.keys().copied().take(listed.len()).collect();
        assert_eq!(listed, expected, "budget {budget}: buckets in order, none skipped");
        assert!(!listed.is_empty(), "budget {budget}: at least the first bucket");
        let mut expected_keys: Vec<String> = listed.iter().flat_map(|b| keys_of[b].clone()).collect();
        let mut got: Vec<String> = digests.iter().map(|(k, _)| k.clone()).collect();
        expected_keys.sort();
        got.sort();
        assert_eq!(got, expected_keys, "budget {budget}: every key of each listed bucket, nothing else");
        for (k, d) in &digests {
            assert_eq!(*d, a.data[k].value.digest(), "budget {budget}: {k}'s own digest");
        }
        let used: usize = listed.iter().map(size_of).sum();
        assert!(used <= budget || listed.len() == 1, "budget {budget}: {used} bytes listed");
        if let Some(next) = keys_of.keys().nth(listed.len()) {
            assert!(used + size_of(next) > budget, "budget {budget}: the next bucket would have fit ({used} bytes)");
        }
    }
}

/// Keys and values a `Gossip` carries.
type GossipEntries = Vec<(String, ReplicatedData)>;

/// The `Gossip` a core sent: its entries and the keys it wants.
fn gossip_sent(out: &[ReplicatorAction<u32>]) -> Option<(GossipEntries, Vec<String>)> {
    out.iter().find_map(|x| match x {
        ReplicatorAction::Send { msg: ReplicatorMsg::Gossip { entries, want, .. }, .. } => {
            Some((entries.clone(), want.clone()))
        }
        _ => None,
    })
}

/// Checks that `entries` are a greedy fill of `candidates` (in order) under `budget`: at least
/// one, within the budget unless only one, each an exact copy of `core`'s value, and every
/// candidate left out would have taken the message past the budget.
fn assert_greedy_fill(
    core: &ReplicatorCore<u32>,
    candidates: &[String],
    entries: &[(String, ReplicatedData)],
    budget: usize,
) {
    let size = |k: &str| k.len() + core.data[k].value.approx_bytes();
    assert!(!entries.is_empty(), "budget {budget}: at least one value");
    let sent: Vec<&String> = entries.iter().map(|(k, _)| k).collect();
    let in_order: Vec<&String> = candidates.iter().filter(|k| sent.contains(k)).collect();
    assert_eq!(sent, in_order, "budget {budget}: candidates in order, none twice");
    for (k, v) in entries {
        assert_eq!(v, &core.data[k].value, "budget {budget}: {k} as stored");
    }
    let used: usize = sent.iter().map(|k| size(k)).sum();
    assert!(used <= budget || entries.len() == 1, "budget {budget}: {used} bytes sent");
    for k in candidates.iter().filter(|k| !sent.contains(k)) {
        assert!(used + size(k) > budget, "budget {budget}: {k} would have fit ({used} bytes sent)");
    }
}

/// Message budgets around the edges of a greedy fill of `candidates`: below, at and above the
/// first value's size, at and below the first two's, and roomy ones.
fn budget_edges(core: &ReplicatorCore<u32>, candidates: &[String]) -> [usize; 8] {
    let size = |k: &str| k.len() + core.data[k].value.approx_bytes();
    let first = size(&candidates[0]);
    let two = first + size(&candidates[1]);
    [1, first, first + 1, two - 1, two, 700, 5_000, 1 << 20]
}

/// A replica holding `key-0000` … `key-0119`, and its keys in order.
fn replica_with_120_keys() -> (ReplicatorCore<u32>, Vec<String>) {
    let mut a = core("a");
    for i in 0..120 {
        local(&mut a, &format!("key-{i:04}"), add("x"));
    }
    let keys = a.data.keys().cloned().collect();
    (a, keys)
}

/// A `Gossip` answer to `Digests` carries the values that differ while they fit
/// `max_message_bytes` (key length + the value's size), always at least one; it wants every key
/// the peer listed that this replica lacks and every key changed on both sides, up to 1,024.
#[test]
fn a_gossip_answer_to_digests_carries_values_within_the_message_budget_and_wants_what_it_lacks() {
    let (mut a, mine) = replica_with_120_keys();
    let changed = "key-0007".to_string();
    let all_buckets: Vec<u16> = (0..KEY_BUCKETS as u16).collect();
    let mut digests: Vec<(String, u64)> = vec![(changed.clone(), a.data[&changed].value.digest() ^ 1)];
    digests.extend((0..3).map(|i| (format!("only-b-{i}"), 5)));
    // The keys b lists as equal are not sent.
    digests.push(("key-0001".into(), a.data["key-0001"].value.digest()));
    let candidates: Vec<String> = mine.iter().filter(|k| *k != "key-0001").cloned().collect();
    for budget in budget_edges(&a, &candidates) {
        a.settings.max_message_bytes = budget;
        let mut out = Vec::new();
        let msg = ReplicatorMsg::Digests { buckets: all_buckets.clone(), digests: digests.clone() };
        a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
        let (entries, mut want) = gossip_sent(&out).expect("a Gossip answer");
        assert_greedy_fill(&a, &candidates, &entries, budget);
        want.sort();
        assert_eq!(want, [changed.clone(), "only-b-0".into(), "only-b-1".into(), "only-b-2".into()], "budget {budget}");
    }
    // More unknown keys than a message may want: the first 1,024 are wanted.
    let many: Vec<(String, u64)> = (0..1_100).map(|i| (format!("zz-{i:05}"), 1)).collect();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::Digests { buckets: all_buckets, digests: many };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
    let (_, want) = gossip_sent(&out).expect("a Gossip answer");
    assert_eq!(want.len(), 1_024);
}

/// Values a peer wants go back while they fit `max_message_bytes`, always at least one, each
/// key once whatever the peer repeats; more than 1,024 wanted keys are cut and counted.
#[test]
fn values_a_peer_wants_go_back_within_the_message_budget_once_each_and_capped() {
    let (mut a, mine) = replica_with_120_keys();
    let mut want: Vec<String> = mine.iter().rev().cloned().collect();
    want.extend(mine.iter().take(5).cloned()); // repeated
    want.push("unknown".into());
    for budget in budget_edges(&a, &mine) {
        a.settings.max_message_bytes = budget;
        let mut out = Vec::new();
        let msg = ReplicatorMsg::Gossip {
            entries: Vec::new(),
            want: want.clone(),
            want_buckets: Vec::new(),
            value_buckets: Vec::new(),
        };
        a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
        let (entries, _) = gossip_sent(&out).expect("the wanted values");
        // Wanted keys are answered in key order.
        assert_greedy_fill(&a, &mine, &entries, budget);
    }
    let rejected = a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed);
    let too_many: Vec<String> = (0..1_100).map(|i| format!("zz-{i:05}")).collect();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::Gossip {
        entries: Vec::new(),
        want: too_many,
        want_buckets: Vec::new(),
        value_buckets: Vec::new(),
    };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
    assert_eq!(a.stats.rejected.load(std::sync::atomic::Ordering::Relaxed), rejected + 1, "the cut is counted");
}

/// Sets a G-set of `members` members `m0000`, `m0001`, … (whatever was there before).
fn gset_of(members: usize) -> Modify {
    Box::new(move |_cur, _ctx| {
        let mut s = GSet::default();
        for i in 0..members {
            s.insert(format!("m{i:04}"));
        }
        Ok(Some(s.into_data()))
    })
}

/// A value that differs goes whole while it has at most `BUCKETED_VALUE_ELEMENTS` elements,
/// and as its bucket digests (to exchange only the differing buckets) once it has more.
#[test]
fn a_differing_value_goes_whole_up_to_the_bucketed_size_and_by_buckets_above_it() {
    use crate::ddata::replicator::gossip::BUCKETED_VALUE_ELEMENTS;
    for (members, by_buckets) in [(BUCKETED_VALUE_ELEMENTS, false), (BUCKETED_VALUE_ELEMENTS + 1, true)] {
        let mut a = core("a");
        local(&mut a, "big", gset_of(members));
        assert_eq!(a.data["big"].value.element_count(), members);
        let digests = vec![("big".to_string(), a.data["big"].value.digest() ^ 1)];
        let buckets: Vec<u16> = (0..KEY_BUCKETS as u16).collect();
        let mut out = Vec::new();
        a.handle(
            ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::Digests { buckets, digests } },
            Instant::now(),
            0,
            &mut out,
        );
        let (entries, value_buckets) = out
            .iter()
            .find_map(|x| match x {
                ReplicatorAction::Send { msg: ReplicatorMsg::Gossip { entries, value_buckets, .. }, .. } => {
                    Some((entries.clone(), value_buckets.clone()))
                }
                _ => None,
            })
            .expect("a Gossip answer");
        let sent_whole = entries.iter().any(|(k, _)| k == "big");
        let sent_buckets = value_buckets.iter().any(|(k, _)| k == "big");
        assert_eq!((sent_whole, sent_buckets), (!by_buckets, by_buckets), "{members} members");
    }
}

/// A large differing value's bucket digests (key length + 9 bytes per bucket) count against
/// the message budget of the whole values sent after it.
#[test]
fn bucket_digests_of_a_large_value_take_their_bytes_from_the_message_budget() {
    use crate::ddata::replicator::gossip::BUCKETED_VALUE_ELEMENTS;
    let mut a = core("a");
    local(&mut a, "a-big", gset_of(BUCKETED_VALUE_ELEMENTS + 1));
    local(&mut a, "b-small", add("x"));
    local(&mut a, "c-small", add("y"));
    let big_bytes = "a-big".len() + a.data["a-big"].value.bucket_digests().expect("a large value").len() * 9;
    let size = |k: &str| k.len() + a.data[k].value.approx_bytes();
    let both_small = size("b-small") + size("c-small");
    let digests: Vec<(String, u64)> =
        ["a-big", "b-small", "c-small"].iter().map(|k| (k.to_string(), a.data[*k].value.digest() ^ 1)).collect();
    let all_buckets: Vec<u16> = (0..KEY_BUCKETS as u16).collect();
    for (budget, second_small_fits) in [(big_bytes + both_small, true), (big_bytes + both_small - 1, false)] {
        a.settings.max_message_bytes = budget;
        let mut out = Vec::new();
        let msg = ReplicatorMsg::Digests { buckets: all_buckets.clone(), digests: digests.clone() };
        a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
        let (entries, _) = gossip_sent(&out).expect("a Gossip answer");
        let sent: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
        let expected: &[&str] = if second_small_fits { &["b-small", "c-small"] } else { &["b-small"] };
        assert_eq!(sent, expected, "budget {budget} ({big_bytes} of it for a-big's bucket digests)");
    }
}

/// Keys changed on both sides are wanted back too, up to the same 1,024 per message.
#[test]
fn keys_changed_on_both_sides_are_wanted_back_at_most_1024_per_message() {
    let mut a = core("a");
    for i in 0..1_100 {
        local(&mut a, &format!("k{i:05}"), add("x"));
    }
    let digests: Vec<(String, u64)> = a.data.iter().map(|(k, e)| (k.clone(), e.value.digest() ^ 1)).collect();
    let mut out = Vec::new();
    let msg = ReplicatorMsg::Digests { buckets: (0..KEY_BUCKETS as u16).collect(), digests };
    a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
    let (_, want) = gossip_sent(&out).expect("a Gossip answer");
    assert_eq!(want.len(), 1_024);
}

/// The parts of a large value answered by buckets (asked for with `want_buckets`, or sent
/// back for differing `value_buckets`) count key length + their size against the budget.
#[test]
fn bucket_parts_of_a_large_value_count_their_size_against_the_message_budget() {
    use crate::ddata::replicator::gossip::BUCKETED_VALUE_ELEMENTS;
    let mut a = core("a");
    local(&mut a, "big", gset_of(BUCKETED_VALUE_ELEMENTS + 1));
    local(&mut a, "small", add("x"));
    let small = "small".len() + a.data["small"].value.approx_bytes();
    let asked: Vec<usize> = vec![0, 1, 2];
    let part = "big".len() + a.data["big"].value.buckets_subset(&asked).approx_bytes();
    let digests = a.data["big"].value.bucket_digests().expect("a large value").to_vec();
    // Their digests differ in buckets 0, 1 and 2 only: those come back as one part.
    let theirs: Vec<u64> = digests.iter().enumerate().map(|(b, d)| if b < 3 { d ^ 1 } else { *d }).collect();
    let asks =
        [(vec![("big".to_string(), vec![0u16, 1, 2])], Vec::new()), (Vec::new(), vec![("big".to_string(), theirs)])];
    for (want_buckets, value_buckets) in asks {
        for (budget, part_fits) in [(small + part, true), (small + part - 1, false)] {
            a.settings.max_message_bytes = budget;
            let mut out = Vec::new();
            let msg = ReplicatorMsg::Gossip {
                entries: Vec::new(),
                want: vec!["small".into()],
                want_buckets: want_buckets.clone(),
                value_buckets: value_buckets.clone(),
            };
            a.handle(ReplicatorInput::Remote { from: peer("b"), msg }, Instant::now(), 0, &mut out);
            let (entries, _) = gossip_sent(&out).expect("an answer");
            let sent: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
            let expected: &[&str] = if part_fits { &["small", "big"] } else { &["small"] };
            assert_eq!(sent, expected, "budget {budget}, want_buckets {}", !want_buckets.is_empty());
        }
    }
}
