//! Reliable delivery in the simulation, the producers' side, performed as `Producer`'s driver
//! does (`sharding/producer/mod.rs`): each producer id `p{k}` (one per node slot) runs the
//! producer core on one node; its sends go through that node's region, their outcomes come
//! back over the network (or fail locally, or time out after `delivery_timeout`); with a
//! durable queue, the producer first claims its queue at a new epoch and restores what it
//! loads, and stores each message with a fenced write before it counts as stored.
//!
//! A supervisor starts a producer again a second after its node stopped or was downed, on the
//! first node that serves (from its own slot on): without a durable queue with nothing of what
//! the old one held; with one, with everything its queue kept. A downed node that was paused
//! keeps running its producer until a fenced write stops it (a zombie).

use super::*;
use crate::sharding::delivery::DeliveryHeader;
use crate::sharding::producer::ProducerSettings;
use crate::sharding::producer::core::{ProducerAction, ProducerCore, ProducerInput, SendResult, StoredMessage};
use crate::sharding::producer::durable::{MAX_CLAIMS, next_epoch, node_tag, persist_result};
use crate::sharding::producer::queue;
use crate::sharding::shard::batch::{self, BatchAction, StateBatch, StateOutcome, StateRequest, StateResult};
use crate::sharding::shard::state::{ClaimOutcome, MAX_BATCH, claim_outcome, claim_updates};

/// A supervisor starts a stopped producer again after this long.
const PRODUCER_RESTART_MS: u64 = 1_000;

/// One running incarnation of a producer id.
pub(super) struct SimProducer {
    /// Its id's index: the id is `p{k}`.
    k: usize,
    id: String,
    host: UniqueAddress,
    /// `None` while its durable queue is being claimed.
    core: Option<ProducerCore>,
    /// Durable: the epoch its queue was claimed at.
    epoch: u64,
    /// Offers waiting for room: waiter → (entity, message).
    waiting: BTreeMap<u64, (String, u64)>,
    next_waiter: u64,
    /// Durable: messages whose write is in flight, by (stream, seq).
    storing: BTreeMap<(u64, u64), (String, u64)>,
    /// The highest fence its claims saw, and how many it made.
    fence: u64,
    claims: usize,
    /// Durable: queue writes waiting for the batch in flight to end (its store's writer takes
    /// one batch at a time: a try of an older write never follows a newer one).
    /// Each with what it does to which message.
    queued: VecDeque<(StateRequest, QueueOp)>,
    writing: bool,
}

/// A delivery sent and not yet ended.
pub(super) struct Flight {
    /// The producer incarnation that sent it.
    pub producer: u64,
    pub entity: String,
    pub header: DeliveryHeader,
    pub round: u64,
    /// Its producer waits for its outcome (a copy on its way still reaches its entity after
    /// that, and is handled there).
    pub open: bool,
}

/// A durable queue write in flight: whose, and what each of its requests does.
pub(super) struct QueueWrite {
    producer: u64,
    ops: Vec<QueueOp>,
}

/// What a queue write does: whether it deletes, and the message it stores or deletes (none:
/// a stale entry's deletion).
type QueueOp = (bool, Option<StoredMessage>);

/// The producers of a reliable run and what is in flight.
#[derive(Default)]
pub(super) struct Producers {
    /// Running incarnations, by incarnation number.
    running: BTreeMap<u64, SimProducer>,
    next_incarnation: u64,
    /// Producer ids with a start due.
    restarting: BTreeSet<usize>,
    pub flights: BTreeMap<u64, Flight>,
    /// (deadline, flight).
    deadlines: BTreeSet<(u64, u64)>,
    next_flight: u64,
    next_message: u64,
}

/// The producers' settings: the defaults, with a durable queue when the run has one, and
/// tight bounds when it asks for them.
fn producer_settings(cfg: &SimConfig) -> ProducerSettings {
    let defaults = ProducerSettings { durable_queue: cfg.durable_queue, ..ProducerSettings::default() };
    if cfg.tight_producers { ProducerSettings { window: 3, max_entities: 4, ..defaults } } else { defaults }
}

