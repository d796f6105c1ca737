//! Lion and Lion8bit tests: parity over 50 steps with lion-pytorch's `Lion` and bitsandbytes'
//! `Lion8bit` (its CPU path; fixtures written by scripts/make_optimizer_fixtures.py), exact
//! resume from a state file, the 8-bit momentum against the f32 one, errors, and (ignored
//! unless on a GPU) CUDA against the CPU reference.
#![cfg(feature = "cpu-ref")]

mod common;
use common::optim::{bits, copies, f32s, grads_at, opt_err, param_on, Lcg};
use common::TempFile;
use flame::optim::{Lion, Lion8bit, Lion8bitConfig, LionConfig, Optimizer};
use flame::{DType, Device, Grads, Tensor};
use std::path::Path;

#[path = "lion/gpu.rs"]
mod gpu;

/// Parameters of odd sizes and mixed dtypes: under and over min_8bit_size, blocks cut short.
fn mixed_params(dev: &Device) -> Vec<(String, Tensor)> {
    let mut r = Lcg(5);
    [
        (1, DType::F32),
        (7, DType::BF16),
        (4095, DType::F32),
        (4097, DType::F16),
        (9001, DType::BF16),
        (5000, DType::F32),
    ]
    .iter()
    .map(|&(n, dt)| (format!("p{n}"), param_on(r.vec(n), &[n], dt, dev)))
    .collect()
}

/// The parameters' bits and each momentum (the 8-bit ones dequantized), for the CUDA tests.
#[cfg(feature = "cuda")]
fn snapshot(opt: &dyn Fn(&str) -> Option<Vec<f32>>, params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    let mut v: Vec<Vec<u64>> = params.iter().map(|(_, p)| bits(p)).collect();
    for (n, _) in params {
        v.push(
            opt(n)
                .unwrap_or_default()
                .iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
        );
    }
    v
}

/// A fixture's run: its parameters from `init`, 50 steps of (p - target) + noise[k % period]
/// at the fixture's lr; returns the parameters and the fixture.
fn run_fixture(
    file: &str,
    names: &[&str],
    opt: &mut dyn FnMut(Vec<(String, Tensor)>) -> Box<dyn Optimizer>,
) -> (
    Vec<(String, Tensor)>,
    std::collections::HashMap<String, Tensor>,
) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/optim");
    let fx = flame::safetensors::load(dir.join(file), &Device::Cpu).unwrap();
    let params: Vec<(String, Tensor)> = names
        .iter()
        .map(|n| {
            let t = &fx[&format!("init.{n}")];
            let p =
                Tensor::from_host(t.to_host().unwrap(), t.dims().to_vec(), &Device::Cpu).unwrap();
            p.set_requires_grad(true).unwrap();
            (n.to_string(), p)
        })
        .collect();
    let mut o = opt(params.clone());
    for (k, &lr) in fx["lr"].to_vec_f64().unwrap().iter().enumerate() {
        o.set_learning_rate(lr);
        let mut g = Grads::new();
        for (n, p) in &params {
            let target = f32s(&fx[&format!("target.{n}")]);
            let noise = f32s(&fx[&format!("noise.{n}")]);
            let m = target.len();
            let j = k % (noise.len() / m);
            let v: Vec<f32> = f32s(p)
                .iter()
                .zip(&target)
                .zip(&noise[j * m..(j + 1) * m])
                .map(|((&x, &t), &e)| (x - t) + e)
                .collect();
            g.insert(
                p,
                Tensor::from_vec(v, p.dims().to_vec(), &Device::Cpu).unwrap(),
            );
        }
        o.step(&g).unwrap();
    }
    (params, fx.into_iter().collect())
}

/// The fixture's keyword arguments as a config (lr is set per step).
fn case_config(case: &str) -> LionConfig {
    match case {
        "default" => LionConfig {
            lr: 1e-3,
            ..Default::default()
        },
        "decay" => LionConfig {
            lr: 3e-4,
            beta1: 0.95,
            beta2: 0.98,
            weight_decay: 0.1,
        },
        _ => unreachable!(),
    }
}

