//! The admin HTTP API (feature `admin`): [`router`] gives an axum `Router` users merge into
//! their own server; [`serve`] runs one on its own listener. JSON everywhere except
//! `/metrics`. `ddshard node` serves it on `--admin-addr` (loopback by default) with the token
//! of `DDSHARD_ADMIN_TOKEN`, plus `GET/PUT/DELETE /kv/{id}` for its sample type.
//!
//! | route | answers |
//! |---|---|
//! | `GET /` | the dashboard: members, per type shards and entities per region, the allocation table, a shard's explanation on click, recent events, live rates |
//! | `GET /alive` | 200 while the process serves |
//! | `GET /ready` | 200 when [`Node::readiness`] holds, else 503 with the reasons |
//! | `GET /metrics` | Prometheus text (with a [`PrometheusHandle`] in the settings; else 404) |
//! | `GET /cluster/members`, `GET /cluster/members/{node}` | members as this node sees them |
//! | `PUT /cluster/members/{node}` `{"operation": "leave" \| "down" \| "forget"}` | token; 202 (`forget`: takes a node that is not a member out of the roster, 400 otherwise) |
//! | `GET /cluster/roster` | the replica holders durable quorums count ([`RosterInfo`]) |
//! | `GET /cluster/events` | membership events, Server-Sent Events |
//! | `GET /cluster/shards` | the entity types started on this node |
//! | `GET /cluster/shards/{type}` | cluster-wide entity counts per region; regions that did not answer listed in `failed` |
//! | `GET /cluster/shards/{type}/allocation` | the coordinator's allocation table |
//! | `GET /cluster/shards/{type}/shards/{shard}/explain` | why the shard is where it is |
//! | `GET /cluster/shards/{type}/entities/{id}` | the entity's shard, home and epoch |
//! | `POST /cluster/shards/{type}/rebalance?dry_run=true` | the plan; without `dry_run` (token) a round runs |
//!
//! Mutating routes need `Authorization: Bearer <token>` with the token of [`AdminSettings`]:
//! without a configured token they answer 403 (off), with a missing or wrong one 401. Errors
//! are `{"error": "…"}` with 400 (bad input: an empty or too long id, a malformed body), 404
//! (unknown type, shard, member, route), 413 (a body over `max_body_bytes`, a state or
//! remembered-id slot over its budget), 503 (the cluster cannot serve it now: no coordinator, no
//! majority, a full buffer, a message not delivered; retry) or 504 (a timeout); 500 only for a
//! fault of the node itself (its storage, a bug). Handlers only
//! await the node's own queries, each bounded by the type's ask timeout, so a slow client or a
//! slow query never blocks the node.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::Stream;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};

#[cfg(feature = "cli")]
pub mod cli;
mod server;

pub use server::ServeSettings;

use crate::error::Error;
use crate::membership::{Member, MemberEvent};
use crate::node::Node;
use crate::sharding::RegionRef;

/// How the admin API runs.
#[derive(Clone, Default)]
pub struct AdminSettings {
    /// The bearer token of mutating routes (`None` or empty: they answer 403).
    pub token: Option<String>,
    /// Where `/metrics` renders from (see [`crate::metrics::install_prometheus`]); `None`:
    /// `/metrics` answers 404.
    pub prometheus: Option<PrometheusHandle>,
    /// Largest request body (larger: 413). 0 means the default, 64 KiB.
    pub max_body_bytes: usize,
    /// How long `/cluster/shards/{type}` waits for each region (0: the type's ask timeout).
    pub stats_timeout: Duration,
}

impl std::fmt::Debug for AdminSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminSettings")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("prometheus", &self.prometheus.is_some())
            .field("max_body_bytes", &self.max_body_bytes)
            .finish()
    }
}

#[derive(Clone)]
struct Admin {
    node: Node,
    settings: AdminSettings,
}

