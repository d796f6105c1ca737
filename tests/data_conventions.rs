//! `flame::data` with the files users bring: captions in UTF-8 with a byte-order mark, in
//! UTF-16 and in Windows-1252; folders laid out for kohya's sd-scripts (`<repeats>_<name>`
//! subfolders); images too small or too elongated to bucket; and the loss plot's axis
//! titles, tick labels and legend. Images are made by each test in its own temporary folder.
#![cfg(feature = "cpu-ref")]

use flame::data::bucket::{unfit, MAX_IMAGE_ASPECT};
use flame::data::png::{font_scale, glyph, text_pixels, TEXT_COLOR, TRAIN_COLOR, VAL_COLOR};
use flame::data::source::{decode_text, kohya_repeats, TextEncoding};
use flame::data::{
    plot_loss, scan, BucketConfig, CaptionOptions, CropMode, DataConfig, Dataset, DatasetOptions,
    OnBadFile, Resample, Source,
};
use flame::Error;
use image::{Rgb, RgbImage};
use std::path::{Path, PathBuf};

/// A fresh temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flame-conv-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `w` x `h` image whose pixels depend on their position and `salt`.
fn pattern(w: u32, h: u32, salt: u8) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        Rgb([
            (x * 7 + y * 3 + salt as u32) as u8,
            (x * 11 + 50) as u8,
            (y * 13 + salt as u32 * 2) as u8,
        ])
    })
}

/// Saves a `w` x `h` PNG as `dir/name` with the caption bytes `caption` beside it.
fn put(dir: &Path, name: &str, (w, h): (u32, u32), caption: &[u8]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    pattern(w, h, name.len() as u8).save(&p).unwrap();
    std::fs::write(p.with_extension("txt"), caption).unwrap();
    p
}

fn options(dir: &Path, repeats: usize, resolution: usize) -> DatasetOptions {
    DatasetOptions {
        sources: vec![Source::Folder {
            dir: dir.to_path_buf(),
            repeats,
            references: vec![],
        }],
        buckets: BucketConfig {
            resolution,
            step: 16,
            max_aspect: 2.0,
        },
        crop: CropMode::Center,
        flip: false,
        resample: Resample::Lanczos3,
        captions: CaptionOptions::default(),
        on_bad_file: OnBadFile::Stop,
        seed: 3,
        references: Default::default(),
    }
}

fn utf16(text: &str, big_endian: bool) -> Vec<u8> {
    let mut out = match big_endian {
        true => vec![0xFE, 0xFF],
        false => vec![0xFF, 0xFE],
    };
    for u in text.encode_utf16() {
        out.extend(match big_endian {
            true => u.to_be_bytes(),
            false => u.to_le_bytes(),
        });
    }
    out
}

// ----- captions ---------------------------------------------------------------------------

#[test]
fn captions_with_a_bom_in_utf16_and_in_windows_1252() {
    let dir = TempDir::new("captions");
    let d = dir.path();
    // A surrogate pair (U+1D11E) checks UTF-16 beyond the basic plane.
    let fancy = "café ☕ \u{1D11E}, tags";
    put(d, "a.png", (32, 32), b"\xEF\xBB\xBF  a cat, sitting\n");
    put(d, "b.png", (32, 32), &utf16(fancy, false));
    put(d, "c.png", (32, 32), &utf16(fancy, true));
    // Windows-1252: e-acute, curly quotes, the euro sign, and the undefined byte 0x81.
    put(d, "d.png", (32, 32), b"caf\xE9 \x93quoted\x94 \x80 \x81x");
    put(d, "e.png", (32, 32), "plain ü".as_bytes());

    let ds = Dataset::open(options(d, 1, 64)).unwrap();
    let captions: Vec<&str> = ds.items.iter().map(|i| i.caption.as_str()).collect();
    assert_eq!(
        captions,
        [
            "a cat, sitting",
            fancy,
            fancy,
            "café \u{201C}quoted\u{201D} \u{20AC} \u{81}x",
            "plain ü"
        ]
    );
    assert!(!captions[0].starts_with('\u{FEFF}'), "the BOM is dropped");
    // Only the Windows-1252 caption is noted, naming its file and what to do.
    assert_eq!(ds.notes.len(), 1, "{:?}", ds.notes);
    let note = &ds.notes[0];
    assert!(
        note.contains("d.txt")
            && note.contains("is not UTF-8: read as Windows-1252")
            && note.contains("save it as UTF-8"),
        "{note}"
    );
    assert!(ds.skipped.is_empty(), "{:?}", ds.skipped);
    // The scan on its own reports the same note.
    let s = scan(&ds.options.sources, OnBadFile::Stop).unwrap();
    assert_eq!(s.notes, ds.notes);
    // A validation split keeps the notes with the training set only (said once).
    let (train, val) = ds.split(0.3).unwrap();
    assert_eq!(train.notes.len(), 1);
    assert!(val.unwrap().notes.is_empty());
}

