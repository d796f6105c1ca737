//! Multi-tensor ops on the CPU (`backend::multi`): the reference of cuda/multi_tensor.cu.
//! Adam runs `AdamHyper::apply` per value in f32; 8-bit moments go block by block (256
//! values, each block independent, so the result does not depend on the split) through
//! `quant8`'s dequantization and quantization. Sums of squares are taken in f64 per chunk of
//! 4096 values and the chunks added in order.

use crate::backend::multi::{
    copy_value, fold_value, AdamBias, AdamHyper, AdamItem, AdamMoments, CastItem, FoldItem,
    MultiRef,
};
use crate::backend::quant8::{self, BLOCK, WORDS_PER_BLOCK};
use crate::backend::validate;
use crate::{CpuStorage, DType, Error, Result, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "adam_multi";
/// Values per parallel task of the f32-moment update and of the sums of squares.
const CHUNK: usize = 4096;

/// A parameter element: read as f32, written back rounded once from f32.
pub(super) trait Param: Copy + Send + Sync {
    fn get(self) -> f32;
    fn put(x: f32) -> Self;
}
impl Param for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(x: f32) -> Self {
        x
    }
}
impl Param for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(x: f32) -> Self {
        bf16::from_f32(x)
    }
}
impl Param for f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(x: f32) -> Self {
        f16::from_f32(x)
    }
}

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
        _ => Err(internal("a non-f32 moment")),
    }
}

fn u32s_mut(s: &mut CpuStorage) -> Result<&mut [u32]> {
    match s {
        CpuStorage::U32(v) => Ok(v),
        _ => Err(internal("non-u32 codes")),
    }
}

/// The two maps of the (2, 256) operand: signed, unsigned.
fn read_maps(s: &CpuStorage) -> Result<([f32; 256], [f32; 256])> {
    let CpuStorage::F32(v) = s else {
        return Err(internal("non-f32 maps"));
    };
    let mut signed = [0f32; 256];
    let mut unsigned = [0f32; 256];
    signed.copy_from_slice(&v[..256]);
    unsigned.copy_from_slice(&v[256..512]);
    Ok((signed, unsigned))
}

/// f32 moments: chunks of the parameter in parallel.
fn full<T: Param>(h: &AdamHyper, b: AdamBias, p: &mut [T], g: &[T], m: &mut [f32], v: &mut [f32]) {
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            for j in 0..p.len() {
                let (np, nm, nv) = h.apply(b, p[j].get(), g[j].get(), m[j], v[j]);
                p[j] = T::put(np);
                m[j] = nm;
                v[j] = nv;
            }
        });
}

/// One 8-bit block: dequantize m and v, update p, m and v, requantize m and v (new maxima
/// written to `ma`, `va`). `p` and `g` hold the block's values (fewer than 256 in the last).
#[allow(clippy::too_many_arguments)]
fn block<T: Param>(
    h: &AdamHyper,
    b: AdamBias,
    (sm, um): (&[f32; 256], &[f32; 256]),
    p: &mut [T],
    g: &[T],
    m_words: &mut [u32],
    ma: &mut f32,
    v_words: &mut [u32],
    va: &mut f32,
) {
    let n = p.len();
    let mut m = [0f32; BLOCK];
    let mut v = [0f32; BLOCK];
    quant8::dequantize_block(sm, m_words, *ma, &mut m[..n]);
    quant8::dequantize_block(um, v_words, *va, &mut v[..n]);
    for j in 0..n {
        let (np, nm, nv) = h.apply(b, p[j].get(), g[j].get(), m[j], v[j]);
        p[j] = T::put(np);
        m[j] = nm;
        v[j] = nv;
    }
    *ma = quant8::quantize_block(sm, &m[..n], m_words);
    *va = quant8::quantize_block(um, &v[..n], v_words);
}

/// One item whose parameter holds `T`.
fn item<T: Param + WithDType>(
    h: &AdamHyper,
    maps: Option<&([f32; 256], [f32; 256])>,
    p: &mut [T],
    g: &[T],
    moments: &mut AdamMoments<'_, CpuStorage>,
    b: AdamBias,
) -> Result<()> {
    let n = p.len();
    match moments {
        AdamMoments::Full { m, v } => {
            let (m, v) = (f32s_mut(m)?, f32s_mut(v)?);
            full(h, b, p, g, &mut m[..n], &mut v[..n]);
        }
        AdamMoments::Quantized {
            m_codes,
            m_absmax,
            v_codes,
            v_absmax,
        } => {
            let (sm, um) = maps.ok_or_else(|| internal("8-bit moments without maps"))?;
            let nb = quant8::blocks(n);
            let (mc, vc) = (u32s_mut(m_codes)?, u32s_mut(v_codes)?);
            let (ma, va) = (f32s_mut(m_absmax)?, f32s_mut(v_absmax)?);
            p.par_chunks_mut(BLOCK)
                .zip(g.par_chunks(BLOCK))
                .zip(mc[..nb * WORDS_PER_BLOCK].par_chunks_mut(WORDS_PER_BLOCK))
                .zip(ma[..nb].par_iter_mut())
                .zip(vc[..nb * WORDS_PER_BLOCK].par_chunks_mut(WORDS_PER_BLOCK))
                .zip(va[..nb].par_iter_mut())
                .for_each(|(((((p, g), mw), ma), vw), va)| {
                    block(h, b, (sm, um), p, g, mw, ma, vw, va)
                });
        }
    }
    Ok(())
}