/// 50 steps against lion-pytorch: each step moves every value by lr (sign update) and the
/// momentum is the same f32 operations, so the parameters agree to f32 rounding of the decay
/// products: within 1e-6 of their scale.
#[test]
fn fifty_steps_match_lion_pytorch() {
    for case in ["default", "decay"] {
        let c = case_config(case);
        let (params, fx) = run_fixture(
            &format!("lion_{case}.safetensors"),
            &["p_a", "p_b"],
            &mut |p| Box::new(Lion::new(p, c).unwrap()),
        );
        for (n, p) in &params {
            let got = p.to_vec_f64().unwrap();
            let want = fx[&format!("final.{n}")].to_vec_f64().unwrap();
            let moved = fx[&format!("init.{n}")].to_vec_f64().unwrap();
            assert!(
                got.iter().zip(&moved).any(|(a, b)| a != b),
                "{case}: {n} moved"
            );
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{case}: {n}[{i}] after 50 steps: {a} against lion-pytorch's {b}"
                );
            }
        }
    }
}

/// 50 steps against bitsandbytes' Lion8bit (CPU): the small parameter keeps f32 state and
/// matches to f32 rounding; the 8-bit one differs only where a dequantized momentum rounds
/// the sign of beta1 * m + (1 - beta1) * g the other way (bitsandbytes' map is computed in
/// f32, FLAME's in f64 and rounded once, and ties may pick the other code), each such step
/// moving a value 2 lr apart: at most 1% of the values differ, by at most 10 lr.
#[test]
fn fifty_steps_match_bitsandbytes_lion8bit() {
    for case in ["default", "decay"] {
        let c = case_config(case);
        let (params, fx) = run_fixture(
            &format!("lion8bit_{case}.safetensors"),
            &["p_big", "p_a"],
            &mut |p| {
                Box::new(
                    Lion8bit::new(
                        p,
                        Lion8bitConfig {
                            lion: c,
                            ..Default::default()
                        },
                    )
                    .unwrap(),
                )
            },
        );
        for (n, p) in &params {
            let got = p.to_vec_f64().unwrap();
            let want = fx[&format!("final.{n}")].to_vec_f64().unwrap();
            let mut off = 0usize;
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let d = (a - b).abs();
                if d > 1e-6 * b.abs().max(1.0) {
                    off += 1;
                    assert!(
                        *n == "p_big" && d <= 10.0 * c.lr + 1e-6,
                        "{case}: {n}[{i}] after 50 steps: {a} against bitsandbytes' {b}"
                    );
                }
            }
            assert!(off * 100 <= got.len(), "{case}: {n}: {off} values differ");
        }
    }
}

/// The 8-bit momentum tracks the f32 one within the dynamic map's error: both runs take the
/// same gradients, and each of the 20 steps requantizes with an error of at most half the
/// signed map's largest gap (0.9 / 256 = 0.0035 of the block maximum), which the decay beta2
/// < 1 only shrinks: after 20 steps every value is within 20 x 0.0035 = 7% of its block's
/// maximum of the f32 run, 10% with room for the maximum changing between steps.
#[test]
fn the_8bit_momentum_tracks_the_f32_momentum() {
    let c = LionConfig {
        lr: 1e-3,
        ..Default::default()
    };
    let pa = mixed_params(&Device::Cpu);
    let pb = copies(&pa);
    let mut a = Lion::new(pa.clone(), c).unwrap();
    let mut b = Lion8bit::new(
        pb.clone(),
        Lion8bitConfig {
            lion: c,
            ..Default::default()
        },
    )
    .unwrap();
    for k in 0..20 {
        // The same gradients on both, from the f32 run's parameters.
        let g = grads_at(&pa, k);
        let mut gb = Grads::new();
        for ((_, p), (_, q)) in pa.iter().zip(&pb) {
            gb.insert(q, g.get(p).unwrap().clone());
        }
        a.step(&g).unwrap();
        b.step(&gb).unwrap();
    }
    assert!(b.state_bytes() < 4 * 20000);
    for (n, p) in &pa {
        let ma = a.momentum(n).unwrap().unwrap();
        let mb = b.momentum(n).unwrap().unwrap();
        if p.elem_count() < 4096 {
            assert_eq!(ma, mb, "{n}: f32 state below min_8bit_size");
            continue;
        }
        for (blk, (x, y)) in ma.chunks(256).zip(mb.chunks(256)).enumerate() {
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (u, v) in x.iter().zip(y) {
                assert!(
                    (u - v).abs() <= 0.1 * scale,
                    "{n} block {blk}: {u} against {v}"
                );
            }
        }
    }
}

