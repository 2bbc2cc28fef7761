//! The durable queue's decisions: stores before sends, writes tried again, deletions and their
//! retries, lanes and places, evictions, and streams resumed from a load.

use super::*;
use std::collections::BTreeMap;

use crate::sharding::delivery::ConsumerMarks;
use crate::sharding::producer::queue::{Restored, RestoredStream};

/// The rig's linger: how long an idle stream keeps its confirmed messages' entries.
const LINGER: Duration = Duration::from_millis(1000);

fn rig() -> Rig {
    let limits = ProducerLimits { durable: true, ..limits() };
    Rig { core: ProducerCore::new("p".into(), limits, 1000, 7 << 16), now: Instant::now(), waiters: 0 }
}

fn persisted(r: &mut Rig, entity: &str, seq: u64, result: PersistResult) -> Vec<ProducerAction> {
    persisted_of(r, entity, S, seq, result)
}

fn persisted_of(r: &mut Rig, entity: &str, stream: u64, seq: u64, result: PersistResult) -> Vec<ProducerAction> {
    r.run(ProducerInput::Persisted { entity: entity.into(), stream, seq, result })
}

fn persists(out: &[ProducerAction]) -> Vec<(String, u64)> {
    out.iter()
        .filter_map(|a| match a {
            ProducerAction::Persist { key, entry } => Some((key.clone(), entry.seq)),
            _ => None,
        })
        .collect()
}

