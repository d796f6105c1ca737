//! One path to a model (`models::discover`): tiny stand-ins of the layouts users have, each
//! trained for two steps through the trainer with `model.path` the only model path given: a
//! ComfyUI `models/` folder (the tiny Flux as a single file, lone CLIP-L and T5 files with
//! the released vocabularies' sizes, so the built-in tokenizers fit, and a lone autoencoder
//! file), the GGUF Flux in ComfyUI's `unet/`, and a Hugging Face cache folder holding the
//! tiny FLUX.2 [klein] pipeline. Of several autoencoders, the one that fits the family is
//! picked. A folder with two diffusion models, two autoencoders that fit equally, or
//! without an autoencoder, is refused naming the files, the role and the key.
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

/// A single file with the diffusers model's names (BFL's FP8 FLUX.2 [klein] layout: split
/// q/k/v, a scale each) is found in a folder as that family's model, with or without the
/// family named, and loads as it (tests/flux2_fp8.rs checks its values).
#[test]
fn a_diffusers_named_single_file_is_found_in_a_folder() {
    let d = temp("discover-diffusers-named");
    let m = d.join("models");
    std::fs::create_dir_all(m.join("diffusion_models")).unwrap();
    let file = m.join("diffusion_models/flux-2-klein-tiny-fp8.safetensors");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/flux2_fp8/diffusers_tensor.safetensors"),
        &file,
    )
    .unwrap();
    for arch in [Some("flux2"), None] {
        let found = flame::models::discover(&m, arch, true, true, KEYS).unwrap();
        assert_eq!(found.family.name, "flux2");
        assert_eq!(found.model, file);
    }
    let ckpt = flame::models::family("flux2")
        .unwrap()
        .open_checkpoint(&file)
        .unwrap();
    assert_eq!(ckpt.format, flame::models::Format::Diffusers);
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

/// The comfy folder's tiny Flux autoencoder `vae/ae.safetensors` (4 latent channels, no quant
/// convs, the tiny model's 16 input channels being 2x2 patches of 4) copied to `vae/name`
/// with `extra` tensors added, its decoder taking `latents` channels, and `scaling` as its
/// config's `scaling_factor` when given.
fn vae_like(
    m: &Path,
    name: &str,
    extra: &[(&str, &[usize])],
    latents: usize,
    scaling: Option<f64>,
) {
    use flame::{DType, Device, Tensor};
    let src = m.join("vae/ae.safetensors");
    let f = flame::safetensors::SafeTensorsFile::open(&src).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&f.metadata()["config"]).unwrap();
    let mut t = flame::safetensors::load(&src, &Device::Cpu).unwrap();
    let conv = t["decoder.conv_in.weight"].dims().to_vec();
    let z = |s: &[usize]| Tensor::zeros(s.to_vec(), DType::F32, &Device::Cpu).unwrap();
    t.insert(
        "decoder.conv_in.weight".into(),
        z(&[conv[0], latents, conv[2], conv[3]]),
    );
    for (k, s) in extra {
        t.insert(k.to_string(), z(s));
    }
    if let Some(s) = scaling {
        cfg["scaling_factor"] = s.into();
    }
    let meta = std::collections::BTreeMap::from([("config".to_string(), cfg.to_string())]);
    flame::safetensors::save_with_metadata(
        t.iter().map(|(k, v)| (k.as_str(), v)),
        &meta,
        m.join("vae").join(name),
    )
    .unwrap();
}

