//! Heap allocations per message (issue 44, items 2 and 3), counted by a counting global
//! allocator around asks and tells to running entities of a one-node cluster, and remote asks
//! between two nodes of one process. The ids are built before counting: what is counted is
//! the library's own work per message. The ceilings are today's counts, so that a change that
//! adds an allocation to the hot path fails here; the goal for an ask is 1.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ddshard::testkit::TestCluster;
use ddshard::{Entity, EntityContext, ShardRegion, ShardingSettings};

/// The system allocator, counting allocations (a `realloc` counts as one).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's allocations alone: exact for work done on one thread, whatever the
    /// tests running beside it allocate.
    static THREAD_ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Held by every test of this file while it runs: the process-wide count of one test must not
/// take in another's allocations (the test harness runs them on parallel threads).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn; a test that failed while holding it does not stop the others.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn counted() {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    // `try_with`: a thread's slot may already be gone while it shuts down.
    let _ = THREAD_ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call goes to `System` unchanged; counting has no effect on the memory.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[derive(Default)]
struct Counter(u64);

impl Entity for Counter {
    type Message = u64;
    type Reply = u64;
    async fn handle(&mut self, add: u64, _: &mut EntityContext) -> u64 {
        self.0 += add;
        self.0
    }
}

const ENTITIES: usize = 100;
const MESSAGES: usize = 20_000;

/// How long the cluster is left idle after the messages, to measure what it allocates without
/// them.
const IDLE_WINDOW: Duration = Duration::from_secs(2);

/// Allocations per message of `MESSAGES` runs of `op` (awaited one after another), less what
/// the cluster allocates meanwhile without them. Its own timers (gossip, heartbeats, ticks)
/// allocate at a steady rate whatever the messages do (about 3,100 a second for two nodes in a
/// debug build here), so the raw count per message grew with the loop's duration: on a slower
/// machine the remote loop took 6.1 s and counted 0.96 allocations per ask of background work.
/// The rate is measured over [`IDLE_WINDOW`] right after and subtracted for the loop's duration.
async fn per_message<F, Fut>(op: F) -> f64
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (before, started) = (ALLOCATIONS.load(Ordering::Relaxed), std::time::Instant::now());
    for i in 0..MESSAGES {
        op(i).await;
    }
    let (during, took) = (ALLOCATIONS.load(Ordering::Relaxed) - before, started.elapsed());
    let (before, started) = (ALLOCATIONS.load(Ordering::Relaxed), std::time::Instant::now());
    tokio::time::sleep(IDLE_WINDOW).await;
    let idle_rate = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / started.elapsed().as_secs_f64();
    let background = idle_rate * took.as_secs_f64();
    println!(
        "{during} allocations in {took:?} for {MESSAGES} messages; {background:.0} of them the idle cluster's ({idle_rate:.0}/s)"
    );
    (during as f64 - background).max(0.0) / MESSAGES as f64
}

async fn region_with_running_entities() -> (TestCluster, ShardRegion<Counter>, Vec<String>) {
    let cluster = TestCluster::start(1).await.expect("the cluster starts");
    cluster.await_converged(Duration::from_secs(30)).await;
    let settings = ShardingSettings { number_of_shards: 10, ..ShardingSettings::default() };
    let region = cluster.node(0).sharding().start("counter", |_: &str| Counter::default(), settings).await.unwrap();
    let ids: Vec<String> = (0..ENTITIES).map(|i| format!("c{i}")).collect();
    // Started, and every table and queue on the path grown to its working size.
    for round in 0..20 {
        for id in &ids {
            region.ask(id, round).await.expect("a running entity answers");
        }
    }
    (cluster, region, ids)
}

#[test]
fn a_local_ask_to_a_running_entity_allocates_no_more_than_it_does_today() {
    let _turn = turn();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (_cluster, region, ids) = region_with_running_entities().await;
        let region = &region;
        let ask = per_message(|i| {
            let id = &ids[i % ENTITIES];
            async move {
                region.ask(id, 1).await.expect("answered");
            }
        })
        .await;
        println!("local ask: {ask:.2} allocations per ask (goal: 1)");
        assert!(ask > 0.5, "the count sees the ask's own allocations: {ask}");
        assert!(ask <= ASK_CEILING, "{ask:.2} allocations per ask, up from {ASK_CEILING}");
    });
}

#[test]
fn a_local_tell_to_a_running_entity_allocates_no_more_than_it_does_today() {
    let _turn = turn();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let (_cluster, region, ids) = region_with_running_entities().await;
        let region = &region;
        let tell = per_message(|i| {
            let id = &ids[i % ENTITIES];
            async move {
                region.tell(id, 1).expect("sent");
                // Handled before the next, as a sender that keeps up would see it.
                tokio::task::yield_now().await;
            }
        })
        .await;
        let total: u64 = {
            let mut sum = 0;
            for id in &ids {
                sum += region.ask(id, 0).await.expect("answered");
            }
            sum
        };
        let warmed: u64 = (0..20).sum::<u64>() * ENTITIES as u64;
        assert_eq!(total - warmed, MESSAGES as u64, "every tell handled");
        println!("local tell: {tell:.2} allocations per tell");
        assert!(tell <= TELL_CEILING, "{tell:.2} allocations per tell, up from {TELL_CEILING}");
    });
}

