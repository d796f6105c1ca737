//! The KL autoencoder against diffusers. Fixtures (tests/fixtures/vae) are made by
//! scripts/make_vae_fixtures.py with diffusers 0.42.1 / torch 2.15.0: two tiny random
//! `AutoencoderKL`s (an SDXL-like one with 4 latent channels and quant convs, a Flux-like one
//! with 16 and none), each saved as a diffusers `vae/` folder and in the LDM layout (under
//! `first_stage_model.` as SDXL's single file; bare as BFL's ae.safetensors), with what
//! diffusers computed in f64 (stored in f32): the posterior's mean and clamped logvar, the
//! decoder's image from that mean, and tiled encode / decode with 16-pixel tiles. Beside
//! them a tiny `AutoencoderKLFlux2` (FLUX.2's: 8 latent channels with quant convs, random
//! batch-norm statistics) in both layouts, with the latents its pipeline makes (patched 2x2
//! and normalized) and the pipeline's decode of them.
//!
//! Tolerance: max |flame - diffusers| / max |diffusers| per tensor, 1e-4 in f32 on the CPU.
#![cfg(feature = "cpu-ref")]

mod common;

use flame::encoders::{AutoencoderKl, PatchNorm, VaeConfig, VaeKind, VaeTiling};
use flame::nn::VarBuilder;
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;
const F32_TOL: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vae")
        .join(name)
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture("outputs.safetensors"), &CPU).unwrap()
}

fn folder_config(name: &str) -> VaeConfig {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    VaeConfig::from_json(&serde_json::from_str(&text).unwrap(), None).unwrap()
}

use common::{check_rel as check, rel_err};

/// Encodes every fixture image of `name` and decodes its reference mean; returns the worst
/// error.
fn parity(name: &str, vae: &AutoencoderKl, dev: &Device) -> f64 {
    let io = outputs();
    let images: Vec<&String> = io
        .keys()
        .filter(|k| k.starts_with(&format!("{name}.x")) && k.matches('.').count() == 1)
        .collect();
    assert!(!images.is_empty(), "{name}: no fixture images");
    let mut worst = 0f64;
    for tag in images {
        let x = io[tag].to_device(dev).unwrap();
        let post = vae.encode(&x).unwrap();
        let mut c = |what: &str, got: &Tensor| {
            let want = &io[&format!("{tag}.{what}")];
            worst = worst.max(check(&format!("{tag} {what}"), got, want, F32_TOL));
        };
        c("mean", &post.mean);
        c("logvar", &post.logvar);
        let mean = io[&format!("{tag}.mean")].to_device(dev).unwrap();
        c("decoded", &vae.decode(&mean).unwrap());
    }
    worst
}

/// SDXL-like (8 / 16 wide, 4 norm groups, 4 latent channels, quant convs) from its diffusers
/// folder: posterior and decoded image on a (2, 3, 24, 24) batch and a (1, 3, 48, 40) image;
/// every key read; the scaling from config.json.
#[test]
fn sdxl_like_folder_matches_diffusers() {
    let (vae, vb) =
        AutoencoderKl::load(fixture("sdxl_like"), None, None, DType::F32, &CPU, None).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    assert_eq!(vae.config.scaling, VaeKind::Sdxl.scaling());
    assert!(vae.config.use_quant_conv && vae.config.use_post_quant_conv);
    parity("sdxl_like", &vae, &CPU);
}

/// The same weights in the LDM layout under `first_stage_model.` (resnets `block.M` with
/// `nin_shortcut`, `mid.attn_1` 1x1 convs, the decoder's `up` list reversed) give the same
/// outputs. Widths 8 / 16 are not multiples of 32, so the groups cannot be inferred without
/// the config: the error says so.
#[test]
fn sdxl_like_ldm_file_matches_diffusers() {
    let file = fixture("sdxl_like_ldm.safetensors");
    let e = AutoencoderKl::load(&file, None, None, DType::F32, &CPU, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("give a config"), "{e}");
    let (vae, vb) = AutoencoderKl::load(
        &file,
        Some("first_stage_model."),
        None,
        DType::F32,
        &CPU,
        Some(folder_config("sdxl_like")),
    )
    .unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    parity("sdxl_like", &vae, &CPU);
    // A wrong prefix names the one found.
    let e = AutoencoderKl::load(&file, Some("vae."), None, DType::F32, &CPU, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("first_stage_model."), "{e}");
}

