//! Membership in the simulation: each node's view (reachability from the cuts, the Down
//! margin), the heartbeats its failure detector sends and answers, and the periodic round that
//! feeds every node's cores a fresh view.

use super::*;

impl Sim {
    /// Node `i`'s view: every member not removed, reachability from the cuts, Down members
    /// dropped once the margin passed since this node first saw them Down.
    pub(super) fn view_of(&mut self, i: usize) -> MembershipSnapshot {
        let margin_ms = 1_000;
        let now = self.now_ms;
        let rows: Vec<(UniqueAddress, MemberStatus, u64)> = self
            .members
            .iter()
            .filter(|m| m.status != MemberStatus::Removed)
            .map(|m| (m.addr.clone(), m.status, m.up_number))
            .collect();
        let me = self.nodes[i].as_ref().expect("running").addr.clone();
        let gossip_reaches = self.gossip_reaches(i);
        let mut members = Vec::new();
        for (addr, status, up) in rows {
            let slot = addr.node_id[1..].parse::<usize>().expect("n<i>") - 1;
            let node = self.nodes[i].as_mut().expect("running");
            if status == MemberStatus::Down && addr != me {
                let seen = *node.down_seen.entry(addr.clone()).or_insert(now);
                if now >= seen + margin_ms {
                    continue;
                }
            }
            let current = self.nodes[slot].as_ref().is_some_and(|n| n.addr == addr);
            let reachable = addr == me
                || (current && if self.cfg.message_path { gossip_reaches[slot] } else { self.reachable(i, slot) });
            members.push(Member::on_loopback(addr, status, up, reachable));
        }
        if self.cfg.message_path {
            crate::membership::view::apply_reachability_table(&mut members, |o| self.verdicts.get(o).cloned());
        }
        MembershipSnapshot { self_address: me, members }
    }

    /// Which node slots' gossip reaches node `i`: chitchat's exchanges are round trips, so
    /// gossip crosses only links that work both ways, and travels on through others; a paused
    /// or stopped node gossips nothing.
    pub(super) fn gossip_reaches(&self, i: usize) -> Vec<bool> {
        let n = self.nodes.len();
        let up = |j: usize| self.nodes[j].is_some() && !self.is_paused(j);
        let mut seen = vec![false; n];
        let mut stack = vec![i];
        seen[i] = true;
        while let Some(a) = stack.pop() {
            let next: Vec<usize> = (0..n)
                .filter(|b| !seen[*b] && up(*b) && !self.cut.contains(&(a, *b)) && !self.cut.contains(&(*b, a)))
                .collect();
            for b in next {
                seen[b] = true;
                stack.push(b);
            }
        }
        seen
    }

    /// Performs the heartbeat core's sends and publishes its verdicts.
    pub(super) fn perform_heartbeat(
        &mut self,
        i: usize,
        actions: Vec<crate::membership::failure_detector::HeartbeatAction>,
    ) {
        use crate::membership::failure_detector::HeartbeatAction;
        let Some(node) = self.nodes[i].as_ref() else { return };
        let me = node.addr.clone();
        let verdicts: Vec<UniqueAddress> = node.heartbeat.iter().flat_map(|h| h.unreachable().cloned()).collect();
        for a in actions {
            let (to, response, seq) = match a {
                HeartbeatAction::SendRequest { to, seq } => (to, false, seq),
                HeartbeatAction::SendResponse { to, seq } => (to, true, seq),
                HeartbeatAction::Verdict { subject, reachable } => {
                    self.trace(|| {
                        format!(
                            "{me} heartbeats find {subject} {}",
                            if reachable { "reachable" } else { "unreachable" }
                        )
                    });
                    continue;
                }
            };
            self.report.heartbeat_frames += 1;
            self.send(&me, &to, Wire::Heartbeat { response, seq });
        }
        self.verdicts.insert(me, verdicts);
    }

