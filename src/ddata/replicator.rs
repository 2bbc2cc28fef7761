//! The replicator as a sans-IO state machine: it takes inputs (local gets and updates, messages
//! from peers, membership, ticks) and returns actions (send, persist, reply, notify). The tokio
//! driver in [`super`] performs them; tests drive it directly with a fake clock.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use crate::clock::Instant;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::crdt::{ReplicatedData, WriteCtx};
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;

/// How many replicas must take part in a read or a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Only this node.
    Local,
    /// `min(N, max(N/2 + 1 + plus, min_cap))` replicas, this node included, where N counts the
    /// Up and Leaving members holding replicas (reachable or not).
    Majority {
        /// Extra replicas on top of a plain majority.
        plus: usize,
        /// Lower bound on the number of replicas.
        min_cap: usize,
    },
    /// Every replica.
    All,
}

impl Consistency {
    /// A plain majority.
    pub const MAJORITY: Consistency = Consistency::Majority { plus: 0, min_cap: 0 };

    /// Replicas needed out of `n`.
    pub fn needed(self, n: usize) -> usize {
        match self {
            Consistency::Local => 1,
            Consistency::Majority { plus, min_cap } => n.min((n / 2 + 1 + plus).max(min_cap)),
            Consistency::All => n,
        }
    }
}

/// Messages between replicators.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ReplicatorMsg {
    /// Merge this value; answer with [`ReplicatorMsg::WriteAck`] once it is stored.
    Write {
        /// Operation id of the writer.
        op: u64,
        /// Key.
        key: String,
        /// Full state.
        value: ReplicatedData,
    },
    /// The write was merged (and persisted, for durable keys).
    WriteAck {
        /// Operation id.
        op: u64,
    },
    /// Send me your value of `key`.
    Read {
        /// Operation id of the reader.
        op: u64,
        /// Key.
        key: String,
    },
    /// Answer to [`ReplicatorMsg::Read`].
    ReadResult {
        /// Operation id.
        op: u64,
        /// The value, if any.
        value: Option<ReplicatedData>,
    },
    /// Anti-entropy probe: a digest over all keys.
    Status {
        /// Hash over every (key, value digest).
        root: u64,
    },
    /// Per-key digests, sent when the root digests differ.
    Digests {
        /// Key → value digest.
        digests: BTreeMap<String, u64>,
    },
    /// Values to merge, and keys whose values the sender wants back.
    Gossip {
        /// Values.
        entries: Vec<(String, ReplicatedData)>,
        /// Keys to send back.
        want: Vec<String>,
    },
}

/// A boxed update of one key's value: changes an existing value in place (returning `None`) or,
/// for a key without a value, returns the new value. A value of the wrong type is an error and
/// must be left untouched.
pub(crate) type Modify =
    Box<dyn FnOnce(Option<&mut ReplicatedData>, &mut WriteCtx) -> Result<Option<ReplicatedData>> + Send>;

/// Inputs of the state machine; `R` is the caller's reply handle.
pub(crate) enum Input<R> {
    Get {
        key: String,
        consistency: Consistency,
        timeout: Duration,
        reply: R,
    },
    Update {
        key: String,
        consistency: Consistency,
        timeout: Duration,
        modify: Modify,
        reply: R,
    },
    Remote {
        from: PeerAddr,
        msg: ReplicatorMsg,
    },
    /// Replica holders other than this node (Up/Leaving with the role) and which are reachable;
    /// plus the members to gossip with.
    Members {
        replicas: Vec<(PeerAddr, bool)>,
        gossip_targets: Vec<PeerAddr>,
    },
    Tick,
}

/// Outputs; the driver performs every `Persist` of a batch before any `Send` or reply of it.
/// `Persist` and `Changed` name only the key: the driver reads the current value when it
/// performs them, so no value is cloned for them.
#[derive(Debug)]
pub(crate) enum Action<R> {
    Send {
        to: PeerAddr,
        msg: ReplicatorMsg,
    },
    /// The same message to several peers (encoded once).
    Broadcast {
        to: Vec<PeerAddr>,
        msg: ReplicatorMsg,
    },
    Persist {
        key: String,
    },
    ReplyGet {
        reply: R,
        result: Result<Option<ReplicatedData>>,
    },
    ReplyUpdate {
        reply: R,
        result: Result<()>,
    },
    Changed {
        key: String,
    },
}

