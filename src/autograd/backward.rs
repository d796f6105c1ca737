//! The backward pass: sort the recorded graph into a tape (reverse topological order), then
//! apply one VJP per primitive. VJPs are ordinary tensor ops, so they run on every backend.

use super::{no_grad, Grads, Op};
use crate::backend::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{Error, Result, Tensor, TensorId};
use std::collections::{HashMap, HashSet};

fn freed() -> Error {
    Error::Autograd(
        "backward through a graph that an earlier backward already freed; \
         use backward_retain_graph for the first pass to go through it twice"
            .into(),
    )
}

fn lock(t: &Tensor) -> Result<Option<std::sync::MutexGuard<'_, Option<Op>>>> {
    match t.grad_fn() {
        Some(m) => Ok(Some(
            m.lock().map_err(|_| Error::Poisoned("autograd node"))?,
        )),
        None => Ok(None),
    }
}

/// Tensors reachable from `root` through recorded ops, each after all tensors that use it.
pub(crate) fn tape(root: &Tensor) -> Result<Vec<Tensor>> {
    tape_of(std::slice::from_ref(root))
}

/// Like `tape` from several roots.
fn tape_of(roots: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(tape_with_customs(roots)?.0)
}

/// A custom node of a tape, with its position in it.
type CustomAt = (usize, std::sync::Arc<dyn super::CustomBackward>);

