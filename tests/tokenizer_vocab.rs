//! The tokenizers built into FLAME (feature `vocab`) and T5's tokenizer read from a bare
//! `spiece.model`, against transformers: tests/fixtures/tokenizers/ids.json holds the ids
//! transformers' CLIPTokenizer, T5TokenizerFast and Qwen2TokenizerFast return for hard
//! captions (unicode, accents, CJK, emoji, runs of punctuation and spaces, newlines, numbers,
//! prompt-weight syntax, special-token text, the empty string, a caption past every limit),
//! loaded from the files FLAME ships and from spiece.model files
//! (scripts/make_tokenizer_fixtures.py). Every id must be equal.
#![cfg(feature = "vocab")]

use flame::encoders::{
    BuiltinTokenizer, ClipTokenizer, Qwen3Tokenizer, T5Tokenizer, Tokens, QWEN3_FLUX2_KLEIN,
    QWEN3_Z_IMAGE,
};
use flame::models::{Sources, TokenizerSource, FAMILIES};
use std::io::Read;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizers")
        .join(name)
}

/// One tokenizer's reference in ids.json: (max_len, [(text, tokens)]).
fn reference(name: &str) -> (usize, Vec<(String, Tokens)>) {
    let text = std::fs::read_to_string(fixture("ids.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = &v[name];
    let max_len = t["max_len"].as_u64().unwrap() as usize;
    let pad = t["pad"].as_u64().unwrap() as u32;
    let captions = t["captions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut ids: Vec<u32> = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let mut mask = vec![1; ids.len()];
            ids.resize(max_len, pad);
            mask.resize(max_len, 0);
            (
                c["text"].as_str().unwrap().to_string(),
                Tokens { ids, mask },
            )
        })
        .collect();
    (max_len, captions)
}

/// Every caption of `name` encoded by `encode` equals transformers' ids and mask.
fn check(name: &str, encode: impl Fn(&str) -> Tokens) {
    let (_, captions) = reference(name);
    assert!(captions.len() >= 19, "{name}: {} captions", captions.len());
    for (text, want) in &captions {
        let got = encode(text);
        assert_eq!(got.ids, want.ids, "{name}: ids of {text:?}");
        assert_eq!(got.mask, want.mask, "{name}: mask of {text:?}");
    }
}

fn gunzip(path: &Path) -> Vec<u8> {
    let mut out = vec![];
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_end(&mut out)
        .unwrap();
    out
}

#[test]
fn builtin_clip_matches_transformers_both_paddings() {
    let l = ClipTokenizer::builtin(BuiltinTokenizer::ClipL, 77).unwrap();
    let g = ClipTokenizer::builtin(BuiltinTokenizer::ClipG, 77).unwrap();
    // OpenAI's vocabulary: BOS 49406, EOS 49407; CLIP-L pads with EOS, bigG with "!" (0).
    assert_eq!(
        l.encode("a photo of a cat").unwrap().ids[..7],
        [49406, 320, 1125, 539, 320, 2368, 49407]
    );
    assert_eq!((l.pad_id(), g.pad_id(), l.eos_id()), (49407, 0, 49407));
    check("clip_l", |t| l.encode(t).unwrap());
    check("clip_g", |t| g.encode(t).unwrap());
    assert!(ClipTokenizer::builtin(BuiltinTokenizer::T5, 77).is_err());
}

#[test]
fn builtin_t5_matches_transformers() {
    for n in [256, 512] {
        let tok = T5Tokenizer::builtin(n).unwrap();
        check(&format!("t5_{n}"), |t| tok.encode(t).unwrap());
    }
}

#[test]
fn builtin_qwen3_matches_transformers_with_the_chat_templates() {
    let raw = Qwen3Tokenizer::builtin(64).unwrap();
    assert_eq!(raw.pad_id(), 151643);
    for (token, id) in [
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<think>", 151667),
        ("</think>", 151668),
    ] {
        assert_eq!(raw.token_id(token), Some(id), "{token}");
    }
    check("qwen3_raw_64", |t| raw.encode(t).unwrap());
    for (name, cond) in [
        ("qwen3_klein_512", &QWEN3_FLUX2_KLEIN),
        ("qwen3_zimage_512", &QWEN3_Z_IMAGE),
    ] {
        let tok = Qwen3Tokenizer::builtin(cond.max_len).unwrap();
        check(name, |t| cond.tokens(&tok, t).unwrap());
    }
}

#[test]
fn t5_spiece_model_reads_as_transformers_converts_it() {
    let dir = std::env::temp_dir().join(format!("flame-spiece-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A small unigram model trained by sentencepiece, as a file and as a folder's
    // spiece.model.
    let small = dir.join("small.model");
    std::fs::write(&small, gunzip(&fixture("small_spiece.model.gz"))).unwrap();
    let tok = T5Tokenizer::from_file(&small, 64).unwrap();
    check("small_spiece_64", |t| tok.encode(t).unwrap());
    // T5 v1.1's own spiece.model: the same ids as the shipped tokenizer.json (and as
    // transformers' conversion of it).
    let real = dir.join("t5");
    std::fs::create_dir_all(&real).unwrap();
    std::fs::write(
        real.join("spiece.model"),
        gunzip(&fixture("t5_spiece.model.gz")),
    )
    .unwrap();
    let tok = T5Tokenizer::from_file(&real, 256).unwrap();
    let shipped = T5Tokenizer::builtin(256).unwrap();
    check("t5_spiece_256", |t| {
        let got = tok.encode(t).unwrap();
        assert_eq!(got, shipped.encode(t).unwrap(), "{t:?}");
        got
    });
    // A truncated or foreign file is an error naming it, not a panic.
    let bad = dir.join("bad.model");
    let bytes = gunzip(&fixture("small_spiece.model.gz"));
    for cut in [
        &bytes[..bytes.len() / 2],
        b"\x0a\xff\xff\xff\xff\x0f".as_slice(),
    ] {
        std::fs::write(&bad, cut).unwrap();
        let e = T5Tokenizer::from_file(&bad, 64).unwrap_err().to_string();
        assert!(e.contains("bad.model"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pipelines_fall_back_to_the_builtin_tokenizers() {
    // Single files only, as in a ComfyUI models/ folder: no tokenizer folder anywhere.
    let dir = std::env::temp_dir().join(format!("flame-vocab-locate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |n: &str| {
        let p = dir.join(n);
        std::fs::write(&p, b"").unwrap();
        p
    };
    let model = file("model.safetensors");
    let cases: [(&str, &[BuiltinTokenizer]); 5] = [
        ("flux", &[BuiltinTokenizer::ClipL, BuiltinTokenizer::T5]),
        (
            "sd3",
            &[
                BuiltinTokenizer::ClipL,
                BuiltinTokenizer::ClipG,
                BuiltinTokenizer::T5,
            ],
        ),
        ("sdxl", &[BuiltinTokenizer::ClipL, BuiltinTokenizer::ClipG]),
        ("flux2", &[BuiltinTokenizer::Qwen3]),
        ("zimage", &[BuiltinTokenizer::Qwen3]),
    ];
    for (name, want) in cases {
        let family = FAMILIES.iter().find(|f| f.name == name).unwrap();
        let text: Vec<PathBuf> = (0..want.len())
            .map(|i| file(&format!("{name}_te{i}.safetensors")))
            .collect();
        let sources = Sources {
            text,
            tokenizers: vec![],
            vae: Some(file("vae.safetensors")),
        };
        let (located, _) = sources
            .locate(family, &model, ["text", "tokenizers", "vae"])
            .unwrap();
        let got: Vec<TokenizerSource> = located.into_iter().map(|(_, t)| t).collect();
        let want: Vec<TokenizerSource> =
            want.iter().map(|b| TokenizerSource::Builtin(*b)).collect();
        assert_eq!(got, want, "{name}");
        for (slot, b) in family.pipeline.text.iter().zip(&want) {
            let TokenizerSource::Builtin(b) = b else {
                unreachable!()
            };
            assert!(slot.builtin_fits(*b), "{name} {}", slot.name);
        }
        // A given tokenizer folder still wins.
        let given = Sources {
            tokenizers: (0..want.len()).map(|_| dir.clone()).collect(),
            ..sources
        };
        let (located, _) = given
            .locate(family, &model, ["text", "tokenizers", "vae"])
            .unwrap();
        assert!(located
            .iter()
            .all(|(_, t)| *t == TokenizerSource::Path(dir.clone())));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
