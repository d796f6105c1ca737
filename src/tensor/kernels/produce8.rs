//! Inputs of 8-bit products quantized by the ops that produce them. adaLN modulation, GELU's
//! tanh form and the concatenation [a, gelu_tanh(x)] before Flux's single blocks' `linear2`
//! write their output and the codes and scales of its rows (those of `Tensor::quant_rows8`) in
//! one pass (cuda/fp8.cu's `quant_rows_*_mod` / `_gelu` / `_catgelu`), so a Linear whose
//! products run in 8 bits (`Linear::input_code`) takes the codes without reading its input a
//! second time. The output is recorded as the producer's own op (the `Modulate` kernel, GELU's
//! unary, [`CatGeluTanh`]) and its values are the producer kernel's, bit for bit (the formulas
//! are shared, cuda/common.cuh); the CPU reference runs the producer's reference, then the
//! quantization's. The concatenation also runs without codes (`Tensor::cat_gelu_tanh`): one
//! pass where GELU and the concatenation took two.

use super::modulate::Modulate;
use crate::autograd::{plain, record, recorded, run_kernel, FusedKernel, Op};
use crate::backend::fp8::{Code8, Produce, CODES_PER_WORD};
use crate::backend::validate::Operands;
use crate::backend::Kernel;
use crate::{BinaryOp, DType, Error, Layout, Result, Shape, Tensor, UnaryOp};

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

const CAT_GELU: &str = "cat_gelu_tanh";

/// y = [a, gelu_tanh(x)] over the last dim, or a's rows alone without x, and with a code the
/// codes and scales of y's rows: [a, x] or [a] -> [y (rows, cols)] or [y, codes, scales]
/// (dims [rows, cols, split]). a is (rows, split), or (B, L, H, D) heads with B L rows and
/// split = H D (attention's output, its heads merged by this pass); x (rows, cols - split);
/// split, D and cols multiples of 4. Recorded (without a code) as y's op: a's gradient is g's
/// first `split` columns in a's shape, x's GELU's backward of the rest.
pub(crate) struct CatGeluTanh {
    pub(crate) code: Option<Code8>,
}

/// (rows, split) of operand a of [`CatGeluTanh`], and its head width (split for a matrix).
fn cat_rows(l: &Layout) -> Option<(usize, usize, usize)> {
    match *l.dims() {
        [r, c] => Some((r, c, c)),
        [b, s, h, d] => Some((b * s, h * d, d)),
        _ => None,
    }
}

impl Kernel for CatGeluTanh {
    fn name(&self) -> &'static str {
        CAT_GELU
    }

    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>> {
        let bad = |msg: String, l: &Layout| Error::invalid(CAT_GELU, msg, l.shape());
        let Some(&(dtype, la)) = args.first().filter(|_| args.len() <= 2) else {
            return Err(Error::invalid(
                CAT_GELU,
                format!("{} operands, expected a and x, or a", args.len()),
                &Shape::from(args.len()),
            ));
        };
        let Some((rows, split, hd)) = cat_rows(la) else {
            return Err(bad("a: (rows, split) or (B, L, H, D)".into(), la));
        };
        let rest = match args.get(1) {
            Some(&(dx, lx)) => {
                if dx != dtype {
                    return Err(Error::DTypeMismatch {
                        op: CAT_GELU,
                        lhs: dtype,
                        rhs: dx,
                    });
                }
                match lx.dims() {
                    &[r, c] if r == rows => c,
                    _ => return Err(bad(format!("x: (rows, cols) with a's {rows} rows"), lx)),
                }
            }
            None => 0,
        };
        let cols = split + rest;
        // f64 (without codes) for the CPU reference's gradient checks.
        let float = fusable(dtype, cols) || (dtype == DType::F64 && self.code.is_none());
        if !float || [cols, split, hd].iter().any(|n| n % CODES_PER_WORD != 0) {
            return Err(bad(
                format!(
                    "{dtype} rows of {split} (heads of {hd}) + {rest} values: f32, bf16 or f16 \
                     (f64 without codes), each a multiple of 4"
                ),
                la,
            ));
        }
        Ok(vec![rows, cols, split])
    }

    #[cfg(feature = "cpu-ref")]
    fn cpu(
        &self,
        dims: &[usize],
        args: &[(&crate::CpuStorage, &Layout)],
    ) -> Result<Vec<crate::CpuStorage>> {
        use super::fp8_products::QuantRowsFp8;
        use crate::backend::{BackendDevice, BackendStorage};
        let (rows, cols, split) = (dims[0], dims[1], dims[2]);
        let shape = Shape::from((rows, cols));
        let Some(&(a, la)) = args.first() else {
            return Err(Error::invalid(CAT_GELU, "no operands", &shape));
        };
        let whole = Layout::contiguous((rows, cols));
        let mut y = crate::backend::cpu::CpuDevice.full(&shape, a.dtype(), 0.0)?;
        // a's part of y, in a's shape (heads split as a has them).
        let part = whole.narrow(1, 0, split)?;
        let part = part
            .reshape(la.shape())
            .ok_or_else(|| Error::invalid(CAT_GELU, "a's part of y as a's shape", la.shape()))?;
        a.copy_strided(la, &mut y, &part)?;
        if let Some(&(x, lx)) = args.get(1) {
            let g = x.unary(lx, UnaryOp::GeluTanh)?;
            let lg = Layout::contiguous((rows, cols - split));
            g.copy_strided(&lg, &mut y, &whole.narrow(1, split, cols - split)?)?;
        }
        let mut out = vec![];
        if let Some(code) = self.code {
            let quant = QuantRowsFp8 { cols: false, code };
            out = quant.cpu(&[rows, cols], &[(&y, &whole)])?;
        }
        out.insert(0, y);
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        dims: &[usize],
        args: &[&crate::backend::cuda::CudaStorage],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        let (rows, cols, split) = (dims[0], dims[1], dims[2]);
        let la = Layout::contiguous((rows, split));
        let lx = Layout::contiguous((rows, cols - split));
        let views: Vec<_> = args.iter().copied().zip([&la, &lx]).collect();
        crate::backend::cuda::kit::cat_gelu_rows(self.code, dims, &views)
    }

    /// Reads a's heads and x's rows where they lie (x is a slice of a wider projection's rows,
    /// a attention's output with its heads apart).
    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&crate::backend::cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<crate::backend::cuda::CudaStorage>> {
        crate::backend::cuda::kit::cat_gelu_rows(self.code, dims, args)
    }
}

