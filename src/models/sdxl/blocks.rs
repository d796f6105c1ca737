//! The UNet's blocks, by LDM key path (sgm `openaimodel.py` / `attention.py`); diffusers'
//! ResnetBlock2D, Transformer2DModel, BasicTransformerBlock, Downsample2D and Upsample2D
//! compute the same. Shape letters: B batch, C channels, H x W spatial, L = H W tokens,
//! T text tokens, D = C model width, N heads, E head dim (D = N E).

use crate::models::common::merge_heads;
use crate::nn::{
    scaled_dot_product_attention, upsample_nearest2d, Conv2d, Conv2dConfig, GroupNorm, LayerNorm,
    Linear, VarBuilder,
};
use crate::{Error, Result, Tensor};

/// GroupNorm epsilon of ResBlocks and the output norm (sgm `GroupNorm32` default 1e-5,
/// diffusers `norm_eps` 1e-5).
pub const RESNET_EPS: f64 = 1e-5;
/// GroupNorm epsilon before a SpatialTransformer (sgm `Normalize`: `eps=1e-6`; diffusers
/// `Transformer2DModel.norm`: `eps=1e-6`).
pub const TRANSFORMER_NORM_EPS: f64 = 1e-6;
/// LayerNorm epsilon inside transformer blocks (PyTorch's `nn.LayerNorm` default, diffusers
/// `norm_eps` 1e-5).
pub const LAYER_NORM_EPS: f64 = 1e-5;
/// Feed-forward width multiplier (sgm `FeedForward(mult=4)`, diffusers `FeedForward(mult=4)`).
const FF_MULT: usize = 4;

fn conv3x3(vb: &VarBuilder, cin: usize, cout: usize, stride: usize) -> Result<Conv2d> {
    let cfg = Conv2dConfig {
        stride,
        padding: 1,
        ..Default::default()
    };
    Conv2d::new(vb, cin, cout, 3, cfg)
}

/// `in_layers` (GroupNorm, SiLU, conv 3x3), `emb_layers.1` (Linear of SiLU(emb)) added per
/// channel, `out_layers` (GroupNorm, SiLU, dropout, conv 3x3), plus the input through
/// `skip_connection` (conv 1x1) when the channels change (sgm `ResBlock`, diffusers
/// `ResnetBlock2D` with time_embedding_norm "default").
#[derive(Clone, Debug)]
pub struct ResBlock {
    /// `in_layers.0`: GroupNorm over Cin.
    pub norm1: GroupNorm,
    /// `in_layers.2`: conv 3x3, Cin -> Cout.
    pub conv1: Conv2d,
    /// `emb_layers.1`: the embedding De -> Cout.
    pub emb: Linear,
    /// `out_layers.0`: GroupNorm over Cout.
    pub norm2: GroupNorm,
    /// `out_layers.3`: conv 3x3, Cout -> Cout.
    pub conv2: Conv2d,
    /// `skip_connection`: conv 1x1 Cin -> Cout, when they differ.
    pub skip: Option<Conv2d>,
}

impl ResBlock {
    /// The block's weights under `vb`: `cin` -> `cout` channels, an `emb_dim`-wide embedding,
    /// GroupNorms of `groups` groups.
    pub fn new(
        vb: &VarBuilder,
        cin: usize,
        cout: usize,
        emb_dim: usize,
        groups: usize,
    ) -> Result<Self> {
        Ok(ResBlock {
            norm1: GroupNorm::new(&vb.pp("in_layers").pp(0), groups, cin, RESNET_EPS, true)?,
            conv1: conv3x3(&vb.pp("in_layers").pp(2), cin, cout, 1)?,
            emb: Linear::new(&vb.pp("emb_layers").pp(1), emb_dim, cout, true)?,
            norm2: GroupNorm::new(&vb.pp("out_layers").pp(0), groups, cout, RESNET_EPS, true)?,
            conv2: conv3x3(&vb.pp("out_layers").pp(3), cout, cout, 1)?,
            skip: if cin != cout {
                Some(Conv2d::new(
                    &vb.pp("skip_connection"),
                    cin,
                    cout,
                    1,
                    Conv2dConfig::default(),
                )?)
            } else {
                None
            },
        })
    }

    /// x (B, Cin, H, W), emb_act = SiLU(emb) (B, De) -> (B, Cout, H, W).
    pub fn forward(&self, x: &Tensor, emb_act: &Tensor) -> Result<Tensor> {
        self.forward_as(x, emb_act, false)
    }

