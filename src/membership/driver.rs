//! The membership task: runs chitchat, moves this node through joining → up, publishes member
//! snapshots and events, and carries status changes (leaving, exiting, removed) into gossip.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chitchat::transport::{Socket, Transport};
use chitchat::{ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig, spawn_chitchat};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::downing::{Decision, KeepMajority};
use super::view::{GossipNode, compute_members, highest_up_number, keys};
use super::{MemberEvent, MemberStatus, MembershipSnapshot, UniqueAddress, diff_snapshots};
use crate::config::{DowningStrategy, NodeConfig};
use crate::error::{Error, Result};

enum Command {
    SetStatus(MemberStatus, oneshot::Sender<()>),
}

/// Cheap, cloneable access to the membership of a running node.
#[derive(Clone)]
pub(crate) struct MembershipHandle {
    snapshot: watch::Receiver<Arc<MembershipSnapshot>>,
    events: broadcast::Sender<MemberEvent>,
    commands: mpsc::UnboundedSender<Command>,
    gossip_addr: SocketAddr,
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

/// The membership task.
pub(crate) struct MembershipDriver {
    chitchat: ChitchatHandle,
    address: UniqueAddress,
    gossip_addr: SocketAddr,
    seeds: Vec<SocketAddr>,
    self_is_first_seed: bool,
    gossip_interval: Duration,
    seed_node_timeout: Duration,
    status: MemberStatus,
    started: Instant,
    up_member_seen_at: Option<Instant>,
    snapshot_tx: watch::Sender<Arc<MembershipSnapshot>>,
    events: broadcast::Sender<MemberEvent>,
    commands: mpsc::UnboundedReceiver<Command>,
    downing: Option<KeepMajority>,
    down_removal_margin: Duration,
    down_seen: std::collections::HashMap<UniqueAddress, Instant>,
    downs_published: std::collections::HashSet<UniqueAddress>,
}

impl MembershipDriver {
    /// Binds the gossip socket, starts chitchat and returns the handle plus the task to spawn.
    pub(crate) async fn start(
        cfg: &NodeConfig,
        address: UniqueAddress,
        messaging_addr: SocketAddr,
    ) -> Result<(MembershipHandle, MembershipDriver)> {
        let socket = chitchat::transport::UdpSocket::open(cfg.gossip_addr)
            .await
            .map_err(|e| Error::Gossip(format!("binding {}: {e:#}", cfg.gossip_addr)))?;
        let gossip_addr = socket.local_addr().map_err(|e| Error::Gossip(format!("{e:#}")))?;
        if gossip_addr.ip().is_unspecified() {
            return Err(Error::BadAddress(gossip_addr));
        }
        let socket: Box<dyn Socket> = Box::new(socket);
        #[cfg(feature = "testkit")]
        let socket: Box<dyn Socket> = match &cfg.fault_injector {
            Some(inj) => {
                // Only the UDP address: messaging is cut by node id, and a TCP port may carry
                // the same number as another node's UDP port.
                inj.register_gossip_addr(&address.node_id, gossip_addr);
                Box::new(crate::testkit::FaultySocket::new(socket, address.node_id.clone(), inj.clone()))
            }
            None => socket,
        };
        let m = &cfg.membership;
        let seeds: Vec<SocketAddr> = cfg.seeds.iter().copied().filter(|s| *s != gossip_addr).collect();
        let chitchat_cfg = ChitchatConfig {
            chitchat_id: ChitchatId::new(address.node_id.to_string(), address.generation, gossip_addr),
            cluster_id: cfg.cluster_id.clone(),
            gossip_interval: m.gossip_interval,
            listen_addr: gossip_addr,
            seed_nodes: seeds.iter().map(ToString::to_string).collect(),
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
        };
        let initial = vec![
            (keys::STATUS.to_string(), MemberStatus::Joining.as_key().to_string()),
            (keys::ROLES.to_string(), cfg.roles.join(",")),
            (keys::MESSAGING.to_string(), messaging_addr.to_string()),
        ];
        let transport = PreboundTransport(Mutex::new(Some(socket)));
        let chitchat =
            spawn_chitchat(chitchat_cfg, initial, &transport).await.map_err(|e| Error::Gossip(format!("{e:#}")))?;
        let empty = Arc::new(MembershipSnapshot { self_address: address.clone(), members: Vec::new() });
        let (snapshot_tx, snapshot_rx) = watch::channel(empty);
        let (events, _) = broadcast::channel(1024);
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let handle = MembershipHandle { snapshot: snapshot_rx, events: events.clone(), commands: cmd_tx, gossip_addr };
        let driver = MembershipDriver {
            chitchat,
            address,
            gossip_addr,
            self_is_first_seed: cfg.seeds.first() == Some(&gossip_addr),
            seeds,
            gossip_interval: m.gossip_interval,
            seed_node_timeout: m.seed_node_timeout,
            status: MemberStatus::Joining,
            started: Instant::now(),
            up_member_seen_at: None,
            snapshot_tx,
            events,
            commands: cmd_rx,
            downing: (m.downing == DowningStrategy::KeepMajority)
                .then(|| KeepMajority::new(m.stable_after, Instant::now())),
            down_removal_margin: m.down_removal_margin,
            down_seen: Default::default(),
            downs_published: Default::default(),
        };
        Ok((handle, driver))
    }

