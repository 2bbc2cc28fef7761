//! Authenticated, fresh gossip datagrams: the UDP socket chitchat gossips through when the
//! cluster has a secret.
//!
//! Guarantees, for a cluster whose members share the secret:
//! - **Authentic.** A datagram whose tag does not verify is dropped and counted before any of its
//!   bytes is parsed, so an outsider can neither join, forge a member's state nor make a node
//!   decode anything.
//! - **Fresh, and taken once.** Each datagram is stamped with its sender's wall clock; one sent
//!   more than `membership.gossip_freshness_window` away from the receiver's clock is dropped,
//!   and one whose tag was already taken inside the window is dropped as a replay. So a captured
//!   datagram cannot bring back the state it carried — e.g. members that have since left, seen
//!   by a node restarted after the cluster forgot them (review finding S1).
//! - **Answered only to its sender.** The stamp names the sender's advertised gossip address,
//!   and chitchat answers there, never to the datagram's UDP source: a datagram with a spoofed
//!   source reflects nothing to a third party and hands the gossip state to nobody but a member
//!   (S4).
//!
//! Format: `format byte ‖ stamp ‖ body ‖ tag`. The stamp is the sender's wall-clock ms (u64,
//! big-endian) and its gossip address (`4 ‖ IPv4 ‖ port` or `6 ‖ IPv6 ‖ port`); the body is
//! chitchat's envelope encoding (zstd-compressed when the tag would push a full-size envelope
//! past the largest UDP payload); the tag is the first 16 bytes of a BLAKE2s MAC, keyed by a key
//! derived from the cluster secret, over everything before it. Earlier releases sent unstamped
//! datagrams (formats 1 and 2); `membership.accept_unstamped_gossip` lets a cluster upgrade from
//! them with two rolling restarts.
//!
//! Clocks: members' wall clocks must agree within the window (30 s by default), as they already
//! must for incarnation generations. A node whose clock is further off hears no gossip; the
//! drops are counted (`stale`) and logged once a minute per sender with the offset.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use blake2::Blake2sMac256;
use blake2::digest::{KeyInit, Mac};
use chitchat::ChitchatEnvelope;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket};
use futures::FutureExt;
use tracing::{debug, warn};

use crate::log_limit::LogLimiter;
use crate::secret::DerivedKey;

/// Largest UDP payload over IPv4, the most chitchat ever puts in one envelope.
const MAX_DATAGRAM: usize = 65_507;
const TAG_LEN: usize = 16;
/// Formats of earlier releases: no stamp.
const FORMAT_PLAIN: u8 = 1;
const FORMAT_ZSTD: u8 = 2;
const FORMAT_STAMPED_PLAIN: u8 = 3;
const FORMAT_STAMPED_ZSTD: u8 = 4;
/// The longest stamp: ms, family, IPv6 address, port.
const MAX_STAMP_LEN: usize = 8 + 1 + 16 + 2;
/// Tags remembered for the replay check. Only authentic datagrams enter, so only members'
/// traffic fills it: a node receives a few datagrams per gossip round whatever the cluster
/// size (chitchat gossips with three peers a round), a few hundred per default window.
const MAX_REMEMBERED_TAGS: usize = 65_536;

/// Counters of the gossip socket, for logs, tests and operators.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GossipStats {
    /// Datagrams dropped because their MAC did not verify (no secret, another secret, forged or
    /// altered).
    pub datagrams_unauthenticated: u64,
    /// Authenticated datagrams that still did not decode (a bug or a member on another version).
    pub datagrams_malformed: u64,
    /// Envelopes not sent because, even compressed, they did not fit one datagram with the tag.
    pub datagrams_oversized: u64,
    /// Authentic datagrams stamped outside the freshness window of this node's clock: old
    /// captures replayed, or a member whose clock is that far off.
    pub datagrams_stale: u64,
    /// Authentic datagrams already received once inside the window: replays.
    pub datagrams_replayed: u64,
    /// Authentic datagrams without a stamp (a member on a release before stamps), dropped
    /// unless `membership.accept_unstamped_gossip` is on.
    pub datagrams_unstamped: u64,
    /// Down marks this node published in gossip, one per member downed: its split-brain
    /// resolver's decisions (itself included when it is on the losing side) and operators'
    /// downs ([`crate::Node::down`]).
    pub downs_published: u64,
    /// Discovery lookups that failed or timed out (every source at once).
    pub discovery_lookups_failed: u64,
    /// Addresses the last successful discovery lookup found (this node's own and duplicates
    /// left out, at most `discovery.max_contact_points`).
    pub discovery_contact_points: u64,
    /// Addresses left out because a lookup found more than `discovery.max_contact_points`.
    pub discovery_addresses_dropped: u64,
}

/// The live cells behind [`GossipStats`], one per field (the snapshot names every cell, so the
/// two cannot drift apart).
#[derive(Debug, Default)]
pub(crate) struct GossipStatCells {
    pub(crate) datagrams_unauthenticated: AtomicU64,
    pub(crate) datagrams_malformed: AtomicU64,
    pub(crate) datagrams_oversized: AtomicU64,
    pub(crate) datagrams_stale: AtomicU64,
    pub(crate) datagrams_replayed: AtomicU64,
    pub(crate) datagrams_unstamped: AtomicU64,
    pub(crate) downs_published: AtomicU64,
    pub(crate) discovery_lookups_failed: AtomicU64,
    pub(crate) discovery_contact_points: AtomicU64,
    pub(crate) discovery_addresses_dropped: AtomicU64,
}

