//! Typed errors of the whole crate.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can go wrong in ddshard, as a type a caller can match on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is out of range or inconsistent; the message names it.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A socket could not be bound or another I/O operation failed.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What ddshard was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// Gossip (chitchat) could not start or failed.
    #[error("gossip error: {0}")]
    Gossip(String),

    /// The LMDB store under `data_dir` could not be opened, read or written (a corrupt file ends
    /// up here, never in a panic).
    #[error("durable store at {path}: {reason}")]
    Storage {
        /// The store's directory.
        path: PathBuf,
        /// What failed.
        reason: String,
    },

    /// The node (or the component asked) has shut down.
    #[error("node is shut down")]
    ShutDown,

    /// No connection to the peer could be used to send the message.
    #[error("peer {peer} is not reachable: {reason}")]
    PeerUnavailable {
        /// The peer's node id.
        peer: String,
        /// Why.
        reason: String,
    },

    /// The per-peer send queue is full; the message was not sent.
    #[error("send queue to {peer} is full; message dropped")]
    SendQueueFull {
        /// The peer's node id.
        peer: String,
    },

    /// A request did not get its response in time.
    #[error("request to {peer} timed out")]
    RequestTimeout {
        /// The peer's node id.
        peer: String,
    },

    /// The message could not be encoded or decoded.
    #[error("codec error: {0}")]
    Codec(String),

    /// Fewer replicas are reachable than the consistency level needs; nothing was sent and the
    /// local value (for an update) was still changed and will spread by gossip.
    #[error("consistency needs {needed} replicas but only {reachable} are reachable")]
    NotEnoughReplicas {
        /// Replicas needed, this node included.
        needed: usize,
        /// Replicas reachable, this node included.
        reachable: usize,
    },

    /// The consistency level was not reached within the timeout. For an update the local value
    /// is changed and will spread by gossip; retry if you need the guarantee.
    #[error("consistency timed out: {acked} of {needed} replicas answered")]
    ConsistencyTimeout {
        /// Replicas needed, this node included.
        needed: usize,
        /// Replicas that answered, this node included.
        acked: usize,
    },

    /// The key holds a CRDT of another type than the one asked for.
    #[error("key {key:?} holds a {found}, not a {expected}")]
    WrongDataType {
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type stored.
        found: &'static str,
    },

    /// A write under `epoch` was refused because a newer allocation (epoch `fence`) has
    /// claimed the state it writes: this writer is a stale incarnation and must stop.
    #[error("write to {key:?} under epoch {epoch} refused: epoch {fence} has claimed it")]
    Fenced {
        /// What was written (a replicator key, or the entity's type and id).
        key: String,
        /// The writer's epoch.
        epoch: u64,
        /// The epoch that claimed the state.
        fence: u64,
    },

    /// Entity ids must not be empty.
    #[error("entity id must not be empty")]
    EmptyEntityId,

    /// The entity id is longer than [`MAX_ENTITY_ID_LEN`](crate::sharding::MAX_ENTITY_ID_LEN)
    /// bytes (the longest a remembered-entity set holds).
    #[error("entity id of {len} bytes is longer than the {max} allowed")]
    EntityIdTooLong {
        /// The id's length in bytes.
        len: usize,
        /// The longest allowed.
        max: usize,
    },

    /// The region's buffer for messages whose shard home is unknown is full; the message was
    /// dropped (counted and logged).
    #[error("buffer of region {type_name:?} is full ({buffer_size} messages); message dropped")]
    BufferFull {
        /// Entity type.
        type_name: String,
        /// The configured `buffer_size`.
        buffer_size: usize,
    },

    /// The entity's mailbox already holds `entity_mailbox_capacity` messages it has not taken
    /// yet (it is slower than its senders); the message was dropped (counted).
    #[error("mailbox of entity {entity_id:?} is full ({capacity} messages); message dropped")]
    MailboxFull {
        /// The entity.
        entity_id: String,
        /// The configured `entity_mailbox_capacity`.
        capacity: usize,
    },

    /// A durable entity's state is over `state.max_bytes` once encoded: nothing was written,
    /// and the entity restarts from its stored state.
    #[error(
        "state of entity {entity_id:?} is {bytes} bytes encoded, over sharding.state.max_bytes = {max}; not written"
    )]
    StateTooLarge {
        /// The entity.
        entity_id: String,
        /// Its encoded size.
        bytes: usize,
        /// The configured `state.max_bytes`.
        max: usize,
    },

    /// The replicated slot that holds the entity's remembered id or durable state (one of its
    /// shard's `remember.slots` or `state.slots` keys) is at its byte budget, one
    /// replicator message: nothing was written, the entity was not started (remembered ids) or
    /// restarts from its stored state (durable state), and the shard serves every other
    /// entity. A slot this full means ids or states far larger than planned, or ids chosen to
    /// land in one slot: raise the slot count, or find the client.
    #[error("slot {slot} of shard {shard:?} is at its budget of {budget} bytes; entity {entity_id:?} not written")]
    SlotFull {
        /// The entity.
        entity_id: String,
        /// Its shard.
        shard: String,
        /// The slot (remembered-id or state key) of the shard the entity maps to.
        slot: u32,
        /// The budget: the replicator's largest message, `replicator.max_gossip_message_bytes`
        /// capped at half of `transport.max_frame_size`.
        budget: usize,
    },

    /// Remember-entities: the entity's shard already remembers its limit of entities
    /// ([`RememberEntitiesSettings::max_per_shard`](crate::sharding::RememberEntitiesSettings::max_per_shard)):
    /// the entity was not started and nothing was written; the shard serves every entity it
    /// remembers, and one that passivates makes room.
    #[error("shard {shard:?} remembers its limit of {limit} entities; entity {entity_id:?} not started")]
    RememberedLimit {
        /// The entity.
        entity_id: String,
        /// Its shard.
        shard: String,
        /// The limit.
        limit: usize,
    },

    /// A durable entity's stored state does not decode as its `State` type (the type changed
    /// incompatibly): the entity answers this instead of starting from `Default`.
    #[error("stored state of {type_name} entity {entity_id:?} does not decode: {reason}")]
    StateUndecodable {
        /// The entity type.
        type_name: String,
        /// The entity.
        entity_id: String,
        /// The decoder's message.
        reason: String,
    },

    /// A durable entity's state write was not acknowledged (not enough replicas, a timeout, a
    /// storage failure): its outcome is unknown (the write may still spread from the replicas
    /// it reached) and the entity restarts from what its node's replica holds.
    #[error("state of entity {entity_id:?} not persisted: {reason}")]
    StateNotPersisted {
        /// The entity.
        entity_id: String,
        /// Why.
        reason: String,
    },

    /// No reply within the ask timeout.
    #[error("ask to entity {entity_id:?} timed out after {timeout:?}")]
    AskTimeout {
        /// The entity.
        entity_id: String,
        /// The timeout used.
        timeout: std::time::Duration,
    },

    /// The message was not handled: the entity stopped or panicked, its shard was handed off,
    /// or the payload did not decode.
    #[error("message to entity {entity_id:?} was not handled: {reason}")]
    NotDelivered {
        /// The entity.
        entity_id: String,
        /// Why.
        reason: String,
    },

    /// The entity answered a typed request ([`crate::sharding::Request`]) with a reply of
    /// another kind: a bug in the entity's handler.
    #[error("entity {entity_id:?} answered request {request} with a reply of another kind")]
    UnexpectedReply {
        /// The entity.
        entity_id: String,
        /// The request's type.
        request: &'static str,
    },

    /// A reliable-delivery producer ([`crate::sharding::Producer`]) holds as many bytes of
    /// unconfirmed messages as its budget allows: the message was not stored.
    #[error(
        "producer {producer_id:?} holds {queued_bytes} bytes unconfirmed; a message of {bytes} bytes passes its budget of {max_queued_bytes}"
    )]
    ProducerQueueFull {
        /// The producer.
        producer_id: String,
        /// The message's size.
        bytes: usize,
        /// What the producer holds.
        queued_bytes: usize,
        /// Its budget.
        max_queued_bytes: usize,
    },

    /// A message over the size one producer message may have (a frame's worth, less room for
    /// its envelope): not stored.
    #[error("message to entity {entity_id:?} is {bytes} bytes encoded, over the limit of {max}")]
    MessageTooLarge {
        /// The entity.
        entity_id: String,
        /// Its encoded size.
        bytes: usize,
        /// The limit.
        max: usize,
    },

    /// A reliable delivery was given up: its entity panicked on it more than the producer's
    /// `max_redeliveries` times. The producer's dead-letter hook got it.
    #[error("message {seq} of producer {producer_id:?} to entity {entity_id:?} was given up: {reason}")]
    DeadLettered {
        /// The producer.
        producer_id: String,
        /// The entity.
        entity_id: String,
        /// The message's number in its stream.
        seq: u64,
        /// The entity's last panic on it.
        reason: String,
    },

    /// The producer stopped (every handle dropped, or its node shut down) before the message
    /// was confirmed: without a durable queue it is no longer sent.
    #[error("producer {producer_id:?} stopped before the message was confirmed")]
    ProducerStopped {
        /// The producer.
        producer_id: String,
    },

    /// A newer incarnation of this producer (the same id, started again here or elsewhere)
    /// claimed its durable queue: this one stopped. What it stored is the newer one's now.
    #[error("producer {producer_id:?} (epoch {epoch}) was superseded by a newer incarnation (epoch {fence})")]
    ProducerFenced {
        /// The producer.
        producer_id: String,
        /// This incarnation's epoch.
        epoch: u64,
        /// The newer one's.
        fence: u64,
    },

    /// A sharded type of this name is already started on this node.
    #[error("entity type {0:?} is already started on this node")]
    TypeAlreadyStarted(String),

    /// No member of the cluster has this node id.
    #[error("no member {0:?} in the cluster")]
    UnknownMember(String),

    /// The coordinator could not be reached for a query.
    #[error("coordinator of {0:?} is not available")]
    CoordinatorUnavailable(String),

    /// The address is not usable (for example, the wildcard address as an advertised address).
    #[error("address {0} cannot be advertised to peers")]
    BadAddress(SocketAddr),

    /// A call's argument is out of range or does not apply to its target (the message says
    /// which): an invalid entity type name, a daemon process of 0 workers, an active-entity
    /// limit for a type that has none.
    #[error("bad request: {0}")]
    BadRequest(String),

    /// An activation log file holds a line that is not an activation record.
    #[error("activation log {path}:{line}: {reason}")]
    ActivationLog {
        /// The file.
        path: PathBuf,
        /// The line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },

    /// The admin HTTP API could not be reached, or answered with an error status.
    #[error("admin API: {message}")]
    AdminApi {
        /// The HTTP status, when there was an answer.
        status: Option<u16>,
        /// The request and what went wrong.
        message: String,
    },

    /// A metrics recorder could not be installed (one per process).
    #[error("metrics: {0}")]
    Metrics(String),

    /// A `ddshard node` process (test kit) did not start, stop or answer as expected.
    #[error("node process: {0}")]
    Process(String),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub(crate) fn storage(path: &std::path::Path, reason: impl ToString) -> Self {
        Error::Storage { path: path.to_path_buf(), reason: reason.to_string() }
    }

    /// Whether the same call may succeed if made again later, unchanged: the failure was a
    /// passing condition of the cluster (a peer away, a queue or buffer full, a quorum short, a
    /// timeout, a coordinator or home moving). Not for bad input, refused or undecodable
    /// data, a stale writer, local configuration or a stopped node. A retried write that
    /// timed out may have been applied once already (`StateNotPersisted`, `AskTimeout`): retry
    /// only what is idempotent, or check first.
    pub fn is_retryable(&self) -> bool {
        // Every variant is named (no `_`): a new one must be placed on a side here.
        match self {
            Error::PeerUnavailable { .. }
            | Error::SendQueueFull { .. }
            | Error::RequestTimeout { .. }
            | Error::NotEnoughReplicas { .. }
            | Error::ConsistencyTimeout { .. }
            | Error::BufferFull { .. }
            | Error::MailboxFull { .. }
            | Error::StateNotPersisted { .. }
            | Error::AskTimeout { .. }
            | Error::NotDelivered { .. }
            | Error::ProducerQueueFull { .. }
            | Error::CoordinatorUnavailable(_) => true,
            Error::Config(_)
            | Error::Io { .. }
            | Error::Gossip(_)
            | Error::Storage { .. }
            | Error::ShutDown
            | Error::Codec(_)
            | Error::WrongDataType { .. }
            | Error::Fenced { .. }
            | Error::EmptyEntityId
            | Error::EntityIdTooLong { .. }
            | Error::StateTooLarge { .. }
            | Error::SlotFull { .. }
            | Error::RememberedLimit { .. }
            | Error::StateUndecodable { .. }
            | Error::UnexpectedReply { .. }
            | Error::MessageTooLarge { .. }
            | Error::DeadLettered { .. }
            | Error::ProducerStopped { .. }
            | Error::ProducerFenced { .. }
            | Error::TypeAlreadyStarted(_)
            | Error::UnknownMember(_)
            | Error::BadAddress(_)
            | Error::BadRequest(_)
            | Error::ActivationLog { .. }
            | Error::Metrics(_)
            | Error::Process(_) => false,
            // Unreachable or failing now; a later call may find it back (a restarting node).
            Error::AdminApi { status, .. } => status.is_none_or(|s| s == 503 || s == 502 || s == 504),
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_passing_conditions_of_the_cluster_are_retryable() {
        let s = || String::from("x");
        let table: Vec<(Error, bool)> = vec![
            (Error::PeerUnavailable { peer: s(), reason: s() }, true),
            (Error::SendQueueFull { peer: s() }, true),
            (Error::RequestTimeout { peer: s() }, true),
            (Error::NotEnoughReplicas { needed: 2, reachable: 1 }, true),
            (Error::ConsistencyTimeout { needed: 2, acked: 1 }, true),
            (Error::BufferFull { type_name: s(), buffer_size: 1 }, true),
            (Error::MailboxFull { entity_id: s(), capacity: 1 }, true),
            (Error::StateNotPersisted { entity_id: s(), reason: s() }, true),
            (Error::AskTimeout { entity_id: s(), timeout: std::time::Duration::from_secs(1) }, true),
            (Error::NotDelivered { entity_id: s(), reason: s() }, true),
            (Error::CoordinatorUnavailable(s()), true),
            (Error::Config(s()), false),
            (Error::io("x", std::io::Error::other("x")), false),
            (Error::Gossip(s()), false),
            (Error::storage(std::path::Path::new("/x"), "x"), false),
            (Error::ShutDown, false),
            (Error::Codec(s()), false),
            (Error::UnexpectedReply { entity_id: s(), request: "R" }, false),
            (Error::WrongDataType { key: s(), expected: "a", found: "b" }, false),
            (Error::Fenced { key: s(), epoch: 1, fence: 2 }, false),
            (Error::EmptyEntityId, false),
            (Error::EntityIdTooLong { len: 2, max: 1 }, false),
            (Error::StateTooLarge { entity_id: s(), bytes: 2, max: 1 }, false),
            (Error::SlotFull { entity_id: s(), shard: s(), slot: 3, budget: 1 }, false),
            (Error::RememberedLimit { entity_id: s(), shard: s(), limit: 1 }, false),
            (Error::StateUndecodable { type_name: s(), entity_id: s(), reason: s() }, false),
            (Error::ProducerQueueFull { producer_id: s(), bytes: 1, queued_bytes: 1, max_queued_bytes: 1 }, true),
            (Error::MessageTooLarge { entity_id: s(), bytes: 2, max: 1 }, false),
            (Error::DeadLettered { producer_id: s(), entity_id: s(), seq: 1, reason: s() }, false),
            (Error::ProducerStopped { producer_id: s() }, false),
            (Error::ProducerFenced { producer_id: s(), epoch: 1, fence: 2 }, false),
            (Error::TypeAlreadyStarted(s()), false),
            (Error::UnknownMember(s()), false),
            (Error::BadAddress("0.0.0.0:1".parse().unwrap()), false),
            (Error::BadRequest(s()), false),
            (Error::ActivationLog { path: "/x".into(), line: 1, reason: s() }, false),
            (Error::Metrics(s()), false),
            (Error::Process(s()), false),
            (Error::AdminApi { status: None, message: s() }, true),
            (Error::AdminApi { status: Some(503), message: s() }, true),
            (Error::AdminApi { status: Some(404), message: s() }, false),
            (Error::AdminApi { status: Some(401), message: s() }, false),
        ];
        for (error, retryable) in table {
            assert_eq!(error.is_retryable(), retryable, "{error:?}");
        }
    }
}
