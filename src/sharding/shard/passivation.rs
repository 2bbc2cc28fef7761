//! Which running entities a shard passivates, and when: a sans-IO policy the shard core feeds
//! with starts, messages and stops, and asks for victims. No per-tick scan: every entity is in
//! a recency list (least recent first), so idle expiry pops from its front in deadline order,
//! and a replacement policy picks victims in O(1) (LFU: O(log n)).
//!
//! - **Idle**: an entity whose last message is `idle_timeout` old is passivated.
//! - **Active-entity limit**: at most `limit` entities run in this shard (the region's limit
//!   divided among its active shards, as Akka does); a start beyond it passivates a victim of
//!   the replacement policy first: `Lru` (least recently used), `Mru` (most recently used, for
//!   cyclic scans), `Slru` (segmented LRU: entities used twice are protected from one-off
//!   traffic) or `Lfu` (least frequently used, ties to the least recent). With
//!   `WindowTinyLfu` admission, a new entity first lives in a small LRU window; when the window
//!   overflows, its oldest competes with the main area's victim and only the more frequently
//!   used of the two (by a count-min sketch of recent accesses) stays.
//!
//! Invariant: [`Passivation::len`] never exceeds the limit after a call returns (the victims
//! it names are already out of the policy; the core stops them).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Instant;

/// The replacement policy of an active-entity limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replacement {
    Lru,
    Mru,
    /// Segmented LRU; the protected segment holds this fraction of the limit (per mille).
    Slru {
        protected_per_mille: u16,
    },
    Lfu,
}

/// What a shard's policy is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PolicySettings {
    pub idle_timeout: Option<Duration>,
    /// The shard's share of the region's active-entity limit; `None`: no limit.
    pub limit: Option<usize>,
    pub replacement: Replacement,
    /// Window-TinyLFU admission in front of the replacement policy.
    pub window_tinylfu: bool,
}

impl PolicySettings {
    /// Idle passivation only (or nothing with `None`).
    pub(crate) fn idle(idle_timeout: Option<Duration>) -> Self {
        PolicySettings { idle_timeout, limit: None, replacement: Replacement::Lru, window_tinylfu: false }
    }
}

/// A node's place in the policy (an index into its slab), kept by the shard's entity entry.
pub(crate) type Handle = u32;

const NIL: u32 = u32::MAX;
/// The `sequence` of a free slot.
const FREE: u64 = u64::MAX;

/// The area of the policy a node is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Area {
    /// The admission window (Window-TinyLFU).
    Window,
    /// The main area (LRU, MRU, LFU), or SLRU's probationary segment.
    Main,
    /// SLRU's protected segment.
    Protected,
}

#[derive(Debug, Clone, Copy)]
struct Links {
    prev: u32,
    next: u32,
}

const UNLINKED: Links = Links { prev: NIL, next: NIL };

#[derive(Debug)]
struct Node {
    key: Arc<str>,
    last_access: Instant,
    /// Links in the recency list of every node (idle expiry).
    recency: Links,
    /// Links in its area's list.
    area_links: Links,
    area: Area,
    /// Accesses (LFU), and the access order that breaks their ties.
    frequency: u32,
    sequence: u64,
}

/// A doubly linked list threaded through the slab; `pick` chooses which links of a node.
#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: List = List { head: NIL, tail: NIL, len: 0 };

/// Count-min sketch of recent accesses: four rows of 4-bit counters (one byte each here, for
/// simplicity), halved after `10 × capacity` increments so old popularity fades.
#[derive(Debug)]
struct Sketch {
    rows: [Vec<u8>; 4],
    mask: usize,
    additions: usize,
    reset_after: usize,
}

/// Counters per row at most (4 MiB for the four rows): a sketch sized for a larger share
/// only estimates less precisely, where an unbounded one could abort the node.
const MAX_SKETCH_WIDTH: usize = 1 << 20;

impl Sketch {
    fn width_for(capacity: usize) -> usize {
        capacity.max(16).next_power_of_two().min(MAX_SKETCH_WIDTH)
    }

    fn new(capacity: usize) -> Self {
        let width = Self::width_for(capacity);
        Sketch {
            rows: std::array::from_fn(|_| vec![0; width]),
            mask: width - 1,
            additions: 0,
            reset_after: capacity.max(16).saturating_mul(10),
        }
    }

