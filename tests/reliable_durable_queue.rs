//! The durable producer queue (`ProducerSettings::durable_queue`): a producer whose node
//! crashes is started again with its id on another node and resumes every message it had
//! stored and not had confirmed; each lands exactly once on its durable entity; an older
//! incarnation still running is fenced. Whole nodes in virtual time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::sharding::{Durable, ProducerSettings};
use ddshard::testkit::eventually;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{DurableEntity, EntityContext, Error, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

/// Keeps every value it was sent (a value twice would be an effect twice); takes 20 ms per
/// message, so a stream has unconfirmed messages when its producer's node crashes.
struct Ledger;

#[derive(Default, Serialize, Deserialize)]
struct Applied(Vec<u64>);

#[derive(Serialize, Deserialize)]
enum LedgerMsg {
    Apply(u64),
    Read,
}

impl DurableEntity for Ledger {
    type Message = LedgerMsg;
    type Reply = Vec<u64>;
    type State = Applied;
    async fn handle(&mut self, state: &mut Applied, msg: LedgerMsg, ctx: &mut EntityContext) -> Vec<u64> {
        if let LedgerMsg::Apply(v) = msg {
            tokio::time::sleep(Duration::from_millis(20)).await;
            state.0.push(v);
            ctx.persist();
        }
        state.0.clone()
    }
}

type Region = ShardRegion<Durable<Ledger>>;

const ENTITIES: u64 = 6;

fn durable() -> ProducerSettings {
    ProducerSettings { durable_queue: true, ..ProducerSettings::default() }
}

async fn start(cluster: &VirtualCluster, nodes: usize) -> Vec<Region> {
    let mut regions = Vec::new();
    for i in 0..nodes {
        let start = move |n: ddshard::Node| async move {
            let s = ShardingSettings { number_of_shards: 12, min_nr_of_members: nodes, ..ShardingSettings::default() };
            n.sharding().start_durable("ledger", |_: &str| Ledger, s).await
        };
        regions.push(cluster.on_node(i, start).await.expect("runs").expect("the region starts"));
    }
    regions
}

fn stored_before_len(stored: &Mutex<Vec<u64>>) -> usize {
    stored.lock().unwrap().len()
}

/// Every entity's applied values, read through `region` on node `i`.
async fn ledgers(cluster: &VirtualCluster, i: usize, region: &Region) -> Vec<Vec<u64>> {
    let region = region.clone();
    cluster
        .on_node(i, move |_| async move {
            let mut all = Vec::new();
            for e in 0..ENTITIES {
                let id = format!("l{e}");
                let read = eventually(Duration::from_secs(60), "a ledger is read", || async {
                    region.ask_with_timeout(&id, LedgerMsg::Read, Duration::from_secs(5)).await.ok()
                })
                .await;
                all.push(read);
            }
            all
        })
        .await
        .expect("the node runs")
}

#[test]
fn a_producer_restarted_on_another_node_resumes_what_it_stored_and_each_message_lands_once() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = start(&cluster, 3).await;
        // Values whose `send` returned (stored), and every value offered.
        let stored = Arc::new(Mutex::new(Vec::new()));
        let offered = Arc::new(Mutex::new(Vec::new()));
        let (region, s, o) = (regions[2].clone(), stored.clone(), offered.clone());
        let sending = cluster.on_node(2, move |_| async move {
            let producer = region.producer("payments", durable()).await?;
            for v in 1..=300u64 {
                o.lock().unwrap().push(v);
                producer.send(&format!("l{}", v % ENTITIES), LedgerMsg::Apply(v)).await?;
                s.lock().unwrap().push(v);
            }
            Ok::<_, Error>(())
        });
        // The producer's node crashes while its entities are far behind (20 ms a message).
        let crash = async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            cluster.crash(2).await;
        };
        let (sent, ()) = futures::future::join(sending, crash).await;
        assert!(sent.is_none(), "the sender died with its node");
        let stored_before = stored.lock().unwrap().clone();
        assert!(stored_before.len() > 50, "the crash came mid-stream: {} stored", stored_before.len());
        let region = regions[0].clone();
        let resumed = cluster
            .on_node(0, move |n| async move {
                n.down(&VirtualCluster::node_id(2)).await?;
                let started = tokio::time::Instant::now();
                let producer = region.producer("payments", durable()).await?;
                let claimed = started.elapsed();
                let resumed = producer.stats();
                // Nothing new is sent: what it resumed drains.
                eventually(Duration::from_secs(120), "the resumed messages are confirmed", || {
                    let p = producer.clone();
                    async move { (p.stats().unconfirmed == 0).then_some(()) }
                })
                .await;
                Ok::<_, Error>((claimed, resumed, producer.stats()))
            })
            .await
            .unwrap()
            .unwrap();
        let (claimed, resumed, drained) = resumed;
        println!(
            "stored before the crash: {}; resumed {} unconfirmed, claimed in {claimed:?} after the down",
            stored_before_len(&stored),
            resumed.unconfirmed
        );
        assert!(claimed < Duration::from_secs(5), "resumed {claimed:?} after the down");
        assert!(resumed.unconfirmed > 0, "the crash left stored messages unconfirmed: {resumed:?}");
        assert_eq!(drained.confirmed as usize, resumed.unconfirmed, "every resumed message confirmed");
        let offered = offered.lock().unwrap().clone();
        let mut applied: Vec<u64> = ledgers(&cluster, 0, &regions[0]).await.into_iter().flatten().collect();
        let all = applied.len();
        applied.sort_unstable();
        applied.dedup();
        assert_eq!(applied.len(), all, "no message applied twice");
        for v in &stored_before {
            assert!(applied.binary_search(v).is_ok(), "stored message {v} was lost");
        }
        assert!(applied.iter().all(|v| offered.contains(v)), "nothing applied that was not offered");
    });
}

