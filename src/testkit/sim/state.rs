//! Durable entity state in the simulation, performed as the region's state I/O does
//! (`sharding/shard/state.rs`): a new shard claims its state slots at its allocation epoch with
//! one read whose replicas store the claim before they answer (tried 3 times, then the shard
//! fails and restarts after its backoff; a newer fence stops the shard and asks for its home
//! again); an entity reads its state from this node's replica when it starts; each message
//! increments the entity's counter and writes it under the shard's epoch at a majority before
//! the ask is answered (tried 3 times; then the incarnation ends and the next one reads the
//! stored state; a write refused by a fence stops the shard).
//!
//! The properties it adds, over every write a majority acknowledged (whether or not its reply
//! still reached the asker):
//! - **no acknowledged write is lost**: no counter value is acknowledged twice (a second
//!   incarnation would have to start from a state older than an acknowledged write), an entity
//!   starting after a claim reads at least every value acknowledged before that claim began,
//!   and the last value answered after recovery is the largest ever acknowledged;
//! - **a fenced epoch never writes**: no write of epoch `e` issued after a claim of a newer
//!   epoch of its shard completed is acknowledged.

use super::*;
use crate::sharding::delivery::ConsumerMarks;
use crate::sharding::durable::{split_stored, with_marks};
use crate::sharding::ids::remembered_slot;
use crate::sharding::shard::batch::{self, BatchAction, StateBatch, StateOutcome, StateRequest, StateResult};
use crate::sharding::shard::state::{ClaimOutcome, claim_outcome};

/// Why an ask to a durable entity failed; typed errors in the real drivers.
pub(super) const FENCED: &str = "Fenced";
pub(super) const NOT_PERSISTED: &str = "StateNotPersisted";

fn state_key(cfg: &SimConfig, shard: &str, entity_id: &str) -> String {
    keys::entity_states(TYPE, shard, remembered_slot(entity_id, settings(cfg).state.slots))
}

/// A stored counter with the entity's marks of reliable deliveries (as a durable entity
/// stores them: `None`, a violation, when they do not encode).
fn stored_form(value: u64, marks: &ConsumerMarks) -> Option<Vec<u8>> {
    let counter = value.to_le_bytes();
    if marks.is_empty() {
        return Some(counter.to_vec());
    }
    with_marks(Some(&counter), marks).ok().map(|b| b.to_vec())
}

/// The counter and marks of a stored value; `None` when it does not read as one.
fn read_stored(stored: &[u8]) -> Option<(u64, ConsumerMarks)> {
    let (counter, marks) = split_stored(stored).ok()?;
    let counter = match counter {
        Some(bytes) => u64::from_le_bytes(<[u8; 8]>::try_from(&*bytes).ok()?),
        None => 0,
    };
    Some((counter, marks))
}

/// One running durable entity: its counter and the message it is writing for.
#[derive(Debug)]
pub(super) struct Activation {
    shard: ShardId,
    incarnation: u64,
    /// The shard's epoch when the entity started: its writes carry it.
    epoch: u64,
    value: u64,
    /// Its marks of reliable deliveries (stored with its counter).
    pub(super) marks: ConsumerMarks,
    /// The message whose write is in flight.
    writing: Option<Msg>,
    queue: VecDeque<Msg>,
    /// Told to stop: it ends once its queue is written.
    stopping: bool,
    /// Holds that ended (given or let go), by token, to apply before its next message.
    pub(super) confirms: VecDeque<(u64, bool)>,
}

impl Activation {
    /// Starts the write of `msg` (its effect, one more on the counter, unless it only settles
    /// the marks) with the marks as they are; returns its shard and the write.
    fn start_write(
        &mut self,
        entity_id: &str,
        issued_ms: u64,
        msg: Msg,
        delivery: Option<(String, u64, u64)>,
        settle: Option<crate::sharding::delivery::DeliveryOutcome>,
    ) -> (ShardId, EntityWrite) {
        if settle.is_none() {
            self.value += 1;
        }
        self.writing = Some(msg);
        let w = EntityWrite {
            entity_id: entity_id.to_string(),
            incarnation: self.incarnation,
            epoch: self.epoch,
            value: self.value,
            issued_ms,
            delivery,
            settle,
            marks: self.marks.streams().map(|(p, s, e)| (p.to_string(), s, e)).collect(),
        };
        (self.shard.clone(), w)
    }
}

