//! Activation log and checker: the evidence for the sharding promise.
//!
//! Test entities (and the sample `kv` type of `ddshard node --activation-log`) record every
//! activation: entity id, node, epoch, start and stop. [`check_activations`] then asserts that
//! no two activations of one id overlapped in time and that epochs never went back (and grew
//! whenever the entity moved to another node).
//!
//! Times are wall-clock ([`SystemTime`]) so that logs written by several processes on one
//! machine can be merged and compared. A log can also be written to a file, one line per event
//! (tab-separated, appended and flushed per line, so a SIGKILL loses nothing already recorded):
//!
//! ```text
//! open  <unix µs>
//! start <n> <epoch> <unix µs> <node> <entity id>
//! stop  <n> <unix µs>
//! ```
//!
//! where `<n>` numbers the activations since the last `open` (written each time a process opens
//! the file, so a restarted node may append to the same one). Activations left without a stop
//! when the file is opened again belonged to a process that died (SIGKILL): the loader gives them
//! that `open` time as their stop, an upper bound that can only report too much overlap, never
//! hide one. A line torn by a kill mid-write is ignored (the next `open` marks it). Tabs, CRs, newlines and backslashes in
//! ids and node names are escaped as `\t`, `\r`, `\n`, `\\`.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// One activation of an entity: where, with which epoch, and when it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activation {
    /// Entity id.
    pub entity_id: String,
    /// Node that ran it.
    pub node: String,
    /// Epoch (fencing token) it ran with.
    pub epoch: u64,
    /// When the instance started.
    pub start: SystemTime,
    /// When it was dropped (`None`: still running, or its process died without a word).
    pub stop: Option<SystemTime>,
}

#[derive(Debug, Default)]
struct LogInner {
    activations: Vec<Activation>,
    file: Option<std::fs::File>,
}

/// Records entity activations (start and stop), in memory and optionally in a file.
#[derive(Debug, Clone, Default)]
pub struct ActivationLog {
    inner: Arc<Mutex<LogInner>>,
}

/// Held by an entity for its lifetime; records the stop when dropped (also on abort).
#[derive(Debug)]
pub struct ActivationGuard {
    log: ActivationLog,
    index: usize,
}

impl Drop for ActivationGuard {
    fn drop(&mut self) {
        let now = crate::clock::wall_time();
        // A poisoned lock still records the stop: a missing one would read as an overlap.
        let mut l = self.log.inner.lock().unwrap_or_else(|p| p.into_inner());
        // Stopped already if its node died (`node_died`): the instance outlived its process only
        // as memory nobody can run.
        if l.activations[self.index].stop.is_none() {
            l.activations[self.index].stop = Some(now);
            let line = format!("stop\t{}\t{}\n", self.index, micros(now));
            write_line(&mut l, &line);
        }
    }
}

fn micros(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros()
}

fn write_line(l: &mut LogInner, line: &str) {
    if let Some(f) = l.file.as_mut()
        && let Err(e) = f.write_all(line.as_bytes())
    {
        tracing::error!(error = %e, "activation log write failed; the log is incomplete from here on");
        l.file = None;
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\t', "\\t").replace('\n', "\\n").replace('\r', "\\r")
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

impl ActivationLog {
    /// A new, empty, in-memory log.
    pub fn new() -> Self {
        Self::default()
    }

    /// A log that also appends every event to `path` (created if missing).
    pub fn with_file(path: &Path) -> Result<Self> {
        let io = |e| Error::io(format!("opening activation log {}", path.display()), e);
        let mut file = std::fs::OpenOptions::new().create(true).read(true).append(true).open(path).map_err(io)?;
        // Mark and end a line torn by a process killed mid-write (even a torn line may parse,
        // say a truncated time), so the loader skips it and new records start clean.
        let torn = {
            use std::io::{Read, Seek, SeekFrom};
            let len = file.seek(SeekFrom::End(0)).map_err(io)?;
            let mut last = [0u8; 1];
            len > 0 && {
                file.seek(SeekFrom::End(-1)).map_err(io)?;
                file.read_exact(&mut last).map_err(io)?;
                last[0] != b'\n'
            }
        };
        let open = format!("{}open\t{}\n", if torn { TORN_MARK } else { "" }, micros(crate::clock::wall_time()));
        file.write_all(open.as_bytes()).map_err(io)?;
        Ok(ActivationLog { inner: Arc::new(Mutex::new(LogInner { activations: Vec::new(), file: Some(file) })) })
    }

    /// Records a start; keep the guard in the entity for as long as it lives.
    pub fn started(&self, entity_id: &str, node: &str, epoch: u64) -> ActivationGuard {
        let now = crate::clock::wall_time();
        let mut l = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        l.activations.push(Activation {
            entity_id: entity_id.to_string(),
            node: node.to_string(),
            epoch,
            start: now,
            stop: None,
        });
        let index = l.activations.len() - 1;
        let line = format!("start\t{index}\t{epoch}\t{}\t{}\t{}\n", micros(now), escape(node), escape(entity_id));
        write_line(&mut l, &line);
        ActivationGuard { log: self.clone(), index }
    }

    /// Records that `node`'s process died now: every activation on it still live stops here, as
    /// it would with its process (an in-process simulation of a crash may leave the instances
    /// in memory, where nothing runs them).
    pub fn node_died(&self, node: &str) {
        let now = crate::clock::wall_time();
        let mut l = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let live: Vec<usize> = (0..l.activations.len())
            .filter(|i| l.activations[*i].node == node && l.activations[*i].stop.is_none())
            .collect();
        for index in live {
            l.activations[index].stop = Some(now);
            let line = format!("stop\t{index}\t{}\n", micros(now));
            write_line(&mut l, &line);
        }
    }

    /// Every activation so far.
    pub fn activations(&self) -> Vec<Activation> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).activations.clone()
    }

    /// Checks this log (see [`check_activations`]).
    pub fn check(&self) -> std::result::Result<(), Vec<String>> {
        check_activations(&self.activations())
    }

    /// Reads the activations of log files written by [`ActivationLog::with_file`] (by any
    /// number of processes) into one list.
    pub fn load(paths: &[PathBuf]) -> Result<Vec<Activation>> {
        let mut all = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::io(format!("reading activation log {}", path.display()), e))?;
            load_one(path, &text, &mut all)?;
        }
        Ok(all)
    }
}

