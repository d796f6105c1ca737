//! Shapes and strided layouts. A view (reshape, permute, narrow, broadcast, squeeze) changes only
//! the layout; the storage is shared.

use crate::{Error, Result};

/// The sizes of a tensor's dimensions, outermost first; rank 0 (no dims) is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// The shape with these dimension sizes.
    pub fn new(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
    /// The dimension sizes, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements: the product of the dims (1 for a scalar).
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.0.len()];
        let mut acc = 1;
        for (s, &d) in strides.iter_mut().zip(&self.0).rev() {
            *s = acc;
            acc *= d;
        }
        strides
    }
    /// The shape both operands broadcast to (numpy rules: align right, 1 stretches).
    pub fn broadcast_with(&self, rhs: &Shape, op: &'static str) -> Result<Shape> {
        let (a, b) = (self.dims(), rhs.dims());
        let rank = a.len().max(b.len());
        let mut out = vec![0; rank];
        for i in 0..rank {
            let da = if i + a.len() >= rank {
                a[i + a.len() - rank]
            } else {
                1
            };
            let db = if i + b.len() >= rank {
                b[i + b.len() - rank]
            } else {
                1
            };
            out[i] = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => {
                    return Err(Error::BroadcastIncompatible {
                        op,
                        lhs: self.clone(),
                        rhs: rhs.clone(),
                    })
                }
            };
        }
        Ok(Shape(out))
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(vec![d])
    }
}
impl From<(usize, usize)> for Shape {
    fn from(d: (usize, usize)) -> Self {
        Shape(vec![d.0, d.1])
    }
}
impl From<(usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize)) -> Self {
        Shape(vec![d.0, d.1, d.2])
    }
}
impl From<(usize, usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize, usize)) -> Self {
        Shape(vec![d.0, d.1, d.2, d.3])
    }
}

/// A dimension index: a usize, or a negative i32/i64 counting from the end (-1 is the last).
pub trait Dim: Copy {
    /// The index in `0..rank` of `shape`; a `DimOutOfRange` error naming `op` otherwise.
    fn resolve(self, shape: &Shape, op: &'static str) -> Result<usize>;
    /// For ops that insert a dim (unsqueeze, stack): -1 means after the last.
    fn resolve_insert(self, shape: &Shape, op: &'static str) -> Result<usize>;
}

fn resolve_signed(d: i64, bound: usize, shape: &Shape, op: &'static str) -> Result<usize> {
    let r = if d < 0 { d + bound as i64 } else { d };
    if r < 0 || r >= bound as i64 {
        return Err(Error::DimOutOfRange {
            op,
            dim: d,
            shape: shape.clone(),
        });
    }
    Ok(r as usize)
}

impl Dim for usize {
    fn resolve(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self as i64, shape.rank(), shape, op)
    }
    fn resolve_insert(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self as i64, shape.rank() + 1, shape, op)
    }
}
impl Dim for i32 {
    fn resolve(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self as i64, shape.rank(), shape, op)
    }
    fn resolve_insert(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self as i64, shape.rank() + 1, shape, op)
    }
}
impl Dim for i64 {
    fn resolve(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self, shape.rank(), shape, op)
    }
    fn resolve_insert(self, shape: &Shape, op: &'static str) -> Result<usize> {
        resolve_signed(self, shape.rank() + 1, shape, op)
    }
}

