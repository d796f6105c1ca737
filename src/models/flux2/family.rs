//! FLUX.2 as a model family: config reading, construction, the training inputs (the
//! autoencoder's latents as normalized 2x2 patches, the text encoder's hidden states) and
//! Flux2KleinPipeline's sampler.
//!
//! Its pipeline (Flux2KleinPipeline's): Qwen3 (Qwen3-4B for klein 4B, Qwen3-8B for 9B) with
//! its hidden states 9, 18 and 27 side by side as the `context`, FLUX.2's autoencoder
//! (AutoencoderKLFlux2: 32 channels, its 2x2 patches normalized by its BatchNorm statistics)
//! and the Klein sampler.

use super::{
    diffusers_map, image_ids, pack_latents, reference_tokens, text_ids, unpack_latents, Flux2,
    Flux2Config,
};
use crate::diffusion::schedulers::{FlowMatchConfig, FlowMatchEuler};
use crate::diffusion::Schedule;
use crate::encoders::{BuiltinTokenizer, Qwen3Context, VaeKind, QWEN3_FLUX2_KLEIN};
use crate::memory::{BlockExec, BlockShape};
use crate::models::checkpoint::{Checkpoint, LDM_PREFIX};
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::models::pipeline::{
    output, EncoderSlot, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput,
};
use crate::nn::adapter::{ModuleNames, ToolNames};
use crate::nn::{KeyMap, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};

/// The family entry of FLUX.2 (BFL's FLUX.2 \[klein\] 4B / 9B and fine-tunes).
pub static FAMILY: Family = Family::of::<Flux2>(
    "flux2",
    "transformer",
    "FLUX.2 [klein] transformer (BFL single file or diffusers Flux2Transformer2DModel)",
    &PIPELINE,
);

/// Qwen3 in the pipeline's `text_encoder` / `tokenizer` folders, its chat prompt without
/// thinking and 512 tokens (diffusers `Flux2KleinPipeline.encode_prompt`,
/// `QWEN3_FLUX2_KLEIN`).
static TEXT: [EncoderSlot; 1] = [EncoderSlot {
    name: "qwen3",
    kind: TextEncoderKind::Qwen3(&QWEN3_FLUX2_KLEIN),
    kohya: "lora_te_model",
    folder: "text_encoder",
    tokenizer: "tokenizer",
    builtin: BuiltinTokenizer::Qwen3,
    single_file_prefix: None,
    max_len: QWEN3_FLUX2_KLEIN.max_len,
    max_len_unguided: QWEN3_FLUX2_KLEIN.max_len,
}];

/// FLUX.2's pipeline: Qwen3, its autoencoder, the Klein sampler.
static PIPELINE: PipelineSpec = PipelineSpec {
    text: &TEXT,
    combine,
    vae: VaeKind::Flux2,
    vae_single_file_prefix: None,
    schedule: pipeline_schedule,
};

/// The `context`: Qwen3's hidden states 9, 18 and 27 side by side at every position, the
/// padding's too (the transformer takes no text mask).
fn combine(outs: &[TextOutput]) -> Result<Vec<(String, Tensor)>> {
    match QWEN3_FLUX2_KLEIN.combine(output(outs, 0)?.qwen3("qwen3")?)? {
        Qwen3Context::Padded(t) => Ok(vec![("context".into(), t)]),
        Qwen3Context::PerCaption(_) => Err(Error::Config {
            path: None,
            msg: "flux2: the text conditioning gave per-caption states, the model takes \
                  every position"
                .into(),
        }),
    }
}

fn pipeline_schedule(s: &SampleSetup) -> Result<Box<dyn Schedule>> {
    // The model's latents are the 2x2 patches already: one token per position.
    Ok(Box::new(schedule(s.steps, s.latent_hw.0 * s.latent_hw.1)?))
}

/// The shift Flux2KleinPipeline gives its sampler (diffusers
/// `pipelines/flux2/pipeline_flux2_klein.py`, `compute_empirical_mu`, copied from
/// `pipeline_flux2.py`): mu on the line through (10 steps, 8.73809524e-5 x tokens +
/// 1.89833333) and (200 steps, 1.6927e-4 x tokens + 0.45666666), at `steps`; past 4300
/// image tokens, the 200-step line alone.
pub fn empirical_mu(image_seq_len: usize, steps: usize) -> f64 {
    let (a1, b1) = (8.73809524e-05, 1.89833333);
    let (a2, b2) = (0.00016927, 0.45666666);
    let n = image_seq_len as f64;
    if image_seq_len > 4300 {
        return a2 * n + b2;
    }
    let m_200 = a2 * n + b2;
    let m_10 = a1 * n + b1;
    let a = (m_200 - m_10) / 190.0;
    let b = m_200 - 200.0 * a;
    a * steps as f64 + b
}

