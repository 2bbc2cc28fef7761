//! Time as the sans-IO cores see it: a monotonic [`Instant`] passed in as `now`, and wall-clock
//! milliseconds passed in as `wall_ms` (for LWW markers, epochs and generations).
//!
//! Cores never read a clock themselves; drivers read these and feed them in, and the
//! deterministic simulation (`testkit::sim`) feeds a fake clock instead. The type is
//! `std::time::Instant`, not tokio's, so the cores do not depend on a runtime.

use std::time::{SystemTime, UNIX_EPOCH};

/// The monotonic instant every core takes as `now`.
pub type Instant = std::time::Instant;

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
