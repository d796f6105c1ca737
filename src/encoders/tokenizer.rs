//! Captions to token ids: CLIP's byte-level BPE and T5's unigram, through Hugging Face's
//! `tokenizers` crate, framed (special tokens, truncation, padding) here to match what
//! transformers' `CLIPTokenizerFast` and `T5TokenizerFast` return with
//! `padding="max_length", truncation=True`.
//!
//! The tokenizer files come from a diffusers pipeline folder (`tokenizer/`, `tokenizer_2/`,
//! `tokenizer_3/`) or a transformers model folder; single-file checkpoints hold none, so
//! FLAME also carries the released vocabularies (feature `vocab`, [`BuiltinTokenizer`]):
//! each tokenizer's `builtin` constructor builds the same tokenizer from them. T5's is also
//! read from a bare `spiece.model` (module `spiece`).

use super::spiece::t5_from_spiece;
use super::vocab::{BuiltinTokenizer, VocabFile};
use crate::{Device, Error, Result, Tensor};
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Lowercase, Replace, Sequence as NormSeq, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// CLIP's context length (transformers `CLIPTextConfig.max_position_embeddings` = 77).
pub const CLIP_MAX_LEN: usize = 77;
/// CLIP's `<|startoftext|>` id in the OpenAI vocabulary (49406).
pub const CLIP_BOS: u32 = 49406;
/// CLIP's `<|endoftext|>` id in the OpenAI vocabulary (49407): CLIP-L's padding.
pub const CLIP_EOS: u32 = 49407;
/// T5 lengths the pipelines use: Flux dev 512, Flux schnell and SD3.5 256
/// (diffusers `FluxPipeline` / `StableDiffusion3Pipeline` `max_sequence_length`).
pub const T5_LEN_FLUX_DEV: usize = 512;
/// See [`T5_LEN_FLUX_DEV`].
pub const T5_LEN_SCHNELL_SD35: usize = 256;

/// CLIP's pre-tokenizer pattern (OpenAI's `SimpleTokenizer`, as transformers 5's
/// `CLIPTokenizer` spells it).
const CLIP_SPLIT: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// One caption as the text encoder takes it: `ids` and `mask` (1 for a real token, 0 for
/// padding), both of the tokenizer's fixed length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// Token ids, padded to the fixed length.
    pub ids: Vec<u32>,
    /// 1 where `ids` holds a token of the text (or BOS / EOS), 0 over the padding.
    pub mask: Vec<u32>,
}

impl Tokens {
    /// A batch as `(ids, mask)` tensors, each (B, L) u32 on `device`; every caption must have
    /// the same length (they do when they come from one tokenizer).
    pub fn batch(tokens: &[Tokens], device: &Device) -> Result<(Tensor, Tensor)> {
        let l = tokens.first().map_or(0, |t| t.ids.len());
        let (mut ids, mut mask) = (vec![], vec![]);
        for t in tokens {
            if t.ids.len() != l || t.mask.len() != l {
                return Err(Error::invalid(
                    "Tokens::batch",
                    format!("captions of lengths {} and {l} in one batch", t.ids.len()),
                    &crate::Shape::from(vec![tokens.len(), l]),
                ));
            }
            ids.extend_from_slice(&t.ids);
            mask.extend_from_slice(&t.mask);
        }
        let b = tokens.len();
        Ok((
            Tensor::from_vec(ids, (b, l), device)?,
            Tensor::from_vec(mask, (b, l), device)?,
        ))
    }
}

