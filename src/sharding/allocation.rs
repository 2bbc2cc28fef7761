//! Shard allocation strategies: where a new shard goes, and which shards to move when the
//! cluster is unbalanced. Pure functions of the current allocation, so they are table-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

pub use super::ids::{RegionId, ShardId};
use super::settings::AllocationSettings;

/// One region's current shards, in allocation order (oldest first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionAllocation {
    /// The region.
    pub region: RegionId,
    /// Its shards, oldest allocation first. Shared with the coordinator's index (building the
    /// view costs O(regions), not O(shards)); `Arc::make_mut` gives an owned copy to edit.
    pub shards: Arc<Vec<ShardId>>,
    /// Its node is leaving (or its region shutting down): allocate elsewhere when possible.
    pub leaving: bool,
}

/// Decides shard placement. Implement it for a custom strategy; the coordinator calls it only
/// with the regions that are registered and not shutting down. A panic in either method is
/// contained (with `panic = "unwind"`, Rust's default): the coordinator logs it, places a new
/// shard on the least-loaded region and skips that rebalance round.
pub trait ShardAllocationStrategy: Send + Sync + 'static {
    /// The region for a new shard. `regions` is never empty.
    fn allocate(&self, requester: &RegionId, shard: &ShardId, regions: &[RegionAllocation]) -> RegionId;

    /// Shards to hand off now (the coordinator then re-allocates them with [`Self::allocate`]).
    /// `in_progress` are shards already being moved.
    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId>;

    /// Why [`Self::allocate`] chose `chosen` for `shard`, for operators (the coordinator's
    /// shard explanation and its history). Called once per allocation and per query.
    fn allocation_reason(&self, shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        let _ = (shard, regions, chosen);
        "chosen by a custom allocation strategy".into()
    }

    /// Why [`Self::rebalance`] moves `shard`, for operators (the rebalance plan).
    fn rebalance_reason(&self, shard: &ShardId, regions: &[RegionAllocation]) -> String {
        let _ = (shard, regions);
        "moved by a custom allocation strategy's rebalance".into()
    }
}

/// The shards `region` holds in `regions` (0 when it is not listed).
fn shard_count(regions: &[RegionAllocation], region: &RegionId) -> usize {
    regions.iter().find(|r| r.region == *region).map_or(0, |r| r.shards.len())
}

/// The region holding `shard` in `regions`, with its shard count.
fn holder<'a>(regions: &'a [RegionAllocation], shard: &str) -> Option<&'a RegionAllocation> {
    regions.iter().find(|r| r.shards.iter().any(|s| s == shard))
}

/// The reason of the least-loaded choice.
fn least_loaded_reason(regions: &[RegionAllocation], chosen: &RegionId) -> String {
    format!(
        "fewest shards ({}) of the {} regions that take shards (ties go to the lowest address)",
        shard_count(regions, chosen),
        regions.len()
    )
}

/// Regions ordered by suitability for a new shard: not leaving first, then fewest shards, then
/// address (so every coordinator decides the same way).
fn by_suitability(regions: &[RegionAllocation]) -> Vec<&RegionAllocation> {
    let mut v: Vec<&RegionAllocation> = regions.iter().collect();
    v.sort_by(|a, b| (a.leaving, a.shards.len(), &a.region).cmp(&(b.leaving, b.shards.len(), &b.region)));
    v
}

/// Shards not in the region `target` gives them (when it gives one), up to `limit` moves in
/// progress at once.
fn misplaced(
    regions: &[RegionAllocation],
    in_progress: &BTreeSet<ShardId>,
    limit: usize,
    target: impl Fn(&str) -> Option<RegionId>,
) -> BTreeSet<ShardId> {
    let mut out = BTreeSet::new();
    for r in regions {
        for s in r.shards.iter() {
            if out.len() + in_progress.len() >= limit {
                return out;
            }
            if !in_progress.contains(s) && target(s).is_some_and(|t| t != r.region) {
                out.insert(s.clone());
            }
        }
    }
    out
}

fn least_loaded(regions: &[RegionAllocation]) -> RegionId {
    by_suitability(regions)[0].region.clone()
}

