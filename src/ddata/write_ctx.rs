//! Who writes and with which clock: the writer identity, the LWW marker and the context every
//! local change of a replicated value carries. A leaf of `ddata`: every data type uses it.

/// Identity of a writer. The LWW marker's writer is the incarnation (`node_id#generation`);
/// an OR-set's writer is the incarnation for keys that are not durable, and the node's durable
/// store (`node_id#store-<id>`) for keys that are, so a restart with its disk adds no writer
/// (see [`WriteCtx`] for how a store writer never reuses a counter).
pub(crate) type Actor = String;

/// LWW marker: hybrid logical clock value, then the writer, so two writers never tie.
pub(crate) type Marker = (u64, Actor);

/// What an update closure may use: the writer identities and the LWW clock.
///
/// **OR-set counters of a store writer.** A store writer outlives its process, and a process
/// may have sent dots it never committed (replication does not wait for the local fsync), so
/// a restarted writer must not count on from what its disk holds. Its store reserves counters
/// durably instead: every counter this process uses lies in `[counter_floor, counter_ceiling)`,
/// the floor being the ceiling the previous process had reserved. The first add of a set in
/// this process jumps to the floor and claims the counters it skipped as seen (they belong to
/// adds that were never acknowledged), so the set's causal context stays one entry per writer.
#[derive(Debug)]
pub struct WriteCtx {
    pub(crate) actor: Actor,
    pub(crate) clock: u64,
    pub(crate) now_ms: u64,
    /// Writer of OR-set adds.
    pub(crate) set_actor: Actor,
    /// Lowest OR-set counter this process may use (0: no floor).
    pub(crate) counter_floor: u64,
    /// OR-set counters at or above this are not reserved durably: such an add is refused.
    pub(crate) counter_ceiling: u64,
    /// OR-set adds refused (counters exhausted or not reserved); the replicator fails the
    /// update when this moved.
    pub(crate) refused_adds: std::cell::Cell<u64>,
    /// OR-set adds refused because the member was longer than peers decode; the replicator
    /// fails the update when this moved.
    pub(crate) refused_too_long: std::cell::Cell<u64>,
    /// A fenced-map write of this update refused by its fence (see [`WriteCtx::refuse`]).
    pub(crate) fenced: Option<super::fenced::Fenced>,
}

impl WriteCtx {
    /// A context for code that builds CRDT values outside a replicator (tests, tools): one
    /// writer for every type, no counter reservation.
    pub fn new(actor: impl Into<Actor>, now_ms: u64) -> Self {
        let actor = actor.into();
        WriteCtx {
            set_actor: actor.clone(),
            actor,
            clock: 0,
            now_ms,
            counter_floor: 0,
            counter_ceiling: u64::MAX,
            refused_adds: std::cell::Cell::new(0),
            refused_too_long: std::cell::Cell::new(0),
            fenced: None,
        }
    }

    /// A context whose OR-set adds are written by `set_actor` with counters in
    /// `[floor, ceiling)` (a store writer; see the type's documentation).
    pub fn with_set_writer(mut self, set_actor: impl Into<Actor>, floor: u64, ceiling: u64) -> Self {
        self.set_actor = set_actor.into();
        self.counter_floor = floor;
        self.counter_ceiling = ceiling;
        self
    }

    /// OR-set adds refused so far (no reserved counter was left).
    pub fn refused_adds(&self) -> u64 {
        self.refused_adds.get()
    }

    /// OR-set adds refused so far because the member was longer than 16 KiB, the longest an
    /// OR-set holds.
    pub fn refused_too_long(&self) -> u64 {
        self.refused_too_long.get()
    }

    /// Reports that this update's write to a [`FencedMap`](super::FencedMap) was refused by the map's fence:
    /// the replicator then fails the key with [`Error::Fenced`](crate::error::Error::Fenced) (the other keys of the update
    /// go on).
    pub fn refuse(&mut self, fenced: super::fenced::Fenced) {
        self.fenced = Some(fenced);
    }

    /// The writer identity.
    pub fn actor(&self) -> &str {
        &self.actor
    }

    /// Next marker, strictly above `floor` and every marker this writer issued: a writer that
    /// has read a value always overwrites it, whatever the wall clocks say.
    pub(super) fn next_marker(&mut self, floor: u64) -> Marker {
        // Saturating: a peer's marker at u64::MAX must not panic or wrap the clock.
        let t = self.now_ms.max(self.clock.saturating_add(1)).max(floor.saturating_add(1));
        self.clock = t;
        (t, self.actor.clone())
    }
}
