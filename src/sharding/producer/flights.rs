//! The producer driver's deliveries in flight: what each outcome is for, and which time out
//! (every flight has the producer's one delivery timeout, so they expire in sending order).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::core::{ProducerInput, SendResult};
use crate::clock::Instant;
use crate::error::Result;
use crate::sharding::delivery::DeliveryOutcome;

/// A delivery in flight: what its outcome is for.
pub(super) struct Flight {
    pub(super) entity: String,
    pub(super) stream: u64,
    pub(super) round: u64,
    pub(super) seq: u64,
}

/// Deliveries in flight, by flight tag, and when each times out (in sending order: the timeout
/// is one for all).
#[derive(Default)]
pub(super) struct Flights {
    next: u64,
    open: HashMap<u64, Flight>,
    expiring: VecDeque<(Instant, u64)>,
}

impl Flight {
    /// The core's input for this flight's end.
    fn ended(self, result: SendResult) -> ProducerInput {
        let Flight { entity, stream, round, seq } = self;
        ProducerInput::Outcome { entity, stream, round, seq, result }
    }
}

impl Flights {
    /// The tag of the next delivery.
    pub(super) fn next_tag(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Delivery `tag` was sent; its outcome is awaited until `until`.
    pub(super) fn sent(&mut self, tag: u64, until: Instant, flight: Flight) {
        self.open.insert(tag, flight);
        self.expiring.push_back((until, tag));
    }

    /// The outcome for flight `tag` as the core hears it, unless the flight is over (timed out).
    pub(super) fn land(&mut self, tag: u64, outcome: Result<DeliveryOutcome>) -> Option<ProducerInput> {
        let result = match outcome {
            Ok(outcome) => SendResult::Answered(outcome),
            Err(e) => SendResult::Failed(e.to_string()),
        };
        Some(self.open.remove(&tag)?.ended(result))
    }

    /// The flights that timed out by `now`, as failures for the core.
    pub(super) fn expire(&mut self, now: Instant, timeout: Duration, out: &mut Vec<ProducerInput>) {
        while let Some(&(_, tag)) = self.expiring.front().filter(|(at, _)| *at <= now) {
            self.expiring.pop_front();
            if let Some(flight) = self.open.remove(&tag) {
                out.push(flight.ended(SendResult::Failed(format!("no outcome within {timeout:?}"))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flight(seq: u64) -> Flight {
        Flight { entity: "e".into(), stream: 7, round: 1, seq }
    }

    fn confirmed() -> Result<DeliveryOutcome> {
        Ok(DeliveryOutcome::Confirmed { handled: true, nonce: 3 })
    }

    #[test]
    fn an_outcome_lands_on_its_flight_once_and_one_after_its_timeout_is_ignored() {
        let (t0, timeout) = (crate::clock::now(), Duration::from_secs(5));
        let mut f = Flights::default();
        for seq in [1, 2] {
            let tag = f.next_tag();
            f.sent(tag, t0 + timeout, flight(seq));
        }
        let landed = f.land(1, confirmed());
        assert!(matches!(
            landed,
            Some(ProducerInput::Outcome { seq: 1, stream: 7, result: SendResult::Answered(_), .. })
        ));
        assert!(f.land(1, confirmed()).is_none(), "a flight lands once");
        let mut out = Vec::new();
        f.expire(t0 + timeout - Duration::from_millis(1), timeout, &mut out);
        assert!(out.is_empty(), "nothing times out early");
        f.expire(t0 + timeout, timeout, &mut out);
        assert!(
            matches!(&out[..], [ProducerInput::Outcome { seq: 2, result: SendResult::Failed(_), .. }]),
            "only the flight still open fails: {out:?}"
        );
        assert!(f.land(2, confirmed()).is_none(), "an outcome after the timeout is ignored");
        assert!(f.open.is_empty() && f.expiring.is_empty());
    }
}
