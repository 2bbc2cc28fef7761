//! A custom allocation strategy: new shards go to the least-loaded region whose node is not a
//! canary (canary nodes run a new build and should take shards only when nothing else can),
//! and the strategy explains its choice to operators (the admin API's shard explanation).
//!
//! `cargo run --example custom_allocation`

use std::collections::BTreeSet;
use std::sync::Arc;

use ddshard::sharding::{RegionAllocation, RegionId, ShardAllocationStrategy, ShardId, StartOptions};
use ddshard::{Entity, EntityContext, MemberStatus, Node, NodeConfig, ShardingSettings};

/// Least shards first, canaries last.
struct AvoidCanaries;

fn is_canary(region: &RegionId) -> bool {
    region.node_id.starts_with("canary")
}

impl ShardAllocationStrategy for AvoidCanaries {
    fn allocate(&self, _requester: &RegionId, _shard: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        // `regions` is never empty; ties go to the lowest address, so every node agrees.
        let best = regions.iter().min_by_key(|r| (is_canary(&r.region), r.leaving, r.shards.len(), r.region.clone()));
        best.expect("the coordinator offers at least one region").region.clone()
    }

    fn rebalance(&self, _regions: &[RegionAllocation], _in_progress: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        BTreeSet::new() // placement only; nothing moves once allocated
    }

    fn allocation_reason(&self, _shard: &ShardId, _regions: &[RegionAllocation], chosen: &RegionId) -> String {
        if is_canary(chosen) { "only canaries could take it".into() } else { "fewest shards among non-canaries".into() }
    }
}

/// Answers with the node it runs on.
struct Job {
    node: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Run;

impl Entity for Job {
    type Message = Run;
    type Reply = String;
    async fn handle(&mut self, _msg: Run, _ctx: &mut EntityContext) -> String {
        self.node.clone()
    }
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let mut nodes: Vec<Node> = Vec::new();
    for id in ["stable-1", "canary-1", "stable-2"] {
        let config = NodeConfig {
            node_id: id.into(),
            cluster_id: "jobs".into(),
            seeds: nodes.first().map(|n| vec![n.gossip_addr().into()]).unwrap_or_default(),
            data_dir: data.path().join(id),
            ..NodeConfig::default()
        };
        nodes.push(Node::start(config).await?);
    }
    for node in &nodes {
        let mut view = node.watch_membership();
        let _ = view.wait_for(|s| s.members.iter().filter(|m| m.status() == MemberStatus::Up).count() == 3).await;
    }
    // Every node starts the type with the same strategy (the coordinator's node uses its own).
    let settings = ShardingSettings { min_nr_of_members: 3, ..ShardingSettings::default() };
    let mut jobs = Vec::new();
    for node in &nodes {
        let me = node.node_id().to_string();
        let options = StartOptions { allocation_strategy: Some(Arc::new(AvoidCanaries)), ..StartOptions::default() };
        let factory = move |_id: &str| Job { node: me.clone() };
        jobs.push(node.sharding().start_with("job", factory, settings.clone(), options).await?);
    }
    let mut hosts = BTreeSet::new();
    for i in 0..40 {
        hosts.insert(jobs[i % 3].ask(&format!("job-{i}"), Run).await?);
    }
    assert!(!hosts.contains("canary-1"), "no job on the canary while stable nodes are up: {hosts:?}");
    println!("40 jobs ran on {hosts:?}; none on canary-1");
    for node in &nodes {
        node.shutdown().await;
    }
    Ok(())
}
