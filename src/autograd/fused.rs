//! Fused kernels on the tape: a [`FusedKernel`] is a `backend::Kernel` (its check and its
//! implementation per backend) that also says how its output's gradient flows back to its
//! inputs and which of them that reads. A call records `Op::Fused` with the kernel, its
//! differentiable inputs and the tensors it keeps for the backward (statistics, constant
//! tables). The backward calls the kernel's `vjp`; nothing else in the autograd names the
//! kernel.

use super::{record, Op};
use crate::backend::Kernel;
use crate::device::Storage;
use crate::{Result, Shape, Tensor};
use std::sync::Arc;

/// A fused kernel with a gradient.
pub trait FusedKernel: Kernel {
    /// For each differentiable input, whether `vjp` reads its value, given which inputs need
    /// gradients (the others are kept as graph edges only, their storage free to go).
    fn reads_inputs(&self, needs_grad: &[bool]) -> Vec<bool>;

    /// Whether `vjp` reads the output's value (the output then keeps its storage while the
    /// graph holds it).
    fn reads_output(&self) -> bool {
        false
    }

    /// The gradients of the inputs (in the order recorded; `None` for one that gets none)
    /// given the output's gradient `g`, the inputs (edges where `reads_inputs` said so), the
    /// tensors kept for the backward, and the output. Runs with recording off.
    fn vjp(
        &self,
        inputs: &[Tensor],
        kept: &[Tensor],
        out: &Tensor,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>>;
}

/// Runs kernel `k` on the tensors' storages and views, returning its output storages
/// (unrecorded).
pub(crate) fn run_kernel(k: &dyn Kernel, args: &[&Tensor]) -> Result<Vec<Storage>> {
    let guards = args
        .iter()
        .map(|t| t.storage())
        .collect::<Result<Vec<_>>>()?;
    let pairs: Vec<_> = guards
        .iter()
        .zip(args)
        .map(|(g, t)| (&**g, t.layout()))
        .collect();
    Storage::kernel(k, &pairs)
}

/// Output storage `s` of shape `shape` on `like`'s device, recording `k` over `inputs` (with
/// `kept` for its backward) when an input needs a gradient (the kernel is boxed only then).
pub(crate) fn recorded<K: FusedKernel + 'static>(
    k: K,
    s: Storage,
    shape: impl Into<Shape>,
    inputs: &[&Tensor],
    kept: &[&Tensor],
) -> Tensor {
    let like = inputs[0];
    let rec = record_kernel(k, inputs, kept);
    Tensor::from_storage(s, shape.into(), like.device().clone(), rec)
}

/// The record of `k` over `inputs` (with `kept` for its backward), `None` unless an input
/// needs a gradient (the kernel is boxed only then): for an output that is not a fresh
/// storage of the kernel (attention's, which a checkpoint may have kept from its forward).
pub(crate) fn record_kernel<K: FusedKernel + 'static>(
    k: K,
    inputs: &[&Tensor],
    kept: &[&Tensor],
) -> Option<Op> {
    record(inputs, || Op::Fused {
        kernel: Arc::new(k),
        inputs: inputs.iter().map(|t| (*t).clone()).collect(),
        kept: kept.iter().map(|t| (*t).clone()).collect(),
    })
}

/// Output storage `s` of shape `shape` on `like`'s device, not recorded (a backward's
/// pieces, constants).
pub(crate) fn plain(s: Storage, shape: impl Into<Shape>, like: &Tensor) -> Tensor {
    Tensor::from_storage(s, shape.into(), like.device().clone(), None)
}
