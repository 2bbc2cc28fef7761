//! Remember-entities costs, each beside its baseline in the same run:
//! - new-entity start rate with remember-entities on vs off (3 nodes, majority writes, LMDB),
//!   with sliding windows of 64, 512 and 1,024 always in flight, each with its start latency
//!   percentiles and the remember writer's stage counters;
//! - restart time of 100k remembered entities after a full-cluster restart, beside a raw
//!   LMDB baseline (the same ids in the same keys read back from one environment and a task
//!   started per id);
//! - memory and serialized size of one shard holding 1M remembered ids, beside the raw ids
//!   (the bytes of the id strings themselves).
//!
//! To profile one part: `DDSHARD_BENCH_ONLY=ratios DDSHARD_BENCH_SIDE=ours
//! DDSHARD_BENCH_PASSES=25` runs only the remember-on sliding passes, 25 per window.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

mod common;
use common::sliding;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::ddata::{OrSet, WriteCtx};
use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct Thing;

#[derive(Serialize, Deserialize)]
struct Ping;

impl Entity for Thing {
    type Message = Ping;
    type Reply = ();
    async fn handle(&mut self, _msg: Ping, _ctx: &mut EntityContext) {}
}

const BATCH: usize = 512;
const IN_FLIGHT: usize = 64;

fn settings(remember: bool) -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 100,
        min_nr_of_members: 3,
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: remember, ..Default::default() },
        ..Default::default()
    }
}

/// `BATCH` new entities, `IN_FLIGHT` asks always in flight.
async fn start_new(r: &ShardRegion<Thing>, prefix: &str, from: usize) {
    start_new_sliding(r, prefix, from, BATCH, IN_FLIGHT).await
}

/// Sliding window: `window` asks always in flight (a new one starts as each finishes) until
/// `total` new entities have started.
async fn start_new_sliding(r: &ShardRegion<Thing>, prefix: &str, from: usize, total: usize, window: usize) {
    start_new_timed(r, prefix, from, total, window, &std::sync::Mutex::new(Vec::new())).await
}

/// [`start_new_sliding`], adding each start's latency to `latencies`.
async fn start_new_timed(
    r: &ShardRegion<Thing>,
    prefix: &str,
    from: usize,
    total: usize,
    window: usize,
    latencies: &std::sync::Mutex<Vec<Duration>>,
) {
    sliding(total, window, |i| {
        let id = format!("{prefix}-{}", from + i);
        async move {
            let t = Instant::now();
            r.ask(&id, Ping).await.unwrap();
            latencies.lock().unwrap().push(t.elapsed());
        }
    })
    .await
}

const SLIDING_TOTAL: usize = 4096;
const SLIDING_WINDOW: usize = 512;

/// Where a remembered start spends its time: the region's remember writer (queue wait, majority
/// round, batch size) and the replicators of all nodes (commits, merges).
#[derive(Default)]
struct StageCounters {
    batches: u64,
    requests: u64,
    ids: u64,
    queue_wait_us: u64,
    round_us: u64,
    commits: u64,
    commit_us: u64,
    records: u64,
    deltas_merged: u64,
}

impl StageCounters {
    fn read(cluster: &TestCluster, region: &ShardRegion<Thing>) -> StageCounters {
        let c = region.counters();
        let mut s = StageCounters {
            batches: c.remember_batches,
            requests: c.remember_requests,
            ids: c.remember_ids_written,
            queue_wait_us: c.remember_queue_wait_micros,
            round_us: c.remember_round_micros,
            ..Default::default()
        };
        for (_, n) in cluster.running() {
            s.commits += n.replicator().stats().durable_commits;
            s.commit_us += n.replicator().stats().durable_commit_micros;
            s.records += n.replicator().stats().durable_records;
            s.deltas_merged += n.replicator().stats().deltas_merged;
        }
        s
    }

