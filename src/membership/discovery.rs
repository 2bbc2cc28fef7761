//! Discovery: where a node finds the gossip addresses of the nodes it joins through.
//!
//! **Guarantee.** While this node sees no other live node in gossip (it is joining, or it was
//! cut off from everyone), every source is asked again every `discovery.lookup_interval` and
//! every address found is contacted every gossip interval, so a seed rescheduled to a new IP
//! is reached within `lookup_interval` plus the name's DNS TTL. Once it sees others, sources
//! are asked every `refresh_interval` and the found addresses that are not live in gossip are
//! contacted then. A source never decides membership: a contact is one gossip handshake, which
//! an address of another cluster or without the secret does not pass; formation stays with the
//! life-cycle core (a first seed, or the lowest of the stable contact points).
//!
//! **Budgets.** Found addresses are deduplicated, this node's own is dropped, and at most
//! `max_contact_points` (the lowest) are kept, the rest counted; a failed or timed-out lookup
//! keeps the last good set (a resolver's hiccup does not make a node forget its peers) and
//! backs off, doubling from `lookup_interval` up to `refresh_interval`; a failure is logged
//! unless it repeats the one before (every failure is counted). Each name and source has its
//! own timeout, so a slow resolver hides no other seed; a lookup runs on a task of its own.
//!
//! Sources: [`SeedList`] (IP literals, and names through the system resolver: DNS A/AAAA and
//! hosts files, every address of a name), [`DnsSrv`] (SRV records: target and port), and
//! [`AggregateDiscovery`] (the union of several); users add their own (a cloud API) by
//! implementing [`Discovery`] and passing it to [`crate::NodeBuilder::discovery`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Instant;
use crate::config::{DiscoverySettings, SeedAddr};

/// At most this many addresses are taken from one name or one SRV answer (a hostile or broken
/// DNS answer cannot make a lookup hold millions).
const MAX_ADDRESSES_PER_NAME: usize = crate::config::DiscoverySettings::MAX_CONTACT_POINTS;

/// Why a lookup found nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {detail}")]
pub struct DiscoveryError {
    /// The source that failed (its [`Discovery::describe`]).
    pub source_name: String,
    /// What went wrong.
    pub detail: String,
}

/// A source of gossip addresses of nodes that may be members (contact points).
#[async_trait]
pub trait Discovery: Send + Sync + 'static {
    /// The addresses this source knows now (duplicates and this node's own are fine: the
    /// caller drops them). An error means this source found nothing this time.
    async fn lookup(&self) -> Result<Vec<SocketAddr>, DiscoveryError>;

    /// What this source is, for logs (`seeds [a:7000, b:7000]`, `dns-srv _gossip._udp.x`).
    fn describe(&self) -> String;
}

/// The `seeds` setting: IP literals as they are, names through the system resolver (DNS A and
/// AAAA, `/etc/hosts`), every address of each name.
#[derive(Debug, Clone)]
pub struct SeedList {
    seeds: Vec<SeedAddr>,
    name_timeout: Duration,
}

impl SeedList {
    /// These seeds; each name may take up to 5 s to resolve.
    pub fn new(seeds: Vec<SeedAddr>) -> Self {
        SeedList { seeds, name_timeout: Duration::from_secs(5) }
    }

    /// How long one name may take to resolve; a slower one counts as failed and hides none
    /// of the other seeds.
    pub fn with_name_timeout(mut self, timeout: Duration) -> Self {
        self.name_timeout = timeout;
        self
    }
}

