//! Durable entity state: loaded before the first message of every incarnation, written
//! (majority, durable) before the reply, kept across passivation, hand-off, a killed node and a
//! full-cluster restart; fenced by epoch; typed errors for oversized and undecodable states.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use ddshard::ddata::{Consistency, FencedMap, KeyUpdate};
use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{Durable, DurableEntity, EntityContext, Error, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

const CONVERGE: Duration = Duration::from_secs(40);

/// A shopping cart whose items are its durable state.
struct Cart;

#[derive(Debug, Clone, Serialize, Deserialize)]
enum CartMsg {
    Add(String),
    /// Adds without persisting: the change is lost with the incarnation.
    AddVolatile(String),
    Get,
    Passivate,
    Clear,
    /// Adds an item of this many bytes and persists.
    AddHuge(usize),
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CartState {
    items: Vec<String>,
}

impl DurableEntity for Cart {
    type Message = CartMsg;
    type Reply = Vec<String>;
    type State = CartState;

    async fn handle(&mut self, state: &mut CartState, msg: CartMsg, ctx: &mut EntityContext) -> Vec<String> {
        match msg {
            CartMsg::Add(item) => {
                state.items.push(item);
                ctx.persist();
            }
            CartMsg::AddVolatile(item) => state.items.push(item),
            CartMsg::Get => {}
            CartMsg::Passivate => ctx.passivate(),
            CartMsg::Clear => ctx.delete_state(),
            CartMsg::AddHuge(n) => {
                state.items.push("x".repeat(n));
                ctx.persist();
            }
        }
        state.items.clone()
    }
}

fn durable_settings() -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 10,
        state: ddshard::sharding::DurableStateSettings { slots: 4, ..common::settings().state },
        ..common::settings()
    }
}

async fn start_carts(node: &ddshard::Node, s: ShardingSettings) -> ShardRegion<Durable<Cart>> {
    node.sharding().start_durable("cart", |_: &str| Cart, s).await.unwrap()
}

/// Asks until answered (a message caught in a hand-off or a node's death is lost, as
/// documented; a client retries). Panics after `within` with the last error.
async fn ask(r: &ShardRegion<Durable<Cart>>, id: &str, msg: CartMsg, within: Duration) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match r.ask_with_timeout(id, msg.clone(), Duration::from_secs(3)).await {
            Ok(items) => return items,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no answer from {id} within {within:?}: {e}"),
        }
    }
}

async fn fill(r: &ShardRegion<Durable<Cart>>, carts: usize) -> BTreeMap<String, Vec<String>> {
    let mut expected = BTreeMap::new();
    for i in 0..carts {
        let id = format!("cart-{i}");
        let items = vec![format!("apples-{i}"), format!("pears-{i}")];
        for item in &items {
            r.ask(&id, CartMsg::Add(item.clone())).await.unwrap();
        }
        expected.insert(id, items);
    }
    expected
}

