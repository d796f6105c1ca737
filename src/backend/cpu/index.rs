//! index_select, gather and scatter_add. Inputs are made contiguous and viewed as
//! (outer, size along dim, inner) blocks.

use super::strided;
use crate::{CpuStorage, DType, Error, Layout, Result, Shape, WithDType};
use rayon::prelude::*;

fn ids_vec(ids: &CpuStorage, il: &Layout, op: &'static str) -> Result<Vec<u32>> {
    match ids {
        CpuStorage::U32(v) => Ok(strided::contiguous(v, il).into_owned()),
        other => Err(Error::invalid(
            op,
            format!("indices must be u32, got {}", other.dtype()),
            il.shape(),
        )),
    }
}

fn check_ids(ids: &[u32], size: usize, op: &'static str, shape: &Shape) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= size) {
        Some(&i) => Err(Error::IndexOutOfRange {
            op,
            index: i as u64,
            size,
            shape: shape.clone(),
        }),
        None => Ok(()),
    }
}

/// (outer, size, inner) of `shape` around `dim`.
fn blocks(shape: &Shape, dim: usize) -> (usize, usize, usize) {
    let d = shape.dims();
    (
        d[..dim].iter().product(),
        d[dim],
        d[dim + 1..].iter().product(),
    )
}

fn select<T: WithDType>(v: &[T], l: &Layout, ids: &[u32], dim: usize) -> Vec<T> {
    let src = strided::contiguous(v, l);
    let (outer, size, inner) = blocks(l.shape(), dim);
    let mut out = vec![T::zeroed(); outer * ids.len() * inner];
    out.par_chunks_mut((ids.len() * inner).max(1))
        .enumerate()
        .for_each(|(o, chunk)| {
            for (j, &id) in ids.iter().enumerate() {
                let s = (o * size + id as usize) * inner;
                chunk[j * inner..(j + 1) * inner].copy_from_slice(&src[s..s + inner]);
            }
        });
    out
}

pub fn index_select(
    s: &CpuStorage,
    l: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    dim: usize,
) -> Result<CpuStorage> {
    if il.dims().len() != 1 {
        return Err(Error::invalid(
            "index_select",
            "indices must be a vector",
            il.shape(),
        ));
    }
    let ids = ids_vec(ids, il, "index_select")?;
    check_ids(&ids, l.dims()[dim], "index_select", l.shape())?;
    Ok(crate::map_cpu_storage!(s, v => select(v, l, &ids, dim)))
}

fn gather_typed<T: WithDType>(v: &[T], l: &Layout, ids: &[u32], il: &Layout, dim: usize) -> Vec<T> {
    let src = strided::contiguous(v, l);
    let (_, size, inner) = blocks(l.shape(), dim);
    let (_, j_n, _) = blocks(il.shape(), dim);
    let mut out = vec![T::zeroed(); ids.len()];
    out.par_chunks_mut((j_n * inner).max(1))
        .enumerate()
        .for_each(|(o, chunk)| {
            for (k, x) in chunk.iter_mut().enumerate() {
                let (j, i) = (k / inner, k % inner);
                let id = ids[(o * j_n + j) * inner + i] as usize;
                *x = src[(o * size + id) * inner + i];
            }
        });
    out
}

pub fn gather(
    s: &CpuStorage,
    l: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    dim: usize,
) -> Result<CpuStorage> {
    crate::backend::validate::gather_shapes("gather", l, il, dim)?;
    let idv = ids_vec(ids, il, "gather")?;
    check_ids(&idv, l.dims()[dim], "gather", l.shape())?;
    Ok(crate::map_cpu_storage!(s, v => gather_typed(v, l, &idv, il, dim)))
}

fn scatter_typed<T: super::Elem>(
    dst: &[T],
    l: &Layout,
    ids: &[u32],
    src: &[T],
    sl: &Layout,
    dim: usize,
) -> Vec<T> {
    let mut out = strided::contiguous(dst, l).into_owned();
    let src = strided::contiguous(src, sl);
    let (_, size, inner) = blocks(l.shape(), dim);
    let (_, j_n, _) = blocks(sl.shape(), dim);
    // Outer block o writes only to out[o]: blocks are independent.
    out.par_chunks_mut((size * inner).max(1))
        .enumerate()
        .for_each(|(o, block)| {
            for j in 0..j_n {
                for i in 0..inner {
                    let k = (o * j_n + j) * inner + i;
                    let t = ids[k] as usize * inner + i;
                    block[t] = T::from_acc(block[t].to_acc() + src[k].to_acc());
                }
            }
        });
    out
}

pub fn scatter_add(
    s: &CpuStorage,
    l: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    src: &CpuStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CpuStorage> {
    crate::backend::validate::gather_shapes("scatter_add", l, il, dim)?;
    if il.shape() != sl.shape() {
        return Err(Error::ShapeMismatch {
            op: "scatter_add",
            lhs: il.shape().clone(),
            rhs: sl.shape().clone(),
        });
    }
    let idv = ids_vec(ids, il, "scatter_add")?;
    check_ids(&idv, l.dims()[dim], "scatter_add", l.shape())?;
    Ok(match (s, src) {
        (CpuStorage::F32(d), CpuStorage::F32(x)) => {
            CpuStorage::F32(scatter_typed(d, l, &idv, x, sl, dim))
        }
        (CpuStorage::F64(d), CpuStorage::F64(x)) => {
            CpuStorage::F64(scatter_typed(d, l, &idv, x, sl, dim))
        }
        (CpuStorage::BF16(d), CpuStorage::BF16(x)) => {
            CpuStorage::BF16(scatter_typed(d, l, &idv, x, sl, dim))
        }
        (CpuStorage::F16(d), CpuStorage::F16(x)) => {
            CpuStorage::F16(scatter_typed(d, l, &idv, x, sl, dim))
        }
        (CpuStorage::U32(_), CpuStorage::U32(_)) => {
            return Err(Error::UnsupportedDType {
                op: "scatter_add",
                dtype: DType::U32,
            })
        }
        (a, b) => {
            return Err(Error::DTypeMismatch {
                op: "scatter_add",
                lhs: a.dtype(),
                rhs: b.dtype(),
            })
        }
    })
}
