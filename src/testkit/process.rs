//! `ddshard node` as real OS processes: spawn with a generated config, read the `READY` line,
//! talk to its admin HTTP API ([`crate::admin`]), SIGKILL or SIGTERM.
//!
//! Used by the multi-process tests, the network-namespace partition test and the fail-over
//! bench; `binary` is the `ddshard` executable (`env!("CARGO_BIN_EXE_ddshard")` there).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::admin::{MemberInfo, TypeStats};
use crate::config::SeedAddr;
use crate::error::{Error, Result};
use crate::service::KvReply;

/// How to start one node process.
#[derive(Debug, Clone)]
pub struct ProcessOptions {
    /// Node id.
    pub node_id: String,
    /// Cluster id.
    pub cluster_id: String,
    /// Where the config file (`<node_id>.toml`) and the data dir (`<node_id>/`) go.
    pub dir: PathBuf,
    /// Gossip addresses to join through, `ip:port` or `host:port` (empty: form a cluster).
    pub seeds: Vec<SeedAddr>,
    /// IP the node binds gossip, messaging and client sockets to (port 0 each, but gossip's
    /// with `gossip_port`).
    pub bind_ip: IpAddr,
    /// The IP peers reach it at when `bind_ip` is unspecified (`0.0.0.0`): gossip and messaging
    /// are advertised there, and the admin API binds there (the test reaches it).
    pub advertise_ip: Option<IpAddr>,
    /// Port of the gossip address (0: any free one), for seeds known before the start.
    pub gossip_port: u16,
    /// Extra lines of the `[membership]` section.
    pub membership_toml: String,
    /// Extra lines of the `[sharding]` section.
    pub sharding_toml: String,
    /// The IP messaging binds to instead of `bind_ip` (a second address of the host, so a
    /// test can cut the message path with a route and leave gossip flowing).
    pub messaging_ip: Option<IpAddr>,
    /// Extra lines of the `[replicator]` section.
    pub replicator_toml: String,
    /// Handed to the process in `DDSHARD_ADMIN_TOKEN` (mutating admin routes on); `None`: off.
    pub admin_token: Option<String>,
    /// A command the node runs under, e.g. `["ip", "netns", "exec", "ns1"]`.
    pub wrapper: Vec<String>,
    /// `--activation-log` file, if any.
    pub activation_log: Option<PathBuf>,
    /// Handed to the process in `DDSHARD_CLUSTER_SECRET` (not written to its config file).
    /// [`ProcessOptions::new`] sets [`TEST_PROCESS_SECRET`], so processes of one test are one
    /// authenticated cluster; `None` runs an open cluster (loopback only).
    pub cluster_secret: Option<String>,
    /// Handed to the process in `DDSHARD_ACCEPTED_CLUSTER_SECRETS` (comma-separated): secrets
    /// it accepts besides its own, for rotating the secret.
    pub accepted_cluster_secrets: Vec<String>,
    /// One config file for every node (`cluster.toml` in `dir`, the shared settings only);
    /// this node's own settings go on top as overrides: its id, data dir and gossip address
    /// as `--set` arguments, its messaging address and seeds as `DDSHARD__…` variables — the
    /// way a local cluster is started by hand from one file.
    pub shared_config_file: bool,
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
            advertise_ip: None,
            gossip_port: 0,
            membership_toml: String::new(),
            sharding_toml: String::new(),
            messaging_ip: None,
            replicator_toml: String::new(),
            admin_token: None,
            wrapper: Vec::new(),
            activation_log: None,
            cluster_secret: Some(TEST_PROCESS_SECRET.to_string()),
            accepted_cluster_secrets: Vec::new(),
            shared_config_file: false,
        }
    }

    /// The settings every node of a cluster shares (no node id, address, seed or data dir).
    fn shared_config_text(&self) -> String {
        format!(
            "cluster_id = \"{}\"\n[membership]\n{}\n[sharding]\n{}\n[replicator]\n{}\n",
            self.cluster_id, self.membership_toml, self.sharding_toml, self.replicator_toml
        )
    }

    /// `--set` arguments and `DDSHARD__…` variables with this node's own settings.
    fn own_settings(&self) -> (Vec<String>, Vec<(String, String)>) {
        let ip = SocketAddr::new(self.bind_ip, 0).ip();
        let mut set = vec![
            format!("node_id={}", self.node_id),
            format!("data_dir={}", self.dir.join(&self.node_id).display()),
            format!("gossip_addr={ip}:{}", self.gossip_port),
        ];
        let seeds: Vec<String> = self.seeds.iter().map(ToString::to_string).collect();
        let mut env = vec![
            ("DDSHARD__MESSAGING_ADDR".to_string(), SocketAddr::new(self.messaging_ip.unwrap_or(ip), 0).to_string()),
            ("DDSHARD__SEEDS".to_string(), seeds.join(",")),
        ];
        if let Some(adv) = self.advertise_ip {
            set.push(format!("gossip_advertise={}", SocketAddr::new(adv, self.gossip_port)));
            env.push(("DDSHARD__MESSAGING_ADVERTISE".to_string(), SocketAddr::new(adv, 0).to_string()));
        }
        (set.into_iter().flat_map(|a| ["--set".to_string(), a]).collect(), env)
    }

    fn config_text(&self) -> String {
        let seeds: Vec<String> = self.seeds.iter().map(|s| format!("\"{s}\"")).collect();
        let advertise = match self.advertise_ip {
            Some(adv) => format!(
                "gossip_advertise = \"{}\"\nmessaging_advertise = \"{}\"\n",
                SocketAddr::new(adv, self.gossip_port),
                SocketAddr::new(adv, 0)
            ),
            None => String::new(),
        };
        format!(
            "node_id = \"{}\"\ncluster_id = \"{}\"\ndata_dir = \"{}\"\nseeds = [{}]\n\
             gossip_addr = \"{ip}:{gossip_port}\"\nmessaging_addr = \"{messaging}\"\n{advertise}\
             [membership]\n{}\n[sharding]\n{}\n[replicator]\n{}\n",
            self.node_id,
            self.cluster_id,
            self.dir.join(&self.node_id).display(),
            seeds.join(", "),
            self.membership_toml,
            self.sharding_toml,
            self.replicator_toml,
            ip = SocketAddr::new(self.bind_ip, 0).ip(),
            gossip_port = self.gossip_port,
            messaging = SocketAddr::new(self.messaging_ip.unwrap_or(self.bind_ip), 0),
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
    /// Bound admin HTTP API address.
    pub admin: SocketAddr,
    /// The admin token it was started with (sent with its `kv` writes).
    admin_token: Option<String>,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Logs go to a file beside the config (appended across restarts), so a node that fails to
/// start says why in the error; `DDSHARD_TEST_LOG=stderr` shows them live instead.
fn stderr_to(log_path: &Path) -> Result<Stdio> {
    if std::env::var("DDSHARD_TEST_LOG").as_deref() == Ok("stderr") {
        return Ok(Stdio::inherit());
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .map_err(|e| Error::io("opening the node's log file", e))?;
    Ok(Stdio::from(file))
}

fn field(line: &str, name: &str) -> Option<SocketAddr> {
    line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}=")))?.parse().ok()
}

impl NodeProcess {
    /// Writes the config and starts the process; returns once it printed its `READY` line
    /// (at most `startup_timeout`; this blocks the calling thread for the node's start-up,
    /// typically well under a second). Its stderr (logs) is appended to `<dir>/<node_id>.stderr.log`,
    /// whose end a failed start quotes, or inherited with `DDSHARD_TEST_LOG=stderr`.
    pub fn spawn(binary: &Path, opts: &ProcessOptions, startup_timeout: Duration) -> Result<NodeProcess> {
        std::fs::create_dir_all(&opts.dir).map_err(|e| Error::io("creating the process dir", e))?;
        let (config, text, (own_args, own_env)) = if opts.shared_config_file {
            (opts.dir.join("cluster.toml"), opts.shared_config_text(), opts.own_settings())
        } else {
            (opts.dir.join(format!("{}.toml", opts.node_id)), opts.config_text(), Default::default())
        };
        // Written aside and renamed into place: nodes sharing one file may start together, and
        // none may read it half written.
        let aside = opts.dir.join(format!(".{}.toml.tmp", opts.node_id));
        std::fs::write(&aside, text).map_err(|e| Error::io("writing the node config", e))?;
        std::fs::rename(&aside, &config).map_err(|e| Error::io("writing the node config", e))?;
        let mut args: Vec<String> = opts.wrapper.clone();
        args.push(binary.display().to_string());
        args.extend(["node".into(), "--config".into(), config.display().to_string()]);
        args.extend(own_args);
        let admin_ip = opts.advertise_ip.unwrap_or(opts.bind_ip);
        args.extend(["--admin-addr".into(), SocketAddr::new(admin_ip, 0).to_string()]);
        if let Some(log) = &opts.activation_log {
            args.extend(["--activation-log".into(), log.display().to_string()]);
        }
        let log_path = opts.dir.join(format!("{}.stderr.log", opts.node_id));
        let stderr = stderr_to(&log_path)?;
        let mut command = Command::new(&args[0]);
        command.envs(own_env);
        match &opts.cluster_secret {
            Some(secret) => command.env(crate::NodeConfig::SECRET_ENV, secret),
            None => command.env_remove(crate::NodeConfig::SECRET_ENV),
        };
        match &opts.admin_token {
            Some(token) => command.env("DDSHARD_ADMIN_TOKEN", token),
            None => command.env_remove("DDSHARD_ADMIN_TOKEN"),
        };
        match opts.accepted_cluster_secrets.as_slice() {
            [] => command.env_remove(crate::NodeConfig::ACCEPTED_SECRETS_ENV),
            accepted => command.env(crate::NodeConfig::ACCEPTED_SECRETS_ENV, accepted.join(",")),
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
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(Error::Process(format!(
                "node {} did not start: {why}; the end of its log ({}):\n{}",
                opts.node_id,
                log_path.display(),
                tail.join("\n")
            )))
        };
        let (line, reader) = match rx.recv_timeout(startup_timeout) {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return fail(&mut child, e.to_string()),
            Err(_) => return fail(&mut child, format!("no READY line within {startup_timeout:?}")),
        };
        let (Some(gossip), Some(admin)) = (field(&line, "gossip"), field(&line, "admin")) else {
            return fail(&mut child, format!("unexpected first line {line:?}"));
        };
        Ok(NodeProcess {
            child,
            _stdout: reader,
            node_id: opts.node_id.clone(),
            gossip,
            admin,
            admin_token: opts.admin_token.clone(),
        })
    }

    /// One request to its admin HTTP API: the status and the body.
    pub async fn admin_request(&self, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
        admin_request_to(self.admin, method, path, body).await
    }

    /// [`NodeProcess::admin_request`] with the node's admin token, for mutating routes.
    pub async fn admin_request_with_token(&self, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
        request_to(self.admin, self.admin_token.as_deref(), method, path, body).await
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
            return Err(Error::Process(format!("kill -TERM {pid} failed")));
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
                return Err(Error::Process(format!("node {} still running after {timeout:?}", self.node_id)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the process has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// The admin API's answer to `GET path` as `T`; an error for any other status.
    pub async fn admin_get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T> {
        let (status, body) = self.admin_request("GET", path, "").await?;
        if status != 200 {
            return Err(Error::Process(format!("{}: GET {path}: {status} {body}", self.node_id)));
        }
        serde_json::from_str(&body).map_err(|e| Error::Codec(format!("{}: GET {path}: {e}: {body}", self.node_id)))
    }

    /// Members as this node sees them, oldest first.
    pub async fn members(&self) -> Result<Vec<MemberInfo>> {
        self.admin_get("/cluster/members").await
    }

    /// Cluster-wide entity counts of the sample `kv` type.
    pub async fn kv_stats(&self) -> Result<KvStats> {
        self.admin_get::<TypeStats>("/cluster/shards/kv").await.map(KvStats)
    }

    /// Reads `kv` entity `id`.
    pub async fn kv_get(&self, id: &str) -> Result<KvReply> {
        kv_get_at(self.admin, id).await
    }

    /// Writes `value` into `kv` entity `id`.
    pub async fn kv_put(&self, id: &str, value: &str) -> Result<KvReply> {
        let token = self.admin_token.as_deref();
        let (status, body) = request_to(self.admin, token, "PUT", &format!("/kv/{id}"), value).await?;
        if status != 200 {
            return Err(Error::Process(format!("{}: PUT /kv/{id}: {status} {body}", self.node_id)));
        }
        serde_json::from_str(&body).map_err(|e| Error::Codec(format!("PUT /kv/{id}: {e}: {body}")))
    }

    /// Asks `fetch` until `check` accepts its answer; panics with the last answer (or error)
    /// after `deadline`.
    pub async fn until<T: std::fmt::Debug>(
        &self,
        what: &str,
        deadline: Duration,
        fetch: impl AsyncFn(&NodeProcess) -> Result<T>,
        check: impl Fn(&T) -> bool,
    ) -> T {
        let end = Instant::now() + deadline;
        loop {
            let answer = fetch(self).await;
            if let Ok(a) = &answer
                && check(a)
            {
                return answer.expect("checked");
            }
            assert!(Instant::now() < end, "{}: {what} not within {deadline:?}; last answer {answer:?}", self.node_id);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until this node sees `up` Up members and `accept` holds for the list.
    pub async fn until_up(
        &self,
        up: usize,
        deadline: Duration,
        accept: impl Fn(&[MemberInfo]) -> bool,
    ) -> Vec<MemberInfo> {
        let what = format!("{up} members up");
        let up_and_accepted = |m: &Vec<MemberInfo>| m.iter().filter(|m| m.status == "up").count() == up && accept(m);
        self.until(&what, deadline, async |n: &NodeProcess| n.members().await, up_and_accepted).await
    }
}

/// One request to the admin HTTP API at `admin` (HTTP/1.1, `Connection: close`): the status
/// and the body.
pub async fn admin_request_to(admin: SocketAddr, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    request_to(admin, None, method, path, body).await
}

/// One request to the admin API at `admin`, with `token` as its bearer token if given.
async fn request_to(
    admin: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = |e| Error::io(format!("admin request {method} {path}"), e);
    let mut sock = tokio::net::TcpStream::connect(admin).await.map_err(io)?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {admin}\r\n{auth}Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(request.as_bytes()).await.map_err(io)?;
    let mut answer = String::new();
    sock.read_to_string(&mut answer).await.map_err(io)?;
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok());
    let status = status.ok_or_else(|| Error::Process(format!("not an HTTP answer: {answer:?}")))?;
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}

/// Reads `kv` entity `id` through the admin API at `admin`.
pub async fn kv_get_at(admin: SocketAddr, id: &str) -> Result<KvReply> {
    let (status, body) = admin_request_to(admin, "GET", &format!("/kv/{id}"), "").await?;
    if status != 200 {
        return Err(Error::Process(format!("GET /kv/{id}: {status} {body}")));
    }
    serde_json::from_str(&body).map_err(|e| Error::Codec(format!("GET /kv/{id}: {e}: {body}")))
}

/// Cluster-wide entity counts of the `kv` type ([`NodeProcess::kv_stats`]).
#[derive(Debug, Clone)]
pub struct KvStats(pub TypeStats);

impl KvStats {
    /// Entities over all regions, or `None` when a region did not answer.
    pub fn total(&self) -> Option<usize> {
        self.0.failed.is_empty().then(|| self.0.regions.values().flat_map(|s| s.values()).sum())
    }

    /// Entities per node id.
    pub fn by_node(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for (region, shards) in &self.0.regions {
            let node = region.split('#').next().unwrap_or(region).to_string();
            *out.entry(node).or_insert(0) += shards.values().sum::<usize>();
        }
        out
    }
}
