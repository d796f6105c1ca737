//! Primitive ops at the tensor level: check operands, broadcast, call the backend through the
//! storage, record the op for autograd when an input requires grad.

use super::{with2, with3, Tensor};
use crate::autograd::{kept_or_replayed, record, take_unread_product, KeptKind, Op};
use crate::backend::{BinaryOp, CmpOp, MatmulDims, ReduceOp, UnaryOp, Window2d};
use crate::shape::Dim;
use crate::{DType, Device, Error, Layout, Result, Shape};

fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device().location(),
            rhs: b.device().location(),
        });
    }
    Ok(())
}

fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

impl Tensor {
    // ----- elementwise --------------------------------------------------------------------

    pub(crate) fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let s = self.storage()?.unary(self.layout(), op)?;
        // sign is piecewise constant: its output carries no gradient.
        let rec = if matches!(op, UnaryOp::Sign) {
            None
        } else {
            record(&[self], || Op::Unary(self.clone(), op))
        };
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    /// `-x` elementwise.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    /// `1 / x` elementwise.
    pub fn recip(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Recip)
    }
    /// `e^x` elementwise.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    /// Natural logarithm, elementwise.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    /// Square root, elementwise.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    /// Sine (radians), elementwise.
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }
    /// Cosine (radians), elementwise.
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }
    /// Hyperbolic tangent, elementwise.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    /// The error function, elementwise.
    pub fn erf(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Erf)
    }
    /// `|x|` elementwise.
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    /// -1, 0 or 1 by the sign of each element; carries no gradient.
    pub fn sign(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sign)
    }
    /// `x * mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Affine { mul, add })
    }
    /// `x^e` elementwise.
    pub fn powf(&self, e: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Powf(e))
    }
    /// `x + v` elementwise.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    /// `x * v` elementwise.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }

    /// The operands broadcast to their common shape.
    pub(crate) fn broadcast_pair(
        &self,
        rhs: &Tensor,
        op: &'static str,
    ) -> Result<(Tensor, Tensor)> {
        if self.shape() == rhs.shape() {
            return Ok((self.clone(), rhs.clone()));
        }
        let shape = self.shape().broadcast_with(rhs.shape(), op)?;
        Ok((self.broadcast_as(shape.clone())?, rhs.broadcast_as(shape)?))
    }

    pub(crate) fn binary(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        same_device(op.name(), self, rhs)?;
        same_dtype(op.name(), self, rhs)?;
        let (a, b) = self.broadcast_pair(rhs, op.name())?;
        let s = with2(&a, &b, |x, y| x.binary(a.layout(), y, b.layout(), op))?;
        let rec = if op.is_activation_backward() {
            None
        } else {
            record(&[&a, &b], || Op::Binary(a.clone(), b.clone(), op))
        };
        Ok(Tensor::from_storage(
            s,
            a.shape().clone(),
            a.device().clone(),
            rec,
        ))
    }

    /// `self + rhs`, broadcasting; same dtype and device.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Add)
    }
    /// `self - rhs`, broadcasting; same dtype and device.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Sub)
    }
    /// `self * rhs` elementwise, broadcasting; same dtype and device.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Mul)
    }
    /// `self / rhs`, broadcasting; same dtype and device.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Div)
    }
    /// The larger of each pair, broadcasting (NaN if either is NaN).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Maximum)
    }
    /// The smaller of each pair, broadcasting (NaN if either is NaN).
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(rhs, BinaryOp::Minimum)
    }

    /// A 0-dim tensor of this one's dtype and device.
    pub(crate) fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::full(v, (), self.dtype(), self.device())
    }

    // ----- comparisons and where ----------------------------------------------------------

    /// 1 where the comparison holds, 0 elsewhere, in the inputs' dtype. Never differentiable.
    pub fn cmp(&self, rhs: &Tensor, op: CmpOp) -> Result<Tensor> {
        same_device("cmp", self, rhs)?;
        same_dtype("cmp", self, rhs)?;
        let (a, b) = {
            let _g = crate::no_grad();
            self.broadcast_pair(rhs, "cmp")?
        };
        let s = with2(&a, &b, |x, y| x.cmp(a.layout(), y, b.layout(), op))?;
        Ok(Tensor::from_storage(
            s,
            a.shape().clone(),
            a.device().clone(),
            None,
        ))
    }
    /// 1 where `self == rhs`, else 0 (see [`Tensor::cmp`]).
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Eq)
    }
    /// 1 where `self != rhs`, else 0.
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Ne)
    }
    /// 1 where `self < rhs`, else 0.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Lt)
    }
    /// 1 where `self <= rhs`, else 0.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Le)
    }
    /// 1 where `self > rhs`, else 0.
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Gt)
    }
    /// 1 where `self >= rhs`, else 0.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp(rhs, CmpOp::Ge)
    }
    /// Compares against a scalar.
    pub fn cmp_scalar(&self, v: f64, op: CmpOp) -> Result<Tensor> {
        self.cmp(&self.scalar_like(v)?, op)
    }

    /// `self != 0 ? on_true : on_false`, broadcasting all three.
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        same_device("where_cond", self, on_true)?;
        same_device("where_cond", self, on_false)?;
        same_dtype("where_cond", on_true, on_false)?;
        let shape = self
            .shape()
            .broadcast_with(on_true.shape(), "where_cond")?
            .broadcast_with(on_false.shape(), "where_cond")?;
        let m = self.detach().broadcast_as(shape.clone())?;
        let (t, f) = (
            on_true.broadcast_as(shape.clone())?,
            on_false.broadcast_as(shape.clone())?,
        );
        let s = with3(&m, &t, &f, |sm, st, sf| {
            sm.where_cond(m.layout(), st, t.layout(), sf, f.layout())
        })?;
        let rec = record(&[&t, &f], || Op::Where(m.clone(), t.clone(), f.clone()));
        Ok(Tensor::from_storage(s, shape, self.device().clone(), rec))
    }

    // ----- reductions ---------------------------------------------------------------------

    fn resolve_dims(&self, dims: &[impl Dim], op: &'static str) -> Result<Vec<usize>> {
        let mut out = dims
            .iter()
            .map(|d| d.resolve(self.shape(), op))
            .collect::<Result<Vec<_>>>()?;
        out.sort_unstable();
        if out.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                op,
                format!("dim listed twice in {out:?}"),
                self.shape(),
            ));
        }
        Ok(out)
    }

    fn reduce_keepdim(&self, op: ReduceOp, dims: Vec<usize>) -> Result<Tensor> {
        let s = self.storage()?.reduce(self.layout(), op, &dims)?;
        let mut out = self.dims().to_vec();
        for &d in &dims {
            out[d] = 1;
        }
        let rec = match op {
            ReduceOp::ArgMax | ReduceOp::ArgMin => None,
            _ => record(&[self], || Op::Reduce(self.clone(), op, dims.clone())),
        };
        Ok(Tensor::from_storage(
            s,
            Shape::new(out),
            self.device().clone(),
            rec,
        ))
    }

    fn squeeze_dims(&self, dims: &[usize]) -> Result<Tensor> {
        let out: Vec<usize> = self
            .dims()
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(i))
            .map(|(_, &d)| d)
            .collect();
        self.reshape(out)
    }

    /// Sum over `dims`, keeping them as size 1.
    pub fn sum_keepdim(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let d = self.resolve_dims(dims, "sum")?;
        self.reduce_keepdim(ReduceOp::Sum, d)
    }
    /// Sum over `dims`, removing them.
    pub fn sum(&self, dims: &[impl Dim]) -> Result<Tensor> {
        let d = self.resolve_dims(dims, "sum")?;
        self.reduce_keepdim(ReduceOp::Sum, d.clone())?
            .squeeze_dims(&d)
    }
    /// Sum of every element, as a 0-dim tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        self.reduce_keepdim(ReduceOp::Sum, all.clone())?
            .squeeze_dims(&all)
    }
    /// Maximum along `dim`, kept as size 1.
    pub fn max_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "max")?;
        self.reduce_keepdim(ReduceOp::Max, vec![d])
    }
    /// Maximum along `dim`, which is removed.
    pub fn max(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "max")?;
        self.reduce_keepdim(ReduceOp::Max, vec![d])?.squeeze(d)
    }
    /// Minimum along `dim`, kept as size 1.
    pub fn min_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "min")?;
        self.reduce_keepdim(ReduceOp::Min, vec![d])
    }
    /// Minimum along `dim`, which is removed.
    pub fn min(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "min")?;
        self.reduce_keepdim(ReduceOp::Min, vec![d])?.squeeze(d)
    }
    /// Maximum over every element, as a 0-dim tensor.
    pub fn max_all(&self) -> Result<Tensor> {
        let all: Vec<usize> = (0..self.rank()).collect();
        self.reduce_keepdim(ReduceOp::Max, all.clone())?
            .squeeze_dims(&all)
    }
    /// Index (u32) of the first maximum along `dim`, which is removed.
    pub fn argmax(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "argmax")?;
        self.reduce_keepdim(ReduceOp::ArgMax, vec![d])?.squeeze(d)
    }
    /// Index (u32) of the first maximum along `dim`, kept as size 1.
    pub fn argmax_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "argmax")?;
        self.reduce_keepdim(ReduceOp::ArgMax, vec![d])
    }
    /// Index (u32) of the first minimum along `dim`, which is removed.
    pub fn argmin(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "argmin")?;
        self.reduce_keepdim(ReduceOp::ArgMin, vec![d])?.squeeze(d)
    }

    // ----- dtype --------------------------------------------------------------------------

    /// The values converted to `dtype` (the same handle if it already is); gradients flow back
    /// between float dtypes.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let s = self.storage()?.cast(self.layout(), dtype)?;
        // Gradients flow between float dtypes; an integer result is cut from the graph.
        let rec = if dtype.is_float() {
            record(&[self], || Op::Cast(self.clone()))
        } else {
            None
        };
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    // ----- sliding windows --------------------------------------------------------------

    /// im2col: (N, C, H, W) -> (N, C * kh * kw, Ho * Wo), zeros in the padding.
    pub fn unfold2d(&self, w: Window2d) -> Result<Tensor> {
        let d = self.dims();
        let (n, c, h, wd) = match d {
            &[n, c, h, wd] => (n, c, h, wd),
            _ => {
                return Err(Error::invalid(
                    "unfold2d",
                    "needs an (N, C, H, W) tensor",
                    self.shape(),
                ))
            }
        };
        let (ho, wo) = w.out_size(h, wd).ok_or_else(|| {
            Error::invalid(
                "unfold2d",
                format!("window {w:?} does not fit"),
                self.shape(),
            )
        })?;
        let s = self.storage()?.unfold2d(self.layout(), w)?;
        let rec = record(&[self], || Op::Unfold2d(self.clone(), w));
        let shape = Shape::from((n, c * w.kernel.0 * w.kernel.1, ho * wo));
        Ok(Tensor::from_storage(s, shape, self.device().clone(), rec))
    }

    /// col2im, the adjoint of `unfold2d`: (N, C * kh * kw, Ho * Wo) -> (N, C, H, W), summing
    /// overlapping windows.
    pub fn fold2d(&self, w: Window2d, hw: (usize, usize)) -> Result<Tensor> {
        let k = w.kernel.0 * w.kernel.1;
        let (n, ck) = match self.dims() {
            &[n, ck, _] if k > 0 && ck % k == 0 => (n, ck),
            _ => {
                return Err(Error::invalid(
                    "fold2d",
                    format!("needs (N, C * {k}, L) columns"),
                    self.shape(),
                ))
            }
        };
        let s = self.storage()?.fold2d(self.layout(), w, hw)?;
        let rec = record(&[self], || Op::Fold2d(self.clone(), w));
        let shape = Shape::from((n, ck / k, hw.0, hw.1));
        Ok(Tensor::from_storage(s, shape, self.device().clone(), rec))
    }

    // ----- devices ------------------------------------------------------------------------

    /// A copy on `device` (self when already there). Gradients flow back across.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let s = device.storage_from_host(&self.to_host()?)?;
        let rec = record(&[self], || Op::ToDevice(self.clone()));
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            device.clone(),
            rec,
        ))
    }

    // ----- indexing -----------------------------------------------------------------------

    /// Picks entries `ids` (a u32 vector) along `dim`.
    pub fn index_select(&self, ids: &Tensor, dim: impl Dim) -> Result<Tensor> {
        same_device("index_select", self, ids)?;
        let d = dim.resolve(self.shape(), "index_select")?;
        let s = with2(self, ids, |x, i| {
            x.index_select(self.layout(), i, ids.layout(), d)
        })?;
        let mut out = self.dims().to_vec();
        out[d] = ids.elem_count();
        let rec = record(&[self], || Op::IndexSelect(self.clone(), ids.detach(), d));
        Ok(Tensor::from_storage(
            s,
            Shape::new(out),
            self.device().clone(),
            rec,
        ))
    }

    /// `out[i][j][k] = self[i][ids[i][j][k]][k]` for dim 1; `ids` (u32) has self's rank and
    /// self's sizes outside `dim`.
    pub fn gather(&self, ids: &Tensor, dim: impl Dim) -> Result<Tensor> {
        same_device("gather", self, ids)?;
        let d = dim.resolve(self.shape(), "gather")?;
        let s = with2(self, ids, |x, i| {
            x.gather(self.layout(), i, ids.layout(), d)
        })?;
        let rec = record(&[self], || Op::Gather(self.clone(), ids.detach(), d));
        Ok(Tensor::from_storage(
            s,
            ids.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    /// A copy of self with `src[i][j][k]` added at `[i][ids[i][j][k]][k]` for dim 1.
    pub fn scatter_add(&self, ids: &Tensor, src: &Tensor, dim: impl Dim) -> Result<Tensor> {
        same_device("scatter_add", self, ids)?;
        same_device("scatter_add", self, src)?;
        same_dtype("scatter_add", self, src)?;
        let d = dim.resolve(self.shape(), "scatter_add")?;
        let s = with3(self, ids, src, |x, i, y| {
            x.scatter_add(self.layout(), i, ids.layout(), y, src.layout(), d)
        })?;
        let rec = record(&[self, src], || {
            Op::ScatterAdd(self.clone(), ids.detach(), src.clone(), d)
        });
        Ok(Tensor::from_storage(
            s,
            self.shape().clone(),
            self.device().clone(),
            rec,
        ))
    }

    // ----- matmul -------------------------------------------------------------------------

    /// `(.., M, K) @ (.., K, N) -> (.., M, N)`, batch dims broadcast. A transposed operand
    /// reaches the backend as strides, not as a copy.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        same_device("matmul", self, rhs)?;
        same_dtype("matmul", self, rhs)?;
        let (ra, rb) = (self.rank(), rhs.rank());
        if ra < 2 || rb < 2 || self.dims()[ra - 1] != rhs.dims()[rb - 2] {
            return Err(Error::ShapeMismatch {
                op: "matmul",
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            });
        }
        let (m, k, n) = (self.dims()[ra - 2], self.dims()[ra - 1], rhs.dims()[rb - 1]);
        let batch = Shape::from(&self.dims()[..ra - 2])
            .broadcast_with(&Shape::from(&rhs.dims()[..rb - 2]), "matmul")?;
        let b = batch.elem_count();
        let with_batch = |tail: [usize; 2]| {
            let mut v = batch.dims().to_vec();
            v.extend_from_slice(&tail);
            v
        };
        let a3 = self.broadcast_as(with_batch([m, k]))?.reshape((b, m, k))?;
        let b3 = rhs.broadcast_as(with_batch([k, n]))?.reshape((b, k, n))?;
        let out = a3.matmul3(&b3)?;
        out.reshape(with_batch([m, n]))
    }

    /// `self @ rhs + bias`: self (..., M, K), rhs (K, N), bias (N) added to every row (a
    /// linear layer's forward). On CUDA, for bf16 / f16, one cuBLASLt GEMM with its bias
    /// epilogue instead of a GEMM and a pass over the output.
    pub fn matmul_bias(&self, rhs: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (lead, m, k, n) = linear_dims("matmul_bias", self, rhs)?;
        check_bias("matmul_bias", self, rhs, bias)?;
        let a3 = self.reshape((1, m, k))?;
        let b3 = rhs.reshape((1, k, n))?;
        let dims = MatmulDims { b: 1, m, k, n };
        let s = with3(&a3, &b3, bias, |x, y, z| {
            x.matmul_bias(a3.layout(), y, b3.layout(), dims, z, bias.layout())
        })?;
        let rec = record(&[&a3, &b3, bias], || Op::Addmm {
            c: None,
            a: a3.clone(),
            b: b3.clone(),
            bias: Some(bias.clone()),
        });
        let out = Tensor::from_storage(s, (1, m, n).into(), self.device().clone(), rec);
        out.reshape([lead, vec![n]].concat())
    }

    /// `self @ rhs (+ bias)`: self (..., M, K), rhs (K, N), bias (N); a linear layer's
    /// base GEMM, recorded as one product (`Op::Addmm`) whatever the bias. With `keep` not
    /// empty, the output is one a checkpoint may keep as those kinds (`crate::autograd::Keep`):
    /// logged in a keeping checkpoint's forward and, in its re-run, taken from the log
    /// instead of computed, the graph recorded as if computed (so gradients flow to self, rhs
    /// and bias alike). Also returns whether the output came from the log and nothing was
    /// recorded (nothing of the product needs a gradient): then `rhs` was not read at all.
    pub(crate) fn linear_product(
        &self,
        rhs: &Tensor,
        bias: Option<&Tensor>,
        keep: &[KeptKind],
    ) -> Result<(Tensor, bool)> {
        let (lead, m, k, n) = linear_dims("linear", self, rhs)?;
        let a3 = self.reshape((1, m, k))?;
        let b3 = rhs.reshape((1, k, n))?;
        let compute = || -> Result<Vec<Tensor>> {
            let _g = crate::no_grad();
            Ok(vec![match bias {
                Some(b) => self.matmul_bias(rhs, b)?.reshape((1, m, n))?,
                None => a3.matmul3(&b3)?,
            }])
        };
        // A product no gradient of this checkpoint re-run reads (`autograd::unread_product`):
        // zeros in its place.
        let (y, replayed) = if take_unread_product() {
            (
                vec![Tensor::zeros((1, m, n), self.dtype(), self.device())?],
                true,
            )
        } else {
            kept_or_replayed(keep, compute)?
        };
        let [y] = <[Tensor; 1]>::try_from(y).map_err(|v| {
            Error::Autograd(format!("kept linear: {} tensors, expected 1", v.len()))
        })?;
        if y.dims() != [1, m, n] || y.dtype() != self.dtype() {
            return Err(Error::Autograd(format!(
                "kept linear output {:?} {} does not fit this call (1, {m}, {n}) {}: the \
                 checkpoint's re-run differs from its forward",
                y.dims(),
                y.dtype(),
                self.dtype()
            )));
        }
        let mut inputs = vec![&a3, &b3];
        inputs.extend(bias);
        let rec = record(&inputs, || Op::Addmm {
            c: None,
            a: a3.clone(),
            b: b3.clone(),
            bias: bias.cloned(),
        });
        let unread = replayed && rec.is_none();
        let y = y
            .view(y.layout().clone(), rec)
            .reshape([lead, vec![n]].concat())?;
        Ok((y, unread))
    }

    /// `self + a @ b`: self (..., M, N), a (..., M, K) with the same leading dims, b (K, N).
    /// Takes `self` by value: when nothing else holds its buffer (the output of a GEMM that
    /// the tape does not keep, as a linear layer's base output is), the product is added
    /// into that buffer by one GEMM with beta = 1 on CUDA, with no separate pass for the add;
    /// otherwise into a copy of it.
    pub fn add_matmul(self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.add_matmul_bias(a, b, None)
    }

    /// `self + a @ b + bias` (`add_matmul` with `bias` (N) broadcast over the rows): on CUDA
    /// the bias rides in the same GEMM's epilogue (bf16, f16), so a layer whose bias was
    /// left out of its base product adds it with no pass of its own.
    pub fn add_matmul_bias(self, a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (lead, m, k, n) = linear_dims("add_matmul", a, b)?;
        same_device("add_matmul", &self, a)?;
        same_dtype("add_matmul", &self, a)?;
        if self.dims() != [lead.clone(), vec![n]].concat() {
            return Err(Error::ShapeMismatch {
                op: "add_matmul",
                lhs: self.shape().clone(),
                rhs: a.shape().clone(),
            });
        }
        if let Some(bias) = bias {
            check_bias("add_matmul", a, b, bias)?;
        }
        let (a3, b3) = (a.reshape((1, m, k))?, b.reshape((1, k, n))?);
        let c3 = self.reshape((1, m, n))?;
        drop(self);
        let mut inputs = vec![&c3, &a3, &b3];
        inputs.extend(bias);
        let rec = record(&inputs, || Op::Addmm {
            c: Some(c3.clone()),
            a: a3.clone(),
            b: b3.clone(),
            bias: bias.cloned(),
        });
        let dims = MatmulDims { b: 1, m, k, n };
        let device = c3.device().clone();
        let bias_storage = bias.map(|t| t.storage()).transpose()?;
        let acc = |acc: &mut crate::device::Storage| {
            let bias = bias_storage
                .as_ref()
                .zip(bias)
                .map(|(s, t)| (&**s, t.layout()));
            with2(&a3, &b3, |x, y| {
                x.matmul_acc(a3.layout(), y, b3.layout(), dims, bias, acc)
            })
        };
        let out = match c3.into_exclusive_storage() {
            Ok(buf) => {
                {
                    let mut g = buf.write().map_err(|_| Error::Poisoned("tensor storage"))?;
                    acc(&mut g)?;
                }
                Tensor::view_of_storage(buf, Layout::contiguous((1, m, n)), device, rec)
            }
            Err(c3) => {
                let mut s = c3.storage()?.copy_contiguous(c3.layout())?;
                acc(&mut s)?;
                Tensor::from_storage(s, (1, m, n).into(), device, rec)
            }
        };
        out.reshape([lead, vec![n]].concat())
    }

    /// The primitive: rank-3 operands with equal batch.
    pub(crate) fn matmul3(&self, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = (self.dims(), rhs.dims());
        let dims = MatmulDims {
            b: a[0],
            m: a[1],
            k: a[2],
            n: b[2],
        };
        // A product no gradient of this checkpoint re-run reads (`autograd::unread_product`):
        // zeros in its place, its backward recorded as usual.
        if take_unread_product() {
            let z = Tensor::zeros((dims.b, dims.m, dims.n), self.dtype(), self.device())?;
            let rec = record(&[self, rhs], || Op::Matmul(self.clone(), rhs.clone()));
            return Ok(z.view(z.layout().clone(), rec));
        }
        let s = with2(self, rhs, |x, y| {
            x.matmul(self.layout(), y, rhs.layout(), dims)
        })?;
        let rec = record(&[self, rhs], || Op::Matmul(self.clone(), rhs.clone()));
        let shape = Layout::contiguous((dims.b, dims.m, dims.n)).shape().clone();
        Ok(Tensor::from_storage(s, shape, self.device().clone(), rec))
    }
}

/// A bias (N) for `a` (..., M, K) times `b` (K, N): on `a`'s device, in its dtype, N long.
fn check_bias(op: &'static str, a: &Tensor, b: &Tensor, bias: &Tensor) -> Result<()> {
    same_device(op, a, bias)?;
    same_dtype(op, a, bias)?;
    if bias.dims() != [b.dims()[1]] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: b.shape().clone(),
            rhs: bias.shape().clone(),
        });
    }
    Ok(())
}

