//! Anti-entropy: root digest → key-space bucket digests → per-key digests → values (or value
//! buckets). Each step answers only what differs, and every message is capped in bytes, so a
//! converged cluster exchanges one root digest per round and nothing else.

use std::collections::{BTreeMap, BTreeSet};

use super::{KEY_BUCKETS, ReplicatorAction, ReplicatorCore, ReplicatorMsg};
use crate::ddata::crdt::{BUCKETS, ReplicatedData};
use crate::ddata::stats::ReplicatorStatCells;
use crate::transport::PeerAddr;

/// Values with more elements than this move by value bucket when they differ.
pub(crate) const BUCKETED_VALUE_ELEMENTS: usize = 256;

/// Most keys a peer may ask for (or ask buckets of) in one gossip message.
const MAX_WANTED_KEYS: usize = 1024;

impl<R> ReplicatorCore<R> {
    fn key_bucket_of(&self, key: &str) -> usize {
        self.data.get(key).map_or_else(|| super::key_hash(key), |e| e.key_hash) as usize % KEY_BUCKETS
    }

    pub(super) fn on_status(&mut self, from: PeerAddr, root: u64, out: &mut Vec<ReplicatorAction<R>>) {
        if root == self.root_digest() {
            return;
        }
        ReplicatorStatCells::inc(&self.stats.digest_mismatches);
        out.push(ReplicatorAction::Send {
            to: from,
            msg: ReplicatorMsg::KeyBuckets { digests: self.key_buckets.clone() },
        });
    }

    pub(super) fn on_key_buckets(&mut self, from: PeerAddr, theirs: Vec<u64>, out: &mut Vec<ReplicatorAction<R>>) {
        if theirs.len() != KEY_BUCKETS {
            ReplicatorStatCells::inc(&self.stats.rejected);
            return;
        }
        let differing: BTreeSet<usize> = (0..KEY_BUCKETS).filter(|b| theirs[*b] != self.key_buckets[*b]).collect();
        if differing.is_empty() {
            return;
        }
        // List the keys of differing buckets, whole buckets at a time, up to the byte budget.
        let mut by_bucket: BTreeMap<usize, Vec<(String, u64)>> = BTreeMap::new();
        for (k, e) in &self.data {
            let b = e.key_hash as usize % KEY_BUCKETS;
            if differing.contains(&b) {
                by_bucket.entry(b).or_default().push((k.clone(), e.value.digest()));
            }
        }
        let mut buckets = Vec::new();
        let mut digests = Vec::new();
        let mut bytes = 0;
        for b in differing {
            let keys = by_bucket.remove(&b).unwrap_or_default();
            let size: usize = keys.iter().map(|(k, _)| k.len() + 10).sum();
            if !buckets.is_empty() && bytes + size > self.settings.max_message_bytes {
                break;
            }
            bytes += size;
            buckets.push(b as u16);
            digests.extend(keys);
        }
        out.push(ReplicatorAction::Send { to: from, msg: ReplicatorMsg::Digests { buckets, digests } });
    }

    pub(super) fn on_digests(
        &mut self,
        from: PeerAddr,
        buckets: Vec<u16>,
        digests: Vec<(String, u64)>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        let buckets: BTreeSet<usize> = buckets.into_iter().map(usize::from).filter(|b| *b < KEY_BUCKETS).collect();
        let theirs: BTreeMap<String, u64> =
            digests.into_iter().filter(|(k, _)| buckets.contains(&self.key_bucket_of(k))).collect();
        let mut entries = Vec::new();
        let mut value_buckets = Vec::new();
        let mut want = Vec::new();
        let mut bytes = 0;
        let mine: Vec<String> = self
            .data
            .iter()
            .filter(|(_, e)| buckets.contains(&(e.key_hash as usize % KEY_BUCKETS)))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &mine {
            let e = &self.data[k];
            let digest = e.value.digest();
            match theirs.get(k) {
                Some(d) if *d == digest => {}
                Some(_) if e.value.element_count() > BUCKETED_VALUE_ELEMENTS && e.value.bucket_digests().is_some() => {
                    let d = e.value.bucket_digests().expect("checked").to_vec();
                    bytes += k.len() + d.len() * 9;
                    value_buckets.push((k.clone(), d));
                }
                other => {
                    let size = k.len() + e.value.approx_bytes();
                    if entries.is_empty() || bytes + size <= self.settings.max_message_bytes {
                        bytes += size;
                        entries.push((k.clone(), e.value.clone()));
                    }
                    // Both sides changed: ask for theirs too.
                    if other.is_some() && want.len() < MAX_WANTED_KEYS {
                        want.push(k.clone());
                    }
                }
            }
        }
        for k in theirs.keys() {
            if !self.data.contains_key(k) && want.len() < MAX_WANTED_KEYS {
                want.push(k.clone());
            }
        }
        if entries.is_empty() && want.is_empty() && value_buckets.is_empty() {
            return;
        }
        ReplicatorStatCells::add(&self.stats.full_values_sent, entries.len());
        out.push(ReplicatorAction::Send {
            to: from,
            msg: ReplicatorMsg::Gossip { entries, want, want_buckets: Vec::new(), value_buckets },
        });
    }

