//! Reliable delivery (`ShardRegion::producer`) beside the same run's plain `tell` and `ask`, on
//! 3 nodes on loopback (entities spread over all three, the producer on the first):
//! - **1 entity**: 50 in flight (the producer's default window) — confirmed messages vs asks
//!   with 50 in flight and tells until handled;
//! - **10,000 entities**: 1,024 in flight, round robin — confirmed messages vs asks with 1,024
//!   in flight and tells until handled.
//!
//! Each shape runs twice: with the producer's queue in memory, and with its durable queue
//! (every message written to a majority before it is sent).
//!
//! Each confirmed message is timed from `send` to its confirmation (each ask from call to
//! answer); the p99 of both is printed. Entity ids are built per message, as users do.
//!
//! `cargo bench --bench reliable` (`DDSHARD_BENCH_QUICK=1`: small sizes, figures meaningless;
//! `DDSHARD_BENCH_ONLY=one` or `fan_out`: one shape).

mod common;

use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{Add, CountingEntity};
use ddshard::sharding::{Producer, ProducerSettings};
use ddshard::testkit::TestCluster;
use ddshard::{ShardRegion, ShardingSettings};

/// Rate and p99 latency of one pass.
struct Pass {
    rate: f64,
    p99: Duration,
}

fn p99(latencies: &Mutex<Vec<Duration>>) -> Duration {
    let mut l = latencies.lock().unwrap();
    l.sort();
    l.get(l.len() * 99 / 100).copied().unwrap_or_default()
}

async fn asks(region: &ShardRegion<CountingEntity>, entities: usize, total: usize, window: usize) -> Pass {
    let latencies = Mutex::new(Vec::with_capacity(total));
    let t = Instant::now();
    common::sliding(total, window, |i| {
        let latencies = &latencies;
        async move {
            let started = Instant::now();
            region.ask(&format!("c{}", i % entities), Add(1)).await.unwrap();
            latencies.lock().unwrap().push(started.elapsed());
        }
    })
    .await;
    Pass { rate: total as f64 / t.elapsed().as_secs_f64(), p99: p99(&latencies) }
}

async fn tells(region: &ShardRegion<CountingEntity>, entities: usize, total: usize) -> f64 {
    let target = common::HANDLED.load(Ordering::Relaxed) + total as u64;
    let t = Instant::now();
    let mut i = 0;
    while i < total {
        match region.tell(&format!("c{}", i % entities), Add(1)) {
            Ok(()) => i += 1,
            Err(ddshard::Error::SendQueueFull { .. } | ddshard::Error::BufferFull { .. }) => {
                tokio::task::yield_now().await
            }
            Err(e) => panic!("{e}"),
        }
    }
    // A tell lost on the way (a full send queue on the region task's path drops it) would
    // leave the count short forever: bounded, and said.
    if tokio::time::timeout(Duration::from_secs(120), common::handled(target)).await.is_err() {
        let short = target - common::HANDLED.load(Ordering::Relaxed);
        println!("tell: {short} of {total} messages not handled within 120 s ({:?})", region.counters());
    }
    total as f64 / t.elapsed().as_secs_f64()
}

async fn confirmed(producer: &Producer<CountingEntity>, entities: usize, total: usize, window: usize) -> Pass {
    let latencies = Mutex::new(Vec::with_capacity(total));
    let t = Instant::now();
    common::sliding(total, window, |i| {
        let latencies = &latencies;
        async move {
            let started = Instant::now();
            let confirmation = producer.send(&format!("c{}", i % entities), Add(1)).await.unwrap();
            confirmation.await.unwrap();
            latencies.lock().unwrap().push(started.elapsed());
        }
    })
    .await;
    Pass { rate: total as f64 / t.elapsed().as_secs_f64(), p99: p99(&latencies) }
}

fn main() {
    let rt = common::runtime();
    let (mut cluster, region, producer, durable) = rt.block_on(async {
        let c = TestCluster::start(3).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        let settings = ShardingSettings { number_of_shards: 100, min_nr_of_members: 3, ..ShardingSettings::default() };
        let mut regions = Vec::new();
        for i in 0..3 {
            let r: ShardRegion<CountingEntity> = c
                .node(i)
                .sharding()
                .start("counter", |_: &str| CountingEntity::default(), settings.clone())
                .await
                .unwrap();
            regions.push(r);
        }
        let producer = regions[0].producer("bench", ProducerSettings::default()).await.unwrap();
        let settings = ProducerSettings { durable_queue: true, ..ProducerSettings::default() };
        let durable = regions[0].producer("bench-durable", settings).await.unwrap();
        (c, regions.swap_remove(0), producer, durable)
    });
    let passes = common::sized(3, 1);
    let shapes: [(&str, usize, usize, usize); 2] = [
        ("one", 1, 50, common::sized(100_000, 500)),
        ("fan_out", common::sized(10_000, 200), 1_024, common::sized(300_000, 2_000)),
    ];
    let mut introduced = 0;
    for (name, entities, window, total) in shapes {
        if !common::part(name) {
            continue;
        }
        // Every entity runs and every shard's home is known before timing.
        rt.block_on(asks(&region, entities, entities, window.min(entities)));
        let (mut ask_runs, mut tell_runs, mut ours, mut stored) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..passes {
            ask_runs.push(rt.block_on(asks(&region, entities, total, window)));
            tell_runs.push(rt.block_on(tells(&region, entities, total)));
            ours.push(rt.block_on(confirmed(&producer, entities, total, window)));
            stored.push(rt.block_on(confirmed(&durable, entities, total, window)));
        }
        let median = |runs: &[Pass]| {
            let mut rates: Vec<f64> = runs.iter().map(|p| p.rate).collect();
            let mut p99s: Vec<f64> = runs.iter().map(|p| p.p99.as_secs_f64() * 1e3).collect();
            (common::median(&mut rates), common::median(&mut p99s))
        };
        let (ask, ask_p99) = median(&ask_runs);
        let (rel, rel_p99) = median(&ours);
        let (dur, dur_p99) = median(&stored);
        let tell = common::median(&mut tell_runs);
        println!(
            "{name}: {entities} entities, {window} in flight: confirmed {rel:.0}/s (p99 {rel_p99:.2} ms), with the durable queue {dur:.0}/s (p99 {dur_p99:.2} ms) vs ask {ask:.0}/s (p99 {ask_p99:.2} ms) vs tell {tell:.0}/s"
        );
        common::print_ratio(&format!("reliable_{name}_vs_ask"), rel, ask);
        common::print_ratio(&format!("reliable_durable_{name}_vs_ask"), dur, ask);
        common::print_ratio(&format!("reliable_{name}_vs_tell"), rel, tell);
        introduced += entities as u64;
        for p in [&producer, &durable] {
            let stats = p.stats();
            assert_eq!(stats.unconfirmed, 0, "every message confirmed: {stats:?}");
            // Nothing lost on loopback: only each entity's first message goes twice, to learn
            // of its incarnation (streams stay while idle, up to `max_entities`).
            assert!(stats.resent <= introduced, "{stats:?}");
        }
    }
    rt.block_on(cluster.shutdown());
}
