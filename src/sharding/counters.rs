//! [`RegionCounters`]: what one region counted since it started.

use std::sync::atomic::AtomicU64;

/// Counters of one region.
#[derive(Debug, Default)]
pub struct RegionCounters {
    /// Messages from this node's handle that took the routed path (through the region task:
    /// the entity was not running here, was starting or stopping, or an earlier message to it
    /// was still on that path) rather than going straight into a running entity's mailbox.
    pub local_routed: AtomicU64,
    /// Messages from other nodes that went from the connection straight into a running
    /// entity's mailbox, without a hop through the region task.
    pub remote_direct: AtomicU64,
    /// Messages from this node's handle sent straight to their shard's home on another node,
    /// without a hop through the region task.
    pub remote_sent_direct: AtomicU64,
    /// Entity incarnations started here (first messages, restarts, remembered entities).
    pub entity_starts: AtomicU64,
    /// Entities stopped because they asked to passivate.
    pub passivations_explicit: AtomicU64,
    /// Entities passivated after the idle timeout.
    pub passivations_idle: AtomicU64,
    /// Entities passivated to make room under the active-entity limit.
    pub passivations_limit: AtomicU64,
    /// Entities stopped because their shard was handed off.
    pub handoff_stops: AtomicU64,
    /// Messages dropped because the buffer was full.
    pub dropped_buffer_full: AtomicU64,
    /// Messages dropped during hand-offs.
    pub dropped_handoff: AtomicU64,
    /// Remembered-id starts and durable-state writes refused because their replicated slot is
    /// at its byte budget ([`crate::Error::SlotFull`]).
    pub dropped_slot_full: AtomicU64,
    /// Remembered-id starts refused because their shard remembers its limit of entities
    /// ([`crate::Error::RememberedLimit`]).
    pub dropped_remembered_limit: AtomicU64,
    /// The largest replicated slot (remembered ids or entity states) this region wrote, in
    /// bytes, since it started: against [`RegionCounters::slot_budget_bytes`], how close the
    /// fullest slot came to refusing growth (alert at half).
    pub slot_bytes_high_water: AtomicU64,
    /// The byte budget of one replicated slot (one replicator message).
    pub slot_budget_bytes: AtomicU64,
    /// Messages from other nodes that did not decode, had an empty entity id, or named another
    /// shard than this node's extractor gives for the id.
    pub dropped_invalid: AtomicU64,
    /// Entity handlers that panicked.
    pub entity_panics: AtomicU64,
    /// Shards stopped because their remembered set could not be loaded or written.
    pub shard_failures: AtomicU64,
    /// Messages dropped because their entity's mailbox was full (`entity_mailbox_capacity`).
    pub dropped_mailbox_full: AtomicU64,
    /// Messages refused because the coordinator refused this region (its shard-id extractor
    /// differs from the coordinator's node: an entity could otherwise run in two shards).
    pub dropped_refused: AtomicU64,
    /// Hand-offs of a local shard the coordinator started (rebalance, shutdown, leave).
    pub handoffs_started: AtomicU64,
    /// Of those, the shards whose entities have all stopped.
    pub handoffs_completed: AtomicU64,
    /// Remember-entities: batches written by this region's remember writer (one majority
    /// update each, covering the starts and stops of all its shards queued meanwhile).
    pub remember_batches: AtomicU64,
    /// Remember-entities: entity starts and stops those batches recorded.
    pub remember_ids_written: AtomicU64,
    /// Remember-entities: total time requests waited for their batch to leave, in microseconds
    /// (divide by the requests for the mean).
    pub remember_queue_wait_micros: AtomicU64,
    /// Remember-entities: requests (one per shard and batch) the writer took.
    pub remember_requests: AtomicU64,
    /// Remember-entities: total time of the batches' majority rounds (with retries), in
    /// microseconds (divide by `remember_batches` for the mean).
    pub remember_round_micros: AtomicU64,
    /// Durable entities: state writes acknowledged (persist and delete).
    pub state_writes: AtomicU64,
    /// Durable entities: batches written by this region's state writer (one majority update
    /// each, for the writes of all its entities queued meanwhile).
    pub state_batches: AtomicU64,
    /// Durable entities: state writes that failed (not acknowledged, refused by a fence, or over
    /// `max_state_bytes`).
    pub state_write_failures: AtomicU64,
    /// Durable entities: writes refused because a newer allocation claimed the shard's state.
    pub state_fenced: AtomicU64,
    /// Durable entities: stored states that did not decode as the entity's `State`.
    pub state_undecodable: AtomicU64,
}
