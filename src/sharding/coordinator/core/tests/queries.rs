//! Tests of the coordinator's answers to operators: the allocation table, the explanation of a
//! shard, and the rebalance plan against the round that follows it.

use super::*;

/// `n` shards all on `a` (started), then `b` registered and the cluster settled: a round has
/// work to do.
fn all_on_a_then_b(n: usize) -> (CoordinatorCore, Instant) {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    for s in 0..n {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
        step(&mut c, from_region(ToCoordinator::ShardStarted { shard: s.to_string(), region: r("a") }), now, 1_000);
    }
    reg(&mut c, "b", now);
    settle(&mut c);
    (c, now)
}

/// Completes every hand-off in progress (acks from every region, then the old home's
/// `ShardStopped`), in shard order.
fn finish_all_hand_offs(c: &mut CoordinatorCore, now: Instant, wall: u64) {
    let shards: Vec<ShardId> = c.handoffs.keys().cloned().collect();
    for shard in shards {
        let regions: Vec<RegionId> = c.all_regions().cloned().collect();
        for region in regions {
            ack(c, &shard, region, now, wall);
        }
        let (from, handoff) = {
            let h = &c.handoffs[&shard];
            (h.from.clone(), h.id)
        };
        step(c, from_region(ToCoordinator::ShardStopped { shard: shard.clone(), region: from, handoff }), now, wall);
    }
}

#[test]
fn a_dry_run_names_the_hand_offs_the_next_round_starts_and_where_each_shard_lands() {
    let (mut c, now) = all_on_a_then_b(6);
    let plan = c.rebalance_plan("t");
    assert!(plan.allowed && plan.blocked_by.is_none(), "{plan:?}");
    assert!(!plan.executed);
    assert_eq!(plan.moves.len(), 3, "six shards on two regions: three move: {plan:?}");
    assert!(plan.moves.iter().all(|m| m.from == r("a").to_string() && m.expected_to == r("b").to_string()));
    assert!(plan.moves.iter().all(|m| m.reason.contains("6 shards")), "{plan:?}");
    assert_eq!(c.rebalance_plan("t"), plan, "a dry run changes nothing");
    assert!(c.handoffs.is_empty(), "a dry run starts no hand-off");
    assert_eq!(c.shards_rebalanced(), 0, "nor counts one");

    let sent = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(10), 2_000);
    let planned: BTreeSet<ShardId> = plan.moves.iter().map(|m| m.shard.clone()).collect();
    assert_eq!(begun_shards(&sent), planned, "the round starts exactly the planned hand-offs");
    assert_eq!(c.shards_rebalanced(), 3);
    finish_all_hand_offs(&mut c, now + Duration::from_secs(10), 2_000);
    for m in &plan.moves {
        let home = c.state.home(&m.shard).map(|(h, _)| h.to_string());
        assert_eq!(home.as_deref(), Some(m.expected_to.as_str()), "{} landed where the plan said", m.shard);
    }
    let after = c.rebalance_plan("t");
    assert!(after.moves.is_empty(), "balanced: nothing more to move: {after:?}");
}

#[test]
fn a_rebalance_on_request_starts_the_planned_hand_offs_and_reports_them() {
    let (mut c, now) = all_on_a_then_b(4);
    let plan = c.rebalance_plan("t");
    let mut out = Vec::new();
    c.handle(CoordinatorInput::RebalanceNow, now, 2_000, &mut out);
    let round = c.take_requested_round().expect("a round ran");
    assert_eq!(round, Ok(plan.moves.clone()));
    assert_eq!(c.take_requested_round(), None, "taken once");
    let started: BTreeSet<ShardId> = c.handoffs.keys().cloned().collect();
    assert_eq!(started, plan.moves.iter().map(|m| m.shard.clone()).collect());
    assert_eq!(c.shards_rebalanced(), 2, "counted for the metrics");
    // In progress now: a second request starts nothing new and names them.
    let again = c.rebalance_plan("t");
    assert!(again.moves.is_empty(), "{again:?}");
    assert_eq!(again.in_progress.len(), 2);
}

