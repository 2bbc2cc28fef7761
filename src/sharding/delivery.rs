//! Reliable delivery, the entity's side: which of a producer's deliveries an entity handles,
//! which it confirms without handling, and which it sends back (see [`super::producer`]).
//!
//! # What is promised
//! - **Nothing confirmed unhandled.** A delivery is confirmed only when this entity handled it
//!   ([`Admission::Handle`], confirmed once the handler returned and, for a durable entity, its
//!   write was acknowledged), or when it is older than what the entity already took from the
//!   same stream ([`Admission::Duplicate`]): a message the entity handled before, or one its
//!   producer says is confirmed already.
//! - **In order per stream.** The messages of one stream (a producer's sequence to one entity)
//!   are handled in sequence order, each at most once per set of marks; a delivery past the
//!   next one expected is sent back with the number expected ([`Admission::Gap`]), and the
//!   producer sends again from there. A producer makes an entity a new stream only once the
//!   one before has nothing unconfirmed, so a late copy of a stream made before the one taken
//!   (by the same incarnation, or under an older durable queue claim) is confirmed without
//!   being handled ([`Admission::Duplicate`]), and the stream taken goes on.
//! - **Effectively once for durable entities.** A durable entity keeps its marks in its stored
//!   state, written in the same fenced write as the state a handler persists
//!   (`super::durable`): a re-sent message whose effect was written is confirmed without being
//!   handled again, across hand-offs, crashes and full restarts. A plain entity keeps its marks
//!   for the life of its incarnation, so a message re-sent to a new incarnation is handled
//!   again (at least once), with [`DeliveryInfo::redelivery`] set.
//!
//! **Settled before confirming.** A durable entity's marks are read from its node's replica,
//! which may hold a write no majority acknowledged (one that failed, and ended the incarnation
//! that made it). Such marks are *unsettled*: an answer that would confirm more than the
//! producer counts confirmed already (a duplicate, or a gap asking for a later number) waits
//! until a write of this incarnation, carrying them, is acknowledged
//! ([`ConsumerMarks::must_settle`]); otherwise the producer could give up a message whose effect
//! a newer allocation of the shard then never reads.
//!
//! **Deferred confirms.** A handler may hold its delivery's confirmation back
//! ([`ConsumerMarks::defer`]): the message then counts as taken by this incarnation only, and
//! is stored as not taken. Until it is confirmed ([`ConsumerMarks::confirm`]), a later message
//! of its stream is sent back ([`Admission::Held`]), so a confirmation never covers a held
//! message; when the hold is let go unconfirmed ([`ConsumerMarks::abandon`], or the
//! incarnation ends), the message is handled again, as a redelivery.
//!
//! # What is not promised
//! An entity keeps the marks of at most [`MAX_PRODUCERS_PER_ENTITY`] producers; a further one
//! replaces the producer heard from least recently, whose next delivery starts over as from a
//! producer never heard (its re-sent messages are handled again). A stream the entity has not
//! seen, and not made before it, replaces the one it kept for that producer: a producer
//! restarted without its durable queue starts new streams, and what the old incarnation left
//! unconfirmed is not re-sent. Nothing orders two incarnations without a durable queue, so a
//! late copy from the old one is taken as a new stream (its producer is gone) and the new
//! one's next message is sent back as a gap: without a durable queue, a producer's restart
//! may get messages of the new incarnation handled twice.

use serde::{Deserialize, Serialize};

/// Most producers whose marks one entity keeps (see the module doc).
pub const MAX_PRODUCERS_PER_ENTITY: usize = 64;

/// What a reliable delivery carries besides its message: who sent it, in which stream, and
/// what the producer has had confirmed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeliveryHeader {
    /// The producer's id.
    pub producer: std::sync::Arc<str>,
    /// The stream: one producer's sequence to one entity, unique per start of that sequence.
    pub stream: u64,
    /// This message's number in its stream (from 1).
    pub seq: u64,
    /// The oldest number of the stream the producer has not had confirmed when it sent this
    /// one: everything before it is confirmed (handled, or given up as a dead letter).
    pub first_unconfirmed: u64,
    /// The producer sent this message before (its outcome did not come back).
    pub redelivery: bool,
    /// The entity incarnation the producer was introduced to ([`DeliveryOutcome::Hello`]) on
    /// this stream; 0 before any.
    pub nonce: u64,
    /// The epoch the producer's incarnation claimed its durable queue at (0: no durable
    /// queue). An entity that heard a newer one refuses this one's deliveries.
    #[serde(default)]
    pub epoch: u64,
    /// When the producer made the stream: the durable queue claim of the incarnation that
    /// made it (0: none) and its number among that incarnation's streams (from 1; 0: not
    /// known, from a node that predates it). See [`made_before`].
    #[serde(default)]
    pub made: (u64, u64),
}

/// What an entity answers a delivery with (the transport's errors aside).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DeliveryOutcome {
    /// Handled now (`handled`), or earlier / confirmed already (`!handled`), by the
    /// incarnation with `nonce` (which the producer may send from now on).
    Confirmed { handled: bool, nonce: u64 },
    /// Not handled: the entity expects `expected` of the stream first.
    Gap { expected: u64, nonce: u64 },
    /// The handler panicked on it: not confirmed.
    Panicked { reason: String },
    /// Not handled: this incarnation takes the stream only from messages sent once its
    /// producer knew of it, carrying `nonce`.
    Hello { nonce: u64 },
    /// Not handled: a newer incarnation of the producer (its queue claimed at `epoch`) sends
    /// to this entity; the sender must stop.
    Superseded { epoch: u64 },
    /// Not handled (or handled, and its confirmation held): the entity took everything
    /// before `pending` and holds `pending`'s confirmation back (a deferred confirm); its
    /// outcome comes when the entity confirms it.
    Pending { pending: u64, nonce: u64 },
}

