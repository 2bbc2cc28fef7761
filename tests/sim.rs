//! The deterministic simulation of the sharding cores (`ddshard::testkit::sim`): seeded runs
//! with crashes, restarts, partitions and dropped messages, checked for at most one live
//! activation per entity, every ask ending, full service after recovery and (with
//! remember-entities) no acknowledged remembered id lost, (with durable state) no acknowledged
//! write lost and none accepted from a fenced epoch; and the same seed giving the same
//! trace byte for byte.
//!
//! Replay one seed with its trace: `DDSHARD_SIM_SEED=42 cargo test --test sim replay -- --nocapture`
//! (add `DDSHARD_SIM_REMEMBER=1` for a remember-entities seed, `DDSHARD_SIM_DURABLE=1` for a
//! durable-state seed, or `DDSHARD_SIM_SHAPE=<name>` for one of `ddshard::testkit::sim::shapes`).
//!
//! The soak runs every shape on all cores, on seeds the other tests never use:
//! `DDSHARD_SIM_SOAK_RUNS=1000000 cargo test --release --test sim soak -- --nocapture`
//! (`DDSHARD_SIM_SOAK_FROM` moves the seed range; see TESTING.md).

use ddshard::ShardingSettings;
use ddshard::testkit::sim::{SimConfig, run_seed};

fn check(seed: u64, cfg: &SimConfig) -> ddshard::testkit::sim::SimReport {
    let report = run_seed(seed, cfg);
    assert!(
        report.violations.is_empty(),
        "seed {seed}: {} violations, first: {:?}\nreplay: DDSHARD_SIM_SEED={seed} DDSHARD_SIM_REMEMBER={} DDSHARD_SIM_DURABLE={} DDSHARD_SIM_MESSAGE_PATH={} cargo test --test sim replay -- --nocapture",
        report.violations.len(),
        &report.violations[..report.violations.len().min(5)],
        u8::from(cfg.remember),
        u8::from(cfg.durable),
        u8::from(cfg.message_path),
    );
    report
}

/// Runs `seeds` seeds of `cfg` on two threads (CI has two cores; each seed is still one
/// deterministic run), each checked; returns the reports and the failures summed by kind.
fn run_seeds(
    seeds: u64,
    cfg: &SimConfig,
) -> (Vec<ddshard::testkit::sim::SimReport>, std::collections::BTreeMap<&'static str, usize>) {
    let reports: Vec<ddshard::testkit::sim::SimReport> = std::thread::scope(|s| {
        let halves: Vec<_> = (0..2u64)
            .map(|t| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    (0..seeds).filter(|seed| seed % 2 == t).map(|seed| check(seed, &cfg)).collect::<Vec<_>>()
                })
            })
            .collect();
        halves.into_iter().flat_map(|h| h.join().expect("a seed failed")).collect()
    });
    let mut failed = std::collections::BTreeMap::new();
    for r in &reports {
        for (k, v) in &r.failed {
            *failed.entry(*k).or_insert(0) += v;
        }
    }
    (reports, failed)
}

#[test]
fn the_same_seed_gives_the_same_trace_byte_for_byte() {
    let cfg = SimConfig::default();
    let a = run_seed(7, &cfg);
    let b = run_seed(7, &cfg);
    assert!(a.trace.len() > 100, "a run with traffic and faults traces a lot: {}", a.trace.len());
    assert_eq!(a.trace, b.trace);
    let c = run_seed(8, &cfg);
    assert_ne!(a.trace, c.trace, "another seed, another interleaving");
}

#[test]
fn a_quiet_cluster_answers_every_ask() {
    let cfg = SimConfig { faults: false, drop_per_mille: 0, ..SimConfig::default() };
    let report = check(1, &cfg);
    assert!(report.failed.is_empty(), "no faults, no failures: {:?}", report.failed);
    assert!(report.answered > 100, "answered {}", report.answered);
}

#[test]
fn random_faults_never_run_an_entity_twice_and_service_recovers() {
    let seeds: u64 = std::env::var("DDSHARD_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let cfg = SimConfig { trace: false, ..SimConfig::default() };
    let started = std::time::Instant::now();
    let (reports, failed) = run_seeds(seeds, &cfg);
    let answered: usize = reports.iter().map(|r| r.answered).sum();
    let activations: usize = reports.iter().map(|r| r.activations).sum();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{seeds} seeds in {secs:.1}s ({:.0} seeds/s): {answered} asks answered, {activations} activations, failed: {failed:?}",
        seeds as f64 / secs
    );
    assert!(answered > seeds as usize * 100, "service under faults: {answered} answers over {seeds} seeds");
    let explained = ["AskTimeout", "NotDelivered(region gone)", "NotDelivered(hand-off)", "NotDelivered(not hosted)"];
    for kind in failed.keys() {
        assert!(explained.contains(kind), "a failure the faults cannot explain: {kind} ({failed:?})");
    }
}

