//! Softmax's backward along the last dim, dx = y (dy - sum(dy y)) per row, in one kernel
//! (cuda/softmax.cu's `softmax_bwd_*`, a warp per row, rows of whole packs held in registers).
//! The forward is a backend primitive (`BackendStorage::softmax_last_dim`: cuda/softmax.cu's
//! `softmax_rows_*` and `softmax_reg*`, the CPU backend's `softmax_rows`), recorded as
//! `Op::Softmax`, whose backward calls this kernel; `Tensor::softmax_composite` is the
//! reference of both.

use crate::autograd::{plain, run_kernel};
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Layout, Result, Tensor};

/// [y, dy (rows, cols)], one dtype -> [dx = y (dy - sum(dy y))] per last-dim row.
pub(crate) struct SoftmaxBackward;

impl Kernel for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "softmax_backward"
    }

    /// Returns [rows, cols].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let o = Operands::new(self.name(), args, 2)?;
        let (rows, cols) = o.rows()?;
        o.expect(1, o.dtype(), o.dims_of(0))?;
        Ok(vec![rows, cols])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        use rayon::prelude::*;
        let (y, dy) = (
            f64_view(args[0].0, args[0].1),
            f64_view(args[1].0, args[1].1),
        );
        let cols = dims[1];
        let mut dx = vec![0.0; y.len()];
        dx.par_chunks_mut(cols)
            .zip(y.par_chunks(cols).zip(dy.par_chunks(cols)))
            .for_each(|(dx, (y, g))| {
                let dot: f64 = y.iter().zip(g).map(|(a, b)| a * b).sum();
                for ((d, y), g) in dx.iter_mut().zip(y).zip(g) {
                    *d = y * (g - dot);
                }
            });
        Ok(vec![from_f64_vec(dx, args[0].0.dtype())])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        use crate::backend::cuda::kit::{by_dtype, launch, ptr, softmax_kernel, Elem};
        use crate::backend::cuda::CudaStorage;
        use crate::Error;
        fn run<T: Elem>(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
            let (x, dev) = (a[0], &a[0].dev);
            let (rows, cols) = (d[0], d[1]);
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let mut dx = dev.alloc::<T>(rows * cols)?;
            let (packs, shape) = softmax_kernel(T::DTYPE, rows, cols, dev.sm_count().max(1));
            let kernel = match packs {
                Some(p) => format!("softmax_bwd_reg{p}_{}", T::SFX),
                None => format!("softmax_bwd_{}", T::SFX),
            };
            // Beside the forward, in cuda/softmax.cu.
            launch!(
                dev,
                "softmax",
                kernel,
                shape,
                &p[0],
                &p[1],
                &mut *dx.slice,
                &rows,
                &cols
            )?;
            Ok(vec![x.wrap(T::wrap(dx))])
        }
        by_dtype!(args[0].buf.dtype(), run(dims, args), u32 => Err(Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl Tensor {
    /// dx of softmax given its output y = self and dy, in one kernel.
    pub(crate) fn softmax_backward(&self, dy: &Tensor) -> Result<Tensor> {
        let dy = dy.to_dtype(self.dtype())?;
        let mut o = run_kernel(&SoftmaxBackward, &[self, &dy])?;
        Ok(plain(o.remove(0), self.shape().clone(), self))
    }
}
