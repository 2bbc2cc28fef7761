//! The shard region of one entity type on one node: [`core`] routes and takes part in
//! hand-offs, [`asks`] tracks asks sent to other regions, the driver runs both, and
//! [`fast`] takes the common messages from other nodes on the connection's own task.

mod asks;
pub(crate) mod core;
mod driver;
mod fast;

pub(crate) use asks::AskTable;
pub(crate) use core::{RegionCore, RegionInput, RegionSettings};
pub(crate) use driver::{RegionCmd, RegionCommands, RegionCommandsRx, RegionTask, region_commands};
pub(crate) use fast::{Direct, FastPath, PeerSenders, RemoteHomes};
