//! Optimizer tests: updates checked against numbers worked out by hand (or with the update
//! formula written out in f64 here), state save/load, and error paths.
#![cfg(feature = "cpu-ref")]

mod common;
use common::TempFile;
use flame::optim::{
    Adam, AdamConfig, AdamOptimizer, AdamVariant, AdamW, Decoupled, Optimizer, Sgd, SgdConfig, L2,
};
use flame::{DType, Device, Error, Grads, Result, Tensor};
use half::bf16;
use std::ops::Range;

// ----- helpers ---------------------------------------------------------------------------

/// A trainable f32 parameter.
fn param(v: &[f64]) -> Tensor {
    param_as(v, DType::F32)
}

/// A trainable parameter of any float dtype, from f64 values.
fn param_as(v: &[f64], dtype: DType) -> Tensor {
    let t = Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    t.set_requires_grad(true).unwrap();
    t
}

fn named(ps: &[(&str, &Tensor)]) -> Vec<(String, Tensor)> {
    ps.iter()
        .map(|(n, t)| (n.to_string(), (*t).clone()))
        .collect()
}

/// Gradients given directly, in each parameter's dtype.
fn grads(gs: &[(&Tensor, &[f64])]) -> Grads {
    let mut out = Grads::new();
    for (p, g) in gs {
        let t = Tensor::from_vec(g.to_vec(), p.dims().to_vec(), &Device::Cpu)
            .unwrap()
            .to_dtype(p.dtype())
            .unwrap();
        out.insert(p, t);
    }
    out
}

fn sgd_cfg(lr: f64, momentum: f64, dampening: f64, weight_decay: f64, nesterov: bool) -> SgdConfig {
    SgdConfig {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
    }
}

fn adam_full(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> AdamConfig {
    AdamConfig {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    }
}

/// Adam's defaults (betas 0.9, 0.999, eps 1e-8) with this lr and weight decay.
fn adam_cfg(lr: f64, weight_decay: f64) -> AdamConfig {
    adam_full(lr, 0.9, 0.999, 1e-8, weight_decay)
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "got {got:?}, want {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "element {i}: got {g}, want {w} (tol {tol}); all: {got:?} vs {want:?}"
        );
    }
}

/// The optimizer and message of an `Error::Optimizer`.
fn opt_err<T: std::fmt::Debug>(r: Result<T>) -> (&'static str, String) {
    match r {
        Err(Error::Optimizer { optimizer, msg }) => (optimizer, msg),
        other => panic!("expected Error::Optimizer, got {other:?}"),
    }
}

// ----- SGD -------------------------------------------------------------------------------

#[test]
fn sgd_plain_steps_update_every_handle() {
    // p = p - lr g with lr 0.1, g = [0.5, 1]:
    // [1, -2] -> [0.95, -2.1] -> [0.9, -2.2].
    let p = param(&[1.0, -2.0]);
    let other_handle = p.clone();
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(0.1, 0.0, 0.0, 0.0, false)).unwrap();
    let g = grads(&[(&p, &[0.5, 1.0])]);
    opt.step(&g).unwrap();
    assert_close(&vals(&p), &[0.95, -2.1], 1e-6);
    opt.step(&g).unwrap();
    assert_close(&vals(&other_handle), &[0.9, -2.2], 1e-6);
    assert!(p.is_var(), "the parameter stays a trainable leaf");
    assert!(
        opt.momentum_buffer("p").is_none(),
        "no buffer without momentum"
    );
}

#[test]
fn sgd_momentum_three_steps() {
    // momentum 0.9, lr 0.1, constant grads g = [1, -2], p0 = [1, 0].
    // buf_1 = g;  buf_t = 0.9 buf_{t-1} + g:  buf = g * (1, 1.9, 2.71).
    // p_t = p_{t-1} - 0.1 buf_t:
    //   element 0: 1 - 0.1 = 0.9;  0.9 - 0.19 = 0.71;  0.71 - 0.271 = 0.439
    //   element 1: 0 + 0.2 = 0.2;  0.2 + 0.38 = 0.58;  0.58 + 0.542 = 1.122
    let p = param(&[1.0, 0.0]);
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(0.1, 0.9, 0.0, 0.0, false)).unwrap();
    let g = grads(&[(&p, &[1.0, -2.0])]);
    let want_p = [[0.9, 0.2], [0.71, 0.58], [0.439, 1.122]];
    let want_buf = [[1.0, -2.0], [1.9, -3.8], [2.71, -5.42]];
    for t in 0..3 {
        opt.step(&g).unwrap();
        assert_close(&vals(&p), &want_p[t], 1e-6);
        let buf = opt.momentum_buffer("p").unwrap();
        assert_eq!(buf.dtype(), DType::F32);
        assert_close(&vals(buf), &want_buf[t], 1e-6);
    }
}

#[test]
fn sgd_dampening() {
    // momentum 0.9, dampening 0.5, lr 0.1, g = 1, p0 = 1. The first buffer is the
    // undampened gradient (torch.optim.SGD): buf = 1, then 0.9 + 0.5 = 1.4, then
    // 1.26 + 0.5 = 1.76. p: 1 - 0.1 = 0.9; 0.9 - 0.14 = 0.76; 0.76 - 0.176 = 0.584.
    let p = param(&[1.0]);
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(0.1, 0.9, 0.5, 0.0, false)).unwrap();
    let g = grads(&[(&p, &[1.0])]);
    for want in [0.9, 0.76, 0.584] {
        opt.step(&g).unwrap();
        assert_close(&vals(&p), &[want], 1e-6);
    }
    assert_close(&vals(opt.momentum_buffer("p").unwrap()), &[1.76], 1e-6);
}

