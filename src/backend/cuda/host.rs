//! Page-locked host copies of device buffers and copies between them on the device's copy
//! stream, for block streaming (`crate::stream`).
//!
//! Ownership and ordering (the invariants `crate::stream` relies on; README "Memory model"):
//! - All compute runs on the device's one compute stream; copies for streaming run on its
//!   copy stream. A buffer of the cache (memory.rs) is only ever handed out in compute-stream
//!   order, so before a copy writes into a freshly allocated buffer, the copy stream waits
//!   for the compute stream's work enqueued so far (an event): whatever last used that
//!   memory has finished.
//! - `upload` returns the buffers with the event of their copies; the compute stream must wait
//!   on that event (`wait`) before any kernel reads the buffer, and before the buffer is
//!   dropped (so it never returns to the cache while the copy may still write it).
//! - A `PinnedBuf` is written once (`stash`, synchronously) and only read afterwards, so
//!   copies from it need no ordering against the host. `offload` writes one on the copy
//!   stream instead; uploads from it run on that stream too, so they follow the write, and
//!   the host never reads it.

use super::storage::{Buf, CudaStorage};
use super::{cuda_err, CudaDevice};
use crate::{DType, Error, Result};
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};

/// A device buffer's bytes in page-locked host memory.
pub struct PinnedBuf {
    host: PinnedHostSlice<u8>,
    dtype: DType,
    len: usize,
}

impl std::fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuf({} x {})", self.len, self.dtype)
    }
}

impl PinnedBuf {
    pub fn bytes(&self) -> usize {
        self.host.len()
    }
}

/// The event of an upload: the buffer's values are there once the event has completed. A
/// packed upload also records when its copy began, for the copy's duration (`copy_ms`).
pub struct Upload(CudaEvent, Option<CudaEvent>);

impl Upload {
    pub(crate) fn timed(&self) -> bool {
        self.1.is_some()
    }

    /// The copy's duration on the device, once it has finished (None before, or when the
    /// upload was not timed).
    pub(crate) fn copy_ms(&self) -> Option<f64> {
        let start = self.1.as_ref()?;
        if !(start.is_complete() && self.0.is_complete()) {
            return None;
        }
        start.elapsed_ms(&self.0).ok().map(f64::from)
    }
}

/// Events that can time a copy.
const TIMED: Option<cudarc::driver::sys::CUevent_flags> =
    Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);

/// Byte alignment of each part of a packed buffer (the alignment cudaMalloc gives, which
/// cuBLAS and the vectorised kernels expect of a buffer's start).
pub(crate) const PACK_ALIGN: usize = 256;

/// Several device buffers' bytes in one page-locked host buffer, each part at a multiple of
/// `PACK_ALIGN`: a streamed block's weights, uploaded by one copy into one device buffer
/// (`upload_pack`).
pub struct PinnedPack {
    host: PinnedHostSlice<u8>,
    /// (byte offset, dtype, elements) of each part, in the order given to `pack`.
    parts: Vec<(usize, DType, usize)>,
    /// Bytes up to the end of the last part.
    used: usize,
}

impl std::fmt::Debug for PinnedPack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedPack({} parts, {} bytes)",
            self.parts.len(),
            self.used
        )
    }
}

impl PinnedPack {
    pub fn bytes(&self) -> usize {
        self.used
    }
}

fn raw(buf: &Buf, dev: &CudaDevice) -> u64 {
    buf.raw_ptr(dev.stream())
}

impl CudaDevice {
    /// The first `len` elements of `s` copied to new page-locked host memory; returns when
    /// the copy is done.
    pub(crate) fn stash(&self, s: &CudaStorage, len: usize) -> Result<PinnedBuf> {
        let dtype = s.buf.dtype();
        if len > s.buf.len() {
            return Err(Error::Cuda(format!(
                "stash of {len} elements from a buffer of {}",
                s.buf.len()
            )));
        }
        let bytes = len * dtype.size_in_bytes();
        // SAFETY: the memory is written whole by the copy below before it is read.
        let mut host = unsafe { self.context().alloc_pinned::<u8>(bytes.max(1)) }.map_err(|e| {
            Error::Cuda(format!("allocating {bytes} bytes of pinned memory: {e:?}"))
        })?;
        let stream = self.stream();
        self.context()
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let dst = host
            .as_mut_slice()
            .map_err(cuda_err("reading the pinned buffer"))?;
        // SAFETY: `dst` holds `bytes` bytes; the source buffer holds at least `bytes` bytes
        // and stays alive (borrowed) until the synchronisation below.
        unsafe {
            result::memcpy_dtoh_async(&mut dst[..bytes], raw(&s.buf, self), stream.cu_stream())
        }
        .map_err(cuda_err("copying to pinned memory"))?;
        stream.synchronize().map_err(cuda_err("synchronizing"))?;
        Ok(PinnedBuf { host, dtype, len })
    }

