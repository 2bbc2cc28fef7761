//! Ports a test must know before a node starts (a seed list written once for every node).
//!
//! Binding port 0 and dropping the socket is racy: until the node binds the number itself, the
//! kernel may hand it to any socket bound to port 0 — another test's node, a DNS lookup, an
//! outgoing connection — and the node then fails to start. [`unused_port`] picks from outside
//! the kernel's ephemeral range, which port-0 binds never draw from, so only another explicit
//! choice could take it, and this process never hands out one number twice.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::sync::Mutex;

/// The kernel's ephemeral range (`ip_local_port_range`), or Linux's default where unreadable.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut parts = text.split_whitespace().map(str::parse::<u16>);
            Some((parts.next()?.ok()?, parts.next()?.ok()?))
        })
        .unwrap_or((32_768, 60_999))
}

/// The ports outside the ephemeral range, above the well-known and registered-service lows:
/// the wider of the span below it (from 10,000) and the span above it.
fn candidate_span() -> std::ops::RangeInclusive<u16> {
    let (low, high) = ephemeral_range();
    let below = 10_000..=low.saturating_sub(1);
    let above = high.saturating_add(1)..=u16::MAX;
    let len = |r: &std::ops::RangeInclusive<u16>| r.end().saturating_sub(*r.start());
    if len(&below) >= len(&above) { below } else { above }
}

/// A port free on `ip` for both UDP and TCP when checked, outside the ephemeral range, and
/// not handed out before by this process. Panics (a test helper) if the span has none left.
pub fn unused_port(ip: IpAddr) -> u16 {
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let span = candidate_span();
    let (start, len) = (u32::from(*span.start()), u32::from(*span.end()) - u32::from(*span.start()) + 1);
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    let handed_out = guard.get_or_insert_with(HashSet::new);
    // A random first candidate, so test binaries run one after another rarely pick alike.
    let offset = rand::random::<u32>() % len;
    for step in 0..len {
        let port = u16::try_from(start + (offset + step) % len).expect("within the u16 span");
        if handed_out.contains(&port) {
            continue;
        }
        let addr = SocketAddr::new(ip, port);
        if UdpSocket::bind(addr).is_ok() && TcpListener::bind(addr).is_ok() {
            handed_out.insert(port);
            return port;
        }
    }
    panic!("no unused port outside the ephemeral range on {ip}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chosen_ports_lie_outside_the_ephemeral_range_and_are_never_handed_out_twice() {
        let (low, high) = ephemeral_range();
        let ip = IpAddr::from([127, 0, 0, 1]);
        let ports: Vec<u16> = (0..50).map(|_| unused_port(ip)).collect();
        assert!(ports.iter().all(|p| *p < low || *p > high), "{ports:?} vs {low}-{high}");
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
        // Still free to bind: what the node will do with it.
        assert!(UdpSocket::bind(SocketAddr::new(ip, ports[0])).is_ok());
    }
}
