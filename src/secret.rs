//! The cluster secret and the keys derived from it.
//!
//! Every member of a cluster holds the same secret. Two keys are derived from it with
//! domain-separated BLAKE2b hashes (so the gossip MAC key and the transport's Noise pre-shared key
//! never coincide, and neither reveals the secret): one authenticates gossip datagrams, the other
//! is the pre-shared key of every messaging connection's Noise handshake.
//!
//! A secret is either a **key** (at least 32 hex digits, 128 bits; `ddshard secret` prints 64)
//! hashed as it is, or a **passphrase**, stretched once at start with Argon2id (64 MiB, 3
//! passes) so that each guess of an attacker who captured traffic costs what it costs a node to
//! start. Either must not be guessable: a secret whose zxcvbn estimate is under 10^18 guesses
//! (repeated or sequential characters, a few dictionary words) is refused at configuration.

use blake2::{Blake2b, Digest, digest::consts::U32};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// Fewest characters a secret may have: 32 random characters (or 64 hex digits from
/// `ddshard secret`) are far beyond brute force; shorter strings are likely typed passwords.
pub const MIN_SECRET_LEN: usize = 32;

/// Most bytes a secret may have (what is read from a file or the environment is bounded).
pub const MAX_SECRET_LEN: usize = 1024;

/// Fewest guesses (log10) the zxcvbn estimate must give a secret: its estimate saturates near
/// 10^19, which every random key of 32 hex digits reaches, and no pattern of repeats, sequences
/// or a few common words does.
const MIN_GUESSES_LOG10: f64 = 18.0;

/// Argon2id's salt for passphrases: fixed, as every member must derive the same key without
/// talking first; the cost parameters, not the salt, are what make a guess expensive.
const PASSPHRASE_SALT: &[u8] = b"ddshard v1 cluster secret passphrase";

/// The shared secret of a cluster's members. Its `Debug` prints no part of it, and it is never
/// logged.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret {
    text: String,
    /// What the purpose keys are hashed from: a key's own text (so keys derive what earlier
    /// releases derived), or a passphrase's Argon2id output.
    keying: Vec<u8>,
}

/// A 32-byte key derived from the cluster secret for one purpose.
pub(crate) type DerivedKey = [u8; 32];

/// Whether `secret` is written as a key: hex digits only, at least 128 bits of them.
fn is_hex_key(secret: &str) -> bool {
    secret.len() >= 32 && secret.bytes().all(|b| b.is_ascii_hexdigit())
}

impl ClusterSecret {
    /// Wraps a secret: a key of at least 32 hex digits, or a passphrase of at least
    /// [`MIN_SECRET_LEN`] characters, either hard to guess; a passphrase is stretched here with
    /// Argon2id (about 0.1 s and 64 MiB, once).
    pub fn new(secret: impl Into<String>) -> Result<Self> {
        let secret = secret.into();
        check_strength("cluster_secret", &secret)?;
        let keying = if is_hex_key(&secret) { secret.as_bytes().to_vec() } else { stretch(&secret)?.to_vec() };
        Ok(ClusterSecret { text: secret, keying })
    }

    /// A fresh random secret: 64 hex digits (256 bits) from the operating system's generator.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        ClusterSecret { keying: text.as_bytes().to_vec(), text }
    }

    /// The secret itself, to write into a member's configuration.
    pub fn expose(&self) -> &str {
        &self.text
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
        h.update(&self.keying);
        h.finalize().into()
    }
}

/// Checks that `text`, a secret named `what` in messages, is hard enough to guess: at least
/// [`MIN_SECRET_LEN`] characters, at most [`MAX_SECRET_LEN`] bytes, and a zxcvbn estimate of
/// at least 10^18 guesses. The error never quotes the text (it ends up in logs and terminals).
pub fn check_strength(what: &str, text: &str) -> Result<()> {
    if text.chars().count() < MIN_SECRET_LEN {
        return Err(Error::Config(format!(
            "{what} must have at least {MIN_SECRET_LEN} characters (generate one with `ddshard secret`)"
        )));
    }
    if text.len() > MAX_SECRET_LEN {
        return Err(Error::Config(format!("{what} must have at most {MAX_SECRET_LEN} bytes")));
    }
    let guesses_log10 = zxcvbn::zxcvbn(text, &["ddshard", "cluster", "secret", "admin", "token"]).guesses_log10();
    if guesses_log10 < MIN_GUESSES_LOG10 {
        return Err(Error::Config(format!(
            "{what} is too easy to guess (about 10^{guesses_log10:.0} guesses; repeats, sequences and common \
             words are the usual reasons): use a random key (`ddshard secret` prints one)"
        )));
    }
    Ok(())
}

