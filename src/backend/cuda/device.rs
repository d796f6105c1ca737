//! The CUDA device: one context and stream per GPU (shared by every handle to that ordinal),
//! kernels loaded once from the embedded PTX, cuBLAS, and memory accounting.
//!
//! Memory comes from FLAME's cache of freed buffers (memory.rs) in front of the driver's
//! stream-ordered pool (cuMemAllocAsync; cudarc uses it when the device supports it), whose
//! release threshold is raised to "never", so memory the cache gives back stays pooled too.

use super::memory::{pool_reserved, trim_pool, DevBuf, MemoryReport, Pool};
use super::{cuda_err, ptx, NVCC_HELP};
use crate::{Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    /// The driver's free bytes once the context was made: what this process took since is
    /// `start_free` less the free bytes now.
    start_free: u64,
    /// The bytes a context of this device takes (measured on a second context made and
    /// destroyed at start), which `start_free` already lacks.
    context_bytes: u64,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLASLt's handle and workspace, for the GEMMs with a bias epilogue and the FP8
    /// GEMMs; made on first use (the workspace comes from the driver, outside FLAME's pool).
    lt: OnceLock<super::lt::Lt>,
    sm_count: usize,
    /// The compute capability's major version (9 for Hopper).
    cc_major: u32,
    cc_minor: u32,
    /// The most shared memory a block may opt into (bytes, static and dynamic together).
    smem_optin: usize,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Each module loaded so far and the seconds its load took (`module_loads`).
    module_loads: Mutex<Vec<(&'static str, f64)>>,
    functions: RwLock<HashMap<&'static str, HashMap<String, CudaFunction>>>,
    /// Clusters of a kernel resident at once, by (module/name, threads, dynamic shared bytes).
    clusters: Mutex<HashMap<(String, u32, u32), usize>>,
    mem: Arc<Pool>,
    /// `DONE_COUNTERS` u32s that are zero between kernels: "last block done" counts (a grid's,
    /// or one per column tile), which the kernel that counts on them sets back to zero (work
    /// on the one stream never overlaps).
    done: OnceLock<CudaSlice<u32>>,
    /// Events without timing free to be recorded again (marks.rs): the uploads' ordering
    /// between the copy, decode and compute streams.
    marks: Arc<super::marks::Marks>,
    /// The stream of streaming copies (host.rs), made on first use.
    copy: OnceLock<Arc<CudaStream>>,
    /// The stream that decodes staged uploads into place (host.rs), made on first use.
    decode: OnceLock<Arc<CudaStream>>,
    /// The stream of offloaded activations' copies (host.rs), made on first use: apart from
    /// the weights' copies, so the compute never waits behind weights prefetched ahead.
    offload: OnceLock<Arc<CudaStream>>,
    /// The stream of collectives over NCCL (`dist`), made on first use: gradient buckets
    /// are summed there while the backward goes on.
    comm: OnceLock<Arc<CudaStream>>,
    /// What the process held outside FLAME's allocator when a budget was first split on
    /// this device (`CudaDevice::held_for_budget`).
    budget_held: Mutex<Option<u64>>,
    /// A lower figure for what the process could hold at start, in place of this device's
    /// own (`limit_memory_at_start`: what data-parallel ranks agreed on, or a resumed run's
    /// record).
    agreed_at_start: Mutex<Option<u64>>,
    /// The second compute stream that checkpoints' re-runs issued ahead run on, beside the
    /// backward (`CudaDevice::side_window`), with its own cuBLAS handles and completion
    /// counters; made on first use.
    side: OnceLock<Side>,
    /// Whether re-runs issued ahead may take the side stream (`set_side_stream`; off until
    /// set).
    side_on: std::sync::atomic::AtomicBool,
    /// Whether f32 matmuls may use TF32 (`set_allow_tf32`), for the side's cuBLAS handle.
    tf32: std::sync::atomic::AtomicBool,
    /// The page-locked buffers that loads from files cross through (`load_bytes`, host.rs),
    /// made on the first large load.
    loads: Mutex<Option<LoadRing>>,
}

/// A window of work on the side stream (`CudaDevice::side_window`): `run` issues the work
/// there; dropping it makes the compute stream wait for the window's end, after which what
/// the side stream's work freed is the compute stream's to reuse. Drop it before the compute
/// stream reads or frees anything the work made.
pub(crate) struct SideWindow {
    dev: CudaDevice,
    /// The window's end on the side stream, once `run` has issued its work.
    end: Option<cudarc::driver::CudaEvent>,
}

impl SideWindow {
    /// Issues `f`'s work on the side stream from this thread (its kernels, GEMMs and
    /// buffers); once per window. The buffers `f` drops before it returns are the side's.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce() -> R) -> Result<R> {
        if self.end.is_some() {
            return Err(Error::Cuda("a side window runs one piece of work".into()));
        }
        // Back to the compute stream however `f` ends (a panic on the helper thread is
        // caught there, and the thread goes on).
        struct Back(bool);
        impl Drop for Back {
            fn drop(&mut self) {
                super::memory::set_on_side(self.0);
            }
        }
        let r = {
            let _back = Back(super::memory::set_on_side(true));
            f()
        };
        self.end = Some(self.dev.0.mem.side_close()?);
        Ok(r)
    }
}

