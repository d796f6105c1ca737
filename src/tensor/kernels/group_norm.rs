//! GroupNorm of (N, C, ...): statistics over each of `groups` channel groups and all trailing
//! positions (in f64, saved in f32: f64 for f64), a per-channel weight and bias, in fused
//! kernels forward and backward (cuda/group_norm.cu). The backward gives dx and, summed over
//! the batch in a fixed order, dw and db. `Tensor::group_norm_composite` is the reference of
//! both backends.

use crate::autograd::{plain, recorded, run_kernel, FusedKernel};
use crate::backend::stats_dtype;
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Tensor};

/// [x (N, C, S), weight?, bias? (C) in x's dtype] -> [y, mean, rstd (N, groups) in the
/// statistics dtype].
pub(crate) struct GroupNorm {
    /// Number of channel groups (divides C).
    pub(crate) groups: usize,
    /// Added to the variance before the square root.
    pub(crate) eps: f64,
    /// Whether a per-channel weight operand is passed.
    pub(crate) weight: bool,
    /// Whether a per-channel bias operand is passed.
    pub(crate) bias: bool,
}

/// [x, dy (N, C, S), mean, rstd (N, groups), weight? (C)] -> [dx, dw, db (C)], all in x's
/// dtype (the weight's): the autograd needs no cast kernels after it.
pub(crate) struct GroupNormBackward {
    /// Number of channel groups.
    pub(crate) groups: usize,
    /// Whether a weight operand is passed.
    pub(crate) weight: bool,
}

/// The operands of either (the backward's after its x, dy, mean, rstd): [N, C, S, groups].
fn check(
    name: &'static str,
    args: &[(DType, &Layout)],
    groups: usize,
    backward: bool,
    params: usize,
) -> Result<Vec<usize>> {
    let first = if backward { 4 } else { 1 };
    let o = Operands::new(name, args, first + params)?;
    let d = o.dims(3, "(N, C, S)")?;
    if groups == 0 || d[1] % groups != 0 {
        return Err(o.invalid(format!("{groups} groups do not divide the channels")));
    }
    let dt = o.dtype();
    if backward {
        o.expect(1, dt, d)?;
        o.expect(2, stats_dtype(dt), &[d[0], groups])?;
        o.expect(3, stats_dtype(dt), &[d[0], groups])?;
    }
    for i in first..first + params {
        o.expect(i, dt, &[d[1]])?;
    }
    Ok(vec![d[0], d[1], d[2], groups])
}

impl Kernel for GroupNorm {
    fn name(&self) -> &'static str {
        "group_norm"
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let params = usize::from(self.weight) + usize::from(self.bias);
        check(self.name(), args, self.groups, false, params)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        use rayon::prelude::*;
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let (dt, groups, eps) = (args[0].0.dtype(), self.groups, self.eps);
        let x = &v[0];
        let (n, c, s) = (dims[0], dims[1], dims[2]);
        let len = c / groups * s;
        let (w, b) = (
            self.weight.then(|| &v[1]),
            self.bias.then(|| &v[v.len() - 1]),
        );
        let mut y = vec![0.0; x.len()];
        let mut stats = vec![(0.0, 0.0); n * groups];
        y.par_chunks_mut(len)
            .zip(x.par_chunks(len))
            .zip(stats.par_iter_mut())
            .enumerate()
            .for_each(|(ng, ((y, x), st))| {
                let mean = x.iter().sum::<f64>() / len as f64;
                let var = x.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / len as f64;
                let rstd = 1.0 / (var + eps).sqrt();
                for (j, (y, a)) in y.iter_mut().zip(x).enumerate() {
                    let ch = ng % groups * (c / groups) + j / s;
                    *y = (a - mean) * rstd * w.map_or(1.0, |w| w[ch]) + b.map_or(0.0, |b| b[ch]);
                }
                *st = (mean, rstd);
            });
        let (mean, rstd): (Vec<f64>, Vec<f64>) = stats.into_iter().unzip();
        let st = stats_dtype(dt);
        Ok(vec![
            from_f64_vec(y, dt),
            from_f64_vec(mean, st),
            from_f64_vec(rstd, st),
        ])
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
            k: &GroupNorm,
            d: &[usize],
            a: &[&CudaStorage],
        ) -> Result<Vec<CudaStorage>> {
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let (y, mean, rstd) = launch::forward::<T, S>(
                a[0],
                &p,
                (d[0], d[1], d[2]),
                k.groups,
                k.eps,
                (k.weight, k.bias),
            )?;
            let x = a[0];
            Ok(vec![
                x.wrap(T::wrap(y)),
                x.wrap(S::wrap(mean)),
                x.wrap(S::wrap(rstd)),
            ])
        }
        match args[0].buf.dtype() {
            DType::F32 => run::<f32, f32>(self, dims, args),
            DType::F64 => run::<f64, f64>(self, dims, args),
            DType::BF16 => run::<half::bf16, f32>(self, dims, args),
            DType::F16 => run::<half::f16, f32>(self, dims, args),
            dtype => Err(Error::UnsupportedDType {
                op: self.name(),
                dtype,
            }),
        }
    }
}

