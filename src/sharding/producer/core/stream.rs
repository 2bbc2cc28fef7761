//! A producer's stream: one entity's numbered messages, its round, and (durable) its lane and
//! the entries it has left to delete (see [`super`]).

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use super::ProducerAction;
use crate::clock::Instant;
use crate::sharding::producer::queue::{QueueEntry, entry_key};

/// An unconfirmed message.
pub(super) struct Queued {
    pub(super) seq: u64,
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
    /// Durable: its lane, places per lane, and when it was made (see [`super::queue`]).
    pub(super) lane: u32,
    pub(super) modulus: u64,
    pub(super) made: (u64, u64),
    /// The message whose confirmation its entity holds back (a deferred confirm): nothing
    /// after it is sent until it is confirmed.
    pub(super) held: Option<u64>,
    /// Durable: confirmed (or given up) messages whose entries may still be stored: deleted at
    /// once, and until a majority acknowledged it (or a later message at the same place
    /// overwrote it) kept here, tried again when the stream is idle or evicted.
    pub(super) undeleted: BTreeSet<u64>,
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

    pub(super) fn key(&self, seq: u64) -> String {
        entry_key(self.lane, seq, self.modulus)
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

    /// The message at `seq`'s place is overwritten by `seq` (acknowledged): no deletion of
    /// the one before is needed.
    pub(super) fn overwritten(&mut self, seq: u64) {
        let modulus = self.modulus.max(1);
        self.undeleted.retain(|u| u % modulus != seq % modulus);
        self.deleting.retain(|u| u % modulus != seq % modulus);
    }

    /// Deletes the entry of message `seq`, confirmed or given up. Its place is written again
    /// only after (a number `modulus` later needs it confirmed first), and the store's writer
    /// keeps the order.
    pub(super) fn delete(&mut self, entity: &str, seq: u64, out: &mut Vec<ProducerAction>) {
        self.undeleted.insert(seq);
        self.deleting.insert(seq);
        out.push(ProducerAction::Unpersist { key: self.key(seq), of: Some((entity.to_string(), self.id, seq)) });
    }

    /// Deletes (again) the entries of its confirmed messages not being deleted already. Only
    /// while it has nothing unconfirmed: no write at one of those places is then on its way.
    pub(super) fn flush(&mut self, entity: &str, out: &mut Vec<ProducerAction>) {
        debug_assert!(self.queue.is_empty(), "a stream with unconfirmed messages is not flushed");
        for &seq in self.undeleted.difference(&self.deleting) {
            let of = Some((entity.to_string(), self.id, seq));
            out.push(ProducerAction::Unpersist { key: self.key(seq), of });
        }
        self.deleting.extend(self.undeleted.iter().copied());
    }
}
