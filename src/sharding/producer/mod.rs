//! Reliable delivery, the producer's side: [`Producer`] sends messages to entities by id, each
//! numbered in its (producer, entity) stream, and sends them again until each is confirmed.
//!
//! # What is promised
//! - **Stored, then confirmed.** [`Producer::send`] returns once the message is stored in the
//!   producer's queue, with a [`Confirmation`] that resolves once the entity handled it (for a
//!   durable entity: handled and its state written). A stored message is sent again after a
//!   hand-off, a crash of the entity's node, a partition or a lost frame, until confirmed; it
//!   leaves the queue unconfirmed only as a dead letter (its entity panicked on it more than
//!   `max_redeliveries` times: [`Error::DeadLettered`], and the hook of
//!   [`Producer::on_dead_letter`]).
//! - **At least once, in order.** An entity handles each stream in the order sent, and a
//!   message it handled is confirmed without being handled again for as long as its marks live
//!   ([`crate::sharding::delivery`]): for a plain entity, its incarnation (a message re-sent
//!   to a new incarnation is handled again, flagged [`crate::sharding::DeliveryInfo::redelivery`]); for a
//!   durable entity, its stored state (the effect of each message lands once).
//! - **Flow control.** At most `window` unconfirmed messages per entity and `max_entities`
//!   entities with unconfirmed messages: `send` waits for room (cancel-safe: a `send` dropped
//!   while it waits stored nothing). Past `max_queued_bytes` of unconfirmed messages it fails
//!   at once ([`Error::ProducerQueueFull`]).
//!
//! # What is not promised
//! The queue lives in this producer's memory: a producer that stops (every handle dropped, its
//! node shut down or crashed) loses what it had not had confirmed, and its waiting
//! confirmations fail with [`Error::ProducerStopped`]. Two live producers with one id are not
//! fenced from each other; give each its own id.
//!
//! The decisions live in the sans-IO [`core`]; this driver stores, sends through the region,
//! and feeds each delivery's outcome back.

pub(crate) mod core;
pub(crate) mod durable;
mod flights;
pub(crate) mod queue;
mod registry;
mod settings;

pub use registry::ProducerInfo;
pub(crate) use registry::producers;
use registry::{ProducerView, register};
pub use settings::{MAX_PRODUCER_ID_LEN, ProducerSettings};

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use self::core::{ProducerAction, ProducerCore, ProducerInput, SendResult};
use self::durable::DurableQueue;
use self::flights::{Flight, Flights};
use super::Entity;
use super::delivery::{DeliveryHeader, DeliveryOutcome};
use super::envelope::{OutcomeSink, Outcomes};
use super::handle::ShardRegion;
use crate::clock::Instant;
use crate::error::{Error, Result};
use crate::transport::wire;

/// Room a delivery's envelope takes in a frame besides its message.
const ENVELOPE_ROOM: usize = 4096;

/// A message given up ([`Producer::on_dead_letter`]).
#[derive(Debug)]
pub struct DeadLetter<M> {
    /// The entity it was for.
    pub entity_id: String,
    /// Its number in the producer's stream to that entity.
    pub seq: u64,
    /// The message.
    pub message: M,
    /// The entity's last panic on it.
    pub reason: String,
}

/// What a producer counted and holds ([`Producer::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProducerStats {
    /// Messages stored.
    pub stored: u64,
    /// Messages confirmed.
    pub confirmed: u64,
    /// Sends of a message sent before.
    pub resent: u64,
    /// `send` calls that had to wait for room.
    pub demand_waits: u64,
    /// Messages given up.
    pub dead_lettered: u64,
    /// Messages stored and not yet confirmed.
    pub unconfirmed: usize,
    /// Their bytes.
    pub queued_bytes: usize,
    /// Entities they are for.
    pub entities: usize,
    /// How long the oldest of them has waited.
    pub oldest_unconfirmed_age: Option<Duration>,
}

type DeadLetterHook<M> = Arc<dyn Fn(DeadLetter<M>) + Send + Sync>;