fn unpersists(out: &[ProducerAction]) -> Vec<String> {
    out.iter()
        .filter_map(|a| match a {
            ProducerAction::Unpersist { key, .. } => Some(key.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_message_is_stored_and_sent_only_once_its_write_is_acknowledged() {
    let mut r = rig();
    let out = r.offer("e", "a");
    assert_eq!(out[0], ProducerAction::Storing { stream: S, seq: 1 });
    assert_eq!(persists(&out), vec![("0.0".to_string(), 1)], "lane 0, its first place");
    assert!(sends(&out).is_empty(), "not sent before it is stored");
    match &out[1] {
        ProducerAction::Persist { entry, .. } => {
            assert_eq!((entry.entity.as_str(), entry.stream, entry.made, entry.modulus), ("e", S, (7 << 16, 1), 3));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.core.counts().stored, 0);
    let out = persisted(&mut r, "e", 1, PersistResult::Stored);
    assert_eq!(out[0], ProducerAction::Stored { stream: S, seq: 1 });
    assert_eq!(sends(&out), vec![(1, 1, 1, false)]);
    assert_eq!(r.core.counts().stored, 1);
}

#[test]
fn what_follows_an_unstored_message_waits_for_it_so_the_order_holds() {
    let mut r = rig();
    r.offer("e", "a");
    persisted(&mut r, "e", 1, PersistResult::Stored);
    r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    r.offer("e", "b");
    r.offer("e", "c");
    assert!(sends(&persisted(&mut r, "e", 3, PersistResult::Stored)).is_empty(), "3 waits for 2");
    let out = persisted(&mut r, "e", 2, PersistResult::Stored);
    assert_eq!(sends(&out), vec![(2, 2, 1, false), (3, 2, 1, false)]);
}

#[test]
fn a_write_not_acknowledged_is_tried_again_after_the_backoff() {
    let mut r = rig();
    r.offer("e", "a");
    assert!(persisted(&mut r, "e", 1, PersistResult::Retry("timeout".into())).is_empty());
    assert!(persists(&r.later(Duration::from_millis(99))).is_empty());
    assert_eq!(persists(&r.later(Duration::from_millis(1))), vec![("0.0".to_string(), 1)]);
}

#[test]
fn a_write_tried_again_is_its_own_message_at_its_own_place_and_none_once_it_is_stored() {
    let mut r = rig();
    r.offer("e", "a"); // 1, place 0: its write still on its way
    r.offer("e", "b"); // 2, place 1
    r.offer("e", "c"); // 3, place 2
    persisted(&mut r, "e", 2, PersistResult::Retry("timeout".into()));
    persisted(&mut r, "e", 3, PersistResult::Retry("timeout".into()));
    // 3's write lands after all (a late acknowledgement of an earlier try).
    persisted(&mut r, "e", 3, PersistResult::Stored);
    let out = r.later(Duration::from_millis(100));
    assert_eq!(persists(&out), vec![("0.1".to_string(), 2)], "2 again, not 1 nor 3");
    assert_eq!(entry_of(&out).bytes, b"b".to_vec());
}

#[test]
fn a_refused_write_fails_its_send_and_the_stream_goes_on_past_its_number() {
    let mut r = rig();
    r.offer("e", "a");
    r.offer("e", "b");
    r.offer("e", "c");
    assert_eq!(r.offer("e", "d"), vec![ProducerAction::Wait], "the window is full");
    let out = persisted(&mut r, "e", 2, PersistResult::Refused("slot full".into()));
    assert!(out.contains(&ProducerAction::StoreFailed { stream: S, seq: 2, reason: "slot full".into() }));
    assert!(
        out.iter().any(|a| matches!(a, ProducerAction::Wake { waiter: 4, .. })),
        "2's place, never written, is free again: room for the waiter {out:?}"
    );
    assert_eq!(r.core.unconfirmed(), 2);
    persisted(&mut r, "e", 1, PersistResult::Stored);
    persisted(&mut r, "e", 3, PersistResult::Stored);
    r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    let out = r.answer("e", S, 2, 1, confirmed(true));
    assert!(unpersists(&out).is_empty(), "a confirmed message's entry stays for the next message at its place");
    // 3 goes with the header saying 3 is the first unconfirmed: its entity skips 2.
    let out = r.offer("e", "d");
    assert_eq!(persists(&out), vec![("0.0".to_string(), 4)], "4 takes the lowest free place: 1's, freed");
    assert_eq!(persists(&r.offer("e", "e")), vec![("0.1".to_string(), 5)], "then 2's");
    assert_eq!(r.offer("e", "f"), vec![ProducerAction::Wait], "3 places, 3 unconfirmed: no room");
}

fn entry_of(out: &[ProducerAction]) -> &QueueEntry {
    out.iter()
        .find_map(|a| match a {
            ProducerAction::Persist { entry, .. } => Some(entry),
            _ => None,
        })
        .expect("a write")
}

/// Stores messages 1..=n of `e` at once (at places 0..n), introduces the stream, and has
/// its entity confirm them all.
fn store_and_confirm(r: &mut Rig, n: u64) -> Vec<ProducerAction> {
    let mut out = Vec::new();
    for _ in 1..=n {
        r.offer("e", "m");
    }
    for seq in 1..=n {
        out.extend(persisted(r, "e", seq, PersistResult::Stored));
    }
    r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    out.extend(r.answer("e", S, 2, n, confirmed(true)));
    out
}

#[test]
fn a_message_takes_the_place_its_predecessor_freed_so_a_lane_keeps_as_few_keys_as_it_held_at_once() {
    let mut r = rig();
    let mut keys = std::collections::BTreeSet::new();
    for seq in 1..=20 {
        let out = r.offer("e", "m");
        keys.extend(persists(&out).into_iter().map(|(key, _)| key));
        persisted(&mut r, "e", seq, PersistResult::Stored);
        if seq == 1 {
            r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
        }
        let out = r.answer("e", S, 2, seq, confirmed(true));
        keys.extend(unpersists(&out));
    }
    assert_eq!(keys.into_iter().collect::<Vec<_>>(), vec!["0.0".to_string()], "one at a time: one key");
}

#[test]
fn each_entry_says_which_numbers_before_it_are_confirmed() {
    let mut r = rig();
    assert_eq!(entry_of(&r.offer("e", "a")).first_unconfirmed, 1, "its own number when nothing is older");
    assert_eq!(entry_of(&r.offer("e", "b")).first_unconfirmed, 1, "1 is not confirmed yet");
    persisted(&mut r, "e", 1, PersistResult::Stored);
    persisted(&mut r, "e", 2, PersistResult::Stored);
    r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    r.answer("e", S, 2, 1, confirmed(true));
    assert_eq!(entry_of(&r.offer("e", "c")).first_unconfirmed, 2);
}

#[test]
fn the_next_message_at_a_confirmed_messages_place_replaces_its_entry_so_no_deletion_is_written() {
    let mut r = rig();
    for seq in 1..=20 {
        let out = r.offer("e", "m");
        assert_eq!(persists(&out), vec![("0.0".to_string(), seq)]);
        persisted(&mut r, "e", seq, PersistResult::Stored);
        if seq == 1 {
            r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
        }
        assert!(unpersists(&r.answer("e", S, 2, seq, confirmed(true))).is_empty(), "{seq}");
        assert!(unpersists(&r.later(LINGER / 2)).is_empty(), "{seq}: the stream idles for less than the linger");
    }
    assert_eq!(unpersists(&r.later(LINGER / 2)), vec!["0.0".to_string()], "the last one's, after the linger");
    unpersisted(&mut r, "e", 20, PersistResult::Stored);
    assert!(unpersists(&r.later(LINGER * 5)).is_empty(), "deleted: nothing more");
}

#[test]
fn a_confirmed_messages_entry_is_deleted_once_its_stream_idled_for_the_linger_and_a_failed_deletion_again() {
    let mut r = rig();
    let out = store_and_confirm(&mut r, 2);
    assert!(unpersists(&out).is_empty(), "kept for the stream's next messages");
    assert!(unpersists(&r.later(LINGER - Duration::from_millis(1))).is_empty());
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string(), "0.1".to_string()]);
    assert!(unpersisted(&mut r, "e", 1, PersistResult::Retry("timeout".into())).is_empty());
    unpersisted(&mut r, "e", 2, PersistResult::Stored);
    assert!(unpersists(&r.later(Duration::from_millis(99))).is_empty(), "after the backoff");
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string()]);
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    assert!(unpersists(&r.later(Duration::from_secs(5))).is_empty(), "deleted: nothing more");
}

#[test]
fn a_failed_deletion_waits_while_its_stream_is_busy_and_a_later_message_at_its_place_ends_it() {
    let mut r = rig();
    store_and_confirm(&mut r, 3); // places 0, 1, 2 of lane 0
    r.later(LINGER); // their deletions on their way
    unpersisted(&mut r, "e", 1, PersistResult::Retry("timeout".into()));
    // Message 4 takes place 0 (message 1's) and stays unconfirmed past the retry's time.
    assert_eq!(persists(&r.offer("e", "d")), vec![("0.0".to_string(), 4)]);
    assert!(unpersists(&r.later(Duration::from_millis(200))).is_empty(), "no deletion while 4 is on its way");
    persisted(&mut r, "e", 4, PersistResult::Stored);
    let out = r.answer("e", S, 2, 4, confirmed(true));
    assert!(unpersists(&out).is_empty(), "4's entry stays for the next message at its place");
    assert_eq!(
        unpersists(&r.later(LINGER)),
        vec!["0.0".to_string()],
        "4's, idle for the linger: 1's was replaced by it"
    );
    unpersisted(&mut r, "e", 4, PersistResult::Stored);
    assert!(unpersists(&r.later(LINGER * 5)).is_empty());
}

#[test]
fn a_failed_deletion_is_tried_again_a_backoff_later_at_a_place_no_message_holds_busy_or_not() {
    let mut r = rig();
    store_and_confirm(&mut r, 2); // places 0 and 1
    r.later(LINGER); // their deletions on their way
    r.offer("e", "c"); // 3, at place 0 (1's): busy
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    unpersisted(&mut r, "e", 2, PersistResult::Retry("timeout".into()));
    assert!(unpersists(&r.later(Duration::from_millis(99))).is_empty(), "a backoff after it failed");
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.1".to_string()], "while 3 is unconfirmed");
    persisted(&mut r, "e", 3, PersistResult::Stored);
    let out = r.answer("e", S, 2, 3, confirmed(true));
    assert!(unpersists(&out).is_empty(), "3's entry stays for now");
    assert!(unpersists(&r.later(LINGER - Duration::from_millis(1))).is_empty(), "the linger after 3 was confirmed");
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string()], "3's, and not 2's again");
}