#[test]
fn sgd_nesterov() {
    // Nesterov, momentum 0.9, lr 0.1, g = 1, p0 = 1. buf = 1, 1.9, 2.71 as above; the step
    // direction is g + 0.9 buf = 1.9, 2.71, 3.439.
    // p: 1 - 0.19 = 0.81; 0.81 - 0.271 = 0.539; 0.539 - 0.3439 = 0.1951.
    let p = param(&[1.0]);
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(0.1, 0.9, 0.0, 0.0, true)).unwrap();
    let g = grads(&[(&p, &[1.0])]);
    for want in [0.81, 0.539, 0.1951] {
        opt.step(&g).unwrap();
        assert_close(&vals(&p), &[want], 1e-6);
    }
    assert_close(&vals(opt.momentum_buffer("p").unwrap()), &[2.71], 1e-6);
}

#[test]
fn sgd_weight_decay() {
    // L2 decay 0.1 without momentum, lr 0.1, g = 1, p0 = 1: d = g + 0.1 p.
    // d = 1.1, p = 1 - 0.11 = 0.89; d = 1.089, p = 0.89 - 0.1089 = 0.7811.
    let p = param(&[1.0]);
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(0.1, 0.0, 0.0, 0.1, false)).unwrap();
    let g = grads(&[(&p, &[1.0])]);
    for want in [0.89, 0.7811] {
        opt.step(&g).unwrap();
        assert_close(&vals(&p), &[want], 1e-6);
    }

    // With momentum 0.9 and a zero gradient only the decay (0.5) drives it, lr 0.1, p0 = 1:
    // d = 0.5, buf = 0.5, p = 1 - 0.05 = 0.95;
    // d = 0.475, buf = 0.45 + 0.475 = 0.925, p = 0.95 - 0.0925 = 0.8575.
    let q = param(&[1.0]);
    let mut opt = Sgd::new(named(&[("q", &q)]), sgd_cfg(0.1, 0.9, 0.0, 0.5, false)).unwrap();
    let g = grads(&[(&q, &[0.0])]);
    for want in [0.95, 0.8575] {
        opt.step(&g).unwrap();
        assert_close(&vals(&q), &[want], 1e-6);
    }
    assert_close(&vals(opt.momentum_buffer("q").unwrap()), &[0.925], 1e-6);
}

// ----- Adam / AdamW ----------------------------------------------------------------------

#[test]
fn adam_first_step_moves_by_lr_sign_g() {
    // Step 1: m = (1-b1) g, v = (1-b2) g^2, so m_hat = g, v_hat = g^2 and the update is
    // lr g / (|g| + eps) = lr sign(g) (to within lr eps / |g| <= 1e-7 here).
    for decoupled in [false, true] {
        let p = param(&[1.0, 1.0, 1.0, 1.0]);
        let config = adam_cfg(0.01, 0.0);
        let mut opt: Box<dyn Optimizer> = if decoupled {
            Box::new(AdamW::new(named(&[("p", &p)]), config).unwrap())
        } else {
            Box::new(Adam::new(named(&[("p", &p)]), config).unwrap())
        };
        opt.step(&grads(&[(&p, &[3.0, -0.5, 1e-3, -100.0])]))
            .unwrap();
        assert_close(&vals(&p), &[0.99, 1.01, 0.99, 1.01], 1e-6);
    }
}

/// Two Adam or AdamW steps written out in f64, straight from the formulas of
/// torch.optim.Adam / torch.optim.AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019).
/// Returns (p, m, v) after each step.
fn adam_by_formula(
    p0: &[f64; 3],
    gs: &[[f64; 3]; 2],
    c: &AdamConfig,
    decoupled: bool,
) -> Vec<[[f64; 3]; 3]> {
    let (mut p, mut m, mut v) = (*p0, [0.0; 3], [0.0; 3]);
    let mut out = Vec::new();
    for (t, g) in gs.iter().enumerate() {
        let t = (t + 1) as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for i in 0..3 {
            let mut gi = g[i];
            if decoupled {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            } else {
                gi += c.weight_decay * p[i];
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
            let m_hat = m[i] / bc1;
            let v_hat = v[i] / bc2;
            p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
        out.push([p, m, v]);
    }
    out
}

/// Runs the optimizer over `gs` from `p0`; returns p after each step and the final state
/// (m, v, step count, state dtype).
fn adam_run<V: AdamVariant>(
    p0: &[f64; 3],
    gs: &[[f64; 3]; 2],
    c: AdamConfig,
    dtype: DType,
) -> (Vec<Vec<f64>>, Vec<f64>, Vec<f64>, u64, DType) {
    let p = param_as(p0, dtype);
    let mut opt = AdamOptimizer::<V>::new(named(&[("w", &p)]), c).unwrap();
    let mut ps = Vec::new();
    for g in gs {
        opt.step(&grads(&[(&p, g)])).unwrap();
        ps.push(vals(&p));
    }
    let s = opt.state("w").unwrap();
    let m = vals(&s.exp_avg);
    let v = vals(&s.exp_avg_sq);
    (ps, m, v, s.step, s.exp_avg.dtype())
}

#[test]
fn adam_and_adamw_two_steps_with_weight_decay_match_the_formula() {
    let p0 = [0.5, -1.5, 2.0];
    let gs = [[0.1, -0.2, 0.3], [-0.4, 0.05, 0.25]];
    // A large eps and weight decay, so that both visibly matter.
    let c = adam_full(0.01, 0.9, 0.99, 1e-2, 0.1);
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12)] {
        for decoupled in [false, true] {
            let want = adam_by_formula(&p0, &gs, &c, decoupled);
            let (ps, m, v, step, sdtype) = if decoupled {
                adam_run::<Decoupled>(&p0, &gs, c, dtype)
            } else {
                adam_run::<L2>(&p0, &gs, c, dtype)
            };
            for t in 0..2 {
                assert_close(&ps[t], &want[t][0], tol);
            }
            assert_eq!(step, 2);
            assert_eq!(sdtype, dtype, "state in the compute dtype");
            assert_close(&m, &want[1][1], tol);
            assert_close(&v, &want[1][2], tol);
        }
    }
    // The reference itself, by hand for element 0 of the first step (p = 0.5, g = 0.1):
    // Adam: g = 0.1 + 0.1 * 0.5 = 0.15, m_hat = 0.15, sqrt(v_hat) = 0.15,
    //       p = 0.5 - 0.01 * 0.15 / (0.15 + 0.01) = 0.5 - 0.009375 = 0.490625.
    // AdamW: p = 0.5 (1 - 0.01 * 0.1) = 0.4995, m_hat = 0.1, sqrt(v_hat) = 0.1,
    //       p = 0.4995 - 0.01 * 0.1 / (0.1 + 0.01) = 0.4995 - 0.0090909.. = 0.4904090..
    let (l2, dec) = (
        adam_by_formula(&p0, &gs, &c, false),
        adam_by_formula(&p0, &gs, &c, true),
    );
    assert!((l2[0][0][0] - 0.490625).abs() < 1e-15);
    assert!((dec[0][0][0] - (0.4995 - 0.001 / 0.11)).abs() < 1e-15);
}

