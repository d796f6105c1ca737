//! The scaled FP8 product of `tensor/kernels/fp8_products.rs` (`Fp8Product`) on CUDA:
//! `y[i, j] = sa[i] * sb[j] * sum_k a[i, k] * b[j, k]` over E4M3 codes packed four a word.
//!
//! One cuBLASLt GEMM on FP8 tensor cores (Hopper and Ada). In cuBLASLt's column-major terms
//! the product is `y^T (n, m) = op(B) A` with B = b (k x n, transposed: the "TN" layout FP8
//! GEMMs require, both operands contiguous along k) and A = a (k x m). The scales ride in the
//! GEMM as two outer vectors (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`: one f32 per row of
//! the output and one per column, cuBLAS 12.9+). Where the library offers no algorithm with
//! those scales, the GEMM runs unscaled into f32 and `scale_outer` applies them; where it
//! offers none at all (another GPU, or widths that break its alignment rules: k a multiple of
//! 16, n of 8), a plain kernel (`fp8_product_naive`) computes the product. Which form a shape
//! takes is settled once per device and shape and cached with the algorithm. The matmul
//! descriptor and layouts of each (device, shape, output dtype, scaled or not) are made once
//! and kept (only the scale vectors' pointers change between calls); the handle and the
//! workspace are the device's (`lt.rs`).
//!
//! Int8 codes (`backend::int8`) take the same layout on integer tensor cores (Turing on): one
//! cuBLASLt GEMM with i32 sums (`CUBLAS_COMPUTE_32I`, exact), then `scale_outer_i32` applies
//! both scale vectors as it rounds to the output dtype (cuBLASLt has no outer-vector scales
//! for int8); `i8_product_naive` where cuBLASLt has no algorithm.

use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use super::CudaDevice as Dev;
use crate::backend::fp8::Code8;
use crate::{DType, Error, Result, Shape};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::DevicePtr;
use half::{bf16, f16};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

const OP: &str = "fp8_product";

/// How a shape's product runs on a device.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// One GEMM with both scale vectors.
    Scaled(sys::cublasLtMatmulAlgo_t),
    /// An unscaled GEMM into f32, then `scale_outer`.
    ThenScale(sys::cublasLtMatmulAlgo_t),
    /// `fp8_product_naive`.
    Naive,
}

/// (device ordinal, code, m, n, k, output dtype, with a bias) -> the form found for it.
type Forms = HashMap<(usize, Code8, usize, usize, usize, DType, bool), Form>;

fn forms() -> &'static Mutex<Forms> {
    static FORMS: OnceLock<Mutex<Forms>> = OnceLock::new();
    FORMS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// (device ordinal, code, m, n, k, output dtype, with scale vectors) -> its descriptor and
/// layouts (an int8 plan's output is always i32).
type Plans = HashMap<(usize, Code8, usize, usize, usize, DType, bool), Arc<Mutex<Plan>>>;

fn plans() -> &'static Mutex<Plans> {
    static PLANS: OnceLock<Mutex<Plans>> = OnceLock::new();
    PLANS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The kept plan of a product, made on its first call.
fn plan_for(
    ordinal: usize,
    code: Code8,
    [m, n, k]: [usize; 3],
    out: DType,
    scales: bool,
) -> Result<Arc<Mutex<Plan>>> {
    let key = (ordinal, code, m, n, k, out, scales);
    let mut map = plans()
        .lock()
        .map_err(|_| Error::Cuda(format!("{OP}: the plan cache was poisoned")))?;
    if let Some(p) = map.get(&key) {
        return Ok(p.clone());
    }
    let p = Arc::new(Mutex::new(Plan::new(code, [m, n, k], out, scales)?));
    map.insert(key, p.clone());
    Ok(p)
}

