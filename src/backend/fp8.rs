//! FP8 E4M3 weights: the format of frozen base weights stored in 8 bits (`model.dtype =
//! "fp8"`), the scalar pieces shared by the loader (quantization on the host), the CPU
//! backend's dequantization and the tests. cuda/fp8.cu decodes with the same bit rules.
//!
//! E4M3 is the OCP 8-bit float ("OCP 8-bit Floating Point Specification (OFP8)", 2023;
//! PyTorch's `float8_e4m3fn`, safetensors' `F8_E4M3`): 1 sign bit, 4 exponent bits with bias
//! 7, 3 mantissa bits; no infinities, `S.1111.111` is NaN, so the largest finite value is
//! 1.75 * 2^8 = 448; subnormals are `0.mmm * 2^-6`. Every E4M3 value is exact in f32.
//!
//! A weight (rows, cols) keeps one f32 scale per row (per output channel of a Linear) and one
//! code per value, `w ~= decode(code) * scale[row]`, `scale = absmax(row) / 448` (1 for an
//! all-zero row). FLAME has no u8 dtype, so the codes are packed four to a u32, little end
//! first: code `c` of a row is bits `8 (c % 4)` of word `c / 4` of that row, which needs
//! `cols % 4 == 0` (layers of other widths stay in the compute dtype).
//!
//! The same packing holds int8 codes (`backend::int8`, `model.compute = "int8"`): [`Code8`]
//! names which of the two a packed weight's bytes are.

/// The largest finite E4M3 value (OCP OFP8 spec, E4M3 max normal 1.75 * 2^8).
pub const E4M3_MAX: f32 = 448.0;

/// Codes per packed u32 word.
pub const CODES_PER_WORD: usize = 4;

/// Which 8-bit code a packed weight's bytes (and its products' activations) are: four a u32
/// word, one f32 scale a row, `value = decode(code) * scale` either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Code8 {
    /// FP8 E4M3 (this module): tensor-core products on Ada and Hopper.
    #[default]
    E4m3,
    /// Symmetric int8 (`backend::int8`): tensor-core products from Turing on.
    Int8,
}

/// What a quantizing pass computes from its input before it quantizes: the producers whose
/// outputs feed 8-bit products, fused so the activations are not read a second time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Produce {
    /// adaLN modulation `x (1 + scale) + shift`, shift and scale one row a batch.
    Modulate,
    /// GELU's tanh form.
    GeluTanh,
}

impl Code8 {
    /// Its name in messages and configs ("fp8", "int8").
    pub fn name(self) -> &'static str {
        match self {
            Code8::E4m3 => "fp8",
            Code8::Int8 => "int8",
        }
    }

    /// The value of `code` (before the row's scale).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Code8::E4m3 => decode(code),
            Code8::Int8 => super::int8::decode(code),
        }
    }

    /// The code nearest to `x` (already divided by the row's scale).
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Code8::E4m3 => encode(x),
            Code8::Int8 => super::int8::encode(x),
        }
    }

    /// The scale of a row whose largest magnitude is `absmax`.
    pub fn row_scale(self, absmax: f32) -> f32 {
        match self {
            Code8::E4m3 => row_scale(absmax),
            Code8::Int8 => super::int8::row_scale(absmax),
        }
    }

    /// The largest magnitude of a row, as the quantization takes it: E4M3's ignores NaN
    /// values (they keep their own NaN code), int8's is NaN when one is (int8 has no NaN
    /// code: the row's NaN scale carries it into the product).
    pub fn absmax(self, values: impl Iterator<Item = f32>) -> f32 {
        match self {
            Code8::E4m3 => values.fold(0f32, |m, v| m.max(v.abs())),
            Code8::Int8 => values.fold(0f32, super::int8::absmax_step),
        }
    }

    /// The smallest compute capability whose tensor cores multiply these codes: 8.9 (Ada,
    /// Hopper) for E4M3, 7.5 (Turing on) for int8.
    pub fn min_compute_capability(self) -> (u32, u32) {
        match self {
            Code8::E4m3 => (8, 9),
            Code8::Int8 => (7, 5),
        }
    }
}

/// The value of an E4M3 code (NaN for 0x7F and 0xFF).
pub fn decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0x0F);
    let man = f32::from(code & 0x07);
    if exp == 0x0F && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        // Subnormal: 0.mmm * 2^(1 - 7).
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The E4M3 code nearest to `x` (ties to the even code), saturating at +-448; NaN gives the
/// NaN code 0x7F. This is the rounding of PyTorch's `float8_e4m3fn` cast for values inside
/// the range (which the per-row scale guarantees); out-of-range values saturate instead of
/// becoming NaN.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    if exp < -6 {
        // Below the smallest normal 2^-6: multiples of 2^-9. a * 512 is exact (a power of
        // two), and rounding it to an integer (ties to even) picks the nearest code; 8
        // rounds up into the first normal code 0x08.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: the exponent rebiased to 7 over the top 3 of f32's 23 mantissa bits, rounded
    // to nearest even on the 20 bits dropped (a carry moves into the exponent, as it should).
    let man = bits & 0x7F_FFFF;
    let mut code = (((exp + 7) as u32) << 3) | (man >> 20);
    let rest = man & 0xF_FFFF;
    const HALF: u32 = 0x8_0000;
    if rest > HALF || (rest == HALF && code & 1 == 1) {
        code += 1;
    }
    sign | code.min(0x7E) as u8
}