/// The admin routes over `node`. No fallback: merge it into any axum app (unknown routes get
/// the app's own fallback; [`no_such_route`] answers them in JSON) or nest it under a prefix
/// (`.nest("/admin", router(..))`: the dashboard at `/admin` reaches every route relative to
/// itself).
pub fn router(node: Node, settings: AdminSettings) -> Router {
    let limit = if settings.max_body_bytes == 0 { 64 * 1024 } else { settings.max_body_bytes };
    Router::new()
        .route("/", get(dashboard))
        .route("/alive", get(alive))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/cluster/members", get(members))
        .route("/cluster/members/{node}", get(member).put(member_operation))
        .route("/cluster/roster", get(roster))
        .route("/cluster/events", get(events))
        .route("/cluster/shards", get(types))
        .route("/cluster/shards/{type_name}", get(type_stats))
        .route("/cluster/shards/{type_name}/allocation", get(allocation))
        .route("/cluster/shards/{type_name}/shards/{shard}/explain", get(explain))
        .route("/cluster/shards/{type_name}/entities/{id}", get(locate))
        .route("/cluster/shards/{type_name}/rebalance", post(rebalance))
        .route("/cluster/daemons/{name}", get(daemon_scale).put(daemon_rescale))
        .route("/cluster/producers", get(producers))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(Admin { node, settings })
}

/// A running admin server.
#[derive(Debug)]
pub struct AdminServer {
    /// The bound address (after port 0).
    pub local_addr: SocketAddr,
}

/// Serves `app` (usually [`router`], merged with the user's own routes) on `addr` (port 0
/// picks one) until the node shuts down, bounded by `settings`: a capped number of
/// connections, a deadline for each request head, and a `Host` check (see [`ServeSettings`]).
pub async fn serve(
    node: &Node,
    addr: SocketAddr,
    app: Router,
    settings: ServeSettings,
) -> crate::error::Result<AdminServer> {
    let local_addr = server::serve(node, addr, app, settings).await?;
    Ok(AdminServer { local_addr })
}

/// The probes alone, `GET /alive` and `GET /ready`, for a listener of their own that an
/// orchestrator reaches and nothing else does.
pub fn probe_router(node: Node) -> Router {
    Router::new()
        .route("/alive", get(alive))
        .route("/ready", get(ready))
        .fallback(no_such_route)
        .with_state(Admin { node, settings: AdminSettings::default() })
}

/// A fallback answering 404 `{"error": "no such route"}` (what `ddshard node` serves beside
/// [`router`]).
pub async fn no_such_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such route")
}

/// An error answer, `{"error": "…"}` with its status; `From<Error>` picks the status of a
/// ddshard error (for the user's own routes beside [`router`]).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// An answer with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(serde_json::json!({ "error": self.message }))).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::UnknownMember(_) => StatusCode::NOT_FOUND,
            // The client's input: fix the request.
            Error::EmptyEntityId | Error::EntityIdTooLong { .. } | Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::StateTooLarge { .. } | Error::SlotFull { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            // A capacity the operator set: more of the same request does not help.
            Error::RememberedLimit { .. } => StatusCode::INSUFFICIENT_STORAGE,
            // The cluster cannot serve it now: retry later.
            Error::CoordinatorUnavailable(_)
            | Error::ShutDown
            | Error::PeerUnavailable { .. }
            | Error::NotEnoughReplicas { .. }
            | Error::StateNotPersisted { .. }
            | Error::NotDelivered { .. }
            | Error::BufferFull { .. }
            | Error::MailboxFull { .. }
            | Error::SendQueueFull { .. }
            | Error::Fenced { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Error::AskTimeout { .. } | Error::RequestTimeout { .. } | Error::ConsistencyTimeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn json<T: Serialize>(value: &T) -> Response {
    axum::Json(value).into_response()
}

fn authorize(admin: &Admin, headers: &HeaderMap) -> ApiResult<()> {
    check_bearer(admin.settings.token.as_deref(), headers)
}

/// Checks the bearer token of a mutating route against `token`, comparing in constant time.
/// An empty token is no token (mutating routes off): an empty `Authorization: Bearer ` must not
/// match it.
pub(crate) fn check_bearer(token: Option<&str>, headers: &HeaderMap) -> ApiResult<()> {
    let Some(token) = token.filter(|t| !t.trim().is_empty()) else {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "no admin token configured: mutating routes are off"));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let same =
        given.len() == token.len() && given.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    if same { Ok(()) } else { Err(ApiError::new(StatusCode::UNAUTHORIZED, "missing or wrong bearer token")) }
}

fn region(admin: &Admin, type_name: &str) -> ApiResult<RegionRef> {
    admin.node.sharding().region(type_name).ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, format!("entity type {type_name:?} is not started on this node"))
    })
}

