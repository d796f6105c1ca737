//! The Z-Image transformer against diffusers' `ZImageTransformer2DModel` on a tiny random
//! model (tests/fixtures/zimage, made by scripts/make_zimage_fixtures.py in float64 with
//! diffusers 0.42.1, stored in f32): forward output, the input gradients (latents, caption
//! features) and every parameter's gradient of loss = sum(output * loss_weight), from the
//! diffusers folder, the original single file and that file with ComfyUI's
//! `model.diffusion_model.` prefix. The batch is two samples whose captions (5 and 37 tokens)
//! pad to different lengths, so both the pad tokens and the batch's key mask are exercised.
//!
//! Tolerance: max |flame - diffusers| / max |diffusers| per tensor, [`TOL`] in f32.
#![cfg(feature = "cpu-ref")]

use flame::autograd::recorded_ops;
use flame::models::zimage::{self, ZImage, ZImageBlock, ZImageConfig};
use flame::models::{load_as, profile_config, DiffusionModel, LoadOptions, ModelSpec, RunShape};
use flame::nn::{Adapters, LoraConfig, VarBuilder};
use flame::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

/// f32 against the f64 reference: the bound of tests/models.rs (1e-4); diffusers' own
/// float32 RMSNorm variance and RoPE product sit at ~1e-7.
const TOL: f64 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zimage")
}

fn io() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture().join("io.safetensors"), &CPU).unwrap()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn config() -> ZImageConfig {
    ZImageConfig::from_diffusers(&json(&fixture().join("transformer/config.json"))).unwrap()
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "shapes");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    err / scale.max(f64::MIN_POSITIVE)
}

/// Loads the fixture from `path` (the tiny model's head dim 16 has no default RoPE split,
/// so both layouts take the config.json's config), runs the fixture's inputs and checks
/// output, input gradients and every parameter gradient. Returns the worst errors.
fn parity(path: &Path) -> [f64; 3] {
    parity_on(path, &CPU)
}

/// [`parity`] with the model and inputs on `dev`.
fn parity_on(path: &Path, dev: &Device) -> [f64; 3] {
    let io = io();
    let on = |k: &str| io[k].to_device(dev).unwrap();
    let (model, vb) = ZImage::load(path, DType::F32, dev, Some(config())).unwrap();
    vb.set_trainable(|_| true).unwrap();
    let lat = on("latents").detach().requires_grad_().unwrap();
    let cap = on("cap_feats").detach().requires_grad_().unwrap();
    let out = model
        .forward(&lat, &on("timesteps"), &cap, &on("cap_mask"))
        .unwrap();
    let e_out = rel_err(&out, &io["output"]);
    assert!(e_out <= TOL, "{path:?}: output error {e_out:e}");
    let loss = out.mul(&on("loss_weight")).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let mut e_in = 0f64;
    for (name, t) in [("latents", &lat), ("cap_feats", &cap)] {
        let e = rel_err(grads.get(t).unwrap(), &io[&format!("grad.{name}")]);
        assert!(e <= TOL, "{path:?}: grad.{name} error {e:e}");
        e_in = e_in.max(e);
    }
    let want = flame::safetensors::load(fixture().join("grads.safetensors"), &CPU).unwrap();
    let params: BTreeMap<String, Tensor> = vb.trainable_params().unwrap().into_iter().collect();
    assert_eq!(
        params.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "trainable parameters vs fixture gradients"
    );
    let mut e_p = 0f64;
    for (k, p) in &params {
        let g = grads
            .get(p)
            .unwrap_or_else(|| panic!("no gradient for {k}"));
        let e = rel_err(g, &want[k]);
        assert!(e <= TOL, "{path:?}: grad of {k} error {e:e}");
        e_p = e_p.max(e);
    }
    println!("{path:?}: output {e_out:.2e}, input grads {e_in:.2e}, param grads {e_p:.2e}");
    [e_out, e_in, e_p]
}

