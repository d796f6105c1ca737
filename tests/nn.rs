#![cfg(feature = "cpu-ref")]
//! The `nn` module: gradchecks of every layer w.r.t. its input and its parameters, forward
//! values against loop references written here, Dropout statistics, `VarBuilder` over real
//! looking Flux checkpoint keys (bf16 files, shards, laziness, errors, training a subset), and
//! the error cases of the layers.

use flame::autograd::gradcheck::{gradcheck, GradcheckConfig};
use flame::nn::{
    apply_rope, modulate, rope, timestep_embedding, upsample_nearest2d, Activation, Dropout,
    EmbedNd, Embedding, GroupNorm, KeyMap, KeySource, LayerNorm, Linear, Modulation, RmsNorm,
    VarBuilder,
};
use flame::optim::{AdamConfig, AdamW, Optimizer};
use flame::safetensors::save;
use flame::{DType, Device, Error, Result, Shape, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type R = Result<()>;
type Layer<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;
const CPU: Device = Device::Cpu;

fn randn(shape: impl Into<Shape>, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &CPU, seed).unwrap()
}

fn uniform(lo: f64, hi: f64, shape: impl Into<Shape>, seed: u64) -> Tensor {
    Tensor::rand_uniform(lo, hi, shape, DType::F64, &CPU, seed).unwrap()
}

/// Values with |x| in [0.2, 2) and random signs: no input sits on relu's kink at 0.
fn away_from_zero(shape: impl Into<Shape>, seed: u64) -> Tensor {
    let shape = shape.into();
    let mag = v(&uniform(0.2, 2.0, shape.clone(), seed));
    let sign = v(&randn(shape.clone(), seed + 1));
    let x: Vec<f64> = mag.iter().zip(&sign).map(|(m, s)| m * s.signum()).collect();
    Tensor::from_vec(x, shape, &CPU).unwrap()
}

fn v(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

fn ids(v: &[u32], shape: impl Into<Shape>) -> Tensor {
    Tensor::from_slice(v, shape, &CPU).unwrap()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= atol, "{what}: [{i}] {g} vs {w}");
    }
}

/// Gradcheck with PyTorch's default tolerances; every input element must be compared.
fn gc(name: &str, inputs: Vec<Tensor>, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    gc_cfg(name, inputs, GradcheckConfig::default(), f)
}

