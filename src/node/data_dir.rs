//! The exclusive lock on a data dir: one running node (or tool) per store.

use crate::error::{Error, Result};

/// Name of the lock file in a data dir.
pub(crate) const LOCK_FILE: &str = "ddshard.lock";

/// Takes the exclusive lock of a data dir: one running node (or tool) per store.
pub(crate) fn lock_data_dir(data_dir: &std::path::Path) -> Result<std::fs::File> {
    crate::ddata::durable::create_private_dir(data_dir)?;
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

#[cfg(test)]
mod tests {
    #[cfg(unix)]
    #[test]
    fn a_new_data_dir_and_its_new_parents_are_private_to_the_user_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a").join("node-1");
        let _lock = super::lock_data_dir(&dir).unwrap();
        for d in [tmp.path().join("a"), dir.clone()] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        assert!(super::lock_data_dir(&dir).is_err(), "locked once");
    }
}
