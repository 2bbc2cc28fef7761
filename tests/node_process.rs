//! `ddshard node` as real processes: the admin HTTP API, SIGKILL of nodes (the
//! coordinator's host first) with remembered entities running again without a message,
//! SIGTERM leaving gracefully, and the sample `kv` type's durable values across rebalance,
//! leave, SIGKILL and a full-cluster restart.

use std::path::Path;
use std::time::{Duration, Instant};

use ddshard::service::KvReply;
use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions};

/// The processes' downing timers (short, for tests).
const STABLE_AFTER: Duration = Duration::from_millis(1500);
const MARGIN: Duration = Duration::from_millis(1000);
/// How long a test waits for the cluster to recover from a kill before it fails: a deadline, not
/// a speed promise (detection about 1 s, then the downing timers above; how fast recovery is,
/// is measured by `benches/failover.rs`, whose figures the README quotes).
const RECOVERY_DEADLINE: Duration = Duration::from_secs(60);

/// The admin token of the test processes (mutating admin routes on).
const ADMIN_TOKEN: &str = "node-process-test-admin-token-0123456789";

/// Runs `ddshard admin --url <n's admin API> <args>` as an operator would: whether it
/// succeeded, and its stdout and stderr.
fn admin_cli_run(n: &NodeProcess, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ddshard"))
        .args(["admin", "--url", &format!("http://{}", n.admin)])
        .args(args)
        .env("DDSHARD_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// [`admin_cli_run`] that must succeed; returns its output.
fn admin_cli(n: &NodeProcess, args: &[&str]) -> String {
    let (ok, text) = admin_cli_run(n, args);
    assert!(ok, "ddshard admin {args:?}: {text}");
    text
}

fn spawn(dir: &Path, id: &str, seeds: &[&NodeProcess], sharding: &str) -> NodeProcess {
    spawn_with(dir, id, seeds, sharding, "")
}

/// [`spawn`] with extra `[replicator]` lines.
fn spawn_with(dir: &Path, id: &str, seeds: &[&NodeProcess], sharding: &str, replicator: &str) -> NodeProcess {
    let mut o = ProcessOptions::new(id, "proc-test", dir);
    o.admin_token = Some(ADMIN_TOKEN.to_string());
    o.replicator_toml = replicator.to_string();
    o.activation_log = Some(dir.join(format!("activations-{id}.log")));
    o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
    o.membership_toml = format!("stable_after = \"{STABLE_AFTER:?}\"\ndown_removal_margin = \"{MARGIN:?}\"");
    o.sharding_toml = format!("number_of_shards = 20\nretry_interval = \"400ms\"\n{sharding}");
    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
}

/// The member listed first (oldest first): the coordinator's host.
async fn oldest(n: &NodeProcess) -> String {
    n.members().await.unwrap()[0].node_id.clone()
}

/// Asks `n` for `kv` entity `id` until `check` accepts the answer, within `deadline`.
async fn until_kv(n: &NodeProcess, id: &str, deadline: Duration, check: impl Fn(&KvReply) -> bool) -> KvReply {
    n.until(&format!("GET /kv/{id}"), deadline, async |n: &NodeProcess| n.kv_get(id).await, check).await
}

/// Asks `n` for the `kv` type's entity counts until `check` accepts them, within `deadline`.
async fn until_stats(n: &NodeProcess, deadline: Duration, check: impl Fn(&KvStats) -> bool) -> KvStats {
    n.until("kv entity counts", deadline, async |n: &NodeProcess| n.kv_stats().await, check).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_node_entities_answer_again_from_the_survivors_and_sigterm_leaves_gracefully() {
    // Three nodes: durable values need a majority of the replica holders ever seen (the
    // roster), so two survivors of three serve them; one of two would wait (DESIGN.md).
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = spawn(dir.path(), "n1", &[], "");
    let mut n2 = spawn(dir.path(), "n2", &[&n1], "");
    let n3 = spawn(dir.path(), "n3", &[&n1], "");
    n1.until_up(3, Duration::from_secs(30), |_| true).await;
    assert_eq!(n1.admin_request("GET", "/bogus", "").await.unwrap().0, 404);
    assert_eq!(n1.admin_request("GET", "/kv/", "").await.unwrap().0, 404, "a missing id is refused");
    for i in 0..20 {
        n2.kv_put(&format!("k{i}"), &format!("v{i}")).await.unwrap();
    }
    let mut on_n2 = 0;
    for i in 0..20 {
        let a = n1.kv_get(&format!("k{i}")).await.unwrap();
        assert_eq!(a.value, Some(format!("v{i}")), "{a:?}");
        on_n2 += usize::from(a.node == "n2");
    }
    assert!(on_n2 > 0, "n2 hosts some entities");
    // The admin HTTP API of a real process: readiness, members, the kv routes, metrics, and a
    // mutating route refused without a configured token.
    let deadline = Instant::now() + Duration::from_secs(30);
    while n1.admin_request("GET", "/ready", "").await.unwrap().0 != 200 {
        assert!(Instant::now() < deadline, "n1 never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, members) = n1.admin_request("GET", "/cluster/members", "").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(members.matches(r#""status":"up""#).count(), 3, "{members}");
    assert_eq!(n2.admin_request("PUT", "/kv/http-1", "over http").await.unwrap().0, 200);
    let (status, value) = n1.admin_request("GET", "/kv/http-1", "").await.unwrap();
    assert!(status == 200 && value.contains(r#""value":"over http""#), "{status} {value}");
    let (status, deleted) = n1.admin_request("DELETE", "/kv/http-1", "").await.unwrap();
    assert!(status == 200 && deleted.contains(r#""value":null"#), "{status} {deleted}");
    assert_eq!(n2.kv_get("http-1").await.unwrap().value, None, "deleted for every node");
    let (status, metrics) = n1.admin_request("GET", "/metrics", "").await.unwrap();
    assert!(status == 200 && metrics.contains(r#"ddshard_region_entities{node="n1",type="kv"}"#), "{metrics}");
    let leave = r#"{"operation": "leave"}"#;
    assert_eq!(n1.admin_request("PUT", "/cluster/members/n2", leave).await.unwrap().0, 401, "no token sent");
    let killed = Instant::now();
    n2.kill();
    let bound = RECOVERY_DEADLINE;
    for i in 0..20 {
        // The value is durable: it comes back with the entity (kv keeps its state).
        let left = bound.saturating_sub(killed.elapsed());
        until_kv(&n1, &format!("k{i}"), left, |a| a.node != "n2" && a.value == Some(format!("v{i}"))).await;
    }
    println!("all 20 entities answered from n1 and n3 {:?} after SIGKILL of n2", killed.elapsed());
    drop(n3);
    let status = n1.terminate(Duration::from_secs(30)).await.unwrap();
    assert!(status.success(), "graceful exit: {status}");
}

/// `n` processes with remembered entities; SIGKILL the coordinator's host, then a
/// non-coordinator; each time every remembered entity runs again on the survivors, with no
/// message sent, within detection + stable_after + margin + 5 s, and then answers.
async fn sigkill_coordinator_host_then_another(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let remember = format!("min_nr_of_members = {n}\n[sharding.remember]\nenabled = true\n");
    // Two of three killed leave one of three replica holders: it serves remembered ids once
    // the dead ones are forgotten, here after 3 s of absence (30 min by default).
    let replicator = if n == 3 { "forget_absent_after = \"3s\"" } else { "" };
    let mut nodes: Vec<NodeProcess> = Vec::new();
    for i in 0..n {
        let seeds: Vec<&NodeProcess> = nodes.first().into_iter().collect();
        let p = spawn_with(dir.path(), &format!("n{}", i + 1), &seeds, &remember, replicator);
        nodes.push(p);
    }
    nodes[1].until_up(n, Duration::from_secs(30), |_| true).await;
    let ids = 10 * n;
    for i in 0..ids {
        nodes[i % n].kv_put(&format!("r{i}"), "v").await.unwrap();
    }
    assert_eq!(nodes[1].kv_stats().await.unwrap().total(), Some(ids));
    let bound = RECOVERY_DEADLINE;

    // First the coordinator's host, then the youngest (never the coordinator).
    let coordinator = oldest(&nodes[1]).await;
    let first = nodes.iter().position(|p| p.node_id == coordinator).unwrap();
    let second = n - 1;
    assert_ne!(first, second);
    let mut killed_at = Vec::new();
    for (round, victim) in [first, second].into_iter().enumerate() {
        let victim_id = nodes[victim].node_id.clone();
        let hosted = nodes[victim].kv_stats().await.unwrap().by_node().get(&victim_id).copied().unwrap_or(0);
        assert!(hosted > 0, "{victim_id} hosts entities before it is killed");
        let killed = Instant::now();
        nodes[victim].kill();
        killed_at.push((victim_id.clone(), std::time::SystemTime::now()));
        let watcher = (0..n).find(|i| *i != first && *i != victim).unwrap();
        until_stats(&nodes[watcher], bound, |s| s.total() == Some(ids) && !s.by_node().contains_key(&victim_id)).await;
        let running = killed.elapsed();
        println!(
            "{n} processes, SIGKILL of {victim_id}{}: its {hosted} remembered entities running again on the \
             survivors after {running:?} (no message sent)",
            if round == 0 { " (coordinator host)" } else { "" }
        );
        for i in 0..ids {
            // The value was in memory on the killed node; only the id is remembered.
            until_kv(&nodes[watcher], &format!("r{i}"), bound, |_| true).await;
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
        let a = until_kv(n, &format!("k{i}"), within, |a| a.value.is_some()).await;
        assert_eq!(a.value, Some(format!("v{i}")), "{when}: k{i} answered {a:?}");
        hosts.push(a.node);
    }
    hosts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_values_survive_rebalance_graceful_leave_sigkill_and_a_full_cluster_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys = 30;
    let within = RECOVERY_DEADLINE;
    let mut n1 = spawn(dir.path(), "n1", &[], "");
    n1.until_up(1, Duration::from_secs(30), |_| true).await;
    for i in 0..keys {
        assert_eq!(n1.kv_put(&format!("k{i}"), &format!("v{i}")).await.unwrap().node, "n1");
    }

    // Rebalance: two more nodes join and take shards over; each loads the states it gets.
    let mut n2 = spawn(dir.path(), "n2", &[&n1], "");
    let mut n3 = spawn(dir.path(), "n3", &[&n1], "");
    n1.until_up(3, Duration::from_secs(30), |_| true).await;
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
    n1.until_up(2, Duration::from_secs(30), |m| m.iter().all(|m| m.node_id != "n2")).await;
    all_values_answer(&n1, keys, within, "after n2 left").await;

    // SIGKILL of n3: n1 is one of the two replica holders left in the roster (n2 left it
    // gracefully), so it serves no durable value alone. The operator forgets n3 with
    // `ddshard admin forget`; then n3's shards start on n1 from the states in its replica.
    n3.kill();
    n1.until_up(1, Duration::from_secs(30), |m| m.iter().all(|m| m.node_id != "n3" || m.status != "up")).await;
    let roster = admin_cli(&n1, &["roster"]);
    assert!(roster.contains("n3") && roster.contains("no (still counted)"), "{roster}");
    let refused = n1.kv_put("written-alone", "v").await;
    assert!(refused.is_err(), "a durable write needs both holders: {refused:?}");
    let (ok, refused) = admin_cli_run(&n1, &["forget", "n1"]);
    assert!(!ok && refused.contains("this node"), "a node never forgets itself: {refused}");
    let forgotten = admin_cli(&n1, &["forget", "n3"]);
    assert!(forgotten.contains("n3: forgotten"), "{forgotten}");
    let hosts = all_values_answer(&n1, keys, within, "after SIGKILL of n3 and its forget").await;
    assert!(hosts.iter().all(|h| h == "n1"), "{hosts:?}");

    // Full-cluster restart: every process gone, then all three start again on their data dirs.
    n1.kill();
    drop((n1, n2, n3));
    let n1 = spawn(dir.path(), "n1", &[], "");
    let n2 = spawn(dir.path(), "n2", &[&n1], "");
    let n3 = spawn(dir.path(), "n3", &[&n1], "");
    n1.until_up(3, Duration::from_secs(30), |_| true).await;
    all_values_answer(&n2, keys, within, "after a full-cluster restart").await;
    drop(n3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_from_one_config_file_with_per_node_overrides_form_one_cluster() {
    // One cluster.toml (cluster id, timers, shard count) for all three; each node's id, data
    // dir and gossip address come from `--set`, its messaging address and seeds from
    // `DDSHARD__…` variables.
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str, seeds: &[&NodeProcess]| {
        let mut o = ProcessOptions::new(id, "one-file", dir.path());
        o.shared_config_file = true;
        o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
        o.sharding_toml = "number_of_shards = 12".into();
        NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
    };
    let n1 = start("n1", &[]);
    let n2 = start("n2", &[&n1]);
    let n3 = start("n3", &[&n1, &n2]);
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.ends_with(".toml"))
        .collect();
    assert_eq!(files, ["cluster.toml"], "one config file for every node");
    for n in [&n1, &n2, &n3] {
        n.until_up(3, Duration::from_secs(60), |_| true).await;
        let mut ids: Vec<String> = n.members().await.unwrap().into_iter().map(|m| m.node_id).collect();
        ids.sort();
        assert_eq!(ids, ["n1", "n2", "n3"], "{} sees the three overridden node ids", n.node_id);
        assert_ne!(n.gossip.port(), 0);
    }
    let mut data_dirs: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok().filter(|e| e.path().is_dir())?.file_name().into_string().ok())
        .collect();
    data_dirs.sort();
    assert_eq!(data_dirs, ["n1", "n2", "n3"], "each node's data dir as overridden");
    // The shared sharding settings hold on every node: 12 shards, spread over the three.
    for i in 0..24 {
        n2.kv_put(&format!("k{i}"), &format!("v{i}")).await.unwrap();
    }
    let stats = n3.kv_stats().await.unwrap();
    assert_eq!(stats.total(), Some(24));
    let shards: Vec<u32> =
        stats.0.regions.values().flat_map(|s| s.keys()).map(|id| id.parse().expect("numeric shard id")).collect();
    assert!(shards.iter().all(|s| *s < 12), "every shard id under the shared number_of_shards: {shards:?}");
}

/// Runs `ddshard node` with `args` until a stderr line satisfies `wanted` (or 30 s pass);
/// returns the lines read.
fn node_log_until(dir: &Path, args: &[&str], wanted: impl Fn(&str) -> bool) -> Vec<String> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ddshard"))
        .args(["node", "--set", "node_id=logs", "--set"])
        .arg(format!("data_dir={}", dir.join("logs").display()))
        .args(["--admin-addr", "127.0.0.1:0"])
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let done = wanted(&line);
        lines.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    lines
}

#[test]
fn a_node_logs_its_member_changes_at_info_by_default_and_as_json_lines_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let text = node_log_until(dir.path(), &[], |l| l.contains("member up"));
    assert!(text.iter().any(|l| l.contains("INFO") && l.contains("member up")), "{text:#?}");
    let json = node_log_until(dir.path(), &["--log-format", "json"], |l| l.contains("member up"));
    assert!(json.iter().any(|l| l.contains("member up")), "{json:#?}");
    for line in &json {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["message"].is_string() && v["timestamp"].is_string(), "{line}");
    }
}

/// Readiness that holds (issue 39): a Kubernetes readiness probe every 100 ms on the survivors
/// while the coordinator's node is SIGKILLed and the coordinator moves, under the default
/// downing timers (5 s + 5 s). Before the latch every survivor answered 503 at once for
/// seconds, which takes a whole service out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_stay_ready_at_every_probe_while_the_coordinators_node_is_sigkilled_and_it_moves() {
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str, seeds: &[&NodeProcess]| {
        let mut o = ProcessOptions::new(id, "ready-test", dir.path());
        o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
        NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
    };
    let n1 = start("n1", &[]);
    let n2 = start("n2", &[&n1]);
    let n3 = start("n3", &[&n1, &n2]);
    let mut nodes = vec![n1, n2, n3];
    for n in &nodes {
        n.until_up(3, Duration::from_secs(60), |_| true).await;
        n.until(
            "ready",
            Duration::from_secs(60),
            async |n: &NodeProcess| n.admin_request("GET", "/ready", "").await,
            |r| r.0 == 200,
        )
        .await;
    }
    let coordinator = oldest(&nodes[0]).await;
    let k = nodes.iter().position(|n| n.node_id == coordinator).unwrap();
    let mut victim = nodes.remove(k);
    victim.kill();
    let killed = Instant::now();
    let (mut samples, mut unready) = (0, Vec::new());
    // Probe until the coordinator has moved (a survivor is the oldest) and a value written
    // through each survivor is served again, and for at least the downing timers.
    let mut moved_at = None;
    while killed.elapsed() < RECOVERY_DEADLINE {
        for n in &nodes {
            let (status, body) = n.admin_request("GET", "/ready", "").await.unwrap();
            samples += 1;
            if status != 200 {
                unready.push(format!("{:?} {}: {status} {body}", killed.elapsed(), n.node_id));
            }
        }
        if moved_at.is_none()
            && oldest(&nodes[0]).await != coordinator
            && nodes[0].kv_put("after-move", "v").await.is_ok()
        {
            moved_at = Some(killed.elapsed());
        }
        if moved_at.is_some() && killed.elapsed() > Duration::from_secs(12) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let moved_at = moved_at.expect("the coordinator moved to a survivor and served a write");
    println!(
        "{samples} probes of the survivors over {:?} (coordinator moved after {moved_at:?}): {} not ready",
        killed.elapsed(),
        unready.len()
    );
    assert!(unready.is_empty(), "a ready survivor answered not ready: {unready:#?}");
}

/// One `cargo run -- node …` command of the README, started as written with its addresses on
/// port 0 (the seed pointed at the first node's bound gossip address) in `dir`; returns the
/// child and its READY line.
fn spawn_readme_node(dir: &Path, command: &str, seed: Option<&str>) -> (std::process::Child, String) {
    use std::io::BufRead;
    let args: Vec<String> = command
        .split_whitespace()
        .skip(3) // cargo run --
        .map(|a| {
            let at = |prefix: &str| a.starts_with(prefix).then(|| format!("{prefix}127.0.0.1:0"));
            if let (Some(seed), true) = (seed, a.starts_with("seeds=")) {
                return format!("seeds={seed}");
            }
            at("gossip_addr=")
                .or_else(|| at("messaging_addr="))
                .unwrap_or_else(|| if a.starts_with("127.0.0.1:") { "127.0.0.1:0".to_string() } else { a.to_string() })
        })
        .collect();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ddshard"))
        .args(&args)
        .current_dir(dir)
        .env_remove("DDSHARD_CLUSTER_SECRET")
        .env_remove("DDSHARD_ADMIN_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("READY") {
                let _ = tx.send(line);
            }
        }
    });
    let ready = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("no READY line: {args:?}"));
    (child, ready)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_two_terminal_quickstart_forms_a_cluster_that_serves_a_kv_write_through_either_node() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let block = readme.split("**Two nodes in two terminals**").nth(1).unwrap();
    let block = block.split("```sh").nth(1).unwrap().split("```").next().unwrap();
    let commands: Vec<String> = block
        .replace("\\\n", " ")
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo run -- node"))
        .map(String::from)
        .collect();
    assert_eq!(commands.len(), 2, "{block}");
    let dir = tempfile::tempdir().unwrap();
    let field = |ready: &str, name: &str| -> std::net::SocketAddr {
        ready.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}="))).unwrap().parse().unwrap()
    };
    let (mut n1, ready1) = spawn_readme_node(dir.path(), &commands[0], None);
    let seed = field(&ready1, "gossip").to_string();
    let (mut n2, ready2) = spawn_readme_node(dir.path(), &commands[1], Some(&seed));
    let (a1, a2) = (field(&ready1, "admin"), field(&ready2, "admin"));
    use ddshard::testkit::process::{admin_request_to, kv_get_at};
    let deadline = Instant::now() + RECOVERY_DEADLINE;
    loop {
        match admin_request_to(a1, "PUT", "/kv/cart-1", "apples").await {
            Ok((200, _)) => break,
            other => assert!(Instant::now() < deadline, "the write never succeeded: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let read = kv_get_at(a2, "cart-1").await.unwrap();
    assert_eq!(read.value.as_deref(), Some("apples"), "{read:?}");
    let (status, members) = admin_request_to(a2, "GET", "/cluster/members", "").await.unwrap();
    assert!(status == 200 && members.matches(r#""status":"up""#).count() == 2, "{members}");
    for child in [&mut n1, &mut n2] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A guessable secret or admin token stops `ddshard node` at start with an error that names
/// the setting and never quotes the value; a key from `ddshard secret` and a strong passphrase
/// both start it.
#[test]
fn a_node_refuses_to_start_with_a_guessable_cluster_secret_or_admin_token_and_never_echoes_it() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let start = |secret: &str, token: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ddshard"));
        command
            .args(["node", "--admin-addr", "127.0.0.1:0", "--set", "gossip_addr=127.0.0.1:0"])
            .args(["--set", "messaging_addr=127.0.0.1:0", "--set", "node_id=n1"])
            .args(["--set", &format!("data_dir={}", dir.path().join("data").display())])
            .env("DDSHARD_CLUSTER_SECRET", secret)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        match token {
            Some(t) => command.env("DDSHARD_ADMIN_TOKEN", t),
            None => command.env_remove("DDSHARD_ADMIN_TOKEN"),
        };
        let mut child = command.spawn().unwrap();
        // A node that starts runs until stopped: READY on stdout tells it apart from a refusal.
        let stdout = child.stdout.take().unwrap();
        let ready = std::io::BufReader::new(stdout).lines().map_while(Result::ok).any(|l| l.starts_with("READY"));
        let _ = child.kill();
        let output = child.wait_with_output().unwrap();
        (ready, String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let weak = "s3cr3t-s3cr3t-s3cr3t-s3cr3t-s3cr3t-";
    let (ready, stderr) = start(weak, None);
    assert!(!ready && stderr.contains("cluster_secret is too easy to guess") && !stderr.contains("s3cr3t"), "{stderr}");
    let key = ddshard::ClusterSecret::generate();
    let (ready, stderr) = start(key.expose(), Some("adminadminadminadminadminadminadmin"));
    assert!(
        !ready && stderr.contains("DDSHARD_ADMIN_TOKEN is too easy to guess") && !stderr.contains("adminadmin"),
        "{stderr}"
    );
    let (ready, stderr) = start(key.expose(), Some(ddshard::ClusterSecret::generate().expose()));
    assert!(ready, "a key and a generated token start the node: {stderr}");
    let (ready, stderr) = start("harbor quilt seven marmalade orbit lantern", None);
    assert!(ready, "a strong passphrase starts the node: {stderr}");
}

/// Issue 39, safe formation: five `ddshard node` processes with one configuration file
/// (`bootstrap_contact_points = 3`) and every node's gossip address as seeds, each node's own
/// first (by the first-seed rule each would form a cluster: with the setting at 0 they do),
/// started at once, five times: each time exactly one cluster forms — every node lists the same five Up
/// members, one of them with up-number 1 (each formation takes 1; a join takes more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_processes_with_one_configuration_started_at_once_form_exactly_one_cluster_every_time() {
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        // Ports known before the start, as a seed list written once for every node is.
        let ports: Vec<u16> = (0..5).map(|_| ddshard::testkit::unused_port([127, 0, 0, 1].into())).collect();
        let seeds: Vec<std::net::SocketAddr> = ports.iter().map(|p| ([127, 0, 0, 1], *p).into()).collect();
        let starts: Vec<_> = ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let mut o = ProcessOptions::new(&format!("n{}", i + 1), "bootstrap-test", dir.path());
                o.shared_config_file = true;
                o.gossip_port = *port;
                // Each lists itself first: by the first-seed rule each would form a cluster.
                o.seeds = seeds.iter().cycle().skip(i).take(seeds.len()).map(|s| (*s).into()).collect();
                o.membership_toml = "bootstrap_contact_points = 3\nbootstrap_stable_margin = \"1s\"".into();
                std::thread::spawn(move || {
                    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
                })
            })
            .collect();
        let nodes: Vec<NodeProcess> = starts.into_iter().map(|t| t.join().unwrap()).collect();
        let mut lists = Vec::new();
        for n in &nodes {
            let members = n.until_up(5, Duration::from_secs(60), |_| true).await;
            let mut view: Vec<(String, Option<u64>)> =
                members.iter().map(|m| (m.address.clone(), m.up_number)).collect();
            view.sort();
            lists.push(view);
        }
        // A node that forms takes up-number 1; one that joins, one more than the highest it saw.
        let formed = lists[0].iter().filter(|(_, u)| *u == Some(1)).count();
        assert_eq!(formed, 1, "round {round}: one formation, then four joins: {:?}", lists[0]);
        assert!(lists.iter().all(|l| *l == lists[0]), "round {round}: the nodes disagree: {lists:#?}");
    }
}

/// A node whose gossip port is already taken exits before its READY line; the start fails with
/// the reason from the node's own log, not a bare "unexpected first line" (how CI's one
/// failed start looked before the logs were kept).
#[test]
fn a_node_that_cannot_bind_its_gossip_port_fails_to_start_with_the_reason_from_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let port = ddshard::testkit::unused_port([127, 0, 0, 1].into());
    let _taken = std::net::UdpSocket::bind(("127.0.0.1", port)).unwrap();
    let mut o = ProcessOptions::new("n1", "taken-port", dir.path());
    o.gossip_port = port;
    let err = NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("did not start"), "{text}");
    assert!(text.contains("in use"), "the log's reason is quoted: {text}");
}