/// What an entity does with a delivery ([`ConsumerMarks::admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The next message of its stream: handle it (the marks count it taken already).
    Handle,
    /// Taken before, or confirmed by its producer's own account: confirm, do not handle.
    Duplicate,
    /// Past the next one expected: send it back asking for `expected`.
    Gap { expected: u64 },
    /// A stream this incarnation was not introduced to: send it back with the incarnation's
    /// nonce (see [`ConsumerMarks::admit`]).
    Hello { nonce: u64 },
    /// From a producer incarnation older than one heard (claimed at `epoch`): refuse it.
    Superseded { epoch: u64 },
    /// A later message of a stream whose message `pending` is held unconfirmed (a deferred
    /// confirm): sent back, its producer waits for `pending`'s outcome.
    Held { pending: u64 },
    /// The held message `pending` sent again: the held confirmation (`token`) is answered to
    /// this delivery from now on, and the delivery it was for is answered as pending.
    Redirect { token: u64, pending: u64 },
}

impl Admission {
    /// What the entity answers a delivery it does not handle, its incarnation's nonce being
    /// `nonce` (`None`: it handles it, and answers once its handler returned).
    pub(crate) fn answer(self, nonce: u64) -> Option<DeliveryOutcome> {
        match self {
            Admission::Handle => None,
            Admission::Duplicate => Some(DeliveryOutcome::Confirmed { handled: false, nonce }),
            Admission::Gap { expected } => Some(DeliveryOutcome::Gap { expected, nonce }),
            Admission::Hello { nonce } => Some(DeliveryOutcome::Hello { nonce }),
            Admission::Superseded { epoch } => Some(DeliveryOutcome::Superseded { epoch }),
            Admission::Held { pending } | Admission::Redirect { pending, .. } => {
                Some(DeliveryOutcome::Pending { pending, nonce })
            }
        }
    }
}

/// Where an entity stands with one producer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Mark {
    producer: String,
    stream: u64,
    /// The next number of `stream` the entity takes.
    expected: u64,
    /// When the producer was last heard, by the marks' own count: the least recent is
    /// replaced when the marks are full.
    heard: u64,
    /// The incarnation whose nonce the producer sent on this stream (0: none yet; not stored,
    /// so every incarnation is introduced anew).
    #[serde(skip)]
    greeted: u64,
    /// The newest producer incarnation heard (its durable queue's claim; 0: none).
    #[serde(default)]
    epoch: u64,
    /// When its producer made `stream` ([`DeliveryHeader::made`]).
    #[serde(default)]
    made: (u64, u64),
    /// The durable queue claim of the producer incarnation that last sent `stream` (0: none,
    /// or not known).
    #[serde(default)]
    sender: u64,
    /// A message handled whose confirmation is held back, and its hold's token: then
    /// `expected` is that message (stored as not taken). Not stored.
    #[serde(skip)]
    pending: Option<(u64, u64)>,
}

/// An entity's marks: per producer, the stream it takes and the next number expected. Public
/// only as the hidden [`super::Entity::delivery_marks`] names it.
#[doc(hidden)]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerMarks {
    marks: Vec<Mark>,
    /// Deliveries heard, for [`Mark::heard`].
    clock: u64,
    /// This incarnation's nonce (random, never 0; not stored).
    #[serde(skip)]
    nonce: u64,
    /// Everything the marks say was acknowledged by a majority (fresh marks, or marks a write
    /// of this incarnation carried); not stored (see the module doc).
    #[serde(skip)]
    settled: bool,
}

impl ConsumerMarks {
    /// Empty marks of an incarnation whose nonce is `nonce`.
    pub(crate) fn new(nonce: u64) -> Self {
        ConsumerMarks { marks: Vec::new(), clock: 0, nonce: nonce.max(1), settled: true }
    }

    /// Marks loaded from the stored state, taken up by a new incarnation with `nonce`: every
    /// producer is introduced to it again before it takes their streams on.
    /// They are unsettled until a write of the incarnation carries them.
    pub(crate) fn begin_incarnation(&mut self, nonce: u64) {
        self.nonce = nonce.max(1);
        self.settled = self.marks.is_empty();
        for m in &mut self.marks {
            m.greeted = 0;
            m.pending = None;
        }
    }

    /// A write carrying the marks was acknowledged by a majority.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }

    /// Whether answering `admission` of the delivery carrying `h` must wait for the marks to
    /// settle: it would confirm a message the producer does not count confirmed yet, on the
    /// word of unsettled marks.
    pub(crate) fn must_settle(&self, h: &DeliveryHeader, admission: Admission) -> bool {
        !self.settled
            && match admission {
                Admission::Duplicate => h.seq >= h.first_unconfirmed,
                Admission::Gap { expected } => expected > h.first_unconfirmed,
                Admission::Held { pending } | Admission::Redirect { pending, .. } => pending > h.first_unconfirmed,
                Admission::Handle | Admission::Hello { .. } | Admission::Superseded { .. } => false,
            }
    }

