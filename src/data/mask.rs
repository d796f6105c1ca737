//! Loss masks: one per image, from a file beside it (OneTrainer's `<name>-masklabel.png`,
//! with kohya's `masked_loss` meaning) or from the image's alpha channel (kohya's
//! `alpha_mask`), in [0, 1] (0: no loss, 1: full loss). A mask is resized, cropped and
//! mirrored exactly as its image ([`super::bucket::to_tensor`], the same filter and
//! geometry), then averaged over each cell of the latent grid, `factor` x `factor` pixels
//! (kohya's `interpolate(mode="area")` to the latent size, which for a whole factor is
//! that mean): a (1, H / factor, W / factor) tensor stored with the latents
//! ([`super::LatentCache::with_masks`]).

use super::bucket::{self, Geometry, Resample};
use crate::{Device, Tensor};
use std::path::{Path, PathBuf};

/// Where masks come from (`data.masked_loss`, `data.alpha_mask`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskSource {
    /// `<name>-masklabel.png` beside the image; an image without one is unmasked.
    File,
    /// The image's alpha channel; an image without alpha is unmasked.
    Alpha,
}

/// The suffix of a mask file's stem (OneTrainer's).
pub const MASK_SUFFIX: &str = "-masklabel";

/// The mask file of `image`: `<dir>/<stem>-masklabel.png`.
pub fn mask_file(image: &Path) -> PathBuf {
    let stem = image
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    image.with_file_name(format!("{stem}{MASK_SUFFIX}.png"))
}

/// Whether `path` is a mask file (its stem ends in `-masklabel`): never a training image.
pub fn is_mask_file(path: &Path) -> bool {
    path.file_stem()
        .and_then(|s| s.to_str())
        .is_some_and(|s| s.ends_with(MASK_SUFFIX))
}

/// The mask of `image` as grey levels in [0, 1] (all channels equal), or `None` where the
/// image has none (no mask file; no alpha channel). Errors say why a mask cannot be read.
fn decode(
    image: &Path,
    source: MaskSource,
) -> std::result::Result<Option<image::Rgb32FImage>, String> {
    let (path, what) = match source {
        MaskSource::File => {
            let m = mask_file(image);
            if !m.is_file() {
                return Ok(None);
            }
            (m, "mask")
        }
        MaskSource::Alpha => (image.to_path_buf(), "image"),
    };
    let img = image::ImageReader::open(&path)
        .map_err(|e| format!("cannot open the {what} {}: {e}", path.display()))?
        .with_guessed_format()
        .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))?
        .decode()
        .map_err(|e| format!("cannot decode the {what} {}: {e}", path.display()))?;
    let grey: Vec<f32> = match source {
        MaskSource::File => img.to_luma32f().into_raw(),
        MaskSource::Alpha if img.color().has_alpha() => {
            img.to_rgba32f().pixels().map(|p| p.0[3]).collect()
        }
        MaskSource::Alpha => return Ok(None),
    };
    let rgb: Vec<f32> = grey.iter().flat_map(|&g| [g, g, g]).collect();
    image::Rgb32FImage::from_raw(img.width(), img.height(), rgb)
        .map(Some)
        .ok_or_else(|| format!("the {what} {} has no pixels", path.display()))
}

/// The mean of each `f` x `f` cell of planes `h` x `w` (h and w multiples of f).
pub fn area_pool(v: &[f32], h: usize, w: usize, f: usize) -> Vec<f32> {
    let (oh, ow) = (h / f, w / f);
    let mut out = vec![0f32; oh * ow];
    for (y, row) in out.chunks_mut(ow.max(1)).enumerate().take(oh) {
        for (x, o) in row.iter_mut().enumerate() {
            let mut s = 0f64;
            for dy in 0..f {
                for dx in 0..f {
                    s += v[(y * f + dy) * w + x * f + dx] as f64;
                }
            }
            *o = (s / (f * f) as f64) as f32;
        }
    }
    out
}

/// The loss mask of `image` for a sample of geometry `geo` (mirrored when `flip`), on the
/// latent grid of the autoencoder's `factor`: (1, bucket height / factor, bucket width /
/// factor) in [0, 1] on `device`; ones where the image has no mask. `Err` says why the
/// mask cannot be used (unreadable, or a size other than the image's), for the caller to
/// treat as a bad file.
pub fn mask_tensor(
    image: &Path,
    source: MaskSource,
    geo: &Geometry,
    resample: Resample,
    flip: bool,
    factor: usize,
    device: &Device,
) -> std::result::Result<Tensor, String> {
    let (bw, bh) = (geo.bucket.width, geo.bucket.height);
    let f = factor.max(1);
    if bw % f != 0 || bh % f != 0 {
        return Err(format!(
            "the {bw}x{bh} bucket is not a whole number of {f}-pixel latent cells"
        ));
    }
    let (h, w) = (bh / f, bw / f);
    let Some(img) = decode(image, source)? else {
        return Tensor::ones((1, h, w), crate::DType::F32, device).map_err(|e| e.to_string());
    };
    let path = match source {
        MaskSource::File => mask_file(image),
        MaskSource::Alpha => image.to_path_buf(),
    };
    if (img.width() as usize, img.height() as usize) != (geo.orig_width, geo.orig_height) {
        return Err(format!(
            "the mask {} is {}x{}, its image {}x{}",
            path.display(),
            img.width(),
            img.height(),
            geo.orig_width,
            geo.orig_height
        ));
    }
    let pixels = bucket::to_tensor(&img, geo, resample, flip, &path, device)
        .and_then(|t| t.narrow(0, 0, 1)?.to_vec::<f32>())
        .map_err(|e| e.to_string())?;
    // to_tensor maps [0, 1] to [-1, 1]; back, clamped (a resize filter can overshoot).
    let grey: Vec<f32> = pixels
        .iter()
        .map(|&v| ((v + 1.0) * 0.5).clamp(0.0, 1.0))
        .collect();
    Tensor::from_vec(area_pool(&grey, bh, bw, f), (1, h, w), device).map_err(|e| e.to_string())
}
