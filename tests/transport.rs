//! Messaging: request/response between nodes, and bad input on the TCP port closing only the
//! offending connection.

use std::net::SocketAddr;
use std::time::Duration;

use ddshard::testkit::{TestCluster, eventually};
use ddshard::transport::wire::{self, Frame, Hello, HelloReply, PROTOCOL_VERSION, RejectReason, ResponseBody};
use ddshard::transport::{Inbound, PeerAddr, Transport};
use ddshard::{Consistency, Error, Node, TransportSettings, UniqueAddress};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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
    assert!(c.node(0).transport().stats().connections_rejected >= 1);
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
    assert!(c.node(0).transport().stats().connections_rejected >= 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_frame_over_the_handshake_limit_closes_the_connection_before_any_bytes_are_buffered() {
    // A long handshake timeout: only the size limit can close this connection in time.
    let mut c = TestCluster::start_with(2, |_, cfg| {
        cfg.transport.connect_timeout = Duration::from_secs(120);
        cfg.transport.unreachable_give_up = Duration::from_secs(120);
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let mut s = TcpStream::connect(c.node(0).messaging_addr()).await.unwrap();
    // Announces a 1 MiB hello (well under max_frame_size) and sends none of it: an outsider
    // must not make the node reserve a frame-sized buffer before it is authenticated.
    s.write_all(&(1u32 << 20).to_be_bytes()).await.unwrap();
    assert!(closed_by_server(&mut s).await, "closed for its announced size, not after the handshake timeout");
    await_rejected(c.node(0), 1).await;
    still_serves(&c).await;
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
    let good = member_hello(c.node(1), target, "127.0.0.1:9".parse().unwrap());
    let older_n2 = UniqueAddress::new("n2", c.node(1).address().generation - 1);
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
        // Only members may connect: a stranger, or an incarnation a newer one replaced.
        (
            Hello { from: UniqueAddress::new("outsider", 1), ..good.clone() },
            RejectReason::NotAMember("not a member here".into()),
        ),
        (
            Hello { from: older_n2, ..good.clone() },
            RejectReason::NotAMember("a newer incarnation of it is a member".into()),
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
    assert!(matches!(reply, Some(HelloReply::Accept { .. })), "a correct handshake is accepted");
    still_serves(&c).await;
    let rejected = c.node(0).transport().stats().connections_rejected;
    assert_eq!(rejected, 5);
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
        std::future::ready((t.stats().frames_sent >= n as u64).then_some(()))
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

// ---- Transport after the handshake: frame limits, malformed frames, stuck handshakes. ----

/// `transport.max_frame_size` of the clusters below: small, so frames at the limit are cheap.
const MAX_FRAME: usize = 64 * 1024;

/// `transport.connect_timeout` (which bounds an inbound handshake) of the handshake test.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);

async fn converged_cluster_with_max_frame(max_frame_size: usize) -> TestCluster {
    let c = TestCluster::start_with(2, move |_, cfg| cfg.transport.max_frame_size = max_frame_size).await.unwrap();
    c.await_converged(CONVERGE).await;
    c
}

fn rejected(n: &Node) -> u64 {
    n.transport().stats().connections_rejected
}

/// Waits until node `n` has counted exactly `expected` rejected connections (the counter is
/// bumped just after the socket is dropped, so a client may see the close first).
async fn await_rejected(n: &Node, expected: u64) {
    eventually(Duration::from_secs(10), &format!("{expected} rejected connections counted"), || {
        std::future::ready((rejected(n) == expected).then_some(()))
    })
    .await;
    assert_eq!(rejected(n), expected, "no more connections rejected than expected");
}

/// A hello from a raw client that speaks as member `as_member` (only members are accepted;
/// with no cluster secret nothing proves the claim), with the right cluster id, version and
/// addressee; responses to its requests go to `reply_to` (writers are keyed by incarnation and
/// address, so they reach the raw client, not the real member).
fn member_hello(as_member: &Node, target: &Node, reply_to: SocketAddr) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        cluster_id: "test-cluster".into(),
        from: as_member.address().clone(),
        from_messaging_addr: reply_to,
        to: target.address().clone(),
    }
}

/// A raw connection to `target` whose handshake was accepted.
async fn accepted(target: SocketAddr, hello: &Hello) -> TcpStream {
    let (s, reply) = handshake(target, hello).await;
    assert!(matches!(reply, Some(HelloReply::Accept { .. })), "handshake accepted, got {reply:?}");
    s
}

/// Writes one length-prefixed frame in a single write.
async fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    s.write_all(&buf).await
}

/// Reads one length-prefixed frame (panics after 10 s).
async fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await?;
        let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut buf).await?;
        std::io::Result::Ok(buf)
    })
    .await
    .expect("a frame within 10 s")
    .expect("reading a frame")
}

