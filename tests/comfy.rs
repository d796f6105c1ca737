//! The adapter files FLAME writes, read as ComfyUI reads them. `tests/fixtures/comfy/` holds
//! the key maps ComfyUI's own `comfy.lora.model_lora_keys_unet` builds for the tiny Flux,
//! SD3.5 and SDXL models of the model fixtures, and the tensor names its `load_lora` and
//! weight adapters look for (`scripts/make_comfy_keymaps.py`, ComfyUI 0.3.64). For every
//! adapter kind, on every Linear and convolution of the models' blocks, each tensor of the
//! kohya-layout file must be one ComfyUI maps to a weight and reads, and the change ComfyUI
//! computes from the file (its scale rules, written out below from its code) must be the
//! change FLAME's adapter applies. DoRA is the exception ComfyUI makes: with a magnitude per
//! output row it divides by the norm of W, where PEFT, LyCORIS and FLAME divide by the norm
//! of W + ΔW; `adapter.format = "comfyui"` writes the magnitudes so that ComfyUI computes
//! what FLAME trained. The PEFT layout of Flux and SD3.5 maps as well. The keys of the
//! released Flux-dev, SD3.5-large and SDXL base are checked against the maps ComfyUI builds
//! for them at full size. FLUX.2 [klein] and Z-Image are read through the maps a recent
//! ComfyUI builds for their tiny models (`scripts/make_comfy_keymaps_flux2_zimage.py`), in
//! both layouts, and per-projection LoKr and LoHa (`lycoris_` names, PEFT modules) on the
//! projections' rows of fused weights.
#![cfg(feature = "cpu-ref")]

use flame::models::{self, LoadOptions, ModelSpec};
use flame::nn::adapter::{AdapterConfig, Adapters, BaseLayer};
use flame::nn::{kohya_name, LoraConfig};
use flame::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const CPU: Device = Device::Cpu;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flame-comfy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Where ComfyUI applies a key's change: the weight's rows (start, size) in ComfyUI's units,
/// the whole weight, or the whole weight with the change's two halves of rows swapped
/// (`comfy.utils.swap_scale_shift`: diffusers' order of an adaLN's scale and shift).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Whole,
    Rows(usize, usize),
    Swapped,
}

/// A ComfyUI key map: adapter key -> (model weight key without `diffusion_model.`, where).
type KeyMap = HashMap<String, (String, Place)>;

