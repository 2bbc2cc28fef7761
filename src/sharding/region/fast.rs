//! [`SharedRegion`]: what a region shares with its handle and with the tasks reading its
//! connections. Its handler of the region topic, run by the transport on the task reading a
//! connection ([`crate::transport::Transport::subscribe_with`]), classifies each message once
//! ([`super::inbound::classify`]) and takes the two common ones without a hop through the region
//! task:
//! - a `Deliver` for an entity that runs here goes straight into its mailbox (the same rule as
//!   the local direct path: [`ShardDirectory::deliver`]);
//! - an `AskReply` completes its waiting ask.
//!
//! Everything else (coordinator messages, a `Deliver` for an entity not running here or
//! refused, anything malformed) is passed on to the region task with the verdict
//! ([`super::inbound::PassedOn`]), which decides without decoding it again.
//!
//! The sending side has a fast path too: the region task publishes each forward decision of
//! its core ([`RemoteHomes`]) with the core's routing generation, and the region's handle sends
//! a message for a shard whose published home is still current straight into that node's
//! queue ([`SharedRegion::send_direct`]) instead of through the region task.
//!
//! **Order.** Messages of one sender to one entity arrive in the order sent over one connection.
//! A `Deliver` passed on to the region task is counted on the routed path of its id's stripe
//! ([`RoutedInFlight`]) until the region task is done with it (the count rides with the
//! message, [`Inbound::hold`], so it is released even if the message is dropped on the way); a
//! later `Deliver` of that stripe takes the fast path only when the count is zero, so it never
//! overtakes one passed on before it.

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::oneshot;
use tracing::debug;

use super::asks::AskTable;
use super::inbound::{Classified, PassedOn, classify, remote_reply};
use crate::error::{Error, Result};
use crate::sharding::Entity;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::delivery::DeliveryOutcome;
use crate::sharding::envelope::{Envelope, Lane, OutcomeSink, OutcomeTo, ReplyTo, RoutedInFlight};
use crate::sharding::ids::{IdMap, RegionId, ShardId, ShardNames};
use crate::sharding::protocol::binary::{self, DeliverHead, ReplyAddress};
use crate::sharding::protocol::{DeliveryFailure, RegionInbound, RegionToRegion};
use crate::sharding::shard::ShardDirectory;
use crate::transport::{Inbound, PeerAddr, PeerSender, Transport, wire};

/// An asker waiting for a remote answer.
pub(crate) enum PendingAsk<R> {
    Reply(oneshot::Sender<Result<R>>),
    Started(oneshot::Sender<Result<()>>),
    /// A reliable delivery's producer, waiting for the entity's outcome.
    Delivery(OutcomeSink),
}

impl<R> PendingAsk<R> {
    pub(crate) fn is_waiting(&self) -> bool {
        match self {
            PendingAsk::Reply(tx) => !tx.is_closed(),
            PendingAsk::Started(tx) => !tx.is_closed(),
            PendingAsk::Delivery(sink) => sink.is_waiting(),
        }
    }

    pub(crate) fn fail(self, error: crate::error::Error) {
        match self {
            PendingAsk::Reply(tx) => {
                let _ = tx.send(Err(error));
            }
            PendingAsk::Started(tx) => {
                let _ = tx.send(Err(error));
            }
            PendingAsk::Delivery(sink) => sink.send(Err(error)),
        }
    }
}

/// Asks this region sent to other regions, shared by the region task (which sends them and
/// fails them when their region is gone) and the fast path (which completes them).
pub(crate) type SharedAsks<R> = Arc<AskTable<PendingAsk<R>>>;

/// Completes the ask `ask_id` with `result`. The one rule for answers to forwarded asks, used
/// by the fast path and the region task alike. The answer may come from another region than
/// the one the ask was sent to: a region that held the message until it learnt the shard's
/// newer home relays it there with the asker's reply address (members are trusted; see the
/// README's threat model).
pub(crate) fn complete_ask<E: Entity>(
    asks: &SharedAsks<E::Reply>,
    from: &RegionId,
    ask_id: u64,
    result: Result<std::borrow::Cow<'_, [u8]>, DeliveryFailure>,
) {
    let taken = asks.take(ask_id);
    let Some((entity_id, pending)) = taken else {
        debug!(%from, ask_id, "answer to an ask that no longer waits (answered, timed out or failed)");
        return;
    };
    match (pending, result) {
        (PendingAsk::Reply(tx), Ok(b)) => {
            let _ = tx.send(wire::decode::<E::Reply>(&b));
        }
        (PendingAsk::Started(tx), Ok(_)) => {
            let _ = tx.send(Ok(()));
        }
        (PendingAsk::Delivery(sink), Ok(b)) => sink.send(wire::decode::<DeliveryOutcome>(&b)),
        (p, Err(failure)) => p.fail(failure.into_error(&entity_id)),
    }
}