#[test]
fn params_without_grads_are_skipped() {
    let a = param(&[1.0, 2.0]);
    let b = param(&[3.0]);
    let mut adam = AdamW::new(named(&[("a", &a), ("b", &b)]), adam_cfg(0.1, 0.5)).unwrap();
    adam.step(&grads(&[(&a, &[1.0, 1.0])])).unwrap();
    // No gradient for b: not even the decoupled decay touches it, and it has no state.
    assert_eq!(vals(&b), [3.0]);
    assert!(adam.state("b").is_none());
    assert_eq!(adam.state("a").unwrap().step, 1);
    let a_after = vals(&a);
    adam.step(&grads(&[(&b, &[1.0])])).unwrap();
    assert_eq!(vals(&a), a_after, "a has no gradient now");
    assert_eq!(adam.state("a").unwrap().step, 1, "a's step is untouched");
    assert_eq!(adam.state("b").unwrap().step, 1);

    let mut sgd = Sgd::new(
        named(&[("a", &a), ("b", &b)]),
        sgd_cfg(0.1, 0.9, 0.0, 0.1, false),
    )
    .unwrap();
    let b_before = vals(&b);
    sgd.step(&grads(&[(&a, &[1.0, 1.0])])).unwrap();
    assert_eq!(vals(&b), b_before);
    assert!(sgd.momentum_buffer("b").is_none());
    assert!(sgd.momentum_buffer("a").is_some());
    // An empty Grads is a no-op.
    let before = (vals(&a), vals(&b));
    sgd.step(&Grads::new()).unwrap();
    assert_eq!((vals(&a), vals(&b)), before);
}

#[test]
fn bf16_params_keep_f32_state_and_round_updates() {
    // SGD, momentum 0.9, lr 1e-3, g = 1, p0 = [1, 8] in bf16 (8 bits of precision: spacing
    // 2^-8 just below 1, 2^-5 just below 8). The f32 buffer is 1, 1.9, 2.71 exactly as in
    // f32; the parameter is rounded back to bf16 after each step:
    //   step 1: 1 - 0.001  = 0.999  -> 1.0        8 - 0.001  -> 8.0
    //   step 2: 1 - 0.0019 = 0.9981 -> 1.0 again (0.998046875 is the next value down)
    //   step 3: 1 - 0.00271 = 0.99729 -> 0.99609375 (= 255/256), 8 - 0.00271 -> 8.0
    let p = param_as(&[1.0, 8.0], DType::BF16);
    let mut opt = Sgd::new(named(&[("p", &p)]), sgd_cfg(1e-3, 0.9, 0.0, 0.0, false)).unwrap();
    let g = grads(&[(&p, &[1.0, 1.0])]);
    let want_p = [[1.0, 8.0], [1.0, 8.0], [0.99609375, 8.0]];
    let want_buf = [1.0, 1.9, 2.71];
    for t in 0..3 {
        opt.step(&g).unwrap();
        assert_eq!(p.dtype(), DType::BF16);
        assert_eq!(vals(&p), want_p[t]);
        let buf = opt.momentum_buffer("p").unwrap();
        assert_eq!(buf.dtype(), DType::F32);
        assert_close(&vals(buf), &[want_buf[t]; 2], 1e-6);
    }

    // Adam, lr 0.01, one step: p - 0.01 sign(g) computed in f32, then rounded to bf16:
    //   1 - 0.01 = 0.99     -> 0.98828125 (253/256; 254/256 = 0.9921875 is farther)
    //   -3 + 0.01 = -2.99   -> -2.984375  (spacing 2^-6 in [2, 4))
    //   0.25 - 0.01 = 0.24  -> 0.240234375 (246 * 2^-10)
    // m = 0.1 g and v = 0.001 g^2 are kept in f32.
    let q = param_as(&[1.0, -3.0, 0.25], DType::BF16);
    let mut adam = Adam::new(named(&[("q", &q)]), adam_cfg(0.01, 0.0)).unwrap();
    adam.step(&grads(&[(&q, &[0.5, -0.5, 2.0])])).unwrap();
    let got: Vec<bf16> = q.to_vec().unwrap();
    let want: Vec<bf16> = [0.98828125, -2.984375, 0.240234375]
        .iter()
        .map(|&x| bf16::from_f64(x))
        .collect();
    assert_eq!(got, want);
    let s = adam.state("q").unwrap();
    assert_eq!(s.exp_avg.dtype(), DType::F32);
    assert_eq!(s.exp_avg_sq.dtype(), DType::F32);
    assert_close(&vals(&s.exp_avg), &[0.05, -0.05, 0.2], 1e-7);
    assert_close(&vals(&s.exp_avg_sq), &[0.00025, 0.00025, 0.004], 1e-9);
}

