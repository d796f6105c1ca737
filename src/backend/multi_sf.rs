//! Schedule-free multi-tensor steps (Defazio et al. 2024, "The Road Less Scheduled",
//! <https://arxiv.org/abs/2405.15682>): the parameters hold y, the point the gradient is
//! taken at; each parameter keeps z, the base sequence, and x, the average to evaluate and
//! save, is y moved away from z (`x = lerp(y, z, 1 - 1/beta1)`, and back
//! `y = lerp(x, z, 1 - beta1)`). Three operations over many tensors, one backend call each
//! (one launch per parameter dtype on CUDA, as `backend::multi`'s Adam):
//!
//! - [`SfOp::Lerp`]: `p = lerp(p, z, w)`, the move between y and x;
//! - [`SfOp::AdamW`]: the `schedulefree` package's `AdamWScheduleFree` step (version 1.4.1,
//!   <https://github.com/facebookresearch/schedule_free>, its `foreach` path), per value:
//!
//!   ```text
//!   g  = g * grad_scale
//!   v  = v * beta2 + (one_minus_beta2 * g) * g
//!   gn = g / (sqrt(v / bias2) + eps)              bias2 = 1 - beta2^(k+1)
//!   gn = gn + weight_decay * y                    (when weight_decay != 0: decay at y)
//!   y  = lerp(y, z, ckp1)
//!   y  = y + y_step * gn                          y_step = lr * (beta1 * (1 - ckp1) - 1)
//!   z  = z - lr * gn
//!   ```
//!
//! - [`SfOp::Prodigy`]: the core step of `prodigy-plus-schedule-free`'s
//!   `ProdigyPlusScheduleFree` (version 2.0.1, <https://github.com/LoganBooker/prodigy-plus-schedule-free>,
//!   `step_param_schedulefree` with factored, StableAdamW, bias correction and the
//!   experimental options off); see [`ProdigySfHyper`].
//!
//! `lerp(a, b, w)` is PyTorch's: `a + w * (b - a)` when |w| < 0.5, else
//! `b - (b - a) * (1 - w)`. Every operation is rounded to f32 with no fused multiply-add on
//! either backend, so the CPU and CUDA agree bit for bit.

/// The f32 scalars of one schedule-free AdamW step, the same for every parameter (the step
/// count `k` is the optimizer's, as the package's group `k`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SfAdamScalars {
    /// Every gradient is multiplied by this first.
    pub grad_scale: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `1 - beta2^(k+1)`.
    pub bias2: f32,
    /// Added to the bias-corrected root.
    pub eps: f32,
    /// Weight decay, taken at y.
    pub weight_decay: f32,
    /// The weight of z in y's interpolation, `weight / weight_sum`.
    pub ckp1: f32,
    /// `lr * (beta1 * (1 - ckp1) - 1)`.
    pub y_step: f32,
    /// The (warmed-up) learning rate.
    pub lr: f32,
}

/// PyTorch's `lerp` of f32 values (its scalar formula).
pub fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

impl SfAdamScalars {
    /// The update of one value, (y, g, v, z) -> (y', v', z'). The CPU backend's;
    /// `sf_adamw_value` in cuda/multi_tensor.cu is its twin.
    pub fn apply(&self, y: f32, g: f32, v: f32, z: f32) -> (f32, f32, f32) {
        let g = g * self.grad_scale;
        let v = v * self.beta2 + self.one_minus_beta2 * g * g;
        let denom = (v / self.bias2).sqrt() + self.eps;
        let mut gn = g / denom;
        if self.weight_decay != 0.0 {
            gn += self.weight_decay * y;
        }
        let y = lerp(y, z, self.ckp1);
        let y = y + self.y_step * gn;
        let z = z - self.lr * gn;
        (y, v, z)
    }
}

