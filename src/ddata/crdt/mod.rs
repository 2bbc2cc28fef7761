//! The replicated data types: an LWW-map, an OR-set, a G-set and the fenced map, all
//! state-based CRDTs whose `merge` is commutative, associative and idempotent (property-tested).
//! Each keeps a canonical digest up to date on every change and hands out deltas (δ-states) of
//! its local changes. What a type provides is the [`DeltaCrdt`] trait (`delta_crdt.rs`);
//! [`ReplicatedData`] and [`ReplicatedDelta`] dispatch to it through `with_types!`, the one list
//! of the types.

use std::collections::{BTreeMap, BTreeSet};

use crdts::LWWReg;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_bytes::ByteBuf;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::error::{Error, Result};

pub(crate) use super::buckets::{BUCKETS, Buckets, bucket_of};
use super::delta_crdt::{DeltaCrdt, self_delta_crdt};
pub(crate) use super::write_ctx::Marker;
pub use super::write_ctx::WriteCtx;

fn lww_entry_hash(key: &str, reg: &LWWReg<Option<ByteBuf>, Marker>) -> u64 {
    let mut h = Xxh3::new();
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key.as_bytes());
    h.update(&reg.marker.0.to_le_bytes());
    h.update(&(reg.marker.1.len() as u64).to_le_bytes());
    h.update(reg.marker.1.as_bytes());
    match &reg.val {
        Some(v) => {
            h.update(&[1]);
            h.update(v);
        }
        None => h.update(&[0]),
    }
    h.digest()
}

type Reg = LWWReg<Option<ByteBuf>, Marker>;

/// A map of last-writer-wins registers. Values are opaque bytes; use [`LwwMap::put_as`] and
/// [`LwwMap::get_as`] for serde types. Removal writes a tombstone (kept, so it wins over older
/// writes everywhere).
///
/// Its digest is a sum of one hash per entry, kept per bucket of keys and updated on every
/// change; its delta is the submap written locally since the last [`LwwMap::take_delta`].
#[derive(Clone, Default)]
pub struct LwwMap {
    entries: BTreeMap<String, Reg>,
    buckets: Buckets,
    delta: Option<BTreeMap<String, Reg>>,
}

#[derive(Serialize, Deserialize)]
struct LwwMapWire {
    entries: BTreeMap<String, Reg>,
}

impl Serialize for LwwMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            entries: &'a BTreeMap<String, Reg>,
        }
        Borrowed { entries: &self.entries }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for LwwMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let wire = LwwMapWire::deserialize(d)?;
        let mut m = LwwMap::default();
        for (k, reg) in wire.entries {
            m.buckets[bucket_of(&k)] = m.buckets[bucket_of(&k)].wrapping_add(lww_entry_hash(&k, &reg));
            m.entries.insert(k, reg);
        }
        Ok(m)
    }
}

impl PartialEq for LwwMap {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}
impl Eq for LwwMap {}

impl std::fmt::Debug for LwwMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LwwMap").field("entries", &self.entries).finish()
    }
}

