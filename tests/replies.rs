//! Replies: deferred (`EntityContext::reply_later`: an entity answers an ask after other
//! messages, from a task that asks another entity, or not at all — dropped, the ask fails at
//! once) and typed (`Request`: a reply type per message). Whole nodes in virtual time.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ddshard::sharding::DeferredReply;
use ddshard::testkit::eventually;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{DurableEntity, Entity, EntityContext, Error, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

const ASK: Duration = Duration::from_secs(20);

#[derive(Serialize, Deserialize)]
enum Cmd {
    /// Answered when a `Release` comes.
    Wait,
    /// Answered at once.
    Ping,
    /// Answers every waiting ask with "released", and itself with how many there were.
    Release,
    /// Answered by entity `0`'s answer to a `Ping`, asked from a task.
    Forward(String),
    /// Takes the reply and drops it.
    Drop,
    /// Says what `reply_later` gave: a second take, and a take of another type.
    Probe,
    /// How many asks wait for a `Release`.
    Waiting,
}

#[derive(Default)]
struct Gate {
    waiting: Vec<DeferredReply<String>>,
    peers: Arc<OnceLock<ShardRegion<Gate>>>,
}

impl Entity for Gate {
    type Message = Cmd;
    type Reply = String;
    async fn handle(&mut self, msg: Cmd, ctx: &mut EntityContext) -> String {
        match msg {
            Cmd::Wait => self.waiting.extend(ctx.reply_later()),
            Cmd::Ping => return format!("pong from {}", ctx.entity_id()),
            Cmd::Waiting => return self.waiting.len().to_string(),
            Cmd::Release => {
                let n = self.waiting.len();
                for later in self.waiting.drain(..) {
                    later.send("released".into());
                }
                return n.to_string();
            }
            Cmd::Forward(to) => {
                let later = ctx.reply_later::<String>().expect("an ask's reply");
                let peers = self.peers.get().expect("the region is known").clone();
                tokio::spawn(async move {
                    match peers.ask(&to, Cmd::Ping).await {
                        Ok(answer) => later.send(format!("forwarded: {answer}")),
                        Err(e) => later.fail(e.to_string()),
                    }
                });
            }
            Cmd::Drop => drop(ctx.reply_later::<String>()),
            Cmd::Probe => {
                let other_type = ctx.reply_later::<u64>().is_some();
                let first = ctx.reply_later::<String>();
                let second = ctx.reply_later::<String>().is_some();
                first.expect("the first take").send(format!("other type: {other_type}, second: {second}"));
            }
        }
        "the handler's own reply".into()
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings { number_of_shards: 10, min_nr_of_members: 2, ..ShardingSettings::default() }
}

async fn start_gate(cluster: &VirtualCluster, i: usize) -> ShardRegion<Gate> {
    let start = |n: ddshard::Node| async move {
        let peers: Arc<OnceLock<ShardRegion<Gate>>> = Arc::default();
        let for_factory = peers.clone();
        let region = n
            .sharding()
            .start("gate", move |_: &str| Gate { waiting: Vec::new(), peers: for_factory.clone() }, settings())
            .await?;
        let _ = peers.set(region.clone());
        Ok::<_, Error>(region)
    };
    cluster.on_node(i, start).await.expect("the node runs").expect("the region starts")
}

/// Asks `cmd` of `id` on node `i`.
async fn ask(
    cluster: &VirtualCluster,
    i: usize,
    region: &ShardRegion<Gate>,
    id: &str,
    cmd: Cmd,
) -> Result<String, Error> {
    let (region, id) = (region.clone(), id.to_string());
    cluster.on_node(i, move |_| async move { region.ask_with_timeout(&id, cmd, ASK).await }).await.expect("runs")
}

#[test]
fn an_entity_answers_asks_from_both_nodes_after_handling_later_messages() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = [start_gate(&cluster, 0).await, start_gate(&cluster, 1).await];
        let waiting = {
            let (c, r0, r1) = (&cluster, &regions[0], &regions[1]);
            futures::future::join(ask(c, 0, r0, "g", Cmd::Wait), ask(c, 1, r1, "g", Cmd::Wait))
        };
        let later = async {
            // Both waits are held while the entity goes on handling messages.
            eventually(Duration::from_secs(30), "both asks wait", || async {
                (ask(&cluster, 0, &regions[0], "g", Cmd::Waiting).await.ok()? == "2").then_some(())
            })
            .await;
            assert_eq!(ask(&cluster, 0, &regions[0], "g", Cmd::Ping).await.unwrap(), "pong from g");
            assert_eq!(ask(&cluster, 1, &regions[1], "g", Cmd::Release).await.unwrap(), "2");
        };
        let ((a, b), ()) = futures::future::join(waiting, later).await;
        assert_eq!((a.unwrap(), b.unwrap()), ("released".to_string(), "released".to_string()));
    });
}