#[test]
fn zimage_matches_diffusers_f32_cpu_both_layouts() {
    parity(&fixture());
    parity(&fixture().join("single_file.safetensors"));
    // ComfyUI's files: the same keys under `model.diffusion_model.`.
    let dir = std::env::temp_dir().join(format!("flame-zimage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("comfy.safetensors");
    let t = flame::safetensors::load(fixture().join("single_file.safetensors"), &CPU).unwrap();
    let prefixed: Vec<(String, Tensor)> = t
        .into_iter()
        .map(|(k, v)| (format!("model.diffusion_model.{k}"), v))
        .collect();
    flame::safetensors::save(prefixed.iter().map(|(k, v)| (k.as_str(), v)), &file).unwrap();
    parity(&file);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same parity on the GPU in f32, both layouts.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn zimage_matches_diffusers_f32_cuda_both_layouts() {
    let dev = Device::cuda(0).unwrap();
    parity_on(&fixture(), &dev);
    parity_on(&fixture().join("single_file.safetensors"), &dev);
}

/// `predict` is the pipeline's use of the model: run at 1 - t, output negated.
#[test]
fn zimage_predict_is_the_negated_output_at_one_minus_t() {
    let io = io();
    let (model, _) = ZImage::load(fixture(), DType::F32, &CPU, None).unwrap();
    let t = io["timesteps"].affine(-1.0, 1.0).unwrap();
    let cond = [io["cap_feats"].clone(), io["cap_mask"].clone()];
    let pred = model.predict(&io["latents"], &t, &cond, 1.0).unwrap();
    let e = rel_err(&pred.neg().unwrap(), &io["output"]);
    assert!(e <= TOL, "predict: {e:e}");
    // A caption of the second sample padded further (T 37 -> 70, mask zeros) changes
    // nothing: the padding is hidden whatever its length and content.
    let extra = Tensor::randn((2, 33, 24), DType::F32, &CPU, 7).unwrap();
    let cap = Tensor::cat(&[&io["cap_feats"], &extra], 1).unwrap();
    let mask = Tensor::cat(
        &[
            &io["cap_mask"],
            &Tensor::zeros((2, 33), DType::F32, &CPU).unwrap(),
        ],
        1,
    )
    .unwrap();
    let out = model
        .forward(&io["latents"], &io["timesteps"], &cap, &mask)
        .unwrap();
    let e = rel_err(&out, &io["output"]);
    assert!(e <= TOL, "longer padding: {e:e}");
    // A mask that is not ones then zeros is refused.
    let holes = Tensor::from_vec(
        (0..74)
            .map(|i| f32::from(u8::from(i % 2 == 0)))
            .collect::<Vec<_>>(),
        (2, 37),
        &CPU,
    )
    .unwrap();
    let e = model
        .forward(&io["latents"], &io["timesteps"], &io["cap_feats"], &holes)
        .unwrap_err()
        .to_string();
    assert!(e.contains("caption mask"), "{e}");
    assert!(model.predict(&io["latents"], &t, &cond[..1], 1.0).is_err());
}

#[test]
fn zimage_patchify_is_the_pipelines() {
    let io = io();
    let x = &io["latents"];
    let p = zimage::patchify(x, 2).unwrap();
    assert_eq!(p.dims(), [2, 12, 16]);
    // Token (r, c) holds latents[:, 2r + i, 2c + j] at channel-last index (i, j, ch).
    let (xv, pv) = (x.to_vec_f64().unwrap(), p.to_vec_f64().unwrap());
    let (b, r, c, i, j, ch) = (1, 2, 1, 1, 0, 3);
    let want = xv[((b * 4 + ch) * 8 + 2 * r + i) * 6 + 2 * c + j];
    let got = pv[(b * 12 + r * 3 + c) * 16 + (i * 2 + j) * 4 + ch];
    assert_eq!(got, want);
    let back = zimage::unpatchify(&p, 4, 3, 2).unwrap();
    assert_eq!(back.to_vec_f64().unwrap(), xv);
}

/// The released transformer's key list (both layouts, from diffusers at its default config):
/// every key FLAME reads is there with its shape, every key there is read, and the config
/// inferred from the single file's shapes and the one read from config.json are the
/// released one.
#[test]
fn zimage_6b_key_lists_load_and_give_the_released_config() {
    let doc = json(&fixture().join("keylist_6b.json"));
    let list = |layout: &str| -> Vec<(String, Vec<usize>)> {
        serde_json::from_value(doc[layout].clone()).unwrap()
    };
    let six = ZImageConfig::z_image_6b();
    assert_eq!(ZImageConfig::from_diffusers(&doc["config"]).unwrap(), six);
    let vb = VarBuilder::from_shapes(list("original"), DType::BF16, &CPU);
    assert_eq!(ZImageConfig::from_single_file(&vb).unwrap(), six);
    ZImage::new(&vb, &six).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    let vb = VarBuilder::from_shapes(list("diffusers"), DType::BF16, &CPU)
        .with_key_map(zimage::diffusers_map(&six))
        .unwrap();
    ZImage::new(&vb, &six).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    assert_eq!(six.ffn_hidden(), 10240);
    assert_eq!(six.head_dim(), 128);
}

#[test]
fn zimage_config_from_json_and_shapes() {
    let c = config();
    let want = ZImageConfig {
        in_channels: 4,
        dim: 32,
        n_layers: 2,
        n_refiner_layers: 1,
        n_heads: 2,
        cap_feat_dim: 24,
        axes_dims: vec![4, 6, 6],
        axes_lens: vec![128, 16, 16],
        ..ZImageConfig::z_image_6b()
    };
    assert_eq!(c, want);
    // The tiny single file's head dim 16 has no known RoPE split: a config error, not a guess.
    let e = ZImage::load(
        fixture().join("single_file.safetensors"),
        DType::F32,
        &CPU,
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("RoPE axes"), "{e}");
    // Omni's SigLIP branch and grouped key/value heads are refused by name.
    let mut j = json(&fixture().join("transformer/config.json"));
    j["siglip_feat_dim"] = 16.into();
    let e = ZImageConfig::from_diffusers(&j).unwrap_err().to_string();
    assert!(e.contains("siglip_feat_dim"), "{e}");
    let mut j = json(&fixture().join("transformer/config.json"));
    j["n_kv_heads"] = 1.into();
    let e = ZImageConfig::from_diffusers(&j).unwrap_err().to_string();
    assert!(e.contains("n_kv_heads"), "{e}");
}

/// A single file without a tensor, or with one of the wrong shape, is an error naming it.
#[test]
fn zimage_missing_or_misshapen_key_is_named() {
    let t = flame::safetensors::load(fixture().join("single_file.safetensors"), &CPU).unwrap();
    let dir = std::env::temp_dir().join(format!("flame-zimage-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, edit: &dyn Fn(&str, &Tensor) -> Option<Tensor>| {
        let v: Vec<(String, Tensor)> = t
            .iter()
            .filter_map(|(k, x)| edit(k, x).map(|x| (k.clone(), x)))
            .collect();
        let path = dir.join(name);
        flame::safetensors::save(v.iter().map(|(k, x)| (k.as_str(), x)), &path).unwrap();
        ZImage::load(&path, DType::F32, &CPU, Some(config()))
            .err()
            .unwrap()
            .to_string()
    };
    let key = "layers.1.feed_forward.w3.weight";
    let e = write("missing.safetensors", &|k, x| (k != key).then(|| x.clone()));
    assert!(e.contains(key), "{e}");
    let key = "layers.0.attention.qkv.weight";
    let e = write("shape.safetensors", &|k, x| {
        Some(if k == key {
            x.narrow(0, 0, 64).unwrap().contiguous().unwrap()
        } else {
            x.clone()
        })
    });
    assert!(e.contains(key), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn block_lora(cfg: &ZImageConfig) -> std::sync::Arc<Adapters> {
    Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        dropout: 0.0,
        targets: cfg
            .block_prefixes()
            .iter()
            .map(|p| format!("{p}.*"))
            .collect(),
        seed: 5,
    })
    .unwrap()
}

/// LoRA on every Linear of the blocks: the model is unchanged at the start, gradients
/// reach every adapter's up projection, and the files name the layers as diffusers (PEFT,
/// q / k / v split) and kohya / ComfyUI (original keys) do.
#[test]
fn zimage_lora_on_every_block_linear() {
    let io = io();
    let cfg = config();
    let a = block_lora(&cfg);
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
    let l = load_as::<ZImage>(fixture(), &opts, Some(cfg.clone())).unwrap();
    // Each block: qkv, out, w1, w2, w3 (+ adaLN_modulation.0 where modulated).
    let n = cfg.n_refiner_layers;
    assert_eq!(a.layers().unwrap().len(), 6 * n + 5 * n + 6 * cfg.n_layers);
    let out = l
        .model
        .forward(
            &io["latents"],
            &io["timesteps"],
            &io["cap_feats"],
            &io["cap_mask"],
        )
        .unwrap();
    assert!(rel_err(&out, &io["output"]) <= TOL);
    let grads = out
        .mul(&io["loss_weight"])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let params = a.params().unwrap();
    let mut ups = 0;
    for (k, p) in &params {
        if k.contains("lora_B") || k.contains("lora_up") || k.ends_with(".up") {
            let g = grads
                .get(p)
                .unwrap_or_else(|| panic!("no gradient for {k}"));
            let m = g
                .to_vec_f64()
                .unwrap()
                .iter()
                .fold(0f64, |m, v| m.max(v.abs()));
            assert!(m > 0.0, "{k}: zero gradient");
            ups += 1;
        }
    }
    assert_eq!(
        ups,
        a.layers().unwrap().len(),
        "{:?}",
        params.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    let dir = std::env::temp_dir().join(format!("flame-zimage-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    a.save_peft(
        dir.join("peft.safetensors"),
        &l.key_map,
        "transformer",
        DType::F32,
    )
    .unwrap();
    a.save_kohya(dir.join("kohya.safetensors"), DType::F32)
        .unwrap();
    let names = |f: &str| -> Vec<String> {
        flame::safetensors::load(dir.join(f), &CPU)
            .unwrap()
            .into_keys()
            .collect()
    };
    let peft = names("peft.safetensors");
    for k in [
        "transformer.layers.0.attention.to_q.lora_A.weight",
        "transformer.layers.0.attention.to_v.lora_B.weight",
        "transformer.layers.1.attention.to_out.0.lora_B.weight",
        "transformer.noise_refiner.0.adaLN_modulation.0.lora_A.weight",
        "transformer.context_refiner.0.feed_forward.w2.lora_A.weight",
    ] {
        assert!(peft.iter().any(|n| n == k), "{k} not in {peft:?}");
    }
    let kohya = names("kohya.safetensors");
    for k in [
        "lora_unet_layers_0_attention_qkv.lora_down.weight",
        "lora_unet_context_refiner_0_feed_forward_w1.lora_up.weight",
    ] {
        assert!(kohya.iter().any(|n| n == k), "{k} not in {kohya:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The block shapes' declared op and view counts against the ones the blocks record with an
/// adapter on every Linear (as tests/plan.rs checks the registered families), and the
/// planner's profile of the tiny model.
#[test]
fn zimage_declared_ops_are_the_ones_the_blocks_record() {
    let cfg = ZImageConfig {
        n_layers: 4,
        ..config()
    };
    let a = block_lora(&cfg);
    let vb = VarBuilder::random(3, 0.3, DType::F32, &CPU)
        .with_adapters(a.clone())
        .unwrap();
    let modulated = ZImageBlock::new(&vb.pp("layers").pp(0), &cfg, true).unwrap();
    let plain = ZImageBlock::new(&vb.pp("context_refiner").pp(0), &cfg, false).unwrap();
    let randn = |s: Vec<usize>, seed| Tensor::randn(s, DType::F32, &CPU, seed).unwrap();
    // Past the first adapted block every block's input needs a gradient.
    let x = randn(vec![1, 32, cfg.dim], 1).requires_grad_().unwrap();
    let c = randn(vec![1, cfg.adaln_dim()], 2);
    let pe = flame::nn::EmbedNd {
        theta: 256.0,
        axes_dim: cfg.axes_dims.clone(),
    }
    .forward(&Tensor::zeros((1, 32, 3), DType::F32, &CPU).unwrap())
    .unwrap();
    let count = |f: &dyn Fn()| {
        let (a, b) = recorded_ops();
        f();
        let (c, d) = recorded_ops();
        (c - a, d - b)
    };
    let m = count(&|| {
        modulated.forward(&x, Some(&c), &pe, None).unwrap();
    });
    let p = count(&|| {
        plain.forward(&x, None, &pe, None).unwrap();
    });
    println!("modulated block records {m:?}, context refiner block {p:?}");
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(block_lora(&cfg));
    let run = RunShape {
        sample: vec![vec![4, 8, 8], vec![20, 24], vec![20]],
        batch: 1,
        optimizer_bytes_per_value: 8.0,
    };
    let prof = profile_config::<ZImage>(&cfg, &opts, &run).unwrap();
    assert_eq!(prof.blocks.len(), cfg.block_prefixes().len());
    let ops: f64 = prof.blocks.iter().map(|b| b.ops).sum();
    let views: f64 = prof.blocks.iter().map(|b| b.views).sum();
    let n = cfg.n_refiner_layers as u64;
    let blocks = (
        (n + cfg.n_layers as u64) * m.0 + n * p.0,
        (n + cfg.n_layers as u64) * m.1 + n * p.1,
    );
    // The whole model's forward on a sample of the profile's shapes, as tests/plan.rs
    // counts the registered families.
    let fresh = VarBuilder::random(3, 0.3, DType::F32, &CPU)
        .with_adapters(block_lora(&cfg))
        .unwrap();
    let model = ZImage::new(&fresh, &cfg).unwrap();
    let whole = count(&|| {
        model
            .forward(
                &randn(vec![1, 4, 8, 8], 3),
                &Tensor::full(0.4, 1, DType::F32, &CPU).unwrap(),
                &randn(vec![1, 20, 24], 4),
                &Tensor::ones((1, 20), DType::F32, &CPU).unwrap(),
            )
            .unwrap();
    });
    println!("blocks record {blocks:?}, the whole forward {whole:?}");
    for (what, declared, seen) in [
        ("ops", ops, blocks.0),
        ("views", views, blocks.1),
        ("ops of the whole forward", ops, whole.0),
        ("views of the whole forward", views, whole.1),
    ] {
        let err = declared / seen as f64 - 1.0;
        assert!(
            err.abs() < 0.10,
            "{what}: {declared} declared, {seen} recorded"
        );
    }
    // Every block holds its weights; the shapes see padded tokens (16 -> 32, 20 -> 32).
    assert!(prof.blocks.iter().all(|b| b.weight_bytes > 0));
    let shapes = ZImage::block_shapes(&cfg, &run.sample).unwrap();
    assert_eq!(
        shapes.iter().map(|s| s.tokens).collect::<Vec<_>>(),
        vec![32, 32, 64, 64, 64, 64]
    );
}

/// The family's entry: registered under "zimage", its pipeline Qwen3 with Z-Image's prompt,
/// the Qwen3 hidden state and its mask handed over as `context` / `context_mask`, and the
/// sampler's sigmas as `ZImagePipeline` sets them (diffusers 0.42.1,
/// `FlowMatchEulerDiscreteScheduler(shift=3.0)` over `get_default_z_image_sigmas`).
#[test]
fn zimage_family_pipeline() {
    use flame::encoders::Qwen3Output;
    use flame::models::{SampleSetup, TextOutput};
    let f = flame::models::family("zimage").unwrap();
    let p = f.pipeline;
    assert_eq!((p.text[0].name, p.text[0].max_len), ("qwen3", 512));
    let hidden = Tensor::randn((2, 6, 4), DType::F32, &Device::Cpu, 3).unwrap();
    let mask = Tensor::from_vec(
        vec![1u32, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0],
        (2, 6),
        &Device::Cpu,
    )
    .unwrap();
    let out = TextOutput::Qwen3(Qwen3Output {
        hidden: vec![hidden.clone()],
        mask,
    });
    let named = (p.combine)(&[out]).unwrap();
    assert_eq!(named[0].0, "context");
    assert_eq!(
        named[0].1.to_vec::<f32>().unwrap(),
        hidden.to_vec::<f32>().unwrap()
    );
    assert_eq!(named[1].0, "context_mask");
    assert_eq!(
        named[1].1.to_vec::<f32>().unwrap(),
        vec![1.0f32, 1., 1., 0., 0., 0., 1., 1., 1., 1., 1., 0.]
    );
    assert!((p.combine)(&[]).is_err());
    let want: [&[f64]; 2] = [
        &[1.0, 0.9, 0.75, 0.5, 0.0],
        &[
            1.0, 0.96, 0.9130436, 0.8571428, 0.7894737, 0.7058824, 0.6, 0.4615385, 0.2727273, 0.0,
        ],
    ];
    for (steps, want) in [4usize, 9].into_iter().zip(want) {
        let setup = SampleSetup {
            steps,
            guided: false,
            latent_hw: (128, 128),
            prediction: flame::diffusion::Prediction::Epsilon,
        };
        let sched = (p.schedule)(&setup).unwrap();
        let got = sched.timesteps();
        assert_eq!(got.len(), steps);
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(*a) / 1000.0 - b).abs() < 1e-6,
                "{steps} steps: {got:?}"
            );
            let t = sched.model_time(i).unwrap();
            assert!(
                (f64::from(t) - b).abs() < 1e-6,
                "{steps} steps, model time {i}: {t}"
            );
        }
    }
}
