//! Roles and a proxy-only node: entities of type `order` run only on nodes with the role
//! `backend`; a node without it (an API gateway, say) starts the type as a proxy and routes
//! every message to the backends, hosting nothing itself.
//!
//! `cargo run --example proxy_only`

use ddshard::{Entity, EntityContext, MemberStatus, Node, NodeConfig, ShardingSettings};

/// Answers with the node it runs on.
struct Order {
    node: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct WhereAreYou;

impl Entity for Order {
    type Message = WhereAreYou;
    type Reply = String;
    async fn handle(&mut self, _msg: WhereAreYou, _ctx: &mut EntityContext) -> String {
        self.node.clone()
    }
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let backend = Node::start(NodeConfig {
        node_id: "backend-1".into(),
        cluster_id: "shop".into(),
        roles: vec!["backend".into()],
        data_dir: data.path().join("backend-1"),
        ..NodeConfig::default()
    })
    .await?;
    let gateway = Node::start(NodeConfig {
        node_id: "gateway-1".into(),
        cluster_id: "shop".into(),
        seeds: vec![backend.gossip_addr().into()],
        data_dir: data.path().join("gateway-1"),
        ..NodeConfig::default()
    })
    .await?;
    let mut view = gateway.watch_membership();
    let _ = view.wait_for(|s| s.members.iter().filter(|m| m.status() == MemberStatus::Up).count() == 2).await;

    let settings = ShardingSettings { role: Some("backend".into()), ..ShardingSettings::default() };
    let factory = |_id: &str| Order { node: "backend-1".into() };
    let _hosting = backend.sharding().start("order", factory, settings.clone()).await?;
    // The gateway lacks the role: `start` gives it a proxy (`start_proxy` says so explicitly).
    let orders = gateway.sharding().start_proxy::<Order>("order", settings).await?;
    for i in 0..20 {
        let host = orders.ask(&format!("order-{i}"), WhereAreYou).await?;
        assert_eq!(host, "backend-1", "orders run only where the role is");
    }
    let hosted_here: usize = orders.region_state().await?.values().map(Vec::len).sum();
    assert_eq!(hosted_here, 0, "a proxy hosts nothing");
    println!("20 orders asked through the gateway, all running on backend-1; the gateway hosts none");
    gateway.shutdown().await;
    backend.shutdown().await;
    Ok(())
}
