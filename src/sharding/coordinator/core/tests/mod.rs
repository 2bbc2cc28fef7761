//! Table tests of the coordinator core.

use super::*;
use crate::membership::UniqueAddress;
use crate::sharding::allocation::LeastShardAllocation;

fn r(n: &str) -> RegionId {
    UniqueAddress::new(n, 1)
}

fn test_settings(min: usize) -> CoordinatorSettings {
    CoordinatorSettings {
        extractor_fingerprint: 7,
        must_agree: vec![("number_of_shards".into(), "10".into()), ("state.slots".into(), "16".into())],
        min_nr_of_members: min,
        rebalance_interval: Duration::from_secs(10),
        handoff_timeout: Duration::from_secs(5),
        shard_start_timeout: Duration::from_secs(2),
        eager_reallocation: false,
        shard_ids: ShardIdRule::Custom,
        max_state_bytes: 1 << 20,
    }
}

fn least_shard() -> Arc<dyn ShardAllocationStrategy> {
    Arc::new(LeastShardAllocation { absolute_limit: 100, relative_limit: 1.0 })
}

fn core_from(
    settings: CoordinatorSettings,
    strategy: Arc<dyn ShardAllocationStrategy>,
    state: CoordinatorState,
) -> CoordinatorCore {
    CoordinatorCore::new(r("c"), settings, strategy, state, Instant::now())
}

fn core(min: usize) -> CoordinatorCore {
    core_from(test_settings(min), least_shard(), CoordinatorState::default())
}

/// The shards a batch of messages starts handing off.
fn begun_shards(sent: &[(RegionId, ToRegion)]) -> BTreeSet<ShardId> {
    sent.iter()
        .filter_map(|(_, m)| match m {
            ToRegion::BeginHandOff { shard, .. } => Some(shard.clone()),
            _ => None,
        })
        .collect()
}

/// A registration of `region` with `extractor` and no settings to check (a node that predates
/// the check, or a test that is not about it).
fn register(region: RegionId, proxy: bool, extractor: u64) -> CoordinatorInput {
    from_region(ToCoordinator::Register { region, proxy, extractor, settings: vec![] })
}

/// A message from the region it names.
fn from_region(msg: ToCoordinator) -> CoordinatorInput {
    CoordinatorInput::FromRegion { from: msg.region().clone(), msg }
}

/// Marks the cluster settled (no unreachable or joining member): rebalancing may run.
fn settle(c: &mut CoordinatorCore) {
    let mut view = c.members.clone();
    view.settled = true;
    c.handle(CoordinatorInput::Members(view), Instant::now(), 1, &mut Vec::new());
}

/// The member of `region` is gone from the membership; returns the messages sent.
fn terminate(c: &mut CoordinatorCore, region: RegionId, now: Instant, wall: u64) -> Vec<(RegionId, ToRegion)> {
    let mut view = c.members.clone();
    view.statuses.remove(&region);
    step(c, CoordinatorInput::Members(view), now, wall)
}

/// Region `region` asks for the home of `shard`; returns the messages sent.
fn get_home(c: &mut CoordinatorCore, shard: &str, region: &str, now: Instant, wall: u64) -> Vec<(RegionId, ToRegion)> {
    step(c, from_region(ToCoordinator::GetShardHome { shard: shard.into(), region: r(region) }), now, wall)
}

/// Feeds an input; completes writes at once; returns the messages sent. A region that
/// registers is listed as an Up member first (tests of rejected registrations call
/// `handle` directly).
fn step(c: &mut CoordinatorCore, input: CoordinatorInput, now: Instant, wall: u64) -> Vec<(RegionId, ToRegion)> {
    if let CoordinatorInput::FromRegion { msg: ToCoordinator::Register { region, .. }, .. } = &input {
        c.members.statuses.entry(region.clone()).or_insert(MemberStatus::Up);
    }
    let mut out = Vec::new();
    c.handle(input, now, wall, &mut out);
    let mut sent = Vec::new();
    while !out.is_empty() {
        let mut next = Vec::new();
        for a in out {
            match a {
                CoordinatorAction::Send { to, msg } => sent.push((to, msg)),
                CoordinatorAction::Write(_) => c.handle(CoordinatorInput::WriteDone, now, wall, &mut next),
            }
        }
        out = next;
    }
    sent
}

