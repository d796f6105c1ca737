//! One path to a model (`models::discover`): tiny stand-ins of the layouts users have, each
//! trained for two steps through the trainer with `model.path` the only model path given: a
//! ComfyUI `models/` folder (the tiny Flux as a single file, lone CLIP-L and T5 files with
//! the released vocabularies' sizes, so the built-in tokenizers fit, and a lone autoencoder
//! file), the GGUF Flux in ComfyUI's `unet/`, and a Hugging Face cache folder holding the
//! tiny FLUX.2 [klein] pipeline. A folder with two diffusion models, or without an
//! autoencoder, is refused naming the files, the role and the key.
#![cfg(feature = "cpu-ref")]

use flame::models::discover::Keys;
use flame::train::{Event, RunOptions, TrainConfig, Trainer};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

/// The released vocabularies' sizes (CLIP's BPE: 49408 ids; T5 v1.1: 32128 embedding rows),
/// so the built-in tokenizers' ids fit the tiny encoders.
const CLIP_VOCAB: usize = 49408;
const T5_VOCAB: usize = 32128;

const KEYS: Keys = Keys {
    model: "model.path",
    arch: "model.arch",
    text: "encoders.text",
    vae: "encoders.vae",
};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-discover-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny demo's pieces (`train --make-tiny` of examples/flux-tiny.toml) under `dir/tiny`.
fn demo(dir: &Path) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let p = dir.join("demo.toml");
    std::fs::copy(example, &p).unwrap();
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
}

