//! Text encoders and tokenizers against transformers. Fixtures (tests/fixtures/encoders) are
//! made by scripts/make_encoder_fixtures.py with transformers 5.24.0: tiny tokenizers learned
//! there (a CLIP-style BPE, a T5-style sentencepiece unigram) with transformers' ids for each
//! caption in tokens.json, and tiny random CLIP-L-like, bigG-like and T5 v1.1-like encoders
//! whose outputs transformers computed in f64 (stored in f32) in outputs.safetensors.
//!
//! Tolerance: max |flame - transformers| / max |transformers| per tensor, 1e-4 in f32 on the
//! CPU (the required bound). Token ids must be equal.
#![cfg(feature = "cpu-ref")]

mod common;

use flame::encoders::{
    relative_bucket, ClipConfig, ClipTextModel, ClipTokenizer, T5Config, T5Encoder, T5Tokenizer,
    Tokens, SD3_T5, SDXL_CLIP_G, SDXL_CLIP_L,
};
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

const CPU: Device = Device::Cpu;
const F32_TOL: f64 = 1e-4;
/// bf16 weights and activations against the f64 reference (8-bit mantissas: 2^-8 = 3.9e-3
/// per rounding). transformers itself in bf16 on these fixtures (torch 2.15, CPU): T5
/// 3.7e-2, clip_g 6.8e-3 (hidden) / 6.7e-3 (projected); FLAME measured 5.5e-2, 6.3e-3 and
/// 8.1e-3.
const BF16_TOL: f64 = 0.1;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/encoders")
        .join(name)
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture("outputs.safetensors"), &CPU).unwrap()
}

use common::check_rel as check;

/// The reference captions of one tokenizer in tokens.json: (max_len, [(text, ids, mask)]).
type Captions = (usize, Vec<(String, Vec<u32>, Vec<u32>)>);

fn reference(name: &str) -> Captions {
    let text = std::fs::read_to_string(fixture("tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = &v[name];
    let ints = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    let caps = t["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["text"].as_str().unwrap().to_string(),
                ints(&c["ids"]),
                ints(&c["mask"]),
            )
        })
        .collect();
    (t["max_len"].as_u64().unwrap() as usize, caps)
}

fn check_captions(name: &str, encode: impl Fn(&str) -> Tokens) -> Captions {
    let (len, caps) = reference(name);
    assert!(caps.len() >= 10, "{name}: the fixture's captions");
    for (text, ids, mask) in &caps {
        let got = encode(text);
        assert_eq!(&got.ids, ids, "{name}: ids of {text:?}");
        assert_eq!(&got.mask, mask, "{name}: mask of {text:?}");
        assert_eq!(ids.len(), len);
    }
    (len, caps)
}

/// The three CLIP tokenizer folders (vocab.json + merges.txt with CLIP-L's and with SDXL
/// tokenizer_2's configs; tokenizer.json) give transformers' ids on every caption: empty,
/// case and whitespace, accents, CJK, emoji, punctuation and "(cat:1.2)", contractions,
/// full-width, and one truncated to 77 with EOS last.
#[test]
fn clip_tokenizers_match_transformers() {
    for (name, pad) in [
        ("clip_tokenizer", None),
        ("clip_tokenizer_2", Some(0)),
        ("clip_tokenizer_json", None),
    ] {
        let tok = ClipTokenizer::from_dir(fixture(name), 77, None).unwrap();
        // CLIP-L pads with <|endoftext|>, SDXL's tokenizer_2 with "!" (id 0).
        assert_eq!(tok.pad_id(), pad.unwrap_or(tok.eos_id()), "{name}: pad id");
        let (_, caps) = check_captions(name, |t| tok.encode(t).unwrap());
        let (_, ids, mask) = caps.iter().find(|c| c.2.iter().all(|&m| m == 1)).unwrap();
        assert_eq!(ids[76], tok.eos_id(), "{name}: truncation keeps EOS last");
        assert_eq!(mask.len(), 77);
    }
    // An explicit pad id overrides the folder's.
    let tok = ClipTokenizer::from_dir(fixture("clip_tokenizer"), 77, Some(0)).unwrap();
    let t = tok.encode("a cat").unwrap();
    assert_eq!((t.ids[5], t.ids[76], t.mask[5]), (0, 0, 0));
}

