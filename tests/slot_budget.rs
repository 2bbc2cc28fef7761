//! A shard an application client cannot wedge: ids (or states) chosen to land in one replicated
//! slot fill it to its byte budget, one replicator message, and no further. Past it, new starts
//! and growing states are refused at once with `SlotFull`; everything acknowledged before
//! still moves with the shard, because the slot still fits one message (review finding S2: the
//! slot used to grow past the frame size, and the shard never loaded again).

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use ddshard::sharding::default_shard_id;
use ddshard::testkit::{TestCluster, eventually, fast_downing, remembered_slot};
use ddshard::{DurableEntity, EntityContext, Error, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

const CONVERGE: Duration = Duration::from_secs(40);
const SHARDS: u32 = 10;
const SLOTS: u32 = 4;
/// The shard and slot every id of these tests is aimed at.
const TARGET: (u32, u32) = (3, 1);

/// `n` ids of `len` bytes that all map to [`TARGET`], as an attacker grinds them (the hashes
/// are public and unseeded).
fn ids_in_one_slot(n: usize, len: usize) -> Vec<String> {
    let padding = "x".repeat(len - 9);
    (0u64..)
        .map(|k| format!("{k:08}-{padding}"))
        .filter(|id| default_shard_id(id, SHARDS) == TARGET.0.to_string() && remembered_slot(id, SLOTS) == TARGET.1)
        .take(n)
        .collect()
}

/// Splits asks' outcomes into acknowledged ids and `SlotFull` refusals (checked to name the
/// target slot); any other failure fails the test.
fn sort_outcomes<T: std::fmt::Debug>(outcomes: Vec<(String, Result<T, Error>)>) -> (Vec<String>, Vec<String>) {
    let (mut acked, mut refused) = (Vec::new(), Vec::new());
    for (id, r) in outcomes {
        match r {
            Ok(_) => acked.push(id),
            Err(Error::SlotFull { ref entity_id, ref shard, slot, budget }) => {
                assert_eq!((entity_id, shard.as_str(), slot), (&id, TARGET.0.to_string().as_str(), TARGET.1));
                assert_eq!(budget, 1 << 20, "the default budget: one replicator message");
                refused.push(id);
            }
            Err(e) => panic!("{}…: neither acknowledged nor refused for its slot: {e}", &id[..8]),
        }
    }
    (acked, refused)
}

/// Kills the node `home` (the target shard's) and returns its index.
async fn kill_the_home(c: &mut TestCluster, home: &str) -> usize {
    let i = (0..c.len()).find(|i| TestCluster::node_id(*i) == home).expect("the home is a node");
    c.kill(i).await;
    i
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_16_kib_ids_aimed_at_one_remembered_slot_are_refused_past_its_budget_and_the_rest_move_with_the_shard()
 {
    let mut c = TestCluster::start_with(3, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings {
        number_of_shards: SHARDS, // The longest ids a type may allow (the default is 1 KiB).
        max_entity_id_bytes: ddshard::sharding::MAX_ENTITY_ID_LEN,
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, slots: SLOTS, ..settings().remember },
        ..settings()
    };
    let regions = start_everywhere(&c, &probe, s).await;
    let ids = ids_in_one_slot(600, 16_000);
    let mut outcomes = Vec::new();
    let mut slowest_refusal = Duration::ZERO;
    for chunk in ids.chunks(20) {
        let asks = chunk.iter().map(|id| {
            let r = regions[0].clone();
            async move {
                let started = Instant::now();
                let result = r.ask(id, CounterMsg::Add(1)).await;
                (id.clone(), result, started.elapsed())
            }
        });
        for (id, result, took) in futures::future::join_all(asks).await {
            if result.is_err() {
                slowest_refusal = slowest_refusal.max(took);
            }
            outcomes.push((id, result));
        }
    }
    let (acked, refused) = sort_outcomes(outcomes);
    println!(
        "{} ids of 16 KB at one slot: {} acknowledged, {} refused with SlotFull (slowest refusal {slowest_refusal:?})",
        ids.len(),
        acked.len(),
        refused.len()
    );
    // 1 MiB holds about 65 of them; without the budget all 600 (9.6 MB) were acknowledged.
    assert!((40..=70).contains(&acked.len()), "{} acknowledged", acked.len());
    assert!(slowest_refusal < Duration::from_secs(5), "refused at once, not by a timeout: {slowest_refusal:?}");
    // The fullest slot shows in the high-water gauge: past half its budget (the alert), never past it.
    let high = regions.iter().map(|r| r.counters().slot_bytes_high_water).max().unwrap();
    let budget = regions[0].counters().slot_budget_bytes;
    println!("fullest remembered slot: {high} of {budget} bytes");
    assert!(budget > 0 && high > budget * 9 / 10 && high <= budget, "high water {high} of {budget}");
    let home = where_is(&regions[0], &acked[0]).await;
    let killed = kill_the_home(&mut c, &home).await;
    let survivors: Vec<ShardRegion<Counter>> =
        regions.iter().enumerate().filter(|(i, _)| *i != killed).map(|(_, r)| r.clone()).collect();
    // Every acknowledged id runs again on a survivor without a message: the shard loaded its
    // slot (it fits one message); no refused id runs.
    let expected: BTreeSet<String> = acked.iter().cloned().collect();
    eventually(CONVERGE, "the acknowledged ids run again after their shard moved", || {
        let survivors = survivors.clone();
        let expected = expected.clone();
        async move {
            let running: BTreeSet<String> = running_ids(&survivors).await.ok()?.into_iter().collect();
            (running == expected).then_some(())
        }
    })
    .await;
    let moved = where_is(&survivors[0], &acked[0]).await;
    assert_ne!(moved, home);
    // The slot still refuses growth on its new home, and still serves what it holds.
    let more = ids_in_one_slot(620, 16_000).split_off(600);
    let (_, refused_after) =
        sort_outcomes(vec![(more[0].clone(), survivors[0].ask(&more[0], CounterMsg::Add(1)).await)]);
    assert_eq!(refused_after.len(), 1);
    assert_eq!(value(&survivors[1], &acked[1]).await, 0, "a restarted counter answers (its value is in memory)");
    c.shutdown().await;
}

/// A blob store whose state is one value of the size asked for.
struct Blob;

#[derive(Debug, Clone, Serialize, Deserialize)]
enum BlobMsg {
    /// Replaces the state with this many bytes and persists.
    Put(usize),
    /// The state's size.
    Size,
}

impl DurableEntity for Blob {
    type Message = BlobMsg;
    type Reply = usize;
    type State = Vec<u8>;

    async fn handle(&mut self, state: &mut Vec<u8>, msg: BlobMsg, ctx: &mut EntityContext) -> usize {
        if let BlobMsg::Put(n) = msg {
            *state = vec![7; n];
            ctx.persist();
        }
        state.len()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_of_63_kib_aimed_at_one_state_slot_are_refused_past_its_budget_and_the_rest_move_with_the_shard() {
    let mut c = TestCluster::start_with(3, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ShardingSettings {
        number_of_shards: SHARDS,
        state: ddshard::sharding::DurableStateSettings { slots: SLOTS, ..settings().state },
        ..settings()
    };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(n.sharding().start_durable("blob", |_: &str| Blob, s.clone()).await.unwrap());
    }
    let ids = ids_in_one_slot(130, 64);
    let mut outcomes = Vec::new();
    for chunk in ids.chunks(10) {
        let asks = chunk.iter().map(|id| {
            let r = regions[0].clone();
            async move { (id.clone(), r.ask(id, BlobMsg::Put(63 * 1024)).await) }
        });
        outcomes.extend(futures::future::join_all(asks).await);
    }
    let (acked, refused) = sort_outcomes(outcomes);
    println!("130 states of 63 KiB at one slot: {} acknowledged, {} refused with SlotFull", acked.len(), refused.len());
    // 1 MiB holds 16 of them; without the budget all 130 (8.2 MB) were acknowledged.
    assert!((12..=16).contains(&acked.len()), "{} acknowledged", acked.len());
    let high = regions.iter().map(|r| r.counters().slot_bytes_high_water).max().unwrap();
    let budget = regions[0].counters().slot_budget_bytes;
    assert!(budget > 0 && high > budget * 9 / 10 && high <= budget, "state slot high water {high} of {budget}");
    // A refused entity restarts from its stored (empty) state; an acknowledged one can still
    // rewrite its state at the same size or smaller in the full slot.
    assert_eq!(ask_until(&regions[0], &refused[0], BlobMsg::Size, CONVERGE).await, 0);
    assert_eq!(ask_until(&regions[0], &acked[0], BlobMsg::Put(1024), CONVERGE).await, 1024);
    assert_eq!(ask_until(&regions[0], &acked[0], BlobMsg::Put(1024), CONVERGE).await, 1024);
    // The home of the target shard: the node whose region runs it.
    let mut home = None;
    for (i, r) in regions.iter().enumerate() {
        if r.region_state().await.unwrap().contains_key(&TARGET.0.to_string()) {
            home = Some(TestCluster::node_id(i));
        }
    }
    let home = home.expect("the target shard runs somewhere");
    let killed = kill_the_home(&mut c, &home).await;
    let survivor = regions.iter().enumerate().find(|(i, _)| *i != killed).map(|(_, r)| r.clone()).unwrap();
    // Every acknowledged state loads on the new home: the slot fits one message.
    for (k, id) in acked.iter().enumerate() {
        let expected = if k == 0 { 1024 } else { 63 * 1024 };
        assert_eq!(ask_until(&survivor, id, BlobMsg::Size, CONVERGE).await, expected, "{}…", &id[..8]);
    }
    c.shutdown().await;
}
