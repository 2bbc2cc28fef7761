//! A last-writer-wins map fenced by epoch: the replicated home of durable entity state.
//!
//! **Order.** Each register is `(epoch, clock, value)` and the greater one wins a merge. The
//! epoch is the writer's fencing token (a shard's allocation epoch), so a write under a newer
//! allocation beats every write of an older one, whatever the wall clocks say; the clock orders
//! the writes of one epoch (the next write of a key under the same epoch counts on from the
//! last, so it needs no wall clock); the value only breaks a tie that a single writer per epoch
//! never makes, so that merges stay commutative even if that assumption is broken.
//!
//! **Fence.** The map carries the highest epoch that has *claimed* it (or written to it), merged
//! by max. A local write under an epoch below the fence is refused ([`Fenced`]), and a replica
//! refuses a replicated write whose writer's fence is below its own
//! ([`FencedMap::admits_write_from`]). A new allocation claims the map on the replicas it reads
//! from before it reads (see `ReplicatorMsg::MergeThenRead`), so an older incarnation can no
//! longer have a write acknowledged by a majority once the newer one has loaded the state.
//!
//! **Digest.** Like the LWW-map: one hash per entry summed per bucket of keys, so anti-entropy
//! ships only the buckets that differ; the fence is folded into bucket 0, so a map that differs
//! only in its fence still differs in a bucket, and every subset or delta carries the fence.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::buckets::{BUCKETS, Buckets, bucket_of};
use super::delta_crdt::self_delta_crdt;
use super::encoded_len::rmp_uint_len;

/// A write refused because a newer allocation (epoch `fence`) has claimed the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("write under epoch {epoch} refused: epoch {fence} has claimed this state")]
pub struct Fenced {
    /// The writer's epoch.
    pub epoch: u64,
    /// The map's fence.
    pub fence: u64,
}

/// One register: epoch, clock within the epoch, value (`None`: deleted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FencedReg(u64, u64, Option<ByteBuf>);

impl FencedReg {
    fn wins_over(&self, other: &FencedReg) -> bool {
        (self.0, self.1, &self.2) > (other.0, other.1, &other.2)
    }

    fn hash(&self, key: &str) -> u64 {
        let mut h = Xxh3::new();
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        h.update(&self.0.to_le_bytes());
        h.update(&self.1.to_le_bytes());
        match &self.2 {
            Some(v) => {
                h.update(&[1]);
                h.update(v);
            }
            None => h.update(&[0]),
        }
        h.digest()
    }
}

/// Approximate encoded bytes of one entry: the key and its header, the register's array
/// header, epoch, clock, and the value with its header (or nil).
fn entry_bytes(key: &str, r: &FencedReg) -> usize {
    reg_bytes(key.len(), r.0, r.1, r.2.as_ref().map(|v| v.len()))
}

/// [`entry_bytes`] from the parts' sizes.
fn reg_bytes(key_len: usize, epoch: u64, clock: u64, value_len: Option<usize>) -> usize {
    let value = value_len.map_or(1, |len| len + rmp_uint_len(len as u64) + 1);
    key_len + 2 + rmp_uint_len(epoch) + rmp_uint_len(clock) + value
}

/// The clock of the next write under `epoch` of a key whose register is `current`.
fn next_clock_after(current: &FencedReg, epoch: u64) -> u64 {
    // An entry from a newer epoch is impossible below the fence (every write raises it).
    if current.0 == epoch { current.1.saturating_add(1) } else { 1 }
}

/// Installs `reg` at `entry` (one lookup), keeping `buckets` and the entries' byte count in
/// step.
fn install(buckets: &mut Buckets, total_bytes: &mut usize, entry: Entry<'_, String, FencedReg>, reg: FencedReg) {
    match entry {
        Entry::Occupied(mut o) => {
            account(buckets, total_bytes, o.key(), Some(o.get()), &reg);
            o.insert(reg);
        }
        Entry::Vacant(v) => {
            account(buckets, total_bytes, v.key(), None, &reg);
            v.insert(reg);
        }
    }
}

/// Moves `buckets` and the byte count from `old` (`None`: no entry) to `new`, `key`'s
/// register.
fn account(buckets: &mut Buckets, total_bytes: &mut usize, key: &str, old: Option<&FencedReg>, new: &FencedReg) {
    let b = bucket_of(key);
    let (removed, old_bytes) = old.map_or((0, 0), |old| (old.hash(key), entry_bytes(key, old)));
    buckets[b] = buckets[b].wrapping_sub(removed).wrapping_add(new.hash(key));
    *total_bytes = *total_bytes - old_bytes + entry_bytes(key, new);
}

