//! SD3.5 against diffusers' SD3Transformer2DModel: a large-like tiny model (QK norm) and a
//! medium-like one (MMDiT-X dual attention), fixtures `sd35_large` and `sd35_medium`.

use super::{fixture, parity, vars, Run};
use flame::models::sd3::{self, Sd3, Sd3Config};
use flame::models::{Checkpoint, Format};
use flame::nn::KeySource;
use flame::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

const NAMES: [&str; 2] = ["sd35_large", "sd35_medium"];

fn config(name: &str) -> Sd3Config {
    let ckpt = Checkpoint::open(fixture(name), "transformer").unwrap();
    Sd3Config::from_diffusers(ckpt.config.as_ref().unwrap()).unwrap()
}

/// Loads with the config each layout gives on its own (config.json, or the single file's
/// shapes) and runs the fixture.
fn run(path: &Path, io: &BTreeMap<String, Tensor>, device: &Device, dtype: DType) -> Result<Run> {
    let (model, vb) = Sd3::load(path, dtype, device, None)?;
    vb.set_trainable(|k| k != "pos_embed")?;
    let inputs = vars(io, &["x", "context", "y"]);
    let output = model.forward(&inputs[0].1, &io["timesteps"], &inputs[1].1, &inputs[2].1)?;
    Ok(Run { output, inputs, vb })
}

#[test]
fn sd35_matches_diffusers_f32_cpu_both_layouts() {
    for name in NAMES {
        for format in [Format::Diffusers, Format::SingleFile] {
            parity(name, format, &Device::Cpu, DType::F32, |p, io| {
                run(p, io, &Device::Cpu, DType::F32)
            });
        }
    }
}

#[test]
fn sd35_single_file_shapes_give_the_diffusers_config() {
    for name in NAMES {
        let ckpt =
            Checkpoint::open(fixture(name).join("single_file.safetensors"), "transformer").unwrap();
        assert_eq!(ckpt.prefix, "model.diffusion_model.");
        let vb = ckpt
            .var_builder(
                DType::F32,
                &Device::Cpu,
                sd3::diffusers_map(&Sd3Config::large()),
            )
            .unwrap();
        assert_eq!(
            Sd3Config::from_single_file(&vb).unwrap(),
            config(name),
            "{name}"
        );
    }
    let medium = config("sd35_medium");
    assert_eq!(medium.dual_attention_layers, vec![0, 1]);
    assert!(medium.qk_norm);
}

#[test]
fn sd35_diffusers_map() {
    let m = sd3::diffusers_map(&Sd3Config::medium());
    assert_eq!(
        m("joint_blocks.23.context_block.adaLN_modulation.1.weight"),
        Some(KeySource::SwapHalves(
            "transformer_blocks.23.norm1_context.linear.weight".into()
        ))
    );
    assert_eq!(
        m("joint_blocks.22.context_block.adaLN_modulation.1.bias"),
        Some(KeySource::Key(
            "transformer_blocks.22.norm1_context.linear.bias".into()
        ))
    );
    assert_eq!(
        m("joint_blocks.5.x_block.attn2.qkv.weight"),
        Some(KeySource::Cat(vec![
            ("transformer_blocks.5.attn2.to_q.weight".into(), 1536),
            ("transformer_blocks.5.attn2.to_k.weight".into(), 1536),
            ("transformer_blocks.5.attn2.to_v.weight".into(), 1536),
        ]))
    );
    assert_eq!(
        m("joint_blocks.5.context_block.attn.ln_k.weight"),
        Some(KeySource::Key(
            "transformer_blocks.5.attn.norm_added_k.weight".into()
        ))
    );
    assert_eq!(
        m("pos_embed"),
        Some(KeySource::Key("pos_embed.pos_embed".into()))
    );
    assert_eq!(m("joint_blocks.5.context_block.attn2.ln_k.weight"), None);
}

#[test]
fn sd35_rejects_a_grid_larger_than_the_position_table() {
    let (model, _) = Sd3::load(fixture("sd35_large"), DType::F32, &Device::Cpu, None).unwrap();
    let x = Tensor::randn((1, 4, 18, 8), DType::F32, &Device::Cpu, 1).unwrap();
    let t = Tensor::from_slice(&[500f32], 1, &Device::Cpu).unwrap();
    let ctx = Tensor::randn((1, 3, 24), DType::F32, &Device::Cpu, 2).unwrap();
    let y = Tensor::randn((1, 20), DType::F32, &Device::Cpu, 3).unwrap();
    let err = model.forward(&x, &t, &ctx, &y).unwrap_err().to_string();
    assert!(err.contains("pos_embed_max_size 8"), "{err}");
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn sd35_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    for name in NAMES {
        for format in [Format::Diffusers, Format::SingleFile] {
            parity(name, format, &dev, DType::F32, |p, io| {
                run(p, io, &dev, DType::F32)
            });
        }
        let w = parity(name, Format::SingleFile, &dev, DType::BF16, |p, io| {
            run(p, io, &dev, DType::BF16)
        });
        println!("{name} bf16 worst relative errors [output, inputs, params]: {w:?}");
    }
}

/// bf16 weights and activations on the CPU backend, within the bf16 bounds.
#[test]
fn sd35_matches_diffusers_bf16_cpu() {
    for name in NAMES {
        parity(
            name,
            Format::Diffusers,
            &Device::Cpu,
            DType::BF16,
            |p, io| run(p, io, &Device::Cpu, DType::BF16),
        );
    }
}
