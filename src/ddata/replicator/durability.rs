//! Durability in the replicator core: persist tickets, the snapshot-or-delta choice, and the
//! acknowledgements held until the local commit.
//!
//! **Rule.** Every change of a durable key gets a *ticket* (a number that only grows, also the
//! sequence number of its delta record on disk). A `WriteAck`, and the success reply of a local
//! or majority update, is released only when every ticket of its keys is committed locally
//! ([`ReplicatorInput::Persisted`](super::ReplicatorInput::Persisted) reports commits in ticket order). So an
//! acknowledged write is in this node's LMDB, and a writer counts itself only once its own
//! commit succeeded.
//!
//! **Failure.** A failed commit fails what waits on its tickets (acks are withheld, update
//! replies become storage errors) and writes the failed keys again as snapshots under new
//! tickets, so a key is never left in memory only once the store works again. The rewrite
//! waits [`REWRITE_BACKOFF`] (doubling while commits keep failing, back to the minimum after
//! one succeeds): the persist thread has already retried, so what fails here fails for a
//! while (a full map at its maximum, a broken disk), and rewriting at once would spin.
//!
//! **Layout.** A change is persisted as its delta (appended to the store's one delta log under
//! its ticket) while the key's live deltas stay within the size of its last snapshot (at least
//! [`LOG_FLOOR_BYTES`]) and [`MAX_LOG_RECORDS`]; otherwise as a snapshot of the whole value,
//! which covers the key's older deltas. So a write costs O(delta) amortized — a snapshot byte
//! per delta byte at most — and a load reads at most about twice each value. (Half the
//! snapshot, the earlier budget, spent two snapshot bytes per delta byte: 10–12 % of a
//! durable producer queue's CPU at 10,000 streams.) The log is trimmed below the oldest live
//! delta of any key; a key whose oldest live delta falls [`MAX_LOG_SPAN`] tickets behind is
//! written whole, so a key written once does not keep the whole log alive.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::{PersistRecord, ReplicatorAction, ReplicatorCore};
use crate::clock::Instant;
use crate::ddata::crdt::ReplicatedDelta;
use crate::error::Error;

/// Delay before failed keys are written again: the first, and the cap while failures go on.
pub(crate) const REWRITE_BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// A key's delta log may grow to at least this many bytes before a snapshot replaces it.
pub(crate) const LOG_FLOOR_BYTES: usize = 4096;
/// Most delta records a key keeps before a snapshot replaces them (bounds load work; a large
/// value's small deltas reach its byte budget only past a few hundred).
pub(crate) const MAX_LOG_RECORDS: u32 = 1024;
/// A key's oldest live delta may be this many tickets behind the newest before the key is
/// written whole (bounds the log's length).
const MAX_LOG_SPAN: u64 = 1 << 17;
/// The log is trimmed when its low-water mark moved by at least this many tickets.
const TRIM_STEP: u64 = 1024;
/// Keys written whole per persist to unpin the log (spreads a burst of them).
const UNPINS_PER_PERSIST: usize = 8;

/// Per-key persistence bookkeeping.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct KeyLog {
    /// The key's latest ticket (0: nothing issued by this process and nothing loaded).
    pub last_ticket: u64,
    /// Approximate size of the key's last snapshot.
    pub snapshot_bytes: usize,
    /// Bytes and records of the key's live deltas (since that snapshot).
    pub log_bytes: usize,
    pub log_records: u32,
    /// Ticket of the key's oldest live delta (0: none).
    pub first_log_seq: u64,
}

/// An action held for a commit, with the deadline of the operation it completes.
type Held<R> = (ReplicatorAction<R>, Option<Instant>);

/// Tickets and held actions.
pub(crate) struct Durability<R> {
    /// The last ticket issued.
    issued: u64,
    /// Every ticket up to this one has been reported committed (or failed).
    reported: u64,
    /// Tickets not yet reported, with their key (for the rewrite after a failure).
    in_flight: BTreeMap<u64, String>,
    /// Actions waiting for a ticket, each with the deadline of the operation it completes
    /// (released after it, a reply fails as timed out instead: see `after_commit_until`).
    held: BTreeMap<u64, Vec<Held<R>>>,
    /// Oldest live delta ticket → its key, for every key with live deltas on disk (a log
    /// stays listed until the snapshot covering it is committed).
    live_logs: BTreeMap<u64, String>,
    /// Snapshot ticket → the `live_logs` entries it covers once committed.
    covering: BTreeMap<u64, Vec<u64>>,
    /// The log was last trimmed below this ticket.
    trimmed_below: u64,
    /// [`MAX_LOG_SPAN`] (smaller in tests).
    pub(super) max_log_span: u64,
    /// Keys whose commit failed, to write again whole (with the `live_logs` entries their
    /// failed snapshots were to cover), and when.
    rewrite: BTreeMap<String, Vec<u64>>,
    rewrite_at: Option<Instant>,
    rewrite_backoff: Duration,
    /// The last failure (what a key waiting for its rewrite answers).
    last_failure: Option<(PathBuf, String)>,
}