/// Hash of a fence, folded into bucket 0 (0 for no fence, so an empty map digests to 0).
fn fence_hash(fence: u64) -> u64 {
    if fence == 0 { 0 } else { xxh3_64(&fence.to_le_bytes()) }
}

/// An LWW-map whose registers are ordered by writer epoch first, with a fence; see the module
/// documentation.
#[derive(Clone, Default)]
pub struct FencedMap {
    fence: u64,
    entries: BTreeMap<String, FencedReg>,
    buckets: Buckets,
    /// Local writes since the last take, and whether the fence moved locally (a claim).
    delta: BTreeMap<String, FencedReg>,
    claimed: bool,
    /// The entries' share of [`FencedMap::approx_bytes`], kept in step by `set` so a size check
    /// costs O(1).
    entry_bytes: usize,
}

#[derive(Serialize, Deserialize)]
struct FencedMapWire {
    fence: u64,
    entries: BTreeMap<String, FencedReg>,
}

impl Serialize for FencedMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            fence: u64,
            entries: &'a BTreeMap<String, FencedReg>,
        }
        Borrowed { fence: self.fence, entries: &self.entries }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for FencedMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let wire = FencedMapWire::deserialize(d)?;
        let mut m = FencedMap::default();
        // The fence is at least every entry's epoch (every write raises it); a peer's value
        // that says otherwise is read as if it did.
        let newest = wire.entries.values().map(|r| r.0).max().unwrap_or(0);
        m.raise_fence(wire.fence.max(newest));
        for (k, reg) in wire.entries {
            m.set(k, reg);
        }
        Ok(m)
    }
}

impl PartialEq for FencedMap {
    fn eq(&self, other: &Self) -> bool {
        self.fence == other.fence && self.entries == other.entries
    }
}
impl Eq for FencedMap {}

impl std::fmt::Debug for FencedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedMap").field("fence", &self.fence).field("entries", &self.entries).finish()
    }
}

impl FencedMap {
    /// The highest epoch that claimed or wrote this map (0: none).
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// Claims the map for `epoch`: from now on writes under older epochs are refused. A claim
    /// under an epoch below the fence changes nothing and is refused.
    pub fn claim(&mut self, epoch: u64) -> Result<(), Fenced> {
        if epoch < self.fence {
            return Err(Fenced { epoch, fence: self.fence });
        }
        if epoch > self.fence {
            self.raise_fence(epoch);
            self.claimed = true;
        }
        Ok(())
    }

    /// Sets `key` to `value` under `epoch`.
    pub fn put(&mut self, key: impl Into<String>, epoch: u64, value: Vec<u8>) -> Result<(), Fenced> {
        self.write(key.into(), epoch, Some(ByteBuf::from(value)))
    }

    /// Deletes `key` under `epoch` (a tombstone, so the deletion wins over older writes).
    pub fn delete(&mut self, key: &str, epoch: u64) -> Result<(), Fenced> {
        if epoch < self.fence {
            return Err(Fenced { epoch, fence: self.fence });
        }
        if self.entries.get(key).is_none_or(|r| r.2.is_none()) {
            return Ok(());
        }
        self.write(key.to_string(), epoch, None)
    }

    fn write(&mut self, key: String, epoch: u64, value: Option<ByteBuf>) -> Result<(), Fenced> {
        if epoch < self.fence {
            return Err(Fenced { epoch, fence: self.fence });
        }
        if epoch > self.fence {
            self.raise_fence(epoch);
            self.claimed = true;
        }
        // One lookup for the clock and the install.
        let delta_key = key.clone();
        let entry = self.entries.entry(key);
        let clock = match &entry {
            Entry::Occupied(o) => next_clock_after(o.get(), epoch),
            Entry::Vacant(_) => 1,
        };
        let reg = FencedReg(epoch, clock, value);
        install(&mut self.buckets, &mut self.entry_bytes, entry, reg.clone());
        self.delta.insert(delta_key, reg);
        Ok(())
    }

    fn raise_fence(&mut self, fence: u64) {
        if fence > self.fence {
            self.buckets[0] = self.buckets[0].wrapping_sub(fence_hash(self.fence)).wrapping_add(fence_hash(fence));
            self.fence = fence;
        }
    }

    /// Installs `reg` under `key`, keeping the bucket digest and the size in step.
    fn set(&mut self, key: String, reg: FencedReg) {
        install(&mut self.buckets, &mut self.entry_bytes, self.entries.entry(key), reg);
    }

