//! The admin listener: HTTP/1.1 connections bounded in number and in how long a client may
//! take to send a request head, so clients that open connections and send nothing (or a head
//! one byte at a time) cannot keep `/ready` from answering nor hold the file descriptors the
//! node's messaging and LMDB share.
//!
//! At the cap, a new connection evicts the oldest one with no request in flight (a silent or
//! trickling client, or an idle kept-alive one); when every connection is serving a request,
//! the new one is closed at once. A probe sends its head at once, so it is served even while
//! silent connections keep arriving. Each head (the first and every later one on a kept-alive
//! connection) must arrive within `header_read_timeout`.
//!
//! A request whose `Host` is not an IP literal, `localhost` or a name of `allowed_hosts` is
//! refused (421) before any route sees it: a page of another site whose name is made to
//! resolve to this address (DNS rebinding) sends its own name, so a browser cannot be turned
//! against a loopback admin API.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
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
}

impl Default for ServeSettings {
    fn default() -> Self {
        ServeSettings { max_connections: 256, header_read_timeout: Duration::from_secs(5), allowed_hosts: Vec::new() }
    }
}

/// Whether a request's `Host` may reach the API: absent (not a browser), an IP literal (no
/// name to rebind), `localhost`, or one of `allowed`.
fn host_allowed(host: Option<&str>, allowed: &[String]) -> bool {
    let Some(host) = host else { return true };
    if host.starts_with('[') {
        return host.split_once(']').is_some_and(|(ip, _)| ip[1..].parse::<std::net::Ipv6Addr>().is_ok());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

/// One connection: its order of arrival, requests in flight, and how to close it.
struct Slot {
    in_flight: AtomicUsize,
    close: CancellationToken,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Slots {
    next: u64,
    open: BTreeMap<u64, Arc<Slot>>,
}

impl Slots {
    /// Admits a new connection; at `max`, by evicting the oldest with no request in flight.
    /// `None` (and nothing changed) when every connection is serving one.
    fn admit(&mut self, max: usize, stats: &AdminStats) -> Option<(u64, Arc<Slot>)> {
        if self.open.len() >= max.max(1) {
            let idle = self.open.iter().find(|(_, s)| s.in_flight.load(Ordering::Acquire) == 0).map(|(id, _)| *id);
            let Some(id) = idle else {
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            let evicted = self.open.remove(&id).expect("listed");
            evicted.close.cancel();
            stats.connections_evicted.fetch_add(1, Ordering::Relaxed);
        }
        let id = self.next;
        self.next += 1;
        let slot = Arc::new(Slot { in_flight: AtomicUsize::new(0), close: CancellationToken::new() });
        self.open.insert(id, slot.clone());
        Some((id, slot))
    }
}

/// Marks a request in flight on its connection until dropped.
struct InFlight(Arc<Slot>);

impl InFlight {
    fn new(slot: &Arc<Slot>) -> Self {
        slot.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(slot.clone())
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
    let slots = Arc::new(Mutex::new(Slots::default()));
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
        let Some((id, slot)) = slots.lock().expect("admin slots").admit(settings.max_connections, &stats) else {
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
                let in_flight = InFlight::new(&in_slot);
                let host = req.headers().get(axum::http::header::HOST).and_then(|h| h.to_str().ok());
                let refused = !host_allowed(host, &settings.allowed_hosts);
                if refused {
                    in_stats.requests_refused_host.fetch_add(1, Ordering::Relaxed);
                }
                let response = app.clone().oneshot(req);
                async move {
                    let response = if refused {
                        use axum::response::IntoResponse;
                        let msg = "Host not allowed: use an IP address, localhost, or a name of allowed_hosts";
                        Ok(super::ApiError::new(axum::http::StatusCode::MISDIRECTED_REQUEST, msg).into_response())
                    } else {
                        response.await
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

    #[test]
    fn only_ip_literals_localhost_and_the_allowed_names_pass_the_host_check() {
        let allowed = vec!["ddshard-0.ddshard".to_string()];
        for host in [
            None,
            Some("127.0.0.1:8558"),
            Some("10.1.2.3"),
            Some("[::1]:8558"),
            Some("localhost:8558"),
            Some("LOCALHOST"),
            Some("ddshard-0.ddshard:8558"),
        ] {
            assert!(host_allowed(host, &allowed), "{host:?}");
        }
        for host in [Some("evil.example:8558"), Some("127.0.0.1.nip.io"), Some("[::1"), Some("[evil]:80"), Some("")] {
            assert!(!host_allowed(host, &allowed), "{host:?}");
        }
    }

    #[test]
    fn at_the_cap_the_oldest_connection_with_no_request_in_flight_is_evicted_and_none_when_all_are_busy() {
        let stats = AdminStats::default();
        let mut slots = Slots::default();
        let (a, slot_a) = slots.admit(3, &stats).expect("room");
        let (_b, slot_b) = slots.admit(3, &stats).expect("room");
        let (_c, slot_c) = slots.admit(3, &stats).expect("room");
        // a serves a request: b, the oldest idle one, goes.
        let busy_a = InFlight::new(&slot_a);
        let (_d, slot_d) = slots.admit(3, &stats).expect("b evicted");
        assert!(slot_b.close.is_cancelled() && !slot_a.close.is_cancelled() && !slot_c.close.is_cancelled());
        assert!(slots.open.contains_key(&a), "a is serving: kept");
        // Every one busy: the new one is refused, nothing evicted.
        let (_busy_c, _busy_d) = (InFlight::new(&slot_c), InFlight::new(&slot_d));
        assert!(slots.admit(3, &stats).is_none());
        assert_eq!(slots.open.len(), 3);
        drop(busy_a);
        assert!(slots.admit(3, &stats).is_some(), "a idle again: evicted for the new one");
        assert!(slot_a.close.is_cancelled());
        assert_eq!(stats.connections_evicted.load(Ordering::Relaxed), 2);
        assert_eq!(stats.connections_refused.load(Ordering::Relaxed), 1);
    }
}
