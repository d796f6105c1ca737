//! FP8 E4M3 base weights: the dequantization op against the format (`backend::fp8`), an FP8
//! Linear against a dense Linear on the decoded weight (forward and gradients, LoRA
//! included), loading F8_E4M3 safetensors files (with and without ComfyUI's per-tensor
//! `scale_weight`), and (ignored unless on a GPU) the CUDA kernel against the CPU bit for bit.
#![cfg(feature = "cpu-ref")]

mod common;
use common::eight_bit::{lcg, lora_linear};
use common::TempFile;
use flame::backend::fp8;
use flame::nn::{Linear, VarBuilder};
use flame::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Quantized codes and scales of a (rows, cols) weight, as tensors on `dev`.
fn quantized(w: &[f32], rows: usize, cols: usize, dev: &Device) -> (Tensor, Tensor) {
    let (c, s) = fp8::quantize_rows(w, rows, cols).unwrap();
    (
        Tensor::from_vec(c, (rows, cols / 4), dev).unwrap(),
        Tensor::from_vec(s, rows, dev).unwrap(),
    )
}

/// The decoded weight by the format's definition: decode(code) * scale in f32.
fn decoded_by_hand(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let (c, s) = fp8::quantize_rows(w, rows, cols).unwrap();
    (0..rows * cols)
        .map(|i| {
            let word = c[i / 4];
            fp8::decode(fp8::unpack(word, i % 4)) * s[i / cols]
        })
        .collect()
}

#[test]
fn dequant_follows_the_format_and_bounds_the_error() {
    let (rows, cols) = (7, 36);
    let mut w = lcg(rows * cols, 1, 3.0);
    // A zero row, a row of tiny values (subnormal codes after scaling) and one huge value.
    w[cols..2 * cols].iter_mut().for_each(|v| *v = 0.0);
    w[2 * cols] = 1e4;
    let (codes, scale) = quantized(&w, rows, cols, &CPU);
    let want = decoded_by_hand(&w, rows, cols);
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let got = codes.dequant_fp8(&scale, dt).unwrap();
        assert_eq!(got.dims(), [rows, cols]);
        let want_t = Tensor::from_vec(want.clone(), (rows, cols), &CPU)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        assert_eq!(bits(&got), bits(&want_t), "{dt}");
    }
    // E4M3 keeps 3 mantissa bits: a rounding error of at most 2^-4 of the value, or half a
    // subnormal step (2^-10 of the scale) below the normal range.
    let s = scale.to_vec::<f32>().unwrap();
    for (i, (&x, &y)) in w.iter().zip(&want).enumerate() {
        let bound = (x.abs() / 16.0).max(s[i / cols] / 1024.0) * 1.0001;
        assert!((x - y).abs() <= bound, "value {i}: {x} -> {y}");
    }
    assert!(want[cols..2 * cols].iter().all(|&v| v == 0.0));
    // A strided view of the codes decodes as its contiguous copy.
    let wide = Tensor::cat(&[&codes, &codes], 1).unwrap();
    let view = wide.narrow(1, 9, 9).unwrap();
    assert_eq!(
        bits(&view.dequant_fp8(&scale, DType::F32).unwrap()),
        bits(&codes.dequant_fp8(&scale, DType::F32).unwrap())
    );
}

#[test]
fn dequant_refuses_bad_operands() {
    let codes = Tensor::from_vec(vec![0u32; 6], (2, 3), &CPU).unwrap();
    let scale = Tensor::from_vec(vec![1f32; 3], 3, &CPU).unwrap();
    assert!(codes.dequant_fp8(&scale, DType::F32).is_err(), "scale rows");
    let scale = Tensor::from_vec(vec![1f32; 2], 2, &CPU).unwrap();
    assert!(
        codes.dequant_fp8(&scale, DType::U32).is_err(),
        "integer output"
    );
    let f = codes.to_dtype(DType::F32).unwrap();
    assert!(f.dequant_fp8(&scale, DType::F32).is_err(), "float codes");
    let nan = fp8::quantize_rows(&[1.0, f32::NAN, 0.0, 0.0], 1, 4).unwrap_err();
    assert!(nan.contains("row 0, column 1"), "{nan}");
    // The first non-finite value by row and column, whatever the rows after it hold.
    let mut w = vec![0.5f32; 64 * 8];
    w[40 * 8 + 6] = f32::INFINITY;
    w[41 * 8] = f32::NAN;
    w[63 * 8 + 1] = f32::NEG_INFINITY;
    let inf = fp8::quantize_rows(&w, 64, 8).unwrap_err();
    assert!(inf.contains("value inf at row 40, column 6"), "{inf}");
    assert!(
        fp8::quantize_rows(&[1.0; 6], 1, 6).is_err(),
        "width not a multiple of 4"
    );
}