/// Region `region` acks the current hand-off of `shard` (with its id); returns the messages sent.
fn ack(c: &mut CoordinatorCore, shard: &str, region: RegionId, now: Instant, wall: u64) -> Vec<(RegionId, ToRegion)> {
    let handoff = c.handoffs.get(shard).map_or(0, |h| h.id);
    step(c, from_region(ToCoordinator::BeginHandOffAck { shard: shard.into(), region, handoff }), now, wall)
}

fn reg(c: &mut CoordinatorCore, n: &str, now: Instant) {
    step(c, register(r(n), false, 7), now, 1);
}

#[test]
fn home_requests_for_shard_ids_the_extractor_cannot_produce_allocate_nothing_and_are_counted() {
    let mut c = core_from(
        CoordinatorSettings { shard_ids: ShardIdRule::Numbered(100), ..test_settings(1) },
        least_shard(),
        CoordinatorState::default(),
    );
    let now = Instant::now();
    reg(&mut c, "a", now);
    for bogus in ["100", "007", "-1", "abc", "", "4294967296"] {
        assert!(get_home(&mut c, bogus, "a", now, 1).is_empty(), "{bogus:?} was answered");
    }
    assert_eq!(c.rejected_messages(), 6);
    assert!(c.state.shards().is_empty(), "nothing allocated");
    let sent = get_home(&mut c, "99", "a", now, 1);
    assert!(
        matches!(&sent[..], [(_, ToRegion::HostShard { .. }), ..] | [(_, ToRegion::ShardHome { .. }), ..]),
        "{sent:?}"
    );
}

#[test]
fn shard_id_rules_match_what_extractors_produce() {
    for k in [0u32, 7, 999] {
        assert!(ShardIdRule::Numbered(1000).allows(&crate::sharding::ids::default_shard_id(&format!("id-{k}"), 1000)));
        assert!(ShardIdRule::Numbered(1000).allows(&k.to_string()));
    }
    assert!(!ShardIdRule::Numbered(1000).allows("1000"));
    assert!(!ShardIdRule::Numbered(1000).allows("+5"));
    assert!(ShardIdRule::Custom.allows(&"s".repeat(crate::sharding::ids::MAX_SHARD_ID_LEN)));
    assert!(!ShardIdRule::Custom.allows(&"s".repeat(crate::sharding::ids::MAX_SHARD_ID_LEN + 1)));
    assert!(!ShardIdRule::Custom.allows(""));
}

#[test]
fn a_region_with_another_shard_id_extractor_is_refused_registers_nothing_and_is_counted() {
    let mut c = core(1);
    let now = Instant::now();
    let sent = step(&mut c, register(r("b"), false, 8), now, 1);
    match &sent[..] {
        [(to, ToRegion::RegisterRefused { coordinator, reason })] => {
            assert_eq!((to, coordinator), (&r("b"), &r("c")));
            assert!(reason.contains("shard-id extractor differs"), "{reason}");
        }
        other => panic!("refused: {other:?}"),
    }
    assert!(c.regions().next().is_none(), "not registered");
    assert_eq!(c.rejected_messages(), 1);
    // The same region with the cluster's extractor is accepted.
    let sent = step(&mut c, register(r("b"), false, 7), now, 1);
    assert!(matches!(&sent[..], [(_, ToRegion::RegisterAck { .. })]), "{sent:?}");
}

