//! The UNet's hyperparameters, from SDXL base 1.0's defaults, a diffusers config.json, or a
//! single file's tensor shapes.

use crate::models::checkpoint::{cfg_opt, cfg_usize, cfg_usize_list};
use crate::nn::VarBuilder;
use crate::{Error, Result};
use serde_json::Value;

/// Channels per attention head in Stability's SDXL configs (sgm `sd_xl_base.yaml`:
/// `num_head_channels: 64`): a single file's heads are its channels / 64.
pub const HEAD_CHANNELS: usize = 64;

/// GroupNorm groups of every ResBlock and SpatialTransformer (sgm `normalization` =
/// `GroupNorm32(32, channels)`, diffusers `norm_num_groups` 32).
pub const NUM_GROUPS: usize = 32;

/// Sinusoidal channels per micro-conditioning number (sgm `ConcatTimestepEmbedderND(outdim=
/// 256)`, diffusers `addition_time_embed_dim` 256): six numbers x 256 + 1280 pooled = 2816.
pub const ADDITION_TIME_EMBED_DIM: usize = 256;

/// The SDXL UNet's hyperparameters (sgm `UNetModel`, diffusers `UNet2DConditionModel`). Level
/// l has `block_out_channels[l]` channels, `num_res_blocks` ResBlocks on the way down (one more on the way
/// up), each followed by a SpatialTransformer of `transformer_depth[l]` blocks when that is
/// above 0.
#[derive(Clone, Debug, PartialEq)]
pub struct SdxlConfig {
    /// Latent channels in (4).
    pub in_channels: usize,
    /// Channels of the predicted noise (4).
    pub out_channels: usize,
    /// Channels of `conv_in`'s output, the first level's (320); the time embedding is 4x
    /// this wide.
    pub model_channels: usize,
    /// Channels of each level (`[320, 640, 1280]`; diffusers' `block_out_channels`, sgm's
    /// `model_channels * channel_mult`); its length is the number of levels, and the first
    /// is `model_channels`. Any widths GroupNorm's groups and the heads divide.
    pub block_out_channels: Vec<usize>,
    /// ResBlocks per level on the way down (2).
    pub num_res_blocks: usize,
    /// Transformer blocks per SpatialTransformer, per level (0: no attention there).
    pub transformer_depth: Vec<usize>,
    /// Attention heads per level (SDXL: channels / 64). The middle block uses the last one.
    pub num_heads: Vec<usize>,
    /// Transformer blocks in the middle block's SpatialTransformer (10).
    pub transformer_depth_middle: usize,
    /// Text token width (CLIP-L 768 + OpenCLIP-bigG 1280).
    pub context_dim: usize,
    /// Width of the vector `y`: pooled text + micro-conditioning embeddings.
    pub adm_in_channels: usize,
    /// Sinusoidal channels per micro-conditioning number (see [`crate::models::sdxl::sdxl_vector`]).
    pub addition_time_embed_dim: usize,
    /// GroupNorm groups (32).
    pub num_groups: usize,
}

/// What one of the UNet's units runs ([`SdxlConfig::units`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    /// A ResBlock (an input block's, or the middle block's first or last).
    Res,
    /// An output block's ResBlock on the skip-concatenated channels; `up`: with its level's
    /// upsampler after it (at levels without attention, where the block stays whole).
    SkipRes {
        /// The level's upsampler runs in this unit too.
        up: bool,
    },
    /// One transformer layer of a SpatialTransformer (self-attention, cross-attention, MLP).
    Layer,
    /// The stride-2 downsampler ending a level on the way down.
    Down,
    /// The upsampler ending a level with attention on the way up.
    Up,
}

/// One unit of checkpointing and streaming of the UNet ([`SdxlConfig::units`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// The key prefix of its weights.
    pub prefix: String,
    /// The resolution level it runs at (its input's).
    pub level: usize,
    /// What it runs.
    pub kind: UnitKind,
}

fn bad(msg: String) -> Error {
    Error::Config { path: None, msg }
}

