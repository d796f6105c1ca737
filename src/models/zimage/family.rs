//! Z-Image as a model family: config reading, construction, the planner's block shapes and
//! the training inputs (latents patched 2x2 inside the model, the text encoder's hidden
//! states right-padded with a mask) and its pipeline: Qwen3's `hidden_states[-2]` of the
//! chat prompt with thinking (`ZImagePipeline._encode_prompt`), FLUX.1's 16-channel
//! autoencoder, and flow-matching Euler with shift 3.

use super::{diffusers_map, ZImage, ZImageConfig, SEQ_MULTI_OF};
use crate::diffusion::schedulers::{FlowMatchConfig, FlowMatchEuler};
use crate::diffusion::Schedule;
use crate::encoders::{BuiltinTokenizer, VaeKind, QWEN3_Z_IMAGE};
use crate::memory::{BlockExec, BlockShape};
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::models::pipeline::{
    output, EncoderSlot, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput,
};
use crate::nn::adapter::{ModuleNames, ToolNames};
use crate::nn::{KeyMap, VarBuilder};
use crate::{Error, Result, Tensor};

/// The family entry of the Z-Image transformer (Z-Image 6B, base and Turbo).
pub static FAMILY: Family = Family::of::<ZImage>(
    "zimage",
    "transformer",
    "Z-Image (original single file or diffusers ZImageTransformer2DModel)",
    &PIPELINE,
);

/// Qwen3 in the pipeline's `text_encoder` / `tokenizer` folders, its chat prompt with
/// thinking, 512 tokens (`ZImagePipeline.encode_prompt`'s `max_sequence_length`;
/// `QWEN3_Z_IMAGE`).
static TEXT: [EncoderSlot; 1] = [EncoderSlot {
    name: "qwen3",
    kind: TextEncoderKind::Qwen3(&QWEN3_Z_IMAGE),
    kohya: "lora_te_model",
    folder: "text_encoder",
    tokenizer: "tokenizer",
    builtin: BuiltinTokenizer::Qwen3,
    single_file_prefix: None,
    max_len: QWEN3_Z_IMAGE.max_len,
    max_len_unguided: QWEN3_Z_IMAGE.max_len,
}];

/// The `context`: Qwen3's `hidden_states[-2]` at every one of the 512 positions, and the
/// `context_mask` (1 over the caption's tokens, 0 over the padding). The pipeline hands
/// the transformer each caption's tokens only; the model lays a padded caption out so that
/// its output is the same (module docs of `zimage::model`).
fn combine(outs: &[TextOutput]) -> Result<Vec<(String, Tensor)>> {
    let out = output(outs, 0)?.qwen3("qwen3")?;
    let [hidden] = out.hidden.as_slice() else {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "zimage: Qwen3 gave {} hidden states, the conditioning takes one",
                out.hidden.len()
            ),
        });
    };
    let mask = out.mask.to_dtype(hidden.dtype())?;
    Ok(vec![
        ("context".into(), hidden.clone()),
        ("context_mask".into(), mask),
    ])
}

/// `ZImagePipeline`'s sampler: sigmas `linspace(1, 1/steps, steps)`
/// (`get_default_z_image_sigmas`) through `FlowMatchEulerDiscreteScheduler` with shift 3 and
/// no dynamic shifting (Z-Image-Turbo's scheduler/scheduler_config.json: `"shift": 3.0,
/// "use_dynamic_shifting": false`).
fn schedule(s: &SampleSetup) -> Result<Box<dyn Schedule>> {
    let config = FlowMatchConfig {
        shift: 3.0,
        use_dynamic_shifting: false,
        ..FlowMatchConfig::flux_dev()
    };
    let tokens = (s.latent_hw.0 / 2) * (s.latent_hw.1 / 2);
    Ok(Box::new(FlowMatchEuler::flux(&config, s.steps, tokens)?))
}

