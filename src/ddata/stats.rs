//! Counters of one node's replicator, readable while it runs (`node.replicator().stats()`).

use std::sync::atomic::{AtomicU64, Ordering};

/// Replicator counters. Every field only grows; read them with `load(Ordering::Relaxed)`.
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
    /// Anti-entropy rounds started (a root digest sent to one peer).
    pub digest_rounds: AtomicU64,
    /// Anti-entropy rounds a peer answered because its root digest differed.
    pub digest_mismatches: AtomicU64,
    /// Messages, values or deltas refused: undecodable, of the wrong type for their key, over a
    /// limit, or from a peer that was not asked.
    pub rejected: AtomicU64,
    /// OR-set adds refused because no durably reserved counter was left (their updates failed
    /// with a storage error).
    pub refused_adds: AtomicU64,
    /// Writes to fenced maps refused because a newer epoch had claimed the key, here or at a
    /// replica (per key and write).
    pub fenced_writes: AtomicU64,
}

impl ReplicatorStats {
    pub(crate) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
