//! The encoded form of an [`OrSet`] and its validation: everything decoded from a peer or the
//! disk is checked before it becomes a set.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Dot, MAX_COUNTER, MAX_ELEMENT_LEN, MAX_WRITERS, OrSet, OrSetError, Writers, get_varint, put_varint};
use crate::ddata::write_ctx::Actor;

/// The encoded form: writer names, version vector, cloud, then every (element, dot) as
/// `[len varint][bytes][writer varint][counter varint]` in one byte string (≈ id length + 5 B).
#[derive(Serialize, Deserialize)]
pub(super) struct OrSetWire {
    pub(super) writers: Vec<Actor>,
    pub(super) vv: Vec<u64>,
    pub(super) cloud: Vec<(u16, u64)>,
    #[serde(with = "serde_bytes")]
    pub(super) entries: Vec<u8>,
    /// Cloud intervals of more than one dot: `(writer, first, last)`. Absent in values written
    /// before intervals existed.
    #[serde(default)]
    pub(super) cloud_ranges: Vec<(u16, u64, u64)>,
}

impl Serialize for OrSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut entries = Vec::with_capacity(self.arena.len() + self.len() * 5);
        self.for_each_entry(|x, d| {
            put_varint(&mut entries, x.len() as u64);
            entries.extend_from_slice(x);
            put_varint(&mut entries, u64::from(d.writer()));
            put_varint(&mut entries, d.counter());
        });
        OrSetWire {
            writers: self.writers.names.clone(),
            vv: self.vv.clone(),
            cloud: self
                .cloud
                .iter()
                .filter(|(d, hi)| d.counter() == **hi)
                .map(|(d, _)| (d.writer(), d.counter()))
                .collect(),
            entries,
            cloud_ranges: self
                .cloud
                .iter()
                .filter(|(d, hi)| d.counter() != **hi)
                .map(|(d, hi)| (d.writer(), d.counter(), *hi))
                .collect(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for OrSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        OrSet::from_wire(OrSetWire::deserialize(d)?).map_err(D::Error::custom)
    }
}

pub(super) fn check_writers(names: &[Actor]) -> Result<Writers, OrSetError> {
    if names.len() > MAX_WRITERS {
        return Err(OrSetError::TooManyWriters);
    }
    let mut w = Writers::default();
    for n in names {
        if w.index_of(n).is_some() {
            return Err(OrSetError::Malformed("duplicate writer"));
        }
        w.intern(n);
    }
    Ok(w)
}

pub(super) fn check_dot(writers: &Writers, w: u64, c: u64) -> Result<Dot, OrSetError> {
    let w = u16::try_from(w).ok().filter(|w| usize::from(*w) < writers.names.len());
    let w = w.ok_or(OrSetError::Malformed("writer index out of range"))?;
    if c == 0 || c > MAX_COUNTER {
        return Err(OrSetError::Malformed("counter out of range"));
    }
    Ok(Dot::new(w, c))
}

pub(super) fn check_element(x: &[u8]) -> Result<(), OrSetError> {
    if x.len() > MAX_ELEMENT_LEN {
        return Err(OrSetError::Malformed("element too long"));
    }
    std::str::from_utf8(x).map_err(|_| OrSetError::Malformed("element is not UTF-8"))?;
    Ok(())
}

impl OrSet {
    pub(super) fn from_wire(wire: OrSetWire) -> Result<OrSet, OrSetError> {
        let writers = check_writers(&wire.writers)?;
        if wire.vv.len() != writers.names.len() {
            return Err(OrSetError::Malformed("version vector length"));
        }
        if wire.vv.iter().any(|n| *n > MAX_COUNTER) {
            return Err(OrSetError::Malformed("counter out of range"));
        }
        let mut set = OrSet { vv: vec![0; writers.names.len()], writers, ..OrSet::default() };
        for (w, n) in wire.vv.iter().enumerate() {
            set.set_vv(w as u16, *n);
        }
        for (w, c) in wire.cloud {
            let d = check_dot(&set.writers, u64::from(w), c)?;
            set.context_insert(d);
        }
        for (w, lo, hi) in wire.cloud_ranges {
            let d = check_dot(&set.writers, u64::from(w), lo)?;
            check_dot(&set.writers, u64::from(w), hi)?;
            if hi < lo {
                return Err(OrSetError::Malformed("empty cloud interval"));
            }
            set.context_insert_range(d.writer(), lo, hi);
        }
        let bytes = &wire.entries;
        let mut pos = 0;
        let mut by_element: Vec<(&[u8], Dot)> = Vec::new();
        while pos < bytes.len() {
            let len = get_varint(bytes, &mut pos).ok_or(OrSetError::Malformed("truncated entry"))?;
            let len = usize::try_from(len).map_err(|_| OrSetError::Malformed("element too long"))?;
            let end =
                pos.checked_add(len).filter(|e| *e <= bytes.len()).ok_or(OrSetError::Malformed("truncated entry"))?;
            let x = &bytes[pos..end];
            check_element(x)?;
            pos = end;
            let w = get_varint(bytes, &mut pos).ok_or(OrSetError::Malformed("truncated entry"))?;
            let c = get_varint(bytes, &mut pos).ok_or(OrSetError::Malformed("truncated entry"))?;
            let d = check_dot(&set.writers, w, c)?;
            if !set.context_contains(d) {
                return Err(OrSetError::Malformed("entry dot outside the causal context"));
            }
            by_element.push((x, d));
        }
        by_element.sort_unstable();
        by_element.dedup();
        set.index.reserve(by_element.len(), |_| 0);
        let mut i = 0;
        while i < by_element.len() {
            let x = by_element[i].0;
            let mut j = i;
            while j < by_element.len() && by_element[j].0 == x {
                j += 1;
            }
            let dots: Vec<Dot> = by_element[i..j].iter().map(|(_, d)| *d).collect();
            set.set_dots(x, &dots);
            i = j;
        }
        Ok(set)
    }
}