fn gc_cfg(
    name: &str,
    x: Vec<Tensor>,
    cfg: GradcheckConfig,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let n: usize = x.iter().map(|t| t.elem_count()).sum();
    let r = gradcheck(&f, &x, cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(r.checked, n, "{name}: elements checked");
    assert!(!r.ops.is_empty(), "{name}: nothing was recorded");
    // A parameter the forward ignores has zero analytic and zero numeric gradient, which
    // gradcheck accepts: check that changing each input changes the output.
    let y0 = v(&f(&x).unwrap());
    for i in 0..x.len() {
        let mut args = x.clone();
        args[i] = args[i].affine(1.5, 0.25).unwrap();
        assert_ne!(v(&f(&args).unwrap()), y0, "{name}: input {i} ignored");
    }
}

/// rope and apply_rope compute in f32: a larger step (f32 rounding of ~6e-8 over 2 eps) and
/// an absolute tolerance to match.
fn f32_cfg(eps: f64, atol: f64) -> GradcheckConfig {
    let d = GradcheckConfig::default();
    GradcheckConfig { eps, atol, ..d }
}

fn lin(w: &Tensor, b: Option<&Tensor>) -> Linear {
    let (weight, bias) = (w.clone(), b.cloned());
    Linear {
        weight,
        bias,
        adapter: None,
        packing: None,
    }
}

fn layer_norm(w: Option<&Tensor>, b: Option<&Tensor>) -> LayerNorm {
    let (weight, bias) = (w.cloned(), b.cloned());
    LayerNorm {
        weight,
        bias,
        eps: 1e-5,
    }
}

fn group_norm(groups: usize, w: Option<&Tensor>, b: Option<&Tensor>) -> GroupNorm {
    let (weight, bias) = (w.cloned(), b.cloned());
    GroupNorm {
        groups,
        weight,
        bias,
        eps: 1e-5,
    }
}

fn rms(w: &Tensor) -> RmsNorm {
    let weight = w.clone();
    RmsNorm { weight, eps: 1e-6 }
}

/// Modulation with lin weight x[1] and bias x[2].
fn modulation(x: &[Tensor], triples: usize) -> Modulation {
    let lin = lin(&x[1], Some(&x[2]));
    Modulation { lin, triples }
}

fn embed_nd(theta: f64, axes_dim: Vec<usize>) -> EmbedNd {
    EmbedNd { theta, axes_dim }
}

// ----- 1. gradchecks ------------------------------------------------------------------------

#[test]
fn gradcheck_linear() {
    let f = |x: &[Tensor]| lin(&x[1], x.get(2)).forward(&x[0]);
    let (x3, w, b) = (randn((2, 3, 5), 1), randn((7, 5), 2), randn(7, 3));
    gc("linear 3-D with bias", vec![x3.clone(), w.clone(), b], f);
    gc("linear 3-D no bias", vec![x3, w], f);
    let (x2, w2) = (randn((4, 3), 4), randn((5, 3), 5));
    gc("linear 2-D no bias", vec![x2, w2], f);
    // A non-contiguous input goes through reshape's copy.
    let (xp, wp) = (randn((3, 2, 5), 6), randn((3, 5), 7));
    gc("linear of permuted x", vec![xp, wp], |x| {
        lin(&x[1], None).forward(&x[0].permute(&[1, 0, 2])?)
    });
}

#[test]
fn gradcheck_embedding_weight() {
    // Repeated ids: the gradient of a row is the sum over its uses.
    let i = ids(&[4, 0, 4, 2, 4, 0], (2, 3));
    gc("embedding weight", vec![randn((5, 3), 10)], move |x| {
        let weight = x[0].clone();
        Embedding { weight }.forward(&i)
    });
}

#[test]
fn gradcheck_norms() {
    let (x, w, b) = (randn((3, 7), 20), randn(7, 21), randn(7, 22));
    gc("layer_norm affine", vec![x, w, b], |x| {
        layer_norm(Some(&x[1]), Some(&x[2])).forward(&x[0])
    });
    gc("layer_norm plain", vec![randn((2, 3, 5), 23)], |x| {
        layer_norm(None, None).forward(&x[0])
    });
    gc("rms_norm", vec![randn((2, 3, 7), 24), randn(7, 25)], |x| {
        rms(&x[1]).forward(&x[0])
    });
    let (x, w, b) = (randn((2, 6, 3, 3), 26), randn(6, 27), randn(6, 28));
    gc("group_norm 4-D affine", vec![x, w, b], |x| {
        group_norm(3, Some(&x[1]), Some(&x[2])).forward(&x[0])
    });
    gc("group_norm 3-D plain", vec![randn((2, 4, 5), 29)], |x| {
        group_norm(2, None, None).forward(&x[0])
    });
}

#[test]
fn gradcheck_activations() {
    use Activation::*;
    for (i, act) in [Gelu, GeluTanh, Silu, Relu].into_iter().enumerate() {
        let x = away_from_zero((3, 7), 30 + 2 * i as u64);
        gc(&format!("{act:?}"), vec![x], move |x| act.forward(&x[0]));
    }
}

#[test]
fn gradcheck_upsample_and_modulate() {
    let up = |s: usize| move |x: &[Tensor]| upsample_nearest2d(&x[0], s);
    gc("upsample x2", vec![randn((1, 2, 2, 3), 40)], up(2));
    gc("upsample x3", vec![randn((2, 1, 3, 2), 41)], up(3));
    let (x, shift) = (randn((2, 3, 5), 42), randn((2, 1, 5), 43));
    let scale = randn((2, 1, 5), 44);
    gc("modulate", vec![x, shift, scale], |x| {
        modulate(&x[0], &x[1], &x[2])
    });
}

#[test]
fn gradcheck_modulation_vec_and_params() {
    // Double: 2 triples of dim 4, lin (24, 4); all six chunks concatenated back.
    let inputs = vec![randn((2, 4), 50), randn((24, 4), 51), randn(24, 52)];
    gc("modulation double", inputs, |x| {
        let outs = modulation(x, 2).forward(&x[0])?;
        let parts: Vec<&Tensor> = outs
            .iter()
            .flat_map(|o| [&o.shift, &o.scale, &o.gate])
            .collect();
        Tensor::cat(&parts, 2)
    });
    // Single: as a block uses it, gate * modulate(h).
    let h = randn((2, 3, 4), 53);
    let inputs = vec![randn((2, 4), 54), randn((12, 4), 55), randn(12, 56)];
    gc("modulation single", inputs, move |x| {
        let o = &modulation(x, 1).forward(&x[0])?[0];
        o.modulate(&h)?.mul(&o.gate)
    });
}

#[test]
fn gradcheck_timestep_embedding() {
    for (flip, dim) in [(true, 7), (false, 8)] {
        let t = uniform(0.0, 1.0, 3, 60);
        gc(&format!("timestep flip {flip} dim {dim}"), vec![t], |x| {
            timestep_embedding(&x[0], dim, 10_000.0, flip, 1.0, 10.0)
        });
    }
}

#[test]
fn gradcheck_rope_wrt_pos() {
    // rope returns f32 (as BFL's `out.float()`), so its output is cast back to f64.
    let pos = uniform(-2.0, 2.0, (1, 4), 70);
    gc_cfg("rope", vec![pos], f32_cfg(5e-3, 1e-3), |x| {
        rope(&x[0], 6, 100.0)?.to_dtype(DType::F64)
    });
}

#[test]
fn gradcheck_apply_rope_wrt_x() {
    // apply_rope computes in f32; it is linear in x, so a large step costs no truncation.
    let pos = uniform(0.0, 4.0, (1, 3, 2), 80);
    let freqs = embed_nd(100.0, vec![2, 4]).forward(&pos).unwrap();
    let x = randn((1, 2, 3, 6), 81);
    gc_cfg("apply_rope", vec![x], f32_cfg(1e-2, 1e-4), move |x| {
        apply_rope(&x[0], &freqs)
    });
}

// ----- 2. forward values --------------------------------------------------------------------

/// y[r][o] = sum_i x[r][i] w[o][i] + b[o], over the rows of x flattened to (rows, in).
fn linear_ref(x: &[f64], w: &[f64], b: Option<&[f64]>, inp: usize, out: usize) -> Vec<f64> {
    let mut y = vec![];
    for row in x.chunks(inp) {
        for o in 0..out {
            let dot: f64 = (0..inp).map(|i| row[i] * w[o * inp + i]).sum();
            y.push(dot + b.map_or(0.0, |b| b[o]));
        }
    }
    y
}

#[test]
fn linear_matches_loops() -> R {
    let (w, b) = (randn((7, 5), 100), randn(7, 101));
    // A non-contiguous 3-D input: x is the permuted view of a (3, 2, 5) tensor.
    let x = randn((3, 2, 5), 102).permute(&[1, 0, 2])?;
    let y = lin(&w, Some(&b)).forward(&x)?;
    assert_eq!(y.dims(), [2, 3, 7]);
    let want = linear_ref(&v(&x), &v(&w), Some(&v(&b)), 5, 7);
    assert_close("linear 3-D", &v(&y), &want, 1e-12);
    // No bias, 1-D input: (5,) -> (7,).
    let x1 = randn(5, 103);
    let y1 = lin(&w, None).forward(&x1)?;
    assert_eq!(y1.dims(), [7]);
    let want = linear_ref(&v(&x1), &v(&w), None, 5, 7);
    assert_close("linear 1-D", &v(&y1), &want, 1e-12);
    Ok(())
}

#[test]
fn norm_layers_match_loops() -> R {
    // Normalise each group of `n` consecutive values (biased variance), then y * w + b with
    // the weight and bias of element i given by `pw(i)`.
    let norm = |x: &[f64], n: usize, center: bool, eps: f64, pw: &dyn Fn(usize) -> (f64, f64)| {
        let mut y = vec![];
        for g in x.chunks(n) {
            let mean = if center {
                g.iter().sum::<f64>() / n as f64
            } else {
                0.0
            };
            let var = g.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / n as f64;
            for e in g {
                let (w, b) = pw(y.len());
                y.push((e - mean) / (var + eps).sqrt() * w + b);
            }
        }
        y
    };
    let (x, w7, b7) = (randn((3, 7), 160), randn(7, 161), randn(7, 162));
    let (wv, bv) = (v(&w7), v(&b7));
    let y = layer_norm(Some(&w7), Some(&b7)).forward(&x)?;
    let want = norm(&v(&x), 7, true, 1e-5, &|i| (wv[i % 7], bv[i % 7]));
    assert_close("layer_norm", &v(&y), &want, 1e-12);
    let want = norm(&v(&x), 7, false, 1e-6, &|i| (wv[i % 7], 0.0));
    assert_close("rms_norm", &v(&rms(&w7).forward(&x)?), &want, 1e-12);
    // (2, 6, 2, 3) in 3 groups: 2 channels x 6 positions each; channel c = i / 6 % 6.
    let (x, w6, b6) = (randn((2, 6, 2, 3), 163), randn(6, 164), randn(6, 165));
    let (wv, bv) = (v(&w6), v(&b6));
    let y = group_norm(3, Some(&w6), Some(&b6)).forward(&x)?;
    let want = norm(&v(&x), 12, true, 1e-5, &|i| (wv[i / 6 % 6], bv[i / 6 % 6]));
    assert_close("group_norm", &v(&y), &want, 1e-12);
    Ok(())
}

#[test]
fn embedding_picks_rows() -> R {
    let weight = randn((6, 5), 110);
    let wv = v(&weight);
    let picks = [5u32, 0, 3, 3, 1, 5];
    let y = Embedding { weight }.forward(&ids(&picks, (2, 3)))?;
    assert_eq!(y.dims(), [2, 3, 5]);
    let want: Vec<f64> = picks
        .iter()
        .flat_map(|&r| wv[r as usize * 5..][..5].to_vec())
        .collect();
    assert_eq!(v(&y), want);
    Ok(())
}

#[test]
fn upsample_nearest2d_values() -> R {
    let x = Tensor::from_vec((1..=12).map(f64::from).collect(), (1, 2, 2, 3), &CPU)?;
    let y = upsample_nearest2d(&x, 2)?;
    assert_eq!(y.dims(), [1, 2, 4, 6]);
    // Written by hand: each pixel becomes a 2x2 block.
    #[rustfmt::skip]
    let want = [
        1., 1., 2., 2., 3., 3.,   1., 1., 2., 2., 3., 3.,
        4., 4., 5., 5., 6., 6.,   4., 4., 5., 5., 6., 6.,
        7., 7., 8., 8., 9., 9.,   7., 7., 8., 8., 9., 9.,
        10., 10., 11., 11., 12., 12.,   10., 10., 11., 11., 12., 12.,
    ];
    assert_eq!(v(&y), want);
    // Scale 3 against out[c][y][x] = in[c][y / 3][x / 3].
    let y3 = v(&upsample_nearest2d(&x, 3)?);
    for (i, got) in y3.iter().enumerate() {
        let (c, yy, xx) = (i / 54, i / 9 % 6, i % 9);
        let want = (c * 6 + (yy / 3) * 3 + xx / 3 + 1) as f64;
        assert_eq!(*got, want, "scale 3 at {c},{yy},{xx}");
    }
    Ok(())
}

/// diffusers' `get_timestep_embedding` in plain f64.
fn timestep_ref(t: &[f64], dim: usize, mp: f64, flip: bool, shift: f64, scale: f64) -> Vec<f64> {
    let half = dim / 2;
    let mut out = vec![];
    for &ti in t {
        let freq = |i: usize| (-mp.ln() * i as f64 / (half as f64 - shift)).exp();
        let args: Vec<f64> = (0..half).map(|i| scale * (ti * freq(i))).collect();
        let sin = args.iter().map(|a| a.sin());
        let cos = args.iter().map(|a| a.cos());
        if flip {
            out.extend(cos.chain(sin));
        } else {
            out.extend(sin.chain(cos));
        }
        if dim % 2 == 1 {
            out.push(0.0);
        }
    }
    out
}

#[test]
fn timestep_embedding_matches_diffusers_formula() -> R {
    let tv = [0.0, 0.37, 5.2, 0.999];
    let t = Tensor::from_slice(&tv, 4, &CPU)?;
    // (dim, max_period, flip, shift, scale): Flux's (flip, shift 0, scale 1000), diffusers'
    // default (no flip, shift 1), and an odd dim each way.
    for (dim, mp, flip, shift, scale) in [
        (8, 10_000.0, true, 0.0, 1000.0),
        (8, 10_000.0, false, 1.0, 1.0),
        (7, 10_000.0, true, 0.0, 1000.0),
        (9, 500.0, false, 1.0, 3.0),
    ] {
        let y = timestep_embedding(&t, dim, mp, flip, shift, scale)?;
        assert_eq!((y.dims(), y.dtype()), (&[4, dim][..], DType::F64));
        let want = timestep_ref(&tv, dim, mp, flip, shift, scale);
        assert_close(&format!("dim {dim} flip {flip}"), &v(&y), &want, 1e-10);
    }
    // f32 timesteps give f32 output (computed in f64, rounded once); u32 ones give f32.
    let t32 = t.to_dtype(DType::F32)?;
    let y = timestep_embedding(&t32, 7, 10_000.0, true, 0.0, 1.0)?;
    assert_eq!(y.dtype(), DType::F32);
    let want = timestep_ref(&v(&t32), 7, 10_000.0, true, 0.0, 1.0);
    assert_close("f32", &v(&y), &want, 1e-6);
    let tu = Tensor::from_slice(&[0u32, 3, 999], 3, &CPU)?;
    let y = timestep_embedding(&tu, 6, 10_000.0, false, 1.0, 1.0)?;
    assert_eq!(y.dtype(), DType::F32);
    let want = timestep_ref(&[0.0, 3.0, 999.0], 6, 10_000.0, false, 1.0, 1.0);
    assert_close("u32", &v(&y), &want, 1e-6);
    Ok(())
}

/// [[cos, -sin], [sin, cos]] of pos * theta^(-2i/dim), flattened as (N, L, dim/2, 2, 2).
fn rope_ref(pos: &[f64], dim: usize, theta: f64) -> Vec<f64> {
    let mut out = vec![];
    for &p in pos {
        for i in 0..dim / 2 {
            let a = p * theta.powf(-((2 * i) as f64) / dim as f64);
            out.extend([a.cos(), -a.sin(), a.sin(), a.cos()]);
        }
    }
    out
}

#[test]
fn rope_matches_rotation_matrices() -> R {
    let pos = uniform(-5.0, 30.0, (2, 3), 120);
    let r = rope(&pos, 6, 10_000.0)?;
    assert_eq!((r.dims(), r.dtype()), (&[2, 3, 3, 2, 2][..], DType::F32));
    assert_close("rope", &v(&r), &rope_ref(&v(&pos), 6, 10_000.0), 1e-6);
    assert!(rope(&pos, 5, 10_000.0).is_err(), "odd dim");
    Ok(())
}

#[test]
fn embed_nd_concatenates_axis_ropes() -> R {
    let idv: Vec<f64> = (0..15).map(|i| ((i * 7) % 11) as f64 + 0.5).collect();
    let idt = Tensor::from_vec(idv, (1, 5, 3), &CPU)?;
    let e = embed_nd(10_000.0, vec![2, 4, 6]);
    let y = e.forward(&idt)?;
    assert_eq!(y.dims(), [1, 1, 5, 6, 2, 2]);
    // Axis i fills pairs [start, start + axes_dim[i] / 2) of dim 3.
    let mut start = 0;
    for (i, d) in [2usize, 4, 6].into_iter().enumerate() {
        let pos = idt.narrow(2, i, 1)?.squeeze(2)?;
        let block = v(&y.narrow(3, start, d / 2)?.squeeze(1)?);
        assert_eq!(block, v(&rope(&pos, d, 10_000.0)?), "axis {i}");
        assert_close("axis", &block, &rope_ref(&v(&pos), d, 1e4), 1e-6);
        start += d / 2;
    }
    assert!(e.forward(&idt.narrow(2, 0, 2)?).is_err(), "2 axes, 3 dims");
    Ok(())
}

#[test]
fn apply_rope_rotates_pairs() -> R {
    // By hand: position 1, dim 4, theta 100 -> angles 1 and 100^(-1/2) = 0.1; x = [1, 2, 3, 4].
    let pos = Tensor::from_slice(&[1.0f64], (1, 1), &CPU)?;
    let freqs = rope(&pos, 4, 100.0)?.unsqueeze(1)?;
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], (1, 1, 1, 4), &CPU)?;
    let y = apply_rope(&x, &freqs)?;
    let (c1, s1, c2, s2) = (1f64.cos(), 1f64.sin(), 0.1f64.cos(), 0.1f64.sin());
    let want = [
        c1 - 2. * s1,
        s1 + 2. * c1,
        3. * c2 - 4. * s2,
        3. * s2 + 4. * c2,
    ];
    assert_close("hand pair", &v(&y), &want, 1e-6);

    // Random: (N, H, L, D) = (2, 3, 4, 6) against the per-pair loop; each pair keeps its norm.
    let pos = uniform(0.0, 20.0, (2, 4, 2), 130);
    let freqs = embed_nd(10_000.0, vec![2, 4]).forward(&pos)?;
    let x = randn((2, 3, 4, 6), 131).to_dtype(DType::F32)?;
    let y = apply_rope(&x, &freqs)?;
    assert_eq!((y.dims(), y.dtype()), (x.dims(), DType::F32));
    let (xv, yv, fv) = (v(&x), v(&y), v(&freqs));
    for (k, (a, got)) in xv.chunks(2).zip(yv.chunks(2)).enumerate() {
        // pair k = ((n * 3 + h) * 4 + l) * 3 + p; freqs index (n, 0, l, p).
        let (p, l, n) = (k % 3, k / 3 % 4, k / 36);
        let f = &fv[((n * 4 + l) * 3 + p) * 4..][..4];
        let want = [f[0] * a[0] + f[1] * a[1], f[2] * a[0] + f[3] * a[1]];
        assert_close(&format!("pair {k}"), got, &want, 1e-5);
        let (na, ny) = (a[0].hypot(a[1]), got[0].hypot(got[1]));
        assert!(
            (na - ny).abs() <= 1e-5 * na.max(1.0),
            "pair {k}: {na} -> {ny}"
        );
    }
    Ok(())
}

