//! Sharded daemon process: N workers (indexes 0..N) kept running somewhere in the cluster, one
//! instance each, spread over the nodes that host the type — say one consumer per partition
//! of a stream. Built on sharding: each worker is a durable entity alone in its shard (shard
//! id = index, so the allocation strategy spreads them and rebalances them as nodes join), with
//! remember-entities, so a worker whose node crashed, left or handed its shard off starts again
//! on its new home without anyone asking, and after a full-cluster restart.
//!
//! A worker is a future built by the caller's function; it runs on a task of its own while its
//! entity lives. When its incarnation must stop (hand-off, leave, shutdown) the future is
//! dropped at its next `.await` (and [`DaemonContext::stopping`] fires first, for cleanup
//! that needs no await); a hand-off waits for that (up to the entity stop timeout) before the
//! worker starts on its new home. A future that returns or panics is run again after
//! `entity_restart_backoff`: a daemon worker is meant to run for as long as the process does.
//!
//! **Rescaling** ([`DaemonProcess::set_count`]). The count lives in the cluster, in the
//! durable state of the process's entity `scale` (until the first rescale, the count every
//! node started the process with). A rescale is a new *revision*, driven by that entity:
//! 1. it records the new revision and count (a majority write);
//! 2. it stops every worker of the old revision — each worker records "stopped at the new
//!    revision" in its own durable state, and answers once its future has ended;
//! 3. only then it starts the workers `0..count` of the new revision, each recording the
//!    revision and count it runs with, and marks the rescale done.
//!
//! So no two workers of one index ever run (sharding keeps one entity per index), and no
//! worker of a new revision runs beside one of the old (a worker only starts after every old
//! one acknowledged its end): a worker's [`DaemonContext::count`] is the same for every
//! worker running. A rescale survives the crash of any node, the `scale` entity's included: its
//! next incarnation resumes from the recorded revision. Workers past the new count stop and
//! are forgotten (passivated, so remember-entities no longer restarts them).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{
    Durable, DurableEntity, EntityContext, PassivationSettings, RememberEntitiesSettings, ShardRegion,
    ShardingSettings, StartOptions, StopReason,
};
use crate::error::{Error, Result};
use crate::node::Node;

/// What a worker of a sharded daemon process knows about itself.
#[derive(Debug, Clone)]
pub struct DaemonContext {
    /// This worker's index, 0..count.
    pub index: usize,
    /// How many workers the process has (the same for every running worker).
    pub count: usize,
    /// The process's revision: 0 until the first rescale, one more with each.
    pub revision: u64,
    /// The process's name.
    pub name: Arc<str>,
    /// The allocation epoch of this worker's shard: it grows each time the worker moves to
    /// another node, so it can fence what the worker writes elsewhere (a stale incarnation
    /// holds a smaller epoch).
    pub epoch: u64,
    stop: CancellationToken,
}

impl DaemonContext {
    /// Completes when this incarnation of the worker must stop (its shard moves, its node
    /// leaves or shuts down); the worker's future is dropped right after.
    pub async fn stopping(&self) {
        self.stop.cancelled().await
    }

    /// Whether this incarnation must stop.
    pub fn is_stopping(&self) -> bool {
        self.stop.is_cancelled()
    }
}

mod rescale;

pub use rescale::DaemonScale;
use rescale::{DaemonState, Rescale};

type WorkerFn = dyn Fn(DaemonContext) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// The id of the entity that holds the process's count and drives rescales.
const SCALE_ID: &str = "scale";

/// How long a rescale step waits for one entity's answer before asking again, beyond the
/// time a worker may take to end (the entity stop timeout).
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Messages of the process's entities.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum DaemonMsg {
    /// Starts (or keeps) a worker; carries nothing.
    KeepAlive,
    /// A worker: stop for `revision` (and be forgotten with `forget`), answered once the
    /// worker's future has ended and the stop is recorded.
    Stop { revision: u64, forget: bool },
    /// A worker: run as part of `revision` of `count` workers, once that is recorded (the
    /// worker tells itself [`DaemonMsg::Start`], handled after the write).
    Run { revision: u64, count: u32 },
    /// A worker to itself: its run of `revision` is recorded; start its future.
    Start { revision: u64 },
    /// Entity `scale`: write the rescale of `revision` again and answer with the scale once it
    /// is acknowledged (the driver's first step: a rescale it drives is durable).
    Record { revision: u64 },
    /// Entity `scale`: the process's scale.
    Scale,
    /// Entity `scale`: rescale to `count` workers.
    SetCount { count: u32 },
    /// Entity `scale`: the rescale of `revision` is complete.
    Done { revision: u64 },
}

