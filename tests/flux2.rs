//! The FLUX.2 transformer against diffusers' Flux2Transformer2DModel (0.42.1): forward output,
//! input gradients and every parameter's gradient of a fixed scalar loss on tiny random-weight
//! models, from the diffusers folder, BFL's single file and the same under ComfyUI's
//! `model.diffusion_model.` prefix; a LoRA on every block Linear against peft's; the packing,
//! position ids and sampler of Flux2KleinPipeline. Fixtures (tests/fixtures/flux2/) are made by
//! scripts/make_flux2_fixtures.py in f64 and stored in f32; the loss is
//! sum(output * loss_weight).
//!
//! Tolerance: max |flame - diffusers| / max |diffusers| per tensor, [`TOL`] in f32 (the bound
//! tests/models.rs holds the other families to).
#![cfg(feature = "cpu-ref")]

mod common;

use common::{check_rel, rel_err, TempFile};
use flame::memory::{Checkpointing, Plan};
use flame::models::flux2::{self, Flux2, Flux2Config};
use flame::models::{load_as, Checkpoint, DiffusionModel, LoadOptions, ModelSpec};
use flame::nn::{Adapters, KeySource, LoraConfig, VarBuilder};
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

/// f32 against the f64 reference, for output, input and parameter gradients (measured: a
/// few 1e-7).
const TOL: f64 = 1e-4;

const KLEIN: &str = "flux2";
const GUIDED: &str = "flux2_guided";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/flux2")
        .join(name)
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(path, &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

fn io(name: &str) -> BTreeMap<String, Tensor> {
    load(&fixture(name).join("io.safetensors"))
}

fn json_config(name: &str) -> Flux2Config {
    let ckpt = Checkpoint::open(fixture(name), "transformer").unwrap();
    Flux2Config::from_diffusers(ckpt.config.as_ref().unwrap()).unwrap()
}

/// BFL's single file with every key under ComfyUI's `model.diffusion_model.`.
fn comfy_file(name: &str) -> TempFile {
    let f = TempFile::new(&format!("{name}-comfy"));
    let src = load(&fixture(name).join("single_file.safetensors"));
    let named: Vec<(String, &Tensor)> = src
        .iter()
        .map(|(k, v)| (format!("model.diffusion_model.{k}"), v))
        .collect();
    flame::safetensors::save(named.iter().map(|(k, v)| (k.as_str(), *v)), f.path()).unwrap();
    f
}

/// The forward of the fixture's inputs (img and txt made trainable) on the model at `path`
/// on `dev`, its config from the checkpoint (config.json, or the single file's shapes).
fn run(name: &str, path: &Path, dev: &Device) -> (Tensor, Vec<(String, Tensor)>, VarBuilder) {
    let io: BTreeMap<String, Tensor> = io(name)
        .into_iter()
        .map(|(k, t)| (k, t.to_device(dev).unwrap()))
        .collect();
    let (model, vb) = Flux2::load(path, DType::F32, dev, None).unwrap();
    assert_eq!(model.config, json_config(name), "{path:?}");
    vb.set_trainable(|_| true).unwrap();
    let img = io["img"].detach().requires_grad_().unwrap();
    let txt = io["txt"].detach().requires_grad_().unwrap();
    let out = model
        .forward(
            &img,
            &io["img_ids"],
            &txt,
            &io["txt_ids"],
            &io["timesteps"],
            io.get("guidance"),
        )
        .unwrap();
    (out, vec![("img".into(), img), ("txt".into(), txt)], vb)
}

/// Output, input gradients and every parameter gradient against the fixture, on the CPU.
fn parity(name: &str, path: &Path) {
    parity_on(name, path, &CPU)
}

/// [`parity`] on `dev`.
fn parity_on(name: &str, path: &Path, dev: &Device) {
    let io = io(name);
    let (out, inputs, vb) = run(name, path, dev);
    let loss_weight = io["loss_weight"].to_device(dev).unwrap();
    let what = format!("{name} {}", path.display());
    let mut worst = [
        check_rel(&format!("{what} output"), &out, &io["output"], TOL),
        0.0,
        0.0,
    ];
    let grads = out.mul(&loss_weight).unwrap().sum_all().unwrap();
    let grads = grads.backward().unwrap();
    for (n, t) in &inputs {
        let e = rel_err(grads.get(t).unwrap(), &io[&format!("grad.{n}")]);
        assert!(e <= TOL, "{what}: grad.{n} error {e:e}");
        worst[1] = worst[1].max(e);
    }
    let want = load(&fixture(name).join("grads.safetensors"));
    let params: BTreeMap<String, Tensor> = vb.trainable_params().unwrap().into_iter().collect();
    assert_eq!(
        params.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: parameters vs fixture gradients"
    );
    for (k, p) in &params {
        let g = grads
            .get(p)
            .unwrap_or_else(|| panic!("{what}: no gradient for {k}"));
        let e = rel_err(g, &want[k]);
        assert!(e <= TOL, "{what}: grad of {k} error {e:e}");
        worst[2] = worst[2].max(e);
    }
    println!(
        "{what}: output {:.2e}, input grads {:.2e}, param grads {:.2e}, {} params",
        worst[0],
        worst[1],
        worst[2],
        params.len()
    );
}

#[test]
fn flux2_matches_diffusers_f32_cpu_every_layout() {
    for name in [KLEIN, GUIDED] {
        parity(name, &fixture(name));
        parity(name, &fixture(name).join("single_file.safetensors"));
    }
    let comfy = comfy_file(KLEIN);
    parity(KLEIN, comfy.path());
}

/// The same parity on the GPU in f32, both layouts.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn flux2_matches_diffusers_f32_cuda() {
    let dev = Device::cuda(0).unwrap();
    for name in [KLEIN, GUIDED] {
        parity_on(name, &fixture(name), &dev);
        parity_on(name, &fixture(name).join("single_file.safetensors"), &dev);
    }
}