impl SdxlConfig {
    /// SDXL base 1.0 (sgm `configs/inference/sd_xl_base.yaml`; diffusers
    /// `stabilityai/stable-diffusion-xl-base-1.0/unet/config.json`).
    pub fn base() -> Self {
        SdxlConfig {
            in_channels: 4,
            out_channels: 4,
            model_channels: 320,
            block_out_channels: vec![320, 640, 1280],
            num_res_blocks: 2,
            transformer_depth: vec![0, 2, 10],
            num_heads: vec![5, 10, 20],
            transformer_depth_middle: 10,
            context_dim: 2048,
            adm_in_channels: 2816,
            addition_time_embed_dim: ADDITION_TIME_EMBED_DIM,
            num_groups: NUM_GROUPS,
        }
    }

    /// Number of resolution levels (`block_out_channels.len()`, 3).
    pub fn levels(&self) -> usize {
        self.block_out_channels.len()
    }

    /// Channels of level `level`.
    pub fn channels(&self, level: usize) -> usize {
        self.block_out_channels[level]
    }

    /// Width of the timestep embedding (sgm `time_embed_dim = model_channels * 4`).
    pub fn time_embed_dim(&self) -> usize {
        4 * self.model_channels
    }

    /// The UNet's blocks as the unit of checkpointing and streaming, in execution order:
    /// every ResBlock, every transformer layer of a SpatialTransformer and every resampler
    /// is one. A block without attention stays whole (`input_blocks.1`, a ResBlock; an
    /// output block's ResBlock with its level's upsampler); one with attention is split into
    /// its ResBlock (`input_blocks.4.0`), its layers (`input_blocks.4.1.transformer_blocks.k`)
    /// and its upsampler (`output_blocks.5.2`). A SpatialTransformer's GroupNorm and
    /// projections in and out stay outside the units (resident, 0.6% of SDXL's weights). SDXL
    /// base's largest whole block (the middle one, 0.77 GiB in bf16) would otherwise be the
    /// step's grain: two of them on the device at once with a prefetch of one.
    pub fn units(&self) -> Vec<Unit> {
        let levels = self.levels();
        let mut v = vec![];
        let mut push = |prefix: String, level: usize, kind: UnitKind| {
            v.push(Unit {
                prefix,
                level,
                kind,
            })
        };
        let mut n = 0;
        for level in 0..levels {
            let depth = self.transformer_depth[level];
            for _ in 0..self.num_res_blocks {
                n += 1;
                if depth == 0 {
                    push(format!("input_blocks.{n}"), level, UnitKind::Res);
                } else {
                    push(format!("input_blocks.{n}.0"), level, UnitKind::Res);
                    for k in 0..depth {
                        push(
                            format!("input_blocks.{n}.1.transformer_blocks.{k}"),
                            level,
                            UnitKind::Layer,
                        );
                    }
                }
            }
            if level + 1 < levels {
                n += 1;
                push(format!("input_blocks.{n}"), level, UnitKind::Down);
            }
        }
        let top = levels.saturating_sub(1);
        push("middle_block.0".into(), top, UnitKind::Res);
        for k in 0..self.transformer_depth_middle {
            push(
                format!("middle_block.1.transformer_blocks.{k}"),
                top,
                UnitKind::Layer,
            );
        }
        push("middle_block.2".into(), top, UnitKind::Res);
        let mut n = 0;
        for level in (0..levels).rev() {
            let depth = self.transformer_depth[level];
            for j in 0..=self.num_res_blocks {
                let up = level > 0 && j == self.num_res_blocks;
                if depth == 0 {
                    push(
                        format!("output_blocks.{n}"),
                        level,
                        UnitKind::SkipRes { up },
                    );
                } else {
                    push(
                        format!("output_blocks.{n}.0"),
                        level,
                        UnitKind::SkipRes { up: false },
                    );
                    for k in 0..depth {
                        push(
                            format!("output_blocks.{n}.1.transformer_blocks.{k}"),
                            level,
                            UnitKind::Layer,
                        );
                    }
                    if up {
                        push(format!("output_blocks.{n}.2"), level, UnitKind::Up);
                    }
                }
                n += 1;
            }
        }
        v
    }

    /// The units' key prefixes in execution order (what `BlockExec` and `BlockStreamer`
    /// name them by; see [`SdxlConfig::units`]).
    pub fn block_prefixes(&self) -> Vec<String> {
        self.units().into_iter().map(|u| u.prefix).collect()
    }

