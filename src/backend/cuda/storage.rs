//! CUDA storage and the elementwise launchers. Each launcher checks dtypes, shapes and that
//! views lie inside their buffers, and returns Err before launching.

use super::layout::{elementwise_grid, grid_for, KernelLayout};
use super::memory::DevBuf;
use super::CudaDevice;
use crate::backend::BackendStorage;
use crate::{CpuStorage, DType, Error, Layout, Result};
use cudarc::driver::DeviceRepr;
use half::{bf16, f16};

pub(crate) enum Buf {
    F32(DevBuf<f32>),
    F64(DevBuf<f64>),
    BF16(DevBuf<bf16>),
    F16(DevBuf<f16>),
    U32(DevBuf<u32>),
}

/// An element type of a CUDA buffer: its kernel-name suffix and its place in `Buf`.
pub(crate) trait Elem:
    DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Send + Sync + 'static
{
    const SFX: &'static str;
    const DTYPE: DType;
    fn get(b: &Buf) -> Option<&DevBuf<Self>>;
    fn get_mut(b: &mut Buf) -> Option<&mut DevBuf<Self>>;
    fn wrap(d: DevBuf<Self>) -> Buf;
    fn from_host(s: &CpuStorage) -> Option<&[Self]>;
    fn to_host(v: Vec<Self>) -> CpuStorage;
    fn one() -> Self;
}

macro_rules! elem {
    ($t:ty, $v:ident, $sfx:literal, $one:expr) => {
        impl Elem for $t {
            const SFX: &'static str = $sfx;
            const DTYPE: DType = DType::$v;
            fn get(b: &Buf) -> Option<&DevBuf<Self>> {
                match b {
                    Buf::$v(x) => Some(x),
                    _ => None,
                }
            }
            fn get_mut(b: &mut Buf) -> Option<&mut DevBuf<Self>> {
                match b {
                    Buf::$v(x) => Some(x),
                    _ => None,
                }
            }
            fn wrap(d: DevBuf<Self>) -> Buf {
                Buf::$v(d)
            }
            fn from_host(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(x) => Some(x),
                    _ => None,
                }
            }
            fn to_host(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn one() -> Self {
                $one
            }
        }
    };
}
elem!(f32, F32, "f32", 1.0);
elem!(f64, F64, "f64", 1.0);
elem!(bf16, BF16, "bf16", bf16::ONE);
elem!(f16, F16, "f16", f16::ONE);
elem!(u32, U32, "u32", 1);

/// Calls `$f::<T>(args)` for the element type of `$dtype`; u32 goes to `$u32`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*), u32 => $u32:expr) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::U32 => $u32,
        }
    };
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        by_dtype!($dtype, $f($($arg),*), u32 => $f::<u32>($($arg),*))
    };
}
pub(crate) use by_dtype;

/// Launches `$module/$name` with `$args` (each pushed by reference).
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg;
        let name: &str = &$name;
        let f = $dev.function($module, name)?;
        let mut b = $dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        let span = crate::backend::profile::Span::start($dev.stream());
        // SAFETY: every kernel of cuda/ takes exactly these arguments (pointer, layout, count
        // and scalar types as declared there), and the launcher checked that each view lies
        // inside its buffer and each output holds the elements the kernel writes.
        let r = unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| Error::Cuda(format!("launching {name}: {e:?}")));
        span.stop($dev.stream(), crate::backend::profile::category($module, name), name);
        r
    }};
}
pub(crate) use launch;

impl Buf {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::BF16(_) => DType::BF16,
            Buf::F16(_) => DType::F16,
            Buf::U32(_) => DType::U32,
        }
    }
    /// The raw device address, for kernel arguments that may be null (event tracking is off,
    /// so cudarc's guard has nothing to record).
    pub(crate) fn raw_ptr(&self, stream: &cudarc::driver::CudaStream) -> u64 {
        use cudarc::driver::DevicePtr;
        match self {
            Buf::F32(b) => b.slice.device_ptr(stream).0,
            Buf::F64(b) => b.slice.device_ptr(stream).0,
            Buf::BF16(b) => b.slice.device_ptr(stream).0,
            Buf::F16(b) => b.slice.device_ptr(stream).0,
            Buf::U32(b) => b.slice.device_ptr(stream).0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Buf::F32(b) => b.len(),
            Buf::F64(b) => b.len(),
            Buf::BF16(b) => b.len(),
            Buf::F16(b) => b.len(),
            Buf::U32(b) => b.len(),
        }
    }
}

/// The typed buffer behind a `&mut Buf`.
pub(crate) fn typed_mut<'a, T: Elem>(
    b: &'a mut Buf,
    op: &'static str,
) -> Result<&'a mut DevBuf<T>> {
    let dtype = b.dtype();
    T::get_mut(b).ok_or(Error::DTypeMismatch {
        op,
        lhs: T::DTYPE,
        rhs: dtype,
    })
}

/// A buffer on one GPU.
pub struct CudaStorage {
    pub(crate) buf: Buf,
    pub(crate) dev: CudaDevice,
}

