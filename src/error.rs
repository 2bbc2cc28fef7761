//! Typed errors of the whole crate.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can go wrong in ddshard, as a type a caller can match on.
#[derive(Debug, thiserror::Error)]
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

    /// A durable entity's state is over `max_state_bytes` once encoded: nothing was written,
    /// and the entity restarts from its stored state.
    #[error("state of entity {entity_id:?} is {bytes} bytes encoded, over max_state_bytes = {max}; not written")]
    StateTooLarge {
        /// The entity.
        entity_id: String,
        /// Its encoded size.
        bytes: usize,
        /// The configured `max_state_bytes`.
        max: usize,
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
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub(crate) fn storage(path: &std::path::Path, reason: impl ToString) -> Self {
        Error::Storage { path: path.to_path_buf(), reason: reason.to_string() }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