    /// The key's counter in each row: one seeded hash per row.
    fn slots(&self, key: &str) -> [usize; 4] {
        std::array::from_fn(|row| {
            (xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), row as u64) as usize) & self.mask
        })
    }

    fn increment(&mut self, key: &str) {
        for (row, i) in self.slots(key).into_iter().enumerate() {
            let c = &mut self.rows[row][i];
            *c = (*c + 1).min(15);
        }
        self.additions += 1;
        if self.additions >= self.reset_after {
            for row in &mut self.rows {
                row.iter_mut().for_each(|c| *c /= 2);
            }
            self.additions /= 2;
        }
    }

    fn estimate(&self, key: &str) -> u8 {
        self.slots(key).into_iter().enumerate().map(|(row, i)| self.rows[row][i]).min().unwrap_or(0)
    }
}

/// One shard's passivation policy.
#[derive(Debug)]
pub(crate) struct Passivation {
    settings: PolicySettings,
    nodes: Vec<Node>,
    free: Vec<u32>,
    recency: List,
    window: List,
    main: List,
    protected: List,
    /// LFU order of the main area: (frequency, sequence, node).
    by_frequency: BTreeSet<(u32, u64, u32)>,
    sketch: Option<Sketch>,
    sequence: u64,
}

impl Passivation {
    pub(crate) fn new(mut settings: PolicySettings) -> Self {
        settings.limit = settings.limit.map(|l| l.max(1));
        let sketch = settings.limit.filter(|_| settings.window_tinylfu).map(Sketch::new);
        Passivation {
            settings,
            nodes: Vec::new(),
            free: Vec::new(),
            recency: EMPTY,
            window: EMPTY,
            main: EMPTY,
            protected: EMPTY,
            by_frequency: BTreeSet::new(),
            sketch,
            sequence: 0,
        }
    }

    /// Forgets every entity (the shard stopped them all at once).
    pub(crate) fn clear(&mut self) {
        *self = Passivation::new(self.settings);
    }

    /// Whether the policy tracks anything at all (no idle timeout and no limit: it does not).
    pub(crate) fn is_active(&self) -> bool {
        self.settings.idle_timeout.is_some() || self.settings.limit.is_some()
    }

    /// Entities tracked (running and not chosen to stop).
    pub(crate) fn len(&self) -> usize {
        self.recency.len
    }

    /// The shard's current limit.
    #[cfg(test)]
    pub(crate) fn limit(&self) -> Option<usize> {
        self.settings.limit
    }

    fn window_capacity(&self) -> usize {
        match (self.settings.window_tinylfu, self.settings.limit) {
            // 1% of the limit, at least one entity (Caffeine's default split).
            (true, Some(limit)) => (limit / 100).max(1).min(limit),
            _ => 0,
        }
    }

    /// The main area's room: the limit less the window (unbounded without a limit).
    fn main_capacity(&self) -> usize {
        self.settings.limit.map_or(usize::MAX, |limit| limit - self.window_capacity())
    }

    fn protected_capacity(&self) -> usize {
        match self.settings.replacement {
            Replacement::Slru { protected_per_mille } => {
                self.main_capacity().saturating_mul(usize::from(protected_per_mille)) / 1000
            }
            _ => 0,
        }
    }

    /// A new entity starts: tracked as the most recent. With a limit, room is made first (the
    /// victims, already untracked, are appended to `victims`). `None` when nothing is tracked
    /// (no idle timeout and no limit).
    pub(crate) fn started(&mut self, key: &Arc<str>, now: Instant, victims: &mut Vec<Arc<str>>) -> Option<Handle> {
        if !self.is_active() {
            return None;
        }
        if let Some(s) = self.sketch.as_mut() {
            s.increment(key);
        }
        let limit = self.settings.limit;
        let area = if self.window_capacity() > 0 { Area::Window } else { Area::Main };
        if area == Area::Main
            && let Some(limit) = limit
        {
            while self.len() >= limit {
                let Some(v) = self.main_victim() else { break };
                victims.push(self.remove(v));
            }
        }
        let h = self.alloc(key.clone(), now, area);
        // The window's oldest move on (the newcomer is its newest, so it stays).
        while self.window.len > self.window_capacity() {
            let candidate = self.window.head;
            self.admit(candidate, victims);
        }
        // A main area left fuller than its share by a lower limit gives way now.
        self.shrink_to_limit(victims);
        Some(h)
    }

