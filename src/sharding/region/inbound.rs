//! What reaches a region's topic from other nodes, classified once: [`classify`] decodes a
//! body and checks a `Deliver` (entity id within the type's limit, shard as this node's
//! extractor gives it, payload decodes) in one place, for the fast path on the reading task and
//! for the region task alike. The fast path hands its verdict on with the message
//! ([`PassedOn`], riding on [`Inbound::hold`](crate::transport::Inbound::hold)), so a message it
//! passes on is decoded once.

use std::borrow::Cow;

use serde::de::DeserializeOwned;

use crate::error::Error;
use crate::sharding::Entity;
use crate::sharding::delivery::DeliveryHeader;
use crate::sharding::envelope::{DeliveryReply, Envelope, OutcomeTo, ReplyTo, not_delivered};
use crate::sharding::ids::{RegionId, ShardId, ShardNames, check_entity_id};
use crate::sharding::protocol::binary::{self, Body};
use crate::sharding::protocol::{DeliveryFailure, RegionInbound, RegionToRegion, ToRegion};
use crate::transport::{PeerAddr, PeerSender, wire};

/// A region-topic message (not a query), decoded and checked; ids and answers borrow from the
/// body where its layout allows ([`binary`]).
#[derive(Debug)]
pub(crate) enum Classified<'a, M> {
    /// From the coordinator.
    Coordinator(ToRegion),
    /// A message for an entity that passed every check; `msg` is `None` for a start without a
    /// message; `delivery` is set for a reliable delivery (whose answer is its outcome).
    Deliver {
        shard: Cow<'a, str>,
        entity_id: Cow<'a, str>,
        msg: Option<M>,
        reply_to: Option<(RegionId, u64)>,
        epoch: u64,
        delivery: Option<DeliveryHeader>,
    },
    /// A message for an entity refused: the error its asker (if any) gets.
    Refused { entity_id: String, reply_to: Option<(RegionId, u64)>, error: Error },
    /// The answer to an ask this node sent.
    AskReply { ask_id: u64, result: Result<Cow<'a, [u8]>, DeliveryFailure> },
    /// The body did not decode.
    Malformed(Error),
}

impl<M> Classified<'_, M> {
    /// The same message owning what it borrowed (to outlive the body).
    pub(crate) fn into_owned(self) -> Classified<'static, M> {
        match self {
            Classified::Coordinator(m) => Classified::Coordinator(m),
            Classified::Deliver { shard, entity_id, msg, reply_to, epoch, delivery } => Classified::Deliver {
                shard: Cow::Owned(shard.into_owned()),
                entity_id: Cow::Owned(entity_id.into_owned()),
                msg,
                reply_to,
                epoch,
                delivery,
            },
            Classified::Refused { entity_id, reply_to, error } => Classified::Refused { entity_id, reply_to, error },
            Classified::AskReply { ask_id, result } => {
                Classified::AskReply { ask_id, result: result.map(|b| Cow::Owned(b.into_owned())) }
            }
            Classified::Malformed(e) => Classified::Malformed(e),
        }
    }
}

/// Classifies `body`, sent by `from`, for a type whose ids are at most `max_entity_id_bytes`
/// and whose shards `shard_names` names: either layout ([`binary::is_binary`]), one set of
/// checks. The extractor only ever sees an id within the limit.
pub(crate) fn classify<'a, M: DeserializeOwned>(
    body: &'a [u8],
    from: &RegionId,
    max_entity_id_bytes: usize,
    shard_names: &ShardNames,
) -> Classified<'a, M> {
    if binary::is_binary(body) {
        return match binary::decode(body) {
            Err(e) => Classified::Malformed(e),
            Ok(Body::AskReply { ask_id, result }) => Classified::AskReply { ask_id, result: result.map(Cow::Borrowed) },
            Ok(Body::Deliver { head, payload }) => {
                let reply_to = head.reply_to.map(|r| (r.region(from), r.ask_id));
                let deliver = Unchecked {
                    shard: head.shard.into(),
                    entity_id: head.entity_id.into(),
                    payload,
                    reply_to,
                    epoch: head.epoch,
                    delivery: None,
                };
                deliver.check(max_entity_id_bytes, shard_names)
            }
        };
    }
    let (shard, entity_id, payload, reply_to, epoch, delivery) = match wire::decode::<RegionInbound>(body) {
        Err(e) => return Classified::Malformed(e),
        Ok(RegionInbound::Coordinator(msg)) => return Classified::Coordinator(msg),
        Ok(RegionInbound::Region(RegionToRegion::AskReply { ask_id, result })) => {
            return Classified::AskReply { ask_id, result: result.map(|b| Cow::Owned(b.into_vec())) };
        }
        Ok(RegionInbound::Region(RegionToRegion::Deliver { shard, entity_id, payload, reply_to, epoch })) => {
            (shard, entity_id, payload, reply_to, epoch, None)
        }
        Ok(RegionInbound::Region(RegionToRegion::DeliverReliably {
            shard,
            entity_id,
            payload,
            reply_to,
            epoch,
            header,
        })) => (shard, entity_id, payload, Some(reply_to), epoch, Some(header)),
    };
    let deliver =
        Unchecked { shard: shard.into(), entity_id: entity_id.into(), payload: &payload, reply_to, epoch, delivery };
    deliver.check(max_entity_id_bytes, shard_names).into_owned()
}