fn tok_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Tokenizer {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// `ids` of the text, then `eos`, then `pad` up to `len`: the text is cut to `len - reserved`
/// ids first, so the specials always fit (transformers truncates the text, never the
/// specials).
fn frame(prefix: &[u32], text: &[u32], eos: u32, pad: u32, len: usize) -> Tokens {
    let keep = len.saturating_sub(prefix.len() + 1).min(text.len());
    let mut ids: Vec<u32> = prefix.to_vec();
    ids.extend_from_slice(&text[..keep]);
    ids.push(eos);
    let n = ids.len();
    ids.resize(len, pad);
    let mut mask = vec![1; n];
    mask.resize(len, 0);
    Tokens { ids, mask }
}

/// Encodes `text` without special tokens, padding or truncation.
fn raw_ids(tok: &Tokenizer, text: &str, path: &Path) -> Result<Vec<u32>> {
    let enc = tok
        .encode(text, false)
        .map_err(|e| tok_err(path, format!("cannot encode {text:?}: {e}")))?;
    Ok(enc.get_ids().to_vec())
}

/// The id of `token`, an error naming the file when the vocabulary lacks it.
fn id_of(tok: &Tokenizer, token: &str, path: &Path) -> Result<u32> {
    tok.token_to_id(token)
        .ok_or_else(|| tok_err(path, format!("the vocabulary has no token {token:?}")))
}

/// A tokenizer.json with its own truncation and padding turned off (we frame ourselves).
fn from_json(path: &Path) -> Result<Tokenizer> {
    from_json_bytes(&read(path)?, path)
}

/// The bytes of the file at `path`.
fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// [`from_json`] from the file's bytes; `path` names it in errors.
fn from_json_bytes(bytes: &[u8], path: &Path) -> Result<Tokenizer> {
    let mut tok = Tokenizer::from_bytes(bytes).map_err(|e| tok_err(path, e.to_string()))?;
    tok.with_truncation(None)
        .map_err(|e| tok_err(path, e.to_string()))?;
    tok.with_padding(None);
    Ok(tok)
}

/// CLIP's byte-level BPE (SD 1.x, SDXL, SD3.5 and Flux's CLIP-L, and OpenCLIP bigG, which
/// shares OpenAI's vocabulary): `<|startoftext|>`, the lower-cased text, `<|endoftext|>`,
/// then padding, `max_len` ids in all.
#[derive(Clone, Debug)]
pub struct ClipTokenizer {
    tok: Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_len: usize,
    path: PathBuf,
}

impl ClipTokenizer {
    /// The tokenizer in folder `dir`: its `tokenizer.json` if present, else `vocab.json` and
    /// `merges.txt`, built into the pipeline of transformers 5's `CLIPTokenizer` (4's
    /// `CLIPTokenizerFast`): NFC, whitespace runs to one space, lower case, CLIP's split,
    /// byte-level BPE with `</w>` word ends. `pad` is the padding id; `None` takes the folder's `pad_token` (from
    /// `special_tokens_map.json` or `tokenizer_config.json`), else `<|endoftext|>`. In
    /// diffusers pipelines CLIP-L's `tokenizer/` pads with `<|endoftext|>` (49407) and the
    /// bigG `tokenizer_2/` of SDXL and SD3 with `"!"` (id 0).
    pub fn from_dir(dir: impl AsRef<Path>, max_len: usize, pad: Option<u32>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(tok_err(
                dir,
                "not a folder; give the tokenizer folder of a diffusers pipeline \
                 (tokenizer/ or tokenizer_2/, holding vocab.json and merges.txt or \
                 tokenizer.json): single-file checkpoints hold no vocabulary",
            ));
        }
        let json = dir.join("tokenizer.json");
        let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        let cfg = folder_config(dir)?;
        let (tok, path) = if json.is_file() {
            (from_json(&json)?, json)
        } else if vocab.is_file() && merges.is_file() {
            let (v, m) = BPE::read_file(path_str(&vocab)?, path_str(&merges)?)
                .map_err(|e| tok_err(dir, e.to_string()))?;
            (clip_bpe(v, m, dir)?, dir.to_path_buf())
        } else {
            return Err(tok_err(
                dir,
                "holds neither tokenizer.json nor vocab.json + merges.txt (CLIP's tokenizer \
                 files, as in a diffusers pipeline's tokenizer/ folder)",
            ));
        };
        Self::configured(tok, &cfg, pad, max_len, path)
    }

    /// The CLIP tokenizer shipped with FLAME: OpenAI's vocabulary, configured as the
    /// pipelines' CLIP-L `tokenizer/` ([`BuiltinTokenizer::ClipL`], padding with
    /// `<|endoftext|>`) or bigG `tokenizer_2/` ([`BuiltinTokenizer::ClipG`], padding with
    /// `"!"`); what [`from_dir`](Self::from_dir) builds from those folders. An error for
    /// another kind, or in a build without the feature `vocab`.
    pub fn builtin(which: BuiltinTokenizer, max_len: usize) -> Result<Self> {
        let config = match which {
            BuiltinTokenizer::ClipL => VocabFile::ClipLConfig,
            BuiltinTokenizer::ClipG => VocabFile::ClipGConfig,
            other => {
                return Err(tok_err(
                    &VocabFile::ClipVocab.path(),
                    format!("{} is not a CLIP tokenizer", other.describe()),
                ))
            }
        };
        let path = VocabFile::ClipVocab.path();
        let vocab: Vocab = serde_json::from_slice::<std::collections::HashMap<String, u32>>(
            &VocabFile::ClipVocab.read()?,
        )
        .map_err(|e| tok_err(&path, format!("invalid JSON: {e}")))?
        .into_iter()
        .collect();
        let merges = parse_merges(
            &VocabFile::ClipMerges.read()?,
            &VocabFile::ClipMerges.path(),
        )?;
        let mut cfg = FolderConfig::default();
        cfg.merge(
            &json_value(&config.read()?, &config.path())?,
            &config.path(),
        )?;
        Self::configured(clip_bpe(vocab, merges, &path)?, &cfg, None, max_len, path)
    }

    /// `tok` with the special tokens and padding of `cfg` (a tokenizer folder's config).
    fn configured(
        mut tok: Tokenizer,
        cfg: &FolderConfig,
        pad: Option<u32>,
        max_len: usize,
        path: PathBuf,
    ) -> Result<Self> {
        // As transformers registers them: BOS, EOS, the pad token and every token of
        // added_tokens_decoder are split from the text before BPE (so SDXL's tokenizer_2 reads
        // a "!" in a caption as its pad token, id 0). Tokens a tokenizer.json already has
        // keep their own flags.
        let have: Vec<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let mut special: Vec<AddedToken> = cfg.added.clone();
        for t in ["<|startoftext|>", "<|endoftext|>"]
            .into_iter()
            .chain(cfg.pad.as_deref())
        {
            if !special.iter().any(|s| s.content == t) {
                special.push(AddedToken::from(t, true));
            }
        }
        special.retain(|t| !have.contains(&t.content));
        tok.add_special_tokens(&special);
        let bos = id_of(&tok, "<|startoftext|>", &path)?;
        let eos = id_of(&tok, "<|endoftext|>", &path)?;
        let pad = match pad {
            Some(p) => p,
            None => match &cfg.pad {
                Some(t) => id_of(&tok, t, &path)?,
                None => eos,
            },
        };
        Self::new(tok, bos, eos, pad, max_len, path)
    }

    fn new(
        tok: Tokenizer,
        bos: u32,
        eos: u32,
        pad: u32,
        max_len: usize,
        path: PathBuf,
    ) -> Result<Self> {
        if max_len < 2 {
            return Err(tok_err(
                &path,
                format!("max_len {max_len} leaves no room for BOS and EOS"),
            ));
        }
        Ok(ClipTokenizer {
            tok,
            bos,
            eos,
            pad,
            max_len,
            path,
        })
    }

    /// The padding id.
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// The `<|endoftext|>` id.
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// `max_len` ids: BOS, the text's tokens (cut to `max_len - 2`), EOS, padding.
    pub fn encode(&self, text: &str) -> Result<Tokens> {
        let ids = raw_ids(&self.tok, text, &self.path)?;
        Ok(frame(&[self.bos], &ids, self.eos, self.pad, self.max_len))
    }
}

