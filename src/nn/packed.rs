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
//! - GGML blocks (`backend::ggml`, a `.gguf` checkpoint): the file's blocks as stored,
//!   packed little end first into (words) u32; rows of whole blocks, in row order.

use crate::backend::ggml::GgmlType;
use crate::{DType, Result, Tensor};

/// How a packed weight is stored, and what decoding it needs besides its words.
#[derive(Clone, Debug)]
pub enum Packing {
    /// FP8 E4M3 codes (out, in / 4) u32 with one f32 scale a row.
    Fp8 {
        /// The per-output-channel scales (out).
        scale: Tensor,
        /// Whether the Linear's products run in 8 bits (`model.compute = "fp8"`, see
        /// `layers.rs`'s `fp8_matmul`) instead of decoding the weight for a GEMM in the
        /// activations' dtype.
        products: bool,
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
            Packing::Fp8 { scale, .. } => packed.dequant_fp8(scale, dtype),
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

    /// Its name in messages (`fp8`, `Q4_K`).
    pub fn name(&self) -> &'static str {
        match self {
            Packing::Fp8 { .. } => "fp8",
            Packing::Ggml { ty, .. } => ty.name(),
        }
    }
}

/// u32 words holding `bytes` bytes.
pub(crate) fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(4)
}
