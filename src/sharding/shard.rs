//! A shard as a sans-IO state machine: the life cycle of its entities (start, passivate,
//! restart on the next message, stop for hand-off), with messages buffered while an entity is
//! passivating and delivered to its next incarnation.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// Life-cycle state of one entity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntityState {
    /// Running and receiving messages.
    Active,
    /// Told to stop (passivation or hand-off); new messages wait in the shard's buffer.
    Stopping,
}

#[derive(Debug)]
struct EntityEntry {
    state: EntityState,
    incarnation: u64,
    last_activity: Instant,
}

/// Why a message was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DropReason {
    /// The shard is being handed off.
    HandOff,
}

#[derive(Debug)]
pub(crate) enum ShardInput<M> {
    Deliver {
        entity_id: String,
        msg: M,
    },
    /// The entity asked to be passivated (after the message it was handling).
    Passivate {
        entity_id: String,
        incarnation: u64,
    },
    /// The entity task ended (after a stop, a panic or a forced abort).
    Terminated {
        entity_id: String,
        incarnation: u64,
    },
    HandOff,
    Tick,
}

#[derive(Debug, PartialEq)]
pub(crate) enum ShardAction<M> {
    /// Spawn entity `entity_id` as `incarnation`.
    Start {
        entity_id: String,
        incarnation: u64,
    },
    /// Put a message in the entity's mailbox.
    Send {
        entity_id: String,
        msg: M,
    },
    /// Put a stop signal in the entity's mailbox (after the messages already there).
    Stop {
        entity_id: String,
    },
    /// Abort the entity task now.
    ForceStop {
        entity_id: String,
    },
    Drop {
        entity_id: String,
        msg: M,
        reason: DropReason,
    },
    /// Hand-off finished: every entity has stopped.
    Stopped,
}

/// One shard's entities.
pub(crate) struct ShardCore<M> {
    entities: HashMap<String, EntityEntry>,
    buffers: HashMap<String, VecDeque<M>>,
    next_incarnation: u64,
    idle_timeout: Option<Duration>,
    handoff_deadline: Option<Instant>,
    handoff_stop_timeout: Duration,
}

impl<M> ShardCore<M> {
    pub(crate) fn new(idle_timeout: Option<Duration>, handoff_stop_timeout: Duration) -> Self {
        ShardCore {
            entities: HashMap::new(),
            buffers: HashMap::new(),
            next_incarnation: 1,
            idle_timeout,
            handoff_deadline: None,
            handoff_stop_timeout,
        }
    }

    /// Live entity ids (active or stopping).
    pub(crate) fn entity_ids(&self) -> impl Iterator<Item = &str> {
        self.entities.keys().map(String::as_str)
    }

    pub(crate) fn entity_count(&self) -> usize {
        self.entities.len()
    }

    fn start(&mut self, entity_id: &str, now: Instant, out: &mut Vec<ShardAction<M>>) {
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        self.entities
            .insert(entity_id.to_string(), EntityEntry { state: EntityState::Active, incarnation, last_activity: now });
        out.push(ShardAction::Start { entity_id: entity_id.to_string(), incarnation });
    }

