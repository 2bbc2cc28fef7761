//! Time as the sans-IO cores see it: a monotonic [`Instant`] passed in as `now`, and wall-clock
//! milliseconds passed in as `wall_ms` (for LWW markers, epochs and generations).
//!
//! Cores never read a clock themselves; drivers read these and feed them in, and the
//! deterministic simulation (`testkit::sim`) feeds a fake clock instead. The type is
//! `std::time::Instant`, not tokio's, so the cores do not depend on a runtime.

//!
//! Drivers read both through this module, never `std::time` directly, so a node run in virtual
//! time (the test kit's whole-node simulation: paused tokio runtimes stepped together) sees one
//! coherent clock: `now()` is the runtime's clock (the real one outside a paused runtime), and
//! [`wall_ms`] follows it while a wall-clock anchor is set on the thread.

use std::cell::Cell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The monotonic instant every core takes as `now`.
pub type Instant = std::time::Instant;

thread_local! {
    /// Wall-clock milliseconds at a monotonic instant, when this thread runs nodes in virtual
    /// time: [`wall_ms`] is then that reading moved on by the runtime's clock.
    static WALL_ANCHOR: Cell<Option<(SystemTime, Instant)>> = const { Cell::new(None) };
}

/// The monotonic instant drivers feed their cores: the current tokio runtime's clock (which is
/// the system's, unless the runtime's time is paused), or the system's outside a runtime.
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn wall_ms() -> u64 {
    wall_time().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The wall clock: the system's, or on a thread running nodes in virtual time the anchored
/// reading moved on by the runtime's clock.
pub(crate) fn wall_time() -> SystemTime {
    match WALL_ANCHOR.with(Cell::get) {
        Some((at_wall, at)) => at_wall + now().saturating_duration_since(at),
        None => SystemTime::now(),
    }
}

/// Makes [`wall_ms`] on this thread read `wall` at the monotonic instant `at` and move on with
/// [`now`] from there (`None`: the system clock again). Only the test kit's virtual-time
/// harness sets it, on the one thread that steps its nodes' runtimes.
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
pub(crate) fn anchor_wall_clock(anchor: Option<(Duration, Instant)>) {
    WALL_ANCHOR.with(|c| c.set(anchor.map(|(wall, at)| (UNIX_EPOCH + wall, at))));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_anchored_wall_clock_moves_with_the_paused_runtime_and_the_system_one_returns_once_cleared() {
        let before = SystemTime::now();
        anchor_wall_clock(Some((Duration::from_secs(1_000_000), now())));
        assert_eq!(wall_ms(), 1_000_000_000);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(wall_ms(), 1_000_001_500, "paused time moved the wall clock");
        assert_eq!(wall_time(), UNIX_EPOCH + Duration::from_millis(1_000_001_500));
        anchor_wall_clock(None);
        assert!(wall_time() >= before, "the system clock again");
        assert!(wall_ms() >= before.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64);
    }
}