/// The slots of schedule-free Prodigy's device-resident scalar state (an f64 tensor of
/// [`PRODIGY_SF_SCALARS`] values): read by the step's pass, written by its reduction, so a
/// step needs no host round-trip.
pub mod prodigy_sf_slot {
    /// The step-size estimate d (starts at d0).
    pub const D: usize = 0;
    /// The running numerator (the package's group `d_numerator`).
    pub const D_NUMERATOR: usize = 1;
    /// The last step's denominator, the sum of |s| (`d_denom`).
    pub const D_DENOM: usize = 2;
    /// The sum of the averaging weights (dlr^2) so far (`weight_sum`).
    pub const WEIGHT_SUM: usize = 3;
    /// Steps taken, as an exact integer in f64 (the package's `k` less one).
    pub const K: usize = 4;
}

/// 2^0.25, d's largest growth a step with `d_limiter` (Python's `2 ** 0.25`).
const TWO_POW_QUARTER: f64 = 1.189207115002721;

/// Values in schedule-free Prodigy's scalar state.
pub const PRODIGY_SF_SCALARS: usize = 5;

/// Prodigy's statistics (p0 and s) are kept for every `PRODIGY_SF_SLICE`-th value of a
/// parameter (the flattened indices 0, 11, 22, ...), in bf16: the package's
/// `get_sliced_tensor(slice_p=11)` and its bf16 state.
pub const PRODIGY_SF_SLICE: usize = 11;

/// The values a parameter of `n` values keeps statistics for.
pub fn prodigy_sf_sliced(n: usize) -> usize {
    n.div_ceil(PRODIGY_SF_SLICE)
}

/// The hyperparameters of a schedule-free Prodigy step, as `ProdigyPlusScheduleFree`
/// computes it with one parameter group, `factored = False`, `use_stableadamw = False`,
/// `use_bias_correction = False`, `weight_decay_by_lr = True`, `prodigy_steps = 0`,
/// `stochastic_rounding = False` and the SPEED, cautious, grams, ADOPT, OrthoGrad and FOCUS
/// options off. From the scalar state (d, weight_sum, ...):
///
/// ```text
/// dlr = d * lr;  weight_sum' = weight_sum + dlr^2                                (f64)
/// ckp1 = weight_sum' > 0 ? dlr^2 / weight_sum' : 0
/// ckp1 = min(1, ckp1 * (1 - beta1) * schedulefree_c)      (when schedulefree_c > 0)
/// xy_step = 1 - beta1 * (1 - ckp1);  d_update = d^2 / sqrt(d0)
/// per value, in f32 (g scaled by grad_scale first):
///   v = v * beta2 + (((1 - beta2) * d^2) * g) * g
///   u = (g * d) / (sqrt(v) + d * eps)
///   every 11th value (slot q):  dot += g * (p0[q] - z)                (f64, p0 bf16)
///                               s[q] = bf16(bf16(s[q] * beta3) + d_update * g);  abs += |s[q]|
///   u = u + weight_decay * y                                     (when weight_decay != 0)
///   y = lerp(y, z, ckp1);  z = z - dlr * u;  y = y - (dlr * xy_step) * u
/// reduction, per parameter then over parameters (the package's f32 running sums):
///   numerator += f32(d_update) * f32(dot);  denominator += bf16(abs)
/// then in f64:
///   d_numerator = d_numerator * beta3 (+ numerator when d > d0 or numerator > 0)
///   d_denom = denominator
///   d_denom > 0:  d_hat = d_numerator / d_denom;  d_hat = min(d * 2^0.25, d_hat) (d_limiter)
///                 d = max(d, d_hat * d_coef)
///   weight_sum = weight_sum';  k = k + 1
/// ```
///
/// The new d applies from the next step on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigySfHyper {
    /// The multiplier of d (the package's lr).
    pub lr: f64,
    /// The interpolation's beta1.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// The decay of s and of the numerator.
    pub beta3: f64,
    /// Added to sqrt(v), times d.
    pub eps: f64,
    /// Decoupled weight decay, taken at y.
    pub weight_decay: f64,
    /// The first estimate of d.
    pub d0: f64,
    /// The multiplier of the raw estimate.
    pub d_coef: f64,
    /// Limit the raw estimate's growth to 2^0.25 a step.
    pub d_limiter: bool,
    /// Refined schedule-free averaging strength (0: off).
    pub schedulefree_c: f64,
    /// Every gradient is multiplied by this first.
    pub grad_scale: f32,
}

