//! FLUX.2 [klein] end to end through FLAME's public API, against diffusers 0.42.1's
//! `Flux2KleinPipeline` on a tiny random pipeline. Fixtures (tests/fixtures/klein) are made by
//! scripts/make_klein_fixtures.py: a diffusers pipeline folder (tiny Flux2Transformer2DModel,
//! 28-layer Qwen3, AutoencoderKLFlux2 with random BatchNorm statistics, the scheduler) and what
//! the pipeline computes with it: `encode_prompt` in f64, and two `__call__` runs in f32 from
//! given latents (classifier-free guidance at 4.0 against the empty prompt, and none), each
//! step's latents, the final latents and the decoded image.
//!
//! Tolerances, max |flame - diffusers| / max |diffusers| per tensor:
//! - the conditioning: the one tolerance table's `Against::Network` bound for f32;
//! - [`TRAJECTORY_TOL`] for the latents after every step (the bound tests/sampler.rs holds
//!   for Flux);
//! - [`IMAGE_TOL`] for the unpatched latents and the decoded image, from FLAME's own final
//!   latents (their error carried through the autoencoder).
#![cfg(feature = "cpu-ref")]

mod common;

use flame::encoders::AutoencoderKl;
use flame::models::{self, flux2, DiffusionModel, LoadOptions, Sources, TextConditioner};
use flame::models::{load_vae, TextOptions};
use flame::sample::{denoise, generate_from, Guidance, Request, Schedule, StepInfo};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;
const TRAJECTORY_TOL: f64 = 1e-5;
const IMAGE_TOL: f64 = 1e-5;
const TABLE_TOL: f64 = 1e-6;
const KEYS: [&str; 3] = ["encoders.text", "encoders.tokenizers", "encoders.vae"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/klein")
}

fn pipeline() -> PathBuf {
    root().join("pipeline")
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(root().join("outputs.safetensors"), &CPU).unwrap()
}

fn cases() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("cases.json")).unwrap()).unwrap()
}

/// max |got - want| / max |want|, asserted within `tol`.
fn check(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> f64 {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale.max(f64::MIN_POSITIVE);
    assert!(err <= tol, "{what}: error {err:e} > {tol:e}");
    err
}

fn family() -> &'static models::Family {
    models::family("flux2").unwrap()
}

fn model() -> Box<dyn DiffusionModel> {
    models::load(
        "flux2",
        pipeline().join("transformer"),
        &LoadOptions::new(DType::F32, &CPU),
    )
    .unwrap()
    .model
}

fn vae() -> AutoencoderKl {
    let (_, located) = Sources::default()
        .locate(family(), &pipeline().join("transformer"), KEYS)
        .unwrap();
    load_vae(family(), &located, DType::F32, &CPU, "encoders.vae").unwrap()
}

fn conditioner() -> TextConditioner {
    conditioner_with(&TextOptions::default())
}

fn conditioner_with(opts: &TextOptions) -> TextConditioner {
    // The pipeline folder's text_encoder/, tokenizer/ and vae/, found from its transformer/.
    let (located, _) = Sources::default()
        .locate(family(), &pipeline().join("transformer"), KEYS)
        .unwrap();
    TextConditioner::load(family(), &located, opts, DType::F32, &CPU, "encoders").unwrap()
}

/// Qwen3's captions keep their own lengths: the captions' cache encodes them one a pass.
#[test]
fn qwen3_captions_encode_one_a_pass() {
    let cond = conditioner();
    assert_eq!(cond.caption_bytes(DType::BF16).unwrap(), None);
    assert_eq!(
        flame::train::images::caption_batch(&cond, DType::F32, &CPU).unwrap(),
        1
    );
}

