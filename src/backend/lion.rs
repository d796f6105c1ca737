//! Lion's multi-tensor step (Chen et al. 2023, "Symbolic Discovery of Optimization
//! Algorithms", <https://arxiv.org/abs/2302.06675>, Algorithm 2), in the order of
//! lion-pytorch's `update_fn` (lucidrains/lion-pytorch) and of bitsandbytes' `Lion8bit`. One
//! value, in f32, each operation rounded to f32 and no fused multiply-add (on either backend,
//! so the CPU and CUDA agree bit for bit):
//!
//! ```text
//! g = g * grad_scale                  (unscaling of a scaled loss, clipping)
//! p = p * decay                       (decoupled weight decay, 1 - lr * weight_decay)
//! c = beta1 * m + one_minus_beta1 * g
//! p = p + neg_lr * sign(c)            (sign(0) = 0, sign(NaN) = NaN, as torch.sign)
//! m = beta2 * m + one_minus_beta2 * g
//! ```
//!
//! The momentum `m` is f32 of the parameter's size, or block-wise 8-bit codes with the signed
//! dynamic map of `quant8` (bitsandbytes' `Lion8bit`): each block of 256 values is
//! dequantized, updated, and requantized with its new absmax, as AdamW8bit's moments are.

/// The scalars a Lion step shares across its parameters, rounded to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionHyper {
    /// The interpolation of the update's direction.
    pub beta1: f32,
    /// The momentum's decay.
    pub beta2: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `-lr`.
    pub neg_lr: f32,
    /// Every gradient is multiplied by this first (1: as given).
    pub grad_scale: f32,
}

/// torch.sign in f32: -1, 0 or 1, NaN for NaN.
pub fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

impl LionHyper {
    /// The update of one value, (p, g, m) -> (p', m'), in the order of the module
    /// documentation. The CPU backend's; `lion_value` in cuda/multi_tensor.cu is its twin.
    pub fn apply(&self, p: f32, g: f32, m: f32) -> (f32, f32) {
        let g = g * self.grad_scale;
        let p = p * self.decay;
        let c = self.beta1 * m + self.one_minus_beta1 * g;
        let p = p + self.neg_lr * sign(c);
        (p, self.beta2 * m + self.one_minus_beta2 * g)
    }
}

/// The momentum of one parameter, updated in place.
pub enum LionMoment<'a, S> {
    /// f32 of the parameter's size (dense, from offset 0).
    Full(&'a mut S),
    /// Block-wise 8-bit as `quant8` describes: (blocks, 64) u32 codes and (blocks) f32
    /// maxima (dense, from offset 0).
    Quantized {
        /// The packed codes.
        codes: &'a mut S,
        /// The block maxima.
        absmax: &'a mut S,
    },
}

/// One parameter of a multi-tensor Lion step: `n` contiguous values of `p` from `p_offset`
/// (f32, bf16 or f16), its gradient (same dtype, contiguous from `g_offset`) and its momentum.
pub struct LionItem<'a, S> {
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
    /// Its momentum.
    pub m: LionMoment<'a, S>,
}

impl<'a, S> LionItem<'a, S> {
    /// The same item over other views of its buffers (the storage enum's backend storage).
    pub(crate) fn map<'b, T>(
        &'b mut self,
        fm: impl Fn(&'b mut S) -> crate::Result<&'b mut T>,
        fr: impl Fn(&'b S) -> crate::Result<&'b T>,
    ) -> crate::Result<LionItem<'b, T>> {
        let m = match &mut self.m {
            LionMoment::Full(m) => LionMoment::Full(fm(m)?),
            LionMoment::Quantized { codes, absmax } => LionMoment::Quantized {
                codes: fm(codes)?,
                absmax: fm(absmax)?,
            },
        };
        Ok(LionItem {
            p: fm(self.p)?,
            p_offset: self.p_offset,
            n: self.n,
            g: fr(self.g)?,
            g_offset: self.g_offset,
            m,
        })
    }
}
