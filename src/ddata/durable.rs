//! LMDB (heed) storage for durable replicator keys and node metadata, under `data_dir`.
//!
//! Every method is blocking and runs a whole transaction; callers on the runtime wrap the call
//! in `spawn_blocking` (a heed write transaction must be created and committed on one thread).

use std::path::{Path, PathBuf};

use heed::types::{Bytes, Str};
use heed::{CommitOrAbort, Database, Env, EnvOpenOptions, WithoutTls};

use super::crdt::ReplicatedData;
use crate::error::{Error, Result};

/// The durable store of one node. Cloning shares the environment.
#[derive(Clone)]
pub struct DurableStore {
    env: Env<WithoutTls>,
    data: Database<'static, Str, Bytes>,
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

/// Version of the value encoding in the `ddata` database. 2: the compact δ-OR-set and the
/// digest-carrying map and G-set of round 2 (1, unmarked, was `crdts::Orswot` and `crdts::GSet`).
pub const FORMAT_VERSION: u32 = 2;

/// What [`DurableStore::load_all`] read.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Every key whose value decoded.
    pub entries: Vec<(String, ReplicatedData)>,
    /// Keys whose stored bytes do not decode (left in place, skipped; other replicas repair).
    pub corrupt: Vec<(String, String)>,
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
        let (data, meta) = env
            .create_databases_and_commit(wtxn, |dbo, w| -> heed::Result<_> {
                let data = dbo.create_database::<Str, Bytes>(w, Some("ddata"))?;
                let meta = dbo.create_database::<Str, Bytes>(w, Some("meta"))?;
                Ok(CommitOrAbort::<_, ()>::Commit((data, meta)))
            })
            .map_err(|e| Error::storage(dir, format!("cannot open databases: {e}")))?
            .unwrap_commit();
        let store = DurableStore { env, data, meta, path: dir.to_path_buf() };
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

    /// Every stored key with its value. Refuses a store written in another format (with an error
    /// that names `ddshard remove-internal-data`); a single value that does not decode is
    /// reported in [`Loaded::corrupt`] and skipped, so one bad record costs that key only.
    pub fn load_all(&self) -> Result<Loaded> {
        self.check_format()?;
        let rtxn = self.env.read_txn().map_err(|e| Error::storage(&self.path, e))?;
        let mut out = Loaded::default();
        for item in self.data.iter(&rtxn).map_err(|e| Error::storage(&self.path, e))? {
            let (key, bytes) = item.map_err(|e| Error::storage(&self.path, e))?;
            match rmp_serde::from_slice::<ReplicatedData>(bytes) {
                Ok(value) => out.entries.push((key.to_string(), value)),
                Err(e) => out.corrupt.push((key.to_string(), e.to_string())),
            }
        }
        Ok(out)
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

    /// Writes (or, with `None`, deletes) several keys in one transaction, durably: the commit
    /// returns after LMDB's fsync.
    pub fn write_batch(&self, batch: &[(String, Option<Vec<u8>>)]) -> Result<()> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        for (key, value) in batch {
            let r = match value {
                Some(v) => self.data.put(&mut wtxn, key, v),
                None => self.data.delete(&mut wtxn, key).map(|_| ()),
            };
            r.map_err(|e| Error::storage(&self.path, format!("writing {key:?}: {e}")))?;
        }
        wtxn.commit().map_err(|e| Error::storage(&self.path, format!("commit: {e}")))
    }

    /// Deletes every key starting with `prefix`; returns how many were deleted.
    pub fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        let mut wtxn = self.env.write_txn().map_err(|e| Error::storage(&self.path, e))?;
        let keys: Vec<String> = {
            let iter = self.data.prefix_iter(&wtxn, prefix).map_err(|e| Error::storage(&self.path, e))?;
            iter.filter_map(|r| r.ok().map(|(k, _)| k.to_string())).collect()
        };
        for k in &keys {
            self.data.delete(&mut wtxn, k).map_err(|e| Error::storage(&self.path, e))?;
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
    use crate::ddata::crdt::{GSet, ReplicatedData};

    #[test]
    fn values_survive_reopen_and_generations_always_grow() {
        let dir = tempfile::tempdir().unwrap();
        let g1;
        {
            let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
            let mut set = GSet::default();
            set.insert("a");
            let bytes = rmp_serde::to_vec(&ReplicatedData::GSet(set.clone())).unwrap();
            s.write_batch(&[("shard-x".into(), Some(bytes))]).unwrap();
            g1 = s.next_generation(1000).unwrap();
            assert_eq!(g1, 1000);
        }
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        let all = s.load_all().unwrap().entries;
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].0, "shard-x");
        // Clock went backwards: still a larger generation.
        assert_eq!(s.next_generation(5).unwrap(), g1 + 1);
        assert_eq!(s.delete_prefix("shard-").unwrap(), 1);
        assert!(s.load_all().unwrap().entries.is_empty());
    }

    #[test]
    fn a_store_of_the_previous_format_is_refused_with_the_removal_command_named() {
        let dir = tempfile::tempdir().unwrap();
        let s = DurableStore::open(dir.path(), 1 << 24).unwrap();
        // Written by round 1: values but no format record.
        s.write_batch(&[("shard-kv/1/0".into(), Some(vec![0x91, 0x80]))]).unwrap();
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
        s.write_batch(&[("shard-kv/1/0".into(), Some(vec![0xc1]))]).unwrap();
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