struct Entry {
    value: ReplicatedData,
    digest: Option<u64>,
}

struct PendingWrite<R> {
    needed: usize,
    acked: HashSet<UniqueAddress>,
    deadline: Instant,
    reply: R,
}

struct PendingRead<R> {
    key: String,
    needed: usize,
    responders: Vec<(PeerAddr, u64)>,
    merged: Option<ReplicatedData>,
    deadline: Instant,
    reply: R,
}

/// Most entries sent in one gossip message; the rest follow in later rounds.
const MAX_GOSSIP_ENTRIES: usize = 64;

/// The replicator state machine.
pub(crate) struct ReplicatorCore<R> {
    self_addr: UniqueAddress,
    ctx: WriteCtx,
    data: BTreeMap<String, Entry>,
    durable_prefixes: Vec<String>,
    replicas: Vec<(PeerAddr, bool)>,
    gossip_targets: Vec<PeerAddr>,
    gossip_interval: Duration,
    next_gossip: Option<Instant>,
    next_op: u64,
    writes: BTreeMap<u64, PendingWrite<R>>,
    reads: BTreeMap<u64, PendingRead<R>>,
    rng: StdRng,
}

pub(crate) fn digest_of(value: &ReplicatedData) -> u64 {
    match rmp_serde::to_vec(value) {
        Ok(bytes) => xxhash_rust::xxh3::xxh3_64(&bytes),
        Err(_) => 0,
    }
}

