//! FLUX.2 [klein], Z-Image, SD3.5 medium and SDXL from GGUF files in the layout of the
//! released ones (scripts/make_gguf_family_fixtures.py: city96's converter's key names, types,
//! reshaped SDXL tensors and dropped size-1 dims): each tiny model, loaded with its quantized
//! Linears packed, equals the same model loaded from the weights the GGUF dequantizes to, in
//! f32 on the CPU: the loss and every LoRA gradient, before and after a step. Refused, naming
//! the tensor: a recorded original shape that does not fit the tensor.
#![cfg(feature = "cpu-ref")]

mod common;
use common::gguf::{gguf_bytes, kv_str, Entry};
use flame::backend::ggml::GgmlType;
use flame::gguf::GgufFile;
use flame::models::{family, LoadOptions, Objective};
use flame::nn::{Adapters, LoraConfig};
use flame::optim::{Optimizer, Sgd, SgdConfig};
use flame::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-gguf-fam-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The GGUF's every tensor dequantized to f32 as a safetensors single file, each in the shape
/// the model reads (Z-Image's pad tokens, stored without their leading 1, as (1, dim)).
fn dequantized(gguf: &Path, dst: &Path) {
    let f = GgufFile::open(gguf).unwrap();
    let t: Vec<(String, Tensor)> = f
        .names()
        .map(|n| {
            let t = f.load_as(n, &CPU, DType::F32).unwrap();
            let t = if n.ends_with("pad_token") && t.dims().len() == 1 {
                t.reshape((1, t.dims()[0])).unwrap()
            } else {
                t
            };
            (n.to_string(), t)
        })
        .collect();
    // The tiny models' configs ride along as in the GGUF (their shapes do not pin them).
    let meta: std::collections::BTreeMap<String, String> = f
        .metadata()
        .get("config")
        .map(|c| ("config".to_string(), c.as_str().unwrap().to_string()))
        .into_iter()
        .collect();
    flame::safetensors::save_with_metadata(t.iter().map(|(n, t)| (n.as_str(), t)), &meta, dst)
        .unwrap();
}

fn adapters(arch: &str) -> std::sync::Arc<Adapters> {
    let r = flame::train::init::RECIPES
        .iter()
        .find(|r| r.arch == arch)
        .unwrap();
    Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        dropout: 0.0,
        targets: r.targets.iter().map(|s| s.to_string()).collect(),
        seed: 3,
    })
    .unwrap()
}

struct Model {
    m: flame::models::Loaded<dyn flame::models::DiffusionModel>,
    adapters: std::sync::Arc<Adapters>,
}

fn load(arch: &str, path: &Path) -> Model {
    let adapters = adapters(arch);
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(adapters.clone());
    Model {
        m: family(arch).unwrap().load(path, &opts).unwrap(),
        adapters,
    }
}

/// A size each rule admits: twice a multiple (latents of 2x2 patches at least), 3 for any.
fn size(rule: flame::models::Size) -> usize {
    match rule {
        flame::models::Size::Exactly(n) => n,
        flame::models::Size::MultipleOf(1) => 3,
        flame::models::Size::MultipleOf(m) => 2 * m,
    }
}

/// The loss of one forward on inputs made from `seed`, and the LoRA gradients by key.
fn loss_and_grads(model: &Model, seed: u64) -> (f32, Vec<(String, Vec<f32>)>) {
    let m = &model.m.model;
    let shapes: Vec<Vec<usize>> = m
        .inputs()
        .iter()
        .map(|i| {
            let mut s = vec![1];
            s.extend(i.dims.iter().map(|r| size(*r)));
            s
        })
        .collect();
    m.check_shapes(&shapes.iter().map(|s| s[1..].to_vec()).collect::<Vec<_>>())
        .unwrap();
    let n = |s: &[usize], k: u64| Tensor::randn(s.to_vec(), DType::F32, &CPU, seed + k).unwrap();
    let xt = n(&shapes[0], 0);
    let cond: Vec<Tensor> = shapes[1..]
        .iter()
        .enumerate()
        .map(|(i, s)| n(s, i as u64 + 1))
        .collect();
    let t = match m.objective() {
        Objective::FlowMatching => 0.4,
        Objective::Ddpm(_) => 400.0,
    };
    let t = Tensor::full(t, 1, DType::F32, &CPU).unwrap();
    let out = m.predict(&xt, &t, &cond, 3.5).unwrap();
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

/// One SGD step on the LoRA parameters, so that B is no longer zero and A gets gradients.
fn step(model: &Model) {
    let (_, _) = loss_and_grads(model, 90);
    let m = &model.m.model;
    let shapes: Vec<Vec<usize>> = m
        .inputs()
        .iter()
        .map(|i| {
            let mut s = vec![1];
            s.extend(i.dims.iter().map(|r| size(*r)));
            s
        })
        .collect();
    let n = |s: &[usize], k: u64| Tensor::randn(s.to_vec(), DType::F32, &CPU, 70 + k).unwrap();
    let cond: Vec<Tensor> = shapes[1..]
        .iter()
        .enumerate()
        .map(|(i, s)| n(s, i as u64 + 1))
        .collect();
    let t = match m.objective() {
        Objective::FlowMatching => 0.7,
        Objective::Ddpm(_) => 700.0,
    };
    let t = Tensor::full(t, 1, DType::F32, &CPU).unwrap();
    let out = m.predict(&n(&shapes[0], 0), &t, &cond, 2.0).unwrap();
    let grads = out.sqr().unwrap().mean_all().unwrap().backward().unwrap();
    let mut opt = Sgd::new(
        model.adapters.params().unwrap(),
        SgdConfig {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    opt.step(&grads).unwrap();
}

/// Within 1e-4 of the largest value: the packed Linear adds its bias after the product where
/// the dense one fuses it, which moves the f32 roundings (1e-5 relative seen on SDXL's
/// smallest gradients); a weight decoded wrong differs by its whole size.
fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: sizes");
    let max = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * max,
            "{what} [{i}]: {x} against {y} (max {max})"
        );
    }
}

