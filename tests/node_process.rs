//! `ddshard node` as real processes: the client line protocol, SIGKILL of a node and its
//! entities answering again from the survivor, SIGTERM leaving gracefully.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ddshard::service::call;

struct NodeProcess {
    child: Child,
    gossip: SocketAddr,
    client: SocketAddr,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, name: &str) -> SocketAddr {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        .parse()
        .unwrap()
}

fn spawn_node(dir: &std::path::Path, id: &str, seeds: &[SocketAddr]) -> NodeProcess {
    spawn_node_with(dir, id, seeds, "")
}

fn spawn_node_with(dir: &std::path::Path, id: &str, seeds: &[SocketAddr], sharding_extra: &str) -> NodeProcess {
    let seeds: Vec<String> = seeds.iter().map(|s| format!("\"{s}\"")).collect();
    let config = format!(
        "node_id = \"{id}\"\ncluster_id = \"proc-test\"\ndata_dir = \"{}\"\nseeds = [{}]\n\
         [membership]\nstable_after = \"1500ms\"\ndown_removal_margin = \"1s\"\n\
         [sharding]\nnumber_of_shards = 20\nretry_interval = \"400ms\"\n{sharding_extra}",
        dir.join(id).display(),
        seeds.join(", ")
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ddshard"))
        .args(["node", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // Blocks until the node printed its addresses (or exited: then the line is empty).
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("READY"), "node {id} did not start: {line:?}");
    NodeProcess { gossip: field(&line, "gossip"), client: field(&line, "client"), child }
}

async fn ask(addr: SocketAddr, request: &str) -> String {
    call(addr, request, Duration::from_secs(10)).await.unwrap()
}

/// Polls until `check` accepts the answer or the deadline passes.
async fn until(addr: SocketAddr, request: &str, deadline: Duration, check: impl Fn(&str) -> bool) -> String {
    let end = Instant::now() + deadline;
    loop {
        let answer = call(addr, request, Duration::from_secs(2)).await.unwrap_or_else(|e| format!("ERR {e}"));
        if check(&answer) {
            return answer;
        }
        assert!(Instant::now() < end, "{request} never satisfied the check; last answer {answer:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_node_entities_answer_again_from_the_survivor_and_sigterm_leaves_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let n1 = spawn_node(dir.path(), "n1", &[]);
    let mut n2 = spawn_node(dir.path(), "n2", &[n1.gossip]);
    until(n1.client, "MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 2).await;
    assert!(ask(n1.client, "BOGUS").await.starts_with("ERR"));
    for i in 0..20 {
        assert!(ask(n2.client, &format!("PUT k{i} v{i}")).await.starts_with("OK "));
    }
    let mut on_n2 = 0;
    for i in 0..20 {
        let a = ask(n1.client, &format!("GET k{i}")).await;
        assert!(a.starts_with("VALUE ") && a.ends_with(&format!(" v{i}")), "{a}");
        on_n2 += usize::from(a.split_whitespace().nth(1) == Some("n2"));
    }
    assert!(on_n2 > 0, "n2 hosts some entities");
    // SIGKILL n2: detection (~1 s) + stable_after (1.5 s) + margin (1 s) + 5 s.
    let killed = Instant::now();
    n2.child.kill().unwrap();
    n2.child.wait().unwrap();
    for i in 0..20 {
        until(n1.client, &format!("GET k{i}"), Duration::from_millis(8500).saturating_sub(killed.elapsed()), |a| {
            a.starts_with("VALUE n1") || a.starts_with("NONE n1")
        })
        .await;
    }
    println!("all 20 entities answered from n1 {:?} after SIGKILL of n2", killed.elapsed());
    // SIGTERM: graceful leave, exit code 0.
    let mut n1 = n1;
    let pid = n1.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = n1.child.wait().unwrap();
    assert!(status.success(), "graceful exit: {status}");
}

/// Sum of entity counts in a `STATS` answer, and whether any region failed to answer.
fn stats_total(answer: &str) -> Option<usize> {
    let body = answer.strip_prefix("STATS")?;
    let (regions, failed) = body.split_once("FAILED")?;
    if !failed.trim().is_empty() {
        return None;
    }
    Some(regions.split_whitespace().filter_map(|r| r.split_once('=')?.1.parse::<usize>().ok()).sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_sigkill_the_coordinator_host_then_another_and_remembered_entities_run_without_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let remember = "remember_entities = true\nmin_nr_of_members = 3\n";
    let mut n1 = spawn_node_with(dir.path(), "n1", &[], remember);
    let n2 = spawn_node_with(dir.path(), "n2", &[n1.gossip], remember);
    let mut n3 = spawn_node_with(dir.path(), "n3", &[n1.gossip], remember);
    until(n2.client, "MEMBERS", Duration::from_secs(30), |a| a.matches(":Up").count() == 3).await;
    for i in 0..30 {
        assert!(ask(n3.client, &format!("PUT r{i} v")).await.starts_with("OK "));
    }
    assert_eq!(stats_total(&ask(n2.client, "STATS").await), Some(30));
    // n1 is the oldest: it runs the coordinator.
    let bound = Duration::from_millis(1000 + 1500 + 1000 + 5000);
    let killed = Instant::now();
    n1.child.kill().unwrap();
    n1.child.wait().unwrap();
    until(n2.client, "STATS", bound, |a| stats_total(a) == Some(30) && !a.contains("n1=")).await;
    println!(
        "coordinator host killed: 30 remembered entities running on n2/n3 after {:?}, no message sent",
        killed.elapsed()
    );
    for i in 0..30 {
        // It answers; its value was in memory on the killed node (only the id is remembered).
        until(n2.client, &format!("GET r{i}"), bound, |a| a.starts_with("VALUE ") || a.starts_with("NONE ")).await;
    }
    // Then a non-coordinator: n3 (n2, the lower address, wins the 1-1 tie and stays).
    let killed = Instant::now();
    n3.child.kill().unwrap();
    n3.child.wait().unwrap();
    until(n2.client, "STATS", bound, |a| a.trim_end() == "STATS n2=30 FAILED").await;
    println!("second node killed: all 30 remembered entities running on n2 after {:?}", killed.elapsed());
    drop(n2);
}
