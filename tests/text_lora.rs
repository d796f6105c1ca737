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
use flame::train::rundir::read_log;
use flame::train::{Event, Prepare, RunOptions, TrainConfig, Trainer};
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
    assert_eq!(
        al.layers().unwrap().len(),
        12,
        "6 Linears in each of 2 layers"
    );
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

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-te-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny image example (examples/flux-tiny.toml) under `dir` with CLIP-L trained beside
/// the model: `steps` steps, checkpoints, validation and samples every `every`, on the CPU,
/// the adapter written in `format`.
fn flux_config(dir: &std::path::Path, steps: usize, every: usize, format: &str) -> TrainConfig {
    flux_config_with(dir, steps, every, format, "[\"clip_l\"]")
}

/// [`flux_config`] with the encoders `encoders` (a TOML list) trained.
fn flux_config_with(
    dir: &std::path::Path,
    steps: usize,
    every: usize,
    format: &str,
    encoders: &str,
) -> TrainConfig {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", &format!("save_every = {every}"))
        .replace("validate_every = 50", &format!("validate_every = {every}"))
        .replace("every = 100", &format!("every = {every}"))
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 2")
        .replace(
            "format = \"kohya\"",
            &format!("format = \"{format}\"\ntext_encoders = {encoders}"),
        );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(p).unwrap();
    flame::train::demo::make_tiny(&cfg).unwrap();
    cfg
}

fn open(cfg: &TrainConfig) -> (Trainer, Vec<String>) {
    let mut notes = vec![];
    let t = Trainer::open(cfg.clone(), Prepare::Encode, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })
    .unwrap();
    (t, notes)
}

fn host(params: &[(String, Tensor)]) -> Vec<(String, Vec<f64>)> {
    params
        .iter()
        .map(|(n, t)| (n.clone(), t.to_vec_f64().unwrap()))
        .collect()
}

/// Flux with CLIP-L's LoRA trained beside the model's: T5's `context` still read from the
/// cache, CLIP-L's `pooled` encoded every step; the encoder's adapter moves; the kohya file
/// holds `lora_te1_*` beside `lora_unet_*` (with kohya's metadata of a run that trains the
/// text encoder); a run stopped at step 4 and resumed ends with the same log and file as one
/// run straight through.
#[test]
fn flux_clip_lora_trains_and_resumes_exactly() {
    let a = temp("full");
    let cfg = flux_config(&a, 6, 3, "kohya");
    let (mut t, notes) = open(&cfg);
    let said = notes
        .iter()
        .find(|n| n.starts_with("text encoders:"))
        .unwrap_or_else(|| panic!("{notes:?}"));
    assert!(
        said.contains("clip_l trained")
            && said.contains("t5 cached")
            && said.contains("[\"pooled\"]"),
        "{said}"
    );
    let lists = t.param_lists().unwrap();
    assert_eq!(
        lists.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        ["model", "text_encoders"]
    );
    let before = host(&lists[1].1);
    assert!(
        before[0]
            .0
            .starts_with("lora_te1.text_model.encoder.layers."),
        "{}",
        before[0].0
    );
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let after = host(&t.param_lists().unwrap()[1].1);
    let moved = before
        .iter()
        .zip(&after)
        .filter(|((_, x), (_, y))| x != y)
        .count();
    assert_eq!(
        moved,
        before.len(),
        "every tensor of CLIP-L's adapters trains"
    );
    let out = &cfg.train.output_dir;
    let file = flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors")).unwrap();
    let names: Vec<&str> = file.names().collect();
    assert!(names.iter().any(|n| n.starts_with("lora_unet_")));
    assert!(names.contains(&"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"));
    assert_eq!(
        file.metadata()
            .get("ss_network_train_unet_only")
            .map(String::as_str),
        Some("False")
    );
    let full = read_log(&out.join("loss.jsonl")).unwrap();
    let lora = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();
    drop(t);

    let b = temp("resumed");
    let cfg = flux_config(&b, 6, 3, "kohya");
    let stop = RunOptions {
        stop_at: Some(4),
        ..Default::default()
    };
    open(&cfg).0.run(&stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    open(&cfg).0.run(&resume, &mut |_| {}).unwrap();
    let out = &cfg.train.output_dir;
    assert_eq!(read_log(&out.join("loss.jsonl")).unwrap(), full);
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// The PEFT layout: the model's adapters under `transformer.` and CLIP-L's under
/// `text_encoder.` in transformers' module names, read back by a resume.
#[test]
fn flux_clip_lora_in_the_peft_layout() {
    let d = temp("peft");
    let cfg = flux_config(&d, 2, 1, "peft");
    open(&cfg)
        .0
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let out = &cfg.train.output_dir;
    let file = flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors")).unwrap();
    let names: Vec<&str> = file.names().collect();
    assert!(names.iter().any(|n| n.starts_with("transformer.")));
    assert!(names.contains(&"text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_A.weight"));
    // A checkpoint in that layout reads back.
    let mut t = open(&cfg).0;
    let ckpt = out.join("checkpoint-0000001");
    let ckpt = if ckpt.is_dir() {
        ckpt
    } else {
        std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("checkpoint-")
            })
            .unwrap()
    };
    t.load_checkpoint(&ckpt).unwrap();
    std::fs::remove_dir_all(&d).ok();
}

