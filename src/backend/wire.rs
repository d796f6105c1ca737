//! A lossless code for bf16 weights on the host link: streamed blocks cross it coded and are
//! decoded on the device (`crate::memory`), about 0.69 of the bytes for the same values.
//!
//! A bf16 value is a sign, an 8-bit exponent and a 7-bit mantissa. The sign and mantissa look
//! random; the exponents of a weight tensor crowd into a few values (a trained or a random
//! layer's weights span a few powers of two; DFloat11, Zhang et al. 2025, measures about 2.6
//! bits of exponent entropy in LLM weights, and normal values have 2.54). So the code keeps
//! the sign and mantissa as one byte and writes each exponent in a Huffman code of the
//! tensor's own exponent counts, no code longer than `MAX_LEN` bits (package-merge, Larmore
//! and Hirschberg 1990): about 8 + 2.6 bits a value instead of 16.
//!
//! To decode in parallel, the values go in chunks of `CHUNK` (a warp of 32 GPU threads), each
//! thread decoding one run of `RUN` in order: run t of a chunk takes values `4 (32 k + t) + j`
//! of it for k = 0..32, j = 0..4, so at each step the warp reads 128 bytes of signs and
//! mantissas and writes 256 bytes of values in one piece. A run's codes form a stream of 32-bit
//! words; a chunk stores its 32 streams interleaved (word w of run t at `32 w + t` from the
//! chunk's first word), each padded to the chunk's longest, so a warp's reads of the same word
//! meet in one piece too (about 0.4 bits a value of padding).
//!
//! Layout of a coded tensor of `len` values (`Layout`), each section at a multiple of 16 bytes
//! (the last chunk may be short):
//! - `sm`: `len` bytes, value i's sign in bit 7 and mantissa in bits 0-6;
//! - `table`: `1 << MAX_LEN` u16 entries, little-endian: for the next `MAX_LEN` bits of a
//!   stream (first bit lowest), the exponent they start with in bits 0-7 and its code's
//!   length in bits 8-11 (0: no code starts so);
//! - `chunks`: a u32 per chunk, the word of `bits` its streams start at;
//! - `bits`: the chunks' interleaved streams as little-endian u32 words, each code's first bit
//!   lowest, and 64 spare zero words after them (a decoder reads up to two words ahead).
//!
//! A tensor pays for its table from about 5 000 values on. `cuda/wire.cu` decodes the same
//! layout on the GPU, bit for bit.

use crate::{Error, Result};

/// Values a run holds: a GPU thread decodes them in order.
pub const RUN: usize = 128;
/// Values a chunk holds: 32 runs (a warp), their streams interleaved.
pub const CHUNK: usize = 32 * RUN;
/// Consecutive values a run takes at each step.
pub const STEP: usize = 4;
/// The longest code, bits: the decode table has `1 << MAX_LEN` entries (2 KiB).
pub const MAX_LEN: u32 = 10;
/// Coded tensors the device decodes in one launch (`WIRE_BATCH` in cuda/wire.cu).
pub const DECODE_BATCH: usize = 32;
/// Spare zero words after the streams.
const SPARE: usize = 64;
/// Entries of the decode table.
pub const TABLE: usize = 1 << MAX_LEN;
/// A tensor is coded only when that saves at least this fraction of its bytes.
pub const MIN_SAVING: f64 = 0.1;
/// Exponent bits a value the planner expects before a tensor is coded: a little over the
/// Huffman code's 2.58 on normal values (DFloat11 measures 2.6 bits of entropy in trained
/// weights), and the streams' padding.
pub const EXPECTED_EXPONENT_BITS: f64 = 3.0;

fn align16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

/// Where the sections of a coded tensor lie, in bytes from its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Values coded.
    pub len: usize,
    /// Start of the sign-and-mantissa bytes (0).
    pub sm: usize,
    /// Start of the decode table.
    pub table: usize,
    /// Start of the chunks' first words.
    pub chunks: usize,
    /// Start of the code words.
    pub bits: usize,
    /// Total bytes.
    pub bytes: usize,
}

