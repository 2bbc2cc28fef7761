//! The write path: an update's modifies applied here, then sent as one acknowledged
//! [`ReplicatorMsg::WriteDelta`] to the replicas its consistency counts, and answered once a
//! majority acknowledged it and it is committed here.

use std::borrow::Cow;
use std::collections::HashSet;

use tracing::warn;

use super::{Consistency, MAX_PENDING_DELTA_ELEMENTS, Modify, ReplicatorAction, ReplicatorCore, ReplicatorMsg};
use crate::clock::Instant;
use crate::ddata::crdt::{ReplicatedData, ReplicatedDelta};
use crate::ddata::fenced::Fenced;
use crate::ddata::orset;
use crate::ddata::stats::ReplicatorStatCells;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;

pub(super) struct PendingWrite<R> {
    pub(super) keys: Vec<String>,
    /// Keys refused by a fence, here or at a replica.
    pub(super) fenced: Vec<(String, Fenced)>,
    /// The level asked for: counted again when the membership changes.
    pub(super) consistency: Consistency,
    pub(super) needed: usize,
    pub(super) addressed: Vec<UniqueAddress>,
    pub(super) acked: HashSet<UniqueAddress>,
    pub(super) deadline: Instant,
    pub(super) reply: R,
}

/// Deltas by key, as a write carries them.
type KeyedDeltas = Vec<(String, ReplicatedDelta)>;
/// Full values by key, as a write carries them.
type KeyedValues = Vec<(String, ReplicatedData)>;

/// An update's modifies applied locally.
pub(super) struct Applied {
    /// Keys written (not refused).
    pub(super) keys: Vec<String>,
    pub(super) deltas: Vec<(String, ReplicatedDelta)>,
    /// Keys the modify left unchanged.
    pub(super) unchanged: Vec<String>,
    /// Keys refused by their fence.
    pub(super) fenced: Vec<(String, Fenced)>,
    /// The first other failure (the modifies after it did not run).
    pub(super) failure: Option<Error>,
}

impl<R> ReplicatorCore<R> {
    /// Applies one key's modify; returns its delta (None: nothing changed).
    /// An OR-set add the modify made that found no reserved counter fails the update (with a
    /// storage error: the reservation is a commit that has not happened), one of a member too
    /// long to decode with `BadRequest`; the rest of the modify stays applied and spreads as a
    /// local update.
    pub(super) fn apply_modify(
        &mut self,
        key: &str,
        modify: Modify,
        out: &mut Vec<ReplicatorAction<R>>,
    ) -> Result<Option<ReplicatedDelta>> {
        self.select_set_writer(key);
        let existing = self.data.get_mut(key);
        let had_value = existing.is_some();
        let result = modify(existing.map(|e| &mut e.value), &mut self.ctx);
        let refused = self.ctx.refused_adds.replace(0);
        let too_long = self.ctx.refused_too_long.replace(0);
        if let Some(Fenced { epoch, fence }) = self.ctx.fenced.take() {
            // The map refused the write and changed nothing; earlier local changes of the key
            // stay pending and spread as usual.
            result?;
            ReplicatorStatCells::inc(&self.stats.fenced_writes);
            return Err(Error::Fenced { key: key.to_string(), epoch, fence });
        }
        let (changed, created) = match result? {
            Some(created) if !had_value => {
                self.put_value(key, created);
                (true, true)
            }
            _ => (self.refresh(key), false),
        };
        let delta = self.data.get_mut(key).and_then(|e| e.value.take_delta());
        if changed {
            // A new key is written whole: its first record is a snapshot.
            self.emit_changed(key, delta.as_ref().filter(|_| !created).map(Cow::Borrowed), out);
        }
        self.reserve_ahead(key, out);
        let refusal = if too_long > 0 {
            let max = orset::MAX_ELEMENT_LEN;
            Some(Error::BadRequest(format!("{too_long} OR-set members of {key} refused: longer than {max} bytes")))
        } else if refused > 0 {
            let reason = format!("{refused} OR-set adds to {key} refused: no durably reserved counter left yet");
            Some(Error::Storage { path: Default::default(), reason })
        } else {
            None
        };
        if let Some(refusal) = refusal {
            ReplicatorStatCells::add(&self.stats.refused_adds, (refused + too_long) as usize);
            if let Some(d) = delta {
                self.pend_delta(key.to_string(), d);
            }
            return Err(refusal);
        }
        Ok(delta)
    }

