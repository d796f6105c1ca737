//! Kernel time by category: with [`enable`] on, every kernel FLAME launches on a GPU is
//! bracketed by a pair of events, filed under its category (the kernel's module in cuda/,
//! "gemm" for cuBLAS, "cast" for dtype conversions) and, inside a [`scope`], under the
//! scope's name as well; [`report`] waits for the device and sums the events' times. The
//! events cost the host a few microseconds per kernel, so the step's wall time is taken
//! with profiling off; the difference to the kernels' sum is the time the GPU waited.
//!
//! Scopes are the forward's only: the backward's kernels of a scoped layer are filed under
//! their own categories.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

static ON: AtomicBool = AtomicBool::new(false);

thread_local! {
    static SCOPE: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Turns kernel timing on or off (off by default); turning it on forgets earlier records.
pub fn enable(on: bool) {
    #[cfg(feature = "cuda")]
    if on {
        if let Ok(mut r) = imp::RECORDS.lock() {
            r.clear();
        }
    }
    ON.store(on, Ordering::Relaxed);
}

/// Whether kernel timing is on.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Files the kernels this thread launches until the guard drops under `name` too (the
/// innermost scope wins).
pub fn scope(name: &'static str) -> ScopeGuard {
    let prev = SCOPE.with(|s| s.replace(Some(name)));
    ScopeGuard(prev)
}

/// Restores the enclosing scope when dropped.
pub struct ScopeGuard(Option<&'static str>);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.set(self.0));
    }
}

/// One category's kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The category ("gemm", "attention", "cast", a cuda/ module, or "scope:<name>").
    pub category: String,
    /// The kernels' summed GPU time.
    pub ms: f64,
    /// How many kernels.
    pub kernels: usize,
}

/// The categories' sums since [`enable`], largest first (scopes listed apart, as
/// "scope:<name>", counting kernels also counted in their own category); waits for the
/// device. Empty without the `cuda` feature.
pub fn report() -> crate::Result<Vec<Row>> {
    #[cfg(feature = "cuda")]
    return imp::report();
    #[cfg(not(feature = "cuda"))]
    Ok(vec![])
}

#[cfg(feature = "cuda")]
pub(crate) use imp::Span;

/// The category of kernel `name` of cuda/`module`: "cast" for dtype conversions, else the
/// module.
pub(crate) fn category<'a>(module: &'a str, name: &str) -> &'a str {
    if name.starts_with("cast") {
        "cast"
    } else {
        module
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{Row, SCOPE};
    use crate::backend::cuda::CudaDevice;
    use crate::{Error, Result};
    use cudarc::driver::CudaEvent;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    type Record = (String, Option<&'static str>, CudaEvent, CudaEvent);
    pub(super) static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

    const TIMED: Option<cudarc::driver::sys::CUevent_flags> =
        Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);

    /// A kernel's start event, while profiling.
    pub(crate) struct Span(Option<CudaEvent>);

    impl Span {
        /// Before a launch on `dev`'s compute stream.
        pub(crate) fn start(dev: &CudaDevice) -> Span {
            if !super::enabled() {
                return Span(None);
            }
            Span(dev.stream().record_event(TIMED).ok())
        }

        /// After the launch: files it under `category`.
        pub(crate) fn stop(self, dev: &CudaDevice, category: &str) {
            let Some(start) = self.0 else { return };
            if let Ok(end) = dev.stream().record_event(TIMED) {
                let scope = SCOPE.with(|s| s.get());
                if let Ok(mut r) = RECORDS.lock() {
                    r.push((category.to_string(), scope, start, end));
                }
            }
        }
    }

    pub(super) fn report() -> Result<Vec<Row>> {
        let records = std::mem::take(&mut *RECORDS.lock().map_err(|_| Error::Poisoned("profile"))?);
        let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        for (cat, scope, a, b) in &records {
            let ms = a
                .elapsed_ms(b)
                .map_err(|e| Error::Cuda(format!("reading a kernel's events: {e:?}")))?
                as f64;
            let e = sums.entry(cat.clone()).or_default();
            e.0 += ms;
            e.1 += 1;
            if let Some(s) = scope {
                let e = sums.entry(format!("scope:{s}")).or_default();
                e.0 += ms;
                e.1 += 1;
            }
        }
        let mut rows: Vec<Row> = sums
            .into_iter()
            .map(|(category, (ms, kernels))| Row {
                category,
                ms,
                kernels,
            })
            .collect();
        rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(rows)
    }
}
