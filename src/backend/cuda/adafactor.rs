//! Launchers of Adafactor's multi-tensor step (cuda/multi_tensor.cu, `backend::adafactor`):
//! one table of every parameter, five launches on the device's stream (the factored lines,
//! the row moments' means, the update's sums, each parameter's scalars, the update) and no
//! host synchronization; and of the moving average of weights (one launch). Operands were
//! checked by `validate::adafactor_multi` / `validate::ema_multi`.

use super::multi::{addr, check_devices, code, grid, upload, THREADS};
use super::storage::{launch, CudaStorage};
use crate::backend::adafactor::{AdafactorHyper, AdafactorItem, AdafactorMoment, AF_CHUNK};
use crate::backend::multi::MultiRef;
use crate::backend::validate;
use crate::{Error, Result};

const OP: &str = "adafactor_multi";
/// Values per chunk of the EMA update (the kernels' ADAM_CHUNK).
const EMA_CHUNK: usize = 4096;
/// Warps per block of the line kernels (MT_WARPS).
const WARPS: u64 = THREADS as u64 / 32;

/// Two f32 in one u64 word, the first at the lower address.
fn pair(a: f32, b: f32) -> u64 {
    u64::from(a.to_bits()) | (u64::from(b.to_bits()) << 32)
}

/// `BackendStorage::adafactor_multi` on CUDA.
pub(super) fn adafactor(
    h: &AdafactorHyper,
    items: &mut [AdafactorItem<'_, CudaStorage>],
) -> Result<()> {
    validate::adafactor_multi(items, h.beta1.is_some(), |s| (s.buf.dtype(), s.buf.len()))?;
    let mut all: Vec<&CudaStorage> = vec![];
    for it in items.iter() {
        all.extend([&*it.p, it.g]);
        all.extend(it.m.as_deref());
        match &it.v {
            AdafactorMoment::Factored { row, col, .. } => all.extend([&**row, &**col]),
            AdafactorMoment::Full(v) => all.push(&**v),
        }
    }
    let Some(first) = check_devices(OP, all.into_iter())? else {
        return Ok(());
    };
    // The table (AfEntry): parameters with values, with their first line, matrix and chunk.
    let mut table: Vec<u64> = vec![];
    let (mut lines, mut batches, mut chunks, mut k) = (0u64, 0u64, 0u64, 0u32);
    for it in items.iter() {
        if it.n == 0 {
            continue;
        }
        let (a, c, rows, cols) = match &it.v {
            AdafactorMoment::Factored {
                row,
                col,
                rows,
                cols,
            } => (addr(row, 0), addr(col, 0), *rows as u64, *cols as u64),
            AdafactorMoment::Full(v) => (addr(v, 0), 0, 0, 0),
        };
        table.extend([
            addr(it.p, it.p_offset),
            addr(it.g, it.g_offset),
            it.m.as_deref().map_or(0, |m| addr(m, 0)),
            a,
            c,
            it.n as u64,
            rows,
            cols,
            code(OP, it.p.buf.dtype())?,
            lines,
            batches,
            chunks,
            it.step.rel.to_bits(),
            pair(it.step.beta2t, it.step.one_minus_beta2t),
        ]);
        if c != 0 {
            let b = it.n as u64 / (rows * cols);
            lines += b * (rows + cols);
            batches += b;
        }
        chunks += it.n.div_ceil(AF_CHUNK) as u64;
        k += 1;
    }
    if k == 0 {
        return Ok(());
    }
    let dev = first.dev.clone();
    let t = upload(first, &table)?;
    let mut rmean = dev.alloc::<f32>(batches.max(1) as usize)?;
    let mut partial = dev.alloc::<f64>(2 * chunks as usize)?;
    let mut scal = dev.alloc::<f32>(2 * k as usize)?;
    let beta1 = h.beta1.unwrap_or(0.0);
    let flags = u32::from(h.scale_parameter) | (u32::from(h.beta1.is_some()) << 1);
    if lines > 0 {
        launch!(
            dev,
            "multi_tensor",
            "af_lines",
            grid(OP, lines.div_ceil(WARPS))?,
            &*t.slice,
            &k,
            &lines,
            &h.eps1,
            &h.grad_scale
        )?;
        launch!(
            dev,
            "multi_tensor",
            "af_rmean",
            grid(OP, batches.div_ceil(WARPS))?,
            &*t.slice,
            &k,
            &batches,
            &mut *rmean.slice
        )?;
    }
    launch!(
        dev,
        "multi_tensor",
        "af_update",
        grid(OP, chunks)?,
        &*t.slice,
        &k,
        &*rmean.slice,
        &mut *partial.slice,
        &h.eps1,
        &h.grad_scale,
        &flags
    )?;
    launch!(
        dev,
        "multi_tensor",
        "af_scalars",
        grid(OP, u64::from(k).div_ceil(u64::from(THREADS)))?,
        &*t.slice,
        &k,
        &*partial.slice,
        &mut *scal.slice,
        &h.eps2,
        &h.clip_threshold,
        &h.weight_decay,
        &flags
    )?;
    launch!(
        dev,
        "multi_tensor",
        "af_apply",
        grid(OP, chunks)?,
        &*t.slice,
        &k,
        &*rmean.slice,
        &*scal.slice,
        &h.grad_scale,
        &beta1,
        &h.one_minus_beta1,
        &flags
    )
}

/// `BackendStorage::ema_multi` on CUDA.
pub(super) fn ema(
    k: f32,
    shadow: &mut CudaStorage,
    items: &[MultiRef<'_, CudaStorage>],
) -> Result<()> {
    const OP: &str = "ema_multi";
    validate::ema_multi(shadow, items, |s| (s.buf.dtype(), s.buf.len()))?;
    check_devices(
        OP,
        std::iter::once(&*shadow).chain(items.iter().map(|i| i.s)),
    )?;
    let mut table: Vec<u64> = vec![];
    let (mut chunks, mut kk, mut offset) = (0u64, 0u32, 0u64);
    for it in items {
        if it.n > 0 {
            table.extend([
                addr(it.s, it.offset),
                it.n as u64,
                code(OP, it.s.buf.dtype())?,
                offset,
                chunks,
            ]);
            chunks += it.n.div_ceil(EMA_CHUNK) as u64;
            kk += 1;
        }
        offset += it.n as u64;
    }
    if kk == 0 {
        return Ok(());
    }
    let t = upload(shadow, &table)?;
    let dev = shadow.dev.clone();
    let s = addr(shadow, 0);
    launch!(
        dev,
        "multi_tensor",
        "ema_update",
        grid(OP, chunks)?,
        &*t.slice,
        &kk,
        &s,
        &k
    )
}
