//! Reliable delivery in the simulation, the entities' side and what the run checks.
//!
//! An entity admits each delivery by its marks ([`ConsumerMarks`], as the entity runner does):
//! a plain entity keeps them for its incarnation and answers once it handled the message; a
//! durable entity keeps them in its stored state, writes them with the counter the message
//! increments, and answers once that write is acknowledged. What it does not handle it
//! answers at once ([`crate::sharding::delivery::Admission::answer`]).
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

/// Where an incarnation is in a stream: (entity, node, incarnation, producer, stream).
type IncarnationStream = (String, UniqueAddress, u64, String, u64);

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
            "{} on {} (incarnation {}) handled message {seq} of stream {} after {last}",
            at.0, at.1, at.2, at.4
        ))
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

/// What a durable entity does with a delivery ([`Sim::admit_durable`]).
pub(super) enum DurableAdmission {
    /// Handle it: the message's (producer, stream, seq).
    Handle((String, u64, u64)),
    /// Answer at once.
    Answer(DeliveryOutcome),
    /// Write the marks back, then answer.
    Settle(DeliveryOutcome),
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
        let Some((_, incarnation)) = node.entities.get(entity_id).cloned() else { return };
        let marks = match node.plain_marks.entry(entity_id.to_string()) {
            std::collections::btree_map::Entry::Occupied(mut e) => {
                if e.get().0 != incarnation {
                    e.insert((incarnation, ConsumerMarks::new(nonce)));
                }
                &mut e.into_mut().1
            }
            std::collections::btree_map::Entry::Vacant(e) => &mut e.insert((incarnation, ConsumerMarks::new(nonce))).1,
        };
        let admission = marks.admit(&header);
        let nonce = marks.nonce();
        if admission == Admission::Handle {
            let at = (entity_id.to_string(), me.clone(), incarnation, header.producer.to_string(), header.stream);
            let v = self.delivery_ledger.handled(at, header.seq);
            self.violations_at_now(v);
        }
        let outcome = admission.answer(nonce).unwrap_or(DeliveryOutcome::Confirmed { handled: true, nonce });
        self.answer_delivery(&me, flight, SendResult::Answered(outcome));
    }

    /// A durable entity's admission of delivery `flight` by `marks` (`None`: a delivery the
    /// run has no record of).
    pub(super) fn admit_durable(&mut self, flight: u64, marks: &mut ConsumerMarks) -> Option<DurableAdmission> {
        let header = self.delivery_header(flight)?;
        let admission = marks.admit(&header);
        Some(match admission.answer(marks.nonce()) {
            None => DurableAdmission::Handle((header.producer.to_string(), header.stream, header.seq)),
            Some(outcome) if marks.must_settle(&header, admission) => DurableAdmission::Settle(outcome),
            Some(outcome) => DurableAdmission::Answer(outcome),
        })
    }

    /// A durable entity's write carrying `marks` was acknowledged; it wrote the effect of
    /// `delivery` (producer, stream, seq) when it has one, for incarnation `incarnation` of
    /// `entity_id` on `node`.
    pub(super) fn durable_delivery_write(
        &mut self,
        entity_id: &str,
        node: UniqueAddress,
        incarnation: u64,
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
