//! Node-to-node messaging over TCP.
//!
//! Every node dials each peer it sends to and keeps one outbound connection per peer
//! incarnation, written by one writer task that batches frames before flushing. Inbound
//! connections are read-only after the handshake, so the pair of nodes uses two connections and
//! the order of messages from one node to another is the order they were sent. Requests and
//! responses are matched by correlation id; the response comes back over the responder's own
//! outbound connection.
//!
//! With a cluster secret every connection authenticates both ends and is encrypted (see
//! [`noise`]); without one the handshake is a plain `Hello` (allowed only on loopback or with
//! `insecure`).
//!
//! Bad input (oversized frames, garbage, a foreign cluster id, another protocol version, a
//! handshake not keyed by the secret) closes only that connection with a logged, typed reason
//! and bumps a counter.

mod link;
mod noise;
pub mod wire;

pub use link::LinkFilter;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::TransportSettings;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::secret::ClusterSecret;
use crate::spawn::Spawner;
use wire::{Frame, Hello, HelloReply, PROTOCOL_VERSION, RejectReason, ResponseBody};

pub use crate::membership::PeerAddr;

/// A message delivered to a topic's subscriber.
#[derive(Debug)]
pub struct Inbound {
    /// Sender.
    pub from: PeerAddr,
    /// Payload.
    pub body: Bytes,
    /// Correlation id when the sender waits for a response ([`Transport::respond`]).
    pub request_id: Option<u64>,
}

/// Counters of the transport, for logs, tests and operators.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Frames written to sockets.
    pub frames_sent: AtomicU64,
    /// Frames read from sockets.
    pub frames_received: AtomicU64,
    /// Connections closed because of bad input or a refused handshake.
    pub connections_rejected: AtomicU64,
    /// Frames dropped: unknown topic, full subscriber, or cut by the link filter.
    pub frames_dropped: AtomicU64,
}

/// Frames waiting for one peer's writer, already length-prefixed in one buffer: senders encode
/// straight into it under a short lock, and the writer takes the whole buffer for one write.
#[derive(Default)]
struct PeerQueue {
    state: Mutex<QueueState>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct QueueState {
    buf: bytes::BytesMut,
    frames: usize,
    closed: bool,
    /// Why the peer refused our handshake, for the errors of later sends.
    refused: Option<String>,
}

struct Inner {
    local: PeerAddr,
    cluster_id: String,
    /// The Noise pre-shared key derived from the cluster secret; `None`: plain handshakes.
    psk: Option<[u8; 32]>,
    settings: TransportSettings,
    /// One writer per peer incarnation *and* the address it is reached at, so a connection that
    /// claims an incarnation with another address can never redirect traffic meant for it.
    writers: Mutex<HashMap<PeerAddr, Arc<PeerQueue>>>,
    topics: Mutex<HashMap<String, mpsc::Sender<Inbound>>>,
    pending: Mutex<HashMap<u64, PendingRequest>>,
    next_request_id: AtomicU64,
    stats: TransportStats,
    shutdown: CancellationToken,
    /// Frames this node sends to itself, dispatched in order by one task.
    loopback: mpsc::UnboundedSender<Bytes>,
    link_filter: Option<Arc<dyn LinkFilter>>,
    spawner: Spawner,
}

/// A request waiting for its response: only the incarnation it was sent to may answer it.
struct PendingRequest {
    peer: UniqueAddress,
    reply: oneshot::Sender<Result<Bytes>>,
}

/// Removes a request's pending entry however its future ends (answered, timed out, or dropped
/// by a caller that gave up).
struct PendingGuard<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.inner.pending.lock().expect("pending lock").remove(&self.id);
    }
}

/// Handle to the messaging layer of one node; cheap to clone.
#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").field("local", &self.inner.local).finish()
    }
}

fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(max_frame).new_codec()
}

/// Largest handshake frame (`Hello` or `HelloReply`; ids and cluster id are at most 200 bytes
/// each, so a real one is under 1 KiB). Until the handshake is done the codec allows only this
/// much, so a connection that has not introduced itself cannot make the node buffer more;
/// afterwards `max_frame_size` applies.
const MAX_HANDSHAKE_FRAME: usize = 4096;

