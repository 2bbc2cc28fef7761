//! Authenticated gossip datagrams: the UDP socket chitchat gossips through when the cluster has
//! a secret.
//!
//! Each datagram is `format byte ‖ body ‖ tag`, where the body is chitchat's own envelope
//! encoding (zstd-compressed when the tag would push a full-size envelope past the largest UDP
//! payload) and the tag is the first 16 bytes of a BLAKE2s MAC, keyed by a key derived from the
//! cluster secret, over everything before it. A datagram whose tag does not verify is dropped and
//! counted before any of its bytes is parsed, so an outsider can neither join, forge a member's
//! state nor make a node decode anything.
//!
//! Replays: a captured datagram replayed later carries only gossip state the receiver already has
//! or a newer version of; chitchat keeps the highest version per key and node generation and
//! ignores older ones, so a replay changes nothing (at worst it makes the receiver answer a
//! `Syn`, as any member could ask it to).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use blake2::Blake2sMac256;
use blake2::digest::{KeyInit, Mac};
use chitchat::ChitchatEnvelope;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket};
use tracing::debug;

use crate::secret::DerivedKey;

/// Largest UDP payload over IPv4, the most chitchat ever puts in one envelope.
const MAX_DATAGRAM: usize = 65_507;
const TAG_LEN: usize = 16;
const FORMAT_PLAIN: u8 = 1;
const FORMAT_ZSTD: u8 = 2;

/// Counters of the gossip socket, for logs, tests and operators.
#[derive(Debug, Default)]
pub struct GossipStats {
    /// Datagrams dropped because their MAC did not verify (no secret, another secret, forged or
    /// altered).
    pub datagrams_unauthenticated: AtomicU64,
    /// Authenticated datagrams that still did not decode (a bug or a member on another version).
    pub datagrams_malformed: AtomicU64,
    /// Envelopes not sent because, even compressed, they did not fit one datagram with the tag.
    pub datagrams_oversized: AtomicU64,
    /// Down marks this node published in gossip, one per member downed: its split-brain
    /// resolver's decisions (itself included when it is on the losing side) and operators'
    /// downs ([`crate::Node::down`]).
    pub downs_published: AtomicU64,
}

/// Why a received datagram was dropped.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DatagramError {
    #[error("datagram not authenticated by the cluster secret")]
    Unauthenticated,
    #[error("malformed datagram: {0}")]
    Malformed(String),
}

/// Seals and opens datagrams with one key; pure, so the format is tested without sockets.
#[derive(Clone)]
pub(crate) struct DatagramSealer {
    key: DerivedKey,
}

impl DatagramSealer {
    pub(crate) fn new(key: DerivedKey) -> Self {
        DatagramSealer { key }
    }

    fn mac(&self) -> Blake2sMac256 {
        <Blake2sMac256 as KeyInit>::new_from_slice(&self.key).expect("a 32-byte key fits BLAKE2s")
    }

    /// The datagram for `envelope`, or `None` when it cannot fit one datagram even compressed.
    pub(crate) fn seal(&self, envelope: &[u8]) -> Option<Vec<u8>> {
        let (format, body) = if 1 + envelope.len() + TAG_LEN <= MAX_DATAGRAM {
            (FORMAT_PLAIN, std::borrow::Cow::Borrowed(envelope))
        } else {
            let compressed = zstd::bulk::compress(envelope, 1).ok()?;
            if 1 + compressed.len() + TAG_LEN > MAX_DATAGRAM {
                return None;
            }
            (FORMAT_ZSTD, std::borrow::Cow::Owned(compressed))
        };
        let mut out = Vec::with_capacity(1 + body.len() + TAG_LEN);
        out.push(format);
        out.extend_from_slice(&body);
        let mut mac = self.mac();
        mac.update(&out);
        let tag = mac.finalize().into_bytes();
        out.extend_from_slice(&tag[..TAG_LEN]);
        Some(out)
    }