    /// Checks the sizes fit together.
    pub fn validate(&self) -> Result<()> {
        let l = self.levels();
        if l == 0 || self.transformer_depth.len() != l || self.num_heads.len() != l {
            return Err(bad(format!(
                "sdxl: block_out_channels {:?}, transformer_depth {:?} and num_heads {:?} need \
                 one entry per level",
                self.block_out_channels, self.transformer_depth, self.num_heads
            )));
        }
        if self.model_channels == 0 || self.num_res_blocks == 0 || self.num_groups == 0 {
            return Err(bad(format!(
                "sdxl: model_channels {}, num_res_blocks {} and num_groups {} must be positive",
                self.model_channels, self.num_res_blocks, self.num_groups
            )));
        }
        if self.block_out_channels[0] != self.model_channels {
            return Err(bad(format!(
                "sdxl: block_out_channels {:?} must start with model_channels {} (conv_in's \
                 output is the first level's input)",
                self.block_out_channels, self.model_channels
            )));
        }
        if self.transformer_depth_middle == 0 {
            return Err(bad(
                "sdxl: the middle block needs transformer_depth_middle >= 1".into(),
            ));
        }
        for level in 0..l {
            let c = self.channels(level);
            if c == 0 || c % self.num_groups != 0 {
                return Err(bad(format!(
                    "sdxl: level {level}'s {c} channels are not divisible into {} groups",
                    self.num_groups
                )));
            }
            let attends = self.transformer_depth[level] > 0 || level == l - 1;
            let h = self.num_heads[level];
            if attends && (h == 0 || c % h != 0) {
                return Err(bad(format!(
                    "sdxl: level {level}'s {c} channels are not divisible into {h} heads"
                )));
            }
        }
        Ok(())
    }