impl FusedKernel for GroupNorm {
    /// dx reads x (and its statistics, kept) and the weight; dw reads x; db reads nothing.
    fn reads_inputs(&self, _needs_grad: &[bool]) -> Vec<bool> {
        let mut v = vec![true];
        if self.weight {
            v.push(true);
        }
        if self.bias {
            v.push(false);
        }
        v
    }

    /// With g = dy w over a group, dx = rstd (g - mean(g) - xhat mean(g xhat)); dw = the sum
    /// over N and positions of dy xhat, db of dy.
    fn vjp(
        &self,
        inputs: &[Tensor],
        kept: &[Tensor],
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let x = &inputs[0];
        let weight = self.weight.then(|| &inputs[1]);
        let (dx, dw, db) = x.group_norm_backward(g, &kept[0], &kept[1], weight, self.groups)?;
        let mut v = vec![Some(dx)];
        if let Some(w) = weight {
            v.push(Some(dw.to_dtype(w.dtype())?));
        }
        if self.bias {
            let b = &inputs[inputs.len() - 1];
            v.push(Some(db.to_dtype(b.dtype())?));
        }
        Ok(v)
    }
}

impl Kernel for GroupNormBackward {
    fn name(&self) -> &'static str {
        "group_norm_backward"
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        check(
            self.name(),
            args,
            self.groups,
            true,
            usize::from(self.weight),
        )
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{f64_view, from_f64_vec};
        let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| f64_view(s, l)).collect();
        let (dt, groups) = (args[0].0.dtype(), self.groups);
        let (x, dy, mean, rstd) = (&v[0], &v[1], &v[2], &v[3]);
        let w = self.weight.then(|| &v[4]);
        let (n, c, s) = (dims[0], dims[1], dims[2]);
        let cpg = c / groups;
        let len = cpg * s;
        let mut dx = vec![0.0; x.len()];
        let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
        for ng in 0..n * groups {
            let (m, r) = (mean[ng], rstd[ng]);
            let base = ng * len;
            let ch = |j: usize| ng % groups * cpg + j / s;
            // g = dy w; dx = rstd (g - mean(g) - xhat mean(g xhat)) over the group.
            let (mut sg, mut sgx) = (0.0, 0.0);
            for j in 0..len {
                let (xh, g) = ((x[base + j] - m) * r, dy[base + j]);
                let wv = w.map_or(1.0, |w| w[ch(j)]);
                sg += g * wv;
                sgx += g * wv * xh;
                dw[ch(j)] += g * xh;
                db[ch(j)] += g;
            }
            let (a, b) = (sg / len as f64, sgx / len as f64);
            for j in 0..len {
                let xh = (x[base + j] - m) * r;
                let g = dy[base + j] * w.map_or(1.0, |w| w[ch(j)]);
                dx[base + j] = r * (g - a - xh * b);
            }
        }
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
            k: &GroupNormBackward,
            d: &[usize],
            a: &[&CudaStorage],
        ) -> Result<Vec<CudaStorage>> {
            let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
            let (dx, dw, db) =
                launch::backward::<T>(a[0], &p, (d[0], d[1], d[2]), k.groups, k.weight)?;
            let x = a[0];
            Ok(vec![
                x.wrap(T::wrap(dx)),
                x.wrap(T::wrap(dw)),
                x.wrap(T::wrap(db)),
            ])
        }
        by_dtype!(args[0].buf.dtype(), run(self, dims, args), u32 => Err(Error::UnsupportedDType {
            op: self.name(),
            dtype: DType::U32,
        }))
    }
}

