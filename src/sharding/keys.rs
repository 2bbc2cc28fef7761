//! Every string format sharding stores or sends under: replicator keys, coordinator-state
//! entry keys and transport topics. One definition each, so a key is never spelt twice.
//!
//! Durable keys start with `shard-` (the default durable prefix of the replicator); type names
//! cannot contain `/`, so one type's keys never prefix another's.

use super::ids::RegionId;

/// Replicator key of the coordinator state (a map fenced by coordinator term; not durable: a
/// full restart starts with no allocations, and remembered shards come from
/// [`remembered_shards`]). Round 1 kept a plain LWW-map under `sharding-coordinator-<type>`;
/// the new name keeps a node of either kind from reading the other's value as its own type.
pub(crate) fn coordinator_state(type_name: &str) -> String {
    format!("sharding-coordinator-fenced-{type_name}")
}

/// Replicator key of one slot of a shard's remembered entity ids.
pub(crate) fn remembered_entities(type_name: &str, shard: &str, slot: u32) -> String {
    format!("shard-{type_name}/{shard}/{slot}")
}

/// Replicator key of one slot of a shard's durable entity states (a fenced map); the stores
/// name it by [`state_space`] and [`slot_key`], the simulation and tests by this.
#[cfg(any(test, feature = "testkit"))]
pub(crate) fn entity_states(type_name: &str, shard: &str, slot: u32) -> String {
    slot_key(&state_space(type_name), shard, slot)
}

/// The key space of a type's durable entity states (see [`slot_key`]).
pub(crate) fn state_space(type_name: &str) -> String {
    format!("shard-{type_name}")
}

/// The key space of the durable queues of a type's producers. `shard-/` is no type's
/// namespace (a type name is never empty), so no shard id of any type can reach it.
pub(crate) fn producer_space(type_name: &str) -> String {
    format!("shard-/producer/{type_name}")
}

/// Replicator key of one slot of a fenced store in `space`: a shard's entity states (`owner`
/// the shard), or a producer's queue (`owner` the producer id). The slot ends the key, so an
/// owner containing `/` still names one key per slot.
pub(crate) fn slot_key(space: &str, owner: &str, slot: u32) -> String {
    format!("{space}/{owner}/state-{slot}")
}

/// Replicator key of the durable set of a type's shards (for a full-cluster restart).
pub(crate) fn remembered_shards(type_name: &str) -> String {
    format!("shard-{type_name}/all")
}

/// Replicator key of the operator's desired shard locations (External allocation).
pub(crate) fn external_locations(type_name: &str) -> String {
    format!("shard-{type_name}/external-locations")
}

/// Prefix of every durable sharding key of a type.
pub fn durable_key_prefix(type_name: &str) -> String {
    format!("shard-{type_name}/")
}

/// Prefix of shard entries in the coordinator-state map.
const SHARD_ENTRY: &str = "s/";
/// Prefix of region entries in the coordinator-state map.
const REGION_ENTRY: &str = "r/";

/// The coordinator-state entry of a shard.
pub(crate) fn shard_entry(shard: &str) -> String {
    format!("{SHARD_ENTRY}{shard}")
}

/// The coordinator-state entry of a region.
pub(crate) fn region_entry(region: &RegionId) -> String {
    format!("{REGION_ENTRY}{region}")
}

/// The shard named by a coordinator-state entry key, if it is a shard entry.
pub(crate) fn shard_of_entry(key: &str) -> Option<&str> {
    key.strip_prefix(SHARD_ENTRY)
}

/// Whether a coordinator-state entry key is a region entry.
pub(crate) fn is_region_entry(key: &str) -> bool {
    key.starts_with(REGION_ENTRY)
}

/// Transport topic of the regions of a type.
pub(crate) fn region_topic(type_name: &str) -> String {
    format!("region/{type_name}")
}

/// Transport topic of the coordinator of a type.
pub(crate) fn coordinator_topic(type_name: &str) -> String {
    format!("coordinator/{type_name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_key_formats_are_pinned() {
        // These strings live in LMDB and in replicated state: changing one orphans data.
        assert_eq!(coordinator_state("cart"), "sharding-coordinator-fenced-cart");
        assert_eq!(remembered_entities("cart", "17", 3), "shard-cart/17/3");
        assert_eq!(remembered_shards("cart"), "shard-cart/all");
        assert_eq!(external_locations("cart"), "shard-cart/external-locations");
        assert_eq!(durable_key_prefix("cart"), "shard-cart/");
        assert!(remembered_entities("cart", "1", 0).starts_with(&durable_key_prefix("cart")));
        assert_eq!(entity_states("cart", "17", 3), "shard-cart/17/state-3");
        assert!(entity_states("cart", "1", 0).starts_with(&durable_key_prefix("cart")));
    }

    #[test]
    fn entry_keys_round_trip() {
        let region = RegionId::new("n1", 7);
        assert_eq!(shard_entry("42"), "s/42");
        assert_eq!(shard_of_entry(&shard_entry("42")), Some("42"));
        assert_eq!(region_entry(&region), "r/n1#7");
        assert!(is_region_entry(&region_entry(&region)));
        assert_eq!(shard_of_entry(&region_entry(&region)), None);
        assert!(!is_region_entry(&shard_entry("42")));
    }

    #[test]
    fn topics_are_pinned() {
        assert_eq!(region_topic("cart"), "region/cart");
        assert_eq!(coordinator_topic("cart"), "coordinator/cart");
    }
}
