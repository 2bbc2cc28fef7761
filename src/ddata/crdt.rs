//! The replicated data types: an LWW-map, an OR-set and a G-set, all state-based CRDTs whose
//! `merge` is commutative, associative and idempotent (property-tested).

use std::collections::{BTreeMap, BTreeSet};

use crdts::{CmRDT, CvRDT, GSet as CrdtGSet, LWWReg, Orswot};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_bytes::ByteBuf;

use crate::error::{Error, Result};

/// Identity of a writer: `node_id#generation`, so an actor is never reused by a restarted node
/// (re-used actors with a lower counter would silently lose OR-set adds).
pub type Actor = String;

/// LWW marker: hybrid logical clock value, then the writer, so two writers never tie.
pub type Marker = (u64, Actor);

/// What an update closure may use: the writer identity and its clock.
#[derive(Debug)]
pub struct WriteCtx {
    pub(crate) actor: Actor,
    pub(crate) clock: u64,
    pub(crate) now_ms: u64,
}

impl WriteCtx {
    /// A context for code that builds CRDT values outside a replicator (tests, tools).
    pub fn new(actor: impl Into<Actor>, now_ms: u64) -> Self {
        WriteCtx { actor: actor.into(), clock: 0, now_ms }
    }

    /// The writer identity.
    pub fn actor(&self) -> &str {
        &self.actor
    }

    /// Next marker, strictly above `floor` and every marker this writer issued: a writer that
    /// has read a value always overwrites it, whatever the wall clocks say.
    fn next_marker(&mut self, floor: u64) -> Marker {
        let t = self.now_ms.max(self.clock + 1).max(floor + 1);
        self.clock = t;
        (t, self.actor.clone())
    }
}

/// A map of last-writer-wins registers. Values are opaque bytes; use [`LwwMap::put_as`] and
/// [`LwwMap::get_as`] for serde types. Removal writes a tombstone (kept, so it wins over older
/// writes everywhere).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LwwMap {
    entries: BTreeMap<String, LWWReg<Option<ByteBuf>, Marker>>,
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
        self.entries.insert(key, LWWReg { val, marker });
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

    /// Merges another replica's state (higher marker wins per key).
    pub fn merge(&mut self, other: LwwMap) {
        for (k, reg) in other.entries {
            match self.entries.get_mut(&k) {
                Some(mine) => mine.merge(reg),
                None => {
                    self.entries.insert(k, reg);
                }
            }
        }
    }
}

/// An observed-remove set of strings (add wins over a concurrent remove).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrSet {
    set: Orswot<String, Actor>,
}

impl Default for OrSet {
    fn default() -> Self {
        OrSet { set: Orswot::new() }
    }
}

impl OrSet {
    /// Adds a member.
    pub fn add(&mut self, ctx: &WriteCtx, member: impl Into<String>) {
        let op = self.set.add(member.into(), self.set.read_ctx().derive_add_ctx(ctx.actor.clone()));
        self.set.apply(op);
    }

    /// Adds several members in one dot.
    pub fn add_all<I: IntoIterator<Item = String>>(&mut self, ctx: &WriteCtx, members: I) {
        let op = self.set.add_all(members, self.set.read_ctx().derive_add_ctx(ctx.actor.clone()));
        self.set.apply(op);
    }

    /// Removes a member (only the adds this replica has seen).
    pub fn remove(&mut self, member: &str) {
        let member = member.to_string();
        let op = self.set.rm(member.clone(), self.set.contains(&member).derive_rm_ctx());
        self.set.apply(op);
    }

    /// Whether `member` is in the set.
    pub fn contains(&self, member: &str) -> bool {
        self.set.contains(&member.to_string()).val
    }

    /// The members, sorted.
    pub fn members(&self) -> BTreeSet<String> {
        self.set.iter().map(|r| r.val.clone()).collect()
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.set.iter().count()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Merges another replica's state.
    pub fn merge(&mut self, other: OrSet) {
        self.set.merge(other.set);
    }
}

/// A grow-only set of strings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GSet {
    set: CrdtGSet<String>,
}

