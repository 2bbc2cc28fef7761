//! A message on its way to an entity, and where its answer goes: a local asker, an asker on
//! another node (by ask id), or a `start_entity` caller.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{mpsc, oneshot, watch};
use tracing::debug;

use super::Entity;
use super::delivery::{DeliveryHeader, DeliveryOutcome};
use super::ids::RegionId;
use super::keys;
use super::protocol::{DeliveryFailure, RegionInbound, RegionToRegion, binary};
use crate::error::{Error, Result};
use crate::membership::MembershipSnapshot;
use crate::transport::{PeerSender, Transport, wire};

/// Where the answer to a message goes.
pub(crate) enum ReplyTo<E: Entity> {
    Local(oneshot::Sender<Result<E::Reply>>),
    Remote {
        region: RegionId,
        ask_id: u64,
        /// The link to the asker's node, when the message came straight from it (no lookup
        /// in the membership per reply).
        via: Option<PeerSender>,
    },
    /// `start_entity`: answered once the entity runs.
    Started(oneshot::Sender<Result<()>>),
    /// A reliable delivery ([`super::producer`]): its producer waits for the entity's outcome.
    Delivery(Box<DeliveryReply>),
}

/// A reliable delivery's header, and where its outcome goes.
pub(crate) struct DeliveryReply {
    pub header: DeliveryHeader,
    pub to: OutcomeTo,
}

/// Where a delivery's outcome goes: its producer on this node, or on another (by ask id).
pub(crate) enum OutcomeTo {
    Local(OutcomeSink),
    Remote { region: RegionId, ask_id: u64, via: Option<PeerSender> },
}

/// The outcomes of a producer's deliveries, each tagged with its flight.
pub(crate) type Outcomes = mpsc::UnboundedSender<(u64, Result<DeliveryOutcome>)>;

/// Where one delivery's outcome goes: its producer's one channel of outcomes, tagged with the
/// delivery's flight (no channel or task per delivery). Dropped unanswered, it tells the
/// producer the delivery was dropped, as a dropped oneshot would.
pub(crate) struct OutcomeSink {
    outcomes: Option<Outcomes>,
    flight: u64,
    /// After this the producer no longer waits for it (its delivery timed out).
    until: crate::clock::Instant,
}

impl OutcomeSink {
    pub(crate) fn new(outcomes: Outcomes, flight: u64, until: crate::clock::Instant) -> Self {
        OutcomeSink { outcomes: Some(outcomes), flight, until }
    }

    /// Sends the outcome to the producer.
    pub(crate) fn send(mut self, outcome: Result<DeliveryOutcome>) {
        if let Some(outcomes) = self.outcomes.take() {
            let _ = outcomes.send((self.flight, outcome));
        }
    }

    /// Whether the producer still waits for this outcome (an ask table keeps only those).
    pub(crate) fn is_waiting(&self) -> bool {
        self.outcomes.as_ref().is_some_and(|o| !o.is_closed()) && crate::clock::now() < self.until
    }
}

impl Drop for OutcomeSink {
    fn drop(&mut self) {
        if let Some(outcomes) = self.outcomes.take() {
            let _ = outcomes.send((self.flight, Err(not_delivered("", "the delivery was dropped"))));
        }
    }
}

impl<E: Entity> ReplyTo<E> {
    /// Whether the answer goes to another node (a relayed message keeps to the region task's
    /// path).
    pub(crate) fn is_remote(&self) -> bool {
        match self {
            ReplyTo::Remote { .. } => true,
            ReplyTo::Delivery(d) => matches!(d.to, OutcomeTo::Remote { .. }),
            ReplyTo::Local(_) | ReplyTo::Started(_) => false,
        }
    }
}

/// A message on its way to an entity. `msg: None` only starts the entity.
pub(crate) struct Envelope<E: Entity> {
    pub msg: Option<E::Message>,
    pub reply: Option<ReplyTo<E>>,
    /// Which path a message of the local handle took, for ordering (see [`RoutedInFlight`]).
    pub lane: Lane,
}