    /// Runs until `shutdown` fires, then stops gossip.
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.gossip_interval / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => self.refresh().await,
                cmd = self.commands.recv() => match cmd {
                    Some(Command::SetStatus(status, done)) => {
                        self.publish_status(status, None).await;
                        self.refresh().await;
                        let _ = done.send(());
                    }
                    None => break,
                },
            }
        }
        if let Err(e) = self.chitchat.shutdown().await {
            debug!(error = %e, "chitchat stopped with an error");
        }
    }

    async fn publish_status(&mut self, status: MemberStatus, up_number: Option<u64>) {
        self.status = status;
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
        if self.status == MemberStatus::Joining && self.ready_to_be_up(&nodes) {
            let up = highest_up_number(&nodes) + 1;
            info!(node = %self.address, up_number = up, "member is up");
            self.publish_status(MemberStatus::Up, Some(up)).await;
            // Re-read so the snapshot carries our own new keys.
            return Box::pin(self.refresh()).await;
        }
        let mut next = compute_members(&self.address, &nodes);
        self.apply_down_removal_margin(&mut next);
        self.run_downing(&next).await;
        let prev = self.snapshot_tx.borrow().clone();
        if *prev != next {
            for ev in diff_snapshots(&prev, &next) {
                debug!(node = %self.address, event = ?ev, "membership event");
                let _ = self.events.send(ev);
            }
            self.snapshot_tx.send_replace(Arc::new(next));
        }
    }

    /// Down members stay listed for `down_removal_margin` after this node first saw them Down,
    /// then they are removed (their shards and singletons move only then).
    fn apply_down_removal_margin(&mut self, snap: &mut MembershipSnapshot) {
        let now = Instant::now();
        let down: std::collections::HashSet<UniqueAddress> = snap
            .members
            .iter()
            .filter(|m| m.status == MemberStatus::Down && m.address != self.address)
            .map(|m| m.address.clone())
            .collect();
        self.down_seen.retain(|a, _| down.contains(a));
        for a in &down {
            self.down_seen.entry(a.clone()).or_insert(now);
        }
        let margin = self.down_removal_margin;
        let seen = &self.down_seen;
        snap.members.retain(|m| seen.get(&m.address).is_none_or(|t| now.duration_since(*t) < margin));
    }

    /// Keep-majority downing: publish down marks for the losing side, or down this node.
    async fn run_downing(&mut self, snap: &MembershipSnapshot) {
        if !self.status.is_up_or_leaving() {
            return;
        }
        let Some(k) = self.downing.as_mut() else { return };
        match k.decide(snap, Instant::now()) {
            Decision::Wait => {}
            Decision::DownOthers(victims) => {
                let new: Vec<UniqueAddress> =
                    victims.into_iter().filter(|v| !self.downs_published.contains(v)).collect();
                if new.is_empty() {
                    return;
                }
                warn!(node = %self.address, downed = ?new.iter().map(ToString::to_string).collect::<Vec<_>>(), "keep-majority: downing unreachable members");
                self.chitchat
                    .with_chitchat(|c| {
                        for v in &new {
                            c.self_node_state().set(format!("{}{v}", keys::DOWN_PREFIX), "1");
                        }
                    })
                    .await;
                self.downs_published.extend(new);
            }
            Decision::DownMyself => {
                warn!(node = %self.address, "keep-majority: this node is on the minority side; downing itself");
                self.publish_status(MemberStatus::Down, None).await;
            }
        }
    }

    /// Joining → Up: with no seeds at once; otherwise once a member that is up was seen and two
    /// more gossip rounds passed (so the highest up-number has arrived); a node that is its own
    /// first seed forms the cluster alone after `seed_node_timeout`.
    fn ready_to_be_up(&mut self, nodes: &[GossipNode]) -> bool {
        if self.seeds.is_empty() && !self.self_is_first_seed {
            return true;
        }
        let now = Instant::now();
        let other_up = nodes.iter().any(|n| {
            n.live
                && n.address.node_id != self.address.node_id
                && n.keys
                    .get(keys::STATUS)
                    .and_then(|s| MemberStatus::from_key(s))
                    .is_some_and(MemberStatus::is_up_or_leaving)
        });
        if other_up {
            let seen = *self.up_member_seen_at.get_or_insert(now);
            return now.duration_since(seen) >= self.gossip_interval * 2;
        }
        if self.self_is_first_seed && now.duration_since(self.started) >= self.seed_node_timeout {
            warn!(node = %self.address, gossip = %self.gossip_addr, "no member answered; forming a new cluster as first seed");
            return true;
        }
        false
    }
}
