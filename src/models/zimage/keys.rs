//! Original Z-Image keys -> diffusers `ZImageTransformer2DModel` keys: the inverse of
//! diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`
//! (`loaders/single_file_utils.py`). `x_embedder.*` and `final_layer.*` live under the patch
//! size's key (`all_x_embedder.2-1.*`, `all_final_layer.2-1.*`); a fused
//! `attention.qkv.weight` is to_q | to_k | to_v (the converter's `torch.chunk(..., 3)`);
//! `attention.out` is `attention.to_out.0`, `q_norm` / `k_norm` are `norm_q` / `norm_k`;
//! every other key is the same in both layouts.

use super::ZImageConfig;
use crate::nn::{KeyMap, KeySource};
use std::sync::Arc;

/// The map for a model of `cfg`'s shape (its width splits qkv; its patch names the embedder).
pub fn diffusers_map(cfg: &ZImageConfig) -> KeyMap {
    let (d, patch) = (cfg.dim, cfg.patch_key());
    Arc::new(move |key: &str| map_key(key, d, &patch))
}

/// One original key's diffusers source, for hidden width `d` and patch key `patch` ("2-1").
pub fn map_key(k: &str, d: usize, patch: &str) -> Option<KeySource> {
    let key = |s: String| Some(KeySource::Key(s));
    if let Some(rest) = k.strip_prefix("x_embedder.") {
        return key(format!("all_x_embedder.{patch}.{rest}"));
    }
    if let Some(rest) = k.strip_prefix("final_layer.") {
        return key(format!("all_final_layer.{patch}.{rest}"));
    }
    if let Some((block, leaf)) = k.split_once(".attention.") {
        return match leaf {
            "qkv.weight" => Some(KeySource::Cat(
                ["to_q", "to_k", "to_v"]
                    .iter()
                    .map(|p| (format!("{block}.attention.{p}.weight"), d))
                    .collect(),
            )),
            "out.weight" => key(format!("{block}.attention.to_out.0.weight")),
            "q_norm.weight" => key(format!("{block}.attention.norm_q.weight")),
            "k_norm.weight" => key(format!("{block}.attention.norm_k.weight")),
            _ => None,
        };
    }
    key(k.to_string())
}
