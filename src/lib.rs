//! # ddshard
//!
//! Cluster sharding for peer-to-peer Rust clusters, in the spirit of Akka Cluster Sharding in
//! distributed-data mode, with no external datastore:
//!
//! - [`membership`]: gossip membership and failure detection over chitchat;
//! - [`transport`]: node-to-node messages over TCP (handshake, framing, batching, reconnects,
//!   request/response);
//! - [`ddata`]: a replicator of CRDTs (LWW-map, OR-set, G-set) with majority reads and writes,
//!   anti-entropy and LMDB durability;
//! - [`Node`]: wires them together;
//! - [`secret`]: the cluster secret that authenticates gossip and messaging;
//! - [`activation`]: an activation log and the checker of "at most one live incarnation".
//!
//! With the `testkit` feature, `testkit` starts in-process clusters with fault injection.

#![deny(missing_docs)]
// Two LMDB calls need `unsafe` (opening and resizing the map, `ddata/durable.rs`), each allowed
// where it is and justified there; the test allocator is test-only. Nothing else may.
#![deny(unsafe_code)]

// The README's Rust snippets compile as doc tests, so the front page cannot drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub mod activation;
#[cfg(feature = "admin")]
pub mod admin;
#[cfg(test)]
mod alloc_count;
pub mod clock;
pub mod config;
pub mod ddata;
mod deadline;
pub mod error;
#[cfg(test)]
mod fuzzing;
mod log_limit;
pub mod membership;
pub mod metrics;
mod node;
pub mod secret;
#[cfg(feature = "cli")]
pub mod service;
pub mod sharding;
mod singleton;
mod spawn;
pub mod transport;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use config::{
    DiscoverySettings, DownAllWhenUnstable, DowningStrategy, MembershipSettings, NodeConfig, ReadinessSettings,
    ReplicatorSettings, SeedAddr, TransportSettings,
};
pub use ddata::{Consistency, Replicator};
pub use error::{Error, Result};
pub use membership::{FailureDetectorSettings, Member, MemberEvent, MemberStatus, MembershipSnapshot, UniqueAddress};
pub use node::{FailureDetectorStats, Node, NodeBuilder};
pub use secret::ClusterSecret;
pub use sharding::{Durable, DurableEntity, Entity, EntityContext, ShardRegion, Sharding, ShardingSettings};
