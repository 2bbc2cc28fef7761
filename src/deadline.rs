//! Ask timeouts by a deadline sweep instead of a runtime timer per ask.
//!
//! Every ask waits for its answer up to a timeout. With `tokio::time::timeout`, each ask
//! registers an entry in the runtime's timer wheel and removes it again when the answer comes,
//! under the timer driver's lock, and reads the clock: a large share of a local ask's cost
//! (see the CHANGELOG's `local_paths` figures). Here an ask that is not answered on its
//! first poll files its waker under its deadline, rounded up to a [`RESOLUTION`] tick, in one of
//! several striped lists (a thread keeps its stripe, so askers on different threads rarely meet
//! on a lock); an answered ask unlinks itself in O(1). One sweeper task per node sleeps until the
//! earliest tick filed and wakes the asks whose tick has passed. While answers come in time the
//! sweeper almost never runs: the earliest filed deadline keeps moving ahead of it.
//!
//! Precision: an ask never times out before its timeout has passed; it times out less than one
//! [`RESOLUTION`] after it, plus the runtime's timer granularity (1 ms) and scheduling delay.
//!
//! Shutdown: when the node stops, every ask still filed times out at once, and asks filed after
//! that time out on their first poll, so nothing waits on a sweeper that is gone.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use slab::Slab;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Instant;

/// Deadlines are rounded up to a multiple of this; an ask times out less than this late.
pub(crate) const RESOLUTION: Duration = Duration::from_millis(5);

/// No entry in a list.
const NIL: usize = usize::MAX;
/// `next_wake` while the sweeper scans: anything filed meanwhile notifies it.
const SCANNING: u64 = 0;
/// `next_wake` when nothing is filed: the sweeper waits for a notification.
const IDLE: u64 = u64::MAX;

/// What a filed deadline holds.
enum Slot {
    /// Not expired yet: the waker of the ask's task.
    Waiting(Waker),
    /// Expired: the ask reads this on its next poll and times out.
    Expired,
}

/// A filed deadline: a node of the doubly linked list of its tick.
struct Entry {
    tick: u64,
    prev: usize,
    next: usize,
    slot: Slot,
}

/// One stripe: filed deadlines in a slab, linked per tick, ticks in order.
#[derive(Default)]
struct Stripe {
    entries: Slab<Entry>,
    /// Tick → the first entry of its list.
    heads: BTreeMap<u64, usize>,
}

impl Stripe {
    /// Files `waker` under `tick`; returns its key.
    fn file(&mut self, tick: u64, waker: Waker) -> usize {
        // One search of the ticks: the new entry becomes its tick's head.
        let head = self.heads.entry(tick).or_insert(NIL);
        let next = *head;
        let key = self.entries.insert(Entry { tick, prev: NIL, next, slot: Slot::Waiting(waker) });
        *head = key;
        if next != NIL {
            self.entries[next].prev = key;
        }
        key
    }

    /// Takes the entry `key` out of its tick's list (it stays in the slab).
    fn unlink(&mut self, key: usize) {
        let Entry { tick, prev, next, .. } = self.entries[key];
        if prev != NIL {
            self.entries[prev].next = next;
        } else if next != NIL {
            self.heads.insert(tick, next);
        } else {
            self.heads.remove(&tick);
        }
        if next != NIL {
            self.entries[next].prev = prev;
        }
    }

    /// Forgets the entry `key`, expired or not (its ask ended).
    fn remove(&mut self, key: usize) {
        if matches!(self.entries[key].slot, Slot::Waiting(_)) {
            self.unlink(key);
        }
        self.entries.remove(key);
    }

    /// Expires every entry filed under a tick up to `tick`, moving their wakers to `wakers`.
    fn expire_through(&mut self, tick: u64, wakers: &mut Vec<Waker>) {
        while let Some(entry) = self.heads.first_entry() {
            if *entry.key() > tick {
                break;
            }
            let mut key = entry.remove();
            while key != NIL {
                let e = &mut self.entries[key];
                key = e.next;
                if let Slot::Waiting(w) = std::mem::replace(&mut e.slot, Slot::Expired) {
                    wakers.push(w);
                }
            }
        }
    }

    /// The earliest tick filed.
    fn earliest(&self) -> Option<u64> {
        self.heads.first_key_value().map(|(t, _)| *t)
    }

