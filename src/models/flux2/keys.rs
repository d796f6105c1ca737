//! BFL FLUX.2 keys -> diffusers `Flux2Transformer2DModel` keys (the inverse of diffusers'
//! `convert_flux2_transformer_checkpoint_to_diffusers` in `loaders/single_file_utils.py`).
//! A double block's fused `qkv` is the concatenation to_q | to_k | to_v (add_q_proj |
//! add_k_proj | add_v_proj for text), which the converter splits with `torch.chunk(.., 3)`;
//! a single block's `linear1` is diffusers' `attn.to_qkv_mlp_proj` as it is (fused in both);
//! the final adaLN stores (scale, shift) in diffusers (the converter's `swap_scale_shift`);
//! RMSNorm `scale`s are diffusers' `weight`s.

use super::Flux2Config;
use crate::nn::{KeyMap, KeySource};
use std::sync::Arc;

/// The map for a model of `cfg`'s shape (the hidden size says how a fused qkv splits).
pub fn diffusers_map(cfg: &Flux2Config) -> KeyMap {
    let h = cfg.hidden_size;
    Arc::new(move |key: &str| map_key(key, h))
}

fn key(k: String) -> Option<KeySource> {
    Some(KeySource::Key(k))
}

/// One BFL key's diffusers source, for hidden size `h`.
pub fn map_key(k: &str, h: usize) -> Option<KeySource> {
    let (path, leaf) = k.rsplit_once('.')?;
    let parts: Vec<&str> = path.split('.').collect();
    match parts.as_slice() {
        ["img_in"] => key(format!("x_embedder.{leaf}")),
        ["txt_in"] => key(format!("context_embedder.{leaf}")),
        [emb @ ("time_in" | "guidance_in"), layer] => {
            let name = match *emb {
                "time_in" => "timestep_embedder",
                _ => "guidance_embedder",
            };
            let lin = match *layer {
                "in_layer" => "linear_1",
                "out_layer" => "linear_2",
                _ => return None,
            };
            key(format!("time_guidance_embed.{name}.{lin}.{leaf}"))
        }
        [m @ ("double_stream_modulation_img"
        | "double_stream_modulation_txt"
        | "single_stream_modulation"), "lin"] => key(format!("{m}.linear.{leaf}")),
        ["final_layer", "linear"] => key(format!("proj_out.{leaf}")),
        ["final_layer", "adaLN_modulation", "1"] => {
            Some(KeySource::SwapHalves(format!("norm_out.linear.{leaf}")))
        }
        ["double_blocks", i, stream, rest @ ..] => {
            let p = format!("transformer_blocks.{i}.");
            let (img, kind) = match *stream {
                "img_attn" => (true, "attn"),
                "img_mlp" => (true, "mlp"),
                "txt_attn" => (false, "attn"),
                "txt_mlp" => (false, "mlp"),
                _ => return None,
            };
            match (kind, rest) {
                ("attn", ["qkv"]) => {
                    let names = if img {
                        ["to_q", "to_k", "to_v"]
                    } else {
                        ["add_q_proj", "add_k_proj", "add_v_proj"]
                    };
                    Some(KeySource::Cat(
                        names
                            .iter()
                            .map(|n| (format!("{p}attn.{n}.{leaf}"), h))
                            .collect(),
                    ))
                }
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
                        "0" => "linear_in",
                        "2" => "linear_out",
                        _ => return None,
                    };
                    key(format!("{p}{ff}.{n}.{leaf}"))
                }
                _ => None,
            }
        }
        ["single_blocks", i, rest @ ..] => {
            let p = format!("single_transformer_blocks.{i}.attn.");
            match rest {
                ["linear1"] => key(format!("{p}to_qkv_mlp_proj.{leaf}")),
                ["linear2"] => key(format!("{p}to_out.{leaf}")),
                ["norm", "query_norm"] if leaf == "scale" => key(format!("{p}norm_q.weight")),
                ["norm", "key_norm"] if leaf == "scale" => key(format!("{p}norm_k.weight")),
                _ => None,
            }
        }
        _ => None,
    }
}
