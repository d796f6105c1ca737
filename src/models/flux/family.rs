//! Flux as a registered model family: config reading, construction, and the training
//! inputs (latents packed into 2x2 patches, T5 tokens, the CLIP pooled vector).

use super::{diffusers_map, image_ids, pack_latents, text_ids, unpack_latents, Flux, FluxConfig};
use crate::models::checkpoint::Checkpoint;
use crate::models::common::{conds, latent_and_context};
use crate::models::family::{DiffusionModel, Family, Input, ModelSpec, Objective, Size};
use crate::nn::{KeyMap, VarBuilder};
use crate::stream::{BlockExec, BlockShape};
use crate::{DType, Result, Tensor};

/// The registry entry of Flux (BFL's FLUX.1 dev / schnell and fine-tunes).
pub static FAMILY: Family = Family::of::<Flux>(
    "flux",
    "transformer",
    "FLUX.1 (BFL single file or diffusers FluxTransformer2DModel)",
);

impl ModelSpec for Flux {
    type Config = FluxConfig;

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
        let shape = BlockShape {
            tokens: (h / 2) * (w / 2) + t,
            width: config.hidden_size,
            layers: 1.0,
            attention_calls: 1,
            heads: config.num_heads,
        };
        Ok(vec![shape; config.depth + config.depth_single_blocks])
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
        let g = if self.config.guidance_embed {
            Some(Tensor::full(guidance, b, DType::F32, dev)?)
        } else {
            None
        };
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

    /// Flux dev (a `guidance_in` embedder); schnell has none.
    fn guidance_input(&self) -> bool {
        self.config.guidance_embed
    }

    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }
}
