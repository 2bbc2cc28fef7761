//! Reliable delivery in the simulation, the entities' side and what the run checks.
//!
//! An entity admits each delivery by its marks ([`ConsumerMarks`], as the entity runner does):
//! a plain entity keeps them for its incarnation and answers once it handled the message; a
//! durable entity keeps them in its stored state, writes them with the counter the message
//! increments, and answers once that write is acknowledged. What it does not handle it
//! answers at once ([`crate::sharding::delivery::Admission::answer`]). With deferred confirms,
//! an entity holds some confirmations back ([`ConsumerMarks::defer`]) and gives or lets go of
//! each later, as a handler holding a `DeferredConfirm` does; a durable entity writes the
//! message's effect with its confirmation.
//!
//! **Checked**, on every seed:
//! - **nothing confirmed unhandled**: a message its producer counts confirmed was handled (a
//!   durable entity: its effect acknowledged by a majority);
//! - **in order**: an entity handles (a durable one: writes the effect of) message `n` of a
//!   stream only once every earlier one was, and an incarnation never goes back in a stream;
//! - **exactly once** for durable entities: no message's effect is acknowledged twice;
//! - **nothing stored is lost**: after recovery every stored message is confirmed — with a
//!   durable queue all of them; without, those of producers still running (a producer's
//!   in-memory queue ends with its node).

use super::producer::Flight;
use super::*;
use crate::sharding::delivery::{Admission, ConsumerMarks, DeliveryHeader, DeliveryOutcome};
use crate::sharding::producer::core::SendResult;

/// One stored message.
struct StoredMessage {
    /// The producer incarnation that stored it.
    incarnation: u64,
    entity: String,
    message: u64,
    confirmed: bool,
}

/// An entity incarnation: its shard's epoch and its number there (numbers start again in
/// every allocation of the shard, so a node may run two incarnations 1 of one entity).
type Incarnation = (u64, u64);

/// Where an incarnation is in a stream: (entity, node, incarnation, producer, stream).
type IncarnationStream = (String, UniqueAddress, Incarnation, String, u64);

/// The run's record of reliable deliveries.
#[derive(Default)]
pub(super) struct DeliveryLedger {
    /// (producer, stream, seq) → the stored message.
    stored: BTreeMap<(String, u64, u64), StoredMessage>,
    /// Plain entities: (producer, stream) → the numbers handled, and the longest run from 1
    /// among them.
    handled: BTreeMap<(String, u64), (BTreeSet<u64>, u64)>,
    /// The last number each incarnation handled in each stream.
    last: BTreeMap<IncarnationStream, u64>,
    /// Durable entities: (producer, stream) → the next number expected by the marks of the
    /// acknowledged writes: every message before it has its effect in an acknowledged value.
    durable_through: BTreeMap<(String, u64), u64>,
}

impl DeliveryLedger {
    pub(super) fn stored(
        &mut self,
        producer: &str,
        incarnation: u64,
        stream: u64,
        seq: u64,
        entity: String,
        message: u64,
    ) {
        let m = StoredMessage { incarnation, entity, message, confirmed: false };
        self.stored.insert((producer.to_string(), stream, seq), m);
    }

    /// The producer counts message `seq` of `stream` confirmed: a violation if no entity
    /// handled it (a durable one: if no acknowledged write carries its effect).
    pub(super) fn confirmed(&mut self, producer: &str, stream: u64, seq: u64, durable: bool) -> Option<String> {
        let key = (producer.to_string(), stream, seq);
        if let Some(m) = self.stored.get_mut(&key) {
            m.confirmed = true;
        }
        let stream_key = (producer.to_string(), stream);
        let handled = if durable {
            self.durable_through.get(&stream_key).is_some_and(|expected| seq < *expected)
        } else {
            self.handled.get(&stream_key).is_some_and(|(set, _)| set.contains(&seq))
        };
        (!handled).then(|| {
            let what = if durable { "no acknowledged write carries its effect" } else { "no entity handled it" };
            format!("producer {producer}: message {seq} of stream {stream} confirmed, but {what}")
        })
    }

    /// A plain entity's incarnation `at` handles message `seq` of its stream: violations when
    /// an earlier one was never handled, or the incarnation goes back in the stream.
    fn handled(&mut self, at: IncarnationStream, seq: u64) -> Vec<String> {
        let mut v = Vec::new();
        let (set, run) = self.handled.entry((at.3.clone(), at.4)).or_default();
        if seq > *run + 1 {
            v.push(format!("{} handled message {seq} of {}'s stream {} before {} was", at.0, at.3, at.4, *run + 1));
        }
        set.insert(seq);
        while set.contains(&(*run + 1)) {
            *run += 1;
        }
        v.extend(self.in_order(at, seq));
        v
    }

