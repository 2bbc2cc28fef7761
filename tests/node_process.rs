//! `ddshard node` as real processes: the client line protocol, SIGKILL of nodes (the
//! coordinator's host first) with remembered entities running again without a message,
//! SIGTERM leaving gracefully, and the sample `kv` type's durable values across rebalance,
//! leave, SIGKILL and a full-cluster restart.

use std::path::Path;
use std::time::{Duration, Instant};

use ddshard::testkit::process::{NodeProcess, ProcessOptions, stats_by_node, stats_total};

/// Failure detection (phi 10 at 150 ms gossip: about 1 s), then the test's downing timers.
const DETECTION: Duration = Duration::from_millis(1000);
const STABLE_AFTER: Duration = Duration::from_millis(1500);
const MARGIN: Duration = Duration::from_millis(1000);
const SLACK: Duration = Duration::from_secs(5);

fn spawn(dir: &Path, id: &str, seeds: &[&NodeProcess], sharding: &str) -> NodeProcess {
    let mut o = ProcessOptions::new(id, "proc-test", dir);
    o.activation_log = Some(dir.join(format!("activations-{id}.log")));
    o.seeds = seeds.iter().map(|s| s.gossip).collect();
    o.membership_toml = format!("stable_after = \"{STABLE_AFTER:?}\"\ndown_removal_margin = \"{MARGIN:?}\"");
    o.sharding_toml = format!("number_of_shards = 20\nretry_interval = \"400ms\"\n{sharding}");
    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
}

async fn ask(n: &NodeProcess, request: &str) -> String {
    n.call(request, Duration::from_secs(10)).await.unwrap()
}

/// The member listed first by `MEMBERS` (oldest first): the coordinator's host.
async fn oldest(n: &NodeProcess) -> String {
    let a = ask(n, "MEMBERS").await;
    a.split_whitespace().nth(1).and_then(|m| m.split(':').next()).unwrap_or_else(|| panic!("{a}")).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_node_entities_answer_again_from_the_survivor_and_sigterm_leaves_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = spawn(dir.path(), "n1", &[], "");
    let mut n2 = spawn(dir.path(), "n2", &[&n1], "");
    n1.until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 2).await;
    assert!(ask(&n1, "BOGUS").await.starts_with("ERR"));
    assert!(ask(&n1, "GET").await.starts_with("ERR"), "a missing id is a typed error");
    for i in 0..20 {
        assert!(ask(&n2, &format!("PUT k{i} v{i}")).await.starts_with("OK "));
    }
    let mut on_n2 = 0;
    for i in 0..20 {
        let a = ask(&n1, &format!("GET k{i}")).await;
        assert!(a.starts_with("VALUE ") && a.ends_with(&format!(" v{i}")), "{a}");
        on_n2 += usize::from(a.split_whitespace().nth(1) == Some("n2"));
    }
    assert!(on_n2 > 0, "n2 hosts some entities");
    let killed = Instant::now();
    n2.kill();
    let bound = DETECTION + STABLE_AFTER + MARGIN + SLACK;
    for i in 0..20 {
        // The value is durable: it comes back with the entity (kv keeps its state).
        n1.until(&format!("GET k{i}"), bound.saturating_sub(killed.elapsed()), |a| {
            a.starts_with("VALUE n1") && a.ends_with(&format!(" v{i}"))
        })
        .await;
    }
    println!("all 20 entities answered from n1 {:?} after SIGKILL of n2", killed.elapsed());
    let status = n1.terminate(Duration::from_secs(30)).await.unwrap();
    assert!(status.success(), "graceful exit: {status}");
}