    /// Each producer's stream and the next number expected: what the marks say was handled.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn streams(&self) -> impl Iterator<Item = (&str, u64, u64)> {
        self.marks.iter().map(|m| (m.producer.as_str(), m.stream, m.expected))
    }

    /// This incarnation's nonce.
    pub(crate) fn nonce(&self) -> u64 {
        self.nonce
    }

    /// Whether no producer has been heard.
    pub(crate) fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// Decides what to do with a delivery carrying `h`, and counts it taken when it is to be
    /// handled (a handler that fails ends the incarnation, and its marks with it).
    ///
    /// **Introduction.** An incarnation takes a stream on only from a message that carries its
    /// nonce: one sent after the producer heard of this incarnation, so what the producer
    /// then counted confirmed includes everything an earlier incarnation handled and had
    /// confirmed. Without it, a copy delayed on the way (held through a hand-off, sent again
    /// meanwhile) could reach a new incarnation after the old one had handled what follows,
    /// and be handled again out of order.
    pub(crate) fn admit(&mut self, h: &DeliveryHeader) -> Admission {
        if h.seq == u64::MAX {
            // No producer numbers that far; taking it would leave nothing after it.
            return Admission::Gap { expected: h.first_unconfirmed.min(h.seq - 1) };
        }
        let introduced = h.nonce == self.nonce;
        let i = self.marks.iter().position(|m| *m.producer == *h.producer);
        // A producer incarnation whose queue a newer one claimed (it learns so only at its
        // next write) may still send what it held, in streams the newer one replaced.
        if let Some(epoch) = i.map(|i| self.marks[i].epoch).filter(|e| h.epoch < *e) {
            return Admission::Superseded { epoch };
        }
        // A copy of a stream its producer replaced, late on the way: everything in it was
        // confirmed before the newer one was made. Taken as a new stream, it would be handled
        // again, and the newer stream's messages after it.
        if i.is_some_and(|i| self.marks[i].stream != h.stream && made_before(h, &self.marks[i])) {
            return Admission::Duplicate;
        }
        let taken_on = i.is_some_and(|i| self.marks[i].stream == h.stream && self.marks[i].greeted == self.nonce);
        if !taken_on && !introduced {
            return Admission::Hello { nonce: self.nonce };
        }
        self.clock = self.clock.saturating_add(1);
        let (heard, nonce) = (self.clock, self.nonce);
        let Some(i) = i else {
            let admission = first_of_stream(h);
            if admission == Admission::Handle {
                let (producer, stream, expected) = (h.producer.to_string(), h.stream, next(h.seq));
                let (epoch, made, sender) = (h.epoch, h.made, h.epoch);
                self.insert(Mark {
                    producer,
                    stream,
                    expected,
                    heard,
                    greeted: nonce,
                    epoch,
                    made,
                    sender,
                    pending: None,
                });
            }
            return admission;
        };
        let mark = &mut self.marks[i];
        mark.heard = heard;
        mark.epoch = h.epoch;
        if mark.stream != h.stream {
            let admission = first_of_stream(h);
            if admission == Admission::Handle {
                mark.stream = h.stream;
                (mark.made, mark.sender) = (h.made, h.epoch);
                mark.expected = next(h.seq);
                mark.greeted = nonce;
                mark.pending = None;
            }
            return admission;
        }
        mark.greeted = nonce;
        mark.sender = h.epoch;
        // Everything before the producer's first unconfirmed message is confirmed: handled
        // here, or given up.
        mark.expected = mark.expected.max(h.first_unconfirmed);
        if let Some((pending, token)) = mark.pending {
            if mark.expected > pending {
                // Its producer counts the held message confirmed (given up): nothing is held.
                mark.pending = None;
            } else {
                return match h.seq.cmp(&pending) {
                    std::cmp::Ordering::Less => Admission::Duplicate,
                    std::cmp::Ordering::Equal => Admission::Redirect { token, pending },
                    std::cmp::Ordering::Greater => Admission::Held { pending },
                };
            }
        }
        match h.seq.cmp(&mark.expected) {
            std::cmp::Ordering::Less => Admission::Duplicate,
            std::cmp::Ordering::Equal => {
                mark.expected = next(h.seq);
                Admission::Handle
            }
            std::cmp::Ordering::Greater => Admission::Gap { expected: mark.expected },
        }
    }

    /// The handler of message `seq` of `producer`'s stream `stream`, just admitted to be
    /// handled, holds its confirmation back under `token`: the message counts as taken by this
    /// incarnation only, and is stored as not taken. False when it is not the message the
    /// stream just took (nothing is held then).
    pub(crate) fn defer(&mut self, producer: &str, stream: u64, seq: u64, token: u64) -> bool {
        let Some(mark) = self
            .marks
            .iter_mut()
            .find(|m| m.producer == producer && m.stream == stream && m.pending.is_none() && m.expected == next(seq))
        else {
            return false;
        };
        mark.expected = seq;
        mark.pending = Some((seq, token));
        true
    }

    /// The confirmation held under `token` is given: its message counts as taken (stored so
    /// by the next write), and the stream goes on. False when nothing is held under it any
    /// more (its stream was replaced, or its producer counts it confirmed already).
    pub(crate) fn confirm(&mut self, token: u64) -> bool {
        let Some(mark) = self.marks.iter_mut().find(|m| m.pending.is_some_and(|(_, t)| t == token)) else {
            return false;
        };
        let (seq, _) = mark.pending.take().expect("found by it");
        mark.expected = mark.expected.max(next(seq));
        true
    }

    /// The hold under `token` is let go unconfirmed: its message is handled again when sent
    /// again.
    pub(crate) fn abandon(&mut self, token: u64) {
        if let Some(mark) = self.marks.iter_mut().find(|m| m.pending.is_some_and(|(_, t)| t == token)) {
            mark.pending = None;
        }
    }

    /// Adds a mark, replacing the least recently heard one when the marks are full.
    fn insert(&mut self, mark: Mark) {
        if self.marks.len() >= MAX_PRODUCERS_PER_ENTITY
            && let Some(oldest) = self.marks.iter().enumerate().min_by_key(|(_, m)| m.heard).map(|(i, _)| i)
        {
            self.marks.swap_remove(oldest);
        }
        self.marks.push(mark);
    }
}

