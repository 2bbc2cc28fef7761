//! Testing your own entity type under a network partition with the test kit (feature
//! `testkit`): five in-process nodes, a 2|3 split, keep-majority downing. The minority stops
//! itself, its entities start again on the majority, and the activation log proves no entity
//! ever ran on both sides at once. The same shape belongs in your own integration tests.
//!
//! `cargo run --example testkit_partition --features testkit`

use std::time::Duration;

use ddshard::activation::{ActivationGuard, ActivationLog};
use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{Entity, EntityContext, ShardRegion, ShardingSettings};

/// Your entity, with an activation guard: a live incarnation holds it.
struct Account {
    node: String,
    log: ActivationLog,
    guard: Option<ActivationGuard>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Touch;

impl Entity for Account {
    type Message = Touch;
    type Reply = String;
    async fn handle(&mut self, _msg: Touch, ctx: &mut EntityContext) -> String {
        if self.guard.is_none() {
            self.guard = Some(self.log.started(ctx.entity_id(), &self.node, ctx.epoch()));
        }
        self.node.clone()
    }
}

#[tokio::main]
async fn main() -> ddshard::Result<()> {
    let mut cluster = TestCluster::start_with(5, |_, config| fast_downing(config)).await?;
    cluster.await_converged(Duration::from_secs(30)).await;
    let log = ActivationLog::new();
    let settings = ShardingSettings { min_nr_of_members: 5, ..ShardingSettings::default() };
    let mut accounts: Vec<ShardRegion<Account>> = Vec::new();
    for (_, node) in cluster.running() {
        let (me, log) = (node.node_id().to_string(), log.clone());
        let factory = move |_id: &str| Account { node: me.clone(), log: log.clone(), guard: None };
        accounts.push(node.sharding().start("account", factory, settings.clone()).await?);
    }
    let ids: Vec<String> = (0..30).map(|i| format!("acct-{i}")).collect();
    for id in &ids {
        accounts[0].ask(id, Touch).await?;
    }

    cluster.partition(&[0, 1], &[2, 3, 4]);
    for i in [0, 1] {
        let node = cluster.node(i).clone();
        eventually(Duration::from_secs(30), "the minority stops itself", || {
            std::future::ready(node.is_shut_down().then_some(()))
        })
        .await;
    }
    println!("n1 and n2 (the minority) downed themselves");
    // Every account answers from the majority side (retried while its shard moves there).
    for id in &ids {
        let region = accounts[4].clone();
        let host = eventually(Duration::from_secs(30), "the account answers on the majority", || {
            let region = region.clone();
            let id = id.clone();
            async move { region.ask_with_timeout(&id, Touch, Duration::from_secs(2)).await.ok() }
        })
        .await;
        assert!(["n3", "n4", "n5"].contains(&host.as_str()), "{id} runs on the majority, not {host}");
    }
    if let Err(violations) = log.check() {
        panic!("an account ran on both sides of the partition: {violations:#?}");
    }
    println!("30 accounts answer from n3..n5; the activation log shows no overlap");
    cluster.shutdown().await;
    Ok(())
}
