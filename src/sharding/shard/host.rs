//! The shards a region hosts: one [`ShardCore`] each, with the entity tasks it started. Performs
//! the shard cores' actions (spawn, mailbox, stop, remember I/O) and turns what the tasks report
//! back ([`ShardEvent`]) into inputs of the cores.
//!
//! Each hosted shard sits in a [`ShardCell`] (its core under a lock) that the region task and
//! the region's handle share through the [`ShardDirectory`]: a message from the local handle
//! to an entity that is running here goes straight into its mailbox (the *direct path*, one
//! lock and no task hop), decided by the same core ([`ShardCore::direct_slot`]); everything
//! else takes the *routed* path through the region task. Ordering between the two paths is
//! kept by [`crate::sharding::envelope::RoutedInFlight`].
//!
//! A shard is reported stopped or restarted only once every entity task it started has ended
//! (per-shard task trackers), so no entity outlives its shard's hand-over. Each hosted shard is
//! an *instance* with an id: results of remember I/O for an earlier, failed instance of the same
//! shard are dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::core::{DropReason, ShardAction, ShardCore, ShardInput, StopReason};
use super::entity::{EntityRun, Factory, RunnerShared};
use super::mailbox::{EntityCmd, Mailbox, Pushed, Scheduled};
use super::remember::RememberIo;
use super::state::StateIo;
use super::{RegionParts, ShardEvent, StoreResult, Work, entity_stop_timeout, new_shard_core};
use crate::error::Error;
use crate::metrics::TypeMetrics;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::envelope::{Envelope, Lane, Replier, ReplyTo, RoutedInFlight};
use crate::sharding::ids::{ShardId, ShardIdExtractor, remembered_slot};
use crate::sharding::query::EntityIdPage;
use crate::sharding::region::RegionInput;
use crate::sharding::settings::ShardingSettings;
use crate::sharding::{Entity, EntityContext};
use crate::spawn::Spawner;

mod directory;

use directory::Lookup;
pub(crate) use directory::ShardDirectory;

/// A running entity as its region sees it, attached to its entry in the shard core: its
/// mailbox (which aborts the task running it, if any, when ended).
struct EntityHandle<E: Entity> {
    mailbox: Arc<Mailbox<E>>,
    /// The epoch this incarnation started under (its writes are fenced by it).
    epoch: u64,
}

struct LocalShard<E: Entity> {
    /// Its id, shared with its entities' contexts.
    id: Arc<str>,
    core: ShardCore<Envelope<E>, EntityHandle<E>>,
    epoch: u64,
    instance: u64,
    tasks: TaskTracker,
}

/// One hosted shard, shared by the region task and the direct path of the region's handle.
pub(crate) struct ShardCell<E: Entity> {
    shard: Mutex<LocalShard<E>>,
}

impl<E: Entity> ShardCell<E> {
    /// The lock; a poisoned one is still consistent (a panic under it stops the region task,
    /// an essential task, and with it the node).
    fn lock(&self) -> MutexGuard<'_, LocalShard<E>> {
        self.shard.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts runs of entities: what the region task and the direct path both need to.
struct Launcher<E: Entity> {
    runner: Arc<RunnerShared<E>>,
    spawner: Spawner,
    /// Every entity task of the region: the region waits for them before it ends.
    entity_tasks: TaskTracker,
    state: Option<StateIo>,
    mailbox_capacity: usize,
}

impl<E: Entity> Launcher<E> {
    /// Runs an entity on a new task until its queue is empty (or it ends).
    fn launch(&self, run: RunOf<E>, scheduled: Scheduled<E>) {
        let ctx = EntityContext::new(run.entity_id, run.shard_id, run.epoch, self.state.clone());
        let task = EntityRun { shared: self.runner.clone(), mailbox: run.mailbox, ctx, incarnation: run.incarnation };
        // Detached: a held JoinHandle would keep the finished task's memory.
        drop(self.spawner.spawn(self.entity_tasks.track_future(run.shard_tasks.track_future(task.run(scheduled)))));
    }

