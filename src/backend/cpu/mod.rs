//! The CPU reference backend: correct for every dtype (bf16/f16 computed in f32, sums
//! accumulated in f64), multithreaded with rayon, matmul through the `gemm` crate.

mod adafactor;
mod attention;
mod conv;
mod fused;
mod index;
mod lion;
mod matmul;
mod multi;
mod norm;
mod num;
mod prodigy;
pub mod random;
mod reduce;
mod schedulefree;
mod strided;

use crate::backend::validate;
use crate::backend::{
    BackendDevice, BackendStorage, BinaryOp, CmpOp, MatmulDims, ReduceOp, UnaryOp,
};
use crate::{CpuStorage, DType, Error, Layout, Result, Shape, WithDType};
pub(crate) use attention::Attn;
pub(crate) use fused::{f64_view, run_kernel};
use half::{bf16, f16};
pub(crate) use matmul::matmul;
pub(crate) use num::{Activation, Elem, Real};
pub(crate) use strided::contiguous;

/// Values computed in f32, each rounded once to `dtype` (as a kernel's `__float2bfloat16_rn`
/// does; not through f64, whose conversion to the half types in `half` decides ties from the
/// high 32 bits only). `op` names the caller in the error for U32.
pub(crate) fn f32_values_as(
    values: Vec<f32>,
    dtype: DType,
    op: &'static str,
) -> Result<CpuStorage> {
    use rayon::prelude::*;
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::F64 => CpuStorage::F64(values.into_iter().map(f64::from).collect()),
        DType::BF16 => CpuStorage::BF16(values.into_par_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(values.into_par_iter().map(f16::from_f32).collect()),
        DType::U32 => return Err(Error::UnsupportedDType { op, dtype }),
    })
}

/// The host as a backend device; its storage is [`CpuStorage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuDevice;

/// Applies `$f` (a generic fn over `T: Elem`) to the float storages; u32 is unsupported.
macro_rules! float_dispatch {
    ($s:expr, $op:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => Ok(CpuStorage::F32($body)),
            CpuStorage::F64($v) => Ok(CpuStorage::F64($body)),
            CpuStorage::BF16($v) => Ok(CpuStorage::BF16($body)),
            CpuStorage::F16($v) => Ok(CpuStorage::F16($body)),
            CpuStorage::U32(_) => Err(Error::UnsupportedDType {
                op: $op,
                dtype: DType::U32,
            }),
        }
    };
}

/// `n` default values (zeros) in a vector whose allocation may fail: a buffer too large
/// for the host is [`Error::HostMemory`] naming `what`, not an abort.
pub(crate) fn zeroed_vec<T: Default + Clone>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::HostMemory {
        what: format!("{what} of {n} elements"),
        bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    v.resize(n, T::default());
    Ok(v)
}

fn unary_map<T: Elem>(v: &[T], l: &Layout, op: UnaryOp) -> Vec<T> {
    let m = |f: fn(T::Acc) -> T::Acc| strided::map1(v, l, move |x: T| T::from_acc(f(x.to_acc())));
    match op {
        UnaryOp::Neg => m(|x| -x),
        UnaryOp::Recip => m(|x| T::Acc::from_f64(1.0) / x),
        UnaryOp::Exp => m(Real::exp),
        UnaryOp::Log => m(Real::ln),
        UnaryOp::Sqrt => m(Real::sqrt),
        UnaryOp::Sin => m(Real::sin),
        UnaryOp::Cos => m(Real::cos),
        UnaryOp::Tanh => m(Real::tanh),
        UnaryOp::Erf => m(Real::erf),
        UnaryOp::Abs => m(Real::abs),
        UnaryOp::Sign => m(Real::sign),
        UnaryOp::Affine { mul, add } => {
            let (mul, add) = (T::Acc::from_f64(mul), T::Acc::from_f64(add));
            strided::map1(v, l, move |x: T| T::from_acc(x.to_acc() * mul + add))
        }
        UnaryOp::Gelu => m(Activation::gelu),
        UnaryOp::GeluTanh => m(Activation::gelu_tanh),
        UnaryOp::Silu => m(Activation::silu),
        UnaryOp::Powf(e) => {
            let e = T::Acc::from_f64(e);
            strided::map1(v, l, move |x: T| T::from_acc(x.to_acc().powf(e)))
        }
    }
}

