//! Argument checks every backend runs before touching memory (the Backend traits are public,
//! so a caller may pass anything). One copy here, called by each backend.

use super::ReduceOp;
use crate::{DType, Error, Layout, Result};

pub(crate) fn same_shape(op: &'static str, a: &Layout, b: &Layout) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        });
    }
    Ok(())
}

pub(crate) fn dim_in_range(op: &'static str, l: &Layout, dim: usize) -> Result<()> {
    if dim >= l.dims().len() {
        return Err(Error::DimOutOfRange {
            op,
            dim: dim as i64,
            shape: l.shape().clone(),
        });
    }
    Ok(())
}

/// gather / scatter_add: indices of the source's rank and sizes outside `dim`.
pub(crate) fn gather_shapes(op: &'static str, l: &Layout, il: &Layout, dim: usize) -> Result<()> {
    dim_in_range(op, l, dim)?;
    let ok = l.dims().len() == il.dims().len()
        && l.dims()
            .iter()
            .zip(il.dims())
            .enumerate()
            .all(|(d, (a, b))| d == dim || a == b);
    if !ok {
        return Err(Error::ShapeMismatch {
            op,
            lhs: l.shape().clone(),
            rhs: il.shape().clone(),
        });
    }
    Ok(())
}

/// Distinct dims in range; arg ops reduce exactly one; only sums reduce an empty dim; u32
/// only has argmax/argmin.
pub(crate) fn reduction(op: ReduceOp, l: &Layout, dims: &[usize], dtype: DType) -> Result<()> {
    let rank = l.dims().len();
    let mut seen = vec![false; rank];
    for &d in dims {
        if d >= rank || std::mem::replace(&mut seen[d], true) {
            return Err(Error::invalid(
                op.name(),
                format!("bad reduction dims {dims:?}"),
                l.shape(),
            ));
        }
    }
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    if arg && dims.len() != 1 {
        return Err(Error::invalid(
            op.name(),
            "reduces exactly one dim",
            l.shape(),
        ));
    }
    if !matches!(op, ReduceOp::Sum) && dims.iter().any(|&d| l.dims()[d] == 0) {
        return Err(Error::invalid(
            op.name(),
            "cannot reduce an empty dim",
            l.shape(),
        ));
    }
    if dtype == DType::U32 && !arg {
        return Err(Error::UnsupportedDType {
            op: op.name(),
            dtype,
        });
    }
    Ok(())
}
