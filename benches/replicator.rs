//! WriteMajority update latency and throughput on a 3-node in-process cluster (durable and
//! memory-only keys) on a 10-member OR-set, with a local-only update in the same run as the
//! baseline; and sliding windows (64 and 512 updates always in flight over 4,096 keys) beside a
//! raw framed-TCP request/response with the same window to a peer, ratios printed.

use std::time::Duration;

use std::time::Instant;

mod common;
use common::sliding;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::Consistency;
use ddshard::ddata::OrSet;
use ddshard::testkit::TestCluster;
use ddshard::transport::PeerAddr;

const OP: Duration = Duration::from_secs(5);

const SLIDING_WINDOW: usize = 512;
const SLIDING_TOTAL: usize = 8192;
const SLIDING_KEYS: usize = 4096;

fn bench(c: &mut Criterion) {
    let rt = common::runtime();
    let cluster = rt.block_on(async {
        let c = TestCluster::start(3).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        c
    });
    let r = cluster.node(0).replicator().clone();

    let mut g = c.benchmark_group("replicator_update_latency");
    g.sample_size(30).measurement_time(Duration::from_secs(6));
    for (name, key, consistency) in [
        ("local_baseline", "bench-local", Consistency::Local),
        ("majority_memory", "bench-mem", Consistency::MAJORITY),
        ("majority_durable_lmdb", "durable-bench", Consistency::MAJORITY),
    ] {
        let mut i = 0u64;
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                i += 1;
                let member = format!("m{}", i % 10);
                let r = r.clone();
                async move { r.update::<OrSet, _>(key, consistency, OP, move |s, ctx| s.add(ctx, member)).await.unwrap() }
            })
        });
    }
    g.finish();

    // Sliding windows of 64 and 512 always in flight, each update a new member on one of 4,096 keys;
    // the baseline is a raw request/response over the same framed TCP transport, same window.
    let transport = cluster.node(0).transport().clone();
    let peer = cluster.node(1).transport().clone();
    let mut echo = peer.subscribe("bench-echo", 65_536);
    let responder = peer.clone();
    rt.spawn(async move {
        while let Some(m) = echo.recv().await {
            if let Some(id) = m.request_id {
                let _ = responder.respond(&m.from, id, Ok(&m.body));
            }
        }
    });
    let to = PeerAddr { address: cluster.node(1).address().clone(), messaging_addr: cluster.node(1).messaging_addr() };
    let body = vec![0u8; 64];
    let round = std::sync::atomic::AtomicUsize::new(0);
    let run = |name: &str, window: usize| {
        let n = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (r, transport, to, body) = (&r, &transport, &to, &body);
        let name = name.to_string();
        async move {
            match name.as_str() {
                "raw_transport_request" => {
                    sliding(SLIDING_TOTAL, window, |_| async move {
                        transport.request(to, "bench-echo", body, OP).await.unwrap();
                    })
                    .await
                }
                _ => {
                    let (prefix, consistency) = match name.as_str() {
                        "local_memory" => ("sl-local", Consistency::Local),
                        "majority_memory" => ("sl-mem", Consistency::MAJORITY),
                        _ => ("durable-sl", Consistency::MAJORITY),
                    };
                    sliding(SLIDING_TOTAL, window, |i| async move {
                        let key = format!("{prefix}-{}", i % SLIDING_KEYS);
                        let member = format!("r{n}-{i}");
                        r.update::<OrSet, _>(&key, consistency, OP, move |s, ctx| s.add(ctx, member)).await.unwrap()
                    })
                    .await
                }
            }
        }
    };
    const SLIDING: [&str; 4] = ["raw_transport_request", "local_memory", "majority_memory", "majority_durable_lmdb"];
    for window in [64, SLIDING_WINDOW] {
        let mut g = c.benchmark_group(format!("replicator_update_sliding_{window}"));
        g.sample_size(10).measurement_time(Duration::from_secs(10));
        g.throughput(Throughput::Elements(SLIDING_TOTAL as u64));
        for name in SLIDING {
            g.bench_function(name, |b| b.to_async(&rt).iter(|| run(name, window)));
        }
        g.finish();
        // The ratios, from interleaved timed passes (median of 5 each).
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); SLIDING.len()];
        for _ in 0..common::sized(5, 1) {
            for (i, name) in SLIDING.iter().enumerate() {
                let t = Instant::now();
                rt.block_on(run(name, window));
                rates[i].push(SLIDING_TOTAL as f64 / t.elapsed().as_secs_f64());
            }
        }
        let medians: Vec<f64> = rates.iter_mut().map(|v| common::median(v)).collect();
        common::print_ratio(&format!("majority_memory_update_sliding_{window}_vs_raw_request"), medians[2], medians[0]);
        common::print_ratio(
            &format!("majority_durable_update_sliding_{window}_vs_raw_request"),
            medians[3],
            medians[0],
        );
        println!(
            "sliding window of {window} (3 nodes): raw transport request {:.0}/s; local update {:.0}/s; \
             majority memory {:.0}/s ({:.2}x raw); majority durable LMDB {:.0}/s ({:.2}x raw)",
            medians[0],
            medians[1],
            medians[2],
            medians[2] / medians[0],
            medians[3],
            medians[3] / medians[0]
        );
    }
    rt.block_on(async move {
        let mut cluster = cluster;
        cluster.shutdown().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
