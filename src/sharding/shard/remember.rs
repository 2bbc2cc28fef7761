//! Remember-entities I/O of a region's shards: the read of a shard's remembered ids at start,
//! and one remember writer per region that group-commits the starts and stops of all its shards
//! (one multi-key update, so one delta message per replica and one LMDB
//! transaction per node, per batch). Each answers the shard with a [`ShardEvent::Store`] (or
//! feeds recovery in batches with [`ShardEvent::Recover`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::batch::{
    BatchAction, RememberBatch, RememberRequest, load_again, remember_read_consistency, remember_write_consistency,
    write_timeout,
};
use super::{RegionParts, ShardEvent, StoreResult, report_full_slot};
use crate::ddata::{Consistency, OrSet, Replicator};
use crate::log_limit::LogLimiter;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::ids::ShardId;
use crate::sharding::{Entity, keys};
use crate::spawn::Spawner;

/// What the remember I/O of one region needs. Cloning shares the region's remember writer.
#[derive(Clone)]
pub(crate) struct RememberIo {
    pub replicator: Replicator,
    pub spawner: Spawner,
    pub type_name: String,
    pub slots: u32,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    /// The remember store's quorums (`sharding.remember`).
    pub read_consistency: Consistency,
    pub write_consistency: Consistency,
    pub recovery_batch: usize,
    pub recovery_interval: Duration,
    /// Largest a slot may grow to (approximate encoded bytes): one replicator message.
    pub slot_budget: usize,
    writer: mpsc::UnboundedSender<WriteRequest>,
    counters: Arc<RegionCounterCells>,
    /// Batch sizes and write times (feature `metrics`).
    metrics: Arc<crate::metrics::TypeMetrics>,
}

/// One shard's starts and stops, and what to do with the outcome.
struct WriteRequest {
    shard: ShardId,
    adds: BTreeSet<String>,
    removes: BTreeSet<String>,
    done: Box<dyn FnOnce(StoreResult) + Send>,
    queued_at: std::time::Instant,
}

/// The slot keys of a shard's remembered ids: its load reads them all in one round.
pub(crate) fn slot_keys(type_name: &str, shard: &str, slots: u32) -> Vec<String> {
    (0..slots).map(|slot| keys::remembered_entities(type_name, shard, slot)).collect()
}

/// The ids a shard's load found: every member of every slot.
pub(crate) fn loaded_ids(slots: Vec<Option<OrSet>>) -> BTreeSet<String> {
    slots.into_iter().flatten().flat_map(|set| set.members()).collect()
}

impl RememberIo {
    /// Starts the region's remember writer (group commit: the starts and stops of all its
    /// shards go out together, one multi-key update per batch; the next batch
    /// accumulates while one is in flight).
    pub(crate) fn new(parts: &RegionParts) -> Self {
        let s = &parts.settings;
        let (writer, requests) = mpsc::unbounded_channel();
        let io = RememberIo {
            replicator: parts.replicator.clone(),
            spawner: parts.spawner.clone(),
            type_name: parts.type_name.to_string(),
            slots: s.remember.slots,
            read_timeout: s.coordinator.waiting_for_state_timeout,
            write_timeout: write_timeout(s),
            read_consistency: remember_read_consistency(s),
            write_consistency: remember_write_consistency(s),
            recovery_batch: s.remember.recovery_batch,
            recovery_interval: s.remember.recovery_interval,
            slot_budget: parts.slot_budget,
            writer,
            counters: parts.counters.clone(),
            metrics: parts.metrics.clone(),
        };
        io.spawner.spawn_until_shutdown(io.clone().run_writer(requests));
        io
    }

    async fn run_writer(self, mut requests: mpsc::UnboundedReceiver<WriteRequest>) {
        let mut batch = Vec::new();
        // One warning a minute per full slot.
        let mut full_log = LogLimiter::new(Duration::from_secs(60));
        while requests.recv_many(&mut batch, 4096).await > 0 {
            let started = std::time::Instant::now();
            let waited: u128 = batch.iter().map(|r| started.duration_since(r.queued_at).as_micros()).sum();
            add(&self.counters.remember_queue_wait_micros, waited);
            add(&self.counters.remember_requests, batch.len());
            let (changes, done): (Vec<RememberRequest>, Vec<_>) = batch
                .drain(..)
                .map(|r| (RememberRequest { shard: r.shard, adds: r.adds, removes: r.removes }, r.done))
                .unzip();
            let (counters, mut out) = (Arc::clone(&self.counters), Vec::new());
            let mut core =
                RememberBatch::start(&self.type_name, self.slots, self.slot_budget, counters, changes, &mut out);
            let ids = core.ids();
            add(&self.counters.remember_ids_written, ids);
            let outcome = loop {
                match out.pop() {
                    Some(BatchAction::Write(updates)) => {
                        let written =
                            self.replicator.update_many(self.write_consistency, self.write_timeout, updates).await;
                        core.handle(written, &mut out);
                    }
                    Some(BatchAction::Done(outcome)) => break outcome,
                    None => unreachable!("a remember batch ends with its outcome"),
                }
            };
            add(&self.counters.remember_round_micros, started.elapsed().as_micros());
            add(&self.counters.remember_batches, 1u8);
            self.metrics.remember_batch_written(ids, started);
            if let Some(error) = &outcome.error {
                warn!(type_name = %self.type_name, shards = done.len(), %error, "recording remembered entities failed");
            }
            for (key, refused) in &outcome.full_slots {
                let what = "remembered-entity (raise sharding.remember.slots, or find the client)";
                report_full_slot(&self.counters, &mut full_log, &self.type_name, key, self.slot_budget, *refused, what);
            }
            debug!(type_name = %self.type_name, shards = done.len(), ids, "remember batch written");
            for (done, result) in done.into_iter().zip(outcome.results) {
                done(result);
            }
        }
    }

