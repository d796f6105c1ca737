//! Fused LayerNorm / RMSNorm launchers (kernels in cuda/norm.cu): rows held in registers by
//! a group of lanes when they fit (one read, one write), else one warp per row; the optional
//! per-column weight and bias applied inside the kernel.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::NormKind;
use crate::{DType, Error, Layout, Result};

fn rows_cols(op: &'static str, l: &Layout) -> Result<(usize, usize)> {
    match l.dims().last() {
        Some(&c) if c > 0 => Ok((l.elem_count() / c, c)),
        _ => Err(Error::invalid(op, "needs a non-empty last dim", l.shape())),
    }
}

/// The raw address of an optional per-column parameter (null when absent), after checking
/// its dtype and length.
fn param_ptr<T: Elem>(
    p: Option<&CudaStorage>,
    cols: usize,
    op: &'static str,
    l: &Layout,
) -> Result<u64> {
    match p {
        None => Ok(0),
        Some(p) => {
            let b = p.typed::<T>(op)?;
            if b.len() != cols {
                return Err(Error::invalid(
                    op,
                    format!("a weight or bias of {} values for rows of {cols}", b.len()),
                    l.shape(),
                ));
            }
            Ok(p.buf.raw_ptr(p.dev.stream()))
        }
    }
}

type Triple = (CudaStorage, CudaStorage, CudaStorage);

/// (packs per lane, lanes per row) of the register-resident kernel for rows of `cols`, when
/// it pays: rows of whole 8-element packs, f32 and half types (the instances in cuda/norm.cu).
fn reg_shape(dtype: DType, cols: usize) -> Option<(usize, usize)> {
    if dtype == DType::F64 || cols % 8 != 0 {
        return None;
    }
    // Measured on an H100 (benches/layers.rs): for rows of 3072 the warp-per-row kernel,
    // which re-reads the row from L1, beats holding 12 packs a lane (register pressure), so
    // only rows of up to 256 columns (a pack a lane) use registers.
    let packs = cols / 8;
    (packs <= 32).then(|| (1, packs.next_power_of_two().max(4)))
}

/// The kernel name and launch shape for `rows` rows of `cols`: register-resident when it
/// fits, otherwise a warp per row streaming the row from cache.
fn pick(
    base: &str,
    sfx: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
    sms: usize,
) -> (String, cudarc::driver::LaunchConfig) {
    match reg_shape(dtype, cols) {
        Some((packs, lanes)) => (
            format!("{base}_reg_{packs}_{lanes}_{sfx}"),
            grid_for(rows.div_ceil(256 / lanes) * 256, sms),
        ),
        None => (
            format!("{base}_{sfx}"),
            grid_for(rows.div_ceil(8) * 256, sms),
        ),
    }
}

fn fwd<T: Elem, S: Elem>(
    s: &CudaStorage,
    l: &Layout,
    kind: NormKind,
    eps: f64,
    weight: Option<&CudaStorage>,
    bias: Option<&CudaStorage>,
) -> Result<Triple> {
    let (rows, cols) = rows_cols("norm", l)?;
    let (w, b) = (
        param_ptr::<T>(weight, cols, "norm", l)?,
        param_ptr::<T>(bias, cols, "norm", l)?,
    );
    let d = s.dense("norm", l)?;
    let x = d.as_ref().unwrap_or(s).typed::<T>("norm")?;
    let dev = &s.dev;
    let (mut y, mut mean, mut rstd) = (
        dev.alloc::<T>(rows * cols)?,
        dev.alloc::<S>(rows)?,
        dev.alloc::<S>(rows)?,
    );
    let rms = i32::from(kind == NormKind::Rms);
    if rows > 0 {
        let (kernel, cfg) = pick("norm_fwd", T::SFX, T::DTYPE, rows, cols, dev.sm_count());
        launch!(
            dev,
            "norm",
            kernel,
            cfg,
            &x.slice,
            &w,
            &b,
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
    weight: Option<&CudaStorage>,
    bias: Option<&CudaStorage>,
) -> Result<Triple> {
    match s.buf.dtype() {
        DType::F32 => fwd::<f32, f32>(s, l, kind, eps, weight, bias),
        DType::F64 => fwd::<f64, f64>(s, l, kind, eps, weight, bias),
        DType::BF16 => fwd::<half::bf16, f32>(s, l, kind, eps, weight, bias),
        DType::F16 => fwd::<half::f16, f32>(s, l, kind, eps, weight, bias),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm",
            dtype: DType::U32,
        }),
    }
}

/// Operands of the backward: x, dy, mean, rstd and the optional weight.
pub(crate) struct NormGrad<'a> {
    pub x: &'a CudaStorage,
    pub l: &'a Layout,
    pub dy: &'a CudaStorage,
    pub dyl: &'a Layout,
    pub mean: &'a CudaStorage,
    pub rstd: &'a CudaStorage,
    pub weight: Option<&'a CudaStorage>,
}

fn bwd<T: Elem, S: Elem>(o: &NormGrad, kind: NormKind) -> Result<CudaStorage> {
    const OP: &str = "norm_backward";
    crate::backend::validate::same_shape(OP, o.l, o.dyl)?;
    let (rows, cols) = rows_cols(OP, o.l)?;
    let w = param_ptr::<T>(o.weight, cols, OP, o.l)?;
    let (dx_, dg_) = (o.x.dense(OP, o.l)?, o.dy.dense(OP, o.dyl)?);
    let x = dx_.as_ref().unwrap_or(o.x).typed::<T>(OP)?;
    let g = dg_.as_ref().unwrap_or(o.dy).typed::<T>(OP)?;
    let (m, r) = (o.mean.typed::<S>(OP)?, o.rstd.typed::<S>(OP)?);
    if m.len() < rows || r.len() < rows {
        return Err(Error::invalid(
            OP,
            format!("statistics for {} rows, the input has {rows}", m.len()),
            o.l.shape(),
        ));
    }
    let dev = &o.x.dev;
    let mut out = dev.alloc::<T>(rows * cols)?;
    let rms = i32::from(kind == NormKind::Rms);
    if rows > 0 {
        let (kernel, cfg) = pick("norm_bwd", T::SFX, T::DTYPE, rows, cols, dev.sm_count());
        launch!(
            dev,
            "norm",
            kernel,
            cfg,
            &x.slice,
            &g.slice,
            &w,
            &m.slice,
            &r.slice,
            &mut out.slice,
            &rows,
            &cols,
            &rms
        )?;
    }
    Ok(o.x.wrap(T::wrap(out)))
}

pub(crate) fn norm_last_dim_backward(o: &NormGrad, kind: NormKind) -> Result<CudaStorage> {
    match o.x.buf.dtype() {
        DType::F32 => bwd::<f32, f32>(o, kind),
        DType::F64 => bwd::<f64, f64>(o, kind),
        DType::BF16 => bwd::<half::bf16, f32>(o, kind),
        DType::F16 => bwd::<half::f16, f32>(o, kind),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm_backward",
            dtype: DType::U32,
        }),
    }
}
