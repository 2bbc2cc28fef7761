//! The remember store's membership-change scenario (issue 42, step 5) with `ddshard node`
//! processes, each in its own network namespace on one bridge: ids remembered under three
//! members come back after the cluster grew to seven and lost the ids' home while the only
//! other holder was cut off. Messaging binds each host's second address and gossip its first;
//! the cuts are blackhole routes to second addresses only, so a cut node stays a reachable
//! member (only `ip` from iproute2 is needed).
//!
//! It may skip only for the environment (no root, no `ip`, a host that cannot build or
//! route the test network), never for the product; under `CI=true` or `DDSHARD_REQUIRE_NETNS=1`
//! a skip fails. A run that got through writes `target/tmp/netns-remember-store-ran.txt`.

mod netns;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use netns::Network;

use ddshard::sharding::query::EntityLocation;
use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions};

const NODES: usize = 7;
const SETTLE: Duration = Duration::from_secs(60);
const TOKEN: &str = "netns-test-admin-token-0123456789abcdef";

struct Cluster<'a> {
    net: &'a Network,
    dir: PathBuf,
    procs: Vec<Option<NodeProcess>>,
}

impl Cluster<'_> {
    fn start(&mut self, i: usize, seeds: &[usize]) {
        let mut o = ProcessOptions::new(&format!("n{}", i + 1), "netns-remember", &self.dir);
        o.bind_ip = self.net.addr(i).parse().unwrap();
        o.messaging_ip = Some(self.net.second_addr(i).parse().unwrap());
        o.admin_token = Some(TOKEN.into());
        o.seeds = seeds.iter().filter_map(|s| self.procs[*s].as_ref().map(|p| p.gossip.into())).collect();
        o.wrapper = self.net.wrapper(i);
        // A node cut off the message path for 10 s stays a reachable member (gossip flows).
        o.membership_toml = "stable_after = \"1500ms\"\ndown_removal_margin = \"1500ms\"\n\
                             [failure_detector]\nacceptable_pause = \"60s\""
            .into();
        // No anti-entropy within the test: only the replicas that acknowledged hold the ids.
        o.replicator_toml = "gossip_interval = \"1h\"".into();
        // Plain majorities for the coordinator and the state (the ids' holders are two of
        // three); the remember store's own rule is what the test is about.
        o.sharding_toml = "number_of_shards = 10\nmin_nr_of_members = 3\nretry_interval = \"400ms\"\n\
                           rebalance_interval = \"1h\"\n\
                           [sharding.remember]\nenabled = true\nslots = 4\n\
                           [sharding.coordinator]\nwrite_majority_plus = 0\nread_majority_plus = 0\nmajority_min_cap = 0\n\
                           [sharding.state]\nwrite_majority_plus = 0\nread_majority_plus = 0\nmajority_min_cap = 0\n"
            .into();
        self.procs[i] = Some(NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, SETTLE).unwrap());
    }

    fn node(&self, i: usize) -> &NodeProcess {
        self.procs[i].as_ref().expect("running")
    }
}

/// The node id hosting `id`'s shard, by the coordinator's table as `node` sees it.
async fn home_of(node: &NodeProcess, id: &str) -> Option<String> {
    let located: EntityLocation = node.admin_get(&format!("/cluster/shards/kv/entities/{id}")).await.ok()?;
    Some(located.home?.split('#').next()?.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_ids_remembered_under_three_members_come_back_after_growing_to_seven_and_losing_their_home() {
    let Some(net) = netns::network_or_skip("netns remember store", NODES) else { return };
    net.add_second_addrs().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster { net: &net, dir: dir.path().to_path_buf(), procs: (0..NODES).map(|_| None).collect() };
    c.start(0, &[]);
    for i in 1..3 {
        c.start(i, &[0]);
    }
    c.node(0).until_up(3, SETTLE, |_| true).await;
    // Every shard allocated and remembered while all three hear every write.
    let warm: Vec<String> = (0..30).map(|k| format!("w{k}")).collect();
    for id in &warm {
        c.node(0).kv_put(id, "v").await.unwrap();
    }
    let mut on_n2 = Vec::new();
    for k in 0..400 {
        let id = format!("e{k}");
        if home_of(c.node(0), &id).await.as_deref() == Some("n2") {
            on_n2.push(id);
        }
        if on_n2.len() == 10 {
            break;
        }
    }
    assert_eq!(on_n2.len(), 10, "ids whose shards n2 hosts");
    // n1 hears no message of n2 or n3: the ids n2 starts are remembered by n2 and n3 alone.
    net.cut_second_addrs(&[0], &[1, 2], true);
    for id in &on_n2 {
        c.node(1).kv_put(id, "v").await.unwrap();
    }
    c.procs[1] = None; // SIGKILL
    net.cut_second_addrs(&[0], &[1, 2], false);
    for i in 3..NODES {
        c.start(i, &[0]);
    }
    c.node(0).until_up(NODES, SETTLE, |_| true).await;
    // n3's message path is cut (it stays a reachable member) while n2 is downed: n2's shards
    // start elsewhere and load their ids while n3, the ids' other holder, cannot answer.
    let cut_at = Instant::now();
    net.cut_second_addrs(&[2], &[0, 3, 4, 5, 6], true);
    let (status, body) =
        c.node(0).admin_request_with_token("PUT", "/cluster/members/n2", r#"{"operation": "down"}"#).await.unwrap();
    assert_eq!(status, 202, "{body}");
    tokio::time::sleep(Duration::from_secs(10)).await;
    net.cut_second_addrs(&[2], &[0, 3, 4, 5, 6], false);
    let expected = warm.len() + on_n2.len();
    let stats = async |n: &NodeProcess| n.kv_stats().await;
    let back =
        c.node(0).until("every remembered id runs", SETTLE, stats, |s: &KvStats| s.total() == Some(expected)).await;
    assert!(!back.by_node().contains_key("n2"));
    for id in &on_n2 {
        let got = c.node(3).kv_get(id).await.unwrap();
        assert!(format!("{got:?}").contains('v'), "{id}: {got:?}");
    }
    let ran = format!(
        "netns remember store test ran: {expected} remembered ids all back {:?} after n2 was downed with n3 cut off\n",
        cut_at.elapsed()
    );
    netns::mark_ran("netns-remember-store-ran.txt", &ran);
}
