//! The tiny demo of examples/flux-tiny.toml: a Flux with random weights (fixed seed), tiny
//! random text encoders with made-up vocabularies, a tiny autoencoder, and a folder of
//! small generated pictures with captions, so the example needs no download. (Or, with
//! `data.dir`, a synthetic pre-encoded dataset.) They are made only when asked
//! (`train --make-tiny`, [`make_tiny`]), never in place of a path a run cannot find.

use super::config::TrainConfig;
use crate::encoders::{clip_key_map, AutoencoderKl, ClipLayout, VaeConfig, VaeKind};
use crate::models::flux::{Flux, FluxConfig};
use crate::nn::{KeyMap, KeySource, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

/// The tiny Flux of [`make_tiny`]: 4 latent channels, hidden 32, one
/// block of each kind, text width 32 (the tiny T5's), pooled 16 (the tiny CLIP's).
pub fn flux_tiny_config() -> FluxConfig {
    FluxConfig {
        in_channels: 16,
        out_channels: 16,
        vec_in_dim: 16,
        context_in_dim: 32,
        hidden_size: 32,
        mlp_ratio: 4.0,
        num_heads: 2,
        depth: 1,
        depth_single_blocks: 1,
        axes_dim: vec![4, 6, 6],
        theta: 10_000.0,
        qkv_bias: true,
        guidance_embed: true,
    }
}

/// [`flux_tiny_config`] as a diffusers `config.json` (a single file's shapes cannot give its
/// RoPE axes: [`make_tiny_flux`] writes it into the file's metadata, where the loader reads
/// it).
pub fn flux_tiny_diffusers_config() -> serde_json::Value {
    let c = flux_tiny_config();
    serde_json::json!({
        "patch_size": 1,
        "in_channels": c.in_channels,
        "out_channels": c.out_channels,
        "num_layers": c.depth,
        "num_single_layers": c.depth_single_blocks,
        "attention_head_dim": c.hidden_size / c.num_heads,
        "num_attention_heads": c.num_heads,
        "joint_attention_dim": c.context_in_dim,
        "pooled_projection_dim": c.vec_in_dim,
        "guidance_embeds": c.guidance_embed,
        "axes_dims_rope": c.axes_dim,
    })
}

/// Seed of the tiny model's weights and of the synthetic data.
const TINY_SEED: u64 = 20_261_122;

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// Writes the tiny Flux's weights (BFL keys) to `path`, with its diffusers config in the
/// file's metadata (`config`), so the file loads as it is.
pub fn make_tiny_flux(path: &Path) -> Result<()> {
    let vb = VarBuilder::random(TINY_SEED, 0.08, DType::F32, &host_device()?);
    Flux::new(&vb, &flux_tiny_config())?;
    let params = vb.params()?;
    if let Some(dir) = path.parent() {
        create_dir(dir)?;
    }
    let meta = [(
        crate::models::CONFIG_METADATA.to_string(),
        flux_tiny_diffusers_config().to_string(),
    )]
    .into_iter()
    .collect();
    crate::safetensors::save_with_metadata(params.iter().map(|(k, t)| (k.as_str(), t)), &meta, path)
}

/// Pre-encoded samples [`make_tiny`] makes for a `data.dir`.
pub const TINY_SAMPLES: usize = 16;

/// `n` synthetic samples for a model with `c` latent channels, `ctx` text width and
/// `pooled` pooled width: latents made of a few smooth patterns (something to learn),
/// random text features.
pub fn make_synthetic(dir: &Path, n: usize, (c, ctx, pooled): (usize, usize, usize)) -> Result<()> {
    let device = host_device()?;
    let tmp = dir.with_extension("tmp-synthetic");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|source| Error::Io {
            path: tmp.clone(),
            source,
        })?;
    }
    create_dir(&tmp)?;
    for i in 0..n {
        let k = (i % 4) as f32;
        let lat: Vec<f32> = (0..c * 8 * 8)
            .map(|j| {
                let (ch, y, x) = (j / 64, (j / 8) % 8, j % 8);
                ((x as f32 * (0.5 + k * 0.3) + ch as f32).sin() + (y as f32 * 0.7 - k).cos()) * 0.8
            })
            .collect();
        let seed = TINY_SEED ^ (i as u64 + 1);
        let sample = [
            ("latents", Tensor::from_vec(lat, (c, 8, 8), &device)?),
            (
                "context",
                Tensor::randn((6, ctx), DType::F32, &device, seed)?.affine(1.0, k as f64 * 0.2)?,
            ),
            (
                "pooled",
                Tensor::randn(pooled, DType::F32, &device, seed ^ 7)?,
            ),
        ];
        let p = tmp.join(format!("sample-{i:04}.safetensors"));
        crate::safetensors::save(sample.iter().map(|(k, t)| (*k, t)), p)?;
    }
    // The folder appears whole or not at all.
    std::fs::rename(&tmp, dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// The demo is made on the host: the CPU backend where built, else the GPU.
fn host_device() -> Result<Device> {
    #[cfg(feature = "cpu-ref")]
    {
        Ok(Device::Cpu)
    }
    #[cfg(not(feature = "cpu-ref"))]
    {
        #[cfg(feature = "cuda")]
        {
            Device::cuda(0)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::NoBackend("making the demo model"))
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    if let Some(dir) = path.parent() {
        create_dir(dir)?;
    }
    std::fs::write(path, bytes).map_err(io_err(path))
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    write(path, v.to_string())
}

/// Makes the tiny demo's stand-ins at the paths `config` names that do not exist (`train
/// --make-tiny`): the tiny Flux at `model.path`; with `data.dir`, [`TINY_SAMPLES`]
/// synthetic pre-encoded samples there; with images, the tiny CLIP and T5 at
/// `encoders.text`, their tokenizers at `encoders.tokenizers`, the autoencoder at
/// `encoders.vae` and pictures with captions in the first of `data.dirs`. A path that exists
/// is left as it is. Each piece is made under a temporary name and renamed into place, so it
/// appears whole or not at all. Returns the paths made.
pub fn make_tiny(config: &TrainConfig) -> Result<Vec<std::path::PathBuf>> {
    make_tiny_in(config, None)
}

/// [`make_tiny`], refusing (before making anything) a config that names any of those paths
/// outside `home` (the config file's folder, for `train --make-tiny`): stand-ins belong to
/// the demo's own folder, never in place of a user's files elsewhere.
pub fn make_tiny_in(config: &TrainConfig, home: Option<&Path>) -> Result<Vec<std::path::PathBuf>> {
    let m = &config.model;
    if m.arch != "flux" {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "the tiny demo is a Flux: model.arch = \"{}\" has no tiny stand-in",
                m.arch
            ),
        });
    }
    if let Some(home) = home {
        let e = &config.encoders;
        let mut named: Vec<(&str, &Path)> = vec![("model.path", m.path.as_path())];
        named.extend(config.data.dir.iter().map(|d| ("data.dir", d.as_path())));
        named.extend(e.text.iter().map(|p| ("encoders.text", p.as_path())));
        named.extend(
            e.tokenizers
                .iter()
                .map(|p| ("encoders.tokenizers", p.as_path())),
        );
        named.extend(e.vae.iter().map(|p| ("encoders.vae", p.as_path())));
        named.extend(
            config
                .data
                .dirs
                .iter()
                .map(|d| ("data.dirs", d.path.as_path())),
        );
        for (key, p) in named {
            let inside = p.components().all(|c| c != std::path::Component::ParentDir);
            if !p.starts_with(home) || !inside {
                return Err(Error::Config {
                    path: None,
                    msg: format!(
                        "{key} = {}: the tiny demo's stand-ins are made only under the \
                         config's own folder ({}); this config names real files",
                        p.display(),
                        home.display()
                    ),
                });
            }
        }
    }
    let mut made = vec![];
    if !m.path.exists() {
        make_tiny_flux(&m.path)?;
        made.push(m.path.clone());
    }
    if let Some(dir) = &config.data.dir {
        if !dir.exists() {
            let c = flux_tiny_config();
            make_synthetic(
                dir,
                TINY_SAMPLES,
                (c.in_channels / 4, c.context_in_dim, c.vec_in_dim),
            )?;
            made.push(dir.clone());
        }
        return Ok(made);
    }
    let e = &config.encoders;
    let pieces: [(Option<&Path>, Maker); 6] = [
        (e.text.first().map(|p| p.as_path()), make_tiny_clip),
        (e.text.get(1).map(|p| p.as_path()), make_tiny_t5),
        (
            e.tokenizers.first().map(|p| p.as_path()),
            make_clip_tokenizer,
        ),
        (e.tokenizers.get(1).map(|p| p.as_path()), make_t5_tokenizer),
        (e.vae.as_deref(), make_tiny_vae),
        (
            config.data.dirs.first().map(|d| d.path.as_path()),
            make_tiny_images,
        ),
    ];
    for (path, make) in pieces {
        if let Some(p) = path.filter(|p| !p.exists()) {
            whole(p, make)?;
            made.push(p.to_path_buf());
        }
    }
    Ok(made)
}

