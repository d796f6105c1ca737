//! Data-parallel gradient sums, bucketed and overlapped with the backward (the scheme of
//! PyTorch's DistributedDataParallel, Li et al. 2020, "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training"): the parameters are cut into buckets of about
//! [`BUCKET_BYTES`] in reverse registration order (roughly the order the backward finishes
//! them); when the last backward of a step has summed every gradient of the next bucket, the
//! bucket's gradients are copied into one flat buffer and its sum over the ranks starts on
//! the collectives stream while the backward goes on. [`GradReducer::finish`] starts the
//! buckets not yet started, in order, waits for all, and puts the sums in place of the
//! gradients.
//!
//! With a group whose collectives block the host (the CPU's TCP group), every bucket is
//! summed in `finish` instead: there is nothing to overlap.
//!
//! Every rank starts the same buckets in the same order, whatever its backward did (a rank
//! with no samples in a step starts them all in `finish`), as NCCL requires. A gradient that
//! grows after its bucket started (a parameter used by two separate backward passes of the
//! last micro-batch) is caught and its bucket summed again in `finish`, so the result is
//! always the sum of the final gradients (the ranks agree on which buckets to sum again
//! through one small host sum per step).

use super::ProcessGroup;
use crate::autograd::GradHook;
use crate::{DType, Error, Grads, Result, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The size buckets are cut at (PyTorch DDP's default `bucket_cap_mb`, 25 MiB).
pub const BUCKET_BYTES: usize = 25 << 20;

struct Bucket {
    /// Indices into `params`.
    members: Vec<usize>,
}

#[derive(Default)]
struct StepState {
    /// Whether the hook acts (during the last micro-batch's backward only).
    armed: bool,
    /// The gradient each parameter has now, once its backward summed it.
    ready: Vec<Option<Tensor>>,
    /// The next bucket to start.
    next: usize,
    /// Each started bucket's flat buffer, with its collective.
    flats: Vec<Option<(Tensor, super::Pending)>>,
    /// Buckets whose gradients grew after they started.
    stale: Vec<bool>,
}

/// See the module documentation. Set it as the [`Grads`] hook of the last micro-batch's
/// backward ([`GradReducer::arm`]), then call [`GradReducer::finish`].
pub struct GradReducer {
    group: Arc<dyn ProcessGroup>,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    bucket_of: Vec<usize>,
    index: HashMap<TensorId, usize>,
    state: Mutex<StepState>,
}

impl GradReducer {
    /// A reducer for `params` (in registration order) over `group`, buckets cut at
    /// `bucket_bytes` and never mixing dtypes.
    pub fn new(
        group: Arc<dyn ProcessGroup>,
        params: Vec<Tensor>,
        bucket_bytes: usize,
    ) -> Arc<GradReducer> {
        let mut params = params;
        params.reverse();
        let mut buckets: Vec<Bucket> = vec![];
        let mut bucket_of = vec![0; params.len()];
        let (mut bytes, mut dtype): (usize, Option<DType>) = (0, None);
        for (i, p) in params.iter().enumerate() {
            let b = p.elem_count() * p.dtype().size_in_bytes();
            let cut = match (buckets.last(), dtype) {
                (None, _) => true,
                (Some(_), Some(d)) => d != p.dtype() || bytes + b > bucket_bytes.max(1),
                (Some(_), None) => true,
            };
            if cut {
                buckets.push(Bucket { members: vec![] });
                bytes = 0;
                dtype = Some(p.dtype());
            }
            bytes += b;
            let k = buckets.len() - 1;
            buckets[k].members.push(i);
            bucket_of[i] = k;
        }
        let index = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id(), i))
            .collect();
        Arc::new(GradReducer {
            group,
            params,
            buckets,
            bucket_of,
            index,
            state: Mutex::new(StepState::default()),
        })
    }

    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The group it sums over.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    fn state(&self) -> Result<std::sync::MutexGuard<'_, StepState>> {
        self.state
            .lock()
            .map_err(|_| Error::Poisoned("gradient reducer"))
    }

    /// Whether buckets are summed while the backward runs (an asynchronous group), so each
    /// gradient is wanted as soon as its backward makes it.
    pub fn overlaps(&self) -> bool {
        self.group.asynchronous()
    }

    /// Makes the hook act from now until [`GradReducer::finish`]: call it before the last
    /// micro-batch's backward of a step.
    pub fn arm(&self) -> Result<()> {
        let mut s = self.state()?;
        let (n, k) = (self.params.len(), self.buckets.len());
        *s = StepState {
            armed: true,
            ready: vec![None; n],
            next: 0,
            flats: (0..k).map(|_| None).collect(),
            stale: vec![false; k],
        };
        Ok(())
    }

    /// The flat buffer of bucket `k` from `grad_of` (zeros for a parameter without one),
    /// in the parameters' dtype.
    fn flat(&self, k: usize, grad_of: &dyn Fn(usize) -> Option<Tensor>) -> Result<Tensor> {
        let parts = self.buckets[k]
            .members
            .iter()
            .map(|&i| {
                let p = &self.params[i];
                match grad_of(i) {
                    Some(g) => g.to_dtype(p.dtype())?.flatten_all(),
                    None => Tensor::zeros(p.elem_count(), p.dtype(), p.device()),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, 0)
    }

    fn start(&self, s: &mut StepState, k: usize) -> Result<()> {
        let flat = {
            let ready = &s.ready;
            self.flat(k, &|i| ready[i].clone())?
        };
        let pending = self.group.all_reduce_sum(&[&flat])?;
        s.flats[k] = Some((flat, pending));
        Ok(())
    }

    /// Sums every parameter's gradient in `grads` over the ranks (zeros where a rank has
    /// none): the buckets the backward did not start are started in order, all are waited
    /// for, and each gradient is replaced by its sum (a view of the bucket's buffer).
    pub fn finish(&self, grads: &mut Grads) -> Result<()> {
        let mut s = self.state()?;
        if s.flats.len() != self.buckets.len() {
            // Not armed this step (e.g. no micro-batch ran): start from a clean state.
            drop(s);
            self.arm()?;
            s = self.state()?;
        }
        s.armed = false;
        let _g = crate::no_grad();
        let grad_of = |i: usize| grads.get(&self.params[i]).cloned();
        // Every bucket the backward did not start, in order: each rank has now started
        // each bucket once.
        for k in 0..self.buckets.len() {
            if s.flats[k].is_none() {
                let flat = self.flat(k, &grad_of)?;
                let pending = self.group.all_reduce_sum(&[&flat])?;
                s.flats[k] = Some((flat, pending));
            }
        }
        // A bucket stale on any rank is summed once more on every rank (the same
        // collectives everywhere, in the same order), from each rank's final gradients.
        let mut stale: Vec<f64> = s.stale.iter().map(|&b| f64::from(u8::from(b))).collect();
        if self.group.asynchronous() {
            self.group.sum_host(&mut stale)?;
        }
        let mut again = vec![];
        for (k, st) in stale.iter().enumerate() {
            if *st > 0.0 {
                let flat = self.flat(k, &grad_of)?;
                let pending = self.group.all_reduce_sum(&[&flat])?;
                again.push((k, flat, pending));
            }
        }
        let mut sums = vec![];
        for (k, slot) in s.flats.iter_mut().enumerate() {
            if let Some((flat, pending)) = slot.take() {
                pending.wait()?;
                if stale[k] == 0.0 {
                    sums.push((k, flat));
                }
            }
        }
        for (k, flat, pending) in again {
            pending.wait()?;
            sums.push((k, flat));
        }
        for (k, flat) in sums {
            let mut at = 0;
            for &i in &self.buckets[k].members {
                let p = &self.params[i];
                let n = p.elem_count();
                let g = flat.narrow(0, at, n)?.reshape(p.shape().clone())?;
                grads.insert(p, g);
                at += n;
            }
        }
        *s = StepState::default();
        Ok(())
    }
}

impl GradHook for GradReducer {
    fn ready(&self, id: TensorId, grad: &Tensor) -> Result<()> {
        let Some(&i) = self.index.get(&id) else {
            return Ok(());
        };
        if !self.group.asynchronous() {
            // A group whose collectives block (TCP) sums everything in `finish`: started
            // here, a bucket would wait for ranks whose backward is elsewhere.
            return Ok(());
        }
        let mut s = self.state()?;
        if !s.armed {
            return Ok(());
        }
        let k = self.bucket_of[i];
        if s.flats[k].is_some() {
            s.stale[k] = true;
            return Ok(());
        }
        s.ready[i] = Some(grad.clone());
        while s.next < self.buckets.len()
            && self.buckets[s.next]
                .members
                .iter()
                .all(|&m| s.ready[m].is_some())
        {
            let k = s.next;
            self.start(&mut s, k)?;
            s.next += 1;
        }
        Ok(())
    }
}
