//! Sharding throughput and latency, each beside a baseline measured in the same run:
//! - local tell / ask through a region vs a raw tokio mpsc actor;
//! - remote tell / ask (entity on another node) vs a raw transport request/response, in
//!   sliding windows of 64 and of 512 always in flight (ratios printed);
//! - latency of the first message to a new shard on 3 nodes, with 200 and with 10,000 shards
//!   already allocated (p50/p99 printed).

use std::time::{Duration, Instant};

mod common;
use common::sliding;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::testkit::TestCluster;
use ddshard::transport::PeerAddr;
use ddshard::{Entity, EntityContext, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

#[derive(Default)]
struct Counter(i64);

#[derive(Serialize, Deserialize)]
enum Msg {
    Add(i64),
    Get,
}

impl Entity for Counter {
    type Message = Msg;
    type Reply = i64;
    async fn handle(&mut self, msg: Msg, _ctx: &mut EntityContext) -> i64 {
        if let Msg::Add(n) = msg {
            self.0 += n;
        }
        self.0
    }
}

const N: u64 = 5_000;
const IN_FLIGHT: usize = 64;
const SLIDING_WINDOW: usize = 512;
const SLIDING_TOTAL: usize = 8192;

fn settings() -> ShardingSettings {
    ShardingSettings { number_of_shards: 100_000, ..ShardingSettings::default() }
}

/// The baseline: one task owning a counter behind a bounded mpsc.
fn mpsc_actor(rt: &tokio::runtime::Runtime) -> mpsc::Sender<(Msg, Option<oneshot::Sender<i64>>)> {
    let (tx, mut rx) = mpsc::channel::<(Msg, Option<oneshot::Sender<i64>>)>(1024);
    rt.spawn(async move {
        let mut c = Counter::default();
        while let Some((m, reply)) = rx.recv().await {
            if let Msg::Add(n) = m {
                c.0 += n;
            }
            if let Some(r) = reply {
                let _ = r.send(c.0);
            }
        }
    });
    tx
}

/// `N` asks with `IN_FLIGHT` always in flight (no task per ask, like the baselines).
async fn asks_region(r: &ShardRegion<Counter>, id: &str) {
    sliding(N as usize, IN_FLIGHT, |_| async {
        r.ask(id, Msg::Add(1)).await.unwrap();
    })
    .await
}

/// `N` asks of the mpsc actor, `IN_FLIGHT` always in flight: the baseline of [`asks_region`].
async fn asks_mpsc(actor: &mpsc::Sender<(Msg, Option<oneshot::Sender<i64>>)>) {
    sliding(N as usize, IN_FLIGHT, |_| async {
        let (tx, rx) = oneshot::channel();
        actor.send((Msg::Add(1), Some(tx))).await.unwrap();
        rx.await.unwrap();
    })
    .await
}

/// Median rates (per second) of `a` and `b`, each doing `ops` operations a pass, passes
/// interleaved.
fn interleaved_rates<A, B, FA, FB>(rt: &tokio::runtime::Runtime, ops: usize, a: A, b: B) -> (f64, f64)
where
    A: Fn() -> FA,
    B: Fn() -> FB,
    FA: std::future::Future<Output = ()>,
    FB: std::future::Future<Output = ()>,
{
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    for _ in 0..common::sized(5, 1) {
        let t = Instant::now();
        rt.block_on(a());
        ra.push(ops as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        rt.block_on(b());
        rb.push(ops as f64 / t.elapsed().as_secs_f64());
    }
    (common::median(&mut ra), common::median(&mut rb))
}

fn bench(c: &mut Criterion) {
    let rt = common::runtime();
    let (cluster, local, remote_from_a) = rt.block_on(async {
        let c = TestCluster::start(3).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        let mut regions = Vec::new();
        for (_, n) in c.running() {
            regions.push(n.sharding().start("counter", |_: &str| Counter::default(), settings()).await.unwrap());
        }
        (c, regions[0].clone(), regions[1].clone())
    });
    // An entity hosted on n1 (local to region 0, remote for region 1).
    let (local_id, remote_id) = rt.block_on(async {
        let mut local_id = None;
        let mut remote_id = None;
        for i in 0.. {
            let id = format!("b{i}");
            local.ask(&id, Msg::Get).await.unwrap();
            let here = local.region_state().await.unwrap().values().flatten().any(|e| *e == id);
            if here && local_id.is_none() {
                local_id = Some(id);
            } else if here && remote_id.is_none() {
                remote_id = Some(id);
            }
            if local_id.is_some() && remote_id.is_some() {
                break;
            }
        }
        (local_id.unwrap(), remote_id.unwrap())
    });

    let mut g = c.benchmark_group("local");
    g.throughput(Throughput::Elements(N));
    g.sample_size(10).measurement_time(Duration::from_secs(6));
    let actor = mpsc_actor(&rt);
    g.bench_function("baseline_mpsc_tell", |b| {
        b.to_async(&rt).iter(|| async {
            for _ in 0..N {
                actor.send((Msg::Add(1), None)).await.unwrap();
            }
            let (tx, rx) = oneshot::channel();
            actor.send((Msg::Get, Some(tx))).await.unwrap();
            rx.await.unwrap();
        })
    });
    g.bench_function("region_tell", |b| {
        b.to_async(&rt).iter(|| async {
            for _ in 0..N {
                local.tell(&local_id, Msg::Add(1)).unwrap();
            }
            local.ask(&local_id, Msg::Get).await.unwrap();
        })
    });
    g.bench_function("baseline_mpsc_ask", |b| b.to_async(&rt).iter(|| asks_mpsc(&actor)));
    g.bench_function("region_ask", |b| b.to_async(&rt).iter(|| asks_region(&local, &local_id)));
    g.finish();
    let (ask, raw) = interleaved_rates(&rt, N as usize, || asks_region(&local, &local_id), || asks_mpsc(&actor));
    common::print_ratio("local_ask_64_in_flight_vs_mpsc_oneshot", ask, raw);

    let mut g = c.benchmark_group("remote");
    g.throughput(Throughput::Elements(N));
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    let (ta, tb) = (cluster.node(1).transport().clone(), cluster.node(0).transport().clone());
    let mut echo = tb.subscribe("bench-echo", 65_536);
    let responder = tb.clone();
    rt.spawn(async move {
        while let Some(m) = echo.recv().await {
            let _ = responder.respond(&m.from, m.request_id.unwrap(), Ok(&m.body));
        }
    });
    let to = PeerAddr { address: cluster.node(0).address().clone(), messaging_addr: cluster.node(0).messaging_addr() };
    let body = rmp_serde::to_vec(&Msg::Add(1)).unwrap();
    let raw_requests = || {
        sliding(N as usize, IN_FLIGHT, |_| async {
            ta.request(&to, "bench-echo", &body, Duration::from_secs(5)).await.unwrap();
        })
    };
    g.bench_function("baseline_transport_request", |b| b.to_async(&rt).iter(raw_requests));
    g.bench_function("region_ask_remote", |b| b.to_async(&rt).iter(|| asks_region(&remote_from_a, &remote_id)));
    g.bench_function("region_tell_remote", |b| {
        b.to_async(&rt).iter(|| async {
            for _ in 0..N {
                remote_from_a.tell(&remote_id, Msg::Add(1)).unwrap();
            }
            remote_from_a.ask(&remote_id, Msg::Get).await.unwrap();
        })
    });
    g.finish();
    let (ask, raw) = interleaved_rates(&rt, N as usize, || asks_region(&remote_from_a, &remote_id), raw_requests);
    common::print_ratio("remote_ask_64_in_flight_vs_raw_request", ask, raw);

    // The remote ask with 512 always in flight, beside the raw request with the same window.
    let mut g = c.benchmark_group("remote_sliding_512");
    g.throughput(Throughput::Elements(SLIDING_TOTAL as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    let body = rmp_serde::to_vec(&Msg::Add(1)).unwrap();
    let raw_request = || {
        sliding(SLIDING_TOTAL, SLIDING_WINDOW, |_| async {
            ta.request(&to, "bench-echo", &body, Duration::from_secs(5)).await.unwrap();
        })
    };
    let region_ask = || {
        sliding(SLIDING_TOTAL, SLIDING_WINDOW, |_| async {
            remote_from_a.ask(&remote_id, Msg::Add(1)).await.unwrap();
        })
    };
    g.bench_function("baseline_transport_request", |b| b.to_async(&rt).iter(raw_request));
    g.bench_function("region_ask_remote", |b| b.to_async(&rt).iter(region_ask));
    g.finish();
    let (ask, raw) = interleaved_rates(&rt, SLIDING_TOTAL, region_ask, raw_request);
    common::print_ratio("remote_ask_sliding_512_vs_raw_request", ask, raw);
    println!(
        "remote ask, {SLIDING_WINDOW} in flight: region {ask:.0}/s vs raw transport request {raw:.0}/s ({:.2}x)",
        ask / raw
    );

    // First message to a new shard: allocation (majority write) + HostShard + delivery, measured
    // with few shards allocated and again with 10,000 (the coordinator ships deltas, so an
    // allocation must not cost more as the map grows).
    let first_messages = |prefix: &'static str, allocated: &std::collections::HashSet<String>| {
        let mut v = Vec::new();
        let mut i = 0;
        while v.len() < common::sized(200, 20) {
            let id = format!("{prefix}-{i}");
            i += 1;
            if allocated.contains(remote_from_a.shard_id(&id).as_str()) {
                continue;
            }
            let t = Instant::now();
            rt.block_on(remote_from_a.ask(&id, Msg::Get)).unwrap();
            v.push(t.elapsed());
        }
        v.sort();
        v
    };
    let print = |label: &str, samples: &[Duration]| {
        println!(
            "first message to a new shard (3 nodes, {label}, {} samples): p50 {:?}, p99 {:?}, max {:?}",
            samples.len(),
            samples[samples.len() / 2],
            samples[samples.len() * 99 / 100],
            samples[samples.len() - 1]
        )
    };
    let mut allocated = std::collections::HashSet::new();
    let few = first_messages("first", &allocated);
    print("~200 shards allocated", &few);
    // Allocate 10,000 shards (asks with 64 in flight), then measure again.
    let target = common::sized(10_000, 500);
    // One id per new shard, then asked with 64 always in flight (a sliding window).
    let mut fill = Vec::new();
    let mut i = 0;
    while allocated.len() < target {
        let id = format!("fill-{i}");
        i += 1;
        if allocated.insert(remote_from_a.shard_id(&id).to_string()) {
            fill.push(id);
        }
    }
    let started = Instant::now();
    rt.block_on(common::sliding(fill.len(), 64, |k| {
        let (r, id) = (remote_from_a.clone(), fill[k].clone());
        async move {
            r.ask(&id, Msg::Get).await.unwrap();
        }
    }));
    println!("allocated {target} more shards in {:?}", started.elapsed());
    let many = first_messages("after-10k", &allocated);
    print(&format!("{target} shards allocated"), &many);
    // The same first-message path, its own baseline from the same run: the allocation must not
    // cost more as the coordinator's map grows.
    let p50 = |v: &[Duration]| v[v.len() / 2].as_secs_f64() * 1e6;
    common::print_ratio_of("first_message_p50_many_shards_vs_few", p50(&many), p50(&few));
    let mut g = c.benchmark_group("first_message_new_shard");
    g.sample_size(30);
    let mut k = 0u64;
    g.bench_function("ask_new_entity_new_shard_3_nodes", |b| {
        b.to_async(&rt).iter(|| {
            k += 1;
            let r = remote_from_a.clone();
            async move { r.ask(&format!("fresh-{k}"), Msg::Get).await.unwrap() }
        })
    });
    g.finish();
    rt.block_on(async move {
        let mut cluster = cluster;
        cluster.shutdown().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
