//! The receiving side: admission limits, the acceptor's handshake (plain or Noise with key
//! confirmation), and the read loop that hands frames to `dispatch`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{FutureExt, SinkExt, StreamExt};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tracing::{debug, info, warn};

use super::admission::HandshakeSlots;
use super::wire::{self, Frame, Hello, HelloReply, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason};
use super::{ConnectionStop, Inner, MAX_HANDSHAKE_FRAME, PeerAddr, RouteCache, codec, cut, dispatch, noise};
use crate::log_limit::LogLimiter;
use crate::machine::{BoxedConnection, Listener};
use crate::membership::{PeerStanding, UniqueAddress};
use tokio_util::sync::CancellationToken;

/// Admission of inbound connections: the handshake slots ([`HandshakeSlots`]), and at most
/// `max_inbound_connections` established ones, counted once the dialer's key confirmation
/// arrived, so handshakes cannot take the members' places.
struct InboundLimits {
    handshaking: Mutex<HandshakeSlots<CancellationToken>>,
    established: Arc<tokio::sync::Semaphore>,
    /// One warning a minute per source address about connections closed by us.
    closed_log: Mutex<LogLimiter<IpAddr>>,
}

/// One inbound connection in its handshake: frees its slot when dropped.
struct HandshakePermit {
    limits: Arc<InboundLimits>,
    slot: u64,
    /// Cancelled when a newer connection evicted this one.
    evicted: CancellationToken,
}

impl HandshakePermit {
    /// The connection sent its first frame.
    fn spoke(&self) {
        self.limits.handshaking.lock().expect("handshaking lock").spoke(self.slot);
    }
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        self.limits.handshaking.lock().expect("handshaking lock").release(self.slot);
    }
}

impl InboundLimits {
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<HandshakePermit> {
        let evicted = CancellationToken::new();
        let (slot, displaced) = self.handshaking.lock().expect("handshaking lock").admit(ip, evicted.clone())?;
        if let Some(displaced) = displaced {
            displaced.cancel();
        }
        Some(HandshakePermit { limits: self.clone(), slot, evicted })
    }
}