fn binary_map<T: Elem>(a: &[T], al: &Layout, b: &[T], bl: &Layout, op: BinaryOp) -> Vec<T> {
    let m = |f: fn(T::Acc, T::Acc) -> T::Acc| {
        strided::map2(a, al, b, bl, move |x: T, y: T| {
            T::from_acc(f(x.to_acc(), y.to_acc()))
        })
    };
    match op {
        BinaryOp::Add => m(|x, y| x + y),
        BinaryOp::Sub => m(|x, y| x - y),
        BinaryOp::Mul => m(|x, y| x * y),
        BinaryOp::Div => m(|x, y| x / y),
        // NaN propagates, as in PyTorch.
        BinaryOp::Maximum => m(|x, y| if x.is_nan() || x >= y { x } else { y }),
        BinaryOp::Minimum => m(|x, y| if x.is_nan() || x <= y { x } else { y }),
        // (x, dy) -> dy * f'(x)
        BinaryOp::GeluBackward => m(|x, g| g * x.gelu_grad()),
        BinaryOp::GeluTanhBackward => m(|x, g| g * x.gelu_tanh_grad()),
        BinaryOp::SiluBackward => m(|x, g| g * x.silu_grad()),
    }
}

/// Softmax of each last-dim row (see `BackendStorage::softmax_last_dim`).
fn softmax_rows<T: Elem>(v: &[T], l: &Layout) -> Vec<T> {
    use rayon::prelude::*;
    let x = strided::contiguous(v, l);
    let cols = l.dims().last().copied().unwrap_or(1);
    let mut out = vec![T::default(); x.len()];
    if cols == 0 {
        return out;
    }
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .for_each(|(y, x)| {
            let nan = T::Acc::from_f64(f64::NAN);
            let mut m = T::Acc::from_f64(f64::NEG_INFINITY);
            for a in x.iter().map(|a| a.to_acc()) {
                if a.is_nan() {
                    m = nan;
                    break;
                }
                if a > m {
                    m = a;
                }
            }
            let sum: f64 = x.iter().map(|a| (a.to_acc() - m).exp().to_f64()).sum();
            let inv = T::Acc::from_f64(1.0 / sum);
            for (y, a) in y.iter_mut().zip(x.iter()) {
                *y = T::from_acc((a.to_acc() - m).exp() * inv);
            }
        });
    out
}

fn cmp_map<T: WithDType>(a: &[T], al: &Layout, b: &[T], bl: &Layout, op: CmpOp) -> Vec<T> {
    let (one, zero) = (T::from_f64(1.0), T::from_f64(0.0));
    let m = |f: fn(&T, &T) -> bool| {
        strided::map2(
            a,
            al,
            b,
            bl,
            move |x: T, y: T| if f(&x, &y) { one } else { zero },
        )
    };
    match op {
        CmpOp::Eq => m(|x, y| x == y),
        CmpOp::Ne => m(|x, y| x != y),
        CmpOp::Lt => m(|x, y| x < y),
        CmpOp::Le => m(|x, y| x <= y),
        CmpOp::Gt => m(|x, y| x > y),
        CmpOp::Ge => m(|x, y| x >= y),
    }
}

/// The view must lie inside its storage: the backend is public, so a caller's bad layout is an
/// error rather than an out-of-bounds panic.
fn check_view(op: &'static str, s: &CpuStorage, l: &Layout) -> Result<()> {
    if l.dims().len() != l.strides().len() || l.offset() + l.storage_span() > s.len() {
        return Err(Error::invalid(
            op,
            format!(
                "view (strides {:?}, offset {}) exceeds its storage of {} elements",
                l.strides(),
                l.offset(),
                s.len()
            ),
            l.shape(),
        ));
    }
    Ok(())
}

fn cast_vec<T: WithDType, U: WithDType>(v: &[T], l: &Layout) -> Vec<U> {
    strided::map1(v, l, |x: T| U::from_f64(x.to_f64()))
}

fn cast_to<T: WithDType>(v: &[T], l: &Layout, dtype: DType) -> CpuStorage {
    match dtype {
        DType::F32 => CpuStorage::F32(cast_vec(v, l)),
        DType::F64 => CpuStorage::F64(cast_vec(v, l)),
        DType::BF16 => CpuStorage::BF16(cast_vec(v, l)),
        DType::F16 => CpuStorage::F16(cast_vec(v, l)),
        DType::U32 => CpuStorage::U32(cast_vec(v, l)),
    }
}

fn mask_vec(s: &CpuStorage, l: &Layout) -> Vec<u8> {
    crate::dispatch_host!(s, v => strided::map1(v, l, |x| (WithDType::to_f64(x) != 0.0) as u8))
}

/// Runs `$body` with `$v` bound to the slice of any CpuStorage (a value of one type results).
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch_host {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::CpuStorage::F32($v) => $body,
            $crate::CpuStorage::F64($v) => $body,
            $crate::CpuStorage::BF16($v) => $body,
            $crate::CpuStorage::F16($v) => $body,
            $crate::CpuStorage::U32($v) => $body,
        }
    };
}