impl GossipStatCells {
    /// The counters as of now (each read on its own: a snapshot, not one instant).
    pub(crate) fn snapshot(&self) -> GossipStats {
        GossipStats {
            datagrams_unauthenticated: self.datagrams_unauthenticated.load(Ordering::Relaxed),
            datagrams_malformed: self.datagrams_malformed.load(Ordering::Relaxed),
            datagrams_oversized: self.datagrams_oversized.load(Ordering::Relaxed),
            datagrams_stale: self.datagrams_stale.load(Ordering::Relaxed),
            datagrams_replayed: self.datagrams_replayed.load(Ordering::Relaxed),
            datagrams_unstamped: self.datagrams_unstamped.load(Ordering::Relaxed),
            downs_published: self.downs_published.load(Ordering::Relaxed),
            discovery_lookups_failed: self.discovery_lookups_failed.load(Ordering::Relaxed),
            discovery_contact_points: self.discovery_contact_points.load(Ordering::Relaxed),
            discovery_addresses_dropped: self.discovery_addresses_dropped.load(Ordering::Relaxed),
        }
    }
}

/// Why a received datagram was dropped.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DatagramError {
    #[error("datagram not authenticated by the cluster secret")]
    Unauthenticated,
    #[error("malformed datagram: {0}")]
    Malformed(String),
}

/// Who sealed a datagram and when: its wall-clock ms and its advertised gossip address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub(crate) sent_ms: u64,
    pub(crate) sender: SocketAddr,
}

impl Stamp {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.sent_ms.to_be_bytes());
        match self.sender.ip() {
            IpAddr::V4(ip) => {
                out.push(4);
                out.extend_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                out.push(6);
                out.extend_from_slice(&ip.octets());
            }
        }
        out.extend_from_slice(&self.sender.port().to_be_bytes());
    }

    /// The stamp at the start of `bytes` and the rest.
    fn decode(bytes: &[u8]) -> Result<(Stamp, &[u8]), DatagramError> {
        let short = || DatagramError::Malformed("truncated stamp".into());
        let (ms, rest) = bytes.split_first_chunk::<8>().ok_or_else(short)?;
        let (family, rest) = rest.split_first().ok_or_else(short)?;
        let (ip, rest): (IpAddr, &[u8]) = match family {
            4 => {
                let (ip, rest) = rest.split_first_chunk::<4>().ok_or_else(short)?;
                ((*ip).into(), rest)
            }
            6 => {
                let (ip, rest) = rest.split_first_chunk::<16>().ok_or_else(short)?;
                ((*ip).into(), rest)
            }
            other => return Err(DatagramError::Malformed(format!("unknown address family {other}"))),
        };
        let (port, rest) = rest.split_first_chunk::<2>().ok_or_else(short)?;
        let stamp = Stamp { sent_ms: u64::from_be_bytes(*ms), sender: SocketAddr::new(ip, u16::from_be_bytes(*port)) };
        Ok((stamp, rest))
    }
}

/// An authentic datagram's contents.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Opened {
    /// `None` for the unstamped formats of earlier releases.
    pub(crate) stamp: Option<Stamp>,
    /// The tag, which identifies the datagram for the replay check.
    pub(crate) tag: [u8; TAG_LEN],
    /// chitchat's envelope encoding.
    pub(crate) envelope: Vec<u8>,
}

/// Seals datagrams with its first key and opens those sealed with any of its keys (a cluster
/// rotating its secret accepts the old and the new one); pure, so the format is tested without
/// sockets.
#[derive(Clone)]
pub(crate) struct DatagramSealer {
    keys: Vec<DerivedKey>,
}

impl DatagramSealer {
    /// `keys` must not be empty: the first seals.
    pub(crate) fn new(keys: Vec<DerivedKey>) -> Self {
        assert!(!keys.is_empty(), "a sealer needs a key");
        DatagramSealer { keys }
    }

    fn mac(&self) -> Blake2sMac256 {
        Self::mac_of(&self.keys[0])
    }

    fn mac_of(key: &DerivedKey) -> Blake2sMac256 {
        <Blake2sMac256 as KeyInit>::new_from_slice(key).expect("a 32-byte key fits BLAKE2s")
    }

    /// The datagram for `envelope` (stamped unless `stamp` is `None`, the format of earlier
    /// releases), or `None` when it cannot fit one datagram even compressed.
    pub(crate) fn seal(&self, envelope: &[u8], stamp: Option<Stamp>) -> Option<Vec<u8>> {
        let mut header = Vec::with_capacity(1 + MAX_STAMP_LEN);
        header.push(0);
        if let Some(stamp) = stamp {
            stamp.encode(&mut header);
        }
        let fits = |body_len: usize| header.len() + body_len + TAG_LEN <= MAX_DATAGRAM;
        let (format, body) = if fits(envelope.len()) {
            (if stamp.is_some() { FORMAT_STAMPED_PLAIN } else { FORMAT_PLAIN }, std::borrow::Cow::Borrowed(envelope))
        } else {
            let compressed = zstd::bulk::compress(envelope, 1).ok()?;
            if !fits(compressed.len()) {
                return None;
            }
            (if stamp.is_some() { FORMAT_STAMPED_ZSTD } else { FORMAT_ZSTD }, std::borrow::Cow::Owned(compressed))
        };
        header[0] = format;
        let mut out = header;
        out.extend_from_slice(&body);
        let mut mac = self.mac();
        mac.update(&out);
        let tag = mac.finalize().into_bytes();
        out.extend_from_slice(&tag[..TAG_LEN]);
        Some(out)
    }