#[async_trait]
impl Discovery for SeedList {
    async fn lookup(&self) -> Result<Vec<SocketAddr>, DiscoveryError> {
        // IP literals as they are; names all at once, each within its own timeout, so a slow
        // or dead resolver hides no other seed.
        let mut found: Vec<SocketAddr> = self.seeds.iter().filter_map(SeedAddr::socket_addr).collect();
        let names = self.seeds.iter().filter(|s| s.socket_addr().is_none()).map(|seed| async move {
            match tokio::time::timeout(self.name_timeout, tokio::net::lookup_host(seed.as_str())).await {
                Ok(Ok(addrs)) => Ok(addrs.take(MAX_ADDRESSES_PER_NAME).collect::<Vec<_>>()),
                Ok(Err(e)) => Err(format!("{seed}: {e}")),
                Err(_) => Err(format!("{seed}: no answer within {:?}", self.name_timeout)),
            }
        });
        let mut failures = Vec::new();
        for result in futures::future::join_all(names).await {
            match result {
                Ok(addrs) => found.extend(addrs),
                Err(e) => failures.push(e),
            }
        }
        if found.is_empty() && !failures.is_empty() {
            return Err(DiscoveryError { source_name: self.describe(), detail: failures.join("; ") });
        }
        Ok(found)
    }

    fn describe(&self) -> String {
        let seeds: Vec<&str> = self.seeds.iter().map(SeedAddr::as_str).collect();
        format!("seeds [{}]", seeds.join(", "))
    }
}

/// DNS SRV records of one name: each record's target host (its addresses from the answer's
/// additional section, else looked up) at the record's port.
pub struct DnsSrv {
    name: String,
    resolver: hickory_resolver::TokioResolver,
}

impl std::fmt::Debug for DnsSrv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsSrv").field("name", &self.name).finish_non_exhaustive()
    }
}

impl DnsSrv {
    /// SRV records of `name`, asked of the system's DNS servers (`/etc/resolv.conf`).
    pub fn system(name: &str) -> crate::error::Result<Self> {
        let builder = hickory_resolver::TokioResolver::builder_tokio()
            .map_err(|e| crate::error::Error::Config(format!("discovery.srv_names: the system resolver: {e}")))?;
        Self::build(name, builder)
    }

    /// SRV records of `name`, asked of the DNS server at `server` (UDP, then TCP for long
    /// answers).
    pub fn with_server(name: &str, server: SocketAddr) -> crate::error::Result<Self> {
        use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
        let mut udp = ConnectionConfig::udp();
        udp.port = server.port();
        let mut tcp = ConnectionConfig::tcp();
        tcp.port = server.port();
        let ns = NameServerConfig::new(server.ip(), true, vec![udp, tcp]);
        let config = ResolverConfig::from_name_servers(vec![ns]);
        Self::build(
            name,
            hickory_resolver::TokioResolver::builder_with_config(
                config,
                hickory_resolver::net::runtime::TokioRuntimeProvider::default(),
            ),
        )
    }

    fn build(
        name: &str,
        mut builder: hickory_resolver::ResolverBuilder<hickory_resolver::net::runtime::TokioRuntimeProvider>,
    ) -> crate::error::Result<Self> {
        if !crate::config::is_host_name(name, true) {
            return Err(crate::error::Error::Config(format!("discovery.srv_names: {name:?} is not a DNS name")));
        }
        // Two tries within the lookup timeout (hickory's default, 5 s a try, would spend the
        // whole timeout on one lost datagram); negative answers cached briefly, so records
        // published after a first miss are seen at the next lookup.
        let options = builder.options_mut();
        options.timeout = Duration::from_secs(2);
        options.negative_max_ttl = Some(Duration::from_secs(1));
        let resolver = builder
            .build()
            .map_err(|e| crate::error::Error::Config(format!("discovery.srv_names: building the resolver: {e}")))?;
        Ok(DnsSrv { name: name.to_string(), resolver })
    }
}

