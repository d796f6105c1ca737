//! Int8 products (`model.compute = "int8"`): the row quantization of activations against its
//! definition (`backend::int8`: absmax / 127, round to nearest even, +-127, a NaN row's NaN
//! scale), the product against the exact integer sum times the scales, a Linear with int8
//! products against the same layer with its weight decoded (output, input gradient and LoRA
//! gradients within stated bounds), its backward against the int8 formula computed by hand,
//! an FP8 file's weights read for int8 products (decoded, quantized again), and (ignored
//! unless on a GPU) every CUDA kernel against the CPU: quantization and decode bit for bit
//! at every form of the kernels, the product within f32 rounding (the GPU's sums are exact
//! in i32), at odd sizes (the plain kernel) and tensor-core sizes (cuBLASLt).
#![cfg(feature = "cpu-ref")]

#[path = "common/eight_bit.rs"]
mod eight_bit;
use eight_bit::{lcg, lora_linear};
use flame::backend::fp8::{self, Code8};
use flame::backend::int8;
use flame::nn::{Linear, VarBuilder};
use flame::{product8, DType, Device, Tensor};

const CPU: Device = Device::Cpu;
const I8: Code8 = Code8::Int8;

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

fn u32s(t: &Tensor) -> Vec<u32> {
    t.to_vec::<u32>().unwrap()
}

/// The integer codes of packed words, row after row.
fn ints(codes: &[u32]) -> Vec<i32> {
    codes
        .iter()
        .flat_map(|&w| (0..4).map(move |j| i32::from(fp8::unpack(w, j) as i8)))
        .collect()
}

