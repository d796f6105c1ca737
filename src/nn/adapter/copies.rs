//! Compute copies of the adapters' trainable weights, made once a step: mixed-precision
//! training's master weights (Micikevicius et al. 2018): the weights are f32 masters that the
//! optimizer updates, the forward reading copies in the activations' dtype. Without them each
//! use of a weight casts it (`super::cast`, one launch) and the backward casts its gradient
//! back (the cast's VJP, one launch): two launches per weight per step, and two more for each
//! checkpointed block's re-run.
//!
//! [`ComputeCopies::new`] makes every copy of a set in one grouped launch
//! (`tensor::multi::cast_multi`): copy = the master scaled by its factor (a kind may fold
//! its scale into a weight, `Adapter::cast_params`) and rounded once to the compute dtype, the values one after another
//! in one buffer, each copy a view of it and a leaf of its own that gradients accumulate for.
//! While a set is entered ([`ComputeCopies::enter`], on this thread, as PyTorch's autocast
//! keeps its weight-cast cache) the adapters' forwards read the copy where they would cast
//! the master (`super::cast_scaled`); a checkpointed block's re-run, inside the same
//! backward, reads the same copies. [`ComputeCopies::fold`], after the backward, adds every
//! copy's gradient into its master's f32 gradient in one grouped launch
//! (`tensor::multi::fold_multi`): `prev + factor * g`, rounded in f32 as the per-use path's
//! VJPs round it.
//!
//! Values: a copy is the per-use cast's value bit for bit (`backend::multi::copy_value`).
//! A master's f32 gradient is the per-use path's bit for bit where each copy takes one
//! gradient contribution per backward (each adapted layer called once a forward, whatever the
//! checkpointing): the per-use path adds the same f32 value `factor * g` to the same earlier
//! sum. A layer called k > 1 times a forward sums its k contributions in the compute dtype
//! before the fold instead of in f32 after each cast; its gradient then agrees to that
//! dtype's rounding of the sum.
//!
//! Ownership: a step makes its copies after the previous optimizer step (the masters'
//! values then) and drops them before its own, so a forward never reads a copy older than the
//! masters. Without an entered set (sampling, a gradcheck through `Adapter::forward_with`
//! with tensors of its own) every lookup misses and the forward casts as it always did.

use crate::autograd::{no_grad, Grads};
use crate::tensor::multi::{cast_multi, fold_multi, FoldSlot};
use crate::{DType, Error, Result, Tensor, TensorId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// One master's copy.
#[derive(Debug)]
struct Entry {
    master: Tensor,
    scale: f64,
    copy: Tensor,
}

/// The compute copies of a set of f32 master weights, for one step (see the module docs).
#[derive(Debug)]
pub struct ComputeCopies {
    dtype: DType,
    entries: Vec<Entry>,
    /// (master id, factor bits) -> index in `entries`.
    index: HashMap<(TensorId, u64), usize>,
}

thread_local! {
    /// The sets entered on this thread, innermost last.
    static ACTIVE: RefCell<Vec<Arc<ComputeCopies>>> = const { RefCell::new(Vec::new()) };
}

/// Leaves the set `ComputeCopies::enter` entered when dropped.
#[must_use = "the copies are read only while the guard lives"]
pub struct CopiesGuard(());

impl Drop for CopiesGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().pop());
    }
}

