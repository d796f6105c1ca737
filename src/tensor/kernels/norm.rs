//! The backward pieces of LayerNorm / RMSNorm over the last dim that are kernels of their own:
//! the parameter gradients alone (`NormParamGrads`, a frozen input with trainable weight or
//! bias) and dx with them in one pass over x and dy (`NormBackward`). The forward and the
//! backward's dx alone are backend primitives (`BackendStorage::norm_last_dim` and
//! `norm_last_dim_backward`: cuda/norm.cu, the CPU backend's norm.rs), recorded as `Op::Norm`,
//! whose backward calls these kernels. On CUDA the column sums are cuda/norm.cu's
//! `norm_bwd_sums_*` and `norm_bwd_params_*` (row blocks, f32 partial rows), on Hopper
//! cuda/norm_bulk.cu's one kernel, or else its column sweeps `norm_param_grads_*`, their
//! partials added in a fixed order by cuda/fused.cu's `sum_partials2*`.
//! `Tensor::layer_norm_composite` and `rms_norm_composite` are the reference of both backends.

use crate::autograd::{plain, run_kernel};
use crate::backend::validate::Operands;
use crate::backend::{stats_dtype, Kernel, NormKind};
use crate::{DType, Layout, Result, Tensor};

/// [x, dy (rows, cols), mean, rstd (rows) stats] -> [dw, db (cols) stats]: the column sums of
/// dy xhat and dy, xhat = (x - mean) rstd (mean 0 for Rms). "stats" is `stats_dtype(x)`.
pub(crate) struct NormParamGrads {
    /// The normalization whose parameter gradients these are.
    pub(crate) kind: NormKind,
}

/// [x, dy (rows, cols), mean, rstd (rows) stats, weight? (cols)] -> [dx, dw, db (cols)], all
/// in x's dtype: `norm_last_dim_backward`'s dx and `NormParamGrads`' sums in one pass over x
/// and dy (the case of trainable norm parameters).
pub(crate) struct NormBackward {
    /// The normalization whose backward this is.
    pub(crate) kind: NormKind,
    /// Whether a weight operand is passed (and `dw`, `db` are meaningful).
    pub(crate) weight: bool,
}

/// The operands of either, `weight` telling whether a weight follows the statistics: returns
/// [rows, cols].
fn check(name: &'static str, args: &[(DType, &Layout)], weight: bool) -> Result<Vec<usize>> {
    let o = Operands::new(name, args, 4 + usize::from(weight))?;
    let (rows, cols) = o.rows()?;
    let (dt, d) = (o.dtype(), o.dims_of(0));
    let stats = stats_dtype(dt);
    o.expect(1, dt, d)?;
    o.expect(2, stats, &d[..d.len() - 1])?;
    o.expect(3, stats, &d[..d.len() - 1])?;
    if weight {
        o.expect(4, dt, &[cols])?;
    }
    Ok(vec![rows, cols])
}

impl Kernel for NormParamGrads {
    fn name(&self) -> &'static str {
        "norm_param_grads"
    }

    /// Returns [rows, cols].
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
        let (x, dy, mean, rstd) = (&v[0], &v[1], &v[2], &v[3]);
        let (rows, cols) = (dims[0], dims[1]);
        let mut dw = vec![0.0; cols];
        let mut db = vec![0.0; cols];
        for r in 0..rows {
            let m = if self.kind == NormKind::Layer {
                mean[r]
            } else {
                0.0
            };
            for c in 0..cols {
                let i = r * cols + c;
                dw[c] += dy[i] * (x[i] - m) * rstd[r];
                db[c] += dy[i];
            }
        }
        let st = stats_dtype(args[0].0.dtype());
        Ok(vec![from_f64_vec(dw, st), from_f64_vec(db, st)])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        use crate::backend::cuda::kit::{ptr, Elem};
        use crate::backend::cuda::CudaStorage;
        fn run<T: Elem, S: Elem>(
            kind: NormKind,
            d: &[usize],
            a: &[&CudaStorage],
        ) -> Result<Vec<CudaStorage>> {
            let x = a[0];
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let (dw, db) = launch::param_sweep::<T, S>(&x.dev, &p, (d[0], d[1]), kind)?;
            Ok(vec![x.wrap(S::wrap(dw)), x.wrap(S::wrap(db))])
        }
        let k = self.kind;
        match args[0].buf.dtype() {
            DType::F32 => run::<f32, f32>(k, dims, args),
            DType::F64 => run::<f64, f64>(k, dims, args),
            DType::BF16 => run::<half::bf16, f32>(k, dims, args),
            DType::F16 => run::<half::f16, f32>(k, dims, args),
            dtype => Err(crate::Error::UnsupportedDType {
                op: self.name(),
                dtype,
            }),
        }
    }
}