impl Drop for SideWindow {
    fn drop(&mut self) {
        let end = match self.end.take() {
            Some(e) => Some(e),
            None => self.dev.0.mem.side_close().ok(),
        };
        if let Some(e) = end {
            // An error here leaves the window's frees unsettled: kept from the compute
            // stream, never handed to it early.
            let _ = self.dev.0.mem.side_settle(&e);
        }
    }
}

/// The side stream and what its work needs of its own: kernels on two streams at once may
/// not share a cuBLAS handle's stream, a cuBLASLt workspace or the completion counters.
struct Side {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    lt: OnceLock<super::lt::Lt>,
    done: OnceLock<CudaSlice<u32>>,
}

/// How many completion counters `CudaDevice::done_counters` holds (16 KiB).
pub(crate) const DONE_COUNTERS: usize = 4096;

/// The page-locked buffers loads from files cross through (`CudaDevice::load_bytes`,
/// host.rs), with each one's last copy to the device.
pub(crate) struct LoadRing {
    pub(crate) bufs: Vec<cudarc::driver::PinnedHostSlice<u8>>,
    /// The event after each buffer's last copy to the device, until the host fills it again.
    pub(crate) done: Vec<Option<cudarc::driver::CudaEvent>>,
    /// The buffer the next piece takes.
    pub(crate) next: usize,
}

