//! Membership over gossip: convergence, age order, failure detection, leave, foreign clusters.

use std::time::Duration;

use ddshard::testkit::{TestCluster, eventually, test_config};
use ddshard::{MemberStatus, Node};

const CONVERGE: Duration = Duration::from_secs(30);

fn ids(node: &Node) -> Vec<String> {
    node.members().iter().map(|m| m.node_id().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_agree_on_members_and_oldest_and_a_later_sixth_is_youngest_everywhere() {
    let mut c = TestCluster::start(5).await.unwrap();
    c.await_converged(CONVERGE).await;
    let first = ids(c.node(0));
    assert_eq!(first.len(), 5);
    for (_, n) in c.running() {
        assert_eq!(ids(n), first, "same age order on {}", n.node_id());
        assert_eq!(n.membership().oldest(None).unwrap().node_id(), "n1");
    }
    let i = c.add_node().await.unwrap();
    c.await_converged(CONVERGE).await;
    for (_, n) in c.running() {
        let order = ids(n);
        assert_eq!(order.last().map(String::as_str), Some("n6"), "n6 youngest on {}", n.node_id());
        assert_eq!(order[..5], first[..], "older members keep their order on {}", n.node_id());
        assert_eq!(n.membership().oldest(None).unwrap().node_id(), "n1");
    }
    let up6 = c.node(i).membership().self_member().unwrap().up_number().unwrap();
    let max_before = c.node(0).members()[..5].iter().map(|m| m.up_number().unwrap()).max().unwrap();
    assert!(up6 > max_before);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abruptly_killed_node_is_seen_unreachable_and_stays_listed() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let mut events = c.node(0).subscribe_events();
    c.kill(2).await;
    for i in [0, 1] {
        let n = c.node(i).clone();
        eventually(Duration::from_secs(15), "n3 unreachable", || {
            let n = n.clone();
            async move { n.members().iter().find(|m| m.node_id() == "n3").filter(|m| !m.is_reachable()).map(|_| ()) }
        })
        .await;
    }
    let saw_unreachable = eventually(Duration::from_secs(5), "unreachable event", || {
        let mut found = None;
        while let Ok(ev) = events.try_recv() {
            if matches!(&ev, ddshard::MemberEvent::Unreachable(m) if m.node_id() == "n3") {
                found = Some(());
            }
        }
        std::future::ready(found)
    })
    .await;
    assert_eq!(saw_unreachable, ());
    assert_eq!(c.node(0).members().len(), 3, "unreachable members are still listed");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gracefully_leaving_node_is_removed_everywhere() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let leaving = c.node(1).clone();
    leaving.leave().await.unwrap();
    assert!(leaving.is_shut_down());
    for i in [0, 2] {
        let n = c.node(i).clone();
        eventually(Duration::from_secs(15), "n2 removed", || {
            let n = n.clone();
            async move { (!ids(&n).contains(&"n2".to_string())).then_some(()) }
        })
        .await;
        assert_eq!(ids(&n), ["n1", "n3"]);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_whose_seeds_name_another_clusters_node_take_nothing_from_its_gossip_replies() {
    // A misconfigured seed list: every joining member gossips first to a node of another
    // cluster, which answers each of them. Neither side may admit the other.
    let dir = tempfile::tempdir().unwrap();
    let foreign = Node::start(test_config("stranger", dir.path(), "another-cluster")).await.unwrap();
    let stranger = foreign.gossip_addr();
    let c = TestCluster::start_with(3, move |i, cfg| {
        if i > 0 {
            cfg.seeds.insert(0, stranger.into());
        }
    })
    .await
    .unwrap();
    c.await_converged(CONVERGE).await;
    let nodes: Vec<Node> = c.running().map(|(_, n)| n.clone()).collect();
    // Several gossip rounds with the stranger in every member's seed list, checked throughout.
    for _ in 0..20 {
        for n in &nodes {
            assert_eq!(ids(n).len(), 3, "{} lists its own cluster only: {:?}", n.node_id(), ids(n));
            assert!(!ids(n).contains(&"stranger".to_string()), "stranger admitted on {}", n.node_id());
        }
        assert_eq!(ids(&foreign), ["stranger"], "the stranger took no member of the other cluster");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    foreign.shutdown().await;
    let mut c = c;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_with_another_cluster_id_never_appears_in_any_member_list() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let dir = tempfile::tempdir().unwrap();
    let mut foreign_cfg = test_config("intruder", dir.path(), "another-cluster");
    foreign_cfg.seeds = vec![c.node(0).gossip_addr().into()];
    let foreign = Node::start(foreign_cfg).await.unwrap();
    // A legitimate node that joins after the intruder had the same chance to gossip.
    c.add_node().await.unwrap();
    let nodes: Vec<Node> = c.running().map(|(_, n)| n.clone()).collect();
    eventually(CONVERGE, "n3 joined while the intruder stays out", || {
        let nodes = nodes.clone();
        let foreign = foreign.clone();
        async move {
            for n in &nodes {
                assert!(!ids(n).contains(&"intruder".to_string()), "intruder admitted on {}", n.node_id());
            }
            assert_eq!(ids(&foreign), ["intruder"], "intruder sees only itself");
            nodes
                .iter()
                .all(|n| ids(n).len() == 3 && n.members().iter().all(|m| m.status() == MemberStatus::Up))
                .then_some(())
        }
    })
    .await;
    assert_eq!(foreign.members()[0].status(), MemberStatus::Joining, "nobody let it in");
    foreign.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_node_is_a_new_incarnation_and_the_youngest() {
    let mut c = TestCluster::start(3).await.unwrap();
    c.await_converged(CONVERGE).await;
    let old = c.node(0).address().clone();
    // n2 and n3 may have become Up in either order; n1 goes to the end after its restart.
    let mut expected: Vec<String> = ids(c.node(1)).into_iter().filter(|id| id != "n1").collect();
    expected.push("n1".to_string());
    c.restart(0).await.unwrap();
    c.await_converged(CONVERGE).await;
    let new = c.node(0).address().clone();
    assert_eq!(new.node_id, old.node_id);
    assert!(new.generation > old.generation);
    for (_, n) in c.running() {
        assert_eq!(ids(n), expected, "on {}", n.node_id());
        assert_eq!(n.membership().member("n1").unwrap().address(), &new);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_id_started_again_elsewhere_stops_the_older_incarnation_with_the_reason() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    let old = c.node(1).clone();
    assert_eq!(old.stop_reason(), None);
    // The same node id from another data dir (a restarted VM, a copied config): a newer
    // incarnation. The old one must not keep acting as n2 beside it.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config("n2", dir.path(), "test-cluster");
    cfg.seeds = vec![c.node(0).gossip_addr().into()];
    let newer = Node::start(cfg).await.unwrap();
    assert!(newer.address().generation > old.address().generation);
    eventually(CONVERGE, "the older incarnation stops by itself", || {
        std::future::ready(old.is_shut_down().then_some(()))
    })
    .await;
    let reason = old.stop_reason().unwrap();
    assert!(reason.contains("superseded") && reason.contains(&newer.address().to_string()), "{reason}");
    assert_eq!(newer.stop_reason(), None, "the newer incarnation keeps running");
    let n1 = c.node(0).clone();
    eventually(CONVERGE, "n1 lists the newer n2 as Up and not the older", || {
        let m = n1.members();
        let n2: Vec<_> = m.iter().filter(|m| m.node_id() == "n2").collect();
        std::future::ready(
            (n2.len() == 1 && n2[0].address() == newer.address() && n2[0].status() == MemberStatus::Up).then_some(()),
        )
    })
    .await;
    newer.shutdown().await;
    c.shutdown().await;
}

/// Review finding S18: n3 restarted on an empty data dir on a host whose clock is behind the one
/// its predecessor started under gets a generation below the predecessor's, still in gossip.
/// The start sees that while joining, stops once with the reason, and records the predecessor's
/// generation in its data dir; the next start on that dir takes a higher generation and joins.
/// Before, every start yielded to the predecessor as if to a successor, in a loop, until the
/// clock caught up (or the predecessor's gossip state expired, up to an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_whose_clock_is_behind_its_predecessors_stops_once_then_joins_above_it() {
    let mut c = TestCluster::start(2).await.unwrap();
    c.await_converged(CONVERGE).await;
    // The predecessor: n3 started under a clock an hour ahead of this one (its data dir's
    // generation floor stands in for that clock).
    let ahead = ddshard::clock::wall_ms() + 3_600_000;
    let predecessor_dir = tempfile::tempdir().unwrap();
    {
        let store = ddshard::ddata::DurableStore::open(&predecessor_dir.path().join("ddata"), 1 << 20).unwrap();
        store.raise_generation_floor(ahead).unwrap();
    }
    let start = |dir: &std::path::Path| {
        let mut cfg = test_config("n3", dir, "test-cluster");
        cfg.seeds = vec![c.node(0).gossip_addr().into()];
        Node::start(cfg)
    };
    let predecessor = start(predecessor_dir.path()).await.unwrap();
    assert!(predecessor.address().generation > ahead);
    let n1 = c.node(0).clone();
    eventually(CONVERGE, "the predecessor is Up", || {
        std::future::ready(
            n1.members()
                .iter()
                .any(|m| m.address() == predecessor.address() && m.status() == MemberStatus::Up)
                .then_some(()),
        )
    })
    .await;
    predecessor.shutdown().await;
    // Its host is gone; n3 restarts elsewhere, on an empty data dir, under the real clock.
    let fresh = tempfile::tempdir().unwrap();
    let behind = start(fresh.path()).await.unwrap();
    assert!(behind.address().generation < predecessor.address().generation);
    eventually(CONVERGE, "the start that is behind stops by itself", || {
        std::future::ready(behind.is_shut_down().then_some(()))
    })
    .await;
    let reason = behind.stop_reason().unwrap();
    assert!(
        reason.contains("below its predecessor") && reason.contains(&predecessor.address().to_string()),
        "{reason}"
    );
    behind.shutdown().await;
    drop(behind);
    // The next start on the same dir is above the predecessor, and joins.
    let next = start(fresh.path()).await.unwrap();
    assert!(next.address().generation > predecessor.address().generation, "{}", next.address());
    eventually(CONVERGE, "n1 lists the next n3 as Up", || {
        std::future::ready(
            n1.members().iter().any(|m| m.address() == next.address() && m.status() == MemberStatus::Up).then_some(()),
        )
    })
    .await;
    assert_eq!(next.stop_reason(), None);
    next.shutdown().await;
    c.shutdown().await;
}

/// Seeds through the system resolver (`/etc/hosts` here): a node whose first seed is a host
/// name resolving to its own gossip address forms the cluster, and a node given that name
/// joins it — the way a StatefulSet names its pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_given_as_host_names_are_resolved_and_the_first_forms_the_cluster_when_it_names_itself() {
    ddshard::testkit::init_test_tracing();
    let port = ddshard::testkit::unused_port([127, 0, 0, 1].into());
    let seed: ddshard::SeedAddr = format!("localhost:{port}").parse().unwrap();
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let mut first = ddshard::testkit::test_config("n1", dirs[0].path(), "named-seeds");
    first.gossip_addr = format!("127.0.0.1:{port}").parse().unwrap();
    first.seeds = vec![seed.clone()];
    first.membership.seed_node_timeout = Duration::from_millis(500);
    let n1 = Node::start(first).await.unwrap();
    let mut second = ddshard::testkit::test_config("n2", dirs[1].path(), "named-seeds");
    second.seeds = vec![seed];
    let n2 = Node::start(second).await.unwrap();
    eventually(Duration::from_secs(30), "both nodes up in one cluster", || {
        let up = |n: &Node| n.members().iter().filter(|m| m.status() == MemberStatus::Up).count();
        std::future::ready((up(&n1) == 2 && up(&n2) == 2).then_some(()))
    })
    .await;
    n2.shutdown().await;
    n1.shutdown().await;
}

/// Listen here, reach me there: each node binds gossip and messaging on every interface
/// (`0.0.0.0`, port 0) and advertises a loopback address with the bound port; the cluster
/// forms on the advertised addresses and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_bound_to_every_interface_form_a_cluster_on_their_advertised_addresses() {
    let secret = ddshard::ClusterSecret::generate();
    let mut c = TestCluster::start_with(3, move |_, cfg| {
        cfg.cluster_secret = Some(secret.clone());
        cfg.gossip_addr = "0.0.0.0:0".parse().unwrap();
        cfg.messaging_addr = "0.0.0.0:0".parse().unwrap();
        cfg.gossip_advertise = Some("127.0.0.1:0".parse().unwrap());
        cfg.messaging_advertise = Some("127.0.0.1:0".parse().unwrap());
    })
    .await
    .unwrap();
    c.await_converged(Duration::from_secs(30)).await;
    for i in 0..3 {
        let n = c.node(i);
        assert!(n.gossip_addr().ip().is_loopback() && n.gossip_addr().port() != 0, "{}", n.gossip_addr());
        for m in n.members() {
            assert!(m.messaging_addr().ip().is_loopback(), "{} is listed at {}", m.node_id(), m.messaging_addr());
        }
    }
    c.node(2)
        .replicator()
        .update::<ddshard::ddata::GSet, _>("advertised", ddshard::Consistency::All, Duration::from_secs(10), |s, _| {
            s.insert("x")
        })
        .await
        .expect("messaging between the advertised addresses");
    c.shutdown().await;
}