/// Appended to a torn line when the file is opened again (a tab cannot occur unescaped in a
/// record's fields).
const TORN_MARK: &str = "\t#torn\n";

fn load_one(path: &Path, text: &str, all: &mut Vec<Activation>) -> Result<()> {
    let bad = |n: usize, line: &str| Error::ActivationLog {
        path: path.to_path_buf(),
        line: n + 1,
        reason: format!("not an activation record: {line:?}"),
    };
    let at = |s: &str| s.parse::<u64>().ok().map(|us| UNIX_EPOCH + Duration::from_micros(us));
    let lines: Vec<&str> = text.split('\n').collect();
    // Index (since the last `open`) → position in `all`.
    let mut open: HashMap<usize, usize> = HashMap::new();
    for (n, line) in lines.iter().enumerate() {
        // The piece after the last newline is empty, or a line torn by a kill: never trusted.
        if n + 1 == lines.len() {
            break;
        }
        if line.ends_with(TORN_MARK.trim_end_matches('\n')) {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        match f.as_slice() {
            ["open", time] => {
                let Some(opened) = at(time) else { return Err(bad(n, line)) };
                // Activations still open belonged to a process that died: they ended no later
                // than this (conservative for the checker).
                for (_, slot) in open.drain() {
                    let a: &mut Activation = &mut all[slot];
                    a.stop.get_or_insert(opened.max(a.start));
                }
            }
            ["start", index, epoch, time, node, id] => {
                let (Ok(index), Ok(epoch), Some(start)) = (index.parse(), epoch.parse(), at(time)) else {
                    return Err(bad(n, line));
                };
                open.insert(index, all.len());
                all.push(Activation { entity_id: unescape(id), node: unescape(node), epoch, start, stop: None });
            }
            ["stop", index, time] => {
                let (Ok(index), Some(stop)) = (index.parse::<usize>(), at(time)) else {
                    return Err(bad(n, line));
                };
                let slot = open.remove(&index).ok_or_else(|| bad(n, line))?;
                all[slot].stop = Some(stop);
            }
            _ => return Err(bad(n, line)),
        }
    }
    Ok(())
}

/// Checks the sharding promise over a set of activations: no two activations of one id overlap
/// in time, and epochs never decrease (and grow whenever the entity moved to another node).
/// Returns every violation found.
pub fn check_activations(activations: &[Activation]) -> std::result::Result<(), Vec<String>> {
    let mut by_id: HashMap<&str, Vec<&Activation>> = HashMap::new();
    for a in activations {
        by_id.entry(&a.entity_id).or_default().push(a);
    }
    let mut violations = Vec::new();
    for (id, mut acts) in by_id {
        acts.sort_by_key(|a| a.start);
        // Compare with the earlier activation that stops last, not only the previous one: a
        // long-lived stale activation may span several later ones.
        let mut stops_last: Option<&Activation> = None;
        for (i, b) in acts.iter().enumerate() {
            if let Some(a) = stops_last
                && a.stop.is_none_or(|stop| stop > b.start)
            {
                violations.push(format!(
                    "{id}: activation on {} (epoch {}) still live when {} (epoch {}) started",
                    a.node, a.epoch, b.node, b.epoch
                ));
            }
            if i > 0 {
                let a = acts[i - 1];
                if b.epoch < a.epoch || (b.node != a.node && b.epoch == a.epoch) {
                    violations
                        .push(format!("{id}: epoch went from {} on {} to {} on {}", a.epoch, a.node, b.epoch, b.node));
                }
            }
            stops_last = match stops_last {
                Some(a) if a.stop.is_none() || b.stop.is_some_and(|s| Some(s) <= a.stop) => Some(a),
                _ => Some(*b),
            };
        }
    }
    if violations.is_empty() { Ok(()) } else { Err(violations) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(id: &str, node: &str, epoch: u64, start: u64, stop: Option<u64>) -> Activation {
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(1_000_000 + s);
        Activation { entity_id: id.into(), node: node.into(), epoch, start: t(start), stop: stop.map(t) }
    }

    #[test]
    fn a_dead_node_stops_its_live_activations_once_and_a_later_drop_keeps_that_stop() {
        let log = ActivationLog::new();
        let on_n1 = log.started("a", "n1", 1);
        let on_n2 = log.started("b", "n2", 1);
        log.node_died("n1");
        let died = log.activations()[0].stop.expect("stopped when its node died");
        assert_eq!(log.activations()[1].stop, None, "another node's activation runs on");
        std::thread::sleep(Duration::from_millis(2));
        drop(on_n1);
        assert_eq!(log.activations()[0].stop, Some(died), "the drop of leftover memory changes nothing");
        drop(on_n2);
        assert!(log.activations()[1].stop.is_some());
    }

    #[test]
    fn sequential_activations_with_growing_epochs_pass() {
        let acts = [act("a", "n1", 1, 0, Some(5)), act("a", "n2", 2, 5, Some(9)), act("a", "n2", 2, 10, None)];
        assert_eq!(check_activations(&acts), Ok(()));
    }

    #[test]
    fn overlap_is_found_even_when_a_stale_activation_spans_several_later_ones() {
        let acts = [act("a", "n1", 1, 0, Some(20)), act("a", "n2", 2, 5, Some(6)), act("a", "n3", 3, 10, Some(12))];
        let v = check_activations(&acts).unwrap_err();
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v.iter().all(|m| m.contains("on n1 (epoch 1) still live")), "{v:?}");
    }

    #[test]
    fn an_activation_that_never_stopped_overlaps_every_later_one() {
        let v = check_activations(&[act("a", "n1", 1, 0, None), act("a", "n2", 2, 3, Some(4))]).unwrap_err();
        assert_eq!(v.len(), 1);
    }

    #[test]
    fn epoch_that_goes_back_or_stays_across_nodes_is_a_violation() {
        let v = check_activations(&[act("a", "n1", 5, 0, Some(1)), act("a", "n2", 4, 2, Some(3))]).unwrap_err();
        assert!(v[0].contains("epoch went from 5"));
        let v = check_activations(&[act("a", "n1", 5, 0, Some(1)), act("a", "n2", 5, 2, Some(3))]).unwrap_err();
        assert!(v[0].contains("epoch went from 5"));
    }

    #[test]
    fn file_logs_of_several_writers_load_back_with_escaped_ids() {
        let dir = tempfile::tempdir().unwrap();
        let (p1, p2) = (dir.path().join("n1.log"), dir.path().join("n2.log"));
        let l1 = ActivationLog::with_file(&p1).unwrap();
        let l2 = ActivationLog::with_file(&p2).unwrap();
        let g = l1.started("odd\tid\nwith\\escapes\r", "n1", 3);
        drop(g);
        let _still_running = l2.started("b", "n2", 7);
        let mut loaded = ActivationLog::load(&[p1.clone(), p2]).unwrap();
        loaded.sort_by(|a, b| a.node.cmp(&b.node));
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded[0].entity_id, "odd\tid\nwith\\escapes\r");
        assert_eq!(loaded[0].epoch, 3);
        assert!(loaded[0].stop.is_some_and(|s| s >= loaded[0].start));
        assert_eq!((loaded[1].entity_id.as_str(), loaded[1].stop), ("b", None));
        // Garbage in the middle of a file is an error.
        std::fs::write(&p1, "nonsense\nstart\t0\t1\t5\tn1\ta\n").unwrap();
        assert!(matches!(ActivationLog::load(&[p1]), Err(Error::ActivationLog { line: 1, .. })));
    }

    #[test]
    fn a_process_killed_mid_write_and_restarted_on_the_same_file_loads_conservatively() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("n1.log");
        let first = ActivationLog::with_file(&p).unwrap();
        let a = first.started("a", "n1", 1);
        let b = first.started("b", "n1", 1);
        drop(b);
        std::mem::forget(a); // SIGKILL: "a" never logs its stop
        drop(first);
        // Torn mid-record: a truncated stop time that would still parse must not be trusted.
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"stop\t0\t12").unwrap();
        drop(f);
        let second = ActivationLog::with_file(&p).unwrap();
        let reopened = SystemTime::now();
        let _c = second.started("a", "n1", 2);
        let loaded = ActivationLog::load(std::slice::from_ref(&p)).unwrap();
        assert_eq!(loaded.len(), 3, "{loaded:?}");
        let killed = loaded.iter().find(|x| x.entity_id == "a" && x.epoch == 1).unwrap();
        let stop = killed.stop.expect("ends at the reopening");
        assert!(stop <= reopened && stop >= killed.start);
        assert_eq!(check_activations(&loaded), Ok(()));
        // A torn line at the very end is ignored too.
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"start\t9\t").unwrap();
        assert_eq!(ActivationLog::load(std::slice::from_ref(&p)).unwrap().len(), 3);
    }
}