/// Resolves once the stored message is confirmed ([`Producer::send`]); dropping it does not
/// withdraw the message.
#[derive(Debug)]
pub struct Confirmation {
    seq: u64,
    producer_id: Arc<str>,
    rx: oneshot::Receiver<Result<()>>,
}

impl Confirmation {
    /// The message's number in the producer's stream to its entity.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl Future for Confirmation {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(r)) => Poll::Ready(r),
            Poll::Ready(Err(_)) => {
                Poll::Ready(Err(Error::ProducerStopped { producer_id: self.producer_id.to_string() }))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

struct State {
    core: ProducerCore,
    /// Offers waiting for room, by waiter id.
    waiters: HashMap<u64, oneshot::Sender<()>>,
    next_waiter: u64,
    /// Stored messages' confirmations, by (stream, seq).
    confirms: HashMap<(u64, u64), oneshot::Sender<Result<()>>>,
    /// Durable: sends waiting for their message's write, by (stream, seq).
    storing: HashMap<(u64, u64), oneshot::Sender<Result<()>>>,
    /// Durable: why a write was refused, for its send, by (stream, seq).
    refusals: HashMap<(u64, u64), Error>,
    /// Why the producer stopped, once it did.
    stopped: Option<Stopped>,
    flights: Flights,
}

/// Why a producer stopped.
#[derive(Debug, Clone, Copy)]
enum Stopped {
    /// Its handles were dropped or its node shut down.
    Stopped,
    /// A newer incarnation claimed its durable queue at `fence`.
    Fenced { epoch: u64, fence: u64 },
}

/// A durable store write that ended: whether it was a deletion, its message, its result.
type WriteEnded = (bool, Option<core::StoredMessage>, Result<()>);

/// A durable store write in flight: the entry's key and value (`None`: a deletion), and the
/// message it stores or deletes (none for a stale entry's deletion).
struct PersistJob {
    key: String,
    value: Option<Vec<u8>>,
    message: Option<core::StoredMessage>,
}

struct Inner<E: Entity> {
    producer_id: Arc<str>,
    region: ShardRegion<E>,
    max_message_bytes: usize,
    state: Mutex<State>,
    /// Where the entities' outcomes come back (one channel, flights by tag).
    outcomes: Outcomes,
    delivery_timeout: Duration,
    dead_letters: Mutex<Option<DeadLetterHook<E::Message>>>,
    /// The durable queue, with its store writes on their way to the producer's task.
    durable: Option<(DurableQueue, mpsc::UnboundedSender<PersistJob>)>,
    /// Ends the producer's task (its handles dropped, or fenced).
    stop: CancellationToken,
}

/// Stops the producer's task when the last handle goes.
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A reliable-delivery producer for the entities of one region ([`ShardRegion::producer`]);
/// cheap to clone. See the module doc for what it promises.
pub struct Producer<E: Entity> {
    inner: Arc<Inner<E>>,
    _stop: Arc<StopOnDrop>,
}

impl<E: Entity> Clone for Producer<E> {
    fn clone(&self) -> Self {
        Producer { inner: self.inner.clone(), _stop: self._stop.clone() }
    }
}

impl<E: Entity> std::fmt::Debug for Producer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").field("producer_id", &self.inner.producer_id).finish_non_exhaustive()
    }
}

impl<E: Entity> ShardRegion<E> {
    /// A reliable-delivery producer for this region's entities, with id `producer_id` (see
    /// [`Producer`]): messages numbered per entity, sent again until confirmed, with flow
    /// control per entity. Works on a proxy too. Fails for an empty id or one over
    /// [`MAX_PRODUCER_ID_LEN`] bytes, settings out of range, a producer of this id running
    /// on this node already, or a stand-in.
    ///
    /// With [`ProducerSettings::durable_queue`], the producer first claims the queue its id
    /// left in the cluster (a majority read; [`Error::ProducerFenced`] stops an older
    /// incarnation still running elsewhere) and sends again everything it holds.
    pub async fn producer(&self, producer_id: &str, settings: ProducerSettings) -> Result<Producer<E>> {
        Producer::start(self.clone(), producer_id, settings).await
    }
}

