//! 8-bit products over FP8 E4M3 operands (`backend::fp8` describes the format: four codes a
//! u32 word, one f32 scale a row): the pieces of a frozen Linear computing in 8 bits
//! (`nn::Packing::Fp8` with 8-bit products).
//!
//! - [`Tensor::quant_rows_fp8`]: activations quantized a row (a token) at a time, with an
//!   optional f32 factor per column applied first (the backward folds the weight's per-row
//!   scales into dy this way): `v = x * col`, `s = absmax(v) / 448`, `r = 1 / s`,
//!   `code = e4m3(v * r)`, each f32 operation rounded once. The reciprocal is taken once a
//!   row (a multiplication an element, not a division); a code can differ from
//!   `e4m3(v / s)` (the loader's weight quantization, `backend::fp8::quantize_rows`) where
//!   `v * r` and `v / s` round to neighbouring f32 values on either side of an E4M3
//!   midpoint.
//! - [`Tensor::transpose_fp8`]: the codes of (rows, cols) as those of (cols, rows), for the
//!   backward's product over the weight's other axis.
//! - [`fp8_product`]: `y[m, n] = sa[m] * sb[n] * sum_k a[m, k] * b[n, k]` over two code
//!   matrices that share their inner axis, rounded once to the output dtype. On CUDA one
//!   cuBLASLt FP8 GEMM with a scale vector per operand (`backend::cuda::fp8_gemm`); the CPU
//!   decodes the codes exactly into f32 and multiplies them in f32.
//!
//! The CPU quantization is bit for bit the kernels' (cuda/fp8.cu: the same f32 products,
//! division and reciprocal, the same rounding to E4M3); the product differs by the order of
//! f32 additions.
//! None of these records a gradient: the Linear's own backward calls them.
//!
//! Each takes the codes' format (`backend::fp8::Code8`): int8 (`backend::int8`) runs the same
//! pieces with `s = absmax(v) / 127` and `code = round(v * r)` clamped to +-127, and the
//! product on integer tensor cores, exact in i32 before the scales
//! (`backend::cuda::fp8_gemm`).

use crate::autograd::{plain, run_kernel};
use crate::backend::fp8::{Code8, CODES_PER_WORD};
use crate::backend::Kernel;
use crate::{DType, Error, Layout, Result, Shape, Tensor};

/// The name of each kernel in errors.
const ROTATE: &str = "hadamard_rows";
const QUANT: &str = "quant_rows_fp8";
const TRANSPOSE: &str = "transpose_fp8";
const PRODUCT: &str = "fp8_product";

fn operands<'a>(
    name: &'static str,
    args: &'a [(DType, &'a Layout)],
    want: &[DType],
) -> Result<&'a [(DType, &'a Layout)]> {
    if args.len() != want.len() {
        let shape = args
            .first()
            .map(|a| a.1.shape().clone())
            .unwrap_or_default();
        return Err(Error::invalid(
            name,
            format!("{} operands, expected {}", args.len(), want.len()),
            &shape,
        ));
    }
    for (&(have, _), &w) in args.iter().zip(want) {
        if have != w {
            return Err(Error::DTypeMismatch {
                op: name,
                lhs: w,
                rhs: have,
            });
        }
    }
    Ok(args)
}

fn matrix(name: &'static str, l: &Layout) -> Result<(usize, usize)> {
    match *l.dims() {
        [r, c] => Ok((r, c)),
        _ => Err(Error::invalid(name, "expected a matrix", l.shape())),
    }
}

fn vector_of(name: &'static str, l: &Layout, len: usize, like: &Layout) -> Result<()> {
    if l.dims() != [len] {
        return Err(Error::ShapeMismatch {
            op: name,
            lhs: like.shape().clone(),
            rhs: l.shape().clone(),
        });
    }
    Ok(())
}

