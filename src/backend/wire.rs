//! A lossless code for bf16 weights on the host link: streamed blocks cross it coded and are
//! decoded on the device (`crate::stream`), about a quarter fewer bytes for the same values.
//!
//! A bf16 value is a sign, an 8-bit exponent and a 7-bit mantissa. The sign and mantissa look
//! random; the exponents of a weight tensor crowd into a few values (a trained or a random
//! layer's weights span a few powers of two; DFloat11, Zhang et al. 2025, measures about 2.6
//! bits of exponent entropy in LLM weights). So the code keeps the sign and mantissa as one
//! byte and writes the exponent as a 4-bit code: `e - base` for the 15 exponents from `base`
//! on (the window holding the most values), 15 for any other exponent, which then follows in a
//! list of escapes. 12 bits a value instead of 16, plus the escapes and a 32-bit escape count
//! per chunk of 512 values (which lets every 16 values decode apart: a GPU thread each).
//!
//! Layout of a coded tensor of `len` values (`Layout`), `padded` = `len` rounded up to a chunk,
//! each section at a multiple of 16 bytes:
//! - `sm`: `padded` bytes, value i's sign in bit 7 and mantissa in bits 0-6;
//! - `codes`: `padded / 2` bytes, value i's code in the low nibble of byte i / 2 for even i,
//!   the high nibble for odd i;
//! - `offsets`: a little-endian u32 per chunk, the escapes before the chunk;
//! - `escapes`: one exponent byte per escaped value, in value order.
//!
//! Padding values (from `len` to `padded`) are code 0 and byte 0 and are never written out.
//! `cuda/wire.cu` decodes the same layout on the GPU, bit for bit.

use crate::{Error, Result};

/// Values a chunk holds: one escape count each (a warp of 32 GPU threads, 16 values a thread).
pub const CHUNK: usize = 512;
/// The code that sends a value's exponent to the escape list.
pub const ESCAPE: u8 = 15;
/// A tensor is coded only when that saves at least this fraction of its bytes.
pub const MIN_SAVING: f64 = 0.1;

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
    /// Start of the exponent codes.
    pub codes: usize,
    /// Start of the per-chunk escape counts.
    pub offsets: usize,
    /// Start of the escaped exponents.
    pub escapes: usize,
    /// Total bytes.
    pub bytes: usize,
}

impl Layout {
    /// The layout of `len` values with `escapes` of them escaped.
    pub fn new(len: usize, escapes: usize) -> Layout {
        let padded = len.div_ceil(CHUNK) * CHUNK;
        let codes = align16(padded);
        let offsets = align16(codes + padded / 2);
        let esc = align16(offsets + 4 * (padded / CHUNK));
        Layout {
            len,
            sm: 0,
            codes,
            offsets,
            escapes: esc,
            bytes: esc + escapes,
        }
    }

    /// Values rounded up to whole chunks.
    pub fn padded(&self) -> usize {
        self.len.div_ceil(CHUNK) * CHUNK
    }

    /// Chunks (escape counts).
    pub fn chunks(&self) -> usize {
        self.padded() / CHUNK
    }
}

/// A coded bf16 tensor: its layout, the base exponent and the bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coded {
    /// Where the sections lie.
    pub layout: Layout,
    /// The exponent that code 0 stands for.
    pub base: u8,
    /// The coded bytes (`layout.bytes`).
    pub bytes: Vec<u8>,
}

/// The base exponent whose window of 15 holds the most of `bits`' exponents, and how many
/// fall outside it.
fn window(bits: &[u16]) -> (u8, usize) {
    let mut hist = [0usize; 256];
    for &b in bits {
        hist[((b >> 7) & 0xFF) as usize] += 1;
    }
    let w = ESCAPE as usize;
    let (mut best, mut held) = (0usize, 0usize);
    let mut sum: usize = hist[..w].iter().sum();
    for base in 0..=256 - w {
        if sum > held {
            (best, held) = (base, sum);
        }
        if base + w < 256 {
            sum = sum + hist[base + w] - hist[base];
        }
    }
    (best as u8, bits.len() - held)
}

