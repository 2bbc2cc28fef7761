//! Discovery through real DNS: a small authoritative server on a UDP port of this test answers
//! SRV (targets and ports, with their A records in the additional section) and A queries from
//! a record table the test edits, with TTL 0. Nodes use `discovery.srv_names` with
//! `discovery.dns_server` pointing at it — the resolver, its wire format and the driver are the
//! shipped ones.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::membership::{Discovery, DnsSrv};
use ddshard::testkit::{eventually, test_config};
use ddshard::{MemberStatus, Node, NodeConfig};
use hickory_proto::op::{Message, OpCode};
use hickory_proto::rr::rdata::{A, SRV};
use hickory_proto::rr::{Name, RData, Record, RecordType};

const SERVICE: &str = "_gossip._udp.ddshard.test.";

/// The records the DNS server serves: SRV targets of [`SERVICE`] (target → ip and port).
#[derive(Default)]
struct Zone {
    targets: Mutex<BTreeMap<String, SocketAddr>>,
    /// Whether SRV answers carry the targets' A records (else the resolver asks for them).
    glue: std::sync::atomic::AtomicBool,
    srv_queries: AtomicUsize,
}

impl Zone {
    fn set(&self, targets: &[(&str, SocketAddr)]) {
        *self.targets.lock().unwrap() = targets.iter().map(|(t, a)| (format!("{t}.ddshard.test."), *a)).collect();
    }

    fn answer(&self, query: &Message) -> Message {
        let mut reply = Message::response(query.metadata.id, OpCode::Query);
        reply.metadata.authoritative = true;
        reply.metadata.recursion_desired = query.metadata.recursion_desired;
        reply.metadata.recursion_available = true;
        let Some(q) = query.queries.first() else { return reply };
        reply.add_query(q.clone());
        let targets = self.targets.lock().unwrap().clone();
        let a_record = |target: &str, addr: SocketAddr| {
            let ip = match addr.ip() {
                std::net::IpAddr::V4(v4) => v4,
                std::net::IpAddr::V6(_) => Ipv4Addr::LOCALHOST,
            };
            Record::from_rdata(Name::from_ascii(target).unwrap(), 0, RData::A(A(ip)))
        };
        let qname = q.name.to_ascii().to_lowercase();
        match q.query_type {
            RecordType::SRV if qname == SERVICE => {
                self.srv_queries.fetch_add(1, Ordering::Relaxed);
                for (target, addr) in &targets {
                    let srv = SRV::new(0, 10, addr.port(), Name::from_ascii(target).unwrap());
                    reply.add_answer(Record::from_rdata(q.name.clone(), 0, RData::SRV(srv)));
                    if self.glue.load(Ordering::Relaxed) {
                        reply.add_additional(a_record(target, *addr));
                    }
                }
            }
            RecordType::A => {
                if let Some(addr) = targets.get(&qname) {
                    reply.add_answer(a_record(&qname, *addr));
                }
            }
            _ => {}
        }
        reply
    }
}

/// Serves `zone` on a UDP port of loopback until the test ends.
async fn dns_server(zone: Arc<Zone>) -> SocketAddr {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else { return };
            let Ok(query) = Message::from_vec(&buf[..n]) else { continue };
            let reply = zone.answer(&query).to_vec().unwrap();
            let _ = socket.send_to(&reply, from).await;
        }
    });
    addr
}

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
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_srv_lookups_give_every_target_at_its_port_with_or_without_glue_records_and_follow_changes() {
    let zone = Arc::new(Zone::default());
    let server = dns_server(zone.clone()).await;
    let a: SocketAddr = "127.0.0.1:7101".parse().unwrap();
    let b: SocketAddr = "127.0.0.2:7102".parse().unwrap();
    zone.set(&[("n1", a), ("n2", b)]);
    let srv = DnsSrv::with_server(SERVICE, server).unwrap();
    for glue in [true, false] {
        zone.glue.store(glue, Ordering::Relaxed);
        let mut found = srv.lookup().await.unwrap();
        found.sort();
        assert_eq!(found, [a, b], "glue {glue}");
    }
    // "Rescheduled": n2 now answers at another IP and port; TTL 0, so the next lookup sees it.
    let moved: SocketAddr = "127.0.0.3:7202".parse().unwrap();
    zone.set(&[("n1", a), ("n2", moved)]);
    let mut found = srv.lookup().await.unwrap();
    found.sort();
    assert_eq!(found, [a, moved]);
    zone.set(&[]);
    // No records is a failed lookup: the driver keeps contacting the nodes found before.
    let err = srv.lookup().await.unwrap_err();
    assert!(err.detail.contains("no records"), "{err}");
    let missing = DnsSrv::with_server("_none._udp.ddshard.test.", server).unwrap();
    assert!(missing.lookup().await.is_err());
    assert!(srv.describe().contains(SERVICE));
}

/// One configuration for every node (the SRV name, bootstrap formation of 3): the nodes start
/// before their records exist, the records appear one by one, and exactly one cluster forms.
/// Then a fourth node starts while DNS still lists only an address nobody answers at (a seed
/// rescheduled away); once the records point at the live nodes it finds them by looking up
/// again, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_one_srv_name_form_one_cluster_and_a_late_node_follows_dns_to_the_moved_seeds() {
    ddshard::testkit::init_test_tracing();
    let zone = Arc::new(Zone::default());
    zone.glue.store(true, Ordering::Relaxed);
    let server = dns_server(zone.clone()).await;
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
        zone.set(&view);
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
    zone.set(&[("n1", gone)]);
    let mut late_cfg = srv_config("n4", dirs[3].path(), server, 0);
    late_cfg.membership.bootstrap_contact_points = 5;
    let late = Node::start(late_cfg).await.unwrap();
    let before = zone.srv_queries.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(up_ids(&late), Vec::<String>::new(), "alone: not Up, no cluster of its own");
    let asked = zone.srv_queries.load(Ordering::Relaxed) - before;
    assert!(asked >= 4, "a node alone looks up again every lookup_interval: {asked} lookups in 2 s");
    let view: Vec<(&str, SocketAddr)> = records.iter().map(|(t, a)| (t.as_str(), *a)).collect();
    zone.set(&view);
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
