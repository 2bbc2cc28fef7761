//! What an idle running entity costs as a user measures it: 1,000,000 entities started on one
//! node by `ask` with 512 always in flight (none passivated), the node's RSS growth per
//! entity, beside the floor measured in the same run: a plain `HashMap` from the same ids to
//! the same entity values. This binary runs under the system allocator (glibc's malloc, what a
//! service gets unless it picks another); `idle_entities_mimalloc` runs the same under
//! mimalloc, a size-class allocator.
//!
//! `cargo bench --bench idle_entities` (`DDSHARD_BENCH_QUICK=1`: 10,000 entities).

use std::collections::HashMap;
use std::time::{Duration, Instant};

mod common;
use common::sliding;
use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardingSettings};
use serde::{Deserialize, Serialize};

/// A small entity, like a device twin's last reading.
#[derive(Default)]
struct Device {
    reading: u64,
}

#[derive(Serialize, Deserialize)]
struct Reading(u64);

impl Entity for Device {
    type Message = Reading;
    type Reply = u64;
    async fn handle(&mut self, msg: Reading, _ctx: &mut EntityContext) -> u64 {
        self.reading = msg.0;
        self.reading
    }
}

const WINDOW: usize = 512;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

/// Bytes glibc's malloc has handed out and not had back (`None` under another allocator, or
/// off glibc): the RSS beyond it is memory the allocator keeps.
fn live_heap_bytes(allocator: &str) -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if allocator == "system" {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        #[allow(unsafe_code)]
        return Some(unsafe { libc::mallinfo2() }.uordblks as u64);
    }
    let _ = allocator;
    None
}

fn id(i: usize) -> String {
    format!("device-{i:07}")
}

#[allow(dead_code)]
fn main() {
    run("system");
}

/// The measure, under the global allocator named `allocator`.
pub fn run(allocator: &str) {
    let total = common::sized(1_000_000, 10_000);
    // The floor first, kept to the end: built after the entities, it would reuse memory the
    // start phase freed, and measure less than it costs.
    let floor_before = rss_bytes();
    let floor: HashMap<String, Device> = (0..total).map(|i| (id(i), Device { reading: i as u64 })).collect();
    let floor_per_entity = rss_bytes().saturating_sub(floor_before) as f64 / total as f64;
    assert_eq!(floor.len(), total);
    assert!(floor.values().map(|d| d.reading).sum::<u64>() > 0);
    let rt = common::runtime();
    let mut cluster = rt.block_on(async {
        let c = TestCluster::start(1).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        c
    });
    let settings = ShardingSettings {
        number_of_shards: 100,
        passivation: ddshard::sharding::PassivationSettings {
            idle_timeout: None,
            // The default safety net (1,000,000 per region, divided among shards) would
            // passivate the fullest shards' entities before the count is reached.
            idle_safety_limit: None,
            ..ShardingSettings::default().passivation
        },
        ..ShardingSettings::default()
    };
    let region = rt.block_on(async {
        let r = cluster.node(0).sharding().start("device", |_: &str| Device::default(), settings).await.unwrap();
        // The shards exist before the measure starts: only entities are counted.
        sliding(1_000, 64, |i| {
            let r = r.clone();
            async move {
                r.ask(&format!("warm-{i}"), Reading(1)).await.unwrap();
            }
        })
        .await;
        r
    });
    let (before, live_before) = (rss_bytes(), live_heap_bytes(allocator));
    let started = Instant::now();
    rt.block_on(sliding(total, WINDOW, |i| {
        let r = region.clone();
        async move {
            r.ask(&id(i), Reading(i as u64)).await.unwrap();
        }
    }));
    let start_time = started.elapsed();
    // Idle: every entity handled its message; let the tasks settle.
    std::thread::sleep(Duration::from_millis(500));
    let (after, live_after) = (rss_bytes(), live_heap_bytes(allocator));
    let running: usize = rt.block_on(region.region_stats()).unwrap().values().sum();
    assert_eq!(running, total + 1_000, "every entity is running");
    let per_entity = after.saturating_sub(before) as f64 / total as f64;

    if let (Some(b), Some(a)) = (live_before, live_after) {
        println!(
            "allocator {allocator}: live heap +{:.0} B per entity; the rest of the RSS is freed memory the allocator keeps",
            a.saturating_sub(b) as f64 / total as f64
        );
    }
    println!(
        "allocator {allocator}: {total} idle entities (size_of entity {} B, id {} B): started in {start_time:.2?} ({:.0}/s), \
         RSS +{:.0} MB = {per_entity:.0} B per entity; floor (HashMap<String, entity>) {floor_per_entity:.0} B per entity",
        std::mem::size_of::<Device>(),
        id(0).len(),
        total as f64 / start_time.as_secs_f64(),
        after.saturating_sub(before) as f64 / 1e6,
    );
    println!(
        "ratio=idle_entity_rss_{allocator}_vs_hashmap_floor {:.2} ({per_entity:.0} B vs baseline {floor_per_entity:.0} B per entity)",
        per_entity / floor_per_entity.max(1.0)
    );
    drop(floor);
    rt.block_on(cluster.shutdown());
}