    /// A violation when incarnation `at` handled `seq` after a later (or the same) number of
    /// its stream.
    fn in_order(&mut self, at: IncarnationStream, seq: u64) -> Option<String> {
        let last = self.last.insert(at.clone(), seq).filter(|last| *last >= seq)?;
        Some(format!(
            "{} on {} (incarnation {:?}) handled message {seq} of stream {} after {last}",
            at.0, at.1, at.2, at.4
        ))
    }

    /// Incarnation `at` let go the hold of message `seq` unconfirmed: it handles `seq` again
    /// next (not a step back).
    fn let_go(&mut self, at: IncarnationStream, seq: u64) {
        if let Some(last) = self.last.get_mut(&at).filter(|last| **last == seq) {
            *last = seq - 1;
        }
    }

    /// A durable entity's write carrying `marks` was acknowledged; `handled`: the message
    /// whose effect it wrote, by incarnation `at`. Violations: an effect written again after
    /// an acknowledged value carried it, or out of order in the incarnation.
    fn durable_write(
        &mut self,
        marks: &[(String, u64, u64)],
        handled: Option<(IncarnationStream, u64)>,
    ) -> Vec<String> {
        let mut v = Vec::new();
        if let Some((at, seq)) = handled {
            let through = self.durable_through.get(&(at.3.clone(), at.4)).copied().unwrap_or(0);
            if through > seq {
                v.push(format!(
                    "{}: the effect of message {seq} of {}'s stream {} written again after a value with every message before {through} was acknowledged",
                    at.0, at.3, at.4
                ));
            }
            v.extend(self.in_order(at, seq));
        }
        for (producer, stream, expected) in marks {
            let through = self.durable_through.entry((producer.clone(), *stream)).or_default();
            *through = (*through).max(*expected);
        }
        v
    }

    /// After recovery: the stored messages never confirmed that must have been (all with a
    /// durable queue; those of producer incarnations still running without), and how many
    /// ended with their producer.
    fn unconfirmed(&self, durable_queue: bool, running: &BTreeSet<u64>) -> (Vec<String>, usize) {
        let mut lost = Vec::new();
        let mut ended = 0;
        for ((producer, stream, seq), m) in self.stored.iter().filter(|(_, m)| !m.confirmed) {
            if durable_queue || running.contains(&m.incarnation) {
                lost.push(format!("{producer}'s message {} to {} (seq {seq} of stream {stream})", m.message, m.entity));
            } else {
                ended += 1;
            }
        }
        (lost, ended)
    }
}

/// A confirmation held back: by which incarnation, where its answer goes (the newest copy of
/// the message), and which message it is (producer, stream, seq).
pub(super) struct Held {
    pub incarnation: u64,
    /// Its shard's epoch (with `incarnation`, the incarnation's identity).
    pub epoch: u64,
    pub flight: u64,
    pub delivery: (String, u64, u64),
}

/// What a durable entity does with a delivery ([`Sim::admit_durable`]).
pub(super) enum DurableAdmission {
    /// Handle it: the message's (producer, stream, seq).
    Handle((String, u64, u64)),
    /// Answer at once.
    Answer(DeliveryOutcome),
    /// Write the marks back, then answer.
    Settle(DeliveryOutcome),
    /// The held message sent again: the hold `u64` answers it from now on; the copy it
    /// answered before gets the outcome.
    Redirect(u64, DeliveryOutcome),
}

impl Sim {
    /// The header of delivery `flight`.
    fn delivery_header(&self, flight: u64) -> Option<DeliveryHeader> {
        self.producers.flights.get(&flight).map(|f| f.header.clone())
    }

