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
    // The link n1 → n2 answers before the bad frames go: a send is fire-and-forget, and frames
    // queued for a first connection that fails (a starved 2-core machine) would be lost.
    let r0 = regions[0].clone();
    eventually(CONVERGE, "n2 answers n1", || {
        let r0 = r0.clone();
        async move {
            let stats = r0.cluster_stats(Duration::from_secs(2)).await.ok()?;
            (stats.regions.len() == 2 && stats.failed.is_empty()).then_some(())
        }
    })
    .await;
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
    sender.transport().send(&target, "region/counter", &forged_deliver(wrong_shard, "victim-2", get.clone())).unwrap();
    // An entity id longer than the type allows (`max_entity_id_bytes`, 1 KiB by default), for
    // the shard it hashes to: each id costs its length in every message, table and slot.
    let too_long = "v".repeat(settings().max_entity_id_bytes + 1);
    let long_shard = regions[1].shard_id(&too_long);
    sender.transport().send(&target, "region/counter", &forged_deliver(&long_shard, &too_long, get)).unwrap();
    // A type this node does not run, and garbage on the region topic.
    let dropped_before = c.node(1).transport().stats().frames_dropped;
    sender.transport().send(&target, "region/no-such-type", &deliver("x", vec![1])).unwrap();
    sender.transport().send(&target, "region/counter", b"garbage").unwrap();
    let r2 = regions[1].clone();
    let t2 = c.node(1).transport().clone();
    eventually(CONVERGE, "all six bad messages counted", || {
        let ok = r2.counters().dropped_invalid == 5 && t2.stats().frames_dropped > dropped_before;
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
    assert!(!probe.created.lock().unwrap().iter().any(|(id, _)| *id == too_long), "an over-long entity id was started");
    // Asked here, the same id fails at once, typed; one at the limit is served.
    let refused = regions[0].ask(&too_long, CounterMsg::Get).await;
    assert!(matches!(refused, Err(ddshard::Error::EntityIdTooLong { len, max: 1024 }) if len == 1025), "{refused:?}");
    assert_eq!(value(&regions[0], &too_long[1..]).await, 0, "an id of exactly max_entity_id_bytes");
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

/// Reads every page of a region's entity ids, `per_page` at a time.
async fn all_entity_pages(region: &ddshard::sharding::RegionRef, per_page: usize) -> Vec<(String, String)> {
    let mut all = Vec::new();
    let mut after = None;
    for _ in 0..10_000 {
        let page = region.entity_ids(after, per_page).await.unwrap();
        assert!(page.entities.len() <= per_page);
        all.extend(page.entities.iter().cloned());
        match page.next {
            Some(next) => {
                assert_eq!(Some(&next), page.entities.last(), "a page goes on after its last entity");
                after = Some(next);
            }
            None => return all,
        }
    }
    panic!("the pages never end: `after` is not honoured");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_types_regions_pages_of_entities_allocation_and_why_each_shard_is_where_it_is() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings { min_nr_of_members: 3, rebalance_interval: Duration::from_secs(3600), ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    let ids: Vec<String> = (0..60).map(|i| format!("q{i}")).collect();
    for id in &ids {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    let mut listed = Vec::new();
    for (_, node) in c.running() {
        assert_eq!(node.sharding().type_names(), vec!["counter".to_string()]);
        assert!(node.sharding().region("nope").is_none());
        let region = node.sharding().region("counter").expect("started here");
        assert!(!region.is_proxy());
        let info = region.info().await.unwrap();
        assert!(info.registered && !info.refused, "{info:?}");
        assert_eq!(info.region, node.address().to_string());
        assert_eq!(info.entities, info.shards.iter().map(|s| s.entities).sum::<usize>());
        // Pages of 7: every running entity once, in (shard, id) order, each in its own shard.
        let pages = all_entity_pages(&region, 7).await;
        assert_eq!(pages.len(), info.entities, "{}", node.node_id());
        assert!(pages.windows(2).all(|w| w[0] < w[1]), "ordered without repeats: {pages:?}");
        for (shard, id) in &pages {
            assert_eq!(&region.shard_of(id), shard);
        }
        listed.extend(pages.into_iter().map(|(_, id)| id));
    }
    listed.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(listed, expected, "the pages of all regions list every entity once");

    // The coordinator's table, asked from the newest node, agrees with where entities run.
    let region = c.node(2).sharding().region("counter").unwrap();
    let table = region.allocation().await.unwrap();
    assert_eq!(table.type_name, "counter");
    assert_eq!(table.coordinator, c.node(0).address().to_string(), "the oldest hosts the coordinator");
    assert_eq!(table.regions.len(), 3);
    assert_eq!(table.regions.iter().map(|r| r.shards).sum::<usize>(), table.shards.len());
    for id in ids.iter().take(10) {
        let host = where_is(&regions[0], id).await;
        let located = region.locate(id).await.unwrap();
        assert_eq!(located.shard, regions[0].shard_id(id));
        let home = located.home.expect("a home");
        assert!(home.starts_with(&format!("{host}#")), "{id}: located on {home}, runs on {host}");
        let row = table.shards.iter().find(|s| s.shard == located.shard).expect("in the table");
        assert_eq!((row.region.as_deref(), row.epoch), (Some(home.as_str()), located.epoch));
        let explained = region.explain(&located.shard).await.unwrap().expect("an allowed shard id");
        assert_eq!(explained.home.as_deref(), Some(home.as_str()));
        let allocated = explained.history.iter().find(|e| e.kind == "allocated").expect("its allocation");
        assert_eq!(allocated.region, home);
        assert!(allocated.reason.contains("requested by region"), "{allocated:?}");
        assert_eq!(explained.regions.iter().filter(|r| r.eligible).count(), 3);
    }
    assert!(region.explain("not-a-shard").await.unwrap().is_none(), "the default extractor numbers shards");
    assert!(matches!(region.locate("").await, Err(ddshard::Error::EmptyEntityId)));
    let nodes: Vec<ddshard::Node> = c.running().map(|(_, n)| n.clone()).collect();
    eventually(CONVERGE, "every node ready", || {
        let nodes = nodes.clone();
        async move {
            for n in &nodes {
                if !n.readiness().await.ready {
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
async fn a_rebalance_dry_run_names_what_the_rebalance_that_follows_moves_and_where() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    // No periodic rounds during the test: only the one asked for.
    let s = ShardingSettings { rebalance_interval: Duration::from_secs(3600), ..settings() };
    let first = start_counter(c.node(0), &probe, s.clone()).await;
    for i in 0..40 {
        first.ask(&format!("d{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    let _second = start_counter(c.node(1), &probe, s).await;
    let region = c.node(1).sharding().region("counter").unwrap();
    let plan = eventually(CONVERGE, "a dry run with moves", || {
        let region = region.clone();
        async move {
            let p = region.rebalance_plan().await.ok()?;
            (p.allowed && !p.moves.is_empty()).then_some(p)
        }
    })
    .await;
    assert!(!plan.executed);
    let n1 = c.node(0).address().to_string();
    let n2 = c.node(1).address().to_string();
    assert!(plan.moves.iter().all(|m| m.from == n1 && m.expected_to == n2), "{plan:?}");
    let done = region.rebalance().await.unwrap();
    assert!(done.executed);
    assert_eq!(done.moves, plan.moves, "the round did what the dry run said");
    let moved: BTreeSet<String> = plan.moves.iter().map(|m| m.shard.clone()).collect();
    eventually(CONVERGE, "every moved shard at its expected home", || {
        let (region, moved, n2) = (region.clone(), moved.clone(), n2.clone());
        async move {
            let table = region.allocation().await.ok()?;
            let landed =
                table.shards.iter().filter(|s| moved.contains(&s.shard) && s.region.as_deref() == Some(&n2)).count();
            (landed == moved.len()).then_some(())
        }
    })
    .await;
    let explained = region.explain(moved.iter().next().unwrap()).await.unwrap().unwrap();
    let kinds: Vec<&str> = explained.history.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["allocated", "hand-off-started", "hand-off-done", "allocated"], "{explained:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_names_a_region_its_coordinator_refused() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let _first = start_counter(c.node(0), &probe, settings()).await;
    let other: ddshard::sharding::ShardIdExtractor = std::sync::Arc::new(|id: &str| format!("x{}", id.len()));
    let opts = ddshard::sharding::StartOptions { shard_id_extractor: Some(other), ..Default::default() };
    let _refused: ddshard::ShardRegion<Counter> = c
        .node(1)
        .sharding()
        .start_with("counter", |_: &str| Counter::new(Probe::default()), settings(), opts)
        .await
        .unwrap();
    let node = c.node(1).clone();
    let why = eventually(CONVERGE, "n2 not ready, naming the refusal", || {
        let node = node.clone();
        async move {
            let r = node.readiness().await;
            (!r.ready && r.not_ready_because.iter().any(|w| w.contains("refused"))).then_some(r)
        }
    })
    .await;
    assert_eq!(why.not_ready_because.len(), 1, "{why:?}");
    let node = c.node(0).clone();
    eventually(CONVERGE, "n1 ready", || {
        let node = node.clone();
        async move { node.readiness().await.ready.then_some(()) }
    })
    .await;
    c.shutdown().await;
}
