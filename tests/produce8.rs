//! Producers that quantize their output for 8-bit products in their own pass
//! (`Tensor::modulate_quant8`, `Tensor::gelu_tanh_quant8`, `Tensor::cat_gelu_tanh_quant8`,
//! and the concatenation without codes, `Tensor::cat_gelu_tanh`): the output is the producer's,
//! bit for bit, with the producer's gradients; the codes and scales are `quant_rows8`'s of
//! that output, bit for bit; a Linear with 8-bit products fed this way gives what it gives
//! when it quantizes its input itself (FP8 and int8, output and gradients). Ignored unless on
//! a GPU: the CUDA kernels against the CUDA ops they fuse, at every form of the kernels
//! (16-byte and 8-byte chunks, rows wider than a block holds in registers, odd row counts,
//! batches of the modulation).
#![cfg(feature = "cpu-ref")]

#[path = "common/eight_bit.rs"]
mod eight_bit;
use eight_bit::{lcg, lora_linear};
use flame::backend::fp8::Code8;
use flame::nn::{modulate_into, Linear};
use flame::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;
const CODES: [Code8; 2] = [Code8::E4m3, Code8::Int8];

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn t(v: Vec<f32>, shape: &[usize], dt: DType, dev: &Device) -> Tensor {
    Tensor::from_vec(v, shape.to_vec(), &CPU)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// The fused modulation against `modulate` then `quant_rows8` on `dev`: y, codes and scales
/// bit for bit; on the CPU also the gradients of x, shift and scale.
fn modulation_case(b: usize, l: usize, d: usize, dt: DType, dev: &Device, grads: bool) {
    for code in CODES {
        let x = t(lcg(b * l * d, 1 + d as u64, 3.0), &[b, l, d], dt, dev);
        let shift = t(lcg(b * d, 2, 0.5), &[b, 1, d], dt, dev);
        let scale = t(lcg(b * d, 3, 0.5), &[b, 1, d], dt, dev);
        let (x, shift, scale) = if grads {
            (
                x.requires_grad_().unwrap(),
                shift.requires_grad_().unwrap(),
                scale.requires_grad_().unwrap(),
            )
        } else {
            (x, shift, scale)
        };
        let (y, rows) = x.modulate_quant8(&shift, &scale, code).unwrap();
        let want = x.modulate(&shift, &scale).unwrap();
        assert_eq!(y.dims(), want.dims());
        let what = format!("{code:?} {dt} ({b}, {l}, {d}) on {dev}");
        assert_eq!(bits(&y), bits(&want), "modulation output, {what}");
        let (codes, scales) = want
            .reshape((b * l, d))
            .unwrap()
            .quant_rows8(code, None)
            .unwrap();
        assert_eq!(rows.code, code);
        assert!(rows.fits(code, b * l, d), "{what}");
        assert_eq!(
            rows.codes.to_vec::<u32>().unwrap(),
            codes.to_vec::<u32>().unwrap(),
            "codes, {what}"
        );
        assert_eq!(bits(&rows.scales), bits(&scales), "scales, {what}");
        if grads {
            let r = t(lcg(b * l * d, 9, 1.0), &[b, l, d], dt, dev);
            let g1 = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = want.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, p) in [("x", &x), ("shift", &shift), ("scale", &scale)] {
                assert_eq!(
                    bits(g1.get(p).unwrap()),
                    bits(g2.get(p).unwrap()),
                    "gradient of {name}, {what}"
                );
            }
        }
    }
}

/// The fused GELU against `gelu_tanh` then `quant_rows8` on `dev`, as `modulation_case`.
fn gelu_case(rows: usize, cols: usize, dt: DType, dev: &Device, grads: bool) {
    for code in CODES {
        let x = t(
            lcg(rows * cols, 5 + cols as u64, 4.0),
            &[1, rows, cols],
            dt,
            dev,
        );
        let x = if grads {
            x.requires_grad_().unwrap()
        } else {
            x
        };
        let (y, r8) = x.gelu_tanh_quant8(code).unwrap();
        let want = x.gelu_tanh().unwrap();
        let what = format!("{code:?} {dt} ({rows}, {cols}) on {dev}");
        assert_eq!(bits(&y), bits(&want), "GELU output, {what}");
        let (codes, scales) = want
            .reshape((rows, cols))
            .unwrap()
            .quant_rows8(code, None)
            .unwrap();
        assert!(r8.fits(code, rows, cols), "{what}");
        assert_eq!(
            r8.codes.to_vec::<u32>().unwrap(),
            codes.to_vec::<u32>().unwrap(),
            "codes, {what}"
        );
        assert_eq!(bits(&r8.scales), bits(&scales), "scales, {what}");
        if grads {
            let r = t(lcg(rows * cols, 8, 1.0), &[1, rows, cols], dt, dev);
            let g1 = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = want.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(
                bits(g1.get(&x).unwrap()),
                bits(g2.get(&x).unwrap()),
                "dx, {what}"
            );
        }
    }
}

