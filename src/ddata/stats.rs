//! Counters of one node's replicator: [`ReplicatorStats`], a snapshot of plain numbers
//! (`node.replicator().stats()`), taken from the [`ReplicatorStatCells`] the replicator adds to.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Consistency;

/// Replicator counters as of the call that returned them ([`crate::ddata::Replicator::stats`]).
/// Every field only grows, but the two `roster_` gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicatorStats {
    /// Full values sent to peers (majority writes without a delta, gossip, read repair, read
    /// results), counted per peer.
    pub full_values_sent: u64,
    /// Deltas sent to peers (majority writes and propagation of local updates), per key and peer.
    pub deltas_sent: u64,
    /// Full values received and merged (writes, gossip, read repair, read results).
    pub values_merged: u64,
    /// Deltas received and merged.
    pub deltas_merged: u64,
    /// LMDB transactions committed.
    pub durable_commits: u64,
    /// LMDB commits that failed after their retries (their writes were not acknowledged).
    pub durable_failures: u64,
    /// LMDB commits retried after an error.
    pub durable_retries: u64,
    /// Total time spent in LMDB commits (writes and fsync), in microseconds; divide by
    /// `durable_commits` for the mean.
    pub durable_commit_micros: u64,
    /// Records (snapshots and deltas) written by those commits.
    pub durable_records: u64,
    /// Bytes of the LMDB map in use: its highest page written, times the page size (LMDB
    /// reuses freed pages below it and never shrinks it). Set after every commit.
    pub durable_map_used_bytes: u64,
    /// The most bytes the LMDB map may grow to (`replicator.lmdb_max_map_size`); at it, a
    /// commit that needs a new page fails.
    pub durable_map_max_bytes: u64,
    /// Anti-entropy rounds started (a root digest sent to one peer).
    pub digest_rounds: u64,
    /// Anti-entropy rounds a peer answered because its root digest differed.
    pub digest_mismatches: u64,
    /// Messages, values or deltas refused: undecodable, of the wrong type for their key, over a
    /// limit, or from a peer that was not asked.
    pub rejected: u64,
    /// OR-set adds refused because no durably reserved counter was left (their updates failed
    /// with a storage error) or the member was longer than 16 KiB, the longest an OR-set holds
    /// (failed with `BadRequest`).
    pub refused_adds: u64,
    /// Messages dropped because their sender is an incarnation this node downed or removed, or
    /// one a newer incarnation of its node replaced: a quarantined member's writes are never
    /// acknowledged (a paused node that wakes up after its peers downed it, say).
    pub quarantined: u64,
    /// Writes to fenced maps refused because a newer epoch had claimed the key, here or at a
    /// replica (per key and write).
    pub fenced_writes: u64,
    /// Gauge (the current value, not a running count): node ids of the roster durable quorums
    /// are counted over, this node's view (see [`crate::ddata::Replicator::roster`]).
    pub roster_holders: u64,
    /// Gauge: of those, how many are not replica holders now (downed, crashed, not back); at
    /// half of `roster_holders` or more, durable writes and shard starts wait.
    pub roster_absent: u64,
    /// Updates asked of this replicator ([`crate::ddata::Replicator::update`] and the
    /// `update_*` calls), by consistency and outcome: read them with
    /// [`ReplicatorStats::updates`].
    updates: [[u64; UPDATE_OUTCOMES.len()]; UPDATE_CONSISTENCIES.len()],
}

/// The live cells behind [`ReplicatorStats`], one per field (the snapshot names every cell, so the
/// two cannot drift apart).
#[derive(Debug, Default)]
pub(crate) struct ReplicatorStatCells {
    pub(crate) full_values_sent: AtomicU64,
    pub(crate) deltas_sent: AtomicU64,
    pub(crate) values_merged: AtomicU64,
    pub(crate) deltas_merged: AtomicU64,
    pub(crate) durable_commits: AtomicU64,
    pub(crate) durable_failures: AtomicU64,
    pub(crate) durable_retries: AtomicU64,
    pub(crate) durable_commit_micros: AtomicU64,
    pub(crate) durable_records: AtomicU64,
    pub(crate) durable_map_used_bytes: AtomicU64,
    pub(crate) durable_map_max_bytes: AtomicU64,
    pub(crate) digest_rounds: AtomicU64,
    pub(crate) digest_mismatches: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) refused_adds: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) fenced_writes: AtomicU64,
    pub(crate) roster_holders: AtomicU64,
    pub(crate) roster_absent: AtomicU64,
    updates: [[AtomicU64; UPDATE_OUTCOMES.len()]; UPDATE_CONSISTENCIES.len()],
}

