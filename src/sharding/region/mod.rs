//! The shard region of one entity type on one node: [`core`] routes and takes part in
//! hand-offs, [`asks`] tracks asks sent to other regions, the driver runs both, [`inbound`]
//! classifies what other nodes send once, and [`fast`] holds what the region shares with its
//! handle and with the tasks reading its connections ([`SharedRegion`]).
//!
//! A message for an entity takes one of three paths; each relies on one ordering rule, so
//! messages of one sender to one entity are handled in the order sent whichever paths they take:
//!
//! | path | from → to | taken when | ordering rule it relies on |
//! |---|---|---|---|
//! | local direct | this node's handle → a running entity's mailbox ([`ShardDirectory::deliver`](crate::sharding::shard::ShardDirectory::deliver)) | the entity runs here and accepts direct messages | no earlier message of the id's stripe is on the routed path (its [`RoutedInFlight`](crate::sharding::envelope::RoutedInFlight) count is zero) |
//! | remote direct | this node's handle → the home node's connection queue ([`SharedRegion::send_direct`]); there, the reading task → the running entity's mailbox ([`SharedRegion::handle`]) | the core's last forward decision for the shard is still current ([`RemoteHomes`], by routing generation), and on arrival the entity runs there | the same stripe rule on both nodes, and one FIFO connection per pair of nodes |
//! | routed | the region task ([`RegionCore`]): buffers while a home is asked or a hand-off runs, forwards, starts entities | everything else, and every message passed on by the two above | a routed message counts on its stripe (a ticket riding with it) until the region task is done with it, so no later direct message overtakes it |

mod asks;
pub(crate) mod core;
mod driver;
mod fast;
mod inbound;

pub(crate) use core::{RegionCore, RegionInput, RegionSettings};
pub(crate) use driver::{RegionCmd, RegionCommands, RegionCommandsRx, RegionDriver, region_commands};
pub(crate) use fast::{Direct, PeerSenders, RemoteHomes, SharedRegion};
