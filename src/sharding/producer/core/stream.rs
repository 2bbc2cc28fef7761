//! A producer's stream: one entity's numbered messages, its round, and (durable) its lane and
//! the entries it has left to delete (see [`super`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use super::ProducerAction;
use crate::clock::Instant;
use crate::sharding::producer::queue::{QueueEntry, entry_key};

/// An unconfirmed message.
pub(super) struct Queued {
    pub(super) seq: u64,
    /// Durable: its place in the stream's lane (0 otherwise).
    pub(super) place: u64,
    pub(super) bytes: Bytes,
    pub(super) stored_at: Instant,
    /// Durable: its write was acknowledged (always true otherwise). Only a run of stored
    /// messages from the front is sent.
    pub(super) stored: bool,
    /// Times sent.
    pub(super) sends: u32,
    /// Times its entity panicked on it.
    pub(super) panics: u32,
}

/// A confirmed message's entry that may still be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Undeleted {
    pub(super) place: u64,
    /// When the message was confirmed (or given up).
    pub(super) since: Instant,
}

/// One entity's stream of messages.
pub(super) struct Stream {
    pub(super) id: u64,
    pub(super) next_seq: u64,
    /// Unconfirmed messages, oldest first.
    pub(super) queue: VecDeque<Queued>,
    /// The newest message sent in this round.
    pub(super) sent_upto: u64,
    pub(super) round: u64,
    /// When the next round starts (after a failure); nothing is sent until then.
    pub(super) retry_at: Option<Instant>,
    pub(super) backoff: Duration,
    /// Offers waiting for room, oldest first.
    pub(super) waiters: VecDeque<u64>,
    /// The entity incarnation the stream was introduced to (sent on every message; 0: none).
    pub(super) nonce: u64,
    /// Since when it has had nothing unconfirmed and nobody waiting (its key in `idle`).
    pub(super) idle_since: Option<u64>,
    /// Durable: its lane, places in the lane, and when it was made (see [`super::queue`]).
    pub(super) lane: u32,
    pub(super) modulus: u64,
    pub(super) made: (u64, u64),
    /// The message whose confirmation its entity holds back (a deferred confirm): nothing
    /// after it is sent until it is confirmed.
    pub(super) held: Option<u64>,
    /// Durable: confirmed (or given up) messages whose entries may still be stored, by number,
    /// with their places and when they were confirmed. Kept here until a later message at the
    /// same place replaced the entry, or a majority acknowledged its deletion: written once
    /// the entry has lingered for `linger`, or the stream is evicted or its producer stops (at
    /// once for a resumed stream), and tried again when it fails.
    pub(super) undeleted: BTreeMap<u64, Undeleted>,
    /// Durable: those of `undeleted` whose deletion is being written.
    pub(super) deleting: BTreeSet<u64>,
    /// Durable: when its next try at the deletions that failed is due.
    pub(super) flush_at: Option<Instant>,
    /// Durable: resumed from a load. It takes no new message: the incarnation before may have
    /// had later numbers confirmed and deleted, which no load sees, so a number given now
    /// could be one its entity handled already (and would confirm as a duplicate without
    /// handling). Offers to its entity wait until it is let go — nothing unconfirmed, every
    /// entry deleted — and then start a new stream.
    pub(super) resumed: bool,
}

impl Stream {
    pub(super) fn first_unconfirmed(&self) -> u64 {
        self.queue.front().map_or(self.next_seq, |q| q.seq)
    }

    pub(super) fn key(&self, place: u64) -> String {
        entry_key(self.lane, place)
    }

    /// The place a new message takes: the lowest one no unconfirmed message holds (a stream
    /// holds fewer unconfirmed messages than places). Reusing the places just freed keeps the
    /// lane's keys, tombstones included, as few as the most messages it held at once.
    pub(super) fn free_place(&self) -> u64 {
        let mut taken: Vec<u64> = self.queue.iter().map(|q| q.place).collect();
        taken.sort_unstable();
        // Places are distinct: the first gap in their sorted run is the lowest free one.
        let mut place = 0;
        for t in taken {
            if t != place {
                break;
            }
            place += 1;
        }
        place
    }

    /// The stored form of message `seq` (`bytes`) of this stream of `entity`.
    pub(super) fn entry(&self, entity: &str, seq: u64, bytes: &Bytes) -> QueueEntry {
        QueueEntry {
            entity: entity.to_string(),
            stream: self.id,
            made: self.made,
            seq,
            modulus: self.modulus,
            bytes: bytes.to_vec(),
            // `seq` itself is unconfirmed (it is being written).
            first_unconfirmed: self.first_unconfirmed().min(seq),
        }
    }

    /// `place` is overwritten by a newer message (acknowledged): no deletion of the one before
    /// is needed.
    pub(super) fn overwritten(&mut self, place: u64) {
        let deleting = &mut self.deleting;
        self.undeleted.retain(|seq, u| {
            let keep = u.place != place;
            if !keep {
                deleting.remove(seq);
            }
            keep
        });
    }

    /// Message `seq` at `place` is confirmed (or given up) at `now`: its entry stays until
    /// the next message at its place replaces it or it has lingered long enough (see
    /// [`Stream::flush`]), except in a resumed stream, which is let go only once its entries
    /// are deleted.
    pub(super) fn confirmed(
        &mut self,
        entity: &str,
        seq: u64,
        place: u64,
        now: Instant,
        out: &mut Vec<ProducerAction>,
    ) {
        if self.resumed {
            self.delete(entity, seq, place, now, out);
        } else {
            self.undeleted.insert(seq, Undeleted { place, since: now });
        }
    }

    /// Deletes the entry of message `seq` at `place`, confirmed or given up. A message may
    /// take the place at once: the store's writer keeps the order, so its write lands after.
    pub(super) fn delete(&mut self, entity: &str, seq: u64, place: u64, now: Instant, out: &mut Vec<ProducerAction>) {
        self.undeleted.insert(seq, Undeleted { place, since: now });
        self.deleting.insert(seq);
        out.push(ProducerAction::Unpersist { key: self.key(place), of: Some((entity.to_string(), self.id, seq)) });
    }

    /// Deletes (again) the entries of its confirmed messages that have lingered `after` by
    /// `now` and are not being deleted already, at places no unconfirmed message holds: no
    /// write at those is on its way (one only follows from a message taking the place later,
    /// and the store's writer keeps the order); an unconfirmed message's own write replaces
    /// the entry at its place.
    pub(super) fn flush(&mut self, entity: &str, now: Instant, after: Duration, out: &mut Vec<ProducerAction>) {
        let held: BTreeSet<u64> = self.queue.iter().map(|q| q.place).collect();
        for (&seq, u) in &self.undeleted {
            if self.deleting.contains(&seq) || held.contains(&u.place) || u.since + after > now {
                continue;
            }
            let of = Some((entity.to_string(), self.id, seq));
            out.push(ProducerAction::Unpersist { key: self.key(u.place), of });
            self.deleting.insert(seq);
        }
    }

    /// When the next of its entries not being deleted will have lingered `after` (`None`:
    /// every one is being deleted).
    pub(super) fn next_flush(&self, after: Duration) -> Option<Instant> {
        let pending = self.undeleted.iter().filter(|(seq, _)| !self.deleting.contains(seq));
        pending.map(|(_, u)| u.since + after).min()
    }
}
