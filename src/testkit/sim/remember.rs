//! Remember-entities in the simulation, performed as the region's remember I/O does: a new
//! shard loads its remembered ids with one majority read of its slot keys; a shard's starts go
//! out as one multi-key majority update (retried, then the shard fails and restarts after
//! `shard_failure_backoff`, as the host does); recovery starts arrive as start-only messages.
//!
//! The property it adds: **no acknowledged remembered id is lost**. Every id whose start write
//! was acknowledged (a majority committed it) is, at the end of the run, in the remembered set
//! of every running node, in memory and on its disk.
//!
//! The coordinator's side is the shipped one: its state writes add each allocated shard to the
//! durable remembered-shards set, its take-over reads that set and allocates every shard in it,
//! and it reallocates a dead region's shards at once (`coordinator/take_over.rs`), so
//! remembered entities come back without being asked.

use super::*;
use crate::sharding::ids::remembered_slot;
use crate::sharding::shard::batch::{BatchAction, RememberBatch, RememberOutcome, RememberRequest};
use crate::sharding::shard::{StoreResult, batch};

fn slot_key(cfg: &SimConfig, shard: &str, entity_id: &str) -> String {
    keys::remembered_entities(TYPE, shard, remembered_slot(entity_id, settings(cfg).remember.slots))
}

/// One remember write: the shard instance it answers and what it records.
#[derive(Debug, Clone)]
pub(super) struct RememberWrite {
    pub shard: ShardId,
    pub instance: u64,
    pub adds: BTreeSet<String>,
    pub removes: BTreeSet<String>,
}