#[async_trait]
impl Discovery for DnsSrv {
    async fn lookup(&self) -> Result<Vec<SocketAddr>, DiscoveryError> {
        use hickory_resolver::proto::rr::RData;
        let fail = |detail: String| DiscoveryError { source_name: self.describe(), detail };
        let answer = self.resolver.srv_lookup(self.name.as_str()).await.map_err(|e| fail(e.to_string()))?;
        // The glue records, by name, read once.
        let mut glue: std::collections::HashMap<_, Vec<std::net::IpAddr>> = std::collections::HashMap::new();
        for r in answer.additionals().iter().take(MAX_ADDRESSES_PER_NAME) {
            match &r.data {
                RData::A(a) => glue.entry(&r.name).or_default().push(a.0.into()),
                RData::AAAA(a) => glue.entry(&r.name).or_default().push(a.0.into()),
                _ => {}
            }
        }
        // Each (target, port) once, at most the budget of them (a hostile answer is bounded).
        let mut targets = Vec::new();
        let mut seen = HashSet::new();
        for record in answer.answers() {
            let RData::SRV(srv) = &record.data else { continue };
            if srv.target.is_root() || srv.port == 0 || !seen.insert((&srv.target, srv.port)) {
                continue;
            }
            targets.push((&srv.target, srv.port));
            if targets.len() == MAX_ADDRESSES_PER_NAME {
                break;
            }
        }
        let mut found = Vec::new();
        let mut unglued = Vec::new();
        for (target, port) in targets {
            match glue.get(target) {
                Some(ips) => found.extend(ips.iter().map(|ip| SocketAddr::new(*ip, port))),
                None => unglued.push((target, port)),
            }
        }
        // Targets without glue are asked for all at once; one without an address hides none.
        let asked = unglued.into_iter().map(|(target, port)| async move {
            match self.resolver.lookup_ip(target.clone()).await {
                Ok(ips) => ips.iter().map(|ip| SocketAddr::new(ip, port)).collect(),
                Err(e) => {
                    tracing::debug!(%target, error = %e, "an SRV target has no address");
                    Vec::new()
                }
            }
        });
        for addrs in futures::future::join_all(asked).await {
            found.extend(addrs);
        }
        found.truncate(MAX_ADDRESSES_PER_NAME);
        Ok(found)
    }

    fn describe(&self) -> String {
        format!("dns-srv {}", self.name)
    }
}

/// The union of several sources; fails only when every source failed.
#[derive(Clone, Default)]
pub struct AggregateDiscovery {
    sources: Vec<Arc<dyn Discovery>>,
}

impl std::fmt::Debug for AggregateDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl AggregateDiscovery {
    /// Of these sources.
    pub fn new(sources: Vec<Arc<dyn Discovery>>) -> Self {
        AggregateDiscovery { sources }
    }

    /// Adds a source.
    pub fn push(&mut self, source: Arc<dyn Discovery>) {
        self.sources.push(source);
    }

    /// Whether there is no source at all.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }
}

#[async_trait]
impl Discovery for AggregateDiscovery {
    async fn lookup(&self) -> Result<Vec<SocketAddr>, DiscoveryError> {
        let results = futures::future::join_all(self.sources.iter().map(|s| s.lookup())).await;
        let mut found = Vec::new();
        let mut failures = Vec::new();
        for r in results {
            match r {
                Ok(addrs) => found.extend(addrs),
                Err(e) => failures.push(e.to_string()),
            }
        }
        if !failures.is_empty() && failures.len() == self.sources.len() {
            return Err(DiscoveryError { source_name: self.describe(), detail: failures.join("; ") });
        }
        Ok(found)
    }

    fn describe(&self) -> String {
        let parts: Vec<String> = self.sources.iter().map(|s| s.describe()).collect();
        parts.join(" + ")
    }
}

/// What the driver tells the [`DiscoveryCore`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum DiscoveryInput {
    /// A gossip refresh: the gossip addresses of the other live nodes now.
    Tick { live: Vec<SocketAddr> },
    /// A lookup ended (errors as text: the core only compares and logs them).
    Found(Result<Vec<SocketAddr>, String>),
}

/// What the driver does for the [`DiscoveryCore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DiscoveryAction {
    /// Ask every source (with `lookup_timeout`), then feed [`DiscoveryInput::Found`].
    Lookup,
    /// One gossip handshake with this address.
    Contact(SocketAddr),
    /// The found set changed: log it (`dropped` past `max_contact_points`).
    FoundChanged { addresses: Vec<SocketAddr>, dropped: usize },
    /// A lookup failed with an error not logged just before.
    LookupFailed(String),
}

