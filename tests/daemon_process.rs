//! Sharded daemon process on in-process nodes: N workers, one instance each, spread over the
//! cluster; after a crash and after a graceful leave every worker runs again on the nodes that
//! remain, and the activation log shows no worker ever ran twice at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ddshard::activation::ActivationLog;
use ddshard::sharding::{DaemonContext, DaemonProcess};
use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{Node, ShardingSettings};

const CONVERGE: Duration = Duration::from_secs(30);
const WORKERS: usize = 6;

fn settings() -> ShardingSettings {
    ShardingSettings {
        retry_interval: Duration::from_millis(400),
        rebalance_interval: Duration::from_millis(500),
        handoff_timeout: Duration::from_secs(10),
        entity_restart_backoff: Duration::from_millis(300),
        min_nr_of_members: 3,
        ..ShardingSettings::default()
    }
}

/// Joins the process on `node`: each worker records its run in `log` (node, index) for as long
/// as its future lives.
async fn join(node: &Node, log: &ActivationLog) -> DaemonProcess {
    let (me, log) = (node.node_id().to_string(), log.clone());
    let worker = move |ctx: DaemonContext| {
        let (me, log) = (me.clone(), log.clone());
        async move {
            assert_eq!(ctx.count, WORKERS);
            let _running = log.started(&ctx.index.to_string(), &me, ctx.epoch);
            // A worker's work: here, waiting to be stopped (dropped at this await).
            std::future::pending::<()>().await;
        }
    };
    node.sharding().daemon_process("indexer", WORKERS, worker, settings()).await.unwrap()
}

/// Waits until every worker runs exactly on `nodes`, and returns index → node.
async fn all_running_on(process: &DaemonProcess, nodes: &[&str], what: &str) -> BTreeMap<usize, String> {
    let allowed: BTreeSet<String> = nodes.iter().map(ToString::to_string).collect();
    eventually(CONVERGE, what, || async {
        let workers = process.workers(Duration::from_secs(2)).await.ok()?;
        (workers.len() == WORKERS && workers.values().all(|n| allowed.contains(n))).then_some(workers)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_runs_once_spread_over_the_cluster_and_again_after_a_crash_and_a_leave() {
    let mut c = TestCluster::start_with(4, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let log = ActivationLog::new();
    let mut processes = Vec::new();
    for i in 0..4 {
        processes.push(join(c.node(i), &log).await);
    }
    assert_eq!(processes[0].type_name(), "daemon-indexer");
    let placed = all_running_on(&processes[1], &["n1", "n2", "n3", "n4"], "all 6 workers run").await;
    let hosts: BTreeSet<&String> = placed.values().collect();
    assert!(hosts.len() >= 3, "6 workers over 4 nodes take at least 3 of them: {placed:?}");
    // Each worker's future runs exactly once (one activation per index, none overlapping).
    eventually(CONVERGE, "each worker's future runs", || {
        let indexes: BTreeSet<String> = log.activations().iter().map(|a| a.entity_id.clone()).collect();
        std::future::ready((indexes.len() == WORKERS).then_some(()))
    })
    .await;

    // A crash: n4's workers start again on the others without any message.
    let on_n4: Vec<usize> = placed.iter().filter(|(_, n)| *n == "n4").map(|(i, _)| *i).collect();
    c.kill(3).await;
    let after_crash = all_running_on(&processes[0], &["n1", "n2", "n3"], "every worker runs after n4 crashed").await;
    for i in &on_n4 {
        assert_ne!(after_crash[i], "n4");
    }

    // A graceful leave of n3: its workers are handed off and run on n1 and n2.
    c.node(2).leave().await.unwrap();
    all_running_on(&processes[0], &["n1", "n2"], "every worker runs after n3 left").await;
    if let Err(v) = log.check() {
        panic!("a worker ran twice at once: {v:#?}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_returns_or_panics_runs_again_after_the_restart_backoff() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let runs = std::sync::Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let seen = runs.clone();
    let worker = move |ctx: DaemonContext| {
        let runs = seen.clone();
        // Worker 2 panics while its future is built, the first time only.
        let built_before = runs.lock().unwrap().iter().filter(|i| **i == 2).count();
        if ctx.index == 2 && built_before == 0 {
            runs.lock().unwrap().push(2);
            panic!("worker 2 fails before its future exists");
        }
        async move {
            let n = {
                let mut r = runs.lock().unwrap();
                r.push(ctx.index);
                r.iter().filter(|i| **i == ctx.index).count()
            };
            if ctx.index == 0 && n == 1 {
                panic!("worker 0 fails its first run");
            }
            if ctx.index == 1 && n <= 2 {
                return; // worker 1 ends twice by itself
            }
            std::future::pending::<()>().await;
        }
    };
    let s = ShardingSettings { min_nr_of_members: 1, ..settings() };
    let process = c.node(0).sharding().daemon_process("flaky", 3, worker, s).await.unwrap();
    eventually(CONVERGE, "workers 0 and 2 ran again after their panics, worker 1 after both returns", || {
        let r = runs.lock().unwrap().clone();
        let count = |i| r.iter().filter(|x| **x == i).count();
        std::future::ready((count(0) == 2 && count(1) == 3 && count(2) == 2).then_some(()))
    })
    .await;
    // Still one instance each: the restarts are of the future, not new entities elsewhere.
    assert_eq!(process.workers(Duration::from_secs(2)).await.unwrap().len(), 3);
    c.shutdown().await;
}
