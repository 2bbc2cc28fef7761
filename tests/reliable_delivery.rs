//! Reliable delivery (`ShardRegion::producer`): every stored message is confirmed once its
//! entity handled it, in order per entity, through crashes of the entity's node; durable
//! entities apply each message once; flow control, budgets and dead letters. Whole nodes in
//! virtual time; what the entities handled is recorded in a log all nodes share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::sharding::{Confirmation, Durable, Producer, ProducerSettings, ProducerStats};
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{DurableEntity, Entity, EntityContext, Error, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

/// What each entity handled, in order: (value, flagged as a redelivery).
type Log = Arc<Mutex<HashMap<String, Vec<(u64, bool)>>>>;

/// Records every value it handles, taking 2 ms for each; panics on `u64::MAX`.
struct Recorder {
    log: Log,
}

impl Entity for Recorder {
    type Message = u64;
    type Reply = ();
    async fn handle(&mut self, value: u64, ctx: &mut EntityContext) {
        if value == u64::MAX {
            panic!("poison");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        let redelivery = ctx.delivery().is_some_and(|d| d.redelivery);
        self.log.lock().unwrap().entry(ctx.entity_id().to_string()).or_default().push((value, redelivery));
    }
}

/// A durable sum: adds every value it handles (`0` only reads it).
struct Sum;

#[derive(Default, Serialize, Deserialize)]
struct Total(u64);

impl DurableEntity for Sum {
    type Message = u64;
    type Reply = u64;
    type State = Total;
    async fn handle(&mut self, state: &mut Total, value: u64, ctx: &mut EntityContext) -> u64 {
        if value > 0 {
            state.0 += value;
            ctx.persist();
        }
        state.0
    }
}

fn settings(min_members: usize) -> ShardingSettings {
    ShardingSettings { number_of_shards: 12, min_nr_of_members: min_members, ..ShardingSettings::default() }
}

async fn start_recorders(cluster: &VirtualCluster, nodes: usize, log: &Log) -> Vec<ShardRegion<Recorder>> {
    let mut regions = Vec::new();
    for i in 0..nodes {
        let log = log.clone();
        let start = move |n: ddshard::Node| async move {
            n.sharding().start("rec", move |_: &str| Recorder { log: log.clone() }, settings(nodes)).await
        };
        regions.push(cluster.on_node(i, start).await.expect("runs").expect("the region starts"));
    }
    regions
}

async fn start_sums(cluster: &VirtualCluster, nodes: usize) -> Vec<ShardRegion<Durable<Sum>>> {
    let mut regions = Vec::new();
    for i in 0..nodes {
        let start = move |n: ddshard::Node| async move {
            n.sharding().start_durable("sum", |_: &str| Sum, settings(nodes)).await
        };
        regions.push(cluster.on_node(i, start).await.expect("runs").expect("the region starts"));
    }
    regions
}

/// Sends `values` to each of `entities` (interleaved), storing each, and returns the
/// confirmations.
async fn send_all<E: Entity<Message = u64>>(
    producer: &Producer<E>,
    entities: &[String],
    values: impl Iterator<Item = u64> + Clone,
) -> Vec<Confirmation> {
    let mut confirmations = Vec::new();
    for v in values {
        for e in entities {
            confirmations.push(producer.send(e, v).await.expect("stored"));
        }
    }
    confirmations
}

/// Checks one entity's log: every value of `1..=n` handled, none skipped ahead of the next
/// unhandled one, and every step back a flagged redelivery.
fn check_in_order_at_least_once(id: &str, log: &[(u64, bool)], n: u64) {
    let mut next = 1;
    for (i, &(v, redelivery)) in log.iter().enumerate() {
        assert!(v <= next, "{id}: {v} handled before {next} (log {log:?})");
        if v < next {
            assert!(redelivery, "{id}: {v} handled again at {i} without the redelivery flag (log {log:?})");
        } else {
            next += 1;
        }
    }
    assert_eq!(next, n + 1, "{id}: not every message was handled (log {log:?})");
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("e{i}")).collect()
}

#[test]
fn every_stored_message_is_confirmed_after_its_entity_handled_it_once_in_order() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let regions = start_recorders(&cluster, 3, &log).await;
        let region = regions[0].clone();
        let entities = ids(20);
        let confirmed = cluster
            .on_node(0, move |_| async move {
                let producer = region.producer("orders", ProducerSettings::default()).await?;
                let confirmations = send_all(&producer, &entities, 1..=25).await;
                let seqs: Vec<u64> = confirmations.iter().take(3).map(Confirmation::seq).collect();
                for c in confirmations {
                    c.await?;
                }
                Ok::<_, Error>((seqs, producer.stats()))
            })
            .await
            .unwrap()
            .unwrap();
        let (seqs, stats) = confirmed;
        assert_eq!(seqs, [1, 1, 1], "numbered per entity");
        assert_eq!((stats.stored, stats.confirmed, stats.unconfirmed, stats.entities), (500, 500, 0, 0));
        assert_eq!(
            stats.resent, 20,
            "nothing was lost: only each entity's first message went twice, to learn of its incarnation"
        );
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 20);
        for (id, handled) in log.iter() {
            assert_eq!(handled.iter().map(|(v, _)| *v).collect::<Vec<_>>(), (1..=25).collect::<Vec<_>>(), "{id}");
        }
    });
}

