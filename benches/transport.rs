//! Small-message throughput between two endpoints on loopback: ddshard's transport beside a
//! plain length-delimited TCP stream carrying the same rmp-encoded messages, in the same run.

use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ddshard::transport::{PeerAddr, Transport};
use ddshard::{TransportSettings, UniqueAddress};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

const BATCH: usize = 20_000;

/// About 100 bytes once encoded.
#[derive(Serialize, Deserialize, Clone)]
struct Msg {
    entity: String,
    seq: u64,
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

fn msg(seq: u64) -> Msg {
    Msg { entity: "counter-12345".into(), seq, payload: vec![7u8; 64] }
}

async fn raw_pair() -> (Framed<TcpStream, LengthDelimitedCodec>, Framed<TcpStream, LengthDelimitedCodec>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
    let c = c.unwrap();
    let s = s.unwrap().0;
    c.set_nodelay(true).unwrap();
    s.set_nodelay(true).unwrap();
    (Framed::new(c, LengthDelimitedCodec::new()), Framed::new(s, LengthDelimitedCodec::new()))
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut g = c.benchmark_group("two_node_small_messages");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(8));

    let (mut tx, rx) = rt.block_on(raw_pair());
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
    rt.spawn(async move {
        let mut rx = rx;
        let mut n = 0usize;
        while let Some(Ok(frame)) = rx.next().await {
            let _m: Msg = rmp_serde::from_slice(&frame).unwrap();
            n += 1;
            if n.is_multiple_of(BATCH) {
                done_tx.send(()).await.unwrap();
            }
        }
    });
    g.bench_function("baseline_raw_framed_tcp", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    for i in 0..BATCH {
                        let bytes = Bytes::from(rmp_serde::to_vec_named(&msg(i as u64)).unwrap());
                        tx.feed(bytes).await.unwrap();
                        if i % 128 == 127 {
                            SinkExt::<Bytes>::flush(&mut tx).await.unwrap();
                        }
                    }
                    SinkExt::<Bytes>::flush(&mut tx).await.unwrap();
                    done_rx.recv().await.unwrap();
                }
                start.elapsed()
            })
        })
    });

    let shutdown = CancellationToken::new();
    let (a, b) = rt.block_on(async {
        let mk = |id: &str| {
            Transport::bind(
                "127.0.0.1:0".parse().unwrap(),
                UniqueAddress::new(id, 1),
                "bench".into(),
                TransportSettings::default(),
                shutdown.clone(),
            )
        };
        (mk("a").await.unwrap(), mk("b").await.unwrap())
    });
    let to: PeerAddr = b.local().clone();
    let mut inbox = b.subscribe("bench", 65_536);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
    rt.spawn(async move {
        let mut n = 0usize;
        while let Some(m) = inbox.recv().await {
            let _m: Msg = rmp_serde::from_slice(&m.body).unwrap();
            n += 1;
            if n.is_multiple_of(BATCH) {
                done_tx.send(()).await.unwrap();
            }
        }
    });
    g.bench_function("ddshard_transport", |bch| {
        bch.iter_custom(|iters| {
            rt.block_on(async {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    let mut i = 0;
                    while i < BATCH {
                        let body = rmp_serde::to_vec_named(&msg(i as u64)).unwrap();
                        match a.send(&to, "bench", &body) {
                            Ok(()) => i += 1,
                            // Queue full: the writer is behind; let it run.
                            Err(ddshard::Error::SendQueueFull { .. }) => tokio::task::yield_now().await,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    done_rx.recv().await.unwrap();
                }
                start.elapsed()
            })
        })
    });
    g.finish();
    shutdown.cancel();
}

criterion_group!(benches, bench);
criterion_main!(benches);