impl Layout {
    /// The layout of `len` values whose streams take `words` 32-bit words.
    pub fn new(len: usize, words: usize) -> Layout {
        let table = align16(len);
        let chunks = align16(table + 2 * TABLE);
        let bits = align16(chunks + 4 * len.div_ceil(CHUNK));
        Layout {
            len,
            sm: 0,
            table,
            chunks,
            bits,
            bytes: bits + 4 * (words + SPARE),
        }
    }

    /// Chunks (the last may be short).
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(CHUNK)
    }

    /// Runs, a GPU thread each (the last chunk's may be short or empty).
    pub fn runs(&self) -> usize {
        32 * self.chunks()
    }

    /// The bytes `len` values are expected to take coded, for the planner (exponents at
    /// `EXPECTED_EXPONENT_BITS`).
    pub fn expected(len: usize) -> Layout {
        Layout::new(
            len,
            (len as f64 * EXPECTED_EXPONENT_BITS / 32.0).ceil() as usize,
        )
    }
}

/// A coded bf16 tensor: its layout and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coded {
    /// Where the sections lie.
    pub layout: Layout,
    /// The coded bytes (`layout.bytes`).
    pub bytes: Vec<u8>,
}

/// Code lengths for symbols of counts `counts` (0: absent), none over `limit` bits, minimising
/// the total coded length: package-merge. One present symbol gets a 1-bit code.
fn code_lengths(counts: &[u64; 256], limit: u32) -> [u32; 256] {
    let mut lens = [0u32; 256];
    let mut leaves: Vec<(u64, usize)> = (0..256)
        .filter(|&s| counts[s] > 0)
        .map(|s| (counts[s], s))
        .collect();
    match leaves.len() {
        0 => return lens,
        1 => {
            lens[leaves[0].1] = 1;
            return lens;
        }
        _ => {}
    }
    leaves.sort_unstable();
    let n = leaves.len();
    // An item is a weight and how many times each leaf (by its place in `leaves`) is in it.
    type Item = (u64, Vec<u8>);
    let singles: Vec<Item> = leaves
        .iter()
        .enumerate()
        .map(|(k, &(w, _))| {
            let mut m = vec![0u8; n];
            m[k] = 1;
            (w, m)
        })
        .collect();
    let mut list = singles.clone();
    for _ in 1..limit {
        let packages = list.chunks_exact(2).map(|p| {
            let m = p[0].1.iter().zip(&p[1].1).map(|(a, b)| a + b).collect();
            (p[0].0 + p[1].0, m)
        });
        let mut merged: Vec<Item> = singles.iter().cloned().chain(packages).collect();
        // Stable: a single goes before a package of equal weight.
        merged.sort_by_key(|i| i.0);
        list = merged;
    }
    for (_, m) in list.iter().take(2 * n - 2) {
        for (k, &c) in m.iter().enumerate() {
            lens[leaves[k].1] += c as u32;
        }
    }
    lens
}

/// Canonical codes for `lens` (shorter codes first, then by symbol), each bit-reversed so that
/// its first bit is the lowest: (code, length) per symbol.
fn canonical(lens: &[u32; 256]) -> [(u32, u32); 256] {
    let mut order: Vec<usize> = (0..256).filter(|&s| lens[s] > 0).collect();
    order.sort_by_key(|&s| (lens[s], s));
    let mut codes = [(0u32, 0u32); 256];
    let mut code = 0u32;
    let mut prev = order.first().map_or(0, |&s| lens[s]);
    for &s in &order {
        code <<= lens[s] - prev;
        prev = lens[s];
        codes[s] = (code.reverse_bits() >> (32 - lens[s]), lens[s]);
        code += 1;
    }
    codes
}

/// The values run `t` of chunk `c` decodes, in order: `STEP` consecutive ones a step, the
/// warp's 32 runs side by side.
fn run_values(c: usize, t: usize, len: usize) -> impl Iterator<Item = usize> {
    (0..RUN / STEP)
        .flat_map(move |k| (0..STEP).map(move |j| c * CHUNK + STEP * (32 * k + t) + j))
        .filter(move |&i| i < len)
}

/// Chunks a task of [`encode`] takes at least: enough work (about 1 MiB of values) that the
/// pool's hand-offs cost nothing beside it.
const CHUNKS_A_TASK: usize = 128;

