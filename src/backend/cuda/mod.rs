//! The CUDA backend through cudarc with dynamic loading: nothing links CUDA at build time, and
//! on a machine without a driver `CudaDevice::new` returns an error instead of panicking.
//! Kernels come from the PTX that build.rs embeds (one module per `cuda/*.cu`).

mod attention;
mod conv;
mod device;
mod fused;
mod index;
mod layout;
mod matmul;
mod norm;
mod reduce;
mod storage;

pub(crate) mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

pub use device::{CudaDevice, MemoryReport};
pub use storage::CudaStorage;

use crate::Error;

/// How to get nvcc, for the error of a build without kernels.
pub(crate) const NVCC_HELP: &str = "install nvcc 13.0 (the CUDA toolkit, or: pip install \
nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 \
nvidia-cuda-cccl==13.0.85, then export CUDA_HOME=<site-packages>/nvidia/cu13), put it on PATH or set NVCC \
or CUDA_HOME, and rebuild";

/// Names of the embedded kernel modules (one per `cuda/*.cu`).
pub fn kernel_modules() -> impl Iterator<Item = &'static str> {
    ptx::MODULES.iter().map(|(n, _)| *n)
}

/// Whether build.rs compiled kernels into this build.
pub fn kernels_compiled() -> bool {
    ptx::MISSING.is_empty()
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen libcuda and drops the handle; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub(crate) fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}
