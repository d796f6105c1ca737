//! FP8 FLUX.2 single files: float8_e4m3fn Linear weights with their scales, in BFL's
//! convention (`weight_scale`, `input_scale`, bare keys; per tensor and per row) and
//! ComfyUI's two (`scale_weight` with the `scaled_fp8` marker, and `weight_scale` with
//! `comfy_quant` records, under `model.diffusion_model.`), load as the weights they stand for.
//! Fixtures (tests/fixtures/flux2_fp8, 1.4 MB) are made by
//! scripts/make_flux2_fp8_fixtures.py from the tiny FLUX.2 transformer of tests/flux2.rs,
//! with PyTorch's float8_e4m3fn rounding and its `code.float() * scale` as the reference.
//!
//! Numbers: each loaded weight equals PyTorch's dequantization bit for bit (f32), dense and
//! kept as FLAME's FP8 codes (`LoadOptions::fp8`); the model's output equals the dequantized
//! model's to [`SAME`]; against the original f32 model (diffusers' output of
//! tests/fixtures/flux2) it is off by FP8's rounding, under [`FP8_ROUNDING`] ([`FP8_STORED`]
//! with FP8 storage, which quantizes the embedders and modulations too).
#![cfg(feature = "cpu-ref")]

mod common;

use common::rel_err;
use flame::models::flux2::{Flux2, Flux2Config};
use flame::models::{load_as, LoadOptions};
use flame::nn::VarBuilder;
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

/// The FP8 file's model against the dequantized one in f32: the same weights, so the same
/// output up to nothing (measured 0).
const SAME: f64 = 1e-6;

/// The FP8 model against the original f32 one: a weight's rounding to 3 mantissa bits is up
/// to 1/16 of it, 3.6e-2 of a tensor's largest value (the script prints it); measured on the
/// output 3.3e-3 (per tensor) and 3.6e-3 (per row).
const FP8_ROUNDING: f64 = 1e-2;

/// The same with FP8 storage, which rounds the embedders, modulations and final layer to FP8
/// too (per row, FLAME's own quantization of their bf16 values): measured 4.4e-2 and 4.5e-2.
const FP8_STORED: f64 = 0.1;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flux2_fp8")
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(path, &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

/// The inputs and diffusers' output of the tiny FLUX.2 (tests/flux2.rs).
fn io() -> BTreeMap<String, Tensor> {
    load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flux2/flux2/io.safetensors"))
}

fn forward(model: &Flux2, io: &BTreeMap<String, Tensor>) -> Tensor {
    let _g = flame::no_grad();
    model
        .forward(
            &io["img"],
            &io["img_ids"],
            &io["txt"],
            &io["txt_ids"],
            &io["timesteps"],
            io.get("guidance"),
        )
        .unwrap()
}

/// The four files with the reference each stands for.
const VARIANTS: [(&str, &str); 4] = [
    ("bfl_tensor", "tensor"),
    ("bfl_channel", "row"),
    ("comfy_scaled", "tensor"),
    ("comfy_quant", "tensor"),
];

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Every weight of each file, loaded dense in f32, is PyTorch's `code.float() * scale` bit
/// for bit; the model's output is the dequantized model's, and the original's within FP8's
/// rounding.
#[test]
fn fp8_files_load_as_their_dequantized_weights() {
    let io = io();
    for (name, reference) in VARIANTS {
        let path = dir().join(format!("{name}.safetensors"));
        let (model, vb) = Flux2::load(&path, DType::F32, &CPU, None).unwrap();
        let want = load(&dir().join(format!("dequantized_{reference}.safetensors")));
        let params: BTreeMap<String, Tensor> = vb.params().unwrap().into_iter().collect();
        assert_eq!(
            params.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}: parameters"
        );
        for (k, t) in &params {
            assert_eq!(bits(t), bits(&want[k]), "{name}: {k}");
        }
        // What the file holds beside its weights is read (the scales) or read past (the
        // input scales, records, ComfyUI's marker) and named here.
        let unused = vb.unused_keys().unwrap();
        assert!(
            unused.iter().all(|k| k.ends_with("scaled_fp8")),
            "{name}: unused {unused:?}"
        );
        let out = forward(&model, &io);
        let (deq, _) = Flux2::load(
            dir().join(format!("dequantized_{reference}.safetensors")),
            DType::F32,
            &CPU,
            None,
        )
        .unwrap();
        let same = rel_err(&out, &forward(&deq, &io));
        let rounding = rel_err(&out, &io["output"]);
        println!("{name}: vs dequantized {same:.2e}, vs the f32 model {rounding:.2e}");
        assert!(same <= SAME, "{name}: {same}");
        assert!(
            rounding <= FP8_ROUNDING && rounding > 1e-4,
            "{name}: {rounding}"
        );
    }
}

