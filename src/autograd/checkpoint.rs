//! Gradient checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
//! Cost"), built on the custom node (`custom.rs`): the forward runs a function without
//! recording and keeps only its inputs; the backward runs it again, recording, and
//! backpropagates through that re-run. Random draws repeat: modules that draw (dropout) take
//! their draw numbers through `next_draw`, which the forward logs and the re-run replays, so
//! the re-run computes the same values and the gradients equal those without checkpointing.
//!
//! Selective recompute: a checkpoint may keep the outputs of expensive ops from its forward
//! instead of recomputing them (`Keep`): attention, whose output and log-sum-exp are ~1% of
//! a transformer block's activations and a fifth of its forward time at 4608 tokens; and
//! the base GEMMs of down-projections (Linears narrower out than in: the MLPs' second
//! layers), which give the most work saved per byte kept (a GEMM's FLOPs per output value
//! are twice its input width) and are about a third of a Flux block's forward. An op opts in through `kept_or`: in a checkpoint's forward it computes and logs
//! its outputs; in the re-run it takes them back from the log, in the same order, instead of
//! computing. The re-run sees the same inputs in the same order (that is what makes the draws
//! repeat), so the logged values are the ones it would compute, bit for bit.
//!
//! `CheckpointHooks` bracket each run of the function: the forward pass and the backward's
//! re-run plus backpropagation. Block streaming uses them to bring a block's weights to the
//! GPU before either and to release them after (`crate::memory`).
//!
//! `SavedHooks` decide where a checkpoint keeps its inputs: on the device (the default), or
//! packed elsewhere (`crate::memory::InputOffload` copies them to page-locked host memory and
//! brings them back, one block ahead, for the re-run). Packing changes where a value waits,
//! never the value: gradients are the same bit for bit.

use super::ahead::Pending;
use super::custom::{custom_op, CustomBackward};
use super::{backward::backward_from, enable_grad, no_grad, probe, Grads};
use crate::{Error, Result, Tensor};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Which pass a checkpointed run belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The forward: the function runs without recording.
    Forward,
    /// The backward: the function runs again, recording, and its graph is backpropagated.
    Backward,
}

/// Called around each run of a checkpointed function.
pub trait CheckpointHooks: Send + Sync {
    /// Before the function runs in `pass`; for the backward's re-run, `digest` is the digest
    /// of the forward it re-runs (`forward_digest`), `None` in the forward.
    fn enter(&self, pass: Pass, digest: Option<u64>) -> Result<()>;
    /// After the forward's run, or after the backward's re-run and its backpropagation.
    fn exit(&self, pass: Pass) -> Result<()>;
    /// After a forward that the backward will re-run: a digest of what its re-run will take
    /// from the log instead of computing (the kept outputs' kinds, shapes and dtypes) and of
    /// which inputs need gradients. Nothing by default.
    fn forward_digest(&self, digest: u64) -> Result<()> {
        let _ = digest;
        Ok(())
    }
    /// After the backward's re-run of a forward of digest `digest`: the weights (maybe none)
    /// that the re-run took the outputs of from its log and that nothing it recorded will
    /// read in the backpropagation (see `Keep::few_rows`). A later forward of the same digest
    /// runs the same ops on the same kinds of values, so its backward will not read them
    /// either: the hooks need not bring them back for it. Nothing by default.
    fn forward_only(&self, weights: &[Tensor], digest: u64) -> Result<()> {
        let _ = (weights, digest);
        Ok(())
    }
    /// Inside a run: `x @ weight^T` when the hooks compute that product elsewhere than on
    /// the device (a streamed weight held in host memory, `BlockStreamer::set_host_products`),
    /// else `None` (the default): the caller computes it.
    fn product(&self, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
        let _ = (weight, x);
        Ok(None)
    }
    /// Whether `product` computes the products of `weight` with inputs like `x` (false by
    /// default); the hooks may start computing them ahead.
    fn computes(&self, weight: &Tensor, x: &Tensor) -> Result<bool> {
        let _ = (weight, x);
        Ok(false)
    }
}

thread_local! {
    /// The hooks of the checkpointed runs under way on this thread, innermost last.
    static HOOKS: RefCell<Vec<Arc<dyn CheckpointHooks>>> = const { RefCell::new(Vec::new()) };
}

/// `x @ weight^T` from the hooks of a checkpointed run under way that compute it elsewhere
/// (`CheckpointHooks::product`, innermost first), or `None`: the caller computes it.
pub(crate) fn hooked_product(weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
    innermost_first(|h| h.product(weight, x))
}

