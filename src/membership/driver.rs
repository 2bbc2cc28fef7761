//! The membership task: runs chitchat, feeds its state to the [`LifecycleCore`] (which decides
//! joining → up, the down-removal margin and downing), publishes member snapshots and events,
//! and carries status changes (leaving, exiting, removed, down) into gossip.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig, spawn_chitchat};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use super::discovery::{
    AggregateDiscovery, Discovery, DiscoveryAction, DiscoveryCore, DiscoveryInput, DnsSrv, SeedList,
};
use super::downing::Strategy;
use super::gossip_auth::{AuthenticatedSocket, GossipSealing, GossipStatCells};
use super::lifecycle::{Bootstrap, LifecycleAction, LifecycleCore, LifecycleSettings};
use super::view::{GossipNode, keys};
use super::{MemberEvent, MemberStatus, MembershipSnapshot, UniqueAddress, diff_snapshots};
use crate::config::{MembershipSettings, NodeConfig};
use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::secret::ClusterSecret;
use crate::spawn::Spawner;

enum Command {
    SetStatus(MemberStatus, oneshot::Sender<()>),
    /// An operator downs these members: their down marks go into gossip as a downing
    /// decision's would.
    Down(Vec<UniqueAddress>, oneshot::Sender<()>),
    /// This node's heartbeats find these members unreachable (the whole list, replacing the
    /// last one).
    PublishUnreachable(Vec<UniqueAddress>),
}

/// Cheap, cloneable access to the membership of a running node.
#[derive(Clone)]
pub(crate) struct MembershipHandle {
    snapshot: watch::Receiver<Arc<MembershipSnapshot>>,
    events: broadcast::Sender<MemberEvent>,
    commands: mpsc::UnboundedSender<Command>,
    gossip_addr: SocketAddr,
    stats: Arc<GossipStatCells>,
}

impl MembershipHandle {
    pub(crate) fn snapshot(&self) -> Arc<MembershipSnapshot> {
        self.snapshot.borrow().clone()
    }
    pub(crate) fn watch(&self) -> watch::Receiver<Arc<MembershipSnapshot>> {
        self.snapshot.clone()
    }
    pub(crate) fn events(&self) -> broadcast::Receiver<MemberEvent> {
        self.events.subscribe()
    }
    pub(crate) fn gossip_addr(&self) -> SocketAddr {
        self.gossip_addr
    }
    pub(crate) fn stats(&self) -> &Arc<GossipStatCells> {
        &self.stats
    }
    /// Publishes this node's verdicts, the members its heartbeats find unreachable, in gossip
    /// (the whole list; an empty one withdraws every earlier verdict).
    pub(crate) fn publish_unreachable(&self, subjects: Vec<UniqueAddress>) -> Result<()> {
        self.commands.send(Command::PublishUnreachable(subjects)).map_err(|_| Error::ShutDown)
    }

    /// Publishes down marks for `victims` (an operator's decision); returns once they are
    /// in this node's gossip state.
    pub(crate) async fn down(&self, victims: Vec<UniqueAddress>) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Down(victims, tx)).map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }

    /// Publishes a new status of this node in gossip; returns once it is set locally.
    pub(crate) async fn set_status(&self, status: MemberStatus) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::SetStatus(status, tx)).map_err(|_| Error::ShutDown)?;
        rx.await.map_err(|_| Error::ShutDown)
    }
}

/// Hands chitchat a socket we bound ourselves, so port 0 works: chitchat needs the advertised
/// address before it opens its socket.
struct PreboundTransport(Mutex<Option<Box<dyn Socket>>>);

#[async_trait]
impl Transport for PreboundTransport {
    async fn open(&self, _listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        self.0
            .lock()
            .expect("prebound socket lock")
            .take()
            .ok_or_else(|| anyhow::anyhow!("gossip socket already opened"))
    }
}

/// Wraps the gossip socket (the test kit's fault injector drops datagrams on cut links).
pub(crate) type GossipSocketWrapper =
    std::sync::Arc<dyn Fn(Box<dyn Socket>, &UniqueAddress, SocketAddr) -> Box<dyn Socket> + Send + Sync>;

/// Where a node's gossip socket comes from: its machine, and a wrapper (if any) it goes through.
pub(crate) struct GossipSockets<'a> {
    pub(crate) machine: &'a dyn Machine,
    pub(crate) wrap: Option<&'a GossipSocketWrapper>,
}

/// Records that this node id's next start must take a generation above the one given.
pub(crate) type GenerationFloor = Arc<dyn Fn(u64) -> crate::error::Result<()> + Send + Sync>;

