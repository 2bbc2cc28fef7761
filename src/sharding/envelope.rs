//! A message on its way to an entity, and where its answer goes: a local asker, an asker on
//! another node (by ask id), or a `start_entity` caller.

use std::sync::Arc;

use tokio::sync::{oneshot, watch};
use tracing::debug;

use super::Entity;
use super::ids::RegionId;
use super::keys;
use super::protocol::{DeliveryFailure, RegionInbound, RegionToRegion};
use crate::error::{Error, Result};
use crate::membership::MembershipSnapshot;
use crate::transport::{Transport, wire};

/// Where the answer to a message goes.
pub(crate) enum ReplyTo<E: Entity> {
    Local(oneshot::Sender<Result<E::Reply>>),
    Remote {
        region: RegionId,
        ask_id: u64,
    },
    /// `start_entity`: answered once the entity runs.
    Started(oneshot::Sender<Result<()>>),
}

/// A message on its way to an entity. `msg: None` only starts the entity.
pub(crate) struct Envelope<E: Entity> {
    pub msg: Option<E::Message>,
    pub reply: Option<ReplyTo<E>>,
}

impl<E: Entity> Envelope<E> {
    /// An envelope that only starts the entity, answering nobody.
    pub(crate) fn start_only() -> Self {
        Envelope { msg: None, reply: None }
    }
}

impl<E: Entity> std::fmt::Debug for Envelope<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Envelope")
    }
}

/// `NotDelivered` for `entity_id`.
pub(crate) fn not_delivered(entity_id: &str, reason: impl Into<String>) -> Error {
    Error::NotDelivered { entity_id: entity_id.to_string(), reason: reason.into() }
}

/// Sends answers: to local waiters directly, to remote askers over the transport.
#[derive(Clone)]
pub(crate) struct Replier {
    transport: Transport,
    topic: Arc<str>,
    members: watch::Receiver<Arc<MembershipSnapshot>>,
}

impl Replier {
    pub(crate) fn new(
        transport: Transport,
        type_name: &str,
        members: watch::Receiver<Arc<MembershipSnapshot>>,
    ) -> Self {
        Replier { transport, topic: keys::region_topic(type_name).into(), members }
    }

    /// Answers `reply` for `entity_id` with `result` (`Ok(None)`: the entity handled no message,
    /// as for `start_entity`).
    pub(crate) fn reply<E: Entity>(&self, reply: ReplyTo<E>, entity_id: &str, result: Result<Option<E::Reply>>) {
        match reply {
            ReplyTo::Local(tx) => {
                let _ = tx.send(result.and_then(|r| r.ok_or_else(|| not_delivered(entity_id, "no reply"))));
            }
            ReplyTo::Started(tx) => {
                let _ = tx.send(result.map(|_| ()));
            }
            ReplyTo::Remote { region, ask_id } => {
                let result = match result {
                    Ok(Some(r)) => wire::encode(&r)
                        .map(|b| serde_bytes::ByteBuf::from(b.to_vec()))
                        .map_err(|e| DeliveryFailure::of(&e)),
                    Ok(None) => Ok(serde_bytes::ByteBuf::new()),
                    Err(e) => Err(DeliveryFailure::of(&e)),
                };
                let msg = RegionInbound::Region(RegionToRegion::AskReply { ask_id, result });
                let peer = self.members.borrow().peer(&region);
                if let (Some(peer), Ok(bytes)) = (peer, wire::encode(&msg))
                    && let Err(e) = self.transport.send(&peer, &self.topic, &bytes)
                {
                    debug!(%region, error = %e, "ask reply not sent");
                }
            }
        }
    }

    /// Fails the envelope's asker (if any) with `NotDelivered { reason }`.
    pub(crate) fn fail<E: Entity>(&self, env: Envelope<E>, entity_id: &str, reason: &str) {
        if let Some(r) = env.reply {
            self.reply::<E>(r, entity_id, Err(not_delivered(entity_id, reason)));
        }
    }
}
