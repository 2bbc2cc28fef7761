//! The replicator as a sans-IO state machine: it takes inputs (local gets and updates, messages
//! from peers, membership, ticks) and returns actions (send, persist, reply, notify). The tokio
//! driver in [`super`] performs them; tests drive it directly with a fake clock.
//!
//! **Writes ship deltas.** An update takes the value's delta (what it changed) and sends that:
//! a majority update (of one or several keys) as one acknowledged [`ReplicatorMsg::WriteDelta`],
//! a local one into a per-key pending delta that [`ReplicatorMsg::DeltaPropagation`] ships
//! every `delta_interval`. Deltas are δ-states, so loss, duplication and reordering are
//! harmless; what a lost delta leaves behind, anti-entropy repairs. A full value is sent only
//! for a key an update did not change (so it has no delta) and by anti-entropy.
//!
//! **Anti-entropy is quiet once converged.** Each value keeps a canonical digest up to date; the
//! replicator keeps 256 key-space bucket sums of `(key, digest)` and their total (the root). A
//! round sends the root; only a peer whose root differs answers, with its bucket sums; only
//! the keys of differing buckets are compared; only differing values move, and large maps and
//! G-sets move by value bucket. Every message is capped in bytes. A merge that leaves the digest
//! unchanged persists and notifies nothing.
//!
//! **Trust.** Acks and read results count only from the replicas the operation addressed.

mod durability;
mod gossip;
mod hand_over;
mod protocol;
mod reads;
mod roster;
mod standing;
#[cfg(test)]
mod tests;
mod writer;
mod writes;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tracing::warn;

use super::crdt::{MergeError, ReplicatedData, ReplicatedDelta, WriteCtx};
use super::fenced::Fenced;
use super::stats::ReplicatorStatCells;
use crate::clock::Instant;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;
use durability::Durability;
pub(crate) use durability::KeyLog;
use hand_over::HandOver;
pub use protocol::Consistency;
pub(crate) use protocol::ReplicatorMsg;
pub(crate) use protocol::{Modify, PersistRecord, ReplicatorAction, ReplicatorInput};
use reads::PendingRead;
use roster::Roster;
#[cfg(test)]
use roster::RosterEntry;
pub(crate) use roster::{ROSTER_KEY, roster_entries};
use standing::Standing;
pub(crate) use writer::{RESERVATION_SPAN, StoreWriter};
use writes::PendingWrite;

/// Settings of the core.
#[derive(Debug, Clone)]
pub(crate) struct CoreSettings {
    pub durable_prefixes: Vec<String>,
    pub gossip_interval: Duration,
    /// How often deltas of local updates are shipped.
    pub delta_interval: Duration,
    /// Budget of one gossip or delta message (values are counted by their approximate encoded
    /// size; one value over the budget still goes alone).
    pub max_message_bytes: usize,
    /// A roster id absent this long is forgotten (`None`: only by an operator).
    pub forget_absent_after: Option<Duration>,
}

impl CoreSettings {
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn new(durable_prefixes: Vec<String>, gossip_interval: Duration) -> Self {
        CoreSettings {
            durable_prefixes,
            gossip_interval,
            delta_interval: Duration::from_millis(50),
            max_message_bytes: 1 << 20,
            forget_absent_after: None,
        }
    }
}

struct Entry {
    value: ReplicatedData,
    key_hash: u64,
    /// This key's share of its key-space bucket digest.
    contribution: u64,
    log: KeyLog,
}

/// Number of key-space buckets of the anti-entropy digest.
pub(crate) const KEY_BUCKETS: usize = 256;

/// Pending local deltas above this many elements ship at once instead of waiting for the timer.
const MAX_PENDING_DELTA_ELEMENTS: usize = 10_000;

