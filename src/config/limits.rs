//! Bounds every setting shares. A leaf: the settings of each layer (membership, sharding,
//! discovery) check themselves against it without importing the node's configuration.

use std::time::Duration;

use crate::error::{Error, Result};

/// Longest duration any setting may have: beyond it a setting is a typo (and adding it to a
/// clock reading could overflow).
pub const MAX_SETTING_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// A config error naming the first of `durations` longer than [`MAX_SETTING_DURATION`].
pub(crate) fn check_durations(durations: &[(&str, Duration)]) -> Result<()> {
    match durations.iter().find(|(_, d)| *d > MAX_SETTING_DURATION) {
        Some((name, d)) => Err(Error::Config(format!("{name} = {d:?} is longer than the 30 days any duration may be"))),
        None => Ok(()),
    }
}
