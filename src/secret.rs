//! The cluster secret and the keys derived from it.
//!
//! Every member of a cluster holds the same secret. Two keys are derived from it with
//! domain-separated BLAKE2b hashes (so the gossip MAC key and the transport's Noise pre-shared key
//! never coincide, and neither reveals the secret): one authenticates gossip datagrams, the other
//! is the pre-shared key of every messaging connection's Noise handshake.

use blake2::{Blake2b, Digest, digest::consts::U32};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// Fewest characters a secret may have: 32 random characters (or 64 hex digits from
/// `ddshard secret`) are far beyond brute force; shorter strings are likely typed passwords.
pub const MIN_SECRET_LEN: usize = 32;

/// The shared secret of a cluster's members. Its `Debug` prints no part of it, and it is never
/// logged.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(String);

/// A 32-byte key derived from the cluster secret for one purpose.
pub(crate) type DerivedKey = [u8; 32];

impl ClusterSecret {
    /// Wraps a secret; it must have at least [`MIN_SECRET_LEN`] characters.
    pub fn new(secret: impl Into<String>) -> Result<Self> {
        let secret = secret.into();
        if secret.chars().count() < MIN_SECRET_LEN {
            return Err(Error::Config(format!(
                "cluster_secret must have at least {MIN_SECRET_LEN} characters (generate one with `ddshard secret`)"
            )));
        }
        Ok(ClusterSecret(secret))
    }

    /// A fresh random secret: 64 hex digits (256 bits) from the operating system's generator.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        ClusterSecret(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The secret itself, to write into a member's configuration.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The key that authenticates gossip datagrams.
    pub(crate) fn gossip_mac_key(&self) -> DerivedKey {
        self.derive(b"ddshard v1 gossip datagram mac")
    }

    /// The pre-shared key of the messaging handshake.
    pub(crate) fn transport_psk(&self) -> DerivedKey {
        self.derive(b"ddshard v1 noise transport psk")
    }

    fn derive(&self, purpose: &[u8]) -> DerivedKey {
        let mut h = Blake2b::<U32>::new();
        // Length-prefixed so no (purpose, secret) pair can collide with another.
        h.update((purpose.len() as u64).to_be_bytes());
        h.update(purpose);
        h.update(self.0.as_bytes());
        h.finalize().into()
    }
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Serialized redacted, like `Debug`: a config written out (or logged as JSON) never carries
/// the secret, and what it writes is not a valid secret, so it cannot be read back as one.
impl Serialize for ClusterSecret {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

/// What a secret serializes to.
const REDACTED: &str = "<redacted>";

impl<'de> Deserialize<'de> for ClusterSecret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ClusterSecret::new(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_contains_the_secret() {
        let s = ClusterSecret::new("correct horse battery staple and more words").unwrap();
        let printed = format!("{s:?} {:?}", Some(&s));
        assert!(!printed.contains("horse"), "{printed}");
        assert!(printed.contains("redacted"));
    }

    #[test]
    fn a_serialized_secret_is_redacted_and_does_not_read_back_as_a_secret() {
        let s = ClusterSecret::new("correct horse battery staple and more words").unwrap();
        let written = toml::to_string(&std::collections::BTreeMap::from([("cluster_secret", s)])).unwrap();
        assert_eq!(written.trim(), format!("cluster_secret = \"{REDACTED}\""));
        assert!(toml::from_str::<std::collections::BTreeMap<String, ClusterSecret>>(&written).is_err());
    }

    #[test]
    fn short_secrets_are_config_errors() {
        assert!(matches!(ClusterSecret::new("x".repeat(MIN_SECRET_LEN - 1)), Err(Error::Config(_))));
        assert!(ClusterSecret::new("x".repeat(MIN_SECRET_LEN)).is_ok());
        assert!(toml::from_str::<std::collections::HashMap<String, ClusterSecret>>("s = \"short\"").is_err());
    }

    #[test]
    fn derived_keys_differ_by_purpose_and_by_secret_and_are_stable() {
        let a = ClusterSecret::new("a".repeat(40)).unwrap();
        let b = ClusterSecret::new("b".repeat(40)).unwrap();
        assert_ne!(a.gossip_mac_key(), a.transport_psk());
        assert_ne!(a.gossip_mac_key(), b.gossip_mac_key());
        assert_ne!(a.transport_psk(), b.transport_psk());
        assert_eq!(a.transport_psk(), a.clone().transport_psk());
        assert_ne!(a.transport_psk(), [0; 32]);
    }

    #[test]
    fn generated_secrets_are_valid_hex_and_distinct() {
        let (x, y) = (ClusterSecret::generate(), ClusterSecret::generate());
        assert_ne!(x, y);
        assert_eq!(x.expose().len(), 64);
        assert!(x.expose().chars().all(|c| c.is_ascii_hexdigit()));
        assert!(ClusterSecret::new(x.expose()).is_ok());
    }
}
