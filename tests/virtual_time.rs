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

/// Remembered entities (4 slots per shard), with the coordinator's state written and read at
/// plain majorities of today's members, so allocations go on while one node of three is cut
/// off (Akka's plus 3 and min-cap 5 need every member of a small cluster, so a member that
/// missed a write could not exist).
fn remembering_at_plain_majorities() -> ShardingSettings {
    let defaults = ShardingSettings::default();
    ShardingSettings {
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, slots: 4, ..defaults.remember },
        coordinator: ddshard::sharding::ShardCoordinatorSettings {
            write_majority_plus: 0,
            read_majority_plus: 0,
            majority_min_cap: 0,
            ..defaults.coordinator
        },
        ..settings()
    }
}

/// Every entity id running in `regions` (no message sent to any), each asked on its node.
async fn running_ids(
    cluster: &VirtualCluster,
    regions: &[(usize, ddshard::ShardRegion<Echo>)],
) -> std::collections::BTreeSet<String> {
    let mut ids = std::collections::BTreeSet::new();
    for (i, region) in regions {
        let region = region.clone();
        if let Some(Ok(state)) = cluster.on_node(*i, move |_| async move { region.region_state().await }).await {
            ids.extend(state.into_values().flatten());
        }
    }
    ids
}

/// Waits (up to a virtual minute) until exactly `expected` runs in `regions`, without a
/// message to any; panics naming the ids missing.
async fn await_running(
    cluster: &VirtualCluster,
    regions: &[(usize, ddshard::ShardRegion<Echo>)],
    expected: &std::collections::BTreeSet<String>,
    when: &str,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let running = running_ids(cluster, regions).await;
        if &running == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "remembered entities not running {when}: {:?}",
            expected.difference(&running).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
                let loaded =
                    DurableStore::open(&cluster.data_dir(i).join("ddata"), 64 << 20).unwrap().load_all().unwrap();
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

mod take_over {
    use super::*;
    use std::collections::BTreeSet;

    use ddshard::testkit::eventually;

    fn remembering() -> ShardingSettings {
        // The shards start on n1 and n2 alone.
        ShardingSettings { min_nr_of_members: 2, ..remembering_at_plain_majorities() }
    }

    async fn start_echo(cluster: &VirtualCluster, i: usize) -> ddshard::ShardRegion<Echo> {
        let start = |n: ddshard::Node| async move { n.sharding().start("echo", |_: &str| Echo, remembering()).await };
        cluster.on_node(i, start).await.expect("the node runs").expect("the region starts")
    }

    #[test]
    fn a_take_over_by_a_node_whose_replicas_missed_the_remembered_shards_restores_every_one_once_the_others_return() {
        VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            // n3 hosts nothing yet, and is cut off (n1 and n2 see it unreachable) while
            // entities in every shard start on n1 and n2: the coordinator's state and the
            // remembered shards reach n1 and n2 only.
            let regions = [start_echo(&cluster, 0).await, start_echo(&cluster, 1).await];
            cluster.partition(&[2], &[0, 1]);
            eventually(Duration::from_secs(30), "n1 and n2 see n3 unreachable", || {
                let sees = |i: usize| {
                    cluster
                        .node(i)
                        .is_some_and(|n| n.members().iter().any(|m| m.node_id() == "n3" && !m.is_reachable()))
                };
                std::future::ready((sees(0) && sees(1)).then_some(()))
            })
            .await;
            let ids: Vec<String> = (0..40).map(|k| format!("e{k}")).collect();
            let (region, asked) = (regions[0].clone(), ids.clone());
            let asks = move |_| async move {
                for id in &asked {
                    assert_eq!(&region.ask_with_timeout(id, Ping, Duration::from_secs(10)).await.unwrap(), id);
                }
            };
            cluster.on_node(0, asks).await.expect("n1 runs");
            // The two nodes that hold them crash; the operator downs them, so n3 is the oldest
            // member and takes the coordinator over from its stale replicas.
            cluster.crash(0).await;
            cluster.crash(1).await;
            cluster.heal();
            for gone in ["n1", "n2"] {
                cluster.on_node(2, move |n| async move { n.down(gone).await }).await.unwrap().unwrap();
            }
            // They come back as new incarnations with their disks: a take-over that read the
            // remembered shards at a majority of the roster restores all 40 without a message.
            cluster.start(0).await.unwrap();
            cluster.start(1).await.unwrap();
            let mut now_running = vec![(2, start_echo(&cluster, 2).await)];
            for i in 0..2 {
                now_running.push((i, start_echo(&cluster, i).await));
            }
            let expected: BTreeSet<String> = ids.into_iter().collect();
            await_running(&cluster, &now_running, &expected, "after the take-over").await;
        });
    }
}

