//! `flame::data`: sources, buckets, crops, resizing, captions, the batch sampler, the caches
//! and PNG output. Images are made by each test in its own temporary folder.
//!
//! Reference values: bucket sizes, geometries and SDXL numbers are worked out by hand in the
//! comments; the resize is checked against PIL's float resize (tests/fixtures/data/resize.json,
//! made by scripts/make_data_fixtures.py) within RESIZE_TOL; 8-bit pixels must round-trip
//! exactly.
#![cfg(feature = "cpu-ref")]

use flame::data::bucket::{closest, decode, to_tensor};
use flame::data::{
    buckets, save_png, Bucket, BucketConfig, CaptionOptions, CropMode, DataConfig, Dataset,
    DatasetOptions, Geometry, LatentCache, OnBadFile, Progress, Resample, Source, TextCache,
};
use flame::{DType, Device, Error, Result, Tensor};
use image::{Rgb, RgbImage};
use std::path::{Path, PathBuf};

/// |FLAME - PIL| on [-1, 1] values: the image crate computes its weights in f32, PIL in f64
/// (measured: at most 8.3e-7 over the four cases).
const RESIZE_TOL: f32 = 5e-6;

/// A fresh temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flame-data-{name}-{}", std::process::id()));
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

/// An image whose pixel (x, y) is a function of its position and `salt`.
fn pattern(w: u32, h: u32, salt: u8) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        Rgb([
            (x * 7 + y * 3 + salt as u32) as u8,
            (x * 11 + 50) as u8,
            (y * 13 + salt as u32 * 2) as u8,
        ])
    })
}

/// Saves `img` as `dir/name` (format from the extension) with `caption` beside it.
fn put(dir: &Path, name: &str, img: &RgbImage, caption: Option<&str>) -> PathBuf {
    let p = dir.join(name);
    img.save(&p).unwrap();
    if let Some(c) = caption {
        std::fs::write(p.with_extension("txt"), c).unwrap();
    }
    p
}

fn options(dir: &Path, resolution: usize, step: usize) -> DatasetOptions {
    DatasetOptions {
        sources: vec![Source::Folder {
            dir: dir.to_path_buf(),
            repeats: 1,
            references: vec![],
        }],
        buckets: BucketConfig {
            resolution,
            step,
            max_aspect: 2.0,
        },
        crop: CropMode::Center,
        flip: false,
        resample: Resample::Lanczos3,
        captions: CaptionOptions::default(),
        on_bad_file: OnBadFile::Stop,
        seed: 7,
        references: Default::default(),
    }
}

fn bucket(width: usize, height: usize) -> Bucket {
    Bucket { width, height }
}

// ----- buckets and geometry ---------------------------------------------------------------

#[test]
fn buckets_at_1024() {
    let cfg = BucketConfig::default();
    let b = buckets(&cfg).unwrap();
    let area = 1024 * 1024;
    for x in &b {
        assert!(x.width % 64 == 0 && x.height % 64 == 0, "{x}");
        assert!(x.width * x.height <= area, "{x}");
        let aspect = (x.width as f64 / x.height as f64).max(x.height as f64 / x.width as f64);
        assert!(aspect <= 2.0, "{x}");
        // The largest height for its width, or the transpose of such a bucket.
        assert!(
            x.width * (x.height + 64) > area || x.height * (x.width + 64) > area,
            "{x}"
        );
    }
    for w in b.windows(2) {
        assert!(
            w[0].width * w[1].height < w[1].width * w[0].height,
            "sorted by W/H"
        );
    }
    // By hand, the largest height for each width (1048576 / W, floored to 64) with an aspect
    // of at most 2: 768x1344 (1.75; 704 -> 1472 is 2.09), 832x1216, 896x1152, 960x1088,
    // 1024x1024, 1088x960, 1152x896, 1216x832, 1280x768, 1344x768, 1408x704 (2.0; 1472 ->
    // 704 is out); their transposes add 704x1408 and 768x1280: 13 buckets.
    let want = [
        (704, 1408),
        (768, 1344),
        (768, 1280),
        (832, 1216),
        (896, 1152),
        (960, 1088),
        (1024, 1024),
        (1088, 960),
        (1152, 896),
        (1216, 832),
        (1280, 768),
        (1344, 768),
        (1408, 704),
    ];
    assert_eq!(b, want.map(|(w, h)| bucket(w, h)));

    assert!(buckets(&BucketConfig {
        resolution: 32,
        step: 64,
        max_aspect: 2.0
    })
    .is_err());
    assert!(buckets(&BucketConfig {
        resolution: 1024,
        step: 64,
        max_aspect: 0.5
    })
    .is_err());
}