/// A lookup of every discovery source in flight (errors as text, a timeout included).
type PendingLookup =
    std::pin::Pin<Box<dyn std::future::Future<Output = std::result::Result<Vec<SocketAddr>, String>> + Send>>;

/// Where this node finds nodes to join through, and the core deciding when and whom.
struct DiscoveryDriver {
    sources: Arc<AggregateDiscovery>,
    /// What the sources are, for logs (described once).
    described: Arc<str>,
    core: DiscoveryCore,
    timeout: Duration,
}

/// The membership task.
pub(crate) struct MembershipDriver {
    chitchat: ChitchatHandle,
    gossip_interval: Duration,
    core: LifecycleCore,
    snapshot_tx: watch::Sender<Arc<MembershipSnapshot>>,
    events: broadcast::Sender<MemberEvent>,
    commands: mpsc::UnboundedReceiver<Command>,
    /// The node's spawner, to stop the node (set when it runs).
    spawner: Option<Spawner>,
    /// Records a generation the next start must exceed (set by the node: its durable store).
    generation_floor: Option<GenerationFloor>,
    /// Counts the down marks this node publishes.
    stats: Arc<GossipStatCells>,
    /// Seeds, SRV names and the builder's sources (none: this node forms a cluster alone).
    discovery: Option<DiscoveryDriver>,
    /// The gossip addresses of the other live nodes at the last refresh.
    live_peers: Vec<SocketAddr>,
}