impl GSet {
    /// Adds a member.
    pub fn insert(&mut self, member: impl Into<String>) {
        self.set.insert(member.into());
    }
    /// Whether `member` is in the set.
    pub fn contains(&self, member: &str) -> bool {
        self.set.contains(&member.to_string())
    }
    /// The members, sorted.
    pub fn members(&self) -> BTreeSet<String> {
        self.set.read()
    }
    /// Merges another replica's state.
    pub fn merge(&mut self, other: GSet) {
        self.set.merge(other.set);
    }
}

/// Any value a replicator key can hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicatedData {
    /// LWW-map.
    LwwMap(LwwMap),
    /// OR-set.
    OrSet(OrSet),
    /// G-set.
    GSet(GSet),
}

impl ReplicatedData {
    /// The type's name, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            ReplicatedData::LwwMap(_) => LwwMap::NAME,
            ReplicatedData::OrSet(_) => OrSet::NAME,
            ReplicatedData::GSet(_) => GSet::NAME,
        }
    }

    /// Merges `other` into `self`; both must be of the same type.
    pub fn merge(&mut self, other: ReplicatedData) -> std::result::Result<(), (&'static str, &'static str)> {
        match (self, other) {
            (ReplicatedData::LwwMap(a), ReplicatedData::LwwMap(b)) => a.merge(b),
            (ReplicatedData::OrSet(a), ReplicatedData::OrSet(b)) => a.merge(b),
            (ReplicatedData::GSet(a), ReplicatedData::GSet(b)) => a.merge(b),
            (a, b) => return Err((a.type_name(), b.type_name())),
        }
        Ok(())
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
}

macro_rules! impl_crdt {
    ($t:ident, $name:literal) => {
        impl Crdt for $t {
            const NAME: &'static str = $name;
            fn into_data(self) -> ReplicatedData {
                ReplicatedData::$t(self)
            }
            fn from_data(data: ReplicatedData, key: &str) -> Result<Self> {
                match data {
                    ReplicatedData::$t(v) => Ok(v),
                    other => {
                        Err(Error::WrongDataType { key: key.to_string(), expected: $name, found: other.type_name() })
                    }
                }
            }
            fn data_mut<'a>(data: &'a mut ReplicatedData, key: &str) -> Result<&'a mut Self> {
                match data {
                    ReplicatedData::$t(v) => Ok(v),
                    other => {
                        Err(Error::WrongDataType { key: key.to_string(), expected: $name, found: other.type_name() })
                    }
                }
            }
        }
    };
}
impl_crdt!(LwwMap, "LwwMap");
impl_crdt!(OrSet, "OrSet");
impl_crdt!(GSet, "GSet");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lww_writer_that_read_a_value_overwrites_it_even_with_an_older_clock() {
        let mut a = LwwMap::default();
        let mut fast = WriteCtx::new("a#1", 10_000);
        a.put(&mut fast, "k", b"from-a".to_vec());
        let mut slow = WriteCtx::new("b#1", 5);
        let mut b = a.clone();
        b.put(&mut slow, "k", b"from-b".to_vec());
        a.merge(b);
        assert_eq!(a.get("k"), Some(&b"from-b"[..]));
    }

    #[test]
    fn lww_remove_is_a_tombstone_that_wins_over_the_older_write() {
        let mut ctx = WriteCtx::new("a#1", 1);
        let mut a = LwwMap::default();
        a.put(&mut ctx, "k", vec![1]);
        let old = a.clone();
        a.remove(&mut ctx, "k");
        a.merge(old);
        assert_eq!(a.get("k"), None);
        assert!(a.is_empty());
    }

    #[test]
    fn orset_concurrent_add_wins_over_remove() {
        let c1 = WriteCtx::new("a#1", 1);
        let c2 = WriteCtx::new("b#1", 1);
        let mut a = OrSet::default();
        a.add(&c1, "x");
        let mut b = a.clone();
        b.remove("x");
        a.add(&c1, "x");
        b.add(&c2, "y");
        a.merge(b);
        assert!(a.contains("x"));
        assert!(a.contains("y"));
    }

    #[test]
    fn merging_different_types_is_refused() {
        let mut a = ReplicatedData::GSet(GSet::default());
        assert_eq!(a.merge(ReplicatedData::OrSet(OrSet::default())), Err(("GSet", "OrSet")));
    }
}
