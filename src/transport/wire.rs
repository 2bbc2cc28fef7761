//! Public with the `testkit` feature only, for protocol tests; no stability promise.
//!
//! Wire format: length-delimited frames (4-byte big-endian length). The first frame each way is
//! the handshake (rmp-serde values); after it the dialing side sends [`Frame`]s only, in the
//! compact binary layout of [`Frame::encode`] since protocol version 3 (as rmp-serde values with
//! named fields in version 2, which a node still speaks to and hears from older peers).
//! Version 4 frames are version 3's; the version tells services that the peer reads the
//! binary layouts of their own bodies that came with it (the sharding's region envelopes), which
//! a service sends only to a peer whose link was accepted at that version
//! ([`crate::transport::PeerSender::peer_version`]).

use std::net::SocketAddr;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::membership::UniqueAddress;

/// Bumped on any incompatible change of the frames below.
pub const PROTOCOL_VERSION: u32 = 4;

/// The oldest version this node still speaks: an acceptor hears dialers of any version from
/// here to [`PROTOCOL_VERSION`], and a dialer refused by an older acceptor dials again at the
/// acceptor's version, so a rolling upgrade never splits the cluster.
pub const MIN_PROTOCOL_VERSION: u32 = 2;

/// The first version whose frames use the binary layout of [`Frame::encode`].
pub(crate) const BINARY_FRAMES: u32 = 3;

/// First frame of a connection, from the dialing node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// Must equal [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Must equal the listener's cluster id.
    pub cluster_id: String,
    /// Who is dialing.
    pub from: UniqueAddress,
    /// Where the dialing node listens (replies go there).
    pub from_messaging_addr: SocketAddr,
    /// The incarnation the dialer wants to reach; a restarted listener refuses old addressees.
    pub to: UniqueAddress,
}

/// The listener's answer to [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum HelloReply {
    /// Accepted; frames may follow. Names the listener's incarnation, which the dialer checks
    /// against the one it meant to reach.
    Accept {
        /// The listener's incarnation.
        address: UniqueAddress,
    },
    /// Refused; the connection closes.
    Reject(RejectReason),
}

/// Why a handshake was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RejectReason {
    /// Another protocol version.
    #[error("protocol version {theirs} is not {ours}")]
    ProtocolVersion {
        /// Dialer's version.
        theirs: u32,
        /// Listener's version.
        ours: u32,
    },
    /// Another cluster.
    #[error("foreign cluster id {0:?}")]
    ForeignCluster(String),
    /// The dialer wanted another node or an older incarnation of this one.
    #[error("addressed to {0}, which is not this node incarnation")]
    WrongAddressee(UniqueAddress),
    /// The dialer is not (or no longer) a member of the listener's cluster.
    #[error("not a member: {0}")]
    NotAMember(String),
    /// The handshake was not keyed by this cluster's secret (another secret, or none).
    #[error("handshake not authenticated by this cluster's secret")]
    Unauthenticated,
}

/// A message after the handshake. Borrowed from the frame buffer when decoded, so bodies are
/// handed on without copying.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Frame<'a> {
    /// One-way message to a topic.
    Message {
        /// Receiving service.
        #[serde(borrow)]
        topic: &'a str,
        /// Service-specific payload.
        #[serde(with = "serde_bytes", borrow)]
        body: &'a [u8],
    },
    /// Request that expects a [`Frame::Response`] with the same id.
    Request {
        /// Correlation id.
        id: u64,
        /// Receiving service.
        #[serde(borrow)]
        topic: &'a str,
        /// Service-specific payload.
        #[serde(with = "serde_bytes", borrow)]
        body: &'a [u8],
    },
    /// Answer to a request.
    Response {
        /// Correlation id of the request.
        id: u64,
        /// Payload, or why the request could not be served.
        #[serde(borrow)]
        body: ResponseBody<'a>,
    },
}

/// Body of a [`Frame::Response`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ResponseBody<'a> {
    /// The service's answer.
    Ok(#[serde(with = "serde_bytes", borrow)] &'a [u8]),
    /// Why the request could not be served.
    Err(String),
}

/// Frame kinds of the binary layout.
const KIND_MESSAGE: u8 = 0;
const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE_OK: u8 = 2;
const KIND_RESPONSE_ERR: u8 = 3;

