//! Int8 weights and activations for 8-bit products on integer tensor cores (`model.compute =
//! "int8"`): the scalar pieces shared by the loader (weights quantized on the host), the CPU
//! reference of the kernels (cuda/fp8.cu's int8 forms) and the tests. Packed as FP8 codes are
//! (`backend::fp8`: four codes a u32 word, the first in the low byte, one f32 scale a row;
//! `fp8::Code8::Int8` names the format).
//!
//! Symmetric, one scale a row (an output channel of a weight, a token of the activations):
//! `scale = absmax(row) / 127`, `code = round(v / scale)` to the nearest integer (ties to
//! even), clamped to [-127, 127], `v ~= code * scale`. -128 is never written, so a code's
//! negation is a code (the absmax/127 scheme of LLM.int8(), Dettmers et al. 2022). A product
//! of two such rows is exact in i32 (|sum| <= 127^2 k < 2^31 for k < 133,000), scaled by the
//! two rows' scales after.
//!
//! Int8 has no NaN or infinity: a row holding one gets a NaN scale, so every product that
//! reads the row is NaN (the E4M3 codes keep NaN in the code instead).
//!
//! A token's scale follows its largest channel, so a few massive channels (transformers
//! carry them) leave the others a few of their 127 steps. The outlier treatment rotates the
//! product's inner axis by a block Hadamard matrix first (`rotate_blocks`, as QuaRot, Ashkboos
//! et al. 2024, and musubi-tuner's ConvRot do): y = x W^T = (x H)(W H)^T for orthonormal H,
//! the weight rotated once at load and each input as it is quantized, so an outlier's
//! magnitude spreads over the block's values.

/// The largest code magnitude (symmetric int8: -128 unused).
pub const INT8_MAX: f32 = 127.0;

/// The value of a code (its byte as a two's-complement i8).
pub fn decode(code: u8) -> f32 {
    f32::from(code as i8)
}

/// The code nearest to `x` (ties to even), saturating at +-127; NaN gives 0 (the row's
/// scale carries the NaN: [`row_scale`]).
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    x.round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8 as u8
}

/// The scale of a row whose largest magnitude is `absmax` (as [`absmax_step`] folds it):
/// `absmax / 127`, 1 for an all-zero row, NaN for a row holding a NaN or an infinity.
pub fn row_scale(absmax: f32) -> f32 {
    if absmax == 0.0 {
        1.0
    } else if absmax.is_finite() {
        absmax / INT8_MAX
    } else {
        f32::NAN
    }
}

/// One step of a row's absmax that keeps a NaN (`f32::max` drops it): the kernels fold the
/// same way.
pub fn absmax_step(m: f32, v: f32) -> f32 {
    if m.is_nan() || v.is_nan() {
        f32::NAN
    } else {
        m.max(v.abs())
    }
}

/// The widest rotation block (values of a row mixed together) `rotation_block` picks.
pub const ROTATION_MAX: usize = 256;

/// The block of the Hadamard rotation for rows of `cols` values: the largest power of two
/// dividing `cols`, at most [`ROTATION_MAX`]; `None` below 16 (a rotation over so few values
/// spreads an outlier little).
pub fn rotation_block(cols: usize) -> Option<usize> {
    let b = (1usize << cols.trailing_zeros().min(8)).min(ROTATION_MAX);
    (cols > 0 && b >= 16).then_some(b)
}

/// The factor of a normalized Hadamard rotation of `block` values, 1 / sqrt(block), rounded
/// once to f32 (the kernels take this value).
pub fn rotation_scale(block: usize) -> f32 {
    (1.0 / (block as f64).sqrt()) as f32
}

/// Rotates each block of `block` values (a power of two) of `v` by the normalized Sylvester
/// Hadamard matrix H / sqrt(block), in place, in f32: log2(block) butterfly stages (a, b) ->
/// (a + b, a - b) over distances 1, 2, 4, ..., then the scale. H is symmetric and H H =
/// block I, so the rotation is its own inverse. cuda/fp8.cu's `hadamard_rows` computes the
/// same sums in the same stages (bit for bit).
pub fn rotate_blocks(v: &mut [f32], block: usize) {
    let scale = rotation_scale(block);
    for b in v.chunks_mut(block) {
        let mut h = 1;
        while h < b.len() {
            for i in (0..b.len()).step_by(2 * h) {
                for j in i..i + h {
                    let (x, y) = (b[j], b[j + h]);
                    b[j] = x + y;
                    b[j + h] = x - y;
                }
            }
            h *= 2;
        }
        for x in b.iter_mut() {
            *x *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_and_ties_go_to_even() {
        for c in 0..=255u8 {
            if c == 0x80 {
                // -128: never written; it decodes, and encodes back saturated.
                assert_eq!(decode(c), -128.0);
                assert_eq!(encode(decode(c)), (-127i8) as u8);
                continue;
            }
            assert_eq!(encode(decode(c)), c, "code {c:#x}");
        }
        assert_eq!(encode(2.5), 2);
        assert_eq!(encode(3.5), 4);
        assert_eq!(encode(-2.5), (-2i8) as u8);
        assert_eq!(encode(126.6), 127);
        assert_eq!(encode(1e9), 127);
        assert_eq!(encode(-1e9), (-127i8) as u8);
        assert_eq!(encode(f32::NAN), 0);
    }

    #[test]
    fn the_rotation_is_the_hadamard_matrix_and_its_own_inverse() {
        assert_eq!(rotation_block(3072), Some(256));
        assert_eq!(rotation_block(48), Some(16));
        assert_eq!(rotation_block(40), None);
        assert_eq!(rotation_block(0), None);
        let block = 16;
        let x: Vec<f32> = (0..2 * block).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut r = x.clone();
        rotate_blocks(&mut r, block);
        // Sylvester's H: H[i][j] = (-1)^popcount(i & j).
        for (k, chunk) in x.chunks(block).enumerate() {
            for i in 0..block {
                let want: f64 = (0..block)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * f64::from(chunk[j])
                    })
                    .sum::<f64>()
                    / (block as f64).sqrt();
                assert!((f64::from(r[k * block + i]) - want).abs() < 1e-5, "{i}");
            }
        }
        rotate_blocks(&mut r, block);
        for (a, b) in r.iter().zip(&x) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn a_row_with_a_nan_or_an_infinity_gets_a_nan_scale() {
        let fold = |v: &[f32]| v.iter().copied().fold(0f32, absmax_step);
        assert_eq!(row_scale(fold(&[0.0, -0.0])), 1.0);
        assert_eq!(row_scale(fold(&[1.0, -254.0, 3.0])), 2.0);
        assert!(row_scale(fold(&[1.0, f32::NAN, 3.0])).is_nan());
        assert!(row_scale(fold(&[f32::NAN, 1.0])).is_nan());
        assert!(row_scale(fold(&[1.0, f32::NEG_INFINITY])).is_nan());
    }
}
