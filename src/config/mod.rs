//! Node configuration: plain serde structs with defaults that mirror `config/default.toml`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::secret::ClusterSecret;

mod discovery;
pub(crate) mod limits;
mod membership;
pub use discovery::DiscoverySettings;
pub use limits::MAX_SETTING_DURATION;
pub(crate) use limits::check_durations;
pub use membership::{DownAllWhenUnstable, DowningStrategy, MembershipSettings};

/// Longest `node_id` or `cluster_id`, in bytes (so a handshake always fits its small first frame).
pub const MAX_ID_LEN: usize = 200;

/// Everything a node needs to start. Build it with struct-update syntax over
/// [`NodeConfig::default`], or load it from TOML with [`NodeConfig::from_toml_str`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Stable id of this node, unique in the cluster. It survives restarts; each restart is a new
    /// incarnation (generation) of it.
    pub node_id: String,
    /// Nodes with another cluster id are never admitted (gossip and messaging both check it).
    pub cluster_id: String,
    /// The secret every member shares: gossip datagrams carry a MAC keyed by it and messaging
    /// connections authenticate with it (Noise, pre-shared key) and are encrypted. Also read
    /// from the environment variable `DDSHARD_CLUSTER_SECRET` by [`NodeConfig::apply_env`].
    /// Without one a node may bind only loopback addresses unless `insecure` is set.
    pub cluster_secret: Option<ClusterSecret>,
    /// Further secrets whose gossip and connections this node accepts, never using them itself:
    /// for rotating the secret without an outage (README, "Rotating the cluster secret"). Also
    /// read from `DDSHARD_ACCEPTED_CLUSTER_SECRETS` (comma-separated) by
    /// [`NodeConfig::apply_env`]. Requires `cluster_secret`; at most 3.
    pub accepted_cluster_secrets: Vec<ClusterSecret>,
    /// Allows binding non-loopback addresses without a `cluster_secret`: anyone who can reach
    /// the ports can then join and speak as a member. Logged loudly at start.
    pub insecure: bool,
    /// UDP address for gossip (chitchat). Port 0 picks a free port; [`crate::Node::gossip_addr`]
    /// reports the bound one.
    pub gossip_addr: SocketAddr,
    /// TCP address for node-to-node messages. Port 0 picks a free port.
    pub messaging_addr: SocketAddr,
    /// The gossip address peers reach this node at, when it is not `gossip_addr`: behind NAT,
    /// in a container with a published port, or with `gossip_addr` on `0.0.0.0` / `[::]`
    /// (then it is required). Port 0: the port bound.
    pub gossip_advertise: Option<SocketAddr>,
    /// The messaging address peers reach this node at, when it is not `messaging_addr` (as for
    /// `gossip_advertise`).
    pub messaging_advertise: Option<SocketAddr>,
    /// Gossip addresses of existing members to join through: `ip:port`, or `host:port` (a DNS
    /// name, e.g. a Kubernetes headless service, or a hosts-file name; every address of it),
    /// looked up again every `discovery.lookup_interval` while this node is alone, so a seed
    /// rescheduled to a new IP is found again. When the first
    /// seed is this node's own gossip address (or a name resolving to it), this node forms the
    /// cluster if nobody answers within `membership.seed_node_timeout`. Empty (and no
    /// `discovery.srv_names`): this node forms a new cluster by itself.
    pub seeds: Vec<SeedAddr>,
    /// Other sources of nodes to join through (DNS SRV), and how often every source is asked.
    pub discovery: DiscoverySettings,
    /// Roles of this node; sharded types and replicated data can be limited to a role.
    pub roles: Vec<String>,
    /// The version of the application this node runs (`"2"`, `"1.4.0"`, `"v1.4.0-rc.1"`),
    /// gossiped to every member. Raise it with every release you roll out: while the regions of
    /// a type run different versions, new and moved shards go only to the newest and nothing is
    /// rebalanced, so each shard moves once per rolling update. Default `0.0.0`.
    pub app_version: crate::app_version::AppVersion,
    /// Directory for durable data (LMDB). Created if missing; never derived from a port.
    pub data_dir: PathBuf,
    /// Gossip membership and failure detection.
    pub membership: MembershipSettings,
    /// Heartbeats over the message path and the phi-accrual detector that judges them.
    pub failure_detector: crate::membership::FailureDetectorSettings,
    /// Node-to-node messaging.
    pub transport: TransportSettings,
    /// The distributed-data replicator.
    pub replicator: ReplicatorSettings,
    /// The settings of sharded entity types (`[sharding]`): what
    /// [`crate::Sharding::settings`] returns to start a type with; the `ddshard` binary starts
    /// its types with them.
    pub sharding: crate::sharding::settings::ShardingSettings,
    /// What [`crate::Node::readiness`] (and `/ready`) forgives.
    pub readiness: ReadinessSettings,
}

/// The address peers reach a socket bound at `bound` at: `advertise` when set (its port 0
/// meaning the bound port), else the bound address itself, which must then be a specific one.
pub(crate) fn advertised_addr(bound: SocketAddr, advertise: Option<SocketAddr>) -> Result<SocketAddr> {
    match advertise {
        Some(a) if a.port() == 0 => Ok(SocketAddr::new(a.ip(), bound.port())),
        Some(a) => Ok(a),
        None if bound.ip().is_unspecified() => Err(Error::BadAddress(bound)),
        None => Ok(bound),
    }
}

/// A seed's address: an IP socket address, or a host name and port resolved through the
/// system resolver (DNS, `/etc/hosts`). Written as text, `10.0.0.7:7000`, `[fd00::7]:7000` or
/// `ddshard-0.ddshard.shop.svc:7000`; anything else is a config error naming it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SeedAddr(String);

impl SeedAddr {
    /// The address, when it is an IP literal (no resolution needed).
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.0.parse().ok()
    }

    /// The address as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for SeedAddr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| Err(Error::Config(format!("seed {s:?}: {why} (write ip:port or host:port)")));
        if s.parse::<SocketAddr>().is_ok() {
            return Ok(SeedAddr(s.to_string()));
        }
        let Some((host, port)) = s.rsplit_once(':') else { return bad("no port") };
        if !port.parse::<u16>().is_ok_and(|p| p > 0) {
            return bad("the port is not 1 to 65535");
        }
        if !is_host_name(host, false) {
            return bad("not an IP address nor a valid host name");
        }
        Ok(SeedAddr(s.to_string()))
    }
}

