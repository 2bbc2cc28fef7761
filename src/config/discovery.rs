//! Where a node looks for the nodes to join through (`[discovery]`), besides `seeds`.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Discovery settings: DNS SRV names, and how often every source (these and `seeds`) is asked
/// again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoverySettings {
    /// DNS SRV names whose records give the gossip address (target and port) of every node,
    /// e.g. `_gossip._udp.ddshard.shop.svc.cluster.local` for a Kubernetes headless service
    /// with a port named `gossip`. Every node may be given the same names; formation then
    /// needs `membership.bootstrap_contact_points` (or a first seed).
    pub srv_names: Vec<String>,
    /// The DNS server the SRV names are asked of (`ip:port`); unset: the system's
    /// (`/etc/resolv.conf`).
    pub dns_server: Option<SocketAddr>,
    /// How often every source is asked again while this node sees no other live node (it is
    /// joining, or cut off from everyone): a seed rescheduled to a new IP is found within this
    /// plus its DNS TTL. Failed lookups back off from here to `refresh_interval`.
    #[serde(with = "humantime_serde")]
    pub lookup_interval: Duration,
    /// How often every source is asked again while this node sees other live nodes; found
    /// nodes that are not live in gossip are contacted then (two groups that lost each other
    /// find each other again).
    #[serde(with = "humantime_serde")]
    pub refresh_interval: Duration,
    /// How long one name of `seeds` may take to resolve (a slower one counts as failed and hides
    /// no other seed); a custom source gets a second more. SRV lookups try twice, 2 s each.
    #[serde(with = "humantime_serde")]
    pub lookup_timeout: Duration,
    /// At most this many found addresses are contacted (the lowest ones); the rest are counted
    /// and logged, so a source returning thousands cannot turn this node into a flood.
    pub max_contact_points: usize,
}

impl Default for DiscoverySettings {
    fn default() -> Self {
        DiscoverySettings {
            srv_names: Vec::new(),
            dns_server: None,
            lookup_interval: Duration::from_secs(1),
            refresh_interval: Duration::from_secs(30),
            lookup_timeout: Duration::from_secs(5),
            max_contact_points: 64,
        }
    }
}

impl DiscoverySettings {
    /// The largest `max_contact_points`.
    pub const MAX_CONTACT_POINTS: usize = 1024;

    /// Checks these settings (called by [`super::NodeConfig::validate`]).
    pub(crate) fn validate(&self) -> crate::error::Result<()> {
        let bad = |m: String| Err(crate::error::Error::Config(m));
        for name in &self.srv_names {
            if !super::is_host_name(name, true) {
                return bad(format!("discovery.srv_names: {name:?} is not a DNS name"));
            }
        }
        if self.srv_names.len() > 16 {
            return bad("discovery.srv_names holds at most 16 names".into());
        }
        if self.dns_server.is_some_and(|a| a.ip().is_unspecified() || a.port() == 0) {
            return bad("discovery.dns_server must be a reachable ip:port".into());
        }
        if !(1..=Self::MAX_CONTACT_POINTS).contains(&self.max_contact_points) {
            return bad(format!("discovery.max_contact_points must be 1 to {}", Self::MAX_CONTACT_POINTS));
        }
        for (name, d) in [
            ("discovery.lookup_interval", self.lookup_interval),
            ("discovery.refresh_interval", self.refresh_interval),
            ("discovery.lookup_timeout", self.lookup_timeout),
        ] {
            if d.is_zero() || d > Duration::from_secs(3600) {
                return bad(format!("{name} must be more than 0 and at most 1 h"));
            }
        }
        if self.refresh_interval < self.lookup_interval {
            return bad("discovery.refresh_interval must be at least discovery.lookup_interval".into());
        }
        Ok(())
    }
}