    fn print_since(&self, before: &StageCounters, elapsed: Duration) {
        let batches = (self.batches - before.batches).max(1);
        let requests = (self.requests - before.requests).max(1);
        let secs = elapsed.as_secs_f64();
        println!(
            "remember stages (node 1's writer, sliding runs): {} batches of {:.0} ids ({:.1} shards) each, \
             queue wait {:.2} ms, majority round {:.2} ms; all nodes: {:.0} LMDB commits/s of {:.0} records taking \
             {:.2} ms each, {:.0} delta merges/s",
            batches,
            (self.ids - before.ids) as f64 / batches as f64,
            requests as f64 / batches as f64,
            (self.queue_wait_us - before.queue_wait_us) as f64 / requests as f64 / 1e3,
            (self.round_us - before.round_us) as f64 / batches as f64 / 1e3,
            (self.commits - before.commits) as f64 / secs,
            (self.records - before.records) as f64 / (self.commits - before.commits).max(1) as f64,
            (self.commit_us - before.commit_us) as f64 / (self.commits - before.commits).max(1) as f64 / 1e3,
            (self.deltas_merged - before.deltas_merged) as f64 / secs,
        );
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn bench(c: &mut Criterion) {
    // Parts (`DDSHARD_BENCH_ONLY`): `set_size`, `starts` (criterion groups), `ratios` (timed
    // sliding passes; `DDSHARD_BENCH_SIDE=ours` runs remember-on alone), `restart`.
    if common::part("set_size") {
        set_size();
    }
    let rt = common::runtime();
    let (mut cluster, on, off) = rt.block_on(async {
        let c = TestCluster::start(3).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for (_, n) in c.running() {
            on.push(n.sharding().start("on", |_: &str| Thing, settings(true)).await.unwrap());
            off.push(n.sharding().start("off", |_: &str| Thing, settings(false)).await.unwrap());
        }
        (c, on[0].clone(), off[0].clone())
    });
    if common::part("starts") {
        starts(c, &rt, &cluster, &on, &off);
    }
    if common::part("ratios") {
        ratios(&rt, &cluster, &on, &off);
    }
    if common::part("restart") {
        restart(&rt, &mut cluster);
    }
    rt.block_on(cluster.shutdown());
}

/// Memory and serialized size of one shard holding 1M ids in 64 slots.
fn set_size() {
    let before = rss_bytes();
    let slots = 64u32;
    let mut sets: Vec<OrSet> = (0..slots).map(|_| OrSet::default()).collect();
    let ctx = WriteCtx::new("n1#1", 1);
    let mut per_slot: Vec<Vec<String>> = vec![Vec::new(); slots as usize];
    let total_ids = common::sized(1_000_000, 10_000) as u32;
    for i in 0..total_ids {
        let id = format!("{:08x}-entity", i.wrapping_mul(2_654_435_761));
        per_slot[(xxhash_rust::xxh3::xxh3_64(id.as_bytes()) % u64::from(slots)) as usize].push(id);
    }
    let t = Instant::now();
    for (s, ids) in sets.iter_mut().zip(per_slot) {
        // As a shard records them: batches of 1000 starts per write.
        for chunk in ids.chunks(1000) {
            s.add_all(&ctx, chunk.to_vec());
            // The replicator takes each update's delta and ships it.
            s.take_delta();
        }
    }
    let built = t.elapsed();
    let raw_id_bytes: usize = sets.iter().flat_map(|s| s.members()).map(|id| id.len()).sum();
    let heap: usize = sets.iter().map(OrSet::heap_bytes).sum();
    let bytes: usize =
        sets.iter().map(|s| rmp_serde::to_vec(&ddshard::ddata::ReplicatedData::OrSet(s.clone())).unwrap().len()).sum();
    let largest = sets.iter().map(|s| rmp_serde::to_vec(s).unwrap().len()).max().unwrap();
    println!(
        "{total_ids} remembered ids in {slots} slots: built in {built:?}, serialized {:.1} MB (largest slot {:.0} \
         KB), set storage {:.1} B/id, RSS +{:.0} MB",
        bytes as f64 / 1e6,
        largest as f64 / 1e3,
        heap as f64 / f64::from(total_ids),
        rss_bytes().saturating_sub(before) as f64 / 1e6
    );
    common::print_ratio_of("orset_heap_vs_raw_id_bytes", heap as f64, raw_id_bytes as f64);
    common::print_ratio_of("orset_serialized_vs_raw_id_bytes", bytes as f64, raw_id_bytes as f64);
}

/// New-entity starts with remember on and off, as criterion groups (64 and 512 in flight).
fn starts(
    c: &mut Criterion,
    rt: &tokio::runtime::Runtime,
    cluster: &TestCluster,
    on: &ShardRegion<Thing>,
    off: &ShardRegion<Thing>,
) {
    let (on, off) = (on.clone(), off.clone());
    let mut g = c.benchmark_group("new_entity_start_rate_3_nodes");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    let mut next = 0usize;
    g.bench_function("remember_entities_off", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    start_new(&off, "off", next).await;
                    next += BATCH;
                }
                t.elapsed()
            })
        })
    });
    let mut next = 0usize;
    g.bench_function("remember_entities_on_majority_lmdb", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    start_new(&on, "on", next).await;
                    next += BATCH;
                }
                t.elapsed()
            })
        })
    });
    g.finish();

    // The same starts with 512 always in flight (the shape of a busy service), each beside the
    // remember-off baseline; stage counters of the remember-on run printed after.
    let stage_before = StageCounters::read(cluster, &on);
    let stage_clock = Instant::now();
    let mut g = c.benchmark_group("new_entity_start_rate_3_nodes_sliding_512");
    g.throughput(Throughput::Elements(SLIDING_TOTAL as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    for (name, region, prefix) in
        [("remember_entities_off", &off, "off-w"), ("remember_entities_on_majority_lmdb", &on, "on-w")]
    {
        let mut next = 0usize;
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..iters {
                        start_new_sliding(region, prefix, next, SLIDING_TOTAL, SLIDING_WINDOW).await;
                        next += SLIDING_TOTAL;
                    }
                    t.elapsed()
                })
            })
        });
    }
    g.finish();
    StageCounters::read(cluster, &on).print_since(&stage_before, stage_clock.elapsed());
}

