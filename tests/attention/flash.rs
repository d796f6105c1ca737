//! Flash attention on CUDA (bf16, f16; head dims 64 and 128) against the composite reference
//! (matmul, softmax, matmul) computed in f32 on the same rounded inputs: the output and the
//! gradients of q, k and v, at lengths 1, 77, 333, 1024 and 4608, with and without a key
//! padding mask and causality; strided and broadcast inputs, the Hopper kernels' layouts, the
//! memory they take, wide heads and the deterministic mode. The CPU has only the composite:
//! these need a GPU (ignored elsewhere). Part of the attention suite (tests/attention.rs).
//!
//! Tolerance: max |flash - reference| <= tol * max |reference|, per tensor, from the one
//! tolerance table (`tolerance::Against::Composite`: bf16 1e-2, f16 2e-3). Measured worst
//! cases are printed.

use super::CPU;
use crate::common::devices::serial;
use crate::common::tolerance::{tolerance, Against};
use flame::{DType, Device, Grads, Tensor};

fn tol(dt: DType) -> f64 {
    tolerance(Against::Composite, dt).1
}

fn gpu() -> Device {
    Device::cuda(0).expect("a CUDA GPU")
}

/// The values of `t` as f64 bit patterns, for comparisons bit for bit.
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn rel_err(a: &Tensor, r: &Tensor) -> f64 {
    let (a, r) = (a.to_vec_f64().unwrap(), r.to_vec_f64().unwrap());
    assert_eq!(a.len(), r.len());
    // A gradient that is 0 everywhere (dq and dk when Lk = 1: the softmax is constant) is
    // compared absolutely, against inputs of unit magnitude.
    let scale = r.iter().fold(0f64, |m, v| m.max(v.abs()));
    let scale = if scale > 0.0 { scale } else { 1.0 };
    a.iter()
        .zip(&r)
        .map(|(x, y)| {
            if x.is_nan() {
                f64::INFINITY
            } else {
                (x - y).abs()
            }
        })
        .fold(0.0, f64::max)
        / scale
}

fn sci(e: &[f64]) -> String {
    let v: Vec<String> = e.iter().map(|x| format!("{x:.2e}")).collect();
    format!("[{}]", v.join(", "))
}