/// The per-row scale of a row whose largest magnitude is `absmax`.
pub fn row_scale(absmax: f32) -> f32 {
    if absmax > 0.0 && absmax.is_finite() {
        absmax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantizes `w` (rows, cols) row by row: (codes packed (rows, cols / 4) u32, scales (rows)
/// f32). `cols` must be a multiple of 4 (`Err` names the width otherwise). A non-finite
/// value is an error naming its row and column: a NaN weight would otherwise become a
/// silent NaN code.
pub fn quantize_rows(
    w: &[f32],
    rows: usize,
    cols: usize,
) -> std::result::Result<(Vec<u32>, Vec<f32>), String> {
    quantize_rows_as(Code8::E4m3, w, rows, cols)
}

/// [`quantize_rows`] into `code`: `scale = code.row_scale(absmax(row))`, each value's code
/// `code.encode(v / scale)`.
pub fn quantize_rows_as(
    code: Code8,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> std::result::Result<(Vec<u32>, Vec<f32>), String> {
    use rayon::prelude::*;
    if cols % CODES_PER_WORD != 0 || w.len() != rows * cols {
        return Err(format!(
            "{} needs (rows, cols) with cols a multiple of 4, got {} values as ({rows}, {cols})",
            code.name(),
            w.len()
        ));
    }
    // The first row holding a non-finite value, looked for on the host's cores (Flux-dev's
    // 12B values took seconds on one).
    let bad = w
        .par_chunks(cols.max(1))
        .position_first(|row| row.iter().any(|v| !v.is_finite()));
    if let Some(r) = bad {
        let c = w[r * cols..]
            .iter()
            .position(|v| !v.is_finite())
            .unwrap_or(0);
        return Err(format!(
            "value {} at row {r}, column {c} is not finite",
            w[r * cols + c]
        ));
    }
    let words = cols / CODES_PER_WORD;
    let mut codes = vec![0u32; rows * words];
    let mut scales = vec![0f32; rows];
    codes
        .par_chunks_mut(words.max(1))
        .zip(scales.par_iter_mut())
        .zip(w.par_chunks(cols.max(1)))
        .for_each(|((c, s), row)| {
            *s = code.row_scale(code.absmax(row.iter().copied()));
            for (word, vals) in c.iter_mut().zip(row.chunks(CODES_PER_WORD)) {
                *word = pack(vals.iter().map(|v| code.encode(v / *s)));
            }
        });
    Ok((codes, scales))
}

/// The values of packed codes (rows, cols / 4) with one scale a row, row after row:
/// `code.decode(c) * scale[row]` in f32, each product rounded once (the inverse of
/// [`quantize_rows_as`] up to its rounding; cuda/fp8.cu's decode computes the same bits).
/// `scales` holds one value per row of `codes`.
pub fn dequantize_rows_as(code: Code8, codes: &[u32], scales: &[f32], cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let table: Vec<f32> = (0..=255u8).map(|c| code.decode(c)).collect();
    let words = cols / CODES_PER_WORD;
    let mut out = vec![0f32; scales.len() * cols];
    out.par_chunks_mut(cols.max(1))
        .zip(scales.par_iter())
        .enumerate()
        .for_each(|(r, (row, &s))| {
            for (c, v) in row.iter_mut().enumerate() {
                let word = codes[r * words + c / CODES_PER_WORD];
                *v = table[usize::from(unpack(word, c % CODES_PER_WORD))] * s;
            }
        });
    out
}

/// Four codes into one word, the first in the low byte.
pub fn pack(codes: impl Iterator<Item = u8>) -> u32 {
    codes
        .take(CODES_PER_WORD)
        .enumerate()
        .fold(0u32, |w, (i, c)| w | (u32::from(c) << (8 * i)))
}

/// Code `j` (0..4) of a packed word.
pub fn unpack(word: u32, j: usize) -> u8 {
    (word >> (8 * j)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_encode_round_trip_every_finite_code() {
        for c in 0..=255u8 {
            let v = decode(c);
            if v.is_nan() {
                assert!(c & 0x7F == 0x7F);
                continue;
            }
            // -0 encodes to 0x80, +0 to 0.
            assert_eq!(encode(v), c, "code {c:#x} value {v}");
        }
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x38), 1.0);
    }

    /// The nearest code by search over the decoded values (ties to the even code).
    fn encode_by_search(x: f32) -> u8 {
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs().min(E4M3_MAX);
        let mut best = 0u8;
        for c in 0..=0x7Eu8 {
            let (d, db) = ((decode(c) - a).abs(), (decode(best) - a).abs());
            if d < db || (d == db && c & 1 == 0) {
                best = c;
            }
        }
        sign | best
    }

    #[test]
    fn encode_matches_a_search_of_the_table() {
        // Every code's value, the midpoints between neighbours (ties), and values around them.
        let mut xs = vec![0.0f32, 1e-30, 3e-3, 0.3, 447.9, 448.0, 500.0];
        for c in 0..0x7Eu8 {
            let (lo, hi) = (decode(c), decode(c + 1));
            let mid = (lo + hi) / 2.0;
            xs.extend([lo, mid, mid * (1.0 + 1e-6), mid * (1.0 - 1e-6), hi]);
        }
        for x in xs {
            for v in [x, -x] {
                assert_eq!(encode(v), encode_by_search(v), "x = {v:e}");
            }
        }
    }

    #[test]
    fn encode_rounds_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code 0x38.
        assert_eq!(encode(1.0625), 0x38);
        assert_eq!(encode(1.07), 0x39);
        // Between 1.125 (0x39) and 1.25 (0x3A): the midpoint goes to 0x3A.
        assert_eq!(encode(1.1875), 0x3A);
        assert_eq!(encode(1000.0), 0x7E);
        assert_eq!(encode(-1000.0), 0xFE);
        assert_eq!(encode(f32::NAN), 0x7F);
    }
}