/// Senders to the peers this region talks to, kept so a reply or a forward takes no
/// transport-wide lock. A region talks to few peers; the list is dropped when it grows past
/// [`PeerSenders::MAX`] (peers come and go over a long life).
pub(crate) struct PeerSenders {
    transport: Transport,
    cache: Mutex<Vec<PeerSender>>,
}

impl PeerSenders {
    const MAX: usize = 256;

    pub(crate) fn new(transport: Transport) -> Self {
        PeerSenders { transport, cache: Mutex::new(Vec::new()) }
    }

    /// The sender for `to`.
    pub(crate) fn get(&self, to: &PeerAddr) -> PeerSender {
        let mut cache = self.cache.lock().expect("senders lock");
        if let Some(s) = cache.iter().find(|s| s.peer() == to) {
            return s.clone();
        }
        if cache.len() >= Self::MAX {
            cache.clear();
        }
        let s = self.transport.sender(to);
        cache.push(s.clone());
        s
    }
}

/// The forward decisions of the region core, as the region task last published them: a home
/// counts only while the core's routing generation is the one it was decided at.
///
/// **Why a direct send is as good as the region task's forward.** The region task publishes a
/// new generation under the write lock *before* it performs anything its core decided at that
/// generation; the handle checks the generation and queues its message under the read lock. So
/// a direct send is either in the peer's queue before the region task acts on a change (a
/// hand-off begun, a region gone, a refusal), or it sees the change and takes the routed path,
/// where the core buffers, forwards or drops as it decides.
#[derive(Default)]
pub(crate) struct RemoteHomes {
    state: RwLock<HomesState>,
    /// The generation last published, readable without the lock: the region task checks it
    /// after every step and takes the write lock only when its core's generation moved.
    published: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct HomesState {
    generation: u64,
    homes: IdMap<ShardId, RemoteHome>,
}

struct RemoteHome {
    generation: u64,
    epoch: u64,
    region: RegionId,
    sender: PeerSender,
}

impl RemoteHomes {
    /// The core's routing generation moved on: every home published before is stale. Called
    /// before any action of the step that moved it is performed.
    pub(crate) fn advance(&self, generation: u64) {
        use std::sync::atomic::Ordering;
        // Only the region task writes `published`, so reading it needs no lock.
        if self.published.load(Ordering::Relaxed) == generation {
            return;
        }
        self.state.write().expect("homes lock").generation = generation;
        self.published.store(generation, Ordering::Relaxed);
    }

    /// The core forwarded a message of `shard` to `region` at `epoch`, at the current generation.
    pub(crate) fn publish(&self, shard: &ShardId, region: &RegionId, epoch: u64, sender: &PeerSender) {
        let mut s = self.state.write().expect("homes lock");
        let generation = s.generation;
        match s.homes.get_mut(shard) {
            Some(h) if h.generation == generation && h.epoch == epoch && h.region == *region => {}
            Some(h) => *h = RemoteHome { generation, epoch, region: region.clone(), sender: sender.clone() },
            None => {
                let home = RemoteHome { generation, epoch, region: region.clone(), sender: sender.clone() };
                s.homes.insert(shard.clone(), home);
            }
        }
    }

