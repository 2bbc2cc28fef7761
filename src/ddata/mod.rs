//! Distributed data: a replicator holding CRDT values under string keys, with Local / Majority /
//! All reads and writes, read repair, anti-entropy by digest, change subscriptions and durable
//! keys in LMDB.
//!
//! The protocol lives in the sans-IO `replicator` state machine; `driver` is its tokio
//! driver: one task that owns the state machine, the inbox and the ticker, and hands store
//! writes to the `persist` thread without waiting for them (the core holds acknowledgements
//! until the thread reports the commit). The backlog of writes handed over and not yet
//! committed is bounded in bytes: past it the loop stops taking new work until the disk
//! catches up.

mod buckets;
pub(crate) mod crdt;
mod delta_crdt;
mod driver;
// The LMDB record layer: public with the `testkit` feature only, for storage tests (no
// stability promise); crate-private otherwise.
#[cfg(feature = "testkit")]
pub mod durable;
#[cfg(not(feature = "testkit"))]
#[allow(unreachable_pub)]
pub(crate) mod durable;
mod encoded_len;
pub(crate) mod fenced;
pub(crate) mod orset;
pub(crate) mod persist;
pub(crate) mod replicator;
pub(crate) mod stats;
mod write_ctx;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

pub use crdt::{
    Crdt, Fenced, FencedMap, GSet, LwwMap, MergeError, OrSet, OrSetDelta, OrSetError, ReplicatedData, ReplicatedDelta,
    WriteCtx,
};
#[cfg(feature = "testkit")]
pub use durable::DurableStore;
#[cfg(not(feature = "testkit"))]
pub(crate) use durable::DurableStore;
pub use persist::DurableHealth;
use replicator::ReplicatorInput;

pub use replicator::Consistency;
pub(crate) use stats::ReplicatorStatCells;
pub use stats::ReplicatorStats;

pub(crate) use driver::{ReplicatorParams, start};

use crate::error::{Error, Result};

/// Transport topic of replicator messages.
pub(crate) const TOPIC: &str = "ddata";

pub(crate) enum ReplyTx {
    Get(oneshot::Sender<Result<Option<ReplicatedData>>>),
    GetMany(oneshot::Sender<Result<Vec<Option<ReplicatedData>>>>),
    /// The keys refused by their fence, if any (see [`replicator::ReplicatorAction::ReplyUpdate`]).
    Update(oneshot::Sender<Result<Vec<(String, Fenced)>>>),
}

// Short-lived: moved through the command channel once.
#[allow(clippy::large_enum_variant)]
enum Command {
    Op(ReplicatorInput<ReplyTx>),
    Subscribe {
        key: String,
        reply: oneshot::Sender<watch::Receiver<Option<ReplicatedData>>>,
    },
    /// Runs a closure on the local value of `key` in the replicator's task (a projection of a
    /// large value without copying it).
    Inspect {
        key: String,
        inspect: Inspection,
    },
    /// This node leaves: its values go to the members that stay ([`ReplicatorInput::HandOver`]).
    HandOver {
        timeout: Duration,
        reply: oneshot::Sender<Result<Vec<(String, Fenced)>>>,
    },
}

/// A closure run on a key's local value in the replicator's task.
type Inspection = Box<dyn FnOnce(Option<&ReplicatedData>) + Send>;

/// Handle to the node's replicator; cheap to clone.
#[derive(Clone, Debug)]
pub struct Replicator {
    commands: mpsc::Sender<Command>,
    stats: Arc<ReplicatorStatCells>,
    health: Arc<DurableHealth>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Command")
    }
}

impl Replicator {
    /// The replicator's counters (values and deltas sent and merged, durable commits, digest
    /// rounds, refused input), as of this call.
    pub fn stats(&self) -> ReplicatorStats {
        self.stats.snapshot()
    }

    /// Whether the durable store commits (false after a commit failed its retries, until one
    /// succeeds), with the last error.
    pub fn durable_health(&self) -> &DurableHealth {
        &self.health
    }

