//! Prodigy's multi-tensor step on the CPU (`backend::multi::ProdigyHyper`): the reference of
//! the prodigy kernels in cuda/multi_tensor.cu. The sums of the first pass are taken per
//! chunk of `PRODIGY_CHUNK` values as the kernel takes them (each of `PRODIGY_THREADS`
//! strided f64 sums, then those in thread order), and the chunks' sums the same way in
//! item order, so the CPU and CUDA agree bit for bit.

use super::multi::Param;
use crate::backend::multi::{
    ProdigyHyper, ProdigyItem, ProdigyPass1, ProdigyPass2, PRODIGY_CHUNK, PRODIGY_SCALARS,
    PRODIGY_THREADS,
};
use crate::backend::validate;
use crate::{CpuStorage, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "prodigy_multi";

fn internal(msg: &str) -> Error {
    Error::invalid(
        OP,
        format!("internal: {msg} after validation"),
        &crate::Shape::from(()),
    )
}

fn f32s(s: &CpuStorage) -> Result<&[f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => Err(internal("a non-f32 state tensor")),
    }
}

fn f32s_mut(s: &mut CpuStorage) -> Result<&mut [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => Err(internal("a non-f32 state tensor")),
    }
}

/// The sum of `f(j)` for j in 0..n in the kernels' order: `PRODIGY_THREADS` strided sums,
/// then those in thread order.
pub(crate) fn strided_sum(n: usize, f: impl Fn(usize) -> f64) -> f64 {
    let mut total = 0.0;
    for t in 0..PRODIGY_THREADS {
        let mut s = 0.0;
        let mut j = t;
        while j < n {
            s += f(j);
            j += PRODIGY_THREADS;
        }
        total = if t == 0 { s } else { total + s };
    }
    total
}

/// One parameter's slices for the passes.
struct Slices<'a, T> {
    p: &'a mut [T],
    g: &'a [T],
    m: Option<&'a mut [f32]>,
    v: &'a mut [f32],
    s: &'a mut [f32],
    p0: Option<&'a [f32]>,
}

/// Pass 1 over one parameter: the state updated, each chunk's (dot, abs) pushed in order.
fn pass1<T: Param>(c: &ProdigyPass1, x: &mut Slices<'_, T>, out: &mut Vec<(f64, f64)>) {
    let has_m = x.m.is_some();
    let n = x.p.len();
    let mut dots = vec![0f64; n];
    let (p, g, p0) = (&*x.p, x.g, x.p0);
    let m: &mut [f32] = match &mut x.m {
        Some(m) => m,
        None => &mut [],
    };
    let (v, s) = (&mut *x.v, &mut *x.s);
    let apply = |j: usize, mj: &mut f32, vj: &mut f32, sj: &mut f32| -> f64 {
        let p0j = p0.map_or(0.0, |q| q[j]);
        let (_, nm, nv, ns, dot) = c.apply(has_m, p[j].get(), g[j].get(), p0j, *mj, *vj, *sj);
        *mj = nm;
        *vj = nv;
        *sj = ns;
        dot
    };
    if has_m {
        dots.par_iter_mut()
            .zip(m.par_iter_mut())
            .zip(v.par_iter_mut())
            .zip(s.par_iter_mut())
            .enumerate()
            .for_each(|(j, (((d, mj), vj), sj))| *d = apply(j, mj, vj, sj));
    } else {
        dots.par_iter_mut()
            .zip(v.par_iter_mut())
            .zip(s.par_iter_mut())
            .enumerate()
            .for_each(|(j, ((d, vj), sj))| *d = apply(j, &mut 0.0, vj, sj));
    }
    let s = &*x.s;
    let chunks: Vec<(f64, f64)> = (0..n.div_ceil(PRODIGY_CHUNK))
        .into_par_iter()
        .map(|c| {
            let start = c * PRODIGY_CHUNK;
            let len = PRODIGY_CHUNK.min(n - start);
            (
                strided_sum(len, |j| dots[start + j]),
                strided_sum(len, |j| f64::from(s[start + j].abs())),
            )
        })
        .collect();
    out.extend(chunks);
}

