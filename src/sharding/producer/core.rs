//! The producer's decisions, sans IO: which messages it stores, which it sends (again), when a
//! stream starts a new round, and what is confirmed or given up (see [`super`]).
//!
//! # What is promised
//! - **A stored message is delivered until confirmed.** Every stored message is sent; when a
//!   send's outcome is a failure (timeout, hand-off, crash), a gap or a panic, the stream sends
//!   everything unconfirmed again from its oldest message, after a backoff for failures and
//!   panics, at once for a gap. Nothing leaves the queue but by a confirmation or, after
//!   `max_redeliveries` panics of the entity on it, as a dead letter.
//! - **Cumulative confirmation is sound.** The entity handles a stream in order
//!   ([`crate::sharding::delivery`]), so a confirmation of message `n`, or a gap asking for
//!   `n + 1`, confirms every message before it.
//! - **Bounded.** At most `window` unconfirmed messages per entity, `max_entities` entities
//!   with unconfirmed messages, and `max_queued_bytes` of stored messages; an offer past the
//!   first two waits (its waiter is woken when room frees, oldest first), one past the byte
//!   budget is refused at once.
//!
//! - **New numbers are never below what an entity handled.** A stream resumed from a
//!   durable queue's load takes no new message (see [`super::queue`]): its entity's next
//!   offers wait until it is let go and then go in a new stream.
//! - **A held message holds its stream.** An entity may hold a message's confirmation back (a
//!   deferred confirm, answered `Pending`): what follows it is sent again once the hold ends
//!   (the message is confirmed, or an answer of any round says the entity holds nothing), and
//!   until then only it is (again, after a failure).
//!
//! A round is one pass over a stream's unconfirmed messages: outcomes of an older round still
//! confirm what they confirm, but start another round only when they end a hold.
//!
//! A stream outlives its last unconfirmed message (idle, so its entity's incarnation, which
//! knows it, is not introduced to a new one per message), until an entity without a stream
//! needs its place: the least recently idle one goes then.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use super::queue::{QueueEntry, Restored};
use crate::clock::Instant;
use crate::sharding::delivery::{DeliveryHeader, DeliveryOutcome};
use deletions::{cancel_flush, entry_confirmed, schedule_flush};
use stream::{Queued, Stream};

/// The producer's bounds and timings.
#[derive(Debug, Clone)]
pub(crate) struct ProducerLimits {
    pub window: usize,
    pub max_entities: usize,
    pub max_queued_bytes: usize,
    pub resend_backoff_min: Duration,
    pub resend_backoff_max: Duration,
    pub max_redeliveries: u32,
    /// Messages are stored in the cluster (majority writes) before they count as stored.
    pub durable: bool,
    /// Durable: how long a confirmed message's entry may stay stored after its confirmation.
    /// Meanwhile the stream's next message takes its place, and its write replaces the entry:
    /// one write per message instead of two.
    pub linger: Duration,
}

/// How a durable store write of one message ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PersistResult {
    /// Acknowledged by a majority.
    Stored,
    /// Not acknowledged (a timeout, too few replicas): written again after a pause.
    Retry(String),
    /// Refused with nothing written (its slot is full): the message is not stored.
    Refused(String),
    /// A newer incarnation of this producer claimed the queue.
    Fenced { fence: u64 },
}

/// How a delivery ended for the producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SendResult {
    /// The entity answered.
    Answered(DeliveryOutcome),
    /// No answer (timeout, not delivered, a failed write): the outcome is unknown.
    Failed(String),
}

