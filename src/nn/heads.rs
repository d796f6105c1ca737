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

/// Attention output (B, H, N, E) -> (B, N, H E).
pub fn merge_heads(o: &Tensor) -> Result<Tensor> {
    let d = o.dims().to_vec();
    o.transpose(1, 2)?.reshape((d[0], d[2], d[1] * d[3]))
}
