//! The README's counter, on a cluster of three nodes in one process: each node joins through
//! the first one's gossip address, counters are told and asked from every node, and one node
//! leaves gracefully (its shards move; the counters keep answering from the others).
//!
//! `cargo run --example counter_cluster`

use ddshard::{Entity, EntityContext, MemberStatus, Node, NodeConfig, ShardRegion};

#[derive(Default)]
struct Counter {
    value: i64,
}

#[derive(serde::Serialize, serde::Deserialize)]
enum CounterMsg {
    Add(i64),
    Get,
}

impl Entity for Counter {
    type Message = CounterMsg;
    type Reply = i64;
    async fn handle(&mut self, msg: CounterMsg, _ctx: &mut EntityContext) -> i64 {
        if let CounterMsg::Add(n) = msg {
            self.value += n;
        }
        self.value
    }
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let mut nodes: Vec<Node> = Vec::new();
    for i in 1..=3 {
        let config = NodeConfig {
            node_id: format!("n{i}"),
            cluster_id: "counters".into(),
            // Every node after the first joins through the first one.
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
    println!("3 members up");

    let mut counters: Vec<ShardRegion<Counter>> = Vec::new();
    for node in &nodes {
        counters
            .push(node.sharding().start("counter", |_id: &str| Counter::default(), node.sharding().settings()).await?);
    }
    // Tell from one node (fire and forget), ask from the same: one sender's messages to one
    // entity arrive in order, so the answer counts the tell.
    for i in 0..30 {
        let id = format!("c-{i}");
        counters[i % 3].tell(&id, CounterMsg::Add(i as i64))?;
        let value: i64 = counters[i % 3].ask(&id, CounterMsg::Get).await?;
        assert_eq!(value, i as i64, "{id}");
    }
    // Ask from another node: the entity lives on exactly one of them.
    for i in 0..30 {
        let id = format!("c-{i}");
        let value: i64 = counters[(i + 1) % 3].ask(&id, CounterMsg::Get).await?;
        assert_eq!(value, i as i64, "{id}");
    }
    println!("30 counters told and asked from different nodes");

    // n3 leaves: it hands its shards off first. A plain entity keeps its value in memory, so a
    // counter that moved starts again from 0 (`start_durable` keeps state across moves).
    nodes[2].leave().await?;
    for i in 0..30 {
        let value: i64 = counters[0].ask(&format!("c-{i}"), CounterMsg::Add(1)).await?;
        assert!(value >= 1);
    }
    println!("n3 left; every counter answers from n1 and n2");
    for node in &nodes[..2] {
        node.shutdown().await;
    }
    Ok(())
}
