//! Launcher of the GGML decode (`tensor/kernels/dequant_ggml.rs`; kernels in cuda/ggml.cu): a
//! thread per block of the type (32 or 256 values), grid-stride loops. The operand was checked
//! by the kernel's `check` (dtype, enough words for the blocks) and made dense by
//! `run_kernel`; the output is a fresh buffer.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::ggml::GgmlType;
use crate::{DType, Error, Result, Shape};
use half::{bf16, f16};

/// [blocks (words) u32] (dense; `d` = [rows, cols]) -> [w (rows, cols) in `dtype`].
pub(crate) fn dequant(
    ty: GgmlType,
    dtype: DType,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    match dtype {
        DType::F32 => run::<f32>(ty, d, a),
        DType::F64 => run::<f64>(ty, d, a),
        DType::BF16 => run::<bf16>(ty, d, a),
        DType::F16 => run::<f16>(ty, d, a),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "dequant_ggml",
            dtype,
        }),
    }
}

fn run<T: Elem>(ty: GgmlType, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "dequant_ggml";
    let (&[rows, cols], &[words]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 1",
            d.len(),
            a.len()
        )));
    };
    let values = rows * cols;
    let blocks = values / ty.block_values();
    let need = ty.bytes_of(values);
    if cols % ty.block_values() != 0 || need.is_none_or(|n| words.buf.len() * 4 < n) {
        return Err(Error::invalid(
            OP,
            format!(
                "{} words do not hold (rows, cols) of {}",
                words.buf.len(),
                ty.name()
            ),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &words.dev;
    let mut w = dev.alloc::<T>(values)?;
    if blocks > 0 {
        let src = words.buf.raw_ptr(dev.stream());
        let kernel = format!("dequant_{}_{}", ty.name().to_ascii_lowercase(), T::SFX);
        launch!(
            dev,
            "ggml",
            kernel,
            grid_for(blocks, dev.sm_count()),
            &src,
            &mut *w.slice,
            &blocks
        )?;
    }
    Ok(vec![words.wrap(T::wrap(w))])
}
