//! The roster: the replica holders that a durable key's quorum is counted over.
//!
//! **Guarantee.** A majority write of a durable key and a later majority read (a shard's claim)
//! of it share a replica however many members downing removed in between: both count a
//! majority of the roster, not of the members left, and a node id leaves the roster only when
//! its values are safe elsewhere (a graceful leave, after its hand-over) or when someone
//! decided they are not needed (an operator's forget, or `forget_absent_after` of absence).
//! Seed 520000593 is the case it closes: downing removed three of five holders and a paused
//! node claimed every shard alone; with the roster it waits for a majority of the five.
//!
//! **What it is.** A replicated, durable LWW-map under [`ROSTER_KEY`], node id →
//! [`RosterEntry`] (the newest generation seen and whether it is forgotten), spread by the
//! replicator's own deltas and anti-entropy like any key. Every node adds each Up replica
//! holder it sees (an entry is only ever raised to a newer generation by this, so a forgotten
//! incarnation never comes back; its next start does). Counting is by node id: a restarted
//! node's disk counts for what its earlier incarnation acknowledged.
//!
//! **Why changes are one at a time.** Adding or forgetting one id keeps every earlier write
//! quorum intersecting every later read quorum (⌊N/2⌋+1 + ⌊(N+1)/2⌋+1 > N+1, and
//! ⌊N/2⌋ + ⌊(N−1)/2⌋+1 > N−1); two at once may not. Joins add one id each and automatic
//! forgets go one per tick; simultaneous joins that a writer has not seen yet are a residual
//! risk DESIGN.md states.
//!
//! **The cost.** With a majority of the roster unreachable, durable writes and claims wait
//! (as a Raft group would) instead of going on with what is left.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::warn;

use super::{Modify, ReplicatorAction, ReplicatorCore};
use crate::clock::Instant;
use crate::ddata::crdt::{Crdt, LwwMap, ReplicatedData};
use crate::membership::UniqueAddress;

/// The key of the roster's LWW-map (always durable, whatever the configured prefixes).
pub(crate) const ROSTER_KEY: &str = "ddshard-roster";

/// One node id's place in the roster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RosterEntry {
    /// The newest generation (incarnation) of the node id seen as a replica holder.
    pub generation: u64,
    /// Forgotten: that incarnation and older ones no longer count (a newer one is added again).
    pub forgotten: bool,
}

/// The roster's entries in a value of [`ROSTER_KEY`] (entries that do not decode are skipped:
/// they name no one).
pub(crate) fn roster_entries(value: Option<&ReplicatedData>) -> BTreeMap<String, RosterEntry> {
    let Some(ReplicatedData::LwwMap(map)) = value else { return BTreeMap::new() };
    map.iter()
        .filter_map(|(id, bytes)| Some((id.to_string(), crate::transport::wire::decode::<RosterEntry>(bytes).ok()?)))
        .collect()
}

/// The core's view of the roster: who counts, and since when each counted id is absent.
#[derive(Default)]
pub(super) struct Roster {
    /// The value's entries, decoded once per change.
    entries: BTreeMap<String, RosterEntry>,
    /// Node ids that count (not forgotten), derived from `entries`.
    counted: BTreeSet<Arc<str>>,
    /// The value changed since `counted` was computed.
    stale: bool,
    /// [`ReplicatorCore::roster_size`], kept until the roster or the replica holders change
    /// (durable operations ask for it on every write).
    size: Option<usize>,
    /// Counted ids that are not replica holders now, and since when (this node's clock).
    absent_since: BTreeMap<Arc<str>, Instant>,
    /// When to forget an id absent this long (`None`: never automatically).
    forget_absent_after: Option<Duration>,
}

impl Roster {
    pub(super) fn new(forget_absent_after: Option<Duration>) -> Self {
        Roster { forget_absent_after, ..Roster::default() }
    }

    /// The roster's value changed (merged, loaded or written here).
    pub(super) fn changed(&mut self) {
        self.stale = true;
        self.size = None;
    }
}

