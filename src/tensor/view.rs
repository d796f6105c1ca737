//! Views (no copy: only the layout changes) and the ops that assemble tensors: contiguous,
//! cat, stack, chunk.

use super::Tensor;
use crate::autograd::{record, Op};
use crate::shape::Dim;
use crate::{Error, Layout, Result, Shape};

/// The storage of [`Tensor::lay_along`] (and of `cat`, whose pieces cover the tensor, each
/// in its region's shape): zeros first only where the pieces leave a gap.
fn lay_storage(
    dims: &[usize],
    dim: usize,
    pieces: &[(usize, usize, &Tensor)],
) -> Result<crate::device::Storage> {
    let shape = Shape::new(dims.to_vec());
    let Some((_, _, first)) = pieces.first() else {
        return Err(Error::invalid("lay_along", "no pieces", &shape));
    };
    let (dtype, device) = (first.dtype(), first.device());
    let out_l = Layout::contiguous(dims.to_vec());
    let covered: usize = pieces.iter().map(|p| p.1).sum();
    let mut dst = if covered == dims.get(dim).copied().unwrap_or(0) {
        device.uninit(&shape, dtype)?
    } else {
        device.full(&shape, dtype, 0.0)?
    };
    for (start, len, t) in pieces {
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                op: "lay_along",
                lhs: dtype,
                rhs: t.dtype(),
            });
        }
        let mismatch = |lhs: &Shape| Error::ShapeMismatch {
            op: "lay_along",
            lhs: lhs.clone(),
            rhs: t.shape().clone(),
        };
        if t.elem_count() != shape.elem_count() / dims[dim].max(1) * len {
            return Err(mismatch(&shape));
        }
        let region = out_l.narrow(dim, *start, *len)?;
        let at = if region.dims() == t.dims() {
            region
        } else {
            region
                .reshape(t.shape())
                .ok_or_else(|| mismatch(region.shape()))?
        };
        t.storage()?.copy_strided(t.layout(), &mut dst, &at)?;
    }
    Ok(dst)
}

