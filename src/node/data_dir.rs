//! The exclusive lock on a data dir: one running node (or tool) per store.

use crate::error::{Error, Result};

/// Name of the lock file in a data dir.
pub(crate) const LOCK_FILE: &str = "ddshard.lock";

/// Takes the exclusive lock of a data dir: one running node (or tool) per store.
pub(crate) fn lock_data_dir(data_dir: &std::path::Path) -> Result<std::fs::File> {
    std::fs::create_dir_all(data_dir).map_err(|e| Error::storage(data_dir, format!("cannot create directory: {e}")))?;
    let path = data_dir.join(LOCK_FILE);
    let file = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::storage(data_dir, format!("cannot open {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(Error::storage(data_dir, "the data dir is in use by a running node (lock held)"))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(Error::storage(data_dir, format!("cannot lock: {e}"))),
    }
}