/// The path a message of this node's handle is on (see [`RoutedInFlight`]).
pub(crate) enum Lane {
    /// Not from the local handle (another node, a recovery start): no ordering to keep with
    /// the direct path.
    Elsewhere,
    /// Put straight into a running entity's mailbox; `usize` is its id's stripe.
    Direct(usize),
    /// On the routed path, counted until the envelope is dropped: once the entity has taken
    /// the message, or it was forwarded, failed or dropped.
    Routed { _ticket: RoutedTicket },
}

impl<E: Entity> Envelope<E> {
    pub(crate) fn new(msg: Option<E::Message>, reply: Option<ReplyTo<E>>) -> Self {
        Envelope { msg, reply, lane: Lane::Elsewhere }
    }

    /// An envelope that only starts the entity, answering nobody.
    pub(crate) fn start_only() -> Self {
        Envelope::new(None, None)
    }

    /// A message that went straight into a mailbox is back on the routed path (its
    /// incarnation ended before taking it): counted there from now on.
    pub(crate) fn back_on_routed_path(&mut self, gate: &Arc<RoutedInFlight>) {
        if let Lane::Direct(stripe) = self.lane {
            self.lane = Lane::Routed { _ticket: gate.ticket(stripe) };
        }
    }
}

/// Stripes of entity ids the routed-path counts are kept by (a power of two).
const ROUTED_STRIPES: usize = 256;

/// Messages of one region handle on the *routed* path (through the region task), counted per
/// stripe of entity ids. The handle sends a message on the *direct* path (straight into a
/// running local entity's mailbox) only while its id's stripe counts none, checked under the
/// shard's lock: an earlier message to the same entity still on the routed path would
/// otherwise be overtaken. A direct message whose incarnation ends before taking it (a panic,
/// a restart) goes back on the routed path, counted from the moment the incarnation ends.
/// That keeps the promise that one handle's messages to one entity are handled in the order
/// sent, across starts, passivation, panics, hand-offs and restarts, without a map per id;
/// the price is that an id shares its stripe with others, and takes the routed path while one
/// of them has a message there.
pub(crate) struct RoutedInFlight {
    stripes: Box<[AtomicUsize]>,
}

impl RoutedInFlight {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(RoutedInFlight { stripes: (0..ROUTED_STRIPES).map(|_| AtomicUsize::new(0)).collect() })
    }

    /// The stripe of `entity_id`.
    pub(crate) fn stripe(entity_id: &str) -> usize {
        (xxhash_rust::xxh3::xxh3_64_with_seed(entity_id.as_bytes(), 0x0D1E) as usize) & (ROUTED_STRIPES - 1)
    }

    /// Whether no message of `stripe` is on the routed path. Acquire: pairs with the release of
    /// the last ticket, so whatever the entity did with that message happened before.
    pub(crate) fn is_clear(&self, stripe: usize) -> bool {
        self.stripes[stripe].load(Ordering::Acquire) == 0
    }

    /// Counts a message of `stripe` onto the routed path until the ticket drops.
    pub(crate) fn ticket(self: &Arc<Self>, stripe: usize) -> RoutedTicket {
        self.stripes[stripe].fetch_add(1, Ordering::AcqRel);
        RoutedTicket { gate: self.clone(), stripe }
    }

    /// Messages of `stripe` on the routed path.
    #[cfg(test)]
    pub(crate) fn count(&self, stripe: usize) -> usize {
        self.stripes[stripe].load(Ordering::Acquire)
    }
}

/// One message counted on the routed path; see [`RoutedInFlight`].
pub(crate) struct RoutedTicket {
    gate: Arc<RoutedInFlight>,
    stripe: usize,
}

