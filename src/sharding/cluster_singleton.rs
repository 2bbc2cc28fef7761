//! Cluster singletons for applications: one instance of an entity in the whole cluster (a
//! scheduler, a leader-only job, an allocator), addressed without an id.
//!
//! **Promise.** At most one instance runs at a time, with the guarantees of one sharded entity
//! (its shard has one home; across a partition that rests on downing, as for every entity, and
//! a durable singleton's writes from a stale home are fenced); it runs without being asked —
//! started when the first node starts the singleton, and again on its new home after its node
//! leaves (a hand-off: the stop hook runs first) or crashes (once the crash is downed) — and
//! it keeps running (no idle passivation; one that calls `ctx.passivate()` is forgotten until
//! its next message). Messages sent meanwhile wait in the sending node's region buffer
//! (`buffer_size`), as for any entity, and are answered by the new instance.
//!
//! Built on sharding: the singleton is the one entity of the one shard of type
//! `singleton-<name>`, remembered so it restarts without a message. A node without the type's
//! role (`settings.role`) runs a proxy that routes to it and never hosts it. Where it runs is
//! the allocation strategy's choice (the least-loaded node that takes shards); it then stays
//! there until that node leaves or fails, as Akka's oldest-member singleton does.

use std::time::Duration;

use super::{
    Durable, DurableEntity, Entity, PassivationSettings, RememberEntitiesSettings, ShardRegion, ShardingSettings,
    StartOptions,
};
use crate::error::{Error, Result};
use crate::node::Node;

/// The id of the singleton's one entity (its shard is `"0"`).
const ENTITY_ID: &str = "singleton";

/// A running cluster singleton (see [`super::Sharding::singleton`]): `tell` and `ask` it from
/// any node. Cheap to clone.
pub struct ClusterSingleton<E: Entity> {
    name: std::sync::Arc<str>,
    region: ShardRegion<E>,
}

impl<E: Entity> Clone for ClusterSingleton<E> {
    fn clone(&self) -> Self {
        ClusterSingleton { name: self.name.clone(), region: self.region.clone() }
    }
}

impl<E: Entity> ClusterSingleton<E> {
    /// The singleton's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The entity type it runs under (`singleton-<name>`), as the admin API and metrics name
    /// it.
    pub fn type_name(&self) -> &str {
        self.region.type_name()
    }

    /// Sends `msg` without waiting for an answer.
    pub fn tell(&self, msg: E::Message) -> Result<()> {
        self.region.tell(ENTITY_ID, msg)
    }

    /// Sends `msg` and waits for the answer (the type's `ask_timeout`).
    pub async fn ask(&self, msg: E::Message) -> Result<E::Reply> {
        self.region.ask(ENTITY_ID, msg).await
    }

    /// [`ClusterSingleton::ask`] with its own timeout.
    pub async fn ask_with_timeout(&self, msg: E::Message, timeout: Duration) -> Result<E::Reply> {
        self.region.ask_with_timeout(ENTITY_ID, msg, timeout).await
    }

    /// The node id the singleton runs on now, by the coordinator's table; `None` while it
    /// moves.
    pub async fn location(&self) -> Result<Option<String>> {
        let located = self.region.erased().locate(ENTITY_ID).await?;
        Ok(located.home.map(|h| h.split('#').next().unwrap_or(&h).to_string()))
    }
}

/// The settings of a singleton's type: one shard, remembered, never passivated.
fn singleton_settings(settings: ShardingSettings) -> ShardingSettings {
    ShardingSettings {
        number_of_shards: 1,
        remember: RememberEntitiesSettings { enabled: true, ..settings.remember },
        passivation: PassivationSettings { idle_timeout: None, ..settings.passivation },
        ..settings
    }
}

fn options() -> StartOptions {
    StartOptions { shard_id_extractor: Some(std::sync::Arc::new(|_: &str| "0".to_string())), ..StartOptions::default() }
}

fn type_name(name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(Error::BadRequest("a cluster singleton needs a name".into()));
    }
    Ok(format!("singleton-{name}"))
}

/// Starts the singleton's region on `node` and makes sure its entity runs.
pub(crate) async fn start<E, F>(
    node: &Node,
    name: &str,
    factory: F,
    settings: ShardingSettings,
) -> Result<ClusterSingleton<E>>
where
    E: Entity,
    F: Fn() -> E + Send + Sync + 'static,
{
    let type_name = type_name(name)?;
    let region = node
        .sharding()
        .start_with(&type_name, move |_: &str| factory(), singleton_settings(settings), options())
        .await?;
    Ok(keep_running(node, name, region))
}

/// [`start`] for a durable entity: its state survives moves, crashes and full restarts.
pub(crate) async fn start_durable<D, F>(
    node: &Node,
    name: &str,
    factory: F,
    settings: ShardingSettings,
) -> Result<ClusterSingleton<Durable<D>>>
where
    D: DurableEntity,
    F: Fn() -> D + Send + Sync + 'static,
{
    let type_name = type_name(name)?;
    let settings = singleton_settings(settings);
    let region = node.sharding().start_durable_with(&type_name, move |_: &str| factory(), settings, options()).await?;
    Ok(keep_running(node, name, region))
}

/// Starts the singleton's entity once from this node (remember-entities keeps it after).
fn keep_running<E: Entity>(node: &Node, name: &str, region: ShardRegion<E>) -> ClusterSingleton<E> {
    let starter = region.clone();
    node.spawner().spawn_until_shutdown(async move {
        starter.start_entity_until_running(ENTITY_ID).await;
    });
    ClusterSingleton { name: name.into(), region }
}
