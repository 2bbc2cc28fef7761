//! Node-to-node messaging over TCP.
//!
//! Every node dials each peer it sends to and keeps one outbound connection per peer
//! incarnation, written by one writer task that batches frames before flushing. Inbound
//! connections are read-only after the handshake, so the pair of nodes uses two connections and
//! the order of messages from one node to another is the order they were sent. Requests and
//! responses are matched by correlation id; the response comes back over the responder's own
//! outbound connection.
//!
//! With a cluster secret every connection authenticates both ends and is encrypted (Noise with
//! a pre-shared key); without one the handshake is a plain `Hello` (allowed only on loopback or with
//! `insecure`).
//!
//! Bad input (oversized frames, garbage, a foreign cluster id, another protocol version, a
//! handshake not keyed by the secret) closes only that connection with a logged, typed reason
//! and bumps a counter.

mod admission;
mod inbound;
mod link;
mod noise;
mod outbound;
// Frames and the handshake on the wire: public with the `testkit` feature only, for protocol
// tests (no stability promise); crate-private otherwise.
#[cfg(feature = "testkit")]
pub mod wire;
#[cfg(not(feature = "testkit"))]
#[allow(unreachable_pub)]
pub(crate) mod wire;

pub use link::LinkFilter;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::LengthDelimitedCodec;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::TransportSettings;
use crate::error::{Error, Result};
use crate::machine::{Machine, OsMachine};
use crate::membership::UniqueAddress;
use crate::secret::ClusterSecret;
use crate::spawn::Spawner;
use inbound::accept_loop;
use outbound::writer_task;
use wire::{Frame, Header, ResponseBody};

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
    /// What a topic handler attached before passing the message on ([`Inbound::hold`]).
    held: Held,
}

/// A value riding along with an [`Inbound`] from its topic handler to its subscriber.
#[derive(Default)]
struct Held(Option<Box<dyn std::any::Any + Send>>);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Held(..)" } else { "Held(None)" })
    }
}

impl Inbound {
    /// A message as a subscriber receives it.
    pub fn new(from: PeerAddr, body: Bytes, request_id: Option<u64>) -> Self {
        Inbound { from, body, request_id, held: Held::default() }
    }

    /// Attaches a value that travels with the message to the subscriber, and is dropped with
    /// the message if it never gets there: a topic handler ([`Transport::subscribe_with`]) that
    /// passes a message on can so hand the subscriber a guard (an in-flight count, say) whose
    /// release cannot be lost.
    pub fn hold(&mut self, value: impl std::any::Any + Send) {
        self.held = Held(Some(Box::new(value)));
    }

    /// Takes the attached value if it is a `T`.
    pub fn take_held<T: std::any::Any>(&mut self) -> Option<T> {
        let held = self.held.0.take()?;
        match held.downcast::<T>() {
            Ok(v) => Some(*v),
            Err(other) => {
                self.held.0 = Some(other);
                None
            }
        }
    }
}

/// Counters of the transport, for logs, tests and operators.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStats {
    /// Frames written to sockets.
    pub frames_sent: u64,
    /// Frames read from sockets.
    pub frames_received: u64,
    /// Bytes written to sockets (after encryption: what goes on the wire, length prefixes
    /// included).
    pub bytes_sent: u64,
    /// Bytes of the frames read from sockets (after decryption, without length prefixes).
    pub bytes_received: u64,
    /// Connections closed because of bad input or a refused handshake.
    pub connections_rejected: u64,
    /// Frames dropped: unknown topic, full subscriber, or cut by the link filter.
    pub frames_dropped: u64,
}

/// The live cells behind [`TransportStats`], one per field (the snapshot names every cell, so the
/// two cannot drift apart).
#[derive(Debug, Default)]
pub(crate) struct TransportStatCells {
    pub(crate) frames_sent: AtomicU64,
    pub(crate) frames_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) connections_rejected: AtomicU64,
    pub(crate) frames_dropped: AtomicU64,
}

impl TransportStatCells {
    /// The counters as of now (each read on its own: a snapshot, not one instant).
    pub(crate) fn snapshot(&self) -> TransportStats {
        TransportStats {
            frames_sent: self.frames_sent.load(Ordering::Relaxed),
            frames_received: self.frames_received.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            connections_rejected: self.connections_rejected.load(Ordering::Relaxed),
            frames_dropped: self.frames_dropped.load(Ordering::Relaxed),
        }
    }
}