    pub(super) fn on_gossip(
        &mut self,
        from: PeerAddr,
        entries: Vec<(String, ReplicatedData)>,
        want: Vec<String>,
        want_buckets: Vec<(String, Vec<u16>)>,
        value_buckets: Vec<(String, Vec<u64>)>,
        out: &mut Vec<ReplicatorAction<R>>,
    ) {
        for (key, value) in entries {
            if let Err(e) = self.merge_in(&key, value, out) {
                self.reject(&from, "gossiped value", &e);
            }
        }
        // What the peer asked for: deduplicated, capped in keys and bytes.
        let mut back: Vec<(String, ReplicatedData)> = Vec::new();
        let mut bytes = 0;
        let mut room = |size: usize, back: &Vec<(String, ReplicatedData)>| {
            let fits = back.is_empty() || bytes + size <= self.settings.max_message_bytes;
            if fits {
                bytes += size;
            }
            fits
        };
        let wanted: BTreeSet<String> = want.into_iter().take(MAX_WANTED_KEYS).collect();
        if wanted.len() >= MAX_WANTED_KEYS {
            ReplicatorStatCells::inc(&self.stats.rejected);
        }
        for k in wanted {
            if let Some(e) = self.data.get(&k)
                && room(k.len() + e.value.approx_bytes(), &back)
            {
                back.push((k, e.value.clone()));
            }
        }
        let mut seen_bucket_keys = BTreeSet::new();
        for (k, bs) in want_buckets.into_iter().take(MAX_WANTED_KEYS) {
            let bs: Vec<usize> = bs.into_iter().map(usize::from).filter(|b| *b < BUCKETS).collect();
            if !seen_bucket_keys.insert(k.clone()) {
                continue;
            }
            if let Some(e) = self.data.get(&k) {
                let part = e.value.buckets_subset(&bs);
                if room(k.len() + part.approx_bytes(), &back) {
                    back.push((k, part));
                }
            }
        }
        // Large values that differ: send our differing buckets, ask for theirs.
        let mut want_back = Vec::new();
        for (k, theirs) in value_buckets.into_iter().take(MAX_WANTED_KEYS) {
            let Some(e) = self.data.get(&k) else { continue };
            let Some(mine) = e.value.bucket_digests() else { continue };
            if theirs.len() != BUCKETS {
                ReplicatorStatCells::inc(&self.stats.rejected);
                continue;
            }
            let differing: Vec<usize> = (0..BUCKETS).filter(|b| mine[*b] != theirs[*b]).collect();
            if differing.is_empty() {
                continue;
            }
            let part = e.value.buckets_subset(&differing);
            if room(k.len() + part.approx_bytes(), &back) {
                back.push((k.clone(), part));
            }
            want_back.push((k, differing.into_iter().map(|b| b as u16).collect()));
        }
        if back.is_empty() && want_back.is_empty() {
            return;
        }
        ReplicatorStatCells::add(&self.stats.full_values_sent, back.len());
        out.push(ReplicatorAction::Send {
            to: from,
            msg: ReplicatorMsg::Gossip {
                entries: back,
                want: Vec::new(),
                want_buckets: want_back,
                value_buckets: Vec::new(),
            },
        });
    }
}