#[test]
fn closest_bucket_and_geometry() {
    let b = buckets(&BucketConfig::default()).unwrap();
    // 640x480 (4:3): 1152x896 (1.286) is closer in log ratio than 1216x832 (1.462).
    assert_eq!(closest(&b, 640, 480), Some(bucket(1152, 896)));
    assert_eq!(closest(&b, 480, 640), Some(bucket(896, 1152)));
    assert_eq!(closest(&b, 3000, 1000), Some(bucket(1408, 704)));
    assert_eq!(closest(&b, 500, 500), Some(bucket(1024, 1024)));
    for (w, h) in [(100, 37), (37, 100), (999, 1001), (1920, 1080)] {
        let got = closest(&b, w, h).unwrap();
        let d = |x: Bucket| {
            ((x.width as f64 / x.height as f64) / (w as f64 / h as f64))
                .ln()
                .abs()
        };
        assert!(b.iter().all(|&x| d(got) <= d(x)), "{w}x{h} -> {got}");
    }

    // Scale max(1152/640, 896/480) = 1.8667: 640 -> 1194.67 -> 1195, 480 -> 896.
    let g = Geometry::new(640, 480, bucket(1152, 896), CropMode::Center, 0, 0);
    assert_eq!((g.resized_width, g.resized_height), (1195, 896));
    assert_eq!((g.left, g.top), (21, 0));
    assert_eq!(g.time_ids(false), [480, 640, 0, 21, 896, 1152]);
    // Mirrored: the crop's left edge in the mirrored image is 1195 - 1152 - 21 = 22.
    assert_eq!(g.time_ids(true), [480, 640, 0, 22, 896, 1152]);

    // Random crops: within the margin, a function of (seed, id), spread over it.
    let mut lefts = std::collections::BTreeSet::new();
    for id in 0..300u64 {
        let r = Geometry::new(640, 480, bucket(1152, 896), CropMode::Random, 3, id);
        assert!(r.left <= 43 && r.top == 0, "{r:?}");
        assert_eq!(
            r,
            Geometry::new(640, 480, bucket(1152, 896), CropMode::Random, 3, id)
        );
        lefts.insert(r.left);
    }
    assert!(
        lefts.contains(&0) && lefts.contains(&43) && lefts.len() > 30,
        "{lefts:?}"
    );
    let a: Vec<usize> = (0..20)
        .map(|id| Geometry::new(640, 480, bucket(1152, 896), CropMode::Random, 1, id).left)
        .collect();
    let b2: Vec<usize> = (0..20)
        .map(|id| Geometry::new(640, 480, bucket(1152, 896), CropMode::Random, 2, id).left)
        .collect();
    assert_ne!(a, b2, "the seed changes the crops");
}

// ----- images to tensors ------------------------------------------------------------------