/// [x (rows, cols) f32/bf16/f16, optional col (cols) f32] -> [codes (rows, cols / 4) u32,
/// scale (rows) f32].
pub(crate) struct QuantRowsFp8 {
    /// Whether a per-column factor is the second operand.
    pub(crate) cols: bool,
    /// The codes' format.
    pub(crate) code: Code8,
}

impl Kernel for QuantRowsFp8 {
    fn name(&self) -> &'static str {
        QUANT
    }

    /// Returns [rows, cols].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let want = usize::from(self.cols) + 1;
        let Some(&(dtype, x)) = args.first() else {
            return Err(Error::invalid(QUANT, "no operands", &Shape::from(())));
        };
        if args.len() != want {
            return Err(Error::invalid(
                QUANT,
                format!("{} operands, expected {want}", args.len()),
                x.shape(),
            ));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType { op: QUANT, dtype });
        }
        let (rows, cols) = matrix(QUANT, x)?;
        if cols % CODES_PER_WORD != 0 {
            return Err(Error::invalid(
                QUANT,
                format!("{cols} columns: FP8 rows pack four codes a word"),
                x.shape(),
            ));
        }
        if self.cols {
            let (cdt, cl) = args[1];
            if cdt != DType::F32 {
                return Err(Error::DTypeMismatch {
                    op: QUANT,
                    lhs: DType::F32,
                    rhs: cdt,
                });
            }
            vector_of(QUANT, cl, cols, x)?;
        }
        Ok(vec![rows, cols])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::f64_view;
        use crate::backend::fp8;
        use crate::CpuStorage;
        use rayon::prelude::*;
        let (rows, cols, code) = (dims[0], dims[1], self.code);
        // Every value of f32, bf16 and f16 is exact in f64 and back in f32.
        let x: Vec<f32> = f64_view(args[0].0, args[0].1)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let col: Option<Vec<f32>> = self.cols.then(|| {
            f64_view(args[1].0, args[1].1)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        });
        let words = cols / CODES_PER_WORD;
        let mut codes = vec![0u32; rows * words];
        let mut scales = vec![0f32; rows];
        codes
            .par_chunks_mut(words.max(1))
            .zip(scales.par_iter_mut())
            .zip(x.par_chunks(cols.max(1)))
            .for_each(|((c, s), row)| {
                let v = |i: usize| match &col {
                    Some(col) => row[i] * col[i],
                    None => row[i],
                };
                *s = code.row_scale(code.absmax((0..cols).map(v)));
                // One reciprocal a row, rounded once (cuda/fp8.cu: `__frcp_rn`), then a
                // product an element (`__fmul_rn`).
                let r = 1.0 / *s;
                for (w, word) in c.iter_mut().enumerate() {
                    let base = w * CODES_PER_WORD;
                    *word = fp8::pack((0..CODES_PER_WORD).map(|j| code.encode(v(base + j) * r)));
                }
            });
        Ok(vec![CpuStorage::U32(codes), CpuStorage::F32(scales)])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::quant_rows_fp8(self.code, dims, args)
    }
}

/// [x (rows, cols) f32/bf16/f16] -> [x rotated (rows, cols) in its dtype]: each block of
/// `block` values of a row by the normalized Hadamard matrix (`backend::int8::rotate_blocks`).
pub(crate) struct HadamardRows {
    /// The block (a power of two from 2 to `int8::ROTATION_MAX`, dividing the row).
    pub(crate) block: usize,
}