/// Frames waiting for one peer's writer, already length-prefixed in one buffer: senders encode
/// straight into it under a short lock, and the writer takes the whole buffer for one write.
#[derive(Default)]
struct PeerQueue {
    state: Mutex<QueueState>,
    wake: tokio::sync::Notify,
    /// The protocol version the peer accepted our link at (0 until one was): an incarnation
    /// runs one build, so it never changes once set.
    version: AtomicU32,
    /// `QueueState::closed`, readable without the lock ([`PeerSender::is_open`]).
    closed: std::sync::atomic::AtomicBool,
}

impl PeerQueue {
    /// Closes the queue, whose `state` the caller holds locked: later frames are refused.
    fn close(&self, state: &mut QueueState) {
        state.closed = true;
        self.closed.store(true, Ordering::Relaxed);
    }
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
    /// The Noise pre-shared keys derived from the cluster secrets: dials with the first,
    /// accepts any (a secret being rotated); empty: plain handshakes.
    psks: Vec<[u8; 32]>,
    settings: TransportSettings,
    /// One writer per peer incarnation *and* the address it is reached at, so a connection that
    /// claims an incarnation with another address can never redirect traffic meant for it.
    writers: Mutex<HashMap<PeerAddr, Arc<PeerQueue>>>,
    topics: Mutex<HashMap<String, Route>>,
    pending: Mutex<HashMap<u64, PendingRequest>>,
    next_request_id: AtomicU64,
    stats: TransportStatCells,
    shutdown: CancellationToken,
    /// Frames this node sends to itself, dispatched in order by one task.
    loopback: mpsc::UnboundedSender<Bytes>,
    link_filter: Option<Arc<dyn LinkFilter>>,
    /// The sockets this node dials with.
    machine: Arc<dyn Machine>,
    spawner: Spawner,
    /// The node's membership: once set, only current members' incarnations are accepted.
    members: std::sync::OnceLock<tokio::sync::watch::Receiver<Arc<crate::membership::MembershipSnapshot>>>,
    /// Established inbound connections by the incarnation that opened them, so forgetting a
    /// peer closes them too.
    inbound: Mutex<HashMap<UniqueAddress, Vec<Arc<ConnectionStop>>>>,
}

/// How an inbound connection is stopped: the token ends its reads, and the flag, read without
/// a lock, stops it between two frames of a batch already read (a token's own check locks).
#[derive(Default)]
pub(crate) struct ConnectionStop {
    pub(crate) token: CancellationToken,
    stopped: std::sync::atomic::AtomicBool,
}

impl ConnectionStop {
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
}

/// A topic subscriber's handler run on the reading task ([`Transport::subscribe_with`]).
type InboundHandler = Arc<dyn Fn(Inbound) -> Option<Inbound> + Send + Sync>;

/// Where frames of one topic go: the handler (if any) first, then the subscriber's channel.
#[derive(Clone)]
struct Route {
    handler: Option<InboundHandler>,
    tx: mpsc::Sender<Inbound>,
}

/// The routes one reading task has looked up, by topic: a connection carries few topics, so a
/// short list compared byte-wise beats hashing the topic of every frame.
#[derive(Default)]
pub(crate) struct RouteCache {
    routes: Vec<(Box<str>, Route)>,
}