#[test]
fn flux2_config_from_json_and_from_shapes_agree() {
    let c = json_config(KLEIN);
    assert_eq!(
        (c.hidden_size, c.num_heads, c.depth, c.depth_single_blocks),
        (32, 2, 2, 2)
    );
    assert_eq!(
        (
            c.in_channels,
            c.context_in_dim,
            c.time_channels,
            c.mlp_hidden()
        ),
        (16, 24, 32, 96)
    );
    assert_eq!((c.axes_dim.clone(), c.theta), (vec![4, 4, 4, 4], 2000.0));
    assert!(!c.guidance_embed);
    assert!(json_config(GUIDED).guidance_embed);
    // The single file's shapes (bare and prefixed) give the same configs (`run` checks
    // each against config.json).
    for name in [KLEIN, GUIDED] {
        let (m, _) = Flux2::load(
            fixture(name).join("single_file.safetensors"),
            DType::F32,
            &CPU,
            None,
        )
        .unwrap();
        assert_eq!(m.config, json_config(name));
    }
    let comfy = comfy_file(KLEIN);
    let (m, _) = Flux2::load(comfy.path(), DType::F32, &CPU, None).unwrap();
    assert_eq!(m.config, c);
}

/// The released sizes: klein 4B and 9B from their config.json keys, and their parameter
/// counts (BFL names them 4B and 9B).
#[test]
fn flux2_klein_configs() {
    let k4 = Flux2Config::klein_4b();
    let json4 = serde_json::json!({
        "_class_name": "Flux2Transformer2DModel", "attention_head_dim": 128,
        "axes_dims_rope": [32, 32, 32, 32], "eps": 1e-6, "guidance_embeds": false,
        "in_channels": 128, "joint_attention_dim": 7680, "mlp_ratio": 3.0,
        "num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20,
        "out_channels": null, "patch_size": 1, "rope_theta": 2000,
        "timestep_guidance_channels": 256
    });
    assert_eq!(Flux2Config::from_diffusers(&json4).unwrap(), k4);
    let mut json9 = json4.clone();
    for (k, v) in [
        ("num_attention_heads", 32),
        ("num_layers", 8),
        ("num_single_layers", 24),
        ("joint_attention_dim", 12288),
    ] {
        json9[k] = v.into();
    }
    let k9 = Flux2Config::klein_9b();
    assert_eq!(Flux2Config::from_diffusers(&json9).unwrap(), k9);
    for (c, blocks, lo, hi) in [(&k4, 25, 3.8e9, 4.0e9), (&k9, 32, 9.0e9, 9.2e9)] {
        assert_eq!((c.head_dim(), c.mlp_hidden()), (128, 3 * c.hidden_size));
        assert_eq!(c.block_prefixes().len(), blocks);
        let vb = VarBuilder::shapes_only(DType::BF16, &CPU);
        Flux2::new(&vb, c).unwrap();
        let n: usize = vb
            .params()
            .unwrap()
            .iter()
            .map(|(_, t)| t.elem_count())
            .sum();
        assert!((lo..hi).contains(&(n as f64)), "{} parameters", n);
    }
    // A patch size other than 1 is refused.
    let mut bad = json4;
    bad["patch_size"] = 2.into();
    assert!(Flux2Config::from_diffusers(&bad).is_err());
}

