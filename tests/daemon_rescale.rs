//! Rescaling a sharded daemon process (`DaemonProcess::set_count`): whole nodes in virtual
//! time. Every worker's run is recorded with its index, revision and count, its start and end
//! numbered in the order they happened (the nodes are stepped on one thread, so the order is
//! total); no two runs of one index overlap, nor runs of two revisions.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::sharding::{DaemonContext, DaemonProcess, DaemonScale};
use ddshard::testkit::eventually;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{Error, ShardingSettings};
use std::sync::atomic::{AtomicU64, Ordering};

const RESCALE: Duration = Duration::from_secs(60);

/// One run of a worker future.
#[derive(Debug, Clone)]
struct Run {
    index: usize,
    revision: u64,
    count: usize,
    node: String,
    start: u64,
    end: Option<u64>,
}

/// Every run, and the nodes that crashed (their runs end at the crash).
#[derive(Clone, Default)]
struct Runs {
    runs: Arc<Mutex<Vec<Run>>>,
    dead: Arc<Mutex<BTreeSet<String>>>,
    /// Numbers the starts and ends in the order they happen.
    events: Arc<AtomicU64>,
}

/// Ends its run when the worker future is dropped.
struct Running {
    runs: Runs,
    at: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut runs = self.runs.runs.lock().unwrap();
        let run = &mut runs[self.at];
        if run.end.is_none() && !self.runs.dead.lock().unwrap().contains(&run.node) {
            run.end = Some(self.runs.next());
        }
    }
}

impl Runs {
    fn started(&self, ctx: &DaemonContext, node: &str) -> Running {
        let mut runs = self.runs.lock().unwrap();
        runs.push(Run {
            index: ctx.index,
            revision: ctx.revision,
            count: ctx.count,
            node: node.to_string(),
            start: self.next(),
            end: None,
        });
        Running { runs: self.clone(), at: runs.len() - 1 }
    }

    fn next(&self) -> u64 {
        self.events.fetch_add(1, Ordering::SeqCst)
    }

    /// `node` crashes now: its runs end here.
    fn crashed(&self, node: &str) {
        self.dead.lock().unwrap().insert(node.to_string());
        let now = self.next();
        for run in self.runs.lock().unwrap().iter_mut().filter(|r| r.node == node && r.end.is_none()) {
            run.end = Some(now);
        }
    }

    /// No two overlapping runs of one index, of two revisions, or of two counts.
    fn check(&self) {
        let runs = self.runs.lock().unwrap().clone();
        for (i, a) in runs.iter().enumerate() {
            for b in &runs[i + 1..] {
                let overlap = a.start < b.end.unwrap_or(u64::MAX) && b.start < a.end.unwrap_or(u64::MAX);
                if overlap {
                    assert_ne!(a.index, b.index, "two runs of one index at once: {a:?} and {b:?}");
                    assert_eq!(a.revision, b.revision, "runs of two revisions at once: {a:?} and {b:?}");
                    assert_eq!(a.count, b.count, "runs with two counts at once: {a:?} and {b:?}");
                }
            }
        }
    }

