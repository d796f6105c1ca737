//! 8-bit products (`model.compute = "fp8"`): the row quantization of activations against its
//! definition (and within a code of the loader's quantizer), the code transpose, the scaled FP8 product against its definition
//! in f64, a Linear with 8-bit products against the same layer decoding its weight (output,
//! input gradient and LoRA gradients within stated bounds), its backward against the
//! 8-bit formula computed by hand, and (ignored unless on a GPU) every CUDA kernel against
//! the CPU: the quantization and transpose bit for bit, the product within f32 summation
//! order, at odd sizes (the plain kernel) and tensor-core sizes (cuBLASLt).
#![cfg(feature = "cpu-ref")]

#[path = "common/eight_bit.rs"]
mod eight_bit;
use eight_bit::{lcg, lora_linear};
use flame::backend::fp8;
use flame::nn::{Linear, VarBuilder};
use flame::{fp8_product, DType, Device, Tensor};
use std::collections::HashMap;

const CPU: Device = Device::Cpu;

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

fn u32s(t: &Tensor) -> Vec<u32> {
    t.to_vec::<u32>().unwrap()
}

/// Decoded codes (rows, cols) times their row scales, in f64.
fn decoded(codes: &[u32], scales: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|i| {
            let c = fp8::unpack(codes[i / 4], i % 4);
            f64::from(fp8::decode(c)) * f64::from(scales[i / cols])
        })
        .collect()
}

/// The activations' row quantization by its definition (`Tensor::quant_rows_fp8`): `s =
/// absmax / 448` (`fp8::row_scale`), `r = 1 / s` once a row, `code = e4m3(v * r)`.
fn quant_rows_ref(x: &[f32], rows: usize, cols: usize) -> (Vec<u32>, Vec<f32>) {
    let mut codes = vec![];
    let mut scales = vec![];
    for row in x.chunks(cols).take(rows) {
        let s = fp8::row_scale(row.iter().fold(0f32, |m, v| m.max(v.abs())));
        let r = 1.0 / s;
        codes.extend(
            row.chunks(4)
                .map(|w| fp8::pack(w.iter().map(|v| fp8::encode(v * r)))),
        );
        scales.push(s);
    }
    (codes, scales)
}

