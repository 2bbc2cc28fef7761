//! Failure detection on the message path (issue 19, first step): a phi-accrual detector per
//! observed node and a sans-IO heartbeat core.
//!
//! **Why on the message path.** Gossip liveness travels transitively: a node that cannot hear
//! from a peer directly still learns its heartbeat through the others, so a one-way or
//! messaging-only cut is never seen. Heartbeats here travel over the same connections as the
//! entities' messages, from a few observers per node.
//!
//! **Who watches whom.** The members, ordered by address, form a ring; each node observes the
//! `monitored_by` members after it (wrapping), so every member has `monitored_by` observers
//! (fewer in a smaller cluster) and the heartbeat traffic per node is O(k), not O(N). Every
//! node computes the same ring from the same membership, so the observers of a member are
//! known to everyone (the reachability table that later step gossips is keyed by them).
//!
//! **The detector.** Phi accrual (Hayashibara et al.): from the recent inter-arrival times of a
//! node's heartbeat responses, phi is how unlikely the silence since the last one is, on a
//! log10 scale; the node is unreachable once phi exceeds the threshold. The mean is padded by
//! `acceptable_pause` (a GC pause or a busy peer is not a failure) and the standard deviation
//! has a floor (a perfectly regular history would otherwise flag the first late heartbeat). A
//! node observed but never heard from is judged against a first estimate, so a node that was
//! dead from the start is still detected.
//!
//! **Assumptions.** Clocks are this node's monotonic clock only (no wall clock, nothing from
//! the peer is trusted for timing); a response counts only if it answers the latest request
//! sent to that node (sequence numbers), so a peer cannot keep itself alive by replaying or
//! sending unsolicited responses.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::clock::Instant;
use crate::membership::UniqueAddress;

/// Settings of the message-path failure detector (`[failure_detector]` in the config file).
///
/// With the defaults a crashed node is flagged by its observers about 1.5 s after its last
/// answer (the usual interval plus `acceptable_pause`, plus a few deviations), within 3 s of
/// the crash; raising `acceptable_pause` or `threshold` trades slower detection for fewer
/// false suspicions of a node that is only busy (long GC pauses, saturated links).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FailureDetectorSettings {
    /// How often each observer sends a heartbeat request to each node it observes.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// Phi above which a node is unreachable (8 ≈ one false suspicion in 10^8 under the model).
    pub threshold: f64,
    /// Silence tolerated on top of the usual interval before phi rises steeply.
    #[serde(with = "humantime_serde")]
    pub acceptable_pause: Duration,
    /// Floor of the standard deviation of the intervals.
    #[serde(with = "humantime_serde")]
    pub min_std_deviation: Duration,
    /// Intervals kept per observed node.
    pub max_sample_size: usize,
    /// Observers per node: each node watches this many others (a ring by address), so the
    /// heartbeat traffic per node does not grow with the cluster.
    pub monitored_by: usize,
}

impl FailureDetectorSettings {
    /// Checks the settings (called by [`crate::NodeConfig::validate`]).
    pub fn validate(&self) -> crate::error::Result<()> {
        let bad = |m: &str| Err(crate::error::Error::Config(format!("failure_detector.{m}")));
        if self.heartbeat_interval < Duration::from_millis(10) {
            return bad("heartbeat_interval must be at least 10ms");
        }
        if !(self.threshold.is_finite() && self.threshold > 0.0) {
            return bad("threshold must be a finite number > 0");
        }
        if self.min_std_deviation.is_zero() {
            return bad("min_std_deviation must be > 0");
        }
        if !(2..=10_000).contains(&self.max_sample_size) {
            return bad("max_sample_size must be between 2 and 10000");
        }
        if !(1..=super::view::MAX_VERDICTS_PER_OBSERVER).contains(&self.monitored_by) {
            return bad("monitored_by must be between 1 and 64");
        }
        Ok(())
    }
}