pub(super) async fn accept_loop(mut listener: Box<dyn Listener>, inner: Arc<Inner>) {
    let limits = Arc::new(InboundLimits {
        handshaking: Mutex::new(HandshakeSlots::new(
            inner.settings.max_handshaking_connections,
            inner.settings.max_handshakes_per_ip,
        )),
        established: Arc::new(tokio::sync::Semaphore::new(inner.settings.max_inbound_connections)),
        closed_log: Mutex::new(LogLimiter::new(Duration::from_secs(60))),
    });
    loop {
        let accepted = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, remote)) => {
                let Some(permit) = limits.admit(remote.ip()) else {
                    // Closed at once: no task, no buffer for a connection over the limits.
                    inner.stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
                    debug!(%remote, "inbound connection over the per-address handshake limit; closed");
                    continue;
                };
                inner.spawner.spawn(read_connection(inner.clone(), stream, remote, permit));
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
    #[error("no first frame within the first-frame timeout")]
    FirstFrameTimeout,
    #[error("evicted by a newer connection while handshaking (the handshake slots are full)")]
    Evicted,
    #[error("established inbound connections at their cap (transport.max_inbound_connections)")]
    OverCapacity,
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

async fn read_connection(inner: Arc<Inner>, stream: BoxedConnection, remote: SocketAddr, permit: HandshakePermit) {
    let limits = permit.limits.clone();
    let result = tokio::select! {
        _ = inner.shutdown.cancelled() => Ok(()),
        r = serve_connection(&inner, stream, permit) => r,
    };
    if let Err(e) = result {
        inner.stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
        let held_back =
            limits.closed_log.lock().expect("log limiter lock").allow(&remote.ip(), std::time::Instant::now());
        match held_back {
            Some(held_back) => warn!(%remote, reason = %e, held_back, "closing inbound connection"),
            None => debug!(%remote, reason = %e, "closing inbound connection"),
        }
    }
}

async fn serve_connection(
    inner: &Arc<Inner>,
    stream: BoxedConnection,
    permit: HandshakePermit,
) -> Result<(), InboundError> {
    let handshake = tokio::time::timeout(inner.settings.connect_timeout, accept_handshake(inner, stream, &permit));
    let (from, mut framed, version) = tokio::select! {
        _ = permit.evicted.cancelled() => return Err(InboundError::Evicted),
        r = handshake => match r {
            Err(_) => return Err(InboundError::HandshakeTimeout),
            Ok(Ok(Some(accepted))) => accepted,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
        },
    };
    let limits = permit.limits.clone();
    drop(permit);
    let Ok(_established) = limits.established.clone().try_acquire_owned() else {
        return Err(InboundError::OverCapacity);
    };
    framed.codec_mut().set_max_frame_length(inner.settings.max_frame_size);
    info!(peer = %from.address, version, "inbound connection accepted");
    let registration = InboundRegistration::new(inner, &from.address);
    let mut routes = RouteCache::default();
    let mut batch = Vec::with_capacity(RECEIVE_BATCH);
    loop {
        let item = tokio::select! {
            _ = registration.stop.token.cancelled() => return Ok(()), // the peer was forgotten
            item = framed.next() => match item {
                Some(item) => item,
                None => break,
            },
        };
        // Every frame already read, up to a count and a byte budget (the reader does not run
        // far ahead of what it dispatches): one wake and one filter check for all of them.
        let size = |item: &std::io::Result<bytes::BytesMut>| item.as_ref().map_or(0, |b| b.len());
        let mut bytes_read = size(&item);
        batch.push(item);
        while batch.len() < RECEIVE_BATCH && bytes_read < RECEIVE_BATCH_BYTES {
            match framed.next().now_or_never() {
                Some(Some(item)) => {
                    bytes_read += size(&item);
                    batch.push(item);
                }
                _ => break,
            }
        }
        inner.stats.frames_received.fetch_add(batch.len() as u64, Ordering::Relaxed);
        inner.stats.bytes_received.fetch_add(bytes_read as u64, Ordering::Relaxed);
        let is_cut = cut(inner, &from.address.node_id, &inner.local.address.node_id);
        for item in batch.drain(..) {
            if registration.stop.is_stopped() {
                return Ok(()); // the peer was forgotten: nothing more of it is heard
            }
            let bytes = item.map_err(InboundError::BadFrame)?.freeze();
            let frame = Frame::decode_at(version, &bytes).map_err(|e| InboundError::MalformedFrame(e.to_string()))?;
            if is_cut {
                inner.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            dispatch(inner, &from, &bytes, frame, &mut routes).await;
        }
    }
    Ok(())
}

/// Frames a reader takes from its buffer before it dispatches them.
const RECEIVE_BATCH: usize = 256;

/// Bytes after which a reader stops taking frames and dispatches what it has (at least one
/// frame is always taken, whatever its size).
const RECEIVE_BATCH_BYTES: usize = 256 * 1024;

/// The acceptor's side of the handshake (the caller bounds it by the connect timeout): the
/// dialer, the connection and the protocol version its frames use; `None` when the peer closed
/// before saying anything.
async fn accept_handshake(
    inner: &Arc<Inner>,
    stream: BoxedConnection,
    permit: &HandshakePermit,
) -> Result<Option<(PeerAddr, Framed<BoxedConnection, InboundCodec>, u32)>, InboundError> {
    let mut framed = Framed::new(stream, codec(MAX_HANDSHAKE_FRAME));
    // A dialer sends its first frame right after connecting: a silent connection is an idle
    // slot-holder, closed long before the whole handshake's deadline.
    let first = match tokio::time::timeout(inner.settings.first_frame_timeout, framed.next()).await {
        Err(_) => return Err(InboundError::FirstFrameTimeout),
        Ok(None) => return Ok(None),
        Ok(Some(Err(e))) => return Err(InboundError::BadFrame(e)),
        Ok(Some(Ok(b))) => b,
    };
    permit.spoke();
    let (mut handshake, hello) = if inner.psks.is_empty() {
        (None, first.to_vec())
    } else {
        match noise::respond(&inner.psks, inner.local.messaging_addr, &first) {
            Ok((hs, payload)) => (Some(hs), payload),
            Err(e) => {
                // Said in plain text: we hold no key this peer shares.
                if let Ok(b) = wire::encode(&HelloReply::Reject(RejectReason::Unauthenticated)) {
                    let _ = framed.send(b).await;
                }
                return Err(InboundError::Unauthenticated(e.to_string()));
            }
        }
    };
    let hello: Hello = wire::decode(&hello).map_err(|e| InboundError::MalformedHandshake(e.to_string()))?;
    let reject = if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&hello.protocol_version) {
        Some(RejectReason::ProtocolVersion { theirs: hello.protocol_version, ours: PROTOCOL_VERSION })
    } else if hello.cluster_id != inner.cluster_id {
        Some(RejectReason::ForeignCluster(hello.cluster_id.clone()))
    } else if hello.to != inner.local.address {
        Some(RejectReason::WrongAddressee(hello.to.clone()))
    } else {
        not_a_member(inner, &hello.from).await
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
    Ok(Some((from, framed, hello.protocol_version)))
}

/// Why `peer` may not send frames here, or `None` if it may: a current member, or any peer when
/// the transport runs outside a node. A peer gossip has not brought here yet gets half the
/// connect timeout to appear.
async fn not_a_member(inner: &Inner, peer: &UniqueAddress) -> Option<RejectReason> {
    let mut members = inner.members.get()?.clone();
    let deadline = tokio::time::Instant::now() + inner.settings.connect_timeout / 2;
    loop {
        let standing = members.borrow_and_update().standing_of(peer);
        match standing {
            PeerStanding::Member => return None,
            PeerStanding::Gone(why) => return Some(RejectReason::NotAMember(why.to_string())),
            PeerStanding::Unknown => match tokio::time::timeout_at(deadline, members.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Some(RejectReason::NotAMember("not a member here".to_string())),
            },
        }
    }
}

/// An established inbound connection in the transport's registry, removed when it ends.
struct InboundRegistration<'a> {
    inner: &'a Inner,
    peer: UniqueAddress,
    stop: Arc<ConnectionStop>,
}

impl<'a> InboundRegistration<'a> {
    fn new(inner: &'a Inner, peer: &UniqueAddress) -> Self {
        let stop = Arc::new(ConnectionStop::default());
        inner.inbound.lock().expect("inbound lock").entry(peer.clone()).or_default().push(stop.clone());
        InboundRegistration { inner, peer: peer.clone(), stop }
    }
}

impl Drop for InboundRegistration<'_> {
    fn drop(&mut self) {
        // Stopped connections are those that ended (this one included from here on).
        self.stop.stop();
        let mut inbound = self.inner.inbound.lock().expect("inbound lock");
        if let Some(conns) = inbound.get_mut(&self.peer) {
            conns.retain(|c| !c.is_stopped());
            if conns.is_empty() {
                inbound.remove(&self.peer);
            }
        }
    }
}
