//! The sample key-value entity type of `ddshard node` and its HTTP routes
//! (`GET/PUT/DELETE /kv/{id}`, merged into the admin API by [`kv_routes`]), so tests and
//! operators reach entities from outside the process.

use serde::{Deserialize, Serialize};

use crate::activation::{ActivationGuard, ActivationLog};
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

/// `GET`, `PUT` (the body is the value, UTF-8) and `DELETE` on `/kv/{id}` over the sample type,
/// answered with the [`KvReply`] as JSON; merge it into [`crate::admin::router`]. With
/// `write_token`, `PUT` and `DELETE` need `Authorization: Bearer <token>` (401 without; an
/// empty token turns them off: 403), as every mutating admin route does.
pub fn kv_routes(region: KvRegion, write_token: Option<String>) -> axum::Router {
    use axum::extract::{Path, State};
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;

    use crate::admin::ApiError;

    #[derive(Clone)]
    struct Kv {
        region: KvRegion,
        write_token: Option<String>,
    }
    /// Writes need the token (checked before the body is read: a client without it cannot
    /// hold the connection with a slow body).
    async fn require_token(
        State(kv): State<Kv>,
        req: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> Response {
        let writes = req.method() != axum::http::Method::GET && req.method() != axum::http::Method::HEAD;
        if let (true, Some(token)) = (writes, &kv.write_token)
            && let Err(refused) = crate::admin::check_bearer(Some(token), req.headers())
        {
            return refused.into_response();
        }
        next.run(req).await
    }

    async fn ask(region: &KvRegion, id: &str, msg: KvMsg) -> Response {
        match region.ask(id, msg).await {
            Ok(reply) => axum::Json(reply).into_response(),
            Err(e) => ApiError::from(e).into_response(),
        }
    }
    async fn get_value(State(kv): State<Kv>, Path(id): Path<String>) -> Response {
        ask(&kv.region, &id, KvMsg::Get).await
    }
    async fn put_value(State(kv): State<Kv>, Path(id): Path<String>, body: axum::body::Bytes) -> Response {
        match String::from_utf8(body.to_vec()) {
            Ok(value) => ask(&kv.region, &id, KvMsg::Put(value)).await,
            Err(_) => ApiError::new(axum::http::StatusCode::BAD_REQUEST, "the value must be UTF-8").into_response(),
        }
    }
    async fn delete_value(State(kv): State<Kv>, Path(id): Path<String>) -> Response {
        ask(&kv.region, &id, KvMsg::Delete).await
    }
    let kv = Kv { region, write_token };
    axum::Router::new()
        .route("/kv/{id}", get(get_value).put(put_value).delete(delete_value))
        .route_layer(axum::middleware::from_fn_with_state(kv.clone(), require_token))
        .with_state(kv)
}
