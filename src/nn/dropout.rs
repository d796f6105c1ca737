//! Seeded dropout: every mask a function of (seed, call), and of the rows of the global batch
//! a process holds, so runs repeat exactly and data-parallel ranks apply one process's masks.

use super::seed::{mix64, GOLDEN};
use crate::{Error, Result, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Inverted dropout: in training, zero each element with probability `p` and scale the rest
/// by 1/(1-p). Seeded: call k uses seed `hash(seed, k)`, so a run repeats exactly.
#[derive(Debug)]
pub struct Dropout {
    /// Probability of zeroing an element, in `[0, 1)`.
    pub p: f64,
    seed: u64,
    calls: AtomicU64,
    /// The rows of the global batch x holds (start, rows, global rows; 0 rows: all of it).
    part: [AtomicU64; 3],
}

/// The rows of a global batch that one process's inputs hold (data-parallel training):
/// dropout draws its mask for the whole batch and keeps these rows, so the processes
/// together apply the mask one process would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BatchPart {
    /// The first row.
    pub start: usize,
    /// The rows (0: the whole batch).
    pub len: usize,
    /// The rows of the global batch.
    pub global: usize,
}

impl Dropout {
    /// Dropout with probability `p` (an error unless `0 <= p < 1`) and mask seed `seed`.
    pub fn new(p: f64, seed: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                "dropout",
                format!("p = {p} is not in [0, 1)"),
                &crate::Shape::default(),
            ));
        }
        Ok(Dropout {
            p,
            seed,
            calls: AtomicU64::new(0),
            part: Default::default(),
        })
    }

    /// Which rows of the global batch the inputs hold from now on.
    pub fn set_part(&self, p: BatchPart) {
        for (a, v) in self.part.iter().zip([p.start, p.len, p.global]) {
            a.store(v as u64, Ordering::Relaxed);
        }
    }

    /// Moves the call counter to `n`: a resumed run sets it to where the interrupted one
    /// was, so its masks repeat.
    pub fn set_calls(&self, n: u64) {
        self.calls.store(n, Ordering::Relaxed)
    }

    /// Whether the next draw drops a whole module when `train` (probability `p`): one uniform
    /// draw a call from the same seeded counter as [`Dropout::forward`], through the
    /// autograd's draw log (a checkpointed block's re-run repeats it). Kohya's and LyCORIS's
    /// module dropout: an adapter skipped for a whole forward.
    pub fn drops(&self, train: bool) -> bool {
        if !train || self.p == 0.0 {
            return false;
        }
        let k = crate::autograd::next_draw(&self.calls);
        let z = mix64(self.seed ^ k.wrapping_mul(GOLDEN));
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.p
    }

    /// x with the next mask applied when `train`; x unchanged otherwise (or when `p` is 0).
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self.mask(x.shape().clone(), x.dtype(), x.device(), train)? {
            Some(m) => x.mul(&m),
            None => Ok(x.clone()),
        }
    }

    /// The next mask for a tensor of `shape` when `train` and `p` > 0: 0 where dropped,
    /// 1 / (1 - p) where kept, its first axis samples of the global batch as
    /// [`Dropout::forward`] draws them. Broadcast against a larger tensor, it drops whole
    /// slices (a sample's rank components, say).
    pub fn mask(
        &self,
        shape: crate::Shape,
        dtype: crate::DType,
        device: &crate::Device,
        train: bool,
    ) -> Result<Option<Tensor>> {
        if !train || self.p == 0.0 {
            return Ok(None);
        }
        // Through the autograd's draw log, so a checkpointed block's re-run repeats the mask.
        let k = crate::autograd::next_draw(&self.calls);
        // splitmix64 of (seed, call): independent streams per call.
        let z = mix64(self.seed ^ k.wrapping_mul(GOLDEN));
        let [start, len, global] = self
            .part
            .each_ref()
            .map(|a| a.load(Ordering::Relaxed) as usize);
        let n = shape.dims().first().copied().unwrap_or(1);
        let u = if len > 0 && global != len && n % len == 0 {
            // x's first dim is `len` samples of n / len rows each (batch outermost): draw
            // the global batch's mask and keep this part's rows.
            let per = n / len;
            let mut dims = shape.dims().to_vec();
            dims[0] = per * global;
            Tensor::rand(dims, dtype, device, z)?.narrow(0, per * start, per * len)?
        } else {
            Tensor::rand(shape, dtype, device, z)?
        };
        let keep = u.cmp_scalar(self.p, crate::CmpOp::Ge)?;
        keep.affine(1.0 / (1.0 - self.p), 0.0).map(Some)
    }
}