/// Makes one piece at a path.
type Maker = fn(&Path) -> Result<()>;

/// Runs `make` on a temporary path beside `path`, then renames it into place.
fn whole(path: &Path, make: Maker) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".tmp-{name}"));
    if tmp.is_dir() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    } else if tmp.exists() {
        std::fs::remove_file(&tmp).map_err(io_err(&tmp))?;
    }
    make(&tmp)?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Writes `params` (model keys) under the source keys `map` gives them: fused tensors split
/// back into their parts, swapped halves swapped back.
fn save_as_source(params: &[(String, Tensor)], map: &KeyMap, path: &Path) -> Result<()> {
    let mut out: Vec<(String, Tensor)> = vec![];
    for (k, t) in params {
        match map(k) {
            None => {}
            Some(KeySource::Key(s)) => out.push((s, t.clone())),
            Some(KeySource::Cat(parts)) => {
                let mut at = 0;
                for (s, rows) in parts {
                    out.push((s, t.narrow(0, at, rows)?.contiguous()?));
                    at += rows;
                }
            }
            Some(KeySource::SwapHalves(s)) => {
                let h = t.dims()[0] / 2;
                out.push((
                    s,
                    Tensor::cat(&[&t.narrow(0, h, h)?, &t.narrow(0, 0, h)?], 0)?,
                ));
            }
        }
    }
    if let Some(dir) = path.parent() {
        create_dir(dir)?;
    }
    crate::safetensors::save(out.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// Random parameters of a model built on `vb`, with norm scales at 1 (as trained models
/// have them, roughly) so activations keep their size through the layers.
fn initialized(vb: &VarBuilder) -> Result<Vec<(String, Tensor)>> {
    vb.params()?
        .into_iter()
        .map(|(k, t)| {
            let norm = k.contains("norm") && k.ends_with(".weight") && t.rank() == 1;
            let t = if norm { t.ones_like()? } else { t };
            Ok((k, t))
        })
        .collect()
}

/// The tiny CLIP-L: width 16 (Flux-tiny's pooled width), 2 layers of 2 heads, the made-up
/// 514-token vocabulary of [`make_clip_tokenizer`]; a transformers folder.
pub fn make_tiny_clip(dir: &Path) -> Result<()> {
    let cfg = serde_json::json!({
        "architectures": ["CLIPTextModel"],
        "vocab_size": 514, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 77,
        "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
        // The legacy rule: pool at the largest id, <|endoftext|> (the last id).
        "eos_token_id": 2
    });
    let c = crate::encoders::ClipConfig::from_json(&cfg, None)?;
    let vb = VarBuilder::random(TINY_SEED ^ 0xC11F, 0.3, DType::F32, &host_device()?);
    crate::encoders::ClipTextModel::new(&vb, &c, ClipLayout::Transformers)?;
    let map = clip_key_map(ClipLayout::Transformers, "", c.hidden_size);
    save_as_source(&initialized(&vb)?, &map, &dir.join("model.safetensors"))?;
    write_json(&dir.join("config.json"), &cfg)
}

/// The tiny T5 encoder: width 32 (Flux-tiny's text width), 2 layers of 2 heads, gated GELU,
/// the vocabulary of [`make_t5_tokenizer`]; a transformers folder.
pub fn make_tiny_t5(dir: &Path) -> Result<()> {
    let cfg = serde_json::json!({
        "architectures": ["T5EncoderModel"],
        "vocab_size": t5_vocab().len(), "d_model": 32, "d_kv": 16, "d_ff": 64,
        "num_layers": 2, "num_heads": 2, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32, "feed_forward_proj": "gated-gelu",
        "layer_norm_epsilon": 1e-6
    });
    let c = crate::encoders::T5Config::from_json(&cfg, None)?;
    let vb = VarBuilder::random(TINY_SEED ^ 0x75, 0.3, DType::F32, &host_device()?);
    crate::encoders::T5Encoder::new(&vb, &c)?;
    let params = initialized(&vb)?;
    create_dir(dir)?;
    crate::safetensors::save(
        params.iter().map(|(k, t)| (k.as_str(), t)),
        dir.join("model.safetensors"),
    )?;
    write_json(&dir.join("config.json"), &cfg)
}

/// The tiny autoencoder: two levels (8, 16 channels: images shrink 2x), 4 latent channels
/// (Flux-tiny's), Flux's latent scaling; a diffusers folder.
pub fn make_tiny_vae(dir: &Path) -> Result<()> {
    let mut c = VaeConfig::for_kind(VaeKind::Flux);
    c.block_out_channels = vec![8, 16];
    c.layers_per_block = 1;
    c.latent_channels = 4;
    c.norm_num_groups = 4;
    let vb = VarBuilder::random(TINY_SEED ^ 0xAE, 0.15, DType::F32, &host_device()?);
    AutoencoderKl::new(&vb, &c)?;
    let params = initialized(&vb)?;
    create_dir(dir)?;
    crate::safetensors::save(
        params.iter().map(|(k, t)| (k.as_str(), t)),
        dir.join("diffusion_pytorch_model.safetensors"),
    )?;
    let blocks = c.block_out_channels.len();
    write_json(
        &dir.join("config.json"),
        &serde_json::json!({
            "_class_name": "AutoencoderKL",
            "in_channels": 3, "out_channels": 3,
            "block_out_channels": c.block_out_channels,
            "down_block_types": vec!["DownEncoderBlock2D"; blocks],
            "up_block_types": vec!["UpDecoderBlock2D"; blocks],
            "layers_per_block": c.layers_per_block,
            "latent_channels": c.latent_channels,
            "norm_num_groups": c.norm_num_groups,
            "act_fn": "silu",
            "use_quant_conv": false, "use_post_quant_conv": false,
            "mid_block_add_attention": true,
            "scaling_factor": c.scaling.scale, "shift_factor": c.scaling.shift
        }),
    )
}

/// GPT-2's byte-to-character table (printable bytes map to themselves, the rest to code
/// points from 256 up): the alphabet of byte-level BPE, as CLIP's vocabulary uses it.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// A CLIP tokenizer folder with no merges: each byte a token, 256 more ending a word, then
/// `<|startoftext|>` (512) and `<|endoftext|>` (513), as CLIP orders its vocabulary.
pub fn make_clip_tokenizer(dir: &Path) -> Result<()> {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(format!("{c}</w>"), (256 + i).into());
    }
    vocab.insert("<|startoftext|>".into(), 512.into());
    vocab.insert("<|endoftext|>".into(), 513.into());
    write_json(&dir.join("vocab.json"), &serde_json::Value::Object(vocab))?;
    write(&dir.join("merges.txt"), "#version: 0.2\n")
}

/// The tiny T5's pieces with their log-probabilities: `<pad>`, `</s>`, `<unk>`, the word
/// marker, single characters, and whole words of the demo's captions.
fn t5_vocab() -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = ["<pad>", "</s>", "<unk>"]
        .iter()
        .map(|s| (s.to_string(), 0.0))
        .collect();
    v.push(("\u{2581}".into(), -3.0));
    for c in "abcdefghijklmnopqrstuvwxyz0123456789,.!?'-".chars() {
        v.push((c.to_string(), -6.0));
    }
    for w in WORDS {
        v.push((format!("\u{2581}{w}"), -2.0));
    }
    v
}

