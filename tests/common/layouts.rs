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
