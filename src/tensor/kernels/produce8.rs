//! Inputs of 8-bit products quantized by the ops that produce them. adaLN modulation and
//! GELU's tanh form write their output and the codes and scales of its rows (those of
//! `Tensor::quant_rows8`) in one pass (cuda/fp8.cu's `quant_rows_*_mod` / `quant_rows_*_gelu`),
//! so a Linear whose products run in 8 bits (`Linear::input_code`) takes the codes without
//! reading its input a second time. The output is recorded as the producer's own op (the
//! `Modulate` kernel, GELU's unary) and its values are the producer kernel's, bit for bit (the
//! formulas are shared, cuda/common.cuh); the CPU reference runs the producer's reference, then
//! the quantization's.

use super::modulate::Modulate;
use crate::autograd::{plain, record, recorded, run_kernel, Op};
use crate::backend::fp8::{Code8, Produce, CODES_PER_WORD};
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Shape, Tensor, UnaryOp};

const NAME: &str = "produce_rows8";

/// Rows of a matrix in 8-bit codes: what [`Tensor::quant_rows8`] returns, with the code.
#[derive(Clone, Debug)]
pub struct Rows8 {
    /// The codes' format.
    pub code: Code8,
    /// (rows, cols / 4) u32, four codes a word.
    pub codes: Tensor,
    /// (rows) f32, one scale a row.
    pub scales: Tensor,
}

impl Rows8 {
    /// The rows (over the last dim) of `y` quantized into `code` by their own pass
    /// ([`Tensor::quant_rows8`]).
    pub fn of(y: &Tensor, code: Code8) -> Result<Rows8> {
        let cols = y.dims().last().copied().unwrap_or(0);
        let rows = y.elem_count() / cols.max(1);
        let (codes, scales) = y.reshape((rows, cols))?.quant_rows8(code, None)?;
        Ok(Rows8 {
            code,
            codes,
            scales,
        })
    }

    /// Whether these are the rows of a (rows, cols) matrix in `code`.
    pub fn fits(&self, code: Code8, rows: usize, cols: usize) -> bool {
        self.code == code
            && cols % CODES_PER_WORD == 0
            && self.codes.dims() == [rows, cols / CODES_PER_WORD]
            && self.scales.dims() == [rows]
    }
}

/// The producer and the quantization in one kernel: for `Produce::Modulate` [x (B, L, D),
/// shift, scale (B, D)], one dtype, -> [y (B L, D), codes, scales] (dims [B L, D, L]); for
/// `Produce::GeluTanh` [x (rows, cols)] -> [y, codes, scales] (dims [rows, cols]).
pub(crate) struct ProduceRows8 {
    pub(crate) code: Code8,
    pub(crate) produce: Produce,
}

impl Kernel for ProduceRows8 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let float = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16);
        let dims = match self.produce {
            Produce::Modulate => {
                let o = Operands::new(NAME, args, 3)?;
                let d = o.dims(3, "(B, L, D)")?;
                let bd = [d[0], d[2]];
                o.expect(1, o.dtype(), &bd)?;
                o.expect(2, o.dtype(), &bd)?;
                vec![d[0] * d[1], d[2], d[1]]
            }
            Produce::GeluTanh => {
                let o = Operands::new(NAME, args, 1)?;
                let d = o.dims(2, "(rows, cols)")?;
                vec![d[0], d[1]]
            }
        };
        let dtype = args[0].0;
        if !float(dtype) {
            return Err(Error::UnsupportedDType { op: NAME, dtype });
        }
        if dims[1] % CODES_PER_WORD != 0 {
            return Err(Error::invalid(
                NAME,
                format!("{} columns: rows pack four codes a word", dims[1]),
                args[0].1.shape(),
            ));
        }
        Ok(dims)
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use super::fp8_products::QuantRowsFp8;
        use crate::backend::BackendStorage;
        let (rows, cols) = (dims[0], dims[1]);
        let y = match self.produce {
            Produce::Modulate => {
                let (b, l) = (rows / dims[2].max(1), dims[2]);
                let mut o = Modulate.cpu(&[b, l, cols], args)?;
                o.pop().ok_or_else(|| {
                    Error::invalid(NAME, "no modulation output", &Shape::from((rows, cols)))
                })?
            }
            Produce::GeluTanh => args[0].0.unary(args[0].1, UnaryOp::GeluTanh)?,
        };
        let quant = QuantRowsFp8 {
            cols: false,
            code: self.code,
        };
        let l = Layout::contiguous((rows, cols));
        let mut out = vec![];
        let codes = quant.cpu(&[rows, cols], &[(&y, &l)])?;
        out.push(y);
        out.extend(codes);
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::quant_rows_fp8_with(self.code, Some(self.produce), dims, args)
    }
}