/// Sends `1..=5` to every entity and waits for their confirmations (so every entity runs),
/// then `6..=last` while the node hosting most of them (never node 0, the producer's) crashes
/// 20 ms in and is downed 300 ms in; returns the producer's counts once every message is
/// confirmed.
async fn crash_mid_stream<E: Entity<Message = u64>>(
    cluster: &VirtualCluster,
    region: &ShardRegion<E>,
    entities: &[String],
    settings: ProducerSettings,
    last: u64,
) -> ProducerStats {
    let (r, e) = (region.clone(), entities.to_vec());
    let producer = cluster
        .on_node(0, move |_| async move {
            let producer = r.producer("orders", settings).await?;
            for c in send_all(&producer, &e, 1..=5).await {
                c.await?;
            }
            Ok::<_, Error>(producer)
        })
        .await
        .unwrap()
        .unwrap();
    let mut hosted = vec![0usize; cluster.len()];
    for id in entities {
        hosted[home_of(cluster, region, id).await] += 1;
    }
    let victim = (1..cluster.len()).max_by_key(|i| hosted[*i]).unwrap();
    assert!(hosted[victim] > 0, "the crash must hit entities: {hosted:?}");
    let (victim_id, e) = (VirtualCluster::node_id(victim), entities.to_vec());
    let sending = cluster.on_node(0, move |n| async move {
        // Downed meanwhile: sends to its entities wait for their window until then.
        let down = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            n.down(&victim_id).await
        });
        let confirmations = send_all(&producer, &e, 6..=last).await;
        down.await.expect("the down task")?;
        for c in confirmations {
            c.await?;
        }
        Ok::<_, Error>(producer.stats())
    });
    let crash = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        cluster.crash(victim).await;
    };
    futures::future::join(sending, crash).await.0.unwrap().unwrap()
}

/// The index of the node hosting `entity_id`.
async fn home_of<E: Entity>(cluster: &VirtualCluster, region: &ShardRegion<E>, entity_id: &str) -> usize {
    let (region, id) = (region.clone(), entity_id.to_string());
    let home = cluster.on_node(0, move |_| async move { region.erased().locate(&id).await }).await.unwrap().unwrap();
    let node = home.home.expect("a home").split('#').next().unwrap().to_string();
    (0..cluster.len()).find(|i| VirtualCluster::node_id(*i) == node).expect("a node of the cluster")
}

#[test]
fn a_crash_of_the_entitys_node_mid_stream_loses_no_stored_message_and_keeps_the_order() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let regions = start_recorders(&cluster, 3, &log).await;
        let entities = ids(12);
        let stats = crash_mid_stream(&cluster, &regions[0], &entities, ProducerSettings::default(), 40).await;
        assert_eq!((stats.stored, stats.confirmed), (480, 480));
        assert!(stats.resent > 0, "the crash must make the producer send again: {stats:?}");
        let log = log.lock().unwrap();
        for id in &entities {
            check_in_order_at_least_once(id, &log[id], 40);
        }
    });
}

