//! Durable entities: entity state kept in the cluster's replicated, LMDB-durable store, so it
//! survives hand-off, passivation, crashes and full-cluster restarts with no external
//! datastore.
//!
//! # What is promised
//! - **Persist, then reply.** A handler that calls [`EntityContext::persist`] has its state
//!   written to a majority of replicas (each with it in LMDB) before its reply leaves and
//!   before the entity's next message is handled; an acknowledged state is what every later
//!   incarnation, on any node, starts from.
//! - **Fenced by epoch.** Every write carries its shard's allocation epoch as the most
//!   significant part of its order, and a shard's new allocation claims the state on the
//!   replicas it loads from: a stale incarnation (a partitioned old home, a superseded node)
//!   never overwrites state of a newer allocation and can no longer get a write acknowledged;
//!   its write fails with [`Error::Fenced`] and its shard stops here.
//! - **Typed failures.** A write not acknowledged fails the ask with
//!   [`Error::StateNotPersisted`] (its outcome is unknown: it may still spread from the
//!   replicas it reached), a state over `state.max_bytes` with [`Error::StateTooLarge`], and
//!   one that would grow its shard's state slot past the slot's byte budget with
//!   [`Error::SlotFull`] (nothing written either way); the entity then restarts from what its
//!   node's replica holds. A stored state
//!   that does not decode answers [`Error::StateUndecodable`] for every message, never a silent
//!   `Default`.
//!
//! # What is not promised
//! No event history (the state is a snapshot, last write wins per epoch), and no transactions
//! across entities.

use std::future::Future;
use std::sync::atomic::Ordering;

use serde::{Serialize, de::DeserializeOwned};
use tracing::warn;

use super::delivery::ConsumerMarks;
use super::{EndIncarnation, Entity, EntityContext, StateChange, StopReason};
use crate::error::{Error, Result};
use crate::transport::wire;

/// A sharded entity whose state is durable in the cluster (see [`super::Sharding::start_durable`]
/// and the promises in this module).
pub trait DurableEntity: Send + 'static {
    /// Messages the entity handles.
    type Message: Serialize + DeserializeOwned + Send + 'static;
    /// What `handle` answers.
    type Reply: Serialize + DeserializeOwned + Send + 'static;
    /// The durable state: loaded before the first message of every incarnation (`Default`
    /// when none is stored), written when the handler calls [`EntityContext::persist`].
    type State: Serialize + DeserializeOwned + Default + Send + 'static;

    /// Handles one message with the entity's state.
    fn handle(
        &mut self,
        state: &mut Self::State,
        msg: Self::Message,
        ctx: &mut EntityContext,
    ) -> impl Future<Output = Self::Reply> + Send;

    /// Runs once when this incarnation starts, after its state is loaded and before its first
    /// message (as [`Entity::started`]; not called when the stored state did not load). Does
    /// nothing by default.
    fn started(&mut self, state: &Self::State, ctx: &EntityContext) -> impl Future<Output = ()> + Send {
        let _ = (state, ctx);
        async {}
    }

    /// [`Entity::on_stop`] with the entity's state: runs once when the incarnation stops on
    /// purpose, bounded the same way. [`EntityContext::persist`] (or
    /// [`EntityContext::delete_state`]) here writes the state before the incarnation ends, with
    /// the guarantees of a write after a message; a write that fails is logged and the stop
    /// goes on (the next incarnation starts from what is stored). Not called for an entity
    /// whose stored state could not be read. Does nothing by default.
    fn on_stop(
        &mut self,
        state: &mut Self::State,
        reason: StopReason,
        ctx: &mut EntityContext,
    ) -> impl Future<Output = ()> + Send {
        let _ = (state, reason, ctx);
        async {}
    }
}

/// A [`DurableEntity`] as its region runs it: the entity and its loaded state.
pub struct Durable<D: DurableEntity> {
    entity: D,
    state: D::State,
    /// Why the stored state could not be loaded (answered to every message).
    broken: Option<Error>,
    /// Holds the sends of replies the entity took ([`EntityContext::reply_later`]) while a
    /// handler runs and writes; made when it first takes one.
    reply_gate: Option<std::sync::Arc<super::deferred::ReplyGate>>,
    /// Its marks of reliable deliveries, stored with its state.
    marks: ConsumerMarks,
    /// A state is stored (not none, or deleted): what settling its marks writes back.
    stored: bool,
}

