//! Products of streamed weights computed where the weights live: on the host.
//!
//! A streamed block's Linears over the conditioning vector (Flux's and SD3's modulations, a
//! UNet ResNet's time embedding: `BlockShape::conditioned`) multiply one row a sample by a
//! large weight: Flux-dev's modulations are 27% of its block weights and a negligible share
//! of its work. Bringing those weights over the host link for a product of a few rows costs
//! the link far more than the product costs the host's memory. With
//! `BlockStreamer::set_host_products`, such weights stay in host memory for good (they
//! never cross the link, nor take device memory), and `Linear::forward` gets their product
//! from here: the input (a few rows) crosses to the host once, the products of every
//! host-held weight that takes an input of its width are computed ahead, in block order, on
//! a worker thread (the rows of each product spread over a thread pool of their own), and
//! each comes back to the device as the block asks for it (`rows x out` values).
//!
//! The products are f32 sums of the weight's values times the input's (bf16, f16 or f32),
//! each output sixteen partial sums added in a fixed order (deterministic whatever the
//! thread count), rounded once to the input's dtype: the same values as a GEMM with f32
//! accumulation up to the order of the sums (the CPU backend's and cuBLAS's differ from it,
//! and from each other, in the last bits).
//!
//! The input is recognised by its storage (the same buffer, view and dtype): the
//! models compute the conditioning vector's activation once and hand the same tensor to
//! every block (a checkpoint's re-run gets a view of the same buffer). The products are
//! kept until another input comes; the input's handle is kept with them, so its buffer
//! cannot be reused for other values while they are.
//!
//! A step's forward runs while the host link brings the blocks' weights, and the products
//! share the host's memory with those copies: on the H100 machine the forward waited 60-87
//! ms a step for them. The backward leaves both idle for longer. So the input of the next
//! forward may be announced ahead (`prepare`, through `DiffusionModel::prepare`): it is
//! copied to the host once the device has computed it and its products are computed while
//! the backward runs. The forward that takes an input of the same values (compared bit for
//! bit once it reaches the host) takes those products; any other input is computed as
//! before, so a wrong announcement costs time, never values.

use crate::{CpuStorage, DType, Error, Result, Tensor};
use rayon::prelude::*;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A weight held in host memory, (out, in).
struct HostWeight {
    /// The model's handle (a placeholder buffer: the weight is never on the device).
    handle: Tensor,
    values: Arc<CpuStorage>,
    out: usize,
    inp: usize,
}

enum Slot {
    /// Not computed, and no job will compute it for the current input.
    Empty,
    /// A job will compute it.
    Pending,
    /// The products, (rows, out) row-major.
    Ready(Arc<Vec<f32>>),
}

/// Counters of the host products since the streamer was made (microseconds of wall time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProductReport {
    /// Products handed to the model.
    pub products: u64,
    /// Inputs brought to the host (each waits for the device's work up to it).
    pub inputs: u64,
    /// Spent computing products (on the worker, or by the model's thread).
    pub compute_us: u64,
    /// The model's thread waited for the worker.
    pub wait_us: u64,
    /// The model's thread spent bringing inputs to the host (each a wait for the device).
    pub input_us: u64,
    /// The model's thread spent sending products back.
    pub transfer_us: u64,
    /// Inputs announced ahead (`prepare`).
    pub announced: u64,
    /// Inputs a forward took whose products were computed (or under way) from an
    /// announcement: the rest of `inputs` waited for their products in the forward.
    pub taken_ahead: u64,
}

/// The products of an input announced ahead of its forward (`HostProducts::prepare`).
struct Ahead {
    /// The job's generation.
    generation: u64,
    /// The input's values as f32 (rows, in), once they have reached the host.
    values: Option<Arc<Vec<f32>>>,
    slots: Vec<Slot>,
}

