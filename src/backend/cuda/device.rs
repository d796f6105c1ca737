//! The CUDA device: one context and stream per GPU (shared by every handle to that ordinal),
//! kernels loaded once from the embedded PTX, cuBLAS, and memory accounting.
//!
//! Memory comes from the driver's stream-ordered pool (cuMemAllocAsync; cudarc uses it when
//! the device supports it). Its release threshold is raised to "never", so memory freed by a
//! dropped tensor stays in the pool and the next allocation of a training step reuses it
//! instead of asking the driver. FLAME counts the bytes of every live buffer: in use, peak,
//! and a hard limit (FLAME_GPU_MEMORY_LIMIT in bytes, or `set_memory_limit`) checked before
//! each allocation, so a run can prove it fits a smaller card.

use super::{cuda_err, ptx, NVCC_HELP};
use crate::{Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Byte counters of one device.
#[derive(Debug, Default)]
pub struct MemoryStats {
    in_use: AtomicU64,
    peak: AtomicU64,
    limit: AtomicU64,
    allocations: AtomicU64,
}

/// A snapshot of a device's memory accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes held by live FLAME buffers.
    pub in_use: u64,
    /// Largest `in_use` since the device opened or the last `reset_peak_memory`.
    pub peak: u64,
    /// The hard limit (u64::MAX: none).
    pub limit: u64,
    /// Buffers allocated so far (a steady training step adds a fixed number per step).
    pub allocations: u64,
}

/// Returns its bytes to the count when the buffer it rides with is dropped.
pub(crate) struct Ticket {
    bytes: u64,
    stats: Arc<MemoryStats>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.stats.in_use.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Device memory of `len` elements with its accounting ticket.
pub(crate) struct DevBuf<T> {
    pub(crate) slice: CudaSlice<T>,
    _ticket: Ticket,
}

impl<T> DevBuf<T> {
    pub(crate) fn len(&self) -> usize {
        self.slice.len()
    }
}

impl<T: DeviceRepr> DevBuf<T> {
    /// The raw device address, for kernel parameter structs (event tracking is off, so
    /// cudarc's guard has nothing to record).
    pub(crate) fn raw(&self, dev: &CudaDevice) -> u64 {
        use cudarc::driver::DevicePtr;
        self.slice.device_ptr(dev.stream()).0
    }
}

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    sm_count: usize,
    /// The compute capability's major version (9 for Hopper).
    cc_major: u32,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    mem: Arc<MemoryStats>,
}

/// One GPU. Cheap to clone; `CudaDevice::new(i)` returns the same device for the same `i`.
#[derive(Clone)]
pub struct CudaDevice(Arc<Inner>);

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.0.ordinal)
    }
}

impl PartialEq for CudaDevice {
    fn eq(&self, other: &Self) -> bool {
        self.0.ordinal == other.0.ordinal
    }
}
impl Eq for CudaDevice {}

