//! The binary layout of the two messages every remote ask is made of, `Deliver` and `AskReply`
//! (protocol version [`BINARY_ENVELOPES`]): fixed fields and length-prefixed strings, the
//! entity's message or answer (rmp) written straight after them to the end of the body. No
//! field names, no second copy of the payload, and a reader borrows ids and payload from the
//! frame instead of allocating them.
//!
//! A body in this layout starts with [`MARK`], a byte MessagePack never uses, so a region tells
//! it from an rmp-encoded [`super::RegionInbound`] by its first byte and reads both. A node
//! sends it only to a peer whose link was accepted at [`BINARY_ENVELOPES`] or later
//! ([`reads_binary`]); to any other peer (an older node in a rolling update, or one whose link
//! is not up yet) it sends the rmp form.
//!
//! Layout (integers big-endian; `str` is a u16 length and UTF-8 bytes):
//! - `Deliver`: `MARK`, kind 1, flags (bit 0: a reply address follows; no other bit is defined),
//!   epoch u64, shard `str`, entity id `str`, [asker's node id `str`, its generation u64, ask id
//!   u64], then the message (empty: only start the entity).
//! - `AskReply` with an answer: `MARK`, kind 2, ask id u64, then the answer.
//! - `AskReply` with a failure: `MARK`, kind 3, ask id u64, then the [`DeliveryFailure`] (rmp).

use bytes::{BufMut, BytesMut};

use super::DeliveryFailure;
use crate::error::{Error, Result};
use crate::sharding::ids::RegionId;
use crate::transport::{PeerSender, wire};

/// The first protocol version whose nodes read this layout.
pub(crate) const BINARY_ENVELOPES: u32 = 4;

/// The first byte of a body in this layout: `0xC1` is the one byte MessagePack never uses.
pub(crate) const MARK: u8 = 0xC1;

const DELIVER: u8 = 1;
const REPLY: u8 = 2;
const FAILED: u8 = 3;

/// `Deliver` flag: a reply address follows the entity id.
const HAS_REPLY_TO: u8 = 1;

/// Whether the peer behind `sender` reads this layout.
pub(crate) fn reads_binary(sender: &PeerSender) -> bool {
    sender.peer_version().is_some_and(|v| v >= BINARY_ENVELOPES)
}

/// Whether `body` is in this layout (not rmp).
pub(crate) fn is_binary(body: &[u8]) -> bool {
    body.first() == Some(&MARK)
}

/// The fixed part of a `Deliver`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeliverHead<'a> {
    pub shard: &'a str,
    pub entity_id: &'a str,
    pub epoch: u64,
    /// Where the answer goes: the asker's region and its ask id there.
    pub reply_to: Option<ReplyAddress<'a>>,
}

/// An asker's region (node id and generation) and its ask id, as a `Deliver` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplyAddress<'a> {
    pub node_id: &'a str,
    pub generation: u64,
    pub ask_id: u64,
}

impl<'a> ReplyAddress<'a> {
    /// The address of ask `ask_id` of `region`.
    pub(crate) fn of(region: &'a RegionId, ask_id: u64) -> Self {
        ReplyAddress { node_id: &region.node_id, generation: region.generation, ask_id }
    }

    /// The asker's region, sharing `known`'s id when it is the same (the sender's own, as a
    /// rule), so reading an address allocates nothing then.
    pub(crate) fn region(&self, known: &RegionId) -> RegionId {
        if *known.node_id == *self.node_id && known.generation == self.generation {
            known.clone()
        } else {
            RegionId::new(self.node_id, self.generation)
        }
    }
}

/// A body read in this layout, borrowing from it.
#[derive(Debug, PartialEq)]
pub(crate) enum Body<'a> {
    Deliver { head: DeliverHead<'a>, payload: &'a [u8] },
    AskReply { ask_id: u64, result: std::result::Result<&'a [u8], DeliveryFailure> },
}

fn put_str(buf: &mut BytesMut, what: &str, s: &str) -> Result<()> {
    let len = u16::try_from(s.len()).map_err(|_| Error::Codec(format!("{what} of {} bytes is too long", s.len())))?;
    buf.put_u16(len);
    buf.put_slice(s.as_bytes());
    Ok(())
}

/// Appends a `Deliver` with `head`, then whatever `payload` appends (the message, or nothing).
/// On an error `buf` may hold part of it; the caller drops what it appended (the transport's
/// queue does).
pub(crate) fn put_deliver(
    buf: &mut BytesMut,
    head: &DeliverHead<'_>,
    payload: impl FnOnce(&mut BytesMut) -> Result<()>,
) -> Result<()> {
    buf.put_slice(&[MARK, DELIVER, if head.reply_to.is_some() { HAS_REPLY_TO } else { 0 }]);
    buf.put_u64(head.epoch);
    put_str(buf, "shard id", head.shard)?;
    put_str(buf, "entity id", head.entity_id)?;
    if let Some(r) = &head.reply_to {
        put_str(buf, "node id", r.node_id)?;
        buf.put_u64(r.generation);
        buf.put_u64(r.ask_id);
    }
    payload(buf)
}

