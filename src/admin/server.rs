//! The admin listener: HTTP/1.1 connections bounded in number and in how long a client may
//! take to send a request head, so clients that open connections and send nothing (or a head
//! one byte at a time) cannot keep `/ready` from answering nor hold the file descriptors the
//! node's messaging and LMDB share.
//!
//! At the cap, a new connection evicts the oldest one with no request in flight (a silent or
//! trickling client, or an idle kept-alive one); when every connection is serving a request,
//! the new one is closed at once. A probe sends its head at once, so it is served even while
//! silent connections keep arriving. Each head (the first and every later one on a kept-alive
//! connection) must arrive within `header_read_timeout`. A request counts as in flight until
//! its handler has answered: an event stream (`/cluster/events`) is idle once its head is
//! sent, so at the cap it is among the first evicted (the dashboard reconnects).
//!
//! A request whose `Host` is not an IP literal, `localhost` or a name of `allowed_hosts` is
//! refused (421) before any route sees it: a page of another site whose name is made to
//! resolve to this address (DNS rebinding) sends its own name, so a browser cannot be turned
//! against a loopback admin API.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::error::Error;
use crate::log_limit::LogLimiter;
use crate::node::{AdminStats, Node};

/// How the admin listener bounds its clients.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// Most connections open at once (at the cap, the oldest with no request in flight is
    /// evicted for a new one). Default 256.
    pub max_connections: usize,
    /// Longest wait for a request head, the first one and each later one on a kept-alive
    /// connection; a connection silent longer is closed. Default 5 s.
    pub header_read_timeout: Duration,
    /// Names a request's `Host` may carry besides IP literals and `localhost` (the names the
    /// API is reached by: a service name, a host name), compared without case and port.
    pub allowed_hosts: Vec<String>,
    /// Longest a request may take, its body included (408 after it); at the connection cap, a
    /// request running longer than `header_read_timeout` may be cut for a new connection.
    /// Default 30 s.
    pub request_timeout: Duration,
}