    /// From a diffusers `UNet2DConditionModel` config.json with SDXL's architecture. Settings
    /// this model does not implement are refused with the field named.
    pub fn from_diffusers(cfg: &Value) -> Result<Self> {
        let err = |field: &str, msg: String| bad(format!("sdxl config.json: \"{field}\" {msg}"));
        // Fields that must keep SDXL's value; absent or null means diffusers' default, which
        // is SDXL's for these.
        let fixed: [(&str, Value); 24] = [
            ("act_fn", "silu".into()),
            ("flip_sin_to_cos", true.into()),
            ("freq_shift", 0.into()),
            ("center_input_sample", false.into()),
            ("downsample_padding", 1.into()),
            ("mid_block_scale_factor", 1.into()),
            ("dropout", 0.into()),
            ("resnet_time_scale_shift", "default".into()),
            ("resnet_skip_time_act", false.into()),
            ("resnet_out_scale_factor", 1.into()),
            ("time_embedding_type", "positional".into()),
            ("conv_in_kernel", 3.into()),
            ("conv_out_kernel", 3.into()),
            ("dual_cross_attention", false.into()),
            ("only_cross_attention", false.into()),
            ("attention_type", "default".into()),
            ("class_embeddings_concat", false.into()),
            ("mid_block_type", "UNetMidBlock2DCrossAttn".into()),
            ("mid_block_only_cross_attention", false.into()),
            // diffusers refuses num_attention_heads itself (its naming issue #2011);
            // attention_head_dim holds SDXL's head counts.
            ("num_attention_heads", Value::Null),
            ("class_embed_type", Value::Null),
            ("encoder_hid_dim_type", Value::Null),
            ("time_embedding_act_fn", Value::Null),
            ("reverse_transformer_layers_per_block", Value::Null),
        ];
        for (field, want) in &fixed {
            if let Some(v) = cfg_opt(cfg, field) {
                let same = match (v.as_f64(), want.as_f64()) {
                    (Some(a), Some(b)) => a == b,
                    _ => v == want,
                };
                if !same {
                    return Err(err(field, format!("= {v} is not supported (SDXL: {want})")));
                }
            }
        }
        for field in [
            "time_embedding_dim",
            "timestep_post_act",
            "time_cond_proj_dim",
            "num_class_embeds",
            "cross_attention_norm",
            "encoder_hid_dim",
        ] {
            if let Some(v) = cfg_opt(cfg, field) {
                return Err(err(field, format!("= {v} is not supported (SDXL: null)")));
            }
        }
        if cfg_opt(cfg, "use_linear_projection").and_then(Value::as_bool) != Some(true) {
            return Err(err(
                "use_linear_projection",
                "must be true (SDXL's linear proj_in / proj_out)".into(),
            ));
        }
        let embed = cfg_opt(cfg, "addition_embed_type");
        if embed.and_then(Value::as_str) != Some("text_time") {
            return Err(err(
                "addition_embed_type",
                format!(
                    "= {} is not supported (SDXL: \"text_time\")",
                    embed.unwrap_or(&Value::Null)
                ),
            ));
        }
        if let Some(eps) = cfg_opt(cfg, "norm_eps") {
            if eps.as_f64().is_none_or(|e| (e - 1e-5).abs() > 1e-12) {
                return Err(err(
                    "norm_eps",
                    format!("= {eps} is not supported (SDXL: 1e-5)"),
                ));
            }
        }
        let num_groups = match cfg_opt(cfg, "norm_num_groups") {
            None if cfg.get("norm_num_groups").is_some() => {
                return Err(err(
                    "norm_num_groups",
                    "= null (no output norm) is not supported".into(),
                ))
            }
            None => NUM_GROUPS,
            Some(_) => cfg_usize(cfg, "norm_num_groups")?,
        };

        let block_out = cfg_usize_list(cfg, "block_out_channels")?
            .ok_or_else(|| err("block_out_channels", "is missing".into()))?;
        let l = block_out.len();
        let model_channels = *block_out
            .first()
            .ok_or_else(|| err("block_out_channels", "is empty".into()))?;
        // An int, or one per level (diffusers accepts either for these fields).
        let per_level = |field: &str, default: usize| -> Result<Vec<usize>> {
            match cfg_opt(cfg, field) {
                None => Ok(vec![default; l]),
                Some(v) if v.is_u64() => Ok(vec![cfg_usize(cfg, field)?; l]),
                Some(_) => {
                    let v = cfg_usize_list(cfg, field)?.unwrap_or_default();
                    if v.len() != l {
                        return Err(err(field, format!("needs {l} entries, one per level")));
                    }
                    Ok(v)
                }
            }
        };
        let uniform = |field: &str, default: usize| -> Result<usize> {
            let v = per_level(field, default)?;
            if v.iter().any(|x| *x != v[0]) {
                return Err(err(
                    field,
                    format!("= {v:?}: only one value for all levels is supported"),
                ));
            }
            Ok(v[0])
        };
        let num_res_blocks = uniform("layers_per_block", 2)?;
        let context_dim = uniform("cross_attention_dim", 1280)?;
        let layers = per_level("transformer_layers_per_block", 1)?;
        // diffusers' default attention_head_dim is 8; SDXL's configs always set it.
        let num_heads = per_level("attention_head_dim", 8)?;

        let down = str_list(cfg, "down_block_types")?;
        let up = str_list(cfg, "up_block_types")?;
        if down.len() != l || up.len() != l {
            return Err(err(
                "down_block_types",
                format!("and up_block_types need {l} entries, one per block_out_channels entry"),
            ));
        }
        let mut transformer_depth = vec![];
        for (i, t) in down.iter().enumerate() {
            let attends = match t.as_str() {
                "CrossAttnDownBlock2D" => true,
                "DownBlock2D" => false,
                _ => {
                    return Err(err(
                        "down_block_types",
                        format!("entry {t:?} is not supported"),
                    ))
                }
            };
            let want_up = if attends {
                "CrossAttnUpBlock2D"
            } else {
                "UpBlock2D"
            };
            if up[l - 1 - i] != want_up {
                return Err(err(
                    "up_block_types",
                    format!(
                        "entry {} is {:?}, the mirror of {t:?} needs {want_up:?}",
                        l - 1 - i,
                        up[l - 1 - i]
                    ),
                ));
            }
            if attends && layers[i] == 0 {
                return Err(err(
                    "transformer_layers_per_block",
                    format!("is 0 at cross-attention level {i}"),
                ));
            }
            transformer_depth.push(if attends { layers[i] } else { 0 });
        }
        let in_channels =
            cfg_opt(cfg, "in_channels").map_or(Ok(4), |_| cfg_usize(cfg, "in_channels"))?;
        let c = SdxlConfig {
            in_channels,
            out_channels: cfg_opt(cfg, "out_channels")
                .map_or(Ok(4), |_| cfg_usize(cfg, "out_channels"))?,
            model_channels,
            block_out_channels: block_out.clone(),
            num_res_blocks,
            transformer_depth,
            num_heads,
            // diffusers' mid block takes `transformer_layers_per_block[-1]`.
            transformer_depth_middle: layers[l - 1],
            context_dim,
            adm_in_channels: cfg_usize(cfg, "projection_class_embeddings_input_dim")?,
            addition_time_embed_dim: cfg_usize(cfg, "addition_time_embed_dim")?,
            num_groups,
        };
        c.validate()?;
        Ok(c)
    }