#[test]
fn layers_accept_permuted_views() -> R {
    // Flux permutes q/k from (N, L, H, D) to (N, H, L, D) before apply_rope: a strided view
    // must give the values of its contiguous copy.
    let x = randn((2, 4, 3, 6), 125).permute(&[0, 2, 1, 3])?;
    let copy = Tensor::from_vec(v(&x), x.shape().clone(), &CPU)?;
    let freqs = rope(&uniform(0.0, 9.0, (2, 4), 126), 6, 1e4)?.unsqueeze(1)?;
    let (gw, gb, rw) = (randn(3, 127), randn(3, 128), randn(6, 129));
    let fs: [(&str, &Layer); 4] = [
        ("apply_rope", &|x| apply_rope(x, &freqs)),
        ("upsample", &|x| upsample_nearest2d(x, 2)),
        ("group_norm", &|x| {
            group_norm(3, Some(&gw), Some(&gb)).forward(x)
        }),
        ("rms_norm", &|x| rms(&rw).forward(x)),
    ];
    for (what, f) in fs {
        assert_eq!(v(&f(&x)?), v(&f(&copy)?), "{what}");
    }
    Ok(())
}

/// The positions of a dropout output's kept (non-zero) elements, for x without zeros.
fn kept(y: &Tensor) -> Vec<bool> {
    v(y).iter().map(|&e| e != 0.0).collect()
}

