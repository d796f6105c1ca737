//! adaLN modulation, `y = x (1 + scale) + shift`, in one kernel (one rounding), with its
//! backward: dx = dy (1 + scale), dshift = sum_L dy, dscale = sum_L dy x. The kernels are
//! cuda/fused.cu's `modulate_fwd` and `modulate_bwd` (column sums by row blocks, or swept
//! with f64 partials, added in a fixed order); `Tensor::modulate_composite` is the reference
//! of both backends.

use crate::autograd::{plain, recorded, run_kernel, FusedKernel};
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Layout, Result, Tensor};

/// [x (B, L, D), shift, scale (B, D)], one dtype -> [y (B, L, D)].
pub(crate) struct Modulate;

/// [x, dy (B, L, D), scale (B, D)] -> [dx (B, L, D), dshift, dscale (B, D)], all in x's
/// dtype (the autograd needs no cast after it).
pub(crate) struct ModulateBackward;

/// The operands of either: [B, L, D] and each operand's dims.
fn check(name: &'static str, args: &[(DType, &Layout)], backward: bool) -> Result<Vec<usize>> {
    let o = Operands::new(name, args, 3)?;
    let d = o.dims(3, "(B, L, D)")?;
    let bd = [d[0], d[2]];
    o.expect(1, o.dtype(), if backward { d } else { &bd })?;
    o.expect(2, o.dtype(), &bd)?;
    Ok(d.to_vec())
}