#[test]
fn random_faults_with_remembered_entities_never_lose_an_acknowledged_id() {
    let seeds: u64 = std::env::var("DDSHARD_SIM_REMEMBER_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let cfg = SimConfig { trace: false, remember: true, ..SimConfig::default() };
    let started = std::time::Instant::now();
    let (reports, failed) = run_seeds(seeds, &cfg);
    let acked: usize = reports.iter().map(|r| r.remembered_acked).sum();
    let answered: usize = reports.iter().map(|r| r.answered).sum();
    println!(
        "{seeds} remember seeds in {:.1}s: {acked} acknowledged remembered ids checked, {answered} answers, failed: {failed:?}",
        started.elapsed().as_secs_f64()
    );
    // Every seed asks all 30 entities by the end, so nearly all their starts are acknowledged
    // (a few writes reach a majority whose answer is lost in a crash: stored, not counted).
    assert!(acked >= seeds as usize * 30 * 98 / 100, "acknowledged remembered ids checked: {acked}");
    assert!(reports.iter().all(|r| r.remembered_acked > 0), "every seed checks some");
    assert!(answered > seeds as usize * 100, "service under faults: {answered} answers over {seeds} seeds");
    let explained = [
        "AskTimeout",
        "NotDelivered(region gone)",
        "NotDelivered(hand-off)",
        "NotDelivered(not hosted)",
        "NotDelivered(shard failed)",
    ];
    for kind in failed.keys() {
        assert!(explained.contains(kind), "a failure the faults cannot explain: {kind} ({failed:?})");
    }
}

#[test]
fn random_faults_with_durable_state_never_lose_an_acknowledged_write_nor_accept_a_fenced_one() {
    let seeds: u64 = std::env::var("DDSHARD_SIM_DURABLE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    for remember in [false, true] {
        let cfg = SimConfig { trace: false, durable: true, remember, ..SimConfig::default() };
        let started = std::time::Instant::now();
        let seeds = if remember { seeds / 3 } else { seeds };
        let (reports, failed) = run_seeds(seeds, &cfg);
        let acked: usize = reports.iter().map(|r| r.states_acked).sum();
        let answered: usize = reports.iter().map(|r| r.answered).sum();
        let zombies: usize = reports.iter().map(|r| r.zombie_overlaps).sum();
        let fenced_coordinators: usize = reports.iter().map(|r| r.coordinators_fenced).sum();
        println!(
            "{seeds} durable seeds (remember {remember}) in {:.1}s: {acked} acknowledged state writes checked, {answered} answers, {zombies} activations beside a paused zombie, {fenced_coordinators} zombie coordinators fenced, failed: {failed:?}",
            started.elapsed().as_secs_f64()
        );
        // Pauses long enough for the peers to down the node leave zombies that resume and try
        // to write: replicas that downed them drop their messages, and any that had not yet
        // would refuse their writes by the fence (the checks above prove nothing they wrote
        // was acknowledged).
        assert!(zombies > 0, "the runs paused nodes past their downing");
        let quarantined: u64 = reports.iter().map(|r| r.quarantined_messages).sum();
        if seeds >= 100 {
            assert!(
                quarantined > 0 || failed.contains_key("Fenced"),
                "a zombie's writes were dropped or fenced: {quarantined} quarantined, {failed:?}"
            );
        }
        // Every answer is an acknowledged write (a few more are acknowledged after their
        // asker gave up).
        assert!(acked >= answered, "{acked} acknowledged writes for {answered} answers");
        assert!(answered > seeds as usize * 100, "service under faults: {answered} answers over {seeds} seeds");
        let explained = [
            "AskTimeout",
            "NotDelivered(region gone)",
            "NotDelivered(hand-off)",
            "NotDelivered(not hosted)",
            "NotDelivered(shard failed)",
            "Fenced",
            "StateNotPersisted",
        ];
        for kind in failed.keys() {
            assert!(explained.contains(kind), "a failure the faults cannot explain: {kind} ({failed:?})");
        }
    }
}

/// Seeds where a claim at a majority plus one (not every reachable replica) misses a value a
/// reachable replica held: the state an entity starts from is older than an acknowledged
/// write. Found with `Consistency::Majority` in the claim (seed 2 first, then 246 and 807 of
/// 1,000); they pass only while claims read every reachable replica.
#[test]
fn a_claim_reads_every_reachable_replica_so_no_acknowledged_state_is_missed_after_peers_return_with_old_disks() {
    for seed in [246, 807] {
        let report = check(seed, &SimConfig { remember: true, durable: true, ..SimConfig::default() });
        assert!(report.states_acked > 100, "seed {seed}: the scenario writes state");
    }
}

/// A stop-the-world pause of the coordinator's node, long enough for its peers to down it and
/// start a new coordinator: on resume the old coordinator answers the requests it missed and
/// allocates, but its write is never acknowledged — replicas that downed its node drop it
/// (quarantine), any that had not heard yet refuse it by the newer coordinator term (it stops at
/// once) — so nobody acts on its allocation (before terms, seeds 13, 53 and 922 started a shard
/// twice this way).
#[test]
fn a_zombie_coordinator_resuming_after_a_pause_is_fenced_by_the_newer_term_and_stops() {
    use ddshard::testkit::sim::Sim;
    // More shards than the workload's entities: some shards are still unallocated when n1
    // pauses.
    let cfg = SimConfig { faults: false, durable: true, drop_per_mille: 0, shards: 64, ..SimConfig::default() };
    let mut sim = Sim::new(922, cfg);
    sim.run_until(2_000);
    // n1 is the oldest member: it hosts the coordinator.
    sim.pause_node(0, 4_850);
    // New ids meanwhile: n2 asks n1, still the coordinator in its view, where their shards
    // go, and those requests wait for n1 to resume.
    sim.run_until(2_100);
    let late: Vec<u64> = (0..20).map(|e| sim.ask_through(1, &format!("late{e}"))).collect();
    sim.run_until(20_000);
    let report = sim.report();
    let starts: Vec<&String> = report.trace.iter().filter(|l| l.contains("coordinator starts")).collect();
    assert!(starts.len() >= 2 && starts[1].contains("n2#1"), "n2 took over during the pause: {starts:?}");
    // Its writes reach replicas that downed n1#1 (they drop them: no acknowledgement) or, had
    // they not heard of the downing yet, that the newer term fenced (it stops at once).
    assert!(
        sim.quarantined_messages() > 0 || report.coordinators_fenced >= 1,
        "the zombie coordinator's writes were dropped or fenced"
    );
    if let Some(fenced) = report.trace.iter().position(|l| l.contains("n1#1 coordinator write fenced")) {
        assert!(report.trace[fenced + 1].contains("n1#1 coordinator stops"), "it stops at once");
    }
    // Its allocations were held until a durable write, so none reached a region.
    let resumed_at = report.trace.iter().position(|l| l.contains("n1 pauses")).expect("paused");
    let zombie_answers: Vec<&String> =
        report.trace[resumed_at..].iter().filter(|l| l.contains("n1#1 -> n2#1 ShardHome")).collect();
    assert!(zombie_answers.is_empty(), "the zombie answered: {zombie_answers:?}");
    assert!(late.iter().all(|a| sim.answered(*a)), "the new coordinator placed every new id");
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

/// Found by a 1,000-seed run: a remembering shard whose load failed waited out its backoff
/// while the coordinator handed it off; the hand-off reached no running shard and was never
/// answered, the shard restarted anyway, and its entities stayed unreachable for good. (Seed
/// 502 showed it first; since forwarded messages are no longer sent on a second hop, seed
/// 2076 is the one whose shard gets its hand-off within the backoff.)
#[test]
fn a_failed_shard_asked_to_hand_off_during_its_backoff_answers_and_stays_stopped() {
    // Seed 2041 (shard 7 on n1) since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42).
    let report = check(2041, &SimConfig { remember: true, ..SimConfig::default() });
    let handoff = report.trace.iter().position(|l| l.contains("-> n1#1 HandOff { shard: \"7\""));
    let handoff = handoff.expect("the scenario: n1 is asked to hand shard 7 off");
    let failed =
        report.trace[..handoff].iter().rposition(|l| l.contains("n1#1 shard 7 failed; restarts after the backoff"));
    let failed = failed.expect("the scenario: shard 7 failed on n1 before");
    let millis = |l: &str| l.split_whitespace().next().and_then(|t| t.parse::<u64>().ok()).expect("a time");
    let backoff = ShardingSettings::default().shard_failure_backoff.as_millis() as u64;
    assert!(millis(&report.trace[handoff]) - millis(&report.trace[failed]) < backoff, "within the backoff");
}

// The seeds of issue 38 each failed on the code before their fix. A fix changes the run from
// its first changed decision on (the random stream is shared), so a seed's later scenario may
// not recur after it; the scripted tests below and the cores' own tests hold each scenario.

/// Seed 11001335 (issue 38): n4 paused for 3.5 s; its peers downed it and the coordinator
/// moved its shard 9 to n3. A partition then put n4 with n2 and n5, who still listed it as a
/// downed member; when n4 woke, they merged and acknowledged its queued writes — a majority of
/// five — and then downed themselves (minority), so n3's claim read only n1 and n3 and missed
/// them. The fault was in a production core: the replicator acknowledged writes from an
/// incarnation its own view had downed (the transport refuses one only once it is removed).
/// Replicas now quarantine every incarnation that left good standing.
#[test]
fn replicas_never_acknowledge_the_writes_of_a_paused_home_they_have_downed() {
    // Seed 11001349 since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42); the quarantine itself is held by the replicator core's tests.
    let report = check(11001349, &shape("message-path-durable-remember"));
    assert!(report.states_acked > 100, "the scenario writes state");
    assert!(report.trace.iter().any(|l| l.contains("n4 pauses")), "the scenario pauses n4");
}

/// Seed 24005053 (issue 38): n4 wrote e18's value 4 at 7122 ms and paused 6 ms later, before
/// the replicas' acknowledgements reached it; down-all-when-unstable then downed every other
/// member, and n5#2, alone, claimed the shard. When n4 woke at 10116 ms it handled the
/// acknowledgements and answered the ask: a write acknowledged after a newer claim had
/// completed without it. The fault was in a production core: an answer handled after the
/// operation's deadline still completed it. No operation completes past its deadline now (an
/// answer is handled only after the expired ones failed).
#[test]
fn a_write_whose_acknowledgements_are_handled_after_a_pause_past_its_deadline_is_not_acknowledged() {
    let report = check(24005053, &shape("message-path-durable-remember"));
    assert!(report.states_acked > 100, "the scenario writes state");
}

/// A named shape of `ddshard::testkit::sim::shapes`.
fn shape(name: &str) -> SimConfig {
    ddshard::testkit::sim::shape(name).expect("a shape")
}

/// Seed 25000037 (issue 38): n2 left while a partition cut it off from the coordinator, so its
/// one hand-off request was lost; its remembering shard 8 failed meanwhile (no majority) and,
/// the region shutting down, was never restarted. The coordinator kept shard 8 on n2 for good,
/// n2 never finished leaving, and 4 remembered entities stayed unreachable. The fault was in
/// the production cores: the request was sent once, and the coordinator only acted on it.
/// Now the region asks again every retry interval, the coordinator hands off the shards of
/// every Leaving member by itself, and the shutdown ends at its timeout whatever happens.
#[test]
fn a_leave_cut_off_from_the_coordinator_still_hands_off_every_shard_including_a_failed_one() {
    // Later changes moved where the scenario recurs: a member leaving with a failed
    // remembering shard is seed 25001277 (n1, shard 10) since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42); the partition part is
    // held by the scripted test below.
    let report = check(25001277, &shape("three-nodes-many-shards"));
    assert!(report.trace.iter().any(|l| l.contains("n1#1 shard 10 failed")), "the scenario: shard 10 fails on n1");
    assert!(report.trace.iter().any(|l| l.contains("n1#1 region stopped; leaves the cluster")), "n1's leave ended");
}

/// The scenario of seed 25000037, scripted: n2 (not the coordinator's node) starts leaving
/// while a partition cuts it off from the coordinator, so its hand-off request is lost; the
/// partition heals before anyone is downed. The region asks again and the coordinator hands
/// off n2's shards because its member is Leaving, so the leave ends well within the shutdown
/// timeout and every entity answers from the other two nodes. Before the fix n2 stayed Leaving
/// with its shards until the shutdown timeout (and in the simulation, which had no timeout,
/// for good).
#[test]
fn a_leave_whose_hand_off_request_is_lost_to_a_partition_still_ends_with_every_shard_moved() {
    use ddshard::testkit::sim::Sim;
    let cfg = SimConfig {
        nodes: 3,
        shards: 12,
        entities: 12,
        faults: false,
        drop_per_mille: 0,
        remember: true,
        ..SimConfig::default()
    };
    let mut sim = Sim::new(6, cfg);
    sim.run_until(1_000);
    let first: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(2_000);
    assert!(first.iter().all(|a| sim.answered(*a)), "all answered before the leave");
    assert!(!sim.live_entities_on(1).is_empty(), "n2 hosts entities");
    // n1 is the oldest member: it hosts the coordinator.
    sim.partition(&[1], &[0, 2]);
    sim.run_until(2_100);
    sim.leave_node(1);
    sim.run_until(2_900);
    sim.heal();
    sim.run_until(12_000);
    let trace = &sim.report().trace;
    let left = trace.iter().find(|l| l.contains("n2#1 region stopped; leaves the cluster")).expect("n2's leave ended");
    assert!(!trace.iter().any(|l| l.contains("graceful shutdown timed out")), "by hand-off, not by its timeout");
    let at: u64 = left.split_whitespace().next().and_then(|t| t.parse().ok()).expect("a time");
    assert!(at < 12_000, "well within the shutdown timeout: {left}");
    let after: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(16_000);
    assert!(after.iter().all(|a| sim.answered(*a)), "every entity answers from the other nodes");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
}

/// Seed 160000972 of the soak (issue 38): in three nodes, n3 and then n1 left while n2 was cut
/// off and then downed; ids acknowledged by n1 and n3 alone (a majority of three) were on
/// nobody else when both exited right after n2#2 came up, so n2#2 lost 9 remembered ids. The
/// fault was in production: a leaving node took its replica away with it. Now a leaving node
/// hands every value over to a majority of the members that stay before it exits
/// (`Input::HandOver`, `Node::leave`).
#[test]
fn two_of_three_nodes_leaving_in_turn_hand_their_replicas_over_so_no_remembered_id_leaves_with_them() {
    // 260002186 is the same fault found by a later soak.
    for seed in [160000972, 260002186] {
        let report = check(seed, &shape("three-nodes-many-shards"));
        assert!(report.remembered_acked > 100, "seed {seed}: the scenario remembers ids");
    }
}

/// Seed 170001275 of the soak (7 nodes, 2 % loss): three members left while the
/// coordinator's node, leaving too, was cut off from one region. A region's repeated
/// shutdown request re-sent the hand-off messages it had not answered — and put off, for the
/// whole hand-off, the periodic re-send the cut-off region needed, so the shards stayed
/// unplaced 10 s longer and asks after recovery timed out. The fault was in this change to the
/// coordinator core (a request-driven re-send reset the hand-off's timer); it leaves the timer
/// alone now.
#[test]
fn a_region_s_repeated_shutdown_request_never_delays_the_hand_off_messages_other_regions_need() {
    check(170001275, &shape("seven-nodes-lossy"));
}

/// Seed 370014969 of the soak (7 nodes, 2 % loss): after recovery e54's final ask was answered
/// with 9 and a message queued behind it (left from the faults) then wrote 10; the checker held
/// that later write against the final answer. The fault was in the simulation's checker, not
/// in the library: it now compares the final answer with what was acknowledged until then.
#[test]
fn a_write_acknowledged_after_the_final_answer_is_not_counted_as_one_the_answer_missed() {
    // 380012375 is the same, in the seven-node message-path shape.
    check(370014969, &shape("seven-nodes-lossy"));
    check(380012375, &shape("seven-nodes-message-path-lossy"));
}

/// Seed 26003152 (issue 38): n6 left during a partition with 2 % loss; its hand-off request
/// was lost, its shard 3 had failed, and a shard allocated to it before the leave was never
/// acknowledged (a shutting-down region ignores HostShard; the coordinator re-sent it to n6
/// forever). Same production faults and fix as seed 25000037.
#[test]
fn a_leave_whose_request_is_lost_hands_off_its_failed_and_unstarted_shards_in_seven_lossy_nodes() {
    check(26003152, &shape("seven-nodes-lossy"));
}

/// Seed 26000290 (issue 38): n6 left while the coordinator's node was cut off, with its shard 4
/// failed. Same production faults and fix as seed 25000037.
#[test]
fn a_leave_while_the_coordinator_is_cut_off_hands_off_a_failed_shard_in_seven_lossy_nodes() {
    check(26000290, &shape("seven-nodes-lossy"));
}

/// Seed 520000593 (issue 38, `durable`), scripted (seeds do not keep their scenario across
/// changes): of five nodes n4 crashes and is downed; n1 pauses, writes are acknowledged by
/// n2, n3 and n5, n2 crashes; n3 and n5 lose keep-majority's tie-break and down themselves;
/// n1 wakes as the whole membership. Before the roster it claimed every shard alone and lost
/// those writes (the checker excused it as "every holder unreachable"). Now its claims wait
/// for three of the five holders, and once n2 and n3 are back every acknowledged write is read.
#[test]
fn a_node_left_alone_by_downing_claims_nothing_until_a_majority_of_the_roster_is_back() {
    use ddshard::testkit::sim::Sim;
    let cfg = SimConfig {
        nodes: 5,
        shards: 12,
        entities: 20,
        faults: false,
        drop_per_mille: 0,
        durable: true,
        ..SimConfig::default()
    };
    let mut sim = Sim::new(7, cfg);
    sim.run_until(1_000);
    let asks: Vec<u64> = (0..20).map(|e| sim.ask_through(2, &format!("e{e}"))).collect();
    sim.run_until(2_500);
    assert!(asks.iter().all(|a| sim.answered(*a)), "all answered at first");
    sim.crash_node(3);
    sim.run_until(16_000);
    sim.pause_node(0, 8_000);
    // What n1 misses while paused is lost to it (in the seed, n1's peers were gone before it
    // could be sent on): only n2, n3 and n5 hold the writes made meanwhile.
    sim.partition(&[0], &[1, 2, 3, 4]);
    sim.run_until(16_200);
    let during: Vec<u64> = (0..20).map(|e| sim.ask_through(2, &format!("e{e}"))).collect();
    sim.run_until(16_800);
    sim.crash_node(1);
    sim.run_until(23_900);
    sim.heal();
    sim.run_until(26_000);
    let trace = |sim: &Sim, what: &str| sim.report().trace.iter().any(|l| l.contains(what));
    assert!(
        trace(&sim, "n3#1 downs itself") && trace(&sim, "n5#1 downs itself"),
        "the scenario: n3, n5 down themselves"
    );
    assert!(trace(&sim, "n1#1 downs n2#1"), "the scenario: n1 wakes and downs n2, alone");
    // Alone, n1 serves nothing durable: one of five holders is no majority for a claim, nor for
    // a write of the shards it still hosts.
    let alone: Vec<u64> = (0..20).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(29_000);
    assert!(!alone.iter().any(|a| sim.answered(*a)), "nothing is served from what one holder has");
    assert!(trace(&sim, "n1#1 shard 5 cannot claim its states: consistency needs 3 replicas but only 1"));
    // n2 and n3 come back on their disks: three of five.
    sim.restart_node(1);
    sim.restart_node(2);
    // The shards that failed to claim restart after their backoff (10 s, and up to a quarter
    // more); a message meanwhile fails at once, naming the backoff.
    sim.run_until(42_000);
    let after: Vec<u64> = (0..20).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(46_000);
    let answered = after.iter().filter(|a| sim.answered(**a)).count();
    assert_eq!(answered, 20, "every entity answers once a majority of the roster is back");
    assert!(
        during.iter().filter(|a| sim.answered(**a)).count() > 5,
        "the scenario: writes acknowledged during the pause"
    );
    // The checker holds every claim to every value acknowledged before it.
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
}

/// Seed 570000570 (issue 38, `seven-nodes-lossy`): the coordinator re-sent an unconfirmed
/// HostShard while n3 was handing shard 10 off; n3 took it, and after the stop kept itself as
/// the shard's home, so asks routed through n3 were answered "not hosted" while n1 ran the
/// shard. Fixed in both cores: no resend during a hand-off, and a region handing a shard off
/// ignores a HostShard for it.
#[test]
fn a_host_shard_resent_during_a_hand_off_leaves_no_stale_home_in_seven_lossy_nodes() {
    check(570000570, &shape("seven-nodes-lossy"));
}

/// Seed 660002017 (issue 38, `three-nodes-many-shards`, found by the first soak with the
/// roster): all three nodes left; n2 was downed and restarted, and n3 and then n1 finished
/// leaving 20 ms apart with n2#2 the only member that stays. n3 forgot itself on n2#2 only; n1
/// still counted n3, found n2#2 alone no majority of {n2, n3}, failed its hand-over at once
/// and stayed in the roster, so n2#2 could never write a remembered id again. The fault was in
/// the replicator core (this change): a hand-over now waits within its deadline for the roster
/// to allow a majority, and a node's own forget ships to every gossip target at once.
#[test]
fn the_last_of_three_leaving_nodes_hands_over_to_the_one_restarted_node_once_it_hears_of_the_others_forget() {
    // Seed 660002563 since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42).
    let report = check(660002563, &shape("three-nodes-many-shards"));
    for line in
        ["n1#1 region stopped; leaves the cluster", "n3#1 region stopped; leaves the cluster", "n2#1 downs itself"]
    {
        assert!(report.trace.iter().any(|l| l.contains(line)), "the scenario: {line}");
    }
}

/// Seeds 670003637 (`seven-nodes-lossy`) and 680001970 (`seven-nodes-message-path-lossy`),
/// found by the soak with the roster: a leaving node (n4; n1, the coordinator's) was handing a
/// remembering shard off when the write of its stopped ids failed (no majority of the roster
/// reachable then). The shard core reported `Failed`, which a region only answers by a restart
/// after the backoff, so the hand-off went unanswered until the region's shutdown timed out
/// 20–30 s later, and asks after recovery met "not hosted" or no home. The fault was in the
/// shard core: a store failure during a hand-off now ends the hand-off (every entity stopped,
/// the new home loads what is stored).
#[test]
fn a_store_failure_while_a_leaving_node_hands_a_shard_off_ends_the_hand_off_instead_of_stalling_the_leave() {
    // Since hand-overs follow the membership (seed 720004905 below), 680001970's run takes
    // another course (n1 is downed before it leaves); it is still checked.
    check(680001970, &shape("seven-nodes-message-path-lossy"));
    // Seed 670000375 (n1 leaves with its shard 0 failed) since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42).
    let report = check(670000375, &shape("seven-nodes-lossy"));
    assert!(report.trace.iter().any(|l| l.contains("n1#1 shard 0 failed")), "the scenario: n1's shard 0 fails");
    let stopped = "n1#1 region stopped; leaves the cluster";
    assert!(report.trace.iter().any(|l| l.contains(stopped)), "n1's leave ended");
    let timed_out = "n1#1 graceful shutdown timed out";
    assert!(!report.trace.iter().any(|l| l.contains(timed_out)), "by hand-off, not by its timeout");
}

/// Seeds 720004905 (`durable`), 730021632 (`durable-remember`) and 770019193
/// (`seven-nodes-lossy`), found by the first 225,000 runs of the million-run soak on the
/// roster: a leaving node's hand-over was fixed to the members of its start. When one of them
/// paused and was downed, or crashed, the hand-over timed out (2 of 3, 1 of 2 acks) although a
/// restarted incarnation of a holder was Up and reachable; the leaver stayed in the roster
/// for good, and the nodes left held no durable majority of it (every ask after recovery
/// failed with `StateNotPersisted` or "not hosted"). The fault was in the replicator core: a
/// hand-over now reads who stays from every membership change, sends every part to a member
/// that turned Up since, and counts the majority over the staying roster of now.
#[test]
fn a_leaving_node_hands_over_to_a_holder_restarted_during_its_leave_so_the_nodes_left_keep_a_durable_majority() {
    for (seed, shape_name, leaver) in [
        (720004905, "durable", "n1#1"),
        // 730000003 and 770000001 since the simulation runs the shipped coordinator take-over.
        (730000003, "durable-remember", "n4#1"),
        (770000001, "seven-nodes-lossy", "n3#1"),
    ] {
        let report = check(seed, &shape(shape_name));
        let stopped = format!("{leaver} region stopped; leaves the cluster");
        assert!(report.trace.iter().any(|l| l.contains(&stopped)), "seed {seed}: {leaver}'s leave ended");
        let failed = report.trace.iter().find(|l| l.contains("replica not handed over"));
        assert!(failed.is_none(), "seed {seed}: every hand-over reached a majority: {failed:?}");
    }
}

/// Seed 760002057 (`three-nodes-many-shards`), found with the three above: of three nodes, n2
/// and then n1's restarted incarnation left. A shard's load read on n3 started while n2, its
/// hand-over done and forgotten, was still listed; the read counted n2, which exited without
/// answering, and the shard stayed down for its 10 s restart backoff, past the recovery's
/// asks. The fault was in the replicator core: a pending read or write now counts the
/// replicas again when the membership changes (table test
/// `a_read_and_a_write_waiting_for_a_holder_that_handed_over_and_left_end_when_it_is_removed`).
#[test]
fn the_one_node_left_of_three_after_two_leaves_serves_every_shard_after_recovery() {
    // Seed 760003059 (n1 and n3 leave) since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42): no seed of the 20,000 after the original
    // showed n2 and then n1's restarted incarnation leaving; any two of the three do.
    let report = check(760003059, &shape("three-nodes-many-shards"));
    let left: std::collections::BTreeSet<&str> = report
        .trace
        .iter()
        .filter_map(|l| {
            l.strip_suffix(" region stopped; leaves the cluster")?.split_whitespace().last()?.split('#').next()
        })
        .collect();
    assert_eq!(left.len(), 2, "the scenario: two of the three nodes leave: {left:?}");
}

/// Seed 760109273 (`three-nodes-many-shards`), found by the million-run soak of session 25:
/// all three nodes of three were asked to leave during the faults (scaling to zero); none had
/// stopped at the recovery's restart point, so none was started again, the leaves ended after
/// it, and nobody was left to answer. The library did its part (each leave handed its shards
/// and replica over, the last to nobody); the simulation's recovery did not: it now starts
/// again every node whose leave ends after its restart point, as an operator scaling back up
/// would, and settles from the last start. Every entity then answers from the restarted nodes.
#[test]
fn every_node_leaving_during_the_faults_is_started_again_by_recovery_and_every_entity_answers() {
    // Seed 760114099 since the remember store reads every reachable replica and registering regions get every known home before their ack (issue 42).
    let report = check(760114099, &shape("three-nodes-many-shards"));
    let leavers: std::collections::BTreeSet<&str> =
        report.trace.iter().filter_map(|l| l.trim().split_once(' ')?.1.strip_suffix(" leaves")).collect();
    assert_eq!(leavers.len(), 3, "the scenario: every node of three leaves: {leavers:?}");
    let restart = report.trace.iter().position(|l| l.contains("heal; restarting stopped nodes")).expect("recovery");
    let late_stops =
        report.trace[restart..].iter().filter(|l| l.ends_with("region stopped; leaves the cluster")).count();
    assert!(late_stops > 0, "the scenario: a leave ends after the restart point");
}

#[test]
fn random_faults_with_one_way_and_messaging_only_cuts_never_run_an_entity_twice_and_service_recovers() {
    let seeds: u64 = std::env::var("DDSHARD_SIM_MESSAGE_PATH_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    for (remember, durable) in [(false, false), (true, true)] {
        let cfg = SimConfig { trace: false, message_path: true, remember, durable, ..SimConfig::default() };
        let seeds = if durable { seeds / 3 } else { seeds };
        let started = std::time::Instant::now();
        let (reports, failed) = run_seeds(seeds, &cfg);
        let answered: usize = reports.iter().map(|r| r.answered).sum();
        let downed: usize = reports.iter().map(|r| r.downed.len()).sum();
        println!(
            "{seeds} message-path seeds (remember {remember}, durable {durable}) in {:.1}s: {answered} answers, {downed} members downed by the resolver, failed: {failed:?}",
            started.elapsed().as_secs_f64()
        );
        assert!(answered > seeds as usize * 100, "service under faults: {answered} answers over {seeds} seeds");
        assert!(downed > 0, "the cuts led the resolver to down members");
    }
}

/// What a one-way cut from the coordinator's node looks like to the resolver: the heartbeats
/// of both ends of each cut link fail, gossip still connects everyone, and the fewest members
/// that cover the broken links (the coordinator's node alone) are downed.
#[test]
fn a_one_way_cut_from_the_coordinators_node_to_two_others_downs_only_that_node_in_the_simulation() {
    use ddshard::testkit::sim::Sim;
    let cfg = SimConfig {
        nodes: 5,
        shards: 10,
        entities: 10,
        faults: false,
        drop_per_mille: 0,
        message_path: true,
        ..SimConfig::default()
    };
    let mut sim = Sim::new(3, cfg);
    sim.run_until(1_000);
    // n1 is the oldest member: it hosts the coordinator.
    sim.cut_one_way(0, 1);
    sim.cut_one_way(0, 2);
    sim.run_until(12_000);
    assert_eq!(sim.report().downed.len(), 1, "{:?}", sim.report().downed);
    assert!(sim.report().downed[0].starts_with("n1#"), "{:?}", sim.report().downed);
    let asks: Vec<u64> = (0..10).map(|e| sim.ask_through(1 + e % 4, &format!("e{e}"))).collect();
    sim.run_until(18_000);
    assert!(asks.iter().all(|a| sim.answered(*a)), "the four others serve every entity");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
}

/// Heartbeats cost each node O(k) frames, not O(N): every node watches `monitored_by` (5)
/// others and answers as many, so its frames per second are the same at 25 and 100 nodes.
#[test]
fn heartbeat_frames_per_node_stay_flat_as_the_simulated_cluster_grows_to_100_nodes() {
    let mut per_node = Vec::new();
    for nodes in [5, 25, 100] {
        let cfg = SimConfig {
            nodes,
            faults: false,
            drop_per_mille: 0,
            fault_ms: 10_000,
            trace: false,
            message_path: true,
            ..SimConfig::default()
        };
        let r = run_seed(1, &cfg);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        let rate = r.heartbeat_frames as f64 / nodes as f64 / (r.virtual_ms as f64 / 1_000.0);
        println!("{nodes} simulated nodes: {rate:.1} heartbeat frames per node per second");
        per_node.push(rate);
    }
    // 5 nodes: 4 watched each (everyone else); from 6 on, 5 requests and 5 answers per 500 ms.
    assert!(per_node[0] <= 16.5, "{per_node:?}");
    for rate in &per_node[1..] {
        assert!((19.0..=20.5).contains(rate), "O(k) per node, not O(N): {per_node:?}");
    }
}

/// The soak: `DDSHARD_SIM_SOAK_RUNS` runs (800 by default, CI's release step runs more) spread
/// evenly over every shape of `ddshard::testkit::sim::shapes` (or those named in
/// `DDSHARD_SIM_SOAK_SHAPES`), on all cores, shape `i` on seeds
/// `DDSHARD_SIM_SOAK_FROM + i × 10,000,000 + k` (from 100,000,000 by default: ranges no other
/// test uses). Prints each shape's runs per second and its first failing seed with the command
/// that replays it; fails if any run broke a promise.
/// Reliable delivery, every reliable shape, random faults: producers (moved by a supervisor
/// when their node stops or is downed) send numbered messages while nodes crash, pause,
/// leave and are cut off; every seed checks that nothing is confirmed unhandled (a durable
/// entity: whose effect no acknowledged write carries), that each stream is handled in order,
/// that no durable entity writes an effect twice, and that after recovery every stored
/// message is confirmed (all of them with a durable queue).
#[test]
fn reliable_delivery_under_random_faults_loses_no_stored_message_and_confirms_nothing_unhandled() {
    let seeds: u64 = std::env::var("DDSHARD_SIM_RELIABLE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let shapes = [
        "reliable",
        "reliable-durable",
        "reliable-durable-tight",
        "reliable-seven-nodes-message-path-lossy",
        "reliable-deferred",
        "reliable-durable-deferred",
    ];
    for name in shapes {
        let cfg = shape(name);
        let cfg = SimConfig { trace: false, ..cfg };
        let started = std::time::Instant::now();
        let (reports, failed) = run_seeds(seeds, &cfg);
        if cfg.deferred_confirms {
            let given: usize = reports.iter().map(|r| r.holds_given).sum();
            let let_go: usize = reports.iter().map(|r| r.holds_let_go).sum();
            assert!(
                given > seeds as usize * 10 && let_go > seeds as usize,
                "{name}: holds {given} given, {let_go} let go"
            );
        }
        let stored: usize = reports.iter().map(|r| r.deliveries_stored).sum();
        let ended: usize = reports.iter().map(|r| r.deliveries_ended_with_producer).sum();
        println!(
            "{name}: {seeds} seeds in {:.1}s, {stored} messages stored, {ended} ended with their producer's in-memory queue, failed asks {failed:?}",
            started.elapsed().as_secs_f64()
        );
        assert!(stored > seeds as usize * 200, "{name}: traffic under faults: {stored} stored over {seeds} seeds");
        if cfg.durable_queue {
            assert_eq!(ended, 0, "{name}: a durable queue ends with no node");
        }
    }
}

/// `reliable-durable` with producers of window 3 and room for 4 streams
/// ([`SimConfig::tight_producers`]): a stream's places wrap, idle streams are evicted and
/// their lanes given out again.
fn tight_producers() -> SimConfig {
    SimConfig { tight_producers: true, ..shape("reliable-durable") }
}

/// Seed 810000024 with tight producers: an evicted stream's deletions and the next stream's
/// first writes in the same lane were performed as batches of their own, so a deletion's
/// retry landed after a newer message's acknowledged write at its place and deleted it; the
/// restarted producer never loaded that message. The simulation now performs a producer's
/// queue writes as its store's writer (`StateIo::run_writer`) does, one batch at a time.
#[test]
fn a_producers_queue_writes_go_one_batch_at_a_time_so_no_retried_deletion_follows_a_newer_write() {
    let report = check(810000024, &tight_producers());
    assert!(report.deliveries_stored > 100, "the scenario sends");
}

/// Seed 830000277 with tight producers: p0's incarnation on n1 was cut off; a new incarnation
/// claimed its queue on n2, took over e16's stream and, after evicting it, sent on newer
/// streams. The old incarnation, which learns of the claim only at its next write, sent its
/// old stream's message 1 again; e16, keeping one stream per producer, took it as a new stream
/// and applied it a second time. Deliveries now carry the epoch of their producer's claim,
/// and an entity refuses one older than the newest it heard (`Superseded`: the sender stops,
/// as fenced). Trace: `DDSHARD_SIM_SHAPE=reliable-durable DDSHARD_SIM_TIGHT_PRODUCERS=1
/// DDSHARD_SIM_SEED=830000277 cargo test --test sim replay -- --nocapture`.
#[test]
fn a_superseded_producer_incarnations_old_stream_is_never_handled_again_by_a_durable_entity() {
    check(830000277, &tight_producers());
}

/// Seed 830000080 with tight producers, found while confirmed entries were deleted only when
/// their stream idled (tried, not landed; the fault was there before, rarer): an eviction began deleting e0's
/// stream and gave lane 2 at once to e3, whose first write no majority acknowledged before
/// its node stopped. The next incarnation, seeing e0's entries still stored, resumed e0's
/// stream in lane 2 and stored messages 2 and 3 there; e3's entry then came back from the
/// restarted node's disk, newer by `made`, and a later load took e3's stream as lane 2's and
/// dropped e0's stored messages. An evicted stream now keeps its lane (and its entity) until a
/// majority acknowledged the deletion of every entry it left.
#[test]
fn an_evicted_streams_lane_goes_to_another_stream_only_once_its_entries_are_deleted() {
    let report = check(830000080, &tight_producers());
    assert!(report.deliveries_stored > 100, "the scenario sends");
}

/// Seed 230000193 of `reliable-deferred` (a fault of the checker): e6's shard was allocated
/// to n3 again, and its new incarnation there was numbered 1, as the one before; a message the
/// first had held and confirmed (the confirmation lost on the way) was sent again and handled
/// by the second, which the checker took for one incarnation stepping back. Incarnations are
/// now told apart by their shard's epoch too (and a plain entity's marks with them).
#[test]
fn two_allocations_of_a_shard_to_one_node_are_two_incarnations_so_a_redelivery_to_the_second_is_no_step_back() {
    let report = check(230000193, &shape("reliable-deferred"));
    assert!(report.holds_given > 0 && report.deliveries_stored > 100, "the scenario holds and sends");
}

/// Seed 1210000435 of `reliable-durable-tight` (session 39), with each message at the lowest
/// free place of its lane while resumed streams still took new numbers: p1's incarnation 2
/// wrote e12's message 2 at one place, unacknowledged (no majority reachable) but kept on a
/// replica; incarnation 6 resumed the stream and wrote its own message 2 at another place,
/// confirmed and deleted it; the first write came back in incarnation 9's load, which resumed
/// the old stream after e12 had moved on, and e12 applied message 2 again. A resumed stream
/// now takes no new number, so every number of a stream is written by one incarnation at one
/// place.
#[test]
fn no_number_of_a_stream_is_written_by_two_incarnations_at_two_places() {
    let report = check(1210000435, &shape("reliable-durable-tight"));
    assert!(report.deliveries_stored > 100, "the scenario sends");
}

/// Seed 1900000018 of `reliable-durable` (session 40), when an entity confirmed unhandled any
/// copy of a stream made before the one it had taken: p0's incarnation 1 wrote e8's message 3,
/// never acknowledged (no majority), kept on n1's disk; incarnation 8, not seeing it, made e8 a
/// newer stream; incarnation 26's load found the entry and resumed the old stream, and e8
/// confirmed message 3 as a duplicate of a stream its producer had moved past, unhandled. Only
/// streams of the incarnation that sent the entity's current one compare now.
#[test]
fn a_stream_a_later_incarnation_resumed_from_a_replicas_disk_is_handled_not_confirmed_unseen() {
    let report = check(1900000018, &shape("reliable-durable"));
    assert!(report.deliveries_stored > 100, "the scenario sends");
}

/// Seed 240000601 of `reliable-durable-deferred` (CI, session 40's submission): e17 held p4's
/// message 6 (a deferred confirm), so the producer's next round sent 6 alone; the hold ended
/// and a late answer of the round before (a gap asking for 7) confirmed 6 and ended the hold,
/// but, being of an older round, started none. Round 4's answer for 6 then found nothing held
/// to release, and 7 and 8, answered pending and never handled, were not sent again. An ended
/// hold now starts a new round whichever round's answer ends it.
#[test]
fn a_hold_a_late_answer_ends_still_sends_again_what_it_held_back() {
    let report = check(240000601, &shape("reliable-durable-deferred"));
    assert!(report.deliveries_stored > 100, "the scenario sends");
}

/// Seed 200000001 of `reliable-durable`: a durable entity's write failed (no majority) but
/// stayed on its node's replica; the next incarnation read those marks and answered a re-sent
/// message as a duplicate, so its producer gave the message up although no majority held its
/// effect. Marks read from a replica now settle (a write of them is acknowledged) before an
/// answer confirms anything on their word.
#[test]
fn a_durable_entity_confirms_a_duplicate_only_once_a_majority_holds_its_marks() {
    let report = check(200000001, &shape("reliable-durable"));
    assert!(report.deliveries_stored > 100, "the scenario sends");
    check(210000008, &shape("reliable-seven-nodes-message-path-lossy"));
}

/// Seed 200000004 of `reliable-durable`: an entity whose writes failed at once restarted and
/// said hello to each re-sent message, and each hello started a round at once — a loop with
/// no time passing. A round after a failure now waits for its backoff.
#[test]
fn a_producer_waits_out_its_backoff_for_an_entity_whose_writes_fail_at_once() {
    check(200000004, &shape("reliable-durable"));
}

#[test]
fn soak_every_shape_keeps_every_promise() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    let env = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    // 20 a shape in the debug suite (overflow checks and debug assertions on the first seeds of
    // each range; CI's release step runs the same ranges 35 times as far).
    let runs = env("DDSHARD_SIM_SOAK_RUNS", 300);
    let from = env("DDSHARD_SIM_SOAK_FROM", 100_000_000);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let shapes = ddshard::testkit::sim::shapes();
    let per_shape = runs.div_ceil(shapes.len() as u64);
    let started = std::time::Instant::now();
    let mut broken = Vec::new();
    // `DDSHARD_SIM_SOAK_SHAPES=durable,seven-nodes-lossy`: only those shapes (each still on its
    // own seed range, with its share of the runs), so a long soak can be split across runs.
    let only: Option<Vec<String>> =
        std::env::var("DDSHARD_SIM_SOAK_SHAPES").ok().map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let mut ran = 0u64;
    for (i, (name, cfg)) in shapes.iter().enumerate() {
        if only.as_ref().is_some_and(|only| !only.iter().any(|o| o == name)) {
            continue;
        }
        ran += per_shape;
        let base = from + i as u64 * 10_000_000;
        let next = AtomicU64::new(0);
        let first_failure: Mutex<Option<(u64, Vec<String>)>> = Mutex::new(None);
        let failures = AtomicU64::new(0);
        let shape_started = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= per_shape {
                            return;
                        }
                        let seed = base + k;
                        let report = run_seed(seed, cfg);
                        if !report.violations.is_empty() {
                            failures.fetch_add(1, Ordering::Relaxed);
                            let mut first = first_failure.lock().unwrap();
                            if first.as_ref().is_none_or(|(s, _)| seed < *s) {
                                *first = Some((seed, report.violations));
                            }
                        }
                    }
                });
            }
        });
        let secs = shape_started.elapsed().as_secs_f64();
        let failures = failures.into_inner();
        print!("{name:>32}: {per_shape} runs in {secs:.1}s ({:.0} runs/s), {failures} failed", per_shape as f64 / secs);
        if let Some((seed, violations)) = first_failure.into_inner().unwrap() {
            println!(
                "; first: seed {seed}: {:?}\n{:>34}replay: DDSHARD_SIM_SHAPE={name} DDSHARD_SIM_SEED={seed} cargo test --test sim replay -- --nocapture",
                &violations[..violations.len().min(3)],
                ""
            );
            broken.push((name, seed));
        } else {
            println!();
        }
    }
    let secs = started.elapsed().as_secs_f64();
    assert!(
        ran > 0,
        "DDSHARD_SIM_SOAK_SHAPES names no shape of {:?}",
        shapes.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    println!("soak: {ran} runs in {secs:.1}s ({:.0} runs/s on {threads} threads)", ran as f64 / secs);
    assert!(broken.is_empty(), "promises broken; first failing seed per shape: {broken:?}");
}

