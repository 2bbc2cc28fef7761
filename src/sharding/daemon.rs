//! Sharded daemon process: N workers (indexes 0..N) kept running somewhere in the cluster, one
//! instance each, spread over the nodes that host the type — say one consumer per partition
//! of a stream. Built on sharding: each worker is an entity alone in its shard (shard id =
//! index, so the allocation strategy spreads them and rebalances them as nodes join), with
//! remember-entities, so a worker whose node crashed, left or handed its shard off starts again
//! on its new home without anyone asking, and after a full-cluster restart.
//!
//! A worker is a future built by the caller's function; it runs on a task of its own while its
//! entity lives. When its incarnation must stop (hand-off, leave, shutdown) the future is
//! dropped at its next `.await` (and [`DaemonContext::stopping`] fires first, for cleanup
//! that needs no await). A future that returns or panics is run again after
//! `entity_restart_backoff`: a daemon worker is meant to run for as long as the process does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use super::{
    Entity, EntityContext, PassivationSettings, RememberEntitiesSettings, ShardRegion, ShardingSettings, StartOptions,
};
use crate::error::{Error, Result};
use crate::node::Node;

/// What a worker of a sharded daemon process knows about itself.
#[derive(Debug, Clone)]
pub struct DaemonContext {
    /// This worker's index, 0..count.
    pub index: usize,
    /// How many workers the process has.
    pub count: usize,
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

type WorkerFn = dyn Fn(DaemonContext) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// The entity that hosts one worker.
pub(crate) struct DaemonWorker {
    name: Arc<str>,
    count: usize,
    worker: Arc<WorkerFn>,
    restart_backoff: Duration,
    shutdown: CancellationToken,
    stop: CancellationToken,
}

impl Drop for DaemonWorker {
    fn drop(&mut self) {
        // The incarnation ended (stopped, handed off, aborted): its worker ends with it.
        self.stop.cancel();
    }
}

/// The message that starts (or keeps) a worker; it carries nothing.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct KeepAlive;

impl Entity for DaemonWorker {
    type Message = KeepAlive;
    type Reply = ();

    async fn handle(&mut self, _msg: KeepAlive, _ctx: &mut EntityContext) {}

    async fn started(&mut self, ctx: &EntityContext) {
        let Ok(index) = ctx.entity_id().parse::<usize>() else {
            error!(daemon = %self.name, id = %ctx.entity_id(), "daemon worker id is not an index; not run");
            return;
        };
        let context = DaemonContext {
            index,
            count: self.count,
            name: self.name.clone(),
            epoch: ctx.epoch(),
            stop: self.stop.clone(),
        };
        let (worker, backoff, shutdown) = (self.worker.clone(), self.restart_backoff, self.shutdown.clone());
        tokio::spawn(async move {
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
        });
    }
}

/// A running sharded daemon process (see [`super::Sharding::daemon_process`]).
#[derive(Clone)]
pub struct DaemonProcess {
    name: Arc<str>,
    count: usize,
    region: ShardRegion<DaemonWorker>,
}

impl DaemonProcess {
    /// The process's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many workers it keeps running.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The entity type name its workers run under (`daemon-<name>`): what the admin API and
    /// the metrics call it.
    pub fn type_name(&self) -> &str {
        self.region.type_name()
    }

    /// Where each worker runs now (index → node id), from every region's answer within
    /// `timeout`; a worker that is between homes is missing.
    pub async fn workers(&self, timeout: Duration) -> Result<std::collections::BTreeMap<usize, String>> {
        let stats = self.region.cluster_stats(timeout).await?;
        let mut out = std::collections::BTreeMap::new();
        for (region, shards) in stats.regions {
            for (shard, entities) in shards {
                if let (Ok(index), true) = (shard.parse::<usize>(), entities > 0) {
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
    if count == 0 || count > u32::MAX as usize {
        return Err(Error::BadRequest(format!(
            "daemon process {name}: count must be between 1 and 2^32 - 1, not {count}"
        )));
    }
    let name: Arc<str> = name.into();
    let worker: Arc<WorkerFn> = Arc::new(move |ctx| Box::pin(worker(ctx)));
    let settings = ShardingSettings {
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
    let (restart_backoff, shutdown) = (settings.entity_restart_backoff, node.shutdown_token());
    let factory = {
        let (name, worker) = (name.clone(), worker.clone());
        move |_id: &str| DaemonWorker {
            name: name.clone(),
            count,
            worker: worker.clone(),
            restart_backoff,
            shutdown: shutdown.clone(),
            stop: CancellationToken::new(),
        }
    };
    let region = node.sharding().start_with(&type_name(&name), factory, settings, options).await?;
    // Every node that joins the process makes sure each worker was started once; after that
    // remember-entities keeps them (a start of a running worker changes nothing).
    let starter = region.clone();
    node.spawner().spawn_until_shutdown(async move {
        for index in 0..count {
            let id = index.to_string();
            while let Err(e) = starter.start_entity(&id).await {
                if matches!(e, Error::ShutDown) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    Ok(DaemonProcess { name, count, region })
}