#[test]
fn row_quantization_is_its_definition() {
    let (rows, cols) = (7, 20);
    let x = lcg(rows * cols, 1, 3.0);
    let col = lcg(cols, 2, 1.0);
    let xt = Tensor::from_vec(x.clone(), (rows, cols), &CPU).unwrap();
    let (c, s) = xt.quant_rows_fp8(None).unwrap();
    let (want_c, want_s) = quant_rows_ref(&x, rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert_eq!(f32s(&s), want_s);
    // A column factor is applied (an f32 product) before the rows are quantized.
    let colt = Tensor::from_vec(col.clone(), cols, &CPU).unwrap();
    let (c, s) = xt.quant_rows_fp8(Some(&colt)).unwrap();
    let scaled: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| v * col[i % cols])
        .collect();
    let (want_c, want_s) = quant_rows_ref(&scaled, rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert_eq!(f32s(&s), want_s);
    // bf16 input: the same as its f32 values; a zero row keeps scale 1.
    let mut z = x.clone();
    z[..cols].iter_mut().for_each(|v| *v = 0.0);
    let zt = Tensor::from_vec(z.clone(), (rows, cols), &CPU)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let (c, s) = zt.quant_rows_fp8(None).unwrap();
    let back = f32s(&zt);
    let (want_c, want_s) = quant_rows_ref(&back, rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert_eq!(f32s(&s), want_s);
    assert_eq!(f32s(&s)[0], 1.0);
    // Against the loader's quantizer (`e4m3(v / s)`): the same scales, and codes equal or
    // one step apart (v * r and v / s differ by at most an f32 rounding), most of them equal.
    let many = lcg(64 * 256, 21, 5.0);
    let mt = Tensor::from_vec(many.clone(), (64, 256), &CPU).unwrap();
    let (c, s) = mt.quant_rows_fp8(None).unwrap();
    let (div_c, div_s) = fp8::quantize_rows(&many, 64, 256).unwrap();
    assert_eq!(f32s(&s), div_s);
    let (got, want) = (u32s(&c), div_c);
    let mut same = 0;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        for j in 0..4 {
            let (a, b) = (fp8::unpack(*g, j), fp8::unpack(*w, j));
            assert!(
                a == b || (a & 0x80 == b & 0x80 && (a & 0x7F).abs_diff(b & 0x7F) == 1),
                "code {}: {a:#x} vs {b:#x}",
                4 * i + j
            );
            same += usize::from(a == b);
        }
    }
    assert!(
        same * 100 >= 99 * many.len(),
        "{same} of {} equal",
        many.len()
    );
    // Bad operands are errors.
    let odd = Tensor::zeros((2, 6), DType::F32, &CPU).unwrap();
    assert!(
        odd.quant_rows_fp8(None).is_err(),
        "width not a multiple of 4"
    );
    let wrong = Tensor::zeros(cols + 4, DType::F32, &CPU).unwrap();
    assert!(
        xt.quant_rows_fp8(Some(&wrong)).is_err(),
        "column factor length"
    );
    let f64x = xt.to_dtype(DType::F64).unwrap();
    assert!(f64x.quant_rows_fp8(None).is_err(), "f64 activations");
}

#[test]
fn transpose_moves_every_code() {
    let (rows, cols) = (12, 8);
    let x = lcg(rows * cols, 3, 1.0);
    let (c, s) = fp8::quantize_rows(&x, rows, cols).unwrap();
    let ct = Tensor::from_vec(c.clone(), (rows, cols / 4), &CPU).unwrap();
    let t = ct.transpose_fp8().unwrap();
    assert_eq!(t.dims(), [cols, rows / 4]);
    let tw = u32s(&t);
    for r in 0..rows {
        for k in 0..cols {
            let a = fp8::unpack(c[r * cols / 4 + k / 4], k % 4);
            let b = fp8::unpack(tw[k * rows / 4 + r / 4], r % 4);
            assert_eq!(a, b, "({r}, {k})");
        }
    }
    assert_eq!(
        u32s(&t.transpose_fp8().unwrap()),
        c,
        "twice is the identity"
    );
    let _ = s;
    let bad = Tensor::zeros((6, 2), DType::U32, &CPU).unwrap();
    assert!(bad.transpose_fp8().is_err(), "rows not a multiple of 4");
}

#[test]
fn product_is_its_definition() {
    let (m, n, k) = (5, 9, 24);
    let a = lcg(m * k, 4, 2.0);
    let b = lcg(n * k, 5, 0.5);
    let (ac, asc) = fp8::quantize_rows(&a, m, k).unwrap();
    let (bc, bsc) = fp8::quantize_rows(&b, n, k).unwrap();
    let (ad, bd) = (decoded(&ac, &asc, m, k), decoded(&bc, &bsc, n, k));
    let t = |v: Vec<u32>, r: usize| Tensor::from_vec(v, (r, k / 4), &CPU).unwrap();
    let s = |v: Vec<f32>| Tensor::from_vec(v.clone(), v.len(), &CPU).unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let y = fp8_product(
            &t(ac.clone(), m),
            &s(asc.clone()),
            &t(bc.clone(), n),
            &s(bsc.clone()),
            dt,
        )
        .unwrap();
        assert_eq!(y.dims(), [m, n]);
        assert_eq!(y.dtype(), dt);
        let got = f32s(&y);
        // f32 accumulation, then one rounding to the output dtype.
        let tol = match dt {
            DType::F32 => 1e-5,
            DType::BF16 => 8e-3,
            _ => 1e-3,
        };
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|q| ad[i * k + q] * bd[j * k + q]).sum();
                let g = f64::from(got[i * n + j]);
                let scale: f64 = (0..k).map(|q| (ad[i * k + q] * bd[j * k + q]).abs()).sum();
                assert!(
                    (g - want).abs() <= tol * scale.max(1e-6),
                    "{dt} ({i}, {j}): {g} vs {want}"
                );
            }
        }
    }
    let z = Tensor::zeros((2, 3), DType::U32, &CPU).unwrap();
    let one = Tensor::ones(2, DType::F32, &CPU).unwrap();
    let other = Tensor::zeros((2, 4), DType::U32, &CPU).unwrap();
    assert!(
        fp8_product(&z, &one, &other, &one, DType::F32).is_err(),
        "k differs"
    );
    assert!(
        fp8_product(&z, &one, &z, &one, DType::F64).is_err(),
        "f64 output"
    );
}

/// A Linear built from `w` (out, in) + bias with a rank-2 LoRA, its weight FP8 and its
/// products in 8 bits or not.
fn linear(w: &[f32], b: &[f32], out: usize, inp: usize, products: bool, dev: &Device) -> Linear {
    lora_linear(w, b, (out, inp), dev, |vb| {
        vb.with_fp8(true)?.with_fp8_products(products)
    })
}

struct Run {
    y: Vec<f32>,
    dx: Vec<f32>,
    da: Vec<f32>,
    db: Vec<f32>,
}