#[derive(Default)]
struct State {
    /// The input whose products `slots` hold, its values as f32 (rows, in).
    input: Option<(Tensor, Arc<Vec<f32>>)>,
    /// Counts the jobs: each takes the next value as its generation.
    jobs: u64,
    /// The current input's generation: a job for an older one stops.
    generation: u64,
    slots: Vec<Slot>,
    /// An announced input's products, until a forward takes them or another comes.
    ahead: Option<Ahead>,
    /// The page-locked buffer the last announced input crossed into, for the next.
    spare: Option<super::link::HostCopy>,
    report: ProductReport,
}

impl State {
    /// The slots of the job of `generation`: the current input's or the announced one's;
    /// `None` once neither is (the job stops).
    fn slots_of(&mut self, generation: u64) -> Option<&mut Vec<Slot>> {
        if self.generation == generation {
            return Some(&mut self.slots);
        }
        self.ahead
            .as_mut()
            .filter(|a| a.generation == generation)
            .map(|a| &mut a.slots)
    }
}

/// The host-held weights of a streamer and their products (see the module docs).
#[derive(Default)]
pub(crate) struct HostProducts {
    weights: Mutex<Vec<Arc<HostWeight>>>,
    state: Arc<(Mutex<State>, Condvar)>,
}

fn poisoned<T>(_: T) -> Error {
    Error::Poisoned("host products")
}

