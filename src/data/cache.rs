//! Encoded samples on disk: latents per (image, bucket, crop, flip) and text embeddings per
//! (caption, encoder), one safetensors file per entry, written atomically
//! ([`crate::safetensors::save_with_metadata`]).
//!
//! An entry's file name is the SHA-256 of everything that decides its content:
//! - latents (`<dir>/latents/`): the image file's SHA-256, the resize filter, the resized
//!   size, the crop offset and size, the flip, and the encoder's identity string; with
//!   loss masks ([`LatentCache::with_masks`]), also the mask's source, the latent factor
//!   and the mask file's SHA-256 (or that there is none), the mask stored as `loss_mask`;
//!   an image's reference images (edit training) are entries of their own, keyed the same
//!   way by the reference file's SHA-256 and its resize, crop and flip
//!   ([`super::reference`]), so a changed reference or reference size recomputes only its
//!   entries, and a picture several images share is encoded once;
//! - text (`<dir>/text/`): the caption and the encoder's identity string.
//!
//! So a changed image, caption, resolution, crop or encoder misses only the entries it
//! changes, and the rest are reused. Hashing every image each run would read the whole
//! dataset: `<dir>/files.json` keeps each image's (size, mtime, SHA-256), and an image whose
//! size and mtime are unchanged keeps its stored hash. A `files.json` that is not such an
//! index is someone else's file: the cache refuses the folder rather than write over it.
//!
//! Filling is resumable: an entry whose file opens, has a well-formed header within the
//! file's length and names its own key in its metadata is reused; a missing entry is
//! computed, and a truncated or otherwise unreadable one is computed again (counted in
//! [`FillReport::repaired`]). Reading a batch opens only that batch's files.

use super::bucket::{self, Geometry, Resample};
use super::mask::{self, MaskSource};
use super::source::{BadFile, OnBadFile};
use super::{data_err, io_err, write_atomic, Dataset};
use crate::safetensors::{save_with_metadata, SafeTensorsFile};
use crate::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What an encoder returns for one sample: named tensors without a batch dim.
pub type Encoded = Vec<(String, Tensor)>;

/// Where a fill stands, given to the progress callback after every entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Entries handled so far.
    pub done: usize,
    /// Entries to handle.
    pub total: usize,
    /// Of `done`, entries found valid on disk.
    pub reused: usize,
    /// Of `done`, entries encoded now.
    pub computed: usize,
}

/// What a fill did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FillReport {
    /// Distinct entries the data needs.
    pub total: usize,
    /// Entries found valid on disk.
    pub reused: usize,
    /// Entries encoded and written (including the repaired ones).
    pub computed: usize,
    /// Of `computed`, entries whose file existed but was unreadable (truncated, damaged, or
    /// another entry's).
    pub repaired: usize,
    /// Images left out because they could not be read or decoded ([`OnBadFile::Skip`]).
    pub skipped: Vec<BadFile>,
}

/// The hex SHA-256 of `parts` joined by newlines.
fn sha_hex(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h.update(b"\n");
        }
        h.update(p.as_bytes());
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hex SHA-256 of a file's bytes.
fn file_sha(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex(&h.finalize()))
}

/// Whether `path` holds a readable entry for `key`.
fn entry_ok(path: &Path, key: &str) -> bool {
    match SafeTensorsFile::open(path) {
        Ok(f) => !f.is_empty() && f.metadata().get("flame.key").map(String::as_str) == Some(key),
        Err(_) => false,
    }
}