#[test]
fn pixels_crop_and_flip_exact() {
    let dir = TempDir::new("pixels");
    let img = pattern(16, 8, 5);
    put(dir.path(), "a.png", &img, Some("a"));
    // Resolution 12, step 8: the buckets are 8x16 and 16x8 (144 / 16 = 9 -> 8), so a 16x8
    // image needs no resize.
    let mut o = options(dir.path(), 12, 8);
    o.flip = true;
    let ds = Dataset::open(o).unwrap();
    assert_eq!(ds.buckets, vec![bucket(8, 16), bucket(16, 8)]);
    assert_eq!(ds.samples[0].geometry.bucket, bucket(16, 8));
    let value = |x: u32, y: u32, c: usize| img.get_pixel(x, y).0[c] as f32 / 255.0 * 2.0 - 1.0;
    let flips: Vec<bool> = (0..16).map(|e| ds.flip(0, e).unwrap()).collect();
    assert!(flips.contains(&true) && flips.contains(&false), "{flips:?}");
    for e in 0..4u64 {
        let t = ds.image(0, e, &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[3, 8, 16]);
        let v = t.to_vec::<f32>().unwrap();
        let f = ds.flip(0, e).unwrap();
        for c in 0..3 {
            for y in 0..8 {
                for x in 0..16 {
                    let sx = if f { 15 - x } else { x };
                    assert_eq!(v[(c * 8 + y) * 16 + x], value(sx as u32, y as u32, c));
                }
            }
        }
        assert_eq!(ds.time_ids(0, e).unwrap(), [8, 16, 0, 0, 8, 16]);
    }
}

#[test]
fn crop_offsets_in_pixels() {
    // A 20x8 image in bucket 16x8 needs no resize (scale max(16/20, 8/8) = 1): a centre crop
    // takes columns 2..18.
    let img = pattern(20, 8, 1);
    let f = image::DynamicImage::ImageRgb8(img.clone()).to_rgb32f();
    let g = Geometry::new(20, 8, bucket(16, 8), CropMode::Center, 0, 0);
    assert_eq!((g.resized_width, g.left), (20, 2));
    let t = to_tensor(
        &f,
        &g,
        Resample::Lanczos3,
        false,
        Path::new("x"),
        &Device::Cpu,
    )
    .unwrap();
    let v = t.to_vec::<f32>().unwrap();
    let want = |x: u32, y: u32, c: usize| img.get_pixel(x, y).0[c] as f32 / 255.0 * 2.0 - 1.0;
    assert_eq!(v[0], want(2, 0, 0));
    assert_eq!(v[15], want(17, 0, 0));
    // Mirrored, the first column is source column 17, and SDXL's left is 20 - 16 - 2 = 2.
    let t = to_tensor(
        &f,
        &g,
        Resample::Lanczos3,
        true,
        Path::new("x"),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap()[0], want(17, 0, 0));
    assert_eq!(g.left_seen(true), 2);
}

#[test]
fn inconsistent_geometry_is_an_error() {
    let f = image::DynamicImage::ImageRgb8(pattern(20, 8, 1)).to_rgb32f();
    let mut g = Geometry::new(20, 8, bucket(16, 8), CropMode::Center, 0, 0);
    g.left = 5;
    let e = to_tensor(
        &f,
        &g,
        Resample::Lanczos3,
        false,
        Path::new("x.png"),
        &Device::Cpu,
    )
    .unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let g = Geometry::new(30, 8, bucket(16, 8), CropMode::Center, 0, 0);
    let e = to_tensor(
        &f,
        &g,
        Resample::Lanczos3,
        false,
        Path::new("x.png"),
        &Device::Cpu,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("x.png") && e.to_string().contains("30x8"),
        "{e}"
    );
}

#[test]
fn constant_image_stays_constant() {
    let img = RgbImage::from_pixel(37, 23, Rgb([100, 30, 250]));
    let f = image::DynamicImage::ImageRgb8(img).to_rgb32f();
    for r in [Resample::Lanczos3, Resample::CatmullRom] {
        for b in [bucket(16, 8), bucket(64, 48), bucket(24, 24)] {
            let g = Geometry::new(37, 23, b, CropMode::Center, 0, 0);
            let v = to_tensor(&f, &g, r, false, Path::new("x"), &Device::Cpu)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let n = b.width * b.height;
            for (c, want) in [100.0f32, 30.0, 250.0].iter().enumerate() {
                let want = want / 255.0 * 2.0 - 1.0;
                for &x in &v[c * n..(c + 1) * n] {
                    assert!((x - want).abs() < 1e-5, "{r:?} {b}: {x} vs {want}");
                }
            }
        }
    }
}