    /// `forward` as a checkpointed unit's last work (`SdxlConfig::units`): `conv2`'s output,
    /// summed into the skip, is then read by no gradient of the unit's re-run
    /// (`Conv2d::forward_tail`). Only for a call whose output is the checkpoint's.
    pub fn forward_unit(&self, x: &Tensor, emb_act: &Tensor) -> Result<Tensor> {
        self.forward_as(x, emb_act, true)
    }

    fn forward_as(&self, x: &Tensor, emb_act: &Tensor, unit: bool) -> Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward(x)?.silu()?)?;
        let e = self.emb.forward(emb_act)?;
        let (b, c) = (e.dims()[0], e.dims()[1]);
        let h = h.add(&e.reshape((b, c, 1, 1))?)?;
        let h = self
            .conv2
            .forward_tail(&self.norm2.forward(&h)?.silu()?, unit)?;
        let x = match &self.skip {
            Some(s) => s.forward(x)?,
            None => x.clone(),
        };
        x.add(&h)
    }
}

/// Multi-head attention with `to_q`, `to_k`, `to_v` (no bias) and `to_out.0` (sgm
/// `CrossAttention`, diffusers `Attention` with `AttnProcessor2_0`); keys and values come
/// from the context when given (cross-attention), else from x.
#[derive(Clone, Debug)]
pub struct Attention {
    /// Queries D -> D.
    pub to_q: Linear,
    /// Keys Dc -> D (Dc = D for self-attention).
    pub to_k: Linear,
    /// Values Dc -> D.
    pub to_v: Linear,
    /// `to_out.0`: output projection D -> D, with bias.
    pub to_out: Linear,
    /// Number of heads N.
    pub heads: usize,
}

impl Attention {
    /// The projections under `vb`: width `dim` (D), keys and values from `kv_dim` (Dc).
    pub fn new(vb: &VarBuilder, dim: usize, kv_dim: usize, heads: usize) -> Result<Self> {
        Ok(Attention {
            to_q: Linear::new(&vb.pp("to_q"), dim, dim, false)?,
            to_k: Linear::new(&vb.pp("to_k"), kv_dim, dim, false)?,
            to_v: Linear::new(&vb.pp("to_v"), kv_dim, dim, false)?,
            to_out: Linear::new(&vb.pp("to_out").pp(0), dim, dim, true)?,
            heads,
        })
    }

    /// (B, L, D) -> (B, N, L, E).
    fn split(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dims();
        let (b, l, e) = (d[0], d[1], d[2] / self.heads);
        x.reshape(vec![b, l, self.heads, e])?.transpose(1, 2)
    }

    /// x (B, L, D), context (B, T, Dc) or None -> (B, L, D); softmax(q k^T / sqrt(E)) v.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        let kv = context.unwrap_or(x);
        let q = self.split(&self.to_q.forward(x)?)?;
        let k = self.split(&self.to_k.forward(kv)?)?;
        let v = self.split(&self.to_v.forward(kv)?)?;
        let o = scaled_dot_product_attention(&q, &k, &v, None, false, None)?;
        self.to_out.forward(&merge_heads(&o)?)
    }
}

/// `net.0.proj` -> GEGLU -> `net.2`: (hidden, gate) = chunk(2) of a 2 x 4 D projection,
/// hidden * GELU(gate) with the exact (erf) GELU (sgm `GEGLU`, diffusers `GEGLU`: `F.gelu`).
#[derive(Clone, Debug)]
pub struct FeedForward {
    /// `net.0.proj`: D -> 2 x 4 D (hidden and gate).
    pub proj: Linear,
    /// `net.2`: 4 D -> D.
    pub out: Linear,
}

impl FeedForward {
    /// The two projections under `vb` for width `dim`.
    pub fn new(vb: &VarBuilder, dim: usize) -> Result<Self> {
        let inner = FF_MULT * dim;
        Ok(FeedForward {
            proj: Linear::new(&vb.pp("net").pp(0).pp("proj"), dim, 2 * inner, true)?,
            out: Linear::new(&vb.pp("net").pp(2), inner, dim, true)?,
        })
    }

    /// x (B, L, D) -> (B, L, D).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_tail(x, false)
    }

    /// `forward` where, with `unread`, a checkpoint's re-run reads nothing of the output
    /// (`Linear::forward_tail`: a unit that ends by adding it to its input).
    pub fn forward_tail(&self, x: &Tensor, unread: bool) -> Result<Tensor> {
        let hg = self.proj.forward(x)?.chunk(2, -1)?;
        self.out.forward_tail(&hg[0].mul(&hg[1].gelu()?)?, unread)
    }
}

