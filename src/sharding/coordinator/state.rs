//! The coordinator state as it is stored in the replicated fenced map: one entry per shard
//! (`s/<shard>`: home and epoch) and one per registered region (`r/<region>`), fenced by
//! coordinator term.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::ddata::FencedMap;
use crate::sharding::ids::{RegionId, ShardId};
use crate::sharding::keys;

/// One entry of the coordinator state to write: key and new value (`None` removes it).
pub(crate) type StateEntry = (String, Option<Vec<u8>>);

/// The take-over's claim of the coordinator state under `term` (refused below the fence).
pub(crate) fn claim_update(type_name: &str, term: u64) -> crate::ddata::KeyUpdate {
    crate::ddata::KeyUpdate::new::<FencedMap, _>(&keys::coordinator_state(type_name), move |m, ctx| {
        if let Err(f) = m.claim(term) {
            ctx.refuse(f);
        }
    })
}

/// Adds `shards` to the durable set of a type's shards (a grow-only set: a shard once
/// allocated is allocated again after a full-cluster restart).
pub(crate) fn remembered_shards_update(
    type_name: &str,
    shards: std::collections::BTreeSet<crate::sharding::ids::ShardId>,
) -> crate::ddata::KeyUpdate {
    crate::ddata::KeyUpdate::new::<crate::ddata::GSet, _>(&keys::remembered_shards(type_name), move |g, _| {
        for s in shards {
            g.insert(s);
        }
    })
}

/// A coordinator write of `entries` (`None`: delete) under its `term`; the whole update is
/// refused once a newer term has claimed the state.
pub(crate) fn write_update(type_name: &str, entries: Vec<StateEntry>, term: u64) -> crate::ddata::KeyUpdate {
    crate::ddata::KeyUpdate::new::<FencedMap, _>(&keys::coordinator_state(type_name), move |m, ctx| {
        for (k, v) in entries {
            let written = match v {
                Some(bytes) => m.put(k, term, bytes),
                None => m.delete(&k, term),
            };
            if let Err(f) = written {
                ctx.refuse(f);
                return;
            }
        }
    })
}

/// Persisted record of a shard: its home (none while unallocated) and the epoch of its latest
/// allocation, kept across deallocation so epochs only grow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShardRecord {
    pub region: Option<RegionId>,
    pub epoch: u64,
}

/// Persisted record of a registered region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RegionRecord {
    pub region: RegionId,
    pub proxy: bool,
}

/// The coordinator state as stored in the LWW-map, with an index of each region's shards.
///
/// Invariant: `homes[r]` holds exactly the shards whose record says `region == Some(r)`, ordered
/// by (epoch, shard id) — so the allocation strategy reads each region's shards in allocation
/// order without a scan of every shard. Records change only through [`Self::set_home`] and
/// [`Self::clear_home`], which keep the index in step in O(log n) for the usual append.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct CoordinatorState {
    shards: BTreeMap<ShardId, ShardRecord>,
    pub regions: BTreeSet<RegionId>,
    pub proxies: BTreeSet<RegionId>,
    /// Shared with the views handed to the strategy (copy-on-write; the views are dropped
    /// before the next change, so appending does not copy).
    homes: BTreeMap<RegionId, Arc<Vec<ShardId>>>,
    /// Estimated encoded size of every shard record (for [`Self::approx_encoded_bytes`]).
    shard_entry_bytes: usize,
}

/// Upper estimate of one entry's encoded size in the replicated map beyond its shard id and
/// region node id: key prefix, field names, generation, epoch and the register's term and
/// clock. Checked against the real encoding in a test.
const ENTRY_OVERHEAD: usize = 48;

fn shard_entry_bytes(shard: &str, rec: &ShardRecord) -> usize {
    shard.len() + rec.region.as_ref().map_or(0, |r| r.node_id.len()) + ENTRY_OVERHEAD
}

impl CoordinatorState {
    /// Reads the state from the replicated map (fenced by coordinator term); undecodable
    /// entries are skipped with a warning.
    pub(crate) fn from_map(map: &FencedMap) -> Self {
        let mut st = CoordinatorState::default();
        for (k, v) in map.iter() {
            if let Some(shard) = keys::shard_of_entry(k) {
                match rmp_serde::from_slice::<ShardRecord>(v) {
                    Ok(r) => st.put(shard.to_string(), r),
                    Err(e) => warn!(key = k, error = %e, "undecodable shard record skipped"),
                }
            } else if keys::is_region_entry(k) {
                match rmp_serde::from_slice::<RegionRecord>(v) {
                    Ok(r) if r.proxy => {
                        st.proxies.insert(r.region);
                    }
                    Ok(r) => {
                        st.regions.insert(r.region);
                    }
                    Err(e) => warn!(key = k, error = %e, "undecodable region record skipped"),
                }
            }
        }
        st
    }

