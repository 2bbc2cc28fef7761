//! What a node takes from the machine it runs on: the sockets it listens and dials on, its gossip
//! socket, and where its disk writer runs.
//!
//! Production nodes use [`OsMachine`]: TCP (no Nagle delay, keepalive), chitchat's UDP socket,
//! and a thread of their own for LMDB commits. The test kit's whole-node simulation swaps in an
//! in-memory network and runs the disk writer on the runtime's blocking pool, where a paused
//! clock stands still while a commit runs; everything above this seam is the shipped code.

use std::fmt::Debug;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use chitchat::transport::Socket;
use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream to or from a peer.
pub(crate) trait Connection: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Connection for T {}

/// A connection of any machine.
pub(crate) type BoxedConnection = Box<dyn Connection>;

/// A bound listening socket.
#[async_trait]
pub(crate) trait Listener: Send + 'static {
    /// The address it is bound to (the port chosen when it bound port 0).
    fn local_addr(&self) -> io::Result<SocketAddr>;

    /// The next inbound connection and the address it comes from. Cancel-safe.
    async fn accept(&mut self) -> io::Result<(BoxedConnection, SocketAddr)>;
}

/// Where a node's disk writer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DiskWriter {
    /// A thread of its own, blocked on its queue between commits.
    OwnThread,
    /// A task that runs each commit on the runtime's blocking pool, so a paused runtime clock
    /// does not move on while the disk works, after waiting `latency` on the runtime's clock (a
    /// disk's write latency in virtual time, during which a crash loses the batch). Only the
    /// test kit's simulated machine.
    /// Its commits do not wait for the disk (`fsync`), only for the operating system's cache:
    /// the simulation crashes processes, never the machine.
    #[cfg_attr(not(any(test, feature = "testkit")), allow(dead_code))]
    BlockingPool { latency: std::time::Duration },
}

impl DiskWriter {
    /// Whether a commit waits for the disk (`fsync`), as a power loss needs.
    pub(crate) fn fsyncs(self) -> bool {
        matches!(self, DiskWriter::OwnThread)
    }
}

/// The sockets and threads a node takes from its machine.
#[async_trait]
pub(crate) trait Machine: Send + Sync + Debug + 'static {
    /// Binds the messaging listener; `keepalive` as for [`Machine::connect`], for the
    /// connections it accepts.
    async fn listen(&self, addr: SocketAddr, keepalive: Duration) -> io::Result<Box<dyn Listener>>;

    /// Dials a peer's messaging address; `keepalive` is how long an idle connection goes
    /// before it is probed, where the machine has such probes.
    async fn connect(&self, to: SocketAddr, keepalive: Duration) -> io::Result<BoxedConnection>;

    /// Binds the plain (unsealed) gossip socket.
    async fn open_gossip(&self, addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>>;

    /// Whether gossip sealed with the cluster secret can be bound here (it needs the
    /// operating system's UDP sockets).
    fn seals_gossip(&self) -> bool;

    /// Where the disk writer runs (and so whether commits wait for the disk).
    fn disk_writer(&self) -> DiskWriter;
}

/// The operating system's sockets and threads.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OsMachine;

/// A TCP listener whose accepted connections get the same socket options as dialed ones.
struct TcpListener {
    listener: tokio::net::TcpListener,
    keepalive: Duration,
}

#[async_trait]
impl Listener for TcpListener {
    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    async fn accept(&mut self) -> io::Result<(BoxedConnection, SocketAddr)> {
        let (stream, remote) = self.listener.accept().await?;
        // Best effort: a socket option refused does not lose the connection.
        let _ = configure_tcp(&stream, self.keepalive);
        Ok((Box::new(stream), remote))
    }
}

#[async_trait]
impl Machine for OsMachine {
    async fn listen(&self, addr: SocketAddr, keepalive: Duration) -> io::Result<Box<dyn Listener>> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        Ok(Box::new(TcpListener { listener, keepalive }))
    }

    async fn connect(&self, to: SocketAddr, keepalive: Duration) -> io::Result<BoxedConnection> {
        let stream = tokio::net::TcpStream::connect(to).await?;
        configure_tcp(&stream, keepalive)?;
        Ok(Box::new(stream))
    }

    async fn open_gossip(&self, addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        Ok(Box::new(chitchat::transport::UdpSocket::open(addr).await?))
    }

    fn seals_gossip(&self) -> bool {
        true
    }

    fn disk_writer(&self) -> DiskWriter {
        DiskWriter::OwnThread
    }
}

/// No Nagle delay, and TCP keepalive so a peer that vanished (power cut, dropped route) is
/// noticed on an idle connection instead of never.
fn configure_tcp(stream: &tokio::net::TcpStream, keepalive: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let probe_every = (keepalive / 3).max(Duration::from_secs(1));
    let probes = socket2::TcpKeepalive::new().with_time(keepalive).with_interval(probe_every);
    #[cfg(any(target_os = "linux", target_os = "macos", target_os = "freebsd"))]
    let probes = probes.with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&probes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operating_systems_disk_writer_waits_for_the_disk_and_the_simulated_one_does_not() {
        assert_eq!(OsMachine.disk_writer(), DiskWriter::OwnThread);
        assert!(DiskWriter::OwnThread.fsyncs());
        assert!(!DiskWriter::BlockingPool { latency: Duration::from_millis(2) }.fsyncs());
    }
}
