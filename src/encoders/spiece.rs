//! T5's tokenizer from a bare SentencePiece `spiece.model`, built as transformers 5's
//! `T5Tokenizer` builds it from that file (models/t5/tokenization_t5.py, with the pieces and
//! the normalizer's charsmap read out of the model as its `SentencePieceExtractor` does):
//!
//! - model: unigram over the model's pieces with their scores, then the sentinels
//!   `<extra_id_99>` ... `<extra_id_0>` (score 0), the unknown piece at the trainer's `unk_id`;
//! - normalizer: the model's precompiled charsmap (`Precompiled`), none when it is empty;
//! - pre-tokenizer: whitespace split, then Metaspace (replacement `▁`, prepend scheme
//!   "always", split);
//! - added tokens: the control and unknown pieces (`<pad>`, `</s>`, `<unk>` in T5's) and the
//!   sentinels, special and matched before normalization; user-defined pieces not special
//!   (transformers' `SpmConverter`);
//! - `</s>` after the text, which [`T5Tokenizer`](super::T5Tokenizer) frames itself.
//!
//! transformers 4's `T5Converter` gave the same pieces through another route (normalizer
//! `Precompiled` + strip on the right + runs of spaces to one `▁`, no whitespace split).
//!
//! The protobuf is read here, only the fields needed (sentencepiece's
//! `sentencepiece_model.proto`): `ModelProto` 1 pieces, 2 trainer_spec, 3 normalizer_spec;
//! `SentencePiece` 1 piece, 2 score, 3 type; `TrainerSpec` 3 model_type, 35 byte_fallback,
//! 40 unk_id; `NormalizerSpec` 2 precompiled_charsmap.

use crate::{Error, Result};
use std::path::Path;
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::precompiled::Precompiled;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};

/// T5's sentinel count (transformers `T5Tokenizer(extra_ids=100)`).
const T5_EXTRA_IDS: usize = 100;

/// `SentencePiece.Type` (sentencepiece_model.proto).
const NORMAL: u64 = 1;
const UNKNOWN: u64 = 2;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;
/// `TrainerSpec.ModelType` UNIGRAM.
const UNIGRAM: u64 = 1;

fn err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Tokenizer {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// One field of a protobuf message.
enum Value<'a> {
    Varint(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

/// The fields of one protobuf message, in order: (field number, value).
fn fields<'a>(mut buf: &'a [u8], path: &Path, what: &str) -> Result<Vec<(u64, Value<'a>)>> {
    let bad = || {
        err(
            path,
            format!("not a SentencePiece model: truncated or malformed {what}"),
        )
    };
    fn varint(buf: &mut &[u8]) -> Option<u64> {
        let mut x = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = buf.split_first()?;
            *buf = rest;
            x |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(x);
            }
        }
        None
    }
    let mut out = vec![];
    while !buf.is_empty() {
        let key = varint(&mut buf).ok_or_else(bad)?;
        let value = match key & 7 {
            0 => Value::Varint(varint(&mut buf).ok_or_else(bad)?),
            1 => {
                let (_, rest) = buf.split_at_checked(8).ok_or_else(bad)?;
                buf = rest;
                continue;
            }
            2 => {
                let n = usize::try_from(varint(&mut buf).ok_or_else(bad)?).map_err(|_| bad())?;
                let (bytes, rest) = buf.split_at_checked(n).ok_or_else(bad)?;
                buf = rest;
                Value::Bytes(bytes)
            }
            5 => {
                let (b, rest) = buf.split_at_checked(4).ok_or_else(bad)?;
                buf = rest;
                Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            _ => return Err(bad()),
        };
        out.push((key >> 3, value));
    }
    Ok(out)
}

/// A piece of the vocabulary.
struct Piece {
    piece: String,
    score: f32,
    kind: u64,
}

/// What the tokenizer needs of a `ModelProto`.
struct SpModel {
    pieces: Vec<Piece>,
    unk_id: usize,
    charsmap: Vec<u8>,
}