#[test]
fn replay() {
    let Some(seed) = std::env::var("DDSHARD_SIM_SEED").ok().and_then(|s| s.parse().ok()) else { return };
    let remember = std::env::var("DDSHARD_SIM_REMEMBER").as_deref() == Ok("1");
    let durable = std::env::var("DDSHARD_SIM_DURABLE").as_deref() == Ok("1");
    let message_path = std::env::var("DDSHARD_SIM_MESSAGE_PATH").as_deref() == Ok("1");
    // The cores' own logs, printed as they run (before the trace), with RUST_LOG set.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
    }
    // A named shape (`ddshard::testkit::sim::shapes`), or the default with the flags above.
    let cfg = match std::env::var("DDSHARD_SIM_SHAPE") {
        Ok(name) => ddshard::testkit::sim::shape(&name).unwrap_or_else(|| panic!("no shape named {name}")),
        Err(_) => SimConfig { remember, durable, message_path, ..SimConfig::default() },
    };
    // `DDSHARD_SIM_TIGHT_PRODUCERS=1`: with `SimConfig::tight_producers`.
    let tight = std::env::var("DDSHARD_SIM_TIGHT_PRODUCERS").as_deref() == Ok("1");
    let cfg = SimConfig { tight_producers: tight || cfg.tight_producers, ..cfg };
    let report = run_seed(seed, &cfg);
    for line in &report.trace {
        println!("{line}");
    }
    println!("violations: {:#?}", report.violations);
}