impl<D: DurableEntity> Durable<D> {
    pub(crate) fn new(entity: D) -> Self {
        let marks = ConsumerMarks::new(rand::random());
        Durable { entity, state: D::State::default(), broken: None, reply_gate: None, marks, stored: false }
    }

    /// Writes the state change the handler asked for; on failure, says how the incarnation
    /// ends.
    async fn write(&mut self, change: StateChange, ctx: &mut EntityContext) -> Result<()> {
        let Some(io) = ctx.state_io.clone() else { return Ok(()) };
        let state = match change {
            StateChange::Delete => None,
            StateChange::Persist => Some(wire::encode(&self.state)),
        };
        // Marks of reliable deliveries go with the state, even a deleted one: a re-sent
        // message whose effect (the deletion too) was written is not applied again.
        let value = match (state, self.marks.is_empty()) {
            (None, true) => None,
            (state, true) => state,
            (state, false) => Some(state.transpose().and_then(|state| with_marks(state.as_deref(), &self.marks))),
        };
        let value = match value {
            None => None,
            Some(encoded) => {
                let bytes = match encoded {
                    Ok(b) => b,
                    Err(e) => {
                        io.counters().state_write_failures.fetch_add(1, Ordering::Relaxed);
                        ctx.end = Some(EndIncarnation::Restart);
                        let reason = format!("the state does not encode: {e}");
                        return Err(Error::StateNotPersisted { entity_id: ctx.entity_id.to_string(), reason });
                    }
                };
                if bytes.len() > io.max_state_bytes() {
                    io.counters().state_write_failures.fetch_add(1, Ordering::Relaxed);
                    ctx.end = Some(EndIncarnation::Restart);
                    return Err(Error::StateTooLarge {
                        entity_id: ctx.entity_id.to_string(),
                        bytes: bytes.len(),
                        max: io.max_state_bytes(),
                    });
                }
                Some(bytes.to_vec())
            }
        };
        match io.write(&ctx.shard_id, ctx.epoch, &ctx.entity_id, value).await {
            Ok(()) => {
                if change == StateChange::Delete {
                    self.state = D::State::default();
                }
                self.stored = change == StateChange::Persist;
                self.marks.settle();
                Ok(())
            }
            Err(Error::Fenced { fence, .. }) => {
                io.counters().state_write_failures.fetch_add(1, Ordering::Relaxed);
                ctx.end = Some(EndIncarnation::Fenced { fence });
                let key = format!("{}/{}", io.type_name(), ctx.entity_id);
                Err(Error::Fenced { key, epoch: ctx.epoch, fence })
            }
            Err(e) => {
                io.counters().state_write_failures.fetch_add(1, Ordering::Relaxed);
                ctx.end = Some(EndIncarnation::Restart);
                Err(match e {
                    // Nothing was written; the entity restarts from its stored state.
                    e @ (Error::StateNotPersisted { .. } | Error::SlotFull { .. }) => e,
                    other => {
                        Error::StateNotPersisted { entity_id: ctx.entity_id.to_string(), reason: other.to_string() }
                    }
                })
            }
        }
    }
}

impl<D: DurableEntity> Entity for Durable<D> {
    type Message = D::Message;
    type Reply = D::Reply;

    /// Never called: the entity runner calls [`Entity::handle_or_fail`], which can answer the
    /// failures a durable entity has and a plain reply cannot carry.
    async fn handle(&mut self, msg: D::Message, ctx: &mut EntityContext) -> D::Reply {
        match self.handle_or_fail(msg, ctx).await {
            Ok(reply) => reply,
            Err(e) => panic!("a durable entity's failure reached Entity::handle: {e}"),
        }
    }

