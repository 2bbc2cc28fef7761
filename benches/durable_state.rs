//! Durable entity state, each figure beside its baseline in the same run:
//! - persisting asks per second on 3 nodes (majority, LMDB on each replica, group commit per
//!   region), a sliding window of 512 always in flight, beside the same asks to an in-memory
//!   entity and beside raw LMDB group commit (one writer thread, one transaction and fsync per
//!   batch) with the same window;
//! - p50 / p99 of one persisting ask at a time, beside an in-memory ask;
//! - a shard's state load (claim and read of its slots on the replicas, then the first entity)
//!   with 10,000 and 100,000 stored states, beside reading the same encoded values from one
//!   raw LMDB environment;
//! - bytes per stored state beyond the state's own encoding.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::sliding;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::ddata::{Consistency, FencedMap, KeyUpdate};
use ddshard::testkit::TestCluster;
use ddshard::{DurableEntity, Entity, EntityContext, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

/// A device twin: its last reading is the state.
struct Twin;

#[derive(Clone, Serialize, Deserialize)]
enum TwinMsg {
    Report(u64),
    Get,
}

#[derive(Default, Serialize, Deserialize)]
struct TwinState {
    reading: u64,
    history: [u64; 3],
}

impl DurableEntity for Twin {
    type Message = TwinMsg;
    type Reply = u64;
    type State = TwinState;
    async fn handle(&mut self, state: &mut TwinState, msg: TwinMsg, ctx: &mut EntityContext) -> u64 {
        if let TwinMsg::Report(v) = msg {
            state.history = [state.reading, state.history[0], state.history[1]];
            state.reading = v;
            ctx.persist();
        }
        state.reading
    }
}

/// The same entity keeping its state in memory only.
#[derive(Default)]
struct VolatileTwin {
    state: TwinState,
}

impl Entity for VolatileTwin {
    type Message = TwinMsg;
    type Reply = u64;
    async fn handle(&mut self, msg: TwinMsg, _ctx: &mut EntityContext) -> u64 {
        if let TwinMsg::Report(v) = msg {
            self.state.history = [self.state.reading, self.state.history[0], self.state.history[1]];
            self.state.reading = v;
        }
        self.state.reading
    }
}

const WINDOW: usize = 512;
const ENTITIES: usize = 4096;

fn settings() -> ShardingSettings {
    ShardingSettings { number_of_shards: 100, min_nr_of_members: 3, ..Default::default() }
}

async fn report_window<E>(r: &ShardRegion<E>, total: usize, round: u64)
where
    E: Entity<Message = TwinMsg, Reply = u64>,
{
    sliding(total, WINDOW, |i| {
        let id = format!("twin-{}", i % ENTITIES);
        async move {
            r.ask(&id, TwinMsg::Report(round)).await.unwrap();
        }
    })
    .await
}

/// Raw LMDB with group commit: a writer thread takes every queued put, writes them in one
/// transaction, commits (fsync) and then answers them all.
struct RawLmdb {
    tx: std::sync::mpsc::Sender<(String, Vec<u8>, tokio::sync::oneshot::Sender<()>)>,
    _dir: tempfile::TempDir,
}

impl RawLmdb {
    fn start() -> RawLmdb {
        let dir = tempfile::tempdir().unwrap();
        let (env, db) = open_env(dir.path().to_path_buf());
        let (tx, rx) = std::sync::mpsc::channel::<(String, Vec<u8>, tokio::sync::oneshot::Sender<()>)>();
        std::thread::spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                batch.extend(rx.try_iter());
                let mut wtxn = env.write_txn().unwrap();
                for (k, v, _) in &batch {
                    db.put(&mut wtxn, k, v).unwrap();
                }
                wtxn.commit().unwrap();
                for (_, _, done) in batch {
                    let _ = done.send(());
                }
            }
        });
        RawLmdb { tx, _dir: dir }
    }

    async fn put(&self, key: String, value: Vec<u8>) {
        let (done, wait) = tokio::sync::oneshot::channel();
        self.tx.send((key, value, done)).unwrap();
        wait.await.unwrap();
    }
}

