//! The SDXL UNet as a registered model family.

use super::{diffusers_map, sdxl_vector, SdxlConfig, Unet, UnitKind};
use crate::diffusion::schedulers::EulerDiscrete;
use crate::diffusion::Ddpm;
use crate::diffusion::Schedule;
use crate::encoders::{BuiltinTokenizer, VaeKind, CLIP_MAX_LEN, SDXL_CLIP_G, SDXL_CLIP_L};
use crate::memory::{BlockExec, BlockShape};
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::models::pipeline::{
    output, EncoderSlot, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput,
};
use crate::nn::{KeyMap, VarBuilder};
use crate::{DType, Result, Tensor};

/// The registry entry of the SDXL UNet.
pub static FAMILY: Family = Family::of::<Unet>(
    "sdxl",
    "unet",
    "SDXL UNet (Stability single file or diffusers UNet2DConditionModel)",
    &PIPELINE,
);

/// CLIP-L and bigG (diffusers' `StableDiffusionXLPipeline.encode_prompt`: both encoders'
/// penultimate hidden states concatenated on features; pooled = bigG's projection).
static TEXT: [EncoderSlot; 2] = [
    EncoderSlot {
        name: "clip_l",
        kind: TextEncoderKind::Clip,
        kohya: "lora_te1",
        folder: "text_encoder",
        tokenizer: "tokenizer",
        builtin: BuiltinTokenizer::ClipL,
        single_file_prefix: Some(SDXL_CLIP_L),
        max_len: CLIP_MAX_LEN,
        max_len_unguided: CLIP_MAX_LEN,
    },
    EncoderSlot {
        name: "clip_g",
        kind: TextEncoderKind::Clip,
        kohya: "lora_te2",
        folder: "text_encoder_2",
        tokenizer: "tokenizer_2",
        builtin: BuiltinTokenizer::ClipG,
        single_file_prefix: Some(SDXL_CLIP_G),
        max_len: CLIP_MAX_LEN,
        max_len_unguided: CLIP_MAX_LEN,
    },
];

fn combine(outs: &[TextOutput]) -> Result<Vec<(String, Tensor)>> {
    let l = output(outs, 0)?.clip("clip_l")?;
    let g = output(outs, 1)?.clip("clip_g")?;
    let pooled = g.projected.clone().ok_or_else(|| crate::Error::Config {
        path: None,
        msg: "clip_g: SDXL needs bigG's text projection, and this checkpoint has none".into(),
    })?;
    Ok(vec![
        (
            "context".into(),
            Tensor::cat(
                &[
                    &l.penultimate,
                    &g.penultimate.to_dtype(l.penultimate.dtype())?,
                ],
                2,
            )?,
        ),
        ("pooled".into(), pooled),
    ])
}

fn schedule(s: &SampleSetup) -> Result<Box<dyn Schedule>> {
    Ok(Box::new(EulerDiscrete::sdxl(s.steps, s.prediction)?))
}

/// SDXL's pipeline: CLIP-L + bigG, the 4-channel autoencoder, Euler (discrete).
static PIPELINE: PipelineSpec = PipelineSpec {
    text: &TEXT,
    combine,
    vae: VaeKind::Sdxl,
    vae_single_file_prefix: Some("first_stage_model."),
    schedule,
};

/// SDXL's micro-conditioning numbers per sample: original size, crop offset, target size.
const TIME_IDS: usize = 6;

/// Ops that launch work and views a unit's forward records with an adapter on each of its
/// Linears and convolutions (`BlockShape::ops`, `views`; `tests/plan.rs` counts them on a
/// tiny model), and the weights that
/// multiply the context's tokens.
impl Unet {
    const RES_OPS: (usize, usize) = (14, 21);
    const SKIP_RES_OPS: (usize, usize) = (18, 25);
    const LAYER_OPS: (usize, usize) = (45, 153);
    const DOWN_OPS: (usize, usize) = (3, 4);
    const UP_OPS: (usize, usize) = (4, 7);
    const CONTEXT_KEYS: &'static [&'static str] = &["attn2.to_k.", "attn2.to_v."];
}

