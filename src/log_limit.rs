//! Rate limits for log lines a peer or an outsider can trigger: at most one line per key per
//! period, with the count of the lines held back since the last one, so a flood of bad input
//! costs a counter increment, not a log flood.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Keys remembered at once; past it, keys not logged within the period are forgotten, and if
/// every key is that recent, new keys share one budget.
const MAX_KEYS: usize = 1024;

/// Decides which of many log lines of one kind are written.
#[derive(Debug)]
pub(crate) struct LogLimiter<K> {
    every: Duration,
    last: HashMap<K, (Instant, u64)>,
    /// The shared budget of new keys while the map is full of recent ones.
    overflow: Option<(Instant, u64)>,
}

impl<K: Hash + Eq + Clone> LogLimiter<K> {
    /// At most one line per key per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        LogLimiter { every, last: HashMap::new(), overflow: None }
    }

    /// `Some(held_back)` when a line about `key` should be written now (`held_back` lines about
    /// it were skipped since the last one), `None` when it should be skipped.
    pub(crate) fn allow(&mut self, key: &K, now: Instant) -> Option<u64> {
        let every = self.every;
        let due = |(at, held): &mut (Instant, u64)| {
            if now.saturating_duration_since(*at) >= every {
                let skipped = *held;
                *at = now;
                *held = 0;
                Some(skipped)
            } else {
                *held = held.saturating_add(1);
                None
            }
        };
        if let Some(entry) = self.last.get_mut(key) {
            return due(entry);
        }
        if self.last.len() >= MAX_KEYS {
            self.last.retain(|_, (at, _)| now.saturating_duration_since(*at) < every);
        }
        if self.last.len() >= MAX_KEYS {
            return match &mut self.overflow {
                Some(entry) => due(entry),
                None => {
                    self.overflow = Some((now, 0));
                    Some(0)
                }
            };
        }
        self.last.insert(key.clone(), (now, 0));
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_key_per_period_with_the_count_held_back() {
        let t0 = Instant::now();
        let mut l = LogLimiter::new(Duration::from_secs(60));
        assert_eq!(l.allow(&"a", t0), Some(0));
        assert_eq!(l.allow(&"a", t0 + Duration::from_secs(1)), None);
        assert_eq!(l.allow(&"a", t0 + Duration::from_secs(59)), None);
        assert_eq!(l.allow(&"b", t0 + Duration::from_secs(59)), Some(0), "another key has its own budget");
        assert_eq!(l.allow(&"a", t0 + Duration::from_secs(60)), Some(2));
        assert_eq!(l.allow(&"a", t0 + Duration::from_secs(61)), None);
        assert_eq!(l.allow(&"a", t0 + Duration::from_secs(120)), Some(1));
    }

    #[test]
    fn a_flood_of_distinct_keys_stays_bounded_and_shares_one_budget() {
        let t0 = Instant::now();
        let mut l = LogLimiter::new(Duration::from_secs(60));
        let allowed = (0..MAX_KEYS as u32 * 3).filter(|k| l.allow(k, t0).is_some()).count();
        assert_eq!(allowed, MAX_KEYS + 1, "each remembered key once, then one line for all the others");
        assert_eq!(l.last.len(), MAX_KEYS);
        // Once the period has passed, old keys are forgotten to make room.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(l.allow(&u32::MAX, later), Some(0));
        assert_eq!(l.last.len(), 1);
        assert_eq!(l.allow(&(u32::MAX - 1), later + Duration::from_secs(1)), Some(0));
    }
}
