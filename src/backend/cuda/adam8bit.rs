//! Launcher of `FusedOp::AdamW8bit` (kernel in cuda/adam8bit.cu): one launch per parameter,
//! one thread block per quantization block of 256 values. Operands were checked by
//! `validate::fused` (dtypes, shapes) and made dense by `fused`; the outputs are fresh
//! buffers, so the kernel never reads what it writes.

use super::storage::{launch, CudaStorage, Elem};
use crate::backend::quant8::{BLOCK, WORDS_PER_BLOCK};
use crate::backend::AdamW8bitStep;
use crate::{Error, Result, Shape};
use cudarc::driver::LaunchConfig;

/// Largest grid.x of a launch: one block per quantization block.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// [p, g, maps, m codes, m absmax, v codes, v absmax] (dense; `d` = [N, blocks]) ->
/// [p', m codes, m absmax, v codes, v absmax].
pub(super) fn step<T: Elem>(
    h: &AdamW8bitStep,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    const OP: &str = "adamw8bit";
    let (&[n, nb], &[p, g, maps, mc, ma, vc, va]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 7",
            d.len(),
            a.len()
        )));
    };
    if nb > MAX_GRID_X {
        return Err(Error::invalid(
            OP,
            format!("{nb} blocks exceed one launch ({MAX_GRID_X})"),
            &Shape::from(n),
        ));
    }
    // The sizes the kernel reads and writes (validate::fused checked the views' shapes; a
    // dense operand is its whole buffer from offset 0).
    let sizes = [
        (p, n),
        (g, n),
        (maps, 512),
        (mc, nb * WORDS_PER_BLOCK),
        (ma, nb),
        (vc, nb * WORDS_PER_BLOCK),
        (va, nb),
    ];
    if let Some((s, want)) = sizes.iter().find(|(s, want)| s.buf.len() < *want) {
        return Err(Error::invalid(
            OP,
            format!("an operand of {} elements, expected {want}", s.buf.len()),
            &Shape::from(n),
        ));
    }
    let dev = &p.dev;
    let mut p_out = dev.alloc::<T>(n)?;
    let mut mc_out = dev.alloc::<u32>(nb * WORDS_PER_BLOCK)?;
    let mut ma_out = dev.alloc::<f32>(nb)?;
    let mut vc_out = dev.alloc::<u32>(nb * WORDS_PER_BLOCK)?;
    let mut va_out = dev.alloc::<f32>(nb)?;
    if nb > 0 {
        let ptr = |s: &CudaStorage| s.buf.raw_ptr(dev.stream());
        let ins = [
            ptr(p),
            ptr(g),
            ptr(maps),
            ptr(mc),
            ptr(ma),
            ptr(vc),
            ptr(va),
        ];
        let cfg = LaunchConfig {
            grid_dim: (nb as u32, 1, 1),
            block_dim: (BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            "adam8bit",
            format!("adamw8bit_{}", T::SFX),
            cfg,
            &ins[0],
            &ins[1],
            &ins[2],
            &ins[3],
            &ins[4],
            &ins[5],
            &ins[6],
            &mut *p_out.slice,
            &mut *mc_out.slice,
            &mut *ma_out.slice,
            &mut *vc_out.slice,
            &mut *va_out.slice,
            &n,
            &h.beta1,
            &h.beta2,
            &h.one_minus_beta1,
            &h.one_minus_beta2,
            &h.eps,
            &h.decay,
            &h.step_size,
            &h.bias2_sqrt
        )?;
    }
    Ok(vec![
        p.wrap(T::wrap(p_out)),
        p.wrap(u32::wrap(mc_out)),
        p.wrap(f32::wrap(ma_out)),
        p.wrap(u32::wrap(vc_out)),
        p.wrap(f32::wrap(va_out)),
    ])
}
