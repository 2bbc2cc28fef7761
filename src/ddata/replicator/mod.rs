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
mod reads;
mod roster;
mod standing;
#[cfg(test)]
mod tests;
mod writer;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::crdt::{MergeError, ReplicatedData, ReplicatedDelta, WriteCtx};
use super::fenced::Fenced;
use super::stats::ReplicatorStats;
use crate::clock::Instant;
use crate::error::{Error, Result};
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;
use durability::Durability;
pub(crate) use durability::{KeyLog, PersistRecord};
use hand_over::HandOver;
use reads::PendingRead;
use roster::Roster;
#[cfg(test)]
use roster::RosterEntry;
pub(crate) use roster::{ROSTER_KEY, roster_entries};
use standing::Standing;
pub(crate) use writer::{RESERVATION_SPAN, StoreWriter};

/// How many replicas must take part in a read or a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Only this node.
    Local,
    /// `min(N, max(N/2 + 1 + plus, min_cap))` replicas, this node included. For a durable key
    /// N is the roster: every replica holder by node id, reachable or not, member or downed,
    /// until it leaves gracefully or is forgotten (so downing never shrinks a durable quorum);
    /// for other keys, the Up and Leaving members holding replicas (reachable or not).
    Majority {
        /// Extra replicas on top of a plain majority.
        plus: usize,
        /// Lower bound on the number of replicas.
        min_cap: usize,
    },
    /// Every replica.
    All,
    /// Every replica reachable when the operation starts, and never fewer than
    /// `Majority { plus, min_cap }` needs. For rare reads that must see what a majority of an
    /// earlier, smaller membership acknowledged: replicas that joined since (or came back with
    /// an old disk) can make up a majority of their own, but the older holders are still
    /// reachable. A durable shard's claim reads this way.
    AllReachable {
        /// Extra replicas on top of a plain majority, as the floor.
        plus: usize,
        /// Lower bound on the number of replicas.
        min_cap: usize,
    },
}

impl Consistency {
    /// A plain majority.
    pub const MAJORITY: Consistency = Consistency::Majority { plus: 0, min_cap: 0 };

    /// Replicas needed out of `n` (for [`Consistency::AllReachable`], its majority floor; see
    /// [`Consistency::needed_of`]).
    pub fn needed(self, n: usize) -> usize {
        match self {
            Consistency::Local => 1,
            Consistency::Majority { plus, min_cap } | Consistency::AllReachable { plus, min_cap } => {
                n.min((n / 2 + 1 + plus).max(min_cap))
            }
            Consistency::All => n,
        }
    }

    /// Replicas needed out of `n`, `reachable` of which (this node included) can answer now.
    pub fn needed_of(self, n: usize, reachable: usize) -> usize {
        match self {
            Consistency::AllReachable { .. } => self.needed(n).max(reachable.min(n)),
            other => other.needed(n),
        }
    }
}

/// Number of key-space buckets of the anti-entropy digest.
pub(crate) const KEY_BUCKETS: usize = 256;