/// A `Deliver` as read, before its checks.
struct Unchecked<'a, 'p> {
    shard: Cow<'a, str>,
    entity_id: Cow<'a, str>,
    payload: &'p [u8],
    reply_to: Option<(RegionId, u64)>,
    epoch: u64,
    delivery: Option<DeliveryHeader>,
}

impl<'a> Unchecked<'a, '_> {
    /// The checks every `Deliver` passes, whatever its layout.
    fn check<M: DeserializeOwned>(self, max_entity_id_bytes: usize, shard_names: &ShardNames) -> Classified<'a, M> {
        let Unchecked { shard, entity_id, payload, reply_to, epoch, delivery } = self;
        let refused =
            |error: Error| Classified::Refused { entity_id: entity_id.to_string(), reply_to: reply_to.clone(), error };
        if delivery.is_some() && payload.is_empty() {
            return refused(not_delivered(&entity_id, "a reliable delivery without a message"));
        }
        if let Err(error) = check_entity_id(&entity_id, max_entity_id_bytes) {
            return refused(error);
        }
        let msg = if payload.is_empty() {
            None
        } else {
            match wire::decode::<M>(payload) {
                Ok(msg) => Some(msg),
                Err(e) => return refused(not_delivered(&entity_id, format!("payload does not decode: {e}"))),
            }
        };
        let own = shard_names.of(&entity_id);
        if own != shard {
            let why = format!("sent for shard {shard:?}, but this node's extractor gives {own:?}");
            return refused(not_delivered(&entity_id, why));
        }
        Classified::Deliver { shard, entity_id, msg, reply_to, epoch, delivery }
    }
}

/// Where the answer to a remote asker goes: its region, its ask id there, and (when the asker's
/// region is on the node `from` that sent the message) the `link` to that node; for a reliable
/// delivery (`delivery`), its outcome goes there.
pub(crate) fn remote_reply<E: Entity>(
    reply_to: Option<(RegionId, u64)>,
    delivery: Option<DeliveryHeader>,
    from: &PeerAddr,
    link: impl FnOnce() -> PeerSender,
) -> Option<ReplyTo<E>> {
    reply_to.map(|(region, ask_id)| {
        let via = (region == from.address).then(link);
        match delivery {
            Some(header) => {
                ReplyTo::Delivery(Box::new(DeliveryReply { header, to: OutcomeTo::Remote { region, ask_id, via } }))
            }
            None => ReplyTo::Remote { region, ask_id, via },
        }
    })
}

/// What the fast path hands on to the region task with a message it did not take.
pub(crate) enum PassedOn<E: Entity> {
    /// Classified, nothing done yet: the region task decides.
    Classified(Classified<'static, E::Message>),
    /// A valid `Deliver` the fast path could not put into a running entity's mailbox: its
    /// envelope, counted on its stripe's routed path until the region task is done with it.
    Routed { shard: ShardId, entity_id: String, epoch: u64, env: Envelope<E> },
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sharding::ids::{ShardIdExtractor, default_shard_id};

    fn names() -> ShardNames {
        ShardNames::new(None, 10)
    }

    fn sender() -> RegionId {
        RegionId::new("n2", 4)
    }

    /// A `Deliver` in the rmp layout.
    fn deliver(shard: &str, entity_id: &str, payload: Vec<u8>) -> Vec<u8> {
        let msg = RegionInbound::Region(RegionToRegion::Deliver {
            shard: shard.to_string(),
            entity_id: entity_id.to_string(),
            payload,
            reply_to: None,
            epoch: 7,
        });
        wire::encode(&msg).unwrap().to_vec()
    }

    /// The same `Deliver` in the binary layout.
    fn deliver_binary(shard: &str, entity_id: &str, payload: Vec<u8>) -> Vec<u8> {
        let head = binary::DeliverHead { shard, entity_id, epoch: 7, reply_to: None };
        let mut buf = bytes::BytesMut::new();
        binary::put_deliver(&mut buf, &head, |b| {
            b.extend_from_slice(&payload);
            Ok(())
        })
        .unwrap();
        buf.to_vec()
    }

    fn reliable(shard: &str, entity_id: &str, payload: Vec<u8>) -> Vec<u8> {
        let header = DeliveryHeader {
            producer: "p".into(),
            stream: 4,
            seq: 2,
            first_unconfirmed: 1,
            redelivery: true,
            nonce: 3,
            epoch: 0,
            made: (0, 0),
        };
        let msg = RegionInbound::Region(RegionToRegion::DeliverReliably {
            shard: shard.to_string(),
            entity_id: entity_id.to_string(),
            payload,
            reply_to: (RegionId::new("n1", 1), 9),
            epoch: 7,
            header,
        });
        wire::encode(&msg).unwrap().to_vec()
    }

    fn classify_u32(body: &[u8]) -> Classified<'_, u32> {
        classify::<u32>(body, &sender(), 8, &names())
    }