impl HostProducts {
    /// Holds the values of `handle` (out, in), a frozen floating-point weight whose device
    /// buffer is a placeholder for good, for its products.
    pub(crate) fn hold(&self, handle: &Tensor, values: CpuStorage) -> Result<()> {
        let (out, inp) = match handle.dims() {
            &[out, inp] if values.len() == out * inp => (out, inp),
            _ => {
                return Err(Error::Stream(format!(
                    "{} values cannot be held on the host for the products of a weight of \
                     shape {} (a Linear's (out, in) weight can)",
                    values.len(),
                    handle.shape()
                )))
            }
        };
        if !matches!(values.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::Stream(format!(
                "a {} weight cannot be held on the host for its products (bf16, f16 or f32 can)",
                values.dtype()
            )));
        }
        self.weights
            .lock()
            .map_err(poisoned)?
            .push(Arc::new(HostWeight {
                handle: handle.clone(),
                values: Arc::new(values),
                out,
                inp,
            }));
        Ok(())
    }

    /// Bytes of the weights held.
    pub(crate) fn bytes(&self) -> Result<u64> {
        Ok(self
            .weights
            .lock()
            .map_err(poisoned)?
            .iter()
            .map(|w| (w.out * w.inp * w.values.dtype().size_in_bytes()) as u64)
            .sum())
    }

    /// Announces the input `x` (rows, in) of a coming forward: it is copied to the host once
    /// the device's work so far has computed it (the calling thread does not wait) and the
    /// products of every held weight of its width are computed on the worker; a forward whose
    /// input has the same values takes them (see the module docs). Replaces an earlier
    /// announcement whose input no forward took.
    pub(crate) fn prepare(&self, x: &Tensor) -> Result<()> {
        let weights: Vec<Arc<HostWeight>> = self.weights.lock().map_err(poisoned)?.clone();
        let (rows, inp) = match x.dims() {
            &[rows, inp] if rows > 0 => (rows, inp),
            _ => return Ok(()),
        };
        let jobs = jobs_for(&weights, 0, inp);
        if jobs.is_empty() {
            return Ok(());
        }
        // Its own buffer, whole: the copy takes a buffer's first elements.
        let xf = {
            let _g = crate::no_grad();
            x.to_dtype(DType::F32)?.dense()?
        };
        let (lock, cvar) = &*self.state;
        let mut st = lock.lock().map_err(poisoned)?;
        // Into the page-locked buffer the last announcement's input crossed into, when free.
        let (host, ticket) = xf.storage()?.offload(rows * inp, st.spare.take())?;
        st.jobs += 1;
        let generation = st.jobs;
        let mut slots: Vec<Slot> = weights.iter().map(|_| Slot::Empty).collect();
        for (k, _) in &jobs {
            slots[*k] = Slot::Pending;
        }
        st.ahead = Some(Ahead {
            generation,
            values: None,
            slots,
        });
        st.report.announced += 1;
        let state = self.state.clone();
        let spawned = std::thread::Builder::new()
            .name("flame-host-products".into())
            .spawn(move || {
                // On any way out (an error, a panic) before the values are stored, the
                // announcement is dropped: a forward waiting for them computes its own.
                let _release = Release(&state, generation);
                // The input's values on the host; the device buffer is kept until its copy
                // is done.
                let values = crate::fault::point("announce")
                    .map_err(|e| Error::Stream(format!("an announced input: {e}")))
                    .and_then(|_| ticket.wait_host())
                    .and_then(|_| host.to_cpu());
                drop(xf);
                if let Ok(mut st) = state.0.lock() {
                    st.spare = Some(host);
                }
                let Ok(CpuStorage::F32(values)) = values else {
                    return;
                };
                let values = Arc::new(values);
                match state.0.lock() {
                    Ok(mut st) => match st.ahead.as_mut() {
                        Some(a) if a.generation == generation => a.values = Some(values.clone()),
                        _ => return,
                    },
                    Err(_) => return,
                }
                state.1.notify_all();
                run_jobs(&state, generation, &values, rows, jobs)
            });
        if let Err(e) = spawned {
            st.ahead = None;
            cvar.notify_all();
            return Err(Error::Stream(format!(
                "starting the host products' thread: {e}"
            )));
        }
        Ok(())
    }

    /// Makes `x` the input whose products are held: when it is not already, brings it to the
    /// host and takes the products announced for the same values (`prepare`), or starts the
    /// products of the held weights of its width from index `from` on.
    fn ensure_input<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        weights: &[Arc<HostWeight>],
        x: &Tensor,
        from: usize,
    ) -> Result<MutexGuard<'a, State>> {
        let same = |held: &Tensor| {
            held.same_storage(x) && held.layout() == x.layout() && held.dtype() == x.dtype()
        };
        if st.input.as_ref().is_some_and(|(held, _)| same(held)) {
            return Ok(st);
        }
        let (rows, inp) = match x.dims() {
            &[rows, inp] if rows > 0 => (rows, inp),
            _ => return Ok(st),
        };
        let t0 = std::time::Instant::now();
        let values = {
            let _g = crate::no_grad();
            x.to_dtype(DType::F32)?.to_vec::<f32>()?
        };
        st.report.inputs += 1;
        st.report.input_us += t0.elapsed().as_micros() as u64;
        // An announced input whose values are still on their way: wait for them (the worker
        // sets them, or drops the announcement, and notifies).
        while st.ahead.as_ref().is_some_and(|a| a.values.is_none()) {
            st = self.state.1.wait(st).map_err(poisoned)?;
        }
        let announced = st
            .ahead
            .as_ref()
            .and_then(|a| a.values.as_ref())
            .is_some_and(|v| {
                v.len() == values.len()
                    && v.iter()
                        .zip(&values)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
            });
        if announced {
            if let Some(a) = st.ahead.take() {
                st.generation = a.generation;
                st.slots = a.slots;
                let values = a.values.unwrap_or_else(|| Arc::new(values));
                st.input = Some((x.clone(), values));
                st.report.taken_ahead += 1;
                return Ok(st);
            }
        }
        // Another input than announced: its products are of no use.
        st.ahead = None;
        let values = Arc::new(values);
        st.jobs += 1;
        st.generation = st.jobs;
        st.input = Some((x.clone(), values.clone()));
        st.slots = weights.iter().map(|_| Slot::Empty).collect();
        let jobs = jobs_for(weights, from, inp);
        if jobs.is_empty() {
            return Ok(st);
        }
        let pending: Vec<usize> = jobs.iter().map(|(k, _)| *k).collect();
        let (state, generation) = (self.state.clone(), st.generation);
        std::thread::Builder::new()
            .name("flame-host-products".into())
            .spawn(move || {
                let _release = Release(&state, generation);
                run_jobs(&state, generation, &values, rows, jobs)
            })
            .map_err(|e| Error::Stream(format!("starting the host products' thread: {e}")))?;
        // Pending once the worker exists (it cannot take the lock before this returns).
        for k in pending {
            st.slots[k] = Slot::Pending;
        }
        Ok(st)
    }

    /// The counters so far.
    pub(crate) fn report(&self) -> Result<ProductReport> {
        Ok(self.state.0.lock().map_err(poisoned)?.report)
    }

    /// Whether `weight` is one of the host-held weights.
    pub(crate) fn holds(&self, weight: &Tensor) -> Result<bool> {
        Ok(self
            .weights
            .lock()
            .map_err(poisoned)?
            .iter()
            .any(|w| w.handle.id() == weight.id()))
    }

    /// `x (rows, in) @ weight^T` on the device of `x`, in `x`'s dtype, when `weight` is held
    /// here; `None` otherwise. A new input crosses to the host (a wait for the device's work
    /// up to it) and takes the products computed for an announced input of the same values
    /// (`prepare`), or starts the products of every held weight of its width from `weight`
    /// on, in the order they were adopted (execution order), on a worker thread.
    pub(crate) fn product(&self, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
        let weights: Vec<Arc<HostWeight>> = self.weights.lock().map_err(poisoned)?.clone();
        let Some(w) = weights.iter().position(|h| h.handle.id() == weight.id()) else {
            return Ok(None);
        };
        let hw = &weights[w];
        let (rows, inp) = match x.dims() {
            &[rows, inp] => (rows, inp),
            _ => (0, 0),
        };
        if inp != hw.inp || rows == 0 {
            return Err(Error::ShapeMismatch {
                op: "host product",
                lhs: x.shape().clone(),
                rhs: (hw.out, hw.inp).into(),
            });
        }
        if x.requires_grad() {
            return Err(Error::Stream(format!(
                "a weight ({}, {}) held on the host for its products got an input that needs a \
                 gradient, whose backward would read the weight on the device: hold no weights \
                 on the host (memory.host_products = false) when adapters sit before the \
                 blocks",
                hw.out, hw.inp
            )));
        }
        let (lock, cvar) = &*self.state;
        let st = lock.lock().map_err(poisoned)?;
        let mut st = self.ensure_input(st, &weights, x, w)?;
        if st.slots.len() < weights.len() {
            st.slots.resize_with(weights.len(), || Slot::Empty);
        }
        // This input's values and generation: a slot is read or written only while the
        // generation is this one (another input may have come meanwhile).
        let generation = st.generation;
        let input = st
            .input
            .as_ref()
            .map(|(_, v)| v.clone())
            .ok_or(Error::Stream("host products: no input".into()))?;
        let t0 = std::time::Instant::now();
        let mut inline = 0u64;
        let values = loop {
            let slot = if st.generation == generation {
                &st.slots[w]
            } else {
                &Slot::Empty
            };
            match slot {
                Slot::Ready(v) => break v.clone(),
                Slot::Pending => st = cvar.wait(st).map_err(poisoned)?,
                Slot::Empty => {
                    drop(st);
                    let t = std::time::Instant::now();
                    let v = Arc::new(products(hw, &input, rows));
                    let us = t.elapsed().as_micros() as u64;
                    st = lock.lock().map_err(poisoned)?;
                    st.report.compute_us += us;
                    inline = us;
                    if st.generation == generation {
                        st.slots[w] = Slot::Ready(v.clone());
                    }
                    break v;
                }
            }
        };
        st.report.wait_us += (t0.elapsed().as_micros() as u64).saturating_sub(inline);
        st.report.products += 1;
        drop(st);
        let t0 = std::time::Instant::now();
        let host = match x.dtype() {
            DType::BF16 => {
                CpuStorage::BF16(values.iter().map(|&v| half::bf16::from_f32(v)).collect())
            }
            DType::F16 => CpuStorage::F16(values.iter().map(|&v| half::f16::from_f32(v)).collect()),
            DType::F32 => CpuStorage::F32(values.to_vec()),
            other => {
                return Err(Error::UnsupportedDType {
                    op: "host product",
                    dtype: other,
                })
            }
        };
        // A few rows of values: from pageable memory, which the driver writes into the
        // compute stream's commands, where a copy from page-locked memory would wait for the
        // copy engine behind the blocks' uploads (H100: 630 ms a step against
        // 538).
        let y = Tensor::from_host(host, (rows, hw.out), x.device())?;
        if let Ok(mut st) = lock.lock() {
            st.report.transfer_us += t0.elapsed().as_micros() as u64;
        }
        Ok(Some(y))
    }
}