    /// Puts a message in a running entity's mailbox, found in `guard` as `lookup` says; `Err`
    /// with the envelope when it is not found there, or its incarnation has ended (its
    /// `Terminated` event is on the way).
    fn push(
        &self,
        entity_id: &str,
        mut guard: MutexGuard<'_, LocalShard<E>>,
        mut env: Envelope<E>,
        lookup: Lookup,
    ) -> Result<(), Envelope<E>> {
        let shard = &mut *guard;
        // One lookup of the entity: the direct path's decision gives its slot.
        let found = match lookup {
            Lookup::Direct(_) => shard.core.direct_slot(entity_id),
            Lookup::Decided => shard.core.slot(entity_id),
        };
        let Some((id, h, incarnation)) = found else { return Err(env) };
        if let Lookup::Direct(stripe) = lookup {
            env.lane = Lane::Direct(stripe);
        }
        let capacity = self.mailbox_capacity;
        match h.mailbox.push(EntityCmd::Msg(env), capacity) {
            Pushed::Queued => Ok(()),
            Pushed::Schedule(scheduled) => {
                let run = RunOf::new((&shard.id, &shard.tasks), id, h, incarnation);
                drop(guard);
                self.launch(run, scheduled);
                Ok(())
            }
            Pushed::Full(env) => {
                drop(guard);
                let counters = &self.runner.counters;
                if counters.dropped_mailbox_full.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(type_name = %self.runner.type_name, %entity_id, capacity, "entity mailbox full; dropping messages");
                }
                if let Some(r) = env.reply {
                    let error = Error::MailboxFull { entity_id: entity_id.to_string(), capacity };
                    self.runner.replier.reply::<E>(r, entity_id, Err(error));
                }
                Ok(())
            }
            Pushed::Ended(env) => Err(env),
        }
    }
}

/// What a new run of an entity needs from its shard.
struct RunOf<E: Entity> {
    entity_id: Arc<str>,
    shard_id: Arc<str>,
    mailbox: Arc<Mailbox<E>>,
    epoch: u64,
    incarnation: u64,
    shard_tasks: TaskTracker,
}

impl<E: Entity> RunOf<E> {
    /// A run of incarnation `incarnation` of entity `id` of the shard with id `shard_id` and
    /// tasks `tasks`, whose handle is `h`.
    fn new((shard_id, tasks): (&Arc<str>, &TaskTracker), id: &Arc<str>, h: &EntityHandle<E>, incarnation: u64) -> Self {
        RunOf {
            entity_id: id.clone(),
            shard_id: shard_id.clone(),
            mailbox: h.mailbox.clone(),
            epoch: h.epoch,
            incarnation,
            shard_tasks: tasks.clone(),
        }
    }
}

/// The shards of one region and their entity tasks.
pub(crate) struct LocalShards<E: Entity> {
    type_name: Arc<str>,
    /// The region's active-entity limit (divided among its shards), if the type has one.
    passivation_limit: Option<usize>,
    settings: ShardingSettings,
    extractor: ShardIdExtractor,
    shards: HashMap<ShardId, Arc<ShardCell<E>>>,
    /// The same shards, for the handle's direct path.
    directory: Arc<ShardDirectory<E>>,
    launcher: Arc<Launcher<E>>,
    next_instance: u64,
    /// Messages sent to an entity task that had already ended, redelivered after its
    /// Terminated event.
    orphans: HashMap<(ShardId, String), Vec<Envelope<E>>>,
    events: mpsc::UnboundedSender<ShardEvent<E>>,
    replier: Replier,
    counters: Arc<RegionCounterCells>,
    remember: RememberIo,
    /// Durable entities: the region's state store.
    state: Option<StateIo>,
    spawner: Spawner,
    /// When each shard's hand-off started here, for its duration.
    handoff_started: HashMap<ShardId, crate::clock::Instant>,
    /// Hand-off durations (feature `metrics`).
    metrics: Arc<TypeMetrics>,
    /// Warnings about shards at their remembered limit: at most one a minute per shard.
    remembered_limit_log: crate::log_limit::LogLimiter<ShardId>,
    /// Permits for shard loads running at once (`max_concurrent_shard_loads`).
    loads: Arc<tokio::sync::Semaphore>,
}

