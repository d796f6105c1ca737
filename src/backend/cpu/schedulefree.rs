//! The schedule-free multi-tensor calls on the CPU (`backend::multi_sf`): the reference of
//! the `sf_*` and `prodigy_sf_*` kernels in cuda/multi_tensor.cu. Prodigy's sums are taken
//! per chunk of `PRODIGY_CHUNK` values as the kernel takes them (`strided_sum`), each
//! parameter's chunks added in order, and the parameters' terms summed in the kernel's
//! thread order, so the CPU and CUDA agree bit for bit.

use super::multi::Param;
use super::prodigy::strided_sum;
use crate::backend::multi::PRODIGY_CHUNK;
use crate::backend::multi_sf::{
    lerp, ProdigySfPass, SfItem, SfOp, PRODIGY_SF_SCALARS, PRODIGY_SF_SLICE,
};
use crate::backend::validate;
use crate::{CpuStorage, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "schedulefree_multi";

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

/// One parameter's slices.
struct Slices<'a, T> {
    p: &'a mut [T],
    g: &'a [T],
    v: &'a mut [f32],
    z: &'a mut [f32],
    s: &'a mut [bf16],
    p0: Option<&'a [bf16]>,
}

impl<T: Param> Slices<'_, T> {
    fn lerp(&mut self, w: f32) {
        let z = &*self.z;
        self.p
            .par_iter_mut()
            .zip(z.par_iter())
            .for_each(|(p, &z)| *p = T::put(lerp(p.get(), z, w)));
    }

    fn adamw(&mut self, c: &crate::backend::multi_sf::SfAdamScalars) {
        let g = self.g;
        self.p
            .par_iter_mut()
            .zip(self.v.par_iter_mut())
            .zip(self.z.par_iter_mut())
            .enumerate()
            .for_each(|(j, ((p, v), z))| {
                let (np, nv, nz) = c.apply(p.get(), g[j].get(), *v, *z);
                *p = T::put(np);
                *v = nv;
                *z = nz;
            });
    }

    /// Prodigy's statistics (before the update, which moves z): each chunk's (dot, abs).
    fn prodigy_stats(&mut self, c: &ProdigySfPass) -> Vec<(f64, f64)> {
        let (g, z, p0) = (self.g, &*self.z, self.p0);
        let dots: Vec<f64> = self
            .s
            .par_iter_mut()
            .enumerate()
            .map(|(q, s)| {
                let j = q * PRODIGY_SF_SLICE;
                let p0v = p0.map_or(0.0, |p0| p0[q].to_f32());
                let (ns, dot) = c.stats(g[j].get(), z[j], p0v, s.to_f32());
                *s = ns;
                dot
            })
            .collect();
        let s = &*self.s;
        let n = self.p.len();
        let at = |j: usize, f: &dyn Fn(usize) -> f64| match j % PRODIGY_SF_SLICE {
            0 => f(j / PRODIGY_SF_SLICE),
            _ => 0.0,
        };
        (0..n.div_ceil(PRODIGY_CHUNK))
            .into_par_iter()
            .map(|k| {
                let start = k * PRODIGY_CHUNK;
                let len = PRODIGY_CHUNK.min(n - start);
                (
                    strided_sum(len, |j| at(start + j, &|q| dots[q])),
                    strided_sum(len, |j| at(start + j, &|q| f64::from(s[q].to_f32().abs()))),
                )
            })
            .collect()
    }

    fn prodigy_update(&mut self, c: &ProdigySfPass) {
        let g = self.g;
        self.p
            .par_iter_mut()
            .zip(self.v.par_iter_mut())
            .zip(self.z.par_iter_mut())
            .enumerate()
            .for_each(|(j, ((p, v), z))| {
                let (np, nv, nz) = c.apply(p.get(), g[j].get(), *v, *z);
                *p = T::put(np);
                *v = nv;
                *z = nz;
            });
    }
}

/// The calls over one item's slices, whatever its parameter dtype.
trait Step {
    fn run(&mut self, op: &SfOp, pass: Option<&ProdigySfPass>) -> Vec<(f64, f64)>;
}