/// Encodes and writes one entry; the file appears only once complete.
fn write_entry(path: &Path, key: &str, source: &str, encoder: &str, enc: &Encoded) -> Result<()> {
    if enc.is_empty() {
        return Err(data_err(
            path,
            format!("the encoder returned no tensor for {source}"),
        ));
    }
    let meta: BTreeMap<String, String> = [
        ("flame.key", key),
        ("flame.source", source),
        ("flame.encoder", encoder),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    save_with_metadata(enc.iter().map(|(n, t)| (n.as_str(), t)), &meta, path)
}

/// The entries at `paths` stacked into a batch: every name of the first entry, each (B, ...),
/// in `dtype` on `device`, sorted by name. Every entry must hold the same names and shapes.
fn load_stacked(paths: &[PathBuf], device: &Device, dtype: DType) -> Result<Vec<(String, Tensor)>> {
    let mut names: Vec<String> = vec![];
    let mut cols: Vec<Vec<Tensor>> = vec![];
    for (k, p) in paths.iter().enumerate() {
        let f = SafeTensorsFile::open(p).map_err(|e| {
            data_err(
                p,
                format!("cache entry unreadable ({e}); fill the cache again"),
            )
        })?;
        let these: Vec<String> = f.names().map(str::to_string).collect();
        if k == 0 {
            cols = vec![vec![]; these.len()];
            names = these;
        } else if these != names {
            return Err(data_err(
                p,
                format!("holds tensors {these:?}, the batch's first entry {names:?}"),
            ));
        }
        for (c, n) in cols.iter_mut().zip(&names) {
            c.push(f.load_as(n, device, dtype)?);
        }
    }
    names
        .into_iter()
        .zip(cols)
        .map(|(n, c)| Ok((n, Tensor::stack(&c.iter().collect::<Vec<_>>(), 0)?)))
        .collect()
}

/// One image's stored size, mtime and content hash.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct FileStamp {
    size: u64,
    mtime_ns: u128,
    sha256: String,
}

fn stamp_of(path: &Path) -> std::io::Result<(u64, u128)> {
    let m = std::fs::metadata(path)?;
    let mtime = m
        .modified()?
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Ok((m.len(), mtime))
}

/// An image's distinct cache entries: key -> (which picture: `None` the image, `Some(j)` its
/// reference j; geometry, flip).
type Views = BTreeMap<String, (Option<usize>, Geometry, bool)>;

/// Latents on disk, per (image, bucket, crop, flip) and encoder (module doc).
#[derive(Debug)]
pub struct LatentCache {
    dir: PathBuf,
    encoder: String,
    /// Image path -> its stamp (content hash), from files.json and this process's hashing.
    files: BTreeMap<PathBuf, FileStamp>,
    /// Loss masks stored with the latents: their source and the latent grid's factor.
    masks: Option<(MaskSource, usize)>,
}

/// The name a loss mask (1, h, w) is stored under in a latent entry.
pub const LOSS_MASK: &str = "loss_mask";

