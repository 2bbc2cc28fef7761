//! Cluster membership over chitchat gossip: member list, status, roles, reachability, age order
//! and membership events.
//!
//! Each node gossips a few small keys of its own (status, up-number, roles, messaging address);
//! [`view::compute_members`] turns the gossip state into the member list, the same way on every
//! node, and the driver runs the joining/leaving life cycle around chitchat.
//!
//! **Age order.** When a member turns Up it takes an *up-number*: one more than the highest it
//! has seen in gossip (Lamport style). Members are ordered by `(up_number, node_id)`, so a node
//! that joins a running cluster is always younger than every member it saw, whatever the wall
//! clocks say, and a restarted node (new generation) is younger than everyone. Views can disagree
//! for a moment; coordinator state is guarded by majority reads and writes, not by this order.

mod discovery;
pub(crate) mod downing;
mod driver;
pub(crate) mod failure_detector;
mod gossip_auth;
mod lifecycle;
pub(crate) mod view;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use discovery::{AggregateDiscovery, Discovery, DiscoveryError, DnsSrv, SeedList};
pub(crate) use driver::{GossipSocketWrapper, GossipSockets, MembershipDriver, MembershipHandle};
pub use failure_detector::FailureDetectorSettings;
pub use gossip_auth::GossipStats;
pub use view::compute_members;

/// A node incarnation: its stable id plus the generation it started with. A restarted node has
/// a larger generation and is a different incarnation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UniqueAddress {
    /// Stable node id.
    pub node_id: Arc<str>,
    /// Generation (grows on every start of the node).
    pub generation: u64,
}

impl UniqueAddress {
    /// Creates an address.
    pub fn new(node_id: impl Into<Arc<str>>, generation: u64) -> Self {
        UniqueAddress { node_id: node_id.into(), generation }
    }
}

impl fmt::Display for UniqueAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.node_id, self.generation)
    }
}

/// Where a peer incarnation is reached.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    /// The incarnation.
    pub address: UniqueAddress,
    /// Its messaging (TCP) address.
    pub messaging_addr: SocketAddr,
}

/// Whether an incarnation may send this node frames ([`MembershipSnapshot::standing_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerStanding {
    /// A listed member that is not Down or Removed.
    Member,
    /// Not listed (yet: gossip may not have brought it here).
    Unknown,
    /// Never again: downed, removed, or superseded by a newer incarnation.
    Gone(&'static str),
}

/// Life-cycle status of a member (as in Akka, without WeaklyUp).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemberStatus {
    /// Started and gossiping, not yet part of the cluster's decisions.
    Joining,
    /// Full member.
    Up,
    /// Leaving gracefully: handing off its work.
    Leaving,
    /// Done handing off; about to stop.
    Exiting,
    /// Gone from the cluster (after leaving, or superseded by a newer incarnation).
    Removed,
    /// Declared down by a downing decision; never comes back as this incarnation.
    Down,
}

impl MemberStatus {
    pub(crate) fn as_key(self) -> &'static str {
        match self {
            MemberStatus::Joining => "joining",
            MemberStatus::Up => "up",
            MemberStatus::Leaving => "leaving",
            MemberStatus::Exiting => "exiting",
            MemberStatus::Removed => "removed",
            MemberStatus::Down => "down",
        }
    }

    pub(crate) fn from_key(s: &str) -> Option<Self> {
        Some(match s {
            "joining" => MemberStatus::Joining,
            "up" => MemberStatus::Up,
            "leaving" => MemberStatus::Leaving,
            "exiting" => MemberStatus::Exiting,
            "removed" => MemberStatus::Removed,
            "down" => MemberStatus::Down,
            _ => return None,
        })
    }

    /// Up or Leaving: the members that count for majorities, may register a region and may
    /// host a singleton.
    pub fn is_up_or_leaving(self) -> bool {
        matches!(self, MemberStatus::Up | MemberStatus::Leaving)
    }

    /// Joining, Up or Leaving: messages to the member can still be handled, so they are sent
    /// and answers are awaited. Exiting members have handed everything off; Down ones are
    /// being stopped.
    pub fn is_routable(self) -> bool {
        matches!(self, MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving)
    }

    /// Routable, or Down but still listed: the member's entities may still be running. A Down
    /// member stays listed for the down-removal margin, so its shards move only once it is gone.
    pub fn may_host(self) -> bool {
        self.is_routable() || self == MemberStatus::Down
    }

    /// Up only: the members new shards go to (Leaving members are handing theirs off; joining
    /// and Down members must not get any).
    pub fn takes_new_shards(self) -> bool {
        self == MemberStatus::Up
    }

    /// Joining, Up or Leaving: the members keep-majority counts when it compares the sides.
    pub fn counts_for_downing(self) -> bool {
        matches!(self, MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving)
    }
}