/// Captions to the `context` through the family's pipeline, as `encode_prompt` gives it.
#[test]
fn text_conditioning_matches_encode_prompt() {
    let io = outputs();
    let caps: Vec<String> = cases()["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    let caps: Vec<&str> = caps.iter().map(String::as_str).collect();
    let got = conditioner().encode(&caps).unwrap();
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["context"]);
    let tol = common::tolerance::tolerance(common::tolerance::Against::Network, DType::F32).1;
    let e = check("context", &got[0].1, &io["encode.context"], tol);
    println!("klein context: worst {e:.2e}");
    // Qwen3's layers streamed from host memory (`encoders.stream_qwen3`): the same values.
    let streamed = conditioner_with(&TextOptions {
        stream_qwen3: true,
        ..TextOptions::default()
    })
    .encode(&caps)
    .unwrap();
    assert_eq!(
        streamed[0].1.to_vec_f64().unwrap(),
        got[0].1.to_vec_f64().unwrap(),
        "streamed Qwen3"
    );
    // Qwen3's Linears in FP8 (`encoders.fp8_qwen3`), streamed or not alike. The tiny
    // encoder is 28 random layers of width 16 whose 9th, 18th and 27th outputs make the
    // context: FP8's rounding (3 mantissa bits, per-row scales; 6.1e-2 at layer 3 in
    // tests/qwen3.rs) compounds through them to 0.16 of the context's norm.
    let fp8 = TextOptions {
        fp8_qwen3: true,
        ..TextOptions::default()
    };
    let ctx8 = conditioner_with(&fp8).encode(&caps).unwrap();
    let (g, w) = (
        ctx8[0].1.to_vec_f64().unwrap(),
        io["encode.context"].to_vec_f64().unwrap(),
    );
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = g.iter().zip(&w).map(|(a, b)| a - b).collect();
    let e8 = norm(&diff) / norm(&w);
    assert!(
        e8 > 0.0 && e8 <= 0.25,
        "FP8 Qwen3: context off by {e8:e} of its norm"
    );
    let ctx8s = conditioner_with(&TextOptions {
        stream_qwen3: true,
        ..fp8
    })
    .encode(&caps)
    .unwrap();
    assert_eq!(
        ctx8s[0].1.to_vec_f64().unwrap(),
        ctx8[0].1.to_vec_f64().unwrap(),
        "streamed FP8 Qwen3"
    );
    println!("klein context with FP8 Qwen3: {e8:.2e} of its norm");
    // The model takes exactly this width.
    let m = model();
    let w = got[0].1.dims()[2];
    assert!(m.inputs()[1].dims[1].admits(w), "context width {w}");
}

/// `case`'s trajectory through `denoise` with the family's sampler and guidance, then the
/// autoencoder's decode; returns the worst (latents, image) errors.
fn trajectory(case: &str, batched: bool) -> (f64, f64) {
    let io = outputs();
    let c = &cases()["cases"][case];
    let (steps, scale) = (
        c["steps"].as_u64().unwrap() as usize,
        c["guidance_scale"].as_f64().unwrap(),
    );
    let m = model();
    let noise = &io[&format!("{case}.noise")];
    let d = noise.dims().to_vec();
    // The family's sampler for the model's (C, h, w) latents.
    let schedule = (family().pipeline.schedule)(&models::SampleSetup {
        steps,
        latent_hw: (d[2], d[3]),
        guided: m.guidance_input(),
        prediction: flame::train::Prediction::Epsilon,
    })
    .unwrap();
    let direct = flux2::schedule(steps, d[2] * d[3]).unwrap();
    assert_eq!(schedule.timesteps(), direct.timesteps());
    let want_t = io[&format!("{case}.timesteps")].to_vec_f64().unwrap();
    for (a, b) in schedule.timesteps().iter().zip(&want_t) {
        assert!(
            (*a as f64 - b).abs() <= TABLE_TOL * b.abs(),
            "timesteps {a} {b}"
        );
    }
    assert!(!m.guidance_input(), "klein has no guidance embedding");
    let cond = vec![io[&format!("{case}.context")].clone()];
    let guidance = match io.get(&format!("{case}.neg_context")) {
        Some(n) => Guidance::cfg(vec![n.clone()], scale).batched(batched),
        None => Guidance::none(),
    };
    let mut worst = 0f64;
    let mut seen = 0;
    let mut on_step = |s: &StepInfo<'_>| -> flame::Result<()> {
        let want = &io[&format!("{case}.latents.{}", s.index)];
        worst = worst.max(check(
            &format!("{case}: latents after step {}", s.index),
            s.latents,
            want,
            TRAJECTORY_TOL,
        ));
        seen += 1;
        Ok(())
    };
    let out = denoise(
        &*m,
        schedule.as_ref(),
        noise,
        &cond,
        &guidance,
        Some(&mut on_step),
    )
    .unwrap();
    assert_eq!(seen, steps);
    // The autoencoder: un-normalized, unpatched latents and the decoded picture.
    let v = vae();
    let _g = flame::no_grad();
    let lat = v.unscale_latents(&out).unwrap();
    let e_lat = check(
        &format!("{case}: output_type=latent"),
        &lat,
        &io[&format!("{case}.latent")],
        IMAGE_TOL,
    );
    let img = v.decode_latents(&out).unwrap();
    let e_img = check(
        &format!("{case}: decoded"),
        &img,
        &io[&format!("{case}.decoded")],
        IMAGE_TOL,
    );
    // diffusers' image processor: (x / 2 + 0.5) clamped to [0, 1].
    let pic = img.affine(0.5, 0.5).unwrap().clamp(0.0, 1.0).unwrap();
    let e_pic = check(
        &format!("{case}: image"),
        &pic,
        &io[&format!("{case}.image")],
        IMAGE_TOL,
    );
    println!(
        "klein {case} (batched {batched}): latents {worst:.2e}, unpatched {e_lat:.2e}, \
         decoded {e_img:.2e}, image {e_pic:.2e}"
    );
    (worst, e_img.max(e_pic).max(e_lat))
}

