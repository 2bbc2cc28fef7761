//! A shard as a sans-IO state machine: the life cycle of its entities (start, passivate,
//! restart, stop for hand-off), with messages buffered while an entity is starting or stopping
//! and delivered to its next incarnation.
//!
//! With remember-entities, the shard first loads its remembered ids (and starts them), records
//! every start and every passivation in the replicated set before acting on it — one write in
//! flight, the starts and stops that arrive meanwhile batched into the next — and restarts an
//! entity that stopped without passivating after `entity_restart_backoff`. The entity table is
//! the shard's only copy of the remembered ids (a loaded id not yet started is an entry in state
//! [`EntityState::Remembered`]): an entry not in `RememberingStart` is remembered in the store.
//!
//! Passivation (idle timeout, active-entity limit) is decided by [`Passivation`]: every
//! running entity is in its recency order, so idle expiry and limit victims need no scan.
//!
//! Costs: a message is O(1) (a hash lookup and a move in the recency list; LFU: O(log n)); a
//! tick is O(entities due), not a scan of the table (restart deadlines are indexed, idle
//! entities leave the recency list's front).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use super::passivation::{Handle, Passivation, PolicySettings};
use crate::clock::Instant;
use crate::sharding::ids::IdMap;

/// Life-cycle state of one entity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntityState {
    /// Remember-entities: its start is being recorded; messages wait.
    RememberingStart,
    /// Running and receiving messages.
    Active,
    /// Told to stop (passivation or hand-off); new messages wait.
    Stopping,
    /// Remember-entities: its passivation is being recorded; messages wait.
    RememberingStop,
    /// Remember-entities: stopped without passivating; restarts at the deadline or on a message.
    WaitingForRestart(Instant),
    /// Remember-entities: loaded from the store and not started yet (its recovery start or a
    /// message starts it, without a new write).
    Remembered,
}

impl EntityState {
    /// Whether an entity task exists (or is about to) for an entry in this state.
    fn has_task(self) -> bool {
        !matches!(self, EntityState::WaitingForRestart(_) | EntityState::Remembered)
    }
}

#[derive(Debug)]
struct EntityEntry<S> {
    state: EntityState,
    incarnation: u64,
    /// Its place in the passivation policy while it runs (`None`: not tracked).
    policy: Option<Handle>,
    /// The host's handle on the running incarnation (its mailbox), attached after `Start`;
    /// dropped with the entry or when the incarnation terminates. Kept here rather than in a
    /// second map of the host: an idle entity then costs one table entry and one id.
    slot: Option<S>,
}

impl<S> EntityEntry<S> {
    fn new(state: EntityState, incarnation: u64) -> Self {
        EntityEntry { state, incarnation, policy: None, slot: None }
    }
}

/// Why an entity incarnation stops on purpose: what [`Entity::on_stop`](crate::Entity::on_stop)
/// is told, and what operators see counted by reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The entity asked to passivate ([`EntityContext::passivate`](crate::EntityContext::passivate)).
    Passivated,
    /// It was idle for the idle timeout.
    Idle,
    /// The region's active-entity limit made room for another entity.
    Limit,
    /// Its shard moves to another node: a rebalance, or this node leaving
    /// ([`Node::leave`](crate::Node::leave)). The next incarnation starts there.
    HandOff,
}

/// Why a message was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DropReason {
    /// The shard is being handed off.
    HandOff,
    /// The shard failed (its remembered set could not be loaded or written).
    ShardFailed,
    /// The shard already holds its limit of messages waiting for entities to start or stop,
    /// or for its load (`buffer_size`).
    BufferFull,
    /// Remember-entities: the entity's start was not recorded, its slot being at its byte
    /// budget; the entity was not started.
    SlotFull,
    /// Remember-entities: the shard already remembers its limit of entities
    /// (`remember.max_per_shard`); a new one was not started.
    RememberedLimit,
}

#[derive(Debug)]
pub(crate) enum ShardInput<M> {
    Deliver {
        entity_id: String,
        msg: M,
    },
    /// The entity asked to be passivated (after the message it was handling).
    Passivate {
        entity_id: String,
        incarnation: u64,
    },
    /// The entity task ended (after a stop, a panic or a forced abort). `leftovers` are the
    /// messages sent to the incarnation that it did not take, oldest first: they go to the next
    /// incarnation ahead of anything the shard held for the entity meanwhile (those arrived
    /// later: the shard holds a message only once it stopped sending to the incarnation).
    Terminated {
        entity_id: String,
        incarnation: u64,
        leftovers: Vec<M>,
    },
    /// Remember-entities: the remembered ids were loaded.
    Loaded(BTreeSet<String>),
    /// Remember-entities: the last `WriteRemembered` is durable on a majority, except the adds
    /// in `refused`, which were not recorded because their slot is at its byte budget.
    WriteDone {
        refused: BTreeSet<String>,
    },
    /// Remember-entities: the load or the write failed.
    StoreFailed,
    /// Remember-entities: the id now lives in another shard (changed extractor); forget it here.
    MovedAway {
        entity_id: String,
    },
    HandOff,
    Tick,
    /// The shard's share of the region's active-entity limit changed.
    PassivationLimit(usize),
}

#[derive(Debug, PartialEq)]
pub(crate) enum ShardAction<M, S = ()> {
    /// Spawn entity `entity_id` as `incarnation`.
    Start {
        entity_id: String,
        incarnation: u64,
    },
    /// Put a message in the entity's mailbox.
    Send {
        entity_id: String,
        msg: M,
    },
    /// Put a stop signal in the entity's mailbox (after the messages already there).
    Stop {
        entity_id: String,
        reason: StopReason,
    },
    /// Abort the entity task now; `slot` is the host's handle on it (the entry is gone).
    ForceStop {
        entity_id: String,
        slot: Option<S>,
    },
    Drop {
        entity_id: String,
        msg: M,
        reason: DropReason,
    },
    /// Remember-entities: start these remembered ids (each through the region).
    Recover {
        entity_ids: Vec<String>,
    },
    /// Remember-entities: record these starts and stops; answer `WriteDone` (naming the starts
    /// refused for a full slot) or `StoreFailed`.
    WriteRemembered {
        adds: BTreeSet<String>,
        removes: BTreeSet<String>,
    },
    /// Hand-off finished: every entity has stopped.
    Stopped,
    /// Remember-entities: the store failed; the shard stopped and must be restarted later.
    Failed,
}

#[derive(Debug)]
struct Remember {
    in_flight: Option<(BTreeSet<String>, BTreeSet<String>)>,
    next_adds: BTreeSet<String>,
    next_removes: BTreeSet<String>,
    /// Most entities the shard remembers, counting those whose start or stop is being
    /// recorded; a new id past it is refused ([`DropReason::RememberedLimit`]).
    limit: usize,
}

/// The messages a shard holds: per entity while it starts or stops, and in arrival order
/// until the shard's stored data loaded; counted, so a flood of them is refused past `limit`
/// instead of growing memory without bound.
#[derive(Debug)]
struct Held<M> {
    by_entity: BTreeMap<String, VecDeque<M>>,
    early: VecDeque<(String, M)>,
    count: usize,
    limit: usize,
}

impl<M> Held<M> {
    fn new(limit: usize) -> Self {
        Held { by_entity: BTreeMap::new(), early: VecDeque::new(), count: 0, limit }
    }

    /// Whether one more message may be held.
    fn has_room(&self) -> bool {
        self.count < self.limit
    }

    fn push(&mut self, entity_id: String, msg: M) {
        self.by_entity.entry(entity_id).or_default().push_back(msg);
        self.count += 1;
    }

    /// Puts an ended incarnation's leftovers ahead of what is held for it (they were taken
    /// in before, so they are held whatever the limit).
    fn push_front_all(&mut self, entity_id: &str, msgs: Vec<M>) {
        let held = self.by_entity.entry(entity_id.to_string()).or_default();
        self.count += msgs.len();
        for msg in msgs.into_iter().rev() {
            held.push_front(msg);
        }
    }