/// Pre-LayerNorm self-attention, cross-attention and feed-forward, each residual (sgm
/// `BasicTransformerBlock`, diffusers `BasicTransformerBlock` with norm_type "layer_norm").
#[derive(Clone, Debug)]
pub struct TransformerBlock {
    /// LayerNorm before self-attention.
    pub norm1: LayerNorm,
    /// Self-attention.
    pub attn1: Attention,
    /// LayerNorm before cross-attention.
    pub norm2: LayerNorm,
    /// Cross-attention to the text context.
    pub attn2: Attention,
    /// LayerNorm before the feed-forward.
    pub norm3: LayerNorm,
    /// The GEGLU feed-forward.
    pub ff: FeedForward,
}

impl TransformerBlock {
    /// The block's weights under `vb`: width `dim` (D), context width `context_dim` (Dc).
    pub fn new(vb: &VarBuilder, dim: usize, context_dim: usize, heads: usize) -> Result<Self> {
        let ln = |n: &str| LayerNorm::new(&vb.pp(n), dim, LAYER_NORM_EPS, true);
        Ok(TransformerBlock {
            norm1: ln("norm1")?,
            attn1: Attention::new(&vb.pp("attn1"), dim, dim, heads)?,
            norm2: ln("norm2")?,
            attn2: Attention::new(&vb.pp("attn2"), dim, context_dim, heads)?,
            norm3: ln("norm3")?,
            ff: FeedForward::new(&vb.pp("ff"), dim)?,
        })
    }

    /// x (B, L, D), context (B, T, Dc) -> (B, L, D).
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        self.forward_as(x, context, false)
    }

    /// `forward` as a checkpointed unit of its own (`SdxlConfig::units`): its output, the
    /// feed-forward's summed into `x`, is then read by no gradient of the unit's re-run
    /// (`FeedForward::forward_tail`). Only for a call whose output is the checkpoint's.
    pub fn forward_unit(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        self.forward_as(x, context, true)
    }

    fn forward_as(&self, x: &Tensor, context: &Tensor, unit: bool) -> Result<Tensor> {
        let x = x.add(&self.attn1.forward(&self.norm1.forward(x)?, None)?)?;
        let x = x.add(
            &self
                .attn2
                .forward(&self.norm2.forward(&x)?, Some(context))?,
        )?;
        x.add(&self.ff.forward_tail(&self.norm3.forward(&x)?, unit)?)
    }
}

/// `norm` (GroupNorm, eps 1e-6), `proj_in` (Linear) on the (B, L, C) tokens, the
/// `transformer_blocks`, `proj_out`, plus the input (sgm `SpatialTransformer` with
/// `use_linear`, diffusers `Transformer2DModel` with `use_linear_projection`).
#[derive(Clone, Debug)]
pub struct SpatialTransformer {
    /// GroupNorm over the C channels.
    pub norm: GroupNorm,
    /// C -> C on the tokens.
    pub proj_in: Linear,
    /// `transformer_blocks.0..depth`.
    pub blocks: Vec<TransformerBlock>,
    /// C -> C on the tokens.
    pub proj_out: Linear,
}