    /// The contents of an authentic datagram. The tag is checked (in constant time) before
    /// anything else is looked at.
    pub(crate) fn open(&self, datagram: &[u8]) -> Result<Opened, DatagramError> {
        if datagram.len() < 1 + TAG_LEN {
            return Err(DatagramError::Unauthenticated);
        }
        let (signed, tag) = datagram.split_at(datagram.len() - TAG_LEN);
        let authentic = self.keys.iter().any(|key| {
            let mut mac = Self::mac_of(key);
            mac.update(signed);
            mac.verify_truncated_left(tag).is_ok()
        });
        if !authentic {
            return Err(DatagramError::Unauthenticated);
        }
        let tag: [u8; TAG_LEN] = tag.try_into().expect("split at TAG_LEN");
        let (format, rest) = (signed[0], &signed[1..]);
        let (stamp, body) = match format {
            FORMAT_PLAIN | FORMAT_ZSTD => (None, rest),
            FORMAT_STAMPED_PLAIN | FORMAT_STAMPED_ZSTD => {
                let (stamp, body) = Stamp::decode(rest)?;
                (Some(stamp), body)
            }
            other => return Err(DatagramError::Malformed(format!("unknown format {other}"))),
        };
        let envelope = match format {
            FORMAT_PLAIN | FORMAT_STAMPED_PLAIN => body.to_vec(),
            // Capacity-bounded: a compressed bomb cannot make more than one datagram's worth.
            _ => zstd::bulk::decompress(body, MAX_DATAGRAM)
                .map_err(|e| DatagramError::Malformed(format!("zstd: {e}")))?,
        };
        Ok(Opened { stamp, tag, envelope })
    }
}

/// Why the replay check refused an authentic datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Stamped outside the window; `offset_ms` is the stamp minus this node's clock.
    Stale { offset_ms: i64 },
    /// Already taken once.
    Replayed,
}

/// The freshness and replay check of stamped datagrams; pure (the clock is an input).
///
/// A datagram is taken when its stamp is within `window` of the clock and its (stamp, tag) has
/// not been taken before. Taken tags are remembered until they leave the window; everything at
/// or below the newest stamp ever forgotten is refused, so neither the memory's bound nor a
/// clock stepped back re-opens the door to a replay.
#[derive(Debug)]
pub(crate) struct ReplayGuard {
    window_ms: u64,
    taken: BTreeSet<(u64, [u8; TAG_LEN])>,
    /// Stamps at or below this were forgotten (or were never admissible): refused.
    floor_ms: u64,
    capacity: usize,
}

impl ReplayGuard {
    pub(crate) fn new(window: Duration) -> Self {
        Self::with_capacity(window, MAX_REMEMBERED_TAGS)
    }

    fn with_capacity(window: Duration, capacity: usize) -> Self {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        ReplayGuard { window_ms, taken: BTreeSet::new(), floor_ms: 0, capacity: capacity.max(1) }
    }

    /// Takes the datagram stamped `sent_ms` with `tag`, received at `now_ms`, or says why not.
    pub(crate) fn admit(&mut self, sent_ms: u64, tag: [u8; TAG_LEN], now_ms: u64) -> Result<(), Refusal> {
        let oldest_admissible = now_ms.saturating_sub(self.window_ms);
        while let Some(&(first, _)) = self.taken.first() {
            if first >= oldest_admissible {
                break;
            }
            self.taken.pop_first();
            self.floor_ms = self.floor_ms.max(first);
        }
        let stale = sent_ms < oldest_admissible || sent_ms > now_ms.saturating_add(self.window_ms);
        if stale || (sent_ms <= self.floor_ms && self.floor_ms > 0) {
            let offset_ms = i64::try_from(i128::from(sent_ms) - i128::from(now_ms)).unwrap_or(i64::MIN);
            return Err(Refusal::Stale { offset_ms });
        }
        if !self.taken.insert((sent_ms, tag)) {
            return Err(Refusal::Replayed);
        }
        if self.taken.len() > self.capacity
            && let Some((first, _)) = self.taken.pop_first()
        {
            self.floor_ms = self.floor_ms.max(first);
        }
        Ok(())
    }
}

/// What the gossip socket needs besides the key.
#[derive(Debug, Clone)]
pub(crate) struct GossipSealing {
    /// How far a stamp may be from this node's clock.
    pub(crate) freshness_window: Duration,
    /// Seal unstamped datagrams and take unstamped ones too (upgrading from a release before
    /// stamps).
    pub(crate) accept_unstamped: bool,
}

/// chitchat's socket with every datagram sealed and checked by [`DatagramSealer`].
///
/// chitchat 0.13 keeps its envelope encoding crate-private, so the bytes are obtained through
/// chitchat's own UDP socket on loopback: to send, an envelope goes from a private `codec` socket
/// to a private `tap` socket, whose received bytes are sealed and sent on the real socket; to
/// receive, the opened bytes go from `tap` to `codec`, whose `recv` decodes them. `tap` is
/// connected to `codec`, so the kernel drops what any other local process sends it; `codec`
/// cannot be (chitchat owns it), so bytes from elsewhere are skipped there, and every wait on a
/// hop ends at one deadline however many such bytes arrive: a local flood of `tap` changes
/// nothing, and one of `codec` costs at most [`LOOPBACK_HOP_TIMEOUT`] per datagram received
/// meanwhile (and may cost those datagrams), but the socket keeps reading. Gossip is a few datagrams per second, so the two
/// extra loopback hops cost nothing measurable; replace them once chitchat exposes its codec.
pub(crate) struct AuthenticatedSocket {
    real: tokio::net::UdpSocket,
    codec: chitchat::transport::UdpSocket,
    tap: tokio::net::UdpSocket,
    tap_addr: SocketAddr,
    sealer: DatagramSealer,
    /// The gossip address stamped on every datagram: where members answer.
    advertised: SocketAddr,
    sealing: GossipSealing,
    guard: ReplayGuard,
    /// One line a minute per sender about stale datagrams (a clock off or replays).
    stale_log: LogLimiter<SocketAddr>,
    /// One line a minute about unstamped datagrams.
    unstamped_log: LogLimiter<()>,
    stats: Arc<GossipStatCells>,
    buf: Box<[u8]>,
    /// Sender and size of an opened datagram handed to `codec` whose decoded envelope has not
    /// been returned yet, and when to give it up (kept across a cancelled `recv`, so the next
    /// one resumes there).
    relayed: Option<(SocketAddr, usize, tokio::time::Instant)>,
}