/// A remote ask, from a proxy node to the node hosting the entity, both in this process (what
/// is counted is both sides' work: the asker's, the host's and both transports'). The links
/// are up before counting, so the asks go in the binary layout of protocol version 4.
#[test]
fn a_remote_ask_to_a_running_entity_allocates_no_more_than_it_does_today() {
    let _turn = turn();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cluster = TestCluster::start(2).await.expect("the cluster starts");
        cluster.await_converged(Duration::from_secs(30)).await;
        let settings = ShardingSettings { number_of_shards: 10, ..ShardingSettings::default() };
        let counter = |_: &str| Counter::default();
        let _host: ShardRegion<Counter> =
            cluster.node(0).sharding().start("counter", counter, settings.clone()).await.unwrap();
        let proxy: ShardRegion<Counter> = cluster.node(1).sharding().start_proxy("counter", settings).await.unwrap();
        let ids: Vec<String> = (0..ENTITIES).map(|i| format!("c{i}")).collect();
        for round in 0..20 {
            for id in &ids {
                proxy.ask(id, round).await.expect("a running entity answers");
            }
        }
        let proxy = &proxy;
        let ask = per_message(|i| {
            let id = &ids[i % ENTITIES];
            async move {
                proxy.ask(id, 1).await.expect("answered");
            }
        })
        .await;
        println!("remote ask: {ask:.2} allocations per ask");
        assert!(ask > 0.5, "the count sees the ask's own allocations: {ask}");
        assert!(ask <= REMOTE_ASK_CEILING, "{ask:.2} allocations per remote ask, up from {REMOTE_ASK_CEILING}");
    });
}

/// The per-id work of remembering entities in the OR-set delta path, on one thread: a
/// writer's set records a batch of new ids and takes its delta, which is encoded (sent to a
/// peer), decoded there, merged into the peer's set and encoded again (the peer's log record).
/// Both sets already hold 10,000 ids, as a busy shard's slot does.
#[test]
fn remembering_ids_through_the_or_set_delta_path_allocates_no_more_per_id_than_it_does_today() {
    let _turn = turn();
    use ddshard::ddata::{OrSet, OrSetDelta, WriteCtx};
    const BATCH: usize = 50;
    const BATCHES: usize = 200;
    let ctx = WriteCtx::new("n1#1", 1);
    let (mut writer, mut peer) = (OrSet::default(), OrSet::default());
    let seed: Vec<String> = (0..10_000).map(|i| format!("seed-{i}")).collect();
    writer.add_all(&ctx, &seed);
    peer.merge_delta(&writer.take_delta().expect("a delta")).expect("merged");
    let batches: Vec<Vec<String>> =
        (0..BATCHES).map(|b| (0..BATCH).map(|i| format!("entity-{b}-{i}")).collect()).collect();
    let thread_count = || THREAD_ALLOCATIONS.with(|n| n.get());
    let before = thread_count();
    for batch in &batches {
        writer.add_all(&ctx, batch);
        let delta = writer.take_delta().expect("a delta");
        let sent = rmp_serde::to_vec(&delta).expect("encodes");
        let received: OrSetDelta = rmp_serde::from_slice(&sent).expect("decodes");
        peer.merge_delta(&received).expect("merged");
        let logged = rmp_serde::to_vec(&received).expect("encodes");
        assert!(logged.len() > BATCH * 8, "the log record holds the batch");
    }
    let per_id = (thread_count() - before) as f64 / (BATCH * BATCHES) as f64;
    assert_eq!(peer, writer, "the peer holds what the writer holds");
    assert_eq!(peer.len(), 10_000 + BATCH * BATCHES);
    println!("OR-set delta path: {per_id:.2} allocations per remembered id");
    assert!(per_id > 1.0, "the count sees the ids' own allocations: {per_id}");
    assert!(per_id <= DELTA_PATH_CEILING, "{per_id:.2} allocations per id, up from {DELTA_PATH_CEILING}");
}

/// Today's counts with a margin for amortized growth (measured 2026-11-28: 1.02 per ask, 0.78
/// per tell). Before: 5.02 and 4.36–4.56; then 3.01 and 2.54 once a run's context shared the
/// shard core's ids; then these, once the default extractor's shard id was no longer built per
/// message (an integer formatted into a new `String`: an allocation and a reallocation). What
/// an ask keeps is its oneshot. Counted one test at a time and less the idle cluster's own
/// allocations (2026-11-29): 1.01 per ask and 0.00 per tell. The 0.78 per tell before was the
/// other tests' allocations and the cluster's timers, counted in with the tells.
const ASK_CEILING: f64 = 1.5;
const TELL_CEILING: f64 = 0.25;
/// A remote ask, both sides (measured 2026-11-29): 20.04 in the rmp layout; 8.79 in the binary
/// layout, which borrows ids from the frame and encodes payload and answer straight into the
/// peer's queue; 2.04 once each writer swaps its buffer with its queue's instead of handing
/// the written one away (an allocation per write, on both sides of both frames). What is left
/// is the ask's oneshot and its entity id in the ask table. 1.98 less the idle cluster's
/// allocations (2026-11-29; 2.81–3.11 counted raw on a machine where the loop took 6 s).
const REMOTE_ASK_CEILING: f64 = 2.5;
/// The OR-set delta path, per remembered id (measured 2026-11-29): 13.00 when each encode
/// copied the delta whole first; 8.88 once it encodes from the delta in place; 2.88 once an
/// element's dots are held inline (in the delta, and in a merge's working lists, which had a
/// `Vec` and a `BTreeSet` each). What is left is the id's `String` in the writer's delta and in
/// the decoded one, and the sets' amortized growth.
const DELTA_PATH_CEILING: f64 = 3.5;