/// One member as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub(crate) address: UniqueAddress,
    pub(crate) status: MemberStatus,
    pub(crate) up_number: Option<u64>,
    pub(crate) roles: Vec<String>,
    pub(crate) app_version: crate::app_version::AppVersion,
    /// Gossip says it is alive and no counted observer sees it unreachable.
    pub(crate) reachable: bool,
    /// Its gossip heartbeat reaches this node (directly or through others).
    pub(crate) gossip_live: bool,
    /// The observers (Up or Leaving, alive in gossip) whose heartbeats over the message path
    /// say it is unreachable, in address order.
    pub(crate) unreachable_by: Vec<UniqueAddress>,
    pub(crate) messaging_addr: SocketAddr,
    pub(crate) gossip_addr: SocketAddr,
}

impl Member {
    /// A member with no roles on loopback addresses, for the simulation and the unit tests.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn on_loopback(address: UniqueAddress, status: MemberStatus, up_number: u64, reachable: bool) -> Member {
        Member {
            address,
            status,
            up_number: Some(up_number),
            roles: Vec::new(),
            app_version: crate::app_version::AppVersion::ZERO,
            reachable,
            gossip_live: reachable,
            unreachable_by: Vec::new(),
            messaging_addr: SocketAddr::from(([127, 0, 0, 1], 1)),
            gossip_addr: SocketAddr::from(([127, 0, 0, 1], 2)),
        }
    }

    /// A member for the crate's unit tests: incarnation `id`#1 with `status`, on loopback.
    #[cfg(test)]
    pub(crate) fn for_test(id: &str, status: MemberStatus, reachable: bool) -> Member {
        Member::on_loopback(UniqueAddress::new(id, 1), status, 1, reachable)
    }

    /// The member's stable node id.
    pub fn node_id(&self) -> &str {
        &self.address.node_id
    }
    /// The incarnation (node id + generation).
    pub fn address(&self) -> &UniqueAddress {
        &self.address
    }
    /// Current status.
    pub fn status(&self) -> MemberStatus {
        self.status
    }
    /// Roles the member has.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }
    /// The version of the application it runs (`app_version`; `0.0.0` when unset or from
    /// a release that does not gossip one).
    pub fn app_version(&self) -> &crate::app_version::AppVersion {
        &self.app_version
    }
    /// Whether it has the role (`None` = any member).
    pub fn has_role(&self, role: Option<&str>) -> bool {
        role.is_none_or(|r| self.roles.iter().any(|x| x == r))
    }
    /// The up-number that orders members by age (lower = older); `None` while joining.
    pub fn up_number(&self) -> Option<u64> {
        self.up_number
    }
    /// False while gossip considers it dead or an observer's heartbeats over the message path
    /// say it is unreachable ([`Self::observed_unreachable_by`]).
    pub fn is_reachable(&self) -> bool {
        self.reachable
    }
    /// Whether its gossip heartbeat reaches this node, directly or through other members (a
    /// member can be alive in gossip and still unreachable on the message path).
    pub fn is_alive_in_gossip(&self) -> bool {
        self.gossip_live
    }
    /// The members whose heartbeats say this one is unreachable on the message path (only
    /// observers that are Up or Leaving and alive in gossip count), in address order.
    pub fn observed_unreachable_by(&self) -> &[UniqueAddress] {
        &self.unreachable_by
    }
    /// TCP address of its messaging endpoint.
    pub fn messaging_addr(&self) -> SocketAddr {
        self.messaging_addr
    }
    /// UDP gossip address.
    pub fn gossip_addr(&self) -> SocketAddr {
        self.gossip_addr
    }
    /// Where messages for this member go.
    pub fn peer(&self) -> PeerAddr {
        PeerAddr { address: self.address.clone(), messaging_addr: self.messaging_addr }
    }
    /// Age key: lower is older. Joining members sort after every member that is up.
    pub(crate) fn age_key(&self) -> (u64, u64, &str) {
        match self.up_number {
            Some(n) => (0, n, &self.address.node_id),
            None => (1, self.address.generation, &self.address.node_id),
        }
    }
}