#[derive(serde::Deserialize)]
struct ResizeFixture {
    source: [u32; 2],
    cases: Vec<ResizeCase>,
}

#[derive(serde::Deserialize)]
struct ResizeCase {
    filter: String,
    size: [usize; 2],
    values: Vec<Vec<Vec<f32>>>,
}

#[test]
fn resize_matches_pil() {
    let text = std::fs::read_to_string("tests/fixtures/data/resize.json").unwrap();
    let fx: ResizeFixture = serde_json::from_str(&text).unwrap();
    let [w, h] = fx.source;
    // The formula of scripts/make_data_fixtures.py, in f32.
    let src = image::Rgb32FImage::from_fn(w, h, |x, y| {
        let v = |c: u32| {
            0.5f32
                + 0.4f32
                    * (0.3f32 * x as f32 + 0.2f32 * y as f32 + (1.1f64 * c as f64) as f32).sin()
        };
        Rgb([v(0), v(1), v(2)])
    });
    assert_eq!(fx.cases.len(), 4);
    for case in &fx.cases {
        let r = match case.filter.as_str() {
            "lanczos3" => Resample::Lanczos3,
            _ => Resample::CatmullRom,
        };
        let [bw, bh] = case.size;
        let g = Geometry {
            orig_width: w as usize,
            orig_height: h as usize,
            resized_width: bw,
            resized_height: bh,
            bucket: bucket(bw, bh),
            left: 0,
            top: 0,
        };
        let v = to_tensor(&src, &g, r, false, Path::new("x"), &Device::Cpu)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let mut worst = 0f32;
        for c in 0..3 {
            for y in 0..bh {
                for x in 0..bw {
                    let want = case.values[c][y][x] * 2.0 - 1.0;
                    worst = worst.max((v[(c * bh + y) * bw + x] - want).abs());
                }
            }
        }
        eprintln!("{} to {bw}x{bh}: max error {worst:e}", case.filter);
        assert!(
            worst < RESIZE_TOL,
            "{} to {bw}x{bh}: max error {worst}",
            case.filter
        );
    }
}

#[test]
fn jpeg_and_webp_sources() {
    let dir = TempDir::new("formats");
    let img = pattern(24, 16, 9);
    put(dir.path(), "b.jpg", &img, Some("jpeg"));
    put(dir.path(), "c.webp", &img, Some("webp"));
    put(dir.path(), "a.png", &img, Some("png"));
    std::fs::write(dir.path().join("notes.md"), "not an image").unwrap();
    let ds = Dataset::open(options(dir.path(), 16, 8)).unwrap();
    let names: Vec<&str> = ds.items.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["a.png", "b.jpg", "c.webp"], "sorted by path");
    let caps: Vec<&str> = ds.items.iter().map(|i| i.caption.as_str()).collect();
    assert_eq!(caps, ["png", "jpeg", "webp"]);
    // Lossless WebP and PNG decode to the same pixels; JPEG is close.
    let png = ds
        .image(0, 0, &Device::Cpu)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let webp = ds
        .image(2, 0, &Device::Cpu)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(png, webp);
    let jpg = ds
        .image(1, 0, &Device::Cpu)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mean_err: f32 = png
        .iter()
        .zip(&jpg)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / png.len() as f32;
    assert!(mean_err < 0.1, "{mean_err}");
}

// ----- sources: repeats, manifests, bad files ---------------------------------------------

