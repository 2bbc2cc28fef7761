//! Authenticated, encrypted connections for clusters with a secret: a Noise `NNpsk0` handshake
//! keyed by the cluster secret, then every byte of the frame stream sealed in records.
//!
//! Why Noise with a pre-shared key rather than mutual TLS: membership here is "knows the cluster
//! secret", not "holds a certificate of this node"; a PSK handshake needs no certificates, no CA
//! and no rotation tooling, is two messages, and (with fresh ephemeral keys on both sides) gives
//! forward secrecy and replay protection. mTLS would add a certificate per node to provision and
//! a 100k-line dependency for the same trust model.
//!
//! The exchange on one connection (the dialer writes frames, the acceptor only reads them):
//!
//! 1. dialer → acceptor, one length-delimited frame: Noise message 1 (`psk, e`) whose payload is
//!    the [`Hello`](super::wire::Hello) (who dials, where it listens, which incarnation it wants);
//! 2. acceptor → dialer, one frame: Noise message 2 (`e, ee`) whose payload is the
//!    [`HelloReply`](super::wire::HelloReply), naming the acceptor's incarnation;
//! 3. dialer → acceptor: the first sealed record holds a key-confirmation frame.
//!
//! Both handshakes bind the prologue, which holds the acceptor's messaging address as the dialer
//! dialed it, and both payloads are part of the handshake hash, so the session keys are bound to
//! both unique addresses and both messaging addresses. The acceptor accepts no frame before the
//! confirmation: a replayed message 1 gets a reply but can never produce it (that needs the
//! dialer's ephemeral private key), and is closed at the handshake deadline.
//!
//! After the handshake the byte stream of length-prefixed frames (the same bytes a plain
//! connection carries) is cut into records of at most 65,519 plaintext bytes, each sent as a
//! 2-byte big-endian length and a Noise transport message (ciphertext plus a 16-byte tag).

use bytes::{Buf, BufMut, BytesMut};
use snow::{HandshakeState, TransportState};
use tokio_util::codec::{Decoder, LengthDelimitedCodec};

/// The Noise protocol: no static keys (identity is the shared secret), the PSK mixed in before
/// the first message so even the `Hello` is confidential and authenticated.
const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
const PROLOGUE: &str = "ddshard messaging v2 to ";
/// Largest Noise message and its tag.
const MAX_MESSAGE: usize = 65_535;
const TAG_LEN: usize = 16;
/// Plaintext bytes in a full record.
pub(crate) const MAX_RECORD_PLAINTEXT: usize = MAX_MESSAGE - TAG_LEN;
/// The payload of the key-confirmation frame, the first frame a dialer seals.
pub(crate) const KEY_CONFIRMATION: &[u8] = b"ddshard key confirmation v2";
/// The dialer seals the confirmation frame alone in its first record: its length prefix, the
/// payload and the tag. An acceptor takes no longer first record, so a replayed message 1
/// (which gets a reply but can never confirm) costs it a handshake frame and this, not a
/// 64 KiB record buffer (review finding S13).
const CONFIRMATION_RECORD: usize = 4 + KEY_CONFIRMATION.len() + TAG_LEN;

/// Why a secure handshake or record failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NoiseError {
    #[error("not authenticated by the cluster secret ({0})")]
    Unauthenticated(snow::Error),
    #[error("record of {0} bytes is shorter than its tag")]
    ShortRecord(usize),
    #[error("first record of {0} bytes is not a key confirmation")]
    NotAConfirmation(usize),
}

fn handshake_state(psk: &[u8; 32], acceptor: std::net::SocketAddr, initiator: bool) -> HandshakeState {
    let prologue = format!("{PROLOGUE}{acceptor}").into_bytes();
    let builder = snow::Builder::new(NOISE_PARAMS.parse().expect("the Noise parameters are valid"))
        .psk(0, psk)
        .and_then(|b| b.prologue(&prologue))
        .expect("the Noise builder accepts a 32-byte PSK and a prologue");
    if initiator { builder.build_initiator() } else { builder.build_responder() }
        .expect("a Noise handshake with a PSK and a prologue builds")
}

