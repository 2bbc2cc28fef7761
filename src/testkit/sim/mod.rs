//! A deterministic simulation of the sharding cores: the coordinator (under its singleton life
//! cycle), regions, shards, the replicator holding the coordinator state, and keep-majority
//! downing, wired together on a seeded in-memory network with a fake clock. No sockets, no
//! tasks, no wall clock: one seed is one interleaving, replayed byte for byte.
//!
//! **What is simulated.** Each node runs the same cores its tokio drivers run. The network
//! delivers per-link in order (as TCP does) after a seeded latency, and drops messages on cut
//! links, to and from crashed nodes, and (optionally) at random. Membership is the sim's own
//! model of gossip: one shared table of members and statuses, seen by each node with
//! reachability from the current cuts and with the down-removal margin applied per observer.
//! Entities are records: a start is an activation, a message to a running entity answers its
//! ask at once, a stop ends the activation.
//!
//! With `remember` on, shards record their starts in replicated OR-sets and recover them
//! (`remember.rs`). With `durable` on, entities keep a counter as durable state: each shard
//! claims its state slots by epoch before it serves, each message writes the incremented counter
//! at a majority before it is answered (`state.rs`). With `reliable` on, a producer per node
//! slot runs the producer core and sends numbered messages that entities admit by their
//! consumer marks (`producer.rs`, `delivery.rs`); with `durable_queue`, producers keep their
//! queues in fenced slots and resume them wherever a supervisor starts them again.
//!
//! **What is checked.** Never two live activations of one entity id (on any nodes, at any
//! time); every ask ends (answered, or failed with a typed reason that the faults explain);
//! after the faults heal and downed nodes restart, every entity answers again; nothing waits
//! for a commit at the end; with remember-entities, no acknowledged remembered id is lost; with
//! durable state, no acknowledged write is lost and no fenced epoch gets a write acknowledged;
//! with reliable delivery, nothing is confirmed unhandled, streams are handled in order, no
//! durable effect is written twice and no stored message is lost (see `delivery.rs`).
//!
//! Files: this one holds the model (nodes, network, membership, the event loop), `perform.rs`
//! what the drivers do with each core's actions, `coordinator.rs` the coordinator's life cycle,
//! take-over and state writes, `remember.rs` and `state.rs` the shard stores, `workload.rs`
//! the asks, the random faults and the controls of scripted runs, `producer.rs` and
//! `delivery.rs` reliable delivery, `run.rs` a run's shape, its course and its report.
//!
//! **Replay a seed.** `DDSHARD_SIM_SEED=<seed> cargo test --test sim -- --nocapture replay`
//! runs one seed with its trace printed. The trace lists every sharding-protocol message and
//! every activation with its virtual time in ms.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::clock::Instant;
use crate::ddata::FencedMap;
use crate::ddata::crdt::ReplicatedData;
use crate::ddata::replicator::{
    CoreSettings, PersistRecord, ReplicatorAction, ReplicatorCore, ReplicatorInput, ReplicatorMsg,
};
use crate::membership::{Member, MemberStatus, MembershipSnapshot, PeerAddr, UniqueAddress};
use crate::sharding::coordinator::core::{CoordinatorInput, MembersView};
use crate::sharding::coordinator::take_over::{TAKE_OVER_RETRY, TakeOver, TakeOverInput};
use crate::sharding::protocol::{ToCoordinator, ToRegion};
use crate::sharding::region::core::{RegionAction, RegionCore, RegionInput, RegionSettings};
use crate::sharding::shard::core::{ShardAction, ShardCore, ShardInput};
use crate::sharding::shard::new_shard_core;
use crate::sharding::shard::passivation::PolicySettings;
use crate::sharding::{ShardId, default_shard_id, keys};
use crate::singleton::{SingletonCore, SingletonInput};

mod coordinator;
mod delivery;
mod membership;
mod perform;
mod producer;
mod remember;
mod run;
mod shapes;
mod state;
mod workload;

use coordinator::{Coordinator, WritePart};

pub use run::{SimConfig, SimReport, run_seed};

