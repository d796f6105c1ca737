//! Multi-tensor ops: one pass over many tensors, one kernel launch per call on CUDA (the
//! optimizer step and the gradient norm of a LoRA with a thousand parameters were a dozen
//! launches per parameter). The idea is apex's and PyTorch's `_foreach`/`_fused_adamw`: the
//! launcher uploads a table of the tensors (addresses, sizes, first chunk), each thread
//! block finds its tensor by binary search over the first chunks and works on one chunk.
//!
//! The Adam update of one value, in f32, each operation rounded to f32 and no fused
//! multiply-add (on either backend, so the CPU and CUDA agree bit for bit):
//!
//! ```text
//! g = g * grad_scale                  (unscaling of a scaled loss, clipping)
//! g = g + l2 * p                      (Adam's L2 penalty; skipped when l2 = 0)
//! p = p * decay                       (AdamW's decoupled decay, 1 - lr * weight_decay)
//! m = beta1 * m + one_minus_beta1 * g
//! v = beta2 * v + one_minus_beta2 * (g * g)
//! p = p - step_size * (m / (sqrt(v) / bias2_sqrt + eps))
//! ```
//!
//! with `step_size = lr / (1 - beta1^t)` and `bias2_sqrt = sqrt(1 - beta2^t)` per tensor
//! (its own step count `t`), worked out in f64 and rounded once (Kingma & Ba 2015,
//! Algorithm 1, in torch.optim.AdamW's form with eps after the bias-corrected root).

/// The scalars an Adam step shares across a group of parameters, rounded to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Decay rate of the first moment.
    pub beta1: f32,
    /// Decay rate of the second moment.
    pub beta2: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// Added to the bias-corrected sqrt(v).
    pub eps: f32,
    /// `1 - lr * weight_decay` for AdamW's decoupled decay, 1 for Adam.
    pub decay: f32,
    /// Adam's L2 penalty (added to the gradient), 0 for AdamW.
    pub l2: f32,
    /// Every gradient is multiplied by this first (1: as given).
    pub grad_scale: f32,
}

/// The bias-corrected scalars of one parameter's step `t`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamBias {
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias2_sqrt: f32,
}

impl AdamHyper {
    /// The update of one value, (p, g, m, v) -> (p', m', v'), in the order of the module
    /// documentation. The CPU backend's; `adam_value` in cuda/multi_tensor.cu is its twin.
    pub fn apply(&self, b: AdamBias, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let mut g = g * self.grad_scale;
        if self.l2 != 0.0 {
            g += self.l2 * p;
        }
        let p = p * self.decay;
        let m = self.beta1 * m + self.one_minus_beta1 * g;
        let v = self.beta2 * v + self.one_minus_beta2 * (g * g);
        let denom = v.sqrt() / b.bias2_sqrt + self.eps;
        (p - b.step_size * (m / denom), m, v)
    }
}

/// The moments of one parameter, updated in place.
pub enum AdamMoments<'a, S> {
    /// f32 moments of the parameter's size (dense, from offset 0).
    Full {
        /// First moment.
        m: &'a mut S,
        /// Second moment.
        v: &'a mut S,
    },
    /// Block-wise 8-bit moments as `quant8` describes: (blocks, 64) u32 codes and (blocks)
    /// f32 maxima each (dense, from offset 0).
    Quantized {
        /// First moment's codes.
        m_codes: &'a mut S,
        /// First moment's block maxima.
        m_absmax: &'a mut S,
        /// Second moment's codes.
        v_codes: &'a mut S,
        /// Second moment's block maxima.
        v_absmax: &'a mut S,
    },
}

/// One parameter of a multi-tensor Adam step: `n` contiguous values of `p` from `p_offset`
/// (f32, bf16 or f16), its gradient (same dtype, contiguous from `g_offset`), its moments and
/// its bias corrections.
pub struct AdamItem<'a, S> {
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
    /// Its moments.
    pub moments: AdamMoments<'a, S>,
    /// Its step's bias corrections.
    pub bias: AdamBias,
}

/// One tensor of a multi-tensor reduction: `n` contiguous values from `offset`.
pub struct MultiRef<'a, S> {
    /// The buffer.
    pub s: &'a S,
    /// Where the values start.
    pub offset: usize,
    /// How many.
    pub n: usize,
}

