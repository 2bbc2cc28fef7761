//! How a [`Producer`](super::Producer) sends, waits and gives up.

use std::time::Duration;

use super::core::ProducerLimits;
use crate::error::{Error, Result};

/// How a [`Producer`](super::Producer) sends, waits and gives up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerSettings {
    /// Most unconfirmed messages per entity (the demand an entity grants): `send` waits past it.
    pub window: usize,
    /// Most entities with unconfirmed messages at once: a `send` to another entity waits past it.
    /// With a durable queue it also waits while this many streams let go still have their
    /// stored entries being deleted (a lane is reused only once they are).
    pub max_entities: usize,
    /// Most bytes of unconfirmed messages (encoded): a `send` past it fails at once.
    pub max_queued_bytes: usize,
    /// How long one delivery waits for its outcome before it counts as failed (it is sent
    /// again; the late outcome, if any, still counts).
    pub delivery_timeout: Duration,
    /// The first wait before a stream is sent again after a failure; it doubles per failure in
    /// a row, up to `resend_backoff_max`.
    pub resend_backoff_min: Duration,
    /// The longest wait before a stream is sent again.
    pub resend_backoff_max: Duration,
    /// Panics of its entity a message survives; one more makes it a dead letter.
    pub max_redeliveries: u32,
    /// Keep unconfirmed messages in the cluster (majority writes, LMDB on every replica), so a
    /// producer started again with the same id — on this node or another — resumes them;
    /// `send` then returns once the message is written. See
    /// [`ShardRegion::producer`](crate::ShardRegion::producer).
    pub durable_queue: bool,
}

impl Default for ProducerSettings {
    fn default() -> Self {
        ProducerSettings {
            window: 50,
            max_entities: 10_000,
            max_queued_bytes: 64 * 1024 * 1024,
            delivery_timeout: Duration::from_secs(5),
            resend_backoff_min: Duration::from_millis(200),
            resend_backoff_max: Duration::from_secs(5),
            max_redeliveries: 10,
            durable_queue: false,
        }
    }
}

impl ProducerSettings {
    pub(super) fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Config(format!("producer settings: {what}")));
        if self.window == 0 || self.max_entities == 0 || self.max_queued_bytes == 0 {
            return bad("window, max_entities and max_queued_bytes must be at least 1");
        }
        if self.delivery_timeout.is_zero() || self.resend_backoff_min.is_zero() {
            return bad("delivery_timeout and resend_backoff_min must be more than zero");
        }
        if self.resend_backoff_max < self.resend_backoff_min {
            return bad("resend_backoff_max must be at least resend_backoff_min");
        }
        Ok(())
    }

    pub(crate) fn limits(&self) -> ProducerLimits {
        ProducerLimits {
            window: self.window,
            max_entities: self.max_entities,
            max_queued_bytes: self.max_queued_bytes,
            resend_backoff_min: self.resend_backoff_min,
            resend_backoff_max: self.resend_backoff_max,
            max_redeliveries: self.max_redeliveries,
            durable: self.durable_queue,
            linger: CONFIRMED_ENTRY_LINGER,
        }
    }
}

/// How long a durable queue keeps a confirmed message's entry after its confirmation, so
/// that the stream's next message replaces it instead of a deletion being written: an entity
/// sent to again within this saves a write per message; a producer that crashes meanwhile
/// sends those messages again (their entities answer them as duplicates).
pub(crate) const CONFIRMED_ENTRY_LINGER: Duration = Duration::from_secs(1);

/// Longest producer id, in bytes.
pub const MAX_PRODUCER_ID_LEN: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_out_of_range_are_refused_with_the_setting_named() {
        assert!(ProducerSettings::default().check().is_ok());
        let table: Vec<(ProducerSettings, &str)> = vec![
            (ProducerSettings { window: 0, ..Default::default() }, "window"),
            (ProducerSettings { max_entities: 0, ..Default::default() }, "max_entities"),
            (ProducerSettings { max_queued_bytes: 0, ..Default::default() }, "max_queued_bytes"),
            (ProducerSettings { delivery_timeout: Duration::ZERO, ..Default::default() }, "delivery_timeout"),
            (ProducerSettings { resend_backoff_min: Duration::ZERO, ..Default::default() }, "resend_backoff_min"),
            (
                ProducerSettings { resend_backoff_max: Duration::from_millis(1), ..Default::default() },
                "resend_backoff_max",
            ),
        ];
        for (settings, named) in table {
            let e = settings.check().unwrap_err().to_string();
            assert!(e.contains(named), "{e}");
        }
    }
}