    fn push_early(&mut self, entity_id: String, msg: M) {
        self.early.push_back((entity_id, msg));
        self.count += 1;
    }

    fn has_for(&self, entity_id: &str) -> bool {
        self.by_entity.get(entity_id).is_some_and(|b| !b.is_empty())
    }

    fn take(&mut self, entity_id: &str) -> VecDeque<M> {
        let taken = self.by_entity.remove(entity_id).unwrap_or_default();
        self.count -= taken.len();
        taken
    }

    fn take_all(&mut self) -> BTreeMap<String, VecDeque<M>> {
        let taken = std::mem::take(&mut self.by_entity);
        self.count -= taken.values().map(VecDeque::len).sum::<usize>();
        taken
    }

    fn take_early(&mut self) -> VecDeque<(String, M)> {
        let taken = std::mem::take(&mut self.early);
        self.count -= taken.len();
        taken
    }
}

/// One shard's entities; `S` is what the host attaches to a running incarnation.
pub(crate) struct ShardCore<M, S = ()> {
    /// Every entity the shard knows: running, starting, stopping, and (remember-entities) the
    /// remembered ones not running. Iteration order is arbitrary: whatever turns it into
    /// actions sorts first (the simulation replays actions in order).
    entities: IdMap<Arc<str>, EntityEntry<S>>,
    /// Messages held for entities that are starting or stopping, and (`early`) until the load.
    held: Held<M>,
    next_incarnation: u64,
    passivation: Passivation,
    handoff_deadline: Option<Instant>,
    handoff_stop_timeout: Duration,
    remember: Option<Remember>,
    /// Whether the shard's stored data (remembered ids, durable entity states) has loaded;
    /// until then messages wait in `held`'s early queue.
    loaded: bool,
    restart_backoff: Duration,
    /// Entities waiting for a restart, by deadline, so a tick costs O(due) rather than a scan
    /// of every entity (a shard may hold hundreds of thousands). An entry whose entity has
    /// since started (or whose deadline moved) is stale and skipped.
    restarts_due: BTreeSet<(Instant, String)>,
    failed: bool,
    /// The latest `now` any input brought: the direct path's access stamp.
    latest_now: Option<Instant>,
}

impl<M, S> ShardCore<M, S> {
    pub(crate) fn new(policy: PolicySettings, handoff_stop_timeout: Duration) -> Self {
        ShardCore {
            entities: IdMap::default(),
            held: Held::new(usize::MAX),
            next_incarnation: 1,
            passivation: Passivation::new(policy),
            handoff_deadline: None,
            handoff_stop_timeout,
            remember: None,
            loaded: true,
            restart_backoff: Duration::from_secs(10),
            restarts_due: BTreeSet::new(),
            failed: false,
            latest_now: None,
        }
    }

    /// A shard that remembers its entities: it waits for `Loaded` before serving. Automatic
    /// passivation is off (remembered entities are meant to stay up, as in Akka).
    pub(crate) fn remembering(handoff_stop_timeout: Duration, restart_backoff: Duration) -> Self {
        ShardCore {
            remember: Some(Remember {
                in_flight: None,
                next_adds: BTreeSet::new(),
                next_removes: BTreeSet::new(),
                limit: usize::MAX,
            }),
            loaded: false,
            restart_backoff,
            ..Self::new(PolicySettings::idle(None), handoff_stop_timeout)
        }
    }

    /// A shard whose entities keep durable state: like [`ShardCore::new`], but it waits for
    /// `Loaded` (the state claimed and read) before serving.
    /// At most `limit` messages held at once (waiting for the load, or for their entity to
    /// start or stop); more are dropped with [`DropReason::BufferFull`]. Unlimited otherwise.
    pub(crate) fn with_buffer_limit(mut self, limit: usize) -> Self {
        self.held.limit = limit;
        self
    }

    /// Remember-entities: at most `limit` entities remembered (unlimited with `None`); a
    /// message for a new id past it is dropped with [`DropReason::RememberedLimit`]. Ids
    /// loaded from the store all come back, even past a lowered limit.
    pub(crate) fn with_remembered_limit(mut self, limit: Option<usize>) -> Self {
        if let Some(r) = self.remember.as_mut() {
            r.limit = limit.unwrap_or(usize::MAX);
        }
        self
    }

    pub(crate) fn loading(policy: PolicySettings, handoff_stop_timeout: Duration) -> Self {
        ShardCore { loaded: false, ..Self::new(policy, handoff_stop_timeout) }
    }

    /// Live entity ids, in no particular order (not counting those waiting for a restart or
    /// remembered and not started).
    pub(crate) fn entity_ids(&self) -> impl Iterator<Item = &str> {
        self.entities.iter().filter(|(_, e)| e.state.has_task()).map(|(id, _)| &**id)
    }

    /// Forced stops of every entity with a task, in id order, each with its slot (the entries
    /// are cleared next).
    fn force_stop_all(&mut self, out: &mut Vec<ShardAction<M, S>>) {
        let mut stops: Vec<(String, Option<S>)> = self
            .entities
            .iter_mut()
            .filter(|(_, e)| e.state.has_task())
            .map(|(id, e)| (id.to_string(), e.slot.take()))
            .collect();
        // The entries are cleared next: nothing stays tracked.
        self.passivation.clear();
        stops.sort_by(|a, b| a.0.cmp(&b.0));
        for (entity_id, slot) in stops {
            out.push(ShardAction::ForceStop { entity_id, slot });
        }
    }

    /// Attaches the host's handle to the running `incarnation` of `entity_id` (after `Start`);
    /// false when that incarnation is not the entity's current one.
    pub(crate) fn attach(&mut self, entity_id: &str, incarnation: u64, slot: S) -> bool {
        match self.entities.get_mut(entity_id) {
            Some(e) if e.incarnation == incarnation && e.state.has_task() => {
                e.slot = Some(slot);
                true
            }
            _ => false,
        }
    }

    /// The host's handle on the running incarnation of `entity_id`, with that incarnation.
    /// The id is the core's own copy, for the host to share rather than copy.
    pub(crate) fn slot(&self, entity_id: &str) -> Option<(&Arc<str>, &S, u64)> {
        let (id, e) = self.entities.get_key_value(entity_id)?;
        e.slot.as_ref().map(|s| (id, s, e.incarnation))
    }

    /// Takes every attached handle out (the shard is being dropped).
    pub(crate) fn take_slots(&mut self) -> Vec<(String, S)> {
        self.entities.iter_mut().filter_map(|(id, e)| e.slot.take().map(|s| (id.to_string(), s))).collect()
    }

    pub(crate) fn entity_count(&self) -> usize {
        self.entity_ids().count()
    }

    /// With remember-entities, the ids remembered in the store (running or not; an id whose
    /// start is still being recorded is not yet); 0 without.
    pub(crate) fn remembered_count(&self) -> usize {
        if self.remember.is_none() {
            return 0;
        }
        self.entities.values().filter(|e| e.state != EntityState::RememberingStart).count()
    }

    fn start(&mut self, entity_id: &str, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        // The id's one copy, shared by the table and the passivation policy (a remembered
        // entity's entry keeps its key).
        let key = match self.entities.get_key_value(entity_id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(entity_id),
        };
        let mut victims = Vec::new();
        let policy = self.passivation.started(&key, now, &mut victims);
        let mut entry = EntityEntry::new(EntityState::Active, incarnation);
        entry.policy = policy;
        self.entities.insert(key, entry);
        self.stop_victims(victims, StopReason::Limit, out);
        out.push(ShardAction::Start { entity_id: entity_id.to_string(), incarnation });
        for msg in self.held.take(entity_id) {
            out.push(ShardAction::Send { entity_id: entity_id.to_string(), msg });
        }
    }

