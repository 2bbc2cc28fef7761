//! What the benches share.

use std::future::Future;

use futures::StreamExt;

/// Runs `op(0..total)` with `window` always in flight (a new one starts as each completes):
/// the sliding-window shape of a busy service, rather than batch-then-wait.
pub async fn sliding<F, Fut>(total: usize, window: usize, op: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut next = 0;
    while next < total.min(window) {
        in_flight.push(op(next));
        next += 1;
    }
    while in_flight.next().await.is_some() {
        if next < total {
            in_flight.push(op(next));
            next += 1;
        }
    }
}
