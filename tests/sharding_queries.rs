//! Queries, roles, min-nr-of-members, epochs, and bad input from other nodes.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use ddshard::testkit::{TestCluster, eventually, fast_downing, forged_deliver};
use ddshard::transport::{PeerAddr, wire};
use ddshard::{Node, ShardingSettings};

const CONVERGE: Duration = Duration::from_secs(30);

fn node_ids(regions: impl IntoIterator<Item = ddshard::UniqueAddress>) -> BTreeSet<String> {
    regions.into_iter().map(|r| r.node_id.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_stats_cover_three_regions_and_list_an_unresponsive_one_as_failed() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 3, ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    let ids: Vec<String> = (0..60).map(|i| format!("s{i}")).collect();
    for id in &ids {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    let stats = regions[0].cluster_stats(Duration::from_secs(5)).await.unwrap();
    assert_eq!(node_ids(stats.regions.keys().cloned()), BTreeSet::from(["n1".into(), "n2".into(), "n3".into()]));
    assert!(stats.failed.is_empty());
    let total: usize = stats.regions.values().flat_map(|m| m.values()).sum();
    assert_eq!(total, 60);
    // Region state lists entity ids.
    let mut listed = BTreeSet::new();
    for r in &regions {
        for (shard, entities) in r.region_state().await.unwrap() {
            for e in entities {
                assert_eq!(r.shard_id(&e), shard);
                listed.insert(e);
            }
        }
    }
    assert_eq!(listed, ids.iter().cloned().collect());
    // n3 stops answering n1 (messaging cut, gossip intact): listed as failed, the rest answer.
    c.injector().cut_messaging(&["n1"], &["n3"]);
    let stats = regions[0].cluster_stats(Duration::from_millis(500)).await.unwrap();
    assert_eq!(node_ids(stats.failed.iter().cloned()), BTreeSet::from(["n3".into()]));
    assert_eq!(node_ids(stats.regions.keys().cloned()), BTreeSet::from(["n1".into(), "n2".into()]));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_message_waits_until_min_nr_of_members_regions_registered() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 3, ..settings() };
    let r1 = start_counter(c.node(0), &probe, s.clone()).await;
    let asker = r1.clone();
    let pending =
        tokio::spawn(async move { asker.ask_with_timeout("m-1", CounterMsg::Add(1), Duration::from_secs(60)).await });
    let _r2 = start_counter(c.node(1), &probe, s.clone()).await;
    let r1b = r1.clone();
    eventually(CONVERGE, "two regions registered", || {
        let r = r1b.clone();
        async move { (r.current_regions().await.ok()?.len() == 2).then_some(()) }
    })
    .await;
    assert!(!pending.is_finished(), "no allocation with 2 of 3 regions");
    assert_eq!(probe.handled.load(Ordering::SeqCst), 0);
    let _r3 = start_counter(c.node(2), &probe, s).await;
    let reply = pending.await.unwrap().unwrap();
    assert_eq!(reply, CounterReply::Value(1));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_types_on_two_roles_are_hosted_only_by_their_role() {
    let mut c = TestCluster::start_with(4, |i, cfg| cfg.roles = vec![if i < 2 { "a".into() } else { "b".into() }])
        .await
        .unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let mut ta = Vec::new();
    let mut tb = Vec::new();
    for (_, n) in c.running() {
        for (name, role, out) in [("ta", "a", &mut ta), ("tb", "b", &mut tb)] {
            let s = ShardingSettings { role: Some(role.into()), ..settings() };
            let mut p = probe.clone();
            p.node = n.node_id().to_string();
            out.push(n.sharding().start(name, move |_: &str| Counter::new(p.clone()), s).await.unwrap());
        }
    }
    assert!(!ta[0].is_proxy() && ta[2].is_proxy() && tb[0].is_proxy() && !tb[2].is_proxy());
    for i in 0..40 {
        // Sent from every node, including the proxies.
        assert_eq!(ta[i % 4].ask(&format!("x{i}"), CounterMsg::Add(1)).await.unwrap(), CounterReply::Value(1));
        assert_eq!(tb[i % 4].ask(&format!("x{i}"), CounterMsg::Add(2)).await.unwrap(), CounterReply::Value(2));
    }
    let sa = ta[3].cluster_stats(Duration::from_secs(5)).await.unwrap();
    let sb = tb[0].cluster_stats(Duration::from_secs(5)).await.unwrap();
    assert!(node_ids(sa.regions.keys().cloned()).is_subset(&BTreeSet::from(["n1".into(), "n2".into()])));
    assert!(node_ids(sb.regions.keys().cloned()).is_subset(&BTreeSet::from(["n3".into(), "n4".into()])));
    assert_eq!(sa.regions.values().flat_map(|m| m.values()).sum::<usize>(), 40);
    assert_eq!(sb.regions.values().flat_map(|m| m.values()).sum::<usize>(), 40);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_seen_by_one_entity_strictly_increase_across_hand_offs_and_crashes() {
    let mut c = TestCluster::start_with(4, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 4, rebalance_interval: Duration::from_secs(3600), ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    let id = "ep-1".to_string();
    let epoch = |r: ddshard::ShardRegion<Counter>, id: String| async move {
        match ask_retry(&r, &id, CounterMsg::Epoch, CONVERGE).await {
            CounterReply::Epoch(e) => e,
            other => panic!("{other:?}"),
        }
    };
    let e1 = epoch(regions[0].clone(), id.clone()).await;
    let host1 = where_is(&regions[0], &id).await;
    let idx = |name: &str| name[1..].parse::<usize>().unwrap() - 1;
    // Hand-off: the host leaves gracefully.
    c.node(idx(&host1)).leave().await.unwrap();
    let via = (0..4).find(|i| *i != idx(&host1)).unwrap();
    let e2 = epoch(regions[via].clone(), id.clone()).await;
    let host2 = match ask_retry(&regions[via], &id, CounterMsg::WhereAreYou, CONVERGE).await {
        CounterReply::Node(n) => n,
        other => panic!("{other:?}"),
    };
    assert_ne!(host1, host2);
    // Crash: the new host is killed; downing removes it; the entity comes back elsewhere.
    c.kill(idx(&host2)).await;
    let via = (0..4).find(|i| *i != idx(&host1) && *i != idx(&host2)).unwrap();
    let e3 = epoch(regions[via].clone(), id.clone()).await;
    assert!(e1 < e2 && e2 < e3, "epochs {e1} < {e2} < {e3}");
    let seen = probe.epochs.lock().unwrap().get(&id).cloned().unwrap();
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_from_another_node_is_dropped_counted_and_harmless() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let regions = start_everywhere(&c, &probe, settings()).await;
    let sender: &Node = c.node(0);
    let target = PeerAddr { address: c.node(1).address().clone(), messaging_addr: c.node(1).messaging_addr() };
    let deliver = |entity_id: &str, payload: Vec<u8>| forged_deliver("0", entity_id, payload);
    // A payload that does not deserialize as the entity's message.
    sender.transport().send(&target, "region/counter", &deliver("victim", vec![0xc1, 0xc1, 0xc1])).unwrap();
    // An empty entity id.
    let get = wire::encode(&CounterMsg::Get).unwrap().to_vec();
    sender.transport().send(&target, "region/counter", &deliver("", get.clone())).unwrap();
    // A well-formed message for a shard this node's extractor does not give the id (a node with
    // another number_of_shards, or a forger): starting it could run the id in two shards.
    let wrong_shard = if regions[1].shard_id("victim-2") == "0" { "1" } else { "0" };
    sender.transport().send(&target, "region/counter", &forged_deliver(wrong_shard, "victim-2", get)).unwrap();
    // A type this node does not run, and garbage on the region topic.
    let dropped_before = c.node(1).transport().stats().frames_dropped.load(Ordering::Relaxed);
    sender.transport().send(&target, "region/no-such-type", &deliver("x", vec![1])).unwrap();
    sender.transport().send(&target, "region/counter", b"garbage").unwrap();
    let r2 = regions[1].clone();
    let t2 = c.node(1).transport().clone();
    eventually(CONVERGE, "all five bad messages counted", || {
        let ok = r2.counters().dropped_invalid.load(Ordering::Relaxed) == 4
            && t2.stats().frames_dropped.load(Ordering::Relaxed) > dropped_before;
        std::future::ready(ok.then_some(()))
    })
    .await;
    // Other traffic is unaffected.
    for i in 0..20 {
        assert_eq!(value(&regions[0], &format!("ok{i}")).await, 0);
    }
    assert_eq!(probe.handled.load(Ordering::SeqCst), 20);
    assert!(
        !probe.created.lock().unwrap().iter().any(|(id, _)| id == "victim-2"),
        "an entity was started from a Deliver naming the wrong shard"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_allocation_places_and_moves_shards_where_the_operator_says() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings {
        allocation: ddshard::sharding::AllocationSettings::External { rebalance_limit: 10 },
        min_nr_of_members: 2,
        ..settings()
    };
    let regions = start_everywhere(&c, &probe, s).await;
    let shard = regions[0].shard_id("ext-1");
    regions[0].set_external_shard_location(&shard, "n2").await.unwrap();
    // The location table follows the replicated map; wait for the coordinator's copy.
    let r0 = regions[0].clone();
    eventually(CONVERGE, "ext-1 allocated on n2", || {
        let r0 = r0.clone();
        async move { (where_is_if_answered(&r0, "ext-1").await.as_deref() == Some("n2")).then_some(()) }
    })
    .await;
    regions[1].set_external_shard_location(&shard, "n1").await.unwrap();
    eventually(CONVERGE, "ext-1 moved to n1 by rebalance", || {
        let r0 = r0.clone();
        async move { (where_is_if_answered(&r0, "ext-1").await.as_deref() == Some("n1")).then_some(()) }
    })
    .await;
    c.shutdown().await;
}