pub use shapes::{shape, shapes};

/// Events in one virtual millisecond past which a run is a livelock (the busiest real
/// millisecond handles a few hundred).
const MAX_EVENTS_PER_MS: u64 = 100_000;

/// The one entity type of the simulation.
const TYPE: &str = "sim";
/// Each node's cores tick this often.
const TICK_MS: u64 = 50;
/// Membership views are refreshed this often.
const MEMBERSHIP_MS: u64 = 100;
/// An ask fails with a timeout after this long.
const ASK_TIMEOUT_MS: u64 = 5_000;
/// Time from a persist to its commit report (an LMDB fsync).
const FSYNC_MS: u64 = 2;

/// A write a node's store takes: committed to its disk when the commit is reported.
#[derive(Clone)]
enum DiskWrite {
    Snapshot(ReplicatedData),
    Delta(crate::ddata::ReplicatedDelta),
    Ceiling(u64),
}

/// A store write and its key (empty for a counter reservation).
type KeyedWrite = (String, DiskWrite);

impl DiskWrite {
    fn keyed(self, key: &str) -> KeyedWrite {
        (key.to_string(), self)
    }
}

/// Why an ask failed; each is a typed error in the real drivers.
const BUFFER_FULL: &str = "BufferFull";
const HAND_OFF: &str = "NotDelivered(hand-off)";
const SHARD_FAILED: &str = "NotDelivered(shard failed)";
/// Never seen today: the simulation's ids and states are far below the slot budget.
const SLOT_FULL: &str = "SlotFull";
/// Never seen today: simulated remembering shards have no remembered limit.
const REMEMBERED_LIMIT: &str = "RememberedLimit";
const REGION_GONE: &str = "NotDelivered(region gone)";
const NOT_HOSTED: &str = "NotDelivered(not hosted)";
const TIMEOUT: &str = "AskTimeout";
const REFUSED: &str = "NotDelivered(region refused)";

/// The shard-id extractor fingerprint every simulated node has (one extractor per run).
const EXTRACTOR: u64 = 0x5eed;

/// The message an entity gets: the client ask it answers, if any, or the reliable delivery it
/// is (by its flight number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Msg {
    ask: Option<u64>,
    delivery: Option<u64>,
}

// Simulation only: messages are moved through the event queue once.
#[allow(clippy::large_enum_variant)]
enum Wire {
    ToCoordinator(ToCoordinator),
    ToRegion(ToRegion),
    Deliver {
        shard: ShardId,
        epoch: u64,
        entity_id: String,
        msg: Msg,
    },
    AskReply {
        ask: u64,
    },
    /// A reliable delivery's outcome, to its producer's node.
    Outcome {
        flight: u64,
        result: crate::sharding::producer::core::SendResult,
    },
    Replicator(ReplicatorMsg),
    /// A heartbeat request (`response` false) or its answer.
    Heartbeat {
        response: bool,
        seq: u64,
    },
}

#[allow(clippy::large_enum_variant)]
enum Event {
    Deliver {
        from: UniqueAddress,
        to: UniqueAddress,
        wire: Wire,
    },
    Tick(usize),
    Membership,
    Fault,
    Ask,
    Terminated {
        node: UniqueAddress,
        shard: ShardId,
        entity_id: String,
        incarnation: u64,
    },
    RetryWrite {
        node: UniqueAddress,
        write: u64,
    },
    /// The node's store committed its persists up to `through` (an fsync later).
    Persisted {
        node: UniqueAddress,
        through: u64,
    },
    /// A client asks again after a transient, typed failure (as callers of `ask` do).
    RetryAsk {
        entity_id: String,
        attempt: u32,
    },
    /// A failed remembering shard starts again after its backoff.
    RestartShard {
        node: UniqueAddress,
        shard: ShardId,
        epoch: u64,
    },
    /// Recovery starts node slot `usize` again: its leave ended after the recovery's restart
    /// point (an operator who scaled down during the faults scales back up after them).
    StartAfterLeave(usize),
    /// Reliable delivery: a producer sends a message.
    Offer,
    /// Reliable delivery: producer `p{usize}` is started (again).
    StartProducer(usize),
    /// Reliable delivery: the confirmation incarnation `incarnation` of `entity_id` held back
    /// under `token` is given (`give`) or let go.
    HoldEnds {
        node: UniqueAddress,
        entity_id: String,
        incarnation: u64,
        token: u64,
        give: bool,
    },
}

