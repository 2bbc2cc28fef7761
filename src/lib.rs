//! # ddshard
//!
//! Cluster sharding for peer-to-peer Rust clusters, in the spirit of Akka Cluster Sharding in
//! distributed-data mode, with no external datastore. Entities are addressed by id and live on
//! one node at a time; callers `tell` and `ask` an id:
//!
//! ```rust,no_run
//! use ddshard::{Entity, EntityContext, Node, NodeConfig, ShardingSettings};
//!
//! #[derive(Default)]
//! struct Counter { value: i64 }
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! enum CounterMsg { Add(i64), Get }
//!
//! impl Entity for Counter {
//!     type Message = CounterMsg;
//!     type Reply = i64;
//!     async fn handle(&mut self, msg: CounterMsg, _ctx: &mut EntityContext) -> i64 {
//!         if let CounterMsg::Add(n) = msg { self.value += n; }
//!         self.value
//!     }
//! }
//!
//! # async fn run() -> ddshard::Result<()> {
//! // Other nodes list this one's gossip address (or a DNS name of all) in `seeds`.
//! let node = Node::start(NodeConfig { node_id: "n1".into(), ..NodeConfig::default() }).await?;
//! // The node's `[sharding]` table; change what one type needs, e.g. `settings.remember.enabled = true`.
//! let settings: ShardingSettings = node.sharding().settings();
//! let counters = node.sharding().start("counter", |_: &str| Counter::default(), settings).await?;
//! counters.tell("c-1", CounterMsg::Add(5))?;
//! assert_eq!(counters.ask("c-1", CounterMsg::Get).await?, 5);
//! node.leave().await?; // hands its shards off first
//! # Ok(()) }
//! ```
//!
//! **Operating it.** The `ddshard node` binary (feature `cli`) runs a node from a TOML file
//! (`config/default.toml` documents every setting) with an admin HTTP API, `/alive` and
//! `/ready` probes and Prometheus `/metrics` (modules `admin` and `metrics`, on by default). Nodes find each other
//! through `seeds` (IP addresses or DNS names, looked up again while a node is alone),
//! `discovery.srv_names` or a [`membership::Discovery`] of your own; with one configuration
//! for every node, `membership.bootstrap_contact_points` lets exactly one of them form the
//! cluster. The repository's `deploy/` has a Dockerfile, Compose and Kubernetes files, a
//! systemd unit, alerts and a Grafana dashboard, all checked by tests; its README walks
//! through them.
//!
//! The parts:
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
// What is `pub` is reachable by users; everything else is `pub(crate)` (tests/public-api.txt lists the surface).
#![deny(unreachable_pub)]
// Two LMDB calls need `unsafe` (opening and resizing the map, `ddata/durable.rs`), each allowed
// where it is and justified there; the test allocator is test-only. Nothing else may.
#![deny(unsafe_code)]
// A function longer than `too-many-lines-threshold` (clippy.toml: 80 code lines) fails CI's
// clippy; tests are exempt (a table test is long by nature).
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

// The README's Rust snippets compile as doc tests, so the front page cannot drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

pub mod activation;
#[cfg(feature = "admin")]
pub mod admin;
#[cfg(test)]
mod alloc_count;
mod app_version;
pub mod clock;
pub mod config;
pub mod ddata;
mod deadline;
pub mod error;
#[cfg(test)]
mod fuzzing;
mod log_limit;
mod machine;
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

pub use app_version::AppVersion;
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