impl Kernel for HadamardRows {
    fn name(&self) -> &'static str {
        ROTATE
    }

    /// Returns [rows, cols].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let Some(&(dtype, x)) = args.first() else {
            return Err(Error::invalid(ROTATE, "no operands", &Shape::from(())));
        };
        if args.len() != 1 {
            return Err(Error::invalid(ROTATE, "one operand", x.shape()));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType { op: ROTATE, dtype });
        }
        let (rows, cols) = matrix(ROTATE, x)?;
        let b = self.block;
        let within = (2..=crate::backend::int8::ROTATION_MAX).contains(&b);
        if !b.is_power_of_two() || !within || cols % b != 0 {
            return Err(Error::invalid(
                ROTATE,
                format!(
                    "a block of {b} over rows of {cols}: a power of two up to 256 dividing them"
                ),
                x.shape(),
            ));
        }
        Ok(vec![rows, cols])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        _dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::f64_view;
        use rayon::prelude::*;
        // Every value of f32, bf16 and f16 is exact in f32.
        let mut v: Vec<f32> = f64_view(args[0].0, args[0].1)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let b = self.block;
        v.par_chunks_mut(b)
            .for_each(|c| crate::backend::int8::rotate_blocks(c, b));
        Ok(vec![crate::backend::cpu::f32_values_as(
            v,
            args[0].0.dtype(),
            ROTATE,
        )?])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::hadamard_rows(self.block, dims, args)
    }
}

/// [codes (rows, cols / 4) u32] -> [codes (cols, rows / 4) u32].
pub(crate) struct TransposeFp8;

impl Kernel for TransposeFp8 {
    fn name(&self) -> &'static str {
        TRANSPOSE
    }

    /// Returns [rows, cols] of the byte matrix.
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let args = operands(TRANSPOSE, args, &[DType::U32])?;
        let (rows, words) = matrix(TRANSPOSE, args[0].1)?;
        if rows % CODES_PER_WORD != 0 {
            return Err(Error::invalid(
                TRANSPOSE,
                format!("{rows} rows: the transposed rows pack four codes a word"),
                args[0].1.shape(),
            ));
        }
        Ok(vec![rows, words * CODES_PER_WORD])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::contiguous;
        use crate::backend::fp8::{pack, unpack};
        use crate::CpuStorage;
        let (rows, cols) = (dims[0], dims[1]);
        let CpuStorage::U32(w) = args[0].0 else {
            return Err(Error::UnsupportedDType {
                op: TRANSPOSE,
                dtype: args[0].0.dtype(),
            });
        };
        let w = contiguous(w, args[0].1);
        let (in_words, out_words) = (cols / CODES_PER_WORD, rows / CODES_PER_WORD);
        let code = |r: usize, c: usize| unpack(w[r * in_words + c / CODES_PER_WORD], c % 4);
        let out = (0..cols * out_words)
            .map(|i| {
                let (c, rw) = (i / out_words.max(1), i % out_words.max(1));
                pack((0..CODES_PER_WORD).map(|j| code(rw * CODES_PER_WORD + j, c)))
            })
            .collect();
        Ok(vec![CpuStorage::U32(out)])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::transpose_fp8(dims, args)
    }
}

/// [a (m, k / 4) u32, sa (m) f32, b (n, k / 4) u32, sb (n) f32, optional bias (n) in `dtype`]
/// -> [y (m, n) in `dtype`].
pub(crate) struct Fp8Product {
    /// The output's float dtype (not f64).
    pub(crate) dtype: DType,
    /// The codes' format (both operands').
    pub(crate) code: Code8,
    /// Whether a bias (n) is the fifth operand, added before the output's rounding.
    pub(crate) bias: bool,
}

