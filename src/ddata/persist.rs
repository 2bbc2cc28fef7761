//! The persist thread: the replicator loop hands it batches of store writes and goes on; it
//! commits them in order (several queued batches in one LMDB transaction and one fsync),
//! retries failures, grows a full map, and reports each commit back, so the loop never waits
//! for the disk and acknowledgements are released only after the commit.
//!
//! **Retries.** A failed transaction is retried after 10 ms, 100 ms and 1 s; a full map is
//! doubled (up to `replicator.lmdb_max_map_size`) and the transaction retried at once. What
//! still fails is reported as a failure (the core then fails what waited on it and writes the
//! keys again) and marks the store unhealthy until a commit succeeds.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::durable::{DurableStore, StoreOp};
use super::stats::ReplicatorStatCells;
use crate::machine::DiskWriter;
use crate::metrics::CommitTimer;

/// Pauses before the retries of a failed transaction.
const RETRY_BACKOFF: [Duration; 3] = [Duration::from_millis(10), Duration::from_millis(100), Duration::from_secs(1)];

/// Most bytes of queued batches joined into one transaction.
const MAX_TRANSACTION_BYTES: usize = 64 << 20;

/// Whether the durable store currently commits, readable while the node runs.
#[derive(Debug, Default)]
pub struct DurableHealth {
    unhealthy: AtomicBool,
    last_error: Mutex<Option<String>>,
}

impl DurableHealth {
    /// `true` unless the last commit failed after its retries.
    pub fn is_healthy(&self) -> bool {
        !self.unhealthy.load(Ordering::Relaxed)
    }

    /// The error of the last failed commit, if the store is unhealthy.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set(&self, error: Option<String>) {
        self.unhealthy.store(error.is_some(), Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = error;
    }
}

/// Writes to commit; `through` is the highest ticket among them.
#[derive(Debug)]
pub(crate) struct PersistJob {
    pub through: u64,
    pub ops: Vec<StoreOp>,
}

/// One commit's outcome: every ticket up to `through` is committed, or failed with `failure`.
#[derive(Debug)]
pub(crate) struct PersistReport {
    pub through: u64,
    pub failure: Option<(PathBuf, String)>,
    /// Bytes of the jobs this report covers (the loop's backlog shrinks by this much).
    pub bytes: usize,
}

/// What the persist worker commits with and reports to.
pub(crate) struct PersistParts {
    pub(crate) store: DurableStore,
    /// The map grows up to this size.
    pub(crate) max_map_size: usize,
    pub(crate) health: Arc<DurableHealth>,
    pub(crate) stats: Arc<ReplicatorStatCells>,
    pub(crate) commit_timer: CommitTimer,
}

/// Handle of a running persist worker: a thread of its own, or (on a machine that says so) a
/// task committing on the runtime's blocking pool; either takes one batch at a time, in order.
/// Dropping the sender ends it once the queue is drained; [`PersistWorker::join`] waits for that.
pub(crate) struct PersistWorker {
    pub jobs: mpsc::UnboundedSender<PersistJob>,
    pub reports: mpsc::UnboundedReceiver<PersistReport>,
    handle: WorkerHandle,
}

enum WorkerHandle {
    Thread(std::thread::JoinHandle<()>),
    Task(tokio::task::JoinHandle<()>),
}

impl PersistWorker {
    /// Starts the worker, the only user of the store from now on.
    pub(crate) fn start(parts: PersistParts, disk_writer: DiskWriter) -> std::io::Result<PersistWorker> {
        Self::start_with(parts, disk_writer, Vec::new(), Limits::PRODUCTION)
    }

    /// Starts the worker with `queued` jobs already waiting.
    fn start_with(
        parts: PersistParts,
        disk_writer: DiskWriter,
        queued: Vec<PersistJob>,
        limits: Limits,
    ) -> std::io::Result<PersistWorker> {
        let (jobs, mut rx) = mpsc::unbounded_channel::<PersistJob>();
        for job in queued {
            let _ = jobs.send(job);
        }
        let (report_tx, reports) = mpsc::unbounded_channel();
        let PersistParts { store, max_map_size, health, stats, commit_timer } = parts;
        let mut writer =
            Writer { store, max_map_size, health, stats, commit_timer, retry_backoff: limits.retry_backoff };
        writer.stats.durable_map_max_bytes.store(max_map_size as u64, Ordering::Relaxed);
        writer.stats.durable_map_used_bytes.store(writer.store.map_used(), Ordering::Relaxed);
        let cap = limits.max_transaction_bytes;
        let handle = match disk_writer {
            DiskWriter::OwnThread => {
                WorkerHandle::Thread(std::thread::Builder::new().name("ddshard-persist".into()).spawn(move || {
                    while let Some(first) = rx.blocking_recv() {
                        let batch = Batch::gather(first, &mut rx, cap);
                        if !writer.commit_and_report(batch, &report_tx) {
                            break;
                        }
                    }
                })?)
            }
            DiskWriter::BlockingPool { latency } => WorkerHandle::Task(tokio::spawn(async move {
                while let Some(first) = rx.recv().await {
                    let batch = Batch::gather(first, &mut rx, cap);
                    tokio::time::sleep(latency).await;
                    let report_tx = report_tx.clone();
                    let committed = tokio::task::spawn_blocking(move || {
                        let more = writer.commit_and_report(batch, &report_tx);
                        (writer, more)
                    });
                    match committed.await {
                        Ok((back, true)) => writer = back,
                        Ok((_, false)) => break,
                        Err(e) => {
                            error!(error = %e, "persist commit did not finish");
                            break;
                        }
                    }
                }
            })),
        };
        Ok(PersistWorker { jobs, reports, handle })
    }