impl<'a, S> MultiRef<'a, S> {
    /// The same view over another view of its buffer (the storage enum's backend storage).
    pub(crate) fn map<T>(
        &self,
        f: impl Fn(&'a S) -> crate::Result<&'a T>,
    ) -> crate::Result<MultiRef<'a, T>> {
        Ok(MultiRef {
            s: f(self.s)?,
            offset: self.offset,
            n: self.n,
        })
    }
}

impl<'a, S> AdamItem<'a, S> {
    /// The same item over other views of its buffers (the storage enum's backend storage).
    pub(crate) fn map<'b, T>(
        &'b mut self,
        fm: impl Fn(&'b mut S) -> crate::Result<&'b mut T>,
        fr: impl Fn(&'b S) -> crate::Result<&'b T>,
    ) -> crate::Result<AdamItem<'b, T>> {
        let moments = match &mut self.moments {
            AdamMoments::Full { m, v } => AdamMoments::Full {
                m: fm(m)?,
                v: fm(v)?,
            },
            AdamMoments::Quantized {
                m_codes,
                m_absmax,
                v_codes,
                v_absmax,
            } => AdamMoments::Quantized {
                m_codes: fm(m_codes)?,
                m_absmax: fm(m_absmax)?,
                v_codes: fm(v_codes)?,
                v_absmax: fm(v_absmax)?,
            },
        };
        Ok(AdamItem {
            p: fm(self.p)?,
            p_offset: self.p_offset,
            n: self.n,
            g: fr(self.g)?,
            g_offset: self.g_offset,
            moments,
            bias: self.bias,
        })
    }
}

// ----- Prodigy ----------------------------------------------------------------------------

/// The slots of Prodigy's device-resident scalar state (`prodigy_multi`'s `scalars`, an f64
/// tensor of [`PRODIGY_SCALARS`] values): the d estimate and its history, the global step
/// count and the powers of the betas for the bias correction, and two slots one step writes
/// for its second pass. Kept on the device so that the global reduction needs no host
/// round-trip: a step is three launches and no synchronization.
pub mod prodigy_slot {
    /// The current estimate d (starts at d0).
    pub const D: usize = 0;
    /// The largest estimate so far (starts at d0).
    pub const D_MAX: usize = 1;
    /// The running numerator, sum over steps of beta3^j * (d/d0) * dlr * <g, p0 - p>.
    pub const D_NUMERATOR: usize = 2;
    /// The last step's denominator, the sum of |s| over every value.
    pub const D_DENOM: usize = 3;
    /// The last step's raw estimate d_coef * numerator / denominator.
    pub const D_HAT: usize = 4;
    /// Steps applied (prodigyopt's `k`), as an exact integer in f64.
    pub const K: usize = 5;
    /// beta1^k, for the bias correction.
    pub const BETA1_POW: usize = 6;
    /// beta2^k.
    pub const BETA2_POW: usize = 7;
    /// The step's dlr = d * lr * bias_correction (with d before the update), for pass 2.
    pub const DLR: usize = 8;
    /// 1 when the step's update applies, 0 when its denominator was 0 (prodigyopt returns
    /// before updating the parameters, d or k then).
    pub const APPLY: usize = 9;
}

/// Values in Prodigy's scalar state.
pub const PRODIGY_SCALARS: usize = 10;

/// Values per chunk of Prodigy's passes (the kernels' PRODIGY_CHUNK), and threads per
/// chunk: each of the `PRODIGY_THREADS` sums its strided values of a chunk in f64, then
/// the thread sums are added in thread order. The CPU adds in this same order, so the
/// partial sums, d and every parameter agree bit for bit across backends.
pub const PRODIGY_CHUNK: usize = 4096;
/// See [`PRODIGY_CHUNK`].
pub const PRODIGY_THREADS: usize = 256;

