//! Scaled dot-product attention: the fused kernels (`Attention` and its backward,
//! `AttentionBackward`: flash attention on CUDA, cuda/attention.cu with the mma.sync kernels
//! and cuda/attention_wgmma.cu with Hopper's, launched by `backend::cuda::kit::flash`; a
//! row-by-row f64 pass on the CPU, `backend::cpu::Attn`) and their composite twin (matmul,
//! softmax, matmul), the reference of both. Shape letters: B batch, H heads, Lq queries, Lk
//! keys, D head dim.

use crate::autograd::{kept_or, plain, record_kernel, run_kernel, FusedKernel, KeptKind};
use crate::backend::validate::Operands;
use crate::backend::{stats_dtype, Kernel};
use crate::{DType, Error, Layout, Result, Tensor};

/// [q (B, H, Lq, D), k, v (B, H, Lk, D), keep? (B, Lk) stats] -> [o (B, H, Lq, D),
/// lse (B, H, Lq) stats]: o = softmax(scale q k^T) v row by row, never forming the Lq x Lk
/// matrix. Key j is hidden from every query where `keep[b][j] == 0` (`mask`), and from
/// queries i < j when `causal` (top-left aligned, as PyTorch's `is_causal`).
/// lse = log sum_j exp(scale q.k_j) over the visible keys; a row that sees no key gives o = 0
/// and lse = +inf (so the backward's exp(s - lse) is 0 there). "stats" is `stats_dtype(q)`.
/// On the tape its inputs are q, k and v, and it keeps [keep?, lse].
pub(crate) struct Attention {
    /// Hide key j from queries i < j.
    pub(crate) causal: bool,
    /// Factor on the logits `q k^T` (usually `1 / sqrt(D)`).
    pub(crate) scale: f64,
    /// Whether a `keep` (B, Lk) key-padding mask operand is passed.
    pub(crate) mask: bool,
}

/// [q, k, v, o, do, lse, keep?] -> [dq, dk, dv]: with P = exp(scale q k^T - lse)
/// recomputed, dv = P^T do, dS = P (do v^T - rowsum(do o)), dq = scale dS k,
/// dk = scale dS^T q.
pub(crate) struct AttentionBackward {
    /// As in the forward.
    pub(crate) causal: bool,
    /// As in the forward.
    pub(crate) scale: f64,
    /// As in the forward.
    pub(crate) mask: bool,
}

/// The operands of either (the backward's add o, do and lse after v): returns
/// [B, H, Lq, Lk, D].
fn check_operands(
    name: &'static str,
    args: &[(DType, &Layout)],
    scale: f64,
    mask: bool,
    backward: bool,
) -> Result<Vec<usize>> {
    let o = Operands::new(name, args, if backward { 6 } else { 3 } + usize::from(mask))?;
    let d = o.dims(4, "(B, H, Lq, D)")?;
    if !scale.is_finite() {
        return Err(o.invalid(format!("scale {scale} is not finite")));
    }
    let kd = o.dims_of(1);
    let lk = if kd.len() == 4 { kd[2] } else { 0 };
    if lk == 0 {
        return Err(o.invalid(format!(
            "needs keys (B, H, Lk, D) with Lk > 0, got {:?}",
            kd
        )));
    }
    let (dt, stats) = (o.dtype(), stats_dtype(o.dtype()));
    let kv = [d[0], d[1], lk, d[3]];
    o.expect(1, dt, &kv)?;
    o.expect(2, dt, &kv)?;
    let mut next = 3;
    if backward {
        o.expect(3, dt, d)?;
        o.expect(4, dt, d)?;
        o.expect(5, stats, &d[..3])?;
        next = 6;
    }
    if mask {
        o.expect(next, stats, &[d[0], lk])?;
    }
    Ok(vec![d[0], d[1], d[2], lk, d[3]])
}

/// The CPU pass for dims [B, H, Lq, Lk, D].
#[cfg(feature = "cpu-ref")]
fn cpu_pass<'a>(
    dims: &[usize],
    causal: bool,
    scale: f64,
    keep: Option<&'a [f64]>,
) -> crate::backend::cpu::Attn<'a> {
    crate::backend::cpu::Attn {
        h: dims[1],
        lq: dims[2],
        lk: dims[3],
        d: dims[4],
        causal,
        scale,
        keep,
    }
}

/// Dense views of the operands for dims [B, H, Lq, Lk, D]: q, k, v, then o, do and lse for
/// the backward, then keep.
#[cfg(feature = "cuda")]
fn dense_layouts(dims: &[usize], backward: bool, mask: bool) -> Vec<Layout> {
    let (b, h, lq, lk, d) = (dims[0], dims[1], dims[2], dims[3], dims[4]);
    let mut shapes = vec![vec![b, h, lq, d], vec![b, h, lk, d], vec![b, h, lk, d]];
    if backward {
        shapes.extend([vec![b, h, lq, d], vec![b, h, lq, d], vec![b, h, lq]]);
    }
    if mask {
        shapes.push(vec![b, lk]);
    }
    shapes
        .into_iter()
        .map(|s| Layout::contiguous(crate::Shape::from(s)))
        .collect()
}