fn randn(shape: &[usize], dt: DType, seed: u64, dev: &Device) -> Tensor {
    Tensor::randn(shape, DType::F64, &CPU, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// Output and (dq, dk, dv) of `f` on leaf copies of the inputs.
fn fwd_bwd(
    x: &[&Tensor; 3],
    dy: &Tensor,
    f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> flame::Result<Tensor>,
) -> Vec<Tensor> {
    let l: Vec<Tensor> = x
        .iter()
        .map(|t| t.detach().requires_grad_().unwrap())
        .collect();
    let y = f(&l[0], &l[1], &l[2]).unwrap();
    let mut g = Grads::new();
    y.backward_with_grad(dy, &mut g, false).unwrap();
    let mut out = vec![y];
    out.extend(l.iter().map(|t| g.get(t).unwrap().clone()));
    out
}

/// Worst relative errors [o, dq, dk, dv] of the flash kernels on one configuration.
#[allow(clippy::too_many_arguments)]
fn errors(
    dt: DType,
    (b, h, lq, lk, d): (usize, usize, usize, usize, usize),
    causal: bool,
    masked: bool,
    seed: u64,
) -> [f64; 4] {
    let dev = gpu();
    let q = randn(&[b, h, lq, d], dt, seed, &dev);
    let k = randn(&[b, h, lk, d], dt, seed + 1, &dev);
    let v = randn(&[b, h, lk, d], dt, seed + 2, &dev);
    let dy = randn(&[b, h, lq, d], dt, seed + 3, &dev);
    // About 70% of keys visible; batch 1, when there is one, sees none (its rows output 0).
    let mask = masked.then(|| {
        let u = Tensor::rand_uniform(0.0, 1.0, (b, lk), DType::F32, &CPU, seed + 4).unwrap();
        let mut keep: Vec<f32> = u.to_vec().unwrap();
        keep.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = f32::from(*x > 0.3 && i / lk != 1));
        keep[0] = 1.0;
        Tensor::from_slice(&keep, (b, lk), &dev).unwrap()
    });
    let scale = 1.0 / (d as f64).sqrt();
    errors_on(&[&q, &k, &v], &dy, mask.as_ref(), causal, scale)
}

/// Worst relative errors [o, dq, dk, dv] of the flash kernels on inputs x (q, k, v) and
/// output gradient dy, against the f32 composite on the same rounded values.
fn errors_on(
    x: &[&Tensor; 3],
    dy: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> [f64; 4] {
    let flash = fwd_bwd(x, dy, &|q, k, v| {
        q.attention_fused(k, v, mask, causal, scale)
    });
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let reference = fwd_bwd(
        &[&f32_(x[0]), &f32_(x[1]), &f32_(x[2])],
        &f32_(dy),
        &|q, k, v| q.attention_composite(k, v, mask, causal, scale),
    );
    let mut e = [0.0; 4];
    for (i, (a, r)) in flash.iter().zip(&reference).enumerate() {
        assert_eq!(a.dtype(), x[0].dtype());
        e[i] = rel_err(a, r);
    }
    e
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_matches_the_f32_composite() {
    let _one = serial();
    // (B, H, Lq, Lk): self-attention at every length, SDXL's cross-attention to 77 tokens,
    // and fewer queries than keys. Two take the Hopper forward's causal tile order in groups
    // of heads (their K and V in 32 MiB) with an uneven last group: 12 heads of 8192 keys in
    // groups of 8 at D = 128; 160 heads of 1024 in groups of 128 at D = 64 and 64 at D = 128,
    // 1280 tiles claimed by a block per SM. The last, past 8192 keys, a causal block per tile.
    let shapes = [
        (2, 3, 1, 1),
        (2, 2, 77, 77),
        (2, 2, 333, 77),
        (1, 3, 77, 333),
        (2, 2, 333, 333),
        (1, 2, 1024, 1024),
        (1, 2, 4608, 4608),
        (1, 12, 300, 8192),
        (4, 40, 1024, 1024),
        (1, 2, 200, 9000),
    ];
    let mut worst = vec![];
    let mut failures = vec![];
    for dt in [DType::BF16, DType::F16] {
        let mut dt_worst = [0f64; 4];
        for d in [64, 128] {
            for (i, &(b, h, lq, lk)) in shapes.iter().enumerate() {
                for (causal, masked) in [(false, false), (false, true), (true, false), (true, true)]
                {
                    let e = errors(dt, (b, h, lq, lk, d), causal, masked, 100 * i as u64);
                    for (w, x) in dt_worst.iter_mut().zip(e) {
                        *w = w.max(x);
                    }
                    if e.iter().any(|&x| x.is_nan() || x > tol(dt)) {
                        failures.push(format!(
                            "{dt} D={d} B={b} H={h} Lq={lq} Lk={lk} causal={causal} mask={masked}: \
                             [o, dq, dk, dv] errors {}",
                            sci(&e)
                        ));
                    }
                }
            }
        }
        worst.push(format!(
            "{dt}: worst [o, dq, dk, dv] {} (bound {:.0e})",
            sci(&dt_worst),
            tol(dt)
        ));
    }
    println!("{}", worst.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_reads_strided_views_and_matches_dense_inputs() {
    let _one = serial();
    let dev = gpu();
    // One projection (B, L, 3, H, D) split into q, k, v views (B, H, L, D), as Flux does.
    let (b, l, h, d) = (2, 301, 3, 128);
    let qkv = randn(&[b, l, 3, h, d], DType::BF16, 7, &dev);
    let dy = randn(&[b, h, l, d], DType::BF16, 8, &dev);
    let p = qkv.permute(&[2, 0, 3, 1, 4]).unwrap();
    let part = |i| p.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| q.attention_fused(k, v, None, true, 0.1);
    let views = fwd_bwd(&[&part(0), &part(1), &part(2)], &dy, &f);
    let dense: Vec<Tensor> = (0..3).map(|i| part(i).contiguous().unwrap()).collect();
    let copies = fwd_bwd(&[&dense[0], &dense[1], &dense[2]], &dy, &f);
    for (a, c) in views.iter().zip(&copies) {
        assert_eq!(a.to_vec_f64().unwrap(), c.to_vec_f64().unwrap());
    }
    // A view whose rows are not 16-byte aligned is copied first, with the same result.
    let odd = randn(&[1, 2, 65, 64], DType::BF16, 9, &dev);
    let q = odd.narrow(2, 1, 64).unwrap();
    let qd = q.contiguous().unwrap();
    let o1 = q.attention_fused(&q, &q, None, false, 0.125).unwrap();
    let o2 = qd.attention_fused(&qd, &qd, None, false, 0.125).unwrap();
    assert_eq!(o1.to_vec_f64().unwrap(), o2.to_vec_f64().unwrap());
}

/// On Hopper the wgmma kernels read q, k, v and do through TMA descriptors; views the
/// descriptors cannot express (a head stride of 0 from broadcasting one head) and a negative
/// scale (the wgmma forward folds the scale in after the row max) take the mma.sync kernels.
/// Every GPU runs this: against the f32 composite, as the main test.
#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_takes_broadcast_heads_and_negative_scales() {
    let _one = serial();
    let dev = gpu();
    let (b, h, l, d) = (2, 3, 200, 128);
    let one = randn(&[b, 1, l, d], DType::BF16, 40, &dev);
    let q = one.broadcast_as((b, h, l, d)).unwrap();
    let k = randn(&[b, h, l, d], DType::BF16, 41, &dev);
    let v = randn(&[b, h, l, d], DType::BF16, 42, &dev);
    let dy = randn(&[b, h, l, d], DType::BF16, 43, &dev);
    for scale in [0.1, -0.1] {
        let e = errors_on(&[&q, &k, &v], &dy, None, false, scale);
        for (i, e) in e.into_iter().enumerate() {
            assert!(
                e <= tol(DType::BF16),
                "scale {scale}, output {i}: error {e:.2e}"
            );
        }
    }
}

/// On compute capability 9.0 the layouts the models pass take the wgmma kernels, not the
/// mma.sync fallback: Flux's single block (q and k normed, v a view into a wider projection,
/// batch 1), its double block (concatenated, dense), and q, k, v all views of one
/// projection, batch 2. Checked by the kernel names the profiler records.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_takes_the_wgmma_kernels_for_the_models_layouts() {
    let _one = serial();
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        panic!("a CUDA device")
    };
    let cc = (
        cuda.compute_capability_major(),
        cuda.compute_capability_minor(),
    );
    if cc != (9, 0) || std::env::var("FLAME_ATTENTION").is_ok_and(|v| v == "mma") {
        println!("compute capability {cc:?} (or FLAME_ATTENTION=mma): the mma.sync kernels serve");
        return;
    }
    let (l, h, d) = (300, 4, 128);
    let views = |b: usize, seed: u64| {
        let x = randn(&[b, l, 3 * h * d + 256], DType::BF16, seed, &dev);
        let qkv = x
            .narrow(2, 0, 3 * h * d)
            .unwrap()
            .reshape(vec![b, l, 3, h, d])
            .unwrap();
        let pick = |i| {
            qkv.narrow(2, i, 1)
                .unwrap()
                .squeeze(2)
                .unwrap()
                .permute(&[0, 2, 1, 3])
                .unwrap()
        };
        (pick(0), pick(1), pick(2))
    };
    let (q1, k1, v1) = views(1, 60);
    let single = [
        q1.contiguous().unwrap(),
        k1.contiguous().unwrap(),
        v1.clone(),
    ];
    let double = [
        q1.contiguous().unwrap(),
        k1.contiguous().unwrap(),
        v1.contiguous().unwrap(),
    ];
    let (q2, k2, v2) = views(2, 61);
    let strided = [q2, k2, v2];
    flame::profile::enable(true);
    for x in [&single, &double, &strided] {
        let dy = randn(x[0].dims(), DType::BF16, 62, &dev);
        fwd_bwd(&[&x[0], &x[1], &x[2]], &dy, &|q, k, v| {
            q.attention_fused(k, v, None, false, 0.088)
        });
    }
    let p = flame::profile::report().unwrap();
    flame::profile::enable(false);
    let count = |prefix: &str| -> usize {
        p.kernels
            .iter()
            .filter(|r| r.category.starts_with(prefix))
            .map(|r| r.kernels)
            .sum()
    };
    let names: Vec<&str> = p.kernels.iter().map(|r| r.category.as_str()).collect();
    assert_eq!(count("attnw_fwd_"), 3, "{names:?}");
    assert_eq!(count("attnw_bwd_"), 3, "{names:?}");
    assert_eq!(count("attn_fwd_") + count("attn_bwd_bf16"), 0, "{names:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_allocates_nothing_of_size_l_squared() {
    let _one = serial();
    // The default mode's memory: the deterministic mode adds its dQ slabs by design (see
    // deterministic_mode_repeats_the_same_bits).
    let _default = Deterministic::set(false);
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        panic!("a CUDA device")
    };
    let (b, h, l, d) = (1, 4, 16384, 128);
    let x: Vec<Tensor> = (0..4)
        .map(|i| randn(&[b, h, l, d], DType::BF16, 20 + i, &dev))
        .collect();
    let leaves: Vec<Tensor> = x[..3]
        .iter()
        .map(|t| t.detach().requires_grad_().unwrap())
        .collect();
    cuda.synchronize().unwrap();
    let base = cuda.memory().in_use;
    cuda.reset_peak_memory();
    let y = flame::nn::scaled_dot_product_attention(
        &leaves[0], &leaves[1], &leaves[2], None, false, None,
    )
    .unwrap();
    let mut g = Grads::new();
    y.backward_with_grad(&x[3], &mut g, false).unwrap();
    cuda.synchronize().unwrap();
    let extra = cuda.memory().peak - base;
    // o, dq, dk, dv, lse, dvec and the f32 dq accumulator: about 10 x (B, H, L, D) bf16. One
    // (B, H, L, L) f32 score matrix would be 4 GiB.
    let tensor = (b * h * l * d * 2) as u64;
    println!(
        "extra peak memory {:.1} MiB = {:.2} x one (B, H, L, D) tensor",
        extra as f64 / 1048576.0,
        extra as f64 / tensor as f64
    );
    assert!(extra <= 12 * tensor, "{extra} bytes beyond the inputs");
    // The kernels refuse what they do not support, by name.
    let f = leaves[0].to_dtype(DType::F32).unwrap();
    let e = f.attention_fused(&f, &f, None, false, 1.0).unwrap_err();
    assert!(e.to_string().contains("attention"), "{e}");
    let q48 = randn(&[1, 1, 8, 48], DType::BF16, 30, &dev);
    let e = q48
        .attention_fused(&q48, &q48, None, false, 1.0)
        .unwrap_err();
    assert!(e.to_string().contains("head dims"), "{e}");
}

/// The forward-only kernel for head width 512 (the autoencoders' single-head mid-block
/// attention), taken by calls that record no gradient: against the f32 composite on the same
/// rounded inputs, at odd lengths (1 key, lengths past a 64-row or 32-key tile), batches and
/// heads above 1, with a key padding mask and causality; and `scaled_dot_product_attention`
/// routes there under `no_grad` but to the composite when a gradient is asked for.
#[test]
#[ignore = "needs a CUDA GPU"]
fn wide_head_forward_matches_the_f32_composite() {
    let _one = serial();
    let dev = gpu();
    let d = 512;
    let mut worst = vec![];
    for dt in [DType::BF16, DType::F16] {
        for (i, &(b, h, lq, lk)) in [
            (1, 1, 1, 1),
            (1, 1, 77, 130),
            (2, 3, 65, 33),
            (1, 1, 333, 1),
            (1, 1, 1024, 1024),
        ]
        .iter()
        .enumerate()
        {
            for (causal, masked) in [(false, false), (true, false), (false, true)] {
                let seed = 700 + 10 * i as u64;
                let q = randn(&[b, h, lq, d], dt, seed, &dev);
                let k = randn(&[b, h, lk, d], dt, seed + 1, &dev);
                let v = randn(&[b, h, lk, d], dt, seed + 2, &dev);
                let mask = masked.then(|| {
                    let u = Tensor::rand_uniform(0.0, 1.0, (b, lk), DType::F32, &CPU, seed + 4)
                        .unwrap();
                    let mut keep: Vec<f32> = u.to_vec().unwrap();
                    keep.iter_mut().for_each(|x| *x = f32::from(*x > 0.3));
                    keep[0] = 1.0;
                    Tensor::from_slice(&keep, (b, lk), &dev).unwrap()
                });
                let m = mask.as_ref();
                let scale = 1.0 / (d as f64).sqrt();
                let _g = flame::no_grad();
                let o = q.attention_fused(&k, &v, m, causal, scale).unwrap();
                let f32_ = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let r = f32_(&q)
                    .attention_composite(&f32_(&k), &f32_(&v), m, causal, scale)
                    .unwrap();
                let e = rel_err(&o, &r);
                assert!(
                    e <= tol(dt),
                    "{dt} (B, H, Lq, Lk) = ({b}, {h}, {lq}, {lk}) causal {causal} mask {masked}: {e:.2e}"
                );
                worst.push(e);
                let via =
                    flame::nn::scaled_dot_product_attention(&q, &k, &v, m, causal, None).unwrap();
                assert_eq!(
                    via.to_vec_f64().unwrap(),
                    o.to_vec_f64().unwrap(),
                    "no_grad sdpa takes the wide kernel"
                );
            }
        }
    }
    println!(
        "wide-head forward worst errors: {}",
        sci(&[worst.iter().cloned().fold(0.0, f64::max)])
    );
    // A call that records takes the composite (the wide kernel has no backward).
    let q = randn(&[1, 1, 40, d], DType::BF16, 1, &dev)
        .requires_grad_()
        .unwrap();
    let k = randn(&[1, 1, 40, d], DType::BF16, 2, &dev);
    let y = flame::nn::scaled_dot_product_attention(&q, &k, &k, None, false, None).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(&q).is_some());
    // The backward at 512 is refused by the kernels, not run wrong.
    let e = q.attention_fused(&k, &k, None, false, 0.1);
    let e = e
        .and_then(|y| y.sum_all()?.backward().map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("512 forward only"), "{e}");
}

/// Sets deterministic kernels on or off for a test and back as they were, also when it
/// fails (FLAME_DETERMINISTIC=1 runs the suite with them on).
struct Deterministic(bool);

impl Deterministic {
    fn set(on: bool) -> Self {
        let was = flame::cuda::deterministic();
        flame::cuda::set_deterministic(on);
        Deterministic(was)
    }

    fn on() -> Self {
        Self::set(true)
    }
}

impl Drop for Deterministic {
    fn drop(&mut self) {
        flame::cuda::set_deterministic(self.0);
    }
}

/// The deterministic mode (`flame::cuda::set_deterministic`): dQ summed over key blocks in
/// slab order gives the same bits on every run, and stays within the flash tolerance of the
/// f32 composite, for head dims 128 and 64 (two slabs per key block in the wgmma kernels),
/// causal with Lq != Lk, a key mask, a negative scale (the mma.sync kernels), and a backward
/// run in several launches.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deterministic_mode_repeats_the_same_bits() {
    let _one = serial();
    let dev = gpu();
    let _det = Deterministic::on();
    let cases = [
        // (B, H, Lq, Lk, D), causal, masked, scale sign
        ((1, 3, 1000, 1000, 128), false, false, 1.0),
        ((2, 2, 333, 700, 64), true, false, 1.0),
        ((2, 2, 500, 300, 128), false, true, 1.0),
        ((1, 2, 257, 257, 64), false, false, -1.0),
        // 64 heads of 4096: slabs of 128 MiB, so the backward runs in launches of 5 of the 32
        // key blocks (`deterministic_chunk` on an H100), causal: the folds zero the slabs
        // the next launch skips.
        ((8, 8, 4096, 4096, 128), true, false, 1.0),
    ];
    for (i, ((b, h, lq, lk, d), causal, masked, sign)) in cases.into_iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            let seed = 900 + 10 * i as u64;
            let q = randn(&[b, h, lq, d], dt, seed, &dev);
            let k = randn(&[b, h, lk, d], dt, seed + 1, &dev);
            let v = randn(&[b, h, lk, d], dt, seed + 2, &dev);
            let dy = randn(&[b, h, lq, d], dt, seed + 3, &dev);
            let mask = masked.then(|| {
                let u = Tensor::rand_uniform(0.0, 1.0, (b, lk), DType::F32, &CPU, seed + 4);
                let keep: Vec<f32> = u.unwrap().to_vec().unwrap();
                let keep: Vec<f32> = keep.iter().map(|&x| f32::from(x > 0.3)).collect();
                Tensor::from_slice(&keep, (b, lk), &dev).unwrap()
            });
            let scale = sign / (d as f64).sqrt();
            let what = format!("case {i} [{dt}]");
            let run = || {
                fwd_bwd(&[&q, &k, &v], &dy, &|q, k, v| {
                    q.attention_fused(k, v, mask.as_ref(), causal, scale)
                })
            };
            let (first, second) = (run(), run());
            for (n, (a, r)) in first.iter().zip(&second).enumerate() {
                assert_eq!(bits(a), bits(r), "{what}: output {n} differs between runs");
            }
            let e = errors_on(&[&q, &k, &v], &dy, mask.as_ref(), causal, scale);
            for (n, e) in e.into_iter().enumerate() {
                assert!(e <= tol(dt), "{what}, output {n}: error {e:.2e}");
            }
        }
    }
}