#[test]
fn dropout_statistics_scaling_and_seeding() -> R {
    let n = 100_000;
    let x = uniform(0.5, 1.5, n, 140);
    let d = Dropout::new(0.3, 42)?;
    let y1 = d.forward(&x, true)?;
    let m1 = kept(&y1);
    let frac = m1.iter().filter(|&&k| k).count() as f64 / n as f64;
    // Binomial(1e5, 0.7): sd 0.0014, so 0.01 is ~7 sd.
    assert!((frac - 0.7).abs() < 0.01, "kept fraction {frac}");
    for (i, (&a, &b)) in v(&x).iter().zip(&v(&y1)).enumerate() {
        assert!(
            b == 0.0 || (b - a / 0.7).abs() <= 1e-12,
            "[{i}] {b} is not {a} / 0.7"
        );
    }
    assert_eq!(v(&d.forward(&x, false)?), v(&x), "eval mode");
    let m2 = kept(&d.forward(&x, true)?);
    assert_ne!(m1, m2, "successive calls draw new masks");
    let fresh = Dropout::new(0.3, 42)?;
    assert_eq!(kept(&fresh.forward(&x, true)?), m1, "same seed, call 1");
    assert_eq!(kept(&fresh.forward(&x, true)?), m2, "same seed, call 2");
    let other = Dropout::new(0.3, 43)?;
    assert_ne!(kept(&other.forward(&x, true)?), m1, "another seed");
    for p in [1.0, -0.1, f64::NAN] {
        assert!(Dropout::new(p, 0).is_err(), "p = {p} accepted");
    }
    assert!(Dropout::new(0.0, 0).is_ok());
    Ok(())
}

