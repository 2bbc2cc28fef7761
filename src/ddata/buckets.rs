//! The digest buckets anti-entropy compares: a large value ships only the buckets that differ.
//! A leaf of `ddata`: the maps and sets keep their digests in them.

use xxhash_rust::xxh3::xxh3_64;

/// Number of digest buckets of a map or G-set: anti-entropy of a large value compares these
/// and ships only the buckets that differ.
pub(crate) const BUCKETS: usize = 64;

/// One digest per bucket (boxed: 512 bytes).
#[derive(Clone)]
pub(crate) struct Buckets(Box<[u64; BUCKETS]>);

impl Default for Buckets {
    fn default() -> Self {
        Buckets(Box::new([0; BUCKETS]))
    }
}

impl std::ops::Deref for Buckets {
    type Target = [u64; BUCKETS];
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Buckets {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

pub(crate) fn bucket_of(key: &str) -> usize {
    (xxh3_64(key.as_bytes()) % BUCKETS as u64) as usize
}