    /// Whether a write of a `value_len`-byte value under `key` at `epoch` keeps the map within
    /// `budget` bytes of [`FencedMap::approx_bytes`] — or does not grow it (no new key, a value
    /// no longer than the current one): a map at its budget still takes those, so its entities
    /// keep working; only growth past the budget is refused. Fence checks are the write's own.
    pub fn fits(&self, key: &str, epoch: u64, value_len: usize, budget: usize) -> bool {
        let current = self.entries.get(key);
        if current.is_some_and(|r| r.2.as_ref().is_some_and(|v| v.len() >= value_len)) {
            return true;
        }
        let old = current.map_or(0, |r| entry_bytes(key, r));
        let clock = current.map_or(1, |r| next_clock_after(r, epoch));
        let new = reg_bytes(key.len(), epoch, clock, Some(value_len));
        self.approx_bytes() - old + new <= budget
    }

    /// The value under `key`, unless absent or deleted.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key)?.2.as_deref().map(|b| b.as_slice())
    }

    /// The epoch of the write that set (or deleted) `key`.
    pub fn epoch_of(&self, key: &str) -> Option<u64> {
        self.entries.get(key).map(|r| r.0)
    }

    /// Live entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().filter_map(|(k, r)| Some((k.as_str(), r.2.as_deref()?.as_slice())))
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

    /// Whether a replicated write from a writer whose map had fence `writer_fence` may be
    /// applied here: not when a newer epoch has claimed this replica.
    pub fn admits_write_from(&self, writer_fence: u64) -> bool {
        writer_fence >= self.fence
    }

    /// Merges another replica's state, a delta or a bucket subset: the greater register wins
    /// per key, the fence is the greater one.
    pub fn merge(&mut self, other: FencedMap) {
        self.raise_fence(other.fence);
        for (k, reg) in other.entries {
            let entry = self.entries.entry(k);
            if let Entry::Occupied(mine) = &entry
                && !reg.wins_over(mine.get())
            {
                continue;
            }
            install(&mut self.buckets, &mut self.entry_bytes, entry, reg);
        }
    }

    /// [`FencedMap::merge`] of a borrowed map (a delta also persisted after it is merged):
    /// only the registers that win are copied.
    pub(crate) fn merge_from(&mut self, other: &FencedMap) {
        self.raise_fence(other.fence);
        for (k, reg) in &other.entries {
            match self.entries.get_mut(k.as_str()) {
                Some(mine) if reg.wins_over(mine) => {
                    account(&mut self.buckets, &mut self.entry_bytes, k, Some(mine), reg);
                    *mine = reg.clone();
                }
                Some(_) => {}
                None => {
                    account(&mut self.buckets, &mut self.entry_bytes, k, None, reg);
                    self.entries.insert(k.clone(), reg.clone());
                }
            }
        }
    }

    /// Canonical digest (the sum of the bucket digests).
    pub fn digest(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, b| a.wrapping_add(*b))
    }

    /// Per-bucket digests (the fence is part of bucket 0's).
    pub fn bucket_digests(&self) -> &[u64; BUCKETS] {
        &self.buckets
    }

    /// The entries of the given buckets, with the fence.
    pub fn buckets_subset(&self, buckets: &[usize]) -> FencedMap {
        let mut m = FencedMap::default();
        m.raise_fence(self.fence);
        for (k, reg) in &self.entries {
            if buckets.contains(&bucket_of(k)) {
                m.set(k.clone(), reg.clone());
            }
        }
        m
    }

    /// Takes the local writes and claim since the last take, as a map that carries the current
    /// fence (what replicas judge the write by).
    pub fn take_delta(&mut self) -> Option<FencedMap> {
        if self.delta.is_empty() && !std::mem::take(&mut self.claimed) {
            return None;
        }
        self.claimed = false;
        let mut m = FencedMap::default();
        m.raise_fence(self.fence);
        for (k, reg) in std::mem::take(&mut self.delta) {
            m.set(k, reg);
        }
        Some(m)
    }

    /// Approximate encoded size in bytes (never encodes; O(1)).
    pub fn approx_bytes(&self) -> usize {
        // The two named fields and the map headers.
        self.entry_bytes + rmp_uint_len(self.fence) + 18
    }
}

self_delta_crdt!(FencedMap, "FencedMap", tag 4, count entry_count, fenced);

#[cfg(test)]
mod tests {
    use super::*;