/// `BackendStorage::adam_multi` on the CPU.
pub(super) fn adam(
    h: &AdamHyper,
    items: &mut [AdamItem<'_, CpuStorage>],
    maps: Option<&CpuStorage>,
) -> Result<()> {
    validate::adam_multi(items, maps, |s| (s.dtype(), s.len()))?;
    let maps = match maps {
        Some(q)
            if matches!(
                items.first().map(|i| &i.moments),
                Some(AdamMoments::Quantized { .. })
            ) =>
        {
            Some(read_maps(q)?)
        }
        _ => None,
    };
    for it in items.iter_mut() {
        let (po, go, n, b) = (it.p_offset, it.g_offset, it.n, it.bias);
        match (&mut *it.p, it.g) {
            (CpuStorage::F32(p), CpuStorage::F32(g)) => item(
                h,
                maps.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.moments,
                b,
            )?,
            (CpuStorage::BF16(p), CpuStorage::BF16(g)) => item(
                h,
                maps.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.moments,
                b,
            )?,
            (CpuStorage::F16(p), CpuStorage::F16(g)) => item(
                h,
                maps.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.moments,
                b,
            )?,
            _ => return Err(internal("a parameter of another dtype")),
        }
    }
    Ok(())
}

fn sum_sq_of<T: WithDType>(x: &[T]) -> f64 {
    let parts: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| {
            c.iter().fold(0.0f64, |s, v| {
                let v = v.to_f64();
                s + v * v
            })
        })
        .collect();
    parts.into_iter().sum()
}

/// `BackendStorage::sum_sq_multi` on the CPU.
pub(super) fn sum_sq(items: &[MultiRef<'_, CpuStorage>]) -> Result<f64> {
    validate::sum_sq_multi(items, |s| (s.dtype(), s.len()))?;
    let mut total = 0.0;
    for it in items {
        let r = it.offset..it.offset + it.n;
        total += match it.s {
            CpuStorage::F32(v) => sum_sq_of(&v[r]),
            CpuStorage::F64(v) => sum_sq_of(&v[r]),
            CpuStorage::BF16(v) => sum_sq_of(&v[r]),
            CpuStorage::F16(v) => sum_sq_of(&v[r]),
            CpuStorage::U32(_) => {
                return Err(Error::UnsupportedDType {
                    op: "sum_sq_multi",
                    dtype: DType::U32,
                })
            }
        };
    }
    Ok(total)
}

/// The values of a float view as f32, one pass each (exact from bf16 and f16).
fn f32_values(r: &MultiRef<'_, CpuStorage>, op: &'static str) -> Result<Vec<f32>> {
    let (o, n) = (r.offset, r.n);
    Ok(match r.s {
        CpuStorage::F32(v) => v[o..o + n].to_vec(),
        CpuStorage::BF16(v) => v[o..o + n].par_iter().map(|x| x.get()).collect(),
        CpuStorage::F16(v) => v[o..o + n].par_iter().map(|x| x.get()).collect(),
        _ => {
            return Err(Error::invalid(
                op,
                "internal: a view of another dtype after validation",
                &crate::Shape::from(n),
            ))
        }
    })
}

/// `values` rounded once into `out[start..]`.
fn put_values(out: &mut CpuStorage, start: usize, values: &[f32], op: &'static str) -> Result<()> {
    fn put<T: Param>(dst: &mut [T], values: &[f32]) {
        dst.par_iter_mut()
            .zip(values.par_iter())
            .for_each(|(d, v)| *d = T::put(*v));
    }
    let end = start + values.len();
    match out {
        CpuStorage::F32(d) => d[start..end].copy_from_slice(values),
        CpuStorage::BF16(d) => put(&mut d[start..end], values),
        CpuStorage::F16(d) => put(&mut d[start..end], values),
        _ => {
            return Err(Error::invalid(
                op,
                "internal: an output of another dtype after validation",
                &crate::Shape::from(values.len()),
            ))
        }
    }
    Ok(())
}

/// `BackendStorage::cast_multi` on the CPU.
pub(super) fn cast(out: &mut CpuStorage, items: &[CastItem<'_, CpuStorage>]) -> Result<()> {
    const OP: &str = "cast_multi";
    validate::cast_multi(out, items, |s| (s.dtype(), s.len()))?;
    let mut start = 0;
    for it in items {
        let mut v = f32_values(&it.src, OP)?;
        v.par_iter_mut().for_each(|x| *x = copy_value(it.scale, *x));
        put_values(out, start, &v, OP)?;
        start += it.src.n;
    }
    Ok(())
}

/// `BackendStorage::fold_multi` on the CPU.
pub(super) fn fold(out: &mut CpuStorage, items: &[FoldItem<'_, CpuStorage>]) -> Result<()> {
    const OP: &str = "fold_multi";
    validate::fold_multi(out, items, |s| (s.dtype(), s.len()))?;
    let mut start = 0;
    for it in items {
        let mut v = f32_values(&it.g, OP)?;
        match &it.prev {
            Some(p) => {
                let p = f32_values(p, OP)?;
                v.par_iter_mut()
                    .zip(p.par_iter())
                    .for_each(|(x, p)| *x = fold_value(it.scale, Some(*p), *x));
            }
            None => v
                .par_iter_mut()
                .for_each(|x| *x = fold_value(it.scale, None, *x)),
        }
        put_values(out, start, &v, OP)?;
        start += it.g.n;
    }
    Ok(())
}