#[test]
fn a_region_whose_settings_that_must_agree_differ_is_refused_naming_the_setting_and_others_are_not() {
    let mut c = core(1);
    let now = Instant::now();
    let register = |region: &str, proxy: bool, settings: Vec<(String, String)>| {
        from_region(ToCoordinator::Register { region: r(region), proxy, extractor: 7, settings })
    };
    let slots =
        |n: &str| vec![("number_of_shards".to_string(), "10".to_string()), ("state.slots".to_string(), n.to_string())];
    let sent = step(&mut c, register("b", false, slots("8")), now, 1);
    match &sent[..] {
        [(to, ToRegion::RegisterRefused { reason, .. })] => {
            assert_eq!(to, &r("b"));
            assert!(reason.contains("`state.slots` is 8 there but 16 on the coordinator's node"), "{reason}");
            assert!(!reason.contains("number_of_shards"), "only what differs: {reason}");
        }
        other => panic!("refused: {other:?}"),
    }
    assert!(c.regions().next().is_none(), "not registered");
    assert_eq!(c.rejected_messages(), 1);
    // The same values, a proxy (it reads and writes no keys), a region that predates the
    // check (sends none) and a setting the coordinator does not know are all accepted.
    for (region, proxy, settings) in [
        ("same", false, slots("16")),
        ("proxy", true, slots("8")),
        ("older", false, vec![]),
        ("newer", false, [slots("16"), vec![("future.knob".to_string(), "on".to_string())]].concat()),
    ] {
        let sent = step(&mut c, register(region, proxy, settings), now, 1);
        assert!(
            sent.iter().any(|(to, m)| *to == r(region) && matches!(m, ToRegion::RegisterAck { .. })),
            "{region}: {sent:?}"
        );
    }
}

#[test]
fn a_registered_region_that_comes_back_with_another_extractor_has_its_shards_handed_off_and_gets_none() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    for s in 0..6 {
        let who = if s % 2 == 0 { "a" } else { "b" };
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: format!("{s}"), region: r(who) }), now, 1);
    }
    let on_a: BTreeSet<ShardId> = c.state().shards_of(&r("a")).iter().cloned().collect();
    assert!(!on_a.is_empty());
    let sent = step(&mut c, register(r("a"), false, 8), now, 1);
    assert!(sent.iter().any(|(to, m)| *to == r("a") && matches!(m, ToRegion::RegisterRefused { .. })), "{sent:?}");
    let begins = begun_shards(&sent);
    assert_eq!(begins, on_a, "its shards leave it by hand-off (entities stop before they start elsewhere)");
    // A new shard never goes to it.
    step(&mut c, from_region(ToCoordinator::GetShardHome { shard: "new".into(), region: r("b") }), now, 1);
    assert_eq!(c.state().home("new").map(|(h, _)| h.clone()), Some(r("b")));
}

#[test]
fn a_registering_region_gets_every_known_home_in_bounded_batches_before_its_ack_except_shards_in_hand_off() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    let shards = 3 * SHARD_HOMES_PER_MESSAGE + 76;
    for s in 0..shards {
        let who = if s % 2 == 0 { "a" } else { "b" };
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: format!("{s}"), region: r(who) }), now, 1);
    }
    // Region a comes back with another extractor: its shards are being handed off.
    let sent = step(&mut c, register(r("a"), false, 8), now, 1);
    let handing_off = begun_shards(&sent);
    assert!(!handing_off.is_empty());
    let sent = step(&mut c, register(r("z"), false, 7), now, 1);
    let to_z: Vec<&ToRegion> = sent.iter().filter(|(to, _)| *to == r("z")).map(|(_, m)| m).collect();
    let (ack, batches) = to_z.split_last().expect("messages to z");
    assert!(matches!(ack, ToRegion::RegisterAck { .. }), "the ack comes last: {ack:?}");
    let mut named = BTreeMap::new();
    for batch in batches {
        let ToRegion::ShardHomes { homes } = batch else { panic!("only batches before the ack: {batch:?}") };
        assert!(homes.len() <= SHARD_HOMES_PER_MESSAGE, "a batch of {}", homes.len());
        for (shard, home, epoch) in homes {
            assert_eq!(c.state().home(shard), Some((home, *epoch)), "shard {shard} as the state has it");
            assert!(named.insert(shard.clone(), home.clone()).is_none(), "shard {shard} named once");
        }
    }
    assert_eq!(named.len(), shards - handing_off.len(), "every home but those in hand-off");
    assert!(named.len() > SHARD_HOMES_PER_MESSAGE, "the test needs more than one batch");
    assert_eq!(batches.len(), named.len().div_ceil(SHARD_HOMES_PER_MESSAGE), "full batches");
    assert!(handing_off.iter().all(|s| !named.contains_key(s)), "a shard in hand-off has no home to give");
}

