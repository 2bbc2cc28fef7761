//! The region task: selects over its handle's commands, the region topic, its shards' task
//! reports, membership and a ticker; feeds them to the region core (and, through
//! [`LocalShards`], to the shard cores) and performs their actions.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use super::core::{RegionAction, RegionCore, RegionDrop, RegionInput};
use super::fast::{NotSent, PendingAsk, SharedRegion, complete_ask};
use super::inbound::{Classified, PassedOn, classify, remote_reply};
use crate::clock::Instant;
use crate::membership::MembershipSnapshot;
use crate::node::Node;
use crate::sharding::counters::RegionCounterCells;
use crate::sharding::envelope::{Envelope, Replier, not_delivered};
use crate::sharding::ids::{RegionId, ShardId};
use crate::sharding::protocol::{RegionQuery, ToCoordinator, ToRegion};
use crate::sharding::query::{EntityIdPage, RegionInfo, ShardCount};
use crate::sharding::settings::ShardingSettings;
use crate::sharding::shard::{LocalShards, ShardEvent, ShardInput, Work};
use crate::sharding::{Entity, keys};
use crate::transport::{Inbound, Transport, wire};

/// How often regions and shards check their deadlines.
pub(crate) const REGION_TICK: Duration = Duration::from_millis(100);

/// Shards whose home requests are timed at once (shard-home latency); more wait untimed.
const MAX_HOMES_TIMED: usize = 10_000;

/// What a region handle asks of its task.
pub(crate) enum RegionCmd<E: Entity> {
    Deliver {
        shard: ShardId,
        entity_id: String,
        env: Envelope<E>,
    },
    State(oneshot::Sender<crate::sharding::protocol::RegionStateReply>),
    Stats(oneshot::Sender<crate::sharding::protocol::RegionStatsReply>),
    Info(oneshot::Sender<RegionInfo>),
    EntityIds {
        after: Option<(ShardId, String)>,
        limit: usize,
        reply: oneshot::Sender<EntityIdPage>,
    },
    GracefulShutdown(oneshot::Sender<()>),
    /// A new active-entity limit; answers whether the type has one.
    SetPassivationLimit(usize, oneshot::Sender<bool>),
}

/// A region task's command channel: its `Deliver` commands count from their send until the task
/// takes them, so the handle can refuse with `BufferFull` when the task falls behind instead of
/// queueing without bound (review finding 6).
pub(crate) fn region_commands<E: Entity>() -> (RegionCommands<E>, RegionCommandsRx<E>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    (RegionCommands { tx, queued: queued.clone() }, RegionCommandsRx { rx, queued })
}

/// The sending side of [`region_commands`].
pub(crate) struct RegionCommands<E: Entity> {
    tx: mpsc::UnboundedSender<RegionCmd<E>>,
    queued: Arc<AtomicUsize>,
}

impl<E: Entity> RegionCommands<E> {
    /// `Deliver` commands sent and not yet taken by the task.
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Sends `cmd`; `Err` once the task is gone.
    pub(crate) fn send(&self, cmd: RegionCmd<E>) -> std::result::Result<(), ()> {
        let deliver = matches!(cmd, RegionCmd::Deliver { .. });
        if deliver {
            self.queued.fetch_add(1, Ordering::Relaxed);
        }
        self.tx.send(cmd).map_err(|_| {
            if deliver {
                self.queued.fetch_sub(1, Ordering::Relaxed);
            }
        })
    }
}

/// The receiving side of [`region_commands`].
pub(crate) struct RegionCommandsRx<E: Entity> {
    rx: mpsc::UnboundedReceiver<RegionCmd<E>>,
    queued: Arc<AtomicUsize>,
}