impl Kernel for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    /// Returns [B, H, Lq, Lk, D].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check_operands(self.name(), args, self.scale, self.mask, false)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let a = cpu_pass(dims, self.causal, self.scale, self.mask.then(|| &v[3][..]));
        let (o, lse) = a.forward(dims[0] * dims[1], &v[0], &v[1], &v[2]);
        let dt = args[0].0.dtype();
        Ok(vec![
            from_f64_vec(o, dt),
            from_f64_vec(lse, stats_dtype(dt)),
        ])
    }

    /// Dense operands: the flash kernels over their contiguous views.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let layouts = dense_layouts(dims, false, self.mask);
        let views: Vec<_> = args.iter().copied().zip(&layouts).collect();
        self.cuda_views(dims, &views)
    }

    /// The flash kernels read q, k and v where they lie (a permuted qkv projection in place)
    /// when their rows are unit-stride and 16-byte aligned; other views are copied first.
    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let (causal, scale, mask) = (self.causal, self.scale, self.mask);
        crate::backend::cuda::kit::flash(self.name(), false, causal, scale, mask, dims, args)
    }
}

impl FusedKernel for Attention {
    /// The backward recomputes the probabilities from q and k and reads v: every input is
    /// kept by value.
    fn reads_inputs(&self, _needs_grad: &[bool]) -> Vec<bool> {
        vec![true; 3]
    }

    /// dS = P (do v^T - rowsum(do o)) reads o.
    fn reads_output(&self) -> bool {
        true
    }

    /// o = P v with P = softmax(scale q k^T): dv = P^T g, dS = P (g v^T - rowsum(g o)),
    /// dq = scale dS k, dk = scale dS^T q; one fused pass recomputes P from lse.
    fn vjp(
        &self,
        inputs: &[Tensor],
        kept: &[Tensor],
        out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (keep, lse) = match (self.mask, kept) {
            (true, [keep, lse]) => (Some(keep), lse),
            (false, [lse]) => (None, lse),
            _ => {
                return Err(Error::Autograd(format!(
                    "internal: attention kept {} tensors, expected {}",
                    kept.len(),
                    1 + usize::from(self.mask)
                )))
            }
        };
        let [q, k, v] = inputs else {
            return Err(Error::Autograd(format!(
                "internal: attention recorded {} inputs, expected q, k and v",
                inputs.len()
            )));
        };
        let (dq, dk, dv) =
            q.attention_backward(k, v, out, g, lse, keep, self.causal, self.scale)?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

impl Kernel for AttentionBackward {
    fn name(&self) -> &'static str {
        "attention_backward"
    }

    /// Returns [B, H, Lq, Lk, D].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check_operands(self.name(), args, self.scale, self.mask, true)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let a = cpu_pass(dims, self.causal, self.scale, self.mask.then(|| &v[6][..]));
        let (dq, dk, dv) = a.backward(dims[0] * dims[1], &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]);
        let dt = args[0].0.dtype();
        Ok(vec![
            from_f64_vec(dq, dt),
            from_f64_vec(dk, dt),
            from_f64_vec(dv, dt),
        ])
    }

    /// Dense operands: the flash kernels over their contiguous views.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let layouts = dense_layouts(dims, true, self.mask);
        let views: Vec<_> = args.iter().copied().zip(&layouts).collect();
        self.cuda_views(dims, &views)
    }

    /// As the forward's: q, k, v, o and do read in place where their rows allow.
    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let (causal, scale, mask) = (self.causal, self.scale, self.mask);
        crate::backend::cuda::kit::flash(self.name(), true, causal, scale, mask, dims, args)
    }
}

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
    /// Attention through the fused kernel, with self = q: the flash kernels on CUDA
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
        let kernel = Attention {
            causal,
            scale,
            mask: keep.is_some(),
        };
        // In a checkpoint that keeps attention, the re-run takes the forward's o and lse
        // instead of running the kernel again (`autograd::Keep`).
        let kept = kept_or(&[KeptKind::Attention], || {
            let mut o = run_kernel(&kernel, &args)?;
            let lse = plain(o.remove(1), (b, h, lq), self);
            let o = plain(o.remove(0), (b, h, lq, d), self);
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
        let mut saved: Vec<&Tensor> = keep.iter().collect();
        saved.push(&lse);
        let rec = record_kernel(kernel, &[self, k, v], &saved);
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
        let kernel = AttentionBackward {
            causal,
            scale,
            mask: keep.is_some(),
        };
        let mut g = run_kernel(&kernel, &args)?.into_iter();
        let mut next = |like: &Tensor| -> Result<Tensor> {
            let s = g.next().ok_or_else(|| {
                Error::Autograd("attention_backward returned too few gradients".into())
            })?;
            Ok(plain(s, like.shape().clone(), like))
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
