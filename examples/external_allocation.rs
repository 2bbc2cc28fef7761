//! External allocation: an operator (or a placement service) says where each shard lives, in
//! a replicated, durable table; new shards follow it at once and allocated ones move at the
//! next rebalance. Here the shard of `tenant-42` is placed on n2, then moved to n1.
//!
//! `cargo run --example external_allocation`

use std::time::Duration;

use ddshard::sharding::AllocationSettings;
use ddshard::{Entity, EntityContext, MemberStatus, Node, NodeConfig, ShardRegion, ShardingSettings};

/// Answers with the node it runs on.
struct Tenant {
    node: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct WhereAreYou;

impl Entity for Tenant {
    type Message = WhereAreYou;
    type Reply = String;
    async fn handle(&mut self, _msg: WhereAreYou, _ctx: &mut EntityContext) -> String {
        self.node.clone()
    }
}

/// Places `shard` on `node`, retrying what the error says is worth retrying for up to 30 s: just
/// after the cluster forms, a node's replicator may not count the other node yet, and a
/// majority write then fails at once with `NotEnoughReplicas`.
async fn place(region: &ShardRegion<Tenant>, shard: &str, node: &str) -> ddshard::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match region.set_external_shard_location(shard, node).await {
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            placed => return placed,
        }
    }
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let mut nodes: Vec<Node> = Vec::new();
    for id in ["n1", "n2"] {
        let config = NodeConfig {
            node_id: id.into(),
            cluster_id: "tenants".into(),
            seeds: nodes.first().map(|n| vec![n.gossip_addr().into()]).unwrap_or_default(),
            data_dir: data.path().join(id),
            ..NodeConfig::default()
        };
        nodes.push(Node::start(config).await?);
    }
    for node in &nodes {
        let mut view = node.watch_membership();
        let _ = view.wait_for(|s| s.members.iter().filter(|m| m.status() == MemberStatus::Up).count() == 2).await;
    }
    let settings = ShardingSettings {
        allocation: AllocationSettings::External { rebalance_limit: 10 },
        min_nr_of_members: 2,
        rebalance_interval: Duration::from_secs(1),
        ..ShardingSettings::default()
    };
    let mut tenants = Vec::new();
    for node in &nodes {
        let me = node.node_id().to_string();
        tenants.push(
            node.sharding().start("tenant", move |_id: &str| Tenant { node: me.clone() }, settings.clone()).await?,
        );
    }

    let shard = tenants[0].shard_id("tenant-42");
    place(&tenants[0], &shard, "n2").await?;
    let host = tenants[0].ask("tenant-42", WhereAreYou).await?;
    assert_eq!(host, "n2");
    println!("shard {shard} placed on n2: tenant-42 runs on {host}");

    // Move it: the table changes now, the shard is handed off at the next rebalance round.
    place(&tenants[0], &shard, "n1").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let host = tenants[1].ask("tenant-42", WhereAreYou).await?;
        if host == "n1" {
            println!("shard {shard} moved to n1: tenant-42 runs on {host}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the shard did not move to n1");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for node in &nodes {
        node.shutdown().await;
    }
    Ok(())
}
