//! Prodigy tests: parity with the prodigyopt package over 50 steps (fixtures written by
//! scripts/make_optimizer_fixtures.py), exact resume from a state file, the cases prodigyopt
//! treats apart (lr 0, an all-zero gradient, parameters starting at zero, beta1 = 0), mixed
//! parameter dtypes, errors, and (ignored unless on a GPU) CUDA against the CPU reference.
#![cfg(feature = "cpu-ref")]

mod common;
use common::optim::{bits, copies, f32s, grads_at, opt_err, param_on, Lcg};
use common::TempFile;
use flame::optim::{Optimizer, Prodigy, ProdigyConfig};
use flame::{DType, Device, Grads, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

#[path = "prodigy/gpu.rs"]
mod gpu;

// ----- helpers ---------------------------------------------------------------------------

/// Parameters of odd sizes and mixed dtypes, one starting at zero (a LoRA up matrix).
fn mixed_params(dev: &Device) -> Vec<(String, Tensor)> {
    let mut r = Lcg(5);
    let mut v: Vec<(String, Tensor)> = [
        (1, DType::F32),
        (7, DType::BF16),
        (4095, DType::F32),
        (4097, DType::F16),
        (9001, DType::BF16),
    ]
    .iter()
    .map(|&(n, dt)| (format!("p{n}"), param_on(r.vec(n), &[n], dt, dev)))
    .collect();
    v.push((
        "up".into(),
        param_on(vec![0.0; 5 * 3], &[5, 3], DType::F32, dev),
    ));
    v
}

/// Every value of a parameter's state and the parameter, as bits, for exact comparisons.
fn snapshot(opt: &Prodigy, params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    let mut out = vec![];
    for (name, p) in params {
        out.push(bits(p));
        let s = opt.state(name).unwrap();
        for t in s.exp_avg.iter().chain([&s.exp_avg_sq, &s.s]).chain(&s.p0) {
            out.push(bits(t));
        }
    }
    let e = opt.estimate().unwrap();
    out.push(
        [e.d, e.d_max, e.d_hat, e.d_numerator, e.d_denom]
            .iter()
            .map(|x| x.to_bits())
            .chain([e.k])
            .collect(),
    );
    out
}

// ----- parity with prodigyopt --------------------------------------------------------------

/// The configs of scripts/make_optimizer_fixtures.py's cases.
fn case_config(case: &str) -> ProdigyConfig {
    let d = ProdigyConfig::default();
    match case {
        "default" => d,
        "warmup" => ProdigyConfig {
            weight_decay: 0.1,
            use_bias_correction: true,
            safeguard_warmup: true,
            d_coef: 2.0,
            growth_rate: 1.5,
            ..d
        },
        "coupled" => ProdigyConfig {
            decouple: false,
            weight_decay: 0.05,
            beta1: 0.0,
            beta2: 0.99,
            beta3: Some(0.9),
            d0: 1e-5,
            ..d
        },
        other => panic!("no case {other}"),
    }
}

/// 50 steps against prodigyopt 1.1.2: the gradient of step k is (p - target) + noise[k] in
/// f32 (as the script computes it), the lr the script set. d is compared per step and the
/// parameters at the end; they differ by rounding only (the dot product is summed in f64
/// here and in f32 by torch, in other orders), which the run's feedback carries along, so
/// the bound is 1e-5 relative on d and 1e-5 of the parameters' scale.
#[test]
fn fifty_steps_match_prodigyopt() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/optim");
    for case in ["default", "warmup", "coupled"] {
        let fx = flame::safetensors::load(
            dir.join(format!("prodigy_{case}.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let names = ["p_a", "p_b", "p_zero"];
        let params: Vec<(String, Tensor)> = names
            .iter()
            .map(|n| {
                let t = fx[&format!("init.{n}")].clone().detach();
                let p = Tensor::from_host(t.to_host().unwrap(), t.dims().to_vec(), &Device::Cpu)
                    .unwrap();
                p.set_requires_grad(true).unwrap();
                (n.to_string(), p)
            })
            .collect();
        let lrs = fx["lr"].to_vec_f64().unwrap();
        let ds = fx["d"].to_vec_f64().unwrap();
        let mut opt = Prodigy::new(params.clone(), case_config(case)).unwrap();
        for (k, (&lr, &d_ref)) in lrs.iter().zip(&ds).enumerate() {
            opt.set_learning_rate(lr);
            let mut g = Grads::new();
            for (n, p) in &params {
                let target = f32s(&fx[&format!("target.{n}")]);
                let noise = f32s(&fx[&format!("noise.{n}")]);
                let m = target.len();
                let v: Vec<f32> = f32s(p)
                    .iter()
                    .zip(&target)
                    .zip(&noise[k * m..(k + 1) * m])
                    .map(|((&x, &t), &e)| (x - t) + e)
                    .collect();
                g.insert(
                    p,
                    Tensor::from_vec(v, p.dims().to_vec(), &Device::Cpu).unwrap(),
                );
            }
            opt.step(&g).unwrap();
            let d = opt.estimate().unwrap().d;
            assert!(
                (d - d_ref).abs() <= 1e-5 * d_ref.abs(),
                "{case}: d after step {k}: {d} against prodigyopt's {d_ref}"
            );
        }
        assert_eq!(opt.estimate().unwrap().k, 50, "{case}: k");
        for (n, p) in &params {
            let got = p.to_vec_f64().unwrap();
            let want = fx[&format!("final.{n}")].to_vec_f64().unwrap();
            let scale = want.iter().fold(0f64, |a, b| a.max(b.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "{case}: {n}[{i}] after 50 steps: {a} against prodigyopt's {b}"
                );
            }
        }
        // prodigyopt keeps no p0 for the parameter that started at zero.
        assert!(opt.state("p_zero").unwrap().p0.is_none(), "{case}");
        assert!(opt.state("p_a").unwrap().p0.is_some(), "{case}");
        assert_eq!(
            opt.state("p_a").unwrap().exp_avg.is_some(),
            case != "coupled",
            "{case}: a first moment only with beta1 > 0"
        );
    }
}

// ----- state files ----------------------------------------------------------------------

/// Saved after step k, loaded into a fresh optimizer over copies of the parameters, the run
/// continues exactly as the uninterrupted one: parameters, state and d bit for bit.
#[test]
fn a_saved_state_resumes_bit_for_bit() {
    let configs = [
        ProdigyConfig::default(),
        ProdigyConfig {
            beta1: 0.0,
            decouple: false,
            weight_decay: 0.01,
            use_bias_correction: true,
            growth_rate: 1.1,
            ..Default::default()
        },
        ProdigyConfig {
            beta3: Some(0.95),
            safeguard_warmup: true,
            weight_decay: 0.1,
            ..Default::default()
        },
    ];
    for (ci, c) in configs.into_iter().enumerate() {
        let pa = mixed_params(&Device::Cpu);
        let mut a = Prodigy::new(pa.clone(), c).unwrap();
        for k in 0..3 {
            a.step(&grads_at(&pa, k)).unwrap();
        }
        let f = TempFile::new("prodigy");
        a.save_state(f.path()).unwrap();
        let pb = copies(&pa);
        let mut b = Prodigy::new(pb.clone(), ProdigyConfig::default()).unwrap();
        b.load_state(f.path()).unwrap();
        assert_eq!(
            b.config(),
            &c,
            "config {ci}: hyperparameters come from the file"
        );
        for k in 3..7 {
            a.set_learning_rate(0.5);
            b.set_learning_rate(0.5);
            a.step(&grads_at(&pa, k)).unwrap();
            b.step(&grads_at(&pb, k)).unwrap();
        }
        assert_eq!(snapshot(&a, &pa), snapshot(&b, &pb), "config {ci}");
        assert_eq!(a.estimate().unwrap().k, 7, "config {ci}");
        // Without the bias correction (which shrinks the first steps) d has grown.
        if !c.use_bias_correction {
            assert!(a.estimate().unwrap().d > c.d0, "config {ci}: d grew");
        }
    }
}

#[test]
fn bad_state_files_are_refused_and_change_nothing() {
    let p = mixed_params(&Device::Cpu);
    let mut a = Prodigy::new(p.clone(), ProdigyConfig::default()).unwrap();
    a.step(&grads_at(&p, 0)).unwrap();
    let f = TempFile::new("prodigy-bad");
    a.save_state(f.path()).unwrap();
    let file = flame::safetensors::SafeTensorsFile::open(f.path()).unwrap();
    let meta = file.metadata().clone();
    let tensors = file.load_all(&Device::Cpu).unwrap();
    let write = |t: &BTreeMap<String, Tensor>, m: &BTreeMap<String, String>, path: &Path| {
        flame::safetensors::save_with_metadata(t.iter().map(|(k, v)| (k.as_str(), v)), m, path)
            .unwrap()
    };
    // A parameter's s missing.
    let mut t2 = tensors.clone();
    t2.remove("p7.s");
    let g = TempFile::new("prodigy-bad2");
    write(&t2, &meta, g.path());
    let mut b = Prodigy::new(copies(&p), ProdigyConfig::default()).unwrap();
    let (_, msg) = opt_err(b.load_state(g.path()));
    assert!(msg.contains("'p7'") && msg.contains("incomplete"), "{msg}");
    // A global scalar missing.
    let mut m2 = meta.clone();
    m2.remove("d");
    write(&tensors, &m2, g.path());
    let (_, msg) = opt_err(b.load_state(g.path()));
    assert!(msg.contains("'d'"), "{msg}");
    // Another kind's file.
    let mut m3 = meta.clone();
    m3.insert("optimizer".into(), "adamw".into());
    write(&tensors, &m3, g.path());
    let (_, msg) = opt_err(b.load_state(g.path()));
    assert!(msg.contains("'adamw'"), "{msg}");
    // Nothing changed: b still takes its first step from scratch.
    assert!(b.state("p7").is_none());
    assert_eq!(b.estimate().unwrap().k, 0);
}

// ----- prodigyopt's special cases ----------------------------------------------------------

/// lr = 0 creates the state and changes nothing else; an all-zero gradient (a zero sum of
/// |s|) updates the moments but not the parameters, d or k, as prodigyopt returns early.
#[test]
fn lr_zero_and_zero_gradients_leave_parameters_and_d() {
    let p = mixed_params(&Device::Cpu);
    let before: Vec<Vec<u64>> = p.iter().map(|(_, t)| bits(t)).collect();
    let mut o = Prodigy::new(p.clone(), ProdigyConfig::default()).unwrap();
    o.set_learning_rate(0.0);
    o.step(&grads_at(&p, 0)).unwrap();
    assert!(o.state("p7").is_some());
    assert_eq!(o.state("p7").unwrap().step, 0);
    assert_eq!(o.estimate().unwrap().k, 0);
    o.set_learning_rate(1.0);
    let mut zero = Grads::new();
    for (_, t) in &p {
        zero.insert(
            t,
            Tensor::zeros(t.shape().clone(), t.dtype(), t.device()).unwrap(),
        );
    }
    o.step(&zero).unwrap();
    let after: Vec<Vec<u64>> = p.iter().map(|(_, t)| bits(t)).collect();
    assert_eq!(before, after);
    let e = o.estimate().unwrap();
    assert_eq!((e.k, e.d), (0, 1e-6));
    o.step(&grads_at(&p, 1)).unwrap();
    assert_eq!(o.estimate().unwrap().k, 1);
    assert_ne!(bits(&p[2].1), before[2]);
}

/// A parameter without a gradient is skipped and its state left as it was.
#[test]
fn parameters_without_gradients_are_skipped() {
    let p = mixed_params(&Device::Cpu);
    let mut o = Prodigy::new(p.clone(), ProdigyConfig::default()).unwrap();
    let mut g = grads_at(&p, 0);
    let only: Vec<(String, Tensor)> = p[1..].to_vec();
    let mut g2 = Grads::new();
    for (_, t) in &only {
        g2.insert(t, g.get(t).unwrap().clone());
    }
    g = g2;
    let first = bits(&p[0].1);
    o.step(&g).unwrap();
    assert_eq!(bits(&p[0].1), first);
    assert!(o.state(&p[0].0).is_none());
    assert!(o.state(&p[1].0).is_some());
}

/// A step on scaled gradients with the scale folded in equals the step on the gradients.
#[test]
fn a_scaled_step_equals_a_step_on_unscaled_gradients() {
    let pa = mixed_params(&Device::Cpu);
    let pb = copies(&pa);
    let mut a = Prodigy::new(pa.clone(), ProdigyConfig::default()).unwrap();
    let mut b = Prodigy::new(pb.clone(), ProdigyConfig::default()).unwrap();
    for k in 0..3 {
        a.step(&grads_at(&pa, k)).unwrap();
        let g = grads_at(&pb, k);
        let mut big = Grads::new();
        for (_, t) in &pb {
            big.insert(t, g.get(t).unwrap().affine(8.0, 0.0).unwrap());
        }
        b.step_scaled(&big, 0.125).unwrap();
    }
    assert_eq!(snapshot(&a, &pa), snapshot(&b, &pb));
}

#[test]
fn bad_configs_and_parameters_are_refused() {
    let p = mixed_params(&Device::Cpu);
    for (c, what) in [
        (
            ProdigyConfig {
                d0: 0.0,
                ..Default::default()
            },
            "d0",
        ),
        (
            ProdigyConfig {
                beta3: Some(1.0),
                ..Default::default()
            },
            "beta3",
        ),
        (
            ProdigyConfig {
                growth_rate: f64::NAN,
                ..Default::default()
            },
            "growth_rate",
        ),
        (
            ProdigyConfig {
                eps: 0.0,
                ..Default::default()
            },
            "eps",
        ),
    ] {
        let (who, msg) = opt_err(Prodigy::new(copies(&p), c));
        assert_eq!(who, "Prodigy");
        assert!(msg.contains(what), "{what}: {msg}");
    }
    let f64p = param_on(vec![1.0; 3], &[3], DType::F64, &Device::Cpu);
    let (_, msg) = opt_err(Prodigy::new(
        vec![("w".into(), f64p)],
        ProdigyConfig::default(),
    ));
    assert!(msg.contains("'w'") && msg.contains("f64"), "{msg}");
    let mut o = Prodigy::new(copies(&p), ProdigyConfig::default()).unwrap();
    o.set_learning_rate(-1.0);
    let (_, msg) = opt_err(o.step(&Grads::new()));
    assert!(msg.contains("learning rate"), "{msg}");
}