impl Sim {
    /// Starts producer `p{k}` on the first node that serves from slot `k` on, unless an
    /// incarnation of it runs on a node its peers have not downed.
    pub(super) fn start_producer(&mut self, k: usize) {
        self.producers.restarting.remove(&k);
        let alive = self.producers.running.values().any(|p| p.k == k && !self.host_gone(&p.host));
        if alive {
            return;
        }
        let n = self.nodes.len();
        let serving = (0..n).map(|j| (k + j) % n).find(|j| {
            self.nodes[*j].as_ref().is_some_and(|node| {
                !self.is_paused(*j) && self.members.iter().any(|m| m.addr == node.addr && m.status == MemberStatus::Up)
            })
        });
        let Some(i) = serving else {
            self.restart_producer_later(k);
            return;
        };
        let host = self.nodes[i].as_ref().expect("serving").addr.clone();
        self.producers.next_incarnation += 1;
        let incarnation = self.producers.next_incarnation;
        let id = format!("p{k}");
        self.trace(|| format!("{host} starts producer {id} (incarnation {incarnation})"));
        let producer = SimProducer {
            k,
            id,
            host,
            core: None,
            epoch: 0,
            waiting: BTreeMap::new(),
            next_waiter: 0,
            storing: BTreeMap::new(),
            fence: 0,
            claims: 0,
            queued: VecDeque::new(),
            writing: false,
        };
        self.producers.running.insert(incarnation, producer);
        if self.cfg.durable_queue {
            self.claim_queue(incarnation);
        } else {
            self.open_producer(incarnation, 0);
        }
    }

    /// Whether `host` stopped, or was downed (or removed) by its peers.
    fn host_gone(&self, host: &UniqueAddress) -> bool {
        self.slot_of(host).is_none() || self.downed_or_removed(host)
    }

    fn restart_producer_later(&mut self, k: usize) {
        if self.producers.restarting.insert(k) {
            self.schedule(PRODUCER_RESTART_MS, Event::StartProducer(k));
        }
    }

    /// Producers whose host is gone (stopped, or downed while paused) are started again.
    pub(super) fn supervise_producers(&mut self) {
        if !self.cfg.reliable {
            return;
        }
        for k in 0..self.nodes.len() {
            let alive = self.producers.running.values().any(|p| p.k == k && !self.host_gone(&p.host));
            if !alive {
                self.restart_producer_later(k);
            }
        }
    }

    /// Node slot `i` stopped: its producers end with it (their in-memory queues too).
    pub(super) fn producers_stopped_with(&mut self, host: &UniqueAddress) {
        let gone: Vec<u64> =
            self.producers.running.iter().filter(|(_, p)| p.host == *host).map(|(inc, _)| *inc).collect();
        for inc in gone {
            let p = self.producers.running.remove(&inc).expect("listed");
            self.trace(|| format!("producer {} (incarnation {inc}) stops with {host}", p.id));
            self.restart_producer_later(p.k);
        }
    }

    /// The producer's core starts: at `epoch` (its queue's claim; 0 without one).
    fn open_producer(&mut self, incarnation: u64, epoch: u64) {
        let (base, limits) = (self.rng.random(), producer_settings(&self.cfg).limits());
        let Some(p) = self.producers.running.get_mut(&incarnation) else { return };
        p.epoch = epoch;
        p.core = Some(ProducerCore::new(p.id.clone(), limits, base, epoch));
    }

