//! The `ddshard` command line: `demo` runs a local in-process cluster with a sharded counter.

#![warn(clippy::too_many_lines)]

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use ddshard::sharding::ClusterShardingStats;
use ddshard::{Durable, DurableEntity, EntityContext, MemberStatus, Node, NodeConfig, ShardRegion};
use serde::{Deserialize, Serialize};

#[derive(Parser)]
#[command(name = "ddshard", version, about = "Cluster sharding for peer-to-peer Rust clusters")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a local 3-node cluster (embedded default settings, temp dirs, loopback) with a
    /// sharded counter workload; then one node leaves gracefully and one is killed.
    Demo {
        /// Counters to create.
        #[arg(long, default_value_t = 300)]
        counters: usize,
        /// Increments per counter.
        #[arg(long, default_value_t = 10)]
        increments: i64,
    },
    /// Run a real node hosting the sample key-value type `kv`, with the admin HTTP API (and
    /// `/kv/{id}`) on --admin-addr. Settings: the embedded defaults (config/default.toml), then
    /// --config, then `DDSHARD__…` environment variables, then each --set (later wins). Prints
    /// one `READY …` line with the bound addresses; SIGTERM or Ctrl-C leaves gracefully.
    Node {
        /// Node configuration (TOML); without it, the embedded defaults.
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Override one setting by its dotted path, e.g. `--set node_id=n2 --set
        /// membership.stable_after=2s` (one file then serves every node of a cluster). Also
        /// from the environment: `DDSHARD__NODE_ID=n2`, `DDSHARD__MEMBERSHIP__STABLE_AFTER=2s`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Append every activation of a `kv` entity (id, node, epoch, start, stop) to this file,
        /// for `ddshard::activation::check_activations` (see `ddshard::activation`).
        #[arg(long)]
        activation_log: Option<std::path::PathBuf>,
        /// Address of the admin HTTP API (`ddshard::admin`, plus `/kv/{id}`); the default is
        /// where `ddshard admin --url` looks; port 0: any free port (two nodes on one host need
        /// two ports). Mutating routes take the bearer token of DDSHARD_ADMIN_TOKEN (at least 32
        /// characters and hard to guess, e.g. from `ddshard secret`); without it they answer 403.
        #[arg(long, default_value = "127.0.0.1:8558")]
        admin_addr: std::net::SocketAddr,
        /// A listener with only `/alive` and `/ready`, for an orchestrator's probes (they then
        /// never share the admin API's connections).
        #[arg(long)]
        probe_addr: Option<std::net::SocketAddr>,
        /// A name clients may reach the admin API by (a service or host name), besides IP
        /// addresses and localhost; repeat for several. Requests with another `Host` answer 421.
        #[arg(long = "admin-allowed-host", value_name = "NAME")]
        admin_allowed_hosts: Vec<String>,
        /// Log lines as `text` (human-readable) or `json` (one object a line, for a log
        /// collector), on stderr. The level is `info` unless RUST_LOG says otherwise.
        #[arg(long, value_enum, default_value = "text")]
        log_format: LogFormat,
    },
    /// Print a fresh random cluster secret (64 hex digits) for `cluster_secret` or
    /// DDSHARD_CLUSTER_SECRET.
    Secret,
    /// Query or steer a running node through its admin HTTP API (`--admin-addr` of
    /// `ddshard node`). Mutating commands send the bearer token of DDSHARD_ADMIN_TOKEN.
    Admin {
        /// The node's admin API.
        #[arg(long, default_value = "http://127.0.0.1:8558")]
        url: String,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        command: ddshard::admin::cli::AdminCommand,
    },
    /// Delete the sharding data (remembered entities and shards) of entity types from a stopped
    /// node's data dir (Akka's RemoveInternalClusterShardingData). Refuses while a node runs on it.
    /// Run it on every node's data dir with the whole cluster stopped: a node that kept the data
    /// replicates it back.
    RemoveInternalData {
        /// The node's data dir.
        #[arg(long)]
        data_dir: std::path::PathBuf,
        /// Entity type names.
        #[arg(required = true)]
        types: Vec<String>,
    },
}

/// How `ddshard node` writes its log lines.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr at `default_level` unless RUST_LOG is set.
fn init_logging(default_level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
    }
}

const DEFAULT_CONFIG: &str = include_str!("../../config/default.toml");

/// The demo's entity: a counter.
#[derive(Default)]
struct Counter;