/// Whether `name` is a host name (labels of letters, digits and `-`; a trailing dot allowed),
/// or with `service_labels` an SRV name, whose labels may also start with `_` (`_gossip._udp.…`).
pub(crate) fn is_host_name(name: &str, service_labels: bool) -> bool {
    let label_ok = |l: &str| {
        let whole = l.len();
        let l = if service_labels { l.strip_prefix('_').unwrap_or(l) } else { l };
        !l.is_empty()
            && whole <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty() && name.len() <= 253 && name.split('.').all(label_ok)
}

impl TryFrom<String> for SeedAddr {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<SeedAddr> for String {
    fn from(s: SeedAddr) -> String {
        s.0
    }
}

impl From<SocketAddr> for SeedAddr {
    fn from(addr: SocketAddr) -> Self {
        SeedAddr(addr.to_string())
    }
}

impl std::fmt::Display for SeedAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Readiness settings (`[readiness]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReadinessSettings {
    /// Once a node was ready, how long a region of it may be without a coordinator (while the
    /// coordinator moves to another node) before the node reports unready.
    #[serde(with = "humantime_serde")]
    pub coordinator_grace: Duration,
}

impl Default for ReadinessSettings {
    fn default() -> Self {
        ReadinessSettings { coordinator_grace: Duration::from_secs(30) }
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            node_id: String::new(),
            cluster_id: "ddshard".into(),
            cluster_secret: None,
            accepted_cluster_secrets: Vec::new(),
            insecure: false,
            gossip_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            messaging_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            gossip_advertise: None,
            messaging_advertise: None,
            seeds: Vec::new(),
            discovery: DiscoverySettings::default(),
            roles: Vec::new(),
            app_version: crate::app_version::AppVersion::ZERO,
            data_dir: PathBuf::from("ddshard-data"),
            membership: MembershipSettings::default(),
            failure_detector: crate::membership::FailureDetectorSettings::default(),
            transport: TransportSettings::default(),
            replicator: ReplicatorSettings::default(),
            sharding: crate::sharding::settings::ShardingSettings::default(),
            readiness: ReadinessSettings::default(),
        }
    }
}

/// Settings that hold secrets: never overridden (`--set` puts them on a command line).
const SECRET_SETTINGS: [&str; 2] = ["cluster_secret", "accepted_cluster_secrets"];

/// A TOML error as a config error: its message and where, never the text around it (a snippet
/// of a config file can hold a secret).
fn toml_error(text: &str, e: &toml::de::Error) -> Error {
    match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            Error::Config(format!("line {line}: {}", e.message()))
        }
        None => Error::Config(e.message().to_string()),
    }
}

/// The setting's dotted path an override variable names (`DDSHARD__A__B_C` → `a.b_c`).
fn override_path_of_env_var(name: &str) -> Option<String> {
    let rest = name.strip_prefix(NodeConfig::OVERRIDE_ENV_PREFIX)?;
    Some(rest.split("__").map(str::to_ascii_lowercase).collect::<Vec<_>>().join("."))
}

/// Sets `raw` at the dotted `path` of `table`, typed after the default found at that path.
fn set_override(table: &mut toml::Table, defaults: &toml::Table, path: &str, raw: &str) -> Result<()> {
    if SECRET_SETTINGS.contains(&path) {
        // Never on a command line (visible to every local user) nor echoed in an error.
        return Err(Error::Config(format!(
            "{path} cannot be overridden; give it in {} or {}, or in the config file",
            NodeConfig::SECRET_ENV,
            NodeConfig::ACCEPTED_SECRETS_ENV
        )));
    }
    let bad = |why: &str| Error::Config(format!("override {path}={raw:?}: {why}"));
    let keys: Vec<&str> = path.split('.').collect();
    if keys.iter().any(|k| k.is_empty()) {
        return Err(bad("the setting's path has an empty part"));
    }
    let (last, parents) = keys.split_last().expect("split yields at least one part");
    let mut default = Some(defaults);
    let mut at = table;
    for key in parents {
        let here = default.and_then(|d| d.get(*key));
        if here.is_some_and(|d| !d.is_table()) {
            return Err(bad(&format!("{key} is a setting, not a section")));
        }
        default = here.and_then(toml::Value::as_table);
        let next = at.entry(key.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = next.as_table_mut().ok_or_else(|| bad(&format!("{key} is a setting, not a section")))?;
    }
    let value = match default.and_then(|d| d.get(*last)) {
        Some(toml::Value::Table(_)) => return Err(bad("that is a section, not a setting")),
        Some(toml::Value::String(_)) => toml::Value::String(raw.to_string()),
        Some(toml::Value::Array(_)) if !raw.trim_start().starts_with('[') => toml::Value::Array(
            raw.split(',').map(str::trim).filter(|x| !x.is_empty()).map(|x| toml::Value::String(x.into())).collect(),
        ),
        _ => match format!("v = {raw}").parse::<toml::Table>() {
            Ok(mut t) => t.remove("v").expect("the table holds the one key parsed"),
            Err(_) => toml::Value::String(raw.to_string()),
        },
    };
    at.insert(last.to_string(), value);
    Ok(())
}

/// Node-to-node messaging settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportSettings {
    /// Largest frame accepted or sent, in bytes. A peer announcing a larger one is disconnected.
    pub max_frame_size: usize,
    /// Frames queued per peer before sends fail with [`Error::SendQueueFull`].
    pub send_queue_capacity: usize,
    /// Bytes queued per peer before sends fail with [`Error::SendQueueFull`] (whichever of the
    /// two limits is reached first).
    pub send_queue_max_bytes: usize,
    /// A peer that could not be dialed for this long loses its writer: queued frames are
    /// dropped, its requests fail with `PeerUnavailable`, and the next send dials anew.
    #[serde(with = "humantime_serde")]
    pub unreachable_give_up: Duration,
    /// Established inbound connections held at once (counted once the dialer proved its keys,
    /// so connections still in their handshake never take a member's place); beyond it a new
    /// one is closed after its handshake and counted.
    pub max_inbound_connections: usize,
    /// Inbound connections in their handshake held at once; a new one beyond it evicts the
    /// oldest (so an outsider holding many, from many addresses, cannot lock members out).
    pub max_handshaking_connections: usize,
    /// Connections from one IP address that may be in their handshake at once; beyond it a new
    /// one is closed at once and counted.
    pub max_handshakes_per_ip: usize,
    /// An inbound connection that has not sent its first handshake frame within this is
    /// closed (a dialer sends it right after connecting; the whole handshake has
    /// `connect_timeout`, which also bounds this).
    #[serde(with = "humantime_serde")]
    pub first_frame_timeout: Duration,
    /// Time allowed for a TCP connect plus handshake.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// First reconnect delay; doubles up to `reconnect_backoff_max`.
    #[serde(with = "humantime_serde")]
    pub reconnect_backoff_min: Duration,
    /// Largest reconnect delay.
    #[serde(with = "humantime_serde")]
    pub reconnect_backoff_max: Duration,
    /// A peer that accepts no byte of a pending write for this long is disconnected (its queued
    /// frames are lost, as on any broken connection) and dialed again.
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// TCP keepalive: an idle connection is probed after this long (then every third of it,
    /// three times), so a vanished peer's connection is closed instead of kept forever.
    #[serde(with = "humantime_serde")]
    pub keepalive: Duration,
}

impl Default for TransportSettings {
    fn default() -> Self {
        TransportSettings {
            max_frame_size: 8 * 1024 * 1024,
            send_queue_capacity: 65_536,
            send_queue_max_bytes: 64 << 20,
            unreachable_give_up: Duration::from_secs(30),
            max_inbound_connections: 1024,
            max_handshaking_connections: 64,
            max_handshakes_per_ip: 32,
            first_frame_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(3),
            reconnect_backoff_min: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_secs(2),
            write_timeout: Duration::from_secs(10),
            keepalive: Duration::from_secs(15),
        }
    }
}

/// Distributed-data replicator settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicatorSettings {
    /// How often the replicator compares digests with one random peer (anti-entropy).
    #[serde(with = "humantime_serde")]
    pub gossip_interval: Duration,
    /// How often deltas of local (`Consistency::Local`) updates are shipped to the other
    /// replicas. Majority updates ship theirs at once.
    #[serde(with = "humantime_serde")]
    pub delta_interval: Duration,
    /// Byte budget of one anti-entropy or delta message (a single value over it still goes
    /// alone); at most half of `transport.max_frame_size` is used.
    pub max_gossip_message_bytes: usize,
    /// Keys starting with one of these prefixes are durable: written to LMDB before an update is
    /// acknowledged and loaded before the replicator serves anything.
    pub durable_key_prefixes: Vec<String>,
    /// Initial size of the LMDB memory map in bytes (virtual; the file grows as needed up to it).
    pub lmdb_map_size: usize,
    /// A full map is doubled up to this size; past it, commits fail (typed error, unhealthy
    /// store) until space is freed or the limit raised.
    pub lmdb_max_map_size: usize,
    /// Only members with this role hold replicas (empty: every member).
    pub role: Option<String>,
    /// A replica holder that has been absent (downed, crashed, not back) this long leaves the
    /// roster that durable quorums are counted over, so a cluster that lost it for good serves
    /// its durable shards again; what only its disk held is given up. `0s`: only an operator
    /// forgets (`ddshard admin forget`). See DESIGN.md, "quorums over a durable roster".
    #[serde(with = "humantime_serde")]
    pub forget_absent_after: Duration,
}

impl Default for ReplicatorSettings {
    fn default() -> Self {
        ReplicatorSettings {
            gossip_interval: Duration::from_millis(500),
            delta_interval: Duration::from_millis(50),
            max_gossip_message_bytes: 1 << 20,
            durable_key_prefixes: vec!["shard-".into(), "durable-".into()],
            lmdb_map_size: 4 << 30,
            lmdb_max_map_size: 64 << 30,
            role: None,
            forget_absent_after: Duration::from_secs(30 * 60),
        }
    }
}

impl NodeConfig {
    /// Parses a TOML document (the format of `config/default.toml`); missing settings keep their
    /// defaults, unknown ones are an error.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| toml_error(text, &e))
    }

    /// Reads and parses a TOML file.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading config {}", path.display()), e))?;
        Self::from_toml_str(&text)
    }

    /// Parses TOML text, then sets each of `overrides` in order (a later one wins): a setting's
    /// dotted path as in the file (`node_id`, `membership.stable_after`,
    /// `sharding.allocation.strategy`) and its value as text. So one file serves every node of
    /// a cluster and each node passes what differs (`ddshard node --set node_id=n2`, or the
    /// `DDSHARD__…` variables of [`NodeConfig::overrides_from_env`]).
    ///
    /// A value is read as the setting's type asks: for a text setting (ids, addresses,
    /// durations such as `2s`) the text as it is; for a list, TOML (`["a", "b"]`) or items
    /// separated by commas (`127.0.0.1:7000,127.0.0.1:7001`); otherwise a TOML value (`3`,
    /// `true`, `0.5`), or the text when it is not one (an unset optional setting like `role`).
    /// An unknown setting or a value of the wrong type is an [`Error::Config`] naming it.
    pub fn from_toml_str_with_overrides(text: &str, overrides: &[(String, String)]) -> Result<Self> {
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| toml_error(text, &e))?;
        let defaults = toml::Table::try_from(NodeConfig::default())
            .map_err(|e| Error::Config(format!("the defaults as TOML: {e}")))?;
        for (path, raw) in overrides {
            set_override(&mut table, &defaults, path, raw)?;
        }
        toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| {
            let set: Vec<&str> = overrides.iter().map(|(p, _)| p.as_str()).collect();
            Error::Config(format!("{} (settings overridden: {set:?})", e.message()))
        })
    }

    /// The replicator's largest message: `replicator.max_gossip_message_bytes`, capped at half
    /// of `transport.max_frame_size`. It is also the budget of one replicated slot (a shard's
    /// remembered-id or state key), so a slot always fits one message whole.
    pub(crate) fn replicator_message_bytes(&self) -> usize {
        self.replicator.max_gossip_message_bytes.min(self.transport.max_frame_size / 2)
    }

    /// Prefix of the environment variables [`NodeConfig::overrides_from_env`] reads.
    pub const OVERRIDE_ENV_PREFIX: &'static str = "DDSHARD__";

    /// The overrides set in the environment, in name order: `DDSHARD__` and then a setting's
    /// dotted path with `__` for each dot, in any case (`DDSHARD__NODE_ID=n2`,
    /// `DDSHARD__MEMBERSHIP__STABLE_AFTER=2s`, `DDSHARD__SHARDING__ALLOCATION__STRATEGY=…`).
    pub fn overrides_from_env() -> Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str() else { continue };
            let Some(path) = override_path_of_env_var(name) else { continue };
            let value = value
                .into_string()
                .map_err(|_| Error::Config(format!("environment variable {name} is not valid UTF-8")))?;
            out.push((path, value));
        }
        out.sort();
        Ok(out)
    }

    /// Splits one `path=value` argument (as `ddshard node --set` takes it) at its first `=`.
    pub fn parse_override(arg: &str) -> Result<(String, String)> {
        match arg.split_once('=') {
            Some((path, value)) if !path.trim().is_empty() => Ok((path.trim().to_string(), value.to_string())),
            _ => Err(Error::Config(format!("override {arg:?} must be KEY=VALUE, e.g. membership.stable_after=2s"))),
        }
    }

    /// Name of the environment variable [`NodeConfig::apply_env`] reads the secret from.
    pub const SECRET_ENV: &'static str = "DDSHARD_CLUSTER_SECRET";

    /// Name of the environment variable [`NodeConfig::apply_env`] reads the accepted secrets
    /// from (comma-separated).
    pub const ACCEPTED_SECRETS_ENV: &'static str = "DDSHARD_ACCEPTED_CLUSTER_SECRETS";

    /// Takes `cluster_secret` from the environment variable `DDSHARD_CLUSTER_SECRET` and
    /// `accepted_cluster_secrets` from `DDSHARD_ACCEPTED_CLUSTER_SECRETS` (comma-separated)
    /// when they are set (they win over the file, so secrets need not be written into one).
    /// `ddshard node` calls this; a library user calls it if they want the same.
    pub fn apply_env(&mut self) -> Result<()> {
        let read = |name: &str| match std::env::var(name) {
            Ok(s) => Ok(Some(s)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::Config(format!("{name} is not valid UTF-8"))),
        };
        if let Some(s) = read(Self::SECRET_ENV)? {
            self.cluster_secret = Some(ClusterSecret::new(s)?);
        }
        if let Some(list) = read(Self::ACCEPTED_SECRETS_ENV)? {
            self.accepted_cluster_secrets =
                list.split(',').filter(|s| !s.is_empty()).map(ClusterSecret::new).collect::<Result<_>>()?;
        }
        Ok(())
    }

    /// The secrets this node accepts, the one it uses first (empty: no secret).
    pub(crate) fn secrets(&self) -> Vec<ClusterSecret> {
        self.cluster_secret.iter().chain(&self.accepted_cluster_secrets).cloned().collect()
    }

    /// Whether this node binds an address another host could reach without a cluster secret
    /// (allowed only with `insecure = true`).
    pub fn is_exposed_without_secret(&self) -> bool {
        self.cluster_secret.is_none()
            && !(self.gossip_addr.ip().is_loopback() && self.messaging_addr.ip().is_loopback())
    }

    /// Checks every setting; [`crate::Node::start`] calls it first.
    pub fn validate(&self) -> Result<()> {
        self.validate_with_sources(false)
    }

    /// [`NodeConfig::validate`] for a node that also has discovery sources of its own
    /// ([`crate::NodeBuilder::discovery`]), which count as finding nodes as `seeds` do.
    pub(crate) fn validate_with_sources(&self, custom_sources: bool) -> Result<()> {
        self.validate_identity()?;
        self.validate_membership(custom_sources)?;
        check_durations(&self.durations())?;
        self.validate_timing()?;
        validate_transport(&self.transport)?;
        self.validate_replicator()?;
        self.sharding.validate()
    }

    /// Names, addresses, roles and secrets.
    fn validate_identity(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.node_id.is_empty() || self.node_id.len() > MAX_ID_LEN {
            return bad("node_id must be 1 to 200 characters".into());
        }
        if self.node_id.contains(['/', '#', ',']) || self.node_id.chars().any(char::is_whitespace) {
            return bad(format!("node_id {:?} must not contain '/', '#', ',' or white space", self.node_id));
        }
        if self.cluster_id.is_empty() || self.cluster_id.len() > MAX_ID_LEN {
            // Bounded so a handshake always fits in the transport's small first-frame limit.
            return bad("cluster_id must be 1 to 200 characters".into());
        }
        if self.is_exposed_without_secret() && !self.insecure {
            return bad(format!(
                "gossip_addr {} / messaging_addr {}: a node that binds a non-loopback address needs a \
                 cluster_secret (or DDSHARD_CLUSTER_SECRET); set insecure = true to run an open cluster anyway",
                self.gossip_addr, self.messaging_addr
            ));
        }
        for (bound, advertise, names) in [
            (self.gossip_addr, self.gossip_advertise, ("gossip_addr", "gossip_advertise")),
            (self.messaging_addr, self.messaging_advertise, ("messaging_addr", "messaging_advertise")),
        ] {
            if advertise.is_some_and(|a| a.ip().is_unspecified()) {
                return bad(format!("{}: peers cannot reach an unspecified address", names.1));
            }
            if bound.ip().is_unspecified() && advertise.is_none() {
                return bad(format!(
                    "{} = {bound} binds every interface: set {} to the address peers reach this node at",
                    names.0, names.1
                ));
            }
        }
        if self.roles.iter().any(|r| r.is_empty() || r.contains(',')) {
            return bad("roles must be non-empty and must not contain ','".into());
        }
        if !self.accepted_cluster_secrets.is_empty() && self.cluster_secret.is_none() {
            return bad("accepted_cluster_secrets needs a cluster_secret (the one this node uses)".into());
        }
        if self.accepted_cluster_secrets.len() > 3 {
            return bad("accepted_cluster_secrets holds at most 3 secrets".into());
        }
        Ok(())
    }

    /// Downing and how nodes are found.
    fn validate_membership(&self, custom_sources: bool) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        let m = &self.membership;
        if m.downing == DowningStrategy::StaticQuorum && m.quorum_size == 0 {
            return bad("membership.quorum_size must be at least 1 with downing = \"static-quorum\"".into());
        }
        self.discovery.validate()?;
        let discovers = !self.seeds.is_empty() || !self.discovery.srv_names.is_empty() || custom_sources;
        if m.bootstrap_contact_points > 0 && !discovers {
            return bad(
                "membership.bootstrap_contact_points needs seeds or discovery.srv_names (where the nodes are found)"
                    .into(),
            );
        }
        let other_sources = custom_sources || !self.discovery.srv_names.is_empty();
        if other_sources && self.seeds.is_empty() && m.bootstrap_contact_points == 0 {
            return bad("discovery.srv_names (or a discovery source) without seeds needs \
                 membership.bootstrap_contact_points: how many nodes must be found before the lowest of them \
                 forms the cluster"
                .into());
        }
        if m.bootstrap_contact_points > 1_000 {
            return bad("membership.bootstrap_contact_points must be at most 1000".into());
        }
        if m.downing_role.as_deref().is_some_and(|r| r.is_empty() || r.contains(',')) {
            return bad("membership.downing_role must be non-empty and must not contain ','".into());
        }
        Ok(())
    }

    /// Every duration setting, each bounded by [`check_durations`].
    fn durations(&self) -> [(&'static str, Duration); 24] {
        let (m, t, r) = (&self.membership, &self.transport, &self.replicator);
        [
            ("membership.gossip_interval", m.gossip_interval),
            ("membership.initial_interval", m.initial_interval),
            ("membership.dead_node_grace_period", m.dead_node_grace_period),
            ("membership.seed_node_timeout", m.seed_node_timeout),
            ("membership.bootstrap_stable_margin", m.bootstrap_stable_margin),
            ("membership.leave_linger", m.leave_linger),
            ("membership.leave_hand_over_timeout", m.leave_hand_over_timeout),
            ("membership.gossip_freshness_window", m.gossip_freshness_window),
            ("membership.stable_after", m.stable_after),
            ("membership.down_removal_margin", m.down_removal_margin),
            ("membership.down_all_when_unstable", m.down_all_when_unstable.after(m.stable_after).unwrap_or_default()),
            ("failure_detector.heartbeat_interval", self.failure_detector.heartbeat_interval),
            ("failure_detector.acceptable_pause", self.failure_detector.acceptable_pause),
            ("failure_detector.min_std_deviation", self.failure_detector.min_std_deviation),
            ("readiness.coordinator_grace", self.readiness.coordinator_grace),
            ("transport.connect_timeout", t.connect_timeout),
            ("transport.first_frame_timeout", t.first_frame_timeout),
            ("transport.reconnect_backoff_min", t.reconnect_backoff_min),
            ("transport.reconnect_backoff_max", t.reconnect_backoff_max),
            ("transport.write_timeout", t.write_timeout),
            ("transport.keepalive", t.keepalive),
            ("transport.unreachable_give_up", t.unreachable_give_up),
            ("replicator.gossip_interval", r.gossip_interval),
            ("replicator.delta_interval", r.delta_interval),
        ]
    }

    /// Gossip timing and failure detection.
    fn validate_timing(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        let m = &self.membership;
        if m.gossip_interval.is_zero() || m.initial_interval.is_zero() {
            return bad("membership.gossip_interval and initial_interval must be > 0".into());
        }
        if m.gossip_freshness_window < m.gossip_interval.saturating_mul(4) {
            return bad(format!(
                "membership.gossip_freshness_window ({:?}) must be at least 4 × membership.gossip_interval: \
                 a datagram in flight or queued must still be fresh when it arrives",
                m.gossip_freshness_window
            ));
        }
        if !(m.phi_threshold.is_finite() && m.phi_threshold > 1.0) {
            return bad("membership.phi_threshold must be > 1".into());
        }
        self.failure_detector.validate()
    }

    /// The durable store and its keys.
    fn validate_replicator(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.replicator.gossip_interval.is_zero() {
            return bad("replicator.gossip_interval must be > 0".into());
        }
        if self.replicator.lmdb_map_size < 1 << 20 {
            return bad("replicator.lmdb_map_size must be at least 1 MiB".into());
        }
        if self.replicator.lmdb_max_map_size < self.replicator.lmdb_map_size {
            return bad("replicator.lmdb_max_map_size must be at least replicator.lmdb_map_size".into());
        }
        if self.replicator.durable_key_prefixes.iter().any(String::is_empty) {
            return bad("replicator.durable_key_prefixes must not contain an empty prefix (it would make every key durable; list the prefixes)".into());
        }
        Ok(())
    }
}

/// Frame sizes, queues, connection budgets and timeouts of the messaging transport.
fn validate_transport(t: &TransportSettings) -> Result<()> {
    let bad = |m: String| Err(Error::Config(m));
    if !(1024..=1 << 30).contains(&t.max_frame_size) {
        return bad("transport.max_frame_size must be between 1 KiB and 1 GiB".into());
    }
    if t.send_queue_capacity == 0 {
        return bad("transport.send_queue_capacity must be > 0".into());
    }
    if t.send_queue_max_bytes < t.max_frame_size + 4 {
        return bad("transport.send_queue_max_bytes must hold at least one frame of max_frame_size".into());
    }
    if t.first_frame_timeout.is_zero() {
        return bad("transport.first_frame_timeout must be > 0".into());
    }
    if t.max_inbound_connections == 0 || t.max_handshakes_per_ip == 0 || t.max_handshaking_connections == 0 {
        return bad(
            "transport.max_inbound_connections, max_handshaking_connections and max_handshakes_per_ip must be > 0"
                .into(),
        );
    }
    if t.unreachable_give_up < t.connect_timeout {
        return bad("transport.unreachable_give_up must be at least transport.connect_timeout".into());
    }
    if t.reconnect_backoff_min.is_zero() || t.reconnect_backoff_max < t.reconnect_backoff_min {
        return bad("transport.reconnect_backoff_min must be > 0 and <= reconnect_backoff_max".into());
    }
    if t.write_timeout < Duration::from_millis(100) || t.keepalive < Duration::from_secs(1) {
        return bad("transport.write_timeout must be >= 100ms and transport.keepalive >= 1s".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::FailureDetectorSettings;

    /// `config/default.toml` documents every setting; it must parse to exactly the defaults.
    /// The grouped `[sharding]` tables are read, and a key of the flat layout before them is
    /// refused by name (a silently ignored `remember_entities = true` would forget entities).
    #[test]
    fn grouped_sharding_tables_are_read_and_a_flat_key_of_the_old_layout_is_refused_by_name() {
        let c = NodeConfig::from_toml_str(
            "[sharding.remember]\nenabled = true\nslots = 32\n[sharding.passivation]\nidle_timeout = \"5m\"\n\
             [sharding.coordinator]\nmajority_min_cap = 3\n[sharding.state]\nmax_bytes = 1024\n",
        )
        .unwrap();
        assert!(c.sharding.remember.enabled);
        assert_eq!(c.sharding.remember.slots, 32);
        assert_eq!(c.sharding.passivation.idle_timeout, Some(Duration::from_secs(300)));
        assert_eq!(c.sharding.coordinator.majority_min_cap, 3);
        assert_eq!(c.sharding.state.max_bytes, 1024);
        for old in ["remember_entities = true", "passivation_idle_timeout = \"5m\"", "state_slots = 8"] {
            let key = old.split(' ').next().unwrap();
            match NodeConfig::from_toml_str(&format!("[sharding]\n{old}\n")) {
                Err(Error::Config(m)) => assert!(m.contains(key), "{old}: {m}"),
                other => panic!("{old}: {other:?}"),
            }
        }
    }

    #[test]
    fn default_toml_documents_exactly_the_defaults() {
        let parsed = NodeConfig::from_toml_str(include_str!("../../config/default.toml")).unwrap();
        let a = toml::to_string(&parsed).unwrap();
        let b = toml::to_string(&NodeConfig::default()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn an_app_version_is_read_from_toml_and_overrides_and_a_malformed_one_is_an_error_naming_it() {
        let cfg = NodeConfig::from_toml_str("app_version = \"v2.1\"").unwrap();
        assert_eq!(cfg.app_version, crate::app_version::AppVersion::new(2, 1, 0));
        let overrides = [("app_version".to_string(), "3.0.0-rc.1".to_string())];
        let cfg = NodeConfig::from_toml_str_with_overrides("", &overrides).unwrap();
        assert_eq!(cfg.app_version.to_string(), "3.0.0-rc.1");
        assert_eq!(NodeConfig::default().app_version, crate::app_version::AppVersion::ZERO);
        for text in ["app_version = \"two\"", "app_version = \"1.2.3.4\""] {
            match NodeConfig::from_toml_str(text) {
                Err(Error::Config(m)) => {
                    assert!(m.contains("app_version") && m.contains(&text[15..text.len() - 1]), "{m}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_settings_are_typed_config_errors() {
        let ok = NodeConfig { node_id: "n1".into(), ..NodeConfig::default() };
        assert!(ok.validate().is_ok());
        for (cfg, what) in [
            (NodeConfig { node_id: String::new(), ..ok.clone() }, "node_id"),
            (NodeConfig { node_id: "a b".into(), ..ok.clone() }, "node_id"),
            (NodeConfig { cluster_id: String::new(), ..ok.clone() }, "cluster_id"),
            (NodeConfig { cluster_id: "c".repeat(201), ..ok.clone() }, "cluster_id"),
            (NodeConfig { roles: vec!["a,b".into()], ..ok.clone() }, "roles"),
            (NodeConfig { messaging_addr: "10.1.2.3:0".parse().unwrap(), ..ok.clone() }, "cluster_secret"),
            (NodeConfig { gossip_addr: "0.0.0.0:7000".parse().unwrap(), ..ok.clone() }, "cluster_secret"),
        ] {
            match cfg.validate() {
                Err(Error::Config(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("expected config error for {what}, got {other:?}"),
            }
        }
        let mut t = ok.clone();
        t.transport.max_frame_size = 10;
        assert!(matches!(t.validate(), Err(Error::Config(_))));
        let mut t = ok.clone();
        t.transport.send_queue_max_bytes = t.transport.max_frame_size;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("send_queue_max_bytes")));
        let mut t = ok.clone();
        t.transport.unreachable_give_up = t.transport.connect_timeout / 2;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("unreachable_give_up")));
        let mut t = ok.clone();
        t.transport.first_frame_timeout = Duration::ZERO;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("first_frame_timeout")));
        let mut t = ok.clone();
        t.transport.max_handshaking_connections = 0;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("max_handshaking_connections")));
        let mut t = ok.clone();
        t.transport.max_handshakes_per_ip = 0;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("max_handshakes_per_ip")));
        let mut t = ok.clone();
        t.membership.dead_node_grace_period = Duration::from_secs(u64::MAX);
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("dead_node_grace_period")));
        let mut t = ok.clone();
        t.sharding.ask_timeout = MAX_SETTING_DURATION + Duration::from_secs(1);
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("ask_timeout")));
        let mut t = ok.clone();
        t.accepted_cluster_secrets = vec![ClusterSecret::generate()];
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("needs a cluster_secret")));
        t.cluster_secret = Some(ClusterSecret::generate());
        assert!(t.validate().is_ok());
        assert_eq!(t.secrets().len(), 2, "its own first, then the accepted one");
        assert_eq!(t.secrets()[0], t.cluster_secret.clone().unwrap());
        t.accepted_cluster_secrets = (0..4).map(|_| ClusterSecret::generate()).collect();
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("at most 3")));
        let mut t = ok.clone();
        t.membership.gossip_freshness_window = t.membership.gossip_interval * 3;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("gossip_freshness_window")));
        t.membership.gossip_freshness_window = t.membership.gossip_interval * 4;
        assert!(t.validate().is_ok(), "four gossip rounds is the shortest window");
        let mut t = ok.clone();
        t.transport.write_timeout = Duration::ZERO;
        assert!(matches!(t.validate(), Err(Error::Config(m)) if m.contains("write_timeout")));
        assert!(matches!(NodeConfig::from_toml_str("no_such_setting = 1"), Err(Error::Config(_))));
        assert!(matches!(NodeConfig::from_toml_str("[membership]\ngossip_interval = \"soon\""), Err(Error::Config(_))));
    }

    #[test]
    fn failure_detector_settings_out_of_range_are_config_errors_naming_the_setting() {
        let ok = NodeConfig { node_id: "n1".into(), ..NodeConfig::default() };
        type Spoil = fn(&mut FailureDetectorSettings);
        let bad: [(Spoil, &str); 6] = [
            (|f| f.monitored_by = 0, "monitored_by"),
            (|f| f.monitored_by = 65, "monitored_by"),
            (|f| f.heartbeat_interval = Duration::from_millis(1), "heartbeat_interval"),
            (|f| f.threshold = f64::NAN, "threshold"),
            (|f| f.min_std_deviation = Duration::ZERO, "min_std_deviation"),
            (|f| f.max_sample_size = 1, "max_sample_size"),
        ];
        for (spoil, what) in bad {
            let mut c = ok.clone();
            spoil(&mut c.failure_detector);
            assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains(what)), "{what}");
        }
        let mut c = ok.clone();
        c.failure_detector.acceptable_pause = MAX_SETTING_DURATION * 2;
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("acceptable_pause")));
    }

    #[test]
    fn down_all_when_unstable_reads_on_off_or_a_duration() {
        let read = |v: &str| {
            NodeConfig::from_toml_str(&format!("[membership]\ndown_all_when_unstable = \"{v}\""))
                .map(|c| c.membership.down_all_when_unstable)
        };
        assert_eq!(read("on").unwrap(), DownAllWhenUnstable::On);
        assert_eq!(read("off").unwrap(), DownAllWhenUnstable::Off);
        assert_eq!(read("2s 500ms").unwrap(), DownAllWhenUnstable::After(Duration::from_millis(2_500)));
        assert!(matches!(read("sometimes"), Err(Error::Config(m)) if m.contains("down_all_when_unstable")));
        let stable = Duration::from_secs(8);
        assert_eq!(DownAllWhenUnstable::On.after(stable), Some(Duration::from_secs(6)));
        assert_eq!(DownAllWhenUnstable::On.after(Duration::from_secs(2)), Some(Duration::from_secs(4)), "floor");
        assert_eq!(DownAllWhenUnstable::Off.after(stable), None);
        assert_eq!(DownAllWhenUnstable::After(Duration::from_secs(1)).after(stable), Some(Duration::from_secs(1)));
        let round_trip = toml::to_string(&MembershipSettings {
            down_all_when_unstable: DownAllWhenUnstable::After(Duration::from_millis(2_500)),
            ..MembershipSettings::default()
        })
        .unwrap();
        assert!(round_trip.contains("down_all_when_unstable = \"2s 500ms\""), "{round_trip}");
    }

    #[test]
    fn split_brain_strategies_read_from_toml_and_static_quorum_needs_a_quorum_size() {
        let read = |body: &str| NodeConfig::from_toml_str(&format!("node_id = \"n1\"\n[membership]\n{body}"));
        let c = read("downing = \"static-quorum\"\nquorum_size = 3\ndowning_role = \"db\"").unwrap();
        assert_eq!(c.membership.downing, DowningStrategy::StaticQuorum);
        assert_eq!((c.membership.quorum_size, c.membership.downing_role.as_deref()), (3, Some("db")));
        assert!(c.validate().is_ok());
        let c = read("downing = \"keep-oldest\"\ndown_if_alone = false").unwrap();
        assert_eq!((c.membership.downing, c.membership.down_if_alone), (DowningStrategy::KeepOldest, false));
        assert_eq!(read("downing = \"down-all\"").unwrap().membership.downing, DowningStrategy::DownAll);
        assert!(matches!(read("downing = \"keep-referee\""), Err(Error::Config(_))));
        let no_quorum = read("downing = \"static-quorum\"").unwrap();
        assert!(matches!(no_quorum.validate(), Err(Error::Config(m)) if m.contains("quorum_size")));
        let bad_role = read("downing_role = \"a,b\"").unwrap();
        assert!(matches!(bad_role.validate(), Err(Error::Config(m)) if m.contains("downing_role")));
    }

    fn set(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn one_file_serves_every_node_with_overrides_typed_as_each_setting_asks() {
        let shared = "cluster_id = \"shop\"\nseeds = [\"127.0.0.1:7000\"]\n[membership]\nstable_after = \"9s\"\n\
                      [sharding.allocation]\nstrategy = \"least-shard\"\nabsolute_limit = 20\nrelative_limit = 0.1\n";
        let c = NodeConfig::from_toml_str_with_overrides(
            shared,
            &set(&[
                // A text setting keeps its text, even when it looks like a number.
                ("node_id", "2"),
                ("gossip_addr", "127.0.0.1:7001"),
                ("membership.stable_after", "2s"),
                ("membership.phi_threshold", "12.5"),
                ("insecure", "true"),
                ("seeds", "127.0.0.1:7000, 127.0.0.1:7002"),
                ("roles", "[\"db\", \"edge\"]"),
                ("sharding.number_of_shards", "64"),
                ("sharding.allocation.absolute_limit", "5"),
                // An optional setting with no default, unquoted.
                ("replicator.role", "db"),
            ]),
        )
        .unwrap();
        assert_eq!((c.node_id.as_str(), c.cluster_id.as_str()), ("2", "shop"), "the file's settings stay");
        assert_eq!(c.gossip_addr, "127.0.0.1:7001".parse().unwrap());
        assert_eq!(c.membership.stable_after, Duration::from_secs(2));
        assert_eq!(c.membership.phi_threshold, 12.5);
        assert!(c.insecure);
        let seeds: Vec<&str> = c.seeds.iter().map(SeedAddr::as_str).collect();
        assert_eq!(seeds, ["127.0.0.1:7000", "127.0.0.1:7002"]);
        assert_eq!(c.roles, ["db", "edge"]);
        assert_eq!(c.sharding.number_of_shards, 64);
        assert_eq!(
            c.sharding.allocation,
            crate::sharding::AllocationSettings::LeastShard { absolute_limit: 5, relative_limit: 0.1 }
        );
        assert_eq!(c.replicator.role.as_deref(), Some("db"));
        // Later overrides win over earlier ones.
        let c = NodeConfig::from_toml_str_with_overrides("", &set(&[("node_id", "a"), ("node_id", "b")])).unwrap();
        assert_eq!(c.node_id, "b");
    }

    #[test]
    fn overrides_of_unknown_settings_or_of_the_wrong_type_are_config_errors_naming_them() {
        let read = |pairs: &[(&str, &str)]| NodeConfig::from_toml_str_with_overrides("", &set(pairs));
        assert!(matches!(read(&[("no_such", "1")]), Err(Error::Config(m)) if m.contains("no_such")));
        assert!(matches!(read(&[("membership.nope", "1")]), Err(Error::Config(m)) if m.contains("nope")));
        assert!(
            matches!(read(&[("sharding.number_of_shards", "many")]), Err(Error::Config(m)) if m.contains("number_of_shards"))
        );
        assert!(matches!(read(&[("membership", "1")]), Err(Error::Config(m)) if m.contains("section")));
        assert!(matches!(read(&[("node_id.x", "1")]), Err(Error::Config(m)) if m.contains("not a section")));
        assert!(matches!(read(&[("membership..stable_after", "1s")]), Err(Error::Config(m)) if m.contains("empty")));
        assert!(matches!(read(&[("membership.stable_after", "soon")]), Err(Error::Config(_))));
    }

    #[test]
    fn override_arguments_and_environment_variable_names_map_to_setting_paths() {
        assert_eq!(NodeConfig::parse_override("a.b=c=d").unwrap(), ("a.b".into(), "c=d".into()));
        assert_eq!(NodeConfig::parse_override("roles=").unwrap(), ("roles".into(), String::new()));
        assert!(matches!(NodeConfig::parse_override("no-equals"), Err(Error::Config(_))));
        assert!(matches!(NodeConfig::parse_override("=1"), Err(Error::Config(_))));
        assert_eq!(override_path_of_env_var("DDSHARD__NODE_ID").as_deref(), Some("node_id"));
        assert_eq!(
            override_path_of_env_var("DDSHARD__SHARDING__ALLOCATION__STRATEGY").as_deref(),
            Some("sharding.allocation.strategy")
        );
        assert_eq!(
            override_path_of_env_var("DDSHARD__membership__stable_after").as_deref(),
            Some("membership.stable_after")
        );
        assert_eq!(override_path_of_env_var("DDSHARD_CLUSTER_SECRET"), None, "one underscore: not an override");
        assert_eq!(override_path_of_env_var("PATH"), None);
    }

    #[test]
    fn discovery_settings_are_checked_and_srv_names_alone_need_bootstrap_formation() {
        let ok = NodeConfig { node_id: "n1".into(), ..NodeConfig::default() };
        let with = |f: &dyn Fn(&mut NodeConfig)| {
            let mut c = ok.clone();
            f(&mut c);
            c.validate()
        };
        let srv = "_gossip._udp.ddshard.shop.svc.cluster.local".to_string();
        for (what, result) in [
            ("bootstrap_contact_points", with(&|c| c.discovery.srv_names = vec![srv.clone()])),
            ("is not a DNS name", with(&|c| c.discovery.srv_names = vec!["bad name".into()])),
            ("is not a DNS name", with(&|c| c.discovery.srv_names = vec!["a..b".into()])),
            ("at most 16", with(&|c| c.discovery.srv_names = vec![srv.clone(); 17])),
            ("dns_server", with(&|c| c.discovery.dns_server = Some("0.0.0.0:53".parse().unwrap()))),
            ("dns_server", with(&|c| c.discovery.dns_server = Some("10.0.0.1:0".parse().unwrap()))),
            ("max_contact_points", with(&|c| c.discovery.max_contact_points = 0)),
            ("max_contact_points", with(&|c| c.discovery.max_contact_points = 1025)),
            ("discovery.lookup_interval", with(&|c| c.discovery.lookup_interval = Duration::ZERO)),
            ("discovery.lookup_timeout", with(&|c| c.discovery.lookup_timeout = Duration::from_secs(3601))),
            (
                "at least discovery.lookup_interval",
                with(&|c| c.discovery.refresh_interval = Duration::from_millis(500)),
            ),
        ] {
            match result {
                Err(Error::Config(m)) => assert!(m.contains(what), "{what}: {m}"),
                other => panic!("{what}: expected a config error, got {other:?}"),
            }
        }
        with(&|c| {
            c.discovery.srv_names = vec![srv.clone(), "_ddshard._tcp.example.".into()];
            c.membership.bootstrap_contact_points = 3;
        })
        .expect("SRV names with bootstrap formation");
        with(&|c| {
            c.discovery.srv_names = vec![srv.clone()];
            c.seeds = vec!["10.0.0.1:7000".parse().unwrap()];
        })
        .expect("SRV names beside a first seed");
        // A builder's own source counts as finding nodes, and alone needs bootstrap formation too.
        let mut custom = ok.clone();
        assert!(
            matches!(custom.validate_with_sources(true), Err(Error::Config(m)) if m.contains("bootstrap_contact_points"))
        );
        custom.membership.bootstrap_contact_points = 3;
        assert!(custom.validate_with_sources(true).is_ok());
        assert!(custom.validate().is_err(), "without a source, bootstrap formation has nothing to find");
        let parsed = NodeConfig::from_toml_str(
            "node_id = \"n1\"\n[discovery]\nsrv_names = [\"_gossip._udp.x.svc\"]\ndns_server = \"10.0.0.10:53\"\n\
             lookup_interval = \"250ms\"\n",
        )
        .unwrap();
        assert_eq!(parsed.discovery.srv_names, ["_gossip._udp.x.svc"]);
        assert_eq!(parsed.discovery.dns_server, Some("10.0.0.10:53".parse().unwrap()));
        assert_eq!(parsed.discovery.lookup_interval, Duration::from_millis(250));
    }

    #[test]
    fn bootstrap_formation_needs_seeds_to_find_its_contact_points_and_a_bounded_count() {
        let mut cfg = NodeConfig { node_id: "n1".into(), ..NodeConfig::default() };
        cfg.membership.bootstrap_contact_points = 3;
        assert!(matches!(cfg.validate(), Err(Error::Config(m)) if m.contains("needs seeds or discovery.srv_names")));
        cfg.seeds = vec!["ddshard.default.svc:7000".parse().unwrap()];
        assert!(cfg.validate().is_ok());
        cfg.membership.bootstrap_contact_points = 1_001;
        assert!(matches!(cfg.validate(), Err(Error::Config(m)) if m.contains("at most 1000")));
    }

    #[test]
    fn non_loopback_addresses_need_a_secret_or_an_explicit_insecure() {
        let exposed = NodeConfig {
            node_id: "n1".into(),
            gossip_addr: "10.1.2.3:7000".parse().unwrap(),
            messaging_addr: "10.1.2.3:7001".parse().unwrap(),
            ..NodeConfig::default()
        };
        assert!(matches!(exposed.validate(), Err(Error::Config(_))));
        let with_secret = NodeConfig { cluster_secret: Some(ClusterSecret::generate()), ..exposed.clone() };
        assert!(with_secret.validate().is_ok());
        assert!(!with_secret.is_exposed_without_secret());
        let insecure = NodeConfig { insecure: true, ..exposed.clone() };
        assert!(insecure.validate().is_ok());
        assert!(insecure.is_exposed_without_secret());
        let key = ClusterSecret::generate();
        let file = format!("node_id = \"n1\"\ncluster_secret = \"{}\"\n", key.expose());
        let parsed = NodeConfig::from_toml_str(&file).unwrap();
        assert_eq!(parsed.cluster_secret.unwrap(), key);
        assert!(matches!(NodeConfig::from_toml_str("cluster_secret = \"too short\""), Err(Error::Config(_))));
    }

    #[test]
    fn a_node_bound_to_every_interface_must_say_where_peers_reach_it() {
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let base = NodeConfig {
            node_id: "n1".into(),
            cluster_secret: Some(ClusterSecret::generate()),
            ..NodeConfig::default()
        };
        let cfg = NodeConfig { gossip_addr: any, ..base.clone() };
        let Err(Error::Config(m)) = cfg.validate() else { panic!("no advertise") };
        assert!(m.contains("gossip_advertise"), "{m}");
        let cfg = NodeConfig { messaging_addr: "[::]:7001".parse().unwrap(), ..base.clone() };
        let Err(Error::Config(m)) = cfg.validate() else { panic!("no advertise") };
        assert!(m.contains("messaging_advertise"), "{m}");
        let cfg =
            NodeConfig { gossip_addr: any, gossip_advertise: Some("10.0.0.7:7000".parse().unwrap()), ..base.clone() };
        assert!(cfg.validate().is_ok());
        let cfg = NodeConfig { gossip_advertise: Some(any), ..base };
        assert!(matches!(cfg.validate(), Err(Error::Config(m)) if m.contains("unspecified")));
        // Port 0 in the advertised address is the bound port; no advertise is the bound address.
        let bound: SocketAddr = "0.0.0.0:41000".parse().unwrap();
        let nat: SocketAddr = "203.0.113.9:0".parse().unwrap();
        assert_eq!(advertised_addr(bound, Some(nat)).unwrap(), "203.0.113.9:41000".parse().unwrap());
        let published: SocketAddr = "203.0.113.9:7000".parse().unwrap();
        assert_eq!(advertised_addr(bound, Some(published)).unwrap(), published);
        assert!(matches!(advertised_addr(bound, None), Err(Error::BadAddress(_))));
        let lo: SocketAddr = "127.0.0.1:41000".parse().unwrap();
        assert_eq!(advertised_addr(lo, None).unwrap(), lo);
    }

    #[test]
    fn seeds_are_ip_socket_addresses_or_host_names_with_a_port_and_anything_else_names_the_seed() {
        for good in
            ["10.0.0.7:7000", "[fd00::7]:7000", "localhost:7000", "ddshard-0.ddshard.shop.svc.cluster.local.:7000"]
        {
            let seed: SeedAddr = good.parse().unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(seed.as_str(), good);
        }
        assert_eq!("10.0.0.7:7000".parse::<SeedAddr>().unwrap().socket_addr(), Some("10.0.0.7:7000".parse().unwrap()));
        assert_eq!("localhost:7000".parse::<SeedAddr>().unwrap().socket_addr(), None, "a name is resolved, later");
        let label = "a".repeat(64);
        for bad in [
            "localhost",
            "localhost:0",
            "localhost:70000",
            ":7000",
            "bad_name:7000",
            "-a.b:7000",
            "a..b:7000",
            &format!("{label}:1"),
        ] {
            let err = bad.parse::<SeedAddr>().unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
        let Err(Error::Config(m)) = NodeConfig::from_toml_str("seeds = [\"no-port\"]") else { panic!("a bad seed") };
        assert!(m.contains("no-port") && m.contains("line 1"), "{m}");
        let c =
            NodeConfig::from_toml_str_with_overrides("", &[("seeds".into(), "a.example:7000,10.1.1.1:7000".into())])
                .unwrap();
        assert_eq!(c.seeds.iter().map(SeedAddr::as_str).collect::<Vec<_>>(), ["a.example:7000", "10.1.1.1:7000"]);
    }

    #[test]
    fn a_secret_never_leaves_through_a_serialized_config_an_error_snippet_or_an_override() {
        // A passphrase (stretched) that carries a marker to look for.
        let secret = format!("s3cr3t-{}", ClusterSecret::generate().expose());
        let cfg = NodeConfig {
            cluster_secret: Some(ClusterSecret::new(secret.clone()).unwrap()),
            accepted_cluster_secrets: vec![ClusterSecret::new(secret.clone()).unwrap()],
            ..NodeConfig::default()
        };
        let written = toml::to_string(&cfg).unwrap();
        assert!(!written.contains("s3cr3t"), "{written}");
        // A file whose secret line is fine but whose next line is broken: the error names the
        // line, never shows the text around it.
        let file = format!("cluster_secret = \"{secret}\"\nnode_id = = \"n1\"\n");
        let Err(Error::Config(m)) = NodeConfig::from_toml_str(&file) else { panic!("a syntax error") };
        assert!(m.starts_with("line 2:") && !m.contains("s3cr3t"), "{m}");
        let Err(Error::Config(m)) = NodeConfig::from_toml_str_with_overrides(&file, &[]) else {
            panic!("a syntax error")
        };
        assert!(!m.contains("s3cr3t"), "{m}");
        // Not settable on a command line, and the refusal does not echo it.
        for path in ["cluster_secret", "accepted_cluster_secrets"] {
            let set = [(path.to_string(), secret.clone())];
            let Err(Error::Config(m)) = NodeConfig::from_toml_str_with_overrides("", &set) else { panic!("{path}") };
            assert!(m.contains("DDSHARD_CLUSTER_SECRET") && !m.contains("s3cr3t"), "{m}");
        }
    }

    #[test]
    fn fuzz_config_parser() {
        let seeds = vec![
            include_str!("../../config/default.toml").as_bytes().to_vec(),
            b"node_id = \"n1\"\n[transport]\nmax_frame_size = 1024\nconnect_timeout = \"1s\"\n".to_vec(),
            b"[sharding.allocation]\nstrategy = \"consistent-hashing\"\nvirtual_nodes = 0\n".to_vec(),
            b"[membership]\nphi_threshold = 1e308\ngossip_interval = \"18446744073709551615s\"\n".to_vec(),
        ];
        bolero::check!().with_iterations(crate::fuzzing::QUICK_ITERATIONS).for_each(|input: &[u8]| {
            let bytes = crate::fuzzing::mutate(&seeds, input);
            if let Ok(cfg) = NodeConfig::from_toml_str(&String::from_utf8_lossy(&bytes)) {
                let _ = cfg.validate();
            }
        });
    }
}