impl<E: Entity> Producer<E> {
    /// Starts a producer sending through `region` (see [`ShardRegion::producer`]).
    async fn start(region: ShardRegion<E>, producer_id: &str, settings: ProducerSettings) -> Result<Self> {
        settings.check()?;
        if producer_id.is_empty() || producer_id.len() > MAX_PRODUCER_ID_LEN {
            return Err(Error::BadRequest(format!(
                "producer id {producer_id:?} must be 1 to {MAX_PRODUCER_ID_LEN} bytes"
            )));
        }
        let node = region.node()?.clone();
        if producers(&node).iter().any(|p| p.producer_id == producer_id && p.type_name == region.type_name()) {
            return Err(Error::BadRequest(format!(
                "a producer {producer_id:?} of type {:?} runs on this node already",
                region.type_name()
            )));
        }
        let opened = if settings.durable_queue { Some(durable::open(&region, producer_id).await?) } else { None };
        let epoch = opened.as_ref().map_or(0, |o| o.queue.epoch);
        let max_message_bytes = node.config().transport.max_frame_size.saturating_sub(ENVELOPE_ROOM);
        let (outcomes, outcomes_rx) = mpsc::unbounded_channel();
        let (persists, persists_rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let core = ProducerCore::new(producer_id.to_string(), settings.limits(), rand::random(), epoch);
        let (durable, restored) = match opened {
            Some(o) => (Some((o.queue, persists)), Some(o.restored)),
            None => (None, None),
        };
        let inner = Arc::new(Inner {
            producer_id: producer_id.into(),
            region,
            max_message_bytes,
            state: Mutex::new(State {
                core,
                waiters: HashMap::new(),
                next_waiter: 0,
                confirms: HashMap::new(),
                storing: HashMap::new(),
                refusals: HashMap::new(),
                stopped: None,
                flights: Flights::default(),
            }),
            outcomes,
            delivery_timeout: settings.delivery_timeout,
            dead_letters: Mutex::new(None),
            durable,
            stop: stop.clone(),
        });
        if let Some(restored) = restored {
            inner.resume(restored);
        }
        let view: Arc<dyn ProducerView> = inner.clone();
        register(&node, Arc::downgrade(&view));
        let task = drive(inner.clone(), outcomes_rx, persists_rx, node.shutdown_token(), settings);
        node.spawner().spawn(task);
        Ok(Producer { inner, _stop: Arc::new(StopOnDrop(stop)) })
    }

    /// The producer's id.
    pub fn producer_id(&self) -> &str {
        &self.inner.producer_id
    }

    /// Stores `msg` for entity `entity_id` and returns once it is stored, waiting for room
    /// first (see the module doc); the [`Confirmation`] resolves once the entity handled it.
    /// An id over the type's limit, a message over the frame limit or past the producer's
    /// byte budget fails at once, with nothing stored.
    ///
    /// Cancel-safe while it waits for room: dropped then, it stored nothing. With a durable
    /// queue it then waits for the message's write; dropped during that wait, the message may
    /// still be stored and delivered. A write refused (its slot full) fails with the refusal,
    /// nothing stored; one not acknowledged is tried again until it is.
    pub async fn send(&self, entity_id: &str, msg: E::Message) -> Result<Confirmation> {
        let inner = &self.inner;
        crate::sharding::ids::check_entity_id(entity_id, inner.region.max_entity_id_bytes())?;
        let bytes = Bytes::from(
            rmp_serde::to_vec_named(&msg).map_err(|e| Error::Codec(format!("message does not encode: {e}")))?,
        );
        if bytes.len() > inner.max_message_bytes {
            return Err(Error::MessageTooLarge {
                entity_id: entity_id.to_string(),
                bytes: bytes.len(),
                max: inner.max_message_bytes,
            });
        }
        loop {
            match inner.offer(entity_id, &bytes)? {
                Offered::Stored(confirmation) => return Ok(confirmation),
                // Durable: stored once its write is acknowledged.
                Offered::Storing(stored, confirmation) => {
                    return match stored.await {
                        Ok(Ok(())) => Ok(confirmation),
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err(inner.stopped_error(Stopped::Stopped)),
                    };
                }
                // Woken for room, or the producer stopped (seen by the next offer).
                Offered::Wait(woken) => {
                    let _ = woken.await;
                }
            }
        }
    }

    /// Calls `hook` with every message given up from now on (its entity panicked on it more
    /// than `max_redeliveries` times), besides failing its [`Confirmation`]. The hook runs on
    /// the producer's task: keep it short.
    pub fn on_dead_letter(&self, hook: impl Fn(DeadLetter<E::Message>) + Send + Sync + 'static) {
        *self.inner.dead_letters.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(hook));
    }

