//! The full-size encoder files users download load: each key list in tests/fixtures/keylists
//! (every tensor's key, shape and storage dtype of a released file, built on the meta device at
//! the real configuration by scripts/make_keylists.py from transformers 5.24 / diffusers 0.42.1,
//! the layouts that are not a model's own state dict proven through diffusers' single-file
//! converters) goes through the real loaders' code (`load_from`, which `load` calls once its
//! files are open) on a `VarBuilder::from_shapes`: no weights, seconds on the CPU.
//!
//! For every list: (a) every key FLAME reads is in the list with the shape FLAME asks for (the
//! loader fails otherwise), (b) every key of the list is read or is on [`IGNORED`], and (c) the
//! configuration FLAME infers from the shapes is the real one (`ClipConfig::clip_l`, `bigg`,
//! `T5Config::xxl`, `VaeConfig::for_kind`). The lists of the encoders inside SDXL's and SD3.5's
//! single files are also merged, as the files hold them, to check the prefix constants and the
//! detection among several encoders.
#![cfg(feature = "cpu-ref")]

use flame::encoders::{
    AutoencoderKl, ClipConfig, ClipTextModel, T5Config, T5Encoder, VaeConfig, VaeKind, SD3_CLIP_G,
    SD3_CLIP_L, SD3_T5, SDXL_CLIP_G, SDXL_CLIP_L,
};
use flame::nn::VarBuilder;
use flame::{DType, Device};
use std::path::{Path, PathBuf};

/// Keys of the released files that FLAME does not read, as suffixes after the encoder's prefix.
const IGNORED: &[(&str, &str)] = &[
    // The (1, 77) int64 buffer 0..76 that transformers 4.2x saved with CLIPTextModel (SDXL's
    // single file has it); FLAME indexes the position embedding itself.
    (
        "text_model.embeddings.position_ids",
        "CLIP position index buffer",
    ),
    // OpenCLIP's contrastive temperature (SDXL's single file, bigG): used only to compare image
    // and text embeddings, not by the text tower; diffusers' converter drops it too.
    ("logit_scale", "OpenCLIP contrastive temperature"),
];

/// One tensor of a list: key, shape.
type Entry = (String, Vec<usize>);

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/keylists")
        .join(format!("{name}.json"))
}

/// The list `name`.json: [[key, [shape...], dtype], ...].
fn list(name: &str) -> Vec<Entry> {
    let path = fixture(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/make_keylists.py)", path.display()));
    let rows: Vec<(String, Vec<usize>, String)> =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!rows.is_empty(), "{name}: empty list");
    for (k, _, dtype) in &rows {
        assert!(
            ["F16", "BF16", "F32", "I64"].contains(&dtype.as_str()),
            "{name}: {k} has dtype {dtype}"
        );
    }
    rows.into_iter().map(|(k, s, _)| (k, s)).collect()
}

fn lists(names: &[&str]) -> Vec<Entry> {
    names.iter().flat_map(|n| list(n)).collect()
}

fn shapes(entries: &[Entry]) -> VarBuilder {
    VarBuilder::from_shapes(entries.iter().cloned(), DType::F32, &Device::Cpu)
}

/// (b): the keys of `own` that the load left unread, less the ignored ones, must be none.
fn all_read(vb: &VarBuilder, own: &[Entry], prefix: &str) -> Result<(), String> {
    let unused = vb.unused_keys().map_err(|e| e.to_string())?;
    let left: Vec<&String> = own
        .iter()
        .map(|(k, _)| k)
        .filter(|k| unused.contains(k))
        .filter(|k| {
            let rest = k.strip_prefix(prefix).unwrap_or(k);
            !IGNORED.iter().any(|(s, _)| rest == *s)
        })
        .collect();
    match left.is_empty() {
        true => Ok(()),
        false => Err(format!("{} keys not read: {left:?}", left.len())),
    }
}