#[test]
fn a_blocked_rebalance_says_why_and_moves_nothing() {
    // One region: nowhere to move to.
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    get_home(&mut c, "1", "a", now, 1);
    settle(&mut c);
    let plan = c.rebalance_plan("t");
    assert!(!plan.allowed);
    assert!(plan.blocked_by.as_deref().is_some_and(|w| w.contains("needs two")), "{plan:?}");

    // Not settled.
    let (mut c, now) = all_on_a_then_b(4);
    let mut view = c.members.clone();
    view.settled = false;
    c.handle(CoordinatorInput::Members(view), now, 1, &mut Vec::new());
    let plan = c.rebalance_plan("t");
    assert!(plan.blocked_by.as_deref().is_some_and(|w| w.contains("not settled")), "{plan:?}");
    assert!(plan.moves.is_empty());
    let mut out = Vec::new();
    c.handle(CoordinatorInput::RebalanceNow, now, 2, &mut out);
    assert!(c.take_requested_round().expect("ran").is_err());
    assert!(c.handoffs.is_empty(), "a blocked request starts nothing");

    // A region handing off everything.
    let (mut c, now) = all_on_a_then_b(4);
    reg(&mut c, "x", now);
    step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: r("x") }), now, 2);
    let plan = c.rebalance_plan("t");
    assert!(plan.blocked_by.as_deref().is_some_and(|w| w.contains(&r("x").to_string())), "{plan:?}");
}

#[test]
fn the_allocation_table_lists_regions_proxies_homes_epochs_and_hand_offs_in_progress() {
    let (mut c, now) = all_on_a_then_b(4);
    step(&mut c, register(r("p"), true, 7), now, 1);
    c.handle(CoordinatorInput::RebalanceNow, now, 2_000, &mut Vec::new());
    let table = c.allocation_table("t", now);
    assert_eq!(table.type_name, "t");
    assert_eq!(table.coordinator, r("c").to_string());
    assert_eq!(table.proxies, vec![r("p").to_string()]);
    let a = table.regions.iter().find(|x| x.region == r("a").to_string()).expect("a listed");
    assert_eq!((a.shards, a.node_id.as_str(), a.member_status.as_deref()), (4, "a", Some("up")));
    assert!(a.takes_new_shards && !a.shutting_down);
    assert_eq!(table.shards.len(), 4);
    for s in &table.shards {
        let rec = c.state.record(&s.shard).expect("recorded");
        assert_eq!(s.epoch, rec.epoch);
        assert_eq!(s.region, rec.region.as_ref().map(ToString::to_string));
        assert_eq!(s.hand_off.is_some(), c.handoffs.contains_key(&s.shard), "{s:?}");
    }
    let moving = table.shards.iter().find_map(|s| s.hand_off.clone()).expect("a hand-off in progress");
    assert_eq!(moving.phase, "waiting-for-acks");
    assert_eq!(moving.waiting_for.len(), 3, "a, b and the proxy must stop routing to it: {moving:?}");
    assert_eq!(moving.deadline_in_ms, 5_000, "the whole hand-off timeout is left");
    assert!(table.rebalance.allowed);
    // The core was made a moment before `now`, with its first round an interval after that.
    assert!((9_000..=10_000).contains(&table.rebalance.next_round_in_ms), "{:?}", table.rebalance);
}

#[test]
fn the_explanation_lists_every_region_with_why_it_cannot_take_the_shard() {
    let (mut c, now) = all_on_a_then_b(2);
    step(&mut c, register(r("p"), true, 7), now, 1);
    reg(&mut c, "l", now);
    let mut view = c.members.clone();
    view.statuses.insert(r("l"), MemberStatus::Leaving);
    c.handle(CoordinatorInput::Members(view), now, 1, &mut Vec::new());
    let e = c.explain("t", "0", now).expect("an allowed shard id");
    assert_eq!(e.home, Some(r("a").to_string()));
    let verdict = |n: &str| e.regions.iter().find(|v| v.region == r(n).to_string()).expect("listed").clone();
    assert!(verdict("a").eligible && verdict("b").eligible);
    assert!(verdict("p").not_eligible_because.as_deref().is_some_and(|w| w.contains("proxy")));
    assert!(verdict("l").not_eligible_because.as_deref().is_some_and(|w| w.contains("leaving")), "{e:?}");
    assert!(!verdict("l").eligible);
    // Were it new now, the strategy would put it on b (a holds the other shard).
    let choice = e.if_allocated_now.expect("regions take shards");
    assert_eq!(choice.region, r("b").to_string());
    assert!(choice.reason.contains("fewest shards (0)"), "{choice:?}");
    // Its allocation is in its history with who asked.
    assert_eq!(e.history.len(), 1);
    assert_eq!(e.history[0].kind, "allocated");
    assert!(e.history[0].reason.contains(&format!("requested by region {}", r("a"))), "{:?}", e.history);
}

