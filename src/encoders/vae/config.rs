//! The autoencoder's sizes, its latent scaling per model family, and the key map from the
//! original LDM / BFL layout to diffusers' names (the model's key paths).

use crate::nn::{KeyMap, KeySource, VarBuilder};
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// How latents are normalized for the diffusion model: `latents = (z - shift) * scale` after
/// encoding, `z = latents / scale + shift` before decoding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentScaling {
    /// diffusers' `scaling_factor`.
    pub scale: f64,
    /// diffusers' `shift_factor` (0 where the config has none).
    pub shift: f64,
}

/// The model family an autoencoder belongs to, which fixes its latent scaling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VaeKind {
    /// SDXL: 4 latent channels with quant convs; scale 0.13025, no shift
    /// (`stabilityai/stable-diffusion-xl-base-1.0` vae/config.json: `"scaling_factor":
    /// 0.13025`, no `shift_factor`).
    Sdxl,
    /// SD3 / SD3.5: 16 latent channels, no quant convs; scale 1.5305, shift 0.0609
    /// (`stabilityai/stable-diffusion-3.5-large` vae/config.json: `"scaling_factor": 1.5305,
    /// "shift_factor": 0.0609`).
    Sd3,
    /// Flux: 16 latent channels, no quant convs; scale 0.3611, shift 0.1159
    /// (`black-forest-labs/FLUX.1-dev` vae/config.json, and BFL's `flux/util.py`
    /// `AutoEncoderParams(scale_factor=0.3611, shift_factor=0.1159)`).
    Flux,
    /// FLUX.2 (dev and \[klein\]): 32 latent channels with quant convs, patched 2x2 into 128
    /// channels normalized by the autoencoder's own batch-norm statistics ([`PatchNorm`];
    /// diffusers `AutoencoderKLFlux2`), no scale or shift.
    Flux2,
}

impl VaeKind {
    /// The family's latent scaling.
    pub fn scaling(self) -> LatentScaling {
        let (scale, shift) = match self {
            VaeKind::Sdxl => (0.13025, 0.0),
            VaeKind::Sd3 => (1.5305, 0.0609),
            VaeKind::Flux => (0.3611, 0.1159),
            VaeKind::Flux2 => (1.0, 0.0),
        };
        LatentScaling { scale, shift }
    }

    /// The family's normalization of patched latents, if it has one.
    pub fn patch_norm(self) -> Option<PatchNorm> {
        match self {
            VaeKind::Flux2 => Some(PatchNorm::FLUX2),
            _ => None,
        }
    }
}

/// Latents patched and normalized per channel (FLUX.2): the encoder's latents (B, C, h, w)
/// become (B, C * patch², h / patch, w / patch), channel `c * patch² + dy * patch + dx`
/// holding pixel (dy, dx) of each patch (diffusers `Flux2Pipeline._patchify_latents`), then
/// `(x - mean) / sqrt(var + eps)` with the running statistics of the autoencoder's
/// non-affine batch norm over the patched channels (its `bn.running_mean` and
/// `bn.running_var`; `Flux2Pipeline._encode_vae_image`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PatchNorm {
    /// The patch side (2).
    pub patch: usize,
    /// diffusers' `batch_norm_eps`.
    pub eps: f64,
}

impl PatchNorm {
    /// FLUX.2's: 2x2 patches, eps 1e-4 (diffusers `AutoencoderKLFlux2.__init__` defaults
    /// `patch_size=(2, 2)`, `batch_norm_eps=1e-4`).
    pub const FLUX2: PatchNorm = PatchNorm {
        patch: 2,
        eps: 1e-4,
    };
}

/// How the checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VaeLayout {
    /// diffusers' `AutoencoderKL` (a pipeline's `vae/` folder):
    /// `encoder.down_blocks.N.resnets.M.conv1`, `encoder.mid_block.attentions.0.to_q`.
    Diffusers,
    /// The original LDM / sgm / BFL names (BFL's `ae.safetensors`; SDXL's and SD3.5's single
    /// files under `first_stage_model.`): `encoder.down.N.block.M.conv1`,
    /// `encoder.mid.attn_1.q` (a 1x1 conv), and the decoder's `up.N` stored in reverse order
    /// of diffusers' `up_blocks`.
    Ldm,
}

