//! Fused LayerNorm / RMSNorm launchers (kernels in cuda/norm.cu): rows held in registers by
//! a group of lanes when they fit (one read, one write), else one warp per row; the optional
//! per-column weight and bias applied inside the kernel (staged in shared memory by the
//! register-resident kernels).

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::NormKind;
use crate::{DType, Error, Layout, Result};

fn rows_cols(op: &'static str, l: &Layout) -> Result<(usize, usize)> {
    match l.dims().last() {
        Some(&c) if c > 0 => Ok((l.elem_count() / c, c)),
        _ => Err(Error::invalid(op, "needs a non-empty last dim", l.shape())),
    }
}

/// The raw address of an optional per-column parameter (null when absent), after checking
/// its dtype and length.
fn param_ptr<T: Elem>(
    p: Option<&CudaStorage>,
    cols: usize,
    op: &'static str,
    l: &Layout,
) -> Result<u64> {
    match p {
        None => Ok(0),
        Some(p) => {
            let b = p.typed::<T>(op)?;
            if b.len() != cols {
                return Err(Error::invalid(
                    op,
                    format!("a weight or bias of {} values for rows of {cols}", b.len()),
                    l.shape(),
                ));
            }
            Ok(p.buf.raw_ptr(p.dev.stream()))
        }
    }
}

type Triple = (CudaStorage, CudaStorage, CudaStorage);

/// Where each row of x starts (cuda/norm.cu `RowMap`): rows indexed by up to three leading
/// dims (d0 = rows / (d1 d2), d1, d2) with strides s0, s1, s2 in elements. The norm kernels
/// read a strided view of rows through it (the head-split q and k of a fused projection)
/// instead of copying it first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowMap {
    d1: u64,
    d2: u64,
    s0: u64,
    s1: u64,
    s2: u64,
}

// SAFETY: a plain #[repr(C)] struct of u64s, laid out as the kernels' `RowMap`.
unsafe impl cudarc::driver::DeviceRepr for RowMap {}

impl RowMap {
    /// Dense rows of `cols` elements.
    pub(crate) fn dense(cols: usize) -> Self {
        RowMap {
            d1: 1,
            d2: 1,
            s0: cols as u64,
            s1: 0,
            s2: 0,
        }
    }

    /// The rows of the view `l` (a unit-stride last dim) as at most three leading dims, each
    /// row starting on a 16-byte boundary (`elem` bytes an element) as the kernels' packed
    /// loads need; None for other views, which are copied first.
    pub(crate) fn of(l: &Layout, elem: usize) -> Option<Self> {
        let (d, st) = (l.dims(), l.strides());
        let (&cols, lead) = d.split_last()?;
        if cols > 1 && st[lead.len()] != 1 {
            return None;
        }
        // Size-1 dims dropped, neighbours merged where the outer steps over the inner whole.
        let (dims, strides) = super::layout::collapse_dims(lead, &st[..lead.len()]);
        if dims.len() > 3 {
            return None;
        }
        let aligned = |x: u64| (x * elem as u64) % 16 == 0;
        if !aligned(l.offset() as u64) || !strides.iter().all(|&s| aligned(s)) {
            return None;
        }
        // Padded in front to three dims, the missing ones of length one.
        let pad = 3 - dims.len();
        let dim = |i: usize| match i.checked_sub(pad) {
            Some(j) => (dims[j], strides[j]),
            None => (1, 0),
        };
        Some(RowMap {
            d1: dim(1).0,
            d2: dim(2).0,
            s0: dim(0).1,
            s1: dim(1).1,
            s2: dim(2).1,
        })
    }
}

/// (packs per lane, lanes per row, rows a group of lanes takes at once) of the
/// register-resident kernels for rows of `cols`: rows of whole 8-element packs, f32 and half
/// types (the instances in cuda/norm.cu). Rows of up to 256 columns share a warp between
/// rows and take 4 rows at once (2 for 512) so that enough loads are in flight; longer rows
/// get a warp each, with up to 12 packs a lane for the half types (3072 columns, Flux's
/// width) and 4 for f32, whose packs take twice the registers.
fn reg_shape(dtype: DType, cols: usize) -> Option<(usize, usize, usize)> {
    if dtype == DType::F64 || cols % 8 != 0 {
        return None;
    }
    let packs = cols / 8;
    if packs <= 32 {
        return Some((1, packs.next_power_of_two().max(4), 4));
    }
    let most = if dtype == DType::F32 { 4 } else { 12 };
    [2, 4, 8, 12]
        .into_iter()
        .find(|&p| p * 32 >= packs && p <= most)
        .map(|p| (p, 32, if p == 2 { 2 } else { 1 }))
}