#[test]
fn a_producer_dropped_once_its_messages_were_confirmed_leaves_none_for_its_next_incarnation_to_send_again() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = start(&cluster, 3).await;
        let region = regions[0].clone();
        let (first, next) = cluster
            .on_node(0, move |_| async move {
                let producer = region.producer("settled", durable()).await?;
                let mut confirmations = Vec::new();
                for v in 1..=2 * ENTITIES {
                    confirmations.push(producer.send(&format!("l{}", v % ENTITIES), LedgerMsg::Apply(v)).await?);
                }
                for c in confirmations {
                    c.await?;
                }
                // Dropped at once: the confirmed messages' entries still linger (an entity's next
                // message would have replaced its entry); the stopping producer deletes them.
                let first = producer.stats();
                drop(producer);
                // Nothing outside shows the stopping producer's deletions ending, and starting
                // the next producer earlier would fence them: wait out the bound they are given
                // (2 s, `CLOSING_BUDGET`), in virtual time.
                tokio::time::sleep(Duration::from_secs(3)).await;
                let next = region.producer("settled", durable()).await?;
                Ok::<_, Error>((first, next.stats()))
            })
            .await
            .expect("the node runs")
            .expect("both producers start");
        assert_eq!(first.confirmed, 2 * ENTITIES, "{first:?}");
        assert_eq!(next.unconfirmed, 0, "nothing left to send again: {next:?}");
        let applied: Vec<u64> = ledgers(&cluster, 0, &regions[0]).await.into_iter().flatten().collect();
        assert_eq!(applied.len() as u64, 2 * ENTITIES, "each message applied once: {applied:?}");
    });
}

#[test]
fn a_second_producer_with_one_id_fences_the_first_which_fails_with_a_typed_error() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = start(&cluster, 3).await;
        let region = regions[0].clone();
        let first = cluster
            .on_node(0, move |_| async move {
                let p = region.producer("orders", durable()).await?;
                p.send("l1", LedgerMsg::Apply(1)).await?.await?;
                Ok::<_, Error>(p)
            })
            .await
            .unwrap()
            .unwrap();
        let region = regions[1].clone();
        let second = cluster
            .on_node(1, move |_| async move {
                let p = region.producer("orders", durable()).await?;
                p.send("l1", LedgerMsg::Apply(2)).await?.await?;
                Ok::<_, Error>(p)
            })
            .await
            .unwrap()
            .unwrap();
        let first_again =
            cluster.on_node(0, move |_| async move { first.send("l1", LedgerMsg::Apply(3)).await.map(|_| ()) });
        match first_again.await.unwrap() {
            Err(Error::ProducerFenced { producer_id, epoch, fence }) => {
                assert_eq!(producer_id, "orders");
                assert!(fence > epoch, "{epoch} < {fence}");
            }
            other => panic!("the older producer must be fenced: {other:?}"),
        }
        // The newer goes on; the same node cannot start the id twice.
        let region = regions[1].clone();
        let after = cluster
            .on_node(1, move |_| async move {
                second.send("l1", LedgerMsg::Apply(4)).await?.await?;
                Ok::<_, Error>(region.producer("orders", durable()).await.map(|_| ()))
            })
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(after, Err(Error::BadRequest(_))), "{after:?}");
        let applied = ledgers(&cluster, 1, &regions[1]).await;
        assert_eq!(applied[1], vec![1, 2, 4], "the fenced producer's message was never stored");
    });
}
