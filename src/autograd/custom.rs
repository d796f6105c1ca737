//! Nodes with their own backward, the way candle's custom ops or PyTorch's
//! `autograd.Function` work: a computation of any number of inputs and outputs whose
//! gradient rule is code rather than a record of primitives. Gradient checkpointing
//! (`checkpoint.rs`) is built on it; so can anything that decides for itself what it keeps
//! for the backward (weights re-fetched from host memory, inputs offloaded).
//!
//! In the graph, the node is a storage-less tensor recording `Op::Custom` over the inputs,
//! and each output records `Op::Output` over the node. The backward walks outputs before
//! their node (they depend on it), collecting the outputs' gradients, then calls the node's
//! `backward` once with all of them.

use super::{record, Grads, Op};
use crate::{Result, Tensor};
use std::sync::Arc;

/// The backward of a custom node.
pub trait CustomBackward: Send + Sync {
    /// The node's name in graph listings (`graph_ops`), e.g. "checkpoint".
    fn name(&self) -> &'static str;

    /// Called by the backward walk when this node is the next custom node it will reach
    /// (`super::ahead`): a node may start the part of its backward that needs no output
    /// gradient (a checkpoint's re-run) on the helper thread. The default does nothing.
    fn prepare(&self) {}

    /// Waits for the work `prepare` started, if any, so the helper thread is free for the
    /// next node's: called just before `backward`. The default does nothing.
    fn settle(&self) {}

    /// Given d(loss)/d(output i) for each output (`None` where an output got no gradient),
    /// returns d(loss)/d(input j) for each input given to `custom_op` (`None` for inputs
    /// that get none). Gradients of trainable leaves the node uses internally (parameters
    /// captured by a checkpointed block) are added to `grads` directly. Runs with recording
    /// off; a node that records (to backpropagate through a re-run) turns it on itself.
    fn backward(
        &self,
        out_grads: &[Option<Tensor>],
        grads: &mut Grads,
    ) -> Result<Vec<Option<Tensor>>>;
}

/// Makes `outputs` (computed from `inputs` without recording) the outputs of a custom node
/// whose backward is `node`; returns them as handles on the tape. When nothing needs a
/// gradient (recording off, or `requires_grad` false) the outputs come back unchanged.
/// `requires_grad` says whether the outputs depend on anything trainable: the inputs, or
/// leaves the computation captured.
pub fn custom_op(
    inputs: &[Tensor],
    outputs: Vec<Tensor>,
    node: Arc<dyn CustomBackward>,
    requires_grad: bool,
) -> Result<Vec<Tensor>> {
    if !requires_grad || !super::grad_enabled() {
        return Ok(outputs);
    }
    let device = match outputs.first() {
        Some(t) => t.device().clone(),
        None => return Ok(outputs),
    };
    let op = Op::Custom {
        inputs: inputs.to_vec(),
        node,
    }
    .slim();
    let node_t = Tensor::graph_node(op, &device);
    let count = outputs.len();
    Ok(outputs
        .into_iter()
        .enumerate()
        .map(|(index, out)| {
            // `record` would skip this when no input requires grad: the node always does.
            let op = record(&[&node_t], || Op::Output {
                node: node_t.clone(),
                index,
                count,
            });
            out.view(out.layout().clone(), op)
        })
        .collect())
}
