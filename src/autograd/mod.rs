//! Reverse-mode autograd. Each op output that depends on a trainable tensor records its `Op`
//! (inputs kept alive by Arc); `backward` sorts the recorded graph into a tape, walks it in
//! reverse applying one VJP per primitive (`backward.rs`), and frees each node's record as it
//! goes. Composite ops (softmax, norms, ...) record only their primitives, so they need no
//! backward code. Gradients live in a `Grads` map keyed by tensor id, outside the tensors.

pub mod ahead;
mod backward;
mod checkpoint;
mod custom;
mod fused;
pub mod gradcheck;

pub use checkpoint::{
    checkpoint, checkpoint_keeping, checkpoint_opts, checkpoint_with, kept_reused, next_draw,
    uncheckpointed, unread_skipped, CheckpointHooks, CheckpointOptions, Keep, PackedTensor, Pass,
    SavedHooks, FEW_ROWS,
};
pub(crate) use checkpoint::{
    hooked_computes, hooked_product, kept_or, kept_or_replayed, note_forward_only,
    take_unread_product, unread_product, KeptKind,
};
pub use custom::{custom_op, CustomBackward};
pub use fused::FusedKernel;
pub(crate) use fused::{plain, record_kernel, recorded, run_kernel};

use crate::backend::{BinaryOp, NormKind, ReduceOp, UnaryOp, Window2d};
use crate::{Tensor, TensorId};
use std::cell::Cell;
use std::collections::HashMap;

pub(crate) enum Op {
    Unary(Tensor, UnaryOp),
    /// Operands already broadcast to the output's shape.
    Binary(Tensor, Tensor, BinaryOp),
    /// (mask, on_true, on_false), broadcast to the output's shape.
    Where(Tensor, Tensor, Tensor),
    /// Sum, Max or Min over dims; the output keeps reduced dims as size 1.
    Reduce(Tensor, ReduceOp, Vec<usize>),
    Cast(Tensor),
    Copy(Tensor),
    Reshape(Tensor),
    Permute(Tensor, Vec<usize>),
    /// (input, dim, start)
    Narrow(Tensor, usize, usize),
    Broadcast(Tensor),
    Cat(Vec<Tensor>, usize),
    /// (input, ids, dim)
    IndexSelect(Tensor, Tensor, usize),
    Gather(Tensor, Tensor, usize),
    /// (dst, ids, src, dim)
    ScatterAdd(Tensor, Tensor, Tensor, usize),
    /// Rank-3 operands (B, M, K) @ (B, K, N).
    Matmul(Tensor, Tensor),
    /// out = c + a @ b + bias: a (B, M, K), b (B, K, N), c (B, M, N) when present (never
    /// read: its values may have been overwritten by the sum), bias (N) added to every row.
    Addmm {
        c: Option<Tensor>,
        a: Tensor,
        b: Tensor,
        bias: Option<Tensor>,
    },
    /// A copy to another device; the gradient goes back to the input's device.
    ToDevice(Tensor),
    /// The fused softmax over the last dim.
    Softmax(Tensor),
    /// im2col of (N, C, H, W).
    Unfold2d(Tensor, Window2d),
    /// col2im back to (N, C, H, W).
    Fold2d(Tensor, Window2d),
    /// The fused last-dim normalization with its saved statistics.
    Norm {
        x: Tensor,
        weight: Option<Tensor>,
        bias: Option<Tensor>,
        mean: Tensor,
        rstd: Tensor,
        kind: NormKind,
    },
    /// A node with its own backward (`CustomBackward`: checkpointed blocks, ...) over any
    /// number of inputs and outputs. Its tensor has no storage; each output records `Output`.
    /// The inputs are graph edges: the node saves what its backward needs itself.
    Custom {
        inputs: Vec<Tensor>,
        node: std::sync::Arc<dyn CustomBackward>,
    },
    /// A fused kernel with its own gradient (`FusedKernel`): its differentiable inputs and
    /// the tensors it keeps for the backward.
    Fused {
        kernel: std::sync::Arc<dyn FusedKernel>,
        inputs: Vec<Tensor>,
        kept: Vec<Tensor>,
    },
    /// Output `index` of `count` of a custom node (the node's storage-less tensor).
    Output {
        node: Tensor,
        index: usize,
        count: usize,
    },
}