/// Commands left in the channel when the task ends no longer count: senders then get
/// `ShutDown`, not `BufferFull`.
impl<E: Entity> Drop for RegionCommandsRx<E> {
    fn drop(&mut self) {
        self.rx.close();
        while let Ok(cmd) = self.rx.try_recv() {
            if matches!(cmd, RegionCmd::Deliver { .. }) {
                self.queued.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl<E: Entity> RegionCommandsRx<E> {
    /// The next command; `None` once every handle is gone.
    pub(crate) async fn recv(&mut self) -> Option<RegionCmd<E>> {
        let cmd = self.rx.recv().await?;
        if matches!(cmd, RegionCmd::Deliver { .. }) {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        Some(cmd)
    }
}

/// The region task of one entity type on one node.
pub(crate) struct RegionDriver<E: Entity> {
    pub type_name: String,
    pub role: Option<String>,
    pub transport: Transport,
    pub core: RegionCore<Envelope<E>>,
    /// `None` for a proxy.
    pub shards: Option<LocalShards<E>>,
    pub settings: ShardingSettings,
    /// What the region topic's fast path shares with this task: the asks sent elsewhere, the
    /// peer senders, the shard directory.
    pub shared: Arc<SharedRegion<E>>,
    pub buffered: Arc<AtomicUsize>,
    pub counters: Arc<RegionCounterCells>,
    pub replier: Replier,
    pub members: Arc<MembershipSnapshot>,
    pub shutdown_waiters: Vec<oneshot::Sender<()>>,
    /// A graceful shutdown was asked for (the core decides when it ends).
    pub shutting_down: bool,
    pub work: VecDeque<Work<E>>,
    /// When each shard's home was first asked for and not yet learnt (shard-home latency).
    pub home_asked: std::collections::HashMap<ShardId, Instant>,
    /// Shard-home latency (feature `metrics`).
    pub metrics: Arc<crate::metrics::TypeMetrics>,
    /// The type's shard names: a `Deliver` naming another shard than its extractor gives is refused
    /// (two nodes that disagree on the shard of an id could otherwise both start it).
    pub shard_names: crate::sharding::ids::ShardNames,
}

impl<E: Entity> RegionDriver<E> {
    pub(crate) async fn run(
        mut self,
        node: Node,
        mut commands: RegionCommandsRx<E>,
        mut events: mpsc::UnboundedReceiver<ShardEvent<E>>,
    ) {
        let topic = self.shared.topic.clone();
        let shared = self.shared.clone();
        let mut inbound = self.transport.subscribe_with(&topic, 65_536, move |m| shared.handle(m));
        let mut members = node.watch_membership();
        let shutdown = node.shutdown_token();
        let mut tick = tokio::time::interval(REGION_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let snap = members.borrow_and_update().clone();
        self.on_members(snap);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => break,
                },
                msg = inbound.recv() => match msg {
                    Some(m) => self.on_inbound(m),
                    None => break,
                },
                Some(ev) = events.recv() => {
                    if let Some(shards) = self.shards.as_mut() {
                        shards.on_event(ev, self.shutting_down, &mut self.work);
                    }
                }
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    let snap = members.borrow_and_update().clone();
                    self.on_members(snap);
                }
                _ = tick.tick() => {
                    self.work.push_back(Work::Region(RegionInput::Tick));
                    for s in self.shards.as_ref().map(LocalShards::ids).unwrap_or_default() {
                        self.work.push_back(Work::Shard(s, ShardInput::Tick));
                    }
                    self.shared.asks.retain_waiting(PendingAsk::is_waiting);
                }
            }
            self.process();
            self.buffered.store(self.core.buffered(), Ordering::Relaxed);
            if self.shutting_down && self.shutdown_waiters.is_empty() {
                break; // graceful shutdown finished
            }
        }
        self.shared.remote.clear();
        self.transport.unsubscribe(&topic);
        // The table outlives this task (the handle and the topic handler share it): its asks
        // fail now rather than at their timeouts.
        // `ShutDown`, as every other ask of a region that stopped gets.
        let waiting = self.shared.asks.take_all();
        for (_, pending) in waiting {
            pending.fail(crate::error::Error::ShutDown);
        }
        if let Some(shards) = self.shards.as_mut() {
            shards.stop_all(self.settings.handoff_timeout).await;
        }
        self.finish_shutdown();
    }

    fn finish_shutdown(&mut self) {
        for w in self.shutdown_waiters.drain(..) {
            let _ = w.send(());
        }
    }

    fn state_reply(&self) -> crate::sharding::protocol::RegionStateReply {
        self.shards.as_ref().map(LocalShards::state).unwrap_or_default()
    }

    fn info(&self) -> RegionInfo {
        let shards: Vec<ShardCount> =
            self.stats_reply().into_iter().map(|(shard, entities)| ShardCount { shard, entities }).collect();
        RegionInfo {
            type_name: self.type_name.clone(),
            region: self.core.me().to_string(),
            proxy: self.shards.is_none(),
            registered: self.core.registered(),
            refused: self.core.refused(),
            coordinator: self.core.coordinator().map(ToString::to_string),
            buffered: self.core.buffered(),
            entities: shards.iter().map(|s| s.entities).sum(),
            remembered_entities: self.shards.as_ref().map_or(0, LocalShards::remembered),
            shards,
        }
    }

    fn stats_reply(&self) -> crate::sharding::protocol::RegionStatsReply {
        self.shards.as_ref().map(LocalShards::stats).unwrap_or_default()
    }

    fn on_command(&mut self, cmd: RegionCmd<E>) {
        match cmd {
            RegionCmd::Deliver { shard, entity_id, env } => {
                self.work.push_back(Work::Region(RegionInput::Route { shard, entity_id, msg: env }))
            }
            RegionCmd::State(tx) => {
                let _ = tx.send(self.state_reply());
            }
            RegionCmd::Stats(tx) => {
                let _ = tx.send(self.stats_reply());
            }
            RegionCmd::Info(tx) => {
                let _ = tx.send(self.info());
            }
            RegionCmd::EntityIds { after, limit, reply } => {
                let page = match &self.shards {
                    Some(shards) => shards.entity_page(after.as_ref(), limit),
                    None => EntityIdPage { entities: Vec::new(), next: None },
                };
                let _ = reply.send(page);
            }
            RegionCmd::SetPassivationLimit(limit, tx) => {
                let set = self.shards.as_mut().is_some_and(|s| s.set_passivation_limit(limit, &mut self.work));
                let _ = tx.send(set);
            }
            RegionCmd::GracefulShutdown(tx) => {
                self.shutdown_waiters.push(tx);
                if !self.shutting_down {
                    info!(type_name = %self.type_name, "region shutting down gracefully");
                    self.shutting_down = true;
                    self.work.push_back(Work::Region(RegionInput::GracefulShutdown));
                }
            }
        }
    }

    fn on_members(&mut self, snap: Arc<MembershipSnapshot>) {
        let routable: BTreeSet<RegionId> =
            snap.members.iter().filter(|m| m.status().is_routable()).map(|m| m.address().clone()).collect();
        let coordinator = snap.singleton_host(self.role.as_deref()).map(|m| m.address().clone());
        self.members = snap;
        self.work.push_back(Work::Region(RegionInput::Members { routable, coordinator }));
    }

    fn on_inbound(&mut self, mut m: Inbound) {
        if let Some(id) = m.request_id {
            let reply = match wire::decode::<RegionQuery>(&m.body) {
                Ok(RegionQuery::Stats) => wire::encode(&self.stats_reply()),
                Ok(RegionQuery::State) => wire::encode(&self.state_reply()),
                Err(e) => Err(e),
            };
            let r = match &reply {
                Ok(b) => Ok(&b[..]),
                Err(e) => Err(e.to_string()),
            };
            let _ = self.transport.respond(&m.from, id, r);
            return;
        }
        let passed = m.take_held::<PassedOn<E>>().unwrap_or_else(|| {
            PassedOn::Classified(
                classify(&m.body, &m.from.address, self.settings.max_entity_id_bytes, &self.shard_names).into_owned(),
            )
        });
        match passed {
            PassedOn::Routed { shard, entity_id, epoch, env } => {
                self.work.push_back(Work::Region(RegionInput::Forwarded { shard, epoch, entity_id, msg: env }));
            }
            PassedOn::Classified(Classified::Deliver { shard, entity_id, msg, reply_to, epoch, delivery }) => {
                let reply = remote_reply(reply_to, delivery, &m.from, || self.shared.senders.get(&m.from));
                let env = Envelope::new(msg, reply);
                let (shard, entity_id) = (shard.into_owned(), entity_id.into_owned());
                self.work.push_back(Work::Region(RegionInput::Forwarded { shard, epoch, entity_id, msg: env }));
            }
            PassedOn::Classified(Classified::Coordinator(msg)) => {
                self.work.push_back(Work::Region(RegionInput::Coordinator { from: m.from.address, msg }))
            }
            PassedOn::Classified(Classified::Refused { entity_id, reply_to, error }) => {
                self.counters.dropped_invalid.fetch_add(1, Ordering::Relaxed);
                warn!(type_name = %self.type_name, peer = %m.from.address, %entity_id, %error, "invalid message dropped");
                if let Some(r) = remote_reply::<E>(reply_to, None, &m.from, || self.shared.senders.get(&m.from)) {
                    self.replier.reply::<E>(r, &entity_id, Err(error));
                }
            }
            PassedOn::Classified(Classified::AskReply { ask_id, result }) => {
                complete_ask::<E>(&self.shared.asks, &m.from.address, ask_id, result);
            }
            PassedOn::Classified(Classified::Malformed(e)) => {
                self.counters.dropped_invalid.fetch_add(1, Ordering::Relaxed);
                warn!(type_name = %self.type_name, peer = %m.from.address, error = %e, "malformed region message dropped");
            }
        }
    }

    fn process(&mut self) {
        let now = crate::clock::now();
        while let Some(w) = self.work.pop_front() {
            match w {
                Work::Region(input) => {
                    if let RegionInput::Coordinator { msg: ToRegion::ShardHome { shard, .. }, .. } = &input
                        && let Some(asked) = self.home_asked.remove(shard)
                    {
                        self.metrics.shard_home_learnt(asked);
                    }
                    let mut out = Vec::new();
                    self.core.handle(input, now, &mut out);
                    // Before any of its decisions is acted on (see `RemoteHomes`).
                    self.shared.remote.advance(self.core.routing_generation());
                    if let Some(shards) = &self.shards {
                        // The direct path delivers only what this region would route.
                        shards.directory().set_open(!self.core.refused());
                    }
                    for a in out {
                        self.perform(a);
                    }
                }
                Work::Shard(shard, input) => match self.shards.as_mut() {
                    Some(shards) => shards.handle(shard, input, now, &mut self.work),
                    None => {
                        if let ShardInput::Deliver { entity_id, msg } = input {
                            self.replier.fail(msg, &entity_id, "this node does not host entities of this type");
                        }
                    }
                },
            }
        }
    }

    fn perform(&mut self, action: RegionAction<Envelope<E>>) {
        match action {
            RegionAction::ToCoordinator { coordinator, msg } => {
                if let ToCoordinator::GetShardHome { shard, .. } = &msg {
                    self.counters.home_requests.fetch_add(1, Ordering::Relaxed);
                    // Timed from the first request (a retry does not restart the clock); a
                    // bounded table, since a custom extractor may name any number of shards.
                    if self.home_asked.len() < MAX_HOMES_TIMED || self.home_asked.contains_key(shard) {
                        self.home_asked.entry(shard.clone()).or_insert_with(Instant::now);
                    }
                }
                let Some(peer) = self.members.peer(&coordinator) else { return };
                let sent = wire::encode(&msg)
                    .and_then(|b| self.transport.send(&peer, &keys::coordinator_topic(&self.type_name), &b));
                if let Err(e) = sent {
                    debug!(error = %e, "message to coordinator not sent");
                }
            }
            RegionAction::StartShard { shard, epoch } => match self.shards.as_mut() {
                Some(shards) => {
                    debug!(type_name = %self.type_name, %shard, epoch, "starting shard");
                    shards.start(shard, epoch, &mut self.work);
                }
                None => error!(%shard, "a proxy was asked to host a shard; ignored"),
            },
            RegionAction::Deliver { shard, entity_id, msg } => {
                self.work.push_back(Work::Shard(shard, ShardInput::Deliver { entity_id, msg }))
            }
            RegionAction::Forward { region, shard, epoch, entity_id, msg } => {
                self.forward(region, shard, epoch, entity_id, msg)
            }
            RegionAction::HandOffShard { shard } => {
                self.counters.handoffs_started.fetch_add(1, Ordering::Relaxed);
                self.work.push_back(Work::Shard(shard, ShardInput::HandOff));
            }
            RegionAction::Drop { entity_id, msg, reason } => self.drop_message(entity_id, msg, reason),
            RegionAction::RegionGone(region) => {
                let gone = self.shared.asks.take_region(&region);
                for (entity_id, pending) in gone {
                    let reason = format!("the entity's node {region} left or went down before answering");
                    pending.fail(not_delivered(&entity_id, reason));
                }
            }
            RegionAction::StillUnregistered { why } => {
                warn!(type_name = %self.type_name, "region still not registered with its coordinator: {why}");
            }
            RegionAction::Stopped { forced: false } => {
                info!(type_name = %self.type_name, "region stopped after handing off its shards");
                self.finish_shutdown();
            }
            RegionAction::Stopped { forced: true } => {
                warn!(type_name = %self.type_name, "graceful shutdown timed out; stopping the remaining shards");
                self.finish_shutdown();
            }
        }
    }

    /// Fails a message the region could not take, with its reason, and counts it.
    fn drop_message(&mut self, entity_id: String, msg: Envelope<E>, reason: RegionDrop) {
        let why = match reason {
            RegionDrop::BufferFull => {
                if self.counters.dropped_buffer_full.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(type_name = %self.type_name, "region buffer full; dropping messages");
                }
                "region buffer full"
            }
            RegionDrop::HandOff => {
                self.counters.dropped_handoff.fetch_add(1, Ordering::Relaxed);
                "dropped during shard hand-off"
            }
            RegionDrop::MovedOn => {
                self.counters.dropped_handoff.fetch_add(1, Ordering::Relaxed);
                "its shard moved on from the node it was sent to (hand-off)"
            }
            RegionDrop::Refused => {
                let why = match self.core.refusal() {
                    Some(reason) => format!("the coordinator refused this region: {reason}"),
                    None => "the coordinator refused this region: its shard-id extractor differs from the cluster's \
                             (change extractors with a full cluster restart)"
                        .to_string(),
                };
                if self.counters.dropped_refused.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(type_name = %self.type_name, "{why}");
                }
                self.replier.fail(msg, &entity_id, &why);
                return;
            }
        };
        self.replier.fail(msg, &entity_id, why);
    }

    fn forward(&mut self, region: RegionId, shard: ShardId, epoch: u64, entity_id: String, env: Envelope<E>) {
        let Some(peer) = self.members.peer(&region) else {
            // The core forwards only to routable regions of the same view; never reached.
            self.replier.fail(env, &entity_id, "the shard's home is not routable");
            return;
        };
        let sender = self.shared.senders.get(&peer);
        self.shared.remote.publish(&shard, &region, epoch, &sender);
        if let Err(NotSent { error, pending }) =
            self.shared.send_deliver(&sender, &region, &shard, epoch, &entity_id, env)
        {
            match pending {
                Some(p) => p.fail(not_delivered(&entity_id, format!("not sent to {region}: {error}"))),
                None => debug!(%region, %error, "message not forwarded"),
            }
        }
    }
}
