//! Adapters on the text encoders. CLIP with a LoRA on its Linears against transformers'
//! CLIPTextModel with peft's LoRA of the same weights: tests/fixtures/text_lora, made by
//! scripts/make_text_lora_fixtures.py (torch 2.15, transformers 5.24, peft; outputs computed
//! in f64, stored in f32) over the tiny encoders of tests/fixtures/encoders.
//!
//! Tolerance: max |flame - peft| / max |peft| per tensor, 1e-4 in f32 on the CPU, as
//! tests/encoders.rs.
#![cfg(feature = "cpu-ref")]

mod common;

use common::check_rel as check;
use flame::encoders::{ClipConfig, ClipTextModel, SDXL_CLIP_G};
use flame::nn::adapter::{
    load_kohya_sets, load_peft_sets, save_kohya_sets, save_peft_sets, FileSet,
};
use flame::nn::{AdapterConfig, Adapters, KeyMap, KeySource};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

const CPU: Device = Device::Cpu;
const F32_TOL: f64 = 1e-4;

fn fixture(dir: &str, name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir)
        .join(name)
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture("text_lora", "outputs.safetensors"), &CPU).unwrap()
}

/// The fixture's LoRA: rank 4, alpha 4 (scale 1), on peft's CLIP targets.
fn lora_config() -> AdapterConfig {
    flame::nn::LoraConfig {
        rank: 4,
        alpha: 4.0,
        dropout: 0.0,
        targets: ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
            .iter()
            .map(|t| format!("*.{t}"))
            .collect(),
        seed: 7,
    }
    .into()
}

fn identity() -> KeyMap {
    Arc::new(|k: &str| Some(KeySource::Key(k.to_string())))
}

fn clip_config(name: &str) -> ClipConfig {
    let text = std::fs::read_to_string(fixture("encoders", name).join("config.json")).unwrap();
    ClipConfig::from_json(&serde_json::from_str(&text).unwrap(), None).unwrap()
}

/// Both encoders with fresh adapters: CLIP-L from its transformers folder, bigG from SDXL's
/// single file in OpenCLIP's layout (its fused in_proj split into q, k, v for the adapters).
fn adapted() -> (ClipTextModel, Arc<Adapters>, ClipTextModel, Arc<Adapters>) {
    let al = Adapters::new(lora_config()).unwrap();
    let ag = Adapters::new(lora_config()).unwrap();
    let (l, _) = ClipTextModel::load_adapted(
        fixture("encoders", "clip_l"),
        None,
        DType::F32,
        &CPU,
        None,
        Some(al.clone()),
    )
    .unwrap();
    let (g, _) = ClipTextModel::load_adapted(
        fixture("encoders", "sdxl_te.safetensors"),
        Some(SDXL_CLIP_G),
        DType::F32,
        &CPU,
        Some(clip_config("clip_g")),
        Some(ag.clone()),
    )
    .unwrap();
    (l, al, g, ag)
}

fn sets<'a>(l: &'a Adapters, g: &'a Adapters, map: &'a KeyMap) -> Vec<FileSet<'a>> {
    vec![
        FileSet {
            adapters: l,
            kohya: "lora_te1",
            peft: "text_encoder",
            map,
        },
        FileSet {
            adapters: g,
            kohya: "lora_te2",
            peft: "text_encoder_2",
            map,
        },
    ]
}

fn parity(name: &str, model: &ClipTextModel) {
    let io = outputs();
    let out = model.forward(&io[&format!("{name}.ids")], None).unwrap();
    let c = |what: &str, got: &Tensor| {
        check(
            &format!("{name} {what}"),
            got,
            &io[&format!("{name}.{what}")],
            F32_TOL,
        );
    };
    c("last_hidden", &out.last_hidden);
    c("penultimate", &out.penultimate);
    c("pooled", &out.pooled);
    if let Some(p) = &out.projected {
        c("projected", p);
    }
}

/// peft's LoRA on every attention and MLP Linear of both CLIPs, read from the diffusers
/// layout (`text_encoder.*`, `text_encoder_2.*`), gives transformers + peft's outputs; the
/// adapters are one per q, k and v projection, 12 a layer's worth of tensors as in the file.
#[test]
fn clip_lora_matches_peft() {
    let (l, al, g, ag) = adapted();
    assert_eq!(al.layers().unwrap().len(), 12, "6 Linears in each of 2 layers");
    assert!(al
        .layers()
        .unwrap()
        .iter()
        .any(|a| a.path() == "text_model.encoder.layers.0.self_attn.q_proj"));
    let map = identity();
    load_peft_sets(
        &sets(&al, &ag, &map),
        fixture("text_lora", "lora.safetensors"),
    )
    .unwrap();
    parity("clip_l", &l);
    parity("clip_g", &g);
}

/// Both layouts write and read back the two encoders' adapters in one file: kohya's
/// `lora_te1_*` / `lora_te2_*` names and diffusers' `text_encoder.*` / `text_encoder_2.*`,
/// each read into fresh adapters giving peft's outputs again; a file missing a set's
/// tensors, or holding another's, is refused.
#[test]
fn clip_lora_files_round_trip() {
    let (_, al, _, ag) = adapted();
    let map = identity();
    load_peft_sets(
        &sets(&al, &ag, &map),
        fixture("text_lora", "lora.safetensors"),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("flame-text-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kohya = dir.join("kohya.safetensors");
    let peft = dir.join("peft.safetensors");
    let meta = BTreeMap::new();
    save_kohya_sets(&sets(&al, &ag, &map), &kohya, DType::F32, &meta).unwrap();
    save_peft_sets(&sets(&al, &ag, &map), &peft, DType::F32, &meta).unwrap();
    let names: Vec<String> = flame::safetensors::SafeTensorsFile::open(&kohya)
        .unwrap()
        .names()
        .map(str::to_string)
        .collect();
    assert!(names.contains(
        &"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight".to_string()
    ));
    assert!(names.contains(&"lora_te2_text_model_encoder_layers_1_mlp_fc2.alpha".to_string()));
    for (path, kohya_layout) in [(&kohya, true), (&peft, false)] {
        let (l, al, g, ag) = adapted();
        let s = sets(&al, &ag, &map);
        match kohya_layout {
            true => load_kohya_sets(&s, path).unwrap(),
            false => load_peft_sets(&s, path).unwrap(),
        }
        parity("clip_l", &l);
        parity("clip_g", &g);
        // Only CLIP-L's set: bigG's tensors are left over.
        let e = match kohya_layout {
            true => load_kohya_sets(&s[..1], path),
            false => load_peft_sets(&s[..1], path),
        }
        .unwrap_err()
        .to_string();
        assert!(e.contains("no planned adapter takes it"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
