//! The CUDA backend through cudarc with dynamic loading: nothing links CUDA at build time, and
//! on a machine without a driver `CudaDevice::new` returns an error instead of panicking.
//! Kernels come from the PTX that build.rs embeds (one module per `cuda/*.cu`).

mod adafactor;
mod attention;
mod conv;
mod device;
mod dispatch;
mod fp8;
mod fp8_gemm;
mod fused;
mod ggml;
mod host;
mod index;
mod layout;
mod lion;
mod lt;
mod marks;
mod matmul;
mod memory;
mod multi;
mod norm;
mod prodigy;
mod reduce;
mod schedulefree;
mod storage;

pub(crate) mod ptx {
    /// An embedded kernel module: its PTX, which the driver compiles for the GPU at its
    /// first load on a machine, or a fat binary of that PTX and machine code for the GPUs
    /// `$FLAME_CUDA_SASS` named at build time (build.rs).
    // A build embeds one kind of image, or none without nvcc: the other goes unbuilt.
    #[allow(dead_code)]
    pub(crate) enum Image {
        Ptx(&'static str),
        Fatbin(&'static [u8]),
    }
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

pub use device::CudaDevice;
pub(crate) use device::SideWindow;
pub(crate) use host::{HostBuf, PinnedPack, Staging, Stall, Upload};
pub use memory::MemoryReport;

pub use storage::CudaStorage;

pub(crate) use fused::run_kernel;

/// What a fused kernel's CUDA implementation (`backend::Kernel::cuda`, in its file of
/// `tensor/kernels/`) builds on: the launch macro, element types, launch shapes, the
/// deterministic column sums the norms and modulation share, a buffer's address; and the
/// launchers that stay backend helpers: flash attention (`flash`, attention.rs), the FP8
/// decode, the 8-bit products' quantization (with the concatenation before Flux's `linear2`) and transpose (fp8.rs) and GEMM (fp8_gemm.rs), the GGML decode (`dequant_ggml`, ggml.rs), the norms' row kernels (norm.rs) and softmax's launch
/// shape.
pub(crate) mod kit {
    pub(crate) use super::attention::flash;
    pub(crate) use super::device::DONE_COUNTERS;
    pub(crate) use super::fp8::cat_gelu_rows;
    pub(crate) use super::fp8::dequant as dequant_fp8;
    pub(crate) use super::fp8::hadamard_rows;
    pub(crate) use super::fp8::quant_rows as quant_rows_fp8;
    pub(crate) use super::fp8::quant_rows_with as quant_rows_fp8_with;
    pub(crate) use super::fp8::transpose as transpose_fp8;
    pub(crate) use super::fp8_gemm::product as fp8_product;
    pub(crate) use super::fused::{cfg, colsum_shape, ptr, sum_parts, sweep};
    pub(crate) use super::ggml::dequant as dequant_ggml;
    pub(crate) use super::hopper_module;
    pub(crate) use super::layout::grid_for;
    pub(crate) use super::memory::DevBuf;
    pub(crate) use super::norm::{
        launch_bwd as norm_bwd, launch_bwd_bulk as norm_bwd_bulk, launch_bwd_sums as norm_bwd_sums,
        RowMap,
    };
    pub(crate) use super::storage::{by_dtype, launch, softmax_kernel, Elem};
}

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

/// The module of `stem` holding its Hopper-only kernels (`__CUDA_ARCH__ >= 900` paths) on a GPU
/// of compute capability 9 or more: `<stem>_sm90` where build.rs made one, `stem` itself when
/// the whole build targets compute_90 or later; `None` on older GPUs or when neither exists.
pub(crate) fn hopper_module(dev: &CudaDevice, stem: &'static str) -> Option<&'static str> {
    if dev.compute_capability_major() < 9 {
        return None;
    }
    let has = |name: &str| ptx::MODULES.iter().any(|(n, _)| *n == name);
    let variant = ptx::MODULES
        .iter()
        .map(|(n, _)| *n)
        .find(|n| n.strip_suffix("_sm90") == Some(stem));
    let digits: String = ptx::ARCH.chars().filter(char::is_ascii_digit).collect();
    let main_is_90 = digits.parse::<u32>().is_ok_and(|v| v >= 90);
    variant.or_else(|| (main_is_90 && has(stem)).then_some(stem))
}

/// The module `stem`, built for compute_90a only (build.rs), on a GPU of compute capability
/// 9.0, where PTX for sm_90a runs (it holds wgmma kernels); `None` elsewhere.
pub(crate) fn sm90a_module(dev: &CudaDevice, stem: &'static str) -> Option<&'static str> {
    let hopper = dev.compute_capability_major() == 9 && dev.compute_capability_minor() == 0;
    (hopper && ptx::MODULES.iter().any(|(n, _)| *n == stem)).then_some(stem)
}

/// Lets `name` of `module` take `bytes` of dynamic shared memory (past the default 48 KiB).
///
/// The limit is a property of the kernel, shared by every thread that launches it, so it is
/// only ever raised, and always to the same value (all the device allows beside the kernel's
/// static shared memory): setting it to each launch's own need let a launch with a smaller need
/// lower it under a concurrent one with a larger need (CUDA_ERROR_INVALID_VALUE at launch, seen
/// with the models tests running in parallel threads on one GPU).
pub(crate) fn allow_shared_memory(
    dev: &CudaDevice,
    module: &'static str,
    name: &str,
    bytes: usize,
) -> crate::Result<()> {
    use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    let f = dev.function(module, name)?;
    let attr = |a| {
        f.get_attribute(a)
            .map(|v| v.max(0) as usize)
            .map_err(|e| Error::Cuda(format!("{name}: reading {a:?}: {e:?}")))
    };
    // Once raised, one driver call a launch.
    if attr(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)? >= bytes {
        return Ok(());
    }
    let most = dev
        .max_shared_memory()
        .saturating_sub(attr(Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?);
    if bytes > most {
        return Err(Error::Cuda(format!(
            "{name}: {bytes} bytes of dynamic shared memory, more than the {most} the device allows it"
        )));
    }
    f.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        most as i32,
    )
    .map_err(|e| Error::Cuda(format!("{name}: {most} bytes of shared memory: {e:?}")))
}

/// How many blocks of `threads` threads and `smem` bytes of dynamic shared memory of `name` a
/// multiprocessor holds at once (at least 1), for grids sized to one wave.
pub(crate) fn resident_blocks(
    dev: &CudaDevice,
    module: &'static str,
    name: &str,
    threads: usize,
    smem: usize,
) -> crate::Result<usize> {
    let n = dev
        .function(module, name)?
        .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
        .map_err(|e| Error::Cuda(format!("occupancy of {name}: {e:?}")))?;
    Ok((n as usize).max(1))
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

/// 0: not decided yet (`FLAME_DETERMINISTIC` decides at first use), 1: off, 2: on.
static DETERMINISTIC: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Deterministic kernels on or off for this process (default: off, or on where the
/// environment has `FLAME_DETERMINISTIC=1`). On, attention's backward sums dQ over the key
/// blocks in a fixed order (each key block of a launch stores its part in an f32 slab of its
/// own, and the slabs are added in order to a running sum) instead of with atomic adds whose
/// order varies between runs, so a step's results are the same bits every time and a bf16
/// run on CUDA resumes exactly. The cost, on an H100: the Flux-dev LoRA step at 1024² 459 ms
/// against 418, its peak 0.45 GiB higher (slabs for 11 key blocks of 128 at a time, at most
/// about 512 MiB where that fills the GPU). Every other kernel is deterministic already.
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

/// Bytes the deterministic mode's attention backward holds beyond the atomic one's for one
/// call of `bh` batch x heads, `lq` queries and `lk` keys of width `d` on a GPU of `sms`
/// SMs (its dQ slabs and their running sum): what the memory planner adds where
/// [`deterministic`] is on.
pub fn deterministic_dq_bytes(bh: usize, lq: usize, lk: usize, d: usize, sms: usize) -> u64 {
    attention::deterministic_dq_bytes(bh, lq, lk, d, sms)
}

/// Whether deterministic kernels are on (see [`set_deterministic`]).
pub fn deterministic() -> bool {
    use std::sync::atomic::Ordering;
    match DETERMINISTIC.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("FLAME_DETERMINISTIC").is_ok_and(|v| v == "1");
            DETERMINISTIC.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// The number of GPUs the CUDA driver sees (an error without a driver).
pub fn device_count() -> crate::Result<usize> {
    if !driver_available() {
        return Err(Error::CudaUnavailable(
            "no CUDA driver (libcuda.so) on this machine".into(),
        ));
    }
    cudarc::driver::result::init().map_err(cuda_err("initialising the driver"))?;
    cudarc::driver::result::device::get_count()
        .map(|n| n as usize)
        .map_err(cuda_err("counting the GPUs"))
}

pub(crate) fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}
