//! The fused ops of `FusedOp` on the CPU: operands read as f64 views, results computed in f64
//! and rounded once to their dtype. This is the reference the CUDA kernels are tested against;
//! the composite twins in `Tensor` are the reference of both.

use super::attention::Attn;
use super::{from_f64_vec, strided};
use crate::backend::{stats_dtype, validate, FusedOp, NormKind};
use crate::{CpuStorage, Layout, Result};
use rayon::prelude::*;

/// The attention pass for dims [B, H, Lq, Lk, D] (from `validate::fused`).
fn attn<'a>(dims: &[usize], causal: bool, scale: f64, keep: Option<&'a [f64]>) -> Attn<'a> {
    Attn {
        h: dims[1],
        lq: dims[2],
        lk: dims[3],
        d: dims[4],
        causal,
        scale,
        keep,
    }
}

/// The view `l` of `s` as contiguous f64 values.
fn view(s: &CpuStorage, l: &Layout) -> Vec<f64> {
    fn conv<T: crate::WithDType>(v: &[T], l: &Layout) -> Vec<f64> {
        strided::contiguous(v, l)
            .iter()
            .map(|x| x.to_f64())
            .collect()
    }
    match s {
        CpuStorage::F32(v) => conv(v, l),
        CpuStorage::F64(v) => conv(v, l),
        CpuStorage::BF16(v) => conv(v, l),
        CpuStorage::F16(v) => conv(v, l),
        CpuStorage::U32(v) => conv(v, l),
    }
}

/// Runs kernel `k` (see `backend::Kernel`): the views checked, then its check, then its
/// reference implementation.
pub(crate) fn run_kernel(
    k: &dyn crate::backend::Kernel,
    args: &[(&CpuStorage, &Layout)],
) -> Result<Vec<CpuStorage>> {
    for (s, l) in args {
        super::check_view(k.name(), s, l)?;
    }
    let metas: Vec<_> = args.iter().map(|(s, l)| (s.dtype(), *l)).collect();
    let dims = k.check(&metas)?;
    k.cpu(&dims, args)
}

/// The view `l` of `s` as contiguous f64 values (what a kernel's reference computes from).
pub(crate) fn f64_view(s: &CpuStorage, l: &Layout) -> Vec<f64> {
    view(s, l)
}