fn parse(data: &[u8], path: &Path) -> Result<SpModel> {
    let mut m = SpModel {
        pieces: vec![],
        // TrainerSpec defaults: unk_id 0, model_type UNIGRAM, byte_fallback false.
        unk_id: 0,
        charsmap: vec![],
    };
    let (mut model_type, mut byte_fallback) = (UNIGRAM, false);
    for (field, value) in fields(data, path, "ModelProto")? {
        let Value::Bytes(msg) = value else { continue };
        match field {
            1 => {
                let mut p = Piece {
                    piece: String::new(),
                    score: 0.0,
                    kind: NORMAL,
                };
                for (f, v) in fields(msg, path, "SentencePiece")? {
                    match (f, v) {
                        (1, Value::Bytes(s)) => {
                            p.piece = String::from_utf8(s.to_vec()).map_err(|_| {
                                err(path, format!("piece {} is not UTF-8", m.pieces.len()))
                            })?
                        }
                        (2, Value::Fixed32(x)) => p.score = f32::from_bits(x),
                        (3, Value::Varint(t)) => p.kind = t,
                        _ => {}
                    }
                }
                m.pieces.push(p);
            }
            2 => {
                for (f, v) in fields(msg, path, "TrainerSpec")? {
                    match (f, v) {
                        (3, Value::Varint(t)) => model_type = t,
                        (35, Value::Varint(b)) => byte_fallback = b != 0,
                        (40, Value::Varint(id)) => {
                            m.unk_id = usize::try_from(id).map_err(|_| {
                                err(path, format!("unk_id {id} is not a piece index"))
                            })?
                        }
                        _ => {}
                    }
                }
            }
            3 => {
                for (f, v) in fields(msg, path, "NormalizerSpec")? {
                    if let (2, Value::Bytes(b)) = (f, v) {
                        m.charsmap = b.to_vec();
                    }
                }
            }
            _ => {}
        }
    }
    if model_type != UNIGRAM {
        return Err(err(
            path,
            format!(
                "a SentencePiece model of type {model_type} (T5's is a unigram model, type 1); \
                 give its tokenizer.json instead"
            ),
        ));
    }
    if byte_fallback {
        return Err(err(
            path,
            "a SentencePiece model with byte fallback (T5's has none); give its tokenizer.json",
        ));
    }
    match m.pieces.get(m.unk_id) {
        Some(p) if p.kind == UNKNOWN => Ok(m),
        _ => Err(err(
            path,
            format!(
                "{} pieces, and piece {} (the trainer's unk_id) is not the unknown piece",
                m.pieces.len(),
                m.unk_id
            ),
        )),
    }
}

/// T5's tokenizer from the bytes of a `spiece.model` (module docs); `path` names it in
/// errors.
pub(super) fn t5_from_spiece(data: &[u8], path: &Path) -> Result<Tokenizer> {
    let m = parse(data, path)?;
    let terr = |e: tokenizers::Error| err(path, e.to_string());
    let mut vocab: Vec<(String, f64)> = m
        .pieces
        .iter()
        .map(|p| (p.piece.clone(), f64::from(p.score)))
        .collect();
    let sentinels: Vec<String> = (0..T5_EXTRA_IDS)
        .rev()
        .map(|i| format!("<extra_id_{i}>"))
        .collect();
    vocab.extend(sentinels.iter().map(|s| (s.clone(), 0.0)));
    let mut tok = Tokenizer::new(Unigram::from(vocab, Some(m.unk_id), false).map_err(terr)?);
    if !m.charsmap.is_empty() {
        let pre = Precompiled::from(&m.charsmap)
            .map_err(|e| err(path, format!("the normalizer's charsmap: {e}")))?;
        tok.with_normalizer(Some(pre));
    }
    tok.with_pre_tokenizer(Some(PreSeq::new(vec![
        WhitespaceSplit.into(),
        Metaspace::new('▁', PrependScheme::Always, true).into(),
    ])));
    let mut special: Vec<AddedToken> = m
        .pieces
        .iter()
        .filter(|p| p.kind == CONTROL || p.kind == UNKNOWN)
        .map(|p| AddedToken::from(p.piece.clone(), true))
        .collect();
    special.extend(sentinels.into_iter().map(|s| AddedToken::from(s, true)));
    tok.add_special_tokens(&special);
    let user: Vec<AddedToken> = m
        .pieces
        .iter()
        .filter(|p| p.kind == USER_DEFINED)
        .map(|p| AddedToken::from(p.piece.clone(), false).normalized(false))
        .collect();
    tok.add_tokens(&user);
    Ok(tok)
}
