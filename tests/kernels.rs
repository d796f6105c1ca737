//! The layer kernels (adaLN modulation, RoPE, GroupNorm, LayerNorm / RMSNorm and their
//! backwards, softmax's backward), column reductions and a Linear's GEMM epilogues, on every
//! device (`common::devices`): against the CPU reference for every float dtype (the CPU
//! against itself in f64, a GPU against the CPU at the same dtype), against their composite
//! twins on the same device, and bit for bit from run to run. Odd sizes, views and the shapes
//! that pick each of the CUDA kernels' paths.
#![cfg(feature = "cpu-ref")]

mod common;

use common::devices::{close_mag, normal_pair, on_every_device};
use flame::{DType, Device, Grads, Result, Tensor};

const FLOATS: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

on_every_device!(
    modulate_matches_the_reference,
    swiglu_matches_the_reference,
    rope_matches_the_reference,
    group_norm_matches_the_reference,
    group_norm_repeats_bit_for_bit,
    norm_backward_with_params_repeats_bit_for_bit,
    softmax_backward_matches_the_reference,
    fused_layers_match_their_composites,
    column_reductions_match_the_reference,
    norms_read_strided_rows_where_they_lie,
    linear_epilogues_match_the_reference,
);

/// Runs `f` on leaf copies of `inputs`, backpropagates `dy`, and returns the output followed by
/// the gradient of every input.
fn fwd_bwd(
    inputs: &[&Tensor],
    dy: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Vec<Tensor> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().requires_grad_().unwrap())
        .collect();
    let y = f(&leaves).unwrap();
    let mut grads = Grads::new();
    y.backward_with_grad(dy, &mut grads, false).unwrap();
    let mut out = vec![y];
    out.extend(
        leaves
            .iter()
            .map(|l| grads.get(l).expect("a gradient for every input").clone()),
    );
    out
}

/// Output and gradients of `f` on `dev` in `dt` and on the CPU reference (`oracle`), from the
/// same random inputs.
fn both(
    dev: &Device,
    shapes: &[Vec<usize>],
    out_shape: &[usize],
    dt: DType,
    seed: u64,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> (Vec<Tensor>, Vec<Tensor>) {
    let (mut r, mut d) = (vec![], vec![]);
    for (i, s) in shapes.iter().enumerate() {
        let (ri, di) = normal_pair(dev, s, dt, seed + i as u64);
        r.push(ri);
        d.push(di);
    }
    let (rdy, ddy) = normal_pair(dev, out_shape, dt, seed + 100);
    let rr: Vec<&Tensor> = r.iter().collect();
    let dr: Vec<&Tensor> = d.iter().collect();
    (fwd_bwd(&dr, &ddy, f), fwd_bwd(&rr, &rdy, f))
}

const NAMES: [&str; 6] = ["y", "d0", "d1", "d2", "d3", "d4"];

/// Compares output and gradients; `mags[k]` is the magnitude scale of result k (sums of many
/// terms carry an error proportional to the terms, not to the result).
fn check(what: &str, dev: &Device, got: &[Tensor], want: &[Tensor], dt: DType, mags: &[f64]) {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        close_mag(
            &format!("{what} {}", NAMES[k]),
            dev,
            g,
            w,
            dt,
            mags.get(k).copied().unwrap_or(0.0),
        );
    }
}

/// `t` in the dtype of x, on x's device (a constant both paths take).
fn like(t: &Tensor, x: &Tensor) -> Tensor {
    t.to_dtype(x.dtype())
        .unwrap()
        .to_device(x.device())
        .unwrap()
}