impl Drop for RoutedTicket {
    fn drop(&mut self) {
        self.gate.stripes[self.stripe].fetch_sub(1, Ordering::Release);
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

/// What an `AskReply` answers with.
enum Answer<'a, T> {
    /// The entity's answer.
    Value(&'a T),
    /// Done, with no value (a start).
    Empty,
    Failed(DeliveryFailure),
}

impl<T: serde::Serialize> Answer<'_, T> {
    /// The answer as the rmp layout carries it (a value that does not encode is a codec
    /// failure).
    fn into_rmp(self) -> std::result::Result<serde_bytes::ByteBuf, DeliveryFailure> {
        match self {
            Answer::Value(v) => rmp_serde::to_vec_named(v)
                .map(serde_bytes::ByteBuf::from)
                .map_err(|e| DeliveryFailure::of(&Error::Codec(e.to_string()))),
            Answer::Empty => Ok(serde_bytes::ByteBuf::new()),
            Answer::Failed(f) => Err(f),
        }
    }
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
            ReplyTo::Remote { region, ask_id, via } => {
                let answer = match &result {
                    Ok(Some(r)) => Answer::Value(r),
                    Ok(None) => Answer::Empty,
                    Err(e) => Answer::Failed(DeliveryFailure::of(e)),
                };
                self.answer_remote(region, ask_id, via, answer);
            }
            // A delivery is answered with its outcome by the entity runner; anything else
            // reaching it here is a failure on the way.
            ReplyTo::Delivery(d) => {
                let outcome = result.and_then(|_| Err(not_delivered(entity_id, "no delivery outcome")));
                self.outcome(d.to, outcome);
            }
        }
    }

    /// Answers a reliable delivery with `outcome`.
    pub(crate) fn outcome(&self, to: OutcomeTo, outcome: Result<DeliveryOutcome>) {
        match to {
            OutcomeTo::Local(sink) => sink.send(outcome),
            OutcomeTo::Remote { region, ask_id, via } => {
                let answer = match &outcome {
                    Ok(o) => Answer::Value(o),
                    Err(e) => Answer::Failed(DeliveryFailure::of(e)),
                };
                self.answer_remote(region, ask_id, via, answer);
            }
        }
    }

    /// Sends an `AskReply` to the asker's node: in the binary layout over a link to a node that
    /// reads it, the answer encoded straight into the link's queue; in the rmp layout otherwise.
    fn answer_remote<T: serde::Serialize>(
        &self,
        region: RegionId,
        ask_id: u64,
        via: Option<PeerSender>,
        answer: Answer<'_, T>,
    ) {
        let in_rmp = |answer: Answer<'_, T>| {
            RegionInbound::Region(RegionToRegion::AskReply { ask_id, result: answer.into_rmp() })
        };
        // A closed link means the asker's node refused us or was forgotten: membership
        // says whether it is still there (no writer is dialed to a departed asker).
        let sent = match via.filter(PeerSender::is_open) {
            Some(via) if binary::reads_binary(&via) => {
                let sent = via.send_with(&self.topic, |buf| match &answer {
                    Answer::Value(v) => binary::put_reply(buf, ask_id, |buf| wire::encode_into(buf, *v)),
                    Answer::Empty => binary::put_reply(buf, ask_id, |_| Ok(())),
                    Answer::Failed(f) => binary::put_failure(buf, ask_id, f),
                });
                match sent {
                    // The answer does not encode, or is too large for a frame: the asker
                    // hears why now rather than at its timeout.
                    Err(e @ Error::Codec(_)) if matches!(answer, Answer::Value(_)) => {
                        let failure = DeliveryFailure::of(&e);
                        via.send_with(&self.topic, |buf| binary::put_failure(buf, ask_id, &failure))
                    }
                    other => other,
                }
            }
            Some(via) => via.send_with(&self.topic, |buf| wire::encode_into(buf, &in_rmp(answer))),
            None => {
                let peer = self.members.borrow().peer(&region);
                match peer {
                    Some(peer) => {
                        wire::encode(&in_rmp(answer)).and_then(|b| self.transport.send(&peer, &self.topic, &b))
                    }
                    None => Ok(()), // the asker's node is gone; its ask fails there
                }
            }
        };
        if let Err(e) = sent {
            debug!(%region, error = %e, "ask reply not sent");
        }
    }

    /// Fails the envelope's asker (if any) with `NotDelivered { reason }`.
    pub(crate) fn fail<E: Entity>(&self, env: Envelope<E>, entity_id: &str, reason: &str) {
        self.fail_with(env, entity_id, || not_delivered(entity_id, reason));
    }

    /// Fails the envelope's asker (if any) with the error `error` makes.
    pub(crate) fn fail_with<E: Entity>(&self, env: Envelope<E>, entity_id: &str, error: impl FnOnce() -> Error) {
        if let Some(r) = env.reply {
            self.reply::<E>(r, entity_id, Err(error()));
        }
    }
}
