//! Devices and the storage enum that dispatches to a backend. This is the only place that
//! knows which backends are compiled in.

use crate::backend::{
    BackendDevice, BackendStorage, BinaryOp, CmpOp, MatmulDims, ReduceOp, UnaryOp,
};
use crate::{CpuStorage, DType, Layout, Result, Shape};

/// Where a tensor lives and which backend computes on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference backend (feature `cpu-ref`).
    #[cfg(feature = "cpu-ref")]
    Cpu,
    /// One GPU through the CUDA backend (feature `cuda`); make it with [`Device::cuda`].
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::CudaDevice),
    /// Present only in builds without any tensor backend; it has no values.
    #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
    None(std::convert::Infallible),
}

pub(crate) enum Storage {
    #[cfg(feature = "cpu-ref")]
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::CudaStorage),
    #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
    None(std::convert::Infallible),
}

#[cfg(all(feature = "cpu-ref", feature = "cuda"))]
fn mismatch(op: &'static str) -> crate::Error {
    crate::Error::DeviceMismatch {
        op,
        lhs: "cpu".into(),
        rhs: "cuda".into(),
    }
}

/// Applies `$e` to the backend value inside `$s`; `wrap` puts a storage result back.
macro_rules! on_storage {
    ($s:expr, $x:ident => wrap $e:expr) => {
        match $s {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu($x) => Storage::Cpu($e),
            #[cfg(feature = "cuda")]
            Storage::Cuda($x) => Storage::Cuda($e),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        }
    };
    ($s:expr, $x:ident => $e:expr) => {
        match $s {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu($x) => $e,
            #[cfg(feature = "cuda")]
            Storage::Cuda($x) => $e,
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        }
    };
}

/// Applies `$e` to two storages of one backend (a device mismatch is an error).
macro_rules! on_pair {
    ($op:literal, $a:expr, $b:expr, ($x:ident, $y:ident) => $e:expr) => {
        match ($a, $b) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu($x), Storage::Cpu($y)) => Storage::Cpu($e),
            #[cfg(feature = "cuda")]
            (Storage::Cuda($x), Storage::Cuda($y)) => Storage::Cuda($e),
            #[cfg(all(feature = "cpu-ref", feature = "cuda"))]
            _ => return Err(mismatch($op)),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            (Storage::None(n), _) => match *n {},
        }
    };
}

/// Like `on_pair` for three storages.
macro_rules! on_triple {
    ($op:literal, $a:expr, $b:expr, $c:expr, ($x:ident, $y:ident, $z:ident) => $e:expr) => {
        match ($a, $b, $c) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu($x), Storage::Cpu($y), Storage::Cpu($z)) => Storage::Cpu($e),
            #[cfg(feature = "cuda")]
            (Storage::Cuda($x), Storage::Cuda($y), Storage::Cuda($z)) => Storage::Cuda($e),
            #[cfg(all(feature = "cpu-ref", feature = "cuda"))]
            _ => return Err(mismatch($op)),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            (Storage::None(n), _, _) => match *n {},
        }
    };
}

/// Applies `$e` to the backend device of `$d`, wrapping the storage it returns.
macro_rules! on_device {
    ($d:expr, $x:ident => $e:expr) => {
        Ok(match $d {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => {
                let $x = crate::backend::cpu::CpuDevice;
                Storage::Cpu($e?)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda($x) => Storage::Cuda($e?),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Device::None(n) => match *n {},
        })
    };
}

/// Where a run computes, as a config names it ("auto", "cuda" or "cpu").
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The first GPU where one answers, else the CPU (for the encoders: the training device).
    Auto,
    /// The first GPU; an error without one.
    Cuda,
    /// The CPU reference backend.
    Cpu,
}

impl Device {
    /// The device a setting names (`train.device`, `encoders.device`, `sample --device`):
    /// "cuda" (GPU 0; an error without one), "cpu", or "auto" and anything else (GPU 0 where
    /// one answers, else the CPU).
    pub fn by_name(name: &str) -> Result<Device> {
        Device::chosen(match name {
            "cuda" => DeviceChoice::Cuda,
            "cpu" => DeviceChoice::Cpu,
            _ => DeviceChoice::Auto,
        })
    }

