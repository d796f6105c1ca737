//! Launchers of the fused kernels of `FusedOp` (kernels in cuda/fused.cu; GroupNorm in
//! group_norm.rs, attention in attention.rs). Operands are
//! checked by `validate::fused`, views are made dense, outputs are fresh buffers.
//!
//! Column sums (the weight/bias gradients of norms and modulation) are swept: a thread per
//! column walks a chunk of rows, chunks spread over grid.y so the GPU fills, and a second
//! kernel adds the chunks' f64 partials in a fixed order (deterministic, no atomics).

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::{validate, BackendDevice, FusedOp, NormKind};
use crate::{DType, Error, Layout, Result};
use cudarc::driver::LaunchConfig;
use half::{bf16, f16};

fn cfg(x: usize, y: usize, z: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn ptr(s: &CudaStorage) -> u64 {
    s.buf.raw_ptr(s.dev.stream())
}

/// (parts, chunk) for a sweep of `rows` rows by `blocks` blocks of columns: about eight
/// blocks per multiprocessor, at least `min_chunk` rows a chunk (the f64 partials of a chunk
/// cost as much traffic as a few rows of input).
fn sweep(rows: usize, blocks: usize, sms: usize, min_chunk: usize) -> (usize, usize) {
    let parts = (8 * sms)
        .div_ceil(blocks.max(1))
        .min(rows.div_ceil(min_chunk))
        .clamp(1, 65535);
    let chunk = rows.div_ceil(parts).max(1);
    (rows.div_ceil(chunk).max(1), chunk)
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
    // Sums two partial rows per output into (S, S) buffers of m values.
    let finish = |part: &super::memory::DevBuf<f64>, parts: usize, m: usize| -> Result<_> {
        let (mut o0, mut o1) = (dev.alloc::<S>(m)?, dev.alloc::<S>(m)?);
        launch!(
            dev,
            "fused",
            format!("sum_partials2_{}", S::SFX),
            cfg(m.div_ceil(32), 1, 1),
            &*part.slice,
            &parts,
            &m,
            &mut *o0.slice,
            &mut *o1.slice
        )?;
        Ok((out(S::wrap(o0)), out(S::wrap(o1))))
    };
    Ok(match op {
        FusedOp::SoftmaxBackward => {
            let (rows, cols) = (d[0], d[1]);
            let mut dx = dev.alloc::<T>(rows * cols)?;
            let (packs, shape) = super::storage::softmax_kernel(T::DTYPE, rows, cols, sms);
            let kernel = match packs {
                Some(p) => format!("softmax_bwd_reg{p}_{}", T::SFX),
                None => format!("softmax_bwd_{}", T::SFX),
            };
            launch!(
                dev,
                "fused",
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
            let (rows, cols) = (d[0], d[1]);
            // Eight columns a thread when rows are whole 16-byte packs.
            let vec = cols % 8 == 0 && T::DTYPE != DType::F64;
            let (blocks, min_chunk, kernel) = if vec {
                (cols.div_ceil(8 * 32), 64, "norm_param_grads_vec")
            } else {
                (cols.div_ceil(256), 8, "norm_param_grads")
            };
            let (parts, chunk) = sweep(rows, blocks, sms, min_chunk);
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
            let (dw, db) = finish(&part, parts, cols)?;
            vec![dw, db]
        }
        FusedOp::Modulate => {
            let (b, l, dd) = (d[0], d[1], d[2]);
            let mut y = dev.alloc::<T>(b * l * dd)?;
            launch!(
                dev,
                "fused",
                format!("modulate_fwd_{}", T::SFX),
                grid_for((b * l * dd).div_ceil(8), sms),
                &p[0],
                &p[1],
                &p[2],
                &mut *y.slice,
                &b,
                &l,
                &dd
            )?;
            vec![out(T::wrap(y))]
        }
        FusedOp::ModulateBackward => {
            let (b, l, dd) = (d[0], d[1], d[2]);
            if b > 65535 {
                return Err(Error::invalid(
                    "modulate_backward",
                    format!("a batch of {b} exceeds one launch (65535)"),
                    &crate::Shape::from(d),
                ));
            }
            let vec = dd % 8 == 0 && T::DTYPE != DType::F64;
            let (blocks, min_chunk, kernel) = if vec {
                (dd.div_ceil(8 * 32), 64, "modulate_bwd_vec")
            } else {
                (dd.div_ceil(256), 8, "modulate_bwd")
            };
            let (parts, chunk) = sweep(l, blocks * b, sms, min_chunk);
            let part = dev.alloc::<f64>(parts * 2 * b * dd)?;
            let mut dx = dev.alloc::<T>(b * l * dd)?;
            launch!(
                dev,
                "fused",
                format!("{kernel}_{}", T::SFX),
                cfg(blocks, parts, b),
                &p[0],
                &p[1],
                &p[2],
                &mut *dx.slice,
                &*part.slice,
                &b,
                &l,
                &dd,
                &chunk
            )?;
            let (dshift, dscale) = finish(&part, parts, b * dd)?;
            vec![out(T::wrap(dx)), dshift, dscale]
        }
        FusedOp::Rope { transpose } => {
            let (b, h, l, hd, r) = (d[0], d[1], d[2], d[3], d[4]);
            let (half, pairs) = (hd / 2, b * h * l * hd / 2);
            let mut y = dev.alloc::<T>(2 * pairs)?;
            let t = i32::from(transpose);
            // Four pairs of four heads per thread (cuda/fused.cu's ROPE_HEADS) when they share
            // a rotation row and fit 32-bit indices.
            let vec = T::DTYPE != DType::F64 && half % 4 == 0 && pairs < (1 << 31);
            let (kernel, work) = if vec {
                let per_head = pairs / (4 * h.max(1));
                (format!("rope_vec_{}", T::SFX), per_head * h.div_ceil(4))
            } else {
                (format!("rope_{}", T::SFX), pairs)
            };
            launch!(
                dev,
                "fused",
                kernel,
                grid_for(work, sms),
                &p[0],
                &p[1],
                &mut *y.slice,
                &h,
                &l,
                &half,
                &r,
                &pairs,
                &t
            )?;
            vec![out(T::wrap(y))]
        }
        FusedOp::GroupNorm {
            groups,
            eps,
            weight,
            bias,
        } => {
            let dims = (d[0], d[1], d[2]);
            let (y, mean, rstd) =
                super::group_norm::forward::<T, S>(x, &p, dims, groups, eps, (weight, bias))?;
            vec![out(T::wrap(y)), out(S::wrap(mean)), out(S::wrap(rstd))]
        }
        FusedOp::GroupNormBackward { groups, weight } => {
            let dims = (d[0], d[1], d[2]);
            let (dx, dw, db) = super::group_norm::backward::<T>(x, &p, dims, groups, weight)?;
            vec![out(T::wrap(dx)), out(T::wrap(dw)), out(T::wrap(db))]
        }
        // `fused` hands these to cuda::attention before operands are made dense: the flash
        // kernels read strided views.
        FusedOp::Attention { .. } | FusedOp::AttentionBackward { .. } => {
            return Err(Error::Cuda(format!(
                "{} reached the dense launcher",
                op.name()
            )))
        }
    })
}
