//! What reaches a region's topic from other nodes, classified once: [`classify`] decodes a
//! body and checks a `Deliver` (entity id within the type's limit, shard as this node's
//! extractor gives it, payload decodes) in one place, for the fast path on the reading task and
//! for the region task alike. The fast path hands its verdict on with the message
//! ([`PassedOn`], riding on [`Inbound::hold`](crate::transport::Inbound::hold)), so a message it
//! passes on is decoded once.

use serde::de::DeserializeOwned;

use crate::error::Error;
use crate::sharding::Entity;
use crate::sharding::delivery::DeliveryHeader;
use crate::sharding::envelope::{DeliveryReply, Envelope, OutcomeTo, ReplyTo, not_delivered};
use crate::sharding::ids::{RegionId, ShardId, ShardIdExtractor, check_entity_id};
use crate::sharding::protocol::{DeliveryFailure, RegionInbound, RegionToRegion, ToRegion};
use crate::transport::{PeerAddr, PeerSender, wire};

/// A region-topic message (not a query), decoded and checked.
#[derive(Debug)]
pub(crate) enum Classified<M> {
    /// From the coordinator.
    Coordinator(ToRegion),
    /// A message for an entity that passed every check; `msg` is `None` for a start without a
    /// message; `delivery` is set for a reliable delivery (whose answer is its outcome).
    Deliver {
        shard: ShardId,
        entity_id: String,
        msg: Option<M>,
        reply_to: Option<(RegionId, u64)>,
        epoch: u64,
        delivery: Option<DeliveryHeader>,
    },
    /// A message for an entity refused: the error its asker (if any) gets.
    Refused { entity_id: String, reply_to: Option<(RegionId, u64)>, error: Error },
    /// The answer to an ask this node sent.
    AskReply { ask_id: u64, result: Result<serde_bytes::ByteBuf, DeliveryFailure> },
    /// The body did not decode.
    Malformed(Error),
}

/// Classifies `body` for a type whose ids are at most `max_entity_id_bytes` and whose shards
/// `extractor` gives. The extractor only ever sees an id within the limit.
pub(crate) fn classify<M: DeserializeOwned>(
    body: &[u8],
    max_entity_id_bytes: usize,
    extractor: &ShardIdExtractor,
) -> Classified<M> {
    let deliver = match wire::decode::<RegionInbound>(body) {
        Err(e) => return Classified::Malformed(e),
        Ok(RegionInbound::Coordinator(msg)) => return Classified::Coordinator(msg),
        Ok(RegionInbound::Region(RegionToRegion::AskReply { ask_id, result })) => {
            return Classified::AskReply { ask_id, result };
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
    let (shard, entity_id, payload, reply_to, epoch, delivery) = deliver;
    if delivery.is_some() && payload.is_empty() {
        let error = not_delivered(&entity_id, "a reliable delivery without a message");
        return Classified::Refused { entity_id, reply_to, error };
    }
    if let Err(error) = check_entity_id(&entity_id, max_entity_id_bytes) {
        return Classified::Refused { entity_id, reply_to, error };
    }
    let msg = if payload.is_empty() {
        None
    } else {
        match wire::decode::<M>(&payload) {
            Ok(msg) => Some(msg),
            Err(e) => {
                let error = not_delivered(&entity_id, format!("payload does not decode: {e}"));
                return Classified::Refused { entity_id, reply_to, error };
            }
        }
    };
    let own = extractor(&entity_id);
    if own != shard {
        let error =
            not_delivered(&entity_id, format!("sent for shard {shard:?}, but this node's extractor gives {own:?}"));
        return Classified::Refused { entity_id, reply_to, error };
    }
    Classified::Deliver { shard, entity_id, msg, reply_to, epoch, delivery }
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
    Classified(Classified<E::Message>),
    /// A valid `Deliver` the fast path could not put into a running entity's mailbox: its
    /// envelope, counted on its stripe's routed path until the region task is done with it.
    Routed { shard: ShardId, entity_id: String, epoch: u64, env: Envelope<E> },
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sharding::ids::default_shard_id;

    fn extractor() -> ShardIdExtractor {
        Arc::new(|id: &str| default_shard_id(id, 10))
    }

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

    fn classify_u32(body: &[u8]) -> Classified<u32> {
        classify::<u32>(body, 8, &extractor())
    }

    #[test]
    fn a_deliver_is_classified_by_its_id_its_payload_and_its_shard() {
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

    #[test]
    fn the_extractor_never_sees_an_id_over_the_limit() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let extractor: ShardIdExtractor = Arc::new(move |id: &str| {
            recorded.lock().unwrap().push(id.to_string());
            "0".to_string()
        });
        let long = "x".repeat(100);
        let c = classify::<u32>(&deliver("0", &long, vec![]), 8, &extractor);
        assert!(matches!(c, Classified::Refused { error: Error::EntityIdTooLong { .. }, .. }), "{c:?}");
        assert!(seen.lock().unwrap().is_empty());
        let c = classify::<u32>(&deliver("0", "ok", vec![]), 8, &extractor);
        assert!(matches!(c, Classified::Deliver { .. }), "{c:?}");
        assert_eq!(*seen.lock().unwrap(), vec!["ok".to_string()]);
    }
}
