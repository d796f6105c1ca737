//! Where training images and their captions come from: folders of images with a `.txt`
//! caption beside each (`cat.png` + `cat.txt`), or a JSONL manifest with one
//! `{"file": "...", "caption": "..."}` object a line (`file` relative to the manifest's
//! folder). Every source has a `repeats` count: its images appear that many times an epoch.
//!
//! Edit training (FLUX.2 \[klein\]) gives each image the reference images it was made from
//! ([`Item::references`], sized as [`super::reference`] says):
//! - a folder source names reference folders (ai-toolkit's `control_path`, one folder or a
//!   list): reference i of an image is the image of the same name in folder i, whatever its
//!   extension (`edits/cat.png` takes `control/cat.jpg`; a `<repeats>_<name>` subfolder's
//!   image `10_x/cat.png` takes `control/10_x/cat.*`), the first of png, jpg, jpeg, webp
//!   (lower case, then upper);
//! - a manifest line lists them: `"references": ["a.png", "b.png"]` (FLAME's), or
//!   musubi-tuner's `"control_path": "a.png"` (a string or a list) or numbered
//!   `"control_path_0"`, `"control_path_1"`, ...; its target may be named `"image_path"`
//!   (musubi-tuner's) instead of `"file"`. Paths are relative to the manifest's folder.
//!
//! A reference that is missing, unreadable or unfit ([`super::reference::unfit`]) makes its
//! image a [`BadFile`] naming the image and the reference; a reference folder that does not
//! exist is an error.
//!
//! A folder's subfolders are searched only when named `<repeats>_<name>` (a number >= 1, an
//! underscore, any name: `10_mychar`, `3_style`), the layout kohya's sd-scripts read: each
//! such subfolder is scanned as a folder of its own whose images appear (that number × the
//! folder's `repeats`) times an epoch, and its images are named `<subfolder>/<file>` so that
//! two subfolders holding the same file names stay distinct. Images directly in the folder
//! are scanned as well, with the folder's `repeats`; other subfolders (`0_name` included,
//! which kohya leaves out) and the subfolders of a `<repeats>_<name>` folder are not
//! searched, and the scan says so in [`Scan::notes`]. A folder that gives no usable image
//! while holding subfolders that do not follow the convention is an error that names some
//! of them. An image appears at most [`MAX_REPEATS`] times an epoch.
//!
//! Image paths must be valid UTF-8 (the caches key images by path): one that is not is a
//! bad file.
//!
//! Captions are UTF-8 (a leading byte-order mark is dropped), or UTF-16 when they start
//! with its byte-order mark (`FF FE` little-endian, `FE FF` big-endian). A caption that is
//! neither is read as Windows-1252 (every byte is a character; the five bytes that table
//! leaves undefined stand for the Latin-1 control characters of the same value), and the
//! scan says so in [`Scan::notes`]. A manifest is JSON and must be UTF-8; a leading
//! byte-order mark is dropped.
//!
//! A scan reads each image's header (format and size, not the pixels) and its caption. An
//! image that cannot be opened or recognised, or whose caption is missing or cannot be
//! decoded, is a [`BadFile`] named by its path: collected into [`Scan::skipped`] with
//! [`OnBadFile::Skip`], or the scan's error with [`OnBadFile::Stop`]. [`scan_for`] also
//! leaves out images too small or too elongated for a [`BucketConfig`]
//! ([`crate::data::bucket::unfit`]) the same way. Pixels that fail to decode later (a
//! truncated file) follow the same option where the images are decoded
//! ([`crate::data::LatentCache::fill`]).

use super::bucket::{unfit, BucketConfig};
use super::{data_err, io_err};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The image file extensions a folder source picks up (case-insensitive).
pub const IMAGE_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "webp"];

/// How many subfolder names an error or note about a folder's subfolders lists.
const LISTED_SUBFOLDERS: usize = 5;

/// The most times one image may appear in an epoch (a source's `repeats` times a
/// `<repeats>_<name>` subfolder's number): kohya's datasets use 1 to a few hundred.
pub const MAX_REPEATS: usize = 100_000;