/// A modify that raises `id`'s entry to `entry` unless it already holds that generation or a
/// newer one (a forgotten incarnation is not added again by seeing it).
pub(super) fn raise(id: Arc<str>, entry: RosterEntry) -> Modify {
    Box::new(move |current, ctx| {
        let write = |map: &mut LwwMap, ctx: &mut crate::ddata::crdt::WriteCtx| map.put_as(ctx, &*id, &entry);
        match current {
            None => {
                let mut map = LwwMap::default();
                write(&mut map, ctx)?;
                Ok(Some(ReplicatedData::LwwMap(map)))
            }
            Some(ReplicatedData::LwwMap(map)) => {
                let known = map.get_as::<RosterEntry>(&id).ok().flatten();
                let newer = match known {
                    None => true,
                    Some(k) => (k.generation, k.forgotten) < (entry.generation, entry.forgotten),
                };
                if newer {
                    write(map, ctx)?;
                }
                Ok(None)
            }
            Some(other) => Err(crate::error::Error::WrongDataType {
                key: ROSTER_KEY.to_string(),
                expected: LwwMap::NAME,
                found: other.type_name(),
            }),
        }
    })
}

impl<R> ReplicatorCore<R> {
    /// Node ids a durable key's quorum is counted over: the roster, with this node and every
    /// replica holder now (a Leaving member that handed over still answers for its copies).
    pub(super) fn roster_size(&mut self) -> usize {
        if let Some(size) = self.roster.size {
            return size;
        }
        self.refresh_roster();
        let mut ids: BTreeSet<&str> = self.roster.counted.iter().map(|id| &**id).collect();
        ids.insert(&self.self_addr.node_id);
        ids.extend(self.replicas.iter().map(|(p, _)| &*p.address.node_id));
        let size = ids.len();
        self.roster.size = Some(size);
        size
    }

    /// Whether node id `id` is one an operation counts now: this node, a replica holder, or
    /// (for a `durable` key) an id of the roster.
    pub(super) fn counts_now(&mut self, durable: bool, id: &str) -> bool {
        if *self.self_addr.node_id == *id || self.replicas.iter().any(|(p, _)| *p.address.node_id == *id) {
            return true;
        }
        durable && {
            self.refresh_roster();
            self.roster.counted.contains(id)
        }
    }

