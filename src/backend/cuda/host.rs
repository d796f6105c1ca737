//! Page-locked host copies of device buffers and copies between them on the device's copy
//! stream, for block streaming (`crate::memory`).
//!
//! Ownership and ordering (the invariants `crate::memory` relies on; docs/MEMORY.md, "Memory model"):
//! - All compute runs on the device's one compute stream; copies for streaming run on its
//!   copy stream. A buffer of the cache (memory.rs) is only ever handed out in compute-stream
//!   order, so before a copy writes into a freshly allocated buffer, the copy stream waits
//!   for the compute stream's work enqueued so far (an event): whatever last used that
//!   memory has finished.
//! - Coded uploads cross into a staging ring (`Staging`) and are decoded into their buffers on
//!   the decode stream: the copy stream waits for the compute once, when the ring is made, and
//!   then only for the decode of whatever last held a range of the ring; the decode stream
//!   waits for the compute stream's work so far before writing the fresh buffer.
//! - `upload` returns the buffers with the event after their last write (copy or decode); the
//!   compute stream must wait on that event (`wait`) before any kernel reads the buffer, and
//!   before the buffer is dropped (so it never returns to the cache while a copy or a decode
//!   may still write it).
//! - A `HostBuf` is written once (`stash`, synchronously, into the process's own memory)
//!   and only read afterwards, by the host, which joins it into a page-locked pack. `offload`
//!   writes a page-locked one on the copy stream instead; uploads from it run on that stream
//!   too, so they follow the write, and the host never reads it.

use super::device::LoadRing;
use super::marks::Mark;
use super::memory::Packed;
use super::storage::{Buf, CudaStorage};
use super::{cuda_err, CudaDevice};
use crate::backend::ring::Ring;
use crate::{DType, Error, Result};
use cudarc::driver::{result, CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// Coded tensors a decode launch takes (`WIRE_BATCH` in cuda/wire.cu).
const WIRE_BATCH: usize = crate::backend::wire::DECODE_BATCH;

/// The parts of one decode launch, by value (`WireParts` in cuda/wire.cu, field for field):
/// each part's sections, output and length, and the first block of each (the last entry
/// the launch's block count).
#[repr(C)]
#[derive(Clone, Copy)]
struct WireParts {
    sm: [u64; WIRE_BATCH],
    table: [u64; WIRE_BATCH],
    chunks: [u64; WIRE_BATCH],
    bits: [u64; WIRE_BATCH],
    out: [u64; WIRE_BATCH],
    len: [u64; WIRE_BATCH],
    first_block: [u32; WIRE_BATCH + 1],
    count: u32,
}

// SAFETY: plain integers in C layout, the kernel parameter's.
unsafe impl cudarc::driver::DeviceRepr for WireParts {}

impl WireParts {
    const EMPTY: WireParts = WireParts {
        sm: [0; WIRE_BATCH],
        table: [0; WIRE_BATCH],
        chunks: [0; WIRE_BATCH],
        bits: [0; WIRE_BATCH],
        out: [0; WIRE_BATCH],
        len: [0; WIRE_BATCH],
        first_block: [0; WIRE_BATCH + 1],
        count: 0,
    };
}

/// A device buffer's bytes in host memory: page-locked where the device copies them back
/// asynchronously (`offload`), the process's own where only the host reads them (`stash`,
/// whose copies `pack` joins into page-locked memory: pinning costs the host about as much
/// as the copies, so a stash is not pinned for the one read).
pub struct HostBuf {
    host: HostBytes,
    dtype: DType,
    len: usize,
}

/// Where a `HostBuf`'s bytes live.
enum HostBytes {
    /// Page-locked.
    Pinned(PinnedHostSlice<u8>),
    /// The process's own memory, 8-byte aligned (a bf16 stash reads as u16s in place), and
    /// its byte count.
    Own(Vec<u64>, usize),
}

impl HostBytes {
    fn len(&self) -> usize {
        match self {
            HostBytes::Pinned(p) => p.len(),
            HostBytes::Own(_, n) => *n,
        }
    }

    /// The bytes (a pinned buffer's only once the copies writing it are done: `offload`'s
    /// are read by the device alone).
    fn slice(&self) -> Result<&[u8]> {
        match self {
            HostBytes::Pinned(p) => {
                // SAFETY: the buffer holds `len` bytes; as `host_ptr`.
                Ok(unsafe { std::slice::from_raw_parts(host_ptr(p)?, p.len()) })
            }
            HostBytes::Own(v, n) => Ok(&bytemuck::cast_slice::<u64, u8>(v)[..*n]),
        }
    }

    /// The page-locked buffer, for copies the device makes asynchronously.
    fn pinned(&self) -> Result<&PinnedHostSlice<u8>> {
        match self {
            HostBytes::Pinned(p) => Ok(p),
            HostBytes::Own(..) => Err(Error::Cuda(
                "a stashed buffer is not page-locked: it is packed, not uploaded".into(),
            )),
        }
    }
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuf({} x {})", self.len, self.dtype)
    }
}

impl HostBuf {
    pub fn bytes(&self) -> usize {
        self.host.len()
    }

    /// The values, copied into host memory of the CPU's own.
    pub(crate) fn to_cpu(&self) -> Result<crate::CpuStorage> {
        let bytes = &self.host.slice()?[..self.len * self.dtype.size_in_bytes()];
        crate::CpuStorage::from_bytes(self.dtype, bytes).ok_or_else(|| {
            Error::Stream(format!(
                "a pinned buffer of {} bytes holds no whole {} values",
                bytes.len(),
                self.dtype
            ))
        })
    }
}

/// An event several holders keep: an upload's last copy or decode is its ready event, the end
/// of its timing and the staging ring's mark of a piece read, one event for all three.
type Shared = Arc<Mark>;

/// The event of an upload: the buffer's values are there once the event has completed. A
/// packed upload asked to be timed also records when each of its copies over the link, and
/// each of its decodes, began and ended (`copy_ms`).
pub struct Upload(
    Shared,
    Vec<(CudaEvent, Shared)>,
    Vec<(CudaEvent, Shared)>,
    /// Bytes of its pieces that had crossed into the staging ring ahead (`cross_pack`).
    usize,
);