#[test]
fn a_durable_entity_applies_each_message_once_across_crashes_and_redeliveries() {
    VirtualRun::new(3).commit_latency(Duration::from_millis(20)).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = start_sums(&cluster, 3).await;
        let entities = ids(12);
        // A short delivery timeout: answers slower than it (a commit takes 20 ms) are sent
        // again, and must not be applied twice.
        let settings = ProducerSettings { delivery_timeout: Duration::from_millis(50), ..Default::default() };
        let stats = crash_mid_stream(&cluster, &regions[0], &entities, settings, 60).await;
        assert_eq!(stats.confirmed, 720);
        assert!(stats.resent > 0, "the test must make the producer send again: {stats:?}");
        let region = regions[0].clone();
        let totals = cluster
            .on_node(0, move |_| async move {
                let mut totals = Vec::new();
                for e in &entities {
                    totals.push(region.ask(e, 0).await);
                }
                totals
            })
            .await
            .unwrap();
        let expected: u64 = (1..=60).sum();
        for (i, total) in totals.into_iter().enumerate() {
            assert_eq!(total.unwrap(), expected, "e{i}: each message's effect exactly once");
        }
    });
}

#[test]
fn a_message_its_entity_keeps_panicking_on_becomes_a_dead_letter_and_the_stream_goes_on() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let regions = start_recorders(&cluster, 2, &log).await;
        let region = regions[1].clone();
        let outcome = cluster
            .on_node(1, move |_| async move {
                let settings = ProducerSettings {
                    max_redeliveries: 2,
                    resend_backoff_min: Duration::from_millis(10),
                    ..Default::default()
                };
                let producer = region.producer("p", settings).await?;
                let letters = Arc::new(Mutex::new(Vec::new()));
                let seen = letters.clone();
                producer.on_dead_letter(move |d| seen.lock().unwrap().push((d.entity_id, d.seq, d.message, d.reason)));
                let before = producer.send("x", 1).await?;
                let poison = producer.send("x", u64::MAX).await?;
                let after = producer.send("x", 2).await?;
                let results = (before.await, poison.await, after.await);
                let letters = letters.lock().unwrap().clone();
                Ok::<_, Error>((results, letters, producer.stats()))
            })
            .await
            .unwrap()
            .unwrap();
        let ((before, poison, after), letters, stats) = outcome;
        assert!(before.is_ok() && after.is_ok(), "{before:?} {after:?}");
        match poison {
            Err(Error::DeadLettered { entity_id, seq: 2, reason, .. }) => {
                assert_eq!(entity_id, "x");
                assert!(reason.contains("poison"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(letters.len(), 1);
        assert_eq!((letters[0].0.as_str(), letters[0].1, letters[0].2), ("x", 2, u64::MAX));
        assert_eq!(stats.dead_lettered, 1);
        let log = log.lock().unwrap();
        assert_eq!(
            log["x"].iter().map(|(v, _)| *v).collect::<Vec<_>>(),
            [1, 2],
            "handled once each, the poison skipped"
        );
    });
}

/// Holds every message until the gate opens.
struct Slow {
    gate: Arc<tokio::sync::Semaphore>,
}

impl Entity for Slow {
    type Message = u64;
    type Reply = ();
    async fn handle(&mut self, _value: u64, _ctx: &mut EntityContext) {
        self.gate.acquire().await.expect("open").forget();
    }
}

#[test]
fn send_waits_for_the_entitys_window_and_a_send_dropped_while_waiting_stores_nothing() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let outcome = cluster
            .on_node(0, move |n| async move {
                let gate = Arc::new(tokio::sync::Semaphore::new(0));
                let g = gate.clone();
                let region = n.sharding().start("slow", move |_: &str| Slow { gate: g.clone() }, settings(1)).await?;
                let settings = ProducerSettings { window: 2, ..Default::default() };
                let producer = region.producer("p", settings).await?;
                let first = producer.send("s", 1).await?;
                let second = producer.send("s", 2).await?;
                let third = tokio::time::timeout(Duration::from_secs(1), producer.send("s", 3)).await;
                let waited = producer.stats();
                // Another entity has room of its own.
                let other = producer.send("t", 1).await?;
                // One message at a time: the stream keeps its unconfirmed second message.
                gate.add_permits(1);
                first.await?;
                let fourth = producer.send("s", 4).await?;
                assert_eq!(fourth.seq(), 3, "the dropped send took no number");
                gate.add_permits(3);
                second.await?;
                fourth.await?;
                other.await?;
                Ok::<_, Error>((third.is_err(), waited))
            })
            .await
            .unwrap()
            .unwrap();
        let (third_timed_out, waited) = outcome;
        assert!(third_timed_out, "the third send waited for the window");
        assert_eq!((waited.stored, waited.demand_waits), (2, 1));
    });
}