#[derive(Debug)]
pub(crate) enum ProducerInput {
    /// A caller offers `bytes` for `entity`; `waiter` names it should it have to wait.
    Offer { entity: String, bytes: Bytes, waiter: u64 },
    /// A woken waiter was gone: the room it was woken for goes to the next one.
    WakeLost { entity: Option<String> },
    /// The outcome of message `seq` of `entity`'s stream `stream`, sent in round `round`.
    Outcome { entity: String, stream: u64, round: u64, seq: u64, result: SendResult },
    /// Time passed: due rounds start.
    Tick,
    /// The durable store write of message `seq` of `entity`'s stream `stream` ended.
    Persisted { entity: String, stream: u64, seq: u64, result: PersistResult },
    /// The durable store deletion at a key ended: of message `seq` of `entity`'s stream
    /// `stream`, or (`None`) of a stale entry a load found.
    Unpersisted { of: Option<StoredMessage>, result: PersistResult },
    /// What a durable queue's load found (before any offer).
    Restore(Restored),
    /// Durable: the producer is stopping. The entries of confirmed messages are deleted now
    /// (those whose places no unconfirmed message holds), so that a later incarnation does
    /// not send them again.
    Closing,
}

/// A stored message: its entity, stream and number.
pub(crate) type StoredMessage = (String, u64, u64);

#[derive(Debug, PartialEq)]
pub(crate) enum ProducerAction {
    /// The offer is stored as message `seq` of stream `stream` (durable: acknowledged).
    Stored { stream: u64, seq: u64 },
    /// Durable: the offer is message `seq` of stream `stream`, being written (`Stored` or
    /// `StoreFailed` follows).
    Storing { stream: u64, seq: u64 },
    /// Durable: message `seq` of stream `stream` could not be stored: it is not.
    StoreFailed { stream: u64, seq: u64, reason: String },
    /// Durable: write `entry` at `key`.
    Persist { key: String, entry: QueueEntry },
    /// Durable: delete the entry at `key`: of a confirmed (or given up) message, whose result
    /// comes back as `Unpersisted`, or (`None`) a stale one a load found.
    Unpersist { key: String, of: Option<StoredMessage> },
    /// Durable: a newer incarnation claimed the queue; this one must stop.
    Fenced { fence: u64 },
    /// No room for the offer: its waiter is woken when there is.
    Wait,
    /// The offer would pass the byte budget: refused, nothing stored.
    Refused { queued_bytes: usize, max_queued_bytes: usize },
    /// Room for a waiter (`entity`'s queue, or `None`: the queue of entities waiting for a stream).
    Wake { waiter: u64, entity: Option<String> },
    /// Send a message, in round `round` of its stream.
    Send { entity: String, header: DeliveryHeader, round: u64, bytes: Bytes },
    /// Message `seq` of stream `stream` is confirmed.
    Confirmed { stream: u64, seq: u64 },
    /// Message `seq` of `entity`'s stream `stream` is given up: its entity panicked on it more
    /// than `max_redeliveries` times.
    DeadLetter { entity: String, stream: u64, seq: u64, bytes: Bytes, reason: String },
}

/// What the producer counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProducerCounts {
    pub stored: u64,
    pub confirmed: u64,
    pub resent: u64,
    pub demand_waits: u64,
    pub dead_lettered: u64,
}

/// One producer's queue and streams.
pub(crate) struct ProducerCore {
    producer: std::sync::Arc<str>,
    limits: ProducerLimits,
    /// Stream ids are `stream_base + n`: a random base per incarnation keeps them unique.
    stream_base: u64,
    streams_made: u64,
    streams: HashMap<String, Stream>,
    /// Idle streams, least recently idle first; the count orders them.
    idle: BTreeMap<u64, String>,
    idle_count: u64,
    /// Offers for entities without a stream, waiting for one (`max_entities` reached).
    parked: VecDeque<u64>,
    queued_bytes: usize,
    /// Rounds due, by time.
    retries: BTreeSet<(Instant, String)>,
    counts: ProducerCounts,
    /// Durable: the epoch this incarnation claimed its queue at.
    epoch: u64,
    /// Durable: lanes given out, and those free again.
    lanes: u32,
    free_lanes: BTreeSet<u32>,
    /// Durable: writes to try again, by time (entity, number).
    persist_retries: BTreeSet<(Instant, String, u64)>,
    /// Durable: flushes of idle or evicted streams' confirmed entries, by time.
    flushes: BTreeSet<(Instant, String)>,
    /// Durable: evicted streams whose entries are being deleted. Their lane, and their entity's
    /// next stream, wait until every deletion is acknowledged (an offer to the entity meanwhile
    /// takes the stream back): so a load never finds a stream that was let go beside the one
    /// that replaced it (see [`super::queue`]).
    evicted: HashMap<String, Stream>,
}

