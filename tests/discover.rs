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
use std::path::{Path, PathBuf};

#[path = "common/layouts.rs"]
mod layouts;
use layouts::{comfy, gguf_flux, hub, temp};

const KEYS: Keys = Keys {
    model: "model.path",
    arch: "model.arch",
    text: "encoders.text",
    vae: "encoders.vae",
};

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
    let d = temp("discover-comfy");
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
    let d = temp("discover-ambiguous");
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
    let d = temp("discover-novae");
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
    let d = temp("discover-gguf");
    let m = comfy(&d);
    gguf_flux(&m);
    let found = flame::models::discover(&m, Some("flux"), false, false, KEYS).unwrap();
    assert_eq!(found.model, m.join("unet/flux1-tiny-F32.gguf"));
    assert!(found.lines[0].contains("GGUF"), "{:?}", found.lines);
    train(&config(&d, "flux", &m, &d.join("tiny/images")));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_hugging_face_cache_folder_trains_from_its_snapshot() {
    let d = temp("discover-hub");
    let hub = hub(&d);
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