/// The member list as seen by one node at one moment, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipSnapshot {
    /// This node.
    pub self_address: UniqueAddress,
    /// Members, oldest first. Removed members are not listed; unreachable ones are, flagged.
    pub members: Vec<Member>,
}

impl MembershipSnapshot {
    /// The listed member with this address (incarnation).
    pub fn get(&self, address: &UniqueAddress) -> Option<&Member> {
        self.members.iter().find(|m| m.address == *address)
    }

    /// Where to send messages for this incarnation, if it is listed and routable
    /// ([`MemberStatus::is_routable`]).
    pub fn peer(&self, address: &UniqueAddress) -> Option<PeerAddr> {
        self.get(address).filter(|m| m.status.is_routable()).map(Member::peer)
    }

    /// Whether this incarnation may send this node frames: the one rule the transport applies
    /// at every inbound handshake.
    pub fn standing_of(&self, address: &UniqueAddress) -> PeerStanding {
        if let Some(m) = self.get(address) {
            return match m.status {
                MemberStatus::Down | MemberStatus::Removed => PeerStanding::Gone("it is downed or removed"),
                _ => PeerStanding::Member,
            };
        }
        if self.members.iter().any(|m| m.node_id() == &*address.node_id && m.address.generation > address.generation) {
            return PeerStanding::Gone("a newer incarnation of it is a member");
        }
        PeerStanding::Unknown
    }

    /// Whether the incarnation is listed and routable ([`MemberStatus::is_routable`]).
    pub fn is_routable(&self, address: &UniqueAddress) -> bool {
        self.get(address).is_some_and(|m| m.status.is_routable())
    }

    /// Where a singleton with this role runs: the oldest member with the role that is Up or
    /// Leaving — unless an older member with the role is Down and still listed (inside the
    /// down-removal margin), in which case nobody: the old instance may still be running, and
    /// the successor waits until it is removed.
    pub fn singleton_host(&self, role: Option<&str>) -> Option<&Member> {
        self.members
            .iter()
            .find(|m| m.has_role(role) && (m.status.is_up_or_leaving() || m.status == MemberStatus::Down))
            .filter(|m| m.status != MemberStatus::Down)
    }

    /// Whether this node hosts the singleton with this role ([`Self::singleton_host`]).
    pub fn hosts_singleton(&self, role: Option<&str>) -> bool {
        self.singleton_host(role).is_some_and(|m| m.address == self.self_address)
    }

    /// The observers that see this incarnation unreachable on the message path (empty when it
    /// is not listed or every observer hears it): the reachability table's row for it.
    pub fn observed_unreachable_by(&self, member: &UniqueAddress) -> &[UniqueAddress] {
        self.get(member).map_or(&[], |m| &m.unreachable_by)
    }

    /// Every member reachable and none joining: a good time to move shards.
    pub fn is_settled(&self) -> bool {
        self.members.iter().all(|m| m.reachable && m.status != MemberStatus::Joining)
    }

    /// The member with this node id, if listed.
    pub fn member(&self, node_id: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.node_id() == node_id)
    }

    /// This node's own entry.
    pub fn self_member(&self) -> Option<&Member> {
        self.members.iter().find(|m| m.address == self.self_address)
    }

    /// The oldest member that is Up or Leaving and has the role (singletons run on
    /// [`Self::singleton_host`], which also waits for an older Down member to be removed).
    pub fn oldest(&self, role: Option<&str>) -> Option<&Member> {
        self.members.iter().find(|m| m.status.is_up_or_leaving() && m.has_role(role))
    }

    /// Members that are Up or Leaving with the role (reachable or not): the replica set that
    /// majorities are counted over.
    pub fn up_members(&self, role: Option<&str>) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(move |m| m.status.is_up_or_leaving() && m.has_role(role))
    }
}

