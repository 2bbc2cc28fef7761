//! The coordinator's take-over read and its state writes, as sans-IO cores. The driver performs
//! their actions on the replicator and so does the simulation, so every simulated seed runs the
//! decisions that ship.
//!
//! **Guarantees.**
//! - A coordinator starts only with state it *claimed*: under a term above every term this node
//!   has seen and at least the wall clock, stored by a majority-plus of replicas before they
//!   answered. A replica holding a newer term makes it claim above that, at most
//!   [`CLAIM_TRIES`] times before the read fails (and the singleton core retries it).
//! - With remember-entities it starts only after it also read the durable set of every shard
//!   the type ever had (a plain majority of the replicator's roster), so a full-cluster restart
//!   allocates every remembered shard again.
//! - Every state write carries the claimed term. A write refused by a newer term ends the
//!   coordinator ([`StateWriteAction::Fenced`]) and is never retried; any other failure is
//!   retried after a backoff (`coordinator.write_retry_backoff_*`) until the state and the newly remembered shards
//!   are both acknowledged, and only then is the write done.

use std::collections::BTreeSet;
use std::time::Duration;

use std::sync::Arc;

use super::core::{CoordinatorAction, CoordinatorCore, CoordinatorInput, CoordinatorSettings, MembersView};
use super::state::{CoordinatorState, StateEntry};
use crate::clock::Instant;
use crate::ddata::{Consistency, FencedMap};
use crate::error::Error;
use crate::sharding::allocation::ShardAllocationStrategy;
use crate::sharding::ids::{RegionId, ShardId, ShardIdRule};
use crate::sharding::keys;
use crate::sharding::settings::ShardingSettings;
use crate::sharding::shard::batch::{remember_read_consistency, remember_write_consistency};

/// Claims of the state under a higher term, when a replica turns out to hold a newer one,
/// before the take-over read fails (and is retried by the singleton core).
pub(crate) const CLAIM_TRIES: usize = 3;

/// Pause between failed take-over reads (the singleton core's retry interval).
pub(crate) const TAKE_OVER_RETRY: Duration = Duration::from_millis(200);

/// Consistency of the state claim at take-over (Akka's ReadMajorityPlus, 5 and min-cap 5 by
/// default).
fn state_read(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator.read_majority_plus, min_cap: s.coordinator.majority_min_cap }
}

/// Consistency of coordinator state writes (WriteMajorityPlus, 3 and min-cap 5 by default).
fn state_write(s: &ShardingSettings) -> Consistency {
    Consistency::Majority { plus: s.coordinator.write_majority_plus, min_cap: s.coordinator.majority_min_cap }
}

/// What the take-over read found: the coordinator state and, with remember-entities, every
/// shard the type ever had.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TakeOverState {
    pub map: FencedMap,
    /// The term this coordinator claimed the state under: every write of it carries it.
    pub term: u64,
    pub remembered_shards: Option<BTreeSet<ShardId>>,
}

impl CoordinatorSettings {
    /// The coordinator settings of a type: its sharding settings, its extractor's fingerprint
    /// and shard ids, and a state budget of half the transport's largest frame (a value over
    /// the message budget still travels alone in one frame).
    pub(crate) fn from_sharding(
        s: &ShardingSettings,
        registration: super::core::Registration,
        shard_ids: ShardIdRule,
        max_frame_size: usize,
    ) -> Self {
        CoordinatorSettings {
            min_nr_of_members: s.min_nr_of_members,
            rebalance_interval: s.rebalance_interval,
            handoff_timeout: s.handoff_timeout,
            shard_start_timeout: s.shard_start_timeout,
            eager_reallocation: s.remember.enabled,
            extractor_fingerprint: registration.extractor_fingerprint,
            must_agree: registration.must_agree,
            shard_ids,
            max_state_bytes: max_frame_size / 2,
        }
    }
}

