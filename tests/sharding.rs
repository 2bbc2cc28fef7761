//! Cluster sharding end to end on in-process clusters (ports of Akka's multi-node specs).

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use ddshard::Error;
use ddshard::testkit::{TestCluster, eventually};

const CONVERGE: Duration = Duration::from_secs(30);

/// What an operator tuned in the node's `[sharding]` table reaches a type started with
/// `node.sharding().settings()`: here 7 shards and a 9-message buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_started_with_the_node_settings_follows_the_sharding_table_of_the_node_config() {
    let mut c = TestCluster::start_with(1, |_, cfg| {
        cfg.sharding.number_of_shards = 7;
        cfg.sharding.buffer_size = 9;
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let node_settings = c.node(0).sharding().settings();
    assert_eq!((node_settings.number_of_shards, node_settings.buffer_size), (7, 9));
    assert_ne!(ddshard::ShardingSettings::default().number_of_shards, 7, "the test must tell the two apart");
    let probe = Probe::default();
    let r = start_counter(c.node(0), &probe, node_settings).await;
    let shards: BTreeSet<String> = (0..500).map(|i| r.shard_id(&format!("c-{i}"))).collect();
    let expected: BTreeSet<String> = (0..7).map(|i| i.to_string()).collect();
    assert_eq!(shards, expected, "ids spread over the table's 7 shards");
    r.tell("c-1", CounterMsg::Add(3)).unwrap();
    assert_eq!(value(&r, "c-1").await, 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_counter_answers_and_lists_its_own_region() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let r = start_counter(c.node(0), &probe, settings()).await;
    r.tell("c-1", CounterMsg::Add(5)).unwrap();
    r.tell("c-1", CounterMsg::Add(2)).unwrap();
    assert_eq!(value(&r, "c-1").await, 7);
    assert_eq!(value(&r, "c-2").await, 0);
    let regions = r.current_regions().await.unwrap();
    assert_eq!(regions, BTreeSet::from([c.node(0).address().clone()]));
    let state = r.region_state().await.unwrap();
    let ids: BTreeSet<String> = state.values().flatten().cloned().collect();
    assert_eq!(ids, BTreeSet::from(["c-1".to_string(), "c-2".to_string()]));
    assert!(matches!(r.tell("", CounterMsg::Get), Err(Error::EmptyEntityId)));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entity_ref_tells_and_asks_its_one_entity_in_order_and_checks_its_id() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let r = start_counter(c.node(0), &probe, settings()).await;
    let cart = r.entity_ref("cart-1");
    assert_eq!(cart.entity_id(), "cart-1");
    cart.tell(CounterMsg::Add(2)).unwrap();
    let copy = cart.clone();
    assert!(matches!(copy.ask(CounterMsg::Add(3)).await.unwrap(), CounterReply::Value(5)), "after the tell");
    assert!(matches!(
        cart.ask_with_timeout(CounterMsg::Get, Duration::from_secs(5)).await.unwrap(),
        CounterReply::Value(5)
    ));
    assert_eq!(value(&r, "cart-2").await, 0, "another id is another entity");
    assert!(matches!(r.entity_ref("").tell(CounterMsg::Get), Err(Error::EmptyEntityId)));
    assert!(format!("{cart:?}").contains("cart-1"));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_node_joins_and_entities_spread_over_both() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let r1 = start_counter(c.node(0), &probe, settings()).await;
    for i in 0..20 {
        r1.tell(&format!("e{i}"), CounterMsg::Add(1)).unwrap();
    }
    c.add_node().await.unwrap();
    c.await_converged(CONVERGE).await;
    let r2 = start_counter(c.node(1), &probe, settings()).await;
    for i in 20..60 {
        r2.tell(&format!("e{i}"), CounterMsg::Add(1)).unwrap();
    }
    // Rebalancing moves some shards to n2; every counter keeps answering meanwhile.
    eventually(CONVERGE, "entities hosted on both nodes", || {
        let (r1, r2) = (r1.clone(), r2.clone());
        async move {
            let mut hosts = BTreeSet::new();
            for i in 0..60 {
                // Ask through both regions: routing agrees wherever the message starts.
                let r = if i % 2 == 0 { &r1 } else { &r2 };
                hosts.insert(where_is(r, &format!("e{i}")).await);
            }
            (hosts.len() == 2).then_some(())
        }
    })
    .await;
    assert_eq!(r2.current_regions().await.unwrap().len(), 2);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passivation_while_messages_keep_arriving_loses_none() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let regions = start_everywhere(&c, &probe, settings()).await;
    let mut expected = 0u64;
    for round in 0..20 {
        for k in 0..10 {
            let r = &regions[(round + k) % 2];
            r.tell("busy", CounterMsg::Add(1)).unwrap();
            expected += 1;
        }
        // Asked, so the next round's messages arrive while it passivates.
        regions[round % 2].ask("busy", CounterMsg::Stop).await.unwrap();
        expected += 1;
    }
    // The final ask is ordered after every tell from the same region.
    regions[0].ask("busy", CounterMsg::Get).await.unwrap();
    regions[1].ask("busy", CounterMsg::Get).await.unwrap();
    expected += 2;
    eventually(CONVERGE, "every message handled exactly once", || {
        let h = probe.handled.load(Ordering::SeqCst);
        assert!(h <= expected, "handled {h} > sent {expected}");
        std::future::ready((h == expected).then_some(()))
    })
    .await;
    let started = probe.started.load(Ordering::SeqCst);
    // A message can reach the mailbox before the passivation request is processed (then it is
    // handled before the stop), so the number of incarnations varies; none may lose a message.
    assert!(started >= 2, "the entity was passivated and started again: {started}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_only_node_reaches_every_entity() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let hosts =
        [start_counter(c.node(0), &probe, settings()).await, start_counter(c.node(1), &probe, settings()).await];
    let proxy = c.node(2).sharding().start_proxy::<Counter>("counter", settings()).await.unwrap();
    assert!(proxy.is_proxy());
    for i in 0..30 {
        proxy.tell(&format!("p{i}"), CounterMsg::Add(i)).unwrap();
    }
    for i in 0..30 {
        assert_eq!(value(&proxy, &format!("p{i}")).await, i);
        let host = where_is(&hosts[0], &format!("p{i}")).await;
        assert_ne!(host, "n3", "a proxy hosts nothing");
    }
    assert!(proxy.region_state().await.unwrap().is_empty());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handler_stops_only_that_entity_and_the_next_message_starts_a_fresh_one() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let r = start_counter(c.node(0), &probe, settings()).await;
    r.tell("a", CounterMsg::Add(3)).unwrap();
    r.tell("b", CounterMsg::Add(4)).unwrap();
    let err = r.ask("a", CounterMsg::Panic).await.unwrap_err();
    assert!(matches!(err, Error::NotDelivered { .. }), "{err}");
    assert_eq!(value(&r, "a").await, 0, "fresh instance");
    assert_eq!(value(&r, "b").await, 4, "other entities unaffected");
    assert_eq!(r.counters().entity_panics, 1);
    c.shutdown().await;
}

/// An entity whose start hook panics for ids starting with "bad".
struct FragileStart;

#[derive(serde::Serialize, serde::Deserialize)]
struct Ping;

impl ddshard::Entity for FragileStart {
    type Message = Ping;
    type Reply = String;
    async fn started(&mut self, ctx: &ddshard::EntityContext) {
        assert!(!ctx.entity_id().starts_with("bad"), "cannot start {}", ctx.entity_id());
    }
    async fn handle(&mut self, _msg: Ping, ctx: &mut ddshard::EntityContext) -> String {
        format!("{} at epoch {}", ctx.entity_id(), ctx.epoch())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_start_hook_fails_the_queued_messages_at_once_without_a_restart_loop() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = c.node(0).sharding().start("fragile", |_: &str| FragileStart, settings()).await.unwrap();
    assert!(r.ask("good-1", Ping).await.unwrap().starts_with("good-1 at epoch "));
    let asks: Vec<_> = (0..5).map(|_| r.ask_with_timeout("bad-1", Ping, Duration::from_secs(20))).collect();
    for result in futures::future::join_all(asks).await {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::NotDelivered { .. }), "{err}");
        // Failed by the hook, not by the 20 s ask timeout (that would be another error).
        assert!(err.to_string().contains("start hook panicked"), "{err}");
    }
    let panics = r.counters().entity_panics;
    assert!((1..=5).contains(&panics), "one panic per start attempt, no spin: {panics}");
    assert_eq!(r.ask("good-2", Ping).await.unwrap().split(' ').next(), Some("good-2"), "the region still serves");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_entity_is_passivated_after_the_idle_timeout_while_a_busy_one_keeps_its_state() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ddshard::ShardingSettings {
        min_nr_of_members: 1,
        passivation: ddshard::sharding::PassivationSettings {
            idle_timeout: Some(Duration::from_millis(600)),
            ..settings().passivation
        },
        ..settings()
    };
    let r = start_counter(c.node(0), &probe, s).await;
    r.ask("idle", CounterMsg::Add(5)).await.unwrap();
    let last_idle_message = tokio::time::Instant::now();
    let mut busy_total = 0;
    // "busy" gets a message every 100 ms; "idle" none, until it is no longer running.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        r.ask("busy", CounterMsg::Add(1)).await.unwrap();
        busy_total += 1;
        let running: BTreeSet<String> = r.region_state().await.unwrap().into_values().flatten().collect();
        assert!(running.contains("busy"), "a busy entity is never passivated");
        if !running.contains("idle") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the idle entity was never passivated");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A lower bound only (never before the timeout), so a slow machine cannot fail it.
    let idle_for = last_idle_message.elapsed();
    assert!(idle_for >= Duration::from_millis(600), "passivated after {idle_for:?}, before the 600 ms timeout");
    assert!(matches!(r.ask("busy", CounterMsg::Get).await.unwrap(), CounterReply::Value(v) if v == busy_total));
    // The next message starts a fresh instance: the passivated one's in-memory state is gone.
    assert!(matches!(r.ask("idle", CounterMsg::Get).await.unwrap(), CounterReply::Value(0)));
    let created = probe.created.lock().unwrap().clone();
    assert_eq!(created.iter().filter(|(id, _)| id == "idle").count(), 2, "{created:?}");
    assert_eq!(created.iter().filter(|(id, _)| id == "busy").count(), 1, "{created:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_to_one_slow_entity_beyond_its_mailbox_capacity_fails_with_mailbox_full() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ddshard::ShardingSettings { min_nr_of_members: 1, entity_mailbox_capacity: 10, ..settings() };
    let r = start_counter(c.node(0), &probe, s).await;
    r.ask("slow", CounterMsg::Get).await.unwrap(); // running
    let busy = {
        let r = r.clone();
        tokio::spawn(async move { r.ask("slow", CounterMsg::SleepMs(1_500)).await })
    };
    // The entity has taken the sleep (its handler counted it): it is busy now.
    eventually(CONVERGE, "the entity is busy", || {
        std::future::ready((probe.handled.load(Ordering::SeqCst) == 2).then_some(()))
    })
    .await;
    let asks = (0..40).map(|_| {
        let r = r.clone();
        async move { r.ask("slow", CounterMsg::Get).await }
    });
    let results = futures::future::join_all(asks).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let full = results
        .iter()
        .filter(|r| matches!(r, Err(Error::MailboxFull { entity_id, capacity: 10 }) if entity_id == "slow"))
        .count();
    assert_eq!(ok + full, 40, "every ask answered or refused with MailboxFull: {results:?}");
    assert!(ok <= 10 && full >= 30, "at most the capacity queued: {ok} answered, {full} refused");
    assert_eq!(r.counters().dropped_mailbox_full, full as u64);
    busy.await.unwrap().unwrap();
    // The entity is fine afterwards.
    r.ask("slow", CounterMsg::Get).await.unwrap();
    c.shutdown().await;
}

/// Records, per sender, whether its numbers arrived in order; counts its own drops.
struct Sequencer {
    last: std::collections::BTreeMap<u32, u64>,
    out_of_order: u64,
    handled: u64,
    drops: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Handlers that have started to work (`WorkMs`), over every instance.
    working: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Drop for Sequencer {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
enum SeqMsg {
    Next {
        sender: u32,
        n: u64,
    },
    /// (messages handled, out of order) by this instance.
    Check,
    /// Keeps the handler busy this long.
    WorkMs(u64),
}

impl ddshard::Entity for Sequencer {
    type Message = SeqMsg;
    type Reply = (u64, u64);
    async fn handle(&mut self, msg: SeqMsg, _ctx: &mut ddshard::EntityContext) -> (u64, u64) {
        match msg {
            SeqMsg::Next { sender, n } => {
                self.handled += 1;
                let last = self.last.entry(sender).or_insert(0);
                if n != *last + 1 {
                    self.out_of_order += 1;
                }
                *last = n;
            }
            SeqMsg::Check => {}
            SeqMsg::WorkMs(ms) => {
                self.working.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(ms)).await
            }
        }
        (self.handled, self.out_of_order)
    }
}

type Counted = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// The region, the count of instances dropped and the count of `WorkMs` handlers started.
async fn start_sequencer(
    node: &ddshard::Node,
    settings: ddshard::ShardingSettings,
) -> (ddshard::ShardRegion<Sequencer>, Counted, Counted) {
    let (drops, working) = (Counted::default(), Counted::default());
    let (d, w) = (drops.clone(), working.clone());
    let make = move |_: &str| Sequencer {
        last: Default::default(),
        out_of_order: 0,
        handled: 0,
        drops: d.clone(),
        working: w.clone(),
    };
    (node.sharding().start("sequencer", make, settings).await.unwrap(), drops, working)
}

/// An entity runs on a task only while it has work and is parked between messages: four
/// senders whose tells keep finding it idle, busy and idle again must see every message
/// handled, each sender's in order, by one and the same instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entity_parked_between_bursts_keeps_its_instance_and_each_senders_order() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ddshard::ShardingSettings { min_nr_of_members: 1, ..settings() };
    let (r, drops, _) = start_sequencer(c.node(0), s).await;
    const PER_SENDER: u64 = 2_000;
    let senders = (0..4u32).map(|sender| {
        let r = r.clone();
        tokio::spawn(async move {
            for n in 1..=PER_SENDER {
                r.tell("seq", SeqMsg::Next { sender, n }).unwrap();
                // Bursts of varying length, then a pause long enough for the entity to park.
                if n % (u64::from(sender) * 7 + 3) == 0 {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
        })
    });
    for s in futures::future::join_all(senders).await {
        s.unwrap();
    }
    let (handled, out_of_order) = eventually(CONVERGE, "every tell handled", || {
        let r = r.clone();
        async move { r.ask("seq", SeqMsg::Check).await.ok().filter(|(h, _)| *h == 4 * PER_SENDER) }
    })
    .await;
    assert_eq!(handled, 4 * PER_SENDER, "one instance handled them all (its count is not reset)");
    assert_eq!(out_of_order, 0, "each sender's messages in order");
    assert_eq!(drops.load(Ordering::SeqCst), 0, "the instance was parked, never dropped");
    c.shutdown().await;
}

/// An entity busy in a handler that outlasts the hand-off's stop timeout is aborted when its
/// shard stops: it is dropped (not leaked with its task), the asks queued behind it fail
/// rather than hang, and the region finishes its graceful shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_entity_past_the_hand_off_stop_timeout_is_dropped_and_the_asks_behind_it_fail() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    // Stop timeout: max(hand-off timeout - 5 s, 1 s) = 1 s.
    let s = ddshard::ShardingSettings { min_nr_of_members: 2, handoff_timeout: Duration::from_secs(3), ..settings() };
    let (r0, drops, working) = start_sequencer(c.node(0), s.clone()).await;
    let (_r1, _, _) = start_sequencer(c.node(1), s).await;
    // An id hosted on node 0.
    let mut id = None;
    for i in 0.. {
        let candidate = format!("busy{i}");
        r0.ask(&candidate, SeqMsg::Check).await.unwrap();
        if r0.region_state().await.unwrap().values().flatten().any(|e| *e == candidate) {
            id = Some(candidate);
            break;
        }
    }
    let id = id.unwrap();
    let busy = {
        let (r, id) = (r0.clone(), id.clone());
        tokio::spawn(async move { r.ask(&id, SeqMsg::WorkMs(120_000)).await })
    };
    eventually(CONVERGE, "the entity is busy in its handler", || {
        std::future::ready((working.load(Ordering::SeqCst) == 1).then_some(()))
    })
    .await;
    let behind = {
        let (r, id) = (r0.clone(), id.clone());
        tokio::spawn(async move { r.ask(&id, SeqMsg::Check).await })
    };
    // Not observable from outside: time for the ask to reach the entity's mailbox. A local
    // ask takes two channel hops (microseconds); 200 ms is a wide margin, not a state wait.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let drops_before = drops.load(Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(20), r0.graceful_shutdown())
        .await
        .expect("the region's graceful shutdown finishes although an entity never yields its handler");
    eventually(CONVERGE, "the busy instance is dropped", || {
        std::future::ready((drops.load(Ordering::SeqCst) > drops_before).then_some(()))
    })
    .await;
    let busy = tokio::time::timeout(Duration::from_secs(10), busy).await.expect("the busy ask ends").unwrap();
    assert!(busy.is_err(), "its handler never finished: {busy:?}");
    let behind = tokio::time::timeout(Duration::from_secs(10), behind).await.expect("the queued ask ends").unwrap();
    assert!(behind.is_err(), "the ask queued behind it fails rather than hangs: {behind:?}");
    c.shutdown().await;
}

/// Once a shard's home is known on both sides, messages between a proxy and the hosting node
/// skip both region tasks: the proxy's handle sends straight to the home's queue and the
/// host's connection reader puts them straight into the running entity's mailbox (its answer
/// completes the ask from the proxy's reader). Every message is still handled once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_between_a_proxy_and_a_running_entity_skip_both_region_tasks_once_the_home_is_known() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let host = start_counter(c.node(0), &probe, settings()).await;
    let proxy = c.node(1).sharding().start_proxy::<Counter>("counter", settings()).await.unwrap();
    assert_eq!(value(&proxy, "fast-1").await, 0, "the first ask learns the home and starts the entity");
    let (sent_before, received_before) = (proxy.counters().remote_sent_direct, host.counters().remote_direct);
    for i in 1..=200 {
        proxy.tell("fast-1", CounterMsg::Add(i)).unwrap();
    }
    assert_eq!(value(&proxy, "fast-1").await, (1..=200).sum::<i64>(), "every tell handled once");
    let sent = proxy.counters().remote_sent_direct - sent_before;
    let received = host.counters().remote_direct - received_before;
    assert_eq!(sent, 201, "every tell and the ask left the proxy without its region task");
    assert_eq!(received, 201, "and reached the entity without the host's region task");
    c.shutdown().await;
}

/// A region that stops fails the asks it still waits for from other nodes at once, rather than
/// leaving their askers to their timeouts (the table of such asks outlives the region task: the
/// handle and the connection's fast path share it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_a_stopping_proxy_still_waits_for_fail_at_once_not_at_their_timeout() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let _host = start_counter(c.node(0), &probe, settings()).await;
    let proxy = c.node(1).sharding().start_proxy::<Counter>("counter", settings()).await.unwrap();
    assert_eq!(value(&proxy, "slow-1").await, 0, "the home is known and the entity runs");
    let sent_before = proxy.counters().remote_sent_direct;
    let asking = {
        let p = proxy.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let r = p.ask_with_timeout("slow-1", CounterMsg::SleepMs(30_000), Duration::from_secs(60)).await;
            (r, started.elapsed())
        })
    };
    eventually(CONVERGE, "the ask sent and waiting", || {
        let sent = proxy.counters().remote_sent_direct;
        std::future::ready((sent > sent_before).then_some(()))
    })
    .await;
    proxy.graceful_shutdown().await;
    let (r, took) = tokio::time::timeout(Duration::from_secs(10), asking)
        .await
        .expect("the ask ends within 10 s of the stop, not at its 60 s timeout")
        .unwrap();
    assert!(matches!(r, Err(Error::ShutDown)), "{r:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    c.shutdown().await;
}

/// Logs a line of the application's own inside `handle`.
struct Greeter;

#[derive(serde::Serialize, serde::Deserialize)]
struct Greet(String);

impl ddshard::Entity for Greeter {
    type Message = Greet;
    type Reply = String;
    async fn handle(&mut self, msg: Greet, _ctx: &mut ddshard::EntityContext) -> String {
        tracing::info!(target: "app", who = %msg.0, "greeting");
        format!("hello {}", msg.0)
    }
}

/// A `Write` into a shared buffer, for a subscriber's output.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 39: the application's own log lines inside `handle` carry the entity's type, id and
/// shard (a span of target `ddshard::entity`), and a filter turns the span off.
#[test]
fn a_log_line_inside_handle_carries_the_entity_type_id_and_shard_unless_filtered_out() {
    let run = |filter: &str| {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_env_filter(filter)
            .with_writer(move || writer.clone())
            .finish();
        // One thread runs the node and the entity, so this thread's subscriber sees the line.
        let _guard = tracing::subscriber::set_default(subscriber);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut c = TestCluster::start(1).await.unwrap();
            c.await_converged(CONVERGE).await;
            let r = c.node(0).sharding().start("greeter", |_: &str| Greeter, settings()).await.unwrap();
            assert_eq!(r.ask("g-7", Greet("ada".into())).await.unwrap(), "hello ada");
            c.shutdown().await;
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines().find(|l| l.contains("greeting")).map(str::to_string).expect("the handler's line was logged")
    };
    let line = run("warn,app=info,ddshard::entity=info");
    let shard = ddshard::sharding::default_shard_id("g-7", settings().number_of_shards);
    assert!(line.contains(&format!("entity{{type=greeter id=g-7 shard={shard}}}")), "{line}");
    assert!(line.contains("who=ada"), "{line}");
    let line = run("warn,app=info,ddshard::entity=off");
    assert!(!line.contains("entity{"), "filtered out: {line}");
}

/// An answer that refuses to encode when its text is `"unencodable"`.
#[derive(serde::Deserialize)]
struct PickyAnswer(String);

impl serde::Serialize for PickyAnswer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == "unencodable" {
            return Err(serde::ser::Error::custom("this answer refuses to encode"));
        }
        s.serialize_newtype_struct("PickyAnswer", &self.0)
    }
}

