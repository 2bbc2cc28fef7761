//! Reads of one or several keys at a consistency level: one `Read` per replica for all the keys,
//! answered by `ReadResult` messages capped in bytes (a replica splits a large answer), merged
//! into the local values, with read repair of the replicas that answered stale.

use std::collections::BTreeMap;

use tracing::warn;

use super::{Consistency, ReplicatorAction, ReplicatorCore, ReplicatorMsg};
use crate::clock::Instant;
use crate::ddata::crdt::{ReplicatedData, ReplicatedDelta};
use crate::ddata::fenced::Fenced;
use crate::ddata::stats::ReplicatorStatCells;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;

/// Most keys one read may ask a replica for.
pub(crate) const MAX_READ_KEYS: usize = 4096;

pub(super) struct PendingRead<R> {
    keys: Vec<String>,
    /// One reply for the whole read (`ReplyGetMany`) rather than for one key (`ReplyGet`).
    many: bool,
    /// A read after a local write (`UpdateAndGetMany`): the reply also waits for the write's
    /// local commit.
    after_write: bool,
    /// The level asked for: counted again when the membership changes (see `recount_pending`).
    consistency: Consistency,
    needed: usize,
    addressed: Vec<UniqueAddress>,
    /// Per replica that answered: the digest of each key it has answered so far.
    responders: BTreeMap<UniqueAddress, (PeerAddr, Vec<Option<u64>>)>,
    /// The local values joined with every answer, per key.
    merged: Vec<Option<ReplicatedData>>,
    pub(super) deadline: Instant,
    reply: R,
}

impl<R> PendingRead<R> {
    fn complete_responders(&self) -> usize {
        self.responders.values().filter(|(_, d)| d.iter().all(Option::is_some)).count()
    }
}

impl<R> ReplicatorCore<R> {
    /// Starts a read of `keys`; `many` selects the reply kind.
    pub(super) fn on_get(
        &mut self,
        keys: Vec<String>,
        many: bool,
        c: Consistency,
        deadline: Instant,
        reply: R,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let reachable = self.reachable_replicas();
        let counted = self.replicas_counted(keys.iter().map(String::as_str));
        let needed = c.needed_of(counted, reachable.len() + 1);
        if let Some(e) = read_refusal(keys.len(), needed, reachable.len()) {
            out.push(read_reply(reply, many, Err(e)));
            return;
        }
        let local: Vec<Option<ReplicatedData>> = keys.iter().map(|k| self.local_value(k).cloned()).collect();
        if needed <= 1 {
            out.push(read_reply(reply, many, Ok(local)));
            return;
        }
        let op = self.next_op();
        let addressed = reachable.iter().map(|p| p.address.clone()).collect();
        out.push(ReplicatorAction::Broadcast { to: reachable, msg: ReplicatorMsg::Read { op, keys: keys.clone() } });
        let read = PendingRead {
            keys,
            many,
            after_write: false,
            consistency: c,
            needed,
            addressed,
            responders: BTreeMap::new(),
            merged: local,
            deadline,
            reply,
        };
        self.reads.insert(op, read);
    }

