//! LDM UNet keys -> diffusers `UNet2DConditionModel` keys: the inverse of diffusers'
//! `convert_ldm_unet_checkpoint` (`loaders/single_file_utils.py`). Every tensor is stored
//! as is; only names differ. Input block i >= 1 is ResBlock / downsampler j = (i - 1) %
//! (res blocks + 1) of down block (i - 1) / (res blocks + 1); output block i is ResBlock j =
//! i % (res blocks + 1) of up block i / (res blocks + 1), up blocks counting from the
//! deepest level. Inside a SpatialTransformer the names are the same in both layouts.

use super::SdxlConfig;
use crate::nn::{KeyMap, KeySource};
use std::sync::Arc;

/// The map for a model of `cfg`'s shape: where upsamplers sit (`.1` or `.2`) and which
/// blocks have attention depend on it.
pub fn diffusers_map(cfg: &SdxlConfig) -> KeyMap {
    let cfg = cfg.clone();
    Arc::new(move |key: &str| map_key(&cfg, key).map(KeySource::Key))
}

/// ResBlock internals (diffusers `update_unet_resnet_ldm_to_diffusers`).
fn resnet(rest: &[&str]) -> Option<String> {
    let (name, leaf) = match rest {
        ["in_layers", "0", leaf] => ("norm1", leaf),
        ["in_layers", "2", leaf] => ("conv1", leaf),
        ["emb_layers", "1", leaf] => ("time_emb_proj", leaf),
        ["out_layers", "0", leaf] => ("norm2", leaf),
        ["out_layers", "3", leaf] => ("conv2", leaf),
        ["skip_connection", leaf] => ("conv_shortcut", leaf),
        _ => return None,
    };
    Some(format!("{name}.{leaf}"))
}

/// SpatialTransformer internals: the same names.
fn transformer(rest: &[&str]) -> Option<String> {
    match rest.first() {
        Some(&("norm" | "proj_in" | "proj_out" | "transformer_blocks")) => Some(rest.join(".")),
        _ => None,
    }
}

/// A two-layer embedding MLP: `0` -> `linear_1`, `2` -> `linear_2`.
fn mlp(name: &str, rest: &[&str]) -> Option<String> {
    match rest {
        ["0", leaf] => Some(format!("{name}.linear_1.{leaf}")),
        ["2", leaf] => Some(format!("{name}.linear_2.{leaf}")),
        _ => None,
    }
}

/// One LDM key's diffusers key, `None` for keys the model of `cfg` does not have.
pub fn map_key(cfg: &SdxlConfig, key: &str) -> Option<String> {
    let parts: Vec<&str> = key.split('.').collect();
    let per = cfg.num_res_blocks + 1;
    let levels = cfg.levels();
    let num = |s: &str| s.parse::<usize>().ok();
    match parts.as_slice() {
        ["time_embed", rest @ ..] => mlp("time_embedding", rest),
        ["label_emb", "0", rest @ ..] => mlp("add_embedding", rest),
        ["input_blocks", "0", "0", leaf] => Some(format!("conv_in.{leaf}")),
        ["out", "0", leaf] => Some(format!("conv_norm_out.{leaf}")),
        ["out", "2", leaf] => Some(format!("conv_out.{leaf}")),
        ["input_blocks", i, sub, rest @ ..] => {
            let i = num(i)?.checked_sub(1)?;
            let (level, j) = (i / per, i % per);
            if level >= levels {
                return None;
            }
            let p = format!("down_blocks.{level}");
            match (*sub, rest) {
                ("0", ["op", leaf]) if j == cfg.num_res_blocks && level + 1 < levels => {
                    Some(format!("{p}.downsamplers.0.conv.{leaf}"))
                }
                ("0", _) if j < cfg.num_res_blocks => {
                    Some(format!("{p}.resnets.{j}.{}", resnet(rest)?))
                }
                ("1", _) if j < cfg.num_res_blocks && cfg.transformer_depth[level] > 0 => {
                    Some(format!("{p}.attentions.{j}.{}", transformer(rest)?))
                }
                _ => None,
            }
        }
        ["middle_block", sub, rest @ ..] => match *sub {
            "0" => Some(format!("mid_block.resnets.0.{}", resnet(rest)?)),
            "1" => Some(format!("mid_block.attentions.0.{}", transformer(rest)?)),
            "2" => Some(format!("mid_block.resnets.1.{}", resnet(rest)?)),
            _ => None,
        },
        ["output_blocks", i, sub, rest @ ..] => {
            let i = num(i)?;
            let (b, j) = (i / per, i % per);
            let level = levels.checked_sub(b + 1)?;
            let p = format!("up_blocks.{b}");
            let attends = cfg.transformer_depth[level] > 0;
            let up_at = if attends { "2" } else { "1" };
            match (*sub, rest) {
                ("0", _) => Some(format!("{p}.resnets.{j}.{}", resnet(rest)?)),
                (s, ["conv", leaf]) if s == up_at && j == cfg.num_res_blocks && level > 0 => {
                    Some(format!("{p}.upsamplers.0.conv.{leaf}"))
                }
                ("1", _) if attends => Some(format!("{p}.attentions.{j}.{}", transformer(rest)?)),
                _ => None,
            }
        }
        _ => None,
    }
}