impl Default for FailureDetectorSettings {
    fn default() -> Self {
        FailureDetectorSettings {
            heartbeat_interval: Duration::from_millis(500),
            threshold: 8.0,
            acceptable_pause: Duration::from_millis(1_000),
            min_std_deviation: Duration::from_millis(100),
            max_sample_size: 200,
            monitored_by: 5,
        }
    }
}

/// The arrival history of one observed node's heartbeats.
#[derive(Debug, Clone)]
pub(crate) struct PhiAccrual {
    /// Inter-arrival times in milliseconds, oldest first, at most `max_sample_size`.
    intervals: VecDeque<f64>,
    sum: f64,
    sum_of_squares: f64,
    /// The last heartbeat, or the start of observation before the first.
    last: Instant,
    /// Whether a heartbeat arrived yet: the first one ends no interval (the time from the
    /// start of observation to it is a connection set-up, not a heartbeat interval).
    heard: bool,
    max_sample_size: usize,
}

impl PhiAccrual {
    /// A history that starts at `now` (the first request sent) with `first_estimate` as its
    /// one sample, spread a quarter of it either way.
    pub(crate) fn new(now: Instant, first_estimate: Duration, max_sample_size: usize) -> Self {
        let mean = first_estimate.as_secs_f64() * 1_000.0;
        let std = mean / 4.0;
        let mut d = PhiAccrual {
            intervals: VecDeque::new(),
            sum: 0.0,
            sum_of_squares: 0.0,
            last: now,
            heard: false,
            max_sample_size: max_sample_size.max(2),
        };
        // Two samples at mean ± std give exactly that mean and deviation.
        d.push(mean - std);
        d.push(mean + std);
        d
    }

    fn push(&mut self, interval_ms: f64) {
        if self.intervals.len() == self.max_sample_size
            && let Some(old) = self.intervals.pop_front()
        {
            self.sum -= old;
            self.sum_of_squares -= old * old;
        }
        self.intervals.push_back(interval_ms);
        self.sum += interval_ms;
        self.sum_of_squares += interval_ms * interval_ms;
    }

    /// A heartbeat (response) arrived at `now`.
    pub(crate) fn heartbeat(&mut self, now: Instant) {
        if self.heard {
            let interval = now.saturating_duration_since(self.last).as_secs_f64() * 1_000.0;
            self.push(interval);
        }
        self.heard = true;
        self.last = now;
    }

    /// Mean and standard deviation of the intervals in milliseconds, the deviation at least
    /// `min_std_deviation`.
    fn mean_and_std(&self, min_std_deviation: Duration) -> (f64, f64) {
        let n = self.intervals.len() as f64;
        let mean = self.sum / n;
        let variance = (self.sum_of_squares / n - mean * mean).max(0.0);
        (mean, variance.sqrt().max(min_std_deviation.as_secs_f64() * 1_000.0))
    }

    /// How unlikely the silence since the last heartbeat is, given the history (log10 scale).
    pub(crate) fn phi(&self, now: Instant, acceptable_pause: Duration, min_std_deviation: Duration) -> f64 {
        let (mean, std) = self.mean_and_std(min_std_deviation);
        let since = now.saturating_duration_since(self.last).as_secs_f64() * 1_000.0;
        phi(since, mean + acceptable_pause.as_secs_f64() * 1_000.0, std)
    }
}

/// Phi of a silence of `since` ms against intervals of `mean` and `std` ms, with the logistic
/// approximation of the normal distribution's tail (absolute error about 10^-4); finite for
/// any input. The two branches are the same quantity; each is the one that keeps its
/// precision on its side (far in the tail, `1 - 1/(1+e)` would round to 0).
fn phi(since: f64, mean: f64, std: f64) -> f64 {
    let y = (since - mean) / std;
    let e = (-y * (1.5976 + 0.070566 * y * y)).exp();
    let p = if since > mean { e / (1.0 + e) } else { 1.0 - 1.0 / (1.0 + e) };
    // p underflows to 0 far in the tail: cap phi there rather than return infinity.
    -p.max(f64::MIN_POSITIVE).log10()
}

