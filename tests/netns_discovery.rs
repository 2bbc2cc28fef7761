//! Discovery and rescheduling the way a container platform does them, with `ddshard node`
//! processes in network namespaces and the real system resolver: each namespace has its own
//! hosts file (`/etc/netns/NAME/hosts`) in which one name, `ddshard-peers`, lists every node's
//! address, as a headless service's name does.
//!
//! Asserts: three processes with one configuration (seed `ddshard-peers:7000`, bootstrap
//! formation of 3), each binding `0.0.0.0` and advertising its namespace's address, form
//! exactly one cluster and serve; then one is SIGKILLed, its namespace moves to a new address
//! and it is started again with the same node id and data dir while its hosts file still lists
//! only its old address: it stays alone (no cluster of its own); once every hosts file lists
//! the new address (edited in place), it finds the others by looking the name up again,
//! rejoins as its next incarnation at the new address (the old incarnation is listed nowhere)
//! and every remembered id answers, within `stable_after` + 10 s of the name's change.
//!
//! Needs root and `ip`; a skip is allowed only outside CI (see `netns/mod.rs`). A run that got
//! through writes `target/tmp/netns-discovery-ran.txt`, which `.ci/run` prints.

mod netns;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ddshard::admin::MemberInfo;
use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions};

const NODES: usize = 3;
const IDS: usize = 30;
const GOSSIP_PORT: u16 = 7000;
const PEERS: &str = "ddshard-peers";
const STABLE_AFTER: Duration = Duration::from_secs(2);
const SETTLE: Duration = Duration::from_secs(60);
const TOKEN: &str = "netns-discovery-admin-token-0123456789abcdef";

fn options(net: &netns::Network, dir: &Path, i: usize, ip: &str) -> ProcessOptions {
    let mut o = ProcessOptions::new(&format!("n{}", i + 1), "netns-discovery", dir);
    o.shared_config_file = true;
    o.bind_ip = IpAddr::from([0, 0, 0, 0]);
    o.advertise_ip = Some(ip.parse().unwrap());
    o.gossip_port = GOSSIP_PORT;
    o.seeds = vec![format!("{PEERS}:{GOSSIP_PORT}").parse().unwrap()];
    o.admin_token = Some(TOKEN.into());
    o.wrapper = net.wrapper(i);
    o.membership_toml = format!(
        "bootstrap_contact_points = {NODES}\nbootstrap_stable_margin = \"1s\"\nstable_after = \"{STABLE_AFTER:?}\"\n\
         down_removal_margin = \"{STABLE_AFTER:?}\""
    );
    o.sharding_toml = "number_of_shards = 12\nretry_interval = \"400ms\"\n[sharding.remember]\nenabled = true\n".into();
    o
}

fn spawn(o: ProcessOptions) -> std::thread::JoinHandle<NodeProcess> {
    std::thread::spawn(move || NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, SETTLE).unwrap())
}