/// The autoencoder's sizes (diffusers `AutoencoderKL` config fields) and latent scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    /// Image channels in (3).
    pub in_channels: usize,
    /// Image channels out (3).
    pub out_channels: usize,
    /// Width of each resolution level, from the image side: (128, 256, 512, 512) in every
    /// released SDXL / SD3 / Flux VAE. The image shrinks 2x between levels.
    pub block_out_channels: Vec<usize>,
    /// ResNet blocks per encoder level (the decoder has one more per level).
    pub layers_per_block: usize,
    /// Latent channels (4 SDXL, 16 SD3 / Flux).
    pub latent_channels: usize,
    /// GroupNorm groups of every norm (32).
    pub norm_num_groups: usize,
    /// A 1x1 conv on the encoder's moments (SDXL yes, SD3 / Flux no).
    pub use_quant_conv: bool,
    /// A 1x1 conv on the latents before the decoder (SDXL yes, SD3 / Flux no).
    pub use_post_quant_conv: bool,
    /// Whether the mid blocks have their self-attention (true in every released VAE).
    pub mid_block_add_attention: bool,
    /// The latent scaling of the family.
    pub scaling: LatentScaling,
    /// FLUX.2's patching and normalization of latents (diffusers `AutoencoderKLFlux2`;
    /// its statistics are weights of the checkpoint), `None` for the others.
    pub patch_norm: Option<PatchNorm>,
}

impl VaeConfig {
    /// The full-size autoencoder of a family, as its pipeline's vae/config.json gives it.
    /// FLUX.2's: 32 latent channels with quant convs (diffusers `AutoencoderKLFlux2.__init__`
    /// defaults `latent_channels=32`, `use_quant_conv=True`, `use_post_quant_conv=True`).
    pub fn for_kind(kind: VaeKind) -> Self {
        let quant = matches!(kind, VaeKind::Sdxl | VaeKind::Flux2);
        VaeConfig {
            in_channels: 3,
            out_channels: 3,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            latent_channels: match kind {
                VaeKind::Sdxl => 4,
                VaeKind::Sd3 | VaeKind::Flux => 16,
                VaeKind::Flux2 => 32,
            },
            norm_num_groups: 32,
            use_quant_conv: quant,
            use_post_quant_conv: quant,
            mid_block_add_attention: true,
            scaling: kind.scaling(),
            patch_norm: kind.patch_norm(),
        }
    }

    /// Channels of the latents the diffusion model sees: the encoder's, times patch² where
    /// they are patched.
    pub fn diffusion_channels(&self) -> usize {
        self.latent_channels * self.patch_norm.map_or(1, |p| p.patch * p.patch)
    }

    /// The image is this many times the diffusion latents' height and width.
    pub fn diffusion_downscale(&self) -> usize {
        self.downscale() * self.patch_norm.map_or(1, |p| p.patch)
    }

