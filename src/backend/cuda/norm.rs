//! Fused LayerNorm / RMSNorm launchers (kernels in cuda/norm.cu): one warp per row.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::NormKind;
use crate::{DType, Error, Layout, Result};

fn dense(s: &CudaStorage, l: &Layout) -> Result<Option<CudaStorage>> {
    s.check("norm", l)?;
    if l.is_contiguous() && l.offset() == 0 {
        Ok(None)
    } else {
        Ok(Some(s.contiguous(l)?))
    }
}

fn rows_cols(op: &'static str, l: &Layout) -> Result<(usize, usize)> {
    match l.dims().last() {
        Some(&c) if c > 0 => Ok((l.elem_count() / c, c)),
        _ => Err(Error::invalid(op, "needs a non-empty last dim", l.shape())),
    }
}

fn fwd<T: Elem, S: Elem>(
    s: &CudaStorage,
    l: &Layout,
    kind: NormKind,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let (rows, cols) = rows_cols("norm", l)?;
    let d = dense(s, l)?;
    let x = d.as_ref().unwrap_or(s).typed::<T>("norm")?;
    let dev = &s.dev;
    let (mut y, mut mean, mut rstd) = (
        dev.alloc::<T>(rows * cols)?,
        dev.alloc::<S>(rows)?,
        dev.alloc::<S>(rows)?,
    );
    let rms = i32::from(kind == NormKind::Rms);
    if rows > 0 {
        launch!(
            dev,
            "norm",
            format!("norm_fwd_{}", T::SFX),
            grid_for(rows.div_ceil(8) * 256, dev.sm_count()),
            &x.slice,
            &mut y.slice,
            &mut mean.slice,
            &mut rstd.slice,
            &rows,
            &cols,
            &eps,
            &rms
        )?;
    }
    Ok((
        s.wrap(T::wrap(y)),
        s.wrap(S::wrap(mean)),
        s.wrap(S::wrap(rstd)),
    ))
}

pub(crate) fn norm_last_dim(
    s: &CudaStorage,
    l: &Layout,
    kind: NormKind,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    match s.buf.dtype() {
        DType::F32 => fwd::<f32, f32>(s, l, kind, eps),
        DType::F64 => fwd::<f64, f64>(s, l, kind, eps),
        DType::BF16 => fwd::<half::bf16, f32>(s, l, kind, eps),
        DType::F16 => fwd::<half::f16, f32>(s, l, kind, eps),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm",
            dtype: DType::U32,
        }),
    }
}

#[allow(clippy::too_many_arguments)]
fn bwd<T: Elem, S: Elem>(
    s: &CudaStorage,
    l: &Layout,
    dy: &CudaStorage,
    dyl: &Layout,
    mean: &CudaStorage,
    rstd: &CudaStorage,
    kind: NormKind,
) -> Result<CudaStorage> {
    const OP: &str = "norm_backward";
    crate::backend::validate::same_shape(OP, l, dyl)?;
    let (rows, cols) = rows_cols(OP, l)?;
    let (dx_, dg_) = (dense(s, l)?, dense(dy, dyl)?);
    let x = dx_.as_ref().unwrap_or(s).typed::<T>(OP)?;
    let g = dg_.as_ref().unwrap_or(dy).typed::<T>(OP)?;
    let (m, r) = (mean.typed::<S>(OP)?, rstd.typed::<S>(OP)?);
    if m.len() < rows || r.len() < rows {
        return Err(Error::invalid(
            OP,
            format!("statistics for {} rows, the input has {rows}", m.len()),
            l.shape(),
        ));
    }
    let dev = &s.dev;
    let mut out = dev.alloc::<T>(rows * cols)?;
    let rms = i32::from(kind == NormKind::Rms);
    if rows > 0 {
        launch!(
            dev,
            "norm",
            format!("norm_bwd_{}", T::SFX),
            grid_for(rows.div_ceil(8) * 256, dev.sm_count()),
            &x.slice,
            &g.slice,
            &m.slice,
            &r.slice,
            &mut out.slice,
            &rows,
            &cols,
            &rms
        )?;
    }
    Ok(s.wrap(T::wrap(out)))
}

pub(crate) fn norm_last_dim_backward(
    s: &CudaStorage,
    l: &Layout,
    dy: &CudaStorage,
    dyl: &Layout,
    mean: &CudaStorage,
    rstd: &CudaStorage,
    kind: NormKind,
) -> Result<CudaStorage> {
    match s.buf.dtype() {
        DType::F32 => bwd::<f32, f32>(s, l, dy, dyl, mean, rstd, kind),
        DType::F64 => bwd::<f64, f64>(s, l, dy, dyl, mean, rstd, kind),
        DType::BF16 => bwd::<half::bf16, f32>(s, l, dy, dyl, mean, rstd, kind),
        DType::F16 => bwd::<half::f16, f32>(s, l, dy, dyl, mean, rstd, kind),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm_backward",
            dtype: DType::U32,
        }),
    }
}
