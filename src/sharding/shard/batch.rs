//! The group commit of a region's remembered ids and entity states, as sans-IO cores: which slot
//! key each change goes to, what one try's update does on a replica, how often a batch is tried,
//! and each request's outcome. The region's writers (`remember.rs`, `state.rs`) perform their
//! actions on the replicator, and so does the simulation, so every seed runs the shipped rules.
//!
//! **Guarantees.**
//! - A batch goes out as one multi-key update (one delta message per replica, one LMDB
//!   transaction per node). It is tried at most [`WRITE_TRIES`] times; a request is answered
//!   once, after the last try: acknowledged only if that try was (a majority stored it).
//! - A slot never grows past its byte budget: on each try, on the replica as it is then, an
//!   add or state that would take its slot past it is left out and its request refused
//!   (`SlotFull`); removes go first, so the room they free is the adds'.
//! - Entity states: per slot key only the writes of the newest epoch queued go out; older ones
//!   are fenced at once, and a key a replica refuses by its fence fails all its writes
//!   (`Fenced`), never retried.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{FullSlot, StoreResult};
use crate::ddata::{Consistency, Fenced, FencedMap, KeyUpdate, OrSet};
use crate::error::Error;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::ids::{ShardId, remembered_slot};
use crate::sharding::keys;
use crate::sharding::settings::ShardingSettings;

/// Tries of each batch (Akka's policy for remembered entities: a few tries, each with a
/// quarter of the update timeout).
pub(crate) const WRITE_TRIES: usize = 3;

/// Tries of a shard's load (its remembered ids, its states' claim), each with
/// `coordinator.waiting_for_state_timeout`.
pub(crate) const LOAD_TRIES: usize = 3;

/// Whether a shard's failed load is tried again: at most [`LOAD_TRIES`] tries, and only after a
/// consistency timeout. A load reads every replica reachable when it starts; one that stopped
/// answering is, by the next try, usually judged unreachable and no longer waited for, so a
/// slow or half-cut replica delays a shard's start by a read timeout or two instead of failing
/// it for `shard_failure_backoff`.
pub(crate) fn load_again(tries: usize, error: &Error) -> bool {
    tries < LOAD_TRIES && matches!(error, Error::ConsistencyTimeout { .. })
}

/// How long a failed shard waits before it restarts: `shard_failure_backoff` plus up to a
/// quarter of it, by a hash of the shard and its epoch. Shards that failed together (a store
/// that stopped answering fails every shard loading from it) then restart spread over that
/// quarter instead of at one instant, and every node and the simulation compute the same wait.
pub(crate) fn shard_restart_after(backoff: Duration, shard: &str, epoch: u64) -> Duration {
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(shard.as_bytes(), epoch);
    // The hash's top 16 bits as a fraction of a quarter of the backoff.
    let spread = backoff / 4;
    backoff + spread.mul_f64((hash >> 48) as f64 / 65_536.0)
}

/// Consistency of remembered-id writes and of the coordinator's remembered-shards set's
/// writes: a majority of the roster plus `remember.write_majority_plus`.
pub(crate) fn remember_write_consistency(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.remember.write_majority_plus, min_cap: s.remember.majority_min_cap }
}

/// Consistency of a shard's load of its remembered ids and of the coordinator take-over's
/// read of the remembered shards: every reachable replica, never fewer than a majority plus
/// `remember.read_majority_plus`.
pub(crate) fn remember_read_consistency(s: &ShardingSettings) -> Consistency {
    Consistency::AllReachable { plus: s.remember.read_majority_plus, min_cap: s.remember.majority_min_cap }
}

/// Consistency of entity state writes: a majority of the roster plus `state.write_majority_plus`.
pub(crate) fn state_write_consistency(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.state.write_majority_plus, min_cap: s.state.majority_min_cap }
}

/// Consistency of a shard's state claim: every reachable replica, never fewer than a majority
/// plus `state.read_majority_plus`.
pub(crate) fn state_read_consistency(s: &ShardingSettings) -> Consistency {
    Consistency::AllReachable { plus: s.state.read_majority_plus, min_cap: s.state.majority_min_cap }
}