    /// Applies `updates` here, then reads their keys at `c` from replicas that merge and store
    /// the same updates before they answer: every answer counted already holds the write. A
    /// new allocation's claim uses it, so that no replica it read from can still take a write
    /// of an older epoch afterwards. Answered with `ReplyGetMany` once the local write is
    /// committed too.
    pub(super) fn on_update_and_get(
        &mut self,
        updates: Vec<(String, super::Modify)>,
        c: Consistency,
        deadline: Instant,
        reply: R,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let reachable = self.reachable_replicas();
        let counted = self.replicas_counted(updates.iter().map(|(k, _)| k.as_str()));
        let needed = c.needed_of(counted, reachable.len() + 1);
        if let Some(e) = read_refusal(updates.len(), needed, reachable.len()) {
            out.push(read_reply(reply, true, Err(e)));
            return;
        }
        let all_keys: Vec<String> = updates.iter().map(|(k, _)| k.clone()).collect();
        let applied = self.apply_all(updates, out);
        if let Some(e) = applied.failure {
            out.push(read_reply(reply, true, Err(e)));
            return;
        }
        if let Some((key, Fenced { epoch, fence })) = applied.fenced.into_iter().next() {
            out.push(read_reply(reply, true, Err(Error::Fenced { key, epoch, fence })));
            return;
        }
        let local: Vec<Option<ReplicatedData>> = all_keys.iter().map(|k| self.local_value(k).cloned()).collect();
        if needed <= 1 {
            for (key, d) in applied.deltas {
                self.pend_delta(key, d);
            }
            match self.commit_ticket(all_keys.iter().map(String::as_str)) {
                Ok(ticket) => self.after_commit(ticket, read_reply(reply, true, Ok(local)), out),
                Err(e) => out.push(read_reply(reply, true, Err(e))),
            }
            return;
        }
        let (entries, values) = self.outgoing(applied.deltas, applied.unchanged);
        let op = self.next_op();
        ReplicatorStatCells::add(&self.stats.deltas_sent, reachable.len() * entries.len());
        ReplicatorStatCells::add(&self.stats.full_values_sent, reachable.len() * values.len());
        let addressed = reachable.iter().map(|p| p.address.clone()).collect();
        let msg = ReplicatorMsg::MergeThenRead { op, keys: all_keys.clone(), entries, values };
        out.push(ReplicatorAction::Broadcast { to: reachable, msg });
        let read = PendingRead {
            keys: all_keys,
            many: true,
            after_write: true,
            consistency: c,
            needed,
            addressed,
            responders: BTreeMap::new(),
            merged: local,
            deadline,
            reply,
        };
        self.reads.insert(op, read);
    }

    /// A peer's [`ReplicatorMsg::MergeThenRead`]: merges its write, then answers the read once
    /// the write is committed here (a failed commit answers nothing: the reader must not count
    /// a replica that may lose the write).
    pub(super) fn on_merge_then_read(
        &mut self,
        from: PeerAddr,
        op: u64,
        keys: Vec<String>,
        entries: Vec<(String, ReplicatedDelta)>,
        values: Vec<(String, ReplicatedData)>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        if keys.len() > MAX_READ_KEYS || entries.len() + values.len() > keys.len() {
            ReplicatorStatCells::inc(&self.stats.rejected);
            return;
        }
        // Only the keys that are read may be written: a peer cannot write more than it reads.
        let mut written = Vec::with_capacity(entries.len() + values.len());
        for (key, delta) in entries {
            if !keys.contains(&key) {
                ReplicatorStatCells::inc(&self.stats.rejected);
                return;
            }
            if let Err(e) = self.merge_delta_in(&key, delta, out) {
                self.reject(&from, "delta of a read after a write", &e);
                return;
            }
            written.push(key);
        }
        for (key, value) in values {
            if !keys.contains(&key) {
                ReplicatorStatCells::inc(&self.stats.rejected);
                return;
            }
            if let Err(e) = self.merge_in(&key, value, out) {
                self.reject(&from, "value of a read after a write", &e);
                return;
            }
            written.push(key);
        }
        let Ok(ticket) = self.commit_ticket(written.iter().map(String::as_str)) else { return };
        for msg in self.read_results(op, &keys) {
            self.after_commit(ticket, ReplicatorAction::Send { to: from.clone(), msg }, out);
        }
    }

    /// Answers a peer's read with this node's values, in messages capped in bytes.
    pub(super) fn on_read(&mut self, from: PeerAddr, op: u64, keys: Vec<String>, out: &mut Vec<ReplicatorAction<R>>) {
        if keys.len() > MAX_READ_KEYS {
            ReplicatorStatCells::inc(&self.stats.rejected);
            return;
        }
        for msg in self.read_results(op, &keys) {
            out.push(ReplicatorAction::Send { to: from.clone(), msg });
        }
    }