    /// Deadlines filed and not expired.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.entries.iter().filter(|(_, e)| matches!(e.slot, Slot::Waiting(_))).count()
    }
}

/// A stripe on a cache line of its own, so two threads filing on two stripes do not share one.
#[repr(align(128))]
#[derive(Default)]
struct PaddedStripe(Mutex<Stripe>);

struct Shared {
    origin: Instant,
    stripes: Box<[PaddedStripe]>,
    /// The tick the sweeper sleeps until ([`SCANNING`], [`IDLE`]): a deadline filed before it
    /// notifies the sweeper.
    next_wake: AtomicU64,
    notify: Notify,
    /// Set when the sweeper stops: deadlines time out at once.
    closed: AtomicBool,
}

thread_local! {
    /// This thread's stripe number (before the modulo), fixed at its first ask.
    static THREAD_STRIPE: usize = {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed)
    };
}

/// The stripe of the thread numbered `thread` among `stripes`: threads take turns.
fn stripe_of(thread: usize, stripes: usize) -> usize {
    thread % stripes
}

impl Shared {
    fn stripe(&self, index: usize) -> MutexGuard<'_, Stripe> {
        // A panic while a stripe is held leaves its lists consistent (no step in between
        // panics), so a poisoned stripe is used as it is.
        self.stripes[index].0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first tick at or after `at`: a deadline filed there never expires before `at`.
    fn tick_at_or_after(&self, at: Instant) -> u64 {
        self.nanos_since_origin(at).div_ceil(RESOLUTION.as_nanos() as u64)
    }

    /// The last tick that has fully begun at `now`.
    fn tick_reached(&self, now: Instant) -> u64 {
        self.nanos_since_origin(now) / RESOLUTION.as_nanos() as u64
    }

    /// Nanoseconds from the origin to `at` (0 before it), saturating: in `u64` arithmetic, not
    /// through `Duration::as_nanos`'s `u128` (every ask that waits computes its tick).
    fn nanos_since_origin(&self, at: Instant) -> u64 {
        let d = at.saturating_duration_since(self.origin);
        d.as_secs().saturating_mul(1_000_000_000).saturating_add(u64::from(d.subsec_nanos()))
    }

    fn instant_of(&self, tick: u64) -> Instant {
        self.origin + RESOLUTION.saturating_mul(u32::try_from(tick).unwrap_or(u32::MAX))
    }

    /// One sweep: expires what is due, wakes those asks, and publishes when the next is due.
    fn sweep(&self, now: Instant) -> Option<u64> {
        self.next_wake.store(SCANNING, Ordering::SeqCst);
        let reached = self.tick_reached(now);
        let mut wakers = Vec::new();
        let mut earliest = IDLE;
        for index in 0..self.stripes.len() {
            let mut stripe = self.stripe(index);
            stripe.expire_through(reached, &mut wakers);
            earliest = earliest.min(stripe.earliest().unwrap_or(IDLE));
        }
        self.next_wake.store(earliest, Ordering::SeqCst);
        for w in wakers {
            w.wake();
        }
        (earliest != IDLE).then_some(earliest)
    }

    /// Expires everything filed, for good.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut wakers = Vec::new();
        for index in 0..self.stripes.len() {
            self.stripe(index).expire_through(u64::MAX, &mut wakers);
        }
        for w in wakers {
            w.wake();
        }
    }
}

/// The ask deadlines of one node: [`DeadlineSweep::within_from`] bounds a future by a timeout.
/// Cheap to clone.
#[derive(Clone)]
pub(crate) struct DeadlineSweep {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DeadlineSweep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadlineSweep").field("closed", &self.shared.closed.load(Ordering::Relaxed)).finish()
    }
}

/// The timeout passed before the future finished.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Elapsed;