/// The fused [a, gelu_tanh(x)] against `cat` of `a` and `gelu_tanh` then `quant_rows8` on
/// `dev`, with x a slice at column `at` of a wider tensor's rows (as Flux's single blocks cut
/// it from `linear1`'s output): y, codes and scales bit for bit, without codes too; on request
/// the gradients of a and of the wider tensor.
#[allow(clippy::too_many_arguments)]
fn cat_gelu_case(
    rows: usize,
    split: usize,
    rest: usize,
    at: usize,
    dt: DType,
    dev: &Device,
    grads: bool,
) {
    let width = at + rest + 4;
    let a = t(
        lcg(rows * split, 31 + split as u64, 3.0),
        &[1, rows, split],
        dt,
        dev,
    );
    let h = t(
        lcg(rows * width, 32 + rest as u64, 4.0),
        &[1, rows, width],
        dt,
        dev,
    );
    let (a, h) = if grads {
        (a.requires_grad_().unwrap(), h.requires_grad_().unwrap())
    } else {
        (a, h)
    };
    // The slice and the two ops, made again for each backward (a backward frees its graph).
    let slice = || h.narrow(2, at, rest).unwrap();
    let x = slice();
    let unfused = || Tensor::cat(&[&a, &slice().gelu_tanh().unwrap()], 2).unwrap();
    let what = |c: &str| format!("{c} {dt} ({rows}, {split} + {rest} at {at}) on {dev}");
    let plain = a.cat_gelu_tanh(&x).unwrap();
    assert_eq!(plain.dims(), unfused().dims());
    assert_eq!(
        bits(&plain),
        bits(&unfused()),
        "output, {}",
        what("no code")
    );
    let cols = split + rest;
    for code in CODES {
        let what = what(&format!("{code:?}"));
        let want = unfused();
        let (y, r8) = a.cat_gelu_tanh_quant8(&slice(), code).unwrap();
        assert_eq!(bits(&y), bits(&want), "output, {what}");
        let (codes, scales) = want
            .reshape((rows, cols))
            .unwrap()
            .quant_rows8(code, None)
            .unwrap();
        assert!(r8.fits(code, rows, cols), "{what}");
        assert_eq!(
            r8.codes.to_vec::<u32>().unwrap(),
            codes.to_vec::<u32>().unwrap(),
            "codes, {what}"
        );
        assert_eq!(bits(&r8.scales), bits(&scales), "scales, {what}");
        if grads {
            let r = t(lcg(rows * cols, 33, 1.0), &[1, rows, cols], dt, dev);
            let g1 = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = want.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, p) in [("a", &a), ("h", &h)] {
                assert_eq!(
                    bits(g1.get(p).unwrap()),
                    bits(g2.get(p).unwrap()),
                    "gradient of {name}, {what}"
                );
            }
        }
    }
}

/// Attention's heads o (1, h, l, d) merged by the fused kernels against `merge_heads` (then
/// `cat` with GELU of x (1, l, m) where `m` > 0, and `quant_rows8`) on `dev`: outputs, codes
/// and scales bit for bit; on request the gradients of o (and x).
fn heads_case(h: usize, l: usize, d: usize, m: usize, dt: DType, dev: &Device, grads: bool) {
    let o = t(lcg(h * l * d, 41 + d as u64, 3.0), &[1, h, l, d], dt, dev);
    let x = t(lcg(l * m.max(1), 42, 4.0), &[1, l, m.max(1)], dt, dev);
    let (o, x) = if grads {
        (o.requires_grad_().unwrap(), x.requires_grad_().unwrap())
    } else {
        (o, x)
    };
    let merged = || flame::nn::merge_heads(&o).unwrap();
    let want = || {
        if m == 0 {
            merged()
        } else {
            Tensor::cat(&[&merged(), &x.gelu_tanh().unwrap()], 2).unwrap()
        }
    };
    let cols = h * d + m;
    for code in CODES {
        let what = format!("{code:?} {dt} ({h} heads of {d}, {l} rows, + {m}) on {dev}");
        let (y, r8) = if m == 0 {
            o.merge_heads_quant8(code).unwrap()
        } else {
            o.transpose(1, 2)
                .unwrap()
                .cat_gelu_tanh_quant8(&x, code)
                .unwrap()
        };
        let w = want();
        assert_eq!(y.dims(), w.dims(), "{what}");
        assert_eq!(bits(&y), bits(&w), "output, {what}");
        let (codes, scales) = w
            .reshape((l, cols))
            .unwrap()
            .quant_rows8(code, None)
            .unwrap();
        assert!(r8.fits(code, l, cols), "{what}");
        assert_eq!(
            r8.codes.to_vec::<u32>().unwrap(),
            codes.to_vec::<u32>().unwrap(),
            "codes, {what}"
        );
        assert_eq!(bits(&r8.scales), bits(&scales), "scales, {what}");
        if grads {
            let r = t(lcg(l * cols, 43, 1.0), &[1, l, cols], dt, dev);
            let g1 = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = w.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(
                bits(g1.get(&o).unwrap()),
                bits(g2.get(&o).unwrap()),
                "do, {what}"
            );
            if m > 0 {
                assert_eq!(
                    bits(g1.get(&x).unwrap()),
                    bits(g2.get(&x).unwrap()),
                    "dx, {what}"
                );
            }
        }
    }
    if m > 0 {
        let plain = o.transpose(1, 2).unwrap().cat_gelu_tanh(&x).unwrap();
        assert_eq!(bits(&plain), bits(&want()), "without codes, {dt} on {dev}");
    }
}