    /// How many replicas an operation on `keys` counts: the roster for durable keys, the
    /// replica holders now for the others.
    pub(super) fn replicas_counted<'k>(&mut self, mut keys: impl Iterator<Item = &'k str>) -> usize {
        let durable = keys.any(|k| self.is_durable(k));
        self.replicas_counted_of(durable)
    }

    /// How many replicas an operation counts: the roster when it touches a `durable` key.
    pub(super) fn replicas_counted_of(&mut self, durable: bool) -> usize {
        if durable { self.roster_size() } else { self.total_replicas() }
    }

    /// Ids of the roster other than this node and the other leaving members (a leaving node's
    /// hand-over counts a majority of these).
    pub(super) fn roster_staying(&mut self, staying: &[UniqueAddress]) -> usize {
        self.refresh_roster();
        let present: BTreeSet<&str> = self.replicas.iter().map(|(p, _)| &*p.address.node_id).collect();
        let staying: BTreeSet<&str> = staying.iter().map(|a| &*a.node_id).collect();
        let mut ids: BTreeSet<&str> = self
            .roster
            .counted
            .iter()
            .map(|id| &**id)
            .filter(|id| staying.contains(id) || !present.contains(id))
            .collect();
        ids.extend(staying.iter());
        ids.remove(&*self.self_addr.node_id);
        ids.len()
    }

    fn refresh_roster(&mut self) {
        if !self.roster.stale {
            return;
        }
        self.roster.stale = false;
        self.roster.entries = roster_entries(self.local_value(ROSTER_KEY));
        self.roster.counted =
            self.roster.entries.iter().filter(|(_, e)| !e.forgotten).map(|(id, _)| Arc::from(id.as_str())).collect();
    }

    /// After a membership change: adds every replica holder (this node too when `holder`) in
    /// its newest generation, and starts (or stops) the absence clock of counted ids.
    pub(super) fn sync_roster(&mut self, holder: bool, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        self.roster.size = None; // the replica holders changed
        let mut holders: Vec<UniqueAddress> = self.replicas.iter().map(|(p, _)| p.address.clone()).collect();
        if holder {
            holders.push(self.self_addr.clone());
        }
        self.refresh_roster();
        let raises: Vec<&UniqueAddress> = holders
            .iter()
            .filter(|a| self.roster.entries.get(&*a.node_id).is_none_or(|e| e.generation < a.generation))
            .collect();
        for a in raises {
            let entry = RosterEntry { generation: a.generation, forgotten: false };
            self.write_roster(raise(a.node_id.clone(), entry), out);
        }
        self.refresh_roster();
        let mut present: BTreeSet<&str> = holders.iter().map(|a| &*a.node_id).collect();
        present.insert(&self.self_addr.node_id);
        let counted = &self.roster.counted;
        self.roster.absent_since.retain(|id, _| counted.contains(id) && !present.contains(&**id));
        for id in counted.iter().filter(|id| !present.contains(&***id)) {
            self.roster.absent_since.entry(id.clone()).or_insert(now);
        }
        self.publish_roster();
    }

    /// Sets the roster gauges of the stats.
    fn publish_roster(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let holders = self.roster_size() as u64;
        self.stats.roster_holders.store(holders, Relaxed);
        self.stats.roster_absent.store(self.roster.absent_since.len() as u64, Relaxed);
    }

    /// Forgets the id absent longest once it has been absent `forget_absent_after` (one per
    /// call: one change at a time).
    pub(super) fn forget_long_absent(&mut self, now: Instant, out: &mut Vec<ReplicatorAction<R>>) {
        let Some(after) = self.roster.forget_absent_after else { return };
        let Some((id, since)) = self.roster.absent_since.iter().min_by_key(|(_, since)| **since) else { return };
        if now.saturating_duration_since(*since) < after {
            return;
        }
        let id = id.clone();
        warn!(node_id = %id, absent_for = ?after, "replica holder forgotten after its absence: its copies no longer count in durable quorums");
        self.forget(&id, out);
    }

    /// Takes `node_id` out of the roster (its newest known generation is forgotten). Returns
    /// whether it was counted.
    pub(super) fn forget(&mut self, node_id: &str, out: &mut Vec<ReplicatorAction<R>>) -> bool {
        self.roster.absent_since.remove(node_id);
        self.refresh_roster();
        let Some(entry) = self.roster.entries.get(node_id).copied() else { return false };
        if entry.forgotten {
            return false;
        }
        self.write_roster(raise(node_id.into(), RosterEntry { forgotten: true, ..entry }), out);
        self.publish_roster();
        true
    }

    /// An operator's forget (see [`super::ReplicatorInput::Forget`]).
    pub(super) fn forget_by_operator(
        &mut self,
        node_id: &str,
        out: &mut Vec<ReplicatorAction<R>>,
    ) -> crate::error::Result<()> {
        let refuse = |why: String| Err(crate::error::Error::BadRequest(why));
        if *self.self_addr.node_id == *node_id {
            return refuse(format!("{node_id} is this node; forget it from another member"));
        }
        if self.replicas.iter().any(|(p, _)| *p.address.node_id == *node_id) {
            return refuse(format!("{node_id} is a replica holder now; only an absent node can be forgotten"));
        }
        if !self.forget(node_id, out) {
            return refuse(format!("{node_id} is not counted in the roster"));
        }
        warn!(node_id, "replica holder forgotten by an operator: its copies no longer count in durable quorums");
        Ok(())
    }

    /// A local write of the roster, spread by deltas and anti-entropy.
    fn write_roster(&mut self, modify: Modify, out: &mut Vec<ReplicatorAction<R>>) {
        match self.apply_modify(ROSTER_KEY, modify, out) {
            Ok(Some(delta)) => self.pend_delta(ROSTER_KEY.to_string(), delta),
            Ok(None) => {}
            Err(e) => warn!(error = %e, "roster not written"),
        }
    }
}