/// The members `me` observes: the `k` after it in the ring of `members` ordered by address.
pub(crate) fn observed_by(me: &UniqueAddress, members: &BTreeSet<UniqueAddress>, k: usize) -> Vec<UniqueAddress> {
    let after = members.range((std::ops::Bound::Excluded(me), std::ops::Bound::Unbounded));
    let before = members.range(..me);
    after.chain(before).filter(|m| *m != me).take(k).cloned().collect()
}

/// The members that observe `subject` (the inverse of [`observed_by`]).
#[cfg(test)]
pub(crate) fn observers_of(subject: &UniqueAddress, members: &BTreeSet<UniqueAddress>, k: usize) -> Vec<UniqueAddress> {
    let before = members.range(..subject).rev();
    let after = members.range((std::ops::Bound::Excluded(subject), std::ops::Bound::Unbounded)).rev();
    before.chain(after).filter(|m| *m != subject).take(k).cloned().collect()
}

/// Inputs of [`HeartbeatCore`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HeartbeatInput {
    /// The members to watch over (every member that is not removed, this node included).
    Members(BTreeSet<UniqueAddress>),
    /// Time passed: send due requests, judge silences.
    Tick,
    /// A peer asks whether this node is alive.
    Request { from: UniqueAddress, seq: u64 },
    /// A peer answered request `seq`.
    Response { from: UniqueAddress, seq: u64 },
}

/// What the driver does for [`HeartbeatCore`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HeartbeatAction {
    SendRequest {
        to: UniqueAddress,
        seq: u64,
    },
    SendResponse {
        to: UniqueAddress,
        seq: u64,
    },
    /// This node's verdict on `subject` changed.
    Verdict {
        subject: UniqueAddress,
        reachable: bool,
    },
}

struct Observed {
    detector: PhiAccrual,
    /// The latest request sent while it is unanswered, and when it was sent.
    pending: Option<u64>,
    sent_at: Instant,
    reachable: bool,
}

/// The heartbeats one node sends, answers and judges.
pub(crate) struct HeartbeatCore {
    me: UniqueAddress,
    settings: FailureDetectorSettings,
    observed: BTreeMap<UniqueAddress, Observed>,
    next_seq: u64,
    /// Requests and responses refused (unknown sender, stale or unsolicited response).
    pub(crate) ignored: u64,
}

impl HeartbeatCore {
    pub(crate) fn new(me: UniqueAddress, settings: FailureDetectorSettings) -> Self {
        HeartbeatCore { me, settings, observed: BTreeMap::new(), next_seq: 1, ignored: 0 }
    }

    /// The nodes this one observes now.
    #[cfg(test)]
    pub(crate) fn observing(&self) -> impl Iterator<Item = &UniqueAddress> {
        self.observed.keys()
    }

    /// The observed nodes this one's verdict is "unreachable" for, in address order: what it
    /// publishes in gossip.
    pub(crate) fn unreachable(&self) -> impl Iterator<Item = &UniqueAddress> {
        self.observed.iter().filter(|(_, o)| !o.reachable).map(|(m, _)| m)
    }

