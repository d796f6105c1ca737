//! The Tensor: shared storage, a strided layout, and (when it takes part in autograd) the op
//! that made it. Cloning is an Arc bump; views share storage and change only the layout.

mod composite;
pub(crate) mod kernels;
pub(crate) mod multi;
mod ops;
mod view;

pub use kernels::{
    fp8_product, product8, product8_bias, scaled_dot_product_attention, Rows8, CPU_COMPOSITE_SCORES,
};
pub use multi::sum_sq_multi;

use crate::autograd::{self, Op};
use crate::device::Storage;
use crate::{CpuStorage, DType, Device, Error, Layout, Result, Shape, WithDType};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

/// Identity of a tensor handle; gradients are keyed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// An n-dimensional array on a [`Device`]: a handle to shared storage with a strided view
/// of it, and the op that made it when autograd recorded one. Cloning is cheap.
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

pub(crate) struct Inner {
    id: TensorId,
    /// `None` in a graph edge: a handle an op keeps to route gradients through, whose values
    /// its VJP never reads (see `Tensor::edge`), so the activation can be freed.
    storage: Option<Arc<RwLock<Storage>>>,
    layout: Layout,
    dtype: DType,
    device: Device,
    /// The op that made this tensor, when it was recorded. `Some(None)`: recorded, then freed
    /// by a backward pass.
    grad_fn: Option<Arc<Mutex<Option<Op>>>>,
    /// A leaf that gradients are accumulated for.
    is_var: AtomicBool,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{:?}, {}, {}{}]",
            self.dims(),
            self.dtype(),
            self.device(),
            if self.requires_grad() { ", grad" } else { "" }
        )
    }
}

impl Tensor {
    // ----- construction -------------------------------------------------------------------

    pub(crate) fn from_storage(
        storage: Storage,
        shape: Shape,
        device: Device,
        op: Option<Op>,
    ) -> Tensor {
        Self::view_of_storage(
            Arc::new(RwLock::new(storage)),
            Layout::contiguous(shape),
            device,
            op,
        )
    }