/// What a replicator reply answers.
#[derive(Debug)]
enum RepReply {
    /// The take-over read `read` claimed the coordinator state.
    TakeOverClaim {
        read: u64,
    },
    /// The take-over read `read` read the remembered shards.
    TakeOverShards {
        read: u64,
    },
    /// One part of coordinator state write `write`.
    StateWrite {
        write: u64,
        part: WritePart,
    },
    RememberLoad {
        shard: ShardId,
        instance: u64,
        /// Tries made so far, this one included.
        tries: usize,
    },
    /// A try of remember batch `u64`.
    RememberWrite(u64),
    StateClaim(state::Claim),
    /// A try of state batch `u64`.
    EntityWrite(u64),
    /// The leaving node's replica was handed over (or not): it exits now.
    HandOver,
    /// A producer incarnation's claim of its durable queue at `epoch`.
    QueueClaim {
        producer: u64,
        epoch: u64,
        tries: usize,
    },
    /// A try of producer-queue write `u64`.
    QueueWrite(u64),
}

struct Node {
    addr: UniqueAddress,
    region: RegionCore<Msg>,
    shards: BTreeMap<ShardId, (ShardCore<Msg>, u64)>,
    /// Remember-entities: the current instance of each shard (a load or write answering an
    /// older one is ignored).
    shard_instances: BTreeMap<ShardId, u64>,
    /// Running entity instances: id → (shard, incarnation).
    entities: BTreeMap<String, (ShardId, u64)>,
    singleton: SingletonCore,
    /// The take-over read in flight, by read id.
    take_over: Option<(u64, TakeOver)>,
    coordinator: Option<Coordinator>,
    /// Remember batches in flight, by id: the write and its core.
    remember_batches: BTreeMap<u64, (remember::RememberWrite, crate::sharding::shard::batch::RememberBatch)>,
    /// State batches in flight, by id: the write, its shard and its core.
    state_batches: BTreeMap<u64, (state::EntityWrite, ShardId, crate::sharding::shard::batch::StateBatch)>,
    replicator: ReplicatorCore<RepReply>,
    /// Asks forwarded from here, by ask id → region they went to.
    forwarded: BTreeMap<u64, UniqueAddress>,
    downing: crate::membership::downing::Resolver,
    /// Message path: the heartbeat core.
    heartbeat: Option<crate::membership::failure_detector::HeartbeatCore>,
    down_seen: BTreeMap<UniqueAddress, u64>,
    last_view: Option<MembershipSnapshot>,
    next_write: u64,
    /// Durable state: running entities' counters and queues.
    states: BTreeMap<String, state::Activation>,
    /// Durable state: when each shard's completed claim began.
    claims_started: BTreeMap<ShardId, u64>,
    /// Reliable delivery: each running plain entity's marks, with its incarnation.
    plain_marks: BTreeMap<String, ((u64, u64), crate::sharding::delivery::ConsumerMarks)>,
    /// Reliable delivery: confirmations held back, by (entity, token).
    held: BTreeMap<(String, u64), delivery::Held>,
    /// Reliable delivery: the last token a hold was given.
    next_hold: u64,
    /// Reliable delivery: producer-queue writes in flight, by id.
    queue_writes: BTreeMap<u64, (producer::QueueWrite, crate::sharding::shard::batch::StateBatch)>,
}

struct MemberRow {
    addr: UniqueAddress,
    status: MemberStatus,
    up_number: u64,
}

struct Ask {
    entity_id: String,
    asker: UniqueAddress,
    deadline: u64,
    outcome: Option<Result<(), &'static str>>,
    /// Asked after recovery: must be answered, after at most `MAX_RETRIES` retries on a
    /// transient failure (hand-off, region gone).
    must_answer: bool,
    attempt: u32,
}