impl Tensor {
    /// A view with another shape of the same element count. Free when the strides allow it
    /// (always for contiguous data); otherwise the data is copied first.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.elem_count() != self.elem_count() {
            return Err(Error::ElementCount {
                op: "reshape",
                count: self.elem_count(),
                shape,
            });
        }
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        match self.layout().reshape(&shape) {
            Some(l) => Ok(self.view(l, record(&[self], || Op::Reshape(self.clone())))),
            None => self.contiguous()?.reshape(shape),
        }
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: impl Dim, end: impl Dim) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(1);
        }
        let (s, e) = (
            start.resolve(self.shape(), "flatten")?,
            end.resolve(self.shape(), "flatten")?,
        );
        if s > e {
            return Err(Error::invalid(
                "flatten",
                format!("start {s} after end {e}"),
                self.shape(),
            ));
        }
        let d = self.dims();
        let mut dims = d[..s].to_vec();
        dims.push(d[s..=e].iter().product());
        dims.extend_from_slice(&d[e + 1..]);
        self.reshape(dims)
    }

    /// All dims merged into one: (elem_count,).
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(self.elem_count())
    }

    /// Dims reordered without copying: output dim i is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let l = self.layout().permute(perm)?;
        Ok(self.view(
            l,
            record(&[self], || Op::Permute(self.clone(), perm.to_vec())),
        ))
    }

    /// Dims `d0` and `d1` swapped, without copying.
    pub fn transpose(&self, d0: impl Dim, d1: impl Dim) -> Result<Tensor> {
        let (a, b) = (
            d0.resolve(self.shape(), "transpose")?,
            d1.resolve(self.shape(), "transpose")?,
        );
        if a == b {
            return Ok(self.clone());
        }
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Swaps the last two dims.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::invalid("t", "needs at least 2 dims", self.shape()));
        }
        self.transpose(-2, -1)
    }

    /// `len` entries of `dim` from `start`.
    pub fn narrow(&self, dim: impl Dim, start: usize, len: usize) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "narrow")?;
        if start == 0 && len == self.dims()[d] {
            return Ok(self.clone());
        }
        let l = self.layout().narrow(d, start, len)?;
        Ok(self.view(l, record(&[self], || Op::Narrow(self.clone(), d, start))))
    }

    /// Entries `range` of `dim` (an alias of narrow).
    pub fn slice(&self, dim: impl Dim, range: std::ops::Range<usize>) -> Result<Tensor> {
        self.narrow(dim, range.start, range.end.saturating_sub(range.start))
    }

    /// Stretches size-1 dims and prepends dims, without copying (stride 0).
    pub fn broadcast_as(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let l = self.layout().broadcast_as(&shape)?;
        Ok(self.view(l, record(&[self], || Op::Broadcast(self.clone()))))
    }

    /// Alias of `broadcast_as`.
    pub fn expand(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        self.broadcast_as(shape)
    }

    /// Prepends `left` dims to the shape by broadcasting.
    pub fn broadcast_left(&self, left: &[usize]) -> Result<Tensor> {
        let mut dims = left.to_vec();
        dims.extend_from_slice(self.dims());
        self.broadcast_as(dims)
    }

    /// Removes `dim`, which must have size 1.
    pub fn squeeze(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve(self.shape(), "squeeze")?;
        if self.dims()[d] != 1 {
            return Err(Error::invalid(
                "squeeze",
                format!("dim {d} is not of size 1"),
                self.shape(),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims.remove(d);
        self.reshape(dims)
    }

    /// Inserts a size-1 dim at `dim` (-1: after the last).
    pub fn unsqueeze(&self, dim: impl Dim) -> Result<Tensor> {
        let d = dim.resolve_insert(self.shape(), "unsqueeze")?;
        let mut dims = self.dims().to_vec();
        dims.insert(d, 1);
        self.reshape(dims)
    }

    /// This tensor's values in a storage no other tensor shares (a view of none), dense: the
    /// tensor itself where it is the only handle to its storage and dense, else a copy;
    /// detached either way. What an in-place write (`assign`) may change without changing
    /// another tensor.
    pub fn owned(self) -> Result<Tensor> {
        // No other handle to this tensor, and no other tensor on its storage.
        let alone = std::sync::Arc::strong_count(&self.0) == 1
            && self
                .0
                .storage
                .as_ref()
                .is_some_and(|s| std::sync::Arc::strong_count(s) == 1);
        let t = if alone && self.is_contiguous() {
            self
        } else {
            self.copy_dense()?
        };
        Ok(t.detach())
    }

    /// The same values in a row-major contiguous layout; copies only when needed.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy_dense()
    }

    /// A one-pass copy into a fresh contiguous buffer, recorded as `Op::Copy`.
    fn copy_dense(&self) -> Result<Tensor> {
        let storage = self.storage()?.copy_contiguous(self.layout())?;
        let op = record(&[self], || Op::Copy(self.clone()));
        Ok(Tensor::from_storage(
            storage,
            self.shape().clone(),
            self.device().clone(),
            op,
        ))
    }

    /// A tensor whose buffer is exactly its elements in order (offset 0, nothing else in the
    /// buffer), for kernels that take a bare buffer; copies when `self` is not one.
    pub(crate) fn dense(&self) -> Result<Tensor> {
        let whole = self.is_contiguous()
            && self.layout().offset() == 0
            && self.storage()?.len() == self.elem_count();
        if whole {
            return Ok(self.clone());
        }
        self.copy_dense()
    }

    /// Joins tensors along `dim`; all other dims must agree.
    pub fn cat(tensors: &[&Tensor], dim: impl Dim) -> Result<Tensor> {
        let first = match tensors.first() {
            Some(t) => *t,
            None => {
                return Err(Error::invalid(
                    "cat",
                    "no tensors to join",
                    &Shape::default(),
                ))
            }
        };
        let d = dim.resolve(first.shape(), "cat")?;
        let mut total = 0;
        for t in tensors {
            let same_rest = t.rank() == first.rank()
                && t.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(i, (a, b))| i == d || a == b);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().clone(),
                    rhs: t.shape().clone(),
                });
            }
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            if t.device() != first.device() {
                return Err(Error::DeviceMismatch {
                    op: "cat",
                    lhs: first.device().location(),
                    rhs: t.device().location(),
                });
            }
            total += t.dims()[d];
        }
        if tensors.len() == 1 {
            return Ok(first.clone());
        }
        let mut dims = first.dims().to_vec();
        dims[d] = total;
        let mut pieces = Vec::with_capacity(tensors.len());
        let mut start = 0;
        for t in tensors {
            pieces.push((start, t.dims()[d], *t));
            start += t.dims()[d];
        }
        let dst = lay_storage(&dims, d, &pieces)?;
        let op = record(tensors, || {
            Op::Cat(tensors.iter().map(|t| (*t).clone()).collect(), d)
        });
        Ok(Tensor::from_storage(
            dst,
            Shape::new(dims),
            first.device().clone(),
            op,
        ))
    }

    /// A tensor of `dims` holding `pieces` (start, length, piece) along `dim`, zeros where no
    /// piece is: piece k fills `start..start + length` of `dim`, given in its own shape,
    /// which is that region's or the region's with `dim` split into several (the gradient of
    /// a head split: (B, N, 1, H, E) for a region of H E along the last dim of a (B, N, 3 H
    /// E) projection). Each piece is copied once, strided, into place (`cat`'s copies); a
    /// lone piece that is the whole tensor in its own shape is returned as it is. Pieces must
    /// be disjoint; not recorded (the backward's sums).
    pub(crate) fn lay_along(
        dims: &[usize],
        dim: usize,
        pieces: &[(usize, usize, &Tensor)],
    ) -> Result<Tensor> {
        if let [(0, _, t)] = pieces {
            if t.dims() == dims {
                return Ok((*t).clone());
            }
        }
        let dst = lay_storage(dims, dim, pieces)?;
        let device = pieces[0].2.device().clone();
        Ok(Tensor::from_storage(
            dst,
            Shape::new(dims.to_vec()),
            device,
            None,
        ))
    }

    /// Joins tensors of one shape along a new dim.
    pub fn stack(tensors: &[&Tensor], dim: impl Dim) -> Result<Tensor> {
        let first = match tensors.first() {
            Some(t) => *t,
            None => {
                return Err(Error::invalid(
                    "stack",
                    "no tensors to stack",
                    &Shape::default(),
                ))
            }
        };
        let d = dim.resolve_insert(first.shape(), "stack")?;
        let parts = tensors
            .iter()
            .map(|t| t.unsqueeze(d))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), d)
    }

    /// Splits `dim` into `n` views of (nearly) equal size, the last possibly smaller.
    pub fn chunk(&self, n: usize, dim: impl Dim) -> Result<Vec<Tensor>> {
        let d = dim.resolve(self.shape(), "chunk")?;
        if n == 0 {
            return Err(Error::invalid("chunk", "zero chunks", self.shape()));
        }
        let size = self.dims()[d];
        let step = size.div_ceil(n).max(1);
        (0..size)
            .step_by(step)
            .map(|s| self.narrow(d, s, step.min(size - s)))
            .collect()
    }
}