impl FusedKernel for CatGeluTanh {
    /// GELU's backward reads x; a's gradient is a slice of g.
    fn reads_inputs(&self, needs_grad: &[bool]) -> Vec<bool> {
        let mut v = vec![false];
        if needs_grad.len() > 1 {
            v.push(needs_grad[1]);
        }
        v
    }

    fn vjp(
        &self,
        inputs: &[Tensor],
        _kept: &[Tensor],
        _out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let Some(a) = inputs.first().filter(|_| inputs.len() <= 2) else {
            return Err(Error::Autograd(format!(
                "internal: {CAT_GELU} recorded {} inputs, expected 1 or 2",
                inputs.len()
            )));
        };
        let last = g.rank().saturating_sub(1);
        let rest = inputs
            .get(1)
            .map_or(0, |x| x.dims().last().copied().unwrap_or(0));
        let split = g.dims().last().copied().unwrap_or(0) - rest;
        let ga = g.narrow(last, 0, split)?.reshape(a.shape().clone())?;
        let mut out = vec![Some(ga)];
        if let Some(x) = inputs.get(1) {
            let gx = x.binary(&g.narrow(last, split, rest)?, BinaryOp::GeluTanhBackward)?;
            out.push(Some(gx));
        }
        Ok(out)
    }
}

