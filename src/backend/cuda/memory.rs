//! Device memory: FLAME's own cache of freed buffers in front of the driver's stream-ordered
//! pool, and the accounting of every live buffer.
//!
//! A dropped buffer's address goes on a free list keyed by its rounded size, and the next
//! request of that size takes it back without a driver call. All of FLAME's work runs on one
//! stream, so a buffer freed after its last use was enqueued may be handed to work enqueued
//! later: the stream orders the two (the argument of stream-ordered allocation, and of
//! PyTorch's caching allocator). The driver's cuMemAllocAsync/cuMemFreeAsync pair costs GPU
//! time as well as host time: on an H100, a 28 MB fill took 9.93 µs into one buffer and
//! 10.62 µs into a fresh buffer each call, and a layer with three outputs pays it three times.
//!
//! Counted: bytes in live buffers (`in_use`), their peak, and a hard limit on `in_use`
//! (FLAME_GPU_MEMORY_LIMIT or `set_memory_limit`), so a run can prove it fits a smaller card;
//! and the bytes the cache holds (`cached`), which `empty_cache` returns to the driver's pool.
//! When the driver runs out of memory, the cache is emptied and the request tried once more.
//! Under a cap, the cache and the driver's pool are emptied whenever a new buffer would take
//! in-use plus cached bytes past the cap, so the device memory the process holds stays near
//! the cap (the proof that a run fits a smaller card).

use crate::{Error, Result};
use cudarc::driver::{sys, CudaSlice, CudaStream, DeviceRepr};
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Requests are rounded up to this many bytes, so near sizes share a free list.
const ROUND: u64 = 512;

/// A snapshot of a device's memory accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes held by live FLAME buffers.
    pub in_use: u64,
    /// Largest `in_use` since the device opened or the last `reset_peak_memory`.
    pub peak: u64,
    /// The hard limit on `in_use` (u64::MAX: none).
    pub limit: u64,
    /// Buffers handed out so far, from the cache or the driver (a steady training step adds a
    /// fixed number per step).
    pub allocations: u64,
    /// Bytes of freed buffers kept for reuse.
    pub cached: u64,
}

/// The free lists and counters of one device, shared by every buffer made on it.
pub(crate) struct Pool {
    device: String,
    ordinal: usize,
    stream: Arc<CudaStream>,
    free: Mutex<HashMap<u64, Vec<sys::CUdeviceptr>>>,
    in_use: AtomicU64,
    peak: AtomicU64,
    limit: AtomicU64,
    allocations: AtomicU64,
    cached: AtomicU64,
}

/// Device memory of `len` elements; dropping it returns the memory to its pool's cache.
pub(crate) struct DevBuf<T> {
    pub(crate) slice: ManuallyDrop<CudaSlice<T>>,
    bytes: u64,
    pool: Arc<Pool>,
}

impl<T> DevBuf<T> {
    pub(crate) fn len(&self) -> usize {
        self.slice.len()
    }
}

impl<T: DeviceRepr> DevBuf<T> {
    /// The raw device address, for kernel parameter structs (event tracking is off, so
    /// cudarc's guard has nothing to record).
    pub(crate) fn raw(&self, dev: &super::CudaDevice) -> u64 {
        use cudarc::driver::DevicePtr;
        self.slice.device_ptr(dev.stream()).0
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let ptr = slice.leak();
        self.pool.in_use.fetch_sub(self.bytes, Ordering::Relaxed);
        match self.pool.free.lock() {
            Ok(mut free) => {
                free.entry(self.bytes).or_default().push(ptr);
                self.pool.cached.fetch_add(self.bytes, Ordering::Relaxed);
            }
            // A poisoned cache: hand the memory back to the driver instead.
            Err(_) => self.pool.release(ptr, self.bytes),
        }
    }
}

impl Pool {
    pub(crate) fn new(ordinal: usize, stream: Arc<CudaStream>, limit: u64) -> Pool {
        Pool {
            device: format!("cuda:{ordinal}"),
            ordinal,
            stream,
            free: Mutex::new(HashMap::new()),
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            allocations: AtomicU64::new(0),
            cached: AtomicU64::new(0),
        }
    }

