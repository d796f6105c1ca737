//! Pieces the transformer models share: head splitting and merging, and the adaLN final
//! layer that Flux and SD3 both have under `final_layer`.

use crate::nn::{Linear, VarBuilder};
use crate::{Error, Result, Tensor};

/// LayerNorm epsilon of the DiT blocks and final layers (BFL Flux and Stability's MMDiT:
/// `nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)`).
pub const EPS: f64 = 1e-6;

pub use crate::nn::{merge_heads, split_qkv};

/// `adaLN_modulation.1` -> (shift, scale) of a LayerNorm without affine, then `linear`
/// (BFL `LastLayer`, Stability `FinalLayer`).
#[derive(Clone, Debug)]
pub struct FinalLayer {
    pub ada: Linear,
    pub linear: Linear,
}

impl FinalLayer {
    pub fn new(vb: &VarBuilder, hidden: usize, out: usize) -> Result<Self> {
        Ok(FinalLayer {
            ada: Linear::new(&vb.pp("adaLN_modulation").pp("1"), hidden, 2 * hidden, true)?,
            linear: Linear::new(&vb.pp("linear"), hidden, out, true)?,
        })
    }

    /// x (B, N, D), c (B, D) -> (B, N, out).
    pub fn forward(&self, x: &Tensor, c: &Tensor) -> Result<Tensor> {
        let m = self.ada.forward(&c.silu()?)?.unsqueeze(1)?.chunk(2, 2)?;
        let x = x.layer_norm(None, None, EPS)?.modulate(&m[0], &m[1])?;
        self.linear.forward(&x)
    }
}

/// A block's outputs (from `BlockExec::run`) as an array of their expected number.
pub(crate) fn outputs<const N: usize>(v: Vec<Tensor>, what: &str) -> Result<[Tensor; N]> {
    let n = v.len();
    v.try_into()
        .map_err(|_| Error::Autograd(format!("{what} gave {n} outputs, expected {N}")))
}

/// The conditioning tensors of `DiffusionModel::predict` as an array of their expected
/// number, each checked to have its expected rank (with the batch dim).
pub(crate) fn conds<'a, const N: usize>(
    model: &'static str,
    cond: &'a [Tensor],
    ranks: [usize; N],
) -> Result<&'a [Tensor; N]> {
    let arr: &[Tensor; N] = cond.try_into().map_err(|_| {
        Error::invalid(
            model,
            format!("predict takes {N} conditioning tensors, got {}", cond.len()),
            &crate::Shape::from(vec![cond.len()]),
        )
    })?;
    for (t, r) in arr.iter().zip(ranks) {
        if t.rank() != r {
            return Err(Error::invalid(
                model,
                format!("a conditioning tensor must have rank {r} (with the batch dim)"),
                t.shape(),
            ));
        }
    }
    Ok(arr)
}

/// (height, width) of the latents (C, H, W) and the token count of the context (T, D) of a
/// sample's shapes, for the memory planner; an error names what is missing.
pub(crate) fn latent_and_context(
    family: &str,
    sample: &[Vec<usize>],
) -> crate::Result<((usize, usize), usize)> {
    match (sample.first(), sample.get(1)) {
        (Some(l), Some(c)) if l.len() == 3 && c.len() == 2 => Ok(((l[1], l[2]), c[0])),
        _ => Err(crate::Error::Config {
            path: None,
            msg: format!(
                "{family}: the memory plan needs a sample's latents (C, H, W) and context \
                 (T, D), got shapes {sample:?}"
            ),
        }),
    }
}