/// [a (m, k/4) u32, sa (m) f32, b (n, k/4) u32, sb (n) f32, optional bias (n) in `dtype`]
/// (dense; `d` = [m, n, k]) -> [y (m, n) in `dtype`]. The bias is added where the scales are
/// applied (`scale_outer`, the plain kernels): with a bias the FP8 product takes the
/// unscaled GEMM's form (cuBLASLt's bias epilogue beside the outer-vector scales gave wrong
/// values on an H200, CUDA 13.0).
pub(crate) fn product(
    code: Code8,
    dtype: DType,
    d: &[usize],
    a: &[&CudaStorage],
) -> Result<Vec<CudaStorage>> {
    match dtype {
        DType::F32 => run::<f32>(code, d, a),
        DType::BF16 => run::<bf16>(code, d, a),
        DType::F16 => run::<f16>(code, d, a),
        _ => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

fn run<T: Elem>(code: Code8, d: &[usize], args: &[&CudaStorage]) -> Result<Vec<CudaStorage>> {
    let (&[m, n, k], [a, sa, b, sb, rest @ ..]) = (d, args) else {
        return Err(Error::Cuda(format!(
            "{OP}: {} sizes and {} operands, expected 3 and 4 or 5",
            d.len(),
            args.len()
        )));
    };
    let (a, sa, b, sb) = (*a, *sa, *b, *sb);
    let bias = rest.first().copied();
    if rest.len() > 1 || bias.is_some_and(|t| t.buf.len() < n) {
        return Err(Error::invalid(
            OP,
            "a bias of another length, or operands past the fifth".to_string(),
            &Shape::from((m, n)),
        ));
    }
    let words = k / crate::backend::fp8::CODES_PER_WORD;
    if a.buf.len() < m * words || b.buf.len() < n * words || sa.buf.len() < m || sb.buf.len() < n {
        return Err(Error::invalid(
            OP,
            "operands smaller than their shapes".to_string(),
            &Shape::from((m, n)),
        ));
    }
    let dev = &a.dev;
    if m * n == 0 || (k == 0 && bias.is_none()) {
        let y = dev.alloc_zeroed::<T>(m * n, "fp8 product")?;
        return Ok(vec![a.wrap(T::wrap(y))]);
    }
    if k == 0 {
        // No products: zero sums, scaled, and the bias.
        let acc = dev.alloc_zeroed::<f32>(m * n, "fp8 product")?;
        let y = scale_outer::<T>(dev, code, &acc, [sa, sb], bias, [m, n])?;
        return Ok(vec![a.wrap(T::wrap(y))]);
    }
    let key = (dev.ordinal(), code, m, n, k, T::DTYPE, bias.is_some());
    let known = forms()
        .lock()
        .map_err(|_| Error::Cuda(format!("{OP}: the form cache was poisoned")))?
        .get(&key)
        .copied();
    let form = match known {
        Some(f) => f,
        None => {
            let f = find_form::<T>(dev, code, [m, n, k], [a, sa, b, sb], bias)?;
            if let Ok(mut map) = forms().lock() {
                map.insert(key, f);
            }
            f
        }
    };
    let y = match form {
        Form::Scaled(algo) => {
            let y = dev.alloc::<T>(m * n)?;
            let out = y.slice.device_ptr(dev.stream()).0;
            let stream = dev.stream();
            let scales = Some((sa.buf.raw_ptr(stream), sb.buf.raw_ptr(stream)));
            gemm(dev, code, [m, n, k], T::DTYPE, [a, b], out, scales, &algo)?;
            y
        }
        Form::ThenScale(algo) => {
            // f32 sums for E4M3, i32 for int8 (as many bytes: the i32 buffer is held as f32).
            let acc = dev.alloc::<f32>(m * n)?;
            let acc_ptr = acc.slice.device_ptr(dev.stream()).0;
            gemm(
                dev,
                code,
                [m, n, k],
                DType::F32,
                [a, b],
                acc_ptr,
                None,
                &algo,
            )?;
            scale_outer::<T>(dev, code, &acc, [sa, sb], bias, [m, n])?
        }
        Form::Naive => {
            let mut y = dev.alloc::<T>(m * n)?;
            let p = |s: &CudaStorage| s.buf.raw_ptr(dev.stream());
            let (pa, psa, pb, psb) = (p(a), p(sa), p(b), p(sb));
            let pbias = bias.map_or(0u64, p);
            let kernel = match code {
                Code8::E4m3 => "fp8_product_naive",
                Code8::Int8 => "i8_product_naive",
            };
            launch!(
                dev,
                "fp8",
                format!("{kernel}_{}", T::SFX),
                grid_for(m * n, dev.sm_count()),
                &pa,
                &psa,
                &pb,
                &psb,
                &pbias,
                &mut *y.slice,
                &m,
                &n,
                &words
            )?;
            y
        }
    };
    Ok(vec![a.wrap(T::wrap(y))])
}

/// y (m, n) = acc * sa (m) * sb (n) [+ bias (n)] in f32, rounded once to T: `acc` the GEMM's
/// f32 sums for E4M3, its i32 sums (as many bytes, held as f32) for int8. Four columns a
/// thread with one 16-byte load where the widths and buffers allow (`scale_outer*_v4`), else
/// an element a thread.
fn scale_outer<T: Elem>(
    dev: &Dev,
    code: Code8,
    acc: &super::memory::DevBuf<f32>,
    [sa, sb]: [&CudaStorage; 2],
    bias: Option<&CudaStorage>,
    [m, n]: [usize; 2],
) -> Result<super::memory::DevBuf<T>> {
    let mut y = dev.alloc::<T>(m * n)?;
    let stream = dev.stream();
    let (pa, pb) = (sa.buf.raw_ptr(stream), sb.buf.raw_ptr(stream));
    let pbias = bias.map_or(0u64, |t| t.buf.raw_ptr(stream));
    let pacc = acc.slice.device_ptr(stream).0;
    let py = y.slice.device_ptr(stream).0;
    let kernel = match code {
        Code8::E4m3 => "scale_outer",
        Code8::Int8 => "scale_outer_i32",
    };
    let four = (4 * T::DTYPE.size_in_bytes()) as u64;
    let v4 = n % 4 == 0 && pacc % 16 == 0 && pb % 16 == 0 && py % four == 0 && pbias % four == 0;
    if v4 {
        const THREADS: u32 = 256;
        let groups = (n / 4).div_ceil(THREADS as usize);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (groups as u32, m.min(65_535) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            "fp8",
            format!("{kernel}_v4_{}", T::SFX),
            cfg,
            &pacc,
            &pa,
            &pb,
            &pbias,
            &mut *y.slice,
            &m,
            &n
        )?;
    } else {
        let total = m * n;
        launch!(
            dev,
            "fp8",
            format!("{kernel}_{}", T::SFX),
            grid_for(total, dev.sm_count()),
            &pacc,
            &pa,
            &pb,
            &pbias,
            &mut *y.slice,
            &n,
            &total
        )?;
    }
    Ok(y)
}

/// The form a shape takes on `dev`: cuBLASLt's FP8 GEMM with its scale vectors where it has
/// an algorithm for them, else unscaled into f32 (int8: always into i32), else the plain
/// kernel.
fn find_form<T: Elem>(
    dev: &Dev,
    code: Code8,
    [m, n, k]: [usize; 3],
    ops: [&CudaStorage; 4],
    bias: Option<&CudaStorage>,
) -> Result<Form> {
    let aligned = ops.iter().all(|s| s.buf.raw_ptr(dev.stream()) % 16 == 0);
    // Tensor cores for the code (FP8: Ada 8.9 and Hopper on; int8: Turing 7.5 on); k a
    // multiple of 16 (16-byte rows of codes), the output's rows 16-byte aligned (the f32 or
    // i32 sums' rows too).
    let cc = (
        dev.compute_capability_major(),
        dev.compute_capability_minor(),
    );
    let fits = cc >= code.min_compute_capability()
        && aligned
        && k % 16 == 0
        && (n * T::DTYPE.size_in_bytes()) % 16 == 0
        && n % 4 == 0;
    if !fits {
        return Ok(Form::Naive);
    }
    let stream = dev.stream();
    let scaled = Some((ops[1].buf.raw_ptr(stream), ops[3].buf.raw_ptr(stream)));
    if code == Code8::E4m3 && bias.is_none() {
        if let Some(algo) = heuristic(dev, code, [m, n, k], T::DTYPE, scaled) {
            return Ok(Form::Scaled(algo));
        }
    }
    if let Some(algo) = heuristic(dev, code, [m, n, k], DType::F32, None) {
        return Ok(Form::ThenScale(algo));
    }
    Ok(Form::Naive)
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType> {
    super::lt::data_type(OP, dtype)
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> Error {
    super::lt::lt_err(OP, what, e)
}

/// A matmul descriptor and the three layouts of one product, destroyed on drop.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
}

// SAFETY: the handles are host objects of cuBLASLt, tied to no thread; a kept plan is used
// by one thread at a time (behind its Mutex), and cuBLASLt reads a descriptor's attributes
// when `cublasLtMatmul` is called, so changing its scale pointers after a call returns does
// not touch GEMMs already queued.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by `Plan::new` and is destroyed once, here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Plan {
    /// y^T (n, m) = op(b)^T-layout (k x n, transposed) times a (k x m), output `out`; with
    /// `scales` the operands' scale vectors are outer vectors (their pointers set by
    /// [`Plan::set_scales`]). Int8 codes sum in i32 into an i32 output (`out` unread), with
    /// i32 alpha and beta (`Lt::matmul_i32`).
    fn new(code: Code8, [m, n, k]: [usize; 3], out: DType, scales: bool) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let (operand, compute, scale, out) = match code {
            Code8::E4m3 => (
                sys::cudaDataType::CUDA_R_8F_E4M3,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
                data_type(out)?,
            ),
            Code8::Int8 => (
                sys::cudaDataType::CUDA_R_8I,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
                sys::cudaDataType::CUDA_R_32I,
                sys::cudaDataType::CUDA_R_32I,
            ),
        };
        let desc = lt::create_matmul_desc(compute, scale).map_err(|e| lt_err("descriptor", e))?;
        let layout = |ty, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                .map_err(|e| lt_err("layout", e))
        };
        // The plan owns each handle as soon as it exists, so an error below frees them.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        plan.a = layout(operand, k, n, k)?;
        plan.b = layout(operand, k, m, k)?;
        plan.d = layout(out, n, m, n)?;
        let trans_a = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        let trans_b = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
        // SAFETY: the descriptor is live; each value is the attribute's documented type.
        unsafe {
            set(plan.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &trans_a)?;
            set(plan.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &trans_b)?;
            if scales {
                let mode =
                    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
                set(plan.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode)?;
                set(plan.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode)?;
            }
        }
        Ok(plan)
    }

    /// The scale vectors: cuBLASLt's A is `b` (its scales `sb`, one per output column of y),
    /// its B is `a` (`sa`).
    fn set_scales(&self, sa: u64, sb: u64) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let (pa, pb) = (sb as *const c_void, sa as *const c_void);
        // SAFETY: the descriptor is live; the values are device pointers to f32 vectors of n
        // and m elements that outlive the GEMM (the caller's operands).
        unsafe {
            set(self.desc, Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa)?;
            set(self.desc, Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb)?;
        }
        Ok(())
    }
}

