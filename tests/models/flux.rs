//! Flux against diffusers' FluxTransformer2DModel: dev (fixture `flux`, guidance embedding)
//! and schnell (fixture `flux_schnell`, none).

use super::{fixture, parity, vars, Run};
use flame::models::flux::{self, Flux, FluxConfig};
use flame::models::{Checkpoint, Format};
use flame::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

const NAME: &str = "flux";
const SCHNELL: &str = "flux_schnell";

fn config_of(name: &str) -> FluxConfig {
    let ckpt = Checkpoint::open(fixture(name), "transformer").unwrap();
    FluxConfig::from_diffusers(ckpt.config.as_ref().unwrap()).unwrap()
}

fn config() -> FluxConfig {
    config_of(NAME)
}

fn run(path: &Path, io: &BTreeMap<String, Tensor>, device: &Device, dtype: DType) -> Result<Run> {
    run_named(NAME, path, io, device, dtype)
}

/// Loads fixture `name` from `path` (config from the diffusers config.json: the tiny model's
/// head dim 16 has no default RoPE split, so the single file cannot infer it) and runs it,
/// with the guidance input where the fixture has one.
fn run_named(
    name: &str,
    path: &Path,
    io: &BTreeMap<String, Tensor>,
    device: &Device,
    dtype: DType,
) -> Result<Run> {
    let (model, vb) = Flux::load(path, dtype, device, Some(config_of(name)))?;
    vb.set_trainable(|_| true)?;
    let inputs = vars(io, &["img", "txt", "y"]);
    let get = |n: &str| inputs.iter().find(|(k, _)| k == n).map(|(_, t)| t.clone());
    let (img, txt, y) = (get("img").unwrap(), get("txt").unwrap(), get("y").unwrap());
    let output = model.forward(
        &img,
        &io["img_ids"],
        &txt,
        &io["txt_ids"],
        &io["timesteps"],
        &y,
        io.get("guidance"),
    )?;
    Ok(Run { output, inputs, vb })
}

#[test]
fn flux_matches_diffusers_f32_cpu_both_layouts() {
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(NAME, format, &Device::Cpu, DType::F32, |p, io| {
            run(p, io, &Device::Cpu, DType::F32)
        });
    }
}

#[test]
fn flux_schnell_matches_diffusers_f32_cpu_both_layouts() {
    let c = config_of(SCHNELL);
    assert!(!c.guidance_embed);
    assert_eq!((c.depth, c.depth_single_blocks), (1, 1));
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(SCHNELL, format, &Device::Cpu, DType::F32, |p, io| {
            run_named(SCHNELL, p, io, &Device::Cpu, DType::F32)
        });
    }
    // dev refuses to run without its guidance input.
    let (dev, _) = Flux::load(fixture(NAME), DType::F32, &Device::Cpu, None).unwrap();
    let io = super::load_io(NAME, &Device::Cpu, DType::F32);
    let e = dev
        .forward(
            &io["img"],
            &io["img_ids"],
            &io["txt"],
            &io["txt_ids"],
            &io["timesteps"],
            &io["y"],
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("guidance"), "{e}");
}

#[test]
fn flux_packing_and_ids_match_the_pipeline() {
    let io = super::load_io(NAME, &Device::Cpu, DType::F32);
    let packed = flux::pack_latents(&io["latents"]).unwrap();
    assert_eq!(
        packed.to_vec_f64().unwrap(),
        io["img"].to_vec_f64().unwrap()
    );
    let back = flux::unpack_latents(&packed, 4, 3).unwrap();
    assert_eq!(
        back.to_vec_f64().unwrap(),
        io["latents"].to_vec_f64().unwrap()
    );
    let ids = flux::image_ids(4, 3, &Device::Cpu).unwrap();
    assert_eq!(
        ids.to_vec_f64().unwrap(),
        io["img_ids"].to_vec_f64().unwrap()
    );
    assert_eq!(
        flux::text_ids(5, &Device::Cpu)
            .unwrap()
            .to_vec_f64()
            .unwrap(),
        io["txt_ids"].to_vec_f64().unwrap()
    );
}

