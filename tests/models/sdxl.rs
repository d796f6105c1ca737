//! The SDXL UNet against diffusers' UNet2DConditionModel (fixture `sdxl`: block_out_channels
//! (4, 8, 16), 2 res blocks, transformer depths [0, 1, 2] and 2 in the middle, heads
//! (1, 2, 4), 2 norm groups, text width 24, y = 20 pooled + 6 x 8 time ids).

use super::{fixture, parity, parity_within, vars, Run, SDXL_BF16_TOL};
use flame::models::sdxl::{self, SdxlConfig, Unet};
use flame::models::{Checkpoint, Format};
use flame::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

const NAME: &str = "sdxl";

/// The fixture whose level widths are not multiples of the first: block_out_channels
/// (4, 6, 10), heads (1, 2, 5), otherwise `sdxl`'s.
const WIDTHS: &str = "sdxl_widths";

fn config() -> SdxlConfig {
    config_of(NAME)
}

fn config_of(name: &str) -> SdxlConfig {
    let ckpt = Checkpoint::open(fixture(name), "unet").unwrap();
    SdxlConfig::from_diffusers(ckpt.config.as_ref().unwrap()).unwrap()
}

/// Loads from `path` (config from the diffusers config.json: the tiny model's 4 channels per
/// head and 2 norm groups are not SDXL's 64 and 32, which a single file cannot show) and
/// runs the fixture with y built from text_embeds and time_ids.
fn run(path: &Path, io: &BTreeMap<String, Tensor>, device: &Device, dtype: DType) -> Result<Run> {
    run_as(config(), path, io, device, dtype)
}

fn run_as(
    cfg: SdxlConfig,
    path: &Path,
    io: &BTreeMap<String, Tensor>,
    device: &Device,
    dtype: DType,
) -> Result<Run> {
    let (model, vb) = Unet::load(path, dtype, device, Some(cfg.clone()))?;
    vb.set_trainable(|_| true)?;
    let inputs = vars(io, &["x", "context", "text_embeds"]);
    let (x, context, text) = (&inputs[0].1, &inputs[1].1, &inputs[2].1);
    let y = sdxl::sdxl_vector(text, &io["time_ids"], cfg.addition_time_embed_dim)?;
    let output = model.forward(x, &io["timesteps"], context, &y)?;
    Ok(Run { output, inputs, vb })
}

#[test]
fn sdxl_matches_diffusers_f32_cpu_both_layouts() {
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(NAME, format, &Device::Cpu, DType::F32, |p, io| {
            run(p, io, &Device::Cpu, DType::F32)
        });
    }
}

/// Level widths that are not multiples of the first (4, 6, 10), as diffusers builds them:
/// the same outputs and gradients in both layouts, and the single file's shapes give the
/// same widths.
#[test]
fn sdxl_with_widths_not_multiples_of_the_first_matches_diffusers() {
    let cfg = config_of(WIDTHS);
    assert_eq!(cfg.block_out_channels, vec![4, 6, 10]);
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(WIDTHS, format, &Device::Cpu, DType::F32, |p, io| {
            run_as(cfg.clone(), p, io, &Device::Cpu, DType::F32)
        });
    }
    let ckpt = Checkpoint::open(fixture(WIDTHS).join("single_file.safetensors"), "unet").unwrap();
    let vb = ckpt
        .var_builder(DType::F32, &Device::Cpu, sdxl::diffusers_map(&cfg))
        .unwrap();
    let inferred = SdxlConfig::from_single_file_with(&vb, 2, 2).unwrap();
    assert_eq!(inferred.block_out_channels, vec![4, 6, 10]);
}