    pub(crate) fn handle(&mut self, input: HeartbeatInput, now: Instant, out: &mut Vec<HeartbeatAction>) {
        match input {
            HeartbeatInput::Members(members) => {
                let want: BTreeSet<UniqueAddress> =
                    observed_by(&self.me, &members, self.settings.monitored_by).into_iter().collect();
                self.observed.retain(|m, _| want.contains(m));
                for m in want {
                    if !self.observed.contains_key(&m) {
                        let detector =
                            PhiAccrual::new(now, self.settings.heartbeat_interval, self.settings.max_sample_size);
                        let seq = self.next_seq;
                        self.next_seq += 1;
                        out.push(HeartbeatAction::SendRequest { to: m.clone(), seq });
                        self.observed
                            .insert(m, Observed { detector, pending: Some(seq), sent_at: now, reachable: true });
                    }
                }
            }
            HeartbeatInput::Tick => self.on_tick(now, out),
            HeartbeatInput::Request { from, seq } => {
                // Any member may ask (it observes this node in its own ring view, which may be
                // a moment ahead of or behind this one's).
                out.push(HeartbeatAction::SendResponse { to: from, seq });
            }
            HeartbeatInput::Response { from, seq } => {
                let Some(o) = self.observed.get_mut(&from).filter(|o| o.pending == Some(seq)) else {
                    self.ignored += 1;
                    return;
                };
                // One sample per request: a duplicate answer must not shrink the intervals.
                o.pending = None;
                o.detector.heartbeat(now);
                if !o.reachable {
                    o.reachable = true;
                    out.push(HeartbeatAction::Verdict { subject: from, reachable: true });
                }
            }
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<HeartbeatAction>) {
        let s = &self.settings;
        for (subject, o) in &mut self.observed {
            if now.saturating_duration_since(o.sent_at) >= s.heartbeat_interval {
                let seq = self.next_seq;
                self.next_seq += 1;
                o.pending = Some(seq);
                o.sent_at = now;
                out.push(HeartbeatAction::SendRequest { to: subject.clone(), seq });
            }
            let available = o.detector.phi(now, s.acceptable_pause, s.min_std_deviation) < s.threshold;
            if available != o.reachable {
                o.reachable = available;
                out.push(HeartbeatAction::Verdict { subject: subject.clone(), reachable: available });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: &str) -> UniqueAddress {
        UniqueAddress::new(n, 1)
    }

    fn ring(n: usize) -> BTreeSet<UniqueAddress> {
        (0..n).map(|i| a(&format!("n{i:02}"))).collect()
    }

    const PAUSE: Duration = Duration::from_millis(1_000);
    const MIN_STD: Duration = Duration::from_millis(100);

    #[test]
    fn phi_is_low_on_time_rises_with_silence_and_stays_finite() {
        let t0 = Instant::now();
        let mut d = PhiAccrual::new(t0, Duration::from_millis(500), 200);
        for i in 1..=20 {
            d.heartbeat(t0 + Duration::from_millis(500 * i));
        }
        let last = t0 + Duration::from_millis(500 * 20);
        let at = |ms: u64| d.phi(last + Duration::from_millis(ms), PAUSE, MIN_STD);
        assert!(at(0) < 0.01, "right after a heartbeat: {}", at(0));
        assert!(at(500) < 1.0, "on time: {}", at(500));
        assert!(at(1_500) > 0.2 && at(1_500) < 8.0, "within the acceptable pause: {}", at(1_500));
        assert!(at(2_200) > 8.0, "well past it: {}", at(2_200));
        let (p1, p2, p3) = (at(1_600), at(1_800), at(2_400));
        assert!(p1 < p2 && p2 < p3, "monotonic in the silence: {p1} {p2} {p3}");
        assert!(at(3_600_000).is_finite(), "an hour of silence: {}", at(3_600_000));
    }

    #[test]
    fn phi_matches_the_normal_tail_and_keeps_its_precision_far_in_it() {
        // The normal distribution's upper tail Q(y) at y standard deviations past the mean.
        for (y, q) in
            [(-3.0, 0.998_65), (-1.0, 0.841_345), (0.0, 0.5), (1.0, 0.158_655), (2.0, 0.022_750_1), (3.0, 0.001_349_9)]
        {
            let p = 10f64.powf(-phi(1_000.0 + y * 100.0, 1_000.0, 100.0));
            assert!((p - q).abs() < 2e-4, "y = {y}: {p} against {q}");
        }
        // Eight deviations out the tail is about 6e-22 (phi ≈ 21), not rounded to nothing.
        let far = phi(1_800.0, 1_000.0, 100.0);
        assert!(far > 20.0 && far < 23.0, "{far}");
    }

    #[test]
    fn the_statistics_follow_the_window_and_the_deviation_has_its_floor() {
        let close = |(m, s): (f64, f64), (em, es): (f64, f64)| (m - em).abs() < 1e-6 && (s - es).abs() < 1e-6;
        let t0 = Instant::now();
        let mut d = PhiAccrual::new(t0, Duration::from_millis(500), 3);
        assert!(close(d.mean_and_std(Duration::ZERO), (500.0, 125.0)), "{:?}", d.mean_and_std(Duration::ZERO));
        // Heartbeats at +0 (starts the history), +200, +600: intervals 200 and 400 push 375
        // out of the window of 3, leaving 625, 200, 400.
        for ms in [0, 200, 600] {
            d.heartbeat(t0 + Duration::from_millis(ms));
        }
        let mean = (625.0 + 200.0 + 400.0) / 3.0;
        let var = (625.0f64 * 625.0 + 200.0 * 200.0 + 400.0 * 400.0) / 3.0 - mean * mean;
        assert!(close(d.mean_and_std(Duration::ZERO), (mean, var.sqrt())), "{:?}", d.mean_and_std(Duration::ZERO));
        // A floor above the deviation replaces it; one below does not.
        assert!(close(d.mean_and_std(Duration::from_millis(500)), (mean, 500.0)));
        assert!(close(d.mean_and_std(Duration::from_millis(10)), (mean, var.sqrt())));
        // Phi is the formula at those figures.
        let now = t0 + Duration::from_millis(600 + 900);
        let expected = phi(900.0, mean + 1_000.0, var.sqrt());
        assert!((d.phi(now, Duration::from_secs(1), Duration::ZERO) - expected).abs() < 1e-9);
    }

    #[test]
    fn a_jittery_history_tolerates_longer_silences_than_a_regular_one() {
        let t0 = Instant::now();
        let mut regular = PhiAccrual::new(t0, Duration::from_millis(500), 200);
        let mut jittery = PhiAccrual::new(t0, Duration::from_millis(500), 200);
        let (mut tr, mut tj) = (t0, t0);
        for i in 0..50u64 {
            tr += Duration::from_millis(500);
            regular.heartbeat(tr);
            tj += Duration::from_millis(if i % 2 == 0 { 100 } else { 900 });
            jittery.heartbeat(tj);
        }
        let silence = Duration::from_millis(1_800);
        assert!(
            jittery.phi(tj + silence, PAUSE, MIN_STD) < regular.phi(tr + silence, PAUSE, MIN_STD),
            "the same mean with more spread is less suspicious"
        );
    }

    #[test]
    fn the_history_keeps_at_most_its_sample_size_and_forgets_the_oldest() {
        let t0 = Instant::now();
        let mut d = PhiAccrual::new(t0, Duration::from_millis(500), 4);
        let mut t = t0;
        // Slow at first, then fast: once the slow ones are forgotten a short silence alarms.
        for _ in 0..4 {
            t += Duration::from_millis(5_000);
            d.heartbeat(t);
        }
        assert!(d.phi(t + Duration::from_millis(3_000), Duration::ZERO, MIN_STD) < 1.0);
        for _ in 0..4 {
            t += Duration::from_millis(100);
            d.heartbeat(t);
        }
        assert_eq!(d.intervals.len(), 4);
        assert!((d.sum - 400.0).abs() < 1e-6, "only the last four: {}", d.sum);
        assert!(d.phi(t + Duration::from_millis(3_000), Duration::ZERO, MIN_STD) > 8.0);
    }

    #[test]
    fn every_member_has_k_observers_and_observes_k_others_on_the_ring() {
        let members = ring(10);
        for m in &members {
            let watched = observed_by(m, &members, 3);
            assert_eq!(watched.len(), 3);
            assert!(!watched.contains(m));
            let watchers = observers_of(m, &members, 3);
            assert_eq!(watchers.len(), 3, "{m}");
            for w in &watchers {
                assert!(observed_by(w, &members, 3).contains(m), "{w} observes {m}");
            }
        }
        // Wrapping: the last member observes the first ones.
        let last = members.iter().next_back().unwrap();
        assert_eq!(observed_by(last, &members, 2), vec![a("n00"), a("n01")]);
        assert_eq!(observers_of(&a("n00"), &members, 2), vec![a("n09"), a("n08")]);
        // A smaller cluster than k: everyone else.
        assert_eq!(observed_by(&a("n00"), &ring(3), 5), vec![a("n01"), a("n02")]);
        assert!(observed_by(&a("n00"), &ring(1), 5).is_empty());
    }

    #[test]
    fn a_hundred_nodes_cost_k_heartbeats_per_interval_each_not_n() {
        let members = ring(100);
        let mut core = HeartbeatCore::new(a("n42"), FailureDetectorSettings::default());
        let t0 = Instant::now();
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(members), t0, &mut out);
        let sent =
            |out: &[HeartbeatAction]| out.iter().filter(|x| matches!(x, HeartbeatAction::SendRequest { .. })).count();
        assert_eq!(sent(&out), 5);
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Tick, t0 + Duration::from_millis(500), &mut out);
        assert_eq!(sent(&out), 5, "one request per observed node per interval");
    }

    /// Drives a core observing "n01" (in a ring of n00–n02) with responses until `until`
    /// (answered while `alive(t)`), ticking every 100 ms; returns the verdicts with their times.
    fn run(alive: impl Fn(Duration) -> bool, until: Duration) -> Vec<(Duration, bool)> {
        let s = FailureDetectorSettings { monitored_by: 1, ..FailureDetectorSettings::default() };
        let mut core = HeartbeatCore::new(a("n00"), s);
        let t0 = Instant::now();
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(ring(3)), t0, &mut out);
        let mut verdicts = Vec::new();
        let mut elapsed = Duration::ZERO;
        while elapsed <= until {
            for x in std::mem::take(&mut out) {
                match x {
                    HeartbeatAction::SendRequest { to, seq } if alive(elapsed) => {
                        // Answered 5 ms later (next step delivers it at its tick time).
                        core.handle(
                            HeartbeatInput::Response { from: to, seq },
                            t0 + elapsed + Duration::from_millis(5),
                            &mut out,
                        );
                    }
                    HeartbeatAction::Verdict { reachable, .. } => verdicts.push((elapsed, reachable)),
                    _ => {}
                }
            }
            elapsed += Duration::from_millis(100);
            core.handle(HeartbeatInput::Tick, t0 + elapsed, &mut out);
        }
        verdicts
    }

