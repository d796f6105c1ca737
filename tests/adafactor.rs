//! Adafactor against transformers 5's `transformers.optimization.Adafactor`: 30 steps on
//! 1-D, 2-D (one of them all zeros, as a LoRA up matrix starts) and 4-D f32 parameters in
//! kohya's settings (a given lr on a cosine schedule), the relative-step default, and both
//! with beta1 and weight decay, each step's parameters within 1e-5 of the package's relative
//! to the tensor's scale (fixtures: scripts/make_optimizer_fixtures.py); state saved and
//! loaded resumes bit for bit, alone and in parameter groups; bad state files and settings
//! are refused. The fused step against its composite twin (`Adafactor::step_composite`) on
//! odd sizes, f32, bf16 and f16, every option combination, within f32 rounding; and (ignored
//! unless on a GPU) CUDA against the CPU reference, its parameters bit for bit.
#![cfg(feature = "cpu-ref")]

mod common;
use common::optim::{bits, copies, f32s, grads_at, opt_err, param_on, Lcg};
use common::TempFile;
use flame::optim::{build_groups, Adafactor, AdafactorConfig, Optimizer, OptimizerConfig};
use flame::safetensors::SafeTensorsFile;
use flame::{DType, Device, Grads, Tensor};
use std::path::Path;

#[path = "adafactor/gpu.rs"]
mod gpu;

const STEPS: usize = 30;
const PARAMS: [&str; 4] = ["p_b", "p_a", "p_zero", "p_conv"];

/// The case's settings, as the script calls `Adafactor(...)`.
fn case_config(case: &str) -> AdafactorConfig {
    let kohya = AdafactorConfig::with_given_lr(1e-3);
    match case {
        "kohya" => kohya,
        "default" => AdafactorConfig::default(),
        "momentum" => AdafactorConfig {
            beta1: Some(0.9),
            weight_decay: 0.01,
            ..kohya
        },
        "warmup" => AdafactorConfig {
            warmup_init: true,
            beta1: Some(0.9),
            weight_decay: 0.01,
            clip_threshold: 0.5,
            decay_rate: -0.7,
            ..Default::default()
        },
        other => panic!("no case {other}"),
    }
}

fn f32_of(f: &SafeTensorsFile, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = f.load(name, &Device::Cpu).unwrap();
    (f32s(&t), t.dims().to_vec())
}

#[test]
fn equals_transformers_over_30_steps() {
    for case in ["kohya", "default", "momentum", "warmup"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/fixtures/optim/adafactor_{case}.safetensors"));
        let f = SafeTensorsFile::open(&path).unwrap();
        let params: Vec<(String, Tensor)> = PARAMS
            .iter()
            .map(|p| {
                let (v, dims) = f32_of(&f, &format!("init.{p}"));
                (p.to_string(), param_on(v, &dims, DType::F32, &Device::Cpu))
            })
            .collect();
        let config = case_config(case);
        let mut opt = Adafactor::new(params.clone(), config).unwrap();
        let lrs = f.load("lr", &Device::Cpu).unwrap().to_vec_f64().unwrap();
        let mut worst = 0.0f64;
        for (k, &lr) in lrs.iter().enumerate().take(STEPS) {
            if !config.relative_step {
                opt.set_learning_rate(lr);
            }
            // The script's gradient, in f32: (p - target) + noise[k].
            let mut g = Grads::new();
            for (name, p) in &params {
                let (target, _) = f32_of(&f, &format!("target.{name}"));
                let (noise, _) = f32_of(&f, &format!("noise.{name}"));
                let n = p.elem_count();
                let v: Vec<f32> = f32s(p)
                    .iter()
                    .zip(&target)
                    .zip(&noise[k * n..(k + 1) * n])
                    .map(|((&x, &t), &e)| (x - t) + e)
                    .collect();
                g.insert(
                    p,
                    Tensor::from_vec(v, p.dims().to_vec(), &Device::Cpu).unwrap(),
                );
            }
            opt.step(&g).unwrap();
            for (name, p) in &params {
                let (traj, _) = f32_of(&f, &format!("traj.{name}"));
                let n = p.elem_count();
                let want = &traj[k * n..(k + 1) * n];
                let scale = (want.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n as f64)
                    .sqrt()
                    .max(1e-30);
                for (i, (&a, &b)) in f32s(p).iter().zip(want).enumerate() {
                    let err = f64::from(a - b).abs() / f64::from(b).abs().max(scale);
                    worst = worst.max(err);
                    assert!(
                        err <= 1e-5,
                        "{case}: step {k}, {name}[{i}]: {a} vs transformers' {b} (relative {err:e})"
                    );
                }
            }
        }
        // The run moved every parameter: the comparison has teeth.
        for (name, p) in &params {
            let (init, _) = f32_of(&f, &format!("init.{name}"));
            assert_ne!(f32s(p), init, "{case}: {name} moved");
        }
        let st = opt.state("p_conv").unwrap();
        assert_eq!(st.step, STEPS as u64);
        assert_eq!(st.exp_avg_sq_row.as_ref().unwrap().dims(), &[2, 3, 4]);
        assert_eq!(st.exp_avg_sq_col.as_ref().unwrap().dims(), &[2, 3, 5]);
        assert!(st.exp_avg_sq.is_none());
        assert_eq!(st.exp_avg.is_some(), config.beta1.is_some());
        assert!(opt.state("p_b").unwrap().exp_avg_sq.is_some());
        println!("{case}: worst relative error {worst:e}");
    }
}