/// What is refused, naming the key: a negative text-encoder rate, a name that is no
/// encoder's, one the family lacks, another trainer's layout.
#[test]
fn text_encoder_settings_are_checked() {
    let d = temp("bad");
    let cfg = flux_config(&d, 2, 1, "kohya");
    let mut c = cfg.clone();
    c.optimizer.text_encoder_lr = Some(-1e-5);
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("optimizer.text_encoder_lr"), "{e}");
    let mut c = cfg.clone();
    c.optimizer.text_encoder_lr = Some(1e-5);
    c.validate().unwrap();
    let mut c = cfg.clone();
    c.adapter.text_encoders = vec!["bert".into()];
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("adapter.text_encoders") && e.contains("bert"),
        "{e}"
    );
    let mut c = cfg.clone();
    c.adapter.text_encoders = vec!["t5".into()];
    c.validate().unwrap();
    let mut c = cfg.clone();
    c.adapter.format = flame::train::config::AdapterFormat::Musubi;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("adapter.text_encoders"), "{e}");
    let mut c = cfg.clone();
    c.adapter.text_encoders = vec!["qwen3".into()];
    let e = Trainer::new(c).err().unwrap().to_string();
    assert!(e.contains("qwen3") && e.contains("clip_l, t5"), "{e}");
    let mut c = cfg.clone();
    c.adapter.text_encoders = vec!["clip_g".into()];
    let e = Trainer::new(c).err().unwrap().to_string();
    assert!(e.contains("clip_g") && e.contains("clip_l, t5"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

/// diffusers' `load_lora_weights` reads FLAME's PEFT-layout file of both encoders' adapters
/// into a tiny SDXL pipeline, every tensor taken, and its encoders give peft's outputs
/// (scripts/check_text_lora_diffusers.py, exit 0).
#[test]
#[ignore = "needs Python with torch, transformers, diffusers and peft (FLAME_PYTHON, default python3)"]
fn diffusers_loads_the_text_encoder_lora() {
    let (_, al, _, ag) = adapted();
    let map = identity();
    load_peft_sets(
        &sets(&al, &ag, &map),
        fixture("text_lora", "lora.safetensors"),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("flame-te-diffusers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lora.safetensors");
    save_peft_sets(&sets(&al, &ag, &map), &file, DType::F32, &BTreeMap::new()).unwrap();
    let python = std::env::var("FLAME_PYTHON").unwrap_or_else(|_| "python3".into());
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_text_lora_diffusers.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Flux with T5's LoRA trained beside the model's: T5's `context` encoded every step, CLIP-L's
/// `pooled` read from the cache; every tensor of T5's adapters moves, on kohya's T5 Linears
/// (q, k, v, o, wi_0, wi_1, wo); the kohya file holds `lora_te3_*` (sd-scripts' T5 prefix);
/// a run stopped at step 4 and resumed ends with the same log and file as one run straight
/// through.
#[test]
fn flux_t5_lora_trains_and_resumes_exactly() {
    let a = temp("t5-full");
    let cfg = flux_config_with(&a, 6, 3, "kohya", "[\"t5\"]");
    let (mut t, notes) = open(&cfg);
    let said = notes
        .iter()
        .find(|n| n.starts_with("text encoders:"))
        .unwrap_or_else(|| panic!("{notes:?}"));
    assert!(
        said.contains("t5 trained (14 adapters)")
            && said.contains("clip_l cached")
            && said.contains("[\"context\"]"),
        "{said}"
    );
    let lists = t.param_lists().unwrap();
    let before = host(&lists[1].1);
    assert!(
        before
            .iter()
            .all(|(n, _)| n.starts_with("lora_te3.encoder.block.")),
        "{}",
        before[0].0
    );
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let after = host(&t.param_lists().unwrap()[1].1);
    let moved = before
        .iter()
        .zip(&after)
        .filter(|((_, x), (_, y))| x != y)
        .count();
    assert_eq!(moved, before.len(), "every tensor of T5's adapters trains");
    let out = &cfg.train.output_dir;
    let file = flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors")).unwrap();
    let names: Vec<&str> = file.names().collect();
    assert!(names.iter().any(|n| n.starts_with("lora_unet_")));
    for k in [
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight",
        "lora_te3_encoder_block_1_layer_1_DenseReluDense_wi_1.lora_down.weight",
        "lora_te3_encoder_block_1_layer_1_DenseReluDense_wo.alpha",
    ] {
        assert!(names.contains(&k), "{k} not in {names:?}");
    }
    let full = read_log(&out.join("loss.jsonl")).unwrap();
    let lora = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();
    drop(t);

    let b = temp("t5-resumed");
    let cfg = flux_config_with(&b, 6, 3, "kohya", "[\"t5\"]");
    let stop = RunOptions {
        stop_at: Some(4),
        ..Default::default()
    };
    open(&cfg).0.run(&stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    open(&cfg).0.run(&resume, &mut |_| {}).unwrap();
    let out = &cfg.train.output_dir;
    assert_eq!(read_log(&out.join("loss.jsonl")).unwrap(), full);
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// T5's adapters in the PEFT layout: under `text_encoder_2.` (Flux's T5 folder) in
/// transformers' module names, and a checkpoint in that layout reads back into a fresh run
/// with the trained values.
#[test]
fn flux_t5_lora_in_the_peft_layout_round_trips() {
    let d = temp("t5-peft");
    let cfg = flux_config_with(&d, 2, 2, "peft", "[\"t5\"]");
    let mut t = open(&cfg).0;
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let trained = host(&t.param_lists().unwrap()[1].1);
    drop(t);
    let out = &cfg.train.output_dir;
    let file = flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors")).unwrap();
    let names: Vec<&str> = file.names().collect();
    assert!(names.iter().any(|n| n.starts_with("transformer.")));
    assert!(
        names.contains(&"text_encoder_2.encoder.block.0.layer.1.DenseReluDense.wi_0.lora_A.weight"),
        "{names:?}"
    );
    let mut t = open(&cfg).0;
    assert_ne!(host(&t.param_lists().unwrap()[1].1), trained);
    t.load_checkpoint(&out.join("checkpoint-0000002")).unwrap();
    assert_eq!(host(&t.param_lists().unwrap()[1].1), trained);
    std::fs::remove_dir_all(&d).ok();
}

/// The memory plan counts a trained encoder: with T5 trained the step's predicted peak grows
/// by exactly what the plan says T5 holds, and that is T5's own bytes: its weight file, its
/// adapters' values (and gradients, as much again), AdamW's two f32 moments a value, and
/// the activations its backward keeps (`kept_values` of its sizes, batch and tokens).
#[test]
fn the_plan_counts_a_trained_encoder() {
    let d = temp("plan");
    let step_peak = |t: &Trainer| {
        t.phase_plans()
            .iter()
            .find(|p| p.phase == "training steps")
            .and_then(|p| p.peak)
            .unwrap()
    };
    let mut cfg = flux_config_with(&d, 2, 2, "kohya", "[]");
    cfg.adapter.text_encoders = vec![];
    let (t, _) = open(&cfg);
    assert!(t.memory.text.is_none());
    let base = step_peak(&t);
    drop(t);
    cfg.adapter.text_encoders = vec!["t5".into()];
    let (t, _) = open(&cfg);
    let with = step_peak(&t);
    let text = t.memory.text.clone().unwrap();
    assert_eq!(with - base, text.total());
    assert!(
        t.memory.describe().contains("trained text encoders"),
        "{}",
        t.memory.describe()
    );
    // T5's weight file on the device (not streamed on the CPU without a budget).
    let folder = d.join("tiny/text_encoder_2");
    let file_bytes: u64 = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(text.weights, file_bytes);
    assert_eq!(text.encoders, vec![("t5", file_bytes)]);
    // The adapters, f32, and AdamW's state (8 bytes a value).
    let values: usize = t.param_lists().unwrap()[1]
        .1
        .iter()
        .map(|(_, x)| x.elem_count())
        .sum();
    assert_eq!(text.trainable, (values * 4) as u64);
    assert_eq!(text.optimizer, (values * 8) as u64);
    // The tiny T5 as its config says, 32 tokens a caption, the batch, f32.
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
            .unwrap();
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let dims = flame::models::pipeline::EncoderDims {
        width: n("d_model"),
        attention: n("num_heads") * n("d_kv"),
        mlp: n("d_ff"),
        layers: n("num_layers"),
        heads: n("num_heads"),
        gated: true,
    };
    let kept = flame::train::text::kept_values(&dims, 32, false);
    assert_eq!(text.activations, (kept * cfg.train.batch_size * 4) as u64);
    std::fs::remove_dir_all(&d).ok();
}

/// The `sample` binary applies a file's text-encoder adapters: with CLIP-L's and T5's LoRA
/// trained, its images equal the run's own samples (merged weights against attached
/// adapters, through the 8-bit PNG), and the file's encoder part is applied (made larger, it
/// changes the images); a file whose text-encoder tensor no encoder takes is refused
/// naming it.
#[test]
fn the_sample_binary_applies_text_encoder_adapters() {
    use std::process::Command;
    let d = temp("sample");
    let mut cfg = flux_config_with(&d, 2, 2, "kohya", "[\"clip_l\", \"t5\"]");
    cfg.optimizer.text_encoder_lr = Some(3e-2);
    open(&cfg)
        .0
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let t = d.join("tiny");
    let json = d.join("flux-tiny.json");
    std::fs::write(
        &json,
        flame::train::demo::flux_tiny_diffusers_config().to_string(),
    )
    .unwrap();
    let run = |lora: &std::path::Path, out: &std::path::Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sample"));
        c.args(["--arch", "flux", "--device", "cpu", "--dtype", "f32"])
            .arg("--model")
            .arg(t.join("flux-tiny.safetensors"))
            .arg("--config")
            .arg(&json);
        for (flag, p) in [
            ("--text-encoder", "text_encoder"),
            ("--text-encoder", "text_encoder_2"),
            ("--tokenizer", "tokenizer"),
            ("--tokenizer", "tokenizer_2"),
            ("--vae", "vae"),
        ] {
            c.arg(flag).arg(t.join(p));
        }
        c.args(["--t5-tokens", "32", "--width", "64", "--height", "64"])
            .args(["--steps", "8", "--guidance", "3.5", "--seed", "1"])
            .args([
                "--prompt",
                "a large red circle on a white background",
                "--prompt",
                "a small blue square on a black background",
            ])
            .arg("--lora")
            .arg(lora)
            .arg("--out")
            .arg(out);
        c.output().unwrap()
    };
    let png = |p: std::path::PathBuf| image::open(&p).unwrap().to_rgb8().into_raw();
    let worst = |a: &[u8], b: &[u8]| a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
    let lora = cfg.train.output_dir.join("lora.safetensors");
    let out = d.join("samples");
    let o = run(&lora, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("text-encoder tensors merged"), "{said}");
    for (i, seed) in [(0, 1), (1, 2)] {
        let a = png(out.join(format!("{i}-{seed}.png")));
        let b = png(cfg
            .train
            .output_dir
            .join(format!("samples/step-0000002-{i}.png")));
        assert!(worst(&a, &b) <= 12, "image {i}: {}", worst(&a, &b));
    }
    // The encoders' part is what changes them: the same file with the encoders' lora_up
    // a thousand times larger gives other images.
    let file = flame::safetensors::load(&lora, &Device::Cpu).unwrap();
    let louder = d.join("louder.safetensors");
    let scaled: Vec<(String, Tensor)> = file
        .iter()
        .map(|(k, v)| {
            let up = k.starts_with("lora_te") && k.ends_with(".lora_up.weight");
            (
                k.clone(),
                if up {
                    v.affine(1e3, 0.0).unwrap()
                } else {
                    v.clone()
                },
            )
        })
        .collect();
    flame::safetensors::save(scaled.iter().map(|(k, v)| (k.as_str(), v)), &louder).unwrap();
    let out2 = d.join("samples-louder");
    let o = run(&louder, &out2);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut differs = 0;
    for (i, seed) in [(0, 1), (1, 2)] {
        let a = png(out.join(format!("{i}-{seed}.png")));
        let c = png(out2.join(format!("{i}-{seed}.png")));
        differs = differs.max(worst(&a, &c));
    }
    assert!(
        differs > 12,
        "the encoders' adapters change nothing ({differs})"
    );
    // A text-encoder tensor no encoder of Flux takes (a third CLIP's), named.
    let stray = "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight";
    let bad = d.join("stray.safetensors");
    let x = Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap();
    flame::safetensors::save(
        file.iter()
            .map(|(k, v)| (k.as_str(), v))
            .chain([(stray, &x)]),
        &bad,
    )
    .unwrap();
    let o = run(&bad, &d.join("samples-bad"));
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains(stray), "{e}");
    std::fs::remove_dir_all(&d).ok();
}