#[test]
fn flux2_packing_ids_and_patches_match_the_pipeline() {
    let io = io(KLEIN);
    let eq = |a: &Tensor, b: &Tensor| assert_eq!(a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let latents = flux2::patchify_latents(&io["raw_latents"]).unwrap();
    eq(&latents, &io["latents"]);
    eq(
        &flux2::unpatchify_latents(&latents).unwrap(),
        &io["raw_latents"],
    );
    let img = flux2::pack_latents(&latents).unwrap();
    eq(&img, &io["img"]);
    eq(&flux2::unpack_latents(&img, 4, 3).unwrap(), &latents);
    let ids = flux2::image_ids(4, 3, &CPU).unwrap();
    let txt_ids = flux2::text_ids(5, &CPU).unwrap();
    for b in 0..2 {
        eq(
            &ids,
            &io["img_ids"].narrow(0, b, 1).unwrap().squeeze(0).unwrap(),
        );
        eq(
            &txt_ids,
            &io["txt_ids"].narrow(0, b, 1).unwrap().squeeze(0).unwrap(),
        );
    }
}

/// `predict` (what training and sampling call) on the (C, h, w) latents packs, runs and
/// unpacks to the fixture's output.
#[test]
fn flux2_predict_is_the_pipelines_call() {
    let io = io(KLEIN);
    let (model, _) = Flux2::load(fixture(KLEIN), DType::F32, &CPU, None).unwrap();
    assert!(!model.guidance_input());
    let inputs = model.inputs();
    assert_eq!(inputs[0].mismatch(&[16, 4, 3]), None);
    assert!(inputs[0].mismatch(&[32, 4, 3]).is_some());
    assert_eq!(inputs[1].mismatch(&[5, 24]), None);
    let pred = model
        .predict(&io["latents"], &io["timesteps"], &[io["txt"].clone()], 1.0)
        .unwrap();
    let want = flux2::unpack_latents(&io["output"], 4, 3).unwrap();
    check_rel("flux2 predict", &pred, &want, TOL);
    // A missing text input is an error, not a panic.
    assert!(model
        .predict(&io["latents"], &io["timesteps"], &[], 1.0)
        .is_err());
    // The guided model needs its guidance input.
    let (guided, _) = Flux2::load(fixture(GUIDED), DType::F32, &CPU, None).unwrap();
    assert!(guided.guidance_input());
    let g = self::io(GUIDED);
    let e = guided
        .forward(
            &g["img"],
            &g["img_ids"],
            &g["txt"],
            &g["txt_ids"],
            &g["timesteps"],
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("guidance"), "{e}");
}

#[test]
fn flux2_reports_missing_and_misshapen_keys() {
    let cfg = Some(json_config(KLEIN));
    let src = load(&fixture(KLEIN).join("single_file.safetensors"));
    let save = |t: &BTreeMap<String, Tensor>, tag: &str| {
        let f = TempFile::new(tag);
        flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), f.path()).unwrap();
        f
    };
    let key_of = |e: Error| match e {
        Error::Param { key, msg, .. } => (key, msg),
        other => panic!("expected a parameter error, got {other}"),
    };
    let mut missing = src.clone();
    missing.remove("double_blocks.1.txt_attn.qkv.weight");
    let f = save(&missing, "flux2-missing");
    let e = Flux2::load(f.path(), DType::F32, &CPU, cfg.clone()).unwrap_err();
    let (key, msg) = key_of(e);
    assert_eq!(key, "double_blocks.1.txt_attn.qkv.weight");
    assert!(msg.contains("missing"), "{msg}");
    let mut bad = src.clone();
    let w = bad["txt_in.weight"].t().unwrap().contiguous().unwrap();
    bad.insert("txt_in.weight".into(), w);
    let f = save(&bad, "flux2-bad");
    let e = Flux2::load(f.path(), DType::F32, &CPU, cfg.clone()).unwrap_err();
    let (key, msg) = key_of(e);
    assert_eq!(key, "txt_in.weight");
    assert!(msg.contains("expected shape"), "{msg}");
    // Not a FLUX.2 file: the shapes' first missing key is named.
    let mut flux1 = src.clone();
    flux1.remove("single_stream_modulation.lin.weight");
    let f = save(&flux1, "flux2-not");
    let e = Flux2::load(f.path(), DType::F32, &CPU, None).unwrap_err();
    assert_eq!(key_of(e).0, "single_stream_modulation.lin.weight");
    // A weight scale beside a weight that is not FP8 is refused by name rather than
    // ignored (FP8 files load: tests/flux2_fp8.rs).
    let mut fp8 = src;
    fp8.insert(
        "double_blocks.0.img_attn.qkv.weight_scale".into(),
        Tensor::ones(1, DType::F32, &CPU).unwrap(),
    );
    let f = save(&fp8, "flux2-fp8");
    let e = Flux2::load(f.path(), DType::F32, &CPU, cfg).unwrap_err();
    assert!(
        matches!(&e, Error::Param { key, msg, .. } if key == "double_blocks.0.img_attn.qkv.weight"
            && msg.contains("double_blocks.0.img_attn.qkv.weight_scale")),
        "{e}"
    );
}

