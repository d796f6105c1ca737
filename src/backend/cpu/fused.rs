//! The common part of every fused kernel on the CPU (`backend::Kernel`): the views checked,
//! then the kernel's check and its reference implementation, which reads its operands as f64
//! views (`f64_view`), computes in f64 and rounds once to each output's dtype. The kernels'
//! own references are in their files of `tensor/kernels/`; they are what the CUDA kernels are
//! tested against, and the composite twins in `Tensor` are the reference of both.

use super::strided;
use crate::{CpuStorage, Layout, Result};

/// The view `l` of `s` as contiguous f64 values (what a kernel's reference computes from).
pub(crate) fn f64_view(s: &CpuStorage, l: &Layout) -> Vec<f64> {
    fn conv<T: crate::WithDType>(v: &[T], l: &Layout) -> Vec<f64> {
        strided::contiguous(v, l)
            .iter()
            .map(|x| x.to_f64())
            .collect()
    }
    match s {
        CpuStorage::F32(v) => conv(v, l),
        CpuStorage::F64(v) => conv(v, l),
        CpuStorage::BF16(v) => conv(v, l),
        CpuStorage::F16(v) => conv(v, l),
        CpuStorage::U32(v) => conv(v, l),
    }
}

/// Runs kernel `k` (see `backend::Kernel`): the views checked, then its check, then its
/// reference implementation.
pub(crate) fn run_kernel(
    k: &dyn crate::backend::Kernel,
    args: &[(&CpuStorage, &Layout)],
) -> Result<Vec<CpuStorage>> {
    for (s, l) in args {
        super::check_view(k.name(), s, l)?;
    }
    let metas: Vec<_> = args.iter().map(|(s, l)| (s.dtype(), *l)).collect();
    let dims = k.check(&metas)?;
    k.cpu(&dims, args)
}