/// Runs another strategy and contains its panics: a strategy bug must not take the coordinator
/// down with it (every shard would stay unallocated until the node restarts). A panicking
/// `allocate` falls back to the least-loaded region, a panicking `rebalance` moves nothing.
pub(crate) struct PanicGuardedStrategy(pub(crate) Arc<dyn ShardAllocationStrategy>);

impl PanicGuardedStrategy {
    fn contain<T>(&self, what: &str, f: impl FnOnce() -> T, fallback: impl FnOnce() -> T) -> T {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(v) => v,
            Err(_) => {
                tracing::error!(call = what, "shard allocation strategy panicked; using the safe fallback");
                fallback()
            }
        }
    }
}

impl ShardAllocationStrategy for PanicGuardedStrategy {
    fn allocate(&self, requester: &RegionId, shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        let chosen = self.contain("allocate", || self.0.allocate(requester, shard, regions), || least_loaded(regions));
        if regions.iter().any(|r| r.region == chosen) {
            chosen
        } else {
            tracing::error!(region = %chosen, %shard, "allocation strategy chose an unknown region; using the least loaded");
            least_loaded(regions)
        }
    }

    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        self.contain("rebalance", || self.0.rebalance(regions, in_progress), BTreeSet::new)
    }

    fn allocation_reason(&self, shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        self.contain(
            "allocation_reason",
            || self.0.allocation_reason(shard, regions, chosen),
            || "the strategy panicked explaining its choice".into(),
        )
    }

    fn rebalance_reason(&self, shard: &ShardId, regions: &[RegionAllocation]) -> String {
        self.contain(
            "rebalance_reason",
            || self.0.rebalance_reason(shard, regions),
            || "the strategy panicked explaining its move".into(),
        )
    }
}

/// Least-shard allocation with Akka's newer rebalance algorithm: balanced within one or two
/// rounds, moving at most `limit = max(1, min(floor(relative_limit × total), absolute_limit))`
/// shards per round.
#[derive(Debug, Clone)]
pub struct LeastShardAllocation {
    /// Upper bound on shards moved per rebalance round.
    pub absolute_limit: usize,
    /// Upper bound as a fraction of all shards.
    pub relative_limit: f64,
}

impl Default for LeastShardAllocation {
    fn default() -> Self {
        LeastShardAllocation { absolute_limit: 20, relative_limit: 0.1 }
    }
}

impl ShardAllocationStrategy for LeastShardAllocation {
    fn allocate(&self, _requester: &RegionId, _shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        least_loaded(regions)
    }

    fn allocation_reason(&self, _shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        least_loaded_reason(regions, chosen)
    }

    fn rebalance_reason(&self, shard: &ShardId, regions: &[RegionAllocation]) -> String {
        let active: Vec<&RegionAllocation> = regions.iter().filter(|r| !r.leaving).collect();
        let total: usize = active.iter().map(|r| r.shards.len()).sum();
        let optimal = total.div_ceil(active.len().max(1));
        let held = holder(regions, shard).map_or(0, |r| r.shards.len());
        if held > optimal {
            format!(
                "its region holds {held} shards, more than the {optimal} per region of an even spread (oldest move first)"
            )
        } else {
            format!(
                "its region holds {held} shards while another holds fewer than {}: one moves to fill it",
                optimal.saturating_sub(1)
            )
        }
    }

    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        if !in_progress.is_empty() || regions.is_empty() {
            return BTreeSet::new();
        }
        // Leaving regions are emptied by their graceful shutdown, not by rebalancing.
        let active: Vec<&RegionAllocation> = regions.iter().filter(|r| !r.leaving).collect();
        if active.is_empty() {
            return BTreeSet::new();
        }
        let total: usize = active.iter().map(|r| r.shards.len()).sum();
        if total == 0 {
            return BTreeSet::new();
        }
        let optimal = total.div_ceil(active.len());
        let relative = (self.relative_limit * total as f64).floor() as usize;
        let limit = relative.min(self.absolute_limit).max(1);
        let mut sorted = active.clone();
        sorted.sort_by(|a, b| (b.shards.len(), &a.region).cmp(&(a.shards.len(), &b.region)));
        // Phase 1: surplus above optimal, oldest shards first.
        let mut out = BTreeSet::new();
        for r in &sorted {
            for s in r.shards.iter().take(r.shards.len().saturating_sub(optimal)) {
                if out.len() >= limit {
                    return out;
                }
                out.insert(s.clone());
            }
        }
        if !out.is_empty() {
            return out;
        }
        // Phase 2: regions at optimal give one shard each to fill regions below optimal - 1.
        let deficit: usize = active.iter().map(|r| (optimal - 1).saturating_sub(r.shards.len())).sum();
        let take = deficit.min(limit);
        for r in sorted.iter().filter(|r| r.shards.len() >= optimal) {
            if out.len() >= take {
                break;
            }
            if let Some(s) = r.shards.first() {
                out.insert(s.clone());
            }
        }
        out
    }
}