    /// The first `len` elements of `s` copied into page-locked host memory on the copy stream
    /// after the compute stream's work so far (what wrote `s`), without waiting on the host:
    /// into `reuse` when it is a buffer of the same bytes (buffers are recycled: pinned
    /// allocation is slow), else into a new one. Returns the host buffer and the copy's
    /// event: the compute stream must `wait` on it before `s` is dropped (so the buffer never
    /// returns to the cache while the copy reads it). The copy runs on the offload stream,
    /// not the weights' copy stream: waiting for it must not mean waiting for weights
    /// prefetched ahead. Uploads from the host buffer (`upload_offloaded`) run on the same
    /// offload stream, so they follow this copy without further ordering.
    pub(crate) fn offload(
        &self,
        s: &CudaStorage,
        len: usize,
        reuse: Option<PinnedBuf>,
    ) -> Result<(PinnedBuf, Upload)> {
        let dtype = s.buf.dtype();
        if len > s.buf.len() {
            return Err(Error::Cuda(format!(
                "offload of {len} elements from a buffer of {}",
                s.buf.len()
            )));
        }
        let bytes = len * dtype.size_in_bytes();
        let mut host = match reuse {
            Some(p) if p.host.len() == bytes.max(1) => p.host,
            _ => {
                // SAFETY: the memory is written whole by the copy below before it is read.
                unsafe { self.context().alloc_pinned::<u8>(bytes.max(1)) }.map_err(|e| {
                    Error::Cuda(format!("allocating {bytes} bytes of pinned memory: {e:?}"))
                })?
            }
        };
        let copy = self.offload_stream()?;
        copy.join(self.stream())
            .map_err(cuda_err("ordering the offload stream after compute"))?;
        let dst = host
            .as_mut_slice()
            .map_err(cuda_err("reading the pinned buffer"))?;
        // SAFETY: `dst` holds `bytes` bytes; the source holds at least `bytes` bytes and the
        // caller keeps it alive until the compute stream has waited on the returned event.
        unsafe {
            result::memcpy_dtoh_async(&mut dst[..bytes], raw(&s.buf, self), copy.cu_stream())
        }
        .map_err(cuda_err("copying to pinned memory"))?;
        let event = copy
            .record_event(None)
            .map_err(cuda_err("recording the copy's event"))?;
        Ok((PinnedBuf { host, dtype, len }, Upload(event, None)))
    }

    /// New device buffers with the values of `ps` (buffers `offload` wrote), copied on the
    /// offload stream, after those copies out and the compute stream's work so far; the
    /// values are there once the compute stream `wait`s on the returned event (one join and
    /// one event for the whole set).
    pub(crate) fn upload_offloaded(&self, ps: &[&PinnedBuf]) -> Result<(Vec<CudaStorage>, Upload)> {
        let copy = self.offload_stream()?;
        let storages = ps
            .iter()
            .map(|p| self.alloc_like(p.dtype, p.len))
            .collect::<Result<Vec<_>>>()?;
        copy.join(self.stream())
            .map_err(cuda_err("ordering the copy stream after compute"))?;
        for (p, storage) in ps.iter().zip(&storages) {
            let bytes = p.len * p.dtype.size_in_bytes();
            // SAFETY: the pinned memory is never written after `stash`; the destination
            // holds `bytes` bytes and is not read before the compute stream waits on the event.
            let src = unsafe { std::slice::from_raw_parts(host_ptr(&p.host)?, bytes) };
            unsafe { result::memcpy_htod_async(raw(&storage.buf, self), src, copy.cu_stream()) }
                .map_err(cuda_err("copying from pinned memory"))?;
        }
        let event = copy
            .record_event(None)
            .map_err(cuda_err("recording the copy's event"))?;
        Ok((storages, Upload(event, None)))
    }