    fn value(m: &FencedMap, k: &str) -> Option<Vec<u8>> {
        m.get(k).map(<[u8]>::to_vec)
    }

    #[test]
    fn a_write_under_a_newer_epoch_wins_whatever_the_order_of_merges() {
        let mut old = FencedMap::default();
        old.put("cart-1", 5, b"old".to_vec()).unwrap();
        for _ in 0..10 {
            old.put("cart-1", 5, b"old-later".to_vec()).unwrap();
        }
        let mut new = FencedMap::default();
        new.put("cart-1", 6, b"new".to_vec()).unwrap();
        let mut a = old.clone();
        a.merge(new.clone());
        let mut b = new.clone();
        b.merge(old.clone());
        assert_eq!(a, b);
        assert_eq!(value(&a, "cart-1"), Some(b"new".to_vec()));
        assert_eq!(a.epoch_of("cart-1"), Some(6));
        assert_eq!(a.fence(), 6);
    }

    #[test]
    fn writes_of_one_epoch_are_ordered_by_their_clock() {
        let mut m = FencedMap::default();
        m.put("k", 3, b"first".to_vec()).unwrap();
        let first = m.clone();
        m.put("k", 3, b"second".to_vec()).unwrap();
        let mut merged = m.clone();
        merged.merge(first.clone());
        assert_eq!(value(&merged, "k"), Some(b"second".to_vec()));
        let mut other_way = first;
        other_way.merge(m);
        assert_eq!(value(&other_way, "k"), Some(b"second".to_vec()));
    }

    #[test]
    fn a_claim_refuses_later_writes_and_claims_of_older_epochs() {
        let mut m = FencedMap::default();
        m.put("k", 4, b"v".to_vec()).unwrap();
        m.claim(7).unwrap();
        assert_eq!(m.put("k", 4, b"stale".to_vec()), Err(Fenced { epoch: 4, fence: 7 }));
        assert_eq!(m.delete("k", 6), Err(Fenced { epoch: 6, fence: 7 }));
        assert_eq!(m.claim(5), Err(Fenced { epoch: 5, fence: 7 }));
        assert_eq!(value(&m, "k"), Some(b"v".to_vec()), "a refused write changes nothing");
        m.claim(7).unwrap();
        m.put("k", 7, b"new".to_vec()).unwrap();
        assert_eq!(value(&m, "k"), Some(b"new".to_vec()));
        assert_eq!(m.fence(), 7);
    }

    #[test]
    fn a_replica_admits_writes_only_from_writers_at_or_above_its_fence() {
        let mut replica = FencedMap::default();
        assert!(replica.admits_write_from(0));
        replica.claim(9).unwrap();
        assert!(!replica.admits_write_from(8));
        assert!(replica.admits_write_from(9));
        assert!(replica.admits_write_from(10));
    }

    #[test]
    fn a_delete_is_a_tombstone_that_beats_the_older_value_everywhere() {
        let mut m = FencedMap::default();
        m.put("k", 2, b"v".to_vec()).unwrap();
        let before = m.clone();
        m.delete("k", 2).unwrap();
        assert_eq!(m.get("k"), None);
        assert_eq!((m.len(), m.entry_count(), m.is_empty()), (0, 1, true));
        let mut merged = before;
        merged.merge(m.clone());
        assert_eq!(merged.get("k"), None);
        assert_eq!(merged, m);
        // Deleting what is absent or already deleted writes nothing.
        let mut fresh = FencedMap::default();
        fresh.delete("absent", 1).unwrap();
        assert_eq!(fresh.take_delta(), None);
        m.take_delta();
        m.delete("k", 2).unwrap();
        assert_eq!(m.take_delta(), None);
    }

    #[test]
    fn a_delta_carries_the_local_writes_and_the_current_fence() {
        let mut m = FencedMap::default();
        m.put("a", 3, b"1".to_vec()).unwrap();
        m.put("b", 3, b"2".to_vec()).unwrap();
        let d = m.take_delta().unwrap();
        assert_eq!((d.len(), d.fence()), (2, 3));
        assert_eq!(m.take_delta(), None, "nothing written since");
        // A merge is not a local change.
        let mut other = FencedMap::default();
        other.put("c", 4, b"3".to_vec()).unwrap();
        m.merge(other);
        assert_eq!(m.take_delta(), None);
        // A claim alone is a delta of no entries that carries the fence.
        m.claim(8).unwrap();
        let d = m.take_delta().unwrap();
        assert_eq!((d.entry_count(), d.fence()), (0, 8));
        assert_eq!(m.take_delta(), None);
        // A delta merged anywhere gives what the writer has.
        let mut replica = FencedMap::default();
        let mut writer = m.clone();
        writer.put("a", 8, b"new".to_vec()).unwrap();
        replica.merge(m.clone());
        replica.merge(writer.take_delta().unwrap());
        assert_eq!(replica, writer);
    }