#[test]
fn repeats_and_manifest() {
    let dir = TempDir::new("repeats");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    put(&a, "1.png", &pattern(40, 24, 1), Some("one"));
    put(&a, "2.png", &pattern(24, 40, 2), Some("two"));
    put(&b, "3.png", &pattern(32, 32, 3), Some("three"));
    let mut o = options(&a, 32, 8);
    o.sources = vec![
        Source::Folder {
            dir: a.clone(),
            repeats: 3,
            references: vec![],
        },
        Source::Folder {
            dir: b.clone(),
            repeats: 1,
            references: vec![],
        },
    ];
    o.crop = CropMode::Random;
    let ds = Dataset::open(o).unwrap();
    assert_eq!(ds.len(), 7);
    let repeats: Vec<(usize, usize)> = ds.samples.iter().map(|s| (s.item, s.repeat)).collect();
    assert_eq!(
        repeats,
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    );
    let ids: std::collections::BTreeSet<u64> = ds.samples.iter().map(|s| s.id).collect();
    assert_eq!(ids.len(), 7, "every repeat has its own id");

    // A manifest with the same images: paths relative to it, captions from it.
    let m = dir.path().join("m.jsonl");
    std::fs::write(
        &m,
        "{\"file\": \"b/3.png\", \"caption\": \"from manifest\"}\n\n{\"file\": \"a/1.png\", \"caption\": \"x\"}\n",
    )
    .unwrap();
    let mut o = options(&a, 32, 8);
    o.sources = vec![Source::Manifest {
        path: m.clone(),
        repeats: 2,
    }];
    let ds = Dataset::open(o.clone()).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(ds.items[0].caption, "from manifest");
    assert_eq!(ds.items[0].path, dir.path().join("b/3.png"));
    assert_eq!((ds.items[1].width, ds.items[1].height), (40, 24));

    // A malformed line is an error naming the manifest and the line.
    std::fs::write(
        &m,
        "{\"file\": \"b/3.png\", \"caption\": \"c\"}\n{\"file\": 3}\n",
    )
    .unwrap();
    let e = Dataset::open(o.clone()).unwrap_err().to_string();
    assert!(e.contains("m.jsonl") && e.contains("line 2"), "{e}");
    std::fs::write(
        &m,
        "{\"file\": \"b/3.png\", \"caption\": \"c\", \"extra\": 1}\n",
    )
    .unwrap();
    let e = Dataset::open(o).unwrap_err().to_string();
    assert!(e.contains("line 1") && e.contains("extra"), "{e}");
}

#[test]
fn bad_files_skipped_or_fatal() {
    let dir = TempDir::new("bad");
    put(dir.path(), "good.png", &pattern(16, 16, 1), Some("fine"));
    put(dir.path(), "nocaption.png", &pattern(16, 16, 2), None);
    std::fs::write(dir.path().join("garbage.png"), b"this is not a png").unwrap();
    std::fs::write(dir.path().join("garbage.txt"), "caption of garbage").unwrap();
    std::fs::write(dir.path().join("empty.png"), [0u8; 0]).unwrap();
    std::fs::write(dir.path().join("empty.txt"), "caption").unwrap();
    put(dir.path(), "badtext.png", &pattern(16, 16, 3), None);
    std::fs::write(dir.path().join("badtext.txt"), [0xff, 0xfe, 0x41]).unwrap();

    let mut o = options(dir.path(), 16, 8);
    o.on_bad_file = OnBadFile::Skip;
    let ds = Dataset::open(o.clone()).unwrap();
    assert_eq!(ds.items.len(), 1);
    assert_eq!(ds.items[0].name, "good.png");
    let skipped: Vec<String> = ds.skipped.iter().map(|b| b.to_string()).collect();
    assert_eq!(skipped.len(), 4, "{skipped:?}");
    let find = |name: &str| {
        skipped
            .iter()
            .find(|s| s.contains(name))
            .unwrap_or_else(|| panic!("{name} not reported: {skipped:?}"))
            .clone()
    };
    assert!(find("nocaption.png").contains("no caption file"));
    assert!(find("garbage.png").contains("image"));
    assert!(find("badtext.png").contains("not UTF-8"));
    let empty = find("empty.png");
    assert!(empty.contains("image"), "{empty}");

    o.on_bad_file = OnBadFile::Stop;
    let e = Dataset::open(o).unwrap_err();
    assert!(matches!(e, Error::Data { .. }), "{e:?}");
    // The first bad file in path order.
    assert!(e.to_string().contains("badtext.png"), "{e}");

    // Only bad files: an error, not an empty dataset.
    let only = TempDir::new("bad-only");
    put(only.path(), "x.png", &pattern(8, 8, 1), None);
    let mut o = options(only.path(), 16, 8);
    o.on_bad_file = OnBadFile::Skip;
    let e = Dataset::open(o).unwrap_err().to_string();
    assert!(
        e.contains("no usable image") && e.contains("1 file(s) left out"),
        "{e}"
    );
}

