//! Fused kernels, one file a kernel family: each kernel's operand check, its CPU reference and
//! CUDA launcher (`backend::Kernel`), for a kernel with a gradient that gradient and what it
//! keeps for it (`autograd::FusedKernel`), the `Tensor` methods that call them and the
//! composite twin, the reference the tests hold both backends to. A new kernel is its file
//! here, its CUDA source in `cuda/` (forward and backward in one .cu file), and, when it has a
//! gradient, one line in [`KERNELS`].
//!
//! - `attention.rs`: scaled dot-product attention (flash attention on CUDA) and its backward;
//! - `dequant_fp8.rs`: the FP8 E4M3 weight decode (no gradient);
//! - `dequant_ggml.rs`: the GGML block-quantized weight decode of GGUF files (no gradient);
//! - `fp8_products.rs`: 8-bit products: activations quantized a row at a time, FP8 codes
//!   transposed, and the scaled FP8 GEMM (no gradient; a Linear's backward calls them);
//! - `group_norm.rs`: GroupNorm and its backward;
//! - `modulate.rs`: adaLN modulation and its backward;
//! - `produce8.rs`: modulation, GELU and the concatenation [a, GELU(x)] writing their output's
//!   rows in 8-bit codes too, for the 8-bit products they feed (recorded as the producer; the
//!   codes are not), and the concatenation without codes (one pass for two);
//! - `norm.rs`: the LayerNorm / RMSNorm backwards with parameter gradients (their forward is a
//!   backend primitive);
//! - `rope.rs`: Flux's rotary position embedding, its backward the transposed rotation;
//! - `softmax.rs`: softmax's backward (its forward is a backend primitive);
//! - `swiglu.rs`: SwiGLU over a projection's two halves and its backward.

mod attention;
mod dequant_fp8;
mod dequant_ggml;
mod fp8_products;
mod group_norm;
mod modulate;
mod norm;
mod produce8;
mod rope;
mod softmax;
mod swiglu;

pub use attention::{scaled_dot_product_attention, CPU_COMPOSITE_SCORES};
pub use fp8_products::{fp8_product, product8, product8_bias};
pub use produce8::Rows8;

use crate::autograd::FusedKernel;

/// Every fused kernel with a gradient, one instance each: their names join the ops the
/// gradcheck suite must exercise (`autograd::differentiable_ops`). Backward-only kernels
/// (softmax's, the norms', attention's) and the FP8 and GGML decodes have none and are not listed.
pub(crate) const KERNELS: &[&dyn FusedKernel] = &[
    &modulate::Modulate,
    &produce8::CatGeluTanh { code: None },
    &swiglu::SwiGlu,
    &rope::Rope { transpose: false },
    &group_norm::GroupNorm {
        groups: 1,
        eps: 0.0,
        weight: false,
        bias: false,
    },
    &attention::Attention {
        causal: false,
        scale: 1.0,
        mask: false,
    },
];