/// Akka's legacy least-shard strategy: move from the region with most shards while the
/// difference to the region with fewest exceeds `threshold`, at most `max_simultaneous` at a
/// time.
#[derive(Debug, Clone)]
pub struct LegacyLeastShardAllocation {
    /// Difference tolerated between the most and least loaded region.
    pub threshold: usize,
    /// Shards in hand-off at the same time.
    pub max_simultaneous: usize,
}

impl Default for LegacyLeastShardAllocation {
    fn default() -> Self {
        LegacyLeastShardAllocation { threshold: 1, max_simultaneous: 3 }
    }
}

impl ShardAllocationStrategy for LegacyLeastShardAllocation {
    fn allocate(&self, _requester: &RegionId, _shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        least_loaded(regions)
    }

    fn allocation_reason(&self, _shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        least_loaded_reason(regions, chosen)
    }

    fn rebalance_reason(&self, shard: &ShardId, regions: &[RegionAllocation]) -> String {
        let held = holder(regions, shard).map_or(0, |r| r.shards.len());
        let least = regions.iter().map(|r| r.shards.len()).min().unwrap_or(0);
        format!("its region holds {held} shards, more than {} over the least loaded region's {least}", self.threshold)
    }

    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        if in_progress.len() >= self.max_simultaneous || regions.is_empty() {
            return BTreeSet::new();
        }
        let least = by_suitability(regions)[0].shards.len();
        let most = regions
            .iter()
            .map(|r| r.shards.iter().filter(|s| !in_progress.contains(*s)).cloned().collect::<Vec<_>>())
            .max_by_key(Vec::len)
            .unwrap_or_default();
        let diff = most.len().saturating_sub(least);
        if diff <= self.threshold {
            return BTreeSet::new();
        }
        let n = (diff - self.threshold).min(self.threshold).min(self.max_simultaneous - in_progress.len());
        let mut sorted = most;
        sorted.sort();
        sorted.into_iter().take(n).collect()
    }
}

/// Consistent hashing of shard ids onto a ring of regions (`virtual_nodes` points per region),
/// so a shard tends to return to the same node; rebalance moves shards that are not on their
/// ring position, up to `rebalance_limit` per round.
#[derive(Debug, Clone)]
pub struct ConsistentHashingAllocation {
    /// Ring points per region.
    pub virtual_nodes: usize,
    /// Shards moved per rebalance round.
    pub rebalance_limit: usize,
}

impl Default for ConsistentHashingAllocation {
    fn default() -> Self {
        ConsistentHashingAllocation { virtual_nodes: 10, rebalance_limit: 10 }
    }
}

impl ConsistentHashingAllocation {
    /// The region the ring gives for `shard` (regions identified by node id, so a restarted
    /// node gets its shards back).
    pub fn ring_owner(&self, shard: &str, regions: &[RegionAllocation]) -> Option<RegionId> {
        let candidates: Vec<&RegionAllocation> = regions.iter().filter(|r| !r.leaving).collect();
        let candidates = if candidates.is_empty() { regions.iter().collect() } else { candidates };
        let mut ring: Vec<(u64, &RegionId)> = Vec::new();
        for r in candidates {
            for v in 0..self.virtual_nodes {
                let point = xxhash_rust::xxh3::xxh3_64(format!("{}-{v}", r.region.node_id).as_bytes());
                ring.push((point, &r.region));
            }
        }
        ring.sort();
        let h = xxhash_rust::xxh3::xxh3_64(shard.as_bytes());
        let i = ring.partition_point(|(p, _)| *p < h);
        ring.get(i).or(ring.first()).map(|(_, r)| (*r).clone())
    }
}

