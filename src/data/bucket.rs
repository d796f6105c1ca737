//! Aspect-ratio buckets and each image's way into one.
//!
//! The buckets of a resolution R (step s, aspect cap A) are every (W, H) with both sides
//! positive multiples of s, W·H ≤ R², and for each width the largest such height (each
//! bucket as large as the area allows), with max(W/H, H/W) ≤ A, and each one's transpose
//! (kohya's `make_bucket_resolutions`: without it, the tall side would lack the buckets
//! that the rounding gives the wide side); they are sorted by W/H. An image of (w, h) goes to the bucket whose ln(W/H) is closest to ln(w/h)
//! (the first on a tie), is resized by max(W/w, H/h) so that it covers the bucket (the
//! resized sides rounded, at least W and H), then cropped to W x H at its centre or at a
//! seeded random offset, and optionally mirrored.
//!
//! Images unfit for bucketing ([`unfit`]): a shorter side under a quarter of the
//! resolution, or an aspect ratio over 4:1 (or the buckets' cap, when larger). The scan of
//! a dataset ([`crate::data::source::scan_for`]) reports them as bad files.
//!
//! SDXL conditions on (original height, original width, crop top, crop left, target height,
//! target width) ([`Geometry::time_ids`]): the crop offset is in the resized image's pixels;
//! for a mirrored sample the left offset is the crop's left edge in the mirrored resized
//! image (resized width − W − left), so the numbers describe the pixels the model sees.

use super::{data_err, draw, purpose, unit};
use crate::{Device, Result, Tensor};
use image::imageops::FilterType;
use std::path::Path;

/// How buckets are made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketConfig {
    /// The target resolution R: every bucket's area is at most R².
    pub resolution: usize,
    /// Bucket sides are multiples of this (64 by default: 8x the VAE's downsampling of 8
    /// gives latents whose sides are multiples of 8).
    pub step: usize,
    /// The largest aspect ratio max(W/H, H/W) of a bucket, >= 1.
    pub max_aspect: f64,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            resolution: 1024,
            step: 64,
            max_aspect: 2.0,
        }
    }
}

/// A bucket's size in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket {
    /// Width.
    pub width: usize,
    /// Height.
    pub height: usize,
}

