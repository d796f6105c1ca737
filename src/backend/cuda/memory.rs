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
//! When the driver runs out of memory, the cache is emptied, the driver's pool trimmed and the
//! request tried once more.
//! Under a cap (FLAME_GPU_MEMORY_LIMIT, `set_memory_limit`, the planner's budget), the memory
//! the process holds is the cap, proven: the first request under it empties the cache, trims
//! the driver's pool and makes one driver allocation of the cap less what is in use (the
//! arena); buffers are then cut from it by best fit, a freed range merged with its free
//! neighbours, with no driver call and no pieces left in the driver's pool (which, fed
//! buffers of many sizes, kept gigabytes of pieces it could not reuse: measured 2–4 GiB over a
//! 12 GiB cap). Large requests are cut from the arena's top and small ones from its bottom; a
//! request that no free range holds although the cap does is served by the driver and counted
//! (`MemoryReport::overflows`: the process is past the cap while it lives). Memory
//! taken from the driver before the arena goes back to it when freed. Where the arena cannot
//! be made, the cache evicts instead: the smallest cached buffer that holds the request, then
//! the least recently freed, and the pool is trimmed past the cap + `POOL_SLACK`.

use crate::{Error, Result};
use cudarc::driver::{sys, CudaSlice, CudaStream, DeviceRepr};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

thread_local! {
    /// Whether this thread is issuing a re-run onto the side stream (`CudaDevice::side_window`):
    /// its kernels, GEMMs and buffers are the side stream's.
    static ON_SIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The stream this thread's work is ordered on now.
pub(crate) fn on() -> On {
    if ON_SIDE.with(|s| s.get()) {
        On::Side
    } else {
        On::Compute
    }
}

/// Sets whether this thread's work goes on the side stream; the previous setting.
pub(crate) fn set_on_side(side: bool) -> bool {
    ON_SIDE.with(|s| s.replace(side))
}

/// Requests are rounded up to this many bytes, so near sizes share a free list.
const ROUND: u64 = 512;

/// How far past a cap the driver's pool may hold memory (pieces of freed buffers it has not
/// reused yet) before it is trimmed: with the CUDA context's own ~0.5 GiB, the process stays
/// within the cap + 1 GiB.
const POOL_SLACK: u64 = 256 << 20;

/// The cap's arena is a multiple of this (the driver's allocation granularity).
const ARENA_GRAIN: u64 = 2 << 20;

/// Requests of at least this many bytes are cut from the arena's top, smaller ones from its
/// bottom.
const ARENA_LARGE: u64 = 32 << 20;

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
    /// Times cached buffers went back to the driver because a new buffer would have taken
    /// the memory held (in use plus cached) past the cap.
    pub evictions: u64,
    /// Buffers the driver served beyond the cap's arena because no free range of it held them
    /// although the cap did (the arena cut into pieces): each takes the process past the cap
    /// while it lives.
    pub overflows: u64,
    /// Times the driver's pool was trimmed after a host wait for the stream: it held more
    /// than the cap allows, or the driver ran out of memory (then the cache was emptied too
    /// and the request tried again). Each costs the host its lead over the GPU.
    pub flushes: u64,
    /// The largest free range of the cap's arena: the largest buffer a request can get
    /// without going past the cap (u64::MAX without an arena).
    pub arena_room: u64,
    /// Bytes of the cap's arena in no live buffer (0 without an arena): the process holds
    /// them from the driver although FLAME counts none of them in use.
    pub arena_free: u64,
    /// Windows of work the side stream ran so far (checkpoints' re-runs issued ahead beside
    /// the backward: `CudaDevice::set_side_stream`).
    pub side_windows: u64,
}

/// The free lists and counters of one device, shared by every buffer made on it.
pub(crate) struct Pool {
    device: String,
    ordinal: usize,
    stream: Arc<CudaStream>,
    /// Cached buffers by rounded size: (address, the tick at which it was freed), oldest
    /// first.
    free: Mutex<HashMap<u64, Vec<(sys::CUdeviceptr, u64)>>>,
    /// Counts frees, to find the least recently freed cached buffers.
    tick: AtomicU64,
    in_use: AtomicU64,
    peak: AtomicU64,
    limit: AtomicU64,
    allocations: AtomicU64,
    cached: AtomicU64,
    evictions: AtomicU64,
    flushes: AtomicU64,
    overflows: AtomicU64,
    /// The cap's arena, made at the first request under a cap.
    arena: Mutex<Option<Arena>>,
    has_arena: AtomicBool,
    /// Whether making the arena was tried (a failure falls back to the cache's eviction).
    arena_tried: AtomicBool,
    /// The side stream, once made (`CudaDevice::side_window`).
    side: std::sync::OnceLock<Arc<CudaStream>>,
    /// Driver allocations freed after the side stream's work, released once the compute
    /// stream has waited for it.
    deferred: Mutex<Vec<(sys::CUdeviceptr, u64)>>,
    side_windows: AtomicU64,
}

