//! Whole nodes in virtual time (`ddshard::testkit::virtual_time`): the shipped node, every driver
//! included, on a simulated network with paused clocks stepped together.

use std::time::{Duration, Instant};

use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{Entity, EntityContext, ShardingSettings};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct Echo;

#[derive(Serialize, Deserialize)]
struct Ping;

impl Entity for Echo {
    type Message = Ping;
    type Reply = String;
    async fn handle(&mut self, _msg: Ping, ctx: &mut EntityContext) -> String {
        ctx.entity_id().to_string()
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings { number_of_shards: 10, min_nr_of_members: 3, ..ShardingSettings::default() }
}

#[test]
fn three_whole_nodes_form_a_cluster_and_answer_asks_in_virtual_time_faster_than_real_time() {
    let real = Instant::now();
    let virtual_elapsed = VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        let started = tokio::time::Instant::now();
        cluster.await_converged(Duration::from_secs(30)).await;
        let mut regions = Vec::new();
        for i in 0..3 {
            let region = cluster
                .on_node(i, |n| async move { n.sharding().start("echo", |_: &str| Echo, settings()).await })
                .await
                .expect("the node runs")
                .expect("the region starts");
            regions.push(region);
        }
        for k in 0..30 {
            let id = format!("e{k}");
            let answer = regions[k % 3].ask_with_timeout(&id, Ping, Duration::from_secs(10)).await.unwrap();
            assert_eq!(answer, id);
        }
        // Idle for a virtual minute: gossip, heartbeats and sweeps keep running.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(cluster.is_converged(), "still one cluster after a quiet minute");
        started.elapsed()
    });
    let real = real.elapsed();
    println!("virtual {virtual_elapsed:?} in real {real:?}");
    assert!(virtual_elapsed >= Duration::from_secs(60));
    assert!(real < virtual_elapsed, "virtual time ran faster than real time ({real:?} for {virtual_elapsed:?})");
}