#[test]
fn modulation_double_chunks_of_lin_silu() -> R {
    let (w, b) = (randn((30, 5), 150), randn(30, 151));
    let map = HashMap::from([
        ("mod.lin.weight".to_string(), w.clone()),
        ("mod.lin.bias".to_string(), b.clone()),
    ]);
    let vb = VarBuilder::from_tensors(map, DType::F64, &CPU);
    let m = Modulation::new(&vb.pp("mod"), 5, true)?;
    let vec = randn((2, 5), 152);
    let outs = m.forward(&vec)?;
    assert_eq!(outs.len(), 2);
    let silu: Vec<f64> = v(&vec).iter().map(|&a| a / (1.0 + (-a).exp())).collect();
    let o = linear_ref(&silu, &v(&w), Some(&v(&b)), 5, 30);
    for (t, out) in outs.iter().enumerate() {
        for (c, part) in [&out.shift, &out.scale, &out.gate].into_iter().enumerate() {
            assert_eq!(part.dims(), [2, 1, 5]);
            // Chunk 3t + c of each row of lin(silu(vec)).
            let want: Vec<f64> = (0..2)
                .flat_map(|n| o[n * 30 + (3 * t + c) * 5..][..5].to_vec())
                .collect();
            assert_close(&format!("triple {t} part {c}"), &v(part), &want, 1e-12);
        }
    }
    // modulate: x * (1 + scale) + shift, broadcast over the tokens.
    let x = randn((2, 3, 5), 153);
    let (sh, sc) = (v(&outs[1].shift), v(&outs[1].scale));
    let want: Vec<f64> = v(&x)
        .iter()
        .enumerate()
        .map(|(i, &e)| e * (1.0 + sc[i / 15 * 5 + i % 5]) + sh[i / 15 * 5 + i % 5])
        .collect();
    assert_close("modulate", &v(&outs[1].modulate(&x)?), &want, 1e-12);
    // Single wants lin (15, 5); the map has (30, 5).
    assert!(Modulation::new(&vb.pp("mod"), 5, false).is_err());
    Ok(())
}

// ----- 3. VarBuilder over Flux keys ---------------------------------------------------------

const QKV_W: &str = "double_blocks.0.img_attn.qkv.weight";
const QKV_B: &str = "double_blocks.0.img_attn.qkv.bias";
const Q_NORM: &str = "double_blocks.0.img_attn.norm.query_norm.scale";
const K_NORM: &str = "double_blocks.0.img_attn.norm.key_norm.scale";
const MOD_W: &str = "double_blocks.0.img_mod.lin.weight";
const MOD_B: &str = "double_blocks.0.img_mod.lin.bias";
const TIN_W: &str = "time_in.in_layer.weight";
const TIN_B: &str = "time_in.in_layer.bias";
const TOUT_W: &str = "time_in.out_layer.weight";
const TOUT_B: &str = "time_in.out_layer.bias";

/// Flux-shaped tensors (hidden 8, head dim 4, timestep features 6), random, in bf16.
fn flux_tensors() -> Vec<(&'static str, Tensor)> {
    let specs: [(&str, &[usize]); 10] = [
        (QKV_W, &[24, 8]),
        (QKV_B, &[24]),
        (Q_NORM, &[4]),
        (K_NORM, &[4]),
        (MOD_W, &[48, 8]),
        (MOD_B, &[48]),
        (TIN_W, &[8, 6]),
        (TIN_B, &[8]),
        (TOUT_W, &[8, 8]),
        (TOUT_B, &[8]),
    ];
    let bf16 = |s: &[usize], seed| {
        let t = Tensor::randn(s.to_vec(), DType::F32, &CPU, seed).unwrap();
        t.to_dtype(DType::BF16).unwrap()
    };
    (0..)
        .zip(specs)
        .map(|(i, (k, s))| (k, bf16(s, 200 + i)))
        .collect()
}

/// `double_blocks.0.img_attn`
fn attn(vb: &VarBuilder) -> VarBuilder {
    vb.pp("double_blocks").pp(0).pp("img_attn")
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("flame-nn-{tag}-{}-{nanos}", std::process::id());
        let p = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    /// Saves the tensors of `all` whose names pass `keep` as `name`.
    fn save(&self, name: &str, all: &[(&str, Tensor)], keep: impl Fn(&str) -> bool) -> PathBuf {
        let p = self.0.join(name);
        let named = all.iter().filter(|(k, _)| keep(k)).map(|(k, t)| (*k, t));
        save(named, &p).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn source<'a>(all: &'a [(&str, Tensor)], key: &str) -> &'a Tensor {
    &all.iter().find(|(k, _)| *k == key).unwrap().1
}

/// `e` is `Error::Param` for `key` and its message holds every one of `parts`.
fn param_err(e: &Error, key: &str, parts: &[&str]) {
    assert!(matches!(e, Error::Param { key: k, .. } if k == key), "{e}");
    let m = e.to_string();
    for p in parts {
        assert!(m.contains(p), "{p:?} not in: {m}");
    }
}

