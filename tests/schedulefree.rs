//! Schedule-free optimizers: parity with the schedulefree and prodigy-plus-schedule-free
//! packages over 50 steps (fixtures written by scripts/make_optimizer_fixtures.py), the
//! move between y and x, exact resume from a state file, errors, and (ignored unless on a
//! GPU) CUDA against the CPU reference.
#![cfg(feature = "cpu-ref")]

mod common;
use common::optim::{bits, copies, f32s, grads_at, opt_err, param_on, Lcg};
use common::TempFile;
use flame::optim::{
    AdamWScheduleFree, AdamWScheduleFreeConfig, Optimizer, ProdigyScheduleFree,
    ProdigyScheduleFreeConfig, ScheduleFreeState,
};
use flame::{DType, Device, Grads, Tensor};
use std::path::Path;

#[path = "schedulefree/gpu.rs"]
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

/// The parameters and every state tensor, as bits.
fn state_bits(
    state: &dyn Fn(&str) -> Option<ScheduleFreeState>,
    params: &[(String, Tensor)],
) -> Vec<Vec<u64>> {
    let mut out = vec![];
    for (name, p) in params {
        out.push(bits(p));
        if let Some(s) = state(name) {
            out.push(vec![s.step]);
            for t in [&s.exp_avg_sq, &s.z].into_iter().chain(&s.s).chain(&s.p0) {
                out.push(bits(t));
            }
        }
    }
    out
}

fn snap_adamw(o: &AdamWScheduleFree, params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    let mut v = state_bits(&|n| o.state(n).cloned(), params);
    let g = o.global();
    v.push(vec![g.k, g.lr_max.to_bits(), g.weight_sum.to_bits()]);
    v
}

fn snap_prodigy(o: &ProdigyScheduleFree, params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    let mut v = state_bits(&|n| o.state(n).cloned(), params);
    let e = o.estimate().unwrap();
    v.push(vec![
        e.d.to_bits(),
        e.d_numerator.to_bits(),
        e.d_denom.to_bits(),
        e.weight_sum.to_bits(),
        e.k,
    ]);
    v
}

// ----- parity with the packages ------------------------------------------------------------

/// The configs of scripts/make_optimizer_fixtures.py's schedule-free cases.
enum Case {
    AdamW(AdamWScheduleFreeConfig),
    Prodigy(ProdigyScheduleFreeConfig),
}

fn case_config(case: &str) -> Case {
    let a = AdamWScheduleFreeConfig::default();
    let p = ProdigyScheduleFreeConfig::default();
    match case {
        "sf_adamw_default" => Case::AdamW(a),
        "sf_adamw_warmup" => Case::AdamW(AdamWScheduleFreeConfig {
            lr: 0.01,
            beta1: 0.95,
            beta2: 0.99,
            eps: 1e-6,
            weight_decay: 0.05,
            warmup_steps: 10,
            r: 0.5,
            weight_lr_power: 1.0,
        }),
        "sf_prodigy_default" => Case::Prodigy(p),
        "sf_prodigy_decay" => Case::Prodigy(ProdigyScheduleFreeConfig {
            weight_decay: 0.1,
            d_limiter: false,
            schedulefree_c: 10.0,
            beta1: 0.95,
            beta2: 0.999,
            beta3: Some(0.98),
            d_coef: 2.0,
            d0: 1e-5,
            ..p
        }),
        other => panic!("no case {other}"),
    }
}

/// 50 steps against schedulefree 1.4.1's AdamWScheduleFree and prodigy-plus-schedule-free
/// 2.0.1's ProdigyPlusScheduleFree (factored, StableAdamW and stochastic rounding off): the
/// gradient of step k is (y - target) + noise[k] in f32, as the script computes it. y after
/// 50 steps, x after eval_mode and (Prodigy) d after every step are compared. They differ
/// by rounding only (torch's lerp and add-with-alpha fuse a multiply and an add, its sums
/// go in other orders and in f32), which the run carries along: 2e-5 of the parameters'
/// scale for AdamW; 1e-4 relative on d and 1e-4 of the parameters' scale for Prodigy (its s
/// is rounded to bf16 each step, so a rounding that lands near a bf16 tie moves it by a
/// bf16 step; d, and every step's size with it, carries that).
#[test]
fn fifty_steps_match_the_packages() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/optim");
    for case in [
        "sf_adamw_default",
        "sf_adamw_warmup",
        "sf_prodigy_default",
        "sf_prodigy_decay",
    ] {
        let fx = flame::safetensors::load(dir.join(format!("{case}.safetensors")), &Device::Cpu)
            .unwrap();
        let names = ["p_a", "p_b", "p_zero", "p_c"];
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
        let mut opt: Box<dyn Optimizer> = match case_config(case) {
            Case::AdamW(c) => Box::new(AdamWScheduleFree::new(params.clone(), c).unwrap()),
            Case::Prodigy(c) => Box::new(ProdigyScheduleFree::new(params.clone(), c).unwrap()),
        };
        for k in 0..50 {
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
        }
        let tol = if case.starts_with("sf_prodigy") {
            1e-4
        } else {
            2e-5
        };
        let close = |what: &str, got: &[f64], want: &[f64]| {
            let scale = want.iter().fold(0f64, |a, b| a.max(b.abs()));
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= tol * scale,
                    "{case}: {what}[{i}] after 50 steps: {a} against the package's {b}"
                );
            }
        };
        for (n, p) in &params {
            let want = fx[&format!("final.{n}")].to_vec_f64().unwrap();
            close(&format!("y {n}"), &p.to_vec_f64().unwrap(), &want);
        }
        opt.eval_mode().unwrap();
        for (n, p) in &params {
            let want = fx[&format!("final_x.{n}")].to_vec_f64().unwrap();
            close(&format!("x {n}"), &p.to_vec_f64().unwrap(), &want);
        }
    }
}

