//! Pieces the transformer models share: head splitting and merging, the adaLN final layer
//! that Flux and SD3 both have under `final_layer`, and BFL's embedder MLP, QK norm and
//! rotary attention that FLUX.1 and FLUX.2 share.

use crate::nn::{scaled_dot_product_attention, Linear, RmsNorm, VarBuilder};
use crate::{Error, Result, Tensor};

/// LayerNorm epsilon of the DiT blocks and final layers (BFL Flux and Stability's MMDiT:
/// `nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)`).
pub const EPS: f64 = 1e-6;

pub use crate::nn::{merge_heads, split_qkv, split_qkv_rest};

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

/// `in_layer` -> SiLU -> `out_layer` (BFL `MLPEmbedder`: FLUX.1's with biases, FLUX.2's
/// without, `disable_bias=True`).
#[derive(Clone, Debug)]
pub struct MlpEmbedder {
    /// `in_dim -> hidden`.
    pub in_layer: Linear,
    /// `hidden -> hidden`.
    pub out_layer: Linear,
}

impl MlpEmbedder {
    /// The two layers under `vb` (`in_layer`, `out_layer`), with biases or not.
    pub fn new(vb: &VarBuilder, in_dim: usize, hidden: usize, bias: bool) -> Result<Self> {
        Ok(MlpEmbedder {
            in_layer: Linear::new(&vb.pp("in_layer"), in_dim, hidden, bias)?,
            out_layer: Linear::new(&vb.pp("out_layer"), hidden, hidden, bias)?,
        })
    }

    /// x (B, in_dim) -> (B, hidden).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.out_layer.forward(&self.in_layer.forward(x)?.silu()?)
    }
}

/// RMSNorm of queries and keys over the head dim (BFL `QKNorm`: keys `norm.query_norm.scale`,
/// `norm.key_norm.scale`).
#[derive(Clone, Debug)]
pub(crate) struct QkNorm {
    query_norm: RmsNorm,
    key_norm: RmsNorm,
}

impl QkNorm {
    pub(crate) fn new(vb: &VarBuilder, head_dim: usize, eps: f64) -> Result<Self> {
        Ok(QkNorm {
            query_norm: RmsNorm::with_key(&vb.pp("query_norm"), head_dim, eps, "scale")?,
            key_norm: RmsNorm::with_key(&vb.pp("key_norm"), head_dim, eps, "scale")?,
        })
    }

    /// (B, N, 3 D) fused projections -> q, k, v each (B, H, N, E); q and k RMS-normed.
    pub(crate) fn qkv(&self, qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = split_qkv(qkv, heads)?;
        Ok((self.query_norm.forward(&q)?, self.key_norm.forward(&k)?, v))
    }

    /// A single-stream block's fused projection (B, N, 3 D + R) -> q, k, v as [`Self::qkv`]
    /// gives them and the rest (B, N, R), cut as [`split_qkv_rest`] cuts them.
    pub(crate) fn qkv_rest(
        &self,
        x: &Tensor,
        heads: usize,
        d: usize,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (q, k, v, rest) = split_qkv_rest(x, heads, d)?;
        Ok((
            self.query_norm.forward(&q)?,
            self.key_norm.forward(&k)?,
            v,
            rest,
        ))
    }
}

/// RoPE on q and k, attention, heads merged: (B, H, N, E) x3 -> (B, N, D) (BFL `attention`).
pub(crate) fn rope_attention(q: &Tensor, k: &Tensor, v: &Tensor, pe: &Tensor) -> Result<Tensor> {
    merge_heads(&rope_attention_heads(q, k, v, pe)?)
}

/// [`rope_attention`] with the heads apart: (B, H, N, E) x3 -> o (B, H, N, E), for a consumer
/// that merges them as it reads them (`Tensor::cat_gelu_tanh`, `Tensor::merge_heads_quant8`).
pub(crate) fn rope_attention_heads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pe: &Tensor,
) -> Result<Tensor> {
    let (q, k) = (q.apply_rope(pe)?, k.apply_rope(pe)?);
    scaled_dot_product_attention(&q, &k, v, None, false, None)
}

/// Attention's output o (B, H, T + L, E) of a double-stream block (text tokens first) merged
/// into (text (B, T, D), image (B, L, D)) rows for the streams' projections `txt` and `img`,
/// each with its rows' 8-bit codes where both projections take codes of one kind: the merge
/// quantizes as it writes (`Tensor::merge_heads_quant8`; batch 1, where each stream's rows
/// are one range).
pub(crate) fn stream_rows(
    o: &Tensor,
    t_len: usize,
    txt: &Linear,
    img: &Linear,
) -> Result<[(Tensor, Option<crate::Rows8>); 2]> {
    let d = o.dims();
    let l_len = d.get(2).copied().unwrap_or(0).saturating_sub(t_len);
    let code = match (txt.input_code(), img.input_code()) {
        (Some(a), Some(b)) if a == b && d.first() == Some(&1) => Some(a),
        _ => None,
    };
    let (attn, rows8) = match code {
        Some(c) => {
            let (y, r) = o.merge_heads_quant8(c)?;
            (y, Some(r))
        }
        None => (merge_heads(o)?, None),
    };
    let part = |start: usize, len: usize| -> Result<(Tensor, Option<crate::Rows8>)> {
        let rows = match &rows8 {
            Some(r) => Some(crate::Rows8 {
                code: r.code,
                codes: r.codes.narrow(0, start, len)?,
                scales: r.scales.narrow(0, start, len)?,
            }),
            None => None,
        };
        Ok((attn.narrow(1, start, len)?, rows))
    };
    Ok([part(0, t_len)?, part(t_len, l_len)?])
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