/// A change in the member list, derived by comparing two snapshots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberEvent {
    /// A new member appeared (joining).
    Joined(Member),
    /// A member became Up.
    Up(Member),
    /// A member started leaving.
    Leaving(Member),
    /// A member finished handing off and is about to stop.
    Exited(Member),
    /// A member was declared down.
    Downed(Member),
    /// A member is gone from the list.
    Removed(UniqueAddress),
    /// A member became unreachable: gossip lost it, or an observer's heartbeats did (the
    /// member carries who: [`Member::observed_unreachable_by`]).
    Unreachable(Member),
    /// The observers that see an unreachable member so changed while it stayed unreachable.
    ObserversChanged(Member),
    /// A member that was unreachable is back.
    Reachable(Member),
}

impl MemberEvent {
    /// What happened, in one word: `joined`, `up`, `leaving`, `exited`, `downed`, `removed`,
    /// `unreachable`, `observers-changed` or `reachable` (the admin API's event kinds).
    pub fn kind(&self) -> &'static str {
        match self {
            MemberEvent::Joined(_) => "joined",
            MemberEvent::Up(_) => "up",
            MemberEvent::Leaving(_) => "leaving",
            MemberEvent::Exited(_) => "exited",
            MemberEvent::Downed(_) => "downed",
            MemberEvent::Removed(_) => "removed",
            MemberEvent::Unreachable(_) => "unreachable",
            MemberEvent::ObserversChanged(_) => "observers-changed",
            MemberEvent::Reachable(_) => "reachable",
        }
    }

    /// The member as it is now (`None` for `removed`, which only names its incarnation).
    pub fn member(&self) -> Option<&Member> {
        match self {
            MemberEvent::Removed(_) => None,
            MemberEvent::Joined(m)
            | MemberEvent::Up(m)
            | MemberEvent::Leaving(m)
            | MemberEvent::Exited(m)
            | MemberEvent::Downed(m)
            | MemberEvent::Unreachable(m)
            | MemberEvent::ObserversChanged(m)
            | MemberEvent::Reachable(m) => Some(m),
        }
    }

    /// The incarnation it is about.
    pub fn address(&self) -> &UniqueAddress {
        match self {
            MemberEvent::Removed(a) => a,
            other => other.member().map(Member::address).expect("every other event carries its member"),
        }
    }
}

/// The events that turn `before` into `after`.
pub fn diff_snapshots(before: &MembershipSnapshot, after: &MembershipSnapshot) -> Vec<MemberEvent> {
    let mut events = Vec::new();
    for m in &after.members {
        match before.members.iter().find(|b| b.address == m.address) {
            None => {
                events.push(MemberEvent::Joined(m.clone()));
                if m.status != MemberStatus::Joining {
                    events.extend(status_event(m));
                }
                if !m.reachable {
                    events.push(MemberEvent::Unreachable(m.clone()));
                }
            }
            Some(b) => {
                if b.status != m.status {
                    events.extend(status_event(m));
                }
                if b.reachable && !m.reachable {
                    events.push(MemberEvent::Unreachable(m.clone()));
                } else if !b.reachable && m.reachable {
                    events.push(MemberEvent::Reachable(m.clone()));
                } else if !m.reachable && b.unreachable_by != m.unreachable_by {
                    events.push(MemberEvent::ObserversChanged(m.clone()));
                }
            }
        }
    }
    for b in &before.members {
        if !after.members.iter().any(|m| m.address == b.address) {
            events.push(MemberEvent::Removed(b.address.clone()));
        }
    }
    events
}

fn status_event(m: &Member) -> Option<MemberEvent> {
    Some(match m.status {
        MemberStatus::Up => MemberEvent::Up(m.clone()),
        MemberStatus::Leaving => MemberEvent::Leaving(m.clone()),
        MemberStatus::Exiting => MemberEvent::Exited(m.clone()),
        MemberStatus::Down => MemberEvent::Downed(m.clone()),
        MemberStatus::Joining | MemberStatus::Removed => return None,
    })
}