    /// This node's values of `keys` as `ReadResult` messages capped in bytes.
    fn read_results(&self, op: u64, keys: &[String]) -> Vec<ReplicatorMsg> {
        let values: Vec<(u32, Option<ReplicatedData>)> =
            keys.iter().enumerate().map(|(i, key)| (i as u32, self.local_value(key).cloned())).collect();
        ReplicatorStatCells::add(&self.stats.full_values_sent, values.iter().filter(|(_, v)| v.is_some()).count());
        let size = |(_, v): &(u32, Option<ReplicatedData>)| 8 + v.as_ref().map_or(0, ReplicatedData::approx_bytes);
        let mut parts = super::split_by_bytes(values, self.settings.max_message_bytes, size);
        if parts.is_empty() {
            parts.push(Vec::new()); // A read of no keys still gets its (empty) answer.
        }
        parts.into_iter().map(|values| ReplicatorMsg::ReadResult { op, values }).collect()
    }

    pub(super) fn on_read_result(
        &mut self,
        op: u64,
        from: PeerAddr,
        values: Vec<(u32, Option<ReplicatedData>)>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let Some(r) = self.reads.get_mut(&op) else { return };
        if !r.addressed.contains(&from.address) {
            ReplicatorStatCells::inc(&self.stats.rejected);
            return;
        }
        let n = r.keys.len();
        let (_, digests) = r.responders.entry(from.address.clone()).or_insert_with(|| (from.clone(), vec![None; n]));
        for (i, value) in values {
            let i = i as usize;
            // An index out of range, or a key answered twice, is ignored.
            let Some(slot @ None) = digests.get_mut(i) else {
                ReplicatorStatCells::inc(&self.stats.rejected);
                continue;
            };
            *slot = Some(value.as_ref().map_or(0, ReplicatedData::digest));
            let Some(v) = value else { continue };
            match &mut r.merged[i] {
                Some(m) => {
                    if let Err((a, b)) = m.merge(v) {
                        warn!(key = %r.keys[i], mine = a, theirs = b, "read result of another type ignored");
                    }
                }
                empty => *empty = Some(v),
            }
        }
        if r.complete_responders() + 1 >= r.needed {
            let r = self.reads.remove(&op).expect("pending read");
            self.finish_read(r, out);
        }
    }

    /// After a membership change, each pending read and write counts the replicas of now
    /// when that needs fewer answers, and ends if it has them: a holder that left (its values
    /// handed over and its roster entry forgotten) or a member removed is waited for no more
    /// (seed 760002057: a shard's load read counted a node whose hand-over had just ended, it
    /// exited unanswered, and the shard stayed down for its restart backoff). Only answers of
    /// ids still counted count then (one that left may have acknowledged after its hand-over
    /// took its copies), and "every reachable replica" stays every replica it addressed that
    /// still counts. Never more than at the start: what was counted then already intersected
    /// every acknowledged write, and so does the roster of now (a holder only leaves it once
    /// its values are on a majority of the rest).
    pub(super) fn recount_pending(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let ops: Vec<(u64, bool)> =
            self.reads.keys().map(|op| (*op, true)).chain(self.writes.keys().map(|op| (*op, false))).collect();
        for (op, read) in ops {
            let (keys, addressed, c, before) = match read {
                true => self.reads.get(&op).map(|r| (&r.keys, &r.addressed, r.consistency, r.needed)),
                false => self.writes.get(&op).map(|w| (&w.keys, &w.addressed, w.consistency, w.needed)),
            }
            .expect("listed");
            let durable = keys.iter().any(|k| self.is_durable(k));
            let addressed: Vec<UniqueAddress> = addressed.clone();
            let still: Vec<UniqueAddress> =
                addressed.into_iter().filter(|a| self.counts_now(durable, &a.node_id)).collect();
            let needed = c.needed_of(self.replicas_counted_of(durable), still.len() + 1);
            if needed >= before {
                continue;
            }
            let done = if read {
                let r = self.reads.get_mut(&op).expect("listed");
                (r.needed, r.addressed) = (needed, still);
                let counted = &r.addressed;
                r.responders.retain(|id, _| counted.contains(id));
                r.complete_responders() + 1 >= needed
            } else {
                let w = self.writes.get_mut(&op).expect("listed");
                (w.needed, w.addressed) = (needed, still);
                let (me, counted) = (&self.self_addr, &w.addressed);
                w.acked.retain(|id| id == me || counted.contains(id));
                w.acked.len() >= needed
            };
            match (done, read) {
                (false, _) => {}
                (true, true) => {
                    let r = self.reads.remove(&op).expect("pending read");
                    self.finish_read(r, out);
                }
                (true, false) => self.finish_write(op, out),
            }
        }
    }