#[derive(Serialize, Deserialize)]
enum CounterMsg {
    /// The increment that takes the counter from `to - 1` to `to`; idempotent, so a client may
    /// send it again after an error whose outcome is unknown (`StateNotPersisted`, a timeout).
    IncrementTo(i64),
    Get,
}

/// The demo's counter keeps its value as durable state: written to a majority of nodes (in
/// LMDB) before each increment is answered.
impl DurableEntity for Counter {
    type Message = CounterMsg;
    type Reply = i64;
    type State = i64;
    async fn handle(&mut self, value: &mut i64, msg: CounterMsg, ctx: &mut EntityContext) -> i64 {
        if let CounterMsg::IncrementTo(to) = msg
            && *value == to - 1
        {
            *value = to;
            ctx.persist();
        }
        *value
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    // A node is a service: its member changes, downing decisions, coordinator moves and
    // hand-offs are what an operator reads (`info`). The other commands print their own output.
    match &cli.command {
        Command::Node { log_format, .. } => init_logging("info", *log_format),
        _ => init_logging("error", LogFormat::Text),
    }
    let result = match cli.command {
        Command::Admin { url, json, command } => {
            let client = ddshard::admin::cli::AdminClient {
                url,
                token: std::env::var(ADMIN_TOKEN_ENV).ok(),
                timeout: Duration::from_secs(30),
            };
            client.run(&command, json).map(|out| println!("{out}")).map_err(Into::into)
        }
        Command::Demo { counters, increments } => demo(counters, increments).await,
        Command::RemoveInternalData { data_dir, types } => remove_internal_data(&data_dir, &types),
        Command::Secret => {
            println!("{}", ddshard::ClusterSecret::generate().expose());
            Ok(())
        }
        Command::Node { config, set, activation_log, admin_addr, probe_addr, admin_allowed_hosts, .. } => {
            let listeners = Listeners { admin: admin_addr, probes: probe_addr, allowed_hosts: admin_allowed_hosts };
            run_node(config.as_deref(), &set, activation_log.as_deref(), listeners).await
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// Where `ddshard node` reads the admin API's bearer token from.
const ADMIN_TOKEN_ENV: &str = "DDSHARD_ADMIN_TOKEN";

/// Where `ddshard node` serves HTTP.
struct Listeners {
    admin: std::net::SocketAddr,
    probes: Option<std::net::SocketAddr>,
    allowed_hosts: Vec<String>,
}

async fn run_node(
    config: Option<&std::path::Path>,
    set: &[String],
    activation_log: Option<&std::path::Path>,
    listeners: Listeners,
) -> Result<(), Box<dyn std::error::Error>> {
    let text = match config {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("reading config {}: {e}", path.display()))?,
        None => DEFAULT_CONFIG.to_string(),
    };
    let mut overrides = NodeConfig::overrides_from_env()?;
    for arg in set {
        overrides.push(NodeConfig::parse_override(arg)?);
    }
    let mut cfg = NodeConfig::from_toml_str_with_overrides(&text, &overrides)?;
    cfg.apply_env()?;
    let admin_token = match std::env::var(ADMIN_TOKEN_ENV) {
        Ok(t) => {
            ddshard::secret::check_strength(ADMIN_TOKEN_ENV, &t)?;
            Some(t)
        }
        Err(_) => None,
    };
    let prometheus = ddshard::metrics::install_prometheus()?;
    let settings = cfg.sharding.clone();
    let log = activation_log.map(ddshard::activation::ActivationLog::with_file).transpose()?;
    let node = Node::start(cfg).await?;
    let me = node.node_id().to_string();
    let factory = move |_: &str| match &log {
        Some(log) => ddshard::service::KvEntity::with_activation_log(&me, log.clone()),
        None => ddshard::service::KvEntity::new(&me),
    };
    let region = node.sharding().start_durable("kv", factory, settings).await?;
    // Off loopback, writes of the sample type need the admin token as every mutating route
    // does (without one configured they are off).
    let kv_token = (!listeners.admin.ip().is_loopback()).then(|| admin_token.clone().unwrap_or_default());
    let settings =
        ddshard::admin::AdminSettings { token: admin_token, prometheus: Some(prometheus), ..Default::default() };
    let app = ddshard::admin::router(node.clone(), settings)
        .merge(ddshard::service::kv_routes(region.clone(), kv_token))
        .fallback(ddshard::admin::no_such_route);
    let serve_settings = ddshard::admin::ServeSettings { allowed_hosts: listeners.allowed_hosts, ..Default::default() };
    let admin = ddshard::admin::serve(&node, listeners.admin, app, serve_settings.clone()).await?.local_addr;
    let probes = match listeners.probes {
        Some(addr) => {
            let probes = ddshard::admin::probe_router(node.clone());
            let bound = ddshard::admin::serve(&node, addr, probes, serve_settings).await?.local_addr;
            format!(" probes={bound}")
        }
        None => String::new(),
    };
    println!(
        "READY node={} gossip={} messaging={} admin={admin}{probes}",
        node.node_id(),
        node.gossip_addr(),
        node.messaging_addr()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = wait_until_stopped(&node) => {
            // Every entity is gone (and logged as stopped) before the process exits.
            node.shutdown().await;
            let why = node.stop_reason().unwrap_or_else(|| "it stopped".into());
            return Err(format!("the node stopped by itself ({why}); restart it to rejoin as a new incarnation").into());
        }
    }
    node.leave().await?;
    Ok(())
}

async fn wait_until_stopped(node: &Node) {
    while !node.is_shut_down() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn remove_internal_data(data_dir: &std::path::Path, types: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    for (t, n) in ddshard::sharding::remove_internal_data(data_dir, types)? {
        println!("{t}: deleted {n} keys");
    }
    eprintln!(
        "every node holds a replica: run this on the data dir of every node of the cluster while all are \
         stopped, or the data comes back from the nodes that kept it"
    );
    Ok(())
}

async fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    while !check() {
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn print_distribution(title: &str, stats: &ClusterShardingStats) {
    println!("\n{title}");
    println!("  {:<8} {:>7} {:>9}", "node", "shards", "entities");
    for (region, shards) in &stats.regions {
        let entities: usize = shards.values().sum();
        println!("  {:<8} {:>7} {:>9}", region.node_id, shards.len(), entities);
    }
    for region in &stats.failed {
        println!("  {:<8} {:>7} {:>9}", region.node_id, "-", "no answer");
    }
}

async fn demo(counters: usize, increments: i64) -> Result<(), Box<dyn std::error::Error>> {
    let base = NodeConfig::from_toml_str(DEFAULT_CONFIG)?;
    let root = tempfile::tempdir()?;
    let n = 3;
    println!("ddshard demo: {n} nodes on loopback, data under {}", root.path().display());
    println!("(embedded defaults; the demo only shortens downing timers to 2 s so the crash is handled quickly)");
    // Members prove they hold this secret: gossip is MAC'd, messaging authenticated and encrypted.
    let nodes = start_demo_cluster(&base, root.path(), n).await?;

    let settings = ddshard::ShardingSettings { min_nr_of_members: n, ..base.sharding.clone() };
    let mut regions: Vec<ShardRegion<Durable<Counter>>> = Vec::new();
    for node in &nodes {
        regions.push(node.sharding().start_durable("counter", |_: &str| Counter, settings.clone()).await?);
    }

    let ids: Vec<String> = (0..counters).map(|i| format!("counter-{i}")).collect();
    increment_all(&regions, &ids, increments).await?;
    check_counters(&regions[0], &ids, increments).await?;
    println!("every counter is {increments}");
    print_distribution("shard distribution", &regions[0].cluster_stats(Duration::from_secs(3)).await?);

    println!("\nnode-2 leaves gracefully (hands its shards off)…");
    nodes[1].leave().await?;
    print_distribution("after node-2 left", &regions[0].cluster_stats(Duration::from_secs(3)).await?);
    check_counters(&regions[0], &ids, increments).await?;
    println!("all {counters} counters kept their value (node-2's were handed off and loaded their durable state)");

    println!("\nnode-3 is killed (no goodbye)…");
    let t = Instant::now();
    nodes[2].shutdown().await;
    let survivor = nodes[0].clone();
    wait_for("node-3 downed and removed", Duration::from_secs(60), || survivor.membership().member("node-3").is_none())
        .await?;
    println!("node-3 downed by keep-majority and removed after {:.1?}", t.elapsed());
    // node-2 left the roster gracefully; node-3's disk still counts. Durable state needs a
    // majority of the roster, so node-1, one of two holders, serves no durable counter alone
    // until node-3 is back or forgotten (DESIGN.md: quorums over a durable roster).
    println!("node-1 is one of the two replica holders left (node-3's disk still counts): durable counters wait");
    survivor.replicator().forget_replica("node-3").await?;
    println!(
        "node-3 forgotten, as an operator who knows it is gone for good does (`ddshard admin forget node-3`; \
         replicator.forget_absent_after does it by itself after 30 min)"
    );
    check_counters(&regions[0], &ids, increments).await?;
    print_distribution("after node-3 was killed", &regions[0].cluster_stats(Duration::from_secs(3)).await?);
    println!("all {counters} counters answer with their value (node-3's restarted from their durable state)");
    nodes[0].shutdown().await;
    Ok(())
}

/// Starts `n` nodes on loopback with one generated cluster secret (gossip authenticated,
/// messaging encrypted) and waits until every member is up and reachable in every view.
async fn start_demo_cluster(
    base: &NodeConfig,
    root: &std::path::Path,
    n: usize,
) -> Result<Vec<Node>, Box<dyn std::error::Error>> {
    let secret = ddshard::ClusterSecret::generate();
    println!("cluster secret generated for this run (gossip authenticated, messaging encrypted)");
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..n {
        let mut cfg = NodeConfig {
            node_id: format!("node-{}", i + 1),
            data_dir: root.join(format!("node-{}", i + 1)),
            seeds: nodes.iter().map(|n| n.gossip_addr().into()).collect(),
            cluster_secret: Some(secret.clone()),
            ..base.clone()
        };
        cfg.membership.stable_after = Duration::from_secs(2);
        cfg.membership.down_removal_margin = Duration::from_secs(2);
        nodes.push(Node::start(cfg).await?);
    }
    // Up and reachable in every view: a durable write needs a majority of reachable replicas,
    // and right after joining a member may still wait for its first heartbeats (a loaded CI
    // machine failed the first increments with StateNotPersisted before this waited for it).
    wait_for("all members up and reachable", Duration::from_secs(30), || {
        nodes.iter().all(|x| {
            x.members().len() == n && x.members().iter().all(|m| m.status() == MemberStatus::Up && m.is_reachable())
        })
    })
    .await?;
    println!(
        "cluster formed: {}",
        nodes[0].members().iter().map(|m| m.node_id().to_string()).collect::<Vec<_>>().join(", ")
    );
    Ok(nodes)
}

/// Takes every counter to `increments`, one round of asks at a time, each round sent from
/// every node in turn (routing is location-transparent), with a progress bar.
async fn increment_all(
    regions: &[ShardRegion<Durable<Counter>>],
    ids: &[String],
    increments: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    let total = ids.len() as u64 * increments as u64;
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(indicatif::ProgressStyle::with_template("  {bar:40} {pos}/{len} increments ({per_sec})")?);
    let started = Instant::now();
    let mut retried = 0u32;
    for round in 0..increments {
        let mut asks = Vec::with_capacity(ids.len());
        for (k, id) in ids.iter().enumerate() {
            let r = regions[(k + round as usize) % regions.len()].clone();
            let id = id.clone();
            asks.push(tokio::spawn(async move { increment(&r, &id, round + 1).await }));
        }
        for a in asks {
            retried += a.await??;
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    println!(
        "\n{total} increments of {} counters in {:.2?} ({:.0} asks/s; {retried} sent again after a transient error)",
        ids.len(),
        elapsed,
        total as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}

/// Takes counter `id` to `to`; an error whose outcome is unknown (a state write a majority did
/// not acknowledge, a shard restarting, a timeout) is sent again, as a client would, which the
/// idempotent increment makes safe. Returns how many times it was sent again.
async fn increment(region: &ShardRegion<Durable<Counter>>, id: &str, to: i64) -> Result<u32, ddshard::Error> {
    let mut tries = 0;
    loop {
        match region.ask(id, CounterMsg::IncrementTo(to)).await {
            Ok(_) => return Ok(tries),
            Err(e) if tries < 20 => {
                tries += 1;
                tracing::debug!(%id, error = %e, "sending the increment again");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Every counter answers `expected` (a message lost with a node that just left or died is
/// asked again, as a client would).
async fn check_counters(
    region: &ShardRegion<Durable<Counter>>,
    ids: &[String],
    expected: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    for id in ids {
        let mut tries = 0;
        let v = loop {
            match region.ask(id, CounterMsg::Get).await {
                Ok(v) => break v,
                Err(e) if tries < 20 => {
                    tries += 1;
                    tracing::debug!(%id, error = %e, "asking again");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        if v != expected {
            return Err(format!("{id} is {v}, expected {expected}: a durable state was lost").into());
        }
    }
    Ok(())
}
