//! The shard coordinator of one entity type: a singleton on the oldest member with the type's
//! role. [`core`] decides (allocation, hand-off, rebalance, registrations), [`state`] is what it
//! stores in the replicated LWW-map, and the driver runs it under the singleton life cycle.

pub(crate) mod core;
mod driver;
pub(crate) mod state;
pub(crate) mod take_over;

pub(crate) use core::Registration;
pub(crate) use driver::start_singleton;