/// The f32 scalars of a schedule-free Prodigy step's pass, from the hyperparameters and the
/// scalar state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigySfPass {
    /// `grad_scale`.
    pub grad_scale: f32,
    /// beta2.
    pub beta2: f32,
    /// beta3.
    pub beta3: f32,
    /// `(1 - beta2) * d^2`.
    pub a_v: f32,
    /// d.
    pub d: f32,
    /// `d * eps`.
    pub eps_d: f32,
    /// `d^2 / sqrt(d0)`.
    pub d_update: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// The weight of z in y's interpolation.
    pub ckp1: f32,
    /// `d * lr`.
    pub dlr: f32,
    /// `dlr * xy_step`.
    pub y_step: f32,
}

/// Python's `max(a, b)`: `b` only when `b > a`.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Python's `min(a, b)`: `b` only when `b < a`.
fn py_min(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}

impl ProdigySfHyper {
    /// The step's weight_sum' and ckp1, in f64.
    fn averaging(&self, st: &[f64; PRODIGY_SF_SCALARS]) -> (f64, f64) {
        let dlr = st[prodigy_sf_slot::D] * self.lr;
        let weight = dlr * dlr;
        let weight_sum = st[prodigy_sf_slot::WEIGHT_SUM] + weight;
        let mut ckp1 = if weight_sum != 0.0 {
            weight / weight_sum
        } else {
            0.0
        };
        if self.schedulefree_c > 0.0 {
            ckp1 = py_min(1.0, ckp1 * (1.0 - self.beta1) * self.schedulefree_c);
        }
        (weight_sum, ckp1)
    }

    /// The pass's scalars from the state `st` (the CPU's; `prodigy_sf_scalars` in
    /// cuda/multi_tensor.cu is its twin).
    pub fn pass(&self, st: &[f64; PRODIGY_SF_SCALARS]) -> ProdigySfPass {
        let d = st[prodigy_sf_slot::D];
        let dlr = d * self.lr;
        let (_, ckp1) = self.averaging(st);
        let xy_step = 1.0 - self.beta1 * (1.0 - ckp1);
        ProdigySfPass {
            grad_scale: self.grad_scale,
            beta2: self.beta2 as f32,
            beta3: self.beta3 as f32,
            a_v: ((1.0 - self.beta2) * (d * d)) as f32,
            d: d as f32,
            eps_d: (d * self.eps) as f32,
            d_update: (d * d / self.d0.sqrt()) as f32,
            weight_decay: self.weight_decay as f32,
            ckp1: ckp1 as f32,
            dlr: dlr as f32,
            y_step: (dlr * xy_step) as f32,
        }
    }

    /// The reduction: the state after a step whose parameters' statistics summed to
    /// `numerator` and `denominator` (each already summed per parameter and rounded as the
    /// module documentation says; `prodigy_sf_reduce` in cuda/multi_tensor.cu is its twin).
    pub fn reduce(&self, st: &mut [f64; PRODIGY_SF_SCALARS], numerator: f64, denominator: f64) {
        use prodigy_sf_slot as s;
        let (weight_sum, _) = self.averaging(st);
        let d = st[s::D];
        // The package's running sums are f32 tensors read with .item().
        let num = numerator as f32 as f64;
        let den = denominator as f32 as f64;
        let mut d_numerator = st[s::D_NUMERATOR] * self.beta3;
        if d > self.d0 || num > 0.0 {
            d_numerator += num;
        }
        let mut d_new = d;
        if den > 0.0 {
            let mut d_hat = d_numerator / den;
            if self.d_limiter {
                d_hat = py_min(d * TWO_POW_QUARTER, d_hat);
            }
            d_new = py_max(d, d_hat * self.d_coef);
        }
        st[s::D] = d_new;
        st[s::D_NUMERATOR] = d_numerator;
        st[s::D_DENOM] = den;
        st[s::WEIGHT_SUM] = weight_sum;
        st[s::K] += 1.0;
    }
}