/// The 16-channel autoencoder of FLUX.1 (`ZImagePipeline` decodes with
/// `latents / scaling_factor + shift_factor` from the VAE's config.json).
static PIPELINE: PipelineSpec = PipelineSpec {
    text: &TEXT,
    combine,
    vae: VaeKind::Flux,
    vae_single_file_prefix: None,
    schedule,
};

/// Ops that launch work and views a block's forward records with an adapter on each of its
/// Linears (`BlockShape::ops`, `views`; tests/zimage.rs counts them on a tiny model):
/// a modulated block (noise refiner, main layers) and a context-refiner block.
impl ZImage {
    const MODULATED_OPS: (usize, usize) = (42, 100);
    const PLAIN_OPS: (usize, usize) = (32, 84);
}

impl ModelSpec for ZImage {
    type Config = ZImageConfig;
    const SIGNATURE: &'static [&'static str] =
        &["x_pad_token", "cap_pad_token", "x_embedder.weight"];
    const DIFFUSERS_CLASS: &'static str = "ZImageTransformer2DModel";
    /// ai-toolkit trains diffusers' `ZImageTransformer2DModel` (ostris/ai-toolkit
    /// `toolkit/models/v2/z_image.py`), musubi-tuner its own model with diffusers' attention
    /// names (kohya-ss/musubi-tuner `src/musubi_tuner/zimage/zimage_model.py`,
    /// `ZImageAttention`: `to_q`, `to_k`, `to_v`, `to_out.0`): diffusers' names.
    const TOOL_NAMES: ToolNames = ToolNames {
        ai_toolkit: Some(ModuleNames::Diffusers),
        musubi: Some(ModuleNames::Diffusers),
    };
    const CONDITIONED: &'static [&'static str] = &["adaLN_modulation.0.weight"];

    fn entry() -> &'static Family {
        &FAMILY
    }
    fn config_from_diffusers(json: &serde_json::Value) -> Result<ZImageConfig> {
        ZImageConfig::from_diffusers(json)
    }
    fn config_from_single_file(vb: &VarBuilder) -> Result<ZImageConfig> {
        ZImageConfig::from_single_file(vb)
    }
    fn reference_config() -> ZImageConfig {
        ZImageConfig::z_image_6b()
    }
    fn validate(config: &ZImageConfig) -> Result<()> {
        config.validate()
    }
    fn diffusers_map(config: &ZImageConfig) -> KeyMap {
        diffusers_map(config)
    }
    fn block_prefixes_of(config: &ZImageConfig) -> Vec<String> {
        config.block_prefixes()
    }
    fn build(vb: &VarBuilder, config: &ZImageConfig) -> Result<ZImage> {
        ZImage::new(vb, config)
    }
    /// The noise refiner sees the padded image tokens, the context refiner the padded
    /// caption slots, the main layers both, one self-attention each.
    fn block_shapes(config: &ZImageConfig, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>> {
        let ((h, w), t) = latent_and_context("zimage", sample)?;
        let p = config.patch_size;
        let img = ((h / p) * (w / p)).div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF;
        let txt = t.div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF;
        let noise = BlockShape {
            tokens: img,
            weight_tokens: img,
            width: config.dim,
            // Measured (NVIDIA H200, 2026-12-01, Z-Image 6B's resident LoRA step at 1024²,
            // 4096 + 512 tokens): 41.41 GiB at the peak where Flux's 21 values a token-channel
            // (`SAVED_PER_TOKEN_CHANNEL`) predicted 34.68, 22.15 of them activations: its
            // blocks keep 1.30 times as much (a norm before and after attention and the MLP,
            // the q/k norms, SwiGLU's three 2.67x-wide tensors).
            layers: 1.3,
            attention_calls: 1,
            cross_calls: 0,
            context_tokens: txt,
            context_keys: &[],
            heads: config.n_heads,
            ops: Self::MODULATED_OPS.0,
            views: Self::MODULATED_OPS.1,
            conditioned: Self::CONDITIONED,
            tails: &[],
            tail_gates: &[],
        };
        let context = BlockShape {
            tokens: txt,
            weight_tokens: txt,
            ops: Self::PLAIN_OPS.0,
            views: Self::PLAIN_OPS.1,
            conditioned: &[],
            tails: &[],
            tail_gates: &[],
            ..noise
        };
        let main = BlockShape {
            tokens: img + txt,
            weight_tokens: img + txt,
            ..noise
        };
        let n = config.n_refiner_layers;
        let mut v = vec![noise; n];
        v.extend(vec![context; n]);
        v.extend(vec![main; config.n_layers]);
        Ok(v)
    }
}

