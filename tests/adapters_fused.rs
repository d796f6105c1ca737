//! LoKr and LoHa on fused layers, one adapter per diffusers projection
//! (`AdapterConfig::per_projection`): on the tiny Flux of the model fixtures (its single
//! blocks' linear1 = to_q, to_k, to_v, proj_mlp; its double blocks' qkv), the PEFT file holds
//! one set of tensors per diffusers module and the kohya file names each projection as
//! LyCORIS does on diffusers (`lycoris_<module>`), keys ComfyUI's own Flux map
//! (tests/fixtures/comfy/flux_tiny.json, `scripts/make_comfy_keymaps.py`) points at the
//! projection's rows; both read back to the same output. peft 0.21.2 on diffusers'
//! FluxTransformer2DModel computes FLAME's output from the PEFT file
//! (`scripts/check_peft_adapters.py`, ignored without Python); an f64 gradcheck of the
//! per-projection forward; the refused combinations.
#![cfg(feature = "cpu-ref")]

use flame::autograd::gradcheck::{gradcheck, GradcheckConfig};
use flame::models::flux::{Flux, FluxConfig};
use flame::models::Checkpoint;
use flame::nn::adapter::{AdapterConfig, Adapters, BaseLayer};
use flame::nn::{KeyMap, KeySource, Linear, LoraConfig, VarBuilder};
use flame::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CPU: Device = Device::Cpu;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/flux")
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-fused-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn flux_config() -> FluxConfig {
    let ck = Checkpoint::open(fixture(), "transformer").unwrap();
    FluxConfig::from_diffusers(ck.config.as_ref().unwrap()).unwrap()
}

fn map() -> KeyMap {
    flame::models::flux::diffusers_map(&flux_config())
}

/// LoKr or LoHa per projection on the fused layers and a plain Linear.
fn config(kind: &str) -> AdapterConfig {
    let mut c = AdapterConfig::from(LoraConfig {
        rank: 2,
        alpha: 3.0,
        dropout: 0.0,
        targets: [
            "double_blocks.*.img_attn.qkv",
            "double_blocks.*.txt_attn.qkv",
            "single_blocks.*.linear1",
            "*txt_mlp.0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        seed: 7,
    });
    c.kind = kind.into();
    c.per_projection = true;
    // PEFT's split (the layout written here).
    c.lokr_split = flame::nn::LokrSplit::Peft;
    c
}

/// The tiny Flux in f64 from its single file, adapted by `a`.
fn flux(a: &Arc<Adapters>) -> Flux {
    let ck = Checkpoint::open(fixture().join("single_file.safetensors"), "transformer").unwrap();
    a.use_key_map(map()).unwrap();
    let vb = ck
        .var_builder(DType::F64, &CPU, map())
        .unwrap()
        .with_adapters(a.clone())
        .unwrap();
    Flux::new(&vb, &flux_config()).unwrap()
}

fn run(model: &Flux) -> Tensor {
    let io = flame::safetensors::load(fixture().join("io.safetensors"), &CPU).unwrap();
    let f = |k: &str| io[k].to_dtype(DType::F64).unwrap();
    model
        .forward(
            &f("img"),
            &io["img_ids"],
            &f("txt"),
            &io["txt_ids"],
            &io["timesteps"],
            &f("y"),
            Some(&io["guidance"]),
        )
        .unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let m = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0.0f64, |d, (x, y)| d.max((x - y).abs()))
        / m
}

/// Every adapter tensor 0.3 N(0, 1) (nothing left at its zero start).
fn perturb(a: &Adapters, seed: u64) {
    for (i, (_, t)) in a.params().unwrap().iter().enumerate() {
        let r = Tensor::randn(t.dims().to_vec(), DType::F32, &CPU, seed + i as u64).unwrap();
        t.assign(&r.affine(0.3, 0.0).unwrap()).unwrap();
    }
}

/// The names of a safetensors file's tensors.
fn names(path: &Path) -> BTreeSet<String> {
    flame::safetensors::SafeTensorsFile::open(path)
        .unwrap()
        .names()
        .map(str::to_string)
        .collect()
}