#[test]
fn a_deferred_reply_moved_to_a_task_forwards_the_ask_to_another_entity() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = [start_gate(&cluster, 0).await, start_gate(&cluster, 1).await];
        for (i, from) in ["a", "b", "c", "d"].into_iter().enumerate() {
            let answer = ask(&cluster, i % 2, &regions[i % 2], from, Cmd::Forward("target".into())).await;
            assert_eq!(answer.unwrap(), "forwarded: pong from target");
        }
    });
}

#[test]
fn a_dropped_deferred_reply_fails_the_ask_at_once_naming_the_entity() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = [start_gate(&cluster, 0).await, start_gate(&cluster, 1).await];
        for (i, region) in regions.iter().enumerate() {
            let asked = tokio::time::Instant::now();
            match ask(&cluster, i, region, "dropper", Cmd::Drop).await {
                Err(Error::NotDelivered { entity_id, reason }) => {
                    assert_eq!(entity_id, "dropper");
                    assert!(reason.contains("dropped its deferred reply"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
            assert!(asked.elapsed() < Duration::from_secs(1), "failed at once, not at the ask timeout");
        }
    });
}

#[test]
fn reply_later_gives_the_reply_once_as_the_entitys_reply_type_and_nothing_for_a_tell() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let regions = [start_gate(&cluster, 0).await, start_gate(&cluster, 1).await];
        let answer = ask(&cluster, 1, &regions[1], "p", Cmd::Probe).await.unwrap();
        assert_eq!(answer, "other type: false, second: false");
        // A tell has no reply to take: Wait keeps nothing, so Release finds none waiting.
        let region = regions[0].clone();
        cluster.on_node(0, move |_| async move { region.tell("t", Cmd::Wait) }).await.unwrap().unwrap();
        assert_eq!(ask(&cluster, 0, &regions[0], "t", Cmd::Release).await.unwrap(), "0");
    });
}

/// A durable counter whose handler persists and sends its deferred reply before returning.
#[derive(Default)]
struct Counter;

#[derive(Default, Serialize, Deserialize)]
struct Count(u64);

impl DurableEntity for Counter {
    type State = Count;
    type Message = ();
    type Reply = u64;
    async fn handle(&mut self, state: &mut Count, _msg: (), ctx: &mut EntityContext) -> u64 {
        state.0 += 1;
        ctx.persist();
        ctx.reply_later::<u64>().expect("an ask's reply").send(state.0);
        0
    }
}