#[test]
fn flux2_diffusers_map() {
    let m = flux2::diffusers_map(&Flux2Config::klein_4b());
    let key = |k: &str| Some(KeySource::Key(k.into()));
    assert_eq!(
        m("double_blocks.4.txt_attn.qkv.weight"),
        Some(KeySource::Cat(vec![
            ("transformer_blocks.4.attn.add_q_proj.weight".into(), 3072),
            ("transformer_blocks.4.attn.add_k_proj.weight".into(), 3072),
            ("transformer_blocks.4.attn.add_v_proj.weight".into(), 3072),
        ]))
    );
    assert_eq!(
        m("single_blocks.19.linear1.weight"),
        key("single_transformer_blocks.19.attn.to_qkv_mlp_proj.weight")
    );
    assert_eq!(
        m("single_blocks.0.norm.key_norm.scale"),
        key("single_transformer_blocks.0.attn.norm_k.weight")
    );
    assert_eq!(
        m("double_blocks.0.img_mlp.0.weight"),
        key("transformer_blocks.0.ff.linear_in.weight")
    );
    assert_eq!(
        m("double_stream_modulation_txt.lin.weight"),
        key("double_stream_modulation_txt.linear.weight")
    );
    assert_eq!(
        m("time_in.out_layer.weight"),
        key("time_guidance_embed.timestep_embedder.linear_2.weight")
    );
    assert_eq!(
        m("final_layer.adaLN_modulation.1.weight"),
        Some(KeySource::SwapHalves("norm_out.linear.weight".into()))
    );
    assert_eq!(m("double_blocks.0.img_mod.lin.weight"), None);
    assert_eq!(m("double_blocks.0.img_mlp.1.weight"), None);
}

