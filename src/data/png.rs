//! PNG output: an image tensor written as a PNG, and the loss plot; both written atomically
//! (a temporary file beside the target, synced, renamed into place), so a reader never sees
//! half a file and a crash keeps the previous one.
//!
//! The plot is rasterised here, with no font or plotting library: axes, a grid with up to
//! five ticks an axis (the first and last at the data's smallest and largest value), tick
//! labels, the axis titles "step" and "loss" (the latter written upwards), the training
//! loss as a blue polyline and the validation loss as an orange polyline with a dot at each
//! point, and a legend above the plot naming each series that has points, beside a swatch
//! of its colour. Text is drawn in a built-in 5x7 pixel font ([`text_pixels`]), doubled on
//! plots of at least 400x300 ([`font_scale`]).

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
/// Colour of the axes and of all text (labels, titles, legend).
pub const TEXT_COLOR: [u8; 3] = [0, 0, 0];

const WHITE: Rgb<u8> = Rgb([255, 255, 255]);
const AXIS: Rgb<u8> = Rgb(TEXT_COLOR);
const GRID: Rgb<u8> = Rgb([225, 225, 225]);

/// Width of a glyph of the plot's font, in font pixels.
pub const GLYPH_WIDTH: u32 = 5;
/// Height of a glyph of the plot's font above its baseline, in font pixels.
pub const GLYPH_HEIGHT: u32 = 7;
/// Rows below the baseline that the descenders of g, j, p, q and y reach, in font pixels.
pub const GLYPH_DESCENT: u32 = 2;
/// Rows of a glyph in all.
const ROWS: usize = (GLYPH_HEIGHT + GLYPH_DESCENT) as usize;
/// From one character's left edge to the next one's, in font pixels (a column of space).
const ADVANCE: u32 = GLYPH_WIDTH + 1;

