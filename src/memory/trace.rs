//! A record of device memory around each run of a block, for finding where a step's peak
//! falls against the planner's terms (`benches/train_step.rs --memory-trace`). Off unless
//! [`trace_blocks`] turns it on; when on, each block's run resets the device's peak count
//! (`CudaDevice::reset_peak_memory`) at its start, so a phase's peak read around it is the
//! last block's.

use crate::Tensor;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Device memory around one run of a block: the bytes FLAME's allocator held in live buffers
/// when it began and when it ended, and the most in between (zeros on the CPU backend).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMemory {
    /// The block's key prefix.
    pub prefix: String,
    /// A checkpointed block's re-run in the backward (else its forward).
    pub rerun: bool,
    /// Bytes in use when the run began.
    pub before: u64,
    /// The most bytes in use during the run.
    pub peak: u64,
    /// Bytes in use when the run ended (its outputs and what its tape keeps included).
    pub after: u64,
}

static TRACING: AtomicBool = AtomicBool::new(false);
static TRACE: Mutex<Vec<BlockMemory>> = Mutex::new(Vec::new());

/// Records each block run from now on ([`take_block_trace`]), or stops.
pub fn trace_blocks(on: bool) {
    TRACING.store(on, Ordering::Relaxed);
}

/// Whether block runs are being recorded.
pub(crate) fn tracing() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// The block runs recorded since the last call, in the order they ran.
pub fn take_block_trace() -> Vec<BlockMemory> {
    match TRACE.lock() {
        Ok(mut v) => std::mem::take(&mut *v),
        Err(e) => std::mem::take(&mut *e.into_inner()),
    }
}

/// (bytes in use, peak) of the device `t` lives on, the peak reset to what is in use when
/// `reset`; zeros off a GPU.
fn device_memory(t: Option<&Tensor>, reset: bool) -> (u64, u64) {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Some(crate::Device::Cuda(c)) = t.map(Tensor::device) {
        if reset {
            c.reset_peak_memory();
        }
        let r = c.memory();
        return (r.in_use, r.peak);
    }
    let _ = (t, reset);
    (0, 0)
}

/// Runs `f(inputs)` for block `prefix`, recording its memory (`rerun`: a re-run in the
/// backward).
pub(crate) fn traced<T>(
    prefix: &str,
    rerun: bool,
    inputs: &[Tensor],
    f: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<T> {
    let (before, _) = device_memory(inputs.first(), true);
    let out = f()?;
    let (after, peak) = device_memory(inputs.first(), false);
    let rec = BlockMemory {
        prefix: prefix.to_string(),
        rerun,
        before,
        peak: peak.max(after),
        after,
    };
    match TRACE.lock() {
        Ok(mut v) => v.push(rec),
        Err(e) => e.into_inner().push(rec),
    }
    Ok(out)
}