#[test]
fn attentions_heads_are_merged_as_they_are_read() {
    for dt in [DType::F32, DType::BF16] {
        heads_case(3, 5, 8, 12, dt, &CPU, true);
        heads_case(2, 7, 4, 0, dt, &CPU, true);
    }
    // Heads of 6 values do not fit the kernel's chunks: the ops one after the other.
    heads_case(2, 3, 6, 8, DType::F32, &CPU, true);
    heads_case(2, 3, 6, 0, DType::F32, &CPU, false);
}

#[test]
fn the_fused_concatenation_is_cat_of_gelu_then_quant_rows8() {
    for dt in [DType::F32, DType::BF16] {
        cat_gelu_case(5, 12, 20, 8, dt, &CPU, true);
        cat_gelu_case(3, 8, 16, 0, dt, &CPU, false);
    }
    // Parts the kernel cannot take (a split not a multiple of 4) go through the two ops.
    cat_gelu_case(4, 6, 10, 2, DType::F32, &CPU, true);
    // The fused op is what the tape records, once.
    let a = t(lcg(24, 1, 1.0), &[2, 3, 4], DType::F32, &CPU)
        .requires_grad_()
        .unwrap();
    let x = t(lcg(48, 2, 1.0), &[2, 3, 8], DType::F32, &CPU);
    let y = a.cat_gelu_tanh(&x).unwrap();
    assert_eq!(y.dims(), [2, 3, 12]);
    let ops = flame::autograd::gradcheck::graph_ops(&y).unwrap();
    assert!(ops.contains("cat_gelu_tanh"), "{ops:?}");
    assert!(
        !ops.contains("cat") && !ops.contains("gelu_tanh"),
        "{ops:?}"
    );
}

#[test]
fn the_fused_modulation_is_modulate_then_quant_rows8() {
    for dt in [DType::F32, DType::BF16] {
        modulation_case(2, 5, 36, dt, &CPU, true);
        modulation_case(1, 3, 8, dt, &CPU, true);
    }
}

#[test]
fn the_fused_gelu_is_gelu_then_quant_rows8() {
    for dt in [DType::F32, DType::BF16] {
        gelu_case(7, 44, dt, &CPU, true);
    }
}

#[test]
fn rows_the_codes_cannot_pack_are_refused() {
    let x = Tensor::from_vec(lcg(2 * 3 * 18, 4, 1.0), (2, 3, 18), &CPU).unwrap();
    let p = Tensor::zeros((2, 1, 18), DType::F32, &CPU).unwrap();
    let err = x
        .modulate_quant8(&p, &p, Code8::Int8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("18 columns"), "{err}");
    let err = x.gelu_tanh_quant8(Code8::E4m3).unwrap_err().to_string();
    assert!(err.contains("18 columns"), "{err}");
}

/// A Linear (out, in) with a bias and a rank-2 LoRA, its products in `code` (or None: f32).
fn linear(out: usize, inp: usize, code: Option<Code8>, rotation: bool, dev: &Device) -> Linear {
    let (w, b) = (lcg(out * inp, 11, 0.3), lcg(out, 12, 0.1));
    lora_linear(&w, &b, (out, inp), dev, |vb| match code {
        Some(c) => vb.with_products(Some(c))?.with_int8_rotation(rotation),
        None => Ok(vb),
    })
}

