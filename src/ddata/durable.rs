//! LMDB (heed) storage for durable replicator keys and node metadata, under `data_dir`.
//! Public with the `testkit` feature only, for storage tests; no stability promise.
//!
//! Every method is blocking and runs a whole transaction; callers on the runtime wrap the call
//! in `spawn_blocking` (a heed write transaction must be created and committed on one thread).
//! Once the replicator has loaded, its persist thread is the only user of the environment.
//!
//! **Layout.** One global delta log and a snapshot per key. Database `deltas`: `u64 sequence`
//! (big-endian) → `u16 key length ‖ key ‖ encoded delta`; sequences only grow, so every commit
//! appends at the end of one B-tree and dirties a few pages however many keys it touches.
//! Database `ddata`: key → `u64 sequence ‖ encoded value`, the sequence being that of the
//! snapshot: it covers every delta of the key with a lower sequence. Loading joins each key's
//! live deltas (above its snapshot) into its snapshot, or, for a key without one, into the
//! empty value of the delta's type. Dead deltas are deleted by [`StoreOp::TrimLog`] once no
//! key needs anything below a sequence.

use std::path::{Path, PathBuf};

use heed::types::{Bytes, Str};
use heed::{CommitOrAbort, Database, Env, EnvOpenOptions, WithoutTls};

use super::crdt::{ReplicatedData, ReplicatedDelta};
use crate::error::{Error, Result};

/// The durable store of one node. Cloning shares the environment.
#[derive(Clone)]
pub struct DurableStore {
    env: Env<WithoutTls>,
    data: Database<'static, Str, Bytes>,
    deltas: Database<'static, Bytes, Bytes>,
    meta: Database<'static, Str, Bytes>,
    path: PathBuf,
    /// Held shared by a transaction from outside the persist thread, exclusively by a map
    /// resize: LMDB unmaps and remaps the file on a resize, which no other transaction of this
    /// process may overlap.
    resize_guard: std::sync::Arc<std::sync::RwLock<()>>,
}

impl std::fmt::Debug for DurableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableStore").field("path", &self.path).finish()
    }
}

const GENERATION_KEY: &str = "generation";
/// The store's random id (8 bytes): with the node id, the OR-set writer of its durable keys.
const STORE_ID_KEY: &str = "store-id";
/// OR-set counters of the store writer below this (8 bytes) may have been used.
const COUNTER_CEILING_KEY: &str = "counter-ceiling";

/// The store's OR-set writer and the counters one process of it may use: `[floor, ceiling)`.
/// Every counter an earlier process could have used (and sent) is below `floor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterReservation {
    /// The store's random id, fixed when the store was first reserved from.
    pub store_id: u64,
    /// Lowest counter of this process: the ceiling the previous one had reserved.
    pub floor: u64,
    /// Counters from here up are not reserved (yet): see [`StoreOp::CounterCeiling`].
    pub ceiling: u64,
}

/// Largest record sequence a store may hold (2^62: billions of years of writes).
const MAX_SEQUENCE: u64 = 1 << 62;
const FORMAT_KEY: &str = "format";

/// Version of the store's layout and value encoding. 3: sequence-stamped snapshots and one
/// global delta log. 2 (bare snapshots, same value encoding) is converted in place at load.
/// 1 (unmarked) was `crdts::Orswot` and `crdts::GSet`, and is refused.
pub const FORMAT_VERSION: u32 = 3;

/// Format 2: snapshots without a sequence, no delta log.
const FORMAT_BARE_SNAPSHOTS: u32 = 2;

/// One key as [`DurableStore::load_all`] read it.
#[derive(Debug)]
pub struct StoredKey {
    /// The key.
    pub key: String,
    /// Its snapshot joined with its live deltas.
    pub value: ReplicatedData,
    /// Encoded size of the snapshot (0 if the key has only deltas).
    pub snapshot_bytes: usize,
    /// Sequence of the snapshot (0 if none).
    pub snapshot_seq: u64,
    /// Encoded size of the live delta records.
    pub log_bytes: usize,
    /// Number of live delta records.
    pub log_records: u32,
    /// Lowest and highest sequence of the live delta records (0 if none).
    pub first_log_seq: u64,
    /// See `first_log_seq`.
    pub last_log_seq: u64,
}

impl StoredKey {
    fn new(key: &str, value: ReplicatedData, snapshot_bytes: usize, snapshot_seq: u64) -> StoredKey {
        StoredKey {
            key: key.to_string(),
            value,
            snapshot_bytes,
            snapshot_seq,
            log_bytes: 0,
            log_records: 0,
            first_log_seq: 0,
            last_log_seq: 0,
        }
    }
}

/// What [`DurableStore::load_all`] read.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Every key whose snapshot and deltas decoded and joined.
    pub entries: Vec<StoredKey>,
    /// Keys whose stored bytes do not decode or join (left in place, skipped; other replicas
    /// repair), with the reason.
    pub corrupt: Vec<(String, String)>,
    /// Delta records below a snapshot (dead, not yet trimmed).
    pub dead_deltas: usize,
    /// Highest sequence in the store (new sequences continue above it).
    pub max_seq: u64,
}

