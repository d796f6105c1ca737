//! Batched matmul through cuBLAS (strided batched GEMM; bf16/f16 accumulate in f32).
//!
//! FLAME is row-major, cuBLAS column-major: C = A B (row-major, M x N) is computed as
//! C^T = B^T A^T in cuBLAS terms, i.e. gemm(m = N, n = M, k = K, A' = B's memory,
//! B' = A's memory). A row-major operand (unit column stride) is already the transpose cuBLAS
//! wants ("N"); a transposed view (unit row stride) is passed with "T". Either way no copy is
//! made; only a view with neither unit stride is copied first.

use super::storage::{CudaStorage, Elem};
use crate::backend::MatmulDims;
use crate::{DType, Error, Layout, Result};
use cudarc::cublas::sys::cublasOperation_t as Trans;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use half::{bf16, f16};

/// How a rows x cols matrix with strides (rs, cs) is stored, with its leading dimension.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mat {
    RowMajor(usize),
    ColMajor(usize),
}

fn storage_of(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<Mat> {
    if (cols == 1 || cs == 1) && (rows == 1 || rs >= cols.max(1)) {
        return Some(Mat::RowMajor(if rows == 1 { cols.max(1) } else { rs }));
    }
    if (rows == 1 || rs == 1) && (cols == 1 || cs >= rows.max(1)) {
        return Some(Mat::ColMajor(if cols == 1 { rows.max(1) } else { cs }));
    }
    None
}

/// The operand as (storage, layout) cuBLAS can read, copying only when needed.
fn operand(s: &CudaStorage, l: &Layout) -> Result<(Option<CudaStorage>, Layout, Mat)> {
    let (d, st) = (l.dims(), l.strides());
    if let Some(m) = storage_of(d[1], d[2], st[1], st[2]) {
        return Ok((None, l.clone(), m));
    }
    let c = s.contiguous(l)?;
    let cl = Layout::contiguous(l.shape().clone());
    Ok((Some(c), cl, Mat::RowMajor(d[2].max(1))))
}

fn as_i32(v: usize, what: &str, l: &Layout) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(
            "matmul",
            format!("{what} = {v} exceeds cuBLAS's int range"),
            l.shape(),
        )
    })
}

/// cuBLAS's view of C = A B: (transa, lda) of A' = B's memory and (transb, ldb) of
/// B' = A's memory (see the module comment).
fn trans_of(m: Mat) -> (Trans, usize) {
    match m {
        Mat::RowMajor(ld) => (Trans::CUBLAS_OP_N, ld),
        Mat::ColMajor(ld) => (Trans::CUBLAS_OP_T, ld),
    }
}

