//! A compact δ-OR-set of strings (add wins over a concurrent remove), built for millions of
//! remembered entity ids.
//!
//! **Model.** The add-wins OR-set of Almeida, Shoker and Baquero, "Delta State Replicated Data
//! Types" (2018): a *dot store* (element → the dots of the adds that put it there; a dot is
//! `(writer, counter)`) and a *causal context* (every dot this replica has seen, as a version
//! vector plus a "cloud" of dots above it that arrived out of order). The join of `(s, c)` and
//! `(s', c')` keeps, per element, the dots both stores hold, plus those of one store that the
//! other's context has not seen; the contexts are unioned.
//!
//! **Deltas.** `add(x)` produces the δ-state `({x → d}, {d} ∪ dots(x))`, `remove(x)` produces
//! `({}, dots(x))`. Each is itself a state, so deltas can be merged in any order, lost,
//! duplicated or joined together: no sequence numbers and no causal delivery are needed (a lost
//! delta is repaired by full-state anti-entropy). [`OrSet::take_delta`] returns everything
//! changed locally since the last take, as an [`OrSetDelta`]; [`OrSet::merge_delta`] costs
//! O(delta). A delta names the element of every dot in its context, so a replica finds the dots
//! to drop without an index from dots to elements.
//!
//! **Memory.** Elements live in one byte arena (a length varint, then the bytes); a
//! `hashbrown::HashTable` holds, per element, its arena offset and one packed dot (16-bit writer
//! index, 48-bit counter) in 12 bytes. Elements with more than one dot (concurrent adds of the
//! same element) keep the rest in a side map, which is empty in the common case. Writers are
//! interned once per set. About 30–45 bytes per 15-byte id.
//!
//! **Digest.** A wrapping sum of one hash per (element, dot), per version-vector entry and per
//! cloud dot, each computed from the writer's *name*: equal states have equal digests on every
//! node, whatever their history or memory layout, and every change updates it in O(1).

use smallvec::SmallVec;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use hashbrown::HashTable;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::buckets::BUCKETS;
use super::delta_crdt::DeltaCrdt;
pub(crate) use super::encoded_len::rmp_uint_len;
use super::write_ctx::{Actor, WriteCtx};

/// Largest dot counter (48 bits); a decoded value above it is refused.
pub(crate) const MAX_COUNTER: u64 = (1 << 48) - 1;
/// Most distinct writers one set may hold (16-bit writer index).
pub(crate) const MAX_WRITERS: usize = 1 << 16;
/// Longest element, in bytes.
pub(crate) const MAX_ELEMENT_LEN: usize = 16 * 1024;

const TAG_ENTRY: u64 = 0x6f72_7365_745f_656e;
const TAG_VV: u64 = 0x6f72_7365_745f_7676;
const TAG_CLOUD: u64 = 0x6f72_7365_745f_636c;

/// An element's dots: almost always one, held inline.
type Dots = SmallVec<[Dot; 2]>;

/// A dot: writer index (16 bits) and counter (48 bits) packed into one word. Writer indexes are
/// local to one set (or one delta); they are translated by name when states meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Dot(u64);

impl Dot {
    fn new(writer: u16, counter: u64) -> Dot {
        debug_assert!(counter <= MAX_COUNTER);
        Dot((u64::from(writer) << 48) | counter)
    }
    fn writer(self) -> u16 {
        (self.0 >> 48) as u16
    }
    fn counter(self) -> u64 {
        self.0 & MAX_COUNTER
    }
}

/// One element of the index: its arena offset and its first dot, split into two `u32`s so the
/// slot is 12 bytes with 4-byte alignment.
#[derive(Clone, Copy)]
struct Slot {
    offset: u32,
    dot: [u32; 2],
}

