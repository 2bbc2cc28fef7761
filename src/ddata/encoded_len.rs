//! Encoded sizes, computed without encoding: what the data types count against their budgets.
//! A leaf of `ddata`.

/// Bytes of `v` as a MessagePack unsigned integer.
pub(crate) fn rmp_uint_len(v: u64) -> usize {
    match v {
        0..=127 => 1,
        128..=255 => 2,
        256..=65_535 => 3,
        65_536..=0xffff_ffff => 5,
        _ => 9,
    }
}
