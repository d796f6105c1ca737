//! The common part of every fused kernel on CUDA (`run_kernel`: the views checked, the
//! kernel's check, one device, then its implementation, `backend::Kernel::cuda_views`), and
//! the launch helpers the kernels' own launchers in `tensor/kernels/` share (through
//! `kit`): launch shapes, and the deterministic column sums of the norms and modulation.
//!
//! Column sums come as partial rows, f32 from a backward's row blocks (cuda/rows.cuh) or f64
//! from the column sweeps (a thread per column walking a chunk of rows, chunks spread over
//! grid.y so the GPU fills); `sum_parts` adds the partials in a fixed order (cuda/fused.cu's
//! `sum_partials2*`: deterministic, no atomics).

use super::memory::DevBuf;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::BackendDevice;
use crate::{DType, Error, Layout, Result};
use cudarc::driver::DeviceRepr;
use cudarc::driver::LaunchConfig;

pub(crate) fn cfg(x: usize, y: usize, z: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch shape of the column sums by row blocks (cuda/rows.cuh) for rows of `cols`
/// columns: P packs a lane, `lw` lanes a row, `threads` a block (several row groups when a
/// row needs fewer than rows.cuh's COLSUM_THREADS), `step` rows a block takes at once.
pub(crate) struct ColSum {
    pub(crate) p: usize,
    pub(crate) lw: usize,
    threads: usize,
    step: usize,
}

/// Rows of whole 16-byte packs of a non-f64 dtype, with at most `lanes` lanes a row (the
/// instances in cuda/norm.cu and fused.cu: one pack a lane, four rows at a time, up to `lanes`
/// packs; two packs and two rows up to twice that; `lanes` is their launch bound).
pub(crate) fn colsum_shape(dtype: DType, cols: usize, lanes: usize) -> Option<ColSum> {
    const THREADS: usize = 256; // rows.cuh's COLSUM_THREADS
    if dtype == DType::F64 || cols % 8 != 0 || cols == 0 {
        return None;
    }
    let packs = cols / 8;
    let p = if packs <= lanes {
        1
    } else if packs <= 2 * lanes {
        2
    } else {
        return None;
    };
    let lanes = packs.div_ceil(p);
    let lw = if lanes < 32 {
        lanes.next_power_of_two()
    } else {
        lanes.div_ceil(32) * 32
    };
    let groups = (THREADS / lw).max(1);
    Some(ColSum {
        p,
        lw,
        threads: groups * lw,
        step: groups * if p == 1 { 4 } else { 2 },
    })
}

impl ColSum {
    pub(crate) fn cfg(&self, blocks: usize, batches: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks as u32, batches as u32, 1),
            block_dim: (self.threads as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// (blocks, chunk) for `rows` rows in chunks of whole steps, at most as many blocks as
    /// `kernel` keeps resident at once on the GPU, shared by `batches`, and at most two a
    /// multiprocessor: every block writes a partial row per sum, traffic the chunk's rows
    /// must outweigh.
    pub(crate) fn chunks(
        &self,
        dev: &super::CudaDevice,
        module: &'static str,
        kernel: &str,
        rows: usize,
        batches: usize,
    ) -> Result<(usize, usize)> {
        let resident = super::resident_blocks(dev, module, kernel, self.threads, 0)?;
        let most = (dev.sm_count().max(1) * resident.min(2)).div_ceil(batches);
        let blocks = rows.div_ceil(self.step).clamp(1, most.max(1));
        // (At least one step: zero rows still get one block, which writes zero sums.)
        let chunk = (rows.div_ceil(blocks).div_ceil(self.step) * self.step).max(self.step);
        Ok((rows.div_ceil(chunk).max(1), chunk))
    }
}

/// Sums `parts` partial rows of two sums of `m` values each (part[(p * 2 + k) * m + i], f64
/// from the sweeps, f32 from the row blocks) in double, in a fixed order, into O.
pub(crate) fn sum_parts<PT: DeviceRepr, O: Elem>(
    dev: &super::CudaDevice,
    part: &DevBuf<PT>,
    parts: usize,
    m: usize,
) -> Result<(DevBuf<O>, DevBuf<O>)> {
    let (mut o0, mut o1) = (dev.alloc::<O>(m)?, dev.alloc::<O>(m)?);
    let base = if std::mem::size_of::<PT>() == 4 {
        "sum_partials2f"
    } else {
        "sum_partials2"
    };
    // 32 outputs by cuda/fused.cu's SUM_GROUPS (32) groups of partial rows a block; the rows
    // split into slices (at least 32 rows each) until there are about two blocks a
    // multiprocessor, each column tile's slices met by a completion counter.
    let tiles = m.div_ceil(32);
    let slices = if tiles <= super::device::DONE_COUNTERS {
        (2 * dev.sm_count().max(1))
            .div_ceil(tiles)
            .min(parts / 32)
            .clamp(1, 65535)
    } else {
        1
    };
    let scratch = dev.alloc::<f64>(if slices > 1 { slices * 2 * m } else { 1 })?;
    let done = dev.done_counters()?;
    let shape = LaunchConfig {
        grid_dim: (tiles as u32, slices as u32, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        "fused",
        format!("{base}_{}", O::SFX),
        shape,
        &*part.slice,
        &parts,
        &m,
        &mut *o0.slice,
        &mut *o1.slice,
        &*scratch.slice,
        &done
    )?;
    Ok((o0, o1))
}

pub(crate) fn ptr(s: &CudaStorage) -> u64 {
    s.buf.raw_ptr(s.dev.stream())
}

/// (parts, chunk) for a sweep of `rows` rows by `blocks` blocks of columns: about eight
/// blocks per multiprocessor, at least `min_chunk` rows a chunk (the f64 partials of a chunk
/// cost as much traffic as a few rows of input).
pub(crate) fn sweep(rows: usize, blocks: usize, sms: usize, min_chunk: usize) -> (usize, usize) {
    let parts = (8 * sms)
        .div_ceil(blocks.max(1))
        .min(rows.div_ceil(min_chunk))
        .clamp(1, 65535);
    let chunk = rows.div_ceil(parts).max(1);
    (rows.div_ceil(chunk).max(1), chunk)
}

/// Runs kernel `k` (see `backend::Kernel`): the views checked, its check, one device, then
/// its CUDA implementation (on dense copies of the views unless it reads them in place).
pub(crate) fn run_kernel(
    k: &dyn crate::backend::Kernel,
    args: &[(&CudaStorage, &Layout)],
) -> Result<Vec<CudaStorage>> {
    let name = k.name();
    for (s, l) in args {
        s.check(name, l)?;
    }
    let metas: Vec<_> = args.iter().map(|(s, l)| (s.buf.dtype(), *l)).collect();
    let dims = k.check(&metas)?;
    let Some((first, _)) = args.first() else {
        return Err(Error::invalid(name, "no operands", &crate::Shape::from(())));
    };
    if args.iter().any(|(s, _)| !first.dev.same_device(&s.dev)) {
        return Err(Error::DeviceMismatch {
            op: name,
            lhs: first.dev.location(),
            rhs: "another device".into(),
        });
    }
    k.cuda_views(&dims, args)
}