// ----- captions ---------------------------------------------------------------------------

#[test]
fn caption_dropout_and_shuffle() {
    let drop = CaptionOptions {
        dropout: 0.3,
        ..CaptionOptions::default()
    };
    let n = 4000u64;
    let dropped = (0..n)
        .filter(|&id| drop.apply("a cat", 1, 0, id).is_empty())
        .count();
    // Binomial(4000, 0.3): sd 29, so +-150 is over 5 sd.
    assert!((1050..=1350).contains(&dropped), "{dropped}");
    for id in 0..50 {
        assert_eq!(drop.apply("a cat", 1, 2, id), drop.apply("a cat", 1, 2, id));
    }
    let by_epoch: Vec<bool> = (0..64)
        .map(|e| drop.apply("x", 1, e, 5).is_empty())
        .collect();
    assert!(
        by_epoch.contains(&true) && by_epoch.contains(&false),
        "drawn per epoch"
    );
    let never = CaptionOptions::default();
    let always = CaptionOptions {
        dropout: 1.0,
        ..CaptionOptions::default()
    };
    assert!((0..100).all(|id| never.apply("a cat", 0, 0, id) == "a cat"));
    assert!((0..100).all(|id| always.apply("a cat", 0, 0, id).is_empty()));

    let shuffle = CaptionOptions {
        shuffle_tags: true,
        keep_tokens: 2,
        ..CaptionOptions::default()
    };
    let cap = "sks person, photo,  red hat, smiling,, outdoors, sunny, bokeh, 35mm";
    let mut orders = std::collections::BTreeSet::new();
    for e in 0..20 {
        let s = shuffle.apply(cap, 9, e, 11);
        assert_eq!(s, shuffle.apply(cap, 9, e, 11), "reproducible");
        let tags: Vec<&str> = s.split(", ").collect();
        assert_eq!(tags[..2], ["sks person", "photo"], "{s}");
        let mut sorted = tags.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            [
                "35mm",
                "bokeh",
                "outdoors",
                "photo",
                "red hat",
                "sks person",
                "smiling",
                "sunny"
            ]
        );
        orders.insert(s);
    }
    assert!(orders.len() > 10, "{orders:?}");
    assert_ne!(shuffle.apply(cap, 9, 0, 11), shuffle.apply(cap, 10, 0, 11));
}

// ----- the batch sampler ------------------------------------------------------------------