#[test]
fn sdxl_config_from_diffusers_json_and_single_file_shapes() {
    let c = config();
    assert_eq!(
        (c.model_channels, &c.block_out_channels, c.num_res_blocks),
        (4, &vec![4, 8, 16], 2)
    );
    assert_eq!(
        (&c.transformer_depth, c.transformer_depth_middle),
        (&vec![0, 1, 2], 2)
    );
    assert_eq!(
        (&c.num_heads, c.num_groups, c.context_dim),
        (&vec![1, 2, 4], 2, 24)
    );
    assert_eq!((c.adm_in_channels, c.addition_time_embed_dim), (68, 8));
    assert_eq!((c.in_channels, c.out_channels), (4, 4));
    let ckpt = Checkpoint::open(fixture(NAME).join("single_file.safetensors"), "unet").unwrap();
    assert_eq!(ckpt.prefix, "model.diffusion_model.");
    let vb = ckpt
        .var_builder(DType::F32, &Device::Cpu, sdxl::diffusers_map(&c))
        .unwrap();
    // The shapes give everything but the head width, the norm groups and the width of one
    // micro-conditioning embedding (only the total y width shows).
    let inferred = SdxlConfig::from_single_file_with(&vb, 4, 2).unwrap();
    assert_eq!(
        SdxlConfig {
            addition_time_embed_dim: 8,
            ..inferred
        },
        c
    );
    // With SDXL's 64 channels per head the tiny model is refused, naming the channels.
    let err = SdxlConfig::from_single_file(&vb).unwrap_err().to_string();
    assert!(
        err.contains("4 channels") && err.contains("heads of 64"),
        "{err}"
    );
}

