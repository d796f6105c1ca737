//! Reduction launchers (kernels in cuda/reduce.cu): one thread per output for short reduced
//! ranges, one warp per output for contiguous ranges (16-byte loads), one block per output
//! otherwise, and a chunked two-pass form when there are too few outputs to fill the GPU. A sum
//! over leading dims (outputs adjacent in memory) gets a thread per output instead.

use super::layout::{grid_for, KernelLayout};
use super::storage::{by_dtype, launch, CudaStorage, Elem};
use crate::backend::ReduceOp;
use crate::{DType, Error, Layout, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// `Partial` of cuda/reduce.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Partial {
    v: f64,
    idx: u64,
}
// SAFETY: repr(C) f64 + u64, as the kernel's struct.
unsafe impl DeviceRepr for Partial {}

/// Reduced ranges up to this length get one thread per output.
const SMALL: usize = 64;
/// Fewest elements per block-chunk when a reduction is split.
const CHUNK_MIN: usize = 4096;

fn blocks(x: usize, y: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn reduce_t<T: Elem>(
    s: &CudaStorage,
    l: &Layout,
    op: ReduceOp,
    dims: &[usize],
) -> Result<CudaStorage> {
    s.check(op.name(), l)?;
    let src = s.typed::<T>(op.name())?;
    let (kept, red) = l.split_reduced(dims);
    let (kk, kr) = (
        KernelLayout::new(&kept, op.name())?,
        KernelLayout::new(&red, op.name())?,
    );
    let (n_out, n_red) = (kept.elem_count(), red.elem_count());
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    let dev = &s.dev;
    let out = dev.alloc_like(if arg { DType::U32 } else { T::DTYPE }, n_out)?;
    if n_out == 0 {
        return Ok(out);
    }
    // Exactly one of (values, indices) is written; the other pointer is null.
    let ptr = out.buf.raw_ptr(dev.stream());
    let (out_v, out_i) = if arg { (0u64, ptr) } else { (ptr, 0u64) };
    let name = format!("r_{}", op.name());
    if n_red <= SMALL {
        launch!(
            dev,
            "reduce",
            format!("{name}_small_{}", T::SFX),
            grid_for(n_out, dev.sm_count()),
            &*src.slice,
            &kk,
            &kr,
            &n_out,
            &n_red,
            &out_v,
            &out_i
        )?;
        return Ok(out);
    }
    let sms = dev.sm_count().max(1);
    if red.is_contiguous() && n_out >= sms {
        // A warp per output: 8 per block of 256 threads.
        let cfg = grid_for(n_out.div_ceil(8) * 256, sms);
        launch!(
            dev,
            "reduce",
            format!("{name}_rows_{}", T::SFX),
            cfg,
            &*src.slice,
            &kk,
            &n_out,
            &n_red,
            &out_v,
            &out_i
        )?;
        return Ok(out);
    }
    // Neighbouring outputs adjacent in memory (a sum over leading dims): a thread per output.
    if kept.strides().last() == Some(&1) {
        let col_blocks = n_out.div_ceil(256);
        let parts = (8 * sms)
            .div_ceil(col_blocks)
            .min(n_red.div_ceil(16))
            .clamp(1, 65535);
        let chunk = n_red.div_ceil(parts);
        let parts = n_red.div_ceil(chunk);
        let mut partials = dev.alloc::<Partial>(if parts > 1 { n_out * parts } else { 1 })?;
        launch!(
            dev,
            "reduce",
            format!("{name}_cols_{}", T::SFX),
            blocks(col_blocks, parts),
            &*src.slice,
            &kk,
            &kr,
            &n_out,
            &n_red,
            &chunk,
            &out_v,
            &out_i,
            &mut *partials.slice
        )?;
        if parts > 1 {
            launch!(
                dev,
                "reduce",
                format!("{name}_cols_partials_{}", T::SFX),
                blocks(n_out.div_ceil(32), 1),
                &*partials.slice,
                &parts,
                &n_out,
                &out_v,
                &out_i
            )?;
        }
        return Ok(out);
    }
    if n_out > i32::MAX as usize {
        return Err(Error::invalid(
            op.name(),
            format!("{n_out} outputs exceed one launch"),
            l.shape(),
        ));
    }
    let parts = if n_out >= 2 * sms {
        1
    } else {
        n_red
            .div_ceil(CHUNK_MIN)
            .min((4 * sms).div_ceil(n_out))
            .max(1)
    };
    let chunk = n_red.div_ceil(parts);
    let parts = n_red.div_ceil(chunk);
    let block = format!("{name}_block_{}", T::SFX);
    if parts == 1 {
        let null: u64 = 0;
        launch!(
            dev,
            "reduce",
            block,
            blocks(n_out, 1),
            &*src.slice,
            &kk,
            &kr,
            &n_red,
            &chunk,
            &out_v,
            &out_i,
            &null
        )?;
        return Ok(out);
    }
    let mut partials = dev.alloc::<Partial>(n_out * parts)?;
    launch!(
        dev,
        "reduce",
        block,
        blocks(n_out, parts),
        &*src.slice,
        &kk,
        &kr,
        &n_red,
        &chunk,
        &out_v,
        &out_i,
        &mut *partials.slice
    )?;
    launch!(
        dev,
        "reduce",
        format!("{name}_partials_{}", T::SFX),
        blocks(n_out, 1),
        &*partials.slice,
        &parts,
        &out_v,
        &out_i
    )?;
    Ok(out)
}

pub(crate) fn reduce(
    s: &CudaStorage,
    l: &Layout,
    op: ReduceOp,
    dims: &[usize],
) -> Result<CudaStorage> {
    crate::backend::validate::reduction(op, l, dims, s.buf.dtype())?;
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    let u32_err = Error::UnsupportedDType {
        op: op.name(),
        dtype: DType::U32,
    };
    by_dtype!(s.buf.dtype(), reduce_t(s, l, op, dims), u32 => if arg { reduce_t::<u32>(s, l, op, dims) } else { Err(u32_err) })
}