/// SwiGLU on dense rows (M % 8 == 0 takes the packed path, odd M the scalar one) and on the
/// MLP half of a wider projection read in place (rows of pitch 3 D + 2 M, as FLUX.2's single
/// blocks give it), its output joined to another (as `linear2`'s input is) so that the
/// backward reads its gradient as rows of a wider pitch too, against the CPU reference,
/// output and gradient.
fn swiglu_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        for (rows, m, pad, joined) in [
            (37, 24, 0, 0),
            (5, 13, 0, 0),
            (300, 3072, 0, 0),
            (7, 40, 24, 0),
            (9, 21, 5, 0),
            (11, 40, 24, 16),
            (6, 21, 5, 3),
        ] {
            let w = 2 * m + pad;
            let (go, co) = both(dev, &[vec![rows, w]], &[rows, m + joined], dt, 2100, &|x| {
                let y = x[0].narrow(1, pad, 2 * m)?.swiglu()?;
                match joined {
                    0 => Ok(y),
                    j => Tensor::cat(&[&x[0].narrow(1, 0, j)?, &y], 1),
                }
            });
            check(
                &format!("swiglu {rows}x{m} of {w}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 3.0],
            );
        }
    }
}

fn modulate_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        // D % 8 == 0 up to 8192 takes the row blocks (4 and 8 lanes a row with several
        // row groups a block, a warp, 12 warps, two packs a lane); D = 13 and 8200 the sweep.
        for (b, l, d) in [
            (2, 37, 24),
            (3, 5, 13),
            (1, 4608, 64),
            (2, 50, 256),
            (2, 300, 3072),
            (1, 33, 5000),
            (2, 9, 8200),
        ] {
            let (go, co) = both(
                dev,
                &[vec![b, l, d], vec![b, 1, d], vec![b, 1, d]],
                &[b, l, d],
                dt,
                2000,
                &|x| x[0].modulate(&x[1], &x[2]),
            );
            let sum = (l as f64).sqrt() * 3.0;
            check(
                &format!("modulate {b}x{l}x{d}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 3.0, sum, sum],
            );
            // Frozen shift and scale: dx through the forward kernel.
            let (cs, _) = normal_pair(dev, &[b, 1, d], dt, 2010);
            let (go, co) = both(dev, &[vec![b, l, d]], &[b, l, d], dt, 2020, &|x| {
                x[0].modulate(&x[0].narrow(1, 0, 1)?.detach(), &like(&cs, &x[0]))
            });
            check(
                &format!("modulate frozen {b}x{l}x{d}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 3.0],
            );
        }
    }
}

fn rope_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        // Head dims 64, 128 and 8: four pairs of up to four heads per thread (3 and 5 heads
        // leave a partial group); 6: the scalar kernel; per-batch and shared rotations.
        for (b, h, l, d, rb) in [
            (2, 3, 17, 64, 2),
            (1, 2, 5, 6, 1),
            (2, 24, 33, 128, 1),
            (3, 5, 9, 8, 3),
        ] {
            let pos =
                Tensor::rand_uniform(0.0, 64.0, (rb, l), DType::F32, &Device::Cpu, 2100).unwrap();
            let cf = flame::nn::rope(&pos, d, 10_000.0)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            let (go, co) = both(dev, &[vec![b, h, l, d]], &[b, h, l, d], dt, 2110, &|x| {
                x[0].apply_rope(&cf.to_device(x[0].device())?)
            });
            check(
                &format!("rope {b}x{h}x{l}x{d}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 3.0],
            );
        }
    }
}

fn group_norm_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        for (shape, groups) in [
            (vec![2, 12, 7, 5], 4),
            (vec![3, 8, 1001], 2),
            (vec![2, 320, 32, 32], 32),
            (vec![1, 6], 3),
            // Planes of whole packs, small to SDXL-sized groups (10 planes of 128x128): on
            // Hopper the one-pass cluster kernels (eighths of 48 to 20480 elements touching 1
            // to 3 channels), elsewhere the two kernels. Falling back: f32 at the SDXL shape
            // (an eighth over 48 KiB), and the backward of 128 channels of 8x8 (its eighths
            // touch 16 channels). Many small groups: (2, 96, 8, 8) and (3, 132, 16, 16).
            (vec![2, 96, 8, 8], 48),
            (vec![3, 132, 16, 16], 22),
            (vec![1, 64, 40, 40], 32),
            (vec![2, 96, 4, 4], 4),
            (vec![1, 128, 8, 8], 1),
            (vec![1, 320, 64, 128], 32),
            (vec![1, 160, 128, 128], 16),
        ] {
            let c = shape[1];
            let n = shape[0] as f64 * (shape.iter().skip(2).product::<usize>() as f64);
            let (go, co) = both(
                dev,
                &[shape.clone(), vec![c], vec![c]],
                &shape,
                dt,
                2200,
                &|x| x[0].group_norm(groups, Some(&x[1]), Some(&x[2]), 1e-5),
            );
            let sum = 3.0 * n.sqrt();
            check(
                &format!("group_norm {shape:?}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 9.0, sum, sum],
            );
            let (go, co) = both(dev, std::slice::from_ref(&shape), &shape, dt, 2300, &|x| {
                x[0].group_norm(groups, None, None, 1e-5)
            });
            check(
                &format!("group_norm plain {shape:?}"),
                dev,
                &go,
                &co,
                dt,
                &[3.0, 9.0],
            );
        }
    }
}