/// A Linear built from `w` (out, in) + bias through a builder with or without FP8, with a
/// LoRA of rank 2 on it.
fn linear(w: &[f32], b: &[f32], out: usize, inp: usize, fp8: bool, dev: &Device) -> Linear {
    lora_linear(w, b, (out, inp), dev, |vb| vb.with_fp8(fp8))
}

#[test]
fn fp8_linear_equals_a_dense_linear_on_the_decoded_weight() {
    let (out, inp, rows) = (6, 12, 5);
    let w = lcg(out * inp, 2, 0.5);
    let b = lcg(out, 3, 0.1);
    let q = linear(&w, &b, out, inp, true, &CPU);
    assert!(matches!(q.packing, Some(flame::nn::Packing::Fp8 { .. })));
    assert_eq!(q.weight.dtype(), DType::U32);
    assert_eq!(q.dims(), (inp, out));
    let dense = linear(&decoded_by_hand(&w, out, inp), &b, out, inp, false, &CPU);
    assert!(dense.packing.is_none());
    let run = |l: &Linear| {
        let x = Tensor::from_vec(lcg(rows * 2 * inp, 4, 1.0), (rows, 2, inp), &CPU)
            .unwrap()
            .requires_grad_()
            .unwrap();
        let y = l.forward(&x).unwrap();
        let r = Tensor::from_vec(lcg(rows * 2 * out, 5, 1.0), (rows, 2, out), &CPU).unwrap();
        let grads = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        let p = l.adapter.as_ref().unwrap().params();
        let (a, bb) = (p[0].1.clone(), p[1].1.clone());
        (
            bits(&y),
            bits(grads.get(&x).unwrap()),
            bits(grads.get(&a).unwrap()),
            bits(grads.get(&bb).unwrap()),
        )
    };
    let (yq, dxq, daq, dbq) = run(&q);
    let (yd, dxd, dad, dbd) = run(&dense);
    assert_eq!(yq, yd, "output");
    assert_eq!(dxq, dxd, "input gradient");
    assert_eq!(daq, dad, "LoRA A gradient");
    assert_eq!(dbq, dbd, "LoRA B gradient");
    // The decoded product leaves the bias out; the LoRA's up-projection GEMM adds it (no add
    // of its own), where the dense layer's base GEMM took it.
    for l in [&q, &dense] {
        let x = Tensor::from_vec(lcg(rows * inp, 7, 1.0), (rows, inp), &CPU)
            .unwrap()
            .requires_grad_()
            .unwrap();
        let ops = flame::autograd::gradcheck::graph_ops(&l.forward(&x).unwrap()).unwrap();
        assert!(
            ops.contains("matmul") && !ops.contains("add") && !ops.contains("broadcast"),
            "{ops:?}"
        );
    }
    // An in-width that is not a multiple of 4 stays dense.
    let odd = linear(&lcg(3 * 6, 6, 1.0), &[0.0; 3], 3, 6, true, &CPU);
    assert!(odd.packing.is_none() && odd.weight.dtype() == DType::F32);
}

