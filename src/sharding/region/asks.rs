//! Asks this region forwarded to other regions, waiting for their `AskReply`: each remembers
//! the region it went to and the entity it was for, so an ask to a region that is gone fails
//! at once (with the entity named) instead of waiting for its timeout.
//!
//! Ask ids are random 64-bit numbers, not a sequence: an `AskReply` is matched by its id alone
//! (a relayed ask is answered by a region other than the one it was sent to), so an id must not
//! be guessable by a member, or a misrouted reply, that never saw the ask (review finding S17).
//!
//! The table is split into [`STRIPES`] stripes by ask id, each behind its own lock: askers
//! insert and the tasks reading connections complete on every core at once, and one lock for
//! all of them would make every remote ask wait for the others. An id is its own hash: it is
//! uniformly random, and chosen here, never by a peer.

use std::sync::Mutex;

use hashbrown::HashTable;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sharding::ids::RegionId;

/// Stripes of the table (a power of two: an id's stripe is its low bits, uniformly random).
pub(crate) const STRIPES: usize = 16;

struct Pending<P> {
    id: u64,
    /// Order of insertion: failures of many asks at once go oldest first.
    seq: u64,
    target: RegionId,
    entity_id: String,
    handle: P,
}

/// Pending remote asks by ask id; `P` is the asker's handle.
pub(crate) struct AskTable<P> {
    next_seq: AtomicU64,
    stripes: [Mutex<HashTable<Pending<P>>>; STRIPES],
}

impl<P> Default for AskTable<P> {
    fn default() -> Self {
        AskTable { next_seq: AtomicU64::new(0), stripes: std::array::from_fn(|_| Mutex::default()) }
    }
}

