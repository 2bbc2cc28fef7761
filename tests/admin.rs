//! The admin HTTP API: every route on a live 3-node cluster through the axum Router, the
//! token rules of mutating routes, bad input, membership events over SSE, and `serve` on a
//! real socket.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use ddshard::admin::{AdminSettings, router};
use ddshard::testkit::{TestCluster, eventually};
use futures::StreamExt;
use serde_json::Value;
use tower::ServiceExt;

const CONVERGE: Duration = Duration::from_secs(30);
const TOKEN: &str = "s3cret-token";

/// Sends one request to the router; returns the status and the body as JSON (or as a JSON
/// string when it is not JSON).
async fn call(app: &axum::Router, method: &str, uri: &str, token: Option<&str>, body: &str) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app.clone().oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24).await.unwrap();
    let value =
        serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value)
}

async fn get(app: &axum::Router, uri: &str) -> (StatusCode, Value) {
    call(app, "GET", uri, None, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_route_answers_on_a_live_cluster_and_refuses_bad_input_with_its_status() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s =
        ddshard::ShardingSettings { min_nr_of_members: 3, rebalance_interval: Duration::from_secs(3600), ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    for i in 0..30 {
        regions[0].ask(&format!("a{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings { token: Some(TOKEN.into()), ..Default::default() });

    let (status, alive) = get(&app, "/alive").await;
    assert_eq!((status, &alive["alive"], &alive["node"]), (StatusCode::OK, &Value::Bool(true), &Value::from("n1")));
    let ready_app = app.clone();
    eventually(CONVERGE, "ready", || {
        let app = ready_app.clone();
        async move { (get(&app, "/ready").await.0 == StatusCode::OK).then_some(()) }
    })
    .await;

    let (status, members) = get(&app, "/cluster/members").await;
    assert_eq!(status, StatusCode::OK);
    let members = members.as_array().expect("a list").clone();
    assert_eq!(members.len(), 3);
    assert!(members.iter().all(|m| m["status"] == "up" && m["reachable"] == true), "{members:?}");
    assert_eq!(members.iter().filter(|m| m["is_self"] == true).count(), 1);
    let (status, n2) = get(&app, "/cluster/members/n2").await;
    assert_eq!((status, &n2["node_id"]), (StatusCode::OK, &Value::from("n2")));
    let (status, err) = get(&app, "/cluster/members/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(err["error"].as_str().is_some_and(|e| e.contains("nope")), "{err}");

    let (status, types) = get(&app, "/cluster/shards").await;
    assert_eq!((status, types), (StatusCode::OK, serde_json::json!([{ "type_name": "counter", "proxy": false }])));
    let (status, stats) = get(&app, "/cluster/shards/counter").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stats["regions"].as_object().expect("regions").len(), 3);
    let total: u64 = stats["regions"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|shards| shards.as_object().unwrap().values().map(|v| v.as_u64().unwrap()))
        .sum();
    assert_eq!(total, 30);
    assert_eq!(stats["failed"], serde_json::json!([]));
    assert_eq!(get(&app, "/cluster/shards/nope").await.0, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, "/cluster/shards/nope/allocation").await.0, StatusCode::NOT_FOUND);

    let (status, table) = get(&app, "/cluster/shards/counter/allocation").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(table["coordinator"], Value::from(n1.address().to_string()));
    let (status, located) = get(&app, "/cluster/shards/counter/entities/a1").await;
    assert_eq!(status, StatusCode::OK);
    let host = where_is(&regions[0], "a1").await;
    assert!(located["home"].as_str().is_some_and(|h| h.starts_with(&format!("{host}#"))), "{located}");
    let shard = located["shard"].as_str().unwrap().to_string();
    let (status, explained) = get(&app, &format!("/cluster/shards/counter/shards/{shard}/explain")).await;
    assert_eq!((status, &explained["home"]), (StatusCode::OK, &located["home"]));
    assert_eq!(get(&app, "/cluster/shards/counter/shards/zzz/explain").await.0, StatusCode::NOT_FOUND);

    // Rebalance: a dry run needs no token; a real round needs the right one.
    let (status, plan) = call(&app, "POST", "/cluster/shards/counter/rebalance?dry_run=true", None, "").await;
    assert_eq!((status, &plan["executed"]), (StatusCode::OK, &Value::Bool(false)));
    let rebalance = "/cluster/shards/counter/rebalance";
    assert_eq!(call(&app, "POST", rebalance, None, "").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&app, "POST", rebalance, Some("wrong"), "").await.0, StatusCode::UNAUTHORIZED);
    let (status, done) = call(&app, "POST", rebalance, Some(TOKEN), "").await;
    assert_eq!((status, &done["executed"]), (StatusCode::OK, &Value::Bool(true)));
    let no_token = router(n1.clone(), AdminSettings::default());
    assert_eq!(call(&no_token, "POST", rebalance, Some(TOKEN), "").await.0, StatusCode::FORBIDDEN);
    let leave = r#"{"operation": "leave"}"#;
    assert_eq!(call(&no_token, "PUT", "/cluster/members/n3", Some(TOKEN), leave).await.0, StatusCode::FORBIDDEN);

    // Bad input.
    let put = |body: &'static str| call(&app, "PUT", "/cluster/members/n3", Some(TOKEN), body);
    assert_eq!(put("{not json").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(put(r#"{"operation": "explode"}"#).await.0, StatusCode::BAD_REQUEST);
    assert_eq!(put(r#"{"operation": "leave", "extra": 1}"#).await.0, StatusCode::BAD_REQUEST);
    let huge = format!(r#"{{"operation": "{}"}}"#, "x".repeat(100 * 1024));
    assert_eq!(call(&app, "PUT", "/cluster/members/n3", Some(TOKEN), &huge).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(call(&app, "PUT", "/cluster/members/nope", Some(TOKEN), leave).await.0, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, "/metrics").await.0, StatusCode::NOT_FOUND, "no exporter in these settings");
    // No fallback of its own (it merges into any app); `no_such_route` is the JSON one.
    assert_eq!(get(&app, "/no/such/route").await.0, StatusCode::NOT_FOUND);
    let with_fallback = app.clone().fallback(ddshard::admin::no_such_route);
    let (status, err) = get(&with_fallback, "/no/such/route").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(err["error"].is_string());

    // Member operations: n3 is asked to leave (through n1), n2 is downed.
    let (status, accepted) = call(&app, "PUT", "/cluster/members/n3", Some(TOKEN), leave).await;
    assert_eq!((status, &accepted["operation"]), (StatusCode::ACCEPTED, &Value::from("leave")));
    let app3 = app.clone();
    eventually(CONVERGE, "n3 left", || {
        let app = app3.clone();
        async move {
            let (_, m) = get(&app, "/cluster/members").await;
            (!m.as_array()?.iter().any(|m| m["node_id"] == "n3")).then_some(())
        }
    })
    .await;
    let (status, _) = call(&app, "PUT", "/cluster/members/n2", Some(TOKEN), r#"{"operation": "down"}"#).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let app2 = app.clone();
    eventually(CONVERGE, "n2 downed and removed", || {
        let app = app2.clone();
        async move {
            let (_, m) = get(&app, "/cluster/members").await;
            (m.as_array()?.len() == 1).then_some(())
        }
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_events_stream_as_server_sent_events_and_serve_answers_on_a_real_socket() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings::default());
    let resp = app.clone().oneshot(Request::get("/cluster/events").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let mut stream = resp.into_body().into_data_stream();
    c.node(1).leave().await.unwrap();
    // Read events until n2's removal shows up (the statuses in between may pass between two
    // of n1's snapshots, so they are not waited for).
    let mut seen = String::new();
    let found = tokio::time::timeout(CONVERGE, async {
        while let Some(chunk) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if seen.contains("event: removed") && seen.contains("\"address\":\"n2#") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(found, Ok(true), "events seen: {seen}");

    // `serve` on port 0, asked over plain TCP.
    let server = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, Default::default()).await.unwrap();
    let mut sock = tokio::net::TcpStream::connect(server.local_addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    sock.write_all(b"GET /alive HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    sock.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""alive":true"#), "{answer}");
    c.shutdown().await;
}

/// Rows of a members table whose status cell (the second) is `status`.
fn rows_with_status(table: &str, status: &str) -> usize {
    table.lines().filter(|l| l.split('┆').nth(1).is_some_and(|cell| cell.trim() == status)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_cli_prints_members_types_shards_allocation_explanations_locations_and_plans() {
    use ddshard::admin::cli::{AdminClient, AdminCommand as A};
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let s = ddshard::ShardingSettings { min_nr_of_members: 3, ..settings() };
    let regions = start_everywhere(&c, &probe, s).await;
    for i in 0..12 {
        regions[0].ask(&format!("c{i}"), CounterMsg::Add(1)).await.unwrap();
    }
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings { token: Some(TOKEN.into()), ..Default::default() });
    let server = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, Default::default()).await.unwrap();
    let url = format!("http://{}", server.local_addr);
    let shard = regions[0].shard_id("c1");
    let host = where_is(&regions[0], "c1").await;
    let client = AdminClient { url: url.clone(), token: Some(TOKEN.into()), timeout: Duration::from_secs(10) };
    let run = |cmd: A, json: bool| {
        let client = client.clone();
        tokio::task::spawn_blocking(move || client.run(&cmd, json))
    };
    let members = run(A::Members, false).await.unwrap().unwrap();
    for n in ["n1 *", "n2", "n3"] {
        assert!(members.contains(n), "{members}");
    }
    assert_eq!(rows_with_status(&members, "up"), 3, "{members}");
    let types = run(A::Types, false).await.unwrap().unwrap();
    assert!(types.contains("counter") && types.contains("false"), "{types}");
    let shards = run(A::Shards { type_name: "counter".into() }, false).await.unwrap().unwrap();
    assert_eq!(shards.matches('#').count(), 3, "three regions: {shards}");
    let table = run(A::Allocation { type_name: "counter".into() }, false).await.unwrap().unwrap();
    assert!(table.contains(&format!("coordinator {}", n1.address())), "{table}");
    let explained =
        run(A::Explain { type_name: "counter".into(), shard: shard.clone() }, false).await.unwrap().unwrap();
    assert!(explained.contains(&format!("shard {shard}: on {host}#")), "{explained}");
    assert!(explained.contains("allocated"), "its history: {explained}");
    let located = run(A::Locate { type_name: "counter".into(), entity_id: "c1".into() }, false).await.unwrap().unwrap();
    assert!(located.contains(&format!("{host}#")) && located.contains(&shard), "{located}");
    let plan = run(A::Rebalance { type_name: "counter".into(), dry_run: true }, true).await.unwrap().unwrap();
    let plan: Value = serde_json::from_str(&plan).expect("--json prints the API's JSON");
    assert_eq!(plan["executed"], Value::Bool(false));
    let missing = run(A::Explain { type_name: "nope".into(), shard: "1".into() }, false).await.unwrap();
    assert!(missing.is_err_and(|e| e.to_string().contains("404")), "an unknown type is an error naming the status");
    let no_token = AdminClient { token: None, ..client.clone() };
    let refused =
        tokio::task::spawn_blocking(move || no_token.run(&A::Down { node_id: "n3".into() }, false)).await.unwrap();
    assert!(refused.is_err_and(|e| e.to_string().contains("401")));

    // The binary itself, as an operator runs it.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ddshard"))
        .args(["admin", "--url", &url, "members"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(rows_with_status(&String::from_utf8_lossy(&out.stdout), "up"), 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_admin_token_turns_mutating_routes_off_instead_of_letting_an_empty_bearer_in() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let leave = r#"{"operation": "leave"}"#;
    for token in ["", "  "] {
        let app = router(c.node(0).clone(), AdminSettings { token: Some(token.into()), ..Default::default() });
        for given in [Some(""), Some(token), None] {
            let (status, err) = call(&app, "PUT", "/cluster/members/n1", given, leave).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "token {token:?}, bearer {given:?}: {err}");
        }
    }
    assert!(c.node(0).members().iter().any(|m| m.node_id() == "n1"), "n1 never left");
    c.shutdown().await;
}

/// Sends `request` on a fresh connection to `addr`; the whole answer (the server closes).
async fn raw_http(addr: std::net::SocketAddr, request: &str) -> String {
    try_raw_http(addr, request).await.expect("an answer")
}

/// [`raw_http`], `Err` when the connection is refused or reset.
async fn try_raw_http(addr: std::net::SocketAddr, request: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    sock.read_to_string(&mut answer).await?;
    Ok(answer)
}

/// Whether the server closed `sock` (a read ends), waiting at most `within`.
async fn closed_by_server(sock: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    matches!(tokio::time::timeout(within, sock.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_silent_connections_on_the_admin_port_neither_keep_ready_from_answering_nor_stop_messaging() {
    use tokio::io::AsyncWriteExt;
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let regions = start_everywhere(&c, &probe, ddshard::ShardingSettings { min_nr_of_members: 3, ..settings() }).await;
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings::default());
    let limits = ddshard::admin::ServeSettings { max_connections: 256, ..Default::default() };
    let addr = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, limits).await.unwrap().local_addr;
    let ready = "GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    eventually(CONVERGE, "ready before the flood", || async move {
        raw_http(addr, ready).await.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
    // A thousand clients each send part of a request head and then nothing (slowloris).
    let mut silent = Vec::new();
    for _ in 0..1000 {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(b"GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.unwrap();
        silent.push(sock);
    }
    // A probe is answered at once, and so is an ask through the node's messaging.
    let started = std::time::Instant::now();
    let answer =
        tokio::time::timeout(Duration::from_secs(2), raw_http(addr, ready)).await.expect("answered within 2 s");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    println!("/ready with 1,000 silent connections open: answered in {:?}", started.elapsed());
    for i in 0..20 {
        regions[1].ask(&format!("flood{i}"), CounterMsg::Add(1)).await.expect("messaging unaffected");
    }
    // The listener kept at most its cap: the oldest silent connections were evicted.
    let mut closed = 0;
    for sock in &mut silent[..744] {
        if closed_by_server(sock, Duration::from_millis(100)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 744, "the 744 oldest of 1,000 silent connections evicted for newer ones");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_sends_no_complete_request_head_is_closed_after_the_header_read_timeout() {
    use tokio::io::AsyncWriteExt;
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings::default());
    let limits = ddshard::admin::ServeSettings { header_read_timeout: Duration::from_secs(1), ..Default::default() };
    let addr = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, limits).await.unwrap().local_addr;
    let started = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut trickle = tokio::net::TcpStream::connect(addr).await.unwrap();
    trickle.write_all(b"GET /alive HTTP/1.1\r\n").await.unwrap();
    // A kept-alive connection that was answered once and then goes silent.
    let mut kept = tokio::net::TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /alive HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::io::AsyncReadExt::read(&mut kept, &mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    assert!(closed_by_server(&mut silent, Duration::from_secs(10)).await, "a silent connection is closed");
    assert!(closed_by_server(&mut trickle, Duration::from_secs(10)).await, "a partial head is closed");
    assert!(closed_by_server(&mut kept, Duration::from_secs(10)).await, "an idle kept-alive one is closed");
    assert!(started.elapsed() >= Duration::from_millis(900), "not before the timeout: {:?}", started.elapsed());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_host_is_a_name_not_allowed_is_refused_so_dns_rebinding_cannot_reach_the_api() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings::default());
    let settings =
        ddshard::admin::ServeSettings { allowed_hosts: vec!["ddshard-0.ddshard".into()], ..Default::default() };
    let addr = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, settings).await.unwrap().local_addr;
    let alive = |host: &str| format!("GET /alive HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let refused = raw_http(addr, &alive("evil.example:8558")).await;
    assert!(refused.starts_with("HTTP/1.1 421"), "{refused}");
    assert!(refused.contains("Host not allowed"), "{refused}");
    for host in [addr.to_string(), "localhost:8558".into(), "ddshard-0.ddshard:8558".into()] {
        let answer = raw_http(addr, &alive(&host)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{host}: {answer}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_listener_answers_alive_and_ready_and_nothing_else() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let probes = ddshard::admin::probe_router(n1.clone());
    assert_eq!(get(&probes, "/alive").await.0, StatusCode::OK);
    let status = get(&probes, "/ready").await.0;
    assert!(status == StatusCode::OK || status == StatusCode::SERVICE_UNAVAILABLE, "{status}");
    for route in ["/cluster/members", "/metrics", "/"] {
        assert_eq!(get(&probes, route).await.0, StatusCode::NOT_FOUND, "{route}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_writes_with_a_write_token_need_it_and_reads_do_not() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let s = ddshard::ShardingSettings { min_nr_of_members: 1, ..settings() };
    let region = n1.sharding().start_durable("kv", |_: &str| ddshard::service::KvEntity::new("n1"), s).await.unwrap();
    let kv = ddshard::service::kv_routes(region.clone(), Some(TOKEN.into()));
    assert_eq!(call(&kv, "PUT", "/kv/a", None, "1").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&kv, "DELETE", "/kv/a", Some("wrong"), "").await.0, StatusCode::UNAUTHORIZED);
    let (status, put) = call(&kv, "PUT", "/kv/a", Some(TOKEN), "1").await;
    assert_eq!((status, &put["value"]), (StatusCode::OK, &Value::from("1")));
    let (status, got) = get(&kv, "/kv/a").await;
    assert_eq!((status, &got["value"]), (StatusCode::OK, &Value::from("1")), "reads need no token");
    let (status, err) = get(&kv, &format!("/kv/{}", "x".repeat(5000))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "an id over the limit is the client's error: {err}");
    // An empty token turns writes off.
    let off = ddshard::service::kv_routes(region, Some(String::new()));
    assert_eq!(call(&off, "PUT", "/kv/a", Some(""), "2").await.0, StatusCode::FORBIDDEN);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_trickling_request_bodies_into_every_slot_cannot_keep_ready_from_answering() {
    use tokio::io::AsyncWriteExt;
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let n1 = c.node(0).clone();
    let app = router(n1.clone(), AdminSettings { token: Some(TOKEN.into()), ..Default::default() });
    let limits = ddshard::admin::ServeSettings {
        max_connections: 16,
        header_read_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let addr = ddshard::admin::serve(&n1, "127.0.0.1:0".parse().unwrap(), app, limits).await.unwrap().local_addr;
    // Every slot holds a request whose handler waits for a body that never comes: each client
    // sends its head, waits for `100 Continue` (its handler is reading the body), then one byte.
    let mut trickling = Vec::new();
    for _ in 0..16 {
        use tokio::io::AsyncReadExt;
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = "PUT /cluster/members/n1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 60000\r\nExpect: 100-continue\r\n\r\n";
        sock.write_all(head.as_bytes()).await.unwrap();
        let mut buf = [0u8; 64];
        let n = sock.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 100"), "{}", String::from_utf8_lossy(&buf[..n]));
        sock.write_all(b"{").await.unwrap();
        trickling.push(sock);
    }
    // Every slot busy with a young request: a new connection is refused.
    let refused = try_raw_http(addr, "GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await;
    assert!(!matches!(&refused, Ok(a) if a.starts_with("HTTP/")), "closed unanswered at the cap: {refused:?}");
    // Past the grace of a slow request, a probe takes the oldest one's slot.
    let ready = "GET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    let answered = eventually(Duration::from_secs(10), "a probe answered", || async move {
        let answer = tokio::time::timeout(Duration::from_secs(2), try_raw_http(addr, ready)).await.ok()?.ok()?;
        answer.starts_with("HTTP/1.1 ").then_some(answer)
    })
    .await;
    assert!(answered.starts_with("HTTP/1.1 200") || answered.starts_with("HTTP/1.1 503"), "{answered}");
    let mut closed = Vec::new();
    for (i, sock) in trickling.iter_mut().enumerate() {
        if closed_by_server(sock, Duration::from_millis(200)).await {
            closed.push(i);
        }
    }
    assert_eq!(closed, [0], "the oldest trickling request was cut for the probe");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_router_merges_into_an_application_with_its_own_fallback() {
    use axum::routing::get as route_get;
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let app = axum::Router::new()
        .route("/app", route_get(|| async { "the application" }))
        .fallback(|| async { (StatusCode::IM_A_TEAPOT, "the application's fallback") })
        .merge(router(c.node(0).clone(), AdminSettings::default()));
    let (status, members) = get(&app, "/cluster/members").await;
    assert!(status == StatusCode::OK && members.as_array().is_some_and(|m| m.len() == 1), "{status} {members}");
    assert_eq!(get(&app, "/app").await, (StatusCode::OK, Value::from("the application")));
    assert_eq!(get(&app, "/nowhere").await.0, StatusCode::IM_A_TEAPOT, "the application's own fallback");
    c.shutdown().await;
}

/// Issue 42, step 4: `GET /cluster/daemons/{name}` shows a daemon process's scale and `PUT`
/// with `{"count": N}` rescales it cluster-wide (with the token), answering once the new
/// revision's workers run; a count of 0 or past its shard count is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_route_shows_a_processes_scale_and_rescales_it_with_the_token() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let s = ddshard::ShardingSettings { number_of_shards: 8, min_nr_of_members: 3, ..settings() };
    let mut processes = Vec::new();
    for i in 0..3 {
        let worker = |_ctx: ddshard::sharding::DaemonContext| std::future::pending::<()>();
        processes.push(c.node(i).sharding().daemon_process("pump", 2, worker, s.clone()).await.unwrap());
    }
    let app = router(c.node(1).clone(), AdminSettings { token: Some(TOKEN.into()), ..Default::default() });
    let scale_app = app.clone();
    let (_, scale) = eventually(CONVERGE, "the scale answers", || {
        let app = scale_app.clone();
        async move { Some(get(&app, "/cluster/daemons/pump").await).filter(|(s, _)| *s == StatusCode::OK) }
    })
    .await;
    assert_eq!((&scale["revision"], &scale["count"]), (&Value::from(0), &Value::from(2)));
    assert_eq!(get(&app, "/cluster/daemons/nope").await.0, StatusCode::NOT_FOUND);

    let route = "/cluster/daemons/pump";
    assert_eq!(call(&app, "PUT", route, None, r#"{"count": 5}"#).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&app, "PUT", route, Some(TOKEN), r#"{"count": "five"}"#).await.0, StatusCode::BAD_REQUEST);
    for count in [0, 9] {
        let (status, err) = call(&app, "PUT", route, Some(TOKEN), &format!(r#"{{"count": {count}}}"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(err["error"].as_str().unwrap().contains(&format!("count of {count}")), "{err}");
    }
    let (status, scale) = call(&app, "PUT", route, Some(TOKEN), r#"{"count": 5}"#).await;
    assert_eq!(status, StatusCode::OK, "{scale}");
    assert_eq!(
        (&scale["revision"], &scale["count"], &scale["rescaling_to"]),
        (&Value::from(1), &Value::from(5), &Value::Null)
    );
    let workers = eventually(CONVERGE, "five workers run", || {
        let p = processes[0].clone();
        async move { p.workers(Duration::from_secs(2)).await.ok().filter(|w| w.len() == 5) }
    })
    .await;
    assert_eq!(workers.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3, 4]);

    // The same through `ddshard admin daemon`, on a real socket.
    use ddshard::admin::cli::{AdminClient, AdminCommand as A};
    let server =
        ddshard::admin::serve(c.node(1), "127.0.0.1:0".parse().unwrap(), app, Default::default()).await.unwrap();
    let client = AdminClient {
        url: format!("http://{}", server.local_addr),
        token: Some(TOKEN.into()),
        timeout: Duration::from_secs(40),
    };
    let rescaled = tokio::task::spawn_blocking(move || {
        let rescaled = client.run(&A::Daemon { name: "pump".into(), count: Some(3) }, false);
        (rescaled, client.run(&A::Daemon { name: "pump".into(), count: None }, false))
    });
    let (rescaled, shown) = rescaled.await.unwrap();
    let (rescaled, shown) = (rescaled.unwrap(), shown.unwrap());
    assert!(rescaled.contains("pump") && rescaled.contains('2') && rescaled.contains('3'), "{rescaled}");
    assert_eq!(rescaled, shown, "the table of the new scale, then the same read back");
    c.shutdown().await;
}

/// Issue 43: `GET /cluster/producers` lists this node's reliable-delivery producers with what
/// each counted and holds, the age of its oldest unconfirmed message included; a producer whose
/// handles are all dropped leaves the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producers_route_lists_this_nodes_producers_with_their_oldest_unconfirmed_age() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let probe = Probe::default();
    let regions = start_everywhere(&c, &probe, settings()).await;
    let app = router(c.node(0).clone(), AdminSettings::default());
    assert_eq!(get(&app, "/cluster/producers").await, (StatusCode::OK, serde_json::json!([])));
    let producer = regions[0].producer("orders", ddshard::sharding::ProducerSettings::default()).await.unwrap();
    for i in 0..4 {
        producer.send(&format!("p{i}"), CounterMsg::Add(1)).await.unwrap().await.unwrap();
    }
    // One held by a slow handler: unconfirmed while it sleeps.
    let held = producer.send("p0", CounterMsg::SleepMs(1_500)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, list) = get(&app, "/cluster/producers").await;
    assert_eq!(status, StatusCode::OK);
    let row = &list[0];
    assert_eq!((&row["producer_id"], &row["type_name"]), (&Value::from("orders"), &Value::from("counter")), "{list}");
    assert_eq!(
        (&row["stored"], &row["confirmed"], &row["unconfirmed"]),
        (&Value::from(5), &Value::from(4), &Value::from(1))
    );
    assert!(row["oldest_unconfirmed_age_ms"].as_u64().is_some_and(|ms| ms >= 300), "{row}");
    held.await.unwrap();
    let (_, list) = get(&app, "/cluster/producers").await;
    assert_eq!(list[0]["oldest_unconfirmed_age_ms"], Value::Null);
    drop(producer);
    eventually(CONVERGE, "a dropped producer leaves the list", || {
        let app = app.clone();
        async move { (get(&app, "/cluster/producers").await.1 == serde_json::json!([])).then_some(()) }
    })
    .await;
    c.shutdown().await;
}
