//! Messages of the sharding protocol between regions and the coordinator, and between regions.
//! All travel over the transport as rmp-serde, except that `Deliver` and `AskReply` go to peers
//! that read it in the binary layout of [`binary`]; entity payloads are already-encoded bytes.

pub(crate) mod binary;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ids::{RegionId, ShardId};
use crate::error::Error;

/// Region → coordinator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum ToCoordinator {
    /// A region (or proxy) announces itself, with its shard-id extractor's fingerprint and the
    /// settings that must agree across nodes (none from a proxy, or from a node that predates
    /// the check).
    Register {
        region: RegionId,
        proxy: bool,
        extractor: u64,
        #[serde(default)]
        settings: Vec<(String, String)>,
    },
    /// Where does this shard live?
    GetShardHome { shard: ShardId, region: RegionId },
    /// The region started the shard it was asked to host.
    ShardStarted { shard: ShardId, region: RegionId },
    /// The region stopped routing to the shard's old home.
    BeginHandOffAck { shard: ShardId, region: RegionId, handoff: u64 },
    /// The old home stopped the shard's entities, answering the `HandOff` with this id (a late
    /// answer to an earlier, timed-out hand-off must not complete a later one).
    ShardStopped { shard: ShardId, region: RegionId, handoff: u64 },
    /// Hand off every shard of this region; it is shutting down.
    GracefulShutdownReq { region: RegionId },
    /// The region stopped (after a graceful shutdown); forget it.
    RegionStopped { region: RegionId },
}

impl ToCoordinator {
    /// The region the message speaks for (every message names its sender's region).
    pub(crate) fn region(&self) -> &RegionId {
        match self {
            ToCoordinator::Register { region, .. }
            | ToCoordinator::GetShardHome { region, .. }
            | ToCoordinator::ShardStarted { region, .. }
            | ToCoordinator::BeginHandOffAck { region, .. }
            | ToCoordinator::ShardStopped { region, .. }
            | ToCoordinator::GracefulShutdownReq { region }
            | ToCoordinator::RegionStopped { region } => region,
        }
    }
}

/// Coordinator → region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum ToRegion {
    /// Registration accepted.
    RegisterAck { coordinator: RegionId },
    /// Registration refused: the region's shard-id extractor is not the coordinator's, or a
    /// setting that must agree differs (`reason` says which; empty from a node that predates
    /// it).
    RegisterRefused {
        coordinator: RegionId,
        #[serde(default)]
        reason: String,
    },
    /// The shard lives at `region`, allocated with `epoch`.
    ShardHome { shard: ShardId, region: RegionId, epoch: u64 },
    /// Every home the coordinator knows, sent to a registering region before its
    /// `RegisterAck` (in messages of at most [`SHARD_HOMES_PER_MESSAGE`] entries), so its first
    /// message to a known shard needs no `GetShardHome`. Each entry is a `ShardHome`.
    ShardHomes { homes: Vec<(ShardId, RegionId, u64)> },
    /// Start hosting the shard (re-sent until `ShardStarted`).
    HostShard { shard: ShardId, epoch: u64 },
    /// Stop routing to the shard's current home; buffer its messages; acknowledge.
    BeginHandOff { shard: ShardId, handoff: u64 },
    /// Drop the shard's buffered messages, stop its entities, answer `ShardStopped` with the
    /// same hand-off id.
    HandOff { shard: ShardId, handoff: u64 },
}

/// Most entries of one [`ToRegion::ShardHomes`]: with shard ids of at most 256 bytes, a message
/// stays within about 200 KB, far under the transport's frame limit.
pub(crate) const SHARD_HOMES_PER_MESSAGE: usize = 512;

