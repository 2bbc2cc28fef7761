//! LMDB (heed) storage for durable replicator keys and node metadata, under `data_dir`.
//!
//! Every method is blocking and runs a whole transaction; callers on the runtime wrap the call
//! in `spawn_blocking` (a heed write transaction must be created and committed on one thread).
//! Once the replicator has loaded, its persist thread is the only user of the environment.
//!
//! **Layout.** A key is stored as a snapshot (database `ddata`, key → encoded value) and a
//! delta log (database `deltas`, `u16 key length ‖ key ‖ u64 sequence` → encoded delta, both
//! big-endian so a key's records sort together in sequence order). Loading joins each key's
//! deltas into its snapshot (or, for a key without one, into the empty value of the delta's
//! type); writing a snapshot drops the key's log.

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
}

impl std::fmt::Debug for DurableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableStore").field("path", &self.path).finish()
    }
}

const GENERATION_KEY: &str = "generation";
const FORMAT_KEY: &str = "format";

/// Version of the store's layout and value encoding. 3: snapshots plus per-key delta logs.
/// 2 (snapshots only, same value encoding) is read as is and restamped. 1 (unmarked) was
/// `crdts::Orswot` and `crdts::GSet`, and is refused.
pub const FORMAT_VERSION: u32 = 3;

/// Formats this build reads without conversion.
const READABLE_FORMATS: [u32; 2] = [2, 3];

/// One key as [`DurableStore::load_all`] read it.
#[derive(Debug)]
pub struct StoredKey {
    /// The key.
    pub key: String,
    /// Its snapshot joined with its delta log.
    pub value: ReplicatedData,
    /// Encoded size of the snapshot (0 if the key has only deltas).
    pub snapshot_bytes: usize,
    /// Encoded size and number of the delta records.
    pub log_bytes: usize,
    /// Number of delta records.
    pub log_records: u32,
    /// Highest sequence number of the key's delta records (0 if none).
    pub last_seq: u64,
}

impl StoredKey {
    fn new(key: &str, value: ReplicatedData, snapshot_bytes: usize) -> StoredKey {
        StoredKey { key: key.to_string(), value, snapshot_bytes, log_bytes: 0, log_records: 0, last_seq: 0 }
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
}

/// One write of a [`DurableStore::apply`] transaction.
#[derive(Debug, Clone)]
pub enum StoreOp {
    /// Replaces the key's snapshot and drops its delta log.
    Snapshot {
        /// The key.
        key: String,
        /// The encoded value.
        bytes: Vec<u8>,
    },
    /// Appends to the key's delta log.
    Delta {
        /// The key.
        key: String,
        /// Sequence number (grows per store).
        seq: u64,
        /// The encoded delta.
        bytes: Vec<u8>,
    },
}

impl StoreOp {
    /// Bytes this op writes.
    pub fn len(&self) -> usize {
        match self {
            StoreOp::Snapshot { key, bytes } | StoreOp::Delta { key, bytes, .. } => key.len() + bytes.len(),
        }
    }