impl Upload {
    /// Bytes of the upload's pieces that had crossed into the staging ring ahead of it
    /// (`CudaDevice::cross_pack`).
    pub(crate) fn landed_bytes(&self) -> usize {
        self.3
    }

    /// Blocks the calling thread until the last copy or decode is done.
    pub(crate) fn wait_host(&self) -> Result<()> {
        self.0
            .synchronize()
            .map_err(cuda_err("waiting for a copy on the host"))
    }

    pub(crate) fn timed(&self) -> bool {
        !self.1.is_empty()
    }

    /// Once the copies have finished (None before, or when the upload was not timed): their
    /// time on the link, the time from the first one's start to the last one's end (more
    /// where a copy waited for the staging ring), and the decodes' time.
    pub(crate) fn copy_ms(&self) -> Option<(f64, f64, f64)> {
        let done =
            |v: &[(CudaEvent, Shared)]| v.iter().all(|(s, e)| s.is_complete() && e.is_complete());
        if !(done(&self.1) && done(&self.2)) {
            return None;
        }
        let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).ok().map(f64::from);
        let sum = |v: &[(CudaEvent, Shared)]| v.iter().map(|(s, e)| ms(s, e)).sum::<Option<f64>>();
        let span = ms(&self.1.first()?.0, &self.1.last()?.1)?;
        Some((sum(&self.1)?, span, sum(&self.2)?))
    }
}

/// Device memory packed uploads land in before their decode (`upload_pack`), used as a ring:
/// the copy stream writes a piece of an upload into the next free range while the decode
/// stream decodes the pieces before it into their blocks, so the link never waits for a
/// decode, nor for the compute to free the block a copy is for (only the decode waits for
/// that). A range is written again only after the decode stream has read it (its event).
/// The ring holds the largest upload, a piece and the largest part beside it, so no upload's
/// pieces wrap onto its own (whose decodes wait for the compute).
pub struct Staging {
    buf: Arc<Packed>,
    /// The bytes a piece gathers coded parts up to.
    piece: usize,
    ring: std::sync::Mutex<Ring<Shared>>,
    /// The compute, copy and decode streams: the compute waits for the other two before the
    /// ring's memory returns to the cache.
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    decode: Arc<CudaStream>,
}

impl Staging {
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The memory returns in compute-stream order: after every copy into it and every
        // decode from it issued so far, whatever the ring's bookkeeping says.
        let _ = self.compute.join(&self.copy);
        let _ = self.compute.join(&self.decode);
    }
}

/// A piece of a packed upload copied into the ring at once: host bytes `[from, from + len)`,
/// then copied to the same offset of the allocation (`raw`: a run of uncoded parts, laid out
/// on the host as on the device) or the coded parts `parts` decoded.
struct Piece {
    from: usize,
    len: usize,
    raw: bool,
    parts: std::ops::Range<usize>,
}

/// The pieces of packed upload `p` through `staging`, parts whose entry in `skip` is true
/// left out: the runs of its raw parts brought, cut into pieces of up to `Staging::piece`
/// bytes (the host buffer's raw prefix mirrors the device layout: a piece lands at its own
/// offset), then runs of adjacent coded parts of up to `Staging::piece` bytes or one part;
/// with the coded parts brought, each with its offset in the allocation.
fn staged_pieces<'a>(
    p: &'a PinnedPack,
    staging: &Staging,
    skip: &[bool],
) -> (Vec<Piece>, Vec<(usize, &'a CodedPart)>) {
    // The coded parts to bring, each with whether the one before it in the pack's coded
    // bytes is brought too (a piece gathers only adjacent parts).
    let mut coded: Vec<(usize, &CodedPart)> = Vec::new();
    let mut follows: Vec<bool> = Vec::new();
    let mut last_taken = false;
    for (k, part) in p.parts.iter().enumerate() {
        let Some(c) = part.coded.as_ref() else {
            continue;
        };
        let take = !skip.get(k).copied().unwrap_or(false);
        if take {
            coded.push((part.at, c));
            follows.push(last_taken);
        }
        last_taken = take;
    }
    // A raw run crosses in pieces of the target's size (a multiple of the pack's alignment,
    // so each piece's copy into place starts aligned): an uncoded pack staged whole
    // (`upload_pack` with a ring) keeps the link and the copies into place overlapping as
    // a coded one's pieces keep the link and the decodes.
    let target = staging.piece.max(1);
    let cut = raw_cut(target);
    let mut pieces: Vec<Piece> = p
        .raw_runs(skip)
        .into_iter()
        .flat_map(|(from, to)| {
            (from..to).step_by(cut).map(move |at| Piece {
                from: at,
                len: cut.min(to - at),
                raw: true,
                parts: 0..0,
            })
        })
        .collect();
    // A piece takes the next part, and the ones after it while it stays within the
    // target: no piece is larger than the target or one part (`staging_ring_bytes`).
    let part_end = |k: usize| p.coded_at + coded[k].1.wire + coded[k].1.layout.bytes;
    let mut k = 0;
    while k < coded.len() {
        let first = k;
        let from = p.coded_at + coded[k].1.wire;
        let mut end = part_end(k);
        k += 1;
        while k < coded.len() && follows[k] && part_end(k) - from <= target {
            end = part_end(k);
            k += 1;
        }
        pieces.push(Piece {
            from,
            len: end - from,
            raw: false,
            parts: first..k,
        });
    }
    (pieces, coded)
}

/// The bytes a raw run is cut into pieces of, for pieces of up to `target` bytes: a multiple
/// of `PACK_ALIGN` (each piece's copy into place starts aligned), at least one.
fn raw_cut(target: usize) -> usize {
    (target / PACK_ALIGN).max(1) * PACK_ALIGN
}

/// Events that can time a copy.
const TIMED: Option<cudarc::driver::sys::CUevent_flags> =
    Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);