impl Drop for LoadRing {
    /// Waits for the buffers' last copies before their memory is freed (cudarc's free waits
    /// on its own event only).
    fn drop(&mut self) {
        for e in self.done.iter().flatten() {
            let _ = e.synchronize();
        }
    }
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
        ctx.bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        ctx.set_limit(sys::CUlimit::CU_LIMIT_STACK_SIZE, STACK_BYTES)
            .map_err(cuda_err("setting the threads' stack size"))?;
        let start_free = driver_free()?;
        let context_bytes = context_cost(ordinal, start_free);
        ctx.bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
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
        let cc_minor = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(cuda_err("reading the compute capability"))? as u32;
        let smem_optin =
            ctx.attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(cuda_err("reading the shared memory a block may use"))? as usize;
        let mem = Arc::new(Pool::new(ordinal, stream.clone(), limit));
        mem.apply_release_threshold()?;
        let marks = super::marks::Marks::new(ctx.clone());
        Ok(CudaDevice(Arc::new(Inner {
            ordinal,
            ctx,
            start_free,
            context_bytes,
            stream,
            blas,
            lt: OnceLock::new(),
            sm_count,
            cc_major,
            cc_minor,
            smem_optin,
            modules: Mutex::new(HashMap::new()),
            module_loads: Mutex::new(Vec::new()),
            functions: RwLock::new(HashMap::new()),
            clusters: Mutex::new(HashMap::new()),
            mem,
            done: OnceLock::new(),
            marks,
            copy: OnceLock::new(),
            decode: OnceLock::new(),
            offload: OnceLock::new(),
            comm: OnceLock::new(),
            budget_held: Mutex::new(None),
            agreed_at_start: Mutex::new(None),
            side: OnceLock::new(),
            side_on: std::sync::atomic::AtomicBool::new(false),
            tf32: std::sync::atomic::AtomicBool::new(false),
            loads: Mutex::new(None),
        })))
    }

    /// The GPU's name as the driver gives it ("NVIDIA H100 80GB HBM3").
    pub fn name(&self) -> Result<String> {
        self.0
            .ctx
            .name()
            .map_err(cuda_err("reading the GPU's name"))
    }

    /// The GPU's index among the visible devices (the N of `cuda:N`).
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// The stream this thread's work on this GPU is queued on, in order: the compute stream,
    /// or the side stream while this thread issues a re-run in a side window
    /// (`side_window`).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self.side_now() {
            Some(s) => &s.stream,
            None => &self.0.stream,
        }
    }

    /// The side stream's parts when this thread's work goes there now.
    fn side_now(&self) -> Option<&Side> {
        if super::memory::on() == super::memory::On::Side {
            self.0.side.get()
        } else {
            None
        }
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        match self.side_now() {
            Some(s) => &s.blas,
            None => &self.0.blas,
        }
    }

    /// cuBLASLt's handle and workspace (`lt.rs`) of the stream this thread's work goes on,
    /// made on first use.
    pub(crate) fn lt(&self) -> Result<&super::lt::Lt> {
        let (cell, stream) = match self.side_now() {
            Some(s) => (&s.lt, &s.stream),
            None => (&self.0.lt, &self.0.stream),
        };
        if let Some(lt) = cell.get() {
            return Ok(lt);
        }
        let lt = super::lt::Lt::new(stream, self.compute_capability_major())?;
        // A racing thread may have set it first; its handle serves as well.
        Ok(cell.get_or_init(|| lt))
    }

    /// Lets f32 matmuls use TF32 tensor cores (10-bit mantissa inputs, f32 accumulation), on
    /// the side stream's cuBLAS handle too. Off by default: f32 matmuls are then exact f32
    /// GEMMs.
    pub fn set_allow_tf32(&self, on: bool) -> Result<()> {
        self.0.tf32.store(on, std::sync::atomic::Ordering::Relaxed);
        if let Some(side) = self.0.side.get() {
            set_math(&side.blas, on)?;
        }
        set_math(&self.0.blas, on)
    }

    /// Whether checkpoints' re-runs issued ahead run on a second compute stream, beside the
    /// backward (off by default; see `side_window`).
    pub fn set_side_stream(&self, on: bool) {
        self.0
            .side_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Opens a window of work on the side stream for the calling thread: a checkpoint's
    /// re-run issued ahead (`autograd::ahead`) then runs beside the backward the walking
    /// thread issues on the compute stream, and small kernels of the two fill the GPU
    /// together where each alone leaves it partly idle. The side stream first waits for the
    /// compute stream's work so far (the re-run's inputs and weights are ready); the compute
    /// stream waits for the window's end before it reads what the re-run made
    /// (`SideWindow`'s drop). Buffers freed after one stream's work are not handed to the
    /// other before it has waited so (`memory.rs`, the arena's tags). None where the side
    /// stream is off (`set_side_stream`) or there is no cap's arena (the cache keeps no
    /// tags): the work stays on the compute stream.
    pub(crate) fn side_window(&self) -> Result<Option<SideWindow>> {
        use std::sync::atomic::Ordering;
        if !self.0.side_on.load(Ordering::Relaxed) || super::memory::on() == super::memory::On::Side
        {
            return Ok(None);
        }
        if self.0.side.get().is_none() {
            let err = |e| Error::Cuda(format!("creating the side stream: {e:?}"));
            self.0.ctx.bind_to_thread().map_err(err)?;
            let stream = self.0.ctx.new_stream().map_err(err)?;
            let blas = CudaBlas::new(stream.clone())
                .map_err(|e| Error::Cuda(format!("creating cuBLAS: {e:?}")))?;
            // A racing thread may have set it first; either serves.
            let made = self
                .0
                .side
                .set(Side {
                    stream,
                    blas,
                    lt: OnceLock::new(),
                    done: OnceLock::new(),
                })
                .is_ok();
            if made {
                let side = self
                    .0
                    .side
                    .get()
                    .ok_or(Error::Poisoned("the side stream"))?;
                if self.0.tf32.load(Ordering::Relaxed) {
                    set_math(&side.blas, true)?;
                }
                self.0.mem.set_side_stream(side.stream.clone());
            }
        }
        Ok(self.0.mem.side_open()?.then(|| SideWindow {
            dev: self.clone(),
            end: None,
        }))
    }

    pub(crate) fn sm_count(&self) -> usize {
        self.0.sm_count
    }

    /// The most shared memory (bytes) a block may opt into.
    pub(crate) fn max_shared_memory(&self) -> usize {
        self.0.smem_optin
    }

    /// The compute capability's major version (8 Ampere/Ada, 9 Hopper).
    pub fn compute_capability_major(&self) -> u32 {
        self.0.cc_major
    }

    /// The compute capability's minor version.
    pub fn compute_capability_minor(&self) -> u32 {
        self.0.cc_minor
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.0
            .stream
            .synchronize()
            .map_err(cuda_err("synchronizing"))
    }

    // ----- memory -------------------------------------------------------------------------

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.0.ctx
    }

    /// The page-locked buffers of loads from files (host.rs `load_bytes`).
    pub(crate) fn load_ring(&self) -> &Mutex<Option<LoadRing>> {
        &self.0.loads
    }

    /// The device's reusable events without timing (marks.rs).
    pub(crate) fn marks(&self) -> &Arc<super::marks::Marks> {
        &self.0.marks
    }

    /// The stream that streaming copies run on (host.rs), made on first use.
    pub(crate) fn copy_stream(&self) -> Result<&Arc<CudaStream>> {
        self.lazy_stream(&self.0.copy, "copy")
    }

    /// The stream that staged uploads are copied or decoded into place on (host.rs), made on
    /// first use. At the highest priority: its blocks go ahead of the compute stream's queued
    /// ones, so a streamed block is not held behind a GEMM, nor the staging ring (and so the
    /// next copy over the link) behind its decode.
    pub(crate) fn decode_stream(&self) -> Result<&Arc<CudaStream>> {
        self.lazy_stream_at(&self.0.decode, "decode", true)
    }

    /// The stream that offloaded activations' copies run on (host.rs), made on first use.
    pub(crate) fn offload_stream(&self) -> Result<&Arc<CudaStream>> {
        self.lazy_stream(&self.0.offload, "offload")
    }

    /// The stream NCCL collectives run on (nccl.rs), made on first use.
    pub(crate) fn comm_stream(&self) -> Result<&Arc<CudaStream>> {
        self.lazy_stream(&self.0.comm, "collectives")
    }

    fn lazy_stream<'a>(
        &self,
        cell: &'a OnceLock<Arc<CudaStream>>,
        what: &'static str,
    ) -> Result<&'a Arc<CudaStream>> {
        self.lazy_stream_at(cell, what, false)
    }

    /// `lazy_stream`, at the context's highest stream priority when `high`.
    fn lazy_stream_at<'a>(
        &self,
        cell: &'a OnceLock<Arc<CudaStream>>,
        what: &'static str,
        high: bool,
    ) -> Result<&'a Arc<CudaStream>> {
        if cell.get().is_none() {
            let err = |e| Error::Cuda(format!("creating the {what} stream: {e:?}"));
            let s = if high {
                self.0.ctx.bind_to_thread().map_err(err)?;
                let (_, greatest) =
                    cudarc::driver::result::stream::get_priority_range().map_err(err)?;
                self.0.ctx.new_stream_with_priority(greatest).map_err(err)?
            } else {
                self.0.ctx.new_stream().map_err(err)?
            };
            // A racing thread may have set it first; either stream serves.
            let _ = cell.set(s);
        }
        cell.get().ok_or(Error::Poisoned("CUDA stream"))
    }

    /// This device's allocation counters now (bytes in use, peak, limit, cache).
    pub fn memory(&self) -> MemoryReport {
        self.0.mem.report()
    }

    /// The largest buffer FLAME's allocator can make now within its cap (the largest free
    /// range of the cap's arena; u64::MAX without a cap): `memory().arena_room` without the
    /// rest of the report.
    pub fn arena_room(&self) -> u64 {
        self.0.mem.arena_room()
    }

    /// Makes the peak equal to what is in use now.
    pub fn reset_peak_memory(&self) {
        self.0.mem.reset_peak();
    }

    /// A hard cap on the bytes FLAME holds on this device (None: no cap). The previous cap's
    /// arena goes back to the driver if no buffer lives in it (the next cap makes its own).
    pub fn set_memory_limit(&self, bytes: Option<u64>) {
        self.0.mem.set_limit(bytes);
        let _ = self
            .0
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))
            .and_then(|_| {
                self.0.mem.drop_idle_arena();
                self.0.mem.apply_release_threshold()
            });
    }

    /// Gives the memory of freed buffers back to the driver, where other libraries of this
    /// process (NCCL, cuBLAS) and other processes can take it: the cached buffers go back to
    /// the driver's pool (stream-ordered frees), the stream drains them, and the pool hands
    /// its unused memory to the driver.
    pub fn release_cached(&self) -> Result<()> {
        self.0.mem.empty();
        self.synchronize()?;
        trim_pool(self.0.ordinal);
        Ok(())
    }

    /// Returns the memory of freed buffers, kept for reuse, to the driver's pool (where other
    /// processes still cannot see it; the pool keeps it until the context closes).
    pub fn empty_cache(&self) {
        self.0.mem.empty();
    }

    /// The address of the device's `DONE_COUNTERS` zeroed completion counters (see
    /// `Inner::done`), the side stream's own where this thread's work goes there.
    pub(crate) fn done_counters(&self) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        let (cell, stream) = match self.side_now() {
            Some(s) => (&s.done, &s.stream),
            None => (&self.0.done, &self.0.stream),
        };
        if cell.get().is_none() {
            let zero = stream
                .alloc_zeros::<u32>(DONE_COUNTERS)
                .map_err(cuda_err("allocating the completion counters"))?;
            // A racing thread may have set it first; either zeroed buffer serves.
            let _ = cell.set(zero);
        }
        let done = cell
            .get()
            .ok_or(Error::Poisoned("CUDA completion counter"))?;
        Ok(done.device_ptr(stream).0)
    }

    /// Uninitialised device memory for `len` elements, counted against the limit.
    pub(crate) fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DevBuf<T>> {
        self.0
            .mem
            .alloc(len, || self.total_memory().unwrap_or(u64::MAX))
    }

    /// `len` zeros in device memory (cleared on the stream), counted against the limit;
    /// `what` names the buffer in an error.
    pub(crate) fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> Result<DevBuf<T>> {
        let mut buf = self.alloc::<T>(len)?;
        self.stream()
            .memset_zeros(&mut *buf.slice)
            .map_err(cuda_err(what))?;
        Ok(buf)
    }

    /// One buffer of `bytes` bytes to cut into parts of several element types
    /// (`memory::Packed`), counted against the limit like any other.
    pub(crate) fn alloc_packed(&self, bytes: usize) -> Result<Arc<super::memory::Packed>> {
        self.0
            .mem
            .alloc_packed(bytes, || self.total_memory().unwrap_or(u64::MAX))
    }

    /// The driver's (free, total) bytes of this GPU.
    fn mem_info(&self) -> Result<(u64, u64)> {
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
        Ok((free as u64, total as u64))
    }

    /// The GPU's total memory in bytes.
    pub fn total_memory(&self) -> Result<u64> {
        Ok(self.mem_info()?.1)
    }

    /// Bytes of the GPU in use by every process, as the driver counts them (total - free):
    /// what a smaller card would have to hold.
    pub fn device_memory_used(&self) -> Result<u64> {
        let (free, total) = self.mem_info()?;
        Ok(total - free)
    }

    /// Bytes the driver's pool holds for this device (in use plus cached for reuse).
    pub fn pool_reserved_bytes(&self) -> Result<u64> {
        pool_reserved(self.0.ordinal)
    }

    /// Bytes this process holds on the GPU as the driver counts them (what `nvidia-smi`
    /// shows for it): its context, measured at start, plus everything it took since (the
    /// free memory at start less the free memory now; another process that allocates or
    /// frees meanwhile moves this figure too).
    pub fn process_memory(&self) -> Result<u64> {
        let (free, _) = self.mem_info()?;
        Ok(self.0.context_bytes + self.0.start_free.saturating_sub(free))
    }

    /// The bytes this process could hold on the GPU when it opened the device, as the driver
    /// counts them: its context and the memory free then (what a default budget is, when no
    /// budget is given; the same from phase to phase of a run, where the free memory of the
    /// moment is not), or the lower figure [`Self::limit_memory_at_start`] set.
    pub fn memory_at_start(&self) -> Result<u64> {
        let agreed = *self
            .0
            .agreed_at_start
            .lock()
            .map_err(|_| Error::Poisoned("the memory agreed at start"))?;
        let own = self.0.context_bytes + self.0.start_free;
        Ok(agreed.map_or(own, |a| a.min(own)))
    }

    /// Takes at most `bytes` as [`Self::memory_at_start`] from here on, for the rest of the
    /// process (a figure only goes down): the ranks of a data-parallel group plan within the
    /// least of theirs, a resumed run within what it planned in before, so that their
    /// choices under a default budget (tiles, streamed encoders) are the same.
    pub fn limit_memory_at_start(&self, bytes: u64) -> Result<()> {
        let mut agreed = self
            .0
            .agreed_at_start
            .lock()
            .map_err(|_| Error::Poisoned("the memory agreed at start"))?;
        *agreed = Some(agreed.map_or(bytes, |a| a.min(bytes)));
        Ok(())
    }

    /// The stack each GPU thread of this context has, bytes (`CU_LIMIT_STACK_SIZE`): FLAME
    /// sets it to what its kernels need (see `STACK_BYTES`); the driver raises it for a
    /// launch that needs more.
    pub fn thread_stack_bytes(&self) -> Result<usize> {
        self.0
            .ctx
            .get_limit(sys::CUlimit::CU_LIMIT_STACK_SIZE)
            .map_err(cuda_err("reading the threads' stack size"))
    }

    /// The cap on FLAME's buffers set by hand (`FLAME_GPU_MEMORY_LIMIT`, bytes; u64::MAX
    /// without one).
    pub fn memory_limit_by_hand(&self) -> Result<u64> {
        limit_from_env()
    }

    /// The bytes this process holds on the GPU outside the buffers FLAME's allocator counts:
    /// the context, loaded kernels, library handles and workspaces. Freed buffers kept for
    /// reuse go back to the driver first, so they do not count; the cap's arena is the
    /// allocator's whether its bytes are in live buffers or not.
    pub fn memory_outside_allocator(&self) -> Result<u64> {
        self.release_cached()?;
        let process = self.process_memory()?;
        let r = self.0.mem.report();
        Ok(process.saturating_sub(r.in_use + r.arena_free))
    }

    /// What this process held outside FLAME's allocator ([`Self::memory_outside_allocator`])
    /// the first time this was asked on this device, kept: a budget is split once a device,
    /// before the work it holds starts, so that every phase of a process (caching, the
    /// model, sampling) and every plan made later share one cap. What the process takes
    /// outside the allocator after that (kernels loaded on first use, cuBLASLt's workspace)
    /// is what `memory::LATE_HEADROOM` leaves room for.
    pub fn held_for_budget(&self) -> Result<u64> {
        let mut held = self
            .0
            .budget_held
            .lock()
            .map_err(|_| Error::Poisoned("the budget's measured share"))?;
        if let Some(h) = *held {
            return Ok(h);
        }
        let h = self.memory_outside_allocator()?;
        *held = Some(h);
        Ok(h)
    }

    // ----- kernels ------------------------------------------------------------------------

    /// How many clusters of `name` (its cluster size compiled in) with `cfg`'s block and shared
    /// memory the device holds at once (cuOccupancyMaxActiveClusters, asked once a shape).
    pub(crate) fn resident_clusters(
        &self,
        module: &'static str,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
    ) -> Result<usize> {
        let key = (
            format!("{module}/{name}"),
            cfg.block_dim.0 * cfg.block_dim.1 * cfg.block_dim.2,
            cfg.shared_mem_bytes,
        );
        let cached = self
            .0
            .clusters
            .lock()
            .map_err(|_| Error::Poisoned("CUDA cluster occupancy cache"))?
            .get(&key)
            .copied();
        if let Some(n) = cached {
            return Ok(n);
        }
        let n = self
            .function(module, name)?
            .occupancy_max_active_clusters(cfg, &self.0.stream)
            .map_err(|e| Error::Cuda(format!("cluster occupancy of {name}: {e:?}")))?
            as usize;
        self.0
            .clusters
            .lock()
            .map_err(|_| Error::Poisoned("CUDA cluster occupancy cache"))?
            .insert(key, n);
        Ok(n)
    }

    /// Each kernel module loaded so far, in order, and the seconds its load took: the
    /// driver compiles a module's PTX for this GPU at its first use in a process (or reads
    /// the result from its disk cache, `CUDA_CACHE_PATH`, where an earlier process on this
    /// machine compiled it).
    pub fn module_loads(&self) -> Vec<(&'static str, f64)> {
        self.0
            .module_loads
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// A kernel from an embedded module; the module is JIT-loaded once, the handle cached.
    pub fn function(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        // A launch reads the handle under a shared lock, keyed by the borrowed names: no
        // allocation and no waiting on other issuing threads, nor on a module being loaded.
        {
            let fns = self
                .0
                .functions
                .read()
                .map_err(|_| Error::Poisoned("CUDA function cache"))?;
            if let Some(f) = fns.get(module).and_then(|m| m.get(name)) {
                return Ok(f.clone());
            }
        }
        // A first use: the module is loaded (the driver may compile its PTX, seconds) under
        // the module lock alone, so launches of kernels already known go on meanwhile.
        let m = {
            let mut cache = self
                .0
                .modules
                .lock()
                .map_err(|_| Error::Poisoned("CUDA module cache"))?;
            match cache.get(module) {
                Some(m) => m.clone(),
                None => {
                    let image = ptx::MODULES
                        .iter()
                        .find(|(n, _)| *n == module)
                        .map(|(_, image)| match image {
                            ptx::Image::Ptx(src) => cudarc::nvrtc::Ptx::from_src(*src),
                            ptx::Image::Fatbin(bytes) => {
                                cudarc::nvrtc::Ptx::from_binary(bytes.to_vec())
                            }
                        })
                        .ok_or_else(|| {
                            Error::Cuda(format!("no embedded kernel module '{module}'"))
                        })?;
                    let t0 = std::time::Instant::now();
                    let m = self
                        .0
                        .ctx
                        .load_module(image)
                        .map_err(cuda_err(&format!("loading module '{module}'")))?;
                    if let Ok(mut v) = self.0.module_loads.lock() {
                        v.push((module, t0.elapsed().as_secs_f64()));
                    }
                    cache.insert(module, m.clone());
                    m
                }
            }
        };
        let f = m
            .load_function(name)
            .map_err(cuda_err(&format!("kernel '{name}' in module '{module}'")))?;
        self.0
            .functions
            .write()
            .map_err(|_| Error::Poisoned("CUDA function cache"))?
            .entry(module)
            .or_default()
            .insert(name.to_string(), f.clone());
        Ok(f)
    }
}