impl Kernel for NormBackward {
    fn name(&self) -> &'static str {
        "norm_backward"
    }

    /// Returns [rows, cols].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check(self.name(), args, self.weight)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let (x, dy, mean, rstd) = (&v[0], &v[1], &v[2], &v[3]);
        let cols = dims[1];
        let w = self.weight.then(|| &v[4]);
        let layer = self.kind == NormKind::Layer;
        let mut dx = vec![0.0; x.len()];
        let (mut dw, mut db) = (vec![0.0; cols], vec![0.0; cols]);
        for (r, dxr) in dx.chunks_mut(cols).enumerate() {
            let (m, s) = (if layer { mean[r] } else { 0.0 }, rstd[r]);
            let row = r * cols..(r + 1) * cols;
            let (xr, gr) = (&x[row.clone()], &dy[row]);
            let gw = |c: usize| gr[c] * w.map_or(1.0, |w| w[c]);
            // a = mean(g), b = mean(g xhat) with g = dy w (a = 0 for Rms).
            let (mut a, mut b) = (0.0, 0.0);
            for c in 0..cols {
                let xh = (xr[c] - m) * s;
                a += gw(c);
                b += gw(c) * xh;
                dw[c] += gr[c] * xh;
                db[c] += gr[c];
            }
            let (a, b) = (if layer { a / cols as f64 } else { 0.0 }, b / cols as f64);
            for (c, d) in dxr.iter_mut().enumerate() {
                *d = s * (gw(c) - a - (xr[c] - m) * s * b);
            }
        }
        let dt = args[0].0.dtype();
        Ok(vec![
            from_f64_vec(dx, dt),
            from_f64_vec(dw, dt),
            from_f64_vec(db, dt),
        ])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        use crate::backend::cuda::kit::{by_dtype, ptr, Elem};
        use crate::backend::cuda::CudaStorage;
        fn run<T: Elem>(
            k: &NormBackward,
            d: &[usize],
            a: &[&CudaStorage],
        ) -> Result<Vec<CudaStorage>> {
            let x = a[0];
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let (dx, dw, db) = launch::backward::<T>(&x.dev, &p, (d[0], d[1]), k.kind, k.weight)?;
            Ok(vec![
                x.wrap(T::wrap(dx)),
                x.wrap(T::wrap(dw)),
                x.wrap(T::wrap(db)),
            ])
        }
        by_dtype!(args[0].buf.dtype(), run(self, dims, args), u32 => Err(crate::Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl Tensor {
    /// (dw, db) of a last-dim norm: column sums of dy xhat and dy, in the statistics dtype.
    pub(crate) fn norm_param_grads(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        kind: NormKind,
    ) -> Result<(Tensor, Tensor)> {
        let dy = dy.to_dtype(self.dtype())?;
        let mut o = run_kernel(&NormParamGrads { kind }, &[self, &dy, mean, rstd])?;
        let cols = self.dims().last().copied().unwrap_or(0);
        let db = plain(o.remove(1), cols, self);
        Ok((plain(o.remove(0), cols, self), db))
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
        let k = NormBackward {
            kind,
            weight: weight.is_some(),
        };
        let dy = dy.to_dtype(self.dtype())?;
        let mut args = vec![self, &dy, mean, rstd];
        args.extend(weight);
        let mut o = run_kernel(&k, &args)?;
        let cols = self.dims().last().copied().unwrap_or(0);
        let db = plain(o.remove(2), cols, self);
        let dw = plain(o.remove(1), cols, self);
        Ok((plain(o.remove(0), self.shape().clone(), self), dw, db))
    }
}

/// The CUDA launchers: the column sweep and the choice among the backward's kernels.
///
/// Column sums are taken by the backward's row kernel when it computes dx too (rows of whole
/// packs up to 8192 columns: cuda/rows.cuh's row blocks, each writing f32 partial rows), or
/// else swept: a thread per column walks a chunk of rows, chunks spread over grid.y so the GPU
/// fills, writing f64 partials. A second kernel adds the partials in a fixed order
/// (deterministic, no atomics). On Hopper the backward with dw and db is one kernel instead
/// (`norm_bwd_bulk`: rows by bulk copies, the partials added after a grid-wide barrier, in a
/// fixed order too).
#[cfg(feature = "cuda")]
mod launch {
    use crate::backend::cuda::kit::{
        cfg, colsum_shape, launch, norm_bwd, norm_bwd_bulk, norm_bwd_sums, sum_parts, sweep,
        DevBuf, Elem, RowMap,
    };
    use crate::backend::cuda::CudaDevice;
    use crate::backend::NormKind;
    use crate::{DType, Error, Result};

    /// dw, db of a last-dim norm by a column sweep over x and dy (p: x, dy, mean, rstd).
    pub(super) fn param_sweep<T: Elem, O: Elem>(
        dev: &CudaDevice,
        p: &[u64],
        (rows, cols): (usize, usize),
        kind: NormKind,
    ) -> Result<(DevBuf<O>, DevBuf<O>)> {
        // Eight columns a thread when rows are whole 16-byte packs.
        let vec = cols % 8 == 0 && T::DTYPE != DType::F64;
        let (blocks, min_chunk, kernel) = if vec {
            (cols.div_ceil(8 * 32), 64, "norm_param_grads_vec")
        } else {
            (cols.div_ceil(256), 8, "norm_param_grads")
        };
        let (parts, chunk) = sweep(rows, blocks, dev.sm_count().max(1), min_chunk);
        let part = dev.alloc::<f64>(parts * 2 * cols)?;
        let rms = i32::from(kind == NormKind::Rms);
        // Beside the forward and the row kernels, in cuda/norm.cu.
        launch!(
            dev,
            "norm",
            format!("{kernel}_{}", T::SFX),
            cfg(blocks, parts, 1),
            &p[0],
            &p[1],
            &p[2],
            &p[3],
            &*part.slice,
            &rows,
            &cols,
            &chunk,
            &rms
        )?;
        sum_parts::<f64, O>(dev, &part, parts, cols)
    }

    /// (dx, dw, db) from dense operands p = [x, dy, mean, rstd, weight?].
    pub(super) fn backward<T: Elem>(
        dev: &CudaDevice,
        p: &[u64],
        (rows, cols): (usize, usize),
        kind: NormKind,
        weight: bool,
    ) -> Result<(DevBuf<T>, DevBuf<T>, DevBuf<T>)> {
        let w = if weight { p[4] } else { 0 };
        if let Some(dx_dw_db) = norm_bwd_bulk::<T>(dev, p, w, (rows, cols), kind)? {
            return Ok(dx_dw_db);
        }
        let mut dx = dev.alloc::<T>(rows * cols)?;
        // Before Hopper, half-type rows of 2049-3072 columns take the row blocks with two packs a lane:
        // kernel_bench on an H100 at 4608 x 3072 bf16, 43.3 us against 48.7-49.0 us for
        // the register-resident rows with their sums in shared memory (two blocks a
        // multiprocessor either way), and 52.9 us with one pack a lane (one block).
        let two_packs = T::DTYPE != DType::F32 && (2049..=3072).contains(&cols);
        let sums = if two_packs {
            None
        } else {
            norm_bwd_sums::<T>(dev, p, w, &mut dx, (rows, cols), kind)?
        };
        let lanes = if two_packs { 192 } else { 384 };
        let (dw, db) = match (sums, colsum_shape(T::DTYPE, cols, lanes)) {
            (Some((part, blocks)), _) => sum_parts::<f32, T>(dev, &part, blocks, cols)?,
            (None, Some(cs)) => {
                let kernel = format!("norm_bwd_params_{}_{}", cs.p, T::SFX);
                let (blocks, chunk) = cs.chunks(dev, "norm", &kernel, rows, 1)?;
                let part = dev.alloc::<f32>(blocks * 2 * cols)?;
                let (lw, rms) = (cs.lw as i32, i32::from(kind == NormKind::Rms));
                launch!(
                    dev,
                    "norm",
                    kernel,
                    cs.cfg(blocks, 1),
                    &p[0],
                    &p[1],
                    &w,
                    &p[2],
                    &p[3],
                    &mut *dx.slice,
                    &*part.slice,
                    &rows,
                    &cols,
                    &chunk,
                    &lw,
                    &rms
                )?;
                sum_parts::<f32, T>(dev, &part, blocks, cols)?
            }
            // Other rows (f64, columns not in whole packs, past 6144): the row kernel
            // for dx, then the column sweep.
            (None, None) => {
                norm_bwd::<T>(dev, p, w, &mut dx, (rows, cols), kind, RowMap::dense(cols))?;
                param_sweep::<T, T>(dev, p, (rows, cols), kind)?
            }
        };
        Ok((dx, dw, db))
    }
}
