//! The entity runner. Each running entity has a [`Mailbox`]: a queue and, while it has no work,
//! the entity itself, parked. A task runs the entity only while its queue has work: the region
//! schedules one when a message arrives at an idle entity, the task handles messages one at a
//! time and parks the entity again once the queue is empty. An idle entity therefore costs its
//! own size, a small mailbox and its map entries, not a task and a channel (issue 13: ≈ 3.4 KB
//! each before, so a million idle entities needed ≈ 3.4 GB). The mailbox's invariants are in
//! [`super::mailbox`].
//!
//! Panics are isolated: a panicking handler stops only that incarnation; the messages still
//! queued go to the next one.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::Abortable;
use tokio::sync::mpsc;
use tracing::{Instrument, error};

use super::ShardEvent;
use super::core::StopReason;
use super::mailbox::{EntityCmd, LingerTimer, Mailbox, Scheduled};
use crate::clock::Instant;
use crate::error::Result;
use crate::log_limit::LogLimiter;
use crate::sharding::confirm;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::delivery::{Admission, DeliveryInfo, DeliveryOutcome};
use crate::sharding::envelope::{DeliveryReply, Envelope, OutcomeTo, Replier, ReplyTo, RoutedInFlight, not_delivered};
use crate::sharding::{EndIncarnation, Entity, EntityContext};

/// Creates the entity of an id.
pub(crate) type Factory<E> = Arc<dyn Fn(&str) -> E + Send + Sync>;

/// What every run of a region's entities shares.
pub(crate) struct RunnerShared<E: Entity> {
    pub factory: Factory<E>,
    pub events: mpsc::UnboundedSender<ShardEvent<E>>,
    pub replier: Replier,
    pub type_name: Arc<str>,
    pub counters: Arc<RegionCounterCells>,
    /// `entity_linger`: how long a run waits on an empty queue before it parks its entity.
    pub linger: Duration,
    /// How long an entity's stop hook may run.
    pub stop_timeout: Duration,
    /// Stop hooks that panic or overrun are user code gone wrong, possibly in every entity of
    /// a hand-off at once: one line per kind per period.
    pub stop_log: Mutex<LogLimiter<&'static str>>,
    /// The local handle's routed-path counts: messages it put straight into a mailbox go back
    /// on the routed path, counted, when their incarnation ends before taking them.
    pub routed: Arc<RoutedInFlight>,
    /// Handler times (feature `metrics`; nothing without it).
    pub metrics: Arc<crate::metrics::TypeMetrics>,
}

/// One run of an entity: from the message that found it idle (or new) until its queue is
/// empty, or it ends.
pub(crate) struct EntityRun<E: Entity> {
    pub shared: Arc<RunnerShared<E>>,
    pub mailbox: Arc<Mailbox<E>>,
    pub ctx: EntityContext,
    pub incarnation: u64,
}

impl<E: Entity> EntityRun<E> {
    /// The span calls into the entity run in, so the user's own log lines inside `started`
    /// and `handle` carry the entity's type, id and shard (target `ddshard::entity`, level
    /// info; a filter such as `ddshard::entity=warn` turns it off). Made once per run (a run
    /// takes every queued message), not per message; disabled, it costs one cached interest
    /// check per run.
    fn call_span(&self) -> tracing::Span {
        tracing::info_span!(
            target: "ddshard::entity",
            "entity",
            r#type = %self.shared.type_name,
            id = %self.ctx.entity_id,
            shard = %self.ctx.shard_id
        )
    }

    /// After a handler: no reply to take any more; the reply it took, if it did. A durable
    /// entity's handler that panicked left its reply gate closed: the replies sent meanwhile
    /// give way to the panic (a handler that ended opened the gate itself).
    fn after_handler(
        &mut self,
        outcome: &std::result::Result<Result<E::Reply>, Box<dyn std::any::Any + Send>>,
    ) -> Option<crate::sharding::deferred::ErasedReply> {
        self.ctx.reply_type = None;
        if let Some(gate) = self.ctx.reply_gate.take() {
            let failure = match outcome {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(panic) => Some(format!("entity handler panicked: {}", panic_text(&**panic))),
            };
            gate.open(failure.as_deref());
        }
        self.ctx.taken_reply.take()
    }