/// How long recovery lets the cluster settle after its last node start before it asks.
const SETTLE_MS: u64 = 15_000;

/// After recovery, producers get this long to have every message they hold confirmed.
const DRAIN_MS: u64 = 60_000;

/// Retries of an ask after recovery that failed transiently.
const MAX_RETRIES: u32 = 3;

/// One simulated cluster.
pub struct Sim {
    cfg: SimConfig,
    rng: StdRng,
    now_ms: u64,
    base: Instant,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Event>,
    link_free_at: BTreeMap<(UniqueAddress, UniqueAddress), u64>,
    /// Node slot → its running incarnation (`None`: crashed or downed).
    nodes: Vec<Option<Node>>,
    generations: Vec<u64>,
    /// Durable replicator state per node slot (what LMDB would hold).
    disks: Vec<BTreeMap<String, ReplicatedData>>,
    /// Per disk, the OR-set counter ceiling its store writer reserved.
    counter_ceilings: Vec<u64>,
    /// Per node slot, writes handed to its store and not yet committed (ticket, write), in
    /// ticket order (the core issues tickets in increasing order), so a commit takes a prefix.
    unsynced: Vec<VecDeque<(u64, KeyedWrite)>>,
    members: Vec<MemberRow>,
    cut: BTreeSet<(usize, usize)>,
    /// Links that lose node-to-node messages while gossip flows (message path only).
    messaging_cut: BTreeSet<(usize, usize)>,
    /// Message path: each observer's published verdicts (what gossip carries; the model
    /// spreads them at once, and a view counts only observers alive in it, as production does).
    verdicts: BTreeMap<UniqueAddress, Vec<UniqueAddress>>,
    /// Per node slot, the virtual time its pause (a GC pause, a frozen VM) ends: until then it
    /// handles nothing, its peers see it unreachable, and what is sent to it waits (as in its
    /// socket buffers).
    paused_until: Vec<u64>,
    /// Node incarnations that were ever paused (see `perform_shard`'s zombies).
    was_paused: BTreeSet<UniqueAddress>,
    asks: BTreeMap<u64, Ask>,
    next_ask: u64,
    live: BTreeMap<String, Vec<(UniqueAddress, u64)>>,
    /// Remember-entities: ids whose start write a majority acknowledged.
    remembered_acked: BTreeSet<String>,
    /// Remember-entities: id → when, by whom and counting which view its start was
    /// acknowledged (the evidence a lost id names).
    remembered_evidence: BTreeMap<String, String>,
    /// Durable state: the acknowledged writes and completed claims.
    ledger: state::StateLedger,
    /// Reliable delivery: the producers, and what they sent.
    producers: producer::Producers,
    /// Reliable delivery: what was stored, handled and confirmed.
    delivery_ledger: delivery::DeliveryLedger,
    dropping: bool,
    /// Recovery has begun: every node whose leave ends from now on is started again (a node
    /// that downs itself stays stopped), and the last start, done or due (virtual ms), bounds
    /// the settle.
    recovering: Option<u64>,
    /// Every node's replicator counts into these (the cluster's totals).
    replicator_stats: Arc<crate::ddata::ReplicatorStatCells>,
    report: SimReport,
}

/// The byte budget of one replicated slot, as a node with the default configuration has it.
fn slot_budget() -> usize {
    crate::config::NodeConfig::default().replicator_message_bytes()
}

/// The sharding settings of the simulated type: the defaults (as a user's type), without
/// idle passivation, remembering entities when the run does.
fn settings(cfg: &SimConfig) -> crate::sharding::ShardingSettings {
    use crate::sharding::{DurableStateSettings, PassivationSettings, RememberEntitiesSettings, ShardingSettings};
    // Few slots per shard, so slots hold several ids and states.
    ShardingSettings {
        passivation: PassivationSettings { idle_timeout: None, ..Default::default() },
        remember: RememberEntitiesSettings { enabled: cfg.remember, slots: 4, ..Default::default() },
        state: DurableStateSettings { slots: 4, ..Default::default() },
        ..Default::default()
    }
}