    /// Writes every value this node holds to a majority of the members that stay (the Up
    /// members other than this one), before this node leaves: a write acknowledged with this
    /// node's help stays on a majority of what remains. `NotEnoughReplicas` when no such
    /// majority is reachable, `ConsistencyTimeout` when it did not answer within `timeout`.
    pub(crate) async fn hand_over(&self, timeout: Duration) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::HandOver { timeout, reply: tx }).await.map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)?.map(|_| ())
    }

    /// Takes `node_id` out of the roster that durable quorums are counted over (DESIGN.md,
    /// "quorums over a durable roster"): for a node that is gone for good, so the durable
    /// shards a majority of the roster can no longer serve are served again. Whatever only its
    /// disk held is given up. `BadRequest` for this node, a replica holder that is a member
    /// now, or an id the roster does not count. The forget spreads to every replica.
    pub async fn forget_replica(&self, node_id: &str) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let input = ReplicatorInput::Forget { node_id: node_id.to_string(), reply: ReplyTx::Update(tx) };
        self.commands.send(Command::Op(input)).await.map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)?.map(|_| ())
    }

    /// The node ids durable quorums are counted over now (the roster, as this node knows it),
    /// each with the newest generation seen.
    pub async fn roster(&self) -> Result<Vec<(String, u64)>> {
        let (tx, rx) = oneshot::channel();
        let inspect: Inspection = Box::new(move |value| {
            let counted = replicator::roster_entries(value).into_iter().filter(|(_, e)| !e.forgotten);
            let _ = tx.send(counted.map(|(id, e)| (id, e.generation)).collect());
        });
        let command = Command::Inspect { key: replicator::ROSTER_KEY.to_string(), inspect };
        self.commands.send(command).await.map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }

    /// Reads `key` with the given consistency. `Ok(None)`: no replica asked has a value.
    pub async fn get<T: Crdt>(&self, key: &str, consistency: Consistency, timeout: Duration) -> Result<Option<T>> {
        let (tx, rx) = oneshot::channel();
        let input = ReplicatorInput::Get { key: key.to_string(), consistency, timeout, reply: ReplyTx::Get(tx) };
        self.commands.send(Command::Op(input)).await.map_err(|_| Error::ShutDown)?;
        let data = rx.await.map_err(|_| Error::ShutDown)??;
        data.map(|d| T::from_data(d, key)).transpose()
    }

    /// Reads several keys of one type in one round (one message per replica; the replicas split
    /// large answers by bytes). Values come in the order of `keys`; at most 4,096 keys.
    pub async fn get_many<T: Crdt>(
        &self,
        keys: Vec<String>,
        consistency: Consistency,
        timeout: Duration,
    ) -> Result<Vec<Option<T>>> {
        let (tx, rx) = oneshot::channel();
        let input = ReplicatorInput::GetMany { keys: keys.clone(), consistency, timeout, reply: ReplyTx::GetMany(tx) };
        self.commands.send(Command::Op(input)).await.map_err(|_| Error::ShutDown)?;
        let values = rx.await.map_err(|_| Error::ShutDown)??;
        values.into_iter().zip(&keys).map(|(d, key)| d.map(|d| T::from_data(d, key)).transpose()).collect()
    }

    /// Changes `key` (starting from `T::default()` when it has no value) and replicates the new
    /// state with the given consistency. On [`Error::ConsistencyTimeout`] or
    /// [`Error::NotEnoughReplicas`] the local value *is* changed and spreads by gossip.
    pub async fn update<T, F>(&self, key: &str, consistency: Consistency, timeout: Duration, modify: F) -> Result<()>
    where
        T: Crdt,
        F: FnOnce(&mut T, &mut WriteCtx) + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let KeyUpdate { key, modify } = KeyUpdate::new::<T, F>(key, modify);
        let input = ReplicatorInput::Update { key, consistency, timeout, modify, reply: ReplyTx::Update(tx) };
        let result = match self.commands.send(Command::Op(input)).await {
            Ok(()) => rx.await.map_err(|_| Error::ShutDown).and_then(|r| r.and_then(first_fenced)),
            Err(_) => Err(Error::ShutDown),
        };
        let outcome = result.as_ref().map_or_else(stats::UpdateOutcome::of, |_| stats::UpdateOutcome::Ok);
        self.stats.count_update(consistency, outcome);
        result
    }

    /// Updates several keys (of any types) and replicates them in one round: one message and
    /// one acknowledgement per replica, one LMDB transaction per node. Errors as for
    /// [`Replicator::update`]; a modify of the wrong type fails the whole call (keys updated
    /// before it keep their local change, which spreads by gossip).
    pub async fn update_many(
        &self,
        consistency: Consistency,
        timeout: Duration,
        updates: Vec<KeyUpdate>,
    ) -> Result<()> {
        first_fenced(self.update_each(consistency, timeout, updates).await?)
    }

    /// [`Replicator::update_many`] where a key refused by its fence (a [`FencedMap`] write that
    /// reports [`WriteCtx::refuse`], or one a replica refused because a newer epoch claimed
    /// the key there) does not fail the others: returns the refused keys, and every other key
    /// is written at `consistency`.
    pub async fn update_each(
        &self,
        consistency: Consistency,
        timeout: Duration,
        updates: Vec<KeyUpdate>,
    ) -> Result<Vec<(String, Fenced)>> {
        if updates.is_empty() {
            return Ok(Vec::new());
        }
        let (tx, rx) = oneshot::channel();
        let updates = updates.into_iter().map(KeyUpdate::into_parts).collect();
        let input = ReplicatorInput::UpdateMany { updates, consistency, timeout, reply: ReplyTx::Update(tx) };
        let result = match self.commands.send(Command::Op(input)).await {
            Ok(()) => rx.await.map_err(|_| Error::ShutDown).and_then(|r| r),
            Err(_) => Err(Error::ShutDown),
        };
        // A key refused by its fence counts the update as fenced, even with the others written.
        let outcome = match &result {
            Ok(refused) if !refused.is_empty() => stats::UpdateOutcome::Fenced,
            Ok(_) => stats::UpdateOutcome::Ok,
            Err(e) => stats::UpdateOutcome::of(e),
        };
        self.stats.count_update(consistency, outcome);
        result
    }

    /// Applies `updates` here, then reads their keys at `consistency` from replicas that merge
    /// and store the same updates *before* they answer, so every answer counted holds the
    /// write. This is how a new allocation claims its state ([`FencedMap::claim`]): once the
    /// read returns, none of the replicas it counted takes a write of an older epoch, and the
    /// values hold every older write a majority acknowledged. Values come in the order of
    /// `updates`; at most 4,096 keys; a key refused by its fence fails the call with
    /// [`Error::Fenced`].
    pub async fn update_and_get_many<T: Crdt>(
        &self,
        consistency: Consistency,
        timeout: Duration,
        updates: Vec<KeyUpdate>,
    ) -> Result<Vec<Option<T>>> {
        let keys: Vec<String> = updates.iter().map(|u| u.key.clone()).collect();
        let (tx, rx) = oneshot::channel();
        let updates = updates.into_iter().map(KeyUpdate::into_parts).collect();
        let input = ReplicatorInput::UpdateAndGetMany { updates, consistency, timeout, reply: ReplyTx::GetMany(tx) };
        self.commands.send(Command::Op(input)).await.map_err(|_| Error::ShutDown)?;
        let values = rx.await.map_err(|_| Error::ShutDown)??;
        values.into_iter().zip(&keys).map(|(d, key)| d.map(|d| T::from_data(d, key)).transpose()).collect()
    }

    /// Reads a projection of this node's value of `key` (`Ok(None)`: no value here), computed
    /// in the replicator's task so that a large value is not copied: `f` should be quick.
    pub async fn read_local_with<T, U, F>(&self, key: &str, f: F) -> Result<Option<U>>
    where
        T: Crdt,
        U: Send + 'static,
        F: FnOnce(&T) -> U + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let owned = key.to_string();
        let inspect = Box::new(move |data: Option<&ReplicatedData>| {
            let result = data.map(|d| T::data_ref(d, &owned).map(f)).transpose();
            let _ = tx.send(result);
        });
        self.commands.send(Command::Inspect { key: key.to_string(), inspect }).await.map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)?
    }

    /// Watches the local value of `key`: the receiver holds the current value and is notified on
    /// every change (local update, replicated write, gossip or read repair).
    pub async fn subscribe(&self, key: &str) -> Result<watch::Receiver<Option<ReplicatedData>>> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::Subscribe { key: key.to_string(), reply: tx })
            .await
            .map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }
}