fn run(l: &Linear, x: &[f32], r: &[f32], rows: usize, dev: &Device) -> Run {
    let (inp, out) = l.dims();
    let xt = Tensor::from_vec(x.to_vec(), (rows, inp), dev)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let y = l.forward(&xt).unwrap();
    let rt = Tensor::from_vec(r.to_vec(), (rows, out), dev).unwrap();
    let grads = y.mul(&rt).unwrap().sum_all().unwrap().backward().unwrap();
    let p = l.adapter.as_ref().unwrap().params();
    Run {
        y: f32s(&y),
        dx: f32s(grads.get(&xt).unwrap()),
        da: f32s(grads.get(&p[0].1).unwrap()),
        db: f32s(grads.get(&p[1].1).unwrap()),
    }
}

/// The largest difference relative to the largest magnitude of `want`.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()))
        / max.max(1e-12)
}

#[test]
fn linear_with_8_bit_products_stays_near_the_decoded_layer() {
    let (out, inp, rows) = (32, 48, 6);
    let w = lcg(out * inp, 6, 0.3);
    let b = lcg(out, 7, 0.1);
    let x = lcg(rows * inp, 8, 1.0);
    let r = lcg(rows * out, 9, 1.0);
    let q = linear(&w, &b, out, inp, true, &CPU);
    assert!(matches!(
        q.packing,
        Some(flame::nn::Packing::Fp8 { products: true, .. })
    ));
    let d = linear(&w, &b, out, inp, false, &CPU);
    let (a, bb) = (run(&q, &x, &r, rows, &CPU), run(&d, &x, &r, rows, &CPU));
    // E4M3 keeps 3 mantissa bits: each quantized operand is within 2^-4 relative of its value,
    // and a sum of products of errors this size stays within a few percent of the largest
    // output.
    for (what, e) in [
        ("y", rel(&a.y, &bb.y)),
        ("dx", rel(&a.dx, &bb.dx)),
        ("lora A grad", rel(&a.da, &bb.da)),
        ("lora B grad", rel(&a.db, &bb.db)),
    ] {
        assert!(e < 0.06, "{what}: relative error {e}");
    }
    // The base product itself changed: the activations were quantized too.
    assert!(rel(&a.y, &bb.y) > 0.0 && rel(&a.dx, &bb.dx) > 0.0);
    // Widths FP8 tensor cores do not take (not multiples of 16) decode instead, exactly.
    let (o2, i2) = (12, 20);
    let w2 = lcg(o2 * i2, 10, 0.3);
    let b2 = lcg(o2, 11, 0.1);
    let x2 = lcg(rows * i2, 12, 1.0);
    let r2 = lcg(rows * o2, 13, 1.0);
    let q2 = run(&linear(&w2, &b2, o2, i2, true, &CPU), &x2, &r2, rows, &CPU);
    let d2 = run(&linear(&w2, &b2, o2, i2, false, &CPU), &x2, &r2, rows, &CPU);
    assert_eq!(q2.y, d2.y);
    assert_eq!(q2.dx, d2.dx);
}

#[test]
fn backward_is_the_8_bit_formula() {
    // dx = quant_rows(dy * s_w) @ Q_w, computed here from the format's pieces alone.
    let (out, inp, rows) = (16, 32, 5);
    let w = lcg(out * inp, 14, 0.4);
    let x = lcg(rows * inp, 15, 1.0);
    let r = lcg(rows * out, 16, 1.0);
    let l = linear(&w, &[0.0; 16], out, inp, true, &CPU);
    let got = run(&l, &x, &r, rows, &CPU);
    let (wc, ws) = fp8::quantize_rows(&w, out, inp).unwrap();
    let g: Vec<f32> = r.iter().enumerate().map(|(i, v)| v * ws[i % out]).collect();
    let (gc, gs) = quant_rows_ref(&g, rows, out);
    let gd = decoded(&gc, &gs, rows, out);
    let wd = decoded(&wc, &vec![1.0; out], out, inp);
    // The LoRA's own input gradient (B is zero at the start) adds nothing.
    for i in 0..rows {
        for k in 0..inp {
            let want: f64 = (0..out).map(|n| gd[i * out + n] * wd[n * inp + k]).sum();
            let g = f64::from(got.dx[i * inp + k]);
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                "({i}, {k}): {g} vs {want}"
            );
        }
    }
    // And the forward: y = quant_rows(x) @ Q_w^T scaled (+ bias 0, LoRA 0 at the start).
    let (xc, xs) = quant_rows_ref(&x, rows, inp);
    let xd = decoded(&xc, &xs, rows, inp);
    let wsd = decoded(&wc, &ws, out, inp);
    for i in 0..rows {
        for n in 0..out {
            let want: f64 = (0..inp).map(|k| xd[i * inp + k] * wsd[n * inp + k]).sum();
            let g = f64::from(got.y[i * out + n]);
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                "y ({i}, {n}): {g} vs {want}"
            );
        }
    }
}

