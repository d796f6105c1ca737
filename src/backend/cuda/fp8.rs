//! Launcher of the FP8 decode (`tensor/kernels/dequant_fp8.rs`; kernels in cuda/fp8.cu): a
//! thread per 16 codes with 16-byte loads and stores where rows are whole groups of 16 and the
//! buffers aligned, else a thread per packed word of four E4M3 codes; grid-stride loops.
//! Operands were checked by the kernel's `check` (dtypes, shapes) and made dense by
//! `run_kernel`; the output is a fresh buffer.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::{DType, Error, Result, Shape};
use half::{bf16, f16};

/// [codes (rows, words) u32, scale (rows) f32] (dense; `d` = [rows, cols]) -> [w (rows,
/// cols) in `dtype`].
pub(crate) fn dequant(dtype: DType, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    match dtype {
        DType::F32 => run::<f32>(d, a),
        DType::F64 => run::<f64>(d, a),
        DType::BF16 => run::<bf16>(d, a),
        DType::F16 => run::<f16>(d, a),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "dequant_fp8",
            dtype,
        }),
    }
}

fn run<T: Elem>(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "dequant_fp8";
    let (&[rows, cols], &[codes, scale]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 2",
            d.len(),
            a.len()
        )));
    };
    let words = rows * cols / crate::backend::fp8::CODES_PER_WORD;
    let words_per_row = cols / crate::backend::fp8::CODES_PER_WORD;
    if codes.buf.len() < words || scale.buf.len() < rows {
        return Err(Error::invalid(
            OP,
            format!(
                "operands of {} and {} elements, expected {words} and {rows}",
                codes.buf.len(),
                scale.buf.len()
            ),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &codes.dev;
    let mut w = dev.alloc::<T>(rows * cols)?;
    if words > 0 {
        let ptr = |s: &CudaStorage| s.buf.raw_ptr(dev.stream());
        let (c, s) = (ptr(codes), ptr(scale));
        // Rows of whole 16-code groups from 16-byte aligned codes into an aligned output: a
        // thread per group with 16-byte loads and stores (f64 keeps the word kernel); else a
        // thread per word. Each kernel takes (items per row, items).
        let out = {
            use cudarc::driver::DevicePtr;
            w.slice.device_ptr(dev.stream()).0
        };
        let x16 = T::DTYPE != DType::F64 && cols % 16 == 0 && c % 16 == 0 && out % 16 == 0;
        let (kernel, per_row, items) = if x16 {
            ("dequant_fp8_x16", cols / 16, rows * cols / 16)
        } else {
            ("dequant_fp8", words_per_row, words)
        };
        launch!(
            dev,
            "fp8",
            format!("{kernel}_{}", T::SFX),
            grid_for(items, dev.sm_count()),
            &c,
            &s,
            &mut *w.slice,
            &per_row,
            &items
        )?;
    }
    Ok(vec![codes.wrap(T::wrap(w))])
}