async fn next_inbound(inbox: &mut mpsc::Receiver<Inbound>) -> Inbound {
    tokio::time::timeout(Duration::from_secs(10), inbox.recv())
        .await
        .expect("a message within 10 s")
        .expect("subscription open")
}

fn message(topic: &str, body: &[u8]) -> Vec<u8> {
    Frame::Message { topic, body }.encode().unwrap().to_vec()
}

/// The encoding of `encode(body)` that is exactly `size` bytes long, with the body's length.
fn encoded_to_size(size: usize, encode: impl Fn(&[u8]) -> Vec<u8>) -> (Vec<u8>, usize) {
    let mut body_len = size - 64;
    for _ in 0..8 {
        let encoded = encode(&vec![0x5a; body_len]);
        if encoded.len() == size {
            return (encoded, body_len);
        }
        body_len = (body_len + size).checked_sub(encoded.len()).expect("frame overhead under 64 bytes");
    }
    panic!("no body length encodes to exactly {size} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_of_exactly_max_frame_size_after_the_handshake_is_processed_and_answered() {
    let mut c = converged_cluster_with_max_frame(MAX_FRAME).await;
    let node = c.node(0);
    let mut inbox = node.transport().subscribe("probe", 16);
    // Responses travel over a connection the node dials to the hello's messaging address.
    let reply_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hello = member_hello(c.node(1), node, reply_listener.local_addr().unwrap());
    let mut s = accepted(node.messaging_addr(), &hello).await;

    let (at_limit, at_limit_body) =
        encoded_to_size(MAX_FRAME, |body| Frame::Request { id: 1, topic: "probe", body }.encode().unwrap().to_vec());
    let after = Frame::Request { id: 2, topic: "probe", body: b"after" }.encode().unwrap();
    write_frame(&mut s, &at_limit).await.unwrap();
    write_frame(&mut s, &after).await.unwrap();
    let expected = [(1u64, at_limit_body), (2, b"after".len())];
    for (id, len) in expected {
        let m = next_inbound(&mut inbox).await;
        assert_eq!(m.request_id, Some(id), "requests dispatched in order");
        assert_eq!(m.body.len(), len, "request {id} delivered whole");
        assert_eq!(m.from.address, hello.from);
        node.transport().respond(&m.from, id, Ok(&(len as u32).to_be_bytes())).unwrap();
    }

    let (mut back, _) = tokio::time::timeout(Duration::from_secs(10), reply_listener.accept())
        .await
        .expect("the node dials the requester to answer")
        .unwrap();
    let their_hello: Hello = wire::decode(&read_frame(&mut back).await).unwrap();
    assert_eq!(their_hello.from, *node.address());
    assert_eq!(their_hello.to, hello.from);
    let accept = HelloReply::Accept { address: their_hello.to.clone() };
    write_frame(&mut back, &wire::encode(&accept).unwrap()).await.unwrap();
    for (id, len) in expected {
        let f = read_frame(&mut back).await;
        match Frame::decode(&f).unwrap() {
            Frame::Response { id: got, body: ResponseBody::Ok(body) } => {
                assert_eq!(got, id);
                assert_eq!(body, (len as u32).to_be_bytes());
            }
            other => panic!("expected the response to request {id}, got {other:?}"),
        }
    }

    // The node's own sender agrees with the receiver on the limit: a frame of exactly
    // max_frame_size from n2 arrives, one byte more is refused before it is sent.
    let sender = c.node(1).transport();
    let to = peer_of(node);
    let (_, body_len) = encoded_to_size(MAX_FRAME, |body| message("probe", body));
    let body = vec![0x5a; body_len];
    sender.send(&to, "probe", &body).expect("a frame of exactly max_frame_size may be sent");
    let m = next_inbound(&mut inbox).await;
    assert_eq!((m.body.len(), m.request_id), (body_len, None));
    assert_eq!(m.from.address, *c.node(1).address());
    let one_more = [&body[..], &[0]].concat();
    assert_eq!(message("probe", &one_more).len(), MAX_FRAME + 1);
    let err = sender.send(&to, "probe", &one_more).unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err}");

    assert_eq!(rejected(node), 0, "a frame at the limit rejects no connection");
    drop((s, back));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_one_byte_over_max_frame_size_closes_only_that_connection() {
    let mut c = converged_cluster_with_max_frame(MAX_FRAME).await;
    let node = c.node(0);
    let mut inbox = node.transport().subscribe("probe", 16);
    let hello = member_hello(c.node(1), node, "127.0.0.1:9".parse().unwrap());
    let mut s = accepted(node.messaging_addr(), &hello).await;
    write_frame(&mut s, &message("probe", b"before")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"before");

    let (over, _) = encoded_to_size(MAX_FRAME + 1, |body| message("probe", body));
    // The server may close while the body is still being written; the close is what counts.
    let _ = write_frame(&mut s, &over).await;
    assert!(closed_by_server(&mut s).await, "a frame over the limit closes the connection");
    assert!(inbox.try_recv().is_err(), "the oversized frame is not delivered");
    await_rejected(node, 1).await;

    still_serves(&c).await;
    let mut fresh = accepted(node.messaging_addr(), &hello).await;
    write_frame(&mut fresh, &message("probe", b"after")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"after");
    drop(fresh);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_gib_length_prefix_after_the_handshake_closes_only_that_connection_without_allocating() {
    let mut c = converged_cluster_with_max_frame(MAX_FRAME).await;
    let node = c.node(0);
    let mut inbox = node.transport().subscribe("probe", 16);
    let hello = member_hello(c.node(1), node, "127.0.0.1:9".parse().unwrap());
    let mut s = accepted(node.messaging_addr(), &hello).await;
    write_frame(&mut s, &message("probe", b"before")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"before", "an authenticated, working connection");
    // A member's connection announces a frame of u32::MAX bytes: refused from the prefix alone
    // (a 4 GiB buffer is never reserved), whatever follows.
    s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let _ = s.write_all(&[0x5a; 64]).await;
    assert!(closed_by_server(&mut s).await, "a 4 GiB prefix closes the connection");
    assert!(inbox.try_recv().is_err(), "nothing of it is delivered");
    await_rejected(node, 1).await;
    still_serves(&c).await;
    let mut fresh = accepted(node.messaging_addr(), &hello).await;
    write_frame(&mut fresh, &message("probe", b"after")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"after", "the node takes new connections");
    drop(fresh);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frame_after_the_handshake_closes_only_that_connection() {
    let mut c = converged_cluster_with_max_frame(MAX_FRAME).await;
    let node = c.node(0);
    let mut inbox = node.transport().subscribe("probe", 16);
    let hello = member_hello(c.node(1), node, "127.0.0.1:9".parse().unwrap());
    let valid = message("probe", b"cut short");
    let cases: [(&str, Vec<u8>); 4] = [
        ("an unknown frame kind", b"\xc1\xc1garbage!!!".to_vec()),
        ("MessagePack that is not a frame", wire::encode(&"not a frame").unwrap().to_vec()),
        // Kind, topic length 5, then only "pr": the header promises more than the frame holds.
        ("a header cut short", valid[..5].to_vec()),
        ("an empty frame", Vec::new()),
    ];
    for (i, (what, bad)) in cases.iter().enumerate() {
        let mut s = accepted(node.messaging_addr(), &hello).await;
        write_frame(&mut s, &message("probe", what.as_bytes())).await.unwrap();
        assert_eq!(&next_inbound(&mut inbox).await.body[..], what.as_bytes(), "connection works before {what}");
        write_frame(&mut s, bad).await.unwrap();
        write_frame(&mut s, &message("probe", b"behind the bad frame")).await.unwrap();
        assert!(closed_by_server(&mut s).await, "{what} closes the connection");
        assert!(inbox.try_recv().is_err(), "nothing after {what} is delivered");
        await_rejected(node, i as u64 + 1).await;
    }

    still_serves(&c).await;
    let mut fresh = accepted(node.messaging_addr(), &hello).await;
    write_frame(&mut fresh, &message("probe", b"after")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"after");
    drop(fresh);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_that_never_completes_is_closed_after_the_handshake_timeout() {
    let mut c = TestCluster::start_with(2, |_, cfg| cfg.transport.connect_timeout = HANDSHAKE_TIMEOUT).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0);
    let target = node.messaging_addr();
    let mut inbox = node.transport().subscribe("probe", 16);
    let hello = member_hello(c.node(1), node, "127.0.0.1:9".parse().unwrap());
    let hello_bytes = wire::encode(&hello).unwrap();
    let prefix = (hello_bytes.len() as u32).to_be_bytes();

    let opened = tokio::time::Instant::now();
    let mut stuck = Vec::new();
    for what in ["nothing", "half a length prefix", "half a hello"] {
        let mut s = TcpStream::connect(target).await.unwrap();
        match what {
            "nothing" => {}
            "half a length prefix" => s.write_all(&prefix[..2]).await.unwrap(),
            _ => {
                s.write_all(&prefix).await.unwrap();
                s.write_all(&hello_bytes[..hello_bytes.len() / 2]).await.unwrap();
            }
        }
        // Watch each connection from now on, so an early close would be seen when it happens.
        stuck.push((what, tokio::spawn(async move { closed_by_server(&mut s).await.then(tokio::time::Instant::now) })));
    }
    // Hanging handshakes hold up neither the listener nor the node's peers.
    let mut good = accepted(target, &hello).await;
    still_serves(&c).await;

    for (what, watch) in stuck {
        let closed_at = watch.await.unwrap();
        let closed_at = closed_at.unwrap_or_else(|| panic!("a connection that sent {what} is closed by the server"));
        assert!(
            closed_at - opened >= HANDSHAKE_TIMEOUT,
            "a connection that sent {what} is not closed before the handshake timeout ({:?})",
            closed_at - opened
        );
    }
    await_rejected(node, 3).await;

    // The timeout bounds the handshake only: the accepted connection, idle for longer, still
    // delivers.
    write_frame(&mut good, &message("probe", b"still open")).await.unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"still open");
    assert_eq!(rejected(node), 3);
    drop(good);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_to_a_peer_of_another_cluster_is_refused_by_it_and_reported_to_the_sender() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let stop = CancellationToken::new();
    let bind = |id: &str, cluster: &str| {
        Transport::bind(
            "127.0.0.1:0".parse().unwrap(),
            UniqueAddress::new(id, 1),
            cluster.into(),
            None,
            TransportSettings::default(),
            stop.clone(),
        )
    };
    let alien = bind("alien", "other-cluster").await.unwrap();
    let friend = bind("friend", "test-cluster").await.unwrap();
    let mut alien_inbox = alien.subscribe("probe", 16);
    let mut friend_inbox = friend.subscribe("probe", 16);
    let sender = c.node(0).transport();

    // Control: the same kind of peer with our cluster id gets the message.
    sender.send(friend.local(), "probe", b"hi").unwrap();
    assert_eq!(&next_inbound(&mut friend_inbox).await.body[..], b"hi");

    let err = eventually(Duration::from_secs(10), "the sender learns that the peer refused it", || {
        std::future::ready(sender.send(alien.local(), "probe", b"hi").err())
    })
    .await;
    assert!(matches!(err, Error::PeerUnavailable { .. }), "{err}");
    assert!(alien_inbox.try_recv().is_err(), "nothing reaches a node of another cluster");
    assert_eq!(alien.stats().frames_received, 0);
    assert!(alien.stats().connections_rejected >= 1);
    assert_eq!(friend.stats().connections_rejected, 0);
    still_serves(&c).await;
    stop.cancel();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_fills_its_send_queue_and_sends_fail_with_send_queue_full() {
    let mut c = TestCluster::start_with(2, |_, cfg| cfg.transport.send_queue_capacity = 64).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    // A peer that completes the handshake and then never reads again.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow = PeerAddr { address: UniqueAddress::new("slow", 1), messaging_addr: listener.local_addr().unwrap() };
    let accept = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let hello: Hello = wire::decode(&read_frame(&mut s).await).unwrap();
        write_frame(&mut s, &wire::encode(&HelloReply::Accept { address: hello.to }).unwrap()).await.unwrap();
        s
    });
    // The first frame makes the node dial; the connection is up before the flood.
    node.transport().send(&slow, "probe", b"first").unwrap();
    let mut s = tokio::time::timeout(CONVERGE, accept).await.expect("the node dials the peer").unwrap();
    let body = vec![7u8; 64 << 10];
    let mut sent = 0usize;
    let full = loop {
        match node.transport().send(&slow, "probe", &body) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 100_000, "6 GiB queued for a peer that reads nothing: the queue is unbounded");
        if sent.is_multiple_of(64) {
            tokio::task::yield_now().await; // let the writer fill the socket
        }
    };
    assert!(matches!(full, Error::SendQueueFull { ref peer } if peer == "slow"), "{full:?}");
    println!("SendQueueFull after {sent} frames of 64 KiB to a peer that stopped reading");
    // The other peers are not held up by it.
    still_serves(&c).await;
    // Once the peer reads again, the queue drains and sends succeed.
    let drain = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 20];
        while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    });
    eventually(CONVERGE, "sends succeed again once the peer reads", || {
        std::future::ready(node.transport().send(&slow, "probe", b"again").ok())
    })
    .await;
    drain.abort();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_leaves_no_pending_entry_behind() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let _silent = c.node(1).transport().subscribe("silent", 16); // receives, never answers
    let t = c.node(0).transport().clone();
    let to = peer_of(c.node(1));
    for _ in 0..10 {
        // The caller gives up first (a select!, a dropped task): the request future is dropped.
        let r =
            tokio::time::timeout(Duration::from_millis(50), t.request(&to, "silent", b"?", Duration::from_secs(60)));
        assert!(r.await.is_err());
    }
    assert_eq!(t.pending_requests(), 0, "a dropped request removes its pending entry");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_a_peer_that_refuses_the_handshake_fails_with_peer_unavailable_not_a_timeout() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let stop = CancellationToken::new();
    let alien = Transport::bind(
        "127.0.0.1:0".parse().unwrap(),
        UniqueAddress::new("alien", 1),
        "other-cluster".into(),
        None,
        TransportSettings::default(),
        stop.clone(),
    )
    .await
    .unwrap();
    let _inbox = alien.subscribe("probe", 16);
    let r = c.node(0).transport().request(alien.local(), "probe", b"?", Duration::from_secs(30)).await;
    assert!(matches!(r, Err(Error::PeerUnavailable { .. })), "{r:?}");
    assert_eq!(c.node(0).transport().pending_requests(), 0);
    stop.cancel();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_from_another_peer_does_not_complete_a_request() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let _silent = c.node(1).transport().subscribe("silent", 16);
    let pending = {
        let (t, to) = (node.transport().clone(), peer_of(c.node(1)));
        tokio::spawn(async move { t.request(&to, "silent", b"?", Duration::from_secs(3)).await })
    };
    // A raw client speaking as member n3 (a valid handshake, from its own address) answers
    // every plausible request id of the request that went to n2.
    let reply_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut s =
        accepted(node.messaging_addr(), &member_hello(c.node(2), &node, reply_listener.local_addr().unwrap())).await;
    for id in 0..1000u64 {
        let forged = Frame::Response { id, body: ResponseBody::Ok(b"forged") }.encode().unwrap();
        write_frame(&mut s, &forged).await.unwrap();
    }
    let r = pending.await.unwrap();
    assert!(matches!(r, Err(Error::RequestTimeout { .. })), "only n2 may answer a request sent to n2: {r:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_accepts_as_another_incarnation_is_refused_by_the_dialer() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    // Whoever listens at this address accepts any handshake, but names another incarnation.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let wanted = PeerAddr { address: UniqueAddress::new("wanted", 7), messaging_addr: listener.local_addr().unwrap() };
    let impostor = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let _hello: Hello = wire::decode(&read_frame(&mut s).await).unwrap();
        let accept = HelloReply::Accept { address: UniqueAddress::new("impostor", 1) };
        write_frame(&mut s, &wire::encode(&accept).unwrap()).await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        rest
    });
    let r = node.transport().request(&wanted, "probe", b"secret payload", Duration::from_secs(30)).await;
    assert!(matches!(r, Err(Error::PeerUnavailable { ref reason, .. }) if reason.contains("impostor")), "{r:?}");
    let leaked = impostor.await.unwrap();
    assert!(leaked.is_empty(), "{} bytes sent to a peer that is not the addressed incarnation", leaked.len());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_left_has_its_connections_closed_and_cannot_connect_again() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let as_n3 = member_hello(c.node(2), &node, "127.0.0.1:9".parse().unwrap());
    let mut s = accepted(node.messaging_addr(), &as_n3).await;
    c.node(2).leave().await.unwrap();
    assert!(closed_by_server(&mut s).await, "the connection of a removed member is closed");
    let (_s, reply) = handshake(node.messaging_addr(), &as_n3).await;
    assert!(matches!(reply, Some(HelloReply::Reject(RejectReason::NotAMember(_)))), "{reply:?}");
    still_serves(&c).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_claiming_a_member_from_another_address_does_not_redirect_traffic_meant_for_it() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let mut real_inbox = c.node(1).transport().subscribe("probe", 16);
    let mut node_inbox = node.transport().subscribe("probe", 16);
    // No writer from n1 to n2 right now: the next one is made by whoever asks first.
    node.transport().forget_peer(c.node(1).address());
    // A raw client claims to be n2, listening at its own address, and sends a request.
    let impostor = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hello = member_hello(c.node(1), &node, impostor.local_addr().unwrap());
    let mut s = accepted(node.messaging_addr(), &hello).await;
    let req = Frame::Request { id: 1, topic: "probe", body: b"?" }.encode().unwrap();
    write_frame(&mut s, &req).await.unwrap();
    let m = next_inbound(&mut node_inbox).await;
    node.transport().respond(&m.from, m.request_id.unwrap(), Ok(b"answer")).unwrap();
    // Traffic for the real n2, sent to the address membership gives for it, reaches n2.
    node.transport().send(&peer_of(c.node(1)), "probe", b"for the real n2").unwrap();
    assert_eq!(&next_inbound(&mut real_inbox).await.body[..], b"for the real n2");
    // The impostor got its own answer (first on its connection, before anything else).
    let (mut back, _) = tokio::time::timeout(CONVERGE, impostor.accept()).await.unwrap().unwrap();
    let their_hello: Hello = wire::decode(&read_frame(&mut back).await).unwrap();
    write_frame(&mut back, &wire::encode(&HelloReply::Accept { address: their_hello.to }).unwrap()).await.unwrap();
    match Frame::decode(&read_frame(&mut back).await).unwrap() {
        Frame::Response { id: 1, body: ResponseBody::Ok(b) } => assert_eq!(b, b"answer"),
        other => panic!("expected only the response, got {other:?}"),
    }
    c.shutdown().await;
}

