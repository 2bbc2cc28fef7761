//! Admission of inbound connections in their handshake (pure): which are held, which a
//! newcomer evicts, which are refused.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

/// Inbound connections still in their handshake: at most `capacity` at once, and at most
/// `per_ip` from one address (a newcomer over that is refused). At the cap a newcomer evicts
/// the oldest connection that has not sent its first frame yet — or, when every one has, the
/// oldest of all. Pure; `H` is what evicts a connection (its task's cancellation token).
///
/// Why evict rather than refuse: with a fixed pool, an outsider that keeps it full from many
/// addresses locks every member out of reconnecting (review finding S3). Why the silent ones
/// first: a member's dialer sends its first frame (authenticated, with a secret) at once, so
/// an outsider churning silent connections as fast as it can never displaces a member's
/// handshake in progress; to do that it needs authentic first frames (replayed captures),
/// which the per-address cap and the connect timeout still bound.
#[derive(Debug)]
pub(super) struct HandshakeSlots<H> {
    capacity: usize,
    per_ip: usize,
    next: u64,
    /// Admission order → address and eviction handle, of those that sent nothing yet…
    silent: BTreeMap<u64, (IpAddr, H)>,
    /// …and of those whose first frame arrived.
    speaking: BTreeMap<u64, (IpAddr, H)>,
    per_address: HashMap<IpAddr, usize>,
}

impl<H> HandshakeSlots<H> {
    pub(super) fn new(capacity: usize, per_ip: usize) -> Self {
        HandshakeSlots {
            capacity: capacity.max(1),
            per_ip,
            next: 0,
            silent: Default::default(),
            speaking: Default::default(),
            per_address: HashMap::new(),
        }
    }

    fn len(&self) -> usize {
        self.silent.len() + self.speaking.len()
    }

    /// Admits a connection from `ip`: its slot, and the eviction handle of the connection it
    /// displaced (at capacity); `None` when `ip` already holds `per_ip`.
    pub(super) fn admit(&mut self, ip: IpAddr, handle: H) -> Option<(u64, Option<H>)> {
        if self.per_address.get(&ip).copied().unwrap_or(0) >= self.per_ip {
            return None;
        }
        let evicted = if self.len() >= self.capacity {
            let oldest = self.silent.first_key_value().or_else(|| self.speaking.first_key_value());
            oldest.map(|(slot, _)| *slot).and_then(|slot| self.release(slot))
        } else {
            None
        };
        *self.per_address.entry(ip).or_insert(0) += 1;
        let slot = self.next;
        self.next += 1;
        self.silent.insert(slot, (ip, handle));
        Some((slot, evicted))
    }

    /// The connection in `slot` sent its first frame: evicted only after every silent one.
    pub(super) fn spoke(&mut self, slot: u64) {
        if let Some(held) = self.silent.remove(&slot) {
            self.speaking.insert(slot, held);
        }
    }

    /// Frees `slot` (its handshake ended, or it was evicted); its handle, if it was held.
    pub(super) fn release(&mut self, slot: u64) -> Option<H> {
        let (ip, handle) = self.silent.remove(&slot).or_else(|| self.speaking.remove(&slot))?;
        if let Some(n) = self.per_address.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&ip);
            }
        }
        Some(handle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn at_capacity_a_newcomer_evicts_the_oldest_silent_handshake_whatever_its_address() {
        let mut slots = HandshakeSlots::new(3, 2);
        assert_eq!(slots.admit(ip(2), "a"), Some((0, None)));
        assert_eq!(slots.admit(ip(3), "b"), Some((1, None)));
        assert_eq!(slots.admit(ip(2), "c"), Some((2, None)));
        assert_eq!(slots.admit(ip(9), "d"), Some((3, Some("a"))), "the oldest goes");
        assert_eq!(slots.len(), 3);
        // The evicted one's address has a place again.
        assert_eq!(slots.admit(ip(2), "e"), Some((4, Some("b"))));
        assert_eq!(slots.per_address[&ip(2)], 2);
        assert_eq!(slots.per_address.get(&ip(3)), None, "b's address is forgotten with it");
    }

    #[test]
    fn a_handshake_that_spoke_is_evicted_only_when_every_other_one_spoke_too() {
        let mut slots = HandshakeSlots::new(3, 3);
        slots.admit(ip(9), "member").unwrap();
        slots.spoke(0);
        slots.admit(ip(2), "silent-1").unwrap();
        slots.admit(ip(2), "silent-2").unwrap();
        for k in 0..10 {
            let (_, evicted) = slots.admit(ip(3 + k), "flood").unwrap();
            assert_ne!(evicted, Some("member"), "a silent one goes first, whatever its age");
            assert!(evicted.is_some());
        }
        slots.spoke(11);
        slots.spoke(12);
        assert_eq!(slots.admit(ip(20), "late").unwrap().1, Some("member"), "all spoke: the oldest goes");
        assert_eq!(slots.release(11), Some("flood"), "a slot that spoke is released like any other");
        assert_eq!(slots.len(), 2);
    }

    #[test]
    fn one_address_holds_at_most_per_ip_handshakes_and_a_finished_one_frees_its_place() {
        let mut slots = HandshakeSlots::new(10, 2);
        let (first, _) = slots.admit(ip(2), 1).unwrap();
        slots.admit(ip(2), 2).unwrap();
        assert_eq!(slots.admit(ip(2), 3), None, "a third from one address is refused, not admitted by eviction");
        assert_eq!(slots.len(), 2);
        assert_eq!(slots.release(first), Some(1));
        assert_eq!(slots.release(first), None, "released once");
        assert_eq!(slots.admit(ip(2), 4).map(|(_, evicted)| evicted), Some(None));
        assert_eq!(slots.per_address[&ip(2)], 2);
    }
}
