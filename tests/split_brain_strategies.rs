//! The split-brain strategies beside keep-majority, each on a real partition of in-process
//! nodes: the side the strategy keeps removes the other, which stops itself (the decision
//! tables for every split shape are in `membership/downing.rs`).

use std::time::Duration;

use ddshard::testkit::{TestCluster, eventually, fast_downing};
use ddshard::{DowningStrategy, MemberStatus, NodeConfig};

const CONVERGE: Duration = Duration::from_secs(30);

async fn cluster(n: usize, strategy: impl Fn(&mut NodeConfig) + Send + Sync + 'static) -> TestCluster {
    let c = TestCluster::start_with(n, move |_, cfg| {
        fast_downing(cfg);
        strategy(cfg);
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    c
}

/// Waits until each of `nodes` (indexes) has stopped itself.
async fn stopped(c: &TestCluster, nodes: &[usize], why: &str) {
    for &i in nodes {
        let n = c.node(i).clone();
        eventually(CONVERGE, &format!("n{} stops: {why}", i + 1), || {
            std::future::ready(n.is_shut_down().then_some(()))
        })
        .await;
    }
}

/// Waits until each of `nodes` lists exactly `members` (node ids), all Up, and checks it still
/// runs.
async fn serving_as(c: &TestCluster, nodes: &[usize], members: &[&str]) {
    for &i in nodes {
        let n = c.node(i).clone();
        let want: Vec<String> = members.iter().map(ToString::to_string).collect();
        eventually(CONVERGE, &format!("n{} keeps running with {members:?}", i + 1), || {
            let n = n.clone();
            let want = want.clone();
            async move {
                let mut ids: Vec<String> = n.members().iter().map(|m| m.node_id().to_string()).collect();
                ids.sort();
                (ids == want && n.members().iter().all(|m| m.status() == MemberStatus::Up)).then_some(())
            }
        })
        .await;
        assert!(!n.is_shut_down(), "n{} is on the side the strategy keeps", i + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_quorum_keeps_a_side_with_the_quorum_and_stops_both_sides_without_one() {
    let mut c = cluster(4, |cfg| {
        cfg.membership.downing = DowningStrategy::StaticQuorum;
        cfg.membership.quorum_size = 3;
    })
    .await;
    // A crash of one of four: three left, exactly the quorum, so they down it and serve on.
    c.kill(3).await;
    serving_as(&c, &[0, 1, 2], &["n1", "n2", "n3"]).await;
    // Then a 2|1 split: neither side holds three members, so both stop (keep-majority would
    // have kept n1 and n2).
    c.partition(&[0, 1], &[2]);
    stopped(&c, &[0, 1, 2], "no side holds a quorum of 3").await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_oldest_keeps_the_minority_side_holding_the_oldest_member() {
    let mut c = cluster(5, |cfg| cfg.membership.downing = DowningStrategy::KeepOldest).await;
    // n1 formed the cluster, so it is the oldest; its side is the smaller one.
    c.partition(&[0, 1], &[2, 3, 4]);
    stopped(&c, &[2, 3, 4], "the side without the oldest member").await;
    serving_as(&c, &[0, 1], &["n1", "n2"]).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_oldest_with_down_if_alone_stops_a_lone_oldest_and_keeps_the_others() {
    let mut c = cluster(3, |cfg| cfg.membership.downing = DowningStrategy::KeepOldest).await;
    c.partition(&[0], &[1, 2]);
    stopped(&c, &[0], "the oldest member is alone on its side").await;
    serving_as(&c, &[1, 2], &["n2", "n3"]).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_all_stops_every_member_on_both_sides_of_a_split() {
    let mut c = cluster(3, |cfg| cfg.membership.downing = DowningStrategy::DownAll).await;
    c.partition(&[0], &[1, 2]);
    stopped(&c, &[0, 1, 2], "down-all").await;
    c.shutdown().await;
}