impl ModelSpec for Unet {
    type Config = SdxlConfig;
    const SIGNATURE: &'static [&'static str] = &[
        "input_blocks.0.0.weight",
        "label_emb.0.0.weight",
        "time_embed.0.weight",
    ];
    const DIFFUSERS_CLASS: &'static str = "UNet2DConditionModel";
    const CONDITIONED: &'static [&'static str] = &["emb_layers.1.weight"];

    fn entry() -> &'static Family {
        &FAMILY
    }
    fn config_from_diffusers(json: &serde_json::Value) -> Result<SdxlConfig> {
        SdxlConfig::from_diffusers(json)
    }
    fn config_from_single_file(vb: &VarBuilder) -> Result<SdxlConfig> {
        SdxlConfig::from_single_file(vb)
    }
    fn reference_config() -> SdxlConfig {
        SdxlConfig::base()
    }
    fn validate(config: &SdxlConfig) -> Result<()> {
        config.validate()
    }
    fn diffusers_map(config: &SdxlConfig) -> KeyMap {
        diffusers_map(config)
    }
    fn block_prefixes_of(config: &SdxlConfig) -> Vec<String> {
        config.block_prefixes()
    }
    fn build(vb: &VarBuilder, config: &SdxlConfig) -> Result<Unet> {
        Unet::new(vb, config)
    }
    /// Each unit ([`SdxlConfig::units`]) at its level's resolution (H/2^l x W/2^l
    /// positions) and channels: a ResNet counts 0.35 of a transformer layer (a handful of
    /// maps a position against a transformer layer's ~21), each transformer layer 1 and two
    /// attention calls (self and cross), a resampler 0.25 at the larger of its two
    /// resolutions; an output block's ResNet reads the concatenated skip (0.5 more).
    /// All of it times 1.2, from the resident SDXL LoRA step at 1024² measured on an H100
    /// (12.07 GiB against 11.08 predicted without it, and a 4 GiB plan that ran
    /// out of memory).
    fn block_shapes(config: &SdxlConfig, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>> {
        let ((h, w), t) = latent_and_context("sdxl", sample)?;
        // Calibration against the measured step (see above).
        const MEASURED: f64 = 1.2;
        let positions = |l: usize| (h >> l).max(1) * (w >> l).max(1);
        let at =
            |l: usize, tokens: usize, layers: f64, attention_calls: usize, ops: (usize, usize)| {
                BlockShape {
                    tokens,
                    weight_tokens: tokens,
                    width: config.channels(l),
                    layers: layers * MEASURED,
                    attention_calls,
                    // A transformer layer's second call attends to the context.
                    cross_calls: attention_calls / 2,
                    context_tokens: t,
                    context_keys: Self::CONTEXT_KEYS,
                    heads: config.num_heads[l],
                    ops: ops.0,
                    views: ops.1,
                    // The ResNets' time-embedding projections.
                    conditioned: Self::CONDITIONED,
                    // A transformer layer ends `x + ff(norm3(x))` (`TransformerBlock`);
                    // a ResBlock ending its unit, `skip(x) + conv2(h)` (set below).
                    tails: &["ff.net.2."],
                    tail_gates: &[],
                }
            };
        Ok(config
            .units()
            .iter()
            .map(|u| {
                let (l, here) = (u.level, positions(u.level));
                // A ResBlock that ends its unit (`ResBlock::forward_unit`).
                let res_tail = |sh: BlockShape| BlockShape {
                    tails: &["out_layers.3."],
                    ..sh
                };
                match u.kind {
                    UnitKind::Res => res_tail(at(l, here, 0.35, 0, Self::RES_OPS)),
                    UnitKind::SkipRes { up: false } => {
                        res_tail(at(l, here, 0.85, 0, Self::SKIP_RES_OPS))
                    }
                    // The upsampler's 0.25 at four times the positions.
                    UnitKind::SkipRes { up: true } => {
                        let (a, b) = (Self::SKIP_RES_OPS, Self::UP_OPS);
                        at(l, here, 1.85, 0, (a.0 + b.0, a.1 + b.1))
                    }
                    UnitKind::Layer => at(l, here, 1.0, 2, Self::LAYER_OPS),
                    UnitKind::Down => at(l, here, 0.25, 0, Self::DOWN_OPS),
                    UnitKind::Up => at(l, positions(l.saturating_sub(1)), 0.25, 0, Self::UP_OPS),
                }
            })
            .collect())
    }
}

impl Unet {
    /// The text tokens and the vector input ([`sdxl_vector`] of pooled and time_ids) of a
    /// batch's `cond` (in `inputs` order).
    fn context_and_vector<'a>(&self, cond: &'a [Tensor]) -> Result<(&'a Tensor, Tensor)> {
        let [ctx, pooled, time_ids] = conds("sdxl", cond, [3, 2, 2])?;
        let y = sdxl_vector(
            pooled,
            &time_ids.to_dtype(DType::F32)?,
            self.config.addition_time_embed_dim,
        )?;
        Ok((ctx, y))
    }
}

impl DiffusionModel for Unet {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    /// latents (C, H, W), context (T, context_dim), pooled (adm_in_channels - 6 x
    /// addition_time_embed_dim), time_ids (6).
    fn inputs(&self) -> Vec<Input> {
        let c = &self.config;
        let pooled = c
            .adm_in_channels
            .saturating_sub(TIME_IDS * c.addition_time_embed_dim);
        let any = Size::MultipleOf(1);
        vec![
            Input::new("latents", vec![Size::Exactly(c.in_channels), any, any]),
            Input::new("context", vec![any, Size::Exactly(c.context_dim)]),
            Input::new("pooled", vec![Size::Exactly(pooled)]),
            Input::new("time_ids", vec![Size::Exactly(TIME_IDS)]),
        ]
    }

    /// DDPM with Stable Diffusion's scaled-linear betas (1000 steps).
    fn objective(&self) -> Objective {
        Objective::Ddpm(Ddpm::scaled_linear())
    }

    /// The UNet's vector input is made from pooled and time_ids ([`sdxl_vector`]).
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<Tensor> {
        let (ctx, y) = self.context_and_vector(cond)?;
        self.forward(xt, t, ctx, &y)
    }

    fn prepare(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<()> {
        // The text context (`context_and_vector`'s first) as `forward` hands it to the
        // blocks, in the latents' dtype.
        if let Some(ctx) = cond.first() {
            self.exec.announce_input(ctx, || {
                let _g = crate::no_grad();
                ctx.to_dtype(xt.dtype())
            })?;
        }
        self.exec.prepare_products(|| {
            let _g = crate::no_grad();
            let (_, y) = self.context_and_vector(cond)?;
            // `forward` casts y to the latents' dtype; `conditioning` does too.
            self.conditioning(xt.dtype(), t, &y)?.silu()
        })
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}
