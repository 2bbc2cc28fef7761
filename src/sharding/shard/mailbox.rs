//! An entity's mailbox: its queue and, while it has no work, the entity itself, parked. The
//! region pushes messages here; the task that runs the entity ([`super::entity`]) takes them.
//!
//! Invariants, each held under the mailbox lock:
//! - at most one task runs an entity (the region schedules one only when it takes the entity
//!   out of `Parked`, or creates it from `New`, and marks the mailbox `Running`);
//! - a task parks the entity only when the queue is empty, so a message pushed while it runs
//!   is handled by it, and one pushed after it parked schedules a new task: nothing is left
//!   in a queue without a task to handle it, and messages are handled in the order pushed;
//! - an `Ended` mailbox takes nothing: what the region sends then is redelivered to the next
//!   incarnation after its `Terminated` event.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::future::{AbortHandle, AbortRegistration};
use tokio::time::Sleep;

use super::core::StopReason;
use crate::sharding::Entity;
use crate::sharding::confirm::{self, HandlerConfirms, Holds};
use crate::sharding::delivery::{Admission, ConsumerMarks, DeliveryHeader};
use crate::sharding::envelope::{Envelope, RoutedInFlight};

/// What the region sends an entity.
pub(crate) enum EntityCmd<E: Entity> {
    Msg(Envelope<E>),
    /// End the incarnation after its stop hook, told why.
    Stop(StopReason),
}

/// Where the entity of a mailbox is.
enum Phase<E> {
    /// Not created yet: the first task creates it and runs its start hook.
    New,
    /// Between messages: no task runs it.
    Parked(E),
    /// A task holds and runs it; the handle aborts that task. (Not tokio's `JoinHandle` or
    /// `AbortHandle`: either keeps the finished task's memory, about 1 KB, allocated for as
    /// long as it is held.)
    Running(AbortHandle),
    /// Stopped, panicked or aborted: the mailbox takes nothing more.
    Ended,
}

struct MailboxInner<E: Entity> {
    queue: VecDeque<EntityCmd<E>>,
    phase: Phase<E>,
    /// The running task while it lingers on an empty queue: the next push wakes it.
    waiter: Option<Waker>,
    /// Reliable deliveries' state for the life of the incarnation; made by its first delivery
    /// (one pointer for an entity that never had one).
    deliveries: Option<Box<Deliveries>>,
}

/// What an incarnation keeps of reliable deliveries besides its entity.
#[derive(Default)]
struct Deliveries {
    /// A plain entity's marks (a durable entity keeps its own, stored with its state).
    marks: Option<ConsumerMarks>,
    /// Its held confirmations, once it held one.
    holds: Option<Arc<Holds>>,
}

impl<E: Entity> MailboxInner<E> {
    /// The incarnation's held confirmations, if it held one.
    fn holds(&self) -> Option<Arc<Holds>> {
        self.deliveries.as_ref().and_then(|d| d.holds.clone())
    }

    /// Ends the incarnation's holds: returns them, to be ended outside the lock.
    fn take_holds(&mut self) -> Option<Arc<Holds>> {
        self.deliveries.as_mut().and_then(|d| d.holds.take())
    }
}

impl<E: Entity> MailboxInner<E> {
    /// Messages queued (a `Stop`, at most one and always last, is not one).
    fn messages_queued(&self) -> usize {
        self.queue.len() - usize::from(matches!(self.queue.back(), Some(EntityCmd::Stop(_))))
    }
}

/// One entity's queue and, while it is idle, the entity.
pub(crate) struct Mailbox<E: Entity> {
    inner: Mutex<MailboxInner<E>>,
}

/// What [`Mailbox::push`] did with a message.
pub(crate) enum Pushed<E: Entity> {
    /// Queued for the task that runs the entity.
    Queued,
    /// Queued; no task runs the entity: run `Scheduled` on a new task.
    Schedule(Scheduled<E>),
    /// The queue holds `capacity` messages already: refused.
    Full(Envelope<E>),
    /// The incarnation ended: the message waits for the next one.
    Ended(Envelope<E>),
}

