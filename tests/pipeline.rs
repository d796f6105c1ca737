//! Captions to a family's text inputs ([`TextConditioner`]) against diffusers' own
//! pipelines. Fixtures (tests/fixtures/pipeline) are made by
//! scripts/make_pipeline_fixtures.py with diffusers 0.42.1 / transformers 5.24.0: tiny
//! random CLIP-L, CLIP-L with projection, bigG and T5 encoders reading the tiny tokenizers of
//! tests/fixtures/encoders, and what `FluxPipeline.encode_prompt`,
//! `StableDiffusion3Pipeline.encode_prompt` and `StableDiffusionXLPipeline.encode_prompt`
//! (no guidance) return for them in f64 (stored in f32), per case in cases.json.
//!
//! Tolerance: max |flame - diffusers| / max |diffusers| per output, table [`tol`].
#![cfg(feature = "cpu-ref")]

mod common;

use common::check_rel;
use flame::models::{family, Sources, TextConditioner, TextEncoderKind, TextOptions};
use flame::train::images::{caption_batch, MAX_CAPTION_BATCH};
use flame::{DType, Device, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;

/// The bound per dtype the encoders run in, against the f64 reference: the one tolerance
/// table's (`Against::Network`). Measured: f32 on the CPU 9.9e-6 (context, T5 at 512 tokens)
/// and 2.5e-7 (pooled), on an H100 9.6e-6 and 1.8e-7; bf16 on an H100 5.2e-2 (context, T5 at
/// 32 tokens) and 6.8e-3 (pooled).
fn tol(dt: DType) -> f64 {
    common::tolerance::tolerance(common::tolerance::Against::Network, dt).1
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture(name: &str) -> PathBuf {
    root().join("pipeline").join(name)
}

/// One case of cases.json: what FLAME is given and what diffusers returned.
struct Case {
    name: String,
    family: String,
    encoders: Vec<PathBuf>,
    tokenizers: Vec<PathBuf>,
    guided: bool,
    t5_tokens: usize,
    captions: Vec<String>,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture("cases.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let strs = |x: &serde_json::Value| -> Vec<String> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    v["cases"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| Case {
            name: name.clone(),
            family: c["family"].as_str().unwrap().to_string(),
            encoders: strs(&c["flame_encoders"])
                .iter()
                .map(|e| fixture(e))
                .collect(),
            tokenizers: strs(&c["tokenizers"])
                .iter()
                .map(|t| root().join("encoders").join(t))
                .collect(),
            guided: c["guided"].as_bool().unwrap(),
            t5_tokens: c["t5_tokens"].as_u64().unwrap() as usize,
            captions: strs(&c["captions"]),
        })
        .collect()
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture("outputs.safetensors"), &CPU).unwrap()
}

fn conditioner(case: &Case, dtype: DType, device: &Device) -> TextConditioner {
    let fam = family(&case.family).unwrap();
    let (located, _vae) = Sources {
        text: case.encoders.clone(),
        tokenizers: case.tokenizers.clone(),
        vae: Some(fixture("clip_l")),
    }
    .locate(
        fam,
        &fixture(""),
        ["encoders.text", "encoders.tokenizers", "encoders.vae"],
    )
    .unwrap();
    let opts = TextOptions {
        guided: case.guided,
        t5_tokens: case.t5_tokens,
        stream_t5: false,
        stream_qwen3: false,
        fp8_qwen3: false,
    };
    TextConditioner::load(fam, &located, &opts, dtype, device, "encoders").unwrap()
}

/// Every case's `context` and `pooled` against diffusers in `dtype` on `device`; the largest
/// error per output name.
fn parity(dtype: DType, device: &Device) -> BTreeMap<&'static str, f64> {
    let io = outputs();
    let mut worst = BTreeMap::new();
    let cases = cases();
    assert_eq!(cases.len(), 7, "cases.json");
    for case in &cases {
        let cond = conditioner(case, dtype, device);
        let caps: Vec<&str> = case.captions.iter().map(String::as_str).collect();
        let got = cond.encode(&caps).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["context", "pooled"], "{}: outputs", case.name);
        for (name, key) in [("context", "context"), ("pooled", "pooled")] {
            let t = &got.iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(t.dtype(), DType::F32, "{}.{name}", case.name);
            let want = &io[&format!("{}.{key}", case.name)];
            let what = format!("{} {dtype:?} {}.{name}", device_name(device), case.name);
            let e = check_rel(&what, &t.to_device(&CPU).unwrap(), want, tol(dtype));
            let w = worst.entry(name).or_insert(0f64);
            *w = w.max(e);
        }
    }
    worst
}