impl ShardAllocationStrategy for ConsistentHashingAllocation {
    fn allocate(&self, requester: &RegionId, shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        self.ring_owner(shard, regions).unwrap_or_else(|| requester.clone())
    }

    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        misplaced(regions, in_progress, self.rebalance_limit, |s| self.ring_owner(s, regions))
    }

    fn allocation_reason(&self, shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        match self.ring_owner(shard, regions) {
            Some(owner) if owner == *chosen => {
                format!("owner of the shard's point on the hash ring ({} points per region)", self.virtual_nodes)
            }
            _ => "no ring owner among the regions: the requesting region".into(),
        }
    }

    fn rebalance_reason(&self, shard: &ShardId, regions: &[RegionAllocation]) -> String {
        match self.ring_owner(shard, regions) {
            Some(owner) => format!("the hash ring places it on {owner}"),
            None => "the hash ring places it elsewhere".into(),
        }
    }
}

/// The strategy the settings name. `external_locations` is the table the External strategy
/// reads (kept equal to the replicated map of desired locations by the coordinator driver).
pub(crate) fn strategy_for(
    settings: &AllocationSettings,
    external_locations: Arc<RwLock<BTreeMap<ShardId, String>>>,
) -> Arc<dyn ShardAllocationStrategy> {
    match settings {
        AllocationSettings::LeastShard { absolute_limit, relative_limit } => {
            Arc::new(LeastShardAllocation { absolute_limit: *absolute_limit, relative_limit: *relative_limit })
        }
        AllocationSettings::LegacyLeastShard { threshold, max_simultaneous } => {
            Arc::new(LegacyLeastShardAllocation { threshold: *threshold, max_simultaneous: *max_simultaneous })
        }
        AllocationSettings::ConsistentHashing { virtual_nodes, rebalance_limit } => {
            Arc::new(ConsistentHashingAllocation { virtual_nodes: *virtual_nodes, rebalance_limit: *rebalance_limit })
        }
        AllocationSettings::External { rebalance_limit } => {
            let mut ext = ExternalAllocation::new(external_locations);
            ext.rebalance_limit = *rebalance_limit;
            Arc::new(ext)
        }
    }
}

/// Desired shard locations (shard id → node id) set by an operator; see
/// [`crate::sharding::ShardRegion::set_external_shard_location`]. Shards go to their desired
/// node when it hosts a region, otherwise to the requester.
#[derive(Debug, Clone, Default)]
pub struct ExternalAllocation {
    locations: Arc<RwLock<BTreeMap<ShardId, String>>>,
    /// Shards moved per rebalance round.
    pub rebalance_limit: usize,
}

impl ExternalAllocation {
    /// A strategy reading the shared location table.
    pub fn new(locations: Arc<RwLock<BTreeMap<ShardId, String>>>) -> Self {
        ExternalAllocation { locations, rebalance_limit: 10 }
    }

    /// The shared table (shard id → node id) this strategy reads.
    pub fn locations(&self) -> &Arc<RwLock<BTreeMap<ShardId, String>>> {
        &self.locations
    }

    fn desired(&self, shard: &str, regions: &[RegionAllocation]) -> Option<RegionId> {
        let node = self.locations.read().expect("locations lock").get(shard).cloned()?;
        regions.iter().find(|r| *r.region.node_id == *node).map(|r| r.region.clone())
    }
}

impl ShardAllocationStrategy for ExternalAllocation {
    fn allocate(&self, requester: &RegionId, shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        self.desired(shard, regions).unwrap_or_else(|| {
            if regions.iter().any(|r| r.region == *requester) { requester.clone() } else { least_loaded(regions) }
        })
    }

    fn rebalance(&self, regions: &[RegionAllocation], in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        misplaced(regions, in_progress, self.rebalance_limit, |s| self.desired(s, regions))
    }

    fn allocation_reason(&self, shard: &ShardId, regions: &[RegionAllocation], chosen: &RegionId) -> String {
        let desired = self.locations.read().expect("locations lock").get(shard).cloned();
        match desired {
            Some(node) if *chosen.node_id == *node => format!("its desired location is node {node}"),
            Some(node) => format!(
                "its desired node {node} hosts none of the {} regions that take shards: the requesting region (or the least loaded)",
                regions.len()
            ),
            None => "no desired location set: the requesting region (or the least loaded)".into(),
        }
    }

