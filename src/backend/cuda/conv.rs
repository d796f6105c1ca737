//! unfold2d / fold2d launchers (kernels in cuda/conv.cu). Convolutions are im2col + cuBLAS
//! GEMM above the backend: one code path that runs at cuBLAS speed, at the cost of a column
//! buffer kh*kw times the input (for SDXL's 3x3 convs at 128x128, 9x 21 MB in bf16).

use super::storage::{launch, Buf, CudaStorage, Elem};
use crate::backend::Window2d;
use crate::{DType, Error, Layout, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// `ConvGeometry` of cuda/conv.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvGeometry {
    planes: u64,
    h: u64,
    w: u64,
    kh: u64,
    kw: u64,
    sh: u64,
    sw: u64,
    ph: u64,
    pw: u64,
    dh: u64,
    dw: u64,
    ho: u64,
    wo: u64,
}
// SAFETY: repr(C) of u64s, as the kernel's struct.
unsafe impl DeviceRepr for ConvGeometry {}

fn geometry(
    planes: usize,
    (h, w): (usize, usize),
    win: Window2d,
    op: &'static str,
    l: &Layout,
) -> Result<ConvGeometry> {
    let (ho, wo) = win
        .out_size(h, w)
        .ok_or_else(|| Error::invalid(op, format!("window {win:?} does not fit"), l.shape()))?;
    let u = |v: usize| v as u64;
    Ok(ConvGeometry {
        planes: u(planes),
        h: u(h),
        w: u(w),
        kh: u(win.kernel.0),
        kw: u(win.kernel.1),
        sh: u(win.stride.0),
        sw: u(win.stride.1),
        ph: u(win.padding.0),
        pw: u(win.padding.1),
        dh: u(win.dilation.0),
        dw: u(win.dilation.1),
        ho: u(ho),
        wo: u(wo),
    })
}

/// Runs im2col (grid.y over column rows, grid.x over Ho*Wo) or col2im (grid.y over planes,
/// grid.x over H*W): `outer` rows of `inner` elements, each thread looping over its share.
fn run<T: Elem>(
    s: &CudaStorage,
    l: &Layout,
    kernel: &str,
    g: ConvGeometry,
    (outer, inner): (usize, usize),
) -> Result<Buf> {
    let d = s.dense("conv", l)?;
    let src = d.as_ref().unwrap_or(s).typed::<T>(kernel_op(kernel))?;
    let out_len = outer * inner;
    let mut out = s.dev.alloc::<T>(out_len)?;
    // 32-bit index math unless a buffer reaches 2^31 elements.
    let cols_len = g.planes * g.kh * g.kw * g.ho * g.wo;
    let wide = i32::from(cols_len.max(g.planes * g.h * g.w) >= 1 << 31);
    if out_len > 0 {
        let y = outer.min(65535);
        // im2col writes eight columns a thread when rows are whole packs.
        // col2im gets a thread per pixel: its taps are dependent loads, so it needs every
        // thread the GPU can hold in flight (measured on an H100: 0.29 ms with 4-5 pixels
        // a thread at SDXL's 320x128x128, batch 2).
        let x = if kernel == "im2col" {
            let per_thread = if inner % 8 == 0 { 8 } else { 1 };
            inner
                .div_ceil(256 * per_thread)
                .min((s.dev.sm_count().max(1) * 64).div_ceil(y))
        } else {
            inner.div_ceil(256).min(65535)
        }
        .max(1);
        let cfg = LaunchConfig {
            grid_dim: (x as u32, y as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            s.dev,
            "conv",
            format!("{kernel}_{}", T::SFX),
            cfg,
            &*src.slice,
            &mut *out.slice,
            &g,
            &wide
        )?;
    }
    Ok(T::wrap(out))
}

fn kernel_op(kernel: &str) -> &'static str {
    if kernel == "im2col" {
        "unfold2d"
    } else {
        "fold2d"
    }
}

macro_rules! by_float {
    ($dtype:expr, $op:literal, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::U32 => Err(Error::UnsupportedDType { op: $op, dtype: DType::U32 }),
        }
    };
}

pub(crate) fn unfold2d(s: &CudaStorage, l: &Layout, win: Window2d) -> Result<CudaStorage> {
    s.check("unfold2d", l)?;
    let (n, c, h, w) = match l.dims() {
        &[n, c, h, w] => (n, c, h, w),
        _ => {
            return Err(Error::invalid(
                "unfold2d",
                "needs an (N, C, H, W) tensor",
                l.shape(),
            ))
        }
    };
    let g = geometry(n * c, (h, w), win, "unfold2d", l)?;
    let rows = n * c * win.kernel.0 * win.kernel.1;
    let shape = (rows, (g.ho * g.wo) as usize);
    let buf = by_float!(s.buf.dtype(), "unfold2d", run(s, l, "im2col", g, shape))?;
    Ok(s.wrap(buf))
}

pub(crate) fn fold2d(
    s: &CudaStorage,
    l: &Layout,
    win: Window2d,
    (h, w): (usize, usize),
) -> Result<CudaStorage> {
    s.check("fold2d", l)?;
    let (kh, kw) = win.kernel;
    let d = l.dims();
    let g0 = geometry(1, (h, w), win, "fold2d", l)?;
    let cols = (g0.ho * g0.wo) as usize;
    if d.len() != 3 || d[2] != cols || kh * kw == 0 || d[1] % (kh * kw) != 0 {
        return Err(Error::invalid(
            "fold2d",
            format!("columns must be (N, C * {kh} * {kw}, {cols})"),
            l.shape(),
        ));
    }
    let planes = d[0] * d[1] / (kh * kw);
    let g = geometry(planes, (h, w), win, "fold2d", l)?;
    let buf = by_float!(
        s.buf.dtype(),
        "fold2d",
        run(s, l, "col2im", g, (planes, h * w))
    )?;
    Ok(s.wrap(buf))
}
