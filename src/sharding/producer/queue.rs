//! The durable queue's stored form: one fenced-map entry per unconfirmed message, keyed by its
//! stream's *lane* and its place in the lane, and the rule that rebuilds the streams from the
//! entries a restarted producer loads.
//!
//! **Keys.** A stream is given a lane when it starts (lanes are reused once their stream has
//! gone idle and been evicted); a message lives at `"{lane}.{place}"`, its place being the
//! lowest one of the lane no unconfirmed message of the stream holds. A stream holds fewer
//! unconfirmed messages than its lane has places (`modulus`, the stream's window when it
//! started; the producer waits for room), so a new message always finds one, and no key per
//! entity or per message accumulates: a confirmed message's tombstone is overwritten by the
//! next message at its place. A lane keeps as many keys, tombstones included, as its streams
//! ever held unconfirmed messages at once — one or two for an entity sent one message at a
//! time, where `seq % modulus` (the layout before) wore a window's worth into every lane, and
//! every write and merge of its slot paid for them. Stores written with that layout load the
//! same way.
//!
//! **Each number is written by one incarnation, at one place.** Only the incarnation that
//! made a stream gives it numbers (a resumed stream takes none, below), and it writes each at
//! the place it chose, again until acknowledged. So no number can be stored twice: a later
//! incarnation's message at another place beside an earlier one's unacknowledged write of the
//! same number (seed 1210000435 of `reliable-durable-tight`, when resumed streams still took
//! new numbers).
//!
//! **Deletion.** A confirmed (or given up) message's entry lingers: the stream's next message
//! takes the lowest free place, usually that one, and its write replaces the entry — one write
//! per message instead of two. An entry no message replaced within a second
//! (`CONFIRMED_ENTRY_LINGER`) is deleted then, busy stream or idle, and so is every entry of a
//! stream evicted, resumed from a load, or whose producer stops; a deletion that fails is tried
//! again. A deletion is written only at a place no unconfirmed message holds, so none is on its
//! way there (a message taking the place later writes after it: the store's writer keeps the
//! order). Each entry also carries its stream's oldest unconfirmed number when it was written,
//! so the entries written after a confirmation say which older ones are confirmed even where a
//! deletion was not written; a confirmed entry a crash left with no later one is sent again
//! and its entity confirms it as a duplicate (a plain entity's new incarnation handles it
//! again).
//!
//! **A stream is let go only once its entries are deleted.** An evicted stream's lane, and its
//! entity's next stream, wait until a majority acknowledged the deletion of every entry it
//! may have left. So when a stream is made in a lane or for an entity, no entry of the one
//! before can come back (a deletion outranks every earlier write of its key), and two streams
//! of one lane or one entity meet in a load only when the newer was written by an incarnation
//! whose load could not see the older's entries: the older's entries were then never
//! acknowledged (an acknowledged entry is in every later load), so its messages were never
//! sent, and dropping or sending them late harms nothing. Without the rule, an older stream's
//! confirmed entries, still stored while its successor's were gone, were resumed as current:
//! sent again, a durable entity that had moved on to the newer stream took them as new.
//!
//! **Restore.** Each entry names its entity, stream, number and when its stream was made (the
//! claiming epoch and a count). Per lane, then per entity, the stream made last is resumed:
//! its entries from the highest oldest-unconfirmed number they carry are what the producer
//! had not had confirmed (or confirmed without that being written: sent again, its entity
//! confirms it as a duplicate or, a plain entity's new incarnation, handles it again); the
//! entries below that number are confirmed ones it deletes before it is let go; entries of
//! other streams are stale and deleted.
//!
//! **A resumed stream takes no new message.** A load cannot see the numbers an earlier
//! incarnation had confirmed and deleted (a deletion leaves no number), so a stream resumed
//! from an entry whose deletion failed may be behind what its entity handled; a new message
//! numbered from there would be confirmed as a duplicate and never handled. The producer
//! sends a resumed stream's messages, deletes its entries, lets it go, and only then starts
//! its entity's next stream, which the entity takes from its first message.

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
    /// The stream's places per lane.
    pub modulus: u64,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
    /// The stream's oldest unconfirmed number when this was written: every entry of the
    /// stream below it is confirmed (0 in entries written before it was kept: none known).
    #[serde(default)]
    pub first_unconfirmed: u64,
}

