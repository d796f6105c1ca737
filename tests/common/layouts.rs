//! Tiny stand-ins of the model layouts users have, built from the tiny demo
//! (`train --make-tiny` of examples/flux-tiny.toml) and tests/fixtures: a ComfyUI `models/`
//! folder (the tiny Flux as a single file, lone CLIP-L and T5 files with the released
//! vocabularies' sizes, so the built-in tokenizers fit, a lone autoencoder file), the same
//! with the Flux as GGUF in `unet/`, and a Hugging Face cache folder holding the tiny
//! FLUX.2 [klein] pipeline.
#![allow(dead_code)]

use flame::train::TrainConfig;
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[path = "gguf.rs"]
mod gguf;

const CPU: Device = Device::Cpu;

/// The released vocabularies' sizes (CLIP's BPE: 49408 ids; T5 v1.1: 32128 embedding rows),
/// so the built-in tokenizers' ids fit the tiny encoders.
pub const CLIP_VOCAB: usize = 49408;
pub const T5_VOCAB: usize = 32128;

/// A fresh folder for one test (`tag` and the process id).
pub fn temp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny demo's pieces (`train --make-tiny` of examples/flux-tiny.toml) under `dir/tiny`.
pub fn demo(dir: &Path) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let p = dir.join("demo.toml");
    std::fs::copy(example, &p).unwrap();
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
}

/// The transformers / diffusers folder `src` as one single file at `dst`, its config.json
/// in the file's metadata; `vocab`: the embedding `key` widened to that many rows (random,
/// seeded) and the config's `vocab_size` set to it.
pub fn single_file(src: &Path, weights: &str, dst: &Path, vocab: Option<(&[&str], usize)>) {
    let mut t = flame::safetensors::load(src.join(weights), &CPU).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    if let Some((keys, rows)) = vocab {
        for (i, key) in keys.iter().enumerate() {
            let Some(old) = t.get(*key) else { continue };
            let width = old.dims()[1];
            let v = Tensor::randn_normal(0.0, 0.3, (rows, width), DType::F32, &CPU, i as u64 + 5)
                .unwrap();
            t.insert(key.to_string(), v);
        }
        cfg["vocab_size"] = rows.into();
    }
    let meta = BTreeMap::from([("config".to_string(), cfg.to_string())]);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    flame::safetensors::save_with_metadata(t.iter().map(|(k, v)| (k.as_str(), v)), &meta, dst)
        .unwrap();
}

/// A ComfyUI-style `models/` folder from the tiny demo under `dir` (which then also holds
/// the demo's pictures in `tiny/images`).
pub fn comfy(dir: &Path) -> PathBuf {
    demo(dir);
    let tiny = dir.join("tiny");
    let m = dir.join("models");
    std::fs::create_dir_all(m.join("diffusion_models")).unwrap();
    std::fs::copy(
        tiny.join("flux-tiny.safetensors"),
        m.join("diffusion_models/flux1-tiny.safetensors"),
    )
    .unwrap();
    single_file(
        &tiny.join("text_encoder"),
        "model.safetensors",
        &m.join("text_encoders/clip_l.safetensors"),
        Some((
            &["text_model.embeddings.token_embedding.weight"],
            CLIP_VOCAB,
        )),
    );
    single_file(
        &tiny.join("text_encoder_2"),
        "model.safetensors",
        &m.join("text_encoders/t5xxl_fp16.safetensors"),
        Some((&["shared.weight", "encoder.embed_tokens.weight"], T5_VOCAB)),
    );
    single_file(
        &tiny.join("vae"),
        "diffusion_pytorch_model.safetensors",
        &m.join("vae/ae.safetensors"),
        None,
    );
    // Files of no role are passed over.
    std::fs::create_dir_all(m.join("loras")).unwrap();
    let lora = Tensor::zeros((2, 2), DType::F32, &CPU).unwrap();
    flame::safetensors::save(
        [("lora_unet_x.lora_down.weight", &lora)],
        m.join("loras/style.safetensors"),
    )
    .unwrap();
    m
}

/// The ComfyUI folder `m`'s tiny Flux replaced by its GGUF stand-in in `unet/` (the one of
/// tests/gguf_flux.rs: every tensor in F32, the tiny model's config in the metadata);
/// returns the GGUF file.
pub fn gguf_flux(m: &Path) -> PathBuf {
    let src = m.join("diffusion_models/flux1-tiny.safetensors");
    let f = flame::safetensors::SafeTensorsFile::open(&src).unwrap();
    let cfg = f.metadata()["config"].clone();
    let entries: Vec<gguf::Entry> = f
        .names()
        .map(|n| {
            let t = f.load_as(n, &CPU, DType::F32).unwrap();
            gguf::Entry {
                name: n.to_string(),
                shape: t.dims().to_vec(),
                ty: flame::backend::ggml::GgmlType::F32,
                bytes: t
                    .flatten_all()
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            }
        })
        .collect();
    let kvs = [
        ("general.architecture", gguf::kv_str("flux")),
        ("config", gguf::kv_str(&cfg)),
    ];
    std::fs::create_dir_all(m.join("unet")).unwrap();
    let out = m.join("unet/flux1-tiny-F32.gguf");
    std::fs::write(&out, gguf::gguf_bytes(3, &kvs, &entries, 32)).unwrap();
    std::fs::remove_file(&src).unwrap();
    out
}