impl ComputeCopies {
    /// The copies of `weights` (each master with the factor its forward scales it by) in
    /// `dtype`, made by one grouped launch. A (master, factor) pair given twice is copied
    /// once.
    pub fn new(weights: Vec<(Tensor, f64)>, dtype: DType) -> Result<Arc<Self>> {
        let mut index = HashMap::new();
        let mut unique: Vec<(Tensor, f64)> = vec![];
        for (t, s) in weights {
            if !s.is_finite() {
                return Err(Error::invalid(
                    "compute copies",
                    format!("the factor {s} is not finite"),
                    t.shape(),
                ));
            }
            let key = (t.id(), s.to_bits());
            if let std::collections::hash_map::Entry::Vacant(v) = index.entry(key) {
                v.insert(unique.len());
                unique.push((t, s));
            }
        }
        let _g = no_grad();
        let pairs: Vec<(&Tensor, f32)> = unique.iter().map(|(t, s)| (t, *s as f32)).collect();
        let Some(buf) = cast_multi(&pairs, dtype)? else {
            return Ok(Arc::new(ComputeCopies {
                dtype,
                entries: vec![],
                index,
            }));
        };
        let mut entries = Vec::with_capacity(unique.len());
        let mut start = 0;
        for (master, scale) in unique {
            let n = master.elem_count();
            let copy = buf
                .narrow(0, start, n)?
                .reshape(master.shape().clone())?
                .detach();
            copy.set_requires_grad(true)?;
            start += n;
            entries.push(Entry {
                master,
                scale,
                copy,
            });
        }
        Ok(Arc::new(ComputeCopies {
            dtype,
            entries,
            index,
        }))
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How many copies.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The copy of `master` scaled by `scale`, if this set holds one.
    pub fn get(&self, master: &Tensor, scale: f64) -> Option<&Tensor> {
        let i = self.index.get(&(master.id(), scale.to_bits()))?;
        self.entries.get(*i).map(|e| &e.copy)
    }

    /// The adapters' forwards on this thread read these copies until the guard drops.
    pub fn enter(self: &Arc<Self>) -> CopiesGuard {
        crate::autograd::ahead::register_carrier(carry);
        ACTIVE.with(|a| a.borrow_mut().push(self.clone()));
        CopiesGuard(())
    }

    /// Adds every copy's gradient in `grads` into its master's f32 gradient there (one
    /// grouped launch), taking the copies' gradients out; returns how many it folded. Call
    /// after each backward that read the copies (each micro-batch's).
    pub fn fold(&self, grads: &mut Grads) -> Result<usize> {
        let _g = no_grad();
        let mut taken: Vec<(&Entry, Tensor)> = vec![];
        for e in &self.entries {
            if let Some(g) = grads.remove_id(e.copy.id()) {
                taken.push((e, g));
            }
        }
        if taken.is_empty() {
            return Ok(0);
        }
        let prevs: Vec<Option<Tensor>> = taken
            .iter()
            .map(|(e, _)| grads.remove_id(e.master.id()))
            .collect();
        for (p, (e, _)) in prevs.iter().zip(&taken) {
            if let Some(p) = p {
                if p.dtype() != DType::F32 || p.shape() != e.master.shape() {
                    return Err(Error::invalid(
                        "compute copies",
                        format!(
                            "a master's gradient {:?} {} for a master {}",
                            p.dtype(),
                            p.shape(),
                            e.master.shape()
                        ),
                        e.master.shape(),
                    ));
                }
            }
        }
        let slots: Vec<FoldSlot<'_>> = taken
            .iter()
            .zip(&prevs)
            .map(|((e, g), prev)| FoldSlot {
                g,
                prev: prev.as_ref(),
                scale: e.scale as f32,
            })
            .collect();
        let Some(out) = fold_multi(&slots)? else {
            return Ok(0);
        };
        let mut start = 0;
        for (e, _) in &taken {
            let n = e.master.elem_count();
            let g = out.narrow(0, start, n)?.reshape(e.master.shape().clone())?;
            start += n;
            grads.set_summed(e.master.id(), g)?;
        }
        Ok(taken.len())
    }
}

/// The sets entered on this thread, entered again on the thread that runs a re-run issued
/// ahead (`crate::autograd::ahead`) for that run's length.
fn carry() -> crate::autograd::ahead::Reenter {
    let sets: Vec<Arc<ComputeCopies>> = ACTIVE.with(|a| a.borrow().clone());
    Box::new(move || {
        let guards: Vec<CopiesGuard> = sets.iter().map(|s| s.enter()).collect();
        Box::new(guards)
    })
}

/// The copy of `master` scaled by `scale` in `dtype` from the sets entered on this thread
/// (innermost first), if one holds it.
pub(crate) fn copy_of(master: &Tensor, scale: f64, dtype: DType) -> Option<Tensor> {
    ACTIVE.with(|a| {
        a.borrow()
            .iter()
            .rev()
            .filter(|set| set.dtype == dtype)
            .find_map(|set| set.get(master, scale).cloned())
    })
}