/// Compares a trace with its golden file under `tests/sim/`; `DDSHARD_BLESS=1` rewrites it.
fn golden(name: &str, trace: &[String]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sim").join(format!("{name}.txt"));
    let text = trace.join("\n") + "\n";
    if std::env::var("DDSHARD_BLESS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (DDSHARD_BLESS=1 writes it)", path.display()));
    if expected != text {
        let first = expected
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(expected.lines().count().min(text.lines().count()));
        panic!(
            "trace differs from {} at line {}:\n  expected: {:?}\n  actual:   {:?}\n(DDSHARD_BLESS=1 rewrites it after you checked the change)",
            path.display(),
            first + 1,
            expected.lines().nth(first),
            text.lines().nth(first)
        );
    }
}

#[test]
fn golden_coordinator_take_over_after_its_node_crashes() {
    use ddshard::testkit::sim::Sim;
    let cfg = SimConfig { nodes: 3, shards: 6, entities: 6, faults: false, drop_per_mille: 0, ..SimConfig::default() };
    let mut sim = Sim::new(1, cfg);
    sim.run_until(1_000);
    let first: Vec<u64> = (0..6).map(|e| sim.ask_through(1, &format!("e{e}"))).collect();
    sim.run_until(2_000);
    assert!(first.iter().all(|a| sim.answered(*a)), "all answered before the crash");
    sim.crash_node(0); // n1: the oldest member, hosting the coordinator
    sim.run_until(8_000);
    let again: Vec<u64> = (0..6).map(|e| sim.ask_through(2, &format!("e{e}"))).collect();
    sim.run_until(12_000);
    assert!(again.iter().all(|a| sim.answered(*a)), "the successor coordinator re-allocated every shard");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
    golden("coordinator_take_over", &sim.report().trace);
}