/// `tape_of`, and the custom nodes in it in the tape's order, with their positions.
fn tape_with_customs(roots: &[Tensor]) -> Result<(Vec<Tensor>, Vec<CustomAt>)> {
    let mut order = Vec::new();
    let mut customs: Vec<CustomAt> = Vec::new();
    let mut seen = HashSet::new();
    // (tensor, expanded, its custom node if it is one).
    type Entry = (
        Tensor,
        bool,
        Option<std::sync::Arc<dyn super::CustomBackward>>,
    );
    let mut stack: Vec<Entry> = roots
        .iter()
        .rev()
        .map(|r| (r.clone(), false, None))
        .collect();
    while let Some((t, expanded, custom)) = stack.pop() {
        if expanded {
            if let Some(node) = custom {
                customs.push((order.len(), node));
            }
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        let mut children = vec![];
        let mut custom = None;
        if let Some(guard) = lock(&t)? {
            let op = guard.as_ref().ok_or_else(freed)?;
            if let Op::Custom { node, .. } = op {
                custom = Some(node.clone());
            }
            children.extend(
                op.inputs()
                    .into_iter()
                    .filter(|i| i.requires_grad() && !seen.contains(&i.id()))
                    .cloned(),
            );
        }
        stack.push((t, true, custom));
        stack.extend(children.into_iter().map(|c| (c, false, None)));
    }
    order.reverse();
    let n = order.len();
    let customs = customs
        .into_iter()
        .rev()
        .map(|(i, node)| (n - 1 - i, node))
        .collect();
    Ok((order, customs))
}

impl Tensor {
    /// Backward from a single-element tensor; returns the leaf gradients.
    pub fn backward(&self) -> Result<Grads> {
        let mut grads = Grads::new();
        self.backward_into(&mut grads)?;
        Ok(grads)
    }

    /// Backward from a single-element tensor, adding leaf gradients into `grads`.
    pub fn backward_into(&self, grads: &mut Grads) -> Result<()> {
        self.backward_impl(None, grads, false)
    }

    /// Like `backward_into`, keeping the graph for another backward pass.
    pub fn backward_retain_graph(&self, grads: &mut Grads) -> Result<()> {
        self.backward_impl(None, grads, true)
    }

    /// Backward from a tensor of any shape given d(loss)/d(self).
    pub fn backward_with_grad(
        &self,
        grad: &Tensor,
        grads: &mut Grads,
        retain_graph: bool,
    ) -> Result<()> {
        self.backward_impl(Some(grad.clone()), grads, retain_graph)
    }

    fn backward_impl(&self, seed: Option<Tensor>, grads: &mut Grads, retain: bool) -> Result<()> {
        let seed = self.seed(seed)?;
        backward_from(vec![(self.clone(), seed)], grads, retain)
    }

    /// d(loss)/d(self) checked against self, or ones for a single-element self.
    fn seed(&self, seed: Option<Tensor>) -> Result<Tensor> {
        if !self.requires_grad() {
            return Err(Error::Autograd(format!(
                "backward from a tensor that does not require grad (shape {})",
                self.shape()
            )));
        }
        let _g = no_grad();
        Ok(match seed {
            Some(g) if g.shape() == self.shape() => g.to_dtype(self.dtype())?,
            Some(g) => {
                return Err(Error::ShapeMismatch {
                    op: "backward",
                    lhs: self.shape().clone(),
                    rhs: g.shape().clone(),
                })
            }
            None if self.elem_count() == 1 => self.ones_like()?,
            None => {
                return Err(Error::Autograd(format!(
                "backward() needs a single-element tensor, got shape {}; use backward_with_grad",
                self.shape()
            )))
            }
        })
    }
}

/// Backward from several tensors at once, each with its d(loss)/d(tensor) (shapes checked
/// by the caller), adding leaf gradients into `grads`.
pub(crate) fn backward_from(
    seeds: Vec<(Tensor, Tensor)>,
    grads: &mut Grads,
    retain: bool,
) -> Result<()> {
    let _g = no_grad();
    let roots: Vec<Tensor> = seeds.iter().map(|(t, _)| t.clone()).collect();
    // The custom nodes in the walk's order: each, on its turn, lets the next one start
    // what it can ahead (`CustomBackward::prepare`, `super::ahead`).
    let (order, customs) = tape_with_customs(&roots)?;
    drop(roots);
    // Each tensor's gradient contributions, in arrival order, summed when its turn
    // comes (see `sum_contributions`).
    let mut pending: HashMap<TensorId, Vec<Part>> = HashMap::new();
    for (t, g) in seeds {
        pending.entry(t.id()).or_default().push(Part::Full(g));
    }
    // Gradients of a custom node's outputs, gathered until the node's turn.
    let mut outputs: HashMap<TensorId, Vec<Option<Tensor>>> = HashMap::new();
    // The custom nodes not yet passed: each handle goes once the walk passes its node, so
    // a node (a checkpoint, with its saved inputs and kept outputs) is freed with its op,
    // not at the walk's end.
    let mut customs: std::collections::VecDeque<CustomAt> = customs.into();
    if let Some((_, first)) = customs.front() {
        first.prepare();
    }
    // The tape is consumed: once a node's VJP has run (and, without retain_graph, its op
    // with the tensors it saved is dropped), the tape's handle goes too, so activations
    // are freed as the backward walks past them rather than at its end.
    for (pos, t) in order.into_iter().enumerate() {
        // Those before this place were passed (a node whose outputs got no gradient is
        // passed without its backward).
        while customs.front().is_some_and(|(p, _)| *p < pos) {
            customs.pop_front();
        }
        let t = &t;
        let parts = pending.remove(&t.id());
        let sum = |parts: Option<Vec<Part>>| -> Result<Option<Tensor>> {
            parts
                .map(|p| {
                    let _p = crate::profile::backward_op("gradient sums");
                    sum_contributions(p, t.dims())
                })
                .transpose()
        };
        if t.is_var() {
            if let Some(g) = sum(parts)? {
                grads.accumulate(t.id(), g)?;
            }
            continue;
        }
        let Some(mut guard) = lock(t)? else { continue };
        let op = if retain { None } else { guard.take() };
        let op = match (&op, guard.as_ref()) {
            (Some(o), _) | (None, Some(o)) => o,
            (None, None) => return Err(freed()),
        };
        // Contributions a view passes on unformed (see `pass_through`).
        if let Some((x, moved)) = pass_through(op, parts.as_deref().unwrap_or(&[]), t.dims())? {
            if x.requires_grad() {
                pending.entry(x.id()).or_default().extend(moved);
            }
            continue;
        }
        let g = sum(parts)?;
        let input_grads = match op {
            Op::Custom { inputs, node } => {
                let Some(gs) = outputs.remove(&t.id()) else {
                    continue;
                };
                let gis = {
                    let _p = crate::profile::backward_op(node.name());
                    node.settle();
                    // This node's own handle goes; the next one may start ahead.
                    while customs.front().is_some_and(|(p, _)| *p <= pos) {
                        customs.pop_front();
                    }
                    if let Some((_, next)) = customs.front() {
                        next.prepare();
                    }
                    node.backward(&gs, grads)?
                };
                if gis.len() != inputs.len() {
                    return Err(Error::Autograd(format!(
                        "custom node {} returned {} input gradients for {} inputs",
                        node.name(),
                        gis.len(),
                        inputs.len()
                    )));
                }
                inputs
                    .iter()
                    .zip(gis)
                    .filter_map(|(x, gi)| gi.map(|gi| (x.clone(), Part::Full(gi))))
                    .collect()
            }
            Op::Output { node, index, count } => {
                let Some(g) = g else { continue };
                let slots = outputs
                    .entry(node.id())
                    .or_insert_with(|| vec![None; *count]);
                let slot = slots
                    .get_mut(*index)
                    .ok_or_else(|| Error::Autograd(format!("custom output {index} of {count}")))?;
                *slot = Some(match slot.take() {
                    Some(prev) => prev.add(&g)?,
                    None => g,
                });
                continue;
            }
            // A narrow's gradient is its slice of the input's: kept as a slice, so the
            // slices of one input are laid side by side once (see `sum_contributions`)
            // rather than each padded with zeros to the input's size and then added.
            Op::Narrow(x, dim, start) => {
                let Some(g) = g else { continue };
                vec![(
                    x.clone(),
                    Part::Slice {
                        dim: *dim,
                        start: *start,
                        len: g.dims()[*dim],
                        grad: g,
                    },
                )]
            }
            Op::Matmul(..) | Op::Addmm { .. } => {
                let Some(g) = g else { continue };
                let _p = crate::profile::backward_op(op.kind());
                product_vjp(op, &g)?
            }
            _ => {
                let Some(g) = g else { continue };
                let _p = crate::profile::backward_op(op.kind());
                vjp(op, t, &g)?
                    .into_iter()
                    .map(|(x, gx)| (x, Part::Full(gx)))
                    .collect()
            }
        };
        for (input, gi) in input_grads {
            if !input.requires_grad() {
                continue;
            }
            pending.entry(input.id()).or_default().push(gi);
        }
    }
    Ok(())
}

/// One gradient contribution to a tensor: of its whole shape, (from a narrow) of the slice
/// `start..start + len` of dim `dim`, zero elsewhere, or a product not yet formed. A slice's
/// `grad` has the slice's shape, or that shape with `dim` split into several dims where a
/// reshape merged them and the gradient could not be viewed merged (heads split off a fused
/// projection: it is laid into the sum from that shape, one strided copy).
enum Part {
    Full(Tensor),
    Slice {
        dim: usize,
        start: usize,
        len: usize,
        grad: Tensor,
    },
    /// `a @ b` with a (B, M, K), b (K, N) and K small beside N (`deferred_product`).
    Product {
        a: Tensor,
        b: Tensor,
    },
}

impl Part {
    /// The contribution at the tensor's full shape `dims` (a slice padded with zeros, a
    /// product formed).
    fn full(self, dims: &[usize]) -> Result<Tensor> {
        match self {
            Part::Full(g) => Ok(g),
            Part::Slice {
                dim,
                start,
                len,
                grad,
            } => Tensor::lay_along(dims, dim, &[(start, len, &grad)]),
            Part::Product { a, b } => {
                let n = b.dims()[0];
                a.reshape((a.elem_count() / n.max(1), n))?
                    .matmul(&b)?
                    .reshape(dims)
            }
        }
    }
}

/// The contributions `parts` to a view's output that pass to its input unformed, with that
/// input: a lone product through a reshape that keeps its last dim (a linear layer's rows
/// flattened or restored); slices of one dim through a narrow of that dim (shifted by its
/// start) or through a reshape that merges the sliced dim with the dims after it (heads
/// split off a fused projection, merged back) where every slice reshapes as a view. The
/// slices of a fused projection's output then meet at the projection and are laid side by
/// side there once, not first into each narrow's part and again into the whole. None: the
/// parts are summed as usual.
fn pass_through(op: &Op, parts: &[Part], td: &[usize]) -> Result<Option<(Tensor, Vec<Part>)>> {
    let slices = || {
        let mut dim = None;
        for p in parts {
            match p {
                Part::Slice { dim: d, .. } if dim.is_none_or(|x| x == *d) => dim = Some(*d),
                _ => return None,
            }
        }
        dim
    };
    Ok(match (op, parts) {
        (Op::Reshape(x), [Part::Product { a, b }]) => {
            let (xd, (n, k)) = (x.dims(), (b.dims()[0], b.dims()[1]));
            if xd.last() != Some(&k) {
                return Ok(None);
            }
            let rows: Vec<usize> = xd[..xd.len() - 1].iter().copied().chain([n]).collect();
            let a = a.reshape(rows)?;
            Some((x.clone(), vec![Part::Product { a, b: b.clone() }]))
        }
        (Op::Narrow(x, nd, ns), _) if slices() == Some(*nd) => {
            let mut shifted = vec![];
            for p in parts {
                if let Part::Slice {
                    dim,
                    start,
                    len,
                    grad,
                } = p
                {
                    shifted.push(Part::Slice {
                        dim: *dim,
                        start: start + ns,
                        len: *len,
                        grad: grad.clone(),
                    });
                }
            }
            Some((x.clone(), shifted))
        }
        (Op::Reshape(x), _) => {
            let Some(d) = slices() else { return Ok(None) };
            let xd = x.dims();
            // x is t with dims d..=e merged into dim d.
            let Some(e) = (d + td.len()).checked_sub(xd.len()) else {
                return Ok(None);
            };
            let merged = e >= d
                && e < td.len()
                && xd.len() > d
                && xd[..d] == td[..d]
                && xd[d] == td[d..=e].iter().product::<usize>()
                && xd[d + 1..] == td[e + 1..];
            if !merged {
                return Ok(None);
            }
            let inner: usize = td[d + 1..=e].iter().product();
            let mut moved = vec![];
            for p in parts {
                let Part::Slice {
                    start, len, grad, ..
                } = p
                else {
                    return Ok(None);
                };
                // A slice of this tensor's shape (not one split further already).
                let mut own = td.to_vec();
                own[d] = *len;
                if grad.dims() != own.as_slice() {
                    return Ok(None);
                }
                let mut gd = xd.to_vec();
                gd[d] = len * inner;
                // Viewed merged where it can be; a slice that would have to be copied to
                // change shape (the permuted gradient of a head split) passes on as it is,
                // its dim split, and is laid into the sum from that shape: one strided copy
                // into the fused projection's gradient rather than one into this tensor's
                // and a second into the projection's (Flux's and FLUX.2's single blocks:
                // q, k, v, then the MLP's part beside them).
                let grad = match grad.layout().reshape(&gd.clone().into()) {
                    Some(_) => grad.reshape(gd)?,
                    None => grad.clone(),
                };
                moved.push(Part::Slice {
                    dim: d,
                    start: start * inner,
                    len: len * inner,
                    grad,
                });
            }
            Some((x.clone(), moved))
        }
        _ => None,
    })
}

/// The contributions of `out = c + a b + bias` (Matmul: a b alone) to its inputs: dc = g;
/// da = g b^T, kept unformed when its inner dim is small (`deferred_product`: a rank-r
/// adapter's x A, added into the input's other contribution by one GEMM with beta = 1 when
/// the sums come); db = a^T g (`weight_grad`); dbias = g summed over the rows.
fn product_vjp(op: &Op, g: &Tensor) -> Result<Vec<(Tensor, Part)>> {
    let (c, a, b, bias) = match op {
        Op::Matmul(a, b) => (None, a, b, None),
        Op::Addmm { c, a, b, bias } => (c.as_ref(), a, b, bias.as_ref()),
        _ => {
            return Err(Error::Autograd(format!(
                "internal: {} is no product",
                op.kind()
            )))
        }
    };
    let mut v = vec![];
    if let Some(c) = c.filter(|c| c.requires_grad()) {
        v.push((c.clone(), Part::Full(g.clone())));
    }
    if a.requires_grad() {
        let part = match deferred_product(g, b)? {
            Some(part) => part,
            None => Part::Full(g.matmul3(&b.t()?)?),
        };
        v.push((a.clone(), part));
    }
    if b.requires_grad() {
        v.push((b.clone(), Part::Full(weight_grad(a, g, b)?)));
    }
    if let Some(bias) = bias.filter(|b| b.requires_grad()) {
        let db = g.sum(&[0usize, 1])?.to_dtype(bias.dtype())?;
        v.push((bias.clone(), Part::Full(db)));
    }
    Ok(v)
}

/// The gradient `a^T g` of a product's right operand b (rank-3 operands). When b is the
/// transpose of a dense tensor (a linear layer's `w.t()`, an adapter's `A.t()`), it is formed
/// as `(g^T a)^T`: the same GEMM, its output laid out as that tensor, so the transposes back
/// (and a cast to an f32 master weight) read it densely. Not for a leaf, whose gradient is
/// kept as it comes.
fn weight_grad(a: &Tensor, g: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !b.is_var() && !b.is_contiguous() && b.t()?.is_contiguous() {
        g.t()?.matmul3(a)?.t()
    } else {
        a.t()?.matmul3(g)
    }
}

/// The input gradient `g b^T` of a product `a b` (g: (B, M, N), b: (B, K, N)... as the
/// product's rank-3 operands) as a `Part::Product` when its inner dim N is at most a quarter
/// of its output's K and b is one matrix for every batch entry: a rank-r adapter's x A, whose
/// [M, K] gradient would otherwise be written, then read again by the add into the base
/// layer's input gradient. Held unformed it costs g and b (small) until the sums, where it
/// is added into another contribution's buffer by one GEMM with beta = 1 (`add_matmul`).
fn deferred_product(g: &Tensor, b: &Tensor) -> Result<Option<Part>> {
    let (bd, n) = (b.dims(), g.dims()[g.rank() - 1]);
    if n == 0 || b.rank() != 3 || 4 * n > bd[1] || !(bd[0] == 1 || b.layout().strides()[0] == 0) {
        return Ok(None);
    }
    let b2 = b.narrow(0, 0, 1)?.reshape((bd[1], bd[2]))?.t()?;
    Ok(Some(Part::Product {
        a: g.clone(),
        b: b2,
    }))
}

/// The sum of a tensor's gradient contributions (`dims` its shape), folded from the last
/// to arrive: g1 + (g2 + (... + gn)). Contributions arrive in reverse execution order of
/// the ops that used the tensor, so the ones a checkpointed block makes (which its node
/// returns already summed, in the same fold) are grouped the same way with and without the
/// checkpoint, and the sums agree bit for bit.
///
/// When every contribution is a slice of one dim (the tensor was only narrowed: a fused
/// projection split into q, k, v, a modulation into its chunks) and no two overlap, they
/// are laid side by side in one new tensor instead (`Tensor::lay_along`: each slice copied
/// into place once, from its own shape): each element then holds exactly the one slice's
/// value (or 0) that the fold would have added to zeros.
fn sum_contributions(parts: Vec<Part>, dims: &[usize]) -> Result<Tensor> {
    if parts.len() > 1 || matches!(parts.first(), Some(Part::Slice { .. })) {
        let mut slices = vec![];
        let mut dim0 = None;
        for p in &parts {
            match p {
                Part::Slice {
                    dim,
                    start,
                    len,
                    grad,
                } if dim0.is_none_or(|d| d == *dim) => {
                    dim0 = Some(*dim);
                    slices.push((*start, *len, grad));
                }
                _ => {
                    slices.clear();
                    break;
                }
            }
        }
        if let (Some(dim), false) = (dim0, slices.is_empty()) {
            slices.sort_by_key(|(s, _, _)| *s);
            let disjoint = slices.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
            if disjoint {
                return Tensor::lay_along(dims, dim, &slices);
            }
        }
    }
    // The fold keeps its grouping with products among the parts: a product meets the sum
    // it is added to (either side) inside one GEMM with beta = 1, into the other operand's
    // buffer where nothing else holds it.
    let mut parts = parts;
    let mut acc = parts
        .pop()
        .ok_or_else(|| Error::Autograd("internal: no gradient contribution".into()))?;
    while let Some(g) = parts.pop() {
        acc = Part::Full(match (g, acc) {
            (Part::Product { a, b }, acc) | (acc, Part::Product { a, b }) => {
                add_product(acc.full(dims)?, &a, &b, dims)?
            }
            (g, acc) => g.full(dims)?.add(&acc.full(dims)?)?,
        });
    }
    acc.full(dims)
}

/// `acc + a @ b` at `dims` (a: (..., M, N), b: (N, K)), by one GEMM with beta = 1 into
/// acc's buffer when nothing else holds it (`add_matmul`).
fn add_product(acc: Tensor, a: &Tensor, b: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let rows: Vec<usize> = a.dims()[..a.rank() - 1]
        .iter()
        .copied()
        .chain([b.dims()[1]])
        .collect();
    // The view alone holds acc's buffer once acc is gone.
    let shaped = acc.reshape(rows)?;
    drop(acc);
    shaped.add_matmul(a, b)?.reshape(dims)
}

/// d(loss)/d(input) for each differentiable input of `op`, given `g` = d(loss)/d(out).
fn vjp(op: &Op, out: &Tensor, g: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
    Ok(match op {
        // Handled by the backward loop, which gathers a custom node's output gradients and
        // keeps a product's input gradient as a part (`product_vjp`).
        Op::Custom { .. } | Op::Output { .. } | Op::Matmul(..) | Op::Addmm { .. } => {
            return Err(Error::Autograd(format!(
                "internal: {} reached the per-op VJP",
                op.kind()
            )))
        }
        Op::Unary(x, u) => {
            let gx = match *u {
                UnaryOp::Neg => g.neg()?,
                // d/dx 1/x = -1/x^2 = -y^2
                UnaryOp::Recip => g.mul(&out.mul(out)?)?.neg()?,
                // d/dx e^x = e^x
                UnaryOp::Exp => g.mul(out)?,
                // d/dx ln x = 1/x
                UnaryOp::Log => g.div(x)?,
                // d/dx sqrt x = 1 / (2 sqrt x)
                UnaryOp::Sqrt => g.div(&out.affine(2.0, 0.0)?)?,
                UnaryOp::Sin => g.mul(&x.cos()?)?,
                UnaryOp::Cos => g.mul(&x.sin()?)?.neg()?,
                // d/dx tanh x = 1 - tanh^2 x
                UnaryOp::Tanh => g.mul(&out.mul(out)?.affine(-1.0, 1.0)?)?,
                // d/dx erf x = 2/sqrt(pi) e^{-x^2}
                UnaryOp::Erf => g.mul(
                    &x.mul(x)?
                        .neg()?
                        .exp()?
                        .affine(std::f64::consts::FRAC_2_SQRT_PI, 0.0)?,
                )?,
                // d/dx |x| = sign(x) (0 at 0, as in PyTorch)
                UnaryOp::Abs => g.mul(&x.sign()?)?,
                // Piecewise constant: never recorded, no gradient.
                UnaryOp::Sign => return Ok(vec![]),
                UnaryOp::Affine { mul, .. } => g.affine(mul, 0.0)?,
                // The fused activations: one kernel computes dy * f'(x).
                UnaryOp::Gelu => x.binary(g, BinaryOp::GeluBackward)?,
                UnaryOp::GeluTanh => x.binary(g, BinaryOp::GeluTanhBackward)?,
                UnaryOp::Silu => x.binary(g, BinaryOp::SiluBackward)?,
                // d/dx x^e = e x^{e-1}
                UnaryOp::Powf(e) => g.mul(&x.powf(e - 1.0)?.affine(e, 0.0)?)?,
            };
            vec![(x.clone(), gx)]
        }
        Op::Binary(a, b, op) => match op {
            BinaryOp::Add => vec![(a.clone(), g.clone()), (b.clone(), g.clone())],
            BinaryOp::Sub => vec![(a.clone(), g.clone()), (b.clone(), g.neg()?)],
            BinaryOp::Mul => {
                let mut v = vec![];
                if a.requires_grad() {
                    v.push((a.clone(), g.mul(b)?));
                }
                if b.requires_grad() {
                    v.push((b.clone(), g.mul(a)?));
                }
                v
            }
            // d/da a/b = 1/b; d/db a/b = -a/b^2 = -out/b
            BinaryOp::Div => {
                let ga = g.div(b)?;
                let mut v = vec![];
                if b.requires_grad() {
                    v.push((b.clone(), ga.mul(out)?.neg()?));
                }
                if a.requires_grad() {
                    v.push((a.clone(), ga));
                }
                v
            }
            // The gradient goes to the selected operand; ties go to the left one.
            BinaryOp::GeluBackward | BinaryOp::GeluTanhBackward | BinaryOp::SiluBackward => {
                return Err(Error::Autograd(format!(
                    "{} is never recorded: second-order gradients of activations are not supported",
                    op.name()
                )))
            }
            BinaryOp::Maximum | BinaryOp::Minimum => {
                let c = if *op == BinaryOp::Maximum {
                    CmpOp::Ge
                } else {
                    CmpOp::Le
                };
                let left = a.cmp(b, c)?;
                let zero = g.zeros_like()?;
                vec![
                    (a.clone(), left.where_cond(g, &zero)?),
                    (b.clone(), left.where_cond(&zero, g)?),
                ]
            }
        },
        Op::Where(m, t, f) => {
            let zero = g.zeros_like()?;
            vec![
                (t.clone(), m.where_cond(g, &zero)?),
                (f.clone(), m.where_cond(&zero, g)?),
            ]
        }
        Op::Reduce(x, r, dims) => {
            let gx = match r {
                ReduceOp::Sum => g.broadcast_as(x.shape().clone())?,
                // Ties share the gradient equally (as torch.amax does).
                ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin => {
                    let hit = x.eq(&out.broadcast_as(x.shape().clone())?)?;
                    let count = hit.sum_keepdim(dims)?;
                    hit.mul(&g.div(&count)?)?
                }
            };
            vec![(x.clone(), gx)]
        }
        Op::Cast(x) => vec![(x.clone(), g.to_dtype(x.dtype())?)],
        Op::Copy(x) => vec![(x.clone(), g.clone())],
        Op::Reshape(x) => vec![(x.clone(), g.reshape(x.shape().clone())?)],
        Op::Permute(x, perm) => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![(x.clone(), g.permute(&inv)?)]
        }
        // Zeros around the gradient of the kept range.
        // Handled by the backward loop (a slice contribution, see `Part`).
        Op::Narrow(..) => {
            return Err(Error::Autograd(
                "internal: narrow reached the per-op VJP".into(),
            ))
        }
        // Sum over the dims that were stretched or prepended.
        Op::Broadcast(x) => {
            let lead = g.rank() - x.rank();
            let dims: Vec<usize> = (0..g.rank())
                .filter(|&d| d < lead || (x.dims()[d - lead] == 1 && g.dims()[d] != 1))
                .collect();
            let s = if dims.is_empty() {
                g.clone()
            } else {
                g.sum_keepdim(&dims)?
            };
            vec![(x.clone(), s.reshape(x.shape().clone())?)]
        }
        Op::Cat(xs, dim) => {
            let mut start = 0;
            let mut v = vec![];
            for x in xs {
                let n = x.dims()[*dim];
                v.push((x.clone(), g.narrow(*dim, start, n)?));
                start += n;
            }
            v
        }
        // Each selected row's gradient is added back where it came from.
        Op::IndexSelect(x, ids, dim) => {
            let mut shape = vec![1; g.rank()];
            shape[*dim] = ids.elem_count();
            let ids = ids.reshape(shape)?.broadcast_as(g.shape().clone())?;
            vec![(x.clone(), x.zeros_like()?.scatter_add(&ids, g, *dim)?)]
        }
        Op::Gather(x, ids, dim) => vec![(x.clone(), x.zeros_like()?.scatter_add(ids, g, *dim)?)],
        Op::ScatterAdd(dst, ids, src, dim) => vec![
            (dst.clone(), g.clone()),
            (src.clone(), g.gather(ids, *dim)?),
        ],
        // C = A B: dA = dC B^T, dB = A^T dC
        // Only the operands that need it: a frozen weight costs no GEMM.
        Op::ToDevice(x) => vec![(x.clone(), g.to_device(x.device())?)],
        // fold2d is the adjoint of unfold2d, and the other way round.
        Op::Unfold2d(x, w) => {
            let d = x.dims();
            vec![(x.clone(), g.fold2d(*w, (d[2], d[3]))?)]
        }
        Op::Fold2d(x, w) => vec![(x.clone(), g.unfold2d(*w)?)],
        Op::Norm {
            x,
            weight,
            bias,
            mean,
            rstd,
            kind,
        } => {
            let mut v = vec![];
            // dw = sum over rows of dy * xhat, db = sum over rows of dy.
            fn want(p: &Option<Tensor>) -> Option<&Tensor> {
                p.as_ref().filter(|p| p.requires_grad())
            }
            let params = want(weight).is_some() || want(bias).is_some();
            let (dx, sums) = if x.requires_grad() && params {
                // All three in one pass over x and dy.
                let (dx, dw, db) = x.norm_backward_params(g, mean, rstd, *kind, weight.as_ref())?;
                (Some(dx), Some((dw, db)))
            } else if x.requires_grad() {
                let dx = x.norm_backward(g, mean, rstd, *kind, weight.as_ref())?;
                (Some(dx), None)
            } else if params {
                // A frozen input with trainable parameters: a column sweep.
                (None, Some(x.norm_param_grads(g, mean, rstd, *kind)?))
            } else {
                (None, None)
            };
            if let Some(dx) = dx {
                v.push((x.clone(), dx));
            }
            if let Some((dw, db)) = sums {
                if let Some(w) = want(weight) {
                    v.push((w.clone(), dw.to_dtype(w.dtype())?));
                }
                if let Some(b) = want(bias) {
                    v.push((b.clone(), db.to_dtype(b.dtype())?));
                }
            }
            v
        }
        // y = softmax(x): dx = y * (g - sum(g * y)) along the last dim, in one kernel.
        Op::Softmax(x) => vec![(x.clone(), out.softmax_backward(g)?)],
        Op::Fused {
            kernel,
            inputs,
            kept,
        } => {
            let gs = kernel.vjp(inputs, kept, out, g)?;
            if gs.len() != inputs.len() {
                return Err(Error::Autograd(format!(
                    "internal: {}'s backward gave {} gradients for {} inputs",
                    kernel.name(),
                    gs.len(),
                    inputs.len()
                )));
            }
            inputs
                .iter()
                .zip(gs)
                .filter_map(|(x, g)| g.map(|g| (x.clone(), g)))
                .collect()
        }
    })
}

