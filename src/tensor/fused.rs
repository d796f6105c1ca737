//! Layers with fused kernels (`FusedOp`): adaLN modulation, RoPE and GroupNorm, plus the fused
//! backward pieces of softmax and the norms. Each has a composite twin written from
//! primitives, kept as its reference (tests compare the two on every backend).

use super::Tensor;
use crate::autograd::{record, Op};
use crate::backend::{stats_dtype, FusedOp, NormKind};
use crate::device::Storage;
use crate::{Error, Result, Shape};

/// Runs `op` on the tensors' storages and views.
pub(crate) fn run(op: FusedOp, args: &[&Tensor]) -> Result<Vec<Storage>> {
    let guards = args
        .iter()
        .map(|t| t.storage())
        .collect::<Result<Vec<_>>>()?;
    let pairs: Vec<_> = guards
        .iter()
        .zip(args)
        .map(|(g, t)| (&**g, t.layout()))
        .collect();
    Storage::fused(op, &pairs)
}

/// Wraps an output storage of `like`'s device (no autograd record).
fn wrap(s: Storage, shape: impl Into<Shape>, like: &Tensor) -> Tensor {
    Tensor::from_storage(s, shape.into(), like.device().clone(), None)
}

/// Runs a norm's fused backward `op` on [x, dy (cast to x's dtype), mean, rstd, weight?] and
/// wraps its [dx, dw, db] outputs, the parameter gradients of `params` values.
fn param_backward(
    op: FusedOp,
    x: &Tensor,
    dy: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    weight: Option<&Tensor>,
    params: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dy = dy.to_dtype(x.dtype())?;
    let mut args = vec![x, &dy, mean, rstd];
    args.extend(weight);
    let mut o = run(op, &args)?;
    let db = wrap(o.remove(2), params, x);
    let dw = wrap(o.remove(1), params, x);
    Ok((wrap(o.remove(0), x.shape().clone(), x), dw, db))
}

impl Tensor {
    /// dx of softmax given its output y = self and dy, in one kernel.
    pub(crate) fn softmax_backward(&self, dy: &Tensor) -> Result<Tensor> {
        let dy = dy.to_dtype(self.dtype())?;
        let mut o = run(FusedOp::SoftmaxBackward, &[self, &dy])?;
        Ok(wrap(o.remove(0), self.shape().clone(), self))
    }

    /// (dw, db) of a last-dim norm: column sums of dy xhat and dy, in the statistics dtype.
    pub(crate) fn norm_param_grads(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        kind: NormKind,
    ) -> Result<(Tensor, Tensor)> {
        let dy = dy.to_dtype(self.dtype())?;
        let mut o = run(FusedOp::NormParamGrads(kind), &[self, &dy, mean, rstd])?;
        let cols = self.dims().last().copied().unwrap_or(0);
        let db = wrap(o.remove(1), cols, self);
        Ok((wrap(o.remove(0), cols, self), db))
    }

    /// (dx, dw, db) of a last-dim norm in one pass over x and dy, all in x's dtype.
    pub(crate) fn norm_backward_params(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        kind: NormKind,
        weight: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let op = FusedOp::NormBackward {
            kind,
            weight: weight.is_some(),
        };
        let cols = self.dims().last().copied().unwrap_or(0);
        param_backward(op, self, dy, (mean, rstd), weight, cols)
    }

    /// adaLN modulation `x * (1 + scale) + shift` in one kernel (one rounding). x is (B, ..., D);
    /// shift and scale broadcast against it as (B, 1, ..., D) with B or D possibly 1. Other
    /// broadcasts, and non-float dtypes, go through `modulate_composite`.
    pub fn modulate(&self, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 || !self.dtype().is_float() {
            return self.modulate_composite(shift, scale);
        }
        if r == 2 {
            let (sh, sc) = (self.pad_rank(shift, 3)?, self.pad_rank(scale, 3)?);
            return match (sh, sc) {
                (Some(sh), Some(sc)) => self.unsqueeze(0)?.modulate(&sh, &sc)?.squeeze(0),
                _ => self.modulate_composite(shift, scale),
            };
        }
        let d = self.dims();
        let (b, e) = (d[0], d[r - 1]);
        let (Some(sh), Some(sc)) = (self.as_batch_rows(shift)?, self.as_batch_rows(scale)?) else {
            return self.modulate_composite(shift, scale);
        };
        let x = self.reshape((b, self.elem_count() / (b * e).max(1), e))?;
        let mut o = run(FusedOp::Modulate, &[&x, &sh, &sc])?;
        let rec = record(&[&x, &sh, &sc], || Op::Modulate {
            x: x.clone(),
            shift: sh.clone(),
            scale: sc.clone(),
        });
        let y = Tensor::from_storage(o.remove(0), x.shape().clone(), x.device().clone(), rec);
        y.reshape(self.shape().clone())
    }