#[test]
fn windows_1252_table_and_decoding_errors() {
    // Every byte of 0x80..=0x9F (not UTF-8 on their own), by the Windows-1252 table; the
    // five undefined bytes as the Latin-1 code points of their value.
    let bytes: Vec<u8> = (0x80..=0x9F).collect();
    let want = "€\u{81}‚ƒ„…†‡ˆ‰Š‹Œ\u{8D}Ž\u{8F}\u{90}‘’“”•–—˜™š›œ\u{9D}žŸ";
    let (text, enc) = decode_text(&bytes).unwrap();
    assert_eq!(enc, TextEncoding::Windows1252);
    assert_eq!(text, want);
    // 0xA0..=0xFF are Latin-1.
    let (text, _) = decode_text(&[0x41, 0xA0, 0xC9, 0xFF]).unwrap();
    assert_eq!(text, "A\u{A0}Éÿ");
    assert_eq!(
        decode_text("naïve".as_bytes()).unwrap(),
        ("naïve".to_string(), TextEncoding::Utf8)
    );
    assert_eq!(
        decode_text(&utf16("x", true)).unwrap(),
        ("x".to_string(), TextEncoding::Utf16Be)
    );
    assert_eq!(decode_text(&[0xFF, 0xFE]).unwrap().0, "");

    // Invalid UTF-16 after its mark: an unpaired surrogate, an odd length.
    let e = decode_text(&[0xFF, 0xFE, 0x00, 0xD8, 0x41, 0x00]).unwrap_err();
    assert!(e.contains("UTF-16 LE") && e.contains("D800"), "{e}");
    let e = decode_text(&[0xFE, 0xFF, 0x00]).unwrap_err();
    assert!(e.contains("UTF-16 BE") && e.contains("odd"), "{e}");
    // A UTF-8 mark before bytes that are not UTF-8.
    let e = decode_text(&[0xEF, 0xBB, 0xBF, 0x61, 0xFF]).unwrap_err();
    assert!(e.contains("UTF-8 byte-order mark"), "{e}");

    // In a scan: bad UTF-16 is a bad file naming the caption, skipped or fatal.
    let dir = TempDir::new("bad-utf16");
    let d = dir.path();
    put(d, "good.png", (32, 32), b"fine");
    put(d, "odd.png", (32, 32), &[0xFF, 0xFE, 0x00, 0xDC]);
    let mut o = options(d, 1, 64);
    o.on_bad_file = OnBadFile::Skip;
    let ds = Dataset::open(o.clone()).unwrap();
    assert_eq!(ds.items.len(), 1);
    assert_eq!(ds.skipped.len(), 1);
    let why = ds.skipped[0].to_string();
    assert!(
        why.contains("odd.png") && why.contains("odd.txt") && why.contains("UTF-16 LE"),
        "{why}"
    );
    o.on_bad_file = OnBadFile::Stop;
    let e = Dataset::open(o.clone()).unwrap_err();
    assert!(matches!(e, Error::Data { .. }), "{e:?}");
    assert!(e.to_string().contains("odd.txt"), "{e}");

    // A Windows-1252 caption beside an image that is left out: reported as skipped, not
    // noted.
    std::fs::write(d.join("odd.txt"), "fixed").unwrap();
    std::fs::write(d.join("junk.png"), b"not a png").unwrap();
    std::fs::write(d.join("junk.txt"), b"caf\xE9").unwrap();
    o.on_bad_file = OnBadFile::Skip;
    let ds = Dataset::open(o).unwrap();
    assert_eq!(ds.items.len(), 2);
    assert_eq!(ds.skipped.len(), 1);
    assert!(ds.notes.is_empty(), "{:?}", ds.notes);
}

