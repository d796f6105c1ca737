//! Flux from a GGUF file (city96's layout: BFL's single-file key names, Linear weights in
//! GGML blocks, norms and biases as F32/F16): a tiny Flux (the trainer's tiny stand-in) written
//! as GGUF with Q8_0 and Q4_K Linear weights, whose forward and LoRA gradients equal the same
//! model on the weights gguf dequantizes, in f32, with its blocks resident or streamed; the
//! planner counting the packed bytes; and a few training steps through the trainer.
#![cfg(feature = "cpu-ref")]

mod common;
use common::gguf::{gguf_bytes, kv_str, quantize_q8_0, random_blocks, Entry};
use flame::backend::ggml::GgmlType;
use flame::gguf::GgufFile;
use flame::memory::Plan;
use flame::models::flux::{self, Flux};
use flame::models::{load_as, profile_as, LoadOptions, RunShape};
use flame::nn::{Adapters, LoraConfig};
use flame::optim::{Optimizer, Sgd, SgdConfig};
use flame::train::{RunOptions, TrainConfig, Trainer};
use flame::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-gguf-flux-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The GGML type a tensor of `shape` under `name` is written in, as city96's converter
/// chooses: Linear weights whose rows are whole K-quant blocks in Q4_K, whole 32-blocks in
/// Q8_0, the rest (narrow Linears, norms, biases) F32, biases F16.
fn type_for(name: &str, shape: &[usize]) -> GgmlType {
    match shape {
        [_, cols] if name.ends_with(".weight") && cols % 256 == 0 => GgmlType::Q4_K,
        [_, cols] if name.ends_with(".weight") && cols % 32 == 0 => GgmlType::Q8_0,
        _ if name.ends_with(".bias") => GgmlType::F16,
        _ => GgmlType::F32,
    }
}

/// Writes the single-file safetensors Flux at `src` as GGUF at `dst`: Q8_0 from the values
/// (gguf-py's quantization), Q4_K as random blocks of small scale (no Q4_K quantizer is
/// needed: any blocks are a valid model), F16 and F32 from the values. Returns the types.
fn to_gguf(src: &Path, dst: &Path) -> HashMap<String, GgmlType> {
    let f = flame::safetensors::SafeTensorsFile::open(src).unwrap();
    let mut entries = vec![];
    let mut types = HashMap::new();
    for (i, name) in f.names().enumerate() {
        let t = f.load(name, &CPU).unwrap();
        let shape = t.dims().to_vec();
        let v = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let ty = type_for(name, &shape);
        let bytes = match ty {
            GgmlType::Q4_K => random_blocks(ty, v.len(), i as u64 + 1, 2e-4),
            GgmlType::Q8_0 => quantize_q8_0(&v),
            GgmlType::F16 => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        types.insert(name.to_string(), ty);
        entries.push(Entry {
            name: name.to_string(),
            shape,
            ty,
            bytes,
        });
    }
    // The tiny model's config rides along as in the safetensors file (its shapes do not pin
    // the RoPE axes down).
    let config = f.metadata().get("config").expect("the tiny file's config");
    let kvs = [
        ("general.architecture", kv_str("flux")),
        ("config", kv_str(config)),
    ];
    let b = gguf_bytes(3, &kvs, &entries, 32);
    std::fs::write(dst, b).unwrap();
    types
}

/// The GGUF's every tensor dequantized to f32, written as a safetensors single file with
/// the same config metadata.
fn dequantized(gguf: &Path, dst: &Path) {
    let f = GgufFile::open(gguf).unwrap();
    let t: Vec<(String, Tensor)> = f
        .names()
        .map(|n| (n.to_string(), f.load_as(n, &CPU, DType::F32).unwrap()))
        .collect();
    let config = f.metadata()["config"].as_str().unwrap().to_string();
    let meta = std::collections::BTreeMap::from([("config".to_string(), config)]);
    flame::safetensors::save_with_metadata(t.iter().map(|(n, t)| (n.as_str(), t)), &meta, dst)
        .unwrap();
}

/// The tiny stand-in model and samples of the trainer (`train --make-tiny`) under `dir`,
/// with its model also as GGUF and as the GGUF dequantized: (config path, gguf, dense).
fn tiny(dir: &Path, steps: usize) -> (PathBuf, PathBuf, PathBuf) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/flux-tiny-encoded.toml");
    let text = std::fs::read_to_string(example)
        .unwrap()
        .replace("steps = 200", &format!("steps = {steps}"))
        .replace("save_every = 50", "save_every = 2")
        .replace("warmup_steps = 10", "warmup_steps = 1")
        .replace("device = \"auto\"", "device = \"cpu\"");
    let p = dir.join("train.toml");
    std::fs::write(&p, &text).unwrap();
    flame::train::demo::make_tiny(&TrainConfig::from_file(&p).unwrap()).unwrap();
    let (src, gguf, dense) = (
        dir.join("tiny/flux-tiny.safetensors"),
        dir.join("tiny/flux-tiny.gguf"),
        dir.join("tiny/flux-tiny-dequantized.safetensors"),
    );
    let types = to_gguf(&src, &gguf);
    assert!(types.values().any(|t| *t == GgmlType::Q4_K));
    assert!(types.values().any(|t| *t == GgmlType::Q8_0));
    dequantized(&gguf, &dense);
    (p, gguf, dense)
}