#[test]
fn the_explanation_says_whether_the_next_round_moves_the_shard() {
    let (c, now) = all_on_a_then_b(4);
    let plan = c.rebalance_plan("t");
    for s in 0..4 {
        let e = c.explain("t", &s.to_string(), now).expect("explained");
        let planned = plan.moves.iter().find(|m| m.shard == s.to_string()).cloned();
        assert_eq!(e.next_rebalance, planned, "shard {s}");
    }
}

#[test]
fn a_shards_history_records_its_hand_off_its_new_home_and_its_loss() {
    let (mut c, now) = all_on_a_then_b(2);
    c.handle(CoordinatorInput::RebalanceNow, now, 2_000, &mut Vec::new());
    let moved: ShardId = c.handoffs.keys().next().cloned().expect("one moves");
    finish_all_hand_offs(&mut c, now, 3_000);
    terminate(&mut c, r("b"), now, 4_000);
    let e = c.explain("t", &moved, now).expect("explained");
    let kinds: Vec<&str> = e.history.iter().map(|h| h.kind.as_str()).collect();
    assert_eq!(kinds, ["allocated", "hand-off-started", "hand-off-done", "allocated", "home-lost"], "{e:?}");
    assert!(e.history[1].reason.starts_with("rebalance: "), "{:?}", e.history[1]);
    assert!(e.history[3].reason.contains("after its hand-off from"), "{:?}", e.history[3]);
    assert_eq!(e.history[3].region, r("b").to_string());
    assert_eq!(e.history[4].region, r("b").to_string());
    let times: Vec<u64> = e.history.iter().map(|h| h.at_ms).collect();
    assert_eq!(times, [1_000, 2_000, 3_000, 3_000, 4_000]);
    assert!(e.history[3].epoch >= 3_000, "an allocation's epoch follows the wall clock");
    assert_eq!(e.home, None, "lost with its region");
}

#[test]
fn a_shards_history_keeps_its_latest_events_only() {
    let (mut c, now) = all_on_a_then_b(1);
    for round in 0..20u64 {
        let region = c.state.home("0").map(|(h, _)| h.clone()).expect("a home");
        c.handle(
            CoordinatorInput::FromRegion {
                from: region.clone(),
                msg: ToCoordinator::GracefulShutdownReq { region: region.clone() },
            },
            now,
            10_000 + round,
            &mut Vec::new(),
        );
        // The region comes back at once (a restart that kept its address, for the test).
        c.shutting_down.clear();
        finish_all_hand_offs(&mut c, now, 10_000 + round);
    }
    let e = c.explain("t", "0", now).expect("explained");
    assert_eq!(e.history.len(), HISTORY_PER_SHARD);
    assert_eq!(e.history.last().map(|h| h.at_ms), Some(10_019), "the newest kept");
}

#[test]
fn a_shard_id_the_extractor_cannot_produce_has_no_explanation() {
    let mut c = core_from(
        CoordinatorSettings { shard_ids: ShardIdRule::Numbered(10), ..test_settings(1) },
        least_shard(),
        CoordinatorState::default(),
    );
    let now = Instant::now();
    reg(&mut c, "a", now);
    assert!(c.explain("t", "10", now).is_none());
    assert!(c.explain("t", "x", now).is_none());
    let never = c.explain("t", "9", now).expect("a possible shard");
    assert_eq!((never.home, never.epoch, never.history.len()), (None, 0, 0));
}