/// Longest topic a frame can carry.
pub const MAX_TOPIC_LEN: usize = u16::MAX as usize;

/// The fixed part of a binary frame: its kind, the correlation id where it has one, and the
/// topic where it has one; the body follows it to the end of the frame.
pub(crate) enum Header<'a> {
    Message { topic: &'a str },
    Request { id: u64, topic: &'a str },
    ResponseOk { id: u64 },
    ResponseErr { id: u64 },
}

impl Header<'_> {
    /// Appends the header; the caller appends the body after it.
    pub(crate) fn put(&self, buf: &mut bytes::BytesMut) -> Result<()> {
        use bytes::BufMut;
        let topic = |buf: &mut bytes::BytesMut, topic: &str| {
            let len = u16::try_from(topic.len())
                .map_err(|_| Error::Codec(format!("topic of {} bytes exceeds {MAX_TOPIC_LEN}", topic.len())))?;
            buf.put_u16(len);
            buf.put_slice(topic.as_bytes());
            Ok(())
        };
        match *self {
            Header::Message { topic: t } => {
                buf.put_u8(KIND_MESSAGE);
                topic(buf, t)
            }
            Header::Request { id, topic: t } => {
                buf.put_u8(KIND_REQUEST);
                buf.put_u64(id);
                topic(buf, t)
            }
            Header::ResponseOk { id } => {
                buf.put_u8(KIND_RESPONSE_OK);
                buf.put_u64(id);
                Ok(())
            }
            Header::ResponseErr { id } => {
                buf.put_u8(KIND_RESPONSE_ERR);
                buf.put_u64(id);
                Ok(())
            }
        }
    }
}

impl<'a> Frame<'a> {
    #[cfg(any(test, feature = "testkit"))]
    /// The frame in the binary layout of protocol version 3: a kind byte (0 message, 1 request,
    /// 2 response, 3 refused request), the correlation id (u64, big-endian) for kinds 1–3, the
    /// topic (u16 big-endian length, UTF-8) for kinds 0–1, then the body to the end of the
    /// frame (for kind 3 the UTF-8 reason). No field names, no second encoding of the body.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut buf = bytes::BytesMut::new();
        self.put(&mut buf)?;
        Ok(buf.to_vec())
    }

    #[cfg(any(test, feature = "testkit"))]
    /// Appends [`Frame::encode`]'s bytes to `buf`.
    pub(crate) fn put(&self, buf: &mut bytes::BytesMut) -> Result<()> {
        let (header, body): (Header<'_>, &[u8]) = match self {
            Frame::Message { topic, body } => (Header::Message { topic }, body),
            Frame::Request { id, topic, body } => (Header::Request { id: *id, topic }, body),
            Frame::Response { id, body: ResponseBody::Ok(b) } => (Header::ResponseOk { id: *id }, b),
            Frame::Response { id, body: ResponseBody::Err(e) } => (Header::ResponseErr { id: *id }, e.as_bytes()),
        };
        header.put(buf)?;
        buf.extend_from_slice(body);
        Ok(())
    }

    /// Reads a frame in the binary layout, borrowing topic and body from `bytes`. Every length
    /// is checked against what is there; a short, unknown or non-UTF-8 frame is a codec error.
    pub fn decode(bytes: &'a [u8]) -> Result<Frame<'a>> {
        let short = || Error::Codec("truncated frame".into());
        let (&kind, rest) = bytes.split_first().ok_or_else(short)?;
        let id = |rest: &'a [u8]| -> Result<(u64, &'a [u8])> {
            let (id, rest) = rest.split_first_chunk::<8>().ok_or_else(short)?;
            Ok((u64::from_be_bytes(*id), rest))
        };
        let topic = |rest: &'a [u8]| -> Result<(&'a str, &'a [u8])> {
            let (len, rest) = rest.split_first_chunk::<2>().ok_or_else(short)?;
            let len = usize::from(u16::from_be_bytes(*len));
            if rest.len() < len {
                return Err(short());
            }
            let (topic, body) = rest.split_at(len);
            let topic = std::str::from_utf8(topic).map_err(|_| Error::Codec("topic is not UTF-8".into()))?;
            Ok((topic, body))
        };
        match kind {
            KIND_MESSAGE => {
                let (topic, body) = topic(rest)?;
                Ok(Frame::Message { topic, body })
            }
            KIND_REQUEST => {
                let (id, rest) = id(rest)?;
                let (topic, body) = topic(rest)?;
                Ok(Frame::Request { id, topic, body })
            }
            KIND_RESPONSE_OK => {
                let (id, body) = id(rest)?;
                Ok(Frame::Response { id, body: ResponseBody::Ok(body) })
            }
            KIND_RESPONSE_ERR => {
                let (id, reason) = id(rest)?;
                let reason = std::str::from_utf8(reason).map_err(|_| Error::Codec("reason is not UTF-8".into()))?;
                let reason = reason.to_string();
                Ok(Frame::Response { id, body: ResponseBody::Err(reason) })
            }
            other => Err(Error::Codec(format!("unknown frame kind {other}"))),
        }
    }

    /// Reads a frame of a connection at protocol `version`.
    pub(crate) fn decode_at(version: u32, bytes: &'a [u8]) -> Result<Frame<'a>> {
        if version >= BINARY_FRAMES { Frame::decode(bytes) } else { decode_borrowed(bytes) }
    }
}