/// `n` processes with remembered entities; SIGKILL the coordinator's host, then a
/// non-coordinator; each time every remembered entity runs again on the survivors, with no
/// message sent, within detection + stable_after + margin + 5 s, and then answers.
async fn sigkill_coordinator_host_then_another(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let remember = format!("remember_entities = true\nmin_nr_of_members = {n}\n");
    let mut nodes: Vec<NodeProcess> = Vec::new();
    for i in 0..n {
        let seeds: Vec<&NodeProcess> = nodes.first().into_iter().collect();
        let p = spawn(dir.path(), &format!("n{}", i + 1), &seeds, &remember);
        nodes.push(p);
    }
    nodes[1].until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == n).await;
    let ids = 10 * n;
    for i in 0..ids {
        let a = ask(&nodes[i % n], &format!("PUT r{i} v")).await;
        assert!(a.starts_with("OK "), "{a}");
    }
    assert_eq!(stats_total(&ask(&nodes[1], "STATS").await), Some(ids));
    let bound = DETECTION + STABLE_AFTER + MARGIN + SLACK;

    // First the coordinator's host, then the youngest (never the coordinator).
    let coordinator = oldest(&nodes[1]).await;
    let first = nodes.iter().position(|p| p.node_id == coordinator).unwrap();
    let second = n - 1;
    assert_ne!(first, second);
    let mut killed_at = Vec::new();
    for (round, victim) in [first, second].into_iter().enumerate() {
        let victim_id = nodes[victim].node_id.clone();
        let hosted = stats_by_node(&ask(&nodes[victim], "STATS").await)
            .into_iter()
            .find(|(node, _)| *node == victim_id)
            .map_or(0, |(_, c)| c);
        assert!(hosted > 0, "{victim_id} hosts entities before it is killed");
        let killed = Instant::now();
        nodes[victim].kill();
        killed_at.push((victim_id.clone(), std::time::SystemTime::now()));
        let watcher = (0..n).find(|i| *i != first && *i != victim).unwrap();
        let gone = format!(" {victim_id}=");
        nodes[watcher].until("STATS", bound, |a| stats_total(a) == Some(ids) && !a.contains(&gone)).await;
        let running = killed.elapsed();
        println!(
            "{n} processes, SIGKILL of {victim_id}{}: its {hosted} remembered entities running again on the \
             survivors after {running:?} (no message sent)",
            if round == 0 { " (coordinator host)" } else { "" }
        );
        assert!(running <= bound, "took {running:?}, bound {bound:?}");
        for i in 0..ids {
            // The value was in memory on the killed node; only the id is remembered.
            nodes[watcher]
                .until(&format!("GET r{i}"), bound, |a| a.starts_with("VALUE ") || a.starts_with("NONE "))
                .await;
        }
    }
    // The activation logs of all processes: a killed process's activations ended when it was
    // killed; none overlaps another activation of its id, and epochs grew with every move.
    let logs: Vec<_> = (1..=n).map(|i| dir.path().join(format!("activations-n{i}.log"))).collect();
    let mut acts = ddshard::activation::ActivationLog::load(&logs).unwrap();
    for a in acts.iter_mut() {
        if let Some((_, t)) = killed_at.iter().find(|(node, _)| *node == a.node) {
            a.stop.get_or_insert(*t);
        }
    }
    let on_survivors: std::collections::BTreeSet<&str> = acts
        .iter()
        .filter(|a| killed_at.iter().all(|(node, _)| *node != a.node))
        .map(|a| a.entity_id.as_str())
        .collect();
    assert_eq!(on_survivors.len(), ids, "every id ran on a survivor");
    // Each id a killed process ran started again on another node afterwards.
    for a in acts.iter().filter(|a| killed_at.iter().any(|(node, _)| *node == a.node)) {
        assert!(
            acts.iter().any(|b| b.entity_id == a.entity_id && b.node != a.node && b.start >= a.start),
            "{} ran on killed {} and never started elsewhere afterwards",
            a.entity_id,
            a.node
        );
    }
    if let Err(v) = ddshard::activation::check_activations(&acts) {
        panic!("overlapping activations across SIGKILL fail-over: {v:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_sigkill_the_coordinator_host_then_another_and_remembered_entities_run_without_a_message() {
    sigkill_coordinator_host_then_another(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_processes_sigkill_the_coordinator_host_then_another_and_remembered_entities_run_without_a_message() {
    sigkill_coordinator_host_then_another(5).await;
}

/// Every `k<i>` answers `v<i>` through `n` (asked until it does: a request caught by a
/// hand-off or a node's death is lost, as documented), within `within`.
async fn all_values_answer(n: &NodeProcess, keys: usize, within: Duration, when: &str) -> Vec<String> {
    let mut hosts = Vec::new();
    for i in 0..keys {
        let a = n.until(&format!("GET k{i}"), within, |a| a.starts_with("VALUE ")).await;
        assert!(a.ends_with(&format!(" v{i}")), "{when}: k{i} answered {a:?}, expected v{i}");
        hosts.push(a.split_whitespace().nth(1).unwrap_or_default().to_string());
    }
    hosts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_values_survive_rebalance_graceful_leave_sigkill_and_a_full_cluster_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys = 30;
    let within = DETECTION + STABLE_AFTER + MARGIN + SLACK + Duration::from_secs(20);
    let mut n1 = spawn(dir.path(), "n1", &[], "");
    n1.until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 1).await;
    for i in 0..keys {
        assert!(ask(&n1, &format!("PUT k{i} v{i}")).await.starts_with("OK n1 "));
    }

    // Rebalance: two more nodes join and take shards over; each loads the states it gets.
    let mut n2 = spawn(dir.path(), "n2", &[&n1], "");
    let mut n3 = spawn(dir.path(), "n3", &[&n1], "");
    n1.until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 3).await;
    let deadline = Instant::now() + within;
    loop {
        let hosts = all_values_answer(&n1, keys, within, "after the rebalance").await;
        if hosts.iter().any(|h| h != "n1") {
            break;
        }
        assert!(Instant::now() < deadline, "no shard moved off n1");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // Graceful leave of n2: its shards are handed off with their states.
    assert!(n2.terminate(Duration::from_secs(30)).await.unwrap().success());
    n1.until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 2 && !a.contains("n2:")).await;
    all_values_answer(&n1, keys, within, "after n2 left").await;

    // SIGKILL of n3: downed, its shards start on n1 from the states on disk and in n1's replica.
    n3.kill();
    let hosts = all_values_answer(&n1, keys, within, "after SIGKILL of n3").await;
    assert!(hosts.iter().all(|h| h == "n1"), "{hosts:?}");

    // Full-cluster restart: every process gone, then all three start again on their data dirs.
    n1.kill();
    drop((n1, n2, n3));
    let n1 = spawn(dir.path(), "n1", &[], "");
    let n2 = spawn(dir.path(), "n2", &[&n1], "");
    let n3 = spawn(dir.path(), "n3", &[&n1], "");
    n1.until("MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 3).await;
    all_values_answer(&n2, keys, within, "after a full-cluster restart").await;
    drop(n3);
}