/// `p` as a string, for the `tokenizers` functions that take one.
fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| tok_err(p, "the path is not valid UTF-8"))
}

/// The merges of a `merges.txt` (a `#version` line, then one `left right` pair a line), as
/// `tokenizers`' `BPE::read_file` reads them.
fn parse_merges(bytes: &[u8], path: &Path) -> Result<Merges> {
    let text = std::str::from_utf8(bytes).map_err(|_| tok_err(path, "not UTF-8"))?;
    let mut merges = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("#version") || line.is_empty() {
            continue;
        }
        match line.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => merges.push((a.to_string(), b.to_string())),
            _ => return Err(tok_err(path, format!("line {}: not a merge pair", i + 1))),
        }
    }
    Ok(merges)
}

/// The JSON value of a config file's bytes.
fn json_value(bytes: &[u8], path: &Path) -> Result<serde_json::Value> {
    serde_json::from_slice(bytes).map_err(|e| tok_err(path, format!("invalid JSON: {e}")))
}

/// CLIP's pipeline around the BPE of `vocab` and `merges`; `path` names them in errors.
fn clip_bpe(vocab: Vocab, merges: Merges, path: &Path) -> Result<Tokenizer> {
    let err = |e: tokenizers::Error| tok_err(path, e.to_string());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token("<|endoftext|>".into())
        .end_of_word_suffix("</w>".into())
        .continuing_subword_prefix(String::new())
        .build()
        .map_err(err)?;
    let mut tok = Tokenizer::new(bpe);
    let ws = Replace::new(ReplacePattern::Regex(r"\s+".into()), " ").map_err(err)?;
    tok.with_normalizer(Some(NormSeq::new(vec![
        NFC.into(),
        ws.into(),
        Lowercase.into(),
    ])));
    let split = Split::new(
        SplitPattern::Regex(CLIP_SPLIT.into()),
        SplitDelimiterBehavior::Removed,
        true,
    )
    .map_err(err)?;
    tok.with_pre_tokenizer(Some(PreSeq::new(vec![
        split.into(),
        // add_prefix_space false; trim_offsets and use_regex at the defaults (true).
        ByteLevel::new(false, true, true).into(),
    ])));
    Ok(tok)
}

