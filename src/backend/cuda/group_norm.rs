//! Launchers of GroupNorm (kernels in cuda/group_norm.cu), called by `fused` with dense
//! operands of shape (N, C, S).
//!
//! On Hopper, a group whose x fits in the shared memory of a cluster of 8 blocks takes one pass
//! a direction (gn_fwd_cluster, gn_bwd_cluster: each input read once from DRAM), with a
//! staggered start when the grid is one wave (see `late_from`); anything else,
//! and f64, takes two kernels a direction that read the inputs twice. Both backward forms leave each
//! plane's (sum dy, sum dy (x - mean)) in one f64 buffer, which gn_param_grads sums over N into
//! dw and db in a fixed order.

use super::storage::{launch, CudaStorage, Elem};
use super::{device::DONE_COUNTERS, layout::grid_for, memory::DevBuf, CudaDevice};
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
    super::hopper_module(dev, "group_norm")
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
