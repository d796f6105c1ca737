//! Launcher of the FP8 decode (`tensor/kernels/dequant_fp8.rs`; kernels in cuda/fp8.cu): a
//! thread per 16 codes with 16-byte loads and stores where rows are whole groups of 16 and the
//! buffers aligned, else a thread per packed word of four E4M3 codes; grid-stride loops.
//! Operands were checked by the kernel's `check` (dtypes, shapes) and made dense by
//! `run_kernel`; the output is a fresh buffer.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::backend::fp8::{Code8, Produce};
use crate::{DType, Error, Result, Shape};
use half::{bf16, f16};

/// [codes (rows, words) u32, scale (rows) f32] (dense; `d` = [rows, cols]) -> [w (rows,
/// cols) in `dtype`].
pub(crate) fn dequant(
    code: Code8,
    dtype: DType,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    match dtype {
        DType::F32 => run::<f32>(code, d, a),
        DType::F64 => run::<f64>(code, d, a),
        DType::BF16 => run::<bf16>(code, d, a),
        DType::F16 => run::<f16>(code, d, a),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "dequant_fp8",
            dtype,
        }),
    }
}

/// The kernels' name stem for `code` (`dequant_fp8*` / `dequant_i8*`, `quant_rows_fp8*` /
/// `quant_rows_i8*`).
fn stem(code: Code8) -> &'static str {
    match code {
        Code8::E4m3 => "fp8",
        Code8::Int8 => "i8",
    }
}