/// Copies the folder `src` to `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

/// A Hugging Face cache folder `dir/hub/models--x--y` holding the tiny FLUX.2 [klein]
/// pipeline (tests/fixtures/klein) as snapshot `abc`, named by refs/main.
pub fn hub(dir: &Path) -> PathBuf {
    let hub = dir.join("hub/models--x--y");
    let pipeline = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/klein/pipeline");
    copy_dir(&pipeline, &hub.join("snapshots/abc"));
    std::fs::create_dir_all(hub.join("refs")).unwrap();
    std::fs::write(hub.join("refs/main"), "abc").unwrap();
    hub
}

/// tests/fixtures/`rel`.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The tensors of the `.safetensors` or `.gguf` file `src` in f32 (a GGUF's dequantized), each
/// key with `prefix` before it; the token embeddings among `widen` (keys of `src`) widened to
/// `rows` rows (random, seeded), so that the built-in tokenizers' ids fit.
pub fn tensors_of(src: &Path, prefix: &str, widen: &[&str], rows: usize) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = if flame::gguf::is_gguf(src) {
        let f = flame::gguf::GgufFile::open(src).unwrap();
        f.names()
            .map(|n| (n.to_string(), f.load_as(n, &CPU, DType::F32).unwrap()))
            .collect()
    } else {
        let f = flame::safetensors::SafeTensorsFile::open(src).unwrap();
        f.names()
            .map(|n| (n.to_string(), f.load_as(n, &CPU, DType::F32).unwrap()))
            .collect()
    };
    for (i, (k, t)) in out.iter_mut().enumerate() {
        if widen.contains(&k.as_str()) {
            let width = t.dims()[1];
            *t = Tensor::randn_normal(0.0, 0.3, (rows, width), DType::F32, &CPU, i as u64 + 5)
                .unwrap();
        }
        *k = format!("{prefix}{k}");
    }
    out
}

/// Writes `tensors` as one `.safetensors` file at `dst`, with the `config` metadata of the
/// GGUF file `config_of` if it has one.
pub fn write_file(tensors: &[(String, Tensor)], dst: &Path, config_of: Option<&Path>) {
    let meta: BTreeMap<String, String> = config_of
        .and_then(|p| {
            let f = flame::gguf::GgufFile::open(p).unwrap();
            Some(f.metadata().get("config")?.as_str()?.to_string())
        })
        .map(|c| ("config".to_string(), c))
        .into_iter()
        .collect();
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    flame::safetensors::save_with_metadata(
        tensors.iter().map(|(k, v)| (k.as_str(), v)),
        &meta,
        dst,
    )
    .unwrap();
}

/// The token embedding of a transformers CLIP text model.
pub const CLIP_EMBEDDING: &str = "text_model.embeddings.token_embedding.weight";
/// The token embeddings of a transformers T5 encoder.
const T5_EMBEDDINGS: [&str; 2] = ["shared.weight", "encoder.embed_tokens.weight"];

/// The tiny SD3.5 medium of tests/fixtures/gguf (scripts/make_gguf_family_fixtures.py) as
/// the pieces of a ComfyUI `models/` folder under `dir`: `checkpoints/sd3.5_medium.safetensors`,
/// Stability's all-in-one without text encoders (the MMDiT under `model.diffusion_model.`, the
/// autoencoder under `first_stage_model.`), or with `gguf` the GGUF in `unet/` and the
/// autoencoder in `vae/`; and `text_encoders/clip_l.safetensors`, `clip_g.safetensors`,
/// `t5xxl_fp16.safetensors` (tests/fixtures/pipeline's encoders, whose widths the model's
/// context and pooled inputs are, with the released vocabularies' rows). Returns the folder.
pub fn sd35_folder(dir: &Path, gguf: bool) -> PathBuf {
    let m = dir.join("models");
    let model = fixture("gguf/sd35_medium-tiny-Q5_0.gguf");
    for (src, dst) in [
        ("pipeline/clip_l_proj", "clip_l"),
        ("pipeline/clip_g", "clip_g"),
    ] {
        single_file(
            &fixture(src),
            "model.safetensors",
            &m.join(format!("text_encoders/{dst}.safetensors")),
            Some((&[CLIP_EMBEDDING], CLIP_VOCAB)),
        );
    }
    single_file(
        &fixture("pipeline/t5"),
        "model.safetensors",
        &m.join("text_encoders/t5xxl_fp16.safetensors"),
        Some((&T5_EMBEDDINGS, T5_VOCAB)),
    );
    if gguf {
        std::fs::create_dir_all(m.join("unet")).unwrap();
        std::fs::copy(&model, m.join("unet/sd3.5_medium-Q5_0.gguf")).unwrap();
        single_file(
            &fixture("vae/flux_like"),
            "diffusion_pytorch_model.safetensors",
            &m.join("vae/sd35_vae.safetensors"),
            None,
        );
        return m;
    }
    let mut all = tensors_of(&model, flame::models::checkpoint::LDM_PREFIX, &[], 0);
    all.extend(wide_vae(
        &fixture("vae/flux_like_ae.safetensors"),
        "first_stage_model.",
    ));
    write_file(
        &all,
        &m.join("checkpoints/sd3.5_medium.safetensors"),
        Some(&model),
    );
    m
}

