//! Local message paths at the shapes, each beside a tokio baseline of the same shape
//! measured in the same run (ratio printed):
//! - tell: one sender, 1,000 receiving entities (round robin) vs 1,000 tasks each behind an
//!   unbounded mpsc (a tell never waits either); the time runs until every message is handled;
//! - ask: 64 concurrent askers over 1,000 entities vs 64 askers over 1,000 mpsc tasks answering
//!   through a oneshot;
//! - ask latency under 90 % load: asks started on a fixed schedule (open loop, whatever is in
//!   flight) at 90 % of the ask throughput just measured, each timed from its start; p50/p99
//!   for the region and for the baseline at the same rate.
//!
//! `cargo bench --bench local_paths` (`DDSHARD_BENCH_QUICK=1`: small sizes, figures meaningless;
//! `DDSHARD_BENCH_ONLY=tell` or `ask`: one part, for a profile).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod common;
use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

const ENTITIES: usize = 1_000;
const ASKERS: usize = 64;

/// Messages handled, by every entity of both the region and the baseline.
static HANDLED: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
struct Counter(u64);

#[derive(Serialize, Deserialize)]
struct Add(u64);

impl Entity for Counter {
    type Message = Add;
    type Reply = u64;
    async fn handle(&mut self, msg: Add, _ctx: &mut EntityContext) -> u64 {
        self.0 += msg.0;
        HANDLED.fetch_add(1, Ordering::Relaxed);
        self.0
    }
}

type Baseline = Vec<mpsc::UnboundedSender<(Add, Option<oneshot::Sender<u64>>)>>;

/// The baseline: one task per entity behind an unbounded mpsc, doing what `Counter` does.
fn baseline_actors(rt: &tokio::runtime::Runtime) -> Baseline {
    (0..ENTITIES)
        .map(|_| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(Add, Option<oneshot::Sender<u64>>)>();
            rt.spawn(async move {
                let mut c = Counter::default();
                while let Some((m, reply)) = rx.recv().await {
                    c.0 += m.0;
                    HANDLED.fetch_add(1, Ordering::Relaxed);
                    if let Some(r) = reply {
                        let _ = r.send(c.0);
                    }
                }
            });
            tx
        })
        .collect()
}

/// Waits until `HANDLED` reaches `target`.
async fn handled(target: u64) {
    while HANDLED.load(Ordering::Relaxed) < target {
        tokio::task::yield_now().await;
    }
}

/// Runs `send(i)` for `total` tells and waits until every one is handled; messages per second.
async fn tells(total: usize, send: impl Fn(usize)) -> f64 {
    let target = HANDLED.load(Ordering::Relaxed) + total as u64;
    let t = Instant::now();
    for i in 0..total {
        send(i % ENTITIES);
    }
    handled(target).await;
    total as f64 / t.elapsed().as_secs_f64()
}