/// The kernel name and launch shape for `rows` rows of `cols`: register-resident when it
/// fits, otherwise a warp per row streaming the row from cache. `params`: whether a weight or
/// bias is passed, which the register-resident kernels stage in shared memory.
fn pick(
    base: &str,
    sfx: &str,
    dtype: DType,
    (rows, cols): (usize, usize),
    params: bool,
    sms: usize,
) -> (String, cudarc::driver::LaunchConfig) {
    match reg_shape(dtype, cols) {
        Some((packs, lanes, rpt)) => {
            // Blocks of 128 threads: on an H100 they beat 256 at 4608 x 3072 bf16 (91.6% vs
            // 87.6% of copy forward) and at RMSNorm's 110592 x 128 (86.5% vs 84.0%), the
            // tail of the last wave being finer.
            let threads = 128;
            let per_block = threads / lanes * rpt;
            let blocks = rows.div_ceil(per_block).clamp(1, sms.max(1) * 32);
            let smem = if params {
                2 * cols * dtype.size_in_bytes()
            } else {
                0
            };
            (
                format!("{base}_reg_{packs}_{lanes}_{sfx}"),
                cudarc::driver::LaunchConfig {
                    grid_dim: (blocks as u32, 1, 1),
                    block_dim: (threads as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                },
            )
        }
        None => (
            format!("{base}_{sfx}"),
            grid_for(rows.div_ceil(8) * 256, sms),
        ),
    }
}

fn fwd<T: Elem, S: Elem>(
    s: &CudaStorage,
    l: &Layout,
    kind: NormKind,
    eps: f64,
    weight: Option<&CudaStorage>,
    bias: Option<&CudaStorage>,
) -> Result<Triple> {
    let (rows, cols) = rows_cols("norm", l)?;
    let (w, b) = (
        param_ptr::<T>(weight, cols, "norm", l)?,
        param_ptr::<T>(bias, cols, "norm", l)?,
    );
    s.check("norm", l)?;
    let (d, xm, xoff) = match RowMap::of(l, T::DTYPE.size_in_bytes()) {
        Some(m) => (None, m, l.offset()),
        None => (s.dense("norm", l)?, RowMap::dense(cols), 0),
    };
    let x = d.as_ref().unwrap_or(s).typed::<T>("norm")?;
    let xv = x.slice.slice(xoff..);
    let dev = &s.dev;
    let (mut y, mut mean, mut rstd) = (
        dev.alloc::<T>(rows * cols)?,
        dev.alloc::<S>(rows)?,
        dev.alloc::<S>(rows)?,
    );
    let rms = i32::from(kind == NormKind::Rms);
    if rows > 0 {
        let params = weight.is_some() || bias.is_some();
        let (kernel, cfg) = pick(
            "norm_fwd",
            T::SFX,
            T::DTYPE,
            (rows, cols),
            params,
            dev.sm_count(),
        );
        launch!(
            dev,
            "norm",
            kernel,
            cfg,
            &xv,
            &w,
            &b,
            &mut *y.slice,
            &mut *mean.slice,
            &mut *rstd.slice,
            &rows,
            &cols,
            &eps,
            &rms,
            &xm
        )?;
    }
    Ok((
        s.wrap(T::wrap(y)),
        s.wrap(S::wrap(mean)),
        s.wrap(S::wrap(rstd)),
    ))
}

pub(crate) fn norm_last_dim(
    s: &CudaStorage,
    l: &Layout,
    kind: NormKind,
    eps: f64,
    weight: Option<&CudaStorage>,
    bias: Option<&CudaStorage>,
) -> Result<Triple> {
    match s.buf.dtype() {
        DType::F32 => fwd::<f32, f32>(s, l, kind, eps, weight, bias),
        DType::F64 => fwd::<f64, f64>(s, l, kind, eps, weight, bias),
        DType::BF16 => fwd::<half::bf16, f32>(s, l, kind, eps, weight, bias),
        DType::F16 => fwd::<half::f16, f32>(s, l, kind, eps, weight, bias),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm",
            dtype: DType::U32,
        }),
    }
}

/// Operands of the backward: x, dy, mean, rstd and the optional weight.
pub(crate) struct NormGrad<'a> {
    pub x: &'a CudaStorage,
    pub l: &'a Layout,
    pub dy: &'a CudaStorage,
    pub dyl: &'a Layout,
    pub mean: &'a CudaStorage,
    pub rstd: &'a CudaStorage,
    pub weight: Option<&'a CudaStorage>,
}

