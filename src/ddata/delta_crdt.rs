//! What every replicated data type provides: state merge, δ-states, a canonical digest, buckets
//! for anti-entropy and its sizes. [`crate::ddata::ReplicatedData`] and
//! [`crate::ddata::ReplicatedDelta`] dispatch to it, so a new type is its own file (the type
//! and this trait), one variant in each of those enums and one line in the type list of
//! `crdt/mod.rs`.
//!
//! A leaf: the types implement it in their own files without importing the enums that hold
//! them.

use super::buckets::BUCKETS;

/// A state-based CRDT with δ-states: `merge_state` is commutative, associative and
/// idempotent, and a delta is itself a state of the type's delta form, so deltas join and merge
/// in any order, lost or duplicated.
pub(crate) trait DeltaCrdt: Clone + Default {
    /// The type's name, for errors.
    const NAME: &'static str;
    /// Mixed into the digest, so equal values of two types never share one.
    const DIGEST_TAG: u64;
    /// A change of one value.
    type Delta: Clone;
    /// Why an incoming state or delta is refused (it would break a limit of the type).
    type Refusal;

    /// Joins `other` into `self`; on a refusal `self` is unchanged.
    fn merge_state(&mut self, other: Self) -> Result<(), Self::Refusal>;
    /// Joins a delta into `self` (O(delta)); on a refusal `self` is unchanged.
    fn merge_delta_state(&mut self, delta: &Self::Delta) -> Result<(), Self::Refusal>;
    /// The local changes since the last take.
    fn take_delta_state(&mut self) -> Option<Self::Delta>;
    /// Canonical digest: equal values have equal digests on every node.
    fn state_digest(&self) -> u64;
    /// Per-bucket digests, for types whose value can be shipped by bucket.
    fn state_bucket_digests(&self) -> Option<&[u64; BUCKETS]>;
    /// The part of the value in `buckets` (the whole value where it cannot be split).
    fn state_buckets_subset(&self, buckets: &[usize]) -> Self;
    /// Approximate encoded size in bytes (for message budgets; never encodes).
    fn state_bytes(&self) -> usize;
    /// Number of elements (entries, members), for batching limits.
    fn element_count(&self) -> usize;
    /// The fence a replica judges a write by; `None` for types without one.
    fn state_fence(&self) -> Option<u64> {
        None
    }

    /// Number of elements a delta carries.
    fn delta_len(delta: &Self::Delta) -> usize;
    /// Approximate encoded size of a delta in bytes.
    fn delta_bytes(delta: &Self::Delta) -> usize;
    /// Joins `other` into `into`, so pending deltas of one key ship as one.
    fn join_deltas(into: &mut Self::Delta, other: Self::Delta);
    /// The writer's fence a delta carries; `None` for types without one.
    fn delta_fence(_delta: &Self::Delta) -> Option<u64> {
        None
    }
}

/// [`DeltaCrdt`] for a type whose delta is a value of the type itself, merged with its
/// infallible inherent `merge` (a borrowed delta with `merge_from`, which copies only what it
/// takes) and read with its inherent `take_delta`, `digest`,
/// `bucket_digests`, `buckets_subset` and `approx_bytes`; `count` names the method that counts
/// its elements, and `fenced` gives it the fence of its inherent `fence`.
macro_rules! self_delta_crdt {
    ($t:ty, $name:literal, tag $tag:literal, count $count:ident $(, $fenced:ident)?) => {
        impl $crate::ddata::delta_crdt::DeltaCrdt for $t {
            const NAME: &'static str = $name;
            const DIGEST_TAG: u64 = $tag;
            type Delta = $t;
            type Refusal = std::convert::Infallible;

            fn merge_state(&mut self, other: Self) -> Result<(), Self::Refusal> {
                self.merge(other);
                Ok(())
            }
            fn merge_delta_state(&mut self, delta: &$t) -> Result<(), Self::Refusal> {
                self.merge_from(delta);
                Ok(())
            }
            fn take_delta_state(&mut self) -> Option<$t> {
                self.take_delta()
            }
            fn state_digest(&self) -> u64 {
                self.digest()
            }
            fn state_bucket_digests(&self) -> Option<&[u64; $crate::ddata::buckets::BUCKETS]> {
                Some(self.bucket_digests())
            }
            fn state_buckets_subset(&self, buckets: &[usize]) -> Self {
                self.buckets_subset(buckets)
            }
            fn state_bytes(&self) -> usize {
                self.approx_bytes()
            }
            fn element_count(&self) -> usize {
                self.$count()
            }
            fn delta_len(delta: &$t) -> usize {
                delta.$count()
            }
            fn delta_bytes(delta: &$t) -> usize {
                delta.approx_bytes()
            }
            fn join_deltas(into: &mut $t, other: $t) {
                into.merge(other)
            }
            $(
                fn state_fence(&self) -> Option<u64> {
                    let _ = stringify!($fenced); // the marker only selects this block
                    Some(self.fence())
                }
                fn delta_fence(delta: &$t) -> Option<u64> {
                    Some(delta.fence())
                }
            )?
        }
    };
}
pub(crate) use self_delta_crdt;
