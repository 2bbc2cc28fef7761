use std::time::Duration;

use bytes::Bytes;

use super::*;

fn limits() -> ProducerLimits {
    ProducerLimits {
        window: 3,
        max_entities: 2,
        max_queued_bytes: 100,
        resend_backoff_min: Duration::from_millis(100),
        resend_backoff_max: Duration::from_millis(400),
        max_redeliveries: 2,
        durable: false,
        linger: Duration::from_millis(1000),
    }
}

struct Rig {
    core: ProducerCore,
    now: Instant,
    waiters: u64,
}

impl Rig {
    fn new() -> Self {
        Rig { core: ProducerCore::new("p".into(), limits(), 1000, 0), now: Instant::now(), waiters: 0 }
    }

    fn run(&mut self, input: ProducerInput) -> Vec<ProducerAction> {
        let mut out = Vec::new();
        self.core.handle(input, self.now, &mut out);
        out
    }

    fn offer(&mut self, entity: &str, body: &str) -> Vec<ProducerAction> {
        self.waiters += 1;
        let waiter = self.waiters;
        self.run(ProducerInput::Offer { entity: entity.into(), bytes: Bytes::from(body.to_string()), waiter })
    }

    fn answer(&mut self, entity: &str, stream: u64, round: u64, seq: u64, result: SendResult) -> Vec<ProducerAction> {
        self.run(ProducerInput::Outcome { entity: entity.into(), stream, round, seq, result })
    }

    /// Offers `body` to a new `entity` whose stream is `stream`, and answers the probe with a
    /// hello: the stream's round 2 then sends what it holds at once.
    fn introduce(&mut self, entity: &str, stream: u64, body: &str) -> Vec<ProducerAction> {
        assert!(matches!(self.offer(entity, body)[0], ProducerAction::Stored { seq: 1, .. }));
        self.answer(entity, stream, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }))
    }

    fn later(&mut self, by: Duration) -> Vec<ProducerAction> {
        self.now += by;
        self.run(ProducerInput::Tick)
    }
}

fn confirmed(handled: bool) -> SendResult {
    SendResult::Answered(DeliveryOutcome::Confirmed { handled, nonce: 9 })
}

fn failed() -> SendResult {
    SendResult::Failed("timed out".into())
}

/// The sends among `out`: (seq, round, first_unconfirmed, redelivery).
fn sends(out: &[ProducerAction]) -> Vec<(u64, u64, u64, bool)> {
    out.iter()
        .filter_map(|a| match a {
            ProducerAction::Send { header, round, .. } => {
                Some((header.seq, *round, header.first_unconfirmed, header.redelivery))
            }
            _ => None,
        })
        .collect()
}

/// The sends among `out`: (seq, nonce).
fn nonces(out: &[ProducerAction]) -> Vec<(u64, u64)> {
    out.iter()
        .filter_map(|a| match a {
            ProducerAction::Send { header, .. } => Some((header.seq, header.nonce)),
            _ => None,
        })
        .collect()
}