    pub(crate) fn report(&self) -> MemoryReport {
        MemoryReport {
            in_use: self.in_use.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            limit: self.limit.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            cached: self.cached.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn reset_peak(&self) {
        self.peak
            .store(self.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    pub(crate) fn set_limit(&self, bytes: Option<u64>) {
        self.limit
            .store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Uninitialised memory for `len` elements, counted against the limit. `total` is the
    /// GPU's size, for the error when the driver has no more.
    pub(crate) fn alloc<T: DeviceRepr>(
        self: &Arc<Self>,
        len: usize,
        total: impl Fn() -> u64,
    ) -> Result<DevBuf<T>> {
        let want = (len.max(1) * std::mem::size_of::<T>()) as u64;
        let bytes = want.div_ceil(ROUND) * ROUND;
        let limit = self.limit.load(Ordering::Relaxed);
        let in_use = self.in_use.fetch_add(bytes, Ordering::Relaxed);
        let oom = |in_use: u64, limit: u64| Error::OutOfMemory {
            device: self.device.clone(),
            requested: bytes,
            in_use,
            limit,
        };
        if in_use.saturating_add(bytes) > limit {
            self.in_use.fetch_sub(bytes, Ordering::Relaxed);
            return Err(oom(in_use, limit));
        }
        // (A poisoned cache is bypassed: the driver serves the request.)
        let reused = self
            .free
            .lock()
            .ok()
            .and_then(|mut free| free.get_mut(&bytes).and_then(Vec::pop));
        // Under a cap, the memory the process holds (buffers in use plus the cache) stays
        // within it too: when a new buffer would pass it, the cache goes back to the driver
        // and the driver's pool is trimmed, so a capped run proves what a smaller card holds.
        if reused.is_none()
            && limit != u64::MAX
            && (in_use + bytes).saturating_add(self.cached.load(Ordering::Relaxed)) > limit
        {
            self.empty();
            self.stream.synchronize().ok();
            super::device::trim_pool(self.ordinal);
        }
        let slice = match reused {
            Some(ptr) => {
                self.cached.fetch_sub(bytes, Ordering::Relaxed);
                // SAFETY: `ptr` came from a CudaSlice of `bytes` bytes on this stream, leaked
                // when its buffer dropped, and is owned by nothing else now.
                unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len.max(1)) }
            }
            None => match self.driver_alloc::<T>(len, bytes) {
                Ok(s) => s,
                Err(e) => {
                    self.in_use.fetch_sub(bytes, Ordering::Relaxed);
                    return Err(if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                        oom(in_use, total())
                    } else {
                        Error::Cuda(format!("allocating {bytes} bytes: {e:?}"))
                    });
                }
            },
        };
        self.peak.fetch_max(in_use + bytes, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(DevBuf {
            slice: ManuallyDrop::new(slice),
            bytes,
            pool: self.clone(),
        })
    }

    /// A fresh buffer of `bytes` bytes (>= len elements) from the driver, seen as `len`
    /// elements; on its out-of-memory error, the cache is emptied and the request tried once more.
    fn driver_alloc<T: DeviceRepr>(
        &self,
        len: usize,
        bytes: u64,
    ) -> std::result::Result<CudaSlice<T>, cudarc::driver::DriverError> {
        let get = || {
            // SAFETY: callers write every element before reading it (kernels fill outputs
            // whole). The buffer is allocated as bytes so that the cache can hand it to any
            // element type later.
            unsafe { self.stream.alloc::<u8>(bytes as usize) }.map(|s| {
                let ptr = s.leak();
                // SAFETY: `ptr` holds `bytes` >= len * size_of::<T>() bytes.
                unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len.max(1)) }
            })
        };
        match get() {
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                self.empty();
                get()
            }
            r => r,
        }
    }

    /// Returns every cached buffer to the driver's pool.
    pub(crate) fn empty(&self) {
        let lists = match self.free.lock() {
            Ok(mut free) => std::mem::take(&mut *free),
            Err(_) => return,
        };
        for (bytes, ptrs) in lists {
            for ptr in ptrs {
                self.cached.fetch_sub(bytes, Ordering::Relaxed);
                self.release(ptr, bytes);
            }
        }
    }

    /// Frees `ptr` (stream-ordered, after the work already enqueued).
    fn release(&self, ptr: sys::CUdeviceptr, bytes: u64) {
        // SAFETY: `ptr` is a leaked allocation of `bytes` bytes on this stream that nothing
        // else owns; the slice's drop frees it with cuMemFreeAsync.
        drop(unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, bytes as usize) });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.empty();
    }
}
