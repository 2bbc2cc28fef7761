//! The workload and the faults of a run: client asks (random ones during the faults, one per
//! entity after recovery), random crashes, graceful leaves, restarts and partitions, and the
//! controls a test drives a scripted run with.

use super::*;

impl Sim {
    /// Asks `entity_id` through node slot `i`'s region.
    pub(super) fn ask(&mut self, i: usize, entity_id: String, must_answer: bool) {
        self.ask_attempt(i, entity_id, must_answer, 0);
    }

    pub(super) fn ask_attempt(&mut self, i: usize, entity_id: String, must_answer: bool, attempt: u32) {
        let Some(node) = self.nodes[i].as_mut() else { return };
        let ask = self.next_ask;
        self.next_ask += 1;
        let shard = default_shard_id(&entity_id, self.cfg.shards);
        let asker = node.addr.clone();
        let deadline = self.now_ms + ASK_TIMEOUT_MS;
        self.asks
            .insert(ask, Ask { entity_id: entity_id.clone(), asker, deadline, outcome: None, must_answer, attempt });
        let mut out = Vec::new();
        let now = self.now();
        let node = self.nodes[i].as_mut().expect("running");
        node.region.handle(
            RegionInput::Route { shard, entity_id, msg: Msg { ask: Some(ask), delivery: None } },
            now,
            &mut out,
        );
        self.perform_region(i, out);
    }

    pub(super) fn on_ask(&mut self) {
        let running: Vec<usize> =
            (0..self.nodes.len()).filter(|i| self.nodes[*i].is_some() && !self.is_paused(*i)).collect();
        if !running.is_empty() {
            let i = running[self.rng.random_range(0..running.len())];
            let e = self.rng.random_range(0..self.cfg.entities);
            self.ask(i, format!("e{e}"), false);
        }
        // Asks whose asker crashed end with it; the others time out.
        let now = self.now_ms;
        let expired: Vec<u64> =
            self.asks.iter().filter(|(_, a)| a.outcome.is_none() && a.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            self.resolve(id, Err(TIMEOUT));
        }
        if self.now_ms < self.cfg.fault_ms {
            let gap = self.rng.random_range(10..60);
            self.schedule(gap, Event::Ask);
        }
    }

    pub(super) fn on_fault(&mut self) {
        if self.now_ms >= self.cfg.fault_ms {
            return;
        }
        let n = self.nodes.len();
        let serving = (0..n).filter(|i| self.nodes[*i].is_some() && !self.is_paused(*i)).count();
        // Pauses exist in durable runs only; the other modes keep the fault stream (and so the
        // seeds pinned by tests) they had before.
        // Message-path runs add one-way and messaging-only cuts (kinds 12 and 13).
        let kinds = 11 + i32::from(self.cfg.durable) + 2 * i32::from(self.cfg.message_path);
        let mut kind = self.rng.random_range(0..kinds);
        if !self.cfg.durable && kind >= 11 {
            kind += 1;
        }
        match kind {
            12 | 13 => {
                let a = self.rng.random_range(0..n);
                let b = (a + self.rng.random_range(1..n)) % n;
                if kind == 12 {
                    self.cut.insert((a, b));
                    self.trace(|| format!("one-way cut n{} -> n{}", a + 1, b + 1));
                } else {
                    self.messaging_cut.insert((a, b));
                    self.messaging_cut.insert((b, a));
                    self.trace(|| format!("messaging-only cut n{} <-> n{}", a + 1, b + 1));
                }
            }
            11 => {
                // A pause long enough, at times, for its peers to down the node and move its
                // shards: on resume it handles what it missed before it learns it was downed.
                let i = self.rng.random_range(0..n);
                // Durable state only: the fence is what makes a zombie harmless there, and the
                // coordinator's term what makes a zombie coordinator harmless (seeds 13, 53 and
                // 922 paused the coordinator's node before its state was fenced).
                if self.nodes[i].is_some() && !self.is_paused(i) && serving > n / 2 + 1 {
                    let ms = self.rng.random_range(500..6_000);
                    self.pause_node(i, ms);
                }
            }
            10 => {
                let i = self.rng.random_range(0..n);
                if self.nodes[i].is_some() && self.nodes.iter().filter(|x| x.is_some()).count() > n / 2 + 1 {
                    self.leave_node(i);
                }
            }
            0..=2 => {
                let i = self.rng.random_range(0..n);
                if self.nodes[i].is_some() && self.nodes.iter().filter(|x| x.is_some()).count() > n / 2 + 1 {
                    self.crash(i, "crashes");
                }
            }
            3..=4 => {
                let i = self.rng.random_range(0..n);
                if self.nodes[i].is_none() && self.cut.is_empty() {
                    self.start_node(i);
                }
            }
            5..=6 => {
                if self.cut.is_empty() {
                    let k = self.rng.random_range(1..=(n - 1) / 2);
                    let mut slots: Vec<usize> = (0..n).collect();
                    for j in 0..n {
                        let r = self.rng.random_range(j..n);
                        slots.swap(j, r);
                    }
                    let (minority, majority) = slots.split_at(k);
                    for a in minority {
                        for b in majority {
                            self.cut.insert((*a, *b));
                            self.cut.insert((*b, *a));
                        }
                    }
                    self.trace(|| format!("partition {minority:?} | {majority:?}"));
                }
            }
            _ => {
                if !self.cut.is_empty() || !self.messaging_cut.is_empty() {
                    self.cut.clear();
                    self.messaging_cut.clear();
                    self.trace(|| "heal".into());
                }
            }
        }
        if self.now_ms < self.cfg.fault_ms {
            let gap = self.rng.random_range(500..3_000);
            self.schedule(gap, Event::Fault);
        }
    }

