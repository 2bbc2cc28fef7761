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

use super::core::{
    CoordinatorAction, CoordinatorCore, CoordinatorInput, CoordinatorSettings, MembersView, Registration, plan_dto,
};
use super::state::CoordinatorState;
use super::take_over::{
    StateWrite, StateWriteAction, StateWriteInput, TAKE_OVER_RETRY, TakeOver, TakeOverAction, TakeOverInput,
    TakeOverState,
};
use crate::clock::wall_ms;
use crate::ddata::{FencedMap, GSet, Replicator};
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
/// How a state write ended.
enum WriteOutcome {
    Acknowledged,
    /// A newer coordinator term claimed the state: this coordinator is stale.
    Fenced {
        term: u64,
        fence: u64,
    },
}

/// Starts the coordinator singleton driver of a type on this node.
pub(crate) fn start_singleton(
    node: &Node,
    type_name: &str,
    settings: ShardingSettings,
    custom: Option<Arc<dyn ShardAllocationStrategy>>,
    registration: Registration,
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
        registration,
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
    registration: Registration,
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
        singleton.handle(SingletonInput::Host(snap.hosts_singleton(role.as_deref())), crate::clock::now(), &mut single);
        loop {
            let mut out = Vec::new();
            for action in single.drain(..) {
                self.perform_singleton(action, &mut running, &snap, &reads_tx, &singleton, &mut out);
            }
            if let Some(r) = running.as_mut() {
                self.perform(r, &mut out, &snap, &done_tx);
            }
            let (now, wall) = (crate::clock::now(), wall_ms());
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
                if let Some(shards) = &state.remembered_shards {
                    info!(type_name = %self.type_name, shards = shards.len(), "allocating remembered shards");
                }
                let cs = CoordinatorSettings::from_sharding(
                    &self.settings,
                    self.registration.clone(),
                    self.shard_ids,
                    self.node.config().transport.max_frame_size,
                );
                let term = state.term;
                let inbound = self.node.transport().subscribe(&keys::coordinator_topic(&self.type_name), 65_536);
                let me = self.node.address().clone();
                let members = Some(MembersView::of(snap));
                let core = state.start_coordinator(
                    me,
                    cs,
                    self.strategy.clone(),
                    members,
                    (crate::clock::now(), wall_ms()),
                    out,
                );
                *running = Some(Running { core, term, inbound, write: None });
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
                Ok(CoordinatorQuery::Allocation) => {
                    wire::encode(&core.allocation_table(type_name, crate::clock::now()))
                }
                Ok(CoordinatorQuery::Explain { shard }) => {
                    wire::encode(&core.explain(type_name, &shard, crate::clock::now()))
                }
                Ok(CoordinatorQuery::RebalancePlan) => wire::encode(&core.rebalance_plan(type_name)),
                Ok(CoordinatorQuery::Rebalance) => {
                    let in_progress = core.in_progress();
                    core.handle(CoordinatorInput::RebalanceNow, crate::clock::now(), wall_ms(), out);
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
                core.handle(input, crate::clock::now(), wall_ms(), out);
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
    /// durable set of shards) as the [`StateWrite`] core decides: retried with backoff until
    /// both succeed, given up when fenced; then reports the outcome.
    fn write_state(
        &self,
        entries: Vec<super::state::StateEntry>,
        term: u64,
        done: mpsc::UnboundedSender<WriteOutcome>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let replicator = self.node.replicator().clone();
        let type_name = self.type_name.clone();
        let metrics = self.metrics.clone();
        let mut out = Vec::new();
        let mut write = StateWrite::start(&self.settings, entries, term, &mut out);
        async move {
            let started = crate::clock::now();
            while let Some(action) = out.pop() {
                match action {
                    StateWriteAction::Write { entries, term, consistency, timeout, remembered } => {
                        // The state entries (counted over the members, with Akka's plus and
                        // min-cap) and the newly remembered shards (a durable key: counted over
                        // the roster, which downing cannot shrink) go at once.
                        let update = super::state::write_update(&type_name, entries, term);
                        let state = replicator.update_many(consistency, timeout, vec![update]);
                        let shards = async {
                            let Some((shards, consistency)) = remembered else { return Ok(()) };
                            let insert = super::state::remembered_shards_update(&type_name, shards);
                            replicator.update_many(consistency, timeout, vec![insert]).await
                        };
                        let (state, shards) = tokio::join!(state, shards);
                        if matches!(state, Err(Error::ShutDown)) || matches!(shards, Err(Error::ShutDown)) {
                            return;
                        }
                        write.handle(StateWriteInput::Written { state, shards }, &mut out);
                    }
                    StateWriteAction::RetryAfter { after, error } => {
                        metrics.state_write_failed();
                        warn!(%type_name, %error, "coordinator state write failed; retrying");
                        tokio::time::sleep(after).await;
                        write.handle(StateWriteInput::Retry, &mut out);
                    }
                    StateWriteAction::Fenced { term, fence } => {
                        let _ = done.send(WriteOutcome::Fenced { term, fence });
                        return;
                    }
                    StateWriteAction::Acknowledged => {
                        metrics.state_written(started);
                        let _ = done.send(WriteOutcome::Acknowledged);
                        return;
                    }
                }
            }
        }
    }
}

/// The take-over read as the [`TakeOver`] core decides: claims the coordinator state under a
/// new term and reads it (majority plus; the replicas store the claim before they answer),
/// then, with remember-entities, reads the durable set of shards. Either failing fails the
/// read (the singleton core retries it).
async fn take_over_read(
    replicator: &Replicator,
    type_name: &str,
    settings: &ShardingSettings,
) -> Result<TakeOverState, String> {
    let key = keys::coordinator_state(type_name);
    let local_fence = replicator.read_local_with::<FencedMap, _, _>(&key, FencedMap::fence).await;
    let local_fence = local_fence.map_err(|e| e.to_string())?.unwrap_or(0);
    let mut out = Vec::new();
    let mut take_over = TakeOver::start(type_name, settings, local_fence, wall_ms(), &mut out);
    while let Some(action) = out.pop() {
        let input = match action {
            TakeOverAction::Claim { term, consistency, timeout } => {
                let claim = super::state::claim_update(type_name, term);
                let read = replicator.update_and_get_many::<FencedMap>(consistency, timeout, vec![claim]).await;
                TakeOverInput::Claimed(read.map(|values| values.into_iter().next().flatten()))
            }
            TakeOverAction::ReadRememberedShards { key, consistency, timeout } => {
                let read = replicator.get::<GSet>(&key, consistency, timeout).await;
                TakeOverInput::RememberedShardsRead(read.map(|set| set.map(|s| s.members()).unwrap_or_default()))
            }
            TakeOverAction::Done(result) => return result,
        };
        take_over.handle(input, &mut out);
    }
    Err("the take-over read ended without an outcome".to_string())
}