const TARGETS: [&str; 4] = [
    "double_blocks.*_attn.qkv",
    "double_blocks.*_mlp.2",
    "single_blocks.*.linear*",
    "final_layer.linear",
];

fn adapters() -> std::sync::Arc<Adapters> {
    Adapters::new(LoraConfig {
        rank: 4,
        alpha: 4.0,
        dropout: 0.0,
        targets: TARGETS.iter().map(|s| s.to_string()).collect(),
        seed: 3,
    })
    .unwrap()
}

/// The model at `path` with fresh adapters (the same initial values every time).
struct Model {
    m: flame::models::Loaded<Flux>,
    adapters: std::sync::Arc<Adapters>,
}

fn load(path: &Path, plan: Plan) -> Model {
    let adapters = adapters();
    let mut opts = LoadOptions::new(DType::F32, &CPU).with_adapters(adapters.clone());
    opts.memory = plan;
    Model {
        m: load_as::<Flux>(path, &opts, None).unwrap(),
        adapters,
    }
}

/// The loss of one forward on fixed inputs, and the LoRA parameters' gradients by key.
fn loss_and_grads(model: &Model) -> (f32, Vec<(String, Vec<f32>)>) {
    let m = &model.m;
    let cfg = flame::train::demo::flux_tiny_config();
    let n = |shape: &[usize], seed| Tensor::randn(shape.to_vec(), DType::F32, &CPU, seed).unwrap();
    let (h, w, t) = (2, 3, 4);
    let img = n(&[1, h * w, cfg.in_channels], 40);
    let txt = n(&[1, t, cfg.context_in_dim], 41);
    let y = n(&[1, cfg.vec_in_dim], 42);
    let ts = Tensor::full(0.4, 1, DType::F32, &CPU).unwrap();
    let g = Tensor::full(3.5, 1, DType::F32, &CPU).unwrap();
    let (ii, ti) = (
        flux::image_ids(h, w, &CPU).unwrap(),
        flux::text_ids(t, &CPU).unwrap(),
    );
    let out = m
        .model
        .forward(&img, &ii, &txt, &ti, &ts, &y, Some(&g))
        .unwrap();
    let loss = out.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let params = model.adapters.params().unwrap();
    assert!(!params.is_empty());
    let gs = params
        .iter()
        .map(|(k, p)| {
            let g = grads
                .get(p)
                .unwrap_or_else(|| panic!("no gradient for {k}"));
            (k.clone(), g.flatten_all().unwrap().to_vec::<f32>().unwrap())
        })
        .collect();
    (loss.to_vec::<f32>().unwrap()[0], gs)
}

