//! Launchers of the schedule-free multi-tensor calls (cuda/multi_tensor.cu,
//! `backend::multi_sf`): one launch per parameter dtype, and for Prodigy one reduction
//! block after them, on the device's stream with no host synchronization. Operands were
//! checked by `validate::schedulefree_multi`.

use super::multi::{addr, check_devices, grid, sfx, upload, THREADS};
use super::storage::{launch, CudaStorage};
use crate::backend::multi::PRODIGY_CHUNK;
use crate::backend::multi_sf::{SfItem, SfOp};
use crate::backend::validate;
use crate::{DType, Error, Result, Shape};
use cudarc::driver::LaunchConfig;

const OP: &str = "schedulefree_multi";
/// Values per block of the lerp and AdamW kernels (ADAM_CHUNK).
const CHUNK: usize = 4096;

/// `BackendStorage::schedulefree_multi` on CUDA.
pub(super) fn schedulefree(
    op: &SfOp,
    items: &mut [SfItem<'_, CudaStorage>],
    scalars: Option<&mut CudaStorage>,
) -> Result<()> {
    validate::schedulefree_multi(op, items, scalars.as_deref(), |s| {
        (s.buf.dtype(), s.buf.len())
    })?;
    let mut all: Vec<&CudaStorage> = scalars.iter().map(|s| &**s).collect();
    for it in items.iter() {
        all.extend([&*it.p, &*it.z]);
        all.extend(it.g);
        all.extend(it.v.as_deref());
        all.extend(it.s.as_deref());
        all.extend(it.p0);
    }
    let Some(first) = check_devices(OP, all.into_iter())? else {
        return Ok(());
    };
    let dev = first.dev.clone();
    let chunk = match op {
        SfOp::Prodigy(_) => PRODIGY_CHUNK,
        _ => CHUNK,
    };
    // Each item's first chunk in the call (Prodigy's partial sums' order, the CPU's order).
    let mut ifirst = Vec::with_capacity(items.len() + 1);
    let mut total = 0u64;
    for it in items.iter() {
        ifirst.push(total);
        total += it.n.div_ceil(chunk) as u64;
    }
    ifirst.push(total);
    let mut tables = vec![];
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut table: Vec<u64> = vec![];
        let (mut chunks, mut k) = (0u64, 0u32);
        for (it, &pf) in items.iter().zip(&ifirst) {
            if it.n == 0 || it.p.buf.dtype() != dtype {
                continue;
            }
            table.extend([
                addr(it.p, it.p_offset),
                it.g.map_or(0, |g| addr(g, it.g_offset)),
                it.v.as_deref().map_or(0, |v| addr(v, 0)),
                addr(it.z, 0),
                it.s.as_deref().map_or(0, |s| addr(s, 0)),
                it.p0.map_or(0, |q| addr(q, 0)),
                it.n as u64,
                chunks,
                pf,
            ]);
            chunks += it.n.div_ceil(chunk) as u64;
            k += 1;
        }
        if k > 0 {
            tables.push((sfx(dtype)?, grid(OP, chunks)?, upload(first, &table)?, k));
        }
    }
    match op {
        SfOp::Lerp(w) => {
            for (s, cfg, t, k) in &tables {
                launch!(
                    dev,
                    "multi_tensor",
                    format!("sf_lerp_{s}"),
                    *cfg,
                    &*t.slice,
                    k,
                    w
                )?;
            }
        }
        SfOp::AdamW(c) => {
            for (s, cfg, t, k) in &tables {
                launch!(
                    dev,
                    "multi_tensor",
                    format!("sf_adamw_{s}"),
                    *cfg,
                    &*t.slice,
                    k,
                    &c.grad_scale,
                    &c.beta2,
                    &c.one_minus_beta2,
                    &c.bias2,
                    &c.eps,
                    &c.weight_decay,
                    &c.ckp1,
                    &c.y_step,
                    &c.lr
                )?;
            }
        }
        SfOp::Prodigy(h) => {
            let st = match &scalars {
                Some(s) => addr(s, 0),
                None => {
                    return Err(Error::invalid(
                        OP,
                        "internal: no scalar state after validation",
                        &Shape::from(()),
                    ))
                }
            };
            let mut partial = dev.alloc::<f64>(2 * total.max(1) as usize)?;
            let firsts = upload(first, &ifirst)?;
            let a = [
                h.lr,
                h.beta1,
                h.beta2,
                h.beta3,
                h.eps,
                h.weight_decay,
                h.d0,
                h.d_coef,
                h.schedulefree_c,
            ];
            let fl = u32::from(h.d_limiter);
            for (s, cfg, t, k) in &tables {
                launch!(
                    dev,
                    "multi_tensor",
                    format!("prodigy_sf_pass_{s}"),
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
            let n_items = items.len() as u64;
            launch!(
                dev,
                "multi_tensor",
                "prodigy_sf_reduce",
                one,
                &*partial.slice,
                &*firsts.slice,
                &n_items,
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
    }
    Ok(())
}
