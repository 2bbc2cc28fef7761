//! The durable queue's stored form: one fenced-map entry per unconfirmed message, keyed by a
//! *place*, and the rule that rebuilds the streams from the entries a restarted producer loads.
//!
//! **Keys.** A message takes the lowest free place when it is stored and frees it once it is
//! confirmed (or given up) and its entry deleted, so the keys a queue ever used number no more
//! than the most messages it held unconfirmed at once — not entities × window, whose tombstones
//! would fill the slots of a producer that sends to many entities. A place is taken again only
//! once its deletion ended: a store write that is not acknowledged is tried again, and a retry
//! of the deletion after a new message's write would delete that message (found by the
//! simulation, seed 500000007 of `reliable-durable`).
//!
//! **Restore.** Each entry names its entity, stream, number and when its stream was made (the
//! claiming epoch and a count). Per entity, the newest stream's entries are what the producer
//! had not had confirmed (or confirmed without its deletion written yet: sent again, its entity
//! confirms it as a duplicate or, a plain entity's new incarnation, handles it again); entries
//! of older streams are stale and deleted.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// One unconfirmed message as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct QueueEntry {
    pub entity: String,
    pub stream: u64,
    /// When its stream was made: the producer's epoch then, and its count of streams made.
    pub made: (u64, u64),
    pub seq: u64,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// The key of place `place`.
pub(crate) fn entry_key(place: u32) -> String {
    place.to_string()
}

/// The place of an entry key.
pub(crate) fn place_of(key: &str) -> Option<u32> {
    key.parse().ok().filter(|p: &u32| entry_key(*p) == key)
}

/// A stream rebuilt from its stored entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RestoredStream {
    pub entity: String,
    pub stream: u64,
    pub made: (u64, u64),
    /// Its messages by number, oldest first, each with its place.
    pub messages: Vec<(u64, Bytes, u32)>,
}

/// What a load found: the streams to resume, the keys of stale entries to delete, and the
/// entries that did not decode (counted, deleted).
#[derive(Debug, Default)]
pub(crate) struct Restored {
    pub streams: Vec<RestoredStream>,
    pub stale: Vec<String>,
    pub undecodable: usize,
}

/// Rebuilds the streams from loaded `(key, value)` entries (see the module doc).
pub(crate) fn restore(entries: Vec<(String, Vec<u8>)>) -> Restored {
    let mut restored = Restored::default();
    // Per entity, per stream: when it was made and its messages.
    let mut found: BTreeMap<String, BTreeMap<u64, ((u64, u64), Vec<(u64, Bytes, u32)>)>> = BTreeMap::new();
    for (key, value) in entries {
        let decoded = place_of(&key).zip(crate::transport::wire::decode::<QueueEntry>(&value).ok());
        let Some((place, e)) = decoded else {
            restored.undecodable += 1;
            restored.stale.push(key);
            continue;
        };
        let stream = found.entry(e.entity).or_default().entry(e.stream).or_insert_with(|| (e.made, Vec::new()));
        stream.1.push((e.seq, Bytes::from(e.bytes), place));
    }
    for (entity, streams) in found {
        let mut streams: Vec<_> = streams.into_iter().collect();
        streams.sort_by_key(|(_, (made, _))| *made);
        let Some((stream, (made, mut messages))) = streams.pop() else { continue };
        let stale = streams.into_iter().flat_map(|(_, (_, m))| m.into_iter().map(|(.., place)| entry_key(place)));
        restored.stale.extend(stale);
        messages.sort_by_key(|(seq, ..)| *seq);
        restored.streams.push(RestoredStream { entity, stream, made, messages });
    }
    restored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::wire;

    fn entry(place: u32, entity: &str, stream: u64, made: (u64, u64), seq: u64) -> (String, Vec<u8>) {
        let e = QueueEntry { entity: entity.into(), stream, made, seq, bytes: seq.to_be_bytes().to_vec() };
        (entry_key(place), wire::encode(&e).unwrap().to_vec())
    }

    fn numbers(s: &RestoredStream) -> Vec<u64> {
        s.messages.iter().map(|(seq, ..)| *seq).collect()
    }

    #[test]
    fn a_place_is_its_number_and_only_that_spelling_is_one() {
        assert_eq!(entry_key(7), "7");
        assert_eq!(place_of("12"), Some(12));
        assert_eq!((place_of("012"), place_of("1.2"), place_of("x")), (None, None, None));
    }

    #[test]
    fn a_load_resumes_each_entitys_newest_stream_in_order_and_deletes_what_older_streams_left() {
        let r = restore(vec![
            entry(0, "a", 10, (1, 1), 6),
            entry(4, "a", 10, (1, 1), 5),
            // b's stream 11, then (after eviction) its stream 12; one deletion of 11 was never
            // written.
            entry(1, "b", 11, (1, 2), 3),
            entry(2, "b", 12, (2, 1), 1),
        ]);
        assert_eq!(r.streams.len(), 2, "{:?}", r.streams);
        let a = &r.streams[0];
        assert_eq!((a.entity.as_str(), a.stream, numbers(a)), ("a", 10, vec![5, 6]));
        assert_eq!(a.messages.iter().map(|(.., p)| *p).collect::<Vec<_>>(), vec![4, 0], "each keeps its place");
        assert_eq!((r.streams[1].entity.as_str(), r.streams[1].stream, numbers(&r.streams[1])), ("b", 12, vec![1]));
        assert_eq!(r.stale, vec!["1".to_string()]);
        assert_eq!(r.undecodable, 0);
    }

    #[test]
    fn of_two_streams_of_one_entity_the_newer_is_resumed_whichever_comes_first() {
        let cases = [
            (vec![entry(0, "a", 10, (1, 1), 2), entry(3, "a", 14, (2, 5), 1)], "0"),
            (vec![entry(0, "a", 14, (2, 5), 1), entry(3, "a", 10, (1, 1), 2)], "3"),
        ];
        for (entries, stale) in cases {
            let r = restore(entries);
            assert_eq!(r.streams.iter().map(|s| s.stream).collect::<Vec<_>>(), vec![14]);
            assert_eq!(r.stale, vec![stale.to_string()]);
        }
    }

    #[test]
    fn an_entry_that_does_not_decode_or_has_no_place_for_a_key_is_counted_and_deleted() {
        let (_, good) = entry(0, "a", 10, (1, 1), 2);
        let r = restore(vec![("1".into(), vec![0xc1]), ("0.3".into(), good), ("bad".into(), vec![])]);
        assert!(r.streams.is_empty());
        assert_eq!(r.undecodable, 3);
        assert_eq!(r.stale.len(), 3);
    }
}