impl LwwMap {
    /// The value under `key`, if set and not removed.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key)?.val.as_deref().map(|b| b.as_slice())
    }

    /// The value decoded from rmp.
    pub fn get_as<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        self.get(key).map(crate::transport::wire::decode).transpose()
    }

    /// Sets `key`.
    pub fn put(&mut self, ctx: &mut WriteCtx, key: impl Into<String>, value: Vec<u8>) {
        self.write(ctx, key.into(), Some(ByteBuf::from(value)));
    }

    /// Sets `key` to the rmp encoding of `value`.
    pub fn put_as<T: Serialize>(&mut self, ctx: &mut WriteCtx, key: impl Into<String>, value: &T) -> Result<()> {
        let bytes = crate::transport::wire::encode(value)?;
        self.put(ctx, key, bytes.to_vec());
        Ok(())
    }

    /// Removes `key` (writes a tombstone).
    pub fn remove(&mut self, ctx: &mut WriteCtx, key: &str) {
        if self.entries.contains_key(key) {
            self.write(ctx, key.to_string(), None);
        }
    }

    fn write(&mut self, ctx: &mut WriteCtx, key: String, val: Option<ByteBuf>) {
        let floor = self.entries.get(&key).map_or(0, |r| r.marker.0);
        let marker = ctx.next_marker(floor);
        let reg = LWWReg { val, marker };
        self.delta.get_or_insert_with(BTreeMap::new).insert(key.clone(), reg.clone());
        self.set(key, reg);
    }

    /// Installs `reg` under `key`, keeping the bucket digest in step.
    fn set(&mut self, key: String, reg: Reg) {
        let b = bucket_of(&key);
        let added = lww_entry_hash(&key, &reg);
        let removed = self.entries.get(&key).map_or(0, |old| lww_entry_hash(&key, old));
        self.buckets[b] = self.buckets[b].wrapping_sub(removed).wrapping_add(added);
        self.entries.insert(key, reg);
    }

    /// Live entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().filter_map(|(k, r)| Some((k.as_str(), r.val.as_deref()?.as_slice())))
    }

    /// Number of live entries.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// True when no live entry exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of entries, tombstones included.
    pub fn entry_count(&self) -> usize {
        self.entries.len()
    }

    /// Merges another replica's state (higher marker wins per key). A submap is a state, so
    /// this also merges deltas and buckets.
    pub fn merge(&mut self, other: LwwMap) {
        for (k, reg) in other.entries {
            let newer = self.entries.get(&k).is_none_or(|mine| reg.marker > mine.marker);
            if newer {
                self.set(k, reg);
            }
        }
    }

    /// [`LwwMap::merge`] of a borrowed map: only the registers that win are copied.
    pub(crate) fn merge_from(&mut self, other: &LwwMap) {
        for (k, reg) in &other.entries {
            if self.entries.get(k).is_none_or(|mine| reg.marker > mine.marker) {
                self.set(k.clone(), reg.clone());
            }
        }
    }

    /// Canonical digest (the sum of the bucket digests).
    pub fn digest(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, b| a.wrapping_add(*b))
    }

    /// Per-bucket digests.
    pub fn bucket_digests(&self) -> &[u64; BUCKETS] {
        &self.buckets
    }

    /// The submap of the given buckets: a state that merges like any other.
    pub fn buckets_subset(&self, buckets: &[usize]) -> LwwMap {
        let mut m = LwwMap::default();
        for (k, reg) in &self.entries {
            if buckets.contains(&bucket_of(k)) {
                m.set(k.clone(), reg.clone());
            }
        }
        m
    }

    /// Takes the entries written locally since the last take.
    pub fn take_delta(&mut self) -> Option<LwwMap> {
        let entries = self.delta.take()?;
        let mut m = LwwMap::default();
        for (k, reg) in entries {
            m.set(k, reg);
        }
        Some(m)
    }

    /// Approximate encoded size in bytes.
    pub fn approx_bytes(&self) -> usize {
        self.entries.iter().map(|(k, r)| k.len() + r.val.as_ref().map_or(0, |v| v.len()) + r.marker.1.len() + 16).sum()
    }

    /// Highest marker clock in the map (a writer continues above it).
    pub fn max_clock(&self) -> u64 {
        self.entries.values().map(|r| r.marker.0).max().unwrap_or(0)
    }
}

pub use super::fenced::{Fenced, FencedMap};
pub use super::orset::{OrSet, OrSetDelta, OrSetError};

/// A grow-only set of strings. Digest: a sum of one hash per member, per bucket; delta: the
/// members added locally since the last take.
#[derive(Clone, Default)]
pub struct GSet {
    set: BTreeSet<String>,
    buckets: Buckets,
    delta: Option<BTreeSet<String>>,
}

#[derive(Serialize, Deserialize)]
struct GSetWire {
    members: BTreeSet<String>,
}

impl Serialize for GSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            members: &'a BTreeSet<String>,
        }
        Borrowed { members: &self.set }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for GSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let wire = GSetWire::deserialize(d)?;
        let mut g = GSet::default();
        for m in wire.members {
            g.add_member(m);
        }
        Ok(g)
    }
}

impl PartialEq for GSet {
    fn eq(&self, other: &Self) -> bool {
        self.set == other.set
    }
}
impl Eq for GSet {}

impl std::fmt::Debug for GSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(&self.set).finish()
    }
}