    fn rebalance_reason(&self, shard: &ShardId, _regions: &[RegionAllocation]) -> String {
        let desired = self.locations.read().expect("locations lock").get(shard).cloned();
        format!("its desired location is node {}", desired.unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::UniqueAddress;

    fn layout(sizes: &[usize]) -> Vec<RegionAllocation> {
        let mut n = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &k)| RegionAllocation {
                region: UniqueAddress::new(format!("r{i}"), 1),
                shards: (0..k)
                    .map(|_| {
                        n += 1;
                        format!("{n:03}")
                    })
                    .collect::<Vec<_>>()
                    .into(),
                leaving: false,
            })
            .collect()
    }

    fn apply(regions: &mut [RegionAllocation], moved: &BTreeSet<ShardId>, s: &dyn ShardAllocationStrategy) {
        for r in regions.iter_mut() {
            Arc::make_mut(&mut r.shards).retain(|x| !moved.contains(x));
        }
        for shard in moved {
            let to = s.allocate(&regions[0].region, shard, regions);
            Arc::make_mut(&mut regions.iter_mut().find(|r| r.region == to).unwrap().shards).push(shard.clone());
        }
    }

    fn sizes(regions: &[RegionAllocation]) -> Vec<usize> {
        regions.iter().map(|r| r.shards.len()).collect()
    }

    const UNLIMITED: LeastShardAllocation = LeastShardAllocation { absolute_limit: 1000, relative_limit: 1.0 };

    #[test]
    fn least_shard_rebalance_matches_the_akka_example_table() {
        // (layout, shards moved in the first round, layout after one round when given)
        type Row = (&'static [usize], usize, Option<&'static [usize]>);
        let table: &[Row] = &[
            (&[1, 2, 0], 1, Some(&[1, 1, 1])),
            (&[1, 1, 0], 0, None),
            (&[3, 0, 0], 2, Some(&[1, 1, 1])),
            (&[4, 4, 0], 2, Some(&[3, 3, 2])),
            (&[4, 4, 2], 1, None),
            (&[50, 50, 0], 32, Some(&[34, 34, 32])),
        ];
        for (before, moved, after) in table {
            let mut regions = layout(before);
            let m = UNLIMITED.rebalance(&regions, &BTreeSet::new());
            assert_eq!(m.len(), *moved, "layout {before:?}");
            apply(&mut regions, &m, &UNLIMITED);
            if let Some(after) = after {
                let mut got = sizes(&regions);
                got.sort_unstable_by(|a, b| b.cmp(a));
                let mut want = after.to_vec();
                want.sort_unstable_by(|a, b| b.cmp(a));
                assert_eq!(got, want, "layout {before:?}");
            }
        }
    }

    #[test]
    fn least_shard_balances_small_layouts_within_two_rounds() {
        for before in [[3usize, 0, 0], [4, 4, 0], [4, 4, 2], [7, 1, 0], [10, 0, 1], [5, 5, 5]] {
            let mut regions = layout(&before);
            for _ in 0..2 {
                let m = UNLIMITED.rebalance(&regions, &BTreeSet::new());
                apply(&mut regions, &m, &UNLIMITED);
            }
            let s = sizes(&regions);
            assert!(s.iter().max().unwrap() - s.iter().min().unwrap() <= 1, "{before:?} -> {s:?}");
        }
    }

    #[test]
    fn least_shard_respects_limits_and_waits_for_rebalances_in_progress() {
        let regions = layout(&[50, 50, 0]);
        let limited = LeastShardAllocation { absolute_limit: 5, relative_limit: 0.1 };
        assert_eq!(limited.rebalance(&regions, &BTreeSet::new()).len(), 5);
        let relative = LeastShardAllocation { absolute_limit: 100, relative_limit: 0.02 };
        assert_eq!(relative.rebalance(&regions, &BTreeSet::new()).len(), 2);
        let busy = BTreeSet::from(["001".to_string()]);
        assert!(limited.rebalance(&regions, &busy).is_empty());
    }

