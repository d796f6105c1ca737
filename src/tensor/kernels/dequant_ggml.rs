//! A GGML block-quantized weight (`backend::ggml` describes the types and their layouts)
//! dequantized into a float dtype. The blocks are held as stored, packed little end first
//! into u32 words (FLAME has no u8 dtype); the output is (rows, cols), `rows * cols / block
//! values` blocks in row order. The values are computed in f32 as gguf-py computes them and
//! rounded once. On CUDA cuda/ggml.cu's `dequant_<type>_*` (a thread per block), launched by
//! `backend::cuda::kit::dequant_ggml`. No gradient: GGUF base weights are frozen.

use crate::autograd::{plain, run_kernel};
use crate::backend::ggml::GgmlType;
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Shape, Tensor};

/// [blocks (words) u32] -> [w (rows, cols) in `dtype`].
pub(crate) struct DequantGgml {
    /// The type of the blocks.
    pub(crate) ty: GgmlType,
    /// The output's (rows, cols); cols a multiple of the type's block values.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// The float dtype of the output.
    pub(crate) dtype: DType,
}

impl DequantGgml {
    /// The block bytes the output needs, if (rows, cols) are whole blocks.
    fn bytes(&self) -> Option<usize> {
        if self.cols % self.ty.block_values() != 0 {
            return None;
        }
        self.ty.bytes_of(self.rows.checked_mul(self.cols)?)
    }
}

impl Kernel for DequantGgml {
    fn name(&self) -> &'static str {
        "dequant_ggml"
    }

    /// Returns [rows, cols].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let name = self.name();
        let out = Shape::from((self.rows, self.cols));
        let [(dt, blocks)] = args else {
            return Err(Error::invalid(
                name,
                format!("{} operands, expected 1", args.len()),
                &out,
            ));
        };
        if !self.dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: name,
                dtype: self.dtype,
            });
        }
        if *dt != DType::U32 {
            return Err(Error::DTypeMismatch {
                op: name,
                lhs: DType::U32,
                rhs: *dt,
            });
        }
        let need = self.bytes().ok_or_else(|| {
            Error::invalid(
                name,
                format!(
                    "rows of {} values are not whole {} blocks of {}",
                    self.cols,
                    self.ty.name(),
                    self.ty.block_values()
                ),
                &out,
            )
        })?;
        if blocks.dims().len() != 1 || blocks.dims()[0] * 4 < need {
            return Err(Error::invalid(
                name,
                format!(
                    "{} blocks of (rows, cols) take {need} bytes, more than the words {} hold",
                    self.ty.name(),
                    blocks.shape()
                ),
                &out,
            ));
        }
        Ok(vec![self.rows, self.cols])
    }

    /// `backend::ggml::dequantize` in f32, rounded once to `dtype`.
    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::contiguous;
        use crate::backend::ggml;
        use crate::CpuStorage;
        let CpuStorage::U32(words) = args[0].0 else {
            return Err(Error::UnsupportedDType {
                op: "dequant_ggml",
                dtype: args[0].0.dtype(),
            });
        };
        let bytes = ggml::word_bytes(&contiguous(words, args[0].1));
        let mut out = vec![0f32; dims[0] * dims[1]];
        ggml::dequantize(self.ty, &bytes, &mut out)
            .map_err(|m| Error::invalid("dequant_ggml", m, &Shape::from((dims[0], dims[1]))))?;
        Ok(vec![crate::backend::cpu::f32_values_as(
            out,
            self.dtype,
            "dequant_ggml",
        )?])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::dequant_ggml(self.ty, self.dtype, dims, args)
    }
}

impl Tensor {
    /// A GGML block-quantized weight dequantized into `dtype`: `self` holds the blocks packed
    /// into u32 words (`backend::ggml::to_words`), `ty` their type, (rows, cols) the weight's
    /// shape. Returns a fresh (rows, cols) tensor, not recorded (GGUF weights are frozen).
    pub fn dequant_ggml(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let k = DequantGgml {
            ty,
            rows,
            cols,
            dtype,
        };
        let w = run_kernel(&k, &[self])?
            .pop()
            .ok_or_else(|| Error::invalid("dequant_ggml", "no output".to_string(), self.shape()))?;
        Ok(plain(w, (rows, cols), self))
    }
}