impl MembershipDriver {
    /// Puts down marks for `victims` into this node's gossip state.
    async fn publish_down_marks(&self, victims: &[UniqueAddress]) {
        self.stats.downs_published.fetch_add(victims.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.chitchat
            .with_chitchat(|c| {
                for v in victims {
                    c.self_node_state().set(format!("{}{v}", keys::DOWN_PREFIX), "1");
                }
            })
            .await;
    }

    /// Binds the gossip socket, starts chitchat and returns the handle plus the task to spawn.
    pub(crate) async fn start(
        cfg: &NodeConfig,
        address: UniqueAddress,
        messaging_addr: SocketAddr,
        sockets: GossipSockets<'_>,
        extra_discovery: Vec<Arc<dyn Discovery>>,
    ) -> Result<(MembershipHandle, MembershipDriver)> {
        let stats = Arc::new(GossipStatCells::default());
        let socket = bind_gossip_socket(cfg, sockets.machine, stats.clone()).await?;
        let bound = socket.local_addr().map_err(|e| Error::Gossip(format!("{e:#}")))?;
        let gossip_addr = crate::config::advertised_addr(bound, cfg.gossip_advertise)?;
        let socket = match sockets.wrap {
            Some(wrap) => wrap(socket, &address, gossip_addr),
            None => socket,
        };
        let m = &cfg.membership;
        // The first seed names this node when it is its gossip address or a name resolving to
        // it (a StatefulSet's pod 0 given its own DNS name): then it may form the cluster.
        // With bootstrap formation no node is a first seed: the lowest of the contact points forms.
        let self_is_first_seed = match cfg.seeds.first() {
            _ if m.bootstrap_contact_points > 0 => false,
            None => false,
            Some(first) => match first.socket_addr() {
                Some(addr) => addr == gossip_addr,
                None => resolves_to(first.as_str(), gossip_addr, cfg.membership.seed_node_timeout).await,
            },
        };
        let sources = discovery_sources(cfg, gossip_addr, extra_discovery)?;
        let has_seeds = !sources.is_empty();
        let discovery = has_seeds.then(|| DiscoveryDriver {
            described: sources.describe().into(),
            sources: Arc::new(sources),
            core: DiscoveryCore::new(cfg.discovery.clone(), m.gossip_interval, gossip_addr, crate::clock::now()),
            // Each name has lookup_timeout; the whole gets a second more to gather them.
            timeout: cfg.discovery.lookup_timeout + Duration::from_secs(1),
        });
        let chitchat_cfg = chitchat_config(cfg, &address, gossip_addr, bound);
        let initial = vec![
            (keys::STATUS.to_string(), MemberStatus::Joining.as_key().to_string()),
            (keys::ROLES.to_string(), cfg.roles.join(",")),
            (keys::APP_VERSION.to_string(), cfg.app_version.to_string()),
            (keys::MESSAGING.to_string(), messaging_addr.to_string()),
        ];
        let transport = PreboundTransport(Mutex::new(Some(socket)));
        let chitchat =
            spawn_chitchat(chitchat_cfg, initial, &transport).await.map_err(|e| Error::Gossip(format!("{e:#}")))?;
        let empty = Arc::new(MembershipSnapshot { self_address: address.clone(), members: Vec::new() });
        let (snapshot_tx, snapshot_rx) = watch::channel(empty);
        let (events, _) = broadcast::channel(1024);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let handle = MembershipHandle {
            snapshot: snapshot_rx,
            events: events.clone(),
            commands: cmd_tx,
            gossip_addr,
            stats: stats.clone(),
        };
        let lifecycle = lifecycle_settings(m, has_seeds, self_is_first_seed);
        let driver = MembershipDriver {
            stats,
            chitchat,
            core: LifecycleCore::new(address.clone(), lifecycle, crate::clock::now()),
            gossip_interval: m.gossip_interval,
            snapshot_tx,
            events,
            commands: cmd_rx,
            spawner: None,
            generation_floor: None,
            discovery,
            live_peers: Vec::new(),
        };
        Ok((handle, driver))
    }

    /// Records (off the async workers: an LMDB commit) that the next start's generation must
    /// exceed `generation`.
    async fn record_generation_floor(&self, generation: u64) -> crate::error::Result<()> {
        let Some(record) = self.generation_floor.clone() else { return Ok(()) };
        tokio::task::spawn_blocking(move || record(generation))
            .await
            .map_err(|e| crate::error::Error::Gossip(format!("recording the generation floor: {e}")))?
    }

    /// Where a start whose generation was behind its predecessor's records the generation the
    /// next start must exceed.
    pub(crate) fn set_generation_floor(&mut self, floor: GenerationFloor) {
        self.generation_floor = Some(floor);
    }

    /// Runs until the node shuts down, then stops gossip. Stops the node itself when a newer
    /// incarnation of its node id appears.
    pub(crate) async fn run(mut self, spawner: Spawner) {
        let shutdown = spawner.shutdown_token().clone();
        self.spawner = Some(spawner);
        let mut tick = tokio::time::interval(self.gossip_interval / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut lookup: Option<PendingLookup> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {
                    self.refresh().await;
                    let live = DiscoveryInput::Tick { live: self.live_peers.clone() };
                    self.discover(live, &mut lookup);
                }
                found = async { lookup.as_mut().expect("guarded by the condition").await }, if lookup.is_some() => {
                    lookup = None;
                    self.discover(DiscoveryInput::Found(found), &mut lookup);
                }
                cmd = self.commands.recv() => match cmd {
                    Some(Command::SetStatus(status, done)) => {
                        self.core.status_published(status);
                        self.publish_status(status, None).await;
                        self.refresh().await;
                        let _ = done.send(());
                    }
                    Some(Command::Down(victims, done)) => {
                        warn!(?victims, "members downed by an operator");
                        self.publish_down_marks(&victims).await;
                        self.refresh().await;
                        let _ = done.send(());
                    }
                    Some(Command::PublishUnreachable(subjects)) => {
                        let value = super::view::encode_unreachable(&subjects);
                        self.chitchat.with_chitchat(|c| c.self_node_state().set(keys::UNREACHABLE, &value)).await;
                        self.refresh().await;
                    }
                    None => break,
                },
            }
        }
        if let Err(e) = self.chitchat.shutdown().await {
            debug!(error = %e, "chitchat stopped with an error");
        }
    }