fn write_hosts(net: &netns::Network, ips: &[String]) {
    let entries: Vec<(String, &str)> = ips.iter().map(|a| (a.clone(), PEERS)).collect();
    for i in 0..NODES {
        net.set_hosts(i, &entries).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_find_each_other_by_one_name_and_a_node_rescheduled_to_a_new_ip_rejoins_with_its_entities() {
    let Some(net) = netns::network_or_skip("netns discovery", NODES) else { return };
    let mut ips: Vec<String> = (0..NODES).map(|i| net.addr(i)).collect();
    write_hosts(&net, &ips);
    let dir = tempfile::tempdir().unwrap();
    let dir: PathBuf = dir.path().to_path_buf();
    let starts: Vec<_> = (0..NODES).map(|i| spawn(options(&net, &dir, i, &ips[i]))).collect();
    let mut procs: Vec<NodeProcess> = starts.into_iter().map(|t| t.join().unwrap()).collect();
    for (p, ip) in procs.iter().zip(&ips) {
        assert_eq!(p.gossip.to_string(), format!("{ip}:{GOSSIP_PORT}"), "bound 0.0.0.0, advertised {ip}");
    }
    let mut views = Vec::new();
    for p in &procs {
        let members = p.until_up(NODES, SETTLE, |_| true).await;
        let mut view: Vec<(String, Option<u64>)> = members.iter().map(|m| (m.address.clone(), m.up_number)).collect();
        view.sort();
        views.push(view);
    }
    assert!(views.iter().all(|v| *v == views[0]), "one cluster: {views:#?}");
    assert_eq!(views[0].iter().filter(|(_, u)| *u == Some(1)).count(), 1, "one formation: {:?}", views[0]);
    for k in 0..IDS {
        procs[k % NODES].kv_put(&format!("e{k}"), &format!("v{k}")).await.unwrap();
    }
    let stats = async |n: &NodeProcess| n.kv_stats().await;
    let before = procs[0].until("every entity counted", SETTLE, stats, |s: &KvStats| s.total() == Some(IDS)).await;
    assert!(before.by_node().get("n3").is_some_and(|c| *c > 0), "n3 hosts some entities: {before:?}");
    let old_incarnation = procs[0]
        .members()
        .await
        .unwrap()
        .into_iter()
        .find(|m| m.node_id == "n3")
        .map(|m| m.address)
        .expect("n3 listed");

    // Rescheduled: killed, its host gets a new address, same id and data dir. Its own view of
    // the name is stale at first (only its old address, where nobody answers): it stays alone
    // and keeps asking the system resolver; the hosts files then list the new address, edited
    // in place under the running processes, and it joins without a restart.
    procs[2].kill();
    let new_ip = net.host_addr(33);
    net.move_host(2, &ips[2], &new_ip).unwrap();
    net.set_hosts(2, &[(ips[2].clone(), PEERS)]).unwrap();
    ips[2] = new_ip.clone();
    procs[2] = spawn(options(&net, &dir, 2, &new_ip)).join().unwrap();
    assert_eq!(procs[2].gossip.to_string(), format!("{new_ip}:{GOSSIP_PORT}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let alone = procs[2].members().await.unwrap();
    assert!(alone.iter().all(|m| m.status != "up"), "with a stale name n3 neither joins nor forms: {alone:?}");
    write_hosts(&net, &ips);
    let restarted_at = Instant::now();
    let rejoined = |m: &[MemberInfo]| {
        let n3: Vec<&MemberInfo> = m.iter().filter(|m| m.node_id == "n3").collect();
        n3.len() == 1 && n3[0].address != old_incarnation && n3[0].messaging_addr.starts_with(&format!("{new_ip}:"))
    };
    let deadline = STABLE_AFTER + Duration::from_secs(10);
    for p in &procs {
        let members = p.until_up(NODES, deadline, rejoined).await;
        assert!(members.iter().all(|m| m.address != old_incarnation), "the old incarnation is gone: {members:?}");
    }
    let rejoin = restarted_at.elapsed();
    for k in 0..IDS {
        let id = format!("e{k}");
        let value = procs[(k + 1) % NODES]
            .until(
                &format!("{id} answers"),
                deadline.saturating_sub(restarted_at.elapsed()),
                async |n| n.kv_get(&id).await,
                |_| true,
            )
            .await;
        assert_eq!(value.value.as_deref(), Some(format!("v{k}").as_str()), "{id}: {value:?}");
    }
    let answered = restarted_at.elapsed();
    assert!(answered <= deadline, "every id answered {answered:?} after the restart (goal {deadline:?})");
    let after = procs[0].until("every entity counted", SETTLE, stats, |s: &KvStats| s.total() == Some(IDS)).await;
    netns::mark_ran(
        "netns-discovery-ran.txt",
        &format!(
            "netns discovery test ran: 3 nodes on 0.0.0.0 formed one cluster through the name {PEERS}; n3 moved to \
             {new_ip}, rejoined {rejoin:?} after the name followed it, all {IDS} ids answered after {answered:?} ({after:?})\n"
        ),
    );
}