/// How long each try of a batch waits: a quarter of `coordinator.updating_state_timeout`, at least 100 ms.
pub(crate) fn write_timeout(s: &ShardingSettings) -> Duration {
    (s.coordinator.updating_state_timeout / 4).max(Duration::from_millis(100))
}

/// What a batch asks of its performer.
pub(crate) enum BatchAction<O> {
    /// Write these updates in one multi-key update at the writer's consistency (remembered ids:
    /// `update_many`; states: `update_each`, whose fenced keys are the answer); answer with
    /// the batch's `handle`.
    Write(Vec<KeyUpdate>),
    /// The batch is over.
    Done(O),
}

impl<O: std::fmt::Debug> std::fmt::Debug for BatchAction<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchAction::Write(updates) => f.debug_tuple("Write").field(&updates.len()).finish(),
            BatchAction::Done(outcome) => f.debug_tuple("Done").field(outcome).finish(),
        }
    }
}

/// Whether another try follows a failed one.
fn try_again(tries: usize, error: &Error) -> bool {
    tries < WRITE_TRIES && !matches!(error, Error::ShutDown)
}

/// One shard's starts and stops in a remember batch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RememberRequest {
    pub shard: ShardId,
    pub adds: BTreeSet<String>,
    pub removes: BTreeSet<String>,
}

/// The ids one batch adds to and removes from one slot key.
type SlotChanges = (Vec<String>, Vec<String>);

/// A remember batch's outcome.
#[derive(Debug, PartialEq)]
pub(crate) struct RememberOutcome {
    /// One per request, in request order.
    pub results: Vec<StoreResult>,
    /// Slot keys that refused adds for their budget, with how many.
    pub full_slots: Vec<(String, usize)>,
    /// Why the batch failed, if it did.
    pub error: Option<String>,
}

/// One group commit of remembered-id starts and stops.
pub(crate) struct RememberBatch {
    shards: Vec<ShardId>,
    keys: Vec<(String, ShardId, Arc<SlotChanges>, FullSlot)>,
    budget: usize,
    counters: Arc<RegionCounterCells>,
    tries: usize,
}

impl RememberBatch {
    /// Starts a batch of `requests` for a type with `slots` slot keys per shard, each at most
    /// `budget` bytes; every try raises the region's `slot_bytes_high_water` to the largest
    /// slot it wrote.
    pub(crate) fn start(
        type_name: &str,
        slots: u32,
        budget: usize,
        counters: Arc<RegionCounterCells>,
        requests: Vec<RememberRequest>,
        out: &mut Vec<BatchAction<RememberOutcome>>,
    ) -> Self {
        let mut by_key: BTreeMap<String, (ShardId, SlotChanges)> = BTreeMap::new();
        let mut shards = Vec::with_capacity(requests.len());
        for req in requests {
            let ids = req.adds.into_iter().map(|id| (id, true));
            for (id, added) in ids.chain(req.removes.into_iter().map(|id| (id, false))) {
                let key = keys::remembered_entities(type_name, &req.shard, remembered_slot(&id, slots));
                let (_, changes) = by_key.entry(key).or_insert_with(|| (req.shard.clone(), Default::default()));
                if added { &mut changes.0 } else { &mut changes.1 }.push(id);
            }
            shards.push(req.shard);
        }
        let keys = by_key
            .into_iter()
            .map(|(key, (shard, changes))| (key, shard, Arc::new(changes), FullSlot::default()))
            .collect();
        let mut batch = RememberBatch { shards, keys, budget, counters, tries: 0 };
        batch.write(out);
        batch
    }

    /// Ids the batch writes, adds and removes.
    pub(crate) fn ids(&self) -> usize {
        self.keys.iter().map(|(_, _, c, _)| c.0.len() + c.1.len()).sum()
    }