impl<T: Param> Step for Slices<'_, T> {
    fn run(&mut self, op: &SfOp, pass: Option<&ProdigySfPass>) -> Vec<(f64, f64)> {
        match (op, pass) {
            (SfOp::Lerp(w), _) => self.lerp(*w),
            (SfOp::AdamW(c), _) => self.adamw(c),
            (SfOp::Prodigy(_), Some(c)) => {
                let sums = self.prodigy_stats(c);
                self.prodigy_update(c);
                return sums;
            }
            (SfOp::Prodigy(_), None) => {}
        }
        vec![]
    }
}

/// Runs `f` on one item's slices, whatever its dtype.
fn with_slices(
    it: &mut SfItem<'_, CpuStorage>,
    f: &mut dyn FnMut(&mut dyn Step) -> Result<()>,
) -> Result<()> {
    let (po, go, n) = (it.p_offset, it.g_offset, it.n);
    let ns = crate::backend::multi_sf::prodigy_sf_sliced(n);
    let z = &mut f32s_mut(it.z)?[..n];
    let v: &mut [f32] = match &mut it.v {
        Some(v) => &mut f32s_mut(v)?[..n],
        None => &mut [],
    };
    let s: &mut [bf16] = match &mut it.s {
        Some(s) => match &mut **s {
            CpuStorage::BF16(s) => &mut s[..ns],
            _ => return Err(internal("a non-bf16 s")),
        },
        None => &mut [],
    };
    let p0 = match it.p0 {
        Some(CpuStorage::BF16(q)) => Some(&q[..ns]),
        Some(_) => return Err(internal("a non-bf16 p0")),
        None => None,
    };
    macro_rules! run {
        ($p:expr, $g:expr) => {
            f(&mut Slices {
                p: &mut $p[po..po + n],
                g: $g,
                v,
                z,
                s,
                p0,
            })
        };
    }
    match (&mut *it.p, it.g) {
        (CpuStorage::F32(p), Some(CpuStorage::F32(g))) => run!(p, &g[go..go + n]),
        (CpuStorage::BF16(p), Some(CpuStorage::BF16(g))) => run!(p, &g[go..go + n]),
        (CpuStorage::F16(p), Some(CpuStorage::F16(g))) => run!(p, &g[go..go + n]),
        (CpuStorage::F32(p), None) => run!(p, &[] as &[f32]),
        (CpuStorage::BF16(p), None) => run!(p, &[] as &[bf16]),
        (CpuStorage::F16(p), None) => run!(p, &[] as &[f16]),
        _ => Err(internal("a parameter of another dtype")),
    }
}

/// `BackendStorage::schedulefree_multi` on the CPU.
pub(super) fn schedulefree(
    op: &SfOp,
    items: &mut [SfItem<'_, CpuStorage>],
    scalars: Option<&mut CpuStorage>,
) -> Result<()> {
    validate::schedulefree_multi(op, items, scalars.as_deref(), |s| (s.dtype(), s.len()))?;
    let SfOp::Prodigy(h) = op else {
        for it in items.iter_mut() {
            with_slices(it, &mut |x| {
                x.run(op, None);
                Ok(())
            })?;
        }
        return Ok(());
    };
    let Some(CpuStorage::F64(sv)) = scalars else {
        return Err(internal("non-f64 scalars"));
    };
    let mut st = [0f64; PRODIGY_SF_SCALARS];
    st.copy_from_slice(&sv[..PRODIGY_SF_SCALARS]);
    let c = h.pass(&st);
    // Each parameter's (numerator, denominator) terms: its chunks' sums added in order.
    let mut terms = Vec::with_capacity(items.len());
    for it in items.iter_mut() {
        with_slices(it, &mut |x| {
            let (mut dot, mut abs) = (0.0, 0.0);
            for (d, a) in x.run(op, Some(&c)) {
                dot += d;
                abs += a;
            }
            terms.push(c.item_terms(dot, abs));
            Ok(())
        })?;
    }
    let num = strided_sum(terms.len(), |i| terms[i].0);
    let den = strided_sum(terms.len(), |i| terms[i].1);
    h.reduce(&mut st, num, den);
    sv[..PRODIGY_SF_SCALARS].copy_from_slice(&st);
    Ok(())
}