// ----- state save / load -----------------------------------------------------------------

/// A small regression problem whose gradients depend on the parameters.
struct Problem {
    x: Tensor,
    y: Tensor,
}

impl Problem {
    fn new() -> Self {
        let dev = Device::Cpu;
        Problem {
            x: Tensor::randn((8, 3), DType::F32, &dev, 7).unwrap(),
            y: Tensor::randn((8, 2), DType::F32, &dev, 8).unwrap(),
        }
    }

    /// Fresh parameters: w (3, 2) in f32 and b (2,) in `b_dtype`.
    fn params(&self, b_dtype: DType) -> Vec<(String, Tensor)> {
        let w = Tensor::randn((3, 2), DType::F32, &Device::Cpu, 9).unwrap();
        w.set_requires_grad(true).unwrap();
        let b = param_as(&[0.5, -0.25], b_dtype);
        vec![("w".into(), w), ("layer.b".into(), b)]
    }

    /// Copies of `params` as new trainable leaves (what a resumed run would load).
    fn copies(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        params
            .iter()
            .map(|(n, t)| {
                let c =
                    Tensor::from_host(t.to_host().unwrap(), t.dims().to_vec(), t.device()).unwrap();
                c.set_requires_grad(true).unwrap();
                (n.clone(), c)
            })
            .collect()
    }

    fn grads(&self, ps: &[(String, Tensor)]) -> Grads {
        let b = ps[1].1.to_dtype(DType::F32);
        let loss = || self.x.matmul(&ps[0].1)?.add(&b?)?.mse_loss(&self.y);
        loss().unwrap().backward().unwrap()
    }
}

fn bits(params: &[(String, Tensor)]) -> Vec<Vec<u64>> {
    params
        .iter()
        .map(|(_, t)| vals(t).iter().map(|v| v.to_bits()).collect())
        .collect()
}

type Make = fn(Vec<(String, Tensor)>, f64) -> Box<dyn Optimizer>;

fn make_sgd(p: Vec<(String, Tensor)>, lr: f64) -> Box<dyn Optimizer> {
    Box::new(Sgd::new(p, sgd_cfg(lr, 0.9, 0.0, 0.01, true)).unwrap())
}

fn make_adam(p: Vec<(String, Tensor)>, lr: f64) -> Box<dyn Optimizer> {
    Box::new(Adam::new(p, adam_cfg(lr, 0.01)).unwrap())
}

fn make_adamw(p: Vec<(String, Tensor)>, lr: f64) -> Box<dyn Optimizer> {
    Box::new(AdamW::new(p, adam_cfg(lr, 0.1)).unwrap())
}

/// Steps `range` of a run whose learning-rate "schedule" drops it to 0.05 at step 2.
fn train(opt: &mut dyn Optimizer, p: &Problem, ps: &[(String, Tensor)], range: Range<usize>) {
    for step in range {
        if step == 2 {
            opt.set_learning_rate(0.05);
        }
        opt.step(&p.grads(ps)).unwrap();
    }
}

#[test]
fn state_round_trip_is_bit_identical() {
    let problem = Problem::new();
    let makers: [(&str, Make); 3] = [
        ("sgd", make_sgd),
        ("adam", make_adam),
        ("adamw", make_adamw),
    ];
    for (name, make) in makers {
        for b_dtype in [DType::F32, DType::BF16] {
            let params = problem.params(b_dtype);
            train(&mut *make(params.clone(), 0.2), &problem, &params, 0..10);
            let want = bits(&params);

            // Interrupted after 5 steps and saved.
            let params = problem.params(b_dtype);
            let mut opt = make(params.clone(), 0.2);
            train(&mut *opt, &problem, &params, 0..5);
            let file = TempFile::new(name);
            opt.save_state(file.path()).unwrap();

            // Resumed into fresh tensors and a fresh optimizer built with another lr: the
            // saved lr (set by the schedule) and state are restored.
            let resumed = Problem::copies(&params);
            let mut opt = make(resumed.clone(), 1.0);
            opt.load_state(file.path()).unwrap();
            assert_eq!(opt.learning_rate(), 0.05, "{name}");
            train(&mut *opt, &problem, &resumed, 5..10);
            assert_eq!(bits(&resumed), want, "{name}, b in {b_dtype}");

            // The check has teeth: resuming without the state ends elsewhere.
            let fresh = Problem::copies(&params);
            train(&mut *make(fresh.clone(), 0.05), &problem, &fresh, 5..10);
            assert_ne!(bits(&fresh), want, "{name}, b in {b_dtype}");
        }
    }
}

