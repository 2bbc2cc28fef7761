//! The coordinator's driver: a [`SingletonCore`] decides when the coordinator of a type runs on
//! this node (and with which state); while it runs, a [`CoordinatorCore`] gets the coordinator
//! topic, membership and ticks, and its actions are performed here (sends, majority writes).
//!
//! **Terms.** The coordinator state is a [`FencedMap`] fenced by coordinator term. The
//! take-over read claims the state under a new term (above every term this node has seen, and
//! at least the wall clock) on the replicas it reads from, and every write of the coordinator
//! is under its term. A coordinator that was paused past its downing and wakes up still
//! believing it runs (a zombie) therefore cannot have a write acknowledged once its successor
//! has claimed the state: a majority of replicas refuse it, the allocation it held back is
//! never announced, and the coordinator stops (`SingletonInput::Fenced`). Without the fence its
//! write overwrote its successor's placement: a shard homed on a region that was gone, or
//! started on a second region (found by the simulation with the coordinator's node paused).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::core::{CoordinatorAction, CoordinatorCore, CoordinatorInput, CoordinatorSettings, MembersView, plan_dto};
use super::state::CoordinatorState;
use crate::clock::{Instant, wall_ms};
use crate::ddata::{Consistency, FencedMap, GSet, KeyUpdate, Replicator};
use crate::error::Error;
use crate::membership::MembershipSnapshot;
use crate::metrics::TypeMetrics;
use crate::node::Node;
use crate::sharding::allocation::{PanicGuardedStrategy, ShardAllocationStrategy, strategy_for};
use crate::sharding::ids::ShardId;
use crate::sharding::keys;
use crate::sharding::protocol::{CoordinatorQuery, RegionInbound, ToCoordinator};
use crate::sharding::settings::{AllocationSettings, ShardingSettings};
use crate::singleton::{SingletonAction, SingletonCore, SingletonInput};
use crate::transport::{Inbound, wire};

/// How often the coordinator checks its deadlines (and whether it is still the host).
const COORDINATOR_TICK: Duration = Duration::from_millis(100);
/// Pause between failed take-over reads.
const TAKE_OVER_RETRY: Duration = Duration::from_millis(200);
/// Backoff of a failed state write: from the first value, doubling up to the second.
const WRITE_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// What the take-over read finds: the coordinator state and, with remember-entities, every
/// shard the type ever had.
pub(crate) struct TakeOverState {
    map: FencedMap,
    /// The term this coordinator claimed the state under: every write of it carries it.
    term: u64,
    remembered_shards: Option<BTreeSet<ShardId>>,
}

/// How a state write ended.
enum WriteOutcome {
    Acknowledged,
    /// A newer coordinator term claimed the state: this coordinator is stale.
    Fenced {
        term: u64,
        fence: u64,
    },
}

/// Consistency of coordinator state writes (Akka's WriteMajorityPlus, 3 and min-cap 5 by default).
fn state_write(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator_write_majority_plus, min_cap: s.coordinator_majority_min_cap }
}

/// Consistency of the state read at take-over (ReadMajorityPlus, 5 and min-cap 5 by default).
fn state_read(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator_read_majority_plus, min_cap: s.coordinator_majority_min_cap }
}

/// Consistency of the durable set of remembered shards, written and read: a plain majority of
/// the replicator's roster (DESIGN.md, decision 4). The coordinator's plus and min-cap are for
/// quorums over today's members; over the roster they would make a small cluster wait for
/// every holder ever seen.
const REMEMBERED_SHARDS: Consistency = Consistency::MAJORITY;

