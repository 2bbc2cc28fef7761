//! The durable queue's I/O: claiming a producer's queue at a new epoch and loading it, and
//! what a store write's result means to the core ([`PersistResult`]).
//!
//! **Fencing.** A producer's queue lives in `state.slots` fenced maps in
//! [`keys::producer_space`], owned by its producer id — the same claims, fences, budgets and
//! group commit as durable entity states (`shard::state`). A starting producer claims every
//! slot at an epoch above every fence it finds, on a majority-plus of replicas, before it loads
//! them: from then on an older incarnation of it (a partitioned node, a process not yet
//! stopped) gets no write acknowledged, and everything that one got acknowledged is in what
//! this one loaded. The older one learns it from its next write, and stops
//! ([`Error::ProducerFenced`]).
//!
//! **Epochs.** The next epoch above fence `f` is `((f >> 16) + 1) << 16` plus 16 bits of the
//! claiming node's address, so two incarnations starting at once on two nodes never share one.

use std::sync::Arc;

use super::core::{PersistResult, ProducerInput};
use super::queue::{self, Restored};
use super::{PersistJob, WriteEnded};
use crate::error::{Error, Result};
use crate::sharding::Entity;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::handle::ShardRegion;
use crate::sharding::keys;
use crate::sharding::shard::StateIo;

/// Claims at most this many times (each a newer fence seen) before giving up.
pub(crate) const MAX_CLAIMS: usize = 8;

/// A producer's durable queue, claimed at `epoch`.
#[derive(Clone)]
pub(super) struct DurableQueue {
    pub store: StateIo,
    pub epoch: u64,
}

/// A claimed queue and what its load found.
pub(super) struct Opened {
    pub queue: DurableQueue,
    pub restored: Restored,
}

/// The epoch a claim tries above fence `fence`, for the node tagged `tag`.
pub(crate) fn next_epoch(fence: u64, tag: u16) -> u64 {
    let high = (fence >> 16).saturating_add(1).min((1 << 48) - 1);
    (high << 16) | u64::from(tag)
}

/// The 16 bits of a claiming node's address its epochs carry.
pub(crate) fn node_tag(address: &str) -> u16 {
    xxhash_rust::xxh3::xxh3_64(address.as_bytes()) as u16
}

/// Claims `producer_id`'s queue in `region`'s type at a new epoch and loads it.
pub(super) async fn open<E: Entity>(region: &ShardRegion<E>, producer_id: &str) -> Result<Opened> {
    let node = region.node()?;
    let store =
        region.state_store(keys::producer_space(region.type_name()), Arc::new(RegionCounterCells::default()))?;
    let tag = node_tag(&node.address().to_string());
    let mut fence = store.local_fence(producer_id).await?;
    for _ in 0..MAX_CLAIMS {
        let epoch = next_epoch(fence, tag);
        match store.claim_and_load(producer_id, epoch).await {
            Ok(_) => {
                let restored = queue::restore(store.load_all(producer_id).await?);
                return Ok(Opened { queue: DurableQueue { store, epoch }, restored });
            }
            Err(Error::Fenced { fence: newer, .. }) => fence = fence.max(newer),
            Err(e) => return Err(e),
        }
    }
    Err(Error::ProducerFenced { producer_id: producer_id.to_string(), epoch: next_epoch(fence, tag), fence })
}

/// What a store write's result means: stored, try again, refused (nothing written: its error),
/// or fenced.
pub(crate) fn persist_result(result: Result<()>) -> (PersistResult, Option<Error>) {
    match result {
        Ok(()) => (PersistResult::Stored, None),
        Err(Error::Fenced { fence, .. }) => (PersistResult::Fenced { fence }, None),
        Err(e @ (Error::SlotFull { .. } | Error::StateTooLarge { .. })) => {
            (PersistResult::Refused(e.to_string()), Some(e))
        }
        Err(e) => (PersistResult::Retry(e.to_string()), None),
    }
}

impl<E: Entity> super::Inner<E> {
    /// Hands `jobs` to the store's writer as one request; resolves with how each ended.
    pub(super) fn write_all(
        &self,
        jobs: Vec<PersistJob>,
    ) -> impl std::future::Future<Output = Vec<WriteEnded>> + Send + 'static {
        let queue = self.durable.as_ref().map(|(queue, _)| (queue.store.clone(), queue.epoch));
        let owner = self.producer_id.clone();
        async move {
            let Some((store, epoch)) = queue else { return Vec::new() };
            let (mut whose, mut writes) = (Vec::with_capacity(jobs.len()), Vec::with_capacity(jobs.len()));
            for job in jobs {
                whose.push((job.value.is_none(), job.message));
                writes.push((job.key, job.value));
            }
            let written = store.write_all(&owner, epoch, writes).await;
            whose.into_iter().zip(written).map(|((deletion, message), written)| (deletion, message, written)).collect()
        }
    }

    /// The producer is stopping (its handles dropped, or its node shutting down): the core
    /// deletes the entries confirmed messages left. False when it was fenced (a newer
    /// incarnation owns the queue) and nothing is written.
    pub(super) fn closing(&self) -> bool {
        let mut closed = false;
        self.feed_with(|_, inputs| {
            closed = true;
            inputs.push(ProducerInput::Closing);
        });
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_epoch_is_above_every_fence_and_differs_between_nodes() {
        for fence in [0, 1, 0xFFFF, 0x1_0000, 0x1_2345, 7 << 40] {
            let (a, b) = (next_epoch(fence, 1), next_epoch(fence, 2));
            assert!(a > fence && b > fence, "{fence:#x}");
            assert_ne!(a, b);
            assert_eq!(a >> 16, b >> 16, "the tag only breaks ties");
        }
        assert_eq!(next_epoch(0, 0xAB), 0x1_00AB);
        assert_eq!(next_epoch(u64::MAX, 3) & 0xFFFF, 3, "saturates, never wraps below");
    }

    #[test]
    fn a_write_result_is_stored_retried_refused_or_fenced() {
        assert_eq!(persist_result(Ok(())).0, PersistResult::Stored);
        let fenced = Error::Fenced { key: "k".into(), epoch: 1, fence: 9 };
        assert_eq!(persist_result(Err(fenced)).0, PersistResult::Fenced { fence: 9 });
        let full = Error::SlotFull { entity_id: "3.1".into(), shard: "p".into(), slot: 2, budget: 10 };
        let (result, kept) = persist_result(Err(full));
        assert!(matches!(result, PersistResult::Refused(_)) && matches!(kept, Some(Error::SlotFull { .. })));
        let timeout = Error::StateNotPersisted { entity_id: "3.1".into(), reason: "timed out".into() };
        assert!(matches!(persist_result(Err(timeout)).0, PersistResult::Retry(_)));
    }
}