fn bwd<T: Elem, S: Elem>(o: &NormGrad, kind: NormKind) -> Result<CudaStorage> {
    const OP: &str = "norm_backward";
    crate::backend::validate::same_shape(OP, o.l, o.dyl)?;
    let (rows, cols) = rows_cols(OP, o.l)?;
    let w = param_ptr::<T>(o.weight, cols, OP, o.l)?;
    o.x.check(OP, o.l)?;
    let elem = T::DTYPE.size_in_bytes();
    let (dx_, xm, xoff) = match RowMap::of(o.l, elem) {
        Some(m) => (None, m, o.l.offset()),
        None => (o.x.dense(OP, o.l)?, RowMap::dense(cols), 0),
    };
    let dg_ = o.dy.dense(OP, o.dyl)?;
    let (xs, gs) = (dx_.as_ref().unwrap_or(o.x), dg_.as_ref().unwrap_or(o.dy));
    xs.typed::<T>(OP)?;
    gs.typed::<T>(OP)?;
    let (m, r) = (o.mean.typed::<S>(OP)?, o.rstd.typed::<S>(OP)?);
    if m.len() < rows || r.len() < rows {
        return Err(Error::invalid(
            OP,
            format!("statistics for {} rows, the input has {rows}", m.len()),
            o.l.shape(),
        ));
    }
    let dev = &o.x.dev;
    let mut out = dev.alloc::<T>(rows * cols)?;
    let mut p = [xs, gs, o.mean, o.rstd].map(|b| b.buf.raw_ptr(dev.stream()));
    p[0] += (xoff * elem) as u64;
    launch_bwd::<T>(dev, &p, w, &mut out, (rows, cols), kind, xm)?;
    Ok(o.x.wrap(T::wrap(out)))
}

/// dx of the norm into `out` from raw operands p = [x, dy, mean, rstd] (dy dense; x's rows
/// where `xm` puts them; checked by the caller) and the weight's address w (0: none).
pub(crate) fn launch_bwd<T: Elem>(
    dev: &super::CudaDevice,
    p: &[u64],
    w: u64,
    out: &mut super::memory::DevBuf<T>,
    (rows, cols): (usize, usize),
    kind: NormKind,
    xm: RowMap,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let rms = i32::from(kind == NormKind::Rms);
    let (kernel, cfg) = pick(
        "norm_bwd",
        T::SFX,
        T::DTYPE,
        (rows, cols),
        w != 0,
        dev.sm_count(),
    );
    launch!(
        dev,
        "norm",
        kernel,
        cfg,
        &p[0],
        &p[1],
        &w,
        &p[2],
        &p[3],
        &mut *out.slice,
        &rows,
        &cols,
        &rms,
        &xm
    )
}

/// dx into `out` and the blocks' partial rows of dw and db (returned with their count) by the
/// register-resident backward with column sums (`norm_bwd_sums` in cuda/norm.cu), for the rows
/// it holds (whole packs, up to 3072 columns, f32 up to 1024); None for other rows. Operands
/// as `launch_bwd`.
pub(crate) fn launch_bwd_sums<T: Elem>(
    dev: &super::CudaDevice,
    p: &[u64],
    w: u64,
    out: &mut super::memory::DevBuf<T>,
    (rows, cols): (usize, usize),
    kind: NormKind,
) -> Result<Option<(super::memory::DevBuf<f32>, usize)>> {
    let Some((packs, lanes, rpt)) = reg_shape(T::DTYPE, cols) else {
        return Ok(None);
    };
    // As `pick`: 128 threads, `lanes` a row. After the staged weight, each group of lanes'
    // two sums per column: 2 * packs * lanes float4s each (72 KiB a block at 2048 columns,
    // 108 KiB at 3072, which tensor/kernels/norm.rs sends to the row blocks instead; 8 KiB at 128).
    const THREADS: usize = 128;
    let groups = THREADS / lanes;
    let smem = 2 * cols * T::DTYPE.size_in_bytes() + groups * 2 * (2 * packs * lanes) * 16;
    let kernel = format!("norm_bwd_sums_{packs}_{lanes}_{}", T::SFX);
    super::allow_shared_memory(dev, "norm", &kernel, smem)?;
    let resident = super::resident_blocks(dev, "norm", &kernel, THREADS, smem)?;
    let blocks = rows
        .div_ceil(groups * rpt)
        .clamp(1, dev.sm_count().max(1) * resident);
    let part = dev.alloc::<f32>(blocks * 2 * cols)?;
    let rms = i32::from(kind == NormKind::Rms);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch!(
        dev,
        "norm",
        kernel,
        cfg,
        &p[0],
        &p[1],
        &w,
        &p[2],
        &p[3],
        &mut *out.slice,
        &*part.slice,
        &rows,
        &cols,
        &rms
    )?;
    Ok(Some((part, blocks)))
}