/// What the deterministic mode is for: a bf16 LoRA run on CUDA through the flash kernels
/// (head dim 64) gives the same adapter bits when run again, so a resumed run repeats the
/// uninterrupted one exactly. Three AdamW steps of a small Flux (256 image + 16 text tokens),
/// twice.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bf16_lora_run_repeats_its_bits_in_deterministic_mode() {
    use flame::models::flux::{self, Flux, FluxConfig};
    use flame::nn::{Adapters, LoraConfig, VarBuilder};
    use flame::optim::{AdamConfig, AdamW, Optimizer};
    let _one = serial();
    let dev = gpu();
    let _det = Deterministic::on();
    let cfg = FluxConfig {
        in_channels: 16,
        out_channels: 16,
        vec_in_dim: 8,
        context_in_dim: 24,
        hidden_size: 128,
        mlp_ratio: 2.0,
        num_heads: 2,
        depth: 1,
        depth_single_blocks: 1,
        axes_dim: vec![16, 24, 24],
        theta: 10_000.0,
        qkv_bias: true,
        guidance_embed: true,
    };
    let bf = DType::BF16;
    let (img, txt, y) = (
        randn(&[1, 256, 16], bf, 60, &dev),
        randn(&[1, 16, 24], bf, 61, &dev),
        randn(&[1, 8], bf, 62, &dev),
    );
    let (ii, ti) = (
        flux::image_ids(16, 16, &dev).unwrap(),
        flux::text_ids(16, &dev).unwrap(),
    );
    let t = Tensor::full(0.6, 1, DType::F32, &dev).unwrap();
    let g = Tensor::full(3.5, 1, DType::F32, &dev).unwrap();
    let train = || -> Vec<Vec<u64>> {
        let adapters = Adapters::new(LoraConfig {
            rank: 4,
            alpha: 4.0,
            dropout: 0.0,
            targets: vec!["double_blocks.*".into(), "single_blocks.*".into()],
            seed: 1,
        })
        .unwrap();
        let vb = VarBuilder::random(3, 0.05, bf, &dev)
            .with_adapters(adapters.clone())
            .unwrap();
        let model = Flux::new(&vb, &cfg).unwrap();
        let params = adapters.params().unwrap();
        let adam = AdamConfig {
            lr: 1e-2,
            ..AdamConfig::default()
        };
        let mut opt = AdamW::new(params.clone(), adam).unwrap();
        for _ in 0..3 {
            let out = model
                .forward(&img, &ii, &txt, &ti, &t, &y, Some(&g))
                .unwrap();
            let loss = out
                .to_dtype(DType::F32)
                .unwrap()
                .sqr()
                .unwrap()
                .mean_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            opt.step(&grads).unwrap();
        }
        params.iter().map(|(_, p)| bits(p)).collect()
    };
    let first = train();
    assert!(first.iter().flatten().any(|&b| b != 0));
    assert!(first == train(), "the second run's adapter differs");
}
