//! SwiGLU over the two halves of a projection's output, `y = silu(a) u` with `x = [a | u]`
//! along the last dim, in one kernel (one rounding), with its backward in one kernel that
//! writes both halves' gradients side by side as x's: `da = g u silu'(a)`, `du = g silu(a)`,
//! `silu'(a) = s (1 + a (1 - s))`, `s = sigmoid(a)`. The kernels are cuda/fused.cu's
//! `swiglu_fwd` and `swiglu_bwd`; they read x in place as rows of any pitch (the MLP half of a
//! fused projection, a narrow of it), and the backward its g likewise (the MLP's slice of the
//! gradient of the product's input). `Tensor::swiglu_composite` is the reference of both
//! backends.
//!
//! Beside the composite (a SiLU, a product, and in the backward two products, SiLU's
//! backward and the copy laying the halves' gradients side by side) it launches one kernel
//! each way and keeps nothing but x for the backward.

use crate::autograd::{plain, recorded, run_kernel, FusedKernel};
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Layout, Result, Tensor};

/// [x (R, 2 M)] -> [y (R, M)].
pub(crate) struct SwiGlu;

/// [x (R, 2 M), g (R, M)] -> [dx (R, 2 M)], in x's dtype.
pub(crate) struct SwiGluBackward;

/// The operands of either: [R, M].
fn check(name: &'static str, args: &[(DType, &Layout)], backward: bool) -> Result<Vec<usize>> {
    let o = Operands::new(name, args, 1 + usize::from(backward))?;
    let d = o.dims(2, "(R, 2 M)")?;
    if d[1] % 2 != 0 {
        return Err(o.invalid(format!("needs an even last dim, got {}", d[1])));
    }
    let (r, m) = (d[0], d[1] / 2);
    if backward {
        o.expect(1, o.dtype(), &[r, m])?;
    }
    Ok(vec![r, m])
}

/// `sigmoid(a)` as the kernels compute it: `(1 + tanh(a / 2)) / 2`.
#[cfg(feature = "cpu-ref")]
fn sigmoid(a: f64) -> f64 {
    0.5 * (1.0 + (0.5 * a).tanh())
}

/// An operand's pointer and row pitch when its rows are unit-stride (read in place), else a dense copy
/// (kept in `copy`) and 2 M.
#[cfg(feature = "cuda")]
fn rows_view(
    name: &'static str,
    s: &crate::backend::cuda::CudaStorage,
    l: &Layout,
    copy: &mut Option<crate::backend::cuda::CudaStorage>,
) -> Result<(u64, usize)> {
    use crate::backend::cuda::kit::ptr;
    s.check(name, l)?;
    let (st, d) = (l.strides(), l.dims());
    if st[1] == 1 && (d[0] == 1 || st[0] >= d[1]) {
        let bytes = s.buf.dtype().size_in_bytes();
        return Ok((ptr(s) + (l.offset() * bytes) as u64, st[0].max(d[1])));
    }
    let c = s.contiguous(l)?;
    let p = ptr(&c);
    *copy = Some(c);
    Ok((p, d[1]))
}

/// The operands of either kernel as dense views: x (R, 2 M), and for the backward g (R, M).
#[cfg(feature = "cuda")]
fn dense_views<'a>(
    dims: &[usize],
    args: &[&'a crate::backend::cuda::CudaStorage],
) -> Vec<(&'a crate::backend::cuda::CudaStorage, Layout)> {
    let widths = [2 * dims[1], dims[1]];
    args.iter()
        .zip(widths)
        .map(|(&s, w)| (s, Layout::contiguous(crate::Shape::from(&[dims[0], w][..]))))
        .collect()
}

/// Either kernel on CUDA, by its `name`: `swiglu_fwd` over [x] -> [y (R, M)], or
/// `swiglu_bwd` over [x, g] -> [dx (R, 2 M)]; x and g read in place (`rows_view`).
#[cfg(feature = "cuda")]
fn swiglu_cuda(
    name: &'static str,
    dims: &[usize],
    args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
    use crate::backend::cuda::kit::{by_dtype, grid_for, launch, Elem};
    use crate::backend::cuda::CudaStorage;
    use crate::Error;
    fn run<T: Elem>(
        name: &'static str,
        d: &[usize],
        a: &[(&CudaStorage, &Layout)],
    ) -> Result<Vec<CudaStorage>> {
        let (x, dev) = (a[0].0, &a[0].0.dev);
        let (r, m) = (d[0], d[1]);
        let mut copy = None;
        let (px, ld) = rows_view(name, x, a[0].1, &mut copy)?;
        let grid = grid_for((r * m).div_ceil(8), dev.sm_count().max(1));
        let Some((g, lg)) = a.get(1) else {
            let mut y = dev.alloc::<T>(r * m)?;
            launch!(
                dev,
                "fused",
                format!("swiglu_fwd_{}", T::SFX),
                grid,
                &px,
                &mut *y.slice,
                &r,
                &m,
                &ld
            )?;
            return Ok(vec![x.wrap(T::wrap(y))]);
        };
        // g read in place too: the MLP's slice of `linear2`'s input gradient in FLUX.2's
        // single blocks.
        let mut gcopy = None;
        let (pg, ldg) = rows_view(name, g, lg, &mut gcopy)?;
        let mut dx = dev.alloc::<T>(r * 2 * m)?;
        launch!(
            dev,
            "fused",
            format!("swiglu_bwd_{}", T::SFX),
            grid,
            &px,
            &pg,
            &mut *dx.slice,
            &r,
            &m,
            &ld,
            &ldg
        )?;
        Ok(vec![x.wrap(T::wrap(dx))])
    }
    by_dtype!(args[0].0.buf.dtype(), run(name, dims, args), u32 => Err(Error::UnsupportedDType {
        op: name,
        dtype: DType::U32,
    }))
}