/// Parameters of each rank and a bf16 one.
fn make_params() -> Vec<(String, Tensor)> {
    let mut r = Lcg(11);
    let dev = Device::Cpu;
    vec![
        ("bias".into(), param_on(r.vec(7), &[7], DType::F32, &dev)),
        (
            "down".into(),
            param_on(r.vec(24), &[4, 6], DType::F32, &dev),
        ),
        (
            "conv".into(),
            param_on(r.vec(120), &[2, 3, 4, 5], DType::F32, &dev),
        ),
        (
            "half".into(),
            param_on(r.vec(15), &[5, 3], DType::BF16, &dev),
        ),
    ]
}

/// Steps `steps`; with `schedule`, the rate set before each (a given lr's decay).
fn run(
    opt: &mut dyn Optimizer,
    params: &[(String, Tensor)],
    steps: std::ops::Range<u64>,
    schedule: bool,
) {
    for k in steps {
        if schedule {
            opt.set_learning_rate(1e-2 / (1.0 + k as f64));
        }
        opt.step(&grads_at(params, k)).unwrap();
    }
}

fn param_bits(params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    params.iter().map(|(_, t)| bits(t)).collect()
}

#[test]
fn state_resumes_bit_for_bit_alone_and_in_groups() {
    let configs = [
        OptimizerConfig::Adafactor(AdafactorConfig::default()),
        OptimizerConfig::Adafactor(AdafactorConfig {
            beta1: Some(0.9),
            weight_decay: 0.01,
            ..AdafactorConfig::with_given_lr(1e-2)
        }),
    ];
    for config in configs {
        let sched = matches!(config, OptimizerConfig::Adafactor(c) if !c.relative_step);
        for grouped in [false, true] {
            let build = |ps: &[(String, Tensor)]| -> Box<dyn Optimizer> {
                match grouped {
                    false => config.build(ps.to_vec()).unwrap(),
                    true => build_groups(
                        config,
                        vec![
                            flame::optim::ParamGroup {
                                name: "default".into(),
                                lr_scale: 1.0,
                                weight_decay: None,
                                params: ps[..2].to_vec(),
                            },
                            flame::optim::ParamGroup {
                                name: "up".into(),
                                lr_scale: 4.0,
                                weight_decay: Some(0.0),
                                params: ps[2..].to_vec(),
                            },
                        ],
                    )
                    .unwrap(),
                }
            };
            let full = make_params();
            run(&mut *build(&full), &full, 0..10, sched);
            let want = param_bits(&full);

            let first = make_params();
            let mut opt = build(&first);
            run(&mut *opt, &first, 0..5, sched);
            let file = TempFile::new("adafactor");
            opt.save_state(file.path()).unwrap();
            let resumed = copies(&first);
            let mut opt = build(&resumed);
            opt.load_state(file.path()).unwrap();
            run(&mut *opt, &resumed, 5..10, sched);
            assert_eq!(param_bits(&resumed), want, "{config:?}, grouped {grouped}");

            // Without the state the run ends elsewhere.
            let fresh = copies(&first);
            run(&mut *build(&fresh), &fresh, 5..10, sched);
            assert_ne!(param_bits(&fresh), want, "{config:?}, grouped {grouped}");

            let st = SafeTensorsFile::open(file.path()).unwrap();
            let pre = if grouped { "group.0." } else { "" };
            let m = st.metadata();
            let kind = m.get("optimizer").map(String::as_str);
            assert_eq!(kind, Some(if grouped { "groups" } else { "adafactor" }));
            assert_eq!(m[&format!("{pre}step.down")], "5");
            assert_eq!(
                st.info(&format!("{pre}down.exp_avg_sq_row")).unwrap().shape,
                [4]
            );
            assert_eq!(
                st.info(&format!("{pre}down.exp_avg_sq_col")).unwrap().shape,
                [6]
            );
            assert!(st.contains(&format!("{pre}bias.exp_avg_sq")));
        }
    }
}