/// One SGD step on the LoRA parameters with `m`'s gradients (so that B is no longer zero and
/// A gets gradients too).
fn step(model: &Model) {
    let m = &model.m;
    let params = model.adapters.params().unwrap();
    let cfg = flame::train::demo::flux_tiny_config();
    let n = |shape: &[usize], seed| Tensor::randn(shape.to_vec(), DType::F32, &CPU, seed).unwrap();
    let (ii, ti) = (
        flux::image_ids(2, 3, &CPU).unwrap(),
        flux::text_ids(4, &CPU).unwrap(),
    );
    let out = m
        .model
        .forward(
            &n(&[1, 6, cfg.in_channels], 50),
            &ii,
            &n(&[1, 4, cfg.context_in_dim], 51),
            &ti,
            &Tensor::full(0.7, 1, DType::F32, &CPU).unwrap(),
            &n(&[1, cfg.vec_in_dim], 52),
            Some(&Tensor::full(2.0, 1, DType::F32, &CPU).unwrap()),
        )
        .unwrap();
    let grads = out.sqr().unwrap().mean_all().unwrap().backward().unwrap();
    let mut opt = Sgd::new(
        params,
        SgdConfig {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    opt.step(&grads).unwrap();
}

fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: sizes");
    let max = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * max,
            "{what} [{i}]: {x} against {y} (max {max})"
        );
    }
}