/// The hyperparameters of a Prodigy step (Mishchenko & Defazio 2024, "Prodigy: An
/// Expeditiously Adaptive Parameter-Free Learner", Algorithm 4 in prodigyopt 1.1.2's form).
/// One step over every parameter with a gradient, the values of one parameter being
/// `p`, `g`, `m` (exp_avg), `v` (exp_avg_sq), `s` and `p0` (the parameter's first value):
///
/// ```text
/// bc  = use_bias_correction ? sqrt(1 - beta2^(k+1)) / (1 - beta1^(k+1)) : 1     (f64)
/// dlr = d * lr * bc                                                              (f64)
/// pass 1, per value, in f32:
///   g = g * grad_scale;  g = g + weight_decay * p        (the latter when !decouple)
///   dot += g * (p0 - p)                                  (f64)
///   m = m * beta1 + (d * (1 - beta1)) * g                (when beta1 > 0)
///   v = v * beta2 + ((d * d * (1 - beta2)) * g) * g
///   s = s * beta3 + ((d / d0) * (safeguard_warmup ? d : dlr)) * g
///   abs += |s|                                           (f64)
/// reduce, in f64:
///   numerator = beta3 * numerator + (d / d0) * dlr * dot
///   abs == 0: stop here (no update of p, d or k)
///   d_hat = d_coef * numerator / abs
///   d == d0: d = max(d, d_hat);  d_max = max(d_max, d_hat);  d = min(d_max, d * growth_rate)
///   k = k + 1
/// pass 2, per value, in f32, with the new d and the step's dlr:
///   p = p + (-weight_decay * dlr) * p                    (when decouple)
///   p = p + (beta1 > 0 ? -dlr : -dlr * d) * ((beta1 > 0 ? m : g) / (sqrt(v) + d * eps))
/// ```
///
/// Every f64 scalar is rounded once to f32 where it meets the values; no fused
/// multiply-add on either backend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyHyper {
    /// The learning-rate multiplier (prodigyopt's lr), > 0.
    pub lr: f64,
    /// First-moment decay (0: no first moment).
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// The decay of s and of the numerator.
    pub beta3: f64,
    /// Added to sqrt(v), times d.
    pub eps: f64,
    /// Weight decay (decoupled or an L2 penalty).
    pub weight_decay: f64,
    /// AdamW-style decoupled decay rather than L2 added to the gradient.
    pub decouple: bool,
    /// Adam's bias correction folded into dlr.
    pub use_bias_correction: bool,
    /// s grows by d instead of dlr (steadier under a learning-rate warm-up).
    pub safeguard_warmup: bool,
    /// The first estimate of d.
    pub d0: f64,
    /// The multiplier of the raw estimate.
    pub d_coef: f64,
    /// The most d may grow in one step (a factor; infinity: unbounded).
    pub growth_rate: f64,
    /// Every gradient is multiplied by this first.
    pub grad_scale: f32,
}

/// The f32 scalars of a step's first pass, from the hyperparameters and the scalar state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyPass1 {
    /// The step's dlr, in f64 (goes into the numerator and pass 2).
    pub dlr: f64,
    /// `grad_scale`.
    pub grad_scale: f32,
    /// The L2 penalty (0 when decoupled).
    pub l2: f32,
    /// beta1, beta2 and beta3.
    pub beta1: f32,
    /// See `beta1`.
    pub beta2: f32,
    /// See `beta1`.
    pub beta3: f32,
    /// d * (1 - beta1).
    pub a_m: f32,
    /// d * d * (1 - beta2).
    pub a_v: f32,
    /// (d / d0) * (safeguard_warmup ? d : dlr).
    pub a_s: f32,
}

/// The f32 scalars of a step's second pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyPass2 {
    /// d * eps (the new d).
    pub eps_d: f32,
    /// -weight_decay * dlr (0 when not decoupled).
    pub decay: f32,
    /// -dlr, or -dlr * d without a first moment.
    pub step: f32,
}

/// Python's `max(a, b)`: `b` only when `b > a` (so a NaN `b` leaves `a`).
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

impl ProdigyHyper {
    /// Pass 1's scalars from the state `st` (the CPU's; `prodigy_pass1_scalars` in
    /// cuda/multi_tensor.cu is its twin).
    pub fn pass1(&self, st: &[f64; PRODIGY_SCALARS]) -> ProdigyPass1 {
        use prodigy_slot as s;
        let d = st[s::D];
        let bc = if self.use_bias_correction {
            (1.0 - st[s::BETA2_POW] * self.beta2).sqrt() / (1.0 - st[s::BETA1_POW] * self.beta1)
        } else {
            1.0
        };
        let dlr = d * self.lr * bc;
        let dd0 = d / self.d0;
        ProdigyPass1 {
            dlr,
            grad_scale: self.grad_scale,
            l2: if self.decouple {
                0.0
            } else {
                self.weight_decay as f32
            },
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            beta3: self.beta3 as f32,
            a_m: (d * (1.0 - self.beta1)) as f32,
            a_v: (d * d * (1.0 - self.beta2)) as f32,
            a_s: (dd0 * if self.safeguard_warmup { d } else { dlr }) as f32,
        }
    }