/// Sets one descriptor attribute to `v`.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    super::lt::set_desc(OP, desc, attr, v)
}

/// cuBLASLt's fastest algorithm for the product (with the scale vectors at `scales`, (sa,
/// sb), when given), or None where it has none: the library answers an unsupported
/// combination with NOT_SUPPORTED or, for some scale modes, INVALID_VALUE, and either means
/// the next form.
fn heuristic(
    dev: &Dev,
    code: Code8,
    mnk: [usize; 3],
    out: DType,
    scales: Option<(u64, u64)>,
) -> Option<sys::cublasLtMatmulAlgo_t> {
    heuristic_or_err(dev, code, mnk, out, scales).ok()
}

fn heuristic_or_err(
    dev: &Dev,
    code: Code8,
    mnk: [usize; 3],
    out: DType,
    scales: Option<(u64, u64)>,
) -> Result<sys::cublasLtMatmulAlgo_t> {
    let plan = Plan::new(code, mnk, out, scales.is_some())?;
    if let Some((sa, sb)) = scales {
        plan.set_scales(sa, sb)?;
    }
    let lt = dev.lt()?;
    super::lt::fastest(
        OP,
        lt.handle(),
        plan.desc,
        [plan.a, plan.b, plan.d],
        lt.workspace_bytes(),
    )?
    .ok_or_else(|| lt_err("heuristic", "no algorithm"))
}