    #[test]
    fn a_crashed_node_is_unreachable_within_three_seconds_and_a_live_one_never() {
        assert!(run(|_| true, Duration::from_secs(60)).is_empty(), "no false suspicion in a minute");
        let crash = Duration::from_secs(10);
        let verdicts = run(|t| t < crash, Duration::from_secs(20));
        let (at, reachable) = verdicts[0];
        assert!(!reachable);
        assert!(at > crash && at <= crash + Duration::from_secs(3), "detected {:?} after the crash", at - crash);
        assert_eq!(verdicts.len(), 1, "and it stays unreachable: {verdicts:?}");
    }

    #[test]
    fn a_node_that_answers_again_is_reachable_again() {
        let verdicts = run(|t| t < Duration::from_secs(5) || t > Duration::from_secs(12), Duration::from_secs(20));
        assert_eq!(verdicts.iter().map(|(_, r)| *r).collect::<Vec<_>>(), vec![false, true], "{verdicts:?}");
        assert!(verdicts[1].0 > Duration::from_secs(12) && verdicts[1].0 < Duration::from_secs(13));
    }

    #[test]
    fn a_node_dead_from_the_start_is_detected_from_the_first_estimate() {
        let verdicts = run(|_| false, Duration::from_secs(10));
        assert_eq!(verdicts.len(), 1);
        assert!(verdicts[0].0 <= Duration::from_secs(3), "{verdicts:?}");
    }