impl LatentCache {
    /// The cache in `dir` for the encoder named `encoder` (any string that changes whenever
    /// the encoder's output would: e.g. the VAE's file hash and dtype). Nothing is written
    /// before a [`fill`](Self::fill) (the folder is made then).
    pub fn open(dir: impl AsRef<Path>, encoder: &str) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index = dir.join("files.json");
        // A missing index only costs rehashing; a file of that name that is not one is
        // someone else's, and the cache would write over it.
        let files = match std::fs::read(&index) {
            Err(_) => BTreeMap::new(),
            Ok(b) => serde_json::from_slice::<BTreeMap<PathBuf, FileStamp>>(&b).map_err(|e| {
                data_err(
                    &index,
                    format!(
                        "not a latent cache's index ({e}): the cache folder (data.cache_dir) \
                         holds other files; point it at an empty folder or a cache's own"
                    ),
                )
            })?,
        };
        Ok(LatentCache {
            dir,
            encoder: encoder.to_string(),
            files,
            masks: None,
        })
    }

    /// Stores each sample's loss mask from `source` with its latents, on the latent grid
    /// of the autoencoder's `factor` ([`mask::mask_tensor`]), as [`LOSS_MASK`]; the entries
    /// are keyed by the mask too.
    pub fn with_masks(mut self, source: MaskSource, factor: usize) -> Self {
        self.masks = Some((source, factor));
        self
    }

    /// The mask's part of an entry's key: its source, the factor and, for mask files, the
    /// file's hash as stored (`None` when the file exists but was not hashed yet); `""`
    /// without masks.
    fn mask_id(&self, image: &Path) -> Option<String> {
        match self.masks {
            None => Some(String::new()),
            Some((MaskSource::Alpha, f)) => Some(format!("mask alpha, factor {f}")),
            Some((MaskSource::File, f)) => {
                let m = mask::mask_file(image);
                match self.files.get(&m) {
                    Some(s) => Some(format!("mask file {}, factor {f}", s.sha256)),
                    None if !m.exists() => Some(format!("mask none, factor {f}")),
                    None => None,
                }
            }
        }
    }

    /// The image's content hash: the stored one when size and mtime match, else read now.
    fn content_hash(&mut self, path: &Path) -> std::io::Result<String> {
        let (size, mtime_ns) = stamp_of(path)?;
        if let Some(s) = self.files.get(path) {
            if s.size == size && s.mtime_ns == mtime_ns {
                return Ok(s.sha256.clone());
            }
        }
        let sha256 = file_sha(path)?;
        self.files.insert(
            path.to_path_buf(),
            FileStamp {
                size,
                mtime_ns,
                sha256: sha256.clone(),
            },
        );
        Ok(sha256)
    }

    fn key(&self, ds: &Dataset, sha: &str, mask: &str, g: &Geometry, flip: bool) -> String {
        // Without masks the key is as before masks existed, so old caches stay valid.
        let sha = match mask.is_empty() {
            true => sha.to_string(),
            false => format!("{sha}\n{mask}"),
        };
        self.view_key(&sha, ds.options.resample, g, flip)
    }

    /// The key of a picture of content hash `sha` resized with `resample` and cropped by
    /// `g`, mirrored when `flip`.
    fn view_key(&self, sha: &str, resample: Resample, g: &Geometry, flip: bool) -> String {
        sha_hex(&[
            "flame-latent-v1",
            sha,
            resample.name(),
            &format!("resized {}x{}", g.resized_width, g.resized_height),
            &format!(
                "crop {}x{} at left {} top {}",
                g.bucket.width, g.bucket.height, g.left, g.top
            ),
            &format!("flip {flip}"),
            &self.encoder,
        ])
    }

    fn entry(&self, key: &str) -> PathBuf {
        self.dir.join("latents").join(format!("{key}.safetensors"))
    }

    /// Encodes every (sample, flip) view of `ds` not yet on disk: `encode` gets the image as
    /// a (3, H, W) f32 tensor in [-1, 1] on `device` and returns the tensors to store (e.g.
    /// `latents` (C, h, w)); `progress` hears after every entry. With flips on, both
    /// mirrorings of each sample are stored, so every epoch finds its entries. Images that
    /// cannot be read or decoded follow `ds.options.on_bad_file`: skipped ones leave `ds`
    /// and are listed in the report. Errors of `encode` stop the fill.
    pub fn fill(
        &mut self,
        ds: &mut Dataset,
        device: &Device,
        encode: &mut dyn FnMut(&Tensor) -> Result<Encoded>,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<FillReport> {
        self.fill_part(ds, device, encode, progress, 0, 1)
    }

    /// [`LatentCache::fill`]'s share of process `rank` of `world` filling one cache together
    /// (data-parallel training): the images `rank`, `rank + world`, ... of `ds`. Every
    /// image is hashed (so each process's index is whole), only the share is decoded and
    /// encoded. With several processes `ds` is left as it is and the skipped images are
    /// only listed: a whole [`LatentCache::fill`] after every share is done then finds every
    /// entry on disk and leaves out the unreadable images the same way in every process.
    pub fn fill_part(
        &mut self,
        ds: &mut Dataset,
        device: &Device,
        encode: &mut dyn FnMut(&Tensor) -> Result<Encoded>,
        progress: &mut dyn FnMut(&Progress),
        rank: usize,
        world: usize,
    ) -> Result<FillReport> {
        let world = world.max(1);
        let latents = self.dir.join("latents");
        std::fs::create_dir_all(&latents).map_err(io_err(&latents))?;
        let flips: &[bool] = if ds.options.flip {
            &[false, true]
        } else {
            &[false]
        };
        // Per item: its content hash (or why it has none) and its distinct entries.
        let mut plan: Vec<(usize, std::result::Result<Views, String>)> = vec![];
        for (i, item) in ds.items.iter().enumerate() {
            let sha = match self.content_hash(&item.path) {
                Ok(s) => s,
                Err(e) => {
                    plan.push((i, Err(format!("cannot read the image: {e}"))));
                    continue;
                }
            };
            if let Some((MaskSource::File, _)) = self.masks {
                let m = mask::mask_file(&item.path);
                if m.exists() {
                    if let Err(e) = self.content_hash(&m) {
                        plan.push((i, Err(format!("cannot read the mask {}: {e}", m.display()))));
                        continue;
                    }
                }
            }
            // The references' hashes and sizes (edit training).
            let mut refs = vec![];
            for (j, r) in item.references.iter().enumerate() {
                let sha = self
                    .content_hash(&r.path)
                    .map_err(|e| format!("cannot read its reference {}: {e}", r.path.display()));
                refs.push(sha.and_then(|sha| {
                    ds.reference_geometry(i, j)
                        .map(|g| (sha, g))
                        .map_err(|e| e.to_string())
                }));
            }
            if let Some(Err(why)) = refs.iter().find(|r| r.is_err()) {
                plan.push((i, Err(why.clone())));
                continue;
            }
            if i % world != rank {
                continue;
            }
            let mask_id = self.mask_id(&item.path).unwrap_or_default();
            let mut entries = BTreeMap::new();
            for s in ds.samples.iter().filter(|s| s.item == i) {
                for &f in flips {
                    entries.insert(
                        self.key(ds, &sha, &mask_id, &s.geometry, f),
                        (None, s.geometry, f),
                    );
                }
            }
            for (j, r) in refs.into_iter().enumerate() {
                let Ok((sha, g)) = r else { continue };
                for &f in flips {
                    entries.insert(
                        self.view_key(&sha, super::reference::RESAMPLE, &g, f),
                        (Some(j), g, f),
                    );
                }
            }
            plan.push((i, Ok(entries)));
        }
        let total = plan
            .iter()
            .map(|(_, e)| e.as_ref().map(|m| m.len()).unwrap_or(0))
            .sum();
        let mut p = Progress {
            total,
            ..Progress::default()
        };
        let mut report = FillReport {
            total,
            ..FillReport::default()
        };
        let mut bad: Vec<(usize, String)> = vec![];
        for (i, entries) in plan {
            let item = &ds.items[i];
            let entries = match entries {
                Ok(e) => e,
                Err(why) => {
                    bad.push((i, why));
                    continue;
                }
            };
            // Each picture (the image, its references) decoded once, when first needed.
            let mut pictures: BTreeMap<Option<usize>, image::Rgb32FImage> = BTreeMap::new();
            for (key, (which, geo, flip)) in entries {
                let path = self.entry(&key);
                if entry_ok(&path, &key) {
                    report.reused += 1;
                    p.reused += 1;
                } else {
                    let (src, resample, named) = match which {
                        None => (item.path.clone(), ds.options.resample, String::new()),
                        Some(j) => {
                            let r = &item.references[j];
                            let named = format!("its reference {}: ", r.path.display());
                            (r.path.clone(), super::reference::RESAMPLE, named)
                        }
                    };
                    if let std::collections::btree_map::Entry::Vacant(e) = pictures.entry(which) {
                        match bucket::decode(&src) {
                            Ok(img) => {
                                e.insert(img);
                            }
                            Err(why) => {
                                bad.push((i, format!("{named}{why}")));
                                break;
                            }
                        }
                    }
                    let Some(img) = pictures.get(&which) else {
                        break;
                    };
                    let x = match bucket::to_tensor(img, &geo, resample, flip, &src, device) {
                        Ok(x) => x,
                        Err(e) => {
                            bad.push((i, format!("{named}{e}")));
                            break;
                        }
                    };
                    let loss_mask = match (self.masks, which) {
                        (Some((src, factor)), None) => match mask::mask_tensor(
                            &item.path,
                            src,
                            &geo,
                            ds.options.resample,
                            flip,
                            factor,
                            device,
                        ) {
                            Ok(m) => Some(m),
                            Err(why) => {
                                bad.push((i, why));
                                break;
                            }
                        },
                        _ => None,
                    };
                    let repaired = path.exists();
                    let source = src.display().to_string();
                    let written = encode(&x).and_then(|mut enc| {
                        enc.extend(loss_mask.map(|m| (LOSS_MASK.to_string(), m)));
                        write_entry(&path, &key, &source, &self.encoder, &enc)
                    });
                    if let Err(e) = written {
                        // The hashes computed so far spare the next fill rereading the images.
                        let _ = self.save_index();
                        return Err(e);
                    }
                    report.computed += 1;
                    report.repaired += repaired as usize;
                    p.computed += 1;
                }
                p.done += 1;
                crate::progress::tick();
                progress(&p);
            }
        }
        self.save_index()?;
        if !bad.is_empty() {
            if ds.options.on_bad_file == OnBadFile::Stop {
                let (i, why) = &bad[0];
                return Err(data_err(&ds.items[*i].path, why.clone()));
            }
            report.skipped = bad
                .iter()
                .map(|(i, why)| BadFile {
                    path: ds.items[*i].path.clone(),
                    reason: why.clone(),
                })
                .collect();
            if world == 1 {
                ds.remove_items(bad)?;
            }
        }
        Ok(report)
    }

    fn save_index(&self) -> Result<()> {
        let path = self.dir.join("files.json");
        let bytes = serde_json::to_vec_pretty(&self.files)
            .map_err(|e| data_err(&path, format!("cannot write the index: {e}")))?;
        write_atomic(&path, &bytes)
    }

    /// The entry file of sample `i` of `ds` in `epoch` (its flip decides which). An error
    /// when the image was not hashed by a [`LatentCache::fill`] of this cache.
    pub fn entry_path(&self, ds: &Dataset, i: usize, epoch: u64) -> Result<PathBuf> {
        let s = ds.sample(i)?;
        let item = ds.item(i)?;
        let sha = self
            .files
            .get(&item.path)
            .map(|s| s.sha256.clone())
            .ok_or_else(|| data_err(&item.path, "not in the latent cache: fill it first"))?;
        let mask = self.mask_id(&item.path).ok_or_else(|| {
            data_err(
                &mask::mask_file(&item.path),
                "this mask is not in the latent cache: fill it first",
            )
        })?;
        Ok(self.entry(&self.key(ds, &sha, &mask, &s.geometry, ds.flip(i, epoch)?)))
    }

    /// The entry files of sample `i`'s reference images in `epoch` (mirrored with the
    /// sample), in order; none without references. An error when a reference was not hashed
    /// by a [`LatentCache::fill`] of this cache.
    pub fn reference_paths(&self, ds: &Dataset, i: usize, epoch: u64) -> Result<Vec<PathBuf>> {
        let s = ds.sample(i)?;
        let item = ds.item(i)?;
        let flip = ds.flip(i, epoch)?;
        item.references
            .iter()
            .enumerate()
            .map(|(j, r)| {
                let sha = self
                    .files
                    .get(&r.path)
                    .map(|s| s.sha256.clone())
                    .ok_or_else(|| {
                        data_err(
                            &r.path,
                            "this reference is not in the latent cache: fill it first",
                        )
                    })?;
                let g = ds.reference_geometry(s.item, j)?;
                Ok(self.entry(&self.view_key(&sha, super::reference::RESAMPLE, &g, flip)))
            })
            .collect()
    }

    /// The cached reference images of the samples `batch` in `epoch`, read from disk now:
    /// per reference (in order), its tensors stacked as [`LatentCache::load_batch`] stacks
    /// them. Every sample of `batch` must have references of the same count and sizes
    /// ([`super::BatchSampler`] batches so); none without references.
    pub fn load_references(
        &self,
        ds: &Dataset,
        batch: &[usize],
        epoch: u64,
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<Vec<(String, Tensor)>>> {
        let per: Vec<Vec<PathBuf>> = batch
            .iter()
            .map(|&i| self.reference_paths(ds, i, epoch))
            .collect::<Result<_>>()?;
        let n = per.first().map_or(0, Vec::len);
        if let Some((k, p)) = per.iter().enumerate().find(|(_, p)| p.len() != n) {
            return Err(data_err(
                &ds.item(batch[k])?.path,
                format!(
                    "{} reference images, the batch's first image {n}: a batch's images must \
                     have the same number",
                    p.len()
                ),
            ));
        }
        (0..n)
            .map(|j| {
                let paths: Vec<PathBuf> = per.iter().map(|p| p[j].clone()).collect();
                load_stacked(&paths, device, dtype)
            })
            .collect()
    }

    /// Encodes the reference pictures of `pictures` (files with their ways into the model,
    /// [`super::reference::geometry`]; e.g. the sample prompts' references) not yet on disk,
    /// unmirrored, as [`LatentCache::fill`] encodes a dataset's references. Errors name the
    /// file.
    pub fn fill_pictures(
        &mut self,
        pictures: &[(PathBuf, Geometry)],
        device: &Device,
        encode: &mut dyn FnMut(&Tensor) -> Result<Encoded>,
    ) -> Result<FillReport> {
        let latents = self.dir.join("latents");
        std::fs::create_dir_all(&latents).map_err(io_err(&latents))?;
        let mut report = FillReport {
            total: pictures.len(),
            ..FillReport::default()
        };
        for (src, geo) in pictures {
            let sha = self.content_hash(src).map_err(io_err(src))?;
            let key = self.view_key(&sha, super::reference::RESAMPLE, geo, false);
            let path = self.entry(&key);
            if entry_ok(&path, &key) {
                report.reused += 1;
                continue;
            }
            let img = bucket::decode(src).map_err(|why| data_err(src, why))?;
            let x = bucket::to_tensor(&img, geo, super::reference::RESAMPLE, false, src, device)?;
            let repaired = path.exists();
            let written = encode(&x).and_then(|enc| {
                write_entry(&path, &key, &src.display().to_string(), &self.encoder, &enc)
            });
            if let Err(e) = written {
                let _ = self.save_index();
                return Err(e);
            }
            report.computed += 1;
            report.repaired += repaired as usize;
        }
        self.save_index()?;
        Ok(report)
    }

    /// The cached tensors of the picture `src` made as `geo` says (unmirrored), as
    /// [`LatentCache::fill_pictures`] stored them, each with a batch of one, in `dtype` on
    /// `device`. An error when it was not filled.
    pub fn load_picture(
        &self,
        src: &Path,
        geo: &Geometry,
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<(String, Tensor)>> {
        let sha = self
            .files
            .get(src)
            .map(|s| s.sha256.clone())
            .ok_or_else(|| data_err(src, "not in the latent cache: fill it first"))?;
        let key = self.view_key(&sha, super::reference::RESAMPLE, geo, false);
        load_stacked(&[self.entry(&key)], device, dtype)
    }

    /// The cached tensors of the samples `batch` in `epoch`, read from disk now: one
    /// (B, ...) tensor per stored name, sorted by name, in `dtype` on `device`.
    pub fn load_batch(
        &self,
        ds: &Dataset,
        batch: &[usize],
        epoch: u64,
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<(String, Tensor)>> {
        let paths = batch
            .iter()
            .map(|&i| self.entry_path(ds, i, epoch))
            .collect::<Result<Vec<_>>>()?;
        load_stacked(&paths, device, dtype)
    }
}

/// Text embeddings on disk, per (caption, encoder) (module doc).
#[derive(Clone, Debug)]
pub struct TextCache {
    dir: PathBuf,
    encoder: String,
}

impl TextCache {
    /// The cache in `dir` for the text encoder named `encoder`; nothing is written before a
    /// [`fill`](Self::fill) (the folder is made then).
    pub fn open(dir: impl AsRef<Path>, encoder: &str) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        Ok(TextCache {
            dir,
            encoder: encoder.to_string(),
        })
    }

    fn key(&self, caption: &str) -> String {
        sha_hex(&["flame-text-v1", &self.encoder, caption])
    }

    /// The entry file of `caption`.
    pub fn entry_path(&self, caption: &str) -> PathBuf {
        self.dir
            .join("text")
            .join(format!("{}.safetensors", self.key(caption)))
    }

    /// Encodes every distinct caption of `captions` not yet on disk (e.g. the captions of
    /// the epochs to come, [`Dataset::caption`]); `encode` returns the tensors to store,
    /// `progress` hears after every entry.
    pub fn fill(
        &self,
        captions: &[String],
        encode: &mut dyn FnMut(&str) -> Result<Encoded>,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<FillReport> {
        self.fill_part(captions, encode, progress, 0, 1)
    }

    /// [`TextCache::fill`]'s share of process `rank` of `world` filling one cache together:
    /// the distinct captions `rank`, `rank + world`, ... in sorted order.
    pub fn fill_part(
        &self,
        captions: &[String],
        encode: &mut dyn FnMut(&str) -> Result<Encoded>,
        progress: &mut dyn FnMut(&Progress),
        rank: usize,
        world: usize,
    ) -> Result<FillReport> {
        let mut one =
            |cs: &[&str]| -> Result<Vec<Encoded>> { cs.iter().map(|c| encode(c)).collect() };
        self.fill_batched(captions, 1, &mut one, progress, rank, world)
    }

    /// [`TextCache::fill_part`] encoding up to `batch` captions a call: `encode` takes the
    /// captions of a group and returns their entries in the same order. The groups are the
    /// missing captions of the share in sorted order, `batch` at a time (the last may hold
    /// fewer), so the same captions and batch make the same groups; each entry is written
    /// as its group finishes.
    pub fn fill_batched(
        &self,
        captions: &[String],
        batch: usize,
        encode: &mut dyn FnMut(&[&str]) -> Result<Vec<Encoded>>,
        progress: &mut dyn FnMut(&Progress),
        rank: usize,
        world: usize,
    ) -> Result<FillReport> {
        let text = self.dir.join("text");
        std::fs::create_dir_all(&text).map_err(io_err(&text))?;
        let world = world.max(1);
        let distinct: Vec<&str> = captions
            .iter()
            .map(String::as_str)
            .collect::<std::collections::BTreeSet<&str>>()
            .into_iter()
            .enumerate()
            .filter(|(k, _)| k % world == rank)
            .map(|(_, c)| c)
            .collect();
        let mut report = FillReport {
            total: distinct.len(),
            ..FillReport::default()
        };
        let mut p = Progress {
            total: distinct.len(),
            ..Progress::default()
        };
        let mut missing = vec![];
        for caption in distinct {
            if entry_ok(&self.entry_path(caption), &self.key(caption)) {
                report.reused += 1;
                p.reused += 1;
                p.done += 1;
                crate::progress::tick();
                progress(&p);
            } else {
                missing.push(caption);
            }
        }
        for group in missing.chunks(batch.max(1)) {
            let encoded = encode(group)?;
            if encoded.len() != group.len() {
                return Err(data_err(
                    &text,
                    format!(
                        "the encoder returned {} entries for {} captions",
                        encoded.len(),
                        group.len()
                    ),
                ));
            }
            for (caption, enc) in group.iter().zip(&encoded) {
                let path = self.entry_path(caption);
                let repaired = path.exists();
                write_entry(&path, &self.key(caption), caption, &self.encoder, enc)?;
                report.computed += 1;
                report.repaired += repaired as usize;
                p.computed += 1;
                p.done += 1;
                crate::progress::tick();
                progress(&p);
            }
        }
        Ok(report)
    }

    /// The cached tensors of `captions`, read from disk now: one (B, ...) tensor per stored
    /// name, sorted by name, in `dtype` on `device`.
    pub fn load_batch(
        &self,
        captions: &[String],
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<(String, Tensor)>> {
        let paths: Vec<PathBuf> = captions.iter().map(|c| self.entry_path(c)).collect();
        load_stacked(&paths, device, dtype)
    }
}