impl RouteCache {
    /// The route of `topic`, looked up in the transport's table when `fresh` or not cached.
    /// Borrowed, not cloned: a clone per frame would touch the subscriber channel's sender
    /// count, which every reading task shares.
    fn get(&mut self, inner: &Inner, topic: &str, fresh: bool) -> Option<&Route> {
        let at = self.routes.iter().position(|(t, _)| &**t == topic);
        if let (Some(i), false) = (at, fresh) {
            return Some(&self.routes[i].1);
        }
        let route = inner.topics.lock().expect("topics lock").get(topic).cloned();
        match (at, route) {
            (Some(i), Some(r)) => {
                self.routes[i].1 = r;
                Some(&self.routes[i].1)
            }
            (Some(i), None) => {
                self.routes.swap_remove(i);
                None
            }
            (None, Some(r)) => {
                self.routes.push((topic.into(), r));
                self.routes.last().map(|(_, r)| r)
            }
            (None, None) => None,
        }
    }
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

/// Where and as whom a transport listens: the address it binds and the one peers dial (when
/// they differ), its incarnation, cluster, secrets (dials with the first, accepts any) and
/// settings.
pub(crate) struct Endpoint {
    pub(crate) bind: SocketAddr,
    pub(crate) advertise: Option<SocketAddr>,
    pub(crate) local: UniqueAddress,
    pub(crate) cluster_id: String,
    pub(crate) secrets: Vec<ClusterSecret>,
    pub(crate) settings: TransportSettings,
    /// The machine whose sockets it listens and dials on.
    pub(crate) machine: Arc<dyn Machine>,
}

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
        let secrets = secret.into_iter().cloned().collect();
        let endpoint =
            Endpoint { bind, advertise: None, local, cluster_id, secrets, settings, machine: Arc::new(OsMachine) };
        Self::bind_with(endpoint, spawner, None).await
    }

    /// Binds the listener and starts accepting; every task goes through `spawner`, and the
    /// link filter (if any) decides which links carry messages. Dials with the first of
    /// `secrets` and accepts dialers holding any of them (none: plain connections).
    pub(crate) async fn bind_with(
        endpoint: Endpoint,
        spawner: Spawner,
        link_filter: Option<Arc<dyn LinkFilter>>,
    ) -> Result<Transport> {
        let Endpoint { bind, advertise, local, cluster_id, secrets, settings, machine } = endpoint;
        let shutdown = spawner.shutdown_token().clone();
        let listener = machine
            .listen(bind, settings.keepalive)
            .await
            .map_err(|e| Error::io(format!("binding messaging address {bind}"), e))?;
        let bound = listener.local_addr().map_err(|e| Error::io("reading bound messaging address", e))?;
        // What peers dial, and what the Noise prologue binds a connection to.
        let messaging_addr = crate::config::advertised_addr(bound, advertise)?;
        let (loopback_tx, loopback_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            local: PeerAddr { address: local, messaging_addr },
            cluster_id,
            psks: secrets.iter().map(ClusterSecret::transport_psk).collect(),
            settings,
            writers: Mutex::default(),
            topics: Mutex::default(),
            pending: Mutex::default(),
            next_request_id: AtomicU64::new(1),
            stats: TransportStatCells::default(),
            shutdown,
            loopback: loopback_tx,
            link_filter,
            machine,
            spawner,
            members: std::sync::OnceLock::new(),
            inbound: Mutex::default(),
        });
        inner.spawner.spawn_essential("transport accept loop", accept_loop(listener, inner.clone()));
        inner.spawner.spawn_essential("transport loopback", loopback_loop(inner.clone(), loopback_rx));
        Ok(Transport { inner })
    }

    /// This node's address as peers see it.
    pub fn local(&self) -> &PeerAddr {
        &self.inner.local
    }

    /// Counters, as of this call.
    pub fn stats(&self) -> TransportStats {
        self.inner.stats.snapshot()
    }

    /// Subscribes to a topic; messages and requests for it arrive on the returned channel.
    /// A second subscription replaces the first.
    pub fn subscribe(&self, topic: &str, capacity: usize) -> mpsc::Receiver<Inbound> {
        self.route(topic, capacity, None)
    }

    /// Subscribes to a topic with a handler that sees each message first, on the task reading
    /// the connection (no task hop): it returns `None` when it dealt with the message and
    /// `Some` to pass it on to the returned channel. It must never block; ordering between what
    /// it handles and what it passes on is its own concern. A second subscription replaces the
    /// first.
    pub fn subscribe_with(
        &self,
        topic: &str,
        capacity: usize,
        handler: impl Fn(Inbound) -> Option<Inbound> + Send + Sync + 'static,
    ) -> mpsc::Receiver<Inbound> {
        self.route(topic, capacity, Some(Arc::new(handler)))
    }

    fn route(&self, topic: &str, capacity: usize, handler: Option<InboundHandler>) -> mpsc::Receiver<Inbound> {
        let (tx, rx) = mpsc::channel(capacity);
        self.inner.topics.lock().expect("topics lock").insert(topic.to_string(), Route { handler, tx });
        rx
    }

    /// Removes a topic's subscription; later messages for it are dropped (and counted).
    pub fn unsubscribe(&self, topic: &str) {
        self.inner.topics.lock().expect("topics lock").remove(topic);
    }

    /// Sends a one-way message. Delivery is at most once and in order per peer.
    pub fn send(&self, to: &PeerAddr, topic: &str, body: &[u8]) -> Result<()> {
        self.push(to, None, &Header::Message { topic }, put_body(body))
    }

    /// A sender for one peer incarnation, for callers that send to it often: it holds the
    /// peer's queue, so a send takes no transport-wide lock and no lookup. Messages sent through
    /// it and through [`Transport::send`] share one order.
    pub fn sender(&self, to: &PeerAddr) -> PeerSender {
        let queue = (to.address != self.inner.local.address).then(|| self.queue_of(to));
        PeerSender(Arc::new(SenderOf { transport: self.clone(), to: to.clone(), queue }))
    }

    /// Sends a request and waits for its response (or the timeout).
    pub async fn request(&self, to: &PeerAddr, topic: &str, body: &[u8], timeout: Duration) -> Result<Bytes> {
        let id = self.inner.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        self.inner.pending.lock().expect("pending lock").insert(id, PendingRequest { peer: to.address.clone(), reply });
        let _pending = PendingGuard { inner: &self.inner, id };
        self.push(to, None, &Header::Request { id, topic }, put_body(body))?;
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

    /// Peer incarnations this node currently keeps a writer (and its queue) for: one per peer
    /// sent to, until it is forgotten, refuses us or stays unreachable (a gauge for operators).
    pub fn peer_writers(&self) -> usize {
        self.inner.writers.lock().expect("writers lock").len()
    }

    /// Answers a request received as [`Inbound`] with `request_id`.
    pub fn respond(&self, to: &PeerAddr, request_id: u64, body: Result<&[u8], String>) -> Result<()> {
        match &body {
            Ok(b) => self.push(to, None, &Header::ResponseOk { id: request_id }, put_body(b)),
            Err(e) => self.push(to, None, &Header::ResponseErr { id: request_id }, put_body(e.as_bytes())),
        }
    }

    /// From now on, accept connections only from incarnations that are members in `members`
    /// ([`crate::membership::MembershipSnapshot::standing_of`]); one not yet listed is given
    /// until half the connect timeout to appear.
    pub(crate) fn admit_only_members(
        &self,
        members: tokio::sync::watch::Receiver<Arc<crate::membership::MembershipSnapshot>>,
    ) {
        let _ = self.inner.members.set(members);
    }

    /// Every peer incarnation this transport holds inbound connections or a writer for.
    pub(crate) fn peers(&self) -> Vec<UniqueAddress> {
        let mut peers: Vec<UniqueAddress> = self.inner.inbound.lock().expect("inbound lock").keys().cloned().collect();
        peers.extend(self.inner.writers.lock().expect("writers lock").keys().map(|p| p.address.clone()));
        peers.sort();
        peers.dedup();
        peers
    }

    /// Stops the writers of a peer incarnation (it left or was replaced) and closes the
    /// connections it opened to us; queued frames are dropped.
    pub fn forget_peer(&self, peer: &UniqueAddress) {
        for conn in self.inner.inbound.lock().expect("inbound lock").remove(peer).unwrap_or_default() {
            conn.stop();
        }
        let mut writers = self.inner.writers.lock().expect("writers lock");
        writers.retain(|to, q| {
            if to.address != *peer {
                return true;
            }
            q.close(&mut q.state.lock().expect("queue lock"));
            q.wake.notify_one();
            false
        });
    }

    /// The queue of `to`'s writer, started on first use.
    fn queue_of(&self, to: &PeerAddr) -> Arc<PeerQueue> {
        let inner = &self.inner;
        let mut writers = inner.writers.lock().expect("writers lock");
        writers
            .entry(to.clone())
            .or_insert_with(|| {
                let q = Arc::new(PeerQueue::default());
                inner.spawner.spawn(writer_task(inner.clone(), to.clone(), q.clone()));
                q
            })
            .clone()
    }

    /// Queues one frame for `to`: `header`, then whatever `body` appends. `cached` is a
    /// [`PeerSender`]'s queue; a closed one falls back to the writers map (which dials anew or
    /// reports why the peer refused us).
    fn push<F>(&self, to: &PeerAddr, cached: Option<&Arc<PeerQueue>>, header: &Header<'_>, body: F) -> Result<()>
    where
        F: FnOnce(&mut bytes::BytesMut) -> Result<()>,
    {
        let inner = &self.inner;
        // A sender's cached queue is closed by its writer when the node shuts down, so only
        // the other paths ask the shutdown token (whose check takes a lock every core shares).
        let body = match cached {
            Some(queue) => match self.push_to(to, queue, header, body)? {
                Pushed::Done => return Ok(()),
                Pushed::Closed(body) => body,
            },
            None => body,
        };
        if inner.shutdown.is_cancelled() {
            return Err(Error::ShutDown);
        }
        if to.address == inner.local.address {
            // Loopback without a socket: decode and dispatch directly, same semantics.
            let mut frame = bytes::BytesMut::new();
            header.put(&mut frame)?;
            body(&mut frame)?;
            let max = inner.settings.max_frame_size;
            if frame.len() > max {
                return Err(Error::Codec(format!("frame of {} bytes exceeds max_frame_size {max}", frame.len())));
            }
            // One task delivers loopback frames in order, like a connection would.
            return inner.loopback.send(frame.freeze()).map_err(|_| Error::ShutDown);
        }
        let queue = self.queue_of(to);
        match self.push_to(to, &queue, header, body)? {
            Pushed::Done => Ok(()),
            Pushed::Closed(_) => {
                let reason = {
                    let q = queue.state.lock().expect("queue lock");
                    q.refused.clone().unwrap_or_else(|| "this incarnation was forgotten".into())
                };
                let mut writers = inner.writers.lock().expect("writers lock");
                if writers.get(to).is_some_and(|w| Arc::ptr_eq(w, &queue)) {
                    // This incarnation refused us; the next send dials anew.
                    writers.remove(to);
                }
                Err(Error::PeerUnavailable { peer: to.address.node_id.to_string(), reason })
            }
        }
    }

    /// Appends one length-prefixed frame to `queue`, waking its writer only when the queue was
    /// empty (a writer that has frames to take is awake or about to be).
    fn push_to<F>(&self, to: &PeerAddr, queue: &PeerQueue, header: &Header<'_>, body: F) -> Result<Pushed<F>>
    where
        F: FnOnce(&mut bytes::BytesMut) -> Result<()>,
    {
        let settings = &self.inner.settings;
        let mut q = queue.state.lock().expect("queue lock");
        if q.closed {
            return Ok(Pushed::Closed(body));
        }
        let full = || Error::SendQueueFull { peer: to.address.node_id.to_string() };
        if q.frames >= settings.send_queue_capacity {
            return Err(full());
        }
        use bytes::BufMut;
        let start = q.buf.len();
        q.buf.put_u32(0);
        let written = header.put(&mut q.buf).and_then(|()| body(&mut q.buf));
        let len = q.buf.len() - start - 4;
        let checked = written.and_then(|()| {
            let max = settings.max_frame_size;
            if len > max {
                return Err(Error::Codec(format!("frame of {len} bytes exceeds max_frame_size {max}")));
            }
            if q.buf.len() > settings.send_queue_max_bytes {
                return Err(full());
            }
            u32::try_from(len).map_err(|_| Error::Codec(format!("frame of {len} bytes")))
        });
        let len = match checked {
            Ok(len) => len,
            Err(e) => {
                q.buf.truncate(start);
                return Err(e);
            }
        };
        q.buf[start..start + 4].copy_from_slice(&len.to_be_bytes());
        let was_empty = q.frames == 0;
        q.frames += 1;
        drop(q);
        if was_empty {
            queue.wake.notify_one();
        }
        Ok(Pushed::Done)
    }
}

/// What [`Transport::push_to`] did with a frame: queued it, or found the queue closed (and
/// hands the body writer back for another queue).
enum Pushed<F> {
    Done,
    Closed(F),
}

/// A body writer that appends `body`.
fn put_body(body: &[u8]) -> impl FnOnce(&mut bytes::BytesMut) -> Result<()> + '_ {
    move |buf| {
        buf.extend_from_slice(body);
        Ok(())
    }
}

/// A sender for one peer incarnation ([`Transport::sender`]); cheap to clone (one pointer).
#[derive(Clone)]
pub struct PeerSender(Arc<SenderOf>);

struct SenderOf {
    transport: Transport,
    to: PeerAddr,
    /// `None` for this node itself (loopback).
    queue: Option<Arc<PeerQueue>>,
}

impl std::fmt::Debug for PeerSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSender").field("to", &self.0.to).finish()
    }
}