/// Remember on against off from interleaved timed passes (median of 3), for each window.
fn ratios(rt: &tokio::runtime::Runtime, cluster: &TestCluster, on: &ShardRegion<Thing>, off: &ShardRegion<Thing>) {
    // The ratios, from interleaved timed passes (median of 3), for both windows.
    let mut next = 1usize << 40;
    for window in [IN_FLIGHT, SLIDING_WINDOW, 1024] {
        let (mut on_rates, mut off_rates) = (Vec::new(), Vec::new());
        let latencies = std::sync::Mutex::new(Vec::new());
        let (stage_before, mut stage_time) = (StageCounters::read(cluster, on), Duration::ZERO);
        for _ in 0..common::passes(3, 1) {
            for (rates, region, prefix, side) in
                [(&mut off_rates, off, "off-r", "baseline"), (&mut on_rates, on, "on-r", "ours")]
            {
                if !common::side(side) {
                    continue;
                }
                let t = Instant::now();
                let timed = if side == "ours" { &latencies } else { &std::sync::Mutex::new(Vec::new()) };
                rt.block_on(start_new_timed(region, prefix, next, SLIDING_TOTAL, window, timed));
                rates.push(SLIDING_TOTAL as f64 / t.elapsed().as_secs_f64());
                if side == "ours" {
                    stage_time += t.elapsed();
                }
            }
            next += SLIDING_TOTAL;
        }
        common::print_ratio(
            &format!("remembered_starts_sliding_{window}_vs_remember_off"),
            common::median(&mut on_rates),
            common::median(&mut off_rates),
        );
        let mut l = latencies.into_inner().unwrap();
        l.sort();
        let at = |q: f64| l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1))).copied();
        println!(
            "remembered start latency, {window} in flight: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
            at(0.5).unwrap_or_default(),
            at(0.9).unwrap_or_default(),
            at(0.99).unwrap_or_default(),
            l.last().copied().unwrap_or_default()
        );
        StageCounters::read(cluster, on).print_since(&stage_before, stage_time);
    }
}

/// Restart time after a full-cluster restart: seed 100k remembered ids straight into the
/// replicated sets (as the shards would have recorded them), restart every node, and time
/// until all of them run again.
fn restart(rt: &tokio::runtime::Runtime, cluster: &mut TestCluster) {
    let n = common::sized(100_000, 2_000);
    rt.block_on(async {
        let s = ShardingSettings {
            remember: ddshard::sharding::RememberEntitiesSettings { slots: 16, ..settings(true).remember },
            ..settings(true)
        };
        let by_key = seed_remembered(cluster, "restart", &s, n).await;
        let baseline = raw_lmdb_restart(&by_key).await;
        let (took, _) = full_restart(cluster, "restart", &s, n).await;
        println!(
            "full-cluster restart: {n} remembered entities running again {took:?} after the restart began \
             (raw LMDB read + one task per id: {baseline:?})"
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        common::print_ratio_of("restart_ms_vs_raw_lmdb_read_and_tasks_ms", ms(took), ms(baseline));

        // The same restart with 1,000 shards, whose loads all start at once: capped at
        // `max_concurrent_shard_loads` per region (the default) beside uncapped, in the same run.
        let many = ShardingSettings { number_of_shards: 1000, ..s.clone() };
        seed_remembered(cluster, "restart-1k", &many, n).await;
        let uncapped = ShardingSettings { max_concurrent_shard_loads: 1_000_000, ..many.clone() };
        let (took_uncapped, faults_uncapped) = full_restart(cluster, "restart-1k", &uncapped, n).await;
        let (took_capped, faults_capped) = full_restart(cluster, "restart-1k", &many, n).await;
        println!(
            "full-cluster restart, 1,000 shards, {n} remembered ids: capped at {} loads per region {took_capped:?} \
             (load timeouts, shard failures: {faults_capped:?}); uncapped {took_uncapped:?} ({faults_uncapped:?})",
            many.max_concurrent_shard_loads
        );
        common::print_ratio_of("restart_1k_shards_capped_ms_vs_uncapped_ms", ms(took_capped), ms(took_uncapped));
    });
}

/// Seeds `n` remembered ids of type `type_name` straight into the replicated sets (as its
/// shards would have recorded them), and the type's set of remembered shards; returns the ids
/// by slot key.
async fn seed_remembered(
    cluster: &TestCluster,
    type_name: &str,
    s: &ShardingSettings,
    n: usize,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let r = cluster.node(0).replicator().clone();
    let mut by_key: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for i in 0..n {
        let id = format!("r-{i}");
        let shard = ddshard::sharding::default_shard_id(&id, s.number_of_shards);
        let slot = xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), 0x5107) % u64::from(s.remember.slots);
        by_key.entry(format!("shard-{type_name}/{shard}/{slot}")).or_default().push(id);
    }
    for (key, ids) in by_key.clone() {
        r.update::<OrSet, _>(&key, ddshard::Consistency::All, Duration::from_secs(30), move |set, ctx| {
            set.add_all(ctx, ids)
        })
        .await
        .unwrap();
    }
    let shards: BTreeSet<String> = (0..s.number_of_shards).map(|i| i.to_string()).collect();
    r.update::<ddshard::ddata::GSet, _>(
        &format!("shard-{type_name}/all"),
        ddshard::Consistency::All,
        Duration::from_secs(30),
        move |g, _| {
            for sh in shards {
                g.insert(sh);
            }
        },
    )
    .await
    .unwrap();
    by_key
}