/// The three outputs of a `ProduceRows8` run: y's storage and the rows' codes.
fn split(
    mut o: Vec<crate::device::Storage>,
    rows: usize,
    cols: usize,
    code: Code8,
    like: &Tensor,
) -> Result<(crate::device::Storage, Rows8)> {
    let missing = || Error::invalid(NAME, "missing output", &Shape::from((rows, cols)));
    let scales = o.pop().ok_or_else(missing)?;
    let codes = o.pop().ok_or_else(missing)?;
    let y = o.pop().ok_or_else(missing)?;
    Ok((
        y,
        Rows8 {
            code,
            codes: plain(codes, (rows, cols / CODES_PER_WORD), like),
            scales: plain(scales, rows, like),
        },
    ))
}

/// Whether a producer's output of this dtype and row width can be quantized in its pass.
fn fusable(dtype: DType, cols: usize) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && cols > 0 && cols % CODES_PER_WORD == 0
}

impl Tensor {
    /// `self.modulate(shift, scale)` and its rows (over the last dim) quantized into `code`
    /// as [`Tensor::quant_rows8`] would, in one pass where the modulation takes its fused
    /// kernel (x (B, ..., D), shift and scale broadcasting as (B, 1, ..., D)); otherwise the
    /// two ops one after the other, with the same values. The output is recorded as
    /// `modulate`'s; the codes are not.
    pub fn modulate_quant8(
        &self,
        shift: &Tensor,
        scale: &Tensor,
        code: Code8,
    ) -> Result<(Tensor, Rows8)> {
        let r = self.rank();
        let e = self.dims().last().copied().unwrap_or(0);
        let fused = if r >= 3 && fusable(self.dtype(), e) {
            match (self.as_batch_rows(shift)?, self.as_batch_rows(scale)?) {
                (Some(sh), Some(sc)) => Some((sh, sc)),
                _ => None,
            }
        } else {
            None
        };
        let Some((sh, sc)) = fused else {
            let y = self.modulate(shift, scale)?;
            let rows = Rows8::of(&y, code)?;
            return Ok((y, rows));
        };
        let b = self.dims()[0];
        let x = self.reshape((b, self.elem_count() / (b * e).max(1), e))?;
        let o = run_kernel(
            &ProduceRows8 {
                code,
                produce: Produce::Modulate,
            },
            &[&x, &sh, &sc],
        )?;
        let rows = x.elem_count() / e.max(1);
        let (y, rows8) = split(o, rows, e, code, self)?;
        let y = recorded(Modulate, y, x.shape().clone(), &[&x, &sh, &sc], &[]);
        Ok((y.reshape(self.shape().clone())?, rows8))
    }

    /// `self.gelu_tanh()` and its rows (over the last dim) quantized into `code` as
    /// [`Tensor::quant_rows8`] would, in one pass (f32, bf16 or f16 with a last dim a multiple
    /// of 4; otherwise the two ops one after the other, with the same values). The output is
    /// recorded as `gelu_tanh`'s; the codes are not.
    pub fn gelu_tanh_quant8(&self, code: Code8) -> Result<(Tensor, Rows8)> {
        let e = self.dims().last().copied().unwrap_or(0);
        let rows = self.elem_count() / e.max(1);
        if self.rank() == 0 || !fusable(self.dtype(), e) {
            let y = self.gelu_tanh()?;
            let r8 = Rows8::of(&y, code)?;
            return Ok((y, r8));
        }
        let x = self.reshape((rows, e))?;
        let o = run_kernel(
            &ProduceRows8 {
                code,
                produce: Produce::GeluTanh,
            },
            &[&x],
        )?;
        let (y, rows8) = split(o, rows, e, code, self)?;
        let rec = record(&[self], || Op::Unary(self.clone(), UnaryOp::GeluTanh));
        let y = Tensor::from_storage(y, self.shape().clone(), self.device().clone(), rec);
        Ok((y, rows8))
    }
}