#[test]
fn golden_partition_downs_the_minority_and_the_majority_takes_its_shards() {
    use ddshard::testkit::sim::Sim;
    let cfg =
        SimConfig { nodes: 5, shards: 10, entities: 10, faults: false, drop_per_mille: 0, ..SimConfig::default() };
    let mut sim = Sim::new(2, cfg);
    sim.run_until(1_000);
    for e in 0..10 {
        sim.ask_through(e % 5, &format!("e{e}"));
    }
    sim.run_until(2_000);
    sim.partition(&[3, 4], &[0, 1, 2]);
    sim.run_until(9_000);
    let after: Vec<u64> = (0..10).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(14_000);
    assert!(after.iter().all(|a| sim.answered(*a)), "the majority serves every entity");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
    golden("partition_and_downing", &sim.report().trace);
}

/// As in production, a type that remembers its entities has its coordinator reallocate a dead
/// region's shards at once (eager reallocation), and each new home loads and starts its
/// remembered ids: they come back without a single ask. (Before the simulation ran the shipped
/// take-over and settings, it reallocated only on demand, and this test asked once per shard.)
#[test]
fn golden_remembered_entities_come_back_on_their_own_after_their_node_crashed() {
    use ddshard::testkit::sim::Sim;
    let cfg = SimConfig {
        nodes: 3,
        shards: 6,
        entities: 12,
        faults: false,
        drop_per_mille: 0,
        remember: true,
        ..SimConfig::default()
    };
    let mut sim = Sim::new(3, cfg);
    sim.run_until(1_000);
    let first: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(2_000);
    assert!(first.iter().all(|a| sim.answered(*a)), "all answered before the crash");
    let victim = (1..3).max_by_key(|i| sim.live_entities_on(*i).len()).unwrap();
    let on_victim = sim.live_entities_on(victim);
    assert!(on_victim.len() >= 2, "it hosts entities: {on_victim:?}");
    sim.crash_node(victim);
    sim.run_until(8_000);
    let live = sim.live_entities();
    let missing: Vec<&String> = on_victim.iter().filter(|e| !live.contains(*e)).collect();
    assert!(missing.is_empty(), "remembered but not restarted without an ask: {missing:?}");
    let asks: Vec<u64> = on_victim.iter().map(|e| sim.ask_through(0, e)).collect();
    sim.run_until(10_000);
    assert!(asks.iter().all(|a| sim.answered(*a)), "and each answers");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
    golden("remembered_restart", &sim.report().trace);
}