/// A run of an entity, taken out of its mailbox by the region: the entity (or nothing, when the
/// task must create it) for the task to own until it parks.
pub(crate) struct Scheduled<E> {
    pub(super) entity: Option<E>,
    pub(super) abort: AbortRegistration,
    /// The incarnation's held confirmations, if it held one.
    pub(super) holds: Option<Arc<Holds>>,
}

/// Marks `phase` running and returns what the new run owns, with the entity it took out.
fn start_run<E: Entity>(m: &mut MailboxInner<E>) -> Option<Scheduled<E>> {
    if !matches!(m.phase, Phase::New | Phase::Parked(_)) {
        return None;
    }
    let (handle, abort) = AbortHandle::new_pair();
    let holds = m.holds();
    match std::mem::replace(&mut m.phase, Phase::Running(handle)) {
        Phase::Parked(e) => Some(Scheduled { entity: Some(e), abort, holds }),
        _ => Some(Scheduled { entity: None, abort, holds }),
    }
}

impl<E: Entity> Mailbox<E> {
    pub(crate) fn new() -> Self {
        Mailbox {
            inner: Mutex::new(MailboxInner {
                queue: VecDeque::new(),
                phase: Phase::New,
                waiter: None,
                deliveries: None,
            }),
        }
    }

    /// The lock; a poisoned one is still consistent (no code panics while holding it).
    fn lock(&self) -> MutexGuard<'_, MailboxInner<E>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `cmd` (a message is refused past `capacity` queued messages; `Stop` never is).
    pub(crate) fn push(&self, cmd: EntityCmd<E>, capacity: usize) -> Pushed<E> {
        let mut m = self.lock();
        match cmd {
            EntityCmd::Msg(env) if matches!(m.phase, Phase::Ended) => return Pushed::Ended(env),
            EntityCmd::Msg(env) if m.messages_queued() >= capacity => return Pushed::Full(env),
            EntityCmd::Stop(_) if matches!(m.phase, Phase::Ended) => return Pushed::Queued,
            cmd => m.queue.push_back(cmd),
        }
        match start_run(&mut m) {
            Some(scheduled) => Pushed::Schedule(scheduled),
            None => {
                let waiter = m.waiter.take();
                drop(m);
                if let Some(task) = waiter {
                    task.wake();
                }
                Pushed::Queued
            }
        }
    }

    /// What a plain entity does with a reliable delivery, by the marks of its incarnation
    /// (which first let go the holds let go since).
    pub(super) fn admit(&self, header: &DeliveryHeader) -> (Admission, u64) {
        let mut m = self.lock();
        let d = m.deliveries.get_or_insert_with(Box::default);
        let marks = d.marks.get_or_insert_with(|| ConsumerMarks::new(rand::random()));
        if let Some(holds) = &d.holds {
            confirm::forget_let_go(holds, marks);
        }
        (marks.admit(header), marks.nonce())
    }

    /// Keeps the holds a handler made for the incarnation, and applies what a plain entity's
    /// handler did with holds to its marks (a durable entity's applied them before its write).
    pub(super) fn apply_confirms(&self, confirms: &mut HandlerConfirms, seq: Option<u64>, plain: bool) {
        let mut m = self.lock();
        let d = m.deliveries.get_or_insert_with(Box::default);
        if d.holds.is_none() {
            d.holds.clone_from(&confirms.holds);
        }
        if plain && confirms.to_apply() {
            let marks = d.marks.get_or_insert_with(|| ConsumerMarks::new(rand::random()));
            confirm::apply(confirms, seq, marks);
        }
    }

    /// Schedules the first run of a new incarnation (its start hook runs without waiting for a
    /// message).
    pub(crate) fn schedule_new(&self) -> Option<Scheduled<E>> {
        let mut m = self.lock();
        if !matches!(m.phase, Phase::New) {
            return None;
        }
        start_run(&mut m)
    }