/// T5's unigram tokenizer.json gives transformers' ids at 16 (truncating) and 256 tokens.
#[test]
fn t5_tokenizer_matches_transformers() {
    for n in [16, 256] {
        let name = format!("t5_tokenizer_{n}");
        let tok = T5Tokenizer::from_file(fixture("t5_tokenizer"), n).unwrap();
        check_captions(&name, |t| tok.encode(t).unwrap());
    }
    let tok = T5Tokenizer::from_file(fixture("t5_tokenizer/tokenizer.json"), 4).unwrap();
    let t = tok.encode("").unwrap();
    assert_eq!((&t.ids, &t.mask), (&vec![1, 0, 0, 0], &vec![1, 0, 0, 0]));
    let (ids, mask) = Tokens::batch(&[tok.encode("a cat").unwrap(), t.clone()], &CPU).unwrap();
    assert_eq!(
        (ids.dims(), mask.dims(), ids.dtype()),
        (&[2, 4][..], &[2, 4][..], DType::U32)
    );
}

/// Missing tokenizer files are errors naming the path and what to give instead.
#[test]
fn tokenizer_errors_name_the_files() {
    let err = |e: Error| match e {
        Error::Tokenizer { path, msg } => format!("{}: {msg}", path.display()),
        other => panic!("expected a tokenizer error, got {other}"),
    };
    let e = err(ClipTokenizer::from_dir(fixture("clip_l"), 77, None).unwrap_err());
    assert!(
        e.contains("clip_l") && e.contains("vocab.json + merges.txt"),
        "{e}"
    );
    let e = err(ClipTokenizer::from_dir(fixture("sdxl_te.safetensors"), 77, None).unwrap_err());
    assert!(
        e.contains("single-file checkpoints hold no vocabulary"),
        "{e}"
    );
    let e = err(T5Tokenizer::from_file(fixture("clip_l"), 256).unwrap_err());
    assert!(e.contains("clip_l") && e.contains("tokenizer.json"), "{e}");
    // A CLIP vocabulary is not T5's: no </s>.
    let e = err(T5Tokenizer::from_file(fixture("clip_tokenizer_json"), 256).unwrap_err());
    assert!(e.contains("</s>"), "{e}");
}

/// A config that does not fit the weights is an error naming the key, both shapes and the
/// file; so is a missing key.
#[test]
fn misfit_weights_name_key_shapes_and_file() {
    let text = std::fs::read_to_string(fixture("clip_l/config.json")).unwrap();
    let mut cfg = ClipConfig::from_json(&serde_json::from_str(&text).unwrap(), None).unwrap();
    cfg.intermediate_size = 40;
    let e = ClipTextModel::load(fixture("clip_l"), None, DType::F32, &CPU, Some(cfg.clone()))
        .unwrap_err()
        .to_string();
    for part in [
        "layers.0.mlp.fc1.weight",
        "[40, 24]",
        "[48, 24]",
        "clip_l/model.safetensors",
    ] {
        assert!(e.contains(part), "{part} not in: {e}");
    }
    cfg.intermediate_size = 48;
    cfg.num_hidden_layers = 3;
    let e = ClipTextModel::load(fixture("clip_l"), None, DType::F32, &CPU, Some(cfg))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.2.layer_norm1.weight") && e.contains("missing"),
        "{e}"
    );
}

/// Runs a CLIP model on the fixture's ids for `name` and checks every output it has.
fn clip_parity(name: &str, model: &ClipTextModel) -> f64 {
    let io = outputs();
    let ids = &io[&format!("{name}.ids")];
    let out = model.forward(ids, None).unwrap();
    let mut worst = 0f64;
    let mut c = |what: &str, got: &Tensor| {
        worst = worst.max(check(
            &format!("{name} {what}"),
            got,
            &io[&format!("{name}.{what}")],
            F32_TOL,
        ));
    };
    c("last_hidden", &out.last_hidden);
    c("penultimate", &out.penultimate);
    c("pooled", &out.pooled);
    match (&out.projected, io.get(&format!("{name}.projected"))) {
        (Some(p), Some(_)) => c("projected", p),
        (None, None) => {}
        (p, w) => panic!(
            "{name}: projection {} vs reference {}",
            p.is_some(),
            w.is_some()
        ),
    }
    if let Some(mask) = io.get(&format!("{name}.mask")).filter(|_| name == "clip_l") {
        let masked = model.forward(ids, Some(mask)).unwrap();
        c("last_hidden_masked", &masked.last_hidden);
    }
    worst
}

