//! A shard region as a sans-IO state machine: routes messages to local shards, to other regions,
//! or into one bounded buffer while a shard's home is unknown; registers with the coordinator
//! with backoff; takes part in hand-offs; shuts down gracefully.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::clock::Instant;
use crate::sharding::ids::{RegionId, ShardId};
use crate::sharding::protocol::{ToCoordinator, ToRegion};

/// Why the region dropped a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionDrop {
    /// The region's buffer (`buffer_size`) is full.
    BufferFull,
    /// Buffered for a shard that was then handed off (delivering it later could reorder).
    HandOff,
    /// The coordinator refused this region: its shard-id extractor differs from the
    /// coordinator's, so routing by it could run an entity in two shards at once.
    Refused,
    /// Sent on by another region to a shard this region no longer hosts (it moved on while
    /// the message travelled). Sending it on once more could let it overtake that region's
    /// later messages to the entity, which go straight to the new home.
    MovedOn,
}

#[derive(Debug)]
pub(crate) enum RegionInput<M> {
    Route {
        shard: ShardId,
        entity_id: String,
        msg: M,
    },
    /// A message another region sent on to this one as the shard's home at `epoch` (0: not
    /// known). Delivered if the shard is hosted here (or about to be); held, and the home asked
    /// for, if it arrived before this region learnt of that home; dropped
    /// ([`RegionDrop::MovedOn`]) if this region knows the shard at that epoch or a newer one
    /// and does not host it: sent on a second hop it could overtake the sender's later
    /// messages, which go straight to the new home.
    Forwarded {
        shard: ShardId,
        epoch: u64,
        entity_id: String,
        msg: M,
    },
    /// A message from the coordinator on `from`.
    Coordinator {
        from: RegionId,
        msg: ToRegion,
    },
    /// The membership changed: the routable regions
    /// ([`crate::membership::MemberStatus::is_routable`]) and the coordinator's host
    /// ([`crate::membership::MembershipSnapshot::singleton_host`]). Homes on regions that are no
    /// longer routable are forgotten (their messages are buffered and the home asked anew),
    /// and each such region is reported with [`RegionAction::RegionGone`].
    Members {
        routable: BTreeSet<RegionId>,
        coordinator: Option<RegionId>,
    },
    /// A local shard finished its hand-off (or, having failed, was not running when asked).
    LocalShardStopped(ShardId),
    /// A local shard that failed has waited out its backoff: it starts again only if this
    /// region still hosts it at `epoch` and is not handing it off or shutting down.
    RestartFailedShard {
        shard: ShardId,
        epoch: u64,
    },
    /// Durable entities: a newer allocation of `shard` claimed its state while this region
    /// hosts it at `epoch`. The local shard stops (as after a newer home elsewhere) and the
    /// home is asked anew; messages wait meanwhile.
    LocalShardFenced {
        shard: ShardId,
        epoch: u64,
    },
    /// Leave: hand every shard off through the coordinator, then stop. The request is sent
    /// again every `retry_interval` until the coordinator acts on it (a request lost to a cut
    /// link or a coordinator that moved must not leave the shards here); past
    /// `shutdown_timeout` the region stops anyway ([`RegionAction::Stopped`] with `forced`).
    GracefulShutdown,
    Tick,
}

#[derive(Debug, PartialEq)]
pub(crate) enum RegionAction<M> {
    ToCoordinator {
        coordinator: RegionId,
        msg: ToCoordinator,
    },
    StartShard {
        shard: ShardId,
        epoch: u64,
    },
    Deliver {
        shard: ShardId,
        entity_id: String,
        msg: M,
    },
    Forward {
        region: RegionId,
        shard: ShardId,
        /// The epoch of that home.
        epoch: u64,
        entity_id: String,
        msg: M,
    },
    HandOffShard {
        shard: ShardId,
    },
    Drop {
        entity_id: String,
        msg: M,
        reason: RegionDrop,
    },
    /// The region is no longer routable: asks waiting for an answer from it fail now.
    RegionGone(RegionId),
    /// The region has not been registered for another `retry_interval` × 10 (and counting):
    /// `why` says what it waits for, for an operator's log.
    StillUnregistered {
        why: String,
    },
    /// Graceful shutdown finished: no shards and no buffered messages left, or (`forced`) the
    /// shutdown timeout passed first; the driver stops whatever still runs. The coordinator
    /// learns of a forced stop from the membership (the member exits), not from this region.
    Stopped {
        forced: bool,
    },
}

/// Settings the region uses.
#[derive(Debug, Clone)]
pub(crate) struct RegionSettings {
    pub buffer_size: usize,
    pub retry_interval: Duration,
    /// [`crate::sharding::ids::extractor_fingerprint`] of this region's extractor.
    pub extractor_fingerprint: u64,
    /// How long a graceful shutdown may take before the region stops anyway.
    pub shutdown_timeout: Duration,
    /// The settings that must agree across nodes ([`crate::sharding::ShardingSettings::must_agree`]).
    pub must_agree: Vec<(String, String)>,
}

impl RegionSettings {
    /// The settings of a region of a type with these sharding settings.
    pub(crate) fn of(settings: &crate::sharding::ShardingSettings, extractor_fingerprint: u64, durable: bool) -> Self {
        RegionSettings {
            buffer_size: settings.buffer_size,
            retry_interval: settings.retry_interval,
            extractor_fingerprint,
            shutdown_timeout: settings.handoff_timeout + SHUTDOWN_GRACE,
            must_agree: settings.must_agree(durable),
        }
    }
}

/// A graceful shutdown gives up this long after the hand-off timeout (a hand-off begun just
/// before its end still gets its answer).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Routing and hand-off state of one region (or proxy).
pub(crate) struct RegionCore<M> {
    me: RegionId,
    proxy: bool,
    settings: RegionSettings,
    coordinator: Option<RegionId>,
    /// Regions messages can be sent to (from the latest membership view).
    routable: BTreeSet<RegionId>,
    registered: bool,
    /// The coordinator refused the registration (another extractor): nothing is routed until
    /// a coordinator accepts it.
    refused: bool,
    /// Why the coordinator refused it, when it said.
    refusal: Option<String>,
    register_backoff: Duration,
    next_register: Instant,
    /// When the next warning is due while the region is not registered.
    next_unregistered_warning: Instant,
    homes: Homes,
    hosted: BTreeMap<ShardId, u64>,
    /// Per shard, the newest epoch this region hosted it at (kept after it stopped), so a
    /// message forwarded for that epoch or an older one is known to have missed its shard.
    hosted_before: BTreeMap<ShardId, u64>,
    /// Shards being handed off, with the id of the `HandOff` to answer.
    handing_off: BTreeMap<ShardId, u64>,
    buffers: BTreeMap<ShardId, VecDeque<(String, M)>>,
    buffered: usize,
    requested: BTreeMap<ShardId, Instant>,
    /// Durable entities: per shard, the newest epoch this region hosted it at whose claim a
    /// newer allocation's fence refused. A home at that epoch or older is stale (the coordinator
    /// that names it has not seen the newer allocation, or is itself a paused zombie) and is
    /// not started again: starting it would be fenced at once, in a loop with that coordinator.
    superseded: BTreeMap<ShardId, u64>,
    /// Graceful shutdown: when it began, and when its request to the coordinator goes again.
    shutting_down: Option<Shutdown>,
    stopped: bool,
}

/// A graceful shutdown in progress.
#[derive(Debug, Clone, Copy)]
struct Shutdown {
    deadline: Instant,
    next_request: Instant,
}