/// Rewrites a buffer of length-prefixed binary frames as the same frames in the rmp layout of
/// protocol version 2, for a link to a peer that has not been upgraded yet. A frame that grows
/// past `max_frame` in the older layout (it is a few dozen bytes longer) is left out rather than
/// sent to a peer that would close the link over it; returns how many were left out.
pub(crate) fn binary_frames_to_v2(chunk: &[u8], out: &mut bytes::BytesMut, max_frame: usize) -> Result<usize> {
    use bytes::BufMut;
    let mut rest = chunk;
    let mut left_out = 0;
    while !rest.is_empty() {
        let (len, tail) = rest.split_first_chunk::<4>().ok_or_else(|| Error::Codec("truncated frame".into()))?;
        let len = u32::from_be_bytes(*len) as usize;
        if tail.len() < len {
            return Err(Error::Codec("truncated frame".into()));
        }
        let (frame, tail) = tail.split_at(len);
        let start = out.len();
        out.put_u32(0);
        rmp_serde::encode::write_named(&mut (&mut *out).writer(), &Frame::decode(frame)?)
            .map_err(|e| Error::Codec(e.to_string()))?;
        let n = out.len() - start - 4;
        match u32::try_from(n) {
            Ok(n32) if n <= max_frame => out[start..start + 4].copy_from_slice(&n32.to_be_bytes()),
            _ => {
                out.truncate(start);
                left_out += 1;
            }
        }
        rest = tail;
    }
    Ok(left_out)
}

/// Encodes any serde value as rmp (named fields, so added fields stay compatible).
pub fn encode<T: Serialize>(value: &T) -> Result<Bytes> {
    rmp_serde::to_vec_named(value).map(Bytes::from).map_err(|e| Error::Codec(e.to_string()))
}

/// Appends `value` as rmp (named fields, as [`encode`]) to `buf`: a body written straight into
/// a peer's queue ([`crate::transport::PeerSender::send_with`]).
pub fn encode_into<T: Serialize>(buf: &mut bytes::BytesMut, value: &T) -> Result<()> {
    use bytes::BufMut;
    rmp_serde::encode::write_named(&mut buf.writer(), value).map_err(|e| Error::Codec(e.to_string()))
}

/// Decodes an rmp value.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Codec(e.to_string()))
}

