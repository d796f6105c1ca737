//! The fused kernels of the `FusedOp` enum that are not yet kernel files of `kernels/`: the
//! backward pieces of softmax and the norms, and the FP8 decode. Each has a composite twin written from
//! primitives, kept as its reference (tests compare the two on every backend).

use super::Tensor;
use crate::backend::{FusedOp, NormKind};
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