/// Most entity ids in one page of [`LocalShards::entity_page`].
pub(crate) const MAX_ENTITY_PAGE: usize = 10_000;

impl<E: Entity> LocalShards<E> {
    /// The shards of one type on this node, with their remember writer and, for `durable`
    /// entities, their state writer.
    pub(crate) fn new(
        parts: &RegionParts,
        factory: Factory<E>,
        extractor: ShardIdExtractor,
        events: mpsc::UnboundedSender<ShardEvent<E>>,
        replier: Replier,
        routed: Arc<RoutedInFlight>,
        durable: bool,
    ) -> Self {
        let remember = RememberIo::new(parts);
        let state = durable.then(|| StateIo::new(parts));
        let RegionParts { type_name, settings, counters, metrics, spawner, .. } = parts.clone();
        let runner = Arc::new(RunnerShared {
            factory,
            events: events.clone(),
            replier: replier.clone(),
            type_name: type_name.clone(),
            counters: counters.clone(),
            linger: settings.entity_linger,
            stop_timeout: entity_stop_timeout(settings.handoff_timeout),
            stop_log: std::sync::Mutex::new(crate::log_limit::LogLimiter::new(Duration::from_secs(10))),
            routed,
            metrics: metrics.clone(),
        });
        let launcher = Arc::new(Launcher {
            runner,
            spawner: spawner.clone(),
            entity_tasks: TaskTracker::new(),
            state: state.clone(),
            mailbox_capacity: settings.entity_mailbox_capacity,
        });
        let directory = Arc::new(ShardDirectory::new(launcher.clone()));
        let load_permits = Arc::new(tokio::sync::Semaphore::new(settings.max_concurrent_shard_loads));
        LocalShards {
            type_name,
            passivation_limit: settings.passivation_limit(),
            settings,
            extractor,
            shards: HashMap::new(),
            directory,
            launcher,
            next_instance: 1,
            orphans: HashMap::new(),
            events,
            replier,
            counters,
            remember,
            state,
            spawner,
            handoff_started: HashMap::new(),
            metrics,
            remembered_limit_log: crate::log_limit::LogLimiter::new(Duration::from_secs(60)),
            loads: load_permits,
        }
    }

    /// The hosted shards for the region handle's direct path.
    pub(crate) fn directory(&self) -> &Arc<ShardDirectory<E>> {
        &self.directory
    }

    pub(crate) fn ids(&self) -> Vec<ShardId> {
        self.shards.keys().cloned().collect()
    }

    /// Shard → live entity ids (sorted).
    pub(crate) fn state(&self) -> std::collections::BTreeMap<ShardId, Vec<String>> {
        self.shards
            .iter()
            .map(|(s, cell)| {
                let mut ids: Vec<String> = cell.lock().core.entity_ids().map(String::from).collect();
                ids.sort();
                (s.clone(), ids)
            })
            .collect()
    }

    /// Up to `limit` (1 ..= [`MAX_ENTITY_PAGE`]) running entities after `after`, ordered by
    /// (shard, entity id). Sorts only the shards the page reads, not every entity.
    pub(crate) fn entity_page(&self, after: Option<&(ShardId, String)>, limit: usize) -> EntityIdPage {
        let limit = limit.clamp(1, MAX_ENTITY_PAGE);
        let mut shards: Vec<&ShardId> =
            self.shards.keys().filter(|s| after.is_none_or(|(from, _)| s.as_str() >= from.as_str())).collect();
        shards.sort_unstable();
        let mut entities: Vec<(ShardId, String)> = Vec::new();
        for shard in shards {
            let mut ids: Vec<String> = {
                let cell = self.shards[shard].lock();
                cell.core
                    .entity_ids()
                    .filter(|id| !matches!(after, Some((s, last)) if s == shard && *id <= last.as_str()))
                    .map(String::from)
                    .collect()
            };
            ids.sort_unstable();
            for id in ids {
                if entities.len() == limit {
                    let next = entities.last().cloned();
                    return EntityIdPage { entities, next };
                }
                entities.push((shard.clone(), id));
            }
        }
        EntityIdPage { entities, next: None }
    }

