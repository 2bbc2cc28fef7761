//! Real LMDB failures on a node (not a messaging cut): an undecodable value in a valid store, a
//! corrupt generation record, a full map at its maximum. Each is a typed error for what it
//! touches; the node stays up or refuses to start with a storage error; nothing acknowledged is
//! lost.

use std::collections::BTreeSet;
use std::time::Duration;

use ddshard::ddata::durable::StoreOp;
use ddshard::ddata::{DurableStore, OrSet};
use ddshard::testkit::TestCluster;
use ddshard::{Consistency, Error};

const OP: Duration = Duration::from_secs(5);
const CONVERGE: Duration = Duration::from_secs(30);

fn members(set: Option<OrSet>) -> BTreeSet<String> {
    set.map(|s| s.members()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_value_in_a_valid_store_costs_its_key_only_and_the_node_starts() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    let r = c.node(0).replicator().clone();
    for (key, id) in [("shard-a-0", "x"), ("shard-b-0", "y")] {
        r.update::<OrSet, _>(key, Consistency::MAJORITY, OP, move |s, ctx| s.add(ctx, id)).await.unwrap();
    }
    c.kill(0).await;
    {
        // A snapshot newer than everything, whose bytes are no value.
        let store = DurableStore::open(&c.data_dir(0).join("ddata"), 64 << 20).unwrap();
        store
            .apply(&[StoreOp::Snapshot { key: "shard-a-0".into(), seq: u64::MAX / 2, bytes: vec![0xc1; 40] }])
            .unwrap();
    }
    c.restart(0).await.expect("a bad value does not stop the node from starting");
    let r = c.node(0).replicator().clone();
    assert_eq!(r.stats().rejected, 1, "the skipped value is counted");
    let b = r.get::<OrSet>("shard-b-0", Consistency::Local, OP).await.unwrap();
    assert_eq!(members(b), BTreeSet::from(["y".to_string()]), "the other key loaded intact");
    assert!(r.get::<OrSet>("shard-a-0", Consistency::Local, OP).await.unwrap().is_none(), "the bad key is skipped");
    // The key works again: a new write goes through and is durable.
    r.update::<OrSet, _>("shard-a-0", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "z")).await.unwrap();
    // The store lost adds of its writer in the skipped key, so it writes under a new identity
    // (it cannot claim its skipped counters dead where it no longer knows its own dots).
    r.update::<OrSet, _>("shard-b-0", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "y2")).await.unwrap();
    let writers = |s: Option<OrSet>| s.map(|s| s.writers().map(str::to_string).collect::<Vec<_>>()).unwrap_or_default();
    let b = writers(r.get::<OrSet>("shard-b-0", Consistency::Local, OP).await.unwrap());
    assert_eq!(b.len(), 2, "the old and the renewed store writer: {b:?}");
    c.restart(0).await.unwrap();
    let r = c.node(0).replicator().clone();
    let a = r.get::<OrSet>("shard-a-0", Consistency::Local, OP).await.unwrap();
    assert_eq!(members(a), BTreeSet::from(["z".to_string()]));
    r.update::<OrSet, _>("shard-b-0", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "y3")).await.unwrap();
    let after = writers(r.get::<OrSet>("shard-b-0", Consistency::Local, OP).await.unwrap());
    assert_eq!(after, b, "a clean restart keeps the writer");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_generation_record_fails_the_node_start_with_a_typed_storage_error() {
    let mut c = TestCluster::start(1).await.unwrap();
    c.await_converged(CONVERGE).await;
    c.kill(0).await;
    {
        let dir = c.data_dir(0).join("ddata");
        // SAFETY: the node is stopped; nothing else has this environment open.
        let env = unsafe { heed::EnvOpenOptions::new().max_dbs(4).open(&dir) }.unwrap();
        let wtxn = env.write_txn().unwrap();
        let meta = env
            .create_databases_and_commit(wtxn, |dbo, w| -> heed::Result<_> {
                let meta = dbo.create_database::<heed::types::Str, heed::types::Bytes>(w, Some("meta"))?;
                Ok(heed::CommitOrAbort::<_, ()>::Commit(meta))
            })
            .unwrap()
            .unwrap_commit();
        let mut wtxn = env.write_txn().unwrap();
        meta.put(&mut wtxn, "generation", &[1, 2, 3]).unwrap();
        wtxn.commit().unwrap();
    }
    let err = c.restart(0).await.expect_err("a node must not guess its generation");
    assert!(
        matches!(&err, Error::Storage { .. }) && err.to_string().contains("corrupt generation record"),
        "typed storage error naming the record: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_map_at_its_maximum_refuses_the_write_with_a_typed_error_and_the_node_keeps_serving() {
    let mut c = TestCluster::start_with(1, |_, cfg| {
        cfg.replicator.lmdb_map_size = 1 << 20;
        cfg.replicator.lmdb_max_map_size = 2 << 20;
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let r = c.node(0).replicator().clone();
    r.update::<OrSet, _>("shard-small-0", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "kept")).await.unwrap();
    // About 3 MiB in one value: more than the map may ever grow to.
    let big = r
        .update::<OrSet, _>("shard-big-0", Consistency::MAJORITY, OP, |s, ctx| {
            for i in 0..200 {
                s.add(ctx, format!("{i:05}{}", "b".repeat(15_000)));
            }
        })
        .await;
    assert!(matches!(big, Err(Error::Storage { .. })), "refused with a typed storage error: {big:?}");
    assert!(!r.durable_health().is_healthy(), "the store reports itself unhealthy");
    assert!(r.durable_health().last_error().unwrap().contains("map full"));
    // The node stays up: reads are served, the acknowledged value is intact.
    let small = r.get::<OrSet>("shard-small-0", Consistency::Local, OP).await.unwrap();
    assert_eq!(members(small), BTreeSet::from(["kept".to_string()]));
    assert!(!c.node(0).is_shut_down());
    // One value that can never fit does not poison the store: the next write commits (the
    // refused key is written again only after a backoff, so it does not spin either).
    r.update::<OrSet, _>("shard-small-1", Consistency::MAJORITY, OP, |s, ctx| s.add(ctx, "later")).await.unwrap();
    assert!(r.durable_health().is_healthy(), "the last commit succeeded");
    let failures = r.stats().durable_failures;
    // Without the backoff this was about one failed commit per millisecond.
    assert!(failures <= 5, "{failures} failed commits so soon: the rewrite must back off");
    // After a restart, what was acknowledged is still there.
    c.restart(0).await.unwrap();
    let r = c.node(0).replicator().clone();
    let small = r.get::<OrSet>("shard-small-0", Consistency::Local, OP).await.unwrap();
    assert_eq!(members(small), BTreeSet::from(["kept".to_string()]));
    let later = r.get::<OrSet>("shard-small-1", Consistency::Local, OP).await.unwrap();
    assert_eq!(members(later), BTreeSet::from(["later".to_string()]));
    c.shutdown().await;
}
