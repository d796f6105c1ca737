//! Reference images of edit training and sampling (FLUX.2 \[klein\]): the pictures a target
//! image was made from, encoded by the autoencoder as the target is and given to the model as
//! tokens of their own ([`crate::models::DiffusionModel::predict_with_references`]).
//!
//! Every reference goes through the size rules of diffusers 0.42.1's
//! `Flux2KleinPipeline.__call__` (step 4, "process images"), so that a model trained on them
//! sees what the pipeline gives it at inference:
//! - `Flux2ImageProcessor.check_image_input`: both sides at least [`MIN_SIDE`] pixels, the
//!   aspect ratio at most [`MAX_ASPECT`]:1; another picture is refused (a bad file);
//! - a picture of more than [`PIPELINE_MAX_PIXELS`] pixels (the pipeline's `1024 * 1024`) is
//!   resized to that area (`_resize_to_target_area`: scale s = sqrt(area / (w h)), sides
//!   `int(w s)`, `int(h s)`, PIL's Lanczos), a smaller one is kept as it is;
//! - each side is floored to a multiple of the autoencoder's factor with its 2x2 patches
//!   (`multiple_of = vae_scale_factor * 2`: 16 for FLUX.2's autoencoder), and the picture
//!   cropped to that at its centre (`Flux2ImageProcessor._resize_and_crop`: left
//!   `(W - w) // 2`, top `(H - h) // 2`; no resize there), then scaled to [-1, 1].
//!
//! [`ReferenceOptions::max_pixels`] replaces the pipeline's area where a run wants smaller
//! references (`data.reference_resolution`, musubi-tuner's `control_resolution`); its default
//! is the pipeline's. A reference is mirrored with its target when the target is.

use super::bucket::{self, Bucket, Geometry, Resample};
use super::data_err;
use crate::{Device, Result, Tensor};
use std::path::Path;

/// The most pixels a reference keeps before it is scaled down (diffusers 0.42.1
/// `Flux2KleinPipeline.__call__`: `if image_width * image_height > 1024 * 1024`).
pub const PIPELINE_MAX_PIXELS: usize = 1024 * 1024;

/// The shortest side a reference may have (`Flux2ImageProcessor.check_image_input`'s
/// `min_side_length=64`).
pub const MIN_SIDE: usize = 64;

/// The largest aspect ratio of a reference (`check_image_input`'s `max_aspect_ratio=8`).
pub const MAX_ASPECT: f64 = 8.0;

/// The resize filter of references (`_resize_to_target_area`: `PIL.Image.Resampling.LANCZOS`),
/// whatever `data.resample` says for the targets.
pub const RESAMPLE: Resample = Resample::Lanczos3;

/// How references are sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceOptions {
    /// Pictures of more pixels are scaled down to this area ([`PIPELINE_MAX_PIXELS`] by
    /// default).
    pub max_pixels: usize,
    /// Sides are floored to multiples of this: the autoencoder's downscale times its 2x2
    /// patches (16 for FLUX.2; the run sets it from the autoencoder it loads).
    pub multiple: usize,
}

impl Default for ReferenceOptions {
    fn default() -> Self {
        ReferenceOptions {
            max_pixels: PIPELINE_MAX_PIXELS,
            multiple: 16,
        }
    }
}

/// Why a `width` x `height` picture cannot be a reference (`check_image_input`'s rules), or
/// `None`.
pub fn unfit(width: usize, height: usize) -> Option<String> {
    if width < MIN_SIDE || height < MIN_SIDE {
        return Some(format!(
            "{width}x{height} pixels: a reference needs both sides of at least {MIN_SIDE} \
             (Flux2ImageProcessor.check_image_input)"
        ));
    }
    let ratio = width.max(height) as f64 / width.min(height) as f64;
    if ratio > MAX_ASPECT {
        return Some(format!(
            "{width}x{height} pixels: a reference's aspect ratio must be at most {MAX_ASPECT}:1 \
             (Flux2ImageProcessor.check_image_input)"
        ));
    }
    None
}

/// The size a `width` x `height` picture is resized to before its crop: itself when it holds
/// at most `max_pixels`, else (`int(w s)`, `int(h s)`) with s = sqrt(max_pixels / (w h))
/// (`Flux2ImageProcessor._resize_to_target_area`).
pub fn resized_size(width: usize, height: usize, max_pixels: usize) -> (usize, usize) {
    if width.saturating_mul(height) <= max_pixels {
        return (width, height);
    }
    let s = (max_pixels as f64 / (width as f64 * height as f64)).sqrt();
    ((width as f64 * s) as usize, (height as f64 * s) as usize)
}

/// A reference's way into the model (module docs): the resize and the centred crop as a
/// [`Geometry`] (its `bucket` the crop's size). `Err` says why the picture cannot be one.
pub fn geometry(
    width: usize,
    height: usize,
    opts: &ReferenceOptions,
) -> std::result::Result<Geometry, String> {
    if let Some(why) = unfit(width, height) {
        return Err(why);
    }
    let m = opts.multiple.max(1);
    let (rw, rh) = resized_size(width, height, opts.max_pixels);
    let (cw, ch) = ((rw / m) * m, (rh / m) * m);
    if cw == 0 || ch == 0 {
        return Err(format!(
            "{width}x{height} pixels: resized to {rw}x{rh}, no side of a multiple of {m} is \
             left (a larger data.reference_resolution keeps more)"
        ));
    }
    Ok(Geometry {
        orig_width: width,
        orig_height: height,
        resized_width: rw,
        resized_height: rh,
        bucket: Bucket {
            width: cw,
            height: ch,
        },
        left: (rw - cw) / 2,
        top: (rh - ch) / 2,
    })
}

/// The reference picture at `path` as the model's autoencoder takes it: decoded, sized by
/// `opts` (module docs), mirrored when `flip`, a (3, h, w) f32 tensor in [-1, 1] on
/// `device`. Errors name the file.
pub fn load(path: &Path, opts: &ReferenceOptions, flip: bool, device: &Device) -> Result<Tensor> {
    let img = bucket::decode(path).map_err(|why| data_err(path, why))?;
    let geo = geometry(img.width() as usize, img.height() as usize, opts)
        .map_err(|why| data_err(path, why))?;
    bucket::to_tensor(&img, &geo, RESAMPLE, flip, path, device)
}
