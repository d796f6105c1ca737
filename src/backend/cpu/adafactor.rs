//! Adafactor's multi-tensor step on the CPU (`backend::adafactor`): the reference of the
//! adafactor kernels in cuda/multi_tensor.cu, with the kernels' sums in the kernels' order
//! (`adafactor::ordered_sum` per line and per chunk, a parameter's chunks in order), so the
//! CPU and CUDA agree bit for bit. And the moving average of weights (`multi::ema_value`).

use super::multi::Param;
use crate::backend::adafactor::{
    decayed, factored_x, full_x, ordered_sum, AdafactorHyper, AdafactorItem, AdafactorMoment,
    AdafactorStep, AF_CHUNK, AF_LANES, AF_THREADS,
};
use crate::backend::multi::{ema_value, MultiRef};
use crate::backend::validate;
use crate::{CpuStorage, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "adafactor_multi";

fn internal(msg: &str) -> Error {
    Error::invalid(
        OP,
        format!("internal: {msg} after validation"),
        &crate::Shape::from(()),
    )
}

fn f32s_mut(s: &mut CpuStorage) -> Result<&mut [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => Err(internal("a non-f32 state tensor")),
    }
}

/// One parameter's second moments as slices.
enum Moment<'a> {
    Factored {
        row: &'a mut [f32],
        col: &'a mut [f32],
        rows: usize,
        cols: usize,
    },
    Full(&'a mut [f32]),
}

/// One parameter's step over its slices.
fn step_one<T: Param>(
    h: &AdafactorHyper,
    st: &AdafactorStep,
    p: &mut [T],
    g: &[T],
    m: Option<&mut [f32]>,
    v: Moment<'_>,
) {
    let n = p.len();
    let (b2, omb2) = (st.beta2t, st.one_minus_beta2t);
    let u = |j: usize| f64::from(h.grad_u(g[j].get()).1);
    // The update x of every value, and the full moment's new values.
    let mut x = vec![0f32; n];
    match v {
        Moment::Factored {
            row,
            col,
            rows,
            cols,
        } => {
            let mat = rows * cols;
            // Each row (b, i): cols values from b * mat + i * cols, stride 1.
            row.par_iter_mut().enumerate().for_each(|(l, r)| {
                let base = (l / rows) * mat + (l % rows) * cols;
                let mean = (ordered_sum(cols, AF_LANES, |j| u(base + j)) / cols as f64) as f32;
                *r = decayed(b2, omb2, *r, mean);
            });
            // Each column (b, j): rows values from b * mat + j, stride cols.
            col.par_iter_mut().enumerate().for_each(|(l, c)| {
                let base = (l / cols) * mat + l % cols;
                let mean =
                    (ordered_sum(rows, AF_LANES, |i| u(base + i * cols)) / rows as f64) as f32;
                *c = decayed(b2, omb2, *c, mean);
            });
            let (row, col) = (&*row, &*col);
            let rmean: Vec<f32> = (0..n / mat)
                .map(|b| {
                    let s = ordered_sum(rows, AF_LANES, |i| f64::from(row[b * rows + i]));
                    (s / rows as f64) as f32
                })
                .collect();
            x.par_iter_mut().enumerate().for_each(|(j, xj)| {
                let (b, rem) = (j / mat, j % mat);
                let gv = h.grad_u(g[j].get()).0;
                *xj = factored_x(
                    gv,
                    row[b * rows + rem / cols],
                    rmean[b],
                    col[b * cols + rem % cols],
                );
            });
        }
        Moment::Full(v) => {
            x.par_iter_mut()
                .zip(v.par_iter_mut())
                .enumerate()
                .for_each(|(j, (xj, vj))| {
                    let (gv, uv) = h.grad_u(g[j].get());
                    *vj = decayed(b2, omb2, *vj, uv);
                    *xj = full_x(gv, *vj);
                });
        }
    }
    // Sums of p^2 and x^2 per chunk, then the chunks in order.
    let (pr, xr) = (&*p, &x);
    let chunks: Vec<(f64, f64)> = (0..n.div_ceil(AF_CHUNK))
        .into_par_iter()
        .map(|c| {
            let start = c * AF_CHUNK;
            let len = AF_CHUNK.min(n - start);
            (
                ordered_sum(len, AF_THREADS, |j| {
                    let pv = f64::from(pr[start + j].get());
                    pv * pv
                }),
                ordered_sum(len, AF_THREADS, |j| {
                    let xv = f64::from(xr[start + j]);
                    xv * xv
                }),
            )
        })
        .collect();
    let (sum_p2, sum_x2) = chunks
        .iter()
        .fold((0.0, 0.0), |(a, b), &(c, d)| (a + c, b + d));
    let (k, decay) = h.scalars(st, n, sum_p2, sum_x2);
    match m {
        Some(m) => p
            .par_iter_mut()
            .zip(m.par_iter_mut())
            .zip(x.par_iter())
            .for_each(|((pj, mj), &xj)| {
                let (np, nm) = h.apply(k, decay, pj.get(), xj, *mj);
                *pj = T::put(np);
                *mj = nm;
            }),
        None => p.par_iter_mut().zip(x.par_iter()).for_each(|(pj, &xj)| {
            *pj = T::put(h.apply(k, decay, pj.get(), xj, 0.0).0);
        }),
    }
}

