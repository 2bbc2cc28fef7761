//! Passivation strategies under a Zipf workload: for each strategy at the same active-entity
//! limit, the hit rate (messages that found their entity running, so no new incarnation) and
//! the node's RSS growth, beside the same run without passivation (every entity touched stays
//! running: the hit-rate ceiling and the memory it costs). Each strategy runs in its own
//! process (this binary, re-executed), so one's freed memory does not flatter the next.
//!
//! `cargo bench --bench passivation` (`DDSHARD_BENCH_QUICK=1`: a small run).

use std::time::{Duration, Instant};

mod common;
use common::sliding;
use ddshard::sharding::{PassivationAdmission, PassivationSettings, PassivationStrategy, ReplacementPolicy};
use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardingSettings};
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// A small entity with some state, like a session.
#[derive(Default)]
struct Session {
    hits: u64,
}

#[derive(Serialize, Deserialize)]
struct Touch;

impl Entity for Session {
    type Message = Touch;
    type Reply = u64;
    async fn handle(&mut self, _msg: Touch, _ctx: &mut EntityContext) -> u64 {
        self.hits += 1;
        self.hits
    }
}

/// The strategies compared, by name: (strategy, replacement, admission).
const STRATEGIES: [(&str, PassivationStrategy, ReplacementPolicy, PassivationAdmission); 7] = [
    ("none", PassivationStrategy::None, ReplacementPolicy::Lru, PassivationAdmission::None),
    ("lru", PassivationStrategy::ActiveEntityLimit, ReplacementPolicy::Lru, PassivationAdmission::None),
    ("slru", PassivationStrategy::ActiveEntityLimit, ReplacementPolicy::Slru, PassivationAdmission::None),
    ("mru", PassivationStrategy::ActiveEntityLimit, ReplacementPolicy::Mru, PassivationAdmission::None),
    ("lfu", PassivationStrategy::ActiveEntityLimit, ReplacementPolicy::Lfu, PassivationAdmission::None),
    (
        "lru+window-tinylfu",
        PassivationStrategy::ActiveEntityLimit,
        ReplacementPolicy::Lru,
        PassivationAdmission::WindowTinylfu,
    ),
    (
        "slru+window-tinylfu",
        PassivationStrategy::ActiveEntityLimit,
        ReplacementPolicy::Slru,
        PassivationAdmission::WindowTinylfu,
    ),
];

const CHILD_ENV: &str = "DDSHARD_BENCH_PASSIVATION_CHILD";
const IN_FLIGHT: usize = 64;
const SHARDS: u32 = 50;

struct Shape {
    ids: usize,
    messages: usize,
    limit: usize,
}

