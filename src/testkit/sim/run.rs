//! What a simulated run is given (its shape), what it reports, and running one seed.

use std::collections::BTreeMap;

/// The shape of one simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Nodes (all start Up).
    pub nodes: usize,
    /// Shards of the entity type.
    pub shards: u32,
    /// Distinct entity ids the workload asks.
    pub entities: usize,
    /// Virtual time with faults and traffic, in ms.
    pub fault_ms: u64,
    /// Random faults (crash, restart, partition, heal) during `fault_ms`.
    pub faults: bool,
    /// Per-mille of messages dropped at random during the faults.
    pub drop_per_mille: u32,
    /// Record the trace (off for long property runs: it is most of their cost).
    pub trace: bool,
    /// Remember-entities on: shards record their starts in replicated OR-sets and the run
    /// checks that no acknowledged id is lost.
    pub remember: bool,
    /// Durable entity state on: each entity's counter is claimed, read and written through
    /// fenced maps, and the run checks that no acknowledged write is lost.
    pub durable: bool,
    /// Reachability as the message path sees it: every node runs the heartbeat core over the
    /// simulated network, its verdicts are merged by the production rule, gossip liveness
    /// travels only over links that work both ways (as chitchat's push-pull needs), the
    /// resolver downs indirectly connected members and downs all when unstable, and the
    /// faults add one-way and messaging-only cuts. Off: each node sees a peer unreachable
    /// exactly while its own link to it is cut (an instant, direct detector).
    pub message_path: bool,
    /// Reliable delivery: a producer per node slot (moved by a supervisor when its node
    /// stops) sends numbered messages to the entities, and the run checks that nothing
    /// stored is lost, nothing is confirmed unhandled, each stream is handled in order and
    /// (with `durable`) each message's effect lands once.
    pub reliable: bool,
    /// Reliable delivery: the producers keep their queues in the cluster (fenced, majority
    /// writes) and resume them wherever they start again.
    pub durable_queue: bool,
    /// Reliable delivery: producers with a window of 3 and room for 4 entities' streams, so
    /// a stream's places wrap, idle streams are evicted and their lanes given out again.
    pub tight_producers: bool,
    /// Reliable delivery: entities hold the confirmation of one delivery in five back
    /// (`EntityContext::confirm_later`) and give it (or, one in five, let it go) 0.1–3 s
    /// later; a durable entity writes the message's effect with the confirmation.
    pub deferred_confirms: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            nodes: 5,
            shards: 12,
            entities: 30,
            fault_ms: 20_000,
            faults: true,
            drop_per_mille: 5,
            trace: true,
            remember: false,
            durable: false,
            message_path: false,
            reliable: false,
            durable_queue: false,
            tight_producers: false,
            deferred_confirms: false,
        }
    }
}

/// What one run saw.
#[derive(Debug, Default)]
pub struct SimReport {
    /// Every protocol message delivered and every activation, with its virtual time.
    pub trace: Vec<String>,
    /// Broken promises (empty on a good run).
    pub violations: Vec<String>,
    /// Asks answered.
    pub answered: usize,
    /// Asks failed, by reason.
    pub failed: BTreeMap<&'static str, usize>,
    /// Activations of entities over the run.
    pub activations: usize,
    /// Remember-entities: ids whose start a majority acknowledged (all checked at the end).
    pub remembered_acked: usize,
    /// Durable state: entity writes a majority acknowledged.
    pub states_acked: usize,
    /// Durable state: activations started while one of the same id lived on a node that had
    /// been paused (a zombie its peers downed; it must commit nothing).
    pub zombie_overlaps: usize,
    /// Coordinator writes refused because a newer coordinator term claimed the state: each is
    /// a zombie coordinator (its node paused past its downing) that stopped instead of acting.
    pub coordinators_fenced: usize,
    /// Message path: heartbeat frames sent (requests and responses) over the run.
    pub heartbeat_frames: u64,
    /// Virtual time the run lasted, in ms.
    pub virtual_ms: u64,
    /// Message path: members downed by the resolver, by node incarnation, in order.
    pub downed: Vec<String>,
    /// Replicator messages dropped because their sender had been downed or removed where they
    /// arrived (a paused zombie's writes, say): see `ReplicatorStatCells::quarantined`.
    pub quarantined_messages: u64,
    /// Reliable delivery: messages stored over the run.
    pub deliveries_stored: usize,
    /// Reliable delivery: stored messages that ended with their producer's in-memory queue
    /// (its node stopped) before they were confirmed.
    pub deliveries_ended_with_producer: usize,
    /// Deferred confirms: holds given over the run.
    pub holds_given: usize,
    /// Deferred confirms: holds let go (dropped unconfirmed) over the run.
    pub holds_let_go: usize,
}

/// Runs one seed with `cfg`.
pub fn run_seed(seed: u64, cfg: &SimConfig) -> SimReport {
    super::Sim::new(seed, cfg.clone()).run()
}
