//! Remote message paths at the shapes: a proxy node (no entities) sends to a node that
//! hosts 1,000 entities, each beside a raw framed-TCP baseline of the same shape measured in
//! the same run (ratio printed):
//! - ask: 256 always in flight (a sliding window: a new ask starts as each answer arrives),
//!   round robin over the 1,000 entities, vs raw requests over one TCP connection each way,
//!   256 always in flight, answered by a server that decodes each request, hands it to one of
//!   1,000 tasks behind an mpsc and writes back what that task answers;
//! - tell: one sender, one-way messages round robin over the 1,000 entities until every one is
//!   handled, vs raw frames decoded by the server and handed to the 1,000 tasks.
//!
//! `cargo bench --bench remote_paths` (`DDSHARD_BENCH_QUICK=1`: small sizes, figures meaningless;
//! `DDSHARD_BENCH_ONLY=ask` or `tell`: one part, for a profile).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Add, CountingEntity};
use ddshard::testkit::TestCluster;
use ddshard::{ShardRegion, ShardingSettings};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

const ENTITIES: usize = 1_000;
const WINDOW: usize = 256;

/// A raw request: correlation id, entity index, the message (rmp).
#[derive(Serialize, Deserialize)]
struct RawRequest {
    id: u64,
    entity: u32,
    reply: bool,
    #[serde(with = "serde_bytes")]
    msg: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct RawReply {
    id: u64,
    #[serde(with = "serde_bytes")]
    reply: Vec<u8>,
}

fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(8 << 20).new_codec()
}

/// A writer task for one side of the baseline's connection: woken by a frame, it yields once
/// (so the tasks already woken add theirs), then writes whatever has queued up and flushes, as
/// the transport's writer does.
fn spawn_writer(
    mut sink: futures::stream::SplitSink<Framed<TcpStream, LengthDelimitedCodec>, Bytes>,
) -> mpsc::UnboundedSender<Bytes> {
    let (out, mut rx) = mpsc::unbounded_channel::<Bytes>();
    tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            tokio::task::yield_now().await;
            sink.feed(first).await.unwrap();
            while let Ok(more) = rx.try_recv() {
                sink.feed(more).await.unwrap();
            }
            sink.flush().await.unwrap();
        }
    });
    out
}

/// The baseline's client: frames go out through one writer task that flushes what has queued
/// (as the transport's writer does), answers come back on the same connection.
struct RawClient {
    out: mpsc::UnboundedSender<Bytes>,
    pending: Arc<Mutex<HashMap<u64, oneshot::Sender<u64>>>>,
    next: AtomicU64,
}

impl RawClient {
    async fn start() -> Arc<RawClient> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(raw_server(listener));
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (sink, mut source) = Framed::new(stream, codec()).split();
        let out = spawn_writer(sink);
        let pending: Arc<Mutex<HashMap<u64, oneshot::Sender<u64>>>> = Arc::default();
        let p = pending.clone();
        tokio::spawn(async move {
            while let Some(Ok(frame)) = source.next().await {
                let r: RawReply = rmp_serde::from_slice(&frame).unwrap();
                let v: u64 = rmp_serde::from_slice(&r.reply).unwrap();
                if let Some(tx) = p.lock().unwrap().remove(&r.id) {
                    let _ = tx.send(v);
                }
            }
        });
        Arc::new(RawClient { out, pending, next: AtomicU64::new(1) })
    }

    fn send(&self, entity: usize, reply: Option<oneshot::Sender<u64>>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let wants = reply.is_some();
        if let Some(tx) = reply {
            self.pending.lock().unwrap().insert(id, tx);
        }
        let msg = rmp_serde::to_vec_named(&Add(1)).unwrap();
        let req = RawRequest { id, entity: entity as u32, reply: wants, msg };
        self.out.send(Bytes::from(rmp_serde::to_vec_named(&req).unwrap())).unwrap();
    }

    async fn ask(&self, entity: usize) -> u64 {
        let (tx, rx) = oneshot::channel();
        self.send(entity, Some(tx));
        rx.await.unwrap()
    }
}

/// The baseline's server: decodes each request, hands it to the entity's task, which answers
/// through the connection's writer task.
async fn raw_server(listener: TcpListener) {
    let (stream, _) = listener.accept().await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sink, mut source) = Framed::new(stream, codec()).split();
    let out = spawn_writer(sink);
    let entities: Vec<mpsc::UnboundedSender<(Add, Option<u64>)>> = (0..ENTITIES)
        .map(|_| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(Add, Option<u64>)>();
            let out = out.clone();
            tokio::spawn(async move {
                let mut c = CountingEntity::default();
                while let Some((m, reply)) = rx.recv().await {
                    c.0 += m.0;
                    common::HANDLED.fetch_add(1, Ordering::Relaxed);
                    if let Some(id) = reply {
                        let reply = rmp_serde::to_vec_named(&c.0).unwrap();
                        let _ = out.send(Bytes::from(rmp_serde::to_vec_named(&RawReply { id, reply }).unwrap()));
                    }
                }
            });
            tx
        })
        .collect();
    while let Some(Ok(frame)) = source.next().await {
        let req: RawRequest = rmp_serde::from_slice(&frame).unwrap();
        let msg: Add = rmp_serde::from_slice(&req.msg).unwrap();
        let _ = entities[req.entity as usize].send((msg, req.reply.then_some(req.id)));
    }
}