impl ProducerCore {
    /// A core whose streams are numbered from `stream_base`; `epoch`: the claim of its durable
    /// queue (0 without one).
    pub(crate) fn new(producer: String, limits: ProducerLimits, stream_base: u64, epoch: u64) -> Self {
        ProducerCore {
            producer: producer.into(),
            limits,
            stream_base,
            streams_made: 0,
            streams: HashMap::new(),
            idle: std::collections::BTreeMap::new(),
            idle_count: 0,
            parked: VecDeque::new(),
            queued_bytes: 0,
            retries: BTreeSet::new(),
            counts: ProducerCounts::default(),
            epoch,
            lanes: 0,
            free_lanes: BTreeSet::new(),
            persist_retries: BTreeSet::new(),
            flushes: BTreeSet::new(),
            evicted: HashMap::new(),
        }
    }

    pub(crate) fn counts(&self) -> ProducerCounts {
        self.counts
    }

    /// Unconfirmed messages.
    pub(crate) fn unconfirmed(&self) -> usize {
        self.streams.values().map(|s| s.queue.len()).sum()
    }

    /// Bytes of unconfirmed messages.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Entities with unconfirmed messages (or offers waiting for room).
    pub(crate) fn entities(&self) -> usize {
        self.streams.len() - self.idle.len()
    }

