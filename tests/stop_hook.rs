//! The entity stop hook (`Entity::on_stop`, `DurableEntity::on_stop`): told why, run once per
//! incarnation that stops on purpose, bounded, and never in the way of the stop. Whole nodes in
//! virtual time, so the timeouts cost nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::sharding::StopReason;
use ddshard::testkit::eventually;
use ddshard::testkit::virtual_time::{VirtualCluster, VirtualRun};
use ddshard::{DurableEntity, Entity, EntityContext, ShardRegion, ShardingSettings};
use serde::{Deserialize, Serialize};

const ASK: Duration = Duration::from_secs(20);

/// What happened to which entity, on which node, in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<(String, String, String)>>>);

impl Log {
    fn push(&self, id: &str, node: &str, what: String) {
        self.0.lock().unwrap().push((id.to_string(), node.to_string(), what));
    }
    fn of(&self, id: &str) -> Vec<(String, String)> {
        self.0.lock().unwrap().iter().filter(|(i, _, _)| i == id).map(|(_, n, w)| (n.clone(), w.clone())).collect()
    }
}

/// How a test entity's stop hook behaves.
#[derive(Clone, Copy)]
enum Hook {
    Records,
    Panics,
    NeverEnds,
}

struct Hooked {
    log: Log,
    node: String,
    hook: Hook,
}

#[derive(Serialize, Deserialize)]
enum Cmd {
    Ping,
    Passivate,
}

impl Entity for Hooked {
    type Message = Cmd;
    type Reply = String;

    async fn started(&mut self, ctx: &EntityContext) {
        self.log.push(ctx.entity_id(), &self.node, "started".into());
    }

    async fn handle(&mut self, msg: Cmd, ctx: &mut EntityContext) -> String {
        if let Cmd::Passivate = msg {
            ctx.passivate();
        }
        self.node.clone()
    }

    async fn on_stop(&mut self, reason: StopReason, ctx: &mut EntityContext) {
        self.log.push(ctx.entity_id(), &self.node, format!("stopping {reason:?}"));
        match self.hook {
            Hook::Records => {
                // An await inside the hook: the stop waits for it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                self.log.push(ctx.entity_id(), &self.node, format!("stopped {reason:?}"));
            }
            Hook::Panics => panic!("the stop hook of {} panics", ctx.entity_id()),
            Hook::NeverEnds => std::future::pending::<()>().await,
        }
    }
}

fn settings() -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 10,
        // The entity stop timeout, and so the hook's bound: 7 s less 5 s.
        handoff_timeout: Duration::from_secs(7),
        ..ShardingSettings::default()
    }
}

async fn start(cluster: &VirtualCluster, i: usize, log: &Log, hook: Hook, s: ShardingSettings) -> ShardRegion<Hooked> {
    let (log, node) = (log.clone(), VirtualCluster::node_id(i));
    let factory = move |_: &str| Hooked { log: log.clone(), node: node.clone(), hook };
    let start = |n: ddshard::Node| async move { n.sharding().start("hooked", factory, s).await };
    cluster.on_node(i, start).await.expect("the node runs").expect("the region starts")
}

async fn ask(cluster: &VirtualCluster, i: usize, region: &ShardRegion<Hooked>, id: &str, cmd: Cmd) -> String {
    let (region, id) = (region.clone(), id.to_string());
    let asked = cluster.on_node(i, move |_| async move { region.ask_with_timeout(&id, cmd, ASK).await });
    asked.await.expect("the asking node runs").expect("answered")
}

/// Waits until `id`'s log has `n` entries.
async fn await_log(log: &Log, id: &str, n: usize) -> Vec<(String, String)> {
    let (log, id2) = (log.clone(), id.to_string());
    eventually(Duration::from_secs(60), &format!("{id} logged {n} events"), move || {
        let events = log.of(&id2);
        std::future::ready((events.len() >= n).then_some(events))
    })
    .await
}

fn event(node: &str, what: &str) -> (String, String) {
    (node.to_string(), what.to_string())
}

#[test]
fn an_entity_that_passivates_runs_its_stop_hook_to_the_end_told_passivated_and_its_next_message_starts_it_again() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        let log = Log::default();
        let region = start(&cluster, 0, &log, Hook::Records, settings()).await;
        ask(&cluster, 0, &region, "a", Cmd::Passivate).await;
        // Sent while the hook runs: it waits for the next incarnation.
        ask(&cluster, 0, &region, "a", Cmd::Ping).await;
        let events = await_log(&log, "a", 4).await;
        assert_eq!(
            events,
            [
                event("n1", "started"),
                event("n1", "stopping Passivated"),
                event("n1", "stopped Passivated"),
                event("n1", "started")
            ]
        );
        assert_eq!(region.counters().passivations_explicit, 1);
    });
}

#[test]
fn an_idle_entity_runs_its_stop_hook_told_idle() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        let log = Log::default();
        let mut s = settings();
        s.passivation.idle_timeout = Some(Duration::from_secs(30));
        let region = start(&cluster, 0, &log, Hook::Records, s).await;
        ask(&cluster, 0, &region, "idle", Cmd::Ping).await;
        let events = await_log(&log, "idle", 3).await;
        assert_eq!(events, [event("n1", "started"), event("n1", "stopping Idle"), event("n1", "stopped Idle")]);
    });
}