impl Slot {
    fn dot(self) -> Dot {
        Dot((u64::from(self.dot[0]) << 32) | u64::from(self.dot[1]))
    }
    fn set_dot(&mut self, d: Dot) {
        self.dot = [(d.0 >> 32) as u32, d.0 as u32];
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&a.to_le_bytes());
    buf[8..].copy_from_slice(&b.to_le_bytes());
    xxh3_64(&buf)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes of `v` as a varint.
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// Bytes an element of `len` bytes takes in an arena or an encoding: its length varint, then it.
fn element_bytes(len: usize) -> usize {
    varint_len(len as u64) + len
}

fn get_varint(bytes: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7f).checked_shl(shift)?;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The element stored at `offset` of an arena (a length varint, then the bytes).
fn element_in(arena: &[u8], offset: u32) -> &[u8] {
    let mut pos = offset as usize;
    let len = get_varint(arena, &mut pos).unwrap_or(0) as usize;
    &arena[pos..pos + len]
}

/// The writer table of one set or delta: index ↔ name, and each name's hash (for digests).
/// Sets have a handful of writers (one per store that wrote them), so a name is found by a
/// scan; the name → index map is built only past [`SCANNED_WRITERS`].
#[derive(Clone, Default)]
struct Writers {
    names: Vec<Actor>,
    hashes: Vec<u64>,
    by_name: HashMap<Actor, u16>,
}

/// Writer tables up to this size are searched by a scan (no map, no hashing of the name).
const SCANNED_WRITERS: usize = 16;

impl Writers {
    fn index_of(&self, name: &str) -> Option<u16> {
        if self.names.len() <= SCANNED_WRITERS {
            self.names.iter().position(|n| n == name).map(|i| i as u16)
        } else {
            self.by_name.get(name).copied()
        }
    }
    fn intern(&mut self, name: &str) -> Option<u16> {
        if let Some(i) = self.index_of(name) {
            return Some(i);
        }
        if self.names.len() >= MAX_WRITERS {
            return None;
        }
        let i = self.names.len() as u16;
        self.names.push(name.to_string());
        self.hashes.push(xxh3_64(name.as_bytes()));
        if self.names.len() > SCANNED_WRITERS {
            if self.by_name.is_empty() {
                self.by_name = self.names.iter().enumerate().map(|(j, n)| (n.clone(), j as u16)).collect();
            } else {
                self.by_name.insert(name.to_string(), i);
            }
        }
        Some(i)
    }
    fn name(&self, i: u16) -> &str {
        &self.names[usize::from(i)]
    }
    fn hash(&self, i: u16) -> u64 {
        self.hashes[usize::from(i)]
    }
}

/// Why a set, a delta or a merge was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrSetError {
    /// More distinct writers than a set may hold.
    #[error("more than {MAX_WRITERS} writers")]
    TooManyWriters,
    /// A malformed encoded value.
    #[error("malformed OR-set: {0}")]
    Malformed(&'static str),
}

/// An observed-remove set of strings (add wins over a concurrent remove), with δ-state
/// replication. See the module documentation.
#[derive(Clone, Default)]
pub struct OrSet {
    writers: Writers,
    /// Per writer index: every counter `1..=vv[w]` has been seen.
    vv: Vec<u64>,
    /// Seen dots above the version vector, as disjoint, non-adjacent intervals per writer,
    /// none touching the vector: first dot of the interval → its last counter.
    cloud: BTreeMap<Dot, u64>,
    arena: Vec<u8>,
    /// Arena bytes of removed elements, reclaimed by compaction.
    garbage: usize,
    index: HashTable<Slot>,
    /// Dots beyond the first, by arena offset (concurrent adds of one element).
    extra: HashMap<u32, Vec<Dot>>,
    entries_digest: u64,
    context_digest: u64,
    /// Local changes not yet taken by [`OrSet::take_delta`].
    delta: Option<Box<OrSetDelta>>,
}

impl OrSet {
    /// Adds a member (with a fresh dot of `ctx`'s OR-set writer; older dots of it are
    /// superseded). An add of a member longer than 16 KiB (peers would refuse the
    /// whole set) is refused and counted in [`WriteCtx::refused_too_long`]; one that finds no
    /// counter left in the writer's reserved range, or no room for a new writer, in
    /// [`WriteCtx::refused_adds`]. A refused add leaves the set unchanged.
    pub fn add(&mut self, ctx: &WriteCtx, member: impl AsRef<str>) {
        let member = member.as_ref();
        if member.len() > MAX_ELEMENT_LEN {
            ctx.refused_too_long.set(ctx.refused_too_long.get() + 1);
            return;
        }
        let Some((dot, claim)) = self.reserve_dot(ctx) else {
            ctx.refused_adds.set(ctx.refused_adds.get() + 1);
            return;
        };
        let w = dot.writer();
        if let Some((lo, hi)) = claim {
            self.context_insert_range(w, lo, hi);
        }
        let old = self.dots_of(member.as_bytes());
        self.set_dots(member.as_bytes(), &[dot]);
        self.context_insert(dot);
        let acc = self.delta.get_or_insert_default();
        // The claim first: the op's dot lies above it, and its dots of older elements are
        // dead in the accumulated delta too (none can be there: they lie above every counter
        // this set knew).
        if let Some((lo, hi)) = claim {
            acc.record_claim(&self.writers, w, lo, hi);
        }
        acc.record(&self.writers, member, &[dot], &old);
    }