#[test]
fn manifest_with_a_bom() {
    let dir = TempDir::new("manifest");
    let d = dir.path();
    put(d, "a.png", (32, 32), b"unused");
    let m = d.join("m.jsonl");
    std::fs::write(
        &m,
        "\u{FEFF}{\"file\": \"a.png\", \"caption\": \"from the manifest\"}\n",
    )
    .unwrap();
    let mut o = options(d, 1, 64);
    o.sources = vec![Source::Manifest {
        path: m.clone(),
        repeats: 1,
    }];
    let ds = Dataset::open(o.clone()).unwrap();
    assert_eq!(ds.items[0].caption, "from the manifest");
    assert!(ds.notes.is_empty());
    // JSON must be UTF-8: Windows-1252 bytes are an error naming the manifest and the byte.
    std::fs::write(&m, b"{\"file\": \"a.png\", \"caption\": \"caf\xE9\"}\n").unwrap();
    let e = Dataset::open(o).unwrap_err().to_string();
    assert!(
        e.contains("m.jsonl") && e.contains("not UTF-8") && e.contains("byte 33"),
        "{e}"
    );
}

// ----- kohya's folders --------------------------------------------------------------------

#[test]
fn kohya_subfolders_multiply_repeats_and_keep_names_apart() {
    assert_eq!(kohya_repeats("10_mychar"), Some(10));
    assert_eq!(kohya_repeats("3_style_v2"), Some(3));
    assert_eq!(kohya_repeats("01_x"), Some(1));
    for no in ["0_zero", "_x", "10_", "mychar", "1a_x", "x_10", "-1_x"] {
        assert_eq!(kohya_repeats(no), None, "{no}");
    }

    let dir = TempDir::new("kohya");
    let root = dir.path().join("images");
    put(&root, "top.png", (32, 32), b"top");
    put(&root.join("10_mychar"), "a.png", (32, 32), b"char a");
    put(&root.join("10_mychar"), "b.png", (32, 48), b"char b");
    put(&root.join("3_style"), "a.png", (48, 32), b"style a");
    // Not searched: no number, a number of 0.
    put(&root.join("unsorted"), "x.png", (32, 32), b"x");
    put(&root.join("0_zero"), "z.png", (32, 32), b"z");

    let ds = Dataset::open(options(&root, 2, 64)).unwrap();
    let got: Vec<(&str, &str, usize)> = ds
        .items
        .iter()
        .map(|i| (i.name.as_str(), i.caption.as_str(), i.repeats))
        .collect();
    assert_eq!(
        got,
        [
            ("top.png", "top", 2),
            ("10_mychar/a.png", "char a", 20),
            ("10_mychar/b.png", "char b", 20),
            ("3_style/a.png", "style a", 6),
        ]
    );
    assert_eq!(ds.items[3].path, root.join("3_style").join("a.png"));
    assert_eq!(ds.len(), 2 + 20 + 20 + 6);
    // Two subfolders' a.png are distinct images: every sample has its own id.
    let ids: std::collections::BTreeSet<u64> = ds.samples.iter().map(|s| s.id).collect();
    assert_eq!(ids.len(), ds.len());
    // The folders not searched are said, 0_zero as kohya's "left out".
    assert!(
        ds.notes.iter().any(|n| n.contains("not searched")
            && n.contains("0_zero/")
            && n.contains("unsorted/")),
        "{:?}",
        ds.notes
    );

    // The same from the [data] table.
    let cfg = DataConfig::from_toml(&format!(
        "[data]\nresolution = 64\nbucket_step = 16\n[[data.dirs]]\npath = {:?}\nrepeats = 2\n",
        root.display().to_string()
    ))
    .unwrap();
    let ds2 = Dataset::open(cfg.options(3).unwrap()).unwrap();
    assert_eq!(ds2.items, ds.items);
}

