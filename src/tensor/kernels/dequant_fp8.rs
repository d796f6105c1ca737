//! An FP8 E4M3 weight decoded into a float dtype (`backend::fp8` describes the format: four
//! codes a u32 word, one f32 scale a row): `w = decode(code) * scale` in f32, rounded once.
//! On CUDA cuda/fp8.cu's `dequant_fp8_x16_*` (a thread per 16 codes, 16-byte loads and stores)
//! or `dequant_fp8_*` (a thread per word), launched by `backend::cuda::kit::dequant_fp8`. No
//! gradient: FP8 weights are frozen. The CPU reference computes the same f32 product, so both
//! backends give the same bits. Int8 codes (`backend::int8`, the same packing) decode through
//! the same kernel's int8 forms (`dequant_i8*`).

use crate::autograd::{plain, run_kernel};
use crate::backend::fp8::{Code8, CODES_PER_WORD};
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Tensor};

/// [codes (rows, cols / 4) u32, scale (rows) f32] -> [w (rows, cols) in `dtype`].
pub(crate) struct DequantFp8 {
    /// The float dtype of the output.
    pub(crate) dtype: DType,
    /// The codes' format.
    pub(crate) code: Code8,
}

impl Kernel for DequantFp8 {
    fn name(&self) -> &'static str {
        "dequant_fp8"
    }

    /// Returns [rows, cols = 4 words].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let name = self.name();
        let Some(&(_, x)) = args.first() else {
            return Err(Error::invalid(name, "no operands", &crate::Shape::from(())));
        };
        if args.len() != 2 {
            return Err(Error::invalid(
                name,
                format!("{} operands, expected 2", args.len()),
                x.shape(),
            ));
        }
        let (codes, scale) = (args[0], args[1]);
        if !self.dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: name,
                dtype: self.dtype,
            });
        }
        for (have, want) in [(codes.0, DType::U32), (scale.0, DType::F32)] {
            if have != want {
                return Err(Error::DTypeMismatch {
                    op: name,
                    lhs: want,
                    rhs: have,
                });
            }
        }
        let d = codes.1.dims();
        if d.len() != 2 || scale.1.dims() != [d[0]] {
            return Err(Error::ShapeMismatch {
                op: name,
                lhs: codes.1.shape().clone(),
                rhs: scale.1.shape().clone(),
            });
        }
        Ok(vec![d[0], d[1] * CODES_PER_WORD])
    }

    /// `decode(code) * scale` in f32 per value, rounded once to `dtype` (cuda/fp8.cu computes
    /// the same f32 product, so both backends give the same bits).
    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{contiguous, f64_view};
        use crate::CpuStorage;
        let cols = dims[1];
        let CpuStorage::U32(codes) = args[0].0 else {
            return Err(Error::UnsupportedDType {
                op: "dequant_fp8",
                dtype: args[0].0.dtype(),
            });
        };
        let codes = contiguous(codes, args[0].1);
        // Every scale is an f32: exact through f64.
        let scale: Vec<f32> = f64_view(args[1].0, args[1].1)
            .into_iter()
            .map(|s| s as f32)
            .collect();
        let out = crate::backend::fp8::dequantize_rows_as(self.code, &codes, &scale, cols);
        // Rounded once from the f32 product, as the kernel does.
        Ok(vec![crate::backend::cpu::f32_values_as(
            out,
            self.dtype,
            "dequant_fp8",
        )?])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::dequant_fp8(self.code, self.dtype, dims, args)
    }
}

impl Tensor {
    /// An FP8 E4M3 weight decoded into `dtype`: `self` holds the packed codes (rows, cols / 4)
    /// u32 and `scale` one f32 per row (`backend::fp8` describes the format). Returns a
    /// fresh (rows, cols) tensor, not recorded (fp8 weights are frozen).
    pub fn dequant_fp8(&self, scale: &Tensor, dtype: DType) -> Result<Tensor> {
        self.dequant8(Code8::E4m3, scale, dtype)
    }

    /// [`Tensor::dequant_fp8`] for codes in `code` (FP8 E4M3 or int8).
    pub fn dequant8(&self, code: Code8, scale: &Tensor, dtype: DType) -> Result<Tensor> {
        let mut o = run_kernel(&DequantFp8 { dtype, code }, &[self, scale])?;
        let rows = self.dims().first().copied().unwrap_or(0);
        let cols = self.dims().get(1).copied().unwrap_or(0) * CODES_PER_WORD;
        let w = o
            .pop()
            .ok_or_else(|| Error::invalid("dequant_fp8", "no output".to_string(), self.shape()))?;
        Ok(plain(w, (rows, cols), self))
    }
}