/// Messages between replicators.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ReplicatorMsg {
    /// Merge these deltas and values (one or more keys); answer with one
    /// [`ReplicatorMsg::WriteAck`] once all are stored.
    WriteDelta {
        /// Operation id of the writer.
        op: u64,
        /// Key → delta.
        entries: Vec<(String, ReplicatedDelta)>,
        /// Key → full value, for keys the update did not change (so they have no delta, but
        /// must still reach the replicas).
        values: Vec<(String, ReplicatedData)>,
    },
    /// The write was merged (and persisted, for durable keys).
    WriteAck {
        /// Operation id.
        op: u64,
    },
    /// Deltas of local updates; no answer.
    DeltaPropagation {
        /// Key → delta.
        entries: Vec<(String, ReplicatedDelta)>,
    },
    /// Send me your values of `keys` (at most `reads::MAX_READ_KEYS`, 4,096).
    Read {
        /// Operation id of the reader.
        op: u64,
        /// Keys.
        keys: Vec<String>,
    },
    /// Answer to [`ReplicatorMsg::Read`], or a part of it (a large answer is split by bytes).
    ReadResult {
        /// Operation id.
        op: u64,
        /// Index into the read's keys → the value, if any.
        values: Vec<(u32, Option<ReplicatedData>)>,
    },
    /// Anti-entropy probe: the root digest over all keys.
    Status {
        /// Sum of the key-space bucket digests.
        root: u64,
    },
    /// Answer to a differing root: the key-space bucket digests.
    KeyBuckets {
        /// 256 (`KEY_BUCKETS`) sums of `(key, value digest)` hashes.
        digests: Vec<u64>,
    },
    /// Per-key digests of the keys in some key-space buckets.
    Digests {
        /// Buckets whose keys are all listed.
        buckets: Vec<u16>,
        /// Key → value digest.
        digests: Vec<(String, u64)>,
    },
    /// Values (or value buckets) to merge, and what the sender wants back.
    Gossip {
        /// Values (whole, or the entries of some value buckets).
        entries: Vec<(String, ReplicatedData)>,
        /// Keys whose values the sender wants.
        want: Vec<String>,
        /// Keys whose value-bucket digests differ: the sender wants those buckets back.
        want_buckets: Vec<(String, Vec<u16>)>,
        /// Value-bucket digests of large differing values, for the receiver to compare.
        value_buckets: Vec<(String, Vec<u64>)>,
    },
    /// Some keys of a [`ReplicatorMsg::WriteDelta`] were refused: a newer epoch has claimed
    /// them here (sent before the `WriteAck` for the rest).
    WriteFenced {
        /// Operation id.
        op: u64,
        /// Key → the writer's fence and this replica's.
        keys: Vec<(String, Fenced)>,
    },
    /// Merge these deltas and values, store them (durable keys: commit), then answer like a
    /// [`ReplicatorMsg::Read`] of `keys`: a read whose every answer already holds the write
    /// (a new allocation's claim, which the answer must not predate).
    MergeThenRead {
        /// Operation id of the reader.
        op: u64,
        /// Keys to answer (at most `reads::MAX_READ_KEYS`).
        keys: Vec<String>,
        /// Key → delta to merge first.
        entries: Vec<(String, ReplicatedDelta)>,
        /// Key → full value to merge first.
        values: Vec<(String, ReplicatedData)>,
    },
}

/// A boxed update of one key's value: changes an existing value in place (returning `None`) or,
/// for a key without a value, returns the new value. A value of the wrong type is an error and
/// must be left untouched.
pub(crate) type Modify =
    Box<dyn FnOnce(Option<&mut ReplicatedData>, &mut WriteCtx) -> Result<Option<ReplicatedData>> + Send>;

