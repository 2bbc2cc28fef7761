//! The replicator's tokio driver: one task owns the [`ReplicatorCore`], the inbox and the
//! ticker, performs the core's actions and hands store writes to the persist worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use super::durable::{DurableStore, StoreOp};
use super::persist::{DurableHealth, PersistJob, PersistParts, PersistReport, PersistWorker};
use super::replicator::ReplicatorMsg;
use super::replicator::{
    self, KeyLog, PersistRecord, RESERVATION_SPAN, ReplicatorAction, ReplicatorCore, ReplicatorInput, StoreWriter,
};
use super::{Command, ReplicatedData, Replicator, ReplicatorStatCells, ReplyTx, TOPIC};
use crate::clock::wall_ms;
use crate::error::{Error, Result};
use crate::machine::DiskWriter;
use crate::membership::{MembershipSnapshot, UniqueAddress};
use crate::spawn::Spawner;
use crate::transport::{Inbound, PeerAddr, Transport};

/// Settings the driver needs.
pub(crate) struct ReplicatorParams {
    pub self_addr: UniqueAddress,
    pub role: Option<String>,
    pub durable_prefixes: Vec<String>,
    pub gossip_interval: Duration,
    pub delta_interval: Duration,
    pub max_message_bytes: usize,
    /// The LMDB map grows up to this size.
    pub max_map_size: usize,
    /// A roster id absent this long is forgotten (`None`: only by an operator).
    pub forget_absent_after: Option<Duration>,
    /// Where the persist worker runs (the node's machine says).
    pub disk_writer: DiskWriter,
}

/// Store writes handed to the persist thread and not yet committed, at most (bytes); past it the
/// loop takes no new commands or messages until commits catch up.
const MAX_PERSIST_BACKLOG_BYTES: usize = 64 << 20;

/// Loads the durable keys, then starts the replicator task. Nothing is served before the load
/// finished; a store that cannot be read fails the start.
pub(crate) async fn start(
    params: ReplicatorParams,
    transport: Transport,
    members: watch::Receiver<Arc<MembershipSnapshot>>,
    store: DurableStore,
    spawner: Spawner,
) -> Result<Replicator> {
    let loader = store.clone();
    let (loaded, reservation) = tokio::task::spawn_blocking(move || {
        let loaded = loader.load_all()?;
        // A key skipped as corrupt may hold adds of the store's writer that no other record
        // has: the writer cannot claim its skipped counters there, so it takes a new identity.
        let reservation = loader.reserve_counters(RESERVATION_SPAN, !loaded.corrupt.is_empty())?;
        Ok::<_, Error>((loaded, reservation))
    })
    .await
    .map_err(|e| Error::storage(store.path(), format!("load task failed: {e}")))??;
    let settings = replicator::CoreSettings {
        durable_prefixes: params.durable_prefixes,
        gossip_interval: params.gossip_interval,
        delta_interval: params.delta_interval,
        max_message_bytes: params.max_message_bytes,
        forget_absent_after: params.forget_absent_after,
    };
    let stats = Arc::new(ReplicatorStatCells::default());
    let writer = StoreWriter::new(&params.self_addr.node_id, reservation);
    let mut core = ReplicatorCore::new(params.self_addr.clone(), writer, settings, stats.clone());
    for (key, error) in &loaded.corrupt {
        ReplicatorStatCells::inc(&stats.rejected);
        error!(%key, %error, "durable value does not decode; skipped (other replicas repair it)");
    }
    if loaded.dead_deltas > 0 {
        tracing::info!(dead = loaded.dead_deltas, "durable delta log has records covered by snapshots; trimmed next");
    }
    let entries = loaded.entries.into_iter().map(|k| {
        let log = KeyLog {
            last_ticket: k.snapshot_seq.max(k.last_log_seq),
            snapshot_bytes: k.snapshot_bytes,
            log_bytes: k.log_bytes,
            log_records: k.log_records,
            first_log_seq: k.first_log_seq,
        };
        (k.key, k.value, log)
    });
    core.load(entries.collect(), loaded.max_seq);
    let health = Arc::new(DurableHealth::default());
    let commit_timer = crate::metrics::CommitTimer::new(&params.self_addr.node_id);
    let parts = PersistParts {
        store,
        max_map_size: params.max_map_size,
        health: health.clone(),
        stats: stats.clone(),
        commit_timer,
    };
    let persist =
        PersistWorker::start(parts, params.disk_writer).map_err(|e| Error::io("starting the persist worker", e))?;
    let inbound = transport.subscribe(TOPIC, 4096);
    let (tx, rx) = mpsc::channel(4096);
    let driver = ReplicatorDriver {
        core,
        transport,
        role: params.role,
        watchers: HashMap::new(),
        stats: stats.clone(),
        persist_backlog: 0,
    };
    let shutdown = spawner.shutdown_token().clone();
    spawner.spawn_essential("replicator", driver.run(rx, inbound, members, persist, shutdown));
    Ok(Replicator { commands: tx, stats, health })
}