    /// Whether the op writes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The delta-log key of `key`'s record `seq`; `None` for a key too long to store.
fn delta_record_key(key: &str, seq: u64) -> Option<Vec<u8>> {
    let mut k = delta_log_prefix(key)?;
    k.extend_from_slice(&seq.to_be_bytes());
    Some(k)
}

fn delta_log_prefix(key: &str) -> Option<Vec<u8>> {
    let len = u16::try_from(key.len()).ok()?;
    let mut k = Vec::with_capacity(2 + key.len() + 8);
    k.extend_from_slice(&len.to_be_bytes());
    k.extend_from_slice(key.as_bytes());
    Some(k)
}

/// Splits a delta-log key into key and sequence; `None` if malformed.
fn parse_delta_record_key(raw: &[u8]) -> Option<(&str, u64)> {
    let len = usize::from(u16::from_be_bytes(raw.get(..2)?.try_into().ok()?));
    let key = std::str::from_utf8(raw.get(2..2 + len)?).ok()?;
    let seq = u64::from_be_bytes(raw.get(2 + len..)?.try_into().ok()?);
    Some((key, seq))
}

impl DurableStore {
    /// Opens (creating if needed) the store in `dir`. A corrupt or foreign file is a typed
    /// [`Error::Storage`].
    pub fn open(dir: &Path, map_size: usize) -> Result<DurableStore> {
        std::fs::create_dir_all(dir).map_err(|e| Error::storage(dir, format!("cannot create directory: {e}")))?;
        let page = 4096;
        let map_size = map_size.div_ceil(page) * page;
        // SAFETY: heed requires that the same file is not opened twice in one process in a way
        // that breaks LMDB's locking; heed itself refuses a second open of the same path, and
        // ddshard opens each data dir once per node.
        let env = unsafe { EnvOpenOptions::new().read_txn_without_tls().map_size(map_size).max_dbs(4).open(dir) }
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
        let store = DurableStore { env, data, deltas, meta, path: dir.to_path_buf() };
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
        for item in self.data.iter(&rtxn).map_err(|e| Error::storage(&self.path, e))? {
            let (key, bytes) = item.map_err(|e| Error::storage(&self.path, e))?;
            let loaded = rmp_serde::from_slice::<ReplicatedData>(bytes)
                .map(|value| StoredKey::new(key, value, bytes.len()))
                .map_err(|e| format!("snapshot: {e}"));
            keys.insert(key.to_string(), loaded);
        }
        for item in self.deltas.iter(&rtxn).map_err(|e| Error::storage(&self.path, e))? {
            let (raw, bytes) = item.map_err(|e| Error::storage(&self.path, e))?;
            let Some((key, seq)) = parse_delta_record_key(raw) else {
                return Err(Error::storage(&self.path, "malformed delta-log key"));
            };
            let joined = match rmp_serde::from_slice::<ReplicatedDelta>(bytes) {
                Err(e) => Err(format!("delta {seq}: {e}")),
                Ok(delta) => {
                    // Deltas without a snapshot start from the empty value of their type.
                    let slot =
                        keys.entry(key.to_string()).or_insert_with(|| Ok(StoredKey::new(key, delta.empty_value(), 0)));
                    let Ok(stored) = slot else { continue };
                    stored.value.merge_delta(&delta).map_err(|e| format!("delta {seq}: {e:?}")).map(|()| {
                        stored.log_bytes = stored.log_bytes.saturating_add(raw.len() + bytes.len());
                        stored.log_records = stored.log_records.saturating_add(1);
                        stored.last_seq = stored.last_seq.max(seq);
                    })
                }
            };
            if let Err(reason) = joined {
                keys.insert(key.to_string(), Err(reason));
            }
        }
        let mut out = Loaded::default();
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
                StoreOp::Snapshot { key, bytes } => {
                    self.data.put(&mut wtxn, key, bytes)?;
                    self.drop_delta_log(&mut wtxn, key)?;
                }
                StoreOp::Delta { key, seq, bytes } => {
                    let Some(record) = delta_record_key(key, *seq) else {
                        return Err(heed::Error::Encoding(format!("key of {} bytes is too long", key.len()).into()));
                    };
                    self.deltas.put(&mut wtxn, &record, bytes)?;
                }
            }
        }
        wtxn.commit()
    }

    fn drop_delta_log(&self, wtxn: &mut heed::RwTxn, key: &str) -> heed::Result<()> {
        let Some(prefix) = delta_log_prefix(key) else { return Ok(()) };
        let mut end = prefix.clone();
        end.extend_from_slice(&[0xff; 8]);
        let range = (std::ops::Bound::Included(prefix.as_slice()), std::ops::Bound::Included(end.as_slice()));
        self.deltas.delete_range(wtxn, &range).map(|_| ())
    }

