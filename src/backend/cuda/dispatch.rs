//! The backend traits' methods on CUDA storage and devices, each handed to its op file
//! (`storage.rs` for elementwise kernels, `matmul.rs`, `reduce.rs`, `index.rs`, `norm.rs`,
//! `conv.rs`, `fused.rs`, `multi.rs`): the op files know storage, this file knows the op
//! files.

use super::layout::grid_for;
use super::storage::{
    binary_t, by_dtype, cast_from, copy_t, launch, softmax_t, to_host_t, unary_t, where_t, Buf,
    CudaStorage, Elem,
};
use super::CudaDevice;
use crate::backend::{
    BackendDevice, BackendStorage, BinaryOp, CmpOp, MatmulDims, ReduceOp, UnaryOp,
};
use crate::{CpuStorage, DType, Error, Layout, Result, Shape};

impl BackendStorage for CudaStorage {
    type Device = CudaDevice;

    fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    fn device(&self) -> CudaDevice {
        self.dev.clone()
    }

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        let (p0, p1) = match op {
            UnaryOp::Affine { mul, add } => (mul, add),
            UnaryOp::Powf(e) => (e, 0.0),
            _ => (0.0, 0.0),
        };
        let name = format!("u_{}", op.name());
        let u32_err = Error::UnsupportedDType {
            op: op.name(),
            dtype: DType::U32,
        };
        let buf = by_dtype!(self.buf.dtype(), unary_t(self, l, &name, p0, p1, op.name()), u32 => Err(u32_err))?;
        Ok(self.wrap(buf))
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        let name = format!("b_{}", op.name());
        let u32_err = Error::UnsupportedDType {
            op: op.name(),
            dtype: DType::U32,
        };
        let buf = by_dtype!(self.buf.dtype(), binary_t(self, l, rhs, rl, &name, op.name()), u32 => Err(u32_err))?;
        Ok(self.wrap(buf))
    }

    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        let name = match op {
            CmpOp::Eq => "c_eq",
            CmpOp::Ne => "c_ne",
            CmpOp::Lt => "c_lt",
            CmpOp::Le => "c_le",
            CmpOp::Gt => "c_gt",
            CmpOp::Ge => "c_ge",
        };
        let buf = by_dtype!(self.buf.dtype(), binary_t(self, l, rhs, rl, name, "cmp"))?;
        Ok(self.wrap(buf))
    }

    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        crate::backend::validate::same_shape("where_cond", l, tl)?;
        crate::backend::validate::same_shape("where_cond", l, fl)?;
        self.same_device("where_cond", t)?;
        self.same_device("where_cond", f)?;
        // The kernel takes a mask of the values' dtype.
        let cast;
        let (m, ml) = if self.dtype() == t.dtype() {
            (self, l.clone())
        } else {
            cast = self.cast(l, t.dtype())?;
            (&cast, Layout::contiguous(l.shape().clone()))
        };
        let buf = by_dtype!(t.dtype(), where_t(m, &ml, t, tl, f, fl))?;
        Ok(self.wrap(buf))
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        super::reduce::reduce(self, l, op, dims)
    }

    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self> {
        let buf = by_dtype!(self.buf.dtype(), cast_from(self, l, dtype))?;
        Ok(self.wrap(buf))
    }

    fn copy_strided(&self, l: &Layout, dst: &mut Self, dst_l: &Layout) -> Result<()> {
        crate::backend::validate::same_shape("copy_strided", l, dst_l)?;
        self.same_device("copy_strided", dst)?;
        by_dtype!(self.buf.dtype(), copy_t(self, l, dst, dst_l))
    }

    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        super::index::index_select(self, l, ids, il, dim)
    }

    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        super::index::gather(self, l, ids, il, dim)
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
        super::index::scatter_add(self, l, ids, il, src, sl, dim)
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        super::matmul::matmul(self, l, rhs, rl, dims)
    }

    fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        dims: MatmulDims,
        bias: &Self,
        bl: &Layout,
    ) -> Result<Self> {
        super::matmul::matmul_bias(self, l, rhs, rl, dims, bias, bl)
    }

    fn matmul_acc(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        dims: MatmulDims,
        bias: Option<(&Self, &Layout)>,
        acc: &mut Self,
    ) -> Result<()> {
        super::matmul::matmul_acc(self, l, rhs, rl, dims, bias, acc)
    }

    fn unfold2d(&self, l: &Layout, w: crate::backend::Window2d) -> Result<Self> {
        super::conv::unfold2d(self, l, w)
    }

    fn fold2d(&self, l: &Layout, w: crate::backend::Window2d, hw: (usize, usize)) -> Result<Self> {
        super::conv::fold2d(self, l, w, hw)
    }

    fn norm_last_dim(
        &self,
        l: &Layout,
        kind: crate::backend::NormKind,
        eps: f64,
        weight: Option<&Self>,
        bias: Option<&Self>,
    ) -> Result<(Self, Self, Self)> {
        super::norm::norm_last_dim(self, l, kind, eps, weight, bias)
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
        let o = super::norm::NormGrad {
            x: self,
            l,
            dy,
            dyl,
            mean,
            rstd,
            weight,
        };
        super::norm::norm_last_dim_backward(&o, kind)
    }

    fn softmax_last_dim(&self, l: &Layout) -> Result<Self> {
        let err = Error::UnsupportedDType {
            op: "softmax",
            dtype: DType::U32,
        };
        let buf = by_dtype!(self.buf.dtype(), softmax_t(self, l), u32 => Err(err))?;
        Ok(self.wrap(buf))
    }

    fn adam_multi(
        h: &crate::backend::multi::AdamHyper,
        items: &mut [crate::backend::multi::AdamItem<'_, Self>],
        maps: Option<&Self>,
    ) -> Result<()> {
        super::multi::adam(h, items, maps)
    }

    fn sum_sq_multi(items: &[crate::backend::multi::MultiRef<'_, Self>]) -> Result<f64> {
        super::multi::sum_sq(items)
    }

    fn prodigy_multi(
        h: &crate::backend::multi::ProdigyHyper,
        items: &mut [crate::backend::multi::ProdigyItem<'_, Self>],
        scalars: &mut Self,
    ) -> Result<()> {
        super::prodigy::prodigy(h, items, scalars)
    }

    fn schedulefree_multi(
        op: &crate::backend::multi_sf::SfOp,
        items: &mut [crate::backend::multi_sf::SfItem<'_, Self>],
        scalars: Option<&mut Self>,
    ) -> Result<()> {
        super::schedulefree::schedulefree(op, items, scalars)
    }

    fn lion_multi(
        h: &crate::backend::lion::LionHyper,
        items: &mut [crate::backend::lion::LionItem<'_, Self>],
        map: Option<&Self>,
    ) -> Result<()> {
        super::lion::lion(h, items, map)
    }

    fn adafactor_multi(
        h: &crate::backend::adafactor::AdafactorHyper,
        items: &mut [crate::backend::adafactor::AdafactorItem<'_, Self>],
    ) -> Result<()> {
        super::adafactor::adafactor(h, items)
    }

    fn ema_multi(
        k: f32,
        shadow: &mut Self,
        items: &[crate::backend::multi::MultiRef<'_, Self>],
    ) -> Result<()> {
        super::adafactor::ema(k, shadow, items)
    }

    fn cast_multi(
        out: &mut Self,
        items: &[crate::backend::multi::CastItem<'_, Self>],
    ) -> Result<()> {
        super::multi::cast(out, items)
    }

    fn fold_multi(
        out: &mut Self,
        items: &[crate::backend::multi::FoldItem<'_, Self>],
    ) -> Result<()> {
        super::multi::fold(out, items)
    }

    fn copy_contiguous(&self, l: &Layout) -> Result<Self> {
        self.contiguous(l)
    }

    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        by_dtype!(self.buf.dtype(), to_host_t(self, l))
    }
}

fn from_host_t<T: Elem>(dev: &CudaDevice, data: &CpuStorage) -> Result<Buf> {
    let src = T::from_host(data).ok_or(Error::DTypeMismatch {
        op: "to_device",
        lhs: T::DTYPE,
        rhs: data.dtype(),
    })?;
    let mut out = dev.alloc::<T>(src.len())?;
    if !src.is_empty() {
        dev.stream()
            .memcpy_htod(src, &mut *out.slice)
            .map_err(super::cuda_err("copying to the device"))?;
    }
    Ok(T::wrap(out))
}

fn alloc_t<T: Elem>(dev: &CudaDevice, n: usize) -> Result<Buf> {
    Ok(T::wrap(dev.alloc::<T>(n)?))
}

fn fill_t<T: Elem>(dev: &CudaDevice, n: usize, value: f64) -> Result<Buf> {
    let mut out = dev.alloc::<T>(n)?;
    if n > 0 {
        launch!(
            dev,
            "fill",
            format!("fill_{}", T::SFX),
            grid_for(n, dev.sm_count()),
            &mut *out.slice,
            &value,
            &n
        )?;
    }
    Ok(T::wrap(out))
}

fn random_t<T: Elem>(
    dev: &CudaDevice,
    n: usize,
    kind: &str,
    seed: u64,
    a: f64,
    b: f64,
) -> Result<Buf> {
    let mut out = dev.alloc::<T>(n)?;
    if n > 0 {
        launch!(
            dev,
            "random",
            format!("rand_{kind}_{}", T::SFX),
            grid_for(n.div_ceil(4), dev.sm_count()),
            &mut *out.slice,
            &n,
            &seed,
            &a,
            &b
        )?;
    }
    Ok(T::wrap(out))
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;

    fn location(&self) -> String {
        format!("cuda:{}", self.ordinal())
    }

    fn same_device(&self, other: &Self) -> bool {
        self == other
    }

    fn storage_from_host(&self, data: &CpuStorage) -> Result<CudaStorage> {
        let buf = by_dtype!(data.dtype(), from_host_t(self, data))?;
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }

    /// Through the device's page-locked load buffers (`load_bytes`, host.rs).
    fn storage_from_bytes(&self, dtype: DType, bytes: &[u8]) -> Result<CudaStorage> {
        self.load_bytes(dtype, bytes)
    }

    fn full(&self, shape: &Shape, dtype: DType, value: f64) -> Result<CudaStorage> {
        let buf = by_dtype!(dtype, fill_t(self, shape.elem_count(), value))?;
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }

    /// A pool buffer as it was left: no fill kernel.
    fn uninit(&self, shape: &Shape, dtype: DType) -> Result<CudaStorage> {
        let buf = by_dtype!(dtype, alloc_t(self, shape.elem_count()))?;
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }

    fn rand_uniform(
        &self,
        shape: &Shape,
        dtype: DType,
        lo: f64,
        hi: f64,
        seed: u64,
    ) -> Result<CudaStorage> {
        let err = Error::UnsupportedDType {
            op: "rand_uniform",
            dtype,
        };
        let buf = by_dtype!(dtype, random_t(self, shape.elem_count(), "uniform", seed, lo, hi), u32 => Err(err))?;
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }

    fn rand_normal(
        &self,
        shape: &Shape,
        dtype: DType,
        mean: f64,
        std: f64,
        seed: u64,
    ) -> Result<CudaStorage> {
        let err = Error::UnsupportedDType {
            op: "rand_normal",
            dtype,
        };
        let buf = by_dtype!(dtype, random_t(self, shape.elem_count(), "normal", seed, mean, std), u32 => Err(err))?;
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }
}
