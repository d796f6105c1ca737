//! From a folder of images with captions to a LoRA, on the tiny example
//! (examples/flux-tiny.toml: tiny Flux, CLIP, T5 and autoencoder, generated pictures):
//! caching with reuse and per-caption invalidation, bucketed training with validation loss,
//! sample images and the loss plot in the run folder, an exact resume, a dry run that writes
//! nothing; LoRA files merged into a model's weights (kohya, PEFT, diffusers parts) equal to
//! the attached adapters; the `sample` binary.
#![cfg(feature = "cpu-ref")]

use flame::models::{self, LoadOptions};
use flame::nn::{Adapters, LoraConfig, LoraMerge};
use flame::train::rundir::read_log;
use flame::train::{Event, Prepare, RunEnd, RunOptions, TrainConfig, Trainer};
use flame::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-images-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The image example's config with its files under `dir`: `steps` steps, checkpoints,
/// validation and samples every `every`, on the CPU.
fn config(dir: &Path, steps: usize, every: usize) -> TrainConfig {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", &format!("save_every = {every}"))
        .replace("validate_every = 50", &format!("validate_every = {every}"))
        .replace("every = 100", &format!("every = {every}"))
        .replace("device = \"auto\"", "device = \"cpu\"")
        .replace("warmup_steps = 10", "warmup_steps = 2")
        // T5 streamed from host memory while captions are encoded (the same embeddings).
        .replace("t5_tokens = 32", "t5_tokens = 32\nstream_t5 = \"on\"");
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    let cfg = TrainConfig::from_file(p).unwrap();
    // The tiny model, encoders, autoencoder and pictures, as `train --make-tiny` makes them.
    flame::train::demo::make_tiny(&cfg).unwrap();
    cfg
}

fn open(cfg: &TrainConfig, prepare: Prepare) -> (Trainer, Vec<String>) {
    let mut notes = vec![];
    let t = Trainer::open(cfg.clone(), prepare, &mut |e| {
        if let Event::Note(n) = e {
            notes.push(n)
        }
    })
    .unwrap();
    (t, notes)
}

/// The largest difference of any channel of any pixel between two PNG files of one size.
fn worst_pixel(a: &Path, b: &Path) -> u8 {
    let (a, b) = (
        image::open(a).unwrap().to_rgb8(),
        image::open(b).unwrap().to_rgb8(),
    );
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap()
}

fn last_note<'a>(notes: &'a [String], what: &str) -> &'a str {
    notes
        .iter()
        .rev()
        .find(|n| n.starts_with(&format!("caching {what}:")))
        .map(String::as_str)
        .unwrap_or_else(|| panic!("no note on caching {what}: {notes:?}"))
}

