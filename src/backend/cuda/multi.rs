//! Launchers of the multi-tensor kernels (cuda/multi_tensor.cu, `backend::multi`): one table
//! of the tensors uploaded per call (u64 words, the layout of the kernels' `*Entry` structs),
//! one launch per call. Operands were checked by `validate::adam_multi` / `sum_sq_multi`;
//! parameters and moments are written in place (each thread reads a value before writing it,
//! each 8-bit block its own codes).

use super::storage::{launch, CudaStorage};
use crate::backend::multi::{AdamHyper, AdamItem, AdamMoments, MultiRef};
use crate::backend::quant8::BLOCK;
use crate::backend::{validate, BackendDevice, BackendStorage};
use crate::{DType, Error, Result, Shape};
use cudarc::driver::LaunchConfig;

/// Values per thread block of the f32-moment update and of the sums of squares (the
/// kernels' ADAM_CHUNK and SUMSQ_CHUNK).
const CHUNK: usize = 4096;
/// Threads per block (MT_THREADS).
pub(super) const THREADS: u32 = 256;

pub(super) fn sfx(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        DType::U32 => {
            return Err(Error::UnsupportedDType {
                op: "multi_tensor",
                dtype,
            })
        }
    })
}

/// The device address of element `offset` of `s`.
pub(super) fn addr(s: &CudaStorage, offset: usize) -> u64 {
    s.buf.raw_ptr(s.dev.stream()) + (offset * s.buf.dtype().size_in_bytes()) as u64
}

/// Two f32 in one u64 word, the first at the lower address.
fn pair(a: f32, b: f32) -> u64 {
    u64::from(a.to_bits()) | (u64::from(b.to_bits()) << 32)
}

/// The first of `bufs`, after checking that all are on its device.
pub(super) fn check_devices<'a>(
    op: &'static str,
    mut bufs: impl Iterator<Item = &'a CudaStorage>,
) -> Result<Option<&'a CudaStorage>> {
    let Some(first) = bufs.next() else {
        return Ok(None);
    };
    for s in bufs {
        if !first.dev.same_device(&s.dev) {
            return Err(Error::DeviceMismatch {
                op,
                lhs: first.dev.location(),
                rhs: s.dev.location(),
            });
        }
    }
    Ok(Some(first))
}

/// The grouped kernels' dtype code of a tensor.
pub(super) fn code(op: &'static str, dtype: DType) -> Result<u64> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        _ => Err(Error::UnsupportedDType { op, dtype }),
    }
}

