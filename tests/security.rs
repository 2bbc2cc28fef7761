//! A cluster with a secret lets no one in: nodes and clients without the secret are never
//! members, their gossip changes nothing and their connections deliver nothing; members form,
//! replicate and serve entities over authenticated, encrypted links.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::testkit::{TestCluster, eventually};
use ddshard::transport::PeerAddr;
use ddshard::transport::wire::{self, Hello, HelloReply, PROTOCOL_VERSION, RejectReason};
use ddshard::{ClusterSecret, Consistency, Error, Node, NodeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONVERGE: Duration = Duration::from_secs(30);

/// Secret `tag`'s key: 64 hex digits, the same for every node given the same tag.
fn secret(tag: char) -> ClusterSecret {
    let text: String = (0..32u32).map(|i| format!("{:02x}", (i * 151 + tag as u32 * 89) as u8 ^ 0x5c)).collect();
    ClusterSecret::new(text).unwrap()
}

fn peer_of(n: &Node) -> PeerAddr {
    PeerAddr { address: n.address().clone(), messaging_addr: n.messaging_addr() }
}

fn member_ids(n: &Node) -> Vec<String> {
    let mut ids: Vec<String> = n.members().iter().map(|m| m.node_id().to_string()).collect();
    ids.sort();
    ids
}

/// Members `0..members` share secret 'a'; any further node gets `outsider(i)`'s secret.
async fn cluster_with_outsider(
    members: usize,
    outsider: impl Fn(usize) -> Option<ClusterSecret> + Send + Sync + 'static,
) -> TestCluster {
    let c = TestCluster::start_with(members, move |i, cfg: &mut NodeConfig| {
        cfg.cluster_secret = if i < members { Some(secret('a')) } else { outsider(i) };
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    c
}

/// Watches the members while `outsider`'s gossip keeps arriving, until each member dropped at
/// least `datagrams` of it as unauthenticated; membership must never change meanwhile.
async fn outsider_stays_out(c: &TestCluster, members: usize, outsider: &Node, datagrams: u64) {
    let expected: Vec<String> = (0..members).map(TestCluster::node_id).collect();
    eventually(CONVERGE, "members dropped the outsider's gossip as unauthenticated", || {
        for i in 0..members {
            assert_eq!(member_ids(c.node(i)), expected, "the outsider (or a change) appeared in n{}'s members", i + 1);
        }
        assert!(
            !member_ids(outsider).iter().any(|id| expected.contains(id)),
            "the outsider learned the members: {:?}",
            member_ids(outsider)
        );
        let dropped = (0..members).map(|i| c.node(i).gossip_stats().datagrams_unauthenticated).min().unwrap();
        std::future::ready((dropped >= datagrams).then_some(()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_secret_forms_replicates_and_serves_entities_over_encrypted_links() {
    let mut c = cluster_with_outsider(3, |_| None).await;
    let probe = common::Probe::default();
    let mut regions = Vec::new();
    for i in 0..3 {
        regions.push(common::start_counter(c.node(i), &probe, common::settings()).await);
    }
    for k in 0..30 {
        let id = format!("e{k}");
        let r = regions[k % 3].ask(&id, common::CounterMsg::Add(1)).await.unwrap();
        assert_eq!(r, common::CounterReply::Value(1));
    }
    let nodes: std::collections::BTreeSet<String> = probe.nodes_seen.lock().unwrap().values().cloned().collect();
    assert!(nodes.len() > 1, "entities ran on one node only: {nodes:?}; messaging between members is not exercised");
    c.node(0)
        .replicator()
        .update::<ddshard::ddata::GSet, _>("secure", Consistency::All, Duration::from_secs(10), |s, _| s.insert("x"))
        .await
        .expect("a write to every replica over authenticated links");
    for i in 0..3 {
        let s = c.node(i).gossip_stats();
        assert_eq!(s.datagrams_unauthenticated, 0, "members' gossip is authentic");
        assert_eq!(c.node(i).transport().stats().connections_rejected, 0);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_secret_never_becomes_a_member_and_cannot_deliver_a_frame() {
    let mut c = cluster_with_outsider(2, |_| Some(secret('b'))).await;
    let outsider_index = c.add_node().await.unwrap();
    let outsider = c.node(outsider_index).clone();
    outsider_stays_out(&c, 2, &outsider, 10).await;

    // Its messaging connections are refused at the handshake: nothing reaches the topic.
    let mut inbox = c.node(0).transport().subscribe("probe", 16);
    let to = peer_of(c.node(0));
    let err = eventually(CONVERGE, "the outsider learns that the member refused it", || {
        std::future::ready(outsider.transport().send(&to, "probe", b"let me in").err())
    })
    .await;
    assert!(matches!(err, Error::PeerUnavailable { ref reason, .. } if reason.contains("secret")), "{err}");
    let r = outsider.transport().request(&to, "probe", b"?", Duration::from_secs(10)).await;
    assert!(matches!(r, Err(Error::PeerUnavailable { .. })), "{r:?}");
    assert!(inbox.try_recv().is_err(), "a frame from a node without the secret was delivered");
    assert!(c.node(0).transport().stats().connections_rejected >= 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_any_secret_is_not_heard_by_a_cluster_that_has_one() {
    let mut c = cluster_with_outsider(2, |_| None).await;
    let outsider_index = c.add_node().await.unwrap();
    let outsider = c.node(outsider_index).clone();
    outsider_stays_out(&c, 2, &outsider, 10).await;
    c.shutdown().await;
}

async fn write_frame(s: &mut TcpStream, body: &[u8]) {
    let mut buf = (body.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(body);
    s.write_all(&buf).await.unwrap();
}

/// The next frame, or `None` once the server closed the connection.
async fn read_frame(s: &mut TcpStream) -> Option<Vec<u8>> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.ok()?;
        let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut buf).await.ok()?;
        Some(buf)
    })
    .await
    .expect("the server answers or closes within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_speaking_the_plain_handshake_is_refused_and_delivers_nothing() {
    let mut c = cluster_with_outsider(2, |_| None).await;
    let node = c.node(0).clone();
    let mut inbox = node.transport().subscribe("probe", 16);
    let rejected_before = node.transport().stats().connections_rejected;
    // A client that knows the cluster id and a member's exact incarnation, but not the secret.
    let mut s = TcpStream::connect(node.messaging_addr()).await.unwrap();
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        cluster_id: "test-cluster".into(),
        from: c.node(1).address().clone(),
        from_messaging_addr: c.node(1).messaging_addr(),
        to: node.address().clone(),
    };
    write_frame(&mut s, &wire::encode(&hello).unwrap()).await;
    let reply = read_frame(&mut s).await.expect("a plain-text refusal");
    let reply: HelloReply = wire::decode(&reply).unwrap();
    assert!(matches!(reply, HelloReply::Reject(RejectReason::Unauthenticated)), "{reply:?}");
    // Frames sent anyway go nowhere, and the connection is closed.
    let frame = wire::Frame::Message { topic: "probe", body: b"forged" }.encode().unwrap();
    let _ = s.write_all(&[&(frame.len() as u32).to_be_bytes()[..], &frame].concat()).await;
    assert!(read_frame(&mut s).await.is_none(), "the connection stays open");
    assert!(inbox.try_recv().is_err());
    // Counted once the server's side of the connection has ended, which may be just after the
    // client saw it close: polled, with a deadline.
    let rejected = || node.transport().stats().connections_rejected;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rejected() < rejected_before + 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(rejected(), rejected_before + 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_the_secure_handshake_is_closed_at_the_deadline() {
    let mut c = TestCluster::start_with(1, |_, cfg| {
        cfg.cluster_secret = Some(secret('a'));
        cfg.transport.connect_timeout = Duration::from_millis(500);
    })
    .await
    .unwrap();
    let node = c.node(0).clone();
    // Garbage of a plausible first-frame size, then silence.
    let mut s = TcpStream::connect(node.messaging_addr()).await.unwrap();
    write_frame(&mut s, &[0x42; 48]).await;
    let mut silent = TcpStream::connect(node.messaging_addr()).await.unwrap();
    let reply = read_frame(&mut s).await.map(|f| wire::decode::<HelloReply>(&f));
    assert!(matches!(reply, Some(Ok(HelloReply::Reject(RejectReason::Unauthenticated)))), "{reply:?}");
    assert!(read_frame(&mut s).await.is_none(), "closed after the refusal");
    assert!(read_frame(&mut silent).await.is_none(), "a silent connection is closed at the handshake deadline");
    eventually(CONVERGE, "both connections counted as rejected", || {
        std::future::ready((node.transport().stats().connections_rejected >= 2).then_some(()))
    })
    .await;
    c.shutdown().await;
}

/// What chitchat's own socket sends with no secret: a real member's gossip, forged by an
/// outsider who runs chitchat with keys of its choosing.
async fn forged_gossip(
    seed: std::net::SocketAddr,
    node_id: &str,
    generation: u64,
    keys: Vec<(String, String)>,
) -> chitchat::ChitchatHandle {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    drop(socket);
    let config = chitchat::ChitchatConfig {
        chitchat_id: chitchat::ChitchatId::new(node_id, generation, addr),
        cluster_id: "test-cluster".into(),
        gossip_interval: Duration::from_millis(50),
        listen_addr: addr,
        seed_nodes: vec![seed.to_string()],
        failure_detector_config: chitchat::FailureDetectorConfig::default(),
        marked_for_deletion_grace_period: Duration::from_secs(3600),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: chitchat::ProtocolVersion::V0,
    };
    chitchat::spawn_chitchat(config, keys, &chitchat::transport::UdpTransport).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_gossip_with_down_marks_fake_members_and_a_max_generation_changes_nothing() {
    let mut c = cluster_with_outsider(3, |_| None).await;
    let before: Vec<_> = c.node(0).members().iter().map(|m| (m.address().clone(), m.status())).collect();
    let seed = c.node(0).gossip_addr();
    let n2 = c.node(1).address().clone();
    let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
    let _superseding =
        forged_gossip(seed, "n2", u64::MAX, vec![kv("status", "up"), kv("up", "0"), kv("msg", "127.0.0.1:9")]).await;
    let _downer = forged_gossip(
        seed,
        "ghost",
        1,
        vec![kv("status", "up"), kv("up", "0"), kv("msg", "127.0.0.1:9"), kv(&format!("down:{n2}"), "1")],
    )
    .await;
    let mut silent_up = Vec::new();
    for k in 0..10 {
        silent_up.push(forged_gossip(seed, &format!("fake-{k}"), 1, vec![kv("status", "up"), kv("up", "0")]).await);
    }
    eventually(CONVERGE, "the forged gossip reached the members and was dropped", || {
        for i in 0..3 {
            let now: Vec<_> = c.node(i).members().iter().map(|m| (m.address().clone(), m.status())).collect();
            assert_eq!(now, before, "n{}'s membership changed under forged gossip", i + 1);
            assert!(!c.node(i).is_shut_down(), "n{} stopped under forged gossip", i + 1);
        }
        let dropped = c.node(0).gossip_stats().datagrams_unauthenticated;
        std::future::ready((dropped >= 50).then_some(()))
    })
    .await;
    c.shutdown().await;
}

/// Raises this process's open-file limit to its hard limit; the flood tests need thousands of
/// sockets. Panics (never skips) if the hard limit is too low, naming it.
fn allow_open_files(needed: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur >= needed,
        "this test needs {needed} open files; the hard limit (ulimit -Hn) is {}",
        lim.rlim_cur
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_connections_and_an_8_mib_length_prefix_leave_the_node_serving() {
    allow_open_files(6_000);
    // A handshake deadline far beyond this test: every early close is the limits' doing.
    let mut c = TestCluster::start_with(2, |_, cfg| {
        cfg.cluster_secret = Some(secret('a'));
        cfg.transport.connect_timeout = Duration::from_secs(120);
        cfg.transport.unreachable_give_up = Duration::from_secs(120);
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let probe = common::Probe::default();
    let regions = [
        common::start_counter(c.node(0), &probe, common::settings()).await,
        common::start_counter(c.node(1), &probe, common::settings()).await,
    ];
    let rejected_before = node.transport().stats().connections_rejected;
    let mut idle = Vec::new();
    for _ in 0..2_000 {
        idle.push(TcpStream::connect(node.messaging_addr()).await.unwrap());
    }
    let mut huge = TcpStream::connect(node.messaging_addr()).await.unwrap();
    huge.write_all(&(8u32 << 20).to_be_bytes()).await.unwrap();
    // All but a handful from this one address are closed at once; the rest at the deadline.
    eventually(Duration::from_secs(20), "connections over the per-address handshake limit closed at once", || {
        let rejected = node.transport().stats().connections_rejected - rejected_before;
        std::future::ready((rejected >= 2_000 - 32).then_some(()))
    })
    .await;
    // Members keep being served meanwhile: entities on both nodes answer, replication works.
    for k in 0..20 {
        let r = regions[k % 2].ask(&format!("e{k}"), common::CounterMsg::Add(1)).await;
        assert_eq!(r.unwrap(), common::CounterReply::Value(1));
    }
    node.replicator()
        .update::<ddshard::ddata::GSet, _>("alive", Consistency::All, Duration::from_secs(10), |s, _| s.insert("yes"))
        .await
        .expect("the node keeps replicating to its peers");
    assert!(read_frame(&mut huge).await.is_none(), "the 8 MiB length prefix closes its connection");
    drop(idle);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stays_unreachable_loses_its_writer_and_its_requests_fail_fast() {
    let mut c = TestCluster::start_with(1, |_, cfg| {
        cfg.transport.connect_timeout = Duration::from_millis(300);
        cfg.transport.unreachable_give_up = Duration::from_secs(1);
    })
    .await
    .unwrap();
    let node = c.node(0).clone();
    // An address nothing listens on, outside the range port-0 binds draw from.
    let gone = std::net::SocketAddr::from(([127, 0, 0, 1], ddshard::testkit::unused_port([127, 0, 0, 1].into())));
    let to = PeerAddr { address: ddshard::UniqueAddress::new("vanished", 3), messaging_addr: gone };
    let before = node.transport().peer_writers();
    let r = node.transport().request(&to, "probe", b"?", Duration::from_secs(60)).await;
    assert!(matches!(r, Err(Error::PeerUnavailable { ref reason, .. }) if reason.contains("not reachable")), "{r:?}");
    assert_eq!(node.transport().peer_writers(), before, "the writer of the unreachable peer is gone");
    assert_eq!(node.transport().pending_requests(), 0);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_queue_is_bounded_in_bytes_not_only_in_frames() {
    let mut c = TestCluster::start_with(1, |_, cfg| {
        cfg.transport.max_frame_size = 1 << 20;
        cfg.transport.send_queue_max_bytes = (1 << 20) + 4;
    })
    .await
    .unwrap();
    let node = c.node(0).clone();
    // A peer that completes the handshake and then never reads.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow =
        PeerAddr { address: ddshard::UniqueAddress::new("slow", 1), messaging_addr: listener.local_addr().unwrap() };
    let accept = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let hello: Hello = wire::decode(&read_frame(&mut s).await.unwrap()).unwrap();
        write_frame(&mut s, &wire::encode(&HelloReply::Accept { address: hello.to }).unwrap()).await;
        s
    });
    node.transport().send(&slow, "probe", b"first").unwrap();
    let _s = tokio::time::timeout(CONVERGE, accept).await.expect("the node dials the peer").unwrap();
    let body = vec![7u8; 64 << 10];
    let mut sent = 0usize;
    let full = loop {
        match node.transport().send(&slow, "probe", &body) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        // 65,536 frames are allowed: only the byte bound can stop this before 64 MiB.
        assert!(sent < 1_000, "64 MiB queued with a 1 MiB byte bound");
        if sent.is_multiple_of(16) {
            tokio::task::yield_now().await;
        }
    };
    assert!(matches!(full, Error::SendQueueFull { .. }), "{full:?}");
    println!("SendQueueFull after {sent} frames of 64 KiB (1 MiB queue bound plus socket buffers)");
    c.shutdown().await;
}

/// A UDP relay in front of `target`, as an attacker on the path would run it: forwards each
/// datagram (a client's to `target`, `target`'s answers back to the client) and keeps a copy.
async fn recording_relay(target: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Mutex<Vec<Vec<u8>>>>) {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    let captured = Arc::new(Mutex::new(Vec::new()));
    let copies = captured.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        let mut client = None;
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            copies.lock().unwrap().push(buf[..n].to_vec());
            let to = if from == target { client } else { Some(target) };
            if from != target {
                client = Some(from);
            }
            if let Some(to) = to {
                let _ = socket.send_to(&buf[..n], to).await;
            }
        }
    });
    (addr, captured)
}

/// S1 of the round-3 security review: gossip captured while the cluster formed, replayed to a
/// node restarted after the members it describes had left. Returns whether the replay made
/// the restarted node list a departed member.
async fn replay_formation_gossip_after_leaves_and_a_restart(accept_unstamped: bool) -> (bool, u64) {
    let window = Duration::from_secs(2);
    let seeds_via_relay: Arc<Mutex<std::collections::HashMap<usize, std::net::SocketAddr>>> = Arc::default();
    let seeds = seeds_via_relay.clone();
    let mut c = TestCluster::start_with(1, move |i, cfg| {
        cfg.cluster_secret = Some(secret('a'));
        cfg.membership.gossip_freshness_window = window;
        cfg.membership.accept_unstamped_gossip = accept_unstamped;
        if let Some(relay) = seeds.lock().unwrap().get(&i) {
            cfg.seeds = vec![(*relay).into()];
        }
    })
    .await
    .unwrap();
    let mut captures = Vec::new();
    for i in 1..3 {
        let (relay, captured) = recording_relay(c.node(0).gossip_addr()).await;
        seeds_via_relay.lock().unwrap().insert(i, relay);
        captures.push(captured);
        c.add_node().await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    for i in 1..3 {
        c.node(i).leave().await.unwrap();
        c.kill(i).await;
    }
    let captured: Vec<Vec<u8>> = captures.iter().flat_map(|c| c.lock().unwrap().clone()).collect();
    let captured_at = std::time::Instant::now();
    assert!(captured.len() >= 4, "the relays saw the joins' gossip: {} datagrams", captured.len());
    c.restart_forming(0).await.unwrap();
    eventually(CONVERGE, "n1 restarted alone", || std::future::ready(TestCluster::is_member(c.node(0)).then_some(())))
        .await;
    assert_eq!(member_ids(c.node(0)), ["n1"]);
    // Every capture is older than the window now.
    tokio::time::sleep(
        (captured_at + window + Duration::from_millis(500)).saturating_duration_since(std::time::Instant::now()),
    )
    .await;
    let attacker = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let victim = c.node(0).gossip_addr();
    for _ in 0..3 {
        for d in &captured {
            attacker.send_to(d, victim).await.unwrap();
        }
    }
    // Watch for ten gossip rounds after the replays were handled.
    // Counters are snapshots: each read takes a new one.
    let refused = || {
        let stats = c.node(0).gossip_stats();
        stats.datagrams_stale + stats.datagrams_replayed + stats.datagrams_unstamped
    };
    let mut phantom = false;
    let watch_until = std::time::Instant::now() + Duration::from_millis(3_000);
    while std::time::Instant::now() < watch_until {
        phantom |= member_ids(c.node(0)) != ["n1"];
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(c.node(0).gossip_stats().downs_published, 0, "the replay made n1 down someone");
    assert!(!c.node(0).is_shut_down(), "the replay stopped n1");
    let mut buf = [0u8; 16];
    let answered = tokio::time::timeout(Duration::from_millis(10), attacker.recv_from(&mut buf)).await.is_ok();
    assert!(!answered || accept_unstamped, "a replayed datagram was answered at the attacker's address");
    let refused = refused();
    c.shutdown().await;
    (phantom, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gossip_captured_at_formation_and_replayed_after_two_members_left_and_n1_restarted_changes_nothing() {
    let (phantom, refused) = replay_formation_gossip_after_leaves_and_a_restart(false).await;
    assert!(!phantom, "a replayed datagram brought a departed member back into n1's list");
    assert!(refused >= 12, "every replayed datagram is refused and counted: {refused}");
}

/// The same replay against a cluster upgrading from unstamped gossip: the departed members come
/// back, which is why `accept_unstamped_gossip` is documented as a two-restart window only, and
/// the proof that the scenario above is sharp enough to fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_upgrading_from_unstamped_gossip_the_same_replay_brings_departed_members_back() {
    let (phantom, _) = replay_formation_gossip_after_leaves_and_a_restart(true).await;
    assert!(phantom, "the replay reproduced S1 without stamps");
}

/// S3 of the round-3 security review: an outsider that holds silent connections from many
/// addresses used to take every inbound slot (handshaking and established shared one pool of
/// 1,024), so a restarted member was refused for as long as the outsider's connections lived,
/// and the resolver downed it. Deadlines are set far out here, so only the slots' own rule can
/// let the member in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_addresses_holding_32_silent_connections_each_do_not_lock_out_a_restarted_member() {
    allow_open_files(8_000);
    let mut c = TestCluster::start_with(2, |_, cfg| {
        cfg.cluster_secret = Some(secret('a'));
        ddshard::testkit::fast_downing(cfg);
        cfg.transport.connect_timeout = Duration::from_secs(60);
        cfg.transport.first_frame_timeout = Duration::from_secs(60);
        cfg.transport.unreachable_give_up = Duration::from_secs(120);
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let mut silent = Vec::new();
    for k in 2..42u8 {
        for _ in 0..32 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(std::net::SocketAddr::from(([127, 0, 0, k], 0))).unwrap();
            silent.push(socket.connect(n1.messaging_addr()).await.unwrap());
        }
    }
    // And ten more addresses open another silent connection every 20 ms each, to take any
    // slot that frees up (the killed n2's, for one).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut pressure = Vec::new();
    for k in 42..52u8 {
        let (stop, target) = (stop.clone(), n1.messaging_addr());
        pressure.push(tokio::spawn(async move {
            let mut held = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind(std::net::SocketAddr::from(([127, 0, 0, k], 0))).unwrap();
                if let Ok(s) = socket.connect(target).await {
                    held.push(s);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.restart(1).await.unwrap();
    let restarted = std::time::Instant::now();
    let n2 = c.node(1).clone();
    // Whatever n2 writes reaches n1 only over n2's link to n1 (deltas and anti-entropy both;
    // two nodes, so no third one can carry it).
    n2.replicator()
        .update::<ddshard::ddata::GSet, _>("from-n2", Consistency::Local, Duration::from_secs(1), |s, _| {
            s.insert("restarted")
        })
        .await
        .unwrap();
    eventually(CONVERGE, "n1 holds what the restarted n2 wrote", || {
        let n1 = n1.clone();
        async move {
            let read =
                n1.replicator().read_local_with::<ddshard::ddata::GSet, _, _>("from-n2", |s| s.contains("restarted"));
            read.await.ok().flatten().filter(|held| *held)
        }
    })
    .await;
    let took = restarted.elapsed();
    let closed = n1.transport().stats().connections_rejected;
    println!(
        "restarted n2 reached n1 {took:?} after its restart, past 1,280 silent connections and ten more addresses \
         opening more ({closed} closed by n1)"
    );
    assert!(took < Duration::from_secs(10), "n2 needed {took:?} to reach n1");
    c.await_converged(CONVERGE).await;
    for (_, n) in c.running() {
        assert_eq!(n.gossip_stats().downs_published, 0, "{} downed a member", n.node_id());
    }
    stop.store(true, Ordering::Relaxed);
    for p in pressure {
        p.abort();
    }
    drop(silent);
    c.shutdown().await;
}
