//! One copy of every rule: the simulation (`src/testkit/sim`) runs the production cores and
//! performs their actions as the drivers do; it moves bytes, time and faults and builds no
//! protocol decision of its own. A decision the simulation copied instead of calling would
//! drift from the shipped one, and the thousands of seeds CI runs would check the copy.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The code of a file without its comment lines.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The names of the `const` items a file defines.
fn const_names(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub(super) "))
                .or_else(|| l.strip_prefix("pub "))
                .unwrap_or(l);
            let name = l.strip_prefix("const ")?.split(':').next()?.trim();
            Some(name.to_string())
        })
        .collect()
}

#[test]
fn the_simulation_defines_no_constant_that_production_code_also_defines() {
    let sim_dir = src().join("testkit").join("sim");
    let production: Vec<(PathBuf, String)> = rust_files(&src())
        .into_iter()
        .filter(|p| !p.starts_with(src().join("testkit")))
        .flat_map(|p| {
            let names = const_names(&code(&p));
            names.into_iter().map(move |n| (p.clone(), n))
        })
        .collect();
    assert!(production.len() > 50, "the scan finds production constants: {}", production.len());
    let mut copies = Vec::new();
    for file in rust_files(&sim_dir) {
        for name in const_names(&code(&file)) {
            for (p, n) in &production {
                if *n == name {
                    copies.push(format!("{name} in {} and {}", file.display(), p.display()));
                }
            }
        }
    }
    assert!(copies.is_empty(), "the simulation must import these, not define them again: {copies:#?}");
}

#[test]
fn the_simulation_builds_no_core_settings_quorum_or_replicated_update_of_its_own() {
    // Each is built by one production function the simulation calls instead:
    // CoordinatorSettings::from_sharding, the take-over and state-write cores, the batch cores
    // and their quorum functions, new_shard_core, claim_updates.
    let forbidden = [
        "CoordinatorSettings {",
        "Consistency::Majority",
        "Consistency::AllReachable",
        "Consistency::MAJORITY",
        "KeyUpdate::new",
        "ShardCore::new(",
        "ShardCore::remembering(",
        "ShardCore::loading(",
        "WRITE_TRIES",
        "CLAIM_TRIES",
        "WRITE_BACKOFF",
        "updating_state_timeout /",
    ];
    let sim_files = rust_files(&src().join("testkit").join("sim"));
    assert!(sim_files.len() >= 5, "the scan finds the simulation: {sim_files:?}");
    let mut found = Vec::new();
    for file in sim_files {
        let code = code(&file);
        for pattern in forbidden {
            if code.contains(pattern) {
                found.push(format!("{pattern} in {}", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "the simulation copies a production decision: {found:#?}");
}
