//! The `[data]` table's keys for images and captions ([`DataConfig`]), readable and checkable
//! on its own: every problem is found at once and named by its key and, read from TOML
//! text, its line.
//!
//! ```toml
//! [data]
//! resolution = 1024
//! flip = true
//! caption_dropout = 0.1
//!
//! [[data.dirs]]
//! path = "images/portraits"
//! repeats = 2
//!
//! [[data.dirs]]
//! path = "images/landscapes"
//! ```

use super::bucket::{BucketConfig, CropMode, Resample};
use super::caption::CaptionOptions;
use super::dataset::DatasetOptions;
use super::source::{OnBadFile, Source};
use crate::train::config::{in_list, line_of, Problem};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One image folder of `data.dirs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirEntry {
    /// The folder: images (png, jpg, jpeg, webp) with a `.txt` caption beside each.
    pub path: PathBuf,
    /// Times each of its images appears in an epoch, >= 1.
    #[serde(default = "one")]
    pub repeats: usize,
}

fn one() -> usize {
    1
}

/// The `[data]` keys for images and captions; every key has a default except the source
/// (`dirs` or `manifest`, exactly one). Defaults are [`DataConfig::default`]'s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Image folders, each with its repeats (`[[data.dirs]]` tables). Default: none.
    pub dirs: Vec<DirEntry>,
    /// A JSONL manifest of `{"file": ..., "caption": ...}` lines instead of `dirs`
    /// (`file` relative to the manifest). Default: none.
    pub manifest: Option<PathBuf>,
    /// Repeats of every manifest image, >= 1. Default 1.
    pub manifest_repeats: usize,
    /// The target resolution R: buckets hold at most R² pixels. Default 1024.
    pub resolution: usize,
    /// Bucket sides are multiples of this, > 0 and at most `resolution`. Default 64.
    pub bucket_step: usize,
    /// The largest bucket aspect ratio (long side / short side), >= 1. Default 2.0.
    pub max_aspect: f64,
    /// "center" or "random" (seeded, one offset per sample and repeat). Default "center".
    pub crop: String,
    /// Mirror samples at random (seeded per epoch); SDXL's crop left is mirrored with them.
    /// Default false.
    pub flip: bool,
    /// The resize filter: "lanczos3" or "catmullrom". Default "lanczos3".
    pub resample: String,
    /// Probability in [0, 1] that a sample trains on the empty caption. Default 0.0.
    pub caption_dropout: f64,
    /// Shuffle the comma-separated tags of each caption every epoch. Default false.
    pub shuffle_tags: bool,
    /// With shuffle_tags, this many leading tags keep their place. Default 0.
    pub keep_tokens: usize,
    /// An unreadable image or a missing caption: "skip" (reported, left out) or "stop".
    /// Default "stop".
    pub on_bad_file: String,
    /// Where latents and text embeddings are cached. Default: none (the trainer's choice).
    pub cache_dir: Option<PathBuf>,
}

impl Default for DataConfig {
    fn default() -> Self {
        let b = BucketConfig::default();
        DataConfig {
            dirs: vec![],
            manifest: None,
            manifest_repeats: 1,
            resolution: b.resolution,
            bucket_step: b.step,
            max_aspect: b.max_aspect,
            crop: "center".into(),
            flip: false,
            resample: "lanczos3".into(),
            caption_dropout: 0.0,
            shuffle_tags: false,
            keep_tokens: 0,
            on_bad_file: "stop".into(),
            cache_dir: None,
        }
    }
}

/// A document holding the `[data]` table (other tables are not read).
#[derive(Deserialize)]
struct Doc {
    #[serde(default)]
    data: DataConfig,
}

impl DataConfig {
    /// Reads the `[data]` table of TOML `text` (other tables are ignored) and checks it;
    /// relative paths stay as written. Errors name every bad key with its line.
    pub fn from_toml(text: &str) -> Result<Self> {
        Self::parse(text, None)
    }

    /// As [`DataConfig::from_toml`] from the file `path`; relative paths become relative to
    /// its folder.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(super::io_err(path))?;
        Self::parse(&text, Some(path))
    }

    fn parse(text: &str, path: Option<&Path>) -> Result<Self> {
        let bad = |msg: String| Error::Config {
            path: path.map(Path::to_path_buf),
            msg,
        };
        let doc: Doc = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        let mut c = doc.data;
        if let Some(base) = path.and_then(Path::parent) {
            let paths = c
                .dirs
                .iter_mut()
                .map(|d| &mut d.path)
                .chain(c.manifest.as_mut())
                .chain(c.cache_dir.as_mut());
            for p in paths {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        let problems = c.problems();
        if problems.is_empty() {
            return Ok(c);
        }
        let lines: Vec<String> = problems
            .iter()
            .map(
                |p| match line_of(text, p.key).or_else(|| table_line(text, p.key)) {
                    Some(n) => format!("line {n}: {} = {}", p.key, p.msg),
                    None => format!("{} (default) = {}", p.key, p.msg),
                },
            )
            .collect();
        Err(bad(lines.join("\n")))
    }

    /// Every problem of the values, each naming its key; empty when all pass.
    pub fn problems(&self) -> Vec<Problem> {
        let mut v = vec![];
        let mut check = |ok: bool, key: &'static str, msg: String| {
            if !ok {
                v.push(Problem { key, msg });
            }
        };
        check(
            self.dirs.is_empty() != self.manifest.is_none(),
            "data.dirs",
            match self.manifest.is_none() {
                true => "no image source: give data.dirs or data.manifest".into(),
                false => "both data.dirs and data.manifest are given: use one".into(),
            },
        );
        for (i, d) in self.dirs.iter().enumerate() {
            check(
                d.repeats >= 1,
                "data.dirs",
                format!(
                    "entry {} ({}): repeats = 0, must be >= 1",
                    i + 1,
                    d.path.display()
                ),
            );
        }
        check(
            self.manifest_repeats >= 1,
            "data.manifest_repeats",
            "0: must be >= 1".into(),
        );
        check(
            self.bucket_step > 0,
            "data.bucket_step",
            "0: must be positive".into(),
        );
        check(
            self.resolution >= self.bucket_step.max(1),
            "data.resolution",
            format!(
                "{}: must be at least data.bucket_step ({})",
                self.resolution, self.bucket_step
            ),
        );
        check(
            self.max_aspect.is_finite() && self.max_aspect >= 1.0,
            "data.max_aspect",
            format!("{}: must be finite and >= 1", self.max_aspect),
        );
        check(
            (0.0..=1.0).contains(&self.caption_dropout),
            "data.caption_dropout",
            format!("{}: must be in [0, 1]", self.caption_dropout),
        );
        if v.iter().all(|p| {
            !matches!(
                p.key,
                "data.bucket_step" | "data.resolution" | "data.max_aspect"
            )
        }) {
            if let Err(e) = super::bucket::buckets(&BucketConfig {
                resolution: self.resolution,
                step: self.bucket_step,
                max_aspect: self.max_aspect,
            }) {
                let why = match e {
                    Error::Config { msg, .. } => msg,
                    other => other.to_string(),
                };
                v.push(Problem {
                    key: "data.max_aspect",
                    msg: format!("{}: {why}", self.max_aspect),
                });
            }
        }
        v.extend(in_list("data.crop", &self.crop, &["center", "random"]));
        v.extend(in_list(
            "data.resample",
            &self.resample,
            &["lanczos3", "catmullrom"],
        ));
        v.extend(in_list(
            "data.on_bad_file",
            &self.on_bad_file,
            &["skip", "stop"],
        ));
        v
    }

    /// The first problem as an error (no file, no line); Ok when every check passes.
    pub fn validate(&self) -> Result<()> {
        match self.problems().into_iter().next() {
            None => Ok(()),
            Some(p) => Err(Error::Config {
                path: None,
                msg: format!("{} = {}", p.key, p.msg),
            }),
        }
    }

    /// The dataset options of this config with the run's `seed`; checks it first.
    pub fn options(&self, seed: u64) -> Result<DatasetOptions> {
        self.validate()?;
        let sources = match &self.manifest {
            Some(path) => vec![Source::Manifest {
                path: path.clone(),
                repeats: self.manifest_repeats,
            }],
            None => self
                .dirs
                .iter()
                .map(|d| Source::Folder {
                    dir: d.path.clone(),
                    repeats: d.repeats,
                })
                .collect(),
        };
        Ok(DatasetOptions {
            sources,
            buckets: BucketConfig {
                resolution: self.resolution,
                step: self.bucket_step,
                max_aspect: self.max_aspect,
            },
            crop: match self.crop.as_str() {
                "random" => CropMode::Random,
                _ => CropMode::Center,
            },
            flip: self.flip,
            resample: match self.resample.as_str() {
                "catmullrom" => Resample::CatmullRom,
                _ => Resample::Lanczos3,
            },
            captions: CaptionOptions {
                dropout: self.caption_dropout,
                shuffle_tags: self.shuffle_tags,
                keep_tokens: self.keep_tokens,
            },
            on_bad_file: match self.on_bad_file.as_str() {
                "skip" => OnBadFile::Skip,
                _ => OnBadFile::Stop,
            },
            seed,
        })
    }
}

/// The line of a key written as a table of arrays (`[[data.dirs]]`): its first header.
fn table_line(text: &str, key: &str) -> Option<usize> {
    let header = format!("[[{key}]]");
    text.lines()
        .position(|l| l.trim().replace(' ', "") == header)
        .map(|i| i + 1)
}