    /// Answers the ask the handler ended with `result`: through the reply the handler took
    /// ([`EntityContext::reply_later`]), when it took it, else directly.
    fn answer(
        &self,
        taken: Option<crate::sharding::deferred::ErasedReply>,
        reply: Option<ReplyTo<E>>,
        result: Result<Option<E::Reply>>,
    ) {
        match (taken, reply) {
            (Some(taken), Some(reply)) => {
                let (replier, id) = (self.shared.replier.clone(), self.ctx.entity_id.clone());
                let deliver = Box::new(move |r: Result<E::Reply>| replier.reply::<E>(reply, &id, r.map(Some)));
                crate::sharding::deferred::finish(taken, deliver, result.map(|_| ()));
            }
            (_, reply) => self.respond(reply, result),
        }
    }

    /// Decides on a reliable delivery by the entity's marks: handed back when the entity is to
    /// handle it (the context then says which delivery it is), or when its answer waits for
    /// the marks to settle; otherwise answered here.
    fn admit(&mut self, running: &mut E, d: Box<DeliveryReply>) -> Admitted {
        let (admission, nonce, settle) = match running.delivery_marks() {
            Some(marks) => {
                if let Some(holds) = &self.ctx.confirms.holds {
                    confirm::forget_let_go(holds, marks);
                }
                let admission = marks.admit(&d.header);
                (admission, marks.nonce(), marks.must_settle(&d.header, admission))
            }
            None => {
                let (admission, nonce) = self.mailbox.admit(&d.header);
                (admission, nonce, false)
            }
        };
        let counters = &self.shared.counters;
        let cell = match admission {
            Admission::Handle => &counters.deliveries_handled,
            Admission::Duplicate => &counters.deliveries_duplicate,
            Admission::Gap { .. }
            | Admission::Hello { .. }
            | Admission::Superseded { .. }
            | Admission::Held { .. }
            | Admission::Redirect { .. } => &counters.deliveries_sent_back,
        };
        cell.fetch_add(1, Ordering::Relaxed);
        match admission.answer(nonce) {
            None => {
                self.ctx.delivery = Some(DeliveryInfo::of(&d.header));
                self.ctx.confirms.stream = Some((d.header.producer.clone(), d.header.stream));
                Admitted::Handle(d, nonce)
            }
            Some(outcome) if settle => Admitted::Settle(d, outcome),
            Some(outcome) => {
                let to = match (admission, &self.ctx.confirms.holds) {
                    // The held message sent again: its answer goes to this delivery now.
                    (Admission::Redirect { token, .. }, Some(holds)) => holds.redirect(token, d.to),
                    _ => d.to,
                };
                self.shared.replier.outcome(to, Ok(outcome));
                Admitted::Answered
            }
        }
    }

    /// Settles the entity's marks, then answers a delivery on their word; false when the
    /// incarnation ended with it (its write failed or was fenced).
    async fn settle(&mut self, entity: &mut Option<E>, d: Box<DeliveryReply>, outcome: DeliveryOutcome) -> bool {
        let running = entity.as_mut().expect("a task that took a command holds its entity");
        let settled = running.settle_marks(&mut self.ctx).await;
        self.shared.replier.outcome(d.to, settled.map(|()| outcome));
        self.goes_on(entity)
    }