#[test]
fn cfg_trajectory_and_image_match_the_pipeline() {
    trajectory("cfg", true);
    trajectory("cfg", false);
}

#[test]
fn unguided_trajectory_and_image_match_the_pipeline() {
    trajectory("plain", false);
}

/// `sample::generate_from`, the loop the `sample` binary and the trainer's samples share,
/// from captions: the conditioner's context and the empty negative prompt, one image at a
/// time, against the pipeline's final latents from the stored context (the conditioning's
/// own error carried through).
#[test]
fn generate_from_captions_matches_the_pipeline() {
    let io = outputs();
    let cond = conditioner();
    let m = model();
    let noise = &io["cfg.noise"];
    let d = noise.dims().to_vec();
    let caps = cases()["captions"].clone();
    let conds: Vec<Vec<Tensor>> = (0..2)
        .map(|i| {
            let named = cond.encode(&[caps[i].as_str().unwrap()]).unwrap();
            models::pipeline::conditioning(&m.inputs(), &named, (0, 0), DType::F32, &CPU).unwrap()
        })
        .collect();
    let uncond = models::pipeline::conditioning(
        &m.inputs(),
        &cond.encode(&[""]).unwrap(),
        (0, 0),
        DType::F32,
        &CPU,
    )
    .unwrap();
    let req = Request {
        steps: 4,
        guidance: 4.0,
        latent_hw: (d[2], d[3]),
        seed: 0,
        prediction: flame::train::Prediction::Epsilon,
        batched_guidance: true,
        cfg_options: Default::default(),
    };
    let noise: Vec<Tensor> = (0..2).map(|i| noise.narrow(0, i, 1).unwrap()).collect();
    let got = generate_from(&*m, &conds, Some(uncond), &req, &noise).unwrap();
    let got = Tensor::cat(&got.iter().collect::<Vec<_>>(), 0).unwrap();
    let e = check("generate_from", &got, &io["cfg.latents.3"], 1e-4);
    println!("klein generate_from captions: {e:.2e}");
}