/// One write of a [`DurableStore::apply`] transaction.
#[derive(Debug, Clone)]
pub enum StoreOp {
    /// Replaces the key's snapshot; it covers the key's deltas below `seq`.
    Snapshot {
        /// The key.
        key: String,
        /// Sequence of the snapshot.
        seq: u64,
        /// The encoded value.
        bytes: Vec<u8>,
    },
    /// Appends a delta of `key` to the log.
    Delta {
        /// The key.
        key: String,
        /// Sequence number (grows per store).
        seq: u64,
        /// The encoded delta.
        bytes: Vec<u8>,
    },
    /// Deletes every delta record below `below` (all dead: covered by snapshots).
    TrimLog {
        /// First sequence kept.
        below: u64,
    },
    /// Reserves the store writer's OR-set counters below `ceiling` (never lowers the stored
    /// ceiling).
    CounterCeiling {
        /// The new ceiling.
        ceiling: u64,
    },
}

impl StoreOp {
    /// Bytes this op writes (what the persist queue's byte bound counts).
    pub fn bytes_written(&self) -> usize {
        match self {
            StoreOp::Snapshot { key, bytes, .. } | StoreOp::Delta { key, bytes, .. } => key.len() + bytes.len() + 8,
            StoreOp::TrimLog { .. } | StoreOp::CounterCeiling { .. } => 8,
        }
    }
}

/// `u16 key length ‖ key ‖ delta`; `None` for a key too long to store.
fn encode_delta_record(key: &str, delta: &[u8]) -> Option<Vec<u8>> {
    let len = u16::try_from(key.len()).ok()?;
    let mut v = Vec::with_capacity(2 + key.len() + delta.len());
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(key.as_bytes());
    v.extend_from_slice(delta);
    Some(v)
}

/// Splits a delta record into key and encoded delta; `None` if malformed.
fn parse_delta_record(raw: &[u8]) -> Option<(&str, &[u8])> {
    let len = usize::from(u16::from_be_bytes(raw.get(..2)?.try_into().ok()?));
    let key = std::str::from_utf8(raw.get(2..2 + len)?).ok()?;
    Some((key, raw.get(2 + len..)?))
}

fn parse_seq(raw: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(raw.try_into().ok()?))
}

/// `u64 sequence ‖ value`.
fn encode_snapshot(seq: u64, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + value.len());
    v.extend_from_slice(&seq.to_be_bytes());
    v.extend_from_slice(value);
    v
}

fn parse_snapshot(raw: &[u8]) -> Option<(u64, &[u8])> {
    Some((parse_seq(raw.get(..8)?)?, raw.get(8..)?))
}

impl DurableStore {
    /// Opens (creating if needed) the store in `dir`. A corrupt or foreign file is a typed
    /// [`Error::Storage`].
    pub fn open(dir: &Path, map_size: usize) -> Result<DurableStore> {
        Self::open_with(dir, map_size, true)
    }

    /// Opens the store; without `fsync` a commit is left in the operating system's cache (it
    /// survives the process, not the machine: only the test kit's simulated machine opens so).
    pub(crate) fn open_with(dir: &Path, map_size: usize, fsync: bool) -> Result<DurableStore> {
        create_private_dir(dir)?;
        let page = 4096;
        let map_size = map_size.div_ceil(page) * page;
        let mut options = EnvOpenOptions::new().read_txn_without_tls();
        options.map_size(map_size).max_dbs(4);
        if !fsync {
            // SAFETY: NO_SYNC only drops the flush at commit; LMDB stays consistent after a
            // crash of the process (not of the machine), which is all it is used for.
            #[allow(unsafe_code)]
            unsafe {
                options.flags(heed::EnvFlags::NO_SYNC);
            }
        }
        // SAFETY: heed requires that the same file is not opened twice in one process in a way
        // that breaks LMDB's locking; heed itself refuses a second open of the same path, and
        // ddshard opens each data dir once per node.
        #[allow(unsafe_code)]
        let env = unsafe { options.open(dir) }
            .map_err(|e| Error::storage(dir, format!("cannot open LMDB environment: {e}")))?;
        let wtxn = env.write_txn().map_err(|e| Error::storage(dir, e))?;
        let (data, deltas, meta) = env
            .create_databases_and_commit(wtxn, |dbo, w| -> heed::Result<_> {
                let data = dbo.create_database::<Str, Bytes>(w, Some("ddata"))?;
                let deltas = dbo.create_database::<Bytes, Bytes>(w, Some("deltas"))?;
                let meta = dbo.create_database::<Str, Bytes>(w, Some("meta"))?;
                Ok(CommitOrAbort::<_, ()>::Commit((data, deltas, meta)))
            })
            .map_err(|e| Error::storage(dir, format!("cannot open databases: {e}")))?
            .unwrap_commit();
        let store = DurableStore { env, data, deltas, meta, path: dir.to_path_buf(), resize_guard: Default::default() };
        store.stamp_if_empty()?;
        Ok(store)
    }