/// One chunk's 32 run streams, interleaved (word w of run t at `32 w + t`, each stream
/// padded with zeros to the longest), as [`encode`] lays them; `streams` is scratch.
fn encode_chunk(
    bits: &[u16],
    c: usize,
    codes: &[(u32, u32); 256],
    streams: &mut [Vec<u32>; 32],
    out: &mut Vec<u32>,
) {
    let len = bits.len();
    for (t, stream) in streams.iter_mut().enumerate() {
        stream.clear();
        // Bits not yet in the stream: `acc`'s low `n`.
        let (mut acc, mut n) = (0u64, 0u32);
        for i in run_values(c, t, len) {
            let (code, l) = codes[((bits[i] >> 7) & 0xFF) as usize];
            acc |= (code as u64) << n;
            n += l;
            if n >= 32 {
                stream.push(acc as u32);
                acc >>= 32;
                n -= 32;
            }
        }
        if n > 0 {
            stream.push(acc as u32);
        }
    }
    let rows = streams.iter().map(Vec::len).max().unwrap_or(0);
    for w in 0..rows {
        out.extend(streams.iter().map(|s| s.get(w).copied().unwrap_or(0)));
    }
}

/// How many of `bits` (bf16 bit patterns) have each exponent.
fn exponent_counts(bits: &[u16]) -> [u64; 256] {
    let mut counts = [0u64; 256];
    for &b in bits {
        counts[((b >> 7) & 0xFF) as usize] += 1;
    }
    counts
}

/// `bits` (bf16 values as their bit patterns) coded, or `None` when that would save less than
/// `MIN_SAVING` of their bytes (exponents spread wide, or too few values). The counts, the
/// chunks' streams and the output bytes are worked out on the host's cores (rayon) in pieces
/// of whole chunks, and joined in order: the same bytes as one core would write.
pub fn encode(bits: &[u16]) -> Option<Coded> {
    use rayon::prelude::*;
    let len = bits.len();
    let piece = CHUNKS_A_TASK * CHUNK;
    let counts = bits.par_chunks(piece).map(exponent_counts).reduce(
        || [0u64; 256],
        |mut a, b| {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
            a
        },
    );
    let codes = canonical(&code_lengths(&counts, MAX_LEN));
    let code_bits: u64 = (0..256).map(|s| counts[s] * codes[s].1 as u64).sum();
    let chunks = len.div_ceil(CHUNK);
    // Before padding the streams: no saving, no code.
    if len == 0
        || (Layout::new(len, (code_bits as usize).div_ceil(32)).bytes as f64)
            > (1.0 - MIN_SAVING) * (2 * len) as f64
    {
        return None;
    }
    // Each piece's chunks' words in order, and where each chunk starts within its piece.
    let pieces: Vec<(Vec<u32>, Vec<usize>)> = (0..chunks.div_ceil(CHUNKS_A_TASK))
        .into_par_iter()
        .map(|k| {
            let first = k * CHUNKS_A_TASK;
            let last = (first + CHUNKS_A_TASK).min(chunks);
            let mut words = Vec::new();
            let mut starts = Vec::with_capacity(last - first);
            let mut streams: [Vec<u32>; 32] = std::array::from_fn(|_| Vec::new());
            for c in first..last {
                starts.push(words.len());
                encode_chunk(bits, c, &codes, &mut streams, &mut words);
            }
            (words, starts)
        })
        .collect();
    // Streams start at a u32 word: a tensor of over ~10^10 values is not coded.
    let mut chunk_words = Vec::with_capacity(chunks);
    let mut total = 0usize;
    for (words, starts) in &pieces {
        for &s in starts {
            chunk_words.push(u32::try_from(total + s).ok()?);
        }
        total += words.len();
    }
    let layout = Layout::new(len, total);
    if (layout.bytes as f64) > (1.0 - MIN_SAVING) * (2 * len) as f64 {
        return None;
    }
    let mut out = vec![0u8; layout.bytes];
    {
        let (sm, rest) = out.split_at_mut(layout.table);
        sm[..len]
            .par_chunks_mut(piece)
            .zip(bits.par_chunks(piece))
            .for_each(|(o, b)| {
                for (o, &b) in o.iter_mut().zip(b) {
                    *o = (((b >> 8) & 0x80) | (b & 0x7F)) as u8;
                }
            });
        let table = &mut rest[..layout.chunks - layout.table];
        for (s, &(code, l)) in codes.iter().enumerate() {
            if l == 0 {
                continue;
            }
            let entry = (s as u16) | ((l as u16) << 8);
            for j in 0..1usize << (MAX_LEN - l) {
                let at = 2 * (code as usize | (j << l));
                table[at..at + 2].copy_from_slice(&entry.to_le_bytes());
            }
        }
    }
    for (c, w) in chunk_words.iter().enumerate() {
        let at = layout.chunks + 4 * c;
        out[at..at + 4].copy_from_slice(&w.to_le_bytes());
    }
    // Each piece's words to their place.
    let mut rest = &mut out[layout.bits..layout.bits + 4 * total];
    let mut places = Vec::with_capacity(pieces.len());
    for (words, _) in &pieces {
        let (here, after) = rest.split_at_mut(4 * words.len());
        places.push((here, words));
        rest = after;
    }
    places.into_par_iter().for_each(|(dst, words)| {
        for (d, w) in dst.chunks_exact_mut(4).zip(words.iter()) {
            d.copy_from_slice(&w.to_le_bytes());
        }
    });
    Some(Coded { layout, bytes: out })
}