/// Where each element lives in storage: element `[i0, i1, ..]` is at
/// `offset + i0 * strides[0] + i1 * strides[1] + ..`. Strides of 0 broadcast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// Row-major strides from offset 0.
    pub fn contiguous(shape: impl Into<Shape>) -> Self {
        Self::contiguous_with_offset(shape, 0)
    }
    /// Row-major strides, starting `offset` elements into the storage.
    pub fn contiguous_with_offset(shape: impl Into<Shape>, offset: usize) -> Self {
        let shape = shape.into();
        let strides = shape.contiguous_strides();
        Layout {
            shape,
            strides,
            offset,
        }
    }
    /// A layout from its parts (strides in elements, one per dim; not checked).
    pub fn new(shape: Shape, strides: Vec<usize>, offset: usize) -> Self {
        Layout {
            shape,
            strides,
            offset,
        }
    }
    /// The view's shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// The view's dimension sizes.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    /// Storage step per dim, in elements (0 for broadcast dims).
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Storage index of the first element.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements in the view.
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }
    /// Row-major contiguous (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }
    /// The storage offsets `[offset, offset + span)` this layout may touch (span 0 if empty).
    pub fn storage_span(&self) -> usize {
        if self.elem_count() == 0 {
            return 0;
        }
        1 + self
            .shape
            .dims()
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum::<usize>()
    }

    /// The view restricted to `start..start + len` along `dim`; an error when that range
    /// passes the end.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let size = self.dims()[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid(
                "narrow",
                format!(
                    "range {start}..{} out of bounds for dim {dim} of size {size}",
                    start + len
                ),
                &self.shape,
            ));
        }
        let mut dims = self.dims().to_vec();
        dims[dim] = len;
        Ok(Layout {
            shape: Shape(dims),
            strides: self.strides.clone(),
            offset: self.offset + start * self.strides[dim],
        })
    }

    /// Dims reordered: output dim i is input dim `perm[i]`; `perm` must be a permutation.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.shape.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::invalid(
                "permute",
                format!("{perm:?} is not a permutation of {rank} dims"),
                &self.shape,
            ));
        }
        Ok(Layout {
            shape: Shape(perm.iter().map(|&p| self.dims()[p]).collect()),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// Expands size-1 dims (and prepends new ones) to `shape` with stride 0.
    pub fn broadcast_as(&self, shape: &Shape) -> Result<Layout> {
        let (src, dst) = (self.dims(), shape.dims());
        let err = || Error::BroadcastIncompatible {
            op: "broadcast_as",
            lhs: self.shape.clone(),
            rhs: shape.clone(),
        };
        if dst.len() < src.len() {
            return Err(err());
        }
        let lead = dst.len() - src.len();
        let mut strides = vec![0; dst.len()];
        for i in 0..src.len() {
            if src[i] == dst[lead + i] {
                strides[lead + i] = self.strides[i];
            } else if src[i] != 1 {
                return Err(err());
            }
        }
        Ok(Layout {
            shape: shape.clone(),
            strides,
            offset: self.offset,
        })
    }

    /// (kept, reduced) for a reduction over `dims`: element r of output o is at
    /// `offset_of(kept, o) + offset_of(reduced, r)`. `kept` has the reduced dims as size 1
    /// (stride 0); `reduced` holds those dims with their strides and offset 0.
    pub fn split_reduced(&self, dims: &[usize]) -> (Layout, Layout) {
        let mut kept = self.dims().to_vec();
        let mut kept_s = self.strides.clone();
        let (mut red, mut red_s) = (vec![], vec![]);
        for &d in dims {
            red.push(self.dims()[d]);
            red_s.push(self.strides[d]);
            kept[d] = 1;
            kept_s[d] = 0;
        }
        (
            Layout::new(Shape(kept), kept_s, self.offset),
            Layout::new(Shape(red), red_s, 0),
        )
    }

    /// A view with a new shape of the same element count, without copying, when the strides
    /// allow it (always for contiguous layouts). None when a copy is needed.
    pub fn reshape(&self, shape: &Shape) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout::contiguous_with_offset(shape.clone(), self.offset));
        }
        if self.elem_count() == 0 {
            return Some(Layout::contiguous_with_offset(shape.clone(), self.offset));
        }
        // General case: ignore size-1 dims, then match groups of old dims against groups of new
        // dims with equal element counts. A group of old dims must be contiguous among itself.
        let old: Vec<(usize, usize)> = self
            .dims()
            .iter()
            .zip(&self.strides)
            .filter(|(&d, _)| d != 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let new_nz: Vec<usize> = (0..shape.rank())
            .filter(|&j| shape.dims()[j] != 1)
            .collect();
        let nd = shape.dims();
        let mut new_s = vec![0; shape.rank()];
        let (mut i, mut j) = (0, 0);
        while i < old.len() {
            if j >= new_nz.len() {
                return None;
            }
            let (i0, j0) = (i, j);
            let (mut op, mut np) = (old[i].0, nd[new_nz[j]]);
            i += 1;
            j += 1;
            while op != np {
                if op < np {
                    op *= old.get(i)?.0;
                    i += 1;
                } else {
                    np *= nd[*new_nz.get(j)?];
                    j += 1;
                }
            }
            if (i0..i - 1).any(|k| old[k].1 != old[k + 1].1 * old[k + 1].0) {
                return None;
            }
            let mut acc = old[i - 1].1;
            for &jj in new_nz[j0..j].iter().rev() {
                new_s[jj] = acc;
                acc *= nd[jj];
            }
        }
        if j != new_nz.len() {
            return None;
        }
        Some(Layout {
            shape: shape.clone(),
            strides: new_s,
            offset: self.offset,
        })
    }
}

