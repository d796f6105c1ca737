//! The CUDA device through cudarc with dynamic loading: nothing links CUDA at build time, and
//! on a machine without a driver `CudaDevice::new` returns an error instead of panicking.
//! Kernels come from the PTX that build.rs embeds; each module is loaded once per device.
//!
//! Status: device creation, module loading, buffers and the fill kernel. Tensors on CUDA (the
//! Backend implementation) are absent: see the README's status table.

mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

use crate::{CpuStorage, DType, Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How to get nvcc, for the error of a build without kernels.
const NVCC_HELP: &str = "install nvcc 13.0 (the CUDA toolkit, or: pip install nvidia-cuda-nvcc==13.0.88 \
nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85, \
then export CUDA_HOME=<site-packages>/nvidia/cu13), put it on PATH or set NVCC or CUDA_HOME, and rebuild";

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

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}

/// One GPU: a context, the stream FLAME's work is ordered on, and the loaded modules.
#[derive(Clone)]
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Arc<Mutex<HashMap<&'static str, Arc<CudaModule>>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

/// Device memory of one dtype.
pub enum CudaBuffer {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
    U32(CudaSlice<u32>),
}

impl CudaDevice {
    /// Opens GPU `ordinal`. Errors (never panics) when kernels were not compiled, the driver
    /// is missing, or the GPU cannot be opened.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        if !kernels_compiled() {
            return Err(Error::CudaUnavailable(format!(
                "{}; {NVCC_HELP}",
                ptx::MISSING
            )));
        }
        if !driver_available() {
            return Err(Error::CudaUnavailable(
                "the NVIDIA driver library (libcuda) was not found on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::CudaUnavailable(format!("opening GPU {ordinal}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            modules: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A kernel from an embedded module; the module is loaded (JIT-compiled) on first use.
    pub fn function(&self, module: &str, name: &str) -> Result<CudaFunction> {
        let m = {
            let mut cache = self
                .modules
                .lock()
                .map_err(|_| Error::Poisoned("CUDA module cache"))?;
            let (key, src) = ptx::MODULES
                .iter()
                .find(|(n, _)| *n == module)
                .ok_or_else(|| Error::Cuda(format!("no embedded kernel module '{module}'")))?;
            match cache.get(key) {
                Some(m) => m.clone(),
                None => {
                    let m = self
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_src(*src))
                        .map_err(cuda_err(&format!("loading module '{module}'")))?;
                    cache.insert(key, m.clone());
                    m
                }
            }
        };
        m.load_function(name)
            .map_err(cuda_err(&format!("kernel '{name}' in module '{module}'")))
    }

    /// `n` elements of `dtype`, all `value` (the `fill` kernels).
    pub fn full(&self, n: usize, dtype: DType, value: f64) -> Result<CudaBuffer> {
        let what = format!("allocating {n} x {dtype}");
        let err = cuda_err(&what);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        macro_rules! fill {
            ($t:ty, $variant:ident, $kernel:literal) => {{
                // SAFETY: the buffer is only written by the kernel below before use.
                let mut buf = unsafe { self.stream.alloc::<$t>(n) }.map_err(&err)?;
                let f = self.function("fill", $kernel)?;
                // SAFETY: fill_* takes (T* out, double value, size_t n) and writes out[0..n),
                // which `buf` holds.
                unsafe {
                    self.stream
                        .launch_builder(&f)
                        .arg(&mut buf)
                        .arg(&value)
                        .arg(&n)
                        .launch(cfg)
                }
                .map_err(cuda_err(concat!("launching ", $kernel)))?;
                CudaBuffer::$variant(buf)
            }};
        }
        Ok(match dtype {
            DType::F32 => fill!(f32, F32, "fill_f32"),
            DType::F64 => fill!(f64, F64, "fill_f64"),
            DType::BF16 => fill!(bf16, BF16, "fill_bf16"),
            DType::F16 => fill!(f16, F16, "fill_f16"),
            DType::U32 => fill!(u32, U32, "fill_u32"),
        })
    }

    /// Copies a buffer to the host (waits for the stream).
    pub fn to_host(&self, buf: &CudaBuffer) -> Result<CpuStorage> {
        let err = cuda_err("copying to the host");
        Ok(match buf {
            CudaBuffer::F32(b) => CpuStorage::F32(self.stream.clone_dtoh(b).map_err(err)?),
            CudaBuffer::F64(b) => CpuStorage::F64(self.stream.clone_dtoh(b).map_err(err)?),
            CudaBuffer::BF16(b) => CpuStorage::BF16(self.stream.clone_dtoh(b).map_err(err)?),
            CudaBuffer::F16(b) => CpuStorage::F16(self.stream.clone_dtoh(b).map_err(err)?),
            CudaBuffer::U32(b) => CpuStorage::U32(self.stream.clone_dtoh(b).map_err(err)?),
        })
    }
}
