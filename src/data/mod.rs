//! Training images and captions, from files on disk to the tensors a training step takes.
//!
//! - [`source`]: folders of images (png, jpg, webp) with a `.txt` caption beside each, or a
//!   JSONL manifest; several sources, each with a `repeats` count. A folder's subfolders
//!   named `<repeats>_<name>` (`10_mychar`, kohya's sd-scripts convention) are scanned too,
//!   their images repeated that number times the folder's `repeats`; other subfolders are
//!   not. Captions in UTF-8 (with or without a byte-order mark), UTF-16 with its
//!   byte-order mark, or else Windows-1252 (noted in [`Scan::notes`]). Bad files reported
//!   by name and skipped or fatal ([`OnBadFile`]).
//! - [`bucket`]: aspect-ratio buckets at a target resolution, each image's resize and crop
//!   ([`Geometry`], with SDXL's micro-conditioning numbers), image files to (3, H, W) f32
//!   tensors in [-1, 1]. Images under a quarter of the resolution on their shorter side or
//!   beyond 4:1 are bad files ([`bucket::unfit`]).
//! - [`caption`]: caption dropout and tag shuffling with `keep_tokens`.
//! - [`Dataset`] ties them together; [`BatchSampler`] draws batches from one bucket at a
//!   time, as a function of (seed, epoch) alone, so a resumed run repeats them.
//! - [`cache`]: latents and text embeddings on disk, keyed by content hashes, filled by a
//!   caller's encoder and read back batch by batch.
//! - [`mask`]: loss masks from `<name>-masklabel.png` files or alpha channels, on the
//!   latent grid, cached with the latents.
//! - [`reference`](mod@reference): reference images of edit training (FLUX.2 \[klein\]), sized as
//!   diffusers' Flux2KleinPipeline sizes them, cached as latents of their own.
//! - [`png`]: images and the loss plot (axis titles, tick labels and a legend in a built-in
//!   5x7 pixel font) written as PNG files, atomically.
//! - [`config`]: the `[data]` table of the train config.
//!
//! Every random choice (crop, flip, caption dropout, tag order, batch order) is a function
//! of the seed, the epoch and a sample's stable id (its file name and repeat), never of a
//! global random stream: the same seed gives the same data, and adding an image does not
//! change what the other images get.

pub mod bucket;
pub mod cache;
pub mod caption;
pub mod config;
mod dataset;
pub mod mask;
pub mod png;
pub mod reference;
pub mod source;

pub use bucket::{buckets, Bucket, BucketConfig, CropMode, Geometry, Resample};
pub use cache::{FillReport, LatentCache, Progress, TextCache, LOSS_MASK};
pub use caption::CaptionOptions;
pub use config::{DataConfig, DirEntry};
pub use dataset::{reg_repeats, BatchSampler, Dataset, DatasetOptions, Sample};
pub use mask::MaskSource;
pub use png::{plot_loss, save_png};
pub use reference::ReferenceOptions;
pub use source::{scan, scan_for, BadFile, Item, OnBadFile, Reference, Scan, Source};

use crate::nn::{key_hash, mix64, GOLDEN};
use crate::Error;
use std::path::Path;

/// A well-mixed 64-bit draw from `seed` and a list of parts (epoch, sample id, purpose):
/// splitmix64 applied over the parts in turn.
pub(crate) fn draw(seed: u64, parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(mix64(seed.wrapping_add(GOLDEN)), |h, &p| {
            mix64(h ^ p.wrapping_add(GOLDEN))
        })
}

/// A uniform number in [0, 1) from a 64-bit draw (its top 53 bits).
pub(crate) fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The purpose of a draw, as a part of [`draw`]: different purposes give independent draws.
pub(crate) fn purpose(name: &str) -> u64 {
    key_hash(name)
}

/// An [`Error::Data`] naming `path`.
pub(crate) fn data_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Data {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// An [`Error::Io`] for `path`.
pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, then renamed
/// into place, so a crash never leaves a half-written file under the real name.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> crate::Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .and_then(|()| crate::fault::point(&format!("write:{name}")))
            .map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