/// A rolling upgrade: a node of this version and one that speaks only protocol version 2 (rmp
/// frames with named fields) hear each other. The old node dials in at version 2 and is
/// accepted; the new node, dialing out, is refused at version 3 by the old listener, dials
/// again at version 2, and sends its response as a version-2 frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_speaks_only_protocol_version_2_is_heard_and_answered_in_version_2_frames() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let mut inbox = node.transport().subscribe("probe", 16);
    let old_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hello = Hello { protocol_version: 2, ..member_hello(c.node(1), &node, old_listener.local_addr().unwrap()) };
    let mut s = accepted(node.messaging_addr(), &hello).await;
    let old_request = wire::encode(&Frame::Request { id: 7, topic: "probe", body: b"from v2" }).unwrap();
    write_frame(&mut s, &old_request).await.unwrap();
    let m = next_inbound(&mut inbox).await;
    assert_eq!((&m.body[..], m.request_id), (&b"from v2"[..], Some(7)), "a version-2 frame is read as one");
    node.transport().respond(&m.from, 7, Ok(b"to v2")).unwrap();

    // The old listener knows only version 2: it refuses the first dial, naming its version.
    let (mut first, _) = tokio::time::timeout(CONVERGE, old_listener.accept()).await.unwrap().unwrap();
    let their_hello: Hello = wire::decode(&read_frame(&mut first).await).unwrap();
    assert_eq!(their_hello.protocol_version, PROTOCOL_VERSION, "a new node dials at its own version first");
    let refusal = HelloReply::Reject(RejectReason::ProtocolVersion { theirs: PROTOCOL_VERSION, ours: 2 });
    write_frame(&mut first, &wire::encode(&refusal).unwrap()).await.unwrap();
    drop(first);
    let (mut second, _) = tokio::time::timeout(CONVERGE, old_listener.accept()).await.unwrap().unwrap();
    let their_hello: Hello = wire::decode(&read_frame(&mut second).await).unwrap();
    assert_eq!(their_hello.protocol_version, 2, "then again at the listener's version");
    write_frame(&mut second, &wire::encode(&HelloReply::Accept { address: their_hello.to }).unwrap()).await.unwrap();
    match wire::decode_borrowed::<Frame>(&read_frame(&mut second).await).unwrap() {
        Frame::Response { id: 7, body: ResponseBody::Ok(b) } => assert_eq!(b, b"to v2"),
        other => panic!("expected the response as a version-2 frame, got {other:?}"),
    }
    c.shutdown().await;
}