/// What a transformers tokenizer folder's `special_tokens_map.json` and
/// `tokenizer_config.json` say: the `pad_token` (a string or `{"content": ...}`, the former
/// file first) and the tokens of `added_tokens_decoder`.
#[derive(Default)]
struct FolderConfig {
    pad: Option<String>,
    added: Vec<AddedToken>,
    /// `padding_side` ("right" or "left"; transformers' default "right").
    padding_side: Option<String>,
    /// `truncation_side` ("right" or "left"; transformers' default "right").
    truncation_side: Option<String>,
}

fn folder_config(dir: &Path) -> Result<FolderConfig> {
    let mut cfg = FolderConfig::default();
    for name in ["special_tokens_map.json", "tokenizer_config.json"] {
        let path = dir.join(name);
        if path.is_file() {
            cfg.merge(&json_value(&read(&path)?, &path)?, &path)?;
        }
    }
    Ok(cfg)
}

impl FolderConfig {
    /// Takes what the config file `v` (at `path`) says that earlier files did not.
    fn merge(&mut self, v: &serde_json::Value, path: &Path) -> Result<()> {
        let content = |t: &serde_json::Value| match t {
            serde_json::Value::String(s) => Some(s.clone()),
            t => t
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_string),
        };
        if self.pad.is_none() {
            self.pad = v.get("pad_token").and_then(content);
        }
        let side = |k: &str| v.get(k).and_then(|s| s.as_str()).map(str::to_string);
        self.padding_side = self.padding_side.take().or_else(|| side("padding_side"));
        self.truncation_side = self
            .truncation_side
            .take()
            .or_else(|| side("truncation_side"));
        let flag = |t: &serde_json::Value, k: &str, default: bool| {
            t.get(k).and_then(|b| b.as_bool()).unwrap_or(default)
        };
        if let Some(added) = v.get("added_tokens_decoder").and_then(|a| a.as_object()) {
            for t in added.values() {
                let Some(c) = content(t) else {
                    return Err(tok_err(path, format!("added token {t} has no content")));
                };
                self.added.push(
                    AddedToken::from(c, flag(t, "special", false))
                        .normalized(flag(t, "normalized", true))
                        .lstrip(flag(t, "lstrip", false))
                        .rstrip(flag(t, "rstrip", false))
                        .single_word(flag(t, "single_word", false)),
                );
            }
        }
        Ok(())
    }
}

/// T5's unigram tokenizer (Flux's `tokenizer_2/`, SD3's `tokenizer_3/`): the text's pieces,
/// `</s>`, then `<pad>`, `max_len` ids in all (no BOS).
#[derive(Clone, Debug)]
pub struct T5Tokenizer {
    tok: Tokenizer,
    eos: u32,
    pad: u32,
    max_len: usize,
    path: PathBuf,
}