impl<R> Default for Durability<R> {
    fn default() -> Self {
        Durability {
            issued: 0,
            reported: 0,
            in_flight: BTreeMap::new(),
            held: BTreeMap::new(),
            live_logs: BTreeMap::new(),
            covering: BTreeMap::new(),
            trimmed_below: 0,
            max_log_span: MAX_LOG_SPAN,
            rewrite: BTreeMap::new(),
            rewrite_at: None,
            rewrite_backoff: REWRITE_BACKOFF.0,
            last_failure: None,
        }
    }
}

impl<R> Durability<R> {
    /// Continues ticket numbers above `max_stored` (the highest sequence on disk).
    pub(crate) fn resume_after(&mut self, max_stored: u64) {
        self.issued = self.issued.max(max_stored);
        self.reported = self.reported.max(max_stored);
    }

    /// A ticket for a record that belongs to no key (reported in order with the rest).
    pub(super) fn issue_unkeyed(&mut self) -> u64 {
        self.issued += 1;
        self.issued
    }

    /// Registers a loaded key's live deltas.
    pub(crate) fn loaded_log(&mut self, key: &str, log: &KeyLog) {
        if log.first_log_seq != 0 {
            self.live_logs.insert(log.first_log_seq, key.to_string());
        }
    }

    /// Tickets issued but not yet reported.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Actions held for a commit.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn held(&self) -> usize {
        self.held.values().map(Vec::len).sum()
    }
}

impl<R> ReplicatorCore<R> {
    /// Emits the persist of a changed durable key: its delta when its log has room, else a
    /// snapshot (`delta: None` always snapshots); then trims or unpins the log.
    pub(super) fn persist(
        &mut self,
        key: &str,
        delta: Option<Cow<'_, ReplicatedDelta>>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        self.persist_record(key, delta, out);
        self.unpin_log(out);
    }

    fn persist_record(
        &mut self,
        key: &str,
        delta: Option<Cow<'_, ReplicatedDelta>>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let Some(entry) = self.data.get_mut(key) else { return };
        let d = &mut self.durability;
        d.issued += 1;
        let ticket = d.issued;
        // A key waiting for its rewrite is written whole now: this snapshot is the rewrite.
        let delta = match d.rewrite.remove(key) {
            Some(covers) => {
                d.covering.entry(ticket).or_default().extend(covers);
                if d.rewrite.is_empty() {
                    d.rewrite_at = None;
                }
                None
            }
            None => delta,
        };
        let log = &mut entry.log;
        log.last_ticket = ticket;
        let fits = delta.filter(|delta| {
            let budget = log.snapshot_bytes.max(LOG_FLOOR_BYTES);
            log.log_bytes.saturating_add(delta.approx_bytes()) <= budget && log.log_records < MAX_LOG_RECORDS
        });
        let record = match fits {
            Some(delta) => {
                if log.log_records == 0 {
                    log.first_log_seq = ticket;
                    d.live_logs.insert(ticket, key.to_string());
                }
                log.log_bytes += delta.approx_bytes();
                log.log_records += 1;
                PersistRecord::Delta(delta.into_owned())
            }
            None => {
                if log.first_log_seq != 0 {
                    // The old deltas stay needed until this snapshot is on disk.
                    d.covering.entry(ticket).or_default().push(log.first_log_seq);
                }
                // O(value), paid once per log's worth of deltas.
                log.snapshot_bytes = entry.value.approx_bytes();
                log.log_bytes = 0;
                log.log_records = 0;
                log.first_log_seq = 0;
                PersistRecord::Snapshot
            }
        };
        d.in_flight.insert(ticket, key.to_string());
        out.push(ReplicatorAction::Persist { key: key.to_string(), ticket, record });
    }

    /// Writes whole the keys whose oldest live delta is too far back (so they do not keep the
    /// whole log alive).
    fn unpin_log(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        for _ in 0..UNPINS_PER_PERSIST {
            let Some((&first, key)) = self.durability.live_logs.first_key_value() else { break };
            if self.durability.issued.saturating_sub(first) <= self.durability.max_log_span {
                break;
            }
            match self.data.get(key).map(|e| e.log.first_log_seq) {
                // Its covering snapshot is on its way; the entry goes when that commits.
                Some(current) if current != first => break,
                Some(_) => {
                    let key = key.clone();
                    self.persist_record(&key, None, out);
                }
                None => {
                    self.durability.live_logs.remove(&first);
                }
            }
        }
    }

    /// Trims the log below the oldest delta a key still needs, once that moved far enough.
    /// Called only after commits, so a trim never relies on a snapshot that is not on disk.
    fn trim_log(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let d = &mut self.durability;
        let low = d.live_logs.first_key_value().map_or(d.reported + 1, |(first, _)| *first).min(d.reported + 1);
        if low >= d.trimmed_below + TRIM_STEP {
            d.trimmed_below = low;
            out.push(ReplicatorAction::TrimLog { below: low });
        }
    }