impl SpatialTransformer {
    /// The weights under `vb`: `channels` (C = D), `depth` transformer blocks of `heads`
    /// heads, text context of width `context_dim`, GroupNorm of `groups` groups.
    pub fn new(
        vb: &VarBuilder,
        channels: usize,
        depth: usize,
        heads: usize,
        context_dim: usize,
        groups: usize,
    ) -> Result<Self> {
        let blocks = (0..depth)
            .map(|j| {
                TransformerBlock::new(
                    &vb.pp("transformer_blocks").pp(j),
                    channels,
                    context_dim,
                    heads,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SpatialTransformer {
            norm: GroupNorm::new(&vb.pp("norm"), groups, channels, TRANSFORMER_NORM_EPS, true)?,
            proj_in: Linear::new(&vb.pp("proj_in"), channels, channels, true)?,
            blocks,
            proj_out: Linear::new(&vb.pp("proj_out"), channels, channels, true)?,
        })
    }

    /// x (B, C, H, W), context (B, T, Dc) -> (B, C, H, W).
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        let mut t = self.tokens_in(x)?;
        for block in &self.blocks {
            t = block.forward(&t, context)?;
        }
        self.tokens_out(&t, x)
    }

    /// Before the layers: x (B, C, H, W) normed and projected to tokens (B, H x W, C).
    pub fn tokens_in(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = bchw(x)?;
        let t = self
            .norm
            .forward(x)?
            .permute(&[0, 2, 3, 1])?
            .reshape((b, h * w, c))?;
        self.proj_in.forward(&t)
    }

    /// After the layers: tokens t (B, H x W, C) projected back onto x (B, C, H, W), the
    /// block's input, as the residual.
    pub fn tokens_out(&self, t: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = bchw(x)?;
        let t = self.proj_out.forward(t)?;
        t.reshape(vec![b, h, w, c])?.permute(&[0, 3, 1, 2])?.add(x)
    }
}

/// The sizes of a feature map x (B, C, H, W).
fn bchw(x: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match *x.dims() {
        [b, c, h, w] => Ok((b, c, h, w)),
        _ => Err(Error::invalid(
            "sdxl spatial transformer",
            "x must be (B, C, H, W)",
            x.shape(),
        )),
    }
}

/// `op`: conv 3x3 with stride 2 and padding 1: H -> floor((H - 1) / 2) + 1 (sgm
/// `Downsample`, diffusers `Downsample2D` with `downsample_padding` 1).
#[derive(Clone, Debug)]
pub struct Downsample {
    /// The strided conv 3x3, C -> C.
    pub op: Conv2d,
}

impl Downsample {
    /// The conv under `vb` (`op`) for `channels` channels.
    pub fn new(vb: &VarBuilder, channels: usize) -> Result<Self> {
        Ok(Downsample {
            op: conv3x3(&vb.pp("op"), channels, channels, 2)?,
        })
    }

    /// x (B, C, H, W) -> (B, C, floor((H - 1) / 2) + 1, floor((W - 1) / 2) + 1).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.op.forward(x)
    }
}

/// Nearest-neighbour resize to (H', W') then `conv` 3x3 (diffusers `Upsample2D`: 2x, or the
/// skip connection's size when the input was not divisible by 2^levels; sgm always does 2x).
#[derive(Clone, Debug)]
pub struct Upsample {
    /// Conv 3x3 after the resize, C -> C.
    pub conv: Conv2d,
}

impl Upsample {
    /// The conv under `vb` (`conv`) for `channels` channels.
    pub fn new(vb: &VarBuilder, channels: usize) -> Result<Self> {
        Ok(Upsample {
            conv: conv3x3(&vb.pp("conv"), channels, channels, 1)?,
        })
    }

    /// x (B, C, H, W) -> (B, C, H', W') with (H', W') = `size`.
    pub fn forward(&self, x: &Tensor, size: (usize, usize)) -> Result<Tensor> {
        self.conv.forward(&interpolate_nearest(x, size)?)
    }
}

/// PyTorch's `F.interpolate(x, size=(H', W'), mode="nearest")` on (B, C, H, W): output row i
/// reads input row min(floor(i * (H / H')), H - 1), the ratio and product in f32 as in
/// ATen's `nearest_neighbor_compute_source_index`; exactly 2x is a broadcast copy.
pub fn interpolate_nearest(x: &Tensor, (oh, ow): (usize, usize)) -> Result<Tensor> {
    let d = x.dims();
    if d.len() != 4 || d[2] == 0 || d[3] == 0 || oh == 0 || ow == 0 {
        return Err(Error::invalid(
            "interpolate_nearest",
            format!("needs (B, C, H, W) and an output size > 0, got ({oh}, {ow})"),
            x.shape(),
        ));
    }
    let (h, w) = (d[2], d[3]);
    if (oh, ow) == (2 * h, 2 * w) {
        return upsample_nearest2d(x, 2);
    }
    let pick = |x: Tensor, dim: usize, from: usize, to: usize| -> Result<Tensor> {
        if from == to {
            return Ok(x);
        }
        let ids = nearest_indices(from, to);
        let ids = Tensor::from_vec(ids, to, x.device())?;
        x.index_select(&ids, dim)
    };
    let y = pick(x.clone(), 2, h, oh)?;
    pick(y, 3, w, ow)
}

/// The source index of each of `to` outputs resized from `from` inputs (ATen `nearest_idx`:
/// i >> 1 when doubling, else min(floorf(i * (float)from / to), from - 1)).
pub fn nearest_indices(from: usize, to: usize) -> Vec<u32> {
    if to == 2 * from {
        return (0..to).map(|i| (i / 2) as u32).collect();
    }
    let scale = from as f32 / to as f32;
    (0..to)
        .map(|i| ((i as f32 * scale).floor() as usize).min(from.saturating_sub(1)) as u32)
        .collect()
}