    /// Remember-entities: the ids remembered over all hosted shards.
    pub(crate) fn remembered(&self) -> usize {
        self.shards.values().map(|cell| cell.lock().core.remembered_count()).sum()
    }

    /// Shard → live entity count.
    pub(crate) fn stats(&self) -> std::collections::BTreeMap<ShardId, usize> {
        self.shards.iter().map(|(s, cell)| (s.clone(), cell.lock().core.entity_count())).collect()
    }

    /// Each shard's share of the region's active-entity limit with `shards` hosted (at least
    /// one entity each).
    fn passivation_share(&self, shards: usize) -> Option<usize> {
        self.passivation_limit.map(|limit| (limit / shards.max(1)).max(1))
    }

    /// Tells every hosted shard its share of the active-entity limit (after a shard came or
    /// went, or the limit changed).
    fn share_passivation_limit(&self, work: &mut VecDeque<Work<E>>) {
        let Some(share) = self.passivation_share(self.shards.len()) else { return };
        for shard in self.shards.keys() {
            work.push_back(Work::Shard(shard.clone(), ShardInput::PassivationLimit(share)));
        }
    }

    /// Changes the region's active-entity limit at run time; false when the type has none (the
    /// `idle` strategy's safety net is not one to tune at run time).
    pub(crate) fn set_passivation_limit(&mut self, limit: usize, work: &mut VecDeque<Work<E>>) -> bool {
        if self.passivation_limit.is_none() || !self.settings.has_active_entity_limit() {
            return false;
        }
        self.passivation_limit = Some(limit.max(1));
        self.share_passivation_limit(work);
        true
    }

    /// Starts hosting `shard` (or only updates its epoch if hosted).
    pub(crate) fn start(&mut self, shard: ShardId, epoch: u64, work: &mut VecDeque<Work<E>>) {
        if let Some(existing) = self.shards.get(&shard) {
            existing.lock().epoch = epoch;
            return;
        }
        let s = &self.settings;
        let instance = self.next_instance;
        self.next_instance += 1;
        let policy = s.passivation_policy(self.passivation_share(self.shards.len() + 1));
        let core = new_shard_core(s, self.state.is_some(), policy);
        let cell = Arc::new(ShardCell {
            shard: Mutex::new(LocalShard {
                id: Arc::from(shard.as_str()),
                core,
                epoch,
                instance,
                tasks: TaskTracker::new(),
            }),
        });
        self.shards.insert(shard.clone(), cell.clone());
        self.directory.insert(shard.clone(), cell);
        self.share_passivation_limit(work);
        if s.remember.enabled || self.state.is_some() {
            self.load(shard, instance, epoch);
        }
    }

    /// Loads what a shard instance needs before it serves: with durable entities, it claims
    /// and loads their states (so a stale instance elsewhere is fenced off first); with
    /// remember-entities, it reads the remembered ids and recovers them.
    fn load(&self, shard: ShardId, instance: u64, epoch: u64) {
        let (state, events, type_name) = (self.state.clone(), self.events.clone(), self.type_name.clone());
        let remember = self.settings.remember.enabled.then(|| self.remember.clone());
        let loads = self.loads.clone();
        self.spawner.spawn_until_shutdown(async move {
            // Its turn among the region's loads; held until the reads are done (not while
            // recovery paces the starts). The semaphore is never closed.
            let permit = loads.acquire_owned().await.ok();
            if let Some(state) = state {
                match state.claim_and_load(&shard, epoch).await {
                    Ok(states) => debug!(%type_name, %shard, epoch, states, "entity states claimed and loaded"),
                    Err(Error::Fenced { fence, .. }) => {
                        let _ = events.send(ShardEvent::Fenced { shard, epoch, fence });
                        return;
                    }
                    Err(e) => {
                        warn!(%type_name, %shard, error = %e, "claiming and loading entity states failed");
                        let _ = events.send(ShardEvent::Store { shard, instance, input: StoreResult::Failed });
                        return;
                    }
                }
            }
            match remember {
                Some(remember) => remember.load(shard, instance, events, permit).await,
                None => {
                    drop(permit);
                    let input = StoreResult::Loaded(Default::default());
                    let _ = events.send(ShardEvent::Store { shard, instance, input });
                }
            }
        });
    }