/// Whether the hooks of a checkpointed run under way compute the products of `weight`
/// (`CheckpointHooks::computes`): its values are not on the device.
pub(crate) fn hooked_computes(weight: &Tensor, x: &Tensor) -> Result<bool> {
    Ok(innermost_first(|h| Ok(h.computes(weight, x)?.then_some(())))?.is_some())
}

/// The first answer of the hooks of the runs under way, innermost first. Each is taken out
/// of the stack alone (an `Arc` clone, no allocation: this runs for every Linear), and no
/// borrow of the stack is held while it answers.
fn innermost_first<R>(
    mut ask: impl FnMut(&dyn CheckpointHooks) -> Result<Option<R>>,
) -> Result<Option<R>> {
    let depth = HOOKS.with(|h| h.borrow().len());
    for i in (0..depth).rev() {
        let Some(h) = HOOKS.with(|s| s.borrow().get(i).cloned()) else {
            continue;
        };
        if let Some(r) = ask(&*h)? {
            return Ok(Some(r));
        }
    }
    Ok(None)
}

/// Pops the hooks `run_hooked` pushed, on every way out.
struct HooksGuard;

impl Drop for HooksGuard {
    fn drop(&mut self) {
        HOOKS.with(|h| h.borrow_mut().pop());
    }
}

/// Where a checkpoint keeps the inputs it saves for its re-run (PyTorch's
/// `saved_tensors_hooks` pack/unpack pair, for checkpoint inputs).
pub trait SavedHooks: Send + Sync {
    /// Called once per saved input in the forward: `Some` takes the value off the device
    /// (the checkpoint then holds only the handle), `None` leaves it as it is.
    fn pack(&self, x: &Tensor) -> Result<Option<Arc<dyn PackedTensor>>>;

    /// Called once per output a checkpoint keeps from its forward for its re-run (attention's
    /// and the down-projections' under `Keep`; not the few-row outputs, which are small), in
    /// the forward's order, before its inputs are packed: `Some` takes it off the device
    /// until the re-run unpacks it, `None` (the default) leaves it there. The re-run unpacks
    /// its inputs first and then these in reverse order, so an unpack that starts the next
    /// one's upload (the one packed before it) fetches them in the order they are read.
    fn pack_kept(&self, x: &Tensor) -> Result<Option<Arc<dyn PackedTensor>>> {
        let _ = x;
        Ok(None)
    }
}

/// A saved input held away from the device by `SavedHooks::pack`.
pub trait PackedTensor: Send + Sync {
    /// The value, on its device again, with the packed tensor's shape and dtype (not
    /// recorded; the checkpoint makes the leaf).
    fn unpack(&self) -> Result<Tensor>;
}

/// How a checkpoint runs: hooks around each run of its function, the op outputs it keeps,
/// and where its saved inputs wait (see the module docs).
#[derive(Clone, Default)]
pub struct CheckpointOptions {
    /// Called around each run (block streaming).
    pub hooks: Option<Arc<dyn CheckpointHooks>>,
    /// Op outputs kept from the forward for the re-run.
    pub keep: Keep,
    /// Where saved inputs wait (None: on the device).
    pub saved: Option<Arc<dyn SavedHooks>>,
    /// The re-run may be issued on the helper thread while the backward walk issues the
    /// backward before it (`super::ahead`): its activations then live beside that backward.
    pub ahead: bool,
}

/// The function a checkpoint re-runs: inputs -> outputs.
type BlockFn = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

enum DrawMode {
    /// Draws come from the counters and are logged.
    Record(Vec<u64>),
    /// Draws come from the log, in order.
    Replay(Arc<Vec<u64>>, usize),
}

thread_local! {
    static DRAWS: RefCell<Vec<DrawMode>> = const { RefCell::new(Vec::new()) };
}

/// The next draw number of a module whose random draws count up in `counter` (dropout's
/// call counter): `counter`'s next value, except inside a checkpoint's re-run, which gets
/// the numbers its forward drew, in the same order.
pub fn next_draw(counter: &AtomicU64) -> u64 {
    DRAWS.with(|d| {
        let mut d = d.borrow_mut();
        match d.last_mut() {
            Some(DrawMode::Replay(log, pos)) if *pos < log.len() => {
                let k = log[*pos];
                *pos += 1;
                k
            }
            Some(DrawMode::Record(log)) => {
                let k = counter.fetch_add(1, Ordering::Relaxed);
                log.push(k);
                k
            }
            _ => counter.fetch_add(1, Ordering::Relaxed),
        }
    })
}