    /// Every shard record, allocated or not, by shard id.
    pub(crate) fn shards(&self) -> &BTreeMap<ShardId, ShardRecord> {
        &self.shards
    }

    /// The record of `shard`, if it was ever allocated.
    pub(crate) fn record(&self, shard: &str) -> Option<&ShardRecord> {
        self.shards.get(shard)
    }

    /// Allocates `shard` to `region` with `epoch`.
    pub(crate) fn set_home(&mut self, shard: &ShardId, region: RegionId, epoch: u64) {
        self.put(shard.clone(), ShardRecord { region: Some(region), epoch });
    }

    /// Deallocates `shard`, keeping its epoch so the next allocation's is larger.
    pub(crate) fn clear_home(&mut self, shard: &str) {
        if let Some(rec) = self.shards.get(shard) {
            let epoch = rec.epoch;
            self.put(shard.to_string(), ShardRecord { region: None, epoch });
        }
    }

    /// The shards `region` hosts, oldest allocation first.
    pub(crate) fn shards_of(&self, region: &RegionId) -> &[ShardId] {
        self.homes.get(region).map_or(&[], |v| v.as_slice())
    }

    fn put(&mut self, shard: ShardId, rec: ShardRecord) {
        if let Some(old) = self.shards.get(&shard)
            && let Some(r) = &old.region
        {
            let list = self.homes.get_mut(r).expect("index holds every allocated shard");
            let at = Self::position(&self.shards, list, old.epoch, &shard).expect("indexed shard");
            Arc::make_mut(list).remove(at);
            if list.is_empty() {
                self.homes.remove(r);
            }
        }
        if let Some(r) = &rec.region {
            let list = self.homes.entry(r.clone()).or_default();
            // Usually the newest epoch: an append.
            let at = Self::position(&self.shards, list, rec.epoch, &shard).unwrap_or_else(|at| at);
            Arc::make_mut(list).insert(at, shard.clone());
        }
        let old = self.shards.get(&shard).map_or(0, |old| shard_entry_bytes(&shard, old));
        self.shard_entry_bytes = self.shard_entry_bytes - old + shard_entry_bytes(&shard, &rec);
        self.shards.insert(shard, rec);
    }

    /// About how many bytes the state takes encoded as the replicated map (at least that
    /// many): it must fit one replicator message, or a successor could never read it.
    pub(crate) fn approx_encoded_bytes(&self) -> usize {
        let regions: usize = self.regions.iter().chain(&self.proxies).map(|r| r.node_id.len() + ENTRY_OVERHEAD).sum();
        self.shard_entry_bytes + regions
    }

    /// [`Self::approx_encoded_bytes`] after adding a record for a new shard `shard`.
    pub(crate) fn approx_encoded_bytes_with(&self, shard: &str) -> usize {
        // The region is not chosen yet: count the longest node id there may be.
        self.approx_encoded_bytes() + shard.len() + crate::config::MAX_ID_LEN + ENTRY_OVERHEAD
    }

    /// Binary search of `list` (ordered by epoch, then id) for (`epoch`, `shard`).
    fn position(
        shards: &BTreeMap<ShardId, ShardRecord>,
        list: &[ShardId],
        epoch: u64,
        shard: &str,
    ) -> Result<usize, usize> {
        list.binary_search_by(|s| {
            let e = shards.get(s).map_or(0, |r| r.epoch);
            (e, s.as_str()).cmp(&(epoch, shard))
        })
    }

    /// Every registered region (and any region still named by a shard record) with its shards
    /// in allocation order. O(regions): the shard lists are shared, not copied.
    pub(crate) fn allocations(&self) -> Vec<(RegionId, Arc<Vec<ShardId>>)> {
        let mut out: BTreeMap<&RegionId, Arc<Vec<ShardId>>> =
            self.regions.iter().map(|r| (r, Arc::default())).collect();
        for (r, list) in &self.homes {
            out.insert(r, list.clone());
        }
        out.into_iter().map(|(r, l)| (r.clone(), l)).collect()
    }

