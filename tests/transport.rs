//! Messaging: request/response between nodes, and bad input on the TCP port closing only the
//! offending connection.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ddshard::testkit::{TestCluster, eventually};
use ddshard::transport::PeerAddr;
use ddshard::transport::wire::{self, Hello, HelloReply, PROTOCOL_VERSION, RejectReason};
use ddshard::{Consistency, Error, Node, UniqueAddress};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONVERGE: Duration = Duration::from_secs(30);

fn peer_of(n: &Node) -> PeerAddr {
    PeerAddr { address: n.address().clone(), messaging_addr: n.messaging_addr() }
}

/// Reads until EOF or error; true when the server closed the connection.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // a reject reply may come first
            Err(_) => return false,
        }
    }
}

async fn still_serves(c: &TestCluster) {
    c.node(1)
        .replicator()
        .update::<ddshard::ddata::GSet, _>("alive", Consistency::All, Duration::from_secs(5), |s, _| s.insert("yes"))
        .await
        .expect("node keeps serving its peers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_gets_its_response_and_unknown_topics_answer_with_an_error() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let server = c.node(1).transport().clone();
    let mut inbox = server.subscribe("echo", 16);
    let srv = server.clone();
    tokio::spawn(async move {
        while let Some(m) = inbox.recv().await {
            let mut reply = m.body.to_vec();
            reply.reverse();
            srv.respond(&m.from, m.request_id.unwrap(), Ok(&reply)).unwrap();
        }
    });
    let client = c.node(0).transport();
    let to = peer_of(c.node(1));
    for i in 0..50u8 {
        let r = client.request(&to, "echo", &[1, 2, i], Duration::from_secs(5)).await.unwrap();
        assert_eq!(&r[..], &[i, 2, 1]);
    }
    let err = client.request(&to, "no-such-topic", b"x", Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(err, Error::PeerUnavailable { .. }), "{err}");
    // A frame over the limit is refused before it is sent.
    let big = vec![0u8; 9 * 1024 * 1024];
    let err = client.send(&to, "echo", &big).unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_close_only_that_connection() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let target = c.node(0).messaging_addr();
    let mut s = TcpStream::connect(target).await.unwrap();
    s.write_all(&[0, 0, 0, 12]).await.unwrap();
    s.write_all(b"\xc1\xc1garbage!!!").await.unwrap();
    assert!(closed_by_server(&mut s).await);
    still_serves(&c).await;
    assert!(c.node(0).transport().stats().connections_rejected.load(Ordering::Relaxed) >= 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_gib_length_prefix_closes_the_connection_without_allocating() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let mut s = TcpStream::connect(c.node(0).messaging_addr()).await.unwrap();
    s.write_all(&[0xff, 0xff, 0xff, 0xff]).await.unwrap();
    s.write_all(&[0u8; 64]).await.unwrap();
    assert!(closed_by_server(&mut s).await);
    still_serves(&c).await;
    assert!(c.node(0).transport().stats().connections_rejected.load(Ordering::Relaxed) >= 1);
    c.shutdown().await;
}

async fn handshake(target: std::net::SocketAddr, hello: &Hello) -> (TcpStream, Option<HelloReply>) {
    let mut s = TcpStream::connect(target).await.unwrap();
    let body = wire::encode(hello).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    let mut len = [0u8; 4];
    if s.read_exact(&mut len).await.is_err() {
        return (s, None);
    }
    let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).await.unwrap();
    (s, wire::decode(&buf).ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_with_foreign_cluster_id_or_version_or_old_incarnation_is_rejected_and_closed() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let target = c.node(0);
    let good = Hello {
        protocol_version: PROTOCOL_VERSION,
        cluster_id: "test-cluster".into(),
        from: UniqueAddress::new("outsider", 1),
        from_messaging_addr: "127.0.0.1:9".parse().unwrap(),
        to: target.address().clone(),
    };
    let cases = [
        (Hello { cluster_id: "evil".into(), ..good.clone() }, RejectReason::ForeignCluster("evil".into())),
        (
            Hello { protocol_version: 99, ..good.clone() },
            RejectReason::ProtocolVersion { theirs: 99, ours: PROTOCOL_VERSION },
        ),
        (
            Hello { to: UniqueAddress::new("n1", target.address().generation - 1), ..good.clone() },
            RejectReason::WrongAddressee(UniqueAddress::new("n1", target.address().generation - 1)),
        ),
    ];
    for (hello, expected) in cases {
        let (mut s, reply) = handshake(target.messaging_addr(), &hello).await;
        match reply {
            Some(HelloReply::Reject(r)) => assert_eq!(r, expected),
            other => panic!("expected a reject, got {other:?}"),
        }
        assert!(closed_by_server(&mut s).await);
    }
    let (_s, reply) = handshake(target.messaging_addr(), &good).await;
    assert!(matches!(reply, Some(HelloReply::Accept)), "a correct handshake is accepted");
    still_serves(&c).await;
    let rejected = c.node(0).transport().stats().connections_rejected.load(Ordering::Relaxed);
    assert_eq!(rejected, 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_to_a_peer_arrive_in_the_order_sent() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let mut inbox = c.node(1).transport().subscribe("seq", 100_000);
    let to = peer_of(c.node(1));
    let t = c.node(0).transport().clone();
    let n = 20_000u32;
    for i in 0..n {
        t.send(&to, "seq", &i.to_be_bytes()).unwrap();
    }
    for i in 0..n {
        let m = tokio::time::timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
        assert_eq!(u32::from_be_bytes(m.body[..4].try_into().unwrap()), i);
        assert_eq!(m.from.address, *c.node(0).address());
    }
    eventually(Duration::from_secs(5), "sent counter", || {
        std::future::ready((t.stats().frames_sent.load(Ordering::Relaxed) >= n as u64).then_some(()))
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_node_sends_to_itself_keep_their_order() {
    let mut c = TestCluster::start(1).await.unwrap();
    let me = peer_of(c.node(0));
    let t = c.node(0).transport().clone();
    let mut inbox = t.subscribe("self", 10_000);
    for i in 0..5_000u32 {
        t.send(&me, "self", &i.to_be_bytes()).unwrap();
    }
    for i in 0..5_000u32 {
        let m = tokio::time::timeout(Duration::from_secs(10), inbox.recv()).await.unwrap().unwrap();
        assert_eq!(u32::from_be_bytes(m.body[..4].try_into().unwrap()), i);
    }
    c.shutdown().await;
}
