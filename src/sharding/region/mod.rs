//! The shard region of one entity type on one node: [`core`] routes and takes part in
//! hand-offs, [`asks`] tracks asks sent to other regions, and the driver runs both.

mod asks;
pub(crate) mod core;
mod driver;

pub(crate) use asks::AskTable;
pub(crate) use core::{RegionCore, RegionInput, RegionSettings};
pub(crate) use driver::{RegionCmd, RegionTask};