impl PeerSender {
    /// The peer incarnation this sender sends to.
    pub fn peer(&self) -> &PeerAddr {
        &self.0.to
    }

    /// Whether the peer's queue still takes frames: `false` once the peer refused us, stayed
    /// unreachable or was forgotten (a send then goes through the transport's writers map).
    pub fn is_open(&self) -> bool {
        self.0.queue.as_ref().is_none_or(|q| !q.closed.load(Ordering::Relaxed))
    }

    /// The protocol version the peer accepted this node's link at, `None` until a link was
    /// accepted (this node itself speaks [`wire::PROTOCOL_VERSION`]). A service sends a body in
    /// a layout that came with a version only to a peer known to speak it; frames queued before
    /// the answer is known are read by any peer, so they keep the older layout.
    pub fn peer_version(&self) -> Option<u32> {
        match &self.0.queue {
            None => Some(wire::PROTOCOL_VERSION),
            Some(q) => Some(q.version.load(Ordering::Relaxed)).filter(|&v| v != 0),
        }
    }

    /// Sends a one-way message, as [`Transport::send`] does.
    pub fn send(&self, topic: &str, body: &[u8]) -> Result<()> {
        self.send_with(topic, put_body(body))
    }

    /// Sends a one-way message whose body `body` appends straight into the peer's queue (no
    /// intermediate buffer). An error from `body` leaves the queue as it was.
    pub fn send_with(&self, topic: &str, body: impl FnOnce(&mut bytes::BytesMut) -> Result<()>) -> Result<()> {
        let s = &self.0;
        s.transport.push(&s.to, s.queue.as_ref(), &Header::Message { topic }, body)
    }
}

