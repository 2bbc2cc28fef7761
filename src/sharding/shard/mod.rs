//! The shards a region hosts: [`core`] is the life cycle of one shard's entities, [`host`]
//! performs it for every hosted shard, [`entity`] runs one entity, and [`remember`] reads and
//! writes remembered entity ids.

pub(crate) mod core;
mod entity;
mod host;
mod remember;

pub(crate) use core::ShardInput;
pub(crate) use entity::Factory;
pub(crate) use host::{LocalShards, ShardEvent, Work};
pub(crate) use remember::RememberIo;
