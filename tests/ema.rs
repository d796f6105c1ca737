//! The moving average of the weights: the fused update (one multi-tensor launch over every
//! weight) against its composite twin (`Ema::update_composite`) and the host-memory loop, on
//! weights of odd sizes and f32, bf16 and f16; and (ignored unless on a GPU) CUDA against the
//! CPU reference, bit for bit. The decay schedule and one update against diffusers' EMAModel
//! are tested in tests/runlogs.rs.
#![cfg(feature = "cpu-ref")]

use flame::train::config::EmaDevice;
use flame::train::ema::{Ema, EmaSchedule};
use flame::{DType, Device, Tensor};

/// A warm-up schedule whose decay moves every step (so every update has its own `1 - d`).
fn schedule() -> EmaSchedule {
    EmaSchedule {
        decay: 0.999,
        min_decay: 0.0,
        update_after_step: 0,
        warmup: true,
        inv_gamma: 1.0,
        power: 2.0 / 3.0,
    }
}

/// Weights of odd sizes and mixed dtypes on `dev`, from `seed`.
fn weights(dev: &Device, seed: u64) -> Vec<(String, Tensor)> {
    [
        ("a", vec![257], DType::F32),
        ("b", vec![37, 53], DType::BF16),
        ("c", vec![1, 1], DType::F16),
        ("d", vec![70, 130], DType::F32),
        ("e", vec![3], DType::BF16),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (n, dims, dt))| {
        let t = Tensor::randn(dims, DType::F32, &Device::Cpu, seed * 10 + i as u64)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .to_device(dev)
            .unwrap();
        (n.to_string(), t)
    })
    .collect()
}

/// Puts the values of `src` into `dst` (same names and shapes).
fn set(dst: &[(String, Tensor)], src: &[(String, Tensor)]) {
    for ((_, d), (_, s)) in dst.iter().zip(src) {
        d.assign(&s.to_device(d.device()).unwrap()).unwrap();
    }
}

fn shadow_bits(e: &Ema) -> Vec<Vec<u32>> {
    e.tensors(&Device::Cpu)
        .unwrap()
        .iter()
        .map(|t| {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// Eight updates with new weights each time: the fused update equals the host loop bit for
/// bit (the same f32 operations) and the composite tensor ops within one f32 rounding of
/// each operation; the average moved away from the first weights.
#[test]
fn the_fused_update_equals_the_composite_and_the_host_loop() {
    let w = weights(&Device::Cpu, 1);
    let mut fused = Ema::new(&w, schedule(), EmaDevice::Gpu).unwrap();
    let mut composite = Ema::new(&w, schedule(), EmaDevice::Gpu).unwrap();
    let mut host = Ema::new(&w, schedule(), EmaDevice::Cpu).unwrap();
    let start = shadow_bits(&fused);
    for k in 2..10 {
        set(&w, &weights(&Device::Cpu, k));
        fused.update(&w).unwrap();
        composite.update_composite(&w).unwrap();
        host.update(&w).unwrap();
        assert_eq!(shadow_bits(&fused), shadow_bits(&host), "update {k}");
        let (f, c) = (
            fused.tensors(&Device::Cpu).unwrap(),
            composite.tensors(&Device::Cpu).unwrap(),
        );
        for (a, b) in f.iter().zip(&c) {
            for (x, y) in a
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .zip(b.to_vec::<f32>().unwrap())
            {
                assert!(
                    (x - y).abs() <= 4.0 * f32::EPSILON * y.abs().max(1.0),
                    "update {k}: {x} vs {y}"
                );
            }
        }
    }
    assert_eq!(fused.steps(), 8);
    assert_ne!(shadow_bits(&fused), start);
}

/// A weight the fused launch does not take (a strided view) sends the update through the
/// composite: the result is the composite's.
#[test]
fn a_strided_weight_takes_the_composite() {
    let base = Tensor::randn((6, 4), DType::F32, &Device::Cpu, 7).unwrap();
    let w = vec![("t".to_string(), base.t().unwrap())];
    let mut a = Ema::new(&w, schedule(), EmaDevice::Gpu).unwrap();
    let mut b = Ema::new(&w, schedule(), EmaDevice::Gpu).unwrap();
    for k in 0..3 {
        base.assign(&Tensor::randn((6, 4), DType::F32, &Device::Cpu, 20 + k).unwrap())
            .unwrap();
        a.update(&w).unwrap();
        b.update_composite(&w).unwrap();
    }
    assert_eq!(shadow_bits(&a), shadow_bits(&b));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_fused_update_matches_the_cpu_bit_for_bit() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    let (wc, wg) = (weights(&Device::Cpu, 1), weights(&gpu, 1));
    let mut ec = Ema::new(&wc, schedule(), EmaDevice::Gpu).unwrap();
    let mut eg = Ema::new(&wg, schedule(), EmaDevice::Gpu).unwrap();
    assert!(eg.on_device());
    for k in 2..8 {
        let next = weights(&Device::Cpu, k);
        set(&wc, &next);
        set(&wg, &next);
        ec.update(&wc).unwrap();
        eg.update(&wg).unwrap();
        assert_eq!(shadow_bits(&ec), shadow_bits(&eg), "update {k}");
    }
}