/// The run's size; `DDSHARD_BENCH_MESSAGES` sets the number of asks (to see that memory under
/// a limit stays flat however long the churn goes on).
fn shape() -> Shape {
    let messages = std::env::var("DDSHARD_BENCH_MESSAGES").ok().and_then(|m| m.parse().ok());
    Shape {
        ids: common::sized(200_000, 5_000),
        messages: messages.unwrap_or_else(|| common::sized(1_000_000, 20_000)),
        limit: common::sized(10_000, 500),
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

/// Ids drawn from a Zipf distribution (exponent 1) over `n` ranks: the inverse of its CDF,
/// by binary search, from a fixed seed (every strategy sees the same sequence).
fn zipf_sequence(n: usize, count: usize) -> Vec<u32> {
    let mut cdf = Vec::with_capacity(n);
    let mut sum = 0.0;
    for rank in 1..=n {
        sum += 1.0 / rank as f64;
        cdf.push(sum);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    (0..count)
        .map(|_| {
            let u = rng.random::<f64>() * sum;
            cdf.partition_point(|c| *c < u) as u32
        })
        .collect()
}

/// One strategy in this process: prints `RESULT <name> <messages> <starts> <rss bytes> <secs>`.
fn child(name: &str) {
    let (_, strategy, replacement, admission) =
        *STRATEGIES.iter().find(|s| s.0 == name).unwrap_or_else(|| panic!("unknown strategy {name}"));
    let Shape { ids, messages, limit } = shape();
    let sequence = zipf_sequence(ids, messages);
    let rt = common::runtime();
    let mut cluster = rt.block_on(async {
        let c = TestCluster::start(1).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        c
    });
    let settings = ShardingSettings {
        number_of_shards: SHARDS,
        passivation: PassivationSettings {
            idle_timeout: None,
            strategy,
            active_entity_limit: limit,
            replacement,
            admission,
            ..PassivationSettings::default()
        },
        ..ShardingSettings::default()
    };
    let region = rt.block_on(async {
        let r = cluster.node(0).sharding().start("session", |_: &str| Session::default(), settings).await.unwrap();
        // Every shard exists before the measure: only entities are counted.
        sliding(SHARDS as usize * 20, IN_FLIGHT, |i| {
            let r = r.clone();
            async move {
                r.ask(&format!("warm-{i}"), Touch).await.unwrap();
            }
        })
        .await;
        r
    });
    let starts_before = region.counters().entity_starts;
    let rss_before = rss_bytes();
    let t = Instant::now();
    rt.block_on(sliding(messages, IN_FLIGHT, |i| {
        let r = region.clone();
        let id = format!("session-{:07}", sequence[i]);
        async move {
            r.ask(&id, Touch).await.unwrap();
        }
    }));
    let secs = t.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let rss = rss_bytes().saturating_sub(rss_before);
    let starts = region.counters().entity_starts - starts_before;
    let running: usize = rt.block_on(region.region_stats()).unwrap().values().sum();
    if strategy == PassivationStrategy::ActiveEntityLimit {
        assert!(running <= limit, "{name}: {running} running over the limit {limit}");
    }
    println!("RESULT {name} {messages} {starts} {rss} {secs:.3} {running}");
    rt.block_on(cluster.shutdown());
}

struct Outcome {
    hit_rate: f64,
    rss: f64,
    rate: f64,
    running: usize,
}

fn run_child(name: &str) -> Outcome {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, name)
        .output()
        .unwrap_or_else(|e| panic!("running the {name} child: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{name} child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line =
        stdout.lines().find(|l| l.starts_with("RESULT ")).unwrap_or_else(|| panic!("{name}: no RESULT in {stdout}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    let (messages, starts): (f64, f64) = (f[2].parse().unwrap(), f[3].parse().unwrap());
    Outcome {
        hit_rate: 1.0 - starts / messages,
        rss: f[4].parse().unwrap(),
        rate: messages / f[5].parse::<f64>().unwrap(),
        running: f[6].parse().unwrap(),
    }
}

fn main() {
    if let Ok(name) = std::env::var(CHILD_ENV) {
        child(&name);
        return;
    }
    let Shape { ids, messages, limit } = shape();
    println!("worker threads: {} (in each strategy's child process)", common::workers());
    println!(
        "Zipf (s = 1) over {ids} ids, {messages} asks with {IN_FLIGHT} in flight, {SHARDS} shards, active-entity limit {limit} per region"
    );
    let unlimited = run_child("none");
    println!(
        "none (no passivation; the baseline): hit rate {:.3}, {} running, RSS +{:.1} MB, {:.0} asks/s",
        unlimited.hit_rate,
        unlimited.running,
        unlimited.rss / 1e6,
        unlimited.rate
    );
    for (name, ..) in &STRATEGIES[1..] {
        if !common::part(name) {
            continue;
        }
        let o = run_child(name);
        assert!(o.running <= limit, "{name}: the limit held");
        println!(
            "{name}: hit rate {:.3}, {} running, RSS +{:.1} MB, {:.0} asks/s",
            o.hit_rate,
            o.running,
            o.rss / 1e6,
            o.rate
        );
        println!(
            "ratio=hit_rate_{name}_vs_unlimited {:.3} ({:.3} vs baseline {:.3})",
            o.hit_rate / unlimited.hit_rate,
            o.hit_rate,
            unlimited.hit_rate
        );
        common::print_ratio_of(&format!("rss_{name}_vs_unlimited"), o.rss, unlimited.rss);
        common::print_ratio(&format!("asks_{name}_vs_unlimited"), o.rate, unlimited.rate);
    }
}
