//! The OR-set writer of durable keys: the node's store, with the counters it reserved.
//!
//! **Rule.** Adds to a durable OR-set are written by the store (`node_id#store-<id>`), so a
//! restart that keeps its disk adds no writer to any set. Every counter this process uses lies
//! in `[floor, ceiling)`, a range the store reserved durably before the first use (see
//! [`WriteCtx`](crate::ddata::WriteCtx)); an earlier process of the store used only counters
//! below `floor`, including the ones it sent but never committed.
//!
//! **Extension.** When a durable set's counter of the store writer comes within
//! [`RESERVE_AHEAD`] of the ceiling, the core reserves [`RESERVATION_SPAN`] more through the
//! persist thread (one small meta record under its own ticket) and uses it once that commit is
//! reported. An add that finds the ceiling before that is refused (the update fails with a
//! storage error); at the default sizes that takes 8 million adds to one set within one fsync.
//!
//! **Why no bound on unsent commits is needed.** Safety rests on the durable ceiling alone: a
//! process never uses a counter at or above the ceiling on disk, so whatever it sent and never
//! committed is below the next process's floor.
//!
//! Keys that are not durable keep the incarnation as writer: their dots are on no disk.

use super::{ReplicatorAction, ReplicatorCore};
use crate::ddata::crdt::ReplicatedData;
use crate::ddata::durable::CounterReservation;

/// Counters reserved at a time (at each start, and per extension).
pub(crate) const RESERVATION_SPAN: u64 = 1 << 24;
/// An extension is asked for once a set's counter is this close to the ceiling.
pub(crate) const RESERVE_AHEAD: u64 = RESERVATION_SPAN / 2;

/// The store writer of this process.
#[derive(Debug, Clone)]
pub(crate) struct StoreWriter {
    /// `node_id#store-<id>`.
    pub name: String,
    /// Lowest counter of this process.
    pub floor: u64,
    /// Durably reserved ceiling (counters at or above it are refused).
    pub ceiling: u64,
    /// An extension on its way: its ticket and the ceiling it reserves.
    pub extending: Option<(u64, u64)>,
}

impl StoreWriter {
    pub(crate) fn new(node_id: &str, reservation: CounterReservation) -> Self {
        StoreWriter {
            name: format!("{node_id}#store-{:016x}", reservation.store_id),
            floor: reservation.floor,
            ceiling: reservation.ceiling,
            extending: None,
        }
    }
}

impl<R> ReplicatorCore<R> {
    /// Points the write context's OR-set writer at the store (durable keys) or the
    /// incarnation (the rest) before an update of `key` runs.
    pub(super) fn select_set_writer(&mut self, key: &str) {
        let durable = self.is_durable(key);
        let ctx = &mut self.ctx;
        let (name, floor, ceiling) = if durable {
            (self.writer.name.as_str(), self.writer.floor, self.writer.ceiling)
        } else {
            (ctx.actor.as_str(), 0, u64::MAX)
        };
        if ctx.set_actor != name {
            ctx.set_actor = name.to_string();
        }
        ctx.counter_floor = floor;
        ctx.counter_ceiling = ceiling;
    }

    /// After an update of a durable key: asks for more counters when the key's set is within
    /// [`RESERVE_AHEAD`] of the ceiling (and no extension is on its way).
    pub(super) fn reserve_ahead(&mut self, key: &str, out: &mut Vec<ReplicatorAction<R>>) {
        if self.writer.extending.is_some() || !self.is_durable(key) {
            return;
        }
        let Some(ReplicatedData::OrSet(set)) = self.data.get(key).map(|e| &e.value) else { return };
        let used = set.max_counter_of(&self.writer.name);
        if used.saturating_add(RESERVE_AHEAD) < self.writer.ceiling {
            return;
        }
        let Some(ceiling) = self.writer.ceiling.checked_add(RESERVATION_SPAN) else { return };
        let ticket = self.durability.issue_unkeyed();
        self.writer.extending = Some((ticket, ceiling));
        out.push(ReplicatorAction::ReserveCounters { ticket, ceiling });
    }

    /// Commits up to `through` were reported: an extension they include is usable now (or, if
    /// its commit failed, asked for again by the next update).
    pub(super) fn on_reservation_persisted(&mut self, through: u64, failed: bool) {
        let Some((ticket, ceiling)) = self.writer.extending else { return };
        if ticket > through {
            return;
        }
        self.writer.extending = None;
        if !failed {
            self.writer.ceiling = self.writer.ceiling.max(ceiling);
        }
    }
}