/// Device memory of `len` elements; dropping it returns the memory to its pool's cache.
pub(crate) struct DevBuf<T> {
    pub(crate) slice: ManuallyDrop<CudaSlice<T>>,
    home: Home,
}

/// Where a buffer's memory goes when it drops.
enum Home {
    /// Back to the pool's cache: a buffer of `bytes` bytes (rounded) of its own.
    Pool { bytes: u64, pool: Arc<Pool> },
    /// Nowhere: a part of a packed buffer, whose memory returns to the pool when its last
    /// part drops (the `Arc` this holds).
    Part(#[allow(dead_code)] Arc<Packed>),
    /// Back to the cap's arena: `bytes` at byte `offset` of it.
    Arena {
        offset: u64,
        bytes: u64,
        pool: Arc<Pool>,
    },
}

/// Under a cap: one driver allocation of the cap's size, cut into buffers by best fit (the
/// smallest free range that holds a request), a freed range merged with its free neighbours.
/// No driver call per buffer, no pieces the driver's pool cannot reuse: the memory the
/// process holds is the arena, whatever the buffers' sizes. Reuse is safe in compute-stream
/// order, as the cache's (copies into a new buffer wait for the compute stream first).
///
/// While a checkpoint's re-run runs on the side stream (`CudaDevice::side_window`), the two
/// streams' frees are kept apart by `Tag`s until each stream has waited for the other: the
/// side stream reuses what the compute stream freed before the side last waited for it, and
/// its own frees; the compute stream reuses what the side stream freed once it has waited
/// for that window's end.
struct Arena {
    base: sys::CUdeviceptr,
    size: u64,
    /// Free ranges by offset (-> length) and by (length, offset).
    by_offset: BTreeMap<u64, u64>,
    by_length: BTreeSet<(u64, u64)>,
    /// Offsets of the live large buffers.
    large: BTreeSet<u64>,
    /// The free ranges one of the streams may not reuse yet, by offset (see `Tag`); a range
    /// without one is free for both.
    tags: BTreeMap<u64, Tag>,
    /// One more than the times the side stream has waited for the compute stream's work.
    side_synced: u64,
    /// One more than the times the compute stream has waited for the side stream's work.
    main_synced: u64,
    /// Whether a side window is open (the side stream may take buffers).
    side_active: bool,
}

/// Which stream's work last used a free range that the other may not reuse yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tag {
    /// Freed after the compute stream's work while a side window was open, at this count of
    /// the side stream's waits (`Arena::side_synced`): the side stream may reuse it once it
    /// has waited again (0: no such free).
    main: u64,
    /// Freed after the side stream's work, at this count of the compute stream's waits
    /// (`Arena::main_synced`): the compute stream may reuse it once it has waited again
    /// (0: no such free).
    side: u64,
}

/// The stream a request or a free is ordered on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum On {
    Compute,
    Side,
}

impl Arena {
    fn new(base: sys::CUdeviceptr, size: u64) -> Arena {
        Arena {
            base,
            size,
            by_offset: BTreeMap::from([(0, size)]),
            by_length: BTreeSet::from([(size, 0)]),
            large: BTreeSet::new(),
            tags: BTreeMap::new(),
            side_synced: 1,
            main_synced: 1,
            side_active: false,
        }
    }

    /// Whether the free range at `off` may serve a request ordered on `on`.
    fn usable(&self, off: u64, on: On) -> bool {
        match (self.tags.get(&off), on) {
            (None, _) => true,
            (Some(t), On::Compute) => t.side < self.main_synced,
            (Some(t), On::Side) => t.main < self.side_synced,
        }
    }