impl CudaStorage {
    /// The kernel layout of `l`, which must lie inside this buffer.
    pub(crate) fn check(&self, op: &'static str, l: &Layout) -> Result<KernelLayout> {
        if l.offset() + l.storage_span() > self.buf.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "view (strides {:?}, offset {}) exceeds its buffer of {} elements",
                    l.strides(),
                    l.offset(),
                    self.buf.len()
                ),
                l.shape(),
            ));
        }
        KernelLayout::new(l, op)
    }

    /// The typed buffer, or a dtype error naming `op`.
    pub(crate) fn typed<T: Elem>(&self, op: &'static str) -> Result<&DevBuf<T>> {
        T::get(&self.buf).ok_or(Error::DTypeMismatch {
            op,
            lhs: T::DTYPE,
            rhs: self.buf.dtype(),
        })
    }

    pub(crate) fn same_device(&self, op: &'static str, other: &CudaStorage) -> Result<()> {
        if self.dev != other.dev {
            return Err(Error::DeviceMismatch {
                op,
                lhs: format!("{:?}", self.dev),
                rhs: format!("{:?}", other.dev),
            });
        }
        Ok(())
    }

    pub(crate) fn wrap(&self, buf: Buf) -> CudaStorage {
        CudaStorage {
            buf,
            dev: self.dev.clone(),
        }
    }

    /// For kernels that take dense operands: None when the view is the whole buffer in order
    /// (use `self`), else a contiguous copy.
    pub(crate) fn dense(&self, op: &'static str, l: &Layout) -> Result<Option<CudaStorage>> {
        self.check(op, l)?;
        if l.is_contiguous() && l.offset() == 0 {
            Ok(None)
        } else {
            Ok(Some(self.contiguous(l)?))
        }
    }

    /// A contiguous copy of the view.
    pub(crate) fn contiguous(&self, l: &Layout) -> Result<CudaStorage> {
        let mut dst = self.dev.alloc_like(self.buf.dtype(), l.elem_count())?;
        self.copy_strided(l, &mut dst, &Layout::contiguous(l.shape().clone()))?;
        Ok(dst)
    }
}

impl CudaDevice {
    /// An uninitialised buffer of `n` elements of `dtype`.
    pub(crate) fn alloc_like(&self, dtype: DType, n: usize) -> Result<CudaStorage> {
        let buf = match dtype {
            DType::F32 => Buf::F32(self.alloc(n)?),
            DType::F64 => Buf::F64(self.alloc(n)?),
            DType::BF16 => Buf::BF16(self.alloc(n)?),
            DType::F16 => Buf::F16(self.alloc(n)?),
            DType::U32 => Buf::U32(self.alloc(n)?),
        };
        Ok(CudaStorage {
            buf,
            dev: self.clone(),
        })
    }
}

pub(super) fn unary_t<T: Elem>(
    s: &CudaStorage,
    l: &Layout,
    name: &str,
    p0: f64,
    p1: f64,
    op: &'static str,
) -> Result<Buf> {
    let kl = s.check(op, l)?;
    let src = s.typed::<T>(op)?;
    let n = l.elem_count();
    let mut out = s.dev.alloc::<T>(n)?;
    if n > 0 {
        launch!(
            s.dev,
            "elementwise",
            format!("{name}_{}", T::SFX),
            elementwise_grid(n, s.dev.sm_count()),
            &*src.slice,
            &kl,
            &mut *out.slice,
            &n,
            &p0,
            &p1
        )?;
    }
    Ok(T::wrap(out))
}

/// Binary ops and comparisons share one kernel signature.
pub(super) fn binary_t<T: Elem>(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    name: &str,
    op: &'static str,
) -> Result<Buf> {
    a.same_device(op, b)?;
    crate::backend::validate::same_shape(op, al, bl)?;
    let (ka, kb) = (a.check(op, al)?, b.check(op, bl)?);
    let (x, y) = (a.typed::<T>(op)?, b.typed::<T>(op)?);
    let n = al.elem_count();
    let mut out = a.dev.alloc::<T>(n)?;
    if n > 0 {
        launch!(
            a.dev,
            "elementwise",
            format!("{name}_{}", T::SFX),
            elementwise_grid(n, a.dev.sm_count()),
            &*x.slice,
            &ka,
            &*y.slice,
            &kb,
            &mut *out.slice,
            &n
        )?;
    }
    Ok(T::wrap(out))
}

pub(super) fn where_t<T: Elem>(
    m: &CudaStorage,
    ml: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    f: &CudaStorage,
    fl: &Layout,
) -> Result<Buf> {
    const OP: &str = "where_cond";
    let (km, kt, kf) = (m.check(OP, ml)?, t.check(OP, tl)?, f.check(OP, fl)?);
    let (mb, tb, fb) = (m.typed::<T>(OP)?, t.typed::<T>(OP)?, f.typed::<T>(OP)?);
    let n = tl.elem_count();
    let mut out = t.dev.alloc::<T>(n)?;
    if n > 0 {
        launch!(
            t.dev,
            "elementwise",
            format!("where_{}", T::SFX),
            grid_for(n, t.dev.sm_count()),
            &*mb.slice,
            &km,
            &*tb.slice,
            &kt,
            &*fb.slice,
            &kf,
            &mut *out.slice,
            &n
        )?;
    }
    Ok(T::wrap(out))
}