    fn view_of_storage(
        storage: Arc<RwLock<Storage>>,
        layout: Layout,
        device: Device,
        op: Option<Op>,
    ) -> Tensor {
        let dtype = match storage.read() {
            Ok(s) => s.dtype(),
            Err(p) => p.into_inner().dtype(),
        };
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            storage: Some(storage),
            layout,
            dtype,
            device,
            grad_fn: op.map(|o| Arc::new(Mutex::new(Some(o)))),
            is_var: AtomicBool::new(false),
        }))
    }

    /// A view of this tensor's storage with another layout.
    pub(crate) fn view(&self, layout: Layout, op: Option<Op>) -> Tensor {
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            storage: self.0.storage.clone(),
            layout,
            dtype: self.0.dtype,
            device: self.0.device.clone(),
            grad_fn: op.map(|o| Arc::new(Mutex::new(Some(o)))),
            is_var: AtomicBool::new(false),
        }))
    }

    /// The handle a recorded op keeps for an input whose values its VJP never reads: the
    /// same id, layout, graph node and leaf flag, without the storage, so the activation is
    /// freed when nothing else needs it (PyTorch saves only what a backward formula reads,
    /// for the same reason). A tensor whose own op reads its output in the backward (exp,
    /// softmax, attention, ...) keeps its storage.
    pub(crate) fn edge(&self) -> Tensor {
        let needs_output = self
            .0
            .grad_fn
            .as_ref()
            .is_some_and(|node| match node.lock() {
                Ok(op) => op.as_ref().is_some_and(Op::reads_output),
                Err(_) => true,
            });
        if needs_output || self.0.storage.is_none() {
            return self.clone();
        }
        Tensor(Arc::new(Inner {
            id: self.0.id,
            storage: None,
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            device: self.0.device.clone(),
            grad_fn: self.0.grad_fn.clone(),
            is_var: AtomicBool::new(self.is_var()),
        }))
    }

    /// A storage-less tensor standing for a graph node (a custom op's node, whose outputs
    /// are separate tensors): shape (), f32, recording `op`.
    pub(crate) fn graph_node(op: Op, device: &Device) -> Tensor {
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            storage: None,
            layout: Layout::contiguous(Shape::default()),
            dtype: DType::F32,
            device: device.clone(),
            grad_fn: Some(Arc::new(Mutex::new(Some(op)))),
            is_var: AtomicBool::new(false),
        }))
    }

    /// A tensor of `shape` on `device` from row-major `data`; its dtype is `T`'s. An error
    /// when `data.len()` is not the shape's element count.
    pub fn from_vec<T: WithDType>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(Error::ElementCount {
                op: "from_vec",
                count: data.len(),
                shape,
            });
        }
        Self::from_host(T::to_storage(data), shape, device)
    }

    /// As [`Tensor::from_vec`], copying the slice.
    pub fn from_slice<T: WithDType>(
        data: &[T],
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        Self::from_vec(data.to_vec(), shape, device)
    }

    /// Builds a tensor from host data of any dtype.
    pub fn from_host(data: CpuStorage, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(Error::ElementCount {
                op: "from_host",
                count: data.len(),
                shape,
            });
        }
        Ok(Self::from_storage(
            device.storage_from_host(&data)?,
            shape,
            device.clone(),
            None,
        ))
    }

    /// A tensor of `shape` and `dtype` from its values' little-endian bytes (as safetensors
    /// files store them; any alignment) on `device`: a GPU copies the bytes across as they
    /// are, without a host copy of the values first.
    pub fn from_le_bytes(
        bytes: &[u8],
        dtype: DType,
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let size = dtype.size_in_bytes();
        if bytes.len() != shape.elem_count() * size {
            return Err(Error::ElementCount {
                op: "from_le_bytes",
                count: bytes.len() / size,
                shape,
            });
        }
        Ok(Self::from_storage(
            device.storage_from_bytes(dtype, bytes)?,
            shape,
            device.clone(),
            None,
        ))
    }

    /// Every element `value` (converted to `dtype`).
    pub fn full(
        value: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        Ok(Self::from_storage(
            device.full(&shape, dtype, value)?,
            shape,
            device.clone(),
            None,
        ))
    }

    /// Every element 0.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Self::full(0.0, shape, dtype, device)
    }

    /// Every element 1.
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Self::full(1.0, shape, dtype, device)
    }

    /// Zeros of this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    /// Ones of this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Self::ones(self.shape().clone(), self.dtype(), self.device())
    }

    /// `value` everywhere, in this tensor's shape, dtype and device.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Self::full(value, self.shape().clone(), self.dtype(), self.device())
    }

    /// `start, start + step, ...` while below `end` (above, for a negative step).
    pub fn arange_step(
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("bad range {start}..{end} step {step}"),
                &Shape::default(),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
        Self::from_vec(v, n, device)?.to_dtype(dtype)
    }

    /// `start, start + 1, ...` while below `end`: a rank-1 tensor.
    pub fn arange(start: f64, end: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        Self::arange_step(start, end, 1.0, dtype, device)
    }

    /// Uniform in [lo, hi), seeded: the same seed gives the same numbers on every backend.
    pub fn rand_uniform(
        lo: f64,
        hi: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Tensor> {
        let shape = shape.into();
        Ok(Self::from_storage(
            device.rand_uniform(&shape, dtype, lo, hi, seed)?,
            shape,
            device.clone(),
            None,
        ))
    }

    /// Uniform in [0, 1).
    pub fn rand(
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Tensor> {
        Self::rand_uniform(0.0, 1.0, shape, dtype, device, seed)
    }

    /// Normal(`mean`, `std`), seeded like [`Tensor::rand_uniform`].
    pub fn randn_normal(
        mean: f64,
        std: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Tensor> {
        let shape = shape.into();
        Ok(Self::from_storage(
            device.rand_normal(&shape, dtype, mean, std, seed)?,
            shape,
            device.clone(),
            None,
        ))
    }

    /// Standard normal.
    pub fn randn(
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
        seed: u64,
    ) -> Result<Tensor> {
        Self::randn_normal(0.0, 1.0, shape, dtype, device, seed)
    }

    // ----- accessors ----------------------------------------------------------------------

    /// This handle's identity (a new one for every op output and view).
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.0.layout.shape()
    }
    /// The dimension sizes, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.0.layout.dims()
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims().len()
    }
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.0.layout.elem_count()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device holding the storage.
    pub fn device(&self) -> &Device {
        &self.0.device
    }
    /// The strided view into the storage.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    /// Whether the view is row-major contiguous.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Whether two handles view the same storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        match (&self.0.storage, &other.0.storage) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn storage_arc(&self) -> Result<&Arc<RwLock<Storage>>> {
        self.0.storage.as_ref().ok_or_else(|| {
            Error::Autograd(format!(
                "internal: the values of a graph edge (shape {}) were read; the op that \
                 recorded it does not save them",
                self.shape()
            ))
        })
    }

    /// The buffer behind this tensor when this handle is the only one to it (no clone, no
    /// view, no value saved by the tape) and the tensor is a contiguous view from its start:
    /// a sum may then overwrite it in place. Otherwise the tensor comes back unchanged.
    pub(crate) fn into_exclusive_storage(
        self,
    ) -> std::result::Result<Arc<RwLock<Storage>>, Tensor> {
        if !self.0.layout.is_contiguous() || self.0.layout.offset() != 0 {
            return Err(self);
        }
        match Arc::try_unwrap(self.0) {
            Ok(mut inner) => match inner.storage.take() {
                Some(s) if Arc::strong_count(&s) == 1 && Arc::weak_count(&s) == 0 => Ok(s),
                s => {
                    inner.storage = s;
                    Err(Tensor(Arc::new(inner)))
                }
            },
            Err(arc) => Err(Tensor(arc)),
        }
    }

    pub(crate) fn storage(&self) -> Result<RwLockReadGuard<'_, Storage>> {
        let s = self
            .storage_arc()?
            .read()
            .map_err(|_| Error::Poisoned("tensor storage"))?;
        let need = self.0.layout.offset() + self.0.layout.storage_span();
        if need > s.len() {
            return Err(Error::Stream(format!(
                "a tensor of shape {} was read while its buffer holds {} elements: a streamed \
                 weight used outside its block's fetch (see stream::BlockStreamer)",
                self.shape(),
                s.len()
            )));
        }
        Ok(s)
    }

    /// Puts `new` behind this tensor and every view of its storage, returning the old
    /// buffer (block streaming swaps a weight's device buffer in and out this way).
    pub(crate) fn swap_storage(&self, new: Storage) -> Result<Storage> {
        let mut s = self
            .storage_arc()?
            .write()
            .map_err(|_| Error::Poisoned("tensor storage"))?;
        Ok(std::mem::replace(&mut *s, new))
    }

    /// A tensor of this one's shape, dtype and device over `storage` (which may be smaller
    /// than the shape while released: see `storage`).
    pub(crate) fn with_storage(&self, storage: Storage) -> Tensor {
        Self::view_of_storage(
            Arc::new(RwLock::new(storage)),
            Layout::contiguous(self.shape().clone()),
            self.device().clone(),
            None,
        )
    }

    pub(crate) fn grad_fn(&self) -> Option<&Mutex<Option<Op>>> {
        self.0.grad_fn.as_deref()
    }

    // ----- autograd -----------------------------------------------------------------------

    /// Whether gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.grad_fn.is_some() || self.is_var()
    }

    /// A leaf whose gradient `backward` accumulates.
    pub fn is_var(&self) -> bool {
        self.0.is_var.load(Ordering::Relaxed)
    }

    /// Marks a leaf as trainable (or frozen). Only leaves of a float dtype qualify.
    pub fn set_requires_grad(&self, on: bool) -> Result<()> {
        if self.0.grad_fn.is_some() {
            return Err(Error::Autograd(format!(
                "set_requires_grad on a tensor computed by an op (shape {}); detach() it first",
                self.shape()
            )));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "set_requires_grad",
                dtype: self.dtype(),
            });
        }
        self.0.is_var.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Builder form of `set_requires_grad(true)`.
    pub fn requires_grad_(self) -> Result<Tensor> {
        self.set_requires_grad(true)?;
        Ok(self)
    }

    /// The same data (shared storage) under a new handle cut from the graph: no grad flows
    /// through it, and marking it trainable does not touch `self`.
    pub fn detach(&self) -> Tensor {
        self.view(self.0.layout.clone(), None)
    }

    // ----- data out -----------------------------------------------------------------------

    /// A contiguous host copy of the data.
    pub fn to_host(&self) -> Result<CpuStorage> {
        self.storage()?.to_host(self.layout())
    }

    /// The elements in row-major order; `T` must be this tensor's dtype.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: "to_vec",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        let host = self.to_host()?;
        T::from_storage(&host)
            .map(|s| s.to_vec())
            .ok_or(Error::DTypeMismatch {
                op: "to_vec",
                lhs: host.dtype(),
                rhs: T::DTYPE,
            })
    }

    /// The elements as f64, whatever the dtype (exact).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        Ok(self.to_host()?.to_f64_vec())
    }

    /// The one element of a single-element tensor, as f64.
    pub fn to_scalar_f64(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::invalid(
                "to_scalar",
                "tensor has more than one element",
                self.shape(),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    // ----- in place -----------------------------------------------------------------------

    /// Overwrites this tensor's elements with `src`'s (same shape and dtype), in its storage,
    /// so every handle and view of it sees the new values. Not recorded by autograd: this is
    /// how optimizers update parameters.
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        if self.shape() != src.shape() {
            return Err(Error::ShapeMismatch {
                op: "assign",
                lhs: self.shape().clone(),
                rhs: src.shape().clone(),
            });
        }
        if self.dtype() != src.dtype() {
            return Err(Error::DTypeMismatch {
                op: "assign",
                lhs: self.dtype(),
                rhs: src.dtype(),
            });
        }
        if self.device() != src.device() {
            return Err(Error::DeviceMismatch {
                op: "assign",
                lhs: self.device().location(),
                rhs: src.device().location(),
            });
        }
        if self.0.grad_fn.is_some() && autograd::grad_enabled() {
            return Err(Error::Autograd(
                "assign into a tensor recorded on the tape would corrupt its gradients".into(),
            ));
        }
        let l = self.layout();
        if l.dims()
            .iter()
            .zip(l.strides())
            .any(|(&d, &s)| d > 1 && s == 0)
        {
            return Err(Error::invalid(
                "assign",
                "destination is a broadcast view",
                self.shape(),
            ));
        }
        // Reading and writing one storage would need both locks: copy the source out first.
        let src = if self.same_storage(src) {
            Tensor::from_host(src.to_host()?, src.shape().clone(), src.device())?
        } else {
            src.clone()
        };
        let s = src.storage()?;
        let mut d = self
            .storage_arc()?
            .write()
            .map_err(|_| Error::Poisoned("tensor storage"))?;
        s.copy_strided(src.layout(), &mut d, l)
    }
}