async fn raw_window(raw: &RawLmdb, total: usize, round: u64) {
    sliding(total, WINDOW, |i| {
        let state = TwinState { reading: round, history: [round; 3] };
        let bytes = rmp_serde::to_vec_named(&state).unwrap();
        raw.put(format!("twin-{}", i % ENTITIES), bytes)
    })
    .await
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn bench(c: &mut Criterion) {
    // Bytes per stored state beyond the state's own encoding (the id is counted as overhead).
    let state = TwinState { reading: 1_763_990_000, history: [1, 2, 3] };
    let state_bytes = rmp_serde::to_vec_named(&state).unwrap();
    let mut map = FencedMap::default();
    let n = 10_000;
    for i in 0..n {
        map.put(format!("twin-{i}"), 1_763_990_000_123, state_bytes.clone()).unwrap();
    }
    let encoded = rmp_serde::to_vec(&ddshard::ddata::ReplicatedData::FencedMap(map.clone())).unwrap().len();
    let per_state = encoded as f64 / n as f64;
    println!(
        "stored state: {} B of state encoding, {per_state:.1} B per state in the replicated value ({:.1} B beyond \
         the state, of which {:.1} B are the id)",
        state_bytes.len(),
        per_state - state_bytes.len() as f64,
        "twin-9999".len() as f64
    );
    common::print_ratio_of("stored_bytes_per_state_vs_state_encoding", per_state, state_bytes.len() as f64);

    let rt = common::runtime();
    let (cluster, durable, volatile) = rt.block_on(async {
        let c = TestCluster::start(3).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        let (mut d, mut v) = (Vec::new(), Vec::new());
        for (_, n) in c.running() {
            d.push(n.sharding().start_durable("twin", |_: &str| Twin, settings()).await.unwrap());
            v.push(n.sharding().start("volatile", |_: &str| VolatileTwin::default(), settings()).await.unwrap());
        }
        // Every shard hosted and every entity started once, so the runs measure steady writes.
        report_window(&d[0], ENTITIES, 0).await;
        report_window(&v[0], ENTITIES, 0).await;
        (c, d[0].clone(), v[0].clone())
    });
    let raw = RawLmdb::start();
    let total = common::sized(16_384, 1_024);

    let mut g = c.benchmark_group("persisting_asks_3_nodes_sliding_512");
    g.throughput(Throughput::Elements(total as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(15));
    let mut round = 1u64;
    g.bench_function("in_memory_entity", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    report_window(&volatile, total, round).await;
                    round += 1;
                }
                t.elapsed()
            })
        })
    });
    g.bench_function("durable_entity_majority_lmdb", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    report_window(&durable, total, round).await;
                    round += 1;
                }
                t.elapsed()
            })
        })
    });
    g.bench_function("raw_lmdb_group_commit_one_node", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    raw_window(&raw, total, round).await;
                    round += 1;
                }
                t.elapsed()
            })
        })
    });
    g.finish();

    // Ratios from interleaved timed passes (median of 3).
    let (mut d_rates, mut v_rates, mut raw_rates) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..common::sized(3, 1) {
        let t = Instant::now();
        rt.block_on(report_window(&volatile, total, round));
        v_rates.push(total as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        rt.block_on(report_window(&durable, total, round));
        d_rates.push(total as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        rt.block_on(raw_window(&raw, total, round));
        raw_rates.push(total as f64 / t.elapsed().as_secs_f64());
        round += 1;
    }
    let durable_rate = common::median(&mut d_rates);
    println!("persisting asks: {durable_rate:.0}/s with {WINDOW} in flight on 3 nodes (goal: 30,000/s)");
    common::print_ratio("persisting_asks_vs_in_memory_asks", durable_rate, common::median(&mut v_rates));
    common::print_ratio("persisting_asks_vs_raw_lmdb_group_commit", durable_rate, common::median(&mut raw_rates));
    let batches = durable.counters().state_batches;
    let writes = durable.counters().state_writes;
    println!(
        "node 1's state writer: {writes} writes in {batches} batches ({:.0} per batch)",
        writes as f64 / batches.max(1) as f64
    );

    // One ask at a time: latency of a persisting ask beside an in-memory one.
    let samples = common::sized(2_000, 50);
    let (mut d_lat, mut v_lat) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    rt.block_on(async {
        for i in 0..samples {
            let id = format!("twin-{}", i % ENTITIES);
            let t = Instant::now();
            durable.ask(&id, TwinMsg::Report(i as u64)).await.unwrap();
            d_lat.push(t.elapsed());
            let t = Instant::now();
            volatile.ask(&id, TwinMsg::Report(i as u64)).await.unwrap();
            v_lat.push(t.elapsed());
        }
    });
    d_lat.sort();
    v_lat.sort();
    println!(
        "one ask at a time: persisting p50 {:?} p99 {:?}; in-memory p50 {:?} p99 {:?}",
        percentile(&d_lat, 0.5),
        percentile(&d_lat, 0.99),
        percentile(&v_lat, 0.5),
        percentile(&v_lat, 0.99)
    );
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    common::print_ratio_of(
        "persisting_ask_p50_us_vs_in_memory_p50_us",
        us(percentile(&d_lat, 0.5)),
        us(percentile(&v_lat, 0.5)),
    );
    common::print_ratio_of(
        "persisting_ask_p99_us_vs_in_memory_p99_us",
        us(percentile(&d_lat, 0.99)),
        us(percentile(&v_lat, 0.99)),
    );

    // A shard's state load with 10k and 100k stored states (and none: the first ask's cost
    // without a load, allocation included).
    for states in [0, common::sized(10_000, 500), common::sized(100_000, 2_000)] {
        rt.block_on(load_time(&cluster, states));
    }
    drop(cluster);
}

/// Seeds `states` states into shard 1 of a fresh two-shard type (on every replica), starts the
/// type, asks an entity of shard 0 (so the coordinator runs and the regions are registered),
/// then times the first ask to an entity of shard 1: its allocation, the claim-and-load of its
/// 16 slots on the replicas and the entity's start. Beside it, the same encoded values read
/// from one raw LMDB environment.
async fn load_time(cluster: &TestCluster, states: usize) {
    let type_name = format!("load{states}");
    let s = ShardingSettings { number_of_shards: 2, ..settings() };
    let state = rmp_serde::to_vec_named(&TwinState { reading: 7, history: [1, 2, 3] }).unwrap();
    let slots = s.state.slots;
    let shard_of = |id: &str| ddshard::sharding::default_shard_id(id, 2);
    let warm = (0..).map(|i| format!("warm-{i}")).find(|id| shard_of(id) == "0").unwrap();
    let mut ids = (0..).map(|i| format!("twin-{i}")).filter(|id| shard_of(id) == "1");
    let probe = ids.next().unwrap();
    let mut by_slot: Vec<Vec<String>> = vec![Vec::new(); slots as usize];
    for id in std::iter::once(probe.clone()).chain(ids).take(states) {
        let slot = xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), 0x5107) % u64::from(slots);
        by_slot[slot as usize].push(id);
    }
    let replicator = cluster.node(0).replicator().clone();
    let mut raw_values = Vec::new();
    for (slot, ids) in by_slot.into_iter().enumerate() {
        let key = format!("shard-{type_name}/1/state-{slot}");
        let (ids, state) = (Arc::new(ids), state.clone());
        let update = KeyUpdate::new::<FencedMap, _>(&key, move |m, _| {
            for id in ids.iter() {
                m.put(id.clone(), 1, state.clone()).unwrap();
            }
        });
        replicator.update_many(Consistency::All, Duration::from_secs(30), vec![update]).await.unwrap();
        let value = replicator.get::<FencedMap>(&key, Consistency::Local, Duration::from_secs(5)).await.unwrap();
        raw_values.push((key, rmp_serde::to_vec(&value.unwrap()).unwrap()));
    }
    let baseline = raw_lmdb_read(&raw_values);
    let mut regions = Vec::new();
    for (_, n) in cluster.running() {
        regions.push(n.sharding().start_durable(&type_name, |_: &str| Twin, s.clone()).await.unwrap());
    }
    regions[0].ask(&warm, TwinMsg::Get).await.unwrap();
    let t = Instant::now();
    let reading = regions[0].ask(&probe, TwinMsg::Get).await.unwrap();
    let took = t.elapsed();
    assert_eq!(reading, if states > 0 { 7 } else { 0 }, "the seeded state was loaded");
    println!("shard state load: {states} states in {took:?} (raw LMDB read of the same values: {baseline:?})");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if states > 0 {
        common::print_ratio_of(&format!("state_load_{states}_ms_vs_raw_lmdb_read_ms"), ms(took), ms(baseline));
    }
}