    /// Closes the queue and waits until everything queued is committed (or failed).
    pub(crate) async fn join(self) {
        let PersistWorker { jobs, reports, handle } = self;
        drop(jobs);
        drop(reports);
        // Whether the worker panicked; `None`: not joined because the runtime is shutting down
        // (the worker still ends once its queue is closed).
        let panicked = match handle {
            WorkerHandle::Thread(handle) => {
                tokio::task::spawn_blocking(move || handle.join()).await.ok().map(|r| r.is_err())
            }
            WorkerHandle::Task(task) => match task.await {
                Ok(()) => Some(false),
                Err(e) => e.is_panic().then_some(true),
            },
        };
        match panicked {
            Some(true) => error!("persist worker panicked"),
            Some(false) => {}
            None => tracing::debug!("persist worker not joined: the runtime is shutting down"),
        }
    }
}

/// Queued jobs joined into one transaction (group commit).
struct Batch {
    through: u64,
    ops: Vec<StoreOp>,
    bytes: usize,
}

impl Batch {
    /// `first` and whatever queued meanwhile, while the batch holds fewer than `cap` bytes.
    fn gather(first: PersistJob, rx: &mut mpsc::UnboundedReceiver<PersistJob>, cap: usize) -> Batch {
        let mut through = first.through;
        let mut ops = first.ops;
        let mut bytes: usize = ops.iter().map(StoreOp::bytes_written).sum();
        while bytes < cap {
            let Ok(next) = rx.try_recv() else { break };
            through = through.max(next.through);
            bytes += next.ops.iter().map(StoreOp::bytes_written).sum::<usize>();
            ops.extend(next.ops);
        }
        Batch { through, ops, bytes }
    }
}

/// The thread's fixed limits (tests shrink them to reach their edges quickly).
#[derive(Clone, Copy)]
struct Limits {
    /// A transaction takes more queued jobs while it holds fewer bytes than this.
    max_transaction_bytes: usize,
    /// Pauses between the tries of a failed commit.
    retry_backoff: &'static [Duration],
}

impl Limits {
    const PRODUCTION: Limits = Limits { max_transaction_bytes: MAX_TRANSACTION_BYTES, retry_backoff: &RETRY_BACKOFF };
}

struct Writer {
    store: DurableStore,
    max_map_size: usize,
    health: Arc<DurableHealth>,
    stats: Arc<ReplicatorStatCells>,
    commit_timer: CommitTimer,
    retry_backoff: &'static [Duration],
}

impl Writer {
    /// Commits `batch` and reports its outcome; `false` when nobody listens any more.
    fn commit_and_report(&mut self, batch: Batch, reports: &mpsc::UnboundedSender<PersistReport>) -> bool {
        let Batch { through, ops, bytes } = batch;
        let failure = self.commit(&ops).err().map(|e| (self.store.path().to_path_buf(), e));
        reports.send(PersistReport { through, failure, bytes }).is_ok()
    }

    /// Commits `ops` in one transaction, with the retries and map growth of the module doc.
    fn commit(&mut self, ops: &[StoreOp]) -> Result<(), String> {
        let mut attempt = 0;
        loop {
            let started = std::time::Instant::now();
            let applied = self.store.apply(ops);
            let took = started.elapsed();
            ReplicatorStatCells::add(&self.stats.durable_commit_micros, took.as_micros() as usize);
            self.commit_timer.record(took);
            // (error, whether retrying can help)
            let (error, retry) = match applied {
                Ok(()) => {
                    self.stats.durable_map_used_bytes.store(self.store.map_used(), Ordering::Relaxed);
                    ReplicatorStatCells::inc(&self.stats.durable_commits);
                    ReplicatorStatCells::add(&self.stats.durable_records, ops.len());
                    if !self.health.is_healthy() {
                        info!(path = %self.store.path().display(), "durable store commits again");
                    }
                    self.health.set(None);
                    return Ok(());
                }
                Err(heed::Error::Mdb(heed::MdbError::MapFull)) => match self.grow() {
                    Ok(()) => continue,
                    Err(e) => (e, false),
                },
                Err(e) => (e.to_string(), true),
            };
            let Some(pause) = self.retry_backoff.get(attempt).filter(|_| retry) else {
                ReplicatorStatCells::inc(&self.stats.durable_failures);
                error!(path = %self.store.path().display(), %error, "durable commit failed; its writes are not acknowledged");
                self.health.set(Some(error.clone()));
                return Err(error);
            };
            ReplicatorStatCells::inc(&self.stats.durable_retries);
            warn!(path = %self.store.path().display(), %error, attempt = attempt + 1, "durable commit failed; retrying");
            std::thread::sleep(*pause);
            attempt += 1;
        }
    }

