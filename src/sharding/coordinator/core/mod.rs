//! The shard coordinator as a sans-IO state machine: region registry, shard → region
//! allocation with epochs, rebalancing with the hand-off protocol, graceful shutdown of regions.
//!
//! Every state change is written to the replicated LWW-map (majority) by the driver; messages
//! that reveal a change (HostShard, ShardHome, RegisterAck) are held until the write holding
//! it is acknowledged, so no region ever learns an allocation a new coordinator could miss.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::state::StateEntry;
use super::state::{CoordinatorState, RegionRecord};
use crate::app_version::AppVersion;
use crate::clock::Instant;
use crate::membership::MemberStatus;
use crate::sharding::allocation::{RegionAllocation, ShardAllocationStrategy};
use crate::sharding::ids::{RegionId, ShardId, ShardIdRule};
use crate::sharding::keys;
use crate::sharding::protocol::{SHARD_HOMES_PER_MESSAGE, ToCoordinator, ToRegion};
use crate::sharding::query::{
    AllocationChoice, AllocationTable, HandOffProgress, PlannedMove, RebalancePlan, RebalanceStatus, RegionSummary,
    RegionVerdict, ShardAllocation, ShardEvent, ShardExplanation,
};

/// A region's repeated shutdown request re-sends the hand-off messages it has not answered
/// that are at least this old.
const RESEND_ON_REQUEST_AFTER: Duration = Duration::from_secs(1);

/// Events kept per shard for its explanation.
pub(crate) const HISTORY_PER_SHARD: usize = 16;

/// Settings the coordinator uses.
#[derive(Debug, Clone)]
pub(crate) struct CoordinatorSettings {
    pub min_nr_of_members: usize,
    pub rebalance_interval: Duration,
    pub handoff_timeout: Duration,
    pub shard_start_timeout: Duration,
    /// Re-allocate shards of terminated regions at once (remember-entities) instead of on demand.
    pub eager_reallocation: bool,
    /// This node's shard-id extractor fingerprint; regions with another one are refused.
    pub extractor_fingerprint: u64,
    /// This node's settings that must agree; regions that send other values are refused.
    pub must_agree: Vec<(String, String)>,
    /// The shard ids the extractor can produce; requests for others are ignored.
    pub shard_ids: ShardIdRule,
    /// Largest the encoded state may grow (one replicator message): a new shard that would
    /// take it past this is refused, since a successor could never read the state back.
    pub max_state_bytes: usize,
}

/// What a coordinator checks in a registration: the extractor's fingerprint and the settings
/// that must agree, as this node has them.
#[derive(Debug, Clone)]
pub(crate) struct Registration {
    pub extractor_fingerprint: u64,
    pub must_agree: Vec<(String, String)>,
}

/// What the coordinator knows of the membership: the status and application version of every
/// listed member and whether the cluster is settled (see
/// [`crate::membership::MembershipSnapshot::is_settled`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct MembersView {
    pub statuses: BTreeMap<RegionId, MemberStatus>,
    /// Each member's application version (`0.0.0` for one not listed).
    pub versions: BTreeMap<RegionId, AppVersion>,
    pub settled: bool,
}

impl MembersView {
    /// The view of a membership snapshot.
    pub(crate) fn of(snap: &crate::membership::MembershipSnapshot) -> Self {
        MembersView {
            statuses: snap.members.iter().map(|m| (m.address().clone(), m.status())).collect(),
            versions: snap.members.iter().map(|m| (m.address().clone(), m.app_version().clone())).collect(),
            settled: snap.is_settled(),
        }
    }

    fn status(&self, region: &RegionId) -> Option<MemberStatus> {
        self.statuses.get(region).copied()
    }

