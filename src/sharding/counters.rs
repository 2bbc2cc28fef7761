//! What one region counted since it started: [`RegionCounters`], a snapshot of plain numbers
//! for users, taken from the [`RegionCounterCells`] the region's tasks add to.

use std::sync::atomic::{AtomicU64, Ordering};

/// What one region counted since it started, as of the call that returned it
/// ([`crate::ShardRegion::counters`], [`crate::sharding::RegionRef::counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionCounters {
    /// Messages from this node's handle that took the routed path (through the region task:
    /// the entity was not running here, was starting or stopping, or an earlier message to it
    /// was still on that path) rather than going straight into a running entity's mailbox.
    pub local_routed: u64,

    /// Messages from other nodes that went from the connection straight into a running
    /// entity's mailbox, without a hop through the region task.
    pub remote_direct: u64,

    /// Messages from this node's handle sent straight to their shard's home on another node,
    /// without a hop through the region task.
    pub remote_sent_direct: u64,

    /// Entity incarnations started here (first messages, restarts, remembered entities).
    pub entity_starts: u64,

    /// Entities stopped because they asked to passivate.
    pub passivations_explicit: u64,

    /// Entities passivated after the idle timeout.
    pub passivations_idle: u64,

    /// Entities passivated to make room under the active-entity limit.
    pub passivations_limit: u64,

    /// Entities stopped because their shard was handed off.
    pub handoff_stops: u64,

    /// Messages dropped because the buffer was full.
    pub dropped_buffer_full: u64,

    /// Messages dropped during hand-offs.
    pub dropped_handoff: u64,

    /// Remembered-id starts and durable-state writes refused because their replicated slot is
    /// at its byte budget ([`crate::Error::SlotFull`]).
    pub dropped_slot_full: u64,

    /// Remembered-id starts refused because their shard remembers its limit of entities
    /// ([`crate::Error::RememberedLimit`]).
    pub dropped_remembered_limit: u64,

    /// The largest replicated slot (remembered ids or entity states) this region wrote, in
    /// bytes, since it started: against [`RegionCounters::slot_budget_bytes`], how close the
    /// fullest slot came to refusing growth (alert at half).
    pub slot_bytes_high_water: u64,

    /// The byte budget of one replicated slot (one replicator message).
    pub slot_budget_bytes: u64,

    /// Messages from other nodes that did not decode, had an empty entity id, or named another
    /// shard than this node's extractor gives for the id.
    pub dropped_invalid: u64,

    /// Entity handlers that panicked.
    pub entity_panics: u64,

    /// Reliable deliveries taken to be handled here (the next message of their stream).
    pub deliveries_handled: u64,

    /// Reliable deliveries confirmed without being handled: taken before, or confirmed by the
    /// producer's own account.
    pub deliveries_duplicate: u64,

    /// Reliable deliveries sent back: past the next number expected, of a stream the
    /// entity's incarnation had not been introduced to, or behind a held message.
    pub deliveries_sent_back: u64,

    /// Reliable deliveries handled whose confirmation the handler held back
    /// ([`EntityContext::confirm_later`](crate::EntityContext::confirm_later)).
    pub deliveries_held: u64,

    /// Shards stopped because their remembered set could not be loaded or written.
    pub shard_failures: u64,

    /// Messages dropped because their entity's mailbox was full (`entity_mailbox_capacity`).
    pub dropped_mailbox_full: u64,

    /// Messages refused because the coordinator refused this region (its shard-id extractor
    /// differs from the coordinator's node: an entity could otherwise run in two shards).
    pub dropped_refused: u64,

    /// Hand-offs of a local shard the coordinator started (rebalance, shutdown, leave).
    pub handoffs_started: u64,

    /// Of those, the shards whose entities have all stopped.
    pub handoffs_completed: u64,

    /// Remember-entities: batches written by this region's remember writer (one majority
    /// update each, covering the starts and stops of all its shards queued meanwhile).
    pub remember_batches: u64,

    /// Remember-entities: entity starts and stops those batches recorded.
    pub remember_ids_written: u64,

    /// Remember-entities: total time requests waited for their batch to leave, in microseconds
    /// (divide by the requests for the mean).
    pub remember_queue_wait_micros: u64,

    /// Remember-entities: requests (one per shard and batch) the writer took.
    pub remember_requests: u64,

    /// Remember-entities: total time of the batches' majority rounds (with retries), in
    /// microseconds (divide by `remember_batches` for the mean).
    pub remember_round_micros: u64,

    /// Durable entities: state writes acknowledged (persist and delete).
    pub state_writes: u64,

    /// Durable entities: batches written by this region's state writer (one majority update
    /// each, for the writes of all its entities queued meanwhile).
    pub state_batches: u64,

    /// Durable entities: state writes that failed (not acknowledged, refused by a fence, or over
    /// `state.max_bytes`).
    pub state_write_failures: u64,

    /// Durable entities: writes refused because a newer allocation claimed the shard's state.
    pub state_fenced: u64,

    /// Durable entities: stored states that did not decode as the entity's `State`.
    pub state_undecodable: u64,

    /// Requests for a shard's home sent to the coordinator (`GetShardHome`, retries included).
    /// A region learns every known home when it registers, so after a restart this counts
    /// only shards that had no home, or whose home moved.
    pub home_requests: u64,

    /// Entity stop hooks dropped at their bound (`Entity::on_stop` still running after the
    /// entity stop timeout); the stop went on.
    pub stop_hook_overruns: u64,

    /// Tries of a shard's load (its remembered ids, its states' claim) that timed out; each is
    /// tried again, up to three tries, before the shard fails for `shard_failure_backoff`.
    pub shard_load_timeouts: u64,
}