    /// Ends the mailbox at once (hand-off timeout, shard stop): the parked entity, if any, is
    /// dropped here; a running task is aborted and drops its own at its next await. Returns
    /// the messages still queued.
    pub(crate) fn end(&self) -> Vec<Envelope<E>> {
        let (previous, queued, holds) = {
            let mut m = self.lock();
            let previous = std::mem::replace(&mut m.phase, Phase::Ended);
            (previous, std::mem::take(&mut m.queue), m.take_holds())
        };
        // Outside the lock: an entity's Drop is user code.
        if let Phase::Running(task) = &previous {
            task.abort();
        }
        drop(previous);
        if let Some(holds) = holds {
            holds.end();
        }
        messages(queued)
    }

    /// Messages queued and not yet taken by the entity.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.lock().messages_queued()
    }

    /// The queue's buffer capacity (released when the entity parks).
    #[cfg(test)]
    fn queue_capacity(&self) -> usize {
        self.lock().queue.capacity()
    }

    /// The next command for the running task, or `None` once the entity is parked (the queue
    /// was empty) or dropped (the mailbox was ended meanwhile): `poll_next` without lingering.
    #[cfg(test)]
    fn next_or_park(&self, entity: &mut Option<E>) -> Option<EntityCmd<E>> {
        let mut m = self.lock();
        if matches!(m.phase, Phase::Ended) {
            drop(m);
            drop(entity.take());
            return None;
        }
        if let Some(cmd) = m.queue.pop_front() {
            return Some(cmd);
        }
        park(&mut m, entity);
        None
    }

    /// The next command for the running task; with the queue empty the task *lingers*: it keeps
    /// its entity and waits, woken by the next push, until its linger timer (`timer`, made at
    /// its first wait: a run that never waits has none) fires with no command taken since it
    /// was set (`took` says whether one was). Then it parks the entity and gets `None`, as it
    /// does once the mailbox is ended. A timer that fires after commands were taken is set
    /// again, `linger` from then: an entity parks after between `linger` and twice that
    /// without a message, and the clock is read once per linger period, not once per message.
    /// The timer is looked at outside the lock, which a push waits for.
    pub(super) fn poll_next(
        &self,
        cx: &mut Context<'_>,
        entity: &mut Option<E>,
        linger: Duration,
        took: &mut bool,
        timer: &mut LingerTimer,
    ) -> Poll<Option<EntityCmd<E>>> {
        let mut m = self.lock();
        if let Some(next) = take_next(&mut m, took) {
            return hand_over(m, entity, next);
        }
        // Waiting: registered before the lock goes, so a push from then on wakes this task.
        if !m.waiter.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            m.waiter = Some(cx.waker().clone());
        }
        drop(m);
        let expired = linger.is_zero()
            || timer.fired(cx, linger) && {
                let idle = !std::mem::take(took);
                if !idle {
                    timer.rearm(cx, linger);
                }
                idle
            };
        if !expired {
            return Poll::Pending;
        }
        let mut m = self.lock();
        if let Some(next) = take_next(&mut m, took) {
            return hand_over(m, entity, next);
        }
        park(&mut m, entity);
        Poll::Ready(None)
    }

    /// Ends the incarnation from its task; returns the messages it had not handled, those the
    /// local handle put here directly counted back on its routed path (`gate`) before the lock
    /// is released, so none of its later messages to the entity can overtake them.
    pub(super) fn end_from_task(&self, gate: &Arc<RoutedInFlight>) -> Vec<Envelope<E>> {
        let mut m = self.lock();
        m.phase = Phase::Ended;
        m.waiter = None;
        let mut leftovers = messages(std::mem::take(&mut m.queue));
        for env in &mut leftovers {
            env.back_on_routed_path(gate);
        }
        let holds = m.take_holds();
        drop(m);
        if let Some(holds) = holds {
            holds.end();
        }
        leftovers
    }
}

/// A run's linger timer ([`Mailbox::poll_next`]), made at its first wait. A lingering task
/// checks it after every message; it is polled (which registers the task's waker with the
/// runtime's timer, under the task's coop budget) only when it was not yet polled with this
/// task's waker, and otherwise just read, since that registration wakes the task when it fires.
#[derive(Default)]
pub(super) struct LingerTimer {
    sleep: Option<Pin<Box<Sleep>>>,
    /// The waker the timer was last polled with.
    polled_with: Option<Waker>,
}