    /// Passivates main-area victims while over the limit (the window alone never is: it holds
    /// at most its capacity, which is within the limit).
    fn shrink_to_limit(&mut self, victims: &mut Vec<Arc<str>>) {
        let Some(limit) = self.settings.limit else { return };
        while self.len() > limit {
            let Some(v) = self.main_victim() else { break };
            victims.push(self.remove(v));
        }
    }

    /// Whether `h` is the live node of `key` (a handle kept past its entity's removal may since
    /// name another entity).
    fn is_node_of(&self, h: Handle, key: &Arc<str>) -> bool {
        self.nodes.get(h as usize).is_some_and(|n| n.sequence != FREE && Arc::ptr_eq(&n.key, key))
    }

    /// A message reached the entity: it becomes the most recent (and more frequent).
    pub(crate) fn accessed(&mut self, h: Handle, key: &Arc<str>, now: Instant) {
        if !self.is_node_of(h, key) {
            return;
        }
        if let Some(s) = self.sketch.as_mut() {
            s.increment(key);
        }
        self.sequence += 1;
        let seq = self.sequence;
        let node = &mut self.nodes[h as usize];
        node.last_access = now;
        let old = (node.frequency, node.sequence, h);
        node.frequency = node.frequency.saturating_add(1);
        node.sequence = seq;
        let new = (node.frequency, node.sequence, h);
        list_move_to_tail(&mut self.nodes, &mut self.recency, h, |n| &mut n.recency);
        let area = self.nodes[h as usize].area;
        match (area, self.settings.replacement) {
            (Area::Window, _) => list_move_to_tail(&mut self.nodes, &mut self.window, h, |n| &mut n.area_links),
            (Area::Main, Replacement::Slru { .. }) => {
                // Used again while probationary: promoted; the protected segment's oldest is
                // demoted back when it overflows.
                list_remove(&mut self.nodes, &mut self.main, h, |n| &mut n.area_links);
                self.nodes[h as usize].area = Area::Protected;
                list_push_tail(&mut self.nodes, &mut self.protected, h, |n| &mut n.area_links);
                while self.protected.len > self.protected_capacity() {
                    let oldest = self.protected.head;
                    list_remove(&mut self.nodes, &mut self.protected, oldest, |n| &mut n.area_links);
                    self.nodes[oldest as usize].area = Area::Main;
                    list_push_tail(&mut self.nodes, &mut self.main, oldest, |n| &mut n.area_links);
                }
            }
            (Area::Protected, _) => list_move_to_tail(&mut self.nodes, &mut self.protected, h, |n| &mut n.area_links),
            (Area::Main, Replacement::Lfu) => {
                self.by_frequency.remove(&old);
                self.by_frequency.insert(new);
            }
            (Area::Main, _) => list_move_to_tail(&mut self.nodes, &mut self.main, h, |n| &mut n.area_links),
        }
    }

    /// The entity stopped or is stopping for another reason (passivated itself, hand-off): it
    /// is no longer tracked.
    pub(crate) fn removed(&mut self, h: Handle, key: &Arc<str>) {
        if self.is_node_of(h, key) {
            self.remove(h);
        }
    }

    /// Entities idle for the timeout at `now`, least recent first (already untracked).
    pub(crate) fn expired(&mut self, now: Instant, victims: &mut Vec<Arc<str>>) {
        let Some(idle) = self.settings.idle_timeout else { return };
        while self.recency.head != NIL {
            let h = self.recency.head;
            if self.nodes[h as usize].last_access + idle > now {
                break;
            }
            victims.push(self.remove(h));
        }
    }

