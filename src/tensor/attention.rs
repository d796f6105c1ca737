//! Scaled dot-product attention: the fused path (`FusedOp::Attention`, flash attention on
//! CUDA, a row-by-row f64 pass on the CPU) and its composite twin (matmul, softmax, matmul),
//! the reference of both. Shape letters: B batch, H heads, Lq queries, Lk keys, D head dim.

use super::fused::run;
use super::Tensor;
use crate::autograd::{kept_or, record, KeptKind, Op};
use crate::backend::{stats_dtype, FusedOp};
use crate::{DType, Error, Result};

/// Sizes (B, H, Lq, Lk, D) of an attention call, after checking every operand.
struct Dims {
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
    d: usize,
}

fn check(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Dims> {
    const OP: &str = "attention";
    let bad = |what: &str, t: &Tensor| Err(Error::invalid(OP, what.to_string(), t.shape()));
    if q.rank() != 4 || q.dims().contains(&0) {
        return bad("q must be a non-empty (B, H, Lq, D) tensor", q);
    }
    let [b, h, lq, d] = [q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]];
    for t in [k, v] {
        if t.rank() != 4 || t.dims()[2] == 0 || [t.dims()[0], t.dims()[1], t.dims()[3]] != [b, h, d]
        {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: q.shape().clone(),
                rhs: t.shape().clone(),
            });
        }
        if t.dtype() != q.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: q.dtype(),
                rhs: t.dtype(),
            });
        }
        if t.device() != q.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: q.device().location(),
                rhs: t.device().location(),
            });
        }
    }
    let lk = k.dims()[2];
    if v.dims()[2] != lk {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: k.shape().clone(),
            rhs: v.shape().clone(),
        });
    }
    if !q.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: q.dtype(),
        });
    }
    if let Some(m) = mask {
        if m.rank() != 2 || (m.dims()[0] != b && m.dims()[0] != 1) || m.dims()[1] != lk {
            return bad(
                &format!("the key padding mask must be (B, Lk) or (1, Lk) = ({b} or 1, {lk})"),
                m,
            );
        }
        if m.device() != q.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: q.device().location(),
                rhs: m.device().location(),
            });
        }
    }
    Ok(Dims { b, h, lq, lk, d })
}

/// The largest (B, H, Lq, Lk) f32 score tensor the CPU's attention materializes (256 MiB);
/// larger attention runs the fused row-by-row pass.
pub const CPU_COMPOSITE_SCORES: u64 = 256 << 20;

/// `1 / sqrt(D)` unless given.
fn scale_or_default(scale: Option<f64>, d: usize) -> f64 {
    scale.unwrap_or(1.0 / (d as f64).sqrt())
}

/// Scaled dot-product attention `softmax(scale q k^T + masks) v` of q (B, H, Lq, D) over
/// k, v (B, H, Lk, D), with autograd. `mask` is an optional key padding mask (B, Lk) or
/// (1, Lk): key j is visible where it is not 0. `causal` hides key j from queries i < j
/// (top-left aligned, as PyTorch's `is_causal`). `scale` defaults to 1 / sqrt(D). A query
/// that sees no key outputs 0.
///
/// On CUDA, bf16 and f16 at head dims 64 and 128 run the flash-attention kernels: nothing of
/// size Lq x Lk is allocated, forward or backward; at head dim 512 (the autoencoders'
/// mid-block attention) a forward-only flash kernel serves calls that record no gradient.
/// On the CPU, scores larger than [`CPU_COMPOSITE_SCORES`] bytes run the CPU's fused
/// row-by-row pass, whose memory grows with Lq + Lk, not their product (a large image on the
/// CPU would otherwise ask for terabytes). Everything else runs the composite
/// (`Tensor::attention_composite`), which materializes the (B, H, Lq, Lk) scores.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    let dims = check(q, k, v, mask)?;
    let scale = scale_or_default(scale, dims.d);
    // Head width 512 (the VAE's single head) has a forward kernel only: it serves calls
    // that record nothing (no gradient asked of q, k or v).
    let records = crate::grad_enabled() && [q, k, v].iter().any(|t| t.requires_grad());
    let flash = q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && (matches!(dims.d, 64 | 128) || (dims.d == 512 && !records));
    let scores = (dims.b * dims.h) as u64 * dims.lq as u64 * dims.lk as u64 * 4;
    let cpu_rows = !q.device().is_cuda() && scores > CPU_COMPOSITE_SCORES;
    if flash || cpu_rows {
        q.attention_fused(k, v, mask, causal, scale)
    } else {
        q.attention_composite(k, v, mask, causal, scale)
    }
}

