//! Durable entity state I/O of a region: the claim-and-load of a shard's states when the shard
//! starts, the read of one entity's state when it starts, and one state writer per region that
//! group-commits the writes of all its entities (one multi-key majority update per batch, so
//! one delta message per replica and one LMDB transaction per node).
//!
//! **Storage.** A shard's states live in `state.slots` fenced maps (entity id → encoded state,
//! spread by id hash), durable on every replica. Every write carries the shard's allocation
//! epoch, the most significant part of its order, so a write under a newer allocation wins
//! whatever the clocks say.
//!
//! **Claim.** A shard instance starting under epoch `e` first claims every slot at `e` on a
//! majority-plus of replicas, which store the claim before they answer with their values (see
//! [`Replicator::update_and_get_many`]). From then on none of those replicas takes a write of
//! an older epoch (it answers the writer that it is fenced), so an older incarnation still
//! running elsewhere cannot get a write acknowledged that this one did not load; and every
//! write it got acknowledged before is in what this one read. The values the claim read are
//! merged into this node's replica, so an entity's state is then read locally.
//!
//! **Quorums.** Counted over the replicator's roster (every replica holder not forgotten,
//! reachable or not, by node id), so downing cannot shrink them. Writes at a majority (plus
//! `state.write_majority_plus`). A claim reads every replica reachable when it starts, and
//! never fewer than a majority plus `state.read_majority_plus` (0 by default): a write
//! acknowledged by a majority is read as long as one of its holders is reachable, and always
//! when a majority of the roster is. Gossip copies every write to every replica within seconds
//! besides.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::ddata::{Consistency, FencedMap, KeyUpdate, Replicator};
use crate::error::{Error, Result};
use crate::log_limit::LogLimiter;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::ids::{ShardId, remembered_slot};
use crate::sharding::keys;
use crate::sharding::shard::batch::{
    BatchAction, StateBatch, StateRequest, StateResult, load_again, state_read_consistency, state_write_consistency,
    write_timeout,
};
use crate::sharding::shard::{RegionParts, report_full_slot};

/// Most writes one batch takes (the rest wait for the next; a request of several writes is
/// never split).
pub(crate) const MAX_BATCH: usize = 4096;

/// The state store of one region's durable entities; cheap to clone.
#[derive(Clone)]
pub(crate) struct StateIo {
    inner: Arc<Inner>,
}

struct Inner {
    replicator: Replicator,
    type_name: String,
    /// The key space of its slots ([`keys::state_space`] or [`keys::producer_space`]).
    space: String,
    slots: u32,
    max_state_bytes: usize,
    /// Largest a slot may grow to (approximate encoded bytes): one replicator message.
    slot_budget: usize,
    write_consistency: Consistency,
    read_consistency: Consistency,
    write_timeout: Duration,
    read_timeout: Duration,
    writer: mpsc::UnboundedSender<WriteRequest>,
    counters: Arc<RegionCounterCells>,
}

impl std::fmt::Debug for StateIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateIo").field("type_name", &self.inner.type_name).finish_non_exhaustive()
    }
}

/// Writes under one owner (a shard, or a producer's queue) and epoch, answered together: each
/// entry's new encoded value (`None`: delete). An entity writes one at a time; a producer
/// hands over every write its core asked for meanwhile, in order.
struct WriteRequest {
    shard: ShardId,
    epoch: u64,
    writes: Vec<(String, Option<Vec<u8>>)>,
    done: oneshot::Sender<Vec<Result<()>>>,
}

/// The claim of every state slot of `shard` in key space `space` at `epoch` (see the module
/// documentation): a slot whose fence is newer refuses it.
pub(crate) fn claim_updates(space: &str, shard: &str, slots: u32, epoch: u64) -> Vec<KeyUpdate> {
    (0..slots)
        .map(|slot| {
            KeyUpdate::new::<FencedMap, _>(&keys::slot_key(space, shard, slot), move |m, ctx| {
                if let Err(f) = m.claim(epoch) {
                    ctx.refuse(f);
                }
            })
        })
        .collect()
}

/// What the answer to try `tries` of a shard's claim at `epoch` means.
#[derive(Debug)]
pub(crate) enum ClaimOutcome {
    /// Claimed: this node's replica now holds every state a majority acknowledged.
    Claimed { states: usize },
    /// Claim again: every replica has to answer for the load (a majority plus one by default),
    /// so a slow one is asked again before the shard fails and waits out its backoff.
    Again,
    /// The shard fails: [`Error::Fenced`] when a replica held a newer claim (this allocation is
    /// stale already), or why the claim could not be read.
    Failed(Error),
}