/// Flux2KleinPipeline's sampler: FlowMatchEulerDiscreteScheduler with dynamic shifting,
/// sigmas `linspace(1, 1/steps, steps)` shifted by mu = [`empirical_mu`] (exponential time
/// shift: e^mu / (e^mu + (1/sigma - 1))). `image_seq_len` is the packed token count, h w of
/// the model's (C, h, w) latents.
pub fn schedule(steps: usize, image_seq_len: usize) -> Result<FlowMatchEuler> {
    let mu = empirical_mu(image_seq_len, steps);
    // A line of slope 0 through mu: `FlowMatchConfig::mu` gives mu at every size, and
    // `FlowMatchEuler::flux` shifts by it as the scheduler does.
    let config = FlowMatchConfig {
        base_shift: mu,
        max_shift: mu,
        base_image_seq_len: 0,
        max_image_seq_len: 1,
        ..FlowMatchConfig::flux_dev()
    };
    FlowMatchEuler::flux(&config, steps, image_seq_len)
}

/// Ops that launch work and views a block's forward records with an adapter on each of its
/// Linears (`BlockShape::ops`, `views`; `tests/plan.rs` counts them on a tiny model).
impl Flux2 {
    const DOUBLE_OPS: (usize, usize) = (58, 139);
    const SINGLE_OPS: (usize, usize) = (22, 49);
}