/// A CLIP loaded from `all` with `prefix`, checked against `own` (its part of `all`): its
/// inferred config and whether it loaded a text projection.
fn clip(all: &[Entry], own: &[Entry], prefix: Option<&str>) -> Result<(ClipConfig, bool), String> {
    let (model, vb) = ClipTextModel::load_from(shapes(all), Path::new("keylist"), prefix, None)
        .map_err(|e| e.to_string())?;
    let common = common_prefix(own);
    all_read(&vb, own, &common)?;
    let projection = vb
        .params()
        .map_err(|e| e.to_string())?
        .iter()
        .any(|(k, _)| k == "text_projection.weight");
    Ok((model.config, projection))
}

fn t5(all: &[Entry], own: &[Entry], prefix: Option<&str>) -> Result<T5Config, String> {
    let (model, vb) = T5Encoder::load_from(shapes(all), Path::new("keylist"), prefix, None)
        .map_err(|e| e.to_string())?;
    all_read(&vb, own, &common_prefix(own))?;
    Ok(model.config)
}

fn vae(
    all: &[Entry],
    own: &[Entry],
    prefix: Option<&str>,
    kind: Option<VaeKind>,
) -> Result<VaeConfig, String> {
    let (model, vb) =
        AutoencoderKl::load_from(shapes(all), Path::new("keylist"), prefix, kind, None)
            .map_err(|e| e.to_string())?;
    all_read(&vb, own, &common_prefix(own))?;
    Ok(model.config)
}

/// The longest dotted prefix every key of `own` shares that is a single file's encoder prefix
/// (`conditioner.embedders.N.{transformer,model}.`, `text_encoders.X.transformer.`,
/// `first_stage_model.`), or "".
fn common_prefix(own: &[Entry]) -> String {
    [
        SDXL_CLIP_L,
        SDXL_CLIP_G,
        SD3_CLIP_L,
        SD3_CLIP_G,
        SD3_T5,
        "first_stage_model.",
    ]
    .into_iter()
    .find(|p| own.iter().all(|(k, _)| k.starts_with(p)))
    .unwrap_or("")
    .to_string()
}