impl ProdigySfPass {
    /// The step of one value, (y, g, v, z) -> (y', v', z'); a sliced value's statistics
    /// come from [`ProdigySfPass::stats`] with z before the step.
    pub fn apply(&self, y: f32, g: f32, v: f32, z: f32) -> (f32, f32, f32) {
        let g = g * self.grad_scale;
        let v = v * self.beta2 + self.a_v * g * g;
        let mut u = (g * self.d) / (v.sqrt() + self.eps_d);
        if self.weight_decay != 0.0 {
            u += self.weight_decay * y;
        }
        let y = lerp(y, z, self.ckp1);
        let z_new = z - self.dlr * u;
        let y = y - self.y_step * u;
        (y, v, z_new)
    }

    /// The statistics of a sliced value: from the value's gradient g (unscaled), z before
    /// the step, and its p0 and s (bf16 values as f32), the new s (rounded to bf16) and the
    /// dot term g * (p0 - z).
    pub fn stats(&self, g: f32, z: f32, p0: f32, s: f32) -> (half::bf16, f64) {
        let g = g * self.grad_scale;
        let x0 = p0 - z;
        let s = half::bf16::from_f32(s * self.beta3).to_f32();
        let s = half::bf16::from_f32(s + self.d_update * g);
        (s, g as f64 * x0 as f64)
    }

    /// A parameter's numerator and denominator terms from its f64 sums.
    pub fn item_terms(&self, dot: f64, abs: f64) -> (f64, f64) {
        let num = self.d_update * dot as f32;
        let den = half::bf16::from_f32(abs as f32).to_f32();
        (num as f64, den as f64)
    }
}

/// What a schedule-free call does to its items.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SfOp {
    /// `p = lerp(p, z, w)`: items need p and z only.
    Lerp(f32),
    /// A schedule-free AdamW step: items need p, g, v and z.
    AdamW(SfAdamScalars),
    /// A schedule-free Prodigy step: items need p, g, v, z and s (p0 absent for a parameter
    /// that started at zero), with the scalar state.
    Prodigy(ProdigySfHyper),
}

/// One parameter of a schedule-free call: `n` contiguous values of `p` from `p_offset`
/// (f32, bf16 or f16); its gradient (same dtype, from `g_offset`); its f32 state (v, z) of
/// `n` values and Prodigy's bf16 s and p0 of `prodigy_sf_sliced(n)` values, dense from 0.
pub struct SfItem<'a, S> {
    /// The parameter's buffer, written in place.
    pub p: &'a mut S,
    /// Where the parameter starts in `p`.
    pub p_offset: usize,
    /// Values of the parameter.
    pub n: usize,
    /// The gradient's buffer (absent for `Lerp`).
    pub g: Option<&'a S>,
    /// Where the gradient starts in `g`.
    pub g_offset: usize,
    /// The second moment (absent for `Lerp`).
    pub v: Option<&'a mut S>,
    /// The base sequence z.
    pub z: &'a mut S,
    /// Prodigy's running s (bf16, sliced).
    pub s: Option<&'a mut S>,
    /// Prodigy's first values (bf16, sliced; absent: all zeros).
    pub p0: Option<&'a S>,
}

impl<'a, S> SfItem<'a, S> {
    /// The same item over other views of its buffers.
    pub(crate) fn map<'b, T>(
        &'b mut self,
        fm: impl Fn(&'b mut S) -> crate::Result<&'b mut T>,
        fr: impl Fn(&'b S) -> crate::Result<&'b T>,
    ) -> crate::Result<SfItem<'b, T>> {
        Ok(SfItem {
            p: fm(self.p)?,
            p_offset: self.p_offset,
            n: self.n,
            g: self.g.map(&fr).transpose()?,
            g_offset: self.g_offset,
            v: match &mut self.v {
                Some(v) => Some(fm(v)?),
                None => None,
            },
            z: fm(self.z)?,
            s: match &mut self.s {
                Some(s) => Some(fm(s)?),
                None => None,
            },
            p0: self.p0.map(&fr).transpose()?,
        })
    }
}