impl Transport {
    /// Binds the listener and starts accepting, outside any node (its tasks end when
    /// `shutdown` fires). `bind` may use port 0. With `secret`, every connection is
    /// authenticated and encrypted and only peers holding the same secret are heard.
    pub async fn bind(
        bind: SocketAddr,
        local: UniqueAddress,
        cluster_id: String,
        secret: Option<&ClusterSecret>,
        settings: TransportSettings,
        shutdown: CancellationToken,
    ) -> Result<Transport> {
        let spawner = Spawner::new(tracing::Span::current(), shutdown);
        Self::bind_with(bind, local, cluster_id, secret, settings, spawner, None).await
    }

    /// Binds the listener and starts accepting; every task goes through `spawner`, and the
    /// link filter (if any) decides which links carry messages.
    pub(crate) async fn bind_with(
        bind: SocketAddr,
        local: UniqueAddress,
        cluster_id: String,
        secret: Option<&ClusterSecret>,
        settings: TransportSettings,
        spawner: Spawner,
        link_filter: Option<Arc<dyn LinkFilter>>,
    ) -> Result<Transport> {
        let shutdown = spawner.shutdown_token().clone();
        let listener =
            TcpListener::bind(bind).await.map_err(|e| Error::io(format!("binding messaging address {bind}"), e))?;
        let messaging_addr = listener.local_addr().map_err(|e| Error::io("reading bound messaging address", e))?;
        if messaging_addr.ip().is_unspecified() {
            return Err(Error::BadAddress(messaging_addr));
        }
        let (loopback_tx, loopback_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            local: PeerAddr { address: local, messaging_addr },
            cluster_id,
            psk: secret.map(ClusterSecret::transport_psk),
            settings,
            writers: Mutex::default(),
            topics: Mutex::default(),
            pending: Mutex::default(),
            next_request_id: AtomicU64::new(1),
            stats: TransportStats::default(),
            shutdown,
            loopback: loopback_tx,
            link_filter,
            spawner,
        });
        inner.spawner.spawn(accept_loop(listener, inner.clone()));
        inner.spawner.spawn(loopback_loop(inner.clone(), loopback_rx));
        Ok(Transport { inner })
    }

    /// This node's address as peers see it.
    pub fn local(&self) -> &PeerAddr {
        &self.inner.local
    }

    /// Counters.
    pub fn stats(&self) -> &TransportStats {
        &self.inner.stats
    }

    /// Subscribes to a topic; messages and requests for it arrive on the returned channel.
    /// A second subscription replaces the first.
    pub fn subscribe(&self, topic: &str, capacity: usize) -> mpsc::Receiver<Inbound> {
        let (tx, rx) = mpsc::channel(capacity);
        self.inner.topics.lock().expect("topics lock").insert(topic.to_string(), tx);
        rx
    }

    /// Removes a topic's subscription; later messages for it are dropped (and counted).
    pub fn unsubscribe(&self, topic: &str) {
        self.inner.topics.lock().expect("topics lock").remove(topic);
    }

    /// Sends a one-way message. Delivery is at most once and in order per peer.
    pub fn send(&self, to: &PeerAddr, topic: &str, body: &[u8]) -> Result<()> {
        self.enqueue(to, &Frame::Message { topic, body })
    }

    /// Sends a request and waits for its response (or the timeout).
    pub async fn request(&self, to: &PeerAddr, topic: &str, body: &[u8], timeout: Duration) -> Result<Bytes> {
        let id = self.inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        self.inner.pending.lock().expect("pending lock").insert(id, PendingRequest { peer: to.address.clone(), reply });
        let _pending = PendingGuard { inner: &self.inner, id };
        self.enqueue(to, &Frame::Request { id, topic, body })?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::ShutDown),
            Err(_) => Err(Error::RequestTimeout { peer: to.address.node_id.to_string() }),
        }
    }

    /// Requests sent and not yet answered, failed or given up (a gauge for operators; it
    /// returns to zero when nothing is in flight).
    pub fn pending_requests(&self) -> usize {
        self.inner.pending.lock().expect("pending lock").len()
    }

    /// Answers a request received as [`Inbound`] with `request_id`.
    pub fn respond(&self, to: &PeerAddr, request_id: u64, body: Result<&[u8], String>) -> Result<()> {
        let body = match &body {
            Ok(b) => ResponseBody::Ok(b),
            Err(e) => ResponseBody::Err(e.clone()),
        };
        self.enqueue(to, &Frame::Response { id: request_id, body })
    }

    /// Stops the writers of a peer incarnation (it left or was replaced); queued frames are
    /// dropped.
    pub fn forget_peer(&self, peer: &UniqueAddress) {
        let mut writers = self.inner.writers.lock().expect("writers lock");
        writers.retain(|to, q| {
            if to.address != *peer {
                return true;
            }
            q.state.lock().expect("queue lock").closed = true;
            q.wake.notify_one();
            false
        });
    }

    fn enqueue(&self, to: &PeerAddr, frame: &Frame<'_>) -> Result<()> {
        let inner = &self.inner;
        if inner.shutdown.is_cancelled() {
            return Err(Error::ShutDown);
        }
        let max = inner.settings.max_frame_size;
        let too_large = |len: usize| Error::Codec(format!("frame of {len} bytes exceeds max_frame_size {max}"));
        if to.address == inner.local.address {
            // Loopback without a socket: decode and dispatch directly, same semantics.
            let bytes = wire::encode(frame)?;
            if bytes.len() > max {
                return Err(too_large(bytes.len()));
            }
            // One task delivers loopback frames in order, like a connection would.
            return inner.loopback.send(bytes).map_err(|_| Error::ShutDown);
        }
        let queue = {
            let mut writers = inner.writers.lock().expect("writers lock");
            writers
                .entry(to.clone())
                .or_insert_with(|| {
                    let q = Arc::new(PeerQueue::default());
                    inner.spawner.spawn(writer_task(inner.clone(), to.clone(), q.clone()));
                    q
                })
                .clone()
        };
        let mut q = queue.state.lock().expect("queue lock");
        if q.closed {
            let reason = q.refused.clone().unwrap_or_else(|| "this incarnation was forgotten".into());
            drop(q);
            let mut writers = inner.writers.lock().expect("writers lock");
            if writers.get(to).is_some_and(|w| Arc::ptr_eq(w, &queue)) {
                // This incarnation refused us; the next send dials anew.
                writers.remove(to);
            }
            return Err(Error::PeerUnavailable { peer: to.address.node_id.to_string(), reason });
        }
        if q.frames >= inner.settings.send_queue_capacity {
            return Err(Error::SendQueueFull { peer: to.address.node_id.to_string() });
        }
        use bytes::BufMut;
        let start = q.buf.len();
        q.buf.put_u32(0);
        let encoded = rmp_serde::encode::write_named(&mut (&mut q.buf).writer(), frame);
        let len = q.buf.len() - start - 4;
        if let Err(e) = encoded {
            q.buf.truncate(start);
            return Err(Error::Codec(e.to_string()));
        }
        if len > max {
            q.buf.truncate(start);
            return Err(too_large(len));
        }
        q.buf[start..start + 4].copy_from_slice(&(len as u32).to_be_bytes());
        q.frames += 1;
        drop(q);
        queue.wake.notify_one();
        Ok(())
    }
}

