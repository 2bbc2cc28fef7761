//! Local and majority writes in the replicator core: the pending local deltas (the cap, the
//! interval's broadcast), what a majority write carries and waits for, and operation ids.
use super::*;

#[test]
fn local_updates_past_the_pending_delta_cap_are_shipped_at_once_not_on_the_interval() {
    let mut a = core("a");
    let now = Instant::now();
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("b"), true)],
        gossip_targets: vec![peer("b")],
        standing: vec![],
        leaving: vec![],
    };
    a.handle(members, now, 0, &mut vec![]);
    // The roster the membership wrote ships on the first interval.
    a.handle(ReplicatorInput::Tick, now, 1, &mut vec![]);
    let shipped = |out: &[ReplicatorAction<u32>]| {
        out.iter().any(|x| matches!(x, ReplicatorAction::Broadcast { msg: ReplicatorMsg::DeltaPropagation { .. }, .. }))
    };
    // Up to the cap the deltas wait for the interval.
    let mut out = Vec::new();
    update(
        &mut a,
        "k",
        Consistency::Local,
        or_add((0..MAX_PENDING_DELTA_ELEMENTS).map(|i| format!("e{i}")).collect()),
        &mut out,
    );
    assert!(!shipped(&out), "at the cap: still pending");
    // One update that takes the count past it, well past, ships everything at once.
    let mut out = Vec::new();
    update(&mut a, "k2", Consistency::Local, or_add((0..10).map(|i| format!("f{i}")).collect()), &mut out);
    assert!(shipped(&out), "past the cap: shipped without waiting for the interval");
    assert!(a.pending_deltas.is_empty());
}

#[test]
fn a_modify_that_returns_a_new_value_for_a_key_that_has_one_changes_it_only_in_place() {
    let mut a = core("a");
    local(&mut a, "k", or_add(vec!["p".into()]));
    // Against the contract: it adds in place and also returns a whole other value.
    let replaces: Modify = Box::new(|cur, ctx| {
        if let Some(ReplicatedData::OrSet(s)) = cur {
            s.add(ctx, "q");
        }
        let mut other = OrSet::default();
        other.add(ctx, "other");
        Ok(Some(ReplicatedData::OrSet(other)))
    });
    local(&mut a, "k", replaces);
    let Some(ReplicatedData::OrSet(s)) = a.local_value("k") else { panic!("an OR-set") };
    assert_eq!(s.members(), ["p".to_string(), "q".to_string()].into());
}

#[test]
fn a_majority_write_waits_out_its_whole_timeout_before_failing() {
    let mut c = core_with_replicas("a", vec![(peer("b"), true), (peer("c"), true)]);
    let now = Instant::now();
    let mut out = Vec::new();
    update(&mut c, "k", Consistency::MAJORITY, or_add(vec!["x".into()]), &mut out);
    let replied = |out: &[ReplicatorAction<u32>]| out.iter().any(|x| matches!(x, ReplicatorAction::ReplyUpdate { .. }));
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now + Duration::from_millis(500), 1, &mut out);
    assert!(!replied(&out), "half-way through its timeout: still waiting: {out:?}");
    let mut out = Vec::new();
    c.handle(ReplicatorInput::Tick, now + Duration::from_secs(6), 1, &mut out);
    assert!(
        out.iter()
            .any(|x| matches!(x, ReplicatorAction::ReplyUpdate { result: Err(Error::ConsistencyTimeout { .. }), .. })),
        "{out:?}"
    );
}