#[test]
fn lokr_and_loha_per_projection_write_and_read_both_layouts() {
    let d = temp("layouts");
    let comfy: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/comfy/flux_tiny.json"),
        )
        .unwrap(),
    )
    .unwrap();
    for kind in ["lokr", "loha"] {
        let a = Adapters::new(config(kind)).unwrap();
        let model = flux(&a);
        let plain = run(&model);
        perturb(&a, 100);
        let y = run(&model);
        assert!(
            rel(&plain, &y) > 1e-3,
            "{kind}: the adapters move the output"
        );
        // One adapter per projection: linear1's parameters are its four projections'.
        let names_of: Vec<String> = a
            .params()
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.starts_with("single_blocks.0.linear1."))
            .collect();
        for short in ["to_q", "to_k", "to_v", "proj_mlp"] {
            assert!(
                names_of
                    .iter()
                    .any(|n| n.starts_with(&format!("single_blocks.0.linear1.{short}."))),
                "{kind}: {names_of:?}"
            );
        }
        // PEFT: every diffusers module its own tensors, no fused name.
        let peft = d.join(format!("{kind}-peft.safetensors"));
        a.save_peft(&peft, &map(), "transformer", DType::F32)
            .unwrap();
        let keys = names(&peft);
        let first = if kind == "lokr" {
            "lokr_w1"
        } else {
            "hada_w1_a"
        };
        for m in ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"] {
            let k = format!("transformer.single_transformer_blocks.0.{m}.{first}");
            assert!(keys.contains(&k), "{kind}: no {k}");
        }
        let k = format!("transformer.transformer_blocks.0.attn.add_v_proj.{first}");
        assert!(keys.contains(&k), "{kind}: no {k}");
        let fresh = Adapters::new(config(kind)).unwrap();
        let again = flux(&fresh);
        fresh.load_peft(&peft, &map(), "transformer").unwrap();
        let e = rel(&run(&again), &y);
        assert!(e < 1e-6, "{kind}: PEFT round trip off by {e:e}");
        // kohya: LyCORIS's names of the diffusers modules, each one ComfyUI maps to rows of
        // the fused weight.
        let kohya = d.join(format!("{kind}-kohya.safetensors"));
        a.save_kohya(&kohya, DType::F32).unwrap();
        let layers: BTreeSet<String> = names(&kohya)
            .into_iter()
            .map(|k| k.split('.').next().unwrap().to_string())
            .collect();
        assert!(layers.contains("lycoris_single_transformer_blocks_0_attn_to_q"));
        assert!(!layers
            .iter()
            .any(|l| l.contains("linear1") || l.contains("qkv")));
        for l in &layers {
            let target = &comfy["map"][l];
            assert!(!target.is_null(), "{kind}: ComfyUI maps no {l}");
            if l.starts_with("lycoris_") {
                assert!(
                    target.is_array(),
                    "{kind}: {l} -> {target}: rows of a fused weight"
                );
            }
        }
        let fresh = Adapters::new(config(kind)).unwrap();
        let again = flux(&fresh);
        fresh.load_kohya(&kohya).unwrap();
        let e = rel(&run(&again), &y);
        assert!(e < 1e-6, "{kind}: kohya round trip off by {e:e}");
        // The merge reads the PEFT file per diffusers part and gives the adapted model.
        let merge = Arc::new(flame::nn::LoraMerge::open(&peft, 1.0, "transformer").unwrap());
        merge.set_diffusers_map(map()).unwrap();
        let ck =
            Checkpoint::open(fixture().join("single_file.safetensors"), "transformer").unwrap();
        let vb = ck
            .var_builder(DType::F64, &CPU, map())
            .unwrap()
            .with_merge(merge.clone())
            .unwrap();
        let merged = Flux::new(&vb, &flux_config()).unwrap();
        merge.check_all_used().unwrap();
        let e = rel(&run(&merged), &y);
        assert!(e < 1e-5, "{kind}: merged PEFT file off by {e:e}");
        // The merge (what `sample --lora` does) reads the kohya file's `lycoris_<module>`
        // names per diffusers part: each fused layer's change is the live adapter's ΔW
        // (`Adapter::delta_weight`), and the merged model the adapted one.
        let merge = Arc::new(flame::nn::LoraMerge::open(&kohya, 1.0, "transformer").unwrap());
        merge.set_diffusers_map(map()).unwrap();
        let vb = ck.var_builder(DType::F32, &CPU, map()).unwrap();
        Flux::new(&vb, &flux_config()).unwrap();
        let weights: HashMap<String, Tensor> = vb.params().unwrap().into_iter().collect();
        for layer in a.layers().unwrap() {
            let key = format!("{}.weight", layer.path());
            let w = weights[&key].clone();
            let live = {
                let w = w.clone();
                let get = move |dt: DType| w.to_dtype(dt);
                layer
                    .delta_weight(&BaseLayer::new(layer.shape(), &get))
                    .unwrap()
            };
            let merged = merge.delta_for(&key, &w).unwrap().unwrap();
            let e = rel(
                &merged.to_dtype(DType::F64).unwrap(),
                &live.to_dtype(DType::F64).unwrap(),
            );
            assert!(e < 1e-5, "{kind} {key}: merged kohya change off by {e:e}");
        }
        let vb = ck
            .var_builder(DType::F64, &CPU, map())
            .unwrap()
            .with_merge(merge.clone())
            .unwrap();
        let merged = Flux::new(&vb, &flux_config()).unwrap();
        merge.check_all_used().unwrap();
        let e = rel(&run(&merged), &y);
        assert!(e < 1e-5, "{kind}: merged kohya file off by {e:e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// f64 gradcheck of the per-projection forward (`Adapter::forward_with`) on a fused Linear
/// of three projections, over the input and every projection's parameters.
#[test]
fn per_projection_forward_passes_an_f64_gradcheck() {
    for (kind, rank) in [("lokr", 1), ("loha", 2)] {
        let mut w = HashMap::new();
        w.insert(
            "qkv.weight".to_string(),
            Tensor::randn((12, 6), DType::F64, &CPU, 1).unwrap(),
        );
        let mut c = config(kind);
        c.rank = rank;
        c.targets = vec!["qkv".into()];
        let a = Adapters::new(c).unwrap();
        let parts: KeyMap = Arc::new(|k: &str| {
            (k == "qkv.weight").then(|| {
                KeySource::Cat(
                    ["to_q", "to_k", "to_v"]
                        .iter()
                        .map(|p| (format!("attn.{p}.weight"), 4))
                        .collect(),
                )
            })
        });
        a.use_key_map(parts).unwrap();
        let vb = VarBuilder::from_tensors(w, DType::F64, &CPU)
            .with_adapters(a.clone())
            .unwrap();
        let lin = Linear::new(&vb.pp("qkv"), 6, 12, false).unwrap();
        let l = lin.adapter.clone().unwrap();
        perturb(&a, 40);
        let weight = lin.weight.clone();
        let get = move |dt: DType| weight.to_dtype(dt);
        let base = BaseLayer::new(l.shape(), &get);
        let x = Tensor::randn((3, 6), DType::F64, &CPU, 2).unwrap();
        let mut inputs = vec![x.clone()];
        inputs.extend(
            l.params()
                .into_iter()
                .map(|(_, t)| t.to_dtype(DType::F64).unwrap()),
        );
        assert!(inputs.len() > 6, "{kind}: three projections' parameters");
        let wt = lin.weight.clone();
        let report = gradcheck(
            |t: &[Tensor]| {
                let y = t[0].matmul(&wt.t()?)?;
                l.forward_with(&base, &t[0], y, &t[1..])
            },
            &inputs,
            GradcheckConfig::default(),
        )
        .unwrap();
        assert!(report.checked > 0, "{kind}");
        // The fused change is the projections' stacked by rows.
        let dw = l.delta_weight(&base).unwrap();
        assert_eq!(dw.dims(), [12, 6]);
    }
}

/// The combinations per projection cannot take are refused, naming the key; without it a
/// LoKr on a fused layer cannot be written as PEFT, and the message names the way out.
#[test]
fn per_projection_refusals_are_named() {
    let mut c = config("lora");
    c.kind = "lora".into();
    let e = Adapters::new(c).unwrap_err().to_string();
    assert!(e.contains("per_projection") && e.contains("lora"), "{e}");
    let mut c = config("lokr");
    c.weight_decompose = true;
    let e = Adapters::new(c).unwrap_err().to_string();
    assert!(
        e.contains("per_projection") && e.contains("weight_decompose"),
        "{e}"
    );
    let mut c = config("lokr");
    c.per_projection = false;
    let a = Adapters::new(c).unwrap();
    let _m = flux(&a);
    let e = a.check_peft(&map()).unwrap_err().to_string();
    assert!(e.contains("per_projection"), "{e}");
}

/// peft 0.21.2 on diffusers' tiny FluxTransformer2DModel, with the PEFT file and the
/// `adapter_config.json` FLAME writes, computes FLAME's output for LoKr and LoHa per
/// projection (`scripts/check_peft_adapters.py flux`). Needs Python with torch, diffusers
/// and peft: `FLAME_PYTHON=/work/pyenv/bin/python cargo test --features cpu-ref --test
/// adapters_fused -- --ignored`.
#[test]
#[ignore = "needs Python with torch, diffusers and peft (FLAME_PYTHON)"]
fn per_projection_files_load_into_peft_on_diffusers_flux() {
    let d = temp("peft-flux");
    for kind in ["lokr", "loha"] {
        let a = Adapters::new(config(kind)).unwrap();
        let model = flux(&a);
        perturb(&a, 300);
        let y = run(&model);
        let sub = d.join(kind);
        std::fs::create_dir_all(&sub).unwrap();
        a.save_peft(
            sub.join("adapter_model.safetensors"),
            &map(),
            "base_model.model",
            DType::F32,
        )
        .unwrap();
        a.save_peft_config(sub.join("adapter_config.json"), &map())
            .unwrap();
        flame::safetensors::save([("output", &y)], sub.join("flame.safetensors")).unwrap();
    }
    let python = std::env::var("FLAME_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_peft_adapters.py");
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("flux")
        .arg(&d)
        .arg(fixture())
        .output()
        .expect("python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "peft:\n{text}");
    std::fs::remove_dir_all(&d).ok();
}