/// The GGUF `file` of family `arch` against its dequantized weights; returns how many
/// weights were held packed.
fn parity(arch: &str, file: &str) -> usize {
    let d = temp(arch);
    let gguf = fixture(file);
    let dense = d.join("dense.safetensors");
    dequantized(&gguf, &dense);
    let reference = load(arch, &dense);
    let packed = load(arch, &gguf);
    let f = GgufFile::open(&gguf).unwrap();
    let mut n_packed = 0;
    for (k, t) in packed.m.vb.params().unwrap() {
        let Some(info) = f.info(&k) else { continue };
        if t.dtype() == DType::U32 {
            assert!(info.ty.is_quantized(), "{k}");
            let (out, inp) = packed.m.vb.packed_dims(&k).unwrap().unwrap();
            assert_eq!(vec![out, inp], info.shape, "{k}");
            n_packed += 1;
        }
    }
    assert!(
        packed.m.vb.unused_keys().unwrap().is_empty(),
        "{arch}: {:?}",
        packed.m.vb.unused_keys().unwrap()
    );
    let (l0, g0) = loss_and_grads(&reference, 40);
    let (l1, g1) = loss_and_grads(&packed, 40);
    assert!(l0.is_finite() && l0 > 0.0, "{arch}: loss {l0}");
    assert_close(&format!("{arch} loss"), &[l1], &[l0]);
    for ((k0, a), (k1, b)) in g0.iter().zip(&g1) {
        assert_eq!(k0, k1);
        assert_close(&format!("{arch} {k0}"), b, a);
    }
    step(&reference);
    step(&packed);
    let (l0, g0) = loss_and_grads(&reference, 50);
    let (l1, g1) = loss_and_grads(&packed, 50);
    assert_close(&format!("{arch} loss after a step"), &[l1], &[l0]);
    let mut nonzero = 0;
    for ((k, a), (_, b)) in g0.iter().zip(&g1) {
        assert_close(&format!("{arch} {k} after a step"), b, a);
        nonzero += usize::from(a.iter().any(|v| *v != 0.0));
    }
    // Most LoRA tensors get a gradient (in the tiny SDXL some see too few positions to).
    assert!(
        nonzero * 5 >= g0.len() * 4,
        "{arch}: {nonzero} of {} LoRA tensors get a gradient",
        g0.len()
    );
    std::fs::remove_dir_all(&d).ok();
    n_packed
}

#[test]
fn a_gguf_flux2_klein_equals_its_dequantized_weights() {
    let f = GgufFile::open(fixture("flux2-tiny-Q8_0.gguf")).unwrap();
    assert_eq!(f.metadata()["general.architecture"].as_str(), Some("flux"));
    // The converter's types: the embedders kept, the blocks' and modulations' Linears packed.
    for (name, ty) in [
        ("img_in.weight", GgmlType::F32),
        ("txt_in.weight", GgmlType::BF16),
        ("double_blocks.0.img_attn.qkv.weight", GgmlType::Q8_0),
        ("double_stream_modulation_img.lin.weight", GgmlType::Q8_0),
        ("single_blocks.1.linear2.weight", GgmlType::Q8_0),
        (
            "double_blocks.0.img_attn.norm.query_norm.scale",
            GgmlType::F32,
        ),
    ] {
        assert_eq!(f.info(name).map(|i| i.ty), Some(ty), "{name}");
    }
    assert!(parity("flux2", "flux2-tiny-Q8_0.gguf") >= 10);
}