/// One source of images.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The images of a folder, each with a `.txt` caption of the same stem beside it, in
    /// path order; then the images of its `<repeats>_<name>` subfolders (module docs),
    /// subfolders in name order. Other subfolders are not searched.
    Folder {
        /// The folder.
        dir: PathBuf,
        /// Times each image appears in an epoch (at least 1); a `<repeats>_<name>`
        /// subfolder's images appear this times its number.
        repeats: usize,
        /// Reference folders (edit training; module docs): each image's reference i is its
        /// namesake in folder i. Empty: no references.
        references: Vec<PathBuf>,
    },
    /// A JSONL file of `{"file": ..., "caption": ...}` lines (blank lines ignored); `file`
    /// relative to the manifest's folder; in line order. A line may list reference images
    /// (module docs).
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// Times each image appears in an epoch (at least 1).
        repeats: usize,
    },
}

/// What to do with an image or caption that cannot be used ("skip" or "stop" in a config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBadFile {
    /// Leave the image out and report it ([`Scan::skipped`], [`crate::data::FillReport`]).
    Skip,
    /// Stop with an error naming the file.
    #[default]
    Stop,
}

/// A training image with its caption, as scanned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// The image file.
    pub path: PathBuf,
    /// The image's name within its source (the file name in a folder, `<subfolder>/<file>`
    /// in a `<repeats>_<name>` subfolder, `file` in a manifest): the stable part of its
    /// random draws, so moving a dataset keeps its crops.
    pub name: String,
    /// The caption, trimmed of surrounding whitespace.
    pub caption: String,
    /// Width in pixels, from the file's header.
    pub width: usize,
    /// Height in pixels, from the file's header.
    pub height: usize,
    /// Times it appears in an epoch.
    pub repeats: usize,
    /// A regularisation (prior-preservation) image (`data.reg_dirs`): its loss is weighted
    /// by `data.prior_loss_weight`.
    pub reg: bool,
    /// The reference images it was made from, in order (edit training; module docs).
    pub references: Vec<Reference>,
}

/// A reference image of an [`Item`]: a picture its target was made from (edit training).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// The picture file.
    pub path: PathBuf,
    /// Width in pixels, from the file's header.
    pub width: usize,
    /// Height in pixels, from the file's header.
    pub height: usize,
}

/// A file that could not be used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadFile {
    /// The image (or caption, or manifest) file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

impl std::fmt::Display for BadFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

impl BadFile {
    /// As an error ([`Error::Data`]).
    pub fn to_error(&self) -> Error {
        data_err(&self.path, self.reason.clone())
    }
}

/// The result of a scan: the usable images in order, the ones left out, and what the user
/// should be told about the ones used.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    /// Usable images: sources in the order given, each in its own order.
    pub items: Vec<Item>,
    /// Files left out with [`OnBadFile::Skip`], in the order met.
    pub skipped: Vec<BadFile>,
    /// Remarks for the user, one line each in the order met: a used image's caption that is
    /// not UTF-8 and was read as Windows-1252, subfolders that were not searched.
    pub notes: Vec<String>,
}

impl Scan {
    fn bad(&mut self, on_bad: OnBadFile, path: &Path, reason: String) -> Result<()> {
        let bad = BadFile {
            path: path.to_path_buf(),
            reason,
        };
        match on_bad {
            OnBadFile::Stop => Err(bad.to_error()),
            OnBadFile::Skip => {
                self.skipped.push(bad);
                Ok(())
            }
        }
    }

    /// Adds the image at `path` with its caption (or why it has none) and its reference
    /// images (or why one is missing or cannot be one), or reports it; with `limits`, an
    /// image [`unfit`] for them is reported too.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        on_bad: OnBadFile,
        limits: Option<&BucketConfig>,
        path: &Path,
        name: String,
        caption: std::result::Result<String, String>,
        repeats: usize,
        references: std::result::Result<Vec<PathBuf>, String>,
    ) -> Result<()> {
        if path.to_str().is_none() {
            return self.bad(
                on_bad,
                path,
                "the path is not valid UTF-8 (the caches key images by path): rename the file \
                 or its folder"
                    .into(),
            );
        }
        let caption = match caption {
            Ok(c) => c,
            Err(why) => return self.bad(on_bad, path, why),
        };
        let (width, height) = match image_size(path) {
            Ok(size) => size,
            Err(why) => return self.bad(on_bad, path, why),
        };
        if let Some(why) = limits.and_then(|cfg| unfit(width, height, cfg)) {
            return self.bad(on_bad, path, why);
        }
        let references = match references.and_then(|refs| {
            refs.into_iter()
                .map(|r| reference(&r))
                .collect::<std::result::Result<Vec<_>, String>>()
        }) {
            Ok(r) => r,
            Err(why) => return self.bad(on_bad, path, why),
        };
        self.items.push(Item {
            path: path.to_path_buf(),
            name,
            caption: caption.trim().to_string(),
            width,
            height,
            repeats,
            reg: false,
            references,
        });
        Ok(())
    }
}

