//! A small authoritative DNS server for tests of discovery: on a UDP port of loopback it
//! answers SRV queries of one service name (every target at its port, with the targets' A or
//! AAAA records in the additional section unless turned off) and A/AAAA queries of the targets, from a
//! table the test edits, with TTL 0 so every lookup sees the latest table. Messages are built
//! with the resolver's own wire types.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hickory_resolver::proto::op::{Message, OpCode};
use hickory_resolver::proto::rr::rdata::{A, AAAA, SRV};
use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};

/// The server's records and counters; the server runs until the runtime ends.
#[derive(Debug)]
pub struct TestDns {
    /// Where it answers.
    pub addr: SocketAddr,
    /// The SRV name it serves (fully qualified, lower case).
    pub service: String,
    zone: Arc<Zone>,
}

#[derive(Debug)]
struct Zone {
    domain: String,
    targets: Mutex<BTreeMap<String, SocketAddr>>,
    glue: AtomicBool,
    srv_queries: AtomicUsize,
    address_queries: AtomicUsize,
}

impl TestDns {
    /// Starts a server for `service` (e.g. `_gossip._udp.ddshard.test.`); targets are named
    /// `<target>.<domain>.` where the domain is the part of `service` after its two labels.
    pub async fn start(service: &str) -> std::io::Result<TestDns> {
        let service = service.to_ascii_lowercase();
        let domain = service.splitn(3, '.').nth(2).unwrap_or_default().to_string();
        let zone = Arc::new(Zone {
            domain,
            targets: Mutex::new(BTreeMap::new()),
            glue: AtomicBool::new(true),
            srv_queries: AtomicUsize::new(0),
            address_queries: AtomicUsize::new(0),
        });
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        let addr = socket.local_addr()?;
        let (served, name) = (zone.clone(), service.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else { return };
                let Ok(query) = Message::from_vec(&buf[..n]) else { continue };
                let Ok(reply) = served.answer(&name, &query).to_vec() else { continue };
                let _ = socket.send_to(&reply, from).await;
            }
        });
        Ok(TestDns { addr, service, zone })
    }

    /// Replaces the SRV targets: `(target, gossip address)` each.
    pub fn set(&self, targets: &[(&str, SocketAddr)]) {
        let named = targets.iter().map(|(t, a)| (format!("{t}.{}", self.zone.domain), *a)).collect();
        *self.zone.targets.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = named;
    }

    /// Whether SRV answers carry the targets' A records (else the resolver asks for them).
    pub fn set_glue(&self, on: bool) {
        self.zone.glue.store(on, Ordering::Relaxed);
    }

    /// SRV queries answered so far.
    pub fn srv_queries(&self) -> usize {
        self.zone.srv_queries.load(Ordering::Relaxed)
    }

    /// A and AAAA queries answered so far (none are needed while glue is on).
    pub fn address_queries(&self) -> usize {
        self.zone.address_queries.load(Ordering::Relaxed)
    }
}

impl Zone {
    fn answer(&self, service: &str, query: &Message) -> Message {
        let mut reply = Message::response(query.metadata.id, OpCode::Query);
        reply.metadata.authoritative = true;
        reply.metadata.recursion_desired = query.metadata.recursion_desired;
        reply.metadata.recursion_available = true;
        let Some(q) = query.queries.first() else { return reply };
        reply.add_query(q.clone());
        let targets = self.targets.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let a_record = |target: &str, addr: SocketAddr| {
            let data = match addr.ip() {
                IpAddr::V4(v4) => RData::A(A(v4)),
                IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
            };
            Name::from_ascii(target).ok().map(|name| Record::from_rdata(name, 0, data))
        };
        let qname = q.name.to_ascii().to_ascii_lowercase();
        match q.query_type {
            RecordType::SRV if qname == service => {
                self.srv_queries.fetch_add(1, Ordering::Relaxed);
                for (target, addr) in &targets {
                    let Ok(name) = Name::from_ascii(target) else { continue };
                    let srv = SRV::new(0, 10, addr.port(), name);
                    reply.add_answer(Record::from_rdata(q.name.clone(), 0, RData::SRV(srv)));
                    if let Some(a) = self.glue.load(Ordering::Relaxed).then(|| a_record(target, *addr)).flatten() {
                        reply.add_additional(a);
                    }
                }
            }
            RecordType::A | RecordType::AAAA => {
                self.address_queries.fetch_add(1, Ordering::Relaxed);
                let v6 = q.query_type == RecordType::AAAA;
                let matching = targets.get(&qname).filter(|addr| addr.is_ipv6() == v6);
                if let Some(a) = matching.and_then(|addr| a_record(&qname, *addr)) {
                    reply.add_answer(a);
                }
            }
            _ => {}
        }
        reply
    }
}
