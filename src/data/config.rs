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
//!
//! A `data.dirs` folder laid out for kohya's sd-scripts, with its images in subfolders
//! named `<repeats>_<name>` (`images/10_mychar/`, `images/3_style/`), is read as it is:
//! each such subfolder's images appear its number times the entry's `repeats` an epoch.
//!
//! Edit training (FLUX.2 \[klein\]): a `data.dirs` entry's `references` names folders of
//! reference images, each holding an image of the same name for every target (ai-toolkit's
//! `control_path`, one folder per reference):
//!
//! ```toml
//! [[data.dirs]]
//! path = "edits/target"             # the edited pictures, with the instruction as caption
//! references = ["edits/control"]    # edits/control/<same name>.* is each one's reference
//! ```

use super::bucket::{BucketConfig, CropMode, Resample};
use super::caption::CaptionOptions;
use super::dataset::DatasetOptions;
use super::reference::ReferenceOptions;
use super::source::{OnBadFile, Source};
use crate::config::{problem_lines, section, Problem};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One image folder of `data.dirs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirEntry {
    /// The folder: images (png, jpg, jpeg, webp) with a `.txt` caption beside each. Its
    /// subfolders named `<repeats>_<name>` (kohya's convention: `10_mychar`, `3_style`) are
    /// read too, their images appearing that number times `repeats`; other subfolders are
    /// not searched.
    pub path: PathBuf,
    /// Times each of its images appears in an epoch, >= 1 (multiplied by a
    /// `<repeats>_<name>` subfolder's number for that subfolder's images).
    #[serde(default = "one")]
    pub repeats: usize,
    /// Folders of reference images (edit training, FLUX.2 \[klein\]; ai-toolkit's
    /// `control_path`): reference i of each image is the image of the same name (any of
    /// png, jpg, jpeg, webp) in folder i. Empty: none.
    #[serde(default)]
    pub references: Vec<PathBuf>,
}

fn one() -> usize {
    1
}

section! {
    /// `[data]`: the training samples: images with captions (`dirs` or `manifest`, encoded
    /// and cached before training), or pre-encoded samples (`dir`).
    DataSection / RawData = "data" {
        /// Pre-encoded samples instead of images: a folder of .safetensors files, one per
        /// sample, holding the tensors the model family needs (Flux: latents, context,
        /// pooled; SDXL adds time_ids).
        dir: Option<PathBuf> = None,
        /// Image folders, each a `[[data.dirs]]` table with `path` (images: png, jpg, jpeg,
        /// webp, with a .txt caption beside each; subfolders named `<repeats>_<name>`,
        /// kohya's layout, are read too, their images repeated that number times `repeats`;
        /// other subfolders are not searched), `repeats` (times each image appears in an
        /// epoch, default 1) and `references` (edit training, FLUX.2 klein only: folders of
        /// reference images, ai-toolkit's control_path; reference i of an image is the image
        /// of the same name, any extension, in folder i; a missing one is a bad file naming
        /// both; default []). Captions in UTF-8 (a byte-order mark is dropped) or UTF-16
        /// with its mark; other bytes are read as Windows-1252, with a note.
        dirs: Vec<DirEntry> = Vec::<DirEntry>::new(),
        /// A JSONL manifest of `{"file": ..., "caption": ...}` lines instead of `dirs`
        /// (`file` relative to the manifest; musubi-tuner's `image_path` is read as `file`).
        /// Edit training (FLUX.2 klein only): a line lists its reference images as
        /// `"references": [...]`, or musubi-tuner's `"control_path"` (a path or a list) or
        /// `"control_path_0"`, `"control_path_1"`, ..., relative to the manifest.
        manifest: Option<PathBuf> = None,
        /// Repeats of every manifest image, >= 1.
        manifest_repeats: usize = 1_usize,
        /// The target resolution R: aspect-ratio buckets hold at most R² pixels. Images whose
        /// shorter side is under R/4, or with an aspect ratio over 4:1, are bad files
        /// (`data.on_bad_file`).
        resolution: usize = 1024_usize,
        /// Bucket sides are multiples of this, > 0 and at most `resolution`.
        bucket_step: usize = 64_usize,
        /// The largest bucket aspect ratio (long side / short side), >= 1.
        max_aspect: f64 = 2.0,
        /// "center" or "random" (seeded, one offset per sample and repeat).
        crop: CropMode = CropMode::Center,
        /// Mirror samples at random (seeded per epoch); SDXL's crop left is mirrored with them.
        flip: bool = false,
        /// The resize filter: "lanczos3" or "catmullrom".
        resample: Resample = Resample::Lanczos3,
        /// Probability in [0, 1] that a sample trains on the empty caption.
        caption_dropout: f64 = 0.0,
        /// Shuffle the comma-separated tags of each caption every epoch.
        shuffle_tags: bool = false,
        /// With shuffle_tags, this many leading tags keep their place.
        keep_tokens: usize = 0_usize,
        /// An unreadable image or a missing caption: "skip" (reported, left out) or "stop".
        on_bad_file: OnBadFile = OnBadFile::Stop,
        /// Where latents and text embeddings are cached (default: `cache` in
        /// train.output_dir). Entries are keyed by content, so a changed image, caption,
        /// resolution or encoder recomputes only what it changes.
        cache_dir: Option<PathBuf> = None,
        /// The fraction of images, in [0, 1), held out for the validation loss (chosen by
        /// file name and seed, so the split is stable when images are added).
        validation_split: f64 = 0.0,
        /// A folder of images with captions for the validation loss, instead of a split.
        validation_dir: Option<PathBuf> = None,
        /// Edit training: the reference folders of validation_dir's images, as a data.dirs
        /// entry's references (held-out images of a split keep their own references).
        validation_references: Vec<PathBuf> = Vec::<PathBuf>::new(),
        /// Edit training: reference images of more than R² pixels are scaled down to that
        /// area before their sides are floored to multiples of 16 and centre-cropped, as
        /// diffusers' Flux2KleinPipeline sizes its `image` (its R is 1024, the default;
        /// musubi-tuner's control_resolution). References of fewer pixels keep their size;
        /// each reference needs both sides of at least 64 pixels and an aspect ratio of at
        /// most 8:1 (the pipeline's check).
        reference_resolution: usize = 1024_usize,
        /// Masked loss from a mask file beside each image (kohya's masked_loss, with
        /// OneTrainer's naming): `<name>-masklabel.png` beside `<name>.png` (or .jpg, ...),
        /// read as grey levels (0 black: no loss, 1 white: full loss); an image without one
        /// trains unmasked. Files named `*-masklabel.*` are never training images. The mask
        /// is resized, cropped and mirrored with its image, averaged over each latent cell
        /// (the autoencoder's factor, as kohya's area interpolation) and cached with the
        /// latents (a changed mask recomputes its entries); each element's loss is
        /// multiplied by it and averaged over all elements (kohya's: not divided by the
        /// mask's sum).
        masked_loss: bool = false,
        /// Masked loss from each image's alpha channel instead (kohya's alpha_mask: 0 no
        /// loss, 1 full loss; an image without alpha trains unmasked).
        alpha_mask: bool = false,
        /// Regularisation (prior-preservation) images, `[[data.reg_dirs]]` tables as in
        /// data.dirs (kohya's reg_data_dir, `<repeats>_<name>` subfolders included): cached
        /// and bucketed with the training images and mixed into their batches. As kohya's
        /// DreamBoothDataset, their repeats are raised to match the training images with
        /// repeats N: each reg image (in scan order) joins with its repeats until they add
        /// up to N, and when all have joined and the sum is still under N, one more repeat
        /// each in turn until it reaches N; reg images past that point are left out.
        reg_dirs: Vec<DirEntry> = Vec::<DirEntry>::new(),
        /// The loss of a regularisation sample is multiplied by this, >= 0 (kohya's and
        /// diffusers' prior_loss_weight).
        prior_loss_weight: f64 = 1.0,
    }
}

/// The `[data]` table: images with captions or pre-encoded samples.
pub type DataConfig = DataSection;

/// A document holding the `[data]` table (other tables are not read).
#[derive(Deserialize)]
struct Doc {
    #[serde(default)]
    data: RawData,
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
        let mut problems = vec![];
        let finished = doc.data.finish(&mut problems).map_err(bad)?;
        let report = |problems: &[Problem]| bad(problem_lines(text, problems));
        let Some(mut c) = finished else {
            return Err(report(&problems));
        };
        if let Some(base) = path.and_then(Path::parent) {
            let paths = c
                .dirs
                .iter_mut()
                .chain(c.reg_dirs.iter_mut())
                .flat_map(|d| std::iter::once(&mut d.path).chain(d.references.iter_mut()))
                .chain(c.validation_references.iter_mut())
                .chain(c.manifest.as_mut())
                .chain(c.cache_dir.as_mut())
                .chain(c.dir.as_mut())
                .chain(c.validation_dir.as_mut());
            for p in paths {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        problems.extend(c.problems());
        if problems.is_empty() {
            return Ok(c);
        }
        Err(report(&problems))
    }

    /// Every problem of the values, each naming its key; empty when all pass.
    pub fn problems(&self) -> Vec<Problem> {
        let mut v = vec![];
        let mut check = |ok: bool, key: &'static str, msg: String| {
            if !ok {
                v.push(Problem { key, msg });
            }
        };
        let sources = [
            !self.dirs.is_empty(),
            self.manifest.is_some(),
            self.dir.is_some(),
        ];
        check(
            sources.iter().filter(|&&s| s).count() == 1,
            "data.dirs",
            match (sources[0], sources[1], sources[2]) {
                (false, false, false) => "no image source: give data.dirs or data.manifest \
                                          (or data.dir for pre-encoded samples)"
                    .into(),
                (true, true, _) => "both data.dirs and data.manifest are given: use one".into(),
                _ => "data.dir (pre-encoded samples) and an image source are both given: use \
                      one"
                .into(),
            },
        );
        check(
            (0.0..1.0).contains(&self.validation_split),
            "data.validation_split",
            format!("{}: must be in [0, 1)", self.validation_split),
        );
        check(
            self.validation_split == 0.0 || self.validation_dir.is_none(),
            "data.validation_split",
            "both data.validation_split and data.validation_dir are given: use one".into(),
        );
        check(
            self.dir.is_none() || (self.validation_split == 0.0 && self.validation_dir.is_none()),
            "data.validation_split",
            "validation needs images (data.dirs or data.manifest), not data.dir".into(),
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
        for (i, d) in self.reg_dirs.iter().enumerate() {
            check(
                d.repeats >= 1,
                "data.reg_dirs",
                format!(
                    "entry {} ({}): repeats = 0, must be >= 1",
                    i + 1,
                    d.path.display()
                ),
            );
        }
        check(
            self.validation_references.is_empty() || self.validation_dir.is_some(),
            "data.validation_references",
            "reference folders for data.validation_dir, which is not given (held-out images \
             of data.validation_split keep their own references)"
                .into(),
        );
        check(
            self.reference_resolution >= 64,
            "data.reference_resolution",
            format!(
                "{}: must be at least 64 (references need sides of 64 pixels)",
                self.reference_resolution
            ),
        );
        check(
            self.dir.is_none() || !self.dirs.iter().any(|d| !d.references.is_empty()),
            "data.dirs",
            "reference images need image data, not data.dir".into(),
        );
        check(
            self.prior_loss_weight.is_finite() && self.prior_loss_weight >= 0.0,
            "data.prior_loss_weight",
            format!("{}: must be finite and >= 0", self.prior_loss_weight),
        );
        check(
            !(self.masked_loss && self.alpha_mask),
            "data.alpha_mask",
            "both data.masked_loss (mask files) and data.alpha_mask (alpha channels) are \
             set: use one"
                .into(),
        );
        check(
            self.dir.is_none() || !(self.masked_loss || self.alpha_mask),
            "data.masked_loss",
            "masks need images (data.dirs or data.manifest), not data.dir".into(),
        );
        check(
            self.dir.is_none() || self.reg_dirs.is_empty(),
            "data.reg_dirs",
            "regularisation images need image data (data.dirs or data.manifest), not data.dir"
                .into(),
        );
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

    /// Whether reference images (edit training) are named in the config: a `data.dirs` or
    /// `data.reg_dirs` entry's `references`, or `data.validation_references` (a manifest's
    /// lines are read at the scan). The key that names them, if any.
    pub fn reference_key(&self) -> Option<&'static str> {
        if self.dirs.iter().any(|d| !d.references.is_empty()) {
            Some("data.dirs")
        } else if self.reg_dirs.iter().any(|d| !d.references.is_empty()) {
            Some("data.reg_dirs")
        } else if !self.validation_references.is_empty() {
            Some("data.validation_references")
        } else {
            None
        }
    }

    /// Whether the samples are images (`dirs` or `manifest`), not pre-encoded (`dir`).
    pub fn images(&self) -> bool {
        self.dir.is_none()
    }

    /// The dataset options of this config with the run's `seed`; checks it first.
    pub fn options(&self, seed: u64) -> Result<DatasetOptions> {
        self.validate()?;
        if let Some(dir) = &self.dir {
            return Err(super::data_err(
                dir,
                "data.dir holds pre-encoded samples, not images",
            ));
        }
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
                    references: d.references.clone(),
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
            crop: self.crop,
            flip: self.flip,
            resample: self.resample,
            captions: CaptionOptions {
                dropout: self.caption_dropout,
                shuffle_tags: self.shuffle_tags,
                keep_tokens: self.keep_tokens,
            },
            on_bad_file: self.on_bad_file,
            seed,
            references: ReferenceOptions {
                max_pixels: self
                    .reference_resolution
                    .saturating_mul(self.reference_resolution),
                ..ReferenceOptions::default()
            },
        })
    }
}