#[test]
fn state_file_layout() {
    let file = TempFile::new("layout");
    let p = param(&[1.0, 2.0]);
    let q = param(&[3.0]);
    let mut opt = AdamW::new(named(&[("p", &p), ("q", &q)]), AdamConfig::default()).unwrap();
    // Before any step there is no state: the file holds only metadata, and loads.
    opt.save_state(file.path()).unwrap();
    opt.load_state(file.path()).unwrap();
    for _ in 0..3 {
        opt.step(&grads(&[(&p, &[1.0, -1.0])])).unwrap();
    }
    opt.step(&grads(&[(&p, &[1.0, -1.0]), (&q, &[2.0])]))
        .unwrap();
    opt.save_state(file.path()).unwrap();
    let f = flame::safetensors::SafeTensorsFile::open(file.path()).unwrap();
    let names: Vec<&str> = f.names().collect();
    assert_eq!(
        names,
        ["p.exp_avg", "p.exp_avg_sq", "q.exp_avg", "q.exp_avg_sq"]
    );
    let m = f.metadata();
    assert_eq!(m["optimizer"], "adamw");
    assert_eq!(m["step.p"], "4");
    assert_eq!(m["step.q"], "1");
    assert_eq!(m["lr"], "0.001");
    assert_eq!(m["beta2"], "0.999");
    assert_eq!(f.info("p.exp_avg").unwrap().dtype, "F32");

    let mut sgd = Sgd::new(named(&[("p", &p)]), sgd_cfg(1e-3, 0.5, 0.0, 0.0, false)).unwrap();
    sgd.step(&grads(&[(&p, &[1.0, 1.0])])).unwrap();
    sgd.save_state(file.path()).unwrap();
    let f = flame::safetensors::SafeTensorsFile::open(file.path()).unwrap();
    assert_eq!(f.names().collect::<Vec<_>>(), ["p.momentum_buffer"]);
    assert_eq!(f.metadata()["optimizer"], "sgd");
    assert_eq!(f.metadata()["nesterov"], "false");
}

#[test]
fn load_state_errors() {
    let file = TempFile::new("errors");
    let a = param(&[1.0, 2.0, 3.0]);
    let b = param(&[4.0]);
    let mut adam = Adam::new(named(&[("a", &a), ("b", &b)]), AdamConfig::default()).unwrap();
    adam.step(&grads(&[(&a, &[1.0, 1.0, 1.0]), (&b, &[1.0])]))
        .unwrap();
    adam.save_state(file.path()).unwrap();

    // Wrong kind: Adam's state into AdamW and into SGD.
    let mut adamw = AdamW::new(named(&[("a", &a), ("b", &b)]), AdamConfig::default()).unwrap();
    let (o, msg) = opt_err(adamw.load_state(file.path()));
    assert_eq!(o, "AdamW");
    assert!(msg.contains("'adam'") && msg.contains("'adamw'"), "{msg}");
    let mut sgd = Sgd::new(named(&[("a", &a), ("b", &b)]), SgdConfig::default()).unwrap();
    let (o, msg) = opt_err(sgd.load_state(file.path()));
    assert_eq!(o, "SGD");
    assert!(msg.contains("'adam'") && msg.contains("'sgd'"), "{msg}");

    // Unknown parameter: the file has state for b, this optimizer has a and c. The state it
    // had before stays.
    let c = param(&[4.0]);
    let mut other = Adam::new(named(&[("a", &a), ("c", &c)]), AdamConfig::default()).unwrap();
    other.step(&grads(&[(&a, &[1.0, 1.0, 1.0])])).unwrap();
    other.step(&grads(&[(&a, &[1.0, 1.0, 1.0])])).unwrap();
    let (o, msg) = opt_err(other.load_state(file.path()));
    assert_eq!(o, "Adam");
    assert!(msg.contains("'b'"), "{msg}");
    assert_eq!(
        other.state("a").unwrap().step,
        2,
        "a failed load changes nothing"
    );

    // Wrong shape: a has 3 elements in the file, 4 here.
    let a4 = param(&[1.0, 2.0, 3.0, 4.0]);
    let mut other = Adam::new(named(&[("a", &a4), ("b", &b)]), AdamConfig::default()).unwrap();
    let (_, msg) = opt_err(other.load_state(file.path()));
    assert!(msg.contains("'a"), "{msg}");
    assert!(msg.contains("[3]") && msg.contains("[4]"), "{msg}");

    // A missing file is an I/O error naming it.
    let missing = TempFile::new("missing");
    match adam.load_state(missing.path()) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing.path()),
        other => panic!("expected Error::Io, got {other:?}"),
    }

    // A hand-made file with moments but no step count for a.
    let m = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let mut meta = std::collections::BTreeMap::new();
    for (k, v) in [
        ("optimizer", "adam"),
        ("lr", "0.001"),
        ("beta1", "0.9"),
        ("beta2", "0.999"),
        ("eps", "1e-8"),
        ("weight_decay", "0"),
    ] {
        meta.insert(k.to_string(), v.to_string());
    }
    let crafted = TempFile::new("crafted");
    flame::safetensors::save_with_metadata(
        [("a.exp_avg", &m), ("a.exp_avg_sq", &m)],
        &meta,
        crafted.path(),
    )
    .unwrap();
    let (_, msg) = opt_err(adam.load_state(crafted.path()));
    assert!(msg.contains("'a'") && msg.contains("step missing"), "{msg}");
    // With the step count it loads, and b (absent from the file) starts afresh.
    meta.insert("step.a".into(), "7".into());
    flame::safetensors::save_with_metadata(
        [("a.exp_avg", &m), ("a.exp_avg_sq", &m)],
        &meta,
        crafted.path(),
    )
    .unwrap();
    adam.load_state(crafted.path()).unwrap();
    assert_eq!(adam.state("a").unwrap().step, 7);
    assert!(adam.state("b").is_none());
    // A bad hyperparameter in the file is rejected.
    meta.insert("beta1".into(), "1.5".into());
    flame::safetensors::save_with_metadata([("a.exp_avg", &m)], &meta, crafted.path()).unwrap();
    let (_, msg) = opt_err(adam.load_state(crafted.path()));
    assert!(msg.contains("beta1"), "{msg}");
}

