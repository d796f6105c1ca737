//! Flux as a registered model family: config reading, construction, and the training
//! inputs (latents packed into 2x2 patches, T5 tokens, the CLIP pooled vector).

use super::{diffusers_map, image_ids, pack_latents, text_ids, unpack_latents, Flux, FluxConfig};
use crate::diffusion::schedulers::{FlowMatchConfig, FlowMatchEuler};
use crate::diffusion::Schedule;
use crate::encoders::{
    BuiltinTokenizer, VaeKind, CLIP_MAX_LEN, T5_LEN_FLUX_DEV, T5_LEN_SCHNELL_SD35,
};
use crate::memory::{BlockExec, BlockShape};
use crate::models::checkpoint::Checkpoint;
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::models::pipeline::{
    output, EncoderSlot, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput,
};
use crate::nn::{KeyMap, VarBuilder};
use crate::{DType, Device, Result, Tensor};

/// The registry entry of Flux (BFL's FLUX.1 dev / schnell and fine-tunes).
pub static FAMILY: Family = Family::of::<Flux>(
    "flux",
    "transformer",
    "FLUX.1 (BFL single file or diffusers FluxTransformer2DModel)",
    &PIPELINE,
);

/// CLIP-L's pooled output and T5's hidden states (diffusers' `FluxPipeline.encode_prompt`:
/// `pooler_output` of `text_encoder`, the last hidden state of `text_encoder_2`; T5 reads
/// 512 tokens for dev, 256 for schnell, `max_sequence_length`).
static TEXT: [EncoderSlot; 2] = [
    EncoderSlot {
        name: "clip_l",
        kind: TextEncoderKind::Clip,
        kohya: "lora_te1",
        folder: "text_encoder",
        tokenizer: "tokenizer",
        builtin: BuiltinTokenizer::ClipL,
        single_file_prefix: None,
        max_len: CLIP_MAX_LEN,
        max_len_unguided: CLIP_MAX_LEN,
    },
    EncoderSlot {
        name: "t5",
        kind: TextEncoderKind::T5,
        kohya: "lora_te3",
        folder: "text_encoder_2",
        tokenizer: "tokenizer_2",
        builtin: BuiltinTokenizer::T5,
        single_file_prefix: None,
        max_len: T5_LEN_FLUX_DEV,
        max_len_unguided: T5_LEN_SCHNELL_SD35,
    },
];

fn combine(outs: &[TextOutput]) -> Result<Vec<(String, Tensor)>> {
    Ok(vec![
        ("context".into(), output(outs, 1)?.t5("t5")?.clone()),
        (
            "pooled".into(),
            output(outs, 0)?.clip("clip_l")?.pooled.clone(),
        ),
    ])
}

fn schedule(s: &SampleSetup) -> Result<Box<dyn Schedule>> {
    let config = match s.guided {
        true => FlowMatchConfig::flux_dev(),
        false => FlowMatchConfig::flux_schnell(),
    };
    // Packed 2x2 latent patches are Flux's image tokens.
    let tokens = (s.latent_hw.0 / 2) * (s.latent_hw.1 / 2);
    Ok(Box::new(FlowMatchEuler::flux(&config, s.steps, tokens)?))
}

/// Flux's pipeline: CLIP-L + T5, the 16-channel autoencoder, flow-matching Euler.
static PIPELINE: PipelineSpec = PipelineSpec {
    text: &TEXT,
    combine,
    vae: VaeKind::Flux,
    vae_single_file_prefix: None,
    schedule,
};

/// Ops that launch work and views a block's forward records with an adapter on each of its
/// Linears (`BlockShape::ops`, `views`; `tests/plan.rs` counts them on a tiny model).
impl Flux {
    const DOUBLE_OPS: (usize, usize) = (59, 175);
    const SINGLE_OPS: (usize, usize) = (23, 61);
}