/// A claim in flight: the shard instance, its epoch and its try.
#[derive(Debug, Clone)]
pub(super) struct Claim {
    pub shard: ShardId,
    pub instance: u64,
    pub epoch: u64,
    pub attempt: u32,
    started_ms: u64,
}

/// One entity write in flight.
#[derive(Debug, Clone)]
pub(super) struct EntityWrite {
    entity_id: String,
    incarnation: u64,
    epoch: u64,
    value: u64,
    issued_ms: u64,
    /// The reliable delivery whose effect it writes: (producer, stream, seq).
    delivery: Option<(String, u64, u64)>,
    /// It settles the marks (the value unchanged): the answer it then sends.
    settle: Option<crate::sharding::delivery::DeliveryOutcome>,
    /// The marks it carries: (producer, stream, next expected).
    marks: Vec<(String, u64, u64)>,
}

/// The run's record of durable writes.
#[derive(Debug, Default)]
pub(super) struct StateLedger {
    /// Entity → acknowledged value → when its ack came.
    acked: BTreeMap<String, BTreeMap<u64, u64>>,
    /// Shard → (when, epoch) of every completed claim.
    claims: BTreeMap<ShardId, Vec<(u64, u64)>>,
    /// Entity → the value answered to its ask after recovery.
    /// (when its write was acknowledged, so a later message's write is not held against it).
    final_values: BTreeMap<String, (u64, u64)>,
    /// (entity, value) → who acknowledged it first, when, and the membership it counted: the
    /// evidence a violation names.
    ack_evidence: BTreeMap<(String, u64), String>,
    /// Shard → its latest completed claim: who, when, and the replicas it read.
    claim_evidence: BTreeMap<ShardId, String>,
}