    /// When the next entity expires, if any.
    #[cfg(test)]
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        let idle = self.settings.idle_timeout?;
        (self.recency.head != NIL).then(|| self.nodes[self.recency.head as usize].last_access + idle)
    }

    /// The shard's share of the limit changed: entities over the new limit are victims. A
    /// shard always keeps room for one (a message must reach its entity).
    pub(crate) fn set_limit(&mut self, limit: usize, victims: &mut Vec<Arc<str>>) {
        if self.settings.limit.is_none() {
            return;
        }
        let limit = limit.max(1);
        self.settings.limit = Some(limit);
        // The sketch follows the share (the first shard of a region starts with all of it);
        // rebuilt when its width would change, losing only recent history.
        if let Some(sketch) = &self.sketch
            && sketch.mask + 1 != Sketch::width_for(limit)
        {
            self.sketch = Some(Sketch::new(limit));
        }
        while self.window.len > self.window_capacity() {
            // The window shrank: its oldest move on to the main area (and compete there).
            let oldest = self.window.head;
            self.admit(oldest, victims);
        }
        self.shrink_to_limit(victims);
    }

    /// Moves the window's `candidate` into the main area if there is room, or if it is used
    /// more often than the main area's victim (which then goes); otherwise it goes itself.
    fn admit(&mut self, candidate: u32, victims: &mut Vec<Arc<str>>) {
        let main_capacity = self.main_capacity();
        let main_len = self.main.len + self.protected.len + self.by_frequency.len();
        if main_len >= main_capacity {
            // Full: the more frequently used of the candidate and the main area's victim stays
            // (ties keep the incumbent: one-off traffic must not flush the main area).
            let estimate = |h: u32| self.sketch.as_ref().map_or(0, |s| s.estimate(&self.nodes[h as usize].key));
            match self.main_victim() {
                Some(v) if estimate(candidate) > estimate(v) => victims.push(self.remove(v)),
                _ => {
                    victims.push(self.remove(candidate));
                    return;
                }
            }
        }
        list_remove(&mut self.nodes, &mut self.window, candidate, |n| &mut n.area_links);
        self.nodes[candidate as usize].area = Area::Main;
        self.enter_main(candidate);
    }

    fn enter_main(&mut self, h: u32) {
        self.sequence += 1;
        let seq = self.sequence;
        let n = &mut self.nodes[h as usize];
        n.sequence = seq;
        if self.settings.replacement == Replacement::Lfu {
            self.by_frequency.insert((n.frequency, n.sequence, h));
        } else {
            list_push_tail(&mut self.nodes, &mut self.main, h, |n| &mut n.area_links);
        }
    }

    /// The main area's next victim under the replacement policy.
    fn main_victim(&self) -> Option<u32> {
        let pick = |l: &List, newest: bool| {
            let h = if newest { l.tail } else { l.head };
            (h != NIL).then_some(h)
        };
        match self.settings.replacement {
            Replacement::Lru => pick(&self.main, false),
            Replacement::Mru => pick(&self.main, true),
            Replacement::Slru { .. } => pick(&self.main, false).or_else(|| pick(&self.protected, false)),
            Replacement::Lfu => self.by_frequency.first().map(|(_, _, h)| *h),
        }
    }

    fn alloc(&mut self, key: Arc<str>, now: Instant, area: Area) -> u32 {
        let node =
            Node { key, last_access: now, recency: UNLINKED, area_links: UNLINKED, area, frequency: 1, sequence: 0 };
        let h = match self.free.pop() {
            Some(h) => {
                self.nodes[h as usize] = node;
                h
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 entities in one shard")
            }
        };
        list_push_tail(&mut self.nodes, &mut self.recency, h, |n| &mut n.recency);
        if area == Area::Window {
            list_push_tail(&mut self.nodes, &mut self.window, h, |n| &mut n.area_links);
        } else {
            self.enter_main(h);
        }
        h
    }

    /// Untracks `h` and returns its key; its slot is reused (marked by `sequence == FREE`).
    fn remove(&mut self, h: u32) -> Arc<str> {
        list_remove(&mut self.nodes, &mut self.recency, h, |n| &mut n.recency);
        let n = &self.nodes[h as usize];
        match (n.area, self.settings.replacement) {
            (Area::Window, _) => list_remove(&mut self.nodes, &mut self.window, h, |n| &mut n.area_links),
            (Area::Protected, _) => list_remove(&mut self.nodes, &mut self.protected, h, |n| &mut n.area_links),
            (Area::Main, Replacement::Lfu) => {
                let key = (n.frequency, n.sequence, h);
                self.by_frequency.remove(&key);
            }
            (Area::Main, _) => list_remove(&mut self.nodes, &mut self.main, h, |n| &mut n.area_links),
        }
        let n = &mut self.nodes[h as usize];
        n.sequence = FREE;
        self.free.push(h);
        std::mem::replace(&mut n.key, Arc::from(""))
    }
}

