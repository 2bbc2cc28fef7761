//! Discovery through real DNS: `testkit::dns` answers SRV (targets and ports, with their A
//! records in the additional section) and A queries on a UDP port from a record table the test
//! edits, with TTL 0. Nodes use `discovery.srv_names` with `discovery.dns_server` pointing at
//! it — the resolver, its wire format and the driver are the shipped ones. (The SRV source's
//! own cases — glue or not, IPv6, port 0, changes — are unit tests of `membership::discovery`.)

use std::net::SocketAddr;
use std::time::Duration;

use ddshard::testkit::dns::TestDns;
use ddshard::testkit::{eventually, test_config};
use ddshard::{MemberStatus, Node, NodeConfig};

const SERVICE: &str = "_gossip._udp.ddshard.test.";

fn srv_config(node_id: &str, dir: &std::path::Path, server: SocketAddr, gossip_port: u16) -> NodeConfig {
    let mut cfg = test_config(node_id, dir, "srv-discovery");
    cfg.gossip_addr = SocketAddr::from(([127, 0, 0, 1], gossip_port));
    cfg.discovery.srv_names = vec![SERVICE.into()];
    cfg.discovery.dns_server = Some(server);
    cfg.discovery.lookup_interval = Duration::from_millis(250);
    cfg.membership.bootstrap_contact_points = 3;
    cfg.membership.bootstrap_stable_margin = Duration::from_secs(1);
    cfg
}

fn up_ids(n: &Node) -> Vec<String> {
    let mut ids: Vec<String> = n
        .members()
        .iter()
        .filter(|m| m.status() == MemberStatus::Up)
        .map(|m| m.address().node_id.to_string())
        .collect();
    ids.sort();
    ids
}

fn free_udp_port() -> u16 {
    ddshard::testkit::unused_port([127, 0, 0, 1].into())
}

/// One configuration for every node (the SRV name, bootstrap formation of 3): the nodes start
/// before their records exist, the records appear one by one, and exactly one cluster forms.
/// Then a fourth node starts while DNS still lists only an address nobody answers at (a seed
/// rescheduled away); once the records point at the live nodes it finds them by looking up
/// again, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_one_srv_name_form_one_cluster_and_a_late_node_follows_dns_to_the_moved_seeds() {
    ddshard::testkit::init_test_tracing();
    let dns = TestDns::start(SERVICE).await.unwrap();
    let server = dns.addr;
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut nodes = Vec::new();
    for (i, dir) in dirs.iter().take(3).enumerate() {
        let node = Node::start(srv_config(&format!("n{}", i + 1), dir.path(), server, 0)).await.unwrap();
        nodes.push(node);
    }
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        records.push((format!("n{}", i + 1), node.gossip_addr()));
        let view: Vec<(&str, SocketAddr)> = records.iter().map(|(t, a)| (t.as_str(), *a)).collect();
        dns.set(&view);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eventually(Duration::from_secs(30), "three nodes Up in one cluster", || {
        std::future::ready(nodes.iter().all(|n| up_ids(n) == ["n1", "n2", "n3"]).then_some(()))
    })
    .await;
    let oldest: Vec<_> =
        nodes.iter().map(|n| n.members().iter().min_by_key(|m| m.up_number()).map(|m| m.address().clone())).collect();
    assert!(oldest.windows(2).all(|w| w[0] == w[1]), "one cluster, one oldest: {oldest:?}");

    // DNS lists only an address nobody answers at: the late node is alone and keeps asking.
    let gone: SocketAddr = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    dns.set(&[("n1", gone)]);
    let mut late_cfg = srv_config("n4", dirs[3].path(), server, 0);
    late_cfg.membership.bootstrap_contact_points = 5;
    let late = Node::start(late_cfg).await.unwrap();
    let before = dns.srv_queries();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(up_ids(&late), Vec::<String>::new(), "alone: not Up, no cluster of its own");
    let asked = dns.srv_queries() - before;
    assert!(asked >= 4, "a node alone looks up again every lookup_interval: {asked} lookups in 2 s");
    let view: Vec<(&str, SocketAddr)> = records.iter().map(|(t, a)| (t.as_str(), *a)).collect();
    dns.set(&view);
    let moved_at = std::time::Instant::now();
    eventually(Duration::from_secs(15), "the late node joined the cluster DNS now names", || {
        std::future::ready((up_ids(&late) == ["n1", "n2", "n3", "n4"]).then_some(()))
    })
    .await;
    eprintln!("the late node joined {:?} after DNS pointed at the cluster", moved_at.elapsed());
    late.shutdown().await;
    for n in nodes {
        n.shutdown().await;
    }
}