/// A reply sent while a durable entity's handler runs leaves after that message's state
/// write: with each commit taking 300 ms, no answer comes sooner, and every acknowledged count
/// survives a crash of the entity's node.
#[test]
fn a_durable_entitys_deferred_reply_sent_in_its_handler_leaves_after_the_state_write() {
    const COMMIT: Duration = Duration::from_millis(300);
    VirtualRun::new(3).commit_latency(COMMIT).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let start = |n: ddshard::Node| async move {
            let s = ShardingSettings { number_of_shards: 10, min_nr_of_members: 3, ..ShardingSettings::default() };
            n.sharding().start_durable("count", |_: &str| Counter, s).await
        };
        let mut regions = Vec::new();
        for i in 0..3 {
            regions.push(cluster.on_node(i, start).await.unwrap().unwrap());
        }
        let region = regions[0].clone();
        let counts = cluster
            .on_node(0, move |_| async move {
                let mut counts = Vec::new();
                for _ in 0..5 {
                    let asked = tokio::time::Instant::now();
                    let count = region.ask_with_timeout("c", (), ASK).await;
                    counts.push(count.map(|c| (c, asked.elapsed())));
                }
                counts
            })
            .await
            .unwrap();
        let (counts, took): (Vec<u64>, Vec<Duration>) = counts.into_iter().map(Result::unwrap).unzip();
        assert!(took.iter().all(|t| *t >= COMMIT), "an answer came before its write was committed: {took:?}");
        assert_eq!(counts, [1, 2, 3, 4, 5], "the deferred reply, not the handler's 0");
        let region = regions[0].clone();
        let home =
            cluster.on_node(0, move |_| async move { region.erased().locate("c").await }).await.unwrap().unwrap();
        let home_node = home.home.unwrap().split('#').next().unwrap().to_string();
        let home_index = (0..3).find(|i| VirtualCluster::node_id(*i) == home_node).unwrap();
        cluster.crash(home_index).await;
        let asker = (home_index + 1) % 3;
        let region = regions[asker].clone();
        let after = cluster
            .on_node(asker, move |n| async move {
                n.down(&home_node).await?;
                region.ask_with_timeout("c", (), Duration::from_secs(60)).await
            })
            .await
            .unwrap();
        assert_eq!(after.unwrap(), 6, "every acknowledged count was written before its reply left");
    });
}

/// A cart that answers its two requests with two kinds of reply.
#[derive(Default)]
struct Cart {
    items: Vec<String>,
}

#[derive(Serialize, Deserialize)]
enum CartMsg {
    Add(String),
    Count,
}

#[derive(Serialize, Deserialize)]
enum CartReply {
    Added(usize),
    Count(usize),
}

impl Entity for Cart {
    type Message = CartMsg;
    type Reply = CartReply;
    async fn handle(&mut self, msg: CartMsg, _ctx: &mut EntityContext) -> CartReply {
        match msg {
            CartMsg::Add(item) => {
                self.items.push(item);
                CartReply::Added(self.items.len())
            }
            CartMsg::Count => CartReply::Count(self.items.len()),
        }
    }
}

struct Add(String);
impl From<Add> for CartMsg {
    fn from(a: Add) -> CartMsg {
        CartMsg::Add(a.0)
    }
}
impl ddshard::sharding::Request<Cart> for Add {
    /// The position of the item added.
    type Reply = usize;
    fn reply_of(reply: CartReply) -> Option<usize> {
        match reply {
            CartReply::Added(n) => Some(n),
            CartReply::Count(_) => None,
        }
    }
}

struct ItemCount;
impl From<ItemCount> for CartMsg {
    fn from(_: ItemCount) -> CartMsg {
        CartMsg::Count
    }
}
impl ddshard::sharding::Request<Cart> for ItemCount {
    type Reply = usize;
    fn reply_of(reply: CartReply) -> Option<usize> {
        match reply {
            CartReply::Count(n) => Some(n),
            CartReply::Added(_) => None,
        }
    }
}

/// A request whose expected reply the entity never gives (a mismatch in user code).
struct Miswired;
impl From<Miswired> for CartMsg {
    fn from(_: Miswired) -> CartMsg {
        CartMsg::Count
    }
}
impl ddshard::sharding::Request<Cart> for Miswired {
    type Reply = usize;
    fn reply_of(reply: CartReply) -> Option<usize> {
        match reply {
            CartReply::Added(n) => Some(n),
            CartReply::Count(_) => None,
        }
    }
}