/// The activations' int8 row quantization by its definition: `s = absmax / 127` (a NaN
/// absmax kept), `r = 1 / s` once a row, `code = round_ties_even(v * r)` within +-127.
fn quant_rows_ref(x: &[f32], rows: usize, cols: usize) -> (Vec<u32>, Vec<f32>) {
    let mut codes = vec![];
    let mut scales = vec![];
    for row in x.chunks(cols).take(rows) {
        let m = row.iter().fold(0f32, |m, &v| {
            if m.is_nan() || v.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
        let s = if m == 0.0 {
            1.0
        } else if m.is_finite() {
            m / 127.0
        } else {
            f32::NAN
        };
        let r = 1.0 / s;
        codes.extend(row.chunks(4).map(|w| {
            fp8::pack(w.iter().map(|v| {
                let q = v * r;
                if q.is_nan() {
                    0
                } else {
                    q.round_ties_even().clamp(-127.0, 127.0) as i8 as u8
                }
            }))
        }));
        scales.push(s);
    }
    (codes, scales)
}

/// Equal as bits (NaN scales included).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Equal as bits, or both NaN (a NaN's payload is the arithmetic's, not the format's).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn same_values(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

#[test]
fn int8_row_quantization_is_its_definition() {
    let (rows, cols) = (7, 20);
    let mut x = lcg(rows * cols, 1, 3.0);
    // A zero row (scale 1), a NaN and an infinity in rows of their own (NaN scales).
    x[..cols].iter_mut().for_each(|v| *v = 0.0);
    x[2 * cols + 3] = f32::NAN;
    x[3 * cols + 5] = f32::INFINITY;
    let col = lcg(cols, 2, 1.0);
    let xt = Tensor::from_vec(x.clone(), (rows, cols), &CPU).unwrap();
    let (c, s) = xt.quant_rows8(I8, None).unwrap();
    let (want_c, want_s) = quant_rows_ref(&x, rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert!(same_bits(&f32s(&s), &want_s), "{:?}", f32s(&s));
    let got_s = f32s(&s);
    assert_eq!(got_s[0], 1.0);
    assert!(got_s[2].is_nan() && got_s[3].is_nan());
    assert!(got_s[1].is_finite() && got_s[4].is_finite());
    // Every code within +-127, the row's largest value at +-127.
    let codes = ints(&u32s(&c));
    assert!(codes.iter().all(|c| c.abs() <= 127));
    assert_eq!(
        codes[cols..2 * cols].iter().map(|c| c.abs()).max(),
        Some(127)
    );
    // A column factor is applied (an f32 product) before the rows are quantized.
    let colt = Tensor::from_vec(col.clone(), cols, &CPU).unwrap();
    let (c, s) = xt.quant_rows8(I8, Some(&colt)).unwrap();
    let scaled: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| v * col[i % cols])
        .collect();
    let (want_c, want_s) = quant_rows_ref(&scaled, rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert!(same_bits(&f32s(&s), &want_s));
    // bf16 input: the same as its f32 values.
    let bt = xt.to_dtype(DType::BF16).unwrap();
    let (c, s) = bt.quant_rows8(I8, None).unwrap();
    let (want_c, want_s) = quant_rows_ref(&f32s(&bt), rows, cols);
    assert_eq!(u32s(&c), want_c);
    assert!(same_bits(&f32s(&s), &want_s));
    // The loader's quantizer (`v / s`) agrees on the scales of finite rows.
    let many = lcg(16 * 64, 21, 5.0);
    let (_, div_s) = fp8::quantize_rows_as(I8, &many, 16, 64).unwrap();
    let mt = Tensor::from_vec(many, (16, 64), &CPU).unwrap();
    assert_eq!(f32s(&mt.quant_rows8(I8, None).unwrap().1), div_s);
    // Bad operands are errors.
    let odd = Tensor::zeros((2, 6), DType::F32, &CPU).unwrap();
    assert!(
        odd.quant_rows8(I8, None).is_err(),
        "width not a multiple of 4"
    );
}

#[test]
fn int8_product_is_the_integer_sum_times_the_scales() {
    let (m, n, k) = (5, 9, 24);
    let a = lcg(m * k, 4, 2.0);
    let b = lcg(n * k, 5, 0.5);
    let (ac, asc) = fp8::quantize_rows_as(I8, &a, m, k).unwrap();
    let (bc, bsc) = fp8::quantize_rows_as(I8, &b, n, k).unwrap();
    let (ai, bi) = (ints(&ac), ints(&bc));
    let t = |v: Vec<u32>, r: usize| Tensor::from_vec(v, (r, k / 4), &CPU).unwrap();
    let s = |v: Vec<f32>| Tensor::from_vec(v.clone(), v.len(), &CPU).unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let y = product8(
            I8,
            &t(ac.clone(), m),
            &s(asc.clone()),
            &t(bc.clone(), n),
            &s(bsc.clone()),
            dt,
        )
        .unwrap();
        assert_eq!((y.dims(), y.dtype()), ([m, n].as_slice(), dt));
        let got = f32s(&y);
        // The sum is exact here (k * 127^2 < 2^24); one rounding for each scale and one to
        // the output dtype.
        let tol = match dt {
            DType::F32 => 1e-6,
            DType::BF16 => 8e-3,
            _ => 1e-3,
        };
        for i in 0..m {
            for j in 0..n {
                let sum: i64 = (0..k)
                    .map(|q| i64::from(ai[i * k + q]) * i64::from(bi[j * k + q]))
                    .sum();
                let want = sum as f64 * f64::from(asc[i]) * f64::from(bsc[j]);
                let g = f64::from(got[i * n + j]);
                assert!(
                    (g - want).abs() <= tol * want.abs().max(1e-3),
                    "{dt} ({i}, {j}): {g} vs {want}"
                );
            }
        }
    }
    // The decode: each code times its row's scale.
    let w = t(ac.clone(), m)
        .dequant8(I8, &s(asc.clone()), DType::F32)
        .unwrap();
    let want: Vec<f32> = ai
        .iter()
        .enumerate()
        .map(|(i, &c)| c as f32 * asc[i / k])
        .collect();
    assert_eq!(f32s(&w), want);
    // A bias is added to every row before the one rounding.
    let bias: Vec<f32> = lcg(n, 6, 1.0);
    let bt = Tensor::from_vec(bias.clone(), n, &CPU).unwrap();
    let plain = f32s(
        &product8(
            I8,
            &t(ac.clone(), m),
            &s(asc.clone()),
            &t(bc.clone(), n),
            &s(bsc.clone()),
            DType::F32,
        )
        .unwrap(),
    );
    let with = f32s(
        &flame::product8_bias(
            I8,
            [&t(ac, m), &s(asc), &t(bc, n), &s(bsc)],
            Some(&bt),
            DType::F32,
        )
        .unwrap(),
    );
    for (i, (w, p)) in with.iter().zip(&plain).enumerate() {
        assert_eq!(*w, p + bias[i % n], "element {i}");
    }
}

/// A Linear built from `w` (out, in) + bias with a rank-2 LoRA, its weight stored as int8 codes
/// with int8 products (`products`, plain), or in f32 (the reference).
fn linear(w: &[f32], b: &[f32], out: usize, inp: usize, products: bool, dev: &Device) -> Linear {
    linear_rotated(w, b, out, inp, products, false, dev)
}

/// [`linear`] with the int8 products' rotation on or off.
fn linear_rotated(
    w: &[f32],
    b: &[f32],
    out: usize,
    inp: usize,
    products: bool,
    rotation: bool,
    dev: &Device,
) -> Linear {
    lora_linear(w, b, (out, inp), dev, |vb| match products {
        true => vb.with_products(Some(I8))?.with_int8_rotation(rotation),
        false => Ok(vb),
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
fn linear_with_int8_products_stays_near_the_f32_layer() {
    let (out, inp, rows) = (32, 48, 6);
    let w = lcg(out * inp, 6, 0.3);
    let b = lcg(out, 7, 0.1);
    let x = lcg(rows * inp, 8, 1.0);
    let r = lcg(rows * out, 9, 1.0);
    let q = linear(&w, &b, out, inp, true, &CPU);
    assert!(matches!(
        q.packing,
        Some(flame::nn::Packing::Fp8 {
            products: true,
            code: Code8::Int8,
            ..
        })
    ));
    assert_eq!(q.packing.as_ref().unwrap().name(), "int8");
    let d = linear(&w, &b, out, inp, false, &CPU);
    assert!(d.packing.is_none());
    let (a, bb) = (run(&q, &x, &r, rows, &CPU), run(&d, &x, &r, rows, &CPU));
    // Each int8 operand is within half a step (1/254 of its row's largest value) of its
    // value; a sum of products of errors this size stays within a few percent of the largest
    // output (E4M3's 3 mantissa bits give 6%).
    for (what, e) in [
        ("y", rel(&a.y, &bb.y)),
        ("dx", rel(&a.dx, &bb.dx)),
        ("lora A grad", rel(&a.da, &bb.da)),
        ("lora B grad", rel(&a.db, &bb.db)),
    ] {
        println!("{what}: relative {e:.2e}");
        assert!(e < 0.03, "{what}: relative {e}");
    }
    assert!(rel(&a.y, &bb.y) > 0.0 && rel(&a.dx, &bb.dx) > 0.0);
    // Widths the tensor cores do not take (not multiples of 16) decode the int8 weight for
    // an f32 product instead: exactly the decoded weight's product.
    let (o2, i2) = (12, 20);
    let w2 = lcg(o2 * i2, 10, 0.3);
    let x2 = lcg(rows * i2, 12, 1.0);
    let l2 = linear(&w2, &[0.0; 12], o2, i2, true, &CPU);
    let (wc, ws) = fp8::quantize_rows_as(I8, &w2, o2, i2).unwrap();
    let wd: Vec<f32> = ints(&wc)
        .iter()
        .enumerate()
        .map(|(i, &c)| c as f32 * ws[i / i2])
        .collect();
    let xt = Tensor::from_vec(x2.clone(), (rows, i2), &CPU).unwrap();
    let want = xt
        .matmul(&Tensor::from_vec(wd, (o2, i2), &CPU).unwrap().t().unwrap())
        .unwrap();
    let got = l2.forward(&xt).unwrap();
    // The LoRA's B starts at zero: its branch adds nothing.
    assert_eq!(f32s(&got), f32s(&want));
}

#[test]
fn int8_backward_is_the_8_bit_formula() {
    // dx = quant_rows(dy * s_w) @ Q_w, computed here from the format's pieces alone.
    let (out, inp, rows) = (16, 32, 5);
    let w = lcg(out * inp, 14, 0.4);
    let x = lcg(rows * inp, 15, 1.0);
    let r = lcg(rows * out, 16, 1.0);
    let l = linear(&w, &[0.0; 16], out, inp, true, &CPU);
    let got = run(&l, &x, &r, rows, &CPU);
    let (wc, ws) = fp8::quantize_rows_as(I8, &w, out, inp).unwrap();
    let wi = ints(&wc);
    // dy = r (the loss is sum(y * r)); the LoRA's B is zero, so only the base contributes.
    let folded: Vec<f32> = r.iter().enumerate().map(|(i, v)| v * ws[i % out]).collect();
    let (gc, gs) = quant_rows_ref(&folded, rows, out);
    let gi = ints(&gc);
    for i in 0..rows {
        for j in 0..inp {
            let sum: i64 = (0..out)
                .map(|o| i64::from(gi[i * out + o]) * i64::from(wi[o * inp + j]))
                .sum();
            let want = sum as f32 * gs[i];
            let g = got.dx[i * inp + j];
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "({i}, {j}): {g} vs {want}"
            );
        }
    }
}

#[test]
fn the_rotation_is_its_definition_and_its_own_inverse() {
    let (rows, cols) = (5, 96);
    let x = lcg(rows * cols, 40, 2.0);
    let xt = Tensor::from_vec(x.clone(), (rows, cols), &CPU).unwrap();
    for block in [2, 16, 32] {
        let mut want = x.clone();
        int8::rotate_blocks(&mut want, block);
        let got = xt.hadamard_rows(block).unwrap();
        assert_eq!(f32s(&got), want, "block {block}");
        let back = f32s(&got.hadamard_rows(block).unwrap());
        assert!(rel(&back, &x) < 1e-6, "block {block}");
    }
    // bf16: the same f32 sums, rounded once.
    let bt = xt.to_dtype(DType::BF16).unwrap();
    let mut want = f32s(&bt);
    int8::rotate_blocks(&mut want, 32);
    let want = Tensor::from_vec(want, (rows, cols), &CPU)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert_eq!(f32s(&bt.hadamard_rows(32).unwrap()), f32s(&want));
    assert!(
        xt.hadamard_rows(64).is_err(),
        "a block not dividing the row"
    );
    assert!(xt.hadamard_rows(12).is_err(), "not a power of two");
    assert!(xt.hadamard_rows(512).is_err(), "past 256");
}

/// Activations whose first `outliers` channels are 50 times the others.
fn with_outliers(rows: usize, inp: usize, outliers: usize, seed: u64) -> Vec<f32> {
    let mut x = lcg(rows * inp, seed, 1.0);
    for r in 0..rows {
        for c in 0..outliers {
            x[r * inp + c] *= 50.0;
        }
    }
    x
}

#[test]
fn the_rotation_spreads_massive_channels() {
    let (out, inp, rows) = (64, 256, 16);
    let w = lcg(out * inp, 41, 0.1);
    let b = lcg(out, 42, 0.1);
    let r = lcg(rows * out, 43, 1.0);
    let f = linear(&w, &b, out, inp, false, &CPU);
    let plain = linear_rotated(&w, &b, out, inp, true, false, &CPU);
    let rotated = linear_rotated(&w, &b, out, inp, true, true, &CPU);
    assert!(matches!(
        rotated.packing,
        Some(flame::nn::Packing::Fp8 { rotation: 256, .. })
    ));
    // The weight decodes back to itself (within its codes' rounding): W H H = W.
    let dw = f32s(&rotated.dense_weight(DType::F32).unwrap());
    assert!(rel(&dw, &w) < 0.04, "{}", rel(&dw, &w));
    for outliers in [0, 4] {
        let x = with_outliers(rows, inp, outliers, 44);
        let want = run(&f, &x, &r, rows, &CPU);
        let (p, q) = (
            run(&plain, &x, &r, rows, &CPU),
            run(&rotated, &x, &r, rows, &CPU),
        );
        let (ep, eq) = (rel(&p.y, &want.y), rel(&q.y, &want.y));
        println!("{outliers} outlier channels: y plain {ep:.2e}, rotated {eq:.2e}");
        // The backward's dy has no outliers; rotated or not, its error stays small.
        for (what, e) in [
            ("dx plain", rel(&p.dx, &want.dx)),
            ("dx rotated", rel(&q.dx, &want.dx)),
        ] {
            assert!(e < 0.03, "{outliers}: {what} {e}");
        }
        assert!(eq < 0.03, "{outliers}: rotated y {eq}");
        if outliers > 0 {
            assert!(eq * 2.0 < ep, "{outliers}: rotated {eq} against plain {ep}");
        }
    }
}

#[test]
fn a_nan_activation_makes_its_row_nan() {
    let (out, inp, rows) = (16, 32, 3);
    let w = lcg(out * inp, 22, 0.3);
    let mut x = lcg(rows * inp, 23, 1.0);
    x[inp + 7] = f32::NAN;
    let l = linear(&w, &[0.0; 16], out, inp, true, &CPU);
    let y = f32s(
        &l.forward(&Tensor::from_vec(x, (rows, inp), &CPU).unwrap())
            .unwrap(),
    );
    assert!(y[..out].iter().all(|v| v.is_finite()));
    assert!(y[out..2 * out].iter().all(|v| v.is_nan()), "{y:?}");
    assert!(y[2 * out..].iter().all(|v| v.is_finite()));
}

#[test]
fn an_fp8_file_is_quantized_again_for_int8_products() {
    // A scaled FP8 weight (E4M3 codes and a per-tensor `weight_scale`, BFL's layout): read for
    // int8 products its values are decoded and quantized to int8 a row at a time.
    let (out, inp) = (16, 32);
    let w = lcg(out * inp, 30, 0.5);
    let scale = 0.5f32 / 448.0;
    let codes: Vec<u8> = w.iter().map(|v| fp8::encode(v / scale)).collect();
    let values: Vec<f32> = codes.iter().map(|&c| fp8::decode(c) * scale).collect();
    let dir = std::env::temp_dir().join(format!("flame-int8-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("scaled.safetensors");
    let header = serde_json::json!({
        "l.weight": {"dtype": "F8_E4M3", "shape": [out, inp], "data_offsets": [0, out * inp]},
        "l.weight_scale": {"dtype": "F32", "shape": [], "data_offsets": [out * inp, out * inp + 4]},
    })
    .to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(&codes);
    bytes.extend(scale.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let vb = VarBuilder::from_files(std::slice::from_ref(&path), DType::F32, &CPU)
        .unwrap()
        .with_products(Some(I8))
        .unwrap();
    let l = Linear::new(&vb.pp("l"), inp, out, false).unwrap();
    let packing = l.packing.as_ref().expect("packed");
    assert_eq!(packing.name(), "int8");
    let got = f32s(&packing.decode(&l.weight, DType::F32).unwrap());
    let (wc, ws) = fp8::quantize_rows_as(I8, &values, out, inp).unwrap();
    let want: Vec<f32> = ints(&wc)
        .iter()
        .enumerate()
        .map(|(i, &c)| c as f32 * ws[i / inp])
        .collect();
    assert_eq!(got, want);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(int8::decode(0x81), -127.0);
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::eight_bit::cuda;
    use super::*;

    /// `x` in `dt` as the CPU converts it, on `d`: the two backends' own conversions are not
    /// what the GPU tests compare.
    fn made_on_cpu(x: &[f32], shape: (usize, usize), dt: DType, d: &Device) -> Tensor {
        Tensor::from_vec(x.to_vec(), shape, &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .to_device(d)
            .unwrap()
    }

    /// The row quantization and the decode equal the CPU's bits at every form of the kernels
    /// (16-byte and 8-byte chunks, element by element, narrow rows several a block, wide rows
    /// read twice), with and without a column factor, zero, NaN and infinite rows included;
    /// the product equals the CPU's within f32 rounding (the GPU sums exactly in i32, the CPU
    /// in f32) at odd sizes (the plain kernel), tensor-core sizes (cuBLASLt) and Flux's widths.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_int8_kernels_equal_cpu() {
        let Some(dev) = cuda() else { return };
        for (rows, cols) in [
            (1, 4),
            (3, 12),
            (77, 4),
            (5, 36),
            (33, 20),
            (9, 1000),
            (17, 2052),
            (3, 12_292),
            (2, 40_000),
        ] {
            let mut x = lcg(rows * cols, (rows * cols) as u64, 3.0);
            x[..cols].iter_mut().for_each(|v| *v = 0.0);
            if rows > 2 {
                x[cols + 1] = f32::NAN;
                x[2 * cols] = f32::NEG_INFINITY;
            }
            let col = lcg(cols, 7, 2.0);
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let mut outs = vec![];
                for d in [CPU, dev.clone()] {
                    let xt = made_on_cpu(&x, (rows, cols), dt, &d);
                    let ct = Tensor::from_vec(col.clone(), cols, &d).unwrap();
                    let (qc, qs) = xt.quant_rows8(I8, None).unwrap();
                    let (cc, cs) = xt.quant_rows8(I8, Some(&ct)).unwrap();
                    let dq = qc.dequant8(I8, &qs, dt).unwrap();
                    outs.push((u32s(&qc), f32s(&qs), u32s(&cc), f32s(&cs), f32s(&dq)));
                }
                let (c, g) = (&outs[0], &outs[1]);
                assert!(same_bits(&c.1, &g.1), "({rows}, {cols}) {dt} scales");
                assert_eq!(c.0, g.0, "({rows}, {cols}) {dt} codes");
                assert!(same_bits(&c.3, &g.3), "({rows}, {cols}) {dt} scales, cols");
                assert_eq!(c.2, g.2, "({rows}, {cols}) {dt} codes, columns");
                assert!(same_values(&c.4, &g.4), "({rows}, {cols}) {dt} decode");
            }
        }
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
            let mut outs = vec![];
            for d in [CPU, dev.clone()] {
                let at = Tensor::from_vec(a.clone(), (m, k), &d).unwrap();
                let bt = Tensor::from_vec(b.clone(), (n, k), &d).unwrap();
                let (ac, asc) = at.quant_rows8(I8, None).unwrap();
                let (bc, bsc) = bt.quant_rows8(I8, None).unwrap();
                let tr = (m % 4 == 0).then(|| u32s(&ac.transpose_fp8().unwrap()));
                let prods: Vec<Vec<f32>> = [DType::F32, DType::BF16, DType::F16]
                    .into_iter()
                    .map(|dt| f32s(&product8(I8, &ac, &asc, &bc, &bsc, dt).unwrap()))
                    .collect();
                outs.push((u32s(&ac), tr, prods));
            }
            let (cpu, gpu) = (&outs[0], &outs[1]);
            assert_eq!(cpu.0, gpu.0, "({m}, {k}) quantization");
            assert_eq!(cpu.1, gpu.1, "({m}, {k}) transpose");
            // The GPU's sums are exact; the CPU's f32 sums round past 2^24 (k of a few
            // thousand), and the half outputs add their own rounding.
            for (i, tol) in [1e-5f32, 8e-3, 1e-3].into_iter().enumerate() {
                let e = rel(&gpu.2[i], &cpu.2[i]);
                println!("({m}, {n}, {k}) product {i}: relative {e:.2e}");
                assert!(e <= tol, "({m}, {n}, {k}) product {i}: relative {e}");
            }
        }
    }

    /// A bias added in the product's pass, both codes, against the CPU: where the unscaled
    /// GEMM's sums are scaled (four columns a thread with an aligned bias, one with a bias at
    /// an odd offset), the plain kernels at odd sizes.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_products_with_a_bias_equal_cpu() {
        let Some(dev) = cuda() else { return };
        for code in [Code8::E4m3, I8] {
            for (m, n, k) in [(7, 12, 20), (33, 40, 48), (77, 128, 96), (300, 3072, 3072)] {
                let a = lcg(m * k, m as u64, 3.0);
                let b = lcg(n * k, n as u64 + 1, 0.2);
                let bias = lcg(n + 1, 9, 1.0);
                for dt in [DType::F32, DType::BF16] {
                    let mut outs = vec![];
                    for d in [CPU, dev.clone()] {
                        let at = Tensor::from_vec(a.clone(), (m, k), &d).unwrap();
                        let bt = Tensor::from_vec(b.clone(), (n, k), &d).unwrap();
                        let whole = Tensor::from_vec(bias.clone(), n + 1, &d)
                            .unwrap()
                            .to_dtype(dt)
                            .unwrap();
                        let (ac, asc) = at.quant_rows8(code, None).unwrap();
                        let (bc, bsc) = bt.quant_rows8(code, None).unwrap();
                        let ops = [&ac, &asc, &bc, &bsc];
                        let mut ys = vec![];
                        for off in [0, 1] {
                            let bv = whole.narrow(0, off, n).unwrap();
                            let y = flame::product8_bias(code, ops, Some(&bv), dt).unwrap();
                            ys.push(f32s(&y));
                        }
                        outs.push(ys);
                    }
                    for (off, (g, c)) in outs[1].iter().zip(&outs[0]).enumerate() {
                        let e = rel(g, c);
                        println!("{code:?} ({m}, {n}, {k}) {dt} bias at {off}: relative {e:.2e}");
                        let tol = match (code, dt) {
                            (Code8::E4m3, _) => 1e-2,
                            (_, DType::F32) => 1e-5,
                            _ => 8e-3,
                        };
                        assert!(e <= tol, "{code:?} ({m}, {n}, {k}) {dt} {off}: {e}");
                    }
                }
            }
        }
    }

    /// The rotation equals the CPU's bits, every dtype and block, odd row counts.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_rotation_equals_cpu() {
        let Some(dev) = cuda() else { return };
        for (rows, cols) in [(1, 16), (3, 96), (77, 256), (5, 3072), (9, 15360)] {
            let x = lcg(rows * cols, cols as u64, 4.0);
            for block in [2usize, 16, 64, 256] {
                if cols % block != 0 {
                    continue;
                }
                for dt in [DType::F32, DType::BF16, DType::F16] {
                    let mut outs = vec![];
                    for d in [CPU, dev.clone()] {
                        let xt = made_on_cpu(&x, (rows, cols), dt, &d);
                        outs.push(f32s(&xt.hadamard_rows(block).unwrap()));
                    }
                    assert_eq!(outs[0], outs[1], "({rows}, {cols}) block {block} {dt}");
                }
            }
        }
    }

    /// A Linear with rotated int8 products on CUDA against the CPU's.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_linear_with_rotated_int8_products_matches_cpu() {
        let Some(dev) = cuda() else { return };
        let (out, inp, rows) = (96, 128, 40);
        let w = lcg(out * inp, 17, 0.3);
        let b = lcg(out, 18, 0.1);
        let x = with_outliers(rows, inp, 3, 19);
        let r = lcg(rows * out, 20, 1.0);
        let mk = |d: &Device| linear_rotated(&w, &b, out, inp, true, true, d);
        let c = run(&mk(&CPU), &x, &r, rows, &CPU);
        let g = run(&mk(&dev), &x, &r, rows, &dev);
        for (what, e) in [
            ("y", rel(&g.y, &c.y)),
            ("dx", rel(&g.dx, &c.dx)),
            ("lora A", rel(&g.da, &c.da)),
        ] {
            println!("rotated {what}: relative {e:.2e}");
            assert!(e < 1e-4, "rotated {what}: relative {e}");
        }
    }

    /// A Linear with int8 products on CUDA against the CPU's: output, input gradient and
    /// LoRA gradient.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_linear_with_int8_products_matches_cpu() {
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
            assert!(e < 1e-4, "{what}: relative {e}");
        }
    }
}