impl GSet {
    /// Adds a member.
    pub fn insert(&mut self, member: impl Into<String>) {
        let member = member.into();
        if !self.set.contains(&member) {
            self.delta.get_or_insert_with(BTreeSet::new).insert(member.clone());
            self.add_member(member);
        }
    }
    fn add_member(&mut self, member: String) {
        let b = bucket_of(&member);
        if !self.set.contains(&member) {
            self.buckets[b] = self.buckets[b].wrapping_add(xxh3_64(member.as_bytes()));
            self.set.insert(member);
        }
    }
    /// Whether `member` is in the set.
    pub fn contains(&self, member: &str) -> bool {
        self.set.contains(member)
    }
    /// The members, sorted.
    pub fn members(&self) -> BTreeSet<String> {
        self.set.clone()
    }
    /// The members, sorted, borrowed.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.set.iter().map(String::as_str)
    }
    /// Number of members.
    pub fn len(&self) -> usize {
        self.set.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
    /// Merges another replica's state (or a delta, or a bucket subset).
    pub fn merge(&mut self, other: GSet) {
        for m in other.set {
            self.add_member(m);
        }
    }
    /// [`GSet::merge`] of a borrowed set: only new members are copied.
    pub(crate) fn merge_from(&mut self, other: &GSet) {
        for m in &other.set {
            if !self.set.contains(m) {
                self.add_member(m.clone());
            }
        }
    }
    /// Canonical digest.
    pub fn digest(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, b| a.wrapping_add(*b))
    }
    /// Per-bucket digests.
    pub fn bucket_digests(&self) -> &[u64; BUCKETS] {
        &self.buckets
    }
    /// The members of the given buckets.
    pub fn buckets_subset(&self, buckets: &[usize]) -> GSet {
        let mut g = GSet::default();
        for m in &self.set {
            if buckets.contains(&bucket_of(m)) {
                g.add_member(m.clone());
            }
        }
        g
    }
    /// Approximate encoded size in bytes.
    pub fn approx_bytes(&self) -> usize {
        self.set.iter().map(|m| m.len() + 2).sum()
    }
    /// Takes the members added locally since the last take.
    pub fn take_delta(&mut self) -> Option<GSet> {
        let members = self.delta.take()?;
        let mut g = GSet::default();
        for m in members {
            g.add_member(m);
        }
        Some(g)
    }
}

/// Any value a replicator key can hold.
// The OR-set's inline part is a few hundred bytes; values live one per key in the replicator's
// map, so boxing would add an allocation per key for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicatedData {
    /// LWW-map.
    LwwMap(LwwMap),
    /// OR-set.
    OrSet(OrSet),
    /// G-set.
    GSet(GSet),
    /// LWW-map fenced by epoch (durable entity state).
    FencedMap(FencedMap),
}

/// A change of one value: itself a state of the same type (a δ-state), so deltas merge in any
/// order, lost or duplicated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicatedDelta {
    /// Entries of an LWW-map written since the last take.
    LwwMap(LwwMap),
    /// Adds and removes of an OR-set.
    OrSet(OrSetDelta),
    /// Members added to a G-set.
    GSet(GSet),
    /// Entries written to a fenced map (and its fence) since the last take.
    FencedMap(FencedMap),
}

impl ReplicatedDelta {
    /// The type's name, for errors.
    pub fn type_name(&self) -> &'static str {
        with_types!(match_delta!(self, (T, _d) => <T as DeltaCrdt>::NAME))
    }

    /// Number of elements the delta carries (for batching limits).
    pub fn len(&self) -> usize {
        with_types!(match_delta!(self, (T, d) => T::delta_len(d)))
    }

    /// True when it carries nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate encoded size in bytes.
    pub fn approx_bytes(&self) -> usize {
        with_types!(match_delta!(self, (T, d) => T::delta_bytes(d)))
    }

    /// Joins `other` into `self` (same type), so pending deltas of one key ship as one.
    pub fn join(&mut self, other: ReplicatedDelta) -> std::result::Result<(), (&'static str, &'static str)> {
        with_types!(match_pair!(
            ReplicatedDelta(self), ReplicatedDelta(other),
            (T, a, b) => T::join_deltas(a, b),
            (a, b) => return Err((a.type_name(), b.type_name()))
        ));
        Ok(())
    }

    /// The writer's fence carried by a fenced map's delta; `None` for other types.
    pub fn fence(&self) -> Option<u64> {
        with_types!(match_delta!(self, (T, d) => T::delta_fence(d)))
    }

    /// The empty value of the delta's type (what a replica without the key merges it into).
    pub fn empty_value(&self) -> ReplicatedData {
        with_types!(match_delta!(self, (T, _d) => T::default().into_data()))
    }
}