/// The claim-and-load rule (see the module documentation), one for the state I/O and the
/// simulation: tried again as [`load_again`] says.
pub(crate) fn claim_outcome(
    space: &str,
    shard: &str,
    epoch: u64,
    tries: usize,
    read: Result<Vec<Option<FencedMap>>>,
) -> ClaimOutcome {
    let values = match read {
        Ok(values) => values,
        Err(e) if load_again(tries, &e) => return ClaimOutcome::Again,
        Err(e) => return ClaimOutcome::Failed(e),
    };
    let mut states = 0;
    for (slot, map) in values.iter().enumerate() {
        let Some(map) = map else { continue };
        if map.fence() > epoch {
            let key = keys::slot_key(space, shard, slot as u32);
            return ClaimOutcome::Failed(Error::Fenced { key, epoch, fence: map.fence() });
        }
        states += map.len();
    }
    ClaimOutcome::Claimed { states }
}

impl StateIo {
    /// Starts the region's state writer.
    pub(crate) fn new(parts: &RegionParts) -> Self {
        Self::in_space(parts, keys::state_space(&parts.type_name), parts.counters.clone())
    }

    /// Starts a writer of fenced slots in key space `space` (a producer's durable queue: the
    /// same claims, fencing, budgets and group commit as entity states), counting into
    /// `counters`.
    pub(crate) fn in_space(parts: &RegionParts, space: String, counters: Arc<RegionCounterCells>) -> Self {
        let s = &parts.settings;
        // Unbounded in type, bounded in effect: every request is one entity's persist (or
        // delete), and an entity sends the next only after this one answered, so the queue
        // holds at most one state (≤ max_state_bytes) per live entity, which the region's
        // entity count already bounds. A bounded channel would make a full queue block the
        // entity, with nothing gained.
        let (writer, requests) = mpsc::unbounded_channel();
        let io = StateIo {
            inner: Arc::new(Inner {
                replicator: parts.replicator.clone(),
                type_name: parts.type_name.to_string(),
                space,
                slots: s.state.slots,
                max_state_bytes: s.state.max_bytes,
                slot_budget: parts.slot_budget,
                write_consistency: state_write_consistency(s),
                read_consistency: state_read_consistency(s),
                write_timeout: write_timeout(s),
                read_timeout: s.coordinator.waiting_for_state_timeout,
                writer,
                counters,
            }),
        };
        parts.spawner.spawn_until_shutdown(io.clone().run_writer(requests));
        io
    }

    /// The entity type.
    pub(crate) fn type_name(&self) -> &str {
        &self.inner.type_name
    }

    /// Largest encoded state.
    pub(crate) fn max_state_bytes(&self) -> usize {
        self.inner.max_state_bytes
    }

    /// The counters of the region.
    pub(crate) fn counters(&self) -> &RegionCounterCells {
        &self.inner.counters
    }

    fn key(&self, shard: &str, entity_id: &str) -> String {
        keys::slot_key(&self.inner.space, shard, remembered_slot(entity_id, self.inner.slots))
    }

