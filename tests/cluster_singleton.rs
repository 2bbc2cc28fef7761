//! Cluster singletons (`Sharding::singleton`): one instance in the cluster, running without a
//! message, moved by a leave, restarted after a crash, reached from nodes without its role.
//! Whole nodes in virtual time; every instance is recorded in an activation log that checks
//! at most one runs at a time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::activation::{ActivationGuard, ActivationLog};
use ddshard::sharding::{ClusterSingleton, Durable, StopReason};
use ddshard::testkit::eventually;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{DurableEntity, Entity, EntityContext, ShardingSettings};
use serde::{Deserialize, Serialize};

const WAIT: Duration = Duration::from_secs(60);

/// The singleton under test: says where it runs, counts in memory, records its life.
struct Leader {
    node: String,
    log: ActivationLog,
    stops: Arc<Mutex<Vec<(String, StopReason)>>>,
    running: Option<ActivationGuard>,
    handled: u64,
}

#[derive(Serialize, Deserialize)]
struct Where;

impl Entity for Leader {
    type Message = Where;
    type Reply = (String, u64);
    async fn started(&mut self, ctx: &EntityContext) {
        self.running = Some(self.log.started("leader", &self.node, ctx.epoch()));
    }
    async fn handle(&mut self, _msg: Where, _ctx: &mut EntityContext) -> (String, u64) {
        self.handled += 1;
        (self.node.clone(), self.handled)
    }
    async fn on_stop(&mut self, reason: StopReason, _ctx: &mut EntityContext) {
        self.stops.lock().unwrap().push((self.node.clone(), reason));
    }
}

#[derive(Clone, Default)]
struct Probe {
    log: ActivationLog,
    stops: Arc<Mutex<Vec<(String, StopReason)>>>,
}

fn settings() -> ShardingSettings {
    ShardingSettings { min_nr_of_members: 2, ..ShardingSettings::default() }
}

async fn join(cluster: &VirtualCluster, i: usize, probe: &Probe, s: ShardingSettings) -> ClusterSingleton<Leader> {
    let (probe, node) = (probe.clone(), VirtualCluster::node_id(i));
    let start = move |n: ddshard::Node| async move {
        let factory = move || Leader {
            node: node.clone(),
            log: probe.log.clone(),
            stops: probe.stops.clone(),
            running: None,
            handled: 0,
        };
        n.sharding().singleton("leader", factory, s).await
    };
    cluster.on_node(i, start).await.expect("the node runs").expect("the singleton starts")
}

/// The node the one live instance runs on, once exactly one runs.
async fn await_one_live(probe: &Probe, not_on: &[&str]) -> String {
    eventually(WAIT, "exactly one instance runs", || {
        let live: Vec<String> =
            probe.log.activations().into_iter().filter(|a| a.stop.is_none()).map(|a| a.node).collect();
        let one = (live.len() == 1 && !not_on.contains(&live[0].as_str())).then(|| live[0].clone());
        std::future::ready(one)
    })
    .await
}

async fn ask(cluster: &VirtualCluster, i: usize, s: &ClusterSingleton<Leader>) -> (String, u64) {
    let s = s.clone();
    cluster.on_node(i, move |_| async move { s.ask_with_timeout(Where, WAIT).await }).await.unwrap().unwrap()
}

fn index_of(node: &str) -> usize {
    (0..8).find(|i| VirtualCluster::node_id(*i) == node).unwrap()
}

/// Issue 42, step 8. Three nodes start the singleton; one instance runs before any message,
/// every node's asks reach it, and when its node leaves it moves once (its stop hook told of
/// the hand-off) while asks sent meanwhile wait for the new instance.
#[test]
fn one_instance_runs_unasked_answers_every_node_and_moves_once_when_its_node_leaves() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let probe = Probe::default();
        let mut singletons = Vec::new();
        for i in 0..3 {
            singletons.push(join(&cluster, i, &probe, settings()).await);
        }
        let host = await_one_live(&probe, &[]).await;
        for (i, s) in singletons.iter().enumerate() {
            assert_eq!(ask(&cluster, i, s).await.0, host, "node {i} reaches the one instance");
        }
        let s = singletons[index_of(&host)].clone();
        let location = cluster.on_node(index_of(&host), move |_| async move { s.location().await }).await.unwrap();
        assert_eq!(location.unwrap().as_deref(), Some(host.as_str()));

        let asker = (index_of(&host) + 1) % 3;
        let during = {
            let s = singletons[asker].clone();
            cluster.on_node(asker, move |_| async move {
                let asks = (0..20).map(|_| s.ask_with_timeout(Where, WAIT));
                futures::future::join_all(asks).await
            })
        };
        let leave = cluster.on_node(index_of(&host), |n| async move { n.leave().await });
        let (answers, left) = futures::future::join(during, leave).await;
        left.unwrap().unwrap();
        assert!(answers.unwrap().into_iter().all(|a| a.is_ok()), "every ask sent during the move is answered");
        let new_host = await_one_live(&probe, &[&host]).await;
        assert_eq!(ask(&cluster, asker, &singletons[asker]).await.0, new_host);
        assert_eq!(probe.stops.lock().unwrap().clone(), [(host, StopReason::HandOff)]);
        assert_eq!(probe.log.activations().len(), 2, "one move, one new instance");
        probe.log.check().unwrap();
    });
}

