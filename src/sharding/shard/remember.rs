//! Remember-entities I/O of a shard: the majority read of its remembered ids at start, and the
//! majority writes of the starts and stops the shard core batches. Each answers the shard with
//! a [`ShardEvent::Store`] (or feeds recovery in batches with [`ShardEvent::Recover`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::{ShardEvent, StoreResult};
use crate::ddata::{Consistency, OrSet, Replicator};
use crate::sharding::ids::{ShardId, remembered_slot};
use crate::sharding::settings::ShardingSettings;
use crate::sharding::{Entity, keys};
use crate::spawn::Spawner;

/// Consistency of remembered-entity reads and writes: plain majorities, so a shard keeps working
/// while a minority of nodes is unreachable (majority reads and writes always intersect).
const REMEMBER_CONSISTENCY: Consistency = Consistency::MAJORITY;

/// Tries of each remembered-entity write (Akka's policy: a few tries with a quarter of the
/// update timeout each).
const WRITE_TRIES: usize = 3;

/// What the remember I/O of one region needs.
#[derive(Clone)]
pub(crate) struct RememberIo {
    pub replicator: Replicator,
    pub spawner: Spawner,
    pub type_name: String,
    pub slots: u32,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub recovery_batch: usize,
    pub recovery_interval: Duration,
}

impl RememberIo {
    pub(crate) fn new(replicator: Replicator, spawner: Spawner, type_name: &str, s: &ShardingSettings) -> Self {
        RememberIo {
            replicator,
            spawner,
            type_name: type_name.to_string(),
            slots: s.remember_entities_slots,
            read_timeout: s.waiting_for_state_timeout,
            write_timeout: (s.updating_state_timeout / 4).max(Duration::from_millis(100)),
            recovery_batch: s.entity_recovery_batch,
            recovery_interval: s.entity_recovery_interval,
        }
    }

    /// Loads the shard's remembered ids with a majority read of every slot; then, with a
    /// recovery batch set, feeds them back in batches at the configured rate.
    pub(crate) fn load<E: Entity>(&self, shard: ShardId, instance: u64, events: mpsc::UnboundedSender<ShardEvent<E>>) {
        let io = self.clone();
        self.spawner.spawn_until_shutdown(async move {
            let reads = (0..io.slots).map(|slot| {
                let key = keys::remembered_entities(&io.type_name, &shard, slot);
                let replicator = io.replicator.clone();
                async move { replicator.get::<OrSet>(&key, REMEMBER_CONSISTENCY, io.read_timeout).await }
            });
            let mut ids = BTreeSet::new();
            for r in futures::future::join_all(reads).await {
                match r {
                    Ok(set) => ids.extend(set.map(|s| s.members()).unwrap_or_default()),
                    Err(e) => {
                        warn!(type_name = %io.type_name, %shard, error = %e, "loading remembered entities failed");
                        let _ = events.send(ShardEvent::Store { shard, instance, input: StoreResult::Failed });
                        return;
                    }
                }
            }
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
        });
    }

    /// Records starts and stops of a shard's entities: one majority update per touched slot.
    pub(crate) fn write<E: Entity>(
        &self,
        shard: ShardId,
        instance: u64,
        adds: BTreeSet<String>,
        removes: BTreeSet<String>,
        events: mpsc::UnboundedSender<ShardEvent<E>>,
    ) {
        let io = self.clone();
        self.spawner.spawn_until_shutdown(async move {
            let mut by_slot: BTreeMap<u32, (Vec<String>, Vec<String>)> = BTreeMap::new();
            for id in adds {
                by_slot.entry(remembered_slot(&id, io.slots)).or_default().0.push(id);
            }
            for id in removes {
                by_slot.entry(remembered_slot(&id, io.slots)).or_default().1.push(id);
            }
            let writes = by_slot.into_iter().map(|(slot, (adds, removes))| {
                let key = keys::remembered_entities(&io.type_name, &shard, slot);
                let replicator = io.replicator.clone();
                async move {
                    let mut last = Ok(());
                    for _ in 0..WRITE_TRIES {
                        let (a, r) = (adds.clone(), removes.clone());
                        last = replicator
                            .update::<OrSet, _>(&key, REMEMBER_CONSISTENCY, io.write_timeout, move |set, ctx| {
                                if !a.is_empty() {
                                    set.add_all(ctx, a);
                                }
                                for id in &r {
                                    set.remove(id);
                                }
                            })
                            .await;
                        if last.is_ok() {
                            break;
                        }
                    }
                    last
                }
            });
            let mut result = StoreResult::WriteDone;
            for r in futures::future::join_all(writes).await {
                if let Err(e) = r {
                    warn!(type_name = %io.type_name, %shard, error = %e, "recording remembered entities failed");
                    result = StoreResult::Failed;
                }
            }
            let _ = events.send(ShardEvent::Store { shard, instance, input: result });
        });
    }
}
