//! Metrics: `METRICS.md` equals the catalog, and a live cluster emits exactly the catalog's
//! series, each labelled with its node, with values that follow what the cluster did.
//! (One test: a process has one `metrics` recorder.)

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use ddshard::metrics::{CATALOG, MetricKind};
use ddshard::testkit::{TestCluster, eventually};

const CONVERGE: Duration = Duration::from_secs(30);

/// The rows of METRICS.md's table: (name, kind, labels, what).
fn documented() -> Vec<(String, String, String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/METRICS.md")).expect("METRICS.md");
    text.lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 4, "a row of four cells: {l}");
            (cells[0].trim_matches('`').into(), cells[1].into(), cells[2].into(), cells[3].into())
        })
        .collect()
}

fn kind_name(k: MetricKind) -> &'static str {
    match k {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
    }
}

/// One sample line of Prometheus text: (metric name, labels, value).
fn parse_sample(line: &str) -> (String, BTreeMap<String, String>, f64) {
    let (head, value) = line.rsplit_once(' ').expect("name and value");
    let (name, labels) = match head.split_once('{') {
        Some((n, rest)) => (n, rest.trim_end_matches('}')),
        None => (head, ""),
    };
    let labels = labels
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').expect("key=value");
            (k.to_string(), v.trim_matches('"').to_string())
        })
        .collect();
    (name.to_string(), labels, value.parse().expect("a number"))
}

/// The catalog name of a sample (histograms render `_bucket`, `_sum` and `_count` lines).
fn catalog_name(sample: &str) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = sample.strip_suffix(suffix)
            && CATALOG.iter().any(|m| m.name == base && m.kind == MetricKind::Histogram)
        {
            return base.to_string();
        }
    }
    sample.to_string()
}