    /// Feeds the discovery core and performs what it decides (no-op without sources).
    fn discover(&mut self, input: DiscoveryInput, lookup: &mut Option<PendingLookup>) {
        let Some(d) = &mut self.discovery else { return };
        if matches!(input, DiscoveryInput::Found(Err(_))) {
            self.stats.discovery_lookups_failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut actions = Vec::new();
        d.core.handle(input, crate::clock::now(), &mut actions);
        for action in actions {
            match action {
                DiscoveryAction::Lookup => {
                    // On a task of its own: a user's source that panics or blocks cannot stop
                    // or stall membership; one past the timeout is aborted.
                    let (sources, timeout) = (d.sources.clone(), d.timeout);
                    let describe = d.described.clone();
                    let task = tokio::spawn(async move { sources.lookup().await.map_err(|e| e.to_string()) });
                    *lookup = Some(Box::pin(async move {
                        let abort = task.abort_handle();
                        match tokio::time::timeout(timeout, task).await {
                            Ok(Ok(found)) => found,
                            Ok(Err(e)) => Err(format!("{describe}: the lookup failed: {e}")),
                            Err(_) => {
                                abort.abort();
                                Err(format!("{describe}: no answer within {timeout:?}"))
                            }
                        }
                    }));
                }
                DiscoveryAction::Contact(addr) => {
                    if let Err(e) = self.chitchat.gossip(addr) {
                        debug!(%addr, error = %e, "contacting a discovered node");
                    }
                }
                DiscoveryAction::FoundChanged { addresses, dropped } => {
                    use std::sync::atomic::Ordering::Relaxed;
                    self.stats.discovery_contact_points.store(addresses.len() as u64, Relaxed);
                    self.stats.discovery_addresses_dropped.fetch_add(dropped as u64, Relaxed);
                    info!(sources = %d.described, found = addresses.len(), ?addresses, "discovery found nodes");
                    if dropped > 0 {
                        warn!(
                            dropped,
                            "discovery found more nodes than discovery.max_contact_points; the lowest are contacted"
                        );
                    }
                }
                DiscoveryAction::LookupFailed(error) => {
                    warn!(%error, "discovery lookup failed; retrying with back-off, still contacting the nodes found before");
                }
            }
        }
    }

    async fn publish_status(&self, status: MemberStatus, up_number: Option<u64>) {
        self.chitchat
            .with_chitchat(|c| {
                let st = c.self_node_state();
                if let Some(n) = up_number {
                    st.set(keys::UP_NUMBER, n);
                }
                st.set(keys::STATUS, status.as_key());
            })
            .await;
    }

    async fn read_gossip(&self) -> Vec<GossipNode> {
        self.chitchat
            .with_chitchat(|c| {
                let live: std::collections::HashSet<ChitchatId> = c.live_nodes().cloned().collect();
                c.node_states()
                    .iter()
                    .map(|(id, st)| GossipNode {
                        address: UniqueAddress::new(id.node_id.clone(), id.generation_id),
                        gossip_addr: id.gossip_advertise_addr,
                        live: live.contains(id),
                        keys: st.key_values().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                    })
                    .collect()
            })
            .await
    }

    async fn refresh(&mut self) {
        let nodes = self.read_gossip().await;
        let me = self.snapshot_tx.borrow().self_address.clone();
        self.live_peers = nodes.iter().filter(|n| n.live && n.address != me).map(|n| n.gossip_addr).collect();
        let mut actions = Vec::new();
        let next = self.core.on_gossip(&nodes, crate::clock::now(), &mut actions);
        for action in actions {
            match action {
                LifecycleAction::PublishStatus { status, up_number } => self.publish_status(status, up_number).await,
                LifecycleAction::Superseded(newer) => {
                    tracing::warn!(%newer, "a newer incarnation of this node id joined; this one stops");
                    // Harmless for a true successor; for a predecessor seen only after this
                    // one turned Up (its gossip came late), it ends the restart loop too.
                    if let Err(e) = self.record_generation_floor(newer.generation).await {
                        tracing::warn!(error = %e, "recording the newer generation failed");
                    }
                    if let Some(spawner) = &self.spawner {
                        spawner.stop(format!("superseded by the newer incarnation {newer} of this node id"));
                    }
                }
                LifecycleAction::GenerationBehind(predecessor) => {
                    let next = match self.record_generation_floor(predecessor.generation).await {
                        Err(e) => format!("recording it failed ({e}): the next start may be behind again"),
                        Ok(()) => format!("the next start takes a generation above {}", predecessor.generation),
                    };
                    let why = format!(
                        "this incarnation's generation is below its predecessor {predecessor}'s (the clock is behind \
                         the one that incarnation started under, and the data dir did not remember it); {next}"
                    );
                    tracing::error!("{why}");
                    if let Some(spawner) = &self.spawner {
                        spawner.stop(why);
                    }
                }
                LifecycleAction::PublishDowns(victims) => self.publish_down_marks(&victims).await,
            }
        }
        let Some(next) = next else {
            // Just turned Up: re-read so the snapshot carries our own new keys.
            return Box::pin(self.refresh()).await;
        };
        let prev = self.snapshot_tx.borrow().clone();
        if *prev != next {
            for ev in diff_snapshots(&prev, &next) {
                log_member_event(&ev);
                let _ = self.events.send(ev);
            }
            self.snapshot_tx.send_replace(Arc::new(next));
        }
    }
}

/// One line per member change, for operators (`info`: these are rare and each matters).
fn log_member_event(ev: &MemberEvent) {
    let kind = ev.kind();
    match ev.member() {
        None => info!(member = %ev.address(), "member {kind}"),
        Some(m) => {
            let observers: Vec<String> = m.observed_unreachable_by().iter().map(ToString::to_string).collect();
            info!(member = %m.address(), status = ?m.status(), messaging = %m.messaging_addr(), unreachable_by = ?observers, "member {kind}");
        }
    }
}

/// Whether `seed` (`host:port`) resolves to `addr` through the system resolver. A name that
/// does not resolve yet is asked again for up to `patience` (a pod's own DNS record may appear
/// a moment after its container starts); one that still does not, does not.
async fn resolves_to(seed: &str, addr: SocketAddr, patience: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match tokio::net::lookup_host(seed).await {
            Ok(mut addrs) => return addrs.any(|a| a == addr),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                warn!(%seed, error = %e, "the first seed does not resolve; this node will not form a cluster by itself");
                return false;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Binds the gossip socket: with a secret every datagram is authenticated; without one,
/// chitchat's plain socket (config validation allowed that only on loopback or with `insecure`).
async fn bind_gossip_socket(
    cfg: &NodeConfig,
    machine: &dyn Machine,
    stats: Arc<GossipStatCells>,
) -> Result<Box<dyn Socket>> {
    let binding = |e: &dyn std::fmt::Display| Error::Gossip(format!("binding {}: {e:#}", cfg.gossip_addr));
    let keys: Vec<_> = cfg.secrets().iter().map(ClusterSecret::gossip_mac_key).collect();
    Ok(if keys.is_empty() {
        machine.open_gossip(cfg.gossip_addr).await.map_err(|e| binding(&e))?
    } else if !machine.seals_gossip() {
        return Err(binding(&"sealed gossip (a cluster secret) needs the operating system's UDP sockets"));
    } else {
        let sealing = GossipSealing {
            freshness_window: cfg.membership.gossip_freshness_window,
            accept_unstamped: cfg.membership.accept_unstamped_gossip,
        };
        Box::new(
            AuthenticatedSocket::bind(cfg.gossip_addr, cfg.gossip_advertise, keys, sealing, stats)
                .await
                .map_err(|e| binding(&e))?,
        )
    })
}

/// Every source of contact points: the seeds (but this node), the SRV names and the user's
/// own. Every source goes through discovery (chitchat gets no seeds of its own): names are
/// looked up again as `[discovery]` says, not once a minute.
fn discovery_sources(
    cfg: &NodeConfig,
    gossip_addr: SocketAddr,
    extra_discovery: Vec<Arc<dyn Discovery>>,
) -> Result<AggregateDiscovery> {
    let seeds: Vec<_> = cfg.seeds.iter().filter(|s| s.socket_addr() != Some(gossip_addr)).cloned().collect();
    let mut sources = AggregateDiscovery::default();
    if !seeds.is_empty() {
        sources.push(Arc::new(SeedList::new(seeds).with_name_timeout(cfg.discovery.lookup_timeout)));
    }
    for name in &cfg.discovery.srv_names {
        let srv = match cfg.discovery.dns_server {
            Some(server) => DnsSrv::with_server(name, server)?,
            None => DnsSrv::system(name)?,
        };
        sources.push(Arc::new(srv));
    }
    for source in extra_discovery {
        sources.push(source);
    }
    Ok(sources)
}

fn chitchat_config(
    cfg: &NodeConfig,
    address: &UniqueAddress,
    gossip_addr: SocketAddr,
    bound: SocketAddr,
) -> ChitchatConfig {
    let m = &cfg.membership;
    ChitchatConfig {
        chitchat_id: ChitchatId::new(address.node_id.to_string(), address.generation, gossip_addr),
        cluster_id: cfg.cluster_id.clone(),
        gossip_interval: m.gossip_interval,
        listen_addr: bound,
        seed_nodes: Vec::new(),
        failure_detector_config: FailureDetectorConfig {
            phi_threshold: m.phi_threshold,
            sampling_window_size: 1000,
            max_interval: Duration::from_secs(10),
            initial_interval: m.initial_interval,
            dead_node_grace_period: m.dead_node_grace_period,
        },
        marked_for_deletion_grace_period: m.dead_node_grace_period,
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: chitchat::ProtocolVersion::V0,
    }
}

fn lifecycle_settings(m: &MembershipSettings, has_seeds: bool, self_is_first_seed: bool) -> LifecycleSettings {
    LifecycleSettings {
        has_seeds,
        self_is_first_seed,
        gossip_interval: m.gossip_interval,
        seed_node_timeout: m.seed_node_timeout,
        bootstrap: (m.bootstrap_contact_points > 0).then_some(Bootstrap {
            contact_points: m.bootstrap_contact_points,
            stable_margin: m.bootstrap_stable_margin,
        }),
        down_removal_margin: m.down_removal_margin,
        downing: Strategy::from_settings(m).map(|strategy| (strategy, m.stable_after)),
        down_all_when_unstable: m.down_all_when_unstable.after(m.stable_after),
    }
}