#[test]
fn messages_revealing_an_allocation_wait_for_the_majority_write() {
    let mut c = core(1);
    c.members.statuses.insert(r("a"), MemberStatus::Up);
    let now = Instant::now();
    let mut out = Vec::new();
    c.handle(register(r("a"), false, 7), now, 1, &mut out);
    assert!(matches!(out.as_slice(), [CoordinatorAction::Write(_)]), "only the write: {out:?}");
    let mut out2 = Vec::new();
    c.handle(from_region(ToCoordinator::GetShardHome { shard: "1".into(), region: r("a") }), now, 1, &mut out2);
    assert!(out2.is_empty(), "queued behind the first write");
    let mut out3 = Vec::new();
    c.handle(CoordinatorInput::WriteDone, now, 1, &mut out3);
    assert!(matches!(&out3[0], CoordinatorAction::Send { msg: ToRegion::RegisterAck { .. }, .. }));
    assert!(matches!(out3.last().unwrap(), CoordinatorAction::Write(_)), "second batch started");
    let mut out4 = Vec::new();
    c.handle(CoordinatorInput::WriteDone, now, 1, &mut out4);
    assert!(out4.iter().any(|a| matches!(a, CoordinatorAction::Send { msg: ToRegion::HostShard { .. }, .. })));
    assert!(out4.iter().any(|a| matches!(a, CoordinatorAction::Send { msg: ToRegion::ShardHome { .. }, .. })));
}

#[test]
fn min_nr_of_members_defers_allocation_until_enough_regions_registered() {
    let mut c = core(3);
    let now = Instant::now();
    reg(&mut c, "a", now);
    let sent = get_home(&mut c, "1", "a", now, 1);
    assert!(sent.is_empty());
    reg(&mut c, "b", now);
    assert!(c.state().shards().is_empty());
    let sent = step(&mut c, register(r("c3"), false, 7), now, 1);
    assert!(sent.iter().any(|(to, m)| *to == r("a") && matches!(m, ToRegion::ShardHome { .. })), "{sent:?}");
}