// ----- construction and step errors ------------------------------------------------------

#[test]
fn construction_errors() {
    let a = param(&[1.0]);
    let b = param(&[2.0]);

    let (o, msg) = opt_err(Sgd::new(
        named(&[("a", &a), ("a", &b)]),
        SgdConfig::default(),
    ));
    assert_eq!(o, "SGD");
    assert!(msg.contains("'a'") && msg.contains("twice"), "{msg}");

    let (_, msg) = opt_err(Adam::new(
        named(&[("a", &a), ("b", &a)]),
        AdamConfig::default(),
    ));
    assert!(msg.contains("'b'") && msg.contains("'a'"), "{msg}");

    let frozen = Tensor::from_vec(vec![1.0f32], 1, &Device::Cpu).unwrap();
    let (o, msg) = opt_err(AdamW::new(
        named(&[("a", &a), ("frozen", &frozen)]),
        AdamConfig::default(),
    ));
    assert_eq!(o, "AdamW");
    assert!(
        msg.contains("'frozen'") && msg.contains("require grad"),
        "{msg}"
    );

    let computed = a.mul_scalar(2.0).unwrap();
    let (_, msg) = opt_err(Sgd::new(
        named(&[("twice_a", &computed)]),
        SgdConfig::default(),
    ));
    assert!(
        msg.contains("'twice_a'") && msg.contains("not a leaf"),
        "{msg}"
    );

    let bad_sgd = [
        sgd_cfg(-0.1, 0.0, 0.0, 0.0, false),
        sgd_cfg(f64::NAN, 0.0, 0.0, 0.0, false),
        sgd_cfg(1e-3, -0.5, 0.0, 0.0, false),
        sgd_cfg(1e-3, 0.0, 0.0, -1.0, false),
        // Nesterov without momentum, and with dampening.
        sgd_cfg(1e-3, 0.0, 0.0, 0.0, true),
        sgd_cfg(1e-3, 0.9, 0.1, 0.0, true),
    ];
    for c in bad_sgd {
        let (o, _) = opt_err(Sgd::new(named(&[("a", &a)]), c));
        assert_eq!(o, "SGD", "{c:?}");
    }
    let bad_adam = [
        adam_cfg(-1e-3, 0.0),
        adam_full(1e-3, 1.0, 0.999, 1e-8, 0.0),
        adam_full(1e-3, 0.9, -0.1, 1e-8, 0.0),
        adam_full(1e-3, 0.9, 0.999, -1e-8, 0.0),
        adam_cfg(1e-3, -0.01),
    ];
    for c in bad_adam {
        let (o, _) = opt_err(Adam::new(named(&[("a", &a)]), c));
        assert_eq!(o, "Adam", "{c:?}");
        let (o, _) = opt_err(AdamW::new(named(&[("a", &a)]), c));
        assert_eq!(o, "AdamW", "{c:?}");
    }
    // Boundary values are fine: beta 0, eps 0, lr 0.
    Adam::new(named(&[("a", &a)]), adam_full(0.0, 0.0, 0.0, 0.0, 0.0)).unwrap();
}

#[test]
fn step_errors() {
    let a = param(&[1.0, 2.0]);
    let b = param(&[3.0, 4.0, 5.0]);
    let mut opt = Adam::new(named(&[("a", &a), ("b", &b)]), AdamConfig::default()).unwrap();
    // b's gradient has the wrong shape: nothing is updated, not even a.
    let mut g = grads(&[(&a, &[1.0, 1.0])]);
    g.insert(&b, Tensor::zeros((3, 1), DType::F32, &Device::Cpu).unwrap());
    let (o, msg) = opt_err(opt.step(&g));
    assert_eq!(o, "Adam");
    assert!(
        msg.contains("'b'") && msg.contains("[3, 1]") && msg.contains("[3]"),
        "{msg}"
    );
    assert_eq!(vals(&a), [1.0, 2.0]);
    assert!(opt.state("a").is_none());

    // A learning rate set to a bad value is caught by the next step.
    let mut sgd = Sgd::new(named(&[("a", &a)]), SgdConfig::default()).unwrap();
    sgd.set_learning_rate(-1.0);
    assert_eq!(sgd.learning_rate(), -1.0);
    let (o, _) = opt_err(sgd.step(&grads(&[(&a, &[1.0, 1.0])])));
    assert_eq!(o, "SGD");
    assert_eq!(vals(&a), [1.0, 2.0]);
}

// ----- end to end ------------------------------------------------------------------------

/// Fits y = 3x + 2 on 64 points in [-1, 1] by full-batch gradient descent; returns the final
/// loss, w and b.
fn fit_line(
    make: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer>,
    steps: usize,
) -> (f64, f64, f64) {
    let dev = Device::Cpu;
    let xs: Vec<f32> = (0..64).map(|i| -1.0 + 2.0 * i as f32 / 63.0).collect();
    let x = Tensor::from_vec(xs, (64, 1), &dev).unwrap();
    let y = x.affine(3.0, 2.0).unwrap();
    let w = Tensor::zeros((1, 1), DType::F32, &dev).unwrap();
    let b = Tensor::zeros(1, DType::F32, &dev).unwrap();
    w.set_requires_grad(true).unwrap();
    b.set_requires_grad(true).unwrap();
    let mut opt = make(named(&[("w", &w), ("b", &b)]));
    let loss = || x.matmul(&w)?.add(&b)?.mse_loss(&y);
    let first = loss().unwrap().to_scalar_f64().unwrap();
    for _ in 0..steps {
        let g = loss().unwrap().backward().unwrap();
        opt.step(&g).unwrap();
    }
    let last = loss().unwrap().to_scalar_f64().unwrap();
    assert!(last < first, "the loss fell from {first} to {last}");
    (last, vals(&w)[0], vals(&b)[0])
}

