//! PNG output: an image tensor written as a PNG, and the loss plot; both written atomically
//! (a temporary file beside the target, synced, renamed into place), so a reader never sees
//! half a file and a crash keeps the previous one.
//!
//! The plot is rasterised here, with no font or plotting library: axes, a grid with five
//! ticks an axis labelled in a built-in 3x5 pixel digit font, the training loss as a blue
//! polyline and the validation loss as an orange polyline with a dot at each point.

use super::{data_err, write_atomic};
use crate::{DType, Result, Tensor};
use image::{Rgb, RgbImage};
use std::path::Path;

/// Encodes `img` as PNG bytes.
fn png_bytes(img: &RgbImage, path: &Path) -> Result<Vec<u8>> {
    let mut buf = std::io::Cursor::new(Vec::new());
    img.write_to(&mut buf, image::ImageFormat::Png)
        .map_err(|e| data_err(path, format!("PNG encoding failed: {e}")))?;
    Ok(buf.into_inner())
}

/// Writes a (3, H, W) tensor of values in [-1, 1] (any float dtype, any device) as an 8-bit
/// RGB PNG at `path`, atomically: value v becomes round((v + 1) / 2 · 255), clamped to
/// [0, 255] (non-finite values become 0).
pub fn save_png(image: &Tensor, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let dims = image.dims();
    if dims.len() != 3 || dims[0] != 3 || dims[1] == 0 || dims[2] == 0 {
        return Err(crate::Error::invalid(
            "save_png",
            format!("needs (3, H, W) for {}", path.display()),
            image.shape(),
        ));
    }
    let (h, w) = (dims[1], dims[2]);
    let v: Vec<f32> = {
        let _g = crate::no_grad();
        image.to_dtype(DType::F32)?.to_vec::<f32>()?
    };
    let mut img = RgbImage::new(w as u32, h as u32);
    for y in 0..h {
        for x in 0..w {
            let px = |c: usize| {
                let v = v[(c * h + y) * w + x];
                let v = if v.is_finite() { v } else { -1.0 };
                ((v + 1.0) * 0.5 * 255.0).round().clamp(0.0, 255.0) as u8
            };
            img.put_pixel(x as u32, y as u32, Rgb([px(0), px(1), px(2)]));
        }
    }
    write_atomic(path, &png_bytes(&img, path)?)
}

/// Colour of the training-loss line.
pub const TRAIN_COLOR: [u8; 3] = [31, 119, 180];
/// Colour of the validation-loss line and its points.
pub const VAL_COLOR: [u8; 3] = [255, 127, 14];

const WHITE: Rgb<u8> = Rgb([255, 255, 255]);
const AXIS: Rgb<u8> = Rgb([0, 0, 0]);
const GRID: Rgb<u8> = Rgb([225, 225, 225]);

/// 3x5 glyphs of "0123456789.-e": a row per entry, bit 2 the leftmost pixel.
const GLYPHS: [(char, [u8; 5]); 13] = [
    ('0', [7, 5, 5, 5, 7]),
    ('1', [2, 6, 2, 2, 7]),
    ('2', [7, 1, 7, 4, 7]),
    ('3', [7, 1, 7, 1, 7]),
    ('4', [5, 5, 7, 1, 1]),
    ('5', [7, 4, 7, 1, 7]),
    ('6', [7, 4, 7, 5, 7]),
    ('7', [7, 1, 1, 1, 1]),
    ('8', [7, 5, 7, 5, 7]),
    ('9', [7, 5, 7, 1, 7]),
    ('.', [0, 0, 0, 0, 2]),
    ('-', [0, 0, 7, 0, 0]),
    ('e', [0, 7, 7, 4, 7]),
];

/// Pixel scale of the digit font.
const FONT_SCALE: i64 = 2;

struct Canvas {
    img: RgbImage,
}

impl Canvas {
    fn set(&mut self, x: i64, y: i64, c: Rgb<u8>) {
        if x >= 0 && y >= 0 && (x as u32) < self.img.width() && (y as u32) < self.img.height() {
            self.img.put_pixel(x as u32, y as u32, c);
        }
    }