    /// Loads the shard's remembered ids with one read of all its slots (every reachable
    /// replica, at least a majority of the roster; tried again as [`load_again`] says), gives
    /// `permit` back, then, with a recovery batch set, feeds the ids back in batches at the
    /// configured rate.
    pub(crate) async fn load<E: Entity>(
        self,
        shard: ShardId,
        instance: u64,
        events: mpsc::UnboundedSender<ShardEvent<E>>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let io = self;
        let mut tries = 0;
        let ids = loop {
            tries += 1;
            let keys = slot_keys(&io.type_name, &shard, io.slots);
            let read = io.replicator.get_many::<OrSet>(keys, io.read_consistency, io.read_timeout).await;
            if matches!(read, Err(crate::error::Error::ConsistencyTimeout { .. })) {
                io.counters.shard_load_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            match read {
                Ok(sets) => break loaded_ids(sets),
                Err(e) if load_again(tries, &e) => {
                    debug!(type_name = %io.type_name, %shard, error = %e, tries, "loading remembered entities again");
                }
                Err(e) => {
                    warn!(type_name = %io.type_name, %shard, error = %e, "loading remembered entities failed");
                    let _ = events.send(ShardEvent::Store { shard, instance, input: StoreResult::Failed });
                    return;
                }
            }
        };
        drop(permit);
        debug!(type_name = %io.type_name, %shard, entities = ids.len(), "remembered entities loaded");
        let all: Vec<String> = ids.iter().cloned().collect();
        // The shard takes the set first; recovery starts follow (at the configured rate).
        let _ = events.send(ShardEvent::Store { shard: shard.clone(), instance, input: StoreResult::Loaded(ids) });
        if io.recovery_batch > 0 {
            for chunk in all.chunks(io.recovery_batch) {
                tokio::time::sleep(io.recovery_interval).await;
                let ev = ShardEvent::Recover { shard: shard.clone(), instance, entity_ids: chunk.to_vec() };
                if events.send(ev).is_err() {
                    return;
                }
            }
        }
    }

    /// Records starts and stops of a shard's entities: queued to the region's remember writer,
    /// which answers the shard with a [`ShardEvent::Store`] once its batch is written.
    pub(crate) fn write<E: Entity>(
        &self,
        shard: ShardId,
        instance: u64,
        adds: BTreeSet<String>,
        removes: BTreeSet<String>,
        events: mpsc::UnboundedSender<ShardEvent<E>>,
    ) {
        let reply_shard = shard.clone();
        let done = Box::new(move |input| {
            let _ = events.send(ShardEvent::Store { shard: reply_shard, instance, input });
        });
        let queued_at = std::time::Instant::now();
        if self.writer.send(WriteRequest { shard, adds, removes, done, queued_at }).is_err() {
            debug!(type_name = %self.type_name, "remember writer stopped (shutting down)");
        }
    }
}

fn add(counter: &AtomicU64, n: impl TryInto<u64>) {
    counter.fetch_add(n.try_into().unwrap_or(u64::MAX), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddata::crdt::WriteCtx;

    #[test]
    fn a_load_reads_every_slot_of_its_shard_and_finds_every_member_of_each() {
        assert_eq!(slot_keys("t", "7", 3), ["shard-t/7/0", "shard-t/7/1", "shard-t/7/2"]);
        let ctx = WriteCtx::new("n1#1", 1);
        let set = |ids: &[&str]| {
            let mut s = OrSet::default();
            for id in ids {
                s.add(&ctx, id);
            }
            Some(s)
        };
        let ids = loaded_ids(vec![set(&["a", "b"]), None, set(&["c"]), set(&[])]);
        assert_eq!(ids, BTreeSet::from(["a".to_string(), "b".to_string(), "c".to_string()]));
        assert!(loaded_ids(vec![None, None]).is_empty());
    }
}