fn lora(targets: &[&str]) -> std::sync::Arc<Adapters> {
    Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        seed: 7,
    })
    .unwrap()
}

/// A rank-2 LoRA on every Linear of the blocks, read from peft's own file: output, input
/// gradients and every adapter's gradient equal peft's on diffusers; written back in the PEFT
/// layout, the file has peft's names and values.
#[test]
fn flux2_lora_matches_peft() {
    let dir = fixture(KLEIN);
    let want = load(&dir.join("lora_io.safetensors"));
    let io = io(KLEIN);
    let cfg = json_config(KLEIN);
    let map = flux2::diffusers_map(&cfg);
    let a = lora(&["double_blocks.*", "single_blocks.*"]);
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
    let l = load_as::<Flux2>(dir.join("single_file.safetensors"), &opts, None).unwrap();
    // 2 double blocks x 2 streams x (qkv, proj, mlp.0, mlp.2) + 2 single blocks x 2.
    assert_eq!(a.layers().unwrap().len(), 20);
    let peft = dir.join("lora.safetensors");
    a.load_peft(&peft, &map, "transformer").unwrap();
    let img = io["img"].detach().requires_grad_().unwrap();
    let txt = io["txt"].detach().requires_grad_().unwrap();
    let out = l
        .model
        .forward(
            &img,
            &io["img_ids"],
            &txt,
            &io["txt_ids"],
            &io["timesteps"],
            None,
        )
        .unwrap();
    check_rel("flux2 lora output", &out, &want["output"], TOL);
    let grads = out
        .mul(&io["loss_weight"])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    check_rel(
        "flux2 lora grad.img",
        grads.get(&img).unwrap(),
        &want["grad.img"],
        TOL,
    );
    check_rel(
        "flux2 lora grad.txt",
        grads.get(&txt).unwrap(),
        &want["grad.txt"],
        TOL,
    );
    let params = a.params().unwrap();
    assert_eq!(params.len(), 40);
    let mut worst = 0f64;
    for (n, p) in &params {
        let g = grads
            .get(p)
            .unwrap_or_else(|| panic!("no gradient reached adapter {n}"));
        let e = rel_err(g, &want[n]);
        assert!(e <= TOL, "adapter {n}: gradient error {e:e}");
        worst = worst.max(e);
    }
    println!("flux2 lora: adapter gradients within {worst:.2e} of peft's");
    // The PEFT file FLAME writes has peft's names (a fused qkv split into to_q, to_k, to_v
    // with one A) and values.
    let f = TempFile::new("flux2-peft");
    a.save_peft(f.path(), &map, "transformer", DType::F32)
        .unwrap();
    let (ours, theirs) = (load(f.path()), load(&peft));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>()
    );
    for (k, t) in &theirs {
        assert!(rel_err(&ours[k], t) < 1e-6, "{k}");
    }
    // kohya names follow BFL's keys.
    let k = TempFile::new("flux2-kohya");
    a.save_kohya(k.path(), DType::F32).unwrap();
    let kohya = load(k.path());
    assert!(kohya.contains_key("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"));
    assert!(kohya.contains_key("lora_unet_single_blocks_1_linear2.lora_up.weight"));
}

