//! Helpers of the 8-bit weight and product suites (tests/fp8.rs, fp8_products.rs,
//! int8_products.rs, produce8.rs): deterministic values, the GPU where there is one, and a
//! Linear with a bias and a rank-2 LoRA built through a configured `VarBuilder`.
#![allow(dead_code)]

use flame::nn::{Adapters, Linear, LoraConfig, VarBuilder};
use flame::{DType, Device, Tensor};
use std::collections::HashMap;

/// Deterministic values in [-amp, amp) (64-bit LCG, Knuth's constants).
pub fn lcg(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

/// The first CUDA GPU, or None (said on stderr) where there is none.
#[cfg(feature = "cuda")]
pub fn cuda() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no GPU ({e})");
            None
        }
    }
}

/// A Linear `l` built from `w` (out, in) and bias `b` in f32 on `dev`, through the builder
/// `with` makes of the plain one (FP8 storage, 8-bit products, ...), with a LoRA of rank 2
/// (alpha 2, seed 3) on it.
pub fn lora_linear(
    w: &[f32],
    b: &[f32],
    (out, inp): (usize, usize),
    dev: &Device,
    with: impl FnOnce(VarBuilder) -> flame::Result<VarBuilder>,
) -> Linear {
    let cpu = Device::Cpu;
    let mut t = HashMap::new();
    t.insert(
        "l.weight".to_string(),
        Tensor::from_vec(w.to_vec(), (out, inp), &cpu).unwrap(),
    );
    t.insert(
        "l.bias".to_string(),
        Tensor::from_vec(b.to_vec(), out, &cpu).unwrap(),
    );
    let adapters = Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        dropout: 0.0,
        targets: vec!["l".into()],
        seed: 3,
    })
    .unwrap();
    let vb = with(VarBuilder::from_tensors(t, DType::F32, dev))
        .unwrap()
        .with_adapters(adapters)
        .unwrap();
    Linear::new(&vb.pp("l"), inp, out, true).unwrap()
}
