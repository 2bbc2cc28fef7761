//! Cluster singletons: one instance of a service (a shard coordinator) on the member
//! [`MembershipSnapshot::singleton_host`] names, started only after a take-over read of its
//! state.
//!
//! [`SingletonCore`] is the sans-IO life cycle every singleton driver runs:
//!
//! - **Rule.** The singleton runs on this node only while this node is the singleton host in
//!   its latest membership view, and only with state read *after* it became the host.
//! - **Take-over read.** On becoming the host the core asks for a read (a majority read of the
//!   singleton's state); a failed read is retried every `retry_interval` while this node is
//!   still the host.
//! - **Re-check after the read.** A read can be slow. If the node stopped being the host
//!   meanwhile (it is leaving, an older member came back into view), the result is dropped
//!   and nothing starts: a singleton started then would run beside its successor until the
//!   next membership change, both acting (found by random fault seed 20: two coordinators
//!   allocated the same shards, and entities ran twice).
//! - **Stop.** Losing the host role stops a running singleton at once.
//! - **Fenced.** A running singleton whose write was refused because a newer instance claimed
//!   its state (the singleton's term is older: this node was paused past its downing and has
//!   not learnt it yet, or views disagree on the host) stops, and reads again only after
//!   `retry_interval` if it is still the host then. Reading at once would claim the state back
//!   and fence the newer instance; the pause gives this node time to learn it is gone.
//! - **Stale reads.** Each read has an id; a result for any read but the latest is ignored.
//!
//! What remains is the assumption of every oldest-member singleton: two views may briefly
//! disagree on who is oldest. The singleton's own writes (majority) and readers that accept
//! messages only from the host they see are the guards.

use std::time::Duration;

use crate::clock::Instant;
#[cfg(doc)]
use crate::membership::MembershipSnapshot;

/// Inputs of [`SingletonCore`]; `S` is the state the take-over read returns.
#[derive(Debug)]
pub(crate) enum SingletonInput<S> {
    /// Whether this node is the singleton host in the latest membership view
    /// ([`MembershipSnapshot::hosts_singleton`]).
    Host(bool),
    /// The take-over read `read` finished.
    ReadDone {
        read: u64,
        result: Result<S, String>,
    },
    Tick,
    /// The running singleton's write was refused: a newer instance claimed the state.
    Fenced,
}

/// Actions of [`SingletonCore`].
#[derive(Debug, PartialEq)]
pub(crate) enum SingletonAction<S> {
    /// Start take-over read `read`; answer with [`SingletonInput::ReadDone`].
    Read { read: u64 },
    /// Start the singleton with the state read.
    Start(S),
    /// Stop the running singleton.
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not the host (or the host with a read pending retry at `retry_at`).
    Idle,
    Reading {
        read: u64,
    },
    RetryAt(Instant),
    Running,
}

/// Life cycle of one singleton on this node.
#[derive(Debug)]
pub(crate) struct SingletonCore {
    host: bool,
    phase: Phase,
    last_read: u64,
    failed_reads: u32,
    retry_interval: Duration,
}

impl SingletonCore {
    pub(crate) fn new(retry_interval: Duration) -> Self {
        SingletonCore { host: false, phase: Phase::Idle, last_read: 0, failed_reads: 0, retry_interval }
    }

    /// Whether the singleton runs here.
    #[cfg(test)]
    pub(crate) fn is_running(&self) -> bool {
        self.phase == Phase::Running
    }

    /// Take-over reads that failed in a row (for logs).
    pub(crate) fn failed_reads(&self) -> u32 {
        self.failed_reads
    }

    fn start_read<S>(&mut self, out: &mut Vec<SingletonAction<S>>) {
        self.last_read += 1;
        self.phase = Phase::Reading { read: self.last_read };
        out.push(SingletonAction::Read { read: self.last_read });
    }

