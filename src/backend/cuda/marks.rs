//! Marks: events without timing that order one stream after another's work, kept for reuse.
//! A streamed block's upload orders its copies, decodes and the compute between three
//! streams with a few events a staged piece; made and destroyed each time, with their
//! timing on, they cost the host about twice the driver calls of the ordering itself (an
//! SDXL step within 4 GiB streamed about 150 uploads of eight pieces each). A mark goes back
//! to its device's free list when its last holder drops it: nothing can wait on it then, and
//! a stream that waited on it before is not affected by its next record (the driver's
//! `cuStreamWaitEvent` takes the record of the moment). Holders only wait on a mark or query
//! it; none records it again (it is recorded once, when handed out).

use super::cuda_err;
use crate::Result;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

/// Free marks kept at most: more than an upload ring's pieces and tickets in flight.
const KEPT: usize = 4096;

/// The events of a device that no one holds, to be recorded again.
pub(crate) struct Marks {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<CudaEvent>>,
}

impl Marks {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Marks {
            ctx,
            free: Mutex::new(Vec::new()),
        })
    }

    /// A mark of `stream`'s work so far: a free event recorded there, or a new one.
    pub(crate) fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<Mark> {
        let reused = self.free.lock().ok().and_then(|mut f| f.pop());
        let ev = match reused {
            Some(e) => e,
            None => self
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda_err("making an event"))?,
        };
        // Recorded before it is handed out: an error drops it (the driver destroys it).
        ev.record(stream).map_err(cuda_err("recording an event"))?;
        Ok(Mark {
            ev: ManuallyDrop::new(ev),
            home: Some(self.clone()),
        })
    }

    /// Makes `waiter` wait for `on`'s work so far (no host wait).
    pub(crate) fn join(self: &Arc<Self>, waiter: &CudaStream, on: &CudaStream) -> Result<()> {
        let m = self.record(on)?;
        waiter
            .wait(&m)
            .map_err(cuda_err("ordering one stream after another"))
    }
}

/// An event held by its users (an upload's ticket, the staging ring's record of a piece):
/// back to its device's `Marks` when dropped, or destroyed where it has none (a timed event).
pub(crate) struct Mark {
    /// Taken only when the mark drops.
    ev: ManuallyDrop<CudaEvent>,
    home: Option<Arc<Marks>>,
}

impl Mark {
    /// An event of its own (timed, say), destroyed when dropped.
    pub(crate) fn own(ev: CudaEvent) -> Mark {
        Mark {
            ev: ManuallyDrop::new(ev),
            home: None,
        }
    }
}

impl std::ops::Deref for Mark {
    type Target = CudaEvent;
    fn deref(&self) -> &CudaEvent {
        &self.ev
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        // SAFETY: the event is not read again: the mark is being dropped.
        let ev = unsafe { ManuallyDrop::take(&mut self.ev) };
        if let Some(home) = &self.home {
            if let Ok(mut free) = home.free.lock() {
                if free.len() < KEPT {
                    free.push(ev);
                }
            }
        }
    }
}