    /// The offset of `bytes` for work on `on`: a small request (under `ARENA_LARGE`) cut
    /// from the start of the smallest free range below every live large buffer that holds it
    /// (else the smallest anywhere), a large one from the end of the highest free range that
    /// holds it, so large and small buffers grow from opposite ends and small ones do not
    /// split the room large ones need: a range a large buffer left among large ones (a
    /// streamed block's, whose successor takes its place) stays whole for the next large one.
    /// Ranges `on` may not reuse yet are passed over.
    fn take(&mut self, bytes: u64, on: On) -> Option<u64> {
        let (len, off) = if bytes < ARENA_LARGE {
            let low = self.large.first().copied().unwrap_or(self.size);
            let mut fits = self
                .by_length
                .range((bytes, 0)..)
                .filter(|&&(_, off)| self.usable(off, on));
            match fits.clone().find(|&&(len, off)| off + len <= low) {
                Some(r) => *r,
                None => *fits.next()?,
            }
        } else {
            self.by_offset
                .iter()
                .rev()
                .find(|(&off, &len)| len >= bytes && self.usable(off, on))
                .map(|(&off, &len)| (len, off))?
        };
        self.by_length.remove(&(len, off));
        self.by_offset.remove(&off);
        let tag = self.tags.remove(&off);
        let (rest, at) = if bytes < ARENA_LARGE {
            ((off + bytes, len - bytes), off)
        } else {
            ((off, len - bytes), off + len - bytes)
        };
        if rest.1 > 0 {
            self.by_offset.insert(rest.0, rest.1);
            self.by_length.insert((rest.1, rest.0));
            if let Some(t) = tag {
                self.tags.insert(rest.0, t);
            }
        }
        if bytes >= ARENA_LARGE {
            self.large.insert(at);
        }
        Some(at)
    }

    /// Frees `bytes` at `off` after work on `on`, merged with the free ranges on either side
    /// that carry the same tag.
    fn give(&mut self, mut off: u64, mut bytes: u64, on: On) {
        if bytes >= ARENA_LARGE {
            self.large.remove(&off);
        }
        let tag = match on {
            On::Compute if self.side_active => Some(Tag {
                main: self.side_synced,
                side: 0,
            }),
            On::Compute => None,
            On::Side => Some(Tag {
                main: 0,
                side: self.main_synced,
            }),
        };
        if let Some(&next) = self.by_offset.get(&(off + bytes)) {
            if self.tags.get(&(off + bytes)).copied() == tag {
                self.by_offset.remove(&(off + bytes));
                self.by_length.remove(&(next, off + bytes));
                self.tags.remove(&(off + bytes));
                bytes += next;
            }
        }
        if let Some((&prev, &len)) = self.by_offset.range(..off).next_back() {
            if prev + len == off && self.tags.get(&prev).copied() == tag {
                self.by_offset.remove(&prev);
                self.by_length.remove(&(len, prev));
                self.tags.remove(&prev);
                off = prev;
                bytes += len;
            }
        }
        self.by_offset.insert(off, bytes);
        self.by_length.insert((bytes, off));
        if let Some(t) = tag {
            self.tags.insert(off, t);
        }
    }

    /// Drops the tags both streams have waited past and merges the free neighbours they
    /// kept apart.
    fn clean(&mut self) {
        let (side, main) = (self.side_synced, self.main_synced);
        self.tags.retain(|_, t| !(t.main < side && t.side < main));
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (&off, &len) in &self.by_offset {
            match merged.last_mut() {
                Some((o, l))
                    if *o + *l == off
                        && !self.tags.contains_key(o)
                        && !self.tags.contains_key(&off) =>
                {
                    *l += len;
                }
                _ => merged.push((off, len)),
            }
        }
        if merged.len() < self.by_offset.len() {
            self.by_offset = merged.iter().copied().collect();
            self.by_length = merged.iter().map(|&(o, l)| (l, o)).collect();
        }
    }

    /// The largest free range.
    fn largest(&self) -> u64 {
        self.by_length.iter().next_back().map_or(0, |r| r.0)
    }
}