/// GroupNorm's one-pass kernels count completions in device counters they must leave at zero
/// (the staggered start's gate, the per-group counts that elect who writes dw and db) and add
/// partial sums in a fixed order: the same inputs give the same bits, run after run, with a
/// launch of another shape (other counters, another stagger) in between.
fn group_norm_repeats_bit_for_bit(dev: &Device) {
    for dt in [DType::BF16, DType::F32] {
        // Staggered (64 clusters, all resident) and not (96 clusters, more than an H100 holds).
        for (shape, groups) in [(vec![2, 320, 32, 32], 32), (vec![2, 96, 8, 8], 48)] {
            let c = shape[1];
            let ins: Vec<Tensor> = [shape.clone(), vec![c], vec![c]]
                .iter()
                .enumerate()
                .map(|(i, s)| normal_pair(dev, s, dt, 2500 + i as u64).1)
                .collect();
            let dy = normal_pair(dev, &shape, dt, 2600).1;
            let run = || -> Vec<Vec<f64>> {
                let refs: Vec<&Tensor> = ins.iter().collect();
                fwd_bwd(&refs, &dy, &|x| {
                    x[0].group_norm(groups, Some(&x[1]), Some(&x[2]), 1e-5)
                })
                .iter()
                .map(|t| t.to_vec_f64().unwrap())
                .collect()
            };
            let first = run();
            let (o, od) = (
                normal_pair(dev, &[3, 132, 16, 16], dt, 2700).1,
                normal_pair(dev, &[3, 132, 16, 16], dt, 2701).1,
            );
            fwd_bwd(&[&o], &od, &|x| x[0].group_norm(22, None, None, 1e-5));
            let again = run();
            for (k, (a, b)) in first.iter().zip(&again).enumerate() {
                let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    same,
                    "group_norm {shape:?} {dt:?}: {} differs between runs",
                    NAMES[k]
                );
            }
        }
    }
}

/// LayerNorm / RMSNorm backward with dw and db: on Hopper one cooperative kernel whose blocks
/// meet at a grid-wide barrier on two device counters (which it must leave at zero) and add
/// their partial sums in a fixed order; elsewhere the row blocks and a sum kernel. The same
/// inputs give the same bits, run after run, with a launch of another shape in between
/// (other block and stage counts).
fn norm_backward_with_params_repeats_bit_for_bit(dev: &Device) {
    for dt in [DType::BF16, DType::F32] {
        for (shape, rms) in [
            (vec![1200, 3072], false),
            (vec![4000, 128], true),
            (vec![9, 5000], false),
        ] {
            let cols = shape[1];
            let params = if rms { 1 } else { 2 };
            let ins: Vec<Tensor> = std::iter::once(shape.clone())
                .chain(std::iter::repeat_n(vec![cols], params))
                .enumerate()
                .map(|(i, s)| normal_pair(dev, &s, dt, 2800 + i as u64).1)
                .collect();
            let dy = normal_pair(dev, &shape, dt, 2900).1;
            let run = || -> Vec<Vec<f64>> {
                let refs: Vec<&Tensor> = ins.iter().collect();
                fwd_bwd(&refs, &dy, &|x| {
                    if rms {
                        x[0].rms_norm(Some(&x[1]), 1e-6)
                    } else {
                        x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)
                    }
                })
                .iter()
                .map(|t| t.to_vec_f64().unwrap())
                .collect()
            };
            let first = run();
            let (o, od) = (
                normal_pair(dev, &[77, 256], dt, 3000).1,
                normal_pair(dev, &[77, 256], dt, 3001).1,
            );
            let ow = normal_pair(dev, &[256], dt, 3002).1;
            fwd_bwd(&[&o, &ow], &od, &|x| {
                x[0].layer_norm(Some(&x[1]), None, 1e-5)
            });
            let again = run();
            for (k, (a, b)) in first.iter().zip(&again).enumerate() {
                let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    same,
                    "norm rms={rms} {shape:?} {dt:?}: {} differs between runs",
                    ["y", "dx", "dw", "db"][k]
                );
            }
        }
    }
}