fn peer_of(addr: &UniqueAddress) -> PeerAddr {
    PeerAddr { address: addr.clone(), messaging_addr: SocketAddr::from(([127, 0, 0, 1], 1)) }
}

fn wire_name(w: &Wire) -> String {
    match w {
        Wire::ToCoordinator(m) => format!("{m:?}"),
        Wire::ToRegion(m) => format!("{m:?}"),
        Wire::Deliver { entity_id, .. } => format!("Deliver({entity_id})"),
        Wire::AskReply { ask } => format!("AskReply({ask})"),
        Wire::Outcome { flight, result } => format!("Outcome({flight}: {result:?})"),
        Wire::Replicator(_) => "Replicator".into(),
        Wire::Heartbeat { .. } => "Heartbeat".into(),
    }
}

impl Sim {
    /// A cluster of `cfg.nodes` Up members, seeded.
    pub fn new(seed: u64, cfg: SimConfig) -> Self {
        let mut sim = Sim {
            rng: StdRng::seed_from_u64(seed),
            now_ms: 0,
            base: Instant::now(),
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            link_free_at: BTreeMap::new(),
            nodes: Vec::new(),
            generations: vec![0; cfg.nodes],
            disks: vec![BTreeMap::new(); cfg.nodes],
            counter_ceilings: vec![0; cfg.nodes],
            unsynced: vec![VecDeque::new(); cfg.nodes],
            members: Vec::new(),
            cut: BTreeSet::new(),
            messaging_cut: BTreeSet::new(),
            verdicts: BTreeMap::new(),
            paused_until: vec![0; cfg.nodes],
            was_paused: BTreeSet::new(),
            asks: BTreeMap::new(),
            next_ask: 1,
            live: BTreeMap::new(),
            remembered_acked: BTreeSet::new(),
            remembered_evidence: BTreeMap::new(),
            ledger: Default::default(),
            producers: Default::default(),
            delivery_ledger: Default::default(),
            dropping: false,
            recovering: None,
            replicator_stats: Arc::new(crate::ddata::ReplicatorStatCells::default()),
            report: SimReport::default(),
            cfg,
        };
        for i in 0..sim.cfg.nodes {
            sim.nodes.push(None);
            sim.start_node(i);
            sim.schedule(1 + i as u64 * 7, Event::Tick(i));
        }
        sim.schedule(MEMBERSHIP_MS, Event::Membership);
        sim
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.now_ms)
    }

    fn wall(&self) -> u64 {
        1_700_000_000_000 + self.now_ms
    }

    fn trace(&mut self, line: impl FnOnce() -> String) {
        if self.cfg.trace {
            let line = format!("{:>6} {}", self.now_ms, line());
            self.report.trace.push(line);
        }
    }

    fn schedule(&mut self, after_ms: u64, ev: Event) {
        self.seq += 1;
        self.queue.push(Reverse((self.now_ms + after_ms, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn slot_of(&self, addr: &UniqueAddress) -> Option<usize> {
        let i = addr.node_id.strip_prefix('n')?.parse::<usize>().ok()?.checked_sub(1)?;
        self.nodes.get(i)?.as_ref().filter(|n| n.addr == *addr).map(|_| i)
    }

    fn start_node(&mut self, i: usize) {
        self.generations[i] += 1;
        let addr = UniqueAddress::new(format!("n{}", i + 1), self.generations[i]);
        let up_number = self.members.iter().map(|m| m.up_number).max().unwrap_or(0) + 1;
        // A newer incarnation supersedes the old one (gossip marks it removed).
        for m in self.members.iter_mut().filter(|m| m.addr.node_id == addr.node_id) {
            m.status = MemberStatus::Removed;
        }
        self.members.push(MemberRow { addr: addr.clone(), status: MemberStatus::Up, up_number });
        let now = self.now();
        let s = settings(&self.cfg);
        // The disk survives the restart, and with it the store writer and its reservation.
        let floor = self.counter_ceilings[i];
        self.counter_ceilings[i] = floor + crate::ddata::replicator::RESERVATION_SPAN;
        let reservation = crate::ddata::durable::CounterReservation {
            store_id: i as u64 + 1,
            floor,
            ceiling: self.counter_ceilings[i],
        };
        let mut replicator = ReplicatorCore::new(
            addr.clone(),
            crate::ddata::replicator::StoreWriter::new(&addr.node_id, reservation),
            CoreSettings::new(vec!["shard-".into()], Duration::from_millis(200)),
            self.replicator_stats.clone(),
        );
        let disk = self.disks[i].iter().map(|(k, v)| (k.clone(), v.clone(), Default::default()));
        replicator.load(disk.collect(), 0);
        let region_settings =
            RegionSettings { buffer_size: 1000, ..RegionSettings::of(&s, EXTRACTOR, self.cfg.durable) };
        self.nodes[i] = Some(Node {
            region: RegionCore::new(addr.clone(), false, region_settings, now),
            shards: BTreeMap::new(),
            shard_instances: BTreeMap::new(),
            entities: BTreeMap::new(),
            singleton: SingletonCore::new(TAKE_OVER_RETRY),
            take_over: None,
            coordinator: None,
            remember_batches: BTreeMap::new(),
            state_batches: BTreeMap::new(),
            replicator,
            forwarded: BTreeMap::new(),
            downing: crate::membership::downing::Resolver::new(
                crate::membership::downing::Strategy::KeepMajority { role: None },
                Duration::from_millis(1_500),
                // "on": stable_after × 3/4, at least 4 s.
                self.cfg.message_path.then_some(Duration::from_secs(4)),
                now,
            ),
            heartbeat: self
                .cfg
                .message_path
                .then(|| crate::membership::failure_detector::HeartbeatCore::new(addr.clone(), Default::default())),
            down_seen: BTreeMap::new(),
            last_view: None,
            next_write: 1,
            states: BTreeMap::new(),
            claims_started: BTreeMap::new(),
            plain_marks: BTreeMap::new(),
            held: BTreeMap::new(),
            next_hold: 0,
            queue_writes: BTreeMap::new(),
            addr: addr.clone(),
        });
        self.trace(|| format!("{addr} starts (up-number {up_number})"));
    }

    /// Crashes node slot `i`: its state is gone (its disk stays); its entities end now.
    fn crash(&mut self, i: usize, why: &str) {
        let Some(node) = self.nodes[i].take() else { return };
        self.paused_until[i] = 0;
        // What its store had not committed is lost.
        self.unsynced[i].clear();
        self.trace(|| format!("{} {why}", node.addr));
        for (entity_id, _) in node.entities {
            self.end_activation(&entity_id, &node.addr);
        }
        if self.cfg.reliable {
            self.producers_stopped_with(&node.addr);
        }
    }

    fn reachable(&self, a: usize, b: usize) -> bool {
        a == b || (!self.cut.contains(&(a, b)) && self.nodes[b].is_some() && !self.is_paused(b))
    }

    fn is_paused(&self, i: usize) -> bool {
        self.paused_until[i] > self.now_ms
    }

    /// The node slot an event is handled on (`None`: the whole cluster's).
    fn event_slot(&self, ev: &Event) -> Option<usize> {
        match ev {
            Event::Deliver { to: node, .. }
            | Event::Terminated { node, .. }
            | Event::RetryWrite { node, .. }
            | Event::Persisted { node, .. }
            | Event::RestartShard { node, .. }
            | Event::HoldEnds { node, .. } => self.slot_of(node),
            Event::Tick(i) => Some(*i),
            Event::Membership
            | Event::Fault
            | Event::Ask
            | Event::RetryAsk { .. }
            | Event::StartAfterLeave(_)
            | Event::Offer
            | Event::StartProducer(_) => None,
        }
    }

    fn send(&mut self, from: &UniqueAddress, to: &UniqueAddress, wire: Wire) {
        let (Some(a), Some(b)) = (self.slot_of(from), to.node_id[1..].parse::<usize>().ok().map(|n| n - 1)) else {
            return;
        };
        if a != b
            && (self.cut.contains(&(a, b))
                || self.messaging_cut.contains(&(a, b))
                || (self.dropping && self.rng.random_range(0..1000) < self.cfg.drop_per_mille))
        {
            return;
        }
        let latency = if a == b { 0 } else { self.rng.random_range(1..=5) };
        let link = (from.clone(), to.clone());
        let at = (self.now_ms + latency).max(*self.link_free_at.get(&link).unwrap_or(&0));
        self.link_free_at.insert(link, at);
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, Event::Deliver { from: from.clone(), to: to.clone(), wire });
    }

    /// Runs events until virtual time `until_ms`.
    pub fn run_until(&mut self, until_ms: u64) {
        // Events handled at the current virtual millisecond: a core that answers every input
        // with another at zero delay never lets time move, which is a livelock and a bug.
        let mut at_this_ms = 0u64;
        while let Some(Reverse((at, seq))) = self.queue.peek().copied() {
            if at > until_ms {
                break;
            }
            self.queue.pop();
            at_this_ms = if at == self.now_ms { at_this_ms + 1 } else { 0 };
            if at_this_ms > MAX_EVENTS_PER_MS {
                let v = format!("t={at} livelock: {MAX_EVENTS_PER_MS} events without time moving");
                self.report.violations.push(v);
                self.queue.clear();
                self.events.clear();
                return;
            }
            self.now_ms = at;
            let Some(ev) = self.events.remove(&seq) else { continue };
            // A paused node's events wait for its pause to end, in their order.
            if let Some(until) = self.event_slot(&ev).map(|i| self.paused_until[i]).filter(|u| *u > at) {
                self.seq += 1;
                self.queue.push(Reverse((until, self.seq)));
                self.events.insert(self.seq, ev);
                continue;
            }
            match ev {
                Event::Deliver { from, to, wire } => self.deliver(from, to, wire),
                Event::Tick(i) => self.on_tick(i),
                Event::Membership => self.on_membership(),
                Event::Fault => self.on_fault(),
                Event::Ask => self.on_ask(),
                Event::Terminated { node, shard, entity_id, incarnation } => {
                    self.on_terminated(node, shard, entity_id, incarnation)
                }
                Event::RetryAsk { entity_id, attempt } => {
                    let i = attempt as usize % self.nodes.len();
                    self.ask_attempt(i, entity_id, true, attempt);
                }
                Event::RetryWrite { node, write } => {
                    if let Some(i) = self.slot_of(&node) {
                        self.retry_state_write(i, write);
                    }
                }
                Event::Persisted { node, through } => self.on_persisted(node, through),
                Event::RestartShard { node, shard, epoch } => self.on_restart_shard(node, shard, epoch),
                Event::StartAfterLeave(i) => {
                    if self.nodes[i].is_none() {
                        self.start_node(i);
                        self.recovering = Some(self.now_ms);
                    }
                }
                Event::Offer => self.on_offer(),
                Event::StartProducer(k) => self.start_producer(k),
                Event::HoldEnds { node, entity_id, incarnation, token, give } => {
                    self.on_hold_ends(node, entity_id, incarnation, token, give);
                }
            }
        }
        self.now_ms = self.now_ms.max(until_ms);
    }

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
        if self.cfg.reliable {
            // Producers send what they hold until it is confirmed.
            let drained_by = self.now_ms + DRAIN_MS;
            while !self.producers_drained() && self.now_ms < drained_by {
                self.run_until(self.now_ms + 500);
            }
        }
        // A commit issued in the last milliseconds (a rebalance's write, a producer's last
        // deletions) is still on its way at `end`; a stuck one never clears. Wait out a few
        // fsyncs for the first kind.
        for _ in 0..20 {
            if self.nodes.iter().flatten().all(|n| n.replicator.durability_backlog() == (0, 0)) {
                break;
            }
            self.run_until(self.now_ms + 5 * FSYNC_MS);
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
