//! Work of the backward issued ahead of its turn on a helper thread: a checkpointed block's
//! re-run needs only the block's saved inputs, not the gradient that reaches it, so the
//! re-run of the next checkpoint the backward walk will meet can be issued while the walk
//! still issues the backward of the one before it. Where a step is paced by the host's issue
//! of many small kernels (SDXL's UNet: about 11,000 a step), two threads issuing halve the
//! re-runs' share of it; the GPU runs both threads' work on the same stream, in the order
//! it was issued, so the allocator's reuse of freed buffers stays ordered as on one thread
//! and the values are the same bit for bit. The cost is memory: the next re-run's
//! activations live beside the current block's backward (the planner counts them where it
//! turns this on).
//!
//! A checkpoint made with `CheckpointOptions::ahead` takes part (`crate::memory::BlockExec`
//! sets it where the plan says so: `crate::memory::Plan::rerun_ahead`).
//!
//! One helper thread, started at the first use, takes one job at a time: a job offered
//! while it is busy is refused (the caller runs the work itself), so a job never waits
//! behind another and nothing waits on the thread that waits for it.
//!
//! Thread-local state a job's work reads (the compute copies an adapter's forward takes,
//! `crate::nn::adapter::ComputeCopies`) crosses with it through carriers
//! ([`register_carrier`]): each, called on the offering thread, returns what re-enters that
//! state on the helper for the job's length.

use crate::{Error, Result};
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender};
use std::sync::{Mutex, OnceLock};

/// What a carrier returns: called on the helper thread before the job, its result (guards)
/// dropped there after it.
pub type Reenter = Box<dyn FnOnce() -> Box<dyn Any> + Send>;

/// A carrier: called on the thread offering a job, it captures that thread's state of one
/// kind (see the module docs).
pub type Carrier = fn() -> Reenter;

type Job = Box<dyn FnOnce() + Send>;

static CARRIERS: Mutex<Vec<Carrier>> = Mutex::new(Vec::new());
static TAKEN: AtomicU64 = AtomicU64::new(0);

struct Helper {
    jobs: Mutex<Sender<Job>>,
    busy: AtomicBool,
}

fn helper() -> Option<&'static Helper> {
    static HELPER: OnceLock<Option<Helper>> = OnceLock::new();
    HELPER
        .get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            std::thread::Builder::new()
                .name("flame-ahead".into())
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .ok()?;
            Some(Helper {
                jobs: Mutex::new(tx),
                busy: AtomicBool::new(false),
            })
        })
        .as_ref()
}

/// How many jobs the helper thread has taken in this process (a counter for tests and
/// reports).
pub fn taken() -> u64 {
    TAKEN.load(Ordering::Relaxed)
}

/// Adds a carrier of thread-local state for the jobs offered from now on (once per
/// function, however often it is registered).
pub fn register_carrier(c: Carrier) {
    if let Ok(mut v) = CARRIERS.lock() {
        if !v.iter().any(|&k| std::ptr::fn_addr_eq(k, c)) {
            v.push(c);
        }
    }
}

/// A job's result, once it is done.
pub(crate) struct Pending<T>(Receiver<std::thread::Result<T>>);

impl<T> Pending<T> {
    /// Waits for the job; an error if it panicked or its thread went away.
    pub(crate) fn wait(self) -> Result<T> {
        match self.0.recv() {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(Error::Autograd(
                "a re-run issued ahead on the helper thread panicked".into(),
            )),
            Err(_) => Err(Error::Autograd(
                "the helper thread ended before a re-run issued ahead on it".into(),
            )),
        }
    }
}

/// Offers `job` to the helper thread, with the offering thread's state the carriers take;
/// `None` when the helper is busy or could not start (the caller then does the work).
pub(crate) fn offer<T: Send + 'static>(
    job: impl FnOnce() -> T + Send + 'static,
) -> Option<Pending<T>> {
    let h = helper()?;
    if h.busy.swap(true, Ordering::AcqRel) {
        return None;
    }
    let carried: Vec<Reenter> = match CARRIERS.lock() {
        Ok(v) => v.iter().map(|c| c()).collect(),
        Err(_) => {
            h.busy.store(false, Ordering::Release);
            return None;
        }
    };
    let (tx, rx) = sync_channel(1);
    let wrapped: Job = Box::new(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let guards: Vec<Box<dyn Any>> = carried.into_iter().map(|c| c()).collect();
            let v = job();
            // Inner guards first, as they were entered.
            for g in guards.into_iter().rev() {
                drop(g);
            }
            v
        }));
        h.busy.store(false, Ordering::Release);
        let _ = tx.send(r);
    });
    let sent = h
        .jobs
        .lock()
        .map(|tx| tx.send(wrapped).is_ok())
        .unwrap_or(false);
    if !sent {
        h.busy.store(false, Ordering::Release);
        return None;
    }
    TAKEN.fetch_add(1, Ordering::Relaxed);
    Some(Pending(rx))
}