    /// Doubles the map, up to the configured maximum.
    fn grow(&mut self) -> Result<(), String> {
        let current = self.store.map_size();
        if current >= self.max_map_size {
            return Err(format!(
                "map full at {current} bytes, the maximum (replicator.lmdb_max_map_size); \
                 raise it or free disk space"
            ));
        }
        let next = current.saturating_mul(2).min(self.max_map_size);
        self.store.grow_map(next).map_err(|e| format!("map full at {current} bytes and cannot grow: {e}"))?;
        info!(path = %self.store.path().display(), from = current, to = next, "durable store map grown");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big_ops(n: usize, each: usize) -> Vec<StoreOp> {
        (0..n).map(|i| StoreOp::Snapshot { key: format!("k{i}"), seq: i as u64, bytes: vec![7; each] }).collect()
    }

    fn parts(
        store: DurableStore,
        max_map_size: usize,
        health: &Arc<DurableHealth>,
        stats: &Arc<ReplicatorStatCells>,
    ) -> PersistParts {
        PersistParts {
            store,
            max_map_size,
            health: health.clone(),
            stats: stats.clone(),
            commit_timer: CommitTimer::new("n"),
        }
    }

    async fn run_one(t: &mut PersistWorker, through: u64, ops: Vec<StoreOp>) -> PersistReport {
        t.jobs.send(PersistJob { through, ops }).unwrap();
        t.reports.recv().await.unwrap()
    }

    #[tokio::test]
    async fn a_full_map_grows_and_the_commit_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let store = DurableStore::open(dir.path(), 1 << 20).unwrap();
        let (health, stats) = (Arc::new(DurableHealth::default()), Arc::new(ReplicatorStatCells::default()));
        let mut t =
            PersistWorker::start(parts(store.clone(), 64 << 20, &health, &stats), DiskWriter::OwnThread).unwrap();
        let r = run_one(&mut t, 1, big_ops(8, 512 << 10)).await;
        assert!(r.failure.is_none(), "{:?}", r.failure);
        assert_eq!(r.through, 1);
        assert!(store.map_size() >= 8 << 20, "grown to {}", store.map_size());
        assert!(health.is_healthy());
        assert_eq!(stats.durable_commits.load(Ordering::Relaxed), 1);
        // The map's use is what was written (8 × 512 KiB and the tree), within the grown map.
        let used = stats.durable_map_used_bytes.load(Ordering::Relaxed);
        assert!(used >= 4 << 20 && used <= store.map_size() as u64, "used {used} of {}", store.map_size());
        assert_eq!(stats.durable_map_max_bytes.load(Ordering::Relaxed), 64 << 20);
        t.join().await;
        drop(store);
        let store = DurableStore::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(store.load_all().unwrap().corrupt.len(), 8, "all eight written (not CRDT values)");
    }

