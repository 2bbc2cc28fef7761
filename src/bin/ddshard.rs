//! The `ddshard` command line: `demo` runs a local in-process cluster.

use std::time::Duration;

use clap::{Parser, Subcommand};
use ddshard::ddata::OrSet;
use ddshard::{Consistency, Node, NodeConfig};

#[derive(Parser)]
#[command(name = "ddshard", version, about = "Cluster sharding for peer-to-peer Rust clusters")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a local 3-node cluster with the embedded default settings and show it working.
    Demo {
        /// Number of nodes.
        #[arg(long, default_value_t = 3)]
        nodes: usize,
    },
}

const DEFAULT_CONFIG: &str = include_str!("../../config/default.toml");

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo { nodes } => demo(nodes).await,
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
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

fn print_members(title: &str, node: &Node) {
    println!("\n{title} (as seen by {})", node.node_id());
    println!("  {:<6} {:<10} {:<9} {:<10} messaging", "node", "status", "up-number", "reachable");
    for m in node.members() {
        let up = m.up_number().map_or("-".to_string(), |n| n.to_string());
        println!(
            "  {:<6} {:<10} {:<9} {:<10} {}",
            m.node_id(),
            format!("{:?}", m.status()),
            up,
            m.is_reachable(),
            m.messaging_addr()
        );
    }
}

async fn demo(n: usize) -> Result<(), Box<dyn std::error::Error>> {
    if n < 3 {
        return Err("the demo needs at least 3 nodes".into());
    }
    let base = NodeConfig::from_toml_str(DEFAULT_CONFIG)?;
    let root = tempfile::tempdir()?;
    println!("ddshard demo: {n} nodes on loopback, data under {}", root.path().display());
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..n {
        let cfg = NodeConfig {
            node_id: format!("node-{}", i + 1),
            data_dir: root.path().join(format!("node-{}", i + 1)),
            seeds: nodes.iter().map(Node::gossip_addr).collect(),
            ..base.clone()
        };
        nodes.push(Node::start(cfg).await?);
    }
    wait_for("all members up", Duration::from_secs(30), || {
        nodes
            .iter()
            .all(|x| x.members().len() == n && x.members().iter().all(|m| m.status() == ddshard::MemberStatus::Up))
    })
    .await?;
    print_members("cluster formed", &nodes[0]);

    let op = Duration::from_secs(5);
    for (i, node) in nodes.iter().enumerate() {
        node.replicator()
            .update::<OrSet, _>("durable-demo", Consistency::MAJORITY, op, move |s, ctx| {
                s.add(ctx, format!("written-by-node-{}", i + 1))
            })
            .await?;
    }
    let seen =
        nodes[n - 1].replicator().get::<OrSet>("durable-demo", Consistency::MAJORITY, op).await?.unwrap_or_default();
    println!("\nreplicated OR-set (majority writes from every node, majority read on node-{n}): {:?}", seen.members());

    println!("\nnode-2 leaves gracefully; node-3 is killed abruptly");
    nodes[1].leave().await?;
    nodes[2].shutdown().await;
    let watcher = nodes[0].clone();
    wait_for("node-2 removed and node-3 unreachable", Duration::from_secs(30), || {
        let ms = watcher.members();
        !ms.iter().any(|m| m.node_id() == "node-2") && ms.iter().any(|m| m.node_id() == "node-3" && !m.is_reachable())
    })
    .await?;
    print_members("after leave and crash", &nodes[0]);
    let local = nodes[0].replicator().get::<OrSet>("durable-demo", Consistency::Local, op).await?.unwrap_or_default();
    println!("\nnode-1 still holds {} replicated entries", local.len());
    println!("(cluster sharding lands on top of this foundation; see README)");
    for node in &nodes {
        node.shutdown().await;
    }
    Ok(())
}
