//! The autoencoder's encoder and decoder, named by diffusers' keys. Shape letters: B batch,
//! C channels, H x W spatial, L = H * W positions.

use super::config::VaeConfig;
use crate::nn::{
    scaled_dot_product_attention, upsample_nearest2d, Conv2d, Conv2dConfig, GroupNorm, Linear,
    VarBuilder,
};
use crate::{Result, Tensor};

/// GroupNorm epsilon of every norm in the autoencoder (diffusers `Encoder` / `Decoder`:
/// `resnet_eps=1e-6`, the attention's and `conv_norm_out`'s `eps=1e-6`).
const EPS: f64 = 1e-6;

fn conv(vb: &VarBuilder, cin: usize, cout: usize, kernel: usize, stride: usize) -> Result<Conv2d> {
    let cfg = Conv2dConfig {
        stride,
        // 3x3 convs pad 1, except the stride-2 downsampler, which pads by hand (below).
        padding: if kernel == 3 && stride == 1 { 1 } else { 0 },
        ..Conv2dConfig::default()
    };
    Conv2d::new(vb, cin, cout, kernel, cfg)
}

/// `norm1`, SiLU, `conv1`, `norm2`, SiLU, `conv2`, plus the input (through the 1x1
/// `conv_shortcut` when the width changes). diffusers `ResnetBlock2D` without a time
/// embedding, dropout 0, output scale 1.
#[derive(Clone, Debug)]
struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    fn new(vb: &VarBuilder, cin: usize, cout: usize, groups: usize) -> Result<Self> {
        Ok(ResnetBlock {
            norm1: GroupNorm::new(&vb.pp("norm1"), groups, cin, EPS, true)?,
            conv1: conv(&vb.pp("conv1"), cin, cout, 3, 1)?,
            norm2: GroupNorm::new(&vb.pp("norm2"), groups, cout, EPS, true)?,
            conv2: conv(&vb.pp("conv2"), cout, cout, 3, 1)?,
            shortcut: if cin != cout {
                Some(conv(&vb.pp("conv_shortcut"), cin, cout, 1, 1)?)
            } else {
                None
            },
        })
    }

    /// (B, Cin, H, W) -> (B, Cout, H, W).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward(x)?.silu()?)?;
        let h = self.conv2.forward(&self.norm2.forward(&h)?.silu()?)?;
        match &self.shortcut {
            Some(s) => s.forward(x)?.add(&h),
            None => x.add(&h),
        }
    }
}

/// A C x C projection of the attention: a Linear in diffusers' layout, a 1x1 conv
/// (C, C, 1, 1) in the LDM layout, read as the Linear it is.
fn projection(vb: &VarBuilder, c: usize) -> Result<Linear> {
    if vb.shape_of("weight").map(|s| s.len()) != Some(4) {
        return Linear::new(vb, c, c, true);
    }
    Ok(Linear {
        weight: vb.get((c, c, 1, 1), "weight")?.reshape((c, c))?,
        bias: Some(vb.get(c, "bias")?),
        adapter: None,
        packing: None,
    })
}

/// Single-head self-attention over the L positions with a residual (diffusers `Attention`
/// as the VAE builds it: `group_norm` first, head width = C, scale 1 / sqrt(C),
/// `residual_connection=True`, `rescale_output_factor` 1). The head width is C (512 in the
/// released VAEs): on CUDA in bf16/f16 without gradients it runs the forward-only flash
/// kernel for that width (nothing of size L x L); with gradients, in f32 or on the CPU, the
/// composite, which materializes the (B, 1, L, L) scores (tiling bounds them).
#[derive(Clone, Debug)]
struct MidAttention {
    norm: GroupNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
}

impl MidAttention {
    fn new(vb: &VarBuilder, c: usize, groups: usize) -> Result<Self> {
        Ok(MidAttention {
            norm: GroupNorm::new(&vb.pp("group_norm"), groups, c, EPS, true)?,
            q: projection(&vb.pp("to_q"), c)?,
            k: projection(&vb.pp("to_k"), c)?,
            v: projection(&vb.pp("to_v"), c)?,
            out: projection(&vb.pp("to_out").pp(0), c)?,
        })
    }

    /// (B, C, H, W) -> (B, C, H, W).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dims();
        let (b, c, h, w) = (d[0], d[1], d[2], d[3]);
        let l = h * w;
        // (B, C, L) -> (B, L, C) tokens.
        let t = self
            .norm
            .forward(x)?
            .reshape((b, c, l))?
            .transpose(1, 2)?
            .contiguous()?;
        let head = |p: &Linear| p.forward(&t)?.reshape((b, 1, l, c));
        let a = scaled_dot_product_attention(
            &head(&self.q)?,
            &head(&self.k)?,
            &head(&self.v)?,
            None,
            false,
            None,
        )?;
        let o = self.out.forward(&a.reshape((b, l, c))?)?; // (B, L, C)
        x.add(&o.transpose(1, 2)?.reshape((b, c, h, w))?)
    }
}

/// `resnets.0`, `attentions.0` (when present), `resnets.1` at width C.
#[derive(Clone, Debug)]
struct MidBlock {
    first: ResnetBlock,
    attn: Option<MidAttention>,
    second: ResnetBlock,
}