#[test]
fn subfolders_outside_the_convention_are_named_in_the_error() {
    let dir = TempDir::new("kohya-miss");
    let root = dir.path().join("images");
    put(&root.join("mychar"), "a.png", (32, 32), b"a");
    put(&root.join("style"), "b.png", (32, 32), b"b");
    std::fs::create_dir_all(root.join(".hidden")).unwrap();
    for on_bad in [OnBadFile::Stop, OnBadFile::Skip] {
        let mut o = options(&root, 1, 64);
        o.on_bad_file = on_bad;
        let e = Dataset::open(o).unwrap_err();
        assert!(matches!(e, Error::Data { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("images")
                && e.contains("<repeats>_<name>")
                && e.contains("kohya")
                && e.contains("mychar/")
                && e.contains("style/")
                && !e.contains(".hidden"),
            "{e}"
        );
    }
    // A few are named, the rest counted.
    for i in 0..7 {
        std::fs::create_dir_all(root.join(format!("more{i}"))).unwrap();
    }
    let e = Dataset::open(options(&root, 1, 64))
        .unwrap_err()
        .to_string();
    assert!(e.contains("and 4 more"), "{e}");
    // With a usable image beside them, the other subfolders are left alone.
    put(&root, "top.png", (32, 32), b"top");
    let ds = Dataset::open(options(&root, 1, 64)).unwrap();
    assert_eq!(ds.items.len(), 1);
    // A folder with no subfolder and no image keeps the plain error.
    let empty = TempDir::new("no-subfolders");
    let e = Dataset::open(options(empty.path(), 1, 64))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no usable image") && !e.contains("<repeats>_<name>"),
        "{e}"
    );
}

// ----- images unfit for buckets -----------------------------------------------------------

#[test]
fn tiny_and_strip_images_are_bad_files() {
    let cfg = BucketConfig {
        resolution: 64,
        step: 16,
        max_aspect: 2.0,
    };
    assert_eq!(
        unfit(8, 8, &cfg).as_deref(),
        Some("8x8 pixels: the shorter side is under 16 (a quarter of data.resolution = 64)")
    );
    let strip = unfit(256, 1, &cfg).unwrap();
    assert!(
        strip.starts_with("256x1 pixels: a 256:1 strip: aspect ratios over 4:1 are not bucketed"),
        "{strip}"
    );
    assert!(strip.contains("under 16"), "both limits: {strip}");
    assert_eq!(
        unfit(20, 100, &cfg).as_deref(),
        Some("20x100 pixels: a 1:5 strip: aspect ratios over 4:1 are not bucketed")
    );
    // At the limits: kept.
    assert_eq!(unfit(64, 16, &cfg), None);
    assert_eq!(unfit(16, 16, &cfg), None);
    assert_eq!(
        unfit(15, 60, &cfg)
            .as_deref()
            .map(|s| s.contains("under 16")),
        Some(true)
    );
    // Just over 4:1 shows enough digits to be over.
    let near = unfit(401, 100, &cfg).unwrap();
    assert!(near.contains("a 4.01:1 strip"), "{near}");
    // A bucket cap above 4 raises the aspect limit.
    let wide = BucketConfig {
        max_aspect: 6.0,
        ..cfg
    };
    assert_eq!(unfit(100, 20, &wide), None);
    assert!(unfit(140, 20, &wide).unwrap().contains("over 6:1"));
    assert_eq!(MAX_IMAGE_ASPECT, 4.0);

    let dir = TempDir::new("unfit");
    let d = dir.path();
    put(d, "a-good.png", (64, 64), b"good");
    put(d, "b-tiny.png", (8, 8), b"tiny");
    put(d, "c-strip.png", (256, 1), b"strip");
    put(d, "d-tall.png", (20, 100), b"tall");
    put(d, "e-edge.png", (64, 16), b"edge");
    let mut o = options(d, 1, 64);
    o.on_bad_file = OnBadFile::Skip;
    let ds = Dataset::open(o.clone()).unwrap();
    let names: Vec<&str> = ds.items.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["a-good.png", "e-edge.png"]);
    let skipped: Vec<String> = ds.skipped.iter().map(|b| b.to_string()).collect();
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert!(
        skipped[0].contains("b-tiny.png")
            && skipped[0].contains(
                "8x8 pixels: the shorter side is under 16 (a quarter of data.resolution = 64)"
            ),
        "{skipped:?}"
    );
    assert!(
        skipped[1].contains("c-strip.png") && skipped[1].contains("a 256:1 strip"),
        "{skipped:?}"
    );
    assert!(
        skipped[2].contains("d-tall.png") && skipped[2].contains("1:5 strip"),
        "{skipped:?}"
    );
    // Stop: the first in path order is the error.
    o.on_bad_file = OnBadFile::Stop;
    let e = Dataset::open(o.clone()).unwrap_err();
    assert!(matches!(e, Error::Data { .. }), "{e:?}");
    assert!(
        e.to_string().contains("b-tiny.png") && e.to_string().contains("under 16"),
        "{e}"
    );
    // A lower resolution admits the tiny image (8 >= 32 / 4); the strips stay out.
    o.on_bad_file = OnBadFile::Skip;
    o.buckets.resolution = 32;
    let ds = Dataset::open(o).unwrap();
    assert_eq!(ds.items.len(), 3);
    // The plain scan knows no resolution and keeps every image.
    let s = scan(
        &[Source::Folder {
            dir: d.to_path_buf(),
            repeats: 1,
            references: vec![],
        }],
        OnBadFile::Stop,
    )
    .unwrap();
    assert_eq!(s.items.len(), 5);
}