/// The 5x7 glyphs: digits, letters, a space and `.-+:,()/=_%?`; each a character and its
/// seven rows top to bottom down to the baseline (then two more for a descender), separated
/// by spaces, '#' a lit pixel. A character not listed is drawn as '?'.
const FONT: [(char, &str); 75] = [
    (' ', "..... ..... ..... ..... ..... ..... ....."),
    ('0', ".###. #...# #..## #.#.# ##..# #...# .###."),
    ('1', "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('2', ".###. #...# ....# ...#. ..#.. .#... #####"),
    ('3', "##### ...#. ..#.. ...#. ....# #...# .###."),
    ('4', "...#. ..##. .#.#. #..#. ##### ...#. ...#."),
    ('5', "##### #.... ####. ....# ....# #...# .###."),
    ('6', "..##. .#... #.... ####. #...# #...# .###."),
    ('7', "##### ....# ...#. ..#.. .#... .#... .#..."),
    ('8', ".###. #...# #...# .###. #...# #...# .###."),
    ('9', ".###. #...# #...# .#### ....# ...#. .##.."),
    ('a', "..... ..... .###. ....# .#### #...# .####"),
    ('b', "#.... #.... #.##. ##..# #...# #...# ####."),
    ('c', "..... ..... .###. #.... #.... #...# .###."),
    ('d', "....# ....# .##.# #..## #...# #...# .####"),
    ('e', "..... ..... .###. #...# ##### #.... .###."),
    ('f', "..##. .#..# .#... ###.. .#... .#... .#..."),
    ('g', "..... ..... .#### #...# #...# #...# .#### ....# .###."),
    ('h', "#.... #.... #.##. ##..# #...# #...# #...#"),
    ('i', "..#.. ..... .##.. ..#.. ..#.. ..#.. .###."),
    ('j', "...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##.."),
    ('k', "#.... #.... #..#. #.#.. ##... #.#.. #..#."),
    ('l', ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('m', "..... ..... ##.#. #.#.# #.#.# #...# #...#"),
    ('n', "..... ..... #.##. ##..# #...# #...# #...#"),
    ('o', "..... ..... .###. #...# #...# #...# .###."),
    ('p', "..... ..... ####. #...# #...# #...# ####. #.... #...."),
    ('q', "..... ..... .#### #...# #...# #...# .#### ....# ....#"),
    ('r', "..... ..... #.##. ##..# #.... #.... #...."),
    ('s', "..... ..... .#### #.... .###. ....# ####."),
    ('t', ".#... .#... ###.. .#... .#... .#..# ..##."),
    ('u', "..... ..... #...# #...# #...# #..## .##.#"),
    ('v', "..... ..... #...# #...# #...# .#.#. ..#.."),
    ('w', "..... ..... #...# #...# #.#.# #.#.# .#.#."),
    ('x', "..... ..... #...# .#.#. ..#.. .#.#. #...#"),
    ('y', "..... ..... #...# #...# #...# #...# .#### ....# .###."),
    ('z', "..... ..... ##### ...#. ..#.. .#... #####"),
    ('A', ".###. #...# #...# ##### #...# #...# #...#"),
    ('B', "####. #...# #...# ####. #...# #...# ####."),
    ('C', ".###. #...# #.... #.... #.... #...# .###."),
    ('D', "###.. #..#. #...# #...# #...# #..#. ###.."),
    ('E', "##### #.... #.... ####. #.... #.... #####"),
    ('F', "##### #.... #.... ####. #.... #.... #...."),
    ('G', ".###. #...# #.... #.### #...# #...# .####"),
    ('H', "#...# #...# #...# ##### #...# #...# #...#"),
    ('I', ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('J', "..### ...#. ...#. ...#. ...#. #..#. .##.."),
    ('K', "#...# #..#. #.#.. ##... #.#.. #..#. #...#"),
    ('L', "#.... #.... #.... #.... #.... #.... #####"),
    ('M', "#...# ##.## #.#.# #.#.# #...# #...# #...#"),
    ('N', "#...# #...# ##..# #.#.# #..## #...# #...#"),
    ('O', ".###. #...# #...# #...# #...# #...# .###."),
    ('P', "####. #...# #...# ####. #.... #.... #...."),
    ('Q', ".###. #...# #...# #...# #.#.# #..#. .##.#"),
    ('R', "####. #...# #...# ####. #.#.. #..#. #...#"),
    ('S', ".#### #.... #.... .###. ....# ....# ####."),
    ('T', "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."),
    ('U', "#...# #...# #...# #...# #...# #...# .###."),
    ('V', "#...# #...# #...# #...# #...# .#.#. ..#.."),
    ('W', "#...# #...# #...# #.#.# #.#.# #.#.# .#.#."),
    ('X', "#...# #...# .#.#. ..#.. .#.#. #...# #...#"),
    ('Y', "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.."),
    ('Z', "##### ....# ...#. ..#.. .#... #.... #####"),
    ('.', "..... ..... ..... ..... ..... .##.. .##.."),
    ('-', "..... ..... ..... ##### ..... ..... ....."),
    ('+', "..... ..#.. ..#.. ##### ..#.. ..#.. ....."),
    (':', "..... .##.. .##.. ..... .##.. .##.. ....."),
    (',', "..... ..... ..... ..... .##.. ..#.. .#..."),
    ('(', "...#. ..#.. .#... .#... .#... ..#.. ...#."),
    (')', ".#... ..#.. ...#. ...#. ...#. ..#.. .#..."),
    ('/', "..... ....# ...#. ..#.. .#... #.... ....."),
    ('=', "..... ..... ##### ..... ##### ..... ....."),
    ('_', "..... ..... ..... ..... ..... ..... #####"),
    ('%', "##... ##..# ...#. ..#.. .#... #..## ...##"),
    ('?', ".###. #...# ....# ...#. ..#.. ..... ..#.."),
];

/// The nine rows of `c`'s glyph ([`GLYPH_HEIGHT`] down to the baseline, then
/// [`GLYPH_DESCENT`] for descenders), bit 4 the leftmost pixel; `None` for a character the
/// font lacks.
pub fn glyph(c: char) -> Option<[u8; 9]> {
    let (_, rows) = FONT.iter().find(|(g, _)| *g == c)?;
    let mut out = [0u8; ROWS];
    for (o, r) in out.iter_mut().zip(rows.split(' ')) {
        *o = r
            .bytes()
            .fold(0u8, |acc, b| (acc << 1) | u8::from(b == b'#'));
    }
    Some(out)
}

/// The font's pixel scale on a `width` x `height` plot: 2 from 400x300 up, else 1.
pub fn font_scale(width: u32, height: u32) -> u32 {
    match width >= 400 && height >= 300 {
        true => 2,
        false => 1,
    }
}

/// `text` in the plot's font at `scale`, written left to right from (0, 0): its width and
/// height in pixels (the height spans the descenders) and the (x, y) of every lit pixel, in
/// row order within each character.
pub fn text_pixels(text: &str, scale: u32) -> (u32, u32, Vec<(u32, u32)>) {
    let n = text.chars().count() as u32;
    let width = (n * ADVANCE).saturating_sub(1) * scale;
    let mut lit = vec![];
    for (k, ch) in text.chars().enumerate() {
        let rows = glyph(ch).or_else(|| glyph('?')).unwrap_or([0; ROWS]);
        let gx = k as u32 * ADVANCE * scale;
        for (r, bits) in rows.iter().enumerate() {
            for col in 0..GLYPH_WIDTH {
                if bits & (1 << (GLYPH_WIDTH - 1 - col)) != 0 {
                    for oy in 0..scale {
                        for ox in 0..scale {
                            lit.push((gx + col * scale + ox, r as u32 * scale + oy));
                        }
                    }
                }
            }
        }
    }
    (width, ROWS as u32 * scale, lit)
}

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

    /// A filled square of side 2·`r` + 1 centred on (x, y).
    fn dot(&mut self, x: i64, y: i64, r: i64, c: Rgb<u8>) {
        for oy in -r..=r {
            for ox in -r..=r {
                self.set(x + ox, y + oy, c);
            }
        }
    }

    /// `text` at `scale` with its top-left corner at (x, y); `upwards` turns it a quarter
    /// turn anticlockwise (read from bottom to top), the corner then being the top-left of
    /// the turned text.
    fn text(&mut self, (x, y): (i64, i64), text: &str, c: Rgb<u8>, scale: u32, upwards: bool) {
        let (w, _, lit) = text_pixels(text, scale);
        for (px, py) in lit {
            let (px, py) = (px as i64, py as i64);
            match upwards {
                false => self.set(x + px, y + py, c),
                true => self.set(x + py, y + (w as i64 - 1 - px), c),
            }
        }
    }
}

/// Width in pixels of `text` at `scale`.
fn text_width(text: &str, scale: u32) -> i64 {
    text_pixels(text, scale).0 as i64
}

/// `s` with trailing zeros after a decimal point dropped (and the point, when bare).
fn trim_zeros(s: String) -> String {
    match s.split_once('e') {
        Some((m, e)) if m.contains('.') => {
            format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.'))
        }
        None if s.contains('.') => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        _ => s,
    }
}

/// A tick label of `v` on an axis whose ticks lie `spacing` apart: enough digits to tell
/// neighbouring ticks apart (one more than the spacing's leading digit needs), trailing
/// zeros dropped; scientific notation below 1e-3 and from 1e5 up.
fn label(v: f64, spacing: f64) -> String {
    let a = v.abs();
    let spacing = if spacing > 0.0 && spacing.is_finite() {
        spacing
    } else {
        a.max(1.0) * 0.1
    };
    if a == 0.0 || (a < spacing / 2.0 && a < 1e-3) {
        return "0".into();
    }
    let s = if !(1e-3..1e5).contains(&a) {
        let digits = ((a / spacing).log10().ceil() as i64 + 1).clamp(1, 6) as usize;
        format!("{v:.prec$e}", prec = digits - 1)
    } else {
        let decimals = ((-spacing.log10()).floor() as i64 + 2).clamp(0, 6) as usize;
        format!("{v:.decimals$}")
    };
    let s = trim_zeros(s);
    match s.as_str() {
        "-0" => "0".into(),
        _ => s,
    }
}

/// Up to `n` tick values from `lo` to `hi`, evenly spaced, the first `lo` and the last `hi`
/// (one value when they are equal).
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi <= lo || n < 2 {
        return vec![lo];
    }
    (0..n)
        .map(|k| lo + (hi - lo) * k as f64 / (n - 1) as f64)
        .collect()
}

/// Draws training and validation loss against step into a `width` x `height` PNG at
/// `path`, replacing it atomically. Points are (step, loss); non-finite losses are left
/// out. The axes span the points' range (padded by 5% in loss); with no point the plot is
/// empty axes with their titles. The x axis is titled "step" and the y axis "loss"; the
/// ticks are labelled, the first and last at the smallest and largest step and loss; a
/// legend above the plot names "training loss" and "validation loss", each only when it
/// has points. An error when the size is under 64x48.
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
    // The ticks: from the smallest to the largest value of each axis.
    let loss_ticks = ticks(l0, l1, 5);
    let step_ticks: Vec<f64> = {
        let mut v: Vec<f64> = ticks(s0 as f64, s1 as f64, 5)
            .into_iter()
            .map(f64::round)
            .collect();
        v.dedup();
        v
    };
    if s1 == s0 {
        s1 = s0 + 1;
    }
    let pad = if l1 > l0 {
        (l1 - l0) * 0.05
    } else {
        l0.abs().max(1.0) * 0.05
    };
    let spacing = match loss_ticks.len() {
        1 => pad,
        n => (l1 - l0) / (n - 1) as f64,
    };
    let (l0, l1) = (l0 - pad, l1 + pad);
    let loss_labels: Vec<String> = loss_ticks.iter().map(|&v| label(v, spacing)).collect();
    let step_labels: Vec<String> = step_ticks.iter().map(|&v| format!("{v:.0}")).collect();

    let mut cv = Canvas {
        img: RgbImage::from_pixel(width, height, WHITE),
    };
    let (w, h) = (width as i64, height as i64);
    let scale = font_scale(width, height);
    let sc = scale as i64;
    // A line of text from its top to the bottom of its descenders, and to its baseline.
    let line_h = ROWS as i64 * sc;
    let cap_h = (GLYPH_HEIGHT * scale) as i64;
    let margin = 4 * sc;
    // Room for the legend above, the loss title and labels on the left, the step labels and
    // title below, half the last step label on the right.
    let top = margin + line_h + 4 * sc;
    let left = margin
        + line_h
        + 3 * sc
        + loss_labels
            .iter()
            .map(|s| text_width(s, scale))
            .max()
            .unwrap_or(0)
        + 6 * sc;
    let last_half = step_labels
        .last()
        .map(|s| text_width(s, scale) / 2)
        .unwrap_or(0);
    let right = (w - margin.max(last_half + sc)).max(left + 1);
    let bottom = (h - margin - line_h - 3 * sc - line_h - 7 * sc).max(top + 1);
    let px =
        |s: f64| left + ((s - s0 as f64) / (s1 - s0) as f64 * (right - left) as f64).round() as i64;
    let py = |l: f64| bottom - ((l - l0) / (l1 - l0) * (bottom - top) as f64).round() as i64;

    for (&v, lab) in loss_ticks.iter().zip(&loss_labels) {
        let y = py(v);
        cv.line((left, y), (right, y), GRID, 1);
        cv.line((left - 3 * sc, y), (left, y), AXIS, 1);
        cv.text(
            (left - 6 * sc - text_width(lab, scale), y - cap_h / 2),
            lab,
            AXIS,
            scale,
            false,
        );
    }
    for (&v, lab) in step_ticks.iter().zip(&step_labels) {
        let x = px(v);
        cv.line((x, top), (x, bottom), GRID, 1);
        cv.line((x, bottom), (x, bottom + 3 * sc), AXIS, 1);
        let tw = text_width(lab, scale);
        let tx = (x - tw / 2).clamp(0, (w - tw).max(0));
        cv.text((tx, bottom + 7 * sc), lab, AXIS, scale, false);
    }
    cv.line((left, top), (left, bottom), AXIS, 1);
    cv.line((left, bottom), (right, bottom), AXIS, 1);

    // Axis titles: "step" centred under the step labels, "loss" upwards left of the loss
    // labels, centred on the plot's height.
    let tw = text_width("step", scale);
    cv.text(
        (
            (left + right) / 2 - tw / 2,
            bottom + 7 * sc + line_h + 3 * sc,
        ),
        "step",
        AXIS,
        scale,
        false,
    );
    let tw = text_width("loss", scale);
    cv.text(
        (margin, (top + bottom) / 2 - tw / 2),
        "loss",
        AXIS,
        scale,
        true,
    );

    for (points, color, dots) in [(&train, TRAIN_COLOR, false), (&val, VAL_COLOR, true)] {
        let c = Rgb(color);
        let pts: Vec<(i64, i64)> = points.iter().map(|&(s, l)| (px(s as f64), py(l))).collect();
        for seg in pts.windows(2) {
            cv.line(seg[0], seg[1], c, 2);
        }
        if dots || pts.len() == 1 {
            for &(x, y) in &pts {
                cv.dot(x, y, 2, c);
            }
        }
    }

    // The legend: a swatch of each series' colour and its name, centred above the plot.
    let mut entries = vec![];
    if !train.is_empty() {
        entries.push(("training loss", TRAIN_COLOR, false));
    }
    if !val.is_empty() {
        entries.push(("validation loss", VAL_COLOR, true));
    }
    let (swatch, gap) = (10 * sc, 8 * sc);
    let widths: Vec<i64> = entries
        .iter()
        .map(|(name, _, _)| swatch + 3 * sc + text_width(name, scale))
        .collect();
    let total = widths.iter().sum::<i64>() + gap * (widths.len() as i64 - 1).max(0);
    // Over the plot when it fits there, else over the whole image.
    let mut x = match total <= right - left - 2 * sc {
        true => (left + right) / 2 - total / 2,
        false => ((w - total) / 2).max(margin),
    };
    let mid = margin + cap_h / 2;
    for ((name, color, dots), ew) in entries.iter().zip(&widths) {
        let c = Rgb(*color);
        cv.line((x, mid), (x + swatch, mid), c, 2);
        if *dots {
            cv.dot(x + swatch / 2, mid, 2, c);
        }
        cv.text((x + swatch + 3 * sc, margin), name, AXIS, scale, false);
        x += ew + gap;
    }
    write_atomic(path, &png_bytes(&cv.img, path)?)
}