fn key_map(name: &str) -> KeyMap {
    let path = fixtures().join(format!("comfy/{name}.json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let strip = |k: &str| k.trim_start_matches("diffusion_model.").to_string();
    v["map"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, t)| {
            let target = match t {
                Value::String(s) => (strip(s), Place::Whole),
                Value::Array(a) if a.len() == 4 => {
                    assert_eq!(a[1].as_u64(), Some(0), "{k}: a slice along rows");
                    let n = |i: usize| a[i].as_u64().unwrap() as usize;
                    (strip(a[0].as_str().unwrap()), Place::Rows(n(2), n(3)))
                }
                Value::Array(a) if a.get(1).and_then(Value::as_str) == Some("swap_scale_shift") => {
                    (strip(a[0].as_str().unwrap()), Place::Swapped)
                }
                _ => panic!("{k}: target {t}"),
            };
            (k.clone(), target)
        })
        .collect()
}

/// Every tensor name ComfyUI's `load_lora` and its weight adapters read after a mapped key.
fn comfy_suffixes() -> BTreeSet<String> {
    let path = fixtures().join("comfy/kinds.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut s: BTreeSet<String> = v["load_lora"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    for (_, a) in v["adapters"].as_object().unwrap() {
        for variant in a["variants"].as_array().unwrap() {
            s.insert(variant["trigger"].as_str().unwrap().to_string());
            for r in variant["requires"].as_array().unwrap() {
                s.insert(r.as_str().unwrap().to_string());
            }
            for (o, _) in variant["optional"].as_object().unwrap() {
                s.insert(o.clone());
            }
        }
    }
    s
}

/// A tiny model of `family` from the model fixtures, with adapters of `kind` on every Linear
/// and convolution of its blocks, every adapter tensor random (DoRA's magnitudes set from the
/// weights first): (the model's weights by key, the adapters, the diffusers key map).
fn tiny(family: &str, kind: &str) -> (HashMap<String, Tensor>, Arc<Adapters>, flame::nn::KeyMap) {
    tiny_with(family, kind, false)
}

/// [`tiny`], with LoKr and LoHa one adapter per diffusers projection of a fused layer
/// (`per_projection`) when asked.
fn tiny_with(
    family: &str,
    kind: &str,
    per_projection: bool,
) -> (HashMap<String, Tensor>, Arc<Adapters>, flame::nn::KeyMap) {
    let sub = models::family(family).unwrap().subfolder;
    let (folder, targets): (PathBuf, &[&str]) = match family {
        "flux" => (
            fixtures().join("models/flux").join(sub),
            &["double_blocks.*", "single_blocks.*"],
        ),
        "sd3" => (
            fixtures().join("models/sd35_large").join(sub),
            &["joint_blocks.*"],
        ),
        "sdxl" => (
            fixtures().join("models/sdxl").join(sub),
            &["input_blocks.*", "middle_block.*", "output_blocks.*"],
        ),
        "flux2" => (
            fixtures().join("flux2/flux2").join(sub),
            &["double_blocks.*", "single_blocks.*"],
        ),
        "zimage" => (
            fixtures().join("zimage").join(sub),
            &["noise_refiner.*", "context_refiner.*", "layers.*"],
        ),
        _ => panic!("no tiny {family}"),
    };
    let mut config = AdapterConfig::from(LoraConfig {
        rank: 4,
        alpha: 3.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed: 5,
    });
    config.kind = kind.into();
    config.conv_rank = 2;
    config.conv_alpha = 1.5;
    config.per_projection = per_projection;
    if per_projection {
        // PEFT's factor split, so that the PEFT layout can be written.
        config.lokr_split = flame::nn::LokrSplit::Peft;
    }
    let adapters = Adapters::new(config).unwrap();
    let json = serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
        .unwrap();
    let mut opts = LoadOptions::new(DType::F32, &CPU).with_adapters(adapters.clone());
    opts.config = Some(json);
    let l = models::load(family, &folder, &opts).unwrap();
    let weights: HashMap<String, Tensor> = l.vb.params().unwrap().into_iter().collect();
    for (i, layer) in adapters.layers().unwrap().iter().enumerate() {
        // DoRA's magnitudes come from the weight at the first use.
        let w = weights[&format!("{}.weight", layer.path())].clone();
        let get = move |dt: DType| w.to_dtype(dt);
        layer
            .delta_weight(&BaseLayer::new(layer.shape(), &get))
            .unwrap();
        for (j, (name, p)) in layer.params().into_iter().enumerate() {
            if name == "dora_scale" {
                continue;
            }
            let seed = 1000 + 10 * i as u64 + j as u64;
            let v = Tensor::randn(p.dims().to_vec(), DType::F32, &CPU, seed).unwrap();
            p.assign(&v.affine(0.2, 0.0).unwrap()).unwrap();
        }
    }
    adapters.set_train(false);
    (weights, adapters, l.key_map)
}

/// The change FLAME's adapter on `path` applies to its weight `w`.
fn flame_delta(adapters: &Adapters, path: &str, w: &Tensor) -> Tensor {
    let layer = adapters
        .layers()
        .unwrap()
        .into_iter()
        .find(|l| l.path() == path)
        .unwrap();
    let w = w.clone();
    let get = move |dt: DType| w.to_dtype(dt);
    layer
        .delta_weight(&BaseLayer::new(layer.shape(), &get))
        .unwrap()
}

fn mat(t: &Tensor) -> (usize, usize, Vec<f32>) {
    let d = t.dims();
    let rows = d[0];
    let v = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    (rows, v.len() / rows.max(1), v)
}

fn mm(a: &Tensor, b: &Tensor) -> (usize, usize, Vec<f32>) {
    let (n, k, a) = mat(a);
    let (k2, m, b) = mat(b);
    assert_eq!(k, k2);
    let mut c = vec![0f32; n * m];
    for i in 0..n {
        for l in 0..k {
            let x = a[i * k + l];
            for j in 0..m {
                c[i * m + j] += x * b[l * m + j];
            }
        }
    }
    (n, m, c)
}

fn kron(a: (usize, usize, Vec<f32>), b: (usize, usize, Vec<f32>)) -> Vec<f32> {
    let ((n1, m1, a), (n2, m2, b)) = (a, b);
    let cols = m1 * m2;
    let mut c = vec![0f32; n1 * n2 * cols];
    for i in 0..n1 {
        for j in 0..m1 {
            for k in 0..n2 {
                for l in 0..m2 {
                    c[(i * n2 + k) * cols + j * m2 + l] = a[i * m1 + j] * b[k * m2 + l];
                }
            }
        }
    }
    c
}

/// The change ComfyUI 0.3.64 computes for one layer from the tensors `t` a file holds under
/// its key (names after the key's dot), on the weight `w` (rows, cols): its `load_lora` and
/// `calculate_weight` at strength 1, written out from comfy/lora.py and
/// comfy/weight_adapter/{lora,loha,lokr,base}.py.
fn comfy_delta(t: &BTreeMap<String, Tensor>, w: &[f32], rows: usize) -> Vec<f32> {
    let alpha = t.get("alpha").map(|a| {
        a.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0]
    });
    let scaled = |v: Vec<f32>, s: f32| v.into_iter().map(|x| x * s).collect::<Vec<_>>();
    if let Some(diff) = t.get("diff") {
        return mat(diff).2;
    }
    // lora.py's pairs: kohya's up/down, PEFT's B/A.
    let pair = [
        ("lora_up.weight", "lora_down.weight"),
        ("lora_B.weight", "lora_A.weight"),
    ]
    .into_iter()
    .find_map(|(u, d)| Some((t.get(u)?, t.get(d)?)));
    if let Some((up, down)) = pair {
        // lora.py: alpha / rank (the down-projection's rows), 1 without an alpha.
        let r = down.dims()[0];
        let s = alpha.map_or(1.0, |a| a / r as f32);
        let (_, _, d) = mm(up, down);
        let d = scaled(d, s);
        let Some(m) = t.get("dora_scale") else {
            return d;
        };
        // base.py `weight_decompose`: W' = (W + ΔW) m / n, n the norm of each row of W when
        // m has a value a row, else of each column of W + ΔW; ComfyUI adds float32's eps.
        let cols = w.len() / rows;
        let v: Vec<f32> = w.iter().zip(&d).map(|(a, b)| a + b).collect();
        let m = mat(m).2;
        let eps = f32::EPSILON;
        let per_row = m.len() == rows;
        let mut out = vec![0f32; w.len()];
        for i in 0..rows {
            for j in 0..cols {
                let (scale, norm) = if per_row {
                    let n = (0..cols)
                        .map(|k| w[i * cols + k].powi(2))
                        .sum::<f32>()
                        .sqrt();
                    (m[i], n)
                } else {
                    let n = (0..rows)
                        .map(|k| v[k * cols + j].powi(2))
                        .sum::<f32>()
                        .sqrt();
                    (m[j], n)
                };
                out[i * cols + j] = v[i * cols + j] * scale / (norm + eps) - w[i * cols + j];
            }
        }
        return out;
    }
    if let Some(w1a) = t.get("hada_w1_a") {
        // loha.py: alpha / the rank of w1_b, 1 without an alpha; (w1a w1b) ⊙ (w2a w2b).
        let w1b = &t["hada_w1_b"];
        let s = alpha.map_or(1.0, |a| a / w1b.dims()[0] as f32);
        let (_, _, a) = mm(w1a, w1b);
        let (_, _, b) = mm(&t["hada_w2_a"], &t["hada_w2_b"]);
        return a.iter().zip(&b).map(|(x, y)| x * y * s).collect();
    }
    if t.keys().any(|k| k.starts_with("lokr_")) {
        // lokr.py: the rank is w2_b's rows if w2 is low-rank, else w1_b's if w1 is; alpha /
        // rank then, and 1 when both factors are full or without an alpha.
        let mut dim = None;
        let w1 = match t.get("lokr_w1") {
            Some(w1) => mat(w1),
            None => {
                dim = Some(t["lokr_w1_b"].dims()[0]);
                mm(&t["lokr_w1_a"], &t["lokr_w1_b"])
            }
        };
        let w2 = match t.get("lokr_w2") {
            Some(w2) => mat(w2),
            None => {
                dim = Some(t["lokr_w2_b"].dims()[0]);
                mm(&t["lokr_w2_a"], &t["lokr_w2_b"])
            }
        };
        let s = match (alpha, dim) {
            (Some(a), Some(r)) => a / r as f32,
            _ => 1.0,
        };
        return scaled(kron(w1, w2), s);
    }
    panic!(
        "no tensor ComfyUI reads: {:?}",
        t.keys().collect::<Vec<_>>()
    );
}

fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// A file's tensors grouped by the key before their tensor name: (key, tensor name) for
/// kohya files (no dot in a key) or by the longest key of `map` a tensor starts with.
fn group(file: &Path, map: &KeyMap, kohya: bool) -> BTreeMap<String, BTreeMap<String, Tensor>> {
    let tensors = flame::safetensors::load(file, &CPU).unwrap();
    let mut groups: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (k, v) in tensors {
        let (key, name) = if kohya {
            let (a, b) = k.split_once('.').unwrap();
            (a.to_string(), b.to_string())
        } else {
            let key = map
                .keys()
                .filter(|m| k.starts_with(&format!("{m}.")))
                .max_by_key(|m| m.len())
                .unwrap_or_else(|| panic!("{file:?}: ComfyUI maps no key of {k}"));
            (key.clone(), k[key.len() + 1..].to_string())
        };
        groups.entry(key).or_default().insert(name, v);
    }
    groups
}

/// The rows of the layer one of a file's keys changes (the whole layer, or its rows that
/// ComfyUI's key map gives the key), in the tiny model's rows: ComfyUI's unit for SD3's
/// slices is 64 x depth, not the tiny width, so a slice's place scales with the part's rows.
fn rows_of(place: Place, part: usize) -> usize {
    match place {
        Place::Rows(s, size) => s * part / size,
        _ => 0,
    }
}