    /// Answers a handled delivery: confirmed, why its write failed, or nothing yet when the
    /// handler held its confirmation back.
    fn answer_delivery(&mut self, to: OutcomeTo, nonce: u64, result: &Result<E::Reply>) {
        let held = self.ctx.confirms.applied.as_mut().and_then(|a| a.held.take());
        let holds = self.ctx.confirms.holds.clone();
        let outcome = match result {
            Ok(_) => Ok(DeliveryOutcome::Confirmed { handled: true, nonce }),
            Err(e) => Err(not_delivered(&self.ctx.entity_id, e.to_string())),
        };
        match (held, holds) {
            (Some(token), Some(holds)) if result.is_ok() => {
                self.shared.counters.deliveries_held.fetch_add(1, Ordering::Relaxed);
                if let Some(to) = holds.place(token, to) {
                    let reason = "its deferred confirm was dropped";
                    self.shared.replier.outcome(to, Err(not_delivered(&self.ctx.entity_id, reason)));
                }
            }
            (held, holds) => {
                if let (Some(token), Some(holds)) = (held, holds) {
                    holds.forget(token);
                }
                self.shared.replier.outcome(to, outcome);
            }
        }
    }

    /// Answers the confirmations the handler gave (after its write, for a durable entity),
    /// and ends the handler's part in held confirmations.
    fn answer_confirms(&mut self) {
        let applied = self.ctx.confirms.applied.take();
        if let (Some(applied), Some(holds)) = (applied, &self.ctx.confirms.holds) {
            let entity_id = &self.ctx.entity_id;
            holds.kept_by(&self.shared.replier);
            let failed = self.ctx.end.is_some();
            for token in applied.confirmed {
                let outcome = match failed {
                    false => Ok(DeliveryOutcome::Confirmed { handled: true, nonce: applied.nonce }),
                    true => Err(not_delivered(entity_id, "the write that confirmed it failed")),
                };
                holds.answer(token, outcome);
            }
        }
        self.ctx.confirms.clear();
    }

    fn respond(&self, reply: Option<ReplyTo<E>>, result: Result<Option<E::Reply>>) {
        if let Some(r) = reply {
            self.shared.replier.reply::<E>(r, &self.ctx.entity_id, result);
        }
    }

    fn terminated(&self, leftovers: Vec<Envelope<E>>) {
        let _ = self.shared.events.send(ShardEvent::Terminated {
            shard: self.ctx.shard_id.to_string(),
            entity_id: self.ctx.entity_id.to_string(),
            incarnation: self.incarnation,
            leftovers,
        });
    }

    /// Fails every queued message with `reason` and reports the incarnation ended.
    fn fail_queued_and_end(&self, reason: &str) {
        for env in self.mailbox.end_from_task(&self.shared.routed) {
            self.respond(env.reply, Err(not_delivered(&self.ctx.entity_id, reason)));
        }
        self.terminated(Vec::new());
    }

    /// Creates the entity and runs its start hook; `None` when either panicked (the
    /// incarnation has ended then).
    async fn create(&mut self) -> Option<E> {
        let (shared, id) = (self.shared.clone(), self.ctx.entity_id.clone());
        let mut entity = match std::panic::catch_unwind(AssertUnwindSafe(|| (shared.factory)(&id))) {
            Ok(e) => e,
            Err(_) => {
                shared.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                error!(type_name = %shared.type_name, entity_id = %id, "entity factory panicked; failing its messages");
                self.fail_queued_and_end("entity factory panicked");
                return None;
            }
        };
        let span = self.call_span();
        if let Err(panic) = AssertUnwindSafe(entity.started(&self.ctx)).catch_unwind().instrument(span).await {
            shared.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
            let what = panic_text(&*panic);
            error!(type_name = %shared.type_name, entity_id = %id, panic = %what, "entity start hook panicked; entity stopped");
            drop(entity);
            // Its queued messages fail (as after a panicking factory): handing them to a fresh
            // instance would spin if the hook always panics, since no message gets consumed.
            self.fail_queued_and_end(&format!("entity start hook panicked: {what}"));
            return None;
        }
        Some(entity)
    }

