//! Convolution and pooling over (N, C, H, W) as functions, written from unfold2d (im2col)
//! and matmul, so they run on every backend and need no backward code. On CUDA the GEMM is
//! cuBLAS: im2col + cuBLAS rather than an implicit-GEMM kernel, because it reaches cuBLAS
//! speed with one code path today; its cost is the column buffer (kh*kw times the input).
//! The layer holding weights and an adapter is `conv.rs`'s `Conv2d`.

use crate::{Error, Result, Tensor, Window2d};

fn window(
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
) -> Window2d {
    Window2d {
        kernel,
        stride,
        padding,
        dilation,
    }
}

/// 2D convolution: x (N, Cin, H, W), weight (Cout, Cin / groups, kh, kw), bias (Cout).
/// Where nothing is recorded (sampling, caching, validation), a column buffer past
/// [`COLUMN_BYTES`] is made a band of output rows at a time ([`conv2d_banded`]).
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> Result<Tensor> {
    if crate::autograd::grad_enabled() {
        conv2d_whole(x, weight, bias, stride, padding, dilation, groups)
    } else {
        conv2d_banded(
            x,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
            COLUMN_BYTES,
        )
    }
}

/// The window of a convolution of x by `weight` and its output size (Ho, Wo), once the
/// shapes are checked to fit together.
fn geometry(
    x: &Tensor,
    weight: &Tensor,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> Result<(Window2d, usize, usize)> {
    let (wd, xd) = (weight.dims(), x.dims());
    let ok = wd.len() == 4
        && xd.len() == 4
        && groups > 0
        && xd[1] % groups == 0
        && wd[0] % groups == 0
        && wd[1] * groups == xd[1];
    if !ok {
        return Err(Error::ShapeMismatch {
            op: "conv2d",
            lhs: x.shape().clone(),
            rhs: weight.shape().clone(),
        });
    }
    let win = window((wd[2], wd[3]), stride, padding, dilation);
    let (ho, wo) = win.out_size(xd[2], xd[3]).ok_or_else(|| {
        Error::invalid("conv2d", format!("window {win:?} does not fit"), x.shape())
    })?;
    Ok((win, ho, wo))
}

/// [`conv2d`] with one column buffer for the whole input.
fn conv2d_whole(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> Result<Tensor> {
    let (win, ho, wo) = geometry(x, weight, stride, padding, dilation, groups)?;
    let (wd, n) = (weight.dims(), x.dims()[0]);
    let (cout, k) = (wd[0], wd[1] * wd[2] * wd[3]);
    // (N, G, K, L) columns against (G, Cout/G, K) weights.
    let cols = x.unfold2d(win)?.reshape(vec![n, groups, k, ho * wo])?;
    let w = weight.reshape((groups, cout / groups, k))?;
    let y = w.matmul(&cols)?.reshape((n, cout, ho, wo))?;
    match bias {
        Some(b) => y.add(&b.reshape((1, cout, 1, 1))?),
        None => Ok(y),
    }
}

/// The largest column buffer (bytes) [`conv2d`] makes at once where no gradient is recorded:
/// past it, the convolution runs a band of output rows at a time ([`conv2d_banded`]). A
/// 3x3 convolution of 128 channels over a 512² f32 tile (the SDXL autoencoder's last
/// decoder level) would otherwise ask for one 1.125 GiB buffer, which a budget's arena of
/// 3 GiB could not place beside the model.
pub const COLUMN_BYTES: usize = 256 << 20;

/// [`conv2d`] a band of output rows at a time, each band's column buffer at most
/// `max_column_bytes` (one output row when a row alone needs more): the same values as the
/// whole convolution (each output is the same dot product), with a column buffer that no
/// longer grows with the image. Each band reads its input rows with the padding's zeros
/// around them.
#[allow(clippy::too_many_arguments)] // conv2d's arguments and the bound
pub fn conv2d_banded(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
    max_column_bytes: usize,
) -> Result<Tensor> {
    let (_, ho, wo) = geometry(x, weight, stride, padding, dilation, groups)?;
    let (wd, xd) = (weight.dims(), x.dims());
    let (n, c, h, w) = (xd[0], xd[1], xd[2], xd[3]);
    let (kh, kw) = (wd[2], wd[3]);
    let row_bytes = (n * c * kh * kw * wo * x.dtype().size_in_bytes()).max(1);
    let rows = (max_column_bytes / row_bytes).clamp(1, ho.max(1));
    if rows >= ho {
        // One band: the whole convolution, its padding as it is.
        return conv2d_whole(x, weight, bias, stride, padding, dilation, groups);
    }
    let (sh, ph, dh) = (stride.0, padding.0, dilation.0);
    let mut bands = vec![];
    let mut r0 = 0;
    while r0 < ho {
        let r1 = (r0 + rows).min(ho);
        // Input rows of output rows r0..r1, in padded coordinates, then clipped to x.
        let (lo, hi) = (r0 * sh, (r1 - 1) * sh + (kh - 1) * dh + 1);
        // Rows a..b of x (a may be negative, b past h): zeros above and below it.
        let (a, b) = (lo as i64 - ph as i64, hi as i64 - ph as i64);
        let (start, end) = (a.clamp(0, h as i64), b.clamp(0, h as i64));
        let end = end.max(start);
        let top = (start - a).clamp(0, b - a) as usize;
        let (start, end) = (start as usize, end as usize);
        let bottom = (hi - lo) - top - (end - start);
        let mut parts = vec![];
        let zeros = |rows: usize| Tensor::zeros((n, c, rows, w), x.dtype(), x.device());
        if top > 0 {
            parts.push(zeros(top)?);
        }
        if end > start {
            parts.push(x.narrow(2, start, end - start)?);
        }
        if bottom > 0 {
            parts.push(zeros(bottom)?);
        }
        let input = if parts.len() == 1 {
            parts.swap_remove(0)
        } else {
            Tensor::cat(&parts.iter().collect::<Vec<_>>(), 2)?
        };
        bands.push(conv2d_whole(
            &input,
            weight,
            bias,
            stride,
            (0, padding.1),
            dilation,
            groups,
        )?);
        r0 = r1;
    }
    Tensor::cat(&bands.iter().collect::<Vec<_>>(), 2)
}

/// The windows of (N, C, H, W) as (N, C, kh * kw, Ho, Wo).
fn windows(x: &Tensor, win: Window2d) -> Result<(Tensor, usize, usize)> {
    let d = x.dims();
    if d.len() != 4 {
        return Err(Error::invalid(
            "pool2d",
            "needs an (N, C, H, W) tensor",
            x.shape(),
        ));
    }
    let (ho, wo) = win.out_size(d[2], d[3]).ok_or_else(|| {
        Error::invalid("pool2d", format!("window {win:?} does not fit"), x.shape())
    })?;
    let k = win.kernel.0 * win.kernel.1;
    Ok((
        x.unfold2d(win)?.reshape(vec![d[0], d[1], k, ho, wo])?,
        ho,
        wo,
    ))
}

/// Average over each window; padding counts as zeros in the average (PyTorch's default,
/// count_include_pad = True).
pub fn avg_pool2d(
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<Tensor> {
    let (w, _, _) = windows(x, window(kernel, stride, padding, (1, 1)))?;
    w.mean(&[2])
}

/// Maximum over each window; padding never wins (it is -inf, as in PyTorch).
pub fn max_pool2d(
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<Tensor> {
    let x = if padding == (0, 0) {
        x.clone()
    } else {
        pad2d(x, padding, f64::NEG_INFINITY)?
    };
    let (w, _, _) = windows(&x, window(kernel, stride, (0, 0), (1, 1)))?;
    w.max(2)
}

/// Pads H and W of (N, C, H, W) with `value` on both sides.
pub fn pad2d(x: &Tensor, (ph, pw): (usize, usize), value: f64) -> Result<Tensor> {
    let d = x.dims().to_vec();
    if d.len() != 4 {
        return Err(Error::invalid(
            "pad2d",
            "needs an (N, C, H, W) tensor",
            x.shape(),
        ));
    }
    let mut y = x.clone();
    if ph > 0 {
        let band = Tensor::full(value, (d[0], d[1], ph, d[3]), x.dtype(), x.device())?;
        y = Tensor::cat(&[&band, &y, &band], 2)?;
    }
    if pw > 0 {
        let band = Tensor::full(
            value,
            (d[0], d[1], d[2] + 2 * ph, pw),
            x.dtype(),
            x.device(),
        )?;
        y = Tensor::cat(&[&band, &y, &band], 3)?;
    }
    Ok(y)
}

/// Average pooling to a fixed (oh, ow), with PyTorch's cell bounds: cell i of n over a size s
/// covers [floor(i s / n), ceil((i + 1) s / n)).
pub fn adaptive_avg_pool2d(x: &Tensor, (oh, ow): (usize, usize)) -> Result<Tensor> {
    let d = x.dims();
    if d.len() != 4 || oh == 0 || ow == 0 {
        return Err(Error::invalid(
            "adaptive_avg_pool2d",
            format!("needs (N, C, H, W) and an output size > 0, got ({oh}, {ow})"),
            x.shape(),
        ));
    }
    let (h, w) = (d[2], d[3]);
    let bounds = |i: usize, n: usize, s: usize| (i * s / n, ((i + 1) * s).div_ceil(n));
    let mut rows = vec![];
    for i in 0..oh {
        let (h0, h1) = bounds(i, oh, h);
        let mut cells = vec![];
        for j in 0..ow {
            let (w0, w1) = bounds(j, ow, w);
            cells.push(
                x.narrow(2, h0, h1 - h0)?
                    .narrow(3, w0, w1 - w0)?
                    .mean_keepdim(&[2, 3])?,
            );
        }
        rows.push(Tensor::cat(&cells.iter().collect::<Vec<_>>(), 3)?);
    }
    Tensor::cat(&rows.iter().collect::<Vec<_>>(), 2)
}