#[test]
fn remembered_shards_are_allocated_without_any_request_once_regions_registered() {
    let mut c = core(2);
    let now = Instant::now();
    let shards: BTreeSet<ShardId> = ["3".to_string(), "9".to_string()].into();
    assert!(step(&mut c, CoordinatorInput::RememberedShards(shards), now, 1).is_empty(), "waits for regions");
    reg(&mut c, "a", now);
    let sent = step(&mut c, register(r("b"), false, 7), now, 1);
    let hosted: BTreeSet<ShardId> = sent
        .iter()
        .filter_map(|(_, m)| match m {
            ToRegion::HostShard { shard, .. } => Some(shard.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(hosted, ["3".to_string(), "9".to_string()].into());
}

#[test]
fn a_successor_coordinator_does_not_wait_for_min_nr_of_members_again() {
    let mut state = CoordinatorState::default();
    state.regions.insert(r("a"));
    // Allocated once by a predecessor, deallocated since.
    state.set_home(&"1".to_string(), r("a"), 7);
    state.clear_home("1");
    let mut c = core_from(test_settings(3), Arc::new(LeastShardAllocation::default()), state);
    c.members.statuses.insert(r("a"), MemberStatus::Up);
    let get = ToCoordinator::GetShardHome { shard: "1".into(), region: r("a") };
    let sent = step(&mut c, from_region(get), Instant::now(), 1);
    assert!(sent.iter().any(|(_, m)| matches!(m, ToRegion::ShardHome { epoch, .. } if *epoch > 7)));
}

#[test]
fn min_nr_of_members_only_holds_back_the_first_allocation() {
    let mut c = core(2);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    get_home(&mut c, "1", "a", now, 1);
    terminate(&mut c, r("b"), now, 1);
    let sent = get_home(&mut c, "2", "a", now, 1);
    assert!(sent.iter().any(|(_, m)| matches!(m, ToRegion::ShardHome { .. })), "one region is enough now");
}

#[test]
fn a_shard_record_at_the_largest_epoch_from_the_replicated_state_does_not_overflow() {
    let mut state = CoordinatorState::default();
    state.set_home(&"1".to_string(), r("a"), u64::MAX);
    state.clear_home("1");
    let mut c = core_from(test_settings(1), least_shard(), state);
    let now = Instant::now();
    reg(&mut c, "a", now);
    step(&mut c, from_region(ToCoordinator::GetShardHome { shard: "1".into(), region: r("a") }), now, 1);
    assert_eq!(c.state().home("1"), Some((&r("a"), u64::MAX)));
}

#[test]
fn epochs_strictly_increase_across_reallocations() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    let mut last = 0;
    for round in 0..4u64 {
        get_home(&mut c, "7", "a", now, 5);
        let (home, epoch) = c.state().home("7").map(|(h, e)| (h.clone(), e)).unwrap();
        assert!(epoch > last, "round {round}: {epoch} > {last}");
        last = epoch;
        // The home dies; a new incarnation of it registers.
        terminate(&mut c, home.clone(), now, 5);
        assert!(c.state().home("7").is_none());
        let again = UniqueAddress::new(home.node_id.clone(), home.generation + 1);
        step(&mut c, register(again, false, 7), now, 5);
    }
}

#[test]
fn rebalance_hands_off_after_all_acks_and_a_terminated_region_counts_as_acked() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    for s in 0..4 {
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: format!("{s}"), region: r("a") }), now, 1);
    }
    reg(&mut c, "b", now);
    reg(&mut c, "x", now);
    settle(&mut c);
    let later = now + Duration::from_secs(11);
    let sent = step(&mut c, CoordinatorInput::Tick, later, 2);
    let begins = begun_shards(&sent);
    assert!(!begins.is_empty());
    let shard = begins.iter().next().unwrap().clone();
    for who in ["a", "b"] {
        let sent = ack(&mut c, &shard, r(who), later, 2);
        assert!(sent.is_empty(), "still waiting for x");
    }
    let sent = terminate(&mut c, r("x"), later, 2);
    let handoff = handoff_id(&sent, "a", &shard).unwrap_or_else(|| panic!("no HandOff to a: {sent:?}"));
    // A GetShardHome during the hand-off is deferred, answered with the new home after.
    let sent =
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: shard.clone(), region: r("b") }), later, 2);
    assert!(sent.is_empty());
    let sent = step(
        &mut c,
        from_region(ToCoordinator::ShardStopped { shard: shard.clone(), region: r("a"), handoff }),
        later,
        2,
    );
    let (home, _) = c.state().home(&shard).unwrap();
    assert_eq!(home, &r("b"));
    assert!(sent.iter().any(|(to, m)| *to == r("b") && matches!(m, ToRegion::HostShard { .. })));
    assert!(sent.iter().any(|(to, m)| *to == r("b") && matches!(m, ToRegion::ShardHome { .. })));
}

/// Regions a and b with shards 0..6 asked for alternately; returns the core, the time and the
/// shards placed on a.
fn regions_a_b_with_six_shards() -> (CoordinatorCore, Instant, BTreeSet<ShardId>) {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    for s in 0..6 {
        get_home(&mut c, &s.to_string(), if s % 2 == 0 { "a" } else { "b" }, now, 1);
    }
    let on_a: BTreeSet<ShardId> =
        c.state().shards().iter().filter(|(_, rec)| rec.region == Some(r("a"))).map(|(s, _)| s.clone()).collect();
    (c, now, on_a)
}

/// Completes the hand-offs of `shards` from region a: a and b ack, a reports each stopped.
fn hand_off_from_a(c: &mut CoordinatorCore, shards: &BTreeSet<ShardId>, now: Instant) {
    for s in shards {
        let mut handoff = None;
        for who in ["a", "b"] {
            handoff = handoff.or(handoff_id(&ack(c, s, r(who), now, 1), "a", s));
        }
        let handoff = handoff.expect("HandOff once every region acked");
        step(c, from_region(ToCoordinator::ShardStopped { shard: s.clone(), region: r("a"), handoff }), now, 1);
    }
}