/// Region → region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum RegionToRegion {
    /// A message for an entity (payload is the rmp-encoded `Entity::Message`).
    Deliver {
        shard: ShardId,
        entity_id: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
        /// Set for asks: who waits, and the ask id there.
        reply_to: Option<(RegionId, u64)>,
        /// The epoch of the home the sender sent it to (0 from nodes that predate it): tells a
        /// message that arrived before its shard started here from one whose shard has moved
        /// on since.
        #[serde(default)]
        epoch: u64,
    },
    /// A reliable delivery ([`super::producer`]): a `Deliver` of an ask whose answer is the
    /// entity's [`DeliveryOutcome`](super::delivery::DeliveryOutcome). A variant of its own, so
    /// a node that predates it drops it (its producer sends it again) instead of handling it
    /// as a plain message whose answer the producer could not read.
    DeliverReliably {
        shard: ShardId,
        entity_id: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
        reply_to: (RegionId, u64),
        epoch: u64,
        header: super::delivery::DeliveryHeader,
    },
    /// The answer to an ask (rmp-encoded `Entity::Reply`), or why there is none.
    AskReply { ask_id: u64, result: Result<serde_bytes::ByteBuf, DeliveryFailure> },
}

/// Why an ask failed on the node that handled it: the delivery errors of [`Error`] without the
/// entity id (the asker knows it), so a remote failure arrives as the same typed error as a
/// local one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DeliveryFailure {
    BufferFull { type_name: String, buffer_size: usize },
    EmptyEntityId,
    AskTimeout { timeout_ms: u64 },
    NotDelivered { reason: String },
    MailboxFull { capacity: u64 },
    Fenced { key: String, epoch: u64, fence: u64 },
    StateTooLarge { bytes: u64, max: u64 },
    SlotFull { shard: String, slot: u32, budget: u64 },
    StateUndecodable { type_name: String, reason: String },
    StateNotPersisted { reason: String },
    RememberedLimit { shard: String, limit: u64 },
}

impl DeliveryFailure {
    /// The failure an error becomes on the wire (errors that are not delivery errors travel as
    /// `NotDelivered` with their text).
    pub(crate) fn of(error: &Error) -> Self {
        match error {
            Error::BufferFull { type_name, buffer_size } => {
                DeliveryFailure::BufferFull { type_name: type_name.clone(), buffer_size: *buffer_size }
            }
            Error::EmptyEntityId => DeliveryFailure::EmptyEntityId,
            Error::AskTimeout { timeout, .. } => {
                DeliveryFailure::AskTimeout { timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX) }
            }
            Error::NotDelivered { reason, .. } => DeliveryFailure::NotDelivered { reason: reason.clone() },
            Error::MailboxFull { capacity, .. } => DeliveryFailure::MailboxFull { capacity: *capacity as u64 },
            Error::Fenced { key, epoch, fence } => {
                DeliveryFailure::Fenced { key: key.clone(), epoch: *epoch, fence: *fence }
            }
            Error::StateTooLarge { bytes, max, .. } => {
                DeliveryFailure::StateTooLarge { bytes: *bytes as u64, max: *max as u64 }
            }
            Error::SlotFull { shard, slot, budget, .. } => {
                DeliveryFailure::SlotFull { shard: shard.clone(), slot: *slot, budget: *budget as u64 }
            }
            Error::StateUndecodable { type_name, reason, .. } => {
                DeliveryFailure::StateUndecodable { type_name: type_name.clone(), reason: reason.clone() }
            }
            Error::StateNotPersisted { reason, .. } => DeliveryFailure::StateNotPersisted { reason: reason.clone() },
            Error::RememberedLimit { shard, limit, .. } => {
                DeliveryFailure::RememberedLimit { shard: shard.clone(), limit: *limit as u64 }
            }
            other => DeliveryFailure::NotDelivered { reason: other.to_string() },
        }
    }

    /// The error the asker of `entity_id` gets.
    pub(crate) fn into_error(self, entity_id: &str) -> Error {
        match self {
            DeliveryFailure::BufferFull { type_name, buffer_size } => Error::BufferFull { type_name, buffer_size },
            DeliveryFailure::EmptyEntityId => Error::EmptyEntityId,
            DeliveryFailure::AskTimeout { timeout_ms } => Error::AskTimeout {
                entity_id: entity_id.to_string(),
                timeout: std::time::Duration::from_millis(timeout_ms),
            },
            DeliveryFailure::NotDelivered { reason } => {
                Error::NotDelivered { entity_id: entity_id.to_string(), reason }
            }
            DeliveryFailure::MailboxFull { capacity } => Error::MailboxFull {
                entity_id: entity_id.to_string(),
                capacity: usize::try_from(capacity).unwrap_or(usize::MAX),
            },
            DeliveryFailure::Fenced { key, epoch, fence } => Error::Fenced { key, epoch, fence },
            DeliveryFailure::StateTooLarge { bytes, max } => Error::StateTooLarge {
                entity_id: entity_id.to_string(),
                bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
                max: usize::try_from(max).unwrap_or(usize::MAX),
            },
            DeliveryFailure::SlotFull { shard, slot, budget } => Error::SlotFull {
                entity_id: entity_id.to_string(),
                shard,
                slot,
                budget: usize::try_from(budget).unwrap_or(usize::MAX),
            },
            DeliveryFailure::StateUndecodable { type_name, reason } => {
                Error::StateUndecodable { type_name, entity_id: entity_id.to_string(), reason }
            }
            DeliveryFailure::StateNotPersisted { reason } => {
                Error::StateNotPersisted { entity_id: entity_id.to_string(), reason }
            }
            DeliveryFailure::RememberedLimit { shard, limit } => Error::RememberedLimit {
                entity_id: entity_id.to_string(),
                shard,
                limit: usize::try_from(limit).unwrap_or(usize::MAX),
            },
        }
    }
}