/// The rows of the change the tensors `t` of one key stand for.
fn out_rows(t: &BTreeMap<String, Tensor>) -> usize {
    let rows = |n: &str| t.get(n).map(|v| v.dims()[0]);
    if let Some(r) = rows("diff")
        .or(rows("lora_up.weight"))
        .or(rows("hada_w1_a"))
    {
        return r;
    }
    let w1 = rows("lokr_w1").or(rows("lokr_w1_a")).unwrap();
    let w2 = rows("lokr_w2").or(rows("lokr_w2_a")).unwrap();
    w1 * w2
}

/// `kind`'s kohya file of the tiny `family` (LoKr and LoHa one adapter per diffusers
/// projection when `per_projection`): each key one ComfyUI's map `map` gives a weight of an
/// adapted layer (the whole of it, or a projection's rows), each tensor one it reads, every
/// row of every adapted layer covered once, and the change ComfyUI computes on those rows
/// the adapter's.
fn kohya_file_loads_in_comfyui(family: &str, map: &str, kind: &str, per_projection: bool) {
    let suffixes = comfy_suffixes();
    let map = key_map(map);
    let (weights, adapters, _) = tiny_with(family, kind, per_projection);
    let d = temp(&format!("{family}-{kind}-{per_projection}"));
    let file = d.join("kohya.safetensors");
    adapters.save_kohya(&file, DType::F32).unwrap();
    let groups = group(&file, &map, true);
    let layers = adapters.layers().unwrap();
    let mut covered: HashMap<String, usize> = HashMap::new();
    let mut split = 0;
    for (key, tensors) in &groups {
        let (target, place) = map
            .get(key)
            .unwrap_or_else(|| panic!("{family} {kind}: ComfyUI maps no {key}"));
        let path = target.trim_end_matches(".weight");
        assert!(
            layers.iter().any(|l| l.path() == path),
            "{family} {kind}: {key} -> {target}, not adapted"
        );
        if *place == Place::Whole {
            assert_eq!(key, &kohya_name(path), "{family} {kind}");
        } else {
            assert!(
                matches!(place, Place::Rows(..)),
                "{family} {kind} {key}: {place:?}"
            );
            split += 1;
        }
        for name in tensors.keys() {
            assert!(
                suffixes.contains(&format!(".{name}")),
                "{family} {kind}: ComfyUI does not read {key}.{name}"
            );
        }
        // A bias change goes to the layer's bias, which ComfyUI patches only where the model
        // has one.
        let bias = format!("{path}.bias");
        if let Some(b) = tensors.get("diff_b") {
            assert!(weights.contains_key(&bias), "{key}: no {bias} for diff_b");
            assert_eq!(b.dims(), weights[&bias].dims(), "{key}.diff_b");
        }
        if kind == "full" {
            assert_eq!(
                tensors.contains_key("diff_b"),
                weights.contains_key(&bias),
                "{key}"
            );
        }
        let w = &weights[target];
        let (rows, cols, wv) = mat(w);
        let part = out_rows(tensors);
        let start = rows_of(*place, part);
        assert!(
            start + part <= rows,
            "{family} {kind} {key}: rows {start}+{part} of {rows}"
        );
        let comfy = comfy_delta(tensors, &wv[start * cols..(start + part) * cols], part);
        let flame = mat(&flame_delta(&adapters, path, w)).2;
        let e = rel_diff(&comfy, &flame[start * cols..(start + part) * cols]);
        assert!(
            e < 1e-5,
            "{family} {kind} {key}: ComfyUI's change off by {e}"
        );
        *covered.entry(path.to_string()).or_default() += part;
    }
    for layer in &layers {
        assert_eq!(
            covered.get(layer.path()).copied(),
            Some(layer.shape().out_dim()),
            "{family} {kind}: {} not covered once",
            layer.path()
        );
    }
    assert_eq!(
        split > 0,
        per_projection && !layers.is_empty() && family != "sdxl",
        "{family} {kind}: {split} keys on a projection's rows"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Every kind's kohya file, on every adapted layer of the tiny Flux, SD3.5 and SDXL: each key
/// one ComfyUI maps to the layer's weight, each tensor one it reads, and the change it
/// computes the adapter's (DoRA: see `dora_needs_the_comfyui_layout`).
#[test]
fn kohya_files_load_in_comfyui_as_trained() {
    for (family, map) in [
        ("flux", "flux_tiny"),
        ("sd3", "sd35_tiny"),
        ("sdxl", "sdxl_tiny"),
    ] {
        for kind in ["lora", "lokr", "loha", "full"] {
            kohya_file_loads_in_comfyui(family, map, kind, false);
        }
    }
}

/// FLUX.2 [klein] and Z-Image: every kind's kohya file, on every Linear of the blocks, read
/// through the key maps a recent ComfyUI builds for them (`flux2_tiny.json`,
/// `zimage_tiny.json`: `scripts/make_comfy_keymaps_flux2_zimage.py`). Each layer's kohya name
/// is `lora_unet_` and its checkpoint key, which ComfyUI maps for every weight of the model;
/// the change it computes is the adapter's.
#[test]
fn flux2_and_zimage_kohya_files_load_in_comfyui_as_trained() {
    for (family, map) in [("flux2", "flux2_tiny"), ("zimage", "zimage_tiny")] {
        for kind in ["lora", "lokr", "loha", "full"] {
            kohya_file_loads_in_comfyui(family, map, kind, false);
        }
    }
}

/// LoKr and LoHa one adapter per diffusers projection (`adapter.per_projection`): the kohya
/// file names each projection `lycoris_<diffusers module>`, which ComfyUI's Flux, FLUX.2 and
/// Z-Image maps give the projection's rows of the fused weight (Flux's and FLUX.2's
/// double-block qkv, Flux's single-block linear1, Z-Image's qkv; FLUX.2's single-block linear1
/// is one diffusers module, `to_qkv_mlp_proj`, and keeps one adapter); the change ComfyUI
/// computes on each projection's rows is the adapter's there.
#[test]
fn per_projection_kohya_files_load_in_comfyui_as_trained() {
    for (family, map) in [
        ("flux", "flux_tiny"),
        ("flux2", "flux2_tiny"),
        ("zimage", "zimage_tiny"),
    ] {
        for kind in ["lokr", "loha"] {
            kohya_file_loads_in_comfyui(family, map, kind, true);
        }
    }
}

/// DoRA: FLAME's kohya file stores the magnitude a row (LyCORIS's `wd_on_out` form, which
/// LyCORIS and FLAME read back exactly); ComfyUI then divides by ‖W‖ instead of ‖W + ΔW‖ and
/// computes another layer. The "comfyui" layout stores m (‖W‖ + ε) / ‖W + ΔW‖ instead, which
/// ComfyUI turns into what FLAME trained, and FLAME reads it back to the same adapter.
#[test]
fn dora_needs_the_comfyui_layout() {
    for (family, map) in [
        ("flux", "flux_tiny"),
        ("sd3", "sd35_tiny"),
        ("sdxl", "sdxl_tiny"),
        ("flux2", "flux2_tiny"),
        ("zimage", "zimage_tiny"),
    ] {
        let map = key_map(map);
        let (weights, adapters, _) = tiny(family, "dora");
        let d = temp(&format!("{family}-dora"));
        let kohya = d.join("kohya.safetensors");
        adapters.save_kohya(&kohya, DType::F32).unwrap();
        let comfyui = d.join("comfyui.safetensors");
        adapters
            .save_comfyui(&comfyui, DType::F32, &|path: &str| {
                Ok(weights[&format!("{path}.weight")].clone())
            })
            .unwrap();
        let (plain, made) = (group(&kohya, &map, true), group(&comfyui, &map, true));
        let mut worst_plain = 0f32;
        for layer in adapters.layers().unwrap() {
            let key = kohya_name(layer.path());
            assert!(map.contains_key(&key), "{family}: ComfyUI maps no {key}");
            let w = &weights[&format!("{}.weight", layer.path())];
            let (rows, _, wv) = mat(w);
            let flame = mat(&flame_delta(&adapters, layer.path(), w)).2;
            worst_plain = worst_plain.max(rel_diff(&comfy_delta(&plain[&key], &wv, rows), &flame));
            let e = rel_diff(&comfy_delta(&made[&key], &wv, rows), &flame);
            assert!(e < 1e-5, "{family} {key}: the comfyui layout off by {e}");
        }
        println!(
            "{family}: ComfyUI's DoRA from the kohya file is {worst_plain:.3} of the change off"
        );
        assert!(
            worst_plain > 1e-3,
            "{family}: ComfyUI computed FLAME's DoRA from the plain file ({worst_plain})"
        );
        // The comfyui file reads back into the same adapters.
        let (_, back, _) = tiny(family, "dora");
        back.load_comfyui(&comfyui, &|path: &str| {
            Ok(weights[&format!("{path}.weight")].clone())
        })
        .unwrap();
        for (a, b) in adapters
            .layers()
            .unwrap()
            .iter()
            .zip(back.layers().unwrap())
        {
            for ((n, x), (_, y)) in a.params().into_iter().zip(b.params()) {
                let e = rel_diff(&mat(&y).2, &mat(&x).2);
                assert!(e < 1e-5, "{family} {} {n}: read back off by {e}", a.path());
            }
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// The PEFT layout (diffusers' module names under `transformer.`, a fused layer's parts
/// under their own names) of Flux, SD3.5, FLUX.2 [klein] and Z-Image: LoRA, and LoKr and LoHa
/// one adapter per projection (`adapter.per_projection`, the PEFT layout of these kinds on a
/// fused layer): every key one ComfyUI maps, to the part's rows of the fused weight, each
/// tensor one it reads, and the change it computes the adapter's on those rows. The PEFT
/// file has no `alpha`: its tensors carry the scale, and ComfyUI then scales by 1.
#[test]
fn peft_files_load_in_comfyui_as_trained() {
    let suffixes = comfy_suffixes();
    let cases = [
        ("flux", "flux_tiny", "lora", false),
        ("sd3", "sd35_tiny", "lora", false),
        ("flux2", "flux2_tiny", "lora", false),
        ("zimage", "zimage_tiny", "lora", false),
        ("flux", "flux_tiny", "lokr", true),
        ("flux2", "flux2_tiny", "lokr", true),
        ("zimage", "zimage_tiny", "lokr", true),
        ("flux", "flux_tiny", "loha", true),
        ("flux2", "flux2_tiny", "loha", true),
        ("zimage", "zimage_tiny", "loha", true),
    ];
    for (family, map, kind, per_projection) in cases {
        let map = key_map(map);
        let (weights, adapters, keys) = tiny_with(family, kind, per_projection);
        let d = temp(&format!("{family}-{kind}-peft"));
        let file = d.join("peft.safetensors");
        adapters
            .save_peft(&file, &keys, "transformer", DType::F32)
            .unwrap();
        let groups = group(&file, &map, false);
        // Each adapted layer's rows, as the parts ComfyUI patches them.
        let mut covered: HashMap<String, usize> = HashMap::new();
        for (key, tensors) in &groups {
            let (target, slice) = &map[key];
            let path = target.trim_end_matches(".weight");
            for name in tensors.keys() {
                // PEFT's LoRA names are ComfyUI's (".lora_B.weight" and ".lora_A.weight").
                assert!(
                    suffixes.contains(&format!(".{name}"))
                        || ["lora_A.weight", "lora_B.weight"].contains(&name.as_str()),
                    "{family} {kind}: ComfyUI does not read {key}.{name}"
                );
            }
            let w = &weights[target];
            let (rows, cols, wv) = mat(w);
            let part = match tensors.get("lora_B.weight") {
                Some(b) => b.dims()[0],
                None => out_rows(tensors),
            };
            let start = rows_of(*slice, part);
            let mut comfy = comfy_delta(tensors, &wv[start * cols..(start + part) * cols], part);
            if *slice == Place::Swapped {
                let half = comfy.len() / 2;
                comfy.rotate_left(half);
            }
            let flame = mat(&flame_delta(&adapters, path, w)).2;
            let e = rel_diff(&comfy, &flame[start * cols..(start + part) * cols]);
            assert!(
                e < 1e-5,
                "{family} {kind} {key}: ComfyUI's change off by {e}"
            );
            *covered.entry(path.to_string()).or_default() += part;
            assert!(covered[path] <= rows);
        }
        for layer in adapters.layers().unwrap() {
            let rows = layer.shape().out_dim();
            assert_eq!(
                covered.get(layer.path()).copied(),
                Some(rows),
                "{family} {kind}: {} not whole in the PEFT file",
                layer.path()
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// A full-size model of `M` at `config`, built without weights, with rank-1 LoRAs on every
/// Linear and convolution of its blocks: the adapters and the diffusers key map.
fn full_size<M: ModelSpec>(
    config: &M::Config,
    targets: &[&str],
) -> (Arc<Adapters>, flame::nn::KeyMap) {
    let mut c = AdapterConfig::from(LoraConfig {
        rank: 1,
        alpha: 1.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed: 5,
    });
    c.conv_rank = 1;
    let adapters = Adapters::new(c).unwrap();
    let vb = flame::nn::VarBuilder::shapes_only(DType::BF16, &CPU)
        .with_adapters(adapters.clone())
        .unwrap();
    M::build(&vb, config).unwrap();
    (adapters, M::diffusers_map(config))
}

/// The released models' layers (FLUX.1-dev, SD3.5-large, SDXL base at their published
/// configurations): the key FLAME's kohya file gives each adapted layer is one ComfyUI maps
/// to that layer's weight, in the maps its code builds for the full-size models; and for
/// Flux-dev and SD3.5-large each key of the PEFT layout is one it maps too, every row of each
/// layer covered once.
#[test]
fn the_released_models_keys_are_ones_comfyui_maps() {
    use flame::models::flux::{Flux, FluxConfig};
    use flame::models::sd3::{Sd3, Sd3Config};
    use flame::models::sdxl::{SdxlConfig, Unet};
    let flux = full_size::<Flux>(&FluxConfig::dev(), &["double_blocks.*", "single_blocks.*"]);
    let sd3 = full_size::<Sd3>(&Sd3Config::large(), &["joint_blocks.*"]);
    let sdxl = full_size::<Unet>(
        &SdxlConfig::base(),
        &["input_blocks.*", "middle_block.*", "output_blocks.*"],
    );
    for (name, (adapters, keys), peft) in [
        ("flux_dev", &flux, true),
        ("sd35_large", &sd3, true),
        ("sdxl_base", &sdxl, false),
    ] {
        let map = key_map(name);
        let layers = adapters.layers().unwrap();
        assert!(layers.len() > 100, "{name}: {} layers", layers.len());
        for l in &layers {
            let key = kohya_name(l.path());
            assert_eq!(
                map.get(&key),
                Some(&(format!("{}.weight", l.path()), Place::Whole)),
                "{name}: {key}"
            );
        }
        if !peft {
            continue;
        }
        let d = temp(&format!("{name}-full-peft"));
        let file = d.join("peft.safetensors");
        adapters
            .save_peft(&file, keys, "transformer", DType::BF16)
            .unwrap();
        let f = flame::safetensors::SafeTensorsFile::open(&file).unwrap();
        let mut rows: HashMap<String, usize> = HashMap::new();
        for t in f.names().filter(|t| t.ends_with(".lora_B.weight")) {
            let module = t.trim_end_matches(".lora_B.weight");
            let (target, _) = map
                .get(module)
                .unwrap_or_else(|| panic!("{name}: ComfyUI maps no {module}"));
            *rows.entry(target.clone()).or_default() += f.info(t).unwrap().shape[0];
        }
        for l in &layers {
            let w = format!("{}.weight", l.path());
            assert_eq!(
                rows.get(&w).copied(),
                Some(l.shape().out_dim()),
                "{name}: {w}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// The files of ai-toolkit's and musubi-tuner's layouts FLAME writes for FLUX.2 [klein] and
/// Z-Image (`adapter.format = "ai-toolkit"` / `"musubi"`, LoRA on every Linear of the blocks),
/// read through the key maps a recent ComfyUI builds for them: every key of ai-toolkit's
/// (`diffusion_model.` and BFL's or diffusers' modules) and of musubi-tuner's FLUX.2 file (the
/// kohya layout) is one ComfyUI maps, a Z-Image q, k or v to its rows of the fused qkv, each
/// tensor one it reads, and the change it computes the adapter's. musubi-tuner's Z-Image
/// names (`lora_unet_` and diffusers' attention modules, `..._attention_to_q`,
/// `..._attention_to_out_0`) are not in ComfyUI's map: exactly those keys are left over, the
/// attention's four Linears of each block (musubi-tuner ships
/// `networks/convert_z_image_lora_to_comfy.py` for them); its feed-forward keys map. The
/// same holds for every key of the files the tools write (tests/fixtures/tool_loras).
#[test]
fn the_tools_layouts_in_comfyui() {
    use flame::nn::adapter::Tool;
    let suffixes = comfy_suffixes();
    for (family, map_name, tool) in [
        ("flux2", "flux2_tiny", Tool::AiToolkit),
        ("flux2", "flux2_tiny", Tool::Musubi),
        ("zimage", "zimage_tiny", Tool::AiToolkit),
        ("zimage", "zimage_tiny", Tool::Musubi),
    ] {
        let what = format!("{family} {}", tool.name());
        let map = key_map(map_name);
        let (weights, adapters, keys) = tiny(family, "lora");
        let names = models::family(family).unwrap().tool_names.of(tool).unwrap();
        let d = temp(&format!("{family}-{}", tool.name()));
        let file = d.join("tool.safetensors");
        adapters
            .save_tool(tool, names, &keys, &file, DType::F32, None)
            .unwrap();
        let kohya = tool == Tool::Musubi;
        let groups = group(&file, &map, kohya);
        let mut covered: HashMap<String, usize> = HashMap::new();
        let mut unmapped: BTreeSet<String> = BTreeSet::new();
        for (key, tensors) in &groups {
            let Some((target, place)) = map.get(key) else {
                unmapped.insert(key.clone());
                continue;
            };
            let path = target.trim_end_matches(".weight");
            for name in tensors.keys() {
                assert!(
                    suffixes.contains(&format!(".{name}"))
                        || ["lora_A.weight", "lora_B.weight"].contains(&name.as_str()),
                    "{what}: ComfyUI does not read {key}.{name}"
                );
            }
            let w = &weights[target];
            let (rows, cols, wv) = mat(w);
            let part = match tensors.get("lora_B.weight") {
                Some(b) => b.dims()[0],
                None => out_rows(tensors),
            };
            let start = rows_of(*place, part);
            assert!(start + part <= rows, "{what} {key}");
            let comfy = comfy_delta(tensors, &wv[start * cols..(start + part) * cols], part);
            let flame = mat(&flame_delta(&adapters, path, w)).2;
            let e = rel_diff(&comfy, &flame[start * cols..(start + part) * cols]);
            assert!(e < 1e-5, "{what} {key}: ComfyUI's change off by {e}");
            *covered.entry(path.to_string()).or_default() += part;
        }
        let attention = |l: &str| l.contains(".attention.");
        for layer in adapters.layers().unwrap() {
            let left = family == "zimage" && kohya && attention(layer.path());
            let want = (!left).then_some(layer.shape().out_dim());
            assert_eq!(
                covered.get(layer.path()).copied(),
                want,
                "{what}: {} as ComfyUI reads it",
                layer.path()
            );
        }
        if family == "zimage" && kohya {
            let expected: BTreeSet<String> = adapters
                .layers()
                .unwrap()
                .iter()
                .filter(|l| attention(l.path()))
                .flat_map(|l| {
                    let block = l.path().trim_end_matches(".attention.qkv");
                    let block = block.trim_end_matches(".attention.out");
                    let tail: &[&str] = match l.path().ends_with(".qkv") {
                        true => &["to_q", "to_k", "to_v"],
                        false => &["to_out_0"],
                    };
                    tail.iter()
                        .map(|t| kohya_name(&format!("{block}.attention.{t}")))
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(unmapped, expected, "{what}: keys ComfyUI does not map");
            println!(
                "{what}: ComfyUI maps {} keys, not the {} attention keys",
                groups.len() - unmapped.len(),
                unmapped.len()
            );
        } else {
            assert!(
                unmapped.is_empty(),
                "{what}: ComfyUI maps none of {unmapped:?}"
            );
            println!("{what}: ComfyUI maps all {} keys", groups.len());
        }
        // The files the tools write (scripts/make_tool_lora_fixtures.py, their default
        // targets): the same keys map, or are left over.
        let fixture = fixtures().join(format!(
            "tool_loras/{family}_{}.safetensors",
            tool.name().replace('-', "_")
        ));
        let f = flame::safetensors::SafeTensorsFile::open(&fixture).unwrap();
        let mut seen = 0;
        for t in f.names() {
            let key = match kohya {
                true => t.split_once('.').unwrap().0,
                false => t
                    .trim_end_matches(".lora_A.weight")
                    .trim_end_matches(".lora_B.weight"),
            };
            let left = family == "zimage" && kohya && key.contains("_attention_");
            assert_eq!(
                map.contains_key(key),
                !left,
                "{what}: {t} of the tool's file in ComfyUI's map"
            );
            seen += 1;
        }
        assert!(seen > 0, "{what}: {}", fixture.display());
        let _ = std::fs::remove_dir_all(&d);
    }
}