    /// The dot of `ctx`'s next add, and, when it is the writer's first add above its floor, the
    /// counters it skips: claimed seen and dead (an earlier process of the writer may have sent
    /// adds with them that it never committed).
    fn reserve_dot(&mut self, ctx: &WriteCtx) -> Option<(Dot, Option<(u64, u64)>)> {
        let Some(w) = self.writers.intern(&ctx.set_actor) else {
            tracing::error!(writers = MAX_WRITERS, "OR-set writer table full; add refused");
            return None;
        };
        self.vv.resize(self.writers.names.len(), 0);
        let max = self.max_counter_of_index(w);
        let next = max.checked_add(1)?.max(ctx.counter_floor);
        if next > MAX_COUNTER || next >= ctx.counter_ceiling {
            tracing::error!(writer = %ctx.set_actor, next, ceiling = ctx.counter_ceiling, "no reserved OR-set counter left; add refused");
            return None;
        }
        let claim = (next - 1 > max).then_some((max + 1, next - 1));
        Some((Dot::new(w, next), claim))
    }

    /// Adds several members, each with its own dot.
    pub fn add_all<I: IntoIterator<Item = S>, S: AsRef<str>>(&mut self, ctx: &WriteCtx, members: I) {
        for m in members {
            self.add(ctx, m);
        }
    }

    /// Whether an add of `member` keeps the set within `budget` bytes of
    /// [`OrSet::approx_bytes`] — or is already in it (a re-add replaces its dot and does not
    /// grow the set): a set at its budget still takes those and every remove; only new members
    /// past the budget are refused. O(writers + concurrent dots + cloud intervals).
    pub fn fits(&self, member: &str, budget: usize) -> bool {
        // The element, its writer index and its counter (at most a full varint).
        let added = element_bytes(member.len()) + 1 + varint_len(u64::MAX);
        self.contains(member) || self.approx_bytes().saturating_add(added) <= budget
    }

    /// Removes a member (the adds this replica has seen; a concurrent unseen add wins).
    pub fn remove(&mut self, member: &str) {
        let old = self.dots_of(member.as_bytes());
        if old.is_empty() {
            return;
        }
        self.set_dots(member.as_bytes(), &[]);
        self.delta.get_or_insert_default().record(&self.writers, member, &[], &old);
    }

    /// Whether `member` is in the set.
    pub fn contains(&self, member: &str) -> bool {
        self.find(member.as_bytes()).is_some()
    }

