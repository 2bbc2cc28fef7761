//! The link-filter seam: which node-to-node links carry messages. Production nodes have none
//! (every link carries); the test kit's fault injector implements it to cut links, so no test
//! hook lives in production code.

/// Decides whether messages from one node to another pass (by node id). Checked by the writer
/// before a batch leaves and by the reader before a frame is dispatched, so a cut link loses
/// messages in both directions the way a broken network would.
pub trait LinkFilter: Send + Sync + std::fmt::Debug + 'static {
    /// Whether messages from node `from` to node `to` pass.
    fn allows(&self, from: &str, to: &str) -> bool;
}