#[test]
fn images_train_a_lora_with_validation_samples_and_a_plot() {
    let d = temp("run");
    let cfg = config(&d, 8, 4);
    let out = cfg.train.output_dir.clone();

    // A dry run writes no cache and no run folder.
    let (t, _) = open(&cfg, Prepare::DryRun);
    assert!(!out.exists(), "a dry run wrote {}", out.display());
    let desc = t.data().describe();
    assert!(
        desc.contains("images") && desc.contains("buckets"),
        "{desc}"
    );
    drop(t);

    let (mut t, notes) = open(&cfg, Prepare::Encode);
    let lat = last_note(&notes, "latents");
    assert!(lat.contains("0 reused"), "{lat}");
    // T5 streamed while the captions were encoded: its host side in the caching notes.
    let t5 = notes
        .iter()
        .find(|n| n.starts_with("t5 streamed while encoding: "))
        .unwrap_or_else(|| panic!("no note on the streamed T5: {notes:?}"));
    assert!(
        t5.contains(" blocks, ") && t5.contains(" s packing them") && !t5.contains(" 0 uploads"),
        "{t5}"
    );
    // 12 pictures, a fifth held out: every training view encoded (flips on: two each).
    let mut events = vec![];
    let end = t
        .run(&RunOptions::default(), &mut |e| events.push(e))
        .unwrap();
    assert!(matches!(end, RunEnd::Finished(_)), "{end:?}");
    let log = read_log(&out.join("loss.jsonl")).unwrap();
    let steps = log.iter().filter(|(_, l)| l.contains("\"loss\"")).count();
    let vals: Vec<usize> = log
        .iter()
        .filter(|(_, l)| l.contains("val_loss"))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!((steps, vals), (8, vec![4, 8]));
    let val_events = events
        .iter()
        .filter(|e| matches!(e, Event::Validation { loss, .. } if loss.is_finite()))
        .count();
    assert_eq!(val_events, 2);
    for step in [4, 8] {
        for i in 0..2 {
            let png = out.join(format!("samples/step-{step:07}-{i}.png"));
            let img = image::open(&png).unwrap();
            assert_eq!((img.width(), img.height()), (64, 64), "{}", png.display());
        }
    }
    assert!(image::open(out.join("loss.png")).is_ok());
    assert!(out.join("lora.safetensors").is_file());
    // Each phase's wall time, in the order first met: caching and the model's load as the
    // trainer opened, then the run's (a step's checkpoint before its optional phases).
    let names: Vec<&str> = t.phase_seconds().iter().map(|(p, _)| *p).collect();
    assert_eq!(
        names,
        [
            "caching",
            "loading the model",
            "training steps",
            "checkpoints",
            "validation",
            "sample images"
        ],
        "{:?}",
        t.phase_seconds()
    );
    assert!(
        t.phase_seconds()
            .iter()
            .all(|(_, s)| s.is_finite() && *s >= 0.0),
        "{:?}",
        t.phase_seconds()
    );

    // Opening again reuses every entry.
    let (_, notes) = open(&cfg, Prepare::Encode);
    for what in ["latents", "captions"] {
        let n = last_note(&notes, what);
        assert!(n.contains(" 0 encoded"), "{n}");
    }
    // One caption changed: that caption alone is encoded again; no latent is.
    let caption = d.join("tiny/images/picture-05.txt");
    std::fs::write(
        &caption,
        "a small green square on a black background, again",
    )
    .unwrap();
    let (_, notes) = open(&cfg, Prepare::Encode);
    assert!(last_note(&notes, "latents").contains(" 0 encoded"));
    let n = last_note(&notes, "captions");
    assert!(n.contains(" 1 encoded"), "{n}");
    // One image changed: only its views are encoded again.
    let png = d.join("tiny/images/picture-02.png");
    let mut img = image::open(&png).unwrap().to_rgb8();
    img.put_pixel(0, 0, image::Rgb([1, 2, 3]));
    img.save(&png).unwrap();
    let (_, notes) = open(&cfg, Prepare::Encode);
    let n = last_note(&notes, "latents");
    assert!(!n.contains(" 0 encoded"), "{n}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn an_interrupted_image_run_resumes_exactly() {
    let a = temp("full");
    let cfg = config(&a, 10, 5);
    open(&cfg, Prepare::Encode)
        .0
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let out = &cfg.train.output_dir;
    let full = read_log(&out.join("loss.jsonl")).unwrap();
    let lora = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();

    let b = temp("resumed");
    let cfg = config(&b, 10, 5);
    let stop = RunOptions {
        stop_at: Some(7),
        ..Default::default()
    };
    open(&cfg, Prepare::Encode)
        .0
        .run(&stop, &mut |_| {})
        .unwrap();
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    open(&cfg, Prepare::Encode)
        .0
        .run(&resume, &mut |_| {})
        .unwrap();
    let out = &cfg.train.output_dir;
    assert_eq!(read_log(&out.join("loss.jsonl")).unwrap(), full);
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

#[test]
fn bad_image_data_is_named() {
    let d = temp("bad");
    let cfg = config(&d, 2, 0);
    drop(open(&cfg, Prepare::DryRun)); // makes the tiny files
    let img = d.join("tiny/images/picture-03.png");
    std::fs::write(&img, b"not a png").unwrap();
    let e = Trainer::new(cfg.clone()).err().unwrap().to_string();
    assert!(e.contains("picture-03.png"), "{e}");
    // Skipped instead, with a note naming it.
    let mut skip = cfg.clone();
    skip.data.on_bad_file = flame::data::OnBadFile::Skip;
    let (_, notes) = open(&skip, Prepare::Encode);
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("skipped") && n.contains("picture-03.png")),
        "{notes:?}"
    );
    // Encoders the config does not point at, for a single-file model without them.
    let mut none = skip.clone();
    none.encoders.text.clear();
    let e = Trainer::new(none).err().unwrap().to_string();
    assert!(e.contains("encoders.text") && e.contains("clip_l"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

/// The tiny Flux with rank-4 LoRAs on `targets`, their B filled with random values.
fn tiny_with_adapters(
    model: &Path,
    targets: &[&str],
) -> (
    Box<dyn models::DiffusionModel>,
    Arc<Adapters>,
    flame::nn::KeyMap,
) {
    tiny_with_kind(model, targets, "lora")
}

/// The tiny Flux with rank-4 adapters of `kind` (LoRA or DoRA) on `targets`, their B filled
/// with random values.
fn tiny_with_kind(
    model: &Path,
    targets: &[&str],
    kind: &str,
) -> (
    Box<dyn models::DiffusionModel>,
    Arc<Adapters>,
    flame::nn::KeyMap,
) {
    let mut config = flame::nn::adapter::AdapterConfig::from(LoraConfig {
        rank: 4,
        alpha: 2.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed: 3,
    });
    config.kind = kind.into();
    let adapters = Adapters::new(config).unwrap();
    let mut opts = LoadOptions::new(DType::F32, &Device::Cpu).with_adapters(adapters.clone());
    opts.config = Some(flame::train::demo::flux_tiny_diffusers_config());
    let l = models::load("flux", model, &opts).unwrap();
    for (i, layer) in adapters.layers().unwrap().iter().enumerate() {
        let up = layer.params()[1].1.clone();
        let r = Tensor::randn(up.dims().to_vec(), DType::F32, &Device::Cpu, 40 + i as u64)
            .unwrap()
            .affine(0.2, 0.0)
            .unwrap();
        up.assign(&r).unwrap();
    }
    adapters.set_train(false);
    (l.model, adapters, l.key_map)
}

/// `adapters` saved under `d` in the kohya and the PEFT layouts: (kohya file, PEFT file).
fn save_both(adapters: &Adapters, map: &flame::nn::KeyMap, d: &Path) -> (PathBuf, PathBuf) {
    let kohya = d.join("kohya.safetensors");
    adapters.save_kohya(&kohya, DType::F32).unwrap();
    let peft = d.join("peft.safetensors");
    adapters
        .save_peft(&peft, map, "transformer", DType::F32)
        .unwrap();
    (kohya, peft)
}

fn predict(m: &dyn models::DiffusionModel) -> Vec<f32> {
    let dev = Device::Cpu;
    let x = Tensor::randn((1, 4, 8, 8), DType::F32, &dev, 1).unwrap();
    let t = Tensor::from_vec(vec![0.6f32], 1, &dev).unwrap();
    let ctx = Tensor::randn((1, 5, 32), DType::F32, &dev, 2).unwrap();
    let pooled = Tensor::randn((1, 16), DType::F32, &dev, 3).unwrap();
    m.predict(&x, &t, &[ctx, pooled], 3.5)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

fn merged(model: &Path, lora: &Path, strength: f64) -> flame::Result<Vec<f32>> {
    let mut opts = LoadOptions::new(DType::F32, &Device::Cpu);
    opts.config = Some(flame::train::demo::flux_tiny_diffusers_config());
    opts.merge = Some(Arc::new(LoraMerge::open(lora, strength, "transformer")?));
    Ok(predict(models::load("flux", model, &opts)?.model.as_ref()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// DoRA on fused layers (a double block's qkv, a single block's linear1, which diffusers
/// splits into parts): FLAME's kohya file (one `dora_scale` a layer) and its PEFT file (a
/// `lora_magnitude_vector` a diffusers part) merge into the weights the adapters compute with.
#[test]
fn dora_files_on_fused_layers_merge_as_the_adapters_compute() {
    let d = temp("merge-dora");
    let model = d.join("flux-tiny.safetensors");
    flame::train::demo::make_tiny_flux(&model).unwrap();
    let targets = ["double_blocks.*.img_attn.qkv", "single_blocks.*.linear1"];
    let (m, adapters, map) = tiny_with_kind(&model, &targets, "dora");
    let want = predict(m.as_ref());
    let (lora, ..) = tiny_with_kind(&model, &targets, "lora");
    assert!(
        max_diff(&predict(lora.as_ref()), &want) > 1e-4,
        "DoRA computes what LoRA does"
    );
    let (kohya, peft) = save_both(&adapters, &map, &d);
    let names = flame::safetensors::load(&peft, &Device::Cpu).unwrap();
    assert!(
        names.contains_key("transformer.transformer_blocks.0.attn.to_k.lora_magnitude_vector"),
        "{:?}",
        names.keys().collect::<Vec<_>>()
    );
    for f in [&kohya, &peft] {
        let e = max_diff(&merged(&model, f, 1.0).unwrap(), &want);
        assert!(e < 1e-5, "{}: {e}", f.display());
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn lora_files_merge_into_the_weights_as_the_adapters_compute() {
    let d = temp("merge");
    let model = d.join("flux-tiny.safetensors");
    flame::train::demo::make_tiny_flux(&model).unwrap();
    let targets = [
        "double_blocks.*.img_attn.qkv",
        "double_blocks.*.txt_mlp.0",
        "single_blocks.*.linear1",
        "final_layer.adaLN_modulation.1",
    ];
    let (m, adapters, map) = tiny_with_adapters(&model, &targets);
    let want = predict(m.as_ref());
    let base = {
        let mut o = LoadOptions::new(DType::F32, &Device::Cpu);
        o.config = Some(flame::train::demo::flux_tiny_diffusers_config());
        predict(models::load("flux", &model, &o).unwrap().model.as_ref())
    };
    assert!(max_diff(&base, &want) > 1e-3, "the adapters change nothing");

    let (kohya, peft) = save_both(&adapters, &map, &d);
    for f in [&kohya, &peft] {
        let got = merged(&model, f, 1.0).unwrap();
        let e = max_diff(&got, &want);
        assert!(e < 1e-5, "{}: {e}", f.display());
    }
    // Strength 0 is the base model.
    assert!(max_diff(&merged(&model, &kohya, 0.0).unwrap(), &base) < 1e-6);

    // PEFT names on the original keys (ai-toolkit, ComfyUI): kohya's tensors renamed.
    let t = flame::safetensors::load(&kohya, &Device::Cpu).unwrap();
    let mut renamed = vec![];
    for l in adapters.layers().unwrap() {
        let k = flame::nn::kohya_name(l.path());
        let s = adapters.config.alpha / adapters.config.rank as f64;
        let a = t[&format!("{k}.lora_down.weight")].clone();
        // No alpha stored: the scale is folded into B, as PEFT files do.
        let b = t[&format!("{k}.lora_up.weight")].affine(s, 0.0).unwrap();
        renamed.push((format!("diffusion_model.{}.lora_A.weight", l.path()), a));
        renamed.push((format!("diffusion_model.{}.lora_B.weight", l.path()), b));
    }
    let comfy = d.join("comfy.safetensors");
    flame::safetensors::save(renamed.iter().map(|(k, t)| (k.as_str(), t)), &comfy).unwrap();
    assert!(max_diff(&merged(&model, &comfy, 1.0).unwrap(), &want) < 1e-5);

    // diffusers parts with their own A each (what diffusers' own training writes for q, k, v):
    // the merged weight's rows of each part get that part's B A.
    let mut t = flame::safetensors::load(&peft, &Device::Cpu).unwrap();
    // Double block 0's image attention: diffusers' to_q, to_k, to_v of transformer_blocks.0.
    let k_a = "transformer.transformer_blocks.0.attn.to_k.lora_A.weight".to_string();
    assert!(t.contains_key(&k_a), "{:?}", t.keys().collect::<Vec<_>>());
    let other = Tensor::randn(t[&k_a].dims().to_vec(), DType::F32, &Device::Cpu, 9).unwrap();
    t.insert(k_a.clone(), other);
    let parts = d.join("parts.safetensors");
    flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), &parts).unwrap();
    let mut o = LoadOptions::new(DType::F32, &Device::Cpu);
    o.config = Some(flame::train::demo::flux_tiny_diffusers_config());
    let plain = models::load("flux", &model, &o).unwrap();
    o.merge = Some(Arc::new(
        LoraMerge::open(&parts, 1.0, "transformer").unwrap(),
    ));
    let with = models::load("flux", &model, &o).unwrap();
    let w = |l: &models::Loaded<dyn models::DiffusionModel>| {
        l.vb.params()
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == "double_blocks.0.img_attn.qkv.weight")
            .unwrap()
            .1
    };
    let (w0, w1) = (w(&plain), w(&with));
    let module = k_a.strip_suffix(".lora_A.weight").unwrap();
    let b = &t[&format!("{module}.lora_B.weight")];
    let delta = b.matmul(&t[&k_a]).unwrap();
    let rows = delta.dims()[0];
    // q, k, v rows in that order: k's rows are the second third.
    let got = w1
        .narrow(0, rows, rows)
        .unwrap()
        .sub(&w0.narrow(0, rows, rows).unwrap())
        .unwrap();
    let e = max_diff(
        &got.to_vec::<f32>().unwrap(),
        &delta.to_vec::<f32>().unwrap(),
    );
    assert!(e < 1e-5, "the k part's update: {e}");

    // A tensor no layer takes is an error naming it; text-encoder tensors are left alone.
    let mut t = flame::safetensors::load(&kohya, &Device::Cpu).unwrap();
    let stray = Tensor::zeros((4, 7), DType::F32, &Device::Cpu).unwrap();
    t.insert(
        "lora_unet_nowhere_layer.lora_down.weight".into(),
        stray.clone(),
    );
    t.insert("lora_te1_text_model_x.lora_down.weight".into(), stray);
    let f = d.join("stray.safetensors");
    flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), &f).unwrap();
    let e = merged(&model, &f, 1.0).unwrap_err().to_string();
    assert!(
        e.contains("lora_unet_nowhere_layer") && e.contains("1 of"),
        "{e}"
    );
    assert_eq!(
        LoraMerge::open(&f, 1.0, "transformer")
            .unwrap()
            .text_encoder_tensors(),
        ["lora_te1_text_model_x.lora_down.weight"]
    );
    // A misshapen one names the tensor and the shape the layer needs.
    let mut t = flame::safetensors::load(&kohya, &Device::Cpu).unwrap();
    let key = t
        .keys()
        .find(|k| k.ends_with("lora_up.weight"))
        .cloned()
        .unwrap();
    t.insert(
        key.clone(),
        Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap(),
    );
    flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), &f).unwrap();
    let e = merged(&model, &f, 1.0).unwrap_err().to_string();
    assert!(e.contains(&key) && e.contains("[3, 4]"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

/// The `sample` binary on the trained tiny example: one PNG per prompt, named by seed; the
/// same images as the run's own samples; bad arguments and foreign LoRAs named.
#[cfg(feature = "cli")]
#[test]
fn the_sample_binary_makes_images_with_a_lora() {
    use std::process::Command;
    let d = temp("sample-bin");
    let cfg = config(&d, 4, 4);
    open(&cfg, Prepare::Encode)
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
    let command = |extra: &[&str]| {
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
        c.args([
            "--t5-tokens",
            "32",
            "--width",
            "64",
            "--height",
            "64",
            "--steps",
            "8",
        ])
        .args(["--guidance", "3.5", "--seed", "1"])
        .args(extra);
        c
    };
    let run = |extra: &[&str]| command(extra).output().unwrap();
    let out = d.join("samples");
    let lora = cfg.train.output_dir.join("lora.safetensors");
    let o = run(&[
        "--prompt",
        "a large red circle on a white background",
        "--prompt",
        "a small blue square on a black background",
        "--lora",
        lora.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (i, seed) in [(0, 1), (1, 2)] {
        // Merged weights against attached adapters: equal up to f32 rounding through the
        // denoising steps and the 8-bit PNG.
        let worst = worst_pixel(
            &out.join(format!("{i}-{seed}.png")),
            &cfg.train
                .output_dir
                .join(format!("samples/step-0000004-{i}.png")),
        );
        assert!(worst <= 12, "image {i}: {worst}");
    }
    // 8-bit products (`--compute fp8`, `--compute int8`): the same picture within the codes'
    // rounding, which moves it (the CPU reference quantizes as the kernels do).
    for code in ["fp8", "int8"] {
        let eight = d.join(format!("samples-{code}"));
        let o = run(&[
            "--prompt",
            "a large red circle on a white background",
            "--lora",
            lora.to_str().unwrap(),
            "--compute",
            code,
            "--out",
            eight.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let a = image::open(eight.join("0-1.png")).unwrap().to_rgb8();
        let b = image::open(out.join("0-1.png")).unwrap().to_rgb8();
        let diffs: Vec<u8> = a
            .as_raw()
            .iter()
            .zip(b.as_raw())
            .map(|(x, y)| x.abs_diff(*y))
            .collect();
        let mean = diffs.iter().map(|&x| x as f64).sum::<f64>() / diffs.len() as f64;
        let worst = diffs.iter().copied().max().unwrap();
        println!("--compute {code} against f32: mean {mean:.2}, worst {worst} of 255");
        assert!(
            worst > 0 && mean < 4.0,
            "{code}: mean {mean}, worst {worst}"
        );
    }
    // Under a budget (`--budget`): the denoising planned within it, guidance's two
    // predictions batched where they fit, the same picture (on the CPU every plan computes
    // the same values); a budget no plan fits is refused, naming the flag and what the
    // smallest plan needs.
    let budgeted = d.join("samples-budget");
    let o = run(&[
        "--prompt",
        "a large red circle on a white background",
        "--lora",
        lora.to_str().unwrap(),
        "--budget",
        "0.5",
        "--out",
        budgeted.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("budget 0.50 GiB"), "{err}");
    let worst = worst_pixel(&budgeted.join("0-1.png"), &out.join("0-1.png"));
    assert!(worst <= 2, "--budget 0.5 against none: {worst}");
    // A decode that runs out of memory is tried again in tiles (the image fits one: the
    // same picture), with a note.
    let tiled = d.join("tiled");
    let o = command(&[
        "--prompt",
        "a large red circle on a white background",
        "--lora",
        lora.to_str().unwrap(),
        "--out",
        tiled.to_str().unwrap(),
    ])
    .env("FLAME_FAULT", "oom:decode")
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("note: the autoencoder ran out of memory decoding whole images"),
        "{err}"
    );
    assert_eq!(
        worst_pixel(&tiled.join("0-1.png"), &out.join("0-1.png")),
        0,
        "the retried decode"
    );
    let o = run(&[
        "--prompt",
        "x",
        "--budget",
        "0.01",
        "--out",
        d.join("never").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("--budget 0.01: no plan fits; the smallest"),
        "{err}"
    );
    assert!(!d.join("never").exists(), "{err}");
    let o = run(&["--compute", "int4", "--prompt", "x"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--compute int4"));
    let o = run(&["--steps", "0", "--prompt", "x"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--steps"));
    let o = run(&[
        "--prompt",
        "x",
        "--lora",
        t.join("vae/config.json").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    std::fs::remove_dir_all(&d).ok();
}

/// Every phase of a run from images has a plan and a predicted peak before anything is
/// cached, in the order the run meets them; a phase predicted past the budget (here sample
/// images far larger than the training pictures) is said at open, naming the knob, while a
/// run whose phases fit says nothing.
#[test]
fn every_phase_is_planned_and_one_past_the_budget_is_said() {
    let d = temp("phase-plans");
    let mut cfg = config(&d, 4, 2);
    cfg.memory.budget_gb = 0.3;
    let (t, notes) = open(&cfg, Prepare::DryRun);
    let names: Vec<&str> = t.phase_plans().iter().map(|p| p.phase).collect();
    assert_eq!(
        names,
        [
            "caching",
            "training steps",
            "validation",
            "sample images",
            "checkpoints"
        ]
    );
    assert!(
        t.phase_plans().iter().all(|p| p.peak.is_some()),
        "{:?}",
        t.phase_plans()
    );
    let peak = |name: &str| {
        t.phase_plans()
            .iter()
            .find(|p| p.phase == name)
            .and_then(|p| p.peak)
            .unwrap()
    };
    let step = t.memory.predicted_peak.unwrap();
    assert_eq!(peak("training steps"), step);
    // The step's peak by its terms, as `--plan` prints it: they add up to it.
    let terms = t.memory.peak_terms().expect("the step's peak by its terms");
    assert_eq!(terms.total(), step);
    assert!(
        terms.weights > 0 && terms.adapters > 0 && terms.fixed > 0,
        "{terms:?}"
    );
    assert!(peak("validation") <= step && peak("checkpoints") < step);
    assert!(
        notes.iter().all(|n| !n.contains("may not fit")),
        "{notes:?}"
    );
    drop(t);

    cfg.sample.size = [1024, 1024];
    let (t, notes) = open(&cfg, Prepare::DryRun);
    let sample = t.phase_plans()[3].clone();
    assert!(sample.plan.contains("1024x1024"), "{sample:?}");
    assert!(
        sample.peak.unwrap() > (0.3 * (1u64 << 30) as f64) as u64,
        "{sample:?}"
    );
    let said = notes
        .iter()
        .find(|n| n.starts_with("sample images may not fit memory.budget_gb"))
        .unwrap_or_else(|| panic!("{notes:?}"));
    assert!(said.contains("sample.size"), "{said}");
    std::fs::remove_dir_all(&d).ok();
}

/// The text encoders' "auto" streaming weighs the run's budget as the driver counts it
/// (`images::driver_budget`: `memory.budget_gb`, or on a GPU the memory free at start): T5
/// streams where the text encoders' weights and `ENCODE_RESERVE` do not fit it, and not
/// without a budget; trained beside the model, where it takes more than half of it.
#[test]
fn auto_streaming_weighs_the_runs_budget() {
    use flame::models::pipeline::weight_bytes;
    use flame::train::config::Toggle;
    use flame::train::images::{
        driver_budget, locate, text_options, training_text_options, ENCODE_RESERVE,
    };
    let d = temp("auto-stream");
    let mut cfg = config(&d, 4, 2);
    cfg.encoders.stream_t5 = Toggle::Auto;
    let family = models::family(&cfg.model.arch).unwrap();
    let (text_at, _) = locate(&cfg, family).unwrap();
    let streams =
        |budget: Option<u64>| text_options(&cfg, family, &text_at, true, budget).stream_t5;
    // The tiny encoders and the reserve fit a TiB, not a byte; exactly their sum fits.
    assert!(streams(Some(1)));
    assert!(!streams(Some(1 << 40)));
    assert!(!streams(None));
    let whole: u64 = text_at.iter().map(|(w, _)| weight_bytes(&w.path)).sum();
    assert!(whole > 0);
    assert!(!streams(Some(whole + ENCODE_RESERVE)));
    assert!(streams(Some(whole + ENCODE_RESERVE - 1)));
    // Trained beside the model, T5 streams where it takes more than half of the budget.
    let t5 = family
        .pipeline
        .text
        .iter()
        .zip(&text_at)
        .find(|(slot, _)| matches!(slot.kind, flame::models::pipeline::TextEncoderKind::T5))
        .map(|(_, (w, _))| weight_bytes(&w.path))
        .unwrap();
    let training =
        |budget: u64| training_text_options(&cfg, family, &text_at, true, Some(budget)).stream_t5;
    assert!(training(2 * t5 - 1) && !training(2 * t5 + 1));
    // On the CPU the budget is memory.budget_gb as given, none where 0.
    assert_eq!(driver_budget(&cfg, &Device::Cpu).unwrap(), None);
    cfg.memory.budget_gb = 0.5;
    assert_eq!(driver_budget(&cfg, &Device::Cpu).unwrap(), Some(1 << 29));
    cfg.encoders.stream_t5 = Toggle::Off;
    assert!(!text_options(&cfg, family, &text_at, true, Some(1)).stream_t5);
    std::fs::remove_dir_all(&d).ok();
}

/// A write of a sample image that fails at the run's last step (a full disk): the run
/// exits non-zero naming the phase, what to look at and `--resume`, with the final adapter
/// and the step's checkpoint written; `--resume` then makes the missing images without
/// training again or repeating the validation.
#[cfg(feature = "cli")]
#[test]
fn a_failed_sample_phase_loses_nothing_and_resume_does_only_what_is_missing() {
    use std::process::Command;
    let d = temp("phase-fails");
    let cfg = config(&d, 2, 2);
    let out = cfg.train.output_dir.clone();
    let run = |fault: Option<&str>, args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_train"));
        c.arg(d.join("train.toml")).args(args);
        match fault {
            Some(f) => c.env("FLAME_FAULT", f),
            None => c.env_remove("FLAME_FAULT"),
        };
        c.output().unwrap()
    };
    let o = run(Some("enospc:write:step-0000002-1.png"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("sample images"), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    for said in ["disk space", "--resume"] {
        assert!(err.contains(said), "{said}: {err}");
    }
    assert!(
        !err.contains("sample.size"),
        "memory knobs for a full disk: {err}"
    );
    assert!(!err.contains("done:"), "{err}");
    assert!(out.join("lora.safetensors").is_file(), "{err}");
    assert!(out.join("checkpoint-0000002").is_dir(), "{err}");
    assert!(out.join("samples/step-0000002-0.png").is_file(), "{err}");
    assert!(!out.join("samples/step-0000002-1.png").exists(), "{err}");
    let log = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    let count = |log: &str, what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(
        (count(&log, "\"loss\""), count(&log, "val_loss")),
        (2, 1),
        "{log}"
    );
    let lora = std::fs::read(out.join("lora.safetensors")).unwrap();

    let o = run(None, &["--resume"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(out.join("samples/step-0000002-1.png").is_file(), "{err}");
    let after = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    assert_eq!(
        (count(&after, "\"loss\""), count(&after, "val_loss")),
        (2, 1),
        "trained or validated again: {after}"
    );
    assert_eq!(
        std::fs::read(out.join("lora.safetensors")).unwrap(),
        lora,
        "the adapter changed"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// A sample image's decode that runs out of memory is tried again in tiles, said in a note,
/// and the run goes on (exit 0, every image written); at the smallest tile (128 pixels) it
/// fails the sample phase, naming it, with the adapter saved. (`FLAME_FAULT=oom:decode`
/// makes the first decode fail as out of memory.)
#[test]
fn a_decode_out_of_memory_is_tried_again_in_tiles() {
    use std::process::Command;
    let d = temp("decode-oom");
    let cfg = config(&d, 2, 2);
    let out = cfg.train.output_dir.clone();
    let toml = d.join("train.toml");
    let run = |fault: &str, config: &Path| {
        Command::new(env!("CARGO_BIN_EXE_train"))
            .arg(config)
            .env("FLAME_FAULT", fault)
            .output()
            .unwrap()
    };
    let o = run("oom:decode", &toml);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("ran out of memory decoding whole images")
            && err.contains("decoding again in 512-pixel tiles"),
        "{err}"
    );
    for i in 0..2 {
        assert!(
            out.join(format!("samples/step-0000002-{i}.png")).is_file(),
            "{err}"
        );
    }
    // At the smallest tile there is nothing smaller to try.
    let small = d.join("small.toml");
    let text = std::fs::read_to_string(&toml)
        .unwrap()
        .replace("stream_t5 = \"on\"", "stream_t5 = \"on\"\nvae_tile = 128")
        .replace(
            "output_dir = \"tiny/out\"",
            "output_dir = \"tiny/small-out\"",
        );
    assert!(
        text.contains("vae_tile = 128") && text.contains("tiny/small-out"),
        "{text}"
    );
    std::fs::write(&small, text).unwrap();
    let o = run("oom:decode", &small);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("sample images") && err.contains("out of GPU memory"),
        "{err}"
    );
    assert!(
        out.with_file_name("small-out")
            .join("lora.safetensors")
            .is_file(),
        "{err}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Validation and sample images under a plan that streams blocks: a forward without
/// gradients releases each streamed block as it leaves it (a recording forward keeps its last
/// ones for the backward), so none stays through the samples' decode; the next step fetches
/// what it needs. The run's losses, validation losses and pictures are those of the run with
/// every block resident.
#[test]
fn validation_and_samples_between_streamed_steps_leave_the_run_as_resident() {
    use flame::memory::Checkpointing;
    use flame::train::config::CheckpointSetting;
    let run = |name: &str, streamed: bool| {
        let d = temp(name);
        let mut cfg = config(&d, 4, 2);
        if streamed {
            cfg.memory.checkpointing = CheckpointSetting::Fixed(Checkpointing::All);
            cfg.memory.stream_blocks = 2;
            cfg.memory.prefetch = 1;
        }
        let (mut t, _) = open(&cfg, Prepare::Encode);
        t.run(&RunOptions::default(), &mut |_| {}).unwrap();
        (cfg, t.stream_report().unwrap())
    };
    let (resident, none) = run("streamed-phases-resident", false);
    assert!(none.is_none());
    let (streamed, report) = run("streamed-phases", true);
    let report = report.expect("blocks streamed");
    // Four training forwards, two validations' and two samples' denoising forwards; the run
    // ends with sample images, after which no streamed block is left on the device.
    assert!(report.forwards > 8, "{report:?}");
    assert_eq!(report.resident, 0, "{report:?}");
    let values = |cfg: &TrainConfig, key: &str| -> Vec<f64> {
        read_log(&cfg.train.output_dir.join("loss.jsonl"))
            .unwrap()
            .iter()
            .filter_map(|(_, l)| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()[key].as_f64()
            })
            .collect()
    };
    for key in ["loss", "val_loss"] {
        let (a, b) = (values(&streamed, key), values(&resident, key));
        assert!(!a.is_empty() && a.len() == b.len(), "{key}: {a:?} {b:?}");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{key}: {x} against {y}");
        }
    }
    for step in [2, 4] {
        let png = |cfg: &TrainConfig| {
            cfg.train
                .output_dir
                .join(format!("samples/step-{step:07}-0.png"))
        };
        let worst = worst_pixel(&png(&streamed), &png(&resident));
        assert!(worst <= 2, "step {step}: {worst}");
    }
}