#[test]
fn after_deleting_what_is_due_a_stream_flushes_next_when_its_next_entry_will_have_lingered() {
    let mut r = rig();
    r.offer("e", "a");
    r.offer("e", "b"); // places 0 and 1
    persisted(&mut r, "e", 1, PersistResult::Stored);
    persisted(&mut r, "e", 2, PersistResult::Stored);
    r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    let t0 = r.now;
    r.answer("e", S, 2, 1, confirmed(true));
    assert_eq!(r.core.flushes_due(), vec![t0 + LINGER]);
    r.now += Duration::from_millis(600);
    r.answer("e", S, 2, 2, confirmed(true));
    assert_eq!(r.core.flushes_due(), vec![t0 + LINGER], "the sooner one stays");
    let out = r.later(Duration::from_millis(400));
    assert_eq!(unpersists(&out), vec!["0.0".to_string()], "1's has lingered its second, 2's not yet");
    assert_eq!(r.core.flushes_due(), vec![t0 + Duration::from_millis(600) + LINGER], "when 2's will have");
}

#[test]
fn a_busy_streams_entries_at_places_its_messages_no_longer_reach_are_deleted_after_the_linger() {
    let mut r = rig();
    store_and_confirm(&mut r, 3); // a burst: places 0, 1, 2
    for seq in 4..=8 {
        // Then one message at a time, always at place 0, each confirmed well within the linger.
        assert_eq!(persists(&r.offer("e", "m")), vec![("0.0".to_string(), seq)]);
        persisted(&mut r, "e", seq, PersistResult::Stored);
        let out = r.later(LINGER / 4);
        let deleted = unpersists(&out);
        if seq < 7 {
            assert!(deleted.is_empty(), "{seq}: {deleted:?}");
        } else if seq == 7 {
            assert_eq!(deleted, vec!["0.1".to_string(), "0.2".to_string()], "lingered a second, never reached");
        }
        assert!(!deleted.contains(&"0.0".to_string()), "{seq}: place 0 is held, or taken again at once");
        r.answer("e", S, 2, seq, confirmed(true));
    }
}