impl TakeOverState {
    /// The coordinator that starts with what this take-over read found: it learns the
    /// membership (if known), announces its predecessor's allocations again, and with
    /// remember-entities allocates every remembered shard that has no home.
    pub(crate) fn start_coordinator(
        self,
        me: RegionId,
        settings: CoordinatorSettings,
        strategy: Arc<dyn ShardAllocationStrategy>,
        members: Option<MembersView>,
        (now, wall_ms): (Instant, u64),
        out: &mut Vec<CoordinatorAction>,
    ) -> CoordinatorCore {
        let mut core = CoordinatorCore::new(me, settings, strategy, CoordinatorState::from_map(&self.map), now);
        if let Some(members) = members {
            core.handle(CoordinatorInput::Members(members), now, wall_ms, out);
        }
        core.handle(CoordinatorInput::TakeOver, now, wall_ms, out);
        if let Some(shards) = self.remembered_shards {
            core.handle(CoordinatorInput::RememberedShards(shards), now, wall_ms, out);
        }
        core
    }
}

/// What the take-over read asks its performer to do; each answer is a [`TakeOverInput`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TakeOverAction {
    /// Claim the coordinator state under `term` and read it
    /// ([`claim_update`](super::state::claim_update) with `update_and_get_many`); answer
    /// [`TakeOverInput::Claimed`].
    Claim { term: u64, consistency: Consistency, timeout: Duration },
    /// Read the durable set of remembered shards ([`keys::remembered_shards`], a `GSet`);
    /// answer [`TakeOverInput::RememberedShardsRead`].
    ReadRememberedShards { key: String, consistency: Consistency, timeout: Duration },
    /// The read is over: the state to start with, or why there is none yet.
    Done(Result<TakeOverState, String>),
}

/// The performer's answers.
#[derive(Debug)]
pub(crate) enum TakeOverInput {
    /// The claim's outcome: the state read (none yet: `None`), or why not.
    Claimed(Result<Option<FencedMap>, Error>),
    /// The remembered shards read (none yet: empty), or why not.
    RememberedShardsRead(Result<BTreeSet<ShardId>, Error>),
}

/// One take-over read of a type's coordinator state.
#[derive(Debug)]
pub(crate) struct TakeOver {
    type_name: String,
    term: u64,
    claims: usize,
    /// With remember-entities, how the remembered shards are read: the remember store's
    /// quorum (`sharding.remember`), counted over the replicator's roster. The coordinator's
    /// plus and min-cap are for quorums over today's members; over the roster they would make
    /// a small cluster wait for every holder ever seen.
    remembered_read: Option<Consistency>,
    consistency: Consistency,
    timeout: Duration,
    claimed: Option<FencedMap>,
}

impl TakeOver {
    /// Starts a read: the first claim goes out under a term above `local_fence` (the newest
    /// term this node's replica holds) and at least `wall_ms`.
    pub(crate) fn start(
        type_name: &str,
        s: &ShardingSettings,
        local_fence: u64,
        wall_ms: u64,
        out: &mut Vec<TakeOverAction>,
    ) -> Self {
        let mut t = TakeOver {
            type_name: type_name.to_string(),
            term: wall_ms.max(local_fence.saturating_add(1)),
            claims: 0,
            remembered_read: s.remember.enabled.then(|| remember_read_consistency(s)),
            consistency: state_read(s),
            timeout: s.coordinator.waiting_for_state_timeout,
            claimed: None,
        };
        t.claim(out);
        t
    }

    fn claim(&mut self, out: &mut Vec<TakeOverAction>) {
        self.claims += 1;
        out.push(TakeOverAction::Claim { term: self.term, consistency: self.consistency, timeout: self.timeout });
    }