/// The blocks run through `BlockExec`: checkpointed, and streamed from host memory, the
/// LoRA gradients and the output equal the resident run's bit for bit.
#[test]
fn flux2_blocks_checkpointed_or_streamed_give_the_resident_gradients() {
    let io = io(KLEIN);
    let path = fixture(KLEIN).join("single_file.safetensors");
    let cfg = json_config(KLEIN);
    let run = |plan: Plan| {
        let a = lora(&["double_blocks.*", "single_blocks.*"]);
        let mut opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
        opts.memory = plan;
        let l = load_as::<Flux2>(&path, &opts, None).unwrap();
        let out = l
            .model
            .forward(
                &io["img"],
                &io["img_ids"],
                &io["txt"],
                &io["txt_ids"],
                &io["timesteps"],
                None,
            )
            .unwrap();
        let grads = out
            .mul(&io["loss_weight"])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let bits = |t: &Tensor| -> Vec<u64> {
            t.to_vec_f64()
                .unwrap()
                .into_iter()
                .map(f64::to_bits)
                .collect()
        };
        let mut v = vec![("output".to_string(), bits(&out))];
        for (n, p) in a.params().unwrap() {
            v.push((n, bits(grads.get(&p).unwrap())));
        }
        v
    };
    let resident = run(Plan::default());
    let prefixes = cfg.block_prefixes();
    for plan in [
        Plan {
            checkpointing: Checkpointing::All,
            ..Plan::default()
        },
        Plan {
            checkpointing: Checkpointing::All,
            streamed: prefixes.clone(),
            prefetch: 1,
            ..Plan::default()
        },
        Plan {
            checkpointing: Checkpointing::Every(2),
            streamed: vec![prefixes[1].clone(), prefixes[2].clone()],
            prefetch: 1,
            ..Plan::default()
        },
    ] {
        let what = format!("{:?} streaming {:?}", plan.checkpointing, plan.streamed);
        assert_eq!(run(plan), resident, "{what}");
    }
}

/// A block's last down-projection (each stream's `mlp.2` in a double block, `linear2` in a
/// single one) is summed into the block's output through a gate from the shared
/// modulation: with the modulation frozen, no gradient of a checkpoint's re-run reads it, so
/// the re-run runs none of those GEMMs (`Linear::forward_tail`) and `Keep::down_projections`
/// keeps nothing of them; with an adapter on the modulation the gates need their
/// gradients, and every re-run computes them. Both give the resident run's gradients bit
/// for bit.
#[test]
fn flux2_reruns_leave_out_the_down_projections_no_gradient_reads() {
    use flame::autograd::{kept_reused, unread_skipped, Keep};
    let io = io(KLEIN);
    let path = fixture(KLEIN).join("single_file.safetensors");
    let cfg = json_config(KLEIN);
    let blocks = ["double_blocks.*", "single_blocks.*"];
    let with_mod = [
        "double_blocks.*",
        "single_blocks.*",
        "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.lin",
        "single_stream_modulation.lin",
    ];
    let run = |targets: &[&str], plan: Plan| {
        let a = lora(targets);
        let mut opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
        opts.memory = plan;
        let l = load_as::<Flux2>(&path, &opts, None).unwrap();
        let out = l
            .model
            .forward(
                &io["img"],
                &io["img_ids"],
                &io["txt"],
                &io["txt_ids"],
                &io["timesteps"],
                None,
            )
            .unwrap();
        let (skipped, reused) = (unread_skipped(), kept_reused());
        let grads = out
            .mul(&io["loss_weight"])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let counts = (unread_skipped() - skipped, kept_reused() - reused);
        let mut v = Vec::new();
        for (n, p) in a.params().unwrap() {
            let g = grads.get(&p).unwrap().to_vec_f64().unwrap();
            v.push((n, g.into_iter().map(f64::to_bits).collect::<Vec<_>>()));
        }
        (v, counts)
    };
    let prefixes = cfg.block_prefixes();
    let down = Keep {
        down_projections: true,
        ..Keep::NONE
    };
    let plans = [
        (Checkpointing::All, vec![], Keep::NONE),
        (Checkpointing::All, vec![], down),
        (Checkpointing::All, prefixes.clone(), down),
    ];
    // Each double block's two streams and each single block, once a step's re-runs.
    let tails = (2 * cfg.depth + cfg.depth_single_blocks) as u64;
    for targets in [&blocks[..], &with_mod[..]] {
        let frozen = targets.len() == blocks.len();
        let (resident, counts) = run(targets, Plan::default());
        // Eight adapted Linears a double block, two a single one, and the three modulations'
        // where they are targets: an A and a B each.
        let layers = 8 * cfg.depth + 2 * cfg.depth_single_blocks + if frozen { 0 } else { 3 };
        assert_eq!(resident.len(), 2 * layers, "{targets:?}");
        assert_eq!(counts, (0, 0), "nothing is re-run resident");
        for (checkpointing, streamed, keep) in plans.clone() {
            let what = format!(
                "{targets:?}, {checkpointing:?}, {keep:?}, {} streamed",
                streamed.len()
            );
            let plan = Plan {
                checkpointing,
                prefetch: if streamed.is_empty() { 0 } else { 1 },
                streamed,
                keep,
                ..Plan::default()
            };
            let (grads, (skipped, reused)) = run(targets, plan);
            assert_eq!(grads, resident, "{what}");
            if frozen {
                // No down-projection but the tails: nothing kept, each tail skipped.
                assert_eq!((skipped, reused), (tails, 0), "{what}");
            } else {
                // The gates read the tails' outputs: computed again, or kept.
                let kept = if keep.down_projections { tails } else { 0 };
                assert_eq!((skipped, reused), (0, kept), "{what}");
            }
        }
    }
}

