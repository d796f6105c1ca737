//! The adapters' compute copies (`ComputeCopies`): the grouped copy and fold against the
//! per-tensor cast and the cast's VJP (bit for bit, odd sizes, on the CPU and on CUDA);
//! a tiny SDXL UNet's losses and f32 gradients with the copies equal those of per-use casts
//! bit for bit for every kind (one micro-batch and two accumulated, and through a
//! checkpointed block); the casts a forward records fall from one per weight (and one
//! scaling per LoRA) to none.
#![cfg(feature = "cpu-ref")]

use flame::autograd::{checkpoint_opts, recorded_ops, CheckpointOptions};
use flame::nn::adapter::{AdapterConfig, Adapters, ComputeCopies};
use flame::nn::{Linear, VarBuilder};
use flame::{DType, Device, Grads, Tensor};
use std::sync::Arc;

const CPU: Device = Device::Cpu;
/// Sizes around the CUDA chunk (4096 values) and odd ones.
const SIZES: [usize; 5] = [1, 7, 33, 4097, 5003];

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The grouped copy and fold on `dev` equal `w.affine(s, 0).to_dtype(dt)` and the per-use
/// VJPs (`g.to_dtype(f32).affine(s, 0)`, added to the earlier gradient) bit for bit.
fn grouped_matches_per_tensor(dev: &Device) {
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let masters: Vec<(Tensor, f64)> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let src = if i % 2 == 0 { DType::F32 } else { DType::BF16 };
                let t = Tensor::randn(n, src, dev, 10 + i as u64).unwrap();
                (t, if i % 3 == 0 { 1.0 } else { 0.37 })
            })
            .collect();
        let copies = ComputeCopies::new(masters.clone(), dt).unwrap();
        assert_eq!(copies.len(), SIZES.len());
        let mut grads = Grads::new();
        let mut want = vec![];
        for (i, (m, s)) in masters.iter().enumerate() {
            let per_use = match *s == 1.0 {
                true => m.to_dtype(dt).unwrap(),
                // Scaled in f32, as an f32 master is (a bf16 one would round twice).
                false => {
                    let m32 = m.to_dtype(DType::F32).unwrap();
                    m32.affine(*s, 0.0).unwrap().to_dtype(dt).unwrap()
                }
            };
            let copy = copies.get(m, *s).unwrap();
            assert_eq!(copy.dtype(), dt);
            let (c, u) = (copy.to_vec_f64().unwrap(), per_use.to_vec_f64().unwrap());
            // Unscaled: bit for bit. Scaled: within one step of the dtype (the CPU's f32
            // affine and an f32 product can round a near-tie differently).
            let ulp = match dt {
                DType::BF16 => 2f64.powi(-7),
                DType::F16 => 2f64.powi(-10),
                _ => 2f64.powi(-23),
            };
            for (k, (a, b)) in c.iter().zip(&u).enumerate() {
                match *s == 1.0 {
                    true => assert_eq!(a.to_bits(), b.to_bits(), "{dt:?} copy {i} at {k}"),
                    false => assert!(
                        (a - b).abs() <= ulp * b.abs().max(1e-30),
                        "{dt:?} copy {i} at {k}: {a} vs {b}"
                    ),
                }
            }
            // The copy's gradient, and (for every other) an earlier f32 gradient.
            let g = Tensor::randn(m.dims().to_vec(), dt, dev, 50 + i as u64).unwrap();
            let mut vjp = g.to_dtype(DType::F32).unwrap();
            if *s != 1.0 {
                vjp = vjp.affine(*s, 0.0).unwrap();
            }
            if i % 2 == 1 {
                let prev = Tensor::randn(m.dims().to_vec(), DType::F32, dev, 90 + i as u64);
                let prev = prev.unwrap();
                vjp = prev.add(&vjp).unwrap();
                grads.insert(m, prev);
            }
            grads.insert(copy, g);
            want.push(vjp);
        }
        assert_eq!(copies.fold(&mut grads).unwrap(), SIZES.len());
        for (i, ((m, s), w)) in masters.iter().zip(&want).enumerate() {
            let g = grads.get(m).unwrap();
            assert_eq!(g.dtype(), DType::F32);
            assert_eq!(bits(g), bits(w), "{dt:?} fold {i}");
            let _ = s;
            assert!(grads.get(copies.get(m, *s).unwrap()).is_none());
        }
    }
}

