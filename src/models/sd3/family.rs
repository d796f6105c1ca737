//! SD3 / SD3.5 as a registered model family.

use super::{diffusers_map, Sd3, Sd3Config};
use crate::diffusion::schedulers::{FlowMatchConfig, FlowMatchEuler};
use crate::diffusion::Schedule;
use crate::encoders::{
    BuiltinTokenizer, VaeKind, CLIP_MAX_LEN, SD3_CLIP_G, SD3_CLIP_L, SD3_T5, T5_LEN_SCHNELL_SD35,
};
use crate::memory::{BlockExec, BlockShape};
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::models::pipeline::{
    output, pad_last, EncoderSlot, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput,
};
use crate::nn::{KeyMap, VarBuilder};
use crate::{Result, Tensor};

/// The registry entry of SD3 / SD3.5 (Stability's MMDiT).
pub static FAMILY: Family = Family::of::<Sd3>(
    "sd3",
    "transformer",
    "SD3 / SD3.5 MMDiT (Stability single file or diffusers SD3Transformer2DModel)",
    &PIPELINE,
);

/// CLIP-L and bigG (both with projections) and T5 (diffusers' `StableDiffusion3Pipeline`:
/// the CLIPs' penultimate hidden states concatenated on features, zero-padded to T5's width
/// and put before T5's 256 tokens; pooled = both projections concatenated).
static TEXT: [EncoderSlot; 3] = [
    EncoderSlot {
        name: "clip_l",
        kind: TextEncoderKind::Clip,
        kohya: "lora_te1",
        folder: "text_encoder",
        tokenizer: "tokenizer",
        builtin: BuiltinTokenizer::ClipL,
        single_file_prefix: Some(SD3_CLIP_L),
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
        single_file_prefix: Some(SD3_CLIP_G),
        max_len: CLIP_MAX_LEN,
        max_len_unguided: CLIP_MAX_LEN,
    },
    EncoderSlot {
        name: "t5",
        kind: TextEncoderKind::T5,
        kohya: "lora_te3",
        folder: "text_encoder_3",
        tokenizer: "tokenizer_3",
        builtin: BuiltinTokenizer::T5,
        single_file_prefix: Some(SD3_T5),
        max_len: T5_LEN_SCHNELL_SD35,
        max_len_unguided: T5_LEN_SCHNELL_SD35,
    },
];

/// A CLIP's projected pooled output; CLIP-L in SD3.5's single files has no projection, where
/// diffusers' conversion (and SD3's reference code) use the identity: the pooled output.
fn projected(c: &crate::encoders::ClipOutput) -> &Tensor {
    c.projected.as_ref().unwrap_or(&c.pooled)
}

fn combine(outs: &[TextOutput]) -> Result<Vec<(String, Tensor)>> {
    let l = output(outs, 0)?.clip("clip_l")?;
    let g = output(outs, 1)?.clip("clip_g")?;
    let t5 = output(outs, 2)?.t5("t5")?;
    let clip = Tensor::cat(&[&l.penultimate, &g.penultimate], 2)?;
    let width = t5.dims().get(2).copied().unwrap_or(0);
    let clip = pad_last(&clip.to_dtype(t5.dtype())?, width)?;
    let pooled = Tensor::cat(&[projected(l), projected(g)], 1)?;
    Ok(vec![
        ("context".into(), Tensor::cat(&[&clip, t5], 1)?),
        ("pooled".into(), pooled),
    ])
}

fn schedule(s: &SampleSetup) -> Result<Box<dyn Schedule>> {
    let tokens = (s.latent_hw.0 / 2) * (s.latent_hw.1 / 2);
    Ok(Box::new(FlowMatchEuler::sd3(
        &FlowMatchConfig::sd3(),
        s.steps,
        tokens,
    )?))
}

/// SD3.5's pipeline: CLIP-L + bigG + T5, the 16-channel autoencoder, flow-matching Euler.
static PIPELINE: PipelineSpec = PipelineSpec {
    text: &TEXT,
    combine,
    vae: VaeKind::Sd3,
    vae_single_file_prefix: Some("first_stage_model."),
    schedule,
};

/// Ops that launch work and views a joint block's forward records with an adapter on each
/// of its Linears (`BlockShape::ops`, `views`; `tests/plan.rs` counts them on a tiny
/// model): a block, and one with
/// MMDiT-X's second attention, and the last block (whose context stream ends at its
/// attention).
impl Sd3 {
    const JOINT_OPS: (usize, usize) = (57, 176);
    const DUAL_OPS: (usize, usize) = (74, 224);
    const LAST_OPS: (usize, usize) = (42, 128);
}