/// The weights' keeper of a streamed block, as far as the loader sees it: it takes every key
/// (here keeping the tensor as its own handle).
struct TakesEvery(Device);

impl flame::nn::HostWeights for TakesEvery {
    fn device(&self) -> &Device {
        &self.0
    }
    fn place(&self, _key: &str, t: &Tensor) -> flame::Result<Option<Tensor>> {
        Ok(Some(t.clone()))
    }
}

/// A bias-free Linear (out, in) with FP8 weights and 8-bit products, its weight resident or
/// taken by a host keeper (streamed).
fn bare_linear(w: &[f32], out: usize, inp: usize, streamed: bool, dev: &Device) -> Linear {
    bare_linear_keeping(w, (out, inp), streamed, true, dev)
}

/// `bare_linear` from a builder that keeps transposes or not (`with_kept_transposes`).
fn bare_linear_keeping(
    w: &[f32],
    (out, inp): (usize, usize),
    streamed: bool,
    keeps: bool,
    dev: &Device,
) -> Linear {
    let mut t = HashMap::new();
    t.insert(
        "l.weight".to_string(),
        Tensor::from_vec(w.to_vec(), (out, inp), &CPU).unwrap(),
    );
    let mut vb = VarBuilder::from_tensors(t, DType::F32, dev)
        .with_fp8_products(true)
        .unwrap()
        .with_kept_transposes(keeps)
        .unwrap();
    if streamed {
        vb = vb
            .with_host_weights(std::sync::Arc::new(TakesEvery(dev.clone())))
            .unwrap();
    }
    Linear::new(&vb.pp("l"), inp, out, false).unwrap()
}

/// dx of `l` at x for the output weights r (one backward).
fn dx_of(l: &Linear, x: &[f32], r: &[f32], rows: usize, dev: &Device) -> Vec<f32> {
    let (inp, out) = l.dims();
    let xt = Tensor::from_vec(x.to_vec(), (rows, inp), dev)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let y = l.forward(&xt).unwrap();
    let rt = Tensor::from_vec(r.to_vec(), (rows, out), dev).unwrap();
    let grads = y.mul(&rt).unwrap().sum_all().unwrap().backward().unwrap();
    f32s(grads.get(&xt).unwrap())
}

fn kept(l: &Linear) -> &flame::nn::Fp8Kept {
    match &l.packing {
        Some(flame::nn::Packing::Fp8 { kept, .. }) => kept,
        other => panic!("not an FP8 packing: {other:?}"),
    }
}

/// A resident weight's backward keeps its transposed codes from the first call (the codes'
/// own transpose, the same tensor at the next call) and gives the same dx every time; a
/// streamed weight, or a resident one whose plan remakes transposes, keeps none and gives the
/// same dx as the resident one.
fn check_kept_transpose(dev: &Device) {
    let (out, inp, rows) = (48, 32, 7);
    let w = lcg(out * inp, 22, 0.5);
    let x = lcg(rows * inp, 23, 1.0);
    let r = lcg(rows * out, 24, 1.0);
    let res = bare_linear(&w, out, inp, false, dev);
    assert!(kept(&res).keeps_transpose());
    assert!(
        kept(&res).kept_transpose().is_none(),
        "made at the first backward"
    );
    let first = dx_of(&res, &x, &r, rows, dev);
    let t = kept(&res).kept_transpose().expect("kept").clone();
    assert_eq!(t.dims(), [inp, out / 4]);
    assert_eq!(u32s(&t), u32s(&res.weight.transpose_fp8().unwrap()));
    let second = dx_of(&res, &x, &r, rows, dev);
    assert_eq!(first, second, "two backwards through one weight");
    assert_eq!(kept(&res).kept_transpose().map(Tensor::id), Some(t.id()));
    // A clone of the layer shares what is kept.
    let clone = res.clone();
    assert_eq!(kept(&clone).kept_transpose().map(Tensor::id), Some(t.id()));

    let st = bare_linear(&w, out, inp, true, dev);
    assert!(!kept(&st).keeps_transpose());
    let streamed = dx_of(&st, &x, &r, rows, dev);
    assert!(
        kept(&st).kept_transpose().is_none(),
        "nothing kept for a streamed weight"
    );
    assert_eq!(streamed, first);

    // A resident weight from a builder told to remake its transposes
    // (`Plan::remake_transposes`) keeps none either, and gives the same dx.
    let remade = bare_linear_keeping(&w, (out, inp), false, false, dev);
    assert!(!kept(&remade).keeps_transpose());
    assert_eq!(dx_of(&remade, &x, &r, rows, dev), first);
    assert!(kept(&remade).kept_transpose().is_none());
}

