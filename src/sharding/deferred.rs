//! Deferred replies: an entity takes the answer to the ask it is handling
//! ([`EntityContext::reply_later`](super::EntityContext::reply_later)) and sends it later —
//! after other messages, from a task that asks another entity, whenever the answer is known.
//!
//! **Promise.** Every ask gets exactly one answer: the first of the handler's reply, a send
//! or failure through the [`DeferredReply`], an error when the handler panicked or its state
//! write failed, or `NotDelivered` when the `DeferredReply` is dropped unanswered. A send made
//! while the handler of the ask still runs leaves with the handler's reply; for a durable
//! entity, a send made while any of its handlers runs — for the ask it handles or for an
//! earlier one — leaves after that handler's state write, replaced by an error if the write
//! fails (the answer may rest on the state that was not written).

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Sends the answer to the asker (a local waiter or a remote node).
pub(crate) type Deliver<R> = Box<dyn FnOnce(Result<R>) + Send>;

enum Cell<R> {
    /// Taken by the handler, which still runs: a send is held until it ends.
    Taken { held: Option<Result<R>> },
    /// The handler ended, the ask unanswered: a send leaves at once.
    Open(Deliver<R>),
    /// Answered.
    Done,
}

/// One ask's answer, shared by the entity's task and the handler's [`DeferredReply`].
struct Shared<R> {
    entity_id: String,
    cell: Mutex<Cell<R>>,
    gate: Arc<ReplyGate>,
}

/// A send held by a [`ReplyGate`]: called with `None` once the handler's write is done, or
/// with why it failed.
type Held = Box<dyn FnOnce(Option<&str>) + Send>;

/// Holds the sends of a durable entity's taken replies while one of its handlers runs (and
/// its state write), so no answer leaves before the state it may rest on is durable. One per
/// durable entity incarnation that took a reply.
#[derive(Default)]
pub(crate) struct ReplyGate {
    /// `Some` while a handler runs: the sends made meanwhile.
    held: Mutex<Option<Vec<Held>>>,
}

impl std::fmt::Debug for ReplyGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplyGate")
    }
}

impl ReplyGate {
    /// A handler starts: sends wait.
    pub(crate) fn close(&self) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
    }

    /// The handler (and its write) ended, failed with `failure` if it did: the held sends go.
    pub(crate) fn open(&self, failure: Option<&str>) {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).take();
        for send in held.into_iter().flatten() {
            send(failure);
        }
    }

    /// Runs `send` now, or when the running handler ends.
    fn send_or_hold(&self, send: Held) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        match held.as_mut() {
            Some(waiting) => waiting.push(send),
            None => {
                drop(held);
                send(None);
            }
        }
    }
}

/// A taken reply as the entity's context holds it until the handler ends (type-erased: the
/// context is not generic over the entity).
#[derive(Clone, Debug)]
pub(crate) struct ErasedReply(Arc<dyn Any + Send + Sync>);

/// Takes the reply of the ask `entity_id` handles, as the handler's [`DeferredReply`] and
/// what its context keeps for [`finish`]. Costs nothing for asks whose reply is not taken.
pub(crate) fn take<R: Send + 'static>(entity_id: &str, gate: Arc<ReplyGate>) -> (DeferredReply<R>, ErasedReply) {
    let cell = Mutex::new(Cell::Taken { held: None });
    let shared = Arc::new(Shared { entity_id: entity_id.to_string(), cell, gate });
    (DeferredReply { cell: shared.clone() }, ErasedReply(shared))
}

/// The handler that took the reply ended: well, or with the error of its state write or its
/// panic. The error answers at once, else what was sent meanwhile, else the reply stays open
/// for a later send through `deliver`.
pub(crate) fn finish<R: Send + 'static>(taken: ErasedReply, deliver: Deliver<R>, outcome: Result<()>) {
    let Ok(shared) = taken.0.downcast::<Shared<R>>() else {
        // The context hands a reply out only as the entity's `Reply` type.
        deliver(Err(Error::NotDelivered { entity_id: String::new(), reason: "reply of another type".into() }));
        return;
    };
    let mut cell = lock(&shared);
    let answer = match (std::mem::replace(&mut *cell, Cell::Done), outcome) {
        (_, Err(e)) => Err(e),
        (Cell::Taken { held: Some(held) }, Ok(_)) => held,
        (Cell::Taken { held: None }, Ok(_)) => {
            *cell = Cell::Open(deliver);
            return;
        }
        (other, Ok(_)) => {
            *cell = other;
            return;
        }
    };
    drop(cell);
    deliver(answer);
}

fn lock<R>(shared: &Shared<R>) -> std::sync::MutexGuard<'_, Cell<R>> {
    shared.cell.lock().unwrap_or_else(|p| p.into_inner())
}

/// The answer to an ask, taken by the entity that handles it
/// ([`EntityContext::reply_later`](super::EntityContext::reply_later)) to send later: after
/// other messages, from a task (say one that asks another entity), whenever the answer is
/// known. `Send`, so it can move anywhere.
///
/// The asker gets exactly one answer. Dropping this unanswered fails the ask with
/// [`Error::NotDelivered`]; an asker whose timeout passes meanwhile has its own error, and a
/// later send goes nowhere. A send made before the handler returns leaves once the handler
/// has: for a durable entity, after that message's state write, and replaced by the write's
/// error if it fails.
pub struct DeferredReply<R: Send + 'static> {
    cell: Arc<Shared<R>>,
}

