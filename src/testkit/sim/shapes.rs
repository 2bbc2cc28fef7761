//! The named shapes the simulation runs in.

use super::SimConfig;

/// The shapes the simulation is run in, by name: the unit of CI's seed runs, of the soak and of
/// `DDSHARD_SIM_SHAPE=<name>` in the replay test. Faults are random in each (crashes,
/// restarts, graceful leaves, partitions; with durable state, pauses; with the message path,
/// one-way and messaging-only cuts and down-all-when-unstable).
pub fn shapes() -> Vec<(&'static str, SimConfig)> {
    let base = SimConfig { trace: false, ..SimConfig::default() };
    let seven_lossy = SimConfig {
        nodes: 7,
        shards: 24,
        entities: 80,
        durable: true,
        remember: true,
        drop_per_mille: 20,
        ..base.clone()
    };
    vec![
        ("default", base.clone()),
        ("remember", SimConfig { remember: true, ..base.clone() }),
        ("durable", SimConfig { durable: true, ..base.clone() }),
        ("durable-remember", SimConfig { durable: true, remember: true, ..base.clone() }),
        ("message-path", SimConfig { message_path: true, ..base.clone() }),
        (
            "message-path-durable-remember",
            SimConfig { message_path: true, durable: true, remember: true, ..base.clone() },
        ),
        ("three-nodes-many-shards", SimConfig { nodes: 3, shards: 40, entities: 120, remember: true, ..base }),
        ("seven-nodes-lossy", seven_lossy.clone()),
        ("seven-nodes-message-path-lossy", SimConfig { message_path: true, ..seven_lossy.clone() }),
        ("reliable", SimConfig { reliable: true, ..base.clone() }),
        ("reliable-durable", SimConfig { reliable: true, durable: true, durable_queue: true, ..base.clone() }),
        (
            "reliable-durable-tight",
            SimConfig { reliable: true, durable: true, durable_queue: true, tight_producers: true, ..base.clone() },
        ),
        (
            "reliable-seven-nodes-message-path-lossy",
            SimConfig { reliable: true, durable_queue: true, message_path: true, ..seven_lossy },
        ),
        // Appended: each shape keeps its seed range (the soak gives shape `i` its own).
        ("reliable-deferred", SimConfig { reliable: true, deferred_confirms: true, ..base.clone() }),
        (
            "reliable-durable-deferred",
            SimConfig { reliable: true, durable: true, durable_queue: true, deferred_confirms: true, ..base },
        ),
    ]
}

/// The shape named `name` in [`shapes`] (with its trace on, for a replay).
pub fn shape(name: &str) -> Option<SimConfig> {
    shapes().into_iter().find(|(n, _)| *n == name).map(|(_, cfg)| SimConfig { trace: true, ..cfg })
}