    /// Claims the producer's durable queue at an epoch above every fence its host's replica
    /// knows and its earlier claims saw.
    fn claim_queue(&mut self, incarnation: u64) {
        let (now, wall) = (self.now(), self.wall());
        let s = settings(&self.cfg);
        let space = keys::producer_space(TYPE);
        let Some(i) = self.producers_host(incarnation).and_then(|h| self.slot_of(&h)) else { return };
        let p = self.producers.running.get_mut(&incarnation).expect("hosted");
        let node = self.nodes[i].as_mut().expect("running");
        let local = (0..s.state.slots)
            .filter_map(|slot| match node.replicator.local_value(&keys::slot_key(&space, &p.id, slot)) {
                Some(ReplicatedData::FencedMap(m)) => Some(m.fence()),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        p.fence = p.fence.max(local);
        p.claims += 1;
        let epoch = next_epoch(p.fence, node_tag(&p.host.to_string()));
        let updates = claim_updates(&space, &p.id, s.state.slots, epoch);
        let input = ReplicatorInput::UpdateAndGetMany {
            updates: updates.into_iter().map(crate::ddata::KeyUpdate::into_parts).collect(),
            consistency: batch::state_read_consistency(&s),
            timeout: s.coordinator.waiting_for_state_timeout,
            reply: RepReply::QueueClaim { producer: incarnation, epoch, tries: 1 },
        };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    /// A claim of a producer's queue ended: on success its entries are restored, and the
    /// stale ones deleted.
    pub(super) fn on_queue_claimed(
        &mut self,
        i: usize,
        incarnation: u64,
        epoch: u64,
        tries: usize,
        result: crate::Result<Vec<Option<ReplicatedData>>>,
    ) {
        let Some(p) = self.producers.running.get(&incarnation) else { return };
        let id = p.id.clone();
        let space = keys::producer_space(TYPE);
        let read = self.typed_slots(&space, &id, result);
        match claim_outcome(&space, &id, epoch, tries, read) {
            ClaimOutcome::Claimed { .. } => {
                let entries = self.local_entries(i, &space, &id);
                let found = entries.len();
                let restored = queue::restore(entries);
                let host = self.nodes[i].as_ref().expect("running").addr.clone();
                let resumed: usize = restored.streams.iter().map(|s| s.messages.len()).sum();
                self.trace(|| format!("{host} producer {id} claims its queue at {epoch:#x}: {found} entries, resumes {resumed}, {} stale", restored.stale.len()));
                self.open_producer(incarnation, epoch);
                self.feed_producer(incarnation, ProducerInput::Restore(restored), None);
            }
            ClaimOutcome::Again => {
                let (now, wall) = (self.now(), self.wall());
                let s = settings(&self.cfg);
                let updates = claim_updates(&space, &id, s.state.slots, epoch);
                let input = ReplicatorInput::UpdateAndGetMany {
                    updates: updates.into_iter().map(crate::ddata::KeyUpdate::into_parts).collect(),
                    consistency: batch::state_read_consistency(&s),
                    timeout: s.coordinator.waiting_for_state_timeout,
                    reply: RepReply::QueueClaim { producer: incarnation, epoch, tries: tries + 1 },
                };
                let mut out = Vec::new();
                self.nodes[i].as_mut().expect("running").replicator.handle(input, now, wall, &mut out);
                self.perform_replicator(i, out);
            }
            ClaimOutcome::Failed(crate::Error::Fenced { fence, .. }) => {
                let p = self.producers.running.get_mut(&incarnation).expect("seen above");
                p.fence = p.fence.max(fence);
                if p.claims < MAX_CLAIMS {
                    self.claim_queue(incarnation);
                } else {
                    self.producer_failed(incarnation, "fenced at every claim");
                }
            }
            ClaimOutcome::Failed(e) => self.producer_failed(incarnation, &e.to_string()),
        }
    }

    /// The producer could not start (as `ShardRegion::producer` returning an error): its
    /// supervisor tries again later.
    fn producer_failed(&mut self, incarnation: u64, why: &str) {
        let Some(p) = self.producers.running.remove(&incarnation) else { return };
        let why = why.to_string();
        self.trace(|| format!("producer {} (incarnation {incarnation}) stops: {why}", p.id));
        self.restart_producer_later(p.k);
    }

    /// Every live entry of `owner`'s slots in `space` on node `i`'s replica.
    fn local_entries(&self, i: usize, space: &str, owner: &str) -> Vec<(String, Vec<u8>)> {
        let node = self.nodes[i].as_ref().expect("running");
        (0..settings(&self.cfg).state.slots)
            .filter_map(|slot| match node.replicator.local_value(&keys::slot_key(space, owner, slot)) {
                Some(ReplicatedData::FencedMap(m)) => {
                    Some(m.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect())
                }
                _ => None,
            })
            .flat_map(|entries: Vec<(String, Vec<u8>)>| entries)
            .collect()
    }

    /// A producer sends one message to a random entity (the run's traffic).
    pub(super) fn on_offer(&mut self) {
        let ready: Vec<u64> = self
            .producers
            .running
            .iter()
            .filter(|(_, p)| p.core.is_some() && self.slot_of(&p.host).is_some_and(|i| !self.is_paused(i)))
            .map(|(inc, _)| *inc)
            .collect();
        if !ready.is_empty() {
            let incarnation = ready[self.rng.random_range(0..ready.len())];
            let entity = format!("e{}", self.rng.random_range(0..self.cfg.entities));
            self.producers.next_message += 1;
            let message = self.producers.next_message;
            self.offer(incarnation, entity, message);
        }
        if self.now_ms < self.cfg.fault_ms {
            let gap = self.rng.random_range(5..40);
            self.schedule(gap, Event::Offer);
        }
    }

    /// Offers `message` for `entity` (again, when woken for room).
    fn offer(&mut self, incarnation: u64, entity: String, message: u64) {
        let Some(p) = self.producers.running.get_mut(&incarnation) else { return };
        p.next_waiter += 1;
        let waiter = p.next_waiter;
        let bytes = bytes::Bytes::copy_from_slice(&message.to_le_bytes());
        let input = ProducerInput::Offer { entity: entity.clone(), bytes, waiter };
        self.feed_producer(incarnation, input, Some((waiter, entity, message)));
    }

    /// Runs `input` through the producer's core and performs what it decides; `offer`: the
    /// offer it answers (waiter, entity, message).
    pub(super) fn feed_producer(&mut self, incarnation: u64, input: ProducerInput, offer: Option<(u64, String, u64)>) {
        let now = self.now();
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            let Some(core) = self.producers.running.get_mut(&incarnation).and_then(|p| p.core.as_mut()) else {
                return;
            };
            let mut out = Vec::new();
            core.handle(input, now, &mut out);
            for action in out {
                self.perform_producer(incarnation, action, offer.as_ref(), &mut inputs);
            }
        }
    }

    fn perform_producer(
        &mut self,
        incarnation: u64,
        action: ProducerAction,
        offer: Option<&(u64, String, u64)>,
        inputs: &mut VecDeque<ProducerInput>,
    ) {
        let Some(p) = self.producers.running.get_mut(&incarnation) else { return };
        let id = p.id.clone();
        match action {
            ProducerAction::Stored { stream, seq } => {
                let stored = p.storing.remove(&(stream, seq)).or_else(|| offer.map(|(_, e, m)| (e.clone(), *m)));
                if let Some((entity, message)) = stored {
                    self.delivery_ledger.stored(&id, incarnation, stream, seq, entity, message);
                }
            }
            ProducerAction::Storing { stream, seq } => {
                if let Some((_, entity, message)) = offer {
                    p.storing.insert((stream, seq), (entity.clone(), *message));
                }
            }
            ProducerAction::StoreFailed { stream, seq, reason } => {
                p.storing.remove(&(stream, seq));
                self.report
                    .violations
                    .push(format!("producer {id}: message {seq} of stream {stream} not stored: {reason}"));
            }
            ProducerAction::Wait => {
                if let Some((waiter, entity, message)) = offer {
                    p.waiting.insert(*waiter, (entity.clone(), *message));
                }
            }
            ProducerAction::Refused { queued_bytes, .. } => {
                self.report.violations.push(format!("producer {id} refused an offer at {queued_bytes} queued bytes"));
            }
            ProducerAction::Wake { waiter, entity } => match p.waiting.remove(&waiter) {
                Some((entity, message)) => self.offer(incarnation, entity, message),
                None => inputs.push_back(ProducerInput::WakeLost { entity }),
            },
            ProducerAction::Persist { key, entry } => {
                let message = Some((entry.entity.clone(), entry.stream, entry.seq));
                let value = crate::transport::wire::encode(&entry).expect("a queue entry encodes").to_vec();
                self.write_queue(incarnation, key, Some(value), message);
            }
            ProducerAction::Unpersist { key, of } => self.write_queue(incarnation, key, None, of),
            ProducerAction::Fenced { fence } => {
                self.trace(|| format!("producer {id} (incarnation {incarnation}) fenced by {fence:#x}; stops"));
                self.producers.running.remove(&incarnation);
            }
            ProducerAction::Send { entity, header, round, bytes } => {
                drop(bytes);
                self.send_delivery(incarnation, Flight { producer: incarnation, entity, header, round, open: true });
            }
            ProducerAction::Confirmed { stream, seq } => {
                let v = self.delivery_ledger.confirmed(&id, stream, seq, self.cfg.durable);
                if let Some(v) = v {
                    self.report.violations.push(format!("t={} {v}", self.now_ms));
                }
            }
            ProducerAction::DeadLetter { entity, seq, reason, .. } => {
                self.report.violations.push(format!("producer {id}: {entity}'s message {seq} dead-lettered: {reason}"));
            }
        }
    }

    /// Sends a delivery through the producer host's region.
    fn send_delivery(&mut self, incarnation: u64, flight: Flight) {
        let Some(host) = self.producers.running.get(&incarnation).map(|p| p.host.clone()) else { return };
        let Some(i) = self.slot_of(&host) else { return };
        self.producers.next_flight += 1;
        let id = self.producers.next_flight;
        let entity_id = flight.entity.clone();
        self.producers.flights.insert(id, flight);
        let timeout = producer_settings(&self.cfg).delivery_timeout.as_millis() as u64;
        self.producers.deadlines.insert((self.now_ms + timeout, id));
        let shard = default_shard_id(&entity_id, self.cfg.shards);
        let msg = Msg { ask: None, delivery: Some(id) };
        let mut out = Vec::new();
        let now = self.now();
        let node = self.nodes[i].as_mut().expect("running");
        node.region.handle(RegionInput::Route { shard, entity_id, msg }, now, &mut out);
        self.perform_region(i, out);
    }

    /// Delivery `flight` ended with `result` (an outcome that reached its producer's node):
    /// its producer hears it, once.
    pub(super) fn on_delivery_outcome(&mut self, flight: u64, result: SendResult) {
        let Some(f) = self.producers.flights.get_mut(&flight).filter(|f| f.open) else { return };
        f.open = false;
        let (producer, entity, header, round) = (f.producer, f.entity.clone(), f.header.clone(), f.round);
        let (stream, seq) = (header.stream, header.seq);
        self.trace(|| {
            format!(
                "producer {} hears {entity}'s outcome of {seq} (stream {stream:x}, round {round}): {result:?}",
                header.producer
            )
        });
        let input = ProducerInput::Outcome { entity, stream: header.stream, round, seq: header.seq, result };
        self.feed_producer(producer, input, None);
    }

    /// Node `i`'s producers tick, and the deliveries past their timeout fail.
    pub(super) fn tick_producers(&mut self, i: usize) {
        let Some(host) = self.nodes[i].as_ref().map(|n| n.addr.clone()) else { return };
        let timeout = producer_settings(&self.cfg).delivery_timeout;
        // Each node times out its own producers' deliveries (a paused one when it resumes).
        let due: Vec<(u64, u64)> =
            self.producers.deadlines.iter().take_while(|(at, _)| *at <= self.now_ms).copied().collect();
        for (at, flight) in due {
            let on =
                self.producers.flights.get(&flight).filter(|f| f.open).and_then(|f| self.producers_host(f.producer));
            match on {
                Some(h) if h != host => continue,
                Some(_) => {
                    self.producers.deadlines.remove(&(at, flight));
                    self.on_delivery_outcome(flight, SendResult::Failed(format!("no outcome within {timeout:?}")));
                }
                None => {
                    self.producers.deadlines.remove(&(at, flight));
                }
            }
        }
        let here: Vec<u64> =
            self.producers.running.iter().filter(|(_, p)| p.host == host).map(|(inc, _)| *inc).collect();
        for incarnation in here {
            self.feed_producer(incarnation, ProducerInput::Tick, None);
        }
    }

    /// Writes one entry of the producer's queue (`None`: deletes it) under its claim, as the
    /// region's state writer does.
    fn write_queue(
        &mut self,
        incarnation: u64,
        key: String,
        value: Option<Vec<u8>>,
        message: Option<(String, u64, u64)>,
    ) {
        let Some(p) = self.producers.running.get_mut(&incarnation) else { return };
        let (owner, epoch) = (p.id.clone(), p.epoch);
        let line = match (&message, value.is_some()) {
            (Some((entity, stream, seq)), true) => {
                format!("producer {owner} writes {key}: {entity}'s {seq} of {stream:x}")
            }
            (Some((entity, stream, seq)), false) => {
                format!("producer {owner} deletes {key}: {entity}'s {seq} of {stream:x}")
            }
            (None, _) => format!("producer {owner} deletes {key} (stale)"),
        };
        let deletion = value.is_none();
        p.queued.push_back((StateRequest { shard: owner, epoch, entity_id: key, value }, (deletion, message)));
        self.trace(|| line);
        self.next_queue_batch(incarnation);
    }

    /// Starts the producer's next queue batch, unless one is in flight: every write queued
    /// meanwhile, in one batch, as the store's writer (`StateIo::run_writer`) takes them.
    fn next_queue_batch(&mut self, incarnation: u64) {
        let Some(p) = self.producers.running.get(&incarnation) else { return };
        if p.writing || p.queued.is_empty() {
            return;
        }
        let Some(i) = self.slot_of(&p.host.clone()) else { return };
        let p = self.producers.running.get_mut(&incarnation).expect("seen above");
        let n = p.queued.len().min(MAX_BATCH);
        let (requests, ops): (Vec<StateRequest>, Vec<_>) = p.queued.drain(..n).unzip();
        p.writing = true;
        let s = settings(&self.cfg);
        let node = self.nodes[i].as_mut().expect("running");
        let id = node.next_write;
        node.next_write += 1;
        let (budget, counters, mut out) = (slot_budget(), Arc::default(), Vec::new());
        let space = keys::producer_space(TYPE);
        let batch = StateBatch::start(&space, s.state.slots, budget, counters, requests, &mut out);
        node.queue_writes.insert(id, (QueueWrite { producer: incarnation, ops }, batch));
        self.perform_queue_batch(i, id, out);
    }

    fn perform_queue_batch(&mut self, i: usize, id: u64, actions: Vec<BatchAction<StateOutcome>>) {
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            match action {
                BatchAction::Write(updates) => self.write_slots(i, updates, RepReply::QueueWrite(id)),
                BatchAction::Done(outcome) => {
                    let Some((write, _)) = node.queue_writes.remove(&id) else { return };
                    let producer = write.producer;
                    let reason = || StateResult::NotPersisted { reason: "no outcome".into() };
                    let mut results = outcome.results.into_iter();
                    for op in write.ops {
                        self.on_queue_written(producer, op, results.next().unwrap_or_else(reason));
                    }
                    if let Some(p) = self.producers.running.get_mut(&producer) {
                        p.writing = false;
                    }
                    self.next_queue_batch(producer);
                }
            }
        }
    }

    /// A try of queue write `id` on node `i` ended.
    pub(super) fn on_queue_try(
        &mut self,
        i: usize,
        id: u64,
        result: crate::Result<Vec<(String, crate::ddata::Fenced)>>,
    ) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, batch)) = node.queue_writes.get_mut(&id) else { return };
        let mut out = Vec::new();
        batch.handle(result, &mut out);
        self.perform_queue_batch(i, id, out);
    }

    fn on_queue_written(&mut self, producer: u64, (deletion, message): QueueOp, result: StateResult) {
        let Some(p) = self.producers.running.get(&producer) else { return };
        let id = p.id.clone();
        let what = if deletion { "deletion" } else { "write" };
        self.trace(|| format!("producer {id}'s {what} of {message:?} ended: {result:?}"));
        let written = result.into_result(String::new(), id.clone(), slot_budget());
        let (result, _) = persist_result(written);
        let input = match message {
            Some((entity, stream, seq)) if !deletion => ProducerInput::Persisted { entity, stream, seq, result },
            of => ProducerInput::Unpersisted { of, result },
        };
        self.feed_producer(producer, input, None);
    }

    /// After recovery: whether every running producer has had everything confirmed, its
    /// evicted streams' entries deleted, and its queue's writes (deletions included) ended.
    pub(super) fn producers_drained(&self) -> bool {
        self.producers.running.values().all(|p| {
            p.core.as_ref().is_some_and(|c| c.unconfirmed() == 0 && c.evicted() == 0)
                && p.waiting.is_empty()
                && p.storing.is_empty()
                && p.queued.is_empty()
                && !p.writing
        }) && self.producers.restarting.is_empty()
    }

    /// The producer incarnations running now.
    pub(super) fn running_producers(&self) -> BTreeSet<u64> {
        self.producers.running.keys().copied().collect()
    }
}

impl Sim {
    /// The node producer incarnation `incarnation` runs on, while it runs.
    pub(super) fn producers_host(&self, incarnation: u64) -> Option<UniqueAddress> {
        self.producers.running.get(&incarnation).map(|p| p.host.clone())
    }
}