#[test]
fn bad_sends_fail_at_once_with_typed_errors_and_store_nothing() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let regions = start_recorders(&cluster, 1, &log).await;
        let region = regions[0].clone();
        let errors = cluster
            .on_node(0, move |_| async move {
                let settings = ProducerSettings { max_queued_bytes: 20, ..Default::default() };
                let producer = region.producer("p", settings).await?;
                let long_id = "x".repeat(10_000);
                let too_long = producer.send(&long_id, 1).await.unwrap_err();
                let empty = producer.send("", 1).await.unwrap_err();
                let mut stored = 0u64;
                let full = loop {
                    match producer.send("a", stored + 1_000_000).await {
                        Ok(_) => stored += 1,
                        Err(e) => break e,
                    }
                };
                let bad_id = region.producer("", ProducerSettings::default()).await.unwrap_err();
                let bad_settings =
                    region.producer("q", ProducerSettings { window: 0, ..Default::default() }).await.unwrap_err();
                Ok::<_, Error>((too_long, empty, stored, full, bad_id, bad_settings, producer.stats()))
            })
            .await
            .unwrap()
            .unwrap();
        let (too_long, empty, stored, full, bad_id, bad_settings, stats) = errors;
        assert!(matches!(too_long, Error::EntityIdTooLong { .. }), "{too_long:?}");
        assert!(matches!(empty, Error::EmptyEntityId), "{empty:?}");
        assert!(matches!(full, Error::ProducerQueueFull { max_queued_bytes: 20, .. }), "{full:?}");
        assert!(full.is_retryable());
        assert_eq!(stats.stored, stored);
        assert!(matches!(bad_id, Error::BadRequest(_)), "{bad_id:?}");
        assert!(matches!(bad_settings, Error::Config(_)), "{bad_settings:?}");
    });
}

#[test]
fn a_restarted_producer_starts_new_streams_its_entities_take_from_the_first_message() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = start_sums(&cluster, 2).await;
        let region = regions[1].clone();
        let total = cluster
            .on_node(1, move |_| async move {
                for round in 0..3 {
                    let producer = region.producer("same-id", ProducerSettings::default()).await?;
                    for v in 1..=5 {
                        producer.send("acc", v + round * 100).await?.await?;
                    }
                    drop(producer);
                }
                region.ask("acc", 0).await
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(total, 15 + 515 + 1015, "each incarnation's messages applied once, none taken for a duplicate");
    });
}