#[test]
fn linear_regression_adamw_and_sgd_momentum() {
    let adamw = fit_line(
        |p| {
            let c = adam_cfg(0.05, 1e-4);
            Box::new(AdamW::new(p, c).unwrap())
        },
        500,
    );
    let sgd = fit_line(
        |p| {
            let c = sgd_cfg(0.1, 0.9, 0.0, 0.0, false);
            Box::new(Sgd::new(p, c).unwrap())
        },
        300,
    );
    for (name, (loss, w, b)) in [("AdamW", adamw), ("SGD", sgd)] {
        assert!(loss < 1e-3, "{name}: loss {loss}");
        assert!((w - 3.0).abs() < 0.05, "{name}: w {w}");
        assert!((b - 2.0).abs() < 0.05, "{name}: b {b}");
    }
}

#[test]
fn optimizers_refuse_an_empty_parameter_list() {
    let (who, msg) = opt_err(AdamW::new(vec![], adam_cfg(1e-3, 0.0)));
    assert_eq!(who, "AdamW");
    assert!(msg.contains("no parameters"), "{msg}");
    let (_, msg) = opt_err(Sgd::new(vec![], sgd_cfg(0.1, 0.0, 0.0, 0.0, false)));
    assert!(msg.contains("no parameters"), "{msg}");
}

// ----- parameter groups --------------------------------------------------------------------

use flame::optim::{
    build_groups, AdamWScheduleFreeConfig, Lion8bitConfig, LionConfig, OptimizerConfig,
    OptimizerKind, ParamGroup, ProdigyConfig, ProdigyScheduleFreeConfig,
};

/// `params` split into groups: w at the run's rate, layer.b at `scale` times it with no
/// weight decay.
fn two_groups(params: &[(String, Tensor)], scale: f64) -> Vec<ParamGroup> {
    vec![
        ParamGroup {
            name: "default".into(),
            lr_scale: 1.0,
            weight_decay: None,
            params: params[..1].to_vec(),
        },
        ParamGroup {
            name: "up".into(),
            lr_scale: scale,
            weight_decay: Some(0.0),
            params: params[1..].to_vec(),
        },
    ]
}

/// The kinds the group tests run: AdamW, Prodigy, Lion, Lion8bit (parameters of 4 values or
/// more on 8-bit momenta: w, not b) and the schedule-free kinds.
fn group_kinds() -> Vec<OptimizerConfig> {
    let lion = LionConfig {
        lr: 0.2,
        weight_decay: 0.1,
        ..Default::default()
    };
    vec![
        OptimizerConfig::AdamW(adam_cfg(0.2, 0.1)),
        OptimizerConfig::Prodigy(ProdigyConfig {
            weight_decay: 0.01,
            ..Default::default()
        }),
        OptimizerConfig::Lion(lion),
        OptimizerConfig::Lion8bit(Lion8bitConfig {
            lion,
            min_8bit_size: 4,
        }),
        OptimizerConfig::AdamWScheduleFree(AdamWScheduleFreeConfig {
            lr: 0.2,
            weight_decay: 0.1,
            ..Default::default()
        }),
        OptimizerConfig::ProdigyScheduleFree(ProdigyScheduleFreeConfig {
            weight_decay: 0.01,
            ..Default::default()
        }),
    ]
}

#[test]
fn groups_step_as_one_optimizer_per_group_at_its_rate() {
    // PyTorch's param groups: each group its lr (here the run's times its multiplier, so a
    // schedule moves them together) and weight decay; the same as separate optimizers.
    // (Multipliers of powers of two: the products are exact.)
    let problem = Problem::new();
    for config in [
        OptimizerConfig::AdamW(adam_cfg(0.2, 0.1)),
        group_kinds()[2],
        group_kinds()[4],
    ] {
        let base = config.lr();
        let params = problem.params(DType::F32);
        let mut grouped = build_groups(config, two_groups(&params, 4.0)).unwrap();
        let split = problem.params(DType::F32);
        let mut w = config.build(split[..1].to_vec()).unwrap();
        let mut b = config
            .with_lr(base * 4.0)
            .with_weight_decay(0.0)
            .build(split[1..].to_vec())
            .unwrap();
        for step in 0..6 {
            if step == 2 {
                grouped.set_learning_rate(base / 4.0);
                w.set_learning_rate(base / 4.0);
                b.set_learning_rate(base);
            }
            grouped.step(&problem.grads(&params)).unwrap();
            let g = problem.grads(&split);
            w.step(&g).unwrap();
            b.step(&g).unwrap();
        }
        assert_eq!(grouped.learning_rate(), base / 4.0);
        assert_eq!(bits(&params), bits(&split), "{config:?}");
        // Eval and train mode reach every group (schedule-free: the parameters move to x
        // and back).
        let before = bits(&params);
        grouped.eval_mode().unwrap();
        w.eval_mode().unwrap();
        b.eval_mode().unwrap();
        assert_eq!(bits(&params), bits(&split), "{config:?}: eval mode");
        if config.kind().is_schedule_free() {
            assert_ne!(bits(&params)[0], before[0], "{config:?}: w moved to x");
            assert_ne!(bits(&params)[1], before[1], "{config:?}: b moved to x");
        }
        grouped.train_mode().unwrap();
        w.train_mode().unwrap();
        b.train_mode().unwrap();
        assert_eq!(bits(&params), bits(&split), "{config:?}: train mode");
        // The multiplier changes the update: the check has teeth.
        let other = problem.params(DType::F32);
        let mut one = build_groups(config, two_groups(&other, 1.0)).unwrap();
        one.step(&problem.grads(&other)).unwrap();
        let once = problem.params(DType::F32);
        let mut g3 = build_groups(config, two_groups(&once, 4.0)).unwrap();
        g3.step(&problem.grads(&once)).unwrap();
        assert_ne!(bits(&other), bits(&once), "{config:?}");
    }
}