#[test]
fn golden_rebalance_hands_shards_off_to_a_restarted_node_without_running_an_entity_twice() {
    use ddshard::testkit::sim::Sim;
    let cfg =
        SimConfig { nodes: 3, shards: 12, entities: 12, faults: false, drop_per_mille: 0, ..SimConfig::default() };
    let mut sim = Sim::new(4, cfg);
    sim.run_until(1_000);
    let first: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(2_000);
    assert!(first.iter().all(|a| sim.answered(*a)), "all answered before the crash");
    // n3 crashes, is downed, and its shards move to n1 and n2.
    sim.crash_node(2);
    sim.run_until(9_000);
    let moved: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(10_000);
    assert!(moved.iter().all(|a| sim.answered(*a)), "the survivors host every shard");
    assert!(sim.live_entities_on(2).is_empty());
    // n3 comes back as a new incarnation; the rebalance rounds hand shards off to it.
    sim.restart_node(2);
    sim.run_until(40_000);
    let trace = &sim.report().trace;
    assert!(trace.iter().any(|l| l.contains("BeginHandOff")), "a rebalance started");
    assert!(trace.iter().any(|l| l.contains("ShardStopped")), "a hand-off completed");
    let after: Vec<u64> = (0..12).map(|e| sim.ask_through(1, &format!("e{e}"))).collect();
    sim.run_until(42_000);
    assert!(after.iter().all(|a| sim.answered(*a)), "every entity answers after the hand-offs");
    assert!(!sim.live_entities_on(2).is_empty(), "the restarted node hosts shards again");
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
    golden("rebalance_after_restart", &sim.report().trace);
}

