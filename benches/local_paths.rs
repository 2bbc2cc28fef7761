//! Local message paths at the shapes, each beside a tokio baseline of the same shape
//! measured in the same run (ratio printed):
//! - tell: one sender, 1,000 receiving entities (round robin) vs 1,000 tasks each behind an
//!   unbounded mpsc (a tell never waits either); the time runs until every message is handled;
//! - ask: 64 concurrent askers over 1,000 entities vs 64 askers over 1,000 mpsc tasks answering
//!   through a oneshot;
//! - both again in the user's shape: the entity id built (`format!`) per message, beside the
//!   mpsc baseline and beside a hand-rolled actor map of the same shape (the id built per
//!   message and looked up in a `HashMap<String, mpsc sender>`: what a user would write
//!   instead of a sharding library);
//! - ask latency under 90 % load: asks started on a fixed schedule (open loop, whatever is in
//!   flight) at 90 % of the slowest ask pass just measured, each timed from its start; p50/p99
//!   for the region and for the baseline at the same rate.
//!
//! `cargo bench --bench local_paths` (`DDSHARD_BENCH_QUICK=1`: small sizes, figures meaningless;
//! `DDSHARD_BENCH_ONLY=tell`, `ask` or `ask,ask_latency`: one part, for a profile; the
//! latency part overloads the region while it probes its open-loop rate, so a profile of the
//! closed-loop asks leaves it out).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

mod common;
use common::{Add, CountingEntity};
use ddshard::testkit::TestCluster;
use ddshard::{ShardRegion, ShardingSettings};
use tokio::sync::{mpsc, oneshot};

const ENTITIES: usize = 1_000;
const ASKERS: usize = 64;

type Baseline = Vec<mpsc::UnboundedSender<(Add, Option<oneshot::Sender<u64>>)>>;

/// The baseline: one task per entity behind an unbounded mpsc, doing what `CountingEntity` does.
fn baseline_actors(rt: &tokio::runtime::Runtime) -> Baseline {
    (0..ENTITIES)
        .map(|_| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(Add, Option<oneshot::Sender<u64>>)>();
            rt.spawn(async move {
                let mut c = CountingEntity::default();
                while let Some((m, reply)) = rx.recv().await {
                    c.0 += m.0;
                    common::HANDLED.fetch_add(1, Ordering::Relaxed);
                    if let Some(r) = reply {
                        let _ = r.send(c.0);
                    }
                }
            });
            tx
        })
        .collect()
}