#[test]
fn flux_config_from_diffusers_json_and_single_file_shapes() {
    let c = config();
    assert_eq!(
        (c.hidden_size, c.num_heads, c.depth, c.depth_single_blocks),
        (32, 2, 2, 2)
    );
    assert_eq!(
        (c.in_channels, c.vec_in_dim, c.context_in_dim),
        (16, 20, 24)
    );
    assert!(c.guidance_embed);
    // The single file's shapes give everything but the RoPE split, which BFL fixes for
    // head dim 128 only: the tiny model's 16 is refused with a message naming it.
    let err = Flux::load(
        fixture(NAME).join("single_file.safetensors"),
        DType::F32,
        &Device::Cpu,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("head dim 16"), "{err}");
}

#[test]
fn flux_reports_missing_and_misshapen_keys() {
    let dir = std::env::temp_dir().join(format!("flame-flux-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = flame::safetensors::load(fixture(NAME).join("single_file.safetensors"), &Device::Cpu)
        .unwrap();
    // Missing: drop one double block's txt qkv bias.
    let mut missing = src.clone();
    missing.remove("double_blocks.1.txt_attn.qkv.bias");
    let p = dir.join("missing.safetensors");
    flame::safetensors::save(missing.iter().map(|(k, v)| (k.as_str(), v)), &p).unwrap();
    let err = Flux::load(&p, DType::F32, &Device::Cpu, Some(config()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("double_blocks.1.txt_attn.qkv.bias") && err.contains("missing"),
        "{err}"
    );
    // Misshapen: a transposed img_in.
    let mut bad = src;
    let w = bad["img_in.weight"].t().unwrap().contiguous().unwrap();
    bad.insert("img_in.weight".into(), w);
    let p = dir.join("bad.safetensors");
    flame::safetensors::save(bad.iter().map(|(k, v)| (k.as_str(), v)), &p).unwrap();
    let err = Flux::load(&p, DType::F32, &Device::Cpu, Some(config()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("img_in.weight") && err.contains("expected shape"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn flux_diffusers_map_fuses_projections() {
    use flame::nn::KeySource;
    let m = flux::diffusers_map(&FluxConfig::dev());
    assert_eq!(
        m("double_blocks.3.txt_attn.qkv.weight"),
        Some(KeySource::Cat(vec![
            ("transformer_blocks.3.attn.add_q_proj.weight".into(), 3072),
            ("transformer_blocks.3.attn.add_k_proj.weight".into(), 3072),
            ("transformer_blocks.3.attn.add_v_proj.weight".into(), 3072),
        ]))
    );
    assert_eq!(
        m("single_blocks.37.linear1.bias"),
        Some(KeySource::Cat(vec![
            ("single_transformer_blocks.37.attn.to_q.bias".into(), 3072),
            ("single_transformer_blocks.37.attn.to_k.bias".into(), 3072),
            ("single_transformer_blocks.37.attn.to_v.bias".into(), 3072),
            ("single_transformer_blocks.37.proj_mlp.bias".into(), 12288),
        ]))
    );
    assert_eq!(
        m("final_layer.adaLN_modulation.1.weight"),
        Some(KeySource::SwapHalves("norm_out.linear.weight".into()))
    );
    assert_eq!(
        m("double_blocks.0.img_attn.norm.key_norm.scale"),
        Some(KeySource::Key(
            "transformer_blocks.0.attn.norm_k.weight".into()
        ))
    );
    assert_eq!(m("double_blocks.0.img_attn.nonsense.weight"), None);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn flux_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(NAME, format, &dev, DType::F32, |p, io| {
            run(p, io, &dev, DType::F32)
        });
        parity(SCHNELL, format, &dev, DType::F32, |p, io| {
            run_named(SCHNELL, p, io, &dev, DType::F32)
        });
    }
    // bf16 weights and activations (flash attention on), against the f64 reference.
    let w = parity(NAME, Format::SingleFile, &dev, DType::BF16, |p, io| {
        run(p, io, &dev, DType::BF16)
    });
    println!("flux bf16 worst relative errors [output, inputs, params]: {w:?}");
}

/// bf16 weights and activations on the CPU backend, within the bf16 bounds.
#[test]
fn flux_matches_diffusers_bf16_cpu() {
    let w = parity(
        NAME,
        Format::SingleFile,
        &Device::Cpu,
        DType::BF16,
        |p, io| run(p, io, &Device::Cpu, DType::BF16),
    );
    println!("flux bf16 cpu worst relative errors [output, inputs, params]: {w:?}");
}