/// The driver's free bytes of the device whose context is current.
fn driver_free() -> Result<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: plain out-parameters; a context is current.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(format!("cuMemGetInfo: {r:?}")));
    }
    Ok(free as u64)
}

/// What a context of GPU `ordinal` takes, as the driver counts it: a second context is
/// made, the free memory read, and the context destroyed; `before` is the free memory with
/// the first one alone. When that cannot be done, [`CONTEXT_BYTES_UNMEASURED`]. The caller
/// makes its own context current again.
fn context_cost(ordinal: usize, before: u64) -> u64 {
    let measured = std::panic::catch_unwind(|| {
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-parameters; a context made here is destroyed before returning and
        // holds no allocation of FLAME's.
        unsafe {
            if sys::cuDeviceGet(&mut dev, ordinal as i32) != sys::cudaError_enum::CUDA_SUCCESS {
                return None;
            }
            if sys::cuCtxCreate_v4(&mut ctx, std::ptr::null_mut(), 0, dev)
                != sys::cudaError_enum::CUDA_SUCCESS
            {
                return None;
            }
            // As the context FLAME works in is set up (the new context is current).
            let limited = sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, STACK_BYTES);
            let after = (limited == sys::cudaError_enum::CUDA_SUCCESS)
                .then(driver_free)
                .and_then(|f| f.ok());
            sys::cuCtxDestroy_v2(ctx);
            after
        }
    });
    match measured {
        Ok(Some(after)) if after < before => before - after,
        _ => CONTEXT_BYTES_UNMEASURED,
    }
}