/// A timed event of `stream`'s work so far where `timed` (the start of a timed copy or
/// decode), else none.
fn clock(stream: &CudaStream, timed: bool, what: &'static str) -> Result<Option<CudaEvent>> {
    timed
        .then(|| stream.record_event(TIMED))
        .transpose()
        .map_err(cuda_err(what))
}

/// Byte alignment of each part of a packed buffer (the alignment cudaMalloc gives, which
/// cuBLAS and the vectorised kernels expect of a buffer's start).
pub(crate) const PACK_ALIGN: usize = 256;

/// Several device buffers' bytes in one page-locked host buffer: a streamed block's weights,
/// uploaded into one device allocation (`upload_pack`), each part at a multiple of
/// `PACK_ALIGN` there. Parts sent as they are come first, at their device offsets (uncoded,
/// one copy brings them all); bf16 parts in the link's lossless code (`crate::backend::wire`)
/// follow, copied into a staging ring in pieces and decoded into place on the decode stream.
pub struct PinnedPack {
    host: PinnedHostSlice<u8>,
    /// Each part, in the order given to `pack`.
    parts: Vec<PackPart>,
    /// Device bytes: up to the end of the last part.
    used: usize,
    /// Host bytes `[0, raw)`: the uncoded parts, laid out as on the device.
    raw: usize,
    /// Where the coded parts' bytes start in the host buffer, and how many there are.
    coded_at: usize,
    coded: usize,
}

/// One part of a pack: its place in the device allocation and, when coded, in the coded
/// bytes.
struct PackPart {
    at: usize,
    dtype: DType,
    len: usize,
    coded: Option<CodedPart>,
}

struct CodedPart {
    /// Offset in the coded bytes (a multiple of `PACK_ALIGN`).
    wire: usize,
    layout: crate::backend::wire::Layout,
}

impl std::fmt::Debug for PinnedPack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedPack({} parts, {} bytes on the device, {} on the link)",
            self.parts.len(),
            self.used,
            self.wire_bytes()
        )
    }
}

impl PinnedPack {
    /// Bytes the parts take on the device.
    pub fn bytes(&self) -> usize {
        self.used
    }

    /// Bytes an upload copies over the link.
    pub fn wire_bytes(&self) -> usize {
        self.raw + self.coded
    }

    /// Whether some part is held coded.
    pub fn is_coded(&self) -> bool {
        self.coded > 0
    }

    /// Bytes of pinned host memory it holds.
    pub fn host_bytes(&self) -> usize {
        self.coded_at + self.coded
    }

    /// The runs of uncoded parts to bring, as byte ranges of the device allocation (which the
    /// host buffer's first `raw` bytes mirror): from a part's start to the end of the last
    /// taken part after it with none skipped between (`skip[k]`: part k is not brought;
    /// empty: none is). All of `[0, raw)` when nothing is skipped.
    fn raw_runs(&self, skip: &[bool]) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut prev = false;
        for (k, part) in self.parts.iter().enumerate() {
            // The raw parts lie back to back from 0 (`pack`): coded parts between them in
            // the parts' order do not split a run.
            if part.coded.is_some() {
                continue;
            }
            let take = !skip.get(k).copied().unwrap_or(false);
            if take {
                let end = part.at + part.len.max(1) * part.dtype.size_in_bytes();
                match runs.last_mut() {
                    Some(run) if prev => run.1 = end,
                    _ => runs.push((part.at, end)),
                }
            }
            prev = take;
        }
        runs
    }

    /// How many parts it holds.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// Each part's bytes on the device and on the link, in the order given to `pack`.
    pub fn part_bytes(&self) -> Vec<(usize, usize)> {
        self.parts
            .iter()
            .map(|p| {
                let device = p.len * p.dtype.size_in_bytes();
                (device, p.coded.as_ref().map_or(device, |c| c.layout.bytes))
            })
            .collect()
    }

    /// The staging an upload needs: a pack with coded parts crosses whole into the staging
    /// ring (`upload_pack`); one without needs none (but see `raw_staging_bytes`). Returns
    /// (bytes on the link, the largest piece that bounds the ring: the raw prefix, which
    /// crosses in pieces of the ring's size, or one coded part; the most pieces: one a part,
    /// a few for the raw runs' cuts, and one more).
    pub fn staging_bytes(&self) -> (usize, usize, usize) {
        if self.coded == 0 {
            return (0, 0, 0);
        }
        let coded = self.parts.iter().filter_map(|p| p.coded.as_ref());
        let part = coded
            .clone()
            .map(|c| c.layout.bytes)
            .fold(self.raw, usize::max);
        // Its raw runs cut into pieces (`staged_pieces`) add a few.
        let cuts = self.raw / crate::backend::wire::MIN_PIECE + 2;
        (self.wire_bytes(), part, self.parts.len() + 1 + cuts)
    }

    /// The staging an upload of this pack uncoded through the staging ring needs (an
    /// uncoded pack given a ring by `upload_pack`): (its bytes on the link, the largest
    /// piece: its raw runs cross in pieces of `wire::staging_piece` of those bytes, the most
    /// pieces). Zeros for a pack with nothing to copy.
    pub fn raw_staging_bytes(&self) -> (usize, usize, usize) {
        if self.raw == 0 {
            return (0, 0, 0);
        }
        let piece = crate::backend::wire::staging_piece(self.raw).max(PACK_ALIGN);
        (
            self.wire_bytes(),
            piece.min(self.raw),
            self.raw.div_ceil(raw_cut(piece)) + self.parts.len() + 1,
        )
    }
}

fn raw(buf: &Buf, dev: &CudaDevice) -> u64 {
    buf.raw_ptr(dev.stream())
}

/// Bytes of each page-locked buffer a load from a file crosses through (`load_bytes`).
const LOAD_PIECE: usize = 16 << 20;
/// The load buffers: the host fills one while the device copies the other in.
const LOAD_BUFFERS: usize = 2;
/// Loads of fewer bytes are copied from the caller's memory as they are (the driver stages
/// them): a piece's event and the host threads' start would cost more.
const LOAD_DIRECT: usize = 1 << 20;
/// Bytes a host thread copies into a page-locked buffer at a time (a load's piece, a pack).
const COPY_TASK: usize = 1 << 20;