#[test]
fn grouped_copy_and_fold_match_per_tensor_casts_on_cpu() {
    grouped_matches_per_tensor(&CPU);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_copy_and_fold_match_per_tensor_casts_on_cuda() {
    let gpu = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no CUDA device ({e})");
            return;
        }
    };
    grouped_matches_per_tensor(&gpu);
}

fn config(kind: &str, tucker: bool) -> AdapterConfig {
    AdapterConfig {
        kind: kind.into(),
        rank: 2,
        // alpha / rank = 1.5 for Linears, 0.5 for convolutions: LoRA's up carries a factor.
        alpha: 3.0,
        dropout: 0.0,
        module_dropout: 0.0,
        rank_dropout: 0.0,
        targets: vec!["input_blocks.*".into(), "output_blocks.*".into()],
        seed: 3,
        conv_rank: 2,
        conv_alpha: 1.0,
        factor: -1,
        decompose_both: false,
        lokr_split: Default::default(),
        tucker,
        weight_decompose: false,
        wd_on_out: true,
        per_projection: false,
    }
}

/// A tiny SDXL UNet in bf16 with `kind`'s adapters, every adapter tensor random.
fn unet(kind: &str) -> (Arc<Adapters>, flame::models::sdxl::Unet) {
    use flame::models::sdxl::{SdxlConfig, Unet};
    let cfg = SdxlConfig {
        in_channels: 4,
        out_channels: 4,
        model_channels: 8,
        block_out_channels: vec![8, 16],
        num_res_blocks: 1,
        transformer_depth: vec![0, 1],
        num_heads: vec![1, 2],
        transformer_depth_middle: 1,
        context_dim: 12,
        adm_in_channels: 10,
        addition_time_embed_dim: 4,
        num_groups: 4,
    };
    let tucker = kind.ends_with("_tucker");
    let a = Adapters::new(config(kind.trim_end_matches("_tucker"), tucker)).unwrap();
    let vb = VarBuilder::random(5, 0.2, DType::BF16, &CPU)
        .with_adapters(a.clone())
        .unwrap();
    let unet = Unet::new(&vb, &cfg).unwrap();
    for (i, (_, p)) in a.params().unwrap().iter().enumerate() {
        let r = Tensor::randn(p.dims().to_vec(), DType::F32, &CPU, 30 + i as u64).unwrap();
        p.assign(&r.affine(0.1, 0.0).unwrap()).unwrap();
    }
    (a, unet)
}

/// The mean square of the UNet's output for micro-batch `micro`.
fn loss(unet: &flame::models::sdxl::Unet, micro: u64) -> Tensor {
    let x = Tensor::randn((1, 4, 8, 8), DType::BF16, &CPU, 1 + 10 * micro).unwrap();
    let t = Tensor::full(500.0, 1, DType::BF16, &CPU).unwrap();
    let ctx = Tensor::randn((1, 5, 12), DType::BF16, &CPU, 2 + 10 * micro).unwrap();
    let y = Tensor::randn((1, 10), DType::BF16, &CPU, 3 + 10 * micro).unwrap();
    let out = unet.forward(&x, &t, &ctx, &y).unwrap();
    out.to_dtype(DType::F32)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
}

/// The losses and the f32 gradients of `micros` accumulated micro-batches, with or without
/// compute copies, and the launching ops the first forward recorded.
fn step(
    a: &Adapters,
    unet: &flame::models::sdxl::Unet,
    copies: bool,
    micros: u64,
) -> (Vec<f64>, Grads, u64) {
    let set = copies.then(|| a.compute_copies(DType::BF16).unwrap());
    let mut grads = Grads::new();
    let (mut losses, mut ops) = (vec![], 0);
    for m in 0..micros {
        let _in = set.as_ref().map(|c| c.enter());
        let before = recorded_ops().0;
        let l = loss(unet, m);
        if m == 0 {
            ops = recorded_ops().0 - before;
        }
        losses.push(l.to_scalar_f64().unwrap());
        l.backward_into(&mut grads).unwrap();
        if let Some(c) = &set {
            c.fold(&mut grads).unwrap();
        }
    }
    (losses, grads, ops)
}