/// Simulation seed 200000001 of `reliable-durable`, on whole nodes: a durable entity's write
/// that no majority acknowledged stays on its node's replica, and the next incarnation reads
/// the marks it carried. A re-sent copy of that message is then a duplicate by those marks —
/// but they may still be lost (a newer home of the shard would claim from a majority without
/// them), so its producer must not hear it confirmed until a write of them is acknowledged.
#[test]
fn a_duplicate_by_marks_no_majority_holds_is_confirmed_only_once_a_write_of_them_is_acknowledged() {
    VirtualRun::new(2)
        // No downing during the cut: the test is about writes that cannot reach a majority.
        .configure(|_, c| c.membership.stable_after = Duration::from_secs(3_600))
        .run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            // The type runs on n1 only, so every shard is there; n2 holds replicas.
            let start =
                |n: ddshard::Node| async move { n.sharding().start_durable("sum", |_: &str| Sum, settings(1)).await };
            let region = cluster.on_node(0, start).await.unwrap().unwrap();
            let settings = ProducerSettings { resend_backoff_max: Duration::from_millis(500), ..Default::default() };
            let r = region.clone();
            let producer =
                cluster.on_node(0, move |_| async move { r.producer("p", settings).await }).await.unwrap().unwrap();
            let p = producer.clone();
            cluster.on_node(0, move |_| async move { p.send("e", 1).await?.await }).await.unwrap().unwrap();
            // Node-to-node messages cut, gossip flowing: n1's writes reach no majority. The
            // handler adds 2, its write fails and ends the incarnation; the next one reads the
            // sum and marks from n1's replica and is sent 2 again.
            let n1 = VirtualCluster::node_id(0);
            let n2 = VirtualCluster::node_id(1);
            cluster.injector().cut_messaging(&[&n1], &[&n2]);
            let p = producer.clone();
            let confirmation = cluster.on_node(0, move |_| async move { p.send("e", 2).await }).await.unwrap().unwrap();
            let (confirmation, early) = cluster
                .on_node(0, move |_| async move {
                    let mut confirmation = confirmation;
                    let early = tokio::time::timeout(Duration::from_secs(15), &mut confirmation).await;
                    (confirmation, early.is_ok())
                })
                .await
                .unwrap();
            let resent = producer.stats().resent;
            assert!(!early, "confirmed while no majority held the marks that call it a duplicate");
            assert!(resent >= 3, "the message went again and again during the cut: {resent}");
            cluster.injector().heal_all();
            let r = region.clone();
            let total = cluster
                .on_node(0, move |_| async move {
                    confirmation.await?;
                    r.ask("e", 0).await
                })
                .await
                .unwrap()
                .unwrap();
            assert_eq!(total, 3, "2 applied once");
        });
}

/// What an [`Approver`] is told: a job (sent reliably), or a plain message about its holds.
#[derive(Debug, Serialize, Deserialize)]
enum Step {
    Job(u64),
    /// Gives every confirmation it holds; answers how many.
    Approve,
    /// Drops what it holds unconfirmed.
    Forget,
    /// Answers how many confirmations it holds (a durable one: its total).
    Count,
    /// Answers how many confirmations it holds.
    Held,
    Passivate,
}

/// Holds the confirmation of every job its entity id handles for the first time (by any
/// incarnation) until approved.
struct Approver {
    log: Log,
    held: Vec<ddshard::sharding::DeferredConfirm>,
}

impl Entity for Approver {
    type Message = Step;
    type Reply = u64;
    async fn handle(&mut self, step: Step, ctx: &mut EntityContext) -> u64 {
        match step {
            Step::Job(v) => {
                let redelivery = ctx.delivery().is_some_and(|d| d.redelivery);
                let mut log = self.log.lock().unwrap();
                let handled = log.entry(ctx.entity_id().to_string()).or_default();
                let first_time = !handled.iter().any(|(h, _)| *h == v);
                handled.push((v, redelivery));
                drop(log);
                if first_time {
                    let held = ctx.confirm_later().expect("a reliable delivery's handler holds its confirmation");
                    assert_eq!(held.delivery().seq, v, "jobs are numbered as sent");
                    assert!(ctx.confirm_later().is_none(), "once per handler");
                    self.held.push(held);
                }
                0
            }
            Step::Approve => {
                let n = self.held.len() as u64;
                for held in self.held.drain(..) {
                    assert!(ctx.confirm(held), "its own incarnation's");
                }
                n
            }
            Step::Forget => {
                self.held.clear();
                0
            }
            Step::Count | Step::Held => {
                assert!(ctx.confirm_later().is_none(), "a plain message has nothing to hold");
                self.held.len() as u64
            }
            Step::Passivate => {
                ctx.passivate();
                0
            }
        }
    }
}

async fn start_approvers(cluster: &VirtualCluster, log: &Log) -> Vec<ShardRegion<Approver>> {
    let mut regions = Vec::new();
    for i in 0..cluster.len() {
        let (log, nodes) = (log.clone(), cluster.len());
        let start = move |n: ddshard::Node| async move {
            n.sharding()
                .start("approver", move |_: &str| Approver { log: log.clone(), held: Vec::new() }, settings(nodes))
                .await
        };
        regions.push(cluster.on_node(i, start).await.expect("runs").expect("the region starts"));
    }
    regions
}