impl LingerTimer {
    /// Whether the timer fired; armed `linger` from now at the first call.
    fn fired(&mut self, cx: &mut Context<'_>, linger: Duration) -> bool {
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(linger)));
        if self.polled_with.as_ref().is_some_and(|w| w.will_wake(cx.waker())) && !sleep.is_elapsed() {
            return false;
        }
        self.polled_with = Some(cx.waker().clone());
        sleep.as_mut().poll(cx).is_ready()
    }

    /// Sets the timer again, `linger` from now, and registers the task with it.
    fn rearm(&mut self, cx: &mut Context<'_>, linger: Duration) {
        if let Some(sleep) = &mut self.sleep {
            sleep.as_mut().reset(tokio::time::Instant::now() + linger);
            self.polled_with = Some(cx.waker().clone());
            let _ = sleep.as_mut().poll(cx);
        }
    }
}

/// What a running task gets next without waiting: `None` inside when the mailbox was ended (the
/// task then drops its entity, outside the lock: its `Drop` is user code; see [`hand_over`]),
/// the next command (noted in `took`), or nothing with the queue empty.
fn take_next<E: Entity>(m: &mut MailboxInner<E>, took: &mut bool) -> Option<Option<EntityCmd<E>>> {
    if matches!(m.phase, Phase::Ended) {
        return Some(None);
    }
    let cmd = m.queue.pop_front()?;
    *took = true;
    m.waiter = None;
    Some(Some(cmd))
}

/// Gives the task what [`take_next`] found, once the lock is released (an ended mailbox's entity
/// is dropped outside it).
fn hand_over<E: Entity>(
    m: MutexGuard<'_, MailboxInner<E>>,
    entity: &mut Option<E>,
    next: Option<EntityCmd<E>>,
) -> Poll<Option<EntityCmd<E>>> {
    drop(m);
    if next.is_none() {
        drop(entity.take());
    }
    Poll::Ready(next)
}

/// Parks the task's entity (if it still holds it) in the mailbox; the task ends next.
fn park<E: Entity>(m: &mut MailboxInner<E>, entity: &mut Option<E>) {
    if let Some(e) = entity.take() {
        m.phase = Phase::Parked(e);
    }
    m.waiter = None;
    // A parked entity keeps no queue buffer: an emptied VecDeque keeps its capacity (at least
    // four envelopes, ≈ 300 B), which an idle entity would carry for good.
    m.queue = VecDeque::new();
}