    /// `x * (1 + scale) + shift` from primitives: the reference of the fused kernel.
    pub fn modulate_composite(&self, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        self.mul(&scale.add_scalar(1.0)?)?.add(shift)
    }

    /// `p` padded with leading 1s to `rank`, if it has at most that rank.
    fn pad_rank(&self, p: &Tensor, rank: usize) -> Result<Option<Tensor>> {
        if p.rank() > rank {
            return Ok(None);
        }
        let mut dims = vec![1; rank - p.rank()];
        dims.extend(p.dims());
        p.reshape(dims).map(Some)
    }

    /// A modulation parameter as a (B, D) tensor of self's dtype, when it broadcasts against
    /// self (B, ..., D) as (B or 1, 1, ..., D or 1).
    fn as_batch_rows(&self, p: &Tensor) -> Result<Option<Tensor>> {
        let r = self.rank();
        let (b, e) = (self.dims()[0], self.dims()[r - 1]);
        let Some(p) = self.pad_rank(p, r)? else {
            return Ok(None);
        };
        let pd = p.dims();
        let ok = pd[1..r - 1].iter().all(|&v| v == 1)
            && (pd[0] == 1 || pd[0] == b)
            && (pd[r - 1] == 1 || pd[r - 1] == e);
        if !ok {
            return Ok(None);
        }
        p.reshape((pd[0], pd[r - 1]))?
            .broadcast_as((b, e))?
            .to_dtype(self.dtype())
            .map(Some)
    }

    /// Rotates pairs `(x[2i], x[2i+1])` of the last dim of x (B, H, L, D) by `freqs`
    /// (B or 1, 1, L, D/2, 2, 2), BFL Flux's layout: (a, b) -> (f00 a + f01 b, f10 a + f11 b),
    /// computed in f32 (f64 for f64) in one kernel. Trainable rotations go through the
    /// composite, which differentiates them too.
    pub fn apply_rope(&self, freqs: &Tensor) -> Result<Tensor> {
        let d = self.dims();
        let fd = freqs.dims();
        let ok = d.len() == 4
            && d[3] % 2 == 0
            && fd.len() == 6
            && (fd[0] == 1 || fd[0] == d[0])
            && fd[1..] == [1, d[2], d[3] / 2, 2, 2];
        if !ok {
            return Err(Error::ShapeMismatch {
                op: "apply_rope",
                lhs: self.shape().clone(),
                rhs: freqs.shape().clone(),
            });
        }
        if !self.dtype().is_float() || freqs.requires_grad() {
            return self.apply_rope_composite(freqs);
        }
        let rot = freqs.to_dtype(stats_dtype(self.dtype()))?.reshape(vec![
            fd[0],
            d[2],
            d[3] / 2,
            2,
            2,
        ])?;
        self.rope_fused(&rot, false)
    }

