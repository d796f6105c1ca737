//! The samplers against diffusers 0.42.1: scheduler tables and steps, and whole denoising
//! trajectories on the tiny random models of tests/fixtures/models. Fixtures
//! (tests/fixtures/sampler/) are made by scripts/make_sampler_fixtures.py: diffusers'
//! schedulers and pipelines (FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline
//! with prompt embeddings given) in float32 on the CPU.
//!
//! Tolerances, max |flame - diffusers| / max |diffusers| per tensor (f32):
//! - [`TABLE_TOL`] for timesteps, sigmas and ᾱ: diffusers' float32 arithmetic is reproduced, so
//!   they agree to an ulp or two (torch's float32 pow(x, 0.5) is not always correctly rounded);
//! - [`STEP_TOL`] for one scheduler step from given model outputs;
//! - [`TRAJECTORY_TOL`] (the required bound) for the latents after every step of a pipeline run.
//!   Measured worst: flux_dev 4.1e-6 (the same loop run by diffusers in f64 is 4.1e-6 from
//!   its own f32 run: the reference's rounding, mostly its f32 timestep and guidance
//!   embeddings of t x 1000), flux_schnell 3.3e-7, sd35 4.4e-7, sdxl_euler 8.9e-7,
//!   sdxl_ddim 9.6e-7.
//!
//! CUDA runs are ignored without a GPU; run them with --include-ignored there.
#![cfg(feature = "cpu-ref")]

use flame::models::{self, DiffusionModel, LoadOptions};
use flame::sample::{
    denoise, Ddim, DdpmConfig, EulerDiscrete, FlowMatchConfig, FlowMatchEuler, Guidance, Schedule,
    StepInfo,
};
use flame::train::Prediction;
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;
const TABLE_TOL: f64 = 1e-6;
const STEP_TOL: f64 = 1e-6;
const TRAJECTORY_TOL: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sampler")
        .join(format!("{name}.safetensors"))
}

fn load(name: &str, dev: &Device) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture(name), dev).unwrap()
}

/// max |got - want| / max |want| (max |got - want| where the reference is all zero).
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    if scale == 0.0 {
        err
    } else {
        err / scale
    }
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn check(what: &str, got: &[f64], want: &Tensor, tol: f64) -> f64 {
    let e = rel_err(got, &vals(want));
    assert!(e <= tol, "{what}: error {e:e} > {tol:e}");
    e
}

// ---------------------------------------------------------------------------------------------
// Schedulers

#[test]
fn flow_match_tables_match_diffusers() {
    let f = load("schedulers", &CPU);
    let mut cases = 0;
    for key in f.keys().filter(|k| k.ends_with(".sigmas")) {
        let parts: Vec<&str> = key.split('.').collect();
        if parts[0] != "flow" {
            continue;
        }
        let (cfg, n, seq): (&str, usize, usize) = (
            parts[1],
            parts[2].parse().unwrap(),
            parts[3].parse().unwrap(),
        );
        let s = match cfg {
            "flux_dev" => FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), n, seq),
            "flux_schnell" => FlowMatchEuler::flux(&FlowMatchConfig::flux_schnell(), n, seq),
            "sd3" => FlowMatchEuler::sd3(&FlowMatchConfig::sd3(), n, seq),
            other => panic!("unknown case {other}"),
        }
        .unwrap();
        let stem = key.trim_end_matches(".sigmas");
        let ts = &f[&format!("{stem}.timesteps")];
        assert_eq!(s.timesteps.len(), n, "{stem}");
        check(
            &format!("{stem} sigmas"),
            &f64s(&s.sigmas),
            &f[key],
            TABLE_TOL,
        );
        check(
            &format!("{stem} timesteps"),
            &f64s(&s.timesteps),
            ts,
            TABLE_TOL,
        );
        cases += 1;
    }
    assert_eq!(cases, 14, "flow cases in the fixture");
}

#[test]
fn flow_match_step_matches_diffusers() {
    let f = load("schedulers", &CPU);
    let s = FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 4, 256).unwrap();
    let (x, v) = (&f["flow.step.sample"], &f["flow.step.model_output"]);
    for i in 0..4 {
        let got = s.step(v, i, x).unwrap();
        check(
            &format!("flow step {i}"),
            &vals(&got),
            &f[&format!("flow.step.prev.{i}")],
            STEP_TOL,
        );
        assert_eq!(s.model_time(i).unwrap(), s.sigmas[i]);
    }
    assert!(s.step(v, 4, x).is_err(), "a step past the schedule");
}