fn run<T: Elem>(code: Code8, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "dequant_fp8";
    let (&[rows, cols], &[codes, scale]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 2",
            d.len(),
            a.len()
        )));
    };
    let words = rows * cols / crate::backend::fp8::CODES_PER_WORD;
    let words_per_row = cols / crate::backend::fp8::CODES_PER_WORD;
    if codes.buf.len() < words || scale.buf.len() < rows {
        return Err(Error::invalid(
            OP,
            format!(
                "operands of {} and {} elements, expected {words} and {rows}",
                codes.buf.len(),
                scale.buf.len()
            ),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &codes.dev;
    let mut w = dev.alloc::<T>(rows * cols)?;
    if words > 0 {
        let ptr = |s: &CudaStorage| s.buf.raw_ptr(dev.stream());
        let (c, s) = (ptr(codes), ptr(scale));
        // Rows of whole 16-code groups from 16-byte aligned codes into an aligned output: a
        // thread per group with 16-byte loads and stores (f64 keeps the word kernel); else a
        // thread per word. Each kernel takes (items per row, items).
        let out = {
            use cudarc::driver::DevicePtr;
            w.slice.device_ptr(dev.stream()).0
        };
        let x16 = T::DTYPE != DType::F64 && cols % 16 == 0 && c % 16 == 0 && out % 16 == 0;
        let (form, per_row, items) = if x16 {
            ("_x16", cols / 16, rows * cols / 16)
        } else {
            ("", words_per_row, words)
        };
        launch!(
            dev,
            "fp8",
            format!("dequant_{}{form}_{}", stem(code), T::SFX),
            grid_for(items, dev.sm_count()),
            &c,
            &s,
            &mut *w.slice,
            &per_row,
            &items
        )?;
    }
    Ok(vec![codes.wrap(T::wrap(w))])
}

/// Chunks of a row each thread of `quant_rows_fp8` keeps in registers between its two passes
/// (`QUANT_HELD` of cuda/fp8.cu).
const QUANT_HELD: usize = 4;

/// The most threads a row of `quant_rows_fp8` takes.
const QUANT_MAX_THREADS: usize = 512;

/// Threads a row and rows a block of `quant_rows_fp8` for rows of `chunks` chunks: enough
/// threads that each holds at most `QUANT_HELD` chunks, a power of two up to 32 (blocks of
/// 256 threads, several rows each) or a multiple of 32 up to 512 (a row a block). Wider rows
/// read their chunks past 4 x 512 twice (the second time from L2): with 1024 threads a row of
/// 21504 bf16 values took 169 us for 4608 rows on an H200, with 512 and a second read 130 us
/// (two blocks an SM in place of one).
fn quant_block(chunks: usize) -> (u32, u32) {
    let need = chunks.div_ceil(QUANT_HELD).max(1);
    if need <= 32 {
        let g = need.next_power_of_two();
        (g as u32, (256 / g) as u32)
    } else {
        (need.next_multiple_of(32).min(QUANT_MAX_THREADS) as u32, 1)
    }
}

/// The form of a row-quantizing kernel of cuda/fp8.cu for rows of `cols` values of `elem`
/// bytes, and its launch: 16-byte chunks where `fits(16)` (every address the kernel forms on
/// 16 bytes), 8-byte chunks of four 2-byte values where `fits(8)`, else four values read one
/// at a time; `quant_block`'s threads and rows a block.
fn quant_launch(
    op: &'static str,
    rows: usize,
    cols: usize,
    elem: usize,
    fits: impl Fn(usize) -> bool,
) -> Result<(&'static str, cudarc::driver::LaunchConfig)> {
    let (form, per_chunk) = if fits(16) {
        ("v16_", 16 / elem)
    } else if elem == 2 && fits(8) {
        ("v8_", 4)
    } else {
        ("", 4)
    };
    let (g, r) = quant_block(cols / per_chunk);
    let blocks = rows.div_ceil(r as usize);
    if blocks > u32::MAX as usize {
        return Err(Error::invalid(
            op,
            "more rows than one launch's grid".to_string(),
            &Shape::from((rows, cols)),
        ));
    }
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (g, r, 1),
        shared_mem_bytes: 0,
    };
    Ok((form, cfg))
}

/// [x (rows, cols) f32/bf16/f16, optional col (cols) f32] (dense; `d` = [rows, cols]) ->
/// [codes (rows, cols / 4) u32, scale (rows) f32] (`quant_rows_fp8*` of cuda/fp8.cu). A row
/// is read in 16-byte chunks where its width and the operands' alignment allow, else 8-byte
/// chunks of four 2-byte values, else element by element; each thread keeps its first chunks
/// in registers, so a row of up to 4 x 512 chunks is read from memory once. On Hopper the
/// kernels of the compute_90 build (`fp8_sm90`) encode with the hardware's conversion.
pub(crate) fn quant_rows(code: Code8, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    quant_rows_with(code, None, d, a)
}

/// [`quant_rows`] with a producer computed first (`quant_rows_*_mod`, `quant_rows_*_gelu`):
/// for `Produce::Modulate` [x (rows, cols), shift, scale (batches, cols)] with `d` = [rows,
/// cols, rows a batch], for `Produce::GeluTanh` [x (rows, cols)] with `d` = [rows, cols]; ->
/// [y (rows, cols) in x's dtype, codes, scale]: the producer's output and its rows' codes.
pub(crate) fn quant_rows_with(
    code: Code8,
    produce: Option<Produce>,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    const OP: &str = "quant_rows_fp8";
    let (rows, cols, per_batch) = match (produce, d) {
        (Some(Produce::Modulate), &[rows, cols, per_batch]) => (rows, cols, per_batch),
        (None | Some(Produce::GeluTanh), &[rows, cols]) => (rows, cols, 1),
        _ => {
            return Err(Error::Cuda(format!(
                "{OP}: {} sizes for {produce:?}",
                d.len()
            )))
        }
    };
    let Some(x) = a.first() else {
        return Err(Error::Cuda(format!("{OP}: no operands")));
    };
    // The column factors (plain quantization), or the modulation's shift and scale.
    let col = a.get(1).filter(|_| produce.is_none());
    let modulation = match (produce, a) {
        (Some(Produce::Modulate), &[_, shift, scale]) => {
            let batches = rows.div_ceil(per_batch.max(1));
            if per_batch == 0
                || shift.buf.len() < batches * cols
                || scale.buf.len() < batches * cols
            {
                return Err(Error::invalid(
                    OP,
                    format!("a modulation of {per_batch} rows a batch and operands too small"),
                    &Shape::from((rows, cols)),
                ));
            }
            Some((shift, scale))
        }
        (Some(Produce::Modulate), _) => {
            return Err(Error::Cuda(format!(
                "{OP}: {} operands for a modulation, expected 3",
                a.len()
            )))
        }
        _ => None,
    };
    if cols % crate::backend::fp8::CODES_PER_WORD != 0 {
        return Err(Error::invalid(
            OP,
            format!("{cols} columns: FP8 rows pack four codes a word"),
            &Shape::from((rows, cols)),
        ));
    }
    if x.buf.len() < rows * cols || col.is_some_and(|c| c.buf.len() < cols) {
        return Err(Error::invalid(
            OP,
            "operands smaller than their shapes".to_string(),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &x.dev;
    let mut codes = dev.alloc::<u32>(rows * cols / crate::backend::fp8::CODES_PER_WORD)?;
    let mut scale = dev.alloc::<f32>(rows)?;
    let y = match produce {
        Some(_) => Some(dev.alloc_like(x.buf.dtype(), rows * cols)?),
        None => None,
    };
    if rows > 0 {
        let sfx = match x.buf.dtype() {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            dtype => return Err(Error::UnsupportedDType { op: OP, dtype }),
        };
        let elem = x.buf.dtype().size_in_bytes();
        let xp = x.buf.raw_ptr(dev.stream());
        let cp = col.map(|c| c.buf.raw_ptr(dev.stream()));
        let mp =
            modulation.map(|(sh, sc)| (sh.buf.raw_ptr(dev.stream()), sc.buf.raw_ptr(dev.stream())));
        let yp = y.as_ref().map(|y| y.buf.raw_ptr(dev.stream()));
        // The factors are read four at a time (16 bytes) by the vector forms; the modulation's
        // rows and the producer's output a chunk at a time, as x.
        let cs16 = cp.is_none_or(|p| p % 16 == 0);
        let aligned = |a: u64| {
            mp.is_none_or(|(sh, sc)| sh % a == 0 && sc % a == 0) && yp.is_none_or(|p| p % a == 0)
        };
        let (form, cfg) = quant_launch(OP, rows, cols, elem, |b| {
            (cols * elem) % b == 0 && xp % b as u64 == 0 && cs16 && aligned(b as u64)
        })?;
        // Hopper gets the compute_90 build, which encodes with the hardware's conversion.
        let module = super::hopper_module(dev, "fp8").unwrap_or("fp8");
        let name = format!("quant_rows_{}_{form}{sfx}", stem(code));
        match (produce, mp, yp) {
            (Some(Produce::Modulate), Some((shp, scp)), Some(yp)) => {
                launch!(
                    dev,
                    module,
                    format!("{name}_mod"),
                    cfg,
                    &xp,
                    &shp,
                    &scp,
                    &per_batch,
                    &yp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &rows,
                    &cols
                )?;
                return finish(x, y, codes, scale);
            }
            (Some(Produce::GeluTanh), None, Some(yp)) => {
                launch!(
                    dev,
                    module,
                    format!("{name}_gelu"),
                    cfg,
                    &xp,
                    &yp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &rows,
                    &cols
                )?;
                return finish(x, y, codes, scale);
            }
            (Some(_), _, _) => {
                return Err(Error::Cuda(format!(
                    "{OP}: a producer without its operands"
                )))
            }
            (None, _, _) => {}
        }
        match cp {
            Some(cp) => {
                launch!(
                    dev,
                    module,
                    format!("quant_rows_{}_{form}{sfx}_cols", stem(code)),
                    cfg,
                    &xp,
                    &cp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &rows,
                    &cols
                )?;
            }
            None => {
                launch!(
                    dev,
                    module,
                    format!("quant_rows_{}_{form}{sfx}", stem(code)),
                    cfg,
                    &xp,
                    &mut *codes.slice,
                    &mut *scale.slice,
                    &rows,
                    &cols
                )?;
            }
        }
    }
    finish(x, y, codes, scale)
}

/// How `quant_rows_*_catgelu` reads a's values (`a_*` of cuda/fp8.cu's `Producer`): row r =
/// (b, l) at `seq` rows a batch, its values heads of `hd` at strides `sb`, `sl`, `sh`.
struct HeadsView {
    ptr: u64,
    sb: usize,
    sl: usize,
    sh: usize,
    seq: usize,
    hd: usize,
}

impl HeadsView {
    /// Every address the kernel forms, in elements from `ptr`, on `b` bytes.
    fn aligned(&self, elem: usize, b: usize) -> bool {
        self.ptr % b as u64 == 0
            && [self.sb, self.sl, self.sh, self.hd]
                .iter()
                .all(|n| (n * elem) % b == 0)
    }
}

/// Operand a of the concatenation in place: a (rows, split) matrix whose rows are unit-stride,
/// or (B, L, H, D) heads unit-stride within a head (attention's (B, H, L, D) output
/// transposed); else a dense (rows, split) copy kept alive in `copies`.
fn heads_view(
    op: &'static str,
    s: &CudaStorage,
    l: &crate::Layout,
    rows: usize,
    split: usize,
    copies: &mut Vec<CudaStorage>,
) -> Result<HeadsView> {
    s.check(op, l)?;
    let elem = s.buf.dtype().size_in_bytes() as u64;
    let at = s.buf.raw_ptr(s.dev.stream()) + l.offset() as u64 * elem;
    match (l.dims(), l.strides()) {
        (&[r, c], &[sr, sc]) if sc == 1 || c <= 1 => {
            return Ok(HeadsView {
                ptr: at,
                sb: 0,
                sl: if r <= 1 { c } else { sr },
                sh: 0,
                seq: r.max(1),
                hd: c.max(1),
            })
        }
        (&[_, seq, _, hd], &[sb, sl, sh, 1]) => {
            return Ok(HeadsView {
                ptr: at,
                sb,
                sl,
                sh,
                seq: seq.max(1),
                hd: hd.max(1),
            })
        }
        _ => {}
    }
    let c = s.contiguous(l)?;
    let p = c.buf.raw_ptr(c.dev.stream());
    copies.push(c);
    Ok(HeadsView {
        ptr: p,
        sb: 0,
        sl: split,
        sh: 0,
        seq: rows.max(1),
        hd: split.max(1),
    })
}

/// [a, x] -> [y = [a, gelu_tanh(x)] (rows, cols)] and, with a code, [codes, scale] of y's
/// rows (`quant_rows_*_catgelu` of cuda/fp8.cu; `d` = [rows, cols, split]): a (rows, split)
/// or (B, L, H, D) heads (`heads_view`), x (rows, cols - split) read at its row pitch, or no
/// x (cols = split: a's rows written densely, attention's heads merged). Split and head
/// widths multiples of 4. In the forms `quant_rows_with` picks: 16-byte chunks where every
/// address the kernel forms is 16-byte aligned, 8-byte chunks, else element by element.
pub(crate) fn cat_gelu_rows(
    code: Option<Code8>,
    d: &[usize],
    a: &[(&CudaStorage, &crate::Layout)],
) -> Result<Vec<CudaStorage>> {
    const OP: &str = "cat_gelu_tanh";
    let (&[rows, cols, split], Some(&(sa, la))) = (d, a.first()) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 3 and 1 or 2",
            d.len(),
            a.len()
        )));
    };
    let x = a.get(1).copied();
    let shape = || Shape::from((rows, cols));
    if split > cols
        || split % crate::backend::fp8::CODES_PER_WORD != 0
        || cols % 4 != 0
        || (x.is_none() && split != cols)
    {
        return Err(Error::invalid(
            OP,
            format!("a split at {split} of rows of {cols}: both multiples of 4"),
            &shape(),
        ));
    }
    let dtype = sa.buf.dtype();
    if let Some((sx, _)) = x {
        sa.same_device(OP, sx)?;
        if sx.buf.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: dtype,
                rhs: sx.buf.dtype(),
            });
        }
    }
    let sfx = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dtype => return Err(Error::UnsupportedDType { op: OP, dtype }),
    };
    let dev = &sa.dev;
    let y = dev.alloc_like(dtype, rows * cols)?;
    let codes = match code {
        Some(_) => Some((
            dev.alloc::<u32>(rows * cols / crate::backend::fp8::CODES_PER_WORD)?,
            dev.alloc::<f32>(rows)?,
        )),
        None => None,
    };
    if rows > 0 && cols > 0 {
        let mut copies = vec![];
        let av = heads_view(OP, sa, la, rows, split, &mut copies)?;
        let (xp, x_pitch) = match x {
            Some((sx, lx)) => {
                let v = heads_view(OP, sx, lx, rows, cols - split, &mut copies)?;
                (v.ptr, v.sl)
            }
            // Nothing of x is read: its rows are a's, at no pitch.
            None => (av.ptr, 0),
        };
        let yp = y.buf.raw_ptr(dev.stream());
        let elem = dtype.size_in_bytes();
        // Every chunk lies in one head of a or in x: the heads, the split and each row's start
        // on the chunk's bytes.
        let fits = |b: usize| {
            av.aligned(elem, b)
                && [xp, yp].iter().all(|p| p % b as u64 == 0)
                && [x_pitch, split, cols].iter().all(|n| (n * elem) % b == 0)
        };
        if av.hd % 4 != 0 {
            return Err(Error::invalid(
                OP,
                format!("heads of {} values: a multiple of 4", av.hd),
                &shape(),
            ));
        }
        let (form, cfg) = quant_launch(OP, rows, cols, elem, fits)?;
        let module = super::hopper_module(dev, "fp8").unwrap_or("fp8");
        let (cp, scp) = match &codes {
            Some((c, s)) => {
                use cudarc::driver::DevicePtr;
                (
                    c.slice.device_ptr(dev.stream()).0,
                    s.slice.device_ptr(dev.stream()).0,
                )
            }
            None => (0, 0),
        };
        launch!(
            dev,
            module,
            format!(
                "quant_rows_{}_{form}{sfx}_catgelu",
                stem(code.unwrap_or(Code8::E4m3))
            ),
            cfg,
            &av.ptr,
            &av.sb,
            &av.sl,
            &av.sh,
            &av.seq,
            &av.hd,
            &xp,
            &x_pitch,
            &split,
            &yp,
            &cp,
            &scp,
            &rows,
            &cols
        )?;
        // The copies' buffers go back to the pool on this stream, after the launch.
        drop(copies);
    }
    match codes {
        Some((c, s)) => finish(sa, Some(y), c, s),
        None => Ok(vec![y]),
    }
}