    fn maybe_write(&mut self, out: &mut Vec<ShardAction<M, S>>) {
        let Some(r) = self.remember.as_mut() else { return };
        if r.in_flight.is_some() || (r.next_adds.is_empty() && r.next_removes.is_empty()) {
            return;
        }
        let adds = std::mem::take(&mut r.next_adds);
        let removes = std::mem::take(&mut r.next_removes);
        r.in_flight = Some((adds.clone(), removes.clone()));
        out.push(ShardAction::WriteRemembered { adds, removes });
    }

    /// Whether the shard serves messages now: loaded, not failed, not handing off.
    fn serving(&self) -> bool {
        self.loaded && !self.failed && self.handoff_deadline.is_none()
    }

    /// The direct path's decision, the same as [`ShardInput::Deliver`] would make: when a
    /// message for `entity_id` would be sent straight to its running incarnation (the shard
    /// serves and the entity is `Active`), its activity is marked (idle passivation) as a
    /// delivery does, and the core's id, the host's handle on that incarnation and the
    /// incarnation are returned to put the message in. `None` (and nothing changed) when the
    /// message must take the routed path: the entity is starting, stopping, not running, not
    /// attached yet, or the shard is not serving.
    ///
    /// The access is stamped with the latest instant the core was handed (its inputs, and the
    /// region's tick every 100 ms), not a clock read per message: idle passivation of an entity
    /// reached this way counts from up to one tick before its last message.
    pub(crate) fn direct_slot(&mut self, entity_id: &str) -> Option<(&Arc<str>, &S, u64)> {
        let now = self.latest_now?;
        if !self.serving() {
            return None;
        }
        // One lookup on the hot path: the table and the policy are disjoint fields.
        let (key, e) = self.entities.get_key_value(entity_id)?;
        if e.state != EntityState::Active {
            return None;
        }
        let slot = e.slot.as_ref()?;
        if let Some(h) = e.policy {
            self.passivation.accessed(h, key, now);
        }
        Some((key, slot, e.incarnation))
    }

    fn deliver(&mut self, entity_id: String, msg: M, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        if self.handoff_deadline.is_some() || self.failed {
            let reason = if self.failed { DropReason::ShardFailed } else { DropReason::HandOff };
            out.push(ShardAction::Drop { entity_id, msg, reason });
            return;
        }
        // A message that would wait here (for the load, or for its entity to start or stop)
        // while the shard already holds its limit is refused, not held.
        let full = |held: &Held<M>| !held.has_room();
        if !self.loaded {
            if full(&self.held) {
                out.push(ShardAction::Drop { entity_id, msg, reason: DropReason::BufferFull });
            } else {
                self.held.push_early(entity_id, msg);
            }
            return;
        }
        let state = self.entities.get_key_value(entity_id.as_str()).map(|(key, e)| {
            if let Some(h) = e.policy {
                self.passivation.accessed(h, key, now);
            }
            e.state
        });
        match state {
            Some(EntityState::Active) => out.push(ShardAction::Send { entity_id, msg }),
            Some(EntityState::WaitingForRestart(_) | EntityState::Remembered) => {
                self.held.push(entity_id.clone(), msg);
                self.start(&entity_id, now, out);
            }
            Some(_) if full(&self.held) => {
                out.push(ShardAction::Drop { entity_id, msg, reason: DropReason::BufferFull })
            }
            Some(_) => self.held.push(entity_id, msg),
            None => match self.remember.as_mut() {
                Some(_) if full(&self.held) => {
                    out.push(ShardAction::Drop { entity_id, msg, reason: DropReason::BufferFull });
                }
                // Every entry of a remembering shard is an id remembered or being recorded.
                Some(r) if self.entities.len() >= r.limit => {
                    out.push(ShardAction::Drop { entity_id, msg, reason: DropReason::RememberedLimit });
                }
                Some(r) => {
                    // Not in the table, so not remembered: record the start before creating it.
                    r.next_adds.insert(entity_id.clone());
                    r.next_removes.remove(&entity_id);
                    self.entities
                        .insert(Arc::from(entity_id.as_str()), EntityEntry::new(EntityState::RememberingStart, 0));
                    self.held.push(entity_id, msg);
                    self.maybe_write(out);
                }
                _ => {
                    self.held.push(entity_id.clone(), msg);
                    self.start(&entity_id, now, out);
                }
            },
        }
    }

    /// The remembered ids (or, for durable entities, the claim) arrived: they recover, and
    /// what arrived before the load is delivered now.
    fn on_loaded(&mut self, ids: BTreeSet<String>, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        if self.loaded {
            return;
        }
        self.loaded = true;
        for id in ids.iter().filter(|_| self.remember.is_some()) {
            self.entities.entry(Arc::from(id.as_str())).or_insert(EntityEntry::new(EntityState::Remembered, 0));
        }
        if !ids.is_empty() && self.remember.is_some() {
            out.push(ShardAction::Recover { entity_ids: ids.into_iter().collect() });
        }
        for (id, msg) in self.held.take_early() {
            self.deliver(id, msg, now, out);
        }
    }

    /// A remember write ended: the recorded starts start (refused ones fail their messages),
    /// the recorded stops leave (restarting where messages arrived meanwhile).
    fn on_write_done(&mut self, refused: BTreeSet<String>, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        let Some(r) = self.remember.as_mut() else { return };
        let Some((adds, removes)) = r.in_flight.take() else { return };
        for id in adds {
            if self.entities.get(id.as_str()).is_some_and(|e| e.state == EntityState::RememberingStart) {
                if refused.contains(&id) {
                    // Not remembered, so never started: its messages fail at once.
                    self.entities.remove(id.as_str());
                    for msg in self.held.take(&id) {
                        out.push(ShardAction::Drop { entity_id: id.clone(), msg, reason: DropReason::SlotFull });
                    }
                } else if self.handoff_deadline.is_some() {
                    self.entities.remove(id.as_str());
                } else {
                    self.start(&id, now, out);
                }
            }
        }
        for id in removes {
            if self.entities.get(id.as_str()).is_some_and(|e| e.state == EntityState::Remembered) {
                // Moved to another shard (changed extractor) and started there.
                self.entities.remove(id.as_str());
                continue;
            }
            if self.entities.get(id.as_str()).is_some_and(|e| e.state == EntityState::RememberingStop) {
                self.entities.remove(id.as_str());
                if self.held.has_for(&id) {
                    // Messages arrived while it passivated: it starts again (recorded again).
                    let buffered = self.held.take(&id);
                    for msg in buffered {
                        self.deliver(id.clone(), msg, now, out);
                    }
                }
            }
        }
        self.maybe_write(out);
        self.check_handoff_done(out);
    }

    /// Hand-off begins: buffered messages fail, idle entries leave, running entities stop; the
    /// shard reports `Stopped` once the last has ended (or at the hand-off stop timeout).
    fn on_hand_off(&mut self, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        if self.handoff_deadline.is_some() {
            return;
        }
        self.handoff_deadline = Some(now + self.handoff_stop_timeout);
        for (id, buffered) in self.held.take_all() {
            for msg in buffered {
                out.push(ShardAction::Drop { entity_id: id.clone(), msg, reason: DropReason::HandOff });
            }
        }
        for (id, msg) in self.held.take_early() {
            out.push(ShardAction::Drop { entity_id: id, msg, reason: DropReason::HandOff });
        }
        // Entries without a task leave now; running ones are told to stop (in id order).
        self.entities.retain(|_, e| e.state.has_task());
        self.restarts_due.clear();
        let running: Vec<Arc<str>> = self.entities.keys().cloned().collect();
        self.stop_victims(running, StopReason::HandOff, out);
        self.check_handoff_done(out);
    }

    fn check_handoff_done(&mut self, out: &mut Vec<ShardAction<M, S>>) {
        let writing = self.remember.as_ref().is_some_and(|r| r.in_flight.is_some());
        if self.handoff_deadline.is_some() && self.entities.is_empty() && !writing {
            self.handoff_deadline = None;
            out.push(ShardAction::Stopped);
        }
    }

