//! Gossip, failure-detector, formation and downing settings (`[membership]`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Gossip and failure-detector settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MembershipSettings {
    /// How often chitchat gossips with peers (and how often membership is re-read).
    #[serde(with = "humantime_serde")]
    pub gossip_interval: Duration,
    /// Phi threshold of the failure detector; with chitchat phi is `elapsed / mean interval`, so
    /// the detection time is about `phi × mean heartbeat inter-arrival`.
    pub phi_threshold: f64,
    /// Prior mean heartbeat interval of a new peer; keep it close to `gossip_interval`
    /// (chitchat's own default of 5 s slows detection for minutes).
    #[serde(with = "humantime_serde")]
    pub initial_interval: Duration,
    /// How long a dead node's gossip state is kept before it is forgotten.
    #[serde(with = "humantime_serde")]
    pub dead_node_grace_period: Duration,
    /// When this node's first seed is its own gossip address, it forms a new cluster by itself
    /// if no member answers within this time.
    #[serde(with = "humantime_serde")]
    pub seed_node_timeout: Duration,
    /// Safe formation for nodes that all get the same seeds (a DNS name of every node, a list
    /// of all of them): when at least this many nodes (this one included) gossip with one
    /// another and none is a member yet, the one with the lowest advertised gossip address
    /// forms the cluster once that set has been stable for `bootstrap_stable_margin`; the
    /// others join it. No node is a "first seed" then. 0 (the default): off, and a node whose
    /// first seed is itself forms the cluster after `seed_node_timeout`.
    pub bootstrap_contact_points: usize,
    /// How long the set of nodes gossiping must stay the same before the lowest forms a
    /// cluster (with `bootstrap_contact_points`).
    #[serde(with = "humantime_serde")]
    pub bootstrap_stable_margin: Duration,
    /// How long a leaving node keeps gossiping its final status so every member sees it removed.
    #[serde(with = "humantime_serde")]
    pub leave_linger: Duration,
    /// How long a leaving node waits for a majority of the members that stay to take its
    /// replica's values (after its shards were handed off, before it exits).
    #[serde(with = "humantime_serde")]
    pub leave_hand_over_timeout: Duration,
    /// With a cluster secret: how far a gossip datagram's stamp (its sender's wall clock) may be
    /// from this node's clock. Older datagrams — captures replayed later — are dropped, and a
    /// datagram is taken once inside the window. Members' clocks must agree within it.
    #[serde(with = "humantime_serde")]
    pub gossip_freshness_window: Duration,
    /// With a cluster secret: seal gossip without stamps and take unstamped datagrams too, for
    /// upgrading a cluster that runs a release before stamps (two rolling restarts: first with
    /// this on, then with it off). While on, replayed gossip is not refused.
    pub accept_unstamped_gossip: bool,
    /// Automatic downing of unreachable members: which side of a split keeps running.
    pub downing: DowningStrategy,
    /// Only members with this role count when a strategy compares the sides of a split (the
    /// others go with their side). Unset: every member.
    pub downing_role: Option<String>,
    /// `static-quorum`: members (with `downing_role`) a side needs to keep running. Required
    /// (at least 1) with that strategy; the cluster must not grow past `quorum_size × 2 − 1`
    /// members, or both sides of a split could hold a quorum (the resolver then downs all).
    pub quorum_size: usize,
    /// `keep-oldest`: when the oldest member is alone on its side and the other side has at
    /// least two members, the oldest goes and the others keep running (a crashed oldest then
    /// does not stop the whole cluster).
    pub down_if_alone: bool,
    /// The resolver decides once the set of unreachable members (and the reachability table)
    /// has not changed for this long.
    #[serde(with = "humantime_serde")]
    pub stable_after: Duration,
    /// When reachability keeps changing so no decision is made within `stable_after` plus this
    /// long of the first change (a flapping link), every member is downed. `"on"`:
    /// `stable_after` × 3/4, at least 4 s; `"off"`; or a duration.
    pub down_all_when_unstable: DownAllWhenUnstable,
    /// A downed member stays listed (as Down) this long before it is removed: its shards and
    /// singletons move only then, giving the losing side time to stop its own.
    #[serde(with = "humantime_serde")]
    pub down_removal_margin: Duration,
}

/// How unreachable members are downed: which side of a split keeps running (the others down
/// themselves). README: "Which split-brain strategy".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum DowningStrategy {
    /// The side with more members (tie: the side with the lowest address) downs the other; the
    /// losing side downs itself.
    KeepMajority,
    /// The side with at least [`MembershipSettings::quorum_size`] members keeps running; a side
    /// with fewer downs itself (both, when neither has a quorum).
    StaticQuorum,
    /// The side with the oldest member keeps running, whatever its size (see
    /// [`MembershipSettings::down_if_alone`]).
    KeepOldest,
    /// Every member is downed when any becomes unreachable: the whole cluster stops and is
    /// restarted by its operator.
    DownAll,
    /// Never down automatically (an unreachable member stays until it comes back or leaves).
    Off,
}

/// When the resolver gives up on a reachability picture that never settles
/// ([`MembershipSettings::down_all_when_unstable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DownAllWhenUnstable {
    /// After `stable_after` × 3/4 more, at least 4 s (Akka's default: the detectors of a
    /// clean partition report over a second or two, and each report restarts the clock).
    On,
    /// Never: a flapping link can hold decisions off indefinitely.
    Off,
    /// After this much more than `stable_after`.
    After(Duration),
}

impl DownAllWhenUnstable {
    /// The time past `stable_after` after which everyone is downed, if ever.
    pub fn after(self, stable_after: Duration) -> Option<Duration> {
        match self {
            DownAllWhenUnstable::On => Some((stable_after * 3 / 4).max(Duration::from_secs(4))),
            DownAllWhenUnstable::Off => None,
            DownAllWhenUnstable::After(d) => Some(d),
        }
    }
}

impl TryFrom<String> for DownAllWhenUnstable {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        match s.as_str() {
            "on" => Ok(DownAllWhenUnstable::On),
            "off" => Ok(DownAllWhenUnstable::Off),
            d => humantime_serde::re::humantime::parse_duration(d)
                .map(DownAllWhenUnstable::After)
                .map_err(|e| format!("down_all_when_unstable must be \"on\", \"off\" or a duration: {e}")),
        }
    }
}

impl From<DownAllWhenUnstable> for String {
    fn from(d: DownAllWhenUnstable) -> String {
        match d {
            DownAllWhenUnstable::On => "on".into(),
            DownAllWhenUnstable::Off => "off".into(),
            DownAllWhenUnstable::After(d) => humantime_serde::re::humantime::format_duration(d).to_string(),
        }
    }
}

impl Default for MembershipSettings {
    fn default() -> Self {
        MembershipSettings {
            gossip_interval: Duration::from_millis(150),
            phi_threshold: 10.0,
            initial_interval: Duration::from_millis(150),
            dead_node_grace_period: Duration::from_secs(3600),
            seed_node_timeout: Duration::from_secs(5),
            bootstrap_contact_points: 0,
            bootstrap_stable_margin: Duration::from_secs(5),
            leave_linger: Duration::from_millis(1000),
            leave_hand_over_timeout: Duration::from_secs(10),
            gossip_freshness_window: Duration::from_secs(30),
            accept_unstamped_gossip: false,
            downing: DowningStrategy::KeepMajority,
            downing_role: None,
            quorum_size: 0,
            down_if_alone: true,
            stable_after: Duration::from_secs(5),
            down_all_when_unstable: DownAllWhenUnstable::On,
            down_removal_margin: Duration::from_secs(5),
        }
    }
}