/// A safetensors file written by hand: `entries` of (name, dtype, shape, bytes).
fn write_raw(path: &std::path::Path, entries: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = vec![];
    for (name, dt, shape, bytes) in entries {
        let begin = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    file.extend(data);
    std::fs::write(path, file).unwrap();
}

#[test]
fn f8_e4m3_files_load_decoded_with_and_without_a_scale() {
    let codes: Vec<u8> = vec![0x38, 0xB8, 0x7E, 0x01, 0x00, 0x40, 0x44, 0x30];
    let values: Vec<f32> = codes.iter().map(|&c| fp8::decode(c)).collect();
    assert_eq!(values[..3], [1.0, -1.0, 448.0]);
    let f = TempFile::new("f8.safetensors");
    write_raw(
        f.path(),
        &[
            ("a.weight", "F8_E4M3", vec![2, 4], codes.clone()),
            ("b.weight", "F8_E4M3", vec![2, 4], codes.clone()),
            (
                "b.scale_weight",
                "F32",
                vec![],
                0.5f32.to_le_bytes().to_vec(),
            ),
        ],
    );
    let vb = VarBuilder::from_files(&[f.path()], DType::F32, &CPU).unwrap();
    let a = vb.get((2, 4), "a.weight").unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a, values);
    let b = vb.get((2, 4), "b.weight").unwrap().to_vec::<f32>().unwrap();
    let halved: Vec<f32> = values.iter().map(|v| v * 0.5).collect();
    assert_eq!(b, halved);
    assert!(
        vb.unused_keys().unwrap().is_empty(),
        "the scale counts as used"
    );
    // Loaded into an FP8 Linear: re-quantized per row, decoding to the same values (each row
    // of E4M3 values times a power of two is again E4M3 after the per-row scale).
    let vb8 = VarBuilder::from_files(&[f.path()], DType::F32, &CPU)
        .unwrap()
        .with_fp8(true)
        .unwrap();
    let l = Linear::new(&vb8.pp("b"), 4, 2, false).unwrap();
    let w = l.dense_weight(DType::F32).unwrap().to_vec::<f32>().unwrap();
    for (g, want) in w.iter().zip(&halved) {
        assert!((g - want).abs() <= want.abs() / 16.0, "{g} vs {want}");
    }
}