/// The reference at `path` with its size, or why it cannot be one: a path that is not
/// UTF-8, a header that cannot be read, a picture the pipeline refuses
/// ([`super::reference::unfit`]).
fn reference(path: &Path) -> std::result::Result<Reference, String> {
    if path.to_str().is_none() {
        return Err(format!(
            "its reference {} has a path that is not valid UTF-8 (the caches key images by \
             path)",
            path.display()
        ));
    }
    let (width, height) =
        image_size(path).map_err(|why| format!("its reference {}: {why}", path.display()))?;
    if let Some(why) = super::reference::unfit(width, height) {
        return Err(format!("its reference {}: {why}", path.display()));
    }
    Ok(Reference {
        path: path.to_path_buf(),
        width,
        height,
    })
}

/// The references of the image named `name` in a folder source (its name in the source:
/// `cat.png`, `10_x/cat.png`): in each reference folder, the first of `<stem>.png`, `.jpg`,
/// `.jpeg`, `.webp` (lower case, then upper) that exists; `Err` names the first folder
/// without one.
fn folder_references(name: &str, folders: &[PathBuf]) -> std::result::Result<Vec<PathBuf>, String> {
    let stem = Path::new(name).with_extension("");
    let stem = stem.to_string_lossy();
    folders
        .iter()
        .map(|dir| {
            IMAGE_EXTENSIONS
                .iter()
                .map(|e| e.to_string())
                .chain(IMAGE_EXTENSIONS.iter().map(|e| e.to_ascii_uppercase()))
                .map(|e| dir.join(format!("{stem}.{e}")))
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    format!(
                        "its reference {} is missing (no {stem}.png, .jpg, .jpeg or .webp in \
                         the reference folder {})",
                        dir.join(format!("{stem}.*")).display(),
                        dir.display()
                    )
                })
        })
        .collect()
}

/// An image's (width, height) from its header; `Err` says why it cannot be read.
pub fn image_size(path: &Path) -> std::result::Result<(usize, usize), String> {
    let reader = image::ImageReader::open(path)
        .map_err(|e| format!("cannot open the image: {e}"))?
        .with_guessed_format()
        .map_err(|e| format!("cannot read the image: {e}"))?;
    if reader.format().is_none() {
        return Err("not a PNG, JPEG or WebP image".into());
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| format!("cannot read the image header: {e}"))?;
    if w == 0 || h == 0 {
        return Err(format!("the image is {w}x{h}"));
    }
    Ok((w as usize, h as usize))
}

/// The text encoding a caption file was read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextEncoding {
    /// UTF-8, with or without a byte-order mark.
    Utf8,
    /// UTF-16 little-endian, from its byte-order mark `FF FE`.
    Utf16Le,
    /// UTF-16 big-endian, from its byte-order mark `FE FF`.
    Utf16Be,
    /// Windows-1252: bytes that are not UTF-8 and start with no byte-order mark.
    Windows1252,
}

/// The characters of Windows-1252's bytes 0x80 to 0x9F; the five bytes the table leaves
/// undefined (0x81, 0x8D, 0x8F, 0x90, 0x9D) stand for the Latin-1 control characters of the
/// same value. Every other byte is the Unicode code point of its value.
const WINDOWS_1252_80: [char; 32] = [
    '\u{20AC}', '\u{0081}', '\u{201A}', '\u{0192}', '\u{201E}', '\u{2026}', '\u{2020}', '\u{2021}',
    '\u{02C6}', '\u{2030}', '\u{0160}', '\u{2039}', '\u{0152}', '\u{008D}', '\u{017D}', '\u{008F}',
    '\u{0090}', '\u{2018}', '\u{2019}', '\u{201C}', '\u{201D}', '\u{2022}', '\u{2013}', '\u{2014}',
    '\u{02DC}', '\u{2122}', '\u{0161}', '\u{203A}', '\u{0153}', '\u{009D}', '\u{017E}', '\u{0178}',
];

