//! Training objectives against formulas written out here in f64: flow matching, the timestep
//! samplers (SD3's logit-normal and shift, Flux's resolution shift from BFL's constants),
//! DDPM's scaled-linear schedule with ε / v targets and min-SNR-γ weights, weighted MSE.
#![cfg(feature = "cpu-ref")]

use flame::train::{
    flow_matching, flux_mu, flux_time_shift, shift_time, weighted_mse, Ddpm, Prediction,
    TimestepSampling,
};
use flame::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn v(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[test]
fn flow_matching_interpolates_and_targets_the_velocity() {
    let x0 = Tensor::randn((3, 2, 4), DType::F64, &CPU, 1).unwrap();
    let e = Tensor::randn((3, 2, 4), DType::F64, &CPU, 2).unwrap();
    let t = Tensor::from_vec(vec![0.0f64, 0.25, 1.0], 3, &CPU).unwrap();
    let (xt, target) = flow_matching(&x0, &e, &t).unwrap();
    let (a, b, x, tg) = (v(&x0), v(&e), v(&xt), v(&target));
    for i in 0..24 {
        let ti = [0.0, 0.25, 1.0][i / 8];
        assert!((x[i] - ((1.0 - ti) * a[i] + ti * b[i])).abs() < 1e-15);
        assert!((tg[i] - (b[i] - a[i])).abs() < 1e-15);
    }
    let bad = Tensor::from_vec(vec![0.5f64; 2], 2, &CPU).unwrap();
    assert!(flow_matching(&x0, &e, &bad).is_err());
}

#[test]
fn timestep_samplers() {
    let n = 20_000;
    let mean = |t: &[f64]| t.iter().sum::<f64>() / t.len() as f64;
    let u = v(&TimestepSampling::Uniform.sample(n, 4096, 7, &CPU).unwrap());
    assert!((mean(&u) - 0.5).abs() < 0.01);
    assert!(u.iter().all(|&t| t > 0.0 && t < 1.0));
    // logit(t) ~ N(0.5, 0.8²).
    let ln = TimestepSampling::LogitNormal {
        mean: 0.5,
        std: 0.8,
    };
    let l: Vec<f64> = v(&ln.sample(n, 4096, 7, &CPU).unwrap())
        .iter()
        .map(|t| (t / (1.0 - t)).ln())
        .collect();
    let m = mean(&l);
    let sd = (l.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64).sqrt();
    assert!(
        (m - 0.5).abs() < 0.02 && (sd - 0.8).abs() < 0.02,
        "{m} {sd}"
    );
    // The same seed gives the same draws.
    assert_eq!(
        v(&ln.sample(5, 0, 3, &CPU).unwrap()),
        v(&ln.sample(5, 0, 3, &CPU).unwrap())
    );
    // SD3's shift 3: t = 0.5 -> 0.75, fixed points 0 and 1, monotone.
    assert!((shift_time(3.0, 0.5) - 0.75).abs() < 1e-15);
    assert_eq!((shift_time(3.0, 0.0), shift_time(3.0, 1.0)), (0.0, 1.0));
    let s = v(&TimestepSampling::Shift { shift: 3.0 }
        .sample(n, 0, 9, &CPU)
        .unwrap());
    assert!(mean(&s) > 0.6, "the shift moves t towards noise");
    // Flux: mu 0.5 at 256 tokens, 1.15 at 4096 (BFL base_shift / max_shift), and
    // time_shift(mu, t) = e^mu / (e^mu + 1/t - 1).
    assert!((flux_mu(256) - 0.5).abs() < 1e-12 && (flux_mu(4096) - 1.15).abs() < 1e-12);
    let t = 0.3;
    let want = 1.15f64.exp() / (1.15f64.exp() + 1.0 / t - 1.0);
    assert!((flux_time_shift(flux_mu(4096), t) - want).abs() < 1e-15);
    let fs = TimestepSampling::FluxShift {
        mean: 0.0,
        std: 1.0,
    };
    let (lo, hi) = (
        mean(&v(&fs.sample(n, 256, 5, &CPU).unwrap())),
        mean(&v(&fs.sample(n, 4096, 5, &CPU).unwrap())),
    );
    assert!(hi > lo && lo > 0.5, "{lo} {hi}");
    assert!(TimestepSampling::LogitNormal {
        mean: 0.0,
        std: 0.0
    }
    .validate()
    .is_err());
    assert!(TimestepSampling::Shift { shift: -1.0 }.validate().is_err());
}

#[test]
fn ddpm_scaled_linear_schedule_targets_and_min_snr() {
    let d = Ddpm::scaled_linear();
    assert_eq!(d.steps(), 1000);
    // beta_0 = 0.00085; ᾱ_999 = 0.004660098513077238 from PyTorch in f64
    // (torch.cumprod(1 - torch.linspace(0.00085**0.5, 0.012**0.5, 1000)**2)), 0.0046600951
    // in diffusers' f32.
    assert!((d.alphas_cumprod[0] - (1.0 - 0.00085)).abs() < 1e-15);
    assert!((d.alphas_cumprod[999] - 0.004660098513077238).abs() < 1e-15);
    let x0 = Tensor::randn((2, 3), DType::F64, &CPU, 1).unwrap();
    let e = Tensor::randn((2, 3), DType::F64, &CPU, 2).unwrap();
    let t = Tensor::from_vec(vec![10f32, 900.0], 2, &CPU).unwrap();
    let (a, b) = (v(&x0), v(&e));
    for pred in [Prediction::Epsilon, Prediction::V] {
        let (xt, target) = d.noisy_and_target(&x0, &e, &t, pred).unwrap();
        let (x, tg) = (v(&xt), v(&target));
        for i in 0..6 {
            let ab = d.alphas_cumprod[[10, 900][i / 3]];
            assert!((x[i] - (ab.sqrt() * a[i] + (1.0 - ab).sqrt() * b[i])).abs() < 1e-12);
            let want = match pred {
                Prediction::Epsilon => b[i],
                Prediction::V => ab.sqrt() * b[i] - (1.0 - ab).sqrt() * a[i],
            };
            assert!((tg[i] - want).abs() < 1e-12);
        }
        let w = v(&d.min_snr_weights(&t, 5.0, pred).unwrap());
        for (k, &s) in [10usize, 900].iter().enumerate() {
            let snr = d.alphas_cumprod[s] / (1.0 - d.alphas_cumprod[s]);
            let want = match pred {
                Prediction::Epsilon => snr.min(5.0) / snr,
                Prediction::V => snr.min(5.0) / (snr + 1.0),
            };
            assert!((w[k] - want).abs() < 1e-6, "{pred:?} t={s}");
        }
    }
    let bad = Tensor::from_vec(vec![10.5f32, 1000.0], 2, &CPU).unwrap();
    assert!(d
        .noisy_and_target(&x0, &e, &bad, Prediction::Epsilon)
        .is_err());
    let ts = v(&d.sample_timesteps(1000, 3, &CPU).unwrap());
    assert!(ts
        .iter()
        .all(|&s| s.fract() == 0.0 && (0.0..1000.0).contains(&s)));
}

#[test]
fn weighted_mse_is_the_weighted_batch_mean() {
    let p = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), &CPU).unwrap();
    let q = Tensor::from_vec(vec![0f32, 0., 1., 1.], (2, 2), &CPU).unwrap();
    let w = Tensor::from_vec(vec![2f32, 0.5], 2, &CPU).unwrap();
    // Per sample: (1 + 4) / 2 = 2.5 and (4 + 9) / 2 = 6.5; weighted: (5 + 3.25) / 2.
    assert_eq!(
        weighted_mse(&p, &q, None).unwrap().to_scalar_f64().unwrap(),
        4.5
    );
    assert_eq!(
        weighted_mse(&p, &q, Some(&w))
            .unwrap()
            .to_scalar_f64()
            .unwrap(),
        4.125
    );
}