/// Answers each message with its own text.
#[derive(Default)]
struct Picky;

impl ddshard::Entity for Picky {
    type Message = String;
    type Reply = PickyAnswer;
    async fn handle(&mut self, msg: String, _ctx: &mut ddshard::EntityContext) -> PickyAnswer {
        PickyAnswer(msg)
    }
}

/// The host of an entity cannot encode its answer to a remote ask: the asker hears why at once
/// (a `NotDelivered` naming the codec error), not at its timeout, over links that carry the
/// binary layout (protocol version 4); the entity answers the next ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_ask_whose_answer_does_not_encode_fails_at_once_with_the_reason() {
    let c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let settings = ddshard::ShardingSettings { number_of_shards: 10, ..Default::default() };
    let _host: ddshard::ShardRegion<Picky> =
        c.node(0).sharding().start("picky", |_: &str| Picky, settings.clone()).await.unwrap();
    let proxy: ddshard::ShardRegion<Picky> = c.node(1).sharding().start_proxy("picky", settings).await.unwrap();
    let timeout = Duration::from_secs(10);
    // Both links up (the ask's and the answer's) before the answer that fails.
    eventually(Duration::from_secs(30), "five answers in a row", || async {
        for _ in 0..5 {
            if !matches!(proxy.ask_with_timeout("p-1", "ok".into(), timeout).await, Ok(PickyAnswer(a)) if a == "ok") {
                return None;
            }
        }
        Some(())
    })
    .await;
    let asked = std::time::Instant::now();
    let failed = proxy.ask_with_timeout("p-1", "unencodable".into(), timeout).await;
    match failed {
        Err(Error::NotDelivered { entity_id, reason }) => {
            assert_eq!(entity_id, "p-1");
            assert!(reason.contains("this answer refuses to encode"), "{reason}");
        }
        Err(other) => panic!("expected NotDelivered naming the codec error, got {other:?}"),
        Ok(_) => panic!("an answer that does not encode cannot arrive"),
    }
    assert!(asked.elapsed() < timeout / 2, "heard at once, not at the timeout: {:?}", asked.elapsed());
    let next = proxy.ask_with_timeout("p-1", "still here".into(), timeout).await.expect("the entity answers");
    assert_eq!(next.0, "still here");
}
