//! Reductions over any set of dims. Sums accumulate in f64 whatever the dtype (this backend is
//! the reference); max/min propagate NaN; argmax/argmin return the first extreme index as u32.

use super::strided;
use crate::backend::ReduceOp;
use crate::shape::for_each_offset;
use crate::{CpuStorage, DType, Error, Layout, Result, WithDType};
use rayon::prelude::*;

#[derive(Clone, Copy)]
enum Acc {
    Sum(f64),
    /// Extreme value so far and its index along the reduced range.
    Ext(f64, usize),
}

fn fold<T: WithDType>(
    op: ReduceOp,
    v: &[T],
    red: &Layout,
    base: usize,
    start: usize,
    end: usize,
) -> Acc {
    let mut acc = match op {
        ReduceOp::Sum => Acc::Sum(0.0),
        _ => Acc::Ext(f64::NAN, usize::MAX),
    };
    let better = |x: f64, best: f64| match op {
        ReduceOp::Max | ReduceOp::ArgMax => x > best,
        _ => x < best,
    };
    let mut f = |i: usize, o: usize| {
        let x = v[base + o].to_f64();
        acc = match acc {
            Acc::Sum(s) => Acc::Sum(s + x),
            Acc::Ext(best, bi) => {
                // The first element wins ties; a NaN, once seen, stays.
                if bi == usize::MAX || (!best.is_nan() && (x.is_nan() || better(x, best))) {
                    Acc::Ext(x, i)
                } else {
                    Acc::Ext(best, bi)
                }
            }
        }
    };
    crate::shape::for_each_offset_range(red, start, end, &mut f);
    acc
}

fn merge(op: ReduceOp, a: Acc, b: Acc) -> Acc {
    match (a, b) {
        (Acc::Sum(x), Acc::Sum(y)) => Acc::Sum(x + y),
        (Acc::Ext(x, i), Acc::Ext(y, j)) => {
            let take_b = i == usize::MAX
                || (j != usize::MAX
                    && !x.is_nan()
                    && (y.is_nan()
                        || match op {
                            ReduceOp::Max | ReduceOp::ArgMax => y > x,
                            _ => y < x,
                        }));
            if take_b {
                Acc::Ext(y, j)
            } else {
                Acc::Ext(x, i)
            }
        }
        (a, _) => a,
    }
}

fn reduce_typed<T: WithDType>(v: &[T], l: &Layout, op: ReduceOp, dims: &[usize]) -> Vec<Acc> {
    let (kept, red) = l.split_reduced(dims);
    let n_red = red.elem_count();
    let mut bases = Vec::with_capacity(kept.elem_count());
    for_each_offset(&kept, |_, o| bases.push(o));
    let threads = rayon::current_num_threads();
    if bases.len() >= 4 * threads || n_red < (1 << 16) {
        // Many outputs: one task per output.
        bases
            .par_iter()
            .map(|&b| fold(op, v, &red, b, 0, n_red))
            .collect()
    } else {
        // Few outputs over long ranges: split each range and merge the partials in order.
        const CHUNK: usize = 1 << 16;
        bases
            .iter()
            .map(|&b| {
                let parts: Vec<Acc> = (0..n_red.div_ceil(CHUNK))
                    .into_par_iter()
                    .map(|c| fold(op, v, &red, b, c * CHUNK, ((c + 1) * CHUNK).min(n_red)))
                    .collect();
                parts
                    .into_iter()
                    .reduce(|a, b| merge(op, a, b))
                    .unwrap_or(Acc::Sum(0.0))
            })
            .collect()
    }
}

pub fn reduce(s: &CpuStorage, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CpuStorage> {
    crate::backend::validate::reduction(op, l, dims, s.dtype())?;
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    let accs = crate::dispatch_host!(s, v => reduce_typed(v, l, op, dims));
    if arg {
        return Ok(CpuStorage::U32(
            accs.iter()
                .map(|a| match a {
                    Acc::Ext(_, i) => *i as u32,
                    Acc::Sum(_) => 0,
                })
                .collect(),
        ));
    }
    let vals: Vec<f64> = accs
        .iter()
        .map(|a| match a {
            Acc::Sum(x) | Acc::Ext(x, _) => *x,
        })
        .collect();
    let out_l = Layout::contiguous(vals.len());
    Ok(match s.dtype() {
        DType::F32 => CpuStorage::F32(strided::map1(&vals, &out_l, |x| x as f32)),
        DType::F64 => CpuStorage::F64(vals),
        DType::BF16 => CpuStorage::BF16(strided::map1(&vals, &out_l, crate::bf16_nearest)),
        DType::F16 => CpuStorage::F16(strided::map1(&vals, &out_l, crate::f16_nearest)),
        DType::U32 => {
            return Err(Error::UnsupportedDType {
                op: op.name(),
                dtype: DType::U32,
            })
        }
    })
}