/// `out = a @ b + beta * out` over the B batches into `out` (at least B*M*N elements,
/// contiguous (B, M, N)); beta is 0 (out's values unread) or 1 (accumulate).
fn gemm_into<T: Elem>(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
    out: &mut super::memory::DevBuf<T>,
    accumulate: bool,
) -> Result<()>
where
    CudaBlas: Gemm<T>,
{
    const OP: &str = "matmul";
    a.check(OP, al)?;
    b.check(OP, bl)?;
    let dev = &a.dev;
    if d.b * d.m * d.n == 0 {
        return Ok(());
    }
    if d.k == 0 {
        // An empty sum: zeros, or nothing to add.
        if !accumulate {
            dev.stream()
                .memset_zeros(&mut *out.slice)
                .map_err(super::cuda_err("zeroing"))?;
        }
        return Ok(());
    }
    let (ac, al, am) = operand(a, al)?;
    let (bc, bl, bm) = operand(b, bl)?;
    let (a, b) = (ac.as_ref().unwrap_or(a), bc.as_ref().unwrap_or(b));
    let (ab, bb) = (a.typed::<T>(OP)?, b.typed::<T>(OP)?);
    let (transa, lda) = trans_of(bm);
    let (transb, ldb) = trans_of(am);
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa,
            transb,
            m: as_i32(d.n, "N", &bl)?,
            n: as_i32(d.m, "M", &al)?,
            k: as_i32(d.k, "K", &al)?,
            alpha: T::one(),
            lda: as_i32(lda, "lda", &bl)?,
            ldb: as_i32(ldb, "ldb", &al)?,
            beta: if accumulate { T::one() } else { T::default() },
            ldc: as_i32(d.n, "N", &bl)?,
        },
        batch_size: as_i32(d.b, "batch", &al)?,
        stride_a: bl.strides()[0] as i64,
        stride_b: al.strides()[0] as i64,
        stride_c: (d.m * d.n) as i64,
    };
    let av = ab.slice.slice(al.offset()..);
    let bv = bb.slice.slice(bl.offset()..);
    // SAFETY: check() proved both views lie inside their buffers; the leading dimensions and
    // batch strides are the views' own strides, so cuBLAS reads only those elements, and
    // `out` holds B*M*N elements (checked by the callers).
    let span = crate::backend::profile::Span::start(dev.stream());
    unsafe {
        dev.blas()
            .gemm_strided_batched(cfg, &bv, &av, &mut *out.slice)
    }
    .map_err(|e| Error::Cuda(format!("cuBLAS gemm {d:?}: {e:?}")))?;
    span.stop(dev.stream(), "gemm", "cublas_gemm");
    Ok(())
}

fn gemm_t<T: Elem>(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
) -> Result<CudaStorage>
where
    CudaBlas: Gemm<T>,
{
    let mut out = a.dev.alloc::<T>(d.b * d.m * d.n)?;
    gemm_into(a, al, b, bl, d, &mut out, false)?;
    Ok(a.wrap(T::wrap(out)))
}

/// `a @ b + bias` by cuBLASLt with its bias epilogue, for bf16 / f16 (f32 stays on cuBLAS,
/// whose f32 GEMMs are exact unless TF32 is allowed), the GEMM's descriptor and algorithm
/// kept per shape (`lt.rs`). None where it does not apply: the caller takes the matmul and an
/// add.
fn gemm_bias_lt<T: Elem>(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
    bias: &CudaStorage,
    biasl: &Layout,
) -> Result<Option<CudaStorage>> {
    if !epilogue_takes::<T>(d, bias, biasl) {
        return Ok(None);
    }
    let dev = &a.dev;
    let mut out = dev.alloc::<T>(d.b * d.m * d.n)?;
    let queued = gemm_bias_into::<T>(a, al, b, bl, d, bias, biasl, &mut out, false)?;
    Ok(queued.then(|| a.wrap(T::wrap(out))))
}

/// Whether cuBLASLt's bias epilogue may take a product of `d` with `bias`: a unit-stride (N)
/// bias of the operands' type, a product with terms and outputs.
fn epilogue_takes<T: Elem>(d: MatmulDims, bias: &CudaStorage, biasl: &Layout) -> bool {
    let unit = biasl.dims() == [d.n] && (d.n == 1 || biasl.strides() == [1]);
    unit && d.k > 0 && d.b * d.m * d.n > 0 && bias.typed::<T>("matmul_bias").is_ok()
}