impl DeadlineSweep {
    /// Deadlines with no sweeper yet: run [`DeadlineSweep::run`] on the node's runtime.
    pub(crate) fn new() -> Self {
        // A few stripes per core: threads rarely share one, and the sweep stays short.
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let stripes = (cores * 4).next_power_of_two().min(64);
        DeadlineSweep {
            shared: Arc::new(Shared {
                origin: crate::clock::now(),
                stripes: (0..stripes).map(|_| PaddedStripe::default()).collect(),
                next_wake: AtomicU64::new(IDLE),
                notify: Notify::new(),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// The sweeper: runs until `shutdown`, then times out every deadline filed and every one
    /// filed later.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let shared = &self.shared;
        loop {
            let due = shared.sweep(crate::clock::now());
            let notified = shared.notify.notified();
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = notified => {}
                _ = async {
                    match due {
                        Some(tick) => tokio::time::sleep_until(shared.instant_of(tick).into()).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
        shared.close();
    }

    /// `future`, unless `timeout` passes first (counted from its first wait).
    #[cfg(test)]
    pub(crate) fn within<F: Future + Unpin>(&self, timeout: Duration, future: F) -> Within<'_, F> {
        self.within_from(None, timeout, future)
    }

    /// `future`, unless `timeout` passes first, counted from `start` (a clock reading the
    /// caller already took, so the deadline costs none of its own) or from its first wait.
    pub(crate) fn within_from<F: Future + Unpin>(
        &self,
        start: Option<crate::clock::Instant>,
        timeout: Duration,
        future: F,
    ) -> Within<'_, F> {
        Within { shared: &self.shared, future, timeout, start, filed: None }
    }
}

/// A future bounded by a deadline (see [`DeadlineSweep::within_from`]).
pub(crate) struct Within<'a, F> {
    shared: &'a Shared,
    future: F,
    timeout: Duration,
    /// Counted from here (`None`: from the first wait).
    start: Option<crate::clock::Instant>,
    /// (stripe, key) once filed.
    filed: Option<(usize, usize)>,
}

impl<F: Future + Unpin> Future for Within<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Poll::Ready(out) = Pin::new(&mut this.future).poll(cx) {
            if let Some((stripe, key)) = this.filed.take() {
                this.shared.stripe(stripe).remove(key);
            }
            return Poll::Ready(Ok(out));
        }
        let shared = this.shared;
        match this.filed {
            Some((stripe, key)) => {
                let mut s = shared.stripe(stripe);
                match &mut s.entries[key].slot {
                    Slot::Expired => {
                        s.entries.remove(key);
                        this.filed = None;
                        return Poll::Ready(Err(Elapsed));
                    }
                    Slot::Waiting(w) => {
                        if !w.will_wake(cx.waker()) {
                            *w = cx.waker().clone();
                        }
                    }
                }
            }
            None => {
                // A deadline past the clock's range never comes: filed under IDLE, it only
                // times out at shutdown and never wakes the sweeper.
                let deadline = this.start.unwrap_or_else(crate::clock::now).checked_add(this.timeout);
                let tick = deadline.map_or(IDLE, |d| shared.tick_at_or_after(d));
                let stripe = stripe_of(THREAD_STRIPE.with(|n| *n), shared.stripes.len());
                let key = shared.stripe(stripe).file(tick, cx.waker().clone());
                this.filed = Some((stripe, key));
                // After filing (see `Shared::sweep`): either the sweeper's scan sees this
                // entry, or this load sees SCANNING or the tick it will sleep until.
                let next_wake = shared.next_wake.load(Ordering::SeqCst);
                if next_wake == SCANNING || tick < next_wake {
                    shared.notify.notify_one();
                }
                if shared.closed.load(Ordering::SeqCst) {
                    shared.stripe(stripe).remove(key);
                    this.filed = None;
                    return Poll::Ready(Err(Elapsed));
                }
            }
        }
        Poll::Pending
    }
}

impl<F> Drop for Within<'_, F> {
    fn drop(&mut self) {
        if let Some((stripe, key)) = self.filed.take() {
            self.shared.stripe(stripe).remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use super::*;

    /// A waker that counts its wakes.
    #[derive(Default)]
    struct CountingWaker(AtomicUsize);
    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<CountingWaker>, Waker) {
        let w = Arc::new(CountingWaker::default());
        (w.clone(), Waker::from(w))
    }

    #[test]
    fn deadlines_expire_at_their_tick_and_not_before() {
        let mut s = Stripe::default();
        let (a, wa) = waker();
        let (b, wb) = waker();
        let (c, wc) = waker();
        s.file(10, wa);
        s.file(12, wb);
        s.file(10, wc);
        let mut wakers = Vec::new();
        s.expire_through(9, &mut wakers);
        assert!(wakers.is_empty(), "nothing is due before tick 10");
        s.expire_through(10, &mut wakers);
        assert_eq!(wakers.len(), 2, "both deadlines of tick 10");
        assert_eq!(s.earliest(), Some(12));
        s.expire_through(11, &mut wakers);
        assert_eq!(wakers.len(), 2);
        s.expire_through(12, &mut wakers);
        assert_eq!(wakers.len(), 3);
        assert_eq!(s.earliest(), None);
        for w in wakers {
            w.wake();
        }
        for w in [a, b, c] {
            assert_eq!(w.0.load(Ordering::SeqCst), 1, "each ask is woken once");
        }
        assert_eq!(s.waiting(), 0);
        assert_eq!(s.entries.len(), 3, "expired entries stay until their ask reads them");
    }

    #[test]
    fn an_answered_deadline_is_unlinked_wherever_it_sits_in_its_tick() {
        // Remove the head, a middle entry and the tail of one tick's list in turn; the rest of
        // the list still expires, and nothing removed does.
        for removed in 0..3 {
            let mut s = Stripe::default();
            let counted: Vec<_> = (0..3).map(|_| waker()).collect();
            let keys: Vec<usize> = counted.iter().map(|(_, w)| s.file(7, w.clone())).collect();
            s.remove(keys[removed]);
            let mut wakers = Vec::new();
            s.expire_through(7, &mut wakers);
            assert_eq!(wakers.len(), 2, "removed entry {removed}");
            for w in wakers {
                w.wake();
            }
            for (i, (c, _)) in counted.iter().enumerate() {
                let expected = usize::from(i != removed);
                assert_eq!(c.0.load(Ordering::SeqCst), expected, "entry {i}, removed {removed}");
            }
        }
    }

    #[test]
    fn removing_every_deadline_of_a_tick_forgets_the_tick() {
        let mut s = Stripe::default();
        let (_, w) = waker();
        let a = s.file(3, w.clone());
        let b = s.file(3, w.clone());
        s.file(5, w);
        s.remove(a);
        assert_eq!(s.earliest(), Some(3));
        s.remove(b);
        assert_eq!(s.earliest(), Some(5), "tick 3 has no deadline left");
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn an_expired_deadline_is_removed_without_touching_the_lists() {
        let mut s = Stripe::default();
        let (_, w) = waker();
        let a = s.file(1, w.clone());
        let mut wakers = Vec::new();
        s.expire_through(1, &mut wakers);
        let b = s.file(2, w);
        s.remove(a);
        assert_eq!(s.earliest(), Some(2));
        s.remove(b);
        assert_eq!(s.earliest(), None);
        assert!(s.entries.is_empty());
    }

    #[test]
    fn ticks_round_deadlines_up_and_the_reached_tick_down() {
        let sweep = DeadlineSweep::new();
        let sh = &sweep.shared;
        let o = sh.origin;
        assert_eq!(sh.tick_at_or_after(o), 0);
        assert_eq!(sh.tick_at_or_after(o + Duration::from_nanos(1)), 1);
        assert_eq!(sh.tick_at_or_after(o + RESOLUTION), 1);
        assert_eq!(sh.tick_at_or_after(o + RESOLUTION + Duration::from_nanos(1)), 2);
        assert_eq!(sh.tick_reached(o + RESOLUTION - Duration::from_nanos(1)), 0);
        assert_eq!(sh.tick_reached(o + RESOLUTION), 1);
        assert_eq!(sh.tick_reached(o + RESOLUTION * 3 + Duration::from_nanos(1)), 3);
        assert_eq!(sh.instant_of(3), o + RESOLUTION * 3);
        // Whole seconds count as well as the nanoseconds past them.
        assert_eq!(sh.tick_at_or_after(o + Duration::new(30, 1)), 6_001);
        assert_eq!(sh.tick_reached(o + Duration::new(30, 5_000_000)), 6_001);
        // Past u64 nanoseconds (584 years) the tick saturates instead of wrapping.
        assert_eq!(sh.tick_at_or_after(o + Duration::from_secs(20_000_000_000)), u64::MAX / 5_000_000 + 1);
        // A deadline is never due before it: its tick is reached only at or after it.
        for nanos in [1u64, 4_999_999, 5_000_000, 5_000_001, 12_345_678] {
            let at = o + Duration::from_nanos(nanos);
            let tick = sh.tick_at_or_after(at);
            assert!(sh.instant_of(tick) >= at, "{nanos} ns");
            assert!(sh.instant_of(tick) < at + RESOLUTION, "{nanos} ns");
        }
    }

    #[test]
    fn a_sweep_expires_what_is_due_and_publishes_the_next_tick() {
        let sweep = DeadlineSweep::new();
        let sh = &sweep.shared;
        let (due, w1) = waker();
        let (later, w2) = waker();
        sh.stripe(0).file(2, w1);
        sh.stripe(sh.stripes.len() - 1).file(9, w2);
        assert_eq!(sh.sweep(sh.origin + RESOLUTION * 2), Some(9));
        assert_eq!(sh.next_wake.load(Ordering::SeqCst), 9);
        assert_eq!(due.0.load(Ordering::SeqCst), 1);
        assert_eq!(later.0.load(Ordering::SeqCst), 0);
        assert_eq!(sh.sweep(sh.origin + RESOLUTION * 9), None, "nothing left");
        assert_eq!(sh.next_wake.load(Ordering::SeqCst), IDLE);
        assert_eq!(later.0.load(Ordering::SeqCst), 1);
    }

    /// Polls a fresh deadline of `timeout` once (filing it) with `next_wake` set to
    /// `published`; returns whether the sweeper was notified.
    fn files_and_notifies(published: u64, timeout: Duration) -> bool {
        use futures::FutureExt;
        let sweep = DeadlineSweep::new();
        sweep.shared.next_wake.store(published, Ordering::SeqCst);
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let mut within = sweep.within(timeout, rx);
        let (_, waker) = waker();
        let polled = Pin::new(&mut within).poll(&mut Context::from_waker(&waker));
        assert!(polled.is_pending());
        sweep.shared.notify.notified().now_or_never().is_some()
    }

    #[test]
    fn a_deadline_wakes_the_sweeper_only_when_it_would_otherwise_sleep_past_it() {
        let hour = Duration::from_secs(3600);
        assert!(files_and_notifies(IDLE, hour), "an idle sweeper is woken");
        assert!(files_and_notifies(SCANNING, hour), "a scan in progress may have missed it: woken");
        assert!(files_and_notifies(IDLE - 1, hour), "it sleeps until later than this deadline: woken");
        assert!(!files_and_notifies(1, hour), "it wakes before this deadline anyway: not woken");
    }

    #[test]
    fn a_deadline_past_the_clocks_range_does_not_wake_an_idle_sweeper() {
        assert!(!files_and_notifies(IDLE, Duration::MAX));
    }

    #[test]
    fn threads_take_the_stripes_in_turn() {
        let got: Vec<usize> = (0..10).map(|t| stripe_of(t, 4)).collect();
        assert_eq!(got, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
    }

    #[test]
    fn a_deadline_wakes_the_waker_of_its_latest_poll() {
        let sweep = DeadlineSweep::new();
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let mut within = sweep.within(Duration::ZERO, rx);
        let (first, w1) = waker();
        let (second, w2) = waker();
        assert!(Pin::new(&mut within).poll(&mut Context::from_waker(&w1)).is_pending());
        // The ask's task moved (another waker): the expiry must wake that one.
        assert!(Pin::new(&mut within).poll(&mut Context::from_waker(&w2)).is_pending());
        sweep.shared.sweep(Instant::now() + RESOLUTION * 2);
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        let out = Pin::new(&mut within).poll(&mut Context::from_waker(&w2));
        assert!(matches!(out, Poll::Ready(Err(Elapsed))));
    }

    /// Runs a sweeper for the test; stops it when dropped.
    struct Running {
        sweep: DeadlineSweep,
        stop: CancellationToken,
        task: Option<tokio::task::JoinHandle<()>>,
    }
    impl Running {
        fn start() -> Self {
            let sweep = DeadlineSweep::new();
            let stop = CancellationToken::new();
            let task = tokio::spawn(sweep.clone().run(stop.clone()));
            Running { sweep, stop, task: Some(task) }
        }
        async fn stop(mut self) {
            self.stop.cancel();
            self.task.take().expect("running").await.expect("sweeper");
        }
    }

    #[tokio::test]
    async fn an_unanswered_future_times_out_but_never_before_its_timeout() {
        let r = Running::start();
        for timeout in [Duration::ZERO, Duration::from_millis(1), Duration::from_millis(12), Duration::from_millis(40)]
        {
            let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
            let started = Instant::now();
            let out = r.sweep.within(timeout, rx).await;
            assert_eq!(out.map(|_| ()), Err(Elapsed), "{timeout:?}");
            assert!(started.elapsed() >= timeout, "{timeout:?} timed out after {:?}", started.elapsed());
        }
        r.stop().await;
    }

    /// An ask's deadline counts from the clock reading its caller took when the ask began, not
    /// from its first wait: it times out `timeout` after that start, never before.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_given_its_start_counts_from_that_start() {
        let r = Running::start();
        let start = crate::clock::now();
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let out = r.sweep.within_from(Some(start), Duration::from_millis(40), rx).await;
        assert_eq!(out.map(|_| ()), Err(Elapsed));
        let after_start = crate::clock::now() - start;
        assert!(after_start >= Duration::from_millis(40), "never before its timeout: {after_start:?}");
        assert!(
            after_start < Duration::from_millis(40) + RESOLUTION,
            "counted from the start, not from the first wait (30 ms later): {after_start:?}"
        );
        r.stop().await;
    }

    #[tokio::test]
    async fn an_answer_in_time_is_returned_and_leaves_nothing_filed() {
        let r = Running::start();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let answer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tx.send(7u32)
        });
        assert_eq!(r.sweep.within(Duration::from_secs(30), rx).await, Ok(Ok(7)));
        answer.await.expect("answer task").expect("sent");
        let sh = &r.sweep.shared;
        assert!((0..sh.stripes.len()).all(|i| sh.stripe(i).entries.is_empty()));
        r.stop().await;
    }

