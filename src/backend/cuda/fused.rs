//! Launchers of the fused kernels of `FusedOp` (kernels in cuda/fused.cu, softmax's backward
//! in cuda/softmax.cu; attention in attention.rs) and the common
//! part of every `backend::Kernel` (`run_kernel`; the kernels' own launchers are in their
//! files of `tensor/kernels/`). Operands are
//! checked by `validate::fused`, views are made dense, outputs are fresh buffers.
//!
//! Column sums (the weight/bias gradients of norms and modulation) are taken by the backward's
//! row kernel when it computes dx too (rows of whole packs up to 8192 columns: cuda/rows.cuh's
//! row blocks, each writing f32 partial rows), or else swept: a thread per column walks a
//! chunk of rows, chunks spread over grid.y so the GPU fills, writing f64 partials. A second
//! kernel adds the partials in a fixed order (deterministic, no atomics). On Hopper the norms'
//! backward with dw and db is one kernel instead (norm.rs `launch_bwd_bulk`: rows by bulk
//! copies, the partials added after a grid-wide barrier, in a fixed order too).

use super::memory::DevBuf;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::{validate, BackendDevice, FusedOp, NormKind};
use crate::{DType, Error, Layout, Result};
use cudarc::driver::DeviceRepr;
use cudarc::driver::LaunchConfig;
use half::{bf16, f16};

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

/// dw, db of a last-dim norm by a column sweep over x and dy (p: x, dy, mean, rstd).
fn norm_param_sweep<T: Elem, O: Elem>(
    dev: &super::CudaDevice,
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
    launch!(
        dev,
        "fused",
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

/// Runs kernel `k` (see `backend::Kernel`): the views checked, its check, one device,
/// dense operands, then its CUDA implementation.
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
    let dense = args
        .iter()
        .map(|(s, l)| s.dense(name, l))
        .collect::<Result<Vec<_>>>()?;
    let bufs: Vec<&CudaStorage> = dense
        .iter()
        .zip(args)
        .map(|(d, (s, _))| d.as_ref().unwrap_or(s))
        .collect();
    k.cuda(&dims, &bufs)
}

pub(crate) fn fused(op: FusedOp, args: &[(&CudaStorage, &Layout)]) -> Result<Vec<CudaStorage>> {
    let name = op.name();
    for (s, l) in args {
        s.check(name, l)?;
    }
    let metas: Vec<_> = args.iter().map(|(s, l)| (s.buf.dtype(), *l)).collect();
    let dims = validate::fused(op, &metas)?;
    let first = args[0].0;
    if args.iter().any(|(s, _)| !first.dev.same_device(&s.dev)) {
        return Err(Error::DeviceMismatch {
            op: name,
            lhs: first.dev.location(),
            rhs: "another device".into(),
        });
    }
    if let FusedOp::Attention { .. } | FusedOp::AttentionBackward { .. } = op {
        return super::attention::run(op, &dims, args);
    }
    let dense = args
        .iter()
        .map(|(s, l)| s.dense(name, l))
        .collect::<Result<Vec<_>>>()?;
    let bufs: Vec<&CudaStorage> = dense
        .iter()
        .zip(args)
        .map(|(d, (s, _))| d.as_ref().unwrap_or(s))
        .collect();
    if let FusedOp::DequantFp8 { dtype } = op {
        return super::fp8::dequant(dtype, &dims, &bufs);
    }
    match first.buf.dtype() {
        DType::F32 => run::<f32, f32>(op, &dims, &bufs),
        DType::F64 => run::<f64, f64>(op, &dims, &bufs),
        DType::BF16 => run::<bf16, f32>(op, &dims, &bufs),
        DType::F16 => run::<f16, f32>(op, &dims, &bufs),
        DType::U32 => Err(Error::UnsupportedDType {
            op: name,
            dtype: DType::U32,
        }),
    }
}

fn run<T: Elem, S: Elem>(op: FusedOp, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    let x = a[0];
    let dev = &x.dev;
    let sms = dev.sm_count().max(1);
    let out = |b| x.wrap(b);
    let p: Vec<u64> = a.iter().map(|s| ptr(s)).collect();
    Ok(match op {
        FusedOp::SoftmaxBackward => {
            let (rows, cols) = (d[0], d[1]);
            let mut dx = dev.alloc::<T>(rows * cols)?;
            let (packs, shape) = super::storage::softmax_kernel(T::DTYPE, rows, cols, sms);
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
            vec![out(T::wrap(dx))]
        }
        FusedOp::NormParamGrads(kind) => {
            let (dw, db) = norm_param_sweep::<T, S>(dev, &p, (d[0], d[1]), kind)?;
            vec![out(S::wrap(dw)), out(S::wrap(db))]
        }
        FusedOp::NormBackward { kind, weight } => {
            let (rows, cols) = (d[0], d[1]);
            let w = if weight { p[4] } else { 0 };
            if let Some((dx, dw, db)) =
                super::norm::launch_bwd_bulk::<T>(dev, &p, w, (rows, cols), kind)?
            {
                return Ok(vec![out(T::wrap(dx)), out(T::wrap(dw)), out(T::wrap(db))]);
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
                super::norm::launch_bwd_sums::<T>(dev, &p, w, &mut dx, (rows, cols), kind)?
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
                    super::norm::launch_bwd::<T>(
                        dev,
                        &p,
                        w,
                        &mut dx,
                        (rows, cols),
                        kind,
                        super::norm::RowMap::dense(cols),
                    )?;
                    norm_param_sweep::<T, T>(dev, &p, (rows, cols), kind)?
                }
            };
            vec![out(T::wrap(dx)), out(T::wrap(dw)), out(T::wrap(db))]
        }
        // `fused` hands these to cuda::attention before operands are made dense: the flash
        // kernels read strided views.
        FusedOp::Attention { .. }
        | FusedOp::AttentionBackward { .. }
        | FusedOp::DequantFp8 { .. } => {
            return Err(Error::Cuda(format!(
                "{} reached the dense launcher",
                op.name()
            )))
        }
    })
}