    fn write(&mut self, out: &mut Vec<BatchAction<RememberOutcome>>) {
        self.tries += 1;
        let updates = self
            .keys
            .iter()
            .map(|(key, _, ids, refused)| {
                let (ids, refused, budget) = (Arc::clone(ids), refused.clone(), self.budget);
                let counters = Arc::clone(&self.counters);
                KeyUpdate::new::<OrSet, _>(key, move |set, ctx| {
                    // Removes first: the room they free is the adds' to take.
                    for id in &ids.1 {
                        set.remove(id);
                    }
                    // Each try decides afresh on the replica as it is then.
                    let mut refused = refused.start_try();
                    for id in &ids.0 {
                        if set.fits(id, budget) {
                            set.add(ctx, id);
                        } else {
                            refused.insert(id.clone());
                        }
                    }
                    counters.slot_bytes_high_water.fetch_max(set.approx_bytes() as u64, Ordering::Relaxed);
                })
            })
            .collect();
        out.push(BatchAction::Write(updates));
    }

    /// The outcome of the latest try.
    pub(crate) fn handle(&mut self, written: Result<(), Error>, out: &mut Vec<BatchAction<RememberOutcome>>) {
        match written {
            Err(e) if try_again(self.tries, &e) => self.write(out),
            Err(e) => {
                let results = self.shards.iter().map(|_| StoreResult::Failed).collect();
                out.push(BatchAction::Done(RememberOutcome {
                    results,
                    full_slots: Vec::new(),
                    error: Some(e.to_string()),
                }));
            }
            Ok(()) => {
                // The adds refused for a full slot, by shard (a slot key belongs to one shard).
                let mut refused: BTreeMap<&ShardId, BTreeSet<String>> = BTreeMap::new();
                let mut full_slots = Vec::new();
                for (key, shard, _, full) in &self.keys {
                    let r = full.take();
                    if !r.is_empty() {
                        full_slots.push((key.clone(), r.len()));
                        refused.entry(shard).or_default().extend(r);
                    }
                }
                let results = self
                    .shards
                    .iter()
                    .map(|shard| StoreResult::WriteDone { refused: refused.get(shard).cloned().unwrap_or_default() })
                    .collect();
                out.push(BatchAction::Done(RememberOutcome { results, full_slots, error: None }));
            }
        }
    }
}

/// One entity's state write in a state batch (`value` `None`: delete).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StateRequest {
    pub shard: ShardId,
    pub epoch: u64,
    pub entity_id: String,
    pub value: Option<Vec<u8>>,
}

/// A state write's outcome (before the writer adds what it knows: the error's entity).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StateResult {
    Written,
    /// The key's fence is newer than the write's epoch.
    Fenced {
        key: String,
        epoch: u64,
        fence: u64,
    },
    /// Its slot is at its byte budget.
    SlotFull {
        slot: u32,
    },
    /// The batch was not acknowledged.
    NotPersisted {
        reason: String,
    },
}

impl StateResult {
    /// The write's result as its writer answers it: `entity_id`'s in `shard`, whose slots hold
    /// `slot_budget` bytes.
    pub(crate) fn into_result(self, entity_id: String, shard: String, slot_budget: usize) -> crate::error::Result<()> {
        match self {
            StateResult::Written => Ok(()),
            StateResult::Fenced { key, epoch, fence } => Err(crate::error::Error::Fenced { key, epoch, fence }),
            StateResult::SlotFull { slot } => {
                Err(crate::error::Error::SlotFull { entity_id, shard, slot, budget: slot_budget })
            }
            StateResult::NotPersisted { reason } => Err(crate::error::Error::StateNotPersisted { entity_id, reason }),
        }
    }
}

/// A state batch's outcome.
#[derive(Debug, PartialEq)]
pub(crate) struct StateOutcome {
    /// One per request, in request order.
    pub results: Vec<StateResult>,
    /// Slot keys that refused states for their budget, with how many.
    pub full_slots: Vec<(String, usize)>,
    /// Why the batch failed, if it did.
    pub error: Option<String>,
}

