//! A real network partition between `ddshard node` processes, each in its own network
//! namespace on one bridge. The 2|3 cut is made with blackhole routes in both directions (only
//! `ip` from iproute2 is needed). Needs root; elsewhere the test prints why it skips.
//!
//! Asserts: the minority processes down themselves and exit; every remembered entity runs on
//! the majority without a message; the activation logs of all processes show no overlapping
//! activations (the minority stopped its entities before the majority started them) and growing
//! epochs; after healing, the minority restarts as new incarnations and receives shards again
//! by rebalance.
//!
//! It may skip only for the environment (no root, no `ip`, a host that cannot build or route
//! the test network), never for the product; under `CI=true` or `DDSHARD_REQUIRE_NETNS=1` a skip
//! fails. A run that got through writes `target/tmp/netns-partition-ran.txt`, which `.ci/run` prints.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ddshard::activation::{ActivationLog, check_activations};
use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions};

const NODES: usize = 5;
const IDS: usize = 40;
const STABLE_AFTER: Duration = Duration::from_millis(1500);
const MARGIN: Duration = Duration::from_millis(1500);
const SETTLE: Duration = Duration::from_secs(60);

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Namespaces `<prefix>n1..n5` with veths on one bridge; removed on drop.
struct Network {
    prefix: String,
    subnet: String,
}

impl Network {
    fn create() -> Result<Network, String> {
        remove_stale_networks();
        let pid = std::process::id();
        // A /24 no interface of this host uses yet.
        let used = Command::new("ip").args(["-4", "-o", "addr"]).output().map_err(|e| format!("ip: {e}"))?;
        let used = String::from_utf8_lossy(&used.stdout).to_string();
        let third = (0..250u32)
            .map(|k| (pid + k) % 250)
            .find(|x| !used.contains(&format!(" 10.213.{x}.")))
            .ok_or("no free 10.213.x.0/24 subnet")?;
        let net = Network { prefix: format!("dds{pid}"), subnet: format!("10.213.{third}") };
        let bridge = net.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        ip(&["addr", "add", &format!("{}.254/24", net.subnet), "dev", &bridge])?;
        for i in 0..NODES {
            let (ns, veth) = (net.ns(i), format!("{}v{i}", net.prefix));
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            ip(&["link", "set", &veth, "master", &bridge, "up"])?;
            ip(&["netns", "exec", &ns, "ip", "addr", "add", &format!("{}/24", net.addr(i)), "dev", "eth0"])?;
            ip(&["netns", "exec", &ns, "ip", "link", "set", "eth0", "up"])?;
            ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}n{}", self.prefix, i + 1)
    }

    fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }

    /// Blackhole routes both ways between the two sides.
    fn partition(&self, a: &[usize], b: &[usize], cut: bool) {
        for (from, to) in a.iter().flat_map(|x| b.iter().map(move |y| (*x, *y))) {
            for (x, y) in [(from, to), (to, from)] {
                let op = if cut { "add" } else { "del" };
                ip(&["netns", "exec", &self.ns(x), "ip", "route", op, "blackhole", &format!("{}/32", self.addr(y))])
                    .unwrap();
            }
        }
    }
}

