//! The coordinator core's answers to operators: the allocation table, one shard's
//! explanation, the rebalance plan. Read-only: a query changes nothing, so a dry run and the
//! round that follows it (with nothing changed in between) agree.

use std::sync::Arc;

use super::*;

impl CoordinatorCore {
    fn hand_off_progress(&self, shard: &str, now: Instant) -> Option<HandOffProgress> {
        let h = self.handoffs.get(shard)?;
        let waiting_for = match &h.phase {
            HandoffPhase::WaitingForAcks(pending) => pending.iter().map(ToString::to_string).collect(),
            HandoffPhase::Stopping => Vec::new(),
        };
        Some(HandOffProgress {
            id: h.id,
            from: h.from.to_string(),
            phase: phase_name(&h.phase).into(),
            waiting_for,
            deadline_in_ms: millis(h.deadline.saturating_duration_since(now)),
        })
    }

    fn rebalance_status(&self, now: Instant) -> RebalanceStatus {
        let blocked_by = self.rebalance_blocked_by(self.live_candidates().len());
        RebalanceStatus {
            allowed: blocked_by.is_none(),
            blocked_by,
            next_round_in_ms: millis(self.next_rebalance.saturating_duration_since(now)),
        }
    }

    /// Every region, proxy and shard as this coordinator holds them.
    pub(crate) fn allocation_table(&self, type_name: &str, now: Instant) -> AllocationTable {
        let candidates: BTreeSet<RegionId> = self.live_candidates().into_iter().map(|c| c.region).collect();
        let regions = self
            .state
            .regions
            .iter()
            .map(|r| {
                let status = self.members.status(r);
                let shutting_down = self.shutting_down.contains(r);
                RegionSummary {
                    region: r.to_string(),
                    node_id: r.node_id.to_string(),
                    shards: self.state.shards_of(r).len(),
                    member_status: status.map(|s| s.as_key().to_string()),
                    shutting_down,
                    takes_new_shards: candidates.contains(r),
                    app_version: self.members.version(r).to_string(),
                }
            })
            .collect();
        let shards = self
            .state
            .shards()
            .iter()
            .map(|(shard, rec)| ShardAllocation {
                shard: shard.clone(),
                region: rec.region.as_ref().map(ToString::to_string),
                epoch: rec.epoch,
                hand_off: self.hand_off_progress(shard, now),
            })
            .collect();
        AllocationTable {
            type_name: type_name.into(),
            coordinator: self.me.to_string(),
            regions,
            proxies: self.state.proxies.iter().map(ToString::to_string).collect(),
            shards,
            rebalance: self.rebalance_status(now),
        }
    }

    /// Shards being handed off now.
    pub(crate) fn in_progress(&self) -> Vec<ShardId> {
        self.handoffs.keys().cloned().collect()
    }

    /// What a rebalance round would do now, acting on nothing.
    pub(crate) fn rebalance_plan(&self, type_name: &str) -> RebalancePlan {
        plan_dto(type_name, self.plan_rebalance(), self.in_progress(), false)
    }

    /// Why `shard` is where it is; `None` for an id the shard-id extractor cannot produce.
    pub(crate) fn explain(&self, type_name: &str, shard: &str, now: Instant) -> Option<ShardExplanation> {
        if !self.settings.shard_ids.allows(shard) {
            return None;
        }
        let shard_id: ShardId = shard.to_string();
        let home = self.state.home(shard).map(|(h, _)| h.clone());
        let newest = self.newest_version(&self.takers());
        let mut regions: Vec<RegionVerdict> = self
            .state
            .regions
            .iter()
            .map(|r| {
                let status = self.members.status(r);
                let not_eligible_because = if self.shutting_down.contains(r) {
                    Some("its region is handing off everything (leaving or stopping)".to_string())
                } else if !status.is_some_and(MemberStatus::takes_new_shards) {
                    Some(format!("its member is {}, not up", status.map_or("not listed", MemberStatus::as_key)))
                } else {
                    let mine = self.members.version(r);
                    newest.as_ref().filter(|n| *n != mine).map(|newest| {
                        format!("its node runs {mine}, and regions of {newest} take shards (a rolling update)")
                    })
                };
                RegionVerdict {
                    region: r.to_string(),
                    shards: self.state.shards_of(r).len(),
                    eligible: not_eligible_because.is_none(),
                    not_eligible_because,
                }
            })
            .collect();
        regions.extend(self.state.proxies.iter().map(|p| RegionVerdict {
            region: p.to_string(),
            shards: 0,
            eligible: false,
            not_eligible_because: Some("a proxy: its node lacks the type's role or started it as a proxy".into()),
        }));
        // The strategy's choice were the shard new now: its current home counted without it.
        let mut candidates = self.live_candidates();
        for c in candidates.iter_mut().filter(|c| Some(&c.region) == home.as_ref()) {
            Arc::make_mut(&mut c.shards).retain(|s| *s != shard_id);
        }
        let if_allocated_now = (!candidates.is_empty()).then(|| {
            let requester = home.clone().unwrap_or_else(|| self.me.clone());
            let region = self.choose(&requester, &shard_id, &candidates);
            let reason = self.strategy.allocation_reason(&shard_id, &candidates, &region);
            AllocationChoice { region: region.to_string(), reason }
        });
        let next_rebalance =
            self.plan_rebalance().ok().and_then(|moves| moves.into_iter().find(|m| m.shard == shard_id));
        Some(ShardExplanation {
            type_name: type_name.into(),
            shard: shard_id.clone(),
            home: home.map(|h| h.to_string()),
            epoch: self.state.record(shard).map_or(0, |r| r.epoch),
            hand_off: self.hand_off_progress(shard, now),
            waiting_regions: self.deferred.get(shard).into_iter().flatten().map(ToString::to_string).collect(),
            regions,
            if_allocated_now,
            next_rebalance,
            rebalance: self.rebalance_status(now),
            history: self.history.get(shard).map(|h| h.iter().cloned().collect()).unwrap_or_default(),
        })
    }
}

/// A plan's data: its moves, or why it could not run.
pub(crate) fn plan_dto(
    type_name: &str,
    plan: Result<Vec<PlannedMove>, String>,
    in_progress: Vec<ShardId>,
    executed: bool,
) -> RebalancePlan {
    let (moves, blocked_by) = match plan {
        Ok(moves) => (moves, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    RebalancePlan {
        type_name: type_name.into(),
        allowed: blocked_by.is_none(),
        blocked_by,
        moves,
        in_progress,
        executed,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