impl<P> AskTable<P> {
    /// The stripe of ask `id`: from bits the table's own index leaves alone (it uses the
    /// lowest for the bucket and the top seven for its tags).
    fn stripe(&self, id: u64) -> std::sync::MutexGuard<'_, HashTable<Pending<P>>> {
        self.stripes[(id >> 32) as usize % STRIPES].lock().expect("asks lock")
    }

    /// Records an ask sent to `target` for `entity_id`; returns its id.
    pub(crate) fn insert(&self, target: RegionId, entity_id: &str, handle: P) -> u64 {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let mut pending = Pending { id: 0, seq, target, entity_id: entity_id.to_string(), handle };
        loop {
            match self.insert_as(rand::random(), pending) {
                Ok(id) => return id,
                Err(back) => pending = back,
            }
        }
    }

    /// Files `pending` under `id`, unless an ask already waits under it (handed back).
    fn insert_as(&self, id: u64, mut pending: Pending<P>) -> Result<u64, Pending<P>> {
        let mut stripe = self.stripe(id);
        match stripe.entry(id, |p| p.id == id, |p| p.id) {
            hashbrown::hash_table::Entry::Vacant(slot) => {
                pending.id = id;
                slot.insert(pending);
                Ok(id)
            }
            hashbrown::hash_table::Entry::Occupied(_) => Err(pending),
        }
    }

    /// The ask answered by an `AskReply` with this id, with its entity id.
    pub(crate) fn take(&self, id: u64) -> Option<(String, P)> {
        let mut stripe = self.stripe(id);
        let found = stripe.find_entry(id, |p| p.id == id).ok()?;
        let (p, _) = found.remove();
        Some((p.entity_id, p.handle))
    }

    /// Takes the asks `which` picks from every stripe, oldest first.
    fn take_where(&self, which: impl Fn(&Pending<P>) -> bool) -> Vec<(String, P)> {
        let mut taken: Vec<Pending<P>> = Vec::new();
        for stripe in &self.stripes {
            taken.extend(stripe.lock().expect("asks lock").extract_if(|p| which(p)));
        }
        taken.sort_unstable_by_key(|p| p.seq);
        taken.into_iter().map(|p| (p.entity_id, p.handle)).collect()
    }

    /// Every ask sent to `region`, oldest first (the region is gone: they fail now).
    pub(crate) fn take_region(&self, region: &RegionId) -> Vec<(String, P)> {
        self.take_where(|p| p.target == *region)
    }

    /// Every ask, oldest first (the region stops: they fail now).
    pub(crate) fn take_all(&self) -> Vec<(String, P)> {
        self.take_where(|_| true)
    }

    /// Forgets asks whose asker stopped waiting (timed out).
    pub(crate) fn retain_waiting(&self, waiting: impl Fn(&P) -> bool) {
        for stripe in &self.stripes {
            stripe.lock().expect("asks lock").retain(|p| waiting(&p.handle));
        }
    }

    /// Asks pending.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.stripes.iter().map(|s| s.lock().unwrap().len()).sum()
    }

    /// Whether ask `id` is pending.
    #[cfg(test)]
    fn contains(&self, id: u64) -> bool {
        self.stripe(id).find(id, |p| p.id == id).is_some()
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
        let t = AskTable::default();
        let id = t.insert(r("b"), "e1", 10u32);
        assert_eq!(t.take(id), Some(("e1".to_string(), 10)));
        assert_eq!(t.take(id), None, "a duplicate answer finds nothing");
        assert_eq!(t.take(999), None);
    }

    #[test]
    fn an_id_already_pending_is_never_given_to_a_second_ask() {
        let t = AskTable::default();
        let pending = |handle: u32| Pending { id: 0, seq: 0, target: r("b"), entity_id: "e".into(), handle };
        assert_eq!(t.insert_as(42, pending(1)).ok(), Some(42));
        let refused = t.insert_as(42, pending(2)).expect_err("the id is taken");
        assert_eq!(refused.handle, 2, "handed back, to be filed under another id");
        assert_eq!(t.take(42).map(|(_, h)| h), Some(1));
        assert_eq!(t.len(), 0);
    }

    /// The table is striped for the asks of many cores at once: random ids spread over every
    /// stripe, so no stripe's lock is everyone's.
    #[test]
    fn asks_spread_over_every_stripe() {
        let t = AskTable::default();
        for i in 0..1000u32 {
            t.insert(r("b"), "e", i);
        }
        let sizes: Vec<usize> = t.stripes.iter().map(|s| s.lock().unwrap().len()).collect();
        assert!(sizes.iter().all(|&n| n > 20), "{sizes:?}");
    }

    #[test]
    fn ask_ids_are_never_reused() {
        let t = AskTable::default();
        let a = t.insert(r("b"), "e1", 1u32);
        t.take(a);
        let b = t.insert(r("b"), "e2", 2u32);
        assert_ne!(a, b);
    }

    /// Review finding S17: a member that saw one ask id (or none) cannot name another pending
    /// ask's: the ids of a thousand pending asks are not each other's neighbours, and the small
    /// numbers a sequence would have used complete nothing.
    #[test]
    fn a_reply_with_a_guessed_ask_id_completes_no_pending_ask() {
        let t = AskTable::default();
        let ids: Vec<u64> = (0..1000u32).map(|i| t.insert(r("b"), &format!("e{i}"), i)).collect();
        for id in &ids {
            assert!(!t.contains(id.wrapping_add(1)) && !t.contains(id.wrapping_sub(1)), "{id}");
        }
        for guess in 0..10_000u64 {
            assert_eq!(t.take(guess), None, "guessed id {guess} completed an ask");
        }
        assert_eq!(t.len(), 1000);
    }

    #[test]
    fn a_gone_region_fails_only_its_own_asks_oldest_first() {
        let t = AskTable::default();
        t.insert(r("b"), "e1", 1u32);
        t.insert(r("c"), "e2", 2u32);
        t.insert(r("b"), "e3", 3u32);
        assert_eq!(t.take_region(&r("b")), vec![("e1".to_string(), 1), ("e3".to_string(), 3)]);
        assert_eq!(t.len(), 1);
        assert!(t.take_region(&r("b")).is_empty());
    }

    #[test]
    fn a_stopping_region_takes_every_ask_oldest_first() {
        let t = AskTable::default();
        t.insert(r("b"), "e1", 1u32);
        t.insert(r("c"), "e2", 2u32);
        t.insert(r("b"), "e3", 3u32);
        let all = t.take_all();
        assert_eq!(all, vec![("e1".to_string(), 1), ("e2".to_string(), 2), ("e3".to_string(), 3)]);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn asks_whose_asker_gave_up_are_forgotten() {
        let t = AskTable::default();
        t.insert(r("b"), "e1", 1u32);
        let kept = t.insert(r("b"), "e2", 2u32);
        t.retain_waiting(|h| *h != 1);
        assert_eq!(t.len(), 1);
        assert!(t.take(kept).is_some());
    }
}