/// Pushes a draw mode for the guard's life.
struct DrawGuard;

impl DrawGuard {
    fn push(mode: DrawMode) -> DrawGuard {
        DRAWS.with(|d| d.borrow_mut().push(mode));
        DrawGuard
    }

    /// The log of a `Record` mode, popping it.
    fn finish(self) -> Vec<u64> {
        let log = DRAWS.with(|d| match d.borrow_mut().pop() {
            Some(DrawMode::Record(log)) => log,
            _ => Vec::new(),
        });
        std::mem::forget(self);
        log
    }
}

impl Drop for DrawGuard {
    fn drop(&mut self) {
        DRAWS.with(|d| d.borrow_mut().pop());
    }
}

/// Which op outputs a checkpointed function keeps from its forward for the backward's
/// re-run, instead of recomputing them (selective recompute).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Keep {
    /// The fused attention's output and log-sum-exp (B, H, Lq, D) + (B, H, Lq) f32 per
    /// call: the re-run then skips the attention forward kernel.
    pub attention: bool,
    /// The base GEMM's output (rows, out), before any adapter's term, of every Linear whose
    /// output is narrower than its input (a down-projection: Flux's `linear2` and the MLPs'
    /// `fc2`, 28 MiB a Flux block at 1024²): the re-run then skips that GEMM (and an FP8
    /// weight's decode for it). The adapter's term is recomputed from the layer's input.
    pub down_projections: bool,
    /// The base GEMM's output of every Linear that sees few rows (at most `1 / FEW_ROWS` of
    /// its input width: the modulations over the conditioning vector, cross-attention's keys
    /// and values over a short text), at most that fraction of the weight's values: the re-run
    /// skips the GEMM. Where nothing of the GEMM needs a gradient (its input, weight and
    /// bias) and the adapter does not read the frozen weight (LoRA, LoHa, LoKr; not DoRA),
    /// neither the re-run nor the backward reads that weight: the re-run tells the
    /// checkpoint's hooks (`CheckpointHooks::forward_only`, with the digest of its forward),
    /// and a streamed block's backward uploads after forwards of the same digest leave the
    /// weight out (Flux-dev's modulations are 27% of its weight bytes).
    pub few_rows: bool,
}

/// A Linear sees few rows when `FEW_ROWS` times its rows are at most its input width
/// (`Keep::few_rows`): its output is then at most `1 / FEW_ROWS` of its weight's values.
pub const FEW_ROWS: usize = 16;

impl Keep {
    /// Nothing kept: the whole function is recomputed.
    pub const NONE: Keep = Keep {
        attention: false,
        down_projections: false,
        few_rows: false,
    };

    /// Whether outputs of `kind` are kept.
    fn keeps(self, kind: KeptKind) -> bool {
        match kind {
            KeptKind::Attention => self.attention,
            KeptKind::DownProjection => self.down_projections,
            KeptKind::FewRows => self.few_rows,
        }
    }

    /// Whether anything is kept.
    pub fn any(self) -> bool {
        self.attention || self.down_projections || self.few_rows
    }
}

/// The kinds of op that can keep their outputs through a checkpoint (see `Keep`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeptKind {
    /// The fused attention: [o, lse].
    Attention,
    /// A down-projection's base GEMM: [y].
    DownProjection,
    /// The base GEMM of a Linear that sees few rows: [y].
    FewRows,
}

enum KeepMode {
    /// A checkpoint's forward: outputs of the kinds in `Keep` are logged.
    Record(Keep, Vec<(KeptKind, Vec<Tensor>)>),
    /// A checkpoint's re-run: logged outputs are handed back in order; the weights of ops
    /// whose outputs came from the log and that recorded nothing are noted
    /// (`note_forward_only`).
    Replay(Arc<Vec<(KeptKind, Vec<Tensor>)>>, usize, Vec<Tensor>),
}

