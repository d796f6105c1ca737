//! Dynamic loss scaling for f16 compute. f16 keeps 5 exponent bits: gradients below 2^-24
//! flush to zero on the way back through an f16 model. The loss is multiplied by a large
//! scale before the backward, so the gradients it makes are as large; the optimizer step
//! divides them by the scale (folded into its fused update). A step whose gradients overflow
//! (a non-finite norm while the loss itself is finite) is skipped and the scale halved;
//! after `growth_interval` clean steps in a row it doubles. The rule and the defaults (init
//! 2^16, growth 2, backoff 0.5, interval 2000) are torch.cuda.amp.GradScaler's
//! (<https://pytorch.org/docs/stable/amp.html#torch.cuda.amp.GradScaler>).

/// The scale a step's gradients are overflowing at when it is this small is not the
/// scaling's doing: with the scale at 1 the gradients are the true ones, and a non-finite
/// one is reported as such (`train.on_nonfinite`).
pub const MIN_SCALE: f64 = 1.0;
/// The largest scale: past it the gradients' divisor (rounded to f32 in the step) would
/// lose its meaning, and f16's range (65504) is long exceeded.
pub const MAX_SCALE: f64 = 4294967296.0;
/// The factor the scale grows by after a run of clean steps (GradScaler's growth_factor).
pub const GROWTH: f64 = 2.0;
/// The factor the scale shrinks by after an overflow (GradScaler's backoff_factor).
pub const BACKOFF: f64 = 0.5;

/// A dynamic loss scale and its count of clean steps; saved in checkpoints so a resumed run
/// scales exactly as an uninterrupted one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    /// The factor the loss is multiplied by (a power of two times the initial scale).
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub clean_steps: usize,
    /// Clean steps in a row before the scale doubles.
    pub growth_interval: usize,
}

impl LossScaler {
    /// A scaler at `init` (>= 1) that doubles after `growth_interval` (>= 1) clean steps.
    pub fn new(init: f64, growth_interval: usize) -> Self {
        LossScaler {
            scale: init,
            clean_steps: 0,
            growth_interval: growth_interval.max(1),
        }
    }

    /// Whether an overflow at the current scale can be blamed on the scaling (the scale is
    /// above `MIN_SCALE`, so halving it may help).
    pub fn can_back_off(&self) -> bool {
        self.scale > MIN_SCALE
    }

    /// The step overflowed: halve the scale (not below `MIN_SCALE`), restart the count.
    pub fn overflowed(&mut self) {
        self.scale = (self.scale * BACKOFF).max(MIN_SCALE);
        self.clean_steps = 0;
    }

    /// A clean step: count it, and double the scale after `growth_interval` of them.
    pub fn clean(&mut self) {
        self.clean_steps += 1;
        if self.clean_steps >= self.growth_interval {
            self.scale = (self.scale * GROWTH).min(MAX_SCALE);
            self.clean_steps = 0;
        }
    }
}