/// Why a merge was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeError {
    /// The incoming value or delta is of another type than the local value.
    WrongType {
        /// Local type.
        mine: &'static str,
        /// Incoming type.
        theirs: &'static str,
    },
    /// The incoming OR-set would break a limit.
    Invalid(OrSetError),
}

impl ReplicatedData {
    /// The type's name, for errors.
    pub fn type_name(&self) -> &'static str {
        with_types!(match_data!(self, (T, _v) => <T as DeltaCrdt>::NAME))
    }

    /// Merges `other` into `self`; both must be of the same type.
    pub fn merge(&mut self, other: ReplicatedData) -> std::result::Result<(), (&'static str, &'static str)> {
        match self.try_merge(other) {
            Ok(()) => Ok(()),
            Err(MergeError::WrongType { mine, theirs }) => Err((mine, theirs)),
            Err(MergeError::Invalid(e)) => {
                tracing::warn!(error = %e, "merge refused");
                Ok(())
            }
        }
    }

    /// Merges `other` into `self`, leaving `self` unchanged on error.
    pub fn try_merge(&mut self, other: ReplicatedData) -> std::result::Result<(), MergeError> {
        with_types!(match_pair!(
            ReplicatedData(self), ReplicatedData(other),
            (T, a, b) => T::merge_state(a, b).map_err(MergeError::from),
            (a, b) => Err(MergeError::WrongType { mine: a.type_name(), theirs: b.type_name() })
        ))
    }

    /// Merges a delta, leaving `self` unchanged on error. O(delta).
    pub fn merge_delta(&mut self, delta: &ReplicatedDelta) -> std::result::Result<(), MergeError> {
        with_types!(match_pair!(
            ReplicatedData(self), ReplicatedDelta(delta),
            (T, a, b) => T::merge_delta_state(a, b).map_err(MergeError::from),
            (a, b) => Err(MergeError::WrongType { mine: a.type_name(), theirs: b.type_name() })
        ))
    }

    /// Takes the local changes since the last take.
    pub fn take_delta(&mut self) -> Option<ReplicatedDelta> {
        with_types!(match_data!(self, (T, v) => T::take_delta_state(v).map(T::wrap_delta)))
    }

    /// Canonical digest: equal values have equal digests on every node.
    pub fn digest(&self) -> u64 {
        let (tag, d) = with_types!(match_data!(self, (T, v) => (T::DIGEST_TAG, T::state_digest(v))));
        d.wrapping_add(tag.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// Per-bucket digests, for values that can be shipped by bucket (maps and G-sets).
    pub fn bucket_digests(&self) -> Option<&[u64; BUCKETS]> {
        with_types!(match_data!(self, (T, v) => T::state_bucket_digests(v)))
    }

    /// The part of the value in the given buckets (the whole value for an OR-set, whose causal
    /// context cannot be split).
    pub fn buckets_subset(&self, buckets: &[usize]) -> ReplicatedData {
        with_types!(match_data!(self, (T, v) => T::state_buckets_subset(v, buckets).into_data()))
    }

    /// Approximate encoded size in bytes (for message budgets; never encodes).
    pub fn approx_bytes(&self) -> usize {
        with_types!(match_data!(self, (T, v) => T::state_bytes(v)))
    }

    /// Number of elements (entries, members), for batching limits.
    pub fn element_count(&self) -> usize {
        with_types!(match_data!(self, (T, v) => T::element_count(v)))
    }

    /// The fence of a fenced map (what a replica judges a replicated write by); `None` for
    /// types without one.
    pub fn fence(&self) -> Option<u64> {
        with_types!(match_data!(self, (T, v) => T::state_fence(v)))
    }
}

impl From<std::convert::Infallible> for MergeError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

impl From<OrSetError> for MergeError {
    fn from(e: OrSetError) -> Self {
        MergeError::Invalid(e)
    }
}

/// A CRDT type a key can hold, with conversions to and from [`ReplicatedData`].
pub trait Crdt: Clone + Default + Send + 'static {
    /// Name for errors.
    const NAME: &'static str;
    /// Wraps the value.
    fn into_data(self) -> ReplicatedData;
    /// Unwraps a value of this type.
    fn from_data(data: ReplicatedData, key: &str) -> Result<Self>;
    /// Borrows a value of this type mutably.
    fn data_mut<'a>(data: &'a mut ReplicatedData, key: &str) -> Result<&'a mut Self>;
    /// Borrows a value of this type.
    fn data_ref<'a>(data: &'a ReplicatedData, key: &str) -> Result<&'a Self>;
}