#[test]
fn flux_mu_is_calculate_shift() {
    // FluxPipeline.calculate_shift(1024) = 0.5 + (1024 - 256) * 0.65 / 3840.
    let mu = FlowMatchConfig::flux_dev().mu(1024);
    assert!((mu - (0.5 + 768.0 * 0.65 / 3840.0)).abs() < 1e-15, "{mu}");
    assert!((FlowMatchConfig::flux_dev().mu(4096) - 1.15).abs() < 1e-12);
    // BFL's get_lin_function, which training's flux shift uses, is the same line.
    assert!((flame::train::flux_mu(1024) - mu).abs() < 1e-12);
}

fn pred_of(name: &str) -> Prediction {
    match name {
        "epsilon" => Prediction::Epsilon,
        "v_prediction" => Prediction::V,
        other => panic!("unknown prediction {other}"),
    }
}

#[test]
fn alphas_cumprod_match_diffusers() {
    let f = load("schedulers", &CPU);
    let ac = DdpmConfig::sdxl().alphas_cumprod();
    check(
        "alphas_cumprod",
        &f64s(&ac),
        &f["betas.alphas_cumprod"],
        TABLE_TOL,
    );
}

#[test]
fn euler_tables_and_steps_match_diffusers() {
    let f = load("schedulers", &CPU);
    for pred in ["epsilon", "v_prediction"] {
        for n in [1, 5, 30, 50] {
            let s = EulerDiscrete::sdxl(n, pred_of(pred)).unwrap();
            let stem = format!("euler.{pred}.{n}");
            check(
                &stem,
                &f64s(&s.timesteps),
                &f[&format!("{stem}.timesteps")],
                0.0,
            );
            check(
                &stem,
                &f64s(&s.sigmas),
                &f[&format!("{stem}.sigmas")],
                TABLE_TOL,
            );
            check(
                &stem,
                &[s.init_noise_sigma() as f64],
                &f[&format!("{stem}.init_noise_sigma")],
                TABLE_TOL,
            );
        }
        let s = EulerDiscrete::sdxl(5, pred_of(pred)).unwrap();
        let (x, m) = (
            &f[&format!("euler.{pred}.step.sample")],
            &f[&format!("euler.{pred}.step.model_output")],
        );
        for i in 0..5 {
            let scaled = s.scale_model_input(x, i).unwrap();
            let key = format!("euler.{pred}.step.scaled.{i}");
            check(&key, &vals(&scaled), &f[&key], STEP_TOL);
            let key = format!("euler.{pred}.step.prev.{i}");
            check(&key, &vals(&s.step(m, i, x).unwrap()), &f[&key], STEP_TOL);
        }
    }
}

#[test]
fn ddim_tables_and_steps_match_diffusers() {
    let f = load("schedulers", &CPU);
    for pred in ["epsilon", "v_prediction"] {
        for n in [1, 5, 30, 50, 999] {
            let s = Ddim::sdxl(n, pred_of(pred)).unwrap();
            let stem = format!("ddim.{pred}.{n}");
            check(
                &stem,
                &f64s(&s.timesteps),
                &f[&format!("{stem}.timesteps")],
                0.0,
            );
            for what in ["alphas_cumprod_t", "alphas_cumprod_prev"] {
                let got = match what {
                    "alphas_cumprod_t" => &s.alphas_cumprod_t,
                    _ => &s.alphas_cumprod_prev,
                };
                let key = format!("{stem}.{what}");
                check(&key, &f64s(got), &f[&key], TABLE_TOL);
            }
        }
        let s = Ddim::sdxl(5, pred_of(pred)).unwrap();
        let (x, m) = (
            &f[&format!("ddim.{pred}.step.sample")],
            &f[&format!("ddim.{pred}.step.model_output")],
        );
        for i in 0..5 {
            let key = format!("ddim.{pred}.step.prev.{i}");
            check(&key, &vals(&s.step(m, i, x).unwrap()), &f[&key], STEP_TOL);
        }
    }
}