/// Answers of the process's entities.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum DaemonReply {
    Done,
    Scale(DaemonScale),
    /// Not done, and why (asked again, or a caller's error).
    Refused(String),
}

/// What every entity of one process shares on a node.
struct Process {
    name: Arc<str>,
    initial_count: u32,
    worker: Arc<WorkerFn>,
    restart_backoff: Duration,
    stop_timeout: Duration,
    shutdown: CancellationToken,
    /// The process's region on this node, for the rescale driver's asks.
    region: OnceLock<ShardRegion<Durable<DaemonEntity>>>,
}

/// A running worker future.
struct Running {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// One entity of the process: worker `index`, or the `scale` entity (`index: None`).
pub(crate) struct DaemonEntity {
    process: Arc<Process>,
    index: Option<usize>,
    running: Option<Running>,
    /// Entity `scale`: cancels the rescale driver of this incarnation when it ends.
    driver: CancellationToken,
}

impl Drop for DaemonEntity {
    fn drop(&mut self) {
        // The incarnation ended (stopped, handed off, aborted): its worker and driver end too.
        if let Some(r) = &self.running {
            r.stop.cancel();
        }
        self.driver.cancel();
    }
}

impl DurableEntity for DaemonEntity {
    type Message = DaemonMsg;
    type Reply = DaemonReply;
    type State = DaemonState;

    async fn started(&mut self, state: &DaemonState, ctx: &EntityContext) {
        match self.index {
            None => {
                if let Some(rescale) = state.rescaling {
                    self.drive(rescale);
                }
            }
            Some(index) => self.run_as_recorded(index, state, ctx.epoch()),
        }
    }

    async fn handle(&mut self, state: &mut DaemonState, msg: DaemonMsg, ctx: &mut EntityContext) -> DaemonReply {
        match (self.index, msg) {
            (_, DaemonMsg::KeepAlive) => DaemonReply::Done,
            (Some(index), DaemonMsg::Stop { revision, forget }) => {
                self.on_stop_asked(index, state, revision, forget, ctx).await
            }
            (Some(index), DaemonMsg::Run { revision, count }) => {
                let Some(next) = rescale::run_asked(state, revision, count) else { return DaemonReply::Done };
                // Written again when repeated (a write that failed may sit on this node's
                // replica alone), without bouncing a worker that runs for it already.
                let repeated = next == *state && self.running.is_some();
                if !repeated && !self.end_worker(self.process.stop_timeout).await {
                    return self.not_ended(index);
                }
                *state = next;
                ctx.persist();
                // The future starts on `Start`, which this entity handles after the write.
                if let (false, Some(region)) = (repeated, self.process.region.get()) {
                    let _ = region.tell(&index.to_string(), DaemonMsg::Start { revision });
                }
                DaemonReply::Done
            }
            (Some(index), DaemonMsg::Start { revision }) => {
                if state.revision == revision {
                    self.run_as_recorded(index, state, ctx.epoch());
                }
                DaemonReply::Done
            }
            (None, DaemonMsg::Record { revision }) => {
                if state.rescaling.is_some_and(|r| r.revision == revision) {
                    ctx.persist();
                }
                DaemonReply::Scale(state.scale(self.process.initial_count))
            }
            (None, DaemonMsg::Scale) => DaemonReply::Scale(state.scale(self.process.initial_count)),
            (None, DaemonMsg::SetCount { count }) => self.on_set_count(state, count, ctx),
            (None, DaemonMsg::Done { revision }) => {
                if let Some(next) = rescale::done(state, revision) {
                    *state = next;
                    ctx.persist();
                    info!(daemon = %self.process.name, revision, count = state.count, "daemon process rescaled");
                }
                DaemonReply::Done
            }
            (index, msg) => DaemonReply::Refused(format!("{msg:?} is not for entity {index:?}")),
        }
    }

    async fn on_stop(&mut self, _state: &mut DaemonState, _reason: StopReason, _ctx: &mut EntityContext) {
        // A hand-off waits for the worker's end before its new home starts it (within the
        // hook's own bound, so an overrun is logged here).
        self.end_worker(self.process.stop_timeout * 3 / 4).await;
    }
}

impl DaemonEntity {
    fn new(process: Arc<Process>, id: &str) -> Self {
        // An id that is neither `scale` nor an index stands for a worker past every count.
        let index = if id == SCALE_ID { None } else { Some(id.parse::<usize>().unwrap_or(usize::MAX)) };
        if index == Some(usize::MAX) {
            error!(daemon = %process.name, %id, "daemon worker id is not an index; not run");
        }
        DaemonEntity { process, index, running: None, driver: CancellationToken::new() }
    }

