//! Devices and the storage enum that dispatches to a backend. This is the only place that
//! knows which backends are compiled in. CUDA tensors join here with the CUDA backend; until
//! then the `cuda` feature provides `flame::cuda::CudaDevice` for kernel loading only.

use crate::backend::{
    BackendDevice, BackendStorage, BinaryOp, CmpOp, MatmulDims, ReduceOp, UnaryOp,
};
use crate::{CpuStorage, DType, Layout, Result, Shape};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    #[cfg(feature = "cpu-ref")]
    Cpu,
    /// Present only in builds without any tensor backend; it has no values.
    #[cfg(not(feature = "cpu-ref"))]
    None(std::convert::Infallible),
}

pub(crate) enum Storage {
    #[cfg(feature = "cpu-ref")]
    Cpu(CpuStorage),
    #[cfg(not(feature = "cpu-ref"))]
    None(std::convert::Infallible),
}

/// Applies `$e` to the backend storage inside `$s`, wrapping a storage result back.
macro_rules! on_storage {
    ($s:expr, $x:ident => wrap $e:expr) => {
        match $s {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu($x) => Storage::Cpu($e),
            #[cfg(not(feature = "cpu-ref"))]
            Storage::None(n) => match *n {},
        }
    };
    ($s:expr, $x:ident => $e:expr) => {
        match $s {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu($x) => $e,
            #[cfg(not(feature = "cpu-ref"))]
            Storage::None(n) => match *n {},
        }
    };
}

/// Applies `$e` to two or three storages on the same backend.
macro_rules! on_pair {
    ($a:expr, $b:expr, ($x:ident, $y:ident) => $e:expr) => {
        match ($a, $b) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu($x), Storage::Cpu($y)) => Storage::Cpu($e),
            #[cfg(not(feature = "cpu-ref"))]
            (Storage::None(n), _) => match *n {},
        }
    };
}

impl Device {
    /// The CPU reference backend.
    #[cfg(feature = "cpu-ref")]
    pub fn cpu() -> Device {
        Device::Cpu
    }

    pub fn location(&self) -> String {
        match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => crate::backend::cpu::CpuDevice.location(),
            #[cfg(not(feature = "cpu-ref"))]
            Device::None(n) => match *n {},
        }
    }

    pub(crate) fn storage_from_host(&self, data: &CpuStorage) -> Result<Storage> {
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => Storage::Cpu(crate::backend::cpu::CpuDevice.storage_from_host(data)?),
            #[cfg(not(feature = "cpu-ref"))]
            Device::None(n) => match *n {},
        })
    }

    pub(crate) fn full(&self, shape: &Shape, dtype: DType, value: f64) -> Result<Storage> {
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => Storage::Cpu(crate::backend::cpu::CpuDevice.full(shape, dtype, value)?),
            #[cfg(not(feature = "cpu-ref"))]
            Device::None(n) => match *n {},
        })
    }

    pub(crate) fn rand_uniform(
        &self,
        shape: &Shape,
        dtype: DType,
        lo: f64,
        hi: f64,
        seed: u64,
    ) -> Result<Storage> {
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => Storage::Cpu(
                crate::backend::cpu::CpuDevice.rand_uniform(shape, dtype, lo, hi, seed)?,
            ),
            #[cfg(not(feature = "cpu-ref"))]
            Device::None(n) => match *n {},
        })
    }

    pub(crate) fn rand_normal(
        &self,
        shape: &Shape,
        dtype: DType,
        mean: f64,
        std: f64,
        seed: u64,
    ) -> Result<Storage> {
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => Storage::Cpu(
                crate::backend::cpu::CpuDevice.rand_normal(shape, dtype, mean, std, seed)?,
            ),
            #[cfg(not(feature = "cpu-ref"))]
            Device::None(n) => match *n {},
        })
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.location())
    }
}

impl Storage {
    pub(crate) fn dtype(&self) -> DType {
        on_storage!(self, s => s.dtype())
    }
    pub(crate) fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.unary(l, op)?))
    }
    pub(crate) fn binary(
        &self,
        l: &Layout,
        rhs: &Storage,
        rl: &Layout,
        op: BinaryOp,
    ) -> Result<Storage> {
        Ok(on_pair!(self, rhs, (a, b) => a.binary(l, b, rl, op)?))
    }
    pub(crate) fn cmp(&self, l: &Layout, rhs: &Storage, rl: &Layout, op: CmpOp) -> Result<Storage> {
        Ok(on_pair!(self, rhs, (a, b) => a.cmp(l, b, rl, op)?))
    }
    pub(crate) fn where_cond(
        &self,
        l: &Layout,
        t: &Storage,
        tl: &Layout,
        f: &Storage,
        fl: &Layout,
    ) -> Result<Storage> {
        Ok(match (self, t, f) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu(m), Storage::Cpu(t), Storage::Cpu(f)) => {
                Storage::Cpu(m.where_cond(l, t, tl, f, fl)?)
            }
            #[cfg(not(feature = "cpu-ref"))]
            (Storage::None(n), _, _) => match *n {},
        })
    }
    pub(crate) fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.reduce(l, op, dims)?))
    }
    pub(crate) fn cast(&self, l: &Layout, dtype: DType) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.cast(l, dtype)?))
    }
    pub(crate) fn copy_strided(&self, l: &Layout, dst: &mut Storage, dst_l: &Layout) -> Result<()> {
        match (self, dst) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu(s), Storage::Cpu(d)) => s.copy_strided(l, d, dst_l),
            #[cfg(not(feature = "cpu-ref"))]
            (Storage::None(n), _) => match *n {},
        }
    }
    pub(crate) fn index_select(
        &self,
        l: &Layout,
        ids: &Storage,
        il: &Layout,
        dim: usize,
    ) -> Result<Storage> {
        Ok(on_pair!(self, ids, (s, i) => s.index_select(l, i, il, dim)?))
    }
    pub(crate) fn gather(
        &self,
        l: &Layout,
        ids: &Storage,
        il: &Layout,
        dim: usize,
    ) -> Result<Storage> {
        Ok(on_pair!(self, ids, (s, i) => s.gather(l, i, il, dim)?))
    }
    pub(crate) fn scatter_add(
        &self,
        l: &Layout,
        ids: &Storage,
        il: &Layout,
        src: &Storage,
        sl: &Layout,
        dim: usize,
    ) -> Result<Storage> {
        Ok(match (self, ids, src) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu(d), Storage::Cpu(i), Storage::Cpu(s)) => {
                Storage::Cpu(d.scatter_add(l, i, il, s, sl, dim)?)
            }
            #[cfg(not(feature = "cpu-ref"))]
            (Storage::None(n), _, _) => match *n {},
        })
    }
    pub(crate) fn matmul(
        &self,
        l: &Layout,
        rhs: &Storage,
        rl: &Layout,
        dims: MatmulDims,
    ) -> Result<Storage> {
        Ok(on_pair!(self, rhs, (a, b) => a.matmul(l, b, rl, dims)?))
    }
    pub(crate) fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        on_storage!(self, s => s.to_host(l))
    }
}