    pub(crate) fn handle<S>(&mut self, input: SingletonInput<S>, now: Instant, out: &mut Vec<SingletonAction<S>>) {
        match input {
            SingletonInput::Host(host) => {
                self.host = host;
                match (host, self.phase) {
                    (true, Phase::Idle) => self.start_read(out),
                    (false, Phase::Running) => {
                        self.phase = Phase::Idle;
                        out.push(SingletonAction::Stop);
                    }
                    // A read in flight is abandoned: its result, however good, must not start a
                    // singleton here any more (the seed-20 race).
                    (false, Phase::Reading { .. } | Phase::RetryAt(_)) => self.phase = Phase::Idle,
                    _ => {}
                }
            }
            SingletonInput::ReadDone { read, result } => {
                if self.phase != (Phase::Reading { read }) {
                    return; // an older read, or one this node gave up when it stopped being host
                }
                // Still reading means still the host: losing the role abandons the read.
                match result {
                    Ok(state) => {
                        self.failed_reads = 0;
                        self.phase = Phase::Running;
                        out.push(SingletonAction::Start(state));
                    }
                    Err(_) => {
                        self.failed_reads += 1;
                        self.phase = Phase::RetryAt(now + self.retry_interval);
                    }
                }
            }
            SingletonInput::Fenced => {
                if self.phase == Phase::Running {
                    self.phase = if self.host { Phase::RetryAt(now + self.retry_interval) } else { Phase::Idle };
                    out.push(SingletonAction::Stop);
                }
            }
            SingletonInput::Tick => {
                if let Phase::RetryAt(at) = self.phase
                    && now >= at
                {
                    self.start_read(out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_millis(200);

    fn run(
        c: &mut SingletonCore,
        input: SingletonInput<&'static str>,
        now: Instant,
    ) -> Vec<SingletonAction<&'static str>> {
        let mut out = Vec::new();
        c.handle(input, now, &mut out);
        out
    }

    #[test]
    fn becoming_the_host_reads_the_state_then_starts_with_it() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        assert_eq!(run(&mut c, SingletonInput::Host(true), now), vec![SingletonAction::Read { read: 1 }]);
        assert!(!c.is_running());
        let out = run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("state") }, now);
        assert_eq!(out, vec![SingletonAction::Start("state")]);
        assert!(c.is_running());
        assert!(run(&mut c, SingletonInput::Host(true), now).is_empty(), "a repeated view changes nothing");
    }

    #[test]
    fn seed_20_race_a_node_that_stopped_being_host_during_its_read_never_starts() {
        // Random fault seed 20: the read took a while, the node began leaving meanwhile, and a
        // coordinator started with the read result ran beside its successor.
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        assert!(run(&mut c, SingletonInput::Host(false), now).is_empty());
        let out = run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("state") }, now);
        assert!(out.is_empty(), "must not start after losing the host role: {out:?}");
        assert!(!c.is_running());
    }

    #[test]
    fn host_again_after_a_lost_read_ignores_the_old_result_and_reads_anew() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        run(&mut c, SingletonInput::Host(false), now);
        assert_eq!(run(&mut c, SingletonInput::Host(true), now), vec![SingletonAction::Read { read: 2 }]);
        assert!(run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("old") }, now).is_empty());
        assert_eq!(
            run(&mut c, SingletonInput::ReadDone { read: 2, result: Ok("new") }, now),
            vec![SingletonAction::Start("new")]
        );
    }

    #[test]
    fn a_failed_read_is_retried_after_the_interval_while_still_host() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        assert!(run(&mut c, SingletonInput::ReadDone { read: 1, result: Err("timeout".into()) }, now).is_empty());
        assert_eq!(c.failed_reads(), 1);
        assert!(run(&mut c, SingletonInput::Tick, now + RETRY / 2).is_empty(), "not before the interval");
        assert_eq!(run(&mut c, SingletonInput::Tick, now + RETRY), vec![SingletonAction::Read { read: 2 }]);
        run(&mut c, SingletonInput::ReadDone { read: 2, result: Ok("s") }, now + RETRY);
        assert_eq!(c.failed_reads(), 0);
        assert!(c.is_running());
    }

    #[test]
    fn a_failed_read_is_not_retried_once_no_longer_host() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        run(&mut c, SingletonInput::ReadDone { read: 1, result: Err("timeout".into()) }, now);
        run(&mut c, SingletonInput::Host(false), now);
        assert!(run(&mut c, SingletonInput::Tick, now + RETRY * 3).is_empty());
    }

    #[test]
    fn losing_the_host_role_stops_a_running_singleton_once() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("s") }, now);
        assert_eq!(run(&mut c, SingletonInput::Host(false), now), vec![SingletonAction::Stop]);
        assert!(run(&mut c, SingletonInput::Host(false), now).is_empty());
        assert!(!c.is_running());
    }

    #[test]
    fn a_fenced_singleton_stops_and_claims_again_only_after_the_retry_interval_if_still_host() {
        let mut c = SingletonCore::new(RETRY);
        let now = Instant::now();
        run(&mut c, SingletonInput::Host(true), now);
        run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("s") }, now);
        assert_eq!(run(&mut c, SingletonInput::Fenced, now), vec![SingletonAction::Stop]);
        assert!(!c.is_running());
        assert!(run(&mut c, SingletonInput::Fenced, now).is_empty(), "stopped once");
        assert!(run(&mut c, SingletonInput::Tick, now + RETRY / 2).is_empty(), "no claim before the interval");
        assert!(run(&mut c, SingletonInput::Host(true), now + RETRY / 2).is_empty(), "nor on a repeated view");
        assert_eq!(run(&mut c, SingletonInput::Tick, now + RETRY), vec![SingletonAction::Read { read: 2 }]);
        // A fenced singleton that learns it is no longer the host never reads again.
        let mut c = SingletonCore::new(RETRY);
        run(&mut c, SingletonInput::Host(true), now);
        run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("s") }, now);
        run(&mut c, SingletonInput::Fenced, now);
        run(&mut c, SingletonInput::Host(false), now);
        assert!(run(&mut c, SingletonInput::Tick, now + RETRY * 5).is_empty());
        // A report for a singleton that is not running changes nothing.
        let mut c = SingletonCore::new(RETRY);
        run(&mut c, SingletonInput::Host(true), now);
        assert!(run(&mut c, SingletonInput::Fenced, now).is_empty());
        assert_eq!(
            run(&mut c, SingletonInput::ReadDone { read: 1, result: Ok("s") }, now),
            vec![SingletonAction::Start("s")]
        );
    }
}