/// A `vae/` folder of several autoencoders: FLUX.2's (with `bn.`), SDXL's (quant convs) and
/// one of other latent channels are passed over for the Flux model, each named with why; an
/// SD3.5-like one (the same structure, its config's scaling_factor SD3's 1.5305) fits less
/// than Flux's own (0.3611); two that fit equally are refused, naming both and the key.
#[test]
fn the_autoencoder_that_fits_the_family_is_picked_among_several() {
    let d = temp("discover-vaes");
    let m = comfy(&d);
    let ae = flame::safetensors::SafeTensorsFile::open(m.join("vae/ae.safetensors")).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&ae.metadata()["config"]).unwrap();
    assert_eq!(cfg["scaling_factor"].as_f64(), Some(0.3611), "{cfg}");
    vae_like(
        &m,
        "flux2-vae.safetensors",
        &[("bn.running_mean", &[16]), ("bn.running_var", &[16])],
        4,
        None,
    );
    vae_like(
        &m,
        "sdxl_vae.safetensors",
        &[
            ("quant_conv.weight", &[8, 8, 1, 1]),
            ("post_quant_conv.weight", &[4, 4, 1, 1]),
        ],
        4,
        None,
    );
    vae_like(&m, "wide.safetensors", &[], 8, None);
    vae_like(&m, "sd3.5_vae.safetensors", &[], 4, Some(1.5305));
    let found = flame::models::discover(&m, Some("flux"), false, false, KEYS).unwrap();
    assert_eq!(found.vae, Some(m.join("vae/ae.safetensors")));
    let all = found.lines.join("\n");
    for want in [
        "passed over",
        "flux2-vae.safetensors: an autoencoder of 4 latent channels, FLUX.2's kind",
        "sdxl_vae.safetensors: an autoencoder of 4 latent channels, with quant convs",
        "wide.safetensors: an autoencoder of 8 latent channels",
        "sd3.5_vae.safetensors",
        "picked among the folder's autoencoders",
        "scaling_factor 0.3611",
    ] {
        assert!(all.contains(want), "{want}:\n{all}");
    }
    // The run uses the one picked.
    let notes = train(&config(&d, "flux", &m, &d.join("tiny/images")));
    assert!(
        notes
            .iter()
            .any(|n| n.contains("autoencoder: ") && n.contains("ae.safetensors (")),
        "{notes:?}"
    );
    // A copy of Flux's fits as well as Flux's: refused, naming both.
    std::fs::copy(
        m.join("vae/ae.safetensors"),
        m.join("vae/ae-copy.safetensors"),
    )
    .unwrap();
    let e = flame::models::discover(&m, Some("flux"), false, false, KEYS)
        .unwrap_err()
        .to_string();
    for want in [
        "ae.safetensors (",
        "ae-copy.safetensors (",
        "fit the flux model equally",
        "encoders.vae",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // With only autoencoders that do not fit, the refusal says why each was passed over.
    for f in [
        "ae.safetensors",
        "ae-copy.safetensors",
        "sd3.5_vae.safetensors",
    ] {
        std::fs::remove_file(m.join("vae").join(f)).unwrap();
    }
    let e = flame::models::discover(&m, Some("flux"), false, false, KEYS)
        .unwrap_err()
        .to_string();
    for want in [
        "an autoencoder that fits",
        "wide.safetensors",
        "sdxl_vae.safetensors",
        "encoders.vae",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// A diffusers model's own weight file opens as its folder (its config.json, every shard);
/// the same file alone, with no config beside it, reads through the diffusers key map:
/// SD3's, whose `context_embedder.weight` is named alike in both layouts. Both build.
#[test]
fn a_diffusers_model_file_opens_as_its_folder_or_alone() {
    use flame::models::{Format, LoadOptions};
    let sd3 = flame::models::family("sd3").unwrap();
    let folder = layouts::fixture("models/sd35_large/transformer");
    let file = folder.join("diffusion_pytorch_model.safetensors");
    let ck = sd3.open_checkpoint(&file).unwrap();
    assert_eq!(ck.format, Format::Diffusers);
    assert!(ck.config.is_some());
    assert_eq!(ck.files, vec![file.clone()]);
    assert_eq!(ck.path, file);
    let d = temp("discover-diffusers-file");
    let alone = d.join("sd35-large-tiny.safetensors");
    std::fs::copy(&file, &alone).unwrap();
    let ck = sd3.open_checkpoint(&alone).unwrap();
    assert_eq!(ck.format, Format::Diffusers);
    assert!(ck.config.is_none());
    let opts = LoadOptions::new(flame::DType::F32, &flame::Device::Cpu);
    let (a, b) = (
        sd3.probe(&file, &opts).unwrap(),
        sd3.probe(&alone, &opts).unwrap(),
    );
    let names = |l: &flame::models::Loaded<dyn flame::models::DiffusionModel>| {
        let mut v: Vec<(String, Vec<usize>)> =
            l.vb.params()
                .unwrap()
                .iter()
                .map(|(k, t)| (k.clone(), t.dims().to_vec()))
                .collect();
        v.sort();
        v
    };
    assert_eq!(names(&a), names(&b));
    std::fs::remove_dir_all(&d).ok();
}

/// A pipeline's component folders without its model_index.json: of two CLIPs for Flux's one
/// CLIP slot, the one in the slot's diffusers folder (`text_encoder/`); without the folder
/// names, both are named in the refusal.
#[test]
fn a_pipelines_components_are_found_by_their_folders() {
    let d = temp("discover-components");
    layouts::demo(&d);
    let tiny = d.join("tiny");
    let p = d.join("pipe");
    for f in ["text_encoder", "text_encoder_2", "vae"] {
        layouts::copy_dir(&tiny.join(f), &p.join(f));
    }
    layouts::copy_dir(
        &layouts::fixture("encoders/clip_g"),
        &p.join("text_encoder_g"),
    );
    std::fs::create_dir_all(p.join("transformer")).unwrap();
    std::fs::copy(
        tiny.join("flux-tiny.safetensors"),
        p.join("transformer/flux-tiny.safetensors"),
    )
    .unwrap();
    let found = flame::models::discover(&p, Some("flux"), false, false, KEYS).unwrap();
    assert_eq!(
        found.text,
        vec![
            p.join("text_encoder/model.safetensors"),
            p.join("text_encoder_2/model.safetensors")
        ]
    );
    let all = found.lines.join("\n");
    assert!(all.contains("in text_encoder/"), "{all}");
    std::fs::rename(p.join("text_encoder"), p.join("clip_a")).unwrap();
    let e = flame::models::discover(&p, Some("flux"), false, false, KEYS)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("several candidates for the clip_l text encoder")
            && e.contains("clip_a")
            && e.contains("text_encoder_g"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}