#[test]
fn every_kind_trains_the_same_with_compute_copies_bit_for_bit() {
    for kind in ["lora", "lora_tucker", "dora", "lokr", "loha", "full"] {
        let (a, unet) = unet(kind);
        let casts = a.cast_params().unwrap();
        let scaled = casts.iter().filter(|(_, s)| *s != 1.0).count();
        for micros in [1, 2] {
            let (l0, g0, ops0) = step(&a, &unet, false, micros);
            let (l1, g1, ops1) = step(&a, &unet, true, micros);
            assert_eq!(l0, l1, "{kind}: losses of {micros} micro-batches");
            for (n, p) in a.params().unwrap() {
                let (x, y) = (g0.get(&p), g1.get(&p));
                assert_eq!(x.is_some(), y.is_some(), "{kind} {n}");
                if let (Some(x), Some(y)) = (x, y) {
                    assert_eq!(y.dtype(), DType::F32, "{kind} {n}");
                    assert_eq!(bits(x), bits(y), "{kind} {n}: {micros} micro-batches");
                }
            }
            // The grads hold the masters' only.
            assert_eq!(g0.len(), g1.len(), "{kind}");
            // One cast per weight the kind casts, and one scaling per factor, fewer: the
            // forward with copies records none of them (each adapted layer runs once).
            assert_eq!(
                ops0 - ops1,
                (casts.len() + scaled) as u64,
                "{kind}: launching ops recorded without ({ops0}) and with ({ops1}) copies"
            );
        }
        match kind {
            "lokr" | "loha" => assert!(casts.is_empty(), "{kind} casts only its change"),
            _ => assert!(!casts.is_empty(), "{kind}"),
        }
    }
}

#[test]
fn a_checkpointed_block_reuses_the_step_s_copies() {
    let a = Adapters::new(AdapterConfig {
        targets: vec!["lin".into()],
        ..config("lora", false)
    })
    .unwrap();
    let vb = VarBuilder::random(7, 0.3, DType::BF16, &CPU)
        .with_adapters(a.clone())
        .unwrap();
    let lin = Arc::new(Linear::new(&vb.pp("lin"), 9, 5, true).unwrap());
    for (i, (_, p)) in a.params().unwrap().iter().enumerate() {
        let r = Tensor::randn(p.dims().to_vec(), DType::F32, &CPU, 40 + i as u64).unwrap();
        p.assign(&r.affine(0.2, 0.0).unwrap()).unwrap();
    }
    let x = Tensor::randn((3, 9), DType::BF16, &CPU, 8).unwrap();
    let run = |copies: bool, ahead: bool| {
        let set = copies.then(|| a.compute_copies(DType::BF16).unwrap());
        let _in = set.as_ref().map(|c| c.enter());
        let l2 = lin.clone();
        let before = recorded_ops().0;
        let opts = CheckpointOptions {
            ahead,
            ..CheckpointOptions::default()
        };
        let f = move |xs: &[Tensor]| Ok(vec![l2.forward(&xs[0])?]);
        let out = checkpoint_opts(std::slice::from_ref(&x), Arc::new(f), opts)
            .unwrap()
            .remove(0);
        let forward_ops = recorded_ops().0 - before;
        let l = out
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let before = recorded_ops().0;
        let mut grads = l.backward().unwrap();
        // The re-run's recorded ops (the backward records nothing else).
        let rerun_ops = recorded_ops().0 - before;
        if let Some(c) = &set {
            assert_eq!(c.fold(&mut grads).unwrap(), 2, "both weights folded");
        }
        (l.to_scalar_f64().unwrap(), grads, forward_ops, rerun_ops)
    };
    let (l0, g0, _, rerun0) = run(false, false);
    let (l1, g1, fwd1, rerun1) = run(true, false);
    assert_eq!(l0, l1);
    // The checkpoint's forward records only its node; its re-run casts nothing with the
    // copies: down, up and the scaling of up fewer.
    assert!(fwd1 <= 1, "{fwd1}");
    assert_eq!(
        rerun0 - rerun1,
        3,
        "re-run ops: {rerun0} without, {rerun1} with copies"
    );
    for (n, p) in a.params().unwrap() {
        assert_eq!(bits(g0.get(&p).unwrap()), bits(g1.get(&p).unwrap()), "{n}");
    }
    // The re-run issued ahead on the helper thread (`autograd::ahead`) reads the same
    // copies: the same ops, loss and gradients.
    let taken = flame::autograd::ahead::taken();
    let (l2, g2, _, rerun2) = run(true, true);
    assert!(
        flame::autograd::ahead::taken() > taken,
        "the helper took it"
    );
    assert_eq!(l2, l1);
    assert_eq!(rerun2, rerun1, "re-run ops ahead");
    for (n, p) in a.params().unwrap() {
        assert_eq!(bits(g2.get(&p).unwrap()), bits(g1.get(&p).unwrap()), "{n}");
    }
}