/// The dialer's handshake toward the node listening at `acceptor`.
pub(crate) fn initiator(psk: &[u8; 32], acceptor: std::net::SocketAddr) -> HandshakeState {
    handshake_state(psk, acceptor, true)
}

/// The acceptor's handshake; `local` is its own messaging address.
pub(crate) fn responder(psk: &[u8; 32], local: std::net::SocketAddr) -> HandshakeState {
    handshake_state(psk, local, false)
}

/// The acceptor's side of message 1 under any of `psks` (a cluster rotating its secret accepts
/// the old and the new one): the handshake of the first key that authenticates it, and its
/// payload. The dialer's key is the one answered with.
pub(crate) fn respond(
    psks: &[[u8; 32]],
    local: std::net::SocketAddr,
    message: &[u8],
) -> Result<(HandshakeState, Vec<u8>), NoiseError> {
    let mut last = None;
    for psk in psks {
        let mut hs = responder(psk, local);
        match read_handshake(&mut hs, message) {
            Ok(payload) => return Ok((hs, payload)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or(NoiseError::Unauthenticated(snow::Error::Decrypt)))
}

/// Writes a handshake message carrying `payload` (at most a few hundred bytes).
pub(crate) fn write_handshake(hs: &mut HandshakeState, payload: &[u8]) -> Result<Vec<u8>, NoiseError> {
    // An ephemeral key (32 bytes), the payload and its tag.
    let mut out = vec![0; (payload.len() + 32 + TAG_LEN).min(MAX_MESSAGE)];
    let n = hs.write_message(payload, &mut out).map_err(NoiseError::Unauthenticated)?;
    out.truncate(n);
    Ok(out)
}

/// Reads a handshake message; its payload, or why it is not authentic.
pub(crate) fn read_handshake(hs: &mut HandshakeState, message: &[u8]) -> Result<Vec<u8>, NoiseError> {
    // The payload is shorter than the message that carries it.
    let mut out = vec![0; message.len()];
    let n = hs.read_message(message, &mut out).map_err(NoiseError::Unauthenticated)?;
    out.truncate(n);
    Ok(out)
}

/// Seals `plain` (any number of bytes) into records appended to `out`.
pub(crate) fn seal(t: &mut TransportState, plain: &[u8], out: &mut BytesMut) -> Result<(), NoiseError> {
    for chunk in plain.chunks(MAX_RECORD_PLAINTEXT) {
        let len = chunk.len() + TAG_LEN;
        let start = out.len();
        out.put_u16(len as u16);
        out.resize(start + 2 + len, 0);
        let written = t.write_message(chunk, &mut out[start + 2..]).map_err(NoiseError::Unauthenticated)?;
        debug_assert_eq!(written, len);
    }
    Ok(())
}

/// Seals one length-prefixed frame holding `body` (for the key confirmation).
pub(crate) fn seal_frame(t: &mut TransportState, body: &[u8], out: &mut BytesMut) -> Result<(), NoiseError> {
    let mut framed = Vec::with_capacity(4 + body.len());
    framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
    framed.extend_from_slice(body);
    seal(t, &framed, out)
}

/// Decodes the frames of a sealed stream: opens records into a plaintext buffer and cuts the
/// length-prefixed frames out of it with the same codec (and frame limit) as a plain
/// connection. Memory stays within one frame limit plus one record; until the first frame
/// (the key confirmation), within one confirmation record.
pub(crate) struct SecureFrameCodec {
    transport: TransportState,
    plain: BytesMut,
    frames: LengthDelimitedCodec,
    /// Opened plaintext of one record; allocated at full size once a frame came through.
    scratch: Box<[u8]>,
    confirmed: bool,
}

impl SecureFrameCodec {
    /// A codec on the acceptor's side: its first record must be a key confirmation.
    pub(crate) fn new(transport: TransportState, frames: LengthDelimitedCodec) -> Self {
        let scratch = vec![0; CONFIRMATION_RECORD].into_boxed_slice();
        SecureFrameCodec { transport, plain: BytesMut::new(), frames, scratch, confirmed: false }
    }

    /// The frame limit of the inner codec.
    pub(crate) fn set_max_frame_length(&mut self, max: usize) {
        self.frames.set_max_frame_length(max);
    }
}

impl Decoder for SecureFrameCodec {
    type Item = BytesMut;
    type Error = std::io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> std::io::Result<Option<BytesMut>> {
        loop {
            if let Some(frame) = self.frames.decode(&mut self.plain)? {
                if !self.confirmed {
                    self.confirmed = true;
                    self.scratch = vec![0; MAX_MESSAGE].into_boxed_slice();
                }
                return Ok(Some(frame));
            }
            if src.len() < 2 {
                return Ok(None);
            }
            let len = u16::from_be_bytes([src[0], src[1]]) as usize;
            if len < TAG_LEN {
                return Err(invalid(NoiseError::ShortRecord(len)));
            }
            if !self.confirmed && len != CONFIRMATION_RECORD {
                return Err(invalid(NoiseError::NotAConfirmation(len)));
            }
            if src.len() < 2 + len {
                src.reserve(2 + len - src.len());
                return Ok(None);
            }
            src.advance(2);
            let record = src.split_to(len);
            let n = self
                .transport
                .read_message(&record, &mut self.scratch)
                .map_err(|e| invalid(NoiseError::Unauthenticated(e)))?;
            self.plain.extend_from_slice(&self.scratch[..n]);
        }
    }
}

fn invalid(e: NoiseError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADDR: &str = "127.0.0.1:4000";

    fn handshake(dialer_psk: [u8; 32], acceptor_psk: [u8; 32]) -> Result<(TransportState, TransportState), NoiseError> {
        let addr = ADDR.parse().unwrap();
        let mut i = initiator(&dialer_psk, addr);
        let mut r = responder(&acceptor_psk, addr);
        let m1 = write_handshake(&mut i, b"hello")?;
        assert_eq!(read_handshake(&mut r, &m1)?, b"hello");
        let m2 = write_handshake(&mut r, b"accept")?;
        assert_eq!(read_handshake(&mut i, &m2)?, b"accept");
        Ok((i.into_transport_mode().unwrap(), r.into_transport_mode().unwrap()))
    }

    #[test]
    fn an_acceptor_rotating_its_secret_completes_handshakes_under_either_key_and_answers_with_the_dialers() {
        let addr = ADDR.parse().unwrap();
        let (old, new, other) = ([1; 32], [2; 32], [3; 32]);
        for dialer_psk in [old, new] {
            let mut i = initiator(&dialer_psk, addr);
            let m1 = write_handshake(&mut i, b"hello").unwrap();
            let (mut r, payload) = respond(&[new, old], addr, &m1).unwrap();
            assert_eq!(payload, b"hello");
            let m2 = write_handshake(&mut r, b"accept").unwrap();
            assert_eq!(read_handshake(&mut i, &m2).unwrap(), b"accept", "answered under the dialer's key");
            let (mut dialer, mut acceptor) = (i.into_transport_mode().unwrap(), r.into_transport_mode().unwrap());
            let mut sealed = BytesMut::new();
            seal(&mut dialer, b"frame", &mut sealed).unwrap();
            let mut out = vec![0; 64];
            let n = acceptor.read_message(&sealed[2..], &mut out).unwrap();
            assert_eq!(&out[..n], b"frame");
        }
        let m1 = write_handshake(&mut initiator(&other, addr), b"hello").unwrap();
        assert!(matches!(respond(&[new, old], addr, &m1), Err(NoiseError::Unauthenticated(_))));
        assert!(matches!(respond(&[], addr, &m1), Err(NoiseError::Unauthenticated(_))), "no key, no handshake");
    }

    fn frames_of(sealed: &[u8], codec: &mut SecureFrameCodec) -> std::io::Result<Vec<Vec<u8>>> {
        let mut src = BytesMut::from(sealed);
        let mut out = Vec::new();
        while let Some(f) = codec.decode(&mut src)? {
            out.push(f.to_vec());
        }
        Ok(out)
    }

    #[test]
    fn frames_larger_than_a_record_cross_the_sealed_stream_intact() {
        let (mut dialer, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let big = vec![9u8; 3 * MAX_RECORD_PLAINTEXT + 5];
        let mut wire = BytesMut::new();
        seal_frame(&mut dialer, KEY_CONFIRMATION, &mut wire).unwrap();
        seal_frame(&mut dialer, &big, &mut wire).unwrap();
        seal_frame(&mut dialer, b"", &mut wire).unwrap();
        assert!(!wire.windows(KEY_CONFIRMATION.len()).any(|w| w == KEY_CONFIRMATION), "plaintext on the wire");
        let mut codec =
            SecureFrameCodec::new(acceptor, LengthDelimitedCodec::builder().max_frame_length(1 << 20).new_codec());
        let frames = frames_of(&wire, &mut codec).unwrap();
        assert_eq!(frames, vec![KEY_CONFIRMATION.to_vec(), big, vec![]]);
    }

    #[test]
    fn bytes_arriving_one_at_a_time_decode_to_the_same_frames() {
        let (mut dialer, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut wire = BytesMut::new();
        seal_frame(&mut dialer, KEY_CONFIRMATION, &mut wire).unwrap();
        seal_frame(&mut dialer, b"one", &mut wire).unwrap();
        seal_frame(&mut dialer, b"two", &mut wire).unwrap();
        let mut codec = SecureFrameCodec::new(acceptor, LengthDelimitedCodec::new());
        let mut src = BytesMut::new();
        let mut got = Vec::new();
        for b in wire.iter() {
            src.put_u8(*b);
            while let Some(f) = codec.decode(&mut src).unwrap() {
                got.push(f.to_vec());
            }
        }
        assert_eq!(got, vec![KEY_CONFIRMATION.to_vec(), b"one".to_vec(), b"two".to_vec()]);
    }

    #[test]
    fn a_different_secret_fails_the_handshake_at_the_first_message() {
        let addr = ADDR.parse().unwrap();
        let mut i = initiator(&[1; 32], addr);
        let mut r = responder(&[2; 32], addr);
        let m1 = write_handshake(&mut i, b"hello").unwrap();
        assert!(matches!(read_handshake(&mut r, &m1), Err(NoiseError::Unauthenticated(_))));
    }

    #[test]
    fn a_dialer_that_dialed_another_address_fails_the_handshake() {
        let mut i = initiator(&[1; 32], "127.0.0.1:4000".parse().unwrap());
        let mut r = responder(&[1; 32], "127.0.0.1:4001".parse().unwrap());
        let m1 = write_handshake(&mut i, b"hello").unwrap();
        assert!(read_handshake(&mut r, &m1).is_err());
    }

    #[test]
    fn a_replayed_first_message_never_yields_a_frame_the_acceptor_accepts() {
        let addr = ADDR.parse().unwrap();
        let mut i = initiator(&[1; 32], addr);
        let m1 = write_handshake(&mut i, b"hello").unwrap();
        // The real session, then a replay of its first message to a fresh responder.
        let mut r1 = responder(&[1; 32], addr);
        read_handshake(&mut r1, &m1).unwrap();
        let m2 = write_handshake(&mut r1, b"accept").unwrap();
        read_handshake(&mut i, &m2).unwrap();
        let mut real = i.into_transport_mode().unwrap();
        let mut replayed = responder(&[1; 32], addr);
        read_handshake(&mut replayed, &m1).unwrap();
        write_handshake(&mut replayed, b"accept").unwrap();
        let replayed = replayed.into_transport_mode().unwrap();
        // The replayer holds only what it saw: the original session's sealed frames do not open
        // under the replayed session's keys (fresh responder ephemeral).
        let mut wire = BytesMut::new();
        seal_frame(&mut real, KEY_CONFIRMATION, &mut wire).unwrap();
        let mut codec = SecureFrameCodec::new(replayed, LengthDelimitedCodec::new());
        assert!(frames_of(&wire, &mut codec).is_err());
    }

    #[test]
    fn a_tampered_or_short_record_is_invalid_data() {
        let (mut dialer, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut wire = BytesMut::new();
        seal_frame(&mut dialer, b"payload", &mut wire).unwrap();
        let mut tampered = wire.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        let mut codec = SecureFrameCodec::new(acceptor, LengthDelimitedCodec::new());
        let e = frames_of(&tampered, &mut codec).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let (_, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut codec = SecureFrameCodec::new(acceptor, LengthDelimitedCodec::new());
        assert!(frames_of(&[0, 3, 1, 2, 3], &mut codec).is_err());
    }

    #[test]
    fn a_sealed_frame_over_the_limit_is_refused_when_its_length_arrives() {
        let (mut dialer, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut wire = BytesMut::new();
        seal_frame(&mut dialer, KEY_CONFIRMATION, &mut wire).unwrap();
        seal_frame(&mut dialer, &vec![0; 5000], &mut wire).unwrap();
        let mut codec =
            SecureFrameCodec::new(acceptor, LengthDelimitedCodec::builder().max_frame_length(4096).new_codec());
        let confirmation_len = 2 + CONFIRMATION_RECORD;
        let mut src = BytesMut::from(&wire[..]);
        assert_eq!(codec.decode(&mut src).unwrap().unwrap()[..], *KEY_CONFIRMATION);
        assert_eq!(src.len(), wire.len() - confirmation_len);
        assert!(codec.decode(&mut src).is_err());
    }

    /// Review finding S13: before the key confirmation, a record of any other length is refused
    /// when its 2-byte length arrives, so a replayed message 1 holds no 64 KiB buffer; only
    /// after the confirmation does the codec open full records.
    #[test]
    fn a_first_record_other_than_the_key_confirmation_is_refused_before_any_large_buffer() {
        let (_, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut codec = SecureFrameCodec::new(acceptor, LengthDelimitedCodec::new());
        assert_eq!(codec.scratch.len(), CONFIRMATION_RECORD);
        let mut src = BytesMut::from(&[0xff, 0xff][..]);
        let e = codec.decode(&mut src).unwrap_err();
        assert!(e.to_string().contains("not a key confirmation"), "{e}");
        assert!(src.capacity() < 1024, "reserved {} bytes for a record never confirmed", src.capacity());
        // A confirmed session opens full records.
        let (mut dialer, acceptor) = handshake([1; 32], [1; 32]).unwrap();
        let mut wire = BytesMut::new();
        seal_frame(&mut dialer, KEY_CONFIRMATION, &mut wire).unwrap();
        seal_frame(&mut dialer, &[3; 60_000], &mut wire).unwrap();
        let mut codec = SecureFrameCodec::new(acceptor, LengthDelimitedCodec::new());
        assert_eq!(frames_of(&wire, &mut codec).unwrap()[1], vec![3; 60_000]);
        assert_eq!(codec.scratch.len(), MAX_MESSAGE);
    }

    #[test]
    fn fuzz_noise_handshake_and_sealed_records() {
        let addr = ADDR.parse().unwrap();
        let psk = [5; 32];
        let mut i = initiator(&psk, addr);
        let m1 = write_handshake(&mut i, b"hello payload").unwrap();
        let (mut dialer, acceptor) = handshake(psk, psk).unwrap();
        let mut records = BytesMut::new();
        seal_frame(&mut dialer, KEY_CONFIRMATION, &mut records).unwrap();
        seal_frame(&mut dialer, &[7; 70_000], &mut records).unwrap();
        let seeds = vec![m1, records.to_vec()];
        // One session, rewound to its first record for every input (a handshake per input
        // would spend the run on key exchanges).
        let codec = std::sync::Mutex::new(SecureFrameCodec::new(
            acceptor,
            LengthDelimitedCodec::builder().max_frame_length(1 << 20).new_codec(),
        ));
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            // An acceptor reading a first message: authentic (a seed) or refused, never a panic.
            let mut r = responder(&psk, addr);
            if read_handshake(&mut r, &bytes).is_ok() {
                assert_eq!(bytes, seeds[0], "a first message nobody wrote was accepted");
            }
            // A reader of sealed records: only the untouched seed opens, in full.
            let mut codec = codec.lock().unwrap_or_else(|e| e.into_inner());
            codec.transport.set_receiving_nonce(0);
            codec.plain.clear();
            codec.confirmed = false;
            // Whatever opens is what the dialer sealed, in order (records open one by one).
            let sealed: [&[u8]; 2] = [KEY_CONFIRMATION, &[7; 70_000]];
            let mut src = BytesMut::from(&bytes[..]);
            let mut frames = 0;
            while let Ok(Some(frame)) = codec.decode(&mut src) {
                assert!(frames < 2 && frame[..] == *sealed[frames], "a frame nobody sealed opened");
                frames += 1;
            }
        });
    }
}