/// The decisions of discovery (module docs): when to look up, whom to contact, what to log.
#[derive(Debug)]
pub(crate) struct DiscoveryCore {
    settings: DiscoverySettings,
    /// How often found addresses are contacted while this node is alone.
    contact_interval: Duration,
    own: SocketAddr,
    next_lookup: Instant,
    lookup_in_flight: bool,
    failures: u32,
    last_error: Option<String>,
    found: Vec<SocketAddr>,
    live: HashSet<SocketAddr>,
    next_contact: Instant,
}

impl DiscoveryCore {
    /// A core for the node at gossip address `own`; the first lookup is due at `now`.
    pub(crate) fn new(settings: DiscoverySettings, contact_interval: Duration, own: SocketAddr, now: Instant) -> Self {
        DiscoveryCore {
            settings,
            contact_interval,
            own,
            next_lookup: now,
            lookup_in_flight: false,
            failures: 0,
            last_error: None,
            found: Vec::new(),
            live: HashSet::new(),
            next_contact: now,
        }
    }

    fn alone(&self) -> bool {
        self.live.is_empty()
    }

    /// The wait before the next lookup: `lookup_interval` while alone, doubled per failure in a
    /// row, never past `refresh_interval` (which is the wait while not alone).
    fn lookup_wait(&self) -> Duration {
        if !self.alone() {
            return self.settings.refresh_interval;
        }
        let factor = 1u32.checked_shl(self.failures.min(16)).unwrap_or(u32::MAX);
        self.settings.lookup_interval.saturating_mul(factor).min(self.settings.refresh_interval)
    }

    fn contact_found(&self, out: &mut Vec<DiscoveryAction>) {
        out.extend(self.found.iter().filter(|a| !self.live.contains(a)).map(|a| DiscoveryAction::Contact(*a)));
    }