fn list_push_tail(nodes: &mut [Node], list: &mut List, h: u32, links: fn(&mut Node) -> &mut Links) {
    *links(&mut nodes[h as usize]) = Links { prev: list.tail, next: NIL };
    if list.tail != NIL {
        links(&mut nodes[list.tail as usize]).next = h;
    } else {
        list.head = h;
    }
    list.tail = h;
    list.len += 1;
}

fn list_remove(nodes: &mut [Node], list: &mut List, h: u32, links: fn(&mut Node) -> &mut Links) {
    let Links { prev, next } = *links(&mut nodes[h as usize]);
    if prev != NIL {
        links(&mut nodes[prev as usize]).next = next;
    } else {
        list.head = next;
    }
    if next != NIL {
        links(&mut nodes[next as usize]).prev = prev;
    } else {
        list.tail = prev;
    }
    *links(&mut nodes[h as usize]) = UNLINKED;
    list.len -= 1;
}

fn list_move_to_tail(nodes: &mut [Node], list: &mut List, h: u32, links: fn(&mut Node) -> &mut Links) {
    if list.tail != h {
        list_remove(nodes, list, h, links);
        list_push_tail(nodes, list, h, links);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// A policy under test with the keys it tracks, so tests speak in ids.
    struct Harness {
        p: Passivation,
        handles: BTreeMap<String, (Handle, Arc<str>)>,
        t0: Instant,
    }

    impl Harness {
        fn new(settings: PolicySettings) -> Self {
            Harness { p: Passivation::new(settings), handles: BTreeMap::new(), t0: Instant::now() }
        }

        fn limited(limit: usize, replacement: Replacement, window_tinylfu: bool) -> Self {
            Self::new(PolicySettings { idle_timeout: None, limit: Some(limit), replacement, window_tinylfu })
        }

        fn forget(&mut self, victims: &[Arc<str>]) -> Vec<String> {
            victims
                .iter()
                .map(|v| {
                    self.handles.remove(&**v).expect("a victim was tracked");
                    v.to_string()
                })
                .collect()
        }

        /// A message to `id` at second `at`: an access, or a start when it is not running.
        /// Returns the victims.
        fn message(&mut self, id: &str, at: u64) -> Vec<String> {
            let now = self.t0 + Duration::from_secs(at);
            if let Some((h, key)) = self.handles.get(id) {
                let (h, key) = (*h, key.clone());
                self.p.accessed(h, &key, now);
                return Vec::new();
            }
            let key: Arc<str> = Arc::from(id);
            let mut victims = Vec::new();
            let h = self.p.started(&key, now, &mut victims);
            let gone = self.forget(&victims);
            if let Some(h) = h {
                self.handles.insert(id.to_string(), (h, key));
            }
            gone
        }

        fn set_limit(&mut self, limit: usize) -> Vec<String> {
            let mut victims = Vec::new();
            self.p.set_limit(limit, &mut victims);
            self.forget(&victims)
        }

        fn running(&self) -> Vec<&str> {
            self.handles.keys().map(String::as_str).collect()
        }
    }

    #[test]
    fn idle_entities_expire_in_the_order_of_their_last_message_without_a_scan() {
        let mut h = Harness::new(PolicySettings::idle(Some(Duration::from_secs(10))));
        h.message("a", 0);
        h.message("b", 1);
        h.message("c", 2);
        h.message("a", 3); // a is now the most recent
        assert_eq!(h.p.next_expiry(), Some(h.t0 + Duration::from_secs(11)), "b expires first");
        let mut victims = Vec::new();
        h.p.expired(h.t0 + Duration::from_secs(10), &mut victims);
        assert!(victims.is_empty(), "nothing is 10 s idle at 10 s");
        h.p.expired(h.t0 + Duration::from_secs(12), &mut victims);
        assert_eq!(h.forget(&victims), ["b", "c"], "b then c, not a");
        assert_eq!(h.running(), ["a"]);
        assert_eq!(h.p.next_expiry(), Some(h.t0 + Duration::from_secs(13)));
    }

    #[test]
    fn without_an_idle_timeout_or_a_limit_nothing_is_tracked() {
        let mut h = Harness::new(PolicySettings::idle(None));
        assert!(!h.p.is_active());
        h.message("a", 0);
        assert_eq!(h.p.len(), 0);
        assert!(h.running().is_empty());
        assert_eq!(h.p.next_expiry(), None);
    }

    #[test]
    fn lru_passivates_the_least_recently_used_to_make_room() {
        let mut h = Harness::limited(3, Replacement::Lru, false);
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            assert!(h.message(id, i as u64).is_empty());
        }
        h.message("a", 3);
        assert_eq!(h.message("d", 4), ["b"]);
        assert_eq!(h.message("e", 5), ["c"]);
        assert_eq!(h.running(), ["a", "d", "e"]);
    }

    #[test]
    fn mru_passivates_the_most_recently_used_before_the_newcomer() {
        let mut h = Harness::limited(3, Replacement::Mru, false);
        h.message("a", 0);
        h.message("b", 1);
        h.message("c", 2);
        h.message("a", 3);
        assert_eq!(h.message("d", 4), ["a"], "a was used last");
        assert_eq!(h.message("e", 5), ["d"], "the previous newcomer is now the most recent");
        assert_eq!(h.running(), ["b", "c", "e"]);
    }

    #[test]
    fn lfu_passivates_the_least_frequently_used_ties_to_the_least_recent() {
        let mut h = Harness::limited(3, Replacement::Lfu, false);
        h.message("a", 0);
        h.message("b", 1);
        h.message("c", 2);
        for t in 3..6 {
            h.message("a", t);
        }
        h.message("c", 6);
        // Frequencies: a 4, b 1, c 2.
        assert_eq!(h.message("d", 7), ["b"]);
        // Now d 1 and c 2: d goes before c, though d is newer.
        assert_eq!(h.message("e", 8), ["d"]);
        // e 1 and c 2, both ahead of a.
        assert_eq!(h.message("f", 9), ["e"]);
        assert_eq!(h.running(), ["a", "c", "f"]);
    }

    #[test]
    fn slru_protects_entities_used_twice_from_a_scan_of_one_off_entities() {
        // Protected segment: 80% of 5 = 4.
        let mut h = Harness::limited(5, Replacement::Slru { protected_per_mille: 800 }, false);
        for (t, id) in ["hot1", "hot2"].iter().enumerate() {
            h.message(id, t as u64);
            h.message(id, t as u64 + 10);
        }
        // A scan of one-off ids passes through the probationary segment only.
        let mut gone = Vec::new();
        for i in 0..10 {
            gone.extend(h.message(&format!("scan{i}"), 20 + i));
        }
        assert!(!gone.iter().any(|v| v.starts_with("hot")), "hot entities survive the scan: {gone:?}");
        assert_eq!(h.running().iter().filter(|id| id.starts_with("hot")).count(), 2);
        // Plain LRU would have lost them.
        let mut lru = Harness::limited(5, Replacement::Lru, false);
        for (t, id) in ["hot1", "hot2"].iter().enumerate() {
            lru.message(id, t as u64);
            lru.message(id, t as u64 + 10);
        }
        for i in 0..10 {
            lru.message(&format!("scan{i}"), 20 + i);
        }
        assert!(lru.running().iter().all(|id| id.starts_with("scan")));
    }

    #[test]
    fn slru_demotes_the_oldest_protected_entity_when_its_segment_overflows() {
        // limit 4, protected 50% = 2.
        let mut h = Harness::limited(4, Replacement::Slru { protected_per_mille: 500 }, false);
        for (t, id) in ["a", "b", "c"].iter().enumerate() {
            h.message(id, t as u64);
        }
        for (t, id) in ["a", "b", "c"].iter().enumerate() {
            h.message(id, 10 + t as u64); // promoted in order: a is demoted when c comes in
        }
        h.message("d", 20);
        // Probation: a (demoted, older), d; protected: b, c. The victim is probation's oldest.
        assert_eq!(h.message("e", 21), ["a"]);
    }

    #[test]
    fn window_tinylfu_admits_a_newcomer_only_when_it_is_used_more_than_the_main_victim() {
        // limit 100: window of 1, main of 99.
        let mut h = Harness::limited(100, Replacement::Lru, true);
        for i in 0..99 {
            let id = format!("main{i}");
            for t in 0..3 {
                h.message(&id, t);
            }
        }
        h.message("w", 5);
        assert_eq!(h.p.len(), 100);
        // A one-off newcomer pushes w out of the window: w was seen once, the main victim
        // (main0) three times, so w is the one that goes.
        assert_eq!(h.message("once", 6), ["w"]);
        // An id seen often before (say it ran, was passivated, and keeps coming back) wins
        // admission over main's least recent entry.
        for t in 0..5 {
            h.message("popular", 7 + t);
        }
        assert_eq!(h.message("x", 20), ["main0"], "popular, leaving the window, beats main0");
        assert!(h.running().contains(&"popular"));
    }

    #[test]
    fn a_lower_limit_passivates_down_to_it_and_a_shard_keeps_room_for_one() {
        let mut h = Harness::limited(4, Replacement::Lru, false);
        for (t, id) in ["a", "b", "c", "d"].iter().enumerate() {
            h.message(id, t as u64);
        }
        assert_eq!(h.set_limit(2), ["a", "b"]);
        assert_eq!(h.p.limit(), Some(2));
        assert_eq!(h.set_limit(0), ["c"], "a share of 0 (more shards than the limit) still runs one");
        assert_eq!(h.p.limit(), Some(1));
        assert_eq!(h.message("e", 9), ["d"]);
        assert!(h.set_limit(3).is_empty());
        assert!(h.message("f", 10).is_empty());
        assert_eq!(h.running(), ["e", "f"]);
    }

    #[test]
    fn a_handle_kept_past_its_entitys_removal_touches_nothing() {
        let mut h = Harness::limited(1, Replacement::Lru, false);
        h.message("a", 0);
        let (old, a_key) = h.handles["a"].clone();
        assert_eq!(h.message("b", 1), ["a"]);
        // b reused a's slot; a's stale handle must neither touch nor remove b.
        assert_eq!(h.handles["b"].0, old, "the slot was reused");
        h.p.accessed(old, &a_key, h.t0 + Duration::from_secs(5));
        h.p.removed(old, &a_key);
        assert_eq!(h.p.len(), 1, "b is still tracked");
        assert_eq!(h.message("c", 6), ["b"]);
    }

    #[test]
    fn lfu_ties_go_to_the_least_recently_used_whatever_the_start_order() {
        let mut h = Harness::limited(2, Replacement::Lfu, false);
        h.message("a", 0);
        h.message("b", 1);
        h.message("b", 2);
        h.message("a", 3); // both used twice; a most recently
        assert_eq!(h.message("c", 4), ["b"]);
        // Never used again since they started: the older goes first, even when the newer took
        // an older slot of the policy.
        let mut h = Harness::limited(2, Replacement::Lfu, false);
        h.message("a", 0);
        h.message("b", 1);
        assert_eq!(h.message("c", 2), ["a"]);
        assert_eq!(h.message("d", 3), ["b"], "b started before c (which reuses a's slot)");
    }

    #[test]
    fn slru_keeps_its_protected_segment_full_before_demoting() {
        // limit 4, protected 50% = 2: a and b, both used twice, stay protected together.
        let mut h = Harness::limited(4, Replacement::Slru { protected_per_mille: 500 }, false);
        h.message("a", 0);
        h.message("b", 1);
        h.message("a", 2);
        h.message("b", 3);
        h.message("c", 4);
        h.message("d", 5);
        assert_eq!(h.message("e", 6), ["c"], "the victim is probation's oldest, not a protected entity");
        assert_eq!(h.message("f", 7), ["d"]);
    }

    #[test]
    fn the_window_holds_one_percent_of_the_limit_and_its_oldest_competes_when_it_overflows() {
        // limit 300: a window of 3, a main area of 297.
        let mut h = Harness::limited(300, Replacement::Lru, true);
        for i in 0..300 {
            assert!(h.message(&format!("e{i:03}"), i).is_empty(), "room for all 300");
        }
        // The 301st pushes the window's oldest (e297, seen once, as is main's victim e000)
        // into a tie with main's victim; ties keep the incumbent.
        assert_eq!(h.message("late", 400), ["e297"]);
    }

    #[test]
    fn the_sketch_halves_its_counts_after_ten_times_its_capacity_in_additions() {
        let mut sketch = Sketch::new(16);
        for _ in 0..20 {
            sketch.increment("hot");
        }
        assert_eq!(sketch.estimate("hot"), 15, "4-bit counters saturate at 15");
        assert_eq!(sketch.estimate("never"), 0);
        // 20 additions so far; 140 more reach 160 = 10 × 16: every counter halves once.
        for i in 0..139 {
            sketch.increment(&format!("other{i}"));
        }
        assert_eq!(sketch.estimate("hot"), 15, "not before the 160th addition");
        sketch.increment("other-last");
        assert_eq!(sketch.estimate("hot"), 7, "halved at the 160th");
        assert_eq!(sketch.additions, 80, "the count of additions halves too");
    }

    #[test]
    fn the_sketch_follows_the_share_and_never_outgrows_its_cap() {
        let mut h = Harness::limited(usize::MAX / 2, Replacement::Lru, true);
        assert_eq!(h.p.sketch.as_ref().unwrap().mask + 1, MAX_SKETCH_WIDTH, "a huge limit is capped");
        h.set_limit(1_000);
        assert_eq!(h.p.sketch.as_ref().unwrap().mask + 1, 1_024, "resized to the new share");
        for _ in 0..5 {
            h.p.sketch.as_mut().unwrap().increment("popular");
        }
        h.set_limit(1_010);
        assert_eq!(h.p.sketch.as_ref().unwrap().mask + 1, 1_024);
        assert_eq!(h.p.sketch.as_ref().unwrap().estimate("popular"), 5, "same width: its history is kept");
        let mut plain = Harness::limited(1_000, Replacement::Lru, false);
        plain.set_limit(10);
        assert!(plain.p.sketch.is_none(), "no admission, no sketch");
    }

    #[test]
    fn a_cleared_policy_tracks_nothing_and_keeps_its_limit() {
        let mut h = Harness::limited(2, Replacement::Lru, false);
        h.message("a", 0);
        h.message("b", 1);
        h.p.clear();
        h.handles.clear();
        assert_eq!(h.p.len(), 0);
        assert!(h.message("c", 2).is_empty(), "no ghost of a or b takes the room");
        assert!(h.message("d", 3).is_empty());
        assert_eq!(h.message("e", 4), ["c"], "the limit of 2 still holds");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Message(u8),
        Stop(u8),
        Limit(u8),
        Tick,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..40).prop_map(Op::Message),
            1 => (0u8..40).prop_map(Op::Stop),
            1 => (0u8..12).prop_map(Op::Limit),
            1 => Just(Op::Tick),
        ]
    }

    fn replacement() -> impl Strategy<Value = Replacement> {
        prop_oneof![
            Just(Replacement::Lru),
            Just(Replacement::Mru),
            Just(Replacement::Lfu),
            (0u16..=1000).prop_map(|p| Replacement::Slru { protected_per_mille: p }),
        ]
    }

    proptest! {
        /// Under any sequence of messages, stops, limit changes and idle ticks, the tracked set
        /// is exactly what was started and not named a victim or stopped, never above the limit,
        /// and every victim was running.
        #[test]
        fn the_limit_is_never_exceeded_and_victims_are_exactly_the_running_entities_that_leave(
            limit in 0usize..10,
            replacement in replacement(),
            window_tinylfu: bool,
            idle in proptest::option::of(1u64..20),
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let settings = PolicySettings {
                idle_timeout: idle.map(Duration::from_secs),
                limit: Some(limit),
                replacement,
                window_tinylfu,
            };
            let mut h = Harness::new(settings);
            let mut limit = limit.max(1);
            for (t, op) in ops.into_iter().enumerate() {
                let t = t as u64;
                match op {
                    Op::Message(i) => {
                        h.message(&format!("e{i}"), t);
                    }
                    Op::Stop(i) => {
                        if let Some((handle, key)) = h.handles.remove(&format!("e{i}")) {
                            h.p.removed(handle, &key);
                        }
                    }
                    Op::Limit(l) => {
                        limit = usize::from(l).max(1);
                        h.set_limit(usize::from(l));
                    }
                    Op::Tick => {
                        let mut victims = Vec::new();
                        h.p.expired(h.t0 + Duration::from_secs(t), &mut victims);
                        h.forget(&victims);
                    }
                }
                prop_assert!(h.p.len() <= limit, "{} running over the limit {limit}", h.p.len());
                prop_assert_eq!(h.p.len(), h.handles.len(), "the policy tracks exactly the running entities");
            }
        }
    }
}