#[test]
fn sdxl_reports_missing_and_misshapen_keys() {
    let dir = std::env::temp_dir().join(format!("flame-sdxl-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = flame::safetensors::load(fixture(NAME).join("single_file.safetensors"), &Device::Cpu)
        .unwrap();
    let p = "model.diffusion_model.";
    // Missing: one cross-attention key projection of the second level.
    let key = "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight";
    let mut missing = src.clone();
    assert!(missing.remove(&format!("{p}{key}")).is_some());
    let path = dir.join("missing.safetensors");
    flame::safetensors::save(missing.iter().map(|(k, v)| (k.as_str(), v)), &path).unwrap();
    let err = Unet::load(&path, DType::F32, &Device::Cpu, Some(config()))
        .unwrap_err()
        .to_string();
    assert!(err.contains(key) && err.contains("missing"), "{err}");
    // Misshapen: a transposed vector embedding.
    let key = "label_emb.0.0.weight";
    let mut bad = src;
    let w = bad[&format!("{p}{key}")].t().unwrap().contiguous().unwrap();
    bad.insert(format!("{p}{key}"), w);
    let path = dir.join("bad.safetensors");
    flame::safetensors::save(bad.iter().map(|(k, v)| (k.as_str(), v)), &path).unwrap();
    let err = Unet::load(&path, DType::F32, &Device::Cpu, Some(config()))
        .unwrap_err()
        .to_string();
    assert!(err.contains(key) && err.contains("expected shape"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Real SDXL base 1.0 names: the LDM keys of `sd_xl_base_1.0.safetensors` against the keys
/// of `stabilityai/stable-diffusion-xl-base-1.0/unet`, as diffusers'
/// `convert_ldm_unet_checkpoint` pairs them.
#[test]
fn sdxl_diffusers_map_on_sdxl_base_keys() {
    let cfg = SdxlConfig::base();
    let m = sdxl::diffusers_map(&cfg);
    let pairs = [
        ("time_embed.0.weight", "time_embedding.linear_1.weight"),
        ("time_embed.2.bias", "time_embedding.linear_2.bias"),
        ("label_emb.0.0.weight", "add_embedding.linear_1.weight"),
        ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
        ("input_blocks.0.0.weight", "conv_in.weight"),
        (
            "input_blocks.1.0.in_layers.0.weight",
            "down_blocks.0.resnets.0.norm1.weight",
        ),
        (
            "input_blocks.2.0.emb_layers.1.bias",
            "down_blocks.0.resnets.1.time_emb_proj.bias",
        ),
        (
            "input_blocks.3.0.op.weight",
            "down_blocks.0.downsamplers.0.conv.weight",
        ),
        (
            "input_blocks.4.0.skip_connection.weight",
            "down_blocks.1.resnets.0.conv_shortcut.weight",
        ),
        (
            "input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight",
            "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k.weight",
        ),
        (
            "input_blocks.5.1.proj_in.bias",
            "down_blocks.1.attentions.1.proj_in.bias",
        ),
        (
            "input_blocks.6.0.op.bias",
            "down_blocks.1.downsamplers.0.conv.bias",
        ),
        (
            "input_blocks.8.1.transformer_blocks.9.ff.net.0.proj.weight",
            "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.0.proj.weight",
        ),
        (
            "middle_block.0.out_layers.3.weight",
            "mid_block.resnets.0.conv2.weight",
        ),
        (
            "middle_block.1.transformer_blocks.9.attn1.to_out.0.weight",
            "mid_block.attentions.0.transformer_blocks.9.attn1.to_out.0.weight",
        ),
        (
            "middle_block.2.out_layers.0.bias",
            "mid_block.resnets.1.norm2.bias",
        ),
        (
            "output_blocks.0.0.skip_connection.bias",
            "up_blocks.0.resnets.0.conv_shortcut.bias",
        ),
        (
            "output_blocks.0.1.norm.weight",
            "up_blocks.0.attentions.0.norm.weight",
        ),
        (
            "output_blocks.2.2.conv.weight",
            "up_blocks.0.upsamplers.0.conv.weight",
        ),
        (
            "output_blocks.4.1.transformer_blocks.0.norm3.bias",
            "up_blocks.1.attentions.1.transformer_blocks.0.norm3.bias",
        ),
        (
            "output_blocks.5.2.conv.bias",
            "up_blocks.1.upsamplers.0.conv.bias",
        ),
        (
            "output_blocks.8.0.in_layers.2.weight",
            "up_blocks.2.resnets.2.conv1.weight",
        ),
        ("out.0.weight", "conv_norm_out.weight"),
        ("out.2.bias", "conv_out.bias"),
    ];
    for (ldm, diffusers) in pairs {
        assert_eq!(
            m(ldm),
            Some(flame::nn::KeySource::Key(diffusers.into())),
            "{ldm}"
        );
    }
    // Keys SDXL base does not have: attention at the top level, a downsampler at the last
    // level, an upsampler at the top, a tenth input block, a ResBlock part that is not one.
    for ldm in [
        "input_blocks.1.1.proj_in.weight",
        "output_blocks.8.1.proj_in.weight",
        "input_blocks.9.0.in_layers.0.weight",
        "output_blocks.8.1.conv.weight",
        "output_blocks.2.1.conv.weight",
        "input_blocks.1.0.in_layers.1.weight",
        "middle_block.3.in_layers.0.weight",
    ] {
        assert_eq!(m(ldm), None, "{ldm}");
    }
}

#[test]
fn sdxl_base_config_from_diffusers_and_refusals() {
    // stabilityai/stable-diffusion-xl-base-1.0/unet/config.json (its architecture fields).
    let json: serde_json::Value = serde_json::from_str(
        r#"{
        "_class_name": "UNet2DConditionModel",
        "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
        "block_out_channels": [320, 640, 1280], "center_input_sample": false,
        "class_embed_type": null, "class_embeddings_concat": false, "conv_in_kernel": 3,
        "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": null,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "downsample_padding": 1, "dual_cross_attention": false, "encoder_hid_dim": null,
        "encoder_hid_dim_type": null, "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4,
        "layers_per_block": 2, "mid_block_only_cross_attention": null,
        "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
        "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": null,
        "num_class_embeds": null, "only_cross_attention": false, "out_channels": 4,
        "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0,
        "resnet_skip_time_act": false, "resnet_time_scale_shift": "default", "sample_size": 128,
        "time_cond_proj_dim": null, "time_embedding_act_fn": null, "time_embedding_dim": null,
        "time_embedding_type": "positional", "timestep_post_act": null,
        "transformer_layers_per_block": [1, 2, 10],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "upcast_attention": null, "use_linear_projection": true
    }"#,
    )
    .unwrap();
    assert_eq!(
        SdxlConfig::from_diffusers(&json).unwrap(),
        SdxlConfig::base()
    );
    for (field, value) in [
        ("use_linear_projection", serde_json::json!(false)),
        ("addition_embed_type", serde_json::json!("text")),
        ("norm_eps", serde_json::json!(1e-6)),
        ("num_attention_heads", serde_json::json!([5, 10, 20])),
        ("resnet_time_scale_shift", serde_json::json!("scale_shift")),
        (
            "up_block_types",
            serde_json::json!(["UpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]),
        ),
        ("layers_per_block", serde_json::json!([2, 2, 3])),
    ] {
        let mut j = json.clone();
        j[field] = value;
        let err = SdxlConfig::from_diffusers(&j).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
}

/// Sources: PyTorch 2.5.1 `F.interpolate(x, size=(to, 1), mode="nearest")` on arange(from).
#[test]
fn sdxl_nearest_resize_matches_pytorch() {
    let want: [(usize, usize, &[u32]); 5] = [
        (3, 5, &[0, 0, 1, 1, 2]),
        (2, 3, &[0, 0, 1]),
        (3, 7, &[0, 0, 0, 1, 1, 2, 2]),
        (7, 13, &[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]),
        (6, 11, &[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]),
    ];
    for (from, to, ids) in want {
        assert_eq!(sdxl::nearest_indices(from, to), ids, "{from} -> {to}");
    }
    let x = Tensor::arange(0.0, 6.0, DType::F32, &Device::Cpu)
        .unwrap()
        .reshape((1, 1, 3, 2))
        .unwrap();
    let y = sdxl::interpolate_nearest(&x, (5, 4)).unwrap();
    assert_eq!(y.dims(), [1, 1, 5, 4]);
    let rows: [f64; 5] = [0.0, 0.0, 2.0, 2.0, 4.0];
    let want: Vec<f64> = rows
        .iter()
        .flat_map(|r| [*r, *r, r + 1.0, r + 1.0])
        .collect();
    assert_eq!(y.to_vec_f64().unwrap(), want);
}

/// A made-up tiny SDXL with random weights runs on sizes not divisible by 4 (odd levels),
/// and keeps the input size, as diffusers does.
#[test]
fn sdxl_runs_on_odd_sizes() {
    let cfg = SdxlConfig {
        model_channels: 8,
        block_out_channels: vec![8, 12, 20],
        transformer_depth: vec![0, 1, 1],
        num_heads: vec![1, 2, 4],
        transformer_depth_middle: 1,
        context_dim: 12,
        adm_in_channels: 10,
        num_groups: 4,
        ..SdxlConfig::base()
    };
    let vb = flame::nn::VarBuilder::random(7, 0.1, DType::F32, &Device::Cpu);
    let unet = Unet::new(&vb, &cfg).unwrap();
    for (h, w) in [(13, 10), (7, 5), (12, 8)] {
        let dev = &Device::Cpu;
        let x = Tensor::randn((1, 4, h, w), DType::F32, dev, 1).unwrap();
        let t = Tensor::from_vec(vec![500f32], 1, dev).unwrap();
        let ctx = Tensor::randn((1, 3, 12), DType::F32, dev, 2).unwrap();
        let y = Tensor::randn((1, 10), DType::F32, dev, 3).unwrap();
        let out = unet.forward(&x, &t, &ctx, &y).unwrap();
        assert_eq!(out.dims(), [1, 4, h, w]);
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn sdxl_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    for format in [Format::Diffusers, Format::SingleFile] {
        parity(NAME, format, &dev, DType::F32, |p, io| {
            run(p, io, &dev, DType::F32)
        });
    }
    let w = parity_within(
        NAME,
        Format::SingleFile,
        &dev,
        DType::BF16,
        SDXL_BF16_TOL,
        |p, io| run(p, io, &dev, DType::BF16),
    );
    println!("sdxl bf16 worst relative errors [output, inputs, params]: {w:?}");
}

/// The bf16 bounds hold on the CPU backend too.
#[test]
fn sdxl_matches_diffusers_bf16_cpu() {
    parity_within(
        NAME,
        Format::SingleFile,
        &Device::Cpu,
        DType::BF16,
        SDXL_BF16_TOL,
        |p, io| run(p, io, &Device::Cpu, DType::BF16),
    );
}
