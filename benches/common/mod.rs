//! What the benches share. Each bench compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;

/// Messages handled by every [`CountingEntity`] of a bench and by its baseline's tasks (which
/// bump it too, so both sides wait for the same thing).
pub static HANDLED: AtomicU64 = AtomicU64::new(0);

/// An entity that adds what it is sent and counts what it handled in [`HANDLED`]: the cheapest
/// real handler, so a bench measures the path to it.
#[derive(Default)]
pub struct CountingEntity(pub u64);

/// The message of [`CountingEntity`].
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Add(pub u64);

impl ddshard::Entity for CountingEntity {
    type Message = Add;
    type Reply = u64;
    async fn handle(&mut self, msg: Add, _ctx: &mut ddshard::EntityContext) -> u64 {
        self.0 += msg.0;
        HANDLED.fetch_add(1, Ordering::Relaxed);
        self.0
    }
}

/// Waits until [`HANDLED`] reaches `target`.
pub async fn handled(target: u64) {
    while HANDLED.load(Ordering::Relaxed) < target {
        tokio::task::yield_now().await;
    }
}

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

/// Whether a bench measures `side` (`"ours"` or `"baseline"`): both, or only the one named in
/// `DDSHARD_BENCH_SIDE`, to profile or count the system calls of one side alone. With one side
/// skipped no ratio is printed.
pub fn side(side: &str) -> bool {
    std::env::var("DDSHARD_BENCH_SIDE").map_or(true, |only| only.trim() == side)
}

/// Smoke mode for CI (`DDSHARD_BENCH_QUICK=1 cargo bench -- --test`): every bench path and its
/// asserts run once, with small sizes; the figures it prints mean nothing.
pub fn quick() -> bool {
    std::env::var_os("DDSHARD_BENCH_QUICK").is_some()
}

/// Whether the part `name` of a bench runs: all of them, or only those listed in
/// `DDSHARD_BENCH_ONLY` (comma-separated), to profile one part at a time.
pub fn part(name: &str) -> bool {
    std::env::var("DDSHARD_BENCH_ONLY").map_or(true, |only| only.split(',').any(|p| p.trim() == name))
}

/// `full`, or `small` in smoke mode.
pub fn sized(full: usize, small: usize) -> usize {
    if quick() { small } else { full }
}

/// Timed passes per figure: `full` (`small` in smoke mode), or `DDSHARD_BENCH_PASSES` to run
/// one part long enough to profile it.
pub fn passes(full: usize, small: usize) -> usize {
    std::env::var("DDSHARD_BENCH_PASSES").ok().and_then(|p| p.parse().ok()).unwrap_or_else(|| sized(full, small))
}

/// The median of timed passes (sorts `v`); NaN for none (a side skipped by [`side`]).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Prints a machine-readable `ratio=` line: `value` against its same-run `baseline`.
pub fn print_ratio(label: &str, value: f64, baseline: f64) {
    println!("ratio={label} {:.3} ({value:.0}/s vs baseline {baseline:.0}/s)", value / baseline);
}

/// Prints a `ratio=` line for figures other than rates (bytes, seconds): `value ÷ baseline`.
pub fn print_ratio_of(label: &str, value: f64, baseline: f64) {
    println!("ratio={label} {:.3} ({value:.0} vs baseline {baseline:.0})", value / baseline);
}

/// The bench's tokio runtime: `DDSHARD_BENCH_WORKERS` worker threads (2 by default, this
/// machine's cores), printed first so every figure carries how many threads made it. Run a
/// bench with 1, 2 and more to see how it scales.
pub fn runtime() -> tokio::runtime::Runtime {
    println!("worker threads: {}", workers());
    tokio::runtime::Builder::new_multi_thread().worker_threads(workers()).enable_all().build().unwrap()
}

/// The worker threads [`runtime`] starts (`DDSHARD_BENCH_WORKERS`, 2 by default, at least 1).
pub fn workers() -> usize {
    std::env::var("DDSHARD_BENCH_WORKERS").ok().and_then(|w| w.parse().ok()).unwrap_or(2usize).max(1)
}
