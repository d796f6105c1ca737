//! Stability SD3 keys -> diffusers `SD3Transformer2DModel` keys (the inverse of diffusers'
//! `convert_sd3_transformer_checkpoint_to_diffusers`). Fused qkv projections are
//! concatenations of to_q | to_k | to_v; the final adaLN and the last block's pre-only
//! context adaLN store (scale, shift) in diffusers where the original has (shift, scale).

use super::Sd3Config;
use crate::nn::{KeyMap, KeySource};
use std::sync::Arc;

/// The map for a model of `cfg`'s depth (the last block's context adaLN is swapped).
pub fn diffusers_map(cfg: &Sd3Config) -> KeyMap {
    let (last, h) = (cfg.depth.saturating_sub(1), cfg.hidden_size);
    Arc::new(move |key: &str| map_key(key, last, h))
}

fn key(k: String) -> Option<KeySource> {
    Some(KeySource::Key(k))
}

/// One SD3 key's diffusers source; `last` is the index of the pre-only block, `h` the
/// hidden size (each of q, k, v).
pub fn map_key(k: &str, last: usize, h: usize) -> Option<KeySource> {
    if k == "pos_embed" {
        return key("pos_embed.pos_embed".into());
    }
    let (path, leaf) = k.rsplit_once('.')?;
    let parts: Vec<&str> = path.split('.').collect();
    let mlp = |which: &str, idx: &str| -> Option<KeySource> {
        let lin = match idx {
            "0" => "linear_1",
            "2" => "linear_2",
            _ => return None,
        };
        key(format!("time_text_embed.{which}.{lin}.{leaf}"))
    };
    match parts.as_slice() {
        ["x_embedder", "proj"] => key(format!("pos_embed.proj.{leaf}")),
        ["t_embedder", "mlp", i] => mlp("timestep_embedder", i),
        ["y_embedder", "mlp", i] => mlp("text_embedder", i),
        ["context_embedder"] => key(format!("context_embedder.{leaf}")),
        ["final_layer", "linear"] => key(format!("proj_out.{leaf}")),
        ["final_layer", "adaLN_modulation", "1"] => {
            Some(KeySource::SwapHalves(format!("norm_out.linear.{leaf}")))
        }
        ["joint_blocks", i, stream, rest @ ..] => {
            let n: usize = i.parse().ok()?;
            let p = format!("transformer_blocks.{n}.");
            let x = match *stream {
                "x_block" => true,
                "context_block" => false,
                _ => return None,
            };
            let qkv = |attn: &str, names: [&str; 3]| {
                Some(KeySource::Cat(
                    names
                        .iter()
                        .map(|q| (format!("{p}{attn}.{q}.{leaf}"), h))
                        .collect(),
                ))
            };
            match rest {
                ["adaLN_modulation", "1"] => {
                    let name = if x { "norm1" } else { "norm1_context" };
                    let src = format!("{p}{name}.linear.{leaf}");
                    if !x && n == last {
                        Some(KeySource::SwapHalves(src))
                    } else {
                        key(src)
                    }
                }
                ["attn", "qkv"] if x => qkv("attn", ["to_q", "to_k", "to_v"]),
                ["attn", "qkv"] => qkv("attn", ["add_q_proj", "add_k_proj", "add_v_proj"]),
                ["attn2", "qkv"] if x => qkv("attn2", ["to_q", "to_k", "to_v"]),
                ["attn", "proj"] => {
                    let name = if x { "to_out.0" } else { "to_add_out" };
                    key(format!("{p}attn.{name}.{leaf}"))
                }
                ["attn2", "proj"] if x => key(format!("{p}attn2.to_out.0.{leaf}")),
                [attn @ ("attn" | "attn2"), ln @ ("ln_q" | "ln_k")] => {
                    let name = match (x, *ln) {
                        (true, "ln_q") => "norm_q",
                        (true, _) => "norm_k",
                        (false, "ln_q") => "norm_added_q",
                        (false, _) => "norm_added_k",
                    };
                    if !x && *attn == "attn2" {
                        return None;
                    }
                    let a = if x { *attn } else { "attn" };
                    key(format!("{p}{a}.{name}.{leaf}"))
                }
                ["mlp", fc] => {
                    let ff = if x { "ff" } else { "ff_context" };
                    let name = match *fc {
                        "fc1" => "net.0.proj",
                        "fc2" => "net.2",
                        _ => return None,
                    };
                    key(format!("{p}{ff}.{name}.{leaf}"))
                }
                _ => None,
            }
        }
        _ => None,
    }
}
