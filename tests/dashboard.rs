//! The dashboard in a real headless Chromium: a 3-node cluster's page shows 3 members and the
//! shard and entity counts the cluster reports, and a screenshot is saved under `target/`.
//!
//! Needs `chromium` (Debian package; `.ci/run` installs it). Without it the test fails under
//! `CI=true` or `DDSHARD_REQUIRE_CHROMIUM=1` and otherwise skips, saying why.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use ddshard::admin::{AdminSettings, router};
use ddshard::testkit::{TestCluster, eventually};

const CONVERGE: Duration = Duration::from_secs(30);

fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        let out = std::process::Command::new("which").arg(name).output().ok()?;
        out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
}

/// Runs headless Chromium on `url` with `args`; returns its standard output.
async fn headless(browser: &PathBuf, url: &str, args: &[&str]) -> String {
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

/// The value of attribute `name` in each tag of `dom` that has `marker`.
fn attr_values(dom: &str, marker: &str, name: &str) -> Vec<String> {
    dom.split('<')
        .filter(|tag| tag.contains(marker))
        .filter_map(|tag| {
            let start = tag.find(&format!("{name}=\""))? + name.len() + 2;
            Some(tag[start..].split('"').next()?.to_string())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_of_a_three_node_cluster_shows_its_members_and_shard_counts_in_a_real_browser() {
    let Some(browser) = chromium() else {
        let required =
            std::env::var("CI").as_deref() == Ok("true") || std::env::var("DDSHARD_REQUIRE_CHROMIUM").is_ok();
        assert!(!required, "chromium is not installed (apt-get install chromium); required under CI");
        println!("SKIPPED: chromium is not installed (apt-get install chromium)");
        return;
    };
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ddshard::ShardingSettings { min_nr_of_members: 3, ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    for i in 0..45 {
        regions[0].ask(&format!("d{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    let n1 = c.node(0).clone();
    let server =
        ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), router(n1.clone(), AdminSettings::default()))
            .await
            .unwrap();
    // A snapshot: no event stream, which would hold the headless browser's virtual time.
    let url = format!("http://{}/?snapshot", server.local_addr);
    // What the cluster itself reports, per node: (shards, entities).
    let stats = regions[0].cluster_stats(Duration::from_secs(5)).await.unwrap();
    let expected: BTreeMap<String, (usize, usize)> = stats
        .regions
        .iter()
        .map(|(r, shards)| (r.node_id.to_string(), (shards.len(), shards.values().sum())))
        .collect();
    assert_eq!(expected.values().map(|(_, e)| e).sum::<usize>(), 45);

    let dom = eventually(CONVERGE, "the page loaded with three members", || {
        let (browser, url) = (browser.clone(), url.clone());
        async move {
            let dom = headless(&browser, &url, &["--dump-dom"]).await;
            (dom.contains(r#"data-loaded="true""#) && dom.contains(r#"<span id="member-count">3</span>"#))
                .then_some(dom)
        }
    })
    .await;
    assert_eq!(attr_values(&dom, "tr data-node=", "data-node").len(), 3, "three member rows");
    let shown: BTreeMap<String, (usize, usize)> = attr_values(&dom, "data-region=", "data-region")
        .into_iter()
        .zip(attr_values(&dom, "data-region=", "data-shards"))
        .zip(attr_values(&dom, "data-region=", "data-entities"))
        .map(|((r, s), e)| (r, (s.parse().unwrap(), e.parse().unwrap())))
        .collect();
    assert_eq!(shown, expected, "shards and entities per region as the cluster reports them");
    assert!(dom.contains("(coordinator)"), "the coordinator's region is marked");

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    headless(&browser, &url, &[&format!("--screenshot={}", shot.display()), "--window-size=1280,1100"]).await;
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a real picture: {} bytes", png.len());
    println!("dashboard screenshot: {}", shot.display());
    c.shutdown().await;
}