    #[test]
    fn a_map_that_differs_only_in_its_fence_differs_in_a_bucket_and_its_subsets_carry_the_fence() {
        let mut a = FencedMap::default();
        a.put("k", 1, b"v".to_vec()).unwrap();
        let mut b = a.clone();
        b.claim(2).unwrap();
        assert_ne!(a.digest(), b.digest());
        let differing: Vec<usize> = (0..BUCKETS).filter(|&i| a.bucket_digests()[i] != b.bucket_digests()[i]).collect();
        assert_eq!(differing, vec![0]);
        let subset = b.buckets_subset(&differing);
        assert_eq!(subset.fence(), 2);
        a.merge(subset);
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a, b);
        assert_eq!(FencedMap::default().digest(), 0);
    }

    #[test]
    fn the_digest_follows_every_change_and_equals_a_fresh_computation() {
        let mut m = FencedMap::default();
        let mut digests = vec![m.digest()];
        m.put("a", 1, b"x".to_vec()).unwrap();
        digests.push(m.digest());
        m.put("a", 1, b"y".to_vec()).unwrap();
        digests.push(m.digest());
        m.delete("a", 1).unwrap();
        digests.push(m.digest());
        m.claim(4).unwrap();
        digests.push(m.digest());
        let mut unique = digests.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), digests.len(), "{digests:?}");
        let decoded: FencedMap = rmp_serde::from_slice(&rmp_serde::to_vec_named(&m).unwrap()).unwrap();
        assert_eq!(decoded.digest(), m.digest());
        assert_eq!(decoded.bucket_digests(), m.bucket_digests());
        assert_eq!(decoded, m);
    }

    #[test]
    fn a_claim_under_the_current_fence_changes_nothing_and_ships_no_delta() {
        let mut m = FencedMap::default();
        m.claim(5).unwrap();
        assert_eq!(m.take_delta().map(|d| d.fence()), Some(5), "a new claim ships its fence");
        m.claim(5).unwrap();
        assert!(m.take_delta().is_none(), "the same claim again has nothing to ship");
        m.put("k", 5, b"v".to_vec()).unwrap();
        m.take_delta();
        m.put("k", 5, b"w".to_vec()).unwrap();
        let d = m.take_delta().expect("the write");
        assert_eq!((d.fence(), d.get("k")), (5, Some(&b"w"[..])));
    }

    #[test]
    fn the_clock_counts_writes_within_an_epoch_and_starts_again_in_a_new_one() {
        let mut m = FencedMap::default();
        for v in [b"a", b"b", b"c"] {
            m.put("k", 1, v.to_vec()).unwrap();
        }
        m.put("k", 2, b"d".to_vec()).unwrap();
        let mut fresh = FencedMap::default();
        fresh.put("k", 2, b"d".to_vec()).unwrap();
        assert_eq!(m.entries.get("k"), fresh.entries.get("k"), "epoch 2's first write: clock 1 on both");
        m.put("k", 2, b"e".to_vec()).unwrap();
        assert_eq!(m.entries.get("k").map(|r| (r.0, r.1)), Some((2, 2)));
        assert!(!m.is_empty() && FencedMap::default().is_empty());
    }

    #[test]
    fn approx_bytes_is_within_five_percent_of_the_encoded_size_for_every_shape_of_map() {
        type BuildMap = fn() -> FencedMap;
        let shapes: [(&str, BuildMap); 3] = [
            ("2,000 short keys with one-byte values", || {
                let mut m = FencedMap::default();
                for i in 0..2_000 {
                    m.put(format!("{i}"), 1, vec![7]).unwrap();
                }
                m
            }),
            ("20 keys with 10 KB values", || {
                let mut m = FencedMap::default();
                for i in 0..20 {
                    m.put(format!("key-{i}"), 1, vec![7; 10_000]).unwrap();
                }
                m
            }),
            ("2,000 tombstones at a large epoch and clock", || {
                let mut m = FencedMap::default();
                let epoch = 1 << 40;
                for i in 0..2_000 {
                    let key = format!("{i}");
                    m.put(key.clone(), epoch, vec![1]).unwrap();
                    m.delete(&key, epoch).unwrap();
                }
                for _ in 0..70_000 {
                    m.put("hot", epoch, vec![1]).unwrap();
                }
                m
            }),
        ];
        for (name, shape) in shapes {
            let m = shape();
            let encoded = rmp_serde::to_vec(&m).unwrap().len();
            let ratio = m.approx_bytes() as f64 / encoded as f64;
            assert!((0.95..=1.05).contains(&ratio), "{name}: approx {} vs encoded {encoded}", m.approx_bytes());
        }
        // Tiny maps: the fixed overhead may be over-counted, never under.
        let mut claimed = FencedMap::default();
        claimed.claim(u64::MAX / 2).unwrap();
        assert!(claimed.approx_bytes() >= rmp_serde::to_vec(&claimed).unwrap().len());
    }

    /// The size as it was computed before it was kept in step: a sum over the entries.
    fn summed_bytes(m: &FencedMap) -> usize {
        m.entries.iter().map(|(k, r)| entry_bytes(k, r)).sum::<usize>() + rmp_uint_len(m.fence) + 18
    }

    #[test]
    fn the_size_kept_in_step_equals_the_sum_over_entries_after_writes_deletes_merges_and_decoding() {
        let mut m = FencedMap::default();
        assert_eq!(m.approx_bytes(), summed_bytes(&m));
        for i in 0..300u64 {
            m.put(format!("k{}", i % 97), i / 50 + 1, vec![1; (i % 13) as usize]).unwrap();
            if i % 7 == 0 {
                m.delete(&format!("k{}", i % 31), i / 50 + 1).unwrap();
            }
            assert_eq!(m.approx_bytes(), summed_bytes(&m), "after write {i}");
        }
        let mut other = FencedMap::default();
        other.put("k1", 9, vec![2; 500]).unwrap();
        other.put("only-there", 9, vec![3; 5]).unwrap();
        m.merge(other);
        assert_eq!(m.approx_bytes(), summed_bytes(&m), "after a merge");
        let decoded: FencedMap = rmp_serde::from_slice(&rmp_serde::to_vec(&m).unwrap()).unwrap();
        assert_eq!(decoded.approx_bytes(), summed_bytes(&m), "decoded");
    }

    #[test]
    fn a_write_fits_while_the_map_stays_within_its_budget_and_a_rewrite_no_larger_always_fits() {
        let mut m = FencedMap::default();
        m.put("a", 1, vec![0; 100]).unwrap();
        let size = m.approx_bytes();
        // A new key of 50 bytes: exactly what it adds fits a budget of size + that, not one less.
        let adds = reg_bytes(1, 1, 1, Some(50));
        assert!(m.fits("b", 1, 50, size + adds));
        assert!(!m.fits("b", 1, 50, size + adds - 1));
        m.put("b", 1, vec![0; 50]).unwrap();
        assert_eq!(m.approx_bytes(), size + adds, "fits counts what the write adds");
        // At (and past) the budget: rewrites no larger still fit, growth does not.
        let full = m.approx_bytes() - 10;
        assert!(m.fits("a", 1, 100, full), "a rewrite of the same size");
        assert!(m.fits("a", 2, 10, full), "a smaller value, under a newer epoch");
        assert!(!m.fits("a", 1, 101, full), "one byte larger");
        assert!(!m.fits("c", 1, 0, full), "a new key, even empty");
        // A deleted key holds no value: writing it again is growth.
        m.delete("b", 1).unwrap();
        assert!(!m.fits("b", 1, 1, m.approx_bytes()), "at its size, a value where a tombstone is grows it");
        let budget = m.approx_bytes() - entry_bytes("b", m.entries.get("b").unwrap()) + reg_bytes(1, 1, 3, Some(50));
        assert!(m.fits("b", 1, 50, budget), "its tombstone's bytes are counted as freed");
        assert!(!m.fits("b", 1, 50, budget - 1));
    }

    #[test]
    fn maps_are_equal_only_with_the_same_fence_and_the_same_registers() {
        let mut a = FencedMap::default();
        a.put("k", 1, b"v".to_vec()).unwrap();
        let mut b = a.clone();
        b.take_delta();
        assert_eq!(a, b, "local bookkeeping (the pending delta) is not part of the value");
        let mut claimed = a.clone();
        claimed.claim(2).unwrap();
        assert_ne!(a, claimed, "another fence");
        let mut other_value = FencedMap::default();
        other_value.put("k", 1, b"w".to_vec()).unwrap();
        assert_ne!(a, other_value, "another register");
        assert_eq!(a.fence(), other_value.fence());
    }

    #[test]
    fn equal_epochs_and_clocks_from_two_writers_still_merge_the_same_both_ways() {
        let mut a = FencedMap::default();
        a.put("k", 5, b"from-a".to_vec()).unwrap();
        let mut b = FencedMap::default();
        b.put("k", 5, b"from-b".to_vec()).unwrap();
        let mut ab = a.clone();
        ab.merge(b.clone());
        let mut ba = b;
        ba.merge(a);
        assert_eq!(ab, ba);
        assert_eq!(value(&ab, "k"), Some(b"from-b".to_vec()));
    }

    #[test]
    fn a_peer_clock_at_its_maximum_does_not_panic_the_next_write() {
        let mut m: FencedMap = rmp_serde::from_slice(
            &rmp_serde::to_vec_named(&FencedMapWire {
                fence: 3,
                entries: BTreeMap::from([("k".to_string(), FencedReg(3, u64::MAX, None))]),
            })
            .unwrap(),
        )
        .unwrap();
        m.put("k", 3, b"v".to_vec()).unwrap();
        assert_eq!(m.fence(), 3);
        m.put("k", 4, b"w".to_vec()).unwrap();
        assert_eq!(value(&m, "k"), Some(b"w".to_vec()));
    }

    #[test]
    fn the_size_estimate_stays_within_a_quarter_of_the_encoded_size() {
        let mut small = FencedMap::default();
        small.put("cart-1", 1_763_900_000_000, b"apples".to_vec()).unwrap();
        let mut many = FencedMap::default();
        for i in 0..1_000 {
            many.put(format!("device-{i:06}"), 42, vec![7u8; 100]).unwrap();
        }
        for i in 0..200 {
            many.delete(&format!("device-{i:06}"), 42).unwrap();
        }
        // Epochs and clocks of every encoded width.
        let mut widths = FencedMap::default();
        for (i, epoch) in [5u64, 200, 60_000, 4_000_000_000, 1 << 40].into_iter().enumerate() {
            for _ in 0..=i * 50 {
                widths.put(format!("w{i}"), epoch, vec![1; 3]).unwrap();
            }
        }
        for (name, m) in [("one entry", small), ("many entries and tombstones", many), ("every width", widths)] {
            let encoded = rmp_serde::to_vec_named(&m).unwrap().len() as f64;
            let ratio = m.approx_bytes() as f64 / encoded;
            assert!((0.8..=1.25).contains(&ratio), "{name}: approx {} vs encoded {encoded}", m.approx_bytes());
        }
    }

    mod merge_by_reference {
        use super::*;
        use proptest::prelude::*;

        /// A map written by `writes` (key, epoch, value or deletion), claims included.
        fn written(writes: &[(u8, u64, Option<u8>)]) -> FencedMap {
            let mut m = FencedMap::default();
            for &(k, epoch, v) in writes {
                let key = format!("k{k}");
                let _ = match v {
                    Some(v) => m.put(key, epoch, vec![v; usize::from(v % 5)]),
                    None => m.delete(&key, epoch).and_then(|_| m.claim(epoch)),
                };
            }
            m
        }

        fn writes() -> impl Strategy<Value = Vec<(u8, u64, Option<u8>)>> {
            prop::collection::vec((0u8..6, 1u64..4, prop::option::of(0u8..8)), 0..12)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1_000))]
            /// Replicas merge a delta they go on to persist by reference: the result, its
            /// digest and its size are the owned merge's, whichever registers win.
            #[test]
            fn merging_a_borrowed_map_equals_merging_it_owned(mine in writes(), theirs in writes()) {
                let (a, b) = (written(&mine), written(&theirs));
                let mut owned = a.clone();
                owned.merge(b.clone());
                let mut borrowed = a;
                borrowed.merge_from(&b);
                prop_assert_eq!(&borrowed, &owned);
                prop_assert_eq!(borrowed.bucket_digests(), owned.bucket_digests());
                prop_assert_eq!(borrowed.approx_bytes(), owned.approx_bytes());
            }
        }
    }

    /// Two incarnations of one shard: a stale one (epoch 1, on replica 0) keeps writing while a
    /// new one (epoch 2, on replica 2) claims and loads the state from a majority, then writes.
    /// Messages arrive in any order. Every write the stale one got acknowledged by a majority
    /// without a refusal is in what the new one loaded, and after gossip every key the new one
    /// wrote holds its last write.
    mod interleavings {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            StaleWrite(u8),
            Deliver(usize, usize),
            Claim(usize),
            NewWrite(u8),
            Gossip(usize, usize),
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                3 => (0u8..4).prop_map(Step::StaleWrite),
                4 => (0usize..64, 1usize..3).prop_map(|(w, r)| Step::Deliver(w, r)),
                2 => (0usize..3).prop_map(Step::Claim),
                2 => (0u8..4).prop_map(Step::NewWrite),
                1 => (0usize..3, 0usize..3).prop_map(|(a, b)| Step::Gossip(a, b)),
            ]
        }

        struct StaleWrite {
            key: String,
            value: Vec<u8>,
            delta: FencedMap,
            delivered: [bool; 3],
            acks: usize,
            refused: bool,
            acked: bool,
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2_000))]
            #[test]
            fn a_stale_incarnation_never_has_a_write_acknowledged_that_the_new_one_did_not_load(
                steps in prop::collection::vec(step(), 0..60),
            ) {
                const STALE: u64 = 1;
                const NEW: u64 = 2;
                let mut replicas = vec![FencedMap::default(); 3];
                let mut writes: Vec<StaleWrite> = Vec::new();
                let mut answers: Vec<FencedMap> = Vec::new();
                let mut claimed = [false; 3];
                let mut loaded: Option<FencedMap> = None;
                let mut new_writes: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let mut serial = 0u8;
                for step in steps {
                    match step {
                        Step::StaleWrite(k) => {
                            serial = serial.wrapping_add(1);
                            let key = format!("e{k}");
                            let value = vec![serial];
                            // Written on its own replica first; refused there once claimed.
                            if replicas[0].put(key.clone(), STALE, value.clone()).is_ok() {
                                let delta = replicas[0].take_delta().unwrap();
                                writes.push(StaleWrite {
                                    key, value, delta, delivered: [true, false, false], acks: 1,
                                    refused: false, acked: false,
                                });
                            }
                        }
                        Step::Deliver(w, r) => {
                            let Some(write) = writes.get_mut(w) else { continue };
                            if write.delivered[r] {
                                continue;
                            }
                            write.delivered[r] = true;
                            if replicas[r].admits_write_from(write.delta.fence()) {
                                replicas[r].merge(write.delta.clone());
                                write.acks += 1;
                                // Acknowledged at its majority unless a refusal came first
                                // (it may still complete after the load: if so, the load saw it).
                                if write.acks >= 2 && !write.refused {
                                    write.acked = true;
                                }
                            } else {
                                write.refused = true;
                            }
                        }
                        Step::Claim(r) => {
                            if claimed[r] || loaded.is_some() {
                                continue;
                            }
                            claimed[r] = true;
                            // The claim is merged, then the replica answers with its value.
                            let mut claim = FencedMap::default();
                            claim.claim(NEW).unwrap();
                            replicas[r].merge(claim);
                            answers.push(replicas[r].clone());
                            if answers.len() >= 2 {
                                let mut view = FencedMap::default();
                                for a in answers.drain(..) {
                                    view.merge(a);
                                }
                                replicas[2].merge(view.clone());
                                loaded = Some(view);
                            }
                        }
                        Step::NewWrite(k) => {
                            if loaded.is_none() {
                                continue;
                            }
                            serial = serial.wrapping_add(1);
                            let key = format!("e{k}");
                            replicas[2].put(key.clone(), NEW, vec![serial]).unwrap();
                            replicas[2].take_delta();
                            new_writes.insert(key, vec![serial]);
                        }
                        Step::Gossip(a, b) => {
                            let from = replicas[a].clone();
                            replicas[b].merge(from);
                        }
                    }
                }
                if let Some(view) = &loaded {
                    for w in writes.iter().filter(|w| w.acked) {
                        // The loaded value is this write or a later write of the same key.
                        let later = writes.iter().skip_while(|x| !std::ptr::eq(*x, w)).filter(|x| x.key == w.key);
                        let found = view.get(&w.key).map(<[u8]>::to_vec);
                        prop_assert!(
                            later.clone().any(|x| Some(&x.value) == found.as_ref()),
                            "acknowledged {:?}={:?} missing from the load ({found:?})", w.key, w.value
                        );
                    }
                }
                let mut all = FencedMap::default();
                for r in &replicas {
                    all.merge(r.clone());
                }
                for (key, value) in &new_writes {
                    prop_assert_eq!(all.get(key), Some(&value[..]), "the new incarnation's write of {} was overwritten", key);
                }
            }
        }
    }
}
