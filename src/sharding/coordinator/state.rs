//! The coordinator state as it is stored in the replicated LWW-map: one entry per shard
//! (`s/<shard>`: home and epoch) and one per registered region (`r/<region>`).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::ddata::LwwMap;
use crate::sharding::ids::{RegionId, ShardId};
use crate::sharding::keys;

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

/// The coordinator state as stored in the LWW-map.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct CoordinatorState {
    pub shards: BTreeMap<ShardId, ShardRecord>,
    pub regions: BTreeSet<RegionId>,
    pub proxies: BTreeSet<RegionId>,
}

impl CoordinatorState {
    /// Reads the state from the replicated map; undecodable entries are skipped with a warning.
    pub(crate) fn from_map(map: &LwwMap) -> Self {
        let mut st = CoordinatorState::default();
        for (k, v) in map.iter() {
            if let Some(shard) = keys::shard_of_entry(k) {
                match rmp_serde::from_slice::<ShardRecord>(v) {
                    Ok(r) => {
                        st.shards.insert(shard.to_string(), r);
                    }
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

    /// Shards of each region ordered by allocation (epoch).
    pub(crate) fn allocations(&self) -> BTreeMap<RegionId, Vec<ShardId>> {
        let mut by_region: BTreeMap<RegionId, Vec<(u64, ShardId)>> =
            self.regions.iter().map(|r| (r.clone(), Vec::new())).collect();
        for (s, rec) in &self.shards {
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

    pub(crate) fn home(&self, shard: &str) -> Option<(&RegionId, u64)> {
        let rec = self.shards.get(shard)?;
        Some((rec.region.as_ref()?, rec.epoch))
    }
}
