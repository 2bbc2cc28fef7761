//! The machine whole nodes run on in virtual time: messaging connections are in-memory byte
//! pipes from dialers to listeners, gossip datagrams go through chitchat's in-process transport,
//! and the disk writer commits on the runtime's blocking pool without waiting for the disk (a
//! crash here is a process's, after which the operating system's cache still holds each commit). Links are cut above this, at the
//! seams every test cluster uses (the fault injector's link filter and gossip socket).
//!
//! A pipe is bounded like a socket's buffers: a writer whose peer stops reading waits, and the
//! transport's write timeout applies as on TCP. When one end is dropped (its node crashed: the
//! runtime holding it is gone) the other reads end-of-stream and its writes fail, as after a
//! reset.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chitchat::transport::{ChannelTransport, Socket, Transport as _};
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

use crate::machine::{BoxedConnection, DiskWriter, Listener, Machine};

/// Bytes a pipe holds in each direction before its writer waits (a socket's buffers).
const PIPE_BYTES: usize = 256 << 10;

/// Connections dialed and not yet accepted, per listener (a listen backlog).
const BACKLOG: usize = 128;

/// Ephemeral ports of dialing ends start here.
const FIRST_EPHEMERAL_PORT: u16 = 40_000;

type Pending = (DuplexStream, SocketAddr);

/// The network every simulated machine of one run is on.
#[derive(Clone, Default)]
pub(crate) struct SimulatedNetwork {
    state: Arc<Mutex<NetState>>,
    gossip: ChannelTransport,
    /// How long each machine's disk takes to commit, in virtual time.
    commit_latency: Duration,
}

#[derive(Default)]
struct NetState {
    listeners: HashMap<SocketAddr, mpsc::Sender<Pending>>,
    next_ephemeral: u16,
}

impl NetState {
    fn ephemeral_port(&mut self) -> u16 {
        let port = FIRST_EPHEMERAL_PORT.saturating_add(self.next_ephemeral);
        self.next_ephemeral = self.next_ephemeral.wrapping_add(1) % (u16::MAX - FIRST_EPHEMERAL_PORT);
        port
    }
}

impl SimulatedNetwork {
    /// A network whose machines' disks take `commit_latency` per commit.
    pub(crate) fn with_commit_latency(commit_latency: Duration) -> Self {
        SimulatedNetwork { commit_latency, ..SimulatedNetwork::default() }
    }

    /// A machine on this network with the address `ip`.
    pub(crate) fn machine(&self, ip: IpAddr) -> SimulatedMachine {
        SimulatedMachine { net: self.clone(), ip }
    }
}

/// One node's machine on a [`SimulatedNetwork`].
#[derive(Clone)]
pub(crate) struct SimulatedMachine {
    net: SimulatedNetwork,
    ip: IpAddr,
}

impl std::fmt::Debug for SimulatedMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulatedMachine").field("ip", &self.ip).finish()
    }
}

struct SimulatedListener {
    addr: SocketAddr,
    pending: mpsc::Receiver<Pending>,
    net: SimulatedNetwork,
}

#[async_trait]
impl Listener for SimulatedListener {
    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }

    async fn accept(&mut self) -> io::Result<(BoxedConnection, SocketAddr)> {
        match self.pending.recv().await {
            Some((stream, from)) => Ok((Box::new(stream), from)),
            None => Err(io::ErrorKind::NotConnected.into()),
        }
    }
}

impl Drop for SimulatedListener {
    fn drop(&mut self) {
        self.net.state.lock().expect("network state").listeners.remove(&self.addr);
    }
}

#[async_trait]
impl Machine for SimulatedMachine {
    async fn listen(&self, addr: SocketAddr, _keepalive: Duration) -> io::Result<Box<dyn Listener>> {
        let mut state = self.net.state.lock().expect("network state");
        let ip = if addr.ip().is_unspecified() { self.ip } else { addr.ip() };
        let port = if addr.port() == 0 { state.ephemeral_port() } else { addr.port() };
        let addr = SocketAddr::new(ip, port);
        if state.listeners.contains_key(&addr) {
            return Err(io::ErrorKind::AddrInUse.into());
        }
        let (tx, pending) = mpsc::channel(BACKLOG);
        state.listeners.insert(addr, tx);
        Ok(Box::new(SimulatedListener { addr, pending, net: self.net.clone() }))
    }

    async fn connect(&self, to: SocketAddr, _keepalive: Duration) -> io::Result<BoxedConnection> {
        let mut state = self.net.state.lock().expect("network state");
        let from = SocketAddr::new(self.ip, state.ephemeral_port());
        let listener = state.listeners.get(&to).ok_or(io::ErrorKind::ConnectionRefused)?;
        let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
        listener.try_send((theirs, from)).map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
        Ok(Box::new(ours))
    }

    async fn open_gossip(&self, addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let ip = if addr.ip().is_unspecified() { self.ip } else { addr.ip() };
        self.net.gossip.open(SocketAddr::new(ip, addr.port())).await
    }

    fn seals_gossip(&self) -> bool {
        false
    }

    /// Commits wait their modelled latency, not a real disk: the simulation crashes processes,
    /// never the machine, so what is committed stays in the operating system's cache.
    fn disk_writer(&self) -> DiskWriter {
        DiskWriter::BlockingPool { latency: self.net.commit_latency }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const KEEPALIVE: Duration = Duration::from_secs(15);

    #[tokio::test]
    async fn a_dialed_pipe_carries_bytes_both_ways_and_ends_when_one_side_is_dropped() {
        let net = SimulatedNetwork::default();
        let (a, b) = (net.machine([127, 0, 0, 1].into()), net.machine([127, 0, 0, 2].into()));
        let mut listener = b.listen("0.0.0.0:7000".parse().unwrap(), KEEPALIVE).await.unwrap();
        assert_eq!(listener.local_addr().unwrap(), "127.0.0.2:7000".parse().unwrap());
        let mut dialed = a.connect("127.0.0.2:7000".parse().unwrap(), KEEPALIVE).await.unwrap();
        let (mut accepted, from) = listener.accept().await.unwrap();
        assert_eq!(from.ip(), IpAddr::from([127, 0, 0, 1]), "the acceptor sees the dialer's address");
        dialed.write_all(b"ping").await.unwrap();
        let mut buf = [0; 4];
        accepted.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        accepted.write_all(b"pong").await.unwrap();
        dialed.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
        drop(accepted);
        assert_eq!(dialed.read(&mut buf).await.unwrap(), 0, "end of stream once the other end is gone");
    }

    #[tokio::test]
    async fn dialing_an_address_nobody_listens_on_is_refused_and_a_dropped_listener_frees_its_address() {
        let net = SimulatedNetwork::default();
        let a = net.machine([127, 0, 0, 1].into());
        let to: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let refused = a.connect(to, KEEPALIVE).await.err().expect("nobody listens");
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
        let listener = a.listen(to, KEEPALIVE).await.unwrap();
        let taken = a.listen(to, KEEPALIVE).await.err().expect("the address is taken");
        assert_eq!(taken.kind(), io::ErrorKind::AddrInUse);
        drop(listener);
        a.listen(to, KEEPALIVE).await.expect("free again once the listener is gone");
    }
}