    /// The members, in no particular order, without copying them.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.index.iter().map(|s| {
            // Only valid UTF-8 enters the arena (members are `String`s or validated on decode).
            std::str::from_utf8(self.element_at(s.offset)).unwrap_or_default()
        })
    }

    /// The members, sorted.
    pub fn members(&self) -> BTreeSet<String> {
        self.iter().map(str::to_string).collect()
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Canonical digest: equal states have equal digests on every node.
    pub fn digest(&self) -> u64 {
        self.entries_digest.wrapping_add(self.context_digest)
    }

    /// Bytes held by the set's own storage (arena, index, side tables), for memory accounting.
    pub fn heap_bytes(&self) -> usize {
        self.arena.capacity()
            + self.index.capacity() * (std::mem::size_of::<Slot>() + 1)
            + self.extra.capacity() * 40
            + self.extra.values().map(|dots| dots.capacity() * 8).sum::<usize>()
            + self.cloud.len() * 40
            + self.vv.capacity() * 8
            + self.writers.names.iter().map(|n| n.capacity() + 32).sum::<usize>()
            + self.writers.by_name.keys().map(|n| n.capacity() + 40).sum::<usize>()
    }

    /// Approximate encoded size in bytes (for message budgets; never encodes): the live arena
    /// (an element again for each of its extra dots), a writer index and a counter per dot
    /// (sized by the largest counter), the writer names and version vector, and each cloud
    /// interval.
    pub fn approx_bytes(&self) -> usize {
        let largest = self.vv.iter().copied().max().unwrap_or(0);
        let dots = self.len() + self.extra.values().map(Vec::len).sum::<usize>();
        let cloud: usize = self
            .cloud
            .iter()
            .map(|(lo, hi)| if lo.counter() == *hi { 2 + rmp_uint_len(*hi) } else { 2 + 2 * rmp_uint_len(*hi) })
            .sum();
        // The encoding repeats an element (with its length varint) for each of its extra dots.
        let repeated: usize =
            self.extra.iter().map(|(offset, more)| more.len() * element_bytes(self.element_at(*offset).len())).sum();
        self.arena.len().saturating_sub(self.garbage)
            + repeated
            + dots * (1 + varint_len(largest))
            + self.writers.names.iter().map(|n| n.len() + 2 + rmp_uint_len(largest)).sum::<usize>()
            + cloud
    }

    /// The writers this set has seen, in the order it met them (each costs context space for
    /// good: see `DESIGN.md` on store writers).
    pub fn writers(&self) -> impl Iterator<Item = &str> {
        self.writers.names.iter().map(String::as_str)
    }

    /// Intervals of dots seen out of order (0 once every delta arrived or anti-entropy closed
    /// the gaps); a number that stays high means deltas are being lost.
    pub fn cloud_intervals(&self) -> usize {
        self.cloud.len()
    }

    /// The highest counter of `writer` this set has seen (0 if none).
    pub fn max_counter_of(&self, writer: &str) -> u64 {
        self.writers.index_of(writer).map_or(0, |w| self.max_counter_of_index(w))
    }

    /// Takes the local changes made since the last take (None when there were none).
    pub fn take_delta(&mut self) -> Option<OrSetDelta> {
        self.delta.take().map(|b| *b)
    }

    /// Merges another replica's full state: O(|self| + |other|).
    pub fn merge(&mut self, other: OrSet) {
        if let Err(e) = self.try_merge(&other) {
            tracing::error!(error = %e, "OR-set merge refused");
        }
    }

    /// Merges another replica's full state, refusing (and leaving `self` unchanged) when the
    /// writer table would overflow.
    pub fn try_merge(&mut self, other: &OrSet) -> Result<(), OrSetError> {
        let map = self.map_writers(&other.writers)?;
        let theirs = |d: Dot| Dot::new(map[usize::from(d.writer())], d.counter());
        // Decide every element against both contexts as they were before the merge.
        let mut changes: Vec<(Vec<u8>, Vec<Dot>)> = Vec::new();
        for slot in self.index.iter() {
            let x = self.element_at(slot.offset);
            if other.find(x).is_some() {
                continue;
            }
            let mine = self.slot_dots(*slot);
            let keep: Vec<Dot> =
                mine.iter().copied().filter(|d| !other.context_contains_mapped(*d, &self.writers)).collect();
            if keep.len() != mine.len() {
                changes.push((x.to_vec(), keep));
            }
        }
        for slot in other.index.iter() {
            let x = other.element_at(slot.offset);
            let d_theirs: Vec<Dot> = other.slot_dots(*slot).into_iter().map(theirs).collect();
            let mine = self.dots_of(x);
            let result = self.join_dots(&mine, &d_theirs, |d| other.context_contains_mapped(d, &self.writers));
            if result != mine {
                changes.push((x.to_vec(), result.into_vec()));
            }
        }
        for (x, dots) in changes {
            self.set_dots(&x, &dots);
        }
        for (w, &n) in other.vv.iter().enumerate() {
            self.context_raise(map[w], n);
        }
        for (d, hi) in &other.cloud {
            let d = theirs(*d);
            self.context_insert_range(d.writer(), d.counter(), *hi);
        }
        Ok(())
    }

    /// Merges a delta: O(delta), plus one pass over the elements for a claim that covers dots
    /// this replica has seen (the rare case of adds a crashed process sent and never committed).
    pub fn merge_delta(&mut self, delta: &OrSetDelta) -> Result<(), OrSetError> {
        let map = self.map_writers(&delta.writers)?;
        let theirs = |(w, c): (u16, u64)| Dot::new(map[usize::from(w)], c);
        let claims: Vec<(u16, u64, u64)> =
            delta.claims.iter().map(|&(w, lo, hi)| (map[usize::from(w)], lo, hi)).collect();
        let claimed = |d: Dot| OrSetDelta::claimed(&claims, (d.writer(), d.counter()));
        for (x, e) in &delta.entries {
            // Inline for the usual one or two dots; sorted, so a long list is still searched
            // in O(log n).
            let present: Dots = e.present.iter().copied().map(theirs).collect();
            let mut seen: SmallVec<[Dot; 4]> = e.present.iter().chain(&e.removed).copied().map(theirs).collect();
            seen.sort_unstable();
            let mine = self.dots_of(x.as_bytes());
            let result = self.join_dots(&mine, &present, |d| seen.binary_search(&d).is_ok() || claimed(d));
            if result != mine {
                self.set_dots(x.as_bytes(), &result);
            }
        }
        if claims.iter().any(|&(w, lo, _)| self.max_counter_of_index(w) >= lo) {
            let mut changes: Vec<(Vec<u8>, Vec<Dot>)> = Vec::new();
            for slot in self.index.iter() {
                let x = self.element_at(slot.offset);
                let mine = self.slot_dots(*slot);
                // Elements of the delta were joined above: none holds a claimed dot any more
                // (a writer's new dots lie above its claims).
                if mine.iter().any(|d| claimed(*d)) {
                    changes.push((x.to_vec(), mine.into_iter().filter(|d| !claimed(*d)).collect()));
                }
            }
            for (x, dots) in changes {
                self.set_dots(&x, &dots);
            }
        }
        for e in delta.entries.values() {
            for d in e.present.iter().chain(&e.removed) {
                self.context_insert(theirs(*d));
            }
        }
        for (w, lo, hi) in claims {
            self.context_insert_range(w, lo, hi);
        }
        Ok(())
    }

    /// `(L ∩ D) ∪ (L \ c') ∪ (D \ c)` for one element: `mine` = L, `theirs` = D (already in this
    /// set's writer indexes), `theirs_seen` tests c'; c is this set's context.
    fn join_dots(&self, mine: &[Dot], theirs: &[Dot], theirs_seen: impl Fn(Dot) -> bool) -> Dots {
        let mut out: Dots = mine.iter().copied().filter(|d| theirs.contains(d) || !theirs_seen(*d)).collect();
        for d in theirs {
            if !mine.contains(d) && !self.context_contains(*d) {
                out.push(*d);
            }
        }
        out.sort_unstable();
        out
    }

    fn map_writers(&mut self, other: &Writers) -> Result<Vec<u16>, OrSetError> {
        let new = other.names.iter().filter(|n| self.writers.index_of(n).is_none()).count();
        if self.writers.names.len() + new > MAX_WRITERS {
            return Err(OrSetError::TooManyWriters);
        }
        let map: Vec<u16> = other.names.iter().map(|n| self.writers.intern(n).expect("room checked")).collect();
        self.vv.resize(self.writers.names.len(), 0);
        Ok(map)
    }

    /// Whether this set's context holds `d`, given in `their` writer indexes' namespace.
    fn context_contains_mapped(&self, d: Dot, their: &Writers) -> bool {
        match self.writers.index_of(their.name(d.writer())) {
            Some(w) => self.context_contains(Dot::new(w, d.counter())),
            None => false,
        }
    }

    fn max_counter_of_index(&self, w: u16) -> u64 {
        let cloud_max = self.cloud.range(Dot::new(w, 0)..=Dot::new(w, MAX_COUNTER)).next_back().map(|(_, hi)| *hi);
        cloud_max.unwrap_or(0).max(self.vv.get(usize::from(w)).copied().unwrap_or(0))
    }

    fn context_contains(&self, d: Dot) -> bool {
        self.vv.get(usize::from(d.writer())).is_some_and(|&n| d.counter() <= n)
            || self
                .cloud
                .range(..=d)
                .next_back()
                .is_some_and(|(lo, hi)| lo.writer() == d.writer() && d.counter() <= *hi)
    }

    fn vv_hash(&self, w: u16, n: u64) -> u64 {
        if n == 0 { 0 } else { mix(self.writers.hash(w) ^ TAG_VV, n) }
    }

    /// Hash of the cloud interval `[lo, hi]` of writer `w` (one canonical form per interval:
    /// the cloud is kept normalized).
    fn cloud_hash(&self, w: u16, lo: u64, hi: u64) -> u64 {
        let start = mix(self.writers.hash(w) ^ TAG_CLOUD, lo);
        if lo == hi { start } else { mix(start, hi) }
    }

    fn set_vv(&mut self, w: u16, n: u64) {
        let old = self.vv[usize::from(w)];
        self.context_digest = self.context_digest.wrapping_sub(self.vv_hash(w, old)).wrapping_add(self.vv_hash(w, n));
        self.vv[usize::from(w)] = n;
    }

    /// Adds one dot to the context.
    fn context_insert(&mut self, d: Dot) {
        self.context_insert_range(d.writer(), d.counter(), d.counter());
    }

    /// Raises writer `w`'s version vector entry to at least `n`.
    fn context_raise(&mut self, w: u16, n: u64) {
        self.context_insert_range(w, 1, n);
    }

    /// Adds the dots `lo..=hi` of writer `w` to the context, keeping it normalized: the
    /// interval absorbs every cloud interval it overlaps or touches, and joins the version
    /// vector when it starts right above it. O(log cloud + intervals absorbed).
    fn context_insert_range(&mut self, w: u16, lo: u64, hi: u64) {
        let n = self.vv[usize::from(w)];
        if hi <= n || lo > hi {
            return;
        }
        let (mut lo, mut hi) = (lo.max(n + 1), hi.min(MAX_COUNTER));
        if let Some((&start, &end)) = self.cloud.range(Dot::new(w, 0)..Dot::new(w, lo)).next_back()
            && end.saturating_add(1) >= lo
        {
            self.cloud_remove(start, end);
            lo = start.counter();
            hi = hi.max(end);
        }
        let reach = hi.saturating_add(1).min(MAX_COUNTER);
        while let Some((&start, &end)) = self.cloud.range(Dot::new(w, lo)..=Dot::new(w, reach)).next() {
            self.cloud_remove(start, end);
            hi = hi.max(end);
        }
        if lo == n + 1 {
            self.set_vv(w, hi);
        } else {
            self.cloud.insert(Dot::new(w, lo), hi);
            self.context_digest = self.context_digest.wrapping_add(self.cloud_hash(w, lo, hi));
        }
    }

    fn cloud_remove(&mut self, start: Dot, end: u64) {
        self.cloud.remove(&start);
        let h = self.cloud_hash(start.writer(), start.counter(), end);
        self.context_digest = self.context_digest.wrapping_sub(h);
    }

    fn element_at(&self, offset: u32) -> &[u8] {
        element_in(&self.arena, offset)
    }

    fn find(&self, x: &[u8]) -> Option<Slot> {
        self.index.find(xxh3_64(x), |s| self.element_at(s.offset) == x).copied()
    }

    fn slot_dots(&self, slot: Slot) -> Dots {
        let mut v: Dots = smallvec::smallvec![slot.dot()];
        if !self.extra.is_empty()
            && let Some(more) = self.extra.get(&slot.offset)
        {
            v.extend_from_slice(more);
            v.sort_unstable();
        }
        v
    }

    fn dots_of(&self, x: &[u8]) -> Dots {
        self.find(x).map(|s| self.slot_dots(s)).unwrap_or_default()
    }

    fn entry_hash(&self, x: &[u8], d: Dot) -> u64 {
        xxh3_64_with_seed(x, mix(self.writers.hash(d.writer()) ^ TAG_ENTRY, d.counter()))
    }

    /// Replaces the dots of `x` (empty: removes it), keeping the digest and arena in step.
    fn set_dots(&mut self, x: &[u8], dots: &[Dot]) {
        let hash = xxh3_64(x);
        let old = self.find(x);
        let old_dots = old.map(|s| self.slot_dots(s)).unwrap_or_default();
        let mut digest = self.entries_digest;
        for d in &old_dots {
            digest = digest.wrapping_sub(self.entry_hash(x, *d));
        }
        for d in dots {
            digest = digest.wrapping_add(self.entry_hash(x, *d));
        }
        self.entries_digest = digest;
        match (old, dots.split_first()) {
            (Some(slot), None) => {
                let arena = &self.arena;
                if let Ok(e) = self.index.find_entry(hash, |s| element_in(arena, s.offset) == x) {
                    e.remove();
                }
                self.extra.remove(&slot.offset);
                self.garbage += element_bytes(x.len());
                self.maybe_compact();
            }
            (Some(slot), Some((first, rest))) => {
                let arena = &self.arena;
                if let Some(s) = self.index.find_mut(hash, |s| element_in(arena, s.offset) == x) {
                    s.set_dot(*first);
                }
                if rest.is_empty() {
                    self.extra.remove(&slot.offset);
                } else {
                    self.extra.insert(slot.offset, rest.to_vec());
                }
            }
            (None, Some((first, rest))) => {
                let offset = self.arena.len() as u32;
                put_varint(&mut self.arena, x.len() as u64);
                self.arena.extend_from_slice(x);
                let mut slot = Slot { offset, dot: [0, 0] };
                slot.set_dot(*first);
                let arena = &self.arena;
                self.index.insert_unique(hash, slot, |s| xxh3_64(element_in(arena, s.offset)));
                if !rest.is_empty() {
                    self.extra.insert(offset, rest.to_vec());
                }
            }
            (None, None) => {}
        }
    }

    /// Rewrites the arena without removed elements once they are half of it.
    fn maybe_compact(&mut self) {
        if self.garbage < 4096 || self.garbage * 2 < self.arena.len() {
            return;
        }
        let mut arena = Vec::with_capacity(self.arena.len() - self.garbage.min(self.arena.len()));
        let mut extra = HashMap::with_capacity(self.extra.len());
        for slot in self.index.iter_mut() {
            let mut p = slot.offset as usize;
            let len = get_varint(&self.arena, &mut p).unwrap_or(0) as usize;
            let new_offset = arena.len() as u32;
            put_varint(&mut arena, len as u64);
            arena.extend_from_slice(&self.arena[p..p + len]);
            if let Some(more) = self.extra.remove(&slot.offset) {
                extra.insert(new_offset, more);
            }
            slot.offset = new_offset;
        }
        self.arena = arena;
        self.extra = extra;
        self.garbage = 0;
    }

    /// Every (element, dot) pair, for encoding and comparison.
    fn for_each_entry<'a>(&'a self, mut f: impl FnMut(&'a [u8], Dot)) {
        for slot in self.index.iter() {
            let x = self.element_at(slot.offset);
            for d in self.slot_dots(*slot) {
                f(x, d);
            }
        }
    }

    /// The state with writer names instead of indexes, sorted: for equality.
    fn canonical(&self) -> CanonicalView<'_> {
        let vv = self
            .vv
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(w, n)| (self.writers.name(w as u16), *n))
            .collect();
        let cloud = self.cloud.iter().map(|(d, hi)| (self.writers.name(d.writer()), d.counter(), *hi)).collect();
        let mut entries = BTreeSet::new();
        self.for_each_entry(|x, d| {
            entries.insert((x, self.writers.name(d.writer()), d.counter()));
        });
        (vv, cloud, entries)
    }
}