    pub(crate) fn handle(&mut self, input: ShardInput<M>, now: Instant, out: &mut Vec<ShardAction<M>>) {
        match input {
            ShardInput::Deliver { entity_id, msg } => {
                if self.handoff_deadline.is_some() {
                    out.push(ShardAction::Drop { entity_id, msg, reason: DropReason::HandOff });
                    return;
                }
                match self.entities.get_mut(&entity_id).map(|e| {
                    e.last_activity = now;
                    e.state
                }) {
                    None => {
                        self.start(&entity_id, now, out);
                        out.push(ShardAction::Send { entity_id, msg });
                    }
                    Some(EntityState::Active) => out.push(ShardAction::Send { entity_id, msg }),
                    Some(EntityState::Stopping) => self.buffers.entry(entity_id).or_default().push_back(msg),
                }
            }
            ShardInput::Passivate { entity_id, incarnation } => {
                if let Some(e) = self.entities.get_mut(&entity_id)
                    && e.incarnation == incarnation
                    && e.state == EntityState::Active
                {
                    e.state = EntityState::Stopping;
                    out.push(ShardAction::Stop { entity_id });
                }
            }
            ShardInput::Terminated { entity_id, incarnation } => {
                if self.entities.get(&entity_id).is_none_or(|e| e.incarnation != incarnation) {
                    return;
                }
                self.entities.remove(&entity_id);
                if let Some(buffered) = self.buffers.remove(&entity_id) {
                    if self.handoff_deadline.is_some() {
                        for msg in buffered {
                            out.push(ShardAction::Drop {
                                entity_id: entity_id.clone(),
                                msg,
                                reason: DropReason::HandOff,
                            });
                        }
                    } else if !buffered.is_empty() {
                        // Messages that arrived while it stopped go to its next incarnation.
                        self.start(&entity_id, now, out);
                        for msg in buffered {
                            out.push(ShardAction::Send { entity_id: entity_id.clone(), msg });
                        }
                    }
                }
                if self.handoff_deadline.is_some() && self.entities.is_empty() {
                    self.handoff_deadline = None;
                    out.push(ShardAction::Stopped);
                }
            }
            ShardInput::HandOff => {
                if self.handoff_deadline.is_some() {
                    return;
                }
                self.handoff_deadline = Some(now + self.handoff_stop_timeout);
                for (id, buffered) in self.buffers.drain() {
                    for msg in buffered {
                        out.push(ShardAction::Drop { entity_id: id.clone(), msg, reason: DropReason::HandOff });
                    }
                }
                let mut ids: Vec<&String> = self.entities.keys().collect();
                ids.sort();
                for id in ids {
                    let e = &self.entities[id];
                    if e.state == EntityState::Active {
                        out.push(ShardAction::Stop { entity_id: id.clone() });
                    }
                }
                for e in self.entities.values_mut() {
                    e.state = EntityState::Stopping;
                }
                if self.entities.is_empty() {
                    self.handoff_deadline = None;
                    out.push(ShardAction::Stopped);
                }
            }
            ShardInput::Tick => {
                if let Some(deadline) = self.handoff_deadline {
                    if now >= deadline {
                        let mut ids: Vec<String> = self.entities.keys().cloned().collect();
                        ids.sort();
                        for id in ids {
                            out.push(ShardAction::ForceStop { entity_id: id });
                        }
                        self.entities.clear();
                        self.handoff_deadline = None;
                        out.push(ShardAction::Stopped);
                    }
                    return;
                }
                if let Some(idle) = self.idle_timeout {
                    let mut ids: Vec<String> = self
                        .entities
                        .iter()
                        .filter(|(_, e)| e.state == EntityState::Active && e.last_activity + idle <= now)
                        .map(|(id, _)| id.clone())
                        .collect();
                    ids.sort();
                    for id in ids {
                        self.entities.get_mut(&id).expect("entity").state = EntityState::Stopping;
                        out.push(ShardAction::Stop { entity_id: id });
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(s: &mut ShardCore<u32>, input: ShardInput<u32>, now: Instant) -> Vec<ShardAction<u32>> {
        let mut out = Vec::new();
        s.handle(input, now, &mut out);
        out
    }

    fn deliver(id: &str, msg: u32) -> ShardInput<u32> {
        ShardInput::Deliver { entity_id: id.into(), msg }
    }

    #[test]
    fn first_message_starts_the_entity_and_later_ones_go_straight_to_it() {
        let mut s = ShardCore::new(None, Duration::from_secs(1));
        let now = Instant::now();
        let out = run(&mut s, deliver("a", 1), now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "a".into(), incarnation: 1 },
                ShardAction::Send { entity_id: "a".into(), msg: 1 }
            ]
        );
        assert_eq!(run(&mut s, deliver("a", 2), now), vec![ShardAction::Send { entity_id: "a".into(), msg: 2 }]);
    }

    #[test]
    fn messages_during_passivation_are_buffered_and_delivered_to_the_next_incarnation() {
        let mut s = ShardCore::new(None, Duration::from_secs(1));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        assert_eq!(
            run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now),
            vec![ShardAction::Stop { entity_id: "a".into() }]
        );
        assert!(run(&mut s, deliver("a", 2), now).is_empty());
        assert!(run(&mut s, deliver("a", 3), now).is_empty());
        // A stale termination of an older incarnation is ignored.
        assert!(run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 0 }, now).is_empty());
        let out = run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1 }, now);
        assert_eq!(
            out,
            vec![
                ShardAction::Start { entity_id: "a".into(), incarnation: 2 },
                ShardAction::Send { entity_id: "a".into(), msg: 2 },
                ShardAction::Send { entity_id: "a".into(), msg: 3 },
            ]
        );
    }

    #[test]
    fn passivated_entity_without_new_messages_stays_stopped() {
        let mut s = ShardCore::new(None, Duration::from_secs(1));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "a".into(), incarnation: 1 }, now);
        assert!(run(&mut s, ShardInput::Terminated { entity_id: "a".into(), incarnation: 1 }, now).is_empty());
        assert_eq!(s.entity_count(), 0);
    }

    #[test]
    fn idle_entities_are_passivated_after_the_timeout() {
        let mut s = ShardCore::new(Some(Duration::from_secs(120)), Duration::from_secs(1));
        let t0 = Instant::now();
        run(&mut s, deliver("a", 1), t0);
        run(&mut s, deliver("b", 1), t0 + Duration::from_secs(100));
        assert_eq!(
            run(&mut s, ShardInput::Tick, t0 + Duration::from_secs(121)),
            vec![ShardAction::Stop { entity_id: "a".into() }]
        );
    }

    #[test]
    fn hand_off_stops_all_entities_drops_buffers_and_forces_stragglers_at_the_deadline() {
        let mut s = ShardCore::new(None, Duration::from_secs(2));
        let now = Instant::now();
        run(&mut s, deliver("a", 1), now);
        run(&mut s, deliver("b", 1), now);
        run(&mut s, ShardInput::Passivate { entity_id: "b".into(), incarnation: 2 }, now);
        run(&mut s, deliver("b", 9), now);
        let out = run(&mut s, ShardInput::HandOff, now);
        assert!(out.contains(&ShardAction::Drop { entity_id: "b".into(), msg: 9, reason: DropReason::HandOff }));
        assert!(out.contains(&ShardAction::Stop { entity_id: "a".into() }));
        assert_eq!(
            run(&mut s, deliver("c", 1), now),
            vec![ShardAction::Drop { entity_id: "c".into(), msg: 1, reason: DropReason::HandOff }]
        );
        assert!(run(&mut s, ShardInput::Terminated { entity_id: "b".into(), incarnation: 2 }, now).is_empty());
        let out = run(&mut s, ShardInput::Tick, now + Duration::from_secs(3));
        assert_eq!(out, vec![ShardAction::ForceStop { entity_id: "a".into() }, ShardAction::Stopped]);
    }

    #[test]
    fn hand_off_of_an_empty_shard_is_done_at_once() {
        let mut s: ShardCore<u32> = ShardCore::new(None, Duration::from_secs(2));
        assert_eq!(run(&mut s, ShardInput::HandOff, Instant::now()), vec![ShardAction::Stopped]);
    }
}
