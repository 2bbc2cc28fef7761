//! The producers running on a node, for [`crate::sharding::Sharding::producers`] and the admin
//! API.

use std::sync::{Arc, Mutex, Weak};

use super::ProducerStats;

/// A producer running on this node ([`crate::sharding::Sharding::producers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerInfo {
    /// The producer's id.
    pub producer_id: String,
    /// The entity type it sends to.
    pub type_name: String,
    /// What it counted and holds.
    pub stats: ProducerStats,
}

/// A running producer, whatever its entity type.
pub(super) trait ProducerView: Send + Sync {
    fn info(&self) -> ProducerInfo;
    /// Stopped or stopping (its handles dropped; its task may still be ending).
    fn stopping(&self) -> bool;
}

/// The producers started on a node (kept on it; a producer leaves when its task ends).
#[derive(Default)]
struct ProducerRegistry(Mutex<Vec<Weak<dyn ProducerView>>>);

/// Lists `view` among `node`'s producers.
pub(super) fn register(node: &crate::node::Node, view: Weak<dyn ProducerView>) {
    let registry = node.kept::<ProducerRegistry>().into_iter().next().unwrap_or_else(|| {
        let r = Arc::new(ProducerRegistry::default());
        node.keep(r.clone());
        r
    });
    let mut list = registry.0.lock().unwrap_or_else(|p| p.into_inner());
    list.retain(|w| w.strong_count() > 0);
    list.push(view);
}

/// The producers running on `node`, in start order.
pub(crate) fn producers(node: &crate::node::Node) -> Vec<ProducerInfo> {
    let mut out = Vec::new();
    for registry in node.kept::<ProducerRegistry>() {
        let list = registry.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        out.extend(list.iter().filter_map(Weak::upgrade).filter(|p| !p.stopping()).map(|p| p.info()));
    }
    out
}