    #[tokio::test]
    async fn a_full_map_at_its_maximum_fails_loudly_and_marks_the_store_unhealthy_until_a_commit_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let store = DurableStore::open(dir.path(), 1 << 20).unwrap();
        let (health, stats) = (Arc::new(DurableHealth::default()), Arc::new(ReplicatorStatCells::default()));
        let mut t = PersistWorker::start(parts(store, 2 << 20, &health, &stats), DiskWriter::OwnThread).unwrap();
        let r = run_one(&mut t, 5, big_ops(8, 512 << 10)).await;
        let (_, reason) = r.failure.expect("a failure report");
        assert!(reason.contains("lmdb_max_map_size"), "{reason}");
        assert_eq!(r.through, 5);
        assert!(!health.is_healthy());
        assert!(health.last_error().unwrap().contains("map full"));
        assert_eq!(stats.durable_failures.load(Ordering::Relaxed), 1);
        let r = run_one(&mut t, 6, big_ops(1, 16)).await;
        assert!(r.failure.is_none());
        assert!(health.is_healthy() && health.last_error().is_none());
        t.join().await;
    }

    #[tokio::test]
    async fn batches_queued_while_a_commit_runs_share_the_next_transaction_on_a_thread_or_the_blocking_pool() {
        let blocking_pool = DiskWriter::BlockingPool { latency: Duration::from_millis(1) };
        for disk_writer in [DiskWriter::OwnThread, blocking_pool] {
            let dir = tempfile::tempdir().unwrap();
            let store = DurableStore::open(dir.path(), 64 << 20).unwrap();
            let (health, stats) = (Arc::new(DurableHealth::default()), Arc::new(ReplicatorStatCells::default()));
            let queued = (1..=200u64).map(|i| PersistJob { through: i, ops: big_ops(1, 64) }).collect();
            let mut t = PersistWorker::start_with(
                parts(store, 64 << 20, &health, &stats),
                disk_writer,
                queued,
                Limits::PRODUCTION,
            )
            .unwrap();
            let r = t.reports.recv().await.unwrap();
            assert!(r.failure.is_none());
            assert_eq!(r.through, 200, "{disk_writer:?}: one report covers every queued ticket");
            assert_eq!(r.bytes, 200 * (2 + 8 + 64), "{disk_writer:?}: and every queued byte");
            assert_eq!(stats.durable_commits.load(Ordering::Relaxed), 1, "{disk_writer:?}: one transaction");
            // A later job gets its own report, after the first: one batch at a time, in order.
            let late = StoreOp::Snapshot { key: "late".into(), seq: 201, bytes: vec![7; 8] };
            t.jobs.send(PersistJob { through: 201, ops: vec![late] }).unwrap();
            assert_eq!(t.reports.recv().await.unwrap().through, 201, "{disk_writer:?}");
            t.join().await;
            // Joined: the store is closed (it opens again) and both keys are on disk. The records
            // are raw bytes (no CRDT): they load as keys that do not decode.
            let loaded = DurableStore::open(dir.path(), 64 << 20).unwrap().load_all().unwrap();
            let mut keys: Vec<String> = loaded.corrupt.into_iter().map(|(k, _)| k).collect();
            keys.sort();
            assert_eq!(keys, ["k0", "late"], "{disk_writer:?}");
        }
    }

    #[tokio::test]
    async fn a_transaction_stops_taking_queued_jobs_once_it_holds_the_byte_cap() {
        let dir = tempfile::tempdir().unwrap();
        let store = DurableStore::open(dir.path(), 64 << 20).unwrap();
        let (health, stats) = (Arc::new(DurableHealth::default()), Arc::new(ReplicatorStatCells::default()));
        // Each job writes 2 + 8 + 64 = 74 bytes; a cap of two jobs exactly.
        let queued = (1..=3u64).map(|i| PersistJob { through: i, ops: big_ops(1, 64) }).collect();
        let limits = Limits { max_transaction_bytes: 2 * 74, ..Limits::PRODUCTION };
        let mut t =
            PersistWorker::start_with(parts(store, 64 << 20, &health, &stats), DiskWriter::OwnThread, queued, limits)
                .unwrap();
        let first = t.reports.recv().await.unwrap();
        assert_eq!((first.through, first.bytes), (2, 148), "the cap is reached: the third job waits");
        let second = t.reports.recv().await.unwrap();
        assert_eq!((second.through, second.bytes), (3, 74));
        assert_eq!(stats.durable_commits.load(Ordering::Relaxed), 2);
        t.join().await;
    }

    #[tokio::test]
    async fn a_commit_that_keeps_failing_is_tried_once_per_backoff_step_then_reported_and_unhealthy() {
        let dir = tempfile::tempdir().unwrap();
        let store = DurableStore::open(dir.path(), 64 << 20).unwrap();
        let (health, stats) = (Arc::new(DurableHealth::default()), Arc::new(ReplicatorStatCells::default()));
        const BACKOFF: [Duration; 2] = [Duration::from_millis(1), Duration::from_millis(1)];
        let limits = Limits { retry_backoff: &BACKOFF, ..Limits::PRODUCTION };
        let mut t = PersistWorker::start_with(
            parts(store, 64 << 20, &health, &stats),
            DiskWriter::OwnThread,
            Vec::new(),
            limits,
        )
        .unwrap();
        // A delta record's key length is a u16: this one can never be stored.
        let unstorable = StoreOp::Delta { key: "k".repeat(70_000), seq: 1, bytes: vec![1] };
        let r = run_one(&mut t, 9, vec![unstorable]).await;
        assert_eq!(r.through, 9);
        assert!(r.failure.is_some());
        assert_eq!(stats.durable_retries.load(Ordering::Relaxed), 2, "one retry per backoff step");
        assert_eq!(stats.durable_failures.load(Ordering::Relaxed), 1);
        assert_eq!(stats.durable_commits.load(Ordering::Relaxed), 0);
        assert!(!health.is_healthy());
        t.join().await;
    }
}