/// The entity id → new encoded state (`None`: delete) writes of one slot key.
type KeyWrites = Vec<(String, Option<Vec<u8>>)>;

/// One slot key's part of a state batch: its epoch, its requests (by index) and their writes.
struct KeyPart {
    key: String,
    epoch: u64,
    requests: Vec<usize>,
    writes: Arc<KeyWrites>,
    refused: FullSlot,
}

/// One group commit of entity states.
pub(crate) struct StateBatch {
    slots: u32,
    budget: usize,
    counters: Arc<RegionCounterCells>,
    /// Each request's entity id, and its outcome once known (stale ones at once).
    requests: Vec<(String, Option<StateResult>)>,
    parts: Vec<KeyPart>,
    tries: usize,
}

impl StateBatch {
    /// Starts a batch of `requests`: per slot key, the writes of its newest epoch go out
    /// (writes of an older epoch of the same shard, queued before its newer instance started
    /// here, are fenced at once).
    pub(crate) fn start(
        space: &str,
        slots: u32,
        budget: usize,
        counters: Arc<RegionCounterCells>,
        requests: Vec<StateRequest>,
        out: &mut Vec<BatchAction<StateOutcome>>,
    ) -> Self {
        let mut outcomes: Vec<(String, Option<StateResult>)> = vec![(String::new(), None); requests.len()];
        let mut by_key: BTreeMap<String, Vec<(usize, StateRequest)>> = BTreeMap::new();
        for (index, req) in requests.into_iter().enumerate() {
            let key = keys::slot_key(space, &req.shard, remembered_slot(&req.entity_id, slots));
            by_key.entry(key).or_default().push((index, req));
        }
        let mut parts = Vec::new();
        for (key, reqs) in by_key {
            let epoch = reqs.iter().map(|(_, r)| r.epoch).max().unwrap_or_default();
            let (mut indices, mut writes) = (Vec::new(), Vec::new());
            for (index, r) in reqs {
                if r.epoch == epoch {
                    indices.push(index);
                    writes.push((r.entity_id.clone(), r.value));
                    outcomes[index] = (r.entity_id, None);
                } else {
                    let stale = StateResult::Fenced { key: key.clone(), epoch: r.epoch, fence: epoch };
                    outcomes[index] = (r.entity_id, Some(stale));
                }
            }
            let writes = Arc::new(writes);
            parts.push(KeyPart { key, epoch, requests: indices, writes, refused: FullSlot::default() });
        }
        let mut batch = StateBatch { slots, budget, counters, requests: outcomes, parts, tries: 0 };
        batch.write(out);
        batch
    }

    fn write(&mut self, out: &mut Vec<BatchAction<StateOutcome>>) {
        self.tries += 1;
        let updates = self
            .parts
            .iter()
            .map(|part| {
                let (epoch, writes, refused, budget) =
                    (part.epoch, Arc::clone(&part.writes), part.refused.clone(), self.budget);
                let counters = Arc::clone(&self.counters);
                KeyUpdate::new::<FencedMap, _>(&part.key, move |m, ctx| {
                    // Each try decides afresh on the replica as it is then.
                    let mut refused = refused.start_try();
                    for (id, value) in writes.iter() {
                        let written = match value {
                            Some(bytes) if !m.fits(id, epoch, bytes.len(), budget) => {
                                refused.insert(id.clone());
                                continue;
                            }
                            Some(bytes) => m.put(id.clone(), epoch, bytes.clone()),
                            None => m.delete(id, epoch),
                        };
                        if let Err(f) = written {
                            // One shard, one epoch per key: the first refusal is every one's.
                            ctx.refuse(f);
                            return;
                        }
                    }
                    counters.slot_bytes_high_water.fetch_max(m.approx_bytes() as u64, Ordering::Relaxed);
                })
            })
            .collect();
        out.push(BatchAction::Write(updates));
    }

