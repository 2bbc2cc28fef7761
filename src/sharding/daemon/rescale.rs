//! The rules of a daemon process's rescale, as pure functions of an entity's durable state and
//! the request (the entities in `mod.rs` perform them): which requests are stale, what each
//! entity records, and when a rescale may start. See the module above for the protocol and
//! what it promises.

use serde::{Deserialize, Serialize};

/// What the process's entities keep durably: a worker's revision and count, and for entity
/// [`SCALE_ID`] the process's revision, count and rescale in progress.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DaemonState {
    /// The revision last taken; 0 before any rescale.
    pub(super) revision: u64,
    /// The count of that revision; 0 until a rescale (the initial count applies).
    pub(super) count: u32,
    /// A worker: stopped at `revision`, not to run until told to.
    pub(super) stopped: bool,
    /// Entity `scale`: the rescale in progress.
    pub(super) rescaling: Option<Rescale>,
}

/// A rescale: from `from` workers to `to`, as revision `revision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Rescale {
    pub(super) revision: u64,
    pub(super) from: u32,
    pub(super) to: u32,
}

/// The scale of a daemon process as the cluster holds it ([`DaemonProcess::scale`](super::DaemonProcess::scale)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonScale {
    /// The revision: 0 until the first rescale, one more with each.
    pub revision: u64,
    /// The workers of that revision.
    pub count: usize,
    /// A rescale in progress (to this count, as `revision`): its old workers are being
    /// stopped or its new ones started.
    pub rescaling_to: Option<usize>,
}

impl DaemonState {
    /// The process's count as this state has it (the initial count before any rescale).
    pub(super) fn count_or(&self, initial: u32) -> u32 {
        if self.count == 0 { initial } else { self.count }
    }

    pub(super) fn scale(&self, initial: u32) -> DaemonScale {
        DaemonScale {
            revision: self.revision,
            count: self.count_or(initial) as usize,
            rescaling_to: self.rescaling.map(|r| r.to as usize),
        }
    }
}

/// A worker asked to stop for `revision`: its state once stopped, or `None` when the request is
/// stale (it runs for that revision already, or a newer one).
pub(super) fn stop_asked(state: &DaemonState, revision: u64, initial: u32) -> Option<DaemonState> {
    if revision < state.revision || (revision == state.revision && !state.stopped) {
        return None;
    }
    Some(DaemonState { revision, count: state.count_or(initial), stopped: true, rescaling: None })
}

/// A worker asked to run as part of `revision` of `count`: its state then (also when the
/// request is repeated: it is written again, since an earlier write may have failed and sit
/// on one replica alone), or `None` when it is stale (the worker knows a newer revision).
pub(super) fn run_asked(state: &DaemonState, revision: u64, count: u32) -> Option<DaemonState> {
    (revision >= state.revision).then_some(DaemonState { revision, count, stopped: false, rescaling: None })
}

/// Entity `scale` asked for `count` workers: the state that starts the rescale, `None` when the
/// process has that count already, or why not while another rescale runs.
pub(super) fn set_count(state: &DaemonState, count: u32, initial: u32) -> Result<Option<DaemonState>, String> {
    if let Some(r) = state.rescaling {
        if r.to == count {
            return Ok(None); // the same rescale asked again (a caller that timed out retries)
        }
        return Err(format!(
            "a rescale to {} workers (revision {}) is in progress; try again when it is done",
            r.to, r.revision
        ));
    }
    let from = state.count_or(initial);
    if count == from {
        return Ok(None);
    }
    let revision = state.revision + 1;
    Ok(Some(DaemonState {
        revision,
        count: from,
        stopped: false,
        rescaling: Some(Rescale { revision, from, to: count }),
    }))
}

/// Entity `scale` told the rescale of `revision` is complete: the state with its count, or
/// `None` when that is not the rescale in progress.
pub(super) fn done(state: &DaemonState, revision: u64) -> Option<DaemonState> {
    let rescale = state.rescaling.filter(|r| r.revision == revision)?;
    Some(DaemonState { revision, count: rescale.to, stopped: false, rescaling: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(revision: u64, count: u32, stopped: bool) -> DaemonState {
        DaemonState { revision, count, stopped, rescaling: None }
    }

    #[test]
    fn a_worker_stops_for_a_newer_revision_or_again_for_the_same_but_not_after_running_for_it() {
        let fresh = DaemonState::default();
        assert_eq!(stop_asked(&fresh, 1, 3), Some(worker(1, 3, true)), "before any rescale: the initial count");
        assert_eq!(stop_asked(&worker(1, 5, false), 2, 3), Some(worker(2, 5, true)));
        assert_eq!(stop_asked(&worker(2, 5, true), 2, 3), Some(worker(2, 5, true)), "a repeated stop");
        assert_eq!(stop_asked(&worker(2, 4, false), 2, 3), None, "runs for that revision already");
        assert_eq!(stop_asked(&worker(3, 4, true), 2, 3), None, "knows a newer revision");
    }

    #[test]
    fn a_worker_runs_for_a_revision_once_and_never_for_an_older_one() {
        assert_eq!(run_asked(&worker(2, 5, true), 2, 4), Some(worker(2, 4, false)));
        assert_eq!(run_asked(&worker(1, 5, false), 2, 4), Some(worker(2, 4, false)));
        assert_eq!(run_asked(&worker(2, 4, false), 2, 4), Some(worker(2, 4, false)), "a repeated run: written again");
        assert_eq!(run_asked(&worker(3, 4, true), 2, 4), None, "an older revision");
    }

    #[test]
    fn a_rescale_starts_from_the_current_count_one_at_a_time_and_completes_once() {
        let initial = DaemonState::default();
        assert_eq!(set_count(&initial, 3, 3), Ok(None), "the count it has");
        let started = set_count(&initial, 5, 3).unwrap().unwrap();
        let rescale = Rescale { revision: 1, from: 3, to: 5 };
        assert_eq!(started, DaemonState { revision: 1, count: 3, stopped: false, rescaling: Some(rescale) });
        assert_eq!(started.scale(3), DaemonScale { revision: 1, count: 3, rescaling_to: Some(5) });
        assert_eq!(set_count(&started, 5, 3), Ok(None), "the same rescale asked again");
        let busy = set_count(&started, 2, 3).unwrap_err();
        assert!(busy.contains("rescale to 5") && busy.contains("revision 1"), "{busy}");
        assert_eq!(done(&started, 2), None, "another revision's completion");
        let complete = done(&started, 1).unwrap();
        assert_eq!(complete, DaemonState { revision: 1, count: 5, stopped: false, rescaling: None });
        assert_eq!(done(&complete, 1), None, "completed once");
        let next = set_count(&complete, 2, 3).unwrap().unwrap();
        assert_eq!(next.rescaling, Some(Rescale { revision: 2, from: 5, to: 2 }));
    }
}