/// CLIP-L-like (quick GELU, legacy EOS rule: pooled at the largest id, padded with EOS) and
/// bigG-like (GELU, pooled at the first EOS, padded with 0, projected) from transformers
/// folders with config.json.
#[test]
fn clip_matches_transformers() {
    let (l, _) = ClipTextModel::load(fixture("clip_l"), None, DType::F32, &CPU, None).unwrap();
    assert_eq!(l.config.eos_token_id, 2);
    clip_parity("clip_l", &l);
    let (g, vb) = ClipTextModel::load(fixture("clip_g"), None, DType::F32, &CPU, None).unwrap();
    assert_ne!(g.config.eos_token_id, 2);
    clip_parity("clip_g", &g);
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
}

/// SDXL's single file: CLIP-L in the transformers layout and bigG in OpenCLIP's (fused
/// in_proj, text_projection stored transposed), each picked by its prefix, give the same
/// outputs as the transformers folders.
#[test]
fn clip_sdxl_single_file_both_layouts() {
    let file = fixture("sdxl_te.safetensors");
    let cfg = |n: &str| {
        let text = std::fs::read_to_string(fixture(n).join("config.json")).unwrap();
        ClipConfig::from_json(&serde_json::from_str(&text).unwrap(), None).unwrap()
    };
    // Two encoders in the file: the prefix must be given, and the error lists both.
    let e = ClipTextModel::load(&file, None, DType::F32, &CPU, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains(SDXL_CLIP_L) && e.contains(SDXL_CLIP_G), "{e}");
    // Width 24 is not a multiple of the head width 64: no config can be inferred.
    let e = ClipTextModel::load(&file, Some(SDXL_CLIP_G), DType::F32, &CPU, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("give a config"), "{e}");
    let (l, vb) = ClipTextModel::load(
        &file,
        Some(SDXL_CLIP_L),
        DType::F32,
        &CPU,
        Some(cfg("clip_l")),
    )
    .unwrap();
    clip_parity("clip_l", &l);
    let (g, vb_g) = ClipTextModel::load(
        &file,
        Some(SDXL_CLIP_G),
        DType::F32,
        &CPU,
        Some(cfg("clip_g")),
    )
    .unwrap();
    clip_parity("clip_g", &g);
    // Each model reads every key under its prefix and none of the other's.
    for (vb, p) in [(&vb, SDXL_CLIP_L), (&vb_g, SDXL_CLIP_G)] {
        let unused = vb.unused_keys().unwrap();
        assert!(
            unused.iter().all(|k| !k.starts_with(p)),
            "{p}: unused {unused:?}"
        );
        assert!(
            unused.iter().any(|k| !k.starts_with(p)),
            "{p}: read the other's keys"
        );
    }
}

/// T5 v1.1-like encoder (gated GELU, relative buckets over 140 tokens so distances past
/// 128 share the last bucket; no score scaling), from the folder and from a single file
/// under SD3.5's prefix with the config inferred from shapes; with and without a mask.
#[test]
fn t5_matches_transformers() {
    let io = outputs();
    let (ids, mask) = (&io["t5.ids"], &io["t5.mask"]);
    let (folder, vb) = T5Encoder::load(fixture("t5"), None, DType::F32, &CPU, None).unwrap();
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    check(
        "t5 last_hidden",
        &folder.forward(ids, None).unwrap(),
        &io["t5.last_hidden"],
        F32_TOL,
    );
    check(
        "t5 last_hidden_masked",
        &folder.forward(ids, Some(mask)).unwrap(),
        &io["t5.last_hidden_masked"],
        F32_TOL,
    );
    let file = fixture("sd3_te.safetensors");
    let (single, _) = T5Encoder::load(&file, Some(SD3_T5), DType::F32, &CPU, None).unwrap();
    assert_eq!(single.config, folder.config, "config inferred from shapes");
    // The only T5 in the file is found without its prefix; a wrong prefix lists it.
    assert!(T5Encoder::load(&file, None, DType::F32, &CPU, None).is_ok());
    let e = T5Encoder::load(&file, Some("nope."), DType::F32, &CPU, None).unwrap_err();
    assert!(e.to_string().contains(SD3_T5), "{e}");
    check(
        "t5 single file",
        &single.forward(ids, None).unwrap(),
        &io["t5.last_hidden"],
        F32_TOL,
    );
    let xxl = T5Config::xxl();
    assert_eq!((xxl.d_model, xxl.num_heads * xxl.d_kv), (4096, 4096));
}