    pub(crate) fn home(&self, shard: &str) -> Option<(&RegionId, u64)> {
        let rec = self.shards.get(shard)?;
        Some((rec.region.as_ref()?, rec.epoch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::UniqueAddress;
    use proptest::prelude::*;

    /// The index as a scan of every record would compute it.
    fn scanned(st: &CoordinatorState) -> BTreeMap<RegionId, Vec<ShardId>> {
        let mut by_region: BTreeMap<RegionId, Vec<(u64, ShardId)>> = BTreeMap::new();
        for (s, rec) in st.shards() {
            if let Some(r) = &rec.region {
                by_region.entry(r.clone()).or_default().push((rec.epoch, s.clone()));
            }
        }
        by_region
            .into_iter()
            .map(|(r, mut v)| {
                v.sort();
                (r, v.into_iter().map(|(_, s)| s).collect())
            })
            .collect()
    }

    proptest! {
        /// Allocations, re-allocations with older or newer epochs and deallocations in any order
        /// leave each region's index equal to a full scan of the records.
        #[test]
        fn region_index_matches_a_scan_of_every_record_after_any_changes(
            ops in proptest::collection::vec((0u8..12, proptest::option::of(0u8..3), 0u64..20), 1..80)
        ) {
            let mut st = CoordinatorState::default();
            for (shard, region, epoch) in ops {
                let shard = format!("s{shard}");
                match region {
                    Some(r) => st.set_home(&shard, UniqueAddress::new(format!("r{r}"), 1), epoch),
                    None => st.clear_home(&shard),
                }
                let index: BTreeMap<RegionId, Vec<ShardId>> =
                    st.homes.iter().map(|(r, l)| (r.clone(), l.to_vec())).collect();
                prop_assert_eq!(&index, &scanned(&st));
                for (r, shards) in &index {
                    prop_assert_eq!(st.shards_of(r), shards.as_slice());
                }
            }
        }
    }

    #[test]
    fn the_state_reads_back_from_the_map_the_coordinator_wrote_skipping_undecodable_entries() {
        let (a, p) = (UniqueAddress::new("a", 1), UniqueAddress::new("p", 1));
        let mut map = FencedMap::default();
        let put = |map: &mut FencedMap, k: String, v: Vec<u8>| map.put(k, 3, v).unwrap();
        put(
            &mut map,
            keys::region_entry(&a),
            rmp_serde::to_vec(&RegionRecord { region: a.clone(), proxy: false }).unwrap(),
        );
        put(
            &mut map,
            keys::region_entry(&p),
            rmp_serde::to_vec(&RegionRecord { region: p.clone(), proxy: true }).unwrap(),
        );
        let home = ShardRecord { region: Some(a.clone()), epoch: 9 };
        put(&mut map, keys::shard_entry("1"), rmp_serde::to_vec(&home).unwrap());
        let away = ShardRecord { region: None, epoch: 4 };
        put(&mut map, keys::shard_entry("2"), rmp_serde::to_vec(&away).unwrap());
        put(&mut map, keys::shard_entry("3"), vec![0xc1]);
        let st = CoordinatorState::from_map(&map);
        assert_eq!(st.regions, BTreeSet::from([a.clone()]));
        assert_eq!(st.proxies, BTreeSet::from([p]));
        assert_eq!(st.record("1"), Some(&home));
        assert_eq!(st.record("2"), Some(&away));
        assert_eq!(st.record("3"), None, "undecodable: skipped");
        assert_eq!(st.shards_of(&a), ["1".to_string()]);
    }

    #[test]
    fn allocations_list_registered_regions_without_shards_and_share_the_index() {
        let (a, b) = (UniqueAddress::new("a", 1), UniqueAddress::new("b", 1));
        let mut st = CoordinatorState::default();
        st.regions.insert(a.clone());
        st.regions.insert(b.clone());
        st.set_home(&"2".to_string(), a.clone(), 5);
        st.set_home(&"1".to_string(), a.clone(), 9);
        let all = st.allocations();
        assert_eq!(all.len(), 2);
        assert_eq!((&all[0].0, all[0].1.as_slice()), (&a, ["2".to_string(), "1".to_string()].as_slice()));
        assert_eq!((&all[1].0, all[1].1.len()), (&b, 0));
        assert!(Arc::ptr_eq(&all[0].1, &st.homes[&a]), "a view, not a copy");
    }
}