    #[test]
    fn a_deliver_is_classified_by_its_id_its_payload_and_its_shard_in_either_layout() {
        for deliver in [deliver, deliver_binary] {
            a_deliver_is_classified_with(deliver);
        }
    }

    fn a_deliver_is_classified_with(deliver: fn(&str, &str, Vec<u8>) -> Vec<u8>) {
        let home = default_shard_id("cart-1", 10);
        let other = if home == "0" { "1".to_string() } else { "0".to_string() };
        let payload = wire::encode(&42u32).unwrap().to_vec();
        type Check = fn(&Classified<u32>) -> bool;
        let table: Vec<(&str, Vec<u8>, Check)> = vec![
            ("valid, with a message", deliver(&home, "cart-1", payload.clone()), |c| {
                matches!(c, Classified::Deliver { msg: Some(42), epoch: 7, .. })
            }),
            ("valid start, no message", deliver(&home, "cart-1", vec![]), |c| {
                matches!(c, Classified::Deliver { msg: None, .. })
            }),
            ("empty id", deliver(&home, "", payload.clone()), |c| {
                matches!(c, Classified::Refused { error: Error::EmptyEntityId, .. })
            }),
            ("id over the type's limit", deliver(&home, "cart-123456", payload.clone()), |c| {
                matches!(c, Classified::Refused { error: Error::EntityIdTooLong { len: 11, max: 8 }, .. })
            }),
            (
                "payload not the type's message",
                deliver(&home, "cart-1", wire::encode(&"text").unwrap().to_vec()),
                |c| matches!(c, Classified::Refused { error: Error::NotDelivered { reason, .. }, .. } if reason.contains("payload does not decode")),
            ),
            (
                "another shard than the extractor gives",
                deliver(&other, "cart-1", payload.clone()),
                |c| matches!(c, Classified::Refused { error: Error::NotDelivered { reason, .. }, .. } if reason.contains("extractor gives")),
            ),
            (
                "a reliable delivery",
                reliable(&home, "cart-1", payload.clone()),
                |c| matches!(c, Classified::Deliver { msg: Some(42), reply_to: Some((_, 9)), delivery: Some(h), .. } if h.seq == 2),
            ),
            (
                "a reliable delivery without a message",
                reliable(&home, "cart-1", vec![]),
                |c| matches!(c, Classified::Refused { reply_to: Some((_, 9)), error: Error::NotDelivered { reason, .. }, .. } if reason.contains("without a message")),
            ),
            ("a reliable delivery for an id over the limit", reliable(&home, "cart-123456", payload.clone()), |c| {
                matches!(c, Classified::Refused { error: Error::EntityIdTooLong { .. }, .. })
            }),
            ("not a region message", vec![0xc1, 0x00], |c| matches!(c, Classified::Malformed(_))),
            (
                "an ask's answer",
                wire::encode(&RegionInbound::Region(RegionToRegion::AskReply {
                    ask_id: 3,
                    result: Err(DeliveryFailure::EmptyEntityId),
                }))
                .unwrap()
                .to_vec(),
                |c| matches!(c, Classified::AskReply { ask_id: 3, result: Err(DeliveryFailure::EmptyEntityId) }),
            ),
            (
                "an ask's answer, binary",
                {
                    let mut buf = bytes::BytesMut::new();
                    binary::put_reply(&mut buf, 4, |b| wire::encode_into(b, &5u32)).unwrap();
                    buf.to_vec()
                },
                |c| matches!(c, Classified::AskReply { ask_id: 4, result: Ok(b) } if wire::decode::<u32>(b).unwrap() == 5),
            ),
            (
                "an ask's failure, binary",
                {
                    let mut buf = bytes::BytesMut::new();
                    binary::put_failure(&mut buf, 3, &DeliveryFailure::EmptyEntityId).unwrap();
                    buf.to_vec()
                },
                |c| matches!(c, Classified::AskReply { ask_id: 3, result: Err(DeliveryFailure::EmptyEntityId) }),
            ),
        ];
        for (case, body, check) in table {
            let got = classify_u32(&body);
            assert!(check(&got), "{case}: {got:?}");
        }
    }

