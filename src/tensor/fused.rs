//! Layers with fused kernels of the `FusedOp` enum: GroupNorm, plus the fused backward pieces
//! of softmax and the norms (adaLN modulation and RoPE are kernel files of `kernels/`). Each has a composite twin written from
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
