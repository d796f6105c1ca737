//! Kernel time by category: with [`enable`] on, every kernel FLAME launches on a GPU is
//! bracketed by a pair of events, filed under its category (the kernel's module in cuda/,
//! "gemm" for cuBLAS, "cast" for dtype conversions) and, inside a [`scope`], under the
//! scope's name as well; [`report`] waits for the device and sums the events' times. The
//! events cost the host a few microseconds per kernel, so the step's wall time is taken
//! with profiling off; the difference to the kernels' sum is the time the GPU waited. While
//! profiling, a kernel's launch and its two events are one at a time across host threads
//! (re-runs issued ahead launch from a helper thread onto the same stream), so each pair
//! brackets its own kernel alone.
//!
//! Scopes are the forward's only: the backward's kernels of a scoped layer are filed under
//! their own categories, and under the recorded op whose gradient they compute (the
//! backward sets [`backward_op`] around each op's VJP, and around the sums of gradient
//! contributions).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

static ON: AtomicBool = AtomicBool::new(false);

thread_local! {
    static SCOPE: Cell<Option<&'static str>> = const { Cell::new(None) };
    static BACKWARD: Cell<Option<&'static str>> = const { Cell::new(None) };
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

/// Files the kernels this thread launches until the guard drops as the backward of op
/// `kind` (the autograd calls it; nested backward passes override it inside).
pub fn backward_op(kind: &'static str) -> BackwardGuard {
    BackwardGuard(BACKWARD.with(|s| s.replace(Some(kind))))
}

/// Restores the enclosing backward op when dropped.
pub struct BackwardGuard(Option<&'static str>);

impl Drop for BackwardGuard {
    fn drop(&mut self) {
        BACKWARD.with(|s| s.set(self.0));
    }
}

/// One category's kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The category: a kind of kernel ("gemm", "cast", a cuda/ module), a scope, the op a
    /// backward kernel serves, or a kernel's name, as the table says.
    pub category: String,
    /// The kernels' summed GPU time.
    pub ms: f64,
    /// How many kernels.
    pub kernels: usize,
}

/// The kernels timed since [`enable`], summed four ways; each table largest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// By kind of kernel (every kernel once).
    pub kinds: Vec<Row>,
    /// By scope (kernels launched inside one; also counted in `kinds`).
    pub scopes: Vec<Row>,
    /// By phase: "forward" (and the optimizer) or `"backward of OP"` (every kernel once).
    pub phases: Vec<Row>,
    /// By kernel name (every kernel once).
    pub kernels: Vec<Row>,
    /// By phase and kernel name, "phase / kernel" (every kernel once).
    pub phase_kernels: Vec<Row>,
}

/// The sums since [`enable`]; waits for the device and forgets the records. Empty without
/// the `cuda` feature.
pub fn report() -> crate::Result<Profile> {
    #[cfg(feature = "cuda")]
    return imp::report();
    #[cfg(not(feature = "cuda"))]
    Ok(Profile::default())
}

#[cfg(feature = "cuda")]
pub(crate) use imp::Span;