    #[test]
    fn stale_duplicate_and_unsolicited_responses_are_ignored_and_counted() {
        let s = FailureDetectorSettings { monitored_by: 1, ..FailureDetectorSettings::default() };
        let mut core = HeartbeatCore::new(a("n00"), s);
        let t0 = Instant::now();
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(ring(3)), t0, &mut out);
        let [HeartbeatAction::SendRequest { seq, .. }] = out[..] else { panic!("{out:?}") };
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Response { from: a("n01"), seq }, t0, &mut out);
        core.handle(HeartbeatInput::Response { from: a("n01"), seq }, t0, &mut out);
        core.handle(HeartbeatInput::Response { from: a("n01"), seq: seq + 7 }, t0, &mut out);
        core.handle(HeartbeatInput::Response { from: a("n02"), seq }, t0, &mut out);
        assert_eq!(core.ignored, 3);
        let d = &core.observed[&a("n01")].detector;
        assert!(d.heard && d.last == t0, "the answer counted once");
        assert_eq!(d.intervals.len(), 2, "the first answer ends no interval");
        // A request from anyone is answered with its own sequence number.
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Request { from: a("n02"), seq: 99 }, t0, &mut out);
        assert_eq!(out, vec![HeartbeatAction::SendResponse { to: a("n02"), seq: 99 }]);
    }

    #[test]
    fn a_late_answer_to_an_earlier_request_does_not_count_for_the_newer_one() {
        let mut core = HeartbeatCore::new(a("n00"), FailureDetectorSettings { monitored_by: 2, ..Default::default() });
        let t0 = Instant::now();
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(ring(3)), t0, &mut out);
        let seqs = |out: &[HeartbeatAction]| -> Vec<u64> {
            out.iter()
                .filter_map(|x| match x {
                    HeartbeatAction::SendRequest { seq, .. } => Some(*seq),
                    _ => None,
                })
                .collect()
        };
        let first = seqs(&out);
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Tick, t0 + Duration::from_millis(500), &mut out);
        let second = seqs(&out);
        let all: BTreeSet<u64> = first.iter().chain(&second).copied().collect();
        assert_eq!(all.len(), 4, "every request has its own number: {first:?} {second:?}");
        // n01 answers its first request only now: too late to count.
        let mut out = Vec::new();
        core.handle(
            HeartbeatInput::Response { from: a("n01"), seq: first[0] },
            t0 + Duration::from_millis(510),
            &mut out,
        );
        assert_eq!(core.ignored, 1);
        assert!(!core.observed[&a("n01")].detector.heard);
    }

    #[test]
    fn a_node_whose_phi_reaches_the_threshold_exactly_is_unreachable() {
        let mut core = HeartbeatCore::new(a("n00"), FailureDetectorSettings { monitored_by: 1, ..Default::default() });
        let t0 = Instant::now();
        core.handle(HeartbeatInput::Members(ring(3)), t0, &mut Vec::new());
        let at = t0 + Duration::from_millis(1_200);
        let s = core.settings.clone();
        core.settings.threshold = core.observed[&a("n01")].detector.phi(at, s.acceptable_pause, s.min_std_deviation);
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Tick, at, &mut out);
        assert!(out.contains(&HeartbeatAction::Verdict { subject: a("n01"), reachable: false }), "{out:?}");
    }

    #[test]
    fn a_membership_change_starts_and_stops_observing_by_the_ring() {
        let mut core = HeartbeatCore::new(a("n00"), FailureDetectorSettings { monitored_by: 2, ..Default::default() });
        let t0 = Instant::now();
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(ring(4)), t0, &mut out);
        assert_eq!(core.observing().cloned().collect::<Vec<_>>(), vec![a("n01"), a("n02")]);
        let mut members = ring(4);
        members.remove(&a("n01"));
        let mut out = Vec::new();
        core.handle(HeartbeatInput::Members(members), t0, &mut out);
        assert_eq!(core.observing().cloned().collect::<Vec<_>>(), vec![a("n02"), a("n03")]);
        assert_eq!(out, vec![HeartbeatAction::SendRequest { to: a("n03"), seq: 3 }], "only the new one is asked now");
    }
}