/// d after every step of the Prodigy cases, against the package's.
#[test]
fn prodigy_d_follows_the_package() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/optim");
    for case in ["sf_prodigy_default", "sf_prodigy_decay"] {
        let fx = flame::safetensors::load(dir.join(format!("{case}.safetensors")), &Device::Cpu)
            .unwrap();
        let names = ["p_a", "p_b", "p_zero", "p_c"];
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
        let Case::Prodigy(c) = case_config(case) else {
            unreachable!()
        };
        let mut opt = ProdigyScheduleFree::new(params.clone(), c).unwrap();
        let ds = fx["d"].to_vec_f64().unwrap();
        for (k, &d_ref) in ds.iter().enumerate() {
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
                (d - d_ref).abs() <= 1e-4 * d_ref.abs(),
                "{case}: d after step {k}: {d} against the package's {d_ref}"
            );
        }
        assert_eq!(opt.estimate().unwrap().k, 50, "{case}: k");
        assert!(opt.estimate().unwrap().d > c.d0, "{case}: d grew");
        // The package keeps no p0 for the parameter that started at zero.
        assert!(opt.state("p_zero").unwrap().p0.is_none(), "{case}");
        assert_eq!(opt.state("p_c").unwrap().s.as_ref().unwrap().dims(), &[5]);
    }
}

// ----- eval and train modes, state files ------------------------------------------------

/// Saved at x after step k (as the trainer saves), loaded into a fresh optimizer over the
/// saved x, both back to y: the runs continue bit for bit.
#[test]
fn a_state_saved_at_x_resumes_bit_for_bit() {
    let adamw = [
        AdamWScheduleFreeConfig::default(),
        AdamWScheduleFreeConfig {
            weight_decay: 0.1,
            warmup_steps: 4,
            r: 1.0,
            ..Default::default()
        },
    ];
    for (ci, c) in adamw.into_iter().enumerate() {
        let pa = mixed_params(&Device::Cpu);
        let mut a = AdamWScheduleFree::new(pa.clone(), c).unwrap();
        for k in 0..3 {
            a.step(&grads_at(&pa, k)).unwrap();
        }
        a.eval_mode().unwrap();
        let f = TempFile::new("sf-adamw");
        a.save_state(f.path()).unwrap();
        let pb = copies(&pa);
        let mut b = AdamWScheduleFree::new(pb.clone(), Default::default()).unwrap();
        b.load_state(f.path()).unwrap();
        assert_eq!(b.config(), &c, "adamw {ci}: hyperparameters from the file");
        for k in 3..7 {
            a.train_mode().unwrap();
            b.train_mode().unwrap();
            a.step_scaled(&grads_at(&pa, k), 0.5).unwrap();
            b.step_scaled(&grads_at(&pb, k), 0.5).unwrap();
        }
        assert_eq!(snap_adamw(&a, &pa), snap_adamw(&b, &pb), "adamw {ci}");
        assert_eq!(a.global().k, 7);
    }
    let prodigy = [
        ProdigyScheduleFreeConfig::default(),
        ProdigyScheduleFreeConfig {
            weight_decay: 0.1,
            d_limiter: false,
            schedulefree_c: 8.0,
            beta3: Some(0.9),
            ..Default::default()
        },
    ];
    for (ci, c) in prodigy.into_iter().enumerate() {
        let pa = mixed_params(&Device::Cpu);
        let mut a = ProdigyScheduleFree::new(pa.clone(), c).unwrap();
        for k in 0..3 {
            a.step(&grads_at(&pa, k)).unwrap();
        }
        a.eval_mode().unwrap();
        let f = TempFile::new("sf-prodigy");
        a.save_state(f.path()).unwrap();
        let pb = copies(&pa);
        let mut b = ProdigyScheduleFree::new(pb.clone(), Default::default()).unwrap();
        b.load_state(f.path()).unwrap();
        assert_eq!(
            b.config(),
            &c,
            "prodigy {ci}: hyperparameters from the file"
        );
        for k in 3..7 {
            a.train_mode().unwrap();
            b.train_mode().unwrap();
            a.step(&grads_at(&pa, k)).unwrap();
            b.step(&grads_at(&pb, k)).unwrap();
        }
        assert_eq!(snap_prodigy(&a, &pa), snap_prodigy(&b, &pb), "prodigy {ci}");
        let e = a.estimate().unwrap();
        assert_eq!(e.k, 7);
        assert!(e.d > c.d0, "prodigy {ci}: d grew");
        assert!(a.state("up").unwrap().p0.is_none());
        assert!(a.state("p9001").unwrap().p0.is_some());
    }
}