#[test]
fn a_gguf_z_image_equals_its_dequantized_weights() {
    let f = GgufFile::open(fixture("zimage-tiny-Q4_0.gguf")).unwrap();
    assert_eq!(
        f.metadata()["general.architecture"].as_str(),
        Some("lumina2")
    );
    // The pad tokens without their leading 1; the refiners kept; the layers' Linears packed.
    assert_eq!(f.info("x_pad_token").unwrap().shape, vec![32]);
    for (name, ty) in [
        ("layers.0.attention.qkv.weight", GgmlType::Q4_0),
        ("layers.1.feed_forward.w1.weight", GgmlType::Q4_0),
        ("context_refiner.0.attention.qkv.weight", GgmlType::BF16),
        ("t_embedder.mlp.0.weight", GgmlType::BF16),
    ] {
        assert_eq!(f.info(name).map(|i| i.ty), Some(ty), "{name}");
    }
    assert!(parity("zimage", "zimage-tiny-Q4_0.gguf") >= 6);
}

#[test]
fn a_gguf_sd35_medium_equals_its_dequantized_weights() {
    let f = GgufFile::open(fixture("sd35_medium-tiny-Q5_0.gguf")).unwrap();
    assert_eq!(f.metadata()["general.architecture"].as_str(), Some("sd3"));
    // pos_embed kept 3-D, the embedders in F16, the joint blocks' Linears packed.
    assert_eq!(f.info("pos_embed").unwrap().shape.len(), 3);
    for (name, ty) in [
        ("joint_blocks.0.x_block.attn.qkv.weight", GgmlType::Q5_0),
        ("joint_blocks.0.x_block.attn2.qkv.weight", GgmlType::Q5_0),
        (
            "joint_blocks.1.context_block.adaLN_modulation.1.weight",
            GgmlType::Q5_0,
        ),
        ("context_embedder.weight", GgmlType::F16),
        ("final_layer.linear.weight", GgmlType::F16),
    ] {
        assert_eq!(f.info(name).map(|i| i.ty), Some(ty), "{name}");
    }
    assert!(parity("sd3", "sd35_medium-tiny-Q5_0.gguf") >= 10);
}

#[test]
fn a_gguf_sdxl_with_reshaped_tensors_equals_its_dequantized_weights() {
    let f = GgufFile::open(fixture("sdxl-tiny-Q8_0.gguf")).unwrap();
    assert_eq!(f.metadata()["general.architecture"].as_str(), Some("sdxl"));
    // A 3x3 convolution stored as rows of 256 with its shape in the metadata reads in it.
    let conv = "input_blocks.8.0.in_layers.2.weight";
    assert!(f
        .metadata()
        .contains_key(&format!("{}{conv}", flame::gguf::ORIG_SHAPE_PREFIX)));
    assert_eq!(f.info(conv).unwrap().shape, vec![16, 16, 3, 3]);
    assert_eq!(f.info(conv).unwrap().ty, GgmlType::Q8_0);
    // One of fewer than 512 values is left as it is.
    let small = "input_blocks.1.0.in_layers.2.weight";
    assert_eq!(f.info(small).unwrap().shape, vec![4, 4, 3, 3]);
    assert_eq!(f.info(small).unwrap().ty, GgmlType::F16);
    let ff = "input_blocks.4.1.transformer_blocks.0.ff.net.2.weight";
    assert_eq!(f.info(ff).unwrap().ty, GgmlType::Q8_0);
    assert_eq!(f.info(ff).unwrap().shape, vec![8, 32]);
    assert_eq!(f.info("out.2.weight").unwrap().ty, GgmlType::F16);
    parity("sdxl", "sdxl-tiny-Q8_0.gguf");
}

/// A recorded original shape whose values are not the tensor's is refused, naming the tensor
/// and the metadata key.
#[test]
fn an_original_shape_that_does_not_fit_is_refused_naming_the_tensor() {
    let d = temp("orig-shape");
    let entry = Entry {
        name: "w".into(),
        shape: vec![2, 256],
        ty: GgmlType::F32,
        bytes: vec![0; 2 * 256 * 4],
    };
    // An array (type 9) of two INT32 (type 5).
    let mut arr = 5u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    for v in [3i32, 100] {
        arr.extend(v.to_le_bytes());
    }
    let key = format!("{}w", flame::gguf::ORIG_SHAPE_PREFIX);
    let kvs = [
        ("general.architecture", kv_str("sdxl")),
        (key.as_str(), (9u32, arr)),
    ];
    let p = d.join("bad.gguf");
    std::fs::write(&p, gguf_bytes(3, &kvs, &[entry], 32)).unwrap();
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(
        e.contains("'w'") || e.contains("w:") || e.contains(" w "),
        "{e}"
    );
    assert!(
        e.contains(&key) && e.contains("[3, 100]") && e.contains("512"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).ok();
}
