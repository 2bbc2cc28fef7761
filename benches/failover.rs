//! Fail-over time after SIGKILL: three `ddshard node` processes (release build) with
//! remembered entities; one is killed and the clock runs until every entity it hosted answers
//! again from a survivor. One sample is one whole run (cluster start excluded), so criterion's
//! median is the median over runs.
//!
//! Baseline, measured in the same run: the time until a survivor's membership drops the killed
//! member (failure detection + `stable_after` + the down decision's gossip +
//! `down_removal_margin`), which is when its shards may move at all. The `ratio=` line gives
//! the fail-over's median over that median: what sharding adds to membership's own floor
//! (re-allocation, remembered-entity reads, restarts, the client's retry).
//!
//! `cargo bench --bench failover`

use std::path::Path;
use std::time::{Duration, Instant};

mod common;
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use ddshard::admin::MemberInfo;
use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions, admin_request_to, kv_get_at};

const NODES: usize = 3;
const IDS: usize = 60;
const STABLE_AFTER: Duration = Duration::from_millis(1500);
const MARGIN: Duration = Duration::from_millis(1000);
const DETECTION_ESTIMATE: Duration = Duration::from_millis(1000);
const RUNS: usize = 10;

fn spawn(dir: &Path, i: usize, seeds: &[&NodeProcess]) -> NodeProcess {
    let mut o = ProcessOptions::new(&format!("n{}", i + 1), "failover-bench", dir);
    o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
    o.membership_toml = format!("stable_after = \"{STABLE_AFTER:?}\"\ndown_removal_margin = \"{MARGIN:?}\"");
    o.sharding_toml = format!(
        "number_of_shards = 30\nmin_nr_of_members = {NODES}\nretry_interval = \"400ms\"\n[sharding.remember]\nenabled = true\n"
    );
    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).expect("node starts")
}

/// One run: start the cluster, place the entities, SIGKILL `victim` (0 = the oldest, which
/// hosts the coordinator), time until every entity it hosted answers from a survivor.
async fn one_run(victim: usize) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<NodeProcess> = Vec::new();
    for i in 0..NODES {
        let seeds: Vec<&NodeProcess> = nodes.first().into_iter().collect();
        let p = spawn(dir.path(), i, &seeds);
        nodes.push(p);
    }
    nodes[1].until_up(NODES, Duration::from_secs(30), |_| true).await;
    let victim_id = format!("n{}", victim + 1);
    for k in 0..IDS {
        nodes[k % NODES].kv_put(&format!("e{k}"), "v").await.unwrap();
    }
    let stats = async |n: &NodeProcess| n.kv_stats().await;
    nodes[1].until("all entities counted", Duration::from_secs(30), stats, |s: &KvStats| s.total() == Some(IDS)).await;
    // Where each entity is now (not where the PUT found it: a rebalance may have moved it).
    let mut on_victim = Vec::new();
    for k in 0..IDS {
        if nodes[1].kv_get(&format!("e{k}")).await.unwrap().node == victim_id {
            on_victim.push(format!("e{k}"));
        }
    }
    assert!(!on_victim.is_empty(), "{victim_id} hosts entities");
    let survivor = nodes[if victim == 1 { 2 } else { 1 }].admin;
    let killed = Instant::now();
    nodes[victim].kill();
    let removal = tokio::spawn(until_removed(survivor, victim_id.clone(), killed));
    let mut waits = Vec::new();
    for id in on_victim {
        let victim_id = victim_id.clone();
        waits.push(tokio::spawn(async move {
            loop {
                let a = kv_get_at(survivor, &id).await;
                if a.as_ref().is_ok_and(|a| a.node != victim_id) {
                    return;
                }
                assert!(killed.elapsed() < Duration::from_secs(60), "{id} never answered again: {a:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    for w in waits {
        w.await.unwrap();
    }
    let failover = killed.elapsed();
    Run { failover, removed: removal.await.unwrap() }
}

/// One run's two clocks, both from the SIGKILL.
struct Run {
    /// Until every entity the victim hosted answered from a survivor.
    failover: Duration,
    /// Until the survivor's membership no longer listed the victim (the baseline).
    removed: Duration,
}

/// Polls `survivor`'s member list every 10 ms until `victim` is no longer in it.
async fn until_removed(survivor: std::net::SocketAddr, victim: String, killed: Instant) -> Duration {
    loop {
        let (status, body) = admin_request_to(survivor, "GET", "/cluster/members", "").await.unwrap();
        assert_eq!(status, 200, "{body}");
        let members: Vec<MemberInfo> = serde_json::from_str(&body).unwrap();
        if !members.iter().any(|m| m.node_id == victim) {
            return killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(60), "{victim} still listed: {members:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn failover(c: &mut Criterion) {
    let rt = common::runtime();
    let configured = DETECTION_ESTIMATE + STABLE_AFTER + MARGIN;
    let mut group = c.benchmark_group("failover_after_sigkill");
    group.sample_size(RUNS).sampling_mode(SamplingMode::Flat);
    group.warm_up_time(Duration::from_millis(1)).measurement_time(Duration::from_secs(1));
    for (name, victim) in [("non_coordinator_node", 2), ("coordinator_host", 0)] {
        let mut runs = Vec::new();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let run = rt.block_on(one_run(victim));
                    total += run.failover;
                    runs.push(run);
                }
                total
            })
        });
        // The first run is criterion's warm-up (cold caches, fresh binaries); `--test` (CI's
        // smoke run) makes just one.
        let runs = if runs.len() > 1 { runs.split_off(1) } else { runs };
        let mut failovers: Vec<Duration> = runs.iter().map(|r| r.failover).collect();
        let mut removals: Vec<Duration> = runs.iter().map(|r| r.removed).collect();
        let (m, removed) = (median(&mut failovers), median(&mut removals));
        println!(
            "{name}: {} runs, median {m:.2?} (min {:.2?}, max {:.2?}); the victim left the survivor's membership \
             after a median {removed:.2?} (settings: detection ~{DETECTION_ESTIMATE:?} + stable_after \
             {STABLE_AFTER:?} + margin {MARGIN:?} = {configured:?})",
            failovers.len(),
            failovers[0],
            failovers[failovers.len() - 1],
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        common::print_ratio_of(&format!("failover_{name}_vs_membership_removal"), ms(m), ms(removed));
    }
    group.finish();
}

criterion_group!(benches, failover);
criterion_main!(benches);