    pub(super) fn on_membership(&mut self) {
        self.supervise_producers();
        let now = self.now();
        for i in 0..self.nodes.len() {
            if self.nodes[i].is_none() || self.is_paused(i) {
                continue;
            }
            let view = self.view_of(i);
            if !self.apply_downing(i, &view, now) {
                continue;
            }
            if view.members.iter().any(|m| m.address == view.self_address && m.status == MemberStatus::Down) {
                self.crash(i, "sees itself downed and stops");
                continue;
            }
            let node = self.nodes[i].as_mut().expect("running");
            if node.last_view.as_ref() == Some(&view) {
                continue;
            }
            node.last_view = Some(view.clone());
            self.deliver_view(i, &view, now);
        }
        self.schedule(MEMBERSHIP_MS, Event::Membership);
    }

    /// Runs node `i`'s downing decision on its view (the shared member table is the gossip);
    /// false when the node stopped (it downed itself or everyone).
    fn apply_downing(&mut self, i: usize, view: &MembershipSnapshot, now: Instant) -> bool {
        let node = self.nodes[i].as_mut().expect("running");
        let me = node.addr.clone();
        match node.downing.decide(view, now) {
            crate::membership::downing::Decision::DownOthers(victims) => {
                let mut downed = Vec::new();
                for m in self.members.iter_mut().filter(|m| victims.contains(&m.addr)) {
                    if m.status != MemberStatus::Down && m.status != MemberStatus::Removed {
                        m.status = MemberStatus::Down;
                        self.report.downed.push(m.addr.to_string());
                        downed.push(m.addr.to_string());
                    }
                }
                if !downed.is_empty() {
                    self.trace(|| format!("{me} downs {}", downed.join(", ")));
                }
                true
            }
            crate::membership::downing::Decision::DownMyself => {
                for m in self.members.iter_mut().filter(|m| m.addr == me) {
                    m.status = MemberStatus::Down;
                }
                self.report.downed.push(me.to_string());
                self.crash(i, "downs itself (minority side)");
                false
            }
            crate::membership::downing::Decision::DownAll => {
                for m in self.members.iter_mut() {
                    if !matches!(m.status, MemberStatus::Removed | MemberStatus::Down) {
                        m.status = MemberStatus::Down;
                        self.report.downed.push(m.addr.to_string());
                    }
                }
                self.crash(i, "downs everyone (reachability never settled)");
                false
            }
            crate::membership::downing::Decision::Wait => true,
        }
    }

    /// Hands node `i`'s new view to each of its cores, as the membership watch does.
    fn deliver_view(&mut self, i: usize, view: &MembershipSnapshot, now: Instant) {
        let wall = self.wall();
        let node = self.nodes[i].as_mut().expect("running");
        let me = node.addr.clone();
        let mut beats = Vec::new();
        if let Some(h) = node.heartbeat.as_mut() {
            let ring = view
                .members
                .iter()
                .filter(|m| m.status.is_routable() || m.address == me)
                .map(|m| m.address.clone())
                .collect();
            h.handle(crate::membership::failure_detector::HeartbeatInput::Members(ring), now, &mut beats);
        }
        let mut single = Vec::new();
        node.singleton.handle(SingletonInput::Host(view.hosts_singleton(None)), now, &mut single);
        let routable = view.members.iter().filter(|m| m.status.is_routable()).map(|m| m.address.clone()).collect();
        let coordinator = view.singleton_host(None).map(|m| m.address.clone());
        let mut region_out = Vec::new();
        node.region.handle(RegionInput::Members { routable, coordinator }, now, &mut region_out);
        let mut coord_out = Vec::new();
        if let Some(c) = node.coordinator.as_mut() {
            c.core.handle(CoordinatorInput::Members(MembersView::of(view)), now, wall, &mut coord_out);
        }
        let mut rep_out = Vec::new();
        node.replicator.handle(ReplicatorInput::members_of(view, None), now, wall, &mut rep_out);
        self.perform_singleton(i, single);
        self.perform_region(i, region_out);
        self.perform_coordinator(i, coord_out);
        self.perform_replicator(i, rep_out);
        self.perform_heartbeat(i, beats);
    }
}
