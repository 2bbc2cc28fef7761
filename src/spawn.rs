//! Every task of a node is spawned through its [`Spawner`]: the task keeps the node's tracing
//! span, and `Node::shutdown` waits for it, so no task outlives the node that started it.

use std::future::Future;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

/// Spawns the tasks of one node. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Spawner {
    tracker: TaskTracker,
    span: Span,
    shutdown: CancellationToken,
}

impl Spawner {
    pub(crate) fn new(span: Span, shutdown: CancellationToken) -> Self {
        Spawner { tracker: TaskTracker::new(), span, shutdown }
    }

    /// Spawns a task that ends by itself once the node shuts down (it watches the token).
    pub(crate) fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task.instrument(self.span.clone()))
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