    /// An asker's region on the node that sent the message is answered over that node's link;
    /// one elsewhere (the message was forwarded) gets no link (looked up when answering).
    #[tokio::test]
    async fn a_remote_asker_on_the_sending_node_is_answered_over_its_link_and_others_without() {
        use crate::config::TransportSettings;
        use crate::membership::UniqueAddress;
        use crate::transport::Transport;
        use tokio_util::sync::CancellationToken;

        struct Nothing;
        impl Entity for Nothing {
            type Message = ();
            type Reply = ();
            async fn handle(&mut self, _: (), _: &mut crate::sharding::EntityContext) {}
        }
        let shutdown = CancellationToken::new();
        let local = UniqueAddress::new("n1", 1);
        let t = Transport::bind(
            "127.0.0.1:0".parse().unwrap(),
            local,
            "c".into(),
            None,
            TransportSettings::default(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        let sender_node = UniqueAddress::new("n2", 1);
        let from = PeerAddr { address: sender_node.clone(), messaging_addr: "127.0.0.1:9".parse().unwrap() };
        let mut links = 0;
        let mut link = || {
            links += 1;
            t.sender(&from)
        };
        assert!(remote_reply::<Nothing>(None, None, &from, &mut link).is_none(), "a tell has no reply");
        match remote_reply::<Nothing>(Some((sender_node.clone(), 5)), None, &from, &mut link) {
            Some(ReplyTo::Remote { region, ask_id: 5, via: Some(_) }) => assert_eq!(region, sender_node),
            _ => panic!("the asker on the sending node is answered over its link"),
        }
        let elsewhere = UniqueAddress::new("n3", 1);
        match remote_reply::<Nothing>(Some((elsewhere.clone(), 6)), None, &from, &mut link) {
            Some(ReplyTo::Remote { region, ask_id: 6, via: None }) => assert_eq!(region, elsewhere),
            _ => panic!("an asker elsewhere gets no link"),
        }
        assert_eq!(links, 1, "the link is looked up only when it is used");
        shutdown.cancel();
    }

    /// A binary `Deliver` borrows its ids from the body, and an asker on the sending node shares
    /// the sender's region id: reading one allocates neither.
    #[test]
    fn a_binary_deliver_borrows_its_ids_and_shares_the_senders_region() {
        let home = default_shard_id("cart-1", 10);
        let from = sender();
        let reply_to = Some(binary::ReplyAddress::of(&from, 11));
        let head = binary::DeliverHead { shard: &home, entity_id: "cart-1", epoch: 2, reply_to };
        let mut buf = bytes::BytesMut::new();
        binary::put_deliver(&mut buf, &head, |b| wire::encode_into(b, &1u32)).unwrap();
        match classify::<u32>(&buf, &from, 8, &names()) {
            Classified::Deliver {
                shard,
                entity_id,
                msg: Some(1),
                reply_to: Some((region, 11)),
                epoch: 2,
                delivery: None,
            } => {
                assert!(matches!((&shard, &entity_id), (Cow::Borrowed(_), Cow::Borrowed("cart-1"))));
                assert!(Arc::ptr_eq(&region.node_id, &from.node_id), "the sender's region is shared, not read anew");
            }
            other => panic!("{other:?}"),
        }
        // An asker elsewhere (a relayed ask) is read as named.
        let elsewhere = RegionId::new("n3", 1);
        let head = binary::DeliverHead { reply_to: Some(binary::ReplyAddress::of(&elsewhere, 12)), ..head };
        let mut buf = bytes::BytesMut::new();
        binary::put_deliver(&mut buf, &head, |_| Ok(())).unwrap();
        match classify::<u32>(&buf, &from, 8, &names()) {
            Classified::Deliver { msg: None, reply_to: Some((region, 12)), .. } => assert_eq!(region, elsewhere),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_extractor_never_sees_an_id_over_the_limit() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let extractor: ShardIdExtractor = Arc::new(move |id: &str| {
            recorded.lock().unwrap().push(id.to_string());
            "0".to_string()
        });
        let long = "x".repeat(100);
        let names = ShardNames::custom(extractor);
        let body = deliver("0", &long, vec![]);
        let c = classify::<u32>(&body, &sender(), 8, &names);
        assert!(matches!(c, Classified::Refused { error: Error::EntityIdTooLong { .. }, .. }), "{c:?}");
        assert!(seen.lock().unwrap().is_empty());
        let body = deliver("0", "ok", vec![]);
        let c = classify::<u32>(&body, &sender(), 8, &names);
        assert!(matches!(c, Classified::Deliver { .. }), "{c:?}");
        assert_eq!(*seen.lock().unwrap(), vec!["ok".to_string()]);
    }
}
