//! The coordinator in the simulation, performed as its driver does: the singleton life cycle,
//! the take-over read and the state writes, each decided by the production core
//! (`coordinator/take_over.rs`), on the node's replicator core.

use super::*;
use crate::sharding::allocation::LeastShardAllocation;
use crate::sharding::coordinator::core::{CoordinatorAction, CoordinatorCore, CoordinatorSettings};
use crate::sharding::coordinator::take_over::{
    StateWrite, StateWriteAction, StateWriteInput, TakeOverAction, TakeOverState,
};
use crate::singleton::SingletonAction;

/// The two parts of a coordinator state write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WritePart {
    State,
    RememberedShards,
}

/// A coordinator state write in flight: its core and the parts answered so far.
pub(super) struct PendingWrite {
    pub(super) id: u64,
    pub(super) core: StateWrite,
    pub(super) state: Option<crate::Result<()>>,
    pub(super) shards: Option<crate::Result<()>>,
}

pub(super) struct Coordinator {
    pub(super) core: CoordinatorCore,
    /// The term it claimed the coordinator state under.
    pub(super) term: u64,
    /// The write in flight.
    pub(super) write: Option<PendingWrite>,
}

impl Sim {
    pub(super) fn perform_singleton(&mut self, i: usize, actions: Vec<SingletonAction<TakeOverState>>) {
        let (now, wall) = (self.now(), self.wall());
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            match action {
                SingletonAction::Read { read } => {
                    let local_fence = match node.replicator.local_value(&keys::coordinator_state(TYPE)) {
                        Some(ReplicatedData::FencedMap(m)) => m.fence(),
                        _ => 0,
                    };
                    let mut out = Vec::new();
                    let take_over = TakeOver::start(TYPE, &settings(&self.cfg), local_fence, wall, &mut out);
                    node.take_over = Some((read, take_over));
                    self.perform_take_over(i, read, out);
                }
                SingletonAction::Start(found) => {
                    node.take_over = None;
                    let s = settings(&self.cfg);
                    let must_agree = s.must_agree(self.cfg.durable);
                    let registration =
                        crate::sharding::coordinator::Registration { extractor_fingerprint: EXTRACTOR, must_agree };
                    let cs = CoordinatorSettings::from_sharding(
                        &s,
                        registration,
                        crate::sharding::ids::ShardIdRule::Custom,
                        crate::config::TransportSettings::default().max_frame_size,
                    );
                    let strategy = Arc::new(LeastShardAllocation::default());
                    let term = found.term;
                    let members = node.last_view.as_ref().map(MembersView::of);
                    let mut out = Vec::new();
                    let core = found.start_coordinator(node.addr.clone(), cs, strategy, members, (now, wall), &mut out);
                    node.coordinator = Some(Coordinator { core, term, write: None });
                    let addr = node.addr.clone();
                    self.trace(|| format!("{addr} coordinator starts (term {term})"));
                    self.perform_coordinator(i, out);
                }
                SingletonAction::Stop => {
                    node.coordinator = None;
                    let addr = node.addr.clone();
                    self.trace(|| format!("{addr} coordinator stops"));
                }
            }
        }
    }

    /// Performs take-over read `read`'s actions on node `i`'s replicator, as the driver does.
    fn perform_take_over(&mut self, i: usize, read: u64, actions: Vec<TakeOverAction>) {
        let (now, wall) = (self.now(), self.wall());
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            let input = match action {
                TakeOverAction::Claim { term, consistency, timeout } => {
                    let claim = crate::sharding::coordinator::state::claim_update(TYPE, term).into_parts();
                    let reply = RepReply::TakeOverClaim { read };
                    ReplicatorInput::UpdateAndGetMany { updates: vec![claim], consistency, timeout, reply }
                }
                TakeOverAction::ReadRememberedShards { key, consistency, timeout } => {
                    ReplicatorInput::Get { key, consistency, timeout, reply: RepReply::TakeOverShards { read } }
                }
                TakeOverAction::Done(result) => {
                    node.take_over = None;
                    let mut single = Vec::new();
                    node.singleton.handle(SingletonInput::ReadDone { read, result }, now, &mut single);
                    self.perform_singleton(i, single);
                    continue;
                }
            };
            let mut out = Vec::new();
            node.replicator.handle(input, now, wall, &mut out);
            self.perform_replicator(i, out);
        }
    }

    /// Feeds an answer to take-over read `read` of node `i`, if it is still the one in flight.
    pub(super) fn take_over_input(&mut self, i: usize, read: u64, input: TakeOverInput) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, take_over)) = node.take_over.as_mut().filter(|(r, _)| *r == read) else { return };
        let mut out = Vec::new();
        take_over.handle(input, &mut out);
        self.perform_take_over(i, read, out);
    }

    pub(super) fn perform_coordinator(&mut self, i: usize, actions: Vec<CoordinatorAction>) {
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            let me = node.addr.clone();
            match action {
                CoordinatorAction::Send { to, msg } => self.send(&me, &to, Wire::ToRegion(msg)),
                CoordinatorAction::Write(entries) => {
                    let id = node.next_write;
                    node.next_write += 1;
                    let Some(c) = node.coordinator.as_mut() else { continue };
                    let mut out = Vec::new();
                    let core = StateWrite::start(&settings(&self.cfg), entries, c.term, &mut out);
                    c.write = Some(PendingWrite { id, core, state: None, shards: None });
                    self.perform_state_write(i, id, out);
                }
            }
        }
    }

    /// Performs the actions of coordinator state write `write` on node `i`, as the driver does.
    fn perform_state_write(&mut self, i: usize, write: u64, actions: Vec<StateWriteAction>) {
        let (now, wall) = (self.now(), self.wall());
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            let me = node.addr.clone();
            match action {
                StateWriteAction::Write { entries, term, consistency, timeout, remembered } => {
                    let Some(w) = node.coordinator.as_mut().and_then(|c| c.write.as_mut()) else { return };
                    w.state = None;
                    // No remembered shards to write: that part is done.
                    w.shards = remembered.is_none().then_some(Ok(()));
                    let update = crate::sharding::coordinator::state::write_update(TYPE, entries, term);
                    let reply = RepReply::StateWrite { write, part: WritePart::State };
                    let mut inputs = vec![ReplicatorInput::UpdateMany {
                        updates: vec![update.into_parts()],
                        consistency,
                        timeout,
                        reply,
                    }];
                    if let Some((shards, consistency)) = remembered {
                        let insert = crate::sharding::coordinator::state::remembered_shards_update(TYPE, shards);
                        let reply = RepReply::StateWrite { write, part: WritePart::RememberedShards };
                        inputs.push(ReplicatorInput::UpdateMany {
                            updates: vec![insert.into_parts()],
                            consistency,
                            timeout,
                            reply,
                        });
                    }
                    for input in inputs {
                        let Some(node) = self.nodes[i].as_mut() else { return };
                        let mut out = Vec::new();
                        node.replicator.handle(input, now, wall, &mut out);
                        self.perform_replicator(i, out);
                    }
                }
                StateWriteAction::RetryAfter { after, error } => {
                    self.trace(|| format!("{me} coordinator state write failed ({error}); again in {after:?}"));
                    self.schedule(after.as_millis() as u64, Event::RetryWrite { node: me, write });
                }
                StateWriteAction::Fenced { term, fence } => {
                    // A newer term claimed the state: this coordinator is a zombie.
                    self.report.coordinators_fenced += 1;
                    self.trace(|| format!("{me} coordinator write under term {term} fenced by {fence}; it stops"));
                    let node = self.nodes[i].as_mut().expect("running");
                    if let Some(c) = node.coordinator.as_mut() {
                        c.write = None;
                    }
                    let mut single = Vec::new();
                    node.singleton.handle(SingletonInput::Fenced, now, &mut single);
                    self.perform_singleton(i, single);
                }
                StateWriteAction::Acknowledged => {
                    let Some(c) = node.coordinator.as_mut() else { return };
                    c.write = None;
                    let mut out = Vec::new();
                    c.core.handle(CoordinatorInput::WriteDone, now, wall, &mut out);
                    self.perform_coordinator(i, out);
                }
            }
        }
    }

    /// One part of coordinator state write `write` answered; both answered, the write's core
    /// decides.
    pub(super) fn on_state_write_part(&mut self, i: usize, write: u64, part: WritePart, result: crate::Result<()>) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some(w) = node.coordinator.as_mut().and_then(|c| c.write.as_mut()).filter(|w| w.id == write) else {
            return;
        };
        match part {
            WritePart::State => w.state = Some(result),
            WritePart::RememberedShards => w.shards = Some(result),
        }
        if w.state.is_none() || w.shards.is_none() {
            return;
        }
        let (state, shards) = (w.state.take().expect("answered"), w.shards.take().expect("answered"));
        let mut out = Vec::new();
        w.core.handle(StateWriteInput::Written { state, shards }, &mut out);
        self.perform_state_write(i, write, out);
    }

    /// The backoff of a failed coordinator state write is over.
    pub(super) fn retry_state_write(&mut self, i: usize, write: u64) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some(w) = node.coordinator.as_mut().and_then(|c| c.write.as_mut()).filter(|w| w.id == write) else {
            return;
        };
        let mut out = Vec::new();
        w.core.handle(StateWriteInput::Retry, &mut out);
        self.perform_state_write(i, write, out);
    }
}