impl Bucket {
    fn ln_aspect(self) -> f64 {
        (self.width as f64 / self.height as f64).ln()
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}

/// The buckets of `cfg`, sorted by aspect ratio W/H (module doc). An error when the
/// config admits none (a resolution below the step, a step of 0, an aspect cap below 1).
pub fn buckets(cfg: &BucketConfig) -> Result<Vec<Bucket>> {
    let BucketConfig {
        resolution: r,
        step: s,
        max_aspect: a,
    } = *cfg;
    let bad = |msg: String| crate::Error::Config { path: None, msg };
    if s == 0 || r < s {
        return Err(bad(format!(
            "buckets: resolution {r} and step {s}: need a step >= 1 and a resolution >= the step"
        )));
    }
    if !(a.is_finite() && a >= 1.0) {
        return Err(bad(format!(
            "buckets: max_aspect {a}: must be finite and >= 1"
        )));
    }
    let area = r * r;
    let longest = ((r as f64 * a.sqrt()) as usize).max(s);
    let mut out = vec![];
    let mut w = s;
    while w <= longest {
        let h = (area / w) / s * s;
        let b = Bucket {
            width: w,
            height: h,
        };
        if h >= s && h <= longest && b.ln_aspect().abs() <= a.ln() + 1e-12 {
            out.push(b);
            out.push(Bucket {
                width: h,
                height: w,
            });
        }
        w += s;
    }
    out.sort_by(|x, y| x.ln_aspect().total_cmp(&y.ln_aspect()));
    out.dedup();
    if out.is_empty() {
        return Err(bad(format!(
            "buckets: no bucket at resolution {r}, step {s}, max_aspect {a}"
        )));
    }
    Ok(out)
}

/// The aspect ratio beyond which an image is not bucketed, whatever the buckets' own cap
/// (a larger [`BucketConfig::max_aspect`] raises it).
pub const MAX_IMAGE_ASPECT: f64 = 4.0;

/// `x` with at most `digits` decimals, trailing zeros dropped.
fn short(x: f64, digits: usize) -> String {
    let s = format!("{x:.digits$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// Why a `width` x `height` image is unfit for the buckets of `cfg`, or `None` when it is
/// fit: its shorter side is under a quarter of `cfg.resolution` (so small that the resize
/// would mostly invent its pixels), or its aspect ratio max(w/h, h/w) is over
/// [`MAX_IMAGE_ASPECT`] (or `cfg.max_aspect`, when larger): such a strip loses most of its
/// pixels to the crop. The reason starts with the size and names each limit that is passed, e.g. "8x8 pixels: the
/// shorter side is under 16 (a quarter of data.resolution = 64)".
pub fn unfit(width: usize, height: usize, cfg: &BucketConfig) -> Option<String> {
    let (long, short_side) = (width.max(height), width.min(height));
    let mut why = vec![];
    let max_aspect = cfg.max_aspect.max(MAX_IMAGE_ASPECT);
    let ratio = long as f64 / short_side.max(1) as f64;
    if ratio > max_aspect {
        let mut r = short(ratio, 2);
        if r.parse::<f64>().is_ok_and(|x| x <= max_aspect) {
            r = short(ratio, 6);
        }
        let shape = match width >= height {
            true => format!("{r}:1"),
            false => format!("1:{r}"),
        };
        why.push(format!(
            "a {shape} strip: aspect ratios over {}:1 are not bucketed",
            short(max_aspect, 2)
        ));
    }
    if short_side.saturating_mul(4) < cfg.resolution {
        why.push(format!(
            "the shorter side is under {} (a quarter of data.resolution = {})",
            cfg.resolution.div_ceil(4),
            cfg.resolution
        ));
    }
    match why.is_empty() {
        true => None,
        false => Some(format!("{width}x{height} pixels: {}", why.join("; "))),
    }
}

/// The bucket of `buckets` whose aspect ratio is closest to `width / height` in log scale;
/// the first on a tie. `None` when `buckets` is empty or a side is 0.
pub fn closest(buckets: &[Bucket], width: usize, height: usize) -> Option<Bucket> {
    if width == 0 || height == 0 {
        return None;
    }
    let target = (width as f64 / height as f64).ln();
    let mut best: Option<(f64, Bucket)> = None;
    for &b in buckets {
        let d = (b.ln_aspect() - target).abs();
        if best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, b));
        }
    }
    best.map(|(_, b)| b)
}

/// Where the crop of an image lies in its resized copy ("center" or "random" in a config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CropMode {
    /// At the centre (the margin's floor half on the top and left).
    #[default]
    Center,
    /// At a seeded offset, uniform over the valid ones, drawn once per sample.
    Random,
}

/// The resampling filter of the resize ("lanczos3" or "catmullrom" in a config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Resample {
    /// Lanczos with a = 3 (PIL's `LANCZOS`).
    #[default]
    Lanczos3,
    /// Catmull-Rom cubic (PIL's `BICUBIC`, a = -0.5).
    CatmullRom,
}

impl Resample {
    fn filter(self) -> FilterType {
        match self {
            Resample::Lanczos3 => FilterType::Lanczos3,
            Resample::CatmullRom => FilterType::CatmullRom,
        }
    }

    /// Its name in configs and cache keys ("lanczos3", "catmullrom").
    pub fn name(self) -> &'static str {
        match self {
            Resample::Lanczos3 => "lanczos3",
            Resample::CatmullRom => "catmullrom",
        }
    }
}

/// An image's way into its bucket: original size, resized size and crop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// The image's width as stored.
    pub orig_width: usize,
    /// The image's height as stored.
    pub orig_height: usize,
    /// Width after the resize (>= the bucket's).
    pub resized_width: usize,
    /// Height after the resize (>= the bucket's).
    pub resized_height: usize,
    /// The bucket: the crop's size.
    pub bucket: Bucket,
    /// The crop's left edge in the resized image (before any mirroring).
    pub left: usize,
    /// The crop's top edge in the resized image.
    pub top: usize,
}