/// The text of a caption file's `bytes` and the encoding it was read in (module docs): a
/// leading UTF-8 byte-order mark is dropped; `FF FE` and `FE FF` start UTF-16 (LE, BE);
/// other bytes are UTF-8 when valid, else Windows-1252. `Err` says why the bytes cannot be
/// text: a UTF-8 byte-order mark before bytes that are not UTF-8, or UTF-16 that is not
/// valid (an odd length, an unpaired surrogate).
pub fn decode_text(bytes: &[u8]) -> std::result::Result<(String, TextEncoding), String> {
    if let Some(rest) = bytes.strip_prefix(&[0xEF, 0xBB, 0xBF]) {
        return String::from_utf8(rest.to_vec())
            .map(|s| (s, TextEncoding::Utf8))
            .map_err(|e| {
                format!(
                    "starts with a UTF-8 byte-order mark but is not UTF-8 (byte {} of the \
                     text after it)",
                    e.utf8_error().valid_up_to()
                )
            });
    }
    let utf16 = match bytes {
        [0xFF, 0xFE, rest @ ..] => Some((rest, TextEncoding::Utf16Le)),
        [0xFE, 0xFF, rest @ ..] => Some((rest, TextEncoding::Utf16Be)),
        _ => None,
    };
    if let Some((rest, enc)) = utf16 {
        let (name, mark) = match enc {
            TextEncoding::Utf16Le => ("UTF-16 LE", "FF FE"),
            _ => ("UTF-16 BE", "FE FF"),
        };
        let bad = |why: String| {
            format!("is not UTF-8, and not valid {name} despite its byte-order mark {mark}: {why}")
        };
        if rest.len() % 2 != 0 {
            return Err(bad(format!(
                "an odd number of bytes ({}) after the mark",
                rest.len()
            )));
        }
        let units = rest.chunks_exact(2).map(|p| match enc {
            TextEncoding::Utf16Le => u16::from_le_bytes([p[0], p[1]]),
            _ => u16::from_be_bytes([p[0], p[1]]),
        });
        let mut text = String::with_capacity(rest.len() / 2);
        let mut at = 2;
        for c in char::decode_utf16(units) {
            match c {
                Ok(c) => {
                    at += 2 * c.len_utf16();
                    text.push(c);
                }
                Err(e) => {
                    return Err(bad(format!(
                        "an unpaired surrogate {:04X} at byte {at}",
                        e.unpaired_surrogate()
                    )))
                }
            }
        }
        return Ok((text, enc));
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok((s.to_string(), TextEncoding::Utf8)),
        Err(_) => Ok((
            bytes
                .iter()
                .map(|&b| match b {
                    0x80..=0x9F => WINDOWS_1252_80[(b - 0x80) as usize],
                    _ => char::from(b),
                })
                .collect(),
            TextEncoding::Windows1252,
        )),
    }
}

/// The caption at `path` (or why it cannot be had), with a note for the user when it was
/// read as Windows-1252.
fn read_caption(path: &Path) -> std::result::Result<(String, Option<String>), String> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let (text, enc) =
                decode_text(&bytes).map_err(|why| format!("caption {} {why}", path.display()))?;
            let note = (enc == TextEncoding::Windows1252).then(|| {
                format!(
                    "caption {} is not UTF-8: read as Windows-1252 (save it as UTF-8 to \
                     silence this)",
                    path.display()
                )
            });
            Ok((text, note))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("no caption file {}", path.display()))
        }
        Err(e) => Err(format!("cannot read caption {}: {e}", path.display())),
    }
}

/// An image file that is not a mask (`*-masklabel.*`, [`super::mask::is_mask_file`]).
fn is_image(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        && !super::mask::is_mask_file(path)
}

