//! Adafactor's multi-tensor step (Shazeer & Stern 2018, in transformers 5's
//! `transformers.optimization.Adafactor` form; `optim::adafactor` holds the composite twin
//! that is its reference). One step over every item, the values of one parameter being `p`,
//! `g`, the first moment `m` (with beta1), and either the factored second moments `R`
//! (B, rows) and `C` (B, cols) of a parameter seen as B matrices of (rows, cols), or the full
//! one `V` (N):
//!
//! ```text
//! per value, f32:     g = g * grad_scale;  u = g * g + eps1
//! factored, per line: R[b, i] = beta2t R + omb2t (f32)(sum_j u[b, i, j] / cols)    (f64 sum)
//!                     C[b, j] = beta2t C + omb2t (f32)(sum_i u[b, i, j] / rows)
//!                     rmean[b] = (f32)(sum_i R[b, i] / rows)                         (f64 sum)
//! per value, f32:     x = ((1 / sqrt(R / rmean)) * (1 / sqrt(C))) * g                (factored)
//!                     V = beta2t V + omb2t u;  x = (1 / sqrt(V)) * g                 (full)
//! per parameter, f64: lr_t = rel * (scale_parameter ? max(eps2, sqrt(sum p^2 / N)) : 1)
//!                     clip = max(sqrt(sum x^2 / N) / clip_threshold, 1)
//!                     k = (f32)(lr_t / clip);  decay = (f32)(-weight_decay * lr_t)
//! per value, f32:     x = x * k;  beta1: m = beta1 m + omb1 x, x = m
//!                     p = p + decay * p  (when decay != 0);  p = p - x
//! ```
//!
//! `rel` (the relative step), `beta2t = 1 - t^decay_rate` and `omb2t = 1 - beta2t` depend on
//! the parameter's own step count only, so the host works them out; `lr_t`, which holds the
//! parameter's RMS, and the clipping are computed where the values are, with no read-back.
//!
//! Sums are in f64 in a fixed order that the CUDA kernels (cuda/multi_tensor.cu) take too: a
//! line (a row or a column of one matrix, or one batch's R) is summed in [`AF_LANES`] strided
//! lane sums added in lane order; the sums of `p^2` and `x^2` per chunk of [`AF_CHUNK`]
//! values in [`AF_THREADS`] strided thread sums added in thread order, and a parameter's
//! chunks in chunk order. Every f32 operation is rounded once, with no fused multiply-add,
//! so the CPU reference and CUDA agree bit for bit.

/// Values per chunk of the update passes (the kernels' AF_CHUNK).
pub const AF_CHUNK: usize = 4096;
/// Threads per chunk (MT_THREADS): each sums its strided values of a chunk.
pub const AF_THREADS: usize = 256;
/// Lanes per line of the factored sums (a warp).
pub const AF_LANES: usize = 32;

/// The sum of `f(j)` for j in 0..n in the kernels' order: `lanes` strided sums (lane l takes
/// l, l + lanes, ...), then those in lane order.
pub fn ordered_sum(n: usize, lanes: usize, f: impl Fn(usize) -> f64) -> f64 {
    let mut total = 0.0;
    for t in 0..lanes {
        let mut s = 0.0;
        let mut j = t;
        while j < n {
            s += f(j);
            j += lanes;
        }
        total = if t == 0 { s } else { total + s };
    }
    total
}

/// The scalars an Adafactor step shares across its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorHyper {
    /// Added to the squared gradient.
    pub eps1: f32,
    /// The least parameter scale.
    pub eps2: f64,
    /// The update's RMS is clipped to this (> 0).
    pub clip_threshold: f64,
    /// The first moment's decay (None: no first moment).
    pub beta1: Option<f32>,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// Decoupled weight decay (times lr_t).
    pub weight_decay: f64,
    /// Scale the step by the parameter's RMS.
    pub scale_parameter: bool,
    /// Every gradient is multiplied by this first (1: as given).
    pub grad_scale: f32,
}

/// The host's scalars of one parameter's step `t`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorStep {
    /// The step size before the parameter scale (transformers' `rel_step_sz`).
    pub rel: f64,
    /// `1 - t^decay_rate`, rounded to f32.
    pub beta2t: f32,
    /// `1 - beta2t` (worked out in f64), rounded to f32.
    pub one_minus_beta2t: f32,
}

impl AdafactorHyper {
    /// The gradient as the step sees it, and `u = g^2 + eps1`.
    pub fn grad_u(&self, g: f32) -> (f32, f32) {
        let g = g * self.grad_scale;
        (g, g * g + self.eps1)
    }

