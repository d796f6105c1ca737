//! What each phase of a process's run took of a GPU's memory, in FLAME's allocator and as
//! the driver counts the process's bytes, and of its time: the meter the `train` and
//! `sample` summaries print.

use crate::Device;

/// Peak bytes in use on a GPU per phase of a run, and the wall time of each phase:
/// [`PhasePeaks::start`] resets the device's peak, [`PhasePeaks::end`] keeps the largest seen
/// for the phase, in FLAME's allocator and as the driver counts the process's bytes (the
/// allocator's arena, the context, and what a phase takes outside the allocator: sampled
/// through the phase by a sampler thread where [`PhasePeaks::watch`] started one), and adds
/// the span to the phase's seconds.
#[derive(Default)]
pub struct PhasePeaks {
    /// Each phase's allocator peak and driver-side peak.
    memory: std::sync::Mutex<Vec<(&'static str, u64, u64)>>,
    /// Each phase's wall seconds.
    time: std::sync::Mutex<crate::progress::Timeline>,
    /// The process's bytes on the GPU as the driver counts them, sampled.
    #[cfg(feature = "cuda")]
    driver: Option<DriverSampler>,
}

/// How often [`DriverSampler`] reads the process's bytes on the GPU, ms.
#[cfg(feature = "cuda")]
const DRIVER_SAMPLE_MS: u64 = 100;

/// The bytes a process holds on a GPU as the driver counts them
/// (`CudaDevice::process_memory`), read every [`DRIVER_SAMPLE_MS`] on a thread of its own
/// until dropped: the largest since the last [`DriverSampler::reset`]. Each reset starts a
/// new span (its number beside the peak), and a reading taken in an earlier span is dropped,
/// so one phase's memory is never charged to the next.
#[cfg(feature = "cuda")]
struct DriverSampler {
    device: crate::cuda::CudaDevice,
    /// (the span's number, its largest reading).
    peak: std::sync::Arc<std::sync::Mutex<(u64, u64)>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(feature = "cuda")]
impl DriverSampler {
    /// Starts sampling `device` (no thread where one cannot be made: the phases' ends are
    /// read then).
    fn start(device: crate::cuda::CudaDevice) -> DriverSampler {
        use std::sync::atomic::{AtomicBool, Ordering};
        let now = device.process_memory().unwrap_or(0);
        let peak = std::sync::Arc::new(std::sync::Mutex::new((0u64, now)));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let thread = {
            let (device, peak, stop) = (device.clone(), peak.clone(), stop.clone());
            std::thread::Builder::new()
                .name("flame-driver-memory".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(DRIVER_SAMPLE_MS));
                        let Ok(span) = peak.lock().map(|p| p.0) else {
                            return;
                        };
                        let Ok(b) = device.process_memory() else {
                            continue;
                        };
                        if let Ok(mut p) = peak.lock() {
                            if p.0 == span {
                                p.1 = p.1.max(b);
                            }
                        }
                    }
                })
                .ok()
        };
        DriverSampler {
            device,
            peak,
            stop,
            thread,
        }
    }

    /// A new span, its largest reading starting from the bytes held now.
    fn reset(&self) {
        let now = self.device.process_memory().unwrap_or(0);
        if let Ok(mut p) = self.peak.lock() {
            *p = (p.0 + 1, now);
        }
    }

    /// The largest reading of the span, the bytes held now included.
    fn peak(&self) -> u64 {
        let now = self.device.process_memory().unwrap_or(0);
        self.peak.lock().map_or(now, |p| p.1.max(now))
    }
}

#[cfg(feature = "cuda")]
impl Drop for DriverSampler {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl PhasePeaks {
    /// Samples the process's bytes on `device` as the driver counts them through every
    /// phase from here on (a GPU; nothing on the CPU).
    pub fn watch(&mut self, device: &Device) {
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Device::Cuda(c) = device {
            self.driver = Some(DriverSampler::start(c.clone()));
        }
        let _ = device;
    }