impl Sim {
    /// A new remembering shard on node `i`: the core, then the load of its slots.
    pub(super) fn start_remembering_shard(&mut self, i: usize, shard: &ShardId, epoch: u64) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let core = crate::sharding::shard::new_shard_core(&settings(&self.cfg), false, PolicySettings::idle(None));
        node.shards.insert(shard.clone(), (core, epoch));
        node.next_write += 1;
        let instance = node.next_write;
        node.shard_instances.insert(shard.clone(), instance);
        self.load_remembered(i, shard, instance, 1);
    }

    /// The remembered-id load of a shard instance: one majority read of its slots.
    pub(super) fn load_remembered(&mut self, i: usize, shard: &ShardId, instance: u64, tries: usize) {
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let keys = crate::sharding::shard::remember::slot_keys(TYPE, shard, s.remember.slots);
        let input = ReplicatorInput::GetMany {
            keys,
            consistency: batch::remember_read_consistency(&s),
            timeout: s.coordinator.waiting_for_state_timeout,
            reply: RepReply::RememberLoad { shard: shard.clone(), instance, tries },
        };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    pub(super) fn is_current(&self, i: usize, shard: &ShardId, instance: u64) -> bool {
        self.nodes[i]
            .as_ref()
            .is_some_and(|n| n.shard_instances.get(shard) == Some(&instance) && n.shards.contains_key(shard.as_str()))
    }

    pub(super) fn on_remember_loaded(
        &mut self,
        i: usize,
        shard: ShardId,
        instance: u64,
        tries: usize,
        result: crate::Result<Vec<Option<ReplicatedData>>>,
    ) {
        if !self.is_current(i, &shard, instance) {
            return;
        }
        let input = match result {
            Ok(values) => {
                let mut sets = Vec::new();
                for value in values {
                    match value {
                        Some(ReplicatedData::OrSet(set)) => sets.push(Some(set)),
                        None => sets.push(None),
                        Some(other) => {
                            self.report.violations.push(format!("remembered slot holds a {}", other.type_name()))
                        }
                    }
                }
                let ids = crate::sharding::shard::remember::loaded_ids(sets);
                let me = self.nodes[i].as_ref().expect("running").addr.clone();
                self.trace(|| format!("{me} shard {shard} loads {} remembered ids", ids.len()));
                ShardInput::Loaded(ids)
            }
            Err(e) if crate::sharding::shard::batch::load_again(tries, &e) => {
                let me = self.nodes[i].as_ref().expect("running").addr.clone();
                self.trace(|| format!("{me} shard {shard} loads its remembered ids again: {e}"));
                self.load_remembered(i, &shard, instance, tries + 1);
                return;
            }
            Err(e) => {
                let me = self.nodes[i].as_ref().expect("running").addr.clone();
                self.trace(|| format!("{me} shard {shard} cannot load its remembered ids: {e}"));
                ShardInput::StoreFailed
            }
        };
        self.shard_input(i, &shard, input);
    }

    /// Writes `w` as the region's remember writer does: one [`RememberBatch`] (here of one
    /// shard's changes), one multi-key majority update per try.
    pub(super) fn remember_write(&mut self, i: usize, w: RememberWrite) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let id = node.next_write;
        node.next_write += 1;
        let request = RememberRequest { shard: w.shard.clone(), adds: w.adds.clone(), removes: w.removes.clone() };
        let (budget, counters, mut out) = (slot_budget(), Arc::default(), Vec::new());
        let batch = RememberBatch::start(TYPE, s.remember.slots, budget, counters, vec![request], &mut out);
        node.remember_batches.insert(id, (w, batch));
        self.perform_remember_batch(i, id, out);
    }

    pub(super) fn perform_remember_batch(&mut self, i: usize, id: u64, actions: Vec<BatchAction<RememberOutcome>>) {
        let (now, wall) = (self.now(), self.wall());
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            match action {
                BatchAction::Write(updates) => {
                    let input = ReplicatorInput::UpdateMany {
                        updates: updates.into_iter().map(crate::ddata::KeyUpdate::into_parts).collect(),
                        consistency: batch::remember_write_consistency(&settings(&self.cfg)),
                        timeout: batch::write_timeout(&settings(&self.cfg)),
                        reply: RepReply::RememberWrite(id),
                    };
                    let mut out = Vec::new();
                    node.replicator.handle(input, now, wall, &mut out);
                    self.perform_replicator(i, out);
                }
                BatchAction::Done(outcome) => {
                    let Some((w, _)) = node.remember_batches.remove(&id) else { return };
                    let result = outcome.results.into_iter().next().unwrap_or(StoreResult::Failed);
                    self.on_remember_written(i, w, result);
                }
            }
        }
    }

    /// A try of remember batch `id` on node `i` ended.
    pub(super) fn on_remember_try(&mut self, i: usize, id: u64, result: crate::Result<()>) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, batch)) = node.remember_batches.get_mut(&id) else { return };
        let mut out = Vec::new();
        batch.handle(result, &mut out);
        self.perform_remember_batch(i, id, out);
    }

    fn on_remember_written(&mut self, i: usize, w: RememberWrite, result: StoreResult) {
        if let StoreResult::WriteDone { refused } = &result {
            // Acknowledged: a majority committed these starts (whether or not the shard
            // instance that asked still runs); they must never be lost. Refused ones were not
            // written.
            let acked: Vec<&String> = w.adds.iter().filter(|id| !refused.contains(*id)).collect();
            self.remembered_acked.extend(acked.iter().map(|id| (*id).clone()));
            let writer = self.nodes[i].as_ref().map_or_else(|| format!("n{}", i + 1), |n| n.addr.to_string());
            let evidence = format!("acknowledged at t={} to {writer} counting [{}]", self.now_ms, self.view_summary(i));
            for id in acked {
                self.remembered_evidence.entry(id.clone()).or_insert_with(|| evidence.clone());
            }
            for id in &w.removes {
                self.remembered_acked.remove(id);
            }
        }
        if !self.is_current(i, &w.shard, w.instance) {
            return;
        }
        let input = match result {
            StoreResult::WriteDone { refused } => ShardInput::WriteDone { refused },
            _ => ShardInput::StoreFailed,
        };
        self.shard_input(i, &w.shard, input);
    }

    /// The shard failed (its store did not answer): it restarts after the backoff, as the host
    /// restarts it, while the region keeps it.
    pub(super) fn on_shard_failed(&mut self, i: usize, shard: &ShardId) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, epoch)) = node.shards.remove(shard.as_str()) else { return };
        let me = node.addr.clone();
        self.trace(|| format!("{me} shard {shard} failed; restarts after the backoff"));
        let backoff = settings(&self.cfg).shard_failure_backoff;
        let after = crate::sharding::shard::batch::shard_restart_after(backoff, shard, epoch).as_millis() as u64;
        self.schedule(after, Event::RestartShard { node: me, shard: shard.clone(), epoch });
    }

    pub(super) fn on_restart_shard(&mut self, node: UniqueAddress, shard: ShardId, epoch: u64) {
        let Some(i) = self.slot_of(&node) else { return };
        let now = self.now();
        let node = self.nodes[i].as_mut().expect("running");
        if !node.shards.contains_key(shard.as_str()) {
            let mut out = Vec::new();
            node.region.handle(RegionInput::RestartFailedShard { shard, epoch }, now, &mut out);
            self.perform_region(i, out);
        }
    }

    /// Feeds one input to a shard core of node `i` and performs what it asks.
    pub(super) fn shard_input(&mut self, i: usize, shard: &ShardId, input: ShardInput<Msg>) {
        let now = self.now();
        let Some((core, _)) = self.nodes[i].as_mut().and_then(|n| n.shards.get_mut(shard.as_str())) else { return };
        let mut out = Vec::new();
        core.handle(input, now, &mut out);
        for a in out {
            self.perform_shard(i, shard, a);
        }
    }

    /// Recovery: each remembered id gets a start-only message through its shard.
    pub(super) fn recover(&mut self, i: usize, shard: &ShardId, entity_ids: Vec<String>) {
        for entity_id in entity_ids {
            self.shard_input(i, shard, ShardInput::Deliver { entity_id, msg: Msg { ask: None, delivery: None } });
        }
    }

    /// No acknowledged remembered id is lost: each is in every running node's set, in memory
    /// and on disk (the run ends after the cluster healed and settled).
    pub(super) fn check_no_acknowledged_id_lost(&mut self) {
        let mut lost = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            for id in &self.remembered_acked {
                let key = slot_key(&self.cfg, &default_shard_id(id, self.cfg.shards), id);
                let in_memory =
                    matches!(node.replicator.local_value(&key), Some(ReplicatedData::OrSet(s)) if s.contains(id));
                let on_disk = matches!(self.disks[i].get(&key), Some(ReplicatedData::OrSet(s)) if s.contains(id));
                if !in_memory || !on_disk {
                    lost.push(format!("{id} on {} (memory {in_memory}, disk {on_disk})", node.addr));
                }
            }
        }
        if !lost.is_empty() {
            let first: Vec<&str> = lost.iter().take(10).map(String::as_str).collect();
            // The first missing id's history: its acknowledgement and the disks holding it.
            let id = lost[0].split(' ').next().unwrap_or_default();
            let key = slot_key(&self.cfg, &default_shard_id(id, self.cfg.shards), id);
            let disks: Vec<String> = (0..self.disks.len())
                .filter(|j| matches!(self.disks[*j].get(&key), Some(ReplicatedData::OrSet(s)) if s.contains(id)))
                .map(|j| format!("n{}", j + 1))
                .collect();
            let evidence = self.remembered_evidence.get(id).cloned().unwrap_or_default();
            let v = format!(
                "{} acknowledged remembered ids missing, first: {}; {id} was {evidence}; on the disks of [{}]",
                lost.len(),
                first.join(", "),
                disks.join(", ")
            );
            self.report.violations.push(v);
        }
        self.report.remembered_acked = self.remembered_acked.len();
    }
}