/// The dashboard: one self-contained page (no CDN, no build step) that reads the JSON routes.
const DASHBOARD: &str = include_str!("admin/dashboard.html");

async fn dashboard() -> axum::response::Html<&'static str> {
    axum::response::Html(DASHBOARD)
}

async fn alive(State(admin): State<Admin>) -> Response {
    json(&serde_json::json!({ "alive": true, "node": admin.node.node_id() }))
}

async fn ready(State(admin): State<Admin>) -> Response {
    let readiness = admin.node.readiness().await;
    let status = if readiness.ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(readiness)).into_response()
}

async fn metrics(State(admin): State<Admin>) -> ApiResult<Response> {
    let Some(prometheus) = &admin.settings.prometheus else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "no metrics exporter installed"));
    };
    admin.node.sample_metrics().await;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], prometheus.render()).into_response())
}

/// A member as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    /// Its node id.
    pub node_id: String,
    /// Its incarnation (`node_id#generation`).
    pub address: String,
    /// `joining`, `up`, `leaving`, `exiting`, `removed` or `down`.
    pub status: String,
    /// Its roles.
    pub roles: Vec<String>,
    /// The application version it runs (`app_version`).
    #[serde(default)]
    pub app_version: String,
    /// No counted observer sees it unreachable.
    pub reachable: bool,
    /// The observers whose heartbeats find it unreachable.
    pub unreachable_by: Vec<String>,
    /// Its age order among Up members (lower is older).
    pub up_number: Option<u64>,
    /// Its messaging (TCP) address.
    pub messaging_addr: String,
    /// This node.
    pub is_self: bool,
}

fn member_info(node: &Node, m: &Member) -> MemberInfo {
    MemberInfo {
        node_id: m.node_id().to_string(),
        address: m.address().to_string(),
        status: m.status().as_key().to_string(),
        roles: m.roles().to_vec(),
        app_version: m.app_version().to_string(),
        reachable: m.is_reachable(),
        unreachable_by: m.observed_unreachable_by().iter().map(ToString::to_string).collect(),
        up_number: m.up_number(),
        messaging_addr: m.messaging_addr().to_string(),
        is_self: m.address() == node.address(),
    }
}

async fn members(State(admin): State<Admin>) -> Response {
    let snap = admin.node.membership();
    let list: Vec<MemberInfo> = snap.members.iter().map(|m| member_info(&admin.node, m)).collect();
    json(&list)
}