/// The replicator state machine.
pub(crate) struct ReplicatorCore<R> {
    self_addr: UniqueAddress,
    ctx: WriteCtx,
    writer: StoreWriter,
    data: BTreeMap<String, Entry>,
    key_buckets: Vec<u64>,
    settings: CoreSettings,
    replicas: Vec<(PeerAddr, bool)>,
    /// The replica holders that are leaving.
    leaving: Vec<UniqueAddress>,
    gossip_targets: Vec<PeerAddr>,
    /// Which incarnations' messages are dropped (see [`standing::Standing`]).
    standing: Standing,
    next_gossip: Option<Instant>,
    next_delta_flush: Option<Instant>,
    pending_deltas: BTreeMap<String, ReplicatedDelta>,
    pending_delta_elements: usize,
    next_op: u64,
    writes: BTreeMap<u64, PendingWrite<R>>,
    reads: BTreeMap<u64, PendingRead<R>>,
    hand_over: Option<HandOver<R>>,
    /// Who durable quorums count (see [`roster`]).
    roster: Roster,
    rng: StdRng,
    stats: Arc<ReplicatorStatCells>,
    durability: Durability<R>,
}

fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

fn contribution(key_hash: u64, value: &ReplicatedData) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&key_hash.to_le_bytes());
    buf[8..].copy_from_slice(&value.digest().to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

impl<R> ReplicatorCore<R> {
    /// A core for incarnation `self_addr`, whose durable OR-set adds are written by `writer`.
    pub(crate) fn new(
        self_addr: UniqueAddress,
        writer: StoreWriter,
        settings: CoreSettings,
        stats: Arc<ReplicatorStatCells>,
    ) -> Self {
        let actor = format!("{}#{}", self_addr.node_id, self_addr.generation);
        let seed = xxhash_rust::xxh3::xxh3_64(actor.as_bytes());
        let roster = Roster::new(settings.forget_absent_after);
        ReplicatorCore {
            roster,
            self_addr,
            ctx: WriteCtx::new(actor, 0),
            writer,
            data: BTreeMap::new(),
            key_buckets: vec![0; KEY_BUCKETS],
            settings,
            replicas: Vec::new(),
            leaving: Vec::new(),
            gossip_targets: Vec::new(),
            standing: Standing::default(),
            next_gossip: None,
            next_delta_flush: None,
            pending_deltas: BTreeMap::new(),
            pending_delta_elements: 0,
            next_op: 1,
            writes: BTreeMap::new(),
            reads: BTreeMap::new(),
            hand_over: None,
            rng: StdRng::seed_from_u64(seed),
            stats,
            durability: Durability::default(),
        }
    }

    /// Installs values loaded from the durable store (before serving anything), with the
    /// state of each key's live deltas; new tickets continue above `max_seq`, the highest
    /// sequence in the store.
    pub(crate) fn load(&mut self, entries: Vec<(String, ReplicatedData, KeyLog)>, max_seq: u64) {
        self.durability.resume_after(max_seq);
        for (key, mut value, log) in entries {
            value.take_delta();
            self.durability.resume_after(log.last_ticket);
            self.durability.loaded_log(&key, &log);
            self.put_value(&key, value);
            if let Some(e) = self.data.get_mut(&key) {
                e.log = log;
            }
        }
        self.roster.changed();
    }

    /// Persist tickets not yet reported, and actions held for them (for tests and metrics).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn durability_backlog(&self) -> (usize, usize) {
        (self.durability.in_flight(), self.durability.held())
    }

    pub(crate) fn is_durable(&self, key: &str) -> bool {
        key == ROSTER_KEY || self.settings.durable_prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    pub(crate) fn local_value(&self, key: &str) -> Option<&ReplicatedData> {
        self.data.get(key).map(|e| &e.value)
    }

    fn total_replicas(&self) -> usize {
        self.replicas.len() + 1
    }

    fn reachable_replicas(&self) -> Vec<PeerAddr> {
        self.replicas.iter().filter(|(_, r)| *r).map(|(p, _)| p.clone()).collect()
    }

    /// Inserts a value under a key that has none.
    fn put_value(&mut self, key: &str, value: ReplicatedData) {
        let key_hash = key_hash(key);
        let c = contribution(key_hash, &value);
        let b = (key_hash % KEY_BUCKETS as u64) as usize;
        let log = KeyLog::default();
        if let Some(old) = self.data.insert(key.to_string(), Entry { value, key_hash, contribution: c, log }) {
            self.key_buckets[b] = self.key_buckets[b].wrapping_sub(old.contribution);
            if let Some(e) = self.data.get_mut(key) {
                e.log = old.log;
            }
        }
        self.key_buckets[b] = self.key_buckets[b].wrapping_add(c);
    }

    /// Recomputes a key's share of the root after its value changed; returns whether the
    /// value's digest changed.
    fn refresh(&mut self, key: &str) -> bool {
        let Some(e) = self.data.get_mut(key) else { return false };
        let c = contribution(e.key_hash, &e.value);
        if c == e.contribution {
            return false;
        }
        let b = (e.key_hash % KEY_BUCKETS as u64) as usize;
        self.key_buckets[b] = self.key_buckets[b].wrapping_sub(e.contribution).wrapping_add(c);
        e.contribution = c;
        true
    }

    pub(crate) fn root_digest(&self) -> u64 {
        self.key_buckets.iter().fold(0u64, |a, b| a.wrapping_add(*b))
    }

    /// Merges a full value into `key`; emits Persist/Changed only when the value changed.
    fn merge_in(&mut self, key: &str, incoming: ReplicatedData, out: &mut Vec<ReplicatorAction<R>>) -> Result<()> {
        ReplicatorStatCells::inc(&self.stats.values_merged);
        let changed = self.merge_with(key, |current| match current {
            Some(v) => v.try_merge(incoming).map(|()| None),
            None => Ok(Some(incoming)),
        })?;
        if changed {
            self.emit_changed(key, None, out);
        }
        Ok(())
    }

    /// Merges a delta into `key` (an absent key starts from the empty value of the delta's type);
    /// the delta itself is what gets persisted when the key's log has room (moved, not cloned).
    fn merge_delta_in(&mut self, key: &str, delta: ReplicatedDelta, out: &mut Vec<ReplicatorAction<R>>) -> Result<()> {
        ReplicatorStatCells::inc(&self.stats.deltas_merged);
        let changed = self.merge_with(key, |current| match current {
            Some(v) => v.merge_delta(&delta).map(|()| None),
            None => {
                let mut v = delta.empty_value();
                v.merge_delta(&delta)?;
                Ok(Some(v))
            }
        })?;
        if changed {
            self.emit_changed(key, Some(Cow::Owned(delta)), out);
        }
        Ok(())
    }

    /// Runs `merge` on the value of `key` (or, for an absent key, installs what it returns);
    /// true when the digest moved (the caller then emits Persist/Changed).
    fn merge_with(
        &mut self,
        key: &str,
        merge: impl FnOnce(Option<&mut ReplicatedData>) -> std::result::Result<Option<ReplicatedData>, MergeError>,
    ) -> Result<bool> {
        let changed = match self.data.get_mut(key) {
            Some(entry) => {
                merge(Some(&mut entry.value)).map_err(|e| merge_error(key, e))?;
                self.refresh(key)
            }
            None => match merge(None).map_err(|e| merge_error(key, e))? {
                Some(value) => {
                    self.put_value(key, value);
                    true
                }
                None => false,
            },
        };
        Ok(changed)
    }

    fn emit_changed(&mut self, key: &str, delta: Option<Cow<'_, ReplicatedDelta>>, out: &mut Vec<ReplicatorAction<R>>) {
        if key == ROSTER_KEY {
            self.roster.changed();
        }
        if self.is_durable(key) {
            self.persist(key, delta, out);
        }
        out.push(ReplicatorAction::Changed { key: key.to_string() });
    }

    /// Why a replicated write to `key` from a writer whose fence is `writer_fence` must be
    /// refused: the key is a fenced map here that a newer epoch has claimed.
    fn refusal(&self, key: &str, writer_fence: Option<u64>) -> Option<Fenced> {
        let writer_fence = writer_fence?;
        let fence = self.local_value(key)?.fence()?;
        (writer_fence < fence).then_some(Fenced { epoch: writer_fence, fence })
    }

    fn reject(&self, from: &PeerAddr, what: &str, e: &Error) {
        ReplicatorStatCells::inc(&self.stats.rejected);
        warn!(peer = %from.address, error = %e, "refusing {what}");
    }

    /// Handles one input at `now` (`wall_ms` feeds the LWW clock).
    pub(crate) fn handle(
        &mut self,
        input: ReplicatorInput<R>,
        now: Instant,
        wall_ms: u64,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        match input {
            ReplicatorInput::Get { key, consistency, timeout, reply } => {
                self.on_get(vec![key], false, consistency, now + timeout, reply, out)
            }
            ReplicatorInput::GetMany { keys, consistency, timeout, reply } => {
                self.on_get(keys, true, consistency, now + timeout, reply, out)
            }
            ReplicatorInput::Update { key, consistency, timeout, modify, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update(vec![(key, modify)], consistency, now + timeout, reply, out)
            }
            ReplicatorInput::UpdateMany { updates, consistency, timeout, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update(updates, consistency, now + timeout, reply, out)
            }
            ReplicatorInput::UpdateAndGetMany { updates, consistency, timeout, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update_and_get(updates, consistency, now + timeout, reply, out)
            }
            ReplicatorInput::Remote { from, msg } => {
                if self.quarantines(&from.address) {
                    return;
                }
                // An answer to an operation past its deadline fails it (and every other expired
                // one) instead of completing it; checked per answer, so the hot path stays O(1).
                if self.answers_an_expired_operation(&msg, now) {
                    self.expire(now, out);
                    return;
                }
                self.on_remote(from, msg, out)
            }
            ReplicatorInput::Members { replicas, gossip_targets, standing, holder, leaving } => {
                (self.replicas, self.leaving) = (replicas, leaving);
                self.gossip_targets = gossip_targets;
                self.standing.update(standing);
                self.ctx.now_ms = wall_ms;
                self.sync_roster(holder, now, out);
                self.recount_pending(out);
                self.retarget_hand_over(out);
            }
            ReplicatorInput::HandOver { timeout, reply } => self.on_hand_over(timeout, reply, now, out),
            ReplicatorInput::Forget { node_id, reply } => {
                self.ctx.now_ms = wall_ms;
                let result = self.forget_by_operator(&node_id, out).map(|()| Vec::new());
                out.push(ReplicatorAction::ReplyUpdate { reply, result });
            }
            ReplicatorInput::Tick => {
                self.ctx.now_ms = wall_ms;
                self.on_tick(now, out)
            }
            ReplicatorInput::Persisted { through, failure } => self.on_persisted(through, failure, now, out),
        }
    }

    fn pend_delta(&mut self, key: String, delta: ReplicatedDelta) {
        self.pending_delta_elements += delta.len();
        match self.pending_deltas.get_mut(&key) {
            Some(p) => {
                if let Err((a, b)) = p.join(delta) {
                    warn!(%key, mine = a, theirs = b, "pending delta of another type dropped");
                }
            }
            None => {
                self.pending_deltas.insert(key, delta);
            }
        }
    }

    fn take_pending(&mut self, key: &str) -> Option<ReplicatedDelta> {
        let d = self.pending_deltas.remove(key)?;
        self.pending_delta_elements = self.pending_delta_elements.saturating_sub(d.len());
        Some(d)
    }

    /// Ships every pending local delta to the gossip targets, in messages capped in bytes.
    fn flush_deltas(&mut self, out: &mut Vec<ReplicatorAction<R>>) {
        let pending = std::mem::take(&mut self.pending_deltas);
        self.pending_delta_elements = 0;
        if self.gossip_targets.is_empty() || pending.is_empty() {
            return;
        }
        let parts = split_by_bytes(pending, self.settings.max_message_bytes, |(k, d)| k.len() + d.approx_bytes());
        for entries in parts {
            ReplicatorStatCells::add(&self.stats.deltas_sent, entries.len() * self.gossip_targets.len());
            let msg = ReplicatorMsg::DeltaPropagation { entries };
            out.push(ReplicatorAction::Broadcast { to: self.gossip_targets.clone(), msg });
        }
    }

    fn next_op(&mut self) -> u64 {
        let op = self.next_op;
        self.next_op += 1;
        op
    }

    fn on_remote(&mut self, from: PeerAddr, msg: ReplicatorMsg, out: &mut Vec<ReplicatorAction<R>>) {
        match msg {
            ReplicatorMsg::WriteDelta { op, entries, values } => self.on_write_delta(from, op, entries, values, out),
            ReplicatorMsg::DeltaPropagation { entries } => {
                for (key, delta) in entries {
                    if let Err(e) = self.merge_delta_in(&key, delta, out) {
                        self.reject(&from, "propagated delta", &e);
                    }
                }
            }
            ReplicatorMsg::WriteAck { op } if self.hand_over.as_ref().is_some_and(|h| h.parts.contains_key(&op)) => {
                self.on_hand_over_ack(op, from.address, out)
            }
            ReplicatorMsg::WriteAck { op } => self.on_write_ack(op, from.address, out),
            ReplicatorMsg::WriteFenced { op, keys } => self.on_write_fenced(op, &from.address, keys),
            ReplicatorMsg::MergeThenRead { op, keys, entries, values } => {
                self.on_merge_then_read(from, op, keys, entries, values, out)
            }
            ReplicatorMsg::Read { op, keys } => self.on_read(from, op, keys, out),
            ReplicatorMsg::ReadResult { op, values } => self.on_read_result(op, from, values, out),
            ReplicatorMsg::Status { root } => self.on_status(from, root, out),
            ReplicatorMsg::KeyBuckets { digests } => self.on_key_buckets(from, digests, out),
            ReplicatorMsg::Digests { buckets, digests } => self.on_digests(from, buckets, digests, out),
            ReplicatorMsg::Gossip { entries, want, want_buckets, value_buckets } => {
                self.on_gossip(from, entries, want, want_buckets, value_buckets, out)
            }
        }
    }

    /// A writer's delta or value write: merged unless fenced; acknowledged, once committed
    /// here, only when every key merged.
    fn on_write_delta(
        &mut self,
        from: PeerAddr,
        op: u64,
        entries: Vec<(String, ReplicatedDelta)>,
        values: Vec<(String, ReplicatedData)>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let mut ok = true;
        let mut keys = Vec::with_capacity(entries.len() + values.len());
        let mut fenced = Vec::new();
        for (key, delta) in entries {
            if let Some(refusal) = self.refusal(&key, delta.fence()) {
                fenced.push((key, refusal));
                continue;
            }
            if let Err(e) = self.merge_delta_in(&key, delta, out) {
                self.reject(&from, "replicated delta", &e);
                ok = false;
            }
            keys.push(key);
        }
        for (key, value) in values {
            if let Some(refusal) = self.refusal(&key, value.fence()) {
                fenced.push((key, refusal));
                continue;
            }
            if let Err(e) = self.merge_in(&key, value, out) {
                self.reject(&from, "replicated value", &e);
                ok = false;
            }
            keys.push(key);
        }
        if !fenced.is_empty() {
            ReplicatorStatCells::add(&self.stats.fenced_writes, fenced.len());
            out.push(ReplicatorAction::Send { to: from.clone(), msg: ReplicatorMsg::WriteFenced { op, keys: fenced } });
        }
        // A write with a refused key is not acknowledged: the writer must not count
        // this replica for it. The ack leaves once the keys are committed here.
        if ok && let Ok(ticket) = self.commit_ticket(keys.iter().map(String::as_str)) {
            self.after_commit(ticket, ReplicatorAction::Send { to: from, msg: ReplicatorMsg::WriteAck { op } }, out);
        }
    }

    fn on_write_ack(&mut self, op: u64, from: UniqueAddress, out: &mut Vec<ReplicatorAction<R>>) {
        let done = match self.writes.get_mut(&op) {
            Some(w) if w.addressed.contains(&from) => {
                w.acked.insert(from);
                w.acked.len() >= w.needed
            }
            Some(_) => {
                ReplicatorStatCells::inc(&self.stats.rejected);
                false
            }
            None => false,
        };
        if done {
            self.finish_write(op, out);
        }
    }

    fn on_write_fenced(&mut self, op: u64, from: &UniqueAddress, keys: Vec<(String, Fenced)>) {
        match self.writes.get_mut(&op) {
            Some(w) if w.addressed.contains(from) => {
                // Only keys of this write, each once: a peer cannot grow the list.
                for (key, refusal) in keys {
                    if let Some(i) = w.keys.iter().position(|k| *k == key) {
                        let key = w.keys.swap_remove(i);
                        w.fenced.push((key, refusal));
                    }
                }
            }
            Some(_) => ReplicatorStatCells::inc(&self.stats.rejected),
            None => {}
        }
    }

    /// Whether `msg` answers a write, read or hand-over whose deadline has passed.
    fn answers_an_expired_operation(&self, msg: &ReplicatorMsg, now: Instant) -> bool {
        match msg {
            ReplicatorMsg::WriteAck { op } | ReplicatorMsg::WriteFenced { op, .. } => {
                self.writes.get(op).is_some_and(|w| w.deadline <= now)
                    || self.hand_over.as_ref().is_some_and(|h| h.parts.contains_key(op) && h.deadline <= now)
            }
            ReplicatorMsg::ReadResult { op, .. } => self.reads.get(op).is_some_and(|r| r.deadline <= now),
            _ => false,
        }
    }

    /// Fails the writes and reads past their deadline.
    fn expire(&mut self, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        let expired: Vec<u64> = self.writes.iter().filter(|(_, w)| w.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let w = self.writes.remove(&op).expect("pending write");
            out.push(ReplicatorAction::ReplyUpdate {
                reply: w.reply,
                result: Err(Error::ConsistencyTimeout { needed: w.needed, acked: w.acked.len() }),
            });
        }
        self.expire_reads(now, out);
        if self.hand_over.as_ref().is_some_and(|h| h.deadline <= now) {
            let reachable = self.hand_over_targets().0.len();
            let h = self.hand_over.take().expect("hand-over");
            let result = if h.waiting {
                // Never a majority of the staying roster reachable.
                Err(Error::NotEnoughReplicas { needed: h.needed, reachable })
            } else {
                let acked = h.parts.values().map(|part| part.acked.len()).min().unwrap_or(0);
                Err(Error::ConsistencyTimeout { needed: h.needed, acked })
            };
            out.push(ReplicatorAction::ReplyUpdate { reply: h.reply, result });
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        self.rewrite_failed(now, out);
        self.expire(now, out);
        self.forget_long_absent(now, out);
        // A hand-over waiting for the roster to allow a majority: counted again.
        self.start_hand_over_parts(out);
        if self.next_delta_flush.is_none_or(|t| t <= now) {
            self.next_delta_flush = Some(now + self.settings.delta_interval);
            self.flush_deltas(out);
        }
        if self.next_gossip.is_none_or(|t| t <= now) {
            self.next_gossip = Some(now + self.settings.gossip_interval);
            if !self.gossip_targets.is_empty() {
                let i = self.rng.random_range(0..self.gossip_targets.len());
                let to = self.gossip_targets[i].clone();
                ReplicatorStatCells::inc(&self.stats.digest_rounds);
                out.push(ReplicatorAction::Send { to, msg: ReplicatorMsg::Status { root: self.root_digest() } });
            }
        }
    }
}

/// The same reply with its operation failed as timed out (other actions unchanged): what a
/// reply released past its operation's deadline becomes.
fn timed_out<R>(action: ReplicatorAction<R>) -> ReplicatorAction<R> {
    let timeout = || Error::ConsistencyTimeout { needed: 0, acked: 0 };
    match action {
        ReplicatorAction::ReplyUpdate { reply, result: Ok(_) } => {
            ReplicatorAction::ReplyUpdate { reply, result: Err(timeout()) }
        }
        ReplicatorAction::ReplyGetMany { reply, result: Ok(_) } => {
            ReplicatorAction::ReplyGetMany { reply, result: Err(timeout()) }
        }
        ReplicatorAction::ReplyGet { reply, result: Ok(_) } => {
            ReplicatorAction::ReplyGet { reply, result: Err(timeout()) }
        }
        other => other,
    }
}

/// Splits `items` into parts of at most `budget` bytes by `size` (an item over the budget goes
/// alone); never returns an empty part.
fn split_by_bytes<T>(items: impl IntoIterator<Item = T>, budget: usize, size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut parts: Vec<Vec<T>> = Vec::new();
    let mut bytes = 0;
    for item in items {
        let n = size(&item);
        match parts.last_mut() {
            Some(part) if bytes + n <= budget => part.push(item),
            _ => {
                parts.push(vec![item]);
                bytes = 0;
            }
        }
        bytes += n;
    }
    parts
}

fn merge_error(key: &str, e: MergeError) -> Error {
    match e {
        MergeError::WrongType { mine, theirs } => {
            Error::WrongDataType { key: key.to_string(), expected: mine, found: theirs }
        }
        MergeError::Invalid(e) => Error::Codec(format!("value of {key:?} refused: {e}")),
    }
}