#[cfg(feature = "cpu-ref")]
/// Visits every element offset of a layout in row-major order, calling `f(linear_index, offset)`.
/// The innermost dim runs as a tight loop.
pub(crate) fn for_each_offset(l: &Layout, mut f: impl FnMut(usize, usize)) {
    for_each_offset_range(l, 0, l.elem_count(), &mut f)
}

#[cfg(feature = "cpu-ref")]
/// Like `for_each_offset` for the linear indices `[start, end)` only (for splitting work).
pub(crate) fn for_each_offset_range(
    l: &Layout,
    start: usize,
    end: usize,
    f: &mut impl FnMut(usize, usize),
) {
    if start >= end {
        return;
    }
    let dims = l.dims();
    let strides = l.strides();
    let rank = dims.len();
    if rank == 0 {
        f(0, l.offset());
        return;
    }
    // Multi-index of `start`.
    let mut idx = vec![0usize; rank];
    let mut rem = start;
    for d in (0..rank).rev() {
        idx[d] = rem % dims[d];
        rem /= dims[d];
    }
    let mut off = l.offset() + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
    let (inner_d, inner_s) = (dims[rank - 1], strides[rank - 1]);
    let mut lin = start;
    while lin < end {
        let run = (inner_d - idx[rank - 1]).min(end - lin);
        for k in 0..run {
            f(lin + k, off + k * inner_s);
        }
        lin += run;
        if lin >= end {
            break;
        }
        // Carry into the outer dims.
        off += run * inner_s;
        idx[rank - 1] += run;
        let mut d = rank - 1;
        while idx[d] == dims[d] && d > 0 {
            off -= dims[d] * strides[d];
            idx[d] = 0;
            d -= 1;
            idx[d] += 1;
            off += strides[d];
        }
    }
}

#[cfg(all(test, feature = "cpu-ref"))]
mod tests {
    use super::*;

    fn offsets(l: &Layout) -> Vec<usize> {
        let mut v = vec![];
        for_each_offset(l, |_, o| v.push(o));
        v
    }

    #[test]
    fn offsets_of_permuted_and_narrowed_views() {
        let l = Layout::contiguous([2, 3, 4]);
        let p = l.permute(&[2, 0, 1]).unwrap();
        let expect: Vec<usize> = (0..4)
            .flat_map(|k| (0..2).flat_map(move |i| (0..3).map(move |j| i * 12 + j * 4 + k)))
            .collect();
        assert_eq!(offsets(&p), expect);
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!(
            offsets(&n),
            vec![4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23]
        );
        // Every sub-range agrees with the full walk.
        let full = offsets(&p);
        for s in 0..full.len() {
            for e in s..=full.len() {
                let mut v = vec![];
                for_each_offset_range(&p, s, e, &mut |i, o| v.push((i, o)));
                let want: Vec<_> = (s..e).map(|i| (i, full[i])).collect();
                assert_eq!(v, want);
            }
        }
    }

    #[test]
    fn reshape_views_non_contiguous_when_possible() {
        // (4, 6) transposed to (6, 4): merging is impossible, splitting dim 0 is fine.
        let t = Layout::contiguous([4, 6]).permute(&[1, 0]).unwrap();
        assert!(t.reshape(&Shape::from([24])).is_none());
        let s = t.reshape(&Shape::from([2, 3, 4])).unwrap();
        assert_eq!(s.strides(), &[3, 1, 6]);
        // A narrowed contiguous row block merges.
        let n = Layout::contiguous([5, 6]).narrow(0, 1, 3).unwrap();
        let m = n.reshape(&Shape::from([18])).unwrap();
        assert_eq!((m.strides(), m.offset()), (&[1usize][..], 6));
        // A narrowed column block does not merge.
        let c = Layout::contiguous([5, 6]).narrow(1, 1, 3).unwrap();
        assert!(c.reshape(&Shape::from([15])).is_none());
        assert_eq!(
            c.reshape(&Shape::from([5, 1, 3])).unwrap().strides(),
            &[6, 0, 1]
        );
    }

    #[test]
    fn broadcast_rules() {
        let a = Shape::from([3, 1, 5]);
        let b = Shape::from([4, 1]);
        assert_eq!(a.broadcast_with(&b, "t").unwrap(), Shape::from([3, 4, 5]));
        assert!(Shape::from([3])
            .broadcast_with(&Shape::from([4]), "t")
            .is_err());
        let l = Layout::contiguous([4, 1])
            .broadcast_as(&Shape::from([3, 4, 5]))
            .unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
    }
}
