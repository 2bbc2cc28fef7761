//! What the benches share. Each bench compiles this module on its own and uses part of it.
#![allow(dead_code)]

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

/// The median of timed passes (sorts `v`).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints a machine-readable `ratio=` line: `value` against its same-run `baseline`.
pub fn print_ratio(label: &str, value: f64, baseline: f64) {
    println!("ratio={label} {:.3} ({value:.0}/s vs baseline {baseline:.0}/s)", value / baseline);
}

/// Prints a `ratio=` line for figures other than rates (bytes, seconds): `value ÷ baseline`.
pub fn print_ratio_of(label: &str, value: f64, baseline: f64) {
    println!("ratio={label} {:.3} ({value:.0} vs baseline {baseline:.0})", value / baseline);
}