    /// From a single file's tensor shapes, with Stability's 64 channels per head and 32
    /// norm groups (which shapes cannot show) and the 256-wide micro-conditioning embedding.
    pub fn from_single_file(vb: &VarBuilder) -> Result<Self> {
        Self::from_single_file_with(vb, HEAD_CHANNELS, NUM_GROUPS)
    }

    /// From a single file's tensor shapes: channels from the convolutions, levels and
    /// ResBlocks from the downsamplers' positions, transformer depths and the text width from
    /// the keys present; heads are channels / `head_channels`. `addition_time_embed_dim` is
    /// SDXL's 256 (the shapes give only the total width of `y`).
    pub fn from_single_file_with(
        vb: &VarBuilder,
        head_channels: usize,
        num_groups: usize,
    ) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: name.to_string(),
                file: None,
                msg: "missing: is this an SDXL UNet checkpoint?".into(),
            })
        };
        let conv_in = shape("input_blocks.0.0.weight")?;
        let conv_out = shape("out.2.weight")?;
        let label = shape("label_emb.0.0.weight")?;
        let model_channels = conv_in[0];
        // input_blocks 1.. are ResBlocks (`.0.in_layers`) and downsamplers (`.0.op`).
        let mut ops = vec![];
        let mut n = 0;
        for i in 1.. {
            if vb.contains(&format!("input_blocks.{i}.0.op.weight")) {
                ops.push(i);
            } else if !vb.contains(&format!("input_blocks.{i}.0.in_layers.0.weight")) {
                break;
            }
            n = i;
        }
        let num_res_blocks = ops.first().map_or(n, |first| first - 1);
        let levels = ops.len() + 1;
        let expected: Vec<usize> = (1..levels).map(|l| l * (num_res_blocks + 1)).collect();
        if num_res_blocks == 0 || ops != expected || n != levels * (num_res_blocks + 1) - 1 {
            return Err(bad(format!(
                "sdxl single file: input_blocks 1..={n} with downsamplers at {ops:?} are not \
                 levels of equally many ResBlocks"
            )));
        }
        let depth = |block: &str| {
            (0..)
                .take_while(|j| {
                    vb.contains(&format!(
                        "{block}.1.transformer_blocks.{j}.attn1.to_q.weight"
                    ))
                })
                .count()
        };
        let mut block_out_channels = vec![];
        let mut transformer_depth = vec![];
        let mut num_heads = vec![];
        for level in 0..levels {
            let block = format!("input_blocks.{}", 1 + level * (num_res_blocks + 1));
            let c = shape(&format!("{block}.0.out_layers.3.weight"))?[0];
            if c % head_channels != 0 {
                return Err(bad(format!(
                    "sdxl single file: level {level}'s {c} channels do not split into heads of \
                     {head_channels} channels; pass an SdxlConfig"
                )));
            }
            if vb
                .shape_of(&format!("{block}.1.proj_in.weight"))
                .is_some_and(|s| s.len() != 2)
            {
                return Err(bad(format!(
                    "sdxl single file: {block}.1.proj_in is a convolution (SD 1.x/2.x); only \
                     linear projections (SDXL) are supported"
                )));
            }
            block_out_channels.push(c);
            transformer_depth.push(depth(&block));
            num_heads.push(c / head_channels);
        }
        let c = SdxlConfig {
            in_channels: conv_in[1],
            out_channels: conv_out[0],
            model_channels,
            block_out_channels,
            num_res_blocks,
            transformer_depth,
            num_heads,
            transformer_depth_middle: depth("middle_block"),
            context_dim: shape("middle_block.1.transformer_blocks.0.attn2.to_k.weight")?[1],
            adm_in_channels: label[1],
            addition_time_embed_dim: ADDITION_TIME_EMBED_DIM,
            num_groups,
        };
        c.validate()?;
        Ok(c)
    }
}

fn str_list(cfg: &Value, field: &str) -> Result<Vec<String>> {
    cfg_opt(cfg, field)
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_str().map(String::from))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            bad(format!(
                "sdxl config.json: \"{field}\" is missing or not a list of strings"
            ))
        })
}