    /// The reduction: the state after a step whose first pass summed `dot` and `abs`
    /// (`prodigy_reduce` in cuda/multi_tensor.cu is its twin).
    pub fn reduce(&self, st: &mut [f64; PRODIGY_SCALARS], dot: f64, abs: f64) {
        use prodigy_slot as s;
        let dlr = self.pass1(st).dlr;
        let d = st[s::D];
        let numerator = self.beta3 * st[s::D_NUMERATOR] + d / self.d0 * dlr * dot;
        st[s::DLR] = dlr;
        if abs == 0.0 {
            st[s::APPLY] = 0.0;
            return;
        }
        let d_hat = self.d_coef * numerator / abs;
        let mut d_new = d;
        if d == self.d0 {
            d_new = py_max(d, d_hat);
        }
        let d_max = py_max(st[s::D_MAX], d_hat);
        d_new = py_min(d_max, d_new * self.growth_rate);
        st[s::D_NUMERATOR] = numerator;
        st[s::D_DENOM] = abs;
        st[s::D_HAT] = d_hat;
        st[s::D] = d_new;
        st[s::D_MAX] = d_max;
        st[s::K] += 1.0;
        st[s::BETA1_POW] *= self.beta1;
        st[s::BETA2_POW] *= self.beta2;
        st[s::APPLY] = 1.0;
    }

    /// Pass 2's scalars from the state after the reduction.
    pub fn pass2(&self, st: &[f64; PRODIGY_SCALARS]) -> ProdigyPass2 {
        use prodigy_slot as s;
        let (d, dlr) = (st[s::D], st[s::DLR]);
        ProdigyPass2 {
            eps_d: (d * self.eps) as f32,
            decay: if self.decouple {
                (-self.weight_decay * dlr) as f32
            } else {
                0.0
            },
            step: if self.beta1 > 0.0 {
                (-dlr) as f32
            } else {
                (-dlr * d) as f32
            },
        }
    }
}

impl ProdigyPass1 {
    /// Pass 1 of one value: (p, g, p0, m, v, s) -> (g', m', v', s') and the value's term of
    /// the dot product; `m` is ignored without a first moment.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        has_m: bool,
        p: f32,
        g: f32,
        p0: f32,
        m: f32,
        v: f32,
        s: f32,
    ) -> (f32, f32, f32, f32, f64) {
        let g = self.grad(p, g);
        let dot = g as f64 * (p0 as f64 - p as f64);
        let m = if has_m {
            m * self.beta1 + self.a_m * g
        } else {
            m
        };
        let v = v * self.beta2 + self.a_v * g * g;
        let s = s * self.beta3 + self.a_s * g;
        (g, m, v, s, dot)
    }

    /// The gradient as the step sees it: scaled, plus the L2 penalty.
    pub fn grad(&self, p: f32, g: f32) -> f32 {
        let g = g * self.grad_scale;
        if self.l2 != 0.0 {
            g + self.l2 * p
        } else {
            g
        }
    }
}

impl ProdigyPass2 {
    /// Pass 2 of one value: the new parameter from p, the numerator `num` (m, or the
    /// gradient without a first moment) and v.
    pub fn apply(&self, p: f32, num: f32, v: f32) -> f32 {
        let denom = v.sqrt() + self.eps_d;
        let p = if self.decay != 0.0 {
            p + self.decay * p
        } else {
            p
        };
        p + self.step * (num / denom)
    }
}

/// One parameter of a Prodigy step: `n` contiguous values of `p` from `p_offset` (f32, bf16
/// or f16), its gradient (same dtype, from `g_offset`) and its f32 state, dense from 0.
pub struct ProdigyItem<'a, S> {
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
    /// The first moment (absent when beta1 = 0).
    pub m: Option<&'a mut S>,
    /// The second moment.
    pub v: &'a mut S,
    /// The running sum s of the d estimate's denominator.
    pub s: &'a mut S,
    /// The parameter's first value (absent: all zeros, as prodigyopt keeps a zero scalar for
    /// a parameter that starts at zero).
    pub p0: Option<&'a S>,
}