#[test]
fn a_deletion_that_failed_on_an_idle_stream_is_tried_again_a_backoff_after_the_failure() {
    let mut r = rig();
    store_and_confirm(&mut r, 1);
    r.later(LINGER); // idle, 1's deletion on its way
    r.later(Duration::from_millis(50));
    unpersisted(&mut r, "e", 1, PersistResult::Retry("timeout".into()));
    // The retry is a backoff after the failure, not after the stream idled.
    assert!(unpersists(&r.later(Duration::from_millis(99))).is_empty());
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string()]);
}

#[test]
fn a_retry_once_scheduled_is_not_put_off_by_a_later_deletion_ending() {
    let mut r = rig();
    store_and_confirm(&mut r, 2);
    r.later(LINGER); // idle, deletions of 1 and 2 on their way
    unpersisted(&mut r, "e", 1, PersistResult::Retry("timeout".into())); // retry at +100 ms
    r.now += Duration::from_millis(50);
    unpersisted(&mut r, "e", 2, PersistResult::Stored);
    assert!(unpersists(&r.later(Duration::from_millis(49))).is_empty());
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string()], "at +100 ms, not later");
}

#[test]
fn a_stream_taken_back_from_eviction_retries_its_failed_deletions_when_it_idles_again() {
    let mut r = rig();
    store_and_confirm(&mut r, 2);
    r.offer("f", "x");
    r.offer("g", "x"); // e evicted
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    unpersisted(&mut r, "e", 2, PersistResult::Retry("timeout".into())); // a retry due at +100 ms
    persisted_of(&mut r, "g", S + 2, 1, PersistResult::Stored);
    r.answer("g", S + 2, 1, 1, confirmed(true));
    r.offer("e", "again"); // taken back: 3, at place 0 (1's; 2's at 1 is still to delete)
    persisted(&mut r, "e", 3, PersistResult::Stored);
    r.now += Duration::from_millis(10);
    r.answer("e", S, 2, 3, confirmed(true)); // idle again, before the old retry's time
    assert!(unpersists(&r.later(Duration::from_millis(99))).is_empty(), "the old retry is void");
    assert!(unpersists(&r.later(LINGER - Duration::from_millis(100))).is_empty(), "a linger after it idled");
    let out = r.later(Duration::from_millis(1));
    assert_eq!(unpersists(&out), vec!["0.1".to_string(), "0.0".to_string()], "2 is tried again, and 3's goes");
}

fn unpersisted(r: &mut Rig, entity: &str, seq: u64, result: PersistResult) -> Vec<ProducerAction> {
    r.run(ProducerInput::Unpersisted { of: Some((entity.into(), S, seq)), result })
}

