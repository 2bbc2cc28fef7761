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

mod crash {
    use super::*;
    use ddshard::testkit::{ActivationGuard, ActivationLog};

    struct Tracked {
        log: ActivationLog,
        node: String,
        guard: Option<ActivationGuard>,
    }

    impl Entity for Tracked {
        type Message = Ping;
        type Reply = String;
        async fn started(&mut self, ctx: &EntityContext) {
            self.guard = Some(self.log.started(ctx.entity_id(), &self.node, ctx.epoch()));
        }
        async fn handle(&mut self, _msg: Ping, ctx: &mut EntityContext) -> String {
            ctx.entity_id().to_string()
        }
    }

    #[test]
    fn a_crash_ends_every_activation_of_the_crashed_node_at_once() {
        VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            let log = ActivationLog::new();
            let mut regions = Vec::new();
            for i in 0..3 {
                let (log, node) = (log.clone(), VirtualCluster::node_id(i));
                let tracked = move |_: &str| Tracked { log: log.clone(), node: node.clone(), guard: None };
                let start = |n: ddshard::Node| async move { n.sharding().start("tracked", tracked, settings()).await };
                regions.push(cluster.on_node(i, start).await.unwrap().unwrap());
            }
            for (i, region) in regions.into_iter().enumerate() {
                // Asked from each node's own runtime, like a caller in that node's process; the
                // test keeps no handle of the region.
                let asks = |_| async move {
                    for k in 0..20 {
                        let id = format!("e{k}");
                        assert_eq!(region.ask_with_timeout(&id, Ping, Duration::from_secs(10)).await.unwrap(), id);
                    }
                };
                cluster.on_node(i, asks).await.unwrap();
            }
            let live_on = |node: &str| log.activations().iter().filter(|a| a.node == node && a.stop.is_none()).count();
            assert!(live_on("n2") > 0, "n2 hosts some of the entities");
            cluster.crash(1).await;
            assert_eq!(live_on("n2"), 0, "a crashed node runs no entity");
        });
    }
}

mod durability {
    use super::*;
    use ddshard::ddata::{Consistency, DurableStore, OrSet, ReplicatedData};

    const OP: Duration = Duration::from_secs(5);

    #[test]
    fn a_majority_write_acknowledged_just_before_every_node_crashes_is_on_the_disks_of_the_acknowledging_majority() {
        VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            // n3 hears no replicator message (gossip says it is reachable, so the majority stays
            // 2 of 3): the write from n2 is acknowledged by exactly n1 and n2.
            cluster.injector().cut_messaging(&["n3"], &["n1", "n2"]);
            let write = |n: ddshard::Node| async move {
                n.replicator()
                    .update::<OrSet, _>("shard-ledger-7-0", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "c-1"))
                    .await
            };
            cluster.on_node(1, write).await.expect("n2 runs").expect("a majority acknowledges");
            // Crashed in the same tick the acknowledgement arrived: a commit still waiting for
            // the disk (each takes 2 ms of virtual time) is lost with its process.
            for i in 0..3 {
                cluster.crash(i).await;
            }
            let mut holders = Vec::new();
            for i in 0..3 {
                let loaded = DurableStore::open(&cluster.data_dir(i).join("ddata"), 64 << 20).unwrap().load_all().unwrap();
                let holds = loaded.entries.iter().any(|k| {
                    k.key == "shard-ledger-7-0" && matches!(&k.value, ReplicatedData::OrSet(s) if s.contains("c-1"))
                });
                if holds {
                    holders.push(VirtualCluster::node_id(i));
                }
            }
            assert_eq!(holders, ["n1", "n2"], "on the disks of exactly the acknowledging majority");
        });
    }
}
