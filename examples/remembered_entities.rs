//! Remembered entities: a type started with `remember.enabled = true` records every started
//! id (replicated OR-sets, durable in LMDB) and starts them again after a hand-off, a crash or
//! a full-cluster restart — without a message. Here a one-node cluster starts five devices,
//! stops completely, and a new process-lifetime of the node (same data dir) finds them running.
//!
//! `cargo run --example remembered_entities`

use std::time::Duration;

use ddshard::{Entity, EntityContext, Node, NodeConfig, ShardRegion, ShardingSettings};

/// A device twin that only needs to be running (say, to keep a connection to its device).
struct Device;

#[derive(serde::Serialize, serde::Deserialize)]
struct Ping;

impl Entity for Device {
    type Message = Ping;
    type Reply = String;
    async fn handle(&mut self, _msg: Ping, ctx: &mut EntityContext) -> String {
        format!("{} is up", ctx.entity_id())
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings {
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, ..ShardingSettings::default().remember },
        ..ShardingSettings::default()
    }
}

async fn start(data_dir: &std::path::Path) -> ddshard::Result<(Node, ShardRegion<Device>)> {
    let config = NodeConfig {
        node_id: "n1".into(),
        cluster_id: "devices".into(),
        data_dir: data_dir.to_path_buf(),
        ..NodeConfig::default()
    };
    let node = Node::start(config).await?;
    let devices = node.sharding().start("device", |_id: &str| Device, settings()).await?;
    Ok((node, devices))
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let data = tempfile::tempdir().expect("a temp dir");
    let ids: Vec<String> = (1..=5).map(|i| format!("device-{i}")).collect();

    let (node, devices) = start(data.path()).await?;
    for id in &ids {
        // Asked once: from now on the id is remembered (written before the entity runs).
        println!("{}", devices.ask(id, Ping).await?);
    }
    node.shutdown().await;
    println!("the whole cluster stopped");

    // The same data dir, a new start: the shards come back and start their remembered ids
    // on their own; no message is sent to them below, the region's state is only read.
    let (node, devices) = start(data.path()).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let running: Vec<String> = devices.region_state().await?.into_values().flatten().collect();
        if ids.iter().all(|id| running.contains(id)) {
            println!("after the restart, running again without a message: {running:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "remembered ids not back: {running:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.shutdown().await;
    Ok(())
}