    /// Asks `entity_id` through node `i` (index from 0) and returns the ask's id.
    pub fn ask_through(&mut self, i: usize, entity_id: &str) -> u64 {
        let id = self.next_ask;
        self.ask(i, entity_id.to_string(), false);
        id
    }

    /// Whether ask `id` was answered.
    pub fn answered(&self, id: u64) -> bool {
        self.asks.get(&id).is_some_and(|a| a.outcome == Some(Ok(())))
    }

    /// Crashes node `i` (index from 0); its disk stays.
    pub fn crash_node(&mut self, i: usize) {
        self.crash(i, "crashes");
    }

    /// Starts node `i` again as a new incarnation on its disk.
    pub fn restart_node(&mut self, i: usize) {
        self.crash(i, "stops for a restart");
        self.start_node(i);
    }

    /// Node `i` leaves gracefully: its member turns Leaving and its region asks the coordinator
    /// to hand its shards off; once the region has stopped, the member is removed and the node
    /// stops.
    pub fn leave_node(&mut self, i: usize) {
        let now = self.now();
        // A paused process starts nothing; a member already Down never turns Leaving (Down is
        // final: overwriting it would let its peers' coordinator keep, then lose, its shards
        // while it still runs them).
        if self.is_paused(i) {
            return;
        }
        let Some(node) = self.nodes[i].as_mut() else { return };
        let addr = node.addr.clone();
        let Some(row) = self.members.iter_mut().find(|m| m.addr == addr) else { return };
        if matches!(row.status, MemberStatus::Down | MemberStatus::Removed) {
            return;
        }
        row.status = MemberStatus::Leaving;
        let mut out = Vec::new();
        node.region.handle(RegionInput::GracefulShutdown, now, &mut out);
        self.trace(|| format!("{addr} leaves"));
        self.perform_region(i, out);
        self.on_membership();
    }

    /// Pauses node `i` (index from 0) for `ms` of virtual time, like a stop-the-world pause or
    /// a suspended VM: it handles nothing meanwhile, then everything it missed, in order,
    /// before it learns what its peers decided about it.
    pub fn pause_node(&mut self, i: usize, ms: u64) {
        let Some(node) = self.nodes[i].as_ref() else { return };
        let addr = node.addr.clone();
        self.paused_until[i] = self.now_ms + ms;
        self.was_paused.insert(addr);
        self.trace(|| format!("n{} pauses for {ms} ms", i + 1));
    }

    /// Cuts every link between the two sets of node indexes.
    pub fn partition(&mut self, a: &[usize], b: &[usize]) {
        for x in a {
            for y in b {
                self.cut.insert((*x, *y));
                self.cut.insert((*y, *x));
            }
        }
        self.trace(|| format!("partition {a:?} | {b:?}"));
    }

    /// Cuts messages from node `from` to node `to` only (gossip and messaging; indexes from 0).
    pub fn cut_one_way(&mut self, from: usize, to: usize) {
        self.cut.insert((from, to));
        self.trace(|| format!("one-way cut n{} -> n{}", from + 1, to + 1));
    }

    /// Cuts node-to-node messages between two nodes, both ways, while gossip flows.
    pub fn cut_messaging(&mut self, a: usize, b: usize) {
        self.messaging_cut.insert((a, b));
        self.messaging_cut.insert((b, a));
        self.trace(|| format!("messaging-only cut n{} <-> n{}", a + 1, b + 1));
    }

    /// Restores every link.
    pub fn heal(&mut self) {
        self.cut.clear();
        self.messaging_cut.clear();
        self.trace(|| "heal".into());
    }

    /// Entity ids running anywhere now.
    pub fn live_entities(&self) -> BTreeSet<String> {
        self.live.iter().filter(|(_, on)| !on.is_empty()).map(|(id, _)| id.clone()).collect()
    }

    /// Entity ids running on node `i` (index from 0), sorted.
    pub fn live_entities_on(&self, i: usize) -> Vec<String> {
        self.nodes[i].as_ref().map(|n| n.entities.keys().cloned().collect()).unwrap_or_default()
    }

    /// Virtual time in ms.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// What was seen so far.
    pub fn report(&self) -> &SimReport {
        &self.report
    }

    /// Replicator messages dropped so far because their sender had been downed or removed
    /// where they arrived ([`SimReport::quarantined_messages`] at the end of a run).
    pub fn quarantined_messages(&self) -> u64 {
        self.replicator_stats.quarantined.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ask `ask` ended with `outcome` (once: a late answer after a failure is dropped).
    pub(super) fn resolve(&mut self, ask: u64, outcome: Result<(), &'static str>) {
        let Some(a) = self.asks.get_mut(&ask) else { return };
        if let Some(earlier) = a.outcome {
            // A late answer after a failure is dropped (the asker stopped waiting); an entity
            // answering one ask twice handled the message twice.
            if outcome.is_ok() && earlier.is_ok() {
                self.report.violations.push(format!("ask {ask} to {} answered twice", a.entity_id));
            }
            return;
        }
        a.outcome = Some(outcome);
        if let (true, Err(why)) = (a.must_answer, outcome)
            && (why == HAND_OFF || why == REGION_GONE)
            && a.attempt < MAX_RETRIES
        {
            let (entity_id, attempt) = (a.entity_id.clone(), a.attempt + 1);
            a.must_answer = false; // its retry carries the promise now
            self.schedule(200, Event::RetryAsk { entity_id, attempt });
        }
        match outcome {
            Ok(()) => self.report.answered += 1,
            Err(why) => *self.report.failed.entry(why).or_default() += 1,
        }
    }
}