#[test]
fn a_leaving_node_runs_the_stop_hook_of_each_entity_it_hands_off_before_that_entity_starts_on_the_node_that_stays() {
    VirtualRun::new(2).run(|cluster: VirtualCluster| async move {
        cluster.await_converged(Duration::from_secs(30)).await;
        let log = Log::default();
        let s = ShardingSettings { min_nr_of_members: 2, ..settings() };
        let regions = [
            start(&cluster, 0, &log, Hook::Records, s.clone()).await,
            start(&cluster, 1, &log, Hook::Records, s).await,
        ];
        let ids: Vec<String> = (0..20).map(|k| format!("e{k}")).collect();
        let mut on_n2 = Vec::new();
        for id in &ids {
            if ask(&cluster, 0, &regions[0], id, Cmd::Ping).await == "n2" {
                on_n2.push(id.clone());
            }
        }
        assert!(!on_n2.is_empty(), "n2 hosts some of them");
        cluster.on_node(1, |n| async move { n.leave().await }).await.expect("n2 runs").expect("n2 left");
        for id in &on_n2 {
            assert_eq!(ask(&cluster, 0, &regions[0], id, Cmd::Ping).await, "n1", "{id} moved to n1");
            let events = await_log(&log, id, 4).await;
            assert_eq!(
                events,
                [
                    event("n2", "started"),
                    event("n2", "stopping HandOff"),
                    event("n2", "stopped HandOff"),
                    event("n1", "started")
                ],
                "{id}: its hook ran to the end before it started on n1"
            );
        }
    });
}

#[test]
fn a_stop_hook_that_panics_is_counted_and_the_entity_stops_all_the_same() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        let log = Log::default();
        let region = start(&cluster, 0, &log, Hook::Panics, settings()).await;
        ask(&cluster, 0, &region, "p", Cmd::Passivate).await;
        assert_eq!(ask(&cluster, 0, &region, "p", Cmd::Ping).await, "n1", "a new incarnation answers");
        let events = await_log(&log, "p", 3).await;
        assert_eq!(events, [event("n1", "started"), event("n1", "stopping Passivated"), event("n1", "started")]);
        assert_eq!(region.counters().entity_panics, 1);
    });
}

#[test]
fn a_stop_hook_that_never_ends_is_dropped_at_its_bound_and_what_was_sent_meanwhile_reaches_the_next_incarnation() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        let log = Log::default();
        let region = start(&cluster, 0, &log, Hook::NeverEnds, settings()).await;
        ask(&cluster, 0, &region, "stuck", Cmd::Passivate).await;
        let sent = tokio::time::Instant::now();
        assert_eq!(ask(&cluster, 0, &region, "stuck", Cmd::Ping).await, "n1");
        let waited = sent.elapsed();
        assert!(waited >= Duration::from_secs(2), "answered after the hook's bound of 2 s, not before: {waited:?}");
        assert!(waited < Duration::from_secs(3), "and not much later: {waited:?}");
        let events = await_log(&log, "stuck", 3).await;
        assert_eq!(events, [event("n1", "started"), event("n1", "stopping Passivated"), event("n1", "started")]);
        assert_eq!(region.counters().stop_hook_overruns, 1);
    });
}

/// A durable counter that counts its own stops in its state.
#[derive(Default)]
struct Tally;

#[derive(Default, Serialize, Deserialize)]
struct TallyState {
    added: u64,
    stops: u64,
}

#[derive(Serialize, Deserialize)]
enum TallyCmd {
    Add,
    Passivate,
    Read,
}

impl DurableEntity for Tally {
    type Message = TallyCmd;
    type Reply = (u64, u64);
    type State = TallyState;

    async fn handle(&mut self, state: &mut TallyState, msg: TallyCmd, ctx: &mut EntityContext) -> (u64, u64) {
        match msg {
            TallyCmd::Add => {
                state.added += 1;
                ctx.persist();
            }
            TallyCmd::Passivate => ctx.passivate(),
            TallyCmd::Read => {}
        }
        (state.added, state.stops)
    }

    async fn on_stop(&mut self, state: &mut TallyState, _reason: StopReason, ctx: &mut EntityContext) {
        state.stops += 1;
        ctx.persist();
    }
}

#[test]
fn a_durable_entity_that_persists_in_its_stop_hook_finds_that_state_in_its_next_incarnation() {
    VirtualRun::new(1).run(|cluster: VirtualCluster| async move {
        let region = cluster
            .on_node(0, |n| async move { n.sharding().start_durable("tally", |_: &str| Tally, settings()).await })
            .await
            .expect("the node runs")
            .expect("the region starts");
        let ask = |cmd: TallyCmd| {
            let region = region.clone();
            cluster.on_node(0, move |_| async move { region.ask_with_timeout("t", cmd, ASK).await.expect("answered") })
        };
        assert_eq!(ask(TallyCmd::Add).await.unwrap(), (1, 0));
        assert_eq!(ask(TallyCmd::Passivate).await.unwrap(), (1, 0));
        assert_eq!(ask(TallyCmd::Read).await.unwrap(), (1, 1), "the stop the hook persisted was loaded");
        assert_eq!(ask(TallyCmd::Passivate).await.unwrap(), (1, 1));
        assert_eq!(ask(TallyCmd::Read).await.unwrap(), (1, 2));
    });
}
