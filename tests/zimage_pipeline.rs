//! The Z-Image pipeline end to end against diffusers' `ZImagePipeline` on a tiny random
//! pipeline folder: captions to the transformer's text inputs ([`TextConditioner`]), the
//! sampler's trajectory with and without classifier-free guidance, the decoded image, and
//! the `sample` binary from the same starting latents. Fixtures (tests/fixtures/zimage_pipeline,
//! 2.0 MB) are made by scripts/make_zimage_pipeline_fixtures.py with diffusers 0.42.1 /
//! transformers 5.24.0 in f32 on the CPU.
//!
//! Guidance: diffusers' Z-Image computes pos + g (pos - neg) and guides when g > 0; FLAME's
//! sampler computes neg + s (pos - neg) and guides when s > 1, the same prediction at
//! s = g + 1 (docs/SAMPLING.md). The pipeline's `cfg_normalization` and `cfg_truncation`
//! are FLAME's [`CfgOptions`], checked on the "cfg" case with each on and with both.
//!
//! Tolerance: max |flame - diffusers| / max |diffusers|, [`TOL`].
#![cfg(feature = "cpu-ref")]

mod common;

use common::check_rel;
use flame::models::pipeline::{conditioning, load_vae};
use flame::models::{
    self, family, LoadOptions, SampleSetup, Sources, TextConditioner, TextOptions,
};
use flame::sample::{denoise, generate_from, CfgOptions, Guidance, Request, StepInfo};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;

/// f32 against diffusers' f32 (both round differently: the same network, other summation
/// orders). Measured on the CPU: text 5.4e-7, trajectories 2.1e-6 (turbo) and 1.5e-6
/// (CFG; with cfg_normalization 1.3e-6, cfg_truncation 8.3e-7, both 9.1e-7), images 8.9e-7.
const TOL: f64 = 1e-5;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zimage_pipeline")
}

fn pipeline() -> PathBuf {
    dir().join("pipeline")
}

fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap()
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(dir().join("outputs.safetensors"), &CPU).unwrap()
}

fn conditioner() -> TextConditioner {
    let fam = family("zimage").unwrap();
    let (text, _vae) = Sources::default()
        .locate(fam, &pipeline(), ["text", "tokenizers", "vae"])
        .unwrap();
    TextConditioner::load(
        fam,
        &text,
        &TextOptions::default(),
        DType::F32,
        &CPU,
        "encoders",
    )
    .unwrap()
}