    pub(crate) fn handle(&mut self, input: DiscoveryInput, now: Instant, out: &mut Vec<DiscoveryAction>) {
        match input {
            DiscoveryInput::Tick { live } => {
                let was_alone = self.alone();
                self.live = live.into_iter().filter(|a| *a != self.own).collect();
                // Cut off from everyone: ask again now rather than after the long refresh wait.
                if self.alone() && !was_alone && !self.lookup_in_flight {
                    self.next_lookup = now;
                }
                if !self.lookup_in_flight && now >= self.next_lookup {
                    self.lookup_in_flight = true;
                    out.push(DiscoveryAction::Lookup);
                } else if self.alone() && now >= self.next_contact {
                    self.next_contact = now + self.contact_interval;
                    self.contact_found(out);
                }
            }
            DiscoveryInput::Found(result) => {
                self.lookup_in_flight = false;
                match result {
                    Ok(addrs) => {
                        self.failures = 0;
                        self.last_error = None;
                        let mut addrs: Vec<SocketAddr> = addrs.into_iter().filter(|a| *a != self.own).collect();
                        addrs.sort_unstable();
                        addrs.dedup();
                        let dropped = addrs.len().saturating_sub(self.settings.max_contact_points);
                        addrs.truncate(self.settings.max_contact_points);
                        if addrs != self.found {
                            out.push(DiscoveryAction::FoundChanged { addresses: addrs.clone(), dropped });
                            self.found = addrs;
                        }
                    }
                    Err(e) => {
                        self.failures = self.failures.saturating_add(1);
                        if self.last_error.as_deref() != Some(e.as_str()) {
                            out.push(DiscoveryAction::LookupFailed(e.clone()));
                            self.last_error = Some(e);
                        }
                    }
                }
                self.next_lookup = now + self.lookup_wait();
                self.next_contact = now + self.contact_interval;
                self.contact_found(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DiscoveryAction::*;

    const GOSSIP: Duration = Duration::from_millis(150);

    fn addr(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, last], 7000))
    }

    fn core(t0: Instant) -> DiscoveryCore {
        DiscoveryCore::new(DiscoverySettings { max_contact_points: 3, ..Default::default() }, GOSSIP, addr(1), t0)
    }

    fn step(c: &mut DiscoveryCore, input: DiscoveryInput, now: Instant) -> Vec<DiscoveryAction> {
        let mut out = Vec::new();
        c.handle(input, now, &mut out);
        out
    }

    fn tick(live: &[u8]) -> DiscoveryInput {
        DiscoveryInput::Tick { live: live.iter().map(|l| addr(*l)).collect() }
    }

    #[test]
    fn a_joining_node_looks_up_at_once_and_contacts_every_address_found_but_its_own() {
        let t0 = Instant::now();
        let mut c = core(t0);
        assert_eq!(step(&mut c, tick(&[]), t0), [Lookup]);
        assert_eq!(step(&mut c, tick(&[]), t0 + GOSSIP), [], "one lookup at a time");
        let out = step(&mut c, DiscoveryInput::Found(Ok(vec![addr(3), addr(1), addr(2), addr(3)])), t0 + GOSSIP);
        assert_eq!(
            out,
            [FoundChanged { addresses: vec![addr(2), addr(3)], dropped: 0 }, Contact(addr(2)), Contact(addr(3))]
        );
    }

    #[test]
    fn while_alone_found_addresses_are_contacted_every_gossip_interval_and_looked_up_every_lookup_interval() {
        let t0 = Instant::now();
        let mut c = core(t0);
        step(&mut c, tick(&[]), t0);
        step(&mut c, DiscoveryInput::Found(Ok(vec![addr(2)])), t0);
        assert_eq!(step(&mut c, tick(&[]), t0 + GOSSIP / 2), [], "not before the contact interval");
        assert_eq!(step(&mut c, tick(&[]), t0 + GOSSIP), [Contact(addr(2))]);
        assert_eq!(step(&mut c, tick(&[]), t0 + GOSSIP * 3 / 2), [], "the next contact a gossip interval later");
        assert_eq!(step(&mut c, tick(&[]), t0 + GOSSIP * 2), [Contact(addr(2))]);
        assert_eq!(step(&mut c, tick(&[]), t0 + Duration::from_secs(1)), [Lookup], "a seed's new IP is asked for");
        let out = step(&mut c, DiscoveryInput::Found(Ok(vec![addr(9)])), t0 + Duration::from_secs(1));
        assert_eq!(out, [FoundChanged { addresses: vec![addr(9)], dropped: 0 }, Contact(addr(9))]);
    }

    #[test]
    fn with_live_peers_lookups_wait_the_refresh_interval_and_only_non_live_addresses_are_contacted() {
        let t0 = Instant::now();
        let mut c = core(t0);
        step(&mut c, tick(&[2]), t0);
        let out = step(&mut c, DiscoveryInput::Found(Ok(vec![addr(2), addr(3)])), t0);
        assert_eq!(out, [FoundChanged { addresses: vec![addr(2), addr(3)], dropped: 0 }, Contact(addr(3))]);
        assert_eq!(step(&mut c, tick(&[2]), t0 + Duration::from_secs(29)), [], "no contacts while not alone");
        assert_eq!(step(&mut c, tick(&[2]), t0 + Duration::from_secs(30)), [Lookup]);
    }

    #[test]
    fn a_node_cut_off_from_everyone_looks_up_again_at_once() {
        let t0 = Instant::now();
        let mut c = core(t0);
        step(&mut c, tick(&[2]), t0);
        step(&mut c, DiscoveryInput::Found(Ok(vec![addr(2)])), t0);
        assert_eq!(step(&mut c, tick(&[]), t0 + Duration::from_secs(2)), [Lookup]);
    }

    #[test]
    fn more_addresses_than_the_budget_keep_the_lowest_and_count_the_rest() {
        let t0 = Instant::now();
        let mut c = core(t0);
        step(&mut c, tick(&[]), t0);
        let many: Vec<SocketAddr> = (2..=200).rev().map(addr).collect();
        let out = step(&mut c, DiscoveryInput::Found(Ok(many)), t0);
        assert_eq!(out[0], FoundChanged { addresses: vec![addr(2), addr(3), addr(4)], dropped: 196 });
        assert_eq!(out.len(), 4, "three contacts: {out:?}");
    }

    #[test]
    fn failed_lookups_keep_the_last_good_set_back_off_and_log_each_distinct_error_once() {
        let t0 = Instant::now();
        let mut c = core(t0);
        step(&mut c, tick(&[]), t0);
        step(&mut c, DiscoveryInput::Found(Ok(vec![addr(2)])), t0);
        let mut now = t0;
        let mut waits = Vec::new();
        for k in 0..7 {
            // The next lookup is due: find when.
            let mut t = now;
            while !step(&mut c, tick(&[]), t).contains(&Lookup) {
                t += Duration::from_millis(50);
                assert!(t - now < Duration::from_secs(60), "round {k}: no lookup within a minute");
            }
            if k > 0 {
                waits.push((t - now).as_millis() / 50 * 50);
            }
            now = t;
            let out = step(&mut c, DiscoveryInput::Found(Err("no such name".into())), now);
            let logged = out.iter().filter(|a| matches!(a, LookupFailed(_))).count();
            assert_eq!(logged, usize::from(k == 0), "round {k}: {out:?}");
            assert!(out.contains(&Contact(addr(2))), "the last good address is still contacted: {out:?}");
        }
        assert_eq!(waits, [2000, 4000, 8000, 16000, 30000, 30000], "doubling up to the refresh interval");
        let out = step(&mut c, DiscoveryInput::Found(Err("timed out".into())), now);
        assert!(out.contains(&LookupFailed("timed out".into())), "a new error is logged: {out:?}");
        let out = step(&mut c, DiscoveryInput::Found(Ok(vec![addr(2)])), now);
        assert_eq!(out, [Contact(addr(2))], "same set: nothing to log");
        assert_eq!(c.lookup_wait(), Duration::from_secs(1), "a success resets the back-off");
    }

    fn seeds(list: &[&str]) -> SeedList {
        SeedList::new(list.iter().map(|s| s.parse().unwrap()).collect())
    }

    #[tokio::test]
    async fn a_seed_list_gives_ip_literals_as_they_are_and_every_address_of_a_name() {
        let found = seeds(&["10.0.0.7:7000", "localhost:7001"]).lookup().await.unwrap();
        assert!(found.contains(&"10.0.0.7:7000".parse().unwrap()), "{found:?}");
        assert!(found.iter().any(|a| a.ip().is_loopback() && a.port() == 7001), "{found:?}");
    }

    #[tokio::test]
    async fn a_seed_list_fails_only_when_no_seed_gave_an_address() {
        let bad = "no-such-host.invalid:7000";
        let found = seeds(&[bad, "10.0.0.7:7000"]).lookup().await.unwrap();
        assert_eq!(found, ["10.0.0.7:7000".parse().unwrap()]);
        let err = seeds(&[bad]).lookup().await.unwrap_err();
        assert!(err.detail.contains(bad), "{err}");
    }

    #[tokio::test]
    async fn sources_describe_themselves_for_logs() {
        assert_eq!(seeds(&["10.0.0.7:7000", "peers.svc:7000"]).describe(), "seeds [10.0.0.7:7000, peers.svc:7000]");
        let srv = DnsSrv::with_server("_gossip._udp.x.svc", addr(53)).unwrap();
        assert_eq!(srv.describe(), "dns-srv _gossip._udp.x.svc");
        let both = AggregateDiscovery::new(vec![Arc::new(seeds(&["10.0.0.7:7000"])), Arc::new(srv)]);
        assert_eq!(both.describe(), "seeds [10.0.0.7:7000] + dns-srv _gossip._udp.x.svc");
    }

    #[tokio::test]
    async fn an_srv_source_refuses_a_name_that_is_not_a_dns_name() {
        for bad in ["bad name", "a..b", ""] {
            assert!(
                matches!(DnsSrv::with_server(bad, addr(53)), Err(crate::error::Error::Config(m)) if m.contains("not a DNS name")),
                "{bad:?}"
            );
        }
        assert!(DnsSrv::with_server("_gossip._udp.x.svc.", addr(53)).is_ok());
    }

    /// Through a real DNS server on a UDP port (`testkit::dns`): every target at its port,
    /// from glue records when the answer has them (no address query then) and by asking
    /// otherwise; IPv4 and IPv6; a record with port 0 skipped; changes seen at the next lookup.
    #[cfg(feature = "testkit")]
    #[tokio::test]
    async fn dns_srv_gives_every_target_at_its_port_with_or_without_glue_and_follows_changes() {
        let dns = crate::testkit::dns::TestDns::start("_gossip._udp.ddshard.test.").await.unwrap();
        let a: SocketAddr = "127.0.0.1:7101".parse().unwrap();
        let b: SocketAddr = "127.0.0.2:7102".parse().unwrap();
        let v6: SocketAddr = "[::1]:7103".parse().unwrap();
        let unusable: SocketAddr = "127.0.0.9:0".parse().unwrap();
        dns.set(&[("n1", a), ("n2", b), ("n3", v6), ("n4", unusable)]);
        let srv = DnsSrv::with_server(&dns.service, dns.addr).unwrap();
        let sorted = |mut v: Vec<SocketAddr>| {
            v.sort();
            v
        };
        assert_eq!(sorted(srv.lookup().await.unwrap()), [a, b, v6], "port 0 skipped");
        assert_eq!(dns.address_queries(), 0, "glue records answer every target");
        dns.set_glue(false);
        assert_eq!(sorted(srv.lookup().await.unwrap()), [a, b, v6], "targets asked for without glue");
        assert!(dns.address_queries() >= 3);
        let moved: SocketAddr = "127.0.0.3:7202".parse().unwrap();
        dns.set(&[("n1", a), ("n2", moved)]);
        assert_eq!(sorted(srv.lookup().await.unwrap()), [a, moved], "TTL 0: the next lookup sees a move");
        dns.set(&[]);
        let err = srv.lookup().await.unwrap_err();
        assert!(err.detail.contains("no records") && err.source_name == srv.describe(), "{err}");
        assert!(dns.srv_queries() >= 4);
    }

    struct Fixed(Result<Vec<SocketAddr>, DiscoveryError>);

    #[async_trait]
    impl Discovery for Fixed {
        async fn lookup(&self) -> Result<Vec<SocketAddr>, DiscoveryError> {
            self.0.clone()
        }
        fn describe(&self) -> String {
            "fixed".into()
        }
    }

    #[tokio::test]
    async fn an_aggregate_is_the_union_of_its_sources_and_fails_only_when_all_fail() {
        let failing = || -> Arc<dyn Discovery> {
            Arc::new(Fixed(Err(DiscoveryError { source_name: "fixed".into(), detail: "down".into() })))
        };
        let both = AggregateDiscovery::new(vec![
            Arc::new(Fixed(Ok(vec![addr(2)]))),
            failing(),
            Arc::new(Fixed(Ok(vec![addr(3), addr(2)]))),
        ]);
        assert_eq!(both.lookup().await.unwrap(), [addr(2), addr(3), addr(2)]);
        let none = AggregateDiscovery::new(vec![failing(), failing()]);
        let err = none.lookup().await.unwrap_err();
        assert_eq!(err.detail, "fixed: down; fixed: down");
        let mut empty = AggregateDiscovery::default();
        assert!(empty.is_empty());
        assert_eq!(empty.lookup().await.unwrap(), Vec::<SocketAddr>::new());
        empty.push(failing());
        assert!(!empty.is_empty());
    }
}