/// Decodes `bytes` laid out as `layout` into `out` (`layout.len` values), checking that every
/// code is in the table and every read inside the bytes.
pub fn decode(layout: &Layout, bytes: &[u8], out: &mut [u16]) -> Result<()> {
    let bad = |what: &str| {
        Error::Stream(format!(
            "a coded bf16 tensor of {} values: {what}",
            layout.len
        ))
    };
    if bytes.len() < layout.bytes || layout.bytes < layout.bits || out.len() != layout.len {
        return Err(bad("too few bytes or a wrong output length"));
    }
    let words = ((layout.bytes - layout.bits) / 4).checked_sub(SPARE);
    if words.is_none_or(|w| *layout != Layout::new(layout.len, w)) {
        return Err(bad("a layout that is not the code's"));
    }
    let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
    let word = |k: usize| -> Result<u64> {
        let at = layout.bits + 4 * k;
        bytes
            .get(at..at + 4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64)
            .ok_or_else(|| bad("a code past the end"))
    };
    for c in 0..layout.chunks() {
        let at = layout.chunks + 4 * c;
        let first = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        for t in 0..32 {
            // Bit `pos` of run t's stream is bit pos % 32 of its word pos / 32, which lies at
            // `first + 32 (pos / 32) + t`.
            let mut pos = 0usize;
            for i in run_values(c, t, layout.len) {
                let (w, s) = (first as usize + 32 * (pos / 32) + t, pos % 32);
                let peek = ((word(w)? | word(w + 32)? << 32) >> s) as usize & (TABLE - 1);
                let entry = u16_at(layout.table + 2 * peek);
                let l = (entry >> 8) as usize;
                if l == 0 {
                    return Err(bad("a code not in the table"));
                }
                pos += l;
                let e = entry & 0xFF;
                let sm = bytes[layout.sm + i] as u16;
                out[i] = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F);
            }
        }
    }
    Ok(())
}

/// The bytes of the staging ring for uploads of at most `wire` bytes on the link in at most
/// `pieces` pieces, none of whose raw prefix or coded parts takes more than `part`: the
/// largest upload, the end of the ring a piece (`staging_piece` bytes or a part) may skip
/// when it wraps, each piece's alignment, and a part more, so that no upload's pieces wrap
/// onto its own (whose decodes wait for the compute).
pub(crate) fn staging_ring_bytes(wire: usize, part: usize, pieces: usize) -> usize {
    if wire == 0 {
        return 0;
    }
    wire + staging_piece(wire).max(part) + part + 256 * (pieces + 1)
}