/// Dropping a long chain of recorded ops would recurse once per op (each op holds its inputs)
/// and overflow the stack. Instead, inputs this node owns alone are unlinked onto a work list.
impl Drop for Inner {
    fn drop(&mut self) {
        // A node shared with graph edges is dropped by the last handle to it.
        fn unlink(node: Option<Arc<Mutex<Option<Op>>>>) -> Option<Op> {
            Arc::try_unwrap(node?).ok()?.into_inner().ok().flatten()
        }
        let mut pending: Vec<Op> = unlink(self.grad_fn.take()).into_iter().collect();
        while let Some(op) = pending.pop() {
            for t in op.into_tensors() {
                if let Ok(mut inner) = Arc::try_unwrap(t.0) {
                    pending.extend(unlink(inner.grad_fn.take()));
                }
            }
        }
    }
}

/// Runs `f` on the storages of `a` and `b`, taking one read lock when they share storage.
pub(crate) fn with2<R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&Storage, &Storage) -> Result<R>,
) -> Result<R> {
    let ga = a.storage()?;
    if a.same_storage(b) {
        f(&ga, &ga)
    } else {
        let gb = b.storage()?;
        f(&ga, &gb)
    }
}

/// Like `with2` for three tensors.
pub(crate) fn with3<R>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    f: impl FnOnce(&Storage, &Storage, &Storage) -> Result<R>,
) -> Result<R> {
    with2(a, b, |sa, sb| {
        if c.same_storage(a) {
            f(sa, sb, sa)
        } else if c.same_storage(b) {
            f(sa, sb, sb)
        } else {
            let gc = c.storage()?;
            f(sa, sb, &gc)
        }
    })
}