    fn version(&self, region: &RegionId) -> &AppVersion {
        static ZERO: AppVersion = AppVersion::ZERO;
        self.versions.get(region).unwrap_or(&ZERO)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CoordinatorInput {
    /// A message from the region on `from` (the transport-level sender). A message whose
    /// `region` field names another region is dropped: a region speaks only for itself.
    FromRegion {
        from: RegionId,
        msg: ToCoordinator,
    },
    /// The membership changed: regions whose member may no longer host
    /// ([`MemberStatus::may_host`]) are terminated, registrations are accepted only from Up
    /// or Leaving members, new shards go only to Up members, and rebalancing waits for a
    /// settled cluster.
    Members(MembersView),
    /// The write started by the last `Write` action is durable on a majority.
    WriteDone,
    /// This coordinator just took over with the state it read: tell every home again.
    TakeOver,
    /// Remember-entities: every shard the type ever had (durable); those without a home are
    /// allocated at once so their entities start without a message.
    RememberedShards(BTreeSet<ShardId>),
    Tick,
    /// An operator asked for a rebalance round now (the periodic schedule is unchanged); the
    /// round's outcome is kept for [`CoordinatorCore::take_requested_round`].
    RebalanceNow,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CoordinatorAction {
    Send {
        to: RegionId,
        msg: ToRegion,
    },
    /// Write these entries with majority; answer with `WriteDone` once acknowledged.
    Write(Vec<StateEntry>),
}

#[derive(Debug)]
enum HandoffPhase {
    WaitingForAcks(BTreeSet<RegionId>),
    Stopping,
}

#[derive(Debug)]
struct Handoff {
    /// Unique across coordinator incarnations (follows the wall clock).
    id: u64,
    from: RegionId,
    phase: HandoffPhase,
    deadline: Instant,
    /// When its last message (BeginHandOff or HandOff) went out: one that got no answer within
    /// `shard_start_timeout` is sent again (a message lost on a broken connection must not
    /// hold the shard until the hand-off times out).
    sent_at: Instant,
}

#[derive(Default)]
struct Batch {
    entries: Vec<StateEntry>,
    effects: Vec<CoordinatorAction>,
}

/// The coordinator of one entity type.
pub(crate) struct CoordinatorCore {
    me: RegionId,
    settings: CoordinatorSettings,
    strategy: Arc<dyn ShardAllocationStrategy>,
    state: CoordinatorState,
    shutting_down: BTreeSet<RegionId>,
    handoffs: BTreeMap<ShardId, Handoff>,
    deferred: BTreeMap<ShardId, BTreeSet<RegionId>>,
    unacked_host: BTreeMap<ShardId, (RegionId, u64, Instant)>,
    in_flight: Option<Batch>,
    queued: Batch,
    next_rebalance: Instant,
    rebalance_allowed: bool,
    last_epoch_ms: u64,
    /// Wall clock of the latest input, and the latest hand-off id issued.
    wall_ms: u64,
    last_handoff_id: u64,
    /// Latched once `min_nr_of_members` regions registered (or the state already had
    /// allocations): the limit only holds back the first allocation.
    min_members_reached: bool,
    members: MembersView,
    rejected: u64,
    /// Each shard's latest events (at most [`HISTORY_PER_SHARD`]), for operators.
    history: BTreeMap<ShardId, VecDeque<ShardEvent>>,
    /// The outcome of the latest `RebalanceNow`: its moves, or why it could not run.
    requested_round: Option<Result<Vec<PlannedMove>, String>>,
    /// Hand-offs started by rebalance rounds (periodic or requested) since this coordinator
    /// took over.
    shards_rebalanced: u64,
}

impl CoordinatorCore {
    pub(crate) fn new(
        me: RegionId,
        settings: CoordinatorSettings,
        strategy: Arc<dyn ShardAllocationStrategy>,
        state: CoordinatorState,
        now: Instant,
    ) -> Self {
        let next_rebalance = now + settings.rebalance_interval;
        // Any shard record (even deallocated) means a predecessor already allocated.
        let min_members_reached = state.regions.len() >= settings.min_nr_of_members || !state.shards().is_empty();
        CoordinatorCore {
            min_members_reached,
            me,
            settings,
            strategy,
            state,
            shutting_down: BTreeSet::new(),
            handoffs: BTreeMap::new(),
            deferred: BTreeMap::new(),
            unacked_host: BTreeMap::new(),
            in_flight: None,
            queued: Batch::default(),
            next_rebalance,
            rebalance_allowed: false,
            last_epoch_ms: 0,
            wall_ms: 0,
            last_handoff_id: 0,
            members: MembersView::default(),
            rejected: 0,
            history: BTreeMap::new(),
            requested_round: None,
            shards_rebalanced: 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn state(&self) -> &CoordinatorState {
        &self.state
    }

    /// Messages dropped because their `region` field was not their sender, or because the
    /// sender was not an Up or Leaving member when it registered.
    #[cfg(test)]
    pub(crate) fn rejected_messages(&self) -> u64 {
        self.rejected
    }

    /// Regions hosting shards (not proxies).
    pub(crate) fn regions(&self) -> impl Iterator<Item = &RegionId> {
        self.state.regions.iter()
    }

    /// Regions and proxies.
    pub(crate) fn all_regions(&self) -> impl Iterator<Item = &RegionId> {
        self.state.regions.iter().chain(self.state.proxies.iter())
    }

    /// Shards being handed off right now.
    #[cfg(test)]
    pub(crate) fn rebalancing(&self) -> impl Iterator<Item = &ShardId> {
        self.handoffs.keys()
    }

    /// Queues state entries and the messages that may only leave once they are durable.
    fn commit(&mut self, entries: Vec<StateEntry>, effects: Vec<CoordinatorAction>, out: &mut Vec<CoordinatorAction>) {
        if entries.is_empty() && self.in_flight.is_none() && self.queued.entries.is_empty() {
            out.extend(effects);
            return;
        }
        self.queued.entries.extend(entries);
        self.queued.effects.extend(effects);
        self.start_write(out);
    }

    fn start_write(&mut self, out: &mut Vec<CoordinatorAction>) {
        if self.in_flight.is_some() {
            return;
        }
        let batch = std::mem::take(&mut self.queued);
        if batch.entries.is_empty() {
            out.extend(batch.effects);
            return;
        }
        out.push(CoordinatorAction::Write(batch.entries.clone()));
        self.in_flight = Some(batch);
    }

    fn send(to: &RegionId, msg: ToRegion) -> CoordinatorAction {
        CoordinatorAction::Send { to: to.clone(), msg }
    }

    fn shard_entry(&self, shard: &str) -> StateEntry {
        let rec = self.state.record(shard).expect("record of a shard being written");
        (keys::shard_entry(shard), Some(rmp_serde::to_vec(rec).expect("shard record encodes")))
    }

    pub(crate) fn handle(
        &mut self,
        input: CoordinatorInput,
        now: Instant,
        wall_ms: u64,
        out: &mut Vec<CoordinatorAction>,
    ) {
        self.wall_ms = self.wall_ms.max(wall_ms);
        match input {
            CoordinatorInput::FromRegion { from, msg } => {
                if *msg.region() != from {
                    self.rejected += 1;
                    warn!(%from, ?msg, "coordinator message naming another region than its sender dropped");
                    return;
                }
                self.on_region_msg(msg, now, wall_ms, out)
            }
            CoordinatorInput::Members(view) => {
                self.rebalance_allowed = view.settled;
                self.members = view;
                let gone: Vec<RegionId> = self
                    .all_regions()
                    .filter(|r| !self.members.status(r).is_some_and(MemberStatus::may_host))
                    .cloned()
                    .collect();
                for region in gone {
                    self.on_region_terminated(region, now, wall_ms, out);
                }
                // A Leaving member's region hands its shards off whether or not its own request
                // arrived (it may be lost on a cut link, or sent to a coordinator that moved).
                let leaving: Vec<RegionId> = self
                    .state
                    .regions
                    .iter()
                    .filter(|r| self.members.status(r) == Some(MemberStatus::Leaving))
                    .cloned()
                    .collect();
                for region in leaving {
                    self.shut_down_region(region, "its member is leaving", now, out);
                }
                // A member that turned Up may take the shards that waited for a candidate.
                self.allocate_deferred(now, wall_ms, out);
            }
            CoordinatorInput::WriteDone => {
                if let Some(batch) = self.in_flight.take() {
                    out.extend(batch.effects);
                }
                self.start_write(out);
            }
            CoordinatorInput::Tick => self.on_tick(now, out),
            CoordinatorInput::RebalanceNow => {
                let round = self.rebalance_round(now, out);
                self.requested_round = Some(round);
            }
            CoordinatorInput::RememberedShards(shards) => {
                for shard in shards {
                    if self.state.home(&shard).is_none() && !self.handoffs.contains_key(&shard) {
                        self.deferred.entry(shard).or_default();
                    }
                }
                self.allocate_deferred(now, wall_ms, out);
            }
            CoordinatorInput::TakeOver => {
                // A predecessor may have written allocations whose HostShard never left it.
                let homes: Vec<(ShardId, RegionId, u64)> = self
                    .state
                    .shards()
                    .iter()
                    .filter_map(|(s, r)| Some((s.clone(), r.region.clone()?, r.epoch)))
                    .collect();
                let mut effects = Vec::new();
                for (shard, region, epoch) in homes {
                    self.unacked_host.insert(shard.clone(), (region.clone(), epoch, now));
                    effects.push(Self::send(&region, ToRegion::HostShard { shard, epoch }));
                }
                self.commit(vec![], effects, out);
            }
        }
    }

    fn on_region_msg(&mut self, msg: ToCoordinator, now: Instant, wall_ms: u64, out: &mut Vec<CoordinatorAction>) {
        match msg {
            ToCoordinator::Register { region, proxy, extractor, settings } => {
                let refusal = self.refusal(proxy, extractor, &settings);
                self.on_register(region, proxy, refusal, now, wall_ms, out)
            }
            ToCoordinator::GetShardHome { shard, region } => self.on_get_shard_home(shard, region, now, wall_ms, out),
            ToCoordinator::ShardStarted { shard, region } => {
                if self.unacked_host.get(&shard).is_some_and(|(r, _, _)| *r == region) {
                    self.unacked_host.remove(&shard);
                }
            }
            ToCoordinator::BeginHandOffAck { shard, region, handoff } => {
                // Only an ack of this hand-off counts: a late ack of an earlier one of the same
                // shard must not release the hand-off before every region stopped routing.
                let Some(h) = self.handoffs.get_mut(&shard).filter(|h| h.id == handoff) else { return };
                if let HandoffPhase::WaitingForAcks(pending) = &mut h.phase {
                    pending.remove(&region);
                    if pending.is_empty() {
                        h.phase = HandoffPhase::Stopping;
                        let (from, handoff) = (h.from.clone(), h.id);
                        self.commit(vec![], vec![Self::send(&from, ToRegion::HandOff { shard, handoff })], out);
                    }
                }
            }
            ToCoordinator::ShardStopped { shard, region, handoff } => {
                let current = self
                    .handoffs
                    .get(&shard)
                    .is_some_and(|h| h.from == region && h.id == handoff && matches!(h.phase, HandoffPhase::Stopping));
                if current {
                    self.finish_handoff(&shard, now, wall_ms, out);
                }
            }
            ToCoordinator::RegionStopped { region } => self.on_region_terminated(region, now, wall_ms, out),
            ToCoordinator::GracefulShutdownReq { region } => {
                // The region reaches this coordinator now: what it has not answered of the
                // hand-offs begun meanwhile (their messages may have been lost) goes again.
                self.resend_handoff_messages_to(&region, now, out);
                self.shut_down_region(region, "its region is shutting down (leave or stop)", now, out)
            }
        }
    }

    /// Sends `region` again the hand-off messages it has not answered: `BeginHandOff` where its
    /// ack is missing, `HandOff` where it is the old home being waited for. Messages sent less
    /// than [`RESEND_ON_REQUEST_AFTER`] ago are left alone (they, or their answers, may still be
    /// on their way).
    fn resend_handoff_messages_to(&mut self, region: &RegionId, now: Instant, out: &mut Vec<CoordinatorAction>) {
        let mut resend = Vec::new();
        for (shard, h) in self.handoffs.iter().filter(|(_, h)| h.sent_at + RESEND_ON_REQUEST_AFTER <= now) {
            let msg = match &h.phase {
                HandoffPhase::WaitingForAcks(pending) if pending.contains(region) => {
                    ToRegion::BeginHandOff { shard: shard.clone(), handoff: h.id }
                }
                HandoffPhase::Stopping if h.from == *region => {
                    ToRegion::HandOff { shard: shard.clone(), handoff: h.id }
                }
                _ => continue,
            };
            // `sent_at` stays: it times the periodic re-send to every region still pending,
            // which this one must not put off.
            resend.push(Self::send(region, msg));
        }
        if !resend.is_empty() {
            self.commit(vec![], resend, out);
        }
    }

    /// Hands off every shard of `region` not already moving, and gives it no new ones: its
    /// region asked to shut down, or its member is leaving. Repeated requests start only the
    /// hand-offs that are missing (one that timed out is started again).
    fn shut_down_region(&mut self, region: RegionId, why: &str, now: Instant, out: &mut Vec<CoordinatorAction>) {
        if !self.state.regions.contains(&region) {
            return;
        }
        if self.shutting_down.insert(region.clone()) {
            info!(%region, why, "region shutting down; handing off its shards");
        }
        let shards: Vec<ShardId> =
            self.state.shards_of(&region).iter().filter(|s| !self.handoffs.contains_key(*s)).cloned().collect();
        for s in shards {
            self.start_handoff(s, region.clone(), why.to_string(), now, out);
        }
    }

    /// The regions that may take new and moved shards: registered, not shutting down, their
    /// member Up, and of the newest version among those (during a rolling update a shard goes
    /// only to an updated node, so it does not move again when the old ones are replaced).
    fn live_candidates(&self) -> Vec<RegionAllocation> {
        let mut takers = self.takers();
        if let Some(newest) = self.newest_version(&takers) {
            takers.retain(|r| *self.members.version(&r.region) == newest);
        }
        takers
    }

    /// The newest version among `regions`.
    fn newest_version(&self, regions: &[RegionAllocation]) -> Option<AppVersion> {
        regions.iter().map(|r| self.members.version(&r.region)).max().cloned()
    }

    /// Registered regions that are not shutting down and whose member is Up, of any version.
    fn takers(&self) -> Vec<RegionAllocation> {
        self.state
            .allocations()
            .into_iter()
            .filter(|(r, _)| {
                !self.shutting_down.contains(r) && self.members.status(r).is_some_and(MemberStatus::takes_new_shards)
            })
            .map(|(region, shards)| RegionAllocation { region, shards, leaving: false })
            .collect()
    }

    /// The oldest and newest versions of the regions that take shards, when they differ: a
    /// rolling update is under way.
    fn mixed_versions(&self) -> Option<(AppVersion, AppVersion)> {
        let takers = self.takers();
        let versions = takers.iter().map(|r| self.members.version(&r.region));
        let (oldest, newest) = (versions.clone().min()?, versions.max()?);
        (oldest != newest).then(|| (oldest.clone(), newest.clone()))
    }

    fn on_get_shard_home(
        &mut self,
        shard: ShardId,
        requester: RegionId,
        now: Instant,
        wall_ms: u64,
        out: &mut Vec<CoordinatorAction>,
    ) {
        if !self.settings.shard_ids.allows(&shard) {
            self.rejected += 1;
            warn!(%requester, shard = %shard.chars().take(64).collect::<String>(), "home asked for a shard id the extractor cannot produce; ignored");
            return;
        }
        if self.state.record(&shard).is_none()
            && self.state.approx_encoded_bytes_with(&shard) > self.settings.max_state_bytes
        {
            self.rejected += 1;
            warn!(%requester, shards = self.state.shards().len(), max_state_bytes = self.settings.max_state_bytes,
                "coordinator state is full; a new shard is refused (use fewer shards or raise transport.max_frame_size)");
            return;
        }
        if self.handoffs.contains_key(&shard) {
            self.deferred.entry(shard).or_default().insert(requester);
            return;
        }
        if let Some((home, epoch)) = self.state.home(&shard) {
            let msg = ToRegion::ShardHome { shard, region: home.clone(), epoch };
            self.commit(vec![], vec![Self::send(&requester, msg)], out);
            return;
        }
        self.deferred.entry(shard).or_default().insert(requester);
        self.allocate_deferred(now, wall_ms, out);
    }

    /// Allocates every deferred shard that can be allocated now.
    fn allocate_deferred(&mut self, now: Instant, wall_ms: u64, out: &mut Vec<CoordinatorAction>) {
        if !self.min_members_reached {
            if self.state.regions.len() < self.settings.min_nr_of_members {
                return;
            }
            self.min_members_reached = true;
        }
        let shards: Vec<ShardId> = self.deferred.keys().filter(|s| !self.handoffs.contains_key(*s)).cloned().collect();
        for shard in shards {
            if let Some((home, epoch)) = self.state.home(&shard).map(|(h, e)| (h.clone(), e)) {
                let requesters = self.deferred.remove(&shard).unwrap_or_default();
                let effects = requesters
                    .iter()
                    .map(|r| Self::send(r, ToRegion::ShardHome { shard: shard.clone(), region: home.clone(), epoch }))
                    .collect();
                self.commit(vec![], effects, out);
                continue;
            }
            let (requester, cause) = match self.deferred[&shard].iter().next() {
                Some(r) => (r.clone(), format!("requested by region {r}")),
                None => (
                    self.me.clone(),
                    "allocated without a request (remembered entities, or a lost home re-allocated at once)"
                        .to_string(),
                ),
            };
            if !self.allocate(&shard, &requester, &cause, now, wall_ms, out) {
                return; // no region can take shards now
            }
        }
    }

    /// The strategy's region for `shard` among `candidates` (not empty); a region it names
    /// that is not a candidate is replaced by the least loaded.
    fn choose(&self, requester: &RegionId, shard: &ShardId, candidates: &[RegionAllocation]) -> RegionId {
        let target = self.strategy.allocate(requester, shard, candidates);
        if candidates.iter().any(|c| c.region == target) {
            target
        } else {
            warn!(%target, %shard, "allocation strategy chose an unknown region; using the least loaded");
            candidates.iter().min_by_key(|c| c.shards.len()).expect("non-empty").region.clone()
        }
    }

    /// Keeps an event of `shard` for operators (the latest [`HISTORY_PER_SHARD`]).
    fn record(&mut self, shard: &ShardId, kind: &str, region: &RegionId, epoch: u64, reason: String) {
        let events = self.history.entry(shard.clone()).or_default();
        if events.len() == HISTORY_PER_SHARD {
            events.pop_front();
        }
        let region = region.to_string();
        events.push_back(ShardEvent { at_ms: self.wall_ms, kind: kind.into(), region, epoch, reason });
    }

    /// Allocates `shard` through the strategy (`cause`: why it needs a home, for its history);
    /// returns false when no region is available.
    fn allocate(
        &mut self,
        shard: &ShardId,
        requester: &RegionId,
        cause: &str,
        now: Instant,
        wall_ms: u64,
        out: &mut Vec<CoordinatorAction>,
    ) -> bool {
        let (target, why) = {
            // Dropped before the state changes: the views share the state's shard lists.
            let candidates = self.live_candidates();
            if candidates.is_empty() {
                return false;
            }
            let target = self.choose(requester, shard, &candidates);
            let why = self.strategy.allocation_reason(shard, &candidates, &target);
            (target, why)
        };
        // Epochs grow per shard and follow the wall clock, so a shard allocated by a new
        // coordinator that missed an unacknowledged allocation still gets a larger epoch.
        let prev = self.state.record(shard).map_or(0, |r| r.epoch);
        // Saturating: `prev` comes from the replicated state (another node wrote it).
        let epoch = prev.saturating_add(1).max(wall_ms).max(self.last_epoch_ms.saturating_add(1));
        self.last_epoch_ms = epoch;
        debug!(%shard, region = %target, epoch, "shard allocated");
        self.record(shard, "allocated", &target, epoch, format!("{cause}; {why}"));
        self.state.set_home(shard, target.clone(), epoch);
        let entry = self.shard_entry(shard);
        let mut effects = vec![Self::send(&target, ToRegion::HostShard { shard: shard.clone(), epoch })];
        for r in self.deferred.remove(shard).unwrap_or_default() {
            effects.push(Self::send(&r, ToRegion::ShardHome { shard: shard.clone(), region: target.clone(), epoch }));
        }
        self.unacked_host.insert(shard.clone(), (target, epoch, now));
        self.commit(vec![entry], effects, out);
        true
    }

    fn start_handoff(
        &mut self,
        shard: ShardId,
        from: RegionId,
        reason: String,
        now: Instant,
        out: &mut Vec<CoordinatorAction>,
    ) {
        let everyone: BTreeSet<RegionId> = self.all_regions().cloned().collect();
        debug!(%shard, %from, "hand-off started");
        self.record(&shard, "hand-off-started", &from, 0, reason);
        let id = (self.last_handoff_id + 1).max(self.wall_ms << 16);
        self.last_handoff_id = id;
        let effects = everyone
            .iter()
            .map(|r| Self::send(r, ToRegion::BeginHandOff { shard: shard.clone(), handoff: id }))
            .collect();
        self.handoffs.insert(
            shard,
            Handoff {
                id,
                from,
                phase: HandoffPhase::WaitingForAcks(everyone),
                deadline: now + self.settings.handoff_timeout,
                sent_at: now,
            },
        );
        self.commit(vec![], effects, out);
    }

    fn finish_handoff(&mut self, shard: &ShardId, now: Instant, wall_ms: u64, out: &mut Vec<CoordinatorAction>) {
        let Some(h) = self.handoffs.remove(shard) else { return };
        debug!(%shard, from = %h.from, "hand-off done");
        self.record(shard, "hand-off-done", &h.from, 0, "every entity stopped on the old home".into());
        self.unacked_host.remove(shard);
        self.state.clear_home(shard);
        let dealloc = self.shard_entry(shard);
        self.commit(vec![dealloc], vec![], out);
        // Eager re-allocation: the shard has a home again before anyone asks.
        let requester =
            self.deferred.get(shard).and_then(|d| d.iter().next().cloned()).unwrap_or_else(|| h.from.clone());
        let cause = format!("re-allocated after its hand-off from {}", h.from);
        self.allocate(shard, &requester, &cause, now, wall_ms, out);
    }

    fn on_region_terminated(&mut self, region: RegionId, now: Instant, wall_ms: u64, out: &mut Vec<CoordinatorAction>) {
        let was_region = self.state.regions.remove(&region);
        let was_proxy = self.state.proxies.remove(&region);
        if !was_region && !was_proxy {
            return;
        }
        info!(%region, "region terminated");
        self.shutting_down.remove(&region);
        let mut entries = vec![(keys::region_entry(&region), None)];
        let lost: Vec<ShardId> = self.state.shards_of(&region).to_vec();
        for s in &lost {
            self.record(s, "home-lost", &region, 0, "its region terminated (left, downed, stopped or refused)".into());
            self.state.clear_home(s);
            self.unacked_host.remove(s);
            entries.push(self.shard_entry(s));
        }
        self.commit(entries, vec![], out);
        // A terminated region counts as having acknowledged, and as having stopped its shards.
        let shards: Vec<ShardId> = self.handoffs.keys().cloned().collect();
        for shard in shards {
            let h = self.handoffs.get_mut(&shard).expect("handoff");
            if h.from == region {
                self.handoffs.remove(&shard);
                let cause = format!("its hand-off's old home {region} terminated");
                self.allocate(&shard, &self.me.clone(), &cause, now, wall_ms, out);
                continue;
            }
            if let HandoffPhase::WaitingForAcks(pending) = &mut h.phase {
                pending.remove(&region);
                if pending.is_empty() {
                    h.phase = HandoffPhase::Stopping;
                    let (from, handoff) = (h.from.clone(), h.id);
                    self.commit(vec![], vec![Self::send(&from, ToRegion::HandOff { shard, handoff })], out);
                }
            }
        }
        for shard in &lost {
            self.deferred.entry(shard.clone()).or_default();
            if !self.settings.eager_reallocation && self.deferred[shard].is_empty() {
                self.deferred.remove(shard);
            }
        }
        self.allocate_deferred(now, wall_ms, out);
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<CoordinatorAction>) {
        // HostShard is re-sent until the region confirms, but not while the shard is handed off
        // (seed 570000570: the region took the stale HostShard while stopping the shard).
        let resend: Vec<(ShardId, RegionId, u64)> = self
            .unacked_host
            .iter()
            .filter(|(s, (_, _, at))| *at + self.settings.shard_start_timeout <= now && !self.handoffs.contains_key(*s))
            .map(|(s, (r, e, _))| (s.clone(), r.clone(), *e))
            .collect();
        for (shard, region, epoch) in resend {
            self.unacked_host.insert(shard.clone(), (region.clone(), epoch, now));
            self.commit(vec![], vec![Self::send(&region, ToRegion::HostShard { shard, epoch })], out);
        }
        // Hand-off messages without an answer are sent again.
        let mut resend = Vec::new();
        for (shard, h) in self.handoffs.iter_mut().filter(|(_, h)| h.sent_at + self.settings.shard_start_timeout <= now)
        {
            h.sent_at = now;
            match &h.phase {
                HandoffPhase::WaitingForAcks(pending) => resend.extend(
                    pending
                        .iter()
                        .map(|r| Self::send(r, ToRegion::BeginHandOff { shard: shard.clone(), handoff: h.id })),
                ),
                HandoffPhase::Stopping => {
                    resend.push(Self::send(&h.from, ToRegion::HandOff { shard: shard.clone(), handoff: h.id }))
                }
            }
        }
        if !resend.is_empty() {
            self.commit(vec![], resend, out);
        }
        // One timeout bounds a whole hand-off.
        let expired: Vec<ShardId> =
            self.handoffs.iter().filter(|(_, h)| h.deadline <= now).map(|(s, _)| s.clone()).collect();
        for shard in expired {
            let h = self.handoffs.remove(&shard).expect("handoff");
            warn!(%shard, from = %h.from, phase = ?h.phase, "hand-off timed out; shard stays where it was");
            let why = format!(
                "not done within the hand-off timeout ({:?}, {}); the shard stays",
                self.settings.handoff_timeout,
                phase_name(&h.phase)
            );
            self.record(&shard, "hand-off-timed-out", &h.from, 0, why);
            if let Some((home, epoch)) = self.state.home(&shard).map(|(h, e)| (h.clone(), e)) {
                let requesters = self.deferred.remove(&shard).unwrap_or_default();
                let mut effects: Vec<CoordinatorAction> = requesters
                    .iter()
                    .map(|r| Self::send(r, ToRegion::ShardHome { shard: shard.clone(), region: home.clone(), epoch }))
                    .collect();
                // Regions forgot the home at BeginHandOff: tell everyone again.
                for r in self.all_regions() {
                    effects
                        .push(Self::send(r, ToRegion::ShardHome { shard: shard.clone(), region: home.clone(), epoch }));
                }
                self.commit(vec![], effects, out);
            }
        }
        if now >= self.next_rebalance {
            self.next_rebalance = now + self.settings.rebalance_interval;
            let _ = self.rebalance_round(now, out);
        }
    }
}

fn phase_name(phase: &HandoffPhase) -> &'static str {
    match phase {
        HandoffPhase::WaitingForAcks(_) => "waiting-for-acks",
        HandoffPhase::Stopping => "stopping",
    }
}

mod queries;
mod rebalance;
mod registration;
pub(crate) use queries::plan_dto;

#[cfg(test)]
mod tests;