mod remember_store {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    use ddshard::ShardRegion;
    use ddshard::sharding::default_shard_id;
    use ddshard::testkit::eventually;

    const SHARDS: u32 = 6;

    fn remembering() -> ShardingSettings {
        ShardingSettings { number_of_shards: SHARDS, ..remembering_at_plain_majorities() }
    }

    async fn start_echo(cluster: &VirtualCluster, i: usize) -> (usize, ShardRegion<Echo>) {
        let start = |n: ddshard::Node| async move { n.sharding().start("echo", |_: &str| Echo, remembering()).await };
        (i, cluster.on_node(i, start).await.expect("the node runs").expect("the region starts"))
    }

    /// Each running region's shards and their running entity ids, asked on its own node.
    async fn placement(
        cluster: &VirtualCluster,
        regions: &[(usize, ShardRegion<Echo>)],
    ) -> BTreeMap<usize, BTreeMap<String, Vec<String>>> {
        let mut placed = BTreeMap::new();
        for (i, region) in regions {
            let region = region.clone();
            if let Some(Ok(state)) = cluster.on_node(*i, move |_| async move { region.region_state().await }).await {
                placed.insert(*i, state);
            }
        }
        placed
    }

    async fn ask_all(cluster: &VirtualCluster, (i, region): &(usize, ShardRegion<Echo>), ids: &[String]) {
        let (region, ids) = (region.clone(), ids.to_vec());
        let asks = move |_| async move {
            for id in &ids {
                assert_eq!(&region.ask_with_timeout(id, Ping, Duration::from_secs(10)).await.unwrap(), id);
            }
        };
        cluster.on_node(*i, asks).await.expect("the asking node runs");
    }

    /// Issue 42, step 5. Ids remembered while the roster was n1–n3 are acknowledged by n2 (their
    /// shard's home) and n3 alone. The cluster grows to seven, n2 crashes and is downed, and its
    /// shards move to a new node whose load of their remembered ids needs 4 of the 7: n1 and
    /// the new nodes answer at once and hold none of them, while n3 — the only other holder, a
    /// reachable member — hears nothing on the message path for 10 s. A load that took the
    /// first majority lost every id (and, with no anti-entropy meanwhile, even the ids all
    /// three held); a load that reads every reachable replica waits for n3 and brings them
    /// all back.
    #[test]
    fn ids_remembered_under_three_members_come_back_after_growing_to_seven_and_losing_their_home_while_the_other_holder_is_cut_off()
     {
        VirtualRun::new(7)
            .initially(3)
            .configure(|_, c| {
                // No anti-entropy within the test: only the acknowledging replicas hold the ids.
                c.replicator.gossip_interval = Duration::from_secs(3600);
                // n3, cut off the message path for 10 s, stays a reachable member meanwhile.
                c.failure_detector.acceptable_pause = Duration::from_secs(60);
            })
            .run(|cluster: VirtualCluster| async move {
                cluster.await_converged(Duration::from_secs(30)).await;
                let mut regions = Vec::new();
                for i in 0..3 {
                    regions.push(start_echo(&cluster, i).await);
                }
                // Every shard allocated and remembered while all three hear every write.
                let warm: Vec<String> = (0..30).map(|k| format!("w{k}")).collect();
                ask_all(&cluster, &regions[0], &warm).await;
                let on_n2: BTreeSet<String> =
                    placement(&cluster, &regions[1..2]).await.remove(&1).unwrap_or_default().into_keys().collect();
                assert!(!on_n2.is_empty(), "n2 hosts shards");
                let ids: Vec<String> = (0..400)
                    .map(|k| format!("e{k}"))
                    .filter(|id| on_n2.contains(&default_shard_id(id, SHARDS)))
                    .take(10)
                    .collect();
                // n1 hears no replicator message from n2 or n3 (gossip flows): the starts n2
                // remembers are acknowledged by n2 and n3, a majority of three.
                cluster.injector().cut_messaging(&["n1"], &["n2", "n3"]);
                ask_all(&cluster, &regions[1], &ids).await;
                cluster.crash(1).await;
                regions.remove(1);
                cluster.heal();
                for i in 3..7 {
                    cluster.start(i).await.unwrap();
                }
                eventually(Duration::from_secs(30), "n1 sees n4..n7 up", || {
                    let members = cluster.node(0).map(|n| n.members()).unwrap_or_default();
                    let up = members.iter().filter(|m| m.status() == ddshard::MemberStatus::Up).count();
                    std::future::ready((up == 7).then_some(()))
                })
                .await;
                for i in 3..7 {
                    regions.push(start_echo(&cluster, i).await);
                }
                // n3's messages are held up (gossip flows: it is a reachable member), and n2 is
                // downed: its shards move to the nodes with none.
                cluster.injector().cut_messaging(&["n3"], &["n1", "n4", "n5", "n6", "n7"]);
                cluster.on_node(0, |n| async move { n.down("n2").await }).await.unwrap().unwrap();
                tokio::time::sleep(Duration::from_secs(10)).await;
                cluster.heal();
                let expected: BTreeSet<String> = warm.iter().chain(&ids).cloned().collect();
                await_running(&cluster, &regions, &expected, "again").await;
            });
    }
}