impl T5Tokenizer {
    /// From a `tokenizer.json` or `spiece.model` file, or a folder holding one (its
    /// tokenizer.json first). A bare `spiece.model` is converted as transformers converts it
    /// (module `spiece`).
    pub fn from_file(path: impl AsRef<Path>, max_len: usize) -> Result<Self> {
        let mut path = path.as_ref().to_path_buf();
        if path.is_dir() {
            let json = path.join("tokenizer.json");
            let spm = path.join("spiece.model");
            path = match (json.is_file(), spm.is_file()) {
                (true, _) => json,
                (false, true) => spm,
                (false, false) => {
                    return Err(tok_err(
                        &path,
                        "neither tokenizer.json nor spiece.model (T5's are in a diffusers \
                         pipeline's tokenizer_2/ for Flux or tokenizer_3/ for SD3)",
                    ))
                }
            };
        }
        if !path.is_file() {
            return Err(tok_err(
                &path,
                "no such file; give T5's tokenizer.json or spiece.model (a diffusers \
                 pipeline's tokenizer_2/ for Flux, tokenizer_3/ for SD3): single-file \
                 checkpoints hold no vocabulary",
            ));
        }
        let tok = match path.extension().is_some_and(|e| e == "model") {
            true => t5_from_spiece(&read(&path)?, &path)?,
            false => from_json(&path)?,
        };
        Self::new(tok, max_len, path)
    }

    /// The T5 tokenizer shipped with FLAME (T5 v1.1's vocabulary, FLUX.1-dev's
    /// `tokenizer_2/tokenizer.json`); an error in a build without the feature `vocab`.
    pub fn builtin(max_len: usize) -> Result<Self> {
        let path = VocabFile::T5Json.path();
        let tok = from_json_bytes(&VocabFile::T5Json.read()?, &path)?;
        Self::new(tok, max_len, path)
    }

    fn new(tok: Tokenizer, max_len: usize, path: PathBuf) -> Result<Self> {
        let eos = id_of(&tok, "</s>", &path)?;
        let pad = id_of(&tok, "<pad>", &path)?;
        if max_len < 1 {
            return Err(tok_err(&path, "max_len 0 leaves no room for EOS"));
        }
        Ok(T5Tokenizer {
            tok,
            eos,
            pad,
            max_len,
            path,
        })
    }

    /// `max_len` ids: the text's pieces (cut to `max_len - 1`), EOS (`</s>`, 1 in T5's
    /// vocabulary), `<pad>` (0).
    pub fn encode(&self, text: &str) -> Result<Tokens> {
        let ids = raw_ids(&self.tok, text, &self.path)?;
        Ok(frame(&[], &ids, self.eos, self.pad, self.max_len))
    }
}

/// Qwen's byte-level BPE (Qwen2 / Qwen3's `tokenizer.json`, transformers'
/// `Qwen2Tokenizer`): the text's tokens with the special tokens (`<|im_start|>`,
/// `<|im_end|>`, `<think>`, ...) matched as whole tokens, no BOS or EOS added, cut to
/// `max_len` and padded after the text with `pad_token` (`<|endoftext|>`): what transformers
/// returns for `tokenizer(text, padding="max_length", truncation=True, max_length=max_len)`,
/// as FLUX.2 \[klein\]'s and Z-Image's pipelines call it on their chat prompts.
#[derive(Clone, Debug)]
pub struct Qwen3Tokenizer {
    tok: Tokenizer,
    pad: u32,
    max_len: usize,
    /// `truncation_side` "left": the first tokens are cut, not the last.
    cut_left: bool,
    path: PathBuf,
}