/// A [`ddshard::transport::PeerSender`] keeps the peer's queue: what it sends and what
/// `Transport::send` sends arrive in one order, and after the peer incarnation is forgotten
/// the sender still delivers (it falls back to a new writer rather than a dead queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sender_shares_the_order_of_plain_sends_and_survives_a_forgotten_writer() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let (a, b) = (c.node(0).clone(), c.node(1).clone());
    let mut inbox = b.transport().subscribe("probe", 1024);
    let to = peer_of(&b);
    let sender = a.transport().sender(&to);
    for i in 0..200u32 {
        let body = i.to_be_bytes();
        if i.is_multiple_of(2) {
            sender.send("probe", &body).unwrap()
        } else {
            a.transport().send(&to, "probe", &body).unwrap()
        }
    }
    for i in 0..200u32 {
        assert_eq!(&next_inbound(&mut inbox).await.body[..], &i.to_be_bytes(), "one order for both paths");
    }
    a.transport().forget_peer(b.address());
    sender
        .send_with("probe", |buf| {
            buf.extend_from_slice(b"after");
            Ok(())
        })
        .unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"after");
    // A body writer that fails leaves nothing behind: the next message arrives alone.
    let failed = sender.send_with("probe", |buf| {
        buf.extend_from_slice(b"half");
        Err(Error::Codec("refused".into()))
    });
    assert!(matches!(failed, Err(Error::Codec(_))), "{failed:?}");
    sender.send("probe", b"whole").unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"whole");
    c.shutdown().await;
}