/// The live counters of one region, one cell per field of [`RegionCounters`] (the snapshot
/// names every cell, so the two cannot drift apart).
#[derive(Debug, Default)]
pub(crate) struct RegionCounterCells {
    pub(crate) local_routed: AtomicU64,
    pub(crate) remote_direct: AtomicU64,
    pub(crate) remote_sent_direct: AtomicU64,
    pub(crate) entity_starts: AtomicU64,
    pub(crate) passivations_explicit: AtomicU64,
    pub(crate) passivations_idle: AtomicU64,
    pub(crate) passivations_limit: AtomicU64,
    pub(crate) handoff_stops: AtomicU64,
    pub(crate) dropped_buffer_full: AtomicU64,
    pub(crate) dropped_handoff: AtomicU64,
    pub(crate) dropped_slot_full: AtomicU64,
    pub(crate) dropped_remembered_limit: AtomicU64,
    pub(crate) slot_bytes_high_water: AtomicU64,
    pub(crate) slot_budget_bytes: AtomicU64,
    pub(crate) dropped_invalid: AtomicU64,
    pub(crate) entity_panics: AtomicU64,
    pub(crate) deliveries_handled: AtomicU64,
    pub(crate) deliveries_duplicate: AtomicU64,
    pub(crate) deliveries_sent_back: AtomicU64,
    pub(crate) deliveries_held: AtomicU64,
    pub(crate) shard_failures: AtomicU64,
    pub(crate) dropped_mailbox_full: AtomicU64,
    pub(crate) dropped_refused: AtomicU64,
    pub(crate) handoffs_started: AtomicU64,
    pub(crate) handoffs_completed: AtomicU64,
    pub(crate) remember_batches: AtomicU64,
    pub(crate) remember_ids_written: AtomicU64,
    pub(crate) remember_queue_wait_micros: AtomicU64,
    pub(crate) remember_requests: AtomicU64,
    pub(crate) remember_round_micros: AtomicU64,
    pub(crate) state_writes: AtomicU64,
    pub(crate) state_batches: AtomicU64,
    pub(crate) state_write_failures: AtomicU64,
    pub(crate) state_fenced: AtomicU64,
    pub(crate) state_undecodable: AtomicU64,
    pub(crate) home_requests: AtomicU64,
    pub(crate) stop_hook_overruns: AtomicU64,
    pub(crate) shard_load_timeouts: AtomicU64,
}