    /// The envelope bytes of an authentic datagram. The tag is checked (in constant time) before
    /// anything else is looked at.
    pub(crate) fn open(&self, datagram: &[u8]) -> Result<Vec<u8>, DatagramError> {
        if datagram.len() < 1 + TAG_LEN {
            return Err(DatagramError::Unauthenticated);
        }
        let (signed, tag) = datagram.split_at(datagram.len() - TAG_LEN);
        let mut mac = self.mac();
        mac.update(signed);
        mac.verify_truncated_left(tag).map_err(|_| DatagramError::Unauthenticated)?;
        let body = &signed[1..];
        match signed[0] {
            FORMAT_PLAIN => Ok(body.to_vec()),
            // Capacity-bounded: a compressed bomb cannot make more than one datagram's worth.
            FORMAT_ZSTD => {
                zstd::bulk::decompress(body, MAX_DATAGRAM).map_err(|e| DatagramError::Malformed(format!("zstd: {e}")))
            }
            other => Err(DatagramError::Malformed(format!("unknown format {other}"))),
        }
    }
}

/// chitchat's socket with every datagram sealed and checked by [`DatagramSealer`].
///
/// chitchat 0.13 keeps its envelope encoding crate-private, so the bytes are obtained through
/// chitchat's own UDP socket on loopback: to send, an envelope goes from a private `codec` socket
/// to a private `tap` socket, whose received bytes are sealed and sent on the real socket; to
/// receive, the opened bytes go from `tap` to `codec`, whose `recv` decodes them. Both private
/// sockets accept bytes only from each other. Gossip is a few datagrams per second, so the two
/// extra loopback hops cost nothing measurable; replace them once chitchat exposes its codec.
pub(crate) struct AuthenticatedSocket {
    real: tokio::net::UdpSocket,
    codec: chitchat::transport::UdpSocket,
    codec_addr: SocketAddr,
    tap: tokio::net::UdpSocket,
    tap_addr: SocketAddr,
    sealer: DatagramSealer,
    stats: Arc<GossipStats>,
    buf: Box<[u8]>,
    /// Sender and size of an opened datagram handed to `codec` whose decoded envelope has not
    /// been returned yet (kept across a cancelled `recv`, so the next one resumes there).
    relayed: Option<(SocketAddr, usize)>,
}

/// A loopback hop normally takes microseconds; past this the datagram is treated as lost.
const LOOPBACK_HOP_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(250);

impl AuthenticatedSocket {
    pub(crate) async fn bind(
        addr: SocketAddr,
        key: DerivedKey,
        stats: Arc<GossipStats>,
    ) -> anyhow::Result<AuthenticatedSocket> {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let codec = chitchat::transport::UdpSocket::open(loopback).await?;
        let tap = tokio::net::UdpSocket::bind(loopback).await?;
        Ok(AuthenticatedSocket {
            real: tokio::net::UdpSocket::bind(addr).await?,
            codec_addr: codec.local_addr()?,
            codec,
            tap_addr: tap.local_addr()?,
            tap,
            sealer: DatagramSealer::new(key),
            stats,
            buf: vec![0; MAX_DATAGRAM + 1].into_boxed_slice(),
            relayed: None,
        })
    }

