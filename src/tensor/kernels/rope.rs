//! Rotary position embedding in BFL Flux's layout: each pair `(x[2i], x[2i+1])` of the last
//! dim of x (B, H, L, D) times its 2x2 matrix, computed in f32 (f64 for f64) in one kernel
//! (cuda/fused.cu's `rope` and `rope_vec`, four pairs of four heads a thread where they share
//! a rotation row). Its backward is the same kernel with the transposed matrices.
//! `Tensor::apply_rope_composite` is the reference of both backends.

use crate::autograd::{recorded, run_kernel, FusedKernel};
use crate::backend::stats_dtype;
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Tensor};

/// [x (B, H, L, D), rot (R, L, D/2, 2, 2) in the statistics dtype, R = 1 or B] -> [y]: each
/// pair times its matrix, or its transpose when `transpose` (the backward).
pub(crate) struct Rope {
    /// Multiply by the transposed matrices.
    pub(crate) transpose: bool,
}

impl Kernel for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    /// Returns [B, H, L, D, R].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let o = Operands::new(self.name(), args, 2)?;
        let d = o.dims(4, "(B, H, L, D)")?;
        if d[3] % 2 != 0 {
            return Err(o.invalid("needs an even head dim"));
        }
        let r = o.dims_of(1).first().copied().unwrap_or(0);
        let r = if r == d[0] { r } else { 1 };
        o.expect(1, stats_dtype(o.dtype()), &[r, d[2], d[3] / 2, 2, 2])?;
        Ok(vec![d[0], d[1], d[2], d[3], r])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let (x, rot) = (
            f64_view(args[0].0, args[0].1),
            f64_view(args[1].0, args[1].1),
        );
        let (h, l, d, r) = (dims[1], dims[2], dims[3], dims[4]);
        let mut y = vec![0.0; x.len()];
        for (p, out) in y.chunks_mut(2).enumerate() {
            // Pair p of (B, H, L, D/2): its matrix is rot[b % R][l][i].
            let (i, pos, bi) = (p % (d / 2), p / (d / 2) % l, p / (d / 2 * l * h));
            let m = &rot[(((bi % r) * l + pos) * (d / 2) + i) * 4..][..4];
            let (a, b) = (x[2 * p], x[2 * p + 1]);
            let (m01, m10) = if self.transpose {
                (m[2], m[1])
            } else {
                (m[1], m[2])
            };
            out[0] = m[0] * a + m01 * b;
            out[1] = m10 * a + m[3] * b;
        }
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
        fn run<T: Elem>(d: &[usize], a: &[&CudaStorage], t: i32) -> Result<Vec<CudaStorage>> {
            let (x, dev) = (a[0], &a[0].dev);
            let (b, h, l, hd, r) = (d[0], d[1], d[2], d[3], d[4]);
            let (half, pairs) = (hd / 2, b * h * l * hd / 2);
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let mut y = dev.alloc::<T>(2 * pairs)?;
            // Four pairs of four heads per thread (cuda/fused.cu's ROPE_HEADS) when they share
            // a rotation row and fit 32-bit indices.
            let vec = T::DTYPE != DType::F64 && half % 4 == 0 && pairs < (1 << 31);
            let (kernel, work) = if vec {
                let per_head = pairs / (4 * h.max(1));
                (format!("rope_vec_{}", T::SFX), per_head * h.div_ceil(4))
            } else {
                (format!("rope_{}", T::SFX), pairs)
            };
            launch!(
                dev,
                "fused",
                kernel,
                grid_for(work, dev.sm_count().max(1)),
                &p[0],
                &p[1],
                &mut *y.slice,
                &h,
                &l,
                &half,
                &r,
                &pairs,
                &t
            )?;
            Ok(vec![x.wrap(T::wrap(y))])
        }
        let t = i32::from(self.transpose);
        by_dtype!(args[0].buf.dtype(), run(dims, args, t), u32 => Err(Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl FusedKernel for Rope {
    /// y = M x per pair: dx = M^T g reads only the matrices (kept), not x.
    fn reads_inputs(&self, _needs_grad: &[bool]) -> Vec<bool> {
        vec![false]
    }

    fn vjp(
        &self,
        _inputs: &[Tensor],
        kept: &[Tensor],
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.rope_fused(&kept[0], !self.transpose)?)])
    }
}

impl Tensor {
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
    fn rope_fused(&self, rot: &Tensor, transpose: bool) -> Result<Tensor> {
        let k = Rope { transpose };
        let mut o = run_kernel(&k, &[self, rot])?;
        Ok(recorded(
            k,
            o.remove(0),
            self.shape().clone(),
            &[self],
            &[rot],
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
}
