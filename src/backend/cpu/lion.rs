//! Lion's multi-tensor step on the CPU (`backend::lion`): the reference of the lion kernels
//! in cuda/multi_tensor.cu. f32 momenta go in parallel chunks; 8-bit momenta block by block
//! (256 values, each block independent) through `quant8`'s dequantization and quantization.

use super::multi::Param;
use crate::backend::lion::{LionHyper, LionItem, LionMoment};
use crate::backend::quant8::{self, BLOCK, WORDS_PER_BLOCK};
use crate::backend::validate;
use crate::{CpuStorage, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "lion_multi";
/// Values per parallel task of the f32-momentum update.
const CHUNK: usize = 4096;

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
        _ => Err(internal("a non-f32 momentum")),
    }
}

/// One item whose parameter holds `T`.
fn item<T: Param>(
    h: &LionHyper,
    map: Option<&[f32; 256]>,
    p: &mut [T],
    g: &[T],
    m: &mut LionMoment<'_, CpuStorage>,
) -> Result<()> {
    let n = p.len();
    match m {
        LionMoment::Full(m) => {
            let m = &mut f32s_mut(m)?[..n];
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .for_each(|((p, g), m)| {
                    for j in 0..p.len() {
                        let (np, nm) = h.apply(p[j].get(), g[j].get(), m[j]);
                        p[j] = T::put(np);
                        m[j] = nm;
                    }
                });
        }
        LionMoment::Quantized { codes, absmax } => {
            let map = map.ok_or_else(|| internal("8-bit momenta without the map"))?;
            let nb = quant8::blocks(n);
            let CpuStorage::U32(words) = &mut **codes else {
                return Err(internal("non-u32 codes"));
            };
            let absmax = f32s_mut(absmax)?;
            p.par_chunks_mut(BLOCK)
                .zip(g.par_chunks(BLOCK))
                .zip(words[..nb * WORDS_PER_BLOCK].par_chunks_mut(WORDS_PER_BLOCK))
                .zip(absmax[..nb].par_iter_mut())
                .for_each(|(((p, g), w), a)| {
                    let k = p.len();
                    let mut m = [0f32; BLOCK];
                    quant8::dequantize_block(map, w, *a, &mut m[..k]);
                    for j in 0..k {
                        let (np, nm) = h.apply(p[j].get(), g[j].get(), m[j]);
                        p[j] = T::put(np);
                        m[j] = nm;
                    }
                    *a = quant8::quantize_block(map, &m[..k], w);
                });
        }
    }
    Ok(())
}

/// `BackendStorage::lion_multi` on the CPU.
pub(super) fn lion(
    h: &LionHyper,
    items: &mut [LionItem<'_, CpuStorage>],
    map: Option<&CpuStorage>,
) -> Result<()> {
    validate::lion_multi(items, map, |s| (s.dtype(), s.len()))?;
    let map = match map {
        Some(CpuStorage::F32(v))
            if matches!(
                items.first().map(|i| &i.m),
                Some(LionMoment::Quantized { .. })
            ) =>
        {
            let mut m = [0f32; 256];
            m.copy_from_slice(&v[..256]);
            Some(m)
        }
        _ => None,
    };
    for it in items.iter_mut() {
        let (po, go, n) = (it.p_offset, it.g_offset, it.n);
        match (&mut *it.p, it.g) {
            (CpuStorage::F32(p), CpuStorage::F32(g)) => item(
                h,
                map.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.m,
            )?,
            (CpuStorage::BF16(p), CpuStorage::BF16(g)) => item::<bf16>(
                h,
                map.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.m,
            )?,
            (CpuStorage::F16(p), CpuStorage::F16(g)) => item::<f16>(
                h,
                map.as_ref(),
                &mut p[po..po + n],
                &g[go..go + n],
                &mut it.m,
            )?,
            _ => return Err(internal("a parameter of another dtype")),
        }
    }
    Ok(())
}
