//! What a simulated run is given (its shape), what it reports, and running one seed.

use std::collections::BTreeMap;

use super::*;

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
}

/// Runs one seed with `cfg`.
pub fn run_seed(seed: u64, cfg: &SimConfig) -> SimReport {
    super::Sim::new(seed, cfg.clone()).run()
}

impl Sim {
    /// The whole run: traffic and faults for `fault_ms`, then heal, restart every stopped node,
    /// let the cluster settle, and ask every entity once more (each must be answered).
    pub fn run(mut self) -> SimReport {
        self.schedule(200, Event::Ask);
        if self.cfg.reliable {
            for k in 0..self.nodes.len() {
                self.schedule(100, Event::StartProducer(k));
            }
            self.schedule(300, Event::Offer);
        }
        if self.cfg.faults {
            self.dropping = self.cfg.drop_per_mille > 0;
            self.schedule(2_000, Event::Fault);
        }
        self.run_until(self.cfg.fault_ms);
        self.dropping = false;
        self.cut.clear();
        self.messaging_cut.clear();
        // Pauses end (what a paused node missed is handled first, as on a real resume).
        let resumed = self.paused_until.iter().copied().max().unwrap_or(0);
        if resumed > self.now_ms {
            self.run_until(resumed);
        }
        self.trace(|| "heal; restarting stopped nodes".into());
        for i in 0..self.nodes.len() {
            if self.nodes[i].is_none() {
                self.start_node(i);
            }
        }
        self.recovering = Some(self.now_ms);
        // Settle: downing of the old incarnations, removal margins, coordinator take-over; a
        // leave still under way ends, and that node is started again (seed 760109273: every
        // node was leaving, and none was left to answer), so settle from the last start.
        while let Some(started) = self.recovering
            && self.now_ms < started + SETTLE_MS
        {
            self.run_until(started + SETTLE_MS);
        }
        for e in 0..self.cfg.entities {
            let i = e % self.nodes.len();
            self.ask(i, format!("e{e}"), true);
        }
        let end = self.now_ms + ASK_TIMEOUT_MS + 1_000;
        self.run_until(end);
        // Asks still open end by their timeout, as `ask` does; an ask that ends twice (an answer
        // after a failure or a second answer) was reported when it happened.
        let open: Vec<u64> = self.asks.iter().filter(|(_, a)| a.outcome.is_none()).map(|(id, _)| *id).collect();
        for id in open {
            self.resolve(id, Err(TIMEOUT));
        }
        let failed: Vec<(u64, String, &'static str)> = self
            .asks
            .iter()
            .filter_map(|(id, a)| match (a.must_answer, a.outcome) {
                (true, Some(Err(why))) => Some((*id, a.entity_id.clone(), why)),
                _ => None,
            })
            .collect();
        for (id, entity_id, why) in failed {
            let placement = self.placement_evidence(&entity_id);
            self.report.violations.push(format!("after recovery, ask {id} to {entity_id} failed: {why}; {placement}"));
        }
        // A commit issued in the last milliseconds (a rebalance's write, say) is still on its
        // way at `end`; a stuck one never clears. Wait out a few fsyncs for the first kind.
        for _ in 0..20 {
            if self.nodes.iter().flatten().all(|n| n.replicator.durability_backlog() == (0, 0)) {
                break;
            }
            self.run_until(self.now_ms + 5 * FSYNC_MS);
        }
        if self.cfg.reliable {
            // Producers send what they hold until it is confirmed.
            let drained_by = self.now_ms + DRAIN_MS;
            while !self.producers_drained() && self.now_ms < drained_by {
                self.run_until(self.now_ms + 500);
            }
        }
        self.check_nothing_waits_for_a_commit();
        self.report.virtual_ms = self.now_ms;
        self.report.quarantined_messages = self.replicator_stats.quarantined.load(std::sync::atomic::Ordering::Relaxed);
        if self.cfg.remember {
            self.check_no_acknowledged_id_lost();
        }
        if self.cfg.durable {
            self.check_no_acknowledged_state_lost();
        }
        if self.cfg.reliable {
            self.check_no_stored_message_lost();
        }
        self.report
    }
}
