//! Readiness as an orchestrator's probe needs it (pure; the clock is an input).
//!
//! Guarantee: a node that was ready stays ready while its regions' coordinator moves — a
//! coordinator fail-over makes every region unregistered at once on every node, and a probe
//! that followed it would take every node out of service together. It turns unready when it
//! cannot serve: it stopped, it is not Up (joining, leaving, downed, removed), its storage is
//! failing, a region was refused or does not answer, or a region has had no coordinator for
//! longer than `readiness.coordinator_grace`. Until it first was ready, every condition counts
//! at once (a starting node is not ready before its regions registered).

use std::collections::HashMap;
use std::time::Duration;

use crate::clock::Instant;

/// Whether a node is ready to serve: Up, durable data loaded, every started region
/// registered with its coordinator.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Readiness {
    /// All conditions hold.
    pub ready: bool,
    /// The conditions that do not hold, one line each.
    pub not_ready_because: Vec<String>,
}

/// What the node sees of one region when probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RegionState {
    Registered,
    /// Not registered with its coordinator (yet, or again while the coordinator moves).
    Unregistered,
    /// Refused by its coordinator (its shard-id extractor differs).
    Refused,
    /// Its task did not answer: the error.
    NotAnswering(String),
}

/// One probe's view of the node.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observation {
    /// Why the node stopped, if it did.
    pub stopped: Option<String>,
    /// Its own status key (`up`, `leaving`, …), `None` while it is not a member yet.
    pub status: Option<&'static str>,
    /// The storage's last error while it is unhealthy.
    pub storage_failing: Option<String>,
    /// Each region by type name.
    pub regions: Vec<(String, RegionState)>,
}

/// The latch: whether the node was ready once, and since when each region is unregistered.
#[derive(Debug)]
pub(crate) struct ReadinessLatch {
    grace: Duration,
    latched: bool,
    unregistered_since: HashMap<String, Instant>,
}

impl ReadinessLatch {
    pub(crate) fn new(coordinator_grace: Duration) -> Self {
        ReadinessLatch { grace: coordinator_grace, latched: false, unregistered_since: HashMap::new() }
    }

    /// Ready or not, with every reason it is not.
    pub(crate) fn observe(&mut self, o: Observation, now: Instant) -> (bool, Vec<String>) {
        let mut missing = Vec::new();
        if let Some(reason) = o.stopped {
            missing.push(format!("the node stopped: {reason}"));
        }
        match o.status {
            Some("up") => {}
            Some(status) => missing.push(format!("this member is {status}, not up")),
            None => missing.push("this member is not in the membership yet".to_string()),
        }
        if let Some(error) = o.storage_failing {
            missing.push(format!("the storage is failing: {error}"));
        }
        self.unregistered_since
            .retain(|name, _| o.regions.iter().any(|(n, s)| n == name && *s == RegionState::Unregistered));
        for (name, state) in o.regions {
            match state {
                RegionState::Registered => {}
                RegionState::Refused => missing
                    .push(format!("region {name} was refused by its coordinator (its shard-id extractor differs)")),
                RegionState::NotAnswering(e) => missing.push(format!("region {name} does not answer: {e}")),
                RegionState::Unregistered => {
                    let since = *self.unregistered_since.entry(name.clone()).or_insert(now);
                    let without = now.saturating_duration_since(since);
                    if !self.latched {
                        missing.push(format!("region {name} is not registered with its coordinator yet"));
                    } else if without >= self.grace {
                        missing.push(format!(
                            "region {name} has had no coordinator for {without:?} (readiness.coordinator_grace: {:?})",
                            self.grace
                        ));
                    }
                }
            }
        }
        let ready = missing.is_empty();
        self.latched |= ready;
        (ready, missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);

    fn up(regions: &[(&str, RegionState)]) -> Observation {
        Observation {
            status: Some("up"),
            regions: regions.iter().map(|(n, s)| (n.to_string(), s.clone())).collect(),
            ..Observation::default()
        }
    }

    #[test]
    fn a_node_is_ready_once_up_with_every_region_registered_and_stays_ready_while_its_coordinator_moves() {
        let t0 = Instant::now();
        let mut l = ReadinessLatch::new(GRACE);
        let (ready, why) = l.observe(Observation { status: None, ..Observation::default() }, t0);
        assert!(!ready && why[0].contains("not in the membership"), "{why:?}");
        let (ready, why) = l.observe(up(&[("cart", RegionState::Unregistered)]), t0);
        assert!(!ready && why[0].contains("not registered"), "before it was ready, a region must register: {why:?}");
        assert_eq!(l.observe(up(&[("cart", RegionState::Registered)]), t0), (true, vec![]));
        // The coordinator moves: every region unregistered, the node stays ready within the grace.
        let moving = up(&[("cart", RegionState::Unregistered)]);
        assert!(l.observe(moving.clone(), t0 + Duration::from_secs(1)).0);
        assert!(
            l.observe(moving.clone(), t0 + Duration::from_secs(30)).0,
            "grace counted from the first probe that saw it"
        );
        let (ready, why) = l.observe(moving.clone(), t0 + Duration::from_secs(31));
        assert!(!ready && why[0].contains("no coordinator for 30s"), "{why:?}");
        // Registered again: ready, and a later move gets a fresh grace.
        assert!(l.observe(up(&[("cart", RegionState::Registered)]), t0 + Duration::from_secs(32)).0);
        assert!(l.observe(moving, t0 + Duration::from_secs(61)).0);
    }

    #[test]
    fn a_ready_node_turns_unready_when_it_cannot_serve_whatever_the_latch() {
        let t0 = Instant::now();
        let mut l = ReadinessLatch::new(GRACE);
        assert!(l.observe(up(&[("cart", RegionState::Registered)]), t0).0);
        let cases: Vec<(Observation, &str)> = vec![
            (Observation { status: Some("leaving"), ..up(&[]) }, "leaving, not up"),
            (Observation { status: Some("down"), ..up(&[]) }, "down, not up"),
            (Observation { stopped: Some("downed".into()), ..up(&[]) }, "stopped: downed"),
            (Observation { storage_failing: Some("map full".into()), ..up(&[]) }, "storage is failing: map full"),
            (up(&[("cart", RegionState::Refused)]), "refused"),
            (up(&[("cart", RegionState::NotAnswering("closed".into()))]), "does not answer: closed"),
        ];
        for (o, why) in cases {
            let (ready, reasons) = l.observe(o, t0);
            assert!(!ready && reasons.iter().any(|r| r.contains(why)), "{why}: {reasons:?}");
        }
        assert!(l.observe(up(&[("cart", RegionState::Registered)]), t0).0, "and ready again once it can");
    }

    #[test]
    fn each_region_has_its_own_grace() {
        let t0 = Instant::now();
        let mut l = ReadinessLatch::new(GRACE);
        assert!(l.observe(up(&[("a", RegionState::Registered), ("b", RegionState::Registered)]), t0).0);
        assert!(l.observe(up(&[("a", RegionState::Unregistered), ("b", RegionState::Registered)]), t0).0);
        let later = t0 + Duration::from_secs(20);
        assert!(l.observe(up(&[("a", RegionState::Unregistered), ("b", RegionState::Unregistered)]), later).0);
        let (ready, why) =
            l.observe(up(&[("a", RegionState::Unregistered), ("b", RegionState::Unregistered)]), t0 + GRACE);
        assert!(!ready && why.len() == 1 && why[0].contains("region a"), "{why:?}");
    }
}
