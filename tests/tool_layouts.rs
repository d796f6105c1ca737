//! The LoRA files ai-toolkit and musubi-tuner write for FLUX.2 [klein] and Z-Image
//! (`adapter.format = "ai-toolkit"` / `"musubi"`, `nn::adapter::Tool`). Fixtures
//! (tests/fixtures/tool_loras, 1.0 MB) are made by scripts/make_tool_lora_fixtures.py with
//! the tools' key names (ai-toolkit 27a03a91, musubi-tuner 30c658c4; the script names the
//! files it follows) on the tiny models of tests/flux2.rs and tests/zimage.rs, with PyTorch's
//! merge W + (alpha / rank) B A in f64 as the reference.
//!
//! Checked: the `sample` binary's merge (`LoraMerge`) reads each tool's file onto the rows
//! it changes (f32 against f64: [`MERGE`]), refusing a tensor no layer takes by name; the
//! files FLAME writes hold the tools' names (the fixtures' set, tensor for tensor) and read
//! back into FLAME's adapters (musubi's FLUX.2 file, the kohya layout itself, bit for bit;
//! the others within [`ROUND_TRIP`]: their scale is folded into a tensor); files the tools
//! trained with separate q, k and v LoRAs on Z-Image merge, and are refused, naming the
//! tensor, as trainable adapters of FLAME's fused qkv.
#![cfg(feature = "cpu-ref")]

mod common;