/// The key of `place` in `lane`.
pub(crate) fn entry_key(lane: u32, place: u64) -> String {
    format!("{lane}.{place}")
}

/// The lane and place of an entry key.
fn lane_and_place(key: &str) -> Option<(u32, u64)> {
    let (lane, place) = key.split_once('.')?;
    Some((lane.parse().ok()?, place.parse().ok()?))
}

/// A stream rebuilt from its stored entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RestoredStream {
    pub entity: String,
    pub stream: u64,
    pub lane: u32,
    pub modulus: u64,
    pub made: (u64, u64),
    /// Its messages (number, place, bytes), oldest first.
    pub messages: Vec<(u64, u64, Bytes)>,
    /// Its confirmed messages whose entries are still stored (their deletions were not
    /// written), with their places: the stream deletes them.
    pub confirmed: Vec<(u64, u64)>,
}

impl RestoredStream {
    /// The keys of every entry it was rebuilt from.
    fn keys(&self) -> impl Iterator<Item = String> + '_ {
        let places = self.messages.iter().map(|(_, place, _)| *place);
        places.chain(self.confirmed.iter().map(|(_, place)| *place)).map(|place| entry_key(self.lane, place))
    }
}

/// What a load found: the streams to resume, the keys of stale entries to delete, and the
/// entries that did not decode (counted, deleted).
#[derive(Debug, Default)]
pub(crate) struct Restored {
    pub streams: Vec<RestoredStream>,
    pub stale: Vec<String>,
    pub undecodable: usize,
}

/// A stream's entries as a load finds them in one lane.
struct Found {
    made: (u64, u64),
    entity: String,
    modulus: u64,
    /// (seq, place, message, key).
    messages: Vec<(u64, u64, Bytes, String)>,
    /// The highest first unconfirmed number its entries carry: those below it are confirmed.
    confirmed_below: u64,
}