/// The bytes a staged piece gathers coded parts up to, for uploads of at most `wire` bytes on
/// the link: an eighth of the largest, and no less than `MIN_PIECE` (or half the largest).
/// Each piece costs the host about five driver calls (its copy and event, the decode
/// stream's wait, the decode and its event); eighths of SDXL's units (8 MB) made about eight
/// pieces an upload where two keep the link and the decodes overlapping.
pub(crate) fn staging_piece(wire: usize) -> usize {
    (wire / 8).max(MIN_PIECE.min(wire / 2))
}

/// The least bytes a staged piece gathers coded parts up to (`staging_piece`): 32 MiB, about
/// 0.6 ms on the link of a GPU's PCIe 5 slot (51 GiB/s measured, H200), against which the
/// host's issue of a piece (about 14 µs, H200) is 2%.
pub(crate) const MIN_PIECE: usize = 32 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded bf16 bit patterns: normal-ish values of scale `scale`, with every special
    /// pattern mixed in (zeros, subnormals, infinities, NaNs, the largest values).
    fn values(n: usize, scale: f32, seed: u64) -> Vec<u16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        (0..n)
            .map(|i| match i % 97 {
                0 => 0x0000,
                1 => 0x8000,
                2 => 0x0001,
                3 => 0x7F80,
                4 => 0xFFC1,
                5 => 0x7F7F,
                _ => {
                    // Sum of uniforms: roughly normal.
                    let u: f32 = (0..4)
                        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
                        .sum();
                    let x = (u - 2.0) * scale;
                    (x.to_bits() >> 16) as u16
                }
            })
            .collect()
    }

    #[test]
    fn round_trips_every_length_and_special_value() {
        for (n, scale) in [
            (1usize, 1.0f32),
            (15, 0.02),
            (16, 3.0),
            (127, 0.02),
            (129, 0.02),
            (4095, 0.02),
            (4096, 0.02),
            (4097, 1e-3),
            (9000, 0.02),
            (70_001, 0.02),
            (300_000, 0.1),
            // Several of encode's tasks, the last one short and its last chunk too.
            (2 * CHUNKS_A_TASK * CHUNK + 5 * CHUNK + 77, 0.02),
        ] {
            let v = values(n, scale, n as u64);
            match encode(&v) {
                Some(c) => {
                    assert_eq!(c.bytes.len(), c.layout.bytes);
                    let mut out = vec![0u16; n];
                    decode(&c.layout, &c.bytes, &mut out).unwrap();
                    assert_eq!(out, v, "{n} values");
                    // A byte, ~2.8 bits a value (6% of these values special) and ~0.4 of
                    // padding, and the table.
                    if n >= 65536 {
                        assert!(
                            (c.bytes.len() as f64) < 0.72 * (2 * n) as f64 + (2 * TABLE) as f64,
                            "{n}: {}",
                            c.bytes.len()
                        );
                    }
                }
                None => assert!(n < 9_000, "{n} values not coded"),
            }
        }
    }

    /// The pieces encoded apart join into the layout of one pass over the chunks: each
    /// chunk's first word is where the chunks before it end.
    #[test]
    fn pieces_join_as_one_pass_lays_the_chunks() {
        let n = 3 * CHUNKS_A_TASK * CHUNK + 3 * CHUNK + 1;
        let v = values(n, 0.02, 7);
        let c = encode(&v).unwrap();
        let codes = canonical(&code_lengths(&exponent_counts(&v), MAX_LEN));
        let mut streams: [Vec<u32>; 32] = std::array::from_fn(|_| Vec::new());
        let mut words = vec![];
        for ch in 0..c.layout.chunks() {
            let at = c.layout.chunks + 4 * ch;
            let first = u32::from_le_bytes(c.bytes[at..at + 4].try_into().unwrap());
            assert_eq!(first as usize, words.len(), "chunk {ch}");
            encode_chunk(&v, ch, &codes, &mut streams, &mut words);
        }
        let bits: Vec<u32> = c.bytes[c.layout.bits..c.layout.bits + 4 * words.len()]
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
            .collect();
        assert_eq!(bits, words);
        assert_eq!(c.layout, Layout::new(n, words.len()));
    }

    #[test]
    fn codes_are_no_longer_than_the_table_and_optimal_when_unlimited() {
        // Counts 2^k for 24 symbols: an unlimited Huffman code would go 23 bits deep.
        let mut counts = [0u64; 256];
        for k in 0..24 {
            counts[100 + k] = 1 << k;
        }
        let lens = code_lengths(&counts, MAX_LEN);
        assert!(lens.iter().all(|&l| l <= MAX_LEN));
        assert!(lens[100..124].iter().all(|&l| l > 0));
        // Kraft: a prefix code fills at most the whole tree.
        let kraft: f64 = lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 0.5f64.powi(l as i32))
            .sum();
        assert!(kraft <= 1.0 + 1e-12, "{kraft}");
        // With room, package-merge gives Huffman's lengths: 1, 2, 3, ... for these counts.
        let free = code_lengths(&counts, 32);
        assert_eq!(free[123], 1);
        assert_eq!(free[122], 2);
        assert_eq!(free[101], 23);
        assert_eq!(free[100], 23);
        // Values drawn with those counts round-trip under the limited code.
        let v: Vec<u16> = (0..(1u32 << 16))
            .map(|i| {
                let k = 23 - (i + 1).trailing_zeros().min(23);
                (((100 + k) << 7) | (i & 0x7F) | ((i & 2) << 14)) as u16
            })
            .collect();
        let c = encode(&v).unwrap();
        let mut out = vec![0u16; v.len()];
        decode(&c.layout, &c.bytes, &mut out).unwrap();
        assert_eq!(out, v);
        // One exponent only: a 1-bit code.
        let one: Vec<u16> = (0..65536u32)
            .map(|i| ((120 << 7) | (i & 0x7F)) as u16)
            .collect();
        let c = encode(&one).unwrap();
        let mut out = vec![0u16; one.len()];
        decode(&c.layout, &c.bytes, &mut out).unwrap();
        assert_eq!(out, one);
    }

    #[test]
    fn wide_exponents_code_when_it_pays_and_not_otherwise() {
        // Exponents spread evenly over 32 powers of two: 5 bits, still a saving.
        let v: Vec<u16> = (0..65536u32)
            .map(|i| (((60 + (i * 7) % 32) << 7) | (i & 0x7F) | ((i & 1) << 15)) as u16)
            .collect();
        let c = encode(&v).unwrap();
        let mut out = vec![0u16; v.len()];
        decode(&c.layout, &c.bytes, &mut out).unwrap();
        assert_eq!(out, v);
        // Every exponent alike often: 8 bits, no saving.
        let w: Vec<u16> = (0..65536u32).map(|i| (i * 40503) as u16).collect();
        assert!(encode(&w).is_none());
    }

    #[test]
    fn the_planner_estimate_is_near_the_code_on_normal_values() {
        let v = values(1 << 20, 0.02, 5);
        let c = encode(&v).unwrap();
        let expected = Layout::expected(v.len()).bytes as f64;
        let got = c.bytes.len() as f64;
        assert!((got / expected - 1.0).abs() < 0.05, "{got} vs {expected}");
    }

    #[test]
    fn truncated_or_corrupt_bytes_are_an_error() {
        let v = values(4096 * 9 + 5, 0.02, 9);
        let c = encode(&v).unwrap();
        let mut out = vec![0u16; v.len()];
        assert!(decode(&c.layout, &c.bytes[..c.layout.bytes - 1], &mut out).is_err());
        assert!(decode(&c.layout, &c.bytes, &mut out[1..]).is_err());
        // A run sent past the codes reads beyond the bytes or into the table's holes.
        let mut bad = c.bytes.clone();
        let at = c.layout.chunks + 4;
        bad[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&c.layout, &bad, &mut out).is_err());
        // A layout whose sections are not where the code puts them.
        let moved = Layout {
            chunks: c.layout.chunks + 16,
            ..c.layout
        };
        assert!(decode(&moved, &c.bytes, &mut out).is_err());
        // Every table entry empty: no code decodes.
        let mut bad = c.bytes.clone();
        bad[c.layout.table..c.layout.table + 2 * TABLE].fill(0);
        assert!(decode(&c.layout, &bad, &mut out).is_err());
    }
}