    pub(crate) fn handle(&mut self, input: TakeOverInput, out: &mut Vec<TakeOverAction>) {
        match input {
            TakeOverInput::Claimed(result) => {
                let newer = match &result {
                    Ok(Some(map)) if map.fence() > self.term => Some(map.fence()),
                    Err(Error::Fenced { fence, .. }) => Some(*fence),
                    _ => None,
                };
                if let Some(fence) = newer {
                    // A replica holds a newer term: claim above it (the other claimant is either
                    // a predecessor or a node that will stop when it sees it is not the host).
                    self.term = fence.saturating_add(1);
                    if self.claims < CLAIM_TRIES {
                        self.claim(out);
                    } else {
                        let why = format!(
                            "newer coordinator terms kept appearing while claiming the state (last tried {})",
                            self.term
                        );
                        out.push(TakeOverAction::Done(Err(why)));
                    }
                    return;
                }
                match result {
                    Ok(map) => {
                        let map = map.unwrap_or_default();
                        if let Some(consistency) = self.remembered_read {
                            self.claimed = Some(map);
                            out.push(TakeOverAction::ReadRememberedShards {
                                key: keys::remembered_shards(&self.type_name),
                                consistency,
                                timeout: self.timeout,
                            });
                        } else {
                            let state = TakeOverState { map, term: self.term, remembered_shards: None };
                            out.push(TakeOverAction::Done(Ok(state)));
                        }
                    }
                    Err(e) => out.push(TakeOverAction::Done(Err(e.to_string()))),
                }
            }
            TakeOverInput::RememberedShardsRead(result) => {
                let Some(map) = self.claimed.take() else { return };
                let done = match result {
                    Ok(shards) => Ok(TakeOverState { map, term: self.term, remembered_shards: Some(shards) }),
                    Err(e) => Err(format!("cannot read the remembered shards yet: {e}")),
                };
                out.push(TakeOverAction::Done(done));
            }
        }
    }
}

/// What a state write asks its performer to do.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StateWriteAction {
    /// Write `entries` under `term` ([`write_update`](super::state::write_update), at
    /// `consistency`) and, at the same time, add `remembered` (if any) to the durable set of
    /// shards, at the remember store's write consistency it carries; answer
    /// [`StateWriteInput::Written`] with both outcomes.
    Write {
        entries: Vec<StateEntry>,
        term: u64,
        consistency: Consistency,
        timeout: Duration,
        remembered: Option<(BTreeSet<ShardId>, Consistency)>,
    },
    /// Both were acknowledged: the coordinator's write is done.
    Acknowledged,
    /// A newer term claimed the state: this coordinator is stale for good and stops.
    Fenced { term: u64, fence: u64 },
    /// The write failed (`error`); answer [`StateWriteInput::Retry`] after `after`.
    RetryAfter { after: Duration, error: String },
}

/// The performer's answers.
#[derive(Debug)]
pub(crate) enum StateWriteInput {
    /// The outcomes of the state write and of the remembered shards' write (`Ok` when there
    /// were none).
    Written { state: Result<(), Error>, shards: Result<(), Error> },
    /// The backoff after a failure is over.
    Retry,
}

/// One coordinator state write, retried until acknowledged or fenced.
#[derive(Debug)]
pub(crate) struct StateWrite {
    entries: Vec<StateEntry>,
    term: u64,
    consistency: Consistency,
    timeout: Duration,
    remembered: Option<(BTreeSet<ShardId>, Consistency)>,
    backoff: Duration,
    max_backoff: Duration,
}

impl StateWrite {
    /// Starts writing `entries` under `term`; with remember-entities the shards the entries
    /// allocate go into the durable set of shards too.
    pub(crate) fn start(
        s: &ShardingSettings,
        entries: Vec<StateEntry>,
        term: u64,
        out: &mut Vec<StateWriteAction>,
    ) -> Self {
        let remembered = s
            .remember
            .enabled
            .then(|| {
                entries
                    .iter()
                    .filter(|(_, v)| v.is_some())
                    .filter_map(|(k, _)| keys::shard_of_entry(k).map(String::from))
                    .collect::<BTreeSet<ShardId>>()
            })
            .filter(|shards| !shards.is_empty())
            .map(|shards| (shards, remember_write_consistency(s)));
        let w = StateWrite {
            entries,
            term,
            consistency: state_write(s),
            timeout: s.coordinator.updating_state_timeout,
            remembered,
            backoff: s.coordinator.write_retry_backoff_min,
            max_backoff: s.coordinator.write_retry_backoff_max,
        };
        w.write(out);
        w
    }

