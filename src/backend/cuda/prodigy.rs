//! Launcher of Prodigy's multi-tensor step (cuda/multi_tensor.cu, `backend::multi::
//! ProdigyHyper`): pass 1 per parameter dtype, one reduction block, pass 2 per dtype, all on
//! the device's stream with no host synchronization (the reduction's result stays in the
//! scalar state and pass 2 reads it there). Operands were checked by
//! `validate::prodigy_multi`.

use super::multi::{addr, check_devices, grid, sfx, upload, THREADS};
use super::storage::{launch, CudaStorage};
use crate::backend::multi::{ProdigyHyper, ProdigyItem, PRODIGY_CHUNK};
use crate::backend::validate;
use crate::{DType, Error, Result};
use cudarc::driver::LaunchConfig;

const OP: &str = "prodigy_multi";

/// The kernels' flags (PF_* in cuda/multi_tensor.cu).
fn flags(h: &ProdigyHyper, first_moment: bool) -> u32 {
    u32::from(h.decouple)
        | (u32::from(h.use_bias_correction) << 1)
        | (u32::from(h.safeguard_warmup) << 2)
        | (u32::from(first_moment) << 3)
}

/// `BackendStorage::prodigy_multi` on CUDA.
pub(super) fn prodigy(
    h: &ProdigyHyper,
    items: &mut [ProdigyItem<'_, CudaStorage>],
    scalars: &mut CudaStorage,
) -> Result<()> {
    validate::prodigy_multi(items, scalars, |s| (s.buf.dtype(), s.buf.len()))?;
    let mut all: Vec<&CudaStorage> = vec![&*scalars];
    for it in items.iter() {
        all.extend([&*it.p, it.g, &*it.v, &*it.s]);
        all.extend(it.m.as_deref());
        all.extend(it.p0);
    }
    check_devices(OP, all.into_iter())?;
    let has_m = items.first().is_some_and(|i| i.m.is_some());
    let fl = flags(h, has_m);
    let st = addr(scalars, 0);
    // Each item's first chunk in the step (the partial sums' order, the CPU's order).
    let mut pfirst = Vec::with_capacity(items.len());
    let mut total = 0u64;
    for it in items.iter() {
        pfirst.push(total);
        total += it.n.div_ceil(PRODIGY_CHUNK) as u64;
    }
    let dev = scalars.dev.clone();
    let mut partial = dev.alloc::<f64>(2 * total.max(1) as usize)?;
    // One table per parameter dtype present.
    let mut tables = vec![];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut table: Vec<u64> = vec![];
        let (mut chunks, mut k) = (0u64, 0u32);
        for (it, &pf) in items.iter().zip(&pfirst) {
            if it.n == 0 || it.p.buf.dtype() != dtype {
                continue;
            }
            table.extend([
                addr(it.p, it.p_offset),
                addr(it.g, it.g_offset),
                it.m.as_deref().map_or(0, |m| addr(m, 0)),
                addr(it.v, 0),
                addr(it.s, 0),
                it.p0.map_or(0, |q| addr(q, 0)),
                it.n as u64,
                chunks,
                pf,
            ]);
            chunks += it.n.div_ceil(PRODIGY_CHUNK) as u64;
            k += 1;
        }
        if k > 0 {
            tables.push((sfx(dtype)?, grid(OP, chunks)?, upload(scalars, &table)?, k));
        }
    }
    let a = [
        h.lr,
        h.beta1,
        h.beta2,
        h.beta3,
        h.eps,
        h.weight_decay,
        h.d0,
        h.d_coef,
        h.growth_rate,
    ];
    for (s, cfg, t, k) in &tables {
        launch!(
            dev,
            "multi_tensor",
            format!("prodigy_pass1_{s}"),
            *cfg,
            &*t.slice,
            k,
            &st,
            &mut *partial.slice,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6],
            &a[7],
            &a[8],
            &h.grad_scale,
            &fl
        )?;
    }
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        "multi_tensor",
        "prodigy_reduce",
        one,
        &*partial.slice,
        &total,
        &st,
        &a[0],
        &a[1],
        &a[2],
        &a[3],
        &a[4],
        &a[5],
        &a[6],
        &a[7],
        &a[8],
        &h.grad_scale,
        &fl
    )?;
    for (s, cfg, t, k) in &tables {
        launch!(
            dev,
            "multi_tensor",
            format!("prodigy_pass2_{s}"),
            *cfg,
            &*t.slice,
            k,
            &st,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6],
            &a[7],
            &a[8],
            &h.grad_scale,
            &fl
        )?;
    }
    Ok(())
}