/// Version vector, cloud intervals and (element, writer, counter) entries, by writer name.
type CanonicalView<'a> = (BTreeMap<&'a str, u64>, BTreeSet<(&'a str, u64, u64)>, BTreeSet<(&'a [u8], &'a str, u64)>);

impl PartialEq for OrSet {
    fn eq(&self, other: &Self) -> bool {
        self.digest() == other.digest() && self.len() == other.len() && self.canonical() == other.canonical()
    }
}

impl Eq for OrSet {}

impl fmt::Debug for OrSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (vv, cloud, _) = self.canonical();
        f.debug_struct("OrSet")
            .field("members", &self.members())
            .field("vv", &vv)
            .field("cloud", &cloud)
            .field("digest", &format_args!("{:016x}", self.digest()))
            .finish()
    }
}

mod delta;
mod wire;

pub use delta::OrSetDelta;

impl DeltaCrdt for OrSet {
    const NAME: &'static str = "OrSet";
    const DIGEST_TAG: u64 = 2;
    type Delta = OrSetDelta;
    type Refusal = OrSetError;

    fn merge_state(&mut self, other: Self) -> Result<(), OrSetError> {
        self.try_merge(&other)
    }
    fn merge_delta_state(&mut self, delta: &OrSetDelta) -> Result<(), OrSetError> {
        self.merge_delta(delta)
    }
    fn take_delta_state(&mut self) -> Option<OrSetDelta> {
        self.take_delta()
    }
    fn state_digest(&self) -> u64 {
        self.digest()
    }
    /// None: an OR-set's causal context cannot be split by bucket.
    fn state_bucket_digests(&self) -> Option<&[u64; BUCKETS]> {
        None
    }
    fn state_buckets_subset(&self, _buckets: &[usize]) -> Self {
        self.clone()
    }
    fn state_bytes(&self) -> usize {
        self.approx_bytes()
    }
    fn element_count(&self) -> usize {
        self.len()
    }
    fn delta_len(delta: &OrSetDelta) -> usize {
        delta.len()
    }
    fn delta_bytes(delta: &OrSetDelta) -> usize {
        delta.approx_bytes()
    }
    fn join_deltas(into: &mut OrSetDelta, other: OrSetDelta) {
        into.join_delta(other)
    }
}

#[cfg(test)]
mod tests;
