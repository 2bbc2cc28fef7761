//! WriteMajority update latency and throughput on a 3-node in-process cluster (durable and
//! memory-only keys) on a 10-member OR-set, with a local-only update in the same run as the
//! baseline.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ddshard::Consistency;
use ddshard::ddata::OrSet;
use ddshard::testkit::TestCluster;

const OP: Duration = Duration::from_secs(5);

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
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

    let mut g = c.benchmark_group("replicator_update_throughput");
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    const IN_FLIGHT: usize = 64;
    g.throughput(Throughput::Elements(IN_FLIGHT as u64));
    for (name, prefix) in [("majority_memory", "tp-mem"), ("majority_durable_lmdb", "durable-tp")] {
        g.bench_with_input(BenchmarkId::new(name, IN_FLIGHT), &prefix, |b, prefix| {
            b.to_async(&rt).iter(|| {
                let r = r.clone();
                let prefix = prefix.to_string();
                async move {
                    let mut tasks = Vec::with_capacity(IN_FLIGHT);
                    for k in 0..IN_FLIGHT {
                        let r = r.clone();
                        // Many keys, as shards would use: one write per key in flight.
                        let key = format!("{prefix}-{k}");
                        tasks.push(tokio::spawn(async move {
                            r.update::<OrSet, _>(&key, Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "x"))
                                .await
                                .unwrap()
                        }));
                    }
                    for t in tasks {
                        t.await.unwrap();
                    }
                }
            })
        });
    }
    g.finish();
    rt.block_on(async move {
        let mut cluster = cluster;
        cluster.shutdown().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