async fn check_all(r: &ShardRegion<Durable<Cart>>, expected: &BTreeMap<String, Vec<String>>, what: &str) {
    for (id, items) in expected {
        assert_eq!(&ask(r, id, CartMsg::Get, CONVERGE).await, items, "{what}: {id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persisted_state_survives_passivation_and_a_volatile_change_does_not() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(c.node(0), durable_settings()).await;
    assert_eq!(r.ask("c1", CartMsg::Add("apples".into())).await.unwrap(), vec!["apples"]);
    assert_eq!(r.ask("c1", CartMsg::AddVolatile("pears".into())).await.unwrap(), vec!["apples", "pears"]);
    r.ask("c1", CartMsg::Passivate).await.unwrap();
    let r2 = r.clone();
    eventually(CONVERGE, "the cart passivated", || {
        let r = r2.clone();
        async move { r.region_state().await.ok()?.values().all(Vec::is_empty).then_some(()) }
    })
    .await;
    assert_eq!(r.ask("c1", CartMsg::Get).await.unwrap(), vec!["apples"], "loaded before the first message");
    assert_eq!(r.counters().state_writes, 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_state_is_default_again_in_the_next_incarnation() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(c.node(0), durable_settings()).await;
    r.ask("c1", CartMsg::Add("apples".into())).await.unwrap();
    r.ask("c1", CartMsg::Clear).await.unwrap();
    assert!(r.ask("c1", CartMsg::Get).await.unwrap().is_empty(), "the state is Default after the delete");
    r.ask("c1", CartMsg::Passivate).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(ask(&r, "c1", CartMsg::Get, CONVERGE).await.is_empty());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalanced_shards_load_the_latest_state_on_their_new_node() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r1 = start_carts(c.node(0), durable_settings()).await;
    let expected = fill(&r1, 20).await;
    c.add_node().await.unwrap();
    c.await_converged(CONVERGE).await;
    let r2 = start_carts(c.node(1), durable_settings()).await;
    let r2c = r2.clone();
    eventually(CONVERGE, "some shards moved to n2 and run carts there", || {
        let r2 = r2c.clone();
        async move {
            for id in ["cart-0", "cart-1", "cart-2", "cart-3", "cart-4", "cart-5"] {
                let _ = r2.ask_with_timeout(id, CartMsg::Get, Duration::from_secs(2)).await;
            }
            r2.region_state().await.ok()?.values().any(|ids| !ids.is_empty()).then_some(())
        }
    })
    .await;
    check_all(&r1, &expected, "asked through n1").await;
    check_all(&r2, &expected, "asked through n2").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_of_a_killed_node_are_served_by_the_survivors() {
    let mut c = TestCluster::start_with(3, |_, cfg| fast_downing(cfg)).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ShardingSettings { min_nr_of_members: 3, ..durable_settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_carts(n, s.clone()).await);
    }
    let expected = fill(&regions[0], 30).await;
    let on_n3: usize = regions[2].region_state().await.unwrap().values().map(Vec::len).sum();
    assert!(on_n3 > 0, "n3 hosts some carts");
    c.kill(2).await;
    check_all(&regions[0], &expected, "after n3 was killed").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_survive_a_full_cluster_restart() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ShardingSettings { min_nr_of_members: 3, ..durable_settings() };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_carts(n, s.clone()).await);
    }
    let expected = fill(&regions[0], 30).await;
    drop(regions);
    c.shutdown().await;
    for i in 0..3 {
        c.restart(i).await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_carts(n, s.clone()).await);
    }
    check_all(&regions[1], &expected, "after a full restart").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_over_max_state_bytes_fails_typed_writes_nothing_and_the_entity_restarts_from_its_stored_state() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(
        c.node(0),
        ShardingSettings {
            state: ddshard::sharding::DurableStateSettings { max_bytes: 1024, ..durable_settings().state },
            ..durable_settings()
        },
    )
    .await;
    r.ask("c1", CartMsg::Add("apples".into())).await.unwrap();
    let err = r.ask("c1", CartMsg::AddHuge(2000)).await.unwrap_err();
    assert!(
        matches!(err, Error::StateTooLarge { ref entity_id, bytes, max: 1024 } if entity_id == "c1" && bytes > 2000),
        "{err:?}"
    );
    assert_eq!(ask(&r, "c1", CartMsg::Get, CONVERGE).await, vec!["apples"], "restarted from the stored state");
    assert_eq!(r.counters().state_write_failures, 1);
    c.shutdown().await;
}

/// The same type name with another state shape: what a deploy that changed the state type
/// incompatibly finds.
struct Renamed;

#[derive(Debug, Default, Serialize, Deserialize)]
struct RenamedState {
    count: u64,
    owner: String,
}

impl DurableEntity for Renamed {
    type Message = CartMsg;
    type Reply = Vec<String>;
    type State = RenamedState;

