//! The deploy files (`deploy/`) are kept true: every `ddshard` flag they pass exists, every
//! setting they set (`DDSHARD__…` variables, `--set`) is one `ddshard node` takes, every metric
//! an alert reads is in the catalog with the label values it names, and every probe path the
//! Kubernetes manifest points at is a route of the admin API.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ddshard::NodeConfig;
use ddshard::testkit::TestCluster;
use tower::ServiceExt;

fn deploy_files() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push((path.clone(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy"), &mut out);
    out.sort();
    assert!(out.len() >= 5, "the deploy files: {:?}", out.iter().map(|(p, _)| p).collect::<Vec<_>>());
    out
}

/// Every token of `text` that starts with `prefix` and goes on with `[A-Za-z0-9_]`.
fn tokens(text: &str, prefix: &str, also: &[char]) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let after = &rest[i + prefix.len()..];
        let len =
            after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || also.contains(&c))).unwrap_or(after.len());
        if len > 0 {
            found.insert(format!("{prefix}{}", &after[..len]));
        }
        rest = &after[len..];
    }
    found
}

/// Whether `path` names a setting `ddshard node` takes (any value type).
fn is_setting(path: &str) -> bool {
    match NodeConfig::from_toml_str_with_overrides("", &[(path.to_string(), "\u{1}".to_string())]) {
        Ok(_) => true,
        Err(e) => !e.to_string().contains("unknown field"),
    }
}

#[test]
fn every_setting_and_flag_the_deploy_files_use_is_one_ddshard_node_takes() {
    let help = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ddshard")).args(args).output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let flags: BTreeSet<String> =
        [help(&["node", "--help"]), help(&["admin", "--help"])].iter().flat_map(|h| tokens(h, "--", &['-'])).collect();
    // Flags of the other tools the files run (cargo, docker, useradd, kubectl).
    let others = [
        "--release",
        "--locked",
        "--bin",
        "--from",
        "--system",
        "--uid",
        "--home-dir",
        "--create-home",
        "--from-literal",
    ];
    assert!(is_setting("membership.stable_after") && is_setting("membership.downing"), "the check itself");
    assert!(!is_setting("membership.no_such_thing") && !is_setting("no_such_section.x"), "the check itself");
    let mut checked = 0;
    for (path, text) in deploy_files() {
        for var in tokens(&text, "DDSHARD__", &[]) {
            let setting = var["DDSHARD__".len()..].to_ascii_lowercase().replace("__", ".");
            assert!(is_setting(&setting), "{}: {var} sets {setting:?}, which is no setting", path.display());
            checked += 1;
        }
        for line in text.lines().filter(|l| l.contains("--set ")) {
            for set in line.split("--set ").skip(1) {
                let key = set.split('=').next().unwrap().trim();
                assert!(is_setting(key), "{}: --set {key} is no setting", path.display());
                checked += 1;
            }
        }
        for flag in tokens(&text, "--", &['-']).into_iter().filter(|f| f.len() > 3 && !others.contains(&f.as_str())) {
            assert!(flags.contains(&flag), "{}: {flag} is no flag of ddshard node or ddshard admin", path.display());
            checked += 1;
        }
        for var in
            ["DDSHARD_CLUSTER_SECRET", "DDSHARD_ADMIN_TOKEN"].into_iter().filter(|v| text.contains(&format!("{v}=")))
        {
            assert!(help(&["node", "--help"]).contains(var) || var == NodeConfig::SECRET_ENV, "{var}");
        }
    }
    println!("{checked} settings and flags of the deploy files checked");
    assert!(checked >= 15, "the files set their nodes up through settings and flags: {checked}");
}

#[test]
fn every_metric_an_alert_reads_is_in_the_catalog_with_the_label_values_it_names() {
    let (_, alerts) = deploy_files().into_iter().find(|(p, _)| p.ends_with("prometheus/alerts.yml")).unwrap();
    let names = metrics_read(&alerts, "alerts.yml");
    assert!(names.len() >= 6, "{names:?}");
}

#[test]
fn the_grafana_dashboard_is_json_whose_every_panel_reads_metrics_of_the_catalog() {
    let (_, text) = deploy_files().into_iter().find(|(p, _)| p.ends_with("grafana/ddshard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut exprs = String::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{panel}");
        for t in targets {
            let expr = t["expr"].as_str().expect("a PromQL expression");
            assert!(expr.contains("ddshard_"), "{expr}");
            exprs.push_str(expr);
            exprs.push('\n');
        }
    }
    let names = metrics_read(&exprs, "grafana/ddshard.json");
    println!("the Grafana dashboard reads {} metrics in {} panels", names.len(), panels.len());
}

/// The catalog metrics `text` (PromQL) reads, each checked: in the catalog (a histogram by its
/// `_bucket`, `_sum` or `_count` series), with the labels and label values it names.
fn metrics_read(text: &str, file: &str) -> BTreeSet<String> {
    let names: BTreeSet<String> = tokens(text, "ddshard_", &[]);
    for name in &names {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|base| ddshard::metrics::CATALOG.iter().any(|d| d.name == *base))
            .unwrap_or(name);
        let def = ddshard::metrics::CATALOG
            .iter()
            .find(|d| d.name == base)
            .unwrap_or_else(|| panic!("{file} reads {name}, which the catalog does not have"));
        let alerts = text;
        // Label values it names, e.g. reason="slot_full" or reason=~"stale|replayed".
        for expr in alerts.split(name.as_str()).skip(1) {
            let Some(selector) = expr.strip_prefix('{').and_then(|s| s.split('}').next()) else { continue };
            for matcher in selector.split(',') {
                let (label, values) = matcher.split_once('=').unwrap();
                assert!(def.labels.split(',').any(|l| l == label.trim()), "{name} has no label {label}");
                for value in values.trim_start_matches('~').trim_matches('"').split('|') {
                    assert!(
                        def.help.contains(value),
                        "{name}{{{label}=\"{value}\"}}: not a value its help names ({})",
                        def.help
                    );
                }
            }
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_of_the_kubernetes_manifest_goes_to_the_probe_listener_and_is_one_of_its_routes() {
    let (_, manifest) = deploy_files().into_iter().find(|(p, _)| p.ends_with("kubernetes/ddshard.yaml")).unwrap();
    let paths: Vec<&str> = manifest.lines().filter_map(|l| l.trim().strip_prefix("path: ")).collect();
    assert_eq!(paths, ["/alive", "/ready"]);
    let ports: Vec<&str> = manifest.lines().filter_map(|l| l.trim().strip_prefix("port: ")).collect();
    assert!(ports.iter().filter(|p| **p == "probes").count() == 2, "both probes on the probes port: {ports:?}");
    assert!(manifest.contains(r#""--probe-addr", "0.0.0.0:8559""#), "the probe listener is started");
    assert!(manifest.contains("name: probes\n              containerPort: 8559"), "and named");
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(Duration::from_secs(30)).await;
    let app = ddshard::admin::probe_router(c.node(0).clone());
    for path in paths {
        let req = Request::builder().uri(path).body(Body::empty()).unwrap();
        let status = app.clone().oneshot(req).await.unwrap().status();
        assert!(status == StatusCode::OK || status == StatusCode::SERVICE_UNAVAILABLE, "{path}: {status}");
    }
    c.shutdown().await;
}