impl Geometry {
    /// The geometry of a `width` x `height` image in `bucket`: the covering resize, then the
    /// crop; `Random` draws its offsets from (seed, id). A side of 0 is taken as 1.
    pub fn new(
        width: usize,
        height: usize,
        bucket: Bucket,
        crop: CropMode,
        seed: u64,
        id: u64,
    ) -> Self {
        let s = f64::max(
            bucket.width as f64 / width.max(1) as f64,
            bucket.height as f64 / height.max(1) as f64,
        );
        let rw = ((width as f64 * s).round() as usize).max(bucket.width);
        let rh = ((height as f64 * s).round() as usize).max(bucket.height);
        let (mx, my) = (rw - bucket.width, rh - bucket.height);
        let (left, top) = match crop {
            CropMode::Center => (mx / 2, my / 2),
            CropMode::Random => {
                let pick = |p: &str, m: usize| {
                    let u = unit(draw(seed, &[id, purpose(p)]));
                    ((u * (m + 1) as f64) as usize).min(m)
                };
                (pick("crop-left", mx), pick("crop-top", my))
            }
        };
        Geometry {
            orig_width: width,
            orig_height: height,
            resized_width: rw,
            resized_height: rh,
            bucket,
            left,
            top,
        }
    }

    /// The crop's left edge as the model sees it: in the mirrored resized image when
    /// `flip`.
    pub fn left_seen(&self, flip: bool) -> usize {
        match flip {
            true => self
                .resized_width
                .saturating_sub(self.bucket.width + self.left),
            false => self.left,
        }
    }

    /// SDXL's six micro-conditioning numbers: original (height, width), crop (top, left),
    /// target (height, width).
    pub fn time_ids(&self, flip: bool) -> [usize; 6] {
        [
            self.orig_height,
            self.orig_width,
            self.top,
            self.left_seen(flip),
            self.bucket.height,
            self.bucket.width,
        ]
    }
}

/// Decodes the image at `path` to RGB in [0, 1] (alpha dropped, 16-bit kept in f32); `Err`
/// says why it cannot be decoded.
pub fn decode(path: &Path) -> std::result::Result<image::Rgb32FImage, String> {
    let img = image::ImageReader::open(path)
        .map_err(|e| format!("cannot open the image: {e}"))?
        .with_guessed_format()
        .map_err(|e| format!("cannot read the image: {e}"))?
        .decode()
        .map_err(|e| format!("cannot decode the image: {e}"))?;
    Ok(img.to_rgb32f())
}

/// `img` resized and cropped by `geo` (mirrored when `flip`) as a (3, H, W) f32 tensor in
/// [-1, 1] on `device`. An error when the image's size is not the geometry's.
pub fn to_tensor(
    img: &image::Rgb32FImage,
    geo: &Geometry,
    resample: Resample,
    flip: bool,
    path: &Path,
    device: &Device,
) -> Result<Tensor> {
    if (img.width() as usize, img.height() as usize) != (geo.orig_width, geo.orig_height) {
        return Err(data_err(
            path,
            format!(
                "decoded to {}x{}, but its header said {}x{} (changed since the scan?)",
                img.width(),
                img.height(),
                geo.orig_width,
                geo.orig_height
            ),
        ));
    }
    let (bw, bh) = (geo.bucket.width, geo.bucket.height);
    if geo.left + bw > geo.resized_width || geo.top + bh > geo.resized_height {
        return Err(data_err(
            path,
            format!(
                "the crop {bw}x{bh} at left {} top {} does not fit the resized {}x{}",
                geo.left, geo.top, geo.resized_width, geo.resized_height
            ),
        ));
    }
    let resized;
    let src = if (geo.resized_width, geo.resized_height) == (geo.orig_width, geo.orig_height) {
        img
    } else {
        resized = image::imageops::resize(
            img,
            geo.resized_width as u32,
            geo.resized_height as u32,
            resample.filter(),
        );
        &resized
    };
    let mut out = vec![0f32; 3 * bh * bw];
    // (3, H, W): channel planes, rows top to bottom.
    for y in 0..bh {
        for x in 0..bw {
            let sx = if flip { bw - 1 - x } else { x };
            let p = src.get_pixel((geo.left + sx) as u32, (geo.top + y) as u32);
            for c in 0..3 {
                out[(c * bh + y) * bw + x] = (p.0[c] * 2.0 - 1.0).clamp(-1.0, 1.0);
            }
        }
    }
    Tensor::from_vec(out, (3, bh, bw), device)
}