#[test]
fn bad_state_files_and_settings_are_refused() {
    let params = make_params();
    let mut opt = Adafactor::new(params.clone(), AdafactorConfig::default()).unwrap();
    run(&mut opt, &params, 0..2, false);
    let file = TempFile::new("adafactor-bad");
    opt.save_state(file.path()).unwrap();
    let st = SafeTensorsFile::open(file.path()).unwrap();
    assert_eq!(st.metadata()["beta1"], "none");
    assert_eq!(st.metadata()["relative_step"], "true");
    // A factored moment of the wrong shape, and a missing one.
    let bad = TempFile::new("adafactor-bad2");
    let mut tensors: Vec<(String, Tensor)> = st
        .names()
        .filter(|n| *n != "down.exp_avg_sq_col")
        .map(|n| (n.to_string(), st.load(n, &Device::Cpu).unwrap()))
        .collect();
    flame::safetensors::save_with_metadata(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        st.metadata(),
        bad.path(),
    )
    .unwrap();
    let mut other = Adafactor::new(copies(&params), AdafactorConfig::default()).unwrap();
    let (_, msg) = opt_err(other.load_state(bad.path()));
    assert!(
        msg.contains("'down'") && msg.contains("exp_avg_sq_col"),
        "{msg}"
    );
    tensors.push((
        "down.exp_avg_sq_col".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
    ));
    flame::safetensors::save_with_metadata(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        st.metadata(),
        bad.path(),
    )
    .unwrap();
    let (_, msg) = opt_err(other.load_state(bad.path()));
    assert!(msg.contains("[6]"), "{msg}");
    // transformers' own refusal, and values out of range.
    for (c, want) in [
        (
            AdafactorConfig {
                warmup_init: true,
                ..AdafactorConfig::with_given_lr(1e-3)
            },
            "warmup_init",
        ),
        (
            AdafactorConfig {
                clip_threshold: 0.0,
                ..Default::default()
            },
            "clip_threshold",
        ),
        (
            AdafactorConfig {
                decay_rate: 0.5,
                ..Default::default()
            },
            "decay_rate",
        ),
        (
            AdafactorConfig {
                beta1: Some(1.0),
                ..Default::default()
            },
            "beta1",
        ),
    ] {
        let (name, msg) = opt_err(Adafactor::new(copies(&params), c));
        assert_eq!(name, "Adafactor");
        assert!(msg.contains(want), "{msg}");
    }
}

/// Parameters of odd sizes: 1-D (257 values, one), factored 37x53 (f32 and bf16), 1x1, a
/// 4-D one of two (3, 5) matrices per leading index; an f16 matrix and a bf16 vector of
/// several chunks (4096 values a chunk).
fn odd_params(dev: &Device) -> Vec<(String, Tensor)> {
    let mut r = Lcg(23);
    [
        ("v257", vec![257], DType::F32),
        ("one", vec![1], DType::F32),
        ("m37x53", vec![37, 53], DType::F32),
        ("h37x53", vec![37, 53], DType::BF16),
        ("s1x1", vec![1, 1], DType::F32),
        ("conv", vec![2, 2, 3, 5], DType::BF16),
        ("f70x130", vec![70, 130], DType::F16),
        ("b4097", vec![4097], DType::BF16),
    ]
    .into_iter()
    .map(|(n, dims, dt)| {
        let len = dims.iter().product();
        (n.to_string(), param_on(r.vec(len), &dims, dt, dev))
    })
    .collect()
}

/// The option combinations: the existing tests' (kohya, the default, beta1 with weight decay,
/// the warm-up) and the rest of scale_parameter x relative_step x beta1 x weight decay.
fn option_cases() -> Vec<AdafactorConfig> {
    let mut v = vec![
        case_config("kohya"),
        case_config("default"),
        case_config("momentum"),
        case_config("warmup"),
    ];
    for scale_parameter in [false, true] {
        for relative_step in [false, true] {
            for beta1 in [None, Some(0.8)] {
                for weight_decay in [0.0, 0.05] {
                    v.push(AdafactorConfig {
                        lr: if relative_step { 0.7 } else { 3e-3 },
                        scale_parameter,
                        relative_step,
                        beta1,
                        weight_decay,
                        clip_threshold: 0.9,
                        ..Default::default()
                    });
                }
            }
        }
    }
    v
}

