//! [`OrSetDelta`]: the local changes of an [`super::OrSet`] as a δ-state.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use super::wire::{check_dot, check_element, check_writers};
use super::{Dot, OrSetError, Writers, rmp_uint_len};

/// Most claims one delta may carry (one per writer restart it joins; a peer's list is capped so
/// that the linear checks stay cheap).
const MAX_CLAIMS: usize = 1024;
use crate::ddata::write_ctx::Actor;

/// The local changes of an [`OrSet`](super::OrSet) since the last [`OrSet::take_delta`](super::OrSet::take_delta), as a δ-state: per
/// touched element, the dots it holds in the delta and the dots the delta has seen removed;
/// and the counter ranges a store writer skipped at its first add in a process (*claims*):
/// every dot of that writer in such a range counts as seen, and no element holds it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct OrSetDelta {
    pub(super) writers: Writers,
    pub(super) entries: BTreeMap<String, DeltaEntry>,
    /// `(writer index, first, last)`: the writer's dots `first..=last` are seen and dead.
    pub(super) claims: Vec<(u16, u64, u64)>,
}

#[derive(Clone, Default, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub(super) struct DeltaEntry {
    pub(super) present: DeltaDots,
    pub(super) removed: DeltaDots,
}

/// An element's `(writer index, counter)` dots in a delta: almost always one, held inline (the
/// same encoding as a `Vec`).
pub(super) type DeltaDots = SmallVec<[(u16, u64); 1]>;

impl PartialEq for Writers {
    fn eq(&self, other: &Self) -> bool {
        self.names == other.names
    }
}
impl Eq for Writers {}

impl fmt::Debug for OrSetDelta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrSetDelta")
            .field("writers", &self.writers.names)
            .field("entries", &self.entries)
            .field("claims", &self.claims)
            .finish()
    }
}

impl OrSetDelta {
    /// Number of elements the delta touches.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the delta touches nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.claims.is_empty()
    }

    /// Approximate encoded size in bytes (O(delta), never encodes): per element its bytes and
    /// headers, per dot a pair of a writer index and a counter sized by its value.
    pub fn approx_bytes(&self) -> usize {
        let dot = |(w, c): &(u16, u64)| 1 + rmp_uint_len(u64::from(*w)) + rmp_uint_len(*c);
        let entries: usize = self
            .entries
            .iter()
            .map(|(k, e)| k.len() + 6 + e.present.iter().chain(&e.removed).map(dot).sum::<usize>())
            .sum();
        let claims: usize = self.claims.iter().map(|(_, lo, hi)| 3 + rmp_uint_len(*lo) + rmp_uint_len(*hi)).sum();
        entries + claims + self.writers.names.iter().map(|n| n.len() + 2).sum::<usize>() + 4
    }

    /// Joins one local op on `x` into this delta: `present` dots `x` now holds, `removed` dots
    /// it no longer does (both in `from`'s writer indexes). The same as joining the op's own
    /// δ-state, without building one.
    pub(super) fn record(&mut self, from: &Writers, x: &str, present: &[Dot], removed: &[Dot]) {
        let mut conv = |d: &Dot| {
            let w = self.writers.intern(from.name(d.writer())).expect("a delta has at most the set's writers");
            (w, d.counter())
        };
        let present: DeltaDots = present.iter().map(&mut conv).collect();
        let removed: DeltaDots = removed.iter().map(&mut conv).collect();
        match self.entries.get_mut(x) {
            None => {
                self.entries.insert(x.to_string(), DeltaEntry { present, removed });
            }
            Some(mine) => join_entry(mine, present, removed, &self.claims, &[]),
        }
    }

    /// Records that the dots `lo..=hi` of `w` (in `from`'s writer indexes) are seen and dead.
    pub(super) fn record_claim(&mut self, from: &Writers, w: u16, lo: u64, hi: u64) {
        let w = self.writers.intern(from.name(w)).expect("a delta has at most the set's writers");
        if !self.claims.contains(&(w, lo, hi)) {
            self.claims.push((w, lo, hi));
        }
    }

    /// Whether a claim covers the dot `(w, c)`.
    pub(super) fn claimed(claims: &[(u16, u64, u64)], (w, c): (u16, u64)) -> bool {
        claims.iter().any(|&(cw, lo, hi)| cw == w && lo <= c && c <= hi)
    }

    /// Joins another delta into this one (both are δ-states, so this is the state join: per
    /// element, a dot stays present unless the other side has seen it without holding it).
    pub fn join_delta(&mut self, other: OrSetDelta) {
        let map: Vec<u16> = other
            .writers
            .names
            .iter()
            .map(|n| self.writers.intern(n).expect("a delta has at most the set's writers"))
            .collect();
        let claims2: Vec<(u16, u64, u64)> =
            other.claims.iter().map(|&(w, lo, hi)| (map[usize::from(w)], lo, hi)).collect();
        if !claims2.is_empty() {
            // The other side's claims cover dots of elements it does not name.
            for (x, mine) in self.entries.iter_mut() {
                if !other.entries.contains_key(x) {
                    let (gone, kept): (DeltaDots, DeltaDots) =
                        mine.present.iter().copied().partition(|d| Self::claimed(&claims2, *d));
                    mine.present = kept;
                    mine.removed.extend(gone);
                }
            }
        }
        for (x, e) in other.entries {
            let conv = |(w, c): &(u16, u64)| (map[usize::from(*w)], *c);
            let p2: DeltaDots = e.present.iter().map(conv).collect();
            let r2: DeltaDots = e.removed.iter().map(conv).collect();
            let mine = self.entries.entry(x).or_default();
            join_entry(mine, p2, r2, &self.claims, &claims2);
        }
        for c in claims2 {
            if !self.claims.contains(&c) {
                self.claims.push(c);
            }
        }
    }
}