async fn member(State(admin): State<Admin>, Path(node_id): Path<String>) -> ApiResult<Response> {
    let snap = admin.node.membership();
    let m = snap.member(&node_id).ok_or_else(|| ApiError::from(Error::UnknownMember(node_id.clone())))?;
    Ok(json(&member_info(&admin.node, m)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemberOperation {
    operation: String,
}

async fn member_operation(
    State(admin): State<Admin>,
    Path(node_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    authorize(&admin, &headers)?;
    let op: MemberOperation = serde_json::from_slice(&body).map_err(|e| {
        let expected = r#"{"operation": "leave" | "down" | "forget"}"#;
        ApiError::new(StatusCode::BAD_REQUEST, format!("expected {expected}: {e}"))
    })?;
    match op.operation.as_str() {
        "leave" => admin.node.leave_member(&node_id, Duration::from_secs(5)).await?,
        "down" => admin.node.down(&node_id).await?,
        "forget" => admin.node.replicator().forget_replica(&node_id).await?,
        other => {
            let why = format!("unknown operation {other:?}: leave, down or forget");
            return Err(ApiError::new(StatusCode::BAD_REQUEST, why));
        }
    }
    let answer = serde_json::json!({ "node": node_id, "operation": op.operation });
    Ok((StatusCode::ACCEPTED, axum::Json(answer)).into_response())
}

/// One node id of the roster durable quorums are counted over, as `/cluster/roster` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RosterInfo {
    /// The node id.
    pub node_id: String,
    /// Its newest generation seen.
    pub generation: u64,
    /// Whether it is an Up or Leaving member now (one that is not still counts until it is
    /// back, leaves gracefully or is forgotten).
    pub member: bool,
}

async fn roster(State(admin): State<Admin>) -> ApiResult<Response> {
    let snap = admin.node.membership();
    let member = |id: &str| snap.members.iter().any(|m| &*m.address().node_id == id && m.status().is_routable());
    let list: Vec<RosterInfo> = admin
        .node
        .replicator()
        .roster()
        .await?
        .into_iter()
        .map(|(node_id, generation)| RosterInfo { member: member(&node_id), node_id, generation })
        .collect();
    Ok(json(&list))
}

/// A membership event as `/cluster/events` sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberEventInfo {
    /// `joined`, `up`, `leaving`, `exited`, `downed`, `removed`, `unreachable`,
    /// `observers-changed` or `reachable`.
    pub kind: String,
    /// The member's incarnation.
    pub address: String,
    /// The member as it is now (not for `removed`).
    pub member: Option<MemberInfo>,
}

fn event_info(node: &Node, e: &MemberEvent) -> MemberEventInfo {
    MemberEventInfo {
        kind: e.kind().into(),
        address: e.address().to_string(),
        member: e.member().map(|m| member_info(node, m)),
    }
}

async fn events(State(admin): State<Admin>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let node = admin.node.clone();
    let rx = node.subscribe_events();
    let stream = futures::stream::unfold((rx, node), |(mut rx, node)| async move {
        let event = match rx.recv().await {
            Ok(e) => {
                let info = event_info(&node, &e);
                Event::default().event(info.kind.clone()).json_data(&info).unwrap_or_default()
            }
            // A slow client missed events: tell it, then go on.
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                Event::default().event("lagged").data(n.to_string())
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok(event), (rx, node)))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A reliable-delivery producer running on this node, as `GET /cluster/producers` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerRow {
    /// The producer's id.
    pub producer_id: String,
    /// The entity type it sends to.
    pub type_name: String,
    /// Messages stored.
    pub stored: u64,
    /// Messages confirmed.
    pub confirmed: u64,
    /// Sends of a message sent before.
    pub resent: u64,
    /// Sends that waited for room.
    pub demand_waits: u64,
    /// Messages given up.
    pub dead_lettered: u64,
    /// Messages stored and not yet confirmed.
    pub unconfirmed: usize,
    /// Their encoded bytes.
    pub queued_bytes: usize,
    /// Entities they are for.
    pub entities: usize,
    /// How long the oldest of them has waited, in milliseconds (`null`: none).
    pub oldest_unconfirmed_age_ms: Option<u64>,
}

/// `GET /cluster/producers`: this node's producers, in start order.
async fn producers(State(admin): State<Admin>) -> Response {
    let rows: Vec<ProducerRow> = admin
        .node
        .sharding()
        .producers()
        .into_iter()
        .map(|p| {
            let s = p.stats;
            ProducerRow {
                producer_id: p.producer_id,
                type_name: p.type_name,
                stored: s.stored,
                confirmed: s.confirmed,
                resent: s.resent,
                demand_waits: s.demand_waits,
                dead_lettered: s.dead_lettered,
                unconfirmed: s.unconfirmed,
                queued_bytes: s.queued_bytes,
                entities: s.entities,
                oldest_unconfirmed_age_ms: s
                    .oldest_unconfirmed_age
                    .map(|a| u64::try_from(a.as_millis()).unwrap_or(u64::MAX)),
            }
        })
        .collect();
    json(&rows)
}

/// An entity type started on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeInfo {
    /// The type's name.
    pub type_name: String,
    /// This node only routes for it.
    pub proxy: bool,
}

async fn types(State(admin): State<Admin>) -> Response {
    let sharding = admin.node.sharding();
    let list: Vec<TypeInfo> = sharding
        .type_names()
        .into_iter()
        .filter_map(|t| sharding.region(&t).map(|r| TypeInfo { proxy: r.is_proxy(), type_name: t }))
        .collect();
    json(&list)
}

/// Cluster-wide entity counts of one type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeStats {
    /// The entity type.
    pub type_name: String,
    /// Region → shard → running entities, for the regions that answered.
    pub regions: std::collections::BTreeMap<String, std::collections::BTreeMap<String, usize>>,
    /// Regions that did not answer in time.
    pub failed: Vec<String>,
}

async fn type_stats(State(admin): State<Admin>, Path(type_name): Path<String>) -> ApiResult<Response> {
    let region = region(&admin, &type_name)?;
    let timeout =
        if admin.settings.stats_timeout.is_zero() { Duration::from_secs(3) } else { admin.settings.stats_timeout };
    let stats = region.cluster_stats(timeout).await?;
    Ok(json(&TypeStats {
        type_name,
        regions: stats.regions.into_iter().map(|(r, shards)| (r.to_string(), shards)).collect(),
        failed: stats.failed.iter().map(ToString::to_string).collect(),
    }))
}

async fn allocation(State(admin): State<Admin>, Path(type_name): Path<String>) -> ApiResult<Response> {
    Ok(json(&region(&admin, &type_name)?.allocation().await?))
}

async fn explain(State(admin): State<Admin>, Path((type_name, shard)): Path<(String, String)>) -> ApiResult<Response> {
    match region(&admin, &type_name)?.explain(&shard).await? {
        Some(e) => Ok(json(&e)),
        None => Err(ApiError::new(StatusCode::NOT_FOUND, format!("{type_name:?} has no shard {shard:?}"))),
    }
}

async fn locate(State(admin): State<Admin>, Path((type_name, id)): Path<(String, String)>) -> ApiResult<Response> {
    Ok(json(&region(&admin, &type_name)?.locate(&id).await?))
}

#[derive(Deserialize)]
struct RebalanceQuery {
    #[serde(default)]
    dry_run: bool,
}

async fn rebalance(
    State(admin): State<Admin>,
    Path(type_name): Path<String>,
    Query(q): Query<RebalanceQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let region = region(&admin, &type_name)?;
    if q.dry_run {
        return Ok(json(&region.rebalance_plan().await?));
    }
    authorize(&admin, &headers)?;
    Ok(json(&region.rebalance().await?))
}

fn daemon(admin: &Admin, name: &str) -> ApiResult<crate::sharding::DaemonProcess> {
    admin.node.sharding().daemon(name).ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, format!("daemon process {name:?} is not started on this node"))
    })
}