    pub(crate) fn handle(&mut self, input: ShardInput<M>, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        // Never backwards: drivers on several threads read the clock before taking the lock.
        self.latest_now = Some(self.latest_now.map_or(now, |latest| latest.max(now)));
        match input {
            ShardInput::Deliver { entity_id, msg } => self.deliver(entity_id, msg, now, out),
            ShardInput::Passivate { entity_id, incarnation } => {
                if let Some((key, e)) = self.entities.get_key_value(entity_id.as_str())
                    && e.incarnation == incarnation
                    && e.state == EntityState::Active
                {
                    let key = key.clone();
                    self.stop_victims(vec![key], StopReason::Passivated, out);
                }
            }
            ShardInput::Terminated { entity_id, incarnation, leftovers } => {
                self.on_terminated(entity_id, incarnation, leftovers, now, out)
            }
            ShardInput::Loaded(ids) => self.on_loaded(ids, now, out),
            ShardInput::WriteDone { refused } => self.on_write_done(refused, now, out),
            ShardInput::StoreFailed => self.fail(out),
            ShardInput::MovedAway { entity_id } => {
                if let Some(r) = self.remember.as_mut() {
                    r.next_removes.insert(entity_id.clone());
                    r.next_adds.remove(&entity_id);
                    self.maybe_write(out);
                }
            }
            ShardInput::HandOff => self.on_hand_off(now, out),
            ShardInput::Tick => self.on_tick(now, out),
            ShardInput::PassivationLimit(limit) => {
                let mut victims = Vec::new();
                self.passivation.set_limit(limit, &mut victims);
                self.stop_victims(victims, StopReason::Limit, out);
            }
        }
    }

    /// Stops the running (`Active`) entities among `victims`, in id order, each out of the
    /// policy: the policy's victims, an entity that passivates itself, a hand-off's entities.
    fn stop_victims(&mut self, mut victims: Vec<Arc<str>>, reason: StopReason, out: &mut Vec<ShardAction<M, S>>) {
        victims.sort();
        for key in victims {
            let Some(e) = self.entities.get_mut(&*key) else { continue };
            if e.state != EntityState::Active {
                continue;
            }
            e.state = EntityState::Stopping;
            if let Some(h) = e.policy.take() {
                self.passivation.removed(h, &key);
            }
            out.push(ShardAction::Stop { entity_id: key.to_string(), reason });
        }
    }

    fn on_terminated(
        &mut self,
        entity_id: String,
        incarnation: u64,
        leftovers: Vec<M>,
        now: Instant,
        out: &mut Vec<ShardAction<M, S>>,
    ) {
        let current = self.entities.get(entity_id.as_str()).is_some_and(|e| e.incarnation == incarnation);
        if !current {
            // Not the running incarnation (already replaced or forgotten): what it left goes
            // the usual way.
            for msg in leftovers {
                self.deliver(entity_id.clone(), msg, now, out);
            }
            return;
        }
        let (key, e) = self.entities.get_key_value(entity_id.as_str()).expect("current entity");
        if let Some(h) = e.policy {
            // Ended without a stop the policy chose (a panic, a durable restart).
            self.passivation.removed(h, key);
        }
        let e = self.entities.get_mut(entity_id.as_str()).expect("current entity");
        e.policy = None;
        // The incarnation's task has ended: the host's handle on it is done.
        e.slot = None;
        if !leftovers.is_empty() {
            // Ahead of what the shard held meanwhile, which arrived after them.
            self.held.push_front_all(&entity_id, leftovers);
        }
        let state = e.state;
        if self.handoff_deadline.is_some() {
            self.entities.remove(entity_id.as_str());
            for msg in self.held.take(&entity_id) {
                out.push(ShardAction::Drop { entity_id: entity_id.clone(), msg, reason: DropReason::HandOff });
            }
            self.check_handoff_done(out);
            return;
        }
        match (state, self.remember.is_some()) {
            (EntityState::Stopping, true) => {
                // Passivated: record the stop; messages meanwhile wait for the write.
                self.entities.get_mut(entity_id.as_str()).expect("entity").state = EntityState::RememberingStop;
                let r = self.remember.as_mut().expect("remember");
                r.next_removes.insert(entity_id.clone());
                r.next_adds.remove(&entity_id);
                self.maybe_write(out);
            }
            (EntityState::Active, true) => {
                // Stopped without passivating (panic): it stays remembered and comes back.
                let at = now + self.restart_backoff;
                self.entities.get_mut(entity_id.as_str()).expect("entity").state = EntityState::WaitingForRestart(at);
                self.restarts_due.insert((at, entity_id.clone()));
                if self.held.has_for(&entity_id) {
                    self.start(&entity_id, now, out);
                }
            }
            _ => {
                self.entities.remove(entity_id.as_str());
                let buffered = self.held.take(&entity_id);
                if !buffered.is_empty() {
                    // Messages that arrived while it stopped go to its next incarnation.
                    for msg in buffered {
                        self.deliver(entity_id.clone(), msg, now, out);
                    }
                }
            }
        }
    }

    fn fail(&mut self, out: &mut Vec<ShardAction<M, S>>) {
        if self.failed {
            return;
        }
        if self.handoff_deadline.is_some() {
            // A store failure while handing off ends the hand-off at once (seed 670003637): a
            // failed shard is only restarted here, so `Failed` would leave the hand-off
            // unanswered until the region's shutdown timeout. Every entity stops now; a write
            // that failed was not acknowledged, and the new home loads what is stored.
            self.force_stop_all(out);
            self.entities.clear();
            self.restarts_due.clear();
            if let Some(r) = self.remember.as_mut() {
                r.in_flight = None;
            }
            self.check_handoff_done(out);
            return;
        }
        self.failed = true;
        self.force_stop_all(out);
        self.entities.clear();
        self.restarts_due.clear();
        for (id, buffered) in self.held.take_all() {
            for msg in buffered {
                out.push(ShardAction::Drop { entity_id: id.clone(), msg, reason: DropReason::ShardFailed });
            }
        }
        for (id, msg) in self.held.take_early() {
            out.push(ShardAction::Drop { entity_id: id, msg, reason: DropReason::ShardFailed });
        }
        out.push(ShardAction::Failed);
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<ShardAction<M, S>>) {
        if let Some(deadline) = self.handoff_deadline {
            if now >= deadline {
                self.force_stop_all(out);
                self.entities.clear();
                self.restarts_due.clear();
                if let Some(r) = self.remember.as_mut() {
                    r.in_flight = None; // the new home reloads whatever was stored
                }
                self.check_handoff_done(out);
            }
            return;
        }
        let later = match self.restarts_due.iter().find(|(at, _)| *at > now).cloned() {
            Some(first_later) => self.restarts_due.split_off(&first_later),
            None => BTreeSet::new(),
        };
        for (at, id) in std::mem::replace(&mut self.restarts_due, later) {
            if self.entities.get(id.as_str()).is_some_and(|e| e.state == EntityState::WaitingForRestart(at)) {
                self.start(&id, now, out);
            }
        }
        let mut idle = Vec::new();
        self.passivation.expired(now, &mut idle);
        self.stop_victims(idle, StopReason::Idle, out);
    }
}

#[cfg(test)]
mod tests {
    use super::super::passivation::Replacement;
    use super::*;

    fn run(s: &mut ShardCore<u32>, input: ShardInput<u32>, now: Instant) -> Vec<ShardAction<u32>> {
        let mut out = Vec::new();
        s.handle(input, now, &mut out);
        out
    }

    fn deliver(id: &str, msg: u32) -> ShardInput<u32> {
        ShardInput::Deliver { entity_id: id.into(), msg }
    }

