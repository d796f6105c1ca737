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

/// [x (rows, cols) f32/bf16/f16, optional col (cols) f32] (dense; `d` = [rows, cols]) ->
/// [codes (rows, cols / 4) u32, scale (rows) f32]: a block of 256 threads a row
/// (`quant_rows_fp8[_cols]_*` of cuda/fp8.cu).
pub(crate) fn quant_rows(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "quant_rows_fp8";
    let &[rows, cols] = d else {
        return Err(Error::Cuda(format!("{OP}: {} sizes, expected 2", d.len())));
    };
    let Some(x) = a.first() else {
        return Err(Error::Cuda(format!("{OP}: no operands")));
    };
    let col = a.get(1);
    if x.buf.len() < rows * cols || col.is_some_and(|c| c.buf.len() < cols) {
        return Err(Error::invalid(
            OP,
            "operands smaller than their shapes".to_string(),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &x.dev;
    let mut codes = dev.alloc::<u32>(rows * cols / crate::backend::fp8::CODES_PER_WORD)?;
    let mut scale = dev.alloc::<f32>(rows)?;
    if rows > 0 {
        let sfx = match x.buf.dtype() {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            dtype => return Err(Error::UnsupportedDType { op: OP, dtype }),
        };
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if rows > u32::MAX as usize {
            return Err(Error::invalid(
                OP,
                "more rows than one launch's grid".to_string(),
                &Shape::from((rows, cols)),
            ));
        }
        let xp = x.buf.raw_ptr(dev.stream());
        match col {
            Some(c) => {
                let cp = c.buf.raw_ptr(dev.stream());
                launch!(
                    dev,
                    "fp8",
                    format!("quant_rows_fp8_cols_{sfx}"),
                    cfg,
                    &xp,
                    &cp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &cols
                )?;
            }
            None => {
                launch!(
                    dev,
                    "fp8",
                    format!("quant_rows_fp8_{sfx}"),
                    cfg,
                    &xp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &cols
                )?;
            }
        }
    }
    Ok(vec![x.wrap(u32::wrap(codes)), x.wrap(f32::wrap(scale))])
}

/// [codes (rows, cols / 4) u32] (dense; `d` = [rows, cols]) -> [codes (cols, rows / 4)]: a
/// block a 64 x 64 byte tile (`transpose_fp8` of cuda/fp8.cu).
pub(crate) fn transpose(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "transpose_fp8";
    let (&[rows, cols], &[codes]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 1",
            d.len(),
            a.len()
        )));
    };
    let words = rows * cols / crate::backend::fp8::CODES_PER_WORD;
    if codes.buf.len() < words {
        return Err(Error::invalid(
            OP,
            format!("{} words, expected {words}", codes.buf.len()),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &codes.dev;
    let mut out = dev.alloc::<u32>(words)?;
    if words > 0 {
        let (gx, gy) = (cols.div_ceil(64), rows.div_ceil(64));
        if gx > u32::MAX as usize || gy > 65_535 {
            return Err(Error::invalid(
                OP,
                "a matrix larger than one launch's grid".to_string(),
                &Shape::from((rows, cols)),
            ));
        }
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let src = codes.buf.raw_ptr(dev.stream());
        launch!(
            dev,
            "fp8",
            "transpose_fp8",
            cfg,
            &src,
            &mut *out.slice,
            &rows,
            &cols
        )?;
    }
    Ok(vec![codes.wrap(u32::wrap(out))])
}
