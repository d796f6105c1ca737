//! The head layout of multi-head attention: a fused q/k/v projection split into heads, and
//! the heads merged back (shared by the models and the text encoders).

use crate::{Error, Result, Tensor};

/// A fused projection (B, N, 3 D) -> q, k, v each (B, H, N, E), as strided views.
pub fn split_qkv(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let d = qkv.dims();
    if d.len() != 3 || heads == 0 || d[2] % (3 * heads) != 0 {
        return Err(Error::invalid(
            "split_qkv",
            format!("needs (B, N, 3 x {heads} x head dim)"),
            qkv.shape(),
        ));
    }
    let (b, n, e) = (d[0], d[1], d[2] / (3 * heads));
    // Narrowed before the heads are permuted: the same views, but the backward then lays
    // the three gradients side by side straight into the projection's layout (one copy)
    // instead of into the permuted one and copying that again to undo the permute.
    let qkv = qkv.reshape(vec![b, n, 3, heads, e])?;
    let pick = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
    Ok((pick(0)?, pick(1)?, pick(2)?))
}

/// A fused projection followed by more channels (B, N, 3 D + R), a single-stream block's
/// `linear1` output (q, k and v side by side, then the MLP's input) -> q, k, v each
/// (B, H, N, E) and the rest (B, N, R), all strided views of `x` with D = `d`.
///
/// Where R is a multiple of the head width E and `x` is contiguous, the four are cut from one
/// view of `x` as (B, N, 3 H + R / E, E), so the backward lays their four gradients side by
/// side into `x`'s in one copy. Otherwise q, k and v come from the first 3 D channels as
/// [`split_qkv`] cuts them, and their gradients are laid into those channels' layout first,
/// then beside the rest's: a second copy of the same values. The gradients are the same
/// either way (each element takes exactly one slice's value).
pub fn split_qkv_rest(
    x: &Tensor,
    heads: usize,
    d: usize,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dims = x.dims();
    if dims.len() != 3 || heads == 0 || d == 0 || d % heads != 0 || dims[2] < 3 * d {
        return Err(Error::invalid(
            "split_qkv_rest",
            format!("needs (B, N, 3 x {d} + R) with {d} a multiple of {heads} heads"),
            x.shape(),
        ));
    }
    let (b, n, w) = (dims[0], dims[1], dims[2]);
    let (e, r) = (d / heads, w - 3 * d);
    if r % e == 0 && x.is_contiguous() {
        let x4 = x.reshape(vec![b, n, w / e, e])?;
        let pick = |i: usize| x4.narrow(2, i * heads, heads)?.permute(&[0, 2, 1, 3]);
        let rest = x4.narrow(2, 3 * heads, r / e)?.reshape(vec![b, n, r])?;
        return Ok((pick(0)?, pick(1)?, pick(2)?, rest));
    }
    let (q, k, v) = split_qkv(&x.narrow(2, 0, 3 * d)?, heads)?;
    Ok((q, k, v, x.narrow(2, 3 * d, r)?))
}

/// Attention output (B, H, N, E) -> (B, N, H E).
pub fn merge_heads(o: &Tensor) -> Result<Tensor> {
    let d = o.dims().to_vec();
    o.transpose(1, 2)?.reshape((d[0], d[2], d[1] * d[3]))
}