fn main() {
    let rt = common::runtime();
    let (mut cluster, proxy, ids) = rt.block_on(async {
        let c = TestCluster::start(2).await.unwrap();
        c.await_converged(Duration::from_secs(30)).await;
        let settings = ShardingSettings { number_of_shards: 100, ..ShardingSettings::default() };
        let host: ShardRegion<CountingEntity> =
            c.node(0).sharding().start("counter", |_: &str| CountingEntity::default(), settings.clone()).await.unwrap();
        let proxy: ShardRegion<CountingEntity> = c.node(1).sharding().start_proxy("counter", settings).await.unwrap();
        let ids: Arc<Vec<String>> = Arc::new((0..ENTITIES).map(|i| format!("c{i}")).collect());
        // Every entity runs and every shard's home is known on both sides.
        for id in ids.iter() {
            host.ask(id, Add(0)).await.unwrap();
            proxy.ask(id, Add(0)).await.unwrap();
        }
        (c, proxy, ids)
    });
    let raw = rt.block_on(RawClient::start());
    let passes = common::sized(5, 1);

    // Ask, 256 always in flight.
    if common::part("ask") {
        let total = common::sized(400_000, 2_000);
        let (mut raw_rates, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..passes {
            let r = raw.clone();
            if common::side("baseline") {
                raw_rates.push(rt.block_on(async move {
                    let t = Instant::now();
                    common::sliding(total, WINDOW, |i| {
                        let r = r.clone();
                        async move {
                            r.ask(i % ENTITIES).await;
                        }
                    })
                    .await;
                    total as f64 / t.elapsed().as_secs_f64()
                }));
            }
            let (p, ids) = (proxy.clone(), ids.clone());
            if common::side("ours") {
                ours.push(rt.block_on(async move {
                    let t = Instant::now();
                    common::sliding(total, WINDOW, |i| {
                        let (p, ids) = (p.clone(), ids.clone());
                        async move {
                            p.ask(&ids[i % ENTITIES], Add(1)).await.unwrap();
                        }
                    })
                    .await;
                    total as f64 / t.elapsed().as_secs_f64()
                }));
            }
        }
        let (raw_ask, ask) = (common::median(&mut raw_rates), common::median(&mut ours));
        println!(
            "remote ask, proxy -> host, {WINDOW} in flight over {ENTITIES} entities: region {ask:.0}/s vs raw framed TCP {raw_ask:.0}/s ({:.2}x)",
            ask / raw_ask
        );
        common::print_ratio("remote_ask_window_256_vs_raw_tcp", ask, raw_ask);
    }

    // Tell, one sender, until every message is handled.
    if common::part("tell") {
        let total = common::sized(1_000_000, 5_000);
        let (mut raw_rates, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..passes {
            if common::side("baseline") {
                raw_rates.push(rt.block_on(async {
                    let target = common::HANDLED.load(Ordering::Relaxed) + total as u64;
                    let t = Instant::now();
                    for i in 0..total {
                        raw.send(i % ENTITIES, None);
                    }
                    common::handled(target).await;
                    total as f64 / t.elapsed().as_secs_f64()
                }));
            }
            if common::side("ours") {
                ours.push(rt.block_on(async {
                    let target = common::HANDLED.load(Ordering::Relaxed) + total as u64;
                    let t = Instant::now();
                    let mut i = 0;
                    while i < total {
                        match proxy.tell(&ids[i % ENTITIES], Add(1)) {
                            Ok(()) => i += 1,
                            // The peer's send queue is full: the writer is behind; let it run.
                            Err(ddshard::Error::SendQueueFull { .. }) => tokio::task::yield_now().await,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    common::handled(target).await;
                    total as f64 / t.elapsed().as_secs_f64()
                }));
            }
        }
        let (raw_tell, tell) = (common::median(&mut raw_rates), common::median(&mut ours));
        println!(
            "remote tell, proxy -> host, {ENTITIES} entities: region {tell:.0}/s vs raw framed TCP {raw_tell:.0}/s ({:.2}x)",
            tell / raw_tell
        );
        common::print_ratio("remote_tell_vs_raw_tcp", tell, raw_tell);
    }
    rt.block_on(cluster.shutdown());
}
