//! The direct path's view of the shards a region hosts ([`ShardDirectory`]): what the region's
//! handle reads on every local message, and the region task changes when a shard starts or stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

use super::{Launcher, ShardCell};
use crate::sharding::Entity;
use crate::sharding::envelope::Envelope;
use crate::sharding::ids::{IdMap, ShardId};

/// How [`Launcher::push`] finds its entity in the shard.
#[derive(Clone, Copy)]
pub(super) enum Lookup {
    /// By the direct path's decision ([`ShardCore::direct_slot`]), which marks the access; the
    /// message is then on the direct path of its id's stripe.
    Direct(usize),
    /// The core decided already (the region task performs its action): its slot.
    Decided,
}

/// The shards hosted here, as the region's handle sees them for the direct path.
pub(crate) struct ShardDirectory<E: Entity> {
    /// Copied on write (only the region task writes, when a shard starts or stops): a read
    /// takes no lock word both workers write, which a lock read per message did.
    shards: ArcSwap<IdMap<ShardId, Arc<ShardCell<E>>>>,
    /// Closed while the coordinator refuses this region: the region routes nothing then.
    open: AtomicBool,
    launcher: Arc<Launcher<E>>,
}

impl<E: Entity> ShardDirectory<E> {
    /// A directory of no shards, open, whose messages `launcher` puts into mailboxes.
    pub(super) fn new(launcher: Arc<Launcher<E>>) -> Self {
        ShardDirectory { shards: ArcSwap::default(), open: AtomicBool::new(true), launcher }
    }

    /// The direct path: puts `env` straight into the mailbox of `entity_id` when the entity
    /// runs here, its shard's core would send it there anyway, and no earlier message of the
    /// handle to an id of `stripe` is on the routed path (checked under the shard's lock, which
    /// every redelivery to a new incarnation takes too). `Err` with the envelope when it must
    /// take the routed path instead.
    pub(crate) fn deliver(
        &self,
        shard_id: &str,
        entity_id: &str,
        stripe: usize,
        env: Envelope<E>,
    ) -> Result<(), Envelope<E>> {
        if !self.open.load(Ordering::Acquire) {
            return Err(env);
        }
        // A shard removed since this read may still be in the map read here; its core refuses
        // then (it stopped serving before the region removed it, and the removal takes its
        // entities' slots under the cell's lock).
        let shards = self.shards.load();
        let Some(cell) = shards.get(shard_id) else { return Err(env) };
        let shard = cell.lock();
        if !self.launcher.runner.routed.is_clear(stripe) {
            return Err(env);
        }
        self.launcher.push(entity_id, shard, env, Lookup::Direct(stripe))
    }

    pub(super) fn insert(&self, shard: ShardId, cell: Arc<ShardCell<E>>) {
        self.shards.rcu(|m| {
            let mut m = IdMap::clone(m);
            m.insert(shard.clone(), cell.clone());
            m
        });
    }

    pub(super) fn remove(&self, shard: &ShardId) {
        self.shards.rcu(|m| {
            let mut m = IdMap::clone(m);
            m.remove(shard);
            m
        });
    }

    pub(super) fn clear(&self) {
        self.shards.store(Arc::default());
    }

    /// Opens or closes the direct path (the region's routing is open or refused).
    pub(crate) fn set_open(&self, open: bool) {
        self.open.store(open, Ordering::Release);
    }
}
