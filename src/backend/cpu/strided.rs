//! Parallel maps over strided views. Work is split into chunks of the output's linear index;
//! each chunk walks the input layouts from its first element.

use crate::shape::for_each_offset_range;
use crate::Layout;
use rayon::prelude::*;

/// Below this many elements a map runs on the calling thread.
const PAR_MIN: usize = 1 << 15;
const CHUNK: usize = 1 << 14;

/// The storage offsets of the linear indices `[start, end)` of `l`.
fn offsets(l: &Layout, start: usize, end: usize, buf: &mut Vec<usize>) {
    buf.clear();
    for_each_offset_range(l, start, end, &mut |_, o| buf.push(o));
}

fn chunked<U: bytemuck::Pod + Send>(n: usize, fill: impl Fn(usize, &mut [U]) + Sync) -> Vec<U> {
    let mut out = vec![U::zeroed(); n];
    if n < PAR_MIN {
        fill(0, &mut out);
    } else {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| fill(c * CHUNK, chunk));
    }
    out
}

pub fn map1<T: Copy + Sync, U: bytemuck::Pod + Send>(
    src: &[T],
    l: &Layout,
    f: impl Fn(T) -> U + Sync,
) -> Vec<U> {
    let n = l.elem_count();
    if l.is_contiguous() {
        let s = &src[l.offset()..l.offset() + n];
        return if n < PAR_MIN {
            s.iter().map(|&x| f(x)).collect()
        } else {
            s.par_iter().map(|&x| f(x)).collect()
        };
    }
    chunked(n, |start, out| {
        let mut k = 0;
        for_each_offset_range(l, start, start + out.len(), &mut |_, o| {
            out[k] = f(src[o]);
            k += 1;
        });
    })
}

pub fn map2<A: Copy + Sync, B: Copy + Sync, U: bytemuck::Pod + Send>(
    a: &[A],
    al: &Layout,
    b: &[B],
    bl: &Layout,
    f: impl Fn(A, B) -> U + Sync,
) -> Vec<U> {
    let n = al.elem_count();
    if al.is_contiguous() && bl.is_contiguous() {
        let (a, b) = (
            &a[al.offset()..al.offset() + n],
            &b[bl.offset()..bl.offset() + n],
        );
        return if n < PAR_MIN {
            a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
        } else {
            a.par_iter()
                .zip(b.par_iter())
                .map(|(&x, &y)| f(x, y))
                .collect()
        };
    }
    chunked(n, |start, out| {
        let (mut oa, mut ob) = (Vec::with_capacity(out.len()), Vec::with_capacity(out.len()));
        offsets(al, start, start + out.len(), &mut oa);
        offsets(bl, start, start + out.len(), &mut ob);
        for ((o, &i), &j) in out.iter_mut().zip(&oa).zip(&ob) {
            *o = f(a[i], b[j]);
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub fn map3<A: Copy + Sync, B: Copy + Sync, C: Copy + Sync, U: bytemuck::Pod + Send>(
    a: &[A],
    al: &Layout,
    b: &[B],
    bl: &Layout,
    c: &[C],
    cl: &Layout,
    f: impl Fn(A, B, C) -> U + Sync,
) -> Vec<U> {
    let n = al.elem_count();
    chunked(n, |start, out| {
        let end = start + out.len();
        let (mut oa, mut ob, mut oc) = (vec![], vec![], vec![]);
        offsets(al, start, end, &mut oa);
        offsets(bl, start, end, &mut ob);
        offsets(cl, start, end, &mut oc);
        for (k, o) in out.iter_mut().enumerate() {
            *o = f(a[oa[k]], b[ob[k]], c[oc[k]]);
        }
    })
}

/// Writes the view `sl` of `src` into the view `dl` of `dst` (same shape).
pub fn copy<T: Copy + Send + Sync>(src: &[T], sl: &Layout, dst: &mut [T], dl: &Layout) {
    let n = sl.elem_count();
    if sl.is_contiguous() && dl.is_contiguous() {
        dst[dl.offset()..dl.offset() + n].copy_from_slice(&src[sl.offset()..sl.offset() + n]);
        return;
    }
    if dl.is_contiguous() {
        let d = &mut dst[dl.offset()..dl.offset() + n];
        if n < PAR_MIN {
            for_each_offset_range(sl, 0, n, &mut |i, o| d[i] = src[o]);
        } else {
            d.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
                let start = c * CHUNK;
                for_each_offset_range(sl, start, start + chunk.len(), &mut |i, o| {
                    chunk[i - start] = src[o]
                });
            });
        }
        return;
    }
    // A strided destination (a narrow of a larger tensor): sequential, since views may not be
    // provably disjoint per chunk.
    let mut so = Vec::with_capacity(n);
    offsets(sl, 0, n, &mut so);
    let mut k = 0;
    for_each_offset_range(dl, 0, n, &mut |_, o| {
        dst[o] = src[so[k]];
        k += 1;
    });
}

/// A contiguous copy of the view (borrowed when already contiguous).
pub fn contiguous<'a, T: Copy + Send + Sync + bytemuck::Pod>(
    src: &'a [T],
    l: &Layout,
) -> std::borrow::Cow<'a, [T]> {
    if l.is_contiguous() {
        std::borrow::Cow::Borrowed(&src[l.offset()..l.offset() + l.elem_count()])
    } else {
        std::borrow::Cow::Owned(map1(src, l, |x| x))
    }
}
