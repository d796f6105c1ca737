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
    // The pipeline folder's text_encoder/, tokenizer/ and vae/, found from its transformer/.
    let (located, _) = Sources::default()
        .locate(family(), &pipeline().join("transformer"), KEYS)
        .unwrap();
    TextConditioner::load(
        family(),
        &located,
        &TextOptions::default(),
        DType::F32,
        &CPU,
        "encoders",
    )
    .unwrap()
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
    };
    let noise: Vec<Tensor> = (0..2).map(|i| noise.narrow(0, i, 1).unwrap()).collect();
    let got = generate_from(&*m, &conds, Some(uncond), &req, &noise).unwrap();
    let got = Tensor::cat(&got.iter().collect::<Vec<_>>(), 0).unwrap();
    let e = check("generate_from", &got, &io["cfg.latents.3"], 1e-4);
    println!("klein generate_from captions: {e:.2e}");
}