/// Appends an `AskReply` answering ask `ask_id` with whatever `answer` appends.
pub(crate) fn put_reply(
    buf: &mut BytesMut,
    ask_id: u64,
    answer: impl FnOnce(&mut BytesMut) -> Result<()>,
) -> Result<()> {
    buf.put_slice(&[MARK, REPLY]);
    buf.put_u64(ask_id);
    answer(buf)
}

/// Appends an `AskReply` failing ask `ask_id` with `failure`.
pub(crate) fn put_failure(buf: &mut BytesMut, ask_id: u64, failure: &DeliveryFailure) -> Result<()> {
    buf.put_slice(&[MARK, FAILED]);
    buf.put_u64(ask_id);
    wire::encode_into(buf, failure)
}

/// A reader over a body: every length is checked against what is there.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn short() -> Error {
        Error::Codec("truncated region envelope".into())
    }

    fn u8(&mut self) -> Result<u8> {
        let (&b, rest) = self.0.split_first().ok_or_else(Self::short)?;
        self.0 = rest;
        Ok(b)
    }

    fn u64(&mut self) -> Result<u64> {
        let (n, rest) = self.0.split_first_chunk::<8>().ok_or_else(Self::short)?;
        self.0 = rest;
        Ok(u64::from_be_bytes(*n))
    }

    fn str(&mut self, what: &str) -> Result<&'a str> {
        let (len, rest) = self.0.split_first_chunk::<2>().ok_or_else(Self::short)?;
        let len = usize::from(u16::from_be_bytes(*len));
        if rest.len() < len {
            return Err(Self::short());
        }
        let (s, rest) = rest.split_at(len);
        self.0 = rest;
        std::str::from_utf8(s).map_err(|_| Error::Codec(format!("{what} is not UTF-8")))
    }
}