    /// A phase begins: its peak and its time count from here, and the data-parallel
    /// watchdog names it ([`crate::progress::set_phase`]).
    pub fn start(&self, device: &Device, phase: &str) {
        crate::progress::set_phase(phase);
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Device::Cuda(c) = device {
            c.reset_peak_memory();
            if let Some(d) = &self.driver {
                d.reset();
            }
        }
        let _ = device;
        self.clock_in();
    }

    /// The phase ends: its peaks and its time are counted.
    pub fn end(&self, device: &Device, phase: &'static str) {
        self.clock_out(phase);
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(c), Ok(mut v)) = (device, self.memory.lock()) {
            let peak = c.memory().peak;
            let held = match &self.driver {
                Some(d) => d.peak(),
                None => c.process_memory().unwrap_or(0),
            };
            match v.iter_mut().find(|(p, _, _)| *p == phase) {
                Some((_, b, d)) => {
                    *b = (*b).max(peak);
                    *d = (*d).max(held);
                }
                None => v.push((phase, peak, held)),
            }
        }
        let _ = (device, phase);
    }

    /// A span of time alone begins (a phase with no peak of its own: the model's load).
    pub fn clock_in(&self) {
        if let Ok(mut t) = self.time.lock() {
            t.begin();
        }
    }

    /// The span begun last counts to `phase`.
    pub fn clock_out(&self, phase: &'static str) {
        if let Ok(mut t) = self.time.lock() {
            t.end(phase);
        }
    }

    /// Each phase's peak in FLAME's allocator, bytes, in the order first met.
    pub fn allocator(&self) -> Vec<(&'static str, u64)> {
        self.memory
            .lock()
            .map(|v| v.iter().map(|&(p, b, _)| (p, b)).collect())
            .unwrap_or_default()
    }

    /// Each phase's driver-side peak, bytes, in the order first met.
    pub fn driver(&self) -> Vec<(&'static str, u64)> {
        self.memory
            .lock()
            .map(|v| v.iter().map(|&(p, _, d)| (p, d)).collect())
            .unwrap_or_default()
    }

    /// Each phase's wall seconds, in the order first met.
    pub fn seconds(&self) -> Vec<(&'static str, f64)> {
        self.time
            .lock()
            .map(|t| t.phases().to_vec())
            .unwrap_or_default()
    }

    /// The summary's memory lines where a GPU was measured: each phase's peak in FLAME's
    /// allocator (with `outside`, what the process holds outside it) and its driver-side
    /// peak (with the requests `device`'s allocator served beyond its cap's arena,
    /// [`arena_overflows`]); none on the CPU.
    pub fn memory_lines(&self, device: &Device, outside: Option<u64>) -> Vec<String> {
        let overflows = arena_overflows(device);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let each = |v: Vec<(&'static str, u64)>| -> String {
            v.iter()
                .map(|(phase, b)| format!("{phase} {:.2} GiB", gib(*b)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let allocator = self.allocator();
        if allocator.is_empty() {
            return vec![];
        }
        vec![
            format!(
                "memory peaks in FLAME's allocator: {}{}",
                each(allocator),
                outside
                    .map(|o| format!(", plus {:.2} GiB held outside it", gib(o)))
                    .unwrap_or_default()
            ),
            format!(
                "driver-side peaks (the process on the GPU, read every 0.1 s): {}{}",
                each(self.driver()),
                overflows
                    .map(|n| format!("; {n} requests served beyond the allocator's arena"))
                    .unwrap_or_default()
            ),
        ]
    }
}

/// How many requests `device`'s allocator has served from the driver beyond its cap's
/// arena (each holds the process past the cap while it lives: `MemoryReport::overflows`);
/// `None` on the CPU.
pub fn arena_overflows(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        return Some(c.memory().overflows);
    }
    let _ = device;
    None
}