/// An FP8 FLUX.2 file with diffusers' bare names, q/k/v split, a scale a tensor (BFL's own
/// FP8 files keep BFL's names: the test below). It reads as a diffusers checkpoint (the config
/// from its shapes): every weight is
/// the dequantized folder's bit for bit (q, k and v each decoded with its own scale, then
/// joined), and so is the output; with FP8 storage the output stays within FP8's rounding.
#[test]
fn an_fp8_file_with_diffusers_names_loads_as_its_dequantized_folder() {
    let io = io();
    let path = dir().join("diffusers_tensor.safetensors");
    let (model, vb) = Flux2::load(&path, DType::F32, &CPU, None).unwrap();
    let (deq, dvb) =
        Flux2::load(dir().join("diffusers_dequantized"), DType::F32, &CPU, None).unwrap();
    assert_eq!(
        model.config, deq.config,
        "the config from the file's shapes"
    );
    let got: BTreeMap<String, Tensor> = vb.params().unwrap().into_iter().collect();
    let want: BTreeMap<String, Tensor> = dvb.params().unwrap().into_iter().collect();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, t) in &got {
        assert_eq!(bits(t), bits(&want[k]), "{k}");
    }
    let unused = vb.unused_keys().unwrap();
    assert!(
        unused.iter().all(|k| k.ends_with(".input_scale")),
        "unused {unused:?}"
    );
    let out = forward(&model, &io);
    assert_eq!(bits(&out), bits(&forward(&deq, &io)), "output");
    let rounding = rel_err(&out, &io["output"]);
    assert!(rounding <= FP8_ROUNDING && rounding > 1e-4, "{rounding}");
    // Kept as FP8 weights (`model.dtype = "fp8"`; q, k and v joined, then quantized a row at
    // a time: their own scales do not survive the join).
    let mut opts = LoadOptions::new(DType::F32, &CPU);
    opts.fp8 = true;
    let stored = load_as::<Flux2>(&path, &opts, None).unwrap();
    let out8 = forward(&stored.model, &io);
    let e = rel_err(&out8, &io["output"]);
    println!("diffusers-named FP8 file: f32 {rounding:.2e}, FP8 storage {e:.2e}");
    assert!(e <= FP8_STORED, "{e}");
}

/// Stored as FLAME's FP8 weights (`model.dtype = "fp8"`), the file's codes and scales are
/// kept as they are: every FP8 block Linear decodes to PyTorch's dequantization bit for bit
/// (no second rounding), every other Linear is FLAME's own quantization of its bf16 value (as
/// from the dequantized file), and the output stays within FP8's rounding of the f32 model.
#[test]
fn fp8_files_keep_their_codes_as_fp8_weights() {
    let io = io();
    for (name, reference) in VARIANTS {
        let reference = dir().join(format!("dequantized_{reference}.safetensors"));
        let fp8 = |path: &Path| {
            let mut opts = LoadOptions::new(DType::F32, &CPU);
            opts.fp8 = true;
            load_as::<Flux2>(path, &opts, None).unwrap()
        };
        let l = fp8(&dir().join(format!("{name}.safetensors")));
        let other = fp8(&reference);
        let want = load(&reference);
        let params: BTreeMap<String, Tensor> = l.vb.params().unwrap().into_iter().collect();
        let others: BTreeMap<String, Tensor> = other.vb.params().unwrap().into_iter().collect();
        assert_eq!(
            params.keys().collect::<Vec<_>>(),
            others.keys().collect::<Vec<_>>(),
            "{name}"
        );
        let mut kept = 0;
        for (k, t) in &params {
            let block = k.starts_with("double_blocks.") || k.starts_with("single_blocks.");
            if block && l.vb.packed_dims(k).unwrap().is_some() {
                let scale = &params[&format!("{k}.fp8_scale")];
                let got = t.dequant_fp8(scale, DType::F32).unwrap();
                assert_eq!(bits(&got), bits(&want[k]), "{name}: {k}");
                kept += 1;
            } else if !(block && k.ends_with(".fp8_scale")) {
                assert_eq!(bits(t), bits(&others[k]), "{name}: {k}");
            }
        }
        assert_eq!(kept, 20, "{name}: FP8 block Linears kept");
        let out = forward(&l.model, &io);
        let rounding = rel_err(&out, &io["output"]);
        println!("{name} as FP8 weights: vs the f32 model {rounding:.2e}");
        assert!(rounding <= FP8_STORED, "{name}: {rounding}");
    }
}

/// In bf16 the weights are the dequantized values rounded once to bf16.
#[test]
fn fp8_files_load_in_bf16() {
    let path = dir().join("bfl_tensor.safetensors");
    let (_, vb) = Flux2::load(&path, DType::BF16, &CPU, None).unwrap();
    let want = load(&dir().join("dequantized_tensor.safetensors"));
    for (k, t) in vb.params().unwrap() {
        assert_eq!(t.dtype(), DType::BF16);
        let w = want[&k].to_dtype(DType::BF16).unwrap();
        assert_eq!(bits(&t), bits(&w), "{k}");
    }
}

