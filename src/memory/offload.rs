//! Offloading of checkpoint inputs to host memory (`memory.offload_inputs`): the values a
//! checkpointed block keeps for its re-run (its input activations, 28 MiB a Flux block at
//! 1024²) wait in page-locked host memory between the forward and the backward instead of on
//! the GPU. The checkpoint's forward hands each input to [`InputOffload::pack`], which starts
//! a device-to-host copy on the device's offload stream (apart from the weights' copy stream,
//! so waiting for it never means waiting for weights prefetched ahead) and keeps the device buffer only until the next
//! block's inputs are packed (by then the copy has long finished; the compute stream waits on
//! its event before the buffer is freed, so the cache never reuses memory a copy still reads).
//! The backward's re-run unpacks in reverse order: unpacking one input uploads it (unless it
//! was prefetched) and starts the upload of the input packed just before it, so the copy of
//! the next block's inputs overlaps this block's recompute and backward.
//!
//! What is offloaded: inputs that need a gradient (the activations flowing from block to
//! block) of at least `min_bytes`. Inputs without a gradient (Flux's positional embedding,
//! the conditioning vector) are shared by every block and stay on the device. With
//! [`InputOffload::keeping_outputs`], the outputs a checkpoint keeps from its forward for its
//! re-run (attention's, the down-projections': `autograd::Keep`) of at least `min_bytes` wait
//! in host memory too (`memory.offload_kept`): packed before the block's inputs and unpacked
//! after them, in reverse, so each unpack's prefetch fetches the next one read. An unpacked
//! slot is not fetched again by a later unpack's prefetch.
//!
//! On the CPU backend "host memory" is a second copy: the mechanism runs the same way, which
//! is how its bookkeeping is tested without a GPU.

use super::link::{HostCopy, Ticket};
use crate::autograd::{PackedTensor, SavedHooks};
use crate::{Device, Error, Result, Shape, Tensor};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// What an [`InputOffload`] has done, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadReport {
    /// Inputs copied to host memory.
    pub packed: u64,
    /// Bytes copied to host memory.
    pub packed_bytes: u64,
    /// Inputs brought back to the device.
    pub unpacked: u64,
    /// Of those, the ones whose upload had started ahead (prefetched).
    pub prefetched: u64,
    /// Page-locked bytes allocated so far (buffers are recycled across steps).
    pub host_bytes: u64,
}

struct State {
    /// Device tensors whose copies are in flight, freed once the compute waited on them.
    pending: Vec<(Tensor, Ticket)>,
    /// Packed slots in pack order (the backward unpacks them in reverse).
    order: Vec<Weak<Slot>>,
    /// Host buffers of dropped slots, for reuse.
    free: Vec<HostCopy>,
    report: OffloadReport,
}

/// Saved-input hooks that keep checkpoint inputs in host memory (see the module docs).
pub struct InputOffload {
    /// Itself, for the slots' link back.
    me: Weak<InputOffload>,
    device: Device,
    min_bytes: usize,
    /// Kept outputs are offloaded too (`SavedHooks::pack_kept`).
    kept: bool,
    state: Mutex<State>,
}

impl std::fmt::Debug for InputOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "InputOffload({}, >= {} bytes)",
            self.device, self.min_bytes
        )
    }
}

/// One packed input.
struct Slot {
    owner: Weak<InputOffload>,
    shape: Shape,
    host: Mutex<Option<HostCopy>>,
    /// An upload started ahead of the unpack, with what to wait for.
    fetched: Mutex<Option<(Tensor, Ticket)>>,
    /// Unpacked already: a later unpack's prefetch passes it by.
    used: std::sync::atomic::AtomicBool,
}

impl InputOffload {
    /// Offloads the checkpoint inputs of at least `min_bytes` that need a gradient, on
    /// `device`.
    pub fn new(device: &Device, min_bytes: usize) -> Arc<Self> {
        Self::with_kept(device, min_bytes, false)
    }

    /// As [`InputOffload::new`], and the outputs checkpoints keep from their forwards wait in
    /// host memory too (see the module docs).
    pub fn keeping_outputs(device: &Device, min_bytes: usize) -> Arc<Self> {
        Self::with_kept(device, min_bytes, true)
    }