/// One GEMM of the codes `a` and `b` into `out` (m x n of `out_dtype`, row-major), with the
/// scale vectors at `scales` (sa, sb) when given.
#[allow(clippy::too_many_arguments)]
fn gemm(
    dev: &Dev,
    code: Code8,
    [m, n, k]: [usize; 3],
    out_dtype: DType,
    [a, b]: [&CudaStorage; 2],
    out: u64,
    scales: Option<(u64, u64)>,
    algo: &sys::cublasLtMatmulAlgo_t,
) -> Result<()> {
    let kept = plan_for(dev.ordinal(), code, [m, n, k], out_dtype, scales.is_some())?;
    let plan = kept
        .lock()
        .map_err(|_| Error::Cuda(format!("{OP}: a kept plan was poisoned")))?;
    let stream = dev.stream();
    if let Some((sa, sb)) = scales {
        plan.set_scales(sa, sb)?;
    }
    let lt = dev.lt()?;
    let (pa, pb) = (a.buf.raw_ptr(stream), b.buf.raw_ptr(stream));
    let span = crate::backend::profile::Span::start(stream);
    // SAFETY: the plan's layouts describe the operands' extents (checked by the caller: b
    // holds n rows of k codes, a m rows, out m x n elements of `out_dtype`); everything is
    // queued on FLAME's one stream.
    let r = unsafe {
        let (layouts, ptrs) = ([plan.a, plan.b, plan.d], [pb, pa, out]);
        match code {
            Code8::E4m3 => lt.matmul(plan.desc, layouts, ptrs, algo, stream),
            Code8::Int8 => lt.matmul_i32(plan.desc, layouts, ptrs, algo, stream),
        }
    };
    let (name, what) = match code {
        Code8::E4m3 => ("cublaslt_fp8_gemm", "FP8"),
        Code8::Int8 => ("cublaslt_i8_gemm", "int8"),
    };
    span.stop(stream, "gemm", name);
    drop(plan);
    r.map_err(|e| lt_err(&format!("{what} GEMM ({m}, {n}, {k})"), e))
}