impl<R> ReplicatorCore<R> {
    pub(crate) fn new(self_addr: UniqueAddress, durable_prefixes: Vec<String>, gossip_interval: Duration) -> Self {
        let actor = format!("{}#{}", self_addr.node_id, self_addr.generation);
        let seed = xxhash_rust::xxh3::xxh3_64(actor.as_bytes());
        ReplicatorCore {
            self_addr,
            ctx: WriteCtx { actor, clock: 0, now_ms: 0 },
            data: BTreeMap::new(),
            durable_prefixes,
            replicas: Vec::new(),
            gossip_targets: Vec::new(),
            gossip_interval,
            next_gossip: None,
            next_op: 1,
            writes: BTreeMap::new(),
            reads: BTreeMap::new(),
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Installs values loaded from the durable store (before serving anything).
    pub(crate) fn load(&mut self, entries: Vec<(String, ReplicatedData)>) {
        for (key, value) in entries {
            self.data.insert(key, Entry { value, digest: None });
        }
    }

    pub(crate) fn is_durable(&self, key: &str) -> bool {
        self.durable_prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    pub(crate) fn local_value(&self, key: &str) -> Option<&ReplicatedData> {
        self.data.get(key).map(|e| &e.value)
    }

    fn total_replicas(&self) -> usize {
        self.replicas.len() + 1
    }

    fn reachable_replicas(&self) -> impl Iterator<Item = &PeerAddr> {
        self.replicas.iter().filter(|(_, r)| *r).map(|(p, _)| p)
    }

    /// Merges `incoming` into the local value of `key`; emits Persist/Changed when it changed.
    fn merge_in(&mut self, key: &str, incoming: ReplicatedData, out: &mut Vec<Action<R>>) -> Result<()> {
        // Equal incoming digests are skipped: anti-entropy and read repair only send values
        // that differ, so comparing whole values (a clone per merge) would cost more than the
        // rare redundant persist.
        match self.data.get_mut(key) {
            Some(entry) => {
                if let Err((mine, theirs)) = entry.value.merge(incoming) {
                    return Err(Error::WrongDataType { key: key.to_string(), expected: mine, found: theirs });
                }
                entry.digest = None;
            }
            None => {
                self.data.insert(key.to_string(), Entry { value: incoming, digest: None });
            }
        }
        self.emit_changed(key, out);
        Ok(())
    }

    fn emit_changed(&self, key: &str, out: &mut Vec<Action<R>>) {
        if self.is_durable(key) {
            out.push(Action::Persist { key: key.to_string() });
        }
        out.push(Action::Changed { key: key.to_string() });
    }

    fn digest(&mut self, key: &str) -> Option<u64> {
        let e = self.data.get_mut(key)?;
        Some(*e.digest.get_or_insert_with(|| digest_of(&e.value)))
    }

    fn root_digest(&mut self) -> u64 {
        let keys: Vec<String> = self.data.keys().cloned().collect();
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for k in keys {
            let d = self.digest(&k).unwrap_or(0);
            h.update(k.as_bytes());
            h.update(&d.to_le_bytes());
        }
        h.digest()
    }

    /// Handles one input at `now` (`wall_ms` feeds the LWW clock).
    pub(crate) fn handle(&mut self, input: Input<R>, now: Instant, wall_ms: u64, out: &mut Vec<Action<R>>) {
        match input {
            Input::Get { key, consistency, timeout, reply } => self.on_get(key, consistency, timeout, reply, now, out),
            Input::Update { key, consistency, timeout, modify, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update(key, consistency, timeout, modify, reply, now, out)
            }
            Input::Remote { from, msg } => self.on_remote(from, msg, out),
            Input::Members { replicas, gossip_targets } => {
                self.replicas = replicas;
                self.gossip_targets = gossip_targets;
            }
            Input::Tick => self.on_tick(now, out),
        }
    }

    fn on_get(
        &mut self,
        key: String,
        c: Consistency,
        timeout: Duration,
        reply: R,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        let needed = c.needed(self.total_replicas());
        let local = self.local_value(&key).cloned();
        if needed <= 1 {
            out.push(Action::ReplyGet { reply, result: Ok(local) });
            return;
        }
        let reachable: Vec<PeerAddr> = self.reachable_replicas().cloned().collect();
        if reachable.len() + 1 < needed {
            out.push(Action::ReplyGet {
                reply,
                result: Err(Error::NotEnoughReplicas { needed, reachable: reachable.len() + 1 }),
            });
            return;
        }
        let op = self.next_op();
        out.push(Action::Broadcast { to: reachable, msg: ReplicatorMsg::Read { op, key: key.clone() } });
        self.reads.insert(
            op,
            PendingRead { key, needed, responders: Vec::new(), merged: local, deadline: now + timeout, reply },
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn on_update(
        &mut self,
        key: String,
        c: Consistency,
        timeout: Duration,
        modify: Modify,
        reply: R,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        let existing = self.data.get_mut(&key);
        let had_value = existing.is_some();
        match modify(existing.map(|e| &mut e.value), &mut self.ctx) {
            Ok(Some(created)) if !had_value => {
                self.data.insert(key.clone(), Entry { value: created, digest: None });
            }
            Ok(_) => {
                if let Some(e) = self.data.get_mut(&key) {
                    e.digest = None;
                }
            }
            Err(e) => {
                out.push(Action::ReplyUpdate { reply, result: Err(e) });
                return;
            }
        }
        self.emit_changed(&key, out);
        let needed = c.needed(self.total_replicas());
        if needed <= 1 {
            out.push(Action::ReplyUpdate { reply, result: Ok(()) });
            return;
        }
        let reachable: Vec<PeerAddr> = self.reachable_replicas().cloned().collect();
        if reachable.len() + 1 < needed {
            out.push(Action::ReplyUpdate {
                reply,
                result: Err(Error::NotEnoughReplicas { needed, reachable: reachable.len() + 1 }),
            });
            return;
        }
        let op = self.next_op();
        let value = self.data[&key].value.clone();
        out.push(Action::Broadcast { to: reachable, msg: ReplicatorMsg::Write { op, key, value } });
        let acked = HashSet::from([self.self_addr.clone()]);
        self.writes.insert(op, PendingWrite { needed, acked, deadline: now + timeout, reply });
    }

    fn next_op(&mut self) -> u64 {
        let op = self.next_op;
        self.next_op += 1;
        op
    }

    fn on_remote(&mut self, from: PeerAddr, msg: ReplicatorMsg, out: &mut Vec<Action<R>>) {
        match msg {
            ReplicatorMsg::Write { op, key, value } => match self.merge_in(&key, value, out) {
                Ok(()) => out.push(Action::Send { to: from, msg: ReplicatorMsg::WriteAck { op } }),
                Err(e) => warn!(peer = %from.address, error = %e, "refusing replicated write"),
            },
            ReplicatorMsg::WriteAck { op } => {
                let done = match self.writes.get_mut(&op) {
                    Some(w) => {
                        w.acked.insert(from.address);
                        w.acked.len() >= w.needed
                    }
                    None => false,
                };
                if done {
                    let w = self.writes.remove(&op).expect("pending write");
                    out.push(Action::ReplyUpdate { reply: w.reply, result: Ok(()) });
                }
            }
            ReplicatorMsg::Read { op, key } => {
                let value = self.local_value(&key).cloned();
                out.push(Action::Send { to: from, msg: ReplicatorMsg::ReadResult { op, value } });
            }
            ReplicatorMsg::ReadResult { op, value } => self.on_read_result(op, from, value, out),
            ReplicatorMsg::Status { root } => {
                if root != self.root_digest() {
                    let keys: Vec<String> = self.data.keys().cloned().collect();
                    let digests = keys.into_iter().filter_map(|k| Some((k.clone(), self.digest(&k)?))).collect();
                    out.push(Action::Send { to: from, msg: ReplicatorMsg::Digests { digests } });
                }
            }
            ReplicatorMsg::Digests { digests } => {
                let keys: Vec<String> = self.data.keys().cloned().collect();
                let mut entries = Vec::new();
                for k in keys {
                    if digests.get(&k) != self.digest(&k).as_ref() && entries.len() < MAX_GOSSIP_ENTRIES {
                        entries.push((k.clone(), self.data[&k].value.clone()));
                    }
                }
                let want: Vec<String> = digests
                    .iter()
                    .filter(|(k, d)| self.data.get(*k).is_none_or(|e| e.digest != Some(**d)))
                    .map(|(k, _)| k.clone())
                    .take(MAX_GOSSIP_ENTRIES)
                    .collect();
                if !entries.is_empty() || !want.is_empty() {
                    out.push(Action::Send { to: from, msg: ReplicatorMsg::Gossip { entries, want } });
                }
            }
            ReplicatorMsg::Gossip { entries, want } => {
                for (key, value) in entries {
                    if let Err(e) = self.merge_in(&key, value, out) {
                        warn!(peer = %from.address, error = %e, "refusing gossiped value");
                    }
                }
                let back: Vec<(String, ReplicatedData)> =
                    want.into_iter().filter_map(|k| Some((k.clone(), self.data.get(&k)?.value.clone()))).collect();
                if !back.is_empty() {
                    out.push(Action::Send { to: from, msg: ReplicatorMsg::Gossip { entries: back, want: Vec::new() } });
                }
            }
        }
    }

    fn on_read_result(&mut self, op: u64, from: PeerAddr, value: Option<ReplicatedData>, out: &mut Vec<Action<R>>) {
        let Some(r) = self.reads.get_mut(&op) else { return };
        if r.responders.iter().any(|(p, _)| p.address == from.address) {
            return;
        }
        let digest = value.as_ref().map_or(0, digest_of);
        r.responders.push((from, digest));
        if let Some(v) = value {
            match &mut r.merged {
                Some(m) => {
                    if let Err((a, b)) = m.merge(v) {
                        warn!(key = %r.key, mine = a, theirs = b, "read result of another type ignored");
                    }
                }
                None => r.merged = Some(v),
            }
        }
        if r.responders.len() + 1 >= r.needed {
            let r = self.reads.remove(&op).expect("pending read");
            if let Some(Err(e)) = r.merged.map(|m| self.merge_in(&r.key, m, out)) {
                out.push(Action::ReplyGet { reply: r.reply, result: Err(e) });
                return;
            }
            let result = self.local_value(&r.key).cloned();
            // Read repair: replicas that answered with an older value get the merged one.
            let final_digest = result.as_ref().map_or(0, digest_of);
            if let Some(v) = &result {
                let stale: Vec<PeerAddr> =
                    r.responders.into_iter().filter(|(_, d)| *d != final_digest).map(|(p, _)| p).collect();
                if !stale.is_empty() {
                    let msg = ReplicatorMsg::Gossip { entries: vec![(r.key.clone(), v.clone())], want: Vec::new() };
                    out.push(Action::Broadcast { to: stale, msg });
                }
            }
            out.push(Action::ReplyGet { reply: r.reply, result: Ok(result) });
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let expired: Vec<u64> = self.writes.iter().filter(|(_, w)| w.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let w = self.writes.remove(&op).expect("pending write");
            out.push(Action::ReplyUpdate {
                reply: w.reply,
                result: Err(Error::ConsistencyTimeout { needed: w.needed, acked: w.acked.len() }),
            });
        }
        let expired: Vec<u64> = self.reads.iter().filter(|(_, r)| r.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let r = self.reads.remove(&op).expect("pending read");
            out.push(Action::ReplyGet {
                reply: r.reply,
                result: Err(Error::ConsistencyTimeout { needed: r.needed, acked: r.responders.len() + 1 }),
            });
        }
        let due = self.next_gossip.is_none_or(|t| t <= now);
        if due {
            self.next_gossip = Some(now + self.gossip_interval);
            if !self.gossip_targets.is_empty() {
                let i = self.rng.random_range(0..self.gossip_targets.len());
                let to = self.gossip_targets[i].clone();
                let root = self.root_digest();
                out.push(Action::Send { to, msg: ReplicatorMsg::Status { root } });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddata::crdt::{Crdt, GSet};

    fn peer(id: &str) -> PeerAddr {
        PeerAddr { address: UniqueAddress::new(id, 1), messaging_addr: "127.0.0.1:1".parse().unwrap() }
    }

    fn core(id: &str) -> ReplicatorCore<u32> {
        ReplicatorCore::new(UniqueAddress::new(id, 1), vec!["shard-".into()], Duration::from_secs(1))
    }

    fn add(member: &'static str) -> Modify {
        Box::new(move |cur, _ctx| match cur {
            Some(ReplicatedData::GSet(s)) => {
                s.insert(member);
                Ok(None)
            }
            Some(other) => Err(Error::WrongDataType { key: "k".into(), expected: "GSet", found: other.type_name() }),
            None => {
                let mut s = GSet::default();
                s.insert(member);
                Ok(Some(s.into_data()))
            }
        })
    }

    #[test]
    fn majority_formula_matches_akka_plus_and_min_cap() {
        let c = Consistency::Majority { plus: 3, min_cap: 5 };
        assert_eq!(c.needed(1), 1);
        assert_eq!(c.needed(3), 3);
        assert_eq!(c.needed(5), 5);
        assert_eq!(c.needed(10), 9);
        assert_eq!(c.needed(20), 14);
        assert_eq!(Consistency::MAJORITY.needed(5), 3);
        assert_eq!(Consistency::MAJORITY.needed(4), 3);
        assert_eq!(Consistency::All.needed(4), 4);
    }

    #[test]
    fn majority_write_completes_on_enough_acks_and_times_out_otherwise() {
        let mut c = core("a");
        let peers = vec![(peer("b"), true), (peer("c"), true), (peer("d"), true), (peer("e"), true)];
        c.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
        let now = Instant::now();
        let mut out = Vec::new();
        c.handle(
            Input::Update {
                key: "shard-1".into(),
                consistency: Consistency::MAJORITY,
                timeout: Duration::from_secs(1),
                modify: add("x"),
                reply: 7,
            },
            now,
            1,
            &mut out,
        );
        // Durable key: persisted, then 4 writes.
        assert!(matches!(out[0], Action::Persist { .. }));
        let (op, fanout) = out
            .iter()
            .find_map(|a| match a {
                Action::Broadcast { to, msg: ReplicatorMsg::Write { op, .. } } => Some((*op, to.len())),
                _ => None,
            })
            .unwrap();
        assert_eq!(fanout, 4);
        let mut out = Vec::new();
        c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
        assert!(out.is_empty(), "2 of 3");
        c.handle(Input::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
        assert!(out.is_empty(), "a duplicate ack does not count");
        c.handle(Input::Remote { from: peer("c"), msg: ReplicatorMsg::WriteAck { op } }, now, 1, &mut out);
        assert!(matches!(out[0], Action::ReplyUpdate { reply: 7, result: Ok(()) }));

        let mut out = Vec::new();
        c.handle(
            Input::Update {
                key: "k2".into(),
                consistency: Consistency::MAJORITY,
                timeout: Duration::from_secs(1),
                modify: add("y"),
                reply: 8,
            },
            now,
            1,
            &mut out,
        );
        let mut out = Vec::new();
        c.handle(Input::Tick, now + Duration::from_secs(2), 1, &mut out);
        assert!(out.iter().any(|a| matches!(
            a,
            Action::ReplyUpdate { reply: 8, result: Err(Error::ConsistencyTimeout { needed: 3, acked: 1 }) }
        )));
        // The local value stays updated.
        assert!(c.local_value("k2").is_some());
    }

    #[test]
    fn too_few_reachable_replicas_fail_at_once_but_keep_the_local_update() {
        let mut c = core("a");
        let peers = vec![(peer("b"), true), (peer("c"), false), (peer("d"), false), (peer("e"), false)];
        c.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
        let mut out = Vec::new();
        c.handle(
            Input::Update {
                key: "k".into(),
                consistency: Consistency::MAJORITY,
                timeout: Duration::from_secs(1),
                modify: add("x"),
                reply: 1,
            },
            Instant::now(),
            1,
            &mut out,
        );
        assert!(out.iter().any(|a| matches!(
            a,
            Action::ReplyUpdate { result: Err(Error::NotEnoughReplicas { needed: 3, reachable: 2 }), .. }
        )));
        assert!(c.local_value("k").is_some());
    }

    #[test]
    fn majority_read_merges_answers_and_repairs_stale_replicas() {
        let mut a = core("a");
        let mut b = core("b");
        let peers = vec![(peer("b"), true), (peer("c"), true)];
        a.handle(Input::Members { replicas: peers, gossip_targets: vec![] }, Instant::now(), 0, &mut vec![]);
        b.handle(
            Input::Update {
                key: "k".into(),
                consistency: Consistency::Local,
                timeout: Duration::from_secs(1),
                modify: add("from-b"),
                reply: 0,
            },
            Instant::now(),
            1,
            &mut vec![],
        );
        let mut out = Vec::new();
        a.handle(
            Input::Get {
                key: "k".into(),
                consistency: Consistency::MAJORITY,
                timeout: Duration::from_secs(1),
                reply: 5,
            },
            Instant::now(),
            1,
            &mut out,
        );
        let op = out
            .iter()
            .find_map(|x| match x {
                Action::Broadcast { msg: ReplicatorMsg::Read { op, .. }, .. } => Some(*op),
                _ => None,
            })
            .unwrap();
        let value = b.local_value("k").cloned();
        let mut out = Vec::new();
        a.handle(
            Input::Remote { from: peer("b"), msg: ReplicatorMsg::ReadResult { op, value } },
            Instant::now(),
            1,
            &mut out,
        );
        let got = out
            .iter()
            .find_map(|x| match x {
                Action::ReplyGet { reply: 5, result: Ok(v) } => Some(v.clone()),
                _ => None,
            })
            .unwrap();
        let set = GSet::from_data(got.unwrap(), "k").unwrap();
        assert!(set.contains("from-b"));
    }

    #[test]
    fn anti_entropy_converges_two_replicas_and_then_sends_only_a_root_digest() {
        let mut a = core("a");
        let mut b = core("b");
        let now = Instant::now();
        for (c, m) in [(&mut a, "x"), (&mut b, "y")] {
            c.handle(
                Input::Update {
                    key: "k".into(),
                    consistency: Consistency::Local,
                    timeout: Duration::from_secs(1),
                    modify: add(m),
                    reply: 0,
                },
                now,
                1,
                &mut vec![],
            );
        }
        a.handle(
            Input::Members { replicas: vec![(peer("b"), true)], gossip_targets: vec![peer("b")] },
            now,
            0,
            &mut vec![],
        );
        let pa = peer("a");
        let pb = peer("b");
        // Pump messages between the two until quiet.
        let mut queue: Vec<(bool, ReplicatorMsg)> = Vec::new();
        let mut out = Vec::new();
        a.handle(Input::Tick, now, 1, &mut out);
        let mut rounds = 0;
        loop {
            for act in out.drain(..) {
                if let Action::Send { to, msg } = act {
                    queue.push((to.address == pb.address, msg));
                }
            }
            let Some((to_b, msg)) = queue.pop() else { break };
            rounds += 1;
            if to_b {
                b.handle(Input::Remote { from: pa.clone(), msg }, now, 1, &mut out);
            } else {
                a.handle(Input::Remote { from: pb.clone(), msg }, now, 1, &mut out);
            }
        }
        assert!(rounds <= 4, "status, digests, gossip, gossip-back: {rounds}");
        assert_eq!(a.local_value("k"), b.local_value("k"));
        // Converged: a tick sends a root digest and b answers nothing.
        let mut out = Vec::new();
        a.handle(Input::Tick, now + Duration::from_secs(2), 1, &mut out);
        let Some(Action::Send { msg, .. }) = out.pop() else { panic!("expected a status") };
        let mut out = Vec::new();
        b.handle(Input::Remote { from: pa, msg }, now, 1, &mut out);
        assert!(out.is_empty());
    }
}