impl Kernel for Fp8Product {
    fn name(&self) -> &'static str {
        PRODUCT
    }

    /// Returns [m, n, k].
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let mut want = vec![DType::U32, DType::F32, DType::U32, DType::F32];
        if self.bias {
            want.push(self.dtype);
        }
        let args = operands(PRODUCT, args, &want)?;
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDType {
                op: PRODUCT,
                dtype: self.dtype,
            });
        }
        let (a, b) = (args[0].1, args[2].1);
        let ((m, ka), (n, kb)) = (matrix(PRODUCT, a)?, matrix(PRODUCT, b)?);
        if ka != kb {
            return Err(Error::ShapeMismatch {
                op: PRODUCT,
                lhs: a.shape().clone(),
                rhs: b.shape().clone(),
            });
        }
        vector_of(PRODUCT, args[1].1, m, a)?;
        vector_of(PRODUCT, args[3].1, n, b)?;
        if self.bias {
            vector_of(PRODUCT, args[4].1, n, b)?;
        }
        Ok(vec![m, n, ka * CODES_PER_WORD])
    }

    /// The codes decoded exactly into f32, one f32 GEMM, then `(acc * sa) * sb (+ bias)` in
    /// f32, rounded once.
    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use crate::backend::cpu::{contiguous, f64_view};
        use crate::backend::fp8::unpack;
        use crate::backend::MatmulDims;
        use crate::CpuStorage;
        use rayon::prelude::*;
        let (m, n, k) = (dims[0], dims[1], dims[2]);
        let table: Vec<f32> = (0..=255u8).map(|c| self.code.decode(c)).collect();
        let values = |s: &CpuStorage, l: &Layout| -> Result<Vec<f32>> {
            let CpuStorage::U32(w) = s else {
                return Err(Error::UnsupportedDType {
                    op: PRODUCT,
                    dtype: s.dtype(),
                });
            };
            let w = contiguous(w, l);
            Ok(w.iter()
                .flat_map(|&word| (0..CODES_PER_WORD).map(move |j| unpack(word, j)))
                .map(|c| table[usize::from(c)])
                .collect())
        };
        let (a, b) = (values(args[0].0, args[0].1)?, values(args[2].0, args[2].1)?);
        let sa: Vec<f64> = f64_view(args[1].0, args[1].1);
        let sb: Vec<f64> = f64_view(args[3].0, args[3].1);
        let bias: Option<Vec<f64>> = self.bias.then(|| f64_view(args[4].0, args[4].1));
        // a (1, m, k) @ b^T (1, k, n), b^T as b's strides swapped.
        let acc = crate::backend::cpu::matmul(
            &CpuStorage::F32(a),
            &Layout::contiguous((1, m, k)),
            &CpuStorage::F32(b),
            &Layout::new(Shape::from((1, k, n)), vec![n * k, 1, k], 0),
            MatmulDims { b: 1, m, n, k },
        )?;
        let CpuStorage::F32(mut acc) = acc else {
            return Err(Error::invalid(
                PRODUCT,
                "the f32 product came back in another dtype",
                &Shape::from((m, n)),
            ));
        };
        acc.par_chunks_mut(n.max(1))
            .zip(sa.par_iter())
            .for_each(|(row, &a)| {
                for (j, (v, &b)) in row.iter_mut().zip(&sb).enumerate() {
                    *v = *v * a as f32 * b as f32;
                    if let Some(bias) = &bias {
                        *v += bias[j] as f32;
                    }
                }
            });
        Ok(vec![crate::backend::cpu::f32_values_as(
            acc, self.dtype, PRODUCT,
        )?])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::fp8_product(self.code, self.dtype, dims, args)
    }
}

impl Tensor {
    /// This (rows, cols) float matrix (f32, bf16 or f16; cols a multiple of 4) quantized a row
    /// at a time into FP8 E4M3: (codes (rows, cols / 4) u32, scales (rows) f32), after
    /// multiplying each column by `col` (cols) f32 when given. In f32, each operation rounded
    /// once: `v = x * col`, `s = absmax(v) / 448` (1 for a zero or non-finite maximum),
    /// `code = e4m3(v * (1 / s))`. Not recorded.
    pub fn quant_rows_fp8(&self, col: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        self.quant_rows8(Code8::E4m3, col)
    }

