//! The dashboard in a real headless Chromium: a cluster of three `ddshard node` processes
//! started as the README says shows its 3 members and the per-region shard and entity counts
//! the cluster reports, and a screenshot is saved under `target/tmp/`.
//!
//! Needs `chromium` (Debian package; `.ci/run` installs it). Without it the test fails under
//! `CI=true` or `DDSHARD_REQUIRE_CHROMIUM=1` and otherwise skips, saying why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ddshard::testkit::process::{KvStats, NodeProcess, ProcessOptions};

const CONVERGE: Duration = Duration::from_secs(30);

fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        let out = std::process::Command::new("which").arg(name).output().ok()?;
        out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
}

/// Chromium, or `None` after saying the test skips (a failure under `CI=true` or
/// `DDSHARD_REQUIRE_CHROMIUM=1`).
fn chromium_or_skip() -> Option<PathBuf> {
    let browser = chromium();
    if browser.is_none() {
        let required =
            std::env::var("CI").as_deref() == Ok("true") || std::env::var("DDSHARD_REQUIRE_CHROMIUM").is_ok();
        assert!(!required, "chromium is not installed (apt-get install chromium); required under CI");
        println!("SKIPPED: chromium is not installed (apt-get install chromium)");
    }
    browser
}

/// Runs headless Chromium on `url` with `args`; returns its standard output.
async fn headless(browser: &Path, url: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(browser);
    cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--virtual-time-budget=6000"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output()).await.expect("chromium finished").unwrap();
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of attribute `name` in each tag of `dom` that contains `marker`.
fn attr_values(dom: &str, marker: &str, name: &str) -> Vec<String> {
    dom.split('<')
        .filter(|tag| tag.contains(marker))
        .filter_map(|tag| {
            let start = tag.find(&format!("{name}=\""))? + name.len() + 2;
            Some(tag[start..].split('"').next()?.to_string())
        })
        .collect()
}

fn spawn(dir: &Path, id: &str, seeds: &[&NodeProcess]) -> NodeProcess {
    let mut o = ProcessOptions::new(id, "dashboard-test", dir);
    o.seeds = seeds.iter().map(|s| s.gossip.into()).collect();
    o.sharding_toml = "number_of_shards = 20\nmin_nr_of_members = 3\nretry_interval = \"400ms\"\n".into();
    NodeProcess::spawn(Path::new(env!("CARGO_BIN_EXE_ddshard")), &o, Duration::from_secs(60)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_of_three_node_processes_shows_their_members_and_shard_counts_in_a_real_browser() {
    let Some(browser) = chromium_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let n1 = spawn(dir.path(), "n1", &[]);
    let n2 = spawn(dir.path(), "n2", &[&n1]);
    let n3 = spawn(dir.path(), "n3", &[&n1]);
    n1.until_up(3, CONVERGE, |_| true).await;
    for i in 0..45 {
        n1.kv_put(&format!("d{i}"), "v").await.unwrap();
    }
    // What the cluster itself reports, per node: (shards, entities).
    let stats = n1
        .until(
            "45 entities counted",
            CONVERGE,
            async |n: &NodeProcess| n.kv_stats().await,
            |s: &KvStats| s.total() == Some(45),
        )
        .await;
    let expected: BTreeMap<String, (usize, usize)> = stats
        .0
        .regions
        .iter()
        .map(|(r, shards)| (r.split('#').next().unwrap().to_string(), (shards.len(), shards.values().sum())))
        .collect();
    // A snapshot: no event stream, which would hold the headless browser's virtual time.
    let url = format!("http://{}/?snapshot", n1.admin);

    let deadline = tokio::time::Instant::now() + CONVERGE;
    let dom = loop {
        let dom = headless(&browser, &url, &["--dump-dom"]).await;
        if dom.contains(r#"data-loaded="true""#) && dom.contains(r#"<span id="member-count">3</span>"#) {
            break dom;
        }
        assert!(tokio::time::Instant::now() < deadline, "the page never showed three members: {dom}");
    };
    // n2 and n3 join at once, so either may be older: the order is the cluster's own.
    let oldest_first: Vec<String> = n1.members().await.unwrap().into_iter().map(|m| m.node_id).collect();
    assert_eq!(oldest_first.len(), 3);
    assert_eq!(oldest_first[0], "n1", "the seed is the oldest");
    assert_eq!(attr_values(&dom, "tr data-node=", "data-node"), oldest_first, "three member rows, oldest first");
    let shown: BTreeMap<String, (usize, usize)> = attr_values(&dom, "data-region=", "data-region")
        .into_iter()
        .zip(attr_values(&dom, "data-region=", "data-shards"))
        .zip(attr_values(&dom, "data-region=", "data-entities"))
        .map(|((r, s), e)| (r, (s.parse().unwrap(), e.parse().unwrap())))
        .collect();
    assert_eq!(shown, expected, "shards and entities per region as the cluster reports them");
    assert_eq!(shown.values().map(|(_, e)| e).sum::<usize>(), 45);
    assert!(dom.contains("n1 (coordinator)"), "the oldest's region is marked as the coordinator's");

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    headless(&browser, &url, &[&format!("--screenshot={}", shot.display()), "--window-size=1280,1100"]).await;
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a real picture: {} bytes", png.len());
    println!("dashboard screenshot: {}", shot.display());
    drop((n2, n3));
}

/// The admin router nested under `/admin` in an application's own axum server, which keeps its
/// own `/`, `/metrics` and fallback: the dashboard at `/admin` loads in a real browser (it
/// reaches every route relative to itself), and the application's routes are untouched.
/// (Before, the router's own fallback made merging it into such an app panic.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_router_nested_under_a_prefix_beside_the_applications_own_routes_serves_a_working_dashboard() {
    use axum::routing::get;
    let Some(browser) = chromium_or_skip() else { return };
    let mut c = ddshard::testkit::TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let node = c.node(0).clone();
    let app = axum::Router::new()
        .route("/", get(|| async { "the application's home" }))
        .route("/metrics", get(|| async { "the application's metrics" }))
        .nest("/admin", ddshard::admin::router(node.clone(), Default::default()))
        .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "the application's fallback") });
    let addr =
        ddshard::admin::serve(&node, "127.0.0.1:0".parse().unwrap(), app, Default::default()).await.unwrap().local_addr;
    let get_text = |path: &str| {
        let url = format!("http://{addr}{path}");
        let fetch = move || {
            let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
            let resp = agent.get(&url).call().unwrap();
            let status = resp.status().as_u16();
            (status, resp.into_body().read_to_string().unwrap())
        };
        async move { tokio::task::spawn_blocking(fetch).await.unwrap() }
    };
    assert_eq!(get_text("/").await, (200, "the application's home".to_string()));
    assert_eq!(get_text("/metrics").await, (200, "the application's metrics".to_string()));
    assert_eq!(get_text("/nowhere").await, (404, "the application's fallback".to_string()));
    let (status, members) = get_text("/admin/cluster/members").await;
    assert!(status == 200 && members.contains(r#""node_id":"n1""#), "{status} {members}");
    assert_eq!(
        get_text("/admin/nowhere").await,
        (404, "the application's fallback".to_string()),
        "no fallback of its own"
    );
    // axum routes a nested router's `/` at `/admin` (not `/admin/`).
    for page in ["/admin?snapshot"] {
        let url = format!("http://{addr}{page}");
        let deadline = tokio::time::Instant::now() + CONVERGE;
        loop {
            let dom = headless(&browser, &url, &["--dump-dom"]).await;
            if dom.contains(r#"data-loaded="true""#) && dom.contains(r#"<span id="member-count">1</span>"#) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{page}: the page never loaded its member: {dom}");
        }
    }
    c.shutdown().await;
}