    fn ids(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn first_message_starts_the_entity_and_later_ones_go_straight_to_it() {
        let mut s = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        let now = Instant::now();
        let out = run(&mut s, deliver("a", 1), now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "a".into(), incarnation: 1 },
                ShardAction::Send { entity_id: "a".into(), msg: 1 }
            ]
        );
        assert_eq!(run(&mut s, deliver("a", 2), now), vec![ShardAction::Send { entity_id: "a".into(), msg: 2 }]);
    }

    #[test]
    fn messages_during_passivation_are_buffered_and_delivered_to_the_next_incarnation() {
        let mut s = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        assert_eq!(
            run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now),
            vec![ShardAction::Stop { entity_id: "a".into(), reason: StopReason::Passivated }]
        );
        assert!(run(&mut s, deliver("a", 2), now).is_empty());
        assert!(run(&mut s, deliver("a", 3), now).is_empty());
        // A stale termination of an older incarnation is ignored.
        assert!(
            run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 0, leftovers: vec![] }, now)
                .is_empty()
        );
        let out = run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "a".into(), incarnation: 2 },
                ShardAction::Send { entity_id: "a".into(), msg: 2 },
                ShardAction::Send { entity_id: "a".into(), msg: 3 },
            ]
        );
    }

    #[test]
    fn leftovers_of_an_incarnation_that_panicked_while_passivating_go_ahead_of_what_the_shard_held_meanwhile() {
        // Found by tests/message_order.rs: the held (newer) messages reached the next
        // incarnation before the leftovers (older), which were redelivered after them.
        let mut s = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("a", 2), now);
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        assert!(run(&mut s, deliver("a", 4), now).is_empty(), "held while it stops");
        // It panicked on 1 with 2 and 3 (sent to it, never taken) left over.
        let out =
            run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![2, 3] }, now);
        let sent: Vec<u32> = out
            .iter()
            .filter_map(|a| match a {
                ShardAction::Send { msg, .. } => Some(*msg),
                _ => None,
            })
            .collect();
        assert_eq!(sent, vec![2, 3, 4], "{out:?}");
        // Leftovers of an incarnation that is not the current one go the usual way.
        let out =
            run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![5] }, now);
        assert_eq!(out, vec![ShardAction::Send { entity_id: "a".into(), msg: 5 }]);
    }

    #[test]
    fn the_direct_path_is_open_only_to_an_active_attached_entity_of_a_serving_shard_and_marks_its_activity() {
        let t0 = Instant::now();
        let mut s: ShardCore<u32, &str> =
            ShardCore::new(PolicySettings::idle(Some(Duration::from_secs(10))), Duration::from_secs(1));
        let mut out = Vec::new();
        s.handle(ShardInput::Deliver { entity_id: "a".into(), msg: 1 }, t0, &mut out);
        assert!(s.direct_slot("a").is_none(), "not attached yet");
        assert!(s.attach("a", 1, "handle"));
        assert_eq!(s.direct_slot("a").map(|(id, h, i)| (&**id, h, i)), Some(("a", &"handle", 1)));
        assert!(s.direct_slot("b").is_none(), "not running");
        // A message on the direct path counts as activity, stamped with the latest instant an
        // input brought (here the tick at 8 s): no passivation a timeout after t0.
        let later = t0 + Duration::from_secs(8);
        s.handle(ShardInput::Tick, later, &mut out);
        assert!(s.direct_slot("a").is_some());
        let mut out = Vec::new();
        s.handle(ShardInput::Tick, t0 + Duration::from_secs(12), &mut out);
        assert!(out.is_empty(), "activity at 8 s keeps it past 12 s: {out:?}");
        // Stopping (passivation) closes it.
        s.handle(ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, later, &mut out);
        assert!(s.direct_slot("a").is_none(), "stopping");
        // So does a hand-off, for every entity.
        let mut s: ShardCore<u32, &str> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        s.handle(ShardInput::Deliver { entity_id: "a".into(), msg: 1 }, t0, &mut out);
        assert!(s.attach("a", 1, "handle"));
        s.handle(ShardInput::HandOff, t0, &mut out);
        assert!(s.direct_slot("a").is_none(), "handing off");
        // And a shard still loading its stored data.
        let mut s: ShardCore<u32, &str> = ShardCore::loading(PolicySettings::idle(None), Duration::from_secs(1));
        s.handle(ShardInput::Deliver { entity_id: "a".into(), msg: 1 }, t0, &mut out);
        assert!(s.direct_slot("a").is_none(), "loading");
    }

    #[test]
    fn a_direct_message_counts_from_the_latest_input_instant_so_its_entity_idles_out_one_timeout_after_it() {
        let t0 = Instant::now();
        let idle = Duration::from_secs(10);
        let mut s: ShardCore<u32, &'static str> =
            ShardCore::new(PolicySettings::idle(Some(idle)), Duration::from_secs(1));
        let mut out = Vec::new();
        s.handle(ShardInput::Deliver { entity_id: "a".into(), msg: 1 }, t0, &mut out);
        assert!(s.attach("a", 1, "handle"));
        // Ticks at 5 s and 4 s (a driver's older reading, taken before the lock): the stamp
        // never goes back, so the direct message is stamped 5 s.
        s.handle(ShardInput::Tick, t0 + Duration::from_secs(5), &mut out);
        s.handle(ShardInput::Tick, t0 + Duration::from_secs(4), &mut out);
        assert!(s.direct_slot("a").is_some());
        let tick = |s: &mut ShardCore<u32, &'static str>, secs: u64| {
            let mut out = Vec::new();
            s.handle(ShardInput::Tick, t0 + Duration::from_secs(secs), &mut out);
            out
        };
        assert!(tick(&mut s, 14).is_empty(), "idle 9 s since the 5 s stamp");
        assert_eq!(tick(&mut s, 15), vec![ShardAction::Stop { entity_id: "a".into(), reason: StopReason::Idle }]);
    }

    #[test]
    fn passivated_entity_without_new_messages_stays_stopped() {
        let mut s = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        assert!(
            run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, now)
                .is_empty()
        );
        assert_eq!(s.entity_count(), 0);
    }

    #[test]
    fn idle_entities_are_passivated_after_the_timeout() {
        let mut s = ShardCore::new(PolicySettings::idle(Some(Duration::from_secs(120))), Duration::from_secs(1));
        let t0 = Instant::now();
        run(&mut s, deliver("a", 1), t0);
        run(&mut s, deliver("b", 1), t0 + Duration::from_secs(100));
        assert_eq!(
            run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(121)),
            vec![ShardAction::Stop { entity_id: "a".into(), reason: StopReason::Idle }]
        );
    }

    #[test]
    fn hand_off_stops_all_entities_drops_buffers_and_forces_stragglers_at_the_deadline() {
        let mut s = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(2));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("b", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "b".into(), incarnation: 2 }, now);
        run(&mut s, deliver("b", 9), now);
        let out = run(&mut s, ShardInput::HandOff, now);
        assert!(out.contains(&ShardAction::Drop { entity_id: "b".into(), msg: 9, reason: DropReason::HandOff }));
        assert!(out.contains(&ShardAction::Stop { entity_id: "a".into(), reason: StopReason::HandOff }));
        assert_eq!(
            run(&mut s, deliver("c", 1), now),
            vec![ShardAction::Drop { entity_id: "c".into(), msg: 1, reason: DropReason::HandOff }]
        );
        assert!(
            run(&mut s, ShardInput::Terminated { entity_id: "b".into(), incarnation: 2, leftovers: vec![] }, now)
                .is_empty()
        );
        assert_eq!(s.entity_count(), 1, "a still runs");
        assert!(run(&mut s, ShardInput::Tick, now + Duration::from_millis(1900)).is_empty(), "not before the deadline");
        let out = run(&mut s, ShardInput::Tick, now + Duration::from_secs(2));
        assert_eq!(out, vec![ShardAction::ForceStop { entity_id: "a".into(), slot: None }, ShardAction::Stopped]);
    }

    #[test]
    fn the_hosts_handle_lives_with_the_running_incarnation_and_a_forced_stop_hands_it_back() {
        let mut s: ShardCore<u32, &'static str> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(2));
        let now = Instant::now();
        let mut out = Vec::new();
        s.handle(deliver("a", 1), now, &mut out);
        assert!(matches!(out[0], ShardAction::Start { incarnation: 1, .. }));
        assert!(!s.attach("a", 2, "stale"), "only the current incarnation takes a handle");
        assert!(!s.attach("b", 1, "unknown"), "nor an entity the shard does not know");
        assert!(s.slot("a").is_none());
        assert!(s.attach("a", 1, "mailbox a#1"));
        assert_eq!(s.slot("a").map(|(id, h, i)| (&**id, h, i)), Some(("a", &"mailbox a#1", 1)));
        // A stale Terminated leaves it; the incarnation's own drops it.
        s.handle(
            ShardInput::Terminated { entity_id: "a".into(), incarnation: 7, leftovers: vec![] },
            now,
            &mut Vec::new(),
        );
        assert_eq!(s.slot("a").map(|(id, h, i)| (&**id, h, i)), Some(("a", &"mailbox a#1", 1)));
        s.handle(
            ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] },
            now,
            &mut Vec::new(),
        );
        assert!(s.slot("a").is_none());
        // A forced stop at the hand-off deadline carries the handle out with it, since the
        // entries are gone once the action is performed.
        let mut out = Vec::new();
        s.handle(deliver("b", 1), now, &mut out);
        assert!(s.attach("b", 2, "mailbox b#2"));
        s.handle(ShardInput::HandOff, now, &mut Vec::new());
        let mut out = Vec::new();
        s.handle(ShardInput::Tick, now + Duration::from_secs(2), &mut out);
        assert_eq!(
            out,
            vec![ShardAction::ForceStop { entity_id: "b".into(), slot: Some("mailbox b#2") }, ShardAction::Stopped]
        );
        assert!(s.take_slots().is_empty());
        // Dropping a shard takes every handle still attached.
        let mut s: ShardCore<u32, &'static str> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(2));
        s.handle(deliver("c", 1), now, &mut Vec::new());
        s.handle(deliver("d", 1), now, &mut Vec::new());
        assert!(s.attach("c", 1, "c") && s.attach("d", 2, "d"));
        let mut taken = s.take_slots();
        taken.sort();
        assert_eq!(taken, vec![("c".to_string(), "c"), ("d".to_string(), "d")]);
        assert!(s.slot("c").is_none());
    }

    #[test]
    fn hand_off_of_an_empty_shard_is_done_at_once() {
        let mut s: ShardCore<u32> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(2));
        assert_eq!(run(&mut s, ShardInput::HandOff, Instant::now()), vec![ShardAction::Stopped]);
    }

    fn remembering() -> ShardCore<u32> {
        ShardCore::remembering(Duration::from_secs(2), Duration::from_secs(10))
    }

    #[test]
    fn remembering_shard_waits_for_its_load_then_recovers_and_serves() {
        let mut s = remembering();
        let now = Instant::now();
        assert!(run(&mut s, deliver("x", 1), now).is_empty(), "held until loaded");
        let out = run(&mut s, ShardInput::Loaded(ids(&["a", "x"])), now);
        assert_eq!(out[0], ShardAction::Recover { entity_ids: vec!["a".into(), "x".into()] });
        // x is remembered already: it starts without a new write.
        assert!(out.contains(&ShardAction::Start { entity_id: "x".into(), incarnation: 1 }));
        assert!(out.contains(&ShardAction::Send { entity_id: "x".into(), msg: 1 }));
        assert!(!out.iter().any(|a| matches!(a, ShardAction::WriteRemembered { .. })));
    }

    #[test]
    fn a_durable_shard_holds_messages_until_its_states_are_loaded_then_serves_without_remembering() {
        let mut s = ShardCore::loading(PolicySettings::idle(Some(Duration::from_secs(60))), Duration::from_secs(2));
        let now = Instant::now();
        assert!(run(&mut s, deliver("x", 1), now).is_empty(), "held until loaded");
        assert!(run(&mut s, deliver("y", 2), now).is_empty());
        let out = run(&mut s, ShardInput::Loaded(ids(&["ignored"])), now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "x".into(), incarnation: 1 },
                ShardAction::Send { entity_id: "x".into(), msg: 1 },
                ShardAction::Start { entity_id: "y".into(), incarnation: 2 },
                ShardAction::Send { entity_id: "y".into(), msg: 2 },
            ],
            "the held messages in order, no recovery and no remember write"
        );
        assert_eq!(s.entity_count(), 2, "a loaded id of a shard that does not remember is not an entity");
        assert!(run(&mut s, ShardInput::Loaded(ids(&["z"])), now).is_empty(), "a second load changes nothing");
        // It passivates on idleness like any shard that does not remember.
        let later = now + Duration::from_secs(200);
        let out = run(&mut s, ShardInput::Tick, later);
        assert!(out.iter().any(|a| matches!(a, ShardAction::Stop { .. })), "{out:?}");
    }

    #[test]
    fn a_durable_shard_whose_load_failed_fails_its_held_messages() {
        let mut s = ShardCore::loading(PolicySettings::idle(None), Duration::from_secs(2));
        let now = Instant::now();
        run(&mut s, deliver("x", 1), now);
        let out = run(&mut s, ShardInput::StoreFailed, now);
        assert!(out.contains(&ShardAction::Failed), "{out:?}");
        assert!(
            out.iter().any(|a| matches!(a, ShardAction::Drop { msg: 1, reason: DropReason::ShardFailed, .. })),
            "{out:?}"
        );
    }

    #[test]
    fn starts_are_recorded_before_the_entity_runs_and_batched_one_write_at_a_time() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        let out = run(&mut s, deliver("a", 1), now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&["a"]), removes: ids(&[]) }]);
        assert!(run(&mut s, deliver("b", 2), now).is_empty(), "queued behind the write in flight");
        assert!(run(&mut s, deliver("c", 3), now).is_empty());
        assert!(run(&mut s, deliver("a", 4), now).is_empty(), "a's messages wait for its write");
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "a".into(), incarnation: 1 },
                ShardAction::Send { entity_id: "a".into(), msg: 1 },
                ShardAction::Send { entity_id: "a".into(), msg: 4 },
                ShardAction::WriteRemembered { adds: ids(&["b", "c"]), removes: ids(&[]) },
            ]
        );
    }

    #[test]
    fn a_start_refused_for_a_full_slot_fails_its_messages_and_the_others_start() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("big", 2), now);
        run(&mut s, deliver("b", 3), now);
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert!(out.contains(&ShardAction::WriteRemembered { adds: ids(&["b", "big"]), removes: ids(&[]) }));
        run(&mut s, deliver("big", 4), now);
        let out = run(&mut s, ShardInput::WriteDone { refused: ids(&["big", "a"]) }, now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "b".into(), incarnation: 2 },
                ShardAction::Send { entity_id: "b".into(), msg: 3 },
                ShardAction::Drop { entity_id: "big".into(), msg: 2, reason: DropReason::SlotFull },
                ShardAction::Drop { entity_id: "big".into(), msg: 4, reason: DropReason::SlotFull },
            ],
            "a refusal names only this write's adds: a (already running) is untouched"
        );
        assert_eq!(s.remembered_count(), 2, "a and b");
        assert_eq!(s.entity_count(), 2);
        // The refused id is forgotten: its next message asks to record its start again.
        let out = run(&mut s, deliver("big", 5), now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&["big"]), removes: ids(&[]) }]);
    }

    #[test]
    fn a_shard_at_its_remembered_limit_refuses_new_ids_and_takes_them_again_once_one_passivated() {
        let now = Instant::now();
        let limited = |out: &[ShardAction<u32>]| {
            out.iter().filter(|a| matches!(a, ShardAction::Drop { reason: DropReason::RememberedLimit, .. })).count()
        };
        let mut s = remembering().with_remembered_limit(Some(3));
        run(&mut s, ShardInput::Loaded(ids(&["a", "b"])), now);
        // c's start is being recorded: it counts, so d is one too many.
        assert_eq!(
            run(&mut s, deliver("c", 1), now),
            vec![ShardAction::WriteRemembered { adds: ids(&["c"]), removes: ids(&[]) }]
        );
        let out = run(&mut s, deliver("d", 2), now);
        assert_eq!(out, vec![ShardAction::Drop { entity_id: "d".into(), msg: 2, reason: DropReason::RememberedLimit }]);
        // Ids it remembers are served as ever, running or not.
        assert_eq!(limited(&run(&mut s, deliver("a", 3), now)), 0);
        assert_eq!(limited(&run(&mut s, deliver("c", 4), now)), 0);
        run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert_eq!(limited(&run(&mut s, deliver("d", 5), now)), 1, "still three remembered");
        // a passivates: its stop is recorded, and only then is there room.
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        let out = run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&[]), removes: ids(&["a"]) }]);
        assert_eq!(limited(&run(&mut s, deliver("d", 6), now)), 1, "a's stop is not recorded yet");
        run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        let out = run(&mut s, deliver("d", 7), now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&["d"]), removes: ids(&[]) }]);
        assert_eq!((s.remembered_count(), s.entities.len()), (2, 3), "b and c remembered, d being recorded");
        // Ids loaded from the store all come back past a lowered limit; new ones wait for room.
        let mut s = remembering().with_remembered_limit(Some(1));
        let out = run(&mut s, ShardInput::Loaded(ids(&["x", "y"])), now);
        assert!(out.contains(&ShardAction::Recover { entity_ids: vec!["x".into(), "y".into()] }), "{out:?}");
        assert_eq!(limited(&run(&mut s, deliver("z", 1), now)), 1);
        // Without a limit nothing is refused.
        let mut s = remembering().with_remembered_limit(None);
        run(&mut s, ShardInput::Loaded(ids(&["x", "y"])), now);
        assert_eq!(limited(&run(&mut s, deliver("z", 1), now)), 0);
    }

    #[test]
    fn a_shard_holds_at_most_its_buffer_limit_of_waiting_messages_and_refuses_more_with_buffer_full() {
        let now = Instant::now();
        let refused = |out: &[ShardAction<u32>]| {
            out.iter().filter(|a| matches!(a, ShardAction::Drop { reason: DropReason::BufferFull, .. })).count()
        };
        // Before the load: at most 3 wait; the 4th and 5th are refused.
        let mut s: ShardCore<u32> =
            ShardCore::loading(PolicySettings::idle(None), Duration::from_secs(1)).with_buffer_limit(3);
        let out: Vec<_> = (0..5).flat_map(|k| run(&mut s, deliver(&format!("e{k}"), k), now)).collect();
        assert_eq!(refused(&out), 2, "{out:?}");
        let out = run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        assert_eq!(out.iter().filter(|a| matches!(a, ShardAction::Send { .. })).count(), 3, "the three held ones go");
        assert_eq!(s.held.count, 0, "and are counted out");
        // Starting remembered entities: a flood of distinct new ids waits for the write, up to
        // the limit; the held messages leave with the write and make room again.
        let mut s: ShardCore<u32> =
            ShardCore::remembering(Duration::from_secs(1), Duration::from_secs(1)).with_buffer_limit(3);
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        let out: Vec<_> = (0..10).flat_map(|k| run(&mut s, deliver(&format!("id{k}"), k), now)).collect();
        assert_eq!(refused(&out), 7, "{out:?}");
        assert_eq!(s.held.count, 3);
        run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert!(out.iter().any(|a| matches!(a, ShardAction::Send { msg: 2, .. })), "{out:?}");
        assert_eq!(s.held.count, 0, "every held message left");
        assert_eq!(refused(&run(&mut s, deliver("id11", 11), now)), 0, "room again");
        // Messages for an entity whose start is being recorded wait too, up to the limit.
        let mut r: ShardCore<u32> =
            ShardCore::remembering(Duration::from_secs(1), Duration::from_secs(1)).with_buffer_limit(3);
        run(&mut r, ShardInput::Loaded(BTreeSet::new()), now);
        let out: Vec<_> = (0..5).flat_map(|k| run(&mut r, deliver("one", k), now)).collect();
        assert_eq!(refused(&out), 2, "{out:?}");
        // A running entity's messages are never held, so never refused.
        let out = run(&mut s, deliver("id0", 20), now);
        assert_eq!(out, vec![ShardAction::Send { entity_id: "id0".into(), msg: 20 }]);
        // A hand-off drops what is held, and counts it out.
        assert_eq!(s.held.count, 1, "id11 waits for its write");
        run(&mut s, deliver("id11", 21), now);
        assert_eq!(s.held.count, 2);
        let out = run(&mut s, ShardInput::HandOff, now);
        assert_eq!(
            out.iter().filter(|a| matches!(a, ShardAction::Drop { reason: DropReason::HandOff, .. })).count(),
            2
        );
        assert_eq!(s.held.count, 0);
    }

    #[test]
    fn passivation_records_the_stop_and_a_message_meanwhile_starts_it_again() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), now);
        run(&mut s, deliver("a", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        let out = run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&[]), removes: ids(&["a"]) }]);
        assert!(run(&mut s, deliver("a", 2), now).is_empty());
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&["a"]), removes: ids(&[]) }]);
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert!(out.contains(&ShardAction::Send { entity_id: "a".into(), msg: 2 }));
    }

    #[test]
    fn entity_that_stops_without_passivating_restarts_after_the_backoff() {
        let mut s = remembering();
        let t0 = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), t0);
        run(&mut s, deliver("a", 1), t0);
        assert!(
            run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, t0)
                .is_empty()
        );
        assert!(run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(5)).is_empty());
        let out = run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(10));
        assert_eq!(out, vec![ShardAction::Start { entity_id: "a".into(), incarnation: 2 }]);
    }

    #[test]
    fn the_configured_restart_backoff_is_the_one_used() {
        let mut s = ShardCore::<u32>::remembering(Duration::from_secs(2), Duration::from_secs(3));
        let t0 = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), t0);
        run(&mut s, deliver("a", 1), t0);
        run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, t0);
        assert!(run(&mut s, ShardInput::Tick, t0 + Duration::from_millis(2900)).is_empty());
        let out = run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(3));
        assert_eq!(out, vec![ShardAction::Start { entity_id: "a".into(), incarnation: 2 }]);
    }

    #[test]
    fn restart_brought_forward_by_a_message_is_not_repeated_at_the_old_deadline() {
        let mut s = remembering();
        let t0 = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), t0);
        run(&mut s, deliver("a", 1), t0);
        run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, t0);
        let out = run(&mut s, deliver("a", 2), t0 + Duration::from_secs(1));
        assert_eq!(out[0], ShardAction::Start { entity_id: "a".into(), incarnation: 2 });
        assert!(run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(10)).is_empty(), "stale deadline skipped");
        // A second crash gets its own deadline.
        run(
            &mut s,
            ShardInput::Terminated { entity_id: "a".into(), incarnation: 2, leftovers: vec![] },
            t0 + Duration::from_secs(11),
        );
        assert!(run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(20)).is_empty());
        let out = run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(21));
        assert_eq!(out, vec![ShardAction::Start { entity_id: "a".into(), incarnation: 3 }]);
    }

    #[test]
    fn idle_entities_stop_at_the_first_tick_past_their_timeout_in_the_order_of_their_last_message() {
        let mut s = ShardCore::new(PolicySettings::idle(Some(Duration::from_secs(120))), Duration::from_secs(1));
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        run(&mut s, deliver("a", 1), at(0));
        run(&mut s, deliver("b", 1), at(10));
        run(&mut s, deliver("a", 2), at(30)); // a is the most recent now
        assert!(run(&mut s, ShardInput::Tick, at(129)).is_empty(), "b is idle 119 s, a 99 s");
        assert_eq!(
            run(&mut s, ShardInput::Tick, at(130)),
            vec![ShardAction::Stop { entity_id: "b".into(), reason: StopReason::Idle }],
            "b, at the first tick past its timeout, not at a later scan"
        );
        assert!(run(&mut s, ShardInput::Tick, at(149)).is_empty());
        assert_eq!(
            run(&mut s, ShardInput::Tick, at(150)),
            vec![ShardAction::Stop { entity_id: "a".into(), reason: StopReason::Idle }]
        );
    }

    fn limited(limit: usize, replacement: Replacement) -> ShardCore<u32> {
        let policy = PolicySettings { idle_timeout: None, limit: Some(limit), replacement, window_tinylfu: false };
        ShardCore::new(policy, Duration::from_secs(1))
    }

    fn stop(id: &str, reason: StopReason) -> ShardAction<u32> {
        ShardAction::Stop { entity_id: id.into(), reason }
    }

    #[test]
    fn a_start_over_the_limit_passivates_the_least_recently_used_entity_first() {
        let mut s = limited(2, Replacement::Lru);
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("b", 1), now + Duration::from_secs(1));
        s.attach("a", 1, ());
        // A message on the direct path counts as a use, as a routed one does.
        assert!(s.direct_slot("a").is_some());
        let out = run(&mut s, deliver("c", 1), now + Duration::from_secs(3));
        assert_eq!(out[0], stop("b", StopReason::Limit), "room is made before c starts: {out:?}");
        assert!(matches!(&out[1], ShardAction::Start { entity_id, .. } if entity_id == "c"), "{out:?}");
        // b stops; its next message starts it again and passivates the least recent, a.
        run(&mut s, ShardInput::Terminated { entity_id: "b".into(), incarnation: 2, leftovers: vec![] }, now);
        let out = run(&mut s, deliver("b", 2), now + Duration::from_secs(4));
        assert_eq!(out[0], stop("a", StopReason::Limit), "{out:?}");
    }

    #[test]
    fn an_entity_that_passivates_itself_or_stops_for_hand_off_leaves_the_limit_to_the_others() {
        let mut s = limited(2, Replacement::Lru);
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("b", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1, leftovers: vec![] }, now);
        // a no longer counts: c starts without a victim.
        let out = run(&mut s, deliver("c", 1), now);
        assert!(!out.iter().any(|a| matches!(a, ShardAction::Stop { .. })), "{out:?}");
        let out = run(&mut s, ShardInput::HandOff, now);
        assert_eq!(out, vec![stop("b", StopReason::HandOff), stop("c", StopReason::HandOff)]);
    }

    #[test]
    fn a_lower_share_of_the_limit_passivates_the_surplus_at_once() {
        let mut s = limited(3, Replacement::Lru);
        let now = Instant::now();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            run(&mut s, deliver(id, 1), now + Duration::from_secs(i as u64));
        }
        assert_eq!(
            run(&mut s, ShardInput::PassivationLimit(1), now),
            vec![stop("a", StopReason::Limit), stop("b", StopReason::Limit)]
        );
        assert!(run(&mut s, ShardInput::PassivationLimit(5), now).is_empty());
        // Without a limit the input changes nothing.
        let mut idle_only: ShardCore<u32> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        run(&mut idle_only, deliver("a", 1), now);
        assert!(run(&mut idle_only, ShardInput::PassivationLimit(0), now).is_empty());
    }

    #[test]
    fn an_id_counts_as_remembered_once_its_start_is_recorded_and_never_without_remember_entities() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), now);
        run(&mut s, deliver("new", 1), now);
        assert_eq!(s.remembered_count(), 1, "the new id's start is not recorded yet");
        run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert_eq!(s.remembered_count(), 2);
        let mut plain: ShardCore<u32> = ShardCore::new(PolicySettings::idle(None), Duration::from_secs(1));
        run(&mut plain, deliver("a", 1), now);
        assert_eq!((plain.entity_count(), plain.remembered_count()), (1, 0));
    }

    #[test]
    fn loaded_ids_are_remembered_but_not_live_until_started() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a", "b"])), now);
        assert_eq!(s.entity_count(), 0, "loaded, not started");
        assert_eq!(s.remembered_count(), 2, "remembered all the same");
        let out = run(&mut s, deliver("b", 1), now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "b".into(), incarnation: 1 },
                ShardAction::Send { entity_id: "b".into(), msg: 1 }
            ],
            "a remembered id starts without a new write"
        );
        assert_eq!(s.entity_ids().collect::<Vec<_>>(), vec!["b"]);
        // Hand-off: the unstarted one leaves at once, the running one is stopped.
        let out = run(&mut s, ShardInput::HandOff, now);
        assert_eq!(out, vec![ShardAction::Stop { entity_id: "b".into(), reason: StopReason::HandOff }]);
        let out = run(&mut s, ShardInput::Terminated { entity_id: "b".into(), incarnation: 1, leftovers: vec![] }, now);
        assert_eq!(out, vec![ShardAction::Stopped]);
    }

    #[test]
    fn id_moved_to_another_shard_is_forgotten_once_its_removal_is_recorded() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a"])), now);
        let out = run(&mut s, ShardInput::MovedAway { entity_id: "a".into() }, now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&[]), removes: ids(&["a"]) }]);
        assert!(run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now).is_empty());
        // Should it come back here, its start is recorded again.
        let out = run(&mut s, deliver("a", 1), now);
        assert_eq!(out, vec![ShardAction::WriteRemembered { adds: ids(&["a"]), removes: ids(&[]) }]);
    }

    #[test]
    fn store_failure_aborts_running_entities_only() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(ids(&["a", "b"])), now);
        run(&mut s, deliver("a", 1), now);
        let out = run(&mut s, ShardInput::StoreFailed, now);
        assert_eq!(out, vec![ShardAction::ForceStop { entity_id: "a".into(), slot: None }, ShardAction::Failed]);
    }

    #[test]
    fn store_failure_stops_the_shard_and_fails_waiting_messages() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        run(&mut s, deliver("a", 1), now);
        let out = run(&mut s, ShardInput::StoreFailed, now);
        assert!(out.contains(&ShardAction::Drop { entity_id: "a".into(), msg: 1, reason: DropReason::ShardFailed }));
        assert_eq!(out.last(), Some(&ShardAction::Failed));
    }

    /// Seed 670003637 (`seven-nodes-lossy`): n4, leaving, was handing shard 5 off when the
    /// write of the stopped ids failed (no majority of the roster reachable); the shard
    /// reported `Failed`, the region never answered the hand-off, and shard 5 stayed on n4 for
    /// the 20 s until its shutdown timeout, answering "not hosted".
    #[test]
    fn a_store_failure_while_handing_off_ends_the_hand_off_instead_of_failing_the_shard() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        run(&mut s, deliver("a", 1), now);
        let out = run(&mut s, ShardInput::HandOff, now);
        assert!(!out.contains(&ShardAction::Stopped), "waits for the write in flight");
        let out = run(&mut s, ShardInput::StoreFailed, now);
        assert_eq!(out.last(), Some(&ShardAction::Stopped), "{out:?}");
        assert!(!out.contains(&ShardAction::Failed), "{out:?}");
    }

    #[test]
    fn hand_off_waits_for_the_write_in_flight() {
        let mut s = remembering();
        let now = Instant::now();
        run(&mut s, ShardInput::Loaded(BTreeSet::new()), now);
        run(&mut s, deliver("a", 1), now);
        let out = run(&mut s, ShardInput::HandOff, now);
        assert!(!out.contains(&ShardAction::Stopped));
        let out = run(&mut s, ShardInput::WriteDone { refused: BTreeSet::new() }, now);
        assert_eq!(out, vec![ShardAction::Stopped]);
    }
}
