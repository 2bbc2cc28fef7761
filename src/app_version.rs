//! The version of the application a node runs, for rolling updates.
//!
//! Every node gossips its [`AppVersion`] (`app_version` in its configuration). While the
//! regions of a sharded type run different versions — a rolling update is under way — the
//! coordinator gives new and moved shards only to the regions of the newest version and runs no
//! rebalance, so a shard that moved onto an updated node stays there and no shard moves toward
//! a node about to be replaced.
//!
//! Roll back by rolling *forward* to a higher version with the old code: a lower version never
//! attracts shards. Finish every update: while two versions run, nothing is rebalanced (the
//! allocation table says so), and a node of the newest version that is Up takes every new
//! shard even while it is unreachable, until it is downed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Longest accepted version text (it is gossiped by every node).
const MAX_LEN: usize = 64;

/// A semantic version, compared by semver precedence (`1.10.0` > `1.9.0` > `1.9.0-rc.1`).
///
/// Parsed leniently from what deploy pipelines put in image tags: a leading `v` is dropped,
/// missing minor and patch numbers are zero (`"2"` is `2.0.0`, `"v1.4"` is `1.4.0`) and
/// leading zeros are ignored (`"2024.01.15"` is `2024.1.15`). A git hash is no version. Build
/// metadata (`+…`) is dropped, since precedence ignores it. The default is `0.0.0`, which every
/// node has until its operator sets one; a peer that gossips none (an older release) counts as
/// `0.0.0`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AppVersion(semver::Version);

impl AppVersion {
    /// `0.0.0`: a node whose operator set no version.
    pub const ZERO: AppVersion = AppVersion(semver::Version::new(0, 0, 0));

    /// The version `major.minor.patch`.
    pub const fn new(major: u64, minor: u64, patch: u64) -> AppVersion {
        AppVersion(semver::Version::new(major, minor, patch))
    }

    /// Parses `text` (see the type's documentation). An empty or malformed text, or one longer
    /// than 64 characters, is [`Error::Config`] naming it.
    pub fn parse(text: &str) -> Result<AppVersion> {
        let bad = |why: &str| {
            let shown: String = text.chars().take(MAX_LEN).collect();
            Error::Config(format!("app_version {shown:?} is not a version: {why}"))
        };
        if text.len() > MAX_LEN {
            return Err(bad("longer than 64 characters"));
        }
        let trimmed = text.trim();
        let unprefixed = trimmed.strip_prefix(['v', 'V']).unwrap_or(trimmed);
        let without_build = unprefixed.split_once('+').map_or(unprefixed, |(v, _)| v);
        let (core, pre) = match without_build.split_once('-') {
            Some((core, pre)) => (core, Some(pre)),
            None => (without_build, None),
        };
        let parts = core.split('.').count();
        if core.is_empty() || parts > 3 {
            return Err(bad("expected MAJOR[.MINOR[.PATCH]][-PRERELEASE]"));
        }
        // Calendar versions (`2024.01.15`) write leading zeros, which semver refuses.
        let numbers: Vec<&str> = core
            .split('.')
            .map(|n| match n.trim_start_matches('0') {
                "" if !n.is_empty() => "0",
                trimmed if n.bytes().all(|b| b.is_ascii_digit()) => trimmed,
                _ => n,
            })
            .collect();
        let mut full = numbers.join(".");
        for _ in parts..3 {
            full.push_str(".0");
        }
        if let Some(pre) = pre {
            full.push('-');
            full.push_str(pre);
        }
        semver::Version::parse(&full).map(AppVersion).map_err(|e| bad(&e.to_string()))
    }
}

impl Default for AppVersion {
    fn default() -> Self {
        AppVersion::ZERO
    }
}

impl fmt::Display for AppVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for AppVersion {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        AppVersion::parse(s)
    }
}

impl TryFrom<String> for AppVersion {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        AppVersion::parse(&s)
    }
}

impl From<AppVersion> for String {
    fn from(v: AppVersion) -> String {
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_image_tags_parse_leniently_and_compare_by_precedence() {
        let v = |s: &str| AppVersion::parse(s).unwrap();
        assert_eq!(v("2"), AppVersion::new(2, 0, 0));
        assert_eq!(v("v1.4"), AppVersion::new(1, 4, 0));
        assert_eq!(v(" 1.2.3+build.7 "), AppVersion::new(1, 2, 3));
        assert_eq!(v("1.2.3-rc.1").to_string(), "1.2.3-rc.1");
        assert_eq!(v("1-alpha").to_string(), "1.0.0-alpha");
        assert_eq!(v("2024.01.15"), AppVersion::new(2024, 1, 15));
        assert!(v("2024.02.01") > v("2024.01.31"));
        assert_eq!(v("0.00.0"), AppVersion::ZERO);
        assert!(v("1.10.0") > v("1.9.0"));
        assert!(v("1.9.0") > v("1.9.0-rc.1"));
        assert!(v("1.9.0-rc.2") > v("1.9.0-rc.1"));
        assert_eq!(AppVersion::default(), AppVersion::ZERO);
        assert_eq!("2.1".parse::<AppVersion>().unwrap(), AppVersion::new(2, 1, 0));
        let longest = format!("1.2.3-{}", "a".repeat(MAX_LEN - 6));
        assert_eq!(AppVersion::parse(&longest).unwrap().to_string(), longest, "64 characters are accepted");
    }

    #[test]
    fn a_version_too_long_or_with_four_numbers_is_refused_saying_why() {
        let why = |text: &str| AppVersion::parse(text).unwrap_err().to_string();
        assert!(why(&format!("1.2.3-{}", "a".repeat(MAX_LEN - 5))).contains("longer than 64"));
        assert!(why("1.2.3.4").contains("expected MAJOR[.MINOR[.PATCH]]"));
        assert!(why("").contains("expected MAJOR[.MINOR[.PATCH]]"));
    }

    #[test]
    fn a_version_that_does_not_parse_is_a_config_error_naming_it() {
        for text in ["", "x", "1.2.3.4", "1..2", "1.2.x", "-rc", "1.2.3-", &"9".repeat(65)] {
            match AppVersion::parse(text) {
                Err(Error::Config(m)) => {
                    assert!(m.contains("app_version"), "{m}");
                    assert!(m.contains(&text.chars().take(64).collect::<String>()), "{m}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_version_round_trips_through_its_text_and_serde() {
        let v = AppVersion::parse("3.1.4-beta.2").unwrap();
        assert_eq!(AppVersion::parse(&v.to_string()).unwrap(), v);
        let bytes = rmp_serde::to_vec(&v).unwrap();
        assert_eq!(rmp_serde::from_slice::<AppVersion>(&bytes).unwrap(), v);
        assert!(rmp_serde::from_slice::<AppVersion>(&rmp_serde::to_vec("nope").unwrap()).is_err());
    }
}