/// The category of kernel `name` of cuda/`module`: "cast" for dtype conversions, else the
/// module.
#[cfg(feature = "cuda")]
pub(crate) fn category<'a>(module: &'a str, name: &str) -> &'a str {
    if name.starts_with("cast") {
        "cast"
    } else {
        // A file's Hopper builds count as the file.
        module
            .strip_suffix("_sm90")
            .or_else(|| module.strip_suffix("_wgmma"))
            .unwrap_or(module)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{Profile, Row, BACKWARD, SCOPE};
    use crate::{Error, Result};
    use cudarc::driver::{CudaEvent, CudaStream};
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    pub(super) struct Record {
        kind: String,
        name: String,
        scope: Option<&'static str>,
        backward: Option<&'static str>,
        start: CudaEvent,
        end: CudaEvent,
    }
    pub(super) static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

    const TIMED: Option<cudarc::driver::sys::CUevent_flags> =
        Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);

    /// Held from a kernel's start event to its end event while profiling: where two host
    /// threads launch onto one stream (re-runs issued ahead, `autograd::ahead`), one
    /// thread's kernel would otherwise land between the other's pair of events and be
    /// counted twice.
    static LAUNCH: Mutex<()> = Mutex::new(());

    thread_local! {
        /// Spans open on this thread: a launch inside another's span takes no second lock.
        static OPEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// An open span's place in `OPEN`, and the launch lock where it is this thread's
    /// outermost span.
    struct Launching {
        _lock: Option<std::sync::MutexGuard<'static, ()>>,
    }

    impl Launching {
        fn enter() -> Launching {
            let outer = OPEN.with(|o| {
                let n = o.get();
                o.set(n + 1);
                n == 0
            });
            // A poisoned lock still serialises: take it back.
            Launching {
                _lock: outer.then(|| LAUNCH.lock().unwrap_or_else(|e| e.into_inner())),
            }
        }
    }

    impl Drop for Launching {
        fn drop(&mut self) {
            OPEN.with(|o| o.set(o.get().saturating_sub(1)));
        }
    }

    /// A kernel's start event, while profiling, and its hold on the launch lock.
    pub(crate) struct Span {
        start: Option<CudaEvent>,
        _launching: Option<Launching>,
    }

    impl Span {
        /// Before a launch on `stream` (a device's compute stream).
        pub(crate) fn start(stream: &CudaStream) -> Span {
            if !super::enabled() {
                return Span {
                    start: None,
                    _launching: None,
                };
            }
            let launching = Launching::enter();
            Span {
                start: stream.record_event(TIMED).ok(),
                _launching: Some(launching),
            }
        }

        /// After the launch of kernel `name` on `stream`: files it under `kind`.
        pub(crate) fn stop(self, stream: &CudaStream, kind: &str, name: &str) {
            // The lock is held until the end event is recorded.
            let Span {
                start,
                _launching: _held,
            } = self;
            let Some(start) = start else {
                return;
            };
            if let Ok(end) = stream.record_event(TIMED) {
                let rec = Record {
                    kind: kind.to_string(),
                    name: name.to_string(),
                    scope: SCOPE.with(|s| s.get()),
                    backward: BACKWARD.with(|s| s.get()),
                    start,
                    end,
                };
                if let Ok(mut r) = RECORDS.lock() {
                    r.push(rec);
                }
            }
        }
    }

    pub(super) fn report() -> Result<Profile> {
        let records = std::mem::take(&mut *RECORDS.lock().map_err(|_| Error::Poisoned("profile"))?);
        let mut tables: [BTreeMap<String, (f64, usize)>; 5] = Default::default();
        for r in &records {
            let ms = r
                .start
                .elapsed_ms(&r.end)
                .map_err(|e| Error::Cuda(format!("reading a kernel's events: {e:?}")))?
                as f64;
            let phase = match r.backward {
                Some(op) => format!("backward of {op}"),
                None => "forward".to_string(),
            };
            let keys = [
                Some(r.kind.clone()),
                r.scope.map(str::to_string),
                Some(format!("{phase} / {}", r.name)),
                Some(phase),
                Some(r.name.clone()),
            ];
            for (t, k) in tables.iter_mut().zip(keys) {
                if let Some(k) = k {
                    let e = t.entry(k).or_default();
                    e.0 += ms;
                    e.1 += 1;
                }
            }
        }
        let rows = |t: BTreeMap<String, (f64, usize)>| {
            let mut v: Vec<Row> = t
                .into_iter()
                .map(|(category, (ms, kernels))| Row {
                    category,
                    ms,
                    kernels,
                })
                .collect();
            v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
            v
        };
        let [kinds, scopes, phase_kernels, phases, kernels] = tables.map(rows);
        Ok(Profile {
            kinds,
            scopes,
            phases,
            kernels,
            phase_kernels,
        })
    }
}
