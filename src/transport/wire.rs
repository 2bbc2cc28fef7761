//! Wire format: length-delimited frames (4-byte big-endian length) holding rmp-serde values.
//! The first frame each way is the handshake; after it the dialing side sends [`Frame`]s only.

use std::net::SocketAddr;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::membership::UniqueAddress;

/// Bumped on any incompatible change of the frames below.
pub const PROTOCOL_VERSION: u32 = 2;

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

/// Encodes any serde value as rmp (named fields, so added fields stay compatible).
pub fn encode<T: Serialize>(value: &T) -> Result<Bytes> {
    rmp_serde::to_vec_named(value).map(Bytes::from).map_err(|e| Error::Codec(e.to_string()))
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
            let _ = decode::<Hello>(&bytes);
            let _ = decode::<HelloReply>(&bytes);
            let mut codec = tokio_util::codec::LengthDelimitedCodec::builder().max_frame_length(4096).new_codec();
            let mut buf = bytes::BytesMut::from(&bytes[..]);
            while let Ok(Some(frame)) = codec.decode(&mut buf) {
                assert!(frame.len() <= 4096, "a frame over the limit was produced");
                let _ = decode_borrowed::<Frame>(&frame);
            }
        });
    }
}