mod warm_up {
    use super::*;

    use ddshard::ShardRegion;

    const SHARDS: u32 = 12;

    fn sharded() -> ShardingSettings {
        ShardingSettings { number_of_shards: SHARDS, ..settings() }
    }

    async fn start_echo(cluster: &VirtualCluster, i: usize) -> ShardRegion<Echo> {
        let start = |n: ddshard::Node| async move { n.sharding().start("echo", |_: &str| Echo, sharded()).await };
        cluster.on_node(i, start).await.expect("the node runs").expect("the region starts")
    }

    /// One id in each shard.
    fn one_per_shard() -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for k in 0.. {
            let id = format!("e{k}");
            let shard = ddshard::sharding::default_shard_id(&id, SHARDS);
            if !ids.iter().any(|known| ddshard::sharding::default_shard_id(known, SHARDS) == shard) {
                ids.push(id);
            }
            if ids.len() == SHARDS as usize {
                return ids;
            }
        }
        unreachable!()
    }

    /// Asks every id once, all at once, on node `i`.
    async fn ask_each(cluster: &VirtualCluster, i: usize, region: &ShardRegion<Echo>, ids: &[String]) {
        let (region, ids) = (region.clone(), ids.to_vec());
        let asks = move |_| async move {
            let asks = ids.iter().map(|id| region.ask_with_timeout(id, Ping, Duration::from_secs(20)));
            for (id, answer) in ids.iter().zip(futures::future::join_all(asks).await) {
                assert_eq!(&answer.expect("answered"), id);
            }
        };
        cluster.on_node(i, asks).await.expect("the asking node runs");
    }

    /// Issue 42, step 2. Each node of three leaves, restarts as a new incarnation and, the
    /// moment its region starts, is asked for an entity in every shard. The coordinator sends a
    /// registering region every home it knows before acknowledging it, so none of those first
    /// messages waits for a `GetShardHome` round trip.
    #[test]
    fn after_a_rolling_restart_the_first_message_to_each_known_shard_needs_no_home_request() {
        VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            let ids = one_per_shard();
            let mut regions = Vec::new();
            for i in 0..3 {
                regions.push(start_echo(&cluster, i).await);
            }
            ask_each(&cluster, 0, &regions[0], &ids).await;
            let mut requests = Vec::new();
            for i in [2, 1, 0] {
                cluster.on_node(i, |n| async move { n.leave().await }).await.expect("runs").expect("left");
                cluster.crash(i).await;
                // Traffic from a node that stays allocates the shards the leaver handed off.
                let other = (i + 1) % 3;
                ask_each(&cluster, other, &regions[other], &ids).await;
                cluster.start(i).await.unwrap();
                cluster.await_converged(Duration::from_secs(30)).await;
                regions[i] = start_echo(&cluster, i).await;
                ask_each(&cluster, i, &regions[i], &ids).await;
                requests.push((VirtualCluster::node_id(i), regions[i].counters().home_requests));
            }
            println!("home requests of each restarted region for its first {SHARDS} messages: {requests:?}");
            assert!(requests.iter().all(|(_, n)| *n == 0), "{requests:?}");
        });
    }
}

mod recovery_pace {
    use super::*;
    use std::sync::{Arc, Mutex};

    use ddshard::ShardRegion;

    /// Start times (virtual) of each incarnation, by id.
    type Starts = Arc<Mutex<Vec<(String, tokio::time::Instant)>>>;

