//! Test entities shared by the sharding tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddshard::sharding::ShardingSettings;
use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardRegion};
use serde::{Deserialize, Serialize};

/// Counter entity; every handled message is also counted in `handled` (shared by all
/// incarnations), and every (entity, epoch) it ran with is recorded.
pub struct Counter {
    pub value: i64,
    pub probe: Probe,
}

#[derive(Clone, Default)]
pub struct Probe {
    pub handled: Arc<AtomicU64>,
    pub epochs: Arc<Mutex<BTreeMap<String, Vec<u64>>>>,
    pub node: String,
    pub nodes_seen: Arc<Mutex<BTreeMap<String, String>>>,
    /// Instances created (incarnations, over all entities).
    pub started: Arc<AtomicU64>,
    /// (entity id, node) of every instance created.
    pub created: Arc<Mutex<Vec<(String, String)>>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CounterMsg {
    Add(i64),
    Get,
    Stop,
    Panic,
    Epoch,
    WhereAreYou,
    /// Keeps the entity busy this long, then answers its value.
    SleepMs(u64),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CounterReply {
    Value(i64),
    Epoch(u64),
    Node(String),
}

impl Counter {
    pub fn new(probe: Probe) -> Self {
        probe.started.fetch_add(1, Ordering::Relaxed);
        Counter { value: 0, probe }
    }
}

impl Entity for Counter {
    type Message = CounterMsg;
    type Reply = CounterReply;

    async fn handle(&mut self, msg: CounterMsg, ctx: &mut EntityContext) -> CounterReply {
        self.probe.handled.fetch_add(1, Ordering::Relaxed);
        {
            let mut e = self.probe.epochs.lock().unwrap();
            let v = e.entry(ctx.entity_id().to_string()).or_default();
            if v.last() != Some(&ctx.epoch()) {
                v.push(ctx.epoch());
            }
        }
        self.probe.nodes_seen.lock().unwrap().insert(ctx.entity_id().to_string(), self.probe.node.clone());
        match msg {
            CounterMsg::Add(n) => {
                self.value += n;
                CounterReply::Value(self.value)
            }
            CounterMsg::Get => CounterReply::Value(self.value),
            CounterMsg::Stop => {
                ctx.passivate();
                CounterReply::Value(self.value)
            }
            CounterMsg::Panic => panic!("asked to panic"),
            CounterMsg::Epoch => CounterReply::Epoch(ctx.epoch()),
            CounterMsg::WhereAreYou => CounterReply::Node(self.probe.node.clone()),
            CounterMsg::SleepMs(ms) => {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                CounterReply::Value(self.value)
            }
        }
    }
}

/// Fast settings for tests.
pub fn settings() -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 20,
        retry_interval: Duration::from_millis(400),
        rebalance_interval: Duration::from_millis(500),
        handoff_timeout: Duration::from_secs(10),
        shard_start_timeout: Duration::from_secs(2),
        ask_timeout: Duration::from_secs(10),
        ..ShardingSettings::default()
    }
}

pub async fn start_counter(node: &ddshard::Node, probe: &Probe, settings: ShardingSettings) -> ShardRegion<Counter> {
    start_type(node, "counter", probe, settings).await
}

/// Every entity id running in these regions (from their region state; no message sent). A
/// region that does not answer is an error, never an empty list.
pub async fn running_ids(regions: &[ShardRegion<Counter>]) -> Result<Vec<String>, ddshard::Error> {
    let mut ids = Vec::new();
    for r in regions {
        ids.extend(r.region_state().await?.into_values().flatten());
    }
    ids.sort();
    Ok(ids)
}

/// Starts a counter type named `type_name`, recording every instance created.
pub async fn start_type(
    node: &ddshard::Node,
    type_name: &str,
    probe: &Probe,
    settings: ShardingSettings,
) -> ShardRegion<Counter> {
    let mut p = probe.clone();
    p.node = node.node_id().to_string();
    node.sharding()
        .start(
            type_name,
            move |id: &str| {
                p.created.lock().unwrap().push((id.to_string(), p.node.clone()));
                Counter::new(p.clone())
            },
            settings,
        )
        .await
        .unwrap()
}

/// Starts the counter type on every running node of the cluster.
pub async fn start_everywhere(c: &TestCluster, probe: &Probe, settings: ShardingSettings) -> Vec<ShardRegion<Counter>> {
    let mut v = Vec::new();
    for (_, n) in c.running() {
        v.push(start_counter(n, probe, settings.clone()).await);
    }
    v
}

pub async fn value(r: &ShardRegion<Counter>, id: &str) -> i64 {
    match r.ask(id, CounterMsg::Get).await.unwrap() {
        CounterReply::Value(v) => v,
        other => panic!("unexpected {other:?}"),
    }
}

pub async fn where_is(r: &ShardRegion<Counter>, id: &str) -> String {
    match r.ask(id, CounterMsg::WhereAreYou).await.unwrap() {
        CounterReply::Node(n) => n,
        other => panic!("unexpected {other:?}"),
    }
}

/// Where `id` runs, or `None` when the ask was not answered: a message that reaches a shard
/// while it is handed off is dropped (at-most-once, as documented), so a poll that spans a
/// rebalance reads such a drop as "not yet".
pub async fn where_is_if_answered(r: &ShardRegion<Counter>, id: &str) -> Option<String> {
    match r.ask(id, CounterMsg::WhereAreYou).await {
        Ok(CounterReply::Node(n)) => Some(n),
        Ok(other) => panic!("unexpected {other:?}"),
        Err(_) => None,
    }
}

/// Asks until an answer comes (a message in flight to a node that crashed is lost, as in any
/// at-most-once system; a client retries). Panics after `within`.
pub async fn ask_retry(r: &ShardRegion<Counter>, id: &str, msg: CounterMsg, within: Duration) -> CounterReply {
    ask_until(r, id, msg, within).await
}

/// [`ask_retry`] for any entity type.
pub async fn ask_until<E: Entity>(r: &ShardRegion<E>, id: &str, msg: E::Message, within: Duration) -> E::Reply
where
    E::Message: Clone,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match r.ask_with_timeout(id, msg.clone(), Duration::from_secs(2)).await {
            Ok(reply) => return reply,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no answer from {} within {within:?}: {e}", &id[..id.len().min(16)]),
        }
    }
}