/// The messages among queued commands (a stop is not one).
fn messages<E: Entity>(queued: VecDeque<EntityCmd<E>>) -> Vec<Envelope<E>> {
    queued
        .into_iter()
        .filter_map(|c| match c {
            EntityCmd::Msg(env) => Some(env),
            EntityCmd::Stop(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::future::Abortable;

    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::sharding::EntityContext;

    /// Counts its drops, to see where an entity is dropped.
    struct Probe(Arc<AtomicUsize>);

    impl Drop for Probe {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[derive(Serialize, Deserialize)]
    struct Ping(u32);

    impl Entity for Probe {
        type Message = Ping;
        type Reply = u32;
        async fn handle(&mut self, msg: Ping, _ctx: &mut EntityContext) -> u32 {
            msg.0
        }
    }

    fn msg(n: u32) -> EntityCmd<Probe> {
        EntityCmd::Msg(Envelope::new(Some(Ping(n)), None))
    }

    fn scheduled(p: Pushed<Probe>) -> Scheduled<Probe> {
        match p {
            Pushed::Schedule(s) => s,
            _ => panic!("expected a new run"),
        }
    }

    fn next(m: &Mailbox<Probe>, entity: &mut Option<Probe>) -> Option<u32> {
        match m.next_or_park(entity) {
            Some(EntityCmd::Msg(env)) => env.msg.map(|p| p.0),
            Some(EntityCmd::Stop(_)) => Some(u32::MAX),
            None => None,
        }
    }

    #[test]
    fn a_message_to_a_running_entity_is_queued_for_its_task_and_one_to_a_parked_entity_starts_a_run_with_it() {
        let drops = Arc::new(AtomicUsize::new(0));
        let m = Mailbox::<Probe>::new();
        let first = m.schedule_new().expect("a new mailbox runs its start hook at once");
        assert!(first.entity.is_none(), "the first run creates the entity");
        assert!(m.schedule_new().is_none(), "never two runs");
        // While the first run holds the entity, messages queue for it: no second task.
        assert!(matches!(m.push(msg(1), 10), Pushed::Queued));
        assert!(matches!(m.push(msg(2), 10), Pushed::Queued));
        let mut entity = Some(Probe(drops.clone()));
        assert_eq!(next(&m, &mut entity), Some(1));
        assert_eq!(next(&m, &mut entity), Some(2));
        // Empty queue: the run parks the entity (it is not dropped).
        assert_eq!(next(&m, &mut entity), None);
        assert!(entity.is_none() && drops.load(Ordering::SeqCst) == 0, "parked, not dropped");
        assert_eq!(m.queued(), 0);
        assert_eq!(m.queue_capacity(), 0, "a parked entity keeps no queue buffer");
        // The next message schedules a run that owns the same instance.
        let run = scheduled(m.push(msg(3), 10));
        assert!(run.entity.is_some(), "the parked instance goes to the new run");
        assert!(matches!(m.push(msg(4), 10), Pushed::Queued), "one run at a time");
        let mut entity = run.entity;
        assert_eq!(next(&m, &mut entity), Some(3));
        assert_eq!(next(&m, &mut entity), Some(4));
        assert_eq!(next(&m, &mut entity), None);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_task_lingers_its_linger_after_each_message_then_parks_its_entity() {
        let m = Arc::new(Mailbox::<Probe>::new());
        let _run = m.schedule_new();
        let linger = Duration::from_millis(100);
        let taken = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (m, taken_count) = (m.clone(), taken.clone());
            async move {
                let mut entity = Some(Probe(Arc::default()));
                let (mut took, mut timer) = (false, LingerTimer::default());
                let mut taken = Vec::new();
                while let Some(cmd) =
                    std::future::poll_fn(|cx| m.poll_next(cx, &mut entity, linger, &mut took, &mut timer)).await
                {
                    if let EntityCmd::Msg(env) = cmd {
                        taken.extend(env.msg.map(|p| p.0));
                        taken_count.fetch_add(1, Ordering::SeqCst);
                    }
                }
                (taken, entity.is_none(), tokio::time::Instant::now())
            }
        });
        let t0 = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!task.is_finished(), "idle for less than its linger: still running");
        assert!(matches!(m.push(msg(1), 10), Pushed::Queued), "the lingering task takes it, no new run");
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(taken.load(Ordering::SeqCst), 1, "the push woke the lingering task");
        // Idle again from 60 ms: the first timer (100 ms) must not park it, the linger after
        // the message must.
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!task.is_finished(), "80 ms after its last message: still running");
        let (taken, parked, at) =
            tokio::time::timeout(Duration::from_secs(5), task).await.expect("parked once idle for its linger").unwrap();
        assert_eq!((taken, parked), (vec![1], true));
        // The timer set at the start fired at 100 ms with a message taken since: set again, it
        // parks the entity at 200 ms, between one and two lingers after the message (60 ms).
        assert_eq!(at - t0, Duration::from_millis(200), "parked by the timer set again when the first fired");
        assert!(scheduled(m.push(msg(2), 10)).entity.is_some(), "the mailbox holds the parked entity");
    }

    #[test]
    fn a_stop_reaches_a_parked_entity_through_a_new_run_and_a_running_one_through_its_queue() {
        let m = Mailbox::<Probe>::new();
        let _first = m.schedule_new();
        let mut entity = Some(Probe(Arc::default()));
        assert!(
            matches!(m.push(EntityCmd::Stop(StopReason::Passivated), 10), Pushed::Queued),
            "running: queued for its task"
        );
        assert_eq!(next(&m, &mut entity), Some(u32::MAX), "the task takes the stop");
        let m = Mailbox::<Probe>::new();
        let _first = m.schedule_new();
        let mut entity = Some(Probe(Arc::default()));
        assert_eq!(next(&m, &mut entity), None, "parked");
        let run = scheduled(m.push(EntityCmd::Stop(StopReason::Passivated), 10));
        let mut entity = run.entity;
        assert!(entity.is_some(), "the new run owns the parked instance, to drop it");
        assert_eq!(next(&m, &mut entity), Some(u32::MAX));
    }

    #[test]
    fn a_full_queue_refuses_messages_but_never_a_stop() {
        let m = Mailbox::<Probe>::new();
        let _run = m.schedule_new();
        assert!(matches!(m.push(msg(1), 2), Pushed::Queued));
        assert!(matches!(m.push(msg(2), 2), Pushed::Queued));
        assert!(matches!(m.push(msg(3), 2), Pushed::Full(_)), "the capacity counts queued messages");
        assert!(
            matches!(m.push(EntityCmd::Stop(StopReason::Passivated), 2), Pushed::Queued),
            "a stop is never refused"
        );
        assert_eq!(m.queued(), 2, "a stop is not a message");
        let mut entity = Some(Probe(Arc::default()));
        assert_eq!(next(&m, &mut entity), Some(1));
        assert!(matches!(m.push(msg(5), 2), Pushed::Queued), "room again once one is taken");
    }

    #[test]
    fn ending_a_mailbox_drops_a_parked_entity_at_once_returns_its_queue_and_refuses_later_messages() {
        let drops = Arc::new(AtomicUsize::new(0));
        let m = Mailbox::<Probe>::new();
        let _run = m.schedule_new();
        let mut entity = Some(Probe(drops.clone()));
        assert_eq!(next(&m, &mut entity), None, "parked");
        assert_eq!(m.end().len(), 0);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "a parked entity is dropped by end() itself");
        assert!(matches!(m.push(msg(1), 10), Pushed::Ended(_)), "an ended mailbox takes nothing");
        assert!(
            matches!(m.push(EntityCmd::Stop(StopReason::Passivated), 10), Pushed::Queued),
            "a stop to it does nothing"
        );
        assert_eq!(m.queued(), 0);
        assert_eq!(m.queue_capacity(), 0, "not even queued");

        // Running: end() aborts the run; the run drops its entity at its next check.
        let drops = Arc::new(AtomicUsize::new(0));
        let m = Mailbox::<Probe>::new();
        let run = m.schedule_new().expect("run");
        assert!(matches!(m.push(msg(1), 10), Pushed::Queued));
        assert!(matches!(m.push(msg(2), 10), Pushed::Queued));
        let queued = m.end();
        assert_eq!(queued.len(), 2, "the messages not taken are returned, to be failed");
        let aborted = futures::executor::block_on(Abortable::new(std::future::pending::<()>(), run.abort));
        assert!(aborted.is_err(), "the running task is aborted");
        let mut entity = Some(Probe(drops.clone()));
        assert_eq!(next(&m, &mut entity), None);
        assert!(entity.is_none() && drops.load(Ordering::SeqCst) == 1, "dropped, not parked");
    }

    #[test]
    fn a_task_that_ends_its_incarnation_takes_the_queue_with_it_and_later_messages_wait_for_the_next() {
        let m = Mailbox::<Probe>::new();
        let _run = m.schedule_new();
        assert!(matches!(m.push(msg(1), 10), Pushed::Queued));
        assert!(matches!(m.push(msg(2), 10), Pushed::Queued));
        let gate = RoutedInFlight::new();
        let stripe = RoutedInFlight::stripe("e");
        let mut direct = Envelope::new(Some(Ping(3)), None);
        direct.lane = crate::sharding::envelope::Lane::Direct(stripe);
        assert!(matches!(m.push(EntityCmd::Msg(direct), 10), Pushed::Queued));
        let leftovers = m.end_from_task(&gate);
        assert_eq!(leftovers.len(), 3);
        assert_eq!(gate.count(stripe), 1, "the direct message is counted on the routed path again");
        drop(leftovers);
        assert_eq!(gate.count(stripe), 0, "until it is dropped");
        assert!(matches!(m.push(msg(4), 10), Pushed::Ended(_)));
    }
}