/// Inputs of the state machine; `R` is the caller's reply handle.
// Remote messages carry values inline; inputs are moved once into the core, never stored.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Input<R> {
    Get {
        key: String,
        consistency: Consistency,
        timeout: Duration,
        reply: R,
    },
    /// Several keys read in one round (one `Read` per replica); answered with `ReplyGetMany`.
    GetMany {
        keys: Vec<String>,
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
    /// Several keys updated and replicated in one round (one message and one ack per replica).
    UpdateMany {
        updates: Vec<(String, Modify)>,
        consistency: Consistency,
        timeout: Duration,
        reply: R,
    },
    /// Updates applied here, then merged and stored by the replicas before they answer with
    /// their values of the same keys (answered with `ReplyGetMany`).
    UpdateAndGetMany {
        updates: Vec<(String, Modify)>,
        consistency: Consistency,
        timeout: Duration,
        reply: R,
    },
    /// A message from a peer. An answer to an operation past its deadline fails it (and the
    /// other expired ones) instead, so an answer that arrives (or is handled) late never
    /// completes one: an incarnation that
    /// was paused past its deadline (and may have been downed and replaced meanwhile) never
    /// acknowledges a write or a read it started before the pause. A message from an
    /// incarnation that has left good standing here is dropped (see `standing`).
    Remote {
        from: PeerAddr,
        msg: ReplicatorMsg,
    },
    /// Replica holders other than this node (Up/Leaving with the role) and which are reachable;
    /// plus the members to gossip with, and every incarnation in good standing (listed, neither
    /// Down nor Removed: [`crate::membership::MembershipSnapshot::standing_of`]). Built from a
    /// view by [`Input::members_of`].
    Members {
        replicas: Vec<(PeerAddr, bool)>,
        gossip_targets: Vec<PeerAddr>,
        standing: Vec<UniqueAddress>,
        /// This node is a replica holder itself (Up or Leaving, with the role): only then does
        /// it enter the roster.
        holder: bool,
        /// The replica holders that are leaving (a hand-over does not count them as staying).
        leaving: Vec<UniqueAddress>,
    },
    /// This node is leaving: write every value it holds to the members that stay, so no
    /// write it acknowledged leaves with it (seed 160000972: two of three nodes left one after
    /// the other, and ids that only they held were gone). Who stays is read from the latest
    /// `Members` (the holders not `leaving`), again on every change; it is done (answered
    /// with `ReplyUpdate`) once a majority of the staying roster acknowledged every part and
    /// this node's own forget, fails with `NotEnoughReplicas` at once when no other holder
    /// stays, and at `timeout` otherwise.
    HandOver {
        timeout: Duration,
        reply: R,
    },
    /// An operator's forget: `node_id` leaves the roster (see [`roster`]), so its copies no
    /// longer count in durable quorums. Refused (`BadRequest`) for this node, a replica holder
    /// now, or an id the roster does not count; answered with `ReplyUpdate`.
    Forget {
        node_id: String,
        reply: R,
    },
    Tick,
    /// The durable store committed every ticket up to `through` (in ticket order), or, with
    /// `failure` (the store's path and the error), the commit holding the tickets not yet
    /// reported failed after its retries.
    Persisted {
        through: u64,
        failure: Option<(std::path::PathBuf, String)>,
    },
}

/// Outputs. Sends and replies may be performed before the `Persist` actions of the same batch
/// complete: whatever claims durability (acks, update replies) is held by the core until
/// [`Input::Persisted`] covers its tickets. `Persist` of a snapshot and `Changed` name only the
/// key: the driver reads the current value when it performs them.
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
    /// Write `record` for `key` under `ticket` (tickets grow; the store commits them in order
    /// and reports with [`Input::Persisted`]).
    Persist {
        key: String,
        ticket: u64,
        record: PersistRecord,
    },
    /// Delete the log's records below `below` (no key needs them any more). Not acknowledged;
    /// a failed trim is covered by the next.
    TrimLog {
        below: u64,
    },
    ReplyGet {
        reply: R,
        result: Result<Option<ReplicatedData>>,
    },
    /// The values of a `GetMany`, in the order of its keys.
    ReplyGetMany {
        reply: R,
        result: Result<Vec<Option<ReplicatedData>>>,
    },
    /// The update's outcome: the keys refused by their fence (with the writer's and the
    /// refusing fence); every other key is written at the consistency asked.
    ReplyUpdate {
        reply: R,
        result: Result<Vec<(String, Fenced)>>,
    },
    Changed {
        key: String,
    },
    /// Reserve the store writer's OR-set counters below `ceiling`, under `ticket` (reported
    /// with [`Input::Persisted`] like a persist; see [`writer`]).
    ReserveCounters {
        ticket: u64,
        ceiling: u64,
    },
}

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