/// Pairs two storages of the same dtype; `$body` sees `$a`, `$b` as slices of one type.
macro_rules! pair_dispatch {
    ($op:expr, $x:expr, $y:expr, ($a:ident, $b:ident) => $body:expr) => {
        match ($x, $y) {
            (CpuStorage::F32($a), CpuStorage::F32($b)) => CpuStorage::F32($body),
            (CpuStorage::F64($a), CpuStorage::F64($b)) => CpuStorage::F64($body),
            (CpuStorage::BF16($a), CpuStorage::BF16($b)) => CpuStorage::BF16($body),
            (CpuStorage::F16($a), CpuStorage::F16($b)) => CpuStorage::F16($body),
            (CpuStorage::U32($a), CpuStorage::U32($b)) => CpuStorage::U32($body),
            (x, y) => {
                return Err(Error::DTypeMismatch {
                    op: $op,
                    lhs: x.dtype(),
                    rhs: y.dtype(),
                })
            }
        }
    };
}

impl BackendStorage for CpuStorage {
    type Device = CpuDevice;

    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }

    fn device(&self) -> CpuDevice {
        CpuDevice
    }

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        check_view(op.name(), self, l)?;
        float_dispatch!(self, op.name(), v => unary_map(v, l, op))
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        check_view(op.name(), self, l)?;
        check_view(op.name(), rhs, rl)?;
        validate::same_shape(op.name(), l, rl)?;
        Ok(match (self, rhs) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32(binary_map(a, l, b, rl, op))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64(binary_map(a, l, b, rl, op))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                CpuStorage::BF16(binary_map(a, l, b, rl, op))
            }
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                CpuStorage::F16(binary_map(a, l, b, rl, op))
            }
            (CpuStorage::U32(_), CpuStorage::U32(_)) => {
                return Err(Error::UnsupportedDType {
                    op: op.name(),
                    dtype: DType::U32,
                })
            }
            (x, y) => {
                return Err(Error::DTypeMismatch {
                    op: op.name(),
                    lhs: x.dtype(),
                    rhs: y.dtype(),
                })
            }
        })
    }

    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        check_view("cmp", self, l)?;
        check_view("cmp", rhs, rl)?;
        validate::same_shape("cmp", l, rl)?;
        Ok(pair_dispatch!("cmp", self, rhs, (a, b) => cmp_map(a, l, b, rl, op)))
    }

    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        for (s, sl) in [(self, l), (t, tl), (f, fl)] {
            check_view("where_cond", s, sl)?;
            validate::same_shape("where_cond", l, sl)?;
        }
        let mask = mask_vec(self, l);
        let ml = Layout::contiguous(l.shape().clone());
        Ok(pair_dispatch!("where_cond", t, f, (a, b) =>
            strided::map3(&mask, &ml, a, tl, b, fl, |m, x, y| if m != 0 { x } else { y })))
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        check_view(op.name(), self, l)?;
        reduce::reduce(self, l, op, dims)
    }

    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self> {
        check_view("cast", self, l)?;
        Ok(crate::dispatch_host!(self, v => cast_to(v, l, dtype)))
    }

    fn copy_strided(&self, l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()> {
        check_view("copy_strided", self, l)?;
        check_view("copy_strided", dst, dst_l)?;
        if l.shape() != dst_l.shape() {
            return Err(Error::ShapeMismatch {
                op: "copy_strided",
                lhs: l.shape().clone(),
                rhs: dst_l.shape().clone(),
            });
        }
        match (self, dst) {
            (CpuStorage::F32(s), CpuStorage::F32(d)) => strided::copy(s, l, d, dst_l),
            (CpuStorage::F64(s), CpuStorage::F64(d)) => strided::copy(s, l, d, dst_l),
            (CpuStorage::BF16(s), CpuStorage::BF16(d)) => strided::copy(s, l, d, dst_l),
            (CpuStorage::F16(s), CpuStorage::F16(d)) => strided::copy(s, l, d, dst_l),
            (CpuStorage::U32(s), CpuStorage::U32(d)) => strided::copy(s, l, d, dst_l),
            (s, d) => {
                return Err(Error::DTypeMismatch {
                    op: "copy_strided",
                    lhs: s.dtype(),
                    rhs: d.dtype(),
                })
            }
        }
        Ok(())
    }

    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        check_view("index_select", self, l)?;
        check_view("index_select", ids, il)?;
        validate::dim_in_range("index_select", l, dim)?;
        index::index_select(self, l, ids, il, dim)
    }

    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        check_view("gather", self, l)?;
        check_view("gather", ids, il)?;
        validate::dim_in_range("gather", l, dim)?;
        index::gather(self, l, ids, il, dim)
    }

    fn scatter_add(
        &self,
        l: &Layout,
        ids: &Self,
        il: &Layout,
        src: &Self,
        sl: &Layout,
        dim: usize,
    ) -> Result<Self> {
        index::scatter_add(self, l, ids, il, src, sl, dim)
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        matmul::matmul(self, l, rhs, rl, dims)
    }

    fn unfold2d(&self, l: &Layout, w: crate::backend::Window2d) -> Result<Self> {
        check_view("unfold2d", self, l)?;
        Ok(match self {
            CpuStorage::F32(v) => CpuStorage::F32(conv::unfold(v, l, w)?),
            CpuStorage::F64(v) => CpuStorage::F64(conv::unfold(v, l, w)?),
            CpuStorage::BF16(v) => CpuStorage::BF16(conv::unfold(v, l, w)?),
            CpuStorage::F16(v) => CpuStorage::F16(conv::unfold(v, l, w)?),
            CpuStorage::U32(_) => {
                return Err(Error::UnsupportedDType {
                    op: "unfold2d",
                    dtype: DType::U32,
                })
            }
        })
    }

    fn fold2d(&self, l: &Layout, w: crate::backend::Window2d, hw: (usize, usize)) -> Result<Self> {
        check_view("fold2d", self, l)?;
        Ok(match self {
            CpuStorage::F32(v) => CpuStorage::F32(conv::fold(v, l, w, hw)?),
            CpuStorage::F64(v) => CpuStorage::F64(conv::fold(v, l, w, hw)?),
            CpuStorage::BF16(v) => CpuStorage::BF16(conv::fold(v, l, w, hw)?),
            CpuStorage::F16(v) => CpuStorage::F16(conv::fold(v, l, w, hw)?),
            CpuStorage::U32(_) => {
                return Err(Error::UnsupportedDType {
                    op: "fold2d",
                    dtype: DType::U32,
                })
            }
        })
    }

    fn norm_last_dim(
        &self,
        l: &Layout,
        kind: crate::backend::NormKind,
        eps: f64,
        weight: Option<&Self>,
        bias: Option<&Self>,
    ) -> Result<(Self, Self, Self)> {
        check_view("norm", self, l)?;
        let (w, b) = (
            weight.map(CpuStorage::to_f64_vec),
            bias.map(CpuStorage::to_f64_vec),
        );
        let (w, b) = (w.as_deref(), b.as_deref());
        let stats = |v: Vec<f64>| match self.dtype() {
            DType::F64 => CpuStorage::F64(v),
            _ => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        };
        let (y, m, r) =
            match self {
                CpuStorage::F32(v) => norm::forward(v, l, kind, eps, w, b)
                    .map(|(y, m, r)| (CpuStorage::F32(y), m, r))?,
                CpuStorage::F64(v) => norm::forward(v, l, kind, eps, w, b)
                    .map(|(y, m, r)| (CpuStorage::F64(y), m, r))?,
                CpuStorage::BF16(v) => norm::forward(v, l, kind, eps, w, b)
                    .map(|(y, m, r)| (CpuStorage::BF16(y), m, r))?,
                CpuStorage::F16(v) => norm::forward(v, l, kind, eps, w, b)
                    .map(|(y, m, r)| (CpuStorage::F16(y), m, r))?,
                CpuStorage::U32(_) => {
                    return Err(Error::UnsupportedDType {
                        op: "norm",
                        dtype: DType::U32,
                    })
                }
            };
        Ok((y, stats(m), stats(r)))
    }

    fn norm_last_dim_backward(
        &self,
        l: &Layout,
        dy: &Self,
        dyl: &Layout,
        mean: &Self,
        rstd: &Self,
        kind: crate::backend::NormKind,
        weight: Option<&Self>,
    ) -> Result<Self> {
        check_view("norm_backward", self, l)?;
        check_view("norm_backward", dy, dyl)?;
        validate::same_shape("norm_backward", l, dyl)?;
        let (m, r) = (mean.to_f64_vec(), rstd.to_f64_vec());
        let w = weight.map(CpuStorage::to_f64_vec);
        let w = w.as_deref();
        Ok(match (self, dy) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(norm::backward(x, l, g, dyl, &m, &r, kind, w)?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(norm::backward(x, l, g, dyl, &m, &r, kind, w)?)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(norm::backward(x, l, g, dyl, &m, &r, kind, w)?)
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                CpuStorage::F16(norm::backward(x, l, g, dyl, &m, &r, kind, w)?)
            }
            (a, b) => {
                return Err(Error::DTypeMismatch {
                    op: "norm_backward",
                    lhs: a.dtype(),
                    rhs: b.dtype(),
                })
            }
        })
    }

    fn softmax_last_dim(&self, l: &Layout) -> Result<Self> {
        check_view("softmax", self, l)?;
        float_dispatch!(self, "softmax", v => softmax_rows(v, l))
    }

    fn adam_multi(
        h: &crate::backend::multi::AdamHyper,
        items: &mut [crate::backend::multi::AdamItem<'_, Self>],
        maps: Option<&Self>,
    ) -> Result<()> {
        multi::adam(h, items, maps)
    }

    fn sum_sq_multi(items: &[crate::backend::multi::MultiRef<'_, Self>]) -> Result<f64> {
        multi::sum_sq(items)
    }

    fn prodigy_multi(
        h: &crate::backend::multi::ProdigyHyper,
        items: &mut [crate::backend::multi::ProdigyItem<'_, Self>],
        scalars: &mut Self,
    ) -> Result<()> {
        prodigy::prodigy(h, items, scalars)
    }

    fn schedulefree_multi(
        op: &crate::backend::multi_sf::SfOp,
        items: &mut [crate::backend::multi_sf::SfItem<'_, Self>],
        scalars: Option<&mut Self>,
    ) -> Result<()> {
        schedulefree::schedulefree(op, items, scalars)
    }

    fn lion_multi(
        h: &crate::backend::lion::LionHyper,
        items: &mut [crate::backend::lion::LionItem<'_, Self>],
        map: Option<&Self>,
    ) -> Result<()> {
        lion::lion(h, items, map)
    }

    fn adafactor_multi(
        h: &crate::backend::adafactor::AdafactorHyper,
        items: &mut [crate::backend::adafactor::AdafactorItem<'_, Self>],
    ) -> Result<()> {
        adafactor::adafactor(h, items)
    }

    fn ema_multi(
        k: f32,
        shadow: &mut Self,
        items: &[crate::backend::multi::MultiRef<'_, Self>],
    ) -> Result<()> {
        adafactor::ema(k, shadow, items)
    }

    fn cast_multi(
        out: &mut Self,
        items: &[crate::backend::multi::CastItem<'_, Self>],
    ) -> Result<()> {
        multi::cast(out, items)
    }

    fn fold_multi(
        out: &mut Self,
        items: &[crate::backend::multi::FoldItem<'_, Self>],
    ) -> Result<()> {
        multi::fold(out, items)
    }

    fn copy_contiguous(&self, l: &Layout) -> Result<Self> {
        self.to_host(l)
    }

    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        check_view("to_host", self, l)?;
        Ok(crate::map_cpu_storage!(self, v => strided::contiguous(v, l).into_owned()))
    }
}

pub(crate) fn from_f64_vec(v: Vec<f64>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        DType::F64 => CpuStorage::F64(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(crate::bf16_nearest).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(crate::f16_nearest).collect()),
        DType::U32 => CpuStorage::U32(v.into_iter().map(|x| x as u32).collect()),
    }
}

impl BackendDevice for CpuDevice {
    type Storage = CpuStorage;

    fn location(&self) -> String {
        "cpu".into()
    }

    fn same_device(&self, _: &Self) -> bool {
        true
    }

    fn storage_from_host(&self, data: &CpuStorage) -> Result<CpuStorage> {
        Ok(data.clone())
    }

    fn full(&self, shape: &Shape, dtype: DType, value: f64) -> Result<CpuStorage> {
        let n = shape.elem_count();
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::BF16 => CpuStorage::BF16(vec![crate::bf16_nearest(value); n]),
            DType::F16 => CpuStorage::F16(vec![crate::f16_nearest(value); n]),
            DType::U32 => CpuStorage::U32(vec![value as u32; n]),
        })
    }

    fn rand_uniform(
        &self,
        shape: &Shape,
        dtype: DType,
        lo: f64,
        hi: f64,
        seed: u64,
    ) -> Result<CpuStorage> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "rand_uniform",
                dtype,
            });
        }
        Ok(from_f64_vec(
            random::uniform(shape.elem_count(), seed, lo, hi),
            dtype,
        ))
    }

    fn rand_normal(
        &self,
        shape: &Shape,
        dtype: DType,
        mean: f64,
        std: f64,
        seed: u64,
    ) -> Result<CpuStorage> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "rand_normal",
                dtype,
            });
        }
        Ok(from_f64_vec(
            random::normal(shape.elem_count(), seed, mean, std),
            dtype,
        ))
    }
}