    /// The runs going on: (index, revision, count).
    fn live(&self) -> BTreeSet<(usize, u64, usize)> {
        let runs = self.runs.lock().unwrap();
        runs.iter().filter(|r| r.end.is_none()).map(|r| (r.index, r.revision, r.count)).collect()
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings { number_of_shards: 16, min_nr_of_members: 2, ..ShardingSettings::default() }
}

async fn join(cluster: &VirtualCluster, i: usize, runs: &Runs, count: usize) -> Result<DaemonProcess, Error> {
    let runs = runs.clone();
    let node = VirtualCluster::node_id(i);
    let start = move |n: ddshard::Node| async move {
        let worker = move |ctx: DaemonContext| {
            let (runs, node) = (runs.clone(), node.clone());
            async move {
                let _running = runs.started(&ctx, &node);
                std::future::pending::<()>().await;
            }
        };
        n.sharding().daemon_process("feed", count, worker, settings()).await
    };
    cluster.on_node(i, start).await.expect("the node runs")
}

/// Starts the process with `count` workers on nodes `0..nodes` once the cluster converged,
/// and waits for its workers; the record of runs and each node's handle.
async fn started(cluster: &VirtualCluster, nodes: usize, count: usize) -> (Runs, Vec<DaemonProcess>) {
    cluster.await_converged(Duration::from_secs(30)).await;
    let runs = Runs::default();
    let mut processes = Vec::new();
    for i in 0..nodes {
        processes.push(join(cluster, i, &runs, count).await.unwrap());
    }
    await_live(&runs, count, 0).await;
    (runs, processes)
}

/// Waits until exactly workers `0..count` of `revision` run, each once.
async fn await_live(runs: &Runs, count: usize, revision: u64) {
    let expected: BTreeSet<(usize, u64, usize)> = (0..count).map(|i| (i, revision, count)).collect();
    eventually(RESCALE, &format!("workers 0..{count} of revision {revision} run"), || {
        std::future::ready((runs.live() == expected).then_some(()))
    })
    .await;
}

async fn set_count(cluster: &VirtualCluster, i: usize, p: &DaemonProcess, count: usize) -> Result<DaemonScale, Error> {
    let p = p.clone();
    cluster.on_node(i, move |_| async move { p.set_count(count, RESCALE).await }).await.expect("the node runs")
}

/// Issue 42, step 4. Three nodes run a process of 3 workers; it is rescaled to 5, 2 and 4 from
/// different nodes. After each rescale exactly the workers of the new count run, each once,
/// with the new revision and count; at no instant did two runs of one index, or of two
/// revisions, overlap.
#[test]
fn rescaling_a_daemon_process_never_runs_an_index_twice_nor_two_revisions_at_once() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        let (runs, processes) = started(&cluster, 3, 3).await;
        for (revision, (node, count)) in [(0, 5), (1, 2), (2, 4)].into_iter().enumerate() {
            let scale = set_count(&cluster, node, &processes[node], count).await.unwrap();
            let revision = revision as u64 + 1;
            assert_eq!(scale, DaemonScale { revision, count, rescaling_to: None });
            await_live(&runs, count, revision).await;
            runs.check();
        }
        // The count lives in the cluster: every node reports it, and a worker list has 4.
        let p = processes[2].clone();
        let (scale, workers) = cluster
            .on_node(2, move |_| async move { (p.scale().await, p.workers(Duration::from_secs(5)).await) })
            .await
            .unwrap();
        assert_eq!(scale.unwrap().count, 4);
        assert_eq!(workers.unwrap().keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
        // Asking for the count it has already changes nothing.
        let same = set_count(&cluster, 0, &processes[0], 4).await.unwrap();
        assert_eq!(same, DaemonScale { revision: 3, count: 4, rescaling_to: None });
        runs.check();
    });
}

/// The node that hosts the process's `scale` entity crashes just as a rescale starts; once
/// it is downed, the entity's next incarnation resumes the rescale from its recorded
/// revision, and the invariants hold throughout.
#[test]
fn a_rescale_whose_driver_crashes_is_resumed_by_its_next_incarnation() {
    VirtualRun::new(4).run(|cluster: VirtualCluster| async move {
        let (runs, processes) = started(&cluster, 4, 4).await;
        let located = cluster
            .on_node(0, |n| async move { n.sharding().region("daemon-feed").unwrap().locate("scale").await })
            .await
            .unwrap()
            .unwrap();
        let home = located.home.unwrap().split('#').next().unwrap().to_string();
        let home_index = (0..4).find(|i| VirtualCluster::node_id(*i) == home).unwrap();
        let asker = (home_index + 1) % 4;
        // The rescale is accepted (not waited for); the driver's node crashes before it is done.
        let p = processes[asker].clone();
        let started = cluster.on_node(asker, move |_| async move { p.set_count(7, Duration::ZERO).await });
        assert_eq!(started.await.unwrap().unwrap(), DaemonScale { revision: 1, count: 4, rescaling_to: Some(7) });
        assert_ne!(runs.live(), (0..7).map(|i| (i, 1, 7)).collect(), "the crash comes before the rescale is done");
        runs.crashed(&home);
        cluster.crash(home_index).await;
        cluster.on_node(asker, move |n| async move { n.down(&home).await }).await.unwrap().unwrap();
        let p = processes[asker].clone();
        eventually(RESCALE, "the rescale to 7 completes", || {
            let p = p.clone();
            let on = cluster.on_node(asker, move |_| async move { p.scale().await });
            async move { on.await.and_then(Result::ok).filter(|s| s.count == 7 && s.rescaling_to.is_none()) }
        })
        .await;
        await_live(&runs, 7, 1).await;
        runs.check();
    });
}