    /// Ends the incarnation on a `Stop`: its hook runs, then it is gone before anyone hears it
    /// terminated (the next incarnation may start elsewhere). Nothing is sent after a Stop (the
    /// shard holds the messages of a stopping entity); anything that was goes to the next
    /// incarnation.
    async fn stop(&mut self, entity: Option<E>, reason: StopReason, span: &tracing::Span) {
        if let Some(mut stopping) = entity {
            self.stop_hook(&mut stopping, reason, span).await;
        }
        let leftovers = self.mailbox.end_from_task(&self.shared.routed);
        self.terminated(leftovers);
    }

    /// Runs the entity's stop hook within the stop timeout; a panic or an overrun is counted and
    /// logged (rate-limited), and the stop goes on either way.
    async fn stop_hook(&mut self, entity: &mut E, reason: StopReason, span: &tracing::Span) {
        let hook = AssertUnwindSafe(entity.on_stop(reason, &mut self.ctx)).catch_unwind().instrument(span.clone());
        let (kind, detail) = match tokio::time::timeout(self.shared.stop_timeout, hook).await {
            Ok(Ok(())) => return,
            Ok(Err(panic)) => {
                self.shared.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                ("entity stop hook panicked; the stop goes on", panic_text(&*panic))
            }
            Err(_) => {
                self.shared.counters.stop_hook_overruns.fetch_add(1, Ordering::Relaxed);
                ("entity stop hook overran its bound and was dropped; the stop goes on", String::new())
            }
        };
        let allowed = self.shared.stop_log.lock().unwrap_or_else(|p| p.into_inner()).allow(&kind, Instant::now());
        if let Some(held_back) = allowed {
            error!(type_name = %self.shared.type_name, entity_id = %self.ctx.entity_id, ?reason, bound = ?self.shared.stop_timeout,
                detail = %detail, held_back, "{kind}");
        }
    }