    /// The device `choice` names: [`DeviceChoice::Cuda`] is GPU 0 (an error without one),
    /// [`DeviceChoice::Auto`] GPU 0 where one answers, else the CPU.
    pub fn chosen(choice: DeviceChoice) -> Result<Device> {
        #[cfg(feature = "cuda")]
        if choice != DeviceChoice::Cpu {
            match Device::cuda(0) {
                Ok(d) => return Ok(d),
                Err(e) if choice == DeviceChoice::Cuda => return Err(e),
                Err(_) => {}
            }
        }
        #[cfg(not(feature = "cuda"))]
        if choice == DeviceChoice::Cuda {
            return Err(crate::Error::CudaUnavailable(
                "device \"cuda\" in a build without the `cuda` feature".into(),
            ));
        }
        Device::cpu_backend()
    }

    /// The CPU reference backend, or an error in a build without it.
    #[cfg(feature = "cpu-ref")]
    pub fn cpu_backend() -> Result<Device> {
        Ok(Device::Cpu)
    }

    /// The CPU reference backend, or an error in a build without it.
    #[cfg(not(feature = "cpu-ref"))]
    pub fn cpu_backend() -> Result<Device> {
        Err(crate::Error::NoBackend("the CPU (the `cpu-ref` feature)"))
    }

    /// The CPU reference backend.
    #[cfg(feature = "cpu-ref")]
    pub fn cpu() -> Device {
        Device::Cpu
    }

