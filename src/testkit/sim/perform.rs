//! How the simulation performs the cores' actions: what the drivers do, on the in-memory
//! network and the sim's entity records.

use super::*;

impl Sim {
    /// The store of `node` committed its persists up to `through`: they are on its disk now.
    pub(super) fn on_persisted(&mut self, node: UniqueAddress, through: u64) {
        let Some(i) = self.slot_of(&node) else { return };
        // A prefix: one commit report per persisting step, so scanning the whole queue each
        // time was quadratic in a burst of writes within one fsync delay.
        while self.unsynced[i].front().is_some_and(|(ticket, _)| *ticket <= through) {
            let (_, write) = self.unsynced[i].pop_front().expect("front seen");
            self.sync(i, write);
        }
        let (now, wall) = (self.now(), self.wall());
        let mut out = Vec::new();
        let input = ReplicatorInput::Persisted { through, failure: None };
        self.nodes[i].as_mut().expect("live node").replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    /// At the end of a run every commit was reported, so nothing may still wait for one.
    /// Where the shard of `entity_id` is, as a violation names it: each coordinator's record of
    /// its home (and hand-off), and every node running it.
    pub(super) fn placement_evidence(&self, entity_id: &str) -> String {
        let shard = default_shard_id(entity_id, self.cfg.shards);
        let now = self.now();
        let mut seen = Vec::new();
        for node in self.nodes.iter().flatten() {
            if let Some(c) = node.coordinator.as_ref() {
                let table = c.core.allocation_table(TYPE, now);
                let home = table.shards.iter().find(|a| a.shard == shard).map_or_else(
                    || "no record".to_string(),
                    |a| {
                        let region = a.region.as_deref().unwrap_or("no home");
                        let hand_off = if a.hand_off.is_some() { ", hand-off in progress" } else { "" };
                        format!("{region} at epoch {}{hand_off}", a.epoch)
                    },
                );
                seen.push(format!("coordinator {} places it on {home}", node.addr));
            }
            if let Some((_, epoch)) = node.shards.get(&shard) {
                seen.push(format!("{} runs it at epoch {epoch}", node.addr));
            }
        }
        if seen.is_empty() {
            seen.push("no coordinator and no node runs it".into());
        }
        let statuses: Vec<String> = self.members.iter().map(|m| format!("{} {:?}", m.addr, m.status)).collect();
        format!("shard {shard}: {}; members: [{}]", seen.join("; "), statuses.join(", "))
    }

    pub(super) fn check_nothing_waits_for_a_commit(&mut self) {
        for node in self.nodes.iter().flatten() {
            let (in_flight, held) = node.replicator.durability_backlog();
            if in_flight + held > 0 {
                self.report
                    .violations
                    .push(format!("{}: {in_flight} persists unreported, {held} acks or replies held", node.addr));
            }
        }
    }

    /// Applies one committed write to node slot `i`'s disk.
    fn sync(&mut self, i: usize, write: KeyedWrite) {
        match write {
            (_, DiskWrite::Ceiling(c)) => self.counter_ceilings[i] = self.counter_ceilings[i].max(c),
            (key, DiskWrite::Snapshot(v)) => {
                self.disks[i].insert(key, v);
            }
            (key, DiskWrite::Delta(d)) => {
                let stored = self.disks[i].entry(key.clone()).or_insert_with(|| d.empty_value());
                if let Err(e) = stored.merge_delta(&d) {
                    self.report.violations.push(format!("persisted delta of {key} does not join: {e:?}"));
                }
            }
        }
    }

    pub(super) fn perform_replicator(&mut self, i: usize, actions: Vec<ReplicatorAction<RepReply>>) {
        // The writes reach the disk when their commit is reported, an fsync later, as with the
        // persist thread (the core holds acks and update replies until then); a crash before
        // that loses them, though their deltas may already have left.
        self.queue_persists(i, &actions);
        for action in actions {
            let Some(node) = self.nodes[i].as_mut() else { return };
            let me = node.addr.clone();
            match action {
                ReplicatorAction::Persist { .. }
                | ReplicatorAction::TrimLog { .. }
                | ReplicatorAction::Changed { .. }
                | ReplicatorAction::ReserveCounters { .. } => {}
                ReplicatorAction::Send { to, msg } => self.send(&me, &to.address, Wire::Replicator(msg)),
                ReplicatorAction::Broadcast { to, msg } => {
                    for p in to {
                        self.send(&me, &p.address, Wire::Replicator(msg.clone()));
                    }
                }
                ReplicatorAction::ReplyGetMany { reply: RepReply::TakeOverClaim { read }, result } => {
                    // As the driver's typed read: a value of another type is an error.
                    let key = keys::coordinator_state(TYPE);
                    let claimed = result.and_then(|mut values| {
                        values
                            .pop()
                            .flatten()
                            .map(|d| <FencedMap as crate::ddata::Crdt>::from_data(d, &key))
                            .transpose()
                    });
                    self.take_over_input(i, read, TakeOverInput::Claimed(claimed));
                }
                ReplicatorAction::ReplyGet { reply: RepReply::TakeOverShards { read }, result } => {
                    let key = keys::remembered_shards(TYPE);
                    let shards = result.and_then(|d| {
                        let set =
                            d.map(|d| <crate::ddata::GSet as crate::ddata::Crdt>::from_data(d, &key)).transpose()?;
                        Ok(set.map(|s| s.members()).unwrap_or_default())
                    });
                    self.take_over_input(i, read, TakeOverInput::RememberedShardsRead(shards));
                }
                ReplicatorAction::ReplyUpdate { reply: RepReply::StateWrite { write, part }, result } => {
                    // As the driver's `update_many`: a key refused by its fence is the error.
                    let result = result.and_then(crate::ddata::first_fenced);
                    self.on_state_write_part(i, write, part, result);
                }
                ReplicatorAction::ReplyGetMany { reply: RepReply::RememberLoad { shard, instance, tries }, result } => {
                    self.on_remember_loaded(i, shard, instance, tries, result)
                }
                ReplicatorAction::ReplyGetMany { reply: RepReply::StateClaim(claim), result } => {
                    self.on_states_claimed(i, claim, result)
                }
                ReplicatorAction::ReplyUpdate { reply: RepReply::EntityWrite(id), result } => {
                    self.on_state_try(i, id, result)
                }
                ReplicatorAction::ReplyUpdate { reply: RepReply::HandOver, result } => {
                    self.on_handed_over(i, &me, result);
                    return;
                }
                ReplicatorAction::ReplyGetMany { reply: RepReply::QueueClaim { producer, epoch, tries }, result } => {
                    self.on_queue_claimed(i, producer, epoch, tries, result)
                }
                ReplicatorAction::ReplyUpdate { reply: RepReply::QueueWrite(id), result } => {
                    self.on_queue_try(i, id, result)
                }
                ReplicatorAction::ReplyUpdate { reply: RepReply::RememberWrite(id), result } => {
                    // As the driver's `update_many`: a key refused by its fence is the error
                    // (remembered-id sets have none).
                    self.on_remember_try(i, id, result.and_then(crate::ddata::first_fenced))
                }
                ReplicatorAction::ReplyGet { .. }
                | ReplicatorAction::ReplyGetMany { .. }
                | ReplicatorAction::ReplyUpdate { .. } => {
                    self.report.violations.push("replicator reply of the wrong kind".into());
                }
            }
        }
    }

    /// Queues node `i`'s persists until their commit is reported (an fsync later).
    fn queue_persists(&mut self, i: usize, actions: &[ReplicatorAction<RepReply>]) {
        let mut through = 0;
        for a in actions {
            if let ReplicatorAction::ReserveCounters { ticket, ceiling } = a {
                through = through.max(*ticket);
                self.queue_unsynced(i, *ticket, DiskWrite::Ceiling(*ceiling).keyed(""));
                continue;
            }
            let ReplicatorAction::Persist { key, ticket, record } = a else { continue };
            through = through.max(*ticket);
            let Some(node) = self.nodes[i].as_ref() else { return };
            let write = match record {
                PersistRecord::Snapshot => node.replicator.local_value(key).cloned().map(DiskWrite::Snapshot),
                PersistRecord::Delta(d) => Some(DiskWrite::Delta(d.clone())),
            };
            if let Some(write) = write {
                self.queue_unsynced(i, *ticket, write.keyed(key));
            }
        }
        if through > 0 {
            let node = self.nodes[i].as_ref().expect("live node").addr.clone();
            self.schedule(FSYNC_MS, Event::Persisted { node, through });
        }
    }

    /// A write handed to node `i`'s store, behind every earlier ticket (`on_persisted` takes a
    /// commit's writes from the front).
    fn queue_unsynced(&mut self, i: usize, ticket: u64, write: KeyedWrite) {
        let queue = &mut self.unsynced[i];
        debug_assert!(queue.back().is_none_or(|(last, _)| *last <= ticket), "persist tickets out of order");
        queue.push_back((ticket, write));
    }

    /// The leaving node's replicas were handed over (or not): as `Node::leave`, the member
    /// exits either way, and a process manager restarts it when the run recovers.
    fn on_handed_over<T>(&mut self, i: usize, me: &UniqueAddress, result: crate::error::Result<T>) {
        // As `Node::leave`: the member exits whether or not the hand-over succeeded.
        if let Err(e) = &result {
            let addr = me.clone();
            self.trace(|| format!("{addr} replica not handed over: {e}"));
        }
        for m in self.members.iter_mut().filter(|m| m.addr == *me) {
            m.status = MemberStatus::Removed;
        }
        self.crash(i, "region stopped; leaves the cluster");
        self.on_membership();
        if self.recovering.is_some() {
            // A process manager's restart delay; the settle counts from the start.
            self.schedule(1_000, Event::StartAfterLeave(i));
            self.recovering = Some(self.now_ms + 1_000);
        }
    }

    pub(super) fn perform_region(&mut self, i: usize, actions: Vec<RegionAction<Msg>>) {
        let now = self.now();
        let mut work: VecDeque<RegionAction<Msg>> = actions.into();
        while let Some(action) = work.pop_front() {
            let Some(node) = self.nodes[i].as_mut() else { return };
            let me = node.addr.clone();
            match action {
                RegionAction::ToCoordinator { coordinator, msg } => {
                    self.send(&me, &coordinator, Wire::ToCoordinator(msg))
                }
                RegionAction::StartShard { shard, epoch } => match node.shards.get_mut(&shard) {
                    Some(existing) => existing.1 = epoch,
                    None if self.cfg.durable => self.start_durable_shard(i, &shard, epoch),
                    None if self.cfg.remember => self.start_remembering_shard(i, &shard, epoch),
                    None => {
                        let core = new_shard_core(&settings(&self.cfg), false, PolicySettings::idle(None));
                        node.shards.insert(shard, (core, epoch));
                    }
                },
                RegionAction::Deliver { shard, entity_id, msg } => match node.shards.get_mut(&shard) {
                    Some((core, _)) => {
                        let mut out = Vec::new();
                        core.handle(ShardInput::Deliver { entity_id, msg }, now, &mut out);
                        for a in out {
                            self.perform_shard(i, &shard, a);
                        }
                    }
                    None => self.fail(msg, NOT_HOSTED),
                },
                RegionAction::Forward { region, shard, epoch, entity_id, msg } => {
                    if let Some(ask) = msg.ask {
                        node.forwarded.insert(ask, region.clone());
                    }
                    self.send(&me, &region, Wire::Deliver { shard, epoch, entity_id, msg });
                }
                RegionAction::HandOffShard { shard } => {
                    if let Some((core, _)) = node.shards.get_mut(&shard) {
                        let mut out = Vec::new();
                        core.handle(ShardInput::HandOff, now, &mut out);
                        for a in out {
                            self.perform_shard(i, &shard, a);
                        }
                    } else {
                        // A failed shard waiting out its backoff runs nothing: stopped already.
                        let mut out = Vec::new();
                        node.region.handle(RegionInput::LocalShardStopped(shard), now, &mut out);
                        self.perform_region(i, out);
                    }
                }
                RegionAction::Drop { msg, reason, .. } => self.fail_dropped(&me, msg, reason),
                RegionAction::RegionGone(region) => self.fail_forwarded_to(i, &region),
                RegionAction::StillUnregistered { why } => self.trace(|| format!("{me} region not registered: {why}")),
                RegionAction::Stopped { forced } => {
                    self.hand_over_and_leave(i, &me, forced);
                    return;
                }
            }
        }
    }

    /// A message the region could not take fails with the error its reason names.
    fn fail_dropped(&mut self, me: &UniqueAddress, msg: Msg, reason: crate::sharding::region::core::RegionDrop) {
        let why = match reason {
            crate::sharding::region::core::RegionDrop::BufferFull => BUFFER_FULL,
            crate::sharding::region::core::RegionDrop::HandOff | crate::sharding::region::core::RegionDrop::MovedOn => {
                HAND_OFF
            }
            crate::sharding::region::core::RegionDrop::Refused => {
                self.report.violations.push(format!("{me} refused although every node has one extractor"));
                REFUSED
            }
        };
        self.fail(msg, why);
    }

    /// The asks node `i` forwarded to a region that left or went down fail.
    fn fail_forwarded_to(&mut self, i: usize, region: &UniqueAddress) {
        let node = self.nodes[i].as_mut().expect("running");
        let gone: Vec<u64> = node.forwarded.iter().filter(|(_, r)| *r == region).map(|(a, _)| *a).collect();
        for ask in &gone {
            node.forwarded.remove(ask);
        }
        for ask in gone {
            self.resolve(ask, Err(REGION_GONE));
        }
    }

    /// The graceful leave is done (or timed out): the replica goes to the members that stay,
    /// and the member exits on the reply.
    fn hand_over_and_leave(&mut self, i: usize, me: &UniqueAddress, forced: bool) {
        if forced {
            self.trace(|| format!("{me} graceful shutdown timed out"));
        }
        let (now, wall) = (self.now(), self.wall());
        let node = self.nodes[i].as_mut().expect("running");
        let timeout = crate::config::MembershipSettings::default().leave_hand_over_timeout;
        let input = ReplicatorInput::HandOver { timeout, reply: RepReply::HandOver };
        let mut out = Vec::new();
        node.replicator.handle(input, now, wall, &mut out);
        self.perform_replicator(i, out);
    }

    pub(super) fn fail(&mut self, msg: Msg, why: &'static str) {
        if let Some(ask) = msg.ask {
            self.resolve(ask, Err(why));
        }
        if let Some(flight) = msg.delivery {
            self.fail_delivery(flight, why);
        }
    }

    /// Whether `node` was paused and its peers have downed (or removed) it since: a zombie
    /// until it learns so.
    fn is_downed_zombie(&self, node: &UniqueAddress) -> bool {
        self.was_paused.contains(node) && self.downed_or_removed(node)
    }

    /// Whether the members table says `node` was downed or removed (or no longer lists it).
    pub(super) fn downed_or_removed(&self, node: &UniqueAddress) -> bool {
        self.members
            .iter()
            .find(|m| m.addr == *node)
            .is_none_or(|m| matches!(m.status, MemberStatus::Down | MemberStatus::Removed))
    }

    pub(super) fn perform_shard(&mut self, i: usize, shard: &ShardId, action: ShardAction<Msg>) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let me = node.addr.clone();
        match action {
            ShardAction::Start { entity_id, incarnation } => self.start_entity(i, shard, entity_id, incarnation),
            ShardAction::Send { entity_id, msg } => {
                if !node.entities.contains_key(&entity_id) {
                    self.fail(msg, NOT_HOSTED);
                    return;
                }
                if self.cfg.durable {
                    self.deliver_durable(i, &entity_id, msg);
                    return;
                }
                if let Some(flight) = msg.delivery {
                    self.deliver_plain(i, &entity_id, flight);
                    return;
                }
                if let Some(ask) = msg.ask
                    && let Some(asker) = self.asks.get(&ask).map(|a| a.asker.clone())
                {
                    self.send(&me, &asker, Wire::AskReply { ask });
                }
            }
            ShardAction::Stop { entity_id, .. } if self.cfg.durable => self.stop_durable(i, &entity_id),
            ShardAction::Stop { entity_id, .. } => {
                if let Some((_, incarnation)) = node.entities.get(&entity_id).cloned() {
                    let ev = Event::Terminated { node: me, shard: shard.clone(), entity_id, incarnation };
                    self.schedule(1, ev);
                }
            }
            ShardAction::ForceStop { entity_id, .. } => {
                node.entities.remove(&entity_id);
                node.plain_marks.remove(&entity_id);
                // An aborted durable entity answers nothing more (a write in flight may still
                // be acknowledged by the replicas).
                node.states.remove(&entity_id);
                self.end_activation(&entity_id, &me);
            }
            ShardAction::Drop { msg, reason, .. } => {
                let why = match reason {
                    crate::sharding::shard::core::DropReason::HandOff => HAND_OFF,
                    crate::sharding::shard::core::DropReason::ShardFailed => SHARD_FAILED,
                    crate::sharding::shard::core::DropReason::SlotFull => SLOT_FULL,
                    crate::sharding::shard::core::DropReason::RememberedLimit => REMEMBERED_LIMIT,
                    crate::sharding::shard::core::DropReason::BufferFull => BUFFER_FULL,
                };
                self.fail(msg, why);
            }
            ShardAction::Failed => self.on_shard_failed(i, shard),
            ShardAction::Stopped => {
                node.shards.remove(shard);
                let mut out = Vec::new();
                node.region.handle(
                    RegionInput::LocalShardStopped(shard.clone()),
                    self.base + Duration::from_millis(self.now_ms),
                    &mut out,
                );
                self.perform_region(i, out);
            }
            ShardAction::Recover { entity_ids } => self.recover(i, shard, entity_ids),
            ShardAction::WriteRemembered { adds, removes } => {
                let Some(&instance) = node.shard_instances.get(shard) else { return };
                let w = remember::RememberWrite { shard: shard.clone(), instance, adds, removes };
                self.remember_write(i, w);
            }
        }
    }

