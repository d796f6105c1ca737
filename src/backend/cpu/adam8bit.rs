//! `FusedOp::AdamW8bit` on the CPU: the reference of cuda/adam8bit.cu. Blocks of 256 values
//! run in parallel (each independent, so the result does not depend on the split); within a
//! block the arithmetic is `AdamW8bitStep::apply` and `quant8`'s quantization, in f32.

use super::strided;
use crate::backend::quant8::{self, BLOCK, WORDS_PER_BLOCK};
use crate::backend::AdamW8bitStep;
use crate::{CpuStorage, DType, Error, Layout, Result, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

/// The view `l` of `s` as contiguous f32 values (exact for f32, bf16 and f16).
fn f32_view(op: &'static str, s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    fn conv<T: WithDType>(v: &[T], l: &Layout) -> Vec<f32> {
        strided::contiguous(v, l)
            .iter()
            .map(|x| x.to_f64() as f32)
            .collect()
    }
    match s {
        CpuStorage::F32(v) => Ok(strided::contiguous(v, l).into_owned()),
        CpuStorage::BF16(v) => Ok(conv(v, l)),
        CpuStorage::F16(v) => Ok(conv(v, l)),
        CpuStorage::F64(_) | CpuStorage::U32(_) => Err(Error::UnsupportedDType {
            op,
            dtype: s.dtype(),
        }),
    }
}

/// The view `l` of a u32 storage, contiguous.
fn u32_view(op: &'static str, s: &CpuStorage, l: &Layout) -> Result<Vec<u32>> {
    match s {
        CpuStorage::U32(v) => Ok(strided::contiguous(v, l).into_owned()),
        _ => Err(Error::DTypeMismatch {
            op,
            lhs: DType::U32,
            rhs: s.dtype(),
        }),
    }
}

/// The two maps of the (2, 256) operand: signed, unsigned.
fn maps(op: &'static str, s: &CpuStorage, l: &Layout) -> Result<([f32; 256], [f32; 256])> {
    let v = f32_view(op, s, l)?;
    let mut signed = [0f32; 256];
    let mut unsigned = [0f32; 256];
    if v.len() != 512 {
        return Err(Error::invalid(op, "maps must be (2, 256)", l.shape()));
    }
    signed.copy_from_slice(&v[..256]);
    unsigned.copy_from_slice(&v[256..]);
    Ok((signed, unsigned))
}

/// One block: dequantize m and v, update p, m and v, requantize m and v. `p` and `g` hold the
/// block's values (fewer than 256 in the last block); returns the new (m absmax, v absmax).
#[allow(clippy::too_many_arguments)]
fn block(
    h: &AdamW8bitStep,
    (sm, um): (&[f32; 256], &[f32; 256]),
    p: &mut [f32],
    g: &[f32],
    m_words: &mut [u32],
    m_absmax: f32,
    v_words: &mut [u32],
    v_absmax: f32,
) -> (f32, f32) {
    let n = p.len();
    let mut m = [0f32; BLOCK];
    let mut v = [0f32; BLOCK];
    quant8::dequantize_block(sm, m_words, m_absmax, &mut m[..n]);
    quant8::dequantize_block(um, v_words, v_absmax, &mut v[..n]);
    for j in 0..n {
        let (np, nm, nv) = h.apply(p[j], g[j], m[j], v[j]);
        p[j] = np;
        m[j] = nm;
        v[j] = nv;
    }
    (
        quant8::quantize_block(sm, &m[..n], m_words),
        quant8::quantize_block(um, &v[..n], v_words),
    )
}

/// [p, g, maps, m codes, m absmax, v codes, v absmax] (checked by `validate::fused`) ->
/// [p', m codes, m absmax, v codes, v absmax].
pub(super) fn step(h: &AdamW8bitStep, args: &[(&CpuStorage, &Layout)]) -> Result<Vec<CpuStorage>> {
    const OP: &str = "adamw8bit";
    let [(ps, pl), (gs, gl), (qs, ql), (mcs, mcl), (mas, mal), (vcs, vcl), (vas, val)] = args
    else {
        return Err(Error::invalid(
            OP,
            format!("{} operands, expected 7", args.len()),
            &crate::Shape::from(()),
        ));
    };
    let dtype = ps.dtype();
    let mut p = f32_view(OP, ps, pl)?;
    let g = f32_view(OP, gs, gl)?;
    let (sm, um) = maps(OP, qs, ql)?;
    let mut mc = u32_view(OP, mcs, mcl)?;
    let mut ma = f32_view(OP, mas, mal)?;
    let mut vc = u32_view(OP, vcs, vcl)?;
    let mut va = f32_view(OP, vas, val)?;
    p.par_chunks_mut(BLOCK)
        .zip(g.par_chunks(BLOCK))
        .zip(mc.par_chunks_mut(WORDS_PER_BLOCK))
        .zip(ma.par_iter_mut())
        .zip(vc.par_chunks_mut(WORDS_PER_BLOCK))
        .zip(va.par_iter_mut())
        .for_each(|(((((p, g), mw), ma), vw), va)| {
            let (nm, nv) = block(h, (&sm, &um), p, g, mw, *ma, vw, *va);
            *ma = nm;
            *va = nv;
        });
    let p = match dtype {
        DType::BF16 => CpuStorage::BF16(p.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(p.into_iter().map(f16::from_f32).collect()),
        _ => CpuStorage::F32(p),
    };
    Ok(vec![
        p,
        CpuStorage::U32(mc),
        CpuStorage::F32(ma),
        CpuStorage::U32(vc),
        CpuStorage::F32(va),
    ])
}
