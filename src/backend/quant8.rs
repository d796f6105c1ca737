//! Block-wise 8-bit dynamic quantization (Dettmers, Lewis, Shleifer & Zettlemoyer 2022,
//! "8-bit Optimizers via Block-wise Quantization", <https://arxiv.org/abs/2110.02861>), the
//! scalar pieces shared by the CPU backend, the optimizer and the tests. The CUDA kernel
//! (cuda/multi_tensor.cu) repeats `nearest_code` and the packing line for line, and receives the
//! maps below as an operand, so both backends quantize with the same table.
//!
//! Layout: a state tensor of `n` values is cut into blocks of [`BLOCK`] = 256 consecutive
//! values. Each block keeps one f32 `absmax` (the largest |value| in it) and 256 one-byte
//! codes, `value ~= map[code] * absmax`. FLAME has no u8 dtype, so the codes of a block are
//! packed four to a u32, little end first: code `j` of block `b` is bits `8 (j % 4)` of word
//! `b * 64 + j / 4`. A tensor of `n` values thus keeps `blocks = ceil(n / 256)` absmax values
//! (F32, shape `(blocks,)`) and `blocks * 64` words (U32, shape `(blocks, 64)`); the codes of
//! the last block past `n` hold the code of 0.

/// Values per quantization block (bitsandbytes' block size for its 8-bit optimizers).
pub const BLOCK: usize = 256;

/// u32 words of packed codes per block.
pub const WORDS_PER_BLOCK: usize = BLOCK / 4;

/// Blocks for `n` values.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// The dynamic quantization map of bitsandbytes' `create_dynamic_map(signed, max_exponent_bits
/// = 7, total_bits = 8)` (bitsandbytes/functional.py, after Dettmers 2016, "8-Bit
/// Approximations for Parallelism in Deep Learning", <https://arxiv.org/abs/1511.04561>),
/// derived here from its definition, sorted ascending:
///
/// for each decade `i = 0..7`, `k = 2^i` (signed) or `2^(i+1)` (unsigned) values
/// `10^(i-6) * (b_j + b_{j+1}) / 2` where `b` = `k + 1` evenly spaced points from 0.1 to 1
/// (the midpoints of `k` equal steps of [0.1, 1] scaled to the decade), their negatives when
/// signed; then 0 and 1.
///
/// Signed: 127 positive values from 5.5e-7 (`10^-6 * 0.55`) to 0.99297 (= 1 - 0.9 / 128),
/// their 127 negatives, 0 and 1 (there is no -1: a block whose largest magnitude is negative
/// keeps it as -0.99297 absmax, as in bitsandbytes). Unsigned: 254 positive values from
/// 3.25e-7 to 0.99648, 0 and 1. The midpoints are computed in f64 and rounded once to f32;
/// bitsandbytes computes them in f32 with torch.linspace, so an entry may differ from its table
/// in the last bit (the codes are a format of this crate, not read from bitsandbytes files).
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let k = if signed {
            1usize << i
        } else {
            1usize << (i + 1)
        };
        let scale = 10f64.powi(i - 6);
        for j in 0..k {
            // Midpoint of step j of k equal steps of [0.1, 1].
            let lo = 0.1 + 0.9 * j as f64 / k as f64;
            let hi = 0.1 + 0.9 * (j + 1) as f64 / k as f64;
            let v = scale * (lo + hi) / 2.0;
            data.push(v);
            if signed {
                data.push(-v);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    let mut map = [0f32; 256];
    for (m, d) in map.iter_mut().zip(&data) {
        *m = *d as f32;
    }
    // 256 distinct finite values, so the order is total.
    map.sort_by(f32::total_cmp);
    map
}

/// The index of the map entry nearest to `x` (`map` sorted ascending, 256 entries): a binary
/// search for the last entry `<= x` (entry 0 when none is), then the nearer of it and the
/// next, the lower on a tie. bitsandbytes' `dQuantize` searches the same way. A NaN `x` gives
/// code 0 (every comparison is false), on both backends.
pub fn nearest_code(map: &[f32; 256], x: f32) -> u8 {
    let mut lo = 0usize;
    let mut step = 128usize;
    while step > 0 {
        if map[lo + step] <= x {
            lo += step;
        }
        step /= 2;
    }
    if lo < 255 && (map[lo + 1] - x) < (x - map[lo]) {
        lo += 1;
    }
    lo as u8
}

/// The code of 0 in `map`.
pub fn zero_code(map: &[f32; 256]) -> u8 {
    nearest_code(map, 0.0)
}

/// `code` repeated in the four bytes of a word: the packed codes of four zeros.
pub fn splat(code: u8) -> u32 {
    u32::from_le_bytes([code; 4])
}

/// Code `j` of a block's packed words.
pub fn unpack(words: &[u32], j: usize) -> u8 {
    words.get(j / 4).map_or(0, |w| (w >> (8 * (j % 4))) as u8)
}

/// Quantizes one block of at most [`BLOCK`] values into its packed words (the values past
/// `vals.len()` get the code of 0) and returns its absmax. `x / absmax` is a correctly
/// rounded division, so it lies in [-1, 1]; a block of zeros gets absmax 0 and the code of 0.
pub fn quantize_block(map: &[f32; 256], vals: &[f32], words: &mut [u32]) -> f32 {
    let absmax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
    let zero = zero_code(map);
    for (w, word) in words.iter_mut().enumerate() {
        let mut bytes = [zero; 4];
        for (k, b) in bytes.iter_mut().enumerate() {
            if let Some(&v) = vals.get(4 * w + k) {
                let x = if absmax > 0.0 { v / absmax } else { 0.0 };
                *b = nearest_code(map, x);
            }
        }
        *word = u32::from_le_bytes(bytes);
    }
    absmax
}

/// The values of one block: `map[code] * absmax` for each of `out`.
pub fn dequantize_block(map: &[f32; 256], words: &[u32], absmax: f32, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = map[usize::from(unpack(words, j))] * absmax;
    }
}

/// Quantizes `vals` block by block: (packed words, `blocks * 64`; absmax, one per block).
pub fn quantize_blockwise(map: &[f32; 256], vals: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let nb = blocks(vals.len());
    let mut words = vec![0u32; nb * WORDS_PER_BLOCK];
    let absmax = vals
        .chunks(BLOCK)
        .zip(words.chunks_mut(WORDS_PER_BLOCK))
        .map(|(v, w)| quantize_block(map, v, w))
        .collect();
    (words, absmax)
}

/// The `n` values of `quantize_blockwise`'s output.
pub fn dequantize_blockwise(map: &[f32; 256], words: &[u32], absmax: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    for ((o, w), a) in out
        .chunks_mut(BLOCK)
        .zip(words.chunks(WORDS_PER_BLOCK))
        .zip(absmax)
    {
        dequantize_block(map, w, *a, o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_have_the_documented_shape() {
        let s = dynamic_map(true);
        let u = dynamic_map(false);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert!(u.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((s[0], s[127], s[255]), (-0.99296875, 0.0, 1.0));
        assert_eq!((u[0], u[255]), (0.0, 1.0));
        assert_eq!(zero_code(&s), 127);
        assert_eq!(zero_code(&u), 0);
        assert_eq!(s[128], 5.5e-7);
    }

    #[test]
    fn nearest_code_is_nearest() {
        let s = dynamic_map(true);
        for i in 0..=2000 {
            let x = -1.0 + i as f32 / 1000.0;
            let c = usize::from(nearest_code(&s, x));
            let best = s
                .iter()
                .map(|m| (m - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((s[c] - x).abs(), best, "x = {x}");
        }
    }
}