/// Whether the link filter (if any) cuts messages from `from` to `to`.
fn cut(inner: &Inner, from: &str, to: &str) -> bool {
    inner.link_filter.as_ref().is_some_and(|f| !f.allows(from, to))
}

/// Dials the peer, handshakes, then writes whatever has queued up in one write per wake-up;
/// reconnects with backoff. Frames in a failed write are lost (delivery is at most once).
async fn writer_task(inner: Arc<Inner>, peer: PeerAddr, queue: Arc<PeerQueue>) {
    let s = &inner.settings;
    let mut backoff = s.reconnect_backoff_min;
    'reconnect: loop {
        let conn = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            r = tokio::time::timeout(s.connect_timeout, dial(&inner, &peer)) => r,
        };
        let mut link = match conn {
            Ok(Ok(link)) => {
                backoff = s.reconnect_backoff_min;
                link
            }
            Ok(Err(DialError::Refused(reason))) => {
                warn!(peer = %peer.address, %reason, "peer refused the handshake; dropping its queue");
                {
                    let mut q = queue.state.lock().expect("queue lock");
                    q.closed = true;
                    q.refused = Some(format!("it refused our handshake: {reason}"));
                    q.buf.clear();
                    q.frames = 0;
                }
                // Requests to it will get no answer: fail them now, not at their timeout.
                let mut pending = inner.pending.lock().expect("pending lock");
                let refused: Vec<u64> =
                    pending.iter().filter(|(_, r)| r.peer == peer.address).map(|(id, _)| *id).collect();
                for id in refused {
                    if let Some(r) = pending.remove(&id) {
                        let peer = peer.address.node_id.to_string();
                        let _ = r.reply.send(Err(Error::PeerUnavailable { peer, reason: reason.clone() }));
                    }
                }
                return;
            }
            Ok(Err(DialError::Io(e))) => {
                debug!(peer = %peer.address, error = %e, "connect failed; retrying");
                tokio::select! {
                    _ = inner.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(s.reconnect_backoff_max);
                continue 'reconnect;
            }
            Err(_) => {
                debug!(peer = %peer.address, "connect timed out; retrying");
                backoff = (backoff * 2).min(s.reconnect_backoff_max);
                continue 'reconnect;
            }
        };
        let mut sealed = bytes::BytesMut::new();
        loop {
            let (chunk, n) = {
                let mut q = queue.state.lock().expect("queue lock");
                if q.closed {
                    return; // forgotten peer
                }
                let n = std::mem::take(&mut q.frames);
                (q.buf.split().freeze(), n)
            };
            if n == 0 {
                tokio::select! {
                    _ = inner.shutdown.cancelled() => return,
                    _ = queue.wake.notified() => continue,
                }
            }
            if cut(&inner, &inner.local.address.node_id, &peer.address.node_id) {
                inner.stats.frames_dropped.fetch_add(n as u64, Ordering::Relaxed);
                continue;
            }
            let bytes: &[u8] = match &mut link.cipher {
                Some(cipher) => {
                    sealed.clear();
                    if let Err(e) = noise::seal(cipher, &chunk, &mut sealed) {
                        warn!(peer = %peer.address, error = %e, "sealing failed; reconnecting");
                        continue 'reconnect;
                    }
                    &sealed
                }
                None => &chunk,
            };
            if let Err(e) = write_making_progress(&mut link.stream, bytes, s.write_timeout).await {
                debug!(peer = %peer.address, error = %e, "write failed; reconnecting");
                continue 'reconnect;
            }
            inner.stats.frames_sent.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

/// Writes all of `buf`, failing if the peer accepts no byte for `stall` (a peer that stopped
/// reading, or a dead path TCP would retransmit into for many minutes).
async fn write_making_progress(stream: &mut TcpStream, mut buf: &[u8], stall: Duration) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    while !buf.is_empty() {
        match tokio::time::timeout(stall, stream.write(buf)).await {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => buf = &buf[n..],
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "peer accepted no byte within write_timeout",
                ));
            }
        }
    }
    Ok(())
}