    /// Runs the entity until its queue is empty or it ends; ends early, dropping the entity,
    /// when its mailbox is ended meanwhile.
    pub(crate) fn run(mut self, scheduled: Scheduled<E>) -> impl Future<Output = ()> + Send + 'static {
        let Scheduled { entity, abort, holds } = scheduled;
        self.ctx.confirms.holds = holds;
        Abortable::new(self.run_until_parked(entity), abort).map(drop)
    }

    async fn run_until_parked(mut self, mut entity: Option<E>) {
        // The first run of an incarnation parks as soon as its queue is empty; later runs
        // linger. Most entities started by a message get no other soon (a million devices
        // each asked once), and a lingering first run holds its task's memory meanwhile; an
        // entity that does get more is woken by a new run and lingers from then on.
        let mut linger = self.shared.linger;
        if entity.is_none() {
            linger = Duration::ZERO;
            // Boxed: a cold path, kept out of the task every run allocates.
            entity = Box::pin(self.create()).await;
            if entity.is_none() {
                return;
            }
        }
        let span = self.call_span();
        let mut took = false;
        let mut timer = LingerTimer::default();
        loop {
            let next =
                std::future::poll_fn(|cx| self.mailbox.poll_next(cx, &mut entity, linger, &mut took, &mut timer));
            let Some(cmd) = next.await else { return };
            let env = match cmd {
                EntityCmd::Stop(reason) => {
                    Box::pin(self.stop(entity.take(), reason, &span)).await;
                    return;
                }
                EntityCmd::Msg(env) => env,
            };
            let Some(msg) = env.msg else {
                self.respond(env.reply, Ok(None));
                continue;
            };
            // The handler is awaited here, not in a helper's future: the task's size is what a
            // run allocates, and each async frame adds its arguments and locals to it.
            let (reply, delivery) = match self.before_handler(&mut entity, env.reply) {
                Before::Handle { reply, delivery } => (reply, delivery),
                Before::Settle(d, outcome) => match Box::pin(self.settle(&mut entity, d, outcome)).await {
                    true => continue,
                    false => return,
                },
                Before::Answered => continue,
            };
            let running = entity.as_mut().expect("a task that took a command holds its entity");
            let started = crate::metrics::start_handler_timer();
            self.ctx.reply_type = reply.is_some().then(std::any::TypeId::of::<E::Reply>);
            // In the run's span, entered for each poll: not a clone of it per message (with a
            // subscriber that keeps spans, a clone and a drop are a reference count each).
            let outcome = {
                let mut handler =
                    std::pin::pin!(AssertUnwindSafe(running.handle_or_fail(msg, &mut self.ctx)).catch_unwind());
                std::future::poll_fn(|cx| span.in_scope(|| handler.as_mut().poll(cx))).await
            };
            self.shared.metrics.handled(started);
            if !self.after_handler_ran(&mut entity, outcome, reply, delivery) {
                return;
            }
        }
    }

    /// Before a message's handler runs: a reliable delivery first passes the entity's marks,
    /// which may answer it here or settle them first.
    fn before_handler(&mut self, entity: &mut Option<E>, reply: Option<ReplyTo<E>>) -> Before<E> {
        let (reply, delivery) = match reply {
            Some(ReplyTo::Delivery(d)) => (None, Some(d)),
            reply => (reply, None),
        };
        let Some(d) = delivery else { return Before::Handle { reply, delivery: None } };
        let running = entity.as_mut().expect("a task that took a command holds its entity");
        match self.admit(running, d) {
            Admitted::Handle(d, nonce) => Before::Handle { reply, delivery: Some((d, nonce)) },
            Admitted::Settle(d, outcome) => Before::Settle(d, outcome),
            Admitted::Answered => Before::Answered,
        }
    }

    /// After a message's handler ran (to `outcome`): answers it; false when the incarnation
    /// ended with it (a panic, a failed or fenced state write).
    fn after_handler_ran(
        &mut self,
        entity: &mut Option<E>,
        outcome: std::result::Result<Result<E::Reply>, Box<dyn std::any::Any + Send>>,
        reply: Option<ReplyTo<E>>,
        delivery: Option<(Box<DeliveryReply>, u64)>,
    ) -> bool {
        let running = entity.as_mut().expect("a task that took a command holds its entity");
        // A durable entity applied its handler's holds before its write.
        if outcome.is_ok() && (self.ctx.confirms.to_apply() || self.ctx.confirms.applied.is_some()) {
            let seq = self.ctx.delivery.as_ref().map(|d| d.seq);
            let plain = running.delivery_marks().is_none();
            self.mailbox.apply_confirms(&mut self.ctx.confirms, seq, plain);
        }
        self.ctx.delivery = None;
        let taken = self.after_handler(&outcome);
        match outcome {
            Ok(result) => {
                match delivery {
                    Some((d, nonce)) => self.answer_delivery(d.to, nonce, &result),
                    None => self.answer(taken, reply, result.map(Some)),
                }
                self.answer_confirms();
            }
            Err(panic) => {
                let id = self.ctx.entity_id.clone();
                self.ctx.confirms.clear();
                self.shared.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                let what = panic_text(&*panic);
                drop(entity.take());
                error!(type_name = %self.shared.type_name, entity_id = %id, panic = %what, "entity handler panicked; entity stopped");
                let reason = format!("entity handler panicked: {what}");
                match delivery {
                    Some((d, _)) => self.shared.replier.outcome(d.to, Ok(DeliveryOutcome::Panicked { reason })),
                    None => self.answer(taken, reply, Err(not_delivered(&id, reason))),
                }
                // Messages still queued go to a fresh instance.
                let leftovers = self.mailbox.end_from_task(&self.shared.routed);
                self.terminated(leftovers);
                return false;
            }
        }
        if !self.goes_on(entity) {
            return false;
        }
        if std::mem::take(&mut self.ctx.passivate) {
            let _ = self.shared.events.send(ShardEvent::Passivate {
                shard: self.ctx.shard_id.to_string(),
                entity_id: self.ctx.entity_id.to_string(),
                incarnation: self.incarnation,
            });
        }
        true
    }

    /// Ends the incarnation when its last write asked to (failed: restart from the stored
    /// state; fenced: stop); true when it goes on.
    fn goes_on(&mut self, entity: &mut Option<E>) -> bool {
        match self.ctx.end.take() {
            None => true,
            Some(EndIncarnation::Restart) => {
                // A durable entity whose state write failed: the next incarnation starts
                // from the stored state and takes the messages queued for this one.
                drop(entity.take());
                let leftovers = self.mailbox.end_from_task(&self.shared.routed);
                self.terminated(leftovers);
                false
            }
            Some(EndIncarnation::Fenced { fence }) => {
                // A newer allocation owns the shard's state: nothing here may run it.
                drop(entity.take());
                let _ = self.shared.events.send(ShardEvent::Fenced {
                    shard: self.ctx.shard_id.to_string(),
                    epoch: self.ctx.epoch,
                    fence,
                });
                self.fail_queued_and_end("a newer allocation of its shard claimed its state");
                false
            }
        }
    }
}