/// Rebuilds the streams from loaded `(key, value)` entries (see the module doc).
pub(crate) fn restore(entries: Vec<(String, Vec<u8>)>) -> Restored {
    let mut restored = Restored::default();
    let mut lanes: BTreeMap<u32, BTreeMap<u64, Found>> = BTreeMap::new();
    for (key, value) in entries {
        let decoded = lane_and_place(&key).zip(crate::transport::wire::decode::<QueueEntry>(&value).ok());
        // In the form the producer writes, so a deletion by lane and place finds it.
        let canonical =
            |(lane, place): &(u32, u64), e: &QueueEntry| *place < e.modulus && entry_key(*lane, *place) == key;
        let Some(((lane, place), e)) = decoded.filter(|(at, e)| canonical(at, e)) else {
            restored.undecodable += 1;
            restored.stale.push(key);
            continue;
        };
        let found = lanes.entry(lane).or_default().entry(e.stream).or_insert_with(|| Found {
            made: e.made,
            entity: e.entity,
            modulus: e.modulus,
            messages: Vec::new(),
            confirmed_below: 0,
        });
        found.confirmed_below = found.confirmed_below.max(e.first_unconfirmed);
        found.messages.push((e.seq, place, Bytes::from(e.bytes), key));
    }
    // The newest stream of each lane, then of each entity.
    let mut newest: BTreeMap<String, RestoredStream> = BTreeMap::new();
    for (lane, streams) in lanes {
        let mut streams: Vec<_> = streams.into_iter().collect();
        streams.sort_by_key(|(_, found)| found.made);
        let Some((stream, Found { made, entity, modulus, mut messages, confirmed_below })) = streams.pop() else {
            continue;
        };
        restored.stale.extend(streams.into_iter().flat_map(|(_, s)| s.messages.into_iter().map(|(.., k)| k)));
        messages.sort_by_key(|(seq, ..)| *seq);
        // Entries of confirmed messages whose deletion was not written.
        let (confirmed, unconfirmed): (Vec<_>, Vec<_>) =
            messages.into_iter().partition(|(seq, ..)| *seq < confirmed_below);
        let candidate = RestoredStream {
            entity: entity.clone(),
            stream,
            lane,
            modulus,
            made,
            messages: unconfirmed.into_iter().map(|(seq, place, bytes, _)| (seq, place, bytes)).collect(),
            confirmed: confirmed.into_iter().map(|(seq, place, ..)| (seq, place)).collect(),
        };
        match newest.get(&entity) {
            Some(kept) if kept.made >= made => restored.stale.extend(candidate.keys()),
            _ => {
                if let Some(older) = newest.insert(entity, candidate) {
                    restored.stale.extend(older.keys());
                }
            }
        }
    }
    restored.streams = newest.into_values().collect();
    restored.streams.sort_by_key(|s| s.lane);
    restored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::wire;

    fn entry(lane: u32, entity: &str, stream: u64, made: (u64, u64), seq: u64) -> (String, Vec<u8>) {
        entry_confirmed_below(lane, entity, stream, made, seq, 0)
    }

    fn entry_confirmed_below(
        lane: u32,
        entity: &str,
        stream: u64,
        made: (u64, u64),
        seq: u64,
        first_unconfirmed: u64,
    ) -> (String, Vec<u8>) {
        let bytes = seq.to_be_bytes().to_vec();
        let e = QueueEntry { entity: entity.into(), stream, made, seq, modulus: 4, bytes, first_unconfirmed };
        // At the place the first layout gave it: a store written then loads as one written now.
        (entry_key(lane, seq % 4), wire::encode(&e).unwrap().to_vec())
    }

    #[test]
    fn entries_below_what_a_newer_entry_says_is_confirmed_are_left_for_their_stream_to_delete() {
        let r = restore(vec![
            entry_confirmed_below(0, "a", 10, (1, 1), 1, 1),
            entry_confirmed_below(0, "a", 10, (1, 1), 2, 1),
            // Written after 1 and 2 were confirmed; 3 confirmed too, its deletion not written.
            entry_confirmed_below(0, "a", 10, (1, 1), 3, 3),
            entry_confirmed_below(0, "a", 10, (1, 1), 4, 3),
        ]);
        assert_eq!(r.streams.len(), 1);
        assert_eq!(numbers(&r.streams[0]), vec![3, 4], "3 may be confirmed: sent again, a duplicate at most");
        assert_eq!(r.streams[0].confirmed, vec![(1, 1), (2, 2)], "deleted by the stream before it is let go");
        assert!(r.stale.is_empty());
    }

    #[test]
    fn a_stream_with_only_confirmed_entries_is_still_resumed_to_delete_them() {
        // Its lane and its entity stay its own until they are gone: a stream made beside it
        // would meet them again in a later load.
        let r = restore(vec![
            entry_confirmed_below(1, "a", 10, (1, 1), 1, 1),
            entry_confirmed_below(1, "a", 10, (1, 1), 2, 3),
        ]);
        assert_eq!(r.streams.len(), 1);
        assert!(numbers(&r.streams[0]).is_empty());
        assert_eq!((r.streams[0].lane, r.streams[0].confirmed.clone()), (1, vec![(1, 1), (2, 2)]));
    }

    #[test]
    fn an_entry_written_before_entries_said_what_is_confirmed_reads_as_unconfirmed() {
        let (key, _) = entry(0, "a", 10, (1, 1), 2);
        #[derive(serde::Serialize)]
        struct Older {
            entity: String,
            stream: u64,
            made: (u64, u64),
            seq: u64,
            modulus: u64,
            #[serde(with = "serde_bytes")]
            bytes: Vec<u8>,
        }
        let older = Older { entity: "a".into(), stream: 10, made: (1, 1), seq: 2, modulus: 4, bytes: vec![7] };
        let r = restore(vec![(key, wire::encode(&older).unwrap().to_vec())]);
        assert_eq!((r.streams.len(), r.undecodable), (1, 0));
        assert_eq!(numbers(&r.streams[0]), vec![2]);
    }

    fn numbers(s: &RestoredStream) -> Vec<u64> {
        s.messages.iter().map(|(seq, ..)| *seq).collect()
    }

    #[test]
    fn keys_name_their_lane_and_place() {
        assert_eq!((entry_key(7, 0), entry_key(7, 3)), ("7.0".into(), "7.3".into()));
        assert_eq!(lane_and_place("12.3"), Some((12, 3)));
        assert_eq!(lane_and_place("x.3"), None);
        assert_eq!(lane_and_place("1.x"), None);
        assert_eq!(lane_and_place("13"), None);
    }

    #[test]
    fn a_streams_messages_load_in_order_whatever_places_they_took_and_keep_their_places() {
        let at = |place: u64, seq: u64, first_unconfirmed: u64| {
            let e = QueueEntry {
                entity: "a".into(),
                stream: 10,
                made: (1, 1),
                seq,
                modulus: 4,
                bytes: vec![seq as u8],
                first_unconfirmed,
            };
            (entry_key(2, place), wire::encode(&e).unwrap().to_vec())
        };
        // 5 took place 0 once 4 (there before) was confirmed; 6 took place 1; 3 is confirmed.
        let r = restore(vec![at(1, 6, 5), at(0, 5, 5), at(3, 3, 3)]);
        assert_eq!(r.streams.len(), 1);
        let places: Vec<(u64, u64)> = r.streams[0].messages.iter().map(|(seq, place, _)| (*seq, *place)).collect();
        assert_eq!(places, vec![(5, 0), (6, 1)]);
        assert_eq!(r.streams[0].confirmed, vec![(3, 3)]);
        let mut keys: Vec<String> = r.streams[0].keys().collect();
        keys.sort();
        assert_eq!(keys, ["2.0", "2.1", "2.3"]);
    }

    #[test]
    fn a_load_resumes_each_lanes_newest_stream_in_order_and_deletes_what_older_streams_left() {
        let r = restore(vec![
            entry(0, "a", 10, (1, 1), 6),
            entry(0, "a", 10, (1, 1), 5),
            // Lane 1 held b's stream 11, then (after eviction) c's stream 12; one deletion of
            // 11 was never written.
            entry(1, "b", 11, (1, 2), 3),
            entry(1, "c", 12, (2, 1), 1),
        ]);
        assert_eq!(r.streams.len(), 2, "{:?}", r.streams);
        assert_eq!((r.streams[0].entity.as_str(), r.streams[0].stream, numbers(&r.streams[0])), ("a", 10, vec![5, 6]));
        assert_eq!((r.streams[1].entity.as_str(), numbers(&r.streams[1])), ("c", vec![1]));
        assert_eq!(r.stale, vec!["1.3".to_string()]);
        assert_eq!(r.undecodable, 0);
    }

    #[test]
    fn of_two_streams_of_one_entity_in_two_lanes_the_newer_is_resumed() {
        let r = restore(vec![entry(0, "a", 10, (1, 1), 2), entry(3, "a", 14, (2, 5), 1)]);
        assert_eq!(r.streams.iter().map(|s| s.stream).collect::<Vec<_>>(), vec![14]);
        assert_eq!(r.stale, vec!["0.2".to_string()]);
        // The newer in the lower lane: kept when the older comes later.
        let r = restore(vec![entry(0, "a", 14, (2, 5), 1), entry(3, "a", 10, (1, 1), 2)]);
        assert_eq!(r.streams.iter().map(|s| s.stream).collect::<Vec<_>>(), vec![14]);
        assert_eq!(r.stale, vec!["3.2".to_string()]);
    }

    #[test]
    fn an_entry_that_does_not_decode_or_sits_past_its_lanes_places_is_counted_and_deleted() {
        let (_, good) = entry(0, "a", 10, (1, 1), 2);
        let r = restore(vec![
            ("0.1".into(), vec![0xc1]),
            ("0.4".into(), good.clone()),
            ("0.+2".into(), good),
            ("bad".into(), vec![]),
        ]);
        assert!(r.streams.is_empty());
        assert_eq!(r.undecodable, 4);
        assert_eq!(r.stale.len(), 4);
    }
}