    #[tokio::test]
    async fn an_abandoned_future_leaves_nothing_filed() {
        let r = Running::start();
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let waited = tokio::time::timeout(Duration::from_millis(10), r.sweep.within(Duration::from_secs(30), rx)).await;
        assert!(waited.is_err(), "the outer timeout came first");
        let sh = &r.sweep.shared;
        assert!((0..sh.stripes.len()).all(|i| sh.stripe(i).entries.is_empty()), "dropped: unfiled");
        r.stop().await;
    }

    #[tokio::test]
    async fn a_shorter_deadline_filed_while_the_sweeper_sleeps_on_a_longer_one_wakes_it() {
        let r = Running::start();
        let (_long_tx, long_rx) = tokio::sync::oneshot::channel::<u32>();
        let sweep = r.sweep.clone();
        let long = tokio::spawn(async move { sweep.within(Duration::from_secs(3600), long_rx).await.is_err() });
        // The sweeper now sleeps until the hour is up.
        let deadline = Instant::now() + Duration::from_secs(10);
        while r.sweep.shared.next_wake.load(Ordering::SeqCst) == IDLE {
            assert!(Instant::now() < deadline, "the long deadline was never filed");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let short = tokio::time::timeout(Duration::from_secs(10), r.sweep.within(Duration::from_millis(20), rx)).await;
        assert_eq!(short.expect("the sweeper woke for the shorter deadline").map(|_| ()), Err(Elapsed));
        r.stop().await;
        assert!(long.await.expect("long task"), "shutdown times the long deadline out");
    }

    #[tokio::test]
    async fn deadlines_filed_after_shutdown_time_out_at_once() {
        let r = Running::start();
        let sweep = r.sweep.clone();
        r.stop().await;
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let out = tokio::time::timeout(Duration::from_secs(10), sweep.within(Duration::from_secs(3600), rx)).await;
        assert_eq!(out.expect("no wait on a stopped sweeper").map(|_| ()), Err(Elapsed));
        // And an answer that is already there still wins.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tx.send(1u32).expect("send");
        assert_eq!(sweep.within(Duration::from_secs(1), rx).await, Ok(Ok(1)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_asks_across_threads_each_end_once_answered_or_timed_out() {
        let r = Running::start();
        let mut tasks = Vec::new();
        for i in 0..200u32 {
            let sweep = r.sweep.clone();
            tasks.push(tokio::spawn(async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                if i % 2 == 0 {
                    tokio::spawn(async move {
                        tokio::task::yield_now().await;
                        let _ = tx.send(i);
                    });
                    sweep.within(Duration::from_secs(30), rx).await == Ok(Ok(i))
                } else {
                    let _keep = tx;
                    sweep.within(Duration::from_millis(u64::from(i % 7) * 3), rx).await.is_err()
                }
            }));
        }
        for t in tasks {
            assert!(t.await.expect("ask task"));
        }
        let sh = &r.sweep.shared;
        assert!((0..sh.stripes.len()).all(|i| sh.stripe(i).entries.is_empty()), "every entry removed");
        r.stop().await;
    }
}