impl Qwen3Tokenizer {
    /// From a tokenizer folder (a pipeline's `tokenizer/`, or a Qwen3 model folder) holding
    /// `tokenizer.json` and optionally `tokenizer_config.json`, or from a `tokenizer.json`
    /// file. The folder's config gives the pad token (default `<|endoftext|>`, transformers
    /// `Qwen2Tokenizer.__init__`), the truncation side and the padding side; padding on the
    /// left is refused (the released tokenizers pad on the right, transformers' default, and
    /// the encoder's positions assume it). Added tokens the config lists that the
    /// tokenizer.json lacks are added as transformers registers them.
    pub fn from_dir(path: impl AsRef<Path>, max_len: usize) -> Result<Self> {
        let path = path.as_ref();
        let (json, dir) = if path.is_dir() {
            (path.join("tokenizer.json"), Some(path))
        } else {
            (path.to_path_buf(), path.parent())
        };
        if !json.is_file() {
            return Err(tok_err(
                path,
                "no tokenizer.json: give the tokenizer folder of a FLUX.2 [klein] or Z-Image \
                 pipeline (tokenizer/) or of a Qwen3 model, or its tokenizer.json (single-file \
                 checkpoints hold no vocabulary; vocab.json + merges.txt alone are not read)",
            ));
        }
        let cfg = match dir {
            Some(d) => folder_config(d)?,
            None => FolderConfig::default(),
        };
        let config_file = dir.map_or_else(|| json.clone(), |d| d.join("tokenizer_config.json"));
        Self::configured(from_json(&json)?, &cfg, &config_file, max_len, json)
    }

    /// The Qwen3 tokenizer shipped with FLAME: Qwen3's `tokenizer.json` and
    /// `tokenizer_config.json` (as in FLUX.2 \[klein\]'s and Z-Image's `tokenizer/`), what
    /// [`from_dir`](Self::from_dir) builds from them; an error in a build without the
    /// feature `vocab`.
    pub fn builtin(max_len: usize) -> Result<Self> {
        let (json, config) = (VocabFile::Qwen3Json, VocabFile::Qwen3Config);
        let tok = from_json_bytes(&json.read()?, &json.path())?;
        let mut cfg = FolderConfig::default();
        cfg.merge(
            &json_value(&config.read()?, &config.path())?,
            &config.path(),
        )?;
        Self::configured(tok, &cfg, &config.path(), max_len, json.path())
    }

    /// `tok` (read from `json`) as the config `cfg` (from `config_file`) sets it up.
    fn configured(
        mut tok: Tokenizer,
        cfg: &FolderConfig,
        config_file: &Path,
        max_len: usize,
        json: PathBuf,
    ) -> Result<Self> {
        let side = |s: &Option<String>, key: &str| match s.as_deref() {
            None | Some("right") => Ok(false),
            Some("left") => Ok(true),
            Some(other) => Err(tok_err(
                config_file,
                format!("{key} \"{other}\" is neither \"right\" nor \"left\""),
            )),
        };
        if side(&cfg.padding_side, "padding_side")? {
            return Err(tok_err(
                config_file,
                "padding_side \"left\": Qwen3's conditioning pads on the right (the \
                 pipelines' released tokenizers do); remove the setting",
            ));
        }
        let cut_left = side(&cfg.truncation_side, "truncation_side")?;
        let have: Vec<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let mut added = cfg.added.clone();
        added.retain(|t| !have.contains(&t.content));
        tok.add_special_tokens(&added);
        let pad = id_of(&tok, cfg.pad.as_deref().unwrap_or("<|endoftext|>"), &json)?;
        if max_len < 1 {
            return Err(tok_err(&json, "max_len 0 leaves no room for a token"));
        }
        Ok(Qwen3Tokenizer {
            tok,
            pad,
            max_len,
            cut_left,
            path: json,
        })
    }

    /// The padding id (`<|endoftext|>`, 151643 in Qwen's vocabulary).
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// Tokens per text.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The id of `token` in the vocabulary, if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }

    /// `max_len` ids: the text's tokens (special tokens written in it read as such), cut to
    /// `max_len` on the truncation side, then padding; the mask is 1 over the text's tokens.
    /// The text is taken as it is (the pipelines' chat prompts are built by `chat_prompt`).
    pub fn encode(&self, text: &str) -> Result<Tokens> {
        let mut ids = raw_ids(&self.tok, text, &self.path)?;
        if ids.len() > self.max_len {
            match self.cut_left {
                true => {
                    ids.drain(..ids.len() - self.max_len);
                }
                false => ids.truncate(self.max_len),
            }
        }
        let n = ids.len();
        ids.resize(self.max_len, self.pad);
        let mut mask = vec![1; n];
        mask.resize(self.max_len, 0);
        Ok(Tokens { ids, mask })
    }
}
