//! The sending side: one writer task per peer incarnation dials, handshakes (plain or Noise),
//! then writes whatever has queued up, sealing it when the link is encrypted.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio_util::codec::Framed;
use tracing::{debug, warn};

use super::wire::{self, BINARY_FRAMES, Hello, HelloReply, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason};
use super::{Inner, MAX_HANDSHAKE_FRAME, PeerAddr, PeerQueue, codec, cut, noise};
use crate::error::Error;
use crate::machine::BoxedConnection;

/// Dials the peer, handshakes, then writes whatever has queued up in one write per wake-up;
/// reconnects with backoff. Frames in a failed write are lost (delivery is at most once).
pub(super) async fn writer_task(inner: Arc<Inner>, peer: PeerAddr, queue: Arc<PeerQueue>) {
    let mut dialer =
        Dialer { backoff: inner.settings.reconnect_backoff_min, unreachable_since: None, version: PROTOCOL_VERSION };
    while let Some(mut link) = dialer.connect(&inner, &peer, &queue).await {
        queue.version.store(dialer.version, Ordering::Relaxed);
        if write_queued(&inner, &peer, &queue, &mut link, dialer.version).await == LinkEnd::Stop {
            break;
        }
    }
    if inner.shutdown.is_cancelled() {
        // Senders holding this queue learn of the shutdown from it (see `Transport::push`).
        queue.close(&mut queue.state.lock().expect("queue lock"));
    }
}

/// The writer's dialing state across reconnects.
struct Dialer {
    backoff: Duration,
    /// When dialing started failing; a peer unreachable for `unreachable_give_up` loses its
    /// writer.
    unreachable_since: Option<tokio::time::Instant>,
    /// Lowered once if the peer is an older node that refuses this version.
    version: u32,
}

impl Dialer {
    /// Dials (with backoff) until a link is up; `None` when the writer ends: shutdown, a
    /// refused handshake, or a peer unreachable for too long (its queue is closed).
    async fn connect(&mut self, inner: &Inner, peer: &PeerAddr, queue: &Arc<PeerQueue>) -> Option<Link> {
        let s = &inner.settings;
        loop {
            let conn = tokio::select! {
                _ = inner.shutdown.cancelled() => return None,
                r = tokio::time::timeout(s.connect_timeout, dial(inner, peer, self.version)) => {
                    r.unwrap_or(Err(DialError::TimedOut))
                }
            };
            let e = match conn {
                Ok(link) => {
                    self.backoff = s.reconnect_backoff_min;
                    self.unreachable_since = None;
                    return Some(link);
                }
                Err(DialError::OlderVersion(theirs)) => {
                    debug!(peer = %peer.address, version = theirs, "peer speaks an older protocol version; dialing at it");
                    self.version = theirs;
                    continue;
                }
                Err(DialError::Refused(reason)) => {
                    warn!(peer = %peer.address, %reason, "peer refused the handshake; dropping its queue");
                    // Kept in the writers map, closed, so the next send fails with the reason.
                    close_writer(inner, peer, queue, &format!("it refused our handshake: {reason}"), false);
                    return None;
                }
                Err(e) => e,
            };
            let failing = *self.unreachable_since.get_or_insert_with(tokio::time::Instant::now);
            if failing.elapsed() >= s.unreachable_give_up {
                let reason = format!("not reachable for {:?}", s.unreachable_give_up);
                debug!(peer = %peer.address, %reason, "giving up on the peer; dropping its queue");
                close_writer(inner, peer, queue, &reason, true);
                return None;
            }
            match e {
                DialError::Io(e) => debug!(peer = %peer.address, error = %e, "connect failed; retrying"),
                _ => debug!(peer = %peer.address, "connect timed out; retrying"),
            }
            tokio::select! {
                _ = inner.shutdown.cancelled() => return None,
                _ = tokio::time::sleep(self.backoff) => {}
            }
            self.backoff = (self.backoff * 2).min(s.reconnect_backoff_max);
        }
    }
}

/// How a link's write loop ended.
#[derive(PartialEq, Eq)]
enum LinkEnd {
    /// The link broke: dial again.
    Reconnect,
    /// Shutdown, or the peer was forgotten: the writer ends.
    Stop,
}

/// The largest write buffer a writer keeps between writes.
const KEPT_BUFFER_BYTES: usize = 1 << 20;