    /// A store without data gets the current format at once, so whatever is written next is
    /// known to be of this format.
    fn stamp_if_empty(&self) -> Result<()> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let empty = self.data.is_empty(&wtxn).map_err(|e| Error::storage(&self.path, e))?;
        let stamped = self.meta.get(&wtxn, FORMAT_KEY).map_err(|e| Error::storage(&self.path, e))?.is_some();
        if empty && !stamped {
            self.meta
                .put(&mut wtxn, FORMAT_KEY, &FORMAT_VERSION.to_be_bytes())
                .map_err(|e| Error::storage(&self.path, e))?;
        }
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every stored key with its value (snapshot joined with its delta log). Refuses a store
    /// written in an unreadable format (with an error that names `ddshard
    /// remove-internal-data`); a key whose snapshot or deltas do not decode or join is reported
    /// in [`Loaded::corrupt`] and skipped, so one bad record costs that key only.
    pub fn load_all(&self) -> Result<Loaded> {
        self.check_format()?;
        let rtxn = self.env.read_txn().map_err(|e| Error::storage(&self.path, e))?;
        let mut keys: std::collections::BTreeMap<String, std::result::Result<StoredKey, String>> = Default::default();
        let mut out = Loaded::default();
        for item in self.data.iter(&rtxn).map_err(|e| Error::storage(&self.path, e))? {
            let (key, raw) = item.map_err(|e| Error::storage(&self.path, e))?;
            let loaded = match parse_snapshot(raw) {
                None => Err("snapshot: shorter than its sequence".to_string()),
                // Sequences grow by one per write: one this high is corrupt (and tickets
                // continuing above it would overflow).
                Some((seq, _)) if seq > MAX_SEQUENCE => Err(format!("snapshot: sequence {seq} beyond any real store")),
                Some((seq, bytes)) => {
                    out.max_seq = out.max_seq.max(seq);
                    rmp_serde::from_slice::<ReplicatedData>(bytes)
                        .map(|value| StoredKey::new(key, value, bytes.len(), seq))
                        .map_err(|e| format!("snapshot: {e}"))
                }
            };
            keys.insert(key.to_string(), loaded);
        }
        // In sequence order, so each key's deltas join in the order they were written.
        for item in self.deltas.iter(&rtxn).map_err(|e| Error::storage(&self.path, e))? {
            let (raw_seq, raw) = item.map_err(|e| Error::storage(&self.path, e))?;
            let (Some(seq), Some((key, bytes))) = (parse_seq(raw_seq), parse_delta_record(raw)) else {
                // Its key cannot be told, so it cannot cost that key only: skipped and reported;
                // the key it belonged to is repaired from the other replicas like any stale one.
                out.corrupt.push((format!("(delta record {raw_seq:02x?})"), "malformed delta record".into()));
                continue;
            };
            if seq > MAX_SEQUENCE {
                keys.insert(key.to_string(), Err(format!("delta: sequence {seq} beyond any real store")));
                continue;
            }
            out.max_seq = out.max_seq.max(seq);
            if let Some(Ok(stored)) = keys.get(key)
                && stored.snapshot_seq >= seq
            {
                out.dead_deltas += 1;
                continue;
            }
            let joined = match rmp_serde::from_slice::<ReplicatedDelta>(bytes) {
                Err(e) => Err(format!("delta {seq}: {e}")),
                Ok(delta) => {
                    // Deltas without a snapshot start from the empty value of their type.
                    let slot = keys
                        .entry(key.to_string())
                        .or_insert_with(|| Ok(StoredKey::new(key, delta.empty_value(), 0, 0)));
                    let Ok(stored) = slot else { continue };
                    stored.value.merge_delta(&delta).map_err(|e| format!("delta {seq}: {e:?}")).map(|()| {
                        stored.log_bytes = stored.log_bytes.saturating_add(raw.len() + 8);
                        stored.log_records = stored.log_records.saturating_add(1);
                        if stored.first_log_seq == 0 {
                            stored.first_log_seq = seq;
                        }
                        stored.last_log_seq = seq;
                    })
                }
            };
            if let Err(reason) = joined {
                keys.insert(key.to_string(), Err(reason));
            }
        }
        for (key, loaded) in keys {
            match loaded {
                Ok(stored) => out.entries.push(stored),
                Err(reason) => out.corrupt.push((key, reason)),
            }
        }
        Ok(out)
    }

    /// Applies `ops` in one transaction, in order, durably (the commit returns after LMDB's
    /// fsync). The raw heed error is returned so the caller can tell a full map from the rest.
    pub fn apply(&self, ops: &[StoreOp]) -> heed::Result<()> {
        let mut wtxn = self.env.write_txn()?;
        for op in ops {
            match op {
                StoreOp::Snapshot { key, seq, bytes } => {
                    self.data.put(&mut wtxn, key, &encode_snapshot(*seq, bytes))?;
                }
                StoreOp::Delta { key, seq, bytes } => {
                    let Some(record) = encode_delta_record(key, bytes) else {
                        return Err(heed::Error::Encoding(format!("key of {} bytes is too long", key.len()).into()));
                    };
                    self.deltas.put(&mut wtxn, &seq.to_be_bytes(), &record)?;
                }
                StoreOp::TrimLog { below } => {
                    let end = below.to_be_bytes();
                    let range = (std::ops::Bound::Unbounded, std::ops::Bound::Excluded(&end[..]));
                    self.deltas.delete_range(&mut wtxn, &range)?;
                }
                StoreOp::CounterCeiling { ceiling } => {
                    let stored = self.meta.get(&wtxn, COUNTER_CEILING_KEY)?.and_then(|b| b.try_into().ok());
                    let stored = stored.map_or(0, u64::from_be_bytes);
                    if *ceiling > stored {
                        self.meta.put(&mut wtxn, COUNTER_CEILING_KEY, &ceiling.to_be_bytes())?;
                    }
                }
            }
        }
        wtxn.commit()
    }

    /// The current size of the memory map.
    pub fn map_size(&self) -> usize {
        self.env.info().map_size
    }

    /// Bytes of the map in use: its highest page written, times the page size.
    pub fn map_used(&self) -> u64 {
        let page = u64::from(self.env.unnamed_database_stat().page_size);
        (self.env.info().last_page_number as u64).saturating_add(1).saturating_mul(page)
    }