    /// Feeds a shard core; a message for a shard not hosted (handed off) fails.
    pub(crate) fn handle(
        &mut self,
        shard: ShardId,
        input: ShardInput<Envelope<E>>,
        now: crate::clock::Instant,
        work: &mut VecDeque<Work<E>>,
    ) {
        let Some(cell) = self.shards.get(&shard).cloned() else {
            match input {
                ShardInput::Deliver { entity_id, msg } => {
                    self.replier.fail(msg, &entity_id, "shard is not hosted here")
                }
                // A failed shard waiting out its backoff runs nothing: it is stopped already.
                ShardInput::HandOff => work.push_back(Work::Region(RegionInput::LocalShardStopped(shard))),
                _ => {}
            }
            return;
        };
        if matches!(input, ShardInput::HandOff) {
            // Timed from the first HandOff (a repeated one does not restart the clock).
            self.handoff_started.entry(shard.clone()).or_insert(now);
        }
        let mut out = Vec::new();
        cell.lock().core.handle(input, now, &mut out);
        for a in out {
            self.perform(&shard, a, work);
        }
    }

    /// Turns a task's report into work; `None` when it concerns a shard instance that is gone.
    pub(crate) fn on_event(&mut self, ev: ShardEvent<E>, shutting_down: bool, work: &mut VecDeque<Work<E>>) {
        match ev {
            ShardEvent::Passivate { shard, entity_id, incarnation } => {
                work.push_back(Work::Shard(shard, ShardInput::Passivate { entity_id, incarnation }));
            }
            ShardEvent::ShardTasksEnded { shard } => {
                debug!(type_name = %self.type_name, %shard, "shard stopped (its aborted entities have ended)");
                work.push_back(Work::Region(RegionInput::LocalShardStopped(shard)));
            }
            ShardEvent::Terminated { shard, entity_id, incarnation, mut leftovers } => {
                // What the incarnation did not take, then what was sent to it after it had
                // ended: the core puts both ahead of what it held for the entity meanwhile. It
                // drops its handle on the incarnation when it takes this input.
                leftovers.extend(self.orphans.remove(&(shard.clone(), entity_id.clone())).unwrap_or_default());
                let input = ShardInput::Terminated { entity_id, incarnation, leftovers };
                work.push_back(Work::Shard(shard, input));
            }
            ShardEvent::Store { shard, instance, input } => {
                if !self.is_instance(&shard, instance) {
                    return;
                }
                let input = match input {
                    StoreResult::Loaded(ids) => ShardInput::Loaded(ids),
                    StoreResult::WriteDone { refused } => ShardInput::WriteDone { refused },
                    StoreResult::Failed => ShardInput::StoreFailed,
                    StoreResult::MovedAway(entity_id) => ShardInput::MovedAway { entity_id },
                };
                work.push_back(Work::Shard(shard, input));
            }
            ShardEvent::Recover { shard, instance, entity_ids } => {
                if self.is_instance(&shard, instance) {
                    self.recover(&shard, instance, entity_ids, work);
                }
            }
            ShardEvent::Fenced { shard, epoch, fence } => {
                if self.shards.get(&shard).is_some_and(|s| s.lock().epoch == epoch) {
                    warn!(type_name = %self.type_name, %shard, epoch, fence, "a newer allocation claimed the shard's state; stopping it here");
                    work.push_back(Work::Region(RegionInput::LocalShardFenced { shard, epoch }));
                }
            }
            ShardEvent::RestartShard { shard, epoch } => {
                if !self.shards.contains_key(&shard) && !shutting_down {
                    info!(type_name = %self.type_name, %shard, "failure backoff over; restarting the shard if still hosted here");
                    work.push_back(Work::Region(RegionInput::RestartFailedShard { shard, epoch }));
                }
            }
        }
    }

    fn is_instance(&self, shard: &ShardId, instance: u64) -> bool {
        self.shards.get(shard).is_some_and(|s| s.lock().instance == instance)
    }