    /// An activation: recorded, traced, and checked against every other live one of its id.
    fn start_entity(&mut self, i: usize, shard: &ShardId, entity_id: String, incarnation: u64) {
        let node = self.nodes[i].as_mut().expect("running");
        let me = node.addr.clone();
        let epoch = node.shards.get(shard).map_or(0, |(_, e)| *e);
        node.entities.insert(entity_id.clone(), (shard.clone(), incarnation));
        self.report.activations += 1;
        self.trace(|| format!("{me} starts {entity_id} (shard {shard}, epoch {epoch})"));
        // An activation on a node that was paused is a zombie once its peers downed it:
        // nothing can stop a frozen process from running again before it learns that
        // (no lease), so with durable state the promise is that it commits nothing (the
        // fence; checked on every acknowledged write), not that it never runs. That
        // covers both sides: a zombie's old activation beside the new one, and a zombie
        // starting one from a stale allocation it handles on waking.
        let me_zombie = self.is_downed_zombie(&me);
        let (zombies, others): (Vec<&UniqueAddress>, Vec<&UniqueAddress>) = self
            .live
            .get(&entity_id)
            .map(|v| v.iter().filter(|(n, _)| *n != me).map(|(n, _)| n).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .partition(|n| me_zombie || self.is_downed_zombie(n));
        let others: Vec<String> = others.into_iter().map(ToString::to_string).collect();
        self.report.zombie_overlaps += zombies.len();
        if !others.is_empty() {
            let v = format!("t={} {entity_id} started on {me} while live on {others:?}", self.now_ms);
            self.report.violations.push(v);
        }
        self.live.entry(entity_id.clone()).or_default().push((me, incarnation));
        if self.cfg.durable {
            self.start_durable_entity(i, shard, &entity_id, incarnation);
        }
    }

    pub(super) fn end_activation(&mut self, entity_id: &str, node: &UniqueAddress) {
        if let Some(v) = self.live.get_mut(entity_id) {
            v.retain(|(n, _)| n != node);
        }
        self.end_holds(entity_id, node);
        self.trace(|| format!("{node} stops {entity_id}"));
    }

    pub(super) fn on_terminated(&mut self, node: UniqueAddress, shard: ShardId, entity_id: String, incarnation: u64) {
        let Some(i) = self.slot_of(&node) else { return };
        let now = self.now();
        let n = self.nodes[i].as_mut().expect("running");
        if n.entities.get(&entity_id).is_some_and(|(_, inc)| *inc == incarnation) {
            n.entities.remove(&entity_id);
            n.plain_marks.remove(&entity_id);
            n.states.remove(&entity_id);
            self.end_activation(&entity_id, &node);
        }
        let n = self.nodes[i].as_mut().expect("running");
        if let Some((core, _)) = n.shards.get_mut(&shard) {
            let mut out = Vec::new();
            core.handle(ShardInput::Terminated { entity_id, incarnation, leftovers: vec![] }, now, &mut out);
            for a in out {
                self.perform_shard(i, &shard, a);
            }
        }
    }

    /// Node slot `i`'s cores tick (and its producers).
    pub(super) fn on_tick(&mut self, i: usize) {
        self.schedule(TICK_MS, Event::Tick(i));
        let (now, wall) = (self.now(), self.wall());
        let Some(node) = self.nodes[i].as_mut() else { return };
        let mut single = Vec::new();
        node.singleton.handle(SingletonInput::Tick, now, &mut single);
        let mut region_out = Vec::new();
        node.region.handle(RegionInput::Tick, now, &mut region_out);
        let mut shard_out = Vec::new();
        for (id, (core, _)) in node.shards.iter_mut() {
            let mut out = Vec::new();
            core.handle(ShardInput::Tick, now, &mut out);
            shard_out.extend(out.into_iter().map(|a| (id.clone(), a)));
        }
        let mut coord_out = Vec::new();
        if let Some(c) = node.coordinator.as_mut() {
            c.core.handle(CoordinatorInput::Tick, now, wall, &mut coord_out);
        }
        let mut rep_out = Vec::new();
        node.replicator.handle(ReplicatorInput::Tick, now, wall, &mut rep_out);
        let mut beats = Vec::new();
        if let Some(h) = node.heartbeat.as_mut() {
            h.handle(crate::membership::failure_detector::HeartbeatInput::Tick, now, &mut beats);
        }
        self.perform_heartbeat(i, beats);
        if self.cfg.reliable {
            self.tick_producers(i);
        }
        self.perform_singleton(i, single);
        self.perform_region(i, region_out);
        for (shard, a) in shard_out {
            self.perform_shard(i, &shard, a);
        }
        self.perform_coordinator(i, coord_out);
        self.perform_replicator(i, rep_out);
    }

    /// A message reaches node `to` (dropped if the link was cut meanwhile or `to` is gone).
    pub(super) fn deliver(&mut self, from: UniqueAddress, to: UniqueAddress, wire: Wire) {
        let Some(i) = self.slot_of(&to) else { return };
        if let Some(a) = self.slot_of(&from).or_else(|| from.node_id[1..].parse::<usize>().ok().map(|n| n - 1))
            && a != i
            && (self.cut.contains(&(a, i)) || self.messaging_cut.contains(&(a, i)))
        {
            return;
        }
        if !matches!(
            wire,
            Wire::Replicator(_)
                | Wire::Deliver { .. }
                | Wire::AskReply { .. }
                | Wire::Heartbeat { .. }
                | Wire::Outcome { .. }
        ) {
            self.trace(|| format!("{from} -> {to} {}", wire_name(&wire)));
        }
        let (now, wall) = (self.now(), self.wall());
        let node = self.nodes[i].as_mut().expect("running");
        match wire {
            Wire::ToCoordinator(msg) => {
                let mut out = Vec::new();
                if let Some(c) = node.coordinator.as_mut() {
                    c.core.handle(CoordinatorInput::FromRegion { from, msg }, now, wall, &mut out);
                }
                self.perform_coordinator(i, out);
            }
            Wire::ToRegion(msg) => {
                let mut out = Vec::new();
                node.region.handle(RegionInput::Coordinator { from, msg }, now, &mut out);
                self.perform_region(i, out);
            }
            Wire::Deliver { shard, epoch, entity_id, msg } => {
                let mut out = Vec::new();
                node.region.handle(RegionInput::Forwarded { shard, epoch, entity_id, msg }, now, &mut out);
                self.perform_region(i, out);
            }
            Wire::AskReply { ask } => {
                node.forwarded.remove(&ask);
                self.resolve(ask, Ok(()));
            }
            Wire::Outcome { flight, result } => {
                // Heard by its producer if it still runs here.
                let to_here = self.producers.flights.get(&flight).and_then(|f| self.producers_host(f.producer));
                if to_here.as_ref() == Some(&to) {
                    self.on_delivery_outcome(flight, result);
                }
            }
            Wire::Replicator(msg) => {
                let mut out = Vec::new();
                node.replicator.handle(ReplicatorInput::Remote { from: peer_of(&from), msg }, now, wall, &mut out);
                self.perform_replicator(i, out);
            }
            Wire::Heartbeat { response, seq } => {
                use crate::membership::failure_detector::HeartbeatInput;
                let mut out = Vec::new();
                if let Some(h) = node.heartbeat.as_mut() {
                    let input = if response {
                        HeartbeatInput::Response { from, seq }
                    } else {
                        HeartbeatInput::Request { from, seq }
                    };
                    h.handle(input, now, &mut out);
                }
                self.perform_heartbeat(i, out);
            }
        }
    }
}