/// Issue 42, step 8: typed requests get their own reply types from any node, through the
/// region and an `EntityRef`, beside plain asks of the same entity; a reply of another kind
/// is a typed error naming the request.
#[test]
fn typed_requests_get_their_own_reply_types_and_a_reply_of_another_kind_is_a_typed_error() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let mut regions = Vec::new();
        for i in 0..2 {
            let start = |n: ddshard::Node| async move {
                n.sharding().start("cart", |_: &str| Cart::default(), settings()).await
            };
            regions.push(cluster.on_node(i, start).await.unwrap().unwrap());
        }
        for (i, region) in regions.iter().enumerate() {
            let region: ShardRegion<Cart> = region.clone();
            let (positions, count, plain, miswired) = cluster
                .on_node(i, move |_| async move {
                    let cart = region.entity_ref("cart-1");
                    let mut positions = Vec::new();
                    for item in ["apple", "pear"] {
                        positions.push(region.request("cart-1", Add(item.into())).await.unwrap());
                    }
                    let count = cart.request(ItemCount).await.unwrap();
                    let plain = matches!(region.ask("cart-1", CartMsg::Count).await.unwrap(), CartReply::Count(_));
                    (positions, count, plain, cart.request(Miswired).await)
                })
                .await
                .unwrap();
            assert_eq!(positions, [2 * i + 1, 2 * i + 2]);
            assert_eq!(count, 2 * i + 2);
            assert!(plain, "the untyped ask still works");
            match miswired {
                Err(Error::UnexpectedReply { entity_id, request }) => {
                    assert_eq!(entity_id, "cart-1");
                    assert!(request.ends_with("Miswired"), "{request}");
                }
                other => panic!("{other:?}"),
            }
        }
    });
}

/// A durable entity that holds asks until it is approved, and answers them from the handler
/// that persists the approval.
#[derive(Default)]
struct Approval {
    waiting: Vec<DeferredReply<bool>>,
}

#[derive(Serialize, Deserialize)]
enum Decision {
    Await,
    Approve,
}

impl DurableEntity for Approval {
    type State = bool;
    type Message = Decision;
    type Reply = bool;
    async fn handle(&mut self, approved: &mut bool, msg: Decision, ctx: &mut EntityContext) -> bool {
        match msg {
            Decision::Await => self.waiting.extend(ctx.reply_later::<bool>()),
            Decision::Approve => {
                *approved = true;
                ctx.persist();
                for later in self.waiting.drain(..) {
                    later.send(true);
                }
            }
        }
        *approved
    }
}

/// The answer to an earlier ask, sent by a later handler that persists the state it rests
/// on, leaves only once that write is acknowledged: with commits of 300 ms, not sooner.
#[test]
fn an_earlier_asks_answer_sent_by_a_persisting_handler_leaves_after_that_write() {
    const COMMIT: Duration = Duration::from_millis(300);
    VirtualRun::new(3).commit_latency(COMMIT).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let start = |n: ddshard::Node| async move {
            let s = ShardingSettings { number_of_shards: 10, min_nr_of_members: 3, ..ShardingSettings::default() };
            n.sharding().start_durable("approval", |_: &str| Approval::default(), s).await
        };
        let mut regions = Vec::new();
        for i in 0..3 {
            regions.push(cluster.on_node(i, start).await.unwrap().unwrap());
        }
        let region = regions[0].clone();
        let (waited, approved) = cluster
            .on_node(0, move |_| async move {
                let waiting = async {
                    let answer = region.ask_with_timeout("a", Decision::Await, ASK).await;
                    (answer, tokio::time::Instant::now())
                };
                // Polled after `waiting`: one handle's messages to an entity arrive in order.
                let approve = async {
                    let sent = tokio::time::Instant::now();
                    (region.ask_with_timeout("a", Decision::Approve, ASK).await, sent)
                };
                let ((waited, answered), (approved, sent)) = futures::future::join(waiting, approve).await;
                (waited.map(|w| (w, answered.duration_since(sent))), approved)
            })
            .await
            .unwrap();
        assert!(approved.unwrap());
        let (answer, after_approve) = waited.unwrap();
        assert!(answer);
        assert!(after_approve >= COMMIT, "the waiting ask was answered {after_approve:?} after the approval was sent");
    });
}