/// Every kind of recorded op but the registered fused kernels, by name (see
/// [`differentiable_ops`]). `to_device` is not listed: it needs two devices, and the GPU
/// suite checks its gradient.
pub const DIFFERENTIABLE_OPS: &[&str] = &[
    "neg",
    "recip",
    "exp",
    "log",
    "sqrt",
    "sin",
    "cos",
    "tanh",
    "erf",
    "abs",
    "affine",
    "powf",
    "add",
    "sub",
    "mul",
    "div",
    "maximum",
    "minimum",
    "where",
    "sum",
    "max",
    "min",
    "cast",
    "copy",
    "reshape",
    "permute",
    "narrow",
    "broadcast",
    "cat",
    "index_select",
    "gather",
    "scatter_add",
    "matmul",
    "softmax",
    "unfold2d",
    "fold2d",
    "norm",
    "gelu",
    "gelu_tanh",
    "silu",
    "checkpoint",
    "custom_output",
];

/// Every kind of recorded op, by name: [`DIFFERENTIABLE_OPS`] and the fused kernels
/// registered in `tensor::kernels::KERNELS`. The CPU gradcheck suite must exercise each one.
pub fn differentiable_ops() -> Vec<&'static str> {
    let mut v = DIFFERENTIABLE_OPS.to_vec();
    v.extend(crate::tensor::kernels::KERNELS.iter().map(|k| k.name()));
    v
}

impl Op {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Op::Unary(_, u) => u.name(),
            Op::Binary(_, _, b) => b.name(),
            Op::Where(..) => "where",
            Op::Reduce(_, r, _) => r.name(),
            Op::Cast(_) => "cast",
            Op::Copy(_) => "copy",
            Op::Reshape(_) => "reshape",
            Op::Permute(..) => "permute",
            Op::Narrow(..) => "narrow",
            Op::Broadcast(_) => "broadcast",
            Op::Cat(..) => "cat",
            Op::IndexSelect(..) => "index_select",
            Op::Gather(..) => "gather",
            Op::ScatterAdd(..) => "scatter_add",
            Op::Matmul(..) | Op::Addmm { .. } => "matmul",
            Op::ToDevice(_) => "to_device",
            Op::Softmax(_) => "softmax",
            Op::Unfold2d(..) => "unfold2d",
            Op::Fold2d(..) => "fold2d",
            Op::Norm { .. } => "norm",
            Op::Custom { node, .. } => node.name(),
            Op::Fused { kernel, .. } => kernel.name(),
            Op::Output { .. } => "custom_output",
        }
    }

    /// Whether the op's forward launches work on a device: views (reshapes, permutes,
    /// narrows, broadcasts) and a custom op's extra outputs do not.
    fn launches(&self) -> bool {
        !matches!(
            self,
            Op::Reshape(_)
                | Op::Permute(..)
                | Op::Narrow(..)
                | Op::Broadcast(_)
                | Op::Output { .. }
        )
    }

    /// Every tensor the op holds (inputs, indices, masks), consuming it.
    pub(crate) fn into_tensors(self) -> Vec<Tensor> {
        match self {
            Op::Unary(x, _)
            | Op::Reduce(x, _, _)
            | Op::Cast(x)
            | Op::Copy(x)
            | Op::Reshape(x)
            | Op::Permute(x, _)
            | Op::Narrow(x, _, _)
            | Op::Broadcast(x)
            | Op::ToDevice(x)
            | Op::Softmax(x)
            | Op::Unfold2d(x, _)
            | Op::Fold2d(x, _) => vec![x],
            Op::Norm {
                x,
                weight,
                bias,
                mean,
                rstd,
                ..
            } => [Some(x), weight, bias, Some(mean), Some(rstd)]
                .into_iter()
                .flatten()
                .collect(),
            Op::Addmm { c, a, b, bias } => {
                [c, Some(a), Some(b), bias].into_iter().flatten().collect()
            }
            Op::Binary(a, b, _)
            | Op::Matmul(a, b)
            | Op::IndexSelect(a, b, _)
            | Op::Gather(a, b, _) => vec![a, b],
            Op::Where(m, t, f) => vec![m, t, f],
            Op::ScatterAdd(d, i, s, _) => vec![d, i, s],
            Op::Cat(xs, _) | Op::Custom { inputs: xs, .. } => xs,
            Op::Fused { inputs, kept, .. } => inputs.into_iter().chain(kept).collect(),
            Op::Output { node, .. } => vec![node],
        }
    }

    /// Inputs that gradients may flow to (indices and masks excluded).
    pub(crate) fn inputs(&self) -> Vec<&Tensor> {
        match self {
            Op::Unary(x, _)
            | Op::Reduce(x, _, _)
            | Op::Cast(x)
            | Op::Copy(x)
            | Op::Reshape(x)
            | Op::Permute(x, _)
            | Op::Narrow(x, _, _)
            | Op::Broadcast(x)
            | Op::IndexSelect(x, _, _)
            | Op::Gather(x, _, _)
            | Op::ToDevice(x)
            | Op::Softmax(x)
            | Op::Unfold2d(x, _)
            | Op::Fold2d(x, _) => vec![x],
            Op::Norm {
                x, weight, bias, ..
            } => [Some(x), weight.as_ref(), bias.as_ref()]
                .into_iter()
                .flatten()
                .collect(),
            Op::Addmm { c, a, b, bias } => [c.as_ref(), Some(a), Some(b), bias.as_ref()]
                .into_iter()
                .flatten()
                .collect(),
            Op::Binary(a, b, _) | Op::Matmul(a, b) => vec![a, b],
            Op::Where(_, t, f) => vec![t, f],
            Op::Cat(xs, _) | Op::Custom { inputs: xs, .. } | Op::Fused { inputs: xs, .. } => {
                xs.iter().collect()
            }
            Op::ScatterAdd(d, _, s, _) => vec![d, s],
            Op::Output { node, .. } => vec![node],
        }
    }
}

