//! One-way message throughput between two endpoints on loopback: ddshard's transport, plain and
//! with a cluster secret (Noise-authenticated, ChaCha20-Poly1305-encrypted), beside a plain
//! length-delimited TCP stream carrying the same rmp-encoded messages, in the same run and the
//! same shape (one sender, one receiver, the sender never waits for the receiver except when
//! its queue is full). Two message sizes: ~100 bytes (per-message cost) and 16 KiB (per-byte
//! cost, where encryption shows). Prints `ratio=` lines from medians of timed passes.

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::transport::{Inbound, PeerSender, Transport};
use ddshard::{ClusterSecret, TransportSettings, UniqueAddress};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

#[derive(Serialize, Deserialize, Clone)]
struct Msg {
    entity: String,
    seq: u64,
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

fn encoded(seq: u64, payload: usize) -> Vec<u8> {
    rmp_serde::to_vec_named(&Msg { entity: "counter-12345".into(), seq, payload: vec![7u8; payload] }).unwrap()
}

/// Sends `batch` messages per pass and waits until the receiver has decoded all of them.
trait Pipe {
    fn pass(&mut self, rt: &Runtime, batch: usize, payload: usize) -> Duration;
}

struct RawPipe {
    tx: Framed<TcpStream, LengthDelimitedCodec>,
    done: mpsc::Receiver<()>,
    batch: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl RawPipe {
    fn new(rt: &Runtime) -> Self {
        let (tx, rx) = rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
            let (c, s) = (c.unwrap(), s.unwrap().0);
            c.set_nodelay(true).unwrap();
            s.set_nodelay(true).unwrap();
            let codec = || LengthDelimitedCodec::builder().max_frame_length(8 << 20).new_codec();
            (Framed::new(c, codec()), Framed::new(s, codec()))
        });
        let (done_tx, done) = mpsc::channel(1);
        let batch = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
        let b = batch.clone();
        rt.spawn(async move {
            let mut rx = rx;
            let mut n = 0usize;
            while let Some(Ok(frame)) = rx.next().await {
                let _m: Msg = rmp_serde::from_slice(&frame).unwrap();
                n += 1;
                if n == b.load(std::sync::atomic::Ordering::Relaxed) {
                    n = 0;
                    done_tx.send(()).await.unwrap();
                }
            }
        });
        RawPipe { tx, done, batch }
    }
}

impl Pipe for RawPipe {
    fn pass(&mut self, rt: &Runtime, batch: usize, payload: usize) -> Duration {
        self.batch.store(batch, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(async {
            let start = Instant::now();
            for i in 0..batch {
                self.tx.feed(Bytes::from(encoded(i as u64, payload))).await.unwrap();
                // The transport's writer also flushes whatever queued up per wake-up.
                if i % 128 == 127 {
                    SinkExt::<Bytes>::flush(&mut self.tx).await.unwrap();
                }
            }
            SinkExt::<Bytes>::flush(&mut self.tx).await.unwrap();
            self.done.recv().await.unwrap();
            start.elapsed()
        })
    }
}

struct TransportPipe {
    /// A hot caller's handle on the peer (`Transport::sender`), as the regions use.
    from: PeerSender,
    done: mpsc::Receiver<()>,
    batch: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _receivers: (Transport, Transport),
}

impl TransportPipe {
    fn new(rt: &Runtime, secret: Option<&ClusterSecret>, shutdown: &CancellationToken) -> Self {
        let (a, b) = rt.block_on(async {
            let mk = |id: &str| {
                Transport::bind(
                    "127.0.0.1:0".parse().unwrap(),
                    UniqueAddress::new(id, 1),
                    "bench".into(),
                    secret,
                    TransportSettings::default(),
                    shutdown.clone(),
                )
            };
            (mk("a").await.unwrap(), mk("b").await.unwrap())
        });
        let mut inbox: mpsc::Receiver<Inbound> = b.subscribe("bench", 65_536);
        let (done_tx, done) = mpsc::channel(1);
        let batch = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
        let n_batch = batch.clone();
        rt.spawn(async move {
            let mut n = 0usize;
            while let Some(m) = inbox.recv().await {
                let _m: Msg = rmp_serde::from_slice(&m.body).unwrap();
                n += 1;
                if n == n_batch.load(std::sync::atomic::Ordering::Relaxed) {
                    n = 0;
                    done_tx.send(()).await.unwrap();
                }
            }
        });
        TransportPipe { from: a.sender(b.local()), done, batch, _receivers: (a, b) }
    }
}

impl Pipe for TransportPipe {
    fn pass(&mut self, rt: &Runtime, batch: usize, payload: usize) -> Duration {
        self.batch.store(batch, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(async {
            let start = Instant::now();
            let mut i = 0;
            while i < batch {
                let body = encoded(i as u64, payload);
                match self.from.send("bench", &body) {
                    Ok(()) => i += 1,
                    // Queue full: the writer is behind; let it run.
                    Err(ddshard::Error::SendQueueFull { .. }) => tokio::task::yield_now().await,
                    Err(e) => panic!("{e}"),
                }
            }
            self.done.recv().await.unwrap();
            start.elapsed()
        })
    }
}

fn bench(c: &mut Criterion) {
    let rt = common::runtime();
    let shutdown = CancellationToken::new();
    let secret = ClusterSecret::generate();
    let mut pipes: Vec<(&str, Box<dyn Pipe>)> = vec![
        ("baseline_raw_framed_tcp", Box::new(RawPipe::new(&rt))),
        ("ddshard_transport_plain", Box::new(TransportPipe::new(&rt, None, &shutdown))),
        ("ddshard_transport_encrypted", Box::new(TransportPipe::new(&rt, Some(&secret), &shutdown))),
    ];
    for (shape, batch, payload) in
        [("small_100B", common::sized(20_000, 500), 64), ("large_16KiB", common::sized(2_000, 50), 16 << 10)]
    {
        let mut g = c.benchmark_group(format!("two_node_one_way_{shape}"));
        g.throughput(Throughput::Elements(batch as u64));
        g.sample_size(10).measurement_time(Duration::from_secs(if common::quick() { 1 } else { 6 }));
        for (name, pipe) in pipes.iter_mut() {
            g.bench_function(*name, |b| {
                b.iter_custom(|iters| (0..iters).map(|_| pipe.pass(&rt, batch, payload)).sum());
            });
        }
        g.finish();
        // Same-run medians, passes interleaved so machine noise hits every pipe alike.
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); pipes.len()];
        for _ in 0..common::sized(7, 1) {
            for (k, (_, pipe)) in pipes.iter_mut().enumerate() {
                rates[k].push(batch as f64 / pipe.pass(&rt, batch, payload).as_secs_f64());
            }
        }
        let [raw, plain, encrypted] = [0, 1, 2].map(|k| common::median(&mut rates[k]));
        common::print_ratio(&format!("transport_plain_vs_raw_tcp_{shape}"), plain, raw);
        common::print_ratio(&format!("transport_encrypted_vs_raw_tcp_{shape}"), encrypted, raw);
        common::print_ratio(&format!("transport_encrypted_vs_plain_{shape}"), encrypted, plain);
    }
    shutdown.cancel();
}

criterion_group!(benches, bench);
criterion_main!(benches);
