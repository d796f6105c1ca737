//! cuBLASLt on a device: its handle and workspace ([`Lt`], one a device, made on first use),
//! and the GEMMs with a bias epilogue of `matmul.rs` ([`BiasGemm`]), whose matmul descriptor,
//! layouts and algorithm are made once per (device, dtype, shape and strides) and kept: a call
//! sets the bias pointer and queues the GEMM. Making and destroying them, and asking the
//! heuristic, at every call cost the host more than the launch: in SDXL's resident step the
//! heuristic alone was 3.6% of the host's time (docs/PERFORMANCE.md, "SDXL: the resident step
//! on the host"), where the step's host pace sets its time.

use crate::{DType, Error, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// cuBLASLt's handle and workspace of one device. The workspace is the driver's memory, outside
/// FLAME's allocator (the budget's `LATE_HEADROOM` holds it): NVIDIA advises 32 MiB on Hopper
/// and 4 MiB before it (cuBLAS docs, `cublasLtMatmul`, workspace), as cudarc's default does.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: a cuBLASLt handle is a host object tied to no thread; every GEMM FLAME queues with it
// runs on the device's one compute stream, so the workspace is used by one GEMM at a time.
unsafe impl Send for Lt {}
// SAFETY: as above; `&Lt` only hands out the handle and the workspace's address.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was made by `Lt::new` and is destroyed once, here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// A handle and a workspace for GPUs of compute capability `major`, on `stream`.
    pub(crate) fn new(stream: &Arc<CudaStream>, major: u32) -> Result<Lt> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Cuda(format!("cuBLASLt: binding the context: {e:?}")))?;
        let handle = lt::create_handle().map_err(|e| lt_err("cuBLASLt", "handle", e))?;
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        // SAFETY: cuBLASLt writes its workspace before reading it.
        match unsafe { stream.alloc::<u8>(bytes) } {
            Ok(workspace) => Ok(Lt { handle, workspace }),
            Err(e) => {
                // SAFETY: made above, owned by nothing else.
                let _ = unsafe { lt::destroy_handle(handle) };
                Err(Error::Cuda(format!(
                    "cuBLASLt: a workspace of {bytes} bytes: {e:?}"
                )))
            }
        }
    }

    pub(crate) fn handle(&self) -> sys::cublasLtHandle_t {
        self.handle
    }

    /// The workspace's size in bytes.
    pub(crate) fn workspace_bytes(&self) -> usize {
        self.workspace.len()
    }

    /// Queues `D = op(A) op(B)` (alpha 1, beta 0, C being D) on `stream` with `desc`, the
    /// layouts of A, B and D, their device addresses, `algo` and the workspace.
    ///
    /// # Safety
    /// `desc` and the layouts are live and describe the operands at the addresses, which hold
    /// them and outlive the GEMM; `stream` is this device's compute stream (GEMMs take the
    /// workspace in turn).
    pub(crate) unsafe fn matmul(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [la, lb, ld]: [sys::cublasLtMatrixLayout_t; 3],
        [a, b, d]: [u64; 3],
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &CudaStream,
    ) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
        self.matmul_beta(desc, [la, lb, ld], [a, b, d], algo, stream, 0.0)
    }

    /// [`Lt::matmul`] with `d` also the GEMM's C scaled by `beta` (f32 scale type):
    /// `d = op(a) op(b) + beta d` (beta = 1 accumulates into `d`).
    ///
    /// # Safety
    /// As [`Lt::matmul`]; `d` holds the values C is read from.
    pub(crate) unsafe fn matmul_beta(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [la, lb, ld]: [sys::cublasLtMatrixLayout_t; 3],
        [a, b, d]: [u64; 3],
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &CudaStream,
        beta: f32,
    ) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
        let alpha = 1f32;
        self.matmul_scaled(
            desc,
            [la, lb, ld],
            [a, b, d],
            algo,
            stream,
            [
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
            ],
        )
    }

    /// [`Lt::matmul`] for a descriptor whose scale type is i32 (integer GEMMs): alpha 1 and
    /// beta 0 as i32.
    ///
    /// # Safety
    /// As [`Lt::matmul`].
    pub(crate) unsafe fn matmul_i32(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        layouts: [sys::cublasLtMatrixLayout_t; 3],
        ptrs: [u64; 3],
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &CudaStream,
    ) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
        let (alpha, beta) = (1i32, 0i32);
        self.matmul_scaled(
            desc,
            layouts,
            ptrs,
            algo,
            stream,
            [
                &alpha as *const i32 as *const c_void,
                &beta as *const i32 as *const c_void,
            ],
        )
    }

    /// The GEMM with alpha and beta at `scalars` (host pointers of the descriptor's scale
    /// type).
    unsafe fn matmul_scaled(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [la, lb, ld]: [sys::cublasLtMatrixLayout_t; 3],
        [a, b, d]: [u64; 3],
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &CudaStream,
        [alpha, beta]: [*const c_void; 2],
    ) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
        let ws = self.workspace.device_ptr(self.workspace.stream()).0;
        lt::matmul(
            self.handle,
            desc,
            alpha,
            beta,
            a as *const c_void,
            la,
            b as *const c_void,
            lb,
            d as *const c_void,
            ld,
            d as *mut c_void,
            ld,
            algo,
            ws as *mut c_void,
            self.workspace.len(),
            stream.cu_stream() as *mut _,
        )
    }
}