#[test]
fn a_stopping_producer_deletes_the_entries_its_confirmed_messages_left_at_places_no_unconfirmed_one_holds() {
    let mut r = rig();
    store_and_confirm(&mut r, 3); // places 0, 1, 2, their entries kept
    assert_eq!(persists(&r.offer("e", "d")), vec![("0.0".to_string(), 4)], "4 takes place 0, unconfirmed");
    let out = r.run(ProducerInput::Closing);
    assert_eq!(unpersists(&out), vec!["0.1".to_string(), "0.2".to_string()], "4's own write replaces 1's");
    assert!(unpersists(&r.run(ProducerInput::Closing)).is_empty(), "each deletion asked for once");
    assert!(unpersists(&r.later(LINGER * 5)).is_empty(), "4 is unconfirmed: nothing is due");
}

/// The lane of the first write among `out`.
fn lane_written(out: &[ProducerAction]) -> String {
    persists(out)[0].0.split('.').next().unwrap().to_string()
}

#[test]
fn an_evicted_streams_lane_is_given_out_only_once_a_majority_acknowledged_its_deletions() {
    let mut r = rig();
    store_and_confirm(&mut r, 2);
    r.offer("f", "x"); // lane 1
    let out = r.offer("g", "x"); // two entities is the limit: e's idle stream goes
    assert_eq!(unpersists(&out), vec!["0.0".to_string(), "0.1".to_string()], "its entries deleted at once");
    assert_eq!(lane_written(&out), "2", "lane 0 is not free while e's entries are being deleted");
    assert_eq!(r.core.evicted(), 1);
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    assert_eq!(r.core.evicted(), 1, "one entry is still there");
    unpersisted(&mut r, "e", 2, PersistResult::Stored);
    assert_eq!(r.core.evicted(), 0, "let go");
    // f's stream idles and goes for h, which takes lane 0, now free.
    persisted_of(&mut r, "f", S + 1, 1, PersistResult::Stored);
    r.answer("f", S + 1, 1, 1, confirmed(true));
    assert_eq!(lane_written(&r.offer("h", "x")), "0");
}

#[test]
fn an_evicted_streams_failed_deletion_is_tried_again_until_acknowledged() {
    let mut r = rig();
    store_and_confirm(&mut r, 1);
    r.offer("f", "x");
    r.offer("g", "x");
    assert!(unpersisted(&mut r, "e", 1, PersistResult::Retry("timeout".into())).is_empty());
    assert!(unpersists(&r.later(Duration::from_millis(99))).is_empty(), "after the backoff");
    assert_eq!(unpersists(&r.later(Duration::from_millis(1))), vec!["0.0".to_string()]);
    assert_eq!(r.core.evicted(), 1);
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    assert_eq!(r.core.evicted(), 0);
}

#[test]
fn an_offer_to_an_evicted_entity_takes_its_stream_back_instead_of_starting_a_new_one() {
    let mut r = rig();
    store_and_confirm(&mut r, 2);
    r.offer("f", "x");
    r.offer("g", "x"); // e evicted, its deletions on their way
    persisted_of(&mut r, "g", S + 2, 1, PersistResult::Stored);
    r.answer("g", S + 2, 1, 1, confirmed(true)); // g idles: room for e
    let out = r.offer("e", "again");
    let e = entry_of(&out);
    assert_eq!((e.entity.as_str(), e.stream, e.seq), ("e", S, 3), "the same stream goes on at 3");
    assert_eq!(persists(&out), vec![("0.0".to_string(), 3)], "in its own lane");
    assert_eq!(r.core.evicted(), 1, "g's stream went for it, e's is back");
    // Deletions ending now are of places the stream still holds: nothing is let go.
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    unpersisted(&mut r, "e", 2, PersistResult::Stored);
    assert_eq!(r.core.evicted(), 1);
    r.run(ProducerInput::Unpersisted { of: Some(("g".into(), S + 2, 1)), result: PersistResult::Stored });
    assert_eq!(r.core.evicted(), 0);
}