// ---------------------------------------------------------------------------------------------
// The `train` and `sample` binaries on the tiny pipeline folder.

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-klein-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A run from `images` on the fixture pipeline (its encoders found from model.path):
/// `steps` steps, checkpoints, validation and samples every 2, the LoRA in `format`.
fn klein_config(
    dir: &std::path::Path,
    images: &std::path::Path,
    steps: usize,
    format: &str,
) -> PathBuf {
    let text = format!(
        r#"[model]
arch = "flux2"
path = "{model}"
dtype = "f32"

[adapter]
rank = 4
alpha = 4.0
targets = ["double_blocks.*_attn.qkv", "double_blocks.*_attn.proj", "double_blocks.*_mlp.*", "single_blocks.*.linear*"]
format = "{format}"

[optimizer]
lr = 1e-3

[train]
steps = {steps}
batch_size = 2
seed = 7
save_every = 2
keep_last = 2
output_dir = "{out}"
device = "cpu"
timesteps = "flux_shift"
validate_every = 2

[data]
resolution = 32
bucket_step = 16
flip = true
caption_dropout = 0.1
validation_split = 0.2

[[data.dirs]]
path = "{images}"

# Qwen3's layers streamed from host memory while the captions are encoded.
[encoders]
stream_qwen3 = "on"

[sample]
every = 2
prompts = ["a large red circle on a white background", "a small blue square"]
steps = 3
guidance = 4.0
seed = 1
"#,
        model = pipeline().display(),
        out = dir.join("out").display(),
        images = images.display(),
    );
    let p = dir.join("train.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn train_bin(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .env_remove("FLAME_FAULT")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "train {args:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// The model's prediction on fixed inputs, with `lora` merged at `strength` (none: the base).
fn predict_with(lora: Option<&std::path::Path>, strength: f64) -> flame::Result<Vec<f64>> {
    let mut opts = LoadOptions::new(DType::F32, &CPU);
    if let Some(l) = lora {
        opts.merge = Some(std::sync::Arc::new(flame::nn::LoraMerge::open(
            l,
            strength,
            family().subfolder,
        )?));
    }
    let m = models::load("flux2", pipeline().join("transformer"), &opts)?.model;
    let x = Tensor::randn((1, 32, 4, 4), DType::F32, &CPU, 1)?;
    let t = Tensor::from_vec(vec![0.6f32], 1, &CPU)?;
    let ctx = Tensor::randn((1, 7, 48), DType::F32, &CPU, 2)?;
    m.predict(&x, &t, &[ctx], 1.0)?.to_vec_f64()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let s = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / s
}

/// Images to a LoRA with the `train` binary: text and latents cached, bucketed batches,
/// validation lines, sample images, checkpoints and a resume that extends the run; the
/// kohya file's and a PEFT run's keys are the FLUX.2 key maps' (every tensor merges into its
/// layer and changes the prediction); then the `sample` binary with the LoRA reproduces the
/// run's own samples, reads FLUX.2's packed `--latents`, and takes no CFG from a
/// step-distilled pipeline.
#[test]
fn train_and_sample_binaries_run_klein_from_images() {
    let d = temp("train");
    let images = d.join("images");
    flame::train::demo::make_tiny_images(&images).unwrap();
    let cfg = klein_config(&d, &images, 4, "kohya");
    let out = d.join("out");
    train_bin(&[cfg.as_os_str()]);
    let log = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    let losses = log.lines().filter(|l| l.contains("\"loss\"")).count();
    let vals: Vec<&str> = log.lines().filter(|l| l.contains("val_loss")).collect();
    assert_eq!((losses, vals.len()), (4, 2), "{log}");
    for l in log.lines() {
        assert!(!l.contains("NaN") && !l.contains("inf"), "{l}");
    }
    for step in [2, 4] {
        for i in 0..2 {
            let png = out.join(format!("samples/step-{step:07}-{i}.png"));
            let img = image::open(&png).unwrap();
            assert_eq!((img.width(), img.height()), (32, 32), "{}", png.display());
        }
    }
    assert!(out.join("loss.png").is_file());
    assert!(out.join("checkpoint-0000004").is_dir());

    // Resume, extended to 6 steps: the caches are reused and steps 5 and 6 are trained.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("steps = 4", "steps = 6");
    std::fs::write(&cfg, text).unwrap();
    train_bin(&[cfg.as_os_str(), std::ffi::OsStr::new("--resume")]);
    let log = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    let steps: Vec<&str> = log.lines().filter(|l| l.contains("\"loss\"")).collect();
    assert_eq!(steps.len(), 6, "{log}");
    assert!(out.join("samples/step-0000006-1.png").is_file());

    // The kohya file: BFL layer names, every tensor merging into its layer.
    let lora = out.join("lora.safetensors");
    let names: Vec<String> = flame::safetensors::SafeTensorsFile::open(&lora)
        .unwrap()
        .names()
        .map(str::to_string)
        .collect();
    for k in [
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
        "lora_unet_double_blocks_1_txt_mlp_2.lora_up.weight",
        "lora_unet_single_blocks_1_linear1.alpha",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} not in {names:?}");
    }
    let base = predict_with(None, 0.0).unwrap();
    let with = predict_with(Some(&lora), 1.0).unwrap();
    assert!(rel(&with, &base) > 1e-6, "the LoRA changes nothing");

    // A PEFT run: diffusers' module names (the fused layers split into their parts).
    let d2 = temp("peft");
    let cfg2 = klein_config(&d2, &images, 2, "peft");
    // No sample images this time.
    let text = std::fs::read_to_string(&cfg2).unwrap();
    std::fs::write(&cfg2, &text[..text.find("[sample]").unwrap()]).unwrap();
    train_bin(&[cfg2.as_os_str()]);
    let peft = d2.join("out/lora.safetensors");
    let names: Vec<String> = flame::safetensors::SafeTensorsFile::open(&peft)
        .unwrap()
        .names()
        .map(str::to_string)
        .collect();
    for k in [
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer.transformer_blocks.1.ff_context.linear_out.lora_B.weight",
        "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} not in {names:?}");
    }
    let with = predict_with(Some(&peft), 1.0).unwrap();
    assert!(rel(&with, &base) > 1e-6, "the PEFT LoRA changes nothing");

    // The sample binary with the kohya LoRA: the run's own last samples (merged weights
    // against attached adapters, through the 8-bit PNG).
    let sample = |extra: &[&std::ffi::OsStr], model: &std::path::Path| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_sample"));
        c.args(["--arch", "flux2", "--device", "cpu", "--dtype", "f32"])
            .arg("--model")
            .arg(model)
            .args(["--width", "32", "--height", "32", "--steps", "3"])
            .args(["--seed", "1"])
            .args(extra);
        c.output().unwrap()
    };
    let s_out = d.join("samples");
    let o = sample(
        &[
            "--guidance".as_ref(),
            "4.0".as_ref(),
            "--prompt".as_ref(),
            "a large red circle on a white background".as_ref(),
            "--prompt".as_ref(),
            "a small blue square".as_ref(),
            "--lora".as_ref(),
            lora.as_os_str(),
            "--out".as_ref(),
            s_out.as_os_str(),
        ],
        &pipeline(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (i, seed) in [(0, 1), (1, 2)] {
        let a = image::open(s_out.join(format!("{i}-{seed}.png")))
            .unwrap()
            .to_rgb8();
        let b = image::open(out.join(format!("samples/step-0000006-{i}.png")))
            .unwrap()
            .to_rgb8();
        let worst = a
            .as_raw()
            .iter()
            .zip(b.as_raw())
            .map(|x| x.0.abs_diff(*x.1))
            .max()
            .unwrap();
        assert!(worst <= 12, "image {i}: {worst}");
    }

    // --latents: the pipeline's packed (N, h w, C) latents give the image the unpacked
    // (N, C, h, w) ones do.
    let z = Tensor::randn((1, 32, 8, 8), DType::F32, &CPU, 5).unwrap();
    let packed = flux2::pack_latents(&z).unwrap();
    let mut pngs = vec![];
    for (name, t) in [("unpacked", z), ("packed", packed)] {
        let f = d.join(format!("{name}.safetensors"));
        flame::safetensors::save([("latents", &t)], &f).unwrap();
        let o_dir = d.join(name);
        let o = sample(
            &[
                "--prompt".as_ref(),
                "x".as_ref(),
                "--latents".as_ref(),
                f.as_os_str(),
                "--out".as_ref(),
                o_dir.as_os_str(),
            ],
            &pipeline(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        pngs.push(std::fs::read(o_dir.join("0-1.png")).unwrap());
    }
    assert_eq!(pngs[0], pngs[1]);

    // A step-distilled pipeline (model_index.json's is_distilled): --guidance is not applied,
    // as diffusers ignores it; the image is the unguided one.
    let distilled = d.join("distilled");
    std::fs::create_dir_all(&distilled).unwrap();
    for sub in [
        "transformer",
        "text_encoder",
        "tokenizer",
        "vae",
        "scheduler",
    ] {
        let to = distilled.join(sub);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(pipeline().join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    let index = std::fs::read_to_string(pipeline().join("model_index.json"))
        .unwrap()
        .replace("\"is_distilled\": false", "\"is_distilled\": true");
    assert!(index.contains("\"is_distilled\": true"));
    std::fs::write(distilled.join("model_index.json"), index).unwrap();
    assert!(models::step_distilled(&distilled).unwrap());
    assert!(!models::step_distilled(&pipeline().join("transformer")).unwrap());
    let run = |model: &std::path::Path, guidance: &str, name: &str| {
        let o_dir = d.join(name);
        let o = sample(
            &[
                "--prompt".as_ref(),
                "x".as_ref(),
                "--guidance".as_ref(),
                guidance.as_ref(),
                "--out".as_ref(),
                o_dir.as_os_str(),
            ],
            model,
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            std::fs::read(o_dir.join("0-1.png")).unwrap(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (a, note) = run(&distilled, "4.0", "d4");
    assert!(note.contains("step-distilled"), "{note}");
    let (b, _) = run(&pipeline(), "1.0", "b1");
    let (c, _) = run(&pipeline(), "4.0", "b4");
    assert_eq!(a, b);
    assert_ne!(a, c);
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&d2).ok();
}

/// FLUX.2 [klein] with Qwen3's LoRA trained beside the model's (its layers streamed from host
/// memory, the adapters on the device): every input encoded every step, every tensor of
/// Qwen3's adapters moves; the PEFT file holds them under `text_encoder.` in
/// Qwen3ForCausalLM's module names; a run stopped at step 2 and resumed ends with the same
/// log and file as one run straight through; the checkpoint reads back into a fresh run.
#[test]
fn klein_qwen3_lora_trains_resumes_and_round_trips() {
    use flame::train::rundir::read_log;
    use flame::train::{Event, Prepare, RunOptions, TrainConfig, Trainer};
    let d = temp("qwen3");
    let images = d.join("images");
    flame::train::demo::make_tiny_images(&images).unwrap();
    let config = |dir: &std::path::Path| {
        let p = klein_config(dir, &images, 4, "peft");
        let text = std::fs::read_to_string(&p).unwrap().replace(
            "format = \"peft\"",
            "format = \"peft\"\ntext_encoders = [\"qwen3\"]",
        );
        std::fs::write(&p, &text[..text.find("[sample]").unwrap()]).unwrap();
        TrainConfig::from_file(p).unwrap()
    };
    let open = |cfg: &TrainConfig| {
        let mut notes = vec![];
        let t = Trainer::open(cfg.clone(), Prepare::Encode, &mut |e| {
            if let Event::Note(n) = e {
                notes.push(n)
            }
        })
        .unwrap();
        (t, notes)
    };
    let host = |t: &Trainer| -> Vec<(String, Vec<f64>)> {
        t.param_lists().unwrap()[1]
            .1
            .iter()
            .map(|(n, x)| (n.clone(), x.to_vec_f64().unwrap()))
            .collect()
    };
    let cfg = config(&d);
    let (mut t, notes) = open(&cfg);
    let said = notes
        .iter()
        .find(|n| n.starts_with("text encoders:"))
        .unwrap_or_else(|| panic!("{notes:?}"));
    assert!(
        said.contains("qwen3 trained") && said.contains("context"),
        "{said}"
    );
    let before = host(&t);
    assert!(
        before
            .iter()
            .all(|(n, _)| n.starts_with("lora_te_model.layers.")),
        "{}",
        before[0].0
    );
    t.run(&RunOptions::default(), &mut |_| {}).unwrap();
    let after = host(&t);
    let moved = before
        .iter()
        .zip(&after)
        .filter(|((_, x), (_, y))| x != y)
        .count();
    assert_eq!(
        moved,
        before.len(),
        "every tensor of Qwen3's adapters trains"
    );
    drop(t);
    let out = d.join("out");
    let names: Vec<String> =
        flame::safetensors::SafeTensorsFile::open(out.join("lora.safetensors"))
            .unwrap()
            .names()
            .map(str::to_string)
            .collect();
    for k in [
        "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight",
        "text_encoder.model.layers.1.mlp.down_proj.lora_B.weight",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} not in {names:?}");
    }
    let full = read_log(&out.join("loss.jsonl")).unwrap();
    let lora = flame::train::metadata::content(&out.join("lora.safetensors")).unwrap();
    // The checkpoint reads back into a fresh run with the trained values.
    let mut t = open(&cfg).0;
    t.load_checkpoint(&out.join("checkpoint-0000004")).unwrap();
    assert_eq!(host(&t), after);
    drop(t);

    let d2 = temp("qwen3-resumed");
    let cfg = config(&d2);
    let stop = RunOptions {
        stop_at: Some(2),
        ..Default::default()
    };
    open(&cfg).0.run(&stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    open(&cfg).0.run(&resume, &mut |_| {}).unwrap();
    let out = d2.join("out");
    assert_eq!(read_log(&out.join("loss.jsonl")).unwrap(), full);
    assert_eq!(
        flame::train::metadata::content(&out.join("lora.safetensors")).unwrap(),
        lora
    );
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&d2).ok();
}