fn confirms(out: &[ProducerAction]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            ProducerAction::Confirmed { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

const S: u64 = 1001; // the first stream of a core with base 1000
/// A stream an earlier incarnation made (a load resumes it).
const OLD: u64 = 77;

#[test]
fn stored_messages_are_numbered_sent_at_once_and_confirmed_cumulatively() {
    let mut r = Rig::new();
    let out = r.offer("e", "a");
    assert_eq!(out[0], ProducerAction::Stored { stream: S, seq: 1 });
    assert_eq!(sends(&out), vec![(1, 1, 1, false)], "a probe");
    assert!(sends(&r.offer("e", "b")).is_empty(), "nothing more until the entity's incarnation is known");
    let out = r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    assert_eq!(sends(&out), vec![(1, 2, 1, true), (2, 2, 1, false)]);
    assert_eq!(sends(&r.offer("e", "c")), vec![(3, 2, 1, false)], "then at once");
    // The answer to 2 confirms 1 too: the entity handles a stream in order.
    assert_eq!(confirms(&r.answer("e", S, 2, 2, confirmed(true))), vec![1, 2]);
    assert_eq!(r.core.unconfirmed(), 1);
    assert_eq!(sends(&r.offer("e", "d")), vec![(4, 2, 3, false)], "the header says what is confirmed");
    assert_eq!(confirms(&r.answer("e", S, 2, 4, confirmed(true))), vec![3, 4]);
    assert_eq!(r.core.entities(), 0, "nothing unconfirmed");
    assert_eq!(r.core.queued_bytes(), 0);
    let c = r.core.counts();
    assert_eq!((c.stored, c.confirmed, c.resent), (4, 4, 1));
}

#[test]
fn an_offer_past_the_window_waits_and_a_confirmation_wakes_the_oldest_waiter() {
    let mut r = Rig::new();
    for body in ["a", "b", "c"] {
        assert!(matches!(r.offer("e", body)[0], ProducerAction::Stored { .. }));
    }
    assert_eq!(r.offer("e", "d"), vec![ProducerAction::Wait]);
    assert_eq!(r.offer("e", "e"), vec![ProducerAction::Wait]);
    assert_eq!(r.core.counts().demand_waits, 2);
    let out = r.answer("e", S, 1, 1, confirmed(true));
    assert!(out.contains(&ProducerAction::Wake { waiter: 4, entity: Some("e".into()) }), "{out:?}");
    assert!(!out.iter().any(|a| matches!(a, ProducerAction::Wake { waiter: 5, .. })), "one room, one waiter");
    // Waiter 4 was gone: the room goes to waiter 5.
    let out = r.run(ProducerInput::WakeLost { entity: Some("e".into()) });
    assert_eq!(out, vec![ProducerAction::Wake { waiter: 5, entity: Some("e".into()) }]);
}

#[test]
fn an_offer_past_the_byte_budget_is_refused_at_once_and_nothing_is_stored() {
    let mut r = Rig::new();
    r.offer("e", &"x".repeat(60));
    let out = r.offer("e", &"y".repeat(41));
    assert_eq!(out, vec![ProducerAction::Refused { queued_bytes: 60, max_queued_bytes: 100 }]);
    assert_eq!(r.core.unconfirmed(), 1);
    assert!(matches!(r.offer("e", &"z".repeat(40))[0], ProducerAction::Stored { seq: 2, .. }), "up to the budget");
}

#[test]
fn entities_past_the_limit_wait_for_a_stream_to_end() {
    let mut r = Rig::new();
    r.offer("a", "1");
    r.offer("b", "1");
    assert_eq!(r.offer("c", "1"), vec![ProducerAction::Wait]);
    let out = r.answer("a", S, 1, 1, confirmed(true));
    assert!(out.contains(&ProducerAction::Wake { waiter: 3, entity: None }), "{out:?}");
    assert!(matches!(r.offer("c", "1")[0], ProducerAction::Stored { .. }));
}

#[test]
fn a_failed_send_sends_every_unconfirmed_message_again_after_a_growing_backoff() {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.offer("e", "b");
    // 1 timed out; 2's answer is still out.
    assert!(r.answer("e", S, 2, 1, failed()).is_empty());
    assert!(sends(&r.offer("e", "c")).is_empty(), "nothing is sent while a round is due");
    assert!(r.later(Duration::from_millis(99)).is_empty());
    let out = r.later(Duration::from_millis(1));
    assert_eq!(sends(&out), vec![(1, 3, 1, true), (2, 3, 1, true), (3, 3, 1, false)]);
    assert_eq!(r.core.counts().resent, 3);
    // A failure of the old round starts nothing; of this one, a round after 200 ms.
    assert!(r.answer("e", S, 2, 2, failed()).is_empty());
    r.answer("e", S, 3, 1, failed());
    assert!(sends(&r.later(Duration::from_millis(199))).is_empty());
    assert_eq!(sends(&r.later(Duration::from_millis(1))).len(), 3);
    // A confirmation puts the backoff back to its minimum.
    r.answer("e", S, 4, 1, confirmed(true));
    r.answer("e", S, 4, 2, failed());
    assert_eq!(sends(&r.later(Duration::from_millis(100))), vec![(2, 5, 2, true), (3, 5, 2, true)]);
}

#[test]
fn a_gap_confirms_what_came_before_and_sends_the_rest_again_at_once_once_per_round() {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.offer("e", "b");
    r.offer("e", "c");
    // The entity took 1, lost 2, and sends 3 back asking for 2.
    let out = r.answer("e", S, 2, 3, SendResult::Answered(DeliveryOutcome::Gap { expected: 2, nonce: 9 }));
    assert_eq!(confirms(&out), vec![1]);
    assert_eq!(sends(&out), vec![(2, 3, 2, true), (3, 3, 2, true)]);
    // The same gap seen by another message of round 2 starts no further round.
    let out = r.answer("e", S, 2, 2, SendResult::Answered(DeliveryOutcome::Gap { expected: 2, nonce: 9 }));
    assert!(sends(&out).is_empty());
}

/// Simulation seed 200000004 of `reliable-durable`: an entity whose every write failed at once
/// (its node cut off from a majority) restarted, said hello, took a message, failed, restarted
/// — and each hello started a round at once, a loop without time passing.
#[test]
fn a_hello_or_a_gap_after_a_failure_of_the_round_waits_for_the_backoff() {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.offer("e", "b");
    // 1 failed (its write refused, the incarnation ended); the next incarnation says hello to 2.
    assert!(sends(&r.answer("e", S, 2, 1, failed())).is_empty());
    assert!(r.answer("e", S, 2, 2, SendResult::Answered(DeliveryOutcome::Hello { nonce: 10 })).is_empty());
    let gap = SendResult::Answered(DeliveryOutcome::Gap { expected: 1, nonce: 10 });
    assert!(sends(&r.answer("e", S, 2, 2, gap)).is_empty(), "nor a gap");
    assert!(sends(&r.later(Duration::from_millis(99))).is_empty());
    assert_eq!(nonces(&r.later(Duration::from_millis(1))), vec![(1, 10), (2, 10)], "the backoff's round, introduced");
}

#[test]
fn a_gap_never_confirms_the_message_it_answers_or_anything_after_it() {
    let mut r = Rig::new();
    r.offer("e", "a");
    r.offer("e", "b");
    let out = r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Gap { expected: 9, nonce: 9 }));
    assert!(confirms(&out).is_empty(), "{out:?}");
    assert_eq!(r.core.unconfirmed(), 2);
}