    /// A delivery reached plain entity `entity_id` on node `i`: admitted by its incarnation's
    /// marks, handled at once (the simulated handler does nothing else) or answered.
    pub(super) fn deliver_plain(&mut self, i: usize, entity_id: &str, flight: u64) {
        let Some(header) = self.delivery_header(flight) else { return };
        let nonce = self.rng.random();
        let node = self.nodes[i].as_mut().expect("running");
        let me = node.addr.clone();
        let Some((shard, incarnation)) = node.entities.get(entity_id).cloned() else { return };
        let epoch = node.shards.get(&shard).map_or(0, |(_, epoch)| *epoch);
        let marks = match node.plain_marks.entry(entity_id.to_string()) {
            std::collections::btree_map::Entry::Occupied(mut e) => {
                if e.get().0 != (epoch, incarnation) {
                    e.insert(((epoch, incarnation), ConsumerMarks::new(nonce)));
                }
                &mut e.into_mut().1
            }
            std::collections::btree_map::Entry::Vacant(e) => {
                &mut e.insert(((epoch, incarnation), ConsumerMarks::new(nonce))).1
            }
        };
        let admission = marks.admit(&header);
        let nonce = marks.nonce();
        let (producer, stream, seq) = (header.producer.to_string(), header.stream, header.seq);
        let mut to = flight;
        match admission {
            Admission::Handle => {
                let at = (entity_id.to_string(), me.clone(), (epoch, incarnation), producer.clone(), stream);
                let v = self.delivery_ledger.handled(at, seq);
                self.violations_at_now(v);
                let held = self.hold_back(i, entity_id, &(producer.clone(), stream, seq));
                self.trace(|| format!("{me} {entity_id}#{incarnation} handles {producer}'s {stream}/{seq} (flight {flight}, held {held:?})"));
                if let Some(token) = held {
                    self.keep_hold(
                        i,
                        entity_id,
                        token,
                        Held { incarnation, epoch, flight, delivery: (producer, stream, seq) },
                    );
                    return;
                }
            }
            Admission::Redirect { token, .. } => to = self.redirect_hold(i, entity_id, token, flight),
            _ => {}
        }
        let outcome = admission.answer(nonce).unwrap_or(DeliveryOutcome::Confirmed { handled: true, nonce });
        self.answer_delivery(&me, to, SendResult::Answered(outcome));
    }

    /// Whether the handler of `delivery`, just admitted on node `i`, holds its confirmation
    /// back (one in five, with deferred confirms): the hold's token, the marks holding it.
    pub(super) fn hold_back(&mut self, i: usize, entity_id: &str, delivery: &(String, u64, u64)) -> Option<u64> {
        if !self.cfg.deferred_confirms || self.rng.random_range(0..5) != 0 {
            return None;
        }
        let durable = self.cfg.durable;
        let node = self.nodes[i].as_mut()?;
        node.next_hold += 1;
        let token = node.next_hold;
        let marks = match durable {
            true => &mut node.states.get_mut(entity_id)?.marks,
            false => &mut node.plain_marks.get_mut(entity_id)?.1,
        };
        let (producer, stream, seq) = delivery;
        marks.defer(producer, *stream, *seq, token).then_some(token)
    }

    /// Keeps a hold on node `i` and schedules its end: given (four in five) or let go, 0.1–3 s
    /// later.
    pub(super) fn keep_hold(&mut self, i: usize, entity_id: &str, token: u64, held: Held) {
        let (delay, give) = (self.rng.random_range(100..3000), self.rng.random_range(0..5) != 0);
        let Some(node) = self.nodes[i].as_mut() else { return };
        let (me, incarnation) = (node.addr.clone(), held.incarnation);
        node.held.insert((entity_id.to_string(), token), held);
        let entity_id = entity_id.to_string();
        self.schedule(delay, Event::HoldEnds { node: me, entity_id, incarnation, token, give });
    }

    /// The held message came again as `flight`: the hold answers it from now on; returns the
    /// flight to answer as pending (the one it answered before, or `flight` with no hold).
    pub(super) fn redirect_hold(&mut self, i: usize, entity_id: &str, token: u64, flight: u64) -> u64 {
        let held = self.nodes[i].as_mut().and_then(|n| n.held.get_mut(&(entity_id.to_string(), token)));
        held.map_or(flight, |h| std::mem::replace(&mut h.flight, flight))
    }

    /// A hold ends: given, the message is confirmed (a durable entity writes its effect with
    /// the confirmation first); let go, it is handled again when it comes again.
    pub(super) fn on_hold_ends(
        &mut self,
        node: UniqueAddress,
        entity_id: String,
        incarnation: u64,
        token: u64,
        give: bool,
    ) {
        self.trace(|| format!("{node} {entity_id}#{incarnation} hold {token} ends, given: {give}"));
        let Some(i) = self.slot_of(&node) else { return };
        let Some(n) = self.nodes[i].as_mut() else { return };
        let key = (entity_id.clone(), token);
        if n.held.get(&key).is_none_or(|h| h.incarnation != incarnation) {
            return;
        }
        match give {
            true => self.report.holds_given += 1,
            false => self.report.holds_let_go += 1,
        }
        if self.cfg.durable {
            if let Some(a) = n.states.get_mut(&entity_id) {
                a.confirms.push_back((token, give));
                self.pump(i, &entity_id);
            }
            return;
        }
        let epoch = n.held.get(&key).map_or(0, |h| h.epoch);
        let Some((_, marks)) = n.plain_marks.get_mut(&entity_id).filter(|(inc, _)| *inc == (epoch, incarnation)) else {
            return;
        };
        let held = n.held.remove(&key).expect("seen above");
        let result = if give {
            marks.confirm(token);
            SendResult::Answered(DeliveryOutcome::Confirmed { handled: true, nonce: marks.nonce() })
        } else {
            marks.abandon(token);
            let (producer, stream, seq) = held.delivery;
            self.delivery_ledger.let_go((entity_id, node.clone(), (epoch, incarnation), producer, stream), seq);
            SendResult::Failed("its deferred confirm was dropped".into())
        };
        self.answer_delivery(&node, held.flight, result);
    }