impl MidBlock {
    fn new(vb: &VarBuilder, c: usize, cfg: &VaeConfig) -> Result<Self> {
        let g = cfg.norm_num_groups;
        Ok(MidBlock {
            first: ResnetBlock::new(&vb.pp("resnets").pp(0), c, c, g)?,
            attn: if cfg.mid_block_add_attention {
                Some(MidAttention::new(&vb.pp("attentions").pp(0), c, g)?)
            } else {
                None
            },
            second: ResnetBlock::new(&vb.pp("resnets").pp(1), c, c, g)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.first.forward(x)?;
        if let Some(a) = &self.attn {
            x = a.forward(&x)?;
        }
        self.second.forward(&x)
    }
}

/// Zero-pads one column on the right and one row at the bottom of (B, C, H, W): diffusers'
/// `Downsample2D` with `padding=0` pads (0, 1, 0, 1) before its 3x3 stride-2 conv.
fn pad_right_bottom(x: &Tensor) -> Result<Tensor> {
    let d = x.dims();
    let (b, c, h, w) = (d[0], d[1], d[2], d[3]);
    let col = Tensor::zeros((b, c, h, 1), x.dtype(), x.device())?;
    let x = Tensor::cat(&[x, &col], 3)?;
    let row = Tensor::zeros((b, c, 1, w + 1), x.dtype(), x.device())?;
    Tensor::cat(&[&x, &row], 2)
}

/// One encoder level: its ResNets, then (except at the last level) the stride-2 conv.
#[derive(Clone, Debug)]
struct DownBlock {
    resnets: Vec<ResnetBlock>,
    downsample: Option<Conv2d>,
}

/// Image (B, 3, H, W) -> moments (B, 2 * latent, H / f, W / f) before `quant_conv`
/// (diffusers `Encoder` with `double_z=True`).
#[derive(Clone, Debug)]
pub(super) struct Encoder {
    conv_in: Conv2d,
    down: Vec<DownBlock>,
    mid: MidBlock,
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    pub(super) fn new(vb: &VarBuilder, cfg: &VaeConfig) -> Result<Self> {
        let ch = &cfg.block_out_channels;
        let g = cfg.norm_num_groups;
        let last = ch[ch.len() - 1];
        let mut down = vec![];
        let mut cin = ch[0];
        for (i, &cout) in ch.iter().enumerate() {
            let vb = vb.pp("down_blocks").pp(i);
            let resnets = (0..cfg.layers_per_block)
                .map(|m| {
                    let c = if m == 0 { cin } else { cout };
                    ResnetBlock::new(&vb.pp("resnets").pp(m), c, cout, g)
                })
                .collect::<Result<Vec<_>>>()?;
            let downsample = if i + 1 < ch.len() {
                Some(conv(&vb.pp("downsamplers.0.conv"), cout, cout, 3, 2)?)
            } else {
                None
            };
            down.push(DownBlock {
                resnets,
                downsample,
            });
            cin = cout;
        }
        Ok(Encoder {
            conv_in: conv(&vb.pp("conv_in"), cfg.in_channels, ch[0], 3, 1)?,
            down,
            mid: MidBlock::new(&vb.pp("mid_block"), last, cfg)?,
            norm_out: GroupNorm::new(&vb.pp("conv_norm_out"), g, last, EPS, true)?,
            conv_out: conv(&vb.pp("conv_out"), last, 2 * cfg.latent_channels, 3, 1)?,
        })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.conv_in.forward(x)?;
        for level in &self.down {
            for r in &level.resnets {
                x = r.forward(&x)?;
            }
            if let Some(d) = &level.downsample {
                x = d.forward(&pad_right_bottom(&x)?)?;
            }
        }
        let x = self.mid.forward(&x)?;
        self.conv_out.forward(&self.norm_out.forward(&x)?.silu()?)
    }
}

/// One decoder level: its ResNets, then (except at the last level) nearest 2x and a conv.
#[derive(Clone, Debug)]
struct UpBlock {
    resnets: Vec<ResnetBlock>,
    upsample: Option<Conv2d>,
}

/// Latents (B, latent, h, w) after `post_quant_conv` -> image (B, 3, h * f, w * f)
/// (diffusers `Decoder`): levels from the latent side, `layers_per_block + 1` ResNets each.
#[derive(Clone, Debug)]
pub(super) struct Decoder {
    conv_in: Conv2d,
    mid: MidBlock,
    up: Vec<UpBlock>,
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    pub(super) fn new(vb: &VarBuilder, cfg: &VaeConfig) -> Result<Self> {
        let g = cfg.norm_num_groups;
        let ch: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
        let mut up = vec![];
        let mut cin = ch[0];
        for (i, &cout) in ch.iter().enumerate() {
            let vb = vb.pp("up_blocks").pp(i);
            let resnets = (0..cfg.layers_per_block + 1)
                .map(|m| {
                    let c = if m == 0 { cin } else { cout };
                    ResnetBlock::new(&vb.pp("resnets").pp(m), c, cout, g)
                })
                .collect::<Result<Vec<_>>>()?;
            let upsample = if i + 1 < ch.len() {
                Some(conv(&vb.pp("upsamplers.0.conv"), cout, cout, 3, 1)?)
            } else {
                None
            };
            up.push(UpBlock { resnets, upsample });
            cin = cout;
        }
        let first = cfg.block_out_channels[0];
        Ok(Decoder {
            conv_in: conv(&vb.pp("conv_in"), cfg.latent_channels, ch[0], 3, 1)?,
            mid: MidBlock::new(&vb.pp("mid_block"), ch[0], cfg)?,
            up,
            norm_out: GroupNorm::new(&vb.pp("conv_norm_out"), g, first, EPS, true)?,
            conv_out: conv(&vb.pp("conv_out"), first, cfg.out_channels, 3, 1)?,
        })
    }

    pub(super) fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let mut x = self.mid.forward(&self.conv_in.forward(z)?)?;
        for level in &self.up {
            for r in &level.resnets {
                x = r.forward(&x)?;
            }
            if let Some(u) = &level.upsample {
                x = u.forward(&upsample_nearest2d(&x, 2)?)?;
            }
        }
        self.conv_out.forward(&self.norm_out.forward(&x)?.silu()?)
    }
}