#[test]
fn a_message_its_entity_keeps_panicking_on_becomes_a_dead_letter_and_the_stream_goes_on() {
    let mut r = Rig::new();
    r.introduce("e", S, "bad");
    r.offer("e", "good");
    let panicked = || SendResult::Answered(DeliveryOutcome::Panicked { reason: "boom".into() });
    for round in 2..=3 {
        assert!(r.answer("e", S, round, 1, panicked()).iter().all(|a| !matches!(a, ProducerAction::DeadLetter { .. })));
        assert_eq!(sends(&r.later(Duration::from_millis(400)))[0].0, 1, "round {round}: tried again");
    }
    let out = r.answer("e", S, 4, 1, panicked());
    assert!(out.iter().any(|a| matches!(a, ProducerAction::DeadLetter { seq: 1, reason, .. } if reason == "boom")));
    assert_eq!(sends(&out), vec![(2, 5, 2, true)], "at once, past the dead letter");
    assert_eq!(r.core.counts().dead_lettered, 1);
    assert!(confirms(&out).is_empty(), "a dead letter is not confirmed");
}

#[test]
fn a_stream_outlives_its_last_message_until_its_place_is_needed_then_the_least_recently_idle_goes() {
    let mut r = Rig::new();
    r.offer("a", "1");
    r.answer("a", S, 1, 1, confirmed(true));
    assert_eq!(r.core.entities(), 0);
    // Idle, not gone: the numbering goes on (the entity's incarnation knows the stream).
    assert_eq!(r.offer("a", "2")[0], ProducerAction::Stored { stream: S, seq: 2 });
    r.answer("a", S, 1, 2, confirmed(true));
    r.offer("b", "1");
    r.answer("b", S + 1, 1, 1, confirmed(true));
    // Two streams, both idle, at `max_entities`: a third entity takes the place of `a`.
    assert_eq!(r.offer("c", "1")[0], ProducerAction::Stored { stream: S + 2, seq: 1 });
    assert_eq!(r.offer("b", "2")[0], ProducerAction::Stored { stream: S + 1, seq: 2 }, "b kept");
    r.answer("c", S + 2, 1, 1, confirmed(true));
    assert_eq!(r.offer("a", "3")[0], ProducerAction::Stored { stream: S + 3, seq: 1 }, "a starts anew");
    // Outcomes of the stream that went are ignored.
    assert!(r.answer("a", S, 1, 2, failed()).is_empty());
    assert!(confirms(&r.answer("a", S, 1, 9, confirmed(true))).is_empty());
    assert!(r.later(Duration::from_secs(1)).is_empty(), "no round from the old stream's failure");
}

