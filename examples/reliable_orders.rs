//! Reliable delivery into durable entities: a checkout producer sends order lines to order
//! entities through a durable queue; midway the producer's node stops without leaving (as a
//! killed process would: no hand-off), is downed, and a producer with the same id started on
//! another node resumes what the first had stored and not had confirmed. At the end every
//! order's total is exactly the sum of its lines: none lost, none applied twice.
//!
//! `cargo run --example reliable_orders`

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ddshard::sharding::ProducerSettings;
use ddshard::{DurableEntity, EntityContext, MemberStatus, Node, NodeConfig};

/// An order: the sum of its lines, kept in the cluster's durable store.
struct Order;

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct OrderState {
    total: u64,
    lines: u32,
}

#[derive(serde::Serialize, serde::Deserialize)]
enum OrderMsg {
    AddLine(u64),
    Total,
}

impl DurableEntity for Order {
    type Message = OrderMsg;
    type Reply = (u64, u32);
    type State = OrderState;
    async fn handle(&mut self, state: &mut OrderState, msg: OrderMsg, ctx: &mut EntityContext) -> (u64, u32) {
        if let OrderMsg::AddLine(amount) = msg {
            // The second quarter of the lines waits until n1 has stopped: lines are stored and
            // not yet handled when it stops, whatever the machine's speed.
            if amount > HELD_FROM {
                while !LINES_FLOW.load(Ordering::Acquire) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            state.total += amount;
            state.lines += 1;
            // The line and the delivery's number are written together: a line sent again
            // after a crash is confirmed without being added twice.
            ctx.persist();
        }
        (state.total, state.lines)
    }
}

const ORDERS: u64 = 20;
const LINES: u64 = 400;
/// Lines above this number are held back until the first producer's node has stopped.
const HELD_FROM: u64 = LINES / 4;
/// Opened once n1 has stopped and is downed.
static LINES_FLOW: AtomicBool = AtomicBool::new(false);

/// Line `k`'s order and amount.
fn line(k: u64) -> (String, u64) {
    (format!("order-{}", k % ORDERS), k)
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let mut nodes: Vec<Node> = Vec::new();
    for i in 1..=3 {
        let config = NodeConfig {
            node_id: format!("n{i}"),
            cluster_id: "orders".into(),
            seeds: nodes.first().map(|n| vec![n.gossip_addr().into()]).unwrap_or_default(),
            data_dir: data.path().join(format!("n{i}")),
            ..NodeConfig::default()
        };
        nodes.push(Node::start(config).await?);
    }
    for node in &nodes {
        let mut view = node.watch_membership();
        let _ = view.wait_for(|s| s.members.iter().filter(|m| m.status() == MemberStatus::Up).count() == 3).await;
    }
    let mut orders = Vec::new();
    for node in &nodes {
        orders.push(node.sharding().start_durable("order", |_: &str| Order, node.sharding().settings()).await?);
    }
    let settings = ProducerSettings { durable_queue: true, ..ProducerSettings::default() };

    // The first half of the lines from n1; each `send` returns once the line is stored in the
    // cluster, before its order handled it.
    let checkout = orders[0].producer("checkout", settings.clone()).await?;
    let sends = (1..=LINES / 2).map(|k| {
        let (order, amount) = line(k);
        let checkout = checkout.clone();
        async move { checkout.send(&order, OrderMsg::AddLine(amount)).await }
    });
    futures::future::try_join_all(sends).await?;
    // The orders work through the first quarter meanwhile; the second is held.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while checkout.stats().unconfirmed > (LINES / 2 - HELD_FROM) as usize {
        assert!(tokio::time::Instant::now() < deadline, "first lines unconfirmed: {:?}", checkout.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let left = checkout.stats().unconfirmed;
    println!("{} lines stored from n1, {left} not confirmed yet; n1 stops without leaving", LINES / 2);
    drop(checkout);
    nodes[0].shutdown().await;
    nodes[1].down("n1").await?;
    LINES_FLOW.store(true, Ordering::Release);

    // The same producer id on n2: it claims the queue (n1's incarnation could no longer store
    // anything) and sends again what n1 had not had confirmed, then the rest.
    let checkout = orders[1].producer("checkout", settings).await?;
    let resumed = checkout.stats().unconfirmed;
    println!("the producer resumed on n2 with {resumed} unconfirmed lines");
    let mut confirmations = Vec::new();
    for k in LINES / 2 + 1..=LINES {
        let (order, amount) = line(k);
        confirmations.push(checkout.send(&order, OrderMsg::AddLine(amount)).await?);
    }
    for confirmation in confirmations {
        confirmation.await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while checkout.stats().unconfirmed > 0 {
        assert!(tokio::time::Instant::now() < deadline, "lines still unconfirmed: {:?}", checkout.stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    for o in 0..ORDERS {
        let id = format!("order-{o}");
        let expected: u64 = (1..=LINES).filter(|k| k % ORDERS == o).sum();
        let (total, lines) = orders[2].ask(&id, OrderMsg::Total).await?;
        assert_eq!((total, u64::from(lines)), (expected, LINES / ORDERS), "{id}: each line exactly once");
    }
    assert!(resumed > 0, "the stop came while lines were stored and not yet handled");
    println!(
        "{ORDERS} orders, {LINES} lines: every total exact ({resumed} lines resumed on n2, none lost or applied twice)"
    );
    for node in &nodes[1..] {
        node.shutdown().await;
    }
    Ok(())
}