/// One allocation of the pool cut into parts of several element types: the device copy of a
/// streamed block's weights, brought in by one copy or decoded into it (`crate::memory`).
/// Counted once, as the buffer it is; each part is a `DevBuf` of its own (offset 0, its own
/// length) that keeps the whole alive.
pub(crate) struct Packed {
    buf: DevBuf<u8>,
    base: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

impl Packed {
    /// The device address of the first byte.
    pub(crate) fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// The bytes of the allocation.
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    /// `len` elements of `T` from byte `offset` on, as a buffer of its own. The range must lie
    /// inside the allocation and `offset` be a multiple of `T`'s alignment.
    pub(crate) fn part<T: DeviceRepr>(
        self: &Arc<Self>,
        offset: usize,
        len: usize,
    ) -> Result<DevBuf<T>> {
        let size = std::mem::size_of::<T>();
        let end = offset + len.max(1) * size;
        if end > self.len() || offset % std::mem::align_of::<T>() != 0 {
            return Err(Error::Cuda(format!(
                "internal: part of {len} elements at byte {offset} of a packed buffer of {} bytes",
                self.len()
            )));
        }
        // SAFETY: the range lies inside the allocation (checked above), which this part keeps
        // alive through its `Home::Part`; the part's drop leaks the slice instead of freeing it.
        let slice = unsafe {
            self.stream
                .upgrade_device_ptr::<T>(self.base + offset as u64, len.max(1))
        };
        Ok(DevBuf {
            slice: ManuallyDrop::new(slice),
            home: Home::Part(self.clone()),
        })
    }
}

impl<T> DevBuf<T> {
    pub(crate) fn len(&self) -> usize {
        self.slice.len()
    }
}

impl<T: DeviceRepr> DevBuf<T> {
    /// The raw device address, for kernel parameter structs (event tracking is off, so
    /// cudarc's guard has nothing to record).
    pub(crate) fn raw(&self, stream: &CudaStream) -> u64 {
        use cudarc::driver::DevicePtr;
        self.slice.device_ptr(stream).0
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let ptr = slice.leak();
        let (bytes, pool) = match &self.home {
            Home::Pool { bytes, pool } => (bytes, pool),
            Home::Arena {
                offset,
                bytes,
                pool,
            } => {
                pool.in_use.fetch_sub(*bytes, Ordering::Relaxed);
                if let Ok(mut a) = pool.arena.lock() {
                    if let Some(a) = a.as_mut() {
                        a.give(*offset, *bytes, on());
                    }
                }
                return;
            }
            // A part: the packed buffer's memory returns when the last part drops.
            Home::Part(_) => return,
        };
        pool.in_use.fetch_sub(*bytes, Ordering::Relaxed);
        // With an arena, memory from the driver goes back to it: the cap counts the arena.
        // After the side stream's work, once the compute stream has waited for it.
        if pool.has_arena.load(Ordering::Relaxed) {
            if on() == On::Side {
                if let Ok(mut d) = pool.deferred.lock() {
                    d.push((ptr, *bytes));
                    return;
                }
            }
            pool.release(ptr, *bytes);
            return;
        }
        match pool.free.lock() {
            Ok(mut free) => {
                let tick = pool.tick.fetch_add(1, Ordering::Relaxed);
                free.entry(*bytes).or_default().push((ptr, tick));
                pool.cached.fetch_add(*bytes, Ordering::Relaxed);
            }
            // A poisoned cache: hand the memory back to the driver instead.
            Err(_) => pool.release(ptr, *bytes),
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
            tick: AtomicU64::new(0),
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            allocations: AtomicU64::new(0),
            cached: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
            arena: Mutex::new(None),
            has_arena: AtomicBool::new(false),
            arena_tried: AtomicBool::new(false),
            side: std::sync::OnceLock::new(),
            deferred: Mutex::new(Vec::new()),
            side_windows: AtomicU64::new(0),
        }
    }

    /// Makes the cap's arena, once: the cache and the driver's unused pool memory go back
    /// first (after a host wait), then one driver allocation of the cap less what is in use.
    fn make_arena(&self, limit: u64, in_use: u64) {
        if self.arena_tried.swap(true, Ordering::Relaxed) {
            return;
        }
        self.empty();
        self.stream.synchronize().ok();
        trim_pool(self.ordinal);
        let size = (limit.saturating_sub(in_use) / ARENA_GRAIN) * ARENA_GRAIN;
        if size == 0 || self.stream.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: a plain device allocation, freed in `Drop for Pool`; buffers cut from it
        // are written before they are read (as any new buffer).
        let Ok(base) = (unsafe { cudarc::driver::result::malloc_sync(size as usize) }) else {
            return;
        };
        if let Ok(mut a) = self.arena.lock() {
            *a = Some(Arena::new(base, size));
            self.has_arena.store(true, Ordering::Relaxed);
        }
        let _ = self.apply_release_threshold();
    }