/// Writes the encoded slot values to a fresh LMDB environment, then (timed) opens it and reads
/// and decodes every value.
fn raw_lmdb_read(values: &[(String, Vec<u8>)]) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    {
        let (env, db) = open_env(dir.path().to_path_buf());
        let mut wtxn = env.write_txn().unwrap();
        for (k, v) in values {
            db.put(&mut wtxn, k, v).unwrap();
        }
        wtxn.commit().unwrap();
        env.prepare_for_closing().wait();
    }
    let t = Instant::now();
    let (env, db) = open_env(dir.path().to_path_buf());
    let rtxn = env.read_txn().unwrap();
    for entry in db.iter(&rtxn).unwrap() {
        let (_, bytes) = entry.unwrap();
        std::hint::black_box(rmp_serde::from_slice::<FencedMap>(bytes).unwrap());
    }
    t.elapsed()
}

/// Opens (creating) an LMDB environment in `dir` with one database of string keys.
fn open_env(dir: std::path::PathBuf) -> (heed::Env, heed::Database<'static, heed::types::Str, heed::types::Bytes>) {
    use heed::types::{Bytes, Str};
    // SAFETY: one environment per directory in this process, opened once at a time.
    let env = unsafe { heed::EnvOpenOptions::new().map_size(1 << 30).max_dbs(1).open(&dir) }.unwrap();
    let wtxn = env.write_txn().unwrap();
    let db = env
        .create_databases_and_commit(wtxn, |dbo, w| -> heed::Result<_> {
            Ok(heed::CommitOrAbort::<_, ()>::Commit(dbo.create_database::<Str, Bytes>(w, Some("states"))?))
        })
        .unwrap()
        .unwrap_commit();
    (env, db)
}

criterion_group!(benches, bench);
criterion_main!(benches);