#[test]
fn a_plan_over_three_regions_spreads_its_moves_as_the_rounds_hand_offs_then_do() {
    let (mut c, now) = all_on_a_then_b(6);
    reg(&mut c, "c", now);
    settle(&mut c);
    let plan = c.rebalance_plan("t");
    let targets: BTreeSet<&str> = plan.moves.iter().map(|m| m.expected_to.as_str()).collect();
    assert_eq!(targets.len(), 2, "the plan counts each move's new home: both b and c take shards: {plan:?}");
    c.handle(CoordinatorInput::RebalanceNow, now, 2_000, &mut Vec::new());
    finish_all_hand_offs(&mut c, now, 3_000);
    for m in &plan.moves {
        let home = c.state.home(&m.shard).map(|(h, _)| h.to_string());
        assert_eq!(home.as_deref(), Some(m.expected_to.as_str()), "{} landed where the plan said", m.shard);
    }
}

#[test]
fn a_region_shutting_down_is_listed_as_taking_no_new_shards_though_its_member_is_up() {
    let (mut c, now) = all_on_a_then_b(2);
    step(&mut c, from_region(ToCoordinator::GracefulShutdownReq { region: r("b") }), now, 1_000);
    let table = c.allocation_table("t", now);
    let b = table.regions.iter().find(|x| x.region == r("b").to_string()).expect("b listed");
    assert_eq!(b.member_status.as_deref(), Some("up"), "its node is still up");
    assert!(b.shutting_down && !b.takes_new_shards, "{b:?}");
    let a = table.regions.iter().find(|x| x.region == r("a").to_string()).expect("a listed");
    assert!(!a.shutting_down && a.takes_new_shards, "{a:?}");
}

#[test]
fn the_choice_were_the_shard_new_now_counts_its_home_without_it() {
    // Shard 0 alone on a, nothing on b: without shard 0, a and b hold none each, and the tie
    // goes to the lowest address, a (counted with it, a would hold one and b would win).
    let (c, now) = all_on_a_then_b(1);
    let e = c.explain("t", "0", now).expect("explained");
    let choice = e.if_allocated_now.expect("regions take shards");
    assert_eq!(choice.region, r("a").to_string(), "{choice:?}");
    assert!(choice.reason.contains("fewest shards (0)"), "{choice:?}");
}

/// Moves shard "1" wherever it is; allocates to the least loaded region, ties to the lowest id.
struct MovesShardOneToTheLeastLoaded;
impl ShardAllocationStrategy for MovesShardOneToTheLeastLoaded {
    fn allocate(&self, _: &RegionId, _: &ShardId, regions: &[RegionAllocation]) -> RegionId {
        regions.iter().min_by_key(|r| (r.shards.len(), r.region.clone())).expect("candidates").region.clone()
    }
    fn rebalance(&self, regions: &[RegionAllocation], _: &BTreeSet<ShardId>) -> BTreeSet<ShardId> {
        regions.iter().flat_map(|r| r.shards.iter()).filter(|s| s.as_str() == "1").cloned().collect()
    }
}

#[test]
fn a_planned_move_counts_its_old_home_without_the_shard_so_the_plan_names_where_it_lands() {
    let mut c = core_from(test_settings(1), Arc::new(MovesShardOneToTheLeastLoaded), CoordinatorState::default());
    let now = Instant::now();
    reg(&mut c, "a", now);
    for s in ["1", "2"] {
        get_home(&mut c, s, "a", now, 1_000);
        step(&mut c, from_region(ToCoordinator::ShardStarted { shard: s.into(), region: r("a") }), now, 1_000);
    }
    reg(&mut c, "b", now);
    get_home(&mut c, "3", "b", now, 1_000);
    step(&mut c, from_region(ToCoordinator::ShardStarted { shard: "3".into(), region: r("b") }), now, 1_000);
    assert_eq!(c.state.home("3").map(|(h, _)| h.clone()), Some(r("b")));
    settle(&mut c);
    // Without shard 1, a holds one shard as b does, and the tie goes to a: its old home.
    let plan = c.rebalance_plan("t");
    assert_eq!(plan.moves.len(), 1, "{plan:?}");
    assert_eq!(
        (plan.moves[0].from.as_str(), plan.moves[0].expected_to.as_str()),
        (r("a").to_string().as_str(), r("a").to_string().as_str())
    );
    c.handle(CoordinatorInput::RebalanceNow, now, 2_000, &mut Vec::new());
    finish_all_hand_offs(&mut c, now, 3_000);
    assert_eq!(c.state.home("1").map(|(h, _)| h.clone()), Some(r("a")), "shard 1 landed where the plan said");
}