    /// Frees the cap's arena when no live buffer is cut from it, so that the next cap makes
    /// its own: a process that caps, lifts the cap and caps again (the step bench's
    /// alternation of plans) otherwise keeps the first cap's arena, and every request past
    /// it goes to the driver, counted as an overflow, at a driver call each. The context
    /// must be bound to the thread.
    pub(crate) fn drop_idle_arena(&self) {
        if !self.has_arena() {
            return;
        }
        let Ok(mut a) = self.arena.lock() else {
            return;
        };
        let idle = a
            .as_ref()
            .is_some_and(|a| a.by_offset.values().sum::<u64>() == a.size);
        if !idle {
            return;
        }
        if let Some(arena) = a.take() {
            self.has_arena.store(false, Ordering::Relaxed);
            // The work enqueued on the freed ranges finishes first.
            self.stream.synchronize().ok();
            // SAFETY: the arena's allocation, with no buffer cut from it alive.
            let _ = unsafe { cudarc::driver::result::free_sync(arena.base) };
            self.arena_tried.store(false, Ordering::Relaxed);
        }
    }

    /// Sets the driver pool's release threshold for the cap and the arena as they are now:
    /// all it holds without a cap, up to the cap under one, none once the cap's arena holds
    /// FLAME's buffers (the pool then serves only requests the arena could not place, and
    /// what they free goes back to the device at the next synchronisation instead of
    /// staying pooled beside the arena). The context must be bound to the thread.
    pub(crate) fn apply_release_threshold(&self) -> Result<()> {
        let keep = match (self.limit.load(Ordering::Relaxed), self.has_arena()) {
            (u64::MAX, _) => u64::MAX,
            (_, true) => 0,
            (limit, false) => limit,
        };
        set_release_threshold(self.ordinal, keep)
    }

    /// Whether the cap's arena exists.
    fn has_arena(&self) -> bool {
        self.has_arena.load(Ordering::Relaxed)
    }

    /// `bytes` from the arena, if there is one: its offset, or None when no free range holds
    /// them (with the largest free range).
    /// Work that finds no range its stream may reuse makes that stream wait for the other's
    /// work so far (the other's frees are then its to reuse too) and asks again.
    fn arena_take(&self, bytes: u64) -> Option<std::result::Result<(sys::CUdeviceptr, u64), u64>> {
        if !self.has_arena.load(Ordering::Relaxed) {
            return None;
        }
        let mut a = self.arena.lock().ok()?;
        let a = a.as_mut()?;
        let on = on();
        let mut taken = a.take(bytes, on);
        if taken.is_none() && !a.tags.is_empty() {
            // The ranges the other stream's work freed become this stream's once it waits
            // for that work.
            if self.waits(a, on).is_ok() {
                a.clean();
                taken = a.take(bytes, on);
            }
        }
        Some(match taken {
            Some(off) => Ok((a.base + off, off)),
            None => Err(a.largest()),
        })
    }

    /// The side stream waits for the compute stream's work queued so far, or the compute
    /// stream for the side's (`on`: the stream that waits); under the arena's lock, so no
    /// free slips between the mark and the count.
    fn waits(&self, a: &mut Arena, on: On) -> Result<()> {
        let side = self.side.get().ok_or(Error::Poisoned("the side stream"))?;
        let (waiter, leader, count) = match on {
            On::Side => (side, &self.stream, &mut a.side_synced),
            On::Compute => (&self.stream, side, &mut a.main_synced),
        };
        let mark = leader
            .record_event(None)
            .map_err(|e| Error::Cuda(format!("marking a stream for the other: {e:?}")))?;
        waiter
            .wait(&mark)
            .map_err(|e| Error::Cuda(format!("a stream waiting for the other: {e:?}")))?;
        *count += 1;
        Ok(())
    }

    /// Makes `side` the side stream (once).
    pub(crate) fn set_side_stream(&self, side: Arc<CudaStream>) {
        let _ = self.side.set(side);
    }