/// The same gradients for two copies of the parameters, made from `from`'s values (so a
/// difference between the copies does not feed back into their gradients).
fn twin_grads(
    from: &[(String, Tensor)],
    a: &[(String, Tensor)],
    b: &[(String, Tensor)],
    k: u64,
) -> (Grads, Grads) {
    let src = grads_at(from, k);
    let (mut ga, mut gb) = (Grads::new(), Grads::new());
    for (((_, f), (_, pa)), (_, pb)) in from.iter().zip(a).zip(b) {
        let g = src.get(f).unwrap();
        let on = |p: &Tensor| {
            Tensor::from_host(g.to_host().unwrap(), p.dims().to_vec(), p.device()).unwrap()
        };
        ga.insert(pa, on(pa));
        gb.insert(pb, on(pb));
    }
    (ga, gb)
}

/// The state tensors of one parameter, in a fixed order (absent ones empty).
fn state_of(opt: &Adafactor, name: &str) -> Vec<Vec<f64>> {
    let st = opt.state(name).unwrap();
    [
        &st.exp_avg,
        &st.exp_avg_sq_row,
        &st.exp_avg_sq_col,
        &st.exp_avg_sq,
    ]
    .iter()
    .map(|t| t.as_ref().map_or(vec![], |t| t.to_vec_f64().unwrap()))
    .collect()
}

/// |a - b| <= tol * max(|b|, the RMS of `want`), elementwise.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let n = want.len().max(1) as f64;
    let scale = (want.iter().map(|x| x * x).sum::<f64>() / n)
        .sqrt()
        .max(1e-30);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() / b.abs().max(scale);
        assert!(err <= tol, "{what}[{i}]: {a} vs {b} (relative {err:e})");
    }
}

/// Six steps (a grad scale on some) of the fused step and of the composite on copies: every
/// parameter within a few f32 roundings of the composite's (one ulp of bf16 and f16 where
/// a rounding falls the other way), every state within f32 rounding, and the step moved the
/// f32 parameters.
#[test]
fn the_fused_step_equals_the_composite() {
    for c in option_cases() {
        let reference = odd_params(&Device::Cpu);
        let fused = copies(&reference);
        let mut oc = Adafactor::new(reference.clone(), c).unwrap();
        let mut of = Adafactor::new(fused.clone(), c).unwrap();
        for k in 0..6u64 {
            let scale = if k % 2 == 1 { 0.5 } else { 1.0 };
            let (gc, gf) = twin_grads(&reference, &reference, &fused, k);
            oc.step_composite(&gc, scale).unwrap();
            of.step_scaled(&gf, scale).unwrap();
            for ((name, pc), (_, pf)) in reference.iter().zip(&fused) {
                let tol = match pc.dtype() {
                    DType::F32 => 2e-6,
                    DType::BF16 => 2f64.powi(-7),
                    _ => 2f64.powi(-10),
                };
                let what = format!("{c:?} step {k} {name}");
                assert_close(
                    &what,
                    &pf.to_vec_f64().unwrap(),
                    &pc.to_vec_f64().unwrap(),
                    tol,
                );
                for (s, (a, b)) in state_of(&of, name)
                    .iter()
                    .zip(state_of(&oc, name))
                    .enumerate()
                {
                    assert_close(&format!("{what} state {s}"), a, &b, 2e-5);
                }
            }
        }
        // Every f32 parameter moved (warmup_init's first steps are below bf16's resolution).
        let start = odd_params(&Device::Cpu);
        for ((name, p), (_, s)) in fused.iter().zip(&start) {
            if p.dtype() == DType::F32 {
                assert!(bits(p) != bits(s), "{c:?}: {name} did not move");
            }
        }
    }
}

/// An f64 parameter (which the fused kernels do not take) goes through the composite update
/// in f64, in the same step as the fused ones: its result is the composite's to the bit.
#[test]
fn f64_parameters_take_the_composite_update() {
    let v: Vec<f32> = (0..24).map(|i| i as f32 * 0.1 - 1.0).collect();
    let a = vec![
        (
            "d".to_string(),
            param_on(v.clone(), &[4, 6], DType::F64, &Device::Cpu),
        ),
        (
            "f".to_string(),
            param_on(v, &[24], DType::F32, &Device::Cpu),
        ),
    ];
    let b = copies(&a);
    let c = AdafactorConfig::default();
    let mut oa = Adafactor::new(a.clone(), c).unwrap();
    let mut ob = Adafactor::new(b.clone(), c).unwrap();
    for k in 0..3 {
        let (ga, gb) = twin_grads(&a, &a, &b, k);
        oa.step(&ga).unwrap();
        ob.step_composite(&gb, 1.0).unwrap();
    }
    assert_eq!(bits(&a[0].1), bits(&b[0].1));
    assert_eq!(oa.state("d").unwrap().step, 3);
    assert_close(
        "f",
        &a[1].1.to_vec_f64().unwrap(),
        &b[1].1.to_vec_f64().unwrap(),
        2e-6,
    );
}