impl ModelSpec for Sd3 {
    type Config = Sd3Config;
    const SIGNATURE: &'static [&'static str] = &[
        "x_embedder.proj.weight",
        "context_embedder.weight",
        "joint_blocks.0.x_block.attn.qkv.weight",
    ];
    const DIFFUSERS_CLASS: &'static str = "SD3Transformer2DModel";
    const CONDITIONED: &'static [&'static str] = &["adaLN_modulation.1.weight"];

    fn entry() -> &'static Family {
        &FAMILY
    }
    fn config_from_diffusers(json: &serde_json::Value) -> Result<Sd3Config> {
        Sd3Config::from_diffusers(json)
    }
    fn config_from_single_file(vb: &VarBuilder) -> Result<Sd3Config> {
        Sd3Config::from_single_file(vb)
    }
    fn reference_config() -> Sd3Config {
        Sd3Config::large()
    }
    fn validate(config: &Sd3Config) -> Result<()> {
        config.validate()
    }
    fn diffusers_map(config: &Sd3Config) -> KeyMap {
        diffusers_map(config)
    }
    fn block_prefixes_of(config: &Sd3Config) -> Vec<String> {
        config.block_prefixes()
    }
    fn build(vb: &VarBuilder, config: &Sd3Config) -> Result<Sd3> {
        Sd3::new(vb, config)
    }
    /// Every joint block sees the patch tokens ((H/p)(W/p)) and the context tokens at the
    /// hidden width; MMDiT-X's dual-attention blocks attend twice over the image tokens. A
    /// joint block keeps 1.15 times what a Flux block does a token and channel (its QK
    /// norms): the resident SD3.5-large LoRA step at 1024² measured 34.62 GiB on an H100
    /// against 32.5 predicted at 1.0.
    fn block_shapes(config: &Sd3Config, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>> {
        let ((h, w), t) = latent_and_context("sd3", sample)?;
        let p = config.patch_size.max(1);
        Ok((0..config.depth)
            .map(|i| {
                let dual = config.dual_attention_layers.contains(&i);
                let ops = if dual {
                    Self::DUAL_OPS
                } else if i + 1 == config.depth {
                    Self::LAST_OPS
                } else {
                    Self::JOINT_OPS
                };
                BlockShape {
                    tokens: (h / p) * (w / p) + t,
                    // Image and text weights (about equal halves) see their own tokens.
                    weight_tokens: ((h / p) * (w / p) + t) / 2,
                    width: config.hidden_size,
                    layers: if dual { 1.5 } else { 1.15 },
                    attention_calls: 1 + usize::from(dual),
                    cross_calls: 0,
                    context_tokens: t,
                    context_keys: &[],
                    heads: config.num_heads,
                    ops: ops.0,
                    views: ops.1,
                    conditioned: Self::CONDITIONED,
                    tails: &[],
                    tail_gates: &[],
                }
            })
            .collect())
    }
}

impl DiffusionModel for Sd3 {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    /// latents (C, H, W) with H, W multiples of the patch size, context (T, context_dim),
    /// pooled (pooled_dim).
    fn inputs(&self) -> Vec<Input> {
        let c = &self.config;
        let p = Size::MultipleOf(c.patch_size);
        vec![
            Input::new("latents", vec![Size::Exactly(c.in_channels), p, p]),
            Input::new(
                "context",
                vec![Size::MultipleOf(1), Size::Exactly(c.context_dim)],
            ),
            Input::new("pooled", vec![Size::Exactly(c.pooled_dim)]),
        ]
    }

    /// The patch grid must fit the position table (`pos_embed_max_size`).
    fn check_shapes(&self, shapes: &[Vec<usize>]) -> std::result::Result<(), String> {
        let (p, m) = (self.config.patch_size, self.config.pos_embed_max_size);
        match shapes.first() {
            Some(s) if s.len() == 3 && (s[1] / p > m || s[2] / p > m) => Err(format!(
                "latents {}x{} make a {}x{} patch grid, larger than the model's position \
                 table ({m}x{m}, pos_embed_max_size)",
                s[1],
                s[2],
                s[1] / p,
                s[2] / p
            )),
            _ => Ok(()),
        }
    }

    fn objective(&self) -> Objective {
        Objective::FlowMatching
    }

    /// SD3's transformer takes t x 1000 (diffusers' SD3 training script).
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<Tensor> {
        let [ctx, pooled] = conds("sd3", cond, [3, 2])?;
        self.forward(xt, &t.affine(1000.0, 0.0)?, ctx, pooled)
    }

    fn prepare(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<()> {
        let [_, pooled] = conds("sd3", cond, [3, 2])?;
        self.exec.prepare_products(|| {
            let _g = crate::no_grad();
            self.conditioning(xt.dtype(), &t.affine(1000.0, 0.0)?, pooled)?
                .silu()
        })
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}
