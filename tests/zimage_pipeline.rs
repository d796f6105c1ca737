//! The Z-Image pipeline end to end against diffusers' `ZImagePipeline` on a tiny random
//! pipeline folder: captions to the transformer's text inputs ([`TextConditioner`]), the
//! sampler's trajectory with and without classifier-free guidance, the decoded image, and
//! the `sample` binary from the same starting latents. Fixtures (tests/fixtures/zimage_pipeline,
//! 2.0 MB) are made by scripts/make_zimage_pipeline_fixtures.py with diffusers 0.42.1 /
//! transformers 5.24.0 in f32 on the CPU.
//!
//! Guidance: diffusers' Z-Image computes pos + g (pos - neg) and guides when g > 0; FLAME's
//! sampler computes neg + s (pos - neg) and guides when s > 1, the same prediction at
//! s = g + 1 (docs/SAMPLING.md).
//!
//! Tolerance: max |flame - diffusers| / max |diffusers|, [`TOL`].
#![cfg(feature = "cpu-ref")]

mod common;

use common::check_rel;
use flame::models::pipeline::{conditioning, load_vae};
use flame::models::{
    self, family, LoadOptions, SampleSetup, Sources, TextConditioner, TextOptions,
};
use flame::sample::{denoise, generate_from, Guidance, Request, StepInfo};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;

/// f32 against diffusers' f32 (both round differently: the same network, other summation
/// orders). Measured on the CPU: text 5.4e-7, trajectories 2.1e-6 (turbo) and 1.5e-6
/// (CFG), images 8.9e-7.
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
            Guidance::cfg(neg.clone(), scale).batched(batched)
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
    };
    let out = generate_from(&*model, &[cond], Some(neg), &req, &[noise.clone()]).unwrap();
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