#[test]
fn grouped_state_resumes_exactly_in_one_file() {
    let problem = Problem::new();
    for config in group_kinds() {
        let run = |opt: &mut dyn Optimizer, ps: &[(String, Tensor)], r: Range<usize>| {
            for step in r {
                opt.set_learning_rate(if step < 2 { 1.0 } else { 0.5 } * config.lr());
                opt.step(&problem.grads(ps)).unwrap();
            }
        };
        let params = problem.params(DType::F32);
        run(
            &mut *build_groups(config, two_groups(&params, 4.0)).unwrap(),
            &params,
            0..8,
        );
        let want = bits(&params);

        let params = problem.params(DType::F32);
        let mut opt = build_groups(config, two_groups(&params, 4.0)).unwrap();
        run(&mut *opt, &params, 0..4);
        let file = TempFile::new("groups");
        opt.save_state(file.path()).unwrap();
        let st = flame::safetensors::SafeTensorsFile::open(file.path()).unwrap();
        assert_eq!(st.metadata()["optimizer"], "groups");
        assert_eq!(st.metadata()["groups"], "2");
        assert_eq!(st.metadata()["group.1.name"], "up");
        assert_eq!(st.metadata()["group.1.lr_scale"], "4");
        assert!(st
            .names()
            .all(|n| n.starts_with("group.0.w.") || n.starts_with("group.1.layer.b.")));
        let b_state = match config.kind() {
            OptimizerKind::Lion | OptimizerKind::Lion8bit => "group.1.layer.b.exp_avg",
            _ => "group.1.layer.b.exp_avg_sq",
        };
        assert!(st.contains(b_state), "{config:?}");
        if config.kind() == OptimizerKind::Lion8bit {
            assert!(st.contains("group.0.w.exp_avg_codes"), "{config:?}");
        }

        let resumed = Problem::copies(&params);
        let mut opt = build_groups(config, two_groups(&resumed, 4.0)).unwrap();
        opt.load_state(file.path()).unwrap();
        run(&mut *opt, &resumed, 4..8);
        assert_eq!(bits(&resumed), want, "{config:?}");

        // Without the state the run ends elsewhere.
        let fresh = Problem::copies(&params);
        run(
            &mut *build_groups(config, two_groups(&fresh, 4.0)).unwrap(),
            &fresh,
            4..8,
        );
        assert_ne!(bits(&fresh), want, "{config:?}");

        // Groups of other names, or one optimizer, do not read the file.
        let mut renamed = two_groups(&Problem::copies(&params), 4.0);
        renamed[1].name = "b".into();
        let e = build_groups(config, renamed)
            .unwrap()
            .load_state(file.path())
            .unwrap_err();
        assert!(e.to_string().contains("\"b\""), "{e}");
        let e = config
            .build(Problem::copies(&params))
            .unwrap()
            .load_state(file.path())
            .unwrap_err();
        assert!(e.to_string().contains("groups"), "{e}");
    }
}

#[test]
fn one_group_is_the_plain_optimizer_and_its_file() {
    let problem = Problem::new();
    let config = OptimizerConfig::AdamW(adam_cfg(0.2, 0.1));
    let a = problem.params(DType::F32);
    let b = problem.params(DType::F32);
    let mut plain = config.build(a.clone()).unwrap();
    let one = ParamGroup {
        name: "default".into(),
        lr_scale: 1.0,
        weight_decay: None,
        params: b.clone(),
    };
    let mut grouped = build_groups(config, vec![one.clone()]).unwrap();
    for _ in 0..3 {
        plain.step(&problem.grads(&a)).unwrap();
        grouped.step(&problem.grads(&b)).unwrap();
    }
    let (fa, fb) = (TempFile::new("plain"), TempFile::new("one"));
    plain.save_state(fa.path()).unwrap();
    grouped.save_state(fb.path()).unwrap();
    assert_eq!(
        std::fs::read(fa.path()).unwrap(),
        std::fs::read(fb.path()).unwrap()
    );
    // A lone group at another rate writes the same layout (its optimizer's own file).
    let scaled = ParamGroup {
        lr_scale: 2.0,
        ..one
    };
    let mut g = build_groups(config, vec![scaled]).unwrap();
    let fc = TempFile::new("scaled");
    g.step(&problem.grads(&b)).unwrap();
    g.save_state(fc.path()).unwrap();
    let st = flame::safetensors::SafeTensorsFile::open(fc.path()).unwrap();
    assert_eq!(st.metadata()["optimizer"], "adamw");
    assert_eq!(st.metadata()["lr"], "0.4");
    // A parameter in two groups is refused.
    let twice = vec![
        ParamGroup {
            name: "a".into(),
            lr_scale: 1.0,
            weight_decay: None,
            params: b.clone(),
        },
        ParamGroup {
            name: "b".into(),
            lr_scale: 2.0,
            weight_decay: None,
            params: b[..1].to_vec(),
        },
    ];
    let e = build_groups(config, twice).err().unwrap();
    assert!(e.to_string().contains("in groups"), "{e}");
}
