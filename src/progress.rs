//! What this process is doing, for the watchdog of a run of several processes
//! ([`crate::dist`]): a counter that long work ticks (a training micro-batch, a cache entry,
//! a denoising step, a tensor read, a file written), the number of collectives entered
//! (every rank enters the same ones in the same order, so the counts compare across ranks:
//! a rank behind the others is the one they wait for), whether the main thread waits for
//! other ranks in a host collective, and a few words for the phase it is in.
//!
//! Everything here is process-wide and costs an atomic add; a process that is not part of a
//! group ticks the counters and nobody reads them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

static TICKS: AtomicU64 = AtomicU64::new(0);
static COLLECTIVES: AtomicU64 = AtomicU64::new(0);
static WAITING: AtomicUsize = AtomicUsize::new(0);
static PHASE: Mutex<String> = Mutex::new(String::new());
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Marks that this process's watchdog has judged the run stuck and is stopping it: the
/// other ranks are being told, and this process exits from the watchdog's thread. Its main
/// thread, which may see those ranks leave first, should wait for that exit
/// ([`stopping`]) rather than report them.
pub fn set_stopping() {
    STOPPING.store(true, Ordering::SeqCst);
}

/// Whether this process's watchdog is stopping the run ([`set_stopping`]).
pub fn stopping() -> bool {
    STOPPING.load(Ordering::SeqCst)
}

/// Some work was done: the process is not stuck.
pub fn tick() {
    TICKS.fetch_add(1, Ordering::Relaxed);
}

/// The main thread entered a collective (counted by the process groups).
pub fn entered_collective() {
    COLLECTIVES.fetch_add(1, Ordering::Relaxed);
    tick();
}

/// Names what the process does now ("caching latents", "training step 12", ...).
pub fn set_phase(phase: impl Into<String>) {
    if let Ok(mut p) = PHASE.lock() {
        *p = phase.into();
    }
    tick();
}

/// While alive, the main thread waits for other ranks (a host collective): not progress,
/// and not being stuck either.
pub struct Waiting(());

/// Marks the main thread as waiting for other ranks until the guard drops.
pub fn waiting() -> Waiting {
    WAITING.fetch_add(1, Ordering::Relaxed);
    Waiting(())
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
        tick();
    }
}

/// The counters at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Work done so far ([`tick`]).
    pub ticks: u64,
    /// Collectives entered so far.
    pub collectives: u64,
    /// Whether the main thread waits in a host collective now.
    pub waiting: bool,
    /// The phase last named.
    pub phase: String,
}

/// This process's counters now.
pub fn snapshot() -> Snapshot {
    Snapshot {
        ticks: TICKS.load(Ordering::Relaxed),
        collectives: COLLECTIVES.load(Ordering::Relaxed),
        waiting: WAITING.load(Ordering::Relaxed) > 0,
        phase: PHASE.lock().map(|p| p.clone()).unwrap_or_default(),
    }
}

impl Snapshot {
    /// The wire form: ticks and collectives (u64, little-endian), the waiting flag, the
    /// phase in UTF-8.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(17 + self.phase.len());
        b.extend(self.ticks.to_le_bytes());
        b.extend(self.collectives.to_le_bytes());
        b.push(self.waiting as u8);
        b.extend(self.phase.as_bytes());
        b
    }

    /// Reads [`Snapshot::to_bytes`]; `None` for a frame too short to be one.
    pub fn from_bytes(b: &[u8]) -> Option<Snapshot> {
        if b.len() < 17 {
            return None;
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        Some(Snapshot {
            ticks: word(0),
            collectives: word(8),
            waiting: b[16] != 0,
            phase: String::from_utf8_lossy(&b[17..]).into_owned(),
        })
    }
}

/// Wall seconds spent in named phases, each phase's spans summed, in the order first met:
/// where a run's minutes went (the `train` and `sample` summaries print it).
#[derive(Debug)]
pub struct Timeline {
    open: Option<std::time::Instant>,
    spent: Vec<(&'static str, f64)>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// No phase timed yet.
    pub fn new() -> Timeline {
        Timeline {
            open: None,
            spent: vec![],
        }
    }

    /// A span begins (a span already open is restarted).
    pub fn begin(&mut self) {
        self.open = Some(std::time::Instant::now());
    }

    /// The open span ends and counts to `phase`; without an open span, nothing.
    pub fn end(&mut self, phase: &'static str) {
        if let Some(t) = self.open.take() {
            self.add(phase, t.elapsed().as_secs_f64());
        }
    }

    /// `secs` more to `phase`.
    pub fn add(&mut self, phase: &'static str, secs: f64) {
        match self.spent.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, s)) => *s += secs,
            None => self.spent.push((phase, secs)),
        }
    }

    /// Each phase and its seconds, in the order first met.
    pub fn phases(&self) -> &[(&'static str, f64)] {
        &self.spent
    }
}

/// One line of where `total` seconds went: each phase's seconds, then what the phases do
/// not cover (start-up, loading, planning, the final writes: `rest` names it), then the
/// whole ("time: caching 5.0 s, training steps 20.1 s; start-up and loading 30.2 s; 55.3 s
/// in all").
pub fn time_line(phases: &[(&'static str, f64)], total: f64, rest: &str) -> String {
    let each: Vec<String> = phases
        .iter()
        .map(|(p, s)| format!("{p} {s:.1} s"))
        .collect();
    let covered: f64 = phases.iter().map(|(_, s)| s).sum();
    let besides = (total - covered).max(0.0);
    format!(
        "time: {}; {rest} {besides:.1} s; {total:.1} s in all",
        match each.is_empty() {
            true => "no phase timed".to_string(),
            false => each.join(", "),
        }
    )
}