    /// The current size of the memory map.
    pub fn map_size(&self) -> usize {
        self.env.info().map_size
    }

    /// Grows the memory map to `new_size` (rounded up to whole pages).
    ///
    /// LMDB allows this only while no transaction of this process is open on the environment:
    /// call it only from the thread that is the store's sole user (the persist thread, after
    /// the load).
    pub(crate) fn grow_map(&self, new_size: usize) -> heed::Result<()> {
        let page = 4096;
        let new_size = new_size.div_ceil(page) * page;
        // SAFETY: per this method's contract, no transaction is open on the environment.
        unsafe { self.env.resize(new_size) }
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
        if let Some(v) = version.filter(|v| READABLE_FORMATS.contains(v)) {
            tracing::info!(path = %self.path.display(), from = v, to = FORMAT_VERSION, "durable store restamped");
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

    /// Deletes every key starting with `prefix` (snapshot and delta log); returns how many keys
    /// were deleted.
    pub fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let mut keys: std::collections::BTreeSet<String> = {
            let iter = self.data.prefix_iter(&wtxn, prefix).map_err(|e| Error::storage(&self.path, e))?;
            iter.filter_map(|r| r.ok().map(|(k, _)| k.to_string())).collect()
        };
        {
            let iter = self.deltas.iter(&wtxn).map_err(|e| Error::storage(&self.path, e))?;
            for item in iter {
                let (raw, _) = item.map_err(|e| Error::storage(&self.path, e))?;
                if let Some((key, _)) = parse_delta_record_key(raw).filter(|(k, _)| k.starts_with(prefix)) {
                    keys.insert(key.to_string());
                }
            }
        }
        for k in &keys {
            self.data.delete(&mut wtxn, k).map_err(|e| Error::storage(&self.path, e))?;
            self.drop_delta_log(&mut wtxn, k).map_err(|e| Error::storage(&self.path, e))?;
        }
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))?;
        Ok(keys.len())
    }

    /// Picks this start's generation: `max(now_ms, last + 1)`, stored before it is used, so a
    /// node never reuses a generation (and CRDT actor ids) even if its clock went backwards.
    pub fn next_generation(&self, now_ms: u64) -> Result<u64> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let last = match self.meta.get(&wtxn, GENERATION_KEY).map_err(|e| Error::storage(&self.path, e))? {
            Some(b) if b.len() == 8 => u64::from_be_bytes(b.try_into().expect("8 bytes")),
            Some(_) => return Err(Error::storage(&self.path, "corrupt generation record")),
            None => 0,
        };
        let generation = now_ms.max(last + 1);
        self.meta
            .put(&mut wtxn, GENERATION_KEY, &generation.to_be_bytes())
            .map_err(|e| Error::storage(&self.path, e))?;
        wtxn.commit().map_err(|e| Error::storage(&self.path, e))?;
        Ok(generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddata::crdt::{Crdt, GSet, OrSet, ReplicatedData, WriteCtx};

    fn snapshot(key: &str, value: &ReplicatedData) -> StoreOp {
        StoreOp::Snapshot { key: key.into(), bytes: rmp_serde::to_vec(value).unwrap() }
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
    fn values_survive_reopen_and_generations_always_grow() {
        let dir = tempfile::tempdir().unwrap();
        let g1;
        {
            let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
            let mut set = GSet::default();
            set.insert("a");
            s.apply(&[snapshot("shard-x", &ReplicatedData::GSet(set))]).unwrap();
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

    #[test]
    fn a_snapshot_joined_with_its_delta_log_loads_as_the_value_that_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let ctx = WriteCtx::new("n#1", 0);
        let mut value = set_with(&["a", "b"]);
        value.take_delta();
        s.apply(&[snapshot("k", &value.clone().into_data())]).unwrap();
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
        let k = loaded.entries.iter().find(|e| e.key == "k").unwrap();
        assert_eq!(k.value.digest(), value.clone().into_data().digest());
        assert_eq!((k.log_records, k.last_seq), (3, 9));
        assert!(k.snapshot_bytes > 0 && k.log_bytes > 0);
        let o = loaded.entries.iter().find(|e| e.key == "only-deltas").unwrap();
        assert_eq!(o.snapshot_bytes, 0);
        assert!(matches!(&o.value, ReplicatedData::OrSet(s) if s.contains("x")));

        // A snapshot drops the log, and only that key's log.
        s.apply(&[snapshot("k", &value.clone().into_data())]).unwrap();
        let loaded = s.load_all().unwrap();
        let k = loaded.entries.iter().find(|e| e.key == "k").unwrap();
        assert_eq!((k.log_records, k.last_seq), (0, 0));
        assert_eq!(k.value.digest(), value.into_data().digest());
        assert_eq!(loaded.entries.iter().find(|e| e.key == "only-deltas").unwrap().log_records, 1);
    }

    #[test]
    fn a_key_that_is_a_prefix_of_another_keeps_its_own_delta_log() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let d = ReplicatedDelta::OrSet(set_with(&["x"]).take_delta().unwrap());
        s.apply(&[delta("a", 1, &d), delta("ab", 2, &d), delta("a\u{0}", 3, &d)]).unwrap();
        s.apply(&[snapshot("a", &set_with(&["y"]).into_data())]).unwrap();
        let loaded = s.load_all().unwrap();
        let records: Vec<(&str, u32)> = loaded.entries.iter().map(|e| (e.key.as_str(), e.log_records)).collect();
        assert_eq!(records, vec![("a", 0), ("a\u{0}", 1), ("ab", 1)]);
        assert_eq!(s.delete_prefix("a").unwrap(), 3, "snapshots and delta-only keys alike");
        assert!(s.load_all().unwrap().entries.is_empty());
    }

    #[test]
    fn a_corrupt_delta_costs_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let d = ReplicatedDelta::OrSet(set_with(&["x"]).take_delta().unwrap());
        let g = ReplicatedDelta::GSet(GSet::default());
        s.apply(&[
            snapshot("good", &set_with(&["a"]).into_data()),
            delta("good", 1, &d),
            snapshot("bad-bytes", &set_with(&["a"]).into_data()),
            StoreOp::Delta { key: "bad-bytes".into(), seq: 2, bytes: vec![0xc1] },
            snapshot("bad-type", &set_with(&["a"]).into_data()),
            delta("bad-type", 3, &g),
        ])
        .unwrap();
        let loaded = s.load_all().unwrap();
        let good: Vec<&str> = loaded.entries.iter().map(|e| e.key.as_str()).collect();
        let bad: Vec<&str> = loaded.corrupt.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(good, vec!["good"]);
        assert_eq!(bad, vec!["bad-bytes", "bad-type"]);
    }

    #[test]
    fn a_store_of_the_previous_layout_is_read_and_restamped() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        s.apply(&[snapshot("shard-kv/1/0", &set_with(&["a"]).into_data())]).unwrap();
        let mut w = s.env.write_txn().unwrap();
        s.meta.put(&mut w, FORMAT_KEY, &2u32.to_be_bytes()).unwrap();
        w.commit().unwrap();
        assert_eq!(s.load_all().unwrap().entries.len(), 1);
        let r = s.env.read_txn().unwrap();
        assert_eq!(s.meta.get(&r, FORMAT_KEY).unwrap(), Some(&FORMAT_VERSION.to_be_bytes()[..]));
    }

    #[test]
    fn a_store_of_the_first_format_is_refused_with_the_removal_command_named() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        // Written by round 1: values but no format record.
        s.apply(&[StoreOp::Snapshot { key: "shard-kv/1/0".into(), bytes: vec![0x91, 0x80] }]).unwrap();
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
        s.apply(&[StoreOp::Snapshot { key: "shard-kv/1/0".into(), bytes: vec![0xc1] }]).unwrap();
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
}