#[test]
fn new_entities_wait_while_as_many_evicted_streams_as_the_entity_limit_are_being_deleted() {
    let mut r = rig();
    let entity_done = |r: &mut Rig, entity: &str, stream: u64| {
        r.offer(entity, "m");
        persisted_of(r, entity, stream, 1, PersistResult::Stored);
        r.answer(entity, stream, 1, 1, confirmed(true));
    };
    entity_done(&mut r, "a", S);
    entity_done(&mut r, "b", S + 1);
    entity_done(&mut r, "c", S + 2); // a evicted
    entity_done(&mut r, "d", S + 3); // b evicted: two being deleted
    assert_eq!(r.core.evicted(), 2);
    assert_eq!(r.offer("e", "m"), vec![ProducerAction::Wait]);
    let out = r.run(ProducerInput::Unpersisted { of: Some(("a".into(), S, 1)), result: PersistResult::Stored });
    assert!(out.iter().any(|a| matches!(a, ProducerAction::Wake { entity: None, .. })), "{out:?}");
}

#[test]
fn a_newer_incarnations_claim_stops_this_one() {
    let mut r = rig();
    r.offer("e", "a");
    assert_eq!(
        persisted(&mut r, "e", 1, PersistResult::Fenced { fence: 9 << 16 }),
        vec![ProducerAction::Fenced { fence: 9 << 16 }]
    );
}

#[test]
fn restored_streams_resume_as_sent_before_and_new_streams_take_free_lanes() {
    let mut r = rig();
    let limits = ProducerLimits { durable: true, max_entities: 3, ..limits() };
    r.core = ProducerCore::new("p".into(), limits, 1000, 7 << 16);
    let restored = |entity: &str, stream, lane, seqs: &[u64]| RestoredStream {
        entity: entity.into(),
        stream,
        lane,
        modulus: 3,
        made: (1 << 16, 1),
        // At their places of the first layout (`seq % modulus`).
        messages: seqs.iter().map(|s| (*s, *s % 3, Bytes::from("m"))).collect(),
        confirmed: Vec::new(),
    };
    let streams = vec![restored("a", 50, 0, &[4, 5]), restored("b", 60, 2, &[1])];
    let out = r.run(ProducerInput::Restore(Restored { streams, ..Restored::default() }));
    let probes: Vec<_> = out
        .iter()
        .filter_map(|a| match a {
            ProducerAction::Send { entity, header, .. } => {
                Some((entity.clone(), header.stream, header.seq, header.redelivery))
            }
            _ => None,
        })
        .collect();
    assert_eq!(probes, vec![("a".to_string(), 50, 4, true), ("b".to_string(), 60, 1, true)]);
    assert_eq!((r.core.unconfirmed(), r.core.entities()), (3, 2));
    // `a`'s resumed stream takes no new message; a new entity takes lane 1, the free one.
    assert_eq!(r.offer("a", "x"), vec![ProducerAction::Wait]);
    let out = r.offer("c", "x");
    assert_eq!(persists(&out), vec![("1.0".to_string(), 1)], "from its lane's first place");
    assert_eq!(r.offer("d", "x"), vec![ProducerAction::Wait], "three entities is the limit: d waits");
}

#[test]
fn a_restored_streams_confirmed_entries_are_deleted_by_it_and_stale_ones_at_once() {
    let mut r = rig();
    let stream = resumed_of_a(0, Vec::new(), vec![(4, 1), (5, 2)]);
    let stale = vec!["1.0".to_string()];
    let out = r.run(ProducerInput::Restore(Restored { streams: vec![stream], stale, undecodable: 0 }));
    assert!(out.contains(&ProducerAction::Unpersist { key: "1.0".into(), of: None }), "{out:?}");
    let mut deleted = unpersists(&out);
    deleted.sort();
    assert_eq!(deleted, vec!["0.1".to_string(), "0.2".to_string(), "1.0".to_string()]);
    // Sent to again, it waits until the resumed stream is let go: then a new stream.
    assert_eq!(r.offer("a", "x"), vec![ProducerAction::Wait]);
    let deleted = |r: &mut Rig, seq| {
        r.run(ProducerInput::Unpersisted { of: Some(("a".into(), OLD, seq)), result: PersistResult::Stored })
    };
    assert!(deleted(&mut r, 4).is_empty(), "5's entry is still there");
    let out = deleted(&mut r, 5);
    assert_eq!(out, vec![ProducerAction::Wake { waiter: 1, entity: Some("a".into()) }]);
    let out = r.offer("a", "x");
    assert_eq!(persists(&out), vec![("0.0".to_string(), 1)], "a new stream, numbered from 1, in the lane let go");
    assert_eq!(out[0], ProducerAction::Storing { stream: S, seq: 1 }, "a stream of this incarnation");
}