/// On a worker's way out (its jobs done, superseded, an error or a panic): the slots of its
/// generation still pending go back to empty, so a waiting model thread computes them itself
/// instead of waiting for good; an announcement of its generation whose input's values never
/// arrived is dropped, so a forward waiting for them computes its own.
struct Release<'a>(&'a (Mutex<State>, Condvar), u64);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let (lock, cvar) = self.0;
        let mut st = match lock.lock() {
            Ok(st) => st,
            Err(p) => p.into_inner(),
        };
        if st
            .ahead
            .as_ref()
            .is_some_and(|a| a.generation == self.1 && a.values.is_none())
        {
            st.ahead = None;
        } else if let Some(slots) = st.slots_of(self.1) {
            for slot in slots.iter_mut() {
                if matches!(slot, Slot::Pending) {
                    *slot = Slot::Empty;
                }
            }
        }
        cvar.notify_all();
    }
}

/// The held weights from index `from` on that take inputs of width `inp`, with their indices.
fn jobs_for(weights: &[Arc<HostWeight>], from: usize, inp: usize) -> Vec<(usize, Arc<HostWeight>)> {
    (from..weights.len())
        .filter(|&k| weights[k].inp == inp)
        .map(|k| (k, weights[k].clone()))
        .collect()
}

/// The worker: each job's products in order, while its input is still the current one or
/// the announced one (the caller holds a `Release` of its generation).
fn run_jobs(
    state: &(Mutex<State>, Condvar),
    generation: u64,
    input: &[f32],
    rows: usize,
    jobs: Vec<(usize, Arc<HostWeight>)>,
) {
    let (lock, cvar) = state;
    for (k, w) in jobs {
        match lock.lock() {
            Ok(mut st) => {
                if st.slots_of(generation).is_none() {
                    return;
                }
            }
            Err(_) => return,
        }
        let t = std::time::Instant::now();
        let v = Arc::new(products(&w, input, rows));
        let us = t.elapsed().as_micros() as u64;
        let Ok(mut st) = lock.lock() else { return };
        st.report.compute_us += us;
        let Some(slots) = st.slots_of(generation) else {
            return;
        };
        if let Some(slot) = slots.get_mut(k) {
            *slot = Slot::Ready(v);
        }
        cvar.notify_all();
    }
}