fn show(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn varbuilder_loads_flux_keys_from_bf16() -> R {
    let dir = TempDir::new("flux");
    let all = flux_tensors();
    let path = dir.save("flux.safetensors", &all, |_| true);
    let vb = VarBuilder::from_files(&[&path], DType::F32, &CPU)?;
    assert_eq!(attn(&vb).pp("qkv").key("weight"), QKV_W);
    assert!(attn(&vb).pp("qkv").contains("bias") && !attn(&vb).contains("bias"));
    let qkv = Linear::new(&attn(&vb).pp("qkv"), 8, 24, true)?;
    let qn = RmsNorm::with_key(&attn(&vb).pp("norm").pp("query_norm"), 4, 1e-6, "scale")?;
    let m = Modulation::new(&vb.pp("double_blocks").pp(0).pp("img_mod"), 8, true)?;
    let tin = Linear::new(&vb.pp("time_in").pp("in_layer"), 6, 8, true)?;
    let got = [
        (QKV_W, &qkv.weight),
        (QKV_B, qkv.bias.as_ref().unwrap()),
        (Q_NORM, &qn.weight),
        (MOD_W, &m.lin.weight),
        (MOD_B, m.lin.bias.as_ref().unwrap()),
        (TIN_W, &tin.weight),
        (TIN_B, tin.bias.as_ref().unwrap()),
    ];
    for (k, t) in got {
        assert_eq!(t.dtype(), DType::F32, "{k}");
        // bf16 -> f32 is exact: the loaded values are the bf16 values.
        assert_eq!(v(t), v(source(&all, k)), "{k}");
        assert!(!t.is_var() && !t.requires_grad(), "{k} loads frozen");
    }
    assert_eq!(vb.unused_keys()?, [K_NORM, TOUT_B, TOUT_W]);
    let mut loaded: Vec<&str> = got.iter().map(|(k, _)| *k).collect();
    loaded.sort();
    let params: Vec<String> = vb.params()?.into_iter().map(|(k, _)| k).collect();
    assert_eq!(params, loaded);
    // The loaded layers run: (2, 3, 8) tokens, (2, 8) vec.
    let ones = |s: &[usize]| Tensor::ones(s.to_vec(), DType::F32, &CPU);
    assert_eq!(qkv.forward(&ones(&[2, 3, 8])?)?.dims(), [2, 3, 24]);
    let outs = m.forward(&ones(&[2, 8])?)?;
    assert_eq!((outs.len(), outs[1].gate.dims()), (2, &[2usize, 1, 8][..]));
    Ok(())
}

#[test]
fn varbuilder_same_key_twice_is_same_tensor() -> R {
    let dir = TempDir::new("twice");
    let all = flux_tensors();
    let path = dir.save("m.safetensors", &all, |_| true);
    let vb = VarBuilder::from_files(&[&path], DType::F32, &CPU)?;
    let a = Linear::new(&attn(&vb).pp("qkv"), 8, 24, true)?;
    let b = vb.get((24, 8), QKV_W)?;
    assert!(a.weight.same_storage(&b) && a.weight.id() == b.id());
    let e = vb.get((8, 24), QKV_W).expect_err("other shape");
    param_err(&e, QKV_W, &["[8, 24]", "[24, 8]"]);
    Ok(())
}

#[test]
fn varbuilder_shards_duplicates_missing_and_shapes() -> R {
    let dir = TempDir::new("shards");
    let all = flux_tensors();
    let a = dir.save("a.safetensors", &all, |k| k.starts_with("double_blocks"));
    let b = dir.save("b.safetensors", &all, |k| k.starts_with("time_in"));
    let vb = VarBuilder::from_files(&[&a, &b], DType::F32, &CPU)?;
    let qkv = Linear::new(&attn(&vb).pp("qkv"), 8, 24, true)?;
    let tout = Linear::new(&vb.pp("time_in").pp("out_layer"), 8, 8, true)?;
    assert_eq!(v(&qkv.weight), v(source(&all, QKV_W)));
    assert_eq!(v(&tout.weight), v(source(&all, TOUT_W)));
    let unused = [K_NORM, Q_NORM, MOD_B, MOD_W, TIN_B, TIN_W];
    assert_eq!(vb.unused_keys()?, unused);

    // A key in two shards: an error naming the key and both files.
    let c = dir.save("c.safetensors", &all, |k| k == QKV_B || k == TIN_W);
    let e = VarBuilder::from_files(&[&a, &c], DType::F32, &CPU).expect_err("dup");
    param_err(&e, QKV_B, &[QKV_B, &show(&a), &show(&c)]);

    // A missing key names the full key and the files searched.
    let e = vb
        .pp("double_blocks")
        .pp(0)
        .get(3, "nope")
        .expect_err("missing");
    let key = "double_blocks.0.nope";
    param_err(&e, key, &[&format!("'{key}'"), &show(&a), &show(&b)]);

    // RmsNorm::new asks for `weight`; BFL's file calls the scale `scale`.
    let qn = attn(&vb).pp("norm").pp("query_norm");
    let e = RmsNorm::new(&qn, 4, 1e-6).expect_err("no `weight`");
    let key = Q_NORM.replace("scale", "weight");
    param_err(&e, &key, &[&format!("'{key}'"), "missing"]);
    assert_eq!(RmsNorm::with_key(&qn, 4, 1e-6, "scale")?.weight.dims(), [4]);

    // A wrong shape names the key, both shapes and the file.
    let e = vb.get((24, 9), MOD_W).expect_err("wrong shape");
    param_err(&e, MOD_W, &[MOD_W, "[24, 9]", "[48, 8]", &show(&a)]);
    assert!(vb.unused_keys()?.contains(&MOD_W.to_string()), "failed get");
    Ok(())
}

/// Writes a file from a raw JSON header and data bytes.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn varbuilder_is_lazy_about_unsupported_dtypes() -> R {
    let dir = TempDir::new("lazy");
    let path = dir.0.join("mixed.safetensors");
    let header = r#"{"good.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
        "step":{"dtype":"I64","shape":[2],"data_offsets":[8,24]},
        "good.bias":{"dtype":"BF16","shape":[1],"data_offsets":[24,26]}}"#;
    let mut data = vec![];
    data.extend([1.5f32, -2.25].iter().flat_map(|f| f.to_le_bytes()));
    data.extend([7i64, 9].iter().flat_map(|i| i.to_le_bytes()));
    data.extend(half::bf16::from_f32(0.375).to_le_bytes());
    raw_file(&path, header, &data);
    let vb = VarBuilder::from_files(&[&path], DType::F64, &CPU)?;
    assert_eq!(vb.unused_keys()?, ["good.bias", "good.weight", "step"]);
    assert_eq!(v(&vb.pp("good").get(2, "weight")?), [1.5, -2.25]);
    let e = vb.get(2, "step").expect_err("I64 is not loadable");
    let m = e.to_string();
    assert!(m.contains("'step'") && m.contains("I64"), "{m}");
    // The failure leaves the builder usable.
    let b = vb.pp("good").get(1, "bias")?;
    assert_eq!((v(&b), b.dtype()), (vec![0.375], DType::F64));
    assert_eq!(vb.unused_keys()?, ["step"]);
    Ok(())
}

