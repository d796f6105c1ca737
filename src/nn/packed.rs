//! Packed base weights: a frozen Linear weight kept in a compact storage format and decoded
//! into the compute dtype at each use (each matmul and its backward), never kept decoded.
//! The format is data ([`Packing`]); the Linear's one packed path (`layers.rs`,
//! `packed_matmul`) and the loader, the streamer and the planner treat every format alike:
//! the packed tensors are ordinary u32 tensors (FLAME has no u8 dtype), loaded, placed in
//! host memory and streamed as any other weight, and counted at their packed size.
//!
//! - FP8 E4M3 (`backend::fp8`, `model.dtype = "fp8"`): codes (out, in / 4) u32, four a word,
//!   and per-row f32 scales (out), quantized from a float checkpoint at load. With 8-bit
//!   products (`model.compute = "fp8"`) the weight is never decoded: the activations are
//!   quantized a token at a time and the GEMM runs on FP8 tensor cores.
//! - int8 (`backend::int8`, `model.compute = "int8"`): the same packing and scales, codes
//!   symmetric integers, the products on integer tensor cores (`Packing::Fp8`'s `code`).
//! - GGML blocks (`backend::ggml`, a `.gguf` checkpoint): the file's blocks as stored,
//!   packed little end first into (words) u32; rows of whole blocks, in row order.

use crate::backend::ggml::GgmlType;
use crate::{DType, Device, Result, Tensor};
use std::sync::{Arc, OnceLock};

/// How a packed weight is stored, and what decoding it needs besides its words.
#[derive(Clone, Debug)]
pub enum Packing {
    /// 8-bit codes (out, in / 4) u32 with one f32 scale a row: FP8 E4M3, or int8 (`code`).
    Fp8 {
        /// The per-output-channel scales (out).
        scale: Tensor,
        /// The codes' format.
        code: crate::backend::fp8::Code8,
        /// The block of the Hadamard rotation along the input axis (`backend::int8`: the
        /// codes are those of W H, and each product rotates its input the same way), or 0.
        rotation: usize,
        /// Whether the Linear's products run in 8 bits (`model.compute = "fp8"` or "int8", see
        /// `layers.rs`'s `packed_matmul`) instead of decoding the weight for a GEMM in the
        /// activations' dtype.
        products: bool,
        /// What the 8-bit backward keeps of the weight between calls (its transposed codes
        /// where the weight stays on the device); shared by the clones of this packing.
        kept: Fp8Kept,
    },
    /// GGML blocks of one type, (words) u32.
    Ggml {
        /// The blocks' type.
        ty: GgmlType,
        /// The weight's (out, in).
        dims: (usize, usize),
    },
}

impl Packing {
    /// The weight (out, in) that `packed` (the words) stands for, decoded into `dtype`.
    pub fn decode(&self, packed: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Packing::Fp8 {
                scale,
                code,
                rotation,
                ..
            } => {
                let w = packed.dequant8(*code, scale, dtype)?;
                // W H H = W: the rotation is its own inverse.
                match *rotation {
                    0 => Ok(w),
                    b => w.hadamard_rows(b),
                }
            }
            Packing::Ggml { ty, dims } => packed.dequant_ggml(*ty, dims.0, dims.1, dtype),
        }
    }

    /// The weight's (out, in), `packed` being its words.
    pub fn dims(&self, packed: &Tensor) -> (usize, usize) {
        match self {
            Packing::Fp8 { .. } => {
                let d = packed.dims();
                (
                    d.first().copied().unwrap_or(0),
                    d.get(1).copied().unwrap_or(0) * crate::backend::fp8::CODES_PER_WORD,
                )
            }
            Packing::Ggml { dims, .. } => *dims,
        }
    }

    /// The tensors decoding reads besides the words (the FP8 scales).
    pub fn side_tensors(&self) -> Option<&Tensor> {
        match self {
            Packing::Fp8 { scale, .. } => Some(scale),
            Packing::Ggml { .. } => None,
        }
    }

    /// Whether its 8-bit products add a frozen bias in their own pass (int8's scale the sums in
    /// a pass of their own, which adds the bias too; the scaled FP8 GEMM does not).
    pub fn fuses_bias(&self) -> bool {
        matches!(
            self,
            Packing::Fp8 {
                code: crate::backend::fp8::Code8::Int8,
                products: true,
                ..
            }
        )
    }

    /// Its name in messages (`fp8`, `Q4_K`).
    pub fn name(&self) -> &'static str {
        match self {
            Packing::Fp8 { code, .. } => code.name(),
            Packing::Ggml { ty, .. } => ty.name(),
        }
    }
}

/// What the backward of an FP8 weight with 8-bit products (dx = dy W) keeps between calls,
/// the weight being frozen:
///
/// - its transposed codes (in, out / 4) u32 (`Tensor::transpose_fp8`), made at the first
///   backward and kept as long as the weight, but only for a weight that stays on the device
///   ([`Fp8Kept::resident`]): a streamed weight's buffer leaves the device with its block
///   (`memory::BlockStreamer`), and a kept transpose would hold as many bytes again there,
///   so its backward transposes the codes each time ([`Fp8Kept::streamed`]);
/// - the all-ones column scale (in) f32 of that transposed product (the weight's row scales
///   are folded into dy), made once for any weight: 4 bytes a column.
///
/// A resident weight's kept transpose doubles its device bytes once it has run a backward;
/// the memory planner counts it (`BlockCost::kept_bytes`, `models::family`).
#[derive(Clone, Debug, Default)]
pub struct Fp8Kept(Arc<KeptParts>);

