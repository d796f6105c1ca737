//! Launcher of Lion's multi-tensor step (cuda/multi_tensor.cu, `backend::lion`): one table
//! of the tensors, one launch per call. Operands were checked by `validate::lion_multi`.

use super::multi::{addr, check_devices, grid, sfx, upload};
use super::storage::{launch, CudaStorage};
use crate::backend::lion::{LionHyper, LionItem, LionMoment};
use crate::backend::quant8::BLOCK;
use crate::backend::validate;
use crate::{Error, Result, Shape};

const OP: &str = "lion_multi";
/// Values per thread block of the f32-momentum update (the kernels' ADAM_CHUNK).
const CHUNK: usize = 4096;

/// `BackendStorage::lion_multi` on CUDA.
pub(super) fn lion(
    h: &LionHyper,
    items: &mut [LionItem<'_, CudaStorage>],
    map: Option<&CudaStorage>,
) -> Result<()> {
    validate::lion_multi(items, map, |s| (s.buf.dtype(), s.buf.len()))?;
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dtype = first.p.buf.dtype();
    let quantized = matches!(first.m, LionMoment::Quantized { .. });
    let mut all: Vec<&CudaStorage> = vec![];
    for it in items.iter() {
        all.extend([&*it.p, it.g]);
        match &it.m {
            LionMoment::Full(m) => all.push(&**m),
            LionMoment::Quantized { codes, absmax } => all.extend([&**codes, &**absmax]),
        }
    }
    all.extend(map);
    let dev_of = check_devices(OP, all.into_iter())?
        .ok_or_else(|| Error::invalid(OP, "internal: no operands", &Shape::from(())))?;
    let mut table: Vec<u64> = vec![];
    let (mut chunks, mut k) = (0u64, 0u32);
    let per = if quantized { BLOCK } else { CHUNK };
    for it in items.iter() {
        if it.n == 0 {
            continue;
        }
        table.extend([addr(it.p, it.p_offset), addr(it.g, it.g_offset)]);
        match &it.m {
            LionMoment::Full(m) => table.push(addr(m, 0)),
            LionMoment::Quantized { codes, absmax } => {
                table.extend([addr(codes, 0), addr(absmax, 0)])
            }
        }
        table.extend([it.n as u64, chunks]);
        chunks += it.n.div_ceil(per) as u64;
        k += 1;
    }
    if k == 0 {
        return Ok(());
    }
    let cfg = grid(OP, chunks)?;
    let dev = &dev_of.dev;
    let t = upload(dev_of, &table)?;
    let s = sfx(dtype)?;
    let a = [
        h.beta1,
        h.beta2,
        h.one_minus_beta1,
        h.one_minus_beta2,
        h.decay,
        h.neg_lr,
        h.grad_scale,
    ];
    if quantized {
        let map = map.ok_or_else(|| Error::invalid(OP, "no map", &Shape::from(())))?;
        let mp = addr(map, 0);
        launch!(
            dev,
            "multi_tensor",
            format!("lion_8bit_{s}"),
            cfg,
            &*t.slice,
            &k,
            &mp,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6]
        )
    } else {
        launch!(
            dev,
            "multi_tensor",
            format!("lion_full_{s}"),
            cfg,
            &*t.slice,
            &k,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6]
        )
    }
}