/// No Nagle delay, and TCP keepalive so a peer that vanished (power cut, dropped route) is
/// noticed on an idle connection instead of never.
fn configure_socket(stream: &TcpStream, settings: &TransportSettings) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let probe_every = (settings.keepalive / 3).max(Duration::from_secs(1));
    let keepalive = socket2::TcpKeepalive::new().with_time(settings.keepalive).with_interval(probe_every);
    #[cfg(any(target_os = "linux", target_os = "macos", target_os = "freebsd"))]
    let keepalive = keepalive.with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// An established outbound connection: the socket and, with a secret, its sending cipher.
struct Link {
    stream: TcpStream,
    cipher: Option<snow::TransportState>,
}

enum DialError {
    Io(std::io::Error),
    Refused(String),
}

async fn dial(inner: &Inner, peer: &PeerAddr) -> Result<Link, DialError> {
    use tokio::io::AsyncWriteExt;
    let stream = TcpStream::connect(peer.messaging_addr).await.map_err(DialError::Io)?;
    configure_socket(&stream, &inner.settings).map_err(DialError::Io)?;
    let mut framed = Framed::new(stream, codec(MAX_HANDSHAKE_FRAME));
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        cluster_id: inner.cluster_id.clone(),
        from: inner.local.address.clone(),
        from_messaging_addr: inner.local.messaging_addr,
        to: peer.address.clone(),
    };
    let hello = wire::encode(&hello).map_err(|e| DialError::Refused(e.to_string()))?;
    let mut handshake = inner.psk.as_ref().map(|psk| noise::initiator(psk, peer.messaging_addr));
    let first = match &mut handshake {
        Some(hs) => Bytes::from(noise::write_handshake(hs, &hello).map_err(|e| DialError::Refused(e.to_string()))?),
        None => hello,
    };
    framed.send(first).await.map_err(DialError::Io)?;
    let reply = match framed.next().await {
        Some(Ok(bytes)) => bytes,
        Some(Err(e)) => return Err(DialError::Io(e)),
        None => return Err(DialError::Io(std::io::ErrorKind::UnexpectedEof.into())),
    };
    let reply = match &mut handshake {
        Some(hs) => match noise::read_handshake(hs, &reply) {
            Ok(payload) => payload,
            // A peer that could not authenticate us says so in plain text (it has no key to
            // seal with); anything else is not this cluster's secret either.
            Err(e) => {
                return Err(DialError::Refused(match wire::decode::<HelloReply>(&reply) {
                    Ok(HelloReply::Reject(r)) => r.to_string(),
                    _ => format!("handshake reply {e}"),
                }));
            }
        },
        None => reply.to_vec(),
    };
    match wire::decode::<HelloReply>(&reply) {
        Ok(HelloReply::Accept { address }) if address == peer.address => {}
        Ok(HelloReply::Accept { address }) => {
            return Err(DialError::Refused(format!("{} answered as {address}", peer.messaging_addr)));
        }
        Ok(HelloReply::Reject(r)) => return Err(DialError::Refused(r.to_string())),
        Err(e) => return Err(DialError::Refused(format!("malformed handshake reply: {e}"))),
    }
    // The acceptor writes nothing after its reply, so no read bytes are left behind here.
    let mut stream = framed.into_inner();
    let cipher = match handshake {
        Some(hs) => {
            let mut cipher = hs.into_transport_mode().map_err(|e| DialError::Refused(e.to_string()))?;
            let mut confirmation = bytes::BytesMut::new();
            noise::seal_frame(&mut cipher, noise::KEY_CONFIRMATION, &mut confirmation)
                .map_err(|e| DialError::Refused(e.to_string()))?;
            stream.write_all(&confirmation).await.map_err(DialError::Io)?;
            Some(cipher)
        }
        None => None,
    };
    Ok(Link { stream, cipher })
}

