//! Adafactor against transformers 5's `transformers.optimization.Adafactor`: 30 steps on
//! 1-D, 2-D (one of them all zeros, as a LoRA up matrix starts) and 4-D f32 parameters in
//! kohya's settings (a given lr on a cosine schedule), the relative-step default, and both
//! with beta1 and weight decay, each step's parameters within 1e-5 of the package's relative
//! to the tensor's scale (fixtures: scripts/make_optimizer_fixtures.py); state saved and
//! loaded resumes bit for bit, alone and in parameter groups; bad state files and settings
//! are refused.
#![cfg(feature = "cpu-ref")]

mod common;
use common::optim::{bits, copies, f32s, grads_at, opt_err, param_on, Lcg};
use common::TempFile;
use flame::optim::{build_groups, Adafactor, AdafactorConfig, Optimizer, OptimizerConfig};
use flame::safetensors::SafeTensorsFile;
use flame::{DType, Device, Grads, Tensor};
use std::path::Path;

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