pub(crate) fn norm_last_dim_backward(o: &NormGrad, kind: NormKind) -> Result<CudaStorage> {
    match o.x.buf.dtype() {
        DType::F32 => bwd::<f32, f32>(o, kind),
        DType::F64 => bwd::<f64, f64>(o, kind),
        DType::BF16 => bwd::<half::bf16, f32>(o, kind),
        DType::F16 => bwd::<half::f16, f32>(o, kind),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "norm_backward",
            dtype: DType::U32,
        }),
    }
}

/// dx, dw and db of a norm backward.
type BufTriple<T> = (
    super::memory::DevBuf<T>,
    super::memory::DevBuf<T>,
    super::memory::DevBuf<T>,
);

/// Stage bytes a multiprocessor should have in flight for `launch_bwd_bulk`: on an H100, 96 KiB
/// timed best both at 4608 x 3072 bf16 (two blocks of two 24 KiB stages: 41.2 us against 42.2
/// with three stages, and 41.4 for one block of three 48 KiB stages) and at 110592 x 128 (three
/// blocks of two 16 KiB stages: 39.6 us; two blocks of two: 43.8, of three: 40.5).
const BULK_STAGE_BYTES_PER_SM: usize = 96 << 10;

/// LayerNorm / RMSNorm backward with the weight and bias gradients in one kernel on Hopper
/// (cuda/norm_bulk.cu): the rows come into shared memory by bulk copies, and the blocks' partial
/// column sums are added after a grid-wide barrier, so the kernel is launched cooperatively
/// (all its blocks resident). Returns (dx, dw, db), or None where it does not apply (before
/// compute capability 9, f64, rows not in whole 16-byte packs or past 6144 columns), for the
/// row blocks of tensor/kernels/norm.rs to take.
pub(crate) fn launch_bwd_bulk<T: Elem>(
    dev: &super::CudaDevice,
    p: &[u64],
    w: u64,
    (rows, cols): (usize, usize),
    kind: NormKind,
) -> Result<Option<BufTriple<T>>> {
    let Some(module) = super::hopper_module(dev, "norm_bulk") else {
        return Ok(None);
    };
    // Bulk copies move 16-byte aligned rows of whole 16-byte packs (the weight is read in packs
    // too); buffers from the device's allocator are aligned, which this only makes sure of.
    let aligned = [p[0], p[1], w].iter().all(|a| a % 16 == 0);
    if T::DTYPE == DType::F64 || cols == 0 || cols % 8 != 0 || cols > 6144 || !aligned {
        return Ok(None);
    }
    // As the kernel's comment: P packs a lane, `lw` lanes a row (a power of two below a warp,
    // else whole warps), several rows' groups a block of 256 threads when a row needs fewer.
    let packs = cols / 8;
    let pk = if packs <= 384 { 1 } else { 2 };
    let lanes = packs.div_ceil(pk);
    let lw = if lanes < 32 {
        lanes.next_power_of_two()
    } else {
        lanes.div_ceil(32) * 32
    };
    let groups = (256 / lw).max(1);
    let threads = groups * lw;
    let stage_rows = groups * 2;
    let stage = 2 * stage_rows * cols * T::DTYPE.size_in_bytes();
    let kernel = format!("norm_bwd_bulk_{pk}_{}", T::SFX);
    let smem = |stages: usize| 128 + (stages * stage).max(32 * threads);
    // Blocks a multiprocessor (at most 3) and stages a block: about BULK_STAGE_BYTES_PER_SM
    // of stages, at least two a block, as many blocks as fit beside them.
    let by_regs = super::resident_blocks(dev, module, &kernel, threads, 0)?.min(3);
    let most = dev.max_shared_memory();
    let mut pick = None;
    for per_sm in (1..=by_regs).rev() {
        let stages = (BULK_STAGE_BYTES_PER_SM / per_sm / stage).clamp(2, 8);
        if smem(stages) > most {
            continue;
        }
        super::allow_shared_memory(dev, module, &kernel, smem(stages))?;
        if super::resident_blocks(dev, module, &kernel, threads, smem(stages))? >= per_sm {
            pick = Some((per_sm, stages));
            break;
        }
    }
    let Some((per_sm, stages)) = pick else {
        return Ok(None);
    };
    let blocks = (dev.sm_count().max(1) * per_sm).min(rows.div_ceil(stage_rows).max(1));
    let chunk = rows.div_ceil(blocks).max(1);
    let blocks = rows.div_ceil(chunk).max(1);
    let mut dx = dev.alloc::<T>(rows * cols)?;
    let (mut dw, mut db) = (dev.alloc::<T>(cols)?, dev.alloc::<T>(cols)?);
    let part = dev.alloc::<f32>(blocks * 2 * cols)?;
    let counters = dev.done_counters()?;
    let (lw, stages_i, rms) = (lw as i32, stages as i32, i32::from(kind == NormKind::Rms));
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem(stages) as u32,
    };
    let f = dev.function(module, &kernel)?;
    let mut b = dev.stream().launch_builder(&f);
    {
        use cudarc::driver::PushKernelArg;
        b.arg(&p[0]).arg(&p[1]).arg(&w).arg(&p[2]).arg(&p[3]);
        b.arg(&mut *dx.slice).arg(&*part.slice);
        b.arg(&mut *dw.slice).arg(&mut *db.slice).arg(&counters);
        b.arg(&rows)
            .arg(&cols)
            .arg(&chunk)
            .arg(&lw)
            .arg(&stages_i)
            .arg(&rms);
    }
    // SAFETY: the arguments are norm_bwd_bulk's, in its order and types; x, dy (rows x cols),
    // mean, rstd (rows) and w (cols or null) were checked by the caller, dx, dw, db and part
    // are fresh buffers of the sizes the kernel writes, and the counters are the device's
    // zeroed completion counters, which the kernel leaves at zero. The cooperative launch
    // fails rather than run with blocks that are not all resident (the grid-wide barrier).
    let span = crate::backend::profile::Span::start(dev.stream());
    unsafe { b.launch_cooperative(cfg) }
        .map_err(|e| Error::Cuda(format!("launching {kernel}: {e:?}")))?;
    span.stop(
        dev.stream(),
        crate::backend::profile::category(module, &kernel),
        &kernel,
    );
    Ok(Some((dx, dw, db)))
}