#[test]
fn only_unrotated_8_bit_products_take_a_producers_codes() {
    assert_eq!(linear(48, 32, None, false, &CPU).input_code(), None);
    for code in CODES {
        assert_eq!(
            linear(48, 32, Some(code), false, &CPU).input_code(),
            Some(code)
        );
    }
    assert_eq!(
        linear(48, 32, Some(Code8::Int8), true, &CPU).input_code(),
        None
    );
    // Widths the tensor cores do not take run decoded: nothing to quantize.
    assert_eq!(
        linear(48, 36, Some(Code8::Int8), false, &CPU).input_code(),
        None
    );
}

/// y, dx and the LoRA's gradients of `f` (a path from x (1, 6, 32) to a Linear's output).
fn through(lin: &Linear, f: impl Fn(&Tensor) -> Tensor, dev: &Device) -> Vec<Vec<u32>> {
    let x = t(lcg(6 * 32, 21, 2.0), &[1, 6, 32], DType::F32, dev)
        .requires_grad_()
        .unwrap();
    let y = f(&x);
    let r = t(lcg(6 * 48, 22, 1.0), &[1, 6, 48], DType::F32, dev);
    let g = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![bits(&y), bits(g.get(&x).unwrap())];
    for (_, p) in lin.adapter.as_ref().unwrap().params() {
        out.push(bits(g.get(&p).unwrap()));
    }
    out
}