    #[test]
    fn least_shard_rebalance_with_no_shards_anywhere_moves_nothing() {
        // Found by the random fault runs: every shard on leaving regions, the rest empty.
        let s = LeastShardAllocation::default();
        let mut layout = layout(&[0, 0]);
        assert!(s.rebalance(&layout, &BTreeSet::new()).is_empty());
        layout.push(RegionAllocation {
            region: UniqueAddress::new("leaving", 1),
            shards: Arc::new(vec!["1".into()]),
            leaving: true,
        });
        assert!(s.rebalance(&layout, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_panicking_strategy_is_contained_with_safe_fallbacks() {
        struct Broken;
        impl ShardAllocationStrategy for Broken {
            fn allocate(&self, _: &RegionId, _: &ShardId, _: &[RegionAllocation]) -> RegionId {
                panic!("broken allocate")
            }
            fn rebalance(&self, _: &[RegionAllocation], _: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
                panic!("broken rebalance")
            }
        }
        struct Stranger;
        impl ShardAllocationStrategy for Stranger {
            fn allocate(&self, _: &RegionId, _: &ShardId, _: &[RegionAllocation]) -> RegionId {
                UniqueAddress::new("nobody", 9)
            }
            fn rebalance(&self, _: &[RegionAllocation], _: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
                BTreeSet::new()
            }
        }
        let layout = layout(&[2, 0]);
        let guarded = PanicGuardedStrategy(Arc::new(Broken));
        assert_eq!(guarded.allocate(&layout[0].region, &"new".into(), &layout), layout[1].region);
        assert!(guarded.rebalance(&layout, &BTreeSet::new()).is_empty());
        let guarded = PanicGuardedStrategy(Arc::new(Stranger));
        assert_eq!(guarded.allocate(&layout[0].region, &"new".into(), &layout), layout[1].region);
        // A strategy that works passes through the guard unchanged.
        let guarded = PanicGuardedStrategy(Arc::new(UNLIMITED));
        let unbalanced = self::layout(&[4, 0]);
        let moved = guarded.rebalance(&unbalanced, &BTreeSet::new());
        assert_eq!(moved, UNLIMITED.rebalance(&unbalanced, &BTreeSet::new()));
        assert!(!moved.is_empty());
        assert_eq!(guarded.allocate(&unbalanced[0].region, &"new".into(), &unbalanced), unbalanced[1].region);
    }

    #[test]
    fn least_shard_allocates_to_the_least_loaded_region_not_leaving() {
        let mut regions = layout(&[2, 0, 1]);
        assert_eq!(UNLIMITED.allocate(&regions[0].region, &"x".into(), &regions).node_id.as_ref(), "r1");
        regions[1].leaving = true;
        assert_eq!(UNLIMITED.allocate(&regions[0].region, &"x".into(), &regions).node_id.as_ref(), "r2");
    }

    #[test]
    fn legacy_strategy_moves_alphabetically_first_shards_from_the_largest_region() {
        let legacy = LegacyLeastShardAllocation::default();
        let regions = layout(&[5, 1, 1]);
        // diff 4 > threshold 1: move min(3, 1, 3) = 1.
        assert_eq!(legacy.rebalance(&regions, &BTreeSet::new()), BTreeSet::from(["001".to_string()]));
        assert!(legacy.rebalance(&layout(&[2, 1, 1]), &BTreeSet::new()).is_empty());
        let t3 = LegacyLeastShardAllocation { threshold: 3, max_simultaneous: 2 };
        // diff 9 > 3: min(6, 3, 2) = 2.
        assert_eq!(t3.rebalance(&layout(&[10, 1]), &BTreeSet::new()).len(), 2);
        let busy: BTreeSet<ShardId> = ["001".to_string(), "002".to_string()].into();
        assert!(t3.rebalance(&layout(&[10, 1]), &busy).is_empty(), "max simultaneous reached");
        let over: BTreeSet<ShardId> = ["001".to_string(), "002".to_string(), "003".to_string()].into();
        assert!(t3.rebalance(&layout(&[10, 1]), &over).is_empty(), "more in progress than allowed moves none");
        // diff 5 > 3: min(5 - 3, 3, 5) = 2 — the surplus over the threshold binds.
        let t3m5 = LegacyLeastShardAllocation { threshold: 3, max_simultaneous: 5 };
        assert_eq!(t3m5.rebalance(&layout(&[6, 1]), &BTreeSet::new()).len(), 2);
        // One move elsewhere in progress: min(6, 3, 3 - 1) = 2 — the free slots bind.
        let t3m3 = LegacyLeastShardAllocation { threshold: 3, max_simultaneous: 3 };
        let elsewhere: BTreeSet<ShardId> = ["zzz".to_string()].into();
        assert_eq!(t3m3.rebalance(&layout(&[10, 1]), &elsewhere).len(), 2);
    }

    #[test]
    fn consistent_hashing_never_picks_a_leaving_region_and_a_shard_on_a_ring_point_belongs_to_it() {
        let ch = ConsistentHashingAllocation::default();
        let mut regions = layout(&[0, 0, 0]);
        regions[1].leaving = true;
        for i in 0..200 {
            assert_ne!(ch.ring_owner(&format!("s{i}"), &regions), Some(regions[1].region.clone()));
        }
        // A shard whose hash is exactly a ring point ("<node>-<v>") belongs to that point's region.
        let regions = layout(&[0, 0, 0]);
        for r in &regions {
            for v in 0..ch.virtual_nodes {
                let point = format!("{}-{v}", r.region.node_id);
                assert_eq!(ch.ring_owner(&point, &regions), Some(r.region.clone()), "{point}");
            }
        }
    }

    #[test]
    fn consistent_hashing_is_stable_and_moves_only_misplaced_shards() {
        let ch = ConsistentHashingAllocation::default();
        let mut regions = layout(&[0, 0, 0]);
        let mut placed = BTreeMap::new();
        for i in 0..60 {
            let shard = format!("s{i}");
            let r = ch.allocate(&regions[0].region, &shard, &regions);
            assert_eq!(r, ch.allocate(&regions[1].region, &shard, &regions), "independent of the requester");
            placed.insert(shard.clone(), r.clone());
            Arc::make_mut(&mut regions.iter_mut().find(|x| x.region == r).unwrap().shards).push(shard);
        }
        assert!(regions.iter().all(|r| !r.shards.is_empty()), "spread over all regions");
        assert!(ch.rebalance(&regions, &BTreeSet::new()).is_empty(), "all on their ring position");
        // A fourth region: only shards now owned by it move.
        regions.push(RegionAllocation { region: UniqueAddress::new("r3", 1), shards: Arc::default(), leaving: false });
        let big = ConsistentHashingAllocation { rebalance_limit: 1000, ..ch.clone() };
        let moved = big.rebalance(&regions, &BTreeSet::new());
        assert!(!moved.is_empty());
        for s in &moved {
            assert_eq!(big.ring_owner(s, &regions).unwrap().node_id.as_ref(), "r3");
        }
        // The limit counts moves already in progress: with 2 of a limit of 5 under way, a round
        // adds 3 (none of them the ones in progress).
        assert!(moved.len() > 5, "enough misplaced shards for the limit to matter");
        let in_progress: BTreeSet<ShardId> = moved.iter().take(2).cloned().collect();
        let limited = ConsistentHashingAllocation { rebalance_limit: 5, ..ch.clone() };
        let next = limited.rebalance(&regions, &in_progress);
        assert_eq!(next.len(), 3, "{next:?}");
        assert!(next.is_disjoint(&in_progress) && next.is_subset(&moved));
        assert!(limited.rebalance(&regions, &moved.iter().take(5).cloned().collect()).is_empty(), "at the limit");
    }

    #[test]
    fn external_strategy_follows_the_operator_table() {
        let table = Arc::new(RwLock::new(BTreeMap::from([("a".to_string(), "r2".to_string())])));
        let ext = ExternalAllocation::new(table.clone());
        let regions = layout(&[1, 0, 0]);
        assert_eq!(ext.allocate(&regions[0].region, &"a".into(), &regions).node_id.as_ref(), "r2");
        assert_eq!(ext.allocate(&regions[1].region, &"b".into(), &regions).node_id.as_ref(), "r1", "requester");
        table.write().unwrap().insert("001".into(), "r1".into());
        assert_eq!(ext.rebalance(&regions, &BTreeSet::new()), BTreeSet::from(["001".to_string()]));
        // A requester that cannot host (a proxy) gets the least loaded region, not itself.
        let proxy = UniqueAddress::new("proxy", 1);
        assert_eq!(ext.allocate(&proxy, &"unlisted".into(), &regions).node_id.as_ref(), "r1");
        // The table it exposes is the one it follows.
        assert!(Arc::ptr_eq(ext.locations(), &table));
        ext.locations().write().unwrap().insert("c".into(), "r2".into());
        assert_eq!(ext.allocate(&regions[0].region, &"c".into(), &regions).node_id.as_ref(), "r2");
    }

    #[test]
    fn each_built_in_strategy_explains_its_choice_and_its_moves() {
        // r0 holds 001..=006, r1 none, r2 holds 007.
        let regions = layout(&[6, 0, 1]);
        let least = LeastShardAllocation::default();
        let chosen = least.allocate(&regions[0].region, &"x".into(), &regions);
        assert_eq!(chosen, regions[1].region);
        assert_eq!(
            least.allocation_reason(&"x".into(), &regions, &chosen),
            "fewest shards (0) of the 3 regions that take shards (ties go to the lowest address)"
        );
        assert!(
            least.rebalance_reason(&"001".into(), &regions).starts_with("its region holds 6 shards, more than the 3 ")
        );
        assert!(
            least.rebalance_reason(&"007".into(), &regions).contains("holds 1 shards while another holds fewer than 2")
        );

        let legacy = LegacyLeastShardAllocation::default();
        assert_eq!(
            legacy.rebalance_reason(&"001".into(), &regions),
            "its region holds 6 shards, more than 1 over the least loaded region's 0"
        );
        assert!(legacy.allocation_reason(&"x".into(), &regions, &regions[1].region).starts_with("fewest shards (0)"));

        let ring = ConsistentHashingAllocation::default();
        let owner = ring.ring_owner("001", &regions).expect("an owner");
        assert!(ring.allocation_reason(&"001".into(), &regions, &owner).starts_with("owner of the shard's point"));
        let other = regions.iter().find(|r| r.region != owner).expect("another").region.clone();
        assert!(ring.allocation_reason(&"001".into(), &regions, &other).starts_with("no ring owner"));
        assert_eq!(ring.rebalance_reason(&"001".into(), &regions), format!("the hash ring places it on {owner}"));

        let ext = ExternalAllocation::default();
        ext.locations().write().unwrap().insert("001".into(), "r2".into());
        ext.locations().write().unwrap().insert("002".into(), "gone".into());
        assert_eq!(
            ext.allocation_reason(&"001".into(), &regions, &regions[2].region),
            "its desired location is node r2"
        );
        assert!(
            ext.allocation_reason(&"002".into(), &regions, &regions[0].region)
                .starts_with("its desired node gone hosts none")
        );
        assert!(ext.allocation_reason(&"003".into(), &regions, &regions[0].region).starts_with("no desired location"));
        assert_eq!(ext.rebalance_reason(&"001".into(), &regions), "its desired location is node r2");
    }

    #[test]
    fn a_strategy_that_panics_explaining_gets_a_fallback_reason() {
        struct PanicsExplaining;
        impl ShardAllocationStrategy for PanicsExplaining {
            fn allocate(&self, r: &RegionId, _: &ShardId, _: &[RegionAllocation]) -> RegionId {
                r.clone()
            }
            fn rebalance(&self, _: &[RegionAllocation], _: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
                BTreeSet::new()
            }
            fn allocation_reason(&self, _: &ShardId, _: &[RegionAllocation], _: &RegionId) -> String {
                panic!("explaining")
            }
            fn rebalance_reason(&self, _: &ShardId, _: &[RegionAllocation]) -> String {
                panic!("explaining")
            }
        }
        let regions = layout(&[1, 1]);
        let guarded = PanicGuardedStrategy(Arc::new(PanicsExplaining));
        assert!(guarded.allocation_reason(&"x".into(), &regions, &regions[0].region).contains("panicked"));
        assert!(guarded.rebalance_reason(&"001".into(), &regions).contains("panicked"));
        // A custom strategy that explains nothing gets the default words.
        struct Silent;
        impl ShardAllocationStrategy for Silent {
            fn allocate(&self, r: &RegionId, _: &ShardId, _: &[RegionAllocation]) -> RegionId {
                r.clone()
            }
            fn rebalance(&self, _: &[RegionAllocation], _: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
                BTreeSet::new()
            }
        }
        let silent = PanicGuardedStrategy(Arc::new(Silent));
        assert_eq!(
            silent.allocation_reason(&"x".into(), &regions, &regions[0].region),
            "chosen by a custom allocation strategy"
        );
        assert_eq!(silent.rebalance_reason(&"x".into(), &regions), "moved by a custom allocation strategy's rebalance");
    }
}
