//! The deterministic simulation of the sharding cores (`ddshard::testkit::sim`): seeded runs
//! with crashes, restarts, partitions and dropped messages, checked for at most one live
//! activation per entity, every ask ending, full service after recovery and (with
//! remember-entities) no acknowledged remembered id lost, (with durable state) no acknowledged
//! write lost and none accepted from a fenced epoch; and the same seed giving the same
//! trace byte for byte.
//!
//! Replay one seed with its trace: `DDSHARD_SIM_SEED=42 cargo test --test sim replay -- --nocapture`
//! (add `DDSHARD_SIM_REMEMBER=1` for a remember-entities seed, `DDSHARD_SIM_DURABLE=1` for a
//! durable-state seed).

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
        let unheld: usize = reports.iter().map(|r| r.states_lost_with_every_holder_unreachable).sum();
        let fenced_coordinators: usize = reports.iter().map(|r| r.coordinators_fenced).sum();
        println!(
            "{seeds} durable seeds (remember {remember}) in {:.1}s: {acked} acknowledged state writes checked, {answered} answers, {zombies} activations beside a paused zombie, {fenced_coordinators} zombie coordinators fenced, {unheld} acknowledged values no reachable replica held at a claim, failed: {failed:?}",
            started.elapsed().as_secs_f64()
        );
        // The residual risk (every holder of a write downed or crashed before a survivor
        // claims) stays rare: one seed in 3,000 hit it when it was measured.
        assert!(unheld * 1000 <= acked, "{unheld} of {acked} acknowledged values lost with every holder unreachable");
        // Pauses long enough for the peers to down the node leave zombies that resume and try
        // to write: the fence must refuse them (and the checks above prove nothing they wrote
        // was acknowledged).
        assert!(zombies > 0, "the runs paused nodes past their downing");
        if seeds >= 100 {
            assert!(failed.contains_key("Fenced"), "a zombie's write was refused by the fence: {failed:?}");
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
/// allocates, but its write is refused by the newer coordinator term, so it stops before
/// anyone acts on its allocation (before terms, seeds 13, 53 and 922 started a shard twice
/// this way).
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
    assert!(report.coordinators_fenced >= 1, "the zombie coordinator wrote and was fenced");
    let fenced = report.trace.iter().position(|l| l.contains("n1#1 coordinator write fenced")).expect("fenced");
    assert!(report.trace[fenced + 1].contains("n1#1 coordinator stops"), "it stops at once");
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
    let report = check(2076, &SimConfig { remember: true, ..SimConfig::default() });
    let failed = report.trace.iter().position(|l| l.contains("n4#1 shard 7 failed; restarts after the backoff"));
    let failed = failed.expect("the scenario: shard 7 fails on n4");
    let handoff = report.trace[failed..].iter().position(|l| l.contains("-> n4#1 HandOff { shard: \"7\""));
    let handoff = handoff.expect("the scenario: n4 is asked to hand shard 7 off") + failed;
    let millis = |l: &str| l.split_whitespace().next().and_then(|t| t.parse::<u64>().ok()).expect("a time");
    let backoff = ShardingSettings::default().shard_failure_backoff.as_millis() as u64;
    assert!(millis(&report.trace[handoff]) - millis(&report.trace[failed]) < backoff, "within the backoff");
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
    let report = run_seed(seed, &SimConfig { remember, durable, message_path, ..SimConfig::default() });
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

#[test]
fn golden_remembered_entities_come_back_with_their_shard_after_a_crash() {
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
    // The entities of the busier of n2 and n3; after its crash one ask per shard brings all of
    // them back (the shard loads its remembered ids and starts each).
    let victim = (1..3).max_by_key(|i| sim.live_entities_on(*i).len()).unwrap();
    let on_victim = sim.live_entities_on(victim);
    assert!(on_victim.len() >= 2, "it hosts entities: {on_victim:?}");
    sim.crash_node(victim);
    sim.run_until(8_000);
    assert!(on_victim.iter().all(|e| !sim.live_entities().contains(e)), "they died with their node");
    let mut one_per_shard = std::collections::BTreeMap::new();
    for e in &on_victim {
        one_per_shard.entry(ddshard::sharding::default_shard_id(e, 6)).or_insert(e.clone());
    }
    let asks: Vec<u64> = one_per_shard.values().map(|e| sim.ask_through(0, e)).collect();
    sim.run_until(10_000);
    assert!(asks.iter().all(|a| sim.answered(*a)));
    assert!(asks.len() < on_victim.len(), "some entities come back without being asked");
    let live = sim.live_entities();
    let missing: Vec<&String> = on_victim.iter().filter(|e| !live.contains(*e)).collect();
    assert!(missing.is_empty(), "remembered but not restarted: {missing:?}");
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