/// Runs `send(i)` for `total` tells and waits until every one is handled; messages per second.
async fn tells(total: usize, send: impl Fn(usize)) -> f64 {
    let target = common::HANDLED.load(Ordering::Relaxed) + total as u64;
    let t = Instant::now();
    for i in 0..total {
        send(i % ENTITIES);
    }
    common::handled(target).await;
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
/// pacing tasks: each wakes on a 1 ms tick (tokio's timer grain) and starts every ask of its
/// share that is due by then, whatever is still in flight (open loop), and polls its own asks.
/// One timer per pacing task, not one per ask: a timer per ask cost more than the asks at
/// these rates and saturated the baseline too. Each ask is timed from its actual start.
/// Returns the sorted latencies and how long the run took (longer than `duration` by more
/// than a little: the rate was beyond what the asks and the harness sustain, and the
/// latencies measure a growing queue).
async fn paced<F, Fut>(rate: f64, duration: Duration, ask: F) -> (Vec<Duration>, Duration)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    use futures::StreamExt;
    let per_task = (rate * duration.as_secs_f64()) as usize / ASKERS;
    let interval = Duration::from_secs_f64(ASKERS as f64 / rate);
    let began = Instant::now();
    let tasks: Vec<_> = (0..ASKERS)
        .map(|a| {
            let ask = ask.clone();
            tokio::spawn(async move {
                let start = tokio::time::Instant::now() + interval.mul_f64(a as f64 / ASKERS as f64);
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut in_flight = futures::stream::FuturesUnordered::new();
                let mut latencies = Vec::with_capacity(per_task);
                let mut sent = 0;
                while sent < per_task || !in_flight.is_empty() {
                    tokio::select! {
                        _ = tick.tick(), if sent < per_task => {
                            let now = tokio::time::Instant::now();
                            while sent < per_task && start + interval * sent as u32 <= now {
                                let fut = ask((a * 17 + sent * 31) % ENTITIES);
                                let started = tokio::time::Instant::now();
                                in_flight.push(async move {
                                    fut.await;
                                    started.elapsed()
                                });
                                sent += 1;
                            }
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
    (v, began.elapsed())
}

/// Whether a paced run kept up with its schedule.
fn kept_up(took: Duration, duration: Duration) -> bool {
    took <= duration + duration / 10 + Duration::from_millis(20)
}

fn pct(v: &[Duration], p: usize) -> Duration {
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn main() {
    let rt = common::runtime();
    let mut cluster = rt.block_on(async {
        let c = TestCluster::start(1).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        c
    });
    let settings = ShardingSettings { number_of_shards: 100, ..ShardingSettings::default() };
    let region: ShardRegion<CountingEntity> = rt.block_on(async {
        let r =
            cluster.node(0).sharding().start("counter", |_: &str| CountingEntity::default(), settings).await.unwrap();
        for i in 0..ENTITIES {
            r.ask(&format!("c{i}"), Add(0)).await.unwrap();
        }
        r
    });
    let ids: Arc<Vec<String>> = Arc::new((0..ENTITIES).map(|i| format!("c{i}")).collect());
    let actors = Arc::new(baseline_actors(&rt));
    // The hand-rolled actor map: the same tasks, found by their id.
    let by_id: Arc<std::collections::HashMap<String, usize>> =
        Arc::new((0..ENTITIES).map(|i| (format!("c{i}"), i)).collect());
    let passes = common::sized(5, 1);

    // Tell, 1,000 receivers.
    if common::part("tell") {
        let tell_total = common::sized(1_000_000, 10_000);
        let (mut raw, mut ours, mut user, mut map) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..passes {
            raw.push(rt.block_on(tells(tell_total, |i| actors[i].send((Add(1), None)).unwrap())));
            ours.push(rt.block_on(tells(tell_total, |i| region.tell(&ids[i], Add(1)).unwrap())));
            user.push(rt.block_on(tells(tell_total, |i| region.tell(&format!("c{i}"), Add(1)).unwrap())));
            map.push(rt.block_on(tells(tell_total, |i| actors[by_id[&format!("c{i}")]].send((Add(1), None)).unwrap())));
        }
        let (raw, ours, user) = (common::median(&mut raw), common::median(&mut ours), common::median(&mut user));
        let map = common::median(&mut map);
        println!("local tell, {ENTITIES} entities: region {ours:.0}/s vs mpsc {raw:.0}/s ({:.2}x)", ours / raw);
        common::print_ratio("local_tell_1000_entities_vs_mpsc", ours, raw);
        println!("local tell, id built per message: region {user:.0}/s vs mpsc {raw:.0}/s ({:.2}x)", user / raw);
        common::print_ratio("local_tell_1000_entities_id_per_message_vs_mpsc", user, raw);
        println!(
            "local tell, id built per message: region {user:.0}/s vs hand-rolled actor map {map:.0}/s ({:.2}x)",
            user / map
        );
        common::print_ratio("local_tell_1000_entities_id_per_message_vs_actor_map", user, map);
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
    // The user's shape: the id built per message, beside the hand-rolled actor map.
    let (mut user, mut map) = (Vec::new(), Vec::new());
    for _ in 0..passes {
        let r = region.clone();
        user.push(rt.block_on(asks(per_asker, move |i| {
            let r = r.clone();
            async move {
                r.ask(&format!("c{i}"), Add(1)).await.unwrap();
            }
        })));
        let (a, by_id) = (actors.clone(), by_id.clone());
        map.push(rt.block_on(asks(per_asker, move |i| {
            let (tx, rx) = oneshot::channel();
            a[by_id[&format!("c{i}")]].send((Add(1), Some(tx))).unwrap();
            async move {
                rx.await.unwrap();
            }
        })));
    }
    // The slowest pass is the capacity the latency pass loads to 90 %: passes vary by up to 2x
    // on this machine, and a rate above what the region sustains measures a queue, not a load.
    let capacity = ours.iter().copied().fold(f64::INFINITY, f64::min);
    let (raw_ask, ask) = (common::median(&mut raw), common::median(&mut ours));
    println!(
        "local ask, {ASKERS} askers over {ENTITIES} entities: region {ask:.0}/s vs mpsc + oneshot {raw_ask:.0}/s ({:.2}x)",
        ask / raw_ask
    );
    common::print_ratio("local_ask_64_askers_vs_mpsc_oneshot", ask, raw_ask);
    let user = common::median(&mut user);
    println!(
        "local ask, id built per message: region {user:.0}/s vs mpsc + oneshot {raw_ask:.0}/s ({:.2}x)",
        user / raw_ask
    );
    common::print_ratio("local_ask_64_askers_id_per_message_vs_mpsc_oneshot", user, raw_ask);
    let map = common::median(&mut map);
    println!(
        "local ask, id built per message: region {user:.0}/s vs hand-rolled actor map + oneshot {map:.0}/s ({:.2}x)",
        user / map
    );
    common::print_ratio("local_ask_64_askers_id_per_message_vs_actor_map", user, map);
    if !common::part("ask_latency") {
        rt.block_on(cluster.shutdown());
        return;
    }

    // Latency at 90 % load. The load is what the region sustains open loop (asks started on a
    // schedule, whatever is in flight): the highest rate, from the slowest closed-loop pass down
    // in steps of 20 %, at which a paced run as long as the measured one keeps up. The baseline runs at the same rate.
    let ask_region = |r: ShardRegion<CountingEntity>, ids: Arc<Vec<String>>| {
        move |i: usize| {
            let (r, ids) = (r.clone(), ids.clone());
            async move {
                r.ask(&ids[i], Add(1)).await.unwrap();
            }
        }
    };
    let mut sustained = capacity;
    let probe = Duration::from_secs(common::sized(5, 1) as u64);
    while sustained > capacity / 64.0 {
        let (_, took) = rt.block_on(paced(sustained, probe, ask_region(region.clone(), ids.clone())));
        if kept_up(took, probe) {
            break;
        }
        sustained *= 0.8;
    }
    let rate = sustained * 0.9;
    let duration = Duration::from_secs(common::sized(5, 1) as u64);
    let a = actors.clone();
    let (raw_lat, raw_took) = rt.block_on(paced(rate, duration, move |i| {
        let (tx, rx) = oneshot::channel();
        a[i].send((Add(1), Some(tx))).unwrap();
        async move {
            rx.await.unwrap();
        }
    }));
    let (lat, took) = rt.block_on(paced(rate, duration, ask_region(region.clone(), ids.clone())));
    println!(
        "open-loop capacity {sustained:.0}/s (closed loop: slowest pass {capacity:.0}/s); kept up at 90 %: region {}, baseline {}",
        kept_up(took, duration),
        kept_up(raw_took, duration)
    );
    println!(
        "local ask at {rate:.0}/s (90 % load), {} asks: region p50 {:?} p99 {:?}; mpsc + oneshot p50 {:?} p99 {:?}",
        lat.len(),
        pct(&lat, 50),
        pct(&lat, 99),
        pct(&raw_lat, 50),
        pct(&raw_lat, 99)
    );
    let routed = region.counters().local_routed;
    println!("messages that took the routed path (not straight into a mailbox): {routed}");
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    for p in [50, 99] {
        let label = format!("local_ask_p{p}_at_90pct_load_vs_mpsc_oneshot_p{p}");
        common::print_ratio_of(&label, micros(pct(&lat, p)), micros(pct(&raw_lat, p)));
    }
    rt.block_on(cluster.shutdown());
}