/// The transformers / diffusers folder `src` as one single file at `dst`, its config.json
/// in the file's metadata; `vocab`: the embedding `key` widened to that many rows (random,
/// seeded) and the config's `vocab_size` set to it.
fn single_file(src: &Path, weights: &str, dst: &Path, vocab: Option<(&[&str], usize)>) {
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

/// A ComfyUI-style `models/` folder from the tiny demo under `dir`.
fn comfy(dir: &Path) -> PathBuf {
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

/// A two-step run on `model` (and `images`) with no other model path given.
fn config(dir: &Path, arch: &str, model: &Path, images: &Path) -> PathBuf {
    let targets = r#"["double_blocks.*_attn.qkv", "single_blocks.*.linear*"]"#;
    let text = format!(
        r#"[model]
arch = "{arch}"
path = "{model}"
dtype = "f32"

[encoders]
t5_tokens = 16

[adapter]
rank = 4
alpha = 4.0
targets = {targets}

[optimizer]
lr = 1e-3

[train]
steps = 2
batch_size = 2
seed = 7
output_dir = "{out}"
device = "cpu"

[data]
resolution = 32
bucket_step = 16

[[data.dirs]]
path = "{images}"
"#,
        model = model.display(),
        out = dir.join("out").display(),
        images = images.display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Trains the config at `p` for its two steps; returns the log's notes.
fn train(p: &Path) -> Vec<String> {
    let cfg = TrainConfig::from_file(p).unwrap();
    let mut notes = vec![];
    Trainer::open(cfg.clone(), flame::train::Prepare::Encode, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })
    .unwrap()
    .run(&RunOptions::default(), &mut |_| {})
    .unwrap();
    let log = flame::train::rundir::read_log(&cfg.train.output_dir.join("loss.jsonl")).unwrap();
    assert_eq!(log.len(), 2);
    for (_, line) in &log {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["loss"].as_f64().unwrap().is_finite(), "{line}");
    }
    assert!(cfg.train.output_dir.join("lora.safetensors").is_file());
    notes
}

#[test]
fn a_comfyui_folder_is_found_by_keys_and_trains() {
    let d = temp("comfy");
    let m = comfy(&d);
    let found = flame::models::discover(&m, None, false, false, KEYS).unwrap();
    assert_eq!(found.family.name, "flux");
    assert_eq!(
        found.model,
        m.join("diffusion_models/flux1-tiny.safetensors")
    );
    assert_eq!(
        found.text,
        vec![
            m.join("text_encoders/clip_l.safetensors"),
            m.join("text_encoders/t5xxl_fp16.safetensors")
        ]
    );
    assert_eq!(found.vae, Some(m.join("vae/ae.safetensors")));
    let all = found.lines.join("\n");
    for role in [
        "diffusion model (flux)",
        "clip_l text encoder",
        "t5 text encoder",
        "autoencoder",
    ] {
        assert!(all.contains(role), "{all}");
    }
    let notes = train(&config(&d, "flux", &m, &d.join("tiny/images")));
    assert!(
        notes.iter().any(|n| n.contains("clip_l text encoder")),
        "{notes:?}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn two_diffusion_models_are_refused_naming_both() {
    let d = temp("ambiguous");
    let m = comfy(&d);
    std::fs::create_dir_all(m.join("unet")).unwrap();
    std::fs::copy(
        m.join("diffusion_models/flux1-tiny.safetensors"),
        m.join("unet/flux1-copy.safetensors"),
    )
    .unwrap();
    let e = flame::models::discover(&m, Some("flux"), false, false, KEYS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("flux1-tiny.safetensors"), "{e}");
    assert!(e.contains("flux1-copy.safetensors"), "{e}");
    assert!(e.contains("model.path"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_folder_without_an_autoencoder_is_refused_naming_the_role() {
    let d = temp("novae");
    let m = comfy(&d);
    std::fs::remove_dir_all(m.join("vae")).unwrap();
    let e = flame::models::discover(&m, Some("flux"), false, false, KEYS)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("autoencoder") && e.contains("encoders.vae"),
        "{e}"
    );
    // Given in [encoders], it is not searched for.
    let found = flame::models::discover(&m, Some("flux"), false, true, KEYS).unwrap();
    assert_eq!(found.vae, None);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_gguf_flux_in_comfyuis_unet_folder_trains() {
    let d = temp("gguf");
    let m = comfy(&d);
    // The GGUF stand-in of tests/gguf_flux.rs, written the same way: every tensor in F32
    // with the tiny model's config in the metadata.
    let src = m.join("diffusion_models/flux1-tiny.safetensors");
    let f = flame::safetensors::SafeTensorsFile::open(&src).unwrap();
    let cfg = f.metadata()["config"].clone();
    let entries: Vec<common_gguf::Entry> = f
        .names()
        .map(|n| {
            let t = f.load_as(n, &CPU, DType::F32).unwrap();
            common_gguf::Entry {
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
        ("general.architecture", common_gguf::kv_str("flux")),
        ("config", common_gguf::kv_str(&cfg)),
    ];
    std::fs::create_dir_all(m.join("unet")).unwrap();
    std::fs::write(
        m.join("unet/flux1-tiny-F32.gguf"),
        common_gguf::gguf_bytes(3, &kvs, &entries, 32),
    )
    .unwrap();
    std::fs::remove_file(&src).unwrap();
    let found = flame::models::discover(&m, Some("flux"), false, false, KEYS).unwrap();
    assert_eq!(found.model, m.join("unet/flux1-tiny-F32.gguf"));
    assert!(found.lines[0].contains("GGUF"), "{:?}", found.lines);
    train(&config(&d, "flux", &m, &d.join("tiny/images")));
    std::fs::remove_dir_all(&d).ok();
}

/// Copies the folder `src` to `dst`.
fn copy_dir(src: &Path, dst: &Path) {
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

#[test]
fn a_hugging_face_cache_folder_trains_from_its_snapshot() {
    let d = temp("hub");
    let hub = d.join("hub/models--x--y");
    let pipeline = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/klein/pipeline");
    copy_dir(&pipeline, &hub.join("snapshots/abc"));
    std::fs::create_dir_all(hub.join("refs")).unwrap();
    std::fs::write(hub.join("refs/main"), "abc").unwrap();
    let found = flame::models::discover(&hub, None, false, false, KEYS).unwrap();
    assert_eq!(found.family.name, "flux2");
    assert_eq!(found.model, hub.join("snapshots/abc"));
    assert!(found.text.is_empty() && found.vae.is_none());
    let images = d.join("images");
    flame::train::demo::make_tiny_images(&images).unwrap();
    train(&config(&d, "flux2", &hub, &images));
    // Two snapshots and no refs/main: refused naming both.
    std::fs::remove_file(hub.join("refs/main")).unwrap();
    std::fs::create_dir_all(hub.join("snapshots/def")).unwrap();
    let e = flame::models::discover(&hub, None, false, false, KEYS)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("abc") && e.contains("def") && e.contains("refs/main"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[path = "common/gguf.rs"]
mod common_gguf;