/// `bits` (bf16 values as their bit patterns) coded, or `None` when that would save less than
/// `MIN_SAVING` of their bytes (exponents spread wide, or too few values).
pub fn encode(bits: &[u16]) -> Option<Coded> {
    let (base, escaped) = window(bits);
    let layout = Layout::new(bits.len(), escaped);
    if (layout.bytes as f64) > (1.0 - MIN_SAVING) * (2 * bits.len()) as f64 {
        return None;
    }
    let mut bytes = vec![0u8; layout.bytes];
    let mut esc = layout.escapes;
    for (c, chunk) in bits.chunks(CHUNK).enumerate() {
        let before = (esc - layout.escapes) as u32;
        let at = layout.offsets + 4 * c;
        bytes[at..at + 4].copy_from_slice(&before.to_le_bytes());
        for (k, &b) in chunk.iter().enumerate() {
            let i = c * CHUNK + k;
            let e = ((b >> 7) & 0xFF) as u8;
            bytes[layout.sm + i] = (((b >> 8) & 0x80) | (b & 0x7F)) as u8;
            let code = match e.checked_sub(base) {
                Some(d) if d < ESCAPE => d,
                _ => {
                    bytes[esc] = e;
                    esc += 1;
                    ESCAPE
                }
            };
            bytes[layout.codes + i / 2] |= code << (4 * (i & 1));
        }
    }
    Some(Coded {
        layout,
        base,
        bytes,
    })
}

/// Decodes `bytes` laid out as `layout` with base exponent `base` into `out` (`layout.len`
/// values), checking that the escapes the codes ask for are there.
pub fn decode(layout: &Layout, base: u8, bytes: &[u8], out: &mut [u16]) -> Result<()> {
    let bad = |what: &str| {
        Error::Stream(format!(
            "a coded bf16 tensor of {} values: {what}",
            layout.len
        ))
    };
    if bytes.len() < layout.escapes || out.len() != layout.len {
        return Err(bad("too few bytes or a wrong output length"));
    }
    let escapes = &bytes[layout.escapes..];
    for (c, chunk) in out.chunks_mut(CHUNK).enumerate() {
        let at = layout.offsets + 4 * c;
        let mut pos =
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        for (k, o) in chunk.iter_mut().enumerate() {
            let i = c * CHUNK + k;
            let code = (bytes[layout.codes + i / 2] >> (4 * (i & 1))) & 0xF;
            let e = if code == ESCAPE {
                let e = *escapes
                    .get(pos)
                    .ok_or_else(|| bad("an escape past the list"))?;
                pos += 1;
                e
            } else {
                base.wrapping_add(code)
            };
            let sm = bytes[layout.sm + i] as u16;
            *o = ((sm & 0x80) << 8) | ((e as u16) << 7) | (sm & 0x7F);
        }
    }
    Ok(())
}

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
            (511, 0.02),
            (512, 0.02),
            (513, 1e-3),
            (1000, 0.02),
            (4097, 0.1),
            (70_001, 0.02),
        ] {
            let v = values(n, scale, n as u64);
            match encode(&v) {
                Some(c) => {
                    assert_eq!(c.bytes.len(), c.layout.bytes);
                    let mut out = vec![0u16; n];
                    decode(&c.layout, c.base, &c.bytes, &mut out).unwrap();
                    assert_eq!(out, v, "{n} values");
                    // 12 bits a value and the escapes (6% of these values) once the chunk
                    // padding is amortised.
                    if n >= 65536 {
                        assert!(
                            (c.bytes.len() as f64) < 0.8 * (2 * n) as f64,
                            "{n}: {}",
                            c.bytes.len()
                        );
                    }
                }
                None => assert!(n < 1024, "{n} values not coded"),
            }
        }
    }

    #[test]
    fn wide_exponents_escape_and_still_round_trip() {
        // Exponents spread over 60 powers of two: a quarter of them fit the window.
        let v: Vec<u16> = (0..8192u32)
            .map(|i| (((60 + (i * 7) % 60) << 7) | (i & 0x7F) | ((i & 1) << 15)) as u16)
            .collect();
        // Too many escapes to save a tenth: not coded.
        assert!(encode(&v).is_none());
        // A tensor with a few wide values codes, the wide ones escaped.
        let mut w = values(8192, 0.02, 3);
        for i in (0..w.len()).step_by(101) {
            w[i] = v[i];
        }
        let c = encode(&w).unwrap();
        let mut out = vec![0u16; w.len()];
        decode(&c.layout, c.base, &c.bytes, &mut out).unwrap();
        assert_eq!(out, w);
    }

    #[test]
    fn truncated_bytes_are_an_error() {
        let v = values(4096, 0.02, 9);
        let c = encode(&v).unwrap();
        let mut out = vec![0u16; v.len()];
        let cut = &c.bytes[..c.layout.escapes + (c.layout.bytes - c.layout.escapes) / 2];
        assert!(decode(&c.layout, c.base, cut, &mut out).is_err());
        assert!(decode(&c.layout, c.base, &c.bytes, &mut out[1..]).is_err());
    }
}