/// What FLAME does not read is refused, naming the tensor: block-wise scales, a record of
/// another format, two scale conventions on one weight, a NaN code, a scale beside a weight
/// that is not FP8. A weight without a scale is its codes' values.
#[test]
fn unreadable_fp8_weights_are_refused_by_name() {
    let path = dir().join("bad.safetensors");
    for fp8 in [false, true] {
        let vb = VarBuilder::from_files(std::slice::from_ref(&path), DType::F32, &CPU)
            .unwrap()
            .with_fp8(fp8)
            .unwrap();
        for (layer, says) in [
            ("blockwise", "block-wise"),
            ("int8", "int8_tensorwise"),
            ("twice", "two weight scales"),
            ("nan", "NaN"),
        ] {
            let e = vb
                .get_linear_weight(8, 16, &format!("{layer}.weight"))
                .unwrap_err();
            match &e {
                Error::Param { key, msg, file } => {
                    assert_eq!(key, &format!("{layer}.weight"), "{e}");
                    assert!(msg.contains(says), "{e}");
                    assert_eq!(file.as_deref(), Some(path.as_path()), "{e}");
                }
                other => panic!("{layer}: {other}"),
            }
        }
        let (plain, packing) = vb.get_linear_weight(8, 16, "plain.weight").unwrap();
        let plain = match packing {
            Some(p) => p.decode(&plain, DType::F32).unwrap(),
            None => plain,
        };
        // The codes' values: each one an E4M3 value.
        for v in plain.flatten_all().unwrap().to_vec::<f32>().unwrap() {
            let back = flame::backend::fp8::decode(flame::backend::fp8::encode(v));
            assert_eq!(back.to_bits(), v.to_bits(), "{v}");
        }
    }
    // A weight scale beside a float32 weight.
    let f = common::TempFile::new("fp8-f32-scale");
    let w = Tensor::ones((4, 8), DType::F32, &CPU).unwrap();
    let s = Tensor::ones((), DType::F32, &CPU).unwrap();
    flame::safetensors::save([("x.weight", &w), ("x.weight_scale", &s)], f.path()).unwrap();
    let vb = VarBuilder::from_files(&[f.path().to_path_buf()], DType::F32, &CPU).unwrap();
    let e = vb.get((4, 8), "x.weight").unwrap_err().to_string();
    assert!(e.contains("x.weight_scale") && e.contains("F32"), "{e}");
}

/// BFL's released FP8 FLUX.2 [klein] 4B file (`black-forest-labs/FLUX.2-klein-4b-fp8`) as its
/// header lists it: block 0 of each stack and every key outside the blocks, each with its shape
/// and storage dtype (tests/fixtures/flux2_fp8/bfl_klein4b_released.json, transcribed from the
/// capture in invoke-ai/InvokeAI `tests/backend/model_manager/load/state_dicts/
/// flux2_klein_4b_scaled_fp8_keys.py`). BFL's names, fused qkv, F8_E4M3 block Linears each with
/// an F32 scalar `weight_scale` and `input_scale`, everything else bf16. The `bfl_tensor`
/// fixture that the tests above load has the same keys with the same dtypes and ranks, and the
/// released shapes (blocks 1.. laid out as block 0) give `Flux2Config::klein_4b`.
#[test]
fn bfls_released_klein_fp8_file_has_the_fixtures_layout_and_gives_klein_4b() {
    let text = std::fs::read_to_string(dir().join("bfl_klein4b_released.json")).unwrap();
    let released: Vec<(String, Vec<usize>, String)> = serde_json::from_str(&text).unwrap();
    let in_block = |k: &str| k.starts_with("double_blocks.") || k.starts_with("single_blocks.");
    let first = |k: &str| k.starts_with("double_blocks.0.") || k.starts_with("single_blocks.0.");

    // The fixture's keys of block 0 and outside the blocks, with dtype and rank.
    let file =
        flame::safetensors::SafeTensorsFile::open(dir().join("bfl_tensor.safetensors")).unwrap();
    let mut ours: Vec<(String, String, usize)> = file
        .names()
        .filter(|k| !in_block(k) || first(k))
        .map(|k| {
            let info = file.info(k).unwrap();
            (k.to_string(), info.dtype.clone(), info.shape.len())
        })
        .collect();
    ours.sort();
    let mut theirs: Vec<(String, String, usize)> = released
        .iter()
        .map(|(k, s, d)| (k.clone(), d.clone(), s.len()))
        .collect();
    theirs.sort();
    assert_eq!(ours, theirs);

    // The whole file's shapes: each stack's blocks as its block 0.
    let config = Flux2Config::klein_4b();
    let mut shapes: Vec<(String, Vec<usize>)> = Vec::new();
    for (k, s, _) in &released {
        let blocks = [
            ("double_blocks.0.", config.depth, "double_blocks"),
            (
                "single_blocks.0.",
                config.depth_single_blocks,
                "single_blocks",
            ),
        ];
        match blocks.iter().find(|(p, _, _)| k.starts_with(p)) {
            Some((p, n, stack)) => {
                let leaf = &k[p.len()..];
                shapes.extend((0..*n).map(|i| (format!("{stack}.{i}.{leaf}"), s.clone())));
            }
            None => shapes.push((k.clone(), s.clone())),
        }
    }
    let vb = VarBuilder::from_shapes(shapes, DType::BF16, &CPU);
    assert_eq!(Flux2Config::from_single_file(&vb).unwrap(), config);
}
