//! Passivation strategies on a live region: an active-entity limit holds under traffic and
//! follows a change at run time; remembered types never passivate by themselves. (The
//! policies' decisions are table- and property-tested in `shard/passivation.rs` and the shard
//! core; idle passivation end to end is in `tests/sharding.rs`.)

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use ddshard::sharding::{PassivationSettings, PassivationStrategy, ReplacementPolicy};
use ddshard::testkit::{TestCluster, eventually};
use ddshard::{Error, ShardRegion, ShardingSettings};

const CONVERGE: Duration = Duration::from_secs(30);

fn limited(limit: usize, replacement: ReplacementPolicy) -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 4,
        passivation: PassivationSettings {
            strategy: PassivationStrategy::ActiveEntityLimit,
            active_entity_limit: limit,
            replacement,
            ..PassivationSettings::default()
        },
        ..settings()
    }
}

/// Entities running in `region` once stops in flight have ended.
async fn settles_at_most(region: &ShardRegion<Counter>, limit: usize, what: &str) -> usize {
    eventually(CONVERGE, what, || async {
        let running = running_ids(std::slice::from_ref(region)).await.ok()?.len();
        (running <= limit).then_some(running)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_active_entity_limit_holds_under_traffic_and_the_recent_entities_stay_running() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let region = start_counter(c.node(0), &probe, limited(20, ReplacementPolicy::Lru)).await;
    for i in 0..100 {
        region.ask(&format!("e{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    let running = settles_at_most(&region, 20, "at most 20 entities run").await;
    assert!(running >= 16, "the limit is used, not emptied: {running} running");
    let stopped = region.counters().passivations_limit;
    assert!(stopped >= 80, "every start past the limit passivated one entity: {stopped}");
    // The last ids asked are the most recent of their shards: they are still running, with
    // their state (no new incarnation).
    let started_before = probe.started.load(Ordering::Relaxed);
    for i in 96..100 {
        let v = region.ask(&format!("e{i}"), CounterMsg::Get).await.unwrap();
        assert_eq!(v, CounterReply::Value(1), "e{i} kept running");
    }
    assert_eq!(probe.started.load(Ordering::Relaxed), started_before, "no restart for recent entities");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_lowered_at_run_time_passivates_the_surplus_and_a_type_without_a_limit_refuses_it() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let region = start_counter(c.node(0), &probe, limited(40, ReplacementPolicy::Lfu)).await;
    for i in 0..40 {
        region.ask(&format!("e{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    assert_eq!(running_ids(std::slice::from_ref(&region)).await.unwrap().len(), 40, "all 40 fit");
    region.set_passivation_limit(8).await.unwrap();
    let running = settles_at_most(&region, 8, "the lowered limit of 8 holds").await;
    assert!(running >= 4, "{running} running");
    let other = start_type(c.node(0), "idle-only", &probe, settings()).await;
    let err = other.set_passivation_limit(8).await.unwrap_err();
    assert!(matches!(err, Error::BadRequest(ref m) if m.contains("no active-entity limit")), "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_entities_never_passivate_by_themselves_whatever_the_limit() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ShardingSettings {
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, ..Default::default() },
        ..limited(5, ReplacementPolicy::Lru)
    };
    let region = start_counter(c.node(0), &probe, s).await;
    for i in 0..30 {
        region.ask(&format!("r{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    // Over a window (not one instant): all 30 keep running, none passivated by the limit.
    for _ in 0..10 {
        assert_eq!(running_ids(std::slice::from_ref(&region)).await.unwrap().len(), 30);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(region.counters().passivations_limit, 0);
    c.shutdown().await;
}