/// What a run does with a message before its handler ([`EntityRun::before_handler`]).
enum Before<E: Entity> {
    /// Runs the handler: the ask or tell to answer, or the reliable delivery and its nonce.
    Handle { reply: Option<ReplyTo<E>>, delivery: Option<(Box<DeliveryReply>, u64)> },
    /// Answers the delivery once the entity's marks settled.
    Settle(Box<DeliveryReply>, DeliveryOutcome),
    /// Answered already.
    Answered,
}

/// What an entity does with a reliable delivery ([`EntityRun::admit`]).
enum Admitted {
    /// Handles it, and answers it confirmed with this incarnation's nonce once handled.
    Handle(Box<DeliveryReply>, u64),
    /// Answers it so once its marks settled.
    Settle(Box<DeliveryReply>, DeliveryOutcome),
    /// Answered already.
    Answered,
}

/// The message of a caught panic, if it carried one.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::sharding::shard::mailbox::Pushed;

    /// The task an entity run is spawned as, for an entity and message of 8 bytes each, is at
    /// most this large: every entity started (by a first message, or again after it parked)
    /// allocates one, and glibc's malloc keeps much of that memory once it is freed (the
    /// `idle_entities` bench: about a task's size per entity started under concurrency).
    const RUN_TASK_BOUND: usize = 1_100;

    /// An entity of 8 bytes that counts what it handled.
    struct Small(Arc<AtomicUsize>);

    impl Entity for Small {
        type Message = u64;
        type Reply = u64;
        async fn handle(&mut self, msg: u64, _: &mut EntityContext) -> u64 {
            self.0.fetch_add(1, Ordering::SeqCst);
            msg
        }
    }

    /// What runs of `Small` entities share (a transport on port 0 behind the replier), the
    /// count its entities bump, and the token that stops the transport.
    async fn small_runner(
        linger: Duration,
    ) -> (Arc<RunnerShared<Small>>, Arc<AtomicUsize>, tokio_util::sync::CancellationToken) {
        use crate::config::TransportSettings;
        use crate::membership::{MembershipSnapshot, UniqueAddress};
        use crate::transport::Transport;
        let shutdown = tokio_util::sync::CancellationToken::new();
        let local = UniqueAddress::new("n1", 1);
        let settings = TransportSettings::default();
        let transport = Transport::bind(
            "127.0.0.1:0".parse().unwrap(),
            local.clone(),
            "c".into(),
            None,
            settings,
            shutdown.clone(),
        )
        .await
        .unwrap();
        let (_, members) =
            tokio::sync::watch::channel(Arc::new(MembershipSnapshot { self_address: local, members: Vec::new() }));
        let handled = Arc::new(AtomicUsize::new(0));
        let count = handled.clone();
        let shared = Arc::new(RunnerShared::<Small> {
            factory: Arc::new(move |_: &str| Small(count.clone())),
            events: mpsc::unbounded_channel().0,
            replier: Replier::new(transport, "small", members),
            type_name: "small".into(),
            counters: Arc::default(),
            linger,
            stop_timeout: Duration::from_secs(1),
            stop_log: Mutex::new(LogLimiter::new(Duration::from_secs(10))),
            routed: RoutedInFlight::new(),
            metrics: Arc::new(crate::metrics::TypeMetrics::new("n1", "small")),
        });
        (shared, handled, shutdown)
    }

    fn small_run(shared: &Arc<RunnerShared<Small>>, mailbox: &Arc<Mailbox<Small>>) -> EntityRun<Small> {
        let ctx = EntityContext::new("e1".into(), "s1".into(), 1, None);
        EntityRun { shared: shared.clone(), mailbox: mailbox.clone(), ctx, incarnation: 1 }
    }

    #[tokio::test]
    async fn a_run_of_a_small_entity_is_a_small_task_with_cold_paths_boxed_and_no_frame_held_twice() {
        let (shared, _, shutdown) = small_runner(Duration::from_millis(100)).await;
        let mailbox = Arc::new(Mailbox::<Small>::new());
        let scheduled = mailbox.schedule_new().expect("a new mailbox schedules its first run");
        let run = small_run(&shared, &mailbox).run(scheduled);
        let size = std::mem::size_of_val(&run);
        assert!(size <= RUN_TASK_BOUND, "a run of an 8-byte entity is {size} B, more than {RUN_TASK_BOUND} B");
        shutdown.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn the_run_that_creates_an_entity_parks_it_once_its_queue_is_empty_and_later_runs_linger() {
        let linger = Duration::from_millis(100);
        let (shared, handled, shutdown) = small_runner(linger).await;
        let mailbox = Arc::new(Mailbox::<Small>::new());
        let push = |n: u64| match mailbox.push(EntityCmd::Msg(Envelope::new(Some(n), None)), 10) {
            Pushed::Schedule(s) => s,
            _ => panic!("expected a new run"),
        };
        let t0 = tokio::time::Instant::now();
        // The first message is an ask: its answer comes from the run, after the handler.
        let (tx, answer) = tokio::sync::oneshot::channel();
        let first = match mailbox.push(EntityCmd::Msg(Envelope::new(Some(1), Some(ReplyTo::Local(tx)))), 10) {
            Pushed::Schedule(s) => tokio::spawn(small_run(&shared, &mailbox).run(s)),
            _ => panic!("expected a new run"),
        };
        first.await.unwrap();
        assert_eq!(handled.load(Ordering::SeqCst), 1);
        assert_eq!(answer.await.unwrap().unwrap(), 1, "the ask was answered with the handler's reply");
        assert_eq!(tokio::time::Instant::now(), t0, "the first run parked without waiting for a message");
        let second = push(2);
        assert!(second.entity.is_some(), "the mailbox held the parked entity");
        let second = tokio::spawn(small_run(&shared, &mailbox).run(second));
        tokio::time::sleep(linger / 2).await;
        assert_eq!(handled.load(Ordering::SeqCst), 2);
        assert!(!second.is_finished(), "a later run lingers for the next message");
        assert!(matches!(mailbox.push(EntityCmd::Msg(Envelope::new(Some(3), None)), 10), Pushed::Queued));
        tokio::time::timeout(linger * 3, second).await.expect("parked once idle for its linger").unwrap();
        assert_eq!(handled.load(Ordering::SeqCst), 3, "the lingering run took the third message");
        shutdown.cancel();
    }
}