    /// chitchat's encoding of `envelope`, or `None` if the loopback hop lost it.
    async fn encode(&mut self, envelope: ChitchatEnvelope) -> anyhow::Result<Option<usize>> {
        // Bytes of an earlier send that was cancelled midway are stale: drop them first.
        while self.tap.try_recv_from(&mut self.buf).is_ok() {}
        self.codec.send(self.tap_addr, envelope).await?;
        loop {
            match tokio::time::timeout(LOOPBACK_HOP_TIMEOUT, self.tap.recv_from(&mut self.buf)).await {
                Ok(Ok((n, from))) if from == self.codec_addr => return Ok(Some(n)),
                Ok(Ok(_)) => continue, // not from our codec socket
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
        let Some(datagram) = self.sealer.seal(&self.buf[..n]) else {
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
                let envelope = match self.sealer.open(&self.buf[..n]) {
                    Ok(bytes) => bytes,
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
                if self.tap.send_to(&envelope, self.codec_addr).await.is_err() {
                    continue;
                }
                self.relayed = Some((from_addr, n));
            }
            match tokio::time::timeout(LOOPBACK_HOP_TIMEOUT, self.codec.recv()).await {
                Ok(Ok(decoded)) if decoded.from_addr == self.tap_addr => {
                    let (from_addr, num_bytes_received) = self.relayed.take().expect("a relayed datagram");
                    return Ok(RecvOutcome { from_addr, envelope: decoded.envelope, num_bytes_received });
                }
                Ok(Ok(_)) => continue, // not from our tap socket
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

    fn sealer(byte: u8) -> DatagramSealer {
        DatagramSealer::new([byte; 32])
    }

    #[test]
    fn a_sealed_datagram_opens_to_its_envelope() {
        let s = sealer(7);
        let d = s.seal(b"hello gossip").unwrap();
        assert_eq!(d.len(), 1 + 12 + TAG_LEN);
        assert_eq!(s.open(&d).unwrap(), b"hello gossip");
    }

    #[test]
    fn another_key_or_any_flipped_bit_is_unauthenticated() {
        let d = sealer(7).seal(b"hello gossip").unwrap();
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
    fn a_full_size_envelope_is_compressed_to_fit_beside_its_tag() {
        let s = sealer(1);
        let envelope: Vec<u8> = (0..MAX_DATAGRAM).map(|i| b"node-status-up"[i % 14]).collect();
        let d = s.seal(&envelope).unwrap();
        assert!(d.len() <= MAX_DATAGRAM);
        assert_eq!(d[0], FORMAT_ZSTD);
        assert_eq!(s.open(&d).unwrap(), envelope);
    }

    #[test]
    fn an_incompressible_full_size_envelope_is_refused_not_truncated() {
        let envelope: Vec<u8> = (0..MAX_DATAGRAM).map(|_| rand::random::<u8>()).collect();
        assert!(sealer(1).seal(&envelope).is_none());
        let just_fits = &envelope[..MAX_DATAGRAM - 1 - TAG_LEN];
        assert_eq!(sealer(1).seal(just_fits).unwrap()[0], FORMAT_PLAIN);
    }

    #[test]
    fn an_authentic_but_unknown_format_or_bad_zstd_is_malformed() {
        let s = sealer(3);
        let mut d = s.seal(b"x").unwrap();
        d[0] = 9;
        let tag_at = d.len() - TAG_LEN;
        let mut mac = s.mac();
        mac.update(&d[..tag_at]);
        let tag = mac.finalize().into_bytes();
        d[tag_at..].copy_from_slice(&tag[..TAG_LEN]);
        assert!(matches!(s.open(&d), Err(DatagramError::Malformed(_))));
        d[0] = FORMAT_ZSTD;
        let mut mac = s.mac();
        mac.update(&d[..tag_at]);
        let tag = mac.finalize().into_bytes();
        d[tag_at..].copy_from_slice(&tag[..TAG_LEN]);
        assert!(matches!(s.open(&d), Err(DatagramError::Malformed(_))));
    }

    #[test]
    fn fuzz_gossip_datagrams() {
        let s = sealer(9);
        let big: Vec<u8> = (0..MAX_DATAGRAM).map(|i| b"gossip"[i % 6]).collect();
        let seeds = vec![s.seal(b"a small envelope").unwrap(), s.seal(&big).unwrap()];
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            // As received: only the seeds themselves are authentic.
            if let Ok(envelope) = s.open(&bytes) {
                assert!(seeds.contains(&bytes), "a datagram nobody sealed opened");
                assert!(envelope.len() <= MAX_DATAGRAM);
            }
            // As a member could send it (tag valid, body anything): typed errors, bounded output.
            let mut signed = bytes.clone();
            if signed.len() < 1 + TAG_LEN {
                signed.resize(1 + TAG_LEN, 0);
            }
            let tag_at = signed.len() - TAG_LEN;
            let mut mac = s.mac();
            mac.update(&signed[..tag_at]);
            let tag = mac.finalize().into_bytes();
            signed[tag_at..].copy_from_slice(&tag[..TAG_LEN]);
            if let Ok(envelope) = s.open(&signed) {
                assert!(envelope.len() <= MAX_DATAGRAM, "decompressed past one datagram");
            }
        });
    }
}
