//! The coordinator core's rebalance round: why it may not run, the plan (the strategy's moves
//! and where each shard lands), and the round that starts those hand-offs. The periodic round,
//! the round an operator asks for and the dry run all use [`CoordinatorCore::plan_rebalance`].

use std::sync::Arc;

use super::*;

impl CoordinatorCore {
    /// Why a rebalance round may not move shards now, when it may not (`candidates`: regions
    /// that take shards).
    pub(super) fn rebalance_blocked_by(&self, candidates: usize) -> Option<String> {
        if !self.rebalance_allowed {
            Some("membership is not settled (a member is joining, leaving or unreachable)".into())
        } else if !self.shutting_down.is_empty() {
            let regions: Vec<String> = self.shutting_down.iter().map(ToString::to_string).collect();
            Some(format!("regions are handing off everything: {}", regions.join(", ")))
        } else if let Some((oldest, newest)) = self.mixed_versions() {
            Some(format!(
                "a rolling update is under way (regions run {oldest} to {newest}): shards move again once \
                 every region runs one version"
            ))
        } else if candidates < 2 {
            Some(format!("{candidates} region(s) take shards; a rebalance needs two"))
        } else {
            None
        }
    }

    /// The hand-offs a rebalance round starts now, or why it cannot run. Each move's
    /// destination is the strategy's choice once the moves before it are done (in order).
    pub(super) fn plan_rebalance(&self) -> Result<Vec<PlannedMove>, String> {
        let candidates = self.live_candidates();
        if let Some(why) = self.rebalance_blocked_by(candidates.len()) {
            return Err(why);
        }
        let in_progress: BTreeSet<ShardId> = self.handoffs.keys().cloned().collect();
        let mut after = candidates.clone();
        let mut moves = Vec::new();
        for shard in self.strategy.rebalance(&candidates, &in_progress) {
            let Some(from) = self.state.home(&shard).map(|(h, _)| h.clone()) else { continue };
            if self.handoffs.contains_key(&shard) {
                continue;
            }
            let reason = self.strategy.rebalance_reason(&shard, &candidates);
            if let Some(r) = after.iter_mut().find(|r| r.region == from) {
                Arc::make_mut(&mut r.shards).retain(|s| *s != shard);
            }
            let to = self.choose(&from, &shard, &after);
            if let Some(r) = after.iter_mut().find(|r| r.region == to) {
                Arc::make_mut(&mut r.shards).push(shard.clone());
            }
            moves.push(PlannedMove { shard, from: from.to_string(), expected_to: to.to_string(), reason });
        }
        Ok(moves)
    }

    /// Runs a rebalance round: starts the planned hand-offs.
    pub(super) fn rebalance_round(
        &mut self,
        now: Instant,
        out: &mut Vec<CoordinatorAction>,
    ) -> Result<Vec<PlannedMove>, String> {
        let plan = self.plan_rebalance();
        for m in plan.iter().flatten() {
            let from = self.state.home(&m.shard).map(|(h, _)| h.clone()).expect("a planned shard has a home");
            info!(shard = %m.shard, %from, "rebalancing shard");
            self.start_handoff(m.shard.clone(), from, format!("rebalance: {}", m.reason), now, out);
            self.shards_rebalanced += 1;
        }
        plan
    }

    /// Hand-offs started by rebalance rounds since this coordinator took over.
    pub(crate) fn shards_rebalanced(&self) -> u64 {
        self.shards_rebalanced
    }

    /// The outcome of the latest [`CoordinatorInput::RebalanceNow`], once.
    pub(crate) fn take_requested_round(&mut self) -> Option<Result<Vec<PlannedMove>, String>> {
        self.requested_round.take()
    }
}