    /// [`Tensor::quant_rows_fp8`] into `code`: for int8, `s = absmax(v) / 127` (1 for a zero
    /// row, NaN for a row holding a NaN or an infinity) and `code = round(v * (1 / s))`, ties
    /// to even, clamped to +-127 (`backend::int8`). Not recorded.
    pub fn quant_rows8(&self, code: Code8, col: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let kernel = QuantRowsFp8 {
            cols: col.is_some(),
            code,
        };
        let args: Vec<&Tensor> = std::iter::once(self).chain(col).collect();
        let mut o = run_kernel(&kernel, &args)?;
        let (rows, cols) = (self.dims()[0], self.dims()[1]);
        let missing = || Error::invalid(QUANT, "missing output".to_string(), self.shape());
        let scale = o.pop().ok_or_else(missing)?;
        let codes = o.pop().ok_or_else(missing)?;
        Ok((
            plain(codes, (rows, cols / CODES_PER_WORD), self),
            plain(scale, rows, self),
        ))
    }

    /// This (rows, cols) float matrix with each block of `block` values of a row rotated by
    /// the normalized Hadamard matrix (`backend::int8::rotate_blocks`: `block` a power of two
    /// up to 256 dividing cols; its own inverse), in f32, rounded once to its dtype. The
    /// int8 products' outlier treatment. Not recorded.
    pub fn hadamard_rows(&self, block: usize) -> Result<Tensor> {
        let mut o = run_kernel(&HadamardRows { block }, &[self])?;
        let y = o
            .pop()
            .ok_or_else(|| Error::invalid(ROTATE, "no output".to_string(), self.shape()))?;
        Ok(plain(y, self.dims().to_vec(), self))
    }

    /// FP8 codes (rows, cols / 4) u32 of a (rows, cols) matrix (rows a multiple of 4) as the
    /// codes (cols, rows / 4) of its transpose. Not recorded.
    pub fn transpose_fp8(&self) -> Result<Tensor> {
        let mut o = run_kernel(&TransposeFp8, &[self])?;
        let (rows, words) = (self.dims()[0], self.dims()[1]);
        let t = o
            .pop()
            .ok_or_else(|| Error::invalid(TRANSPOSE, "no output".to_string(), self.shape()))?;
        Ok(plain(
            t,
            (words * CODES_PER_WORD, rows / CODES_PER_WORD),
            self,
        ))
    }
}

/// `y[i, j] = sa[i] * sb[j] * sum_k decode(a[i, k]) * decode(b[j, k])` in `dtype` (f32, bf16
/// or f16): `a` (m, k / 4) and `b` (n, k / 4) FP8 codes with their per-row scales `sa` (m) and
/// `sb` (n). Not recorded.
pub fn fp8_product(
    a: &Tensor,
    sa: &Tensor,
    b: &Tensor,
    sb: &Tensor,
    dtype: DType,
) -> Result<Tensor> {
    product8(Code8::E4m3, a, sa, b, sb, dtype)
}

/// [`product8`] with `bias` (n, in `dtype`) added to every row before the output's rounding
/// (the Linear's frozen bias, in the product's own pass). Not recorded.
pub fn product8_bias(
    code: Code8,
    [a, sa, b, sb]: [&Tensor; 4],
    bias: Option<&Tensor>,
    dtype: DType,
) -> Result<Tensor> {
    let kernel = Fp8Product {
        dtype,
        code,
        bias: bias.is_some(),
    };
    let args: Vec<&Tensor> = [a, sa, b, sb].into_iter().chain(bias).collect();
    let mut o = run_kernel(&kernel, &args)?;
    let (m, n) = (a.dims()[0], b.dims()[0]);
    let y = o
        .pop()
        .ok_or_else(|| Error::invalid(PRODUCT, "no output".to_string(), a.shape()))?;
    Ok(plain(y, (m, n), a))
}

/// [`fp8_product`] over codes in `code` (FP8 E4M3 or int8): for int8 the sum is exact in
/// i32 on the GPU (f32 on the CPU reference), then scaled. Not recorded.
pub fn product8(
    code: Code8,
    a: &Tensor,
    sa: &Tensor,
    b: &Tensor,
    sb: &Tensor,
    dtype: DType,
) -> Result<Tensor> {
    product8_bias(code, [a, sa, b, sb], None, dtype)
}