/// cuBLASLt's data type of a float dtype; `op` names the caller in the error.
pub(crate) fn data_type(op: &'static str, dtype: DType) -> Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        dtype => return Err(Error::UnsupportedDType { op, dtype }),
    })
}

/// A cuBLASLt error of `op` while making or running `what`.
pub(crate) fn lt_err(op: &str, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{op}: cuBLASLt {what}: {e:?}"))
}

const OP: &str = "matmul_bias";

/// One GEMM `C = op(A) op(B) + bias` (`+ C` where `accumulate`) in cuBLASLt's column-major
/// terms: C (m, n) with leading dimension `ldc`, A (m, k) or (k, m) where `transa`, B (k, n)
/// or (n, k) where `transb`, the bias a vector of m added to every column; batched over
/// `batch` = (count, A's, B's and C's batch strides) with one bias for all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BiasGemm {
    pub transa: bool,
    pub transb: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldc: i64,
    pub batch: Option<(i32, i64, i64, i64)>,
    pub accumulate: bool,
}

/// A kept GEMM: its descriptor, layouts and algorithm (None: cuBLASLt has none for it),
/// destroyed on drop.
struct Kept {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: Option<sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the handles are host objects of cuBLASLt, tied to no thread; a kept GEMM is used by
// one thread at a time (behind its Mutex), and cuBLASLt reads a descriptor's attributes when
// `cublasLtMatmul` is called, so setting the next call's bias pointer does not touch GEMMs
// already queued.
unsafe impl Send for Kept {}

impl Drop for Kept {
    fn drop(&mut self) {
        // SAFETY: each non-null handle was made by `Kept::new` and is destroyed once, here.
        unsafe {
            for l in [self.c, self.b, self.a] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// Sets one attribute of a descriptor to `v`.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
pub(crate) unsafe fn set_desc<T>(
    op: &str,
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err(op, "descriptor attribute", e))
}

/// Sets one attribute of a layout to `v`.
///
/// # Safety
/// `layout` is live and `T` is the attribute's type.
unsafe fn set_layout<T>(
    layout: sys::cublasLtMatrixLayout_t,
    attr: sys::cublasLtMatrixLayoutAttribute_t,
    v: &T,
) -> Result<()> {
    lt::set_matrix_layout_attribute(
        layout,
        attr,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err(OP, "layout attribute", e))
}

/// cuBLASLt's fastest algorithm for a descriptor and its layouts within a workspace of `bytes`,
/// or None where it has none (NOT_SUPPORTED).
pub(crate) fn fastest(
    op: &str,
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    [a, b, c]: [sys::cublasLtMatrixLayout_t; 3],
    bytes: usize,
) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
    let pref = lt::create_matmul_pref().map_err(|e| lt_err(op, "preference", e))?;
    let ws = bytes as u64;
    // SAFETY: `pref` is live until destroyed below; the value is the attribute's u64; the
    // descriptor and layouts are the caller's, live.
    let found = unsafe {
        let r = lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            std::mem::size_of::<u64>(),
        )
        .and_then(|()| lt::get_matmul_algo_heuristic(handle, desc, a, b, c, c, pref));
        let _ = lt::destroy_matmul_pref(pref);
        r
    };
    match found {
        Ok(h) => Ok(Some(h.algo)),
        Err(e) if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Ok(None),
        Err(e) => Err(lt_err(op, "heuristic", e)),
    }
}

impl Kept {
    fn new(lt: &Lt, dtype: DType, g: &BiasGemm) -> Result<Kept> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        use sys::cublasLtMatrixLayoutAttribute_t as LAttr;
        let ty = data_type(OP, dtype)?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_err(OP, "descriptor", e))?;
        // The kept GEMM owns each handle as soon as it exists, so an error below frees them.
        let mut kept = Kept {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            algo: None,
        };
        let layout = |rows: u64, cols: u64, ld: i64, stride: Option<(i32, i64)>| {
            let l = lt::create_matrix_layout(ty, rows, cols, ld)
                .map_err(|e| lt_err(OP, "layout", e))?;
            if let Some((count, stride)) = stride {
                // SAFETY: `l` is live; the values are the attributes' i32 and i64.
                let set = unsafe {
                    set_layout(l, LAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count).and_then(
                        |()| {
                            set_layout(
                                l,
                                LAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                &stride,
                            )
                        },
                    )
                };
                if let Err(e) = set {
                    // SAFETY: made above, owned by nothing else.
                    let _ = unsafe { lt::destroy_matrix_layout(l) };
                    return Err(e);
                }
            }
            Ok(l)
        };
        let (ar, ac) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
        kept.a = layout(ar, ac, g.lda, g.batch.map(|(c, sa, _, _)| (c, sa)))?;
        kept.b = layout(br, bc, g.ldb, g.batch.map(|(c, _, sb, _)| (c, sb)))?;
        kept.c = layout(g.m, g.n, g.ldc, g.batch.map(|(c, _, _, sc)| (c, sc)))?;
        let trans = |t: bool| {
            if t {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        // SAFETY: the descriptor is live; each value is the attribute's documented type.
        unsafe {
            set_desc(
                OP,
                kept.desc,
                Attr::CUBLASLT_MATMUL_DESC_TRANSA,
                &trans(g.transa),
            )?;
            set_desc(
                OP,
                kept.desc,
                Attr::CUBLASLT_MATMUL_DESC_TRANSB,
                &trans(g.transb),
            )?;
            set_desc(
                OP,
                kept.desc,
                Attr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epilogue,
            )?;
            if g.batch.is_some() {
                set_desc(
                    OP,
                    kept.desc,
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                    &0i64,
                )?;
            }
        }
        kept.algo = fastest(
            OP,
            lt.handle(),
            kept.desc,
            [kept.a, kept.b, kept.c],
            lt.workspace_bytes(),
        )?;
        Ok(kept)
    }
}

/// (device ordinal, dtype, GEMM) -> its kept descriptor, layouts and algorithm.
type Plans = HashMap<(usize, DType, BiasGemm), Arc<Mutex<Kept>>>;

fn plans() -> &'static Mutex<Plans> {
    static PLANS: OnceLock<Mutex<Plans>> = OnceLock::new();
    PLANS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Queues `c = op(a) op(b) + bias` (`c +=` where `g.accumulate`; `g`, elements of `dtype`:
/// bf16 or f16, accumulated in f32) on `stream` from the device addresses `a`, `b`, `bias`
/// into `c`; false where cuBLASLt has no algorithm for it (the shape, or the operands'
/// alignment), nothing queued.
///
/// # Safety
/// The addresses hold the elements `g` describes (A, B and C with their leading dimensions and
/// batch strides, the bias m elements) and outlive the GEMM; `stream` is `lt`'s device's
/// compute stream.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_bias(
    lt: &Lt,
    stream: &CudaStream,
    ordinal: usize,
    dtype: DType,
    g: BiasGemm,
    [a, b, c, bias]: [u64; 4],
) -> Result<bool> {
    let key = (ordinal, dtype, g);
    let kept = {
        let mut map = plans()
            .lock()
            .map_err(|_| Error::Poisoned("cuBLASLt bias GEMM plans"))?;
        match map.get(&key) {
            Some(k) => k.clone(),
            None => {
                let k = Arc::new(Mutex::new(Kept::new(lt, dtype, &g)?));
                map.insert(key, k.clone());
                k
            }
        }
    };
    let kept = kept
        .lock()
        .map_err(|_| Error::Poisoned("a cuBLASLt bias GEMM plan"))?;
    let Some(algo) = kept.algo else {
        return Ok(false);
    };
    let bias = bias as *const c_void;
    set_desc(
        OP,
        kept.desc,
        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
        &bias,
    )?;
    let r = lt.matmul_beta(
        kept.desc,
        [kept.a, kept.b, kept.c],
        [a, b, c],
        &algo,
        stream,
        if g.accumulate { 1.0 } else { 0.0 },
    );
    match r {
        Ok(()) => Ok(true),
        // The operands' alignment rules the algorithm out: the caller takes another way.
        Err(e) if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Ok(false),
        Err(e) => Err(lt_err(OP, &format!("GEMM {g:?}"), e)),
    }
}