use flame::models::{self, LoadOptions};
use flame::nn::adapter::{AdapterConfig, Adapters, BaseLayer, ModuleNames, Tool};
use flame::nn::{KeyMap, LoraConfig, LoraMerge};
use flame::{DType, Device, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CPU: Device = Device::Cpu;

/// A merged weight in f32 against PyTorch's in f64 (measured: 1.2e-7).
const MERGE: f64 = 1e-6;

/// A tensor read back from a file whose scale alpha / rank was folded into it and taken out
/// again (measured: 1.2e-7); the kohya layout reads back bit for bit.
const ROUND_TRIP: f64 = 1e-6;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tool_file(name: &str) -> PathBuf {
    fixtures().join(format!("tool_loras/{name}.safetensors"))
}

/// The tiny model's single file.
fn model_file(family: &str) -> PathBuf {
    match family {
        "flux2" => fixtures().join("flux2/flux2/single_file.safetensors"),
        "zimage" => fixtures().join("zimage/single_file.safetensors"),
        _ => panic!("{family}"),
    }
}

/// Load options for the tiny model's single file in f32: Z-Image's tiny head dim needs its
/// config.json (its shapes do not give the RoPE axes).
fn options(family: &str) -> LoadOptions {
    let mut opts = LoadOptions::new(DType::F32, &CPU);
    if family == "zimage" {
        let json = fixtures().join("zimage/transformer/config.json");
        opts.config = Some(serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap());
    }
    opts
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    flame::safetensors::load(path, &CPU)
        .unwrap()
        .into_iter()
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-tools-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny model of `family` with `merge` merged into its weights (f32): its weights by key.
fn merged_weights(family: &str, merge: LoraMerge) -> flame::Result<BTreeMap<String, Tensor>> {
    let mut opts = options(family);
    opts.merge = Some(Arc::new(merge));
    let l = models::load(family, model_file(family), &opts)?;
    Ok(l.vb.params()?.into_iter().collect())
}

/// The family's weights without a LoRA.
fn base_weights(family: &str) -> BTreeMap<String, Tensor> {
    let l = models::load(family, model_file(family), &options(family)).unwrap();
    l.vb.params().unwrap().into_iter().collect()
}

/// Each tool's file merged by the `sample` binary's merge gives PyTorch's merged weights,
/// and leaves every other weight as it was.
#[test]
fn the_tools_files_merge_onto_the_rows_they_change() {
    let want = load(&fixtures().join("tool_loras/merged.safetensors"));
    for (name, family) in [
        ("flux2_ai_toolkit", "flux2"),
        ("flux2_musubi", "flux2"),
        ("zimage_ai_toolkit", "zimage"),
        ("zimage_musubi", "zimage"),
    ] {
        let fam = models::family(family).unwrap();
        let m = LoraMerge::open(tool_file(name), 1.0, fam.subfolder).unwrap();
        let got = merged_weights(family, m).unwrap();
        let base = base_weights(family);
        let (mut changed, mut worst) = (0, 0f64);
        for (k, w) in &got {
            match want.get(&format!("{name}.{k}")) {
                Some(t) => {
                    let e = common::rel_err(w, t);
                    assert!(e <= MERGE, "{name}: {k} off by {e:e}");
                    worst = worst.max(e);
                    changed += 1;
                }
                None => assert_eq!(
                    w.to_vec_f64().unwrap(),
                    base[k].to_vec_f64().unwrap(),
                    "{name}: {k} changed"
                ),
            }
        }
        let expected = want
            .keys()
            .filter(|k| k.starts_with(&format!("{name}.")))
            .count();
        assert_eq!(changed, expected, "{name}: merged weights");
        println!("{name}: {changed} weights merged, within {worst:.1e} of PyTorch's");
    }
}

/// A tensor of such a file that no layer takes is refused, naming it.
#[test]
fn a_tools_file_with_a_foreign_tensor_is_refused_by_name() {
    let d = temp("foreign");
    for (name, family, extra) in [
        (
            "zimage_musubi",
            "zimage",
            "lora_unet_layers_9_attention_to_q.lora_down.weight",
        ),
        (
            "flux2_ai_toolkit",
            "flux2",
            "diffusion_model.double_blocks.0.img_attn.qkv_typo.lora_A.weight",
        ),
    ] {
        let mut t = load(&tool_file(name));
        t.insert(
            extra.into(),
            Tensor::zeros((4, 32), DType::F32, &CPU).unwrap(),
        );
        let f = d.join(format!("{name}.safetensors"));
        flame::safetensors::save(t.iter().map(|(k, v)| (k.as_str(), v)), &f).unwrap();
        let fam = models::family(family).unwrap();
        let m = LoraMerge::open(&f, 1.0, fam.subfolder).unwrap();
        let e = merged_weights(family, m).unwrap_err().to_string();
        assert!(e.contains(extra), "{name}: {e}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Adapters of kind LoRA (rank 4, alpha 3) on the layers `targets` matches of the tiny
/// `family`, every tensor random; with the model's diffusers map.
fn adapters(family: &str, targets: &[&str], seed: u64) -> (Arc<Adapters>, KeyMap) {
    let config = AdapterConfig::from(LoraConfig {
        rank: 4,
        alpha: 3.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed,
    });
    let a = Adapters::new(config).unwrap();
    let opts = options(family).with_adapters(a.clone());
    let l = models::load(family, model_file(family), &opts).unwrap();
    for (i, layer) in a.layers().unwrap().iter().enumerate() {
        for (j, (_, p)) in layer.params().into_iter().enumerate() {
            let v = Tensor::randn(
                p.dims().to_vec(),
                DType::F32,
                &CPU,
                seed + 10 * i as u64 + j as u64,
            )
            .unwrap();
            p.assign(&v.affine(0.2, 0.0).unwrap()).unwrap();
        }
    }
    a.set_train(false);
    (a, l.key_map)
}

/// The tool's targets in FLAME's layer names, as its default configuration chooses them
/// (the fixtures' layers).
fn targets(family: &str, tool: Tool) -> &'static [&'static str] {
    match (family, tool) {
        ("flux2", _) => &["double_blocks.*", "single_blocks.*"],
        ("zimage", Tool::AiToolkit) => &["layers.*"],
        ("zimage", Tool::Musubi) => &["layers.*.attention.*", "layers.*.feed_forward.*"],
        _ => panic!("{family}"),
    }
}

fn names(family: &str, tool: Tool) -> ModuleNames {
    models::family(family).unwrap().tool_names.of(tool).unwrap()
}

fn shapes(path: &Path) -> BTreeMap<String, Vec<usize>> {
    let f = flame::safetensors::SafeTensorsFile::open(path).unwrap();
    f.names()
        .map(|n| (n.to_string(), f.info(n).unwrap().shape.clone()))
        .collect()
}

fn params(a: &Adapters) -> BTreeMap<String, Vec<f32>> {
    a.params()
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.to_vec::<f32>().unwrap()))
        .collect()
}

/// FLAME's files in each tool's layout: the tool's tensor names and shapes (the fixtures'),
/// read back into fresh adapters, and merged by the `sample` binary's merge as FLAME's
/// adapters change the weights.
#[test]
fn flame_writes_the_tools_layouts_and_reads_them_back() {
    let d = temp("write");
    for (family, tool, fixture) in [
        ("flux2", Tool::AiToolkit, "flux2_ai_toolkit"),
        ("flux2", Tool::Musubi, "flux2_musubi"),
        ("zimage", Tool::AiToolkit, "zimage_ai_toolkit"),
        ("zimage", Tool::Musubi, "zimage_musubi"),
    ] {
        let what = format!("{family} {}", tool.name());
        let (a, map) = adapters(family, targets(family, tool), 7);
        let file = d.join(format!("{fixture}.safetensors"));
        a.save_tool(tool, names(family, tool), &map, &file, DType::F32, None)
            .unwrap();
        // The tool's names and shapes, tensor for tensor.
        assert_eq!(shapes(&file), shapes(&tool_file(fixture)), "{what}");

        // Back into fresh adapters.
        let (b, _) = adapters(family, targets(family, tool), 99);
        b.load_tool(tool, names(family, tool), &map, &file).unwrap();
        let (pa, pb) = (params(&a), params(&b));
        assert_eq!(pa.keys().collect::<Vec<_>>(), pb.keys().collect::<Vec<_>>());
        let mut worst = 0f64;
        for (k, va) in &pa {
            let vb = &pb[k];
            let scale = va.iter().fold(1e-12f32, |m, x| m.max(x.abs()));
            let e = va
                .iter()
                .zip(vb)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale;
            worst = worst.max(f64::from(e));
        }
        println!("{what}: round trip {worst:.1e}");
        match (family, tool) {
            ("flux2", Tool::Musubi) => assert_eq!(worst, 0.0, "{what}"),
            _ => assert!(worst <= ROUND_TRIP, "{what}: {worst}"),
        }

        // Merged as the adapters change the weights.
        let fam = models::family(family).unwrap();
        let got =
            merged_weights(family, LoraMerge::open(&file, 1.0, fam.subfolder).unwrap()).unwrap();
        let base = base_weights(family);
        for l in a.layers().unwrap() {
            let key = format!("{}.weight", l.path());
            let w = base[&key].clone();
            let get = move |dt: DType| w.to_dtype(dt);
            let delta = l.delta_weight(&BaseLayer::new(l.shape(), &get)).unwrap();
            let want = base[&key].add(&delta).unwrap();
            let e = common::rel_err(&got[&key], &want);
            assert!(e <= 1e-5, "{what}: {key} merged off by {e:e}");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// musubi-tuner's FLUX.2 file is FLAME's kohya layout: the same tensors under the same names.
#[test]
fn musubis_flux2_layout_is_the_kohya_layout() {
    let d = temp("kohya");
    let (a, map) = adapters("flux2", targets("flux2", Tool::Musubi), 3);
    let (musubi, kohya) = (d.join("musubi.safetensors"), d.join("kohya.safetensors"));
    a.save_tool(
        Tool::Musubi,
        ModuleNames::Original,
        &map,
        &musubi,
        DType::BF16,
        None,
    )
    .unwrap();
    a.save_kohya(&kohya, DType::BF16).unwrap();
    let (m, k) = (load(&musubi), load(&kohya));
    assert_eq!(m.keys().collect::<Vec<_>>(), k.keys().collect::<Vec<_>>());
    for (n, t) in &m {
        assert_eq!(t.dtype(), k[n].dtype(), "{n}");
        assert_eq!(t.to_vec_f64().unwrap(), k[n].to_vec_f64().unwrap(), "{n}");
    }
    // And every name is the fixture's, as musubi-tuner names FLUX.2's block Linears.
    let fixture: BTreeSet<String> = load(&tool_file("flux2_musubi")).into_keys().collect();
    assert_eq!(k.into_keys().collect::<BTreeSet<_>>(), fixture);
    let _ = std::fs::remove_dir_all(&d);
}

/// The tools' own FLUX.2 files read into FLAME's adapters (the fused qkv is one module in
/// BFL's names), which then change the weights as the files say; their Z-Image files, of
/// separate q, k and v LoRAs, are refused as adapters of FLAME's fused qkv, naming the
/// tensor (they merge: above).
#[test]
fn the_tools_files_as_trainable_adapters() {
    let want = load(&fixtures().join("tool_loras/merged.safetensors"));
    for (name, tool, alpha) in [
        ("flux2_ai_toolkit", Tool::AiToolkit, 4.0),
        ("flux2_musubi", Tool::Musubi, 2.0),
    ] {
        let mut config = AdapterConfig::from(LoraConfig {
            rank: 4,
            alpha,
            dropout: 0.0,
            targets: targets("flux2", tool)
                .iter()
                .map(|s| s.to_string())
                .collect(),
            seed: 1,
        });
        config.kind = "lora".into();
        let a = Adapters::new(config).unwrap();
        let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
        let l = models::load("flux2", model_file("flux2"), &opts).unwrap();
        a.load_tool(tool, ModuleNames::Original, &l.key_map, tool_file(name))
            .unwrap();
        let base = base_weights("flux2");
        for layer in a.layers().unwrap() {
            let key = format!("{}.weight", layer.path());
            let w = base[&key].clone();
            let get = move |dt: DType| w.to_dtype(dt);
            let delta = layer
                .delta_weight(&BaseLayer::new(layer.shape(), &get))
                .unwrap();
            let e = common::rel_err(
                &base[&key].add(&delta).unwrap(),
                &want[&format!("{name}.{key}")],
            );
            assert!(e <= MERGE, "{name}: {key} off by {e:e}");
        }
    }
    for (name, tool, refused) in [
        (
            "zimage_ai_toolkit",
            Tool::AiToolkit,
            "diffusion_model.layers.0.attention.to_k.lora_A.weight",
        ),
        (
            "zimage_musubi",
            Tool::Musubi,
            "lora_unet_layers_0_attention_to_k.lora_down.weight",
        ),
    ] {
        let (a, map) = adapters("zimage", targets("zimage", tool), 5);
        let e = a
            .load_tool(tool, ModuleNames::Diffusers, &map, tool_file(name))
            .unwrap_err()
            .to_string();
        assert!(e.contains(refused) && e.contains("differs"), "{name}: {e}");
    }
}

/// The layouts are LoRA's: another kind is refused by name, in the API and in the config;
/// so is a family FLAME does not write them for.
#[test]
fn the_tools_layouts_are_for_lora_on_flux2_and_zimage() {
    let mut config = AdapterConfig::from(LoraConfig {
        rank: 4,
        alpha: 4.0,
        dropout: 0.0,
        targets: vec!["double_blocks.*".into()],
        seed: 1,
    });
    config.kind = "loha".into();
    let a = Adapters::new(config).unwrap();
    let opts = LoadOptions::new(DType::F32, &CPU).with_adapters(a.clone());
    let l = models::load("flux2", model_file("flux2"), &opts).unwrap();
    let d = temp("kinds");
    let e = a
        .save_tool(
            Tool::AiToolkit,
            ModuleNames::Original,
            &l.key_map,
            d.join("x.safetensors"),
            DType::F32,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("ai-toolkit") && e.contains("loha"), "{e}");
    let _ = std::fs::remove_dir_all(&d);

    let template = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/klein.toml"),
    )
    .unwrap();
    let with = |format: &str, kind: &str, arch: &str| {
        let t = template
            .replace("format = \"peft\"", &format!("format = \"{format}\""))
            .replace("arch = \"flux2\"", &format!("arch = \"{arch}\""));
        let t = if kind == "lora" {
            t
        } else {
            t.replace("[adapter]", &format!("[adapter]\nkind = \"{kind}\""))
        };
        flame::train::TrainConfig::from_toml(&t)
    };
    for format in ["ai-toolkit", "musubi"] {
        let c = with(format, "lora", "flux2").unwrap();
        assert_eq!(c.adapter.format.tool().unwrap().name(), format);
        let c = with(format, "lora", "zimage").unwrap();
        assert_eq!(c.adapter.format.tool().unwrap().name(), format);
        let e = with(format, "dora", "flux2").unwrap_err().to_string();
        assert!(e.contains("adapter.format") && e.contains("dora"), "{e}");
        let e = with(format, "lora", "sdxl").unwrap_err().to_string();
        assert!(
            e.contains("adapter.format") && e.contains("flux2 and zimage"),
            "{e}"
        );
    }
}