/// Whether the link filter (if any) cuts messages from `from` to `to`.
fn cut(inner: &Inner, from: &str, to: &str) -> bool {
    inner.link_filter.as_ref().is_some_and(|f| !f.allows(from, to))
}

async fn loopback_loop(inner: Arc<Inner>, mut frames: mpsc::UnboundedReceiver<Bytes>) {
    let from = inner.local.clone();
    let mut cache = RouteCache::default();
    loop {
        let bytes = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            b = frames.recv() => match b {
                Some(b) => b,
                None => return,
            },
        };
        if let Ok(f) = Frame::decode(&bytes) {
            dispatch(&inner, &from, &bytes, f, &mut cache).await;
        }
    }
}

/// Delivers one frame: responses complete their pending request; messages and requests go to
/// the topic's handler and subscriber. `buf` is the frame's buffer; bodies are slices of it,
/// not copies.
async fn dispatch(inner: &Arc<Inner>, from: &PeerAddr, buf: &Bytes, frame: Frame<'_>, cache: &mut RouteCache) {
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
    let mut inbound = Inbound::new(from.clone(), buf.slice_ref(body), request_id);
    let mut delivered = false;
    // A cached route may belong to a replaced subscription: on failure look up once more.
    for attempt in 0..2 {
        let Some(route) = cache.get(inner, topic, attempt == 1) else { break };
        // A handler sees a message once, even when its channel turns out to be replaced.
        if let (Some(handler), 0) = (&route.handler, attempt) {
            match handler(inbound) {
                None => return,
                Some(back) => inbound = back,
            }
        }
        // Most frames find room: no await machinery for them.
        let sent = match route.tx.try_send(inbound) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(back)) => route.tx.send(back).await.map_err(|e| e.0),
            Err(mpsc::error::TrySendError::Closed(back)) => Err(back),
        };
        match sent {
            Ok(()) => {
                delivered = true;
                break;
            }
            Err(back) => inbound = back,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the snapshot reads its own cell (distinct values, so two crossed wires
    /// fail).
    #[test]
    fn a_transport_stats_snapshot_reads_each_counter_from_its_own_cell() {
        use std::sync::atomic::Ordering;
        let cells = TransportStatCells::default();
        cells.frames_sent.store(1, Ordering::Relaxed);
        cells.frames_received.store(2, Ordering::Relaxed);
        cells.bytes_sent.store(3, Ordering::Relaxed);
        cells.bytes_received.store(4, Ordering::Relaxed);
        cells.connections_rejected.store(5, Ordering::Relaxed);
        cells.frames_dropped.store(6, Ordering::Relaxed);
        let snapshot = cells.snapshot();
        let expected = TransportStats {
            frames_sent: 1,
            frames_received: 2,
            bytes_sent: 3,
            bytes_received: 4,
            connections_rejected: 5,
            frames_dropped: 6,
        };
        assert_eq!(snapshot, expected);
    }
}