#[test]
fn only_a_resumed_stream_with_nothing_unconfirmed_is_let_go_when_its_deletions_end() {
    let mut r = rig();
    // A stream of this incarnation, idle once its entry is deleted, goes on.
    store_and_confirm(&mut r, 1);
    unpersisted(&mut r, "e", 1, PersistResult::Stored);
    assert_eq!(r.offer("e", "m")[0], ProducerAction::Storing { stream: S, seq: 2 }, "the same stream");
    // A resumed one whose confirmed entry is deleted still sends what it loaded.
    let stream = resumed_of_a(1, vec![(2, 2, Bytes::from("m"))], vec![(1, 1)]);
    r.run(ProducerInput::Restore(Restored { streams: vec![stream], ..Restored::default() }));
    assert_eq!(r.offer("a", "x"), vec![ProducerAction::Wait]);
    let out = r.run(ProducerInput::Unpersisted { of: Some(("a".into(), OLD, 1)), result: PersistResult::Stored });
    assert!(out.is_empty(), "2 is unconfirmed: {out:?}");
    assert_eq!(r.core.unconfirmed(), 2, "e's 2 and a's 2");
}

/// `a`'s stream made by an earlier incarnation (`OLD`), as a load found it in `lane`.
fn resumed_of_a(lane: u32, messages: Vec<(u64, u64, Bytes)>, confirmed: Vec<(u64, u64)>) -> RestoredStream {
    RestoredStream { entity: "a".into(), stream: OLD, lane, modulus: 3, made: (1 << 16, 1), messages, confirmed }
}

