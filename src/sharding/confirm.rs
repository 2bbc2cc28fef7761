//! Deferred confirms: the handler of a reliable delivery holds its confirmation back
//! ([`EntityContext::confirm_later`](super::EntityContext::confirm_later)) and a later handler
//! gives it ([`EntityContext::confirm`](super::EntityContext::confirm)), once what the message
//! asked for is done: another service answered, a timer fired, another entity replied.
//!
//! # What is promised
//! - **Confirmed only when given.** A held message is confirmed to its producer only by
//!   `confirm` in a handler of the same incarnation; for a durable entity, once that handler's
//!   state write, which carries the confirmation (a confirm persists the state as
//!   [`persist`](super::EntityContext::persist) does), is acknowledged.
//! - **Its stream waits, nothing else does.** Until then the later messages of its stream are
//!   sent back and come again after it ([`super::delivery`]); other producers' messages, other
//!   streams and plain messages are handled meanwhile.
//! - **Let go, delivered again.** A hold let go unconfirmed (its [`DeferredConfirm`] dropped,
//!   or its incarnation ended: passivation, hand-off, a crash, a failed write) is answered as
//!   not delivered, and its message is delivered and handled again, with
//!   [`DeliveryInfo::redelivery`] set.
//!
//! # What is not promised
//! A durable entity's effect-once guarantee covers what the confirming handler writes: a
//! message whose first handler wrote state and held its confirmation back is handled again
//! after the hold is let go, whatever that handler wrote. Write a held message's effect in the
//! handler that confirms it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::delivery::{ConsumerMarks, DeliveryInfo, DeliveryOutcome};
use super::envelope::{OutcomeTo, Replier, not_delivered};
use crate::error::Result;

/// A reliable delivery's confirmation, held back by the handler that took it
/// ([`EntityContext::confirm_later`](super::EntityContext::confirm_later)). Give it with
/// [`EntityContext::confirm`](super::EntityContext::confirm) in a later handler of the same
/// entity incarnation; dropped unconfirmed, its message is delivered and handled again.
pub struct DeferredConfirm {
    holds: Arc<Holds>,
    token: u64,
    delivery: DeliveryInfo,
    /// Given: dropping it lets nothing go.
    given: bool,
}

impl DeferredConfirm {
    /// The delivery whose confirmation it holds.
    pub fn delivery(&self) -> &DeliveryInfo {
        &self.delivery
    }
}

impl std::fmt::Debug for DeferredConfirm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredConfirm").field("delivery", &self.delivery).finish_non_exhaustive()
    }
}

impl Drop for DeferredConfirm {
    fn drop(&mut self) {
        if !self.given {
            self.holds.let_go(self.token);
        }
    }
}

/// One entity incarnation's held confirmations: where each one's answer goes.
pub(crate) struct Holds {
    entity_id: String,
    inner: Mutex<HoldsInner>,
}

#[derive(Default)]
struct HoldsInner {
    /// Sends the answers; set once the runner keeps the holds (before any is placed).
    replier: Option<Replier>,
    next: u64,
    /// Token → where its answer goes (`None`: its handler still runs).
    slots: HashMap<u64, Option<OutcomeTo>>,
    /// Holds let go unconfirmed that the marks may still hold (see [`apply`]).
    let_go: Vec<u64>,
    /// The incarnation ended: no hold is made or kept any more.
    ended: bool,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds").field("entity_id", &self.entity_id).finish_non_exhaustive()
    }
}

impl Holds {
    fn new(entity_id: &str) -> Arc<Self> {
        Arc::new(Holds { entity_id: entity_id.to_string(), inner: Mutex::default() })
    }

    /// The lock; a poisoned one is still consistent (no code panics while holding it).
    fn lock(&self) -> MutexGuard<'_, HoldsInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The runner keeps these holds for its incarnation: answers go through `replier`.
    pub(crate) fn kept_by(&self, replier: &Replier) {
        let mut h = self.lock();
        if h.replier.is_none() {
            h.replier = Some(replier.clone());
        }
    }

    /// The handler whose hold is `token` ended, the delivery's answer to go to `to`: kept, or
    /// given back when the hold was let go meanwhile (answer it as not delivered).
    pub(crate) fn place(&self, token: u64, to: OutcomeTo) -> Option<OutcomeTo> {
        match self.lock().slots.get_mut(&token) {
            Some(slot @ None) => {
                *slot = Some(to);
                None
            }
            _ => Some(to),
        }
    }

    /// The held message was sent again, its answer to go to `to`: returns where to answer it
    /// as pending (where the answer went before; `to` when nothing was kept).
    pub(crate) fn redirect(&self, token: u64, to: OutcomeTo) -> OutcomeTo {
        match self.lock().slots.get_mut(&token) {
            Some(Some(kept)) => std::mem::replace(kept, to),
            _ => to,
        }
    }