#[test]
fn graceful_shutdown_moves_every_shard_of_the_region_and_only_those() {
    let (mut c, now, on_a) = regions_a_b_with_six_shards();
    let sent = step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: r("a") }), now, 1);
    let begins = begun_shards(&sent);
    assert_eq!(begins, on_a);
    hand_off_from_a(&mut c, &on_a, now);
    assert!(c.state().shards().values().all(|rec| rec.region == Some(r("b"))));
}

/// The id of the `HandOff` of `shard` sent to region `to`, if any.
fn handoff_id(sent: &[(RegionId, ToRegion)], to: &str, shard: &str) -> Option<u64> {
    sent.iter().find_map(|(r_, m)| match m {
        ToRegion::HandOff { shard: s, handoff } if *r_ == r(to) && s == shard => Some(*handoff),
        _ => None,
    })
}

/// Regions a and b, shard "1" allocated; returns the core, the start time and its home.
fn regions_a_b_with_shard_1() -> (CoordinatorCore, Instant, RegionId) {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    get_home(&mut c, "1", "a", now, 1);
    let home = c.state().home("1").unwrap().0.clone();
    (c, now, home)
}

#[test]
fn a_late_shard_stopped_of_a_timed_out_hand_off_does_not_complete_the_next_one() {
    let (mut c, now, home) = regions_a_b_with_shard_1();
    let home_name = home.node_id.clone();
    let hand_off = |c: &mut CoordinatorCore, at: Instant| {
        step(c, from_region(ToCoordinator::GracefulShutdownReq { region: home.clone() }), at, 1);
        let mut id = None;
        for who in ["a", "b"] {
            let sent = ack(c, "1", r(who), at, 1);
            id = id.or(handoff_id(&sent, &home_name, "1"));
        }
        id.expect("HandOff sent")
    };
    // First hand-off: HandOff sent, no answer before the timeout; the shard stays.
    let first = hand_off(&mut c, now);
    step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(6), 1);
    assert_eq!(c.state().home("1").unwrap().0, &home);
    // Second hand-off of the same shard from the same region; the first one's answer
    // arrives late and must not complete it.
    let later = now + Duration::from_secs(7);
    let second = hand_off(&mut c, later);
    assert_ne!(first, second);
    let stale = ToCoordinator::ShardStopped { shard: "1".into(), region: home.clone(), handoff: first };
    step(&mut c, from_region(stale), later, 2);
    assert_eq!(c.state().home("1").unwrap().0, &home, "the stale answer moved nothing");
    let current = ToCoordinator::ShardStopped { shard: "1".into(), region: home.clone(), handoff: second };
    step(&mut c, from_region(current), later, 2);
    assert_ne!(c.state().home("1").map(|(h, _)| h.clone()), Some(home.clone()), "the current answer moves it");
}

#[test]
fn hand_off_timeout_keeps_the_shard_and_retells_its_home() {
    let (mut c, now, home) = regions_a_b_with_shard_1();
    step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: home.clone() }), now, 1);
    let sent = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(6), 1);
    assert!(sent.iter().any(|(_, m)| matches!(m, ToRegion::ShardHome { region, .. } if *region == home)));
    assert_eq!(c.rebalancing().count(), 0);
}

#[test]
fn a_message_naming_another_region_than_its_sender_is_dropped() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    get_home(&mut c, "1", "a", now, 1);
    let home = c.state().home("1").map(|(h, _)| h.clone()).expect("allocated");
    // A forged RegionStopped for the live home, sent by the other region: ignored.
    let other = if home == r("a") { r("b") } else { r("a") };
    let forged =
        CoordinatorInput::FromRegion { from: other, msg: ToCoordinator::RegionStopped { region: home.clone() } };
    assert!(step(&mut c, forged, now, 2).is_empty());
    assert_eq!(c.rejected_messages(), 1);
    assert_eq!(c.state().home("1").map(|(h, _)| h.clone()), Some(home), "the shard keeps its home");
}