/// The number after `seq` (below `u64::MAX`: [`ConsumerMarks::admit`] refuses that one).
fn next(seq: u64) -> u64 {
    seq.saturating_add(1)
}

/// Whether the stream of `h` was sent by the producer incarnation that sent `mark`'s and made
/// before it, so that all of it was confirmed before `mark`'s was made: one incarnation sends
/// an entity one stream at a time (the one it resumed from its load, if any, then those it
/// makes), and starts the next only once the one before has nothing unconfirmed.
///
/// A later incarnation's streams do not compare: its load may resume a stream made before
/// `mark`'s whose entries no earlier load saw (never acknowledged, so never sent, and come
/// back from a replica's disk), and its messages are to be handled (seed 1900000018 of
/// `reliable-durable`). Durable queue claims (`epoch`) name incarnations; without them, the
/// random base the ids of one incarnation's streams share does.
fn made_before(h: &DeliveryHeader, mark: &Mark) -> bool {
    let (theirs, ours) = (h.made, mark.made);
    if theirs.1 == 0 || ours.1 == 0 {
        return false;
    }
    // A mark's sender is never newer than the newest claim it heard, which a delivery is not
    // older than (`Superseded` otherwise): a delivery without a claim meets no sender with one.
    if h.epoch > 0 {
        return h.epoch == mark.sender && theirs < ours;
    }
    h.stream.wrapping_sub(theirs.1) == mark.stream.wrapping_sub(ours.1) && theirs.1 < ours.1
}

/// A delivery of a stream the entity has no mark of: the stream starts where the producer's
/// confirmed messages end.
fn first_of_stream(h: &DeliveryHeader) -> Admission {
    match h.seq.cmp(&h.first_unconfirmed) {
        std::cmp::Ordering::Less => Admission::Duplicate,
        std::cmp::Ordering::Equal => Admission::Handle,
        std::cmp::Ordering::Greater => Admission::Gap { expected: h.first_unconfirmed },
    }
}

/// What an entity knows about the reliable delivery it is handling
/// ([`super::EntityContext::delivery`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryInfo {
    /// The producer's id.
    pub producer_id: String,
    /// The message's number in its producer's sequence to this entity.
    pub seq: u64,
    /// The producer sent it before: an earlier incarnation of this entity may have handled it
    /// (a plain entity's; a durable entity never sees a message whose effect it wrote).
    pub redelivery: bool,
}