/// x is lerp(y, z, 1 - 1/beta1): computed here from the state, per value, in f32 with
/// PyTorch's lerp; eval_mode writes exactly that, a second eval_mode changes nothing, and a
/// step at x is refused.
#[test]
fn eval_mode_moves_to_x_and_steps_need_train_mode() {
    let p = mixed_params(&Device::Cpu);
    let mut o = AdamWScheduleFree::new(p.clone(), Default::default()).unwrap();
    for k in 0..4 {
        o.step(&grads_at(&p, k)).unwrap();
    }
    let w = (1.0 - 1.0 / 0.9f64) as f32;
    let want: Vec<Vec<f32>> = p
        .iter()
        .map(|(n, t)| {
            let z = f32s(&o.state(n).unwrap().z);
            f32s(t)
                .iter()
                .zip(&z)
                .map(|(&y, &z)| {
                    let x = if w.abs() < 0.5 {
                        y + w * (z - y)
                    } else {
                        z - (z - y) * (1.0 - w)
                    };
                    // Rounded to the parameter's dtype.
                    Tensor::from_vec(vec![x], 1, &Device::Cpu)
                        .unwrap()
                        .to_dtype(t.dtype())
                        .unwrap()
                        .to_vec_f64()
                        .unwrap()[0] as f32
                })
                .collect()
        })
        .collect();
    o.eval_mode().unwrap();
    for ((n, t), want) in p.iter().zip(&want) {
        assert_eq!(&f32s(t), want, "{n}: x");
    }
    let before: Vec<Vec<u64>> = p.iter().map(|(_, t)| bits(t)).collect();
    o.eval_mode().unwrap();
    assert_eq!(before, p.iter().map(|(_, t)| bits(t)).collect::<Vec<_>>());
    let (_, msg) = opt_err(o.step(&grads_at(&p, 9)));
    assert!(msg.contains("eval mode"), "{msg}");
    o.train_mode().unwrap();
    o.step(&grads_at(&p, 9)).unwrap();
}

#[test]
fn bad_configs_and_state_files_are_refused() {
    let p = mixed_params(&Device::Cpu);
    for c in [
        AdamWScheduleFreeConfig {
            beta1: 0.0,
            ..Default::default()
        },
        AdamWScheduleFreeConfig {
            lr: f64::NAN,
            ..Default::default()
        },
        AdamWScheduleFreeConfig {
            r: -1.0,
            ..Default::default()
        },
    ] {
        assert!(AdamWScheduleFree::new(p.clone(), c).is_err(), "{c:?}");
    }
    for c in [
        ProdigyScheduleFreeConfig {
            beta1: 0.0,
            ..Default::default()
        },
        ProdigyScheduleFreeConfig {
            d0: 0.0,
            ..Default::default()
        },
        ProdigyScheduleFreeConfig {
            schedulefree_c: -1.0,
            ..Default::default()
        },
    ] {
        assert!(ProdigyScheduleFree::new(p.clone(), c).is_err(), "{c:?}");
    }
    // A state file of the other kind is refused and changes nothing.
    let mut a = AdamWScheduleFree::new(p.clone(), Default::default()).unwrap();
    a.step(&grads_at(&p, 0)).unwrap();
    let f = TempFile::new("sf-kind");
    a.save_state(f.path()).unwrap();
    let q = copies(&p);
    let mut b = ProdigyScheduleFree::new(q.clone(), Default::default()).unwrap();
    b.step(&grads_at(&q, 0)).unwrap();
    let before = snap_prodigy(&b, &q);
    let (_, msg) = opt_err(b.load_state(f.path()));
    assert!(msg.contains("adamw_schedulefree"), "{msg}");
    assert_eq!(before, snap_prodigy(&b, &q));
}