impl Sim {
    /// A new durable shard on node `i`: the core (waiting for its load), then the claim.
    pub(super) fn start_durable_shard(&mut self, i: usize, shard: &ShardId, epoch: u64) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let core = crate::sharding::shard::new_shard_core(&s, true, PolicySettings::idle(None));
        node.shards.insert(shard.clone(), (core, epoch));
        node.next_write += 1;
        let instance = node.next_write;
        node.shard_instances.insert(shard.clone(), instance);
        let claim = Claim { shard: shard.clone(), instance, epoch, attempt: 0, started_ms: self.now_ms };
        self.claim_states(i, claim);
    }

    fn claim_states(&mut self, i: usize, claim: Claim) {
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let epoch = claim.epoch;
        let s = settings(&self.cfg);
        let updates =
            crate::sharding::shard::state::claim_updates(&keys::state_space(TYPE), &claim.shard, s.state.slots, epoch);
        let updates = updates.into_iter().map(crate::ddata::KeyUpdate::into_parts).collect();
        let input = ReplicatorInput::UpdateAndGetMany {
            updates,
            consistency: batch::state_read_consistency(&s),
            timeout: s.coordinator.waiting_for_state_timeout,
            reply: RepReply::StateClaim(claim),
        };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    pub(super) fn on_states_claimed(
        &mut self,
        i: usize,
        claim: Claim,
        result: crate::Result<Vec<Option<ReplicatedData>>>,
    ) {
        if !self.is_current(i, &claim.shard, claim.instance) {
            return;
        }
        let read = self.typed_slots(&keys::state_space(TYPE), &claim.shard, result);
        let tries = claim.attempt as usize + 1;
        let me = self.nodes[i].as_ref().expect("running").addr.clone();
        match claim_outcome(&keys::state_space(TYPE), &claim.shard, claim.epoch, tries, read) {
            ClaimOutcome::Claimed { .. } => {
                self.trace(|| format!("{me} shard {} claims its states at epoch {}", claim.shard, claim.epoch));
                self.ledger.claims.entry(claim.shard.clone()).or_default().push((self.now_ms, claim.epoch));
                let evidence = format!(
                    "claimed at t={} (epoch {}) by {me}, reading every reachable replica of its view [{}]",
                    self.now_ms,
                    claim.epoch,
                    self.view_summary(i)
                );
                self.ledger.claim_evidence.insert(claim.shard.clone(), evidence);
                self.node_claims_started(i).insert(claim.shard.clone(), claim.started_ms);
                if self.cfg.remember {
                    self.load_remembered(i, &claim.shard, claim.instance, 1);
                } else {
                    self.shard_input(i, &claim.shard, ShardInput::Loaded(BTreeSet::new()));
                }
            }
            ClaimOutcome::Again => self.claim_states(i, Claim { attempt: claim.attempt + 1, ..claim }),
            ClaimOutcome::Failed(crate::Error::Fenced { fence, .. }) => {
                self.trace(|| {
                    format!("{me} shard {} epoch {} fenced by {fence} at its claim", claim.shard, claim.epoch)
                });
                self.shard_fenced(i, &claim.shard, claim.epoch);
            }
            ClaimOutcome::Failed(e) => {
                self.trace(|| format!("{me} shard {} cannot claim its states: {e}", claim.shard));
                self.shard_input(i, &claim.shard, ShardInput::StoreFailed)
            }
        }
    }

    /// A claim's read of `owner`'s slots in `space`, typed as the state I/O reads them: a
    /// value of another type is an error.
    pub(super) fn typed_slots(
        &self,
        space: &str,
        owner: &str,
        result: crate::Result<Vec<Option<ReplicatedData>>>,
    ) -> crate::Result<Vec<Option<crate::ddata::FencedMap>>> {
        let slots = settings(&self.cfg).state.slots;
        result.and_then(|values| {
            let keys = (0..slots).map(|slot| keys::slot_key(space, owner, slot));
            values
                .into_iter()
                .zip(keys)
                .map(|(d, key)| {
                    d.map(|d| <crate::ddata::FencedMap as crate::ddata::Crdt>::from_data(d, &key)).transpose()
                })
                .collect::<crate::Result<Vec<_>>>()
        })
    }

    fn node_claims_started(&mut self, i: usize) -> &mut BTreeMap<ShardId, u64> {
        &mut self.nodes[i].as_mut().expect("running").claims_started
    }

    /// A newer allocation owns the shard's states: the region stops the shard and asks for its
    /// home again.
    fn shard_fenced(&mut self, i: usize, shard: &ShardId, epoch: u64) {
        let now = self.now();
        let Some(node) = self.nodes[i].as_mut() else { return };
        let mut out = Vec::new();
        node.region.handle(RegionInput::LocalShardFenced { shard: shard.clone(), epoch }, now, &mut out);
        self.perform_region(i, out);
    }

    /// A durable entity starts: its state is read from this node's replica.
    pub(super) fn start_durable_entity(&mut self, i: usize, shard: &ShardId, entity_id: &str, incarnation: u64) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let epoch = node.shards.get(shard).map_or(0, |(_, e)| *e);
        let stored = match node.replicator.local_value(&state_key(&self.cfg, shard, entity_id)) {
            Some(ReplicatedData::FencedMap(m)) => m.get(entity_id).map(<[u8]>::to_vec),
            _ => None,
        };
        let (value, mut marks) = match stored.as_deref().map(read_stored) {
            None => (0, ConsumerMarks::default()),
            Some(Some(read)) => read,
            Some(None) => {
                self.report.violations.push(format!("{entity_id}: a stored state that does not read"));
                (0, ConsumerMarks::default())
            }
        };
        // Reliable runs only: other runs keep the random stream (and so the seeds) they had.
        if self.cfg.reliable {
            marks.begin_incarnation(self.rng.random());
        }
        let node = self.nodes[i].as_mut().expect("running");
        let claimed_ms = node.claims_started.get(shard).copied();
        let activation = Activation {
            shard: shard.clone(),
            incarnation,
            epoch,
            value,
            marks,
            writing: None,
            queue: VecDeque::new(),
            stopping: false,
            confirms: VecDeque::new(),
        };
        node.states.insert(entity_id.to_string(), activation);
        // Every value acknowledged before this shard's claim began is in what it read.
        if let Some(claimed_ms) = claimed_ms {
            let before = self
                .ledger
                .acked
                .get(entity_id)
                .and_then(|acks| acks.iter().filter(|(_, at)| **at < claimed_ms).map(|(v, _)| *v).max());
            if let Some(acked) = before.filter(|acked| *acked > value) {
                let v = format!(
                    "t={} {entity_id} started with {value} though {acked} was acknowledged before its shard's claim",
                    self.now_ms
                );
                self.report.violations.push(v);
            }
        }
    }

    /// A message for a running durable entity: handled in order, one write at a time.
    pub(super) fn deliver_durable(&mut self, i: usize, entity_id: &str, msg: Msg) {
        let Some(a) = self.nodes[i].as_mut().and_then(|n| n.states.get_mut(entity_id)) else {
            self.fail(msg, NOT_HOSTED);
            return;
        };
        if msg.ask.is_none() && msg.delivery.is_none() {
            return; // a start-only message (remembered recovery): the start was all it asked
        }
        a.queue.push_back(msg);
        self.pump(i, entity_id);
    }

    /// Handles the entity's next queued message unless a write is in flight (a reliable
    /// delivery it does not handle is answered at once); ends a stopping entity whose queue is
    /// done.
    pub(super) fn pump(&mut self, i: usize, entity_id: &str) {
        if self.pump_holds(i, entity_id) {
            return;
        }
        let (delivery, settle) = loop {
            let Some(a) = self.nodes[i].as_mut().and_then(|n| n.states.get_mut(entity_id)) else { return };
            if a.writing.is_some() {
                return;
            }
            let Some(flight) = a.queue.front().and_then(|m| m.delivery) else { break (None, None) };
            let mut marks = std::mem::take(&mut a.marks);
            let admission = self.admit_durable(flight, &mut marks);
            let node = self.nodes[i].as_mut().expect("running");
            let me = node.addr.clone();
            let a = node.states.get_mut(entity_id).expect("seen above");
            a.marks = marks;
            match admission {
                Some(delivery::DurableAdmission::Handle(d)) => {
                    let Some(token) = self.hold_back(i, entity_id, &d) else { break (Some(d), None) };
                    // Handled, its confirmation held: its effect is written when it is given.
                    let a = self.nodes[i].as_mut().and_then(|n| n.states.get_mut(entity_id)).expect("seen above");
                    a.queue.pop_front();
                    let held = delivery::Held { incarnation: a.incarnation, epoch: a.epoch, flight, delivery: d };
                    self.keep_hold(i, entity_id, token, held);
                }
                Some(delivery::DurableAdmission::Redirect(token, outcome)) => {
                    a.queue.pop_front();
                    let to = self.redirect_hold(i, entity_id, token, flight);
                    self.answer_delivery(&me, to, crate::sharding::producer::core::SendResult::Answered(outcome));
                }
                Some(delivery::DurableAdmission::Settle(outcome)) => break (None, Some(outcome)),
                Some(delivery::DurableAdmission::Answer(outcome)) => {
                    a.queue.pop_front();
                    let result = crate::sharding::producer::core::SendResult::Answered(outcome);
                    self.answer_delivery(&me, flight, result);
                }
                None => {
                    a.queue.pop_front();
                }
            }
        };
        let Some(node) = self.nodes[i].as_mut() else { return };
        let me = node.addr.clone();
        let Some(a) = node.states.get_mut(entity_id) else { return };
        let Some(msg) = a.queue.pop_front() else {
            if a.stopping {
                let (shard, incarnation) = (a.shard.clone(), a.incarnation);
                let entity_id = entity_id.to_string();
                self.schedule(1, Event::Terminated { node: me, shard, entity_id, incarnation });
            }
            return;
        };
        let (shard, w) = a.start_write(entity_id, self.now_ms, msg, delivery, settle);
        self.write_state(i, &shard, w);
    }

    /// Applies the holds that ended to the entity's marks, unless a write is in flight: one
    /// let go is answered as not delivered; one given writes the message's effect with the
    /// marks it moved on, answered confirmed once acknowledged. True when a write started.
    fn pump_holds(&mut self, i: usize, entity_id: &str) -> bool {
        loop {
            let Some(node) = self.nodes[i].as_mut() else { return false };
            let me = node.addr.clone();
            let Some(a) = node.states.get_mut(entity_id).filter(|a| a.writing.is_none()) else { return false };
            let Some((token, give)) = a.confirms.pop_front() else { return false };
            let Some(held) = node.held.remove(&(entity_id.to_string(), token)) else { continue };
            if !give {
                a.marks.abandon(token);
                let result =
                    crate::sharding::producer::core::SendResult::Failed("its deferred confirm was dropped".into());
                self.answer_delivery(&me, held.flight, result);
                continue;
            }
            a.marks.confirm(token);
            let msg = Msg { ask: None, delivery: Some(held.flight) };
            let (shard, w) = a.start_write(entity_id, self.now_ms, msg, Some(held.delivery), None);
            self.write_state(i, &shard, w);
            return true;
        }
    }

    /// Writes `w` as the region's state writer does: one [`StateBatch`] (here of one entity's
    /// write), one multi-key update per try.
    fn write_state(&mut self, i: usize, shard: &ShardId, w: EntityWrite) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let id = node.next_write;
        node.next_write += 1;
        let Some(value) = node.states.get(&w.entity_id).and_then(|a| stored_form(w.value, &a.marks)) else {
            self.report.violations.push(format!("{}: marks that do not encode", w.entity_id));
            return;
        };
        let value = Some(value);
        let request = StateRequest { shard: shard.clone(), epoch: w.epoch, entity_id: w.entity_id.clone(), value };
        let (budget, counters, mut out) = (slot_budget(), Arc::default(), Vec::new());
        let batch =
            StateBatch::start(&keys::state_space(TYPE), s.state.slots, budget, counters, vec![request], &mut out);
        node.state_batches.insert(id, (w, shard.clone(), batch));
        self.perform_state_batch(i, id, out);
    }

    /// One try of a state batch's writes (entity states or a producer's queue), as the
    /// state writer makes it: one multi-key update at the write consistency.
    pub(super) fn write_slots(&mut self, i: usize, updates: Vec<crate::ddata::KeyUpdate>, reply: RepReply) {
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let input = ReplicatorInput::UpdateMany {
            updates: updates.into_iter().map(crate::ddata::KeyUpdate::into_parts).collect(),
            consistency: batch::state_write_consistency(&s),
            timeout: batch::write_timeout(&s),
            reply,
        };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    fn perform_state_batch(&mut self, i: usize, id: u64, actions: Vec<BatchAction<StateOutcome>>) {
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            match action {
                BatchAction::Write(updates) => self.write_slots(i, updates, RepReply::EntityWrite(id)),
                BatchAction::Done(outcome) => {
                    let Some((w, shard, _)) = node.state_batches.remove(&id) else { return };
                    let reason = || StateResult::NotPersisted { reason: "no outcome".into() };
                    let result = outcome.results.into_iter().next().unwrap_or_else(reason);
                    self.on_state_written(i, w, &shard, result);
                }
            }
        }
    }

    /// A try of state batch `id` on node `i` ended: the keys refused by their fence, or why not.
    pub(super) fn on_state_try(
        &mut self,
        i: usize,
        id: u64,
        result: crate::Result<Vec<(String, crate::ddata::Fenced)>>,
    ) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, _, batch)) = node.state_batches.get_mut(&id) else { return };
        let mut out = Vec::new();
        batch.handle(result, &mut out);
        self.perform_state_batch(i, id, out);
    }

    fn on_state_written(&mut self, i: usize, w: EntityWrite, shard: &ShardId, result: StateResult) {
        if result == StateResult::Written {
            self.record_ack(i, &w);
        }
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some(a) = node.states.get_mut(&w.entity_id).filter(|a| a.incarnation == w.incarnation) else { return };
        match result {
            StateResult::Written => {
                let msg = a.writing.take();
                a.marks.settle();
                let nonce = a.marks.nonce();
                let me = node.addr.clone();
                if let Some(flight) = msg.and_then(|m| m.delivery) {
                    let handled = crate::sharding::delivery::DeliveryOutcome::Confirmed { handled: true, nonce };
                    let outcome = w.settle.clone().unwrap_or(handled);
                    let result = crate::sharding::producer::core::SendResult::Answered(outcome);
                    self.answer_delivery(&me, flight, result);
                }
                if let Some(ask) = msg.and_then(|m| m.ask) {
                    if self.asks.get(&ask).is_some_and(|a| a.must_answer) {
                        self.ledger.final_values.insert(w.entity_id.clone(), (w.value, self.now_ms));
                    }
                    if let Some(asker) = self.asks.get(&ask).map(|a| a.asker.clone()) {
                        self.send(&me, &asker, Wire::AskReply { ask });
                    }
                }
                self.pump(i, &w.entity_id);
            }
            StateResult::Fenced { .. } => {
                // A newer allocation claimed the state: this incarnation ends, and its shard
                // stops here.
                self.end_durable(i, &w.entity_id, FENCED);
                self.shard_fenced(i, shard, w.epoch);
            }
            StateResult::SlotFull { .. } => self.end_durable(i, &w.entity_id, SLOT_FULL),
            StateResult::NotPersisted { .. } => self.end_durable(i, &w.entity_id, NOT_PERSISTED),
        }
    }

    fn record_ack(&mut self, i: usize, w: &EntityWrite) {
        let now = self.now_ms;
        let writer = self.nodes[i].as_ref().map_or_else(|| format!("n{}", i + 1), |n| n.addr.to_string());
        let this = format!("t={now} by {writer} (epoch {}) counting its view [{}]", w.epoch, self.view_summary(i));
        // A claim of a newer epoch that completed before this write was issued fenced a
        // majority plus one: the write cannot have been accepted by a majority.
        let shard = default_shard_id(&w.entity_id, self.cfg.shards);
        if let Some((at, epoch)) = self
            .ledger
            .claims
            .get(&shard)
            .and_then(|c| c.iter().find(|(at, epoch)| *epoch > w.epoch && *at < w.issued_ms))
        {
            let v = format!(
                "t={now} {}: a write of epoch {} issued at {} was acknowledged after epoch {epoch} claimed its shard at {at}",
                w.entity_id, w.epoch, w.issued_ms
            );
            self.report.violations.push(v);
        }
        if let Some(node) = self.nodes[i].as_ref().map(|n| n.addr.clone()) {
            self.durable_delivery_write(&w.entity_id, node, (w.epoch, w.incarnation), &w.marks, w.delivery.clone());
        }
        if w.settle.is_some() {
            // The value unchanged, acknowledged again: its marks are settled.
            return;
        }
        let acks = self.ledger.acked.entry(w.entity_id.clone()).or_default();
        if acks.insert(w.value, now).is_some() {
            let key = (w.entity_id.clone(), w.value);
            let first = self.ledger.ack_evidence.get(&key).cloned().unwrap_or_default();
            let claim = self.ledger.claim_evidence.get(&shard).cloned().unwrap_or_else(|| "none".into());
            let holders = self.holders(&shard, &w.entity_id, w.value);
            let v = format!(
                "t={now} {}: value {} acknowledged twice (an acknowledged write was lost): first {first}; again {this}; \
                 the shard's latest claim: {claim}; holding {} now: [{holders}]",
                w.entity_id, w.value, w.value
            );
            self.report.violations.push(v);
        } else {
            self.ledger.ack_evidence.insert((w.entity_id.clone(), w.value), this);
        }
        self.report.states_acked += 1;
        if std::env::var_os("DDSHARD_SIM_DEBUG_ACKS").is_some() {
            let (e, v, ep, iss) = (w.entity_id.clone(), w.value, w.epoch, w.issued_ms);
            self.trace(|| format!("DEBUG ack {e} value {v} epoch {ep} issued {iss}"));
        }
    }

    /// The incarnation ends after a failed or fenced write: its message and the queued ones
    /// fail (fenced), or the queued ones go to the next incarnation (not persisted).
    fn end_durable(&mut self, i: usize, entity_id: &str, why: &'static str) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let me = node.addr.clone();
        let Some(a) = node.states.remove(entity_id) else { return };
        node.entities.remove(entity_id);
        self.end_activation(entity_id, &me);
        if let Some(msg) = a.writing {
            self.fail(msg, why);
        }
        let input =
            ShardInput::Terminated { entity_id: entity_id.to_string(), incarnation: a.incarnation, leftovers: vec![] };
        self.shard_input(i, &a.shard, input);
        for msg in a.queue {
            if why == FENCED {
                self.fail(msg, why);
            } else {
                self.shard_input(i, &a.shard, ShardInput::Deliver { entity_id: entity_id.to_string(), msg });
            }
        }
    }

    /// The shard asks the entity to stop: it finishes its queue first.
    pub(super) fn stop_durable(&mut self, i: usize, entity_id: &str) {
        if let Some(a) = self.nodes[i].as_mut().and_then(|n| n.states.get_mut(entity_id)) {
            a.stopping = true;
            self.pump(i, entity_id);
        }
    }

    /// Node `i`'s view as a violation names it: each member, its status, and whether it is
    /// unreachable.
    pub(super) fn view_summary(&self, i: usize) -> String {
        let Some(view) = self.nodes[i].as_ref().and_then(|n| n.last_view.as_ref()) else { return "no view".into() };
        let members: Vec<String> = view
            .members
            .iter()
            .map(|m| {
                let reach = if m.reachable { "" } else { ", unreachable" };
                format!("{} {:?}{reach}", m.address, m.status)
            })
            .collect();
        members.join(", ")
    }

    /// Which replicas hold `value` (or a newer one) of the entity now: running nodes' memory,
    /// and every node slot's disk.
    fn holders(&self, shard: &ShardId, entity_id: &str, value: u64) -> String {
        let key = state_key(&self.cfg, shard, entity_id);
        let stored = |data: Option<&ReplicatedData>| match data {
            Some(ReplicatedData::FencedMap(m)) => m.get(entity_id).and_then(read_stored).map_or(0, |(v, _)| v),
            _ => 0,
        };
        let mut held = Vec::new();
        for j in 0..self.nodes.len() {
            if let Some(n) = self.nodes[j].as_ref().filter(|n| stored(n.replicator.local_value(&key)) >= value) {
                held.push(format!("{} (memory)", n.addr));
            }
            if stored(self.disks[j].get(&key)) >= value {
                held.push(format!("n{} (disk)", j + 1));
            }
        }
        held.join(", ")
    }

    /// After recovery, the value each entity answered is the largest acknowledged until its
    /// own acknowledgement (a message queued behind the final ask — one left from the faults —
    /// may write a larger one afterwards: seed 370014969 of the soak).
    pub(super) fn check_no_acknowledged_state_lost(&mut self) {
        for (entity_id, (value, at)) in &self.ledger.final_values {
            let largest = self
                .ledger
                .acked
                .get(entity_id)
                .and_then(|a| a.iter().filter(|(_, acked_at)| **acked_at <= *at).map(|(v, _)| *v).max())
                .unwrap_or(0);
            if *value < largest {
                let v = format!(
                    "{entity_id} answered {value} after recovery (at t={at}) though {largest} was acknowledged by then"
                );
                self.report.violations.push(v);
            }
        }
    }
}
