//! LoRA adapters: planning by path patterns, the forward (against the merged weight W + s B A),
//! gradients only to A and B, f64 gradcheck of the adapter term, and the kohya / ComfyUI file
//! layout round trip with its errors. On the tiny Flux of the model fixtures.
#![cfg(feature = "cpu-ref")]

use flame::autograd::gradcheck::{gradcheck, GradcheckConfig};
use flame::models::flux::{Flux, FluxConfig};
use flame::models::Checkpoint;
use flame::nn::{kohya_name, Adapters, BaseLayer, Linear, LoraConfig, VarBuilder};
use flame::{DType, Device, Result, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

const CPU: Device = Device::Cpu;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/flux")
}

fn config() -> FluxConfig {
    let ck = Checkpoint::open(fixture(), "transformer").unwrap();
    FluxConfig::from_diffusers(ck.config.as_ref().unwrap()).unwrap()
}

fn lora_cfg(targets: &[&str], rank: usize) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 3.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed: 11,
    }
}

const TARGETS: [&str; 3] = [
    "double_blocks.*.img_attn.qkv",
    "single_blocks.*.linear1",
    "*txt_mlp.0",
];

/// The tiny Flux in f64 from the single file, with adapters planned by `cfg` (or none).
fn flux(
    weights: &std::path::Path,
    cfg: Option<LoraConfig>,
) -> (Flux, VarBuilder, Option<Arc<Adapters>>) {
    flux_with(weights, cfg.map(Into::into))
}

/// `flux` with any adapter config.
fn flux_with(
    weights: &std::path::Path,
    cfg: Option<flame::nn::AdapterConfig>,
) -> (Flux, VarBuilder, Option<Arc<Adapters>>) {
    let ck = Checkpoint::open(weights, "transformer").unwrap();
    let mut vb = ck
        .var_builder(
            DType::F64,
            &CPU,
            flame::models::flux::diffusers_map(&config()),
        )
        .unwrap();
    let adapters = cfg.map(|c| Adapters::new(c).unwrap());
    if let Some(a) = &adapters {
        vb = vb.with_adapters(a.clone()).unwrap();
    }
    let model = Flux::new(&vb, &config()).unwrap();
    (model, vb, adapters)
}