fn limit_from_env() -> Result<u64> {
    match std::env::var("FLAME_GPU_MEMORY_LIMIT") {
        Err(_) => Ok(u64::MAX),
        Ok(v) => v.trim().parse::<u64>().map_err(|_| {
            Error::CudaUnavailable(format!("FLAME_GPU_MEMORY_LIMIT={v:?} is not a byte count"))
        }),
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (once; later calls return the same device). Errors, never panics,
    /// when the kernels were not compiled, the driver is missing, or the GPU cannot be opened.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        static OPEN: OnceLock<Mutex<HashMap<usize, CudaDevice>>> = OnceLock::new();
        let open = OPEN.get_or_init(Default::default);
        let mut open = open
            .lock()
            .map_err(|_| Error::Poisoned("CUDA device table"))?;
        if let Some(d) = open.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Self::open(ordinal)?;
        open.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        if !super::kernels_compiled() {
            return Err(Error::CudaUnavailable(format!(
                "{}; {NVCC_HELP}",
                ptx::MISSING
            )));
        }
        if !super::driver_available() {
            return Err(Error::CudaUnavailable(
                "the NVIDIA driver library (libcuda) was not found on this machine".into(),
            ));
        }
        let limit = limit_from_env()?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::CudaUnavailable(format!("opening GPU {ordinal}: {e:?}")))?;
        // One stream orders all of FLAME's work: cudarc's per-buffer events are not needed.
        // SAFETY: every buffer of this context is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Cuda(format!("creating cuBLAS: {e:?}")))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("reading the SM count"))? as usize;
        let cc_major = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(cuda_err("reading the compute capability"))? as u32;
        keep_freed_memory_pooled(&ctx, ordinal)?;
        let mem = Arc::new(MemoryStats::default());
        mem.limit.store(limit, Ordering::Relaxed);
        Ok(CudaDevice(Arc::new(Inner {
            ordinal,
            ctx,
            stream,
            blas,
            sm_count,
            cc_major,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            mem,
        })))
    }

    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.0.stream
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.0.blas
    }

    pub(crate) fn sm_count(&self) -> usize {
        self.0.sm_count
    }

    /// The compute capability's major version (8 Ampere/Ada, 9 Hopper).
    pub fn compute_capability_major(&self) -> u32 {
        self.0.cc_major
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.0
            .stream
            .synchronize()
            .map_err(cuda_err("synchronizing"))
    }

    // ----- memory -------------------------------------------------------------------------

    pub fn memory(&self) -> MemoryReport {
        let m = &self.0.mem;
        MemoryReport {
            in_use: m.in_use.load(Ordering::Relaxed),
            peak: m.peak.load(Ordering::Relaxed),
            limit: m.limit.load(Ordering::Relaxed),
            allocations: m.allocations.load(Ordering::Relaxed),
        }
    }

    /// Makes the peak equal to what is in use now.
    pub fn reset_peak_memory(&self) {
        let m = &self.0.mem;
        m.peak
            .store(m.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// A hard cap on the bytes FLAME holds on this device (None: no cap).
    pub fn set_memory_limit(&self, bytes: Option<u64>) {
        self.0
            .mem
            .limit
            .store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Uninitialised device memory for `len` elements, counted against the limit.
    pub(crate) fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DevBuf<T>> {
        let bytes = (len.max(1) * std::mem::size_of::<T>()) as u64;
        let m = &self.0.mem;
        let limit = m.limit.load(Ordering::Relaxed);
        let in_use = m.in_use.fetch_add(bytes, Ordering::Relaxed);
        let oom = |in_use: u64, limit: u64| Error::OutOfMemory {
            device: format!("cuda:{}", self.0.ordinal),
            requested: bytes,
            in_use,
            limit,
        };
        let ticket = Ticket {
            bytes,
            stats: m.clone(),
        };
        if in_use.saturating_add(bytes) > limit {
            return Err(oom(in_use, limit));
        }
        // SAFETY: callers write every element before reading it (kernels fill outputs whole).
        let slice = match unsafe { self.0.stream.alloc::<T>(len.max(1)) } {
            Ok(s) => s,
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(oom(in_use, self.total_memory().unwrap_or(u64::MAX)))
            }
            Err(e) => return Err(Error::Cuda(format!("allocating {bytes} bytes: {e:?}"))),
        };
        m.peak.fetch_max(in_use + bytes, Ordering::Relaxed);
        m.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(DevBuf {
            slice,
            _ticket: ticket,
        })
    }

    /// The GPU's total memory in bytes.
    pub fn total_memory(&self) -> Result<u64> {
        let (mut free, mut total) = (0usize, 0usize);
        self.0
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        // SAFETY: plain out-parameters.
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        if r != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(Error::Cuda(format!("cuMemGetInfo: {r:?}")));
        }
        Ok(total as u64)
    }

    /// Bytes the driver's pool holds for this device (in use plus cached for reuse).
    pub fn pool_reserved_bytes(&self) -> Result<u64> {
        pool_attribute(
            self.0.ordinal,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )
    }

    // ----- kernels ------------------------------------------------------------------------

    /// A kernel from an embedded module; the module is JIT-loaded once, the handle cached.
    pub fn function(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let key = format!("{module}/{name}");
        let mut fns = self
            .0
            .functions
            .lock()
            .map_err(|_| Error::Poisoned("CUDA function cache"))?;
        if let Some(f) = fns.get(&key) {
            return Ok(f.clone());
        }
        let m = {
            let mut cache = self
                .0
                .modules
                .lock()
                .map_err(|_| Error::Poisoned("CUDA module cache"))?;
            match cache.get(module) {
                Some(m) => m.clone(),
                None => {
                    let src = ptx::MODULES
                        .iter()
                        .find(|(n, _)| *n == module)
                        .map(|(_, s)| *s)
                        .ok_or_else(|| {
                            Error::Cuda(format!("no embedded kernel module '{module}'"))
                        })?;
                    let m = self
                        .0
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_src(src))
                        .map_err(cuda_err(&format!("loading module '{module}'")))?;
                    cache.insert(module, m.clone());
                    m
                }
            }
        };
        let f = m
            .load_function(name)
            .map_err(cuda_err(&format!("kernel '{name}' in module '{module}'")))?;
        fns.insert(key, f.clone());
        Ok(f)
    }
}

fn default_pool(ordinal: usize) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-parameter; ordinal was opened by CudaContext::new, so it is valid.
    let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal as sys::CUdevice) };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(format!("cuDeviceGetDefaultMemPool: {r:?}")));
    }
    Ok(pool)
}

fn pool_attribute(ordinal: usize, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let pool = default_pool(ordinal)?;
    let mut v: u64 = 0;
    // SAFETY: the reserved/used attributes are cuuint64_t out-parameters.
    let r = unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
    };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(format!("cuMemPoolGetAttribute: {r:?}")));
    }
    Ok(v)
}

/// Freed memory stays in the pool instead of going back to the driver at each sync.
fn keep_freed_memory_pooled(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(cuda_err("binding the context"))?;
    let pool = default_pool(ordinal)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD takes a cuuint64_t.
    let r = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
    };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(format!(
            "setting the pool's release threshold: {r:?}"
        )));
    }
    Ok(())
}