/// A loopback hop normally takes microseconds; past this the datagram is treated as lost.
const LOOPBACK_HOP_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(250);

impl AuthenticatedSocket {
    pub(crate) async fn bind(
        addr: SocketAddr,
        advertise: Option<SocketAddr>,
        keys: Vec<DerivedKey>,
        sealing: GossipSealing,
        stats: Arc<GossipStatCells>,
    ) -> anyhow::Result<AuthenticatedSocket> {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let codec = chitchat::transport::UdpSocket::open(loopback).await?;
        let tap = tokio::net::UdpSocket::bind(loopback).await?;
        tap.connect(codec.local_addr()?).await?;
        let real = tokio::net::UdpSocket::bind(addr).await?;
        Ok(AuthenticatedSocket {
            advertised: crate::config::advertised_addr(real.local_addr()?, advertise)?,
            real,
            codec,
            tap_addr: tap.local_addr()?,
            tap,
            sealer: DatagramSealer::new(keys),
            guard: ReplayGuard::new(sealing.freshness_window),
            sealing,
            stale_log: LogLimiter::new(Duration::from_secs(60)),
            unstamped_log: LogLimiter::new(Duration::from_secs(60)),
            stats,
            buf: vec![0; MAX_DATAGRAM + 1].into_boxed_slice(),
            relayed: None,
        })
    }

    /// Where to answer an authentic datagram received from `from_addr`, or `None` when it is
    /// dropped (stale, replayed, or unstamped where stamps are required; counted and logged).
    fn admit(&mut self, opened: &Opened, from_addr: SocketAddr) -> Option<SocketAddr> {
        let Some(stamp) = opened.stamp else {
            if self.sealing.accept_unstamped {
                return Some(from_addr);
            }
            self.stats.datagrams_unstamped.fetch_add(1, Ordering::Relaxed);
            if let Some(held_back) = self.unstamped_log.allow(&(), crate::clock::now()) {
                warn!(
                    from = %from_addr,
                    held_back,
                    "unstamped gossip datagram dropped: a member runs a release before gossip stamps; \
                     upgrade with membership.accept_unstamped_gossip = true first (see CHANGELOG)"
                );
            }
            return None;
        };
        match self.guard.admit(stamp.sent_ms, opened.tag, crate::clock::wall_ms()) {
            Ok(()) => Some(stamp.sender),
            Err(Refusal::Replayed) => {
                self.stats.datagrams_replayed.fetch_add(1, Ordering::Relaxed);
                debug!(from = %from_addr, sender = %stamp.sender, "replayed gossip datagram dropped");
                None
            }
            Err(Refusal::Stale { offset_ms }) => {
                self.stats.datagrams_stale.fetch_add(1, Ordering::Relaxed);
                if let Some(held_back) = self.stale_log.allow(&stamp.sender, crate::clock::now()) {
                    warn!(
                        from = %from_addr,
                        sender = %stamp.sender,
                        offset_ms,
                        window_ms = self.sealing.freshness_window.as_millis() as u64,
                        held_back,
                        "gossip datagram stamped outside the freshness window dropped: a replay, or \
                         that member's clock is that far from ours (check NTP)"
                    );
                }
                None
            }
        }
    }

    /// chitchat's encoding of `envelope`, or `None` if the loopback hop lost it.
    async fn encode(&mut self, envelope: ChitchatEnvelope) -> anyhow::Result<Option<usize>> {
        // Bytes of an earlier send that was cancelled midway are stale: drop them first (only
        // `codec` can have sent them: `tap` is connected to it).
        while self.tap.try_recv(&mut self.buf).is_ok() {}
        self.codec.send(self.tap_addr, envelope).await?;
        let deadline = tokio::time::Instant::now() + LOOPBACK_HOP_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, self.tap.recv(&mut self.buf)).await {
                Ok(Ok(n)) => return Ok(Some(n)),
                Ok(Err(e)) if is_transient(&e) => continue,
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Ok(None),
            }
        }
    }
}