    async fn handle_or_fail(&mut self, msg: D::Message, ctx: &mut EntityContext) -> Result<D::Reply> {
        if let Some(e) = &self.broken {
            return Err(match e {
                Error::StateUndecodable { type_name, entity_id, reason } => Error::StateUndecodable {
                    type_name: type_name.clone(),
                    entity_id: entity_id.clone(),
                    reason: reason.clone(),
                },
                other => Error::StateNotPersisted { entity_id: ctx.entity_id.to_string(), reason: other.to_string() },
            });
        }
        ctx.state_change = None;
        // An answer sent meanwhile (to this ask or an earlier one) may rest on the state this
        // handler writes: it leaves once the write is acknowledged, or gives way to its error.
        if let Some(gate) = &self.reply_gate {
            gate.close();
        }
        ctx.reply_gate = self.reply_gate.clone();
        let reply = self.entity.handle(&mut self.state, msg, ctx).await;
        self.reply_gate = ctx.reply_gate.take();
        self.apply_confirms(ctx);
        let result = match ctx.state_change.take() {
            None => Ok(reply),
            Some(change) => self.write(change, ctx).await.map(|()| reply),
        };
        if let Some(gate) = &self.reply_gate {
            gate.open(result.as_ref().err().map(ToString::to_string).as_deref());
        }
        result
    }

    fn delivery_marks(&mut self) -> Option<&mut ConsumerMarks> {
        Some(&mut self.marks)
    }

    async fn settle_marks(&mut self, ctx: &mut EntityContext) -> Result<()> {
        if self.broken.is_some() {
            // Never write over a stored state that did not load (its marks were not read).
            let reason = "its stored state did not load".to_string();
            return Err(Error::StateNotPersisted { entity_id: ctx.entity_id.to_string(), reason });
        }
        // The state as it is stored (or its absence), now with a majority's acknowledgement.
        let change = if self.stored { StateChange::Persist } else { StateChange::Delete };
        self.write(change, ctx).await
    }

    async fn started(&mut self, ctx: &EntityContext) {
        self.load(ctx).await;
        if self.broken.is_none() {
            self.entity.started(&self.state, ctx).await;
        }
    }

    async fn on_stop(&mut self, reason: StopReason, ctx: &mut EntityContext) {
        if self.broken.is_some() {
            return;
        }
        ctx.state_change = None;
        self.entity.on_stop(&mut self.state, reason, ctx).await;
        self.apply_confirms(ctx);
        if let Some(change) = ctx.state_change.take()
            && let Err(e) = self.write(change, ctx).await
        {
            warn!(entity_id = %ctx.entity_id, error = %e, "the state the stop hook wrote was not persisted; the stop goes on");
        }
    }
}

impl<D: DurableEntity> Durable<D> {
    /// Applies the handler's held confirmations to the marks; one it gave is written with
    /// the state (as `persist` does, unless the handler deleted it), so its message's effect
    /// is never applied again.
    fn apply_confirms(&mut self, ctx: &mut EntityContext) {
        let seq = ctx.delivery.as_ref().map(|d| d.seq);
        if ctx.confirms.to_apply() && super::confirm::apply(&mut ctx.confirms, seq, &mut self.marks) {
            ctx.state_change.get_or_insert(StateChange::Persist);
        }
    }

    /// Loads the stored state from this node's replica (see [`EntityContext`]'s shard claim).
    async fn load(&mut self, ctx: &EntityContext) {
        let Some(io) = &ctx.state_io else { return };
        match io.read(&ctx.shard_id, &ctx.entity_id).await {
            Ok(None) => {}
            Ok(Some(bytes)) => match split_marks::<D::State>(&bytes) {
                Ok((state, mut marks)) => {
                    marks.begin_incarnation(rand::random());
                    self.stored = state.is_some();
                    self.state = state.unwrap_or_default();
                    self.marks = marks;
                }
                Err(e) => {
                    io.counters().state_undecodable.fetch_add(1, Ordering::Relaxed);
                    warn!(type_name = %io.type_name(), entity_id = %ctx.entity_id, error = %e, "stored entity state does not decode; the entity answers errors");
                    self.broken = Some(Error::StateUndecodable {
                        type_name: io.type_name().to_string(),
                        entity_id: ctx.entity_id.to_string(),
                        reason: e.to_string(),
                    });
                }
            },
            Err(e) => {
                warn!(type_name = %io.type_name(), entity_id = %ctx.entity_id, error = %e, "reading the entity's state failed");
                self.broken = Some(e);
            }
        }
    }
}