#[test]
fn resident_weights_keep_their_transposed_codes() {
    check_kept_transpose(&CPU);
}

/// The planner counts the kept transposes: with 8-bit products every Flux-dev block keeps as
/// many bytes as its FP8 codes (all its Linears' widths are multiples of 16), and nothing
/// with FP8 weights decoded for bf16 products.
#[test]
fn planner_counts_kept_transposes() {
    use flame::models::flux::{Flux, FluxConfig};
    use flame::models::{profile_config, LoadOptions, RunShape};
    let run = RunShape {
        sample: vec![vec![16, 128, 128], vec![512, 4096], vec![768]],
        batch: 1,
        optimizer_bytes_per_value: 8.0,
    };
    let profile = |products: bool| {
        let mut opts = LoadOptions::new(DType::BF16, &CPU);
        opts.fp8 = true;
        opts.products = products.then_some(flame::backend::fp8::Code8::E4m3);
        profile_config::<Flux>(&FluxConfig::dev(), &opts, &run).unwrap()
    };
    let (decoded, eight) = (profile(false), profile(true));
    assert!(decoded.blocks.iter().all(|b| b.kept_bytes == 0));
    for b in &eight.blocks {
        // The codes multiplied in 8 bits, never decoded, and kept transposed beside them.
        assert!(b.product_bytes > 0 && b.decode_bytes == 0, "{}", b.prefix);
        assert_eq!(b.kept_bytes, b.product_bytes, "{}", b.prefix);
    }
    let resident = flame::memory::Plan::default();
    let kept: u64 = eight.blocks.iter().map(|b| b.kept_bytes).sum();
    let outside = eight.other_kept_bytes;
    assert_eq!(eight.other_weight_bytes, decoded.other_weight_bytes);
    assert!(
        outside > 0 && decoded.other_kept_bytes == 0,
        "the Linears outside the blocks keep theirs too"
    );
    assert_eq!(
        eight.peak(&resident),
        decoded.peak(&resident) + kept + outside
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::eight_bit::cuda;
    use super::*;

    /// Quantization and transpose equal the CPU's bits; the product equals the CPU's within
    /// the tensor cores' summation (bounds below), at odd sizes (the plain kernel), at sizes the
    /// tensor cores take (cuBLASLt with its scale vectors) and at Flux's widths.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_8_bit_products_equal_cpu() {
        let Some(dev) = cuda() else { return };
        for (m, n, k) in [
            (1, 4, 4),
            (7, 12, 20),
            (33, 40, 48),
            (64, 64, 64),
            (77, 128, 96),
            (300, 3072, 3072),
            (257, 64, 3072),
        ] {
            let a = lcg(m * k, m as u64, 3.0);
            let b = lcg(n * k, n as u64 + 1, 0.2);
            let col = lcg(k, 5, 1.0);
            let mut outs = vec![];
            for d in [CPU, dev.clone()] {
                let at = Tensor::from_vec(a.clone(), (m, k), &d).unwrap();
                let bt = Tensor::from_vec(b.clone(), (n, k), &d).unwrap();
                let ct = Tensor::from_vec(col.clone(), k, &d).unwrap();
                let mut quant = vec![];
                for dt in [DType::F32, DType::BF16, DType::F16] {
                    // The half values are made once, on the CPU, and copied: the two backends'
                    // own conversions are not what is compared here.
                    let half = Tensor::from_vec(a.clone(), (m, k), &CPU)
                        .unwrap()
                        .to_dtype(dt)
                        .unwrap()
                        .to_device(&d)
                        .unwrap();
                    let (qc, qs) = half.quant_rows_fp8(None).unwrap();
                    let (cc, cs) = half.quant_rows_fp8(Some(&ct)).unwrap();
                    quant.push((u32s(&qc), f32s(&qs), u32s(&cc), f32s(&cs)));
                }
                let (ac, asc) = at.quant_rows_fp8(None).unwrap();
                let (bc, bsc) = bt.quant_rows_fp8(None).unwrap();
                let tr = if m % 4 == 0 {
                    Some(u32s(&ac.transpose_fp8().unwrap()))
                } else {
                    None
                };
                let mut prods = vec![];
                for dt in [DType::F32, DType::BF16, DType::F16] {
                    prods.push(f32s(&fp8_product(&ac, &asc, &bc, &bsc, dt).unwrap()));
                }
                outs.push((quant, tr, prods));
            }
            let (cpu, gpu) = (&outs[0], &outs[1]);
            assert_eq!(cpu.0, gpu.0, "({m}, {k}) quantization");
            assert_eq!(cpu.1, gpu.1, "({m}, {k}) transpose");
            // FP8 tensor cores sum in less than f32's precision between cuBLASLt's promotions
            // to f32 (DeepSeek-V3 technical report, 2024, section 3.3.2: about 14 bits on
            // Hopper), so the f32 output is held to 5e-3 of the largest value, not f32
            // rounding; the half outputs add their own rounding.
            for (i, tol) in [5e-3f32, 1e-2, 5e-3].into_iter().enumerate() {
                let e = rel(&gpu.2[i], &cpu.2[i]);
                println!("({m}, {n}, {k}) product {i}: relative {e:.2e}");
                assert!(e <= tol, "({m}, {n}, {k}) product {i}: relative {e}");
            }
        }
    }

    /// The row quantization equals the CPU's bits at every form of the kernel: 16-byte chunks
    /// (f32, halves of widths a multiple of 8), 8-byte chunks (halves of widths 4 mod 8),
    /// several rows a block with a partial last block (narrow rows, odd row counts), a row a
    /// block, and rows wider than the registers hold (read twice: above 2048 chunks), with
    /// and without a column factor; an all-zero row and values past E4M3's range too.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_row_quantization_equals_cpu_at_every_form() {
        let Some(dev) = cuda() else { return };
        for (rows, cols) in [
            (1, 4),
            (3, 12),
            (77, 4),
            (5, 36),
            (300, 64),
            (33, 20),
            (9, 1000),
            (17, 2052),
            (7, 3072),
            (3, 12_292),
            (3, 33_004),
            (2, 40_000),
        ] {
            let mut x = lcg(rows * cols, (rows * cols) as u64, 3.0);
            x[..cols].iter_mut().for_each(|v| *v = 0.0);
            if rows > 1 {
                // Past 448 after scaling by the column factor.
                x[cols] = 5e4;
            }
            let col = lcg(cols, 7, 2.0);
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let mut outs = vec![];
                for d in [CPU, dev.clone()] {
                    let xt = Tensor::from_vec(x.clone(), (rows, cols), &CPU)
                        .unwrap()
                        .to_dtype(dt)
                        .unwrap()
                        .to_device(&d)
                        .unwrap();
                    let ct = Tensor::from_vec(col.clone(), cols, &d).unwrap();
                    let (qc, qs) = xt.quant_rows_fp8(None).unwrap();
                    let (cc, cs) = xt.quant_rows_fp8(Some(&ct)).unwrap();
                    outs.push((u32s(&qc), f32s(&qs), u32s(&cc), f32s(&cs)));
                }
                assert_eq!(outs[0].1, outs[1].1, "({rows}, {cols}) {dt} scales");
                assert_eq!(outs[0].0, outs[1].0, "({rows}, {cols}) {dt} codes");
                assert_eq!(
                    outs[0].3, outs[1].3,
                    "({rows}, {cols}) {dt} scales, columns"
                );
                assert_eq!(outs[0].2, outs[1].2, "({rows}, {cols}) {dt} codes, columns");
            }
        }
    }

    /// The encode at every code's value, the midpoints between neighbouring codes (ties to
    /// even) and the f32 values either side of them, subnormal codes, values below the
    /// smallest code, zeros of both signs, both signs of everything, NaN and infinities: rows
    /// whose largest magnitude is 448 (an infinity's row: scale 1 too), so each code is
    /// `fp8::encode(v)` itself, on the CPU and bit for bit on CUDA (on Hopper the hardware's
    /// conversion).
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_encode_equals_cpu_at_every_code_and_midpoint() {
        let Some(dev) = cuda() else { return };
        let next = |v: f32, up: bool| {
            let b = v.to_bits();
            f32::from_bits(if up { b + 1 } else { b - 1 })
        };
        let mut vals = vec![
            0.0f32,
            1e-30,
            1e-40,
            2f32.powi(-10),
            3.0 * 2f32.powi(-11),
            448.0,
        ];
        for c in 0..0x7Eu8 {
            let (lo, hi) = (fp8::decode(c), fp8::decode(c + 1));
            let mid = (lo + hi) / 2.0;
            vals.extend([lo, mid, next(mid, true), next(mid, false)]);
        }
        let mut all: Vec<f32> = vals.iter().flat_map(|&v| [v, -v]).collect();
        all.push(f32::NAN);
        let cols = 256;
        let per_row = cols - 1;
        let rows = all.len().div_ceil(per_row) + 1;
        let mut x = vec![0.0f32; rows * cols];
        for (r, chunk) in all.chunks(per_row).enumerate() {
            x[r * cols] = 448.0;
            x[r * cols + 1..r * cols + 1 + chunk.len()].copy_from_slice(chunk);
        }
        // The last row: infinities saturate, its scale is 1 (a non-finite maximum).
        let last = (rows - 1) * cols;
        x[last..last + 4].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, 1.0, -3.5]);
        let mut outs = vec![];
        for d in [CPU, dev.clone()] {
            let xt = Tensor::from_vec(x.clone(), (rows, cols), &d).unwrap();
            let (c, s) = xt.quant_rows_fp8(None).unwrap();
            outs.push((u32s(&c), f32s(&s)));
        }
        let (cpu, gpu) = (&outs[0], &outs[1]);
        assert!(cpu.1.iter().all(|&s| s == 1.0), "scale 1 in every row");
        for (i, &v) in x.iter().enumerate() {
            let code = fp8::unpack(cpu.0[i / 4], i % 4);
            assert_eq!(code, fp8::encode(v), "CPU, value {v:e}");
            let g = fp8::unpack(gpu.0[i / 4], i % 4);
            assert_eq!(
                g,
                code,
                "value {v:e} ({:#010x}): CUDA {g:#x}, CPU {code:#x}",
                v.to_bits()
            );
        }
        assert_eq!(cpu.1, gpu.1);
    }

    /// The kept transposed codes on CUDA (`transpose_fp8`'s own, the same dx at each
    /// backward, nothing kept for a streamed weight).
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_resident_weights_keep_their_transposed_codes() {
        let Some(dev) = cuda() else { return };
        check_kept_transpose(&dev);
    }

    /// A Linear with 8-bit products on CUDA (bf16 activations) against the CPU's.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_linear_with_8_bit_products_matches_cpu() {
        let Some(dev) = cuda() else { return };
        let (out, inp, rows) = (96, 128, 40);
        let w = lcg(out * inp, 17, 0.3);
        let b = lcg(out, 18, 0.1);
        let x = lcg(rows * inp, 19, 1.0);
        let r = lcg(rows * out, 20, 1.0);
        let c = run(&linear(&w, &b, out, inp, true, &CPU), &x, &r, rows, &CPU);
        let g = run(&linear(&w, &b, out, inp, true, &dev), &x, &r, rows, &dev);
        for (what, e) in [
            ("y", rel(&g.y, &c.y)),
            ("dx", rel(&g.dx, &c.dx)),
            ("lora A", rel(&g.da, &c.da)),
        ] {
            println!("{what}: relative {e:.2e}");
            // The products' tensor-core sums (see above), through bf16 activations.
            assert!(e < 1e-2, "{what}: relative {e}");
        }
    }
}