#[cfg(all(test, feature = "cpu-ref"))]
mod tests {
    use super::*;
    use crate::{DType, Device};

    fn randn(dims: &[usize], seed: u64) -> Tensor {
        Tensor::randn(dims.to_vec(), DType::F64, &Device::Cpu, seed).unwrap()
    }

    #[test]
    fn only_products_of_a_small_inner_dim_and_one_matrix_are_deferred() -> Result<()> {
        let g = randn(&[1, 6, 4], 1);
        // a (1, 6, 16) @ b (1, 16, 4): the input gradient g b^T has inner dim 4 <= 16 / 4.
        assert!(deferred_product(&g, &randn(&[1, 16, 4], 2))?.is_some());
        // inner dim 4 > 12 / 4: formed at once.
        assert!(deferred_product(&g, &randn(&[1, 12, 4], 3))?.is_none());
        // a batch of different matrices: formed at once; one matrix broadcast: deferred.
        let g2 = randn(&[2, 6, 4], 4);
        assert!(deferred_product(&g2, &randn(&[2, 16, 4], 5))?.is_none());
        let shared = randn(&[16, 4], 6).broadcast_as((2, 16, 4))?;
        assert!(deferred_product(&g2, &shared)?.is_some());
        Ok(())
    }

    #[test]
    fn a_product_summed_into_a_contribution_equals_the_formed_sum() -> Result<()> {
        let (a, b) = (randn(&[2, 3, 2], 7), randn(&[2, 8], 8));
        let full = randn(&[2, 3, 8], 9);
        let want = full.add(&a.matmul(&b)?)?.to_vec::<f64>()?;
        let part = |t: &Tensor| -> Result<Part> { Ok(Part::Full(t.affine(1.0, 0.0)?)) };
        let product = || Part::Product {
            a: a.clone(),
            b: b.clone(),
        };
        for parts in [vec![product(), part(&full)?], vec![part(&full)?, product()]] {
            let got = sum_contributions(parts, &[2, 3, 8])?.to_vec::<f64>()?;
            for (x, y) in got.iter().zip(&want) {
                assert!((x - y).abs() < 1e-12, "{x} vs {y}");
            }
        }
        let alone = sum_contributions(vec![product()], &[6, 8])?;
        assert_eq!(alone.dims(), &[6, 8]);
        let formed = a.reshape((6, 2))?.matmul(&b)?;
        assert_eq!(alone.to_vec::<f64>()?, formed.to_vec::<f64>()?);
        Ok(())
    }
}