async fn loopback_loop(inner: Arc<Inner>, mut frames: mpsc::UnboundedReceiver<Bytes>) {
    let from = inner.local.clone();
    let mut cache = HashMap::new();
    loop {
        let bytes = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            b = frames.recv() => match b {
                Some(b) => b,
                None => return,
            },
        };
        if let Ok(f) = wire::decode_borrowed::<Frame>(&bytes) {
            dispatch(&inner, &from, &bytes, f, &mut cache).await;
        }
    }
}

async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    loop {
        let accepted = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, remote)) => {
                let _ = configure_socket(&stream, &inner.settings);
                inner.spawner.spawn(read_connection(inner.clone(), stream, remote));
            }
            Err(e) => {
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why an inbound connection was closed by us.
#[derive(Debug, thiserror::Error)]
enum InboundError {
    #[error("handshake refused: {0}")]
    Rejected(RejectReason),
    #[error("malformed handshake: {0}")]
    MalformedHandshake(String),
    #[error("handshake not authenticated by the cluster secret: {0}")]
    Unauthenticated(String),
    #[error("no key confirmation after the handshake")]
    NoKeyConfirmation,
    #[error("handshake not completed within the connect timeout")]
    HandshakeTimeout,
    #[error("bad frame (oversized, truncated or not authentic): {0}")]
    BadFrame(std::io::Error),
    #[error("malformed frame: {0}")]
    MalformedFrame(String),
}

/// Frames of an accepted connection: plain, or opened from sealed records.
enum InboundCodec {
    Plain(LengthDelimitedCodec),
    Secure(Box<noise::SecureFrameCodec>),
}

impl InboundCodec {
    fn set_max_frame_length(&mut self, max: usize) {
        match self {
            InboundCodec::Plain(c) => c.set_max_frame_length(max),
            InboundCodec::Secure(c) => c.set_max_frame_length(max),
        }
    }
}

impl tokio_util::codec::Decoder for InboundCodec {
    type Item = bytes::BytesMut;
    type Error = std::io::Error;

    fn decode(&mut self, src: &mut bytes::BytesMut) -> std::io::Result<Option<bytes::BytesMut>> {
        match self {
            InboundCodec::Plain(c) => c.decode(src),
            InboundCodec::Secure(c) => c.decode(src),
        }
    }
}

async fn read_connection(inner: Arc<Inner>, stream: TcpStream, remote: SocketAddr) {
    let result = tokio::select! {
        _ = inner.shutdown.cancelled() => Ok(()),
        r = serve_connection(&inner, stream) => r,
    };
    if let Err(e) = result {
        inner.stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
        warn!(%remote, reason = %e, "closing inbound connection");
    }
}

async fn serve_connection(inner: &Arc<Inner>, stream: TcpStream) -> Result<(), InboundError> {
    let (from, mut framed) =
        match tokio::time::timeout(inner.settings.connect_timeout, accept_handshake(inner, stream)).await {
            Err(_) => return Err(InboundError::HandshakeTimeout),
            Ok(Ok(Some(accepted))) => accepted,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        };
    framed.codec_mut().set_max_frame_length(inner.settings.max_frame_size);
    info!(peer = %from.address, "inbound connection accepted");
    let mut topic_cache = HashMap::new();
    while let Some(item) = framed.next().await {
        let bytes = item.map_err(InboundError::BadFrame)?.freeze();
        inner.stats.frames_received.fetch_add(1, Ordering::Relaxed);
        let frame: Frame = wire::decode_borrowed(&bytes).map_err(|e| InboundError::MalformedFrame(e.to_string()))?;
        if cut(inner, &from.address.node_id, &inner.local.address.node_id) {
            inner.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        dispatch(inner, &from, &bytes, frame, &mut topic_cache).await;
    }
    Ok(())
}

/// The acceptor's side of the handshake (the caller bounds it by the connect timeout); `None`
/// when the peer closed before saying anything.
async fn accept_handshake(
    inner: &Arc<Inner>,
    stream: TcpStream,
) -> Result<Option<(PeerAddr, Framed<TcpStream, InboundCodec>)>, InboundError> {
    let mut framed = Framed::new(stream, codec(MAX_HANDSHAKE_FRAME));
    let first = match framed.next().await {
        None => return Ok(None),
        Some(Err(e)) => return Err(InboundError::BadFrame(e)),
        Some(Ok(b)) => b,
    };
    let mut handshake = inner.psk.as_ref().map(|psk| noise::responder(psk, inner.local.messaging_addr));
    let hello = match &mut handshake {
        Some(hs) => match noise::read_handshake(hs, &first) {
            Ok(payload) => payload,
            Err(e) => {
                // Said in plain text: we hold no key this peer shares.
                if let Ok(b) = wire::encode(&HelloReply::Reject(RejectReason::Unauthenticated)) {
                    let _ = framed.send(b).await;
                }
                return Err(InboundError::Unauthenticated(e.to_string()));
            }
        },
        None => first.to_vec(),
    };
    let hello: Hello = wire::decode(&hello).map_err(|e| InboundError::MalformedHandshake(e.to_string()))?;
    let reject = if hello.protocol_version != PROTOCOL_VERSION {
        Some(RejectReason::ProtocolVersion { theirs: hello.protocol_version, ours: PROTOCOL_VERSION })
    } else if hello.cluster_id != inner.cluster_id {
        Some(RejectReason::ForeignCluster(hello.cluster_id.clone()))
    } else if hello.to != inner.local.address {
        Some(RejectReason::WrongAddressee(hello.to.clone()))
    } else {
        None
    };
    let reply = match &reject {
        Some(reason) => HelloReply::Reject(reason.clone()),
        None => HelloReply::Accept { address: inner.local.address.clone() },
    };
    let reply = wire::encode(&reply).map_err(|e| InboundError::MalformedHandshake(e.to_string()))?;
    let reply = match &mut handshake {
        Some(hs) => {
            Bytes::from(noise::write_handshake(hs, &reply).map_err(|e| InboundError::Unauthenticated(e.to_string()))?)
        }
        None => reply,
    };
    let sent = framed.send(reply).await;
    if let Some(reason) = reject {
        return Err(InboundError::Rejected(reason));
    }
    sent.map_err(InboundError::BadFrame)?;
    let from = PeerAddr { address: hello.from, messaging_addr: hello.from_messaging_addr };
    let framed = match handshake {
        None => framed.map_codec(InboundCodec::Plain),
        Some(hs) => {
            let cipher = hs.into_transport_mode().map_err(|e| InboundError::Unauthenticated(e.to_string()))?;
            let mut framed =
                framed.map_codec(|plain| InboundCodec::Secure(Box::new(noise::SecureFrameCodec::new(cipher, plain))));
            // Nothing counts until the dialer proves it holds this session's keys.
            match framed.next().await {
                Some(Ok(b)) if &b[..] == noise::KEY_CONFIRMATION => {}
                Some(Err(e)) => return Err(InboundError::Unauthenticated(e.to_string())),
                _ => return Err(InboundError::NoKeyConfirmation),
            }
            framed
        }
    };
    Ok(Some((from, framed)))
}

/// Delivers one frame: responses complete their pending request; messages and requests go to
/// the topic's subscriber (looked up once per connection and topic). `buf` is the frame's
/// buffer; bodies are slices of it, not copies.
async fn dispatch(
    inner: &Arc<Inner>,
    from: &PeerAddr,
    buf: &Bytes,
    frame: Frame<'_>,
    cache: &mut HashMap<String, mpsc::Sender<Inbound>>,
) {
    let (topic, body, request_id) = match frame {
        Frame::Response { id, body } => {
            let mut pending = inner.pending.lock().expect("pending lock");
            let Some(request) = pending.get(&id) else { return };
            if request.peer != from.address {
                // Only the incarnation a request went to may answer it.
                drop(pending);
                inner.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
                debug!(peer = %from.address, id, "response to a request sent to another peer; dropped");
                return;
            }
            if let Some(request) = pending.remove(&id) {
                let _ = request.reply.send(match body {
                    ResponseBody::Ok(b) => Ok(buf.slice_ref(b)),
                    ResponseBody::Err(reason) => {
                        Err(Error::PeerUnavailable { peer: from.address.node_id.to_string(), reason })
                    }
                });
            }
            return;
        }
        Frame::Message { topic, body } => (topic, body, None),
        Frame::Request { id, topic, body } => (topic, body, Some(id)),
    };
    let mut inbound = Inbound { from: from.clone(), body: buf.slice_ref(body), request_id };
    let mut delivered = false;
    // A cached sender may belong to a replaced subscription: on failure look up once more.
    for attempt in 0..2 {
        if attempt == 1 || !cache.contains_key(topic) {
            match inner.topics.lock().expect("topics lock").get(topic) {
                Some(tx) => cache.insert(topic.to_string(), tx.clone()),
                None => break,
            };
        }
        match cache[topic].send(inbound).await {
            Ok(()) => {
                delivered = true;
                break;
            }
            Err(mpsc::error::SendError(back)) => {
                cache.remove(topic);
                inbound = back;
            }
        }
    }
    if !delivered {
        inner.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
        warn!(peer = %from.address, %topic, "no subscriber for topic; message dropped");
        if let Some(id) = request_id {
            let t = Transport { inner: inner.clone() };
            let _ = t.respond(from, id, Err(format!("no service for topic {topic:?}")));
        }
    }
}