/// `ZImagePipeline.encode_prompt` for three captions (22, 16 and 71 tokens in their chat
/// prompts) in one batch: the context (B, 512, 32) holds each caption's hidden states
/// then padding, the mask 1 over the caption's tokens.
#[test]
fn conditioning_matches_diffusers() {
    let c = cases();
    let io = outputs();
    let captions: Vec<&str> = c["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let got = conditioner().encode(&captions).unwrap();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["context", "context_mask"]);
    let (ctx, mask) = (&got[0].1, &got[1].1);
    assert_eq!(ctx.dims(), [3, 512, 32]);
    assert_eq!(mask.dims(), [3, 512]);
    for (i, n) in c["tokens"].as_array().unwrap().iter().enumerate() {
        let n = n.as_u64().unwrap() as usize;
        let m = mask.narrow(0, i, 1).unwrap().to_vec_f64().unwrap();
        let want_mask: Vec<f64> = (0..512).map(|j| f64::from(u8::from(j < n))).collect();
        assert_eq!(m, want_mask, "caption {i}: mask");
        let rows = ctx.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
        let rows = rows.narrow(0, 0, n).unwrap();
        check_rel(
            &format!("caption {i} ({n} tokens): hidden_states[-2]"),
            &rows,
            &io[&format!("encode_prompt.{i}")],
            TOL,
        );
    }
}

/// One case of cases.json.
struct Case {
    name: &'static str,
    prompt: String,
    negative: String,
    guidance: f64,
    steps: usize,
    size: (usize, usize),
    sigmas: Vec<f64>,
    /// `cfg_normalization` and `cfg_truncation` as the pipeline got them.
    options: CfgOptions,
}

fn case(name: &'static str) -> Case {
    let c = &cases()["cases"][name];
    let us = |k: &str| c[k].as_u64().unwrap() as usize;
    Case {
        name,
        prompt: c["prompt"].as_str().unwrap().into(),
        negative: c["negative"].as_str().unwrap().into(),
        guidance: c["guidance"].as_f64().unwrap(),
        steps: us("steps"),
        size: (us("height"), us("width")),
        sigmas: c["sigmas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect(),
        options: CfgOptions {
            normalization: c["cfg_normalization"].as_f64().unwrap(),
            truncation: c["cfg_truncation"].as_f64().unwrap(),
        },
    }
}

/// The case's conditioning and its negative one, as the model takes them.
fn conds(c: &Case, model: &dyn models::DiffusionModel) -> (Vec<Tensor>, Vec<Tensor>) {
    let enc = conditioner();
    let inputs = model.inputs();
    let one = |p: &str| {
        conditioning(
            &inputs,
            &enc.encode(&[p]).unwrap(),
            c.size,
            DType::F32,
            &CPU,
        )
    };
    (one(&c.prompt).unwrap(), one(&c.negative).unwrap())
}

/// diffusers' image from FLAME's decoded [-1, 1] image: `VaeImageProcessor.postprocess`'s
/// (x / 2 + 0.5) clamped to [0, 1].
fn postprocess(img: &Tensor) -> Tensor {
    img.affine(0.5, 0.5).unwrap().clamp(0.0, 1.0).unwrap()
}

/// The family's sampler against `ZImagePipeline.__call__` from the same starting latents:
/// sigmas, the latents after every step (guidance as FLAME's scale g + 1, the two
/// predictions batched and not), `sample::generate_from` (the loop the trainer and the
/// `sample` binary share), and the image the autoencoder decodes.
fn trajectory(name: &'static str) -> f64 {
    let c = case(name);
    let io = outputs();
    let fam = family("zimage").unwrap();
    let model = models::load("zimage", pipeline(), &LoadOptions::new(DType::F32, &CPU))
        .unwrap()
        .model;
    let hw = (c.size.0 / 8, c.size.1 / 8);
    let setup = SampleSetup {
        steps: c.steps,
        latent_hw: hw,
        guided: false,
        prediction: flame::train::Prediction::Epsilon,
    };
    let schedule = (fam.pipeline.schedule)(&setup).unwrap();
    let ts: Vec<f64> = schedule.timesteps().iter().map(|&t| f64::from(t)).collect();
    let want_ts: Vec<f64> = c.sigmas[..c.steps].iter().map(|s| s * 1000.0).collect();
    for (a, b) in ts.iter().zip(&want_ts) {
        assert!(
            (a - b).abs() <= 1e-4,
            "{}: timesteps {ts:?} vs {want_ts:?}",
            c.name
        );
    }
    assert_eq!(ts.len(), c.steps);

    let (cond, neg) = conds(&c, &*model);
    let noise = &io[&format!("{name}.latents")];
    let scale = c.guidance + 1.0;
    let mut worst = 0f64;
    for batched in [false, true] {
        let guidance = if c.guidance > 0.0 {
            Guidance::cfg(neg.clone(), scale)
                .batched(batched)
                .with_options(c.options)
        } else {
            Guidance::none()
        };
        let mut seen = 0;
        let mut on_step = |s: &StepInfo<'_>| -> flame::Result<()> {
            let e = check_rel(
                &format!("{name} (batched {batched}): latents after step {}", s.index),
                s.latents,
                &io[&format!("{name}.step.{}", s.index)],
                TOL,
            );
            worst = worst.max(e);
            seen += 1;
            Ok(())
        };
        let out = denoise(
            &*model,
            &*schedule,
            noise,
            &cond,
            &guidance,
            Some(&mut on_step),
        )
        .unwrap();
        assert_eq!(seen, c.steps);
        worst = worst.max(check_rel(
            &format!("{name} (batched {batched}): final latents"),
            &out,
            &io[&format!("{name}.final")],
            TOL,
        ));
    }

    let req = Request {
        steps: c.steps,
        guidance: scale,
        latent_hw: hw,
        seed: 0,
        prediction: flame::train::Prediction::Epsilon,
        batched_guidance: true,
        cfg_options: c.options,
    };
    let out = generate_from(
        &*model,
        &[cond],
        Some(neg),
        &req,
        std::slice::from_ref(noise),
    )
    .unwrap();
    let final_ = &io[&format!("{name}.final")];
    worst = worst.max(check_rel(
        &format!("{name}: generate_from"),
        &out[0],
        final_,
        TOL,
    ));

    let (_, vae_at) = Sources::default()
        .locate(fam, &pipeline(), ["text", "tokenizers", "vae"])
        .unwrap();
    let vae = load_vae(fam, &vae_at, DType::F32, &CPU, "vae").unwrap();
    let img = {
        let _g = flame::no_grad();
        vae.decode_latents(final_).unwrap()
    };
    worst.max(check_rel(
        &format!("{name}: decoded image"),
        &postprocess(&img),
        &io[&format!("{name}.image")],
        TOL,
    ))
}

/// Z-Image-Turbo's way: guidance_scale 0 (no classifier-free guidance), 3 steps, 64x48.
#[test]
fn turbo_trajectory_matches_diffusers() {
    println!("worst {:.2e}", trajectory("turbo"));
}

/// The base model's way: guidance_scale 2.5 with a negative prompt (FLAME's scale 3.5),
/// 4 steps, 48x64.
#[test]
fn cfg_trajectory_matches_diffusers() {
    println!("worst {:.2e}", trajectory("cfg"));
}

/// `cfg_normalization = True` (FLAME's 1): every guided prediction scaled back to the norm
/// of its conditional one where it is larger.
#[test]
fn cfg_normalization_matches_diffusers() {
    println!("worst {:.2e}", trajectory("cfg_norm"));
    options_change_the_result("cfg_norm");
}

/// `cfg_truncation = 0.2`: the last two of the 4 steps (normalized times 0.25 and 0.5) run
/// the conditional prediction alone.
#[test]
fn cfg_truncation_matches_diffusers() {
    println!("worst {:.2e}", trajectory("cfg_trunc"));
    options_change_the_result("cfg_trunc");
}

/// Both at once: `cfg_normalization = 1.2`, `cfg_truncation = 0.3`.
#[test]
fn cfg_normalization_and_truncation_match_diffusers() {
    println!("worst {:.2e}", trajectory("cfg_both"));
    options_change_the_result("cfg_both");
}

/// The case's options move diffusers' result away from the plain "cfg" case's (the same
/// inputs): a FLAME that ignored them would fail the trajectory checks.
fn options_change_the_result(name: &str) {
    let io = outputs();
    let apart = io[&format!("{name}.final")]
        .sub(&io["cfg.final"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_vec_f64()
        .unwrap()[0];
    println!("{name}: {apart:.3e} from cfg's final latents");
    assert!(apart > 1e-2, "{name}: {apart}");
}

/// Out-of-range options are refused before the model runs, naming them.
#[test]
fn bad_cfg_options_are_refused() {
    let c = case("cfg");
    let model = models::load("zimage", pipeline(), &LoadOptions::new(DType::F32, &CPU))
        .unwrap()
        .model;
    let fam = family("zimage").unwrap();
    let schedule = (fam.pipeline.schedule)(&SampleSetup {
        steps: 1,
        latent_hw: (c.size.0 / 8, c.size.1 / 8),
        guided: false,
        prediction: flame::train::Prediction::Epsilon,
    })
    .unwrap();
    let (cond, neg) = conds(&c, &*model);
    let noise = &outputs()["cfg.latents"];
    for (options, name) in [
        (
            CfgOptions {
                normalization: -1.0,
                truncation: 1.0,
            },
            "cfg_normalization",
        ),
        (
            CfgOptions {
                normalization: 0.0,
                truncation: f64::NAN,
            },
            "cfg_truncation",
        ),
    ] {
        let g = Guidance::cfg(neg.clone(), 3.5).with_options(options);
        let e = denoise(&*model, &*schedule, noise, &cond, &g, None).unwrap_err();
        assert!(e.to_string().contains(name), "{e}");
    }
}

/// examples/zimage.toml parses and passes every check that needs no files.
#[test]
fn the_template_parses() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/zimage.toml");
    let c = flame::train::TrainConfig::from_file(&p).unwrap();
    assert_eq!(c.model.arch, "zimage");
    assert!(c.model.path.is_absolute() && c.train.steps > 0);
    assert_eq!((c.sample.steps, c.sample.guidance), (50, 6.0));
    assert_eq!(
        (c.sample.cfg_normalization, c.sample.cfg_truncation),
        (0.0, 1.0)
    );
    // Out-of-range guidance options are refused by name.
    let text = std::fs::read_to_string(&p).unwrap();
    let text = text.replacen(
        "[sample]",
        "[sample]\ncfg_normalization = -1.0\ncfg_truncation = -0.5",
        1,
    );
    assert_ne!(
        text,
        std::fs::read_to_string(&p).unwrap(),
        "the template has a [sample]"
    );
    let e = flame::train::TrainConfig::from_toml(&text)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sample.cfg_normalization") && e.contains("sample.cfg_truncation"),
        "{e}"
    );
}

#[cfg(feature = "cli")]
fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-zpipe-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Eight pictures of three aspect ratios (64x64, 64x48, 48x64: three buckets at
/// resolution 64, step 16), a rectangle of a colour on another, with captions saying so.
#[cfg(feature = "cli")]
fn pictures(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    let colours = [
        ("red", [220u8, 30, 30]),
        ("green", [30, 200, 60]),
        ("blue", [40, 60, 220]),
        ("yellow", [230, 220, 40]),
    ];
    for i in 0..8 {
        let (w, h) = [(64u32, 64u32), (64, 48), (48, 64)][i % 3];
        let (name, fg) = colours[i % 4];
        let (_, bg) = colours[(i + 1) % 4];
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            let inside = x > w / 4 && x < 3 * w / 4 && y > h / 5 + i as u32 && y < 4 * h / 5;
            image::Rgb(if inside { fg } else { bg })
        });
        img.save(dir.join(format!("picture-{i}.png"))).unwrap();
        std::fs::write(
            dir.join(format!("picture-{i}.txt")),
            format!("a {name} rectangle, picture {i}"),
        )
        .unwrap();
    }
}