    fn with_kept(device: &Device, min_bytes: usize, kept: bool) -> Arc<Self> {
        Arc::new_cyclic(|me| InputOffload {
            me: me.clone(),
            device: device.clone(),
            min_bytes,
            kept,
            state: Mutex::new(State {
                pending: vec![],
                order: vec![],
                free: vec![],
                report: OffloadReport::default(),
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Poisoned("input offload state"))
    }

    /// What it has done so far.
    pub fn report(&self) -> Result<OffloadReport> {
        Ok(self.lock()?.report)
    }

    /// Frees the device buffers of finished copies (the compute work waits for each copy
    /// first, without a host wait).
    fn retire(&self, st: &mut State) -> Result<()> {
        for (t, ticket) in st.pending.drain(..) {
            self.device.wait(&ticket)?;
            drop(t);
        }
        Ok(())
    }

    /// Frees every device buffer still waiting for its copy (the end of a forward).
    pub fn flush(&self) -> Result<()> {
        let mut st = self.lock()?;
        self.retire(&mut st)
    }

    /// Starts the upload of `slot` unless it is fetched already.
    fn start_upload(&self, slot: &Slot) -> Result<()> {
        let mut fetched = slot
            .fetched
            .lock()
            .map_err(|_| Error::Poisoned("offload slot"))?;
        if fetched.is_some() {
            return Ok(());
        }
        let host = slot
            .host
            .lock()
            .map_err(|_| Error::Poisoned("offload slot"))?;
        let Some(h) = host.as_ref() else {
            return Err(Error::Stream(
                "an offloaded input was unpacked after its release".into(),
            ));
        };
        let (mut storages, ticket) = self.device.upload_offloaded(&[h])?;
        let storage = storages
            .pop()
            .ok_or_else(|| Error::Stream("an upload returned no buffer".into()))?;
        let t = Tensor::from_storage(storage, slot.shape.clone(), self.device.clone(), None);
        *fetched = Some((t, ticket));
        Ok(())
    }
}

impl SavedHooks for InputOffload {
    fn pack(&self, x: &Tensor) -> Result<Option<Arc<dyn PackedTensor>>> {
        if !x.requires_grad() {
            return Ok(None);
        }
        self.pack_value(x)
    }

    fn pack_kept(&self, x: &Tensor) -> Result<Option<Arc<dyn PackedTensor>>> {
        if !self.kept {
            return Ok(None);
        }
        self.pack_value(x)
    }
}

impl InputOffload {
    /// `x` (of at least `min_bytes`, on this device) copied to host memory.
    fn pack_value(&self, x: &Tensor) -> Result<Option<Arc<dyn PackedTensor>>> {
        let bytes = x.elem_count() * x.dtype().size_in_bytes();
        if bytes < self.min_bytes || x.device() != &self.device {
            return Ok(None);
        }
        let x = if x.is_contiguous() && x.layout().offset() == 0 {
            x.detach()
        } else {
            let _g = crate::no_grad();
            x.contiguous()?.detach()
        };
        let mut st = self.lock()?;
        self.retire(&mut st)?;
        st.order.retain(|w| w.strong_count() > 0);
        let pos = st.free.iter().position(|h| h.bytes() == bytes.max(1));
        let reuse = pos.map(|i| st.free.swap_remove(i));
        let reused = reuse.is_some();
        let (host, ticket) = {
            let s = x.storage()?;
            s.offload(x.elem_count(), reuse)?
        };
        if !reused {
            st.report.host_bytes += host.bytes() as u64;
        }
        st.report.packed += 1;
        st.report.packed_bytes += bytes as u64;
        st.pending.push((x.clone(), ticket));
        let slot = Arc::new(Slot {
            owner: self.me.clone(),
            shape: x.shape().clone(),
            host: Mutex::new(Some(host)),
            fetched: Mutex::new(None),
            used: std::sync::atomic::AtomicBool::new(false),
        });
        st.order.push(Arc::downgrade(&slot));
        Ok(Some(slot))
    }
}

impl PackedTensor for Slot {
    fn unpack(&self) -> Result<Tensor> {
        let owner = self
            .owner
            .upgrade()
            .ok_or_else(|| Error::Stream("an offloaded input outlived its offloader".into()))?;
        let mut st = owner.lock()?;
        owner.retire(&mut st)?;
        owner.start_upload(self)?;
        let (t, ticket) = self
            .fetched
            .lock()
            .map_err(|_| Error::Poisoned("offload slot"))?
            .take()
            .ok_or_else(|| Error::Stream("an offloaded input's upload vanished".into()))?;
        owner.device.wait(&ticket)?;
        st.report.unpacked += 1;
        self.used.store(true, std::sync::atomic::Ordering::Relaxed);
        // The next value the backward needs is the one packed before this one that is not
        // unpacked yet: start it.
        let me = st
            .order
            .iter()
            .position(|w| std::ptr::eq(w.as_ptr(), self as *const Slot));
        let waiting = |w: &Weak<Slot>| {
            w.upgrade()
                .filter(|s| !s.used.load(std::sync::atomic::Ordering::Relaxed))
        };
        if let Some(prev) = me.and_then(|i| st.order[..i].iter().rev().find_map(waiting)) {
            let already = prev
                .fetched
                .lock()
                .map_err(|_| Error::Poisoned("offload slot"))?
                .is_some();
            if !already {
                owner.start_upload(&prev)?;
                st.report.prefetched += 1;
            }
        }
        Ok(t)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The host buffer goes back to the offloader for the next step; a prefetched upload
        // nobody unpacked is waited for before its buffer is freed.
        let Some(owner) = self.owner.upgrade() else {
            return;
        };
        let Ok(mut st) = owner.lock() else {
            return;
        };
        if let Ok(mut f) = self.fetched.lock() {
            if let Some((t, ticket)) = f.take() {
                if owner.device.wait(&ticket).is_ok() {
                    drop(t);
                } else {
                    // Never free a buffer a copy may still write.
                    std::mem::forget(t);
                }
            }
        }
        if let Some(h) = self.host.lock().ok().and_then(|mut h| h.take()) {
            st.free.push(h);
        }
    }
}