    /// Sends `outcome` for the hold `token` (confirmed, or why its confirming write failed),
    /// which ends.
    pub(crate) fn answer(&self, token: u64, outcome: Result<DeliveryOutcome>) {
        let (slot, replier) = {
            let mut h = self.lock();
            (h.slots.remove(&token), h.replier.clone())
        };
        if let (Some(Some(to)), Some(replier)) = (slot, replier) {
            replier.outcome(to, outcome);
        }
    }

    /// The hold `token` ends with no answer of its own (its handler's answer covers it).
    pub(crate) fn forget(&self, token: u64) {
        self.lock().slots.remove(&token);
    }

    /// The holds let go unconfirmed since the last call.
    fn take_let_go(&self) -> Vec<u64> {
        std::mem::take(&mut self.lock().let_go)
    }

    /// A [`DeferredConfirm`] was dropped unconfirmed: its message goes again.
    fn let_go(&self, token: u64) {
        let (slot, replier) = {
            let mut h = self.lock();
            let slot = h.slots.remove(&token);
            if slot.is_some() && !h.ended {
                h.let_go.push(token);
            }
            (slot, h.replier.clone())
        };
        if let (Some(Some(to)), Some(replier)) = (slot, replier) {
            replier.outcome(to, Err(not_delivered(&self.entity_id, "its deferred confirm was dropped")));
        }
    }

    /// The incarnation ended: every hold is answered as not delivered.
    pub(crate) fn end(&self) {
        let (slots, replier) = {
            let mut h = self.lock();
            h.ended = true;
            h.let_go.clear();
            (std::mem::take(&mut h.slots), h.replier.clone())
        };
        let Some(replier) = replier else { return };
        for to in slots.into_values().flatten() {
            replier.outcome(to, Err(not_delivered(&self.entity_id, "its incarnation ended with its confirm held")));
        }
    }
}

/// What one handler did with held confirmations, as applied to the marks.
#[derive(Debug, Default)]
pub(crate) struct Applied {
    /// Its own delivery is held under this token.
    pub held: Option<u64>,
    /// Holds it confirmed.
    pub confirmed: Vec<u64>,
    /// The incarnation's nonce (the confirmations carry it).
    pub nonce: u64,
}

/// The context's part in held confirmations: this incarnation's holds, and what the running
/// handler does with them.
#[derive(Debug, Default)]
pub(crate) struct HandlerConfirms {
    /// The incarnation's holds (made by its first `confirm_later`).
    pub holds: Option<Arc<Holds>>,
    /// The delivery being handled: its producer and stream (its number is in `delivery`).
    pub stream: Option<(Arc<str>, u64)>,
    /// The handler holds its delivery's confirmation under this token.
    pub deferring: Option<u64>,
    /// Holds the handler confirmed.
    pub confirming: Vec<u64>,
    /// What [`apply`] made of the above, for the runner to answer.
    pub applied: Option<Applied>,
}

/// A copy of a context holds nothing and gives nothing: held confirmations belong to the
/// context the runner hands its handlers.
impl Clone for HandlerConfirms {
    fn clone(&self) -> Self {
        HandlerConfirms::default()
    }
}

impl HandlerConfirms {
    /// Holds the confirmation of the delivery being handled (`info`), for entity `entity_id`.
    pub(crate) fn defer(&mut self, entity_id: &str, info: &DeliveryInfo) -> Option<DeferredConfirm> {
        if self.stream.is_none() || self.deferring.is_some() {
            return None;
        }
        let holds = self.holds.get_or_insert_with(|| Holds::new(entity_id)).clone();
        let token = {
            let mut h = holds.lock();
            if h.ended {
                return None;
            }
            h.next += 1;
            let token = h.next;
            h.slots.insert(token, None);
            token
        };
        self.deferring = Some(token);
        Some(DeferredConfirm { holds, token, delivery: info.clone(), given: false })
    }

    /// Gives the confirmation `confirm` holds; false when it is not one of this incarnation's.
    pub(crate) fn confirm(&mut self, mut confirm: DeferredConfirm) -> bool {
        if !self.holds.as_ref().is_some_and(|h| Arc::ptr_eq(h, &confirm.holds)) {
            return false; // dropped here: let go
        }
        // Answered by the runner once the handler (and its write) ended.
        confirm.given = true;
        self.confirming.push(confirm.token);
        true
    }

    /// Whether the handler did something with holds that [`apply`] has not applied yet.
    pub(crate) fn to_apply(&self) -> bool {
        self.deferring.is_some() || !self.confirming.is_empty()
    }

    /// Ends the handler's part: what a panicking handler held or confirmed is let go with its
    /// incarnation.
    pub(crate) fn clear(&mut self) {
        self.stream = None;
        self.deferring = None;
        self.confirming.clear();
        self.applied = None;
    }
}