/// A caption encoded in a batch gives what it gives alone (the captions' caches fill in
/// batches: CLIP and T5 take every caption at their fixed length, so a row sees only its
/// own tokens), and a batch's room per caption counts the largest layer's work and the
/// outputs.
#[test]
fn captions_encode_alike_alone_and_in_batches() {
    for case in cases() {
        let cond = conditioner(&case, DType::F32, &CPU);
        let caps: Vec<&str> = case.captions.iter().map(String::as_str).collect();
        let batch = cond.encode(&caps).unwrap();
        for (i, c) in caps.iter().enumerate() {
            let alone = cond.encode(&[c]).unwrap();
            for ((n, b), (m, a)) in batch.iter().zip(&alone) {
                assert_eq!(n, m);
                let row = b.narrow(0, i, 1).unwrap();
                let what = format!("{} caption {i} {n}", case.name);
                check_rel(&what, &row, a, 1e-5);
            }
        }
        // The room a caption takes: the largest layer's work at each slot's length, plus the
        // outputs; T5 asked for f16 runs in f32.
        let fam = family(&case.family).unwrap();
        let work = |elem: usize, t5_elem: usize| {
            fam.pipeline
                .text
                .iter()
                .enumerate()
                .map(|(i, slot)| {
                    let tokens = slot.len(case.guided, case.t5_tokens);
                    match slot.kind {
                        TextEncoderKind::T5 => cond.dims(i).unwrap().pass_bytes(tokens, t5_elem),
                        _ => cond.dims(i).unwrap().pass_bytes(tokens, elem),
                    }
                })
                .max()
                .unwrap()
        };
        let bf16 = cond.caption_bytes(DType::BF16).unwrap().unwrap();
        let f16 = cond.caption_bytes(DType::F16).unwrap().unwrap();
        let (w16, w_f16) = (work(2, 2), work(2, 4));
        assert!(
            bf16 > w16 && bf16 < w16 + (1 << 20),
            "{}: {bf16} / {w16}",
            case.name
        );
        assert!(
            f16 > w_f16 && f16 < w_f16 + (1 << 20),
            "{}: {f16} / {w_f16}",
            case.name
        );
        // No cap on the CPU: the most captions a pass.
        assert_eq!(
            caption_batch(&cond, DType::F32, &CPU).unwrap(),
            MAX_CAPTION_BATCH
        );
    }
}

fn device_name(d: &Device) -> &'static str {
    if d.is_cuda() {
        "cuda"
    } else {
        "cpu"
    }
}

/// Flux (dev 512 / schnell 256 / 32 T5 tokens), SD3 (256 / 32, CLIP-L with and without a
/// projection) and SDXL against diffusers, f32 on the CPU.
#[test]
fn conditioning_matches_diffusers() {
    let worst = parity(DType::F32, &CPU);
    println!("worst: {worst:?}");
}

/// The same on the GPU, f32 and bf16 encoders (outputs in f32).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn conditioning_matches_diffusers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    for dt in [DType::F32, DType::BF16] {
        let worst = parity(dt, &dev);
        println!("cuda {dt:?} worst: {worst:?}");
    }
}

fn locate_err(fam: &str, sources: Sources, model: &Path) -> String {
    let e = sources
        .locate(
            family(fam).unwrap(),
            model,
            ["encoders.text", "encoders.tokenizers", "encoders.vae"],
        )
        .unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    e.to_string()
}