#[test]
fn registration_is_accepted_only_from_up_or_leaving_members() {
    let mut c = core(1);
    let now = Instant::now();
    for (status, accepted) in [
        (None, false),
        (Some(MemberStatus::Joining), false),
        (Some(MemberStatus::Down), false),
        (Some(MemberStatus::Exiting), false),
        (Some(MemberStatus::Leaving), true),
        (Some(MemberStatus::Up), true),
    ] {
        let region = r(&format!("{status:?}"));
        if let Some(s) = status {
            c.members.statuses.insert(region.clone(), s);
        }
        let rejected = c.rejected_messages();
        let mut out = Vec::new();
        c.handle(register(region.clone(), false, 7), now, 1, &mut out);
        assert_eq!(c.regions().any(|x| *x == region), accepted, "{status:?}");
        assert_eq!(c.rejected_messages() == rejected, accepted, "{status:?}");
    }
}

#[test]
fn a_down_member_keeps_its_shards_until_removed_but_gets_no_new_ones() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    for s in 0..4 {
        let region = if s % 2 == 0 { r("a") } else { r("b") };
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: s.to_string(), region }), now, 1);
    }
    let on_b: Vec<ShardId> =
        (0..4).map(|s| s.to_string()).filter(|s| c.state().home(s).is_some_and(|(h, _)| *h == r("b"))).collect();
    assert!(!on_b.is_empty(), "least-shard spreads over both");
    let mut view = c.members.clone();
    view.statuses.insert(r("b"), MemberStatus::Down);
    step(&mut c, CoordinatorInput::Members(view), now, 2);
    for s in &on_b {
        assert_eq!(c.state().home(s).map(|(h, _)| h.clone()), Some(r("b")), "kept during the margin");
    }
    for s in 10..14 {
        step(&mut c, from_region(ToCoordinator::GetShardHome { shard: s.to_string(), region: r("b") }), now, 3);
        assert_eq!(c.state().home(&s.to_string()).map(|(h, _)| h.clone()), Some(r("a")), "shard {s}");
    }
    let sent = terminate(&mut c, r("b"), now, 4);
    for s in &on_b {
        assert_eq!(c.state().home(s), None, "deallocated once removed: {sent:?}");
    }
}

#[test]
fn a_late_begin_hand_off_ack_of_an_earlier_hand_off_does_not_release_the_next_one() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    get_home(&mut c, "1", "a", now, 1);
    step(&mut c, from_region(ToCoordinator::ShardStarted { shard: "1".into(), region: r("a") }), now, 1);
    reg(&mut c, "b", now);
    step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: r("a") }), now, 2);
    let current = c.handoffs["1"].id;
    // Acks that name another hand-off of the same shard (a delayed one from an earlier round,
    // or a forger's) are not counted.
    for who in ["a", "b"] {
        let late = ToCoordinator::BeginHandOffAck { shard: "1".into(), region: r(who), handoff: current - 1 };
        let sent = step(&mut c, from_region(late), now, 2);
        assert!(sent.is_empty(), "a stale ack released the hand-off: {sent:?}");
    }
    ack(&mut c, "1", r("a"), now, 2);
    let sent = ack(&mut c, "1", r("b"), now, 2);
    assert!(
        sent.iter()
            .any(|(to, m)| *to == r("a") && matches!(m, ToRegion::HandOff { handoff, .. } if *handoff == current))
    );
}

#[test]
fn unanswered_hand_off_messages_are_sent_again_after_the_shard_start_timeout() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    get_home(&mut c, "1", "a", now, 1);
    step(&mut c, from_region(ToCoordinator::ShardStarted { shard: "1".into(), region: r("a") }), now, 1);
    reg(&mut c, "b", now);
    let sent = step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: r("a") }), now, 2);
    assert!(sent.iter().any(|(to, m)| *to == r("b") && matches!(m, ToRegion::BeginHandOff { .. })));
    // b's ack is lost; a acks.
    ack(&mut c, "1", r("a"), now, 2);
    let early = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(1), 2);
    assert!(early.is_empty(), "not before the shard start timeout: {early:?}");
    let again = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(2), 2);
    let id = c.handoffs["1"].id;
    assert_eq!(
        again,
        vec![(r("b"), ToRegion::BeginHandOff { shard: "1".into(), handoff: id })],
        "only to the region that did not ack, with the same hand-off id"
    );
    let sent = ack(&mut c, "1", r("b"), now, 2);
    let Some(ToRegion::HandOff { handoff, .. }) =
        sent.iter().map(|(_, m)| m.clone()).find(|m| matches!(m, ToRegion::HandOff { .. }))
    else {
        panic!("HandOff after every ack: {sent:?}")
    };
    // The HandOff is lost too: sent again with the same id.
    let again = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(4), 2);
    assert_eq!(again, vec![(r("a"), ToRegion::HandOff { shard: "1".into(), handoff })]);
}