    /// The ticket the given keys' durability waits for (0: nothing pending), or the storage
    /// error of the last failed commit when one of them waits for its rewrite (it is not on
    /// this node's disk, so nothing may count it as durable here).
    pub(super) fn commit_ticket<'a>(&self, keys: impl IntoIterator<Item = &'a str>) -> Result<u64, Error> {
        let mut ticket = 0;
        for key in keys {
            if self.durability.rewrite.contains_key(key) {
                let (path, reason) = self.durability.last_failure.clone().unwrap_or_default();
                return Err(Error::Storage { path, reason });
            }
            ticket = ticket.max(self.data.get(key).map_or(0, |e| e.log.last_ticket));
        }
        Ok(ticket)
    }

    /// Emits `action` once `ticket` is committed (at once if it already is).
    pub(super) fn after_commit(
        &mut self,
        ticket: u64,
        action: ReplicatorAction<R>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        self.after_commit_until(ticket, action, None, out);
    }

    /// Emits `action` once `ticket` is committed; a reply released after `deadline` (the
    /// node paused, or its disk stalled, between the operation's completion and its commit)
    /// fails as timed out: no operation succeeds past its deadline (see `ReplicatorInput::Remote`).
    pub(super) fn after_commit_until(
        &mut self,
        ticket: u64,
        action: ReplicatorAction<R>,
        deadline: Option<Instant>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        if ticket <= self.durability.reported {
            out.push(action);
        } else {
            self.durability.held.entry(ticket).or_default().push((action, deadline));
        }
    }

    /// Every ticket up to `through` was committed, or (with `failure`) the commit holding
    /// those not yet reported failed.
    pub(super) fn on_persisted(
        &mut self,
        through: u64,
        failure: Option<(PathBuf, String)>,
        now: Instant,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let through = through.min(self.durability.issued);
        if through <= self.durability.reported {
            return;
        }
        self.durability.reported = through;
        self.on_reservation_persisted(through, failure.is_some());
        let rest = self.durability.in_flight.split_off(&(through + 1));
        let done = std::mem::replace(&mut self.durability.in_flight, rest);
        let rest = self.durability.held.split_off(&(through + 1));
        let released = std::mem::replace(&mut self.durability.held, rest);
        let rest = self.durability.covering.split_off(&(through + 1));
        let covered = std::mem::replace(&mut self.durability.covering, rest);
        let Some((path, reason)) = failure else {
            self.durability.rewrite_backoff = REWRITE_BACKOFF.0;
            for first in covered.into_values().flatten() {
                self.durability.live_logs.remove(&first);
            }
            for (action, deadline) in released.into_values().flatten() {
                match deadline {
                    Some(d) if d <= now => out.push(super::timed_out(action)),
                    _ => out.push(action),
                }
            }
            self.trim_log(out);
            return;
        };
        self.durability.last_failure = Some((path.clone(), reason.clone()));
        for (action, _) in released.into_values().flatten() {
            match action {
                // Not stored here, so not acknowledged: the writer (or the reader after a
                // write) must not count this replica.
                ReplicatorAction::Send {
                    msg: super::ReplicatorMsg::WriteAck { .. } | super::ReplicatorMsg::ReadResult { .. },
                    ..
                } => {}
                ReplicatorAction::ReplyUpdate { reply, result: Ok(_) } => {
                    let result = Err(Error::Storage { path: path.clone(), reason: reason.clone() });
                    out.push(ReplicatorAction::ReplyUpdate { reply, result });
                }
                ReplicatorAction::ReplyGetMany { reply, result: Ok(_) } => {
                    let result = Err(Error::Storage { path: path.clone(), reason: reason.clone() });
                    out.push(ReplicatorAction::ReplyGetMany { reply, result });
                }
                other => out.push(other),
            }
        }
        // Write each failed key again, whole, after the backoff; the logs a failed snapshot was
        // to cover wait for the new one.
        for (ticket, key) in done {
            let covers = self.durability.rewrite.entry(key).or_default();
            covers.extend(covered.get(&ticket).into_iter().flatten());
        }
        let d = &mut self.durability;
        if d.rewrite_at.is_none() {
            d.rewrite_at = Some(now + d.rewrite_backoff);
            d.rewrite_backoff = (d.rewrite_backoff * 2).min(REWRITE_BACKOFF.1);
        }
    }

    /// Writes the keys of failed commits again once their backoff has passed.
    pub(super) fn rewrite_failed(&mut self, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        if self.durability.rewrite_at.is_none_or(|at| now < at) {
            return;
        }
        self.durability.rewrite_at = None;
        for (key, covers) in std::mem::take(&mut self.durability.rewrite) {
            // Every key here had a record persisted, which only durable keys get (a counter
            // reservation is unkeyed and asked for again by the next update that needs it).
            if self.data.contains_key(&key) {
                self.persist_record(&key, None, out);
                let ticket = self.durability.issued;
                self.durability.covering.entry(ticket).or_default().extend(covers);
            }
        }
    }
}