    struct Recorded {
        starts: Starts,
    }

    impl Entity for Recorded {
        type Message = Ping;
        type Reply = String;
        async fn started(&mut self, ctx: &EntityContext) {
            self.starts.lock().unwrap().push((ctx.entity_id().to_string(), tokio::time::Instant::now()));
        }
        async fn handle(&mut self, _msg: Ping, ctx: &mut EntityContext) -> String {
            ctx.entity_id().to_string()
        }
    }

    const BATCH: usize = 10;
    const INTERVAL: Duration = Duration::from_secs(1);

    fn paced() -> ShardingSettings {
        let defaults = ShardingSettings::default();
        ShardingSettings {
            // One shard: its remembered ids come back in one load, paced.
            number_of_shards: 1,
            remember: ddshard::sharding::RememberEntitiesSettings {
                enabled: true,
                recovery_batch: BATCH,
                recovery_interval: INTERVAL,
                ..defaults.remember
            },
            min_nr_of_members: 1,
            ..settings()
        }
    }

    async fn start(cluster: &VirtualCluster, starts: &Starts) -> ShardRegion<Recorded> {
        let starts = starts.clone();
        let factory = move |_: &str| Recorded { starts: starts.clone() };
        let start = |n: ddshard::Node| async move { n.sharding().start("paced", factory, paced()).await };
        cluster.on_node(0, start).await.expect("the node runs").expect("the region starts")
    }

    /// Issue 42, step 9: `remember.recovery_batch` and `recovery_interval` (the constant
    /// recovery strategy) start a restarted shard's remembered entities `BATCH` per interval,
    /// never more, and every one of them.
    #[test]
    fn remembered_entities_come_back_after_a_restart_ten_per_recovery_interval_and_all_of_them() {
        VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
            let starts: Starts = Arc::default();
            let region = start(&cluster, &starts).await;
            let ids: Vec<String> = (0..45).map(|k| format!("r{k}")).collect();
            let asked = ids.clone();
            let asks = move |_| async move {
                for id in &asked {
                    assert_eq!(&region.ask_with_timeout(id, Ping, Duration::from_secs(10)).await.unwrap(), id);
                }
            };
            cluster.on_node(0, asks).await.expect("n1 runs");
            cluster.crash(0).await;
            starts.lock().unwrap().clear();
            cluster.start(0).await.unwrap();
            let _region = start(&cluster, &starts).await;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while starts.lock().unwrap().len() < ids.len() {
                assert!(tokio::time::Instant::now() < deadline, "not every remembered entity came back");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Two more intervals in which no start may follow the last batch (checked below:
            // each id exactly once).
            tokio::time::sleep(INTERVAL * 2).await;
            let starts = starts.lock().unwrap().clone();
            let mut came_back: Vec<&str> = starts.iter().map(|(id, _)| id.as_str()).collect();
            came_back.sort_unstable();
            let mut expected: Vec<&str> = ids.iter().map(String::as_str).collect();
            expected.sort_unstable();
            assert_eq!(came_back, expected, "every remembered entity, once");
            // Counted per interval from the first batch: 10, 10, 10, 10, 5.
            let first = starts.iter().map(|(_, at)| *at).min().unwrap();
            let mut per_interval = [0usize; 6];
            for (_, at) in &starts {
                let k = ((*at - first).as_millis() / INTERVAL.as_millis()) as usize;
                per_interval[k.min(5)] += 1;
            }
            println!("remembered entities started per {INTERVAL:?}: {per_interval:?}");
            assert_eq!(per_interval, [10, 10, 10, 10, 5, 0]);
        });
    }
}

mod load_cap {
    use super::*;

    use ddshard::ShardRegion;

    fn capped(cap: usize) -> ShardingSettings {
        ShardingSettings {
            number_of_shards: 12,
            max_concurrent_shard_loads: cap,
            // Shards go to n1 and n2 (n3 may not have registered before it is cut off).
            min_nr_of_members: 2,
            ..remembering_at_plain_majorities()
        }
    }