/// The shard homes a region knows, and a generation that grows with every change to them: a
/// forward goes to a home in this map whose region is routable, and a region that stops being
/// routable, or a refusal, takes its homes out of the map; so a copy of a forward decision taken
/// at one generation holds while the generation is unchanged.
#[derive(Default)]
struct Homes {
    map: BTreeMap<ShardId, (RegionId, u64)>,
    generation: u64,
}

impl Homes {
    fn get(&self, shard: &ShardId) -> Option<&(RegionId, u64)> {
        self.map.get(shard)
    }

    fn insert(&mut self, shard: ShardId, home: (RegionId, u64)) {
        self.generation += 1;
        self.map.insert(shard, home);
    }

    fn remove(&mut self, shard: &ShardId) {
        self.generation += 1;
        self.map.remove(shard);
    }

    fn retain(&mut self, keep: impl FnMut(&ShardId, &mut (RegionId, u64)) -> bool) {
        let before = self.map.len();
        self.map.retain(keep);
        if self.map.len() != before {
            self.generation += 1;
        }
    }

    fn clear(&mut self) {
        self.generation += 1;
        self.map.clear();
    }
}

/// Registration retries start at an eighth of the retry interval (at least 100 ms) and double
/// up to the interval.
/// How often a region that is not registered says so: every ten retry intervals.
fn unregistered_warning_every(retry_interval: Duration) -> Duration {
    retry_interval.saturating_mul(10)
}

fn initial_register_backoff(retry_interval: Duration) -> Duration {
    (retry_interval / 8).max(Duration::from_millis(100)).min(retry_interval)
}

impl<M> RegionCore<M> {
    pub(crate) fn new(me: RegionId, proxy: bool, settings: RegionSettings, now: Instant) -> Self {
        let settings_warn_after = unregistered_warning_every(settings.retry_interval);
        RegionCore {
            me,
            proxy,
            register_backoff: initial_register_backoff(settings.retry_interval),
            settings,
            coordinator: None,
            routable: BTreeSet::new(),
            registered: false,
            refused: false,
            refusal: None,
            next_register: now,
            next_unregistered_warning: now + settings_warn_after,
            homes: Homes::default(),
            hosted: BTreeMap::new(),
            hosted_before: BTreeMap::new(),
            handing_off: BTreeMap::new(),
            buffers: BTreeMap::new(),
            buffered: 0,
            requested: BTreeMap::new(),
            superseded: BTreeMap::new(),
            shutting_down: None,
            stopped: false,
        }
    }

    /// Whether the coordinator refused this region: nothing is routed (not even to the
    /// entities of shards still hosted here) until one accepts it.
    pub(crate) fn refused(&self) -> bool {
        self.refused
    }

    /// What an unregistered region waits for, in an operator's words.
    fn unregistered_because(&self) -> String {
        match (&self.coordinator, self.refused) {
            (None, _) => "no coordinator: no member that can run the type's coordinator is up and reachable (is a \
                          node with the type's role running?)"
                .to_string(),
            (Some(_), true) => format!(
                "the coordinator refused it: {}",
                self.refusal().unwrap_or("its shard-id extractor differs from the coordinator's node")
            ),
            (Some(c), false) => format!(
                "the coordinator on {c} has not answered its registration (unreachable, or still reading its state)"
            ),
        }
    }

