//! BFL Flux keys -> diffusers `FluxTransformer2DModel` keys (the inverse of diffusers'
//! `convert_flux_transformer_checkpoint_to_diffusers`). Fused projections are concatenations
//! of diffusers' separate ones: `qkv` = to_q | to_k | to_v, a single block's `linear1` =
//! to_q | to_k | to_v | proj_mlp; the final adaLN stores (scale, shift) in diffusers.

use super::FluxConfig;
use crate::nn::{KeyMap, KeySource};
use std::sync::Arc;

/// The map for a model of `cfg`'s shape (the sizes say how fused projections split).
pub fn diffusers_map(cfg: &FluxConfig) -> KeyMap {
    let (h, m) = (cfg.hidden_size, cfg.mlp_hidden());
    Arc::new(move |key: &str| map_key(key, h, m))
}

fn key(k: String) -> Option<KeySource> {
    Some(KeySource::Key(k))
}

fn cat(parts: &[(&str, usize)], prefix: &str, leaf: &str) -> Option<KeySource> {
    Some(KeySource::Cat(
        parts
            .iter()
            .map(|(p, rows)| (format!("{prefix}{p}.{leaf}"), *rows))
            .collect(),
    ))
}

/// One BFL key's diffusers source, for hidden size `h` and MLP width `m`.
pub fn map_key(k: &str, h: usize, m: usize) -> Option<KeySource> {
    let (path, leaf) = k.rsplit_once('.')?;
    let embedder = |name: &str, rest: &str| -> Option<KeySource> {
        let lin = match rest {
            "in_layer" => "linear_1",
            "out_layer" => "linear_2",
            _ => return None,
        };
        key(format!("time_text_embed.{name}.{lin}.{leaf}"))
    };
    let parts: Vec<&str> = path.split('.').collect();
    match parts.as_slice() {
        ["img_in"] => key(format!("x_embedder.{leaf}")),
        ["txt_in"] => key(format!("context_embedder.{leaf}")),
        ["time_in", rest] => embedder("timestep_embedder", rest),
        ["vector_in", rest] => embedder("text_embedder", rest),
        ["guidance_in", rest] => embedder("guidance_embedder", rest),
        ["final_layer", "linear"] => key(format!("proj_out.{leaf}")),
        ["final_layer", "adaLN_modulation", "1"] => {
            Some(KeySource::SwapHalves(format!("norm_out.linear.{leaf}")))
        }
        ["double_blocks", i, rest @ ..] => {
            let p = format!("transformer_blocks.{i}.");
            let (stream, rest) = rest.split_first()?;
            let img = match *stream {
                "img_mod" | "img_attn" | "img_mlp" => true,
                "txt_mod" | "txt_attn" | "txt_mlp" => false,
                _ => return None,
            };
            let kind = &stream[4..];
            match (kind, rest) {
                ("mod", ["lin"]) => {
                    let n = if img { "norm1" } else { "norm1_context" };
                    key(format!("{p}{n}.linear.{leaf}"))
                }
                ("attn", ["qkv"]) if img => cat(
                    &[("to_q", h), ("to_k", h), ("to_v", h)],
                    &format!("{p}attn."),
                    leaf,
                ),
                ("attn", ["qkv"]) => cat(
                    &[("add_q_proj", h), ("add_k_proj", h), ("add_v_proj", h)],
                    &format!("{p}attn."),
                    leaf,
                ),
                ("attn", ["proj"]) => {
                    let n = if img { "to_out.0" } else { "to_add_out" };
                    key(format!("{p}attn.{n}.{leaf}"))
                }
                ("attn", ["norm", which]) if leaf == "scale" => {
                    let n = match (img, *which) {
                        (true, "query_norm") => "norm_q",
                        (true, "key_norm") => "norm_k",
                        (false, "query_norm") => "norm_added_q",
                        (false, "key_norm") => "norm_added_k",
                        _ => return None,
                    };
                    key(format!("{p}attn.{n}.weight"))
                }
                ("mlp", [idx]) => {
                    let ff = if img { "ff" } else { "ff_context" };
                    let n = match *idx {
                        "0" => "net.0.proj",
                        "2" => "net.2",
                        _ => return None,
                    };
                    key(format!("{p}{ff}.{n}.{leaf}"))
                }
                _ => None,
            }
        }
        ["single_blocks", i, rest @ ..] => {
            let p = format!("single_transformer_blocks.{i}.");
            match rest {
                ["modulation", "lin"] => key(format!("{p}norm.linear.{leaf}")),
                ["linear1"] => cat(
                    &[
                        ("attn.to_q", h),
                        ("attn.to_k", h),
                        ("attn.to_v", h),
                        ("proj_mlp", m),
                    ],
                    &p,
                    leaf,
                ),
                ["linear2"] => key(format!("{p}proj_out.{leaf}")),
                ["norm", "query_norm"] if leaf == "scale" => key(format!("{p}attn.norm_q.weight")),
                ["norm", "key_norm"] if leaf == "scale" => key(format!("{p}attn.norm_k.weight")),
                _ => None,
            }
        }
        _ => None,
    }
}