/// Flux-like (16 latent channels, no quant convs; one logvar channel pushed past the clamp)
/// from its folder (scale and shift from config.json) and from a bare LDM file as BFL's
/// ae.safetensors, which needs the family: Flux and SD3 share the shapes.
#[test]
fn flux_like_both_layouts_match_diffusers() {
    let (vae, vb) =
        AutoencoderKl::load(fixture("flux_like"), None, None, DType::F32, &CPU, None).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    assert_eq!(vae.config.scaling, VaeKind::Flux.scaling());
    assert!(!vae.config.use_quant_conv && !vae.config.use_post_quant_conv);
    parity("flux_like", &vae, &CPU);
    let post = vae.encode(&outputs()["flux_like.x48x40"]).unwrap();
    let logvar0 = post.logvar.narrow(1, 0, 1).unwrap().to_vec_f64().unwrap();
    assert!(logvar0.iter().all(|&v| v == 20.0), "the clamp at 20");

    let file = fixture("flux_like_ae.safetensors");
    // Widths 8 are not multiples of 32: the norm groups cannot be inferred.
    let e = AutoencoderKl::load(&file, None, Some(VaeKind::Flux), DType::F32, &CPU, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[8, 8]") && e.contains("give a config"), "{e}");
    let (ldm, vb) = AutoencoderKl::load(
        &file,
        None,
        Some(VaeKind::Sd3),
        DType::F32,
        &CPU,
        Some(folder_config("flux_like")),
    )
    .unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    assert_eq!(ldm.config.scaling, VaeKind::Sd3.scaling(), "kind overrides");
    parity("flux_like", &ldm, &CPU);
}

/// FLUX.2's autoencoder from its diffusers folder (`AutoencoderKLFlux2` by config.json's
/// class) and from a bare LDM file with its `bn.*` statistics (config inferred but for the
/// norm groups): the posterior and decoder as the others, and the latents the pipeline
/// trains on, patched 2x2 into 32 channels and normalized, there and back.
#[test]
fn flux2_like_latents_match_the_pipeline() {
    let io = outputs();
    let tag = "flux2_like.x32x24";
    let folder = fixture("flux2_like");
    let (vae, vb) = AutoencoderKl::load(&folder, None, None, DType::F32, &CPU, None).unwrap();
    // The batch norm's step counter is the one tensor a frozen autoencoder never reads.
    assert_eq!(vb.unused_keys().unwrap(), vec!["bn.num_batches_tracked"]);
    assert_eq!(vae.config.patch_norm, Some(PatchNorm::FLUX2));
    assert_eq!(vae.config.scaling, VaeKind::Flux2.scaling());
    assert_eq!(
        (
            vae.config.diffusion_channels(),
            vae.config.diffusion_downscale()
        ),
        (32, 4)
    );
    parity("flux2_like", &vae, &CPU);
    let x = &io[tag];
    let latents = vae.encode_latents(x).unwrap();
    assert_eq!(latents.dims(), &[2, 32, 8, 6]);
    check("latents", &latents, &io[&format!("{tag}.latents")], F32_TOL);
    let want = &io[&format!("{tag}.latents")];
    check(
        "decode_latents",
        &vae.decode_latents(want).unwrap(),
        &io[&format!("{tag}.from_latents")],
        F32_TOL,
    );
    // Normalizing and back is the identity on the encoder's latents.
    let mean = &io[&format!("{tag}.mean")];
    let back = vae
        .unscale_latents(&vae.scale_latents(mean).unwrap())
        .unwrap();
    check("round trip", &back, mean, 1e-6);
    // A latent of odd height cannot be patched; diffusion latents of the wrong width are
    // refused by name.
    let e = vae
        .scale_latents(&mean.narrow(2, 0, 7).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiples of the patch 2"), "{e}");
    let e = vae.unscale_latents(mean).unwrap_err().to_string();
    assert!(e.contains("unscale_latents") && e.contains("32"), "{e}");

    // FLUX.2's own single file: LDM names, the statistics under bn.; only the norm groups
    // (widths of 8 are no multiple of 32) come from a config.
    let file = fixture("flux2_like_ae.safetensors");
    let cfg = folder_config("flux2_like");
    let (ldm, vb) = AutoencoderKl::load(&file, None, None, DType::F32, &CPU, Some(cfg)).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), vec!["bn.num_batches_tracked"]);
    check(
        "ldm latents",
        &ldm.encode_latents(x).unwrap(),
        &io[&format!("{tag}.latents")],
        F32_TOL,
    );
    // The shape inference finds the patch from the statistics' count.
    let vb = VarBuilder::from_files(&[&file], DType::F32, &CPU)
        .unwrap()
        .with_key_map(flame::encoders::vae_key_map(
            flame::encoders::VaeLayout::Ldm,
            "",
            2,
        ))
        .unwrap();
    let e = VaeConfig::from_shapes(&vb, None).unwrap_err().to_string();
    assert!(e.contains("[8, 8]"), "groups: {e}");

    // A config.json giving the decoder other widths is refused by name.
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
            .unwrap();
    j["decoder_block_out_channels"] = serde_json::json!([8, 16]);
    let e = VaeConfig::from_json(&j, None).unwrap_err().to_string();
    assert!(e.contains("decoder_block_out_channels"), "{e}");
}