#[test]
fn leading_spacing_off_by_ones() {
    // "leading" with steps_offset 1 never starts at 999: 30 steps start at 29 * 33 + 1 = 958
    // and end at 1; 1000 steps would start at 1000, past the table (diffusers' DDIM raises an
    // IndexError there, its Euler clamps the sigma and hands the UNet t = 1000).
    let s = Ddim::sdxl(30, Prediction::Epsilon).unwrap();
    assert_eq!((s.timesteps[0], s.timesteps[29]), (958.0, 1.0));
    let e = Ddim::sdxl(1000, Prediction::Epsilon)
        .unwrap_err()
        .to_string();
    assert!(e.contains("timestep 1000"), "{e}");
    let s = EulerDiscrete::sdxl(1000, Prediction::Epsilon).unwrap();
    assert_eq!(s.timesteps[0], 1000.0);
    assert_eq!(s.sigmas[0], s.sigmas[1]);
}

#[test]
fn schedulers_refuse_bad_step_counts() {
    let msg = |e: Error| e.to_string();
    for e in [
        FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 0, 256).unwrap_err(),
        FlowMatchEuler::sd3(&FlowMatchConfig::sd3(), 0, 0).unwrap_err(),
        EulerDiscrete::sdxl(0, Prediction::Epsilon).unwrap_err(),
        Ddim::sdxl(0, Prediction::V).unwrap_err(),
    ] {
        let m = msg(e);
        assert!(m.contains("steps must be at least 1"), "{m}");
    }
    let m = msg(EulerDiscrete::sdxl(1001, Prediction::Epsilon).unwrap_err());
    assert!(m.contains("1001 steps, more than the 1000"), "{m}");
    let bad = FlowMatchConfig {
        shift: -1.0,
        ..FlowMatchConfig::sd3()
    };
    let m = msg(FlowMatchEuler::sd3(&bad, 4, 0).unwrap_err());
    assert!(m.contains("shift"), "{m}");
}

// ---------------------------------------------------------------------------------------------
// Trajectories

fn model(family: &str, name: &str, dev: &Device) -> Box<dyn DiffusionModel> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    let sub = models::family(family).unwrap().subfolder;
    // The tiny models' shapes do not pin their configs down: read config.json (as
    // tests/models.rs does).
    let json =
        serde_json::from_str(&std::fs::read_to_string(dir.join(sub).join("config.json")).unwrap())
            .unwrap();
    let mut opts = LoadOptions::new(DType::F32, dev);
    opts.config = Some(json);
    models::load(family, dir.join(sub), &opts).unwrap().model
}

/// Runs `case` with `schedule` on `dev` and checks the latents after every step; returns the
/// worst relative error. Classifier-free guidance runs both ways: its two predictions one
/// after the other, and as one batch (diffusers' way).
fn trajectory(case: &str, family: &str, name: &str, schedule: &dyn Schedule, dev: &Device) -> f64 {
    let f = load(case, dev);
    let mut worst = trajectory_as(case, family, name, schedule, dev, false);
    if f.contains_key("neg_context") {
        worst = worst.max(trajectory_as(case, family, name, schedule, dev, true));
    }
    worst
}

fn trajectory_as(
    case: &str,
    family: &str,
    name: &str,
    schedule: &dyn Schedule,
    dev: &Device,
    batched: bool,
) -> f64 {
    let f = load(case, dev);
    let m = model(family, name, dev);
    let ts = vals(&f["timesteps"]);
    check(
        &format!("{case} timesteps"),
        &f64s(schedule.timesteps()),
        &f["timesteps"],
        TABLE_TOL,
    );
    let mut cond = vec![f["context"].clone(), f["pooled"].clone()];
    if let Some(ids) = f.get("time_ids") {
        cond.push(ids.clone());
    }
    let g = f["guidance"].to_vec_f64().unwrap()[0];
    let guidance = match (f.get("neg_context"), m.guidance_input()) {
        (Some(nc), _) => {
            let mut un = vec![nc.clone(), f["neg_pooled"].clone()];
            if let Some(ids) = f.get("time_ids") {
                un.push(ids.clone());
            }
            Guidance::cfg(un, g).batched(batched)
        }
        (None, true) => Guidance::distilled(g),
        (None, false) => Guidance::none(),
    };
    let mut worst = 0f64;
    let mut seen = 0;
    let mut on_step = |s: &StepInfo<'_>| -> flame::Result<()> {
        assert_eq!(s.timestep as f64, ts[s.index]);
        let want = &f[&format!("latents.{}", s.index)];
        let e = check(
            &format!("{case} on {dev}: latents after step {}", s.index),
            &vals(s.latents),
            want,
            TRAJECTORY_TOL,
        );
        worst = worst.max(e);
        seen += 1;
        Ok(())
    };
    let out = denoise(
        &*m,
        schedule,
        &f["noise"],
        &cond,
        &guidance,
        Some(&mut on_step),
    )
    .unwrap();
    assert_eq!(seen, ts.len(), "{case}: callback calls");
    let last = &f[&format!("latents.{}", ts.len() - 1)];
    check(
        &format!("{case}: the returned latents"),
        &vals(&out),
        last,
        TRAJECTORY_TOL,
    );
    println!(
        "{case} on {dev} (guidance batched: {batched}): {} steps, worst latents error {worst:.2e}",
        ts.len()
    );
    worst
}

