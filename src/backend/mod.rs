//! The Backend boundary. A backend receives storage and layouts, never a Tensor, and knows
//! nothing of autograd. Every backend implements the small primitive set below; composite ops
//! (softmax, norms, activations, losses) are written once above it, in `tensor::composite`.

pub mod adafactor;
#[cfg(feature = "cpu-ref")]
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fp8;
pub mod ggml;
pub mod int8;
pub mod lion;
pub mod multi;
pub mod multi_sf;
pub mod profile;
pub mod quant8;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod ring;
#[cfg_attr(not(any(feature = "cpu-ref", feature = "cuda")), allow(dead_code))]
pub(crate) mod validate;
pub mod wire;

use crate::{CpuStorage, DType, Layout, Result, Shape};

/// Elementwise functions of one input. Parameters ride along (`Affine`, `Powf`) so scalar
/// arithmetic needs no broadcast tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `1 / x`.
    Recip,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// Sine (radians).
    Sin,
    /// Cosine (radians).
    Cos,
    /// A libm primitive rather than a composite of exp: the exp form overflows for |x| > 44 in
    /// f32 (> 5.5 in f16) and its backward then multiplies 0 by inf, giving NaN gradients.
    Tanh,
    /// The error function.
    Erf,
    /// `|x|`.
    Abs,
    /// -1, 0 or 1. Not differentiable (its derivative is 0 almost everywhere).
    Sign,
    /// `x * mul + add`.
    Affine {
        /// The factor.
        mul: f64,
        /// The offset, added after the product.
        add: f64,
    },
    /// `x ^ e`.
    Powf(f64),
    /// x/2 (1 + erf(x / sqrt 2)), fused (`Tensor::gelu_composite` is the reference).
    Gelu,
    /// x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), fused.
    GeluTanh,
    /// x sigmoid(x), fused.
    Silu,
}

impl UnaryOp {
    /// The op's lowercase name, as errors and kernel names use it (e.g. `"gelu_tanh"`).
    pub fn name(&self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Recip => "recip",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Erf => "erf",
            UnaryOp::Abs => "abs",
            UnaryOp::Sign => "sign",
            UnaryOp::Affine { .. } => "affine",
            UnaryOp::Powf(_) => "powf",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
        }
    }
}

/// Elementwise functions of two inputs of the same shape and dtype: `(lhs, rhs) -> out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `lhs + rhs`.
    Add,
    /// `lhs - rhs`.
    Sub,
    /// `lhs * rhs`.
    Mul,
    /// `lhs / rhs`.
    Div,
    /// The larger of the two; NaN if either is NaN.
    Maximum,
    /// The smaller of the two; NaN if either is NaN.
    Minimum,
    /// (x, dy) -> dy * gelu'(x): the fused backward of `UnaryOp::Gelu`.
    GeluBackward,
    /// (x, dy) -> dy * gelu_tanh'(x).
    GeluTanhBackward,
    /// (x, dy) -> dy * silu'(x).
    SiluBackward,
}

impl BinaryOp {
    /// The op's lowercase name, as errors and kernel names use it (e.g. `"maximum"`).
    pub fn name(&self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::GeluBackward => "gelu_backward",
            BinaryOp::GeluTanhBackward => "gelu_tanh_backward",
            BinaryOp::SiluBackward => "silu_backward",
        }
    }

    /// Backward ops of fused activations: never recorded (no second-order gradients).
    pub fn is_activation_backward(&self) -> bool {
        matches!(
            self,
            BinaryOp::GeluBackward | BinaryOp::GeluTanhBackward | BinaryOp::SiluBackward
        )
    }
}

/// Comparisons give 1 where true and 0 where false, in the inputs' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    /// `lhs == rhs`.
    Eq,
    /// `lhs != rhs`.
    Ne,
    /// `lhs < rhs`.
    Lt,
    /// `lhs <= rhs`.
    Le,
    /// `lhs > rhs`.
    Gt,
    /// `lhs >= rhs`.
    Ge,
}

/// Reductions over one or more dims, which keep size 1 in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// Index (u32) of the first maximum; one dim only.
    ArgMax,
    /// Index (u32) of the first minimum; one dim only.
    ArgMin,
}

impl ReduceOp {
    /// The op's lowercase name, as errors and kernel names use it (e.g. `"argmax"`).
    pub fn name(&self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }
}