/// The repeats a subfolder named `<repeats>_<name>` (kohya's convention) gives its images:
/// `Some(repeats)` for a number >= 1 (ASCII digits), an underscore and a non-empty name;
/// `None` for any other name. A number too large for `usize` reads as `usize::MAX`, which
/// the caller then refuses ([`MAX_REPEATS`]).
pub fn kohya_repeats(name: &str) -> Option<usize> {
    let n = kohya_number(name)?.parse::<usize>().unwrap_or(usize::MAX);
    (n >= 1).then_some(n)
}

/// The digits of a `<number>_<name>` folder name (ASCII digits, an underscore, a non-empty
/// name), whatever the number.
fn kohya_number(name: &str) -> Option<&str> {
    let (number, rest) = name.split_once('_')?;
    let digits = !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit());
    (digits && !rest.is_empty()).then_some(number)
}

/// The entries of `dir`, sorted by path.
fn entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .map(|e| e.map(|e| e.path()).map_err(io_err(dir)))
        .collect::<Result<Vec<_>>>()?;
    out.sort();
    Ok(out)
}

/// The last component of `path` as text.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Scans the folder source `dir` with `repeats` into `scan` (module docs).
fn scan_folder(
    scan: &mut Scan,
    dir: &Path,
    repeats: usize,
    references: &[PathBuf],
    on_bad: OnBadFile,
    limits: Option<&BucketConfig>,
) -> Result<()> {
    if let Some(r) = references.iter().find(|r| !r.is_dir()) {
        return Err(data_err(
            r,
            format!(
                "the reference folder of {} is not a folder (or does not exist)",
                dir.display()
            ),
        ));
    }
    let before = scan.items.len();
    let all = entries(dir)?;
    let mut images: Vec<(PathBuf, String, usize)> = all
        .iter()
        .filter(|p| is_image(p) && p.is_file())
        .map(|p| (p.clone(), file_name(p), repeats))
        .collect();
    let mut others = vec![];
    for sub in all.iter().filter(|p| p.is_dir()) {
        let sub_name = file_name(sub);
        let Some(n) = kohya_repeats(&sub_name) else {
            others.push(sub_name);
            continue;
        };
        let times = n
            .checked_mul(repeats)
            .filter(|t| *t <= MAX_REPEATS)
            .ok_or_else(|| {
                let digits = kohya_number(&sub_name).unwrap_or_default();
                data_err(
                    sub,
                    format!(
                        "the folder name asks for {digits} repeats (× the source's {repeats}): \
                         at most {MAX_REPEATS} times an image an epoch"
                    ),
                )
            })?;
        let inner = entries(sub)?;
        let nested: Vec<String> = inner
            .iter()
            .filter(|p| p.is_dir())
            .map(|p| file_name(p))
            .filter(|n| !n.starts_with('.'))
            .collect();
        if !nested.is_empty() {
            scan.notes.push(format!(
                "{}: not searched: {} (the subfolders of a <repeats>_<name> folder are not \
                 searched; move their images up or give them their own <repeats>_<name> \
                 folder beside it)",
                sub.display(),
                listing(&nested)
            ));
        }
        images.extend(
            inner
                .into_iter()
                .filter(|p| is_image(p) && p.is_file())
                .map(|p| {
                    let name = format!("{sub_name}/{}", file_name(&p));
                    (p, name, times)
                }),
        );
    }
    for (image, name, times) in images {
        let (caption, note) = match read_caption(&image.with_extension("txt")) {
            Ok((text, note)) => (Ok(text), note),
            Err(why) => (Err(why), None),
        };
        let used = scan.items.len();
        let refs = folder_references(&name, references);
        scan.add(on_bad, limits, &image, name, caption, times, refs)?;
        // Only images that are used: a skipped one is reported as such.
        if scan.items.len() > used {
            scan.notes.extend(note);
        }
    }
    others.retain(|n| !n.starts_with('.'));
    if others.is_empty() {
        return Ok(());
    }
    let zero: Vec<String> = others.iter().filter(|n| zero_repeats(n)).cloned().collect();
    if scan.items.len() == before {
        let why = match zero.is_empty() {
            true => "".to_string(),
            false => format!(
                " ({} named with 0 repeats, which kohya's convention leaves out)",
                listing(&zero)
            ),
        };
        return Err(data_err(
            dir,
            format!(
                "no usable image in this folder; its subfolders are only searched when \
                 named <repeats>_<name> with repeats >= 1 (kohya's convention, e.g. \
                 10_mychar), and these are not: {}{why}",
                listing(&others)
            ),
        ));
    }
    scan.notes.push(format!(
        "{}: subfolders not searched: {} (only <repeats>_<name> subfolders with repeats >= 1 \
         are, kohya's convention)",
        dir.display(),
        listing(&others)
    ));
    Ok(())
}

