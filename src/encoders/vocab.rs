//! The tokenizer vocabularies built into FLAME (cargo feature `vocab`, on by default), for
//! text encoders given as single files with no tokenizer folder: OpenAI CLIP's BPE (MIT),
//! T5 v1.1's SentencePiece unigram (Apache-2.0) and Qwen3's BPE (Apache-2.0). The files are
//! in the crate's `vocab/` folder, gzipped; `vocab/NOTICE.md` names each one's source and
//! licence, and `scripts/make_vocab.py` writes them from the released files.

use crate::Result;
use std::path::PathBuf;

/// A tokenizer shipped with FLAME, configured as the diffusers pipelines' tokenizer folders
/// configure it. Which one a text encoder slot falls back to is part of the family's
/// pipeline (`EncoderSlot::builtin`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BuiltinTokenizer {
    /// CLIP's BPE padding with `<|endoftext|>`: CLIP-L's `tokenizer/` in SD 1.x, SDXL, SD3
    /// and FLUX.1.
    ClipL,
    /// CLIP's BPE padding with `"!"` (id 0, registered as a special token): OpenCLIP bigG's
    /// `tokenizer_2/` in SDXL and SD3.
    ClipG,
    /// T5 v1.1's unigram: FLUX.1's `tokenizer_2/`, SD3's `tokenizer_3/`.
    T5,
    /// Qwen3's byte-level BPE with its added tokens: FLUX.2 \[klein\]'s and Z-Image's
    /// `tokenizer/`.
    Qwen3,
}

impl BuiltinTokenizer {
    /// Whether this build carries the vocabularies (feature `vocab`).
    pub const AVAILABLE: bool = cfg!(feature = "vocab");

    /// What it is, for messages and cache keys.
    pub fn describe(self) -> &'static str {
        match self {
            BuiltinTokenizer::ClipL => {
                "FLAME's built-in CLIP tokenizer (OpenAI's BPE vocabulary, padding with \
                 <|endoftext|>, as CLIP-L's tokenizer/)"
            }
            BuiltinTokenizer::ClipG => {
                "FLAME's built-in CLIP tokenizer (OpenAI's BPE vocabulary, padding with \"!\", \
                 as OpenCLIP bigG's tokenizer_2/ in SDXL and SD3)"
            }
            BuiltinTokenizer::T5 => {
                "FLAME's built-in T5 tokenizer (T5 v1.1's SentencePiece vocabulary, as FLUX.1's \
                 tokenizer_2/)"
            }
            BuiltinTokenizer::Qwen3 => {
                "FLAME's built-in Qwen3 tokenizer (Qwen3's BPE vocabulary with its added tokens)"
            }
        }
    }
}

/// One shipped file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VocabFile {
    /// CLIP's `vocab.json`.
    ClipVocab,
    /// CLIP's `merges.txt`.
    ClipMerges,
    /// CLIP-L's `tokenizer_config.json`.
    ClipLConfig,
    /// OpenCLIP bigG's `tokenizer_config.json` (SDXL's `tokenizer_2/`).
    ClipGConfig,
    /// T5's `tokenizer.json`.
    T5Json,
    /// Qwen3's `tokenizer.json`.
    Qwen3Json,
    /// Qwen3's `tokenizer_config.json`.
    Qwen3Config,
}

impl VocabFile {
    /// Its name in the crate's `vocab/` folder.
    fn name(self) -> &'static str {
        match self {
            VocabFile::ClipVocab => "clip_vocab.json.gz",
            VocabFile::ClipMerges => "clip_merges.txt.gz",
            VocabFile::ClipLConfig => "clip_l_tokenizer_config.json",
            VocabFile::ClipGConfig => "clip_g_tokenizer_config.json",
            VocabFile::T5Json => "t5_tokenizer.json.gz",
            VocabFile::Qwen3Json => "qwen3_tokenizer.json.gz",
            VocabFile::Qwen3Config => "qwen3_tokenizer_config.json.gz",
        }
    }

    /// The path errors name.
    pub(super) fn path(self) -> PathBuf {
        PathBuf::from(format!("<FLAME built-in>/vocab/{}", self.name()))
    }

    /// The file's bytes, decompressed.
    pub(super) fn read(self) -> Result<Vec<u8>> {
        imp::read(self)
    }
}

#[cfg(feature = "vocab")]
mod imp {
    use super::VocabFile;
    use crate::{Error, Result};
    use std::io::Read;

    macro_rules! shipped {
        ($name:literal) => {
            include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/vocab/", $name))
        };
    }

    fn bytes(f: VocabFile) -> &'static [u8] {
        match f {
            VocabFile::ClipVocab => shipped!("clip_vocab.json.gz"),
            VocabFile::ClipMerges => shipped!("clip_merges.txt.gz"),
            VocabFile::ClipLConfig => shipped!("clip_l_tokenizer_config.json"),
            VocabFile::ClipGConfig => shipped!("clip_g_tokenizer_config.json"),
            VocabFile::T5Json => shipped!("t5_tokenizer.json.gz"),
            VocabFile::Qwen3Json => shipped!("qwen3_tokenizer.json.gz"),
            VocabFile::Qwen3Config => shipped!("qwen3_tokenizer_config.json.gz"),
        }
    }

    pub(super) fn read(f: VocabFile) -> Result<Vec<u8>> {
        let data = bytes(f);
        if !f.name().ends_with(".gz") {
            return Ok(data.to_vec());
        }
        let mut out = vec![];
        flate2::read::GzDecoder::new(data)
            .read_to_end(&mut out)
            .map_err(|e| Error::Tokenizer {
                path: f.path(),
                msg: format!("cannot decompress: {e}"),
            })?;
        Ok(out)
    }
}

#[cfg(not(feature = "vocab"))]
mod imp {
    use super::{VocabFile, NOT_BUILT};
    use crate::{Error, Result};

    pub(super) fn read(f: VocabFile) -> Result<Vec<u8>> {
        Err(Error::Tokenizer {
            path: f.path(),
            msg: NOT_BUILT.into(),
        })
    }
}

/// Why a build without the feature has no built-in tokenizer.
pub(crate) const NOT_BUILT: &str = "this FLAME was built without the `vocab` feature, so it \
     carries no tokenizer vocabularies: give the tokenizer folders of a diffusers pipeline, or \
     build with the default features (`--features vocab`)";