/// Waits until an incarnation of entity `id` other than `not_of` holds `n` confirmations,
/// polling with a deadline (virtual time); returns that incarnation's number. (`Step::Held`
/// answers `incarnation × 1,000 + confirmations held`.)
async fn holds<E: Entity<Message = Step, Reply = u64>>(
    r: &ShardRegion<E>,
    id: &str,
    n: u64,
    not_of: Option<u64>,
) -> Result<u64, Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let answer = r.ask(id, Step::Held).await?;
        if answer % 1000 == n && Some(answer / 1000) != not_of {
            return Ok(answer / 1000);
        }
        assert!(tokio::time::Instant::now() < deadline, "{id} never held {n} confirmations");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `c` is still unresolved after `wait`.
async fn still_open(c: &mut Confirmation, wait: Duration) -> bool {
    tokio::time::timeout(wait, c).await.is_err()
}

#[test]
fn a_held_confirmation_is_given_only_by_a_later_handler_and_its_stream_waits_meanwhile() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let regions = start_approvers(&cluster, &log).await;
        let region = regions[0].clone();
        let (r, l) = (region.clone(), log.clone());
        cluster
            .on_node(0, move |_| async move {
                let producer = r.producer("jobs", ProducerSettings::default()).await?;
                let mut c: Vec<Confirmation> = Vec::new();
                for v in 1..=3 {
                    c.push(producer.send("e", Step::Job(v)).await?);
                }
                // Held past several delivery timeouts: the producer sends 1 again meanwhile,
                // and the hold answers the newest copy.
                assert!(still_open(&mut c[0], Duration::from_secs(30)).await, "held: not confirmed");
                assert!(still_open(&mut c[1], Duration::ZERO).await);
                // (An entity's first message is flagged: it went first as the probe that learns
                // of the entity's incarnation.)
                assert_eq!(l.lock().unwrap()["e"], [(1, true)], "2 waits for 1, and 1 is handled once");
                assert_eq!(r.ask("e", Step::Count).await?, 1, "plain messages are handled meanwhile");
                assert_eq!(r.ask("e", Step::Approve).await?, 1);
                let mut c = c.into_iter();
                c.next().unwrap().await?;
                let mut second = c.next().unwrap();
                let third = c.next().unwrap();
                // 2 comes at once once 1 is confirmed, and is held in turn.
                assert!(still_open(&mut second, Duration::from_secs(3)).await);
                // 2 was sent before (and sent back, as 1 was held): flagged, though never handled.
                assert_eq!(l.lock().unwrap()["e"], [(1, true), (2, true)]);
                assert_eq!(r.ask("e", Step::Approve).await?, 1);
                second.await?;
                holds(&r, "e", 1, None).await?;
                assert_eq!(r.ask("e", Step::Approve).await?, 1);
                third.await?;
                let stats = producer.stats();
                assert_eq!((stats.confirmed, stats.unconfirmed), (3, 0));
                Ok::<_, Error>(())
            })
            .await
            .unwrap()
            .unwrap();
        let values: Vec<u64> = log.lock().unwrap()["e"].iter().map(|(v, _)| *v).collect();
        assert_eq!(values, [1, 2, 3], "each once, in order");
        let held: u64 = regions.iter().map(|r| r.counters().deliveries_held).sum();
        assert_eq!(held, 3, "each held once (a held message sent again is not handled again)");
    });
}