    /// Durable: evicted streams whose entries are still being deleted.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn evicted(&self) -> usize {
        self.evicted.len()
    }

    /// Durable: when the streams' flushes are due, soonest first.
    #[cfg(test)]
    pub(crate) fn flushes_due(&self) -> Vec<Instant> {
        self.flushes.iter().map(|(at, _)| *at).collect()
    }

    /// When the oldest unconfirmed message was stored.
    pub(crate) fn oldest_unconfirmed(&self) -> Option<Instant> {
        self.streams.values().filter_map(|s| s.queue.front().map(|q| q.stored_at)).min()
    }

    pub(crate) fn handle(&mut self, input: ProducerInput, now: Instant, out: &mut Vec<ProducerAction>) {
        match input {
            ProducerInput::Offer { entity, bytes, waiter } => self.offer(entity, bytes, waiter, now, out),
            ProducerInput::WakeLost { entity: Some(entity) } => self.wake(&entity, out),
            ProducerInput::WakeLost { entity: None } => self.wake_parked(out),
            ProducerInput::Outcome { entity, stream, round, seq, result } => {
                self.outcome(&entity, stream, round, seq, result, now, out);
            }
            ProducerInput::Tick => self.tick(now, out),
            ProducerInput::Persisted { entity, stream, seq, result } => {
                self.persisted(&entity, stream, seq, result, now, out);
            }
            ProducerInput::Unpersisted { of, result } => self.unpersisted(of, result, now, out),
            ProducerInput::Restore(restored) => self.restore(restored, now, out),
            ProducerInput::Closing => self.closing(now, out),
        }
    }

    /// Whether `s` has room for another message: fewer than `window` unconfirmed messages,
    /// and (durable) a free place in its lane.
    fn has_room(&self, s: &Stream) -> bool {
        self.room(s) > 0
    }

    /// Messages that fit in `s` now (none in a resumed stream: see [`Stream::resumed`]).
    fn room(&self, s: &Stream) -> usize {
        if s.resumed {
            return 0;
        }
        let by_window = self.limits.window.saturating_sub(s.queue.len());
        if !self.limits.durable {
            return by_window;
        }
        let places = usize::try_from(s.modulus).unwrap_or(usize::MAX);
        by_window.min(places.saturating_sub(s.queue.len()))
    }

    fn offer(&mut self, entity: String, bytes: Bytes, waiter: u64, now: Instant, out: &mut Vec<ProducerAction>) {
        let current = match self.streams.get_mut(&entity) {
            Some(s) => Some(s),
            None => self.evicted.get_mut(&entity),
        };
        if let Some(s) = current.filter(|s| s.resumed) {
            // Its entity's next messages go in a new stream, once this one is let go.
            self.counts.demand_waits += 1;
            s.waiters.push_back(waiter);
            out.push(ProducerAction::Wait);
            return;
        }
        let room = match self.streams.get(&entity) {
            Some(s) => self.has_room(s),
            None => self.room_for_a_stream(),
        };
        if !room {
            self.counts.demand_waits += 1;
            match self.streams.get_mut(&entity) {
                Some(s) => s.waiters.push_back(waiter),
                None => self.parked.push_back(waiter),
            }
            out.push(ProducerAction::Wait);
            return;
        }
        if self.queued_bytes.saturating_add(bytes.len()) > self.limits.max_queued_bytes {
            let (queued_bytes, max_queued_bytes) = (self.queued_bytes, self.limits.max_queued_bytes);
            out.push(ProducerAction::Refused { queued_bytes, max_queued_bytes });
            return;
        }
        if !self.streams.contains_key(&entity) && self.streams.len() >= self.limits.max_entities {
            self.evict_idle(now, out);
        }
        if let Some(mut s) = self.evicted.remove(&entity) {
            // Taken back while its entries were being deleted: the same stream and lane go on
            // (a deletion still on its way is written before any new message at its place).
            cancel_flush(&mut self.flushes, &entity, &mut s);
            self.streams.insert(entity.clone(), s);
        }
        if !self.streams.contains_key(&entity) {
            let lane = self.free_lanes.pop_first().unwrap_or_else(|| {
                self.lanes += 1;
                self.lanes - 1
            });
            self.streams_made += 1;
            let stream = self.new_stream(self.stream_base.wrapping_add(self.streams_made), lane);
            self.streams.insert(entity.clone(), stream);
        }
        let s = self.streams.get_mut(&entity).expect("made above");
        if let Some(at) = s.idle_since.take() {
            self.idle.remove(&at);
        }
        let seq = s.next_seq;
        s.next_seq += 1;
        self.queued_bytes += bytes.len();
        let durable = self.limits.durable;
        let place = if durable { s.free_place() } else { 0 };
        if durable {
            out.push(ProducerAction::Storing { stream: s.id, seq });
            out.push(ProducerAction::Persist { key: s.key(place), entry: s.entry(&entity, seq, &bytes) });
        } else {
            self.counts.stored += 1;
            out.push(ProducerAction::Stored { stream: s.id, seq });
        }
        s.queue.push_back(Queued { seq, place, bytes, stored_at: now, stored: !durable, sends: 0, panics: 0 });
        self.pump(&entity, out);
    }

    /// Whether an entity without a stream may have one now: fewer than `max_entities` with
    /// unconfirmed messages (so an idle stream to evict if every place is taken), and
    /// (durable) fewer than `max_entities` evicted ones still being deleted.
    fn room_for_a_stream(&self) -> bool {
        self.entities() < self.limits.max_entities && self.evicted.len() < self.limits.max_entities
    }

    /// A stream with id `id` in `lane`, numbered from 1.
    fn new_stream(&self, id: u64, lane: u32) -> Stream {
        Stream {
            id,
            next_seq: 1,
            queue: VecDeque::new(),
            sent_upto: 0,
            round: 1,
            retry_at: None,
            backoff: self.limits.resend_backoff_min,
            waiters: VecDeque::new(),
            nonce: 0,
            idle_since: None,
            lane,
            modulus: self.limits.window.max(1) as u64,
            made: (self.epoch, self.streams_made),
            held: None,
            resumed: false,
            undeleted: BTreeMap::new(),
            deleting: BTreeSet::new(),
            flush_at: None,
        }
    }

    /// A durable write ended.
    fn persisted(
        &mut self,
        entity: &str,
        stream: u64,
        seq: u64,
        result: PersistResult,
        now: Instant,
        out: &mut Vec<ProducerAction>,
    ) {
        let Some(s) = self.streams.get_mut(entity).filter(|s| s.id == stream) else { return };
        let Some(i) = s.queue.iter().position(|q| q.seq == seq && !q.stored) else { return };
        match result {
            PersistResult::Stored => {
                s.queue[i].stored = true;
                s.overwritten(s.queue[i].place);
                self.counts.stored += 1;
                out.push(ProducerAction::Stored { stream, seq });
                self.pump(entity, out);
            }
            PersistResult::Retry(_) => {
                self.persist_retries.insert((now + self.limits.resend_backoff_min, entity.to_string(), seq));
            }
            PersistResult::Refused(reason) => {
                // Nothing was written; later numbers of the stream go on without it (the
                // header's first unconfirmed number moves the entity past it).
                let q = s.queue.remove(i).expect("found above");
                self.queued_bytes -= q.bytes.len();
                out.push(ProducerAction::StoreFailed { stream, seq, reason });
                self.after_progress(entity, out);
            }
            PersistResult::Fenced { fence } => out.push(ProducerAction::Fenced { fence }),
        }
    }

    /// Resumes the streams a durable queue's load found: everything in them counts as sent
    /// before (their entities may have handled it), and is sent once each entity's
    /// incarnation is known.
    fn restore(&mut self, restored: Restored, now: Instant, out: &mut Vec<ProducerAction>) {
        out.extend(restored.stale.into_iter().map(|key| ProducerAction::Unpersist { key, of: None }));
        for r in restored.streams {
            if self.streams.contains_key(&r.entity) {
                continue;
            }
            let mut s = self.new_stream(r.stream, r.lane);
            (s.modulus, s.made, s.resumed) = (r.modulus.max(1), r.made, true);
            // Entries of confirmed messages whose deletion was not written: deleted now, and
            // the stream is let go only once they are. Their places are not written before.
            for (seq, place) in r.confirmed {
                s.next_seq = s.next_seq.max(seq.saturating_add(1));
                s.delete(&r.entity, seq, place, now, out);
            }
            for (seq, place, bytes) in r.messages {
                self.queued_bytes += bytes.len();
                s.next_seq = s.next_seq.max(seq.saturating_add(1));
                s.queue.push_back(Queued { seq, place, bytes, stored_at: now, stored: true, sends: 1, panics: 0 });
            }
            self.lanes = self.lanes.max(r.lane.saturating_add(1));
            self.streams.insert(r.entity.clone(), s);
            self.pump(&r.entity, out);
            self.after_progress(&r.entity, out);
        }
        let used: BTreeSet<u32> = self.streams.values().map(|s| s.lane).collect();
        self.free_lanes = (0..self.lanes).filter(|l| !used.contains(l)).collect();
    }

    /// Sends the stream's messages not yet sent in this round (none while a round is due).
    fn pump(&mut self, entity: &str, out: &mut Vec<ProducerAction>) {
        let Some(s) = self.streams.get_mut(entity) else { return };
        if s.retry_at.is_some() {
            return;
        }
        let first_unconfirmed = s.first_unconfirmed();
        let sent_upto = s.sent_upto;
        // Before the entity's incarnation is known, one message asks for its introduction
        // (a hello); the rest would only be sent back.
        let probe = usize::from(s.nonce == 0 && sent_upto < first_unconfirmed);
        let allowed = if s.nonce == 0 { probe } else { usize::MAX };
        // Durable: what is not stored yet waits (and what follows it, to keep the order).
        // Past a message the entity holds (a deferred confirm), nothing would be taken.
        let held = s.held.unwrap_or(u64::MAX);
        let sendable = s.queue.iter_mut().filter(|q| q.seq > sent_upto).take_while(|q| q.stored && q.seq <= held);
        for q in sendable.take(allowed) {
            let header = DeliveryHeader {
                producer: self.producer.clone(),
                stream: s.id,
                seq: q.seq,
                first_unconfirmed,
                redelivery: q.sends > 0,
                nonce: s.nonce,
                epoch: self.epoch,
                made: s.made,
            };
            if q.sends > 0 {
                self.counts.resent += 1;
            }
            q.sends = q.sends.saturating_add(1);
            s.sent_upto = q.seq;
            out.push(ProducerAction::Send {
                entity: entity.to_string(),
                header,
                round: s.round,
                bytes: q.bytes.clone(),
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn outcome(
        &mut self,
        entity: &str,
        stream: u64,
        round: u64,
        seq: u64,
        result: SendResult,
        now: Instant,
        out: &mut Vec<ProducerAction>,
    ) {
        let Some(s) = self.streams.get(entity).filter(|s| s.id == stream) else { return };
        let current = round == s.round;
        let held_before = s.held;
        // What the answer asks for next: a new round at once (even while one is due after a
        // failure: the entity answered and moved on), or one unless a round is due already. A
        // round after a failure waits for its backoff whatever else the stream hears (an
        // entity that fails at once, its writes refused, would otherwise be sent to in a
        // loop), and sends everything unconfirmed.
        let (mut round_now, mut round_unless_due) = (false, false);
        // The incarnation that answered (0: none), learned once the round is decided: a
        // stream that knew none sends the rest of its round to it.
        let mut learned = 0;
        match result {
            SendResult::Answered(DeliveryOutcome::Confirmed { nonce, .. }) => {
                self.confirm_through(entity, seq, now, out);
                if let Some(s) = self.streams.get_mut(entity) {
                    s.backoff = self.limits.resend_backoff_min;
                    // The held message is confirmed: what it held back (answered pending,
                    // not handled) goes again, at once.
                    round_now = s.held.take_if(|held| *held <= seq).is_some();
                }
                learned = nonce;
            }
            SendResult::Answered(DeliveryOutcome::Pending { pending, nonce }) => {
                // The entity took everything before `pending` and holds `pending`'s
                // confirmation back (a deferred confirm): its outcome comes when the entity
                // gives it; until then only `pending` is sent (again).
                self.confirm_through(entity, pending.min(seq).saturating_sub(1), now, out);
                if let Some(s) = self.streams.get_mut(entity) {
                    let first = s.first_unconfirmed();
                    match first.cmp(&pending) {
                        std::cmp::Ordering::Equal => s.held = Some(pending),
                        // The hold ended before this answer came (its confirmation overtook
                        // it): `seq` was not handled, and no release will send it again.
                        std::cmp::Ordering::Greater => round_unless_due = current && seq >= first,
                        std::cmp::Ordering::Less => {}
                    }
                }
                learned = nonce;
            }
            SendResult::Answered(DeliveryOutcome::Gap { expected, nonce }) => {
                // The entity took everything before `expected` (never more than was sent),
                // and holds nothing back: a hold this ends (whichever round's answer it is)
                // kept back what follows, unsent in this round or answered pending.
                self.confirm_through(entity, expected.min(seq).saturating_sub(1), now, out);
                self.streams.get_mut(entity).expect("seen above").held = None;
                round_unless_due = current || held_before.is_some();
                learned = nonce;
            }
            SendResult::Answered(DeliveryOutcome::Hello { nonce }) => {
                // The entity's incarnation is new to the stream: everything unconfirmed goes
                // again, introduced. Once per round: the other hellos of the round are then of
                // an older one (and may carry an older incarnation's nonce).
                if current {
                    let s = self.streams.get_mut(entity).expect("seen above");
                    (s.nonce, s.held) = (nonce, None);
                    round_unless_due = true;
                }
            }
            SendResult::Answered(DeliveryOutcome::Panicked { reason }) => {
                self.confirm_through(entity, seq.saturating_sub(1), now, out);
                self.streams.get_mut(entity).expect("seen above").held = None;
                if self.count_panic(entity, seq, reason, now, out) {
                    round_now = true;
                } else if current || held_before.is_some() {
                    self.retry_later(entity, now);
                }
            }
            SendResult::Failed(_) => {
                if current {
                    self.retry_later(entity, now);
                }
            }
            // The entity heard a newer incarnation of this producer: its queue was claimed.
            SendResult::Answered(DeliveryOutcome::Superseded { epoch }) => {
                out.push(ProducerAction::Fenced { fence: epoch });
            }
        }
        let due = self.streams.get(entity).is_some_and(|s| s.retry_at.is_some());
        if round_now || (round_unless_due && !due) {
            self.new_round(entity, out);
        }
        self.learn_nonce(entity, learned, out);
        self.after_progress(entity, out);
    }

    /// An answer from an incarnation that took the stream on without an introduction (it knew
    /// the stream already: a restored producer's, or one whose hello was lost): a stream that
    /// knew no incarnation sends to this one from now on, all at once.
    fn learn_nonce(&mut self, entity: &str, nonce: u64, out: &mut Vec<ProducerAction>) {
        if let Some(s) = self.streams.get_mut(entity).filter(|s| s.nonce == 0 && nonce != 0) {
            s.nonce = nonce;
            self.pump(entity, out);
        }
    }

    /// Counts a panic on message `seq`; gives it up when it passed `max_redeliveries` (true:
    /// the stream goes on without it at once).
    fn count_panic(
        &mut self,
        entity: &str,
        seq: u64,
        reason: String,
        now: Instant,
        out: &mut Vec<ProducerAction>,
    ) -> bool {
        let Some(s) = self.streams.get_mut(entity) else { return false };
        let Some(q) = s.queue.front_mut().filter(|q| q.seq == seq) else { return false };
        q.panics = q.panics.saturating_add(1);
        if q.panics <= self.limits.max_redeliveries {
            return false;
        }
        let q = s.queue.pop_front().expect("the front was just seen");
        self.queued_bytes -= q.bytes.len();
        self.counts.dead_lettered += 1;
        out.push(ProducerAction::DeadLetter { entity: entity.to_string(), stream: s.id, seq, bytes: q.bytes, reason });
        if self.limits.durable {
            entry_confirmed(&mut self.flushes, self.limits.linger, entity, s, (seq, q.place), now, out);
        }
        true
    }

    /// Confirms every unconfirmed message of the stream up to `upto`.
    fn confirm_through(&mut self, entity: &str, upto: u64, now: Instant, out: &mut Vec<ProducerAction>) {
        let Some(s) = self.streams.get_mut(entity) else { return };
        // Durable: only what was stored can have been sent, so only that is confirmed.
        while s.queue.front().is_some_and(|q| q.seq <= upto && q.stored) {
            let q = s.queue.pop_front().expect("seen above");
            out.push(ProducerAction::Confirmed { stream: s.id, seq: q.seq });
            if self.limits.durable {
                entry_confirmed(&mut self.flushes, self.limits.linger, entity, s, (q.seq, q.place), now, out);
            }
            self.queued_bytes -= q.bytes.len();
            self.counts.confirmed += 1;
        }
    }

    /// Starts a new round now: everything unconfirmed is sent again.
    fn new_round(&mut self, entity: &str, out: &mut Vec<ProducerAction>) {
        let Some(s) = self.streams.get_mut(entity) else { return };
        if let Some(at) = s.retry_at.take() {
            self.retries.remove(&(at, entity.to_string()));
        }
        s.round += 1;
        s.sent_upto = s.first_unconfirmed().saturating_sub(1);
        self.pump(entity, out);
    }

    /// Starts a new round after the stream's backoff (which doubles, up to its maximum).
    fn retry_later(&mut self, entity: &str, now: Instant) {
        let Some(s) = self.streams.get_mut(entity) else { return };
        if s.retry_at.is_some() || s.queue.is_empty() {
            return;
        }
        let at = now + s.backoff;
        s.retry_at = Some(at);
        s.backoff = (s.backoff * 2).min(self.limits.resend_backoff_max);
        self.retries.insert((at, entity.to_string()));
    }

    fn tick(&mut self, now: Instant, out: &mut Vec<ProducerAction>) {
        while let Some((at, entity, seq)) = self.persist_retries.first().cloned().filter(|(at, ..)| *at <= now) {
            self.persist_retries.remove(&(at, entity.clone(), seq));
            let Some(s) = self.streams.get(&entity) else { continue };
            if let Some(q) = s.queue.iter().find(|q| q.seq == seq && !q.stored) {
                out.push(ProducerAction::Persist { key: s.key(q.place), entry: s.entry(&entity, seq, &q.bytes) });
            }
        }
        while let Some((at, entity)) = self.flushes.first().cloned().filter(|(at, _)| *at <= now) {
            self.flushes.remove(&(at, entity.clone()));
            let evicted = !self.streams.contains_key(&entity);
            let s = self.streams.get_mut(&entity).or_else(|| self.evicted.get_mut(&entity));
            if let Some(s) = s.filter(|s| s.flush_at == Some(at)) {
                s.flush_at = None;
                // An evicted or resumed stream is let go once its entries are deleted: none
                // lingers.
                let after = if evicted || s.resumed { Duration::ZERO } else { self.limits.linger };
                s.flush(&entity, now, after, out);
                if let Some(next) = s.next_flush(after) {
                    // Those at places a message holds wait for its write (or, refused, for this).
                    let at = next.max(now + self.limits.resend_backoff_min);
                    schedule_flush(&mut self.flushes, &entity, s, at);
                }
            }
        }
        while let Some((at, entity)) = self.retries.first().cloned().filter(|(at, _)| *at <= now) {
            self.retries.remove(&(at, entity.clone()));
            if let Some(s) = self.streams.get_mut(&entity).filter(|s| s.retry_at == Some(at)) {
                s.retry_at = None;
                self.new_round(&entity, out);
            }
        }
    }

    /// After messages left the stream's queue: its waiters get the room; a stream with nothing
    /// left goes idle, and its place to an entity waiting for one.
    fn after_progress(&mut self, entity: &str, out: &mut Vec<ProducerAction>) {
        let Some(s) = self.streams.get(entity) else { return };
        if s.queue.is_empty() && s.waiters.is_empty() {
            self.go_idle(entity);
            self.wake_parked(out);
            return;
        }
        let room = self.room(s);
        for _ in 0..room.min(s.waiters.len()) {
            self.wake(entity, out);
        }
    }

    /// Wakes the oldest waiter of `entity`'s stream.
    fn wake(&mut self, entity: &str, out: &mut Vec<ProducerAction>) {
        let Some(s) = self.streams.get_mut(entity) else { return self.wake_parked(out) };
        match s.waiters.pop_front() {
            Some(waiter) => out.push(ProducerAction::Wake { waiter, entity: Some(entity.to_string()) }),
            None if s.queue.is_empty() => {
                self.go_idle(entity);
                self.wake_parked(out);
            }
            None => {}
        }
    }

    /// The stream has nothing unconfirmed and nobody waiting: it stays, idle, until its place
    /// is needed.
    fn go_idle(&mut self, entity: &str) {
        let Some(s) = self.streams.get_mut(entity) else { return };
        if s.idle_since.is_some() {
            return;
        }
        if let Some(at) = s.retry_at.take() {
            self.retries.remove(&(at, entity.to_string()));
        }
        self.idle_count += 1;
        s.idle_since = Some(self.idle_count);
        self.idle.insert(self.idle_count, entity.to_string());
    }

    /// Wakes the oldest offer waiting for a stream, if there is room for one.
    fn wake_parked(&mut self, out: &mut Vec<ProducerAction>) {
        if self.room_for_a_stream()
            && let Some(waiter) = self.parked.pop_front()
        {
            out.push(ProducerAction::Wake { waiter, entity: None });
        }
    }
}

mod deletions;
mod stream;
#[cfg(test)]
mod tests;
