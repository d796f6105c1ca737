//! The UNet: embeddings, `input_blocks`, `middle_block`, `output_blocks`, `out`, by LDM key
//! path (sgm `UNetModel`). Shape letters: B batch, C channels, H x W spatial, T text tokens.

use super::blocks::{Downsample, ResBlock, SpatialTransformer, Upsample, RESNET_EPS};
use super::SdxlConfig;
use crate::memory::BlockExec;
use crate::models::common::outputs;
use crate::nn::{timestep_embedding, Conv2d, Conv2dConfig, GroupNorm, Linear, VarBuilder};
use crate::{DType, Error, Result, Tensor};

/// Sinusoidal timestep embedding: max period 10000, cos first, no frequency shift (sgm
/// `timestep_embedding`; diffusers `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)`).
pub const MAX_PERIOD: f64 = 10_000.0;

/// `0` -> SiLU -> `2`: the time embedding (`time_embed`) and the vector embedding
/// (`label_emb.0`) (diffusers `TimestepEmbedding`).
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Key `0`: input width -> the time embedding width (4 x `model_channels`).
    pub fc0: Linear,
    /// Key `2`: embedding width -> embedding width.
    pub fc2: Linear,
}

impl Mlp {
    fn new(vb: &VarBuilder, in_dim: usize, dim: usize) -> Result<Self> {
        Ok(Mlp {
            fc0: Linear::new(&vb.pp(0), in_dim, dim, true)?,
            fc2: Linear::new(&vb.pp(2), dim, dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc0.forward(x)?.silu()?)
    }
}

/// A ResBlock (`.0`) with an optional SpatialTransformer (`.1`).
#[derive(Clone, Debug)]
pub struct ResLayer {
    /// `.0`: the ResBlock.
    pub res: ResBlock,
    /// `.1`: the SpatialTransformer, at levels with `transformer_depth` above 0.
    pub attn: Option<SpatialTransformer>,
}

/// One `input_blocks.i` (i >= 1): a ResBlock with an optional SpatialTransformer, or a
/// downsampler (`.0.op`).
#[derive(Clone, Debug)]
pub enum InputBlock {
    /// A ResBlock, with a SpatialTransformer at levels that have attention.
    Res(Box<ResLayer>),
    /// The stride-2 downsampler ending every level but the last.
    Down(Downsample),
}

/// One `output_blocks.i`: a ResBlock on cat(h, skip) (`.0`), an optional SpatialTransformer
/// (`.1`), and at a level's last block (not the top level's) an upsampler (`.1` or `.2`).
#[derive(Clone, Debug)]
pub struct OutputBlock {
    /// `.0`: the ResBlock on the skip-concatenated channels.
    pub res: ResBlock,
    /// `.1`: the SpatialTransformer, at levels with attention.
    pub attn: Option<SpatialTransformer>,
    /// The upsampler at the end of a level (not the top one).
    pub up: Option<Upsample>,
}

/// The SDXL UNet (sgm `UNetModel`, diffusers `UNet2DConditionModel` with text_time
/// conditioning).
#[derive(Clone, Debug)]
pub struct Unet {
    /// The hyperparameters it was built with.
    pub config: SdxlConfig,
    /// `time_embed`: sinusoidal timestep channels (`model_channels`) -> time embedding.
    pub time_embed: Mlp,
    /// `label_emb.0`: the vector y (`adm_in_channels`) -> time embedding width.
    pub label_emb: Mlp,
    /// `input_blocks.0.0`: conv 3x3 from `in_channels` to `model_channels`.
    pub conv_in: Conv2d,
    /// `input_blocks.1..`, in order.
    pub input_blocks: Vec<InputBlock>,
    /// `middle_block.{0,1,2}`: ResBlock, SpatialTransformer, ResBlock.
    pub middle: (ResBlock, SpatialTransformer, ResBlock),
    /// `output_blocks.0..`, in order.
    pub output_blocks: Vec<OutputBlock>,
    /// `out.0`: the final GroupNorm (followed by SiLU).
    pub norm_out: GroupNorm,
    /// `out.2`: conv 3x3 to `out_channels`.
    pub conv_out: Conv2d,
    /// How the blocks run (`SdxlConfig::block_prefixes` names them).
    pub exec: BlockExec,
}

fn conv3x3(vb: &VarBuilder, cin: usize, cout: usize) -> Result<Conv2d> {
    let cfg = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    Conv2d::new(vb, cin, cout, 3, cfg)
}

impl Unet {
    /// Builds the UNet from parameters under LDM key paths (after `model.diffusion_model.`).
    pub fn new(vb: &VarBuilder, cfg: &SdxlConfig) -> Result<Unet> {
        cfg.validate()?;
        let (g, ted, ctx) = (cfg.num_groups, cfg.time_embed_dim(), cfg.context_dim);
        let mc = cfg.model_channels;
        let attn =
            |vb: &VarBuilder, level: usize, ch: usize| -> Result<Option<SpatialTransformer>> {
                match cfg.transformer_depth[level] {
                    0 => Ok(None),
                    depth => SpatialTransformer::new(vb, ch, depth, cfg.num_heads[level], ctx, g)
                        .map(Some),
                }
            };
        let ib = vb.pp("input_blocks");
        // Channels of every skip connection, pushed as sgm's `input_block_chans`.
        let mut skips = vec![mc];
        let mut input_blocks = vec![];
        let mut ch = mc;
        for level in 0..cfg.levels() {
            let out = cfg.channels(level);
            for _ in 0..cfg.num_res_blocks {
                let b = ib.pp(input_blocks.len() + 1);
                let res = ResBlock::new(&b.pp(0), ch, out, ted, g)?;
                let attn = attn(&b.pp(1), level, out)?;
                input_blocks.push(InputBlock::Res(Box::new(ResLayer { res, attn })));
                ch = out;
                skips.push(ch);
            }
            if level + 1 < cfg.levels() {
                let b = ib.pp(input_blocks.len() + 1);
                input_blocks.push(InputBlock::Down(Downsample::new(&b.pp(0), ch)?));
                skips.push(ch);
            }
        }
        let last = cfg.levels() - 1;
        let mb = vb.pp("middle_block");
        let middle = (
            ResBlock::new(&mb.pp(0), ch, ch, ted, g)?,
            SpatialTransformer::new(
                &mb.pp(1),
                ch,
                cfg.transformer_depth_middle,
                cfg.num_heads[last],
                ctx,
                g,
            )?,
            ResBlock::new(&mb.pp(2), ch, ch, ted, g)?,
        );
        let ob = vb.pp("output_blocks");
        let mut output_blocks = vec![];
        for level in (0..cfg.levels()).rev() {
            let out = cfg.channels(level);
            for j in 0..=cfg.num_res_blocks {
                let b = ob.pp(output_blocks.len());
                let skip = skips.pop().ok_or_else(|| Error::Config {
                    path: None,
                    msg: "sdxl: more output blocks than skip connections".into(),
                })?;
                let res = ResBlock::new(&b.pp(0), ch + skip, out, ted, g)?;
                let attn = attn(&b.pp(1), level, out)?;
                let up = if level > 0 && j == cfg.num_res_blocks {
                    let pos = if attn.is_some() { 2 } else { 1 };
                    Some(Upsample::new(&b.pp(pos), out)?)
                } else {
                    None
                };
                output_blocks.push(OutputBlock { res, attn, up });
                ch = out;
            }
        }
        Ok(Unet {
            config: cfg.clone(),
            time_embed: Mlp::new(&vb.pp("time_embed"), mc, ted)?,
            label_emb: Mlp::new(&vb.pp("label_emb").pp(0), cfg.adm_in_channels, ted)?,
            conv_in: conv3x3(&ib.pp(0).pp(0), cfg.in_channels, mc)?,
            input_blocks,
            middle,
            output_blocks,
            norm_out: GroupNorm::new(&vb.pp("out").pp(0), g, ch, RESNET_EPS, true)?,
            conv_out: conv3x3(&vb.pp("out").pp(2), ch, cfg.out_channels)?,
            exec: BlockExec::default(),
        })
    }

    /// Runs one unit (`SdxlConfig::units`), the `index`-th, through [`BlockExec`], and
    /// counts it.
    fn unit<F>(&self, prefix: &str, index: &mut usize, inputs: &[Tensor], f: F) -> Result<Tensor>
    where
        F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
    {
        let out = self
            .exec
            .run(prefix, *index, inputs, move |xs| Ok(vec![f(xs)?]))?;
        *index += 1;
        let [h] = outputs::<1>(out, "sdxl unit")?;
        Ok(h)
    }

    /// A SpatialTransformer under `prefix` on x (B, C, H, W): its projections in and out
    /// resident, each transformer layer a unit.
    fn attention(
        &self,
        st: &SpatialTransformer,
        prefix: &str,
        index: &mut usize,
        x: &Tensor,
        context: &Tensor,
    ) -> Result<Tensor> {
        let mut t = st.tokens_in(x)?;
        for (k, layer) in st.blocks.iter().enumerate() {
            let layer = layer.clone();
            t = self.unit(
                &format!("{prefix}.transformer_blocks.{k}"),
                index,
                &[t, context.clone()],
                move |xs| layer.forward_unit(&xs[0], &xs[1]),
            )?;
        }
        st.tokens_out(&t, x)
    }

    /// The conditioning `emb` (B, time_embed_dim) in `dtype`: the embeddings of `timesteps`
    /// (B,), or (1,) for the whole batch, and of the vector `y` (B, adm_in_channels), summed.
    /// Every ResBlock takes `silu(emb)`.
    pub fn conditioning(&self, dtype: DType, timesteps: &Tensor, y: &Tensor) -> Result<Tensor> {
        // One timestep for the whole batch (diffusers' `timesteps.expand(batch)`).
        let b = y.dims().first().copied().unwrap_or(1);
        let timesteps = if timesteps.dims() == [1] && b != 1 {
            timesteps.broadcast_as(b)?
        } else {
            timesteps.clone()
        };
        let cast = |t: &Tensor| {
            if t.dtype() == dtype {
                Ok(t.clone())
            } else {
                t.to_dtype(dtype)
            }
        };
        // Diffusers casts the f32 sinusoids to the sample's dtype (`t_emb.to(sample.dtype)`).
        let t_emb = timestep_embedding(
            &timesteps,
            self.config.model_channels,
            MAX_PERIOD,
            true,
            0.0,
            1.0,
        )?;
        self.time_embed
            .forward(&cast(&t_emb)?)?
            .add(&self.label_emb.forward(&cast(y)?)?)
    }

    /// The noise (or v) prediction: x (B, C, H, W) latents, timesteps (B,) or (1,),
    /// context (B, T, context_dim) text tokens, y (B, adm_in_channels) from [`super::sdxl_vector`].
    /// Any H x W works: where a level's size was odd, upsampling goes to the skip
    /// connection's size, as diffusers does. Keep timesteps in f32 whatever the model's dtype
    /// (bf16 rounds 901 to 900); their embedding is cast to x's dtype, as in diffusers.
    pub fn forward(
        &self,
        x: &Tensor,
        timesteps: &Tensor,
        context: &Tensor,
        y: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let xd = x.dims();
        if xd.len() != 4 || xd[1] != cfg.in_channels {
            return Err(Error::invalid(
                "sdxl unet",
                format!("x must be (B, {}, H, W)", cfg.in_channels),
                x.shape(),
            ));
        }
        let b = xd[0];
        let bad = |what: String, t: &Tensor| {
            Error::invalid(
                "sdxl unet",
                format!("{what} for x {:?}", x.dims()),
                t.shape(),
            )
        };
        let cd = context.dims();
        if cd.len() != 3 || cd[0] != b || cd[2] != cfg.context_dim {
            return Err(bad(
                format!("context must be ({b}, T, {})", cfg.context_dim),
                context,
            ));
        }
        if y.dims() != [b, cfg.adm_in_channels] {
            return Err(bad(format!("y must be ({b}, {})", cfg.adm_in_channels), y));
        }
        if !matches!(timesteps.dims(), [n] if *n == b || *n == 1) {
            return Err(bad(format!("timesteps must be ({b},) or (1,)"), timesteps));
        }
        let dt = x.dtype();
        let cast = |t: &Tensor| {
            if t.dtype() == dt {
                Ok(t.clone())
            } else {
                t.to_dtype(dt)
            }
        };
        // The blocks' text context: the one announced for this forward where `context` is
        // its source (`DiffusionModel::prepare`), whose keys' and values' products the
        // streamer may have computed ahead.
        let context = self.exec.take_input(context, || cast(context))?;
        let y = cast(y)?;

        let emb = self.conditioning(dt, timesteps, &y)?;
        // Every ResBlock applies SiLU to emb before its own projection: done once here.
        let emb = emb.silu()?;

        let mut h = self.conv_in.forward(x)?;
        let mut hs = vec![h.clone()];
        // The units run in `SdxlConfig::units` order; `index` counts them.
        let mut index = 0;
        for (i, block) in self.input_blocks.iter().enumerate() {
            let prefix = format!("input_blocks.{}", i + 1);
            h = match block {
                InputBlock::Res(layer) => {
                    let res = layer.res.clone();
                    let whole = layer.attn.is_none();
                    let h = self.unit(
                        &if whole {
                            prefix.clone()
                        } else {
                            format!("{prefix}.0")
                        },
                        &mut index,
                        &[h, emb.clone()],
                        move |xs| res.forward_unit(&xs[0], &xs[1]),
                    )?;
                    match &layer.attn {
                        Some(a) => {
                            self.attention(a, &format!("{prefix}.1"), &mut index, &h, &context)?
                        }
                        None => h,
                    }
                }
                InputBlock::Down(d) => {
                    let d = d.clone();
                    self.unit(&prefix, &mut index, &[h], move |xs| d.forward(&xs[0]))?
                }
            };
            hs.push(h.clone());
        }
        let (r0, attn, r1) = self.middle.clone();
        h = self.unit("middle_block.0", &mut index, &[h, emb.clone()], move |xs| {
            r0.forward_unit(&xs[0], &xs[1])
        })?;
        h = self.attention(&attn, "middle_block.1", &mut index, &h, &context)?;
        h = self.unit("middle_block.2", &mut index, &[h, emb.clone()], move |xs| {
            r1.forward_unit(&xs[0], &xs[1])
        })?;
        for (i, block) in self.output_blocks.iter().enumerate() {
            let skip = hs.pop().ok_or_else(|| {
                Error::invalid(
                    "sdxl unet",
                    format!("no skip for output block {i}"),
                    x.shape(),
                )
            })?;
            // The size of the skip the next block joins: 2x unless a size was odd there.
            let next = match (&block.up, hs.last()) {
                (None, _) => None,
                (Some(_), Some(n)) => Some((n.dims()[2], n.dims()[3])),
                (Some(_), None) => {
                    return Err(Error::invalid(
                        "sdxl unet",
                        format!("no skip after output block {i}"),
                        x.shape(),
                    ))
                }
            };
            let prefix = format!("output_blocks.{i}");
            let res = block.res.clone();
            match &block.attn {
                // Without attention the block is one unit: the ResBlock and the upsampler.
                None => {
                    let up = block.up.clone();
                    h = self.unit(&prefix, &mut index, &[h, skip, emb.clone()], move |xs| {
                        let x = Tensor::cat(&[&xs[0], &xs[1]], 1)?;
                        match (&up, next) {
                            (Some(up), Some(size)) => up.forward(&res.forward(&x, &xs[2])?, size),
                            // The ResBlock ends the unit.
                            _ => res.forward_unit(&x, &xs[2]),
                        }
                    })?;
                }
                Some(a) => {
                    h = self.unit(
                        &format!("{prefix}.0"),
                        &mut index,
                        &[h, skip, emb.clone()],
                        move |xs| res.forward_unit(&Tensor::cat(&[&xs[0], &xs[1]], 1)?, &xs[2]),
                    )?;
                    h = self.attention(a, &format!("{prefix}.1"), &mut index, &h, &context)?;
                    if let (Some(up), Some(size)) = (block.up.clone(), next) {
                        h = self.unit(&format!("{prefix}.2"), &mut index, &[h], move |xs| {
                            up.forward(&xs[0], size)
                        })?;
                    }
                }
            }
        }
        self.conv_out.forward(&self.norm_out.forward(&h)?.silu()?)
    }
}
