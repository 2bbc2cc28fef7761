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
use crate::ddata::OrSet;
use crate::ddata::replicator::Modify;
use crate::sharding::ids::remembered_slot;

/// Slot keys per shard.
const SLOTS: u32 = 4;
/// Tries of each remember write before the shard fails (as the remember writer does).
const WRITE_TRIES: u32 = 3;

fn slot_key(shard: &str, entity_id: &str) -> String {
    keys::remembered_entities(TYPE, shard, remembered_slot(entity_id, SLOTS))
}

/// One remember write: the shard instance it answers and what it records.
#[derive(Debug, Clone)]
pub(super) struct RememberWrite {
    pub shard: ShardId,
    pub instance: u64,
    pub adds: BTreeSet<String>,
    pub removes: BTreeSet<String>,
    pub attempt: u32,
}

impl Sim {
    /// A new remembering shard on node `i`: the core, then the load of its slots.
    pub(super) fn start_remembering_shard(&mut self, i: usize, shard: &ShardId, epoch: u64) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let stop_timeout = crate::sharding::shard::entity_stop_timeout(s.handoff_timeout);
        let core = ShardCore::remembering(stop_timeout, s.entity_restart_backoff);
        node.shards.insert(shard.clone(), (core, epoch));
        node.next_write += 1;
        let instance = node.next_write;
        node.shard_instances.insert(shard.clone(), instance);
        self.load_remembered(i, shard, instance);
    }

    /// The remembered-id load of a shard instance: one majority read of its slots.
    pub(super) fn load_remembered(&mut self, i: usize, shard: &ShardId, instance: u64) {
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let s = settings(&self.cfg);
        let keys = (0..SLOTS).map(|slot| keys::remembered_entities(TYPE, shard, slot)).collect();
        let input = RepInput::GetMany {
            keys,
            consistency: Consistency::MAJORITY,
            timeout: s.waiting_for_state_timeout,
            reply: RepReply::RememberLoad { shard: shard.clone(), instance },
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
        result: crate::Result<Vec<Option<ReplicatedData>>>,
    ) {
        if !self.is_current(i, &shard, instance) {
            return;
        }
        let input = match result {
            Ok(values) => {
                let mut ids = BTreeSet::new();
                for value in values.into_iter().flatten() {
                    match value {
                        ReplicatedData::OrSet(set) => ids.extend(set.members()),
                        other => self.report.violations.push(format!("remembered slot holds a {}", other.type_name())),
                    }
                }
                let me = self.nodes[i].as_ref().expect("running").addr.clone();
                self.trace(|| format!("{me} shard {shard} loads {} remembered ids", ids.len()));
                ShardInput::Loaded(ids)
            }
            Err(e) => {
                let me = self.nodes[i].as_ref().expect("running").addr.clone();
                self.trace(|| format!("{me} shard {shard} cannot load its remembered ids: {e}"));
                ShardInput::StoreFailed
            }
        };
        self.shard_input(i, &shard, input);
    }

    /// Sends `w` as one multi-key majority update (one slot key per touched slot).
    pub(super) fn remember_write(&mut self, i: usize, w: RememberWrite) {
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let mut by_key: BTreeMap<String, (Vec<String>, Vec<String>)> = BTreeMap::new();
        for id in &w.adds {
            by_key.entry(slot_key(&w.shard, id)).or_default().0.push(id.clone());
        }
        for id in &w.removes {
            by_key.entry(slot_key(&w.shard, id)).or_default().1.push(id.clone());
        }
        let updates: Vec<(String, Modify)> = by_key
            .into_iter()
            .map(|(key, (adds, removes))| {
                crate::ddata::KeyUpdate::new::<OrSet, _>(&key, move |set, ctx| {
                    set.add_all(ctx, adds);
                    for id in &removes {
                        set.remove(id);
                    }
                })
                .into_parts()
            })
            .collect();
        let s = settings(&self.cfg);
        let input = RepInput::UpdateMany {
            updates,
            consistency: Consistency::MAJORITY,
            timeout: s.updating_state_timeout / 4,
            reply: RepReply::RememberWrite(w),
        };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    pub(super) fn on_remember_written(&mut self, i: usize, w: RememberWrite, result: crate::Result<()>) {
        if result.is_ok() {
            // Acknowledged: a majority committed these starts (whether or not the shard
            // instance that asked still runs); they must never be lost.
            self.remembered_acked.extend(w.adds.iter().cloned());
            let writer = self.nodes[i].as_ref().map_or_else(|| format!("n{}", i + 1), |n| n.addr.to_string());
            let evidence = format!("acknowledged at t={} to {writer} counting [{}]", self.now_ms, self.view_summary(i));
            for id in &w.adds {
                self.remembered_evidence.entry(id.clone()).or_insert_with(|| evidence.clone());
            }
            for id in &w.removes {
                self.remembered_acked.remove(id);
            }
        }
        if !self.is_current(i, &w.shard, w.instance) {
            return;
        }
        match result {
            Ok(()) => self.shard_input(i, &w.shard, ShardInput::WriteDone { refused: Default::default() }),
            Err(_) if w.attempt + 1 < WRITE_TRIES => {
                let node = self.nodes[i].as_ref().expect("running").addr.clone();
                let retry = RememberWrite { attempt: w.attempt + 1, ..w };
                self.schedule(1, Event::RetryRemember { node, write: retry });
            }
            Err(_) => self.shard_input(i, &w.shard, ShardInput::StoreFailed),
        }
    }

    /// The shard failed (its store did not answer): it restarts after the backoff, as the host
    /// restarts it, while the region keeps it.
    pub(super) fn on_shard_failed(&mut self, i: usize, shard: &ShardId) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let Some((_, epoch)) = node.shards.remove(shard.as_str()) else { return };
        let me = node.addr.clone();
        self.trace(|| format!("{me} shard {shard} failed; restarts after the backoff"));
        let after = settings(&self.cfg).shard_failure_backoff.as_millis() as u64;
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
            self.shard_input(i, shard, ShardInput::Deliver { entity_id, msg: Msg { ask: None } });
        }
    }

    /// No acknowledged remembered id is lost: each is in every running node's set, in memory
    /// and on disk (the run ends after the cluster healed and settled).
    pub(super) fn check_no_acknowledged_id_lost(&mut self) {
        let mut lost = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            for id in &self.remembered_acked {
                let key = slot_key(&default_shard_id(id, self.cfg.shards), id);
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
            let key = slot_key(&default_shard_id(id, self.cfg.shards), id);
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