    /// One or more keys updated together and replicated in one round: one `WriteDelta` per
    /// replica, one ack each. A key the update did not change has no delta, so its full value
    /// goes instead (a retried write must still reach the majority). A failing modify fails the
    /// update; keys modified before it keep their local change (it spreads as with any local
    /// update).
    pub(super) fn on_update(
        &mut self,
        updates: Vec<(String, Modify)>,
        c: Consistency,
        deadline: Instant,
        reply: R,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let Applied { keys, deltas, unchanged, fenced, failure } = self.apply_all(updates, out);
        let reachable = self.reachable_replicas();
        let counted = self.replicas_counted(keys.iter().map(String::as_str));
        let needed = c.needed_of(counted, reachable.len() + 1);
        if failure.is_some() || needed <= 1 || reachable.len() + 1 < needed || keys.is_empty() {
            for (key, d) in deltas {
                self.pend_delta(key, d);
            }
            let result = match failure {
                Some(e) => Err(e),
                None if needed <= 1 || keys.is_empty() => Ok(()),
                None => Err(Error::NotEnoughReplicas { needed, reachable: reachable.len() + 1 }),
            };
            match result.and_then(|()| self.commit_ticket(keys.iter().map(String::as_str))) {
                Ok(ticket) => {
                    self.after_commit(ticket, ReplicatorAction::ReplyUpdate { reply, result: Ok(fenced) }, out)
                }
                Err(e) => out.push(ReplicatorAction::ReplyUpdate { reply, result: Err(e) }),
            }
            if self.pending_delta_elements > MAX_PENDING_DELTA_ELEMENTS {
                self.flush_deltas(out);
            }
            return;
        }
        // Earlier local changes of these keys ride along.
        let (deltas, values) = self.outgoing(deltas, unchanged);
        let op = self.next_op();
        ReplicatorStatCells::add(&self.stats.deltas_sent, reachable.len() * deltas.len());
        ReplicatorStatCells::add(&self.stats.full_values_sent, reachable.len() * values.len());
        let msg = ReplicatorMsg::WriteDelta { op, entries: deltas, values };
        let addressed = reachable.iter().map(|p| p.address.clone()).collect();
        out.push(ReplicatorAction::Broadcast { to: reachable, msg });
        let acked = HashSet::from([self.self_addr.clone()]);
        let consistency = c;
        self.writes.insert(op, PendingWrite { keys, fenced, consistency, needed, addressed, acked, deadline, reply });
    }

    /// Applies the modifies of an update in order. A key refused by its fence is set aside and
    /// the others go on; any other failure stops there (keys modified before it keep their
    /// local change, which spreads as with any local update).
    pub(super) fn apply_all(&mut self, updates: Vec<(String, Modify)>, out: &mut Vec<ReplicatorAction<R>>) -> Applied {
        let mut applied = Applied {
            keys: Vec::with_capacity(updates.len()),
            deltas: Vec::with_capacity(updates.len()),
            unchanged: Vec::new(),
            fenced: Vec::new(),
            failure: None,
        };
        for (key, modify) in updates {
            match self.apply_modify(&key, modify, out) {
                Ok(Some(d)) => {
                    applied.keys.push(key.clone());
                    applied.deltas.push((key, d));
                }
                Ok(None) => {
                    applied.keys.push(key.clone());
                    applied.unchanged.push(key);
                }
                Err(Error::Fenced { key, epoch, fence }) => applied.fenced.push((key, Fenced { epoch, fence })),
                Err(e) => {
                    applied.failure = Some(e);
                    break;
                }
            }
        }
        applied
    }

    /// The deltas of an update with the earlier local changes of its keys joined in, and the
    /// full values of the keys it did not change (a retried write must still reach the
    /// replicas).
    pub(super) fn outgoing(
        &mut self,
        mut deltas: Vec<(String, ReplicatedDelta)>,
        unchanged: Vec<String>,
    ) -> (KeyedDeltas, KeyedValues) {
        for (key, d) in deltas.iter_mut() {
            if let Some(p) = self.take_pending(key)
                && let Err((a, b)) = d.join(p)
            {
                warn!(%key, mine = a, theirs = b, "pending delta of another type dropped");
            }
        }
        let mut values = Vec::new();
        for key in unchanged {
            if let Some(p) = self.take_pending(&key) {
                deltas.push((key, p));
            } else if let Some(e) = self.data.get(&key) {
                values.push((key, e.value.clone()));
            }
        }
        (deltas, values)
    }

    /// A write a majority acknowledged: answered once committed here too.
    pub(super) fn finish_write(&mut self, op: u64, out: &mut Vec<ReplicatorAction<R>>) {
        let w = self.writes.remove(&op).expect("pending write");
        match self.commit_ticket(w.keys.iter().map(String::as_str)) {
            Ok(ticket) => {
                let reply = ReplicatorAction::ReplyUpdate { reply: w.reply, result: Ok(w.fenced) };
                self.after_commit_until(ticket, reply, Some(w.deadline), out)
            }
            Err(e) => out.push(ReplicatorAction::ReplyUpdate { reply: w.reply, result: Err(e) }),
        }
    }
}