// ----- the loss plot ----------------------------------------------------------------------

/// Top-left corners where `text` is drawn in the plot's font (turned upwards when `up`):
/// every lit pixel in the text colour and no other pixel of its box.
fn find(img: &RgbImage, text: &str, up: bool) -> Vec<(u32, u32)> {
    let scale = font_scale(img.width(), img.height());
    let (w, h, lit) = text_pixels(text, scale);
    let mut mask = vec![false; (w * h) as usize];
    for (x, y) in lit {
        mask[(y * w + x) as usize] = true;
    }
    // In image orientation: upwards text is w tall and h wide.
    let (bw, bh) = if up { (h, w) } else { (w, h) };
    let at = |x: u32, y: u32| -> bool {
        // (x, y) in the box -> the unturned text's pixel.
        let (tx, ty) = if up { (w - 1 - y, x) } else { (x, y) };
        mask[(ty * w + tx) as usize]
    };
    let mut out = vec![];
    if bw > img.width() || bh > img.height() {
        return out;
    }
    for oy in 0..=img.height() - bh {
        'pos: for ox in 0..=img.width() - bw {
            for y in 0..bh {
                for x in 0..bw {
                    let is_text = img.get_pixel(ox + x, oy + y).0 == TEXT_COLOR;
                    if is_text != at(x, y) {
                        continue 'pos;
                    }
                }
            }
            out.push((ox, oy));
        }
    }
    out
}

fn one(img: &RgbImage, text: &str, up: bool) -> (u32, u32) {
    let m = find(img, text, up);
    assert_eq!(m.len(), 1, "{text:?} (upwards {up}) drawn at {m:?}");
    m[0]
}

#[test]
fn loss_plot_has_titles_ticks_and_a_legend() {
    // The font: every character the plot writes has its own glyph.
    let chars = "0123456789.-e stpviadnglro";
    let mut seen = std::collections::BTreeSet::new();
    for c in chars.chars() {
        let g = glyph(c).unwrap_or_else(|| panic!("no glyph for {c:?}"));
        assert!(
            c == ' ' || g.iter().map(|r| r.count_ones()).sum::<u32>() >= 3,
            "{c:?}"
        );
        assert!(seen.insert(g), "{c:?} looks like another character");
    }
    assert_eq!(text_pixels("l", 1).2.len(), 10);
    assert_eq!(text_pixels("ab", 2).0, 22);
    // A character the font lacks is drawn as '?'.
    assert_eq!(text_pixels("\u{3042}", 1).2, text_pixels("?", 1).2);

    let dir = TempDir::new("plot");
    let p = dir.path().join("loss.png");
    // Steps 12..=92 (ticks 12, 32, 52, 72, 92), losses 2.5 down to 0.5 (ticks every 0.5).
    let train: Vec<(usize, f64)> = (12..=92)
        .map(|s| (s, 2.5 - 2.0 * (s - 12) as f64 / 80.0))
        .collect();
    let val = vec![(40, 1.6), (92, 0.9)];
    let (w, h) = (480u32, 320u32);
    plot_loss(&train, &val, w, h, &p).unwrap();
    let img = image::open(&p).unwrap().to_rgb8();

    // Step labels below the plot, left to right, min and max included.
    let xs: Vec<(u32, u32)> = ["12", "32", "52", "72", "92"]
        .iter()
        .map(|t| one(&img, t, false))
        .collect();
    for pair in xs.windows(2) {
        assert!(pair[0].0 < pair[1].0 && pair[0].1 == pair[1].1, "{xs:?}");
    }
    assert!(xs[0].1 > h * 3 / 4, "{xs:?}");
    // Loss labels left of the plot, bottom to top.
    let ys: Vec<(u32, u32)> = ["0.5", "1.5", "2.5"]
        .iter()
        .map(|t| one(&img, t, false))
        .collect();
    for pair in ys.windows(2) {
        assert!(pair[0].1 > pair[1].1, "{ys:?}");
    }
    assert!(ys.iter().all(|&(x, _)| x < w / 3), "{ys:?}");
    // "step" under the step labels, centred; "loss" written upwards at the left edge.
    let (sx, sy) = one(&img, "step", false);
    assert!(sy > xs[0].1 && sx > w / 3 && sx < w * 2 / 3, "{sx}, {sy}");
    let (lx, ly) = one(&img, "loss", true);
    assert!(lx < ys[0].0 && ly > h / 4 && ly < h * 3 / 4, "{lx}, {ly}");
    // The legend above the plot: both series, each after a swatch of its colour.
    let legend = |name: &str, color: [u8; 3]| {
        let (x, y) = one(&img, name, false);
        assert!(y < h / 8, "{name} at {y}");
        let th = text_pixels(name, font_scale(w, h)).1;
        let swatch = (x.saturating_sub(30)..x)
            .flat_map(|xx| (y..y + th).map(move |yy| (xx, yy)))
            .filter(|&(xx, yy)| img.get_pixel(xx, yy).0 == color)
            .count();
        assert!(swatch >= 10, "{name}: {swatch} swatch pixels");
        x
    };
    let tx = legend("training loss", TRAIN_COLOR);
    let vx = legend("validation loss", VAL_COLOR);
    assert!(tx < vx);

    // Without validation data: no validation entry and no orange at all.
    plot_loss(&train, &[], w, h, &p).unwrap();
    let img = image::open(&p).unwrap().to_rgb8();
    legend_only(&img, true);
    assert!(img.pixels().all(|px| px.0 != VAL_COLOR));
    // Without data: titles and ticks, no legend.
    plot_loss(&[], &[], w, h, &p).unwrap();
    let img = image::open(&p).unwrap().to_rgb8();
    legend_only(&img, false);
    one(&img, "step", false);
    one(&img, "loss", true);
    assert!(img.pixels().all(|px| px.0 != TRAIN_COLOR));
    // A small plot uses the font unscaled and still has its titles.
    plot_loss(&train, &val, 200, 120, &p).unwrap();
    let img = image::open(&p).unwrap().to_rgb8();
    assert_eq!(font_scale(200, 120), 1);
    one(&img, "step", false);
    one(&img, "loss", true);
    one(&img, "92", false);
}