/// Pass 2 over one parameter.
fn pass2<T: Param>(c1: &ProdigyPass1, c2: &ProdigyPass2, x: &mut Slices<'_, T>) {
    let (g, v) = (x.g, &*x.v);
    match &x.m {
        Some(m) => x.p.par_iter_mut().enumerate().for_each(|(j, p)| {
            *p = T::put(c2.apply(p.get(), m[j], v[j]));
        }),
        None => x.p.par_iter_mut().enumerate().for_each(|(j, p)| {
            let pv = p.get();
            *p = T::put(c2.apply(pv, c1.grad(pv, g[j].get()), v[j]));
        }),
    }
}

/// Runs `f` on one item's slices, whatever its dtype.
fn with_slices(
    it: &mut ProdigyItem<'_, CpuStorage>,
    f: &mut dyn FnMut(&mut dyn Step) -> Result<()>,
) -> Result<()> {
    let (po, go, n) = (it.p_offset, it.g_offset, it.n);
    let m = match &mut it.m {
        Some(m) => Some(&mut f32s_mut(m)?[..n]),
        None => None,
    };
    let v = &mut f32s_mut(it.v)?[..n];
    let s = &mut f32s_mut(it.s)?[..n];
    let p0 = match it.p0 {
        Some(q) => Some(&f32s(q)?[..n]),
        None => None,
    };
    match (&mut *it.p, it.g) {
        (CpuStorage::F32(p), CpuStorage::F32(g)) => f(&mut Slices {
            p: &mut p[po..po + n],
            g: &g[go..go + n],
            m,
            v,
            s,
            p0,
        }),
        (CpuStorage::BF16(p), CpuStorage::BF16(g)) => f(&mut Slices::<bf16> {
            p: &mut p[po..po + n],
            g: &g[go..go + n],
            m,
            v,
            s,
            p0,
        }),
        (CpuStorage::F16(p), CpuStorage::F16(g)) => f(&mut Slices::<f16> {
            p: &mut p[po..po + n],
            g: &g[go..go + n],
            m,
            v,
            s,
            p0,
        }),
        _ => Err(internal("a parameter of another dtype")),
    }
}

/// The passes over one item's slices, whatever its parameter dtype.
trait Step {
    fn pass1(&mut self, c: &ProdigyPass1, out: &mut Vec<(f64, f64)>);
    fn pass2(&mut self, c1: &ProdigyPass1, c2: &ProdigyPass2);
}

impl<T: Param> Step for Slices<'_, T> {
    fn pass1(&mut self, c: &ProdigyPass1, out: &mut Vec<(f64, f64)>) {
        pass1(c, self, out)
    }
    fn pass2(&mut self, c1: &ProdigyPass1, c2: &ProdigyPass2) {
        pass2(c1, c2, self)
    }
}

/// `BackendStorage::prodigy_multi` on the CPU.
pub(super) fn prodigy(
    h: &ProdigyHyper,
    items: &mut [ProdigyItem<'_, CpuStorage>],
    scalars: &mut CpuStorage,
) -> Result<()> {
    validate::prodigy_multi(items, scalars, |s| (s.dtype(), s.len()))?;
    let CpuStorage::F64(sv) = scalars else {
        return Err(internal("non-f64 scalars"));
    };
    let mut st = [0f64; PRODIGY_SCALARS];
    st.copy_from_slice(&sv[..PRODIGY_SCALARS]);
    let c1 = h.pass1(&st);
    let mut partial = vec![];
    for it in items.iter_mut() {
        with_slices(it, &mut |x| {
            x.pass1(&c1, &mut partial);
            Ok(())
        })?;
    }
    let dot = strided_sum(partial.len(), |i| partial[i].0);
    let abs = strided_sum(partial.len(), |i| partial[i].1);
    h.reduce(&mut st, dot, abs);
    sv[..PRODIGY_SCALARS].copy_from_slice(&st);
    if st[crate::backend::multi::prodigy_slot::APPLY] == 0.0 {
        return Ok(());
    }
    let c2 = h.pass2(&st);
    for it in items.iter_mut() {
        with_slices(it, &mut |x| {
            x.pass2(&c1, &c2);
            Ok(())
        })?;
    }
    Ok(())
}