/// A Linear's FP8 codes read from safetensors files on the host (f32, bf16 and f16 files, a
/// weight concatenated from parts and one with its halves swapped, as diffusers' layouts map
/// them) equal those of the same values given as tensors, which are assembled on the device:
/// the same rounding to the builder's dtype, the same codes and scales; every key read counts
/// as used.
#[test]
fn fp8_weights_read_on_the_host_quantize_as_assembled_ones() {
    use flame::nn::KeySource;
    use half::{bf16, f16};
    use std::collections::HashMap;
    let (out, inp) = (6usize, 8usize);
    // Values of several binades and sub-bf16 detail: each dtype's rounding shows.
    let values = |n: usize, seed: u64| -> Vec<f32> {
        lcg(n, seed, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1 << (i % 5)) as f32 + 1e-4 * v)
            .collect()
    };
    let le = |dt: &str, v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| match dt {
                "F32" => x.to_le_bytes().to_vec(),
                "BF16" => bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                _ => f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
            })
            .collect()
    };
    let as_stored = |dt: &str, v: &[f32], shape: Vec<usize>| {
        let t = Tensor::from_vec(v.to_vec(), shape, &CPU).unwrap();
        match dt {
            "F32" => t,
            "BF16" => t.to_dtype(DType::BF16).unwrap(),
            _ => t.to_dtype(DType::F16).unwrap(),
        }
    };
    let sources: Vec<(&str, &str, Vec<usize>, Vec<f32>)> = vec![
        ("a.weight", "F32", vec![out, inp], values(out * inp, 1)),
        ("b.weight", "BF16", vec![out, inp], values(out * inp, 2)),
        ("c.weight", "F16", vec![out, inp], values(out * inp, 3)),
        ("q.weight", "BF16", vec![2, inp], values(2 * inp, 4)),
        ("k.weight", "F32", vec![4, inp], values(4 * inp, 5)),
        ("s.weight", "F32", vec![out, inp], values(out * inp, 6)),
    ];
    let f = TempFile::new("fp8-host.safetensors");
    let entries: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = sources
        .iter()
        .map(|(k, dt, shape, v)| (*k, *dt, shape.clone(), le(dt, v)))
        .collect();
    write_raw(f.path(), &entries);
    let tensors: HashMap<String, Tensor> = sources
        .iter()
        .map(|(k, dt, shape, v)| (k.to_string(), as_stored(dt, v, shape.clone())))
        .collect();
    let map: flame::nn::KeyMap = std::sync::Arc::new(|k: &str| {
        Some(match k {
            "qk.weight" => KeySource::Cat(vec![("q.weight".into(), 2), ("k.weight".into(), 4)]),
            "swapped.weight" => KeySource::SwapHalves("s.weight".into()),
            k => KeySource::Key(k.into()),
        })
    });
    for dtype in [DType::BF16, DType::F32, DType::F16] {
        let files = VarBuilder::from_files(&[f.path()], dtype, &CPU)
            .unwrap()
            .with_key_map(map.clone())
            .unwrap()
            .with_fp8(true)
            .unwrap();
        let given = VarBuilder::from_tensors(tensors.clone(), dtype, &CPU)
            .with_key_map(map.clone())
            .unwrap()
            .with_fp8(true)
            .unwrap();
        for key in ["a", "b", "c", "qk", "swapped"] {
            let name = format!("{key}.weight");
            let (c1, p1) = files.get_linear_weight(out, inp, &name).unwrap();
            let (c2, p2) = given.get_linear_weight(out, inp, &name).unwrap();
            assert_eq!(c1.dtype(), DType::U32, "{key}");
            assert_eq!(
                c1.to_vec::<u32>().unwrap(),
                c2.to_vec::<u32>().unwrap(),
                "{key} in {dtype:?}"
            );
            let scale = |p: Option<flame::nn::Packing>| match p {
                Some(flame::nn::Packing::Fp8 { scale, .. }) => bits(&scale),
                other => panic!("{key}: {other:?}"),
            };
            assert_eq!(scale(p1), scale(p2), "{key} in {dtype:?}");
        }
        assert!(files.unused_keys().unwrap().is_empty(), "{dtype:?}");
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::common::eight_bit::cuda;
    use super::*;

    /// The CUDA kernels decode to the CPU's bits for every output dtype and odd sizes: rows
    /// of whole 16-code groups (the 16-byte kernel: 48, 4096, 3072 columns) and not (the word
    /// kernel).
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_dequant_equals_cpu_bit_for_bit() {
        let Some(dev) = cuda() else { return };
        for (rows, cols) in [
            (1, 4),
            (7, 12),
            (333, 3076),
            (3, 4096),
            (5, 48),
            (1, 16),
            (67, 3072),
        ] {
            let w = lcg(rows * cols, rows as u64, 2.0);
            let (c, s) = quantized(&w, rows, cols, &CPU);
            let (cg, sg) = quantized(&w, rows, cols, &dev);
            for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let a = c.dequant_fp8(&s, dt).unwrap();
                let b = cg.dequant_fp8(&sg, dt).unwrap();
                assert!(b.device().is_cuda());
                assert_eq!(bits(&a), bits(&b), "({rows}, {cols}) {dt}");
            }
        }
    }

    /// An FP8 Linear on CUDA (bf16 compute) against the same layer on the CPU.
    #[test]
    #[ignore = "needs a GPU"]
    fn cuda_fp8_linear_matches_cpu() {
        let Some(dev) = cuda() else { return };
        let (out, inp) = (40, 64);
        let w = lcg(out * inp, 7, 0.3);
        let b = lcg(out, 8, 0.1);
        let x = lcg(9 * inp, 9, 1.0);
        let mut got = vec![];
        for d in [CPU, dev] {
            let l = linear(&w, &b, out, inp, true, &d);
            let xt = Tensor::from_vec(x.clone(), (9, inp), &d)
                .unwrap()
                .requires_grad_()
                .unwrap();
            let y = l.forward(&xt).unwrap();
            let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let dx = g.get(&xt).unwrap().to_vec::<f32>().unwrap();
            got.push((y.to_vec::<f32>().unwrap(), dx));
        }
        for (what, a, b) in [("y", &got[0].0, &got[1].0), ("dx", &got[0].1, &got[1].1)] {
            let max = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (p, q) in a.iter().zip(b.iter()) {
                assert!((p - q).abs() <= 1e-4 * max, "{what}: {p} vs {q}");
            }
        }
    }
}