    /// GPU `ordinal` (see `cuda::CudaDevice::new` for the errors).
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Ok(Device::Cuda(crate::backend::cuda::CudaDevice::new(
            ordinal,
        )?))
    }

    /// True for a GPU.
    pub fn is_cuda(&self) -> bool {
        match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => false,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => true,
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Device::None(n) => match *n {},
        }
    }

    /// Waits until the work queued on the device's compute stream so far is done (on the
    /// CPU, which queues nothing, at once): a step timed on the host then spans its kernels.
    /// Copies on other streams (a block streamer's uploads ahead) and host threads are not
    /// waited for.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.synchronize(),
            #[allow(unreachable_patterns)]
            _ => Ok(()),
        }
    }

    /// Where the device is, for messages: `"cpu"` or `"cuda:N"`.
    pub fn location(&self) -> String {
        match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => crate::backend::cpu::CpuDevice.location(),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.location(),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Device::None(n) => match *n {},
        }
    }

    /// How many kernel modules this process has loaded on the device and the seconds the
    /// loads took (the driver compiles a module's PTX at its first use on a machine, then
    /// reads its disk cache); `None` on the CPU, which loads none.
    pub fn kernel_loads(&self) -> Option<(usize, f64)> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let loads = d.module_loads();
                Some((loads.len(), loads.iter().map(|(_, s)| s).sum()))
            }
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    pub(crate) fn storage_from_host(&self, data: &CpuStorage) -> Result<Storage> {
        on_device!(self, d => d.storage_from_host(data))
    }

    pub(crate) fn storage_from_bytes(&self, dtype: crate::DType, bytes: &[u8]) -> Result<Storage> {
        on_device!(self, d => d.storage_from_bytes(dtype, bytes))
    }

    pub(crate) fn full(&self, shape: &Shape, dtype: DType, value: f64) -> Result<Storage> {
        on_device!(self, d => d.full(shape, dtype, value))
    }

    /// Storage for an op that writes every element first (see `BackendDevice::uninit`).
    pub(crate) fn uninit(&self, shape: &Shape, dtype: DType) -> Result<Storage> {
        on_device!(self, d => d.uninit(shape, dtype))
    }

    pub(crate) fn rand_uniform(
        &self,
        shape: &Shape,
        dtype: DType,
        lo: f64,
        hi: f64,
        seed: u64,
    ) -> Result<Storage> {
        on_device!(self, d => d.rand_uniform(shape, dtype, lo, hi, seed))
    }

    pub(crate) fn rand_normal(
        &self,
        shape: &Shape,
        dtype: DType,
        mean: f64,
        std: f64,
        seed: u64,
    ) -> Result<Storage> {
        on_device!(self, d => d.rand_normal(shape, dtype, mean, std, seed))
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
        Ok(on_pair!("binary", self, rhs, (a, b) => a.binary(l, b, rl, op)?))
    }
    pub(crate) fn cmp(&self, l: &Layout, rhs: &Storage, rl: &Layout, op: CmpOp) -> Result<Storage> {
        Ok(on_pair!("cmp", self, rhs, (a, b) => a.cmp(l, b, rl, op)?))
    }
    pub(crate) fn where_cond(
        &self,
        l: &Layout,
        t: &Storage,
        tl: &Layout,
        f: &Storage,
        fl: &Layout,
    ) -> Result<Storage> {
        Ok(on_triple!("where_cond", self, t, f, (m, t, f) => m.where_cond(l, t, tl, f, fl)?))
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
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Storage::Cuda(d)) => s.copy_strided(l, d, dst_l),
            #[cfg(all(feature = "cpu-ref", feature = "cuda"))]
            _ => Err(mismatch("copy_strided")),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
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
        Ok(on_pair!("index_select", self, ids, (s, i) => s.index_select(l, i, il, dim)?))
    }
    pub(crate) fn gather(
        &self,
        l: &Layout,
        ids: &Storage,
        il: &Layout,
        dim: usize,
    ) -> Result<Storage> {
        Ok(on_pair!("gather", self, ids, (s, i) => s.gather(l, i, il, dim)?))
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
        Ok(
            on_triple!("scatter_add", self, ids, src, (d, i, s) => d.scatter_add(l, i, il, s, sl, dim)?),
        )
    }
    pub(crate) fn matmul(
        &self,
        l: &Layout,
        rhs: &Storage,
        rl: &Layout,
        dims: MatmulDims,
    ) -> Result<Storage> {
        Ok(on_pair!("matmul", self, rhs, (a, b) => a.matmul(l, b, rl, dims)?))
    }
    pub(crate) fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Storage,
        rl: &Layout,
        dims: MatmulDims,
        bias: &Storage,
        bl: &Layout,
    ) -> Result<Storage> {
        Ok(
            on_triple!("matmul_bias", self, rhs, bias, (a, b, c) => a.matmul_bias(l, b, rl, dims, c, bl)?),
        )
    }
    pub(crate) fn matmul_acc(
        &self,
        l: &Layout,
        rhs: &Storage,
        rl: &Layout,
        dims: MatmulDims,
        bias: Option<(&Storage, &Layout)>,
        acc: &mut Storage,
    ) -> Result<()> {
        match (self, rhs, acc) {
            #[cfg(feature = "cpu-ref")]
            (Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)) => {
                #[allow(unreachable_patterns)]
                let bias = match bias {
                    Some((Storage::Cpu(s), bl)) => Some((s, bl)),
                    None => None,
                    #[cfg(feature = "cuda")]
                    Some(_) => return Err(mismatch("matmul_acc")),
                };
                a.matmul_acc(l, b, rl, dims, bias, c)
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) => {
                #[allow(unreachable_patterns)]
                let bias = match bias {
                    Some((Storage::Cuda(s), bl)) => Some((s, bl)),
                    None => None,
                    #[cfg(feature = "cpu-ref")]
                    Some(_) => return Err(mismatch("matmul_acc")),
                };
                a.matmul_acc(l, b, rl, dims, bias, c)
            }
            #[cfg(all(feature = "cpu-ref", feature = "cuda"))]
            _ => Err(mismatch("matmul_acc")),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            (Storage::None(n), _, _) => match *n {},
        }
    }
    pub(crate) fn unfold2d(&self, l: &Layout, w: crate::backend::Window2d) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.unfold2d(l, w)?))
    }
    pub(crate) fn fold2d(
        &self,
        l: &Layout,
        w: crate::backend::Window2d,
        hw: (usize, usize),
    ) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.fold2d(l, w, hw)?))
    }
    #[cfg(feature = "cpu-ref")]
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn cpu(&self, op: &'static str) -> Result<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(mismatch(op)),
        }
    }
    #[cfg(feature = "cpu-ref")]
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn cpu_mut(&mut self, op: &'static str) -> Result<&mut CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(mismatch(op)),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda_mut(&mut self, op: &'static str) -> Result<&mut crate::backend::cuda::CudaStorage> {
        let _ = op;
        match self {
            Storage::Cuda(s) => Ok(s),
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(_) => Err(mismatch(op)),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda(&self, op: &'static str) -> Result<&crate::backend::cuda::CudaStorage> {
        // `op` names the mismatch, which only a build with both backends can have.
        let _ = op;
        match self {
            Storage::Cuda(s) => Ok(s),
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(_) => Err(mismatch(op)),
        }
    }
    pub(crate) fn norm_last_dim(
        &self,
        l: &Layout,
        kind: crate::backend::NormKind,
        eps: f64,
        weight: Option<&Storage>,
        bias: Option<&Storage>,
    ) -> Result<(Storage, Storage, Storage)> {
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(s) => {
                let w = weight.map(|w| w.cpu("norm")).transpose()?;
                let b = bias.map(|b| b.cpu("norm")).transpose()?;
                let (y, m, r) = s.norm_last_dim(l, kind, eps, w, b)?;
                (Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let w = weight.map(|w| w.cuda("norm")).transpose()?;
                let b = bias.map(|b| b.cuda("norm")).transpose()?;
                let (y, m, r) = s.norm_last_dim(l, kind, eps, w, b)?;
                (Storage::Cuda(y), Storage::Cuda(m), Storage::Cuda(r))
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        })
    }
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_last_dim_backward(
        &self,
        l: &Layout,
        dy: &Storage,
        dyl: &Layout,
        mean: &Storage,
        rstd: &Storage,
        kind: crate::backend::NormKind,
        weight: Option<&Storage>,
    ) -> Result<Storage> {
        const OP: &str = "norm_backward";
        Ok(match self {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(x) => {
                let w = weight.map(|w| w.cpu(OP)).transpose()?;
                Storage::Cpu(x.norm_last_dim_backward(
                    l,
                    dy.cpu(OP)?,
                    dyl,
                    mean.cpu(OP)?,
                    rstd.cpu(OP)?,
                    kind,
                    w,
                )?)
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(x) => {
                let w = weight.map(|w| w.cuda(OP)).transpose()?;
                Storage::Cuda(x.norm_last_dim_backward(
                    l,
                    dy.cuda(OP)?,
                    dyl,
                    mean.cuda(OP)?,
                    rstd.cuda(OP)?,
                    kind,
                    w,
                )?)
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        })
    }
    /// Elements in the buffer.
    pub(crate) fn len(&self) -> usize {
        match self {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.buf.len(),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        }
    }
    /// Fused kernel `k` over operands of one device (see `backend::Kernel`).
    pub(crate) fn kernel(
        k: &dyn crate::backend::Kernel,
        args: &[(&Storage, &Layout)],
    ) -> Result<Vec<Storage>> {
        let Some((first, _)) = args.first() else {
            return Err(crate::Error::invalid(
                k.name(),
                "no operands",
                &Shape::from(()),
            ));
        };
        Ok(match first {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(_) => {
                let a = args
                    .iter()
                    .map(|(s, l)| Ok((s.cpu(k.name())?, *l)))
                    .collect::<Result<Vec<_>>>()?;
                crate::backend::cpu::run_kernel(k, &a)?
                    .into_iter()
                    .map(Storage::Cpu)
                    .collect()
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => {
                let a = args
                    .iter()
                    .map(|(s, l)| Ok((s.cuda(k.name())?, *l)))
                    .collect::<Result<Vec<_>>>()?;
                crate::backend::cuda::run_kernel(k, &a)?
                    .into_iter()
                    .map(Storage::Cuda)
                    .collect()
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        })
    }
    /// A multi-tensor Adam step over storages of one device (`BackendStorage::adam_multi`).
    pub(crate) fn adam_multi(
        h: &crate::backend::multi::AdamHyper,
        items: &mut [crate::backend::multi::AdamItem<'_, Storage>],
        maps: Option<&Storage>,
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "adam_multi";
        let Some(first) = items.first() else {
            return Ok(());
        };
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cpu_mut(OP), |s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            let maps = maps.map(|m| m.cpu(OP)).transpose()?;
            return CpuStorage::adam_multi(h, &mut a, maps);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cuda_mut(OP), |s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            let maps = maps.map(|m| m.cuda(OP)).transpose()?;
            return crate::backend::cuda::CudaStorage::adam_multi(h, &mut a, maps);
        }
        let _ = (h, maps, OP);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A multi-tensor Lion step over storages of one device (`BackendStorage::lion_multi`).
    pub(crate) fn lion_multi(
        h: &crate::backend::lion::LionHyper,
        items: &mut [crate::backend::lion::LionItem<'_, Storage>],
        map: Option<&Storage>,
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "lion_multi";
        let Some(first) = items.first() else {
            return Ok(());
        };
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cpu_mut(OP), |s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            let map = map.map(|m| m.cpu(OP)).transpose()?;
            return CpuStorage::lion_multi(h, &mut a, map);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cuda_mut(OP), |s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            let map = map.map(|m| m.cuda(OP)).transpose()?;
            return crate::backend::cuda::CudaStorage::lion_multi(h, &mut a, map);
        }
        let _ = (h, map, OP);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A multi-tensor Prodigy step over storages of one device
    /// (`BackendStorage::prodigy_multi`).
    pub(crate) fn prodigy_multi(
        h: &crate::backend::multi::ProdigyHyper,
        items: &mut [crate::backend::multi::ProdigyItem<'_, Storage>],
        scalars: &mut Storage,
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "prodigy_multi";
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*scalars {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cpu_mut(OP), |s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::prodigy_multi(h, &mut a, scalars.cpu_mut(OP)?);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*scalars {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cuda_mut(OP), |s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::prodigy_multi(
                h,
                &mut a,
                scalars.cuda_mut(OP)?,
            );
        }
        let _ = (h, items, OP);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A multi-tensor schedule-free call over storages of one device
    /// (`BackendStorage::schedulefree_multi`).
    pub(crate) fn schedulefree_multi(
        op: &crate::backend::multi_sf::SfOp,
        items: &mut [crate::backend::multi_sf::SfItem<'_, Storage>],
        scalars: Option<&mut Storage>,
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "schedulefree_multi";
        let Some(first) = items.first() else {
            return Ok(());
        };
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cpu_mut(OP), |s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            let st = match scalars {
                Some(s) => Some(s.cpu_mut(OP)?),
                None => None,
            };
            return CpuStorage::schedulefree_multi(op, &mut a, st);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cuda_mut(OP), |s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            let st = match scalars {
                Some(s) => Some(s.cuda_mut(OP)?),
                None => None,
            };
            return crate::backend::cuda::CudaStorage::schedulefree_multi(op, &mut a, st);
        }
        let _ = (op, scalars, first, OP);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A multi-tensor Adafactor step over storages of one device
    /// (`BackendStorage::adafactor_multi`).
    pub(crate) fn adafactor_multi(
        h: &crate::backend::adafactor::AdafactorHyper,
        items: &mut [crate::backend::adafactor::AdafactorItem<'_, Storage>],
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "adafactor_multi";
        let Some(first) = items.first() else {
            return Ok(());
        };
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cpu_mut(OP), |s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::adafactor_multi(h, &mut a);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*first.p {
            let mut a = items
                .iter_mut()
                .map(|it| it.map(|s| s.cuda_mut(OP), |s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::adafactor_multi(h, &mut a);
        }
        let _ = (h, first, OP);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A multi-tensor EMA update into `shadow` (`BackendStorage::ema_multi`).
    pub(crate) fn ema_multi(
        k: f32,
        shadow: &mut Storage,
        items: &[crate::backend::multi::MultiRef<'_, Storage>],
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "ema_multi";
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*shadow {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::ema_multi(k, shadow.cpu_mut(OP)?, &a);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*shadow {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::ema_multi(k, shadow.cuda_mut(OP)?, &a);
        }
        let _ = (k, items);
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A grouped copy into a compute dtype (`BackendStorage::cast_multi`).
    pub(crate) fn cast_multi(
        out: &mut Storage,
        items: &[crate::backend::multi::CastItem<'_, Storage>],
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "cast_multi";
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*out {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::cast_multi(out.cpu_mut(OP)?, &a);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*out {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::cast_multi(out.cuda_mut(OP)?, &a);
        }
        let _ = items;
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// A grouped fold of gradients into f32 (`BackendStorage::fold_multi`).
    pub(crate) fn fold_multi(
        out: &mut Storage,
        items: &[crate::backend::multi::FoldItem<'_, Storage>],
    ) -> Result<()> {
        use crate::backend::BackendStorage;
        const OP: &str = "fold_multi";
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = &*out {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::fold_multi(out.cpu_mut(OP)?, &a);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = &*out {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::fold_multi(out.cuda_mut(OP)?, &a);
        }
        let _ = items;
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    /// The sum of squares of many views on one device (`BackendStorage::sum_sq_multi`).
    pub(crate) fn sum_sq_multi(
        items: &[crate::backend::multi::MultiRef<'_, Storage>],
    ) -> Result<f64> {
        use crate::backend::BackendStorage;
        const OP: &str = "sum_sq_multi";
        let Some(first) = items.first() else {
            return Ok(0.0);
        };
        #[cfg(feature = "cpu-ref")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cpu(_) = first.s {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cpu(OP)))
                .collect::<Result<Vec<_>>>()?;
            return CpuStorage::sum_sq_multi(&a);
        }
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Storage::Cuda(_) = first.s {
            let a = items
                .iter()
                .map(|it| it.map(|s| s.cuda(OP)))
                .collect::<Result<Vec<_>>>()?;
            return crate::backend::cuda::CudaStorage::sum_sq_multi(&a);
        }
        Err(crate::Error::invalid(
            OP,
            "internal: storage of no backend",
            &Shape::from(()),
        ))
    }
    pub(crate) fn softmax_last_dim(&self, l: &Layout) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.softmax_last_dim(l)?))
    }
    pub(crate) fn copy_contiguous(&self, l: &Layout) -> Result<Storage> {
        Ok(on_storage!(self, s => wrap s.copy_contiguous(l)?))
    }
    pub(crate) fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        on_storage!(self, s => s.to_host(l))
    }
}

impl Device {
    /// A one-element storage of `dtype`: what a released streamed tensor holds.
    pub(crate) fn placeholder(&self, dtype: DType) -> Result<Storage> {
        on_device!(self, d => d.full(&Shape::from(1), dtype, 0.0))
    }
}

/// A window of work on a GPU's side stream (`Device::side_window`): see the CUDA backend's
/// `SideWindow`. Without the CUDA backend there is none.
pub(crate) struct SideWindow {
    #[cfg(feature = "cuda")]
    inner: crate::backend::cuda::SideWindow,
    #[cfg(not(feature = "cuda"))]
    _none: std::convert::Infallible,
}

impl SideWindow {
    /// Issues `f`'s work on the side stream from this thread.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce() -> R) -> Result<R> {
        #[cfg(feature = "cuda")]
        return self.inner.run(f);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = f;
            match self._none {}
        }
    }

    /// Ends the window: the compute stream waits for its work (the window drops here).
    pub(crate) fn join(self) {}
}

impl Device {
    /// A window of work on this GPU's second compute stream, beside the work other threads
    /// issue on the compute stream (a checkpoint's re-run issued ahead: `autograd::ahead`);
    /// None on the CPU, where the side stream is off, or without a cap's arena.
    pub(crate) fn side_window(&self) -> Result<Option<SideWindow>> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(d.side_window()?.map(|inner| SideWindow { inner })),
            #[allow(unreachable_patterns)]
            _ => Ok(None),
        }
    }
}
