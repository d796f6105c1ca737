//! Layouts as kernels see them, and launch shapes.

use crate::{Error, Layout, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

pub(crate) const MAX_RANK: usize = 8;
const CONTIGUOUS: u32 = 1;
const INDEX32: u32 = 2;
/// The innermost merged dim has stride 1 and a multiple of 8 elements; bits 8..12 hold log2
/// of a power of two (at most 16) dividing the offset and the other strides (`packs8` in
/// cuda/common.cuh: the kernels then move 8 elements per address computation).
const ROWS8: u32 = 4;

/// `StridedLayout` of cuda/common.cuh, passed to kernels by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct KernelLayout {
    rank: u32,
    /// CONTIGUOUS | INDEX32 | ROWS8 and the pack alignment, as in cuda/common.cuh.
    flags: u32,
    offset: u64,
    dims: [u64; MAX_RANK],
    strides: [u64; MAX_RANK],
}

// SAFETY: a plain repr(C) struct of integers, laid out as the C struct the kernels declare.
unsafe impl DeviceRepr for KernelLayout {}

/// Drops size-1 dims and merges dims that are contiguous with each other, so a view of rank
/// up to any size usually fits MAX_RANK and strided indexing does fewer divisions.
fn collapse(l: &Layout) -> (Vec<u64>, Vec<u64>) {
    collapse_dims(l.dims(), l.strides())
}

/// [`collapse`] of dims `dims_in` with `strides_in` (the leading dims of a view, say).
pub(crate) fn collapse_dims(dims_in: &[usize], strides_in: &[usize]) -> (Vec<u64>, Vec<u64>) {
    let mut dims: Vec<u64> = vec![];
    let mut strides: Vec<u64> = vec![];
    for (&d, &s) in dims_in.iter().zip(strides_in) {
        if d == 1 {
            continue;
        }
        match (dims.last_mut(), strides.last_mut()) {
            (Some(pd), Some(ps)) if *ps == s as u64 * d as u64 => {
                *pd *= d as u64;
                *ps = s as u64;
            }
            _ => {
                dims.push(d as u64);
                strides.push(s as u64);
            }
        }
    }
    (dims, strides)
}

impl KernelLayout {
    pub(crate) fn new(l: &Layout, op: &'static str) -> Result<Self> {
        let (d, s) = collapse(l);
        if d.len() > MAX_RANK {
            return Err(Error::invalid(
                op,
                format!(
                    "a view of more than {MAX_RANK} non-mergeable dims; make it contiguous first"
                ),
                l.shape(),
            ));
        }
        let mut k = KernelLayout {
            rank: d.len() as u32,
            flags: if l.is_contiguous() { CONTIGUOUS } else { 0 }
                | if (l.elem_count() as u64) < (1u64 << 32) {
                    INDEX32
                } else {
                    0
                },
            offset: l.offset() as u64,
            dims: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        k.dims[..d.len()].copy_from_slice(&d);
        k.strides[..s.len()].copy_from_slice(&s);
        k.flags |= rows8(l.offset() as u64, &d, &s);
        Ok(k)
    }
}

/// ROWS8 and the pack alignment (log2, in bits 8..12) of merged dims `d` with strides `s`:
/// set where the innermost dim has stride 1 and a multiple of 8 elements, so elements
/// 8v .. 8v + 7 in row-major order sit side by side; the alignment is the largest power of
/// two up to 16 dividing the offset and every other stride of a dim longer than one (the
/// merged dims have none of length one).
fn rows8(offset: u64, d: &[u64], s: &[u64]) -> u32 {
    match (d.last(), s.last()) {
        (Some(&n), Some(&1)) if n % 8 == 0 => {
            let g = s[..s.len() - 1]
                .iter()
                .fold(offset, |g, &st| g | st)
                .trailing_zeros()
                .min(4);
            ROWS8 | (g << 8)
        }
        _ => 0,
    }
}

/// A grid-stride launch over `work` items: enough blocks to fill the GPU, no more.
pub(crate) fn grid_for(work: usize, sm_count: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    let blocks = work.div_ceil(THREADS).clamp(1, sm_count.max(1) * 32);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Work items of an elementwise kernel: 8 elements per item on the packed path.
pub(crate) fn elementwise_grid(n: usize, sm_count: usize) -> LaunchConfig {
    grid_for(n.div_ceil(8).max(1), sm_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    #[test]
    fn collapse_merges_contiguous_runs_and_drops_unit_dims() {
        let l = Layout::contiguous([2, 1, 3, 4]);
        assert_eq!(collapse(&l), (vec![24], vec![1]));
        let t = Layout::contiguous([2, 3, 4]).permute(&[0, 2, 1]).unwrap();
        assert_eq!(collapse(&t), (vec![2, 4, 3], vec![12, 1, 4]));
        let b = Layout::contiguous([3])
            .broadcast_as(&Shape::from([5, 3]))
            .unwrap();
        assert_eq!(collapse(&b), (vec![5, 3], vec![0, 1]));
    }

    fn flags(l: &Layout) -> u32 {
        KernelLayout::new(l, "test").unwrap().flags & !(CONTIGUOUS | INDEX32)
    }

    #[test]
    fn rows_of_whole_packs_and_their_alignment() {
        let pack = |log2: u32| ROWS8 | (log2 << 8);
        // The mlp half of a single block's projection: rows of 12288 in rows of 21504, from
        // column 9216: aligned to 16 elements (2^4).
        let h = Layout::contiguous([1, 4608, 21504]);
        assert_eq!(flags(&h.narrow(2, 9216, 12288).unwrap()), pack(4));
        // Off by 4 elements: packs of 8 bf16 would straddle 16 bytes, of f32 not (2^2).
        assert_eq!(flags(&h.narrow(2, 4, 16).unwrap()), pack(2));
        // A row broadcast over a matrix (a gate or a bias): stride 0 is aligned to anything.
        let row = Layout::contiguous([1, 1, 24])
            .broadcast_as(&Shape::from([1, 5, 24]))
            .unwrap();
        assert_eq!(flags(&row), pack(4));
        // Heads permuted with the head dim innermost: (B, H, L, D) over (B, L, H, D).
        let heads = Layout::contiguous([2, 7, 3, 64])
            .permute(&[0, 2, 1, 3])
            .unwrap();
        assert_eq!(flags(&heads), pack(4));
        // Rows not a whole number of packs, a strided innermost dim, an odd offset.
        assert_eq!(flags(&h.narrow(2, 0, 12).unwrap()), 0);
        assert_eq!(
            flags(&Layout::contiguous([8, 8]).permute(&[1, 0]).unwrap()),
            0
        );
        assert_eq!(flags(&h.narrow(2, 3, 8).unwrap()), pack(0));
        // A contiguous run from an offset of 24: aligned to 8 elements.
        assert_eq!(
            flags(&Layout::contiguous([10, 24]).narrow(0, 1, 3).unwrap()),
            pack(3)
        );
    }
}