    /// What the producer counted and holds now.
    pub fn stats(&self) -> ProducerStats {
        self.inner.stats()
    }
}

impl<E: Entity> ProducerView for Inner<E> {
    fn info(&self) -> ProducerInfo {
        let (producer_id, type_name) = (self.producer_id.to_string(), self.region.type_name().to_string());
        ProducerInfo { producer_id, type_name, stats: self.stats() }
    }

    fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }
}

impl<E: Entity> Inner<E> {
    fn stats(&self) -> ProducerStats {
        let st = self.lock();
        let c = st.core.counts();
        ProducerStats {
            stored: c.stored,
            confirmed: c.confirmed,
            resent: c.resent,
            demand_waits: c.demand_waits,
            dead_lettered: c.dead_lettered,
            unconfirmed: st.core.unconfirmed(),
            queued_bytes: st.core.queued_bytes(),
            entities: st.core.entities(),
            oldest_unconfirmed_age: st
                .core
                .oldest_unconfirmed()
                .map(|t| crate::clock::now().saturating_duration_since(t)),
        }
    }
}

/// What performing a run of the core's actions gave its caller.
struct Performed<M> {
    answer: Option<ProducerAction>,
    dead: Vec<DeadLetter<M>>,
}

impl<M> Default for Performed<M> {
    fn default() -> Self {
        Performed { answer: None, dead: Vec::new() }
    }
}

/// What an offer came to ([`Inner::offer`]).
enum Offered {
    Stored(Confirmation),
    /// Durable: stored once the receiver says so.
    Storing(oneshot::Receiver<Result<()>>, Confirmation),
    /// No room: wait for the wake, then offer again.
    Wait(oneshot::Receiver<()>),
}

impl<E: Entity> Inner<E> {
    /// Offers `bytes` for `entity_id` to the core once.
    fn offer(&self, entity_id: &str, bytes: &Bytes) -> Result<Offered> {
        let mut st = self.lock();
        if let Some(why) = st.stopped {
            return Err(self.stopped_error(why));
        }
        st.next_waiter += 1;
        let waiter = st.next_waiter;
        let offer = ProducerInput::Offer { entity: entity_id.to_string(), bytes: bytes.clone(), waiter };
        let (answer, dead) = self.run_core(&mut st, offer);
        let confirmation = |st: &mut State, stream, seq| {
            let (tx, rx) = oneshot::channel();
            st.confirms.insert((stream, seq), tx);
            Confirmation { seq, producer_id: self.producer_id.clone(), rx }
        };
        let offered = match answer {
            Some(ProducerAction::Stored { stream, seq }) => Ok(Offered::Stored(confirmation(&mut st, stream, seq))),
            Some(ProducerAction::Storing { stream, seq }) => {
                let (tx, rx) = oneshot::channel();
                st.storing.insert((stream, seq), tx);
                Ok(Offered::Storing(rx, confirmation(&mut st, stream, seq)))
            }
            Some(ProducerAction::Refused { queued_bytes, max_queued_bytes }) => Err(Error::ProducerQueueFull {
                producer_id: self.producer_id.to_string(),
                bytes: bytes.len(),
                queued_bytes,
                max_queued_bytes,
            }),
            _ => {
                let (tx, rx) = oneshot::channel();
                st.waiters.insert(waiter, tx);
                Ok(Offered::Wait(rx))
            }
        };
        drop(st);
        self.dead_letters(dead);
        offered
    }