/// Everything on a region topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum RegionInbound {
    /// From the coordinator.
    Coordinator(ToRegion),
    /// From another region.
    Region(RegionToRegion),
}

/// Requests answered on the coordinator topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum CoordinatorQuery {
    /// Registered regions.
    CurrentRegions,
    /// The allocation table ([`crate::sharding::query::AllocationTable`]).
    Allocation,
    /// Why a shard is where it is (`Option<`[`crate::sharding::query::ShardExplanation`]`>`;
    /// `None` for a shard id the extractor cannot produce).
    Explain { shard: ShardId },
    /// What a rebalance round would do now ([`crate::sharding::query::RebalancePlan`]).
    RebalancePlan,
    /// Run a rebalance round now; answered with the plan it carried out.
    Rebalance,
}

/// Requests answered on a region topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum RegionQuery {
    /// Shards hosted by the region with their entity counts.
    Stats,
    /// Shards hosted by the region with their entity ids.
    State,
}

/// Answer to [`RegionQuery::Stats`]: shard id → number of live entities.
pub(crate) type RegionStatsReply = BTreeMap<ShardId, usize>;
/// Answer to [`RegionQuery::State`]: shard id → entity ids.
pub(crate) type RegionStateReply = BTreeMap<ShardId, Vec<String>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deliver_from_a_node_that_predates_the_home_epoch_decodes_with_epoch_zero() {
        // The Deliver as such a node encodes it: no `epoch` field.
        #[derive(Serialize)]
        enum OldRegionInbound {
            #[allow(dead_code)]
            Coordinator(()),
            Region(OldRegionToRegion),
        }
        #[derive(Serialize)]
        enum OldRegionToRegion {
            Deliver { shard: ShardId, entity_id: String, payload: Vec<u8>, reply_to: Option<(RegionId, u64)> },
        }
        let old = OldRegionInbound::Region(OldRegionToRegion::Deliver {
            shard: "3".into(),
            entity_id: "cart-9".into(),
            payload: vec![7],
            reply_to: None,
        });
        use crate::transport::wire;
        let decoded: RegionInbound = wire::decode(&wire::encode(&old).unwrap()).unwrap();
        assert!(matches!(
            decoded,
            RegionInbound::Region(RegionToRegion::Deliver { epoch: 0, ref shard, .. }) if shard == "3"
        ));
    }

    #[test]
    fn a_node_that_predates_reliable_delivery_cannot_decode_one_so_never_handles_it_as_a_plain_message() {
        // What such a node decodes: the variants it knew.
        #[derive(Deserialize, Debug)]
        #[allow(dead_code)]
        enum OldRegionToRegion {
            Deliver {
                shard: ShardId,
                entity_id: String,
                payload: serde_bytes::ByteBuf,
                reply_to: Option<(RegionId, u64)>,
            },
            AskReply {
                ask_id: u64,
                result: Result<serde_bytes::ByteBuf, DeliveryFailure>,
            },
        }
        let header = crate::sharding::delivery::DeliveryHeader {
            producer: "p".into(),
            stream: 1,
            seq: 1,
            first_unconfirmed: 1,
            redelivery: false,
            nonce: 9,
            epoch: 0,
            made: (4, 2),
        };
        let new = RegionToRegion::DeliverReliably {
            shard: "3".into(),
            entity_id: "cart-9".into(),
            payload: vec![7],
            reply_to: (RegionId::new("n1", 1), 5),
            epoch: 2,
            header,
        };
        use crate::transport::wire;
        let bytes = wire::encode(&new).unwrap();
        assert!(wire::decode::<OldRegionToRegion>(&bytes).is_err());
        assert_eq!(wire::decode::<RegionToRegion>(&bytes).unwrap(), new);
    }

    #[test]
    fn delivery_failures_cross_the_wire_as_the_same_typed_errors_with_the_entity_id() {
        let cases = [
            Error::BufferFull { type_name: "cart".into(), buffer_size: 7 },
            Error::EmptyEntityId,
            Error::AskTimeout { entity_id: "remote-side".into(), timeout: std::time::Duration::from_millis(1500) },
            Error::NotDelivered { entity_id: "remote-side".into(), reason: "entity stopped".into() },
            Error::MailboxFull { entity_id: "remote-side".into(), capacity: 9 },
            Error::Fenced { key: "cart/cart-1".into(), epoch: 4, fence: 6 },
            Error::StateTooLarge { entity_id: "remote-side".into(), bytes: 70_000, max: 65_536 },
            Error::SlotFull { entity_id: "remote-side".into(), shard: "17".into(), slot: 5, budget: 1 << 20 },
            Error::StateUndecodable { type_name: "cart".into(), entity_id: "remote-side".into(), reason: "bad".into() },
            Error::StateNotPersisted { entity_id: "remote-side".into(), reason: "timed out".into() },
            Error::RememberedLimit { entity_id: "remote-side".into(), shard: "17".into(), limit: 50_000 },
        ];
        for e in cases {
            let wire = crate::transport::wire::encode(&DeliveryFailure::of(&e)).unwrap();
            let back = crate::transport::wire::decode::<DeliveryFailure>(&wire).unwrap().into_error("cart-1");
            match (&e, &back) {
                (Error::BufferFull { .. }, Error::BufferFull { type_name, buffer_size }) => {
                    assert_eq!((type_name.as_str(), *buffer_size), ("cart", 7))
                }
                (Error::EmptyEntityId, Error::EmptyEntityId) => {}
                (Error::AskTimeout { .. }, Error::AskTimeout { entity_id, timeout }) => {
                    assert_eq!((entity_id.as_str(), timeout.as_millis()), ("cart-1", 1500))
                }
                (Error::NotDelivered { .. }, Error::NotDelivered { entity_id, reason }) => {
                    assert_eq!((entity_id.as_str(), reason.as_str()), ("cart-1", "entity stopped"))
                }
                (Error::MailboxFull { .. }, Error::MailboxFull { entity_id, capacity }) => {
                    assert_eq!((entity_id.as_str(), *capacity), ("cart-1", 9))
                }
                (Error::Fenced { .. }, Error::Fenced { key, epoch, fence }) => {
                    assert_eq!((key.as_str(), *epoch, *fence), ("cart/cart-1", 4, 6))
                }
                (Error::StateTooLarge { .. }, Error::StateTooLarge { entity_id, bytes, max }) => {
                    assert_eq!((entity_id.as_str(), *bytes, *max), ("cart-1", 70_000, 65_536))
                }
                (Error::SlotFull { .. }, Error::SlotFull { entity_id, shard, slot, budget }) => {
                    assert_eq!((entity_id.as_str(), shard.as_str(), *slot, *budget), ("cart-1", "17", 5, 1 << 20))
                }
                (Error::StateUndecodable { .. }, Error::StateUndecodable { type_name, entity_id, reason }) => {
                    assert_eq!((type_name.as_str(), entity_id.as_str(), reason.as_str()), ("cart", "cart-1", "bad"))
                }
                (Error::StateNotPersisted { .. }, Error::StateNotPersisted { entity_id, reason }) => {
                    assert_eq!((entity_id.as_str(), reason.as_str()), ("cart-1", "timed out"))
                }
                (Error::RememberedLimit { .. }, Error::RememberedLimit { entity_id, shard, limit }) => {
                    assert_eq!((entity_id.as_str(), shard.as_str(), *limit), ("cart-1", "17", 50_000))
                }
                _ => panic!("{e:?} came back as {back:?}"),
            }
        }
        let other = DeliveryFailure::of(&Error::ShutDown).into_error("cart-2");
        assert!(matches!(other, Error::NotDelivered { ref entity_id, .. } if entity_id == "cart-2"), "{other:?}");
    }

    #[test]
    fn fuzz_sharding_messages_and_coordinator_records() {
        use crate::sharding::coordinator::state::{RegionRecord, ShardRecord};
        let region: RegionId = crate::membership::UniqueAddress::new("n1", 5);
        use crate::transport::wire;
        let seeds: Vec<Vec<u8>> = vec![
            wire::encode(&ToCoordinator::Register {
                region: region.clone(),
                proxy: false,
                extractor: 77,
                settings: vec![],
            })
            .unwrap()
            .to_vec(),
            wire::encode(&ToCoordinator::ShardStopped { shard: "12".into(), region: region.clone(), handoff: 3 })
                .unwrap()
                .to_vec(),
            wire::encode(&RegionInbound::Coordinator(ToRegion::ShardHome {
                shard: "1".into(),
                region: region.clone(),
                epoch: 9,
            }))
            .unwrap()
            .to_vec(),
            wire::encode(&RegionInbound::Region(RegionToRegion::Deliver {
                shard: "1".into(),
                entity_id: "cart-1".into(),
                payload: vec![1, 2, 3],
                reply_to: Some((region.clone(), 4)),
                epoch: 7,
            }))
            .unwrap()
            .to_vec(),
            wire::encode(&RegionInbound::Region(RegionToRegion::AskReply {
                ask_id: 4,
                result: Err(DeliveryFailure::MailboxFull { capacity: 10 }),
            }))
            .unwrap()
            .to_vec(),
            rmp_serde::to_vec(&ShardRecord { region: Some(region.clone()), epoch: 2 }).unwrap(),
            rmp_serde::to_vec(&RegionRecord { region, proxy: true }).unwrap(),
        ];
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            let _ = wire::decode::<ToCoordinator>(&bytes);
            let _ = wire::decode::<CoordinatorQuery>(&bytes);
            let _ = wire::decode::<RegionQuery>(&bytes);
            if let Ok(RegionInbound::Region(RegionToRegion::AskReply { result: Err(f), .. })) =
                wire::decode::<RegionInbound>(&bytes)
            {
                let _ = f.into_error("e");
            }
            let _ = rmp_serde::from_slice::<ShardRecord>(&bytes);
            let _ = rmp_serde::from_slice::<RegionRecord>(&bytes);
        });
    }
}
