//! Every task of a node is spawned through its [`Spawner`]: the task keeps the node's tracing
//! span, and `Node::shutdown` waits for it, so no task outlives the node that started it.
//!
//! Essential tasks (the drivers of membership, replication, coordinators and regions, the
//! transport's accept and loopback loops) are spawned with [`Spawner::spawn_essential`]: if one
//! panics, the node cannot keep its promises, so it stops as a whole (logged, with the reason
//! kept for [`crate::Node::stop_reason`]) instead of limping on without it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};

use futures::FutureExt;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

/// Spawns the tasks of one node. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Spawner {
    tracker: TaskTracker,
    /// The runtime the node started on: tasks go there even when spawned from a thread
    /// outside it (a `tell` from synchronous code that starts an entity's run).
    runtime: tokio::runtime::Handle,
    span: Span,
    shutdown: CancellationToken,
    stop_reason: Arc<OnceLock<String>>,
}

impl Spawner {
    /// A spawner on the current runtime (panics outside one, like `tokio::spawn`).
    pub(crate) fn new(span: Span, shutdown: CancellationToken) -> Self {
        let runtime = tokio::runtime::Handle::current();
        Spawner { tracker: TaskTracker::new(), runtime, span, shutdown, stop_reason: Arc::default() }
    }

    /// The runtime the node started on (for the rare task the node must not track).
    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Spawns a task the node cannot run without: a panic in it stops the node.
    pub(crate) fn spawn_essential<F>(&self, name: &'static str, task: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let this = self.clone();
        self.spawn(async move {
            if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                tracing::error!(task = name, panic = %message, "an essential task panicked; stopping the node");
                this.stop(format!("essential task {name} panicked: {message}"));
            }
        })
    }

    /// Stops the node by itself (downed, superseded, a panic), keeping the first reason given.
    pub(crate) fn stop(&self, reason: String) {
        let _ = self.stop_reason.set(reason);
        self.shutdown.cancel();
    }

    /// Why the node stopped by itself, if it did.
    pub(crate) fn stop_reason(&self) -> Option<String> {
        self.stop_reason.get().cloned()
    }

    /// Spawns a task that ends by itself once the node shuts down (it watches the token).
    pub(crate) fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn_on(task.instrument(self.span.clone()), &self.runtime)
    }

    /// Spawns a task that is dropped when the node shuts down (a timer, a retrying write).
    pub(crate) fn spawn_until_shutdown<F>(&self, task: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let shutdown = self.shutdown.clone();
        self.spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = task => {}
            }
        })
    }

    /// The node's shutdown token.
    pub(crate) fn shutdown_token(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Cancels the token and waits for every task spawned so far and later.
    pub(crate) async fn shut_down(&self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_an_essential_task_stops_the_node_with_the_reason() {
        let spawner = Spawner::new(Span::none(), CancellationToken::new());
        let bystander = spawner.spawn(spawner.shutdown_token().clone().cancelled_owned());
        spawner.spawn_essential("replicator", async { panic!("state machine broke") }).await.unwrap();
        assert!(spawner.shutdown_token().is_cancelled(), "the node stops");
        assert_eq!(spawner.stop_reason().unwrap(), "essential task replicator panicked: state machine broke");
        bystander.await.unwrap();
    }

    #[tokio::test]
    async fn an_essential_task_that_ends_normally_or_an_ordinary_panic_stops_nothing() {
        let spawner = Spawner::new(Span::none(), CancellationToken::new());
        spawner.spawn_essential("done", async {}).await.unwrap();
        let entity = spawner.spawn(async { panic!("an entity's own bug") });
        assert!(entity.await.unwrap_err().is_panic());
        assert!(!spawner.shutdown_token().is_cancelled());
        assert_eq!(spawner.stop_reason(), None);
    }

    #[tokio::test]
    async fn the_first_stop_reason_is_kept() {
        let spawner = Spawner::new(Span::none(), CancellationToken::new());
        spawner.stop("downed".into());
        spawner.stop("later".into());
        assert_eq!(spawner.stop_reason().unwrap(), "downed");
    }
}