    /// Entity `entity_id` on `node` ended: what it held is answered as not delivered.
    pub(super) fn end_holds(&mut self, entity_id: &str, node: &UniqueAddress) {
        let Some(n) = self.slot_of(node).and_then(|i| self.nodes[i].as_mut()) else { return };
        let keys: Vec<(String, u64)> = n
            .held
            .range((entity_id.to_string(), 0)..=(entity_id.to_string(), u64::MAX))
            .map(|(k, _)| k.clone())
            .collect();
        let flights: Vec<u64> = keys.iter().filter_map(|k| n.held.remove(k)).map(|h| h.flight).collect();
        for flight in flights {
            self.answer_delivery(
                node,
                flight,
                SendResult::Failed("its incarnation ended with its confirm held".into()),
            );
        }
    }

    /// A durable entity's admission of delivery `flight` by `marks` (`None`: a delivery the
    /// run has no record of).
    pub(super) fn admit_durable(&mut self, flight: u64, marks: &mut ConsumerMarks) -> Option<DurableAdmission> {
        let header = self.delivery_header(flight)?;
        let admission = marks.admit(&header);
        Some(match (admission.answer(marks.nonce()), admission) {
            (None, _) => DurableAdmission::Handle((header.producer.to_string(), header.stream, header.seq)),
            (Some(outcome), _) if marks.must_settle(&header, admission) => DurableAdmission::Settle(outcome),
            (Some(outcome), Admission::Redirect { token, .. }) => DurableAdmission::Redirect(token, outcome),
            (Some(outcome), _) => DurableAdmission::Answer(outcome),
        })
    }

    /// A durable entity's write carrying `marks` was acknowledged; it wrote the effect of
    /// `delivery` (producer, stream, seq) when it has one, for incarnation `incarnation` of
    /// `entity_id` on `node`.
    pub(super) fn durable_delivery_write(
        &mut self,
        entity_id: &str,
        node: UniqueAddress,
        incarnation: Incarnation,
        marks: &[(String, u64, u64)],
        delivery: Option<(String, u64, u64)>,
    ) {
        let handled =
            delivery.map(|(producer, stream, seq)| ((entity_id.to_string(), node, incarnation, producer, stream), seq));
        let v = self.delivery_ledger.durable_write(marks, handled);
        self.violations_at_now(v);
    }

    fn violations_at_now(&mut self, v: Vec<String>) {
        let now = self.now_ms;
        self.report.violations.extend(v.into_iter().map(|v| format!("t={now} {v}")));
    }

    /// Sends delivery `flight`'s outcome from node `from` to its producer's node.
    pub(super) fn answer_delivery(&mut self, from: &UniqueAddress, flight: u64, result: SendResult) {
        let host = self.producers.flights.get(&flight).and_then(|f: &Flight| self.producers_host(f.producer));
        if let Some(host) = host {
            self.send(from, &host, Wire::Outcome { flight, result });
        }
    }

    /// A delivery failed where it was (a drop, a failed write): its producer hears so.
    pub(super) fn fail_delivery(&mut self, flight: u64, why: &'static str) {
        let Some(host) = self.producers.flights.get(&flight).and_then(|f| self.producers_host(f.producer)) else {
            return;
        };
        self.send(&host.clone(), &host, Wire::Outcome { flight, result: SendResult::Failed(why.to_string()) });
    }

    /// After recovery, every stored message the promise covers is confirmed.
    pub(super) fn check_no_stored_message_lost(&mut self) {
        let running = self.running_producers();
        let (lost, ended) = self.delivery_ledger.unconfirmed(self.cfg.durable_queue, &running);
        self.report.deliveries_stored = self.delivery_ledger.stored.len();
        self.report.deliveries_ended_with_producer = ended;
        if !lost.is_empty() {
            let first: Vec<&str> = lost.iter().take(5).map(String::as_str).collect();
            self.report.violations.push(format!(
                "{} stored messages never confirmed, first: {}",
                lost.len(),
                first.join("; ")
            ));
        }
    }
}
