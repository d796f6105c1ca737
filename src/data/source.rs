//! Where training images and their captions come from: folders of images with a `.txt`
//! caption beside each (`cat.png` + `cat.txt`), or a JSONL manifest with one
//! `{"file": "...", "caption": "..."}` object a line (`file` relative to the manifest's
//! folder). Every source has a `repeats` count: its images appear that many times an epoch.
//!
//! A scan reads each image's header (format and size, not the pixels) and its caption. An
//! image that cannot be opened or recognised, or whose caption is missing or not UTF-8, is a
//! [`BadFile`] named by its path: collected into [`Scan::skipped`] with
//! [`OnBadFile::Skip`], or the scan's error with [`OnBadFile::Stop`]. Pixels that fail to
//! decode later (a truncated file) follow the same option where the images are decoded
//! ([`crate::data::LatentCache::fill`]).

use super::{data_err, io_err};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The image file extensions a folder source picks up (case-insensitive).
pub const IMAGE_EXTENSIONS: [&str; 4] = ["png", "jpg", "jpeg", "webp"];

/// One source of images.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The images of a folder (not its subfolders), each with a `.txt` caption of the same
    /// stem beside it; in path order.
    Folder {
        /// The folder.
        dir: PathBuf,
        /// Times each image appears in an epoch (at least 1).
        repeats: usize,
    },
    /// A JSONL file of `{"file": ..., "caption": ...}` lines (blank lines ignored); `file`
    /// relative to the manifest's folder; in line order.
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// Times each image appears in an epoch (at least 1).
        repeats: usize,
    },
}

/// What to do with an image or caption that cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
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
    /// The image's name within its source (the file name in a folder, `file` in a
    /// manifest): the stable part of its random draws, so moving a dataset keeps its crops.
    pub name: String,
    /// The caption, trimmed of surrounding whitespace.
    pub caption: String,
    /// Width in pixels, from the file's header.
    pub width: usize,
    /// Height in pixels, from the file's header.
    pub height: usize,
    /// Times it appears in an epoch.
    pub repeats: usize,
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

/// The result of a scan: the usable images in order, and the ones left out.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    /// Usable images: sources in the order given, each in its own order.
    pub items: Vec<Item>,
    /// Files left out with [`OnBadFile::Skip`], in the order met.
    pub skipped: Vec<BadFile>,
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

    /// Adds the image at `path` with its caption (or why it has none), or reports it.
    fn add(
        &mut self,
        on_bad: OnBadFile,
        path: &Path,
        name: String,
        caption: std::result::Result<String, String>,
        repeats: usize,
    ) -> Result<()> {
        let caption = match caption {
            Ok(c) => c,
            Err(why) => return self.bad(on_bad, path, why),
        };
        match image_size(path) {
            Ok((width, height)) => {
                self.items.push(Item {
                    path: path.to_path_buf(),
                    name,
                    caption: caption.trim().to_string(),
                    width,
                    height,
                    repeats,
                });
                Ok(())
            }
            Err(why) => self.bad(on_bad, path, why),
        }
    }
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

fn read_caption(path: &Path) -> std::result::Result<String, String> {
    match std::fs::read(path) {
        Ok(bytes) => {
            String::from_utf8(bytes).map_err(|_| format!("caption {} is not UTF-8", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("no caption file {}", path.display()))
        }
        Err(e) => Err(format!("cannot read caption {}: {e}", path.display())),
    }
}

fn is_image(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// Every image of `sources` with its caption, in a fixed order (each folder's images sorted
/// by path, a manifest's in line order, sources in the order given). A missing folder or
/// manifest, or a manifest line that is not such an object, is an error naming it and its
/// line, whatever `on_bad`; bad images and captions follow `on_bad`.
pub fn scan(sources: &[Source], on_bad: OnBadFile) -> Result<Scan> {
    let mut scan = Scan::default();
    for source in sources {
        match source {
            Source::Folder { dir, repeats } => {
                check_repeats(dir, *repeats)?;
                let mut images: Vec<PathBuf> = std::fs::read_dir(dir)
                    .map_err(io_err(dir))?
                    .map(|e| e.map(|e| e.path()).map_err(io_err(dir)))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .filter(|p| is_image(p) && p.is_file())
                    .collect();
                images.sort();
                for image in images {
                    let caption = read_caption(&image.with_extension("txt"));
                    let name = image
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    scan.add(on_bad, &image, name, caption, *repeats)?;
                }
            }
            Source::Manifest { path, repeats } => {
                check_repeats(path, *repeats)?;
                let text = std::fs::read_to_string(path).map_err(io_err(path))?;
                let base = path.parent().unwrap_or(Path::new("."));
                for (i, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let (file, caption) = manifest_line(line)
                        .map_err(|msg| data_err(path, format!("line {}: {msg}", i + 1)))?;
                    let image = base.join(&file);
                    let caption = caption.ok_or_else(|| {
                        format!("no caption (manifest {} line {})", path.display(), i + 1)
                    });
                    scan.add(on_bad, &image, file, caption, *repeats)?;
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
    Ok(())
}

/// `file` and `caption` (absent or null: `None`) of a manifest line.
fn manifest_line(line: &str) -> std::result::Result<(String, Option<String>), String> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| "not a JSON object".to_string())?;
    for k in obj.keys() {
        if k != "file" && k != "caption" {
            return Err(format!(
                "unknown key \"{k}\" (expected \"file\" and \"caption\")"
            ));
        }
    }
    let file = obj
        .get("file")
        .and_then(|f| f.as_str())
        .filter(|f| !f.is_empty())
        .ok_or_else(|| "\"file\" must be a non-empty string".to_string())?;
    let caption = match obj.get("caption") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(c)) => Some(c.clone()),
        Some(other) => return Err(format!("\"caption\" must be a string, not {other}")),
    };
    Ok((file.to_string(), caption))
}