/// The outputs of a quantizing pass: the producer's output where there is one, the codes and
/// the scales.
fn finish(
    x: &CudaStorage,
    y: Option<CudaStorage>,
    codes: super::memory::DevBuf<u32>,
    scale: super::memory::DevBuf<f32>,
) -> Result<Vec<CudaStorage>> {
    Ok(y.into_iter()
        .chain([x.wrap(u32::wrap(codes)), x.wrap(f32::wrap(scale))])
        .collect())
}

/// [x (rows, cols) f32/bf16/f16] (dense; `d` = [rows, cols]) -> [x with each block of `block`
/// values of a row rotated by the normalized Hadamard matrix] (`hadamard_rows_*` of
/// cuda/fp8.cu): 128 threads a CUDA block, one block of values at a time.
pub(crate) fn hadamard_rows(
    block: usize,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    match a.first().map(|x| x.buf.dtype()) {
        Some(DType::F32) => rotate::<f32>(block, d, a),
        Some(DType::BF16) => rotate::<bf16>(block, d, a),
        Some(DType::F16) => rotate::<f16>(block, d, a),
        Some(dtype) => Err(Error::UnsupportedDType {
            op: "hadamard_rows",
            dtype,
        }),
        None => Err(Error::Cuda("hadamard_rows: no operand".into())),
    }
}

