//! Qwen3 as the text encoder of FLUX.2 [klein] and Z-Image, against transformers and the
//! diffusers pipelines. Fixtures (tests/fixtures/qwen3) are made by
//! scripts/make_qwen3_fixtures.py with transformers 5.24.0 / diffusers 0.42.1: a tiny Qwen
//! tokenizer learned there with transformers' ids for eight chat-templated captions in
//! tokens.json, and a tiny random Qwen3 (bf16 weights; width 32, 4 query heads over 2
//! key/value heads of width 16, 4 layers) whose hidden states transformers computed in f64
//! (stored in f32), with what `Flux2KleinPipeline.encode_prompt` and
//! `ZImagePipeline.encode_prompt` return for it, in outputs.safetensors.
//!
//! Tolerance: max |flame - reference| / max |reference| per tensor, the one table's
//! `Against::Network` bounds (f32 1e-4, bf16 0.1). Token ids must be equal.
#![cfg(feature = "cpu-ref")]

mod common;

use common::{check_rel, TempFile};
use flame::encoders::{
    chat_prompt, Qwen3Combine, Qwen3Conditioning, Qwen3Config, Qwen3Context, Qwen3Encoder,
    Qwen3Options, Qwen3Tokenizer, Tokens, QWEN3_FLUX2_KLEIN, QWEN3_Z_IMAGE,
};
use flame::nn::VarBuilder;
use flame::{DType, Device, Error, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const CPU: Device = Device::Cpu;
/// The fixture's prompt length (the pipelines' 512, shortened to keep the files small).
const LEN: usize = 48;

fn tol(dt: DType) -> f64 {
    common::tolerance::tolerance(common::tolerance::Against::Network, dt).1
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen3")
        .join(name)
}

fn outputs() -> BTreeMap<String, Tensor> {
    flame::safetensors::load(fixture("outputs.safetensors"), &CPU).unwrap()
}

fn tokens_json() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("tokens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ints(x: &serde_json::Value) -> Vec<u32> {
    x.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

/// The fixture's captions, in order.
fn captions() -> Vec<String> {
    tokens_json()["templates"]["klein"]["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["caption"].as_str().unwrap().to_string())
        .collect()
}

/// FLUX.2 [klein]'s conditioning at the fixture's scale: hidden states 1, 2, 3 of the tiny
/// model's 4 layers stand for 9, 18, 27 of Qwen3-4B's 36; 48 tokens for 512.
const KLEIN_TINY: Qwen3Conditioning = Qwen3Conditioning {
    layers: &[1, 2, 3],
    max_len: LEN,
    ..QWEN3_FLUX2_KLEIN
};
/// Z-Image's at 48 tokens (hidden_states[-2] is the same index at any depth).
const ZIMAGE_TINY: Qwen3Conditioning = Qwen3Conditioning {
    max_len: LEN,
    ..QWEN3_Z_IMAGE
};

fn load(path: &Path, dtype: DType, opts: &Qwen3Options) -> (Qwen3Encoder, VarBuilder) {
    Qwen3Encoder::load(path, dtype, &CPU, opts).unwrap()
}

fn folder() -> Qwen3Encoder {
    load(
        &fixture("text_encoder"),
        DType::F32,
        &Qwen3Options::default(),
    )
    .0
}

/// The chat prompts equal what transformers' `apply_chat_template` renders from Qwen3's
/// template for both pipelines' `enable_thinking`, and the tokenizer gives transformers' ids
/// and masks at 48 and 512 tokens: empty, plain, accents, CJK, emoji, contractions with
/// whitespace runs and newlines, special-token text inside a caption, and a caption cut
/// with the prompt's tail.
#[test]
fn tokenizer_and_chat_prompts_match_transformers() {
    let v = tokens_json();
    let short = Qwen3Tokenizer::from_dir(fixture("tokenizer"), LEN).unwrap();
    let long = Qwen3Tokenizer::from_dir(fixture("tokenizer/tokenizer.json"), 512).unwrap();
    assert_eq!(short.pad_id() as u64, v["pad_id"].as_u64().unwrap());
    assert_eq!(short.token_id("<|endoftext|>"), Some(short.pad_id()));
    for (name, cond) in [("klein", KLEIN_TINY), ("zimage", ZIMAGE_TINY)] {
        let t = &v["templates"][name];
        assert_eq!(t["thinking"].as_bool().unwrap(), cond.thinking, "{name}");
        let caps = t["captions"].as_array().unwrap();
        assert_eq!(caps.len(), 8);
        let mut cut = 0;
        for c in caps {
            let (caption, text) = (c["caption"].as_str().unwrap(), c["text"].as_str().unwrap());
            assert_eq!(cond.prompt(caption), text, "{name}: prompt of {caption:?}");
            let mut lens = vec![(LEN, &short)];
            if name == "klein" {
                lens.push((512, &long));
            }
            for (n, tok) in lens {
                let want = &c[n.to_string()];
                let got = tok.encode(text).unwrap();
                assert_eq!(
                    got.ids,
                    ints(&want["ids"]),
                    "{name} {n}: ids of {caption:?}"
                );
                assert_eq!(
                    got.mask,
                    ints(&want["mask"]),
                    "{name} {n}: mask of {caption:?}"
                );
                cut += usize::from(n == LEN && got.mask.iter().all(|&m| m == 1));
            }
            assert_eq!(
                cond.tokens(&short, caption).unwrap().ids,
                ints(&c["48"]["ids"])
            );
        }
        assert!(cut >= 3, "{name}: captions cut at {LEN} tokens");
    }
    assert_eq!(
        chat_prompt("a cat", false),
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    assert_eq!(
        chat_prompt("a cat", true),
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// Every hidden state (0 the embedding output, 1..3 the layers' outputs, 4 the final-normed
/// output; negative indices from the end) of the folder load within the f32 bound of
/// transformers' with the padding mask, padded rows and full rows alike; and without a mask.
#[test]
fn hidden_states_match_transformers() {
    let io = outputs();
    let (ids, mask) = (&io["ids"], &io["mask"]);
    let enc = folder();
    assert_eq!(enc.depth(), 4);
    let hs = enc
        .hidden_states(ids, Some(mask), &[0, 1, 2, 3, 4])
        .unwrap();
    let ctx = &io["klein.context"]; // hidden_states 1, 2, 3 side by side
    check_rel("hidden 0", &hs[0], &io["hidden.0"], tol(DType::F32));
    for (i, h) in hs.iter().enumerate().take(4).skip(1) {
        let want = ctx.narrow(2, (i - 1) * 32, 32).unwrap();
        check_rel(&format!("hidden {i}"), h, &want, tol(DType::F32));
    }
    check_rel(
        "hidden 4 (normed)",
        &hs[4],
        &io["hidden.4"],
        tol(DType::F32),
    );
    let neg = enc.hidden_states(ids, Some(mask), &[-1, -5]).unwrap();
    assert_eq!(
        neg[0].to_vec::<f32>().unwrap(),
        hs[4].to_vec::<f32>().unwrap()
    );
    assert_eq!(
        neg[1].to_vec::<f32>().unwrap(),
        hs[0].to_vec::<f32>().unwrap()
    );
    let un = enc.hidden_states(ids, None, &[2]).unwrap();
    check_rel(
        "hidden 2 unmasked",
        &un[0],
        &io["unmasked.2"],
        tol(DType::F32),
    );
    // The mask matters on the padded rows only: the full rows are unchanged.
    assert!(common::rel_err(&un[0], &hs[2]) > 1e-3);
    let full_row = un[0].narrow(0, 2, 1).unwrap();
    let masked_row = hs[2].narrow(0, 2, 1).unwrap();
    check_rel("full row, mask or not", &full_row, &masked_row, 1e-6);
    let e = enc
        .hidden_states(ids, Some(mask), &[5])
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden state 5") && e.contains("0..=4"), "{e}");
}

/// The hidden states on the GPU in f32 (masked attention through the composite: head width
/// 16) and in bf16.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn hidden_states_match_transformers_on_cuda() {
    let dev = Device::cuda(0).unwrap();
    let io = outputs();
    let (ids, mask) = (
        io["ids"].to_device(&dev).unwrap(),
        io["mask"].to_device(&dev).unwrap(),
    );
    for dt in [DType::F32, DType::BF16] {
        let (enc, _) =
            Qwen3Encoder::load(fixture("text_encoder"), dt, &dev, &Qwen3Options::default())
                .unwrap();
        let hs = enc.hidden_states(&ids, Some(&mask), &[0, 4]).unwrap();
        check_rel(
            &format!("cuda {dt:?} hidden 0"),
            &hs[0],
            &io["hidden.0"],
            tol(dt),
        );
        check_rel(
            &format!("cuda {dt:?} hidden 4"),
            &hs[1],
            &io["hidden.4"],
            tol(dt),
        );
    }
}

/// FLUX.2 [klein]'s conditioning: the chat prompts without thinking through the tokenizer
/// give the pipeline's ids, and hidden states 1, 2, 3 side by side on features give what
/// `Flux2KleinPipeline.encode_prompt` returns, padding positions included.
#[test]
fn klein_conditioning_matches_the_pipeline() {
    let io = outputs();
    let tok = Qwen3Tokenizer::from_dir(fixture("tokenizer"), LEN).unwrap();
    let caps = captions();
    let tokens: Vec<Tokens> = caps
        .iter()
        .map(|c| KLEIN_TINY.tokens(&tok, c).unwrap())
        .collect();
    let (ids, mask) = Tokens::batch(&tokens, &CPU).unwrap();
    assert_eq!(
        ids.to_vec::<u32>().unwrap(),
        io["ids"].to_vec::<u32>().unwrap()
    );
    assert_eq!(
        mask.to_vec::<u32>().unwrap(),
        io["mask"].to_vec::<u32>().unwrap()
    );
    let enc = load(&fixture("text_encoder"), DType::F32, &KLEIN_TINY.options()).0;
    assert_eq!(enc.depth(), 3, "layer 4 is not needed");
    let out = KLEIN_TINY.encode(&enc, &ids, &mask).unwrap();
    assert_eq!(out.hidden.len(), 3);
    let Qwen3Context::Padded(ctx) = KLEIN_TINY.combine(&out).unwrap() else {
        panic!("[klein] keeps every position")
    };
    assert_eq!(ctx.dims(), &[8, LEN, 96]);
    check_rel("klein context", &ctx, &io["klein.context"], tol(DType::F32));
    assert_eq!(
        (QWEN3_FLUX2_KLEIN.layers, QWEN3_FLUX2_KLEIN.max_len),
        (&[9isize, 18, 27][..], 512)
    );
    assert_eq!(QWEN3_FLUX2_KLEIN.combine, Qwen3Combine::ConcatFeatures);
}

/// Z-Image's conditioning: the chat prompts with thinking (no thinking block) give the
/// pipeline's ids, and hidden_states[-2] at each caption's tokens give what
/// `ZImagePipeline.encode_prompt` returns, caption by caption.
#[test]
fn zimage_conditioning_matches_the_pipeline() {
    let io = outputs();
    let tok = Qwen3Tokenizer::from_dir(fixture("tokenizer"), LEN).unwrap();
    let tokens: Vec<Tokens> = captions()
        .iter()
        .map(|c| ZIMAGE_TINY.tokens(&tok, c).unwrap())
        .collect();
    let (ids, mask) = Tokens::batch(&tokens, &CPU).unwrap();
    assert_eq!(
        ids.to_vec::<u32>().unwrap(),
        io["zimage.ids"].to_vec::<u32>().unwrap()
    );
    assert_eq!(
        mask.to_vec::<u32>().unwrap(),
        io["zimage.mask"].to_vec::<u32>().unwrap()
    );
    let file = fixture("qwen_3_tiny.safetensors");
    let enc = load(&file, DType::F32, &ZIMAGE_TINY.options()).0;
    assert_eq!(
        enc.depth(),
        3,
        "hidden_states[-2] of 4 layers is layer 3's output"
    );
    let out = ZIMAGE_TINY.encode(&enc, &ids, &mask).unwrap();
    let Qwen3Context::PerCaption(rows) = ZIMAGE_TINY.combine(&out).unwrap() else {
        panic!("Z-Image keeps each caption's tokens")
    };
    assert_eq!(rows.len(), 8);
    let mut padded = 0;
    for (n, (row, t)) in rows.iter().zip(&tokens).enumerate() {
        let valid = t.mask.iter().filter(|&&m| m == 1).count();
        padded += usize::from(valid < LEN);
        assert_eq!(row.dims(), &[valid, 32]);
        let want = &io[&format!("zimage.context.{n}")];
        check_rel(&format!("zimage caption {n}"), row, want, tol(DType::F32));
    }
    assert!(padded >= 3, "padded captions in the fixture");
    assert_eq!(
        (
            QWEN3_Z_IMAGE.layers,
            QWEN3_Z_IMAGE.thinking,
            QWEN3_Z_IMAGE.max_len
        ),
        (&[-2isize][..], true, 512)
    );
}

/// ComfyUI's single file ("model." keys, no config: inferred from the shapes), transformers'
/// folder (config.json) and a bare `Qwen3Model` layout with a language-model head beside it
/// give the same config and bit-identical states; every key but the head is read.
#[test]
fn single_file_and_layouts_equal_the_folder() {
    let io = outputs();
    let (ids, mask) = (&io["ids"], &io["mask"]);
    let (folder, vb) = load(
        &fixture("text_encoder"),
        DType::F32,
        &Qwen3Options::default(),
    );
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    let file = fixture("qwen_3_tiny.safetensors");
    let (single, vb) = load(&file, DType::F32, &Qwen3Options::default());
    assert_eq!(single.config, folder.config, "config inferred from shapes");
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    let which = [0, 2, 4];
    let a = folder.hidden_states(ids, Some(mask), &which).unwrap();
    let b = single.hidden_states(ids, Some(mask), &which).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
    }
    // transformers 5 saves a Qwen3Model without "model."; a head beside it is not read.
    let mut bare: HashMap<String, Tensor> = flame::safetensors::load(&file, &CPU)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches("model.").to_string(), v))
        .collect();
    bare.insert("lm_head.weight".into(), bare["embed_tokens.weight"].clone());
    let raw = VarBuilder::from_tensors(bare, DType::F32, &CPU);
    let (enc, vb) = Qwen3Encoder::load_from(raw, &file, &Qwen3Options::default()).unwrap();
    assert_eq!(enc.config, folder.config);
    assert_eq!(
        vb.unused_keys().unwrap(),
        vec!["lm_head.weight".to_string()]
    );
    let c = enc.hidden_states(ids, Some(mask), &which).unwrap();
    for (x, y) in a.iter().zip(&c) {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
    }
}

/// Layers streamed from host memory give the resident encoder's states bit for bit, at
/// every prefetch depth, the whole model or the layers one pipeline needs.
#[test]
fn streamed_equals_resident() {
    let io = outputs();
    let (ids, mask) = (&io["ids"], &io["mask"]);
    let resident = folder();
    let want = resident.hidden_states(ids, Some(mask), &[1, 3, 4]).unwrap();
    for prefetch in [1, 2, 5] {
        let opts = Qwen3Options {
            stream: Some(prefetch),
            ..Qwen3Options::default()
        };
        let (streamed, _) = load(&fixture("text_encoder"), DType::F32, &opts);
        let got = streamed.hidden_states(ids, Some(mask), &[1, 3, 4]).unwrap();
        for (x, y) in want.iter().zip(&got) {
            assert_eq!(
                x.to_vec::<f32>().unwrap(),
                y.to_vec::<f32>().unwrap(),
                "{prefetch}"
            );
        }
    }
    let opts = Qwen3Options {
        stream: Some(2),
        ..ZIMAGE_TINY.options()
    };
    let (partial, _) = load(&fixture("text_encoder"), DType::F32, &opts);
    let got = partial.hidden_states(ids, Some(mask), &[-2]).unwrap();
    assert_eq!(
        got[0].to_vec::<f32>().unwrap(),
        want[1].to_vec::<f32>().unwrap()
    );
}

/// An encoder loaded for some hidden states refuses deeper ones, naming what it holds.
#[test]
fn partial_depth_refuses_deeper_states() {
    let io = outputs();
    let enc = load(&fixture("text_encoder"), DType::F32, &KLEIN_TINY.options()).0;
    let e = enc
        .hidden_states(&io["ids"], Some(&io["mask"]), &[4])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("hidden state 4") && e.contains("3 of its 4 layers"),
        "{e}"
    );
    let opts = Qwen3Options {
        hidden_states: vec![7],
        ..Qwen3Options::default()
    };
    let e = Qwen3Encoder::load(fixture("text_encoder"), DType::F32, &CPU, &opts).unwrap_err();
    assert!(e.to_string().contains("hidden state 7"), "{e}");
}

/// bf16 weights and activations stay within the bf16 bound of the f64 reference; f16 is
/// refused (f16 files load in bf16 or f32); FP8 E4M3 Linear weights (per-row scales, 3
/// mantissa bits) stay within the FP8 bound below.
#[test]
fn bf16_and_fp8_and_f16_refused() {
    let io = outputs();
    let (ids, mask) = (&io["ids"], &io["mask"]);
    let (enc, _) = load(
        &fixture("text_encoder"),
        DType::BF16,
        &Qwen3Options::default(),
    );
    let hs = enc.hidden_states(ids, Some(mask), &[3, 4]).unwrap();
    assert_eq!(hs[0].dtype(), DType::BF16);
    let l3 = io["klein.context"].narrow(2, 64, 32).unwrap();
    check_rel("bf16 hidden 3", &hs[0], &l3, tol(DType::BF16));
    check_rel("bf16 hidden 4", &hs[1], &io["hidden.4"], tol(DType::BF16));
    let e = Qwen3Encoder::load(
        fixture("text_encoder"),
        DType::F16,
        &CPU,
        &Qwen3Options::default(),
    )
    .unwrap_err();
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
    let opts = Qwen3Options {
        fp8: true,
        ..Qwen3Options::default()
    };
    let (fp8, vb) = load(&fixture("qwen_3_tiny.safetensors"), DType::F32, &opts);
    assert!(vb.fp8());
    let hs = fp8.hidden_states(ids, Some(mask), &[3]).unwrap();
    check_rel("fp8 hidden 3", &hs[0], &l3, FP8_TOL);
}

/// FP8 E4M3 weights against the f64 reference on bf16 weights: each weight rounded to 3
/// mantissa bits (2^-4 relative) through 3 layers of random weights; measured 6.1e-2.
const FP8_TOL: f64 = 0.1;

/// Writes `tensors` to a temporary safetensors file.
fn write(tag: &str, tensors: &BTreeMap<String, Tensor>) -> TempFile {
    let f = TempFile::new(tag);
    flame::safetensors::save(tensors.iter().map(|(k, v)| (k.as_str(), v)), f.path()).unwrap();
    f
}

/// A missing key, a wrong shape, a corrupt file, a file without a Qwen3, a config that does
/// not fit and tokenizer files that cannot serve are errors naming the key and the file.
#[test]
fn errors_name_the_key_and_the_file() {
    let file = fixture("qwen_3_tiny.safetensors");
    let tensors = flame::safetensors::load(&file, &CPU).unwrap();
    let opts = Qwen3Options::default();
    let err = |p: &Path| {
        Qwen3Encoder::load(p, DType::F32, &CPU, &opts)
            .unwrap_err()
            .to_string()
    };
    let mut missing = tensors.clone();
    missing.remove("model.layers.2.mlp.up_proj.weight");
    let f = write("missing", &missing);
    let e = err(f.path());
    for part in [
        "model.layers.2.mlp.up_proj.weight",
        "missing",
        &f.path().display().to_string(),
    ] {
        assert!(e.contains(part), "{part} not in: {e}");
    }
    let mut shape = tensors.clone();
    let o = "model.layers.1.self_attn.o_proj.weight";
    shape.insert(o.into(), shape[o].t().unwrap().contiguous().unwrap());
    let f = write("shape", &shape);
    let e = err(f.path());
    for part in [o, "[32, 64]", "[64, 32]", &f.path().display().to_string()] {
        assert!(e.contains(part), "{part} not in: {e}");
    }
    // A shape the config is inferred from names the key too.
    let mut norm = tensors.clone();
    norm.remove("model.layers.0.self_attn.q_proj.weight");
    let f = write("infer", &norm);
    let e = err(f.path());
    assert!(e.contains("model.layers.0.self_attn.q_proj.weight"), "{e}");
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    // A corrupt file: the header's length points past the end.
    let f = TempFile::new("corrupt");
    std::fs::write(f.path(), [0xffu8, 0xff, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    let e = err(f.path());
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    // A file without a Qwen3 (a T5 encoder).
    let t5 = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/encoders/sd3_te.safetensors");
    let e = err(&t5);
    assert!(
        e.contains("holds no Qwen3 text encoder") && e.contains("sd3_te"),
        "{e}"
    );
    // A config that does not fit the weights: one layer too many.
    let mut cfg = folder().config;
    cfg.num_hidden_layers = 5;
    let opts5 = Qwen3Options {
        config: Some(cfg),
        ..Qwen3Options::default()
    };
    let e = Qwen3Encoder::load(&file, DType::F32, &CPU, &opts5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.4.input_layernorm.weight") && e.contains("qwen_3_tiny"),
        "{e}"
    );
    // Tokenizer files.
    let tok_err = |p: &Path| Qwen3Tokenizer::from_dir(p, LEN).unwrap_err().to_string();
    let e = tok_err(&fixture("text_encoder"));
    assert!(
        e.contains("text_encoder") && e.contains("no tokenizer.json"),
        "{e}"
    );
    let dir = std::env::temp_dir().join(format!("flame-qwen3-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"padding_side": "left"}"#,
    )
    .unwrap();
    let e = tok_err(&dir);
    assert!(
        e.contains("tokenizer_config.json") && e.contains("padding_side"),
        "{e}"
    );
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"pad_token": "<pad>"}"#,
    )
    .unwrap();
    let e = tok_err(&dir);
    assert!(e.contains("tokenizer.json") && e.contains("<pad>"), "{e}");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"truncation_side": "left"}"#,
    )
    .unwrap();
    let tok = Qwen3Tokenizer::from_dir(&dir, 4).unwrap();
    let full = Qwen3Tokenizer::from_dir(fixture("tokenizer"), 64).unwrap();
    let text = chat_prompt("a photo of a cat", true);
    let all = full.encode(&text).unwrap();
    let n = all.mask.iter().filter(|&&m| m == 1).count();
    assert_eq!(tok.encode(&text).unwrap().ids, all.ids[n - 4..n].to_vec());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// config.json in transformers 5's form (`rope_parameters`) and 4.x's (`rope_theta`,
/// `rope_scaling: null`), the defaults of absent fields, and the settings FLAME refuses; the
/// real configs' head layout.
#[test]
fn config_from_json() {
    let text = std::fs::read_to_string(fixture("text_encoder/config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cfg = Qwen3Config::from_json(&v, None).unwrap();
    assert_eq!(
        (
            cfg.rope_theta,
            cfg.head_dim,
            cfg.num_key_value_heads,
            cfg.vocab_size
        ),
        (1e6, 16, 2, 325)
    );
    let old = serde_json::json!({
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": null,
        "hidden_act": "silu", "use_sliding_window": false, "attention_bias": false
    });
    assert_eq!(
        Qwen3Config::from_json(&old, None).unwrap(),
        Qwen3Config::qwen3_4b()
    );
    let bare = serde_json::json!({
        "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2
    });
    let d = Qwen3Config::from_json(&bare, None).unwrap();
    assert_eq!(
        (d.num_key_value_heads, d.head_dim, d.rope_theta),
        (2, 128, 10_000.0)
    );
    let path = Path::new("config.json");
    for (key, value, part) in [
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            "yarn",
        ),
        ("hidden_act", serde_json::json!("gelu"), "gelu"),
        ("use_sliding_window", serde_json::json!(true), "sliding"),
        ("num_key_value_heads", serde_json::json!(3), "groups"),
    ] {
        let mut v = old.clone();
        v[key] = value;
        let e = Qwen3Config::from_json(&v, Some(path))
            .unwrap_err()
            .to_string();
        assert!(e.contains(part) && e.contains("config.json"), "{key}: {e}");
    }
    let (c4, c8) = (Qwen3Config::qwen3_4b(), Qwen3Config::qwen3_8b());
    assert_eq!(c4.num_attention_heads * c4.head_dim, 4096);
    assert_eq!((c8.hidden_size, c8.num_hidden_layers), (4096, 36));
    assert_eq!(c4.hidden_index(-2).unwrap(), 35);
    assert_eq!(c4.hidden_index(36).unwrap(), 36);
    assert!(c4.hidden_index(-38).is_err());
}

/// Qwen3-4B's released key and shape list (transformers' names under "model.", made on the
/// meta device from Qwen/Qwen3-4B's config.json) loads through `load_from` without weights:
/// the config inferred from its shapes is `Qwen3Config::qwen3_4b()` (32 heads of 128 over
/// width 2560, 8 key/value heads), every key is read, and FLUX.2 [klein]'s and Z-Image's
/// options build 27 and 35 layers.
#[test]
fn qwen3_4b_key_list_loads() {
    let text = std::fs::read_to_string(fixture("qwen3_4b_keys.json")).unwrap();
    let keys: BTreeMap<String, Vec<usize>> = serde_json::from_str(&text).unwrap();
    assert_eq!(keys.len(), 36 * 11 + 2);
    let origin = fixture("qwen3_4b_keys.json");
    let raw = || VarBuilder::from_shapes(keys.clone(), DType::BF16, &CPU);
    let (enc, vb) = Qwen3Encoder::load_from(raw(), &origin, &Qwen3Options::default()).unwrap();
    assert_eq!(enc.config, Qwen3Config::qwen3_4b());
    assert_eq!(enc.depth(), 36);
    assert_eq!(vb.unused_keys().unwrap(), Vec::<String>::new());
    for (cond, depth) in [(QWEN3_FLUX2_KLEIN, 27), (QWEN3_Z_IMAGE, 35)] {
        let (enc, vb) = Qwen3Encoder::load_from(raw(), &origin, &cond.options()).unwrap();
        assert_eq!(enc.depth(), depth, "{}", cond.pipeline);
        let unused = vb.unused_keys().unwrap();
        assert!(
            unused.contains(&"model.norm.weight".to_string()),
            "{}",
            cond.pipeline
        );
        assert_eq!(unused.len(), (36 - depth) * 11 + 1, "{}", cond.pipeline);
    }
}