    /// A worker asked to stop for `revision`: ends its future, records the stop, answers.
    async fn on_stop_asked(
        &mut self,
        index: usize,
        state: &mut DaemonState,
        revision: u64,
        forget: bool,
        ctx: &mut EntityContext,
    ) -> DaemonReply {
        let Some(next) = rescale::stop_asked(state, revision, self.process.initial_count) else {
            return DaemonReply::Done;
        };
        if !self.end_worker(self.process.stop_timeout).await {
            return self.not_ended(index);
        }
        *state = next;
        ctx.persist();
        if forget {
            ctx.passivate();
        }
        DaemonReply::Done
    }

    /// Entity `scale`: starts a rescale to `count` unless one runs; answers with the scale.
    fn on_set_count(&mut self, state: &mut DaemonState, count: u32, ctx: &mut EntityContext) -> DaemonReply {
        match rescale::set_count(state, count, self.process.initial_count) {
            Err(why) => return DaemonReply::Refused(why),
            Ok(None) => {}
            Ok(Some(next)) => {
                *state = next;
                ctx.persist();
                let rescale = state.rescaling.expect("a rescale starts");
                info!(daemon = %self.process.name, from = rescale.from, to = count, revision = rescale.revision,
                    "daemon process rescaling");
                self.drive(rescale);
            }
        }
        DaemonReply::Scale(state.scale(self.process.initial_count))
    }

    /// Runs worker `index` when its recorded state says it runs and no future of it does.
    fn run_as_recorded(&mut self, index: usize, state: &DaemonState, epoch: u64) {
        let count = state.count_or(self.process.initial_count);
        if !state.stopped && index < count as usize && self.running.is_none() {
            self.run(index, count, state.revision, epoch);
        }
    }

    /// The answer when worker `index`'s future did not end in time (the driver asks again).
    fn not_ended(&self, index: usize) -> DaemonReply {
        DaemonReply::Refused(format!("worker {index} did not end within {:?}", self.process.stop_timeout))
    }

    /// Runs worker `index` as part of `revision` of `count` workers.
    fn run(&mut self, index: usize, count: u32, revision: u64, epoch: u64) {
        let stop = CancellationToken::new();
        let context = DaemonContext {
            index,
            count: count as usize,
            revision,
            name: self.process.name.clone(),
            epoch,
            stop: stop.clone(),
        };
        let (worker, backoff, shutdown) =
            (self.process.worker.clone(), self.process.restart_backoff, self.process.shutdown.clone());
        let task = tokio::spawn(run_worker(worker, context, backoff, shutdown));
        self.running = Some(Running { stop, task });
    }

    /// Stops the running worker, if any, and waits for its end (up to `bound`); whether it
    /// ended. A future ends at its next `.await`: one that computes without awaiting runs on
    /// past every stop.
    async fn end_worker(&mut self, bound: Duration) -> bool {
        let Some(running) = self.running.take() else { return true };
        running.stop.cancel();
        let mut task = running.task;
        match tokio::time::timeout(bound, &mut task).await {
            Ok(_) => true,
            Err(_) => {
                warn!(daemon = %self.process.name, index = ?self.index, ?bound,
                    "daemon worker did not end when asked; it is dropped at its next await");
                self.running = Some(Running { stop: running.stop, task });
                false
            }
        }
    }