pub(super) fn fused(op: FusedOp, args: &[(&CpuStorage, &Layout)]) -> Result<Vec<CpuStorage>> {
    for (s, l) in args {
        super::check_view(op.name(), s, l)?;
    }
    let metas: Vec<_> = args.iter().map(|(s, l)| (s.dtype(), *l)).collect();
    let dims = validate::fused(op, &metas)?;
    if let FusedOp::DequantFp8 { dtype } = op {
        return dequant_fp8(dtype, &dims, args);
    }
    let dt = args[0].0.dtype();
    let st = stats_dtype(dt);
    let v: Vec<Vec<f64>> = args.iter().map(|(s, l)| view(s, l)).collect();
    Ok(match op {
        FusedOp::SoftmaxBackward => {
            let (y, dy) = (&v[0], &v[1]);
            let cols = dims[1];
            let mut dx = vec![0.0; y.len()];
            dx.par_chunks_mut(cols)
                .zip(y.par_chunks(cols).zip(dy.par_chunks(cols)))
                .for_each(|(dx, (y, g))| {
                    let dot: f64 = y.iter().zip(g).map(|(a, b)| a * b).sum();
                    for ((d, y), g) in dx.iter_mut().zip(y).zip(g) {
                        *d = y * (g - dot);
                    }
                });
            vec![from_f64_vec(dx, dt)]
        }
        FusedOp::NormParamGrads(kind) => {
            let (x, dy, mean, rstd) = (&v[0], &v[1], &v[2], &v[3]);
            let (rows, cols) = (dims[0], dims[1]);
            let mut dw = vec![0.0; cols];
            let mut db = vec![0.0; cols];
            for r in 0..rows {
                let m = if kind == NormKind::Layer {
                    mean[r]
                } else {
                    0.0
                };
                for c in 0..cols {
                    let i = r * cols + c;
                    dw[c] += dy[i] * (x[i] - m) * rstd[r];
                    db[c] += dy[i];
                }
            }
            vec![from_f64_vec(dw, st), from_f64_vec(db, st)]
        }
        FusedOp::NormBackward { kind, weight } => {
            let (x, dy, mean, rstd) = (&v[0], &v[1], &v[2], &v[3]);
            let cols = dims[1];
            let w = weight.then(|| &v[4]);
            let layer = kind == NormKind::Layer;
            let mut dx = vec![0.0; x.len()];
            let (mut dw, mut db) = (vec![0.0; cols], vec![0.0; cols]);
            for (r, dxr) in dx.chunks_mut(cols).enumerate() {
                let (m, s) = (if layer { mean[r] } else { 0.0 }, rstd[r]);
                let row = r * cols..(r + 1) * cols;
                let (xr, gr) = (&x[row.clone()], &dy[row]);
                let gw = |c: usize| gr[c] * w.map_or(1.0, |w| w[c]);
                // a = mean(g), b = mean(g xhat) with g = dy w (a = 0 for Rms).
                let (mut a, mut b) = (0.0, 0.0);
                for c in 0..cols {
                    let xh = (xr[c] - m) * s;
                    a += gw(c);
                    b += gw(c) * xh;
                    dw[c] += gr[c] * xh;
                    db[c] += gr[c];
                }
                let (a, b) = (if layer { a / cols as f64 } else { 0.0 }, b / cols as f64);
                for (c, d) in dxr.iter_mut().enumerate() {
                    *d = s * (gw(c) - a - (xr[c] - m) * s * b);
                }
            }
            vec![
                from_f64_vec(dx, dt),
                from_f64_vec(dw, dt),
                from_f64_vec(db, dt),
            ]
        }
        FusedOp::Attention {
            causal,
            scale,
            mask,
        } => {
            let a = attn(&dims, causal, scale, mask.then(|| &v[3][..]));
            let (o, lse) = a.forward(dims[0] * dims[1], &v[0], &v[1], &v[2]);
            vec![from_f64_vec(o, dt), from_f64_vec(lse, st)]
        }
        FusedOp::AttentionBackward {
            causal,
            scale,
            mask,
        } => {
            let a = attn(&dims, causal, scale, mask.then(|| &v[6][..]));
            let (dq, dk, dv) =
                a.backward(dims[0] * dims[1], &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]);
            vec![
                from_f64_vec(dq, dt),
                from_f64_vec(dk, dt),
                from_f64_vec(dv, dt),
            ]
        }
        FusedOp::DequantFp8 { .. } => {
            return Err(crate::Error::invalid(
                op.name(),
                "internal: reached the f64 path",
                &crate::Shape::from(()),
            ))
        }
    })
}

/// `FusedOp::DequantFp8`: `decode(code) * scale` in f32 per value, rounded once to `dtype`
/// (cuda/fp8.cu computes the same f32 product, so both backends give the same bits).
fn dequant_fp8(
    dtype: crate::DType,
    dims: &[usize],
    args: &[(&CpuStorage, &Layout)],
) -> Result<Vec<CpuStorage>> {
    use crate::backend::fp8;
    let (rows, cols) = (dims[0], dims[1]);
    let CpuStorage::U32(codes) = args[0].0 else {
        return Err(crate::Error::UnsupportedDType {
            op: "dequant_fp8",
            dtype: args[0].0.dtype(),
        });
    };
    let codes = strided::contiguous(codes, args[0].1);
    let scale: Vec<f64> = view(args[1].0, args[1].1);
    let table: Vec<f32> = (0..=255u8).map(fp8::decode).collect();
    let words = cols / fp8::CODES_PER_WORD;
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            let s = scale[r] as f32;
            for (c, v) in row.iter_mut().enumerate() {
                let word = codes[r * words + c / fp8::CODES_PER_WORD];
                let code = fp8::unpack(word, c % fp8::CODES_PER_WORD);
                *v = table[usize::from(code)] * s;
            }
        });
    // Rounded once from the f32 product (as the kernel's __float2bfloat16_rn does); not
    // through f64, whose conversion to the half types in `half` decides ties from the high
    // 32 bits only.
    Ok(vec![match dtype {
        crate::DType::F32 => CpuStorage::F32(out),
        crate::DType::F64 => CpuStorage::F64(out.into_iter().map(f64::from).collect()),
        crate::DType::BF16 => {
            CpuStorage::BF16(out.into_par_iter().map(half::bf16::from_f32).collect())
        }
        crate::DType::F16 => {
            CpuStorage::F16(out.into_par_iter().map(half::f16::from_f32).collect())
        }
        crate::DType::U32 => {
            return Err(crate::Error::UnsupportedDType {
                op: "dequant_fp8",
                dtype,
            })
        }
    }])
}