    /// Joins the merged answers into the local values, repairs stale replicas, replies.
    fn finish_read(&mut self, r: PendingRead<R>, out: &mut Vec<ReplicatorAction<R>>) {
        let mut results = Vec::with_capacity(r.keys.len());
        for (key, merged) in r.keys.iter().zip(r.merged) {
            if let Some(Err(e)) = merged.map(|m| self.merge_in(key, m, out)) {
                out.push(read_reply(r.reply, r.many, Err(e)));
                return;
            }
            results.push(self.local_value(key).cloned());
        }
        // Read repair: each replica that answered gets the keys it answered stale.
        for (peer, digests) in r.responders.into_values() {
            let stale: Vec<(String, ReplicatedData)> = r
                .keys
                .iter()
                .zip(&results)
                .zip(&digests)
                .filter_map(|((key, v), d)| {
                    let v = v.as_ref()?;
                    (d.is_some_and(|d| d != v.digest())).then(|| (key.clone(), v.clone()))
                })
                .collect();
            ReplicatorStatCells::add(&self.stats.full_values_sent, stale.len());
            let size = |(k, v): &(String, ReplicatedData)| k.len() + v.approx_bytes();
            for entries in super::split_by_bytes(stale, self.settings.max_message_bytes, size) {
                out.push(repair(&peer, entries));
            }
        }
        let reply = read_reply(r.reply, r.many, Ok(results));
        if r.after_write {
            // The local write (and what the answers merged here) must be committed first.
            match self.commit_ticket(r.keys.iter().map(String::as_str)) {
                Ok(ticket) => self.after_commit(ticket, reply, out),
                Err(e) => out.push(read_reply_of(reply, Err(e))),
            }
        } else {
            out.push(reply);
        }
    }

    /// Fails the reads past their deadline.
    pub(super) fn expire_reads(&mut self, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        let expired: Vec<u64> = self.reads.iter().filter(|(_, r)| r.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let r = self.reads.remove(&op).expect("pending read");
            let acked = r.complete_responders() + 1;
            out.push(read_reply(r.reply, r.many, Err(Error::ConsistencyTimeout { needed: r.needed, acked })));
        }
    }
}

fn repair<R>(to: &PeerAddr, entries: Vec<(String, ReplicatedData)>) -> ReplicatorAction<R> {
    let msg = ReplicatorMsg::Gossip { entries, want: Vec::new(), want_buckets: Vec::new(), value_buckets: Vec::new() };
    ReplicatorAction::Send { to: to.clone(), msg }
}

/// Why a read of `keys` keys that needs `needed` replicas (this node included) cannot start
/// with `reachable` other replicas reachable.
fn read_refusal(keys: usize, needed: usize, reachable: usize) -> Option<Error> {
    if keys > MAX_READ_KEYS {
        Some(Error::Codec(format!("a read of {keys} keys is over the limit of {MAX_READ_KEYS}")))
    } else if reachable + 1 < needed {
        Some(Error::NotEnoughReplicas { needed, reachable: reachable + 1 })
    } else {
        None
    }
}

/// The same reply handle with another result.
fn read_reply_of<R>(action: ReplicatorAction<R>, result: Result<Vec<Option<ReplicatedData>>>) -> ReplicatorAction<R> {
    match action {
        ReplicatorAction::ReplyGetMany { reply, .. } => read_reply(reply, true, result),
        ReplicatorAction::ReplyGet { reply, .. } => read_reply(reply, false, result),
        other => other,
    }
}

fn read_reply<R>(reply: R, many: bool, result: Result<Vec<Option<ReplicatedData>>>) -> ReplicatorAction<R> {
    if many {
        ReplicatorAction::ReplyGetMany { reply, result }
    } else {
        let result = result.map(|mut v| v.pop().flatten());
        ReplicatorAction::ReplyGet { reply, result }
    }
}