impl<R: Send + 'static> DeferredReply<R> {
    /// Answers the ask with `reply`.
    pub fn send(self, reply: R) {
        self.answer(|| Ok(reply));
    }

    /// Fails the ask with [`Error::NotDelivered`] giving `reason`.
    pub fn fail(self, reason: impl Into<String>) {
        self.answer(|| Err(Error::NotDelivered { entity_id: self.cell.entity_id.clone(), reason: reason.into() }));
    }

    /// Answers unless answered: at once after the handler ended, else when it ends.
    fn answer(&self, answer: impl FnOnce() -> Result<R>) {
        let mut cell = lock(&self.cell);
        match std::mem::replace(&mut *cell, Cell::Done) {
            Cell::Taken { held: None } => *cell = Cell::Taken { held: Some(answer()) },
            Cell::Open(deliver) => {
                drop(cell);
                let (answer, entity_id) = (answer(), self.cell.entity_id.clone());
                self.cell.gate.send_or_hold(Box::new(move |failure| match failure {
                    None => deliver(answer),
                    Some(why) => deliver(Err(Error::StateNotPersisted {
                        entity_id,
                        reason: format!("the entity's state write at the time of this answer failed: {why}"),
                    })),
                }));
            }
            other => *cell = other,
        }
    }
}

impl<R: Send + 'static> Drop for DeferredReply<R> {
    fn drop(&mut self) {
        self.answer(|| {
            Err(Error::NotDelivered {
                entity_id: self.cell.entity_id.clone(),
                reason: "the entity dropped its deferred reply unanswered".into(),
            })
        });
    }
}

impl<R: Send + 'static> std::fmt::Debug for DeferredReply<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeferredReply")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answers = Arc<Mutex<Vec<std::result::Result<u32, String>>>>;

    fn deliver() -> (Deliver<u32>, Answers) {
        let answers: Answers = Arc::default();
        let log = answers.clone();
        (Box::new(move |r: Result<u32>| log.lock().unwrap().push(r.map_err(|e| e.to_string()))), answers)
    }

    fn answers(a: &Answers) -> Vec<std::result::Result<u32, String>> {
        a.lock().unwrap().clone()
    }

    fn write_failed() -> Error {
        Error::NotDelivered { entity_id: "e".into(), reason: "state not persisted".into() }
    }

    #[test]
    fn a_reply_sent_after_the_handler_ended_leaves_at_once_and_the_return_value_is_dropped() {
        let (later, taken) = take::<u32>("e", Arc::default());
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        assert!(answers(&a).is_empty(), "the handler's return value does not answer a taken reply");
        later.send(42);
        assert_eq!(answers(&a), [Ok(42)]);
    }

    #[test]
    fn a_reply_sent_while_the_handler_runs_waits_for_it_and_gives_way_to_its_error() {
        let (later, taken) = take::<u32>("e", Arc::default());
        later.send(5);
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        assert_eq!(answers(&a), [Ok(5)]);

        let (later, taken) = take::<u32>("e", Arc::default());
        later.send(5);
        let (d, a) = deliver();
        finish(taken, d, Err(write_failed()));
        let got = answers(&a);
        assert_eq!(got.len(), 1);
        assert!(got[0].as_ref().unwrap_err().contains("state not persisted"), "{got:?}");
    }

    #[test]
    fn a_handler_error_answers_a_taken_reply_not_yet_sent_and_a_later_send_goes_nowhere() {
        let (later, taken) = take::<u32>("e", Arc::default());
        let (d, a) = deliver();
        finish(taken, d, Err(write_failed()));
        later.send(9);
        let got = answers(&a);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].is_err());
    }

    #[test]
    fn an_earlier_asks_reply_sent_while_a_later_handler_runs_waits_for_its_write_and_gives_way_to_its_failure() {
        let gate: Arc<ReplyGate> = Arc::default();
        let (later, taken) = take::<u32>("e", gate.clone());
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        gate.close();
        later.send(3);
        assert!(answers(&a).is_empty(), "held while the next handler runs");
        gate.open(None);
        assert_eq!(answers(&a), [Ok(3)]);

        let (later, taken) = take::<u32>("e", gate.clone());
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        gate.close();
        later.send(4);
        gate.open(Some("not acknowledged"));
        let got = answers(&a);
        assert_eq!(got.len(), 1);
        assert!(got[0].as_ref().unwrap_err().contains("not acknowledged"), "{got:?}");
        // Open again: a send leaves at once.
        let (later, taken) = take::<u32>("e", gate);
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        later.send(5);
        assert_eq!(answers(&a), [Ok(5)]);
    }

    #[test]
    fn a_dropped_or_failed_deferred_reply_fails_the_ask_once_naming_the_entity() {
        let (later, taken) = take::<u32>("cart-7", Arc::default());
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        drop(later);
        let got = answers(&a);
        assert_eq!(got.len(), 1);
        let e = got[0].as_ref().unwrap_err();
        assert!(e.contains("dropped its deferred reply") && e.contains("cart-7"), "{e}");

        let (later, taken) = take::<u32>("e", Arc::default());
        later.fail("no stock");
        let (d, a) = deliver();
        finish(taken, d, Ok(()));
        let got = answers(&a);
        assert_eq!(got.len(), 1);
        assert!(got[0].as_ref().unwrap_err().contains("no stock"), "{got:?}");
    }
}