impl Tensor {
    /// Attention through the backend's fused op, with self = q: the flash kernels on CUDA
    /// (bf16/f16, D = 64 or 128; other cases are an error there), a row-by-row pass on the
    /// CPU (every float dtype). Saves only the output and the f32 log-sum-exp per row for
    /// the backward. See `scaled_dot_product_attention` for the arguments.
    pub fn attention_fused(
        &self,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
        scale: f64,
    ) -> Result<Tensor> {
        let Dims { b, h, lq, lk, d } = check(self, k, v, mask)?;
        let keep = match mask {
            Some(m) => Some(keep_flags(m, b, lk, stats_dtype(self.dtype()))?),
            None => None,
        };
        let mut args = vec![self, k, v];
        args.extend(keep.as_ref());
        let op = FusedOp::Attention {
            causal,
            scale,
            mask: keep.is_some(),
        };
        // In a checkpoint that keeps attention, the re-run takes the forward's o and lse
        // instead of running the kernel again (`autograd::Keep`).
        let kept = kept_or(&[KeptKind::Attention], || {
            let mut o = run(op, &args)?;
            let lse =
                Tensor::from_storage(o.remove(1), (b, h, lq).into(), self.device().clone(), None);
            let o = Tensor::from_storage(
                o.remove(0),
                (b, h, lq, d).into(),
                self.device().clone(),
                None,
            );
            Ok(vec![o, lse])
        })?;
        let [o, lse] = <[Tensor; 2]>::try_from(kept).map_err(|v| {
            Error::Autograd(format!(
                "kept attention: {} tensors, expected o and lse",
                v.len()
            ))
        })?;
        if o.dims() != [b, h, lq, d] || lse.dims() != [b, h, lq] || o.dtype() != self.dtype() {
            return Err(Error::Autograd(format!(
                "kept attention output {:?} {} / lse {:?} does not fit this call (B, H, Lq, D) = \
                 ({b}, {h}, {lq}, {d}) {}: the checkpoint's re-run differs from its forward",
                o.dims(),
                o.dtype(),
                lse.dims(),
                self.dtype()
            )));
        }
        let rec = record(&[self, k, v], || Op::Attention {
            q: self.clone(),
            k: k.clone(),
            v: v.clone(),
            keep: keep.clone(),
            lse: lse.clone(),
            causal,
            scale,
        });
        Ok(o.view(o.layout().clone(), rec))
    }

    /// (dq, dk, dv) of `attention_fused` given its output o, the output's gradient and the
    /// saved log-sum-exp: one backward pass that recomputes the probabilities tile by tile.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward(
        &self,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dout: &Tensor,
        lse: &Tensor,
        keep: Option<&Tensor>,
        causal: bool,
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dout = dout.to_dtype(self.dtype())?;
        let mut args = vec![self, k, v, o, &dout, lse];
        args.extend(keep);
        let op = FusedOp::AttentionBackward {
            causal,
            scale,
            mask: keep.is_some(),
        };
        let mut g = run(op, &args)?.into_iter();
        let mut next = |like: &Tensor| -> Result<Tensor> {
            let s = g.next().ok_or_else(|| {
                Error::Autograd("attention_backward returned too few gradients".into())
            })?;
            Ok(Tensor::from_storage(
                s,
                like.shape().clone(),
                like.device().clone(),
                None,
            ))
        };
        Ok((next(self)?, next(k)?, next(v)?))
    }

    /// Attention from primitives: `softmax(scale q k^T + masks) v` with the (B, H, Lq, Lk)
    /// scores materialized. The reference of the fused path on every backend; same arguments
    /// as `scaled_dot_product_attention`.
    pub fn attention_composite(
        &self,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        causal: bool,
        scale: f64,
    ) -> Result<Tensor> {
        let Dims { lq, lk, .. } = check(self, k, v, mask)?;
        let (dt, dev) = (self.dtype(), self.device());
        let s = self.matmul(&k.transpose(2, 3)?)?.affine(scale, 0.0)?;
        // hidden: 1 where a query must not see a key, broadcastable to (B, H, Lq, Lk).
        let mut hidden = match mask {
            Some(m) => {
                let m = m.detach();
                Some(
                    m.eq(&m.zeros_like()?)?
                        .to_dtype(dt)?
                        .reshape((m.dims()[0], 1, 1, lk))?,
                )
            }
            None => None,
        };
        if causal {
            let i = Tensor::arange(0.0, lq as f64, dt, dev)?.reshape((1, 1, lq, 1))?;
            let j = Tensor::arange(0.0, lk as f64, dt, dev)?.reshape((1, 1, 1, lk))?;
            let (i, j) = (
                i.broadcast_as((1, 1, lq, lk))?,
                j.broadcast_as((1, 1, lq, lk))?,
            );
            let c = j.gt(&i)?;
            hidden = Some(match hidden {
                Some(h) => h.maximum(&c)?,
                None => c,
            });
        }
        let Some(hidden) = hidden else {
            return s.softmax(3)?.matmul(v);
        };
        let s = hidden.where_cond(&Tensor::full(f64::NEG_INFINITY, (), dt, dev)?, &s)?;
        let mut p = s.softmax(3)?;
        if mask.is_some() {
            // A row that sees no key is all -inf and its softmax NaN; it outputs 0, as the
            // fused path does. (Causal alone always shows key 0 to every query.)
            let shape = hidden
                .shape()
                .broadcast_with(&(1, 1, lq, lk).into(), "attention")?;
            let seen = hidden
                .affine(-1.0, 1.0)?
                .broadcast_as(shape)?
                .sum_keepdim(&[3])?;
            p = seen.where_cond(&p, &p.zeros_like()?.detach())?;
        }
        p.matmul(v)
    }
}

/// The key padding mask as visibility flags (B, Lk) in `dtype`: 1 where m is not 0.
fn keep_flags(m: &Tensor, b: usize, lk: usize, dtype: DType) -> Result<Tensor> {
    let m = m.detach();
    m.ne(&m.zeros_like()?)?
        .to_dtype(dtype)?
        .broadcast_as((b, lk))?
        .detach()
        .contiguous()
}