    /// The buffers `ps` copied, in order, into one new page-locked buffer (each part at a
    /// multiple of `PACK_ALIGN`), for `upload_pack`. A host copy: returns when done.
    pub(crate) fn pack(&self, ps: &[&PinnedBuf]) -> Result<PinnedPack> {
        let mut parts = Vec::with_capacity(ps.len());
        let mut used = 0usize;
        for p in ps {
            let at = used.div_ceil(PACK_ALIGN) * PACK_ALIGN;
            parts.push((at, p.dtype, p.len));
            used = at + p.len.max(1) * p.dtype.size_in_bytes();
        }
        // SAFETY: every byte that a copy reads is written below (the parts) or is padding,
        // which nothing reads as a value.
        let mut host = unsafe { self.context().alloc_pinned::<u8>(used.max(1)) }
            .map_err(|e| Error::Cuda(format!("allocating {used} bytes of pinned memory: {e:?}")))?;
        let dst = host
            .as_mut_slice()
            .map_err(cuda_err("reading the pinned buffer"))?;
        for (p, &(at, dtype, len)) in ps.iter().zip(&parts) {
            let bytes = len * dtype.size_in_bytes();
            // SAFETY: a stashed buffer is written once, synchronously, and only read since.
            let src = unsafe { std::slice::from_raw_parts(host_ptr(&p.host)?, bytes) };
            dst[at..at + bytes].copy_from_slice(src);
        }
        Ok(PinnedPack { host, parts, used })
    }

    /// The parts of `p` as new device buffers cut from one allocation (of at least `slot`
    /// bytes: the streamer gives every block the same, so a freed one fits the next) and
    /// filled by one copy
    /// on the copy stream after the compute stream's work so far; `wait` on the event before
    /// reading them or dropping them (as for `upload`). The allocation returns to the cache
    /// when the last part drops.
    pub(crate) fn upload_pack(
        &self,
        p: &PinnedPack,
        slot: usize,
    ) -> Result<(Vec<CudaStorage>, Upload)> {
        let packed = self.alloc_packed(p.used.max(slot).max(1))?;
        let copy = self.copy_stream()?;
        copy.join(self.stream())
            .map_err(cuda_err("ordering the copy stream after compute"))?;
        let start = copy
            .record_event(TIMED)
            .map_err(cuda_err("recording the copy's start"))?;
        // SAFETY: the pinned memory is never written after `pack`; the destination holds
        // `used` bytes and is not read before the compute stream waits on the event.
        let src = unsafe { std::slice::from_raw_parts(host_ptr(&p.host)?, p.used) };
        unsafe { result::memcpy_htod_async(packed.base(), src, copy.cu_stream()) }
            .map_err(cuda_err("copying from pinned memory"))?;
        let event = copy
            .record_event(TIMED)
            .map_err(cuda_err("recording the copy's event"))?;
        let storages = p
            .parts
            .iter()
            .map(|&(at, dtype, len)| {
                let buf = match dtype {
                    DType::F32 => Buf::F32(packed.part(at, len)?),
                    DType::F64 => Buf::F64(packed.part(at, len)?),
                    DType::BF16 => Buf::BF16(packed.part(at, len)?),
                    DType::F16 => Buf::F16(packed.part(at, len)?),
                    DType::U32 => Buf::U32(packed.part(at, len)?),
                };
                Ok(CudaStorage {
                    buf,
                    dev: self.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((storages, Upload(event, Some(start))))
    }

    /// The compute stream waits for an upload (no host wait).
    pub(crate) fn wait(&self, u: &Upload) -> Result<()> {
        self.stream()
            .wait(&u.0)
            .map_err(cuda_err("waiting for an upload"))
    }
}

/// The host address of pinned memory, without the host-side synchronisation `as_slice` does
/// (the buffer is only read by copies).
fn host_ptr(p: &PinnedHostSlice<u8>) -> Result<*const u8> {
    // `as_ptr` waits on the slice's event, which only copies through cudarc's own calls
    // record; ours do not, so it returns at once.
    p.as_ptr().map_err(cuda_err("reading the pinned buffer"))
}