#[test]
fn locate_names_the_key_and_the_slots() {
    let enc = |n: &str| fixture(n);
    // A wrong count of encoder paths: the key, the count, the family's slots in order.
    let e = locate_err(
        "sd3",
        Sources {
            text: vec![enc("clip_l_proj"), enc("t5")],
            ..Default::default()
        },
        &fixture(""),
    );
    assert!(e.contains("encoders.text"), "{e}");
    assert!(e.contains("2 paths given"), "{e}");
    assert!(
        e.contains("sd3 takes 3 (clip_l, clip_g, t5), in that order"),
        "{e}"
    );
    // And of tokenizers.
    let tok = root().join("encoders/clip_tokenizer");
    let e = locate_err(
        "flux",
        Sources {
            text: vec![enc("clip_l"), enc("t5")],
            tokenizers: vec![tok.clone(), tok.clone(), tok],
            vae: None,
        },
        &fixture(""),
    );
    assert!(e.contains("encoders.tokenizers"), "{e}");
    assert!(
        e.contains("flux takes 2 (clip_l, t5), in that order"),
        "{e}"
    );
    assert!(!e.contains("encoders.text"), "{e}");

    // A Flux single file holds no text encoders: nothing given names encoders.text and the
    // slots to give.
    let single = enc("t5/model.safetensors");
    let e = locate_err("flux", Sources::default(), &single);
    assert!(e.contains("encoders.text"), "{e}");
    assert!(e.contains("no clip_l text encoder next to"), "{e}");
    assert!(e.contains("(clip_l, t5) in that order"), "{e}");
    // Encoders given, tokenizers not: the built-in tokenizers (feature `vocab`), so the next
    // missing piece is the VAE; without them, encoders.tokenizers with the pipeline's
    // folders and the feature to build with.
    let e = locate_err(
        "flux",
        Sources {
            text: vec![enc("clip_l"), enc("t5")],
            ..Default::default()
        },
        &single,
    );
    if cfg!(feature = "vocab") {
        assert!(e.contains("encoders.vae"), "{e}");
    } else {
        assert!(e.contains("encoders.tokenizers"), "{e}");
        assert!(
            e.contains("tokenizer/ for clip_l, tokenizer_2/ for t5"),
            "{e}"
        );
        assert!(e.contains("`vocab` feature"), "{e}");
    }
    // Tokenizers given, no VAE: encoders.vae.
    let toks = vec![
        root().join("encoders/clip_tokenizer"),
        root().join("encoders/t5_tokenizer"),
    ];
    let e = locate_err(
        "flux",
        Sources {
            text: vec![enc("clip_l"), enc("t5")],
            tokenizers: toks,
            vae: None,
        },
        &single,
    );
    assert!(e.contains("encoders.vae"), "{e}");
}

/// SD3 and SDXL single files may hold the encoders, under the family's prefixes: locate
/// reads the model file under them when it has keys there, and otherwise names
/// `encoders.text` and the slot missing.
#[test]
fn single_files_with_and_without_encoders() {
    let toks = |names: &[&str]| -> Vec<PathBuf> {
        names
            .iter()
            .map(|t| root().join("encoders").join(t))
            .collect()
    };
    let keys = ["encoders.text", "encoders.tokenizers", "encoders.vae"];
    // SDXL's layout with both CLIPs (tests/fixtures/encoders, made for tests/encoders.rs).
    let sdxl = root().join("encoders/sdxl_te.safetensors");
    let fam = family("sdxl").unwrap();
    let (located, vae) = Sources {
        tokenizers: toks(&["clip_tokenizer", "clip_tokenizer_2"]),
        ..Default::default()
    }
    .locate(fam, &sdxl, keys)
    .unwrap();
    for ((w, _), slot) in located.iter().zip(fam.pipeline.text) {
        assert_eq!(w.path, sdxl);
        assert_eq!(w.prefix, slot.single_file_prefix);
    }
    assert_eq!((vae.path, vae.prefix), (sdxl, Some("first_stage_model.")));
    // SD3.5's layout with T5 alone: no CLIP-L.
    let sd3 = root().join("encoders/sd3_te.safetensors");
    let sources = Sources {
        tokenizers: toks(&["clip_tokenizer", "clip_tokenizer_2", "t5_tokenizer"]),
        ..Default::default()
    };
    let e = locate_err("sd3", sources.clone(), &sd3);
    assert!(e.contains("encoders.text"), "{e}");
    assert!(
        e.contains("holds no clip_l text encoder (no keys under 'text_encoders.clip_l."),
        "{e}"
    );
    assert!(e.contains("(clip_l, clip_g, t5) in that order"), "{e}");
    // A model file with no encoder at all (here the t5 fixture): the first slot is named.
    let e = locate_err("sd3", sources, &fixture("t5/model.safetensors"));
    assert!(e.contains("encoders.text"), "{e}");
    assert!(e.contains("holds no clip_l text encoder"), "{e}");
}