/// Writes whatever queues up, one write per wake-up, until the link breaks or the writer ends.
async fn write_queued(inner: &Inner, peer: &PeerAddr, queue: &PeerQueue, link: &mut Link, version: u32) -> LinkEnd {
    let s = &inner.settings;
    let mut sealed = bytes::BytesMut::new();
    let mut older = bytes::BytesMut::new();
    // The buffer being written, swapped with the queue's: the two take turns, so queueing a
    // frame allocates nothing once both have grown to the traffic's size.
    let mut chunk = bytes::BytesMut::new();
    loop {
        chunk.clear();
        if chunk.capacity() > KEPT_BUFFER_BYTES {
            chunk = bytes::BytesMut::new(); // a burst's buffer is not kept for ever
        }
        let n = {
            let mut q = queue.state.lock().expect("queue lock");
            if q.closed {
                return LinkEnd::Stop; // forgotten peer
            }
            let n = std::mem::take(&mut q.frames);
            if n > 0 {
                std::mem::swap(&mut q.buf, &mut chunk);
            }
            n
        };
        if n == 0 {
            tokio::select! {
                _ = inner.shutdown.cancelled() => return LinkEnd::Stop,
                _ = queue.wake.notified() => {
                    // Woken by the first frame; the tasks woken with it (entities answering
                    // a batch that one read delivered) add theirs before we take the queue,
                    // so they leave in one write rather than one each.
                    tokio::task::yield_now().await;
                    continue;
                }
            }
        }
        if cut(inner, &inner.local.address.node_id, &peer.address.node_id) {
            inner.stats.frames_dropped.fetch_add(n as u64, Ordering::Relaxed);
            continue;
        }
        let frames: &[u8] = if version < BINARY_FRAMES {
            older.clear();
            match wire::binary_frames_to_v2(&chunk, &mut older, s.max_frame_size) {
                Ok(0) => {}
                Ok(left_out) => {
                    inner.stats.frames_dropped.fetch_add(left_out as u64, Ordering::Relaxed);
                    warn!(peer = %peer.address, left_out, "frames too large for an older peer's layout; dropped");
                }
                Err(e) => {
                    inner.stats.frames_dropped.fetch_add(n as u64, Ordering::Relaxed);
                    warn!(peer = %peer.address, error = %e, "frames not rewritten for an older peer; dropped");
                    continue;
                }
            }
            &older
        } else {
            &chunk
        };
        let bytes: &[u8] = match &mut link.cipher {
            Some(cipher) => {
                sealed.clear();
                if let Err(e) = noise::seal(cipher, frames, &mut sealed) {
                    warn!(peer = %peer.address, error = %e, "sealing failed; reconnecting");
                    return LinkEnd::Reconnect;
                }
                &sealed
            }
            None => frames,
        };
        if let Err(e) = write_making_progress(&mut link.stream, bytes, s.write_timeout).await {
            debug!(peer = %peer.address, error = %e, "write failed; reconnecting");
            return LinkEnd::Reconnect;
        }
        inner.stats.frames_sent.fetch_add(n as u64, Ordering::Relaxed);
        inner.stats.bytes_sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    }
}

/// Writes all of `buf`, failing if the peer accepts no byte for `stall` (a peer that stopped
/// reading, or a dead path TCP would retransmit into for many minutes).
async fn write_making_progress(stream: &mut BoxedConnection, mut buf: &[u8], stall: Duration) -> std::io::Result<()> {
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

/// An established outbound connection: the socket and, with a secret, its sending cipher.
struct Link {
    stream: BoxedConnection,
    cipher: Option<snow::TransportState>,
}

enum DialError {
    Io(std::io::Error),
    TimedOut,
    Refused(String),
    /// The peer speaks only this older version, which this node still speaks too.
    OlderVersion(u32),
}

/// Ends a writer: drops its queued frames and fails the requests waiting on the peer now, not
/// at their timeouts. With `forget`, the writer also leaves the map (the next send dials anew);
/// without, the closed queue stays so the next send fails with `reason` first.
fn close_writer(inner: &Inner, peer: &PeerAddr, queue: &Arc<PeerQueue>, reason: &str, forget: bool) {
    {
        let mut q = queue.state.lock().expect("queue lock");
        queue.close(&mut q);
        q.refused = Some(reason.to_string());
        q.buf = bytes::BytesMut::new();
        q.frames = 0;
    }
    if forget {
        let mut writers = inner.writers.lock().expect("writers lock");
        if writers.get(peer).is_some_and(|w| Arc::ptr_eq(w, queue)) {
            writers.remove(peer);
        }
    }
    let mut pending = inner.pending.lock().expect("pending lock");
    let waiting: Vec<u64> = pending.iter().filter(|(_, r)| r.peer == peer.address).map(|(id, _)| *id).collect();
    for id in waiting {
        if let Some(r) = pending.remove(&id) {
            let peer = peer.address.node_id.to_string();
            let _ = r.reply.send(Err(Error::PeerUnavailable { peer, reason: reason.to_string() }));
        }
    }
}

async fn dial(inner: &Inner, peer: &PeerAddr, version: u32) -> Result<Link, DialError> {
    use tokio::io::AsyncWriteExt;
    let stream = inner.machine.connect(peer.messaging_addr, inner.settings.keepalive).await.map_err(DialError::Io)?;
    let mut framed = Framed::new(stream, codec(MAX_HANDSHAKE_FRAME));
    let hello = Hello {
        protocol_version: version,
        cluster_id: inner.cluster_id.clone(),
        from: inner.local.address.clone(),
        from_messaging_addr: inner.local.messaging_addr,
        to: peer.address.clone(),
    };
    let hello = wire::encode(&hello).map_err(|e| DialError::Refused(e.to_string()))?;
    let mut handshake = inner.psks.first().map(|psk| noise::initiator(psk, peer.messaging_addr));
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
        Ok(HelloReply::Reject(RejectReason::ProtocolVersion { ours, .. }))
            if (MIN_PROTOCOL_VERSION..version).contains(&ours) =>
        {
            return Err(DialError::OlderVersion(ours));
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