    /// A line from (x0, y0) to (x1, y1), Bresenham, `thick` pixels square per point.
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: Rgb<u8>, thick: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            for ox in 0..thick {
                for oy in 0..thick {
                    self.set(x + ox - thick / 2, y + oy - thick / 2, c);
                }
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// `text` (digits, '.', '-', 'e'; other characters leave a gap) with its top-left at
    /// (x, y).
    fn text(&mut self, x: i64, y: i64, text: &str, c: Rgb<u8>) {
        for (k, ch) in text.chars().enumerate() {
            let Some((_, rows)) = GLYPHS.iter().find(|(g, _)| *g == ch) else {
                continue;
            };
            let gx = x + k as i64 * 4 * FONT_SCALE;
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..3 {
                    if bits & (4 >> col) != 0 {
                        for oy in 0..FONT_SCALE {
                            for ox in 0..FONT_SCALE {
                                self.set(
                                    gx + col * FONT_SCALE + ox,
                                    y + r as i64 * FONT_SCALE + oy,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Width in pixels of `text` in the digit font.
fn text_width(text: &str) -> i64 {
    text.chars().count() as i64 * 4 * FONT_SCALE - FONT_SCALE
}

/// A tick label: short, in the digit font's characters.
fn label(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Draws training and validation loss against step into a `width` x `height` PNG at
/// `path`, replacing it atomically. Points are (step, loss); non-finite losses are left
/// out. The axes span the points' range (padded by 5% in loss); with no point the plot is
/// empty axes. An error when the size is under 64x48.
pub fn plot_loss(
    train: &[(usize, f64)],
    val: &[(usize, f64)],
    width: u32,
    height: u32,
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    if width < 64 || height < 48 {
        return Err(data_err(
            path,
            format!("plot size {width}x{height}: at least 64x48"),
        ));
    }
    let finite = |v: &[(usize, f64)]| -> Vec<(usize, f64)> {
        v.iter().copied().filter(|(_, l)| l.is_finite()).collect()
    };
    let (train, val) = (finite(train), finite(val));
    let all = train.iter().chain(&val);
    let (mut s0, mut s1, mut l0, mut l1) = (usize::MAX, 0usize, f64::INFINITY, f64::NEG_INFINITY);
    for &(s, l) in all {
        s0 = s0.min(s);
        s1 = s1.max(s);
        l0 = l0.min(l);
        l1 = l1.max(l);
    }
    if s0 > s1 {
        (s0, s1, l0, l1) = (0, 1, 0.0, 1.0);
    }
    if s1 == s0 {
        s1 = s0 + 1;
    }
    let pad = if l1 > l0 {
        (l1 - l0) * 0.05
    } else {
        l0.abs().max(1.0) * 0.05
    };
    let (l0, l1) = (l0 - pad, l1 + pad);

    let mut cv = Canvas {
        img: RgbImage::from_pixel(width, height, WHITE),
    };
    let (w, h) = (width as i64, height as i64);
    // The plot area: room on the left for loss labels, below for step labels.
    let ticks = 5;
    let labels_y: Vec<String> = (0..ticks)
        .map(|k| label(l0 + (l1 - l0) * k as f64 / (ticks - 1) as f64))
        .collect();
    let left = labels_y.iter().map(|s| text_width(s)).max().unwrap_or(0) + 10;
    let (right, top, bottom) = (w - 10, 10, h - 5 * FONT_SCALE - 12);
    let px =
        |s: f64| left + ((s - s0 as f64) / (s1 - s0) as f64 * (right - left) as f64).round() as i64;
    let py = |l: f64| bottom - ((l - l0) / (l1 - l0) * (bottom - top) as f64).round() as i64;
    for (k, lab) in labels_y.iter().enumerate() {
        let y = bottom - (bottom - top) * k as i64 / (ticks - 1) as i64;
        cv.line((left, y), (right, y), GRID, 1);
        cv.line((left - 4, y), (left, y), AXIS, 1);
        cv.text(
            left - 6 - text_width(lab),
            y - 5 * FONT_SCALE / 2,
            lab,
            AXIS,
        );
    }
    for k in 0..ticks {
        let s = s0 as f64 + (s1 - s0) as f64 * k as f64 / (ticks - 1) as f64;
        let x = px(s);
        cv.line((x, top), (x, bottom), GRID, 1);
        cv.line((x, bottom), (x, bottom + 4), AXIS, 1);
        let lab = label(s.round());
        let tx = (x - text_width(&lab) / 2).clamp(0, (w - text_width(&lab)).max(0));
        cv.text(tx, bottom + 7, &lab, AXIS);
    }
    cv.line((left, top), (left, bottom), AXIS, 1);
    cv.line((left, bottom), (right, bottom), AXIS, 1);
    for (points, color, dots) in [(&train, TRAIN_COLOR, false), (&val, VAL_COLOR, true)] {
        let c = Rgb(color);
        let pts: Vec<(i64, i64)> = points.iter().map(|&(s, l)| (px(s as f64), py(l))).collect();
        for seg in pts.windows(2) {
            cv.line(seg[0], seg[1], c, 2);
        }
        if dots || pts.len() == 1 {
            for &(x, y) in &pts {
                for oy in -2..=2 {
                    for ox in -2..=2 {
                        cv.set(x + ox, y + oy, c);
                    }
                }
            }
        }
    }
    write_atomic(path, &png_bytes(&cv.img, path)?)
}