    /// A parameter's multiplier `k` of the update and its weight decay, from its sums of
    /// `p^2` and `x^2` over `n` values (the CPU's; `af_scalars` in cuda/multi_tensor.cu is
    /// its twin).
    pub fn scalars(&self, s: &AdafactorStep, n: usize, sum_p2: f64, sum_x2: f64) -> (f32, f32) {
        let n = n as f64;
        let mut lr_t = s.rel;
        if self.scale_parameter {
            let rms = (sum_p2 / n).sqrt();
            lr_t *= if rms > self.eps2 { rms } else { self.eps2 };
        }
        let r = (sum_x2 / n).sqrt() / self.clip_threshold;
        let clip = if r > 1.0 { r } else { 1.0 };
        ((lr_t / clip) as f32, (-self.weight_decay * lr_t) as f32)
    }

    /// The last pass over one value: (p, x, m) -> (p', m') with the parameter's `k` and
    /// `decay`; `m` is ignored without a first moment.
    pub fn apply(&self, k: f32, decay: f32, p: f32, x: f32, m: f32) -> (f32, f32) {
        let mut x = x * k;
        let mut m = m;
        if let Some(b1) = self.beta1 {
            m = b1 * m + self.one_minus_beta1 * x;
            x = m;
        }
        let p = if decay != 0.0 { p + decay * p } else { p };
        (p - x, m)
    }
}

/// An exponential average's step in f32: `beta * prev + omb * x`.
pub fn decayed(beta: f32, omb: f32, prev: f32, x: f32) -> f32 {
    beta * prev + omb * x
}

/// The factored update of one value from its gradient `g`, row moment `r`, the row
/// moments' mean `rmean` and column moment `c`.
pub fn factored_x(g: f32, r: f32, rmean: f32, c: f32) -> f32 {
    let rf = 1.0 / (r / rmean).sqrt();
    let cf = 1.0 / c.sqrt();
    (rf * cf) * g
}

/// The full update of one value from its gradient and its (updated) second moment.
pub fn full_x(g: f32, v: f32) -> f32 {
    (1.0 / v.sqrt()) * g
}

/// A parameter's second moments, updated in place (f32, dense from offset 0).
pub enum AdafactorMoment<'a, S> {
    /// The parameter is B = N / (rows * cols) matrices of (rows, cols): R of (B, rows)
    /// values and C of (B, cols).
    Factored {
        /// Row means.
        row: &'a mut S,
        /// Column means.
        col: &'a mut S,
        /// The second to last dim.
        rows: usize,
        /// The last dim.
        cols: usize,
    },
    /// V of the parameter's N values.
    Full(&'a mut S),
}

/// One parameter of a multi-tensor Adafactor step: `n` contiguous values of `p` from
/// `p_offset` (f32, bf16 or f16), its gradient (same dtype, contiguous from `g_offset`), its
/// f32 state and its step's scalars.
pub struct AdafactorItem<'a, S> {
    /// The parameter's buffer, written in place.
    pub p: &'a mut S,
    /// Where the parameter starts in `p`.
    pub p_offset: usize,
    /// Values of the parameter.
    pub n: usize,
    /// The gradient's buffer.
    pub g: &'a S,
    /// Where the gradient starts in `g`.
    pub g_offset: usize,
    /// The first moment (with beta1), of `n` values.
    pub m: Option<&'a mut S>,
    /// The second moments.
    pub v: AdafactorMoment<'a, S>,
    /// The step's scalars.
    pub step: AdafactorStep,
}

impl<'a, S> AdafactorItem<'a, S> {
    /// The same item over other views of its buffers.
    pub(crate) fn map<'b, T>(
        &'b mut self,
        fm: impl Fn(&'b mut S) -> crate::Result<&'b mut T>,
        fr: impl Fn(&'b S) -> crate::Result<&'b T>,
    ) -> crate::Result<AdafactorItem<'b, T>> {
        let v = match &mut self.v {
            AdafactorMoment::Factored {
                row,
                col,
                rows,
                cols,
            } => AdafactorMoment::Factored {
                rows: *rows,
                cols: *cols,
                row: fm(row)?,
                col: fm(col)?,
            },
            AdafactorMoment::Full(v) => AdafactorMoment::Full(fm(v)?),
        };
        Ok(AdafactorItem {
            p: fm(self.p)?,
            p_offset: self.p_offset,
            n: self.n,
            g: fr(self.g)?,
            g_offset: self.g_offset,
            m: match &mut self.m {
                Some(m) => Some(fm(m)?),
                None => None,
            },
            v,
            step: self.step,
        })
    }
}