/// Saved after 3 steps, loaded into a fresh optimizer over copies of the parameters, the
/// run continues exactly as the uninterrupted one, for Lion and Lion8bit.
#[test]
fn a_saved_state_resumes_bit_for_bit() {
    let c = LionConfig {
        lr: 2e-3,
        beta1: 0.95,
        beta2: 0.98,
        weight_decay: 0.1,
    };
    for eight in [false, true] {
        let make = |p: Vec<(String, Tensor)>, c: LionConfig| -> Box<dyn Optimizer> {
            if eight {
                Box::new(
                    Lion8bit::new(
                        p,
                        Lion8bitConfig {
                            lion: c,
                            ..Default::default()
                        },
                    )
                    .unwrap(),
                )
            } else {
                Box::new(Lion::new(p, c).unwrap())
            }
        };
        let pa = mixed_params(&Device::Cpu);
        let mut a = make(pa.clone(), c);
        for k in 0..3 {
            a.step(&grads_at(&pa, k)).unwrap();
        }
        let f = TempFile::new("lion");
        a.save_state(f.path()).unwrap();
        let pb = copies(&pa);
        let mut b = make(pb.clone(), LionConfig::default());
        b.load_state(f.path()).unwrap();
        assert_eq!(
            b.learning_rate(),
            c.lr,
            "the hyperparameters come from the file"
        );
        for k in 3..7 {
            a.step_scaled(&grads_at(&pa, k), 0.5).unwrap();
            b.step_scaled(&grads_at(&pb, k), 0.5).unwrap();
        }
        let all = |p: &[(String, Tensor)]| p.iter().map(|(_, t)| bits(t)).collect::<Vec<_>>();
        assert_eq!(all(&pa), all(&pb), "8-bit {eight}");
        // A file of the other kind is refused.
        let mut other = make(copies(&pa), c);
        let g = TempFile::new("lion-other");
        let o2: Box<dyn Optimizer> = if eight {
            Box::new(Lion::new(copies(&pa), c).unwrap())
        } else {
            Box::new(Lion8bit::new(copies(&pa), Lion8bitConfig::default()).unwrap())
        };
        o2.save_state(g.path()).unwrap();
        let (_, msg) = opt_err(other.load_state(g.path()));
        assert!(msg.contains("optimizer kind"), "{msg}");
    }
}

/// A scaled step is the step on the gradients times the scale; parameters without a gradient
/// keep their values and state.
#[test]
fn scaled_steps_and_missing_gradients() {
    let c = LionConfig {
        lr: 1e-3,
        ..Default::default()
    };
    let pa = mixed_params(&Device::Cpu);
    let pb = copies(&pa);
    let mut a = Lion8bit::new(
        pa.clone(),
        Lion8bitConfig {
            lion: c,
            ..Default::default()
        },
    )
    .unwrap();
    let mut b = Lion8bit::new(
        pb.clone(),
        Lion8bitConfig {
            lion: c,
            ..Default::default()
        },
    )
    .unwrap();
    let g = grads_at(&pa, 1);
    let mut g4 = Grads::new();
    for ((_, p), (_, q)) in pa.iter().zip(&pb) {
        let t = g.get(p).unwrap().to_dtype(DType::F32).unwrap();
        g4.insert(q, t.mul_scalar(4.0).unwrap().to_dtype(q.dtype()).unwrap());
    }
    a.step(&g).unwrap();
    b.step_scaled(&g4, 0.25).unwrap();
    for ((n, p), (_, q)) in pa.iter().zip(&pb) {
        assert_eq!(bits(p), bits(q), "{n}");
    }
    let before = bits(&pa[0].1);
    let mut partial = Grads::new();
    partial.insert(&pa[1].1, g.get(&pa[1].1).unwrap().clone());
    a.step(&partial).unwrap();
    assert_eq!(bits(&pa[0].1), before, "no gradient: no change");
    assert_eq!(a.state(&pa[0].0).unwrap().step(), 1);
    assert_eq!(a.state(&pa[1].0).unwrap().step(), 2);
}

#[test]
fn bad_configs_are_refused() {
    let p = || mixed_params(&Device::Cpu);
    for (c, want) in [
        (
            LionConfig {
                beta1: 1.5,
                ..Default::default()
            },
            "beta1",
        ),
        (
            LionConfig {
                weight_decay: -1.0,
                ..Default::default()
            },
            "weight_decay",
        ),
        (
            LionConfig {
                lr: f64::NAN,
                ..Default::default()
            },
            "learning rate",
        ),
    ] {
        let (name, msg) = opt_err(Lion::new(p(), c));
        assert_eq!(name, "Lion");
        assert!(msg.contains(want), "{msg}");
    }
    let mut o = Lion::new(p(), LionConfig::default()).unwrap();
    o.set_learning_rate(-1.0);
    let (_, msg) = opt_err(o.step(&grads_at(&p(), 0)));
    assert!(msg.contains("learning rate"), "{msg}");
}