    /// The error a stopped producer answers with.
    fn stopped_error(&self, why: Stopped) -> Error {
        let producer_id = self.producer_id.to_string();
        match why {
            Stopped::Stopped => Error::ProducerStopped { producer_id },
            Stopped::Fenced { epoch, fence } => Error::ProducerFenced { producer_id, epoch, fence },
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `input` through the core and performs what it decided; returns the answer to an
    /// offer (stored, storing, wait, refused) and the dead letters for the hook (called
    /// unlocked).
    fn run_core(&self, st: &mut State, input: ProducerInput) -> (Option<ProducerAction>, Vec<DeadLetter<E::Message>>) {
        let now = crate::clock::now();
        let mut done = Performed::default();
        let mut inputs = std::collections::VecDeque::from([input]);
        let mut out = Vec::new();
        while let Some(input) = inputs.pop_front() {
            st.core.handle(input, now, &mut out);
            for action in out.drain(..) {
                self.perform(st, action, &mut inputs, &mut done);
            }
        }
        (done.answer, done.dead)
    }

    /// Performs one of the core's actions; what it feeds back goes to `inputs`.
    fn perform(
        &self,
        st: &mut State,
        action: ProducerAction,
        inputs: &mut std::collections::VecDeque<ProducerInput>,
        done: &mut Performed<E::Message>,
    ) {
        match action {
            // Durable: a write acknowledged completes its send.
            ProducerAction::Stored { stream, seq } if st.storing.contains_key(&(stream, seq)) => {
                let _ = st.storing.remove(&(stream, seq)).expect("checked").send(Ok(()));
            }
            a @ (ProducerAction::Stored { .. }
            | ProducerAction::Storing { .. }
            | ProducerAction::Wait
            | ProducerAction::Refused { .. }) => done.answer = Some(a),
            ProducerAction::StoreFailed { stream, seq, reason } => {
                let error = st
                    .refusals
                    .remove(&(stream, seq))
                    .unwrap_or_else(|| Error::StateNotPersisted { entity_id: String::new(), reason: reason.clone() });
                st.confirms.remove(&(stream, seq));
                if let Some(tx) = st.storing.remove(&(stream, seq)) {
                    let _ = tx.send(Err(error));
                }
            }
            ProducerAction::Persist { key, entry } => {
                let message = Some((entry.entity.clone(), entry.stream, entry.seq));
                match wire::encode(&entry) {
                    Ok(value) => self.persist(PersistJob { key, value: Some(value.to_vec()), message }),
                    Err(e) => {
                        let result = core::PersistResult::Refused(e.to_string());
                        let (entity, stream, seq) = (entry.entity, entry.stream, entry.seq);
                        inputs.push_back(ProducerInput::Persisted { entity, stream, seq, result });
                    }
                }
            }
            ProducerAction::Unpersist { key, of } => self.persist(PersistJob { key, value: None, message: of }),
            ProducerAction::Fenced { fence } => {
                let epoch = self.durable.as_ref().map_or(0, |(q, _)| q.epoch);
                warn!(producer = %self.producer_id, epoch, fence, "a newer incarnation of this producer claimed its queue; stopping");
                self.stop_locked(st, Stopped::Fenced { epoch, fence });
            }
            ProducerAction::Wake { waiter, entity } => {
                if st.waiters.remove(&waiter).is_none_or(|tx| tx.send(()).is_err()) {
                    inputs.push_back(ProducerInput::WakeLost { entity });
                }
            }
            ProducerAction::Send { entity, header, round, bytes } => {
                let (stream, seq) = (header.stream, header.seq);
                let (tag, until) = (st.flights.next_tag(), crate::clock::now() + self.delivery_timeout);
                // Recorded once sent: an outcome comes back through the task, which takes this
                // lock first; a delivery not sent reports its drop, found in no flight.
                match self.deliver(&entity, header, &bytes, tag, until) {
                    Ok(()) => {
                        st.flights.sent(tag, until, Flight { entity, stream, round, seq });
                    }
                    Err(e) => {
                        let result = SendResult::Failed(e.to_string());
                        inputs.push_back(ProducerInput::Outcome { entity, stream, round, seq, result });
                    }
                }
            }
            ProducerAction::Confirmed { stream, seq } => {
                if let Some(tx) = st.confirms.remove(&(stream, seq)) {
                    let _ = tx.send(Ok(()));
                }
            }
            ProducerAction::DeadLetter { entity, stream, seq, bytes, reason } => {
                warn!(producer = %self.producer_id, entity_id = %entity, seq, reason = %reason,
                    "message given up after its entity panicked on it past max_redeliveries");
                if let Some(tx) = st.confirms.remove(&(stream, seq)) {
                    let _ = tx.send(Err(Error::DeadLettered {
                        producer_id: self.producer_id.to_string(),
                        entity_id: entity.clone(),
                        seq,
                        reason: reason.clone(),
                    }));
                }
                if let Ok(message) = wire::decode::<E::Message>(&bytes) {
                    done.dead.push(DeadLetter { entity_id: entity, seq, message, reason });
                }
            }
        }
    }

    /// Hands a store write to the producer's task.
    fn persist(&self, job: PersistJob) {
        if let Some((_, jobs)) = &self.durable {
            let _ = jobs.send(job);
        }
    }

    /// Feeds what a durable queue's load found to the core (which resumes its streams and
    /// deletes the stale entries).
    fn resume(&self, restored: queue::Restored) {
        if restored.undecodable > 0 {
            warn!(producer = %self.producer_id, entries = restored.undecodable, "stored queue entries that do not decode were deleted");
        }
        self.feed(ProducerInput::Restore(restored));
    }

    /// Sends one delivery through the region, its outcome tagged `tag` and awaited until
    /// `until`.
    fn deliver(&self, entity: &str, header: DeliveryHeader, bytes: &[u8], tag: u64, until: Instant) -> Result<()> {
        let msg = wire::decode::<E::Message>(bytes)?;
        self.region.deliver_reliably(entity, header, msg, OutcomeSink::new(self.outcomes.clone(), tag, until))
    }

    /// Feeds a run of outcomes to the core under one lock.
    fn land(&self, outcomes: &mut Vec<(u64, Result<DeliveryOutcome>)>) {
        self.feed_with(|st, inputs| {
            inputs.extend(outcomes.drain(..).filter_map(|(tag, outcome)| st.flights.land(tag, outcome)));
        });
        outcomes.clear();
    }

    /// A tick: the deliveries that timed out fail, and the core hears the time.
    fn tick(&self) {
        self.feed_with(|st, inputs| {
            st.flights.expire(crate::clock::now(), self.delivery_timeout, inputs);
            inputs.push(ProducerInput::Tick);
        });
    }

    fn dead_letters(&self, dead: Vec<DeadLetter<E::Message>>) {
        if dead.is_empty() {
            return;
        }
        let hook = self.dead_letters.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(hook) = hook {
            for letter in dead {
                hook(letter);
            }
        }
    }

    /// Feeds an input that answers no offer (an outcome, a tick).
    fn feed(&self, input: ProducerInput) {
        self.feed_with(|_, inputs| inputs.push(input));
    }

    /// Feeds what `gather` finds under the producer's lock (inputs that answer no offer), all
    /// under that one lock; the dead letters go to the hook after.
    fn feed_with(&self, gather: impl FnOnce(&mut State, &mut Vec<ProducerInput>)) {
        let dead = {
            let mut st = self.lock();
            if st.stopped.is_some() {
                return;
            }
            let mut inputs = Vec::new();
            gather(&mut st, &mut inputs);
            let mut dead = Vec::new();
            for input in inputs {
                dead.extend(self.run_core(&mut st, input).1);
            }
            dead
        };
        self.dead_letters(dead);
    }

    /// A run of store writes (or deletions) ended: the core hears how, under one lock.
    fn written(&self, ended: &mut Vec<WriteEnded>) {
        self.feed_with(|st, inputs| {
            for (deletion, message, written) in ended.drain(..) {
                let (result, refusal) = durable::persist_result(written);
                inputs.push(match message {
                    Some((entity, stream, seq)) if !deletion => {
                        if let Some(e) = refusal {
                            st.refusals.insert((stream, seq), e);
                        }
                        ProducerInput::Persisted { entity, stream, seq, result }
                    }
                    of => ProducerInput::Unpersisted { of, result },
                });
            }
        });
        ended.clear();
    }

    /// The producer stopped: every waiting confirmation fails, every waiting `send` is woken
    /// to find it stopped.
    fn stop(&self) {
        let mut st = self.lock();
        self.stop_locked(&mut st, Stopped::Stopped);
    }

    /// Stops the producer for `why` (the first reason stays), failing what waits, and ends its
    /// task.
    fn stop_locked(&self, st: &mut State, why: Stopped) {
        let why = *st.stopped.get_or_insert(why);
        st.waiters.clear();
        for (_, tx) in st.confirms.drain().chain(st.storing.drain()) {
            let _ = tx.send(Err(self.stopped_error(why)));
        }
        self.stop.cancel();
    }
}

/// Most queue writes handed to the store's writer in one request.
const MAX_WRITES_PER_REQUEST: usize = 1024;

/// Longest a stopping producer waits for the deletions of its confirmed messages' entries.
const CLOSING_BUDGET: Duration = Duration::from_secs(2);

/// How often due rounds are started.
const TICK: Duration = Duration::from_millis(50);

/// The producer's task: waits for the outcomes of deliveries in flight and feeds them, and
/// time, to the core; ends when the last handle goes or the node shuts down.
async fn drive<E: Entity>(
    inner: Arc<Inner<E>>,
    mut outcomes: mpsc::UnboundedReceiver<(u64, Result<DeliveryOutcome>)>,
    mut persists: mpsc::UnboundedReceiver<PersistJob>,
    shutdown: CancellationToken,
    settings: ProducerSettings,
) {
    let stop = inner.stop.clone();
    let (mut landed, mut jobs) = (Vec::new(), Vec::new());
    let (mut writing, mut ended) = (FuturesUnordered::new(), Vec::new());
    #[cfg(feature = "metrics")]
    let mut published = tokio::time::interval(Duration::from_secs(1));
    #[cfg(not(feature = "metrics"))]
    let mut published = futures::future::pending::<()>();
    let mut tick = tokio::time::interval(TICK.min(settings.resend_backoff_min));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = shutdown.cancelled() => break,
            // Every outcome waiting, under one lock.
            n = outcomes.recv_many(&mut landed, 1024) => {
                if n == 0 { break; }
                inner.land(&mut landed);
            }
            // Every write asked for by now, in order, as one request to the store's writer.
            n = persists.recv_many(&mut jobs, MAX_WRITES_PER_REQUEST), if inner.durable.is_some() => {
                // Its sender lives in `inner.durable`: closed only without a durable queue.
                if n == 0 { break; }
                writing.push(inner.write_all(std::mem::take(&mut jobs)));
            }
            Some(first) = writing.next(), if !writing.is_empty() => {
                // Every write that ended by now, under one lock.
                ended.extend(first);
                while let Some(Some(more)) = writing.next().now_or_never() {
                    ended.extend(more);
                }
                inner.written(&mut ended);
            }
            _ = tick.tick() => inner.tick(),
            _ = next_publish(&mut published) => inner.publish_metrics(),
        }
    }
    if inner.durable.is_some() && inner.closing() {
        // The entries of confirmed messages are deleted before the task ends (a later
        // incarnation would send them again), within a bound: the store may be going too.
        let deadline = tokio::time::sleep(CLOSING_BUDGET);
        tokio::pin!(deadline);
        while !(writing.is_empty() && persists.is_empty()) {
            tokio::select! {
                _ = &mut deadline => break,
                n = persists.recv_many(&mut jobs, MAX_WRITES_PER_REQUEST), if !persists.is_empty() => {
                    if n > 0 {
                        writing.push(inner.write_all(std::mem::take(&mut jobs)));
                    }
                }
                Some(written) = writing.next(), if !writing.is_empty() => {
                    ended.extend(written);
                    inner.written(&mut ended);
                }
            }
        }
    }
    inner.stop();
    inner.publish_metrics();
}

