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
    fn a_row_with_a_nan_or_an_infinity_gets_a_nan_scale() {
        let fold = |v: &[f32]| v.iter().copied().fold(0f32, absmax_step);
        assert_eq!(row_scale(fold(&[0.0, -0.0])), 1.0);
        assert_eq!(row_scale(fold(&[1.0, -254.0, 3.0])), 2.0);
        assert!(row_scale(fold(&[1.0, f32::NAN, 3.0])).is_nan());
        assert!(row_scale(fold(&[f32::NAN, 1.0])).is_nan());
        assert!(row_scale(fold(&[1.0, f32::NEG_INFINITY])).is_nan());
    }
}
