//! The operator-facing side of `ddshard node`: a sample key-value entity type and a small line
//! protocol over TCP, so tests and operators can reach entities from outside the process.
//!
//! A line protocol (not HTTP) because it needs no extra dependency, works with `nc`, and every
//! answer is one line a test can read. Requests and answers (one line each, UTF-8, at most
//! 64 KiB):
//!
//! | request | answer |
//! |---|---|
//! | `PUT <id> <value…>` | `OK <node> <epoch>` (the value is durable before the answer) |
//! | `GET <id>` | `VALUE <node> <epoch> <value…>` or `NONE <node> <epoch>` |
//! | `DEL <id>` | `OK <node> <epoch>` (the value is deleted and the entity passivates) |
//! | `STATS` | `STATS <node>=<entities>… FAILED <node>…` |
//! | `MEMBERS` | `MEMBERS <node>:<status>[:unreachable]…` |
//!
//! Errors answer `ERR <reason>`; the connection stays open.

use std::net::SocketAddr;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LinesCodec};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::activation::{ActivationGuard, ActivationLog};
use crate::error::{Error, Result};
use crate::node::Node;
use crate::sharding::{Durable, DurableEntity, EntityContext, ShardRegion};

/// The sample entity: one string value per id, durable (it survives rebalances, leaves,
/// crashes and full-cluster restarts).
#[derive(Debug, Default)]
pub struct KvEntity {
    node: String,
    log: Option<ActivationLog>,
    activation: Option<ActivationGuard>,
}

impl KvEntity {
    /// An empty entry hosted on `node`.
    pub fn new(node: &str) -> Self {
        KvEntity { node: node.to_string(), log: None, activation: None }
    }

    /// An empty entry hosted on `node` that records its activation (start, epoch, stop) in
    /// `log`.
    pub fn with_activation_log(node: &str, log: ActivationLog) -> Self {
        KvEntity { log: Some(log), ..Self::new(node) }
    }
}

/// Messages of [`KvEntity`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum KvMsg {
    /// Sets the value.
    Put(String),
    /// Reads the value.
    Get,
    /// Deletes the value and passivates the entity.
    Delete,
}

/// The stored state of [`KvEntity`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct KvState {
    /// The value, if set.
    pub value: Option<String>,
}

/// Reply of [`KvEntity`]: the value and where / with which epoch it was served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvReply {
    /// Current value.
    pub value: Option<String>,
    /// Node that hosts the entity.
    pub node: String,
    /// Fencing epoch of the activation.
    pub epoch: u64,
}

impl DurableEntity for KvEntity {
    type Message = KvMsg;
    type Reply = KvReply;
    type State = KvState;

    async fn started(&mut self, _state: &KvState, ctx: &EntityContext) {
        if let Some(log) = &self.log {
            self.activation = Some(log.started(ctx.entity_id(), &self.node, ctx.epoch()));
        }
    }

    async fn handle(&mut self, state: &mut KvState, msg: KvMsg, ctx: &mut EntityContext) -> KvReply {
        match msg {
            KvMsg::Put(v) => {
                state.value = Some(v);
                ctx.persist();
            }
            KvMsg::Get => {}
            KvMsg::Delete => {
                state.value = None;
                ctx.delete_state();
                ctx.passivate();
            }
        }
        KvReply { value: state.value.clone(), node: self.node.clone(), epoch: ctx.epoch() }
    }
}

/// The region of the sample type.
pub type KvRegion = ShardRegion<Durable<KvEntity>>;

const MAX_LINE: usize = 64 * 1024;

/// Answers one request line.
pub async fn answer(node: &Node, region: &KvRegion, line: &str) -> String {
    let mut words = line.split_whitespace();
    let cmd = words.next().unwrap_or("").to_ascii_uppercase();
    let result: Result<String> = async {
        match cmd.as_str() {
            "PUT" | "GET" | "DEL" => {
                let id = words.next().ok_or_else(|| Error::Config("missing entity id".into()))?;
                let msg = match cmd.as_str() {
                    "PUT" => KvMsg::Put(words.collect::<Vec<_>>().join(" ")),
                    "GET" => KvMsg::Get,
                    _ => KvMsg::Delete,
                };
                let r = region.ask(id, msg).await?;
                Ok(match (cmd.as_str(), r.value) {
                    ("GET", Some(v)) => format!("VALUE {} {} {v}", r.node, r.epoch),
                    ("GET", None) => format!("NONE {} {}", r.node, r.epoch),
                    _ => format!("OK {} {}", r.node, r.epoch),
                })
            }
            "STATS" => {
                let stats = region.cluster_stats(Duration::from_secs(3)).await?;
                let mut out = String::from("STATS");
                for (r, shards) in &stats.regions {
                    out.push_str(&format!(" {}={}", r.node_id, shards.values().sum::<usize>()));
                }
                out.push_str(" FAILED");
                for r in &stats.failed {
                    out.push_str(&format!(" {}", r.node_id));
                }
                Ok(out)
            }
            "MEMBERS" => {
                let mut out = String::from("MEMBERS");
                for m in node.members() {
                    out.push_str(&format!(" {}:{:?}", m.node_id(), m.status()));
                    if !m.is_reachable() {
                        out.push_str(":unreachable");
                    }
                }
                Ok(out)
            }
            "" => Err(Error::Config("empty request".into())),
            other => Err(Error::Config(format!("unknown command {other:?}"))),
        }
    }
    .await;
    result.unwrap_or_else(|e| format!("ERR {}", e.to_string().replace('\n', " ")))
}

/// Serves the line protocol on `listener` until `shutdown`.
pub async fn serve(node: Node, region: KvRegion, listener: TcpListener, shutdown: CancellationToken) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => match a {
                Ok(x) => x,
                Err(e) => {
                    warn!(error = %e, "client accept failed");
                    continue;
                }
            },
        };
        let (node, region, shutdown) = (node.clone(), region.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut lines = Framed::new(stream, LinesCodec::new_with_max_length(MAX_LINE));
            loop {
                let line = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    l = lines.next() => l,
                };
                let reply = match line {
                    Some(Ok(l)) => answer(&node, &region, &l).await,
                    Some(Err(e)) => {
                        debug!(%peer, error = %e, "bad client line; closing");
                        let _ = lines.send(format!("ERR {e}")).await;
                        return;
                    }
                    None => return,
                };
                if lines.send(reply).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Sends one request line to a node's client address and returns the answer line.
pub async fn call(addr: SocketAddr, request: &str, timeout: Duration) -> Result<String> {
    let work = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
        let mut lines = Framed::new(stream, LinesCodec::new_with_max_length(MAX_LINE));
        lines.send(request.to_string()).await.map_err(|e| Error::Codec(e.to_string()))?;
        match lines.next().await {
            Some(Ok(l)) => Ok(l),
            Some(Err(e)) => Err(Error::Codec(e.to_string())),
            None => Err(Error::PeerUnavailable { peer: addr.to_string(), reason: "closed without answer".into() }),
        }
    };
    tokio::time::timeout(timeout, work).await.map_err(|_| Error::RequestTimeout { peer: addr.to_string() })?
}