    fn write(&self, out: &mut Vec<StateWriteAction>) {
        out.push(StateWriteAction::Write {
            entries: self.entries.clone(),
            term: self.term,
            consistency: self.consistency,
            timeout: self.timeout,
            remembered: self.remembered.clone(),
        });
    }

    pub(crate) fn handle(&mut self, input: StateWriteInput, out: &mut Vec<StateWriteAction>) {
        match input {
            StateWriteInput::Written { state, shards } => {
                // The state's outcome first: a fence there ends the writes for good.
                match state.and(shards) {
                    Ok(()) => out.push(StateWriteAction::Acknowledged),
                    Err(Error::Fenced { fence, .. }) => out.push(StateWriteAction::Fenced { term: self.term, fence }),
                    Err(e) => {
                        let after = self.backoff;
                        self.backoff = (self.backoff * 2).min(self.max_backoff);
                        out.push(StateWriteAction::RetryAfter { after, error: e.to_string() });
                    }
                }
            }
            StateWriteInput::Retry => self.write(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration() -> super::super::core::Registration {
        super::super::core::Registration { extractor_fingerprint: 77, must_agree: vec![] }
    }

    fn remember() -> ShardingSettings {
        ShardingSettings {
            remember: crate::sharding::RememberEntitiesSettings {
                enabled: true,
                // Set apart from the coordinator's and the states' quorums, so a test sees
                // which one a read or write took.
                write_majority_plus: 1,
                read_majority_plus: 2,
                majority_min_cap: 4,
                ..ShardingSettings::default().remember
            },
            ..ShardingSettings::default()
        }
    }

    fn map_with_fence(fence: u64) -> FencedMap {
        let mut m = FencedMap::default();
        m.claim(fence).unwrap();
        m
    }

    fn fenced(fence: u64) -> Error {
        Error::Fenced { key: keys::coordinator_state("t"), epoch: 1, fence }
    }

    /// A take-over whose first claim went out at term 10.
    fn claiming_at_10(s: &ShardingSettings) -> TakeOver {
        let mut out = Vec::new();
        let t = TakeOver::start("t", s, 0, 10, &mut out);
        assert_eq!(claim_term(&out), 10);
        t
    }

    fn claim_term(out: &[TakeOverAction]) -> u64 {
        match out {
            [TakeOverAction::Claim { term, .. }] => *term,
            other => panic!("expected one claim: {other:?}"),
        }
    }

    #[test]
    fn coordinator_settings_follow_the_type_and_reallocate_eagerly_only_when_entities_are_remembered() {
        let s = ShardingSettings { min_nr_of_members: 3, ..ShardingSettings::default() };
        let cs = CoordinatorSettings::from_sharding(&s, registration(), ShardIdRule::Numbered(10), 8 << 20);
        assert_eq!(cs.min_nr_of_members, 3);
        assert_eq!(
            (cs.rebalance_interval, cs.handoff_timeout, cs.shard_start_timeout),
            (s.rebalance_interval, s.handoff_timeout, s.shard_start_timeout)
        );
        assert_eq!((cs.extractor_fingerprint, cs.shard_ids), (77, ShardIdRule::Numbered(10)));
        assert_eq!(cs.max_state_bytes, 4 << 20, "half the largest frame");
        assert!(!cs.eager_reallocation);
        let cs = CoordinatorSettings::from_sharding(&remember(), registration(), ShardIdRule::Custom, 8 << 20);
        assert!(cs.eager_reallocation, "remembered shards come back without a message");
    }

    #[test]
    fn the_first_claim_is_above_every_term_seen_here_and_at_least_the_wall_clock() {
        let s = ShardingSettings::default();
        let mut out = Vec::new();
        TakeOver::start("t", &s, 41, 7, &mut out);
        assert_eq!(
            out,
            vec![TakeOverAction::Claim {
                term: 42,
                consistency: Consistency::Majority {
                    plus: s.coordinator.read_majority_plus,
                    min_cap: s.coordinator.majority_min_cap
                },
                timeout: s.coordinator.waiting_for_state_timeout
            }]
        );
        let mut out = Vec::new();
        TakeOver::start("t", &s, 41, 1_000, &mut out);
        assert_eq!(claim_term(&out), 1_000, "the wall clock when it is higher");
        let mut out = Vec::new();
        TakeOver::start("t", &s, u64::MAX, 0, &mut out);
        assert_eq!(claim_term(&out), u64::MAX, "saturates");
    }

    #[test]
    fn a_newer_term_on_a_replica_is_claimed_above_at_most_three_times_then_the_read_fails() {
        let s = ShardingSettings::default();
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        // A replica answered with a newer term: claim above it.
        t.handle(TakeOverInput::Claimed(Ok(Some(map_with_fence(20)))), &mut out);
        assert_eq!(claim_term(&out), 21);
        out.clear();
        // A replica refused the claim: above its fence.
        t.handle(TakeOverInput::Claimed(Err(fenced(30))), &mut out);
        assert_eq!(claim_term(&out), 31);
        out.clear();
        t.handle(TakeOverInput::Claimed(Err(fenced(40))), &mut out);
        match out.as_slice() {
            [TakeOverAction::Done(Err(why))] => assert!(why.contains("last tried 41"), "{why}"),
            other => panic!("three claims, then the read fails: {other:?}"),
        }
    }

    #[test]
    fn a_claim_that_reads_its_own_term_or_an_older_one_starts_with_that_state() {
        let s = ShardingSettings::default();
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        t.handle(TakeOverInput::Claimed(Ok(Some(map_with_fence(10)))), &mut out);
        assert_eq!(
            out,
            vec![TakeOverAction::Done(Ok(TakeOverState {
                map: map_with_fence(10),
                term: 10,
                remembered_shards: None
            }))]
        );
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        t.handle(TakeOverInput::Claimed(Ok(None)), &mut out);
        assert_eq!(
            out,
            vec![TakeOverAction::Done(Ok(TakeOverState {
                map: FencedMap::default(),
                term: 10,
                remembered_shards: None
            }))],
            "no state yet: an empty one"
        );
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        t.handle(TakeOverInput::Claimed(Err(Error::ConsistencyTimeout { needed: 3, acked: 1 })), &mut out);
        assert!(matches!(out.as_slice(), [TakeOverAction::Done(Err(_))]), "{out:?}");
    }

    #[test]
    fn with_remember_entities_the_claimed_state_waits_for_the_remembered_shards_read() {
        let s = remember();
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        t.handle(TakeOverInput::Claimed(Ok(Some(map_with_fence(10)))), &mut out);
        assert_eq!(
            out,
            vec![TakeOverAction::ReadRememberedShards {
                key: "shard-t/all".into(),
                consistency: Consistency::AllReachable { plus: 2, min_cap: 4 },
                timeout: s.coordinator.waiting_for_state_timeout
            }]
        );
        out.clear();
        let shards: BTreeSet<ShardId> = ["3".to_string(), "7".to_string()].into();
        t.handle(TakeOverInput::RememberedShardsRead(Ok(shards.clone())), &mut out);
        assert_eq!(
            out,
            vec![TakeOverAction::Done(Ok(TakeOverState {
                map: map_with_fence(10),
                term: 10,
                remembered_shards: Some(shards)
            }))]
        );
        // A failed read of the shards fails the take-over (retried by the singleton core).
        let (mut t, mut out) = (claiming_at_10(&s), Vec::new());
        t.handle(TakeOverInput::Claimed(Ok(None)), &mut out);
        out.clear();
        t.handle(TakeOverInput::RememberedShardsRead(Err(Error::ConsistencyTimeout { needed: 2, acked: 1 })), &mut out);
        match out.as_slice() {
            [TakeOverAction::Done(Err(why))] => assert!(why.contains("remembered shards"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A late answer after the read ended does nothing.
        out.clear();
        t.handle(TakeOverInput::RememberedShardsRead(Ok(BTreeSet::new())), &mut out);
        assert!(out.is_empty());
    }

    fn entries() -> Vec<StateEntry> {
        vec![
            (keys::shard_entry("5"), Some(vec![1])),
            (keys::shard_entry("6"), None),
            ("r/n1#1".to_string(), Some(vec![2])),
        ]
    }

    #[test]
    fn a_state_write_carries_its_term_and_with_remember_entities_the_shards_it_allocates() {
        let mut out = Vec::new();
        StateWrite::start(&ShardingSettings::default(), entries(), 9, &mut out);
        match out.as_slice() {
            [StateWriteAction::Write { entries: e, term: 9, remembered: None, .. }] => assert_eq!(e, &entries()),
            other => panic!("{other:?}"),
        }
        let mut out = Vec::new();
        StateWrite::start(&remember(), entries(), 9, &mut out);
        match out.as_slice() {
            [StateWriteAction::Write { remembered: Some((r, consistency)), .. }] => {
                assert_eq!(r, &BTreeSet::from(["5".to_string()]), "only shards allocated, not deleted, not regions");
                assert_eq!(*consistency, Consistency::Majority { plus: 1, min_cap: 4 }, "the remember store's");
            }
            other => panic!("{other:?}"),
        }
        let mut out = Vec::new();
        StateWrite::start(&remember(), vec![("r/n1#1".to_string(), Some(vec![]))], 9, &mut out);
        assert!(matches!(out.as_slice(), [StateWriteAction::Write { remembered: None, .. }]), "no shard, no set write");
    }

    #[test]
    fn a_failed_state_write_is_retried_with_a_doubling_backoff_and_a_fenced_one_never() {
        let mut out = Vec::new();
        let mut w = StateWrite::start(&remember(), entries(), 9, &mut out);
        let first = out.pop().unwrap();
        let timeout = || Err(Error::ConsistencyTimeout { needed: 3, acked: 1 });
        let mut afters = Vec::new();
        for k in 0..7 {
            out.clear();
            // Either part failing fails the write.
            let (state, shards) = if k % 2 == 0 { (timeout(), Ok(())) } else { (Ok(()), timeout()) };
            w.handle(StateWriteInput::Written { state, shards }, &mut out);
            match out.as_slice() {
                [StateWriteAction::RetryAfter { after, .. }] => afters.push(after.as_millis()),
                other => panic!("{other:?}"),
            }
            out.clear();
            w.handle(StateWriteInput::Retry, &mut out);
            assert_eq!(out, vec![first.clone()], "the same write again");
        }
        assert_eq!(afters, vec![100, 200, 400, 800, 1600, 2000, 2000], "Akka's defaults");
        // Set otherwise, followed.
        let mut s = remember();
        s.coordinator.write_retry_backoff_min = Duration::from_millis(300);
        s.coordinator.write_retry_backoff_max = Duration::from_millis(1000);
        let mut w = StateWrite::start(&s, entries(), 9, &mut Vec::new());
        let afters: Vec<u128> = (0..4)
            .map(|_| {
                let mut out = Vec::new();
                w.handle(StateWriteInput::Written { state: timeout(), shards: Ok(()) }, &mut out);
                w.handle(StateWriteInput::Retry, &mut Vec::new());
                match out.as_slice() {
                    [StateWriteAction::RetryAfter { after, .. }] => after.as_millis(),
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        assert_eq!(afters, vec![300, 600, 1000, 1000]);
        out.clear();
        w.handle(StateWriteInput::Written { state: Ok(()), shards: Ok(()) }, &mut out);
        assert_eq!(out, vec![StateWriteAction::Acknowledged]);
        // Fenced: the state's outcome wins over the shards' failure, and nothing is retried.
        out.clear();
        w.handle(StateWriteInput::Written { state: Err(fenced(12)), shards: timeout() }, &mut out);
        assert_eq!(out, vec![StateWriteAction::Fenced { term: 9, fence: 12 }]);
    }
}