    /// The outcome of the latest try: the keys refused by their fence, or why it failed.
    pub(crate) fn handle(
        &mut self,
        written: Result<Vec<(String, Fenced)>, Error>,
        out: &mut Vec<BatchAction<StateOutcome>>,
    ) {
        let (mut full_slots, mut error) = (Vec::new(), None);
        match written {
            Err(e) if try_again(self.tries, &e) => return self.write(out),
            Err(e) => {
                let reason = e.to_string();
                for part in &self.parts {
                    for &index in &part.requests {
                        self.requests[index].1 = Some(StateResult::NotPersisted { reason: reason.clone() });
                    }
                }
                error = Some(reason);
            }
            Ok(fenced) => {
                let fenced: BTreeMap<String, u64> = fenced.into_iter().map(|(k, f)| (k, f.fence)).collect();
                for part in &self.parts {
                    let refused = part.refused.take();
                    let fence = fenced.get(&part.key).copied();
                    if !refused.is_empty() && fence.is_none() {
                        full_slots.push((part.key.clone(), refused.len()));
                    }
                    for &index in &part.requests {
                        let (entity_id, result) = &mut self.requests[index];
                        *result = Some(match fence {
                            Some(fence) => StateResult::Fenced { key: part.key.clone(), epoch: part.epoch, fence },
                            None if refused.contains(entity_id) => {
                                StateResult::SlotFull { slot: remembered_slot(entity_id, self.slots) }
                            }
                            None => StateResult::Written,
                        });
                    }
                }
            }
        }
        let results = self.requests.iter_mut().map(|(_, r)| r.take().expect("every request decided")).collect();
        out.push(BatchAction::Done(StateOutcome { results, full_slots, error }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddata::ReplicatedData;
    use crate::ddata::crdt::WriteCtx;

    #[test]
    fn shards_that_failed_together_restart_spread_over_a_quarter_of_the_backoff_the_same_on_every_node() {
        let backoff = Duration::from_secs(10);
        let waits: Vec<Duration> = (0..200).map(|k| shard_restart_after(backoff, &k.to_string(), 7)).collect();
        assert!(waits.iter().all(|w| *w >= backoff && *w <= backoff * 5 / 4), "{waits:?}");
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*max - *min > backoff / 5, "spread over most of the quarter: {min:?}..{max:?}");
        let distinct: BTreeSet<Duration> = waits.iter().copied().collect();
        assert!(distinct.len() > 190, "hardly two shards at one instant: {}", distinct.len());
        assert_eq!(shard_restart_after(backoff, "3", 7), waits[3], "the same wait wherever it is computed");
        assert_ne!(shard_restart_after(backoff, "3", 8), waits[3], "another epoch, another wait");
    }

    /// One replica: its values by key, updated as the replicator core applies a write.
    #[derive(Default)]
    struct Replica(BTreeMap<String, ReplicatedData>);

    impl Replica {
        /// Applies the updates; the keys a fence refused.
        fn apply(&mut self, updates: Vec<KeyUpdate>) -> Vec<(String, Fenced)> {
            let mut fenced = Vec::new();
            for update in updates {
                let (key, modify) = update.into_parts();
                let mut ctx = WriteCtx::new("n1#1", 1);
                if let Some(created) = modify(self.0.get_mut(&key), &mut ctx).unwrap() {
                    self.0.insert(key.clone(), created);
                }
                if let Some(f) = ctx.fenced.take() {
                    fenced.push((key, f));
                }
            }
            fenced
        }

        fn set(&self, key: &str) -> BTreeSet<String> {
            match self.0.get(key) {
                Some(ReplicatedData::OrSet(s)) => s.members().into_iter().collect(),
                _ => BTreeSet::new(),
            }
        }
    }

    fn ids(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn request(shard: &str, adds: &[&str], removes: &[&str]) -> RememberRequest {
        RememberRequest { shard: shard.into(), adds: ids(adds), removes: ids(removes) }
    }

    fn timeout() -> Error {
        Error::ConsistencyTimeout { needed: 2, acked: 1 }
    }

    fn updates<O>(out: &mut Vec<BatchAction<O>>) -> Vec<KeyUpdate> {
        match out.pop() {
            Some(BatchAction::Write(u)) if out.is_empty() => u,
            _ => panic!("expected one write"),
        }
    }

    #[test]
    fn each_try_waits_a_quarter_of_the_update_timeout_at_least_100_ms_and_states_and_remembered_ids_use_their_own_quorums()
     {
        let s = |ms| ShardingSettings {
            coordinator: crate::sharding::ShardCoordinatorSettings {
                updating_state_timeout: Duration::from_millis(ms),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(write_timeout(&s(2_000)), Duration::from_millis(500));
        assert_eq!(write_timeout(&s(200)), Duration::from_millis(100));
        let s = ShardingSettings {
            state: crate::sharding::DurableStateSettings {
                write_majority_plus: 1,
                read_majority_plus: 2,
                majority_min_cap: 3,
                ..Default::default()
            },
            remember: crate::sharding::RememberEntitiesSettings {
                write_majority_plus: 4,
                read_majority_plus: 5,
                majority_min_cap: 6,
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(state_write_consistency(&s), Consistency::Majority { plus: 1, min_cap: 3 });
        assert_eq!(state_read_consistency(&s), Consistency::AllReachable { plus: 2, min_cap: 3 });
        assert_eq!(remember_write_consistency(&s), Consistency::Majority { plus: 4, min_cap: 6 });
        assert_eq!(remember_read_consistency(&s), Consistency::AllReachable { plus: 5, min_cap: 6 });
    }

    #[test]
    fn a_load_is_tried_again_only_after_a_consistency_timeout_and_at_most_three_times() {
        let timeout = Error::ConsistencyTimeout { needed: 3, acked: 2 };
        assert!(load_again(1, &timeout));
        assert!(load_again(2, &timeout));
        assert!(!load_again(3, &timeout), "the third try was the last");
        assert!(!load_again(1, &Error::ShutDown));
        assert!(!load_again(1, &Error::NotEnoughReplicas { needed: 3, reachable: 1 }), "no quorum: the backoff");
    }

    #[test]
    fn a_remember_batch_writes_each_slot_key_once_across_shards_and_answers_each_request() {
        let counters = Arc::new(RegionCounterCells::default());
        let mut out = Vec::new();
        let requests = vec![request("1", &["a", "b", "c"], &[]), request("2", &["a"], &["z"])];
        let mut batch = RememberBatch::start("t", 2, 1 << 20, counters.clone(), requests, &mut out);
        assert_eq!(batch.ids(), 5);
        let mut replica = Replica::default();
        let written = updates(&mut out);
        let keys: BTreeSet<String> = written.iter().map(|u| u.key().to_string()).collect();
        let expected: BTreeSet<String> = [("1", "a"), ("1", "b"), ("1", "c"), ("2", "a"), ("2", "z")]
            .iter()
            .map(|(shard, id)| keys::remembered_entities("t", shard, remembered_slot(id, 2)))
            .collect();
        assert_eq!(keys, expected, "one update per slot key touched");
        assert!(replica.apply(written).is_empty());
        let all: BTreeSet<String> = keys.iter().flat_map(|k| replica.set(k)).collect();
        assert_eq!(all, ids(&["a", "b", "c"]), "adds written, the absent remove a no-op");
        assert!(counters.slot_bytes_high_water.load(Ordering::Relaxed) > 0, "the gauge follows the slot");
        batch.handle(Ok(()), &mut out);
        match out.as_slice() {
            [BatchAction::Done(o)] => {
                let done = StoreResult::WriteDone { refused: BTreeSet::new() };
                assert_eq!(o, &RememberOutcome { results: vec![done.clone(), done], full_slots: vec![], error: None });
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_remember_batch_is_tried_three_times_then_every_request_fails_and_a_shutdown_ends_it_at_once() {
        let counters = Arc::new(RegionCounterCells::default());
        let mut out = Vec::new();
        let mut batch =
            RememberBatch::start("t", 4, 1 << 20, counters.clone(), vec![request("1", &["a"], &[])], &mut out);
        for _ in 1..WRITE_TRIES {
            updates(&mut out);
            batch.handle(Err(timeout()), &mut out);
        }
        updates(&mut out);
        batch.handle(Err(timeout()), &mut out);
        match out.as_slice() {
            [BatchAction::Done(o)] => {
                assert_eq!(o.results, vec![StoreResult::Failed]);
                assert!(o.error.as_deref().is_some_and(|e| e.contains("consistency")), "{o:?}");
            }
            other => panic!("after {WRITE_TRIES} tries: {other:?}"),
        }
        let mut out = Vec::new();
        let mut batch = RememberBatch::start("t", 4, 1 << 20, counters, vec![request("1", &["a"], &[])], &mut out);
        updates(&mut out);
        batch.handle(Err(Error::ShutDown), &mut out);
        assert!(matches!(out.as_slice(), [BatchAction::Done(o)] if o.results == vec![StoreResult::Failed]));
    }

    #[test]
    fn a_full_remember_slot_refuses_new_adds_on_each_try_afresh_and_removes_make_room() {
        let counters = Arc::new(RegionCounterCells::default());
        let key = keys::remembered_entities("t", "1", 0);
        let mut replica = Replica::default();
        // A budget that fits a few ids of this length in one slot.
        let id = |k: usize| format!("{k:03}-{}", "x".repeat(60));
        let first: Vec<String> = (0..40).map(id).collect();
        let adds: Vec<&str> = first.iter().map(String::as_str).collect();
        let mut out = Vec::new();
        let mut batch = RememberBatch::start("t", 1, 600, counters.clone(), vec![request("1", &adds, &[])], &mut out);
        replica.apply(updates(&mut out));
        batch.handle(Ok(()), &mut out);
        let (stored, refused) = match out.pop() {
            Some(BatchAction::Done(o)) => {
                let Some(StoreResult::WriteDone { refused }) = o.results.first().cloned() else { panic!("{o:?}") };
                assert_eq!(o.full_slots, vec![(key.clone(), refused.len())]);
                (replica.set(&key), refused)
            }
            other => panic!("{other:?}"),
        };
        assert!(!stored.is_empty() && !refused.is_empty(), "some fit, some refused");
        assert_eq!(stored.len() + refused.len(), 40);
        assert!(stored.is_disjoint(&refused), "a refused id is not written");
        let high = counters.slot_bytes_high_water.load(Ordering::Relaxed);
        assert!(high <= 600 && high > 400, "the slot filled to its budget and no further: {high}");
        // A try that fails, then one that succeeds: the second decides afresh. The batch
        // removes two stored ids and adds two refused ones, which now fit.
        let removed: Vec<&str> = stored.iter().take(2).map(String::as_str).collect();
        let added: Vec<&str> = refused.iter().take(2).map(String::as_str).collect();
        let mut batch = RememberBatch::start("t", 1, 600, counters, vec![request("1", &added, &removed)], &mut out);
        let mut lost = Replica::default();
        lost.apply(updates(&mut out));
        batch.handle(Err(timeout()), &mut out);
        replica.apply(updates(&mut out));
        batch.handle(Ok(()), &mut out);
        match out.pop() {
            Some(BatchAction::Done(o)) => {
                assert_eq!(o.results, vec![StoreResult::WriteDone { refused: BTreeSet::new() }]);
                assert!(o.full_slots.is_empty());
            }
            other => panic!("{other:?}"),
        }
        let now = replica.set(&key);
        assert!(added.iter().all(|a| now.contains(*a)) && removed.iter().all(|r| !now.contains(*r)));
    }

    fn state(shard: &str, epoch: u64, id: &str, value: Option<&[u8]>) -> StateRequest {
        StateRequest { shard: shard.into(), epoch, entity_id: id.into(), value: value.map(<[u8]>::to_vec) }
    }

    fn state_done(out: &mut Vec<BatchAction<StateOutcome>>) -> StateOutcome {
        match out.pop() {
            Some(BatchAction::Done(o)) if out.is_empty() => o,
            _ => panic!("expected the outcome"),
        }
    }

    #[test]
    fn a_state_batch_writes_the_newest_epoch_per_key_fences_older_ones_at_once_and_answers_in_order() {
        let counters = Arc::new(RegionCounterCells::default());
        let key = keys::entity_states("t", "1", 0);
        let requests =
            vec![state("1", 5, "a", Some(b"old")), state("1", 6, "b", Some(b"new")), state("1", 6, "c", None)];
        let mut out = Vec::new();
        let mut batch = StateBatch::start(&keys::state_space("t"), 1, 1 << 20, counters, requests, &mut out);
        let mut replica = Replica::default();
        assert!(replica.apply(updates(&mut out)).is_empty());
        batch.handle(Ok(Vec::new()), &mut out);
        let o = state_done(&mut out);
        assert_eq!(
            o.results,
            vec![
                StateResult::Fenced { key: key.clone(), epoch: 5, fence: 6 },
                StateResult::Written,
                StateResult::Written
            ]
        );
        assert!(o.full_slots.is_empty() && o.error.is_none(), "nothing refused for the budget: {o:?}");
        match replica.0.get(&key) {
            Some(ReplicatedData::FencedMap(m)) => {
                assert_eq!(m.get("b"), Some(&b"new"[..]));
                assert_eq!(m.get("a"), None, "the stale write never went out");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_state_key_refused_by_a_newer_claim_fails_its_writes_with_fenced_and_is_not_retried() {
        let counters = Arc::new(RegionCounterCells::default());
        let key = keys::entity_states("t", "1", 0);
        let mut replica = Replica::default();
        // A newer allocation claimed the slot at epoch 9.
        replica.apply(vec![KeyUpdate::new::<FencedMap, _>(&key, |m, _| m.claim(9).unwrap())]);
        let mut out = Vec::new();
        let mut batch = StateBatch::start(
            &keys::state_space("t"),
            1,
            1 << 20,
            counters,
            vec![state("1", 7, "a", Some(b"v"))],
            &mut out,
        );
        let fenced = replica.apply(updates(&mut out));
        assert_eq!(fenced.len(), 1);
        batch.handle(Ok(fenced), &mut out);
        assert_eq!(state_done(&mut out).results, vec![StateResult::Fenced { key, epoch: 7, fence: 9 }]);
    }

    #[test]
    fn a_state_batch_failing_every_try_answers_not_persisted_and_a_full_slot_answers_slot_full() {
        let counters = Arc::new(RegionCounterCells::default());
        let mut out = Vec::new();
        let mut batch = StateBatch::start(
            &keys::state_space("t"),
            4,
            1 << 20,
            counters.clone(),
            vec![state("1", 1, "a", Some(b"v"))],
            &mut out,
        );
        for _ in 0..WRITE_TRIES {
            updates(&mut out);
            batch.handle(Err(timeout()), &mut out);
        }
        let o = state_done(&mut out);
        assert!(matches!(o.results.as_slice(), [StateResult::NotPersisted { .. }]), "{o:?}");
        assert!(o.error.is_some());
        // A budget of 100 bytes: the first state fits, the second not.
        let key = keys::entity_states("t", "1", remembered_slot("b", 1));
        let requests = vec![state("1", 1, "a", Some(&[0; 40])), state("1", 1, "b", Some(&[0; 80]))];
        let mut batch = StateBatch::start(&keys::state_space("t"), 1, 100, counters, requests, &mut out);
        let mut replica = Replica::default();
        replica.apply(updates(&mut out));
        batch.handle(Ok(Vec::new()), &mut out);
        let o = state_done(&mut out);
        assert_eq!(o.results, vec![StateResult::Written, StateResult::SlotFull { slot: 0 }]);
        assert_eq!(o.full_slots, vec![(key, 1)]);
    }
}