/// Decodes a value that borrows from `bytes` (such as [`Frame`]).
pub fn decode_borrowed<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Codec(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuzz_frame_and_handshake_decoders() {
        use tokio_util::codec::Decoder;
        let to = UniqueAddress::new("n2", 7);
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_id: "c".into(),
            from: UniqueAddress::new("n1", 3),
            from_messaging_addr: "127.0.0.1:4000".parse().unwrap(),
            to: to.clone(),
        };
        let mut seeds = vec![
            Frame::Message { topic: "region/kv", body: b"payload" }.encode().unwrap(),
            Frame::Request { id: 9, topic: "replicator", body: &[0x92, 1, 2] }.encode().unwrap(),
            Frame::Response { id: 9, body: ResponseBody::Ok(b"ok") }.encode().unwrap(),
            Frame::Response { id: u64::MAX, body: ResponseBody::Err("no".into()) }.encode().unwrap(),
            encode(&Frame::Message { topic: "region/kv", body: b"payload" }).unwrap().to_vec(),
            encode(&Frame::Request { id: 9, topic: "replicator", body: &[0x92, 1, 2] }).unwrap().to_vec(),
            encode(&Frame::Response { id: 9, body: ResponseBody::Ok(b"ok") }).unwrap().to_vec(),
            encode(&Frame::Response { id: u64::MAX, body: ResponseBody::Err("no".into()) }).unwrap().to_vec(),
            encode(&hello).unwrap().to_vec(),
            encode(&HelloReply::Accept { address: to.clone() }).unwrap().to_vec(),
            encode(&HelloReply::Reject(RejectReason::WrongAddressee(to))).unwrap().to_vec(),
            encode(&HelloReply::Reject(RejectReason::NotAMember("x".into()))).unwrap().to_vec(),
        ];
        // Length-prefixed, as they arrive on a socket.
        let framed: Vec<Vec<u8>> = seeds.iter().map(|s| [&(s.len() as u32).to_be_bytes()[..], s].concat()).collect();
        seeds.extend(framed);
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            let _ = decode_borrowed::<Frame>(&bytes);
            if let Ok(f) = Frame::decode(&bytes) {
                // Whatever decodes encodes back to the same bytes (the layout has one spelling).
                assert_eq!(f.encode().unwrap(), bytes, "binary frame round trip");
            }
            let _ = decode::<Hello>(&bytes);
            let _ = decode::<HelloReply>(&bytes);
            let mut codec = tokio_util::codec::LengthDelimitedCodec::builder().max_frame_length(4096).new_codec();
            let mut buf = bytes::BytesMut::from(&bytes[..]);
            while let Ok(Some(frame)) = codec.decode(&mut buf) {
                assert!(frame.len() <= 4096, "a frame over the limit was produced");
                let _ = decode_borrowed::<Frame>(&frame);
                let _ = Frame::decode(&frame);
            }
        });
    }

    fn frames() -> Vec<Frame<'static>> {
        vec![
            Frame::Message { topic: "region/kv", body: b"payload" },
            Frame::Message { topic: "", body: b"" },
            Frame::Request { id: 9, topic: "replicator", body: &[0x92, 1, 2] },
            Frame::Response { id: u64::MAX, body: ResponseBody::Ok(b"ok") },
            Frame::Response { id: 0, body: ResponseBody::Err("no service".into()) },
        ]
    }

    fn same(a: &Frame<'_>, b: &Frame<'_>) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn every_binary_frame_kind_decodes_to_what_was_encoded() {
        for f in frames() {
            let bytes = f.encode().unwrap();
            assert!(same(&Frame::decode(&bytes).unwrap(), &f), "{f:?}");
        }
    }

    #[test]
    fn a_connection_reads_frames_in_the_layout_of_its_dialers_version() {
        let f = Frame::Request { id: 3, topic: "replicator", body: b"body" };
        let (binary, named) = (f.encode().unwrap(), encode(&f).unwrap());
        for version in [BINARY_FRAMES, PROTOCOL_VERSION] {
            assert!(same(&Frame::decode_at(version, &binary).unwrap(), &f), "version {version}");
            assert!(Frame::decode_at(version, &named).is_err(), "an rmp frame is not read at version {version}");
        }
        assert!(same(&Frame::decode_at(MIN_PROTOCOL_VERSION, &named).unwrap(), &f));
        assert!(Frame::decode_at(MIN_PROTOCOL_VERSION, &binary).is_err(), "a binary frame is not read at version 2");
    }

    #[test]
    fn a_value_encoded_into_a_buffer_is_appended_as_encode_writes_it() {
        let value = Hello {
            protocol_version: PROTOCOL_VERSION,
            cluster_id: "c".into(),
            from: UniqueAddress::new("n1", 3),
            from_messaging_addr: "127.0.0.1:4000".parse().unwrap(),
            to: UniqueAddress::new("n2", 7),
        };
        let mut buf = bytes::BytesMut::from(&b"head"[..]);
        encode_into(&mut buf, &value).unwrap();
        assert_eq!(&buf[..4], b"head", "appended, not overwritten");
        assert_eq!(&buf[4..], &encode(&value).unwrap()[..]);
    }

    #[test]
    fn a_binary_message_costs_three_bytes_plus_its_topic_and_body() {
        let bytes = Frame::Message { topic: "region/kv", body: &[7; 100] }.encode().unwrap();
        assert_eq!(bytes.len(), 1 + 2 + 9 + 100);
        let bytes = Frame::Request { id: 1, topic: "t", body: &[7; 10] }.encode().unwrap();
        assert_eq!(bytes.len(), 1 + 8 + 2 + 1 + 10);
        assert_eq!(&bytes[..12], &[1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, b't']);
    }

    #[test]
    fn truncated_unknown_or_non_utf8_binary_frames_are_codec_errors() {
        let good = Frame::Request { id: 5, topic: "topic", body: b"body" }.encode().unwrap();
        // Cut anywhere inside the header: never a frame, never a panic.
        for cut in 0..(1 + 8 + 2 + 5) {
            assert!(Frame::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Frame::decode(&[9, 0, 0]).is_err(), "unknown kind");
        assert!(Frame::decode(&[0, 0, 2, 0xff, 0xfe]).is_err(), "topic not UTF-8");
        assert!(Frame::decode(&[0, 0xff, 0xff, b'a']).is_err(), "topic longer than the frame");
        let long = "t".repeat(MAX_TOPIC_LEN + 1);
        assert!(Frame::Message { topic: &long, body: b"" }.encode().is_err(), "topic too long to encode");
    }

    #[test]
    fn binary_frames_rewritten_for_a_version_2_peer_decode_there_as_the_same_frames() {
        let mut chunk = bytes::BytesMut::new();
        for f in frames() {
            let start = chunk.len();
            chunk.extend_from_slice(&[0; 4]);
            f.put(&mut chunk).unwrap();
            let n = (chunk.len() - start - 4) as u32;
            chunk[start..start + 4].copy_from_slice(&n.to_be_bytes());
        }
        let mut old = bytes::BytesMut::new();
        assert_eq!(binary_frames_to_v2(&chunk, &mut old, 1 << 20).unwrap(), 0);
        let mut codec = tokio_util::codec::LengthDelimitedCodec::new();
        for f in frames() {
            use tokio_util::codec::Decoder;
            let frame = codec.decode(&mut old).unwrap().expect("one frame per frame");
            assert!(same(&decode_borrowed::<Frame>(&frame).unwrap(), &f), "{f:?}");
        }
        assert!(old.is_empty());
        assert!(binary_frames_to_v2(&chunk[..chunk.len() - 1], &mut bytes::BytesMut::new(), 1 << 20).is_err());
    }

    #[test]
    fn a_frame_that_outgrows_the_limit_in_the_version_2_layout_is_left_out_alone() {
        let max = 100;
        let mut chunk = bytes::BytesMut::new();
        for body in [&[1u8; 10][..], &[2u8; 90][..], &[3u8; 10][..]] {
            let f = Frame::Message { topic: "t", body };
            let start = chunk.len();
            chunk.extend_from_slice(&[0; 4]);
            f.put(&mut chunk).unwrap();
            let n = (chunk.len() - start - 4) as u32;
            assert!(n as usize <= max, "every binary frame fits the limit");
            chunk[start..start + 4].copy_from_slice(&n.to_be_bytes());
        }
        let mut old = bytes::BytesMut::new();
        assert_eq!(binary_frames_to_v2(&chunk, &mut old, max).unwrap(), 1, "the 90-byte body no longer fits");
        let mut codec = tokio_util::codec::LengthDelimitedCodec::new();
        use tokio_util::codec::Decoder;
        for first in [1u8, 3] {
            let frame = codec.decode(&mut old).unwrap().unwrap();
            assert!(frame.len() <= max);
            match decode_borrowed::<Frame>(&frame).unwrap() {
                Frame::Message { body, .. } => assert_eq!(body[0], first),
                other => panic!("{other:?}"),
            }
        }
        assert!(old.is_empty(), "nothing else written");
        // A frame exactly at the limit in the older layout is kept.
        let at_limit = encode(&Frame::Message { topic: "t", body: &[2u8; 90] }).unwrap().len();
        let mut old = bytes::BytesMut::new();
        assert_eq!(binary_frames_to_v2(&chunk, &mut old, at_limit).unwrap(), 0, "{at_limit} bytes fit {at_limit}");
        assert_eq!(binary_frames_to_v2(&chunk, &mut bytes::BytesMut::new(), at_limit - 1).unwrap(), 1);
    }
}