/// 8-bit products go where they pay at the run's rows (`VarBuilder::with_product_rows`,
/// `nn::products_pay`): a Linear whose products are large enough, or that sees few rows
/// (reading its weight more than computing), takes FP8 products; a small product over many
/// rows loads as without them (in the model's dtype, or FP8 codes decoded at each use where
/// the weights are stored in FP8); int8 needs larger products; a key the rows do not know
/// keeps them.
#[test]
fn eight_bit_products_go_where_they_pay() {
    use flame::backend::fp8::Code8;
    use flame::nn::{products_pay, Packing, ProductRows};
    let (out, inp) = (32, 64);
    // 32 x 64 = 2048 multiply-adds a row: 12 G at about 5.9 M rows.
    let rows: ProductRows = std::sync::Arc::new(|key: &str| match key {
        "big.weight" => Some(10_000_000),
        "small.weight" => Some(1_000),
        "few.weight" => Some(4),
        _ => None,
    });
    assert!(products_pay(
        Some(&rows),
        "big.weight",
        Code8::E4m3,
        (out, inp)
    ));
    assert!(!products_pay(
        Some(&rows),
        "big.weight",
        Code8::Int8,
        (out, inp)
    ));
    assert!(!products_pay(
        Some(&rows),
        "small.weight",
        Code8::E4m3,
        (out, inp)
    ));
    // 4 rows x 16 <= 64 inputs: few rows.
    assert!(products_pay(
        Some(&rows),
        "few.weight",
        Code8::Int8,
        (out, inp)
    ));
    assert!(products_pay(
        Some(&rows),
        "other.weight",
        Code8::E4m3,
        (out, inp)
    ));
    assert!(products_pay(None, "small.weight", Code8::E4m3, (out, inp)));

    let build = |code: Code8, fp8: bool| {
        let mut t = HashMap::new();
        for k in ["big", "small", "other"] {
            t.insert(
                format!("{k}.weight"),
                Tensor::from_vec(lcg(out * inp, 31, 0.5), (out, inp), &CPU).unwrap(),
            );
        }
        let vb = VarBuilder::from_tensors(t, DType::F32, &CPU)
            .with_fp8(fp8)
            .unwrap()
            .with_products(Some(code))
            .unwrap()
            .with_product_rows(rows.clone())
            .unwrap();
        ["big", "small", "other"].map(|k| Linear::new(&vb.pp(k), inp, out, false).unwrap())
    };
    let products = |l: &Linear| matches!(l.packing, Some(Packing::Fp8 { products: true, .. }));
    let [big, small, other] = build(Code8::E4m3, false);
    assert!(products(&big) && products(&other));
    assert!(small.packing.is_none() && small.weight.dtype() == DType::F32);
    // FP8 storage: the others keep their codes, decoded at each use.
    let [big, small, _] = build(Code8::E4m3, true);
    assert!(products(&big));
    assert!(matches!(
        small.packing,
        Some(Packing::Fp8 {
            products: false,
            code: Code8::E4m3,
            ..
        })
    ));
    // Int8 pays later: not the large one here.
    let [big, _, other] = build(Code8::Int8, false);
    assert!(big.packing.is_none() && products(&other));
}