impl ModelSpec for Flux {
    type Config = FluxConfig;
    const SIGNATURE: &'static [&'static str] = &[
        "img_in.weight",
        "txt_in.weight",
        "time_in.in_layer.weight",
        "double_blocks.0.img_mod.lin.weight",
    ];
    const DIFFUSERS_CLASS: &'static str = "FluxTransformer2DModel";
    const CONDITIONED: &'static [&'static str] = &["_mod.lin.weight", "modulation.lin.weight"];

    fn entry() -> &'static Family {
        &FAMILY
    }
    fn config_from_diffusers(json: &serde_json::Value) -> Result<FluxConfig> {
        FluxConfig::from_diffusers(json)
    }
    fn config_from_single_file(vb: &VarBuilder) -> Result<FluxConfig> {
        FluxConfig::from_single_file(vb)
    }
    fn reference_config() -> FluxConfig {
        FluxConfig::dev()
    }
    fn validate(config: &FluxConfig) -> Result<()> {
        config.validate()
    }
    fn diffusers_map(config: &FluxConfig) -> KeyMap {
        diffusers_map(config)
    }
    fn block_prefixes_of(config: &FluxConfig) -> Vec<String> {
        config.block_prefixes()
    }
    fn check_single_file(ckpt: &Checkpoint) -> Result<()> {
        if ckpt.prefix.is_empty() {
            Ok(())
        } else {
            Err(ckpt.error("a Flux single file has BFL keys without a prefix"))
        }
    }
    fn build(vb: &VarBuilder, config: &FluxConfig) -> Result<Flux> {
        Flux::new(vb, config)
    }
    /// Every block (double and single) sees the packed image tokens ((H/2)(W/2)) and the
    /// text tokens at the hidden width, one attention call each.
    fn block_shapes(config: &FluxConfig, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>> {
        let ((h, w), t) = latent_and_context("flux", sample)?;
        let img = (h / 2) * (w / 2);
        let single = BlockShape {
            tokens: img + t,
            weight_tokens: img + t,
            width: config.hidden_size,
            layers: 1.0,
            attention_calls: 1,
            cross_calls: 0,
            context_tokens: t,
            context_keys: &[],
            heads: config.num_heads,
            ops: Self::SINGLE_OPS.0,
            views: Self::SINGLE_OPS.1,
            // The modulations (`img_mod`, `txt_mod`, a single block's `modulation`).
            conditioned: Self::CONDITIONED,
            tails: &[],
            tail_gates: &[],
        };
        // A double block's image and text weights (equal halves) each see their own tokens.
        let double = BlockShape {
            weight_tokens: (img + t) / 2,
            ops: Self::DOUBLE_OPS.0,
            views: Self::DOUBLE_OPS.1,
            ..single
        };
        let mut v = vec![double; config.depth];
        v.extend(vec![single; config.depth_single_blocks]);
        Ok(v)
    }
}

impl Flux {
    /// The guidance input of a batch of `b` at scale `guidance`: dev's (`guidance_in`);
    /// schnell takes none.
    fn guidance_tensor(&self, guidance: f64, b: usize, dev: &Device) -> Result<Option<Tensor>> {
        self.config
            .guidance_embed
            .then(|| Tensor::full(guidance, b, DType::F32, dev))
            .transpose()
    }
}

impl DiffusionModel for Flux {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    /// latents (C/4, H, W) with H, W even (2x2 packing), context (T, context_in_dim),
    /// pooled (vec_in_dim).
    fn inputs(&self) -> Vec<Input> {
        let c = &self.config;
        vec![
            Input::new(
                "latents",
                vec![
                    Size::Exactly(c.in_channels / 4),
                    Size::MultipleOf(2),
                    Size::MultipleOf(2),
                ],
            ),
            Input::new(
                "context",
                vec![Size::MultipleOf(1), Size::Exactly(c.context_in_dim)],
            ),
            Input::new("pooled", vec![Size::Exactly(c.vec_in_dim)]),
        ]
    }

    fn objective(&self) -> Objective {
        Objective::FlowMatching
    }

    /// Packs `xt` into tokens, runs the transformer with image and text position ids and,
    /// for guidance-distilled models (dev), `guidance` as the guidance input; unpacks.
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], guidance: f64) -> Result<Tensor> {
        let [ctx, pooled] = conds("flux", cond, [3, 2])?;
        let d = xt.dims();
        if d.len() != 4 {
            return Err(crate::Error::invalid(
                "flux",
                "xt must be (B, C, H, W)",
                xt.shape(),
            ));
        }
        let (b, h, w) = (d[0], d[2] / 2, d[3] / 2);
        let dev = xt.device();
        let img = pack_latents(xt)?;
        let g = self.guidance_tensor(guidance, b, dev)?;
        let out = self.forward(
            &img,
            &image_ids(h, w, dev)?,
            ctx,
            &text_ids(ctx.dims()[1], dev)?,
            t,
            pooled,
            g.as_ref(),
        )?;
        unpack_latents(&out, h, w)
    }

    fn prepare(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], guidance: f64) -> Result<()> {
        let [_, pooled] = conds("flux", cond, [3, 2])?;
        self.exec.prepare_products(|| {
            let _g = crate::no_grad();
            let b = xt.dims().first().copied().unwrap_or(1);
            let g = self.guidance_tensor(guidance, b, xt.device())?;
            self.conditioning(xt.dtype(), t, pooled, g.as_ref())?.silu()
        })
    }

    /// Flux dev (a `guidance_in` embedder); schnell has none.
    fn guidance_input(&self) -> bool {
        self.config.guidance_embed
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}