#[test]
fn flux_dev_trajectory_matches_diffusers() {
    // (2, 4, 8, 6) latents: 4 x 3 packed tokens.
    let s = FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 6, 12).unwrap();
    trajectory("flux_dev", "flux", "flux", &s, &CPU);
}

#[test]
fn flux_schnell_trajectory_matches_diffusers() {
    let s = FlowMatchEuler::flux(&FlowMatchConfig::flux_schnell(), 4, 12).unwrap();
    trajectory("flux_schnell", "flux", "flux_schnell", &s, &CPU);
}

#[test]
fn sd35_cfg_trajectory_matches_diffusers() {
    let s = FlowMatchEuler::sd3(&FlowMatchConfig::sd3(), 5, 12).unwrap();
    trajectory("sd35", "sd3", "sd35_large", &s, &CPU);
}

#[test]
fn sdxl_euler_cfg_trajectory_matches_diffusers() {
    let s = EulerDiscrete::sdxl(5, Prediction::Epsilon).unwrap();
    trajectory("sdxl_euler", "sdxl", "sdxl", &s, &CPU);
}

#[test]
fn sdxl_ddim_cfg_trajectory_matches_diffusers() {
    let s = Ddim::sdxl(5, Prediction::Epsilon).unwrap();
    trajectory("sdxl_ddim", "sdxl", "sdxl", &s, &CPU);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn flux_dev_trajectory_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    let s = FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 6, 12).unwrap();
    trajectory("flux_dev", "flux", "flux", &s, &dev);
    let s = EulerDiscrete::sdxl(5, Prediction::Epsilon).unwrap();
    trajectory("sdxl_euler", "sdxl", "sdxl", &s, &dev);
}

// ---------------------------------------------------------------------------------------------
// Errors