impl<'a, S> ProdigyItem<'a, S> {
    /// The same item over other views of its buffers.
    pub(crate) fn map<'b, T>(
        &'b mut self,
        fm: impl Fn(&'b mut S) -> crate::Result<&'b mut T>,
        fr: impl Fn(&'b S) -> crate::Result<&'b T>,
    ) -> crate::Result<ProdigyItem<'b, T>> {
        Ok(ProdigyItem {
            p: fm(self.p)?,
            p_offset: self.p_offset,
            n: self.n,
            g: fr(self.g)?,
            g_offset: self.g_offset,
            m: match &mut self.m {
                Some(m) => Some(fm(m)?),
                None => None,
            },
            v: fm(self.v)?,
            s: fm(self.s)?,
            p0: match self.p0 {
                Some(p0) => Some(fr(p0)?),
                None => None,
            },
        })
    }
}

// ----- EMA of weights ---------------------------------------------------------------------

/// An exponential moving average's update of one value in f32, as diffusers' `EMAModel`
/// writes it (`s_param.sub_(one_minus_decay * (s_param - param))`, training_utils.py 0.42):
/// `s - k * (s - p)` with `k = 1 - decay`. `ema_update` in cuda/multi_tensor.cu is its twin.
pub fn ema_value(k: f32, s: f32, p: f32) -> f32 {
    s - k * (s - p)
}

/// One weight of a grouped copy into a compute dtype (`BackendStorage::cast_multi`): its
/// values and the factor they are scaled by first ([`copy_value`]).
pub struct CastItem<'a, S> {
    /// The weight's values (f32, bf16 or f16).
    pub src: MultiRef<'a, S>,
    /// The factor (1: the values as they are).
    pub scale: f32,
}

impl<'a, S> CastItem<'a, S> {
    /// The same item over another view of its buffer (the storage enum's backend storage).
    pub(crate) fn map<T>(
        &self,
        f: impl Fn(&'a S) -> crate::Result<&'a T>,
    ) -> crate::Result<CastItem<'a, T>> {
        Ok(CastItem {
            src: self.src.map(f)?,
            scale: self.scale,
        })
    }
}

/// One gradient of a grouped fold into f32 (`BackendStorage::fold_multi`): the gradient of
/// a copy [`CastItem`] made, the f32 gradient it adds to (none: it starts one), and the
/// copy's factor ([`fold_value`]).
pub struct FoldItem<'a, S> {
    /// The copy's gradient (f32, bf16 or f16).
    pub g: MultiRef<'a, S>,
    /// The weight's gradient so far (f32, `g.n` values), if any.
    pub prev: Option<MultiRef<'a, S>>,
    /// The copy's factor.
    pub scale: f32,
}

impl<'a, S> FoldItem<'a, S> {
    /// The same item over other views of its buffers (the storage enum's backend storage).
    pub(crate) fn map<T>(
        &self,
        f: impl Fn(&'a S) -> crate::Result<&'a T>,
    ) -> crate::Result<FoldItem<'a, T>> {
        Ok(FoldItem {
            g: self.g.map(&f)?,
            prev: self.prev.as_ref().map(|p| p.map(&f)).transpose()?,
            scale: self.scale,
        })
    }
}

/// The value a grouped copy holds for a weight's value `p` with factor `scale`, in f32
/// before its rounding to the copy's dtype: `p`, or `p * scale + 0` (the `affine` a
/// per-use `w.affine(scale, 0).to_dtype(..)` computes, rounded in f32 the same way, so the
/// copy is the per-use cast's value bit for bit). `grouped_copy` in cuda/multi_tensor.cu is
/// its twin.
pub fn copy_value(scale: f32, p: f32) -> f32 {
    if scale == 1.0 {
        p
    } else {
        p * scale + 0.0
    }
}

/// A weight's f32 gradient after a copy's gradient `g` (its value in f32) is folded into
/// it: `prev + copy_value(scale, g)`, or `copy_value(scale, g)` where there was none. The
/// per-use path's VJPs compute the same: the cast's gives `g` in f32 (exact), the affine's
/// `g * scale + 0`, and the gradient sum adds it to `prev`. d/dw (s w) = s. `grouped_fold` in
/// cuda/multi_tensor.cu is its twin.
pub fn fold_value(scale: f32, prev: Option<f32>, g: f32) -> f32 {
    let c = copy_value(scale, g);
    match prev {
        Some(p) => p + c,
        None => c,
    }
}
