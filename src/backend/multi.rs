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