/// The planner counts what the loader does: with the run's shapes, SDXL's Linears under
/// 12 G multiply-adds a product over many rows (all but its GEGLU projections at 1024²) are
/// sized in bf16, and with int8 products only those over few rows stay 8-bit (the time
/// embedding's, cross-attention's keys and values over 77 tokens);
/// Flux-dev's block Linears all keep their FP8 products.
#[test]
fn the_profile_sizes_products_where_they_pay() {
    use flame::models::flux::{Flux, FluxConfig};
    use flame::models::sdxl::{SdxlConfig, Unet};
    use flame::models::{profile_config, LoadOptions, RunShape};
    let profile = |sdxl: bool, code: Option<flame::backend::fp8::Code8>, with_run: bool| {
        let run = if sdxl {
            RunShape {
                sample: vec![vec![4, 128, 128], vec![77, 2048], vec![1280], vec![6]],
                batch: 1,
                optimizer_bytes_per_value: 8.0,
            }
        } else {
            RunShape {
                sample: vec![vec![16, 128, 128], vec![512, 4096], vec![768]],
                batch: 1,
                optimizer_bytes_per_value: 8.0,
            }
        };
        let mut opts = LoadOptions::new(DType::BF16, &CPU);
        opts.products = code;
        opts.run = with_run.then(|| run.clone());
        if sdxl {
            profile_config::<Unet>(&SdxlConfig::base(), &opts, &run).unwrap()
        } else {
            profile_config::<Flux>(&FluxConfig::dev(), &opts, &run).unwrap()
        }
    };
    let sum = |p: &flame::memory::MemoryProfile| -> (u64, f64, u64) {
        (
            p.blocks.iter().map(|b| b.product_bytes).sum(),
            p.blocks.iter().map(|b| b.product_flops).sum(),
            p.blocks.iter().map(|b| b.weight_bytes).sum(),
        )
    };
    let fp8 = Some(flame::backend::fp8::Code8::E4m3);
    let int8 = Some(flame::backend::fp8::Code8::Int8);
    let (all_bytes, all_flops, all_weights) = sum(&profile(true, fp8, false));
    let (paying_bytes, paying_flops, paying_weights) = sum(&profile(true, fp8, true));
    assert!(
        paying_bytes > 0 && (paying_bytes as f64) < 0.7 * all_bytes as f64,
        "{paying_bytes} of {all_bytes}"
    );
    assert!(paying_flops < all_flops);
    // The Linears left in bf16 hold two bytes a weight, not one.
    assert!(paying_weights > all_weights);
    let (int8_bytes, int8_flops, _) = sum(&profile(true, int8, true));
    assert!(int8_bytes > 0 && int8_bytes < paying_bytes, "{int8_bytes}");
    assert!(int8_flops < paying_flops);
    assert_eq!(
        sum(&profile(false, fp8, true)),
        sum(&profile(false, fp8, false))
    );
}
