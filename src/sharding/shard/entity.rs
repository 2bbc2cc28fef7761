//! The entity runner: one task per running entity. It creates the entity, runs its start
//! hook, handles its mailbox one message at a time and isolates panics (a panicking handler
//! stops only that incarnation; the messages still queued go to the next one).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;
use tokio::sync::mpsc;
use tracing::error;

use super::ShardEvent;
use crate::error::Result;
use crate::sharding::envelope::{Envelope, Replier, ReplyTo, not_delivered};
use crate::sharding::handle::RegionCounters;
use crate::sharding::{EndIncarnation, Entity, EntityContext};

/// Creates the entity of an id.
pub(crate) type Factory<E> = Arc<dyn Fn(&str) -> E + Send + Sync>;

/// What the region sends an entity task.
pub(crate) enum EntityCmd<E: Entity> {
    Msg(Envelope<E>),
    Stop,
}

/// Runs one entity: creates it, handles its mailbox one message at a time, isolates panics.
pub(crate) struct EntityRunner<E: Entity> {
    pub ctx: EntityContext,
    pub incarnation: u64,
    pub events: mpsc::UnboundedSender<ShardEvent<E>>,
    pub replier: Replier,
    pub type_name: Arc<str>,
    pub counters: Arc<RegionCounters>,
    /// Messages sent to this incarnation and not yet taken (the host bounds it).
    pub queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl<E: Entity> EntityRunner<E> {
    fn respond(&self, reply: Option<ReplyTo<E>>, result: Result<Option<E::Reply>>) {
        if let Some(r) = reply {
            self.replier.reply::<E>(r, &self.ctx.entity_id, result);
        }
    }

    fn terminated(&self, leftovers: Vec<Envelope<E>>) {
        let _ = self.events.send(ShardEvent::Terminated {
            shard: self.ctx.shard_id.clone(),
            entity_id: self.ctx.entity_id.clone(),
            incarnation: self.incarnation,
            leftovers,
        });
    }

    /// Fails every queued message with `reason` and reports the incarnation ended.
    fn fail_queued_and_end(&self, inbox: &mut mpsc::UnboundedReceiver<EntityCmd<E>>, reason: &str) {
        inbox.close();
        while let Ok(cmd) = inbox.try_recv() {
            if let EntityCmd::Msg(env) = cmd {
                self.respond(env.reply, Err(not_delivered(&self.ctx.entity_id, reason)));
            }
        }
        self.terminated(Vec::new());
    }

    pub(crate) async fn run(mut self, factory: Factory<E>, mut inbox: mpsc::UnboundedReceiver<EntityCmd<E>>) {
        let id = self.ctx.entity_id.clone();
        let mut entity = match std::panic::catch_unwind(AssertUnwindSafe(|| factory(&id))) {
            Ok(e) => e,
            Err(_) => {
                self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                error!(type_name = %self.type_name, entity_id = %id, "entity factory panicked; failing its messages");
                self.fail_queued_and_end(&mut inbox, "entity factory panicked");
                return;
            }
        };
        if let Err(panic) = AssertUnwindSafe(entity.started(&self.ctx)).catch_unwind().await {
            self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
            let what = panic_text(&*panic);
            error!(type_name = %self.type_name, entity_id = %id, panic = %what, "entity start hook panicked; entity stopped");
            drop(entity);
            // Its queued messages fail (as after a panicking factory): handing them to a fresh
            // instance would spin if the hook always panics, since no message gets consumed.
            self.fail_queued_and_end(&mut inbox, &format!("entity start hook panicked: {what}"));
            return;
        }
        while let Some(cmd) = inbox.recv().await {
            let env = match cmd {
                EntityCmd::Stop => break,
                EntityCmd::Msg(env) => env,
            };
            self.queued.fetch_sub(1, Ordering::Relaxed);
            let Some(msg) = env.msg else {
                self.respond(env.reply, Ok(None));
                continue;
            };
            let outcome = AssertUnwindSafe(entity.handle_or_fail(msg, &mut self.ctx)).catch_unwind().await;
            match outcome {
                Ok(result) => self.respond(env.reply, result.map(Some)),
                Err(panic) => {
                    self.counters.entity_panics.fetch_add(1, Ordering::Relaxed);
                    let what = panic_text(&*panic);
                    drop(entity);
                    error!(type_name = %self.type_name, entity_id = %id, panic = %what, "entity handler panicked; entity stopped");
                    self.respond(env.reply, Err(not_delivered(&id, format!("entity handler panicked: {what}"))));
                    // Messages still queued go to a fresh instance.
                    inbox.close();
                    let mut leftovers = Vec::new();
                    while let Ok(cmd) = inbox.try_recv() {
                        if let EntityCmd::Msg(env) = cmd {
                            leftovers.push(env);
                        }
                    }
                    self.terminated(leftovers);
                    return;
                }
            }
            match self.ctx.end.take() {
                None => {}
                Some(EndIncarnation::Restart) => {
                    // A durable entity whose state write failed: the next incarnation starts
                    // from the stored state and takes the messages queued for this one.
                    drop(entity);
                    inbox.close();
                    let mut leftovers = Vec::new();
                    while let Ok(cmd) = inbox.try_recv() {
                        if let EntityCmd::Msg(env) = cmd {
                            leftovers.push(env);
                        }
                    }
                    self.terminated(leftovers);
                    return;
                }
                Some(EndIncarnation::Fenced { fence }) => {
                    // A newer allocation owns the shard's state: nothing here may run it.
                    drop(entity);
                    let _ = self.events.send(ShardEvent::Fenced {
                        shard: self.ctx.shard_id.clone(),
                        epoch: self.ctx.epoch,
                        fence,
                    });
                    self.fail_queued_and_end(&mut inbox, "a newer allocation of its shard claimed its state");
                    return;
                }
            }
            if std::mem::take(&mut self.ctx.passivate) {
                let _ = self.events.send(ShardEvent::Passivate {
                    shard: self.ctx.shard_id.clone(),
                    entity_id: id.clone(),
                    incarnation: self.incarnation,
                });
            }
        }
        // Gone before anyone hears it terminated: the next incarnation may start elsewhere.
        drop(entity);
        self.terminated(Vec::new());
    }
}

/// The message of a caught panic, if it carried one.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}