/// Flux2KleinPipeline's sampler: the empirical mu and the shifted sigmas of diffusers'
/// FlowMatchEulerDiscreteScheduler.
#[test]
fn flux2_schedule_matches_the_pipeline() {
    let s = load(&fixture("schedule.safetensors"));
    for (tokens, steps) in [(12, 4), (12, 50), (1024, 4), (4096, 50), (5000, 28)] {
        let mu = s[&format!("mu.{tokens}.{steps}")].to_vec_f64().unwrap()[0];
        let ours = flux2::empirical_mu(tokens, steps);
        // The fixture holds mu in f32.
        assert!(
            (ours - mu).abs() <= 1e-6 * mu.abs(),
            "mu {tokens} {steps}: {ours} {mu}"
        );
        let sched = flux2::schedule(steps, tokens).unwrap();
        let want = s[&format!("sigmas.{tokens}.{steps}")].to_vec_f64().unwrap();
        assert_eq!(sched.sigmas.len(), want.len());
        for (i, (a, b)) in sched.sigmas.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*a) - b).abs() <= 1e-6,
                "sigma {i} of {tokens} tokens, {steps} steps: {a} {b}"
            );
        }
    }
}

/// The family's entry: registered under "flux2", its pipeline Qwen3 (the klein prompt) and
/// FLUX.2's autoencoder, a missing text output named; its block shapes are the config's.
#[test]
fn flux2_family_entry() {
    let f = Flux2::entry();
    assert_eq!((f.name, f.subfolder), ("flux2", "transformer"));
    assert!(std::ptr::eq(flame::models::family("flux2").unwrap(), f));
    let p = f.pipeline;
    assert_eq!(p.text.len(), 1);
    assert_eq!((p.text[0].name, p.text[0].max_len), ("qwen3", 512));
    assert_eq!(p.vae, flame::encoders::VaeKind::Flux2);
    let e = (p.combine)(&[]).unwrap_err().to_string();
    assert!(e.contains("0 encoder outputs"), "{e}");
    let cfg = Flux2Config::klein_4b();
    let shapes = Flux2::block_shapes(&cfg, &[vec![128, 64, 64], vec![512, 7680]]).unwrap();
    assert_eq!(shapes.len(), 25);
    assert_eq!(shapes[0].tokens, 64 * 64 + 512);
    assert_eq!(shapes[24].weight_tokens, 64 * 64 + 512);
}