/// Removes namespaces and bridges of earlier runs whose process is gone (a run killed before
/// its `Drop` could clean up).
fn remove_stale_networks() {
    let alive = |pid: &str| Path::new(&format!("/proc/{pid}")).exists();
    let pid_of = |name: &str| -> Option<String> {
        let digits: String = name.strip_prefix("dds")?.chars().take_while(char::is_ascii_digit).collect();
        (!digits.is_empty()).then_some(digits)
    };
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for name in String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()) {
            if pid_of(name).is_some_and(|p| !alive(&p)) {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "94: dds24657v1@if2: <…" — the bridge, or a veth whose namespace is gone.
            let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next()) else { continue };
            if pid_of(name).is_some_and(|p| !alive(&p)) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..NODES {
            // Deleting one end of a veth removes both at once; a namespace alone may linger.
            let _ = ip(&["link", "del", &format!("{}v{i}", self.prefix)]);
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

/// Skips (prints why and returns true), or fails the test when a run is required.
fn skip(why: &str) -> bool {
    let required = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("DDSHARD_REQUIRE_NETNS").as_deref() == Ok("1");
    assert!(
        !required,
        "the netns partition test cannot run here: {why} (required under CI=true / DDSHARD_REQUIRE_NETNS=1)"
    );
    eprintln!("SKIPPED netns partition test (allowed outside CI): {why}");
    true
}

/// Runs `f` on a thread that joined network namespace `ns` (`setns` moves only the calling
/// thread; a socket stays in the namespace it was created in).
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let file = std::fs::File::open(format!("/var/run/netns/{ns}")).map_err(|e| format!("open netns {ns}: {e}"))?;
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid namespace fd; setns changes only this short-lived thread.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns: {}", std::io::Error::last_os_error()));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| "netns probe thread panicked".to_string())?
}

/// Whether namespace 2 reaches a TCP listener in namespace 1 over the bridge (a host whose
/// firewall filters bridged traffic cannot run this test). Plain sockets: no product code.
fn bridge_probe(net: &Network) -> Result<(), String> {
    let addr: std::net::IpAddr = net.addr(0).parse().unwrap();
    let listener = in_netns(&net.ns(0), move || std::net::TcpListener::bind((addr, 0)))?
        .map_err(|e| format!("bind in {}: {e}", net.ns(0)))?;
    let target = listener.local_addr().map_err(|e| e.to_string())?;
    in_netns(&net.ns(1), move || std::net::TcpStream::connect_timeout(&target, Duration::from_secs(3)))?
        .map_err(|e| format!("{} cannot reach {target} in {}: {e}", net.ns(1), net.ns(0)))?;
    listener.accept().map_err(|e| e.to_string())?;
    Ok(())
}

fn skip_reason() -> Option<String> {
    let uid = Command::new("id").arg("-u").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if uid.as_deref() != Some("0") {
        return Some("network namespaces need root".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("`ip` (iproute2) is not installed".into());
    }
    None
}

struct Cluster<'a> {
    net: &'a Network,
    dir: PathBuf,
    procs: Vec<Option<NodeProcess>>,
    logs: Vec<PathBuf>,
}

impl Cluster<'_> {
    fn start(&mut self, i: usize, seeds: &[usize]) {
        let log = self.dir.join(format!("activations-n{}-{}.log", i + 1, self.logs.len()));
        let mut o = ProcessOptions::new(&format!("n{}", i + 1), "netns-test", &self.dir);
        o.bind_ip = self.net.addr(i).parse().unwrap();
        // Off loopback, `kv` writes need the admin token.
        o.admin_token = Some("netns-test-admin-token-0123456789abcdef".into());
        o.seeds = seeds.iter().filter_map(|s| self.procs[*s].as_ref().map(|p| p.gossip)).collect();
        o.wrapper = vec!["ip".into(), "netns".into(), "exec".into(), self.net.ns(i)];
        o.membership_toml = format!("stable_after = \"{STABLE_AFTER:?}\"\ndown_removal_margin = \"{MARGIN:?}\"");
        o.sharding_toml = "number_of_shards = 10\nremember_entities = true\nmin_nr_of_members = 5\n\
                           retry_interval = \"400ms\"\nrebalance_interval = \"1s\"\n"
            .into();
        o.activation_log = Some(log.clone());
        self.logs.push(log);
        self.procs[i] = Some(NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, SETTLE).unwrap());
    }

    fn node(&self, i: usize) -> &NodeProcess {
        self.procs[i].as_ref().expect("running")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_partition_two_three_minority_stops_first_no_overlap_and_rejoins_by_rebalance() {
    if let Some(why) = skip_reason()
        && skip(&why)
    {
        return;
    }
    let net = match Network::create() {
        Ok(n) => n,
        Err(e) if skip(&format!("cannot build the test network: {e}")) => return,
        Err(_) => unreachable!("skip() fails when a run is required"),
    };
    if let Err(e) = bridge_probe(&net)
        && skip(&format!("namespaces cannot reach each other over the bridge: {e}"))
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut c =
        Cluster { net: &net, dir: dir.path().to_path_buf(), procs: (0..NODES).map(|_| None).collect(), logs: vec![] };
    c.start(0, &[]);
    for i in 1..NODES {
        c.start(i, &[0]);
    }
    c.node(2).until_up(NODES, SETTLE, |_| true).await;
    for k in 0..IDS {
        c.node(k % NODES).kv_put(&format!("e{k}"), "v").await.unwrap();
    }
    // The admin API listens off loopback here: a write without the token is refused.
    let (status, body) = c.node(0).admin_request("PUT", "/kv/no-token", "v").await.unwrap();
    assert_eq!(status, 401, "{body}");
    let stats = async |n: &NodeProcess| n.kv_stats().await;
    let before = c.node(2).until("all entities counted", SETTLE, stats, |s: &KvStats| s.total() == Some(IDS)).await;
    let on_minority: usize = before.by_node().iter().filter(|(n, _)| *n == "n1" || *n == "n2").map(|(_, c)| c).sum();
    assert!(on_minority > 0, "the minority hosts some entities: {before:?}");

    let (minority, majority) = ([0, 1], [2, 3, 4]);
    let cut_at = Instant::now();
    let cut_wall = std::time::SystemTime::now();
    net.partition(&minority, &majority, true);
    for i in minority {
        let p = c.procs[i].as_mut().unwrap();
        let status = p.wait_exit(SETTLE).await.unwrap();
        assert!(!status.success(), "n{} exits because it was downed: {status}", i + 1);
        println!("n{} downed itself and exited {:?} after the cut", i + 1, cut_at.elapsed());
    }
    let moved = c
        .node(2)
        .until("every entity on the majority", SETTLE, stats, |s: &KvStats| {
            let by_node = s.by_node();
            s.total() == Some(IDS) && !by_node.contains_key("n1") && !by_node.contains_key("n2")
        })
        .await;
    println!("all {IDS} remembered entities run on the majority {:?} after the cut: {moved:?}", cut_at.elapsed());
    let acts = ActivationLog::load(&c.logs).unwrap();
    if let Err(v) = check_activations(&acts) {
        panic!("overlapping activations across the partition: {v:#?}");
    }
    // Every minority activation ended (logged by the exiting process), and the closest
    // hand-over of an id from the minority to the majority still left a gap.
    let on_min = |n: &str| n == "n1" || n == "n2";
    assert!(acts.iter().filter(|a| on_min(&a.node)).all(|a| a.stop.is_some()), "the minority stopped every entity");
    let gap = acts
        .iter()
        .filter(|a| on_min(&a.node))
        .filter_map(|old| {
            let next = acts
                .iter()
                .filter(|b| b.entity_id == old.entity_id && !on_min(&b.node) && b.start >= cut_wall)
                .map(|b| b.start)
                .min()?;
            next.duration_since(old.stop?).ok()
        })
        .min()
        .expect("some entity moved from the minority to the majority");
    println!("smallest gap between a minority stop and the majority start of the same id: {gap:?}");

    // Heal; the minority restarts as new incarnations and gets shards back by rebalance.
    net.partition(&minority, &majority, false);
    let restarted_at = std::time::SystemTime::now();
    for i in minority {
        c.procs[i] = None;
        c.start(i, &majority);
    }
    c.node(2).until_up(NODES, SETTLE, |m| m.iter().all(|m| m.status != "down")).await;
    let rebalanced = c
        .node(0)
        .until("entities back on the minority", SETTLE, stats, |s: &KvStats| {
            s.total() == Some(IDS) && s.by_node().iter().any(|(n, c)| (n == "n1" || n == "n2") && *c > 0)
        })
        .await;
    println!("after healing and restarting the minority: {rebalanced:?}");
    for i in 0..NODES {
        c.procs[i] = None; // SIGKILL: the last activations simply end
    }
    let acts = ActivationLog::load(&c.logs).unwrap();
    if let Err(v) = check_activations(&acts) {
        panic!("overlapping activations: {v:#?}");
    }
    let restarted_hosts = acts.iter().filter(|a| on_min(&a.node) && a.start >= restarted_at).count();
    assert!(restarted_hosts > 0, "the restarted minority hosts entities again");
    let ran = format!(
        "netns partition test ran: 2|3 cut, minority exited, {IDS} ids moved, gap {gap:?}, {restarted_hosts} activations on the restarted minority\n"
    );
    let marker = Path::new(env!("CARGO_TARGET_TMPDIR")).join("netns-partition-ran.txt");
    std::fs::write(&marker, &ran).unwrap();
    print!("{ran}");
}