struct ReplicatorDriver {
    core: ReplicatorCore<ReplyTx>,
    transport: Transport,
    role: Option<String>,
    watchers: HashMap<String, watch::Sender<Option<ReplicatedData>>>,
    stats: Arc<ReplicatorStatCells>,
    /// Bytes handed to the persist thread and not yet reported.
    persist_backlog: usize,
}

impl ReplicatorDriver {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut inbound: mpsc::Receiver<Inbound>,
        mut members: watch::Receiver<Arc<MembershipSnapshot>>,
        mut persist: PersistWorker,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(Duration::from_millis(25));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut cmds = Vec::with_capacity(256);
        let mut msgs = Vec::with_capacity(256);
        let mut actions = Vec::new();
        self.apply_members(&members.borrow_and_update(), &mut actions);
        loop {
            let now = crate::clock::now();
            let wall = wall_ms();
            let accepting = self.persist_backlog < MAX_PERSIST_BACKLOG_BYTES;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                report = persist.reports.recv() => {
                    let Some(PersistReport { through, failure, bytes }) = report else {
                        error!("persist thread ended; the replicator stops");
                        break;
                    };
                    self.persist_backlog = self.persist_backlog.saturating_sub(bytes);
                    self.core.handle(ReplicatorInput::Persisted { through, failure }, now, wall, &mut actions);
                }
                n = commands.recv_many(&mut cmds, 256), if accepting => {
                    if n == 0 { break; }
                    for c in cmds.drain(..) {
                        match c {
                            Command::Op(input) => self.core.handle(input, now, wall, &mut actions),
                            Command::Inspect { key, inspect } => inspect(self.core.local_value(&key)),
                            Command::HandOver { timeout, reply } => {
                                let input = ReplicatorInput::HandOver { timeout, reply: ReplyTx::Update(reply) };
                                self.core.handle(input, now, wall, &mut actions);
                            }
                            Command::Subscribe { key, reply } => {
                                let current = self.core.local_value(&key).cloned();
                                let w = self.watchers.entry(key).or_insert_with(|| watch::channel(current).0);
                                let _ = reply.send(w.subscribe());
                            }
                        }
                    }
                }
                n = inbound.recv_many(&mut msgs, 256), if accepting => {
                    if n == 0 { break; }
                    for m in msgs.drain(..) {
                        match crate::transport::wire::decode::<ReplicatorMsg>(&m.body) {
                            Ok(msg) => self.core.handle(ReplicatorInput::Remote { from: m.from, msg }, now, wall, &mut actions),
                            Err(e) => {
                                ReplicatorStatCells::inc(&self.stats.rejected);
                                warn!(peer = %m.from.address, error = %e, "malformed replicator message dropped");
                            }
                        }
                    }
                }
                _ = tick.tick() => self.core.handle(ReplicatorInput::Tick, now, wall, &mut actions),
                changed = members.changed() => {
                    if changed.is_err() { break; }
                    let snap = members.borrow_and_update().clone();
                    self.apply_members(&snap, &mut actions);
                }
            }
            if !actions.is_empty() {
                // Drained, not taken: the buffer keeps its capacity across rounds.
                self.perform(&mut actions, &persist.jobs);
            }
        }
        // Whatever was handed over is still committed before the node's shutdown completes
        // (and the store is closed before it can be opened again).
        persist.join().await;
    }

    fn apply_members(&mut self, snap: &MembershipSnapshot, out: &mut Vec<ReplicatorAction<ReplyTx>>) {
        self.core.handle(ReplicatorInput::members_of(snap, self.role.as_deref()), crate::clock::now(), wall_ms(), out);
    }

    /// Performs actions: the persists of the batch go to the persist thread as one job (the
    /// loop does not wait for it); sends, replies and notifications go at once (the core holds
    /// whatever must wait for the commit).
    fn perform(&mut self, actions: &mut Vec<ReplicatorAction<ReplyTx>>, jobs: &mpsc::UnboundedSender<PersistJob>) {
        let mut ops = Vec::new();
        let mut through = 0;
        for a in actions.drain(..) {
            match a {
                ReplicatorAction::Persist { key, ticket, record } => {
                    through = through.max(ticket);
                    let encoded = match &record {
                        PersistRecord::Snapshot => self.core.local_value(&key).map(rmp_serde::to_vec),
                        PersistRecord::Delta(d) => Some(rmp_serde::to_vec(d)),
                    };
                    match (encoded, record) {
                        (Some(Ok(bytes)), PersistRecord::Snapshot) => {
                            ops.push(StoreOp::Snapshot { key, seq: ticket, bytes })
                        }
                        (Some(Ok(bytes)), PersistRecord::Delta(_)) => {
                            ops.push(StoreOp::Delta { key, seq: ticket, bytes })
                        }
                        (Some(Err(e)), _) => error!(%key, error = %e, "cannot encode durable value"),
                        (None, _) => {}
                    }
                }
                ReplicatorAction::TrimLog { below } => ops.push(StoreOp::TrimLog { below }),
                ReplicatorAction::ReserveCounters { ticket, ceiling } => {
                    through = through.max(ticket);
                    ops.push(StoreOp::CounterCeiling { ceiling });
                }
                ReplicatorAction::Send { to, msg } => self.send_to(std::slice::from_ref(&to), &msg),
                ReplicatorAction::Broadcast { to, msg } => self.send_to(&to, &msg),
                ReplicatorAction::ReplyGet { reply: ReplyTx::Get(tx), result } => {
                    let _ = tx.send(result);
                }
                ReplicatorAction::ReplyGetMany { reply: ReplyTx::GetMany(tx), result } => {
                    let _ = tx.send(result);
                }
                ReplicatorAction::ReplyUpdate { reply: ReplyTx::Update(tx), result } => {
                    let _ = tx.send(result);
                }
                ReplicatorAction::ReplyGet { .. }
                | ReplicatorAction::ReplyGetMany { .. }
                | ReplicatorAction::ReplyUpdate { .. } => {
                    error!("reply handle of the wrong kind; this is a bug");
                }
                ReplicatorAction::Changed { key } => {
                    if let Some(w) = self.watchers.get(&key) {
                        w.send_replace(self.core.local_value(&key).cloned());
                    }
                }
            }
        }
        if !ops.is_empty() {
            self.persist_backlog += ops.iter().map(StoreOp::bytes_written).sum::<usize>();
            if jobs.send(PersistJob { through, ops }).is_err() {
                error!("persist thread gone; durable writes are not acknowledged");
            }
        }
    }

    /// Encodes once, sends to each peer.
    fn send_to(&self, peers: &[PeerAddr], msg: &ReplicatorMsg) {
        match crate::transport::wire::encode(msg) {
            Ok(bytes) => {
                for to in peers {
                    if let Err(e) = self.transport.send(to, TOPIC, &bytes) {
                        warn!(peer = %to.address, error = %e, "replicator message not sent");
                    }
                }
            }
            Err(e) => error!(error = %e, "cannot encode replicator message"),
        }
    }
}
