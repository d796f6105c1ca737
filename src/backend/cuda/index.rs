//! index_select, gather and scatter_add launchers (kernels in cuda/index.cu). Operands are
//! made contiguous and viewed as (outer, size along dim, inner). Kernels flag an index past
//! its dim; the launcher reads the flag (one 4-byte copy, which waits for the kernel) and
//! returns the same error as the CPU backend.

use super::layout::grid_for;
use super::storage::{by_dtype, launch, CudaStorage, Elem};
use crate::{DType, Error, Layout, Result, Shape};

fn blocks(shape: &Shape, dim: usize) -> (usize, usize, usize) {
    let d = shape.dims();
    (
        d[..dim].iter().product(),
        d[dim],
        d[dim + 1..].iter().product(),
    )
}

fn check_ids(ids: &CudaStorage, il: &Layout, op: &'static str) -> Result<()> {
    if ids.buf.dtype() != DType::U32 {
        return Err(Error::invalid(
            op,
            format!("indices must be u32, got {}", ids.buf.dtype()),
            il.shape(),
        ));
    }
    Ok(())
}

/// Reads the kernel's flag; on a bad index, finds the first one for the error.
fn verify(
    ids: &CudaStorage,
    il: &Layout,
    bad: &super::memory::DevBuf<u32>,
    size: usize,
    op: &'static str,
    shape: &Shape,
) -> Result<()> {
    let flag = ids
        .dev
        .stream()
        .clone_dtoh(&*bad.slice)
        .map_err(super::cuda_err("reading the index flag"))?;
    if flag.first().copied().unwrap_or(0) == 0 {
        return Ok(());
    }
    let host = ids.to_host_any(il)?;
    let index = host
        .to_f64_vec()
        .into_iter()
        .find(|&i| i as usize >= size)
        .unwrap_or(f64::NAN) as u64;
    Err(Error::IndexOutOfRange {
        op,
        index,
        size,
        shape: shape.clone(),
    })
}

impl CudaStorage {
    fn to_host_any(&self, l: &Layout) -> Result<crate::CpuStorage> {
        crate::backend::BackendStorage::to_host(self, l)
    }
}

/// index_select (kernel `index_select_*`, `n_j` = the number of ids) and gather (`gather_*`,
/// `n_j` = the ids' size along `dim`) share one signature: src, ids, out, outer, size, n_j,
/// inner, flag. The output has outer * n_j * inner elements.
#[allow(clippy::too_many_arguments)]
fn lookup_t<T: Elem>(
    op: &'static str,
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    dim: usize,
    n_j: usize,
) -> Result<CudaStorage> {
    let (sd, idd) = (s.dense(op, l)?, ids.dense(op, il)?);
    let src = sd.as_ref().unwrap_or(s).typed::<T>(op)?;
    let idb = idd.as_ref().unwrap_or(ids).typed::<u32>(op)?;
    let (outer, size, inner) = blocks(l.shape(), dim);
    let n = outer * n_j * inner;
    let mut out = s.dev.alloc::<T>(n)?;
    let mut bad = s.dev.alloc_zeroed::<u32>(1, "clearing the index flag")?;
    if n > 0 {
        launch!(
            s.dev,
            "index",
            format!("{op}_{}", T::SFX),
            grid_for(n, s.dev.sm_count()),
            &*src.slice,
            &*idb.slice,
            &mut *out.slice,
            &outer,
            &size,
            &n_j,
            &inner,
            &mut *bad.slice
        )?;
    }
    verify(ids, il, &bad, size, op, l.shape())?;
    Ok(s.wrap(T::wrap(out)))
}

pub(crate) fn index_select(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    crate::backend::validate::dim_in_range("index_select", l, dim)?;
    check_ids(ids, il, "index_select")?;
    if il.dims().len() != 1 {
        return Err(Error::invalid(
            "index_select",
            "indices must be a vector",
            il.shape(),
        ));
    }
    by_dtype!(
        s.buf.dtype(),
        lookup_t("index_select", s, l, ids, il, dim, il.elem_count())
    )
}

pub(crate) fn gather(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    crate::backend::validate::dim_in_range("gather", l, dim)?;
    check_ids(ids, il, "gather")?;
    crate::backend::validate::gather_shapes("gather", l, il, dim)?;
    by_dtype!(
        s.buf.dtype(),
        lookup_t("gather", s, l, ids, il, dim, il.dims()[dim])
    )
}

fn scatter_t<T: Elem>(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    const OP: &str = "scatter_add";
    let mut out = s.contiguous(l)?;
    let (idd, srd) = (ids.dense("index", il)?, src.dense("index", sl)?);
    let idb = idd.as_ref().unwrap_or(ids).typed::<u32>(OP)?;
    let srb = srd.as_ref().unwrap_or(src).typed::<T>(OP)?;
    let (outer, size, inner) = blocks(l.shape(), dim);
    let n_j = il.dims()[dim];
    let mut bad = s.dev.alloc_zeroed::<u32>(1, "clearing the index flag")?;
    let dev = s.dev.clone();
    let cols = outer * inner;
    if cols > 0 && n_j > 0 {
        let o = super::storage::typed_mut::<T>(&mut out.buf, OP)?;
        launch!(
            dev,
            "index",
            format!("scatter_add_{}", T::SFX),
            grid_for(cols, dev.sm_count()),
            &mut *o.slice,
            &*idb.slice,
            &*srb.slice,
            &outer,
            &size,
            &n_j,
            &inner,
            &mut *bad.slice
        )?;
    }
    verify(ids, il, &bad, size, OP, l.shape())?;
    Ok(out)
}

pub(crate) fn scatter_add(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    crate::backend::validate::dim_in_range("scatter_add", l, dim)?;
    check_ids(ids, il, "scatter_add")?;
    crate::backend::validate::gather_shapes("scatter_add", l, il, dim)?;
    if il.shape() != sl.shape() {
        return Err(Error::ShapeMismatch {
            op: "scatter_add",
            lhs: il.shape().clone(),
            rhs: sl.shape().clone(),
        });
    }
    let u32_err = Error::UnsupportedDType {
        op: "scatter_add",
        dtype: DType::U32,
    };
    by_dtype!(s.buf.dtype(), scatter_t(s, l, ids, il, src, sl, dim), u32 => Err(u32_err))
}
