//! The names sharding gives things: region and shard ids, the entity → shard mapping and the
//! entity → remembered-slot mapping. A leaf module: everything else in `sharding` uses it.

use std::sync::Arc;

use crate::membership::UniqueAddress;

/// Whether `entity_id` may name an entity of a type whose ids are at most `max_len` bytes
/// ([`crate::ShardingSettings::max_entity_id_bytes`]): not empty and not longer, here and when
/// a peer sends one ([`Error::EntityIdTooLong`](crate::Error::EntityIdTooLong) otherwise).
pub(crate) fn check_entity_id(entity_id: &str, max_len: usize) -> crate::error::Result<()> {
    if entity_id.is_empty() {
        Err(crate::error::Error::EmptyEntityId)
    } else if entity_id.len() > max_len {
        Err(crate::error::Error::EntityIdTooLong { len: entity_id.len(), max: max_len })
    } else {
        Ok(())
    }
}

/// Longest shard id a coordinator accepts from a custom extractor (its state holds every one).
pub(crate) const MAX_SHARD_ID_LEN: usize = 256;

/// Which shard ids a type's extractor can produce, so the coordinator allocates no other (a
/// member with a bug, or a forger, cannot fill its state with shards no entity can live in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShardIdRule {
    /// The default extractor: `"0"` to `"n-1"`, written without leading zeros.
    Numbered(u32),
    /// A custom extractor: any non-empty id of at most [`MAX_SHARD_ID_LEN`] bytes.
    Custom,
}

impl ShardIdRule {
    /// Whether the extractor could have produced `shard`.
    pub(crate) fn allows(self, shard: &str) -> bool {
        match self {
            ShardIdRule::Numbered(n) => shard.parse::<u32>().is_ok_and(|k| k < n && k.to_string() == shard),
            ShardIdRule::Custom => !shard.is_empty() && shard.len() <= MAX_SHARD_ID_LEN,
        }
    }
}

/// A map keyed by shard or entity ids on the message path (a shard's entities, the shards
/// hosted here, the homes of remote shards): hashed with foldhash rather than std's SipHash,
/// several times faster on short ids, and seeded at random per process like std's, so ids a
/// client chooses cannot be made to collide without knowing the seed.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A region (one node incarnation hosting one entity type).
pub type RegionId = UniqueAddress;
/// A shard id.
pub type ShardId = String;

/// Maps an entity id to its shard id.
pub type ShardIdExtractor = Arc<dyn Fn(&str) -> ShardId + Send + Sync>;

/// How a region names the shard of an entity: by its extractor, and with the default extractor
/// by number from ids built once, so naming a message's shard builds nothing (the handle for
/// each message it sends, the region for each one it receives).
#[derive(Clone)]
pub(crate) struct ShardNames {
    extractor: ShardIdExtractor,
    /// With the default extractor, shard `k`'s id at index `k` (`None` with a custom one).
    numbered: Option<Arc<[ShardId]>>,
}

impl ShardNames {
    /// The user's extractor, or (`None`) the default one over `number_of_shards`.
    pub(crate) fn new(custom: Option<ShardIdExtractor>, number_of_shards: u32) -> Self {
        match custom {
            Some(extractor) => ShardNames::custom(extractor),
            None => ShardNames {
                extractor: Arc::new(move |id: &str| default_shard_id(id, number_of_shards)),
                numbered: Some((0..number_of_shards.max(1)).map(|k| k.to_string()).collect()),
            },
        }
    }

    /// Names given by `extractor` alone.
    pub(crate) fn custom(extractor: ShardIdExtractor) -> Self {
        ShardNames { extractor, numbered: None }
    }

    /// The shard of `entity_id`.
    pub(crate) fn of(&self, entity_id: &str) -> std::borrow::Cow<'_, str> {
        match &self.numbered {
            Some(ids) => ids[default_shard_number(entity_id, ids.len() as u32) as usize].as_str().into(),
            None => (self.extractor)(entity_id).into(),
        }
    }

    /// The extractor behind the names.
    pub(crate) fn extractor(&self) -> &ShardIdExtractor {
        &self.extractor
    }
}

/// The default shard of an entity: the XXH3-64 hash (seed 0) of the id's UTF-8 bytes, modulo
/// `number_of_shards`, in decimal. Stable across versions, platforms and processes: changing it
/// moves every entity (and orphans every remembered id), so a test pins literal values.
pub fn default_shard_id(entity_id: &str, number_of_shards: u32) -> ShardId {
    default_shard_number(entity_id, number_of_shards).to_string()
}

/// The number [`default_shard_id`] writes in decimal.
pub(crate) fn default_shard_number(entity_id: &str, number_of_shards: u32) -> u64 {
    xxhash_rust::xxh3::xxh3_64(entity_id.as_bytes()) % u64::from(number_of_shards.max(1))
}

/// The slot of an entity id among `slots` remembered-entity keys (stable, like
/// [`default_shard_id`]).
pub(crate) fn remembered_slot(entity_id: &str, slots: u32) -> u32 {
    (xxhash_rust::xxh3::xxh3_64_with_seed(entity_id.as_bytes(), 0x5107) % u64::from(slots.max(1))) as u32
}

/// Entity type names: non-empty and without `/` (keys and topics are built with `/`, so one
/// type's keys never prefix another's).
/// A fingerprint of what `extractor` does: the hash of the shards it gives 64 fixed probe ids.
/// Two nodes whose extractors differ (a changed function, another `number_of_shards`) almost
/// surely differ here; the coordinator refuses regions whose fingerprint is not its own, since
/// the same entity id would live in two shards at once.
pub(crate) fn extractor_fingerprint(extractor: &ShardIdExtractor) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for i in 0..64 {
        h.update(extractor(&format!("ddshard-extractor-probe-{i}")).as_bytes());
        h.update(&[0]);
    }
    h.digest()
}

pub(crate) fn valid_type_name(type_name: &str) -> bool {
    !type_name.is_empty() && !type_name.contains('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_shard_ids_are_pinned_literal_values() {
        // A change here moves every entity of every deployed cluster: a breaking change.
        for (id, shards, expected) in
            [("counter-42", 1000, "918"), ("c-1", 1000, "884"), ("cart-7", 100, "93"), ("e0", 16, "0"), ("x", 1, "0")]
        {
            assert_eq!(default_shard_id(id, shards), expected, "shard of {id:?} among {shards}");
        }
    }

    #[test]
    fn default_shard_ids_spread_over_every_shard() {
        let used: std::collections::BTreeSet<ShardId> =
            (0..10_000).map(|i| default_shard_id(&format!("e{i}"), 100)).collect();
        assert_eq!(used.len(), 100);
    }

    #[test]
    fn remembered_slots_are_pinned_literal_values() {
        for (id, slots, expected) in [("counter-42", 16, 3), ("c-1", 16, 15), ("cart-7", 64, 31), ("x", 1, 0)] {
            assert_eq!(remembered_slot(id, slots), expected, "slot of {id:?} among {slots}");
        }
    }

    #[test]
    fn type_names_with_a_slash_or_empty_are_invalid() {
        assert!(valid_type_name("counter"));
        assert!(!valid_type_name(""));
        assert!(!valid_type_name("a/b"));
    }
}