    /// Starts remembered entities: those still in this shard directly, the others (the
    /// extractor changed) through the region, forgetting them here once the new shard has them.
    fn recover(&mut self, shard: &ShardId, instance: u64, entity_ids: Vec<String>, work: &mut VecDeque<Work<E>>) {
        for id in entity_ids {
            let target = (self.extractor)(&id);
            if target == *shard {
                let input = ShardInput::Deliver { entity_id: id, msg: Envelope::start_only() };
                work.push_back(Work::Shard(shard.clone(), input));
                continue;
            }
            let (tx, rx) = oneshot::channel();
            let env = Envelope::new(None, Some(ReplyTo::Started(tx)));
            work.push_back(Work::Region(RegionInput::Route { shard: target, entity_id: id.clone(), msg: env }));
            let (events, origin) = (self.events.clone(), shard.clone());
            self.spawner.spawn_until_shutdown(async move {
                if let Ok(Ok(())) = rx.await {
                    let input = StoreResult::MovedAway(id);
                    let _ = events.send(ShardEvent::Store { shard: origin, instance, input });
                }
            });
        }
    }

    fn fail_orphans(&mut self, shard: &ShardId) {
        let keys: Vec<(ShardId, String)> = self.orphans.keys().filter(|(s, _)| s == shard).cloned().collect();
        for k in keys {
            for env in self.orphans.remove(&k).unwrap_or_default() {
                self.replier.fail(env, &k.1, "its shard stopped");
            }
        }
    }

    fn spawn_entity(&mut self, shard_id: &ShardId, entity_id: String, incarnation: u64) {
        let Some(cell) = self.shards.get(shard_id) else { return };
        let mailbox = Arc::new(Mailbox::new());
        let first = mailbox.schedule_new().expect("a new mailbox");
        let mut shard = cell.lock();
        let handle = EntityHandle { mailbox, epoch: shard.epoch };
        if shard.core.attach(&entity_id, incarnation, handle) {
            let (id, h, _) = shard.core.slot(&entity_id).expect("just attached");
            let run = RunOf::new((&shard.id, &shard.tasks), id, h, incarnation);
            drop(shard);
            self.launcher.launch(run, first);
        }
    }

    fn perform(
        &mut self,
        shard_id: &ShardId,
        action: ShardAction<Envelope<E>, EntityHandle<E>>,
        work: &mut VecDeque<Work<E>>,
    ) {
        match action {
            ShardAction::Start { entity_id, incarnation } => {
                self.counters.entity_starts.fetch_add(1, Ordering::Relaxed);
                self.spawn_entity(shard_id, entity_id, incarnation)
            }
            ShardAction::Send { entity_id, msg } => self.send_to_entity(shard_id, entity_id, msg),
            ShardAction::Stop { entity_id, reason } => self.stop_entity(shard_id, entity_id, reason),
            ShardAction::ForceStop { entity_id, slot } => {
                if let Some(h) = slot {
                    warn!(type_name = %self.type_name, %entity_id, "entity did not stop within the hand-off timeout; aborted");
                    self.end_entity(&entity_id, h, "the entity was aborted");
                }
            }
            ShardAction::Drop { entity_id, msg, reason } => self.drop_message(shard_id, entity_id, msg, reason),
            ShardAction::Recover { entity_ids } => {
                // With a recovery batch set, the load task feeds them in batches instead.
                if let Some(s) = self.shards.get(shard_id)
                    && self.settings.remember.recovery_batch == 0
                {
                    let instance = s.lock().instance;
                    self.recover(shard_id, instance, entity_ids, work);
                }
            }
            ShardAction::WriteRemembered { adds, removes } => {
                if let Some(s) = self.shards.get(shard_id) {
                    let instance = s.lock().instance;
                    self.remember.write(shard_id.clone(), instance, adds, removes, self.events.clone());
                }
            }
            ShardAction::Failed => self.on_shard_failed(shard_id, work),
            ShardAction::Stopped => self.on_shard_stopped(shard_id, work),
        }
    }