thread_local! {
    static NO_GRAD_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// While set, `record` records nothing and only notes (in `PROBE_HIT`) that it would
    /// have: a checkpointed forward learns whether its outputs need a graph node.
    static PROBING: Cell<bool> = const { Cell::new(false) };
    static PROBE_HIT: Cell<bool> = const { Cell::new(false) };
    /// Ops recorded on this thread, and views among them (`recorded_ops`).
    static RECORDED: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// How many ops this thread has recorded on the tape so far: (those that launch work, the
/// views). The differences across a forward are the kernels it issues for the backward to
/// answer (a launch or more each on a GPU) and the views it makes: the planner's time model
/// charges the host for both (`BlockShape::ops`, `BlockShape::views`).
pub fn recorded_ops() -> (u64, u64) {
    RECORDED.with(|r| r.get())
}

/// Adds ops and views recorded for this thread elsewhere (a re-run issued ahead on the
/// helper thread, `ahead`) to its counts.
pub(crate) fn count_recorded(ops: u64, views: u64) {
    RECORDED.with(|r| {
        let (a, b) = r.get();
        r.set((a + ops, b + views));
    });
}

/// Whether ops on this thread are recorded (false inside a `no_grad` guard).
pub fn grad_enabled() -> bool {
    NO_GRAD_DEPTH.with(|d| d.get() == 0)
}

/// While the guard lives, nothing on this thread is recorded. Guards nest.
#[must_use = "recording resumes when the guard is dropped"]
pub struct NoGradGuard(());

/// Stops recording ops on this thread until the returned guard is dropped.
pub fn no_grad() -> NoGradGuard {
    NO_GRAD_DEPTH.with(|d| d.set(d.get() + 1));
    NoGradGuard(())
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        NO_GRAD_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Recording on again (inside a `no_grad` region, such as the backward pass re-running a
/// checkpointed block) until dropped; the previous state comes back then.
pub(crate) struct EnableGradGuard {
    depth: u32,
    probing: bool,
}

pub(crate) fn enable_grad() -> EnableGradGuard {
    EnableGradGuard {
        depth: NO_GRAD_DEPTH.with(|d| d.replace(0)),
        probing: PROBING.with(|p| p.replace(false)),
    }
}

impl Drop for EnableGradGuard {
    fn drop(&mut self) {
        NO_GRAD_DEPTH.with(|d| d.set(self.depth));
        PROBING.with(|p| p.set(self.probing));
    }
}

/// Runs `f` recording nothing; returns its result and whether any op inside would have been
/// recorded (some input of an op required grad). An enclosing probe sees that too.
pub(crate) fn probe<R>(f: impl FnOnce() -> R) -> (R, bool) {
    let probing = PROBING.with(|p| p.replace(true));
    let outer_hit = PROBE_HIT.with(|h| h.replace(false));
    let r = f();
    let hit = PROBE_HIT.with(|h| h.get());
    PROBING.with(|p| p.set(probing));
    PROBE_HIT.with(|h| h.set(outer_hit || hit));
    (r, hit)
}

/// The op to record for an output of `inputs`, built only if any input requires grad and
/// recording is on: inference records nothing and builds nothing.
pub(crate) fn record(inputs: &[&Tensor], op: impl FnOnce() -> Op) -> Option<Op> {
    if !grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return None;
    }
    if PROBING.with(|p| p.get()) {
        PROBE_HIT.with(|h| h.set(true));
        return None;
    }
    let op = op().slim();
    let launches = op.launches();
    RECORDED.with(|r| {
        let (ops, views) = r.get();
        r.set(if launches {
            (ops + 1, views)
        } else {
            (ops, views + 1)
        })
    });
    Some(op)
}

/// `t` by value when `keep`, else its graph edge.
fn keep_if(t: Tensor, keep: bool) -> Tensor {
    if keep {
        t
    } else {
        t.edge()
    }
}

impl Op {
    /// Whether this op's VJP reads its output's values (then the output keeps its storage
    /// when later ops take it as an edge).
    pub(crate) fn reads_output(&self) -> bool {
        match self {
            Op::Unary(_, u) => matches!(
                u,
                UnaryOp::Recip | UnaryOp::Exp | UnaryOp::Sqrt | UnaryOp::Tanh
            ),
            Op::Binary(_, _, b) => *b == BinaryOp::Div,
            Op::Reduce(_, r, _) => *r != ReduceOp::Sum,
            Op::Softmax(_) => true,
            Op::Fused { kernel, .. } => kernel.reads_output(),
            _ => false,
        }
    }

    /// The op with every input its VJP does not read by value replaced by a graph edge
    /// (`Tensor::edge`), given which inputs need gradients: e.g. a matmul with a frozen
    /// weight keeps the weight (for dA = dC B^T) but not the activation A.
    fn slim(self) -> Op {
        let e = |t: Tensor| t.edge();
        match self {
            Op::Unary(x, u) => {
                let reads_x = !matches!(
                    u,
                    UnaryOp::Neg
                        | UnaryOp::Affine { .. }
                        | UnaryOp::Recip
                        | UnaryOp::Exp
                        | UnaryOp::Sqrt
                        | UnaryOp::Tanh
                );
                Op::Unary(keep_if(x, reads_x), u)
            }
            Op::Binary(a, b, op) => match op {
                BinaryOp::Add | BinaryOp::Sub => Op::Binary(e(a), e(b), op),
                // d/da ab = b, d/db ab = a.
                BinaryOp::Mul => {
                    let (ga, gb) = (a.requires_grad(), b.requires_grad());
                    Op::Binary(keep_if(a, gb), keep_if(b, ga), op)
                }
                // d/da a/b = 1/b, d/db a/b = -out/b: a is never read.
                BinaryOp::Div => Op::Binary(e(a), b, op),
                _ => Op::Binary(a, b, op),
            },
            Op::Where(m, t, f) => Op::Where(m, e(t), e(f)),
            Op::Reduce(x, r, dims) => Op::Reduce(keep_if(x, r != ReduceOp::Sum), r, dims),
            Op::Cast(x) => Op::Cast(e(x)),
            Op::Copy(x) => Op::Copy(e(x)),
            Op::Reshape(x) => Op::Reshape(e(x)),
            Op::Permute(x, p) => Op::Permute(e(x), p),
            Op::Narrow(x, d, s) => Op::Narrow(e(x), d, s),
            Op::Broadcast(x) => Op::Broadcast(e(x)),
            Op::Cat(xs, d) => Op::Cat(xs.into_iter().map(e).collect(), d),
            Op::IndexSelect(x, ids, d) => Op::IndexSelect(e(x), ids, d),
            Op::Gather(x, ids, d) => Op::Gather(e(x), ids, d),
            Op::ScatterAdd(dst, ids, src, d) => Op::ScatterAdd(e(dst), ids, e(src), d),
            // dA = dC B^T needs B; dB = A^T dC needs A.
            Op::Matmul(a, b) => {
                let (ga, gb) = (a.requires_grad(), b.requires_grad());
                Op::Matmul(keep_if(a, gb), keep_if(b, ga))
            }
            // As Matmul; c and bias are never read (dc = g, dbias = the row sums of g).
            Op::Addmm { c, a, b, bias } => {
                let (ga, gb) = (a.requires_grad(), b.requires_grad());
                Op::Addmm {
                    c: c.map(e),
                    a: keep_if(a, gb),
                    b: keep_if(b, ga),
                    bias: bias.map(e),
                }
            }
            Op::ToDevice(x) => Op::ToDevice(e(x)),
            Op::Softmax(x) => Op::Softmax(e(x)),
            Op::Unfold2d(x, w) => Op::Unfold2d(e(x), w),
            Op::Fold2d(x, w) => Op::Fold2d(e(x), w),
            Op::Norm {
                x,
                weight,
                bias,
                mean,
                rstd,
                kind,
            } => Op::Norm {
                x,
                weight,
                bias: bias.map(e),
                mean,
                rstd,
                kind,
            },
            Op::Custom { inputs, node } => Op::Custom {
                inputs: inputs.into_iter().map(e).collect(),
                node,
            },
            Op::Fused {
                kernel,
                inputs,
                kept,
            } => {
                let needs: Vec<bool> = inputs.iter().map(Tensor::requires_grad).collect();
                let reads = kernel.reads_inputs(&needs);
                Op::Fused {
                    inputs: inputs
                        .into_iter()
                        .enumerate()
                        .map(|(i, t)| keep_if(t, reads.get(i).copied().unwrap_or(true)))
                        .collect(),
                    kernel,
                    kept,
                }
            }
            op @ Op::Output { .. } => op,
        }
    }
}

/// Told when a backward has summed a leaf's gradient: every contribution of that backward
/// is in it (data-parallel training starts summing it over the ranks then, while the
/// backward goes on).
pub trait GradHook: Send + Sync {
    /// Leaf `id`'s gradient, as it stands after this backward's contributions.
    fn ready(&self, id: TensorId, grad: &Tensor) -> crate::Result<()>;
}

/// Gradients of leaf tensors, keyed by tensor id. `backward_into` adds to what is here, so
/// gradients accumulate across backward calls until `zero_grad`.
#[derive(Default, Clone)]
pub struct Grads {
    map: HashMap<TensorId, Tensor>,
    hook: Option<std::sync::Arc<dyn GradHook>>,
}

impl Grads {
    /// An empty set of gradients.
    pub fn new() -> Self {
        Self::default()
    }
    /// The gradient of `t` (same shape as `t`), if one was computed.
    pub fn get(&self, t: &Tensor) -> Option<&Tensor> {
        self.map.get(&t.id())
    }
    /// The gradient of the tensor with id `id`, if one was computed.
    pub fn get_id(&self, id: TensorId) -> Option<&Tensor> {
        self.map.get(&id)
    }
    /// Sets the gradient of `t`, returning the one it replaces.
    pub fn insert(&mut self, t: &Tensor, grad: Tensor) -> Option<Tensor> {
        self.map.insert(t.id(), grad)
    }
    /// Takes the gradient of `t` out, if there is one.
    pub fn remove(&mut self, t: &Tensor) -> Option<Tensor> {
        self.map.remove(&t.id())
    }
    /// Calls `hook` each time a backward has summed a leaf's gradient (`None`: stop).
    pub fn set_hook(&mut self, hook: Option<std::sync::Arc<dyn GradHook>>) {
        self.hook = hook;
    }
    /// Forgets every gradient.
    pub fn zero_grad(&mut self) {
        self.map.clear()
    }
    /// Number of tensors with a gradient.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// True when no tensor has a gradient.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Sets leaf `id`'s gradient to `g`, a sum its caller formed of every contribution so
    /// far (a grouped fold of compute copies' gradients), and tells the hook as
    /// `accumulate` does.
    pub(crate) fn set_summed(&mut self, id: TensorId, g: Tensor) -> crate::Result<()> {
        if let Some(h) = &self.hook {
            h.ready(id, &g)?;
        }
        self.map.insert(id, g);
        Ok(())
    }
    /// Takes the gradient of the tensor with id `id` out, if there is one.
    pub(crate) fn remove_id(&mut self, id: TensorId) -> Option<Tensor> {
        self.map.remove(&id)
    }
    pub(crate) fn accumulate(&mut self, id: TensorId, g: Tensor) -> crate::Result<()> {
        let _guard = no_grad();
        let sum = match self.map.remove(&id) {
            Some(prev) => prev.add(&g)?,
            None => g,
        };
        if let Some(h) = &self.hook {
            h.ready(id, &sum)?;
        }
        self.map.insert(id, sum);
        Ok(())
    }
}
