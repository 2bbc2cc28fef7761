//! What goes in and out of the replicator core: the consistency levels, the messages between
//! replicators, the inputs the core takes and the actions it returns.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ddata::crdt::{ReplicatedData, ReplicatedDelta, WriteCtx};
use crate::ddata::fenced::Fenced;
use crate::error::Result;
use crate::membership::UniqueAddress;
use crate::transport::PeerAddr;

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

/// Messages between replicators.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum ReplicatorMsg {
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
pub(crate) enum ReplicatorInput<R> {
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
    /// view by [`ReplicatorInput::members_of`].
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

/// What to write for a key.
#[derive(Debug, Clone)]
pub(crate) enum PersistRecord {
    /// The whole current value (the driver reads it when it performs the action); drops the
    /// key's delta log.
    Snapshot,
    /// Append this delta to the log, under the action's ticket.
    Delta(ReplicatedDelta),
}

/// Outputs. Sends and replies may be performed before the `Persist` actions of the same batch
/// complete: whatever claims durability (acks, update replies) is held by the core until
/// [`ReplicatorInput::Persisted`] covers its tickets. `Persist` of a snapshot and `Changed` name only the
/// key: the driver reads the current value when it performs them.
#[derive(Debug)]
pub(crate) enum ReplicatorAction<R> {
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
    /// and reports with [`ReplicatorInput::Persisted`]).
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
    /// with [`ReplicatorInput::Persisted`] like a persist; see [`writer`]).
    ReserveCounters {
        ticket: u64,
        ceiling: u64,
    },
}