#[cfg(feature = "metrics")]
async fn next_publish(every: &mut tokio::time::Interval) {
    every.tick().await;
}

#[cfg(not(feature = "metrics"))]
async fn next_publish(never: &mut futures::future::Pending<()>) {
    never.await
}

impl<E: Entity> Inner<E> {
    /// Copies the producer's counts into the `metrics` facade (feature `metrics`), labelled
    /// with its node, type and id: one producer id, one series per name.
    fn publish_metrics(&self) {
        #[cfg(feature = "metrics")]
        {
            use crate::metrics::{set_counter, set_counters_by};
            let Ok(node) = self.region.node() else { return };
            let s = self.stats();
            let l = vec![
                ("node", node.node_id().to_string()),
                ("type", self.region.type_name().to_string()),
                ("producer", self.producer_id.to_string()),
            ];
            set_counters_by(
                "ddshard_producer_messages_total",
                &l,
                "event",
                &[
                    ("stored", s.stored),
                    ("confirmed", s.confirmed),
                    ("resent", s.resent),
                    ("dead_lettered", s.dead_lettered),
                ],
            );
            set_counter("ddshard_producer_demand_waits_total", &l, s.demand_waits);
            ::metrics::gauge!("ddshard_producer_unconfirmed", &l).set(s.unconfirmed as f64);
            ::metrics::gauge!("ddshard_producer_queued_bytes", &l).set(s.queued_bytes as f64);
            let age = s.oldest_unconfirmed_age.map_or(0.0, |a| a.as_secs_f64());
            ::metrics::gauge!("ddshard_producer_oldest_unconfirmed_seconds", &l).set(age);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::delivery::DeliveryInfo;

    #[test]
    fn delivery_info_says_which_message_and_whether_it_was_sent_before() {
        let h = DeliveryHeader {
            producer: "p".into(),
            stream: 1,
            seq: 4,
            first_unconfirmed: 2,
            redelivery: true,
            nonce: 3,
            epoch: 0,
            made: (0, 0),
        };
        assert_eq!(DeliveryInfo::of(&h), DeliveryInfo { producer_id: "p".into(), seq: 4, redelivery: true });
    }

    fn confirmed() -> Result<DeliveryOutcome> {
        Ok(DeliveryOutcome::Confirmed { handled: true, nonce: 3 })
    }

    #[test]
    fn a_delivery_dropped_unanswered_tells_its_producer_and_one_answered_says_nothing_more() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let until = crate::clock::now() + Duration::from_secs(5);
        drop(OutcomeSink::new(tx.clone(), 4, until));
        let (tag, outcome) = rx.try_recv().expect("a dropped sink reports");
        assert_eq!(tag, 4);
        assert!(matches!(outcome, Err(Error::NotDelivered { .. })));
        OutcomeSink::new(tx, 5, until).send(confirmed());
        assert!(matches!(rx.try_recv(), Ok((5, Ok(DeliveryOutcome::Confirmed { .. })))));
        assert!(rx.try_recv().is_err(), "an answered sink sends once");
    }

    #[test]
    fn a_sink_is_waited_for_until_its_deadline_and_while_its_producer_lives() {
        let (tx, rx) = mpsc::unbounded_channel();
        let now = crate::clock::now();
        let live = OutcomeSink::new(tx.clone(), 1, now + Duration::from_secs(60));
        let past = OutcomeSink::new(tx, 2, now);
        assert!(live.is_waiting());
        assert!(!past.is_waiting(), "the producer timed it out");
        drop(rx);
        assert!(!live.is_waiting(), "its producer is gone");
    }
}