#[cfg(test)]
mod tests {
    use super::RowMap;
    use crate::Layout;

    fn map(d: [u64; 5]) -> Option<RowMap> {
        Some(RowMap {
            d1: d[0],
            d2: d[1],
            s0: d[2],
            s1: d[3],
            s2: d[4],
        })
    }

    #[test]
    fn row_maps_of_views() {
        // Dense (B, N, D): one merged dim of rows.
        let dense = Layout::contiguous((2, 5, 64));
        assert_eq!(RowMap::of(&dense, 2), map([1, 10, 0, 0, 64]));
        // q of a fused projection: (B, N, 3, H, E) narrowed at 0 on dim 2, permuted to
        // (B, H, N, E): three leading dims, none mergeable.
        let qkv = Layout::contiguous(vec![2, 5, 3, 4, 64]);
        let q = qkv.narrow(2, 1, 1).unwrap();
        let q = Layout::new(
            vec![2, 4, 5, 64].into(),
            vec![5 * 3 * 4 * 64, 64, 3 * 4 * 64, 1],
            q.offset(),
        );
        assert_eq!(RowMap::of(&q, 2), map([4, 5, 3840, 64, 768]));
        // Batch 1: the size-1 dim dropped.
        let q1 = Layout::new(vec![1, 4, 5, 64].into(), vec![0, 64, 768, 1], 256);
        assert_eq!(RowMap::of(&q1, 2), map([4, 5, 0, 64, 768]));
        // Rows off a 16-byte boundary, a strided last dim, four unmergeable dims: copied.
        assert_eq!(
            RowMap::of(&Layout::new(vec![3, 8].into(), vec![12, 1], 0), 2),
            None
        );
        assert_eq!(
            RowMap::of(&Layout::new(vec![3, 8].into(), vec![16, 1], 3), 2),
            None
        );
        assert_eq!(
            RowMap::of(&Layout::new(vec![3, 8].into(), vec![1, 3], 0), 2),
            None
        );
        let four = Layout::new(vec![2, 2, 2, 2, 8].into(), vec![1000, 300, 80, 24, 1], 0);
        assert_eq!(RowMap::of(&four, 4), None);
    }
}