fn softmax_backward_matches_the_reference(dev: &Device) {
    for dt in FLOATS {
        // Streaming rows (7, 1000, 4608, 77 columns) and the register-resident ones: 4, 12
        // and 16 packs a lane, whole (1024, 3072, 4096) and partly filled (2056).
        for shape in [
            vec![7],
            vec![33, 1000],
            vec![4, 4608],
            vec![3, 5, 77],
            vec![29, 1024],
            vec![37, 3072],
            vec![13, 2056],
            vec![5, 4096],
        ] {
            let (go, co) = both(dev, std::slice::from_ref(&shape), &shape, dt, 2400, &|x| {
                x[0].softmax(-1)
            });
            check(
                &format!("softmax {shape:?}"),
                dev,
                &go,
                &co,
                dt,
                &[0.0, 1.0],
            );
        }
    }
}

/// On the GPU, each fused layer against its composite twin, output and every gradient. The
/// composite rounds after each primitive in half types, so the bound is a few ulps of the
/// operands' scale rather than the CPU-agreement table.
fn fused_layers_match_their_composites(dev: &Device) {
    type F = fn(&[Tensor]) -> Result<Tensor>;
    /// (name, input shapes, output shape, fused, composite)
    type Pair = (&'static str, Vec<Vec<usize>>, Vec<usize>, F, F);
    let cases: [Pair; 5] = [
        (
            "swiglu",
            vec![vec![3, 37, 48]],
            vec![3, 37, 24],
            |x| x[0].swiglu(),
            |x| x[0].swiglu_composite(),
        ),
        (
            "modulate",
            vec![vec![2, 37, 24], vec![2, 1, 24], vec![2, 1, 24]],
            vec![2, 37, 24],
            |x| x[0].modulate(&x[1], &x[2]),
            |x| x[0].modulate_composite(&x[1], &x[2]),
        ),
        (
            "group_norm",
            vec![vec![2, 12, 7, 5], vec![12], vec![12]],
            vec![2, 12, 7, 5],
            |x| x[0].group_norm(4, Some(&x[1]), Some(&x[2]), 1e-5),
            |x| x[0].group_norm_composite(4, Some(&x[1]), Some(&x[2]), 1e-5),
        ),
        (
            "softmax",
            vec![vec![33, 1000]],
            vec![33, 1000],
            |x| x[0].softmax(-1),
            |x| x[0].softmax_composite(-1),
        ),
        (
            "layer_norm",
            vec![vec![9, 3072], vec![3072], vec![3072]],
            vec![9, 3072],
            |x| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-6),
            |x| x[0].layer_norm_composite(Some(&x[1]), Some(&x[2]), 1e-6),
        ),
    ];
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // A few ulps of the operands' scale: 2^-6 for bf16, 2^-9 for f16, 1e-4 for f32.
        let eps = match dt {
            DType::BF16 => 1.6e-2,
            DType::F16 => 2e-3,
            _ => 1e-4,
        };
        for (name, shapes, out, fused, composite) in &cases {
            let mut g = vec![];
            for (i, s) in shapes.iter().enumerate() {
                g.push(normal_pair(dev, s, dt, 2500 + i as u64).1);
            }
            let dy = normal_pair(dev, out, dt, 2600).1;
            let gr: Vec<&Tensor> = g.iter().collect();
            let (a, b) = (fwd_bwd(&gr, &dy, fused), fwd_bwd(&gr, &dy, composite));
            for (k, (x, y)) in a.iter().zip(&b).enumerate() {
                let (xv, yv) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
                let scale = yv.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                let worst = xv
                    .iter()
                    .zip(&yv)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0, f64::max);
                assert!(
                    worst <= eps * scale,
                    "{name} [{dt}] {}: fused vs composite differ by {worst} (scale {scale})",
                    NAMES[k]
                );
            }
        }
    }
    // RoPE: rotations as constants on both paths.
    let pos = Tensor::arange(0.0, 17.0, DType::F32, dev)
        .unwrap()
        .reshape((1, 17))
        .unwrap();
    let f = flame::nn::rope(&pos, 64, 10_000.0)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let x = normal_pair(dev, &[2, 3, 17, 64], dt, 2700).1;
        let dy = normal_pair(dev, &[2, 3, 17, 64], dt, 2701).1;
        let a = fwd_bwd(&[&x], &dy, &|v| v[0].apply_rope(&f));
        let b = fwd_bwd(&[&x], &dy, &|v| v[0].apply_rope_composite(&f));
        // Both compute in f32 and round once: identical up to FMA contraction.
        let (atol, rtol) = common::tolerance::tolerance(common::tolerance::Against::Cpu, dt);
        for (p, q) in a.iter().zip(&b) {
            let (pv, qv) = (p.to_vec_f64().unwrap(), q.to_vec_f64().unwrap());
            for (i, (x, y)) in pv.iter().zip(&qv).enumerate() {
                assert!(
                    (x - y).abs() <= atol + rtol * y.abs().max(3.0),
                    "rope vs composite [{dt} on {dev}] element {i}: {x} against {y}"
                );
            }
        }
    }
}

