//! `ddshard node` as real OS processes: spawn with a generated config, read the `READY` line,
//! talk the client line protocol ([`crate::service`]), SIGKILL or SIGTERM.
//!
//! Used by the multi-process tests, the network-namespace partition test and the fail-over
//! bench; `binary` is the `ddshard` executable (`env!("CARGO_BIN_EXE_ddshard")` there).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How to start one node process.
#[derive(Debug, Clone)]
pub struct ProcessOptions {
    /// Node id.
    pub node_id: String,
    /// Cluster id.
    pub cluster_id: String,
    /// Where the config file (`<node_id>.toml`) and the data dir (`<node_id>/`) go.
    pub dir: PathBuf,
    /// Gossip addresses to join through (empty: form a cluster).
    pub seeds: Vec<SocketAddr>,
    /// IP the node binds gossip, messaging and client sockets to (port 0 each).
    pub bind_ip: IpAddr,
    /// Extra lines of the `[membership]` section.
    pub membership_toml: String,
    /// Extra lines of the `[sharding]` section.
    pub sharding_toml: String,
    /// A command the node runs under, e.g. `["ip", "netns", "exec", "ns1"]`.
    pub wrapper: Vec<String>,
    /// `--activation-log` file, if any.
    pub activation_log: Option<PathBuf>,
    /// Handed to the process in `DDSHARD_CLUSTER_SECRET` (not written to its config file).
    /// [`ProcessOptions::new`] sets [`TEST_PROCESS_SECRET`], so processes of one test are one
    /// authenticated cluster; `None` runs an open cluster (loopback only).
    pub cluster_secret: Option<String>,
}

/// The cluster secret [`ProcessOptions::new`] gives every test process.
pub const TEST_PROCESS_SECRET: &str = "ddshard-testkit-process-secret-not-for-production";

impl ProcessOptions {
    /// A node on loopback with default settings.
    pub fn new(node_id: &str, cluster_id: &str, dir: &Path) -> Self {
        ProcessOptions {
            node_id: node_id.to_string(),
            cluster_id: cluster_id.to_string(),
            dir: dir.to_path_buf(),
            seeds: Vec::new(),
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            membership_toml: String::new(),
            sharding_toml: String::new(),
            wrapper: Vec::new(),
            activation_log: None,
            cluster_secret: Some(TEST_PROCESS_SECRET.to_string()),
        }
    }

    fn config_text(&self) -> String {
        let seeds: Vec<String> = self.seeds.iter().map(|s| format!("\"{s}\"")).collect();
        format!(
            "node_id = \"{}\"\ncluster_id = \"{}\"\ndata_dir = \"{}\"\nseeds = [{}]\n\
             gossip_addr = \"{ip}:0\"\nmessaging_addr = \"{ip}:0\"\n\
             [membership]\n{}\n[sharding]\n{}\n",
            self.node_id,
            self.cluster_id,
            self.dir.join(&self.node_id).display(),
            seeds.join(", "),
            self.membership_toml,
            self.sharding_toml,
            ip = SocketAddr::new(self.bind_ip, 0).ip(),
        )
    }
}

/// A running `ddshard node` process; killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct NodeProcess {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    /// Node id.
    pub node_id: String,
    /// Bound gossip address (seed for others).
    pub gossip: SocketAddr,
    /// Bound client line-protocol address.
    pub client: SocketAddr,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, name: &str) -> Option<SocketAddr> {
    line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}=")))?.parse().ok()
}