/// Shapes of a batched matmul: `(B, M, K) @ (B, K, N) -> (B, M, N)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    /// Batch size `B`.
    pub b: usize,
    /// Rows `M` of the left operand and the output.
    pub m: usize,
    /// Columns `N` of the right operand and the output.
    pub n: usize,
    /// The contracted size `K`.
    pub k: usize,
}

/// Which normalization `norm_last_dim` applies to each last-dim row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// (x - mean) / sqrt(var + eps), var biased.
    Layer,
    /// x / sqrt(mean(x^2) + eps).
    Rms,
}

/// A fused kernel as one object, in the manner of candle's `CustomOp`: its operand check and
/// one implementation per backend. The backends run the common part (each view inside its
/// storage, one device, the check, dense operands on a GPU) and call the kernel's own
/// implementation; `autograd::FusedKernel` adds its gradient and what it keeps for it. A
/// kernel family with its `Tensor` methods, composite twin and gradient is one file of
/// `tensor/kernels/`; a kernel with a gradient is registered in `tensor::kernels::KERNELS`.
/// Operands may be any views; outputs are contiguous.
pub trait Kernel: Send + Sync {
    /// The kernel's snake_case name (errors, the graph's op names, profiles).
    fn name(&self) -> &'static str;

    /// Checks the operands (count, dtypes, shapes), each as (dtype, view), and returns the
    /// sizes the implementations read. Every backend calls it before its implementation.
    fn check(&self, args: &[(DType, &Layout)]) -> Result<Vec<usize>>;

    /// The reference implementation on host storages (the views checked, not necessarily
    /// contiguous), the outputs fresh and contiguous. What the CUDA implementation is tested
    /// against.
    #[cfg(feature = "cpu-ref")]
    fn cpu(&self, dims: &[usize], args: &[(&CpuStorage, &Layout)]) -> Result<Vec<CpuStorage>>;

    /// The CUDA implementation: operands checked, on one device and contiguous from offset
    /// 0 (dense copies where the views were not), the outputs fresh buffers.
    #[cfg(feature = "cuda")]
    fn cuda(&self, dims: &[usize], args: &[&cuda::CudaStorage]) -> Result<Vec<cuda::CudaStorage>>;

    /// What the CUDA backend calls with the checked operands on one device, as views of any
    /// strides. The default makes each view dense (a copy where it is not) and calls
    /// [`Kernel::cuda`]; a kernel that reads strided views in place overrides it (flash
    /// attention reads q, k and v of a permuted projection where they lie).
    #[cfg(feature = "cuda")]
    fn cuda_views(
        &self,
        dims: &[usize],
        args: &[(&cuda::CudaStorage, &Layout)],
    ) -> Result<Vec<cuda::CudaStorage>> {
        let dense = args
            .iter()
            .map(|(s, l)| s.dense(self.name(), l))
            .collect::<Result<Vec<_>>>()?;
        let bufs: Vec<&cuda::CudaStorage> = dense
            .iter()
            .zip(args)
            .map(|(d, (s, _))| d.as_ref().unwrap_or(s))
            .collect();
        self.cuda(dims, &bufs)
    }
}

/// The dtype of saved normalization statistics: f64 for f64 inputs, f32 otherwise.
pub fn stats_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The sliding window of a 2D convolution or pooling over (N, C, H, W).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window2d {
    /// Kernel size (kh, kw).
    pub kernel: (usize, usize),
    /// Step between windows (sh, sw).
    pub stride: (usize, usize),
    /// Zeros added on each side (ph, pw).
    pub padding: (usize, usize),
    /// Spacing between kernel taps (dh, dw); 1 is a dense kernel.
    pub dilation: (usize, usize),
}

impl Window2d {
    /// Output (Ho, Wo) for input (H, W): (H + 2p - d (k - 1) - 1) / s + 1, or None when the
    /// window does not fit or a stride, kernel or dilation is zero.
    pub fn out_size(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let one = |n: usize, k: usize, s: usize, p: usize, d: usize| -> Option<usize> {
            if k == 0 || s == 0 || d == 0 {
                return None;
            }
            let span = d * (k - 1) + 1;
            (n + 2 * p).checked_sub(span).map(|r| r / s + 1)
        };
        Some((
            one(
                h,
                self.kernel.0,
                self.stride.0,
                self.padding.0,
                self.dilation.0,
            )?,
            one(
                w,
                self.kernel.1,
                self.stride.1,
                self.padding.1,
                self.dilation.1,
            )?,
        ))
    }
}