/// The words of the demo's captions.
const WORDS: [&str; 14] = [
    "a",
    "red",
    "green",
    "blue",
    "yellow",
    "circle",
    "square",
    "on",
    "white",
    "black",
    "background",
    "small",
    "large",
    "picture",
];

/// A T5 `tokenizer.json`: a unigram model of the demo's pieces behind a whitespace split and
/// SentencePiece's word marker, as T5's own tokenizer.json is laid out.
pub fn make_t5_tokenizer(dir: &Path) -> Result<()> {
    let special = |id: usize, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let meta = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
                                  "prepend_scheme": "always", "split": true});
    let vocab: Vec<serde_json::Value> = t5_vocab()
        .into_iter()
        .map(|(p, s)| serde_json::json!([p, s]))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, meta]},
        "post_processor": null,
        "decoder": meta,
        "model": {"type": "Unigram", "unk_id": 2, "vocab": vocab, "byte_fallback": false}
    });
    write_json(&dir.join("tokenizer.json"), &json)
}

/// Twelve small pictures (a coloured circle or square on a plain background, in three
/// sizes and so three aspect-ratio buckets) with a caption beside each.
pub fn make_tiny_images(dir: &Path) -> Result<()> {
    create_dir(dir)?;
    let colours: [(&str, [u8; 3]); 4] = [
        ("red", [220, 40, 40]),
        ("green", [40, 200, 60]),
        ("blue", [40, 70, 220]),
        ("yellow", [230, 210, 40]),
    ];
    let sizes = [(64u32, 64u32), (96, 64), (64, 96)];
    for i in 0..12usize {
        let (name, fg) = colours[i % 4];
        let (bg_name, bg) = if i % 3 == 0 {
            ("black", [15u8, 15, 15])
        } else {
            ("white", [240, 240, 240])
        };
        let square = (i / 4) % 2 == 1;
        let (w, h) = sizes[i % 3];
        let r = (w.min(h) as f32) * if i % 2 == 0 { 0.3 } else { 0.2 };
        let (cx, cy) = (w as f32 / 2.0, h as f32 / 2.0);
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            let (dx, dy) = (x as f32 + 0.5 - cx, y as f32 + 0.5 - cy);
            let inside = match square {
                true => dx.abs() <= r && dy.abs() <= r,
                false => dx * dx + dy * dy <= r * r,
            };
            image::Rgb(if inside { fg } else { bg })
        });
        let stem = format!("picture-{i:02}");
        let png = dir.join(format!("{stem}.png"));
        img.save(&png)
            .map_err(|e| crate::data::data_err(&png, format!("cannot write: {e}")))?;
        let size = if i % 2 == 0 { "large" } else { "small" };
        let shape = if square { "square" } else { "circle" };
        write(
            &dir.join(format!("{stem}.txt")),
            format!("a {size} {name} {shape} on a {bg_name} background"),
        )?;
    }
    Ok(())
}