#[test]
fn sampler_batches_one_bucket_per_batch() {
    let dir = TempDir::new("sampler");
    // 5 wide, 3 tall, 4 square images at resolution 32, step 8.
    for i in 0..12u8 {
        let (w, h) = match i % 3 {
            0 if i < 10 => (48, 24),
            1 if i < 9 => (24, 48),
            _ => (32, 32),
        };
        put(
            dir.path(),
            &format!("{i:02}.png"),
            &pattern(w, h, i),
            Some("c"),
        );
    }
    let ds = Dataset::open(options(dir.path(), 32, 8)).unwrap();
    let s = ds.sampler(2, false).unwrap();
    let sizes: Vec<usize> = s.bucket_sizes().iter().map(|(_, n)| *n).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 12);
    let per_epoch = s.batches_per_epoch();
    assert_eq!(
        per_epoch,
        sizes.iter().map(|n| n.div_ceil(2)).sum::<usize>()
    );
    let mut seen_orders = std::collections::BTreeSet::new();
    for e in 0..4 {
        let batches = s.epoch(e);
        assert_eq!(batches, s.epoch(e), "a function of (seed, epoch)");
        assert_eq!(batches.len(), per_epoch);
        let mut all: Vec<usize> = batches.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(
            all,
            (0..12).collect::<Vec<_>>(),
            "each sample once an epoch"
        );
        for b in &batches {
            let b0 = ds.samples[b[0]].geometry.bucket;
            assert!(b.iter().all(|&i| ds.samples[i].geometry.bucket == b0));
        }
        for (k, b) in batches.iter().enumerate() {
            assert_eq!(s.batch_at(e as usize * per_epoch + k), (e, b.clone()));
        }
        seen_orders.insert(batches);
    }
    assert!(seen_orders.len() > 1, "epochs differ");

    let full = ds.sampler(2, true).unwrap();
    assert!(full.epoch(0).iter().all(|b| b.len() == 2));
    assert_eq!(
        full.batches_per_epoch(),
        sizes.iter().map(|n| n / 2).sum::<usize>()
    );
    assert!(ds.sampler(0, false).is_err());
    assert!(ds.sampler(100, true).is_err());

    let mut other = options(dir.path(), 32, 8);
    other.seed = 8;
    let ds2 = Dataset::open(other).unwrap();
    assert_ne!(
        ds2.sampler(2, false).unwrap().epoch(0),
        s.epoch(0),
        "seeded"
    );
}

#[path = "data/cache.rs"]
mod cache;

// ----- PNG output -------------------------------------------------------------------------

#[test]
fn png_round_trip() {
    let dir = TempDir::new("png");
    let img = pattern(13, 7, 4);
    let p = put(dir.path(), "src.png", &img, None);
    let f = decode(&p).unwrap();
    let g = Geometry::new(13, 7, bucket(13, 7), CropMode::Center, 0, 0);
    let t = to_tensor(&f, &g, Resample::Lanczos3, false, &p, &Device::Cpu).unwrap();
    let out = dir.path().join("out.png");
    save_png(&t, &out).unwrap();
    assert_eq!(
        image::open(&out).unwrap().to_rgb8(),
        img,
        "8-bit values round-trip exactly"
    );
    // bf16 and out-of-range values: clamped, no error; a wrong shape is an error.
    let t2 = t.affine(2.0, 0.0).unwrap().to_dtype(DType::BF16).unwrap();
    save_png(&t2, &out).unwrap();
    let back = image::open(&out).unwrap().to_rgb8();
    assert_eq!(back.dimensions(), (13, 7));
    assert!(save_png(&t.narrow(0, 0, 2).unwrap(), &out).is_err());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");
}