/// `out = a @ b + bias` (`out +=` where `accumulate`) as one cuBLASLt GEMM with the bias in
/// its epilogue, `out` holding the contiguous (B, M, N) values; false where cuBLASLt takes no
/// such GEMM (the bias not a unit-stride (N) vector, no algorithm, the operands' alignment),
/// nothing queued.
#[allow(clippy::too_many_arguments)]
fn gemm_bias_into<T: Elem>(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
    bias: &CudaStorage,
    biasl: &Layout,
    out: &mut super::memory::DevBuf<T>,
    accumulate: bool,
) -> Result<bool> {
    const OP: &str = "matmul_bias";
    a.check(OP, al)?;
    b.check(OP, bl)?;
    bias.check(OP, biasl)?;
    if !epilogue_takes::<T>(d, bias, biasl) {
        return Ok(false);
    }
    if out.slice.len() < d.b * d.m * d.n {
        return Err(Error::invalid(
            OP,
            format!("an output of {} values", out.slice.len()),
            al.shape(),
        ));
    }
    let (ac, al, am) = operand(a, al)?;
    let (bc, bl, bm) = operand(b, bl)?;
    let (a, b) = (ac.as_ref().unwrap_or(a), bc.as_ref().unwrap_or(b));
    let (ab, bb, biasb) = (a.typed::<T>(OP)?, b.typed::<T>(OP)?, bias.typed::<T>(OP)?);
    let (transa, lda) = trans_of(bm);
    let (transb, ldb) = trans_of(am);
    // Column-major: C^T (n, m) = op(b)^T op(a)^T, cuBLASLt's A being b and its B a.
    let g = super::lt::BiasGemm {
        transa: transa == Trans::CUBLAS_OP_T,
        transb: transb == Trans::CUBLAS_OP_T,
        m: d.n as u64,
        n: d.m as u64,
        k: d.k as u64,
        lda: lda as i64,
        ldb: ldb as i64,
        ldc: d.n as i64,
        batch: (d.b > 1).then(|| {
            (
                d.b as i32,
                bl.strides()[0] as i64,
                al.strides()[0] as i64,
                (d.m * d.n) as i64,
            )
        }),
        accumulate,
    };
    let dev = &a.dev;
    let lt = dev.lt()?;
    let stream = dev.stream();
    let at = |s: &super::memory::DevBuf<T>, offset: usize| {
        use cudarc::driver::DevicePtr;
        s.slice.device_ptr(stream).0 + (offset * std::mem::size_of::<T>()) as u64
    };
    let ptrs = [
        at(bb, bl.offset()),
        at(ab, al.offset()),
        at(out, 0),
        at(biasb, biasl.offset()),
    ];
    let span = crate::backend::profile::Span::start(stream);
    // SAFETY: check() proved both views lie inside their buffers; the leading dimensions and
    // batch strides are the views' own strides, so cuBLASLt reads only those elements; `out`
    // holds B*M*N elements; the bias view holds N unit-stride elements (checked above); all
    // are queued on the device's stream, which `lt` belongs to.
    let queued = unsafe { super::lt::gemm_bias(lt, stream, dev.ordinal(), T::DTYPE, g, ptrs) }?;
    span.stop(stream, "gemm", "cublaslt_gemm_bias");
    Ok(queued)
}

fn check_pair(
    op: &'static str,
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
) -> Result<()> {
    a.same_device(op, b)?;
    if al.dims() != [d.b, d.m, d.k] || bl.dims() != [d.b, d.k, d.n] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: al.shape().clone(),
            rhs: bl.shape().clone(),
        });
    }
    if a.buf.dtype() != b.buf.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.buf.dtype(),
            rhs: b.buf.dtype(),
        });
    }
    Ok(())
}

/// `a @ b + bias` (bias (N) on every row): one cuBLASLt GEMM with its bias epilogue for
/// bf16 / f16, else the matmul and a broadcast add.
pub(crate) fn matmul_bias(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
    bias: &CudaStorage,
    biasl: &Layout,
) -> Result<CudaStorage> {
    check_pair("matmul_bias", a, al, b, bl, d)?;
    bias.same_device("matmul_bias", a)?;
    let fused = match a.buf.dtype() {
        DType::BF16 => gemm_bias_lt::<bf16>(a, al, b, bl, d, bias, biasl)?,
        DType::F16 => gemm_bias_lt::<f16>(a, al, b, bl, d, bias, biasl)?,
        _ => None,
    };
    if let Some(out) = fused {
        return Ok(out);
    }
    use crate::backend::{BackendStorage, BinaryOp};
    let out = matmul(a, al, b, bl, d)?;
    let shape = crate::Shape::from(vec![d.b, d.m, d.n]);
    let ol = Layout::contiguous(shape.clone());
    out.binary(&ol, bias, &biasl.broadcast_as(&shape)?, BinaryOp::Add)
}