    /// Pushes a message into a running entity's mailbox.
    fn send_to_entity(&mut self, shard_id: &ShardId, entity_id: String, msg: Envelope<E>) {
        let Some(cell) = self.shards.get(shard_id) else {
            self.replier.fail(msg, &entity_id, "entity is not running");
            return;
        };
        let shard = cell.lock();
        if shard.core.slot(&entity_id).is_none() {
            drop(shard);
            self.replier.fail(msg, &entity_id, "entity is not running");
            return;
        }
        if let Err(env) = self.launcher.push(&entity_id, shard, msg, Lookup::Decided) {
            // The incarnation already ended; its Terminated event is on the way. The
            // message goes to the next incarnation after it (not back into this loop,
            // which would spin until the event is read).
            self.orphans.entry((shard_id.clone(), entity_id)).or_default().push(env);
        }
    }

    /// Queues a stop behind the entity's messages (it runs its stop hook, then ends).
    fn stop_entity(&mut self, shard_id: &ShardId, entity_id: String, reason: StopReason) {
        let counter = match reason {
            StopReason::Passivated => &self.counters.passivations_explicit,
            StopReason::Idle => &self.counters.passivations_idle,
            StopReason::Limit => &self.counters.passivations_limit,
            StopReason::HandOff => &self.counters.handoff_stops,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let Some(cell) = self.shards.get(shard_id) else { return };
        let shard = cell.lock();
        let Some((id, h, incarnation)) = shard.core.slot(&entity_id) else { return };
        if let Pushed::Schedule(scheduled) = h.mailbox.push(EntityCmd::Stop(reason), usize::MAX) {
            let run = RunOf::new((&shard.id, &shard.tasks), id, h, incarnation);
            drop(shard);
            self.launcher.launch(run, scheduled);
        }
    }

    /// Fails a message the shard could not take, with the error its reason names.
    fn drop_message(&mut self, shard_id: &ShardId, entity_id: String, msg: Envelope<E>, reason: DropReason) {
        let why = match reason {
            DropReason::HandOff => {
                self.counters.dropped_handoff.fetch_add(1, Ordering::Relaxed);
                "dropped during shard hand-off"
            }
            DropReason::ShardFailed => "its shard failed and restarts after shard_failure_backoff",
            DropReason::BufferFull => {
                self.counters.dropped_buffer_full.fetch_add(1, Ordering::Relaxed);
                let (type_name, buffer_size) = (self.type_name.to_string(), self.settings.buffer_size);
                return self.replier.fail_with(msg, &entity_id, || Error::BufferFull { type_name, buffer_size });
            }
            DropReason::RememberedLimit => {
                self.counters.dropped_remembered_limit.fetch_add(1, Ordering::Relaxed);
                let limit = self.settings.remember.max_per_shard.unwrap_or(usize::MAX);
                if let Some(held_back) = self.remembered_limit_log.allow(shard_id, std::time::Instant::now()) {
                    warn!(type_name = %self.type_name, shard = %shard_id, limit, held_back,
                        "shard remembers its limit of entities: new ones are refused (RememberedLimit)");
                }
                let shard = shard_id.clone();
                return self.replier.fail_with(msg, &entity_id, || Error::RememberedLimit {
                    entity_id: entity_id.clone(),
                    shard,
                    limit,
                });
            }
            DropReason::SlotFull => {
                // Counted by the remember writer, once per refused id.
                let (slot, budget) = (remembered_slot(&entity_id, self.remember.slots), self.remember.slot_budget);
                let shard = shard_id.clone();
                return self.replier.fail_with(msg, &entity_id, || Error::SlotFull {
                    entity_id: entity_id.clone(),
                    shard,
                    slot,
                    budget,
                });
            }
        };
        self.replier.fail(msg, &entity_id, why);
    }

    /// The shard failed (its store did): its entities end and it restarts after the backoff,
    /// once their tasks have ended.
    fn on_shard_failed(&mut self, shard_id: &ShardId, work: &mut VecDeque<Work<E>>) {
        self.fail_orphans(shard_id);
        let Some(s) = self.remove_shard(shard_id, work) else { return };
        let s = self.abort_entities(&s);
        self.counters.shard_failures.fetch_add(1, Ordering::Relaxed);
        let backoff = super::batch::shard_restart_after(self.settings.shard_failure_backoff, shard_id, s.epoch);
        warn!(type_name = %self.type_name, shard = %shard_id, ?backoff, "shard failed; restarting after backoff");
        let (events, shard, epoch, tasks) = (self.events.clone(), shard_id.clone(), s.epoch, s.tasks);
        self.spawner.spawn_until_shutdown(async move {
            tasks.wait().await;
            tokio::time::sleep(backoff).await;
            let _ = events.send(ShardEvent::RestartShard { shard, epoch });
        });
    }

    /// The shard handed off: out of the directory, reported stopped to the region once its
    /// entity tasks have ended.
    fn on_shard_stopped(&mut self, shard_id: &ShardId, work: &mut VecDeque<Work<E>>) {
        self.counters.handoffs_completed.fetch_add(1, Ordering::Relaxed);
        if let Some(started) = self.handoff_started.remove(shard_id) {
            self.metrics.handoff_done(started);
        }
        self.fail_orphans(shard_id);
        let Some(s) = self.remove_shard(shard_id, work) else {
            work.push_back(Work::Region(RegionInput::LocalShardStopped(shard_id.clone())));
            return;
        };
        let s = self.abort_entities(&s);
        if s.tasks.is_empty() {
            debug!(type_name = %self.type_name, shard = %shard_id, "shard stopped");
            work.push_back(Work::Region(RegionInput::LocalShardStopped(shard_id.clone())));
        } else {
            // Aborted entities end at their next await; report the shard stopped (so it
            // may start elsewhere) only then.
            let (events, shard, tasks) = (self.events.clone(), shard_id.clone(), s.tasks);
            self.spawner.spawn_until_shutdown(async move {
                tasks.wait().await;
                let _ = events.send(ShardEvent::ShardTasksEnded { shard });
            });
        }
    }

    /// Ends an entity at once: a parked entity is dropped here, a running task is aborted (it
    /// drops its entity at its next await), and the messages it had not taken fail.
    fn end_entity(&self, entity_id: &str, h: EntityHandle<E>, why: &str) {
        for env in h.mailbox.end() {
            self.replier.fail(env, entity_id, why);
        }
    }

    /// Stops hosting `shard_id`: out of the directory first, so the direct path sends nothing
    /// more to its entities.
    fn remove_shard(&mut self, shard_id: &ShardId, work: &mut VecDeque<Work<E>>) -> Option<Arc<ShardCell<E>>> {
        self.directory.remove(shard_id);
        let removed = self.shards.remove(shard_id);
        if removed.is_some() {
            self.share_passivation_limit(work);
        }
        removed
    }

    /// Ends every entity of a shard and closes its tracker (so waiting for it can end); returns
    /// what the shard's end still needs (its epoch and tracker).
    fn abort_entities(&self, cell: &ShardCell<E>) -> EndedShard {
        let (slots, ended) = {
            let mut shard = cell.lock();
            shard.tasks.close();
            (shard.core.take_slots(), EndedShard { epoch: shard.epoch, tasks: shard.tasks.clone() })
        };
        for (id, h) in slots {
            self.end_entity(&id, h, "its shard stopped");
        }
        ended
    }

    /// Aborts every entity (the region is ending); then waits, up to `timeout`, for their tasks.
    pub(crate) async fn stop_all(&mut self, timeout: Duration) {
        self.directory.clear();
        for (_, cell) in std::mem::take(&mut self.shards) {
            self.abort_entities(&cell);
        }
        // Nobody hears that this region stopped before its entities are gone. `abort` takes
        // effect at an entity's next await; one that never yields cannot be stopped.
        let tasks = &self.launcher.entity_tasks;
        tasks.close();
        if tokio::time::timeout(timeout, tasks.wait()).await.is_err() {
            tracing::error!(
                type_name = %self.type_name,
                still_running = tasks.len(),
                "entity tasks did not end within the hand-off timeout after being aborted (a handler that never yields?)"
            );
        }
    }
}

/// What is left of a shard once it stopped hosting: what its restart or its stop report waits on.
struct EndedShard {
    epoch: u64,
    tasks: TaskTracker,
}