struct PendingWrite<R> {
    keys: Vec<String>,
    /// Keys refused by a fence, here or at a replica.
    fenced: Vec<(String, Fenced)>,
    /// The level asked for: counted again when the membership changes.
    consistency: Consistency,
    needed: usize,
    addressed: Vec<UniqueAddress>,
    acked: HashSet<UniqueAddress>,
    deadline: Instant,
    reply: R,
}

/// Deltas by key, as a write carries them.
type KeyedDeltas = Vec<(String, ReplicatedDelta)>;
/// Full values by key, as a write carries them.
type KeyedValues = Vec<(String, ReplicatedData)>;

/// An update's modifies applied locally.
struct Applied {
    /// Keys written (not refused).
    keys: Vec<String>,
    deltas: Vec<(String, ReplicatedDelta)>,
    /// Keys the modify left unchanged.
    unchanged: Vec<String>,
    /// Keys refused by their fence.
    fenced: Vec<(String, Fenced)>,
    /// The first other failure (the modifies after it did not run).
    failure: Option<Error>,
}

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
    stats: Arc<ReplicatorStats>,
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
        stats: Arc<ReplicatorStats>,
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
    fn merge_in(&mut self, key: &str, incoming: ReplicatedData, out: &mut Vec<Action<R>>) -> Result<()> {
        ReplicatorStats::inc(&self.stats.values_merged);
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
    fn merge_delta_in(&mut self, key: &str, delta: ReplicatedDelta, out: &mut Vec<Action<R>>) -> Result<()> {
        ReplicatorStats::inc(&self.stats.deltas_merged);
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

    fn emit_changed(&mut self, key: &str, delta: Option<Cow<'_, ReplicatedDelta>>, out: &mut Vec<Action<R>>) {
        if key == ROSTER_KEY {
            self.roster.changed();
        }
        if self.is_durable(key) {
            self.persist(key, delta, out);
        }
        out.push(Action::Changed { key: key.to_string() });
    }

    /// Why a replicated write to `key` from a writer whose fence is `writer_fence` must be
    /// refused: the key is a fenced map here that a newer epoch has claimed.
    fn refusal(&self, key: &str, writer_fence: Option<u64>) -> Option<Fenced> {
        let writer_fence = writer_fence?;
        let fence = self.local_value(key)?.fence()?;
        (writer_fence < fence).then_some(Fenced { epoch: writer_fence, fence })
    }

    fn reject(&self, from: &PeerAddr, what: &str, e: &Error) {
        ReplicatorStats::inc(&self.stats.rejected);
        warn!(peer = %from.address, error = %e, "refusing {what}");
    }

    /// Handles one input at `now` (`wall_ms` feeds the LWW clock).
    pub(crate) fn handle(&mut self, input: Input<R>, now: Instant, wall_ms: u64, out: &mut Vec<Action<R>>) {
        match input {
            Input::Get { key, consistency, timeout, reply } => {
                self.on_get(vec![key], false, consistency, timeout, reply, now, out)
            }
            Input::GetMany { keys, consistency, timeout, reply } => {
                self.on_get(keys, true, consistency, timeout, reply, now, out)
            }
            Input::Update { key, consistency, timeout, modify, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update(vec![(key, modify)], consistency, timeout, reply, now, out)
            }
            Input::UpdateMany { updates, consistency, timeout, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update(updates, consistency, timeout, reply, now, out)
            }
            Input::UpdateAndGetMany { updates, consistency, timeout, reply } => {
                self.ctx.now_ms = wall_ms;
                self.on_update_and_get(updates, consistency, timeout, reply, now, out)
            }
            Input::Remote { from, msg } => {
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
            Input::Members { replicas, gossip_targets, standing, holder, leaving } => {
                (self.replicas, self.leaving) = (replicas, leaving);
                self.gossip_targets = gossip_targets;
                self.standing.update(standing);
                self.ctx.now_ms = wall_ms;
                self.sync_roster(holder, now, out);
                self.recount_pending(out);
                self.retarget_hand_over(out);
            }
            Input::HandOver { timeout, reply } => self.on_hand_over(timeout, reply, now, out),
            Input::Forget { node_id, reply } => {
                self.ctx.now_ms = wall_ms;
                let result = self.forget_by_operator(&node_id, out).map(|()| Vec::new());
                out.push(Action::ReplyUpdate { reply, result });
            }
            Input::Tick => {
                self.ctx.now_ms = wall_ms;
                self.on_tick(now, out)
            }
            Input::Persisted { through, failure } => self.on_persisted(through, failure, now, out),
        }
    }

    /// Applies one key's modify; returns its delta (None: nothing changed).
    /// An OR-set add the modify made that found no reserved counter fails the update (with a
    /// storage error: the reservation is a commit that has not happened), one of a member too
    /// long to decode with `BadRequest`; the rest of the modify stays applied and spreads as a
    /// local update.
    fn apply_modify(&mut self, key: &str, modify: Modify, out: &mut Vec<Action<R>>) -> Result<Option<ReplicatedDelta>> {
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
            ReplicatorStats::inc(&self.stats.fenced_writes);
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
            let max = super::orset::MAX_ELEMENT_LEN;
            Some(Error::BadRequest(format!("{too_long} OR-set members of {key} refused: longer than {max} bytes")))
        } else if refused > 0 {
            let reason = format!("{refused} OR-set adds to {key} refused: no durably reserved counter left yet");
            Some(Error::Storage { path: Default::default(), reason })
        } else {
            None
        };
        if let Some(refusal) = refusal {
            ReplicatorStats::add(&self.stats.refused_adds, (refused + too_long) as usize);
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
    #[allow(clippy::too_many_arguments)]
    fn on_update(
        &mut self,
        updates: Vec<(String, Modify)>,
        c: Consistency,
        timeout: Duration,
        reply: R,
        now: Instant,
        out: &mut Vec<Action<R>>,
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
                Ok(ticket) => self.after_commit(ticket, Action::ReplyUpdate { reply, result: Ok(fenced) }, out),
                Err(e) => out.push(Action::ReplyUpdate { reply, result: Err(e) }),
            }
            if self.pending_delta_elements > MAX_PENDING_DELTA_ELEMENTS {
                self.flush_deltas(out);
            }
            return;
        }
        // Earlier local changes of these keys ride along.
        let (deltas, values) = self.outgoing(deltas, unchanged);
        let op = self.next_op();
        ReplicatorStats::add(&self.stats.deltas_sent, reachable.len() * deltas.len());
        ReplicatorStats::add(&self.stats.full_values_sent, reachable.len() * values.len());
        let msg = ReplicatorMsg::WriteDelta { op, entries: deltas, values };
        let addressed = reachable.iter().map(|p| p.address.clone()).collect();
        out.push(Action::Broadcast { to: reachable, msg });
        let acked = HashSet::from([self.self_addr.clone()]);
        let (consistency, deadline) = (c, now + timeout);
        self.writes.insert(op, PendingWrite { keys, fenced, consistency, needed, addressed, acked, deadline, reply });
    }

    /// Applies the modifies of an update in order. A key refused by its fence is set aside and
    /// the others go on; any other failure stops there (keys modified before it keep their
    /// local change, which spreads as with any local update).
    fn apply_all(&mut self, updates: Vec<(String, Modify)>, out: &mut Vec<Action<R>>) -> Applied {
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
    fn outgoing(
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
    fn finish_write(&mut self, op: u64, out: &mut Vec<Action<R>>) {
        let w = self.writes.remove(&op).expect("pending write");
        match self.commit_ticket(w.keys.iter().map(String::as_str)) {
            Ok(ticket) => {
                let reply = Action::ReplyUpdate { reply: w.reply, result: Ok(w.fenced) };
                self.after_commit_until(ticket, reply, Some(w.deadline), out)
            }
            Err(e) => out.push(Action::ReplyUpdate { reply: w.reply, result: Err(e) }),
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
    fn flush_deltas(&mut self, out: &mut Vec<Action<R>>) {
        let pending = std::mem::take(&mut self.pending_deltas);
        self.pending_delta_elements = 0;
        if self.gossip_targets.is_empty() || pending.is_empty() {
            return;
        }
        let parts = split_by_bytes(pending, self.settings.max_message_bytes, |(k, d)| k.len() + d.approx_bytes());
        for entries in parts {
            ReplicatorStats::add(&self.stats.deltas_sent, entries.len() * self.gossip_targets.len());
            let msg = ReplicatorMsg::DeltaPropagation { entries };
            out.push(Action::Broadcast { to: self.gossip_targets.clone(), msg });
        }
    }

    fn next_op(&mut self) -> u64 {
        let op = self.next_op;
        self.next_op += 1;
        op
    }

    fn on_remote(&mut self, from: PeerAddr, msg: ReplicatorMsg, out: &mut Vec<Action<R>>) {
        match msg {
            ReplicatorMsg::WriteDelta { op, entries, values } => {
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
                    ReplicatorStats::add(&self.stats.fenced_writes, fenced.len());
                    out.push(Action::Send { to: from.clone(), msg: ReplicatorMsg::WriteFenced { op, keys: fenced } });
                }
                // A write with a refused key is not acknowledged: the writer must not count
                // this replica for it. The ack leaves once the keys are committed here.
                if ok && let Ok(ticket) = self.commit_ticket(keys.iter().map(String::as_str)) {
                    self.after_commit(ticket, Action::Send { to: from, msg: ReplicatorMsg::WriteAck { op } }, out);
                }
            }
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
            ReplicatorMsg::WriteAck { op } => {
                let done = match self.writes.get_mut(&op) {
                    Some(w) if w.addressed.contains(&from.address) => {
                        w.acked.insert(from.address);
                        w.acked.len() >= w.needed
                    }
                    Some(_) => {
                        ReplicatorStats::inc(&self.stats.rejected);
                        false
                    }
                    None => false,
                };
                if done {
                    self.finish_write(op, out);
                }
            }
            ReplicatorMsg::WriteFenced { op, keys } => match self.writes.get_mut(&op) {
                Some(w) if w.addressed.contains(&from.address) => {
                    // Only keys of this write, each once: a peer cannot grow the list.
                    for (key, refusal) in keys {
                        if let Some(i) = w.keys.iter().position(|k| *k == key) {
                            let key = w.keys.swap_remove(i);
                            w.fenced.push((key, refusal));
                        }
                    }
                }
                Some(_) => ReplicatorStats::inc(&self.stats.rejected),
                None => {}
            },
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
    fn expire(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let expired: Vec<u64> = self.writes.iter().filter(|(_, w)| w.deadline <= now).map(|(op, _)| *op).collect();
        for op in expired {
            let w = self.writes.remove(&op).expect("pending write");
            out.push(Action::ReplyUpdate {
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
            out.push(Action::ReplyUpdate { reply: h.reply, result });
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
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
                ReplicatorStats::inc(&self.stats.digest_rounds);
                out.push(Action::Send { to, msg: ReplicatorMsg::Status { root: self.root_digest() } });
            }
        }
    }
}

/// The same reply with its operation failed as timed out (other actions unchanged): what a
/// reply released past its operation's deadline becomes.
fn timed_out<R>(action: Action<R>) -> Action<R> {
    let timeout = || Error::ConsistencyTimeout { needed: 0, acked: 0 };
    match action {
        Action::ReplyUpdate { reply, result: Ok(_) } => Action::ReplyUpdate { reply, result: Err(timeout()) },
        Action::ReplyGetMany { reply, result: Ok(_) } => Action::ReplyGetMany { reply, result: Err(timeout()) },
        Action::ReplyGet { reply, result: Ok(_) } => Action::ReplyGet { reply, result: Err(timeout()) },
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