/// The stack each GPU thread is given, in bytes (`CU_LIMIT_STACK_SIZE`). The driver sets local
/// memory aside for it for every thread the device can hold at once, so CUDA's default of
/// 1 KiB held 232 MiB more of an H200 than 128 bytes do (a context of 518 MiB, 320 at 256
/// bytes; CUDA 13.0, driver 580). FLAME's kernels take at most 200 bytes a thread (ptxas for
/// sm_90: `norm_bwd_params_2_f32`, the attention backward 48), and the driver raises the limit
/// for a launch that needs more (CUDA driver API, `cuCtxSetLimit`), as a library's kernel
/// might: what it takes then is among what `memory::LATE_HEADROOM` leaves for.
const STACK_BYTES: usize = 256;

/// A context's bytes where they cannot be measured: about what CUDA 13 takes on an H200
/// with [`STACK_BYTES`].
const CONTEXT_BYTES_UNMEASURED: u64 = 320 << 20;

/// TF32 on `blas`'s f32 GEMMs or not.
fn set_math(blas: &CudaBlas, on: bool) -> Result<()> {
    use cudarc::cublas::sys::{cublasMath_t, cublasSetMathMode, cublasStatus_t};
    let mode = if on {
        cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
    } else {
        cublasMath_t::CUBLAS_DEFAULT_MATH
    };
    // SAFETY: the handle is live for the device's lifetime; the mode is a valid enum value.
    let r = unsafe { cublasSetMathMode(*blas.handle(), mode) };
    if r != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(Error::Cuda(format!("cublasSetMathMode: {r:?}")));
    }
    Ok(())
}