/// `BackendStorage::adafactor_multi` on the CPU: the items one after another (each is
/// independent of the others).
pub(super) fn adafactor(
    h: &AdafactorHyper,
    items: &mut [AdafactorItem<'_, CpuStorage>],
) -> Result<()> {
    validate::adafactor_multi(items, h.beta1.is_some(), |s| (s.dtype(), s.len()))?;
    for it in items.iter_mut() {
        let (po, go, n, st) = (it.p_offset, it.g_offset, it.n, it.step);
        if n == 0 {
            continue;
        }
        let m = match &mut it.m {
            Some(m) => Some(&mut f32s_mut(m)?[..n]),
            None => None,
        };
        let v = match &mut it.v {
            AdafactorMoment::Factored {
                row,
                col,
                rows,
                cols,
            } => {
                let b = n / (*rows * *cols);
                Moment::Factored {
                    row: &mut f32s_mut(row)?[..b * *rows],
                    col: &mut f32s_mut(col)?[..b * *cols],
                    rows: *rows,
                    cols: *cols,
                }
            }
            AdafactorMoment::Full(v) => Moment::Full(&mut f32s_mut(v)?[..n]),
        };
        match (&mut *it.p, it.g) {
            (CpuStorage::F32(p), CpuStorage::F32(g)) => {
                step_one(h, &st, &mut p[po..po + n], &g[go..go + n], m, v)
            }
            (CpuStorage::BF16(p), CpuStorage::BF16(g)) => {
                step_one::<bf16>(h, &st, &mut p[po..po + n], &g[go..go + n], m, v)
            }
            (CpuStorage::F16(p), CpuStorage::F16(g)) => {
                step_one::<f16>(h, &st, &mut p[po..po + n], &g[go..go + n], m, v)
            }
            _ => return Err(internal("a parameter of another dtype")),
        }
    }
    Ok(())
}

fn ema_into<T: Param>(k: f32, s: &mut [f32], p: &[T]) {
    s.par_iter_mut()
        .zip(p.par_iter())
        .for_each(|(s, p)| *s = ema_value(k, *s, p.get()));
}

/// `BackendStorage::ema_multi` on the CPU.
pub(super) fn ema(
    k: f32,
    shadow: &mut CpuStorage,
    items: &[MultiRef<'_, CpuStorage>],
) -> Result<()> {
    validate::ema_multi(shadow, items, |s| (s.dtype(), s.len()))?;
    let CpuStorage::F32(s) = shadow else {
        return Err(Error::invalid(
            "ema_multi",
            "internal: a non-f32 shadow after validation",
            &crate::Shape::from(()),
        ));
    };
    let mut start = 0;
    for it in items {
        let (o, n) = (it.offset, it.n);
        let dst = &mut s[start..start + n];
        match it.s {
            CpuStorage::F32(p) => ema_into(k, dst, &p[o..o + n]),
            CpuStorage::BF16(p) => ema_into(k, dst, &p[o..o + n]),
            CpuStorage::F16(p) => ema_into(k, dst, &p[o..o + n]),
            _ => {
                return Err(Error::invalid(
                    "ema_multi",
                    "internal: a weight of another dtype after validation",
                    &crate::Shape::from(n),
                ))
            }
        }
        start += n;
    }
    Ok(())
}
