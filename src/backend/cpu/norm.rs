//! Fused last-dim normalization (LayerNorm / RMSNorm) with an optional per-column weight and
//! bias, and its backward, on the CPU: one row per task. Statistics accumulate in f64; y and
//! dx are computed in the accumulation type, as the CUDA kernels do.

use super::{strided, Elem, Real};
use crate::backend::NormKind;
use crate::{Error, Layout, Result};
use rayon::prelude::*;

fn cols_of(op: &'static str, l: &Layout) -> Result<usize> {
    match l.dims().last() {
        Some(&c) if c > 0 => Ok(c),
        _ => Err(Error::invalid(op, "needs a non-empty last dim", l.shape())),
    }
}

fn check_params(
    op: &'static str,
    cols: usize,
    params: [Option<&[f64]>; 2],
    l: &Layout,
) -> Result<()> {
    for p in params.into_iter().flatten() {
        if p.len() != cols {
            return Err(Error::invalid(
                op,
                format!("a weight or bias of {} values for rows of {cols}", p.len()),
                l.shape(),
            ));
        }
    }
    Ok(())
}

/// (y, mean, rstd) with statistics as f64 (the caller stores them in the stats dtype).
pub(super) fn forward<T: Elem>(
    v: &[T],
    l: &Layout,
    kind: NormKind,
    eps: f64,
    weight: Option<&[f64]>,
    bias: Option<&[f64]>,
) -> Result<(Vec<T>, Vec<f64>, Vec<f64>)> {
    let cols = cols_of("norm", l)?;
    check_params("norm", cols, [weight, bias], l)?;
    let x = strided::contiguous(v, l);
    let rows = x.len() / cols;
    let mut y = vec![T::default(); x.len()];
    let mut stats = vec![(0.0, 0.0); rows];
    let (one, zero) = (T::Acc::from_f64(1.0), T::Acc::from_f64(0.0));
    y.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .zip(stats.par_iter_mut())
        .for_each(|((y, x), st)| {
            let n = cols as f64;
            let mean = match kind {
                NormKind::Layer => x.iter().map(|a| a.to_acc().to_f64()).sum::<f64>() / n,
                NormKind::Rms => 0.0,
            };
            let var = x
                .iter()
                .map(|a| (a.to_acc().to_f64() - mean).powi(2))
                .sum::<f64>()
                / n;
            let rstd = 1.0 / (var + eps).sqrt();
            let (m, r) = (T::Acc::from_f64(mean), T::Acc::from_f64(rstd));
            for (c, (y, a)) in y.iter_mut().zip(x).enumerate() {
                let w = weight.map_or(one, |w| T::Acc::from_f64(w[c]));
                let b = bias.map_or(zero, |b| T::Acc::from_f64(b[c]));
                *y = T::from_acc((a.to_acc() - m) * r * w + b);
            }
            *st = (mean, rstd);
        });
    let (mean, rstd) = stats.into_iter().unzip();
    Ok((y, mean, rstd))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward<T: Elem>(
    v: &[T],
    l: &Layout,
    dy: &[T],
    dyl: &Layout,
    mean: &[f64],
    rstd: &[f64],
    kind: NormKind,
    weight: Option<&[f64]>,
) -> Result<Vec<T>> {
    let cols = cols_of("norm_backward", l)?;
    check_params("norm_backward", cols, [weight, None], l)?;
    let (x, g) = (strided::contiguous(v, l), strided::contiguous(dy, dyl));
    let rows = x.len() / cols;
    if mean.len() != rows || rstd.len() != rows || g.len() != x.len() {
        return Err(Error::invalid(
            "norm_backward",
            format!(
                "statistics for {} rows, dy of {} elements",
                mean.len(),
                g.len()
            ),
            l.shape(),
        ));
    }
    let one = T::Acc::from_f64(1.0);
    // dy * w in the accumulation type, as the kernels compute it.
    let gw = |c: usize, d: &T| d.to_acc() * weight.map_or(one, |w| T::Acc::from_f64(w[c]));
    let mut dx = vec![T::default(); x.len()];
    dx.par_chunks_mut(cols)
        .zip(x.par_chunks(cols).zip(g.par_chunks(cols)))
        .enumerate()
        .for_each(|(r, (dx, (x, g)))| {
            let n = cols as f64;
            let (m, s) = (mean[r], rstd[r]);
            let xhat = |a: &T| (a.to_acc().to_f64() - m) * s;
            let mean_g = match kind {
                NormKind::Layer => {
                    g.iter()
                        .enumerate()
                        .map(|(c, d)| gw(c, d).to_f64())
                        .sum::<f64>()
                        / n
                }
                NormKind::Rms => 0.0,
            };
            let mean_g_xhat = x
                .iter()
                .zip(g)
                .enumerate()
                .map(|(c, (a, d))| gw(c, d).to_f64() * xhat(a))
                .sum::<f64>()
                / n;
            let (a, b, sa) = (
                T::Acc::from_f64(mean_g),
                T::Acc::from_f64(mean_g_xhat),
                T::Acc::from_f64(s),
            );
            let mm = T::Acc::from_f64(m);
            for (c, ((o, xv), d)) in dx.iter_mut().zip(x).zip(g).enumerate() {
                let xh = (xv.to_acc() - mm) * sa;
                *o = T::from_acc(sa * (gw(c, d) - a - xh * b));
            }
        });
    Ok(dx)
}