/// The three outputs of a `ProduceRows8` run: y's storage and the rows' codes.
fn split_outputs(
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
        let (y, rows8) = split_outputs(o, rows, e, code, self)?;
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
        let (y, rows8) = split_outputs(o, rows, e, code, self)?;
        let rec = record(&[self], || Op::Unary(self.clone(), UnaryOp::GeluTanh));
        let y = Tensor::from_storage(y, self.shape().clone(), self.device().clone(), rec);
        Ok((y, rows8))
    }

    /// `Tensor::cat(&[self, &x.gelu_tanh()?], last)` in one pass (Flux's single blocks feed
    /// `linear2` so): x (..., m), self (..., split) with x's leading dims, or attention's
    /// heads (B, L, H, D) beside x (B, L, m) (the heads merged as they are read); both of
    /// one dtype (f32, bf16 or f16), split, D and m multiples of 4; otherwise the ops one
    /// after the other, with the same values. x may be a slice of a wider tensor's rows, self
    /// a transposed view: both are read where they lie.
    pub fn cat_gelu_tanh(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.cat_gelu(Some(x), None)?.0)
    }

    /// [`Tensor::cat_gelu_tanh`] and its rows (over the last dim) quantized into `code` as
    /// [`Tensor::quant_rows8`] would, in the same pass where the concatenation takes its fused
    /// kernel. The output is recorded as the concatenation's; the codes are not.
    pub fn cat_gelu_tanh_quant8(&self, x: &Tensor, code: Code8) -> Result<(Tensor, Rows8)> {
        self.cat_gelu8(Some(x), code)
    }

    /// Attention's output o (B, H, L, D) with its heads merged, (B, L, H D) as
    /// [`crate::nn::merge_heads`] makes it, and its rows quantized into `code`, in one pass
    /// (D a multiple of 4, f32, bf16 or f16; otherwise the two ops one after the other). The
    /// output is recorded as the merge's; the codes are not.
    pub fn merge_heads_quant8(&self, code: Code8) -> Result<(Tensor, Rows8)> {
        if self.rank() != 4 {
            return Err(Error::invalid(
                "merge_heads_quant8",
                "attention's output (B, H, L, D)",
                self.shape(),
            ));
        }
        self.transpose(1, 2)?.cat_gelu8(None, code)
    }

    /// [`Tensor::cat_gelu`] with codes, which it gives whenever a code is asked.
    fn cat_gelu8(&self, x: Option<&Tensor>, code: Code8) -> Result<(Tensor, Rows8)> {
        let (y, rows8) = self.cat_gelu(x, Some(code))?;
        let rows8 = rows8.ok_or_else(|| Error::invalid(CAT_GELU, "no codes made", y.shape()))?;
        Ok((y, rows8))
    }

    /// [self, gelu_tanh(x)] (or self's rows alone) with its rows' codes where `code` is given,
    /// in one kernel where it takes them: self (..., split) with x's leading dims, or heads
    /// (B, L, H, D) (x (B, L, m)).
    fn cat_gelu(&self, x: Option<&Tensor>, code: Option<Code8>) -> Result<(Tensor, Option<Rows8>)> {
        let da = self.dims();
        let heads = da.len() == 4 && x.is_none_or(|x| x.rank() == 3);
        // The rows' leading dims and a's width.
        let (lead, split) = if heads {
            (da[..2].to_vec(), da[2] * da[3])
        } else {
            let r = da.len().max(1);
            (da[..r - 1].to_vec(), da.last().copied().unwrap_or(0))
        };
        let rest = x.map_or(0, |x| x.dims().last().copied().unwrap_or(0));
        let cols = split + rest;
        let rows: usize = lead.iter().product();
        // The operands as the kernel reads them, where x's rows are a's on one device.
        let operands = if !lead.is_empty()
            && x.is_none_or(|x| {
                x.dims()[..x.rank().saturating_sub(1)] == lead[..] && x.device() == self.device()
            }) {
            let a2 = if heads {
                self.clone()
            } else {
                self.reshape((rows, split))?
            };
            let mut v = vec![a2];
            if let Some(x) = x {
                v.push(x.reshape((rows, rest))?);
            }
            Some(v)
        } else {
            None
        };
        let kernel = CatGeluTanh { code };
        // The kernel's own check says what it takes (its f64 form is the CPU reference's).
        let operands = operands.filter(|v| {
            let views: Vec<_> = v.iter().map(|t| (t.dtype(), t.layout())).collect();
            kernel.check(&views).is_ok() && !(self.dtype() == DType::F64 && self.device().is_cuda())
        });
        let mut shape = lead.clone();
        shape.push(cols);
        let Some(operands) = operands else {
            let mut flat = lead.clone();
            flat.push(split);
            let a = self.reshape(flat)?;
            let y = match x {
                Some(x) => Tensor::cat(&[&a, &x.gelu_tanh()?], lead.len())?,
                None => a,
            };
            let r8 = code.map(|c| Rows8::of(&y, c)).transpose()?;
            return Ok((y, r8));
        };
        let args: Vec<&Tensor> = operands.iter().collect();
        let mut o = run_kernel(&kernel, &args)?;
        let (y, rows8) = match code {
            Some(c) => {
                let (y, r8) = split_outputs(o, rows, cols, c, self)?;
                (y, Some(r8))
            }
            None => {
                let y = o.pop().ok_or_else(|| {
                    Error::invalid(CAT_GELU, "missing output", &Shape::from((rows, cols)))
                })?;
                (y, None)
            }
        };
        let mut inputs = vec![self];
        inputs.extend(x);
        let y = recorded(CatGeluTanh { code: None }, y, shape, &inputs, &[]);
        Ok((y, rows8))
    }
}