#[test]
fn loss_plot() {
    let dir = TempDir::new("plot");
    let p = dir.path().join("loss.png");
    let train: Vec<(usize, f64)> = (1..=200).map(|s| (s, 1.0 / (s as f64).sqrt())).collect();
    let val: Vec<(usize, f64)> = vec![(50, 0.2), (100, f64::NAN), (150, 0.12), (200, 0.1)];
    flame::data::plot_loss(&train, &val, 480, 320, &p).unwrap();
    let img = image::open(&p).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), (480, 320));
    let count = |c: [u8; 3]| img.pixels().filter(|px| px.0 == c).count();
    assert!(count(flame::data::png::TRAIN_COLOR) > 300);
    assert!(count(flame::data::png::VAL_COLOR) > 50);
    assert!(count([0, 0, 0]) > 400, "axes and labels");
    // The training curve falls: its leftmost pixels sit above its rightmost.
    let rows_at = |x: u32| {
        (0..320)
            .filter(|&y| img.get_pixel(x, y).0 == flame::data::png::TRAIN_COLOR)
            .collect::<Vec<_>>()
    };
    let (left_col, right_col) = (
        (0..480).find(|&x| !rows_at(x).is_empty()).unwrap(),
        (0..480).rev().find(|&x| !rows_at(x).is_empty()).unwrap(),
    );
    assert!(rows_at(left_col)[0] < rows_at(right_col)[0]);
    // Rewritten in place; an empty plot is fine; a tiny one is an error.
    flame::data::plot_loss(&[], &[], 200, 100, &p).unwrap();
    assert_eq!(image::open(&p).unwrap().width(), 200);
    assert!(flame::data::plot_loss(&train, &val, 10, 10, &p).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

// ----- config -----------------------------------------------------------------------------

#[test]
fn config_defaults_and_problems() {
    let c = DataConfig::from_toml("[data]\n[[data.dirs]]\npath = \"imgs\"\n").unwrap();
    assert_eq!(c.dirs[0].repeats, 1);
    assert_eq!((c.resolution, c.bucket_step, c.max_aspect), (1024, 64, 2.0));
    assert_eq!(
        (c.crop, c.on_bad_file, c.resample),
        (CropMode::Center, OnBadFile::Stop, Resample::Lanczos3)
    );
    let o = c.options(5).unwrap();
    assert_eq!(o.seed, 5);
    assert_eq!(o.buckets, BucketConfig::default());
    assert_eq!(
        o.sources,
        [Source::Folder {
            dir: "imgs".into(),
            repeats: 1,
            references: vec![],
        }]
    );

    let text = "[model]\narch = \"flux\"\n\n[data]\nresolution = 32\nbucket_step = 64\ncrop = \"middle\"\ncaption_dropout = 1.5\non_bad_file = \"ignore\"\nmanifest = \"m.jsonl\"\n\n[[data.dirs]]\npath = \"a\"\nrepeats = 0\n";
    let e = DataConfig::from_toml(text).unwrap_err().to_string();
    for want in [
        "line 5: data.resolution = 32",
        "line 7: data.crop = \"middle\"",
        "line 8: data.caption_dropout = 1.5",
        "line 9: data.on_bad_file = \"ignore\"",
        "line 12: data.dirs = entry 1 (a): repeats = 0",
        "both data.dirs and data.manifest",
    ] {
        assert!(e.contains(want), "missing {want:?} in:\n{e}");
    }
    let e = DataConfig::from_toml("[data]\nresolutoin = 512\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("resolutoin") && e.contains("line 2"), "{e}");
    let e = DataConfig::from_toml("[data]\nflip = \"yes\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("flip"), "{e}");
    // Each key fine alone, but no bucket: 64x64 is not the largest height for width 64.
    let e = DataConfig::from_toml("[data]\nmanifest = \"m\"\nresolution = 100\nmax_aspect = 1.0\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 4: data.max_aspect = 1: ") && e.contains("no bucket"),
        "{e}"
    );
    let e = DataConfig::from_toml("[data]\n").unwrap_err().to_string();
    assert!(e.contains("no image source"), "{e}");

    // From a file, relative paths join its folder.
    let dir = TempDir::new("config");
    let f = dir.path().join("train.toml");
    std::fs::write(
        &f,
        "[data]\nmanifest = \"m.jsonl\"\ncache_dir = \"/abs/cache\"\nflip = true\n",
    )
    .unwrap();
    let c = DataConfig::from_file(&f).unwrap();
    assert_eq!(c.manifest, Some(dir.path().join("m.jsonl")));
    assert_eq!(c.cache_dir, Some(PathBuf::from("/abs/cache")));
    assert!(c.flip);
}