impl Tensor {
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
        let k = GroupNorm {
            groups,
            eps,
            weight: weight.is_some(),
            bias: bias.is_some(),
        };
        let mut args = vec![&x];
        args.extend(weight.iter().chain(bias.iter()));
        let mut o = run_kernel(&k, &args)?;
        let mean = plain(o.remove(1), (n, groups), self);
        let rstd = plain(o.remove(1), (n, groups), self);
        recorded(k, o.remove(0), x.shape().clone(), &args, &[&mean, &rstd]).reshape(dims)
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
    fn group_norm_backward(
        &self,
        dy: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        weight: Option<&Tensor>,
        groups: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let k = GroupNormBackward {
            groups,
            weight: weight.is_some(),
        };
        let dy = dy.to_dtype(self.dtype())?;
        let mut args = vec![self, &dy, mean, rstd];
        args.extend(weight);
        let mut o = run_kernel(&k, &args)?;
        let c = self.dims()[1];
        let db = plain(o.remove(2), c, self);
        let dw = plain(o.remove(1), c, self);
        Ok((plain(o.remove(0), self.shape().clone(), self), dw, db))
    }
}

/// The CUDA launchers (kernels in cuda/group_norm.cu) on dense operands of shape (N, C, S).
///
/// On Hopper, a group whose x fits in the shared memory of a cluster of 8 blocks takes one
/// pass a direction (gn_fwd_cluster, gn_bwd_cluster: each input read once from DRAM), with a
/// staggered start when the grid is one wave (see `late_from`); anything else, and f64, takes
/// two kernels a direction that read the inputs twice. Both backward forms leave each
/// plane's (sum dy, sum dy (x - mean)) in one f64 buffer, which gn_param_grads sums over N
/// into dw and db in a fixed order.
#[cfg(feature = "cuda")]
mod launch {
    use crate::backend::cuda::kit::{grid_for, hopper_module, launch, DevBuf, Elem, DONE_COUNTERS};
    use crate::backend::cuda::{CudaDevice, CudaStorage};
    use crate::{DType, Error, Result};
    use cudarc::driver::LaunchConfig;

    /// A cluster's share of a group (cuda/group_norm.cu's GNC).
    const CLUSTER: usize = 8;
    /// Bytes of x a block may hold in shared memory (GNC_SMEM).
    const SMEM: usize = 48 * 1024;
    /// Channels a forward chunk (GNC_CHANNELS), a backward chunk (GNB_CHANNELS) and a backward
    /// group (GNC_CHANNELS) may span.
    const CHANNELS: usize = 64;
    const BWD_CHUNK_CHANNELS: usize = 16;

    /// `blocks` blocks of 256 threads (both forms), with `smem` bytes of dynamic shared memory.
    fn cfg(blocks: usize, smem: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    }

    /// The module and per-block bytes of the one-pass form for (n, c, s) in `groups`, when it
    /// applies to the forward (`backward` false) or the backward.
    fn one_pass<T: Elem>(
        dev: &CudaDevice,
        (n, c, s, groups): (usize, usize, usize, usize),
        backward: bool,
    ) -> Option<(&'static str, usize)> {
        let cpg = c / groups;
        let chunk = cpg * s / CLUSTER;
        let bytes = chunk * T::DTYPE.size_in_bytes();
        // Channels a chunk may touch: whole ones plus a partial one at each end.
        let spans = chunk / s + 2;
        let fits = T::DTYPE != DType::F64
            && s % 8 == 0
            && chunk % 8 == 0
            && bytes <= SMEM
            && u32::try_from(n * c * s).is_ok()
            && if backward {
                // The gate's two counters, then one per group index.
                spans <= BWD_CHUNK_CHANNELS && cpg <= CHANNELS && groups + 2 <= DONE_COUNTERS
            } else {
                spans <= CHANNELS
            };
        hopper_module(dev, "group_norm")
            .filter(|_| fits)
            .map(|m| (m, bytes))
    }

    /// The first late group of the one-pass kernels' staggered start (cuda/group_norm.cu): half the
    /// clusters wait for the other half's first chunk, so that loads, reductions and stores overlap.
    /// Only when every cluster is resident at once (a late cluster must never wait on one that has
    /// no place to run; the kernel's time limit covers that case too); `clusters` otherwise (none late).
    fn late_from(
        dev: &CudaDevice,
        module: &'static str,
        name: &str,
        cfg: LaunchConfig,
        clusters: usize,
    ) -> Result<u32> {
        let staggered = clusters >= 2 && clusters <= dev.resident_clusters(module, name, cfg)?;
        Ok(if staggered { clusters / 2 } else { clusters } as u32)
    }