    /// The rotation by rot (R, L, D/2, 2, 2), or by its transpose (the backward).
    pub(crate) fn rope_fused(&self, rot: &Tensor, transpose: bool) -> Result<Tensor> {
        let mut o = run(FusedOp::Rope { transpose }, &[self, rot])?;
        let rec = record(&[self], || Op::Rope {
            x: self.clone(),
            rot: rot.clone(),
            transpose,
        });
        Ok(Tensor::from_storage(
            o.remove(0),
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    /// `apply_rope` from primitives (in f32): the reference of the fused kernel.
    pub fn apply_rope_composite(&self, freqs: &Tensor) -> Result<Tensor> {
        let d = self.dims().to_vec();
        let pairs = self.to_dtype(stats_dtype(self.dtype()))?.reshape(vec![
            d[0],
            d[1],
            d[2],
            d[3] / 2,
            1,
            2,
        ])?;
        let f = freqs.to_dtype(pairs.dtype())?;
        let (f0, f1) = (
            f.narrow(5, 0, 1)?.squeeze(5)?,
            f.narrow(5, 1, 1)?.squeeze(5)?,
        );
        let (a, b) = (
            pairs.narrow(5, 0, 1)?.squeeze(5)?,
            pairs.narrow(5, 1, 1)?.squeeze(5)?,
        );
        f0.mul(&a)?
            .add(&f1.mul(&b)?)?
            .reshape(d)?
            .to_dtype(self.dtype())
    }

    /// The dims of an (N, C, ...) tensor whose channels split into `groups`.
    fn group_dims(&self, groups: usize) -> Result<Vec<usize>> {
        let dims = self.dims().to_vec();
        if dims.len() < 2 || groups == 0 || dims[1] % groups != 0 {
            return Err(Error::invalid(
                "group_norm",
                format!("{groups} groups do not divide the channels of an (N, C, ...) tensor"),
                self.shape(),
            ));
        }
        Ok(dims)
    }

    /// GroupNorm of (N, C, ...): statistics over each of `groups` channel groups and all
    /// trailing positions (in f64, saved in f32), per-channel weight and bias, in fused kernels.
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let dims = self.group_dims(groups)?;
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "group_norm",
                dtype: self.dtype(),
            });
        }
        let (n, c) = (dims[0], dims[1]);
        let param = |p: Option<&Tensor>| -> Result<Option<Tensor>> {
            match p {
                None => Ok(None),
                Some(p) if p.dims() == [c] => Ok(Some(p.to_dtype(self.dtype())?)),
                Some(p) => Err(Error::ShapeMismatch {
                    op: "group_norm",
                    lhs: self.shape().clone(),
                    rhs: p.shape().clone(),
                }),
            }
        };
        let (weight, bias) = (param(weight)?, param(bias)?);
        let x = self.reshape((n, c, self.elem_count() / (n * c).max(1)))?;
        let op = FusedOp::GroupNorm {
            groups,
            eps,
            weight: weight.is_some(),
            bias: bias.is_some(),
        };
        let mut args = vec![&x];
        args.extend(weight.iter().chain(bias.iter()));
        let mut o = run(op, &args)?;
        let mean = wrap(o.remove(1), (n, groups), self);
        let rstd = wrap(o.remove(1), (n, groups), self);
        let rec = record(&args, || Op::GroupNorm {
            x: x.clone(),
            weight: weight.clone(),
            bias: bias.clone(),
            mean,
            rstd,
            groups,
        });
        Tensor::from_storage(o.remove(0), x.shape().clone(), x.device().clone(), rec).reshape(dims)
    }

    /// GroupNorm from primitives (computed in f32): the reference of the fused kernels.
    pub fn group_norm_composite(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let dims = self.group_dims(groups)?;
        let x = self.to_dtype(stats_dtype(self.dtype()))?.reshape((
            dims[0],
            groups,
            self.elem_count() / dims[0] / groups,
        ))?;
        let mu = x.mean_keepdim(&[-1])?;
        let xc = x.sub(&mu)?;
        let var = xc.sqr()?.mean_keepdim(&[-1])?;
        let y = xc
            .mul(&var.add_scalar(eps)?.powf(-0.5)?)?
            .reshape(dims.clone())?;
        // Per-channel parameters broadcast as (C, 1, 1, ...).
        let mut pshape = vec![dims[1]];
        pshape.extend(std::iter::repeat_n(1, dims.len() - 2));
        let w = weight.map(|w| w.reshape(pshape.clone())).transpose()?;
        let b = bias.map(|b| b.reshape(pshape.clone())).transpose()?;
        self.affine_params(y, w.as_ref(), b.as_ref())
    }

    /// (dx, dw, db) of the fused GroupNorm, all in x's dtype (the weight's).
    pub(crate) fn group_norm_backward(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        weight: Option<&Tensor>,
        groups: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let op = FusedOp::GroupNormBackward {
            groups,
            weight: weight.is_some(),
        };
        param_backward(op, self, dy, (mean, rstd), weight, self.dims()[1])
    }

    /// (dx, dshift, dscale) of the fused modulation, all in x's dtype.
    pub(crate) fn modulate_backward(
        &self,
        dy: &Tensor,
        scale: &Tensor,
        params: bool,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let dy = dy.to_dtype(self.dtype())?;
        if !params {
            // dx = dy (1 + scale): the forward kernel with a zero shift.
            let zero = scale.zeros_like()?;
            let mut o = run(FusedOp::Modulate, &[&dy, &zero, scale])?;
            return Ok((wrap(o.remove(0), self.shape().clone(), self), None));
        }
        let mut o = run(FusedOp::ModulateBackward, &[self, &dy, scale])?;
        let bd = scale.shape().clone();
        let dscale = wrap(o.remove(2), bd.clone(), self);
        let dshift = wrap(o.remove(1), bd, self);
        Ok((
            wrap(o.remove(0), self.shape().clone(), self),
            Some((dshift, dscale)),
        ))
    }

    /// An FP8 E4M3 weight decoded into `dtype`: `self` holds the packed codes (rows, cols / 4)
    /// u32 and `scale` one f32 per row (`backend::fp8` describes the format). Returns a
    /// fresh (rows, cols) tensor, not recorded (fp8 weights are frozen).
    pub fn dequant_fp8(&self, scale: &Tensor, dtype: crate::DType) -> Result<Tensor> {
        let mut o = run(FusedOp::DequantFp8 { dtype }, &[self, scale])?;
        let rows = self.dims().first().copied().unwrap_or(0);
        let cols = self.dims().get(1).copied().unwrap_or(0) * crate::backend::fp8::CODES_PER_WORD;
        let w = o
            .pop()
            .ok_or_else(|| Error::invalid("dequant_fp8", "no output".to_string(), self.shape()))?;
        Ok(wrap(w, (rows, cols), self))
    }
}