#[async_trait]
impl Socket for AuthenticatedSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.real.local_addr()?)
    }

    async fn send(&mut self, to: SocketAddr, envelope: ChitchatEnvelope) -> anyhow::Result<SendOutcome> {
        let Some(n) = self.encode(envelope).await? else {
            debug!(%to, "gossip envelope lost on the loopback codec hop; not sent");
            return Ok(SendOutcome { num_bytes_sent: 0 });
        };
        let stamp = (!self.sealing.accept_unstamped)
            .then(|| Stamp { sent_ms: crate::clock::wall_ms(), sender: self.advertised });
        let Some(datagram) = self.sealer.seal(&self.buf[..n], stamp) else {
            self.stats.datagrams_oversized.fetch_add(1, Ordering::Relaxed);
            debug!(%to, len = n, "gossip envelope too large for one sealed datagram; not sent");
            return Ok(SendOutcome { num_bytes_sent: 0 });
        };
        match self.real.send_to(&datagram, to).await {
            Ok(n) => Ok(SendOutcome { num_bytes_sent: n }),
            // A peer that went away is gossip's normal weather, not a broken socket.
            Err(e) if is_transient(&e) => Ok(SendOutcome { num_bytes_sent: 0 }),
            Err(e) => Err(e.into()),
        }
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            if self.relayed.is_none() {
                let (n, from_addr) = match self.real.recv_from(&mut self.buf).await {
                    Ok(r) => r,
                    Err(e) if is_transient(&e) => continue,
                    Err(e) => return Err(e.into()),
                };
                let opened = match self.sealer.open(&self.buf[..n]) {
                    Ok(opened) => opened,
                    Err(e) => {
                        let counter = match e {
                            DatagramError::Unauthenticated => &self.stats.datagrams_unauthenticated,
                            DatagramError::Malformed(_) => &self.stats.datagrams_malformed,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        debug!(from = %from_addr, len = n, error = %e, "gossip datagram dropped");
                        continue;
                    }
                };
                let Some(answer_to) = self.admit(&opened, from_addr) else { continue };
                let envelope = opened.envelope;
                // A hop given up at its deadline may still be waiting in `codec`: drop it, or
                // it would be returned as this datagram, credited to this one's sender.
                for _ in 0..64 {
                    match self.codec.recv().now_or_never() {
                        Some(Ok(_)) => continue,
                        Some(Err(_)) | None => break,
                    }
                }
                if self.tap.send(&envelope).await.is_err() {
                    continue;
                }
                self.relayed = Some((answer_to, n, tokio::time::Instant::now() + LOOPBACK_HOP_TIMEOUT));
            }
            let Some((_, _, deadline)) = self.relayed else { continue };
            match tokio::time::timeout_at(deadline, self.codec.recv()).await {
                Ok(Ok(decoded)) if decoded.from_addr == self.tap_addr => {
                    let (from_addr, num_bytes_received, _) = self.relayed.take().expect("a relayed datagram");
                    return Ok(RecvOutcome { from_addr, envelope: decoded.envelope, num_bytes_received });
                }
                Ok(Ok(_)) => continue, // not from our tap socket: the deadline still holds
                Ok(Err(e)) => return Err(e),
                // chitchat drops (and logs) bytes it cannot decode and keeps waiting.
                Err(_) => {
                    self.relayed = None;
                    self.stats.datagrams_malformed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::OutOfMemory
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the snapshot reads its own cell (distinct values, so two crossed wires
    /// fail).
    #[test]
    fn a_gossip_stats_snapshot_reads_each_counter_from_its_own_cell() {
        use std::sync::atomic::Ordering;
        let cells = GossipStatCells::default();
        cells.datagrams_unauthenticated.store(1, Ordering::Relaxed);
        cells.datagrams_malformed.store(2, Ordering::Relaxed);
        cells.datagrams_oversized.store(3, Ordering::Relaxed);
        cells.datagrams_stale.store(4, Ordering::Relaxed);
        cells.datagrams_replayed.store(5, Ordering::Relaxed);
        cells.datagrams_unstamped.store(6, Ordering::Relaxed);
        cells.downs_published.store(7, Ordering::Relaxed);
        cells.discovery_lookups_failed.store(8, Ordering::Relaxed);
        cells.discovery_contact_points.store(9, Ordering::Relaxed);
        cells.discovery_addresses_dropped.store(10, Ordering::Relaxed);
        let snapshot = cells.snapshot();
        let expected = GossipStats {
            datagrams_unauthenticated: 1,
            datagrams_malformed: 2,
            datagrams_oversized: 3,
            datagrams_stale: 4,
            datagrams_replayed: 5,
            datagrams_unstamped: 6,
            downs_published: 7,
            discovery_lookups_failed: 8,
            discovery_contact_points: 9,
            discovery_addresses_dropped: 10,
        };
        assert_eq!(snapshot, expected);
    }

    fn sealer(byte: u8) -> DatagramSealer {
        DatagramSealer::new(vec![[byte; 32]])
    }

    fn stamp(sent_ms: u64) -> Option<Stamp> {
        Some(Stamp { sent_ms, sender: "10.1.2.3:7000".parse().unwrap() })
    }

    /// Re-tags `d` as its sealer would, after its signed part was edited.
    fn retag(s: &DatagramSealer, d: &mut [u8]) {
        let tag_at = d.len() - TAG_LEN;
        let mut mac = s.mac();
        mac.update(&d[..tag_at]);
        let tag = mac.finalize().into_bytes();
        d[tag_at..].copy_from_slice(&tag[..TAG_LEN]);
    }

    #[test]
    fn a_sealed_datagram_opens_to_its_stamp_and_envelope() {
        let s = sealer(7);
        let d = s.seal(b"hello gossip", stamp(1_700_000_000_123)).unwrap();
        assert_eq!(d.len(), 1 + 8 + 1 + 4 + 2 + 12 + TAG_LEN);
        let opened = s.open(&d).unwrap();
        assert_eq!(opened.envelope, b"hello gossip");
        assert_eq!(opened.stamp, stamp(1_700_000_000_123));
        assert_eq!(&opened.tag[..], &d[d.len() - TAG_LEN..]);
        let v6 = Stamp { sent_ms: u64::MAX, sender: "[2001:db8::7]:65535".parse().unwrap() };
        let d = s.seal(b"", Some(v6)).unwrap();
        assert_eq!(d.len(), 1 + MAX_STAMP_LEN + TAG_LEN);
        assert_eq!(s.open(&d).unwrap().stamp, Some(v6));
    }

    #[test]
    fn an_unstamped_datagram_of_earlier_releases_opens_without_a_stamp() {
        let s = sealer(7);
        let d = s.seal(b"hello gossip", None).unwrap();
        assert_eq!(d.len(), 1 + 12 + TAG_LEN);
        assert_eq!(d[0], FORMAT_PLAIN);
        let opened = s.open(&d).unwrap();
        assert_eq!((opened.stamp, opened.envelope), (None, b"hello gossip".to_vec()));
    }

    #[test]
    fn another_key_or_any_flipped_bit_is_unauthenticated() {
        let d = sealer(7).seal(b"hello gossip", stamp(5)).unwrap();
        assert_eq!(sealer(8).open(&d), Err(DatagramError::Unauthenticated));
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 0x01;
            assert_eq!(sealer(7).open(&bad), Err(DatagramError::Unauthenticated), "flipped byte {i}");
        }
        assert_eq!(sealer(7).open(&d[..d.len() - 1]), Err(DatagramError::Unauthenticated));
        assert_eq!(sealer(7).open(&[]), Err(DatagramError::Unauthenticated));
        assert_eq!(sealer(7).open(&[FORMAT_PLAIN; TAG_LEN]), Err(DatagramError::Unauthenticated));
    }

    #[test]
    fn a_sealer_rotating_its_key_seals_with_the_first_and_opens_with_any() {
        let (old, new) = (sealer(1), sealer(2));
        let rotating = DatagramSealer::new(vec![[2; 32], [1; 32]]);
        let from_old = old.seal(b"old", stamp(1)).unwrap();
        let from_new = new.seal(b"new", stamp(1)).unwrap();
        assert_eq!(rotating.open(&from_old).unwrap().envelope, b"old");
        assert_eq!(rotating.open(&from_new).unwrap().envelope, b"new");
        let sealed = rotating.seal(b"rotating", stamp(1)).unwrap();
        assert_eq!(sealed, new.seal(b"rotating", stamp(1)).unwrap(), "sealed with the first key");
        assert_eq!(old.open(&sealed), Err(DatagramError::Unauthenticated), "sealed with the first key only");
        assert_eq!(rotating.open(&sealer(3).seal(b"x", stamp(1)).unwrap()), Err(DatagramError::Unauthenticated));
    }

    #[test]
    fn a_full_size_envelope_is_compressed_to_fit_beside_its_stamp_and_tag() {
        let s = sealer(1);
        let envelope: Vec<u8> = (0..MAX_DATAGRAM).map(|i| b"node-status-up"[i % 14]).collect();
        for (st, format) in [(stamp(9), FORMAT_STAMPED_ZSTD), (None, FORMAT_ZSTD)] {
            let d = s.seal(&envelope, st).unwrap();
            assert!(d.len() <= MAX_DATAGRAM);
            assert_eq!(d[0], format);
            let opened = s.open(&d).unwrap();
            assert_eq!((opened.stamp, opened.envelope), (st, envelope.clone()));
        }
    }

    #[test]
    fn an_envelope_compressed_to_a_few_kilobytes_is_sent_compressed() {
        // Random kilobytes then zeros: zstd keeps the random part (about 6 KB).
        let mut envelope: Vec<u8> = (0..6_000).map(|_| rand::random::<u8>()).collect();
        envelope.resize(MAX_DATAGRAM, 0);
        let d = sealer(1).seal(&envelope, stamp(1)).unwrap();
        assert_eq!(d[0], FORMAT_STAMPED_ZSTD);
        assert!((6_000..8_000).contains(&d.len()), "{}", d.len());
        assert_eq!(sealer(1).open(&d).unwrap().envelope, envelope);
    }

    #[test]
    fn an_incompressible_full_size_envelope_is_refused_not_truncated() {
        let envelope: Vec<u8> = (0..MAX_DATAGRAM).map(|_| rand::random::<u8>()).collect();
        assert!(sealer(1).seal(&envelope, stamp(1)).is_none());
        let v4_stamp_len = 8 + 1 + 4 + 2;
        let just_fits = &envelope[..MAX_DATAGRAM - 1 - v4_stamp_len - TAG_LEN];
        let d = sealer(1).seal(just_fits, stamp(1)).unwrap();
        assert_eq!((d[0], d.len()), (FORMAT_STAMPED_PLAIN, MAX_DATAGRAM));
        let one_more = &envelope[..MAX_DATAGRAM - v4_stamp_len - TAG_LEN];
        assert!(sealer(1).seal(one_more, stamp(1)).is_none(), "one byte over, incompressible");
    }

    #[test]
    fn an_authentic_but_unknown_format_bad_stamp_or_bad_zstd_is_malformed() {
        let s = sealer(3);
        let mut d = s.seal(b"x", stamp(1)).unwrap();
        d[0] = 9;
        retag(&s, &mut d);
        assert!(matches!(s.open(&d), Err(DatagramError::Malformed(m)) if m.contains("format 9")));
        d[0] = FORMAT_STAMPED_ZSTD;
        retag(&s, &mut d);
        assert!(matches!(s.open(&d), Err(DatagramError::Malformed(m)) if m.contains("zstd")));
        let mut d = s.seal(b"x", stamp(1)).unwrap();
        d[1 + 8] = 5; // address family
        retag(&s, &mut d);
        assert!(matches!(s.open(&d), Err(DatagramError::Malformed(m)) if m.contains("family 5")));
        let mut short = vec![FORMAT_STAMPED_PLAIN, 0, 0, 0];
        short.extend_from_slice(&[0; TAG_LEN]);
        retag(&s, &mut short);
        assert!(matches!(s.open(&short), Err(DatagramError::Malformed(m)) if m.contains("truncated")));
    }

    const W: Duration = Duration::from_secs(30);

    #[test]
    fn a_datagram_is_taken_once_and_only_inside_the_window() {
        let mut g = ReplayGuard::new(W);
        let now = 1_000_000;
        assert_eq!(g.admit(now, [1; TAG_LEN], now), Ok(()));
        assert_eq!(g.admit(now, [1; TAG_LEN], now + 5), Err(Refusal::Replayed));
        assert_eq!(g.admit(now, [2; TAG_LEN], now + 5), Ok(()), "another datagram of the same ms");
        assert_eq!(g.admit(now - 30_000, [3; TAG_LEN], now), Ok(()), "the window's edge is inside");
        assert_eq!(g.admit(now + 30_000, [4; TAG_LEN], now), Ok(()), "a clock ahead by the window");
        assert_eq!(g.admit(now - 30_001, [5; TAG_LEN], now), Err(Refusal::Stale { offset_ms: -30_001 }));
        assert_eq!(g.admit(now + 30_001, [6; TAG_LEN], now), Err(Refusal::Stale { offset_ms: 30_001 }));
        // Still refused as a replay until it leaves the window, then as stale.
        assert_eq!(g.admit(now, [1; TAG_LEN], now + 30_000), Err(Refusal::Replayed));
        assert_eq!(g.admit(now, [1; TAG_LEN], now + 30_001), Err(Refusal::Stale { offset_ms: -30_001 }));
        assert_eq!(ReplayGuard::new(W).admit(0, [7; TAG_LEN], 0), Ok(()), "a clock at the epoch still works");
    }

    #[test]
    fn a_clock_stepped_back_does_not_reopen_the_window_to_a_forgotten_replay() {
        let mut g = ReplayGuard::new(W);
        assert_eq!(g.admit(100_000, [1; TAG_LEN], 100_000), Ok(()));
        // Forgotten once it leaves the window...
        assert_eq!(g.admit(200_000, [2; TAG_LEN], 200_000), Ok(()));
        assert_eq!(g.taken.len(), 1);
        // ...and the clock is stepped back 90 s: the old datagram looks fresh again, but its
        // stamp is at or below what was forgotten.
        assert!(matches!(g.admit(100_000, [1; TAG_LEN], 110_000), Err(Refusal::Stale { .. })));
        assert_eq!(g.admit(100_001, [3; TAG_LEN], 110_000), Ok(()), "newer than anything forgotten");
    }

    #[test]
    fn a_full_memory_forgets_the_oldest_and_refuses_everything_up_to_it() {
        let mut g = ReplayGuard::with_capacity(W, 3);
        let now = 1_000_000;
        for (k, sent) in [now - 3, now - 2, now - 1, now].into_iter().enumerate() {
            assert_eq!(g.admit(sent, [k as u8; TAG_LEN], now), Ok(()));
        }
        assert_eq!(g.taken.len(), 3);
        assert!(matches!(g.admit(now - 3, [0; TAG_LEN], now), Err(Refusal::Stale { .. })), "the forgotten one");
        assert!(matches!(g.admit(now - 3, [9; TAG_LEN], now), Err(Refusal::Stale { .. })), "as old as it");
        assert_eq!(g.admit(now - 2, [1; TAG_LEN], now), Err(Refusal::Replayed), "still remembered");
    }

    async fn socket(window: Duration, accept_unstamped: bool) -> (AuthenticatedSocket, Arc<GossipStatCells>) {
        let stats = Arc::new(GossipStatCells::default());
        let sealing = GossipSealing { freshness_window: window, accept_unstamped };
        let s = AuthenticatedSocket::bind("127.0.0.1:0".parse().unwrap(), None, vec![[5; 32]], sealing, stats.clone())
            .await
            .unwrap();
        (s, stats)
    }

    fn bad_cluster() -> ChitchatEnvelope {
        ChitchatEnvelope { version: chitchat::ProtocolVersion::V0, message: chitchat::ChitchatMessage::BadCluster }
    }

    /// What `from` puts on the wire for one envelope (captured by a plain socket).
    async fn capture(from: &mut AuthenticatedSocket) -> Vec<u8> {
        let wire = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        from.send(wire.local_addr().unwrap(), bad_cluster()).await.unwrap();
        let mut buf = vec![0; MAX_DATAGRAM];
        let (n, _) = tokio::time::timeout(Duration::from_secs(10), wire.recv_from(&mut buf)).await.unwrap().unwrap();
        buf.truncate(n);
        buf
    }

    async fn received(s: &mut AuthenticatedSocket) -> RecvOutcome {
        tokio::time::timeout(Duration::from_secs(10), s.recv()).await.expect("a datagram within 10 s").unwrap()
    }

    async fn nothing_received(s: &mut AuthenticatedSocket) -> bool {
        tokio::time::timeout(Duration::from_millis(300), s.recv()).await.is_err()
    }

    #[tokio::test]
    async fn a_captured_datagram_is_answered_at_its_stamped_sender_once_and_never_when_stale() {
        let (mut member, _) = socket(W, false).await;
        let member_addr = member.local_addr().unwrap();
        let (mut fresh, fresh_stats) = socket(W, false).await;
        let (mut strict, strict_stats) = socket(Duration::from_millis(100), false).await;
        let datagram = capture(&mut member).await;
        // The attacker sends the capture from its own address: taken once, and the reply goes
        // to the member that stamped it.
        let attacker = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        attacker.send_to(&datagram, fresh.local_addr().unwrap()).await.unwrap();
        let got = received(&mut fresh).await;
        assert_eq!(got.from_addr, member_addr, "answered at the stamped sender, not the UDP source");
        assert_eq!(got.envelope, bad_cluster());
        attacker.send_to(&datagram, fresh.local_addr().unwrap()).await.unwrap();
        assert!(nothing_received(&mut fresh).await, "a replay inside the window was taken");
        assert_eq!(fresh_stats.datagrams_replayed.load(Ordering::Relaxed), 1);
        // Outside a node's window the same capture is stale.
        tokio::time::sleep(Duration::from_millis(200)).await;
        attacker.send_to(&datagram, strict.local_addr().unwrap()).await.unwrap();
        assert!(nothing_received(&mut strict).await, "a stale datagram was taken");
        assert_eq!(strict_stats.datagrams_stale.load(Ordering::Relaxed), 1);
        assert_eq!(strict_stats.datagrams_replayed.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn unstamped_gossip_is_taken_only_by_a_node_upgrading_from_it() {
        let (mut old, _) = socket(W, true).await;
        let datagram = capture(&mut old).await;
        assert_eq!(datagram[0], FORMAT_PLAIN, "a node upgrading seals as the release before stamps");
        let (mut strict, strict_stats) = socket(W, false).await;
        let (mut upgrading, _) = socket(W, true).await;
        let wire = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        wire.send_to(&datagram, strict.local_addr().unwrap()).await.unwrap();
        assert!(nothing_received(&mut strict).await, "unstamped gossip taken where stamps are required");
        assert_eq!(strict_stats.datagrams_unstamped.load(Ordering::Relaxed), 1);
        wire.send_to(&datagram, upgrading.local_addr().unwrap()).await.unwrap();
        let got = received(&mut upgrading).await;
        assert_eq!(got.from_addr, wire.local_addr().unwrap(), "unstamped: answered at the UDP source");
        // And a stamped datagram is taken by a node that is upgrading.
        let (mut new, _) = socket(W, false).await;
        let datagram = capture(&mut new).await;
        wire.send_to(&datagram, upgrading.local_addr().unwrap()).await.unwrap();
        assert_eq!(received(&mut upgrading).await.from_addr, new.local_addr().unwrap());
    }

    /// Review finding S11: a local process flooding the private loopback ports does not stall
    /// the socket. `tap` is connected to `codec`, so a flood of it is dropped by the kernel and
    /// sending goes on, every datagram; a flood of `codec` (chitchat's socket, which cannot be
    /// connected) may cost the datagrams received meanwhile, each given up at the hop's
    /// deadline, but the socket goes on reading and takes the next one once the flood ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_local_flood_of_the_private_loopback_ports_does_not_stall_gossip() {
        let (mut a, a_stats) = socket(W, false).await;
        let (mut b, _) = socket(W, false).await;
        let ports = [a.tap_addr, a.codec.local_addr().unwrap()];
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flooder = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                let junk = [0x5au8; 512];
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for p in ports {
                        let _ = s.send_to(&junk, p);
                        sent += 1;
                    }
                }
                sent
            })
        };
        let (a_addr, b_addr) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        for round in 0..20 {
            let sent = tokio::time::timeout(Duration::from_secs(2), a.send(b_addr, bad_cluster())).await;
            assert!(sent.expect("a send stalled by the flood").unwrap().num_bytes_sent > 0, "round {round}: lost");
            assert_eq!(received(&mut b).await.from_addr, a_addr, "round {round}");
            // Identical envelopes sealed in one millisecond are one datagram to the replay guard.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Received during the flood: each datagram is given up at the codec hop's deadline at
        // the latest, so `recv` keeps reading the real socket.
        for _ in 0..3 {
            b.send(a_addr, bad_cluster()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), a.recv()).await;
        stop.store(true, Ordering::Relaxed);
        assert!(flooder.join().unwrap() > 1_000, "the flood ran");
        tokio::time::sleep(Duration::from_millis(2)).await;
        b.send(a_addr, bad_cluster()).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            // Datagrams sent during the flood may come first, or be given up.
            let got = tokio::time::timeout_at(deadline, a.recv()).await.expect("receiving stalled after the flood");
            if got.unwrap().from_addr == b_addr {
                break;
            }
        }
        assert_eq!(a_stats.datagrams_unauthenticated.load(Ordering::Relaxed), 0, "no junk reached the real socket");
    }

    /// A local process that writes well-formed chitchat envelopes straight to the private
    /// `codec` port, all the while, gets none in: only what came through `tap` (authenticated)
    /// is ever returned, with its own sender.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn envelopes_written_straight_to_the_codec_port_are_never_taken_as_authenticated() {
        let (mut a, _) = socket(W, false).await;
        let (mut b, _) = socket(W, false).await;
        let codec = a.codec.local_addr().unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let injector = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut local = chitchat::transport::UdpSocket::open("127.0.0.1:0".parse().unwrap()).await.unwrap();
                let injected = || ChitchatEnvelope {
                    version: chitchat::ProtocolVersion::V1,
                    message: chitchat::ChitchatMessage::BadCluster,
                };
                while !stop.load(Ordering::Relaxed) {
                    local.send(codec, injected()).await.unwrap();
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            })
        };
        let (a_addr, b_addr) = (a.local_addr().unwrap(), b.local_addr().unwrap());
        let mut genuine = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while genuine < 5 {
            assert!(tokio::time::Instant::now() < deadline, "{genuine} genuine datagrams received");
            b.send(a_addr, bad_cluster()).await.unwrap();
            if let Ok(got) = tokio::time::timeout(Duration::from_millis(500), a.recv()).await {
                let got = got.unwrap();
                assert_eq!(got.envelope, bad_cluster(), "an injected envelope was taken");
                assert_eq!(got.from_addr, b_addr);
                genuine += 1;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        stop.store(true, Ordering::Relaxed);
        injector.await.unwrap();
    }

    #[test]
    fn fuzz_gossip_datagrams() {
        let s = sealer(9);
        let big: Vec<u8> = (0..MAX_DATAGRAM).map(|i| b"gossip"[i % 6]).collect();
        let seeds = vec![
            s.seal(b"a small envelope", stamp(42)).unwrap(),
            s.seal(&big, stamp(43)).unwrap(),
            s.seal(b"unstamped", None).unwrap(),
        ];
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            // As received: only the seeds themselves are authentic.
            if let Ok(opened) = s.open(&bytes) {
                assert!(seeds.contains(&bytes), "a datagram nobody sealed opened");
                assert!(opened.envelope.len() <= MAX_DATAGRAM);
            }
            // As a member could send it (tag valid, body anything): typed errors, bounded output.
            let mut signed = bytes.clone();
            if signed.len() < 1 + TAG_LEN {
                signed.resize(1 + TAG_LEN, 0);
            }
            retag(&s, &mut signed);
            if let Ok(opened) = s.open(&signed) {
                assert!(opened.envelope.len() <= MAX_DATAGRAM, "decompressed past one datagram");
                // And the replay check takes any stamp without panicking.
                if let Some(st) = opened.stamp {
                    let mut g = ReplayGuard::with_capacity(W, 2);
                    let now = u64::from_le_bytes(bytes.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([0; 8]));
                    let first = g.admit(st.sent_ms, opened.tag, now);
                    if first.is_ok() {
                        assert_eq!(g.admit(st.sent_ms, opened.tag, now), Err(Refusal::Replayed));
                    }
                }
            }
        });
    }
}