#[test]
fn clip_files_load() {
    let (l, g) = (ClipConfig::clip_l(), ClipConfig::bigg());
    // (list, the real config, has a text projection)
    for (name, want, projection) in [
        ("clip_l", &l, false),
        ("clip_l_projection", &l, true),
        ("clip_l_bare", &l, false),
        ("clip_g", &g, true),
        ("sdxl_clip_l", &l, false),
        ("sdxl_clip_g_openclip", &g, true),
        ("sd35_clip_l", &l, false),
        ("sd35_clip_g", &g, true),
    ] {
        let own = list(name);
        let (cfg, proj) = clip(&own, &own, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(&cfg, want, "{name}: inferred config");
        assert_eq!(proj, projection, "{name}: text projection");
    }
}

#[test]
fn t5_files_load() {
    for name in ["t5xxl", "sd35_t5xxl"] {
        let own = list(name);
        let cfg = t5(&own, &own, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(cfg, T5Config::xxl(), "{name}: inferred config");
    }
}

#[test]
fn vae_files_load() {
    // Without a kind, 4 latent channels with quant convs are taken as SDXL; 16 need one.
    for (name, kind, want) in [
        ("flux_ae", Some(VaeKind::Flux), VaeKind::Flux),
        ("sdxl_vae", None, VaeKind::Sdxl),
        ("sdxl_vae_ldm", None, VaeKind::Sdxl),
        ("sd35_vae", Some(VaeKind::Sd3), VaeKind::Sd3),
        ("sd35_vae_ldm", Some(VaeKind::Sd3), VaeKind::Sd3),
    ] {
        let own = list(name);
        let cfg = vae(&own, &own, None, kind).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(cfg, VaeConfig::for_kind(want), "{name}: inferred config");
    }
}

/// SDXL's single file holds CLIP-L, bigG (OpenCLIP names) and the VAE (LDM names): each loads
/// by its prefix constant, the VAE is found alone, and two CLIPs without a prefix are refused.
#[test]
fn sdxl_single_file_loads() {
    let all = lists(&["sdxl_clip_l", "sdxl_clip_g_openclip", "sdxl_vae_ldm"]);
    let (cfg, proj) = clip(&all, &list("sdxl_clip_l"), Some(SDXL_CLIP_L)).unwrap();
    assert_eq!((cfg, proj), (ClipConfig::clip_l(), false));
    let (cfg, proj) = clip(&all, &list("sdxl_clip_g_openclip"), Some(SDXL_CLIP_G)).unwrap();
    assert_eq!((cfg, proj), (ClipConfig::bigg(), true));
    let err = clip(&all, &[], None).unwrap_err();
    assert!(err.contains("several"), "{err}");
    let cfg = vae(&all, &list("sdxl_vae_ldm"), None, None).unwrap();
    assert_eq!(cfg, VaeConfig::for_kind(VaeKind::Sdxl));
}

/// SD3.5's single files that include the encoders: CLIP-L, bigG and T5 under
/// `text_encoders.*.transformer.` beside the VAE under `first_stage_model.`.
#[test]
fn sd35_single_file_loads() {
    let names = ["sd35_clip_l", "sd35_clip_g", "sd35_t5xxl", "sd35_vae_ldm"];
    let all = lists(&names);
    let (cfg, proj) = clip(&all, &list("sd35_clip_l"), Some(SD3_CLIP_L)).unwrap();
    assert_eq!((cfg, proj), (ClipConfig::clip_l(), false));
    let (cfg, proj) = clip(&all, &list("sd35_clip_g"), Some(SD3_CLIP_G)).unwrap();
    assert_eq!((cfg, proj), (ClipConfig::bigg(), true));
    assert_eq!(
        t5(&all, &list("sd35_t5xxl"), None).unwrap(),
        T5Config::xxl()
    );
    assert_eq!(
        t5(&all, &list("sd35_t5xxl"), Some(SD3_T5)).unwrap(),
        T5Config::xxl()
    );
    let cfg = vae(&all, &list("sd35_vae_ldm"), None, Some(VaeKind::Sd3)).unwrap();
    assert_eq!(cfg, VaeConfig::for_kind(VaeKind::Sd3));
}

/// The check has teeth: a list with one shape changed, one key gone or one unknown key added
/// fails, naming the key.
#[test]
fn corrupted_lists_fail() {
    for name in ["sdxl_clip_g_openclip", "t5xxl", "sdxl_vae_ldm"] {
        let good = list(name);
        let run = |entries: &[Entry]| -> Result<(), String> {
            match name {
                "sdxl_clip_g_openclip" => clip(entries, entries, None).map(|_| ()),
                "t5xxl" => t5(entries, entries, None).map(|_| ()),
                _ => vae(entries, entries, None, None).map(|_| ()),
            }
        };
        run(&good).unwrap();
        let prefix = common_prefix(&good);
        let i = good
            .iter()
            .rposition(|(k, _)| k[prefix.len()..].contains(".1."))
            .expect("a key of layer 1");
        let key = good[i].0.clone();

        let mut bad = good.clone();
        bad[i].1[0] += 1;
        let err = run(&bad).expect_err("a misshapen key must fail");
        assert!(err.contains(&key), "{name}: {err}");

        let mut bad = good.clone();
        bad.remove(i);
        let err = run(&bad).expect_err("a missing key must fail");
        assert!(
            err.contains(&key) || err.contains("not read"),
            "{name}: {err}"
        );

        let mut bad = good.clone();
        let extra = format!("{key}_extra");
        bad.push((extra.clone(), vec![1]));
        let err = run(&bad).expect_err("an unread key must fail");
        assert!(err.contains(&extra), "{name}: {err}");
    }
}