/// The first byte of a stored state that carries marks of reliable deliveries: `0xC1`, which
/// MessagePack never uses, so a state stored without marks (by every earlier release too)
/// reads as before.
const WITH_MARKS: u8 = 0xC1;

/// A stored state with its marks (`state: None`: deleted, the marks kept).
#[derive(Serialize, serde::Deserialize)]
struct StoredWithMarks {
    state: Option<serde_bytes::ByteBuf>,
    marks: ConsumerMarks,
}

/// The stored form of an encoded state (or none) with `marks`.
pub(crate) fn with_marks(state: Option<&[u8]>, marks: &ConsumerMarks) -> Result<bytes::Bytes> {
    let stored = StoredWithMarks { state: state.map(|s| serde_bytes::ByteBuf::from(s.to_vec())), marks: marks.clone() };
    let mut out = vec![WITH_MARKS];
    out.extend_from_slice(&wire::encode(&stored)?);
    Ok(out.into())
}

/// A stored state (`None`: deleted, its marks kept) and its marks (none for a state stored
/// without).
fn split_marks<S: DeserializeOwned>(stored: &[u8]) -> Result<(Option<S>, ConsumerMarks)> {
    let (state, marks) = split_stored(stored)?;
    let state = match state {
        Some(bytes) => Some(wire::decode(&bytes)?),
        None => None,
    };
    Ok((state, marks))
}

/// A stored value's encoded state (`None`: deleted, its marks kept) and its marks (none for a
/// state stored without).
pub(crate) fn split_stored(stored: &[u8]) -> Result<(Option<std::borrow::Cow<'_, [u8]>>, ConsumerMarks)> {
    match stored.split_first() {
        Some((&WITH_MARKS, rest)) => {
            let stored: StoredWithMarks = wire::decode(rest)?;
            Ok((stored.state.map(|b| std::borrow::Cow::Owned(b.into_vec())), stored.marks))
        }
        _ => Ok((Some(std::borrow::Cow::Borrowed(stored)), ConsumerMarks::default())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::delivery::{Admission, DeliveryHeader};

    fn marks() -> ConsumerMarks {
        let mut m = ConsumerMarks::new(9);
        let h = DeliveryHeader {
            producer: "p".into(),
            stream: 3,
            seq: 1,
            first_unconfirmed: 1,
            redelivery: false,
            nonce: 9,
            epoch: 0,
            made: (0, 0),
        };
        assert_eq!(m.admit(&h), Admission::Handle);
        m
    }

    /// What of the marks is stored (an incarnation's nonce is not).
    fn stored_form(m: &ConsumerMarks) -> Vec<u8> {
        wire::encode(m).unwrap().to_vec()
    }

    #[test]
    fn a_state_stored_without_marks_reads_as_every_earlier_release_stored_it() {
        let plain = wire::encode(&vec![1u32, 2]).unwrap();
        let (state, m): (Option<Vec<u32>>, _) = split_marks(&plain).unwrap();
        assert_eq!((state, m.is_empty()), (Some(vec![1, 2]), true));
    }

    #[test]
    fn a_state_stored_with_marks_reads_back_both_and_a_deleted_one_keeps_its_marks() {
        let state = wire::encode(&vec![7u32]).unwrap();
        let stored = with_marks(Some(&state), &marks()).unwrap();
        assert_eq!(stored[0], WITH_MARKS);
        let (back, m): (Option<Vec<u32>>, _) = split_marks(&stored).unwrap();
        assert_eq!((back, stored_form(&m)), (Some(vec![7]), stored_form(&marks())));
        let deleted = with_marks(None, &marks()).unwrap();
        let (back, m): (Option<Vec<u32>>, _) = split_marks(&deleted).unwrap();
        assert_eq!((back, stored_form(&m)), (None, stored_form(&marks())));
    }

    #[test]
    fn a_truncated_stored_state_with_marks_is_an_error_not_a_default() {
        let stored = with_marks(Some(&wire::encode(&5u32).unwrap()), &marks()).unwrap();
        assert!(split_marks::<u32>(&stored[..stored.len() - 3]).is_err());
        assert!(split_marks::<u32>(&[WITH_MARKS]).is_err());
    }
}
