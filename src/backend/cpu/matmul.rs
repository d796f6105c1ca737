//! Batched matmul through the `gemm` crate. Operands are rank-3 views of any strides (a
//! transposed view is passed as swapped strides, never copied). bf16/f16 compute in f32.

use super::strided;
use crate::backend::MatmulDims;
use crate::{CpuStorage, Error, Layout, Result, WithDType};
use gemm::Parallelism;
use rayon::prelude::*;

fn check(op_side: &str, l: &Layout, len: usize, want: [usize; 3]) -> Result<()> {
    if l.dims() != want {
        return Err(Error::invalid(
            "matmul",
            format!("{op_side} layout does not match the dims {want:?}"),
            l.shape(),
        ));
    }
    if l.offset() + l.storage_span() > len {
        return Err(Error::invalid(
            "matmul",
            format!("{op_side} view reaches past its storage of {len} elements"),
            l.shape(),
        ));
    }
    Ok(())
}

fn gemm_batched<T: WithDType + Default>(
    a: &[T],
    al: &Layout,
    b: &[T],
    bl: &Layout,
    d: MatmulDims,
) -> Result<Vec<T>> {
    let MatmulDims { b: batch, m, n, k } = d;
    check("lhs", al, a.len(), [batch, m, k])?;
    check("rhs", bl, b.len(), [batch, k, n])?;
    let mut out = super::zeroed_vec::<T>(batch * m * n, "matmul output")?;
    if m * n == 0 {
        return Ok(out);
    }
    let (sa, sb) = (al.strides(), bl.strides());
    let one = T::from_f64(1.0);
    let run = |i: usize, dst: &mut [T], par: Parallelism| {
        // SAFETY: `check` proved every element the strides address lies inside `a` and `b`
        // (offset + span <= len); `dst` is a contiguous m x n block of this batch entry, and
        // with read_dst = false gemm only writes it.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr().add(al.offset() + i * sa[0]),
                sa[2] as isize,
                sa[1] as isize,
                b.as_ptr().add(bl.offset() + i * sb[0]),
                sb[2] as isize,
                sb[1] as isize,
                T::default(),
                one,
                false,
                false,
                false,
                par,
            )
        }
    };
    // Small matrices: parallel over the batch; large ones: gemm's own threads.
    if batch > 1 && m * n * k < (1 << 18) {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, dst)| run(i, dst, Parallelism::None));
    } else {
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            run(i, dst, Parallelism::Rayon(0));
        }
    }
    Ok(out)
}

fn via_f32<T: WithDType + Default>(
    a: &[T],
    al: &Layout,
    b: &[T],
    bl: &Layout,
    d: MatmulDims,
    back: fn(f32) -> T,
) -> Result<Vec<T>> {
    let to = |x: T| x.to_f64() as f32;
    let (a32, b32) = (strided::map1(a, al, to), strided::map1(b, bl, to));
    let out = gemm_batched(
        &a32,
        &Layout::contiguous(al.shape().clone()),
        &b32,
        &Layout::contiguous(bl.shape().clone()),
        d,
    )?;
    Ok(strided::map1(&out, &Layout::contiguous(out.len()), back))
}

pub fn matmul(
    a: &CpuStorage,
    al: &Layout,
    b: &CpuStorage,
    bl: &Layout,
    d: MatmulDims,
) -> Result<CpuStorage> {
    Ok(match (a, b) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => CpuStorage::F32(gemm_batched(x, al, y, bl, d)?),
        (CpuStorage::F64(x), CpuStorage::F64(y)) => CpuStorage::F64(gemm_batched(x, al, y, bl, d)?),
        (CpuStorage::BF16(x), CpuStorage::BF16(y)) => {
            CpuStorage::BF16(via_f32(x, al, y, bl, d, half::bf16::from_f32)?)
        }
        (CpuStorage::F16(x), CpuStorage::F16(y)) => {
            CpuStorage::F16(via_f32(x, al, y, bl, d, half::f16::from_f32)?)
        }
        (CpuStorage::U32(_), CpuStorage::U32(_)) => {
            return Err(Error::UnsupportedDType {
                op: "matmul",
                dtype: crate::DType::U32,
            })
        }
        (x, y) => {
            return Err(Error::DTypeMismatch {
                op: "matmul",
                lhs: x.dtype(),
                rhs: y.dtype(),
            })
        }
    })
}