/// Shape inference on the shapes of a (32, 64)-wide VAE with 2 ResNets per level (zeros
/// under the keys it reads): 16 latent channels without quant convs need a `VaeKind`; 4 with
/// quant convs are taken as SDXL.
#[test]
fn shape_inference_and_the_family_question() {
    use flame::nn::VarBuilder;
    use std::collections::HashMap;
    let vb = |latent: usize, quant: bool| {
        let mut t = HashMap::new();
        let mut put = |k: &str, s: &[usize]| {
            t.insert(
                k.to_string(),
                Tensor::zeros(s.to_vec(), DType::F32, &CPU).unwrap(),
            );
        };
        put("encoder.conv_in.weight", &[32, 3, 3, 3]);
        for (i, (cin, c)) in [(32, 32), (32, 64)].into_iter().enumerate() {
            for m in 0..2 {
                let k = format!("encoder.down_blocks.{i}.resnets.{m}.conv1.weight");
                put(&k, &[c, if m == 0 { cin } else { c }, 3, 3]);
            }
        }
        put("decoder.conv_in.weight", &[64, latent, 3, 3]);
        put("decoder.conv_out.weight", &[3, 32, 3, 3]);
        put("encoder.mid_block.attentions.0.to_q.weight", &[64, 64]);
        if quant {
            put("quant_conv.weight", &[2 * latent, 2 * latent, 1, 1]);
            put("post_quant_conv.weight", &[latent, latent, 1, 1]);
        }
        VarBuilder::from_tensors(t, DType::F32, &CPU)
    };
    let e = VaeConfig::from_shapes(&vb(16, false), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("VaeKind") && e.contains("0.3611"), "{e}");
    let flux = VaeConfig::from_shapes(&vb(16, false), Some(VaeKind::Flux)).unwrap();
    assert_eq!(
        flux,
        VaeConfig {
            block_out_channels: vec![32, 64],
            ..VaeConfig::for_kind(VaeKind::Flux)
        }
    );
    let sdxl = VaeConfig::from_shapes(&vb(4, true), None).unwrap();
    assert_eq!(
        sdxl,
        VaeConfig {
            block_out_channels: vec![32, 64],
            ..VaeConfig::for_kind(VaeKind::Sdxl)
        }
    );
}

/// Tiled encode and decode (16-pixel tiles, 8-latent tiles, overlap 0.25) of the 48 x 40
/// image equal diffusers' tiled_encode / tiled_decode; and how far tiling moves the result
/// from the untiled one, bounded by what diffusers' own tiling gives on the same fixture.
#[test]
fn tiling_matches_diffusers() {
    let (mut vae, _) =
        AutoencoderKl::load(fixture("sdxl_like"), None, None, DType::F32, &CPU, None).unwrap();
    let io = outputs();
    let x = &io["sdxl_like.x48x40"];
    let mean = &io["sdxl_like.x48x40.mean"];
    let tiling = VaeTiling::new(16);
    let post = vae.encode_tiled(x, tiling).unwrap();
    check(
        "tiled mean",
        &post.mean,
        &io["sdxl_like.x48x40.tiled_mean"],
        F32_TOL,
    );
    check(
        "tiled logvar",
        &post.logvar,
        &io["sdxl_like.x48x40.tiled_logvar"],
        F32_TOL,
    );
    let dec = vae.decode_tiled(mean, tiling).unwrap();
    check(
        "tiled decoded",
        &dec,
        &io["sdxl_like.x48x40.tiled_decoded"],
        F32_TOL,
    );
    // The `tiling` field makes encode / decode tile; an image within one tile is untiled.
    vae.tiling = Some(tiling);
    let auto = vae.encode(x).unwrap();
    assert_eq!(rel_err(&auto.mean, &post.mean), 0.0);
    let small = x.narrow(2, 0, 16).unwrap().narrow(3, 0, 16).unwrap();
    vae.tiling = None;
    let whole = vae.encode(&small).unwrap().mean;
    vae.tiling = Some(tiling);
    assert_eq!(rel_err(&vae.encode(&small).unwrap().mean, &whole), 0.0);
    // Tiled vs untiled: the same gap as diffusers' (its own tiled vs untiled outputs).
    let gap_ref = rel_err(&io["sdxl_like.x48x40.tiled_mean"], mean);
    let gap = rel_err(&post.mean, mean);
    println!("tiled vs untiled mean: {gap:.3e} (diffusers {gap_ref:.3e})");
    assert!((gap - gap_ref).abs() <= F32_TOL, "{gap} vs {gap_ref}");
    let tiny = VaeTiling::new(1);
    assert!(
        vae.encode_tiled(x, tiny).is_err(),
        "a tile smaller than 2 latents"
    );
}