/// Reads a body in this layout ([`is_binary`]). A short body, an unknown kind or flag, or a
/// string that is not UTF-8 is a codec error.
pub(crate) fn decode(body: &[u8]) -> Result<Body<'_>> {
    let mut r = Reader(body);
    if r.u8()? != MARK {
        return Err(Error::Codec("not a binary region envelope".into()));
    }
    match r.u8()? {
        DELIVER => {
            let flags = r.u8()?;
            if flags & !HAS_REPLY_TO != 0 {
                return Err(Error::Codec(format!("unknown deliver flags {flags:#04x}")));
            }
            let epoch = r.u64()?;
            let shard = r.str("shard id")?;
            let entity_id = r.str("entity id")?;
            let reply_to = if flags & HAS_REPLY_TO != 0 {
                let node_id = r.str("node id")?;
                Some(ReplyAddress { node_id, generation: r.u64()?, ask_id: r.u64()? })
            } else {
                None
            };
            Ok(Body::Deliver { head: DeliverHead { shard, entity_id, epoch, reply_to }, payload: r.0 })
        }
        REPLY => Ok(Body::AskReply { ask_id: r.u64()?, result: Ok(r.0) }),
        FAILED => {
            let ask_id = r.u64()?;
            Ok(Body::AskReply { ask_id, result: Err(wire::decode::<DeliveryFailure>(r.0)?) })
        }
        other => Err(Error::Codec(format!("unknown region envelope kind {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliver(head: &DeliverHead<'_>, payload: &[u8]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        put_deliver(&mut buf, head, |b| {
            b.put_slice(payload);
            Ok(())
        })
        .unwrap();
        buf.to_vec()
    }

    fn reply(ask_id: u64, answer: &[u8]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        put_reply(&mut buf, ask_id, |b| {
            b.put_slice(answer);
            Ok(())
        })
        .unwrap();
        buf.to_vec()
    }

    fn failure(ask_id: u64, f: &DeliveryFailure) -> Vec<u8> {
        let mut buf = BytesMut::new();
        put_failure(&mut buf, ask_id, f).unwrap();
        buf.to_vec()
    }

    fn samples() -> Vec<(Vec<u8>, Body<'static>)> {
        let ask = ReplyAddress { node_id: "node-a", generation: 1 << 40, ask_id: u64::MAX - 3 };
        let with_reply = DeliverHead { shard: "17", entity_id: "cart-9", epoch: 7, reply_to: Some(ask) };
        let tell = DeliverHead { shard: "", entity_id: "é", epoch: 0, reply_to: None };
        let full = DeliveryFailure::MailboxFull { capacity: 10 };
        vec![
            (deliver(&with_reply, &[0x92, 1, 2]), Body::Deliver { head: with_reply, payload: &[0x92, 1, 2] }),
            (deliver(&tell, &[]), Body::Deliver { head: tell, payload: &[] }),
            (reply(9, &[0x2a]), Body::AskReply { ask_id: 9, result: Ok(&[0x2a]) }),
            (reply(0, &[]), Body::AskReply { ask_id: 0, result: Ok(&[]) }),
            (failure(5, &full), Body::AskReply { ask_id: 5, result: Err(full.clone()) }),
        ]
    }

    #[test]
    fn every_envelope_reads_back_as_written_and_is_told_from_an_rmp_body() {
        for (bytes, expected) in samples() {
            assert!(is_binary(&bytes));
            assert_eq!(decode(&bytes).unwrap(), expected);
        }
        let rmp = wire::encode(&super::super::RegionInbound::Region(super::super::RegionToRegion::AskReply {
            ask_id: 1,
            result: Ok(serde_bytes::ByteBuf::new()),
        }))
        .unwrap();
        assert!(!is_binary(&rmp), "an rmp body never starts with the mark");
        assert!(decode(&rmp).is_err());
    }

    #[test]
    fn a_deliver_names_its_fields_in_a_fixed_layout() {
        let head = DeliverHead {
            shard: "3",
            entity_id: "e1",
            epoch: 2,
            reply_to: Some(ReplyAddress { node_id: "n", generation: 4, ask_id: 5 }),
        };
        let mut expected = vec![MARK, DELIVER, HAS_REPLY_TO, 0, 0, 0, 0, 0, 0, 0, 2, 0, 1, b'3', 0, 2, b'e', b'1'];
        expected.extend([0, 1, b'n', 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 5, 0xff]);
        assert_eq!(deliver(&head, &[0xff]), expected);
        assert_eq!(reply(6, &[7]), vec![MARK, REPLY, 0, 0, 0, 0, 0, 0, 0, 6, 7]);
    }

    #[test]
    fn a_truncated_envelope_is_a_codec_error_at_every_length() {
        for (bytes, _) in samples() {
            // Cut anywhere before the payload (whose end is the body's end), reading fails.
            let fixed = match decode(&bytes).unwrap() {
                Body::Deliver { payload, .. } => bytes.len() - payload.len(),
                Body::AskReply { result: Ok(answer), .. } => bytes.len() - answer.len(),
                Body::AskReply { result: Err(_), .. } => bytes.len(),
            };
            for cut in 0..fixed {
                assert!(matches!(decode(&bytes[..cut]), Err(Error::Codec(_))), "{bytes:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn unknown_kinds_flags_and_non_utf8_ids_are_refused() {
        let head = DeliverHead { shard: "1", entity_id: "ab", epoch: 1, reply_to: None };
        let good = deliver(&head, &[]);
        let mut kind = good.clone();
        kind[1] = 9;
        let mut flags = good.clone();
        flags[2] = 0x80;
        let mut utf8 = good.clone();
        let at = good.len() - 2;
        utf8[at] = 0xff;
        for (name, bytes) in [("kind", kind), ("flags", flags), ("utf-8", utf8)] {
            let e = decode(&bytes).unwrap_err();
            assert!(matches!(e, Error::Codec(_)), "{name}: {e:?}");
        }
    }

    #[test]
    fn an_id_too_long_for_its_length_field_is_an_error_not_a_wrapped_length() {
        let long = "x".repeat(usize::from(u16::MAX) + 1);
        let head = DeliverHead { shard: "1", entity_id: &long, epoch: 1, reply_to: None };
        let mut buf = BytesMut::new();
        let e = put_deliver(&mut buf, &head, |_| Ok(())).unwrap_err();
        assert!(matches!(e, Error::Codec(ref m) if m.contains("entity id")), "{e:?}");
    }

    #[test]
    fn a_reply_address_shares_the_known_region_when_it_names_it() {
        let known = RegionId::new("node-a", 3);
        let same = ReplyAddress { node_id: "node-a", generation: 3, ask_id: 1 }.region(&known);
        assert!(std::sync::Arc::ptr_eq(&same.node_id, &known.node_id));
        for other in [
            ReplyAddress { node_id: "node-a", generation: 4, ask_id: 1 },
            ReplyAddress { node_id: "node-b", generation: 3, ask_id: 1 },
        ] {
            let region = other.region(&known);
            assert_eq!((&*region.node_id, region.generation), (other.node_id, other.generation));
        }
    }

    #[test]
    fn fuzz_binary_region_envelopes() {
        let seeds: Vec<Vec<u8>> = samples().into_iter().map(|(b, _)| b).collect();
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            if let Ok(Body::Deliver { head, payload }) = decode(&bytes) {
                // What reads back writes again to the same bytes.
                assert_eq!(deliver(&head, payload), bytes);
            }
        });
    }
}