fn sum(samples: &[(String, BTreeMap<String, String>, f64)], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| n == name && want.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)))
        .map(|(_, _, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_md_equals_the_catalog_and_a_live_cluster_emits_exactly_it_labelled_by_node() {
    let table: Vec<(String, String, String, String)> =
        CATALOG.iter().map(|m| (m.name.into(), kind_name(m.kind).into(), m.labels.into(), m.help.into())).collect();
    assert_eq!(documented(), table, "METRICS.md lists the catalog, row for row");
    for m in CATALOG {
        let unit_ok = match m.kind {
            MetricKind::Counter => m.name.ends_with("_total"),
            MetricKind::Histogram => m.name.ends_with("_seconds") || m.name.ends_with("_size"),
            MetricKind::Gauge => !m.name.ends_with("_total"),
        };
        assert!(unit_ok && m.name.starts_with("ddshard_"), "{}", m.name);
        assert!(m.labels.starts_with("node"), "{}: every series has its node", m.name);
    }

    let prometheus = ddshard::metrics::install_prometheus().expect("the only recorder of this process");
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    // Remembered entities: their ids are durable, so LMDB commits happen.
    let s = ddshard::ShardingSettings {
        min_nr_of_members: 3,
        remember: ddshard::sharding::RememberEntitiesSettings { enabled: true, ..settings().remember },
        ..settings()
    };
    let regions = start_everywhere(&c, &probe, s).await;
    let ids: Vec<String> = (0..30).map(|i| format!("m{i}")).collect();
    for id in &ids {
        regions[0].ask(id, CounterMsg::Add(1)).await.unwrap();
    }
    // A timed-out ask and a failed one, so every outcome is recorded.
    // A reliable-delivery producer: its series, and the deliveries its entities took.
    let producer = regions[0].producer("metrics", ddshard::sharding::ProducerSettings::default()).await.unwrap();
    for id in &ids[..3] {
        producer.send(id, CounterMsg::Add(0)).await.unwrap().await.unwrap();
    }
    let slow = regions[0].ask_with_timeout("m0", CounterMsg::SleepMs(300), Duration::from_millis(20)).await;
    assert!(matches!(slow, Err(ddshard::Error::AskTimeout { .. })), "{slow:?}");
    assert!(regions[0].ask("", CounterMsg::Get).await.is_err(), "an empty id is refused");
    regions[0].ask("m5", CounterMsg::Stop).await.unwrap(); // passivates itself

    let nodes: Vec<ddshard::Node> = c.running().map(|(_, n)| n.clone()).collect();
    let samples =
        eventually(CONVERGE, "every region registered, 29 entities running and remembered, batches settled", || {
            let (nodes, prometheus) = (nodes.clone(), prometheus.clone());
            async move {
                for n in &nodes {
                    n.sample_metrics().await;
                }
                let text = prometheus.render();
                let samples: Vec<_> =
                    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).map(parse_sample).collect();
                let registered = sum(&samples, "ddshard_region_registered", &[("type", "counter")]);
                let running = sum(&samples, "ddshard_region_entities", &[("type", "counter")]);
                let remembered = sum(&samples, "ddshard_remembered_entities", &[("type", "counter")]);
                // Histograms are recorded as a batch ends, counters copied at the sample: a remember
                // batch (m5's stop) ending between the two shows in one only. Settled, they agree
                // (checked below).
                let batches = sum(&samples, "ddshard_remember_batches_total", &[("type", "counter")]);
                let timed = sum(&samples, "ddshard_remember_write_seconds_count", &[("type", "counter")]);
                let ids = sum(&samples, "ddshard_remember_ids_written_total", &[("type", "counter")]);
                let sized = sum(&samples, "ddshard_remember_batch_size_sum", &[("type", "counter")]);
                let settled = batches == timed && ids == sized;
                // The producer publishes its own series each second.
                let produced = sum(&samples, "ddshard_producer_messages_total", &[("event", "confirmed")]) == 3.0;
                (registered == 3.0 && running == 29.0 && remembered == 29.0 && settled && produced).then_some(samples)
            }
        })
        .await;

    let emitted: BTreeSet<String> = samples.iter().map(|(n, _, _)| catalog_name(n)).collect();
    let catalog: BTreeSet<String> = CATALOG.iter().map(|m| m.name.to_string()).collect();
    assert_eq!(emitted, catalog, "emitted = catalog (left: emitted, right: catalog)");
    let node_ids: BTreeSet<&str> = ["n1", "n2", "n3"].into();
    for (name, labels, _) in &samples {
        let node = labels.get("node").map(String::as_str);
        assert!(node.is_some_and(|n| node_ids.contains(n)), "{name} {labels:?}: a node label");
        let def = CATALOG.iter().find(|m| m.name == catalog_name(name)).expect("in the catalog");
        let allowed: BTreeSet<&str> = def.labels.split(',').chain(["le"]).collect();
        for key in labels.keys() {
            assert!(allowed.contains(key.as_str()), "{name}: label {key} is not in the catalog's {}", def.labels);
        }
    }
    // Values follow what the cluster did.
    assert_eq!(sum(&samples, "ddshard_region_entities", &[("type", "counter")]), 29.0, "30 started, m5 passivated");
    for n in ["n1", "n2", "n3"] {
        assert_eq!(sum(&samples, "ddshard_members", &[("node", n), ("status", "up")]), 3.0, "{n} sees 3 up");
        assert_eq!(sum(&samples, "ddshard_unreachable_members", &[("node", n)]), 0.0);
    }
    assert_eq!(sum(&samples, "ddshard_coordinator_active", &[("node", "n1")]), 1.0, "the oldest runs it");
    assert_eq!(sum(&samples, "ddshard_coordinator_active", &[]), 1.0, "only the oldest");
    let asked = |outcome| sum(&samples, "ddshard_ask_seconds_count", &[("node", "n1"), ("outcome", outcome)]);
    assert!(asked("ok") >= 30.0, "{}", asked("ok"));
    assert_eq!(asked("timeout"), 1.0);
    assert_eq!(asked("error"), 1.0);
    assert!(sum(&samples, "ddshard_coordinator_state_write_seconds_count", &[("node", "n1")]) >= 1.0);
    assert!(sum(&samples, "ddshard_lmdb_commit_seconds_count", &[]) >= 1.0);
    assert!(sum(&samples, "ddshard_lmdb_commits_total", &[]) >= 1.0);
    assert!(sum(&samples, "ddshard_remember_ids_written_total", &[("type", "counter")]) >= 30.0);
    let batched = sum(&samples, "ddshard_remember_batch_size_sum", &[("type", "counter")]);
    assert_eq!(
        batched,
        sum(&samples, "ddshard_remember_ids_written_total", &[("type", "counter")]),
        "sizes sum to the ids"
    );
    let batches = sum(&samples, "ddshard_remember_write_seconds_count", &[("type", "counter")]);
    assert_eq!(batches, sum(&samples, "ddshard_remember_batches_total", &[("type", "counter")]));
    assert!(sum(&samples, "ddshard_transport_frames_sent_total", &[("node", "n1")]) > 0.0);
    assert!(sum(&samples, "ddshard_transport_bytes_sent_total", &[("node", "n1")]) > 0.0);
    assert!(sum(&samples, "ddshard_transport_bytes_received_total", &[("node", "n1")]) > 0.0);
    assert!(sum(&samples, "ddshard_entity_starts_total", &[("type", "counter")]) >= 30.0, "every entity started");
    assert_eq!(sum(&samples, "ddshard_entity_stops_total", &[("reason", "passivated")]), 1.0, "m5 passivated itself");
    assert_eq!(sum(&samples, "ddshard_entity_stops_total", &[("reason", "idle")]), 0.0);
    assert!(
        sum(&samples, "ddshard_entity_handle_seconds_count", &[("type", "counter")]) >= 31.0,
        "every handled message"
    );
    let homes = sum(&samples, "ddshard_shard_home_seconds_count", &[("node", "n1")]);
    assert!(homes >= 1.0, "n1 asked for homes and learnt them");
    let majority_ok =
        sum(&samples, "ddshard_replicator_updates_total", &[("consistency", "majority"), ("outcome", "ok")]);
    assert!(majority_ok >= 1.0, "the coordinator's and the remember writers' writes");
    assert_eq!(sum(&samples, "ddshard_replicator_updates_total", &[("outcome", "timeout")]), 0.0);
    assert_eq!(sum(&samples, "ddshard_downs_published_total", &[]), 0.0, "nobody was downed");
    let produced =
        |event| sum(&samples, "ddshard_producer_messages_total", &[("producer", "metrics"), ("event", event)]);
    assert_eq!((produced("stored"), produced("confirmed")), (3.0, 3.0));
    assert_eq!(sum(&samples, "ddshard_producer_unconfirmed", &[("node", "n1")]), 0.0);
    assert_eq!(sum(&samples, "ddshard_deliveries_total", &[("outcome", "handled")]), 3.0, "each taken once");
    assert_eq!(sum(&samples, "ddshard_deliveries_total", &[("outcome", "sent_back")]), 3.0, "one hello per entity");
    drop(producer);

    // n3's region hands its shards off (timed), then an operator downs n3 (counted).
    let n3_shards = sum(&samples, "ddshard_region_hosted_shards", &[("node", "n3")]);
    let before = samples;
    assert!(n3_shards > 0.0);
    regions[2].graceful_shutdown().await;
    c.node(0).down("n3").await.unwrap();
    for n in &nodes {
        n.sample_metrics().await;
    }
    let samples: Vec<_> =
        prometheus.render().lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).map(parse_sample).collect();
    let handoffs = sum(&samples, "ddshard_handoff_seconds_count", &[("node", "n3")]);
    assert_eq!(handoffs, n3_shards, "one timed hand-off per shard n3 hosted");
    assert_eq!(sum(&samples, "ddshard_handoffs_completed_total", &[("node", "n3")]), n3_shards);
    let n3_entities = sum(&before, "ddshard_region_entities", &[("node", "n3")]);
    assert_eq!(sum(&samples, "ddshard_entity_stops_total", &[("node", "n3"), ("reason", "handoff")]), n3_entities);
    assert_eq!(sum(&samples, "ddshard_downs_published_total", &[("node", "n1")]), 1.0, "n1 downed n3");
    c.shutdown().await;
}