/// Kills and restarts every node, starts type `type_name` on each, and waits until its `n`
/// remembered entities run again; returns the time from the restart and the regions' shard
/// load timeouts and shard failures.
async fn full_restart(
    cluster: &mut TestCluster,
    type_name: &str,
    s: &ShardingSettings,
    n: usize,
) -> (Duration, (u64, u64)) {
    for i in 0..3 {
        cluster.kill(i).await;
    }
    let t = Instant::now();
    for i in 0..3 {
        cluster.restart(i).await.unwrap();
    }
    cluster.await_converged(Duration::from_secs(60)).await;
    let mut regions = Vec::new();
    for (_, node) in cluster.running() {
        regions.push(node.sharding().start(type_name, |_: &str| Thing, s.clone()).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let mut running = 0;
        for r in &regions {
            running += r.region_stats().await.unwrap().values().sum::<usize>();
        }
        if running >= n {
            let took = t.elapsed();
            let timeouts = regions.iter().map(|r| r.counters().shard_load_timeouts).sum();
            let failures = regions.iter().map(|r| r.counters().shard_failures).sum();
            return (took, (timeouts, failures));
        }
        assert!(Instant::now() < deadline, "only {running} of {n} running after 300 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The restart's floor on one node: the same ids in the same keys, written to a fresh LMDB
/// environment and fsynced, then (timed) the environment opened, every key read and decoded,
/// and one tokio task started per id, until all of them ran.
async fn raw_lmdb_restart(by_key: &std::collections::BTreeMap<String, Vec<String>>) -> Duration {
    use heed::types::{Bytes, Str};
    let dir = tempfile::tempdir().unwrap();
    let open = |dir: &std::path::Path| {
        // SAFETY: one environment per directory in this process, opened once at a time.
        let env = unsafe { heed::EnvOpenOptions::new().map_size(1 << 30).max_dbs(1).open(dir) }.unwrap();
        let wtxn = env.write_txn().unwrap();
        let db = env
            .create_databases_and_commit(wtxn, |dbo, w| -> heed::Result<_> {
                Ok(heed::CommitOrAbort::<_, ()>::Commit(dbo.create_database::<Str, Bytes>(w, Some("ids"))?))
            })
            .unwrap()
            .unwrap_commit();
        (env, db)
    };
    {
        let (env, db) = open(dir.path());
        let mut wtxn = env.write_txn().unwrap();
        for (key, ids) in by_key {
            db.put(&mut wtxn, key, &rmp_serde::to_vec(ids).unwrap()).unwrap();
        }
        wtxn.commit().unwrap();
        env.prepare_for_closing().wait();
    }
    let t = Instant::now();
    let (env, db) = open(dir.path());
    let rtxn = env.read_txn().unwrap();
    let done = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let mut n = 0u32;
    for entry in db.iter(&rtxn).unwrap() {
        let (_, bytes) = entry.unwrap();
        for id in rmp_serde::from_slice::<Vec<String>>(bytes).unwrap() {
            let done = done.clone();
            tokio::spawn(async move {
                std::hint::black_box(id);
                done.add_permits(1);
            });
            n += 1;
        }
    }
    let _all = done.acquire_many(n).await.unwrap();
    t.elapsed()
}

criterion_group!(benches, bench);
criterion_main!(benches);