/// Latent scaling: `encode_latents` is `(mean - shift) * scale`, `decode_latents` undoes it;
/// a seeded sample repeats, differs between seeds, and its noise `(sample - mean) / std` is
/// standard normal to within sampling error (mean within 0.1, variance within 0.15 over the
/// 7200 draws of the 15 unclamped channels: about 8 standard errors each).
#[test]
fn scaling_and_sampling() {
    let (vae, _) =
        AutoencoderKl::load(fixture("flux_like"), None, None, DType::F32, &CPU, None).unwrap();
    let io = outputs();
    let x = &io["flux_like.x48x40"];
    let mean = &io["flux_like.x48x40.mean"];
    let (s, sh) = (0.3611, 0.1159);
    let want = mean.affine(s, -sh * s).unwrap();
    check(
        "encode_latents",
        &vae.encode_latents(x).unwrap(),
        &want,
        F32_TOL,
    );
    let back = vae.unscale_latents(&want).unwrap();
    check("unscale", &back, mean, 1e-6);
    check(
        "decode_latents",
        &vae.decode_latents(&want).unwrap(),
        &io["flux_like.x48x40.decoded"],
        F32_TOL,
    );
    let post = vae.encode(x).unwrap();
    let a = post.sample(7).unwrap();
    assert_eq!(rel_err(&post.sample(7).unwrap(), &a), 0.0);
    assert!(rel_err(&post.sample(8).unwrap(), &a) > 0.01);
    // Channels other than the clamped one (std e^10 would swamp the f32 mean).
    let c = 1..16;
    let n = |t: &Tensor| t.narrow(1, 1, c.len()).unwrap();
    let eps = n(&a)
        .sub(&n(&post.mean))
        .unwrap()
        .div(&n(&post.std().unwrap()))
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let m = eps.iter().sum::<f64>() / eps.len() as f64;
    let v = eps.iter().map(|e| (e - m) * (e - m)).sum::<f64>() / eps.len() as f64;
    println!("noise: mean {m:.3}, variance {v:.3} over {}", eps.len());
    assert!(m.abs() < 0.1 && (v - 1.0).abs() < 0.15, "{m} {v}");
    let sampled = vae.encode_latents_sampled(x, 7).unwrap();
    check(
        "encode_latents_sampled",
        &sampled,
        &a.affine(s, -sh * s).unwrap(),
        F32_TOL,
    );
}

/// The full-size presets match the pipelines' vae/config.json.
#[test]
fn presets() {
    let f = VaeConfig::for_kind(VaeKind::Flux);
    assert_eq!(
        (f.latent_channels, f.use_quant_conv, f.downscale()),
        (16, false, 8)
    );
    let x = VaeConfig::for_kind(VaeKind::Sdxl);
    assert_eq!((x.latent_channels, x.use_quant_conv), (4, true));
    assert_eq!(x.block_out_channels, vec![128, 256, 512, 512]);
    let s = VaeKind::Sd3.scaling();
    assert_eq!((s.scale, s.shift), (1.5305, 0.0609));
    let f2 = VaeConfig::for_kind(VaeKind::Flux2);
    assert_eq!(
        (
            f2.latent_channels,
            f2.use_quant_conv,
            f2.diffusion_channels()
        ),
        (32, true, 128)
    );
    assert_eq!(f2.diffusion_downscale(), 16);
}

/// The same parity on the GPU in f32 (composite attention at head width 16).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn vae_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    let (vae, _) =
        AutoencoderKl::load(fixture("sdxl_like"), None, None, DType::F32, &dev, None).unwrap();
    parity("sdxl_like", &vae, &dev);
    let (vae, _) =
        AutoencoderKl::load(fixture("flux_like"), None, None, DType::F32, &dev, None).unwrap();
    parity("flux_like", &vae, &dev);
    let (vae, _) =
        AutoencoderKl::load(fixture("flux2_like"), None, None, DType::F32, &dev, None).unwrap();
    parity("flux2_like", &vae, &dev);
    let io = outputs();
    let x = io["flux2_like.x32x24"].to_device(&dev).unwrap();
    check(
        "latents on cuda",
        &vae.encode_latents(&x).unwrap(),
        &io["flux2_like.x32x24.latents"],
        F32_TOL,
    );
}