#[test]
fn varbuilder_trains_only_selected_params() -> R {
    let dir = TempDir::new("train");
    let all = flux_tensors();
    let path = dir.save("m.safetensors", &all, |_| true);
    let vb = VarBuilder::from_files(&[&path], DType::F32, &CPU)?;
    let qkv = Linear::new(&attn(&vb).pp("qkv"), 8, 24, true)?;
    let qn = RmsNorm::with_key(&attn(&vb).pp("norm").pp("query_norm"), 4, 1e-6, "scale")?;
    let tin = Linear::new(&vb.pp("time_in").pp("in_layer"), 6, 8, true)?;
    vb.set_trainable(|k| k.contains("qkv"))?;
    for (k, t) in vb.params()? {
        assert_eq!(t.is_var(), k.contains("qkv"), "{k}");
    }
    let names: Vec<String> = vb.trainable_params()?.into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, [QKV_B, QKV_W]);
    let snapshot = || -> Result<Vec<(String, Vec<f64>)>> {
        Ok(vb
            .params()?
            .iter()
            .map(|(k, t)| (k.clone(), v(t)))
            .collect())
    };
    let before = snapshot()?;

    // Every parameter takes part in the loss; only the qkv ones may change.
    let x = Tensor::randn((3, 8), DType::F32, &CPU, 300)?;
    let t = tin.forward(&Tensor::randn((3, 6), DType::F32, &CPU, 301)?)?;
    let y = qkv.forward(&x)?.add(&Tensor::cat(&[&t, &t, &t], 1)?)?;
    let q = qn.forward(&y.narrow(1, 0, 4)?)?;
    let loss = y.sqr()?.mean_all()?.add(&q.sum_all()?)?;
    let grads = loss.backward()?;
    assert!(grads.get(&tin.weight).is_none() && grads.get(&qn.weight).is_none());
    let cfg = AdamConfig {
        lr: 0.05,
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let mut opt = AdamW::new(vb.trainable_params()?, cfg)?;
    opt.step(&grads)?;
    for ((k, old), (_, new)) in before.iter().zip(snapshot()?) {
        if k.contains("qkv") {
            let all_moved = old.iter().zip(&new).all(|(a, b)| a != b);
            assert!(all_moved, "{k}: some element unchanged");
        } else {
            assert_eq!(old, &new, "{k}: frozen but changed");
        }
    }
    // The layer's own handle sees the update (same storage).
    assert_eq!(v(&qkv.weight), v(&vb.get((24, 8), QKV_W)?));
    assert_ne!(v(&qkv.weight), v(source(&all, QKV_W)));
    Ok(())
}

#[test]
fn varbuilder_from_tensors_converts_and_freezes() -> R {
    let w = randn((3, 2), 310).requires_grad_()?;
    let map = HashMap::from([("l.weight".into(), w.clone())]);
    let vb = VarBuilder::from_tensors(map, DType::F32, &CPU);
    let l = Linear::new(&vb.pp("l"), 2, 3, false)?;
    assert_eq!(l.weight.dtype(), DType::F32);
    assert!(!l.weight.requires_grad(), "loads as a frozen leaf");
    assert_close("f32 copy", &v(&l.weight), &v(&w), 1e-6);
    let e = Linear::new(&vb.pp("l"), 2, 3, true).expect_err("no bias in the map");
    param_err(&e, "l.bias", &["'l.bias'"]);
    Ok(())
}

// ----- 4. error cases -----------------------------------------------------------------------

#[test]
fn layer_errors() {
    let e = lin(&randn((4, 3), 400), None).forward(&randn((2, 5), 401));
    let e = e.expect_err("in dim 5 vs 3").to_string();
    assert!(e.contains("linear"), "{e}");
    assert!(upsample_nearest2d(&randn((2, 3, 4), 402), 2).is_err());
    assert!(upsample_nearest2d(&randn((1, 1, 2, 2), 403), 0).is_err());
    let freqs = rope(&uniform(0.0, 3.0, (1, 2), 404), 4, 1e4).unwrap();
    let freqs = freqs.unsqueeze(1).unwrap();
    let e = apply_rope(&randn((1, 1, 2, 5), 405), &freqs).expect_err("odd D");
    assert!(e.to_string().contains("apply_rope"), "{e}");
    assert!(apply_rope(&randn((2, 4), 406), &freqs).is_err(), "2-D x");
    let e = timestep_embedding(&randn((2, 1), 407), 8, 1e4, true, 0.0, 1.0);
    let e = e.expect_err("2-D t").to_string();
    assert!(e.contains("timestep_embedding"), "{e}");
    assert!(timestep_embedding(&randn(2, 408), 1, 1e4, true, 0.0, 1.0).is_err());
}

#[test]
fn varbuilder_key_map_concatenates_swaps_and_renames() -> R {
    let dir = TempDir::new("keymap");
    let all: Vec<(&str, Tensor)> = [
        ("attn.to_q.weight", 0u64),
        ("attn.to_k.weight", 1),
        ("attn.to_v.weight", 2),
        ("norm_out.linear.weight", 3),
        ("proj_out.weight", 4),
        ("extra.weight", 5),
    ]
    .into_iter()
    .map(|(k, s)| (k, randn((4, 3), 300 + s)))
    .collect();
    let path = dir.save("diffusers.safetensors", &all, |_| true);
    let map: KeyMap = Arc::new(|k: &str| match k {
        "blk.qkv.weight" => Some(KeySource::Cat(vec![
            ("attn.to_q.weight".into(), 4),
            ("attn.to_k.weight".into(), 4),
            ("attn.to_v.weight".into(), 4),
        ])),
        "blk.qkv2.weight" => Some(KeySource::Cat(vec![
            ("attn.to_q.weight".into(), 4),
            ("attn.to_k.weight".into(), 8),
        ])),
        "final.ada.weight" => Some(KeySource::SwapHalves("norm_out.linear.weight".into())),
        "final.linear.weight" => Some(KeySource::Key("proj_out.weight".into())),
        "blk.gone.weight" => Some(KeySource::Key("nowhere.weight".into())),
        _ => None,
    });
    let vb = VarBuilder::from_files(&[&path], DType::F64, &CPU)?.with_key_map(map)?;
    assert_eq!(vb.pp("blk").shape_of("qkv.weight"), Some(vec![12, 3]));
    assert!(vb.contains("blk.qkv.weight") && !vb.contains("blk.gone.weight"));
    let qkv = vb.get((12, 3), "blk.qkv.weight")?;
    let mut want = vec![];
    for k in ["attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"] {
        want.extend(v(source(&all, k)));
    }
    assert_eq!(v(&qkv), want);
    let ada = v(&vb.get((4, 3), "final.ada.weight")?);
    let n = v(source(&all, "norm_out.linear.weight"));
    assert_eq!(ada, [&n[6..], &n[..6]].concat(), "halves swapped");
    assert_eq!(
        v(&vb.get((4, 3), "final.linear.weight")?),
        v(source(&all, "proj_out.weight"))
    );
    assert_eq!(vb.unused_keys()?, ["extra.weight"]);
    // A part whose rows differ from what the layout declares.
    param_err(
        &vb.get((12, 3), "blk.qkv2.weight").unwrap_err(),
        "blk.qkv2.weight",
        &["attn.to_k.weight", "says 8"],
    );
    // Errors name the model key and the source keys.
    param_err(
        &vb.get((4, 3), "blk.gone.weight").unwrap_err(),
        "blk.gone.weight",
        &["missing", "nowhere.weight"],
    );
    param_err(
        &vb.get((4, 3), "blk.unknown.weight").unwrap_err(),
        "blk.unknown.weight",
        &["no source"],
    );
    let vb2 = VarBuilder::from_files(&[&path], DType::F64, &CPU)?.with_key_map(Arc::new(|k| {
        (k == "blk.qkv.weight").then(|| KeySource::Cat(vec![("attn.to_q.weight".into(), 4)]))
    }))?;
    param_err(
        &vb2.get((12, 3), "blk.qkv.weight").unwrap_err(),
        "blk.qkv.weight",
        &["expected shape", "[4, 3]", "attn.to_q.weight"],
    );
    Ok(())
}