/// A rescale to 0 workers, or past the most the process may have (its `number_of_shards`), is
/// a typed error naming the value; nothing changes.
#[test]
fn a_rescale_to_zero_or_past_the_shard_count_is_refused_naming_the_value() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        let (runs, processes) = started(&cluster, 3, 3).await;
        for count in [0, 17] {
            match set_count(&cluster, 0, &processes[0], count).await {
                Err(Error::BadRequest(m)) => {
                    assert!(m.contains(&format!("count of {count}")) && m.contains("1..=16"), "{m}")
                }
                other => panic!("{count}: {other:?}"),
            }
        }
        assert_eq!(runs.live(), (0..3).map(|i| (i, 0, 3)).collect());
    });
}

/// The node of one old worker is paused (a stopped process) as a rescale starts: the workers
/// of the new revision start only once it has resumed and its worker has ended, not beside it.
#[test]
fn a_rescale_starts_no_new_worker_while_an_old_one_on_a_paused_node_still_runs() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        let (runs, processes) = started(&cluster, 3, 3).await;
        let scale_home = cluster
            .on_node(0, |n| async move { n.sharding().region("daemon-feed").unwrap().locate("scale").await })
            .await
            .unwrap()
            .unwrap()
            .home
            .unwrap();
        // A node that runs a worker and neither hosts `scale` nor asks.
        let paused = runs
            .runs
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.node.clone())
            .find(|n| !scale_home.starts_with(&format!("{n}#")) && n != "n1")
            .expect("a worker runs on another node");
        let paused_index = (0..3).find(|i| VirtualCluster::node_id(*i) == paused).unwrap();
        cluster.pause(paused_index, Duration::from_secs(2));
        set_count(&cluster, 0, &processes[0], 5).await.unwrap();
        await_live(&runs, 5, 1).await;
        runs.check();
    });
}

/// A node that starts the process with another count than the cluster's is refused: its
/// calls fail with an error naming the setting that holds the count and both values, it runs
/// no worker, and the others go on.
#[test]
fn a_node_started_with_another_count_is_refused_with_an_error_naming_both_counts() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let runs = Runs::default();
        let mut processes = Vec::new();
        for i in 0..2 {
            processes.push(join(&cluster, i, &runs, 3).await.unwrap());
        }
        let odd = join(&cluster, 2, &runs, 4).await.unwrap();
        let refusal = eventually(RESCALE, "n3's calls are refused", || {
            let odd = odd.clone();
            let on = cluster.on_node(2, move |_| async move { odd.scale().await });
            async move {
                match on.await? {
                    Err(Error::NotDelivered { reason, .. }) if reason.contains("refused") => Some(reason),
                    _ => None,
                }
            }
        })
        .await;
        assert!(refusal.contains("number_of_shards") && refusal.contains('4') && refusal.contains('3'), "{refusal}");
        await_live(&runs, 3, 0).await;
        assert!(runs.runs.lock().unwrap().iter().all(|r| r.node != "n3"), "the refused node runs no worker");
        let scale = set_count(&cluster, 1, &processes[1], 2).await.unwrap();
        assert_eq!(scale.count, 2, "the others go on");
    });
}