/// `GET /cluster/daemons/{name}`: the process's revision, count and rescale in progress.
async fn daemon_scale(State(admin): State<Admin>, Path(name): Path<String>) -> ApiResult<Response> {
    Ok(json(&daemon(&admin, &name)?.scale().await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rescale {
    count: usize,
}

/// How long `PUT /cluster/daemons/{name}` waits for the new revision's workers.
const RESCALE_WAIT: Duration = Duration::from_secs(30);

/// `PUT /cluster/daemons/{name}` `{"count": N}`: rescales the process cluster-wide; answers
/// with the new scale once its workers run (504 after 30 s, the rescale going on).
async fn daemon_rescale(
    State(admin): State<Admin>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    authorize(&admin, &headers)?;
    let process = daemon(&admin, &name)?;
    let rescale: Rescale = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!(r#"expected {{"count": N}}: {e}"#)))?;
    Ok(json(&process.set_count(rescale.count, RESCALE_WAIT).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_input_answers_4xx_unavailability_503_timeouts_504_and_only_node_faults_500() {
        let status = |e: Error| ApiError::from(e).status;
        assert_eq!(status(Error::EmptyEntityId), StatusCode::BAD_REQUEST);
        assert_eq!(status(Error::EntityIdTooLong { len: 2000, max: 1024 }), StatusCode::BAD_REQUEST);
        assert_eq!(status(Error::BadRequest("x".into())), StatusCode::BAD_REQUEST);
        assert_eq!(status(Error::UnknownMember("n9".into())), StatusCode::NOT_FOUND);
        assert_eq!(status(Error::NotEnoughReplicas { needed: 3, reachable: 1 }), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(Error::CoordinatorUnavailable("t".into())), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(Error::ShutDown), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(Error::ConsistencyTimeout { needed: 2, acked: 1 }), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(status(Error::Config("broken".into())), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