/// The tiny FLUX.2 [klein] (`flux2`) or Z-Image (`zimage`) of tests/fixtures/gguf in a ComfyUI
/// `models/` folder under `dir`: the GGUF in `unet/`, the pipeline's Qwen3 in
/// `text_encoders/` (with Qwen's vocabulary's rows, so the built-in tokenizer's ids fit) and
/// its autoencoder in `vae/`, each a single file with its config in the metadata. Returns the
/// folder.
pub fn qwen_family_folder(dir: &Path, arch: &str) -> PathBuf {
    let (gguf, pipeline) = match arch {
        "flux2" => ("flux2-tiny-Q8_0.gguf", "klein/pipeline"),
        _ => ("zimage-tiny-Q4_0.gguf", "zimage_pipeline/pipeline"),
    };
    let m = dir.join("models");
    std::fs::create_dir_all(m.join("unet")).unwrap();
    std::fs::copy(fixture(&format!("gguf/{gguf}")), m.join("unet").join(gguf)).unwrap();
    let p = fixture(pipeline);
    single_file(
        &p.join("text_encoder"),
        "model.safetensors",
        &m.join("text_encoders/qwen_3.safetensors"),
        Some((&["model.embed_tokens.weight"], QWEN3_VOCAB)),
    );
    // The autoencoder's tensors FLAME reads (FLUX.2's batch-norm step count, an I64, left
    // out), its config in the metadata.
    let vae = flame::safetensors::SafeTensorsFile::open(
        p.join("vae/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let t: Vec<(String, Tensor)> = vae
        .names()
        .filter(|n| !n.ends_with("num_batches_tracked"))
        .map(|n| (n.to_string(), vae.load_as(n, &CPU, DType::F32).unwrap()))
        .collect();
    let cfg = std::fs::read_to_string(p.join("vae/config.json")).unwrap();
    let meta = BTreeMap::from([("config".to_string(), cfg)]);
    let dst = m.join("vae").join(format!("{arch}_vae.safetensors"));
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    flame::safetensors::save_with_metadata(t.iter().map(|(k, v)| (k.as_str(), v)), &meta, &dst)
        .unwrap();
    m
}

/// Qwen's vocabulary (Qwen3's embedding rows).
pub const QWEN3_VOCAB: usize = 151936;

/// The autoencoder of `src` (BFL's layout, widths of 8, 16 latent channels, SD3's kind) at
/// widths of 32, random, each key under `prefix`: an all-in-one file holds no autoencoder
/// config, and a width that is no multiple of 32 leaves its norm groups unknown. The latent
/// side keeps its size (the decoder's first convolution's input, the encoder's last output).
pub fn wide_vae(src: &Path, prefix: &str) -> Vec<(String, Tensor)> {
    let f = flame::safetensors::SafeTensorsFile::open(src).unwrap();
    f.names()
        .enumerate()
        .map(|(i, n)| {
            let shape = f.info(n).unwrap().shape.clone();
            let keep = |d: usize| {
                (n.starts_with("decoder.conv_in.") && d == 1)
                    || (n.starts_with("encoder.conv_out.") && d == 0)
            };
            let wide: Vec<usize> = shape
                .iter()
                .enumerate()
                .map(|(d, &w)| if w == 8 && !keep(d) { 32 } else { w })
                .collect();
            let t = if wide.len() == 1 {
                let v = if n.contains("norm") && n.ends_with(".weight") {
                    1.0
                } else {
                    0.0
                };
                Tensor::full(v, wide, DType::F32, &CPU).unwrap()
            } else {
                Tensor::randn_normal(0.0, 0.05, wide, DType::F32, &CPU, i as u64 + 11).unwrap()
            };
            (format!("{prefix}{n}"), t)
        })
        .collect()
}
