//! Tests of allocation during a rolling update: while the regions that take shards run
//! different application versions, new and moved shards go only to the newest and no
//! rebalance runs.

use super::*;
use crate::app_version::AppVersion;

/// `region`'s member runs `version`.
fn runs(c: &mut CoordinatorCore, region: &str, version: AppVersion) {
    let mut view = c.members.clone();
    view.versions.insert(r(region), version);
    c.handle(CoordinatorInput::Members(view), Instant::now(), 1, &mut Vec::new());
}

const V1: AppVersion = AppVersion::new(1, 0, 0);
const V2: AppVersion = AppVersion::new(2, 0, 0);

/// The region `shard` is allocated to now.
fn home_of(c: &CoordinatorCore, shard: &str) -> Option<RegionId> {
    c.state.home(shard).map(|(h, _)| h.clone())
}

#[test]
fn while_versions_are_mixed_new_shards_go_only_to_the_newest_even_when_it_holds_the_most() {
    let mut c = core(1);
    let now = Instant::now();
    for n in ["a", "b", "c"] {
        reg(&mut c, n, now);
        runs(&mut c, n, V1);
    }
    reg(&mut c, "d", now);
    runs(&mut c, "d", V2);
    for s in 0..9 {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
    }
    for s in 0..9 {
        assert_eq!(home_of(&c, &s.to_string()), Some(r("d")), "shard {s}");
    }
    // A second updated node shares the new shards with the first.
    reg(&mut c, "e", now);
    runs(&mut c, "e", V2);
    for s in 9..13 {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
        assert_eq!(home_of(&c, &s.to_string()), Some(r("e")), "shard {s}: the updated region with fewest");
    }
}

#[test]
fn a_node_that_gossips_no_version_counts_as_the_oldest() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    reg(&mut c, "b", now);
    runs(&mut c, "b", AppVersion::parse("0.0.1").unwrap());
    for s in 0..4 {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
        assert_eq!(home_of(&c, &s.to_string()), Some(r("b")));
    }
}

#[test]
fn the_shards_of_a_leaving_old_node_move_only_to_updated_nodes() {
    let mut c = core(1);
    let now = Instant::now();
    for n in ["a", "b"] {
        reg(&mut c, n, now);
        runs(&mut c, n, V1);
    }
    for s in 0..6 {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
    }
    let on_a: Vec<ShardId> = c.state.shards_of(&r("a")).to_vec();
    assert_eq!(on_a.len(), 3);
    reg(&mut c, "n", now);
    runs(&mut c, "n", V2);
    let leave = leaving(&c, "a");
    let sent = step(&mut c, leave, now, 2_000);
    assert_eq!(begun_shards(&sent), on_a.iter().cloned().collect());
    for shard in &on_a {
        for region in ["a", "b", "n"] {
            ack(&mut c, shard, r(region), now, 2_000);
        }
        let handoff = c.handoffs[shard].id;
        step(
            &mut c,
            from_region(ToCoordinator::ShardStopped { shard: shard.clone(), region: r("a"), handoff }),
            now,
            2_000,
        );
        get_home(&mut c, shard, "b", now, 2_000);
        assert_eq!(home_of(&c, shard), Some(r("n")), "{shard} moves to the updated node, not to b");
    }
}

#[test]
fn no_rebalance_runs_while_versions_are_mixed_and_the_plan_says_why() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    runs(&mut c, "a", V1);
    for s in 0..6 {
        get_home(&mut c, &s.to_string(), "a", now, 1_000);
    }
    reg(&mut c, "b", now);
    runs(&mut c, "b", V2);
    settle(&mut c);
    let plan = c.rebalance_plan("t");
    assert!(!plan.allowed && plan.moves.is_empty(), "{plan:?}");
    let why = plan.blocked_by.unwrap();
    assert!(why.contains("rolling update") && why.contains("1.0.0") && why.contains("2.0.0"), "{why}");
    let sent = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(11), 2_000);
    assert!(begun_shards(&sent).is_empty(), "no hand-off while mixed: {sent:?}");
    // Once a runs v2 too, the round moves half of its shards.
    runs(&mut c, "a", V2);
    let sent = step(&mut c, CoordinatorInput::Tick, now + Duration::from_secs(22), 3_000);
    assert_eq!(begun_shards(&sent).len(), 3, "{sent:?}");
}

#[test]
fn the_allocation_table_and_a_shards_explanation_name_each_regions_version_and_why_an_old_one_takes_none() {
    let mut c = core(1);
    let now = Instant::now();
    reg(&mut c, "a", now);
    runs(&mut c, "a", V1);
    reg(&mut c, "b", now);
    runs(&mut c, "b", V2);
    get_home(&mut c, "0", "a", now, 1_000);
    let table = c.allocation_table("t", now);
    let summary: Vec<(String, String, bool)> =
        table.regions.iter().map(|s| (s.node_id.clone(), s.app_version.clone(), s.takes_new_shards)).collect();
    assert_eq!(summary, [("a".to_string(), "1.0.0".to_string(), false), ("b".to_string(), "2.0.0".to_string(), true)]);
    let explained = c.explain("t", "0", now).unwrap();
    let a = explained.regions.iter().find(|v| v.region == r("a").to_string()).unwrap();
    assert!(!a.eligible);
    let why = a.not_eligible_because.as_deref().unwrap();
    assert!(why.contains("runs 1.0.0") && why.contains("2.0.0"), "{why}");
    assert!(explained.regions.iter().any(|v| v.region == r("b").to_string() && v.eligible));
    assert_eq!(explained.if_allocated_now.map(|c| c.region), Some(r("b").to_string()));
}