impl ZImage {
    /// The model's timesteps for FLAME's flow-matching t (noise at 1): `1 - t`.
    fn model_t(t: &Tensor) -> Result<Tensor> {
        t.affine(-1.0, 1.0)
    }
}

impl DiffusionModel for ZImage {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    /// latents (C, H, W) with H, W multiples of the patch, context (T, cap_feat_dim) the
    /// text encoder's hidden states right-padded to T, context_mask (T) 1 for the caption's
    /// tokens then 0.
    fn inputs(&self) -> Vec<Input> {
        let c = &self.config;
        vec![
            Input::new(
                "latents",
                vec![
                    Size::Exactly(c.in_channels),
                    Size::MultipleOf(c.patch_size),
                    Size::MultipleOf(c.patch_size),
                ],
            ),
            Input::new(
                "context",
                vec![Size::MultipleOf(1), Size::Exactly(c.cap_feat_dim)],
            ),
            Input::new("context_mask", vec![Size::MultipleOf(1)]),
        ]
    }

    /// The context and its mask have one length, and every position lies inside the
    /// model's RoPE tables (`axes_lens`). Given the latents alone (the trainer checks every
    /// bucket so, before any caption is encoded), only the patch grid is checked.
    fn check_shapes(&self, shapes: &[Vec<usize>]) -> std::result::Result<(), String> {
        let c = &self.config;
        let Some(l) = shapes.first().filter(|l| l.len() == 3) else {
            return Err(format!(
                "zimage: latents {:?} must be (C, H, W)",
                shapes.first()
            ));
        };
        let grid = (l[1] / c.patch_size, l[2] / c.patch_size);
        if grid.0 >= c.axes_lens[1] || grid.1 >= c.axes_lens[2] {
            return Err(format!(
                "zimage: a {}x{} patch grid exceeds the positions the model knows (axes_lens \
                 {:?})",
                grid.0, grid.1, c.axes_lens
            ));
        }
        match (shapes.get(1), shapes.get(2)) {
            (None, None) => Ok(()),
            (Some(t), Some(m)) if !t.is_empty() && m.first() == t.first() => {
                let frame = t[0].div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF + 1;
                if frame >= c.axes_lens[0] {
                    return Err(format!(
                        "zimage: {} caption tokens exceed the positions the model knows \
                         (axes_lens {:?})",
                        t[0], c.axes_lens
                    ));
                }
                Ok(())
            }
            (t, m) => Err(format!(
                "zimage: context {t:?} and context_mask {m:?} must have one length"
            )),
        }
    }

    fn objective(&self) -> Objective {
        Objective::FlowMatching
    }

    /// The velocity ε - x0 at FLAME's t: the model runs at `1 - t` and its output, which
    /// points from the noise to the data, is negated (`ZImagePipeline.__call__`:
    /// `timestep = (1000 - t) / 1000`, `noise_pred = -noise_pred`).
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<Tensor> {
        let [ctx, mask] = conds("zimage", cond, [3, 2])?;
        self.forward(xt, &Self::model_t(t)?, ctx, mask)?.neg()
    }

    fn prepare(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], _guidance: f64) -> Result<()> {
        conds("zimage", cond, [3, 2])?;
        self.exec.prepare_products(|| {
            let _g = crate::no_grad();
            self.conditioning(xt.dtype(), &Self::model_t(t)?)
        })
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}