    /// Opens a window of work on the side stream, which first waits for the compute stream's
    /// work so far: false without an arena (nothing then keeps the streams' reuse apart, so
    /// the work stays on the compute stream).
    pub(crate) fn side_open(&self) -> Result<bool> {
        if !self.has_arena() || self.side.get().is_none() {
            return Ok(false);
        }
        let mut a = self
            .arena
            .lock()
            .map_err(|_| Error::Poisoned("the GPU arena"))?;
        let Some(a) = a.as_mut() else {
            return Ok(false);
        };
        self.waits(a, On::Side)?;
        a.side_active = true;
        a.clean();
        self.side_windows.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Closes the open side window: the event of its work's end.
    pub(crate) fn side_close(&self) -> Result<cudarc::driver::CudaEvent> {
        let side = self.side.get().ok_or(Error::Poisoned("the side stream"))?;
        let mut a = self
            .arena
            .lock()
            .map_err(|_| Error::Poisoned("the GPU arena"))?;
        if let Some(a) = a.as_mut() {
            a.side_active = false;
        }
        side.record_event(None)
            .map_err(|e| Error::Cuda(format!("marking the side stream: {e:?}")))
    }

    /// The compute stream waits for a side window's `end`; what the side stream's work
    /// freed is then the compute stream's to reuse.
    pub(crate) fn side_settle(&self, end: &cudarc::driver::CudaEvent) -> Result<()> {
        {
            let mut a = self
                .arena
                .lock()
                .map_err(|_| Error::Poisoned("the GPU arena"))?;
            self.stream
                .wait(end)
                .map_err(|e| Error::Cuda(format!("the compute stream waiting: {e:?}")))?;
            if let Some(a) = a.as_mut() {
                a.main_synced += 1;
                a.clean();
            }
        }
        let freed = self
            .deferred
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default();
        for (ptr, bytes) in freed {
            self.release(ptr, bytes);
        }
        Ok(())
    }

    pub(crate) fn report(&self) -> MemoryReport {
        MemoryReport {
            in_use: self.in_use.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            limit: self.limit.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            cached: self.cached.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            overflows: self.overflows.load(Ordering::Relaxed),
            arena_room: self.arena_room(),
            arena_free: self.arena_free(),
            side_windows: self.side_windows.load(Ordering::Relaxed),
        }
    }

    /// Bytes of the cap's arena in no live buffer, or 0 without one.
    fn arena_free(&self) -> u64 {
        if !self.has_arena.load(Ordering::Relaxed) {
            return 0;
        }
        match self.arena.lock() {
            Ok(a) => a.as_ref().map_or(0, |a| a.by_offset.values().sum()),
            Err(_) => 0,
        }
    }

    /// The largest free range of the cap's arena, or u64::MAX without one.
    pub(crate) fn arena_room(&self) -> u64 {
        if !self.has_arena.load(Ordering::Relaxed) {
            return u64::MAX;
        }
        match self.arena.lock() {
            Ok(a) => a.as_ref().map_or(u64::MAX, Arena::largest),
            Err(_) => 0,
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
        let oom = |in_use: u64, limit: u64, device_full: bool| Error::OutOfMemory {
            device: self.device.clone(),
            requested: bytes,
            in_use,
            limit,
            device_full,
        };
        if in_use.saturating_add(bytes) > limit {
            self.in_use.fetch_sub(bytes, Ordering::Relaxed);
            return Err(oom(in_use, limit, false));
        }
        // Under a cap, buffers come from the cap's arena.
        if limit != u64::MAX {
            self.make_arena(limit, in_use);
        }
        match self.arena_take(bytes) {
            Some(Ok((ptr, offset))) => {
                self.peak.fetch_max(in_use + bytes, Ordering::Relaxed);
                self.allocations.fetch_add(1, Ordering::Relaxed);
                // SAFETY: `bytes` >= len * size_of::<T>() bytes at `ptr` are inside the arena
                // and owned by this buffer alone until it drops (and leaks the slice).
                let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len.max(1)) };
                return Ok(DevBuf {
                    slice: ManuallyDrop::new(slice),
                    home: Home::Arena {
                        offset,
                        bytes,
                        pool: self.clone(),
                    },
                });
            }
            // No free range holds it although the cap does (the arena is cut into pieces):
            // the driver serves it, counted, and it goes back to the driver when freed.
            Some(Err(_)) => {
                self.overflows.fetch_add(1, Ordering::Relaxed);
            }
            None => {}
        }
        // (A poisoned cache is bypassed: the driver serves the request.)
        let reused = self
            .free
            .lock()
            .ok()
            .and_then(|mut free| free.get_mut(&bytes).and_then(Vec::pop))
            .map(|(ptr, _)| ptr);
        // Under a cap, the memory the process holds (buffers in use plus the cache) stays
        // within it too, so a capped run proves what a smaller card holds: when a new buffer
        // would take it past the cap, the least recently freed cached buffers go back to the
        // driver's pool (stream-ordered, no host wait), as many as that takes.
        if reused.is_none() && limit != u64::MAX {
            let held = (in_use + bytes).saturating_add(self.cached.load(Ordering::Relaxed));
            if held > limit {
                self.evictions.fetch_add(1, Ordering::Relaxed);
                self.evict(held - limit, bytes);
            }
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
                        oom(in_use, total(), true)
                    } else {
                        Error::Cuda(format!("allocating {bytes} bytes: {e:?}"))
                    });
                }
            },
        };
        // The driver's pool keeps what was freed to it; when the pieces it could not reuse
        // take what it holds past the cap by more than `POOL_SLACK`, the cache goes back to it
        // and it hands its unused memory to the driver, after a host wait for the work that
        // may still use it. The cache then refills from nothing, so this is rare.
        if reused.is_none()
            && limit != u64::MAX
            && pool_reserved(self.ordinal).is_ok_and(|r| r > limit.saturating_add(POOL_SLACK))
        {
            self.flushes.fetch_add(1, Ordering::Relaxed);
            self.empty();
            self.stream.synchronize().ok();
            trim_pool(self.ordinal);
        }
        self.peak.fetch_max(in_use + bytes, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(DevBuf {
            slice: ManuallyDrop::new(slice),
            home: Home::Pool {
                bytes,
                pool: self.clone(),
            },
        })
    }

    /// A buffer of `bytes` bytes to be cut into parts (`Packed::part`).
    pub(crate) fn alloc_packed(
        self: &Arc<Self>,
        bytes: usize,
        total: impl Fn() -> u64,
    ) -> Result<Arc<Packed>> {
        let buf = self.alloc::<u8>(bytes, total)?;
        use cudarc::driver::DevicePtr;
        let base = buf.slice.device_ptr(&self.stream).0;
        Ok(Arc::new(Packed {
            buf,
            base,
            stream: self.stream.clone(),
        }))
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
                // The cache and the pool's unused memory back to the driver, once the work
                // that may still use them is done.
                self.flushes.fetch_add(1, Ordering::Relaxed);
                self.empty();
                self.stream.synchronize().ok();
                trim_pool(self.ordinal);
                get()
            }
            r => r,
        }
    }

    /// Returns cached buffers to the driver's pool until `need` bytes (or the whole cache)
    /// went back, for a new buffer of `bytes`: first the smallest cached buffer that could hold
    /// it (the pool can cut the new one from its memory instead of reserving more), then the
    /// least recently freed.
    fn evict(&self, need: u64, bytes: u64) {
        let Ok(mut free) = self.free.lock() else {
            return;
        };
        // Takes the oldest buffer of list `size` out of the cache, back to the driver.
        let take = |free: &mut HashMap<u64, Vec<(sys::CUdeviceptr, u64)>>, size: u64| {
            let list = free.get_mut(&size)?;
            if list.is_empty() {
                free.remove(&size);
                return None;
            }
            let (ptr, _) = list.remove(0);
            if list.is_empty() {
                free.remove(&size);
            }
            self.cached.fetch_sub(size, Ordering::Relaxed);
            self.release(ptr, size);
            Some(size)
        };
        let mut freed = 0u64;
        let fit = free
            .iter()
            .filter(|(&b, v)| b >= bytes && !v.is_empty())
            .map(|(&b, _)| b)
            .min();
        if let Some(fit) = fit {
            freed += take(&mut free, fit).unwrap_or(0);
        }
        while freed < need {
            // The list whose oldest buffer is the oldest of all.
            let Some(size) = free
                .iter()
                .filter_map(|(&b, v)| v.first().map(|&(_, tick)| (tick, b)))
                .min()
                .map(|(_, b)| b)
            else {
                break;
            };
            match take(&mut free, size) {
                Some(n) => freed += n,
                None => continue,
            }
        }
    }

    /// Returns every cached buffer to the driver's pool.
    pub(crate) fn empty(&self) {
        let lists = match self.free.lock() {
            Ok(mut free) => std::mem::take(&mut *free),
            Err(_) => return,
        };
        for (bytes, ptrs) in lists {
            for (ptr, _) in ptrs {
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
        if let Ok(Some(a)) = self.arena.get_mut().map(Option::take) {
            self.stream.synchronize().ok();
            // SAFETY: the arena's allocation; no buffer cut from it outlives the pool (each
            // holds an `Arc` of it).
            let _ = unsafe { cudarc::driver::result::free_sync(a.base) };
            let _ = a.size;
        }
    }
}

/// The driver's default memory pool of GPU `ordinal`, which FLAME's allocations come from.
fn default_pool(ordinal: usize) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-parameter; ordinal was opened by CudaContext::new, so it is valid.
    let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal as sys::CUdevice) };
    if r != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::Cuda(format!("cuDeviceGetDefaultMemPool: {r:?}")));
    }
    Ok(pool)
}