/// Storage of one backend. Layouts passed in describe views into `self`; outputs are
/// contiguous. Binary, where and matmul operands already share the output's shape (broadcast
/// through zero strides by the caller).
pub trait BackendStorage: Sized + Send + Sync {
    /// The device type this storage lives on.
    type Device: BackendDevice<Storage = Self>;

    /// The element type.
    fn dtype(&self) -> DType;
    /// The device holding the buffer.
    fn device(&self) -> Self::Device;

    /// `op` applied to each element of the view `l`, in its dtype.
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self>;
    /// `op(self[l], rhs[rl])` elementwise; both views have the same shape and dtype.
    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self>;
    /// `op(self[l], rhs[rl])` elementwise as 1/0 in the inputs' dtype (see [`CmpOp`]).
    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self>;
    /// `mask != 0 ? on_true : on_false`; `self` is the mask (any dtype).
    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self>;
    /// Reduces `dims` to size 1 (the output keeps the input's rank).
    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self>;
    /// The view `l` converted to `dtype` (float to u32 truncates and saturates).
    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self>;
    /// Copies the view `l` of `self` into the view `dst_l` of `dst` (same shape and dtype).
    fn copy_strided(&self, l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()>;
    /// `out[.., i, ..] = self[.., ids[i], ..]` along `dim`; `ids` is a u32 vector.
    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// `out[i][j][k] = self[i][ids[i][j][k]][k]` (dim = 1); out has the shape of `ids`.
    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// `out = self; out[i][ids[i][j][k]][k] += src[i][j][k]` (dim = 1).
    fn scatter_add(
        &self,
        l: &Layout,
        ids: &Self,
        il: &Layout,
        src: &Self,
        sl: &Layout,
        dim: usize,
    ) -> Result<Self>;
    /// `(B, M, K) @ (B, K, N)`; each operand is a rank-3 layout of any strides.
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self>;
    /// `self @ rhs + bias`, the vector `bias` (N) added to every row of each (M, N) product:
    /// a linear layer's forward in one kernel where the backend's GEMM has a bias epilogue
    /// (cuBLASLt's on CUDA). The default is the matmul, then a broadcast add.
    fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        dims: MatmulDims,
        bias: &Self,
        bl: &Layout,
    ) -> Result<Self> {
        let out = self.matmul(l, rhs, rl, dims)?;
        let shape = Shape::from(vec![dims.b, dims.m, dims.n]);
        let ol = Layout::contiguous(shape.clone());
        out.binary(&ol, bias, &bl.broadcast_as(&shape)?, BinaryOp::Add)
    }
    /// `acc += self @ rhs [+ bias]` in place, `acc` holding the contiguous (B, M, N) values
    /// in the operands' dtype, `bias` (N) broadcast over the rows: on CUDA one GEMM with
    /// beta = 1 and the bias in its epilogue (the sum rounded once, no separate pass over
    /// `acc`). The default is the matmul, then the adds.
    fn matmul_acc(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        dims: MatmulDims,
        bias: Option<(&Self, &Layout)>,
        acc: &mut Self,
    ) -> Result<()> {
        let p = match bias {
            Some((b, bl)) => self.matmul_bias(l, rhs, rl, dims, b, bl)?,
            None => self.matmul(l, rhs, rl, dims)?,
        };
        let ol = Layout::contiguous(Shape::from(vec![dims.b, dims.m, dims.n]));
        *acc = acc.binary(&ol, &p, &ol, BinaryOp::Add)?;
        Ok(())
    }
    /// im2col: (N, C, H, W) -> (N, C * kh * kw, Ho * Wo), rows ordered (c, ki, kj), zeros
    /// where the window reaches into the padding (PyTorch's `unfold`).
    fn unfold2d(&self, l: &Layout, w: Window2d) -> Result<Self>;
    /// col2im, the adjoint of `unfold2d`: (N, C * kh * kw, Ho * Wo) -> (N, C, H, W), each pixel
    /// the sum of the columns that read it, summed in (ki, kj) order in the accumulation type.
    fn fold2d(&self, l: &Layout, w: Window2d, hw: (usize, usize)) -> Result<Self>;
    /// Normalizes each last-dim row (statistics accumulated in f64) and applies the optional
    /// per-column weight and bias (contiguous, x's dtype): y = xhat * w + b, rounded once.
    /// Returns y (x's dtype, contiguous), mean (zeros for Rms) and rstd = 1 / sqrt(var + eps),
    /// one per row, in `stats_dtype`. Fused (one read of x, one write of y);
    /// `Tensor::layer_norm_composite` and `rms_norm_composite` are its reference.
    fn norm_last_dim(
        &self,
        l: &Layout,
        kind: NormKind,
        eps: f64,
        weight: Option<&Self>,
        bias: Option<&Self>,
    ) -> Result<(Self, Self, Self)>;
    /// dx of `norm_last_dim` given dy (same shape as x), the saved statistics and the weight,
    /// with xhat = (x - mean) rstd and g = dy * w: Layer: rstd (g - mean(g) - xhat mean(g xhat));
    /// Rms: rstd (g - xhat mean(g xhat)).
    #[allow(clippy::too_many_arguments)]
    fn norm_last_dim_backward(
        &self,
        l: &Layout,
        dy: &Self,
        dyl: &Layout,
        mean: &Self,
        rstd: &Self,
        kind: NormKind,
        weight: Option<&Self>,
    ) -> Result<Self>;
    /// Softmax along the last dim: `exp(x - max) / sum(exp(x - max))` per row, with exp in
    /// the accumulation type and the sum in f64. Fused (one read, one write); the composite
    /// `Tensor::softmax_composite` is its reference.
    fn softmax_last_dim(&self, l: &Layout) -> Result<Self>;
    /// One Adam step of every item, in place (one kernel launch on CUDA): the parameters, of
    /// one dtype (f32, bf16 or f16), and their moments, all f32 or all 8-bit, as
    /// `multi::AdamHyper::apply` and `quant8` describe; `maps` is the (2, 256) f32 table of
    /// the signed then the unsigned `quant8::dynamic_map` for 8-bit moments. Checked by
    /// `validate::adam_multi` before anything is written.
    fn adam_multi(
        h: &multi::AdamHyper,
        items: &mut [multi::AdamItem<'_, Self>],
        maps: Option<&Self>,
    ) -> Result<()>;
    /// The sum of the squares of every value of every item, accumulated in f64 (in an order
    /// fixed by the sizes alone, so the same inputs give the same bits).
    fn sum_sq_multi(items: &[multi::MultiRef<'_, Self>]) -> Result<f64>;
    /// One Prodigy step of every item, in place, as `multi::ProdigyHyper` describes: the
    /// first pass over every item, the global reduction into the f64 `scalars`
    /// (`multi::prodigy_slot`), the second pass; on CUDA three launches and no host
    /// synchronization. Parameters of f32, bf16 and f16 may mix. Checked by
    /// `validate::prodigy_multi` before anything is written.
    fn prodigy_multi(
        h: &multi::ProdigyHyper,
        items: &mut [multi::ProdigyItem<'_, Self>],
        scalars: &mut Self,
    ) -> Result<()>;
    /// One schedule-free call over every item, in place, as `multi_sf` describes: the move
    /// between y and x, an AdamW step, or a Prodigy step with its reduction into the f64
    /// `scalars` (`multi_sf::prodigy_sf_slot`; on CUDA two launches and no host
    /// synchronization). Parameters of f32, bf16 and f16 may mix. Checked by
    /// `validate::schedulefree_multi` before anything is written.
    fn schedulefree_multi(
        op: &multi_sf::SfOp,
        items: &mut [multi_sf::SfItem<'_, Self>],
        scalars: Option<&mut Self>,
    ) -> Result<()>;
    /// One Lion step of every item, in place (one kernel launch on CUDA): the parameters, of
    /// one dtype (f32, bf16 or f16), and their momenta, all f32 or all 8-bit, as
    /// `lion::LionHyper::apply` and `quant8` describe; `map` is the (256) f32 signed
    /// `quant8::dynamic_map` for 8-bit momenta. Checked by `validate::lion_multi` before
    /// anything is written.
    fn lion_multi(
        h: &lion::LionHyper,
        items: &mut [lion::LionItem<'_, Self>],
        map: Option<&Self>,
    ) -> Result<()>;
    /// One Adafactor step of every item, in place, as `adafactor` describes: the factored
    /// moments' line sums, the row moments' means, the update's sums, each parameter's
    /// scalars and the update (on CUDA five launches and no host synchronization).
    /// Parameters of f32, bf16 and f16 may mix. Checked by `validate::adafactor_multi`
    /// before anything is written.
    fn adafactor_multi(
        h: &adafactor::AdafactorHyper,
        items: &mut [adafactor::AdafactorItem<'_, Self>],
    ) -> Result<()>;
    /// The moving average `s = s - k (s - p)` (`multi::ema_value`) of every item into the
    /// f32 `shadow`, where the items lie one after another from its start (one launch on
    /// CUDA). Items of f32, bf16 and f16 may mix. Checked by `validate::ema_multi`.
    fn ema_multi(k: f32, shadow: &mut Self, items: &[multi::MultiRef<'_, Self>]) -> Result<()>;
    /// The compute-dtype copies of every item into `out` (f32, bf16 or f16), where they lie
    /// one after another from its start: `multi::copy_value` of each value, rounded once to
    /// `out`'s dtype (one launch on CUDA). Items of f32, bf16 and f16 may mix. Checked by
    /// `validate::cast_multi`.
    fn cast_multi(out: &mut Self, items: &[multi::CastItem<'_, Self>]) -> Result<()>;
    /// The f32 gradients of every item into `out` (f32), one after another from its start:
    /// `multi::fold_value` of each value (one launch on CUDA). Gradients of f32, bf16 and f16
    /// may mix. Checked by `validate::fold_multi`.
    fn fold_multi(out: &mut Self, items: &[multi::FoldItem<'_, Self>]) -> Result<()>;
    /// A contiguous copy of the view `l` on this device, in one pass.
    fn copy_contiguous(&self, l: &Layout) -> Result<Self>;
    /// Contiguous host copy of the view `l`.
    fn to_host(&self, l: &Layout) -> Result<CpuStorage>;
}

/// A device of one backend: creates storage and says where it lives.
pub trait BackendDevice: Sized + Clone + Send + Sync {
    /// The storage type this device allocates.
    type Storage: BackendStorage<Device = Self>;

    /// Where the device is, for messages: `"cpu"`, `"cuda:0"`, ...
    fn location(&self) -> String;
    /// Whether `other` is the same device (storage of both can be combined).
    fn same_device(&self, other: &Self) -> bool;
    /// A copy of host data on this device, in the same dtype.
    fn storage_from_host(&self, data: &CpuStorage) -> Result<Self::Storage>;
    /// Values of `dtype` from their little-endian bytes (a file's, at any alignment) on this
    /// device. By default through a host copy of the values (`storage_from_host`); a GPU
    /// copies the bytes across as they are.
    fn storage_from_bytes(&self, dtype: DType, bytes: &[u8]) -> Result<Self::Storage> {
        let data =
            CpuStorage::from_bytes(dtype, bytes).ok_or_else(|| crate::Error::InvalidArgument {
                op: "storage_from_bytes",
                msg: format!("not a whole number of {dtype:?} values"),
                shape: Shape::from(bytes.len()),
            })?;
        self.storage_from_host(&data)
    }
    /// Contiguous storage of `shape` with every element `value` (converted to `dtype`).
    fn full(&self, shape: &Shape, dtype: DType, value: f64) -> Result<Self::Storage>;
    /// Contiguous storage of `shape` for an op that writes every element before anything
    /// reads one (a concatenation): its contents are unspecified. Zeros unless a backend
    /// can skip the fill.
    fn uninit(&self, shape: &Shape, dtype: DType) -> Result<Self::Storage> {
        self.full(shape, dtype, 0.0)
    }
    /// Uniform in [lo, hi) from a counter-based generator: element i depends only on
    /// (seed, i), not on how the work is split.
    fn rand_uniform(
        &self,
        shape: &Shape,
        dtype: DType,
        lo: f64,
        hi: f64,
        seed: u64,
    ) -> Result<Self::Storage>;
    /// Normal(mean, std), counter-based like `rand_uniform`.
    fn rand_normal(
        &self,
        shape: &Shape,
        dtype: DType,
        mean: f64,
        std: f64,
        seed: u64,
    ) -> Result<Self::Storage>;
}