impl ReplicatorStats {
    /// Updates that ended with `outcome` (one of `ok`, `timeout`, `not_enough_replicas`, `fenced`, `error`) at `consistency` (one of
    /// `local`, `majority`, `all`, `all_reachable`); 0 for names not in those lists.
    pub fn updates(&self, consistency: &str, outcome: &str) -> u64 {
        let c = UPDATE_CONSISTENCIES.iter().position(|x| *x == consistency);
        let o = UPDATE_OUTCOMES.iter().position(|x| *x == outcome);
        match (c, o) {
            (Some(c), Some(o)) => self.updates[c][o],
            _ => 0,
        }
    }
}

impl ReplicatorStatCells {
    /// The counters as of now (each read on its own: a snapshot, not one instant).
    pub(crate) fn snapshot(&self) -> ReplicatorStats {
        ReplicatorStats {
            full_values_sent: self.full_values_sent.load(Ordering::Relaxed),
            deltas_sent: self.deltas_sent.load(Ordering::Relaxed),
            values_merged: self.values_merged.load(Ordering::Relaxed),
            deltas_merged: self.deltas_merged.load(Ordering::Relaxed),
            durable_commits: self.durable_commits.load(Ordering::Relaxed),
            durable_failures: self.durable_failures.load(Ordering::Relaxed),
            durable_retries: self.durable_retries.load(Ordering::Relaxed),
            durable_commit_micros: self.durable_commit_micros.load(Ordering::Relaxed),
            durable_records: self.durable_records.load(Ordering::Relaxed),
            durable_map_used_bytes: self.durable_map_used_bytes.load(Ordering::Relaxed),
            durable_map_max_bytes: self.durable_map_max_bytes.load(Ordering::Relaxed),
            digest_rounds: self.digest_rounds.load(Ordering::Relaxed),
            digest_mismatches: self.digest_mismatches.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            refused_adds: self.refused_adds.load(Ordering::Relaxed),
            quarantined: self.quarantined.load(Ordering::Relaxed),
            fenced_writes: self.fenced_writes.load(Ordering::Relaxed),
            roster_holders: self.roster_holders.load(Ordering::Relaxed),
            roster_absent: self.roster_absent.load(Ordering::Relaxed),
            updates: self.updates.each_ref().map(|row| row.each_ref().map(|cell| cell.load(Ordering::Relaxed))),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the snapshot reads its own cell (distinct values, so two crossed wires
    /// fail).
    #[test]
    fn a_replicator_stats_snapshot_reads_each_counter_from_its_own_cell() {
        use std::sync::atomic::Ordering;
        let cells = ReplicatorStatCells::default();
        cells.full_values_sent.store(1, Ordering::Relaxed);
        cells.deltas_sent.store(2, Ordering::Relaxed);
        cells.values_merged.store(3, Ordering::Relaxed);
        cells.deltas_merged.store(4, Ordering::Relaxed);
        cells.durable_commits.store(5, Ordering::Relaxed);
        cells.durable_failures.store(6, Ordering::Relaxed);
        cells.durable_retries.store(7, Ordering::Relaxed);
        cells.durable_commit_micros.store(8, Ordering::Relaxed);
        cells.durable_records.store(9, Ordering::Relaxed);
        cells.durable_map_used_bytes.store(10, Ordering::Relaxed);
        cells.durable_map_max_bytes.store(11, Ordering::Relaxed);
        cells.digest_rounds.store(12, Ordering::Relaxed);
        cells.digest_mismatches.store(13, Ordering::Relaxed);
        cells.rejected.store(14, Ordering::Relaxed);
        cells.refused_adds.store(15, Ordering::Relaxed);
        cells.quarantined.store(16, Ordering::Relaxed);
        cells.fenced_writes.store(17, Ordering::Relaxed);
        cells.roster_holders.store(18, Ordering::Relaxed);
        cells.roster_absent.store(19, Ordering::Relaxed);
        cells.count_update(Consistency::Majority { plus: 0, min_cap: 0 }, UpdateOutcome::Fenced);

        let snapshot = cells.snapshot();
        assert_eq!(snapshot.updates("majority", "fenced"), 1);
        assert_eq!(snapshot.updates("majority", "ok"), 0);
        assert_eq!(snapshot.updates("no such consistency", "fenced"), 0);
        let expected = ReplicatorStats {
            full_values_sent: 1,
            deltas_sent: 2,
            values_merged: 3,
            deltas_merged: 4,
            durable_commits: 5,
            durable_failures: 6,
            durable_retries: 7,
            durable_commit_micros: 8,
            durable_records: 9,
            durable_map_used_bytes: 10,
            durable_map_max_bytes: 11,
            digest_rounds: 12,
            digest_mismatches: 13,
            rejected: 14,
            refused_adds: 15,
            quarantined: 16,
            fenced_writes: 17,
            roster_holders: 18,
            roster_absent: 19,
            ..Default::default()
        };
        assert_eq!(ReplicatorStats { updates: expected.updates, ..snapshot }, expected);
    }
}