/// A passphrase's 32-byte key: Argon2id with 64 MiB, 3 passes, 1 lane (RFC 9106's second
/// recommended setting, one lane so a node's start costs one core).
fn stretch(passphrase: &str) -> Result<[u8; 32]> {
    use argon2::{Algorithm, Argon2, Params, Version};
    let params = Params::new(64 * 1024, 3, 1, Some(32))
        .map_err(|e| Error::Config(format!("cluster_secret: key stretching parameters: {e}")))?;
    let mut key = [0u8; 32];
    Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
        .hash_password_into(passphrase.as_bytes(), PASSPHRASE_SALT, &mut key)
        .map_err(|e| Error::Config(format!("cluster_secret: key stretching failed: {e}")))?;
    Ok(key)
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

    /// A key as the tests write one: 40 hex digits, patternless.
    fn key(seed: u8) -> String {
        (0..20u8).map(|i| format!("{:02x}", i.wrapping_mul(151).wrapping_add(seed.wrapping_mul(89)) ^ 0x5c)).collect()
    }

    #[test]
    fn short_secrets_are_config_errors() {
        let strong = key(1);
        assert!(matches!(ClusterSecret::new(&strong[..MIN_SECRET_LEN - 1]), Err(Error::Config(_))));
        assert!(ClusterSecret::new(&strong[..MIN_SECRET_LEN]).is_ok());
        assert!(toml::from_str::<std::collections::HashMap<String, ClusterSecret>>("s = \"short\"").is_err());
    }

    #[test]
    fn long_but_guessable_secrets_are_refused_without_quoting_them() {
        for weak in [
            "a".repeat(48),
            "s3cr3t-".repeat(6),
            "0123456789abcdef0123456789abcdef".to_string(),
            "passwordpasswordpasswordpassword".to_string(),
            "qwertyuiopasdfghjklzxcvbnm1234567890".to_string(),
        ] {
            match ClusterSecret::new(weak.clone()) {
                Err(Error::Config(m)) => {
                    assert!(m.contains("too easy to guess") && !m.contains(&weak[..8]), "{weak}: {m}")
                }
                other => panic!("{weak} accepted: {other:?}"),
            }
        }
        assert!(matches!(ClusterSecret::new(key(2).repeat(60)), Err(Error::Config(m)) if m.contains("at most")));
    }

    #[test]
    fn every_random_key_of_32_hex_digits_passes_the_guessability_bar() {
        for _ in 0..200 {
            let bytes: [u8; 16] = rand::random();
            let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert!(ClusterSecret::new(text.clone()).is_ok(), "a random 128-bit key was refused: {text}");
        }
    }

    #[test]
    fn a_hex_key_derives_what_earlier_releases_derived_and_a_passphrase_is_stretched() {
        // A key is hashed as written (clusters on `ddshard secret` keys keep their keys)...
        let k = ClusterSecret::new(key(3)).unwrap();
        let mut h = Blake2b::<U32>::new();
        let purpose = b"ddshard v1 noise transport psk";
        h.update((purpose.len() as u64).to_be_bytes());
        h.update(purpose);
        h.update(key(3).as_bytes());
        assert_eq!(k.transport_psk(), <[u8; 32]>::from(h.finalize()));
        // ...a passphrase is not: its purpose keys come from Argon2id's output, the same on
        // every node.
        let phrase = "correct horse battery staple and more words";
        let p = ClusterSecret::new(phrase).unwrap();
        assert_eq!(p.keying, stretch(phrase).unwrap().to_vec());
        assert_ne!(p.keying, phrase.as_bytes());
        assert_eq!(p.transport_psk(), ClusterSecret::new(phrase).unwrap().transport_psk());
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