/// A run's config in `dir` on the tiny pipeline: LoRA on the refiners' and main layers'
/// attention and feed-forward Linears, three buckets, a validation split, samples and
/// checkpoints every 3 steps, in `format`.
#[cfg(feature = "cli")]
fn run_config(dir: &std::path::Path, steps: usize, format: &str) -> PathBuf {
    pictures(&dir.join("images"));
    let text = format!(
        r#"[model]
arch = "zimage"
path = "{model}"
dtype = "f32"

[adapter]
rank = 4
alpha = 4.0
targets = ["*.attention.qkv", "*.attention.out", "*.feed_forward.w*"]
format = "{format}"

[optimizer]
lr = 1e-2

[schedule]
kind = "constant"

[train]
steps = {steps}
batch_size = 2
seed = 3
save_every = 3
keep_last = 2
validate_every = 3
output_dir = "{out}"
device = "cpu"
timesteps = "shift"
timestep_shift = 3.0

[data]
resolution = 64
bucket_step = 16
flip = true
validation_split = 0.25

[[data.dirs]]
path = "{images}"

[sample]
every = 3
prompts = ["a red rectangle"]
negative_prompt = "blurry"
steps = 3
guidance = 2.0
size = [48, 64]
seed = 5
cfg_normalization = 1.0
cfg_truncation = 0.5
"#,
        model = pipeline().display(),
        out = dir.join("out").display(),
        images = dir.join("images").display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[cfg(feature = "cli")]
fn train_bin(config: &std::path::Path, fault: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_train"));
    c.arg(config).args(args);
    match fault {
        Some(f) => c.env("FLAME_FAULT", f),
        None => c.env_remove("FLAME_FAULT"),
    };
    c.output().unwrap()
}

#[cfg(feature = "cli")]
fn said(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The tensor names of a safetensors file.
#[cfg(feature = "cli")]
fn names(p: &std::path::Path) -> Vec<String> {
    let f = flame::safetensors::SafeTensorsFile::open(p).unwrap();
    let mut v: Vec<String> = f.names().map(str::to_string).collect();
    v.sort();
    v
}

/// The `train` binary from images on the tiny pipeline: caching, buckets, validation,
/// samples and checkpoints; a run killed at step 5 resumes from checkpoint-3 to the same
/// log and the same LoRA bytes; a PEFT run writes diffusers' names. Then the `sample`
/// binary: from diffusers' starting latents it makes diffusers' image (within 1 of 255 a
/// channel), and with the kohya LoRA and with the PEFT LoRA the same image, unlike the
/// image without; without --steps and --guidance it takes Z-Image's 50 and 6.
#[cfg(feature = "cli")]
#[test]
fn the_binaries_train_and_sample_a_lora() {
    // Uninterrupted, kohya layout.
    let a = temp("train-a");
    let cfg_a = run_config(&a, 6, "kohya");
    let o = train_bin(&cfg_a, None, &[]);
    assert!(o.status.success(), "{}", said(&o));
    let out_a = a.join("out");
    let log = std::fs::read_to_string(out_a.join("loss.jsonl")).unwrap();
    let losses = log.lines().filter(|l| l.contains("\"loss\"")).count();
    let vals: Vec<&str> = log.lines().filter(|l| l.contains("val_loss")).collect();
    assert_eq!((losses, vals.len()), (6, 2), "{log}");
    for step in [3, 6] {
        let png = out_a.join(format!("samples/step-{step:07}-0.png"));
        let img = image::open(&png).unwrap();
        assert_eq!((img.width(), img.height()), (48, 64), "{}", png.display());
    }
    assert!(image::open(out_a.join("loss.png")).is_ok());
    assert!(out_a.join("checkpoint-0000006").is_dir() && out_a.join("checkpoint-0000003").is_dir());
    let kohya = out_a.join("lora.safetensors");
    let kn = names(&kohya);
    assert!(
        kn.iter()
            .any(|n| n.starts_with("lora_unet_layers_1_attention_qkv.lora_down")),
        "{kn:?}"
    );
    assert!(kn
        .iter()
        .any(|n| n.starts_with("lora_unet_noise_refiner_0_feed_forward_w2")));

    // Killed at the start of step 5, resumed from checkpoint-3.
    let b = temp("train-b");
    let cfg_b = run_config(&b, 6, "kohya");
    let o = train_bin(&cfg_b, Some("kill:step@5"), &[]);
    assert!(!o.status.success());
    assert!(!b.join("out/lora.safetensors").exists());
    let o = train_bin(&cfg_b, None, &["--resume"]);
    assert!(o.status.success(), "{}", said(&o));
    let log_b = std::fs::read_to_string(b.join("out/loss.jsonl")).unwrap();
    assert_eq!(log_b, log, "resumed log");
    assert_eq!(
        flame::train::metadata::content(&b.join("out/lora.safetensors")).unwrap(),
        flame::train::metadata::content(&kohya).unwrap(),
        "resumed LoRA"
    );

    // The same run in PEFT layout: diffusers' module names, to_q / to_k / to_v apart.
    let c = temp("train-c");
    let cfg_c = run_config(&c, 6, "peft");
    let o = train_bin(&cfg_c, None, &[]);
    assert!(o.status.success(), "{}", said(&o));
    let peft = c.join("out/lora.safetensors");
    let pn = names(&peft);
    for want in [
        "transformer.layers.1.attention.to_q.lora_A.weight",
        "transformer.layers.1.attention.to_out.0.lora_B.weight",
        "transformer.context_refiner.0.feed_forward.w1.lora_A.weight",
    ] {
        assert!(pn.iter().any(|n| n == want), "{want} not in {pn:?}");
    }

    // The same run in musubi-tuner's layout: kohya's names of diffusers' modules, the
    // final file only (checkpoints keep the kohya layout, which resumes exactly).
    let e = temp("train-e");
    let cfg_e = run_config(&e, 6, "musubi");
    let o = train_bin(&cfg_e, None, &[]);
    assert!(o.status.success(), "{}", said(&o));
    let musubi = e.join("out/lora.safetensors");
    let mn = names(&musubi);
    for want in [
        "lora_unet_layers_1_attention_to_q.lora_down.weight",
        "lora_unet_layers_1_attention_to_v.alpha",
        "lora_unet_layers_1_attention_to_out_0.lora_up.weight",
        "lora_unet_context_refiner_0_feed_forward_w1.lora_down.weight",
    ] {
        assert!(mn.iter().any(|n| n == want), "{want} not in {mn:?}");
    }
    assert!(!mn.iter().any(|n| n.contains("attention_qkv")), "{mn:?}");
    let ck = names(&e.join("out/checkpoint-0000006/adapter.safetensors"));
    assert!(
        ck.iter()
            .any(|n| n == "lora_unet_layers_1_attention_qkv.lora_down.weight"),
        "{ck:?}"
    );

    // The sample binary: diffusers' CFG case from its own starting latents.
    let io = outputs();
    let cfg_case = case("cfg");
    let lat = a.join("latents.safetensors");
    flame::safetensors::save([("latents", &io["cfg.latents"])], &lat).unwrap();
    let sample = |out: &str, extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sample"));
        cmd.args(["--arch", "zimage", "--device", "cpu", "--dtype", "f32"])
            .arg("--model")
            .arg(pipeline())
            .args([
                "--prompt",
                &cfg_case.prompt,
                "--negative",
                &cfg_case.negative,
            ])
            .args(["--steps", &cfg_case.steps.to_string()])
            .args(["--guidance", &(cfg_case.guidance + 1.0).to_string()])
            .args(["--width", &cfg_case.size.1.to_string()])
            .args(["--height", &cfg_case.size.0.to_string()])
            .arg("--latents")
            .arg(&lat)
            .arg("--out")
            .arg(a.join(out))
            .args(extra);
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", said(&o));
        let png = a.join(out).join("0-0.png");
        image::open(&png).unwrap().to_rgb8()
    };
    let plain = sample("plain", &[]);
    let want = io["cfg.image"].to_vec_f64().unwrap(); // (1, 3, H, W)
    let (h, w) = (cfg_case.size.0, cfg_case.size.1);
    let mut worst = 0f64;
    for (i, px) in plain.pixels().enumerate() {
        let (y, x) = (i / w, i % w);
        for ch in 0..3 {
            let d = (f64::from(px[ch]) / 255.0 - want[ch * h * w + y * w + x]).abs();
            worst = worst.max(d);
        }
    }
    println!(
        "sample binary vs diffusers' image: {:.2} of 255",
        worst * 255.0
    );
    assert!(worst * 255.0 <= 1.0, "{}", worst * 255.0);
    // The same with both of Z-Image's guidance options, against the "cfg_both" case (the
    // same prompts and starting latents).
    let both = case("cfg_both");
    let opts = sample(
        "options",
        &[
            "--cfg-normalization",
            &both.options.normalization.to_string(),
            "--cfg-truncation",
            &both.options.truncation.to_string(),
        ],
    );
    let want = io["cfg_both.image"].to_vec_f64().unwrap();
    let mut worst = 0f64;
    for (i, px) in opts.pixels().enumerate() {
        let (y, x) = (i / w, i % w);
        for ch in 0..3 {
            let d = (f64::from(px[ch]) / 255.0 - want[ch * h * w + y * w + x]).abs();
            worst = worst.max(d);
        }
    }
    println!(
        "sample binary with --cfg-normalization / --cfg-truncation vs diffusers' image: {:.2} \
         of 255",
        worst * 255.0
    );
    assert!(worst * 255.0 <= 1.0, "{}", worst * 255.0);

    let with_kohya = sample("kohya", &["--lora", kohya.to_str().unwrap()]);
    let with_peft = sample("peft", &["--lora", peft.to_str().unwrap()]);
    let with_musubi = sample("musubi", &["--lora", musubi.to_str().unwrap()]);
    let diff = |p: &image::RgbImage, q: &image::RgbImage| {
        p.as_raw()
            .iter()
            .zip(q.as_raw())
            .map(|(a, b)| (i32::from(*a) - i32::from(*b)).abs())
            .max()
            .unwrap()
    };
    let (same, changed) = (diff(&with_kohya, &with_peft), diff(&with_kohya, &plain));
    let same_musubi = diff(&with_kohya, &with_musubi);
    println!(
        "kohya vs PEFT LoRA: {same} of 255; kohya vs musubi: {same_musubi} of 255; LoRA vs \
         none: {changed} of 255"
    );
    assert!(same <= 1, "{same}");
    assert!(same_musubi <= 1, "{same_musubi}");
    assert!(changed >= 2, "{changed}");

    // Z-Image's defaults: ZImagePipeline's 50 steps and guidance_scale 5 (FLAME's 6).
    let defaults = |out: &str, extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_sample"))
            .args(["--arch", "zimage", "--device", "cpu", "--dtype", "f32"])
            .arg("--model")
            .arg(pipeline())
            .args([
                "--prompt",
                "a red rectangle",
                "--width",
                "32",
                "--height",
                "32",
            ])
            .arg("--out")
            .arg(a.join(out))
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", said(&o));
        let png = image::open(a.join(out).join("0-0.png")).unwrap().to_rgb8();
        (String::from_utf8_lossy(&o.stderr).into_owned(), png)
    };
    let (log, by_default) = defaults("default", &[]);
    assert!(
        log.contains("step 50/50") && !log.contains("step 51"),
        "{log}"
    );
    let (_, explicit) = defaults("explicit", &["--steps", "50", "--guidance", "6"]);
    let (_, other) = defaults("other", &["--steps", "50", "--guidance", "3.5"]);
    assert_eq!(diff(&by_default, &explicit), 0);
    assert!(diff(&by_default, &other) > 0);
    for d in [a, b, c, e] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// Z-Image with Qwen3's LoRA trained beside the model's (`adapter.text_encoders =
/// ["qwen3"]`): both sets move and the PEFT file holds Qwen3's under `text_encoder.model.`.
#[cfg(feature = "cli")]
#[test]
fn zimage_trains_qwen3_adapters() {
    use flame::train::{Prepare, RunOptions, TrainConfig, Trainer};
    let d = temp("qwen3");
    let p = run_config(&d, 2, "peft");
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "format = \"peft\"",
        "format = \"peft\"\ntext_encoders = [\"qwen3\"]",
    );
    std::fs::write(&p, &text[..text.find("[sample]").unwrap()]).unwrap();
    let cfg = TrainConfig::from_file(&p).unwrap();
    let mut t = Trainer::open(cfg, Prepare::Encode, &mut |_| {}).unwrap();
    let before: Vec<Vec<f64>> = t.param_lists().unwrap()[1]
        .1
        .iter()
        .map(|(_, x)| x.to_vec_f64().unwrap())
        .collect();
    assert!(!before.is_empty());
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let after: Vec<Vec<f64>> = t.param_lists().unwrap()[1]
        .1
        .iter()
        .map(|(_, x)| x.to_vec_f64().unwrap())
        .collect();
    let moved = before.iter().zip(&after).filter(|(x, y)| x != y).count();
    assert_eq!(
        moved,
        before.len(),
        "every tensor of Qwen3's adapters trains"
    );
    let names: Vec<String> =
        flame::safetensors::SafeTensorsFile::open(d.join("out/lora.safetensors"))
            .unwrap()
            .names()
            .map(str::to_string)
            .collect();
    assert!(
        names
            .iter()
            .any(|n| n == "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight"),
        "{names:?}"
    );
    std::fs::remove_dir_all(&d).ok();
}