    /// Entity `scale`: drives `rescale` on a task of this incarnation.
    fn drive(&self, rescale: Rescale) {
        let (stop, process) = (self.driver.clone(), self.process.clone());
        tokio::spawn(async move {
            let steps = async {
                // A remembered `scale` entity may restart before its node's region is known.
                let region = loop {
                    match process.region.get() {
                        Some(region) => break region.clone(),
                        None => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                };
                // A step may wait for a worker to end (the stop timeout) and for its write.
                drive(&region, rescale, process.stop_timeout + STEP_TIMEOUT).await;
            };
            tokio::select! {
                () = stop.cancelled() => {}
                () = steps => info!(daemon = %process.name, revision = rescale.revision, "daemon rescale driven"),
            }
        });
    }
}

/// The rescale's steps, each asked again until its entity answers `Done`: the rescale is
/// recorded (the `scale` entity writes it again and answers after the write), every worker of
/// the old revision stopped, the new ones started, the rescale marked done. A step not
/// answered because this node shuts down ends the drive; the next incarnation resumes it.
async fn drive(region: &ShardRegion<Durable<DaemonEntity>>, rescale: Rescale, timeout: Duration) -> Option<()> {
    let Rescale { revision, from, to } = rescale;
    let recorded = until_done(region, SCALE_ID.to_string(), timeout, || DaemonMsg::Record { revision }).await?;
    if !matches!(recorded, DaemonReply::Scale(s) if s.revision == revision && s.rescaling_to.is_some()) {
        return None; // the write of this rescale failed: the entity restarted without it
    }
    let stops = (0..from.max(to))
        .map(|i| until_done(region, i.to_string(), timeout, move || DaemonMsg::Stop { revision, forget: i >= to }));
    futures::future::join_all(stops).await.into_iter().collect::<Option<Vec<_>>>()?;
    let runs =
        (0..to).map(|i| until_done(region, i.to_string(), timeout, move || DaemonMsg::Run { revision, count: to }));
    futures::future::join_all(runs).await.into_iter().collect::<Option<Vec<_>>>()?;
    until_done(region, SCALE_ID.to_string(), timeout, move || DaemonMsg::Done { revision }).await.map(|_| ())
}

/// Asks `id` the message `msg` makes until it answers other than `Refused`; `None` when this
/// node shuts down.
async fn until_done(
    region: &ShardRegion<Durable<DaemonEntity>>,
    id: String,
    timeout: Duration,
    msg: impl Fn() -> DaemonMsg,
) -> Option<DaemonReply> {
    loop {
        match region.ask_with_timeout(&id, msg(), timeout).await {
            Ok(DaemonReply::Refused(why)) => warn!(%id, %why, "daemon rescale step refused; asking again"),
            Ok(reply) => return Some(reply),
            Err(Error::ShutDown) => return None,
            Err(e) => warn!(%id, error = %e, "daemon rescale step not answered; asking again"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs a worker's future until it is stopped, again after the backoff when it returns or
/// panics.
async fn run_worker(worker: Arc<WorkerFn>, context: DaemonContext, backoff: Duration, shutdown: CancellationToken) {
    let stop = context.stop.clone();
    loop {
        // A panic while building the future counts as the worker's panic too.
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker(context.clone())));
        let run = async move {
            match built {
                Ok(future) => std::panic::AssertUnwindSafe(future).catch_unwind().await,
                Err(panic) => Err(panic),
            }
        };
        let index = context.index;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shutdown.cancelled() => return,
            ended = run => match ended {
                Ok(()) => warn!(daemon = %context.name, index, ?backoff, "daemon worker returned; running it again after the backoff"),
                Err(_) => error!(daemon = %context.name, index, ?backoff, "daemon worker panicked; running it again after the backoff"),
            },
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}

/// A running sharded daemon process (see [`super::Sharding::daemon_process`]).
#[derive(Clone)]
pub struct DaemonProcess {
    name: Arc<str>,
    count: usize,
    max_count: usize,
    region: ShardRegion<Durable<DaemonEntity>>,
}

impl DaemonProcess {
    /// The process's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The count this node started the process with (every node must start it with the same;
    /// after a rescale the cluster's count is [`DaemonProcess::scale`]'s).
    pub fn count(&self) -> usize {
        self.count
    }

    /// The entity type name its workers run under (`daemon-<name>`): what the admin API and
    /// the metrics call it.
    pub fn type_name(&self) -> &str {
        self.region.type_name()
    }

    /// The process's scale as the cluster holds it: revision, count, and a rescale in
    /// progress.
    pub async fn scale(&self) -> Result<DaemonScale> {
        match self.region.ask(SCALE_ID, DaemonMsg::Scale).await? {
            DaemonReply::Scale(scale) => Ok(scale),
            other => Err(Error::NotDelivered { entity_id: SCALE_ID.into(), reason: format!("answered {other:?}") }),
        }
    }

    /// Changes the number of workers cluster-wide to `count` and waits (up to `timeout`; zero:
    /// not at all, answering with the rescale started) until the workers of the new revision
    /// run. Every worker of the old revision has ended before
    /// one of the new starts (see the module documentation), so no index ever runs twice and
    /// every running worker sees the same [`DaemonContext::count`].
    ///
    /// A `count` of 0 or over the process's maximum (its `[sharding]` `number_of_shards`, at
    /// least the count it started with) is [`Error::BadRequest`] naming it; so is a rescale
    /// while another runs. A rescale not done within `timeout` is [`Error::AskTimeout`] and
    /// goes on in the background (it survives crashes; [`DaemonProcess::scale`] shows it).
    pub async fn set_count(&self, count: usize, timeout: Duration) -> Result<DaemonScale> {
        if count == 0 || count > self.max_count {
            return Err(Error::BadRequest(format!(
                "daemon process {}: a count of {count} is outside 1..={} (the most workers it may have: its \
                 number_of_shards)",
                self.name, self.max_count
            )));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let started = match self.region.ask(SCALE_ID, DaemonMsg::SetCount { count: count as u32 }).await? {
            DaemonReply::Scale(scale) => scale,
            DaemonReply::Refused(why) => return Err(Error::BadRequest(format!("daemon process {}: {why}", self.name))),
            DaemonReply::Done => return Err(Error::BadRequest("unexpected answer to a rescale".into())),
        };
        if timeout.is_zero() || started.rescaling_to.is_none() {
            return Ok(started);
        }
        loop {
            if let Ok(scale) = self.scale().await
                && scale.revision >= started.revision
                && scale.rescaling_to.is_none()
            {
                return Ok(scale);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::AskTimeout { entity_id: SCALE_ID.into(), timeout });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Where each worker of the current revision runs now (index → node id), from every
    /// region's answer within `timeout`; a worker that is between homes is missing.
    pub async fn workers(&self, timeout: Duration) -> Result<std::collections::BTreeMap<usize, String>> {
        let count = self.scale().await.map_or(self.count, |s| s.count);
        let stats = self.region.cluster_stats(timeout).await?;
        let mut out = std::collections::BTreeMap::new();
        for (region, shards) in stats.regions {
            for (shard, entities) in shards {
                if let (Ok(index), true) = (shard.parse::<usize>(), entities > 0)
                    && index < count
                {
                    out.insert(index, region.node_id.to_string());
                }
            }
        }
        Ok(out)
    }
}

/// The type name of daemon process `name`.
pub(crate) fn type_name(name: &str) -> String {
    format!("daemon-{name}")
}

/// Starts (or joins) daemon process `name` on `node`.
pub(crate) async fn start<F, Fut>(
    node: &Node,
    name: &str,
    count: usize,
    worker: F,
    settings: ShardingSettings,
) -> Result<DaemonProcess>
where
    F: Fn(DaemonContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let max_count = (settings.number_of_shards as usize).max(count);
    if count == 0 || count > u32::MAX as usize {
        return Err(Error::BadRequest(format!(
            "daemon process {name}: count must be between 1 and 2^32 - 1, not {count}"
        )));
    }
    let name: Arc<str> = name.into();
    let worker: Arc<WorkerFn> = Arc::new(move |ctx| Box::pin(worker(ctx)));
    let settings = ShardingSettings {
        // The count every node starts with must agree (it is what registration compares).
        number_of_shards: count as u32,
        remember: RememberEntitiesSettings { enabled: true, ..settings.remember },
        passivation: PassivationSettings { idle_timeout: None, ..settings.passivation },
        ..settings
    };
    let options = StartOptions {
        // One worker per shard: the shard is the index, so allocation spreads the workers.
        shard_id_extractor: Some(Arc::new(|id: &str| id.to_string())),
        ..StartOptions::default()
    };
    let process = Arc::new(Process {
        name: name.clone(),
        initial_count: count as u32,
        worker,
        restart_backoff: settings.entity_restart_backoff,
        stop_timeout: super::shard::entity_stop_timeout(settings.handoff_timeout),
        shutdown: node.shutdown_token(),
        region: OnceLock::new(),
    });
    let factory = {
        let process = process.clone();
        move |id: &str| DaemonEntity::new(process.clone(), id)
    };
    let region = node.sharding().start_durable_with(&type_name(&name), factory, settings, options).await?;
    let _ = process.region.set(region.clone());
    // Every node that joins the process makes sure each worker of the current count was
    // started once; after that remember-entities keeps them (a start of a running worker
    // changes nothing).
    let starter = region.clone();
    node.spawner().spawn_until_shutdown(async move {
        let current = loop {
            match starter.ask(SCALE_ID, DaemonMsg::Scale).await {
                // During a rescale, only workers both revisions have (the others are being
                // stopped and forgotten, or are started by the rescale).
                Ok(DaemonReply::Scale(scale)) => break scale.count.min(scale.rescaling_to.unwrap_or(usize::MAX)),
                Err(Error::ShutDown) => return,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        for index in 0..current {
            if !starter.start_entity_until_running(&index.to_string()).await {
                return;
            }
        }
    });
    let process = DaemonProcess { name, count, max_count, region };
    node.keep(Arc::new(process.clone()));
    Ok(process)
}

/// The daemon process `name` started on `node`, if it was.
pub(crate) fn find(node: &Node, name: &str) -> Option<DaemonProcess> {
    node.kept::<DaemonProcess>().into_iter().find(|p| &*p.name == name).map(|p| (*p).clone())
}