    /// Grows the memory map to `new_size` (rounded up to whole pages).
    ///
    /// LMDB allows this only while no transaction of this process is open on the environment:
    /// call it only from the thread that is the store's sole user (the persist thread, after
    /// the load).
    pub(crate) fn grow_map(&self, new_size: usize) -> heed::Result<()> {
        let page = 4096;
        let new_size = new_size.div_ceil(page) * page;
        // The one transaction other threads may run meanwhile waits (see `resize_guard`).
        let _exclusive = self.resize_guard.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: per this method's contract no transaction of the persist thread is open, and
        // the guard keeps out those of other threads.
        #[allow(unsafe_code)]
        unsafe {
            self.env.resize(new_size)
        }
    }

    /// Stamps an empty store with [`FORMAT_VERSION`]; refuses data of another version.
    fn check_format(&self) -> Result<()> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let stored = self.meta.get(&wtxn, FORMAT_KEY).map_err(|e| Error::storage(&self.path, e))?;
        let version = match stored {
            Some(b) if b.len() == 4 => Some(u32::from_be_bytes(b.try_into().expect("4 bytes"))),
            Some(_) => return Err(Error::storage(&self.path, "corrupt format record")),
            None => None,
        };
        if version == Some(FORMAT_VERSION) {
            return Ok(());
        }
        if version == Some(FORMAT_BARE_SNAPSHOTS) {
            // Every snapshot gets sequence 0 (there are no deltas in this format).
            let bare: Vec<(String, Vec<u8>)> = {
                let iter = self.data.iter(&wtxn).map_err(|e| Error::storage(&self.path, e))?;
                iter.map(|r| r.map(|(k, v)| (k.to_string(), encode_snapshot(0, v))))
                    .collect::<heed::Result<_>>()
                    .map_err(|e| Error::storage(&self.path, e))?
            };
            for (key, value) in &bare {
                self.data.put(&mut wtxn, key, value).map_err(|e| Error::storage(&self.path, e))?;
            }
            tracing::info!(path = %self.path.display(), keys = bare.len(), "durable store converted from format 2");
            self.meta
                .put(&mut wtxn, FORMAT_KEY, &FORMAT_VERSION.to_be_bytes())
                .map_err(|e| Error::storage(&self.path, e))?;
            return wtxn.commit().map_err(|e| Error::storage(&self.path, e));
        }
        let empty = self.data.is_empty(&wtxn).map_err(|e| Error::storage(&self.path, e))?;
        if !empty {
            let found = version.map_or_else(|| "1 (unmarked)".to_string(), |v| v.to_string());
            return Err(Error::storage(
                &self.path,
                format!(
                    "replicated data written in format {found}, this build reads format {FORMAT_VERSION}; \
                     remove it with `ddshard remove-internal-data --data-dir <node data dir> <entity types>` \
                     (the cluster's other replicas and the remembered entities' owners repopulate it) \
                     or start this node with an empty data dir"
                ),
            ));
        }
        self.meta
            .put(&mut wtxn, FORMAT_KEY, &FORMAT_VERSION.to_be_bytes())
            .map_err(|e| Error::storage(&self.path, e))?;
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))
    }

    /// Deletes every key starting with `prefix` (snapshot and deltas); returns how many keys
    /// were deleted.
    pub fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let mut keys: std::collections::BTreeSet<String> = {
            let iter = self.data.prefix_iter(&wtxn, prefix).map_err(|e| Error::storage(&self.path, e))?;
            iter.filter_map(|r| r.ok().map(|(k, _)| k.to_string())).collect()
        };
        let mut dead_deltas: Vec<[u8; 8]> = Vec::new();
        {
            let iter = self.deltas.iter(&wtxn).map_err(|e| Error::storage(&self.path, e))?;
            for item in iter {
                let (seq, raw) = item.map_err(|e| Error::storage(&self.path, e))?;
                if let (Ok(seq), Some((key, _))) = (<[u8; 8]>::try_from(seq), parse_delta_record(raw))
                    && key.starts_with(prefix)
                {
                    keys.insert(key.to_string());
                    dead_deltas.push(seq);
                }
            }
        }
        for k in &keys {
            self.data.delete(&mut wtxn, k).map_err(|e| Error::storage(&self.path, e))?;
        }
        for seq in &dead_deltas {
            self.deltas.delete(&mut wtxn, seq).map_err(|e| Error::storage(&self.path, e))?;
        }
        if !keys.is_empty() {
            // The store no longer knows everything its writer wrote in these keys (other
            // replicas may still hold them): the next process writes under a new identity.
            self.meta.delete(&mut wtxn, STORE_ID_KEY).map_err(|e| Error::storage(&self.path, e))?;
        }
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))?;
        Ok(keys.len())
    }

    /// Reserves `span` OR-set counters for this process, durably, before any is used: the
    /// floor is the ceiling stored by the previous process (0 for a new store), the new
    /// ceiling `floor + span`. Creates the store id on first use.
    ///
    /// `new_identity` gives the store a new writer id (and so its sets a new writer): the caller
    /// asks for it when the store lost data its writer wrote (a record that no longer decodes),
    /// since a writer claims the counters it skipped as dead and must know every dot it wrote in
    /// a set to do so (see `replicator::writer`).
    pub fn reserve_counters(&self, span: u64, new_identity: bool) -> Result<CounterReservation> {
        let corrupt = |what: &str| Error::storage(&self.path, format!("corrupt {what} record"));
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let read = |key: &str| -> Result<Option<u64>> {
            match self.meta.get(&wtxn, key).map_err(|e| Error::storage(&self.path, e))? {
                Some(b) => b.try_into().map(|b| Some(u64::from_be_bytes(b))).map_err(|_| corrupt(key)),
                None => Ok(None),
            }
        };
        let stored_id = read(STORE_ID_KEY)?;
        let floor = read(COUNTER_CEILING_KEY)?.unwrap_or(0);
        let Some(ceiling) = floor.checked_add(span).filter(|c| *c <= crate::ddata::orset::MAX_COUNTER) else {
            return Err(Error::storage(&self.path, "OR-set counters of this store are exhausted"));
        };
        let store_id = match stored_id {
            Some(id) if !new_identity => id,
            _ => {
                let id = rand::random::<u64>();
                self.meta.put(&mut wtxn, STORE_ID_KEY, &id.to_be_bytes()).map_err(|e| Error::storage(&self.path, e))?;
                id
            }
        };
        self.meta
            .put(&mut wtxn, COUNTER_CEILING_KEY, &ceiling.to_be_bytes())
            .map_err(|e| Error::storage(&self.path, e))?;
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))?;
        Ok(CounterReservation { store_id, floor, ceiling })
    }

    /// The last generation stored (0 for none).
    fn stored_generation(&self, txn: &heed::RoTxn) -> Result<u64> {
        match self.meta.get(txn, GENERATION_KEY).map_err(|e| Error::storage(&self.path, e))? {
            Some(b) if b.len() == 8 => Ok(u64::from_be_bytes(b.try_into().expect("8 bytes"))),
            Some(_) => Err(Error::storage(&self.path, "corrupt generation record")),
            None => Ok(0),
        }
    }

    /// Makes the next start's generation exceed `generation` (a predecessor's, seen in gossip
    /// while this start's own was below it); a lower one changes nothing.
    /// Safe beside the running persist thread (it never overlaps a map resize).
    pub fn raise_generation_floor(&self, generation: u64) -> Result<()> {
        let _shared = self.resize_guard.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let last = self.stored_generation(&wtxn)?;
        if generation > last {
            self.meta
                .put(&mut wtxn, GENERATION_KEY, &generation.to_be_bytes())
                .map_err(|e| Error::storage(&self.path, e))?;
        }
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))
    }

    /// Picks this start's generation: `max(now_ms, last + 1)`, stored before it is used, so a
    /// node never reuses a generation (and CRDT actor ids) even if its clock went backwards.
    pub fn next_generation(&self, now_ms: u64) -> Result<u64> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let last = self.stored_generation(&wtxn)?;
        let Some(next) = last.checked_add(1) else {
            return Err(Error::storage(&self.path, "generation record at its maximum"));
        };
        let generation = now_ms.max(next);
        self.meta
            .put(&mut wtxn, GENERATION_KEY, &generation.to_be_bytes())
            .map_err(|e| Error::storage(&self.path, e))?;
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))?;
        Ok(generation)
    }
}

