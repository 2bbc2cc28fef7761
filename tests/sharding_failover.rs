//! Crashes: the coordinator's node is killed; keep-majority downing lets the cluster move on.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{MemberStatus, Node, ShardRegion};

const CONVERGE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_node_killed_known_shards_keep_answering_and_new_shards_allocate_after_take_over() {
    let mut c = TestCluster::start_with(4, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s =
        ddshard::ShardingSettings { min_nr_of_members: 4, rebalance_interval: Duration::from_secs(3600), ..settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_counter(n, &probe, s.clone()).await);
    }
    let ids: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let mut homes = BTreeMap::new();
    for id in &ids {
        regions[1].ask(id, CounterMsg::Add(1)).await.unwrap();
        homes.insert(id.clone(), where_is(&regions[1], id).await);
    }
    // n1 runs the coordinator; kill it.
    c.kill(0).await;
    // Shards with known homes elsewhere keep answering throughout, with their state.
    for (id, home) in &homes {
        if home != "n1" {
            assert_eq!(value(&regions[2], id).await, 1, "{id} on {home}");
        }
    }
    // n1 gets downed and removed everywhere; the coordinator moves to n2.
    let survivors: Vec<Node> = c.running().map(|(_, n)| n.clone()).collect();
    eventually(CONVERGE, "n1 removed after downing", || {
        let s = survivors.clone();
        async move { s.iter().all(|n| n.membership().member("n1").is_none()).then_some(()) }
    })
    .await;
    // New shards are allocated by the new coordinator; n1's entities come back elsewhere.
    for i in 0..20 {
        assert_eq!(value(&regions[3], &format!("fresh{i}")).await, 0);
    }
    for (id, home) in &homes {
        let v = value(&regions[2], id).await;
        if home == "n1" {
            assert_eq!(v, 0, "{id} re-created")
        } else {
            assert_eq!(v, 1)
        }
        assert_ne!(where_is(&regions[2], id).await, "n1");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minority_side_of_a_partition_downs_itself_and_the_majority_downs_it() {
    let mut c = TestCluster::start_with(5, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    c.partition(&[0, 1], &[2, 3, 4]);
    for i in [0, 1] {
        let n = c.node(i).clone();
        eventually(CONVERGE, "minority node stops itself", || std::future::ready(n.is_shut_down().then_some(()))).await;
    }
    for i in [2, 3, 4] {
        let n = c.node(i).clone();
        assert!(!n.is_shut_down());
        eventually(CONVERGE, "minority removed on the majority side", || {
            let n = n.clone();
            async move {
                let mut ids: Vec<String> = n.members().iter().map(|m| m.node_id().to_string()).collect();
                ids.sort();
                (ids == ["n3", "n4", "n5"] && n.members().iter().all(|m| m.status() == MemberStatus::Up)).then_some(())
            }
        })
        .await;
    }
    c.heal();
    // The downed nodes come back only as new incarnations.
    c.restart(0).await.unwrap();
    c.restart(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    c.shutdown().await;
}

/// An entity that records its activations (from its first message, which carries the epoch;
/// entities here are always started by a message).
struct Tracked {
    log: ddshard::testkit::ActivationLog,
    node: String,
    guard: Option<ddshard::testkit::ActivationGuard>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Touch;

impl ddshard::Entity for Tracked {
    type Message = Touch;
    type Reply = ();
    async fn handle(&mut self, _msg: Touch, ctx: &mut ddshard::EntityContext) {
        if self.guard.is_none() {
            self.guard = Some(self.log.started(ctx.entity_id(), &self.node, ctx.epoch()));
        }
    }
}

async fn start_tracked(
    n: &Node,
    log: &ddshard::testkit::ActivationLog,
    s: ddshard::ShardingSettings,
) -> ddshard::ShardRegion<Tracked> {
    let (log, node) = (log.clone(), n.node_id().to_string());
    n.sharding()
        .start("tracked", move |_: &str| Tracked { log: log.clone(), node: node.clone(), guard: None }, s)
        .await
        .unwrap()
}

/// Asks until `id` answers, pausing between tries; at the deadline fails with the last error.
async fn ask_until_answered(region: &ShardRegion<Tracked>, id: &str, when: &str) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    loop {
        match region.ask_with_timeout(id, Touch, Duration::from_secs(2)).await {
            Ok(_) => return,
            Err(e) if tokio::time::Instant::now() >= deadline => panic!("{id} never answered {when}: last error {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_two_three_minority_stops_before_majority_starts_and_no_activations_overlap() {
    let mut c = TestCluster::start_with(5, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let log = ddshard::testkit::ActivationLog::new();
    let s = ddshard::ShardingSettings { min_nr_of_members: 5, ..settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_tracked(n, &log, s.clone()).await);
    }
    let ids: Vec<String> = (0..50).map(|i| format!("t{i}")).collect();
    for id in &ids {
        regions[0].ask(id, Touch).await.unwrap();
    }
    let on_minority: BTreeSet<String> =
        log.activations().iter().filter(|a| a.node == "n1" || a.node == "n2").map(|a| a.entity_id.clone()).collect();
    assert!(!on_minority.is_empty(), "the minority hosts some entities");
    let cut_at = std::time::SystemTime::now();
    c.partition(&[0, 1], &[2, 3, 4]);
    // Keep traffic going from the majority side until every entity answers there.
    for id in &ids {
        ask_until_answered(&regions[3], id, "on the majority side").await;
    }
    assert!(c.node(0).is_shut_down() && c.node(1).is_shut_down(), "the minority downed itself");
    if let Err(v) = log.check() {
        panic!("overlapping activations: {v:#?}");
    }
    // Distinct ids, not activations: every id runs on the majority, and each one the minority
    // hosted started there again after the cut.
    let majority = |a: &&ddshard::testkit::Activation| a.node != "n1" && a.node != "n2";
    let on_majority: BTreeSet<String> =
        log.activations().iter().filter(majority).map(|a| a.entity_id.clone()).collect();
    assert_eq!(
        on_majority,
        ids.iter().cloned().collect::<BTreeSet<String>>(),
        "every entity runs on the majority side"
    );
    let moved: BTreeSet<String> = log
        .activations()
        .iter()
        .filter(majority)
        .filter(|a| on_minority.contains(&a.entity_id) && a.start >= cut_at)
        .map(|a| a.entity_id.clone())
        .collect();
    assert_eq!(moved, on_minority, "each entity of the minority started on the majority after the cut");
    c.heal();
    // The minority comes back as new incarnations and receives shards again by rebalance.
    c.restart(0).await.unwrap();
    c.restart(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r1 = start_tracked(c.node(0), &log, s.clone()).await;
    let r2 = start_tracked(c.node(1), &log, s.clone()).await;
    eventually(CONVERGE, "rejoined nodes receive shards by rebalance", || {
        let (r1, r2) = (r1.clone(), r2.clone());
        async move {
            let n = r1.region_state().await.ok()?.len() + r2.region_state().await.ok()?.len();
            (n > 0).then_some(())
        }
    })
    .await;
    // Touch everything again so moved entities start on their new homes.
    for id in &ids {
        ask_until_answered(&regions[3], id, "after the rebalance").await;
    }
    c.shutdown().await;
    if let Err(v) = log.check() {
        panic!("overlapping activations: {v:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lower_coordinator_min_cap_keeps_allocating_while_one_of_four_nodes_is_unreachable() {
    // Downing is off here: the killed node stays an unreachable member.
    let mut c = TestCluster::start(4).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let strict = ddshard::ShardingSettings { rebalance_interval: Duration::from_secs(3600), ..settings() };
    let relaxed = ddshard::ShardingSettings {
        coordinator_write_majority_plus: 0,
        coordinator_read_majority_plus: 0,
        coordinator_majority_min_cap: 3,
        ..strict.clone()
    };
    // Regions on n1..n3 only; n4 holds replicas but hosts no shard.
    let (mut strict_regions, mut relaxed_regions) = (Vec::new(), Vec::new());
    for i in 0..3 {
        strict_regions.push(start_type(c.node(i), "strict", &probe, strict.clone()).await);
        relaxed_regions.push(start_type(c.node(i), "relaxed", &probe, relaxed.clone()).await);
    }
    assert_eq!(value(&strict_regions[0], "before").await, 0);
    assert_eq!(value(&relaxed_regions[0], "before").await, 0);
    c.kill(3).await;
    let n1 = c.node(0).clone();
    eventually(CONVERGE, "n4 seen unreachable", || {
        let n1 = n1.clone();
        async move { n1.members().iter().any(|m| m.node_id() == "n4" && !m.is_reachable()).then_some(()) }
    })
    .await;
    // Majority 3 of 4 suffices for the relaxed type: new shards keep being allocated.
    for i in 0..5 {
        let r = relaxed_regions[1].ask(&format!("after{i}"), CounterMsg::Add(1)).await.unwrap();
        assert_eq!(r, CounterReply::Value(1));
    }
    // With Akka's defaults (plus 3, min-cap 5) every allocation needs all 4 members.
    let stalled = strict_regions[1].ask_with_timeout("after0", CounterMsg::Get, Duration::from_secs(3)).await;
    assert!(stalled.is_err(), "the strict type cannot allocate a new shard with n4 unreachable: {stalled:?}");
    // A region that knows the home of a shard keeps reaching it (the coordinator is not asked;
    // it is busy retrying the write, and Akka's coordinator stashes requests meanwhile too).
    assert_eq!(value(&strict_regions[0], "before").await, 0, "known shards keep answering");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_cuts_under_traffic_never_run_an_entity_twice_and_every_entity_answers_after_heal() {
    let mut c = TestCluster::start_with(5, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let log = ddshard::testkit::ActivationLog::new();
    let s = ddshard::ShardingSettings { min_nr_of_members: 5, ..settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(Some(start_tracked(n, &log, s.clone()).await));
    }
    let ids: Vec<String> = (0..30).map(|i| format!("w{i}")).collect();
    for id in &ids {
        regions[0].as_ref().unwrap().ask(id, Touch).await.unwrap();
    }
    // Asymmetric loss: n1 cannot reach n3 and n2 cannot reach n4 (gossip and messaging), while
    // the reverse directions work.
    c.injector().cut_one_way("n1", "n3");
    c.injector().cut_one_way("n2", "n4");
    let (mut answered, mut failed) = (0, 0);
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut k = 0;
    while tokio::time::Instant::now() < until {
        let live: Vec<&ShardRegion<Tracked>> = regions
            .iter()
            .enumerate()
            .filter(|(i, _)| !c.node(*i).is_shut_down())
            .filter_map(|(_, r)| r.as_ref())
            .collect();
        let r = live[k % live.len()];
        match r.ask_with_timeout(&ids[k % ids.len()], Touch, Duration::from_millis(500)).await {
            Ok(()) => answered += 1,
            Err(_) => failed += 1,
        }
        k += 1;
    }
    println!("during the one-way cuts: {answered} answered, {failed} failed");
    assert!(answered > 0, "the cluster kept serving during the one-way cuts");
    c.heal();
    // Whoever was downed comes back as a new incarnation.
    for (i, region) in regions.iter_mut().enumerate() {
        if c.node(i).is_shut_down() {
            c.restart(i).await.unwrap();
            *region = Some(start_tracked(c.node(i), &log, s.clone()).await);
        }
    }
    c.await_converged(CONVERGE).await;
    for id in &ids {
        ask_until_answered(regions[4].as_ref().unwrap(), id, "after the heal").await;
    }
    c.shutdown().await;
    if let Err(v) = log.check() {
        panic!("an entity ran twice across the one-way cuts: {v:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_two_tie_is_won_by_the_side_with_the_lowest_address_and_no_entity_runs_twice() {
    let mut c = TestCluster::start_with(4, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let log = ddshard::testkit::ActivationLog::new();
    let s = ddshard::ShardingSettings { min_nr_of_members: 4, ..settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_tracked(n, &log, s.clone()).await);
    }
    let ids: Vec<String> = (0..40).map(|i| format!("t{i}")).collect();
    for id in &ids {
        regions[0].ask(id, Touch).await.unwrap();
    }
    let on_losers: BTreeSet<String> =
        log.activations().iter().filter(|a| a.node == "n3" || a.node == "n4").map(|a| a.entity_id.clone()).collect();
    assert!(!on_losers.is_empty(), "the side that will lose hosts some entities");
    c.partition(&[0, 1], &[2, 3]);
    for i in [2, 3] {
        let n = c.node(i).clone();
        eventually(CONVERGE, "n3 and n4 (without the lowest address) down themselves", || {
            std::future::ready(n.is_shut_down().then_some(()))
        })
        .await;
    }
    for id in &ids {
        ask_until_answered(&regions[1], id, "on the side with n1").await;
    }
    assert!(!c.node(0).is_shut_down() && !c.node(1).is_shut_down(), "n1 and n2 won the tie and kept running");
    if let Err(v) = log.check() {
        panic!("an entity ran on both sides of the tie: {v:#?}");
    }
    let moved: BTreeSet<String> = log
        .activations()
        .iter()
        .filter(|a| (a.node == "n1" || a.node == "n2") && on_losers.contains(&a.entity_id))
        .map(|a| a.entity_id.clone())
        .collect();
    assert_eq!(moved, on_losers, "every entity of the losing side runs on the winning side");
    c.heal();
    c.restart(2).await.unwrap();
    c.restart(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    c.shutdown().await;
}
