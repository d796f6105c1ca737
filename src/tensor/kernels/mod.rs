//! Fused kernels, one file each: the kernel's operand check, its CPU reference and CUDA
//! launcher (`backend::Kernel`), its gradient and what it keeps for it
//! (`autograd::FusedKernel`), the `Tensor` method that calls it and its composite twin, the
//! reference the tests hold both backends to. A new kernel is its file here, its CUDA source
//! in `cuda/` (forward and backward in one .cu file), and one line in [`KERNELS`].

mod group_norm;
mod modulate;
mod rope;

use crate::autograd::FusedKernel;

/// Every fused kernel with a gradient, one instance each: their names join the ops the
/// gradcheck suite must exercise (`autograd::differentiable_ops`).
pub(crate) const KERNELS: &[&dyn FusedKernel] = &[
    &modulate::Modulate,
    &rope::Rope { transpose: false },
    &group_norm::GroupNorm {
        groups: 1,
        eps: 0.0,
        weight: false,
        bias: false,
    },
];
