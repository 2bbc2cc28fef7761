//! Rotating the cluster secret without an outage: three `ddshard node` processes go through
//! the three rolling restarts of a rotation (accept the new secret; use it, still accepting the
//! old; drop the old) under traffic, and stay one cluster that answers every value throughout.

use std::path::Path;
use std::time::Duration;

use std::sync::{Arc, Mutex};

use ddshard::testkit::process::{NodeProcess, ProcessOptions, kv_get_at};

/// A passphrase (stretched with Argon2id at each start), rotated to a key: the move an operator
/// who started with a passphrase makes.
const OLD: &str = "harbor quilt seven marmalade orbit lantern";
const NEW: &str = "9f3c2a71e04b58d6c1a7e2f90b3d4c5a6e7f8091a2b3c4d5";
const KEYS: usize = 30;
const DEADLINE: Duration = Duration::from_secs(60);

fn spawn(dir: &Path, id: &str, seeds: &[&NodeProcess], secret: &str, accepted: &[&str]) -> NodeProcess {
    let mut o = ProcessOptions::new(id, "rotation", dir);
    o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
    o.cluster_secret = Some(secret.to_string());
    o.accepted_cluster_secrets = accepted.iter().map(ToString::to_string).collect();
    o.membership_toml = "stable_after = \"1500ms\"\ndown_removal_margin = \"1s\"".to_string();
    o.sharding_toml = "number_of_shards = 20\nretry_interval = \"400ms\"".to_string();
    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, DEADLINE).unwrap()
}

/// Every node lists exactly the three, all up (one cluster, not two), and every value
/// answers from every node.
async fn one_cluster_serving_every_value(nodes: &[NodeProcess], when: &str) -> usize {
    for n in nodes {
        n.until_up(3, DEADLINE, |m| m.len() == 3 && m.iter().all(|m| m.reachable)).await;
    }
    let mut answered = 0;
    for n in nodes {
        for k in 0..KEYS {
            let id = format!("k{k}");
            let reply = n.kv_get(&id).await.unwrap_or_else(|e| panic!("{when}: GET {id} from {}: {e}", n.node_id));
            assert_eq!(reply.value, Some(format!("v{k}")), "{when}: {id} from {}", n.node_id);
            answered += 1;
        }
    }
    answered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_rotation_of_the_cluster_secret_keeps_three_processes_one_cluster_serving_every_value() {
    let dir = tempfile::tempdir().unwrap();
    let n1 = spawn(dir.path(), "n1", &[], OLD, &[]);
    let n2 = spawn(dir.path(), "n2", &[&n1], OLD, &[]);
    let n3 = spawn(dir.path(), "n3", &[&n1, &n2], OLD, &[]);
    let mut nodes = vec![n1, n2, n3];
    for n in &nodes {
        n.until_up(3, DEADLINE, |_| true).await;
    }
    for k in 0..KEYS {
        nodes[k % 3].kv_put(&format!("k{k}"), &format!("v{k}")).await.unwrap();
    }
    let mut answered = one_cluster_serving_every_value(&nodes, "before the rotation").await;
    // Traffic throughout: reads of every key from the nodes that are up, round-robin. A read
    // caught by a restart's hand-off may fail (at-most-once); none may fail for the secret.
    let admins = Arc::new(Mutex::new(nodes.iter().map(|n| Some(n.admin)).collect::<Vec<_>>()));
    let (ok, failed) = (Arc::new(Mutex::new(0usize)), Arc::new(Mutex::new(Vec::<String>::new())));
    let traffic = {
        let (admins, ok, failed) = (admins.clone(), ok.clone(), failed.clone());
        tokio::spawn(async move {
            for round in 0usize.. {
                let up: Vec<_> = admins.lock().unwrap().iter().flatten().copied().collect();
                let Some(admin) = up.get(round % up.len().max(1)).copied() else { continue };
                match kv_get_at(admin, &format!("k{}", round % KEYS)).await {
                    Ok(r) if r.value == Some(format!("v{}", round % KEYS)) => *ok.lock().unwrap() += 1,
                    other => failed.lock().unwrap().push(format!("{other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let steps: [(&str, &str, &[&str]); 3] = [
        ("1: accept the new secret", OLD, &[NEW]),
        ("2: use the new secret, accept the old", NEW, &[OLD]),
        ("3: drop the old secret", NEW, &[]),
    ];
    for (step, secret, accepted) in steps {
        for i in 0..3 {
            let id = nodes[i].node_id.clone();
            admins.lock().unwrap()[i] = None;
            let status = nodes[i].terminate(DEADLINE).await.unwrap();
            assert!(status.success(), "{id} left gracefully: {status}");
            let others: Vec<&NodeProcess> = nodes.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, n)| n).collect();
            let restarted = spawn(dir.path(), &id, &others, secret, accepted);
            admins.lock().unwrap()[i] = Some(restarted.admin);
            nodes[i] = restarted;
            answered += one_cluster_serving_every_value(&nodes, &format!("step {step}, {id} restarted")).await;
        }
    }
    traffic.abort();
    let (ok, failed) = (*ok.lock().unwrap(), failed.lock().unwrap().clone());
    println!(
        "rotation done: 9 rolling restarts, {answered} reads answered between them; traffic: {ok} reads answered, \
         {} failed during the restarts' hand-offs",
        failed.len()
    );
    assert!(ok > 100, "the traffic ran: {ok} reads");
    for f in &failed {
        assert!(!f.contains("secret") && !f.contains("nauthenticated"), "a read failed for the secret: {f}");
    }
    assert!(failed.len() * 20 <= ok, "more than 5 % of the traffic failed: {failed:?}");
    // The old secret is refused now: a node holding only it never joins.
    let outsider = spawn(dir.path(), "n4", &[&nodes[0]], OLD, &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let members = nodes[0].members().await.unwrap();
    assert!(members.iter().all(|m| m.node_id != "n4"), "a node with the retired secret joined: {members:?}");
    drop(outsider);
}
