//! Composite ops, written once from primitives. They need no backward code: autograd records
//! their primitives. A backend may later add a fused kernel; this code stays its reference.
//! Norms compute in f32 (f64 stays f64) and cast back, as PyTorch's kernels do.

use super::Tensor;
use crate::backend::NormKind;
use crate::shape::Dim;
use crate::{DType, Error, Result, Shape};

// sqrt(2 / pi) and 0.044715: the tanh approximation of GELU (Hendrycks & Gimpel, 2016).
const GELU_TANH_SCALE: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_CUBIC: f64 = 0.044_715;

impl Tensor {
    /// `x * x` elementwise.
    pub fn sqr(&self) -> Result<Tensor> {
        self.mul(self)
    }

    /// Mean over `dims`, keeping them as size 1.
    pub fn mean_keepdim(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let s = self.sum_keepdim(dims)?;
        let n = self.elem_count() / s.elem_count().max(1);
        s.affine(1.0 / n as f64, 0.0)
    }

    /// Mean over `dims`, removing them.
    pub fn mean(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let s = self.sum(dims)?;
        let n = self.elem_count() / s.elem_count().max(1);
        s.affine(1.0 / n as f64, 0.0)
    }

    /// Mean of every element, as a 0-dim tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.sum_all()?
            .affine(1.0 / self.elem_count().max(1) as f64, 0.0)
    }

    /// Biased variance (divides by n), keeping the reduced dims.
    pub fn var_keepdim(&self, dims: &[impl Dim]) -> Result<Tensor> {
        self.sub(&self.mean_keepdim(dims)?)?
            .sqr()?
            .mean_keepdim(dims)
    }

    /// Each element limited to `[lo, hi]`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        self.maximum(&self.scalar_like(lo)?)?
            .minimum(&self.scalar_like(hi)?)
    }

    /// max(x, 0); the derivative at 0 is 0, as in PyTorch.
    pub fn relu(&self) -> Result<Tensor> {
        // Zero on the left: maximum gives ties to its left operand.
        self.scalar_like(0.0)?.maximum(self)
    }

    /// 1 / (1 + e^-x), as (1 + tanh(x / 2)) / 2: no overflow for any x.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.affine(0.5, 0.0)?.tanh()?.affine(0.5, 0.5)
    }

    /// x * sigmoid(x), through the fused kernel (forward and backward).
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(crate::UnaryOp::Silu)
    }

    /// x * sigmoid(x) from primitives: the reference of the fused kernel.
    pub fn silu_composite(&self) -> Result<Tensor> {
        self.mul(&self.sigmoid()?)
    }

    /// x/2 (1 + erf(x / sqrt 2)): the exact GELU, through the fused kernel.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary(crate::UnaryOp::Gelu)
    }

    /// The exact GELU from primitives: the reference of the fused kernel.
    pub fn gelu_composite(&self) -> Result<Tensor> {
        let cdf = self
            .affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?
            .erf()?
            .affine(0.5, 0.5)?;
        self.mul(&cdf)
    }

    /// x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GELU's tanh approximation, through the
    /// fused kernel.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.unary(crate::UnaryOp::GeluTanh)
    }

    /// GELU's tanh approximation from primitives: the reference of the fused kernel.
    pub fn gelu_tanh_composite(&self) -> Result<Tensor> {
        let inner = self.add(&self.powf(3.0)?.affine(GELU_TANH_CUBIC, 0.0)?)?;
        let t = inner
            .affine(GELU_TANH_SCALE, 0.0)?
            .tanh()?
            .affine(0.5, 0.5)?;
        self.mul(&t)
    }

    /// exp(x - max) / sum(exp(x - max)) along `dim`, through the backend's fused kernel (one
    /// read, one write); a dim other than the last is moved last and back.
    pub fn softmax(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "softmax")?;
        let last = self.rank().saturating_sub(1);
        if d != last {
            return self.transpose(d, last)?.softmax(last)?.transpose(d, last);
        }
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "softmax",
                dtype: self.dtype(),
            });
        }
        let s = self.storage()?.softmax_last_dim(self.layout())?;
        let rec = crate::autograd::record(&[self], || crate::autograd::Op::Softmax(self.clone()));
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    /// The composite softmax from primitives: the reference of the fused kernel.
    pub fn softmax_composite(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "softmax")?;
        // The shift cancels in the ratio: detaching it keeps it out of the graph.
        let z = self.sub(&self.max_keepdim(d)?.detach())?;
        let e = z.exp()?;
        e.div(&e.sum_keepdim(&[d])?)
    }

    /// x - max - log(sum(exp(x - max))) along `dim`.
    pub fn log_softmax(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "log_softmax")?;
        let z = self.sub(&self.max_keepdim(d)?.detach())?;
        z.sub(&z.exp()?.sum_keepdim(&[d])?.log()?)
    }

    /// The dtype norms compute in.
    fn norm_dtype(&self) -> DType {
        if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// The fused normalization of each last-dim row with an optional per-column weight and
    /// bias applied in the kernel (one read, one write, one rounding; statistics saved in f32,
    /// f64 for f64 inputs, for the backward).
    pub(crate) fn norm_fused(
        &self,
        kind: NormKind,
        eps: f64,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "norm",
                dtype: self.dtype(),
            });
        }
        let cols = self.dims().last().copied().unwrap_or(1);
        let param = |p: Option<&Tensor>| -> Result<Option<Tensor>> {
            match p {
                None => Ok(None),
                Some(p) if p.dims() == [cols] => Ok(Some(p.to_dtype(self.dtype())?.dense()?)),
                Some(p) => Err(Error::ShapeMismatch {
                    op: "norm",
                    lhs: self.shape().clone(),
                    rhs: p.shape().clone(),
                }),
            }
        };
        let (weight, bias) = (param(weight)?, param(bias)?);
        let (y, mean, rstd) = {
            let (ws, bs) = (
                weight.as_ref().map(|w| w.storage()).transpose()?,
                bias.as_ref().map(|b| b.storage()).transpose()?,
            );
            self.storage()?
                .norm_last_dim(self.layout(), kind, eps, ws.as_deref(), bs.as_deref())?
        };
        let rows = Shape::from(&self.dims()[..self.rank().saturating_sub(1)]);
        let mean = Tensor::from_storage(mean, rows.clone(), self.device().clone(), None);
        let rstd = Tensor::from_storage(rstd, rows, self.device().clone(), None);
        let mut inputs = vec![self];
        inputs.extend(weight.iter().chain(bias.iter()));
        let rec = crate::autograd::record(&inputs, || crate::autograd::Op::Norm {
            x: self.clone(),
            weight: weight.clone(),
            bias: bias.clone(),
            mean,
            rstd,
            kind,
        });
        Ok(Tensor::from_storage(
            y,
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    /// dx of `norm_fused` given dy, its saved statistics and its weight.
    pub(crate) fn norm_backward(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        kind: NormKind,
        weight: Option<&Tensor>,
    ) -> Result<Tensor> {
        let dy = dy.to_dtype(self.dtype())?;
        let s = {
            let (x, g, m, r) = (
                self.storage()?,
                dy.storage()?,
                mean.storage()?,
                rstd.storage()?,
            );
            let w = weight.map(|w| w.storage()).transpose()?;
            x.norm_last_dim_backward(self.layout(), &g, dy.layout(), &m, &r, kind, w.as_deref())?
        };
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            self.device().clone(),
            None,
        ))
    }

    /// LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias, through the
    /// fused kernel.
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.norm_fused(NormKind::Layer, eps, weight, bias)
    }

    /// RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, through the fused kernel.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        self.norm_fused(NormKind::Rms, eps, weight, None)
    }

    /// LayerNorm from primitives (computed in f32): the reference of the fused kernel.
    pub fn layer_norm_composite(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let x = self.to_dtype(self.norm_dtype())?;
        let mu = x.mean_keepdim(&[-1])?;
        let xc = x.sub(&mu)?;
        let var = xc.sqr()?.mean_keepdim(&[-1])?;
        let y = xc.mul(&var.add_scalar(eps)?.powf(-0.5)?)?;
        self.affine_params(y, weight, bias)
    }

    /// RMSNorm from primitives (computed in f32): the reference of the fused kernel.
    pub fn rms_norm_composite(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let x = self.to_dtype(self.norm_dtype())?;
        let ms = x.sqr()?.mean_keepdim(&[-1])?;
        let y = x.mul(&ms.add_scalar(eps)?.powf(-0.5)?)?;
        self.affine_params(y, weight, None)
    }

    /// `y * weight + bias` in y's dtype, cast back to self's dtype.
    pub(super) fn affine_params(
        &self,
        y: Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let mut y = y;
        if let Some(w) = weight {
            y = y.mul(&w.to_dtype(y.dtype())?)?;
        }
        if let Some(b) = bias {
            y = y.add(&b.to_dtype(y.dtype())?)?;
        }
        y.to_dtype(self.dtype())
    }

    /// mean((self - target)^2)
    pub fn mse_loss(&self, target: &Tensor) -> Result<Tensor> {
        if self.shape() != target.shape() {
            return Err(Error::ShapeMismatch {
                op: "mse_loss",
                lhs: self.shape().clone(),
                rhs: target.shape().clone(),
            });
        }
        self.sub(target)?.sqr()?.mean_all()
    }

    /// Mean cross entropy of (N, C) logits against (N,) u32 class indices.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 || targets.dims() != [self.dims()[0]] {
            return Err(Error::ShapeMismatch {
                op: "cross_entropy",
                lhs: self.shape().clone(),
                rhs: targets.shape().clone(),
            });
        }
        let lp = self.log_softmax(1)?;
        lp.gather(&targets.unsqueeze(1)?, 1)?.mean_all()?.neg()
    }
}