/// The δ-state join of one element: `mine` (whose delta has `claims1`) with the element's
/// `present` and `removed` dots from a delta with `claims2`. A dot stays present unless the
/// other side has seen it without holding it.
fn join_entry(
    mine: &mut DeltaEntry,
    p2: DeltaDots,
    r2: DeltaDots,
    claims1: &[(u16, u64, u64)],
    claims2: &[(u16, u64, u64)],
) {
    let seen1: BTreeSet<(u16, u64)> = mine.present.iter().chain(&mine.removed).copied().collect();
    let seen2: BTreeSet<(u16, u64)> = p2.iter().chain(&r2).copied().collect();
    let seen_by_1 = |d: &(u16, u64)| seen1.contains(d) || OrSetDelta::claimed(claims1, *d);
    let seen_by_2 = |d: &(u16, u64)| seen2.contains(d) || OrSetDelta::claimed(claims2, *d);
    let mut present: DeltaDots = mine.present.iter().copied().filter(|d| p2.contains(d) || !seen_by_2(d)).collect();
    for d in &p2 {
        if !mine.present.contains(d) && !seen_by_1(d) {
            present.push(*d);
        }
    }
    present.sort_unstable();
    let removed = seen1.union(&seen2).copied().filter(|d| !present.contains(d)).collect();
    *mine = DeltaEntry { present, removed };
}

#[derive(Serialize, Deserialize)]
pub(super) struct OrSetDeltaWire {
    pub(super) writers: Vec<Actor>,
    pub(super) entries: Vec<(String, DeltaEntry)>,
    /// Absent in deltas written before claims existed.
    #[serde(default)]
    pub(super) claims: Vec<(u16, u64, u64)>,
}

/// [`OrSetDeltaWire`] borrowed from a delta: the same encoding, with no copy of its elements.
#[derive(Serialize)]
struct OrSetDeltaWireRef<'a> {
    writers: &'a [Actor],
    entries: EntriesRef<'a>,
    claims: &'a [(u16, u64, u64)],
}

/// A delta's elements as the sequence of `(element, entry)` pairs the wire form holds.
struct EntriesRef<'a>(&'a BTreeMap<String, DeltaEntry>);

impl Serialize for EntriesRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

impl Serialize for OrSetDelta {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        OrSetDeltaWireRef { writers: &self.writers.names, entries: EntriesRef(&self.entries), claims: &self.claims }
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for OrSetDelta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = OrSetDeltaWire::deserialize(d)?;
        let check = || -> Result<OrSetDelta, OrSetError> {
            let writers = check_writers(&wire.writers)?;
            let mut entries = BTreeMap::new();
            for (x, e) in wire.entries {
                check_element(x.as_bytes())?;
                for (w, c) in e.present.iter().chain(&e.removed) {
                    check_dot(&writers, u64::from(*w), *c)?;
                }
                if entries.insert(x, e).is_some() {
                    return Err(OrSetError::Malformed("duplicate element in delta"));
                }
            }
            if wire.claims.len() > MAX_CLAIMS {
                return Err(OrSetError::Malformed("too many claims in delta"));
            }
            for &(w, lo, hi) in &wire.claims {
                check_dot(&writers, u64::from(w), lo)?;
                check_dot(&writers, u64::from(w), hi)?;
                if hi < lo {
                    return Err(OrSetError::Malformed("empty claim in delta"));
                }
            }
            Ok(OrSetDelta { writers, entries, claims: wire.claims })
        };
        check().map_err(D::Error::custom)
    }
}