    /// Claims the shard's states for `epoch` and loads them into this node's replica (see the
    /// module documentation). [`Error::Fenced`] when a newer epoch has claimed them already.
    pub(crate) async fn claim_and_load(&self, shard: &str, epoch: u64) -> Result<usize> {
        let io = &self.inner;
        let mut tries = 0;
        loop {
            tries += 1;
            let updates = claim_updates(&io.space, shard, io.slots, epoch);
            let read = io.replicator.update_and_get_many::<FencedMap>(io.read_consistency, io.read_timeout, updates);
            let read = read.await;
            if matches!(read, Err(Error::ConsistencyTimeout { .. })) {
                io.counters.shard_load_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            match claim_outcome(&io.space, shard, epoch, tries, read) {
                ClaimOutcome::Claimed { states } => return Ok(states),
                ClaimOutcome::Again => {
                    debug!(type_name = %io.type_name, %shard, tries, "claiming the states timed out; again");
                }
                ClaimOutcome::Failed(e) => return Err(e),
            }
        }
    }

    /// The highest fence of `owner`'s slots on this node's replica (0 when none is claimed):
    /// where a new claim starts looking for an epoch above every earlier one.
    pub(crate) async fn local_fence(&self, owner: &str) -> Result<u64> {
        let mut fence = 0;
        for slot in 0..self.inner.slots {
            let key = keys::slot_key(&self.inner.space, owner, slot);
            let f = self.inner.replicator.read_local_with::<FencedMap, _, _>(&key, |m| m.fence()).await?;
            fence = fence.max(f.unwrap_or(0));
        }
        Ok(fence)
    }

    /// Every live entry of `owner`'s slots on this node's replica (after its claim: every entry
    /// a majority acknowledged).
    pub(crate) async fn load_all(&self, owner: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut all = Vec::new();
        for slot in 0..self.inner.slots {
            let key = keys::slot_key(&self.inner.space, owner, slot);
            let entries = self.inner.replicator.read_local_with::<FencedMap, _, _>(&key, |m| {
                m.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect::<Vec<_>>()
            });
            all.extend(entries.await?.unwrap_or_default());
        }
        Ok(all)
    }

    /// The stored state of one entity, from this node's replica (which its shard's claim
    /// brought up to date).
    pub(crate) async fn read(&self, shard: &str, entity_id: &str) -> Result<Option<Vec<u8>>> {
        let (id, key) = (entity_id.to_string(), self.key(shard, entity_id));
        let value =
            self.inner.replicator.read_local_with::<FencedMap, _, _>(&key, move |m| m.get(&id).map(<[u8]>::to_vec));
        Ok(value.await?.flatten())
    }

    /// Writes one entity's state (`None`: deletes it) under `epoch`: queued to the region's
    /// state writer, answered once its batch is acknowledged at the write consistency.
    pub(crate) async fn write(&self, shard: &str, epoch: u64, entity_id: &str, value: Option<Vec<u8>>) -> Result<()> {
        let written = self.write_all(shard, epoch, vec![(entity_id.to_string(), value)]).await;
        written.into_iter().next().unwrap_or(Err(Error::ShutDown))
    }

    /// Writes several entries of `owner` under `epoch`, in order, in one request to the
    /// writer (so in one batch): each one's result, in the same order ([`Error::ShutDown`]
    /// for each once the writer is gone).
    pub(crate) async fn write_all(
        &self,
        owner: &str,
        epoch: u64,
        writes: Vec<(String, Option<Vec<u8>>)>,
    ) -> Vec<Result<()>> {
        let count = writes.len();
        let (done, result) = oneshot::channel();
        let req = WriteRequest { shard: owner.to_string(), epoch, writes, done };
        let answered = match self.inner.writer.send(req) {
            Ok(()) => result.await.ok(),
            Err(_) => None,
        };
        answered.unwrap_or_else(|| (0..count).map(|_| Err(Error::ShutDown)).collect())
    }

    /// Takes one batch at a time, every request queued meanwhile (up to [`MAX_BATCH`] writes),
    /// and ends it (its tries included) before the next: a retried write never lands after a
    /// newer write of its key (a producer's durable queue deletes and reuses places relying on
    /// it; the simulation performs its queue writes the same way).
    async fn run_writer(self, mut requests: mpsc::UnboundedReceiver<WriteRequest>) {
        // One warning a minute per full slot.
        let mut full_log = LogLimiter::new(Duration::from_secs(60));
        while let Some(first) = requests.recv().await {
            let mut writes = first.writes.len();
            let mut batch = vec![first];
            while writes < MAX_BATCH {
                let Ok(more) = requests.try_recv() else { break };
                writes += more.writes.len();
                batch.push(more);
            }
            self.write_batch(batch, &mut full_log).await;
        }
    }

    /// Writes one batch as the [`StateBatch`] core decides: per slot key, the writes of its
    /// newest epoch in one fenced-map update (older ones are fenced at once).
    async fn write_batch(&self, batch: Vec<WriteRequest>, full_log: &mut LogLimiter<String>) {
        let io = &self.inner;
        add(&io.counters.state_batches, 1);
        let mut requests = Vec::new();
        let mut done = Vec::with_capacity(batch.len());
        for r in batch {
            done.push((r.done, r.writes.len()));
            requests.extend(r.writes.into_iter().map(|(entity_id, value)| StateRequest {
                shard: r.shard.clone(),
                epoch: r.epoch,
                entity_id,
                value,
            }));
        }
        let shards: Vec<(ShardId, String)> = requests.iter().map(|r| (r.shard.clone(), r.entity_id.clone())).collect();
        let (counters, mut out) = (Arc::clone(&io.counters), Vec::new());
        let mut core = StateBatch::start(&io.space, io.slots, io.slot_budget, counters, requests, &mut out);
        let outcome = loop {
            match out.pop() {
                Some(BatchAction::Write(updates)) => {
                    let written = io.replicator.update_each(io.write_consistency, io.write_timeout, updates).await;
                    core.handle(written, &mut out);
                }
                Some(BatchAction::Done(outcome)) => break outcome,
                None => unreachable!("a state batch ends with its outcome"),
            }
        };
        if let Some(error) = &outcome.error {
            warn!(type_name = %io.type_name, writes = done.len(), %error, "writing entity states failed");
        }
        for (key, refused) in &outcome.full_slots {
            let what = "entity-state (raise sharding.state.slots, or find the client)";
            report_full_slot(&io.counters, full_log, &io.type_name, key, io.slot_budget, *refused, what);
        }
        let mut results = outcome.results.into_iter().zip(shards).map(|(result, (shard, entity_id))| {
            match &result {
                StateResult::Written => add(&io.counters.state_writes, 1),
                StateResult::Fenced { .. } => add(&io.counters.state_fenced, 1),
                _ => {}
            }
            result.into_result(entity_id, shard, io.slot_budget)
        });
        for (done, writes) in done {
            let _ = done.send(results.by_ref().take(writes).collect());
        }
        debug!(type_name = %io.type_name, "state batch written");
    }
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(fence: u64, entries: &[&str]) -> FencedMap {
        let mut m = FencedMap::default();
        m.claim(fence).unwrap();
        for e in entries {
            m.put(e.to_string(), fence, vec![1]).unwrap();
        }
        m
    }

    fn timeout() -> Error {
        Error::ConsistencyTimeout { needed: 3, acked: 2 }
    }

    #[test]
    fn a_claim_claims_every_state_slot_of_its_shard_and_is_refused_where_a_newer_epoch_claimed_first() {
        let updates = claim_updates(&keys::state_space("t"), "4", 3, 9);
        let keys: Vec<&str> = updates.iter().map(|u| u.key()).collect();
        assert_eq!(keys, ["shard-t/4/state-0", "shard-t/4/state-1", "shard-t/4/state-2"]);
        let mut newer = crate::ddata::ReplicatedData::FencedMap(map(12, &[]));
        for (k, update) in updates.into_iter().enumerate() {
            let (_, modify) = update.into_parts();
            let mut ctx = crate::ddata::crdt::WriteCtx::new("n1#1", 1);
            if k == 1 {
                // Slot 1 was claimed at 12 already: the claim at 9 is refused there.
                assert!(modify(Some(&mut newer), &mut ctx).unwrap().is_none());
                assert_eq!(ctx.fenced.map(|f| (f.epoch, f.fence)), Some((9, 12)));
            } else {
                match modify(None, &mut ctx).unwrap() {
                    Some(crate::ddata::ReplicatedData::FencedMap(m)) => assert_eq!(m.fence(), 9),
                    other => panic!("a claimed, empty map: {other:?}"),
                }
                assert!(ctx.fenced.is_none());
            }
        }
    }

    #[test]
    fn a_claim_that_times_out_is_tried_three_times_and_any_other_failure_fails_the_shard_at_once() {
        assert!(matches!(claim_outcome(&keys::state_space("t"), "1", 5, 1, Err(timeout())), ClaimOutcome::Again));
        assert!(matches!(claim_outcome(&keys::state_space("t"), "1", 5, 2, Err(timeout())), ClaimOutcome::Again));
        assert!(matches!(
            claim_outcome(&keys::state_space("t"), "1", 5, 3, Err(timeout())),
            ClaimOutcome::Failed(Error::ConsistencyTimeout { .. })
        ));
        let refused = Error::NotEnoughReplicas { needed: 3, reachable: 1 };
        assert!(matches!(
            claim_outcome(&keys::state_space("t"), "1", 5, 1, Err(refused)),
            ClaimOutcome::Failed(Error::NotEnoughReplicas { .. })
        ));
    }

    #[test]
    fn a_claim_counts_the_states_it_loaded_and_a_newer_fence_on_any_slot_makes_the_allocation_stale() {
        let read = vec![Some(map(5, &["a", "b"])), None, Some(map(4, &["c"]))];
        assert!(matches!(
            claim_outcome(&keys::state_space("t"), "1", 5, 1, Ok(read)),
            ClaimOutcome::Claimed { states: 3 }
        ));
        let read = vec![Some(map(5, &["a"])), Some(map(7, &[]))];
        match claim_outcome(&keys::state_space("t"), "1", 5, 1, Ok(read)) {
            ClaimOutcome::Failed(Error::Fenced { key, epoch, fence }) => {
                assert_eq!((key.as_str(), epoch, fence), ("shard-t/1/state-1", 5, 7))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            claim_outcome(&keys::state_space("t"), "1", 5, 1, Ok(vec![None, None])),
            ClaimOutcome::Claimed { states: 0 }
        ));
    }
}