#[test]
fn varbuilder_from_shapes_checks_like_a_file() -> R {
    let shapes = [
        ("a.q", vec![4, 3]),
        ("a.k", vec![4, 3]),
        ("b.w", vec![2]),
        ("c", vec![1]),
    ];
    let vb = VarBuilder::from_shapes(
        shapes.iter().map(|(k, s)| (k.to_string(), s.clone())),
        DType::F32,
        &CPU,
    )
    .with_key_map(Arc::new(|k: &str| match k {
        "qk" => Some(KeySource::Cat(vec![("a.q".into(), 4), ("a.k".into(), 4)])),
        _ => Some(KeySource::Key(k.to_string())),
    }))?;
    assert_eq!(vb.source_keys(), ["a.k", "a.q", "b.w", "c"]);
    assert_eq!(vb.shape_of("qk"), Some(vec![8, 3]));
    // A zero-stride view of one zero, not (8, 3) values.
    let qk = vb.get((8, 3), "qk")?;
    assert_eq!(qk.dims(), [8, 3]);
    assert_eq!(qk.layout().strides(), [0, 0]);
    assert_eq!(v(&qk), vec![0.0; 24]);
    param_err(
        &vb.get(3, "b.w").unwrap_err(),
        "b.w",
        &["expected shape", "[2]"],
    );
    param_err(
        &vb.get(1, "d").unwrap_err(),
        "d",
        &["missing", "shapes given"],
    );
    // b.w failed its check, so it counts as unread with c.
    assert_eq!(vb.unused_keys()?, ["b.w", "c"]);
    Ok(())
}

#[test]
fn varbuilder_random_is_seeded_per_key() -> R {
    let a = VarBuilder::random(7, 0.5, DType::F32, &CPU);
    let b = VarBuilder::random(7, 0.5, DType::F32, &CPU);
    let (a1, a2) = (a.get((64, 32), "x.weight")?, a.get(5, "y.bias")?);
    // Built in the other order, the same keys give the same values.
    let (b2, b1) = (b.get(5, "y.bias")?, b.get((64, 32), "x.weight")?);
    assert_eq!(v(&a1), v(&b1));
    assert_eq!(v(&a2), v(&b2));
    let other = VarBuilder::random(8, 0.5, DType::F32, &CPU).get((64, 32), "x.weight")?;
    assert_ne!(v(&a1), v(&other));
    let x = v(&a1);
    let var = x.iter().map(|x| x * x).sum::<f64>() / x.len() as f64;
    assert!((var.sqrt() - 0.5).abs() < 0.05, "std {}", var.sqrt());
    assert!(!a.contains("x.weight"));
    assert!(a.unused_keys()?.is_empty());
    Ok(())
}

/// `split_qkv_rest` cuts a single-stream block's fused projection into q, k, v and the rest as
/// `split_qkv` of the first 3 D channels and a narrow of the others do, and the gradients
/// they give back to the projection are the same bit for bit, whether the rest's width is a
/// multiple of the head width (one view of four slices) or not (the two-level cut).
#[test]
fn split_qkv_rest_equals_the_two_level_cut() -> R {
    use flame::nn::{split_qkv, split_qkv_rest};
    let (heads, d) = (2, 8);
    for rest in [12, 7] {
        let x = randn((2, 5, 3 * d + rest), 91 + rest as u64).requires_grad_()?;
        let (q, k, vt, r) = split_qkv_rest(&x, heads, d)?;
        let (q2, k2, v2) = split_qkv(&x.narrow(2, 0, 3 * d)?, heads)?;
        let r2 = x.narrow(2, 3 * d, rest)?;
        for (a, b) in [(&q, &q2), (&k, &k2), (&vt, &v2), (&r, &r2)] {
            assert_eq!(a.dims(), b.dims());
            assert_eq!(v(a), v(b));
        }
        // A loss that weighs each part differently, so a part's gradient landing in another's
        // place would show.
        let loss = |q: &Tensor, k: &Tensor, vt: &Tensor, r: &Tensor| -> Result<Tensor> {
            let mut total = r.sqr()?.sum_all()?;
            for (t, s) in [(q, 2.0), (k, -3.0), (vt, 0.5)] {
                total = total.add(&t.sqr()?.affine(s, 0.0)?.sum_all()?)?;
            }
            Ok(total)
        };
        let g = loss(&q, &k, &vt, &r)?.backward()?;
        let g2 = loss(&q2, &k2, &v2, &r2)?.backward()?;
        assert_eq!(v(g.get(&x).unwrap()), v(g2.get(&x).unwrap()), "rest {rest}");
    }
    // Shapes it cannot cut are refused.
    let x = randn((2, 5, 20), 3);
    assert!(split_qkv_rest(&x, 2, 8).is_err(), "narrower than 3 D");
    assert!(
        split_qkv_rest(&x, 3, 4).is_err(),
        "D not a multiple of the heads"
    );
    Ok(())
}