/// Applies what the handler did with holds to `marks` (a durable entity's before its write):
/// its delivery held, holds confirmed, holds let go since. True when a confirmation moved the
/// marks on (a durable entity writes them then).
pub(crate) fn apply(confirms: &mut HandlerConfirms, seq: Option<u64>, marks: &mut ConsumerMarks) -> bool {
    let Some(holds) = confirms.holds.clone() else { return false };
    let mut applied = Applied { nonce: marks.nonce(), ..Applied::default() };
    if let (Some(token), Some((producer, stream)), Some(seq)) = (confirms.deferring.take(), &confirms.stream, seq) {
        if marks.defer(producer, *stream, seq, token) {
            applied.held = Some(token);
        } else {
            holds.forget(token);
        }
    }
    let mut moved_on = false;
    for token in std::mem::take(&mut confirms.confirming) {
        moved_on |= marks.confirm(token);
        applied.confirmed.push(token);
    }
    for token in holds.take_let_go() {
        marks.abandon(token);
    }
    confirms.applied = Some(applied);
    moved_on
}

/// Lets go, in `marks`, the holds of `holds` let go since the last look (before a delivery is
/// admitted).
pub(crate) fn forget_let_go(holds: &Holds, marks: &mut ConsumerMarks) {
    for token in holds.take_let_go() {
        marks.abandon(token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(seq: u64) -> DeliveryInfo {
        DeliveryInfo { producer_id: "p".into(), seq, redelivery: false }
    }

    /// A handler's part while it handles message `seq` of stream 7 from producer `p`.
    fn handling(confirms: &mut HandlerConfirms, seq: u64) -> Option<DeferredConfirm> {
        confirms.clear();
        confirms.stream = Some(("p".into(), 7));
        confirms.defer("e", &info(seq))
    }

    #[test]
    fn a_handler_holds_its_own_delivery_once_and_nothing_outside_a_delivery() {
        let mut confirms = HandlerConfirms::default();
        assert!(confirms.defer("e", &info(1)).is_none(), "no delivery is being handled");
        let held = handling(&mut confirms, 1).expect("a delivery's handler holds it");
        assert!(confirms.defer("e", &info(1)).is_none(), "once per handler");
        assert_eq!(held.delivery().seq, 1);
        assert!(confirms.to_apply());
    }

    #[test]
    fn a_confirmation_is_given_only_to_its_own_incarnation_and_a_copy_of_the_context_gives_none() {
        let (mut mine, mut other) = (HandlerConfirms::default(), HandlerConfirms::default());
        let held = handling(&mut mine, 1).unwrap();
        let foreign = handling(&mut other, 1).unwrap();
        mine.clear();
        assert!(!mine.confirm(foreign), "another incarnation's: let go");
        assert_eq!(other.holds.as_ref().unwrap().take_let_go(), [1], "dropped unconfirmed, it is let go");
        let mut copy = mine.clone();
        assert!(copy.holds.is_none() && copy.stream.is_none(), "a copy holds nothing");
        assert!(!copy.confirm(handling(&mut other, 2).unwrap()), "and gives nothing");
        assert!(mine.confirm(held));
        assert_eq!(mine.confirming, vec![1]);
        assert!(mine.holds.as_ref().unwrap().take_let_go().is_empty(), "given: nothing let go");
    }

    #[test]
    fn applying_holds_rewinds_the_held_message_and_a_confirmation_moves_the_marks_on() {
        use crate::sharding::delivery::{Admission, DeliveryHeader};
        let h = |seq| DeliveryHeader {
            producer: "p".into(),
            stream: 7,
            seq,
            first_unconfirmed: 1,
            redelivery: false,
            nonce: 3,
            epoch: 0,
            made: (0, 0),
        };
        let mut marks = ConsumerMarks::new(3);
        let mut confirms = HandlerConfirms::default();
        assert_eq!(marks.admit(&h(1)), Admission::Handle);
        let held = handling(&mut confirms, 1).unwrap();
        assert!(!apply(&mut confirms, Some(1), &mut marks), "holding moves nothing on");
        assert_eq!(confirms.applied.as_ref().map(|a| (a.held, a.nonce)), Some((Some(1), 3)));
        assert_eq!(marks.admit(&h(2)), Admission::Held { pending: 1 });
        confirms.clear();
        assert!(confirms.confirm(held));
        assert!(apply(&mut confirms, None, &mut marks), "a confirmation moves the marks on");
        assert_eq!(confirms.applied.as_ref().map(|a| a.confirmed.clone()), Some(vec![1]));
        assert_eq!(marks.admit(&h(2)), Admission::Handle);
        // A hold dropped is let go in the marks before the next admission.
        confirms.clear();
        let dropped = handling(&mut confirms, 2).unwrap();
        apply(&mut confirms, Some(2), &mut marks);
        drop(dropped);
        forget_let_go(confirms.holds.as_ref().unwrap(), &mut marks);
        assert_eq!(marks.admit(&h(2)), Admission::Handle, "handled again");
    }
}