impl Default for ServeSettings {
    fn default() -> Self {
        ServeSettings {
            max_connections: 256,
            header_read_timeout: Duration::from_secs(5),
            allowed_hosts: Vec::new(),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// Whether a request's `Host` may reach the API: absent (not a browser), an IP literal (no
/// name to rebind), `localhost`, or one of `allowed`. A `Host` that is not text is refused.
fn host_allowed(host: Option<&axum::http::HeaderValue>, allowed: &[String]) -> bool {
    let Some(host) = host else { return true };
    let Ok(host) = host.to_str() else { return false };
    let port_ok = |rest: &str| rest.is_empty() || rest.strip_prefix(':').is_some_and(is_port);
    if let Some(v6) = host.strip_prefix('[') {
        return v6.split_once(']').is_some_and(|(ip, rest)| ip.parse::<std::net::Ipv6Addr>().is_ok() && port_ok(rest));
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if is_port(port) => name,
        _ => host,
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

/// Set in a slot's `in_flight` once it is chosen for eviction: no request starts on it then.
const CLOSING: usize = 1 << (usize::BITS - 1);

/// One connection: its requests in flight (with [`CLOSING`]), since when it has been busy,
/// and how to close it.
struct Slot {
    in_flight: AtomicUsize,
    /// Milliseconds since the listener's start when its current request began.
    busy_since_ms: AtomicU64,
    close: CancellationToken,
}

/// The open connections, oldest first.
struct Slots {
    started: std::time::Instant,
    next: u64,
    open: BTreeMap<u64, Arc<Slot>>,
}

impl Slots {
    fn new() -> Self {
        Slots { started: std::time::Instant::now(), next: 0, open: BTreeMap::new() }
    }

    fn now_ms(started: std::time::Instant) -> u64 {
        u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Admits a new connection. At `max`, it evicts the oldest with no request in flight, else
    /// the oldest whose request has run longer than `slow` (a client trickling its body holds
    /// a slot no longer than that); `None` (nothing changed) when every connection is serving
    /// a request younger than that.
    fn admit(&mut self, max: usize, slow: Duration, stats: &AdminStats) -> Option<(u64, Arc<Slot>)> {
        if self.open.len() >= max.max(1) {
            let idle = self
                .open
                .iter()
                .find(|(_, s)| s.in_flight.compare_exchange(0, CLOSING, Ordering::AcqRel, Ordering::Acquire).is_ok());
            let victim = idle.map(|(id, _)| *id).or_else(|| {
                let now = Self::now_ms(self.started);
                let slow = u64::try_from(slow.as_millis()).unwrap_or(u64::MAX);
                let (id, s) = self.open.iter().find(|(_, s)| {
                    s.in_flight.load(Ordering::Acquire) & CLOSING == 0
                        && now.saturating_sub(s.busy_since_ms.load(Ordering::Acquire)) >= slow
                })?;
                s.in_flight.fetch_or(CLOSING, Ordering::AcqRel);
                Some(*id)
            });
            let Some(id) = victim else {
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            let evicted = self.open.remove(&id).expect("listed");
            evicted.close.cancel();
            stats.connections_evicted.fetch_add(1, Ordering::Relaxed);
        }
        let id = self.next;
        self.next += 1;
        let slot = Arc::new(Slot {
            in_flight: AtomicUsize::new(0),
            busy_since_ms: AtomicU64::new(0),
            close: CancellationToken::new(),
        });
        self.open.insert(id, slot.clone());
        Some((id, slot))
    }
}

/// Marks a request in flight on its connection until dropped.
struct InFlight(Arc<Slot>);

impl InFlight {
    /// `None` when the connection is being evicted (the request must not start).
    fn start(slot: &Arc<Slot>, started: std::time::Instant) -> Option<Self> {
        let before = slot.in_flight.fetch_add(1, Ordering::AcqRel);
        if before & CLOSING != 0 {
            slot.in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        if before == 0 {
            slot.busy_since_ms.store(Slots::now_ms(started), Ordering::Release);
        }
        Some(InFlight(slot.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Binds `addr` and serves `app` under `settings` until the node shuts down.
pub(super) async fn serve(
    node: &Node,
    addr: SocketAddr,
    app: Router,
    settings: ServeSettings,
) -> crate::error::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Io { context: format!("binding the admin API on {addr}"), source: e })?;
    let local_addr = listener
        .local_addr()
        .map_err(|e| Error::Io { context: "reading the admin API's address".into(), source: e })?;
    let shutdown = node.shutdown_token();
    let stats = node.admin_stats().clone();
    node.spawner().spawn(accept_loop(listener, app, Arc::new(settings), stats, shutdown));
    Ok(local_addr)
}

async fn accept_loop(
    listener: TcpListener,
    app: Router,
    settings: Arc<ServeSettings>,
    stats: Arc<AdminStats>,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Mutex::new(Slots::new()));
    let started = slots.lock().expect("admin slots").started;
    let mut log = LogLimiter::new(Duration::from_secs(60));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait a little rather than spin.
                if let Some(held) = log.allow(&(), std::time::Instant::now()) {
                    tracing::warn!(error = %e, held_back = held, "admin API: accepting a connection failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some((id, slot)) =
            slots.lock().expect("admin slots").admit(settings.max_connections, settings.header_read_timeout, &stats)
        else {
            drop(stream);
            continue;
        };
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let (app, slots, stats, shutdown) = (app.clone(), slots.clone(), stats.clone(), shutdown.clone());
        let settings = settings.clone();
        tokio::spawn(async move {
            let (in_slot, header_read_timeout) = (slot.clone(), settings.header_read_timeout);
            let in_stats = stats.clone();
            let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let in_flight = InFlight::start(&in_slot, started);
                let host_ok = host_allowed(req.headers().get(axum::http::header::HOST), &settings.allowed_hosts);
                if !host_ok {
                    in_stats.requests_refused_host.fetch_add(1, Ordering::Relaxed);
                }
                let (app, request_timeout) = (app.clone(), settings.request_timeout);
                async move {
                    use axum::http::StatusCode;
                    let refuse = |status, msg: &str| Ok(super::ApiError::new(status, msg).into_response());
                    let Some(in_flight) = in_flight else {
                        return refuse(StatusCode::SERVICE_UNAVAILABLE, "connection closing: retry on a new one");
                    };
                    if !host_ok {
                        let msg = "Host not allowed: use an IP address, localhost, or a name of allowed_hosts";
                        return refuse(StatusCode::MISDIRECTED_REQUEST, msg);
                    }
                    let response = match tokio::time::timeout(request_timeout, app.oneshot(req)).await {
                        Ok(response) => response,
                        Err(_) => refuse(StatusCode::REQUEST_TIMEOUT, "the request took longer than request_timeout"),
                    };
                    drop(in_flight);
                    response
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            // Dropping the connection closes it: at eviction, and when the node stops.
            tokio::select! {
                _ = conn => {}
                _ = slot.close.cancelled() => {}
                _ = shutdown.cancelled() => {}
            }
            slots.lock().expect("admin slots").open.remove(&id);
            stats.connections.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn only_ip_literals_localhost_and_the_allowed_names_pass_the_host_check() {
        let allowed = vec!["ddshard-0.ddshard".to_string()];
        let check =
            |host: Option<&str>| host_allowed(host.map(|h| HeaderValue::from_str(h).unwrap()).as_ref(), &allowed);
        for host in [
            None,
            Some("127.0.0.1:8558"),
            Some("10.1.2.3"),
            Some("[::1]:8558"),
            Some("[::1]"),
            Some("localhost:8558"),
            Some("LOCALHOST"),
            Some("ddshard-0.ddshard:8558"),
        ] {
            assert!(check(host), "{host:?}");
        }
        for host in [
            Some("evil.example:8558"),
            Some("127.0.0.1.nip.io"),
            Some("[::1"),
            Some("[evil]:80"),
            Some("[::1]junk"),
            Some("[::1]:"),
            Some("localhost:123456"),
            Some(""),
        ] {
            assert!(!check(host), "{host:?}");
        }
        let not_text = HeaderValue::from_bytes(b"caf\xe9").unwrap();
        assert!(!host_allowed(Some(&not_text), &allowed), "a Host that is not text is refused");
    }

    #[test]
    fn at_the_cap_the_oldest_idle_connection_is_evicted_then_the_oldest_slow_one_and_none_when_all_are_young() {
        let stats = AdminStats::default();
        let mut slots = Slots::new();
        let started = slots.started;
        let slow = Duration::from_secs(3600);
        let (a, slot_a) = slots.admit(3, slow, &stats).expect("room");
        let (_b, slot_b) = slots.admit(3, slow, &stats).expect("room");
        let (_c, slot_c) = slots.admit(3, slow, &stats).expect("room");
        // a serves a request: b, the oldest idle one, goes, and no request starts on it.
        let busy_a = InFlight::start(&slot_a, started).expect("open");
        let (_d, slot_d) = slots.admit(3, slow, &stats).expect("b evicted");
        assert!(slot_b.close.is_cancelled() && !slot_a.close.is_cancelled() && !slot_c.close.is_cancelled());
        assert!(InFlight::start(&slot_b, started).is_none(), "an evicted connection starts no request");
        assert!(slots.open.contains_key(&a), "a is serving: kept");
        // Every one busy with a young request: the new one is refused, nothing evicted.
        let (_busy_c, _busy_d) = (InFlight::start(&slot_c, started), InFlight::start(&slot_d, started));
        assert!(slots.admit(3, slow, &stats).is_none());
        assert_eq!(slots.open.len(), 3);
        // With no grace for slow requests, the oldest busy one (a) is cut for the new one.
        assert!(slots.admit(3, Duration::ZERO, &stats).is_some(), "a's request is older than zero");
        assert!(slot_a.close.is_cancelled());
        drop(busy_a);
        assert_eq!(stats.connections_evicted.load(Ordering::Relaxed), 2);
        assert_eq!(stats.connections_refused.load(Ordering::Relaxed), 1);
    }
}