    /// The image is this many times the latent's height and width: 2^(levels - 1).
    pub fn downscale(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// From a diffusers `vae/config.json` (`AutoencoderKL`, or `AutoencoderKLFlux2` by its
    /// `_class_name`: patched latents, no scaling); absent fields take the class's defaults
    /// (`AutoencoderKL`: `scaling_factor` 0.18215, no shift). Block types other than
    /// `DownEncoderBlock2D` / `UpDecoderBlock2D`, activations other than SiLU, and per-channel
    /// `latents_mean` / `latents_std` normalization are refused.
    pub fn from_json(v: &Value, path: Option<&Path>) -> Result<Self> {
        let fields = crate::encoders::JsonFields::new(v, path);
        let err = |msg: String| fields.err(msg);
        let int = |name: &str, default: usize| fields.int(name, Some(default));
        let flag = |name: &str| v.get(name).and_then(Value::as_bool).unwrap_or(true);
        let float = |name: &str, default: f64| match v.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| err(format!("\"{name}\" = {x} is not a number"))),
        };
        let block_out_channels = match v.get("block_out_channels") {
            None | Some(Value::Null) => vec![64],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err("\"block_out_channels\" holds a non-integer".into()))?,
            Some(x) => return Err(err(format!("\"block_out_channels\" = {x} is not a list"))),
        };
        for (field, want) in [
            ("down_block_types", "DownEncoderBlock2D"),
            ("up_block_types", "UpDecoderBlock2D"),
        ] {
            if let Some(Value::Array(a)) = v.get(field) {
                if a.len() != block_out_channels.len() || a.iter().any(|t| t != want) {
                    return Err(err(format!(
                        "\"{field}\" must be {} x \"{want}\", got {}",
                        block_out_channels.len(),
                        Value::Array(a.clone())
                    )));
                }
            }
        }
        // AutoencoderKLFlux2 may give the decoder other widths; none of the released
        // autoencoders does, and this model builds both sides from one list.
        if let Some(d) = v.get("decoder_block_out_channels").filter(|d| !d.is_null()) {
            let same = d.as_array().is_some_and(|a| {
                a.len() == block_out_channels.len()
                    && a.iter()
                        .zip(&block_out_channels)
                        .all(|(x, &c)| x.as_u64() == Some(c as u64))
            });
            if !same {
                return Err(err(format!(
                    "\"decoder_block_out_channels\" = {d} differs from the encoder's: not supported"
                )));
            }
        }
        match v.get("act_fn").and_then(Value::as_str) {
            None | Some("silu") | Some("swish") => {}
            Some(other) => return Err(err(format!("act_fn \"{other}\" is not silu"))),
        }
        for field in ["latents_mean", "latents_std"] {
            if v.get(field).is_some_and(|x| !x.is_null()) {
                return Err(err(format!(
                    "\"{field}\": per-channel latent normalization is not supported"
                )));
            }
        }
        let flux2 = v.get("_class_name").and_then(Value::as_str) == Some("AutoencoderKLFlux2");
        let patch_norm = if flux2 {
            let patch = match v.get("patch_size") {
                None | Some(Value::Null) => PatchNorm::FLUX2.patch,
                Some(Value::Array(a))
                    if a.len() == 2 && a[0] == a[1] && a[0].as_u64().is_some_and(|p| p > 0) =>
                {
                    a[0].as_u64().unwrap_or(2) as usize
                }
                Some(x) => {
                    return Err(err(format!(
                        "\"patch_size\" = {x} is not a square patch [p, p]"
                    )))
                }
            };
            Some(PatchNorm {
                patch,
                eps: float("batch_norm_eps", PatchNorm::FLUX2.eps)?,
            })
        } else {
            None
        };
        // AutoencoderKLFlux2's defaults (its `__init__`): 2 ResNets a level, 32 latent
        // channels; its latents are normalized by the batch norm, not scaled.
        let (layers, latent) = if flux2 { (2, 32) } else { (1, 4) };
        let scaling = match flux2 {
            true => VaeKind::Flux2.scaling(),
            false => LatentScaling {
                scale: float("scaling_factor", 0.18215)?,
                shift: float("shift_factor", 0.0)?,
            },
        };
        let cfg = VaeConfig {
            in_channels: int("in_channels", 3)?,
            out_channels: int("out_channels", 3)?,
            layers_per_block: int("layers_per_block", layers)?,
            latent_channels: int("latent_channels", latent)?,
            norm_num_groups: int("norm_num_groups", 32)?,
            use_quant_conv: flag("use_quant_conv"),
            use_post_quant_conv: flag("use_post_quant_conv"),
            mid_block_add_attention: flag("mid_block_add_attention"),
            scaling,
            patch_norm,
            block_out_channels,
        };
        cfg.validate().map_err(err)?;
        Ok(cfg)
    }

    /// Inferred from the shapes of a checkpoint read through [`vae_key_map`] (`vb` at the
    /// model's root): channels and depth from the convs present, quant convs and attention by
    /// their presence. Not in the keys, so assumed: 32 norm groups (every released VAE; an
    /// error when a width is not a multiple of 32). The scaling comes from `kind`; without
    /// it, 4 latent channels with quant convs are taken as SDXL (SD 1.x VAEs share the shapes
    /// but scale by 0.18215: give a config for them), and 16 latent channels without quant
    /// convs are an error, as Flux and SD3 cannot be told apart by shape.
    pub fn from_shapes(vb: &VarBuilder, kind: Option<VaeKind>) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name)
                .filter(|s| s.len() == 4)
                .ok_or_else(|| Error::Param {
                    key: vb.key(name),
                    file: None,
                    msg: "missing or not a conv weight: cannot infer the VAE config".into(),
                })
        };
        let conv_in = shape("encoder.conv_in.weight")?;
        let down = vb.pp("encoder").pp("down_blocks");
        let levels = (0..)
            .take_while(|i| down.pp(i).pp("resnets.0.conv1").contains("weight"))
            .count();
        let block_out_channels = (0..levels)
            .map(|i| {
                shape(&format!("encoder.down_blocks.{i}.resnets.0.conv1.weight")).map(|s| s[0])
            })
            .collect::<Result<Vec<_>>>()?;
        let layers_per_block = (0..)
            .take_while(|m| down.pp(0).pp("resnets").pp(m).contains("conv1.weight"))
            .count();
        let latent_channels = shape("decoder.conv_in.weight")?[1];
        let use_quant_conv = vb.pp("quant_conv").contains("weight");
        // FLUX.2's batch-norm statistics over the patched channels: patch² = their count
        // over the latent channels.
        let patch_norm = match vb.shape_of("bn.running_mean") {
            None => None,
            Some(s) => {
                let n = s.iter().product::<usize>();
                let p = (1..=8)
                    .find(|p| p * p * latent_channels == n)
                    .ok_or_else(|| Error::Param {
                        key: vb.key("bn.running_mean"),
                        file: None,
                        msg: format!(
                            "{n} statistics are no square patch of {latent_channels} latent \
                             channels"
                        ),
                    })?;
                Some(PatchNorm {
                    patch: p,
                    eps: kind
                        .and_then(VaeKind::patch_norm)
                        .map_or(PatchNorm::FLUX2.eps, |k| k.eps),
                })
            }
        };
        let groups = 32;
        if block_out_channels.iter().any(|c| c % groups != 0) {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "VAE widths {block_out_channels:?} are not multiples of 32: the norm groups \
                     cannot be inferred, give a config"
                ),
            });
        }
        let scaling = match (kind, latent_channels, use_quant_conv) {
            (Some(k), _, _) => k.scaling(),
            _ if patch_norm.is_some() => VaeKind::Flux2.scaling(),
            (None, 4, true) => VaeKind::Sdxl.scaling(),
            (None, 16, false) => {
                return Err(Error::Config {
                    path: None,
                    msg: "16 latent channels without quant_conv: Flux (scale 0.3611, shift \
                          0.1159) and SD3.5 (scale 1.5305, shift 0.0609) have the same shapes; \
                          say which with a VaeKind"
                        .into(),
                })
            }
            (None, c, q) => {
                return Err(Error::Config {
                    path: None,
                    msg: format!(
                        "{c} latent channels ({} quant_conv) match no known family; give a \
                         VaeKind or a config",
                        if q { "with" } else { "without" }
                    ),
                })
            }
        };
        let cfg = VaeConfig {
            in_channels: conv_in[1],
            out_channels: shape("decoder.conv_out.weight")?[0],
            layers_per_block,
            latent_channels,
            norm_num_groups: groups,
            use_quant_conv,
            use_post_quant_conv: vb.pp("post_quant_conv").contains("weight"),
            mid_block_add_attention: vb
                .pp("encoder.mid_block.attentions.0.to_q")
                .contains("weight"),
            scaling,
            patch_norm,
            block_out_channels,
        };
        cfg.validate()
            .map_err(|msg| Error::Config { path: None, msg })?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let g = self.norm_num_groups;
        let bad_width = self
            .block_out_channels
            .iter()
            .any(|&c| g == 0 || c % g != 0);
        if self.block_out_channels.is_empty() || bad_width || self.layers_per_block == 0 {
            return Err(format!(
                "VAE: widths {:?} must be non-empty and split into {g} groups, with at least \
                 one ResNet per level (have {})",
                self.block_out_channels, self.layers_per_block
            ));
        }
        if self.in_channels == 0 || self.out_channels == 0 || self.latent_channels == 0 {
            return Err("VAE: image and latent channels must be positive".into());
        }
        if let Some(p) = self.patch_norm {
            if p.patch == 0 || !(p.eps.is_finite() && p.eps >= 0.0) {
                return Err(format!(
                    "VAE: patch {} and batch_norm_eps {} must be positive",
                    p.patch, p.eps
                ));
            }
        }
        if !(self.scaling.scale.is_finite() && self.scaling.scale > 0.0) {
            return Err(format!(
                "VAE: scaling_factor {} must be positive",
                self.scaling.scale
            ));
        }
        Ok(())
    }
}