/// `acc += a @ b [+ bias]`: one GEMM with beta = 1 into `acc` (contiguous (B, M, N) values),
/// the bias (N) in cuBLASLt's epilogue where it takes the GEMM (bf16 and f16), else added
/// after.
pub(crate) fn matmul_acc(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
    bias: Option<(&CudaStorage, &Layout)>,
    acc: &mut CudaStorage,
) -> Result<()> {
    check_pair("matmul_acc", a, al, b, bl, d)?;
    acc.same_device("matmul_acc", a)?;
    if acc.buf.len() < d.b * d.m * d.n || acc.buf.dtype() != a.buf.dtype() {
        return Err(Error::invalid(
            "matmul_acc",
            format!(
                "the accumulator holds {} {} values, the product {} x {} x {} {}",
                acc.buf.len(),
                acc.buf.dtype(),
                d.b,
                d.m,
                d.n,
                a.buf.dtype()
            ),
            al.shape(),
        ));
    }
    use super::storage::typed_mut;
    if let Some((bias, biasl)) = bias {
        bias.same_device("matmul_acc", a)?;
        let fused = match a.buf.dtype() {
            DType::BF16 => {
                let out = typed_mut::<bf16>(&mut acc.buf, "matmul_acc")?;
                gemm_bias_into::<bf16>(a, al, b, bl, d, bias, biasl, out, true)?
            }
            DType::F16 => {
                let out = typed_mut::<f16>(&mut acc.buf, "matmul_acc")?;
                gemm_bias_into::<f16>(a, al, b, bl, d, bias, biasl, out, true)?
            }
            _ => false,
        };
        if fused {
            return Ok(());
        }
        // The product with its bias (`matmul_bias`), added into the accumulator.
        use crate::backend::{BackendStorage, BinaryOp};
        let p = matmul_bias(a, al, b, bl, d, bias, biasl)?;
        let ol = Layout::contiguous(crate::Shape::from(vec![d.b, d.m, d.n]));
        *acc = acc.binary(&ol, &p, &ol, BinaryOp::Add)?;
        return Ok(());
    }
    macro_rules! into {
        ($t:ty) => {
            gemm_into::<$t>(
                a,
                al,
                b,
                bl,
                d,
                typed_mut(&mut acc.buf, "matmul_acc")?,
                true,
            )
        };
    }
    match a.buf.dtype() {
        DType::F32 => into!(f32),
        DType::F64 => into!(f64),
        DType::BF16 => into!(bf16),
        DType::F16 => into!(f16),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "matmul_acc",
            dtype: DType::U32,
        }),
    }
}

pub(crate) fn matmul(
    a: &CudaStorage,
    al: &Layout,
    b: &CudaStorage,
    bl: &Layout,
    d: MatmulDims,
) -> Result<CudaStorage> {
    check_pair("matmul", a, al, b, bl, d)?;
    match a.buf.dtype() {
        DType::F32 => gemm_t::<f32>(a, al, b, bl, d),
        DType::F64 => gemm_t::<f64>(a, al, b, bl, d),
        DType::BF16 => gemm_t::<bf16>(a, al, b, bl, d),
        DType::F16 => gemm_t::<f16>(a, al, b, bl, d),
        DType::U32 => Err(Error::UnsupportedDType {
            op: "matmul",
            dtype: DType::U32,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operand_storage() {
        // (3, 4) row-major; its transpose; a column of a row-major matrix; a strided mess.
        assert_eq!(storage_of(3, 4, 4, 1), Some(Mat::RowMajor(4)));
        assert_eq!(storage_of(4, 3, 1, 4), Some(Mat::ColMajor(4)));
        assert_eq!(storage_of(3, 1, 4, 0), Some(Mat::RowMajor(4)));
        assert_eq!(storage_of(1, 5, 0, 1), Some(Mat::RowMajor(5)));
        assert_eq!(storage_of(3, 4, 8, 2), None);
    }
}