impl RegionCounterCells {
    /// The counters as of now (each read on its own: a snapshot, not one instant).
    pub(crate) fn snapshot(&self) -> RegionCounters {
        RegionCounters {
            local_routed: self.local_routed.load(Ordering::Relaxed),
            remote_direct: self.remote_direct.load(Ordering::Relaxed),
            remote_sent_direct: self.remote_sent_direct.load(Ordering::Relaxed),
            entity_starts: self.entity_starts.load(Ordering::Relaxed),
            passivations_explicit: self.passivations_explicit.load(Ordering::Relaxed),
            passivations_idle: self.passivations_idle.load(Ordering::Relaxed),
            passivations_limit: self.passivations_limit.load(Ordering::Relaxed),
            handoff_stops: self.handoff_stops.load(Ordering::Relaxed),
            dropped_buffer_full: self.dropped_buffer_full.load(Ordering::Relaxed),
            dropped_handoff: self.dropped_handoff.load(Ordering::Relaxed),
            dropped_slot_full: self.dropped_slot_full.load(Ordering::Relaxed),
            dropped_remembered_limit: self.dropped_remembered_limit.load(Ordering::Relaxed),
            slot_bytes_high_water: self.slot_bytes_high_water.load(Ordering::Relaxed),
            slot_budget_bytes: self.slot_budget_bytes.load(Ordering::Relaxed),
            dropped_invalid: self.dropped_invalid.load(Ordering::Relaxed),
            entity_panics: self.entity_panics.load(Ordering::Relaxed),
            deliveries_handled: self.deliveries_handled.load(Ordering::Relaxed),
            deliveries_duplicate: self.deliveries_duplicate.load(Ordering::Relaxed),
            deliveries_sent_back: self.deliveries_sent_back.load(Ordering::Relaxed),
            deliveries_held: self.deliveries_held.load(Ordering::Relaxed),
            shard_failures: self.shard_failures.load(Ordering::Relaxed),
            dropped_mailbox_full: self.dropped_mailbox_full.load(Ordering::Relaxed),
            dropped_refused: self.dropped_refused.load(Ordering::Relaxed),
            handoffs_started: self.handoffs_started.load(Ordering::Relaxed),
            handoffs_completed: self.handoffs_completed.load(Ordering::Relaxed),
            remember_batches: self.remember_batches.load(Ordering::Relaxed),
            remember_ids_written: self.remember_ids_written.load(Ordering::Relaxed),
            remember_queue_wait_micros: self.remember_queue_wait_micros.load(Ordering::Relaxed),
            remember_requests: self.remember_requests.load(Ordering::Relaxed),
            remember_round_micros: self.remember_round_micros.load(Ordering::Relaxed),
            state_writes: self.state_writes.load(Ordering::Relaxed),
            state_batches: self.state_batches.load(Ordering::Relaxed),
            state_write_failures: self.state_write_failures.load(Ordering::Relaxed),
            state_fenced: self.state_fenced.load(Ordering::Relaxed),
            state_undecodable: self.state_undecodable.load(Ordering::Relaxed),
            home_requests: self.home_requests.load(Ordering::Relaxed),
            stop_hook_overruns: self.stop_hook_overruns.load(Ordering::Relaxed),
            shard_load_timeouts: self.shard_load_timeouts.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the snapshot reads its own cell (distinct values, so two crossed wires
    /// fail).
    #[test]
    fn a_snapshot_reads_each_counter_from_its_own_cell() {
        let cells = RegionCounterCells::default();
        cells.local_routed.store(1, Ordering::Relaxed);
        cells.remote_direct.store(2, Ordering::Relaxed);
        cells.remote_sent_direct.store(3, Ordering::Relaxed);
        cells.entity_starts.store(4, Ordering::Relaxed);
        cells.passivations_explicit.store(5, Ordering::Relaxed);
        cells.passivations_idle.store(6, Ordering::Relaxed);
        cells.passivations_limit.store(7, Ordering::Relaxed);
        cells.handoff_stops.store(8, Ordering::Relaxed);
        cells.dropped_buffer_full.store(9, Ordering::Relaxed);
        cells.dropped_handoff.store(10, Ordering::Relaxed);
        cells.dropped_slot_full.store(11, Ordering::Relaxed);
        cells.dropped_remembered_limit.store(12, Ordering::Relaxed);
        cells.slot_bytes_high_water.store(13, Ordering::Relaxed);
        cells.slot_budget_bytes.store(14, Ordering::Relaxed);
        cells.dropped_invalid.store(15, Ordering::Relaxed);
        cells.entity_panics.store(16, Ordering::Relaxed);
        cells.shard_failures.store(17, Ordering::Relaxed);
        cells.dropped_mailbox_full.store(18, Ordering::Relaxed);
        cells.dropped_refused.store(19, Ordering::Relaxed);
        cells.handoffs_started.store(20, Ordering::Relaxed);
        cells.handoffs_completed.store(21, Ordering::Relaxed);
        cells.remember_batches.store(22, Ordering::Relaxed);
        cells.remember_ids_written.store(23, Ordering::Relaxed);
        cells.remember_queue_wait_micros.store(24, Ordering::Relaxed);
        cells.remember_requests.store(25, Ordering::Relaxed);
        cells.remember_round_micros.store(26, Ordering::Relaxed);
        cells.state_writes.store(27, Ordering::Relaxed);
        cells.state_batches.store(28, Ordering::Relaxed);
        cells.state_write_failures.store(29, Ordering::Relaxed);
        cells.state_fenced.store(30, Ordering::Relaxed);
        cells.state_undecodable.store(31, Ordering::Relaxed);
        cells.home_requests.store(32, Ordering::Relaxed);
        cells.stop_hook_overruns.store(33, Ordering::Relaxed);
        cells.shard_load_timeouts.store(34, Ordering::Relaxed);
        cells.deliveries_handled.store(35, Ordering::Relaxed);
        cells.deliveries_duplicate.store(36, Ordering::Relaxed);
        cells.deliveries_sent_back.store(37, Ordering::Relaxed);
        cells.deliveries_held.store(38, Ordering::Relaxed);
        let s = cells.snapshot();
        assert_eq!(s.local_routed, 1);
        assert_eq!(s.remote_direct, 2);
        assert_eq!(s.remote_sent_direct, 3);
        assert_eq!(s.entity_starts, 4);
        assert_eq!(s.passivations_explicit, 5);
        assert_eq!(s.passivations_idle, 6);
        assert_eq!(s.passivations_limit, 7);
        assert_eq!(s.handoff_stops, 8);
        assert_eq!(s.dropped_buffer_full, 9);
        assert_eq!(s.dropped_handoff, 10);
        assert_eq!(s.dropped_slot_full, 11);
        assert_eq!(s.dropped_remembered_limit, 12);
        assert_eq!(s.slot_bytes_high_water, 13);
        assert_eq!(s.slot_budget_bytes, 14);
        assert_eq!(s.dropped_invalid, 15);
        assert_eq!(s.entity_panics, 16);
        assert_eq!(s.shard_failures, 17);
        assert_eq!(s.dropped_mailbox_full, 18);
        assert_eq!(s.dropped_refused, 19);
        assert_eq!(s.handoffs_started, 20);
        assert_eq!(s.handoffs_completed, 21);
        assert_eq!(s.remember_batches, 22);
        assert_eq!(s.remember_ids_written, 23);
        assert_eq!(s.remember_queue_wait_micros, 24);
        assert_eq!(s.remember_requests, 25);
        assert_eq!(s.remember_round_micros, 26);
        assert_eq!(s.state_writes, 27);
        assert_eq!(s.state_batches, 28);
        assert_eq!(s.state_write_failures, 29);
        assert_eq!(s.state_fenced, 30);
        assert_eq!(s.state_undecodable, 31);
        assert_eq!(s.home_requests, 32);
        assert_eq!(s.stop_hook_overruns, 33);
        assert_eq!(s.shard_load_timeouts, 34);
        assert_eq!((s.deliveries_handled, s.deliveries_duplicate, s.deliveries_sent_back), (35, 36, 37));
        assert_eq!(s.deliveries_held, 38);
    }
}