fn run(model: &Flux) -> Result<Tensor> {
    let io = flame::safetensors::load(fixture().join("io.safetensors"), &CPU)?;
    let f = |k: &str| io[k].to_dtype(DType::F64).unwrap();
    model.forward(
        &f("img"),
        &io["img_ids"],
        &f("txt"),
        &io["txt_ids"],
        &io["timesteps"],
        &f("y"),
        Some(&io["guidance"]),
    )
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter().zip(&b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// Gives every B random values (a trained-looking adapter).
fn randomize(a: &Adapters) {
    for (i, l) in a.layers().unwrap().iter().enumerate() {
        let up = l.params()[1].1.clone();
        let v = Tensor::randn(up.shape().clone(), DType::F32, &CPU, 500 + i as u64).unwrap();
        up.assign(&v.affine(0.3, 0.0).unwrap()).unwrap();
    }
}

#[test]
fn adapters_go_where_the_patterns_say() {
    let (_, _, a) = flux(
        &fixture().join("single_file.safetensors"),
        Some(lora_cfg(&TARGETS, 4)),
    );
    let paths: Vec<String> = a
        .unwrap()
        .layers()
        .unwrap()
        .iter()
        .map(|l| l.path().to_string())
        .collect();
    assert_eq!(
        paths,
        [
            "double_blocks.0.img_attn.qkv",
            "double_blocks.0.txt_mlp.0",
            "double_blocks.1.img_attn.qkv",
            "double_blocks.1.txt_mlp.0",
            "single_blocks.0.linear1",
            "single_blocks.1.linear1",
        ]
    );
    let c = lora_cfg(&["a*b.c", "x"], 1);
    assert!(c.matches("a.b.c") && c.matches("ab.c") && c.matches("a.q.r.b.c") && c.matches("x"));
    assert!(!c.matches("a.b.cd") && !c.matches("xa") && !c.matches("b.c"));
}

#[test]
fn fresh_adapters_change_nothing_and_trained_ones_equal_the_merged_weight() {
    let single = fixture().join("single_file.safetensors");
    let (base, _, _) = flux(&single, None);
    let (adapted, vb, a) = flux(&single, Some(lora_cfg(&TARGETS, 4)));
    let a = a.unwrap();
    let y0 = run(&base).unwrap();
    assert_eq!(
        max_diff(&run(&adapted).unwrap(), &y0),
        0.0,
        "B = 0 at the start"
    );
    randomize(&a);
    let y = run(&adapted).unwrap();
    assert!(max_diff(&y, &y0) > 1e-3, "the adapters act");
    // The same weights with W + (alpha / rank) B A merged in, no adapters.
    let mut merged: HashMap<String, Tensor> = vb.params().unwrap().into_iter().collect();
    for l in a.layers().unwrap() {
        let k = format!("{}.weight", l.path());
        let w = merged[&k].clone();
        let weight = |dt| w.to_dtype(dt);
        let delta = l.delta_weight(&BaseLayer::new(l.shape(), &weight)).unwrap();
        merged.insert(k, w.add(&delta.to_dtype(DType::F64).unwrap()).unwrap());
    }
    let vb2 = VarBuilder::from_tensors(merged, DType::F64, &CPU);
    let y2 = run(&Flux::new(&vb2, &config()).unwrap()).unwrap();
    assert!(max_diff(&y, &y2) < 1e-5, "{}", max_diff(&y, &y2));
}

#[test]
fn only_adapters_get_gradients() {
    let (model, vb, a) = flux(
        &fixture().join("single_file.safetensors"),
        Some(lora_cfg(&TARGETS, 2)),
    );
    let a = a.unwrap();
    randomize(&a);
    let loss = run(&model).unwrap().sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(grads.len(), 12, "A and B of 6 adapters");
    for (name, p) in a.params().unwrap() {
        let g = grads
            .get(&p)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert!(g.to_vec_f64().unwrap().iter().any(|v| *v != 0.0), "{name}");
        assert_eq!(g.dtype(), DType::F32);
    }
    assert!(
        vb.trainable_params().unwrap().is_empty(),
        "base weights stay frozen"
    );
}

#[test]
fn gradcheck_lora_linear() {
    let mut map = HashMap::new();
    map.insert(
        "l.weight".to_string(),
        Tensor::randn((5, 7), DType::F64, &CPU, 1).unwrap(),
    );
    map.insert(
        "l.bias".to_string(),
        Tensor::randn(5, DType::F64, &CPU, 2).unwrap(),
    );
    let a = Adapters::new(lora_cfg(&["l"], 3)).unwrap();
    let vb = VarBuilder::from_tensors(map, DType::F64, &CPU)
        .with_adapters(a.clone())
        .unwrap();
    let lin = Linear::new(&vb.pp("l"), 7, 5, true).unwrap();
    let l = lin.adapter.clone().unwrap();
    randomize(&a);
    // Gradcheck through f64 copies of A and B standing in for the f32 parameters.
    let x = Tensor::randn((4, 7), DType::F64, &CPU, 3).unwrap();
    let p = l.params();
    let (down, up) = (
        p[0].1.to_dtype(DType::F64).unwrap(),
        p[1].1.to_dtype(DType::F64).unwrap(),
    );
    let w = lin.weight.clone();
    let b = lin.bias.clone().unwrap();
    let s = a.config.alpha / a.config.rank as f64;
    let report = gradcheck(
        |t: &[Tensor]| {
            let base = t[0].matmul(&w.t()?)?.add(&b)?;
            base.add(
                &t[0]
                    .matmul(&t[1].t()?)?
                    .matmul(&t[2].t()?)?
                    .affine(s, 0.0)?,
            )
        },
        &[x.clone(), down.clone(), up.clone()],
        GradcheckConfig::default(),
    )
    .unwrap();
    assert!(report.checked > 0);
    // And the layer computes that same expression, in its order: the bias goes with the
    // base GEMM (its epilogue on CUDA), the adapter's term is added after.
    let term = x
        .matmul(&down.t().unwrap())
        .unwrap()
        .matmul(&up.t().unwrap())
        .unwrap()
        .affine(s, 0.0)
        .unwrap();
    let want = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .add(&b)
        .unwrap()
        .add(&term)
        .unwrap();
    assert_eq!(max_diff(&lin.forward(&x).unwrap(), &want), 0.0);
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-lora-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn kohya_round_trip_and_errors() {
    let dir = temp("kohya");
    let single = fixture().join("single_file.safetensors");
    let (model, _, a) = flux(&single, Some(lora_cfg(&TARGETS, 4)));
    let a = a.unwrap();
    randomize(&a);
    let y = run(&model).unwrap();
    let file = dir.join("lora.safetensors");
    a.save_kohya(&file, DType::F32).unwrap();
    let saved: BTreeMap<String, Tensor> = flame::safetensors::load(&file, &CPU).unwrap();
    let name = kohya_name("double_blocks.0.img_attn.qkv");
    assert_eq!(name, "lora_unet_double_blocks_0_img_attn_qkv");
    assert_eq!(saved[&format!("{name}.lora_down.weight")].dims(), [4, 32]);
    assert_eq!(saved[&format!("{name}.lora_up.weight")].dims(), [96, 4]);
    assert_eq!(saved[&format!("{name}.alpha")].dims(), [] as [usize; 0]);
    assert_eq!(saved.len(), 18);
    // A fresh model with the same plan loads it and computes the same output.
    let (model2, _, a2) = flux(&single, Some(lora_cfg(&TARGETS, 4)));
    a2.unwrap().load_kohya(&file).unwrap();
    assert_eq!(max_diff(&run(&model2).unwrap(), &y), 0.0);
    // Fewer targets: the file has tensors no adapter takes.
    let (_, _, a3) = flux(&single, Some(lora_cfg(&TARGETS[..2], 4)));
    let e = a3.unwrap().load_kohya(&file).unwrap_err().to_string();
    assert!(
        e.contains("lora_unet_double_blocks_0_txt_mlp_0") && e.contains("no planned adapter"),
        "{e}"
    );
    // More targets: an adapter is missing from the file.
    let more = [TARGETS[0], TARGETS[1], TARGETS[2], "final_layer.linear"];
    let (_, _, a4) = flux(&single, Some(lora_cfg(&more, 4)));
    let e = a4.unwrap().load_kohya(&file).unwrap_err().to_string();
    assert!(
        e.contains("lora_unet_final_layer_linear.lora_down.weight") && e.contains("missing"),
        "{e}"
    );
    // Another rank: shapes differ.
    let (_, _, a5) = flux(&single, Some(lora_cfg(&TARGETS, 2)));
    let e = a5.unwrap().load_kohya(&file).unwrap_err().to_string();
    assert!(e.contains("shape [4, 32]"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Every adapter target the Flux key map can split, the final adaLN (halves swapped) included.
const PEFT_TARGETS: [&str; 4] = [
    "double_blocks.*.*_attn.qkv",
    "single_blocks.*.linear1",
    "double_blocks.1.img_mlp.2",
    "final_layer.adaLN_modulation.1",
];

#[test]
fn peft_round_trip_splits_fused_layers() {
    let dir = temp("peft");
    let single = fixture().join("single_file.safetensors");
    let map = flame::models::flux::diffusers_map(&config());
    let (model, _, a) = flux(&single, Some(lora_cfg(&PEFT_TARGETS, 4)));
    let a = a.unwrap();
    randomize(&a);
    let y = run(&model).unwrap();
    let file = dir.join("peft.safetensors");
    a.save_peft(&file, &map, "transformer", DType::F32).unwrap();
    let saved = flame::safetensors::load(&file, &CPU).unwrap();
    // linear1 (32 -> 3*32 + 128) splits into to_q, to_k, to_v and proj_mlp, sharing A.
    let p = "transformer.single_transformer_blocks.0";
    assert_eq!(
        saved[&format!("{p}.proj_mlp.lora_B.weight")].dims(),
        [128, 4]
    );
    assert_eq!(
        saved[&format!("{p}.attn.to_v.lora_B.weight")].dims(),
        [32, 4]
    );
    assert_eq!(
        saved[&format!("{p}.attn.to_q.lora_A.weight")]
            .to_vec_f64()
            .unwrap(),
        saved[&format!("{p}.proj_mlp.lora_A.weight")]
            .to_vec_f64()
            .unwrap()
    );
    assert!(saved.contains_key("transformer.transformer_blocks.1.attn.add_k_proj.lora_A.weight"));
    assert!(saved.contains_key("transformer.norm_out.linear.lora_B.weight"));
    // 2 double blocks x 2 streams x 3 + 2 single blocks x 4 + 1 + 1 modules, A and B each.
    assert_eq!(saved.len(), 2 * (12 + 8 + 2));
    let (model2, _, a2) = flux(&single, Some(lora_cfg(&PEFT_TARGETS, 4)));
    a2.unwrap().load_peft(&file, &map, "transformer").unwrap();
    // alpha / rank is folded into B and divided out again in f32: an ulp of B at most.
    let d = max_diff(&run(&model2).unwrap(), &y);
    assert!(d < 1e-6, "{d}");
    // A file whose q and k parts have different A's cannot fill one fused rank-4 adapter.
    let mut bad = saved.clone();
    let k = format!("{p}.attn.to_k.lora_A.weight");
    bad.insert(k.clone(), bad[&k].affine(2.0, 0.0).unwrap());
    let bad_file = dir.join("bad.safetensors");
    flame::safetensors::save(bad.iter().map(|(k, v)| (k.as_str(), v)), &bad_file).unwrap();
    let (_, _, a3) = flux(&single, Some(lora_cfg(&PEFT_TARGETS, 4)));
    let e = a3
        .unwrap()
        .load_peft(&bad_file, &map, "transformer")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&k) && e.contains("fused layer single_blocks.0.linear1"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The PEFT file loads in diffusers (`load_lora_adapter`) and gives FLAME's output: needs
/// Python with PyTorch, diffusers and peft (the GPU machine; run with --include-ignored).
#[test]
#[ignore = "needs python3 with torch, diffusers and peft"]
fn peft_file_matches_diffusers_with_the_adapter() {
    let dir = temp("peft-diffusers");
    let single = fixture().join("single_file.safetensors");
    let map = flame::models::flux::diffusers_map(&config());
    let (model, _, a) = flux(&single, Some(lora_cfg(&PEFT_TARGETS, 4)));
    let a = a.unwrap();
    randomize(&a);
    let y = run(&model).unwrap();
    let lora = dir.join("peft.safetensors");
    a.save_peft(&lora, &map, "transformer", DType::F32).unwrap();
    let out = dir.join("flame_output.safetensors");
    flame::safetensors::save([("output", &y)], &out).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_peft_lora.py");
    let status = std::process::Command::new("python3")
        .arg(script)
        .arg(fixture())
        .arg(&lora)
        .arg(&out)
        .status()
        .expect("python3");
    assert!(
        status.success(),
        "diffusers disagrees (see its output above)"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A DoRA PEFT file (magnitudes split and swapped with the fused layers' rows) loads in
/// diffusers (`load_lora_adapter` turns DoRA on from `lora_magnitude_vector`) and gives
/// FLAME's output: needs Python with PyTorch, diffusers and peft (run with
/// --include-ignored).
#[test]
#[ignore = "needs python3 with torch, diffusers and peft"]
fn dora_peft_file_matches_diffusers_with_the_adapter() {
    let dir = temp("dora-diffusers");
    let single = fixture().join("single_file.safetensors");
    let map = flame::models::flux::diffusers_map(&config());
    let mut cfg = flame::nn::AdapterConfig::from(lora_cfg(&PEFT_TARGETS, 4));
    cfg.kind = "dora".into();
    let (model, _, a) = flux_with(&single, Some(cfg));
    let a = a.unwrap();
    randomize(&a);
    // The first forward sets each magnitude to its row norms; move them off those.
    run(&model).unwrap();
    for (i, (n, t)) in a.params().unwrap().iter().enumerate() {
        if n.ends_with("dora_scale") {
            let r = Tensor::randn(t.dims().to_vec(), DType::F32, &CPU, 700 + i as u64).unwrap();
            let m = t.mul(&r.affine(0.1, 1.0).unwrap()).unwrap();
            t.assign(&m).unwrap();
        }
    }
    let y = run(&model).unwrap();
    let file = dir.join("peft.safetensors");
    a.save_peft(&file, &map, "transformer", DType::F32).unwrap();
    assert!(flame::safetensors::load(&file, &CPU)
        .unwrap()
        .keys()
        .any(|k| k.ends_with("lora_magnitude_vector")));
    let out = dir.join("flame_output.safetensors");
    flame::safetensors::save([("output", &y)], &out).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_peft_lora.py");
    let status = std::process::Command::new("python3")
        .arg(script)
        .arg(fixture())
        .arg(&file)
        .arg(&out)
        .status()
        .expect("python3");
    assert!(
        status.success(),
        "diffusers disagrees (see its output above)"
    );
    std::fs::remove_dir_all(&dir).ok();
}
