//! Shared by the fuzz targets (`#[test] fn fuzz_*` beside the decoder each one checks): turns a
//! fuzzer's input into either raw bytes or a structure-aware mutation of a valid encoding, so
//! random inputs get past the first length and tag checks into the parsers behind them.
//!
//! Every target runs under `cargo test` (its committed corpus in `__fuzz__/`, then 2,000
//! random inputs) and as a campaign: `BOLERO_RANDOM_ITERATIONS=1000000 cargo test --release
//! --lib fuzz_` on stable, or coverage-guided with `cargo bolero test` (see TESTING.md).

/// Random inputs per target in an ordinary `cargo test` (`BOLERO_RANDOM_ITERATIONS` overrides).
pub(crate) const QUICK_ITERATIONS: usize = 2_000;

/// The bytes a target decodes for this fuzzer input: with its first byte divisible by four the
/// rest verbatim; otherwise one of `seeds` (picked by the first byte) edited by the remaining
/// bytes, three at a time (operation, position high, position low): flip a bit, overwrite,
/// insert or delete a byte, truncate, or set a byte to an extreme value.
pub(crate) fn mutate(seeds: &[Vec<u8>], input: &[u8]) -> Vec<u8> {
    let Some((&first, rest)) = input.split_first() else { return Vec::new() };
    if seeds.is_empty() || first % 4 == 0 {
        return rest.to_vec();
    }
    let mut bytes = seeds[usize::from(first / 4) % seeds.len()].clone();
    for edit in rest.chunks_exact(3) {
        let (op, pos) = (edit[0], usize::from(u16::from_be_bytes([edit[1], edit[2]])));
        let at = if bytes.is_empty() { 0 } else { pos % bytes.len() };
        match op % 6 {
            0 if !bytes.is_empty() => bytes[at] ^= 1 << (op / 6 % 8),
            1 if !bytes.is_empty() => bytes[at] = edit[2],
            2 => bytes.insert(at, edit[2]),
            3 if !bytes.is_empty() => {
                bytes.remove(at);
            }
            4 => bytes.truncate(at),
            5 if !bytes.is_empty() => bytes[at] = if op & 0x80 == 0 { 0x00 } else { 0xff },
            _ => {}
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_pick_raw_bytes_or_an_edited_seed() {
        let seeds = vec![b"abc".to_vec(), b"xyz".to_vec()];
        assert_eq!(mutate(&seeds, &[0, 1, 2]), vec![1, 2]);
        assert_eq!(mutate(&seeds, &[1]), b"abc");
        assert_eq!(mutate(&seeds, &[5]), b"xyz");
        // op 4 (truncate) at position 1
        assert_eq!(mutate(&seeds, &[1, 4, 0, 1]), b"a");
        // op 2 (insert 0x41 'A' at 0x41 % 3 = 2)
        assert_eq!(mutate(&seeds, &[1, 2, 0, 0x41]), b"abAc");
        assert!(mutate(&seeds, &[]).is_empty());
    }
}