#[test]
fn golden_graceful_leave_hands_every_shard_off_before_the_node_stops() {
    use ddshard::testkit::sim::Sim;
    let cfg =
        SimConfig { nodes: 3, shards: 12, entities: 12, faults: false, drop_per_mille: 0, ..SimConfig::default() };
    let mut sim = Sim::new(5, cfg);
    sim.run_until(1_000);
    let first: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(2_000);
    assert!(first.iter().all(|a| sim.answered(*a)), "all answered before the leave");
    let leaving = sim.live_entities_on(1);
    assert!(!leaving.is_empty(), "n2 hosts entities");
    // n2 (not the coordinator's node) leaves: each of its shards is handed off, then it stops.
    sim.leave_node(1);
    sim.run_until(6_000);
    let trace = &sim.report().trace;
    assert!(trace.iter().any(|l| l.contains("GracefulShutdownReq")), "the region asked to hand off");
    assert!(trace.iter().any(|l| l.contains("n2#1 region stopped; leaves the cluster")), "{trace:#?}");
    let after: Vec<u64> = (0..12).map(|e| sim.ask_through(0, &format!("e{e}"))).collect();
    sim.run_until(8_000);
    assert!(after.iter().all(|a| sim.answered(*a)), "every entity answers from the other nodes");
    assert!(sim.live_entities_on(1).is_empty());
    assert!(sim.report().violations.is_empty(), "{:?}", sim.report().violations);
    golden("graceful_leave", &sim.report().trace);
}