/// Whether a subfolder's name is kohya's `<repeats>_<name>` with repeats 0 (left out).
fn zero_repeats(name: &str) -> bool {
    kohya_number(name).is_some_and(|n| n.bytes().all(|b| b == b'0'))
}

/// Up to [`LISTED_SUBFOLDERS`] folder names as `a/, b/ and N more`.
fn listing(names: &[String]) -> String {
    let mut listed: Vec<String> = names
        .iter()
        .take(LISTED_SUBFOLDERS)
        .map(|n| format!("{n}/"))
        .collect();
    if names.len() > LISTED_SUBFOLDERS {
        listed.push(format!("and {} more", names.len() - LISTED_SUBFOLDERS));
    }
    listed.join(", ")
}

/// Every image of `sources` with its caption, in a fixed order (each folder's images sorted
/// by path, then its `<repeats>_<name>` subfolders' in name order, a manifest's in line
/// order, sources in the order given). A missing folder or manifest, a manifest line that
/// is not such an object, or a folder with no usable image but with subfolders outside the
/// `<repeats>_<name>` convention is an error naming it (and the line), whatever `on_bad`;
/// bad images and captions follow `on_bad`.
pub fn scan(sources: &[Source], on_bad: OnBadFile) -> Result<Scan> {
    scan_sources(sources, on_bad, None)
}

/// As [`scan`], and images unfit for the buckets of `limits` (a shorter side under a
/// quarter of the resolution, or an aspect ratio beyond 4:1 or the buckets' own cap,
/// [`unfit`]) are bad files too, following `on_bad` like the others.
pub fn scan_for(sources: &[Source], on_bad: OnBadFile, limits: &BucketConfig) -> Result<Scan> {
    scan_sources(sources, on_bad, Some(limits))
}

fn scan_sources(
    sources: &[Source],
    on_bad: OnBadFile,
    limits: Option<&BucketConfig>,
) -> Result<Scan> {
    let mut scan = Scan::default();
    for source in sources {
        match source {
            Source::Folder {
                dir,
                repeats,
                references,
            } => {
                check_repeats(dir, *repeats)?;
                scan_folder(&mut scan, dir, *repeats, references, on_bad, limits)?;
            }
            Source::Manifest { path, repeats } => {
                check_repeats(path, *repeats)?;
                let bytes = std::fs::read(path).map_err(io_err(path))?;
                let (bom, bytes) = match bytes.strip_prefix(&[0xEF, 0xBB, 0xBF]) {
                    Some(rest) => (3, rest),
                    None => (0, &bytes[..]),
                };
                let text = std::str::from_utf8(bytes).map_err(|e| {
                    data_err(
                        path,
                        format!(
                            "not UTF-8 (at byte {}): a JSONL manifest must be saved as UTF-8",
                            bom + e.valid_up_to()
                        ),
                    )
                })?;
                let base = path.parent().unwrap_or(Path::new("."));
                for (i, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let line = manifest_line(line)
                        .map_err(|msg| data_err(path, format!("line {}: {msg}", i + 1)))?;
                    let image = base.join(&line.file);
                    let caption = line.caption.ok_or_else(|| {
                        format!("no caption (manifest {} line {})", path.display(), i + 1)
                    });
                    let refs: Vec<PathBuf> = line.references.iter().map(|r| base.join(r)).collect();
                    let refs = match refs.iter().find(|r| !r.is_file()) {
                        Some(r) => Err(format!(
                            "its reference {} is missing (manifest {} line {})",
                            r.display(),
                            path.display(),
                            i + 1
                        )),
                        None => Ok(refs),
                    };
                    scan.add(on_bad, limits, &image, line.file, caption, *repeats, refs)?;
                }
            }
        }
    }
    Ok(scan)
}