impl Kernel for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check(self.name(), args, false)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let x = f64_view(args[0].0, args[0].1);
        let (r, m) = (dims[0], dims[1]);
        let mut y = Vec::with_capacity(r * m);
        for row in x.chunks_exact(2 * m) {
            let (a, u) = row.split_at(m);
            y.extend(a.iter().zip(u).map(|(&a, &u)| a * sigmoid(a) * u));
        }
        Ok(vec![from_f64_vec(y, args[0].0.dtype())])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let views = dense_views(dims, args);
        let views: Vec<_> = views.iter().map(|(s, l)| (*s, l)).collect();
        swiglu_cuda(self.name(), dims, &views)
    }

    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        swiglu_cuda(self.name(), dims, args)
    }
}

impl FusedKernel for SwiGlu {
    /// Both halves' gradients read both halves.
    fn reads_inputs(&self, _needs_grad: &[bool]) -> Vec<bool> {
        vec![true]
    }

    fn vjp(
        &self,
        inputs: &[Tensor],
        _kept: &[Tensor],
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let x = &inputs[0];
        let g = g.to_dtype(x.dtype())?;
        let mut o = run_kernel(&SwiGluBackward, &[x, &g])?;
        Ok(vec![Some(plain(o.remove(0), x.shape().clone(), x))])
    }
}

impl Kernel for SwiGluBackward {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check(self.name(), args, true)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let x = f64_view(args[0].0, args[0].1);
        let g = f64_view(args[1].0, args[1].1);
        let (r, m) = (dims[0], dims[1]);
        let mut dx = vec![0.0; r * 2 * m];
        for ((row, g), dx) in x
            .chunks_exact(2 * m)
            .zip(g.chunks_exact(m))
            .zip(dx.chunks_exact_mut(2 * m))
        {
            let (a, u) = row.split_at(m);
            let (da, du) = dx.split_at_mut(m);
            for k in 0..m {
                let s = sigmoid(a[k]);
                da[k] = g[k] * u[k] * (s * (1.0 + a[k] * (1.0 - s)));
                du[k] = g[k] * a[k] * s;
            }
        }
        Ok(vec![from_f64_vec(dx, args[0].0.dtype())])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let views = dense_views(dims, args);
        let views: Vec<_> = views.iter().map(|(s, l)| (*s, l)).collect();
        swiglu_cuda(self.name(), dims, &views)
    }

    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        swiglu_cuda(self.name(), dims, args)
    }
}

impl Tensor {
    /// SwiGLU over the last dim: (..., 2 M) -> (..., M), `silu(first half) * second half`, in
    /// one kernel each way (the gradient of both halves written side by side). Non-float
    /// dtypes, an odd last dim and views whose rows cannot be read as such go through
    /// `swiglu_composite`.
    pub fn swiglu(&self) -> Result<Tensor> {
        let r = self.rank();
        let w = self.dims().last().copied().unwrap_or(0);
        if r == 0 || w == 0 || w % 2 != 0 || !self.dtype().is_float() || self.elem_count() == 0 {
            return self.swiglu_composite();
        }
        let rows = self.elem_count() / w;
        if self
            .layout()
            .reshape(&crate::Shape::from((rows, w)))
            .is_none()
        {
            return self.swiglu_composite();
        }
        let x = self.reshape((rows, w))?;
        let mut o = run_kernel(&SwiGlu, &[&x])?;
        let y = recorded(SwiGlu, o.remove(0), (rows, w / 2), &[&x], &[]);
        let mut dims = self.dims().to_vec();
        dims[r - 1] = w / 2;
        y.reshape(dims)
    }

    /// SwiGLU from primitives: the reference of the fused kernel.
    pub fn swiglu_composite(&self) -> Result<Tensor> {
        let last = self.rank().saturating_sub(1);
        let m = self.dims().get(last).copied().unwrap_or(0) / 2;
        self.narrow(last, 0, m)?
            .silu()?
            .mul(&self.narrow(last, m, m)?)
    }
}