pub(super) fn grid(op: &'static str, chunks: u64) -> Result<LaunchConfig> {
    if chunks > (1 << 31) - 1 {
        return Err(Error::invalid(
            op,
            format!("{chunks} chunks exceed one launch"),
            &Shape::from(()),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (chunks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A device copy of a launch's table.
pub(super) fn upload(s: &CudaStorage, table: &[u64]) -> Result<super::memory::DevBuf<u64>> {
    let mut t = s.dev.alloc::<u64>(table.len())?;
    s.dev
        .stream()
        .memcpy_htod(table, &mut *t.slice)
        .map_err(super::cuda_err(
            "copying a multi-tensor table to the device",
        ))?;
    Ok(t)
}

/// `BackendStorage::adam_multi` on CUDA.
pub(super) fn adam(
    h: &AdamHyper,
    items: &mut [AdamItem<'_, CudaStorage>],
    maps: Option<&CudaStorage>,
) -> Result<()> {
    const OP: &str = "adam_multi";
    validate::adam_multi(items, maps, |s| (s.buf.dtype(), s.buf.len()))?;
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dtype = first.p.buf.dtype();
    let quantized = matches!(first.moments, AdamMoments::Quantized { .. });
    let mut all: Vec<&CudaStorage> = vec![];
    for it in items.iter() {
        all.push(&*it.p);
        all.push(it.g);
        match &it.moments {
            AdamMoments::Full { m, v } => all.extend([&**m, &**v]),
            AdamMoments::Quantized {
                m_codes,
                m_absmax,
                v_codes,
                v_absmax,
            } => all.extend([&**m_codes, &**m_absmax, &**v_codes, &**v_absmax]),
        }
    }
    all.extend(maps);
    let dev_of = check_devices(OP, all.into_iter())?
        .ok_or_else(|| Error::invalid(OP, "internal: no operands", &Shape::from(())))?;
    // The table: one entry per tensor with values (empty ones have no chunk).
    let mut table: Vec<u64> = vec![];
    let mut chunks = 0u64;
    let mut k = 0u32;
    let per = if quantized { BLOCK } else { CHUNK };
    for it in items.iter() {
        if it.n == 0 {
            continue;
        }
        table.extend([addr(it.p, it.p_offset), addr(it.g, it.g_offset)]);
        match &it.moments {
            AdamMoments::Full { m, v } => table.extend([addr(m, 0), addr(v, 0)]),
            AdamMoments::Quantized {
                m_codes,
                m_absmax,
                v_codes,
                v_absmax,
            } => table.extend([
                addr(m_codes, 0),
                addr(m_absmax, 0),
                addr(v_codes, 0),
                addr(v_absmax, 0),
            ]),
        }
        table.extend([
            it.n as u64,
            chunks,
            pair(it.bias.step_size, it.bias.bias2_sqrt),
        ]);
        chunks += it.n.div_ceil(per) as u64;
        k += 1;
    }
    if k == 0 {
        return Ok(());
    }
    let cfg = grid(OP, chunks)?;
    let dev = &dev_of.dev;
    let t = upload(dev_of, &table)?;
    let s = sfx(dtype)?;
    let scal = [
        h.beta1,
        h.beta2,
        h.one_minus_beta1,
        h.one_minus_beta2,
        h.eps,
        h.decay,
        h.l2,
        h.grad_scale,
    ];
    if quantized {
        let maps = maps.ok_or_else(|| Error::invalid(OP, "no maps", &Shape::from(())))?;
        let mp = addr(maps, 0);
        launch!(
            dev,
            "multi_tensor",
            format!("adam_8bit_{s}"),
            cfg,
            &*t.slice,
            &k,
            &mp,
            &scal[0],
            &scal[1],
            &scal[2],
            &scal[3],
            &scal[4],
            &scal[5],
            &scal[6],
            &scal[7]
        )
    } else {
        launch!(
            dev,
            "multi_tensor",
            format!("adam_full_{s}"),
            cfg,
            &*t.slice,
            &k,
            &scal[0],
            &scal[1],
            &scal[2],
            &scal[3],
            &scal[4],
            &scal[5],
            &scal[6],
            &scal[7]
        )
    }
}

/// `BackendStorage::sum_sq_multi` on CUDA: f64 partial sums per chunk, added on the host in
/// chunk order.
pub(super) fn sum_sq(items: &[MultiRef<'_, CudaStorage>]) -> Result<f64> {
    const OP: &str = "sum_sq_multi";
    validate::sum_sq_multi(items, |s| (s.buf.dtype(), s.buf.len()))?;
    let Some(first) = check_devices(OP, items.iter().map(|i| i.s))? else {
        return Ok(0.0);
    };
    let mut total = 0.0;
    // One launch per dtype present, in a fixed order.
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let mut table: Vec<u64> = vec![];
        let (mut chunks, mut k) = (0u64, 0u32);
        for it in items.iter().filter(|i| i.s.dtype() == dtype && i.n > 0) {
            table.extend([addr(it.s, it.offset), it.n as u64, chunks]);
            chunks += it.n.div_ceil(CHUNK) as u64;
            k += 1;
        }
        if k == 0 {
            continue;
        }
        let cfg = grid(OP, chunks)?;
        let dev = &first.dev;
        let t = upload(first, &table)?;
        let mut partial = dev.alloc::<f64>(chunks as usize)?;
        launch!(
            dev,
            "multi_tensor",
            format!("sum_sq_{}", sfx(dtype)?),
            cfg,
            &*t.slice,
            &k,
            &mut *partial.slice
        )?;
        let host = dev
            .stream()
            .clone_dtoh(&*partial.slice)
            .map_err(super::cuda_err("copying partial sums to the host"))?;
        total += host.iter().sum::<f64>();
    }
    Ok(total)
}

/// Values per thread block of the grouped copies and folds (the kernels' ADAM_CHUNK).
const COPY_CHUNK: usize = CHUNK;

/// `BackendStorage::cast_multi` on CUDA: one launch over a table of (source, values, its
/// dtype code, destination, first chunk, factor bits) per item.
pub(super) fn cast(
    out: &mut CudaStorage,
    items: &[crate::backend::multi::CastItem<'_, CudaStorage>],
) -> Result<()> {
    const OP: &str = "cast_multi";
    validate::cast_multi(out, items, |s| (s.buf.dtype(), s.buf.len()))?;
    check_devices(
        OP,
        std::iter::once(&*out).chain(items.iter().map(|i| i.src.s)),
    )?;
    let out_code = code(OP, out.buf.dtype())?;
    let mut table: Vec<u64> = vec![];
    let (mut chunks, mut k, mut offset) = (0u64, 0u32, 0usize);
    for it in items {
        let n = it.src.n;
        if n > 0 {
            table.extend([
                addr(it.src.s, it.src.offset),
                n as u64,
                code(OP, it.src.s.buf.dtype())?,
                addr(out, offset),
                chunks,
                u64::from(it.scale.to_bits()),
            ]);
            chunks += n.div_ceil(COPY_CHUNK) as u64;
            k += 1;
        }
        offset += n;
    }
    if k == 0 {
        return Ok(());
    }
    let t = upload(out, &table)?;
    let dev = out.dev.clone();
    launch!(
        dev,
        "multi_tensor",
        "grouped_copy",
        grid(OP, chunks)?,
        &*t.slice,
        &k,
        &out_code
    )
}

/// `BackendStorage::fold_multi` on CUDA: one launch over a table of (gradient, values, its
/// dtype code, earlier gradient or 0, destination, first chunk, factor bits) per item.
pub(super) fn fold(
    out: &mut CudaStorage,
    items: &[crate::backend::multi::FoldItem<'_, CudaStorage>],
) -> Result<()> {
    const OP: &str = "fold_multi";
    validate::fold_multi(out, items, |s| (s.buf.dtype(), s.buf.len()))?;
    check_devices(
        OP,
        std::iter::once(&*out)
            .chain(items.iter().map(|i| i.g.s))
            .chain(items.iter().filter_map(|i| i.prev.as_ref().map(|p| p.s))),
    )?;
    let mut table: Vec<u64> = vec![];
    let (mut chunks, mut k, mut offset) = (0u64, 0u32, 0usize);
    for it in items {
        let n = it.g.n;
        if n > 0 {
            table.extend([
                addr(it.g.s, it.g.offset),
                n as u64,
                code(OP, it.g.s.buf.dtype())?,
                it.prev.as_ref().map_or(0, |p| addr(p.s, p.offset)),
                addr(out, offset),
                chunks,
                u64::from(it.scale.to_bits()),
            ]);
            chunks += n.div_ceil(COPY_CHUNK) as u64;
            k += 1;
        }
        offset += n;
    }
    if k == 0 {
        return Ok(());
    }
    let t = upload(out, &table)?;
    let dev = out.dev.clone();
    launch!(
        dev,
        "multi_tensor",
        "grouped_fold",
        grid(OP, chunks)?,
        &*t.slice,
        &k
    )
}