/// Starts the coordinator singleton driver of a type on this node.
pub(crate) fn start_singleton(
    node: &Node,
    type_name: &str,
    settings: ShardingSettings,
    custom: Option<Arc<dyn ShardAllocationStrategy>>,
    extractor_fingerprint: u64,
    shard_ids: crate::sharding::ids::ShardIdRule,
) {
    let table: Arc<RwLock<BTreeMap<ShardId, String>>> = Arc::default();
    if custom.is_none() && matches!(settings.allocation, AllocationSettings::External { .. }) {
        node.spawner().spawn(follow_external_locations(node.clone(), type_name.to_string(), table.clone()));
    }
    let strategy = custom.unwrap_or_else(|| strategy_for(&settings.allocation, table));
    let strategy: Arc<dyn ShardAllocationStrategy> = Arc::new(PanicGuardedStrategy(strategy));
    let driver = CoordinatorDriver {
        metrics: Arc::new(TypeMetrics::new(node.node_id(), type_name)),
        node: node.clone(),
        type_name: type_name.to_string(),
        settings,
        strategy,
        extractor_fingerprint,
        shard_ids,
    };
    node.spawner().spawn_essential("shard coordinator", driver.run());
}

/// Keeps the External strategy's table equal to the replicated map of desired locations.
async fn follow_external_locations(node: Node, type_name: String, table: Arc<RwLock<BTreeMap<ShardId, String>>>) {
    let shutdown = node.shutdown_token();
    let Ok(mut rx) = node.replicator().subscribe(&keys::external_locations(&type_name)).await else { return };
    loop {
        let current = rx.borrow_and_update().clone();
        if let Some(crate::ddata::ReplicatedData::LwwMap(m)) = current {
            let next: BTreeMap<ShardId, String> =
                m.iter().filter_map(|(k, _)| Some((k.to_string(), m.get_as::<String>(k).ok()??))).collect();
            *table.write().expect("locations lock") = next;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

struct CoordinatorDriver {
    /// Whether it runs here, and its state writes (feature `metrics`).
    metrics: Arc<TypeMetrics>,
    node: Node,
    type_name: String,
    settings: ShardingSettings,
    strategy: Arc<dyn ShardAllocationStrategy>,
    extractor_fingerprint: u64,
    shard_ids: crate::sharding::ids::ShardIdRule,
}

/// The coordinator while it runs here.
struct Running {
    core: CoordinatorCore,
    term: u64,
    inbound: mpsc::Receiver<Inbound>,
    /// The state write in flight (aborted when the coordinator stops: a write still retrying
    /// must not land after a successor took over).
    write: Option<JoinHandle<()>>,
}

async fn next_inbound(running: &mut Option<Running>) -> Option<Inbound> {
    match running {
        Some(r) => r.inbound.recv().await,
        None => std::future::pending().await,
    }
}

impl CoordinatorDriver {
    async fn run(self) {
        let shutdown = self.node.shutdown_token();
        let role = self.settings.role.clone();
        let mut members = self.node.watch_membership();
        let mut singleton = SingletonCore::new(TAKE_OVER_RETRY);
        let mut running: Option<Running> = None;
        let (reads_tx, mut reads_rx) = mpsc::unbounded_channel();
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<WriteOutcome>();
        let mut tick = tokio::time::interval(COORDINATOR_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut snap = members.borrow_and_update().clone();
        let mut single = Vec::new();
        singleton.handle(SingletonInput::Host(snap.hosts_singleton(role.as_deref())), Instant::now(), &mut single);
        loop {
            let mut out = Vec::new();
            for action in single.drain(..) {
                self.perform_singleton(action, &mut running, &snap, &reads_tx, &singleton, &mut out);
            }
            if let Some(r) = running.as_mut() {
                self.perform(r, &mut out, &snap, &done_tx);
            }
            let (now, wall) = (Instant::now(), wall_ms());
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    snap = members.borrow_and_update().clone();
                    singleton.handle(SingletonInput::Host(snap.hosts_singleton(role.as_deref())), now, &mut single);
                    if let Some(r) = running.as_mut() {
                        r.core.handle(CoordinatorInput::Members(MembersView::of(&snap)), now, wall, &mut out);
                    }
                }
                Some((read, result)) = reads_rx.recv() => {
                    singleton.handle(SingletonInput::ReadDone { read, result }, now, &mut single);
                }
                Some(m) = next_inbound(&mut running) => {
                    if let Some(r) = running.as_mut() {
                        self.on_inbound(&mut r.core, m, &mut out);
                    }
                }
                Some(outcome) = done_rx.recv() => match outcome {
                    WriteOutcome::Acknowledged => {
                        if let Some(r) = running.as_mut() {
                            debug!(type_name = %self.type_name, "coordinator state write acknowledged");
                            r.write = None;
                            r.core.handle(CoordinatorInput::WriteDone, now, wall, &mut out);
                        }
                    }
                    WriteOutcome::Fenced { term, fence } => {
                        if running.as_ref().is_some_and(|r| r.term == term) {
                            warn!(type_name = %self.type_name, term, fence, "a newer coordinator claimed the state; this one stops");
                            singleton.handle(SingletonInput::Fenced, now, &mut single);
                        }
                    }
                },
                _ = tick.tick() => {
                    // Also checked without a membership change: a change consumed while this
                    // driver was busy must not leave a coordinator running.
                    let host = members.borrow().hosts_singleton(role.as_deref());
                    singleton.handle(SingletonInput::Host(host), now, &mut single);
                    singleton.handle(SingletonInput::Tick, now, &mut single);
                    if let Some(r) = running.as_mut() {
                        r.core.handle(CoordinatorInput::Tick, now, wall, &mut out);
                    }
                }
            }
            if let Some(r) = running.as_mut() {
                self.perform(r, &mut out, &snap, &done_tx);
                self.metrics.shards_rebalanced(r.core.shards_rebalanced());
            }
        }
        if let Some(r) = running.take() {
            self.stop(r);
        }
    }

    fn perform_singleton(
        &self,
        action: SingletonAction<TakeOverState>,
        running: &mut Option<Running>,
        snap: &MembershipSnapshot,
        reads: &mpsc::UnboundedSender<(u64, Result<TakeOverState, String>)>,
        singleton: &SingletonCore,
        out: &mut Vec<CoordinatorAction>,
    ) {
        match action {
            SingletonAction::Read { read } => {
                if singleton.failed_reads() >= 5 {
                    warn!(type_name = %self.type_name, attempts = singleton.failed_reads(), "coordinator still cannot read its state");
                }
                let (replicator, settings, type_name) =
                    (self.node.replicator().clone(), self.settings.clone(), self.type_name.clone());
                let reads = reads.clone();
                self.node.spawner().spawn_until_shutdown(async move {
                    let result = take_over_read(&replicator, &type_name, &settings).await;
                    if let Err(e) = &result {
                        info!(%type_name, error = %e, "coordinator waiting for its state");
                    }
                    let _ = reads.send((read, result));
                });
            }
            SingletonAction::Start(state) => {
                let st = CoordinatorState::from_map(&state.map);
                info!(type_name = %self.type_name, shards = st.shards().len(), regions = st.regions.len(), "coordinator started");
                let cs = CoordinatorSettings {
                    min_nr_of_members: self.settings.min_nr_of_members,
                    rebalance_interval: self.settings.rebalance_interval,
                    handoff_timeout: self.settings.handoff_timeout,
                    shard_start_timeout: self.settings.shard_start_timeout,
                    eager_reallocation: self.settings.remember_entities,
                    extractor_fingerprint: self.extractor_fingerprint,
                    shard_ids: self.shard_ids,
                    // A value over the message budget still travels alone in one frame.
                    max_state_bytes: self.node.config().transport.max_frame_size / 2,
                };
                let now = Instant::now();
                let me = self.node.address().clone();
                let mut core = CoordinatorCore::new(me, cs, self.strategy.clone(), st, now);
                let inbound = self.node.transport().subscribe(&keys::coordinator_topic(&self.type_name), 65_536);
                core.handle(CoordinatorInput::Members(MembersView::of(snap)), now, wall_ms(), out);
                core.handle(CoordinatorInput::TakeOver, now, wall_ms(), out);
                if let Some(shards) = state.remembered_shards {
                    info!(type_name = %self.type_name, shards = shards.len(), "allocating remembered shards");
                    core.handle(CoordinatorInput::RememberedShards(shards), now, wall_ms(), out);
                }
                *running = Some(Running { core, term: state.term, inbound, write: None });
                self.metrics.coordinator_active(true);
            }
            SingletonAction::Stop => {
                info!(type_name = %self.type_name, "no longer the coordinator's host; coordinator stops");
                if let Some(r) = running.take() {
                    self.stop(r);
                }
            }
        }
    }

    fn stop(&self, r: Running) {
        self.metrics.coordinator_active(false);
        self.node.transport().unsubscribe(&keys::coordinator_topic(&self.type_name));
        if let Some(w) = r.write {
            w.abort();
        }
    }

    fn on_inbound(&self, core: &mut CoordinatorCore, m: Inbound, out: &mut Vec<CoordinatorAction>) {
        if let Some(id) = m.request_id {
            let type_name = &self.type_name;
            let reply = match wire::decode::<CoordinatorQuery>(&m.body) {
                Ok(CoordinatorQuery::CurrentRegions) => {
                    wire::encode(&core.regions().cloned().collect::<BTreeSet<crate::sharding::RegionId>>())
                }
                Ok(CoordinatorQuery::Allocation) => wire::encode(&core.allocation_table(type_name, Instant::now())),
                Ok(CoordinatorQuery::Explain { shard }) => {
                    wire::encode(&core.explain(type_name, &shard, Instant::now()))
                }
                Ok(CoordinatorQuery::RebalancePlan) => wire::encode(&core.rebalance_plan(type_name)),
                Ok(CoordinatorQuery::Rebalance) => {
                    let in_progress = core.in_progress();
                    core.handle(CoordinatorInput::RebalanceNow, Instant::now(), wall_ms(), out);
                    let round = core.take_requested_round().unwrap_or_else(|| Err("the round did not run".into()));
                    wire::encode(&plan_dto(type_name, round, in_progress, true))
                }
                Err(e) => Err(e),
            };
            let r = match &reply {
                Ok(b) => Ok(&b[..]),
                Err(e) => Err(e.to_string()),
            };
            let _ = self.node.transport().respond(&m.from, id, r);
            return;
        }
        match wire::decode::<ToCoordinator>(&m.body) {
            Ok(msg) => {
                debug!(type_name = %self.type_name, ?msg, "coordinator received");
                let input = CoordinatorInput::FromRegion { from: m.from.address, msg };
                core.handle(input, Instant::now(), wall_ms(), out);
            }
            Err(e) => warn!(peer = %m.from.address, error = %e, "malformed coordinator message dropped"),
        }
    }

    fn perform(
        &self,
        running: &mut Running,
        out: &mut Vec<CoordinatorAction>,
        snap: &MembershipSnapshot,
        done: &mpsc::UnboundedSender<WriteOutcome>,
    ) {
        let topic = keys::region_topic(&self.type_name);
        for action in out.drain(..) {
            match action {
                CoordinatorAction::Send { to, msg } => {
                    let Some(peer) = snap.peer(&to) else { continue };
                    let sent = wire::encode(&RegionInbound::Coordinator(msg))
                        .and_then(|b| self.node.transport().send(&peer, &topic, &b));
                    if let Err(e) = sent {
                        debug!(region = %to, error = %e, "coordinator message not sent");
                    }
                }
                CoordinatorAction::Write(entries) => {
                    debug!(type_name = %self.type_name, entries = entries.len(), "coordinator state write started");
                    let write = self.write_state(entries, running.term, done.clone());
                    running.write = Some(self.node.spawner().spawn_until_shutdown(write));
                }
            }
        }
    }

    /// Writes the entries (and, with remember-entities, the newly allocated shards into the
    /// durable set of shards), retrying with backoff until both succeed; then reports done.
    fn write_state(
        &self,
        entries: Vec<super::core::StateEntry>,
        term: u64,
        done: mpsc::UnboundedSender<WriteOutcome>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let replicator = self.node.replicator().clone();
        let shards_key = keys::remembered_shards(&self.type_name);
        let (timeout, consistency) = (self.settings.updating_state_timeout, state_write(&self.settings));
        let type_name = self.type_name.clone();
        let metrics = self.metrics.clone();
        let remembered: Option<BTreeSet<ShardId>> = self.settings.remember_entities.then(|| {
            entries
                .iter()
                .filter(|(_, v)| v.is_some())
                .filter_map(|(k, _)| keys::shard_of_entry(k).map(String::from))
                .collect()
        });
        async move {
            let started = Instant::now();
            let mut backoff = WRITE_BACKOFF.0;
            loop {
                // The state entries (counted over the members, with Akka's plus and min-cap)
                // and the newly remembered shards (a durable key: a plain majority of the
                // roster, which downing cannot shrink) go at once, each in one round.
                let state = replicator.update_many(
                    consistency,
                    timeout,
                    vec![super::state::write_update(&type_name, entries.clone(), term)],
                );
                let shards = async {
                    let Some(shards) = remembered.clone().filter(|s| !s.is_empty()) else { return Ok(()) };
                    let insert = KeyUpdate::new::<GSet, _>(&shards_key, move |g, _| {
                        for s in shards {
                            g.insert(s);
                        }
                    });
                    replicator.update_many(REMEMBERED_SHARDS, timeout, vec![insert]).await
                };
                let (state, shards) = tokio::join!(state, shards);
                // The state's outcome first: a fence there ends the writes for good.
                let r = state.and(shards);
                match r {
                    Ok(()) => break,
                    Err(Error::ShutDown) => return,
                    Err(Error::Fenced { fence, .. }) => {
                        // Retrying cannot help: the term is stale for good.
                        let _ = done.send(WriteOutcome::Fenced { term, fence });
                        return;
                    }
                    Err(e) => {
                        metrics.state_write_failed();
                        warn!(%type_name, error = %e, "coordinator state write failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(WRITE_BACKOFF.1);
                    }
                }
            }
            metrics.state_written(started);
            let _ = done.send(WriteOutcome::Acknowledged);
        }
    }
}

/// Claims of the state under a higher term, when a replica turns out to hold a newer one,
/// before the take-over read fails (and is retried by the singleton core).
const CLAIM_TRIES: usize = 3;

/// The take-over read: claims the coordinator state under a new term and reads it (majority
/// plus; the replicas store the claim before they answer), then, with remember-entities, reads
/// the durable set of shards. Either failing fails the read (it is retried).
async fn take_over_read(
    replicator: &Replicator,
    type_name: &str,
    settings: &ShardingSettings,
) -> Result<TakeOverState, String> {
    let (consistency, timeout) = (state_read(settings), settings.waiting_for_state_timeout);
    let key = keys::coordinator_state(type_name);
    let local_fence = replicator.read_local_with::<FencedMap, _, _>(&key, FencedMap::fence).await;
    let mut term = wall_ms().max(local_fence.map_err(|e| e.to_string())?.unwrap_or(0).saturating_add(1));
    let mut claimed = None;
    for _ in 0..CLAIM_TRIES {
        let claim = super::state::claim_update(type_name, term);
        match replicator.update_and_get_many::<FencedMap>(consistency, timeout, vec![claim]).await {
            Ok(values) => {
                let map = values.into_iter().next().flatten().unwrap_or_default();
                // A replica holds a newer term: claim above it (the other claimant is either
                // a predecessor or a node that will stop when it sees it is not the host).
                if map.fence() > term {
                    term = map.fence().saturating_add(1);
                    continue;
                }
                claimed = Some(map);
                break;
            }
            Err(Error::Fenced { fence, .. }) => term = fence.saturating_add(1),
            Err(e) => return Err(e.to_string()),
        }
    }
    let Some(map) = claimed else {
        return Err(format!("newer coordinator terms kept appearing while claiming the state (last tried {term})"));
    };
    let remembered_shards = if settings.remember_entities {
        let set = replicator
            .get::<GSet>(&keys::remembered_shards(type_name), REMEMBERED_SHARDS, timeout)
            .await
            .map_err(|e| format!("cannot read the remembered shards yet: {e}"))?;
        Some(set.map(|s| s.members()).unwrap_or_default())
    } else {
        None
    };
    Ok(TakeOverState { map, term, remembered_shards })
}