#[test]
fn a_hello_sends_every_unconfirmed_message_again_with_the_incarnation_s_nonce_once_per_round() {
    let mut r = Rig::new();
    for body in ["a", "b", "c"] {
        r.offer("e", body);
    }
    let hello = |nonce| SendResult::Answered(DeliveryOutcome::Hello { nonce });
    let out = r.answer("e", S, 1, 1, hello(42));
    assert_eq!(nonces(&out), vec![(1, 42), (2, 42), (3, 42)]);
    assert!(confirms(&out).is_empty(), "a hello confirms nothing");
    assert!(r.answer("e", S, 1, 2, hello(42)).is_empty(), "the round's other hellos start nothing");
    assert!(r.answer("e", S, 1, 3, hello(7)).is_empty(), "nor does an older incarnation's");
    assert_eq!(confirms(&r.answer("e", S, 2, 1, confirmed(true))), vec![1]);
    assert_eq!(nonces(&r.offer("e", "d")), vec![(4, 42)], "later messages carry it too");
    // The entity restarted again: a hello of the current round introduces the new incarnation.
    assert_eq!(nonces(&r.answer("e", S, 2, 2, hello(43))), vec![(2, 43), (3, 43), (4, 43)]);
}

#[test]
fn the_oldest_unconfirmed_message_is_reported_until_confirmed() {
    let mut r = Rig::new();
    assert_eq!(r.core.oldest_unconfirmed(), None);
    let first = r.now;
    r.offer("a", "1");
    r.now += Duration::from_secs(1);
    r.offer("b", "1");
    assert_eq!(r.core.oldest_unconfirmed(), Some(first));
    r.answer("a", S, 1, 1, confirmed(true));
    assert_eq!(r.core.oldest_unconfirmed(), Some(first + Duration::from_secs(1)));
}

mod durable;

#[test]
fn an_entity_that_heard_a_newer_incarnation_of_this_producer_stops_it_as_fenced() {
    let mut r = Rig::new();
    r.offer("e", "a");
    let out = r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Superseded { epoch: 9 << 16 }));
    assert!(out.contains(&ProducerAction::Fenced { fence: 9 << 16 }), "{out:?}");
    assert!(confirms(&out).is_empty(), "nothing confirmed by it");
}

#[test]
fn an_answer_from_an_incarnation_that_knew_the_stream_lets_the_rest_go_at_once() {
    // A restored stream probes with no nonce; its entity's incarnation, introduced to the
    // stream before, confirms by number and names itself.
    let mut r = Rig::new();
    r.offer("e", "a");
    r.offer("e", "b");
    r.offer("e", "c");
    let out = r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Confirmed { handled: false, nonce: 5 }));
    assert_eq!(confirms(&out), vec![1]);
    assert_eq!(nonces(&out), vec![(2, 5), (3, 5)]);
}