/// A topic handler runs on the reading task: what it keeps never reaches the channel, what it
/// passes on does, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_handler_keeps_what_it_handles_and_passes_on_the_rest_in_order() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let (a, b) = (c.node(0).clone(), c.node(1).clone());
    let kept = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let k = kept.clone();
    let mut inbox = b.transport().subscribe_with("probe", 1024, move |m: Inbound| {
        if m.body[0].is_multiple_of(2) {
            k.lock().unwrap().push(m.body[0]);
            None
        } else {
            Some(m)
        }
    });
    for i in 0..100u8 {
        a.transport().send(&peer_of(&b), "probe", &[i]).unwrap();
    }
    for i in (1..100u8).step_by(2) {
        assert_eq!(next_inbound(&mut inbox).await.body[0], i);
    }
    assert_eq!(*kept.lock().unwrap(), (0..100u8).step_by(2).collect::<Vec<_>>());
    c.shutdown().await;
}

/// A [`ddshard::transport::PeerSender`] learns of its node's shutdown from the peer's queue
/// (its writer closes the queue as it ends): a send after the shutdown fails with `ShutDown`
/// instead of queueing frames nobody will write, and a peer sender never asks the shutdown
/// token on its fast path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sender_of_a_node_that_shut_down_fails_with_shut_down() {
    let bind = |name: &str, shutdown: &CancellationToken| {
        let (name, shutdown) = (name.to_string(), shutdown.clone());
        async move {
            let local = UniqueAddress::new(name, 1);
            let settings = TransportSettings::default();
            Transport::bind("127.0.0.1:0".parse().unwrap(), local, "c".into(), None, settings, shutdown).await.unwrap()
        }
    };
    let (a_stop, b_stop) = (CancellationToken::new(), CancellationToken::new());
    let (a, b) = (bind("a", &a_stop).await, bind("b", &b_stop).await);
    let mut inbox = b.subscribe("probe", 16);
    let sender = a.sender(b.local());
    sender.send("probe", b"before").unwrap();
    assert_eq!(&next_inbound(&mut inbox).await.body[..], b"before");
    assert_eq!(sender.peer_version(), Some(PROTOCOL_VERSION), "the link was accepted at this version");
    a_stop.cancel();
    eventually(Duration::from_secs(10), "a send after the shutdown fails with ShutDown", || {
        let failed = matches!(sender.send("probe", b"after"), Err(Error::ShutDown));
        async move { failed.then_some(()) }
    })
    .await;
    b_stop.cancel();
}