/// Whether the legend of `img` names the training loss (as `training` says) and never the
/// validation loss.
fn legend_only(img: &RgbImage, training: bool) {
    assert_eq!(find(img, "training loss", false).len(), training as usize);
    assert!(find(img, "validation loss", false).is_empty());
}

#[test]
fn nested_folders_huge_repeats_and_undecodable_paths_are_said() {
    let dir = TempDir::new("kohya-nested");
    let root = dir.path().join("images");
    put(&root.join("2_set"), "a.png", (32, 32), b"a");
    put(&root.join("2_set").join("deeper"), "b.png", (32, 32), b"b");
    let ds = Dataset::open(options(&root, 1, 64)).unwrap();
    assert_eq!(ds.items.len(), 1);
    assert!(
        ds.notes
            .iter()
            .any(|n| n.contains("2_set") && n.contains("deeper/")),
        "{:?}",
        ds.notes
    );

    // A folder name asking for more repeats than a machine counts: the number as written.
    let huge = "99999999999999999999999";
    put(&root.join(format!("{huge}_x")), "c.png", (32, 32), b"c");
    let e = Dataset::open(options(&root, 1, 64))
        .unwrap_err()
        .to_string();
    assert!(e.contains(huge) && e.contains("at most 100000"), "{e}");
    std::fs::remove_dir_all(root.join(format!("{huge}_x"))).unwrap();
    let e = Dataset::open(options(&root, 100_001, 64))
        .unwrap_err()
        .to_string();
    assert!(e.contains("repeats = 100001"), "{e}");

    // A file name that is not UTF-8 is a bad file (the caches key images by path).
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let name = std::ffi::OsStr::from_bytes(b"caf\xe9.png");
        let p = root.join("2_set").join(name);
        std::fs::copy(root.join("2_set/a.png"), &p).unwrap();
        std::fs::write(p.with_extension("txt"), b"cafe").unwrap();
        let e = Dataset::open(options(&root, 1, 64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid UTF-8") && e.contains("rename"), "{e}");
        let mut o = options(&root, 1, 64);
        o.on_bad_file = OnBadFile::Skip;
        let ds = Dataset::open(o).unwrap();
        assert_eq!(ds.items.len(), 1);
        assert!(ds.skipped.iter().any(|b| b.reason.contains("UTF-8")));
    }
}