    /// y, mean, rstd (the saved statistics in S, one per (n, group)).
    pub(super) fn forward<T: Elem, S: Elem>(
        x: &CudaStorage,
        p: &[u64],
        (n, c, s): (usize, usize, usize),
        groups: usize,
        eps: f64,
        (weight, bias): (bool, bool),
    ) -> Result<(DevBuf<T>, DevBuf<S>, DevBuf<S>)> {
        let dev = &x.dev;
        let planes = n * c;
        let cpg = c / groups;
        let w = if weight { p[1] } else { 0 };
        let bp = if bias { p[p.len() - 1] } else { 0 };
        let mut y = dev.alloc::<T>(planes * s)?;
        let (mut mean, mut rstd) = (dev.alloc::<S>(n * groups)?, dev.alloc::<S>(n * groups)?);
        if let Some((module, smem)) = one_pass::<T>(dev, (n, c, s, groups), false) {
            let (c32, s32, cpg32, eps32) = (c as u32, s as u32, cpg as u32, eps as f32);
            let name = format!("gn_fwd_cluster_{}", T::SFX);
            let config = cfg(n * groups * CLUSTER, smem);
            let late = late_from(dev, module, &name, config, n * groups)?;
            let gate = dev.done_counters()?;
            launch!(
                dev,
                module,
                name,
                config,
                &p[0],
                &w,
                &bp,
                &mut *y.slice,
                &mut *mean.slice,
                &mut *rstd.slice,
                &c32,
                &s32,
                &cpg32,
                &eps32,
                &gate,
                &late
            )?;
            return Ok((y, mean, rstd));
        }
        let mut st = dev.alloc::<f64>(2 * planes)?;
        launch!(
            dev,
            "group_norm",
            format!("gn_stats_{}", T::SFX),
            cfg(planes, 0),
            &p[0],
            &mut *st.slice,
            &s
        )?;
        launch!(
            dev,
            "group_norm",
            format!("gn_fwd_{}", T::SFX),
            cfg(planes, 0),
            &p[0],
            &*st.slice,
            &w,
            &bp,
            &mut *y.slice,
            &mut *mean.slice,
            &mut *rstd.slice,
            &c,
            &s,
            &cpg,
            &eps
        )?;
        Ok((y, mean, rstd))
    }

    /// dx, dw, db (dw and db in x's dtype, the weight's) from x, dy, mean, rstd (and the weight
    /// when `weight`).
    pub(super) fn backward<T: Elem>(
        x: &CudaStorage,
        p: &[u64],
        (n, c, s): (usize, usize, usize),
        groups: usize,
        weight: bool,
    ) -> Result<(DevBuf<T>, DevBuf<T>, DevBuf<T>)> {
        let dev = &x.dev;
        let (planes, cpg) = (n * c, c / groups);
        let w = if weight { p[4] } else { 0 };
        let mut st = dev.alloc::<f64>(2 * planes)?;
        let mut dx = dev.alloc::<T>(planes * s)?;
        let (mut dw, mut db) = (dev.alloc::<T>(c)?, dev.alloc::<T>(c)?);
        if let Some((module, smem)) = one_pass::<T>(dev, (n, c, s, groups), true) {
            // The gate's u64 in the first two counters, the per-group counts after it.
            let gate = dev.done_counters()?;
            let counts = gate + 8;
            let (n32, c32, s32, cpg32) = (n as u32, c as u32, s as u32, cpg as u32);
            let name = format!("gn_bwd_cluster_{}", T::SFX);
            let config = cfg(n * groups * CLUSTER, smem);
            let late = late_from(dev, module, &name, config, n * groups)?;
            launch!(
                dev,
                module,
                name,
                config,
                &p[0],
                &p[1],
                &p[2],
                &p[3],
                &w,
                &mut *dx.slice,
                &mut *st.slice,
                &mut *dw.slice,
                &mut *db.slice,
                &counts,
                &n32,
                &c32,
                &s32,
                &cpg32,
                &gate,
                &late
            )?;
            return Ok((dx, dw, db));
        }
        launch!(
            dev,
            "group_norm",
            format!("gn_bwd_stats_{}", T::SFX),
            cfg(planes, 0),
            &p[0],
            &p[1],
            &p[2],
            &mut *st.slice,
            &c,
            &s,
            &cpg
        )?;
        launch!(
            dev,
            "group_norm",
            format!("gn_bwd_dx_{}", T::SFX),
            cfg(planes, 0),
            &p[0],
            &p[1],
            &*st.slice,
            &p[2],
            &p[3],
            &w,
            &mut *dx.slice,
            &c,
            &s,
            &cpg
        )?;
        launch!(
            dev,
            "group_norm",
            format!("gn_param_grads_{}", T::SFX),
            grid_for(c, dev.sm_count().max(1)),
            &*st.slice,
            &p[3],
            &mut *dw.slice,
            &mut *db.slice,
            &n,
            &c,
            &cpg
        )?;
        Ok((dx, dw, db))
    }
}