/// `src` into `dst` (of the same length), [`COPY_TASK`] bytes a task on the host's threads.
fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    dst.par_chunks_mut(COPY_TASK)
        .zip(src.par_chunks(COPY_TASK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

impl CudaDevice {
    /// `bytes` (at least 1) of page-locked host memory, cached (not write-combined, which
    /// cudarc's `alloc_pinned` asks for): the host reads stashed weights when it packs them,
    /// and uploads from write-combined packs ran no faster (measured on an H100: 48.1 against
    /// 48.2 GiB/s).
    ///
    /// # Safety
    /// The memory is unset: the caller writes what it reads.
    unsafe fn alloc_host(&self, bytes: usize) -> Result<PinnedHostSlice<u8>> {
        // SAFETY: as the caller's.
        unsafe {
            self.context()
                .alloc_pinned_with_flags::<u8>(bytes.max(1), 0)
        }
        .map_err(|e| Error::Cuda(format!("allocating {bytes} bytes of pinned memory: {e:?}")))
    }

    /// A new buffer of `dtype` holding the values of `bytes` (little-endian, as files store
    /// them, at any alignment: a memory-mapped file's tensor), copied on the compute stream
    /// after its work so far. Large loads cross in pieces through two page-locked buffers of
    /// the device's (`LoadRing`): the host's threads copy a piece into one (reading a mapped
    /// file's pages in) while the device copies the other's in, where a copy from pageable
    /// memory would take a heap copy of the values first and then the driver's own staging,
    /// one after the other. Returns once the last piece's copy is issued: the compute stream
    /// orders whatever reads the buffer after it.
    pub(crate) fn load_bytes(&self, dtype: DType, bytes: &[u8]) -> Result<CudaStorage> {
        let size = dtype.size_in_bytes();
        if bytes.len() % size != 0 {
            return Err(Error::Cuda(format!(
                "a load of {} bytes is not a whole number of {dtype:?} values",
                bytes.len()
            )));
        }
        let storage = crate::backend::BackendDevice::uninit(
            self,
            &crate::Shape::from(bytes.len() / size),
            dtype,
        )?;
        if bytes.is_empty() {
            return Ok(storage);
        }
        let dst = raw(&storage.buf, self);
        let stream = self.stream();
        self.context()
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        if bytes.len() < LOAD_DIRECT {
            // SAFETY: `dst` holds `bytes.len()` bytes; from pageable memory the call returns
            // once the bytes are staged, so `bytes` may go after it.
            unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }
                .map_err(cuda_err("copying to the device"))?;
            return Ok(storage);
        }
        let mut guard = self
            .load_ring()
            .lock()
            .map_err(|_| Error::Poisoned("load buffers"))?;
        let ring = match &mut *guard {
            Some(r) => r,
            none => {
                let bufs = (0..LOAD_BUFFERS)
                    // SAFETY: a piece's bytes are written before its copy reads them.
                    .map(|_| unsafe { self.alloc_host(LOAD_PIECE) })
                    .collect::<Result<Vec<_>>>()?;
                none.insert(LoadRing {
                    bufs,
                    done: (0..LOAD_BUFFERS).map(|_| None).collect(),
                    next: 0,
                })
            }
        };
        for (k, piece) in bytes.chunks(LOAD_PIECE).enumerate() {
            let slot = ring.next;
            ring.next = (slot + 1) % LOAD_BUFFERS;
            // The event stays until the wait succeeds: a failed wait leaves the buffer
            // waited for again by the next load.
            if let Some(e) = &ring.done[slot] {
                e.synchronize()
                    .map_err(cuda_err("waiting for a load's copy"))?;
            }
            ring.done[slot] = None;
            let at = ring.bufs[slot]
                .as_mut_ptr()
                .map_err(cuda_err("reading a load buffer"))?;
            // SAFETY: the buffer holds LOAD_PIECE bytes, and its last copy to the device has
            // finished (waited for above): nothing else reads or writes it.
            let buf = unsafe { std::slice::from_raw_parts_mut(at, piece.len()) };
            copy_parallel(buf, piece);
            // SAFETY: the destination holds `bytes.len()` bytes from `dst`, this piece at
            // its offset; the page-locked source stays untouched until the event below has
            // passed.
            unsafe {
                result::memcpy_htod_async(dst + (k * LOAD_PIECE) as u64, &*buf, stream.cu_stream())
            }
            .map_err(cuda_err("copying to the device"))?;
            match stream.record_event(None) {
                Ok(e) => ring.done[slot] = Some(e),
                Err(e) => {
                    // No event to wait on: the copy must be done before the buffer is
                    // filled again.
                    let _ = stream.synchronize();
                    return Err(cuda_err("recording a load's copy")(e));
                }
            }
        }
        Ok(storage)
    }

    /// The first `len` elements of `s` copied to new page-locked host memory; returns when
    /// the copy is done.
    pub(crate) fn stash(&self, s: &CudaStorage, len: usize) -> Result<HostBuf> {
        let dtype = s.buf.dtype();
        if len > s.buf.len() {
            return Err(Error::Cuda(format!(
                "stash of {len} elements from a buffer of {}",
                s.buf.len()
            )));
        }
        let bytes = len * dtype.size_in_bytes();
        let mut host = vec![0u64; bytes.div_ceil(8)];
        let stream = self.stream();
        self.context()
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut host)[..bytes];
        // SAFETY: `dst` holds `bytes` bytes; the source buffer holds at least `bytes` bytes
        // and stays alive (borrowed) until the synchronisation below (a copy into pageable
        // memory returns once done anyway).
        unsafe { result::memcpy_dtoh_async(dst, raw(&s.buf, self), stream.cu_stream()) }
            .map_err(cuda_err("copying to host memory"))?;
        stream.synchronize().map_err(cuda_err("synchronizing"))?;
        Ok(HostBuf {
            host: HostBytes::Own(host, bytes),
            dtype,
            len,
        })
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
        reuse: Option<HostBuf>,
    ) -> Result<(HostBuf, Upload)> {
        let dtype = s.buf.dtype();
        if len > s.buf.len() {
            return Err(Error::Cuda(format!(
                "offload of {len} elements from a buffer of {}",
                s.buf.len()
            )));
        }
        let bytes = len * dtype.size_in_bytes();
        let mut host = match reuse.map(|p| p.host) {
            Some(HostBytes::Pinned(p)) if p.len() == bytes.max(1) => p,
            _ => {
                // SAFETY: the memory is written whole by the copy below before it is read.
                unsafe { self.alloc_host(bytes) }?
            }
        };
        let copy = self.offload_stream()?;
        self.marks().join(copy, self.stream())?;
        let dst = host
            .as_mut_slice()
            .map_err(cuda_err("reading the pinned buffer"))?;
        // SAFETY: `dst` holds `bytes` bytes; the source holds at least `bytes` bytes and the
        // caller keeps it alive until the compute stream has waited on the returned event.
        unsafe {
            result::memcpy_dtoh_async(&mut dst[..bytes], raw(&s.buf, self), copy.cu_stream())
        }
        .map_err(cuda_err("copying to pinned memory"))?;
        let event = self.marks().record(copy)?;
        Ok((
            HostBuf {
                host: HostBytes::Pinned(host),
                dtype,
                len,
            },
            Upload(Arc::new(event), Vec::new(), Vec::new(), 0),
        ))
    }

    /// New device buffers with the values of `ps` (buffers `offload` wrote), copied on the
    /// offload stream, after those copies out and the compute stream's work so far; the
    /// values are there once the compute stream `wait`s on the returned event (one join and
    /// one event for the whole set).
    pub(crate) fn upload_offloaded(&self, ps: &[&HostBuf]) -> Result<(Vec<CudaStorage>, Upload)> {
        let copy = self.offload_stream()?;
        let storages = ps
            .iter()
            .map(|p| self.alloc_like(p.dtype, p.len))
            .collect::<Result<Vec<_>>>()?;
        self.marks().join(copy, self.stream())?;
        for (p, storage) in ps.iter().zip(&storages) {
            let bytes = p.len * p.dtype.size_in_bytes();
            // SAFETY: the pinned memory is never written after `stash`; the destination
            // holds `bytes` bytes and is not read before the compute stream waits on the event.
            let src = unsafe { std::slice::from_raw_parts(host_ptr(p.host.pinned()?)?, bytes) };
            unsafe { result::memcpy_htod_async(raw(&storage.buf, self), src, copy.cu_stream()) }
                .map_err(cuda_err("copying from pinned memory"))?;
        }
        let event = self.marks().record(copy)?;
        Ok((storages, Upload(Arc::new(event), Vec::new(), Vec::new(), 0)))
    }

    /// The buffers `ps` copied, in order, into one new page-locked buffer, for
    /// `upload_pack`; with `code`, bf16 buffers that the link's lossless code shrinks go
    /// coded (`crate::backend::wire`, encoded here on the host's cores). A host copy:
    /// returns when done.
    pub(crate) fn pack(&self, ps: &[&HostBuf], code: bool) -> Result<PinnedPack> {
        use crate::backend::wire;
        use rayon::prelude::*;
        let align = |x: usize| x.div_ceil(PACK_ALIGN) * PACK_ALIGN;
        // A stashed buffer is written once, synchronously, and only read since.
        let srcs = ps
            .iter()
            .map(|p| Ok(&p.host.slice()?[..p.len * p.dtype.size_in_bytes()]))
            .collect::<Result<Vec<&[u8]>>>()?;
        let coded: Vec<Option<wire::Coded>> = ps
            .par_iter()
            .zip(&srcs)
            .map(|(p, src)| {
                if !code || p.dtype != DType::BF16 {
                    return None;
                }
                // Host buffers are page- or 8-byte aligned: the bytes are u16s in place.
                bytemuck::try_cast_slice::<u8, u16>(src)
                    .ok()
                    .and_then(wire::encode)
            })
            .collect();
        // Device layout: the uncoded parts first (the host buffer's first `raw` bytes mirror
        // them), then the coded ones (whose bytes follow in the host buffer at `coded_at`).
        let mut slots: Vec<Option<PackPart>> = ps.iter().map(|_| None).collect();
        let mut used = 0usize;
        for (i, p) in ps.iter().enumerate() {
            if coded[i].is_none() {
                let at = align(used);
                used = at + p.len.max(1) * p.dtype.size_in_bytes();
                slots[i] = Some(PackPart {
                    at,
                    dtype: p.dtype,
                    len: p.len,
                    coded: None,
                });
            }
        }
        let raw = used;
        let mut wire_used = 0usize;
        for (i, c) in coded.iter().enumerate() {
            if let Some(c) = c {
                let at = align(used);
                used = at + c.layout.len.max(1) * 2;
                let w = align(wire_used);
                wire_used = w + c.bytes.len();
                slots[i] = Some(PackPart {
                    at,
                    dtype: DType::BF16,
                    len: c.layout.len,
                    coded: Some(CodedPart {
                        wire: w,
                        layout: c.layout,
                    }),
                });
            }
        }
        let parts: Vec<PackPart> = slots.into_iter().flatten().collect();
        let coded_at = align(raw);
        let total = coded_at + wire_used;
        // SAFETY: every byte that a copy reads is written below (the parts) or is padding,
        // which nothing reads as a value.
        let mut host = unsafe { self.alloc_host(total) }?;
        let dst = host
            .as_mut_slice()
            .map_err(cuda_err("reading the pinned buffer"))?;
        // Each part's bytes into its range, split among the host's threads (the copies of a
        // block's weights are most of a load's host time once nothing is pinned twice).
        for ((part, src), c) in parts.iter().zip(&srcs).zip(&coded) {
            match (&part.coded, c) {
                (Some(cp), Some(c)) => {
                    let at = coded_at + cp.wire;
                    copy_parallel(&mut dst[at..at + c.bytes.len()], &c.bytes);
                }
                _ => copy_parallel(&mut dst[part.at..part.at + src.len()], src),
            }
        }
        Ok(PinnedPack {
            host,
            parts,
            used,
            raw,
            coded_at,
            coded: wire_used,
        })
    }

    /// The parts of `p` as new device buffers cut from one allocation of the pack's bytes;
    /// `wait` on the event before reading them or dropping them (as for `upload`). The allocation
    /// returns to the cache when the last part drops.
    ///
    /// Without `staging`, one copy on the copy stream after the compute stream's work so far
    /// brings every part as it is (a pack with coded parts needs a ring). With it, where the
    /// ring holds the whole pack's bytes on the link, the pack crosses into the staging ring
    /// in pieces (`crate::backend::wire::staging_piece` of the largest upload, or one
    /// part), none waiting for the compute; the decode stream, after the compute stream's
    /// work so far and each piece's copy, copies or decodes it into the allocation. An
    /// uncoded pack given a ring too small for it crosses as without one.
    ///
    /// Parts whose entry in `skip` is true (`skip` empty: none; the caller checks its length)
    /// are not brought: neither
    /// copied nor decoded (the copies take the runs of the other parts); their ranges of the
    /// allocation hold whatever was there. `crossed`: the id of a crossing of `p`'s first
    /// pieces (`cross_pack`) to decode instead of copying them again, where it is still in
    /// the ring and nothing is skipped.
    pub(crate) fn upload_pack(
        &self,
        p: &PinnedPack,
        staging: Option<&Staging>,
        skip: &[bool],
        timed: bool,
        crossed: Option<u64>,
    ) -> Result<(Vec<CudaStorage>, Upload)> {
        // An uncoded pack given no ring crosses straight into place (a coded streamer's
        // first blocks: `BlockStreamer::set_uncoded_first`); given one, it is staged as a
        // coded pack is (the backward's raw forms: `BlockStreamer::set_raw_backward`).
        let ring = staging.filter(|s| p.wire_bytes() > 0 && s.len() >= p.wire_bytes());
        if p.coded > 0 && ring.is_none() {
            return Err(Error::Stream(format!(
                "a coded pack of {} bytes on the link needs as much staging, has {}",
                p.wire_bytes(),
                staging.map_or(0, Staging::len)
            )));
        }
        let packed = self.alloc_packed(p.used.max(1))?;
        let event = match ring {
            None => {
                let copy = self.copy_stream()?;
                let queued = self.upload_direct(p, &packed, copy, skip, timed);
                if queued.is_err() {
                    // Some copies may be queued: the pack's buffer drops with the error, and
                    // returns to the cache only after them.
                    let _ = self.stream().join(copy);
                }
                queued?
            }
            Some(staging) => self.upload_staged(p, &packed, staging, skip, timed, crossed)?,
        };
        let storages = p
            .parts
            .iter()
            .map(|part| {
                let (at, len) = (part.at, part.len);
                let buf = match part.dtype {
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
        Ok((storages, event))
    }

    /// `upload_pack` without the staging ring: the runs of `p`'s parts brought, copied on
    /// the copy stream straight into `packed` after the compute stream's work so far.
    fn upload_direct(
        &self,
        p: &PinnedPack,
        packed: &Packed,
        copy: &Arc<CudaStream>,
        skip: &[bool],
        timed: bool,
    ) -> Result<Upload> {
        let host = host_ptr(&p.host)?;
        self.marks().join(copy, self.stream())?;
        let start = clock(copy, timed, "recording the copy's start")?;
        for (from, to) in p.raw_runs(skip) {
            // SAFETY: the pinned memory is never written after `pack`; the range lies within
            // its first `raw` bytes and the destination's `used`, and is not read before the
            // compute stream waits on the event.
            let src = unsafe { std::slice::from_raw_parts(host.add(from), to - from) };
            unsafe {
                result::memcpy_htod_async(packed.base() + from as u64, src, copy.cu_stream())
            }
            .map_err(cuda_err("copying from pinned memory"))?;
        }
        let end = self.stamp(copy, timed, "recording the copy's event")?;
        let timing = start.map(|s| (s, end.clone())).into_iter().collect();
        Ok(Upload(end, timing, Vec::new(), 0))
    }

    /// An event of `stream`'s work so far that its holders share: timed where `timed` (the
    /// end of a timed copy or decode), else a mark without timing.
    fn stamp(&self, stream: &CudaStream, timed: bool, what: &'static str) -> Result<Shared> {
        Ok(Arc::new(match clock(stream, timed, what)? {
            Some(e) => Mark::own(e),
            None => self.marks().record(stream)?,
        }))
    }

    /// `upload_pack` through the staging ring: the pieces of `p` (`staged_pieces`) copied on
    /// the copy stream, each into the ring's next free range once the decode stream has read
    /// what was there, but for the first pieces that crossed ahead (`cross_pack`, the
    /// crossing `crossed`, where nothing is skipped); copied or decoded into `packed` on the
    /// decode stream once the compute stream has freed it (its work so far) and the piece is
    /// in.
    fn upload_staged(
        &self,
        p: &PinnedPack,
        packed: &Packed,
        staging: &Staging,
        skip: &[bool],
        timed: bool,
        crossed: Option<u64>,
    ) -> Result<Upload> {
        let (pieces, coded) = staged_pieces(p, staging, skip);
        let copy = self.copy_stream()?;
        let decode = self.decode_stream()?;
        let crossed = crossed.filter(|_| !skip.contains(&true));
        let queued = self.queue_staged(
            p, &pieces, &coded, packed, staging, copy, decode, timed, crossed,
        );
        if queued.is_err() {
            // Some of it may be queued: nothing the copies or decodes touch may return to
            // the cache (the pack's buffer drops with the error) before they are done.
            let _ = self.stream().join(copy);
            let _ = self.stream().join(decode);
        }
        queued
    }

    /// Copies the first pieces of packed upload `p` (every part brought) into the staging
    /// ring ahead of its decode, on the copy stream, as far as the ring has room that no
    /// other crossing holds: the link's time before the compute frees the memory the upload
    /// will land in (the backward's end, for the next forward's first uploads). The upload
    /// (`upload_pack` with the crossing's id) then decodes those pieces and brings the rest.
    /// Returns the crossing's id, its bytes and whether every piece crossed; None where the
    /// pack is not coded, does not fit the ring or no piece found room.
    pub(crate) fn cross_pack(
        &self,
        p: &PinnedPack,
        staging: &Staging,
    ) -> Result<Option<(u64, usize, bool)>> {
        if p.coded == 0 || staging.len() < p.wire_bytes() {
            return Ok(None);
        }
        let (pieces, _) = staged_pieces(p, staging, &[]);
        let copy = self.copy_stream()?;
        let host = host_ptr(&p.host)?;
        let mut ring = staging
            .ring
            .lock()
            .map_err(|_| Error::Poisoned("staging ring"))?;
        let id = ring.begin_crossing();
        let mut bytes = 0;
        for piece in &pieces {
            // Neither onto another crossing nor onto this one's own pieces.
            let Some((at, read)) = ring.cross(id, piece.len) else {
                break;
            };
            let (_, copied) = self.copy_to_ring(copy, host, staging, piece, at, read, false)?;
            ring.crossed(id, at, piece.len, copied);
            bytes += piece.len;
        }
        let crossed = ring.end_crossing(id);
        if crossed == 0 {
            return Ok(None);
        }
        Ok(Some((id, bytes, crossed == pieces.len())))
    }

    /// Copies `piece` of the pinned bytes at `host` into the staging ring at `at` on `copy`,
    /// once the decode that last read that range (`read`) is done: the copy's start (where
    /// `timed`) and its end.
    #[allow(clippy::too_many_arguments)]
    fn copy_to_ring(
        &self,
        copy: &Arc<CudaStream>,
        host: *const u8,
        staging: &Staging,
        piece: &Piece,
        at: usize,
        read: Option<Shared>,
        timed: bool,
    ) -> Result<(Option<CudaEvent>, Shared)> {
        if let Some(e) = read {
            copy.wait(&e)
                .map_err(cuda_err("waiting for the staging ring"))?;
        }
        let start = clock(copy, timed, "recording the copy's start")?;
        // SAFETY: the pinned memory is never written after `pack`; the range lies inside the
        // ring (`Ring::copy`, `Ring::cross`) and nothing reads it until a decode waits for
        // this copy.
        let src = unsafe { std::slice::from_raw_parts(host.add(piece.from), piece.len) };
        let dst = staging.buf.base() + at as u64;
        unsafe { result::memcpy_htod_async(dst, src, copy.cu_stream()) }
            .map_err(cuda_err("copying from pinned memory"))?;
        let copied = self.stamp(copy, timed, "recording the copy's event")?;
        Ok((start, copied))
    }

    /// Queues `upload_staged`'s pieces: on the copy stream into the ring (but those of the
    /// crossing `crossed`, already there), on the decode stream into `packed`.
    #[allow(clippy::too_many_arguments)]
    fn queue_staged(
        &self,
        p: &PinnedPack,
        pieces: &[Piece],
        coded: &[(usize, &CodedPart)],
        packed: &Packed,
        staging: &Staging,
        copy: &Arc<CudaStream>,
        decode: &Arc<CudaStream>,
        timed: bool,
        crossed: Option<u64>,
    ) -> Result<Upload> {
        self.marks().join(decode, self.stream())?;
        let host = host_ptr(&p.host)?;
        let mut ring = staging
            .ring
            .lock()
            .map_err(|_| Error::Poisoned("staging ring"))?;
        // The pieces that crossed ahead, if the crossing is still whole in the ring (the
        // same pieces: the same pack, ring and nothing skipped).
        let landed = match crossed {
            Some(id) => {
                let lens: Vec<usize> = pieces.iter().map(|p| p.len).collect();
                ring.land(id, &lens)
            }
            None => Vec::new(),
        };
        let mut landed_bytes = 0;
        let mut timing = Vec::with_capacity(if timed { pieces.len() } else { 0 });
        let mut decoding = Vec::with_capacity(if timed { pieces.len() } else { 0 });
        // The last piece's decode end.
        let mut last: Option<Shared> = None;
        for (k, piece) in pieces.iter().enumerate() {
            let (at, copied) = match landed.get(k) {
                Some((at, len, copied)) => {
                    landed_bytes += len;
                    (*at, copied.clone())
                }
                None => {
                    // The piece's range in the ring: past any crossing it would overwrite
                    // (dropped), after the decode that last read it.
                    let (at, read) = ring.copy(piece.len);
                    let (start, copied) =
                        self.copy_to_ring(copy, host, staging, piece, at, read, timed)?;
                    if let Some(start) = start {
                        timing.push((start, copied.clone()));
                    }
                    (at, copied)
                }
            };
            let dst = staging.buf.base() + at as u64;
            decode
                .wait(&copied)
                .map_err(cuda_err("waiting for a staged copy"))?;
            let before = clock(decode, timed, "recording a decode's start")?;
            if piece.raw {
                self.copy_staged(decode, dst, packed.base() + piece.from as u64, piece.len)?;
            }
            let parts = coded[piece.parts.clone()].iter().map(|&(part_at, c)| {
                (
                    dst + (p.coded_at + c.wire - piece.from) as u64,
                    &c.layout,
                    packed.base() + part_at as u64,
                )
            });
            self.decode_wire(decode, parts)?;
            let after = self.stamp(decode, timed, "recording a decode's end")?;
            if let Some(before) = before {
                decoding.push((before, after.clone()));
            }
            ring.read(at, piece.len, after.clone());
            last = Some(after);
        }
        // The decode stream runs in order: the last piece's end is the upload's.
        let ready = match last {
            Some(e) => e,
            None => Arc::new(self.marks().record(decode)?),
        };
        Ok(Upload(ready, timing, decoding, landed_bytes))
    }

    /// Copies `n` bytes from device address `src` to `dst` (both 16-byte aligned) on
    /// `stream` with a kernel (cuda/wire.cu `wire_copy_bytes`).
    fn copy_staged(&self, stream: &Arc<CudaStream>, src: u64, dst: u64, n: usize) -> Result<()> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        if n == 0 {
            return Ok(());
        }
        let f = self.function("wire", "wire_copy_bytes")?;
        let len = n as u64;
        let mut b = stream.launch_builder(&f);
        b.arg(&src);
        b.arg(&dst);
        b.arg(&len);
        let cfg = LaunchConfig {
            grid_dim: ((n.div_ceil(16 * 256)).clamp(1, 1024) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel takes exactly these arguments; both ranges hold `n` bytes (a
        // staged piece and its run of the pack's allocation, both at 256-byte alignment).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| Error::Cuda(format!("launching wire_copy_bytes: {e:?}")))
    }

    /// Decodes coded bf16 parts, each `(src, layout, dst)`: the coded bytes at device
    /// address `src` into `dst`, on `stream` (cuda/wire.cu: a thread per run of values), up
    /// to `WIRE_BATCH` parts a launch (an SDXL unit streams about 18 tensors, each its own
    /// launch before).
    fn decode_wire<'a>(
        &self,
        stream: &Arc<CudaStream>,
        parts: impl Iterator<Item = (u64, &'a crate::backend::wire::Layout, u64)>,
    ) -> Result<()> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let mut parts = parts.filter(|(_, l, _)| l.runs() > 0).peekable();
        if parts.peek().is_none() {
            return Ok(());
        }
        let f = self.function("wire", "wire_decode_bf16")?;
        while parts.peek().is_some() {
            let mut p = WireParts::EMPTY;
            let mut blocks: u32 = 0;
            for (i, (src, l, dst)) in parts.by_ref().take(WIRE_BATCH).enumerate() {
                let runs = u32::try_from(l.runs())
                    .map_err(|_| Error::Stream(format!("a coded tensor of {} values", l.len)))?;
                p.sm[i] = src + l.sm as u64;
                p.table[i] = src + l.table as u64;
                p.chunks[i] = src + l.chunks as u64;
                p.bits[i] = src + l.bits as u64;
                p.out[i] = dst;
                p.len[i] = l.len as u64;
                p.first_block[i] = blocks;
                blocks = blocks
                    .checked_add(runs.div_ceil(256))
                    .ok_or_else(|| Error::Stream("a decode launch past 2^32 blocks".into()))?;
                p.count = i as u32 + 1;
            }
            p.first_block[p.count as usize] = blocks;
            let mut b = stream.launch_builder(&f);
            b.arg(&p);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes one `WireParts` by value (the same layout as
            // cuda/wire.cu's); each part's coded bytes lie in the staging buffer (sections
            // 16-byte aligned at a 256-byte aligned start, two spare rows of words after the
            // streams) and its output holds `len` bf16 values at `out`, inside the pack's
            // allocation.
            unsafe { b.launch(cfg) }
                .map_err(|e| Error::Cuda(format!("launching wire_decode_bf16: {e:?}")))?;
        }
        Ok(())
    }

    /// A staging ring for packed uploads of at most `wire` bytes on the link, in at most
    /// `pieces` pieces, whose raw prefix or coded parts take at most `part` each, to land in
    /// before their decode (`upload_pack`): pieces of up to `wire::staging_piece` bytes or one
    /// part, and room for the largest upload beside one piece (`staging_ring_bytes`). The copy
    /// stream waits here for the compute stream's work so far: the ring's memory may be a
    /// buffer the compute has just freed.
    pub(crate) fn alloc_staging(&self, wire: usize, part: usize, pieces: usize) -> Result<Staging> {
        let buf =
            self.alloc_packed(crate::backend::wire::staging_ring_bytes(wire, part, pieces).max(1))?;
        let (copy, decode) = (self.copy_stream()?.clone(), self.decode_stream()?.clone());
        copy.join(self.stream())
            .map_err(cuda_err("ordering the copy stream after compute"))?;
        let len = buf.len();
        Ok(Staging {
            buf,
            piece: crate::backend::wire::staging_piece(wire),
            ring: std::sync::Mutex::new(Ring::new(len, PACK_ALIGN)),
            compute: self.stream().clone(),
            copy,
            decode,
        })
    }

    /// The compute stream waits for an upload (no host wait).
    pub(crate) fn wait(&self, u: &Upload) -> Result<()> {
        self.stream()
            .wait(&u.0)
            .map_err(cuda_err("waiting for an upload"))
    }

    /// `wait`, between two timed events on the compute stream: the time from the compute
    /// work before the wait being done to the upload being done, the compute stream's stall.
    pub(crate) fn wait_timed(&self, u: &Upload) -> Result<Stall> {
        let s = self.stream();
        let before = s
            .record_event(TIMED)
            .map_err(cuda_err("recording a wait's start"))?;
        self.wait(u)?;
        let after = s
            .record_event(TIMED)
            .map_err(cuda_err("recording a wait's end"))?;
        Ok(Stall(before, after))
    }
}

/// The compute stream's events around a wait for an upload (`CudaDevice::wait_timed`).
pub struct Stall(CudaEvent, CudaEvent);

impl Stall {
    /// Once both events have completed: the milliseconds the compute stream stood waiting.
    pub(crate) fn ms(&self) -> Option<f64> {
        (self.0.is_complete() && self.1.is_complete())
            .then(|| self.0.elapsed_ms(&self.1).ok().map(f64::from))
            .flatten()
    }
}

/// The host address of pinned memory, without the host-side synchronisation `as_slice` does
/// (the buffer is only read by copies).
fn host_ptr(p: &PinnedHostSlice<u8>) -> Result<*const u8> {
    // `as_ptr` waits on the slice's event, which only copies through cudarc's own calls
    // record; ours do not, so it returns at once.
    p.as_ptr().map_err(cuda_err("reading the pinned buffer"))
}