/// Every replicated type, each named as its variant of [`ReplicatedData`] and
/// [`ReplicatedDelta`] (the type's `DeltaCrdt::Delta` in the latter): adding a type is its file,
/// its two variants and its name here. Calls `$callback!([types…] args…)`.
macro_rules! with_types {
    ($callback:ident ! ($($args:tt)*)) => {
        $callback! { [LwwMap, OrSet, GSet, FencedMap] $($args)* }
    };
}
use with_types;

/// `match` on a [`ReplicatedData`], the body run with `$ty` naming the variant's type and `$v`
/// bound to its value.
macro_rules! match_data {
    ([$($t:ident),*] $value:expr, ($ty:ident, $v:ident) => $body:expr) => {
        match $value {
            $(ReplicatedData::$t($v) => {
                #[allow(dead_code)]
                type $ty = $t;
                $body
            })*
        }
    };
}
use match_data;

/// `match` on a [`ReplicatedDelta`], as [`match_data`].
macro_rules! match_delta {
    ([$($t:ident),*] $value:expr, ($ty:ident, $v:ident) => $body:expr) => {
        match $value {
            $(ReplicatedDelta::$t($v) => {
                #[allow(dead_code)]
                type $ty = $t;
                $body
            })*
        }
    };
}
use match_delta;

/// `match` on two values of the enums named, the body run where both are of one type, the
/// fallback where they differ.
macro_rules! match_pair {
    ([$($t:ident),*] $left:ident($lhs:expr), $right:ident($rhs:expr),
        ($ty:ident, $a:ident, $b:ident) => $body:expr, ($x:ident, $y:ident) => $otherwise:expr) => {
        match ($lhs, $rhs) {
            $(($left::$t($a), $right::$t($b)) => {
                #[allow(dead_code)]
                type $ty = $t;
                $body
            })*
            ($x, $y) => $otherwise,
        }
    };
}
use match_pair;

macro_rules! impl_crdt {
    ([$($t:ident),*]) => {
        $(impl Crdt for $t {
            const NAME: &'static str = <$t as DeltaCrdt>::NAME;
            fn into_data(self) -> ReplicatedData {
                ReplicatedData::$t(self)
            }
            fn from_data(data: ReplicatedData, key: &str) -> Result<Self> {
                match data {
                    ReplicatedData::$t(v) => Ok(v),
                    other => Err(wrong_type::<Self>(key, &other)),
                }
            }
            fn data_mut<'a>(data: &'a mut ReplicatedData, key: &str) -> Result<&'a mut Self> {
                match data {
                    ReplicatedData::$t(v) => Ok(v),
                    other => Err(wrong_type::<Self>(key, other)),
                }
            }
            fn data_ref<'a>(data: &'a ReplicatedData, key: &str) -> Result<&'a Self> {
                match data {
                    ReplicatedData::$t(v) => Ok(v),
                    other => Err(wrong_type::<Self>(key, other)),
                }
            }
        }
        impl DeltaVariant for $t {
            fn wrap_delta(delta: <Self as DeltaCrdt>::Delta) -> ReplicatedDelta {
                ReplicatedDelta::$t(delta)
            }
        })*
    };
}
with_types!(impl_crdt!());

/// The [`ReplicatedDelta`] variant of a type's delta.
trait DeltaVariant: DeltaCrdt {
    fn wrap_delta(delta: Self::Delta) -> ReplicatedDelta;
}

fn wrong_type<T: Crdt>(key: &str, found: &ReplicatedData) -> Error {
    Error::WrongDataType { key: key.to_string(), expected: T::NAME, found: found.type_name() }
}

self_delta_crdt!(LwwMap, "LwwMap", tag 1, count entry_count);
self_delta_crdt!(GSet, "GSet", tag 3, count len);

#[cfg(test)]
mod tests;