thread_local! {
    static KEPT: RefCell<Vec<KeepMode>> = const { RefCell::new(Vec::new()) };
    static REUSED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static UNREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static UNREAD_PRODUCT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Depth of `uncheckpointed` runs on this thread: inside one, a tail is computed even in
    /// an enclosing checkpoint's re-run (its output feeds what follows in that checkpoint).
    static UNCHECKPOINTED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f`, a unit that runs without a checkpoint of its own (`memory::BlockExec`'s
/// resident blocks), so that its tails (`unread_product`) are computed
/// even inside an enclosing checkpoint's re-run: their outputs feed the rest of that
/// checkpoint.
pub fn uncheckpointed<R>(f: impl FnOnce() -> R) -> R {
    UNCHECKPOINTED.with(|d| d.set(d.get() + 1));
    let out = f();
    UNCHECKPOINTED.with(|d| d.set(d.get().saturating_sub(1)));
    out
}

/// Whether this thread runs a checkpoint's re-run whose own function is at hand (not a unit
/// run without a checkpoint inside it): where tails take placeholders.
fn tails_skip() -> bool {
    UNCHECKPOINTED.with(|d| d.get() == 0)
        && KEPT.with(|k| matches!(k.borrow().last(), Some(KeepMode::Replay(..))))
}

/// The outputs of an op that may keep them as any of `kinds`: `compute()`, except inside a
/// checkpoint's re-run whose forward kept them, which gets the kept tensors (no storage-less
/// handles: each is a value computed on the forward, detached). Inside a checkpoint's
/// forward that keeps one of `kinds`, the computed outputs are logged (as the first kept
/// kind).
pub(crate) fn kept_or(
    kinds: &[KeptKind],
    compute: impl FnOnce() -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    Ok(kept_or_replayed(kinds, compute)?.0)
}

/// `kept_or`, and whether the outputs came from a checkpoint's log (the op computed
/// nothing).
pub(crate) fn kept_or_replayed(
    kinds: &[KeptKind],
    compute: impl FnOnce() -> Result<Vec<Tensor>>,
) -> Result<(Vec<Tensor>, bool)> {
    let replayed = KEPT.with(|k| {
        let mut k = k.borrow_mut();
        match k.last_mut() {
            Some(KeepMode::Replay(log, pos, _))
                if *pos < log.len() && kinds.contains(&log[*pos].0) =>
            {
                let out = log[*pos].1.clone();
                *pos += 1;
                Some(out)
            }
            _ => None,
        }
    });
    if let Some(out) = replayed {
        REUSED.with(|r| r.set(r.get() + 1));
        return Ok((out, true));
    }
    let out = compute()?;
    KEPT.with(|k| {
        if let Some(KeepMode::Record(keep, log)) = k.borrow_mut().last_mut() {
            if let Some(&kind) = kinds.iter().find(|&&kind| keep.keeps(kind)) {
                log.push((kind, out.iter().map(Tensor::detach).collect()));
            }
        }
    });
    Ok((out, false))
}

/// Notes, inside a checkpoint's re-run, weights that only its forward read: an op whose
/// output came from the log, that recorded nothing for the backward (nothing of it needs a
/// gradient) and that read them for nothing else (a Linear whose adapter does not read the
/// frozen weight). The checkpoint hands them to its hooks (`CheckpointHooks::forward_only`).
/// Elsewhere, nothing.
pub(crate) fn note_forward_only<'a>(weights: impl IntoIterator<Item = &'a Tensor>) {
    KEPT.with(|k| {
        if let Some(KeepMode::Replay(_, _, unread)) = k.borrow_mut().last_mut() {
            unread.extend(weights.into_iter().cloned());
        }
    });
}

/// How many op outputs this thread has taken from a checkpoint's kept log instead of
/// computing them (a counter for tests and reports).
pub fn kept_reused() -> u64 {
    REUSED.with(|r| r.get())
}

/// Runs `f` with, where `unread`, its first product marked as one whose output no gradient
/// of a checkpoint's re-run reads (a layer ending its block: `nn::Linear::forward_tail`,
/// `nn::Conv2d::forward_tail`): inside a re-run that product (a Linear's base product, or
/// `Tensor::matmul`'s primitive, which a convolution's is) takes zeros of its shape and
/// records its backward as usual (`take_unread_product`); elsewhere `f` runs as it is.
pub(crate) fn unread_product<R>(unread: bool, f: impl FnOnce() -> R) -> R {
    let before = UNREAD_PRODUCT.with(|u| u.replace(unread));
    let out = f();
    UNREAD_PRODUCT.with(|u| u.set(before));
    out
}

/// Whether the product primitive about to run is `unread_product`'s inside a checkpoint's
/// re-run: then it takes zeros instead of computing (counted in `unread_skipped`), and the
/// mark is spent.
pub(crate) fn take_unread_product() -> bool {
    if !UNREAD_PRODUCT.with(|u| u.get()) {
        return false;
    }
    let rerun = tails_skip();
    if rerun {
        UNREAD_PRODUCT.with(|u| u.set(false));
        UNREAD.with(|r| r.set(r.get() + 1));
    }
    rerun
}

/// How many op outputs this thread's checkpoint re-runs replaced by a placeholder because no
/// gradient reads them (`unread_product`: their products not run; a counter for tests and
/// reports).
pub fn unread_skipped() -> u64 {
    UNREAD.with(|r| r.get())
}

/// Pushes a keep mode for the guard's life.
struct KeepGuard;

impl KeepGuard {
    fn push(mode: KeepMode) -> KeepGuard {
        KEPT.with(|k| k.borrow_mut().push(mode));
        KeepGuard
    }

    /// The log of a `Record` mode, popping it.
    fn finish(self) -> Vec<(KeptKind, Vec<Tensor>)> {
        let log = KEPT.with(|k| match k.borrow_mut().pop() {
            Some(KeepMode::Record(_, log)) => log,
            _ => Vec::new(),
        });
        std::mem::forget(self);
        log
    }

    /// The weights a `Replay` mode noted (`note_forward_only`), popping it.
    fn finish_unread(self) -> Vec<Tensor> {
        let unread = KEPT.with(|k| match k.borrow_mut().pop() {
            Some(KeepMode::Replay(_, _, unread)) => unread,
            _ => Vec::new(),
        });
        std::mem::forget(self);
        unread
    }
}

impl Drop for KeepGuard {
    fn drop(&mut self) {
        KEPT.with(|k| k.borrow_mut().pop());
    }
}

/// `f(inputs)`, checkpointed: nothing inside `f` is kept for the backward except `inputs`
/// (and what `f` captured, such as parameters); the backward re-runs `f`. Parameters that
/// `f` captures get their gradients as without checkpointing. Outside recording (inference,
/// `no_grad`) this is `f(inputs)`.
pub fn checkpoint<F>(inputs: &[Tensor], f: F) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    checkpoint_with(inputs, Arc::new(f), None)
}

/// `checkpoint` with hooks around each run of `f` (see `CheckpointHooks`).
pub fn checkpoint_with(
    inputs: &[Tensor],
    f: Arc<BlockFn>,
    hooks: Option<Arc<dyn CheckpointHooks>>,
) -> Result<Vec<Tensor>> {
    checkpoint_keeping(inputs, f, hooks, Keep::NONE)
}

/// `checkpoint_with` that keeps the outputs of the ops in `keep` from the forward for the
/// re-run (selective recompute: more memory, less recompute). Gradients are the same as
/// with `Keep::NONE`, bit for bit.
pub fn checkpoint_keeping(
    inputs: &[Tensor],
    f: Arc<BlockFn>,
    hooks: Option<Arc<dyn CheckpointHooks>>,
    keep: Keep,
) -> Result<Vec<Tensor>> {
    checkpoint_opts(
        inputs,
        f,
        CheckpointOptions {
            hooks,
            keep,
            ..CheckpointOptions::default()
        },
    )
}

/// A checkpoint with every option (`CheckpointOptions`). Gradients are the same as a plain
/// `checkpoint`'s whatever the options, bit for bit.
pub fn checkpoint_opts(
    inputs: &[Tensor],
    f: Arc<BlockFn>,
    opts: CheckpointOptions,
) -> Result<Vec<Tensor>> {
    let CheckpointOptions {
        hooks,
        keep,
        saved: saved_hooks,
        ahead,
    } = opts;
    if !super::grad_enabled() {
        return run_hooked(&hooks, Pass::Forward, None, || f(inputs));
    }
    let draws = DrawGuard::push(DrawMode::Record(Vec::new()));
    let kept = KeepGuard::push(KeepMode::Record(keep, Vec::new()));
    let (outputs, needs_grad) = probe(|| run_hooked(&hooks, Pass::Forward, None, || f(inputs)));
    let kept = kept.finish();
    let draws = draws.finish();
    let outputs = outputs?;
    if !needs_grad {
        return Ok(outputs);
    }
    // The kept outputs the hooks take off the device, packed before the inputs (see
    // `SavedHooks::pack_kept`).
    let packed_kept = match &saved_hooks {
        Some(h) => pack_kept(h.as_ref(), &kept)?,
        None => vec![],
    };
    let saved = inputs
        .iter()
        .map(|x| {
            let packed = match &saved_hooks {
                Some(h) => h.pack(x)?,
                None => None,
            };
            let value = match packed {
                Some(p) => Saved::Packed(p),
                None => Saved::Value(x.detach()),
            };
            Ok((value, x.requires_grad()))
        })
        .collect::<Result<Vec<_>>>()?;
    let digest = digest(&kept, &saved);
    if let Some(h) = &hooks {
        h.forward_digest(digest)?;
    }
    let node = Arc::new(Checkpoint {
        parts: Arc::new(RerunParts {
            f,
            hooks,
            digest,
            saved,
            draws: Arc::new(draws),
            kept: if packed_kept.is_empty() {
                Kept::Here(Arc::new(kept))
            } else {
                Kept::Packed(packed_kept)
            },
        }),
        shapes: outputs.iter().map(|t| t.shape().clone()).collect(),
        issue_ahead: ahead,
        ahead: Mutex::new(None),
    });
    custom_op(inputs, outputs, node, true)
}

fn run_hooked<R>(
    hooks: &Option<Arc<dyn CheckpointHooks>>,
    pass: Pass,
    digest: Option<u64>,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    if let Some(h) = hooks {
        h.enter(pass, digest)?;
    }
    let r = {
        let _pushed = push_hooks(hooks);
        f()
    };
    exit_hooked(hooks, pass, r)
}

/// Pushes `hooks` on this thread's stack (`hooked_product`, `hooked_computes` ask them)
/// until the guard drops.
fn push_hooks(hooks: &Option<Arc<dyn CheckpointHooks>>) -> Option<HooksGuard> {
    hooks.as_ref().map(|h| {
        HOOKS.with(|s| s.borrow_mut().push(h.clone()));
        HooksGuard
    })
}

/// The hooks' `exit` after a run that entered them, with the run's result `r`: the run's
/// own error first, a hook's error only when the run succeeded.
fn exit_hooked<R>(hooks: &Option<Arc<dyn CheckpointHooks>>, pass: Pass, r: Result<R>) -> Result<R> {
    if let Some(h) = hooks {
        let exited = h.exit(pass);
        let r = r?;
        exited?;
        return Ok(r);
    }
    r
}

/// The digest `CheckpointHooks::forward_digest` reports: the kinds of the kept outputs in
/// order, the shapes and dtypes of the few-row ones, and which inputs need gradients. Which
/// weights a re-run leaves unread follows from these (a Linear's outputs are kept as few
/// rows or not by its rows; whether its GEMM records depends on what needs a gradient); the
/// other kept outputs' shapes (attention's, with the image size) do not enter, so steps of
/// several image sizes share a digest.
fn digest(kept: &[(KeptKind, Vec<Tensor>)], saved: &[(Saved, bool)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (kind, ts) in kept {
        (*kind as u8).hash(&mut h);
        ts.len().hash(&mut h);
        if *kind == KeptKind::FewRows {
            for t in ts {
                t.dims().hash(&mut h);
                t.dtype().hash(&mut h);
            }
        }
    }
    for (_, needs) in saved {
        needs.hash(&mut h);
    }
    h.finish()
}

/// A saved input: its value on the device, or a packed handle.
enum Saved {
    Value(Tensor),
    Packed(Arc<dyn PackedTensor>),
}

impl Saved {
    /// The value on the device (detached; a packed one unpacked).
    fn value(&self) -> Result<Tensor> {
        match self {
            Saved::Value(x) => Ok(x.detach()),
            Saved::Packed(p) => p.unpack(),
        }
    }
}

/// Op outputs kept from a checkpoint's forward, by kind, in the order the re-run reads them.
type KeptLog = Arc<Vec<(KeptKind, Vec<Tensor>)>>;

/// A checkpoint's kept outputs: on the device, or some of them packed by its hooks.
enum Kept {
    Here(KeptLog),
    Packed(Vec<(KeptKind, Vec<Saved>)>),
}

/// The kept outputs `hooks` take off the device (`SavedHooks::pack_kept`: attention's and the
/// down-projections'), in the forward's order; empty when it takes none.
fn pack_kept(
    hooks: &dyn SavedHooks,
    kept: &[(KeptKind, Vec<Tensor>)],
) -> Result<Vec<(KeptKind, Vec<Saved>)>> {
    let mut any = false;
    let out = kept
        .iter()
        .map(|(kind, ts)| {
            let v = ts
                .iter()
                .map(|t| {
                    let packed = match kind {
                        KeptKind::Attention | KeptKind::DownProjection => hooks.pack_kept(t)?,
                        KeptKind::FewRows => None,
                    };
                    Ok(match packed {
                        Some(p) => {
                            any = true;
                            Saved::Packed(p)
                        }
                        None => Saved::Value(t.clone()),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((*kind, v))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(if any { out } else { vec![] })
}

impl Kept {
    /// The kept outputs on the device: packed ones unpacked in reverse order (after the
    /// inputs; see `SavedHooks::pack_kept`).
    fn values(&self) -> Result<KeptLog> {
        let v = match self {
            Kept::Here(v) => return Ok(v.clone()),
            Kept::Packed(v) => v,
        };
        let mut out = Vec::with_capacity(v.len());
        for (kind, ts) in v.iter().rev() {
            let mut values = ts
                .iter()
                .rev()
                .map(Saved::value)
                .collect::<Result<Vec<_>>>()?;
            values.reverse();
            out.push((*kind, values));
        }
        out.reverse();
        Ok(Arc::new(out))
    }
}

struct Checkpoint {
    /// What its re-run reads (shared with the helper thread when issued ahead).
    parts: Arc<RerunParts>,
    shapes: Vec<crate::Shape>,
    /// Whether the re-run may be issued ahead (`CheckpointOptions::ahead`).
    issue_ahead: bool,
    /// The re-run issued ahead on the helper thread (`super::ahead`), until the backward
    /// takes it.
    ahead: Mutex<Option<Ahead>>,
}

/// A re-run issued ahead: still on the helper thread, or done and waiting for the backward.
/// An error: the hooks' `enter` failed (no `exit` follows).
enum Ahead {
    Issued(Pending<Result<Rerun>>),
    Done(Result<Rerun>),
}

/// A re-run, its hooks entered: the fresh leaves of the inputs and the outputs recorded from
/// them, or its error (the hooks' `exit` follows either way).
struct Rerun {
    /// The side stream's window the re-run ran in, if it ran there (issued ahead on a GPU
    /// with a cap's arena): dropped, the compute stream waits for it. First, so that it drops
    /// before the tensors the re-run made.
    side: Option<crate::device::SideWindow>,
    run: Result<(Vec<Tensor>, Vec<Tensor>)>,
    /// What the re-run counted on the thread that ran it: kept outputs reused, ops and views
    /// recorded (`kept_reused`, `super::recorded_ops`), for the walking thread to count
    /// where another thread ran it.
    counts: (u64, u64, u64),
}

/// What a checkpoint's re-run reads.
struct RerunParts {
    f: Arc<BlockFn>,
    hooks: Option<Arc<dyn CheckpointHooks>>,
    /// The forward's digest (`CheckpointHooks::forward_digest`).
    digest: u64,
    /// The inputs' values (detached) and whether each needs a gradient.
    saved: Vec<(Saved, bool)>,
    draws: Arc<Vec<u64>>,
    /// Op outputs kept from the forward, in the order the re-run asks for them.
    kept: Kept,
}

impl RerunParts {
    /// The hooks' `enter` (its error: the result's), then the re-run with them on this
    /// thread's stack: fresh leaves for the inputs that need gradients (the re-run's graph
    /// ends there, and their gradients are read back out of `grads` after the backward),
    /// and the outputs. With `side` (a re-run issued ahead), the block's work goes on the
    /// GPU's side stream where there is one (`Device::side_window`), beside the backward the
    /// walking thread issues.
    fn run(&self, side: bool) -> Result<Rerun> {
        if let Some(h) = &self.hooks {
            h.enter(Pass::Backward, Some(self.digest))?;
        }
        let _pushed = push_hooks(&self.hooks);
        let (reused, (ops, views)) = (kept_reused(), super::recorded_ops());
        let mut window = None;
        let run = self.rerun(side.then_some(&mut window));
        let (reused2, (ops2, views2)) = (kept_reused(), super::recorded_ops());
        Ok(Rerun {
            side: window,
            run,
            counts: (reused2 - reused, ops2 - ops, views2 - views),
        })
    }

    /// With `side`, the block's function runs in a side window, kept there for the caller.
    fn rerun(
        &self,
        side: Option<&mut Option<crate::device::SideWindow>>,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let leaves = self
            .saved
            .iter()
            .map(|(x, needs)| {
                let leaf = x.value()?;
                if *needs {
                    leaf.set_requires_grad(true)?;
                }
                Ok(leaf)
            })
            .collect::<Result<Vec<_>>>()?;
        let kept = self.kept.values()?;
        let window = match (side, leaves.first()) {
            (Some(slot), Some(x)) => {
                *slot = x.device().side_window()?;
                slot.as_mut()
            }
            _ => None,
        };
        let (outputs, unread) = {
            let _rec = enable_grad();
            let _draws = DrawGuard::push(DrawMode::Replay(self.draws.clone(), 0));
            let kept = KeepGuard::push(KeepMode::Replay(kept, 0, Vec::new()));
            // The buffers the block frees before it returns are the side stream's.
            let outputs = match window {
                Some(w) => w.run(|| (self.f)(&leaves))?,
                None => (self.f)(&leaves),
            };
            let unread = kept.finish_unread();
            (outputs?, unread)
        };
        if let Some(h) = &self.hooks {
            h.forward_only(&unread, self.digest)?;
        }
        Ok((leaves, outputs))
    }
}

impl CustomBackward for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn prepare(&self) {
        if !self.issue_ahead {
            return;
        }
        let Ok(mut slot) = self.ahead.lock() else {
            return;
        };
        if slot.is_some() {
            return;
        }
        let parts = self.parts.clone();
        *slot = super::ahead::offer(move || parts.run(true)).map(Ahead::Issued);
    }

    fn settle(&self) {
        if let Ok(mut slot) = self.ahead.lock() {
            if let Some(Ahead::Issued(p)) = slot.take() {
                *slot = Some(Ahead::Done(p.wait().and_then(|r| r)));
            }
        }
    }

    fn backward(
        &self,
        out_grads: &[Option<Tensor>],
        grads: &mut Grads,
    ) -> Result<Vec<Option<Tensor>>> {
        let ahead = self
            .ahead
            .lock()
            .map_err(|_| Error::Poisoned("a checkpoint's re-run"))?
            .take();
        let rerun = match ahead {
            Some(done) => {
                let r = match done {
                    Ahead::Issued(p) => p.wait()??,
                    Ahead::Done(r) => r?,
                };
                // Counted where it ran; counted here too, as the walk's own.
                let (reused, ops, views) = r.counts;
                REUSED.with(|c| c.set(c.get() + reused));
                super::count_recorded(ops, views);
                r
            }
            None => self.parts.run(false)?,
        };
        // The compute stream waits for a side stream's re-run before it reads what it made.
        if let Some(w) = rerun.side {
            w.join();
        }
        let hooks = &self.parts.hooks;
        let r = {
            let _pushed = push_hooks(hooks);
            rerun.run.and_then(|(leaves, outputs)| {
                self.backward_through(leaves, outputs, out_grads, grads)
            })
        };
        exit_hooked(hooks, Pass::Backward, r)
    }
}

impl Checkpoint {
    /// The backward through the re-run's graph from the outputs' gradients: the inputs'
    /// gradients, the captured leaves' added to `grads`.
    fn backward_through(
        &self,
        leaves: Vec<Tensor>,
        outputs: Vec<Tensor>,
        out_grads: &[Option<Tensor>],
        grads: &mut Grads,
    ) -> Result<Vec<Option<Tensor>>> {
        if outputs.len() != out_grads.len() {
            return Err(Error::Autograd(format!(
                "a checkpointed function gave {} outputs on its re-run and {} on its forward",
                outputs.len(),
                out_grads.len()
            )));
        }
        let mut seeds = Vec::new();
        for ((out, g), shape) in outputs.into_iter().zip(out_grads).zip(&self.shapes) {
            if out.shape() != shape {
                return Err(Error::ShapeMismatch {
                    op: "checkpoint re-run",
                    lhs: shape.clone(),
                    rhs: out.shape().clone(),
                });
            }
            if let (Some(g), true) = (g, out.requires_grad()) {
                let g = {
                    let _g = no_grad();
                    g.to_dtype(out.dtype())?
                };
                seeds.push((out, g));
            }
        }
        if !seeds.is_empty() {
            backward_from(seeds, grads, false)?;
        }
        Ok(leaves
            .iter()
            .zip(&self.parts.saved)
            .map(|(leaf, (_, needs))| if *needs { grads.remove(leaf) } else { None })
            .collect())
    }
}