/// An update's outcome as one result: the first key refused by its fence is the error.
pub(crate) fn first_fenced(fenced: Vec<(String, Fenced)>) -> Result<()> {
    match fenced.into_iter().next() {
        Some((key, Fenced { epoch, fence })) => Err(Error::Fenced { key, epoch, fence }),
        None => Ok(()),
    }
}

/// One key's change in [`Replicator::update_many`].
pub struct KeyUpdate {
    key: String,
    modify: replicator::Modify,
}

impl std::fmt::Debug for KeyUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyUpdate").field("key", &self.key).finish_non_exhaustive()
    }
}

impl KeyUpdate {
    /// The key and its boxed modify, as the replicator core takes them.
    pub(crate) fn into_parts(self) -> (String, replicator::Modify) {
        (self.key, self.modify)
    }

    /// Changes `key` (starting from `T::default()` when it has no value).
    pub fn new<T, F>(key: &str, modify: F) -> KeyUpdate
    where
        T: Crdt,
        F: FnOnce(&mut T, &mut WriteCtx) + Send + 'static,
    {
        let owned_key = key.to_string();
        let modify: replicator::Modify = Box::new(move |current, ctx| match current {
            Some(data) => {
                modify(T::data_mut(data, &owned_key)?, ctx);
                Ok(None)
            }
            None => {
                let mut value = T::default();
                modify(&mut value, ctx);
                Ok(Some(value.into_data()))
            }
        });
        KeyUpdate { key: key.to_string(), modify }
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }
}