/// The singleton's node crashes; once the crash is downed, the singleton starts on another
/// node without any message, and never ran twice at once.
#[test]
fn a_crashed_hosts_singleton_runs_again_elsewhere_without_a_message() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let probe = Probe::default();
        for i in 0..3 {
            join(&cluster, i, &probe, settings()).await;
        }
        let host = await_one_live(&probe, &[]).await;
        probe.log.node_died(&host);
        cluster.crash(index_of(&host)).await;
        let other = (index_of(&host) + 1) % 3;
        let down = host.clone();
        cluster.on_node(other, move |n| async move { n.down(&down).await }).await.unwrap().unwrap();
        let new_host = await_one_live(&probe, &[&host]).await;
        assert_ne!(new_host, host);
        probe.log.check().unwrap();
    });
}

/// With a role, nodes without it route to the singleton and never host it, even when every
/// node with the role but one has left.
#[test]
fn nodes_without_the_singletons_role_reach_it_and_never_host_it() {
    VirtualRun::new(3)
        .configure(|i, c| {
            if i < 2 {
                c.roles = vec!["backend".into()];
            }
        })
        .run(|cluster: VirtualCluster| async move {
            cluster.await_converged(Duration::from_secs(30)).await;
            let probe = Probe::default();
            let with_role = ShardingSettings { role: Some("backend".into()), ..settings() };
            let mut singletons = Vec::new();
            for i in 0..3 {
                singletons.push(join(&cluster, i, &probe, with_role.clone()).await);
            }
            let host = await_one_live(&probe, &["n3"]).await;
            assert_eq!(ask(&cluster, 2, &singletons[2]).await.0, host, "the proxy on n3 reaches it");
            cluster.on_node(index_of(&host), |n| async move { n.leave().await }).await.unwrap().unwrap();
            let new_host = await_one_live(&probe, &[&host, "n3"]).await;
            assert_eq!(ask(&cluster, 2, &singletons[2]).await.0, new_host);
            assert!(probe.log.activations().iter().all(|a| a.node != "n3"), "n3 never hosted it");
            probe.log.check().unwrap();
        });
}

/// A durable singleton: its state moves with it.
#[derive(Default)]
struct Sequence;

impl DurableEntity for Sequence {
    type State = u64;
    type Message = ();
    type Reply = u64;
    async fn handle(&mut self, next: &mut u64, _msg: (), ctx: &mut EntityContext) -> u64 {
        *next += 1;
        ctx.persist();
        *next
    }
}

#[test]
fn a_durable_singletons_state_moves_with_it_when_its_node_leaves() {
    VirtualRun::new(3).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let mut singletons: Vec<ClusterSingleton<Durable<Sequence>>> = Vec::new();
        for i in 0..3 {
            let start =
                |n: ddshard::Node| async move { n.sharding().durable_singleton("seq", || Sequence, settings()).await };
            singletons.push(cluster.on_node(i, start).await.unwrap().unwrap());
        }
        let next = |i: usize| {
            let s: ClusterSingleton<Durable<Sequence>> = singletons[i].clone();
            cluster.on_node(i, move |_| async move { s.ask_with_timeout((), WAIT).await })
        };
        for want in 1..=3 {
            assert_eq!(next(0).await.unwrap().unwrap(), want);
        }
        let s = singletons[0].clone();
        let host = cluster.on_node(0, move |_| async move { s.location().await }).await.unwrap().unwrap().unwrap();
        cluster.on_node(index_of(&host), |n| async move { n.leave().await }).await.unwrap().unwrap();
        let asker = (index_of(&host) + 1) % 3;
        assert_eq!(next(asker).await.unwrap().unwrap(), 4, "the next number, from the state that moved");
    });
}