/// Sums, maxima and arg-maxima over leading dims take the thread-per-column path.
fn column_reductions_match_the_reference(dev: &Device) {
    for dt in FLOATS {
        for (shape, dims) in [
            (vec![5000, 37], vec![0]),
            (vec![2, 300, 65], vec![0, 1]),
            (vec![129, 3, 1000], vec![0]),
            (vec![4608, 3072], vec![0]),
        ] {
            let (c, g) = normal_pair(dev, &shape, dt, 2800);
            let what = format!("over {dims:?} of {shape:?}");
            // Both sum in f64 and round once; only the order of the f64 additions differs.
            close_mag(
                &format!("sum {what}"),
                dev,
                &g.sum(&dims).unwrap(),
                &c.sum(&dims).unwrap(),
                dt,
                0.0,
            );
            if dims.len() == 1 {
                close_mag(
                    &format!("max {what}"),
                    dev,
                    &g.max(0).unwrap(),
                    &c.max(0).unwrap(),
                    dt,
                    0.0,
                );
                assert_eq!(
                    g.argmax(0).unwrap().to_vec_f64().unwrap(),
                    c.argmax(0).unwrap().to_vec_f64().unwrap(),
                    "argmax {what}"
                );
            }
        }
    }
}

/// The norms read a strided view of rows where it lies (the head-split q of a fused
/// projection, (B, H, N, E) over (B, N, 3, H, E)) instead of copying it first: against the
/// CPU, and bit for bit against the same norm of a dense copy, forward and backward. E = 128
/// and 64 take the register-resident kernels through the row map, E = 20 (no whole packs) and
/// f64 the streaming ones, E = 12 in bf16 (rows off 16-byte boundaries) the copy.
fn norms_read_strided_rows_where_they_lie(dev: &Device) {
    let q = |x: &Tensor| x.narrow(2, 1, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
    for dt in FLOATS {
        for e in [128usize, 64, 20, 12] {
            let shape = vec![2, 37, 3, 4, e];
            let (cx, gx) = normal_pair(dev, &shape, dt, 4000 + e as u64);
            let (cw, gw) = normal_pair(dev, &[e], dt, 4100);
            let (cdy, gdy) = normal_pair(dev, &[2, 4, 37, e], dt, 4200);
            for rms in [true, false] {
                let norm = |v: &Tensor, w: &Tensor| {
                    if rms {
                        v.rms_norm(Some(w), 1e-6)
                    } else {
                        v.layer_norm(None, None, 1e-6)
                    }
                };
                let what = format!(
                    "{} E {e} [{dt}]",
                    if rms { "rms_norm" } else { "layer_norm" }
                );
                let g = fwd_bwd(&[&gx], &gdy, &|x| norm(&q(&x[0])?, &gw));
                let c = fwd_bwd(&[&cx], &cdy, &|x| norm(&q(&x[0])?, &cw));
                check(&what, dev, &g, &c, dt, &[3.0, 9.0]);
                let d = fwd_bwd(&[&gx], &gdy, &|x| norm(&q(&x[0])?.contiguous()?, &gw));
                for (k, (a, b)) in g.iter().zip(&d).enumerate() {
                    assert_eq!(
                        a.to_vec_f64().unwrap(),
                        b.to_vec_f64().unwrap(),
                        "{what} {}: strided rows vs a dense copy",
                        NAMES[k]
                    );
                }
            }
        }
    }
}

/// A linear layer's GEMM epilogues: `matmul_bias` (cuBLASLt's bias epilogue for bf16 / f16,
/// its GEMM kept per shape, cuBLAS and an add otherwise) with the weight transposed as Linear
/// passes it, each shape twice with other operands (the kept GEMM's second call) and once
/// with the activations a view one row into a larger tensor (an address off cuBLASLt's
/// preferred alignment), and `add_matmul` (a beta = 1 GEMM into a fresh product's buffer, as
/// an adapter's term is added) with and without a bias in its epilogue, outputs and
/// gradients against the CPU at odd sizes.
fn linear_epilogues_match_the_reference(dev: &Device) {
    for dt in FLOATS {
        for (m, k, n) in [(37, 24, 40), (1, 8, 1), (129, 200, 72), (300, 3072, 17)] {
            let mag = |terms: usize| 3.0 * (terms as f64).sqrt();
            for (seed, offset) in [(4300, false), (4350, false), (4370, true)] {
                let rows = if offset { m + 1 } else { m };
                let (go, co) = both(
                    dev,
                    &[vec![rows, k], vec![n, k], vec![n]],
                    &[m, n],
                    dt,
                    seed,
                    &|x| {
                        let a = if offset {
                            x[0].narrow(0, 1, m)?
                        } else {
                            x[0].clone()
                        };
                        a.matmul_bias(&x[1].t()?, &x[2])
                    },
                );
                check(
                    &format!("matmul_bias {m}x{k}x{n} (seed {seed}, offset {offset})"),
                    dev,
                    &go,
                    &co,
                    dt,
                    &[mag(k), mag(n), mag(m), mag(m)],
                );
            }
            let (go, co) = both(
                dev,
                &[vec![m, k], vec![n, k], vec![m, 4], vec![n, 4]],
                &[m, n],
                dt,
                4400,
                &|x| x[0].matmul(&x[1].t()?)?.add_matmul(&x[2], &x[3].t()?),
            );
            check(
                &format!("add_matmul {m}x{k}x{n}"),
                dev,
                &go,
                &co,
                dt,
                // The output is rounded twice on each side (the base product, then the sum
                // added into it), so the two may differ by two units of the last place.
                &[2.0 * mag(k + 4), mag(n), mag(m), mag(n), mag(m)],
            );
            // The same with a bias in the accumulating GEMM's epilogue (a layer's bias the
            // base product left out, added by its LoRA's up-projection).
            let (go, co) = both(
                dev,
                &[vec![m, k], vec![n, k], vec![m, 4], vec![n, 4], vec![n]],
                &[m, n],
                dt,
                4450,
                &|x| {
                    x[0].matmul(&x[1].t()?)?
                        .add_matmul_bias(&x[2], &x[3].t()?, Some(&x[4]))
                },
            );
            check(
                &format!("add_matmul_bias {m}x{k}x{n}"),
                dev,
                &go,
                &co,
                dt,
                &[2.0 * mag(k + 5), mag(n), mag(m), mag(n), mag(m), mag(m)],
            );
        }
    }
}