fn check_repeats(path: &Path, repeats: usize) -> Result<()> {
    if repeats == 0 {
        return Err(data_err(path, "repeats = 0: must be at least 1"));
    }
    if repeats > MAX_REPEATS {
        return Err(data_err(
            path,
            format!("repeats = {repeats}: at most {MAX_REPEATS} times an image an epoch"),
        ));
    }
    Ok(())
}

/// One manifest line: its image, caption (absent or null: `None`) and reference images as
/// written.
struct ManifestLine {
    file: String,
    caption: Option<String>,
    references: Vec<String>,
}

/// A manifest line's fields (module docs): the image as `"file"` or musubi-tuner's
/// `"image_path"`, `"caption"`, and the references as `"references"` (a list), or
/// musubi-tuner's `"control_path"` (a string or a list) or `"control_path_<n>"` (in the
/// order of n); one of those forms a line.
fn manifest_line(line: &str) -> std::result::Result<ManifestLine, String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| "not a JSON object".to_string())?;
    let numbered = |k: &str| {
        k.strip_prefix("control_path_")
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<usize>().ok())
    };
    for k in obj.keys() {
        let known = matches!(
            k.as_str(),
            "file" | "image_path" | "caption" | "references" | "control_path"
        ) || numbered(k).is_some();
        if !known {
            return Err(format!(
                "unknown key \"{k}\" (expected \"file\" or \"image_path\", \"caption\", and \
                 for reference images \"references\", \"control_path\" or \
                 \"control_path_<n>\")"
            ));
        }
    }
    let file = match (obj.get("file"), obj.get("image_path")) {
        (Some(_), Some(_)) => {
            return Err("both \"file\" and \"image_path\" are given: use one".into());
        }
        (Some(f), None) | (None, Some(f)) => f,
        (None, None) => return Err("no \"file\" (or \"image_path\")".into()),
    };
    let file = file.as_str().filter(|f| !f.is_empty()).ok_or_else(|| {
        "the image (\"file\" or \"image_path\") must be a non-empty string".to_string()
    })?;
    let caption = match obj.get("caption") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(c)) => Some(c.clone()),
        Some(other) => return Err(format!("\"caption\" must be a string, not {other}")),
    };
    let path_of = |key: &str, v: &serde_json::Value| -> std::result::Result<String, String> {
        v.as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .ok_or_else(|| format!("\"{key}\" must hold non-empty strings (paths), not {v}"))
    };
    let list = |key: &str, v: &serde_json::Value| -> std::result::Result<Vec<String>, String> {
        match v {
            serde_json::Value::Array(a) => a.iter().map(|x| path_of(key, x)).collect(),
            other => Ok(vec![path_of(key, other)?]),
        }
    };
    let mut numbered_refs: Vec<(usize, &serde_json::Value)> = obj
        .iter()
        .filter_map(|(k, v)| numbered(k).map(|n| (n, v)))
        .collect();
    numbered_refs.sort_by_key(|(n, _)| *n);
    let forms = [
        obj.contains_key("references"),
        obj.contains_key("control_path"),
        !numbered_refs.is_empty(),
    ];
    if forms.iter().filter(|&&f| f).count() > 1 {
        return Err(
            "reference images given in two forms (\"references\", \"control_path\", \
             \"control_path_<n>\"): use one"
                .into(),
        );
    }
    let references = match (obj.get("references"), obj.get("control_path")) {
        (Some(serde_json::Value::Array(a)), _) => a
            .iter()
            .map(|x| path_of("references", x))
            .collect::<std::result::Result<_, _>>()?,
        (Some(other), _) => {
            return Err(format!(
                "\"references\" must be a list of paths, not {other}"
            ))
        }
        (None, Some(c)) => list("control_path", c)?,
        (None, None) => numbered_refs
            .iter()
            .map(|(n, v)| path_of(&format!("control_path_{n}"), v))
            .collect::<std::result::Result<_, _>>()?,
    };
    Ok(ManifestLine {
        file: file.to_string(),
        caption,
        references,
    })
}