#[derive(Debug, Default)]
struct KeptParts {
    /// Whether the transposed codes are kept (a resident weight).
    keep_transpose: bool,
    transposed: OnceLock<Tensor>,
    ones: OnceLock<Tensor>,
}

impl Fp8Kept {
    /// For a weight that stays on the device: its transposed codes are kept.
    pub fn resident() -> Self {
        Fp8Kept(Arc::new(KeptParts {
            keep_transpose: true,
            ..KeptParts::default()
        }))
    }

    /// For a weight whose buffer may leave the device (a streamed block's): its transposed
    /// codes are made at each backward and dropped after it.
    pub fn streamed() -> Self {
        Fp8Kept::default()
    }

    /// Whether the transposed codes are kept.
    pub fn keeps_transpose(&self) -> bool {
        self.0.keep_transpose
    }

    /// The codes (in, out / 4) of `packed` (out, in / 4) transposed: the kept ones, made now
    /// on the first call, where they are kept, else made for this call. `packed` must be the
    /// weight this was made for.
    pub fn transposed(&self, packed: &Tensor) -> Result<Tensor> {
        if !self.0.keep_transpose {
            return packed.transpose_fp8();
        }
        if let Some(t) = self.0.transposed.get() {
            return Ok(t.clone());
        }
        let t = packed.transpose_fp8()?;
        // Two threads may both make it: the values are the same, the first is kept.
        Ok(self.0.transposed.get_or_init(|| t).clone())
    }

    /// The kept transposed codes, if made.
    pub fn kept_transpose(&self) -> Option<&Tensor> {
        self.0.transposed.get()
    }

    /// `n` ones (f32) on `device`, made on the first call; an error if a call asks for
    /// another length or device than the first.
    pub fn ones(&self, n: usize, device: &Device) -> Result<Tensor> {
        if self.0.ones.get().is_none() {
            let t = Tensor::ones(n, DType::F32, device)?;
            let _ = self.0.ones.set(t);
        }
        match self.0.ones.get() {
            Some(t) if t.dims() == [n] && t.device() == device => Ok(t.clone()),
            Some(t) => Err(crate::Error::ShapeMismatch {
                op: "fp8 backward ones",
                lhs: t.shape().clone(),
                rhs: crate::Shape::from(n),
            }),
            None => Err(crate::Error::Autograd(
                "fp8 backward: the column scale was not made".into(),
            )),
        }
    }
}

/// Whether an (out, in) 8-bit weight's widths let its products run in 8 bits: FP8 and int8
/// tensor cores take multiples of 16 in both directions (the forward's and the backward's
/// products).
pub(crate) fn eight_bit_widths(out: usize, inp: usize) -> bool {
    out % 16 == 0 && inp % 16 == 0
}

/// The rows a Linear's products see in a run, by the weight's model key (`None`: not known,
/// a weight outside the blocks the run's shapes describe): what decides where 8-bit products
/// pay (`products_pay`). Made by `models::product_rows` from the run's shapes.
pub type ProductRows = std::sync::Arc<dyn Fn(&str) -> Option<usize> + Send + Sync>;

/// Multiply-adds a product needs before its 8-bit form pays for its extra passes (the
/// activations' quantization, the output's scaling), whatever its size: measured by
/// `examples/product8_sizes.rs` on an NVIDIA H200 (2026-12-01), a frozen Linear's forward and
/// input gradient against bf16: FP8 0.95x at 13.4 G and 26.2 G, 0.87x at 38.7 G; int8 0.97x
/// at 38.7 G, slower below.
fn min_eight_bit_macs(code: crate::backend::fp8::Code8) -> f64 {
    match code {
        crate::backend::fp8::Code8::E4m3 => 12e9,
        crate::backend::fp8::Code8::Int8 => 35e9,
    }
}

/// Whether the (out, in) Linear of model key `key` runs its products in `code`: where `rule`
/// gives its rows, those whose products pay: large enough (at least `min_eight_bit_macs`), or
/// over few rows (`autograd::FEW_ROWS`: a modulation's, which reads its weight more than it
/// computes, and reads half the bytes in 8 bits); without a rule, or for a key it does not
/// know, every one (the widths are checked apart, `eight_bit_widths`). One rule for the
/// loader (`VarBuilder::with_product_rows`) and the planner's profile.
pub fn products_pay(
    rule: Option<&ProductRows>,
    key: &str,
    code: crate::backend::fp8::Code8,
    (out, inp): (usize, usize),
) -> bool {
    match rule.and_then(|rows| rows(key)) {
        None => true,
        Some(r) => {
            r * crate::autograd::FEW_ROWS <= inp
                || r as f64 * out as f64 * inp as f64 >= min_eight_bit_macs(code)
        }
    }
}

/// u32 words holding `bytes` bytes.
pub(crate) fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(4)
}