/// Creates `dir` and its missing parents readable by this user only (0700 on Unix, whatever the
/// umask): a store holds every entity's state. Directories that exist keep their mode.
pub(crate) fn create_private_dir(dir: &Path) -> Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir).map_err(|e| Error::storage(dir, format!("cannot create directory: {e}")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_store_flushes_every_commit_to_disk_unless_opened_without_fsync() {
        let no_sync =
            |store: &super::DurableStore| store.env.get_flags().unwrap() & heed::EnvFlags::NO_SYNC.bits() != 0;
        let dir = tempfile::tempdir().unwrap();
        let store = super::DurableStore::open(&dir.path().join("a"), 1 << 20).unwrap();
        assert!(!no_sync(&store), "what production opens waits for the disk");
        let simulated = super::DurableStore::open_with(&dir.path().join("b"), 1 << 20, false).unwrap();
        assert!(no_sync(&simulated));
    }

    use super::*;
    use crate::ddata::crdt::{Crdt, GSet, OrSet, ReplicatedData, WriteCtx};

    fn snapshot(key: &str, seq: u64, value: &ReplicatedData) -> StoreOp {
        StoreOp::Snapshot { key: key.into(), seq, bytes: rmp_serde::to_vec(value).unwrap() }
    }

    fn delta(key: &str, seq: u64, d: &ReplicatedDelta) -> StoreOp {
        StoreOp::Delta { key: key.into(), seq, bytes: rmp_serde::to_vec(d).unwrap() }
    }

    fn set_with(ids: &[&str]) -> OrSet {
        let ctx = WriteCtx::new("n#1", 0);
        let mut s = OrSet::default();
        for id in ids {
            s.add(&ctx, *id);
        }
        s
    }

    #[test]
    fn every_open_reserves_counters_above_all_earlier_ones_and_an_extension_never_lowers_them() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 20).unwrap();
        let first = s.reserve_counters(100, false).unwrap();
        assert_eq!((first.floor, first.ceiling), (0, 100), "a new store starts at 0");
        s.apply(&[StoreOp::CounterCeiling { ceiling: 250 }]).unwrap();
        s.apply(&[StoreOp::CounterCeiling { ceiling: 120 }]).unwrap();
        s.apply(&[StoreOp::CounterCeiling { ceiling: 250 }]).unwrap();
        drop(s);
        let s = DurableStore::open(dir.path(), 1 << 20).unwrap();
        let second = s.reserve_counters(100, false).unwrap();
        assert_eq!((second.floor, second.ceiling), (250, 350), "the highest ceiling ever stored is the floor");
        assert_eq!(second.store_id, first.store_id, "the store keeps its writer id");
        let renewed = s.reserve_counters(100, true).unwrap();
        assert_ne!(renewed.store_id, first.store_id, "a store that lost data gets a new writer");
        assert_eq!(renewed.floor, 350, "its counters still continue");
        assert_eq!(s.reserve_counters(100, false).unwrap().store_id, renewed.store_id, "and keeps it");
        s.apply(&[StoreOp::Snapshot { key: "shard-t/1/0".into(), seq: 1, bytes: vec![0xc0] }]).unwrap();
        assert_eq!(s.delete_prefix("shard-t/").unwrap(), 1);
        assert_ne!(s.reserve_counters(100, false).unwrap().store_id, renewed.store_id, "deleted data: new writer");
        let other = DurableStore::open(tempfile::tempdir().unwrap().path(), 1 << 20).unwrap();
        assert_ne!(
            other.reserve_counters(100, false).unwrap().store_id,
            first.store_id,
            "another store, another writer"
        );
    }

    #[test]
    fn a_counter_reservation_past_the_largest_counter_or_a_corrupt_record_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 20).unwrap();
        s.apply(&[StoreOp::CounterCeiling { ceiling: crate::ddata::orset::MAX_COUNTER - 10 }]).unwrap();
        assert!(matches!(s.reserve_counters(10, false), Ok(r) if r.ceiling == crate::ddata::orset::MAX_COUNTER));
        assert!(matches!(s.reserve_counters(1, false), Err(Error::Storage { .. })), "exhausted");
        let mut w = s.env.write_txn().unwrap();
        s.meta.put(&mut w, COUNTER_CEILING_KEY, &[1, 2, 3]).unwrap();
        w.commit().unwrap();
        assert!(matches!(s.reserve_counters(1, false), Err(Error::Storage { .. })), "corrupt");
    }

    #[test]
    fn values_survive_reopen_and_generations_always_grow() {
        let dir = tempfile::tempdir().unwrap();
        let g1;
        {
            let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
            let mut set = GSet::default();
            set.insert("a");
            s.apply(&[snapshot("shard-x", 1, &ReplicatedData::GSet(set))]).unwrap();
            g1 = s.next_generation(1000).unwrap();
            assert_eq!(g1, 1000);
        }
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let all = s.load_all().unwrap().entries;
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].key, "shard-x");
        // Clock went backwards: still a larger generation.
        assert_eq!(s.next_generation(5).unwrap(), g1 + 1);
        assert_eq!(s.delete_prefix("shard-").unwrap(), 1);
        assert!(s.load_all().unwrap().entries.is_empty());
    }

    /// Review finding S18: a predecessor's generation recorded as the floor makes the next
    /// start's generation exceed it whatever the clock says; a lower floor changes nothing.
    #[test]
    fn a_raised_generation_floor_puts_the_next_generation_above_it_and_a_lower_one_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        assert_eq!(s.next_generation(1_000).unwrap(), 1_000);
        s.raise_generation_floor(9_000).unwrap();
        assert_eq!(s.next_generation(1_001).unwrap(), 9_001, "above the predecessor, not the clock");
        s.raise_generation_floor(5_000).unwrap();
        assert_eq!(s.next_generation(1_002).unwrap(), 9_002, "a lower floor is ignored");
        drop(s);
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        s.raise_generation_floor(20_000).unwrap();
        assert_eq!(s.next_generation(1_003).unwrap(), 20_001, "kept across a reopen");
    }

    #[test]
    fn a_generation_record_at_its_maximum_is_a_typed_error_not_an_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        assert_eq!(s.next_generation(u64::MAX).unwrap(), u64::MAX);
        let err = s.next_generation(5).unwrap_err();
        assert!(matches!(&err, Error::Storage { .. }) && err.to_string().contains("maximum"), "{err}");
    }

    #[test]
    fn a_record_sequence_beyond_any_real_store_costs_its_key_only_and_tickets_stay_low() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let mut set = GSet::default();
        set.insert("a");
        let value = ReplicatedData::GSet(set);
        s.apply(&[snapshot("shard-x", u64::MAX - 1, &value), snapshot("shard-y", 3, &value)]).unwrap();
        let loaded = s.load_all().unwrap();
        assert_eq!(loaded.corrupt.len(), 1, "{:?}", loaded.corrupt);
        assert!(loaded.corrupt[0].0 == "shard-x" && loaded.corrupt[0].1.contains("sequence"));
        assert_eq!(loaded.entries.len(), 1);
        assert_eq!(loaded.max_seq, 3, "tickets continue above the valid records only");
    }

    #[test]
    fn records_at_the_highest_valid_sequence_load_and_one_above_it_cost_their_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let mut set = GSet::default();
        set.insert("a");
        let value = ReplicatedData::GSet(set.clone());
        let d = ReplicatedDelta::GSet(set);
        s.apply(&[
            snapshot("snap-at-max", MAX_SEQUENCE, &value),
            snapshot("snap-over", MAX_SEQUENCE + 1, &value),
            delta("delta-at-max", MAX_SEQUENCE, &d),
            delta("delta-over", MAX_SEQUENCE + 1, &d),
        ])
        .unwrap();
        let loaded = s.load_all().unwrap();
        let ok: Vec<&str> = loaded.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(ok, ["delta-at-max", "snap-at-max"]);
        let bad: Vec<&str> = loaded.corrupt.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(bad, ["delta-over", "snap-over"], "{:?}", loaded.corrupt);
        assert_eq!(loaded.max_seq, MAX_SEQUENCE);
    }

    #[test]
    fn a_format_record_of_the_wrong_size_is_a_typed_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        {
            let mut w = s.env.write_txn().unwrap();
            s.meta.put(&mut w, FORMAT_KEY, &[0, 0, 3]).unwrap();
            w.commit().unwrap();
        }
        let err = s.load_all().unwrap_err();
        assert!(matches!(&err, Error::Storage { .. }) && err.to_string().contains("corrupt format record"), "{err}");
    }

    #[test]
    fn a_generation_record_of_the_wrong_size_is_a_typed_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        {
            let mut w = s.env.write_txn().unwrap();
            s.meta.put(&mut w, GENERATION_KEY, &[1, 2, 3]).unwrap();
            w.commit().unwrap();
        }
        let err = s.next_generation(1_000).unwrap_err();
        assert!(matches!(&err, Error::Storage { .. }) && err.to_string().contains("corrupt generation"), "{err}");
    }

    #[test]
    fn a_malformed_delta_record_is_skipped_and_reported_not_a_failed_load() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let value = ReplicatedData::OrSet(set_with(&["a"]));
        s.apply(&[snapshot("shard-ok", 1, &value)]).unwrap();
        {
            let mut w = s.env.write_txn().unwrap();
            // A key length past the record, and a sequence key of the wrong size.
            s.deltas.put(&mut w, &2u64.to_be_bytes(), &[0xff, 0xff, b'k']).unwrap();
            s.deltas.put(&mut w, &[1, 2, 3], &[0, 1, b'k']).unwrap();
            w.commit().unwrap();
        }
        let loaded = s.load_all().expect("one bad record does not fail the whole store");
        assert_eq!(loaded.corrupt.len(), 2, "{:?}", loaded.corrupt);
        assert!(loaded.corrupt.iter().all(|(_, why)| why.contains("malformed")));
        assert_eq!(loaded.entries.len(), 1);
        assert_eq!(loaded.entries[0].key, "shard-ok");
    }

    #[test]
    fn a_snapshot_joined_with_its_live_deltas_loads_as_the_value_that_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let ctx = WriteCtx::new("n#1", 0);
        let mut value = set_with(&["a", "b"]);
        let early = ReplicatedDelta::OrSet(value.take_delta().unwrap());
        // Delta 3 is below the snapshot of sequence 5: dead, covered by it.
        let snap = snapshot("k", 5, &value.clone().into_data());
        let StoreOp::Snapshot { bytes: ref snap_bytes, .. } = snap else { unreachable!() };
        let snap_len = snap_bytes.len();
        s.apply(&[delta("k", 3, &early), snap]).unwrap();
        let mut ops = Vec::new();
        for (seq, id) in [(7, "c"), (8, "d")] {
            value.add(&ctx, id);
            ops.push(delta("k", seq, &ReplicatedDelta::OrSet(value.take_delta().unwrap())));
        }
        value.remove("a");
        ops.push(delta("k", 9, &ReplicatedDelta::OrSet(value.take_delta().unwrap())));
        s.apply(&ops).unwrap();
        // A key that only ever got deltas starts from the empty value of their type.
        let only = set_with(&["x"]).take_delta().unwrap();
        s.apply(&[delta("only-deltas", 10, &ReplicatedDelta::OrSet(only))]).unwrap();

        let loaded = s.load_all().unwrap();
        assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
        assert_eq!((loaded.dead_deltas, loaded.max_seq), (1, 10));
        let k = loaded.entries.iter().find(|e| e.key == "k").unwrap();
        assert_eq!(k.value.digest(), value.clone().into_data().digest());
        assert_eq!((k.snapshot_seq, k.log_records, k.first_log_seq, k.last_log_seq), (5, 3, 7, 9));
        // A delta record is `u16 key length ‖ key ‖ delta` under an 8-byte sequence.
        let live_log: usize = ops
            .iter()
            .map(|o| match o {
                StoreOp::Delta { key, bytes, .. } => 2 + key.len() + bytes.len() + 8,
                _ => 0,
            })
            .sum();
        assert_eq!((k.snapshot_bytes, k.log_bytes), (snap_len, live_log));
        let o = loaded.entries.iter().find(|e| e.key == "only-deltas").unwrap();
        assert_eq!(o.snapshot_bytes, 0);
        assert!(matches!(&o.value, ReplicatedData::OrSet(s) if s.contains("x")));

        // A newer snapshot covers the key's deltas; a trim deletes what no key needs.
        s.apply(&[snapshot("k", 11, &value.clone().into_data()), StoreOp::TrimLog { below: 10 }]).unwrap();
        let loaded = s.load_all().unwrap();
        let k = loaded.entries.iter().find(|e| e.key == "k").unwrap();
        assert_eq!((k.log_records, k.snapshot_seq), (0, 11));
        assert_eq!(k.value.digest(), value.into_data().digest());
        assert_eq!(loaded.dead_deltas, 0, "trimmed");
        assert_eq!(loaded.entries.iter().find(|e| e.key == "only-deltas").unwrap().log_records, 1, "kept");
    }

    #[test]
    fn every_commit_appends_its_deltas_at_the_end_of_one_log_whatever_keys_it_touches() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let d = ReplicatedDelta::OrSet(set_with(&["x"]).take_delta().unwrap());
        s.apply(&[delta("zebra", 1, &d), delta("apple", 2, &d), delta("mango", 3, &d)]).unwrap();
        let r = s.env.read_txn().unwrap();
        let seqs: Vec<u64> = s.deltas.iter(&r).unwrap().map(|x| parse_seq(x.unwrap().0).unwrap()).collect();
        assert_eq!(seqs, vec![1, 2, 3], "ordered by sequence, not by key");
    }

    #[test]
    fn deleting_a_prefix_removes_snapshots_and_deltas_of_those_keys_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let d = ReplicatedDelta::OrSet(set_with(&["x"]).take_delta().unwrap());
        s.apply(&[delta("a/1", 1, &d), delta("ab", 2, &d), delta("b/1", 3, &d)]).unwrap();
        s.apply(&[snapshot("a/2", 4, &set_with(&["y"]).into_data())]).unwrap();
        assert_eq!(s.delete_prefix("a").unwrap(), 3, "snapshots and delta-only keys alike");
        let keys: Vec<String> = s.load_all().unwrap().entries.into_iter().map(|e| e.key).collect();
        assert_eq!(keys, vec!["b/1".to_string()]);
    }

    #[test]
    fn a_corrupt_delta_costs_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let d = ReplicatedDelta::OrSet(set_with(&["x"]).take_delta().unwrap());
        let g = ReplicatedDelta::GSet(GSet::default());
        s.apply(&[
            snapshot("good", 0, &set_with(&["a"]).into_data()),
            delta("good", 1, &d),
            snapshot("bad-bytes", 0, &set_with(&["a"]).into_data()),
            StoreOp::Delta { key: "bad-bytes".into(), seq: 2, bytes: vec![0xc1] },
            snapshot("bad-type", 0, &set_with(&["a"]).into_data()),
            delta("bad-type", 3, &g),
            StoreOp::Snapshot { key: "bad-snapshot".into(), seq: 0, bytes: vec![0xc1] },
        ])
        .unwrap();
        let loaded = s.load_all().unwrap();
        let good: Vec<&str> = loaded.entries.iter().map(|e| e.key.as_str()).collect();
        let bad: Vec<&str> = loaded.corrupt.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(good, vec!["good"]);
        assert_eq!(bad, vec!["bad-bytes", "bad-snapshot", "bad-type"]);
    }

    #[test]
    fn a_store_of_the_previous_layout_is_converted_and_loads_every_value() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        // Format 2: bare encoded values.
        let value = set_with(&["a"]).into_data();
        let mut w = s.env.write_txn().unwrap();
        s.data.put(&mut w, "shard-kv/1/0", &rmp_serde::to_vec(&value).unwrap()).unwrap();
        s.meta.put(&mut w, FORMAT_KEY, &2u32.to_be_bytes()).unwrap();
        w.commit().unwrap();
        let loaded = s.load_all().unwrap();
        assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
        assert_eq!(loaded.entries[0].value.digest(), value.digest());
        assert_eq!(s.load_all().unwrap().entries.len(), 1, "and again after the conversion");
        let r = s.env.read_txn().unwrap();
        assert_eq!(s.meta.get(&r, FORMAT_KEY).unwrap(), Some(&FORMAT_VERSION.to_be_bytes()[..]));
    }

    #[test]
    fn a_store_of_the_first_format_is_refused_with_the_removal_command_named() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        // Written by round 1: values but no format record.
        s.apply(&[StoreOp::Snapshot { key: "shard-kv/1/0".into(), seq: 0, bytes: vec![0x91, 0x80] }]).unwrap();
        let mut w = s.env.write_txn().unwrap();
        s.meta.delete(&mut w, FORMAT_KEY).unwrap();
        w.commit().unwrap();
        drop(s);
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let err = s.load_all().unwrap_err().to_string();
        assert!(err.contains("remove-internal-data") && err.contains("format 1"), "{err}");
        // After the removal the store is stamped and loads.
        assert_eq!(s.delete_prefix("shard-").unwrap(), 1);
        assert!(s.load_all().unwrap().entries.is_empty());
        s.apply(&[StoreOp::Snapshot { key: "shard-kv/1/0".into(), seq: 0, bytes: vec![0xc1] }]).unwrap();
        let loaded = s.load_all().unwrap();
        assert_eq!(loaded.corrupt.len(), 1, "a bad record is skipped and reported, not fatal");
        assert!(loaded.entries.is_empty());
    }

    #[test]
    fn corrupt_environment_file_is_a_typed_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("data.mdb"), vec![0xAB; 64 * 1024]).unwrap();
        let err = DurableStore::open(dir.path(), 1 << 24).unwrap_err();
        assert!(matches!(err, Error::Storage { .. }), "{err}");
    }

    #[test]
    fn fuzz_durable_records() {
        let value = ReplicatedData::OrSet(set_with(&["a", "b", "c"]));
        let mut with_delta = ReplicatedData::OrSet(set_with(&["a"]));
        let delta = with_delta.take_delta().unwrap();
        let seeds = vec![
            encode_snapshot(42, &rmp_serde::to_vec(&value).unwrap()),
            encode_delta_record("shard-kv-1-0", &rmp_serde::to_vec(&delta).unwrap()).unwrap(),
            encode_snapshot(MAX_SEQUENCE, &rmp_serde::to_vec(&ReplicatedData::GSet(GSet::default())).unwrap()),
        ];
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            let _ = parse_seq(&bytes);
            if let Some((_, body)) = parse_snapshot(&bytes) {
                let _ = rmp_serde::from_slice::<ReplicatedData>(body);
            }
            if let Some((_, body)) = parse_delta_record(&bytes)
                && let Ok(delta) = rmp_serde::from_slice::<ReplicatedDelta>(body)
            {
                let mut v = delta.empty_value();
                let _ = v.merge_delta(&delta);
                let mut v = value.clone();
                let _ = v.merge_delta(&delta);
            }
        });
    }
}