/// Returns the driver pool's unused memory to the device (memory whose stream-ordered free
/// has not completed yet stays).
pub(super) fn trim_pool(ordinal: usize) {
    if let Ok(pool) = default_pool(ordinal) {
        // SAFETY: a valid pool handle; trimming only releases unused memory.
        let _ = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
    }
}

/// Bytes the driver's pool of GPU `ordinal` holds (in use plus kept for reuse).
pub(super) fn pool_reserved(ordinal: usize) -> Result<u64> {
    pool_attribute(
        ordinal,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    )
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

/// How much freed memory the driver's pool keeps for reuse at a synchronisation
/// (`Pool::apply_release_threshold` chooses it: under a cap without an arena, up to the cap,
/// so that the memory the process holds goes back under the cap at every sync without FLAME
/// waiting for it).
fn set_release_threshold(ordinal: usize, bytes: u64) -> Result<()> {
    let pool = default_pool(ordinal)?;
    let mut threshold: u64 = bytes;
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// An arena with a side window open, as `Pool::side_open` leaves it.
    fn opened(a: &mut Arena) {
        a.side_synced += 1;
        a.side_active = true;
    }

    #[test]
    fn without_a_side_window_frees_merge_and_serve_both_streams() {
        let mut a = Arena::new(0, 16 * MIB);
        let x = a.take(MIB, On::Compute).unwrap();
        let y = a.take(MIB, On::Compute).unwrap();
        a.give(x, MIB, On::Compute);
        a.give(y, MIB, On::Compute);
        assert!(a.tags.is_empty());
        assert_eq!(a.by_offset.len(), 1, "{:?}", a.by_offset);
        assert_eq!(a.largest(), 16 * MIB);
    }

    #[test]
    fn each_stream_reuses_the_others_frees_only_after_waiting_for_them() {
        let mut a = Arena::new(0, 8 * MIB);
        // Fill the arena with four buffers, then open a window.
        let bufs: Vec<u64> = (0..4)
            .map(|_| a.take(2 * MIB, On::Compute).unwrap())
            .collect();
        opened(&mut a);
        // The compute stream frees one while the side works: not the side's yet.
        a.give(bufs[0], 2 * MIB, On::Compute);
        assert_eq!(a.take(2 * MIB, On::Side), None);
        // The side frees one of its own: its to reuse, not the compute stream's.
        a.give(bufs[1], 2 * MIB, On::Side);
        let again = a.take(2 * MIB, On::Side).unwrap();
        assert_eq!(again, bufs[1]);
        a.give(again, 2 * MIB, On::Side);
        // The compute stream takes its own free, never the side's.
        assert_eq!(a.take(2 * MIB, On::Compute), Some(bufs[0]));
        assert_eq!(a.take(2 * MIB, On::Compute), None);
        a.give(bufs[0], 2 * MIB, On::Compute);
        // The two frees sit side by side but stay apart: their tags differ.
        assert_eq!(a.by_offset.len(), 2, "{:?}", a.by_offset);
        // The window closes and the compute stream waits for its end: the side's free is
        // the compute stream's; the compute stream's free is still not the side's.
        a.side_active = false;
        a.main_synced += 1;
        a.clean();
        assert!(a.usable(bufs[1], On::Compute));
        assert!(!a.usable(bufs[0], On::Side));
        // The next window waits for the compute stream first: everything is both's, merged.
        opened(&mut a);
        a.clean();
        assert!(a.tags.is_empty(), "{:?}", a.tags);
        assert_eq!(a.by_offset.len(), 1, "{:?}", a.by_offset);
        assert_eq!(a.take(4 * MIB, On::Side), Some(0));
    }

    #[test]
    fn a_split_range_keeps_its_tag() {
        let mut a = Arena::new(0, 8 * MIB);
        let x = a.take(4 * MIB, On::Compute).unwrap();
        let _rest = a.take(4 * MIB, On::Compute).unwrap();
        opened(&mut a);
        a.give(x, 4 * MIB, On::Side);
        let part = a.take(MIB, On::Side).unwrap();
        assert_eq!(part, x);
        // The rest of the side's free is still the side's alone, until the compute stream
        // waits for the side's work so far.
        assert!(!a.usable(x + MIB, On::Compute));
        assert!(a.usable(x + MIB, On::Side));
        assert_eq!(a.take(MIB, On::Compute), None);
        a.main_synced += 1;
        assert_eq!(a.take(MIB, On::Compute), Some(x + MIB));
    }
}