/// The threads that compute the products, a pool of their own: `FLAME_HOST_PRODUCT_THREADS`
/// when set to a positive count, else one a core. Each thread's rate is bound by the
/// memory's latency, so fewer threads computed slower: Flux-dev at 12 GiB on the H100
/// machine's 16 cores took 115 ms a step with 16 threads, 143 with 14, 179 with 8, 418 with 4.
/// `None` (rayon's global pool) where the pool cannot be made.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = std::env::var("FLAME_HOST_PRODUCT_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(cores);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("flame-host-products-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The host's rate at the products of weights it holds, GiB of bf16 weights a second: one
/// row times a 3072 x 10240 weight (60 MiB, a Flux modulation's size) on the products' pool,
/// the fastest of four (the first warms the pool and the pages).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn measure_rate() -> f64 {
    let (out, inp) = (10240usize, 3072usize);
    let w = vec![half::bf16::from_f32(0.5); out * inp];
    let x = vec![1.0f32; inp];
    let run = || {
        by_output(&w, inp, &x, 1, |b| {
            f32::from_bits((b.to_bits() as u32) << 16)
        })
    };
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let t = std::time::Instant::now();
        std::hint::black_box(match pool() {
            Some(pool) => pool.install(run),
            None => run(),
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (out * inp * 2) as f64 / (1u64 << 30) as f64 / best.max(1e-9)
}

/// `x (rows, in) @ w^T` as f32, (rows, out) row-major.
fn products(w: &HostWeight, x: &[f32], rows: usize) -> Vec<f32> {
    match pool() {
        Some(pool) => pool.install(|| products_here(w, x, rows)),
        None => products_here(w, x, rows),
    }
}

/// `products` on the current rayon pool.
fn products_here(w: &HostWeight, x: &[f32], rows: usize) -> Vec<f32> {
    let by_output: Vec<f32> = match &*w.values {
        // The bits shifted in place (`half`'s conversion branches on NaN, which keeps the
        // loop from vectorising; a NaN stays a NaN either way).
        CpuStorage::BF16(v) => by_output(v, w.inp, x, rows, |b| {
            f32::from_bits((b.to_bits() as u32) << 16)
        }),
        CpuStorage::F16(v) => by_output(v, w.inp, x, rows, |b| b.to_f32()),
        CpuStorage::F32(v) => by_output(v, w.inp, x, rows, |b| b),
        // `hold` takes floating-point weights only.
        _ => vec![0.0; w.out * rows],
    };
    if rows <= 1 {
        // (out, 1) is (1, out).
        return by_output;
    }
    // (out, rows) -> (rows, out).
    let mut out = vec![0.0; by_output.len()];
    for (o, chunk) in by_output.chunks(rows).enumerate() {
        for (r, &v) in chunk.iter().enumerate() {
            out[r * w.out + o] = v;
        }
    }
    out
}

/// For each output (a row of `w`, `inp` values), its sum with each of `x`'s rows: (out,
/// rows). Outputs spread over rayon's threads; each sum is sequential in a fixed order.
fn by_output<T: Copy + Sync>(
    w: &[T],
    inp: usize,
    x: &[f32],
    rows: usize,
    to: impl Fn(T) -> f32 + Sync,
) -> Vec<f32> {
    w.par_chunks(inp)
        .with_min_len(16)
        .flat_map_iter(|row| x.chunks(inp).take(rows).map(|xr| dot(row, xr, &to)))
        .collect()
}

/// How far ahead of its sums `dot` asks the memory for a weight's bytes: each thread's rate
/// at the products was bound by the memory's latency on the H100 machine (2 GB/s a thread,
/// linear in the threads from 4 to 16), where the hardware's own prefetch did not
/// keep enough lines in flight.
const PREFETCH_BYTES: usize = 2048;

/// Sixteen lanes of partial sums over the values in order, then the lanes summed pairwise:
/// the same order for every call of a given length.
fn dot<T: Copy>(w: &[T], x: &[f32], to: &impl Fn(T) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // Past this row the next one's (a row of a task's rows follows the one before
            // in memory), or past the weight's end: a prefetch is a hint that never faults.
            let ahead = a.as_ptr().wrapping_byte_add(PREFETCH_BYTES).cast::<i8>();
            // SAFETY: SSE is part of every x86-64 target; a prefetch reads nothing the program
            // sees and faults on no address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead) };
        }
        for l in 0..LANES {
            acc[l] += to(a[l]) * b[l];
        }
    }
    for (l, (&a, &b)) in wt.iter().zip(xt).enumerate() {
        acc[l] += to(a) * b;
    }
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for l in 0..n {
            acc[l] += acc[l + n];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_on_odd_lengths() {
        for n in [1usize, 15, 16, 17, 100, 3073] {
            let w: Vec<half::bf16> = (0..n)
                .map(|i| half::bf16::from_f32(((i * 7919 % 97) as f32 - 48.0) / 32.0))
                .collect();
            let x: Vec<f32> = (0..n).map(|i| ((i * 31 % 13) as f32 - 6.0) / 8.0).collect();
            let want: f64 = w.iter().zip(&x).map(|(a, b)| a.to_f64() * *b as f64).sum();
            let got = dot(&w, &x, &|b: half::bf16| b.to_f32());
            let scale: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| (a.to_f64() * *b as f64).abs())
                .sum();
            assert!(
                (got as f64 - want).abs() <= 1e-6 * scale.max(1.0),
                "n {n}: {got} against {want}"
            );
        }
    }
}
