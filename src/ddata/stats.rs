//! Counters of one node's replicator, readable while it runs (`node.replicator().stats()`).

use std::sync::atomic::{AtomicU64, Ordering};

use super::Consistency;

/// Replicator counters. Every field only grows, but the two `roster_` gauges; read them with
/// `load(Ordering::Relaxed)`.
#[derive(Debug, Default)]
pub struct ReplicatorStats {
    /// Full values sent to peers (majority writes without a delta, gossip, read repair, read
    /// results), counted per peer.
    pub full_values_sent: AtomicU64,
    /// Deltas sent to peers (majority writes and propagation of local updates), per key and peer.
    pub deltas_sent: AtomicU64,
    /// Full values received and merged (writes, gossip, read repair, read results).
    pub values_merged: AtomicU64,
    /// Deltas received and merged.
    pub deltas_merged: AtomicU64,
    /// LMDB transactions committed.
    pub durable_commits: AtomicU64,
    /// LMDB commits that failed after their retries (their writes were not acknowledged).
    pub durable_failures: AtomicU64,
    /// LMDB commits retried after an error.
    pub durable_retries: AtomicU64,
    /// Total time spent in LMDB commits (writes and fsync), in microseconds; divide by
    /// `durable_commits` for the mean.
    pub durable_commit_micros: AtomicU64,
    /// Records (snapshots and deltas) written by those commits.
    pub durable_records: AtomicU64,
    /// Bytes of the LMDB map in use: its highest page written, times the page size (LMDB
    /// reuses freed pages below it and never shrinks it). Set after every commit.
    pub durable_map_used_bytes: AtomicU64,
    /// The most bytes the LMDB map may grow to (`replicator.lmdb_max_map_size`); at it, a
    /// commit that needs a new page fails.
    pub durable_map_max_bytes: AtomicU64,
    /// Anti-entropy rounds started (a root digest sent to one peer).
    pub digest_rounds: AtomicU64,
    /// Anti-entropy rounds a peer answered because its root digest differed.
    pub digest_mismatches: AtomicU64,
    /// Messages, values or deltas refused: undecodable, of the wrong type for their key, over a
    /// limit, or from a peer that was not asked.
    pub rejected: AtomicU64,
    /// OR-set adds refused because no durably reserved counter was left (their updates failed
    /// with a storage error) or the member was longer than
    /// [`MAX_ENTITY_ID_LEN`](crate::sharding::MAX_ENTITY_ID_LEN) bytes (failed with `BadRequest`).
    pub refused_adds: AtomicU64,
    /// Messages dropped because their sender is an incarnation this node downed or removed, or
    /// one a newer incarnation of its node replaced: a quarantined member's writes are never
    /// acknowledged (a paused node that wakes up after its peers downed it, say).
    pub quarantined: AtomicU64,
    /// Writes to fenced maps refused because a newer epoch had claimed the key, here or at a
    /// replica (per key and write).
    pub fenced_writes: AtomicU64,
    /// Gauge (the current value, not a running count): node ids of the roster durable quorums
    /// are counted over, this node's view (see [`crate::ddata::Replicator::roster`]).
    pub roster_holders: AtomicU64,
    /// Gauge: of those, how many are not replica holders now (downed, crashed, not back); at
    /// half of `roster_holders` or more, durable writes and shard starts wait.
    pub roster_absent: AtomicU64,
    /// Updates asked of this replicator ([`crate::ddata::Replicator::update`] and the
    /// `update_*` calls), by consistency and outcome: read them with
    /// [`ReplicatorStats::updates`].
    updates: [[AtomicU64; UPDATE_OUTCOMES.len()]; UPDATE_CONSISTENCIES.len()],
}

/// The consistencies updates are counted by (see [`ReplicatorStats::updates`]).
pub(crate) const UPDATE_CONSISTENCIES: [&str; 4] = ["local", "majority", "all", "all_reachable"];
/// How an update ended, in the order of [`UPDATE_OUTCOMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpdateOutcome {
    Ok = 0,
    Timeout = 1,
    NotEnoughReplicas = 2,
    Fenced = 3,
    Error = 4,
}

impl UpdateOutcome {
    /// The outcome a failed update's error names.
    pub(crate) fn of(e: &crate::error::Error) -> Self {
        match e {
            crate::error::Error::ConsistencyTimeout { .. } => UpdateOutcome::Timeout,
            crate::error::Error::NotEnoughReplicas { .. } => UpdateOutcome::NotEnoughReplicas,
            crate::error::Error::Fenced { .. } => UpdateOutcome::Fenced,
            _ => UpdateOutcome::Error,
        }
    }
}

/// The outcomes updates are counted by (see [`ReplicatorStats::updates`]).
pub(crate) const UPDATE_OUTCOMES: [&str; 5] = ["ok", "timeout", "not_enough_replicas", "fenced", "error"];

impl ReplicatorStats {
    /// Updates that ended with `outcome` (one of `ok`, `timeout`, `not_enough_replicas`, `fenced`, `error`) at `consistency` (one of
    /// `local`, `majority`, `all`, `all_reachable`); 0 for names not in those lists.
    pub fn updates(&self, consistency: &str, outcome: &str) -> u64 {
        let c = UPDATE_CONSISTENCIES.iter().position(|x| *x == consistency);
        let o = UPDATE_OUTCOMES.iter().position(|x| *x == outcome);
        match (c, o) {
            (Some(c), Some(o)) => self.updates[c][o].load(Ordering::Relaxed),
            _ => 0,
        }
    }

    /// Counts an update that ended with `outcome` at `consistency`.
    pub(crate) fn count_update(&self, consistency: Consistency, outcome: UpdateOutcome) {
        let c = match consistency {
            Consistency::Local => 0,
            Consistency::Majority { .. } => 1,
            Consistency::All => 2,
            Consistency::AllReachable { .. } => 3,
        };
        self.updates[c][outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