/// (leading dims, M, K, N) of `a` (..., M, K) times `b` (K, N), after the device, dtype and
/// shape checks.
fn linear_dims(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
) -> Result<(Vec<usize>, usize, usize, usize)> {
    same_device(op, a, b)?;
    same_dtype(op, a, b)?;
    let r = a.rank();
    if r < 1 || b.rank() != 2 || a.dims()[r - 1] != b.dims()[0] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        });
    }
    let lead = a.dims()[..r - 1].to_vec();
    Ok((
        lead.clone(),
        lead.iter().product(),
        b.dims()[0],
        b.dims()[1],
    ))
}

#[cfg(all(test, feature = "cpu-ref"))]
mod tests {
    use crate::{DType, Device, Result, Tensor};
    use std::sync::Arc;

    fn buffer(t: &Tensor) -> usize {
        t.0.storage.as_ref().map_or(0, |s| Arc::as_ptr(s) as usize)
    }

    #[test]
    fn add_matmul_sums_into_an_exclusive_buffer_and_copies_a_shared_one() -> Result<()> {
        let dev = Device::Cpu;
        let (x, w) = (
            Tensor::randn((3, 4), DType::F32, &dev, 1)?,
            Tensor::randn((4, 5), DType::F32, &dev, 2)?,
        );
        let (a, b) = (
            Tensor::randn((3, 2), DType::F32, &dev, 3)?,
            Tensor::randn((2, 5), DType::F32, &dev, 4)?,
        );
        let want = x.matmul(&w)?.add(&a.matmul(&b)?)?.to_vec_f64()?;
        let close = |t: &Tensor| -> Result<()> {
            for (g, w) in t.to_vec_f64()?.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
            Ok(())
        };
        // A fresh GEMM output that nothing else holds: the sum lands in its buffer.
        let c = x.matmul(&w)?;
        let before = buffer(&c);
        let out = c.add_matmul(&a, &b)?;
        assert_eq!(buffer(&out), before);
        close(&out)?;
        // A clone kept elsewhere: its values stay, the sum goes to a new buffer.
        let c = x.matmul(&w)?;
        let kept = c.clone();
        let kept_vals = kept.to_vec_f64()?;
        let out = c.add_matmul(&a, &b)?;
        assert_ne!(buffer(&out), buffer(&kept));
        assert_eq!(kept.to_vec_f64()?, kept_vals);
        close(&out)?;
        // A view (transposed) of another tensor: copied as well.
        let ct = x.matmul(&w)?.t()?.contiguous()?.t()?;
        let out = ct.add_matmul(&a, &b)?;
        close(&out)?;
        Ok(())
    }
}