/// The key map of an autoencoder whose tensors sit under `prefix` in `layout`: model key
/// (diffusers' names) -> source key. `levels` is the number of resolution levels (the LDM
/// decoder's `up.N` counts from the latent side backwards: diffusers `up_blocks.i` is
/// `up.{levels - 1 - i}`). The renaming is the inverse of diffusers'
/// `convert_ldm_vae_checkpoint`.
pub fn vae_key_map(layout: VaeLayout, prefix: &str, levels: usize) -> KeyMap {
    let prefix = prefix.to_string();
    Arc::new(move |key: &str| {
        let k = match layout {
            VaeLayout::Diffusers => key.to_string(),
            VaeLayout::Ldm => ldm_key(key, levels)?,
        };
        Some(KeySource::Key(format!("{prefix}{k}")))
    })
}

/// A diffusers model key in LDM names, `None` for keys the LDM layout lacks.
fn ldm_key(key: &str, levels: usize) -> Option<String> {
    let (side, rest) = key.split_once('.')?;
    match side {
        "quant_conv" | "post_quant_conv" | "bn" => return Some(key.to_string()),
        "encoder" | "decoder" => {}
        _ => return None,
    }
    let rest = if let Some(t) = rest.strip_prefix("conv_norm_out.") {
        format!("norm_out.{t}")
    } else if let Some(t) = rest.strip_prefix("down_blocks.") {
        let (i, t) = t.split_once('.')?;
        if let Some(t) = t.strip_prefix("resnets.") {
            format!("down.{i}.block.{t}")
        } else {
            format!("down.{i}.downsample.{}", t.strip_prefix("downsamplers.0.")?)
        }
    } else if let Some(t) = rest.strip_prefix("up_blocks.") {
        let (i, t) = t.split_once('.')?;
        let j = levels.checked_sub(i.parse::<usize>().ok()? + 1)?;
        if let Some(t) = t.strip_prefix("resnets.") {
            format!("up.{j}.block.{t}")
        } else {
            format!("up.{j}.upsample.{}", t.strip_prefix("upsamplers.0.")?)
        }
    } else if let Some(t) = rest.strip_prefix("mid_block.resnets.") {
        let (m, t) = t.split_once('.')?;
        format!("mid.block_{}.{t}", m.parse::<usize>().ok()? + 1)
    } else if let Some(t) = rest.strip_prefix("mid_block.attentions.0.") {
        let (module, leaf) = t.rsplit_once('.')?;
        let m = match module {
            "group_norm" => "norm",
            "to_q" => "q",
            "to_k" => "k",
            "to_v" => "v",
            "to_out.0" => "proj_out",
            _ => return None,
        };
        format!("mid.attn_1.{m}.{leaf}")
    } else {
        rest.to_string()
    };
    Some(format!(
        "{side}.{}",
        rest.replace("conv_shortcut", "nin_shortcut")
    ))
}