#[test]
fn a_wake_lost_by_a_stream_left_with_nothing_lets_it_idle_and_one_with_messages_does_not() {
    let mut r = Rig::new(); // window 3, two entities
    for body in ["1", "2", "3"] {
        r.offer("a", body);
    }
    assert_eq!(r.offer("a", "4"), vec![ProducerAction::Wait], "a's window is full");
    r.offer("b", "x");
    assert_eq!(r.offer("c", "x"), vec![ProducerAction::Wait], "two entities: c waits for one");
    r.answer("a", S, 1, 1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 9 }));
    let out = r.answer("a", S, 2, 1, confirmed(true));
    assert!(out.iter().any(|x| matches!(x, ProducerAction::Wake { entity: Some(_), .. })), "{out:?}");
    // a's woken offer is gone; a still has 2 and 3: it does not idle, c still waits.
    let out = r.run(ProducerInput::WakeLost { entity: Some("a".into()) });
    assert!(!out.iter().any(|x| matches!(x, ProducerAction::Wake { .. })), "{out:?}");
    // Another waiter, woken once a has nothing left, and gone too: a idles, c is woken.
    r.offer("a", "4");
    assert_eq!(r.offer("a", "5"), vec![ProducerAction::Wait]);
    r.answer("a", S, 2, 4, confirmed(true));
    let out = r.run(ProducerInput::WakeLost { entity: Some("a".into()) });
    assert!(out.iter().any(|x| matches!(x, ProducerAction::Wake { entity: None, .. })), "{out:?}");
}

fn pending(pending: u64) -> SendResult {
    SendResult::Answered(DeliveryOutcome::Pending { pending, nonce: 9 })
}

#[test]
fn a_message_its_entity_holds_back_holds_its_stream_until_confirmed_then_the_rest_goes_at_once() {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.offer("e", "b");
    r.offer("e", "c");
    // 1 is taken, 2 held (a deferred confirm), 3 sent back as pending.
    assert_eq!(confirms(&r.answer("e", S, 2, 3, pending(2))), vec![1], "everything before the held one");
    assert_eq!(r.core.unconfirmed(), 2);
    // A failure of the held message sends it alone again (what follows would only come back).
    assert!(sends(&r.answer("e", S, 2, 2, failed())).is_empty(), "after the backoff");
    assert_eq!(sends(&r.later(Duration::from_millis(100))), vec![(2, 3, 2, true)]);
    assert!(sends(&r.answer("e", S, 3, 2, pending(2))).is_empty(), "still held: nothing else goes");
    // Confirmed: what it held back goes again at once.
    let out = r.answer("e", S, 3, 2, confirmed(true));
    assert_eq!(confirms(&out), vec![2]);
    assert_eq!(sends(&out), vec![(3, 4, 3, true)]);
    assert_eq!(sends(&r.offer("e", "d")), vec![(4, 4, 3, false)], "the stream flows again");
}

#[test]
fn a_gap_from_an_incarnation_the_stream_did_not_know_yet_sends_each_unconfirmed_message_once() {
    let mut r = Rig::new();
    // Before an introduction only the probe goes; 2 and 3 wait.
    assert_eq!(sends(&r.offer("e", "a")), vec![(1, 1, 1, false)]);
    assert!(sends(&r.offer("e", "b")).is_empty());
    assert!(sends(&r.offer("e", "c")).is_empty());
    // An incarnation that knew the stream (a hello of it lost) asks for 1: the next round
    // sends 1, 2 and 3 to it, each once.
    let out = r.answer("e", S, 1, 1, SendResult::Answered(DeliveryOutcome::Gap { expected: 1, nonce: 9 }));
    assert_eq!(sends(&out), vec![(1, 2, 1, true), (2, 2, 1, false), (3, 2, 1, false)]);
}