impl Kernel for Modulate {
    fn name(&self) -> &'static str {
        "modulate"
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
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let (x, shift, scale) = (&v[0], &v[1], &v[2]);
        let (l, d) = (dims[1], dims[2]);
        let y = x
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let p = i / (l * d) * d + i % d;
                x * (1.0 + scale[p]) + shift[p]
            })
            .collect();
        Ok(vec![from_f64_vec(y, args[0].0.dtype())])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        use crate::backend::cuda::kit::{by_dtype, grid_for, launch, ptr, Elem};
        use crate::backend::cuda::CudaStorage;
        use crate::Error;
        fn run<T: Elem>(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
            let (x, dev) = (a[0], &a[0].dev);
            let (b, l, dd) = (d[0], d[1], d[2]);
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let mut y = dev.alloc::<T>(b * l * dd)?;
            launch!(
                dev,
                "fused",
                format!("modulate_fwd_{}", T::SFX),
                grid_for((b * l * dd).div_ceil(8), dev.sm_count().max(1)),
                &p[0],
                &p[1],
                &p[2],
                &mut *y.slice,
                &b,
                &l,
                &dd
            )?;
            Ok(vec![x.wrap(T::wrap(y))])
        }
        by_dtype!(args[0].buf.dtype(), run(dims, args), u32 => Err(Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl FusedKernel for Modulate {
    /// dx = g (1 + scale) reads scale; dscale = sum g x reads x; shift is never read.
    fn reads_inputs(&self, needs_grad: &[bool]) -> Vec<bool> {
        let params = needs_grad.get(1..).is_some_and(|p| p.iter().any(|&n| n));
        vec![params, false, true]
    }

    fn vjp(
        &self,
        inputs: &[Tensor],
        _kept: &[Tensor],
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (x, shift, scale) = (&inputs[0], &inputs[1], &inputs[2]);
        let params = shift.requires_grad() || scale.requires_grad();
        let (dx, dp) = x.modulate_backward(g, scale, params)?;
        Ok(match dp {
            Some((dshift, dscale)) => vec![
                Some(dx),
                Some(dshift.to_dtype(shift.dtype())?),
                Some(dscale.to_dtype(scale.dtype())?),
            ],
            None => vec![Some(dx), None, None],
        })
    }
}

impl Kernel for ModulateBackward {
    fn name(&self) -> &'static str {
        "modulate_backward"
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
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let (x, dy, scale) = (&v[0], &v[1], &v[2]);
        let (b, l, d) = (dims[0], dims[1], dims[2]);
        let mut dx = vec![0.0; x.len()];
        let (mut dshift, mut dscale) = (vec![0.0; b * d], vec![0.0; b * d]);
        for (i, dx) in dx.iter_mut().enumerate() {
            let p = i / (l * d) * d + i % d;
            *dx = dy[i] * (1.0 + scale[p]);
            dshift[p] += dy[i];
            dscale[p] += dy[i] * x[i];
        }
        let dt = args[0].0.dtype();
        Ok(vec![
            from_f64_vec(dx, dt),
            from_f64_vec(dshift, dt),
            from_f64_vec(dscale, dt),
        ])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        use crate::backend::cuda::kit::{
            by_dtype, cfg, colsum_shape, launch, ptr, sum_parts, sweep, Elem,
        };
        use crate::backend::cuda::CudaStorage;
        use crate::Error;
        fn run<T: Elem>(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
            let (x, dev) = (a[0], &a[0].dev);
            let (b, l, dd) = (d[0], d[1], d[2]);
            if b > 65535 {
                return Err(Error::invalid(
                    "modulate_backward",
                    format!("a batch of {b} exceeds one launch (65535)"),
                    &crate::Shape::from(d),
                ));
            }
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let mut dx = dev.alloc::<T>(b * l * dd)?;
            let (dshift, dscale) = match colsum_shape(T::DTYPE, dd, 512) {
                Some(cs) => {
                    let kernel = format!("modulate_bwd_rows_{}_{}", cs.p, T::SFX);
                    let (parts, chunk) = cs.chunks(dev, "fused", &kernel, l, b)?;
                    let part = dev.alloc::<f32>(parts * 2 * b * dd)?;
                    let lw = cs.lw as i32;
                    launch!(
                        dev,
                        "fused",
                        kernel,
                        cs.cfg(parts, b),
                        &p[0],
                        &p[1],
                        &p[2],
                        &mut *dx.slice,
                        &*part.slice,
                        &b,
                        &l,
                        &dd,
                        &chunk,
                        &lw
                    )?;
                    sum_parts::<f32, T>(dev, &part, parts, b * dd)?
                }
                // A thread per column walking a chunk of rows, f64 partials.
                None => {
                    let blocks = dd.div_ceil(256);
                    let (parts, chunk) = sweep(l, blocks * b, dev.sm_count().max(1), 8);
                    let part = dev.alloc::<f64>(parts * 2 * b * dd)?;
                    launch!(
                        dev,
                        "fused",
                        format!("modulate_bwd_{}", T::SFX),
                        cfg(blocks, parts, b),
                        &p[0],
                        &p[1],
                        &p[2],
                        &mut *dx.slice,
                        &*part.slice,
                        &b,
                        &l,
                        &dd,
                        &chunk
                    )?;
                    sum_parts::<f64, T>(dev, &part, parts, b * dd)?
                }
            };
            Ok(vec![
                x.wrap(T::wrap(dx)),
                x.wrap(T::wrap(dshift)),
                x.wrap(T::wrap(dscale)),
            ])
        }
        by_dtype!(args[0].buf.dtype(), run(dims, args), u32 => Err(Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl Tensor {
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
        let mut o = run_kernel(&Modulate, &[&x, &sh, &sc])?;
        let y = recorded(
            Modulate,
            o.remove(0),
            x.shape().clone(),
            &[&x, &sh, &sc],
            &[],
        );
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
    pub(super) fn as_batch_rows(&self, p: &Tensor) -> Result<Option<Tensor>> {
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

    /// (dx, dshift, dscale) of the fused modulation, all in x's dtype; without `params` only
    /// dx (the forward kernel with a zero shift).
    fn modulate_backward(
        &self,
        dy: &Tensor,
        scale: &Tensor,
        params: bool,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let dy = dy.to_dtype(self.dtype())?;
        if !params {
            let zero = scale.zeros_like()?;
            let mut o = run_kernel(&Modulate, &[&dy, &zero, scale])?;
            return Ok((plain(o.remove(0), self.shape().clone(), self), None));
        }
        let mut o = run_kernel(&ModulateBackward, &[self, &dy, scale])?;
        let bd = scale.shape().clone();
        let dscale = plain(o.remove(2), bd.clone(), self);
        let dshift = plain(o.remove(1), bd, self);
        Ok((
            plain(o.remove(0), self.shape().clone(), self),
            Some((dshift, dscale)),
        ))
    }
}