impl DeliveryInfo {
    /// What the entity learns of the delivery carrying `h`.
    pub(crate) fn of(h: &DeliveryHeader) -> Self {
        DeliveryInfo { producer_id: h.producer.to_string(), seq: h.seq, redelivery: h.redelivery }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nonce of the incarnation most tests run.
    const N: u64 = 77;

    /// A delivery sent once the producer knew incarnation `N`.
    fn h(producer: &str, stream: u64, seq: u64, first_unconfirmed: u64) -> DeliveryHeader {
        DeliveryHeader {
            producer: producer.into(),
            stream,
            seq,
            first_unconfirmed,
            redelivery: false,
            nonce: N,
            epoch: 0,
            made: (0, 0),
        }
    }

    /// The same delivery sent before the producer knew of incarnation `N`.
    fn stale(producer: &str, stream: u64, seq: u64, first_unconfirmed: u64) -> DeliveryHeader {
        DeliveryHeader { nonce: 5, ..h(producer, stream, seq, first_unconfirmed) }
    }

    /// Runs `steps` (a delivery and the admission it must get) through one set of marks.
    fn check(steps: &[(DeliveryHeader, Admission)]) -> ConsumerMarks {
        let mut marks = ConsumerMarks::new(N);
        for (i, (header, want)) in steps.iter().enumerate() {
            assert_eq!(marks.admit(header), *want, "step {i}: {header:?}");
        }
        marks
    }

    use Admission::{Duplicate, Gap, Handle, Superseded};
    const HELLO: Admission = Admission::Hello { nonce: N };

    #[test]
    fn an_incarnation_takes_a_stream_on_only_from_a_message_carrying_its_nonce() {
        check(&[
            (stale("p", 7, 1, 1), HELLO),
            (h("p", 7, 1, 1), Handle),
            // Taken on: what the producer sent before it knew the incarnation is judged by
            // number (the same number is the same message).
            (stale("p", 7, 2, 1), Handle),
            (stale("p", 7, 2, 1), Duplicate),
            (stale("p", 7, 4, 1), Gap { expected: 3 }),
            // Another stream of the producer needs its own introduction.
            (stale("p", 8, 1, 1), HELLO),
            (stale("q", 1, 1, 1), HELLO),
        ]);
    }

    #[test]
    fn a_delayed_copy_never_rewinds_a_new_incarnation_past_what_an_earlier_one_handled() {
        // Incarnation 5 handled 1..=6; its copies of 3 and 4 were held on the way and reach
        // incarnation N, which has no marks (a plain entity restarted).
        check(&[
            (stale("p", 7, 3, 3), HELLO),
            (stale("p", 7, 4, 3), HELLO),
            // The producer, introduced, sends what it has unconfirmed: from 7.
            (h("p", 7, 7, 7), Handle),
            (stale("p", 7, 3, 3), Duplicate),
        ]);
    }

    #[test]
    fn marks_name_their_incarnation_by_a_nonce_never_zero() {
        assert_eq!(ConsumerMarks::new(N).nonce(), N);
        assert_eq!(ConsumerMarks::new(0).nonce(), 1, "0 means no incarnation on the wire");
        let mut marks = ConsumerMarks::new(N);
        marks.begin_incarnation(99);
        assert_eq!(marks.nonce(), 99);
    }

    #[test]
    fn marks_are_empty_until_a_stream_is_taken_on_so_a_plain_state_is_stored_as_before() {
        let mut marks = ConsumerMarks::new(N);
        assert!(marks.is_empty());
        assert_eq!(marks.admit(&stale("p", 7, 1, 1)), HELLO);
        assert!(marks.is_empty(), "a hello takes nothing on");
        assert_eq!(marks.admit(&h("p", 7, 1, 1)), Handle);
        assert!(!marks.is_empty(), "now its marks are stored with the state");
    }

    #[test]
    fn stored_marks_are_introduced_to_each_new_incarnation_and_keep_their_numbers() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle), (h("p", 7, 2, 1), Handle)]);
        let bytes = crate::transport::wire::encode(&marks).unwrap();
        marks = crate::transport::wire::decode(&bytes).unwrap();
        marks.begin_incarnation(99);
        let again = DeliveryHeader { nonce: 99, ..h("p", 7, 2, 1) };
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Admission::Hello { nonce: 99 }, "the old nonce is not this one");
        assert_eq!(marks.admit(&again), Duplicate, "2 was handled and stored");
        assert_eq!(marks.admit(&DeliveryHeader { seq: 3, ..again }), Handle);
    }

    #[test]
    fn a_producer_incarnation_older_than_one_heard_is_refused_even_after_a_restart() {
        let mut marks = ConsumerMarks::new(N);
        let newer = |stream, seq, first| DeliveryHeader { epoch: 0x2_0001, ..h("p", stream, seq, first) };
        let older = |stream, seq, first| DeliveryHeader { epoch: 0x1_0001, ..h("p", stream, seq, first) };
        assert_eq!(marks.admit(&older(7, 1, 1)), Handle);
        assert_eq!(marks.admit(&newer(9, 1, 1)), Handle, "the newer incarnation's stream replaces the older's");
        // The older incarnation, not yet told its queue was claimed, sends its old stream again:
        // taken as a new stream, it would be handled a second time.
        let refused = marks.admit(&older(7, 1, 1));
        assert_eq!(refused, Superseded { epoch: 0x2_0001 });
        assert!(!marks.must_settle(&older(7, 1, 1), refused), "nothing is confirmed by it");
        assert_eq!(refused.answer(N), Some(DeliveryOutcome::Superseded { epoch: 0x2_0001 }));
        assert_eq!(marks.admit(&newer(9, 2, 1)), Handle, "the newer goes on");
        // Stored with the state and read by the next incarnation, the epoch still refuses.
        let mut restarted: ConsumerMarks =
            crate::transport::wire::decode(&crate::transport::wire::encode(&marks).unwrap()).unwrap();
        restarted.begin_incarnation(N);
        assert_eq!(restarted.admit(&older(7, 2, 1)), Superseded { epoch: 0x2_0001 });
        // A producer with no durable queue (epoch 0) is never refused while none with one was heard.
        let mut plain = ConsumerMarks::new(N);
        assert_eq!(plain.admit(&h("q", 1, 1, 1)), Handle);
        assert_eq!(plain.admit(&h("q", 2, 1, 1)), Handle);
    }

    /// Message `seq` of the `n`th stream an incarnation without a durable queue made, its
    /// stream ids counted from `base`.
    fn nth(base: u64, n: u64, seq: u64, first_unconfirmed: u64) -> DeliveryHeader {
        DeliveryHeader { made: (0, n), ..h("p", base.wrapping_add(n), seq, first_unconfirmed) }
    }

    #[test]
    fn a_late_copy_of_a_stream_its_producer_replaced_is_confirmed_without_being_handled() {
        let base = u64::MAX - 1; // ids wrap: base + 1 is the largest, base + 2 is 0
        let marks = check(&[
            (nth(base, 1, 1, 1), Handle),
            (nth(base, 1, 2, 1), Handle),
            // Stream 1 confirmed and let go; the producer makes the entity stream 2.
            (nth(base, 2, 1, 1), Handle),
            // A copy of stream 1's message 2, sent before its confirmation came back, arrives
            // now: taken as a new stream it would be handled again, and stream 2's message 1
            // after it (sent back as a gap).
            (nth(base, 1, 2, 2), Duplicate),
            (nth(base, 1, 3, 3), Duplicate),
            (nth(base, 2, 2, 1), Handle),
            (nth(base, 3, 1, 1), Handle),
        ]);
        assert_eq!(marks.streams().collect::<Vec<_>>(), [("p", base.wrapping_add(3), 2)]);
        assert_eq!(Duplicate.answer(N), Some(DeliveryOutcome::Confirmed { handled: false, nonce: N }));
    }

    #[test]
    fn a_stream_another_incarnation_without_a_durable_queue_made_replaces_the_one_taken() {
        // Nothing orders incarnations without a claim: a restarted producer's streams are taken
        // (see the module doc), whatever their number.
        check(&[
            (nth(1_000, 5, 1, 1), Handle),
            (nth(9_000, 1, 1, 1), Handle),
            (nth(1_000, 4, 3, 3), Handle),
            // A node that predates the stream's number sends none (0): never taken as older.
            (nth(1_000, 9, 1, 1), Handle),
            (DeliveryHeader { made: (0, 0), ..h("p", 1_003, 2, 2) }, Handle),
            (nth(1_000, 2, 1, 1), Handle),
        ]);
        // Nor one with a claim but no number (a node that predates it).
        let claimed = |made, stream| DeliveryHeader { epoch: 9, made, ..h("p", stream, 1, 1) };
        check(&[(claimed((9, 2), 5), Handle), (claimed((0, 0), 4), Handle)]);
        // Nor the stream of an incarnation with a claim after one without (ids of one base
        // or not: a claim is what names an incarnation that has one).
        check(&[(nth(1_000, 3, 1, 1), Handle), (claimed((9, 1), 1_001), Handle)]);
    }

    #[test]
    fn a_stream_resumed_from_an_older_claim_is_older_than_every_stream_the_newer_claim_made() {
        let claim =
            |made: (u64, u64), stream, seq, first| DeliveryHeader { epoch: 9, made, ..h("p", stream, seq, first) };
        let mut marks = check(&[
            // Incarnation 9 resumes the stream incarnation 4 made (its 7th), then lets it go.
            (claim((4, 7), 500, 3, 3), Handle),
            (claim((9, 1), 20, 1, 1), Handle),
            (claim((4, 7), 500, 3, 3), Duplicate),
            (claim((4, 8), 501, 1, 1), Duplicate),
            (claim((9, 1), 20, 2, 1), Handle),
            (claim((9, 2), 21, 1, 1), Handle),
            (claim((9, 1), 20, 3, 1), Duplicate),
        ]);
        // Stored with the state, the stream's claim still orders the next incarnation's copies.
        let mut restarted: ConsumerMarks =
            crate::transport::wire::decode(&crate::transport::wire::encode(&marks).unwrap()).unwrap();
        restarted.begin_incarnation(N);
        assert_eq!(restarted.admit(&claim((9, 1), 20, 3, 3)), Duplicate);
        assert_eq!(marks.admit(&claim((9, 3), 22, 1, 1)), Handle);
    }

    #[test]
    fn a_stream_a_later_incarnation_resumed_is_handled_however_old_its_claim() {
        // Incarnation 9 sent stream (9, 3); incarnation 12's load found a stream incarnation 4
        // made and never had acknowledged (so never sent), come back from a replica's disk.
        let from =
            |epoch, made: (u64, u64), stream, seq, first| DeliveryHeader { epoch, made, ..h("p", stream, seq, first) };
        check(&[
            (from(9, (9, 3), 22, 1, 1), Handle),
            (from(12, (4, 6), 500, 3, 3), Handle),
            (from(12, (12, 1), 30, 1, 1), Handle),
            (from(12, (4, 6), 500, 3, 3), Duplicate),
            (from(9, (9, 3), 22, 2, 2), Superseded { epoch: 12 }),
        ]);
    }

    #[test]
    fn a_stream_is_handled_in_order_each_message_once() {
        check(&[
            (h("p", 7, 1, 1), Handle),
            (h("p", 7, 2, 1), Handle),
            (h("p", 7, 2, 1), Duplicate),
            (h("p", 7, 1, 1), Duplicate),
            (h("p", 7, 3, 1), Handle),
        ]);
    }

    #[test]
    fn a_message_past_the_next_one_expected_is_sent_back_asking_for_that_one() {
        check(&[
            (h("p", 7, 1, 1), Handle),
            (h("p", 7, 3, 1), Gap { expected: 2 }),
            (h("p", 7, 4, 1), Gap { expected: 2 }),
            (h("p", 7, 2, 1), Handle),
            (h("p", 7, 3, 1), Handle),
        ]);
    }

    #[test]
    fn a_new_incarnation_takes_a_stream_from_the_producer_s_first_unconfirmed_message() {
        // No marks (a plain entity restarted): 1..4 were confirmed, 5 is the first open one.
        check(&[(h("p", 7, 6, 5), Gap { expected: 5 }), (h("p", 7, 5, 5), Handle), (h("p", 7, 6, 5), Handle)]);
    }

    #[test]
    fn what_the_producer_counts_confirmed_is_never_asked_for_again() {
        // The marks say 3 is next (written before 3 and 4 were confirmed without a write):
        // the producer's account moves them on, and 3 is a duplicate.
        check(&[
            (h("p", 7, 1, 1), Handle),
            (h("p", 7, 2, 1), Handle),
            (h("p", 7, 5, 5), Handle),
            (h("p", 7, 3, 5), Duplicate),
            (h("p", 7, 6, 5), Handle),
        ]);
        // A producer that gave a message up (a dead letter) skips it the same way.
        check(&[(h("p", 7, 1, 1), Handle), (h("p", 7, 3, 3), Handle)]);
    }

    #[test]
    fn a_new_stream_of_a_producer_replaces_its_old_one_from_its_first_message() {
        check(&[
            (h("p", 7, 1, 1), Handle),
            (h("p", 7, 2, 1), Handle),
            // Restarted producer: new stream, numbered from 1 again.
            (h("p", 9, 2, 1), Gap { expected: 1 }),
            (h("p", 9, 1, 1), Handle),
            (h("p", 9, 2, 1), Handle),
            (h("p", 9, 1, 1), Duplicate),
        ]);
    }

    #[test]
    fn producers_are_kept_apart() {
        check(&[
            (h("a", 1, 1, 1), Handle),
            (h("b", 1, 1, 1), Handle),
            (h("b", 1, 1, 1), Duplicate),
            (h("a", 1, 2, 1), Handle),
            (h("b", 1, 3, 1), Gap { expected: 2 }),
        ]);
    }

    #[test]
    fn a_message_the_producer_already_counts_confirmed_is_not_handled_by_a_stranger_either() {
        // Hostile or confused: a number below the producer's own first unconfirmed one.
        let mut marks = check(&[(h("p", 7, 2, 4), Duplicate)]);
        assert!(marks.is_empty(), "no mark is made for a message not handled");
        assert_eq!(marks.admit(&h("p", 7, u64::MAX, u64::MAX)), Gap { expected: u64::MAX - 1 }, "never taken");
        assert!(marks.is_empty());
        assert_eq!(marks.admit(&h("p", 7, u64::MAX - 1, u64::MAX - 1)), Handle, "the last number a stream has");
        assert_eq!(marks.admit(&h("p", 7, u64::MAX - 1, 1)), Duplicate);
    }

    #[test]
    fn full_marks_replace_the_producer_heard_from_least_recently() {
        let mut marks = ConsumerMarks::new(N);
        for p in 0..MAX_PRODUCERS_PER_ENTITY {
            assert_eq!(marks.admit(&h(&format!("p{p}"), 1, 1, 1)), Handle);
        }
        // p0 is heard again: p1 is now the least recent.
        assert_eq!(marks.admit(&h("p0", 1, 1, 1)), Duplicate);
        assert_eq!(marks.admit(&h("new", 1, 1, 1)), Handle);
        assert_eq!(marks.marks.len(), MAX_PRODUCERS_PER_ENTITY);
        assert_eq!(marks.admit(&h("p0", 1, 1, 1)), Duplicate, "p0 kept");
        assert_eq!(marks.admit(&h("p1", 1, 1, 1)), Handle, "p1 was replaced: its stream starts over");
    }

    #[test]
    fn marks_survive_an_encoding_round_trip() {
        let marks = check(&[(h("a", 3, 1, 1), Handle), (h("b", 4, 1, 1), Handle)]);
        let bytes = crate::transport::wire::encode(&marks).unwrap();
        let back: ConsumerMarks = crate::transport::wire::decode(&bytes).unwrap();
        let numbers =
            |m: &ConsumerMarks| m.marks.iter().map(|m| (m.producer.clone(), m.stream, m.expected)).collect::<Vec<_>>();
        assert_eq!(numbers(&back), numbers(&marks));
        assert_eq!((back.nonce, back.marks[0].greeted), (0, 0), "an incarnation's nonce is not stored");
    }

    #[test]
    fn each_admission_but_handle_is_answered_at_once_with_the_incarnation_s_nonce() {
        assert_eq!(Handle.answer(N), None, "handled, it is answered once its handler returned");
        assert_eq!(Duplicate.answer(N), Some(DeliveryOutcome::Confirmed { handled: false, nonce: N }));
        assert_eq!(Gap { expected: 4 }.answer(N), Some(DeliveryOutcome::Gap { expected: 4, nonce: N }));
        assert_eq!(Admission::Hello { nonce: 8 }.answer(N), Some(DeliveryOutcome::Hello { nonce: 8 }));
    }

    #[test]
    fn a_held_message_holds_its_stream_back_until_its_confirmation_is_given() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle), (h("p", 7, 2, 1), Handle)]);
        assert!(marks.defer("p", 7, 2, 40));
        // What follows is sent back: confirming it would confirm the held message too.
        assert_eq!(marks.admit(&h("p", 7, 3, 1)), Admission::Held { pending: 2 });
        assert_eq!(marks.admit(&h("p", 7, 9, 1)), Admission::Held { pending: 2 });
        assert_eq!(marks.admit(&h("p", 7, 1, 1)), Duplicate, "taken before the held one");
        // The held message sent again takes the held answer over; it is not handled again.
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Admission::Redirect { token: 40, pending: 2 });
        assert_eq!(marks.admit(&h("q", 1, 1, 1)), Handle, "other producers go on");
        assert!(marks.confirm(40));
        assert!(!marks.confirm(40), "given once");
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Duplicate);
        assert_eq!(marks.admit(&h("p", 7, 3, 1)), Handle);
    }

    #[test]
    fn a_held_message_is_stored_as_not_taken_so_a_new_incarnation_handles_it_again() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle), (h("p", 7, 2, 1), Handle)]);
        assert!(marks.defer("p", 7, 2, 40));
        let mut restarted: ConsumerMarks =
            crate::transport::wire::decode(&crate::transport::wire::encode(&marks).unwrap()).unwrap();
        restarted.begin_incarnation(99);
        let again = DeliveryHeader { nonce: 99, redelivery: true, ..h("p", 7, 2, 1) };
        assert_eq!(restarted.admit(&again), Handle, "handled again, as a redelivery");
        assert!(!restarted.confirm(40), "the old incarnation's hold is not this one's");
        assert_eq!(restarted.admit(&DeliveryHeader { seq: 3, ..again }), Handle);
    }

    #[test]
    fn a_hold_let_go_unconfirmed_hands_its_message_to_the_handler_again() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle)]);
        assert!(marks.defer("p", 7, 1, 40));
        marks.abandon(41);
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Admission::Held { pending: 1 }, "another token lets nothing go");
        marks.abandon(40);
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Gap { expected: 1 });
        assert_eq!(marks.admit(&h("p", 7, 1, 1)), Handle);
        assert!(!marks.confirm(40), "nothing is held under it any more");
        assert_eq!(marks.admit(&h("p", 7, 2, 1)), Handle);
    }

    #[test]
    fn a_producer_that_counts_the_held_message_confirmed_ends_the_hold() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle)]);
        assert!(marks.defer("p", 7, 1, 40));
        assert_eq!(marks.admit(&h("p", 7, 2, 2)), Handle, "1 was given up or confirmed");
        assert!(!marks.confirm(40));
        // A new stream of the producer ends the hold on its old one too.
        assert!(marks.defer("p", 7, 2, 41));
        assert_eq!(marks.admit(&h("p", 9, 1, 1)), Handle);
        assert!(!marks.confirm(41));
        assert_eq!(marks.admit(&h("p", 9, 2, 1)), Handle);
    }

    #[test]
    fn only_the_message_a_stream_just_took_can_be_held_and_only_once() {
        let mut marks = check(&[(h("p", 7, 1, 1), Handle), (h("p", 7, 2, 1), Handle)]);
        assert!(!marks.defer("p", 7, 1, 40), "1 is not the one just taken");
        assert!(!marks.defer("p", 7, 3, 40), "3 was not taken");
        assert!(!marks.defer("p", 8, 2, 40), "another stream");
        assert!(!marks.defer("q", 7, 2, 40), "another producer");
        assert!(marks.defer("p", 7, 2, 40));
        assert!(!marks.defer("p", 7, 2, 41), "held already");
        assert_eq!(marks.admit(&h("p", 7, 3, 1)), Admission::Held { pending: 2 });
    }

    #[test]
    fn a_pending_answer_confirms_only_what_comes_before_the_held_message() {
        assert_eq!(Admission::Held { pending: 4 }.answer(N), Some(DeliveryOutcome::Pending { pending: 4, nonce: N }));
        let redirect = Admission::Redirect { token: 9, pending: 4 };
        assert_eq!(redirect.answer(N), Some(DeliveryOutcome::Pending { pending: 4, nonce: N }));
        // On unsettled marks, it waits for them to settle when it confirms more than the
        // producer counts confirmed.
        let mut stored = check(&[(h("p", 1, 1, 1), Handle)]);
        stored.begin_incarnation(N);
        assert_eq!(stored.admit(&h("p", 1, 2, 1)), Handle);
        assert!(stored.defer("p", 1, 2, 40));
        assert!(stored.must_settle(&h("p", 1, 3, 1), Admission::Held { pending: 2 }));
        assert!(!stored.must_settle(&h("p", 1, 3, 2), Admission::Held { pending: 2 }));
        assert!(stored.must_settle(&h("p", 1, 2, 1), redirect_of(40, 2)));
        assert!(!stored.must_settle(&h("p", 1, 2, 2), redirect_of(40, 2)));
        stored.settle();
        assert!(!stored.must_settle(&h("p", 1, 3, 1), Admission::Held { pending: 2 }));
    }

    fn redirect_of(token: u64, pending: u64) -> Admission {
        Admission::Redirect { token, pending }
    }

    /// Simulation seed 200000001 of `reliable-durable` (see the module doc's "settled").
    #[test]
    fn marks_read_from_a_replica_settle_before_an_answer_confirms_on_their_word() {
        let mut stored = check(&[(h("p", 1, 1, 1), Handle), (h("p", 1, 2, 1), Handle)]);
        assert!(!stored.must_settle(&h("p", 1, 1, 1), Duplicate), "fresh marks are settled");
        stored.begin_incarnation(N);
        let (dup, gap) = (h("p", 1, 2, 1), h("p", 1, 5, 1));
        // Introduced, a re-sent 2 is a duplicate, and 5 a gap asking for 3: both would confirm 2.
        assert_eq!(stored.admit(&dup), Duplicate);
        assert!(stored.must_settle(&dup, Duplicate));
        assert_eq!(stored.admit(&gap), Gap { expected: 3 });
        assert!(stored.must_settle(&gap, Gap { expected: 3 }));
        // What the producer counts confirmed already needs no settling, nor does a handle or a
        // hello (they confirm nothing the marks alone say).
        assert!(!stored.must_settle(&h("p", 1, 1, 2), Duplicate));
        assert!(!stored.must_settle(&h("p", 1, 4, 3), Gap { expected: 3 }));
        assert!(!stored.must_settle(&h("p", 1, 3, 1), Handle));
        assert!(!stored.must_settle(&stale("p", 1, 3, 1), Admission::Hello { nonce: N }));
        stored.settle();
        assert!(!stored.must_settle(&dup, Duplicate), "settled by an acknowledged write");
        // Marks stored empty (a state without deliveries) have nothing to settle.
        let mut empty = ConsumerMarks::default();
        empty.begin_incarnation(N);
        assert!(!empty.must_settle(&dup, Duplicate));
    }
}