/// A rig whose stream to `e` had 1 confirmed and sent 2, 3 and 4 in round 2.
fn three_sent_in_round_2() -> Rig {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.answer("e", S, 2, 1, confirmed(true));
    for body in ["b", "c", "d"] {
        r.offer("e", body);
    }
    r
}

#[test]
fn a_late_answer_of_an_older_round_that_confirms_the_held_message_sends_what_it_held_back() {
    let mut r = three_sent_in_round_2();
    // 2 held; 3 sent back as pending; 2's send fails: round 3 sends 2 alone.
    r.answer("e", S, 2, 3, pending(2));
    r.answer("e", S, 2, 2, failed());
    assert_eq!(sends(&r.later(Duration::from_millis(100))), vec![(2, 3, 2, true)]);
    // Round 2's late answer for 4: the hold ended, 2 is confirmed, 3 comes next.
    let mut out = r.answer("e", S, 2, 4, SendResult::Answered(DeliveryOutcome::Gap { expected: 3, nonce: 9 }));
    assert_eq!(confirms(&out), vec![2]);
    // Round 3's answer for 2, a duplicate now, has nothing left to release.
    out.extend(r.answer("e", S, 3, 2, confirmed(false)));
    let sent: Vec<u64> = sends(&out).iter().map(|s| s.0).collect();
    assert_eq!(sent, vec![3, 4], "what the hold kept back goes again");
}

#[test]
fn a_pending_answer_overtaken_by_its_held_messages_confirmation_sends_the_unhandled_message_again() {
    let mut r = three_sent_in_round_2();
    // The entity held 2 and sent 3 and 4 back as pending, then confirmed 2: that answer came
    // first.
    assert_eq!(confirms(&r.answer("e", S, 2, 2, confirmed(true))), vec![2]);
    let out = r.answer("e", S, 2, 3, pending(2));
    assert!(confirms(&out).is_empty(), "3 was not handled");
    assert_eq!(sends(&out), vec![(3, 3, 3, true), (4, 3, 3, true)], "so it goes again, and what follows");
    // 4's answer of the round before: round 3 has sent it already.
    assert!(sends(&r.answer("e", S, 2, 4, pending(2))).is_empty());
}

#[test]
fn a_pending_answer_for_a_message_already_confirmed_holds_nothing() {
    let mut r = Rig::new();
    r.introduce("e", S, "a");
    r.offer("e", "b");
    assert_eq!(confirms(&r.answer("e", S, 2, 2, confirmed(true))), vec![1, 2]);
    r.offer("e", "c");
    // A late pending answer about 2 (its hold was redirected) must not stop 3.
    assert!(confirms(&r.answer("e", S, 2, 2, pending(2))).is_empty());
    assert_eq!(sends(&r.offer("e", "d")), vec![(4, 2, 3, false)], "not held");
}

#[test]
fn a_new_incarnation_a_gap_or_a_panic_ends_a_hold() {
    // Each of these answers says the entity holds nothing back any more: the next round
    // sends everything unconfirmed, not the held message alone.
    let ends: [(u64, SendResult); 3] = [
        (1, SendResult::Answered(DeliveryOutcome::Hello { nonce: 10 })),
        (2, SendResult::Answered(DeliveryOutcome::Gap { expected: 2, nonce: 9 })),
        (2, SendResult::Answered(DeliveryOutcome::Panicked { reason: "boom".into() })),
    ];
    for (seq, end) in ends {
        let mut r = Rig::new();
        r.introduce("e", S, "a");
        r.offer("e", "b");
        r.offer("e", "c");
        r.answer("e", S, 2, 3, pending(2));
        let mut out = r.answer("e", S, 2, seq, end.clone());
        out.extend(r.later(Duration::from_millis(100)));
        let sent: Vec<u64> = sends(&out).iter().map(|s| s.0).collect();
        assert_eq!(sent, vec![2, 3], "after {end:?}");
    }
}