fn err_of(r: flame::Result<Tensor>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn denoise_refuses_bad_arguments_naming_them() {
    let f = load("sd35", &CPU);
    let m = model("sd3", "sd35_large", &CPU);
    let s = FlowMatchEuler::sd3(&FlowMatchConfig::sd3(), 2, 12).unwrap();
    let (noise, ctx, pooled) = (&f["noise"], &f["context"], &f["pooled"]);
    let cond = vec![ctx.clone(), pooled.clone()];
    let none = Guidance::none();
    let run = |s: &dyn Schedule, noise: &Tensor, cond: &[Tensor], g: &Guidance| {
        err_of(denoise(&*m, s, noise, cond, g, None))
    };

    // A DDPM schedule for a flow-matching model.
    let e = run(
        &Ddim::sdxl(2, Prediction::Epsilon).unwrap(),
        noise,
        &cond,
        &none,
    );
    assert!(e.contains("Ddpm schedule for a sd3 model"), "{e}");
    // Too few conditioning tensors.
    let e = run(&s, noise, &cond[..1], &none);
    assert!(
        e.contains("1 tensors, the model takes 2 (context, pooled)"),
        "{e}"
    );
    // A context of the wrong width, a pooled of another batch.
    let e = run(
        &s,
        noise,
        &[ctx.narrow(2, 0, 20).unwrap(), pooled.clone()],
        &none,
    );
    assert!(e.contains("context") && e.contains("24"), "{e}");
    let e = run(
        &s,
        noise,
        &[ctx.clone(), pooled.narrow(0, 0, 1).unwrap()],
        &none,
    );
    assert!(
        e.contains("pooled has shape [1, 20]") && e.contains("batch"),
        "{e}"
    );
    // Noise of the wrong rank, channels, or odd size (patch 2), or too large for the table.
    let e = run(
        &s,
        &noise.narrow(1, 0, 1).unwrap().squeeze(1).unwrap(),
        &cond,
        &none,
    );
    assert!(e.contains("noise must be (B, C, H, W)"), "{e}");
    let e = run(&s, &noise.narrow(1, 0, 3).unwrap(), &cond, &none);
    assert!(e.contains("noise (batch excluded)"), "{e}");
    let e = run(&s, &noise.narrow(3, 0, 5).unwrap(), &cond, &none);
    assert!(e.contains("noise (batch excluded)"), "{e}");
    let big = Tensor::zeros((2, 4, 18, 6), DType::F32, &CPU).unwrap();
    let e = run(&s, &big, &cond, &none);
    assert!(e.contains("position table"), "{e}");
    // Guidance: negative, non-finite, mismatched uncond, distilled for a model without.
    let un = vec![f["neg_context"].clone(), f["neg_pooled"].clone()];
    let e = run(&s, noise, &cond, &Guidance::cfg(un.clone(), -1.0));
    assert!(
        e.contains("classifier-free guidance scale -1 must be finite and >= 0"),
        "{e}"
    );
    let e = run(&s, noise, &cond, &Guidance::cfg(un.clone(), f64::NAN));
    assert!(e.contains("NaN must be finite"), "{e}");
    let short = vec![
        f["neg_context"].narrow(1, 0, 3).unwrap(),
        f["neg_pooled"].clone(),
    ];
    let e = run(&s, noise, &cond, &Guidance::cfg(short, 4.5));
    assert!(e.contains("uncond vs cond"), "{e}");
    let e = run(&s, noise, &cond, &Guidance::cfg(un[..1].to_vec(), 4.5));
    assert!(e.contains("uncond: 1 tensors"), "{e}");
    let e = run(&s, noise, &cond, &Guidance::distilled(3.5));
    assert!(e.contains("has no guidance input"), "{e}");
    // An empty custom schedule.
    struct Empty;
    impl Schedule for Empty {
        fn timesteps(&self) -> &[f32] {
            &[]
        }
        fn process(&self) -> flame::sample::Process {
            flame::sample::Process::FlowMatching
        }
        fn model_time(&self, _: usize) -> flame::Result<f32> {
            Ok(1.0)
        }
        fn step(&self, m: &Tensor, _: usize, _: &Tensor) -> flame::Result<Tensor> {
            Ok(m.clone())
        }
    }
    let e = run(&Empty, noise, &cond, &none);
    assert!(e.contains("no steps"), "{e}");
    // A callback's error stops the loop after its step and is returned.
    let mut calls = 0;
    let mut stop = |_: &StepInfo<'_>| -> flame::Result<()> {
        calls += 1;
        Err(Error::Config {
            path: None,
            msg: "stopped by the callback".into(),
        })
    };
    let e = err_of(denoise(&*m, &s, noise, &cond, &none, Some(&mut stop)));
    assert!(e.contains("stopped by the callback"), "{e}");
    assert_eq!(calls, 1);
}

#[test]
fn flux_dev_needs_distilled_guidance_and_records_no_graph() {
    let f = load("flux_dev", &CPU);
    let m = model("flux", "flux", &CPU);
    let s = FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 1, 12).unwrap();
    let cond = vec![f["context"].clone(), f["pooled"].clone()];
    let e = err_of(denoise(
        &*m,
        &s,
        &f["noise"],
        &cond,
        &Guidance::none(),
        None,
    ));
    assert!(e.contains("guidance-distilled") && e.contains("3.5"), "{e}");
    let e = err_of(denoise(
        &*m,
        &s,
        &f["noise"],
        &cond,
        &Guidance::distilled(-0.5),
        None,
    ));
    assert!(e.contains("distilled guidance scale -0.5"), "{e}");
    // Inputs that require gradients give latents without a graph.
    let noise = f["noise"].detach().requires_grad_().unwrap();
    let out = denoise(&*m, &s, &noise, &cond, &Guidance::distilled(3.5), None).unwrap();
    assert!(!out.requires_grad(), "the loop recorded autograd ops");
}