    /// Forgets every published home (the region task stops).
    pub(crate) fn clear(&self) {
        let mut s = self.state.write().expect("homes lock");
        s.generation = u64::MAX;
        s.homes.clear();
        self.published.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A `Deliver` that could not be queued: why, and the local ask it carried (out of the table).
pub(crate) struct NotSent<R> {
    pub error: Error,
    pub pending: Option<PendingAsk<R>>,
}

/// What [`SharedRegion::send_direct`] did.
pub(crate) enum Direct<E: Entity> {
    /// Queued for the shard's home, or failed sending there (the error is the caller's).
    Sent(Result<()>),
    /// Not for the fast path: take the routed path.
    Routed(Envelope<E>),
}

/// What a region shares with its handle (direct sends, the local direct path) and with the
/// tasks reading its connections (the region topic's handler).
pub(crate) struct SharedRegion<E: Entity> {
    pub me: RegionId,
    /// This type's region topic.
    pub topic: Arc<str>,
    pub remote: RemoteHomes,
    /// The shards hosted here (`None` for a proxy: it hosts nothing).
    pub direct: Option<Arc<ShardDirectory<E>>>,
    pub routed: Arc<RoutedInFlight>,
    pub shard_names: ShardNames,
    /// The type's `max_entity_id_bytes`.
    pub max_entity_id_bytes: usize,
    pub counters: Arc<RegionCounterCells>,
    pub asks: SharedAsks<E::Reply>,
    pub senders: Arc<PeerSenders>,
}

impl<E: Entity> SharedRegion<E> {
    /// Sends a message of this node's handle straight to the shard's remote home when the
    /// region core's latest forward decision for the shard is still current and no earlier
    /// message of its id's stripe is on the routed path (see [`RemoteHomes`]).
    pub(crate) fn send_direct(&self, shard: &str, entity_id: &str, stripe: usize, env: Envelope<E>) -> Direct<E> {
        let state = self.remote.state.read().expect("homes lock");
        let Some(home) = state.homes.get(shard).filter(|h| h.generation == state.generation) else {
            return Direct::Routed(env);
        };
        if !self.routed.is_clear(stripe) || env.reply.as_ref().is_some_and(ReplyTo::is_remote) {
            return Direct::Routed(env);
        }
        // Queued under the read lock (see `RemoteHomes`): `state` lives to the end.
        match self.send_deliver(&home.sender, &home.region, shard, home.epoch, entity_id, env) {
            Ok(()) => {
                self.counters.remote_sent_direct.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Direct::Sent(Ok(()))
            }
            // The asker hears the error from the call itself.
            Err(NotSent { error, .. }) => Direct::Sent(Err(error)),
        }
    }

    /// Sends `env` for `entity_id` to the home of `shard` on `region` (at `epoch`) through
    /// `sender`: a local asker waits in the ask table for the answer; a remote asker's reply
    /// address is passed on. The one encoding of a `Deliver`, for the region task's forwards
    /// and the handle's direct sends alike. On failure the ask (if any) is out of the table
    /// again and handed back with the error.
    pub(crate) fn send_deliver(
        &self,
        sender: &PeerSender,
        region: &RegionId,
        shard: &str,
        epoch: u64,
        entity_id: &str,
        env: Envelope<E>,
    ) -> std::result::Result<(), NotSent<E::Reply>> {
        let (reply_to, pending, header) = match env.reply {
            None => (None, None, None),
            Some(ReplyTo::Remote { region, ask_id, .. }) => (Some((region, ask_id)), None, None),
            Some(ReplyTo::Local(tx)) => (None, Some(PendingAsk::Reply(tx)), None),
            Some(ReplyTo::Started(tx)) => (None, Some(PendingAsk::Started(tx)), None),
            Some(ReplyTo::Delivery(d)) => match d.to {
                OutcomeTo::Local(tx) => (None, Some(PendingAsk::Delivery(tx)), Some(d.header)),
                OutcomeTo::Remote { region, ask_id, .. } => (Some((region, ask_id)), None, Some(d.header)),
            },
        };
        if header.is_none() && binary::reads_binary(sender) {
            let ask_id = pending.map(|p| self.asks.insert(region.clone(), entity_id, p));
            let reply_to = match (&reply_to, ask_id) {
                (Some((region, id)), _) => Some(ReplyAddress::of(region, *id)),
                (None, Some(id)) => Some(ReplyAddress::of(&self.me, id)),
                (None, None) => None,
            };
            let head = DeliverHead { shard, entity_id, epoch, reply_to };
            let sent = sender.send_with(&self.topic, |buf| {
                binary::put_deliver(buf, &head, |buf| env.msg.as_ref().map_or(Ok(()), |m| wire::encode_into(buf, m)))
            });
            return sent
                .map_err(|error| NotSent { error, pending: ask_id.and_then(|id| self.asks.take(id)).map(|(_, p)| p) });
        }
        let payload = match env.msg.as_ref().map(rmp_serde::to_vec_named).transpose() {
            Ok(p) => p.unwrap_or_default(),
            Err(e) => return Err(NotSent { error: Error::Codec(format!("message does not encode: {e}")), pending }),
        };
        let ask_id = pending.map(|p| self.asks.insert(region.clone(), entity_id, p));
        let reply_to = reply_to.or_else(|| ask_id.map(|id| (self.me.clone(), id)));
        let (shard, entity_id) = (shard.to_string(), entity_id.to_string());
        let msg = match (header, reply_to) {
            (Some(header), Some(reply_to)) => RegionInbound::Region(RegionToRegion::DeliverReliably {
                shard,
                entity_id,
                payload,
                reply_to,
                epoch,
                header,
            }),
            (_, reply_to) => {
                RegionInbound::Region(RegionToRegion::Deliver { shard, entity_id, payload, reply_to, epoch })
            }
        };
        sender
            .send_with(&self.topic, |buf| wire::encode_into(buf, &msg))
            .map_err(|error| NotSent { error, pending: ask_id.and_then(|id| self.asks.take(id)).map(|(_, p)| p) })
    }

    /// Takes `m` if it can (`None`), or hands it back for the region task with what it found
    /// ([`PassedOn`]).
    pub(crate) fn handle(&self, mut m: Inbound) -> Option<Inbound> {
        if m.request_id.is_some() {
            return Some(m); // queries
        }
        let classified = classify::<E::Message>(&m.body, &m.from.address, self.max_entity_id_bytes, &self.shard_names);
        let passed = match (classified, self.direct.as_ref()) {
            (Classified::AskReply { ask_id, result }, _) => {
                complete_ask::<E>(&self.asks, &m.from.address, ask_id, result);
                return None;
            }
            // A proxy (no directory) hosts nothing: the region task decides (it holds, forwards
            // or fails it).
            (Classified::Deliver { shard, entity_id, msg, reply_to, epoch, delivery }, Some(direct)) => {
                let stripe = RoutedInFlight::stripe(&entity_id);
                let reply = remote_reply(reply_to, delivery, &m.from, || self.senders.get(&m.from));
                let mut env = Envelope::new(msg, reply);
                if self.routed.is_clear(stripe) {
                    match direct.deliver(&shard, &entity_id, stripe, env) {
                        Ok(()) => {
                            self.counters.remote_direct.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            return None;
                        }
                        Err(back) => env = back,
                    }
                }
                env.lane = Lane::Routed { _ticket: self.routed.ticket(stripe) };
                PassedOn::<E>::Routed { shard: shard.into_owned(), entity_id: entity_id.into_owned(), epoch, env }
            }
            (other, _) => PassedOn::Classified(other.into_owned()),
        };
        m.hold(passed);
        Some(m)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::TransportSettings;
    use crate::membership::{MembershipSnapshot, UniqueAddress};
    use crate::sharding::envelope::Replier;
    use crate::sharding::protocol::binary::Body;
    use crate::sharding::test_entities::Echo;
    use crate::transport::wire::{Frame, Hello, HelloReply, RejectReason};

    async fn read_frame(s: &mut TcpStream) -> Vec<u8> {
        tokio::time::timeout(Duration::from_secs(10), async {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).await.unwrap();
            let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
            s.read_exact(&mut buf).await.unwrap();
            buf
        })
        .await
        .expect("a frame within 10 s")
    }

    async fn write_frame(s: &mut TcpStream, body: &[u8]) {
        s.write_all(&(body.len() as u32).to_be_bytes()).await.unwrap();
        s.write_all(body).await.unwrap();
    }

    /// A peer that speaks protocol versions up to `version`: it refuses a dial above it (naming
    /// its own, as an older node does) and accepts one at it.
    async fn accept_at(listener: &TcpListener, version: u32) -> TcpStream {
        loop {
            let (mut s, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await.unwrap().unwrap();
            let hello: Hello = wire::decode(&read_frame(&mut s).await).unwrap();
            if hello.protocol_version > version {
                let refusal = RejectReason::ProtocolVersion { theirs: hello.protocol_version, ours: version };
                write_frame(&mut s, &wire::encode(&HelloReply::Reject(refusal)).unwrap()).await;
                continue;
            }
            write_frame(&mut s, &wire::encode(&HelloReply::Accept { address: hello.to }).unwrap()).await;
            return s;
        }
    }

    /// The body of the next region frame on `s`.
    async fn next_body(s: &mut TcpStream) -> Vec<u8> {
        let frame = read_frame(s).await;
        match Frame::decode(&frame).unwrap() {
            Frame::Message { topic: "region/echo", body } => body.to_vec(),
            other => panic!("{other:?}"),
        }
    }

    /// A `Deliver` sent to a node whose link is not up yet, or that speaks only protocol
    /// version 3 (a rolling update), is in the rmp layout every version reads; once a node
    /// accepted the link at version 4, `Deliver` and `AskReply` go in the binary layout. Both
    /// name the same message, shard, entity and asker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn region_envelopes_go_binary_only_to_a_node_that_accepted_version_4() {
        for (version, binary_after_link) in [(3, false), (4, true)] {
            let shutdown = CancellationToken::new();
            let local = UniqueAddress::new("n1", 1);
            let settings = TransportSettings::default();
            let t =
                Transport::bind("127.0.0.1:0".parse().unwrap(), local, "c".into(), None, settings, shutdown.clone())
                    .await
                    .unwrap();
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let peer =
                PeerAddr { address: UniqueAddress::new("n2", 1), messaging_addr: listener.local_addr().unwrap() };
            let region = SharedRegion::<Echo> {
                me: t.local().address.clone(),
                topic: "region/echo".into(),
                remote: RemoteHomes::default(),
                direct: None,
                routed: RoutedInFlight::new(),
                shard_names: ShardNames::new(None, 10),
                max_entity_id_bytes: 64,
                counters: Arc::default(),
                asks: Arc::default(),
                senders: Arc::new(PeerSenders::new(t.clone())),
            };
            let sender = region.senders.get(&peer);
            assert_eq!(sender.peer_version(), None, "no link yet");
            let ask = |entity_id: &str| {
                let (tx, _rx) = oneshot::channel();
                let env = Envelope::new(Some(7), Some(ReplyTo::Local(tx)));
                assert!(region.send_deliver(&sender, &peer.address, "3", 2, entity_id, env).is_ok());
            };
            ask("e1");
            let mut s = accept_at(&listener, version).await;
            let first = next_body(&mut s).await;
            assert!(!binary::is_binary(&first), "version {version}: before the link is up, rmp");
            match wire::decode::<RegionInbound>(&first).unwrap() {
                RegionInbound::Region(RegionToRegion::Deliver { shard, entity_id, payload, reply_to, epoch: 2 }) => {
                    assert_eq!((shard.as_str(), entity_id.as_str()), ("3", "e1"));
                    assert_eq!(wire::decode::<u32>(&payload).unwrap(), 7);
                    assert_eq!(reply_to.map(|(r, _)| r), Some(region.me.clone()));
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(sender.peer_version(), Some(version), "the version the link was accepted at");
            ask("e2");
            let second = next_body(&mut s).await;
            assert_eq!(binary::is_binary(&second), binary_after_link, "version {version}");
            let ask_id = if binary_after_link {
                match binary::decode(&second).unwrap() {
                    Body::Deliver { head, payload } => {
                        assert_eq!((head.shard, head.entity_id, head.epoch), ("3", "e2", 2));
                        assert_eq!(wire::decode::<u32>(payload).unwrap(), 7);
                        let reply_to = head.reply_to.unwrap();
                        assert_eq!((reply_to.node_id, reply_to.generation), ("n1", 1));
                        reply_to.ask_id
                    }
                    other => panic!("{other:?}"),
                }
            } else {
                match wire::decode::<RegionInbound>(&second).unwrap() {
                    RegionInbound::Region(RegionToRegion::Deliver { entity_id, reply_to: Some((_, id)), .. }) => {
                        assert_eq!(entity_id, "e2");
                        id
                    }
                    other => panic!("{other:?}"),
                }
            };
            assert_eq!(region.asks.take(ask_id).map(|(e, _)| e).as_deref(), Some("e2"), "the ask waits under its id");

            // This node answers an ask of that node over the same link: in the layout it reads.
            let members = tokio::sync::watch::channel(Arc::new(MembershipSnapshot {
                self_address: region.me.clone(),
                members: vec![],
            }))
            .1;
            let replier = Replier::new(t.clone(), "echo", members);
            let to = ReplyTo::<Echo>::Remote { region: peer.address.clone(), ask_id: 99, via: Some(sender.clone()) };
            replier.reply::<Echo>(to, "e3", Ok(Some(8)));
            let answer = next_body(&mut s).await;
            assert_eq!(binary::is_binary(&answer), binary_after_link, "version {version}");
            let classified = classify::<u32>(&answer, &peer.address, 64, &region.shard_names);
            match classified {
                Classified::AskReply { ask_id: 99, result: Ok(b) } => assert_eq!(wire::decode::<u32>(&b).unwrap(), 8),
                other => panic!("{other:?}"),
            }
            shutdown.cancel();
        }
    }
}