#[test]
fn a_majority_write_carries_the_keys_earlier_local_changes_with_it() {
    let mut a = core("a");
    let peers = vec![(peer("b"), true), (peer("c"), true)];
    a.handle(
        ReplicatorInput::Members {
            holder: true,
            replicas: peers,
            gossip_targets: vec![peer("b"), peer("c")],
            standing: vec![],
            leaving: vec![],
        },
        Instant::now(),
        0,
        &mut vec![],
    );
    local(&mut a, "k", or_add(vec!["earlier".into()]));
    assert!(a.pending_deltas.contains_key("k"));
    let mut out = Vec::new();
    update(&mut a, "k", Consistency::MAJORITY, or_add(vec!["now".into()]), &mut out);
    let entries = out
        .iter()
        .find_map(|x| match x {
            ReplicatorAction::Broadcast { msg: ReplicatorMsg::WriteDelta { entries, .. }, .. } => Some(entries.clone()),
            _ => None,
        })
        .expect("a WriteDelta");
    let [(key, ReplicatedDelta::OrSet(d))] = &entries[..] else { panic!("{entries:?}") };
    let mut at_replica = OrSet::default();
    at_replica.merge_delta(d).unwrap();
    assert_eq!((key.as_str(), at_replica.members()), ("k", ["earlier".to_string(), "now".to_string()].into()));
    assert!(!a.pending_deltas.contains_key("k"), "what rode along is not shipped again");
}

#[test]
fn pending_local_deltas_are_shipped_to_every_gossip_target_once_and_to_nobody_without_targets() {
    let now = Instant::now();
    let broadcasts = |out: &[ReplicatorAction<u32>]| {
        out.iter()
            .filter_map(|x| match x {
                ReplicatorAction::Broadcast { to, msg: ReplicatorMsg::DeltaPropagation { entries } } => {
                    Some((to.len(), entries.len()))
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // Alone: nothing to ship to, no broadcast at all.
    let mut alone = core("a");
    alone.handle(ReplicatorInput::Tick, now, 1, &mut vec![]);
    local(&mut alone, "k", or_add(vec!["x".into()]));
    let mut out = Vec::new();
    alone.handle(ReplicatorInput::Tick, now + Duration::from_secs(10), 1, &mut out);
    assert_eq!(broadcasts(&out), vec![], "{out:?}");
    // Two targets, three keys changed: one message to both, six deltas counted.
    let mut a = core("a");
    let members = ReplicatorInput::Members {
        holder: true,
        replicas: vec![(peer("b"), true), (peer("c"), true)],
        gossip_targets: vec![peer("b"), peer("c")],
        standing: vec![],
        leaving: vec![],
    };
    a.handle(members, now, 0, &mut vec![]);
    // The roster the membership wrote ships on the first interval.
    a.handle(ReplicatorInput::Tick, now, 1, &mut vec![]);
    let sent_before = a.stats.deltas_sent.load(std::sync::atomic::Ordering::Relaxed);
    for key in ["k1", "k2", "k3"] {
        local(&mut a, key, or_add(vec!["x".into()]));
    }
    let mut out = Vec::new();
    a.handle(ReplicatorInput::Tick, now + Duration::from_secs(10), 1, &mut out);
    assert_eq!(broadcasts(&out), vec![(2, 3)], "{out:?}");
    assert_eq!(a.stats.deltas_sent.load(std::sync::atomic::Ordering::Relaxed) - sent_before, 6);
}

#[test]
fn concurrent_majority_writes_get_their_own_operation_and_complete_on_their_own_acks() {
    let mut a = core_with_replicas("a", vec![(peer("b"), true), (peer("c"), true)]);
    let start = |a: &mut ReplicatorCore<u32>, key: &str, reply: u32| {
        let mut out = Vec::new();
        let input = ReplicatorInput::Update {
            key: key.into(),
            consistency: Consistency::MAJORITY,
            timeout: Duration::from_secs(5),
            modify: or_add(vec!["x".into()]),
            reply,
        };
        a.handle(input, Instant::now(), 1, &mut out);
        write_op(&out)
    };
    let (first, second) = (start(&mut a, "k1", 1), start(&mut a, "k2", 2));
    assert_ne!(first, second);
    let mut out = Vec::new();
    a.handle(
        ReplicatorInput::Remote { from: peer("b"), msg: ReplicatorMsg::WriteAck { op: first } },
        Instant::now(),
        1,
        &mut out,
    );
    commit_all(&mut a, &mut out);
    let replies: Vec<u32> = out
        .iter()
        .filter_map(|x| match x {
            ReplicatorAction::ReplyUpdate { reply, result: Ok(_) } => Some(*reply),
            _ => None,
        })
        .collect();
    assert_eq!(replies, vec![1], "the first write's ack completes the first write only");
}