    /// Load timeouts on n1 and n2 once every shard has been asked for and 2.5 s have passed:
    /// each load waits for n3 (a reachable member that hears nothing), whose read times out
    /// after 2 s.
    fn timeouts_after_loads_start(cap: usize) -> Vec<u64> {
        VirtualRun::new(3).configure(|_, c| c.failure_detector.acceptable_pause = Duration::from_secs(60)).run(
            move |cluster: VirtualCluster| async move {
                cluster.await_converged(Duration::from_secs(30)).await;
                let mut regions: Vec<ShardRegion<Echo>> = Vec::new();
                for i in 0..3 {
                    let start = move |n: ddshard::Node| async move {
                        n.sharding().start("echo", |_: &str| Echo, capped(cap)).await
                    };
                    regions.push(cluster.on_node(i, start).await.unwrap().unwrap());
                }
                cluster.injector().cut_messaging(&["n3"], &["n1", "n2"]);
                let region = regions[0].clone();
                cluster
                    .on_node(0, move |_| async move {
                        for k in 0..60 {
                            let region = region.clone();
                            tokio::spawn(async move {
                                region.ask_with_timeout(&format!("e{k}"), Ping, Duration::from_secs(30)).await
                            });
                        }
                    })
                    .await
                    .unwrap();
                // The count is taken at a point in virtual time: past the first read timeout
                // (2 s), before the second (4 s).
                tokio::time::sleep(Duration::from_millis(2500)).await;
                regions[..2].iter().map(|r| r.counters().shard_load_timeouts).collect()
            },
        )
    }

    /// Issue 42, step 6: a region loads at most `max_concurrent_shard_loads` shards at once.
    #[test]
    fn a_region_runs_at_most_its_cap_of_shard_loads_at_once_and_the_rest_wait_their_turn() {
        let capped = timeouts_after_loads_start(1);
        let uncapped = timeouts_after_loads_start(100);
        println!(
            "load timeouts within the first read timeout on n1 and n2: capped at 1 {capped:?}, uncapped {uncapped:?}"
        );
        assert!(capped.iter().all(|t| *t <= 1), "one load at a time per region: {capped:?}");
        assert!(uncapped.iter().sum::<u64>() > 2, "uncapped, every shard's load ran at once: {uncapped:?}");
    }
}

mod settings_agreement {
    use super::*;

    use ddshard::{DurableEntity, Error};

    #[derive(Default)]
    struct Tally;

    impl DurableEntity for Tally {
        type Message = Ping;
        type Reply = u64;
        type State = u64;
        async fn handle(&mut self, state: &mut u64, _msg: Ping, ctx: &mut EntityContext) -> u64 {
            *state += 1;
            ctx.persist();
            *state
        }
    }

    fn with_slots(slots: u32) -> ShardingSettings {
        let defaults = ShardingSettings::default();
        ShardingSettings {
            state: ddshard::sharding::DurableStateSettings { slots, ..defaults.state },
            min_nr_of_members: 1,
            ..settings()
        }
    }

    /// Issue 42, step 7. n2 starts a durable type with 8 state slots where the cluster has 16:
    /// it would read and write other keys and miss states. Its region is refused with an error
    /// naming the setting, and n1 keeps serving.
    #[test]
    fn a_node_started_with_other_state_slots_is_refused_naming_the_setting_and_the_cluster_keeps_serving() {
        VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            let start = |slots: u32| {
                move |n: ddshard::Node| async move {
                    n.sharding().start_durable("tally", |_: &str| Tally, with_slots(slots)).await
                }
            };
            let r1 = cluster.on_node(0, start(16)).await.unwrap().unwrap();
            let r2 = cluster.on_node(1, start(8)).await.unwrap().unwrap();
            let ask = |i: usize, region: ddshard::ShardRegion<Durable<Tally>>| {
                cluster.on_node(
                    i,
                    move |_| async move { region.ask_with_timeout("t", Ping, Duration::from_secs(10)).await },
                )
            };
            assert_eq!(ask(0, r1.clone()).await.unwrap().unwrap(), 1, "n1 serves");
            let refused = eventually(Duration::from_secs(30), "n2's region is refused", || {
                let r2 = r2.clone();
                async move { r2.erased().info().await.ok().filter(|i| i.refused) }
            })
            .await;
            assert!(!refused.registered);
            match ask(1, r2.clone()).await.unwrap() {
                Err(Error::NotDelivered { reason, .. }) => {
                    assert!(reason.contains("`state.slots` is 8 there but 16"), "{reason}");
                }
                other => panic!("refused with the setting named: {other:?}"),
            }
            assert_eq!(ask(0, r1).await.unwrap().unwrap(), 2, "n1 still serves");
        });
    }

    use ddshard::Durable;
    use ddshard::testkit::eventually;
}