/// `ASKERS` tasks each asking `per_asker` times in a row; asks per second.
async fn asks<F, Fut>(per_asker: usize, ask: F) -> f64
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let t = Instant::now();
    let tasks: Vec<_> = (0..ASKERS)
        .map(|a| {
            let ask = ask.clone();
            tokio::spawn(async move {
                for k in 0..per_asker {
                    ask((a * 17 + k * 31) % ENTITIES).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (ASKERS * per_asker) as f64 / t.elapsed().as_secs_f64()
}

/// Asks started on a fixed schedule, `rate` per second in all for `duration`, by `ASKERS`
/// pacing tasks (each starts its share on time whatever is still in flight, and polls its own
/// asks, starting late ones at once: tokio's timer has a 1 ms grain, so asks go out in small
/// bursts); each ask is timed from its start. Returns the sorted latencies.
async fn paced<F, Fut>(rate: f64, duration: Duration, ask: F) -> Vec<Duration>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    use futures::StreamExt;
    let per_task = (rate * duration.as_secs_f64()) as usize / ASKERS;
    let interval = Duration::from_secs_f64(ASKERS as f64 / rate);
    let tasks: Vec<_> = (0..ASKERS)
        .map(|a| {
            let ask = ask.clone();
            tokio::spawn(async move {
                let start = tokio::time::Instant::now() + interval.mul_f64(a as f64 / ASKERS as f64);
                let mut in_flight = futures::stream::FuturesUnordered::new();
                let mut latencies = Vec::with_capacity(per_task);
                let mut sent = 0;
                while sent < per_task || !in_flight.is_empty() {
                    let due = start + interval * sent as u32;
                    tokio::select! {
                        _ = tokio::time::sleep_until(due), if sent < per_task => {
                            let fut = ask((a * 17 + sent * 31) % ENTITIES);
                            let started = tokio::time::Instant::now();
                            in_flight.push(async move {
                                fut.await;
                                started.elapsed()
                            });
                            sent += 1;
                        }
                        Some(latency) = in_flight.next() => latencies.push(latency),
                    }
                }
                latencies
            })
        })
        .collect();
    let mut v = Vec::new();
    for t in tasks {
        v.extend(t.await.unwrap());
    }
    v.sort();
    v
}

fn pct(v: &[Duration], p: usize) -> Duration {
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut cluster = rt.block_on(async {
        let c = TestCluster::start(1).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        c
    });
    let settings = ShardingSettings { number_of_shards: 100, ..ShardingSettings::default() };
    let region: ShardRegion<Counter> = rt.block_on(async {
        let r = cluster.node(0).sharding().start("counter", |_: &str| Counter::default(), settings).await.unwrap();
        for i in 0..ENTITIES {
            r.ask(&format!("c{i}"), Add(0)).await.unwrap();
        }
        r
    });
    let ids: Arc<Vec<String>> = Arc::new((0..ENTITIES).map(|i| format!("c{i}")).collect());
    let actors = Arc::new(baseline_actors(&rt));
    let passes = common::sized(5, 1);

    // Tell, 1,000 receivers.
    if common::part("tell") {
        let tell_total = common::sized(1_000_000, 10_000);
        let (mut raw, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..passes {
            raw.push(rt.block_on(tells(tell_total, |i| actors[i].send((Add(1), None)).unwrap())));
            ours.push(rt.block_on(tells(tell_total, |i| region.tell(&ids[i], Add(1)).unwrap())));
        }
        let (raw, ours) = (common::median(&mut raw), common::median(&mut ours));
        println!("local tell, {ENTITIES} entities: region {ours:.0}/s vs mpsc {raw:.0}/s ({:.2}x)", ours / raw);
        common::print_ratio("local_tell_1000_entities_vs_mpsc", ours, raw);
    }
    if !common::part("ask") {
        rt.block_on(cluster.shutdown());
        return;
    }

    // Ask, 64 askers.
    let per_asker = common::sized(20_000, 200);
    let (mut raw, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..passes {
        let a = actors.clone();
        raw.push(rt.block_on(asks(per_asker, move |i| {
            let (tx, rx) = oneshot::channel();
            a[i].send((Add(1), Some(tx))).unwrap();
            async move {
                rx.await.unwrap();
            }
        })));
        let (r, ids) = (region.clone(), ids.clone());
        ours.push(rt.block_on(asks(per_asker, move |i| {
            let (r, ids) = (r.clone(), ids.clone());
            async move {
                r.ask(&ids[i], Add(1)).await.unwrap();
            }
        })));
    }
    let (raw_ask, ask) = (common::median(&mut raw), common::median(&mut ours));
    println!(
        "local ask, {ASKERS} askers over {ENTITIES} entities: region {ask:.0}/s vs mpsc + oneshot {raw_ask:.0}/s ({:.2}x)",
        ask / raw_ask
    );
    common::print_ratio("local_ask_64_askers_vs_mpsc_oneshot", ask, raw_ask);

    // Latency at 90 % of the region's ask throughput, the baseline at the same rate.
    let rate = ask * 0.9;
    let duration = Duration::from_secs(common::sized(5, 1) as u64);
    let a = actors.clone();
    let raw_lat = rt.block_on(paced(rate, duration, move |i| {
        let (tx, rx) = oneshot::channel();
        a[i].send((Add(1), Some(tx))).unwrap();
        async move {
            rx.await.unwrap();
        }
    }));
    let (r, ids2) = (region.clone(), ids.clone());
    let lat = rt.block_on(paced(rate, duration, move |i| {
        let (r, ids) = (r.clone(), ids2.clone());
        async move {
            r.ask(&ids[i], Add(1)).await.unwrap();
        }
    }));
    println!(
        "local ask at {rate:.0}/s (90 % load), {} asks: region p50 {:?} p99 {:?}; mpsc + oneshot p50 {:?} p99 {:?}",
        lat.len(),
        pct(&lat, 50),
        pct(&lat, 99),
        pct(&raw_lat, 50),
        pct(&raw_lat, 99)
    );
    println!("ratio=local_ask_p99_at_90pct_load_micros {:.0}", pct(&lat, 99).as_secs_f64() * 1e6);
    rt.block_on(cluster.shutdown());
}