impl ModelSpec for Flux2 {
    type Config = Flux2Config;
    const SIGNATURE: &'static [&'static str] = &[
        "img_in.weight",
        "txt_in.weight",
        "double_stream_modulation_img.lin.weight",
        "single_stream_modulation.lin.weight",
    ];
    const DIFFUSERS_CLASS: &'static str = "Flux2Transformer2DModel";
    /// ai-toolkit's FLUX.2 is its port of BFL's model (ostris/ai-toolkit
    /// `extensions_built_in/diffusion_models/flux2/src/model.py`), musubi-tuner's too
    /// (kohya-ss/musubi-tuner `src/musubi_tuner/flux_2/flux2_models.py`): BFL's names.
    const TOOL_NAMES: ToolNames = ToolNames {
        ai_toolkit: Some(ModuleNames::Original),
        musubi: Some(ModuleNames::Original),
    };
    /// FLUX.2 \[klein\] edits from reference images (`Flux2KleinPipeline`'s `image`).
    const REFERENCES: bool = true;

    fn entry() -> &'static Family {
        &FAMILY
    }
    fn config_from_diffusers(json: &serde_json::Value) -> Result<Flux2Config> {
        Flux2Config::from_diffusers(json)
    }
    fn config_from_single_file(vb: &VarBuilder) -> Result<Flux2Config> {
        Flux2Config::from_single_file(vb)
    }
    fn reference_config() -> Flux2Config {
        Flux2Config::klein_4b()
    }
    fn validate(config: &Flux2Config) -> Result<()> {
        config.validate()
    }
    fn diffusers_map(config: &Flux2Config) -> KeyMap {
        diffusers_map(config)
    }
    fn block_prefixes_of(config: &Flux2Config) -> Vec<String> {
        config.block_prefixes()
    }
    /// BFL's keys, bare or under ComfyUI's `model.diffusion_model.`. FP8 files (BFL's
    /// `weight_scale` / `input_scale`, ComfyUI's `scale_weight` / `scaled_fp8`) load through
    /// `nn::scaled_fp8`, their weights scaled.
    fn check_single_file(ckpt: &Checkpoint) -> Result<()> {
        if !ckpt.prefix.is_empty() && ckpt.prefix != LDM_PREFIX {
            return Err(ckpt.error(format!(
                "a FLUX.2 single file has BFL keys, bare or under \"{LDM_PREFIX}\""
            )));
        }
        Ok(())
    }
    fn build(vb: &VarBuilder, config: &Flux2Config) -> Result<Flux2> {
        Flux2::new(vb, config)
    }
    /// Every block (double and single) sees the packed image tokens (h w of the (C, h, w)
    /// latents), the reference images' tokens (the (C, h_i, w_i) shapes after the inputs, as
    /// `DiffusionModel::predict_with_references` appends them) and the text tokens at the
    /// hidden width, one attention call each.
    fn block_shapes(config: &Flux2Config, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>> {
        let ((h, w), t) = latent_and_context("flux2", sample)?;
        let references: usize = sample
            .iter()
            .skip(2)
            .filter(|s| s.len() == 3)
            .map(|s| s[1] * s[2])
            .sum();
        let img = h * w + references;
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
            // The modulations are the model's, outside the blocks.
            conditioned: &[],
            // Each block ends `x + gate * linear(h)`, the gate from the model's modulation.
            tails: &["linear2.", "_mlp.2."],
            // The shared modulations and the embedders they read.
            tail_gates: &["_modulation", "time_in", "guidance_in"],
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

impl Flux2 {
    /// The guidance input of a batch of `b` at scale `guidance` where the model has a
    /// guidance embedding; Klein takes none.
    fn guidance_tensor(&self, guidance: f64, b: usize, dev: &Device) -> Result<Option<Tensor>> {
        self.config
            .guidance_embed
            .then(|| Tensor::full(guidance, b, DType::F32, dev))
            .transpose()
    }
}

impl DiffusionModel for Flux2 {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    /// latents (C, h, w): the autoencoder's latents as 2x2 patches normalized by its
    /// BatchNorm statistics (`Flux2KleinPipeline._patchify_latents`, `_encode_vae_image`);
    /// context (T, context_in_dim): the text encoder's stacked hidden states.
    fn inputs(&self) -> Vec<Input> {
        let c = &self.config;
        vec![
            Input::new(
                "latents",
                vec![
                    Size::Exactly(c.in_channels),
                    Size::MultipleOf(1),
                    Size::MultipleOf(1),
                ],
            ),
            Input::new(
                "context",
                vec![Size::MultipleOf(1), Size::Exactly(c.context_in_dim)],
            ),
        ]
    }

    /// Rectified flow, as Flux2KleinPipeline samples it (FlowMatchEulerDiscreteScheduler:
    /// the model's `timestep` is sigma, x_t = (1 - sigma) x0 + sigma noise, velocity noise - x0).
    fn objective(&self) -> Objective {
        Objective::FlowMatching
    }

    /// Packs `xt` into tokens, runs the transformer with image and text position ids (and,
    /// where the model has a guidance embedding, `guidance`); unpacks.
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], guidance: f64) -> Result<Tensor> {
        self.predict_with_references(xt, t, cond, &[], guidance)
    }

    /// [`predict`](DiffusionModel::predict) with the reference latents `refs` appended as
    /// tokens after the image's ([`reference_tokens`], [`Flux2::forward_with_references`]).
    fn predict_with_references(
        &self,
        xt: &Tensor,
        t: &Tensor,
        cond: &[Tensor],
        refs: &[Tensor],
        guidance: f64,
    ) -> Result<Tensor> {
        let [ctx] = conds("flux2", cond, [3])?;
        let d = xt.dims();
        if d.len() != 4 {
            return Err(Error::invalid(
                "flux2",
                "xt must be (B, C, h, w)",
                xt.shape(),
            ));
        }
        let (b, h, w) = (d[0], d[2], d[3]);
        let dev = xt.device();
        let g = self.guidance_tensor(guidance, b, dev)?;
        if let Some(r) = refs.iter().find(|r| r.rank() != 4 || r.dims()[0] != b) {
            return Err(Error::ShapeMismatch {
                op: "flux2: a reference's latents (B, C, h, w) vs xt",
                lhs: r.shape().clone(),
                rhs: xt.shape().clone(),
            });
        }
        let refs = reference_tokens(refs)?;
        let out = self.forward_with_references(
            &pack_latents(xt)?,
            &image_ids(h, w, dev)?,
            refs.as_ref().map(|(r, ids)| (r, ids)),
            ctx,
            &text_ids(ctx.dims()[1], dev)?,
            t,
            g.as_ref(),
        )?;
        unpack_latents(&out, h, w)
    }

    /// Models with a guidance embedding (FLUX.2 \[dev\]); Klein has none.
    fn guidance_input(&self) -> bool {
        self.config.guidance_embed
    }

    /// The latents are the autoencoder's 2x2 patches already: one token a position.
    fn image_tokens(&self, h: usize, w: usize) -> usize {
        h * w
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}