    /// Why the coordinator refused this region, if it did and said why.
    pub(crate) fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref().filter(|_| self.refused)
    }

    /// The coordinator acknowledged this region's registration.
    pub(crate) fn registered(&self) -> bool {
        self.registered
    }

    /// This region.
    pub(crate) fn me(&self) -> &RegionId {
        &self.me
    }

    /// The coordinator this region registers with, when one is known.
    pub(crate) fn coordinator(&self) -> Option<&RegionId> {
        self.coordinator.as_ref()
    }

    /// Messages waiting for a shard home.
    pub(crate) fn buffered(&self) -> usize {
        self.buffered
    }

    /// Grows with every change that can change where a message is routed (a home learnt or
    /// forgotten, a region no longer routable, a refusal): a [`RegionAction::Forward`] decided
    /// at one generation is the decision for every message to that shard until it changes.
    pub(crate) fn routing_generation(&self) -> u64 {
        self.homes.generation
    }

    fn to_coordinator(&self, msg: ToCoordinator, out: &mut Vec<RegionAction<M>>) {
        if let Some(c) = &self.coordinator {
            out.push(RegionAction::ToCoordinator { coordinator: c.clone(), msg });
        }
    }

    fn request_home(&mut self, shard: &ShardId, now: Instant, out: &mut Vec<RegionAction<M>>) {
        if !self.registered {
            return; // asked for every buffered shard once registered
        }
        if self.requested.get(shard).is_some_and(|at| *at + self.settings.retry_interval > now) {
            return;
        }
        self.requested.insert(shard.clone(), now);
        self.to_coordinator(ToCoordinator::GetShardHome { shard: shard.clone(), region: self.me.clone() }, out);
    }

    fn route(&mut self, shard: ShardId, entity_id: String, msg: M, now: Instant, out: &mut Vec<RegionAction<M>>) {
        if self.refused {
            out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::Refused });
            return;
        }
        match self.homes.get(&shard).cloned() {
            Some((home, epoch)) if home == self.me => {
                if !self.hosted.contains_key(&shard) {
                    self.hosted.insert(shard.clone(), epoch);
                    out.push(RegionAction::StartShard { shard: shard.clone(), epoch });
                }
                out.push(RegionAction::Deliver { shard, entity_id, msg });
            }
            Some((home, epoch)) if self.routable.contains(&home) => {
                out.push(RegionAction::Forward { region: home, shard, epoch, entity_id, msg })
            }
            home => {
                if home.is_some() {
                    // The home's node is gone: forget it and ask again.
                    self.homes.remove(&shard);
                }
                if self.buffered >= self.settings.buffer_size {
                    out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::BufferFull });
                    return;
                }
                self.buffers.entry(shard.clone()).or_default().push_back((entity_id, msg));
                self.buffered += 1;
                self.request_home(&shard, now, out);
            }
        }
    }

    fn forwarded(
        &mut self,
        shard: ShardId,
        epoch: u64,
        entity_id: String,
        msg: M,
        now: Instant,
        out: &mut Vec<RegionAction<M>>,
    ) {
        if self.refused {
            out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::Refused });
            return;
        }
        let home = self.homes.get(&shard).cloned();
        if home.as_ref().is_some_and(|(home, _)| *home == self.me) {
            return self.route(shard, entity_id, msg, now, out);
        }
        if self.hosted.contains_key(&shard) {
            // Hosted here, its hand-off begun: the shard still runs its entities (the new home
            // starts only once it has stopped), so the message reaches the entity before it
            // stops, or the shard drops it.
            out.push(RegionAction::Deliver { shard, entity_id, msg });
            return;
        }
        let known = home.as_ref().map(|(_, e)| *e).max(self.hosted_before.get(&shard).copied());
        if epoch > 0 && known.is_some_and(|k| k >= epoch) {
            out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::MovedOn });
            if home.is_none() {
                self.request_home(&shard, now, out);
            }
            return;
        }
        // Sent for a home this region has not heard of yet (the coordinator answers others
        // before its HostShard reaches here): held until it does. A home elsewhere known here
        // is older than the sender's, so it is forgotten rather than forwarded to.
        if home.is_some() {
            self.homes.remove(&shard);
        }
        self.route(shard, entity_id, msg, now, out);
    }

    fn flush(&mut self, shard: &ShardId, now: Instant, out: &mut Vec<RegionAction<M>>) {
        if let Some(buf) = self.buffers.remove(shard) {
            self.buffered -= buf.len();
            for (entity_id, msg) in buf {
                self.route(shard.clone(), entity_id, msg, now, out);
            }
        }
    }

    fn host(&mut self, shard: ShardId, epoch: u64, now: Instant, out: &mut Vec<RegionAction<M>>) {
        self.homes.insert(shard.clone(), (self.me.clone(), epoch));
        if self.hosted.get(&shard) != Some(&epoch) {
            self.hosted.insert(shard.clone(), epoch);
            out.push(RegionAction::StartShard { shard: shard.clone(), epoch });
        }
        self.flush(&shard, now, out);
    }

    pub(crate) fn handle(&mut self, input: RegionInput<M>, now: Instant, out: &mut Vec<RegionAction<M>>) {
        match input {
            RegionInput::Route { shard, entity_id, msg } => self.route(shard, entity_id, msg, now, out),
            RegionInput::Forwarded { shard, epoch, entity_id, msg } => {
                self.forwarded(shard, epoch, entity_id, msg, now, out)
            }
            RegionInput::Coordinator { from, msg } => {
                // Only the coordinator this region follows (the oldest member in its view) may
                // place shards here: a stale one elsewhere (its node stopped being the oldest)
                // must not start a shard its successor placed on another region. Messages lost
                // while two views briefly disagree are re-sent by the usual retries.
                if self.coordinator.as_ref() == Some(&from) {
                    self.on_coordinator(msg, now, out);
                }
            }
            RegionInput::Members { routable, coordinator } => {
                for gone in self.routable.difference(&routable) {
                    self.homes.retain(|_, (r, _)| r != gone);
                    out.push(RegionAction::RegionGone(gone.clone()));
                }
                // A region that became routable changes no forward already decided; one that
                // left takes its homes with it (the retain above moved the generation).
                self.routable = routable;
                if coordinator != self.coordinator {
                    if self.registered {
                        self.next_unregistered_warning = now + unregistered_warning_every(self.settings.retry_interval);
                    }
                    self.coordinator = coordinator;
                    self.registered = false;
                    self.register_backoff = initial_register_backoff(self.settings.retry_interval);
                    self.next_register = now;
                    self.on_tick(now, out);
                }
            }
            RegionInput::LocalShardStopped(shard) => {
                if let Some(epoch) = self.hosted.remove(&shard) {
                    let before = self.hosted_before.entry(shard.clone()).or_insert(epoch);
                    *before = (*before).max(epoch);
                }
                if let Some(handoff) = self.handing_off.remove(&shard) {
                    self.to_coordinator(ToCoordinator::ShardStopped { shard, region: self.me.clone(), handoff }, out);
                }
                self.check_stopped(out);
            }
            RegionInput::RestartFailedShard { shard, epoch } => {
                if self.hosted.get(&shard) == Some(&epoch)
                    && !self.handing_off.contains_key(&shard)
                    && self.shutting_down.is_none()
                {
                    out.push(RegionAction::StartShard { shard, epoch });
                }
            }
            RegionInput::LocalShardFenced { shard, epoch } => {
                if self.hosted.get(&shard) != Some(&epoch) {
                    return;
                }
                let newest = self.superseded.entry(shard.clone()).or_insert(epoch);
                *newest = (*newest).max(epoch);
                if self.homes.get(&shard).is_some_and(|(home, e)| *home == self.me && *e <= epoch) {
                    self.homes.remove(&shard);
                }
                if !self.handing_off.contains_key(&shard) {
                    self.handing_off.insert(shard.clone(), 0);
                    out.push(RegionAction::HandOffShard { shard: shard.clone() });
                }
                self.requested.remove(&shard);
                self.request_home(&shard, now, out);
            }
            RegionInput::GracefulShutdown => {
                if self.shutting_down.is_none() {
                    let deadline = now + self.settings.shutdown_timeout;
                    self.shutting_down = Some(Shutdown { deadline, next_request: now });
                }
                self.request_shutdown(now, out);
                self.check_stopped(out);
            }
            RegionInput::Tick => self.on_tick(now, out),
        }
    }

    /// The coordinator names a shard's home: hosted here, or remembered and its buffered
    /// messages sent on; a late (older) answer changes nothing, and a newer home elsewhere
    /// stops the local copy.
    fn on_shard_home(
        &mut self,
        shard: ShardId,
        region: RegionId,
        epoch: u64,
        now: Instant,
        out: &mut Vec<RegionAction<M>>,
    ) {
        if self.is_superseded(&shard, epoch) {
            // Asked again after the retry interval (messages wait), by when the
            // coordinator has read the newer allocation or its node learnt it was downed.
            return;
        }
        // Epochs never go backwards: a home older than one known here is a late message.
        let known = self.homes.get(&shard).map(|(_, e)| *e).max(self.hosted.get(&shard).copied());
        if known.is_some_and(|k| epoch < k) {
            return;
        }
        // Placed elsewhere with a newer epoch while running here (the coordinator's state
        // lost it, or it took this region for gone): stop the local one, so the id never
        // runs in two places.
        if region != self.me
            && self.hosted.get(&shard).is_some_and(|hosted| *hosted < epoch)
            && !self.handing_off.contains_key(&shard)
        {
            self.handing_off.insert(shard.clone(), 0);
            out.push(RegionAction::HandOffShard { shard: shard.clone() });
        }
        if region == self.me || self.routable.contains(&region) {
            // Otherwise the request stays throttled: asking again at once for a home
            // this region cannot reach yet would loop with the coordinator.
            self.requested.remove(&shard);
        }
        if region == self.me {
            self.host(shard, epoch, now, out);
        } else {
            self.homes.insert(shard.clone(), (region, epoch));
            self.flush(&shard, now, out);
        }
    }

    fn on_coordinator(&mut self, msg: ToRegion, now: Instant, out: &mut Vec<RegionAction<M>>) {
        match msg {
            ToRegion::RegisterAck { coordinator } => {
                self.coordinator = Some(coordinator);
                self.registered = true;
                self.refused = false;
                self.requested.clear();
                let shards: Vec<ShardId> = self.buffers.keys().cloned().collect();
                for s in shards {
                    self.request_home(&s, now, out);
                }
                if let Some(s) = self.shutting_down.as_mut() {
                    s.next_request = now;
                    self.request_shutdown(now, out);
                }
            }
            ToRegion::RegisterRefused { reason, .. } => {
                // Retried with the backoff: a coordinator elsewhere may accept it later.
                self.refused = true;
                self.refusal = (!reason.is_empty()).then_some(reason);
                self.homes.clear();
                self.requested.clear();
                self.buffered = 0;
                for (entity_id, msg) in std::mem::take(&mut self.buffers).into_values().flatten() {
                    out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::Refused });
                }
            }
            ToRegion::ShardHome { shard, region, epoch } => self.on_shard_home(shard, region, epoch, now, out),
            ToRegion::ShardHomes { homes } => {
                for (shard, region, epoch) in homes {
                    self.on_shard_home(shard, region, epoch, now, out);
                }
            }
            ToRegion::HostShard { shard, epoch } => {
                if self.proxy || self.shutting_down.is_some() || self.is_superseded(&shard, epoch) {
                    return; // the coordinator re-sends elsewhere after shard_start_timeout
                }
                if self.handing_off.contains_key(&shard) {
                    // Sent before the hand-off began (seed 570000570): taking it would keep a
                    // home here once the shard stopped. The hand-off's end answers it.
                    return;
                }
                self.requested.remove(&shard);
                self.host(shard.clone(), epoch, now, out);
                self.to_coordinator(ToCoordinator::ShardStarted { shard, region: self.me.clone() }, out);
            }
            ToRegion::BeginHandOff { shard, handoff } => {
                self.homes.remove(&shard);
                self.requested.remove(&shard);
                self.to_coordinator(ToCoordinator::BeginHandOffAck { shard, region: self.me.clone(), handoff }, out);
            }
            ToRegion::HandOff { shard, handoff } => {
                // Messages buffered for the shard are dropped: sent on after the hand-off they
                // could overtake messages that reach the new home first.
                if let Some(buf) = self.buffers.remove(&shard) {
                    self.buffered -= buf.len();
                    for (entity_id, msg) in buf {
                        out.push(RegionAction::Drop { entity_id, msg, reason: RegionDrop::HandOff });
                    }
                }
                self.homes.remove(&shard);
                if self.hosted.contains_key(&shard) {
                    // A repeated HandOff (new id) is answered with the newest id once stopped.
                    if self.handing_off.insert(shard.clone(), handoff).is_none() {
                        out.push(RegionAction::HandOffShard { shard });
                    }
                } else {
                    self.to_coordinator(ToCoordinator::ShardStopped { shard, region: self.me.clone(), handoff }, out);
                }
            }
        }
    }

    /// Whether a home of `shard` at `epoch` is known to be superseded (see `superseded`); a
    /// newer one forgets the record.
    fn is_superseded(&mut self, shard: &ShardId, epoch: u64) -> bool {
        match self.superseded.get(shard) {
            Some(fenced) if epoch <= *fenced => true,
            Some(_) => {
                self.superseded.remove(shard);
                false
            }
            None => false,
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<RegionAction<M>>) {
        if !self.registered && self.shutting_down.is_none() && now >= self.next_unregistered_warning {
            self.next_unregistered_warning = now + unregistered_warning_every(self.settings.retry_interval);
            out.push(RegionAction::StillUnregistered { why: self.unregistered_because() });
        }
        if !self.registered && self.coordinator.is_some() && now >= self.next_register {
            let extractor = self.settings.extractor_fingerprint;
            let settings = if self.proxy { Vec::new() } else { self.settings.must_agree.clone() };
            let register = ToCoordinator::Register { region: self.me.clone(), proxy: self.proxy, extractor, settings };
            self.to_coordinator(register, out);
            self.next_register = now + self.register_backoff;
            self.register_backoff = (self.register_backoff * 2).min(self.settings.retry_interval);
        }
        if self.registered {
            let shards: Vec<ShardId> = self.buffers.keys().cloned().collect();
            for s in shards {
                self.request_home(&s, now, out);
            }
        }
        self.request_shutdown(now, out);
        self.check_stopped(out);
        if let Some(s) = self.shutting_down
            && !self.stopped
            && now >= s.deadline
        {
            self.stopped = true;
            out.push(RegionAction::Stopped { forced: true });
        }
    }

    /// Asks the coordinator to hand this region's shards off, at most once per retry interval
    /// while the shutdown lasts.
    fn request_shutdown(&mut self, now: Instant, out: &mut Vec<RegionAction<M>>) {
        let Some(s) = self.shutting_down.as_mut() else { return };
        if self.stopped || !self.registered || now < s.next_request {
            return;
        }
        s.next_request = now + self.settings.retry_interval;
        self.to_coordinator(ToCoordinator::GracefulShutdownReq { region: self.me.clone() }, out);
    }

    fn check_stopped(&mut self, out: &mut Vec<RegionAction<M>>) {
        if self.shutting_down.is_some() && !self.stopped && self.hosted.is_empty() && self.buffered == 0 {
            self.stopped = true;
            self.to_coordinator(ToCoordinator::RegionStopped { region: self.me.clone() }, out);
            out.push(RegionAction::Stopped { forced: false });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::UniqueAddress;

    fn r(n: &str) -> RegionId {
        UniqueAddress::new(n, 1)
    }

    #[test]
    fn a_refused_region_fails_what_it_buffered_routes_nothing_and_routes_again_once_accepted() {
        let mut c = RegionCore::new(r("me"), false, test_settings(10, 8), Instant::now());
        let mut out = Vec::new();
        c.handle(members(&["me", "coord", "other"], Some("coord")), Instant::now(), &mut out);
        assert!(matches!(
            &out[..],
            [RegionAction::ToCoordinator { msg: ToCoordinator::Register { extractor: 8, .. }, .. }]
        ));
        assert!(run(&mut c, route("1", 1)).is_empty(), "buffered until registered");
        let out = run(&mut c, coord(ToRegion::RegisterRefused { coordinator: r("coord"), reason: String::new() }));
        assert!(matches!(&out[..], [RegionAction::Drop { msg: 1, reason: RegionDrop::Refused, .. }]), "{out:?}");
        assert_eq!(c.buffered(), 0);
        let out = run(&mut c, route("1", 2));
        assert!(matches!(&out[..], [RegionAction::Drop { msg: 2, reason: RegionDrop::Refused, .. }]), "{out:?}");
        assert_eq!(c.refusal(), None, "a coordinator that predates the reason gave none");
        run(
            &mut c,
            coord(ToRegion::RegisterRefused { coordinator: r("coord"), reason: "`state.slots` differs".into() }),
        );
        assert_eq!(c.refusal(), Some("`state.slots` differs"));
        // A coordinator that accepts it (the cluster now runs this extractor) lifts the refusal.
        run(&mut c, coord(ToRegion::RegisterAck { coordinator: r("coord") }));
        assert_eq!(c.refusal(), None, "accepted: no refusal to report");
        let out = run(&mut c, route("1", 3));
        assert!(matches!(&out[..], [RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }]));
    }

    /// Region settings for tests: a 2 s retry interval, this buffer and extractor fingerprint.
    fn test_settings(buffer_size: usize, extractor_fingerprint: u64) -> RegionSettings {
        RegionSettings {
            buffer_size,
            retry_interval: Duration::from_secs(2),
            extractor_fingerprint,
            shutdown_timeout: Duration::from_secs(31),
            must_agree: Vec::new(),
        }
    }

    fn region(buffer_size: usize) -> RegionCore<u32> {
        let mut c = RegionCore::new(r("me"), false, test_settings(buffer_size, 7), Instant::now());
        let mut out = Vec::new();
        c.handle(members(&["me", "coord", "other"], Some("coord")), Instant::now(), &mut out);
        assert!(matches!(&out[..], [RegionAction::ToCoordinator { msg: ToCoordinator::Register { .. }, .. }]));
        c.handle(coord(ToRegion::RegisterAck { coordinator: r("coord") }), Instant::now(), &mut out);
        c
    }

    #[test]
    fn homes_sent_before_the_registration_ack_deliver_what_was_buffered_and_the_ack_asks_only_for_unknown_shards() {
        let mut c = RegionCore::new(r("me"), false, test_settings(10, 7), Instant::now());
        run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        assert!(run(&mut c, route("1", 1)).is_empty(), "buffered until registered");
        assert!(run(&mut c, route("9", 2)).is_empty(), "buffered until registered");
        let homes = vec![("1".to_string(), r("other"), 4), ("2".to_string(), r("me"), 3)];
        let out = run(&mut c, coord(ToRegion::ShardHomes { homes }));
        assert!(
            out.iter().any(|a| matches!(a, RegionAction::Forward { msg: 1, epoch: 4, .. })),
            "a known home delivers what waited for it: {out:?}"
        );
        assert!(out.iter().any(|a| matches!(a, RegionAction::StartShard { .. })), "its own shard starts: {out:?}");
        let out = run(&mut c, coord(ToRegion::RegisterAck { coordinator: r("coord") }));
        let asked: Vec<&ShardId> = out
            .iter()
            .filter_map(|a| match a {
                RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { shard, .. }, .. } => Some(shard),
                _ => None,
            })
            .collect();
        assert_eq!(asked, ["9"], "only the shard nobody named");
        let out = run(&mut c, route("1", 3));
        assert!(matches!(&out[..], [RegionAction::Forward { msg: 3, .. }]), "{out:?}");
    }

    #[test]
    fn an_unregistered_region_says_why_every_ten_retry_intervals_and_a_registered_one_is_quiet() {
        let t0 = Instant::now();
        let settings = test_settings(10, 7);
        let mut c: RegionCore<u32> = RegionCore::new(r("me"), false, settings, t0);
        let warnings = |c: &mut RegionCore<u32>, at: Duration| -> Vec<String> {
            let mut out = Vec::new();
            c.handle(RegionInput::Tick, t0 + at, &mut out);
            out.into_iter()
                .filter_map(|a| match a {
                    RegionAction::StillUnregistered { why } => Some(why),
                    _ => None,
                })
                .collect()
        };
        assert!(warnings(&mut c, Duration::from_secs(19)).is_empty(), "not before ten retry intervals");
        let why = warnings(&mut c, Duration::from_secs(20));
        assert!(matches!(&why[..], [w] if w.starts_with("no coordinator")), "{why:?}");
        assert!(warnings(&mut c, Duration::from_secs(21)).is_empty(), "once per period");
        c.handle(members(&["me", "coord"], Some("coord")), t0 + Duration::from_secs(21), &mut Vec::new());
        let why = warnings(&mut c, Duration::from_secs(40));
        assert!(matches!(&why[..], [w] if w.contains("has not answered")), "{why:?}");
        let refused = ToRegion::RegisterRefused { coordinator: r("coord"), reason: "`state.slots` differs".into() };
        c.handle(coord(refused), t0 + Duration::from_secs(41), &mut Vec::new());
        let why = warnings(&mut c, Duration::from_secs(60));
        assert!(matches!(&why[..], [w] if w.contains("refused it: `state.slots` differs")), "{why:?}");
        c.handle(
            coord(ToRegion::RegisterAck { coordinator: r("coord") }),
            t0 + Duration::from_secs(61),
            &mut Vec::new(),
        );
        assert!(warnings(&mut c, Duration::from_secs(200)).is_empty(), "registered: nothing to say");
    }

    /// A membership view with these routable regions and this coordinator host.
    fn members(routable: &[&str], coordinator: Option<&str>) -> RegionInput<u32> {
        RegionInput::Members { routable: routable.iter().map(|n| r(n)).collect(), coordinator: coordinator.map(r) }
    }

    /// A message from the coordinator the test region follows.
    fn coord(msg: ToRegion) -> RegionInput<u32> {
        RegionInput::Coordinator { from: r("coord"), msg }
    }

    #[test]
    fn the_routing_generation_moves_with_every_change_of_the_homes_a_forward_goes_to_and_only_then() {
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        let mut seen = c.routing_generation();
        let mut moved = |c: &RegionCore<u32>, what: &str, expected: bool| {
            let now = c.routing_generation();
            assert_eq!(now != seen, expected, "{what}: generation {seen} -> {now}");
            assert!(now >= seen, "{what}: the generation never goes back");
            seen = now;
        };
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 5 }));
        moved(&c, "a home learnt", true);
        let out = run(&mut c, route("1", 1));
        assert!(matches!(&out[..], [RegionAction::Forward { epoch: 5, .. }]), "{out:?}");
        run(&mut c, RegionInput::Tick);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        moved(&c, "a forward, a tick and the same routable regions", false);
        run(&mut c, coord(ToRegion::BeginHandOff { shard: "1".into(), handoff: 1 }));
        moved(&c, "a hand-off begun (the home forgotten)", true);
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("third"), epoch: 6 }));
        moved(&c, "a new home", true);
        run(&mut c, coord(ToRegion::HandOff { shard: "2".into(), handoff: 2 }));
        moved(&c, "a hand-off of a shard not hosted here", true);
        run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        moved(&c, "a region with a home no longer routable", true);
        run(&mut c, members(&["me", "coord"], Some("coord")));
        moved(&c, "a region without homes no longer routable", false);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        moved(&c, "regions routable again (no home is known on them)", false);
        let out = run(&mut c, route("1", 2));
        assert!(
            !out.iter().any(|a| matches!(a, RegionAction::Forward { .. })),
            "the home on a region that left was forgotten, not reused when it came back: {out:?}"
        );
        run(&mut c, coord(ToRegion::HostShard { shard: "3".into(), epoch: 1 }));
        moved(&c, "a shard hosted here", true);
        run(&mut c, RegionInput::LocalShardFenced { shard: "3".into(), epoch: 1 });
        moved(&c, "a local shard fenced (its home forgotten)", true);
        run(&mut c, coord(ToRegion::RegisterRefused { coordinator: r("coord"), reason: String::new() }));
        moved(&c, "the registration refused", true);
        run(&mut c, coord(ToRegion::RegisterAck { coordinator: r("coord") }));
        moved(&c, "the registration accepted again (no home known yet)", false);
    }

    #[test]
    fn a_shard_home_older_than_the_one_known_is_ignored() {
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 5 }));
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("third"), epoch: 4 }));
        let out = run(&mut c, route("1", 1));
        assert!(
            matches!(&out[..], [RegionAction::Forward { region, .. }] if *region == r("other")),
            "routed by the newest home: {out:?}"
        );
        // An older HostShard-as-ShardHome for this region does not start anything either.
        assert!(run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 2 })).is_empty());
    }

    #[test]
    fn a_newer_home_elsewhere_for_a_shard_running_here_stops_the_local_one() {
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 2 }));
        let out = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 3 }));
        assert!(out.contains(&RegionAction::HandOffShard { shard: "1".into() }), "{out:?}");
        let again = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 3 }));
        assert!(!again.contains(&RegionAction::HandOffShard { shard: "1".into() }), "stopped once: {again:?}");
    }

    #[test]
    fn a_fenced_local_shard_is_stopped_forgotten_and_its_home_asked_anew_while_messages_wait() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 2 }));
        // A report for another epoch (an older instance) changes nothing.
        assert!(run(&mut c, RegionInput::LocalShardFenced { shard: "1".into(), epoch: 1 }).is_empty());
        let out = run(&mut c, RegionInput::LocalShardFenced { shard: "1".into(), epoch: 2 });
        assert!(out.contains(&RegionAction::HandOffShard { shard: "1".into() }), "{out:?}");
        assert!(
            out.iter().any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { shard, .. }, .. } if shard == "1")),
            "{out:?}"
        );
        // Stopped once, and nothing is delivered here meanwhile.
        let again = run(&mut c, RegionInput::LocalShardFenced { shard: "1".into(), epoch: 2 });
        assert!(!again.contains(&RegionAction::HandOffShard { shard: "1".into() }), "{again:?}");
        run(&mut c, RegionInput::LocalShardStopped("1".into()));
        let out = run(&mut c, route("1", 7));
        assert!(
            !out.iter().any(|a| matches!(a, RegionAction::Deliver { .. } | RegionAction::StartShard { .. })),
            "{out:?}"
        );
        assert_eq!(c.buffered(), 1);
        // The coordinator names the new home: the message goes there.
        let out = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 3 }));
        assert!(
            out.iter().any(|a| matches!(a, RegionAction::Forward { region, msg: 7, .. } if *region == r("other"))),
            "{out:?}"
        );
    }

    #[test]
    fn messages_from_a_coordinator_the_region_does_not_follow_are_ignored() {
        let mut c = region(10);
        let stale =
            RegionInput::Coordinator { from: r("old-coord"), msg: ToRegion::HostShard { shard: "1".into(), epoch: 3 } };
        assert!(run(&mut c, stale).is_empty(), "no shard started for a stale coordinator");
        let out = run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 4 }));
        assert!(out.contains(&RegionAction::StartShard { shard: "1".into(), epoch: 4 }));
    }

    /// Found by the durable simulation (seed 13): a paused coordinator's node woke up, still
    /// named its own region as the home of a shard a newer allocation had claimed, and the
    /// region restarted the shard, was fenced at once, asked again and so on, without end.
    #[test]
    fn a_home_at_an_epoch_already_fenced_is_not_started_again_and_is_asked_after_the_retry_interval() {
        let mut c = region(10);
        let t0 = Instant::now();
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 2 }));
        run(&mut c, RegionInput::LocalShardFenced { shard: "1".into(), epoch: 2 });
        run(&mut c, RegionInput::LocalShardStopped("1".into()));
        run(&mut c, route("1", 7));
        let asks_home = |out: &[RegionAction<u32>]| {
            out.iter().any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }))
        };
        for stale in [
            ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 2 },
            ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 1 },
            ToRegion::HostShard { shard: "1".into(), epoch: 2 },
        ] {
            let out = run(&mut c, coord(stale));
            assert!(out.is_empty(), "a superseded home starts nothing and asks nothing at once: {out:?}");
        }
        assert_eq!(c.buffered(), 1, "the message waits");
        let mut out = Vec::new();
        c.handle(RegionInput::Tick, t0 + Duration::from_secs(1), &mut out);
        assert!(!asks_home(&out), "not before the retry interval: {out:?}");
        c.handle(RegionInput::Tick, t0 + Duration::from_secs(3), &mut out);
        assert!(asks_home(&out), "asked again after it: {out:?}");
        // A newer allocation here starts and gets the message.
        let out = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 5 }));
        assert!(out.contains(&RegionAction::StartShard { shard: "1".into(), epoch: 5 }), "{out:?}");
        assert!(out.iter().any(|a| matches!(a, RegionAction::Deliver { .. })), "{out:?}");
        // And the record is gone: a later allocation at any newer epoch is not held back.
        assert!(c.superseded.is_empty());
    }

    fn run(c: &mut RegionCore<u32>, input: RegionInput<u32>) -> Vec<RegionAction<u32>> {
        let mut out = Vec::new();
        c.handle(input, Instant::now(), &mut out);
        out
    }

    fn route(shard: &str, msg: u32) -> RegionInput<u32> {
        RegionInput::Route { shard: shard.into(), entity_id: format!("e{msg}"), msg }
    }

    #[test]
    fn a_shard_homed_here_that_stopped_locally_is_started_again_by_its_next_message_once() {
        let mut c = region(10);
        let out = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 5 }));
        assert!(out.contains(&RegionAction::StartShard { shard: "1".into(), epoch: 5 }), "{out:?}");
        run(&mut c, RegionInput::LocalShardStopped("1".into()));
        let out = run(&mut c, route("1", 1));
        assert!(
            matches!(&out[..], [RegionAction::StartShard { epoch: 5, .. }, RegionAction::Deliver { msg: 1, .. }]),
            "{out:?}"
        );
        let out = run(&mut c, route("1", 2));
        assert!(matches!(&out[..], [RegionAction::Deliver { msg: 2, .. }]), "started once: {out:?}");
    }

    #[test]
    fn a_region_that_leaves_the_view_loses_its_homes_and_only_those() {
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 1 }));
        run(&mut c, coord(ToRegion::ShardHome { shard: "2".into(), region: r("third"), epoch: 1 }));
        let out = run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        assert_eq!(out, vec![RegionAction::RegionGone(r("third"))]);
        let out = run(&mut c, route("1", 1));
        assert!(matches!(&out[..], [RegionAction::Forward { region, msg: 1, .. }] if *region == r("other")), "{out:?}");
        let out = run(&mut c, route("2", 2));
        assert!(
            matches!(&out[..], [RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }]),
            "the gone region's shard is asked for again: {out:?}"
        );
    }

    fn asks_home(out: &[RegionAction<u32>]) -> bool {
        out.iter().any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }))
    }

    #[test]
    fn a_home_answer_lifts_the_request_throttle_so_a_lost_home_is_asked_for_at_once() {
        // A reachable region's home, then that region leaves the view.
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other", "third"], Some("coord")));
        assert!(asks_home(&run(&mut c, route("2", 1))));
        run(&mut c, coord(ToRegion::ShardHome { shard: "2".into(), region: r("third"), epoch: 1 }));
        run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        assert!(asks_home(&run(&mut c, route("2", 2))), "asked again at once, not after the retry interval");
        // A home here (this node not in its own routable view), then handed off.
        let mut c = region(10);
        run(&mut c, members(&["coord", "other"], Some("coord")));
        assert!(asks_home(&run(&mut c, route("1", 1))));
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("me"), epoch: 1 }));
        run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 3 }));
        assert!(asks_home(&run(&mut c, route("1", 2))), "asked again at once after the hand-off");
    }

    fn forwarded(shard: &str, epoch: u64, msg: u32) -> RegionInput<u32> {
        RegionInput::Forwarded { shard: shard.into(), epoch, entity_id: format!("e{msg}"), msg }
    }

    #[test]
    fn a_message_forwarded_by_another_region_is_delivered_only_where_its_shard_is_hosted_and_never_sent_on() {
        let mut c = region(10);
        run(&mut c, members(&["me", "coord", "other"], Some("coord")));
        run(&mut c, coord(ToRegion::RegisterAck { coordinator: r("coord") }));
        // Sent for a home here the coordinator has not told this region of yet: held, the home
        // asked for, and delivered once it is known.
        let out = run(&mut c, forwarded("1", 1, 1));
        assert!(asks_home(&out) && !out.iter().any(|a| matches!(a, RegionAction::Drop { .. })), "{out:?}");
        let out = run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }));
        assert!(out.iter().any(|a| matches!(a, RegionAction::Deliver { msg: 1, .. })), "{out:?}");
        // Homed here: delivered.
        let out = run(&mut c, forwarded("1", 1, 2));
        assert!(matches!(&out[..], [RegionAction::Deliver { msg: 2, .. }]), "{out:?}");
        // Hand-off begun here: the shard still runs it until it stops.
        run(&mut c, coord(ToRegion::BeginHandOff { shard: "1".into(), handoff: 1 }));
        let out = run(&mut c, forwarded("1", 1, 3));
        assert!(matches!(&out[..], [RegionAction::Deliver { msg: 3, .. }]), "{out:?}");
        // Handed off, homed elsewhere since: dropped, not forwarded a second time (it could
        // overtake the sender's later messages, which go straight to the new home).
        run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 1 }));
        run(&mut c, RegionInput::LocalShardStopped("1".into()));
        let out = run(&mut c, forwarded("1", 1, 4));
        assert!(matches!(&out[0], RegionAction::Drop { msg: 4, reason: RegionDrop::MovedOn, .. }), "{out:?}");
        assert!(asks_home(&out), "no home known: asked for: {out:?}");
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 2 }));
        let out = run(&mut c, forwarded("1", 1, 5));
        assert_eq!(out, vec![RegionAction::Drop { entity_id: "e5".into(), msg: 5, reason: RegionDrop::MovedOn }]);
        // A sender that knows a newer home (here, at epoch 3) than this region: held for it.
        let out = run(&mut c, forwarded("1", 3, 6));
        assert!(!out.iter().any(|a| matches!(a, RegionAction::Drop { .. } | RegionAction::Forward { .. })), "{out:?}");
        assert_eq!(c.buffered(), 1);
        // A local message still goes on to a home elsewhere.
        run(&mut c, coord(ToRegion::ShardHome { shard: "2".into(), region: r("other"), epoch: 1 }));
        let out = run(&mut c, route("2", 7));
        assert!(matches!(&out[..], [RegionAction::Forward { msg: 7, epoch: 1, .. }]), "{out:?}");
    }

    #[test]
    fn a_hand_off_drops_the_shards_buffered_messages_and_frees_their_buffer_space() {
        let mut c = region(3);
        for m in 1..=3 {
            run(&mut c, route("1", m));
        }
        assert_eq!(c.buffered(), 3);
        let out = run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 1 }));
        assert_eq!(
            out.iter().filter(|a| matches!(a, RegionAction::Drop { reason: RegionDrop::HandOff, .. })).count(),
            3
        );
        assert_eq!(c.buffered(), 0);
        assert!(!matches!(
            &run(&mut c, route("2", 4))[..],
            [RegionAction::Drop { reason: RegionDrop::BufferFull, .. }]
        ));
    }

    #[test]
    fn an_unanswered_home_request_is_repeated_once_the_retry_interval_has_passed() {
        let mut c = region(10);
        let t0 = Instant::now();
        let asks = |out: &[RegionAction<u32>]| {
            out.iter()
                .filter(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }))
                .count()
        };
        let mut out = Vec::new();
        c.handle(route("1", 1), t0, &mut out);
        assert_eq!(asks(&out), 1);
        let mut out = Vec::new();
        c.handle(RegionInput::Tick, t0 + Duration::from_secs(2) - Duration::from_millis(1), &mut out);
        assert_eq!(asks(&out), 0, "not before the interval");
        c.handle(RegionInput::Tick, t0 + Duration::from_secs(2), &mut out);
        assert_eq!(asks(&out), 1, "again once it has passed");
    }

    #[test]
    fn unknown_shard_is_buffered_asked_once_and_flushed_in_order_when_its_home_arrives() {
        let mut c = region(10);
        let out = run(&mut c, route("1", 1));
        assert!(matches!(&out[..], [RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }]));
        assert!(run(&mut c, route("1", 2)).is_empty(), "asked only once per shard");
        let out = run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 3 }));
        let msgs: Vec<u32> = out
            .iter()
            .map(|a| match a {
                RegionAction::Forward { msg, region, .. } if *region == r("other") => *msg,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(msgs, vec![1, 2]);
        assert_eq!(c.buffered(), 0);
    }

    #[test]
    fn full_buffer_drops_with_a_typed_reason() {
        let mut c = region(2);
        run(&mut c, route("1", 1));
        run(&mut c, route("2", 2));
        let out = run(&mut c, route("3", 3));
        assert_eq!(out, vec![RegionAction::Drop { entity_id: "e3".into(), msg: 3, reason: RegionDrop::BufferFull }]);
    }

    #[test]
    fn host_shard_starts_it_acknowledges_and_delivers_locally() {
        let mut c = region(10);
        run(&mut c, route("1", 1));
        let out = run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 9 }));
        assert_eq!(out[0], RegionAction::StartShard { shard: "1".into(), epoch: 9 });
        assert!(out.contains(&RegionAction::Deliver { shard: "1".into(), entity_id: "e1".into(), msg: 1 }));
        assert!(
            out.iter()
                .any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::ShardStarted { .. }, .. }))
        );
    }

    #[test]
    fn hand_off_buffers_after_begin_drops_buffer_on_hand_off_and_reports_stopped() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }));
        let out = run(&mut c, coord(ToRegion::BeginHandOff { shard: "1".into(), handoff: 9 }));
        assert!(matches!(
            &out[..],
            [RegionAction::ToCoordinator { msg: ToCoordinator::BeginHandOffAck { handoff: 9, .. }, .. }]
        ));
        run(&mut c, route("1", 5));
        assert_eq!(c.buffered(), 1);
        let out = run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 7 }));
        assert!(out.contains(&RegionAction::Drop { entity_id: "e5".into(), msg: 5, reason: RegionDrop::HandOff }));
        assert!(out.contains(&RegionAction::HandOffShard { shard: "1".into() }));
        let out = run(&mut c, RegionInput::LocalShardStopped("1".into()));
        assert!(
            matches!(
                &out[..],
                [RegionAction::ToCoordinator { msg: ToCoordinator::ShardStopped { handoff: 7, .. }, .. }]
            ),
            "answers with the id of the HandOff: {out:?}"
        );
    }

    /// Seed 570000570 (`seven-nodes-lossy`): the coordinator re-sent an unanswered HostShard
    /// while this region was stopping the shard for a hand-off; the region took it, answered
    /// ShardStarted and kept itself as the shard's home after the stop, so every later message
    /// for the shard was answered "not hosted" here while another region ran it.
    #[test]
    fn a_host_shard_resent_during_a_hand_off_is_ignored_and_no_home_here_outlives_the_stop() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 4 }));
        run(&mut c, coord(ToRegion::BeginHandOff { shard: "1".into(), handoff: 7 }));
        run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 7 }));
        let out = run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 4 }));
        assert!(out.is_empty(), "stale while handing off: neither started nor confirmed: {out:?}");
        let out = run(&mut c, RegionInput::LocalShardStopped("1".into()));
        assert!(matches!(
            &out[..],
            [RegionAction::ToCoordinator { msg: ToCoordinator::ShardStopped { handoff: 7, .. }, .. }]
        ));
        let out = run(&mut c, route("1", 5));
        assert!(
            out.iter()
                .any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. })),
            "the home is asked for again, not assumed to be here: {out:?}"
        );
    }

    #[test]
    fn a_failed_shard_restarts_after_its_backoff_only_if_still_hosted_at_its_epoch_and_not_handed_off() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 4 }));
        let restart = |epoch| RegionInput::RestartFailedShard { shard: "1".into(), epoch };
        assert_eq!(run(&mut c, restart(4)), vec![RegionAction::StartShard { shard: "1".into(), epoch: 4 }]);
        assert!(run(&mut c, restart(3)).is_empty(), "an older epoch's backoff ended: hosted anew since");
        // The coordinator hands it off while it waits out its backoff (nothing runs): the driver
        // answers at once, and the backoff's end starts nothing.
        let out = run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 8 }));
        assert!(out.contains(&RegionAction::HandOffShard { shard: "1".into() }));
        let out = run(&mut c, RegionInput::LocalShardStopped("1".into()));
        assert!(matches!(
            &out[..],
            [RegionAction::ToCoordinator { msg: ToCoordinator::ShardStopped { handoff: 8, .. }, .. }]
        ));
        assert!(run(&mut c, restart(4)).is_empty(), "handed off: not restarted here");
        run(&mut c, coord(ToRegion::HostShard { shard: "2".into(), epoch: 1 }));
        run(&mut c, coord(ToRegion::HandOff { shard: "2".into(), handoff: 9 }));
        assert!(
            run(&mut c, RegionInput::RestartFailedShard { shard: "2".into(), epoch: 1 }).is_empty(),
            "a hand-off on its way: not restarted"
        );
        run(&mut c, coord(ToRegion::HostShard { shard: "3".into(), epoch: 1 }));
        run(&mut c, RegionInput::GracefulShutdown);
        assert!(
            run(&mut c, RegionInput::RestartFailedShard { shard: "3".into(), epoch: 1 }).is_empty(),
            "shutting down: not restarted"
        );
    }

    #[test]
    fn graceful_shutdown_ends_when_no_shard_and_no_message_is_left() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }));
        let out = run(&mut c, RegionInput::GracefulShutdown);
        assert!(!out.contains(&RegionAction::Stopped { forced: false }));
        let out = run(&mut c, coord(ToRegion::HostShard { shard: "2".into(), epoch: 1 }));
        assert!(out.is_empty(), "no new shards while shutting down");
        run(&mut c, coord(ToRegion::HandOff { shard: "1".into(), handoff: 1 }));
        let out = run(&mut c, RegionInput::LocalShardStopped("1".into()));
        assert!(out.contains(&RegionAction::Stopped { forced: false }));
    }

    /// The shutdown requests among `out`.
    fn shutdown_requests(out: &[RegionAction<u32>]) -> usize {
        out.iter()
            .filter(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::GracefulShutdownReq { .. }, .. }))
            .count()
    }

    #[test]
    fn a_shutting_down_region_asks_the_coordinator_again_every_retry_interval_until_it_stops() {
        let mut c = region(10);
        let t0 = Instant::now();
        let at = |c: &mut RegionCore<u32>, input, ms: u64| {
            let mut out = Vec::new();
            c.handle(input, t0 + Duration::from_millis(ms), &mut out);
            out
        };
        at(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }), 0);
        assert_eq!(shutdown_requests(&at(&mut c, RegionInput::GracefulShutdown, 0)), 1);
        // The request was lost: ticks within the retry interval send nothing, the next one asks again.
        assert_eq!(shutdown_requests(&at(&mut c, RegionInput::Tick, 1_999)), 0);
        assert_eq!(shutdown_requests(&at(&mut c, RegionInput::Tick, 2_000)), 1);
        assert_eq!(shutdown_requests(&at(&mut c, RegionInput::Tick, 3_000)), 0);
        // A new coordinator that acknowledges the registration is asked at once.
        let out = at(
            &mut c,
            RegionInput::Members { routable: [r("me"), r("other")].into(), coordinator: Some(r("other")) },
            3_100,
        );
        assert_eq!(shutdown_requests(&out), 0, "not registered with the new one yet");
        let out = at(
            &mut c,
            RegionInput::Coordinator { from: r("other"), msg: ToRegion::RegisterAck { coordinator: r("other") } },
            3_200,
        );
        assert_eq!(shutdown_requests(&out), 1);
        let out = at(
            &mut c,
            RegionInput::Coordinator { from: r("other"), msg: ToRegion::HandOff { shard: "1".into(), handoff: 5 } },
            3_300,
        );
        assert!(out.contains(&RegionAction::HandOffShard { shard: "1".into() }));
        let out = at(&mut c, RegionInput::LocalShardStopped("1".into()), 3_400);
        assert!(out.contains(&RegionAction::Stopped { forced: false }));
        assert_eq!(shutdown_requests(&at(&mut c, RegionInput::Tick, 9_000)), 0, "stopped: no more requests");
    }

    #[test]
    fn a_region_s_shutdown_timeout_is_the_hand_off_timeout_plus_a_second() {
        let settings = crate::sharding::ShardingSettings::default();
        let region = RegionSettings::of(&settings, 7, false);
        assert_eq!(region.shutdown_timeout, settings.handoff_timeout + Duration::from_secs(1));
        assert_eq!((region.buffer_size, region.retry_interval), (settings.buffer_size, settings.retry_interval));
        assert_eq!(region.extractor_fingerprint, 7);
    }

    #[test]
    fn a_graceful_shutdown_past_its_timeout_stops_the_region_and_leaves_the_coordinator_to_the_membership() {
        let mut c = region(10);
        let t0 = Instant::now();
        let timeout = Duration::from_secs(31);
        let mut out = Vec::new();
        c.handle(coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }), t0, &mut out);
        c.handle(RegionInput::GracefulShutdown, t0, &mut out);
        let mut tick = |at: Instant| {
            let mut out = Vec::new();
            c.handle(RegionInput::Tick, at, &mut out);
            out
        };
        let before = tick(t0 + timeout - Duration::from_millis(1));
        assert!(!before.iter().any(|a| matches!(a, RegionAction::Stopped { .. })), "{before:?}");
        let out = tick(t0 + timeout);
        assert!(out.contains(&RegionAction::Stopped { forced: true }), "{out:?}");
        assert!(
            !out.iter()
                .any(|a| matches!(a, RegionAction::ToCoordinator { msg: ToCoordinator::RegionStopped { .. }, .. })),
            "its shard still runs until the driver stops it: the coordinator learns from the membership"
        );
        assert!(!tick(t0 + timeout * 2).iter().any(|a| matches!(a, RegionAction::Stopped { .. })), "stopped once");
    }

    #[test]
    fn registration_retries_with_backoff_until_acknowledged() {
        let t0 = Instant::now();
        let mut c: RegionCore<u32> = RegionCore::new(r("me"), true, test_settings(10, 7), t0);
        let mut out = Vec::new();
        c.handle(members(&["me", "coord"], Some("coord")), t0, &mut out);
        assert!(matches!(
            &out[..],
            [RegionAction::ToCoordinator { msg: ToCoordinator::Register { proxy: true, .. }, .. }]
        ));
        let mut times = Vec::new();
        let mut t = t0;
        for _ in 0..100 {
            t += Duration::from_millis(50);
            let mut out = Vec::new();
            c.handle(RegionInput::Tick, t, &mut out);
            if !out.is_empty() {
                times.push(t.duration_since(t0).as_millis());
            }
        }
        // 250 ms, then doubling: 500, 1000, 2000 (capped).
        assert_eq!(times[..3], [250, 750, 1750]);
    }

    #[test]
    fn a_region_that_stops_being_routable_is_reported_and_its_shards_asked_for_again() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("other"), epoch: 3 }));
        assert!(matches!(&run(&mut c, route("1", 1))[..], [RegionAction::Forward { .. }]));
        let out = run(&mut c, members(&["me", "coord"], Some("coord")));
        assert_eq!(out, vec![RegionAction::RegionGone(r("other"))]);
        let out = run(&mut c, route("1", 2));
        assert!(
            matches!(&out[..], [RegionAction::ToCoordinator { msg: ToCoordinator::GetShardHome { .. }, .. }]),
            "buffered and asked again, not forwarded to a gone region: {out:?}"
        );
        assert_eq!(c.buffered(), 1);
    }

    #[test]
    fn a_home_on_a_region_never_seen_routable_is_not_forwarded_to() {
        let mut c = region(10);
        run(&mut c, coord(ToRegion::ShardHome { shard: "1".into(), region: r("stranger"), epoch: 3 }));
        let out = run(&mut c, route("1", 1));
        assert!(!out.iter().any(|a| matches!(a, RegionAction::Forward { .. })), "{out:?}");
        assert_eq!(c.buffered(), 1);
    }

    #[test]
    fn a_new_coordinator_host_restarts_registration_at_once() {
        let mut c = region(10);
        let out = run(&mut c, members(&["me", "coord", "other"], Some("other")));
        assert!(
            matches!(&out[..], [RegionAction::ToCoordinator { coordinator, msg: ToCoordinator::Register { .. } }] if *coordinator == r("other")),
            "{out:?}"
        );
        let stale = run(&mut c, coord(ToRegion::HostShard { shard: "1".into(), epoch: 1 }));
        assert!(stale.is_empty(), "the old coordinator is no longer followed");
    }
}
