//! Remembered entities: back after hand-off, crash and full-cluster restart; batched durable
//! writes; changed extractor; remove-internal-data.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ddshard::ddata::OrSet;
use ddshard::sharding::{StartOptions, remove_internal_data};
use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{Consistency, Error, ShardRegion, ShardingSettings};

const CONVERGE: Duration = Duration::from_secs(40);

fn remember() -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 10,
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, slots: 4, ..settings().remember },
        ..settings()
    }
}

async fn start_all(c: &TestCluster, probe: &Probe, s: ShardingSettings) -> Vec<ShardRegion<Counter>> {
    start_everywhere(c, probe, s).await
}

async fn await_running(regions: &[ShardRegion<Counter>], expected: &BTreeSet<String>, what: &str) {
    let regions = regions.to_vec();
    eventually(CONVERGE, what, || {
        let regions = regions.clone();
        let expected = expected.clone();
        async move {
            // A region that does not answer is not "empty": poll again (the deadline names it).
            let ids = running_ids(&regions).await.ok()?;
            let set: BTreeSet<String> = ids.iter().cloned().collect();
            assert_eq!(ids.len(), set.len(), "an entity runs twice: {ids:?}");
            (set == expected).then_some(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_off_shard_restarts_its_remembered_entities_on_the_new_node_without_a_message() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let r1 = start_counter(c.node(0), &probe, remember()).await;
    let ids: BTreeSet<String> = (0..30).map(|i| format!("h{i}")).collect();
    for id in &ids {
        r1.ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    c.add_node().await.unwrap();
    c.await_converged(CONVERGE).await;
    let r2 = start_counter(c.node(1), &probe, remember()).await;
    let r2c = r2.clone();
    eventually(CONVERGE, "rebalanced shards run their entities on n2", || {
        let r2 = r2c.clone();
        async move { (!running_ids(&[r2]).await.ok()?.is_empty()).then_some(()) }
    })
    .await;
    await_running(&[r1, r2], &ids, "every remembered entity runs, once").await;
    let created_on_n2 = probe.created.lock().unwrap().iter().filter(|(_, n)| n == "n2").count();
    assert!(created_on_n2 > 0);
    assert_eq!(probe.handled.load(std::sync::atomic::Ordering::SeqCst), 30, "no message was needed");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_entities_of_a_killed_node_run_on_the_survivors_without_a_message() {
    let mut c = TestCluster::start_with(3, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 3, ..remember() };
    let regions = start_all(&c, &probe, s).await;
    let ids: BTreeSet<String> = (0..30).map(|i| format!("k{i}")).collect();
    for id in &ids {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    let on_n3 = running_ids(&regions[2..]).await.unwrap();
    assert!(!on_n3.is_empty(), "n3 hosts some");
    c.kill(2).await;
    await_running(&regions[..2], &ids, "all remembered entities run on n1 and n2").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_cluster_restart_brings_back_every_remembered_entity_but_not_passivated_ones() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 3, ..remember() };
    let regions = start_all(&c, &probe, s.clone()).await;
    let ids: Vec<String> = (0..30).map(|i| format!("f{i}")).collect();
    for id in &ids {
        regions[1].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    for id in &ids[..10] {
        regions[2].ask(id, CounterMsg::Stop).await.unwrap();
    }
    let expected: BTreeSet<String> = ids[10..].iter().cloned().collect();
    await_running(&regions, &expected, "passivated entities stopped").await;
    for i in 0..3 {
        c.kill(i).await;
    }
    for i in 0..3 {
        c.restart(i).await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    let probe2 = Probe::default();
    let regions = start_all(&c, &probe2, s).await;
    await_running(&regions, &expected, "every remembered entity runs again after the full restart").await;
    assert_eq!(probe2.handled.load(std::sync::atomic::Ordering::SeqCst), 0, "started without messages");
    c.shutdown().await;
}

async fn durable_set(r: &ddshard::Node, type_name: &str, shard: &str, slots: u32) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for slot in 0..slots {
        let key = format!("shard-{type_name}/{shard}/{slot}");
        if let Some(s) = r.replicator().get::<OrSet>(&key, Consistency::MAJORITY, Duration::from_secs(5)).await.unwrap()
        {
            all.extend(s.members());
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_set_of_one_shard_reflects_every_start_and_passivation() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { number_of_shards: 1, min_nr_of_members: 3, ..remember() };
    let regions = start_all(&c, &probe, s).await;
    let node = c.node(0).clone();
    let id = |i: usize| format!("e{i:02}");
    // 20 starts.
    for i in 0..20 {
        regions[i % 3].ask(&id(i), CounterMsg::Add(1)).await.unwrap();
    }
    let mut expected: BTreeSet<String> = (0..20).map(id).collect();
    assert_eq!(durable_set(&node, "counter", "0", 4).await, expected);
    // 20 starts mixed with 20 passivations, concurrently.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (r, a, b) = (regions[i % 3].clone(), id(20 + i), id(i));
        tasks.push(tokio::spawn(async move {
            r.ask(&a, CounterMsg::Add(1)).await.unwrap();
            r.ask(&b, CounterMsg::Stop).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    expected = (20..40).map(id).collect();
    let n = node.clone();
    let e = expected.clone();
    eventually(CONVERGE, "durable set after mixed starts and stops", || {
        let (n, e) = (n.clone(), e.clone());
        async move { (durable_set(&n, "counter", "0", 4).await == e).then_some(()) }
    })
    .await;
    // 20 passivations.
    for i in 20..40 {
        regions[i % 3].ask(&id(i), CounterMsg::Stop).await.unwrap();
    }
    let n = node.clone();
    eventually(CONVERGE, "durable set empty after passivating all", || {
        let n = n.clone();
        async move { durable_set(&n, "counter", "0", 4).await.is_empty().then_some(()) }
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_extractor_across_a_full_restart_moves_each_remembered_entity_exactly_once() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let old = ShardingSettings { number_of_shards: 4, min_nr_of_members: 2, ..remember() };
    let regions = start_all(&c, &probe, old.clone()).await;
    let ids: BTreeSet<String> = (0..24).map(|i| format!("x{i}")).collect();
    for id in &ids {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    for i in 0..2 {
        c.kill(i).await;
    }
    for i in 0..2 {
        c.restart(i).await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    // New extractor: 7 shards, numbered from 100 so no shard id is shared with the old ones.
    let extractor: ddshard::sharding::ShardIdExtractor =
        Arc::new(|id: &str| (100 + xxhash_rust::xxh3::xxh3_64(id.as_bytes()) % 7).to_string());
    let probe2 = Probe::default();
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        let mut p = probe2.clone();
        p.node = n.node_id().to_string();
        let opts = StartOptions { shard_id_extractor: Some(extractor.clone()), ..Default::default() };
        regions.push(
            n.sharding()
                .start_with("counter", move |_: &str| Counter::new(p.clone()), old.clone(), opts)
                .await
                .unwrap(),
        );
    }
    await_running(&regions, &ids, "every remembered entity runs once under the new extractor").await;
    for r in &regions {
        for (shard, entities) in r.region_state().await.unwrap() {
            for e in entities {
                assert_eq!(shard, extractor(&e), "{e} runs in the shard the new extractor gives");
            }
        }
    }
    // The old shards forget the moved ids.
    let node = c.node(0).clone();
    eventually(CONVERGE, "old shards' durable sets emptied", || {
        let node = node.clone();
        async move {
            for s in 0..4 {
                if !durable_set(&node, "counter", &s.to_string(), 4).await.is_empty() {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_internal_data_drops_only_the_named_types_and_refuses_while_running() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 2, ..remember() };
    let mut keep = Vec::new();
    let mut drop = Vec::new();
    for (_, n) in c.running() {
        keep.push(start_type(n, "keep", &probe, s.clone()).await);
        drop.push(start_type(n, "drop", &probe, s.clone()).await);
    }
    let ids: BTreeSet<String> = (0..12).map(|i| format!("r{i}")).collect();
    for id in &ids {
        keep[0].ask(id, CounterMsg::Add(1)).await.unwrap();
        drop[1].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    let err = remove_internal_data(c.data_dir(0), &["drop".to_string()]).unwrap_err();
    assert!(matches!(err, Error::Storage { .. }), "refused while running: {err}");
    for i in 0..2 {
        c.kill(i).await;
    }
    for i in 0..2 {
        let removed = remove_internal_data(c.data_dir(i), &["drop".to_string()]).unwrap();
        assert_eq!(removed[0].0, "drop");
        assert!(removed[0].1 > 0, "node {i} held some of drop's keys");
    }
    for i in 0..2 {
        c.restart(i).await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    // One probe per type: what "keep" restarts must not hide what "drop" would.
    let (probe_keep, probe_drop) = (Probe::default(), Probe::default());
    let mut keep = Vec::new();
    let mut drop = Vec::new();
    for (_, n) in c.running() {
        keep.push(start_type(n, "keep", &probe_keep, s.clone()).await);
        drop.push(start_type(n, "drop", &probe_drop, s.clone()).await);
    }
    // Both types started together with the same settings: once "keep" has hosted its shards,
    // read its remembered ids and restarted them, "drop" had the same chance.
    await_running(&keep, &ids, "kept type's entities are back").await;
    let d0 = drop[0].clone();
    eventually(CONVERGE, "drop's coordinator knows both regions", || {
        let d0 = d0.clone();
        async move { (d0.current_regions().await.ok()?.len() == 2).then_some(()) }
    })
    .await;
    // Over a window of several retry and rebalance intervals, not one instant.
    let window = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < window {
        assert_eq!(running_ids(&drop).await.unwrap(), Vec::<String>::new(), "the removed type starts nothing");
        assert!(probe_drop.created.lock().unwrap().is_empty(), "the removed type creates no entity");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kept: BTreeSet<String> = probe_keep.created.lock().unwrap().iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(kept, ids, "the kept type restarted exactly its remembered ids");
    // The removed type still works: a new message creates exactly that entity.
    drop[0].ask("fresh", CounterMsg::Add(1)).await.unwrap();
    let created: Vec<String> = probe_drop.created.lock().unwrap().iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(created, vec!["fresh".to_string()]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_failing_during_writes_and_loads_recovers_and_loses_no_acknowledged_start() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings {
        number_of_shards: 1,
        min_nr_of_members: 3,
        shard_failure_backoff: Duration::from_millis(300),
        coordinator: ddshard::sharding::ShardCoordinatorSettings {
            updating_state_timeout: Duration::from_millis(400),
            waiting_for_state_timeout: Duration::from_millis(300),
            ..remember().coordinator
        },
        ..remember()
    };
    let regions = start_all(&c, &probe, s).await;
    let acked: BTreeSet<String> = (0..10).map(|i| format!("a{i}")).collect();
    for id in &acked {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    let host = where_is(&regions[0], "a0").await;
    let h = host[1..].parse::<usize>().unwrap() - 1;
    let others: Vec<String> = (0..3).filter(|i| *i != h).map(|i| format!("n{}", i + 1)).collect();
    // The host's majority writes and reads stall (messaging cut, gossip intact).
    c.injector().cut_messaging(&[host.as_str()], &[others[0].as_str(), others[1].as_str()]);
    let start_write = regions[h].ask_with_timeout("late", CounterMsg::Add(1), Duration::from_secs(3)).await;
    assert!(start_write.is_err(), "a start that could not be recorded is not acknowledged");
    let stop_write = regions[h].ask_with_timeout("a1", CounterMsg::Stop, Duration::from_secs(3)).await;
    let _ = stop_write; // answered or not: the stop's write fails either way
    let r = regions[h].clone();
    eventually(CONVERGE, "the shard failed on writes and again on its reload", || {
        std::future::ready((r.counters().shard_failures >= 2).then_some(()))
    })
    .await;
    c.heal();
    // Recovery: the shard restarts, reloads, and new starts are recorded again.
    assert_eq!(ask_retry(&regions[h], "late", CounterMsg::Add(1), CONVERGE).await, CounterReply::Value(1));
    let mut expected = acked.clone();
    expected.insert("late".into());
    let node = c.node(0).clone();
    let e = expected.clone();
    eventually(CONVERGE, "every acknowledged start is in the durable set", || {
        let (n, e) = (node.clone(), e.clone());
        async move { durable_set(&n, "counter", "0", 4).await.is_superset(&e).then_some(()) }
    })
    .await;
    await_running(&regions, &expected, "acknowledged entities run again").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_at_max_remembered_refuses_new_ids_from_local_and_remote_askers_keeps_the_rest_across_a_crash_and_takes_one_more_after_a_passivation()
 {
    const LIMIT: usize = 20;
    let mut c = TestCluster::start_with(3, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    // One shard, so every id counts against the same limit, and askers on two nodes: at least
    // one of them reaches the shard over the wire.
    let s = ShardingSettings {
        number_of_shards: 1,
        remember: ddshard::sharding::RememberEntitiesSettings { max_per_shard: Some(LIMIT), ..remember().remember },
        ..remember()
    };
    let regions = start_all(&c, &probe, s).await;
    let home = where_is(&regions[0], "first").await;
    let asks = (0..40).map(|k| {
        let r = regions[k % 2].clone();
        async move { (format!("id-{k}"), r.ask(&format!("id-{k}"), CounterMsg::Add(1)).await) }
    });
    let (mut acked, mut refused) = (BTreeSet::from(["first".to_string()]), 0);
    for (id, result) in futures::future::join_all(asks).await {
        match result {
            Ok(_) => {
                acked.insert(id);
            }
            Err(Error::RememberedLimit { entity_id, shard, limit }) => {
                assert_eq!((entity_id, shard.as_str(), limit), (id, "0", LIMIT));
                refused += 1;
            }
            Err(e) => panic!("{id}: neither acknowledged nor refused at the limit: {e}"),
        }
    }
    println!("41 ids at a shard remembering at most {LIMIT}: {} acknowledged, {refused} refused", acked.len());
    assert_eq!((acked.len(), refused), (LIMIT, 41 - LIMIT));
    let home_index = (0..c.len()).find(|i| TestCluster::node_id(*i) == home).expect("the home is a node");
    let counted = regions[home_index].counters().dropped_remembered_limit;
    assert_eq!(counted, refused as u64, "every refusal counted where the shard lives");
    // The acknowledged ids come back on a survivor after their home crashed; nothing else does.
    c.kill(home_index).await;
    let survivors: Vec<ShardRegion<Counter>> =
        regions.iter().enumerate().filter(|(i, _)| *i != home_index).map(|(_, r)| r.clone()).collect();
    await_running(&survivors, &acked, "the acknowledged ids run again after the crash").await;
    let refused_there = survivors[0].ask("newcomer", CounterMsg::Add(1)).await;
    assert!(matches!(refused_there, Err(Error::RememberedLimit { .. })), "{refused_there:?}");
    // One passivates: its stop is recorded and a new id takes its place.
    let gone = acked.iter().find(|id| id.as_str() != "first").cloned().expect("an id");
    survivors[0].ask(&gone, CounterMsg::Stop).await.unwrap();
    ask_retry(&survivors[0], "newcomer", CounterMsg::Add(1), CONVERGE).await;
    acked.remove(&gone);
    acked.insert("newcomer".to_string());
    await_running(&survivors, &acked, "the newcomer runs in the passivated one's place").await;
    c.shutdown().await;
}