/// T5 with its blocks streamed from host memory gives the resident encoder's outputs bit for
/// bit (with and without a padding mask), whatever the prefetch depth.
#[test]
fn t5_streamed_equals_resident() {
    let io = outputs();
    let (ids, mask) = (&io["t5.ids"], &io["t5.mask"]);
    let (resident, _) = T5Encoder::load(fixture("t5"), None, DType::F32, &CPU, None).unwrap();
    for prefetch in [1, 2, 5] {
        let (streamed, _) =
            T5Encoder::load_streamed(fixture("t5"), None, DType::F32, &CPU, None, prefetch)
                .unwrap();
        for m in [None, Some(mask)] {
            let a = resident.forward(ids, m).unwrap().to_vec::<f32>().unwrap();
            let b = streamed.forward(ids, m).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(a, b, "prefetch {prefetch}, mask {}", m.is_some());
        }
    }
}

/// T5's relative position buckets equal transformers' for every distance in [-300, 300]
/// (bidirectional, 32 buckets, max distance 128).
#[test]
fn t5_buckets_match_transformers() {
    let want = outputs()["t5.buckets"].to_vec::<u32>().unwrap();
    let got: Vec<u32> = (-300..=300)
        .map(|r| relative_bucket(r, 32, 128) as u32)
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        (got[300], got[301], got[299], got[0], got[600]),
        (0, 17, 1, 15, 31)
    );
}

/// T5 overflows f16: loading in f16 is refused (f16 files load into bf16 or f32). bf16
/// weights and activations stay within [`BF16_TOL`] of the f64 reference.
#[test]
fn t5_refuses_f16_and_runs_in_bf16() {
    let e = T5Encoder::load(fixture("t5"), None, DType::F16, &CPU, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedDType {
                dtype: DType::F16,
                ..
            }
        ),
        "{e}"
    );
    let io = outputs();
    let (t5, _) = T5Encoder::load(fixture("t5"), None, DType::BF16, &CPU, None).unwrap();
    let h = t5.forward(&io["t5.ids"], None).unwrap();
    assert_eq!(h.dtype(), DType::BF16);
    check("t5 bf16 last_hidden", &h, &io["t5.last_hidden"], BF16_TOL);
    let (g, _) = ClipTextModel::load(fixture("clip_g"), None, DType::BF16, &CPU, None).unwrap();
    let out = g.forward(&io["clip_g.ids"], None).unwrap();
    check(
        "clip_g bf16 last_hidden",
        &out.last_hidden,
        &io["clip_g.last_hidden"],
        BF16_TOL,
    );
    let p = out.projected.unwrap();
    check(
        "clip_g bf16 projected",
        &p,
        &io["clip_g.projected"],
        BF16_TOL,
    );
}

/// The same parity on the GPU in f32 (composite attention at head width 12).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn encoders_match_transformers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    let io = outputs();
    let (g, _) = ClipTextModel::load(fixture("clip_g"), None, DType::F32, &dev, None).unwrap();
    let out = g
        .forward(&io["clip_g.ids"].to_device(&dev).unwrap(), None)
        .unwrap();
    check(
        "cuda clip_g last_hidden",
        &out.last_hidden,
        &io["clip_g.last_hidden"],
        F32_TOL,
    );
    check(
        "cuda clip_g projected",
        out.projected.as_ref().unwrap(),
        &io["clip_g.projected"],
        F32_TOL,
    );
    let (t5, _) = T5Encoder::load(fixture("t5"), None, DType::F32, &dev, None).unwrap();
    let ids = io["t5.ids"].to_device(&dev).unwrap();
    let h = t5.forward(&ids, None).unwrap();
    check("cuda t5 last_hidden", &h, &io["t5.last_hidden"], F32_TOL);
    // Streamed from page-locked host memory on the copy stream: the same bits.
    let (streamed, _) =
        T5Encoder::load_streamed(fixture("t5"), None, DType::F32, &dev, None, 2).unwrap();
    let hs = streamed.forward(&ids, None).unwrap();
    assert_eq!(
        h.to_vec::<f32>().unwrap(),
        hs.to_vec::<f32>().unwrap(),
        "cuda t5 streamed"
    );
}