mod state_and_timers;

mod queries;

mod rolling_update;

/// A view in which `region`'s member is Leaving (the others keep their status).
fn leaving(c: &CoordinatorCore, region: &str) -> CoordinatorInput {
    let mut view = c.members.clone();
    view.statuses.insert(r(region), MemberStatus::Leaving);
    CoordinatorInput::Members(view)
}

#[test]
fn a_leaving_members_shards_are_handed_off_without_its_request_including_one_it_never_acknowledged() {
    let (mut c, now, on_a) = regions_a_b_with_six_shards();
    assert!(!on_a.is_empty());
    // a never answered a HostShard (a shutting-down region ignores them): it is handed off too.
    assert!(on_a.iter().any(|s| c.unacked_host.contains_key(s)), "the test needs an unacknowledged home");
    let view = leaving(&c, "a");
    let sent = step(&mut c, view.clone(), now, 1);
    assert_eq!(begun_shards(&sent), on_a, "every shard of the Leaving member, and only those");
    let again = step(&mut c, view, now, 1);
    assert!(begun_shards(&again).is_empty(), "a hand-off in progress is not begun twice");
    hand_off_from_a(&mut c, &on_a, now);
    assert!(c.state().shards().values().all(|rec| rec.region == Some(r("b"))), "no shard stays on a, none goes back");
}

#[test]
fn a_repeated_shutdown_request_resends_only_the_hand_off_messages_the_region_left_unanswered_for_a_second() {
    let (mut c, now, home) = regions_a_b_with_shard_1();
    let other = if home == r("a") { r("b") } else { r("a") };
    let request = || from_region(ToCoordinator::GracefulShutdownReq { region: home.clone() });
    let sent = step(&mut c, request(), now, 1);
    assert_eq!(begun_shards(&sent), BTreeSet::from(["1".to_string()]));
    // The home's BeginHandOff was lost; the other region acked.
    ack(&mut c, "1", other.clone(), now, 1);
    // A region that answered gets nothing again, even when it asks to shut down too.
    let other_request = from_region(ToCoordinator::GracefulShutdownReq { region: other.clone() });
    let to_other = step(&mut c, other_request.clone(), now + Duration::from_secs(1), 1);
    assert!(to_other.is_empty(), "the other region acked already: {to_other:?}");
    let soon = step(&mut c, request(), now + Duration::from_millis(999), 1);
    assert!(soon.is_empty(), "less than a second old: maybe still on its way: {soon:?}");
    let later = step(&mut c, request(), now + RESEND_ON_REQUEST_AFTER, 1);
    assert_eq!(later.len(), 1, "{later:?}");
    assert!(matches!(&later[0], (to, ToRegion::BeginHandOff { shard, .. }) if *to == home && shard == "1"));
    // That re-send does not put off the periodic one (shard_start_timeout after the start),
    // which every region still pending needs (seed 170001275 waited 10 s more for one).
    let periodic = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(2), 1);
    assert!(periodic.iter().any(|(to, m)| *to == home && matches!(m, ToRegion::BeginHandOff { .. })), "{periodic:?}");
    // Once it acked, the HandOff it does not answer is what goes again.
    let sent = ack(&mut c, "1", home.clone(), now + Duration::from_secs(2), 1);
    let id = handoff_id(&sent, &home.node_id, "1").expect("HandOff sent");
    let t = now + Duration::from_secs(3);
    let to_other = step(&mut c, other_request, t, 1);
    assert!(to_other.is_empty(), "only the old home is sent the HandOff: {to_other:?}");
    let again = step(&mut c, request(), t, 1);
    assert_eq!(again, vec![(home.clone(), ToRegion::HandOff { shard: "1".into(), handoff: id })]);
}
