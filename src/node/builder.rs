//! [`NodeBuilder`]: a node's configuration plus the seams that are not configuration — a
//! [`LinkFilter`] for messaging and a wrapper of the gossip socket (the test kit's fault
//! injector uses both), and the machine whose sockets and threads it uses (the test kit's
//! whole-node simulation swaps it). Production code compiles the same with or without the test
//! kit.

use std::sync::Arc;

use super::Node;
use crate::config::NodeConfig;
use crate::error::Result;
use crate::machine::{Machine, OsMachine};
use crate::membership::{Discovery, GossipSocketWrapper};
use crate::transport::LinkFilter;

/// Starts a [`Node`] with seams; `Node::builder(config).start()` equals `Node::start(config)`.
#[must_use = "a builder does nothing until `start`"]
pub struct NodeBuilder {
    pub(super) config: NodeConfig,
    pub(super) link_filter: Option<Arc<dyn LinkFilter>>,
    pub(super) gossip_socket: Option<GossipSocketWrapper>,
    pub(super) discovery: Vec<Arc<dyn Discovery>>,
    pub(super) machine: Arc<dyn Machine>,
}

impl std::fmt::Debug for NodeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeBuilder")
            .field("node_id", &self.config.node_id)
            .field("link_filter", &self.link_filter)
            .field("gossip_socket", &self.gossip_socket.is_some())
            .field("discovery", &self.discovery.iter().map(|d| d.describe()).collect::<Vec<_>>())
            .field("machine", &self.machine)
            .finish()
    }
}

impl NodeBuilder {
    /// A builder for a node with this configuration and no seams.
    pub fn new(config: NodeConfig) -> Self {
        NodeBuilder {
            config,
            link_filter: None,
            gossip_socket: None,
            discovery: Vec::new(),
            machine: Arc::new(OsMachine),
        }
    }

    /// Messages between nodes pass only where `filter` allows.
    pub fn link_filter(mut self, filter: Arc<dyn LinkFilter>) -> Self {
        self.link_filter = Some(filter);
        self
    }

    /// Also finds nodes to join through with `source` (a cloud API, a registry), besides the
    /// configured `seeds` and `discovery.srv_names`; asked as `[discovery]` says. A node with a
    /// source and no first seed needs `membership.bootstrap_contact_points` to form a cluster.
    pub fn discovery(mut self, source: Arc<dyn Discovery>) -> Self {
        self.discovery.push(source);
        self
    }

    /// Wraps the bound gossip socket before chitchat gets it (crate-private: its type is
    /// chitchat's, which is not part of the public API; only the test kit uses it).
    #[cfg_attr(not(feature = "testkit"), allow(dead_code))]
    pub(crate) fn gossip_socket(mut self, wrap: GossipSocketWrapper) -> Self {
        self.gossip_socket = Some(wrap);
        self
    }

    /// Runs the node on `machine`'s sockets and threads instead of the operating system's
    /// (crate-private: only the test kit's whole-node simulation swaps it).
    #[cfg_attr(not(feature = "testkit"), allow(dead_code))]
    pub(crate) fn machine(mut self, machine: Arc<dyn Machine>) -> Self {
        self.machine = machine;
        self
    }

    /// Starts the node (see [`Node::start`]).
    pub async fn start(self) -> Result<Node> {
        Node::start_built(self).await
    }
}