    async fn handle(&mut self, state: &mut RenamedState, _msg: CartMsg, _ctx: &mut EntityContext) -> Vec<String> {
        vec![state.owner.clone()]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_state_that_does_not_decode_is_a_typed_error_naming_the_type_and_id_never_a_default() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(c.node(0), durable_settings()).await;
    r.ask("c1", CartMsg::Add("apples".into())).await.unwrap();
    drop(r);
    c.restart(0).await.unwrap();
    c.await_converged(CONVERGE).await;
    let renamed = c.node(0).sharding().start_durable("cart", |_: &str| Renamed, durable_settings()).await.unwrap();
    // Until the restarted shard is hosted: retried with a pause, the last error named at the
    // deadline.
    let deadline = tokio::time::Instant::now() + CONVERGE;
    let err = loop {
        match renamed.ask_with_timeout("c1", CartMsg::Get, Duration::from_secs(3)).await {
            Err(Error::StateUndecodable { type_name, entity_id, reason }) => break (type_name, entity_id, reason),
            Err(e @ (Error::AskTimeout { .. } | Error::NotDelivered { .. })) => {
                assert!(tokio::time::Instant::now() < deadline, "no decode error before the deadline; last: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("expected a decode error, got {other:?}"),
        }
    };
    assert_eq!((err.0.as_str(), err.1.as_str()), ("cart", "c1"), "{}", err.2);
    assert!(renamed.counters().state_undecodable >= 1);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persist_after_a_newer_epoch_claimed_the_state_fails_fenced_and_the_shard_stops_here() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ShardingSettings {
        state: ddshard::sharding::DurableStateSettings { slots: 1, ..durable_settings().state },
        ..durable_settings()
    };
    let r = start_carts(c.node(0), s).await;
    r.ask("c1", CartMsg::Add("apples".into())).await.unwrap();
    // A newer allocation of the shard claims its state (what a new home does when it starts).
    let key = format!("shard-cart/{}/state-0", r.shard_id("c1"));
    let claim = KeyUpdate::new::<FencedMap, _>(&key, |m, _ctx| m.claim(u64::MAX).unwrap());
    c.node(0).replicator().update_many(Consistency::Local, Duration::from_secs(3), vec![claim]).await.unwrap();
    let err = r.ask("c1", CartMsg::Add("pears".into())).await.unwrap_err();
    assert!(matches!(err, Error::Fenced { ref key, fence: u64::MAX, .. } if key == "cart/c1"), "{err:?}");
    assert_eq!(r.counters().state_fenced, 1);
    let r2 = r.clone();
    eventually(CONVERGE, "the fenced shard no longer runs the cart here", || {
        let r = r2.clone();
        async move { r.region_state().await.ok()?.values().all(|ids| !ids.contains(&"c1".to_string())).then_some(()) }
    })
    .await;
    // The stale write did not land: the map holds the state before it.
    let stored = c
        .node(0)
        .replicator()
        .get::<FencedMap>(&key, Consistency::Local, Duration::from_secs(3))
        .await
        .unwrap()
        .unwrap();
    let items: CartState = rmp_serde::from_slice(stored.get("c1").unwrap()).unwrap();
    assert_eq!(items.items, vec!["apples"]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_durable_entities_come_back_after_a_full_restart_with_their_state_and_without_a_message() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ShardingSettings {
        min_nr_of_members: 2,
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, ..durable_settings().remember },
        ..durable_settings()
    };
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_carts(n, s.clone()).await);
    }
    let expected = fill(&regions[0], 12).await;
    drop(regions);
    c.shutdown().await;
    for i in 0..2 {
        c.restart(i).await.unwrap();
    }
    c.await_converged(CONVERGE).await;
    let mut regions = Vec::new();
    for (_, n) in c.running() {
        regions.push(start_carts(n, s.clone()).await);
    }
    let all = regions.clone();
    eventually(CONVERGE, "every remembered cart runs again without a message", || {
        let all = all.clone();
        async move {
            let mut running = Vec::new();
            for r in &all {
                running.extend(r.region_state().await.ok()?.into_values().flatten());
            }
            running.sort();
            (running.len() == 12).then_some(())
        }
    })
    .await;
    check_all(&regions[0], &expected, "remembered and restarted").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_internal_data_removes_a_types_states_too() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(c.node(0), durable_settings()).await;
    r.ask("c1", CartMsg::Add("apples".into())).await.unwrap();
    drop(r);
    c.kill(0).await;
    let removed = ddshard::sharding::remove_internal_data(c.data_dir(0), &["cart".to_string()]).unwrap();
    assert!(removed[0].1 >= 1, "{removed:?}");
    c.restart(0).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = start_carts(c.node(0), durable_settings()).await;
    assert!(ask(&r, "c1", CartMsg::Get, CONVERGE).await.is_empty(), "the state went with the type's data");
    c.shutdown().await;
}