fn linear_takes_the_codes(dev: &Device) {
    for code in CODES {
        let lin = linear(48, 32, Some(code), false, dev);
        let shift = t(lcg(32, 23, 0.5), &[1, 1, 32], DType::F32, dev);
        let scale = t(lcg(32, 24, 0.5), &[1, 1, 32], DType::F32, dev);
        let fused = through(
            &lin,
            |x| modulate_into(x, &shift, &scale, &lin).unwrap(),
            dev,
        );
        let plain = through(
            &lin,
            |x| lin.forward(&x.modulate(&shift, &scale).unwrap()).unwrap(),
            dev,
        );
        assert_eq!(fused, plain, "modulation into a {code:?} Linear on {dev}");
        // The codes given are the ones used: another input's codes give another output.
        let x = t(lcg(6 * 32, 25, 2.0), &[6, 32], DType::F32, dev);
        let (codes, scales) = x
            .affine(-1.0, 0.0)
            .unwrap()
            .quant_rows8(code, None)
            .unwrap();
        let other = flame::Rows8 {
            code,
            codes,
            scales,
        };
        let own = bits(&lin.forward(&x).unwrap());
        assert_ne!(own, bits(&lin.forward_rows8(&x, Some(&other)).unwrap()));
        let fused = through(&lin, |x| lin.forward_gelu_tanh(x).unwrap(), dev);
        let plain = through(&lin, |x| lin.forward(&x.gelu_tanh().unwrap()).unwrap(), dev);
        assert_eq!(fused, plain, "GELU into a {code:?} Linear on {dev}");
        // [x's first 8 columns, GELU of the other 24] into the Linear, as Flux's single blocks.
        let cat = |x: &Tensor| {
            (
                x.narrow(2, 0, 8).unwrap(),
                x.narrow(2, 8, 24).unwrap().affine(2.0, 0.0).unwrap(),
            )
        };
        let fused = through(
            &lin,
            |x| {
                let (a, h) = cat(x);
                lin.forward_cat_gelu_tanh(&a, &h).unwrap()
            },
            dev,
        );
        let plain = through(
            &lin,
            |x| {
                let (a, h) = cat(x);
                let y = Tensor::cat(&[&a, &h.gelu_tanh().unwrap()], 2).unwrap();
                lin.forward(&y).unwrap()
            },
            dev,
        );
        assert_eq!(
            fused, plain,
            "the concatenation into a {code:?} Linear on {dev}"
        );
        // x's rows as attention's two heads of 16, merged with their codes, then rows 0..2
        // and 2..6 into the Linear with their share of the codes (a double-stream block's
        // text and image rows), against the merge and the Linear quantizing each part.
        let heads = |x: &Tensor| {
            x.reshape((1, 6, 2, 16))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let parts = [(0, 2), (2, 4)];
        let fused = through(
            &lin,
            |x| {
                let (y, r8) = heads(x).merge_heads_quant8(code).unwrap();
                let outs: Vec<Tensor> = parts
                    .iter()
                    .map(|&(s, n)| {
                        let rows = flame::Rows8 {
                            code,
                            codes: r8.codes.narrow(0, s, n).unwrap(),
                            scales: r8.scales.narrow(0, s, n).unwrap(),
                        };
                        lin.forward_rows8(&y.narrow(1, s, n).unwrap(), Some(&rows))
                            .unwrap()
                    })
                    .collect();
                Tensor::cat(&outs.iter().collect::<Vec<_>>(), 1).unwrap()
            },
            dev,
        );
        let plain = through(
            &lin,
            |x| {
                let y = flame::nn::merge_heads(&heads(x)).unwrap();
                let outs: Vec<Tensor> = parts
                    .iter()
                    .map(|&(s, n)| lin.forward(&y.narrow(1, s, n).unwrap()).unwrap())
                    .collect();
                Tensor::cat(&outs.iter().collect::<Vec<_>>(), 1).unwrap()
            },
            dev,
        );
        assert_eq!(fused, plain, "merged heads into a {code:?} Linear on {dev}");
        // The codes are the merge's: rows of another part's codes give another output.
        let (y, r8) = heads(&x.reshape((1, 6, 32)).unwrap())
            .merge_heads_quant8(code)
            .unwrap();
        let wrong = flame::Rows8 {
            code,
            codes: r8.codes.narrow(0, 0, 2).unwrap(),
            scales: r8.scales.narrow(0, 0, 2).unwrap(),
        };
        let part = y.narrow(1, 2, 2).unwrap();
        assert_ne!(
            bits(&lin.forward(&part).unwrap()),
            bits(&lin.forward_rows8(&part, Some(&wrong)).unwrap())
        );
    }
}

#[test]
fn a_linear_fed_its_producers_codes_gives_what_it_gives_alone() {
    linear_takes_the_codes(&CPU);
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::eight_bit::cuda;
    use super::*;

    /// The fused kernels against the CUDA ops they fuse, bit for bit: 16-byte chunks (bf16
    /// rows of 3072, f32 rows of 20), 8-byte chunks (bf16 and f16 rows of 36), rows wider
    /// than a block keeps in registers (bf16 rows of 16448: 2056 chunks of 8 against 4 x 512),
    /// odd row counts, two batches of the modulation; gradients through the recorded ops.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_producers_equal_the_ops_they_fuse() {
        let Some(dev) = cuda() else { return };
        for (b, l, d, dt) in [
            (1, 7, 3072, DType::BF16),
            (2, 9, 36, DType::BF16),
            (2, 5, 36, DType::F16),
            (2, 3, 20, DType::F32),
            (1, 3, 16448, DType::BF16),
        ] {
            modulation_case(b, l, d, dt, &dev, true);
            gelu_case(b * l, d, dt, &dev, true);
        }
    }

    /// The fused concatenation against `cat` of `gelu_tanh` and `quant_rows8` on CUDA, bit
    /// for bit, with and without codes, gradients through the recorded op: Flux's widths
    /// (3072 beside 12288 of a 21504-wide projection: 16-byte chunks, rows wider than a block
    /// keeps in registers) at 7 rows, 8-byte chunks (bf16 and f16 slices at a column of 4),
    /// element by element (f32 parts of 4 and 20 at a column of 2), f32 16-byte chunks, odd
    /// row counts.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_concatenation_equals_the_ops_it_fuses() {
        let Some(dev) = cuda() else { return };
        for (rows, split, rest, at, dt) in [
            (7, 3072, 12288, 9216, DType::BF16),
            (9, 36, 44, 4, DType::BF16),
            (5, 36, 44, 4, DType::F16),
            (3, 4, 20, 2, DType::F32),
            (11, 32, 64, 16, DType::F32),
        ] {
            cat_gelu_case(rows, split, rest, at, dt, &dev, true);
        }
        // Attention's heads merged as they are read: Flux's 24 heads of 128 (beside 12288
        // MLP values, and alone), heads of 64, 8-byte chunks (heads of 4 bf16), element by
        // element (f32 heads of 4 beside 20).
        for (h, l, d, m, dt) in [
            (24, 7, 128, 12288, DType::BF16),
            (24, 9, 128, 0, DType::BF16),
            (3, 5, 64, 0, DType::F16),
            (3, 5, 4, 12, DType::BF16),
            (2, 3, 4, 20, DType::F32),
        ] {
            heads_case(h, l, d, m, dt, &dev, true);
        }
    }

    /// A Linear with FP8 and int8 products on CUDA fed its producer's codes gives what it
    /// gives quantizing its input itself.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_linear_fed_its_producers_codes_gives_what_it_gives_alone() {
        let Some(dev) = cuda() else { return };
        linear_takes_the_codes(&dev);
    }
}