/// A resumed stream cannot know the numbers the incarnation before had confirmed and
/// deleted; a new message in it could take one its entity handled. It takes none: offers
/// to its entity wait until it has nothing unconfirmed and every entry is deleted, then go
/// in a new stream, which the entity takes from its first message.
#[test]
fn a_resumed_stream_takes_no_new_message_and_its_entitys_offers_wait_for_a_new_stream() {
    let mut r = rig();
    let stream = resumed_of_a(0, vec![(2, 2, Bytes::from("m"))], Vec::new());
    r.run(ProducerInput::Restore(Restored { streams: vec![stream], ..Restored::default() }));
    assert_eq!(r.offer("a", "x"), vec![ProducerAction::Wait]);
    assert_eq!(r.offer("a", "y"), vec![ProducerAction::Wait]);
    assert_eq!(r.core.counts().demand_waits, 2);
    r.answer("a", OLD, 1, 2, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    let out = r.answer("a", OLD, 2, 2, confirmed(false));
    assert_eq!(unpersists(&out), vec!["0.2".to_string()], "2's entry is deleted");
    assert!(!out.iter().any(|a| matches!(a, ProducerAction::Wake { .. })), "not before the deletion is written");
    let deleted = |r: &mut Rig, result| r.run(ProducerInput::Unpersisted { of: Some(("a".into(), OLD, 2)), result });
    let out = deleted(&mut r, PersistResult::Retry("timeout".into()));
    assert!(out.is_empty(), "a failed deletion keeps it: {out:?}");
    assert_eq!(unpersists(&r.later(Duration::from_millis(100))), vec!["0.2".to_string()], "tried again");
    let out = deleted(&mut r, PersistResult::Stored);
    let woken: Vec<u64> = out
        .iter()
        .filter_map(|a| match a {
            ProducerAction::Wake { waiter, entity: Some(e) } if e == "a" => Some(*waiter),
            _ => None,
        })
        .collect();
    assert_eq!(woken, vec![1, 2], "both offers, oldest first");
    let out = r.offer("a", "x");
    assert_eq!(out[0], ProducerAction::Storing { stream: S, seq: 1 }, "a stream of this incarnation");
}

/// Delivers every send among `out` to an entity's `marks` and feeds each answer back to
/// `r`'s core (and what that sends, in turn), recording the bodies the entity handled.
/// Returns the other actions.
fn deliver(
    r: &mut Rig,
    marks: &mut ConsumerMarks,
    out: Vec<ProducerAction>,
    handled: &mut Vec<String>,
) -> Vec<ProducerAction> {
    let (mut pending, mut rest): (std::collections::VecDeque<ProducerAction>, _) = (out.into(), Vec::new());
    while let Some(action) = pending.pop_front() {
        let ProducerAction::Send { entity, header, round, bytes } = action else {
            rest.push(action);
            continue;
        };
        let outcome = match marks.admit(&header).answer(marks.nonce()) {
            Some(outcome) => outcome,
            None => {
                handled.push(String::from_utf8(bytes.to_vec()).unwrap());
                DeliveryOutcome::Confirmed { handled: true, nonce: marks.nonce() }
            }
        };
        let (stream, seq) = (header.stream, header.seq);
        pending.extend(r.answer(&entity, stream, round, seq, SendResult::Answered(outcome)));
    }
    rest
}

/// p's first incarnation had messages 1 to 3 of e's stream confirmed; the deletions of 2
/// and 3 were written, 1's failed, and p stopped before trying it again. The next
/// incarnation loads only 1's entry and resumes the stream from it: a message it then
/// stores must reach e as a new one, not take a number e handled already.
#[test]
fn a_stream_resumed_from_an_entry_whose_deletion_failed_numbers_new_messages_past_what_its_entity_handled() {
    let mut marks = ConsumerMarks::new(9);
    let mut handled = Vec::new();
    let mut first = rig();
    let mut stored = BTreeMap::new();
    for body in ["a", "b", "c"] {
        for action in first.offer("e", body) {
            if let ProducerAction::Persist { key, entry } = action {
                stored.insert(key, entry);
            }
        }
    }
    for seq in 1..=3 {
        let out = persisted(&mut first, "e", seq, PersistResult::Stored);
        deliver(&mut first, &mut marks, out, &mut handled);
    }
    assert_eq!(handled, ["a", "b", "c"]);
    // Deleted: 2 and 3; 1's deletion failed (its entry stays).
    stored.retain(|_, entry| entry.seq == 1);
    let entries =
        stored.into_iter().map(|(key, entry)| (key, crate::transport::wire::encode(&entry).unwrap().to_vec()));
    let restored = crate::sharding::producer::queue::restore(entries.collect());
    let mut next = Rig {
        core: ProducerCore::new("p".into(), ProducerLimits { durable: true, ..limits() }, 5000, 8 << 16),
        now: first.now,
        waiters: 0,
    };
    let out = next.run(ProducerInput::Restore(restored));
    assert_eq!(next.offer("e", "d"), vec![ProducerAction::Wait], "not in the resumed stream");
    let mut deletions = Vec::new();
    for action in deliver(&mut next, &mut marks, out, &mut handled) {
        if let ProducerAction::Unpersist { of: Some((_, stream, seq)), .. } = action {
            deletions.push((stream, seq));
        }
    }
    assert_eq!(handled, ["a", "b", "c"], "1 again is a duplicate");
    assert_eq!(deletions.len(), 1, "1's entry");
    let (stream, seq) = deletions[0];
    let of = Some(("e".to_string(), stream, seq));
    let out = next.run(ProducerInput::Unpersisted { of, result: PersistResult::Stored });
    assert!(matches!(out[..], [ProducerAction::Wake { waiter: 1, .. }]), "{out:?}");
    let out = next.offer("e", "d");
    let Some((stream, seq)) = out.iter().find_map(|a| match a {
        ProducerAction::Storing { stream, seq } => Some((*stream, *seq)),
        _ => None,
    }) else {
        panic!("stored: {out:?}")
    };
    let out = persisted_of(&mut next, "e", stream, seq, PersistResult::Stored);
    deliver(&mut next, &mut marks, out, &mut handled);
    assert_eq!(handled, ["a", "b", "c", "d"], "d handled once, as new");
    assert_eq!(next.core.unconfirmed(), 0);
}

#[test]
fn a_deletion_refused_by_a_newer_claim_stops_this_incarnation() {
    let mut r = rig();
    let fenced = PersistResult::Fenced { fence: 9 << 16 };
    let out = r.run(ProducerInput::Unpersisted { of: None, result: fenced });
    assert_eq!(out, vec![ProducerAction::Fenced { fence: 9 << 16 }]);
}