#[test]
fn a_gguf_flux_equals_its_dequantized_weights_in_f32_resident_and_streamed() {
    let d = temp("parity");
    let (_, gguf, dense) = tiny(&d, 2);
    let reference = load(&dense, Plan::default());
    let packed = load(&gguf, Plan::default());
    // The quantized Linears are held packed: u32 words, their (out, in) recorded.
    let f = GgufFile::open(&gguf).unwrap();
    let mut n_packed = 0;
    for (k, t) in packed.m.vb.params().unwrap() {
        let Some(info) = f.info(&k) else { continue };
        if info.ty.is_quantized() {
            assert_eq!(t.dtype(), DType::U32, "{k}");
            assert_eq!(t.elem_count(), info.bytes.div_ceil(4), "{k}");
            let (out, inp) = packed.m.vb.packed_dims(&k).unwrap().unwrap();
            assert_eq!(vec![out, inp], info.shape, "{k}");
            n_packed += 1;
        } else {
            assert_eq!(t.dtype(), DType::F32, "{k}");
        }
    }
    assert!(n_packed >= 8, "{n_packed} packed weights");
    assert!(packed.m.vb.unused_keys().unwrap().is_empty());

    let (l0, g0) = loss_and_grads(&reference);
    let (l1, g1) = loss_and_grads(&packed);
    assert_close("loss", &[l1], &[l0]);
    for ((k0, a), (k1, b)) in g0.iter().zip(&g1) {
        assert_eq!(k0, k1);
        assert_close(k0, b, a);
    }
    // After a step B is no longer zero: A's gradients are compared too.
    step(&reference);
    step(&packed);
    let (l0, g0) = loss_and_grads(&reference);
    let (l1, g1) = loss_and_grads(&packed);
    assert_close("loss after a step", &[l1], &[l0]);
    let mut nonzero = 0;
    for ((k, a), (_, b)) in g0.iter().zip(&g1) {
        assert_close(k, b, a);
        nonzero += usize::from(a.iter().any(|v| *v != 0.0));
    }
    assert_eq!(nonzero, g0.len(), "every LoRA tensor gets a gradient");

    // Streamed: the blocks' packed words live in host memory and come to the device around
    // their runs; the values are the same.
    let streamed = load(
        &gguf,
        Plan {
            streamed: vec!["double_blocks.0".into(), "single_blocks.0".into()],
            ..Plan::default()
        },
    );
    let (l2, _) = loss_and_grads(&streamed);
    let fresh = load(&gguf, Plan::default());
    let (l3, g3) = loss_and_grads(&fresh);
    let (_, g2) = loss_and_grads(&streamed);
    assert_eq!(l2.to_bits(), l3.to_bits(), "streamed loss");
    for ((k, a), (_, b)) in g3.iter().zip(&g2) {
        assert_eq!(a, b, "{k}: streamed gradient");
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn the_planner_counts_gguf_weights_at_their_packed_size() {
    let d = temp("plan");
    let (_, gguf, dense) = tiny(&d, 2);
    let run = RunShape {
        sample: vec![vec![4, 4, 6], vec![4, 32], vec![16]],
        batch: 1,
        optimizer_bytes_per_value: 8.0,
    };
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(adapters());
    let p = profile_as::<Flux>(&gguf, &opts, &run).unwrap();
    let q = profile_as::<Flux>(&dense, &opts, &run).unwrap();
    let f = GgufFile::open(&gguf).unwrap();
    for (b, bq) in p.blocks.iter().zip(&q.blocks) {
        // Each tensor of the block as the load holds it: quantized ones as their words,
        // others in f32 (the load's dtype).
        let want: u64 = f
            .names()
            .filter(|n| n.starts_with(&format!("{}.", b.prefix)))
            .map(|n| {
                let i = f.info(n).unwrap();
                if i.ty.is_quantized() {
                    (i.bytes.div_ceil(4) * 4) as u64
                } else {
                    (i.elem_count() * 4) as u64
                }
            })
            .sum();
        assert_eq!(b.weight_bytes, want, "{}", b.prefix);
        assert!(b.weight_bytes < bq.weight_bytes, "{}", b.prefix);
        assert!(b.decode_bytes > 0, "{}: packed weights decode", b.prefix);
        assert_eq!(bq.decode_bytes, 0);
        // The same work: FLOPs count the weights' values, not their words.
        assert_eq!(b.gemm_flops, bq.gemm_flops, "{}", b.prefix);
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_lora_trains_over_a_gguf_base_through_the_trainer() {
    let d = temp("train");
    let (cfg_path, gguf, _) = tiny(&d, 4);
    let text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("tiny/flux-tiny.safetensors", "tiny/flux-tiny.gguf");
    std::fs::write(&cfg_path, text).unwrap();
    let cfg = TrainConfig::from_file(&cfg_path).unwrap();
    assert_eq!(cfg.model.path, gguf);
    Trainer::new(cfg.clone())
        .unwrap()
        .run(&RunOptions::default(), &mut |_| {})
        .unwrap();
    let log = flame::train::rundir::read_log(&cfg.train.output_dir.join("loss.jsonl")).unwrap();
    assert_eq!(log.len(), 4);
    for (_, line) in &log {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["loss"].as_f64().unwrap().is_finite(), "{line}");
    }
    let lora =
        flame::safetensors::load(cfg.train.output_dir.join("lora.safetensors"), &CPU).unwrap();
    assert!(!lora.is_empty());
    std::fs::remove_dir_all(&d).ok();
}

/// 8-bit products need float or FP8 weights: a GGUF base is refused by name (the `train`
/// binary's `model.compute = "fp8"` and `sample --compute fp8` both ask this), a
/// safetensors one is taken on the CPU.
#[test]
fn eight_bit_products_refuse_a_gguf_base() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let gguf = root.join("gguf/flux-random-tiny-Q4_K_S.gguf");
    let why = flame::models::fp8_products_refusal(&gguf, &Device::Cpu).expect("refused");
    assert!(
        why.contains("GGUF") && why.contains("flux-random-tiny"),
        "{why}"
    );
    let st = root.join("flux2_fp8/diffusers_tensor.safetensors");
    assert!(st.is_file());
    assert_eq!(flame::models::fp8_products_refusal(&st, &Device::Cpu), None);
    // Int8 products the same (`model.compute = "int8"`).
    let int8 = flame::backend::fp8::Code8::Int8;
    let why = flame::models::products_refusal(int8, &gguf, &Device::Cpu).expect("refused");
    assert!(why.contains("GGUF"), "{why}");
    assert_eq!(
        flame::models::products_refusal(int8, &st, &Device::Cpu),
        None
    );
}
