//! Asks this region forwarded to other regions, waiting for their `AskReply`: each remembers
//! the region it went to and the entity it was for, so an ask to a region that is gone fails
//! at once (with the entity named) instead of waiting for its timeout.
//!
//! Ask ids are random 64-bit numbers, not a sequence: an `AskReply` is matched by its id alone
//! (a relayed ask is answered by a region other than the one it was sent to), so an id must not
//! be guessable by a member, or a misrouted reply, that never saw the ask (review finding S17).

use std::collections::HashMap;

use crate::sharding::ids::RegionId;

struct Pending<P> {
    /// Order of insertion: failures of many asks at once go oldest first.
    seq: u64,
    target: RegionId,
    entity_id: String,
    handle: P,
}

/// Pending remote asks by ask id; `P` is the asker's handle.
pub(crate) struct AskTable<P> {
    next_seq: u64,
    asks: HashMap<u64, Pending<P>>,
}

impl<P> Default for AskTable<P> {
    fn default() -> Self {
        AskTable { next_seq: 0, asks: HashMap::new() }
    }
}

impl<P> AskTable<P> {
    /// Records an ask sent to `target` for `entity_id`; returns its id.
    pub(crate) fn insert(&mut self, target: RegionId, entity_id: String, handle: P) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let id = loop {
            let id: u64 = rand::random();
            if !self.asks.contains_key(&id) {
                break id;
            }
        };
        self.asks.insert(id, Pending { seq, target, entity_id, handle });
        id
    }

    /// The ask answered by an `AskReply` with this id, with its entity id.
    pub(crate) fn take(&mut self, id: u64) -> Option<(String, P)> {
        self.asks.remove(&id).map(|p| (p.entity_id, p.handle))
    }

    /// Every ask sent to `region`, oldest first (the region is gone: they fail now).
    pub(crate) fn take_region(&mut self, region: &RegionId) -> Vec<(String, P)> {
        let mut ids: Vec<(u64, u64)> =
            self.asks.iter().filter(|(_, p)| p.target == *region).map(|(id, p)| (p.seq, *id)).collect();
        ids.sort_unstable();
        ids.into_iter().filter_map(|(_, id)| self.take(id)).collect()
    }

    /// Every ask, oldest first (the region stops: they fail now).
    pub(crate) fn take_all(&mut self) -> Vec<(String, P)> {
        let mut all: Vec<Pending<P>> = self.asks.drain().map(|(_, p)| p).collect();
        all.sort_unstable_by_key(|p| p.seq);
        all.into_iter().map(|p| (p.entity_id, p.handle)).collect()
    }

    /// Forgets asks whose asker stopped waiting (timed out).
    pub(crate) fn retain_waiting(&mut self, waiting: impl Fn(&P) -> bool) {
        self.asks.retain(|_, p| waiting(&p.handle));
    }

    /// Asks pending.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.asks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(n: &str) -> RegionId {
        RegionId::new(n, 1)
    }

    #[test]
    fn an_answered_ask_is_taken_once_with_its_entity() {
        let mut t = AskTable::default();
        let id = t.insert(r("b"), "e1".into(), 10u32);
        assert_eq!(t.take(id), Some(("e1".to_string(), 10)));
        assert_eq!(t.take(id), None, "a duplicate answer finds nothing");
        assert_eq!(t.take(999), None);
    }

    #[test]
    fn ask_ids_are_never_reused() {
        let mut t = AskTable::default();
        let a = t.insert(r("b"), "e1".into(), 1u32);
        t.take(a);
        let b = t.insert(r("b"), "e2".into(), 2u32);
        assert_ne!(a, b);
    }

    /// Review finding S17: a member that saw one ask id (or none) cannot name another pending
    /// ask's: the ids of a thousand pending asks are not each other's neighbours, and the small
    /// numbers a sequence would have used complete nothing.
    #[test]
    fn a_reply_with_a_guessed_ask_id_completes_no_pending_ask() {
        let mut t = AskTable::default();
        let ids: Vec<u64> = (0..1000u32).map(|i| t.insert(r("b"), format!("e{i}"), i)).collect();
        for id in &ids {
            assert!(!t.asks.contains_key(&id.wrapping_add(1)) && !t.asks.contains_key(&id.wrapping_sub(1)), "{id}");
        }
        for guess in 0..10_000u64 {
            assert_eq!(t.take(guess), None, "guessed id {guess} completed an ask");
        }
        assert_eq!(t.len(), 1000);
    }

    #[test]
    fn a_gone_region_fails_only_its_own_asks_oldest_first() {
        let mut t = AskTable::default();
        t.insert(r("b"), "e1".into(), 1u32);
        t.insert(r("c"), "e2".into(), 2u32);
        t.insert(r("b"), "e3".into(), 3u32);
        assert_eq!(t.take_region(&r("b")), vec![("e1".to_string(), 1), ("e3".to_string(), 3)]);
        assert_eq!(t.len(), 1);
        assert!(t.take_region(&r("b")).is_empty());
    }

    #[test]
    fn a_stopping_region_takes_every_ask_oldest_first() {
        let mut t = AskTable::default();
        t.insert(r("b"), "e1".into(), 1u32);
        t.insert(r("c"), "e2".into(), 2u32);
        t.insert(r("b"), "e3".into(), 3u32);
        let all = t.take_all();
        assert_eq!(all, vec![("e1".to_string(), 1), ("e2".to_string(), 2), ("e3".to_string(), 3)]);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn asks_whose_asker_gave_up_are_forgotten() {
        let mut t = AskTable::default();
        t.insert(r("b"), "e1".into(), 1u32);
        let kept = t.insert(r("b"), "e2".into(), 2u32);
        t.retain_waiting(|h| *h != 1);
        assert_eq!(t.len(), 1);
        assert!(t.take(kept).is_some());
    }
}