#[test]
fn a_held_confirmation_dropped_or_ended_with_its_incarnation_delivers_the_message_again() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let region = start_approvers(&cluster, &log).await.remove(0);
        let r = region.clone();
        cluster
            .on_node(0, move |_| async move {
                let producer = r.producer("jobs", ProducerSettings::default()).await?;
                let mut dropped = producer.send("dropped", Step::Job(1)).await?;
                let mut passivated = producer.send("passivated", Step::Job(1)).await?;
                assert!(still_open(&mut dropped, Duration::from_secs(2)).await);
                assert!(still_open(&mut passivated, Duration::ZERO).await);
                // Let go unconfirmed: handled again (a redelivery, which it does not hold).
                r.ask("dropped", Step::Forget).await?;
                dropped.await?;
                r.ask("passivated", Step::Passivate).await?;
                passivated.await?;
                assert_eq!(producer.stats().confirmed, 2);
                Ok::<_, Error>(())
            })
            .await
            .unwrap()
            .unwrap();
        let log = log.lock().unwrap();
        let values = |id: &str| log[id].iter().map(|(v, _)| *v).collect::<Vec<_>>();
        assert_eq!((values("dropped"), log["dropped"][1]), (vec![1, 1], (1, true)), "again, flagged");
        assert_eq!((values("passivated"), log["passivated"][1]), (vec![1, 1], (1, true)));
    });
}

/// A durable total whose jobs count once approved: a job's confirmation is held until then,
/// and its value is added by the handler that confirms it.
struct DurableApprover {
    held: Vec<(u64, ddshard::sharding::DeferredConfirm)>,
    /// This incarnation's number, from 1.
    incarnation: u64,
}

/// Incarnations of [`DurableApprover`] made so far.
static APPROVERS_MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl DurableEntity for DurableApprover {
    type Message = Step;
    type Reply = u64;
    type State = Total;
    async fn handle(&mut self, state: &mut Total, step: Step, ctx: &mut EntityContext) -> u64 {
        match step {
            Step::Job(v) => self.held.push((v, ctx.confirm_later().expect("a reliable delivery"))),
            Step::Approve => {
                for (v, held) in self.held.drain(..) {
                    state.0 += v;
                    assert!(ctx.confirm(held));
                }
                // No `persist`: the confirm writes the state with it.
            }
            Step::Forget => self.held.clear(),
            Step::Count => {}
            Step::Held => return self.incarnation * 1000 + self.held.len() as u64,
            Step::Passivate => ctx.passivate(),
        }
        state.0
    }
}

#[test]
fn a_durable_entity_writes_a_held_message_s_effect_with_its_confirmation_once_across_incarnations() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let mut regions = Vec::new();
        for i in 0..3 {
            let start = move |n: ddshard::Node| async move {
                n.sharding()
                    .start_durable(
                        "approved",
                        |_: &str| DurableApprover {
                            held: Vec::new(),
                            incarnation: APPROVERS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
                        },
                        settings(3),
                    )
                    .await
            };
            regions.push(cluster.on_node(i, start).await.expect("runs").expect("the region starts"));
        }
        let region = regions.remove(0);
        let r = region.clone();
        let total = cluster
            .on_node(0, move |_| async move {
                let producer = r.producer("jobs", ProducerSettings::default()).await?;
                let first = producer.send("t", Step::Job(5)).await?;
                let mut second = producer.send("t", Step::Job(7)).await?;
                let first_incarnation = holds(&r, "t", 1, None).await?;
                // The incarnation ends with 5 held: its next one gets 5 again and holds it.
                r.ask("t", Step::Passivate).await?;
                holds(&r, "t", 1, Some(first_incarnation)).await?;
                assert_eq!(r.ask("t", Step::Count).await?, 0, "nothing counted before approval");
                assert_eq!(r.ask("t", Step::Approve).await?, 5);
                first.await?;
                assert!(still_open(&mut second, Duration::from_secs(2)).await, "7 is held in turn");
                assert_eq!(r.ask("t", Step::Approve).await?, 12);
                second.await?;
                // A new incarnation reads the total and the marks written with it: nothing
                // comes again, nothing counts twice.
                let second_incarnation = holds(&r, "t", 0, None).await?;
                r.ask("t", Step::Passivate).await?;
                let third = producer.send("t", Step::Job(1)).await?;
                holds(&r, "t", 1, Some(second_incarnation)).await?;
                assert_eq!(r.ask("t", Step::Approve).await?, 13);
                third.await?;
                assert_eq!(producer.stats().confirmed, 3);
                r.ask("t", Step::Count).await
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(total, 13);
    });
}
