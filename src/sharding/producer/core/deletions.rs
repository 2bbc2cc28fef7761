//! The durable queue's deletions (see [`crate::sharding::producer::queue`]): the entries of
//! confirmed messages linger until replaced or flushed, an evicted or resumed stream is let go
//! only once its entries are deleted, and a stopping producer deletes what lingers.

use std::collections::BTreeSet;
use std::time::Duration;

use super::stream::Stream;
use super::{PersistResult, ProducerAction, ProducerCore, StoredMessage};
use crate::clock::Instant;

impl ProducerCore {
    /// Drops the least recently idle stream (its entity starts a new one when sent to again).
    /// Durable, one with entries left is kept aside until they are deleted.
    pub(super) fn evict_idle(&mut self, now: Instant, out: &mut Vec<ProducerAction>) {
        let Some((_, entity)) = self.idle.pop_first() else { return };
        let Some(mut s) = self.streams.remove(&entity) else { return };
        s.idle_since = None;
        cancel_flush(&mut self.flushes, &entity, &mut s);
        if s.undeleted.is_empty() {
            self.free_lanes.insert(s.lane);
            return;
        }
        s.flush(&entity, now, Duration::ZERO, out);
        self.evicted.insert(entity, s);
    }

    /// A deletion ended. An evicted stream whose entries are all deleted is let go (its lane
    /// is free, its entity may start a new stream), and so is a resumed one with nothing left
    /// unconfirmed; one whose deletion failed is tried again after a pause, at a place no
    /// unconfirmed message holds by then.
    pub(super) fn unpersisted(
        &mut self,
        of: Option<StoredMessage>,
        result: PersistResult,
        now: Instant,
        out: &mut Vec<ProducerAction>,
    ) {
        if let PersistResult::Fenced { fence } = result {
            out.push(ProducerAction::Fenced { fence });
            return;
        }
        let Some((entity, stream, seq)) = of else { return };
        let evicted = !self.streams.contains_key(&entity);
        let s = self.streams.get_mut(&entity).or_else(|| self.evicted.get_mut(&entity));
        let Some(s) = s.filter(|s| s.id == stream) else { return };
        if !s.deleting.remove(&seq) {
            return; // its place was overwritten meanwhile
        }
        if result == PersistResult::Stored {
            s.undeleted.remove(&seq);
        }
        if s.undeleted.is_empty() && (evicted || (s.resumed && s.queue.is_empty())) {
            let s = if evicted { self.evicted.remove(&entity) } else { self.take_stream(&entity) };
            self.let_go(&entity, s.expect("found above"), out);
        } else {
            schedule_flush(&mut self.flushes, &entity, s, now + self.limits.resend_backoff_min);
        }
    }

    /// Removes `entity`'s stream, with what it has scheduled.
    fn take_stream(&mut self, entity: &str) -> Option<Stream> {
        let mut s = self.streams.remove(entity)?;
        if let Some(at) = s.idle_since.take() {
            self.idle.remove(&at);
        }
        if let Some(at) = s.retry_at.take() {
            self.retries.remove(&(at, entity.to_string()));
        }
        cancel_flush(&mut self.flushes, entity, &mut s);
        Some(s)
    }

    /// The producer is stopping: every stream deletes the entries it left at places no
    /// unconfirmed message holds.
    pub(super) fn closing(&mut self, now: Instant, out: &mut Vec<ProducerAction>) {
        for (entity, s) in &mut self.streams {
            s.flush(entity, now, Duration::ZERO, out);
        }
    }

    /// Lets go of a stream whose entries are all deleted: its lane is free, its entity may
    /// start a new stream, and the offers that waited for that are woken.
    fn let_go(&mut self, entity: &str, s: Stream, out: &mut Vec<ProducerAction>) {
        self.free_lanes.insert(s.lane);
        for waiter in s.waiters {
            out.push(ProducerAction::Wake { waiter, entity: Some(entity.to_string()) });
        }
        self.wake_parked(out);
    }
}

/// Durable: message `seq` at `place` of `s` is confirmed (or given up) at `now`; its entry
/// lingers (see [`Stream::confirmed`]) and a flush is due when it will have lingered `linger`.
pub(super) fn entry_confirmed(
    flushes: &mut BTreeSet<(Instant, String)>,
    linger: Duration,
    entity: &str,
    s: &mut Stream,
    (seq, place): (u64, u64),
    now: Instant,
    out: &mut Vec<ProducerAction>,
) {
    s.confirmed(entity, seq, place, now, out);
    schedule_flush(flushes, entity, s, now + linger);
}

/// Schedules a flush of `s` (see [`Stream::flush`]) at `at`, or earlier if one is: when it has
/// entries not being deleted (confirmed messages' that linger, deletions that failed).
pub(super) fn schedule_flush(flushes: &mut BTreeSet<(Instant, String)>, entity: &str, s: &mut Stream, at: Instant) {
    if s.undeleted.len() <= s.deleting.len() || s.flush_at.is_some_and(|t| t <= at) {
        return;
    }
    cancel_flush(flushes, entity, s);
    s.flush_at = Some(at);
    flushes.insert((at, entity.to_string()));
}

/// Drops the try `s` has scheduled at its failed deletions.
pub(super) fn cancel_flush(flushes: &mut BTreeSet<(Instant, String)>, entity: &str, s: &mut Stream) {
    if let Some(at) = s.flush_at.take() {
        flushes.remove(&(at, entity.to_string()));
    }
}