impl NodeProcess {
    /// Writes the config and starts the process; returns once it printed its `READY` line
    /// (at most `startup_timeout`; this blocks the calling thread for the node's start-up,
    /// typically well under a second). Its stderr (logs) is discarded unless
    /// `DDSHARD_TEST_LOG=stderr`.
    pub fn spawn(binary: &Path, opts: &ProcessOptions, startup_timeout: Duration) -> Result<NodeProcess> {
        std::fs::create_dir_all(&opts.dir).map_err(|e| Error::io("creating the process dir", e))?;
        let config = opts.dir.join(format!("{}.toml", opts.node_id));
        std::fs::write(&config, opts.config_text()).map_err(|e| Error::io("writing the node config", e))?;
        let mut args: Vec<String> = opts.wrapper.clone();
        args.push(binary.display().to_string());
        args.extend(["node".into(), "--config".into(), config.display().to_string()]);
        args.extend(["--client-addr".into(), SocketAddr::new(opts.bind_ip, 0).to_string()]);
        if let Some(log) = &opts.activation_log {
            args.extend(["--activation-log".into(), log.display().to_string()]);
        }
        let stderr =
            if std::env::var("DDSHARD_TEST_LOG").as_deref() == Ok("stderr") { Stdio::inherit() } else { Stdio::null() };
        let mut command = Command::new(&args[0]);
        match &opts.cluster_secret {
            Some(secret) => command.env(crate::NodeConfig::SECRET_ENV, secret),
            None => command.env_remove(crate::NodeConfig::SECRET_ENV),
        };
        let mut child = command
            .args(&args[1..])
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", args[0]), e))?;
        let stdout = child.stdout.take().expect("piped stdout");
        // Read the READY line on a thread so a node that never prints cannot hang the caller.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let r = reader.read_line(&mut line).map(|_| (line, reader));
            let _ = tx.send(r);
        });
        let fail = |child: &mut Child, why: String| {
            let _ = child.kill();
            let _ = child.wait();
            Err(Error::Config(format!("node {} did not start: {why}", opts.node_id)))
        };
        let (line, reader) = match rx.recv_timeout(startup_timeout) {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return fail(&mut child, e.to_string()),
            Err(_) => return fail(&mut child, format!("no READY line within {startup_timeout:?}")),
        };
        let (Some(gossip), Some(client)) = (field(&line, "gossip"), field(&line, "client")) else {
            return fail(&mut child, format!("unexpected first line {line:?}"));
        };
        Ok(NodeProcess { child, _stdout: reader, node_id: opts.node_id.clone(), gossip, client })
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (graceful leave); waits up to `timeout` for the exit status.
    pub async fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().map_err(|e| Error::io("running kill", e))?;
        if !sent.success() {
            return Err(Error::Config(format!("kill -TERM {pid} failed")));
        }
        self.wait_exit(timeout).await
    }

    /// Waits up to `timeout` for the process to exit by itself (e.g. after being downed).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| Error::io("waiting for the node", e))? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(Error::Config(format!("node {} still running after {timeout:?}", self.node_id)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the process has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// One request line; the answer line.
    pub async fn call(&self, request: &str, timeout: Duration) -> Result<String> {
        crate::service::call(self.client, request, timeout).await
    }

    /// Repeats `request` until `check` accepts the answer; panics with the last answer after
    /// `deadline`. Errors count as answers `ERR …`.
    pub async fn until(&self, request: &str, deadline: Duration, check: impl Fn(&str) -> bool) -> String {
        let end = Instant::now() + deadline;
        loop {
            let answer = self.call(request, Duration::from_secs(2)).await.unwrap_or_else(|e| format!("ERR {e}"));
            if check(&answer) {
                return answer;
            }
            assert!(
                Instant::now() < end,
                "{}: {request} never satisfied the check within {deadline:?}; last answer {answer:?}",
                self.node_id
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Sum of entity counts in a `STATS` answer, or `None` if it is not one or a region failed to
/// answer.
pub fn stats_total(answer: &str) -> Option<usize> {
    let body = answer.strip_prefix("STATS")?;
    let (regions, failed) = body.split_once("FAILED")?;
    if !failed.trim().is_empty() {
        return None;
    }
    Some(regions.split_whitespace().filter_map(|r| r.split_once('=')?.1.parse::<usize>().ok()).sum())
}

/// Entity count per node in a `STATS` answer.
pub fn stats_by_node(answer: &str) -> Vec<(String, usize)> {
    let body = answer.strip_prefix("STATS").unwrap_or("");
    let regions = body.split_once("FAILED").map_or(body, |(r, _)| r);
    regions
        .split_whitespace()
        .filter_map(|r| {
            let (n, c) = r.split_once('=')?;
            Some((n.to_string(), c.parse().ok()?))
        })
        .collect()
}