fn cast_to<S: Elem, D: Elem>(s: &CudaStorage, l: &Layout) -> Result<Buf> {
    let kl = s.check("cast", l)?;
    let src = s.typed::<S>("cast")?;
    let n = l.elem_count();
    let mut out = s.dev.alloc::<D>(n)?;
    if n > 0 {
        launch!(
            s.dev,
            "elementwise",
            format!("cast_{}_{}", S::SFX, D::SFX),
            elementwise_grid(n, s.dev.sm_count()),
            &*src.slice,
            &kl,
            &mut *out.slice,
            &n
        )?;
    }
    Ok(D::wrap(out))
}

pub(super) fn cast_from<S: Elem>(s: &CudaStorage, l: &Layout, dtype: DType) -> Result<Buf> {
    match dtype {
        DType::F32 => cast_to::<S, f32>(s, l),
        DType::F64 => cast_to::<S, f64>(s, l),
        DType::BF16 => cast_to::<S, bf16>(s, l),
        DType::F16 => cast_to::<S, f16>(s, l),
        DType::U32 => cast_to::<S, u32>(s, l),
    }
}

pub(super) fn copy_t<T: Elem>(
    src: &CudaStorage,
    sl: &Layout,
    dst: &mut CudaStorage,
    dl: &Layout,
) -> Result<()> {
    const OP: &str = "copy_strided";
    let (ks, kd) = (src.check(OP, sl)?, dst.check(OP, dl)?);
    let n = sl.elem_count();
    if n == 0 {
        return Ok(());
    }
    let s = src.typed::<T>(OP)?;
    let dev = dst.dev.clone();
    let d = typed_mut::<T>(&mut dst.buf, OP)?;
    let bits = 8 * std::mem::size_of::<T>();
    launch!(
        dev,
        "elementwise",
        format!("copy_b{bits}"),
        grid_for(n, dev.sm_count()),
        &*s.slice,
        &ks,
        &mut *d.slice,
        &kd,
        &n
    )
}

/// The packs a lane holds (4, 12 or 16; `None`: the streaming kernel) and the launch shape of
/// a softmax (forward or backward) over `rows` rows of `cols`: a warp per row. Rows of whole
/// 16-byte packs that fit stay in registers (f32 only up to 4 packs a lane: its packs take
/// twice the registers), in blocks of 128 threads, which measured faster than 256 on an H100
/// (94% vs 90% of copy at 4608 x 3072 bf16); other rows stream from cache.
pub(crate) fn softmax_kernel(
    dtype: DType,
    rows: usize,
    cols: usize,
    sms: usize,
) -> (Option<usize>, cudarc::driver::LaunchConfig) {
    let most = if dtype == DType::F32 { 4 } else { 16 };
    let packs = (dtype != DType::F64 && cols % 8 == 0)
        .then(|| {
            [4, 12, 16]
                .into_iter()
                .find(|&p| p * 32 * 8 >= cols && p <= most)
        })
        .flatten();
    let threads = if packs.is_some() { 128 } else { 256 };
    let blocks = rows.div_ceil(threads / 32).clamp(1, sms.max(1) * 32);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    (packs, cfg)
}

pub(super) fn softmax_t<T: Elem>(s: &CudaStorage, l: &Layout) -> Result<Buf> {
    let dense = s.dense("softmax", l)?;
    let src = dense.as_ref().unwrap_or(s).typed::<T>("softmax")?;
    let n = l.elem_count();
    let cols = l.dims().last().copied().unwrap_or(1);
    let mut out = s.dev.alloc::<T>(n)?;
    if n > 0 {
        let rows = n / cols;
        let (packs, cfg) = softmax_kernel(T::DTYPE, rows, cols, s.dev.sm_count());
        let kernel = match packs {
            Some(p) => format!("softmax_reg{p}_{}", T::SFX),
            None => format!("softmax_rows_{}", T::SFX),
        };
        launch!(
            s.dev,
            "softmax",
            kernel,
            cfg,
            &*src.slice,
            &mut *out.slice,
            &rows,
            &cols
        )?;
    }
    Ok(T::wrap(out))
}

pub(super) fn to_host_t<T: Elem>(s: &CudaStorage, l: &Layout) -> Result<CpuStorage> {
    s.check("to_host", l)?;
    let n = l.elem_count();
    if !l.is_contiguous() {
        return s
            .contiguous(l)?
            .to_host(&Layout::contiguous(l.shape().clone()));
    }
    let src = s.typed::<T>("to_host")?;
    let view = src.slice.slice(l.offset()..l.offset() + n);
    let v = s
        .dev
        .stream()
        .clone_dtoh(&view)
        .map_err(super::cuda_err("copying to the host"))?;
    Ok(T::to_host(v))
}