fn rotate<T: Elem>(block: usize, d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "hadamard_rows";
    let (&[rows, cols], &[x]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 1",
            d.len(),
            a.len()
        )));
    };
    if block == 0 || block > 256 || !block.is_power_of_two() || cols % block != 0 {
        return Err(Error::invalid(
            OP,
            format!("a block of {block} over rows of {cols}"),
            &Shape::from((rows, cols)),
        ));
    }
    if x.buf.len() < rows * cols {
        return Err(Error::invalid(
            OP,
            "an operand smaller than its shape".to_string(),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &x.dev;
    let mut y = dev.alloc::<T>(rows * cols)?;
    let blocks = rows * (cols / block);
    if blocks > 0 {
        let xp = x.buf.raw_ptr(dev.stream());
        let (b, scale) = (block as u32, crate::backend::int8::rotation_scale(block));
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (blocks.min(dev.sm_count() * 16) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            "fp8",
            format!("hadamard_rows_{}", T::SFX),
            cfg,
            &xp,
            &mut *y.slice,
            &rows,
            &cols,
            &b,
            &scale
        )?;
    }
    Ok(vec![x.wrap(T::wrap(y))])
}

/// [codes (rows, cols / 4) u32] (dense; `d` = [rows, cols]) -> [codes (cols, rows / 4)]: a
/// block a 64 x 64 byte tile (`transpose_fp8` of cuda/fp8.cu).
pub(crate) fn transpose(d: &[usize], a: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    const OP: &str = "transpose_fp8";
    let (&[rows, cols], &[codes]) = (d, a) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 2 and 1",
            d.len(),
            a.len()
        )));
    };
    let words = rows * cols / crate::backend::fp8::CODES_PER_WORD;
    if codes.buf.len() < words {
        return Err(Error::invalid(
            OP,
            format!("{} words, expected {words}", codes.buf.len()),
            &Shape::from((rows, cols)),
        ));
    }
    let dev = &codes.dev;
    let mut out = dev.alloc::<u32>(words)?;
    if words > 0 {
        let (gx, gy) = (cols.div_ceil(64), rows.div_ceil(64));
        if gx > u32::MAX as usize || gy > 65_535 {
            return Err(Error::invalid(
                OP,
                "a matrix larger than one launch's grid".to_string(),
                &Shape::from((rows, cols)),
            ));
        }
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let src = codes.buf.raw_ptr(dev.stream());
        launch!(
            dev,
            "fp8",
            "transpose_fp8",
            cfg,
            &src,
            &mut *out.slice,
            &rows,
            &cols
        )?;
    }
    Ok(vec![codes.wrap(u32::wrap(out))])
}
