//! unfold2d (im2col) and fold2d (col2im) on the CPU: parallel over (n, c) planes.

use super::{strided, Elem, Real};
use crate::backend::Window2d;
use crate::{Error, Layout, Result};
use rayon::prelude::*;

/// (N, C, H, W) of a rank-4 layout.
pub(super) fn nchw(op: &'static str, l: &Layout) -> Result<(usize, usize, usize, usize)> {
    match l.dims() {
        &[n, c, h, w] => Ok((n, c, h, w)),
        _ => Err(Error::invalid(
            op,
            "needs an (N, C, H, W) tensor",
            l.shape(),
        )),
    }
}

pub(super) fn unfold<T: Elem>(v: &[T], l: &Layout, win: Window2d) -> Result<Vec<T>> {
    let (_, _, h, w) = nchw("unfold2d", l)?;
    let (ho, wo) = win.out_size(h, w).ok_or_else(|| {
        Error::invalid(
            "unfold2d",
            format!("window {win:?} does not fit"),
            l.shape(),
        )
    })?;
    let x = strided::contiguous(v, l);
    let (kh, kw) = win.kernel;
    let plane = kh * kw * ho * wo;
    let mut out = super::zeroed_vec::<T>(x.len() / (h * w).max(1) * plane, "im2col columns")?;
    if plane == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(plane).enumerate().for_each(|(nc, dst)| {
        let src = &x[nc * h * w..(nc + 1) * h * w];
        for ki in 0..kh {
            for kj in 0..kw {
                for oh in 0..ho {
                    let y =
                        (oh * win.stride.0 + ki * win.dilation.0) as isize - win.padding.0 as isize;
                    for ow in 0..wo {
                        let xx = (ow * win.stride.1 + kj * win.dilation.1) as isize
                            - win.padding.1 as isize;
                        let i = ((ki * kw + kj) * ho + oh) * wo + ow;
                        if y >= 0 && (y as usize) < h && xx >= 0 && (xx as usize) < w {
                            dst[i] = src[y as usize * w + xx as usize];
                        }
                    }
                }
            }
        }
    });
    Ok(out)
}

/// The column index (o) of kernel tap k reading input position `pos`, if any.
#[inline]
fn tap(pos: usize, k: usize, stride: usize, pad: usize, dil: usize, out: usize) -> Option<usize> {
    let t = (pos + pad).checked_sub(k * dil)?;
    (t % stride == 0 && t / stride < out).then_some(t / stride)
}

pub(super) fn fold<T: Elem>(
    v: &[T],
    l: &Layout,
    win: Window2d,
    (h, w): (usize, usize),
) -> Result<Vec<T>> {
    let (kh, kw) = win.kernel;
    let (ho, wo) = win.out_size(h, w).ok_or_else(|| {
        Error::invalid("fold2d", format!("window {win:?} does not fit"), l.shape())
    })?;
    let d = l.dims();
    if d.len() != 3 || d[2] != ho * wo || kh * kw == 0 || d[1] % (kh * kw) != 0 {
        return Err(Error::invalid(
            "fold2d",
            format!("columns must be (N, C * {kh} * {kw}, {})", ho * wo),
            l.shape(),
        ));
    }
    let cols = strided::contiguous(v, l);
    let plane = kh * kw * ho * wo;
    let mut out = super::zeroed_vec::<T>(cols.len() / plane.max(1) * h * w, "col2im output")?;
    if h * w == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(h * w).enumerate().for_each(|(nc, dst)| {
        let src = &cols[nc * plane..(nc + 1) * plane];
        for y in 0..h {
            for x in 0..w {
                let mut acc = T::Acc::from_f64(0.0);
                for ki in 0..kh {
                    let Some(oh) = tap(y, ki, win.stride.0, win.padding.0, win.dilation.0, ho)
                    else {
                        continue;
                    };
                    for kj in 0..kw {
                        let Some(ow) = tap(x, kj, win.stride.1, win.padding.1, win.dilation.1, wo)
                        else {
                            continue;
                        };
                        acc = acc + src[((ki * kw + kj) * ho + oh) * wo + ow].to_acc();
                    }
                }
                dst[y * w + x] = T::from_acc(acc);
            }
        }
    });
    Ok(out)
}
