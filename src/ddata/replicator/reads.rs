//! Reads of one or several keys at a consistency level: one `Read` per replica for all the keys,
//! answered by `ReadResult` messages capped in bytes (a replica splits a large answer), merged
//! into the local values, with read repair of the replicas that answered stale.

use std::collections::BTreeMap;
use std::time::Duration;

use tracing::warn;

use super::{Action, Consistency, ReplicatorCore, ReplicatorMsg};
use crate::clock::Instant;
use crate::ddata::crdt::ReplicatedData;
use crate::ddata::stats::ReplicatorStats;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;

/// Most keys one read may ask a replica for.
pub(crate) const MAX_READ_KEYS: usize = 4096;

pub(super) struct PendingRead<R> {
    keys: Vec<String>,
    /// One reply for the whole read (`ReplyGetMany`) rather than for one key (`ReplyGet`).
    many: bool,
    needed: usize,
    addressed: Vec<UniqueAddress>,
    /// Per replica that answered: the digest of each key it has answered so far.
    responders: BTreeMap<UniqueAddress, (PeerAddr, Vec<Option<u64>>)>,
    /// The local values joined with every answer, per key.
    merged: Vec<Option<ReplicatedData>>,
    deadline: Instant,
    reply: R,
}

impl<R> PendingRead<R> {
    fn complete_responders(&self) -> usize {
        self.responders.values().filter(|(_, d)| d.iter().all(Option::is_some)).count()
    }
}

impl<R> ReplicatorCore<R> {
    /// Starts a read of `keys`; `many` selects the reply kind.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_get(
        &mut self,
        keys: Vec<String>,
        many: bool,
        c: Consistency,
        timeout: Duration,
        reply: R,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        let needed = c.needed(self.total_replicas());
        let reachable = self.reachable_replicas();
        let refusal = if keys.len() > MAX_READ_KEYS {
            Some(Error::Codec(format!("a read of {} keys is over the limit of {MAX_READ_KEYS}", keys.len())))
        } else if needed > 1 && reachable.len() + 1 < needed {
            Some(Error::NotEnoughReplicas { needed, reachable: reachable.len() + 1 })
        } else {
            None
        };
        if let Some(e) = refusal {
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
        out.push(Action::Broadcast { to: reachable, msg: ReplicatorMsg::Read { op, keys: keys.clone() } });
        let read = PendingRead {
            keys,
            many,
            needed,
            addressed,
            responders: BTreeMap::new(),
            merged: local,
            deadline: now + timeout,
            reply,
        };
        self.reads.insert(op, read);
    }

    /// Answers a peer's read with this node's values, in messages capped in bytes.
    pub(super) fn on_read(&mut self, from: PeerAddr, op: u64, keys: Vec<String>, out: &mut Vec<Action<R>>) {
        if keys.len() > MAX_READ_KEYS {
            ReplicatorStats::inc(&self.stats.rejected);
            return;
        }
        let values: Vec<(u32, Option<ReplicatedData>)> =
            keys.iter().enumerate().map(|(i, key)| (i as u32, self.local_value(key).cloned())).collect();
        ReplicatorStats::add(&self.stats.full_values_sent, values.iter().filter(|(_, v)| v.is_some()).count());
        let size = |(_, v): &(u32, Option<ReplicatedData>)| 8 + v.as_ref().map_or(0, ReplicatedData::approx_bytes);
        let mut parts = super::split_by_bytes(values, self.settings.max_message_bytes, size);
        if parts.is_empty() {
            parts.push(Vec::new()); // A read of no keys still gets its (empty) answer.
        }
        for values in parts {
            out.push(Action::Send { to: from.clone(), msg: ReplicatorMsg::ReadResult { op, values } });
        }
    }

    pub(super) fn on_read_result(
        &mut self,
        op: u64,
        from: PeerAddr,
        values: Vec<(u32, Option<ReplicatedData>)>,
        out: &mut Vec<Action<R>>,
    ) {
        let Some(r) = self.reads.get_mut(&op) else { return };
        if !r.addressed.contains(&from.address) {
            ReplicatorStats::inc(&self.stats.rejected);
            return;
        }
        let n = r.keys.len();
        let (_, digests) = r.responders.entry(from.address.clone()).or_insert_with(|| (from.clone(), vec![None; n]));
        for (i, value) in values {
            let i = i as usize;
            // An index out of range, or a key answered twice, is ignored.
            let Some(slot @ None) = digests.get_mut(i) else {
                ReplicatorStats::inc(&self.stats.rejected);
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

    /// Joins the merged answers into the local values, repairs stale replicas, replies.
    fn finish_read(&mut self, r: PendingRead<R>, out: &mut Vec<Action<R>>) {
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
            ReplicatorStats::add(&self.stats.full_values_sent, stale.len());
            let size = |(k, v): &(String, ReplicatedData)| k.len() + v.approx_bytes();
            for entries in super::split_by_bytes(stale, self.settings.max_message_bytes, size) {
                out.push(repair(&peer, entries));
            }
        }
        out.push(read_reply(r.reply, r.many, Ok(results)));
    }

    /// Fails the reads past their deadline.
    pub(super) fn expire_reads(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let expired: Vec<u64> = self.reads.iter().filter(|(_, r)| r.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let r = self.reads.remove(&op).expect("pending read");
            let acked = r.complete_responders() + 1;
            out.push(read_reply(r.reply, r.many, Err(Error::ConsistencyTimeout { needed: r.needed, acked })));
        }
    }
}

fn repair<R>(to: &PeerAddr, entries: Vec<(String, ReplicatedData)>) -> Action<R> {
    let msg = ReplicatorMsg::Gossip { entries, want: Vec::new(), want_buckets: Vec::new(), value_buckets: Vec::new() };
    Action::Send { to: to.clone(), msg }
}

fn read_reply<R>(reply: R, many: bool, result: Result<Vec<Option<ReplicatedData>>>) -> Action<R> {
    if many {
        Action::ReplyGetMany { reply, result }
    } else {
        let result = result.map(|mut v| v.pop().flatten());
        Action::ReplyGet { reply, result }
    }
}
