//! A scanned, bucketed image dataset and its seeded batch sampler.

use super::bucket::{self, Bucket, BucketConfig, CropMode, Geometry, Resample};
use super::caption::CaptionOptions;
use super::reference::{self, ReferenceOptions};
use super::source::{self, BadFile, Item, OnBadFile, Source};
use super::{data_err, draw, purpose, unit};
use crate::nn::key_hash;
use crate::nn::permutation;
use crate::{Result, Tensor};
use std::collections::BTreeSet;

/// Everything that decides what a [`Dataset`] yields.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetOptions {
    /// Where the images come from.
    pub sources: Vec<Source>,
    /// The buckets.
    pub buckets: BucketConfig,
    /// Centre or seeded random crops.
    pub crop: CropMode,
    /// Mirror each sample with probability 1/2, drawn per (seed, epoch, sample).
    pub flip: bool,
    /// The resize filter.
    pub resample: Resample,
    /// Caption dropout and tag shuffling.
    pub captions: CaptionOptions,
    /// Bad images and captions: skipped and reported, or fatal.
    pub on_bad_file: OnBadFile,
    /// The seed of every draw.
    pub seed: u64,
    /// How reference images (edit training, [`Item::references`]) are sized.
    pub references: ReferenceOptions,
}

/// One sample: an image's `repeat`-th appearance in an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Index into [`Dataset::items`].
    pub item: usize,
    /// Which repeat of the item (0-based).
    pub repeat: usize,
    /// The stable id its draws are seeded by: from the item's name and the repeat.
    pub id: u64,
    /// Its bucket, resize and crop.
    pub geometry: Geometry,
}

/// Images with captions, each repeat a [`Sample`] with its bucket and crop.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// The options it was opened with.
    pub options: DatasetOptions,
    /// The usable images, in scan order.
    pub items: Vec<Item>,
    /// Every item's repeats, items in order.
    pub samples: Vec<Sample>,
    /// The buckets of `options.buckets`, sorted by aspect ratio.
    pub buckets: Vec<Bucket>,
    /// The files left out ([`OnBadFile::Skip`]): at the scan (including images too small
    /// or too elongated for the buckets, [`bucket::unfit`]), and images that failed to
    /// decode when a cache was filled.
    pub skipped: Vec<BadFile>,
    /// The scan's remarks on files used but not as written ([`source::Scan::notes`]: a
    /// caption read as Windows-1252), for the user to see.
    pub notes: Vec<String>,
}

/// The most samples (images × repeats) an epoch may hold: each takes a few dozen bytes of
/// host memory and a latent cache entry on disk.
pub const MAX_SAMPLES: usize = 10_000_000;

/// The first source's folder or manifest, to name in an error about the whole dataset.
fn source_place(sources: &[Source]) -> std::path::PathBuf {
    match sources.first() {
        Some(Source::Folder { dir, .. }) => dir.clone(),
        Some(Source::Manifest { path, .. }) => path.clone(),
        None => std::path::PathBuf::from("."),
    }
}

impl Dataset {
    /// Scans the sources, leaving out images unfit for the buckets ([`source::scan_for`]),
    /// makes the buckets and places every sample (module docs of [`source`] and
    /// [`bucket`]). An error when no usable image remains.
    pub fn open(options: DatasetOptions) -> Result<Dataset> {
        let scan = source::scan_for(&options.sources, options.on_bad_file, &options.buckets)?;
        let buckets = bucket::buckets(&options.buckets)?;
        let mut ds = Dataset {
            items: scan.items,
            skipped: scan.skipped,
            notes: scan.notes,
            samples: vec![],
            buckets,
            options,
        };
        ds.place()?;
        Ok(ds)
    }

    fn place(&mut self) -> Result<()> {
        let o = &self.options;
        let views = self
            .items
            .iter()
            .try_fold(0usize, |n, it| n.checked_add(it.repeats))
            .filter(|n| *n <= MAX_SAMPLES);
        let Some(views) = views else {
            return Err(data_err(
                &source_place(&o.sources),
                format!(
                    "{} images with their repeats make more than {MAX_SAMPLES} samples an \
                     epoch: lower the repeats (data.dirs, data.manifest_repeats, \
                     <repeats>_<name> folders)",
                    self.items.len()
                ),
            ));
        };
        let mut samples = Vec::with_capacity(views);
        for (i, item) in self.items.iter().enumerate() {
            let b = bucket::closest(&self.buckets, item.width, item.height)
                .ok_or_else(|| data_err(&item.path, "no bucket for this image"))?;
            for repeat in 0..item.repeats {
                let id = draw(key_hash(&item.name), &[repeat as u64]);
                let geometry = Geometry::new(item.width, item.height, b, o.crop, o.seed, id);
                samples.push(Sample {
                    item: i,
                    repeat,
                    id,
                    geometry,
                });
            }
        }
        if samples.is_empty() {
            return Err(data_err(
                &source_place(&o.sources),
                format!(
                    "no usable image in the {} source(s) ({} file(s) left out)",
                    o.sources.len(),
                    self.skipped.len()
                ),
            ));
        }
        self.samples = samples;
        Ok(())
    }

    /// Leaves out the items at `bad` (indices into `items`), recording why; the remaining
    /// samples keep their ids and geometry.
    pub(crate) fn remove_items(&mut self, bad: Vec<(usize, String)>) -> Result<()> {
        let drop: BTreeSet<usize> = bad.iter().map(|(i, _)| *i).collect();
        for (i, reason) in bad {
            if let Some(item) = self.items.get(i) {
                self.skipped.push(BadFile {
                    path: item.path.clone(),
                    reason,
                });
            }
        }
        let items = std::mem::take(&mut self.items);
        self.items = items
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !drop.contains(i))
            .map(|(_, it)| it)
            .collect();
        self.place()
    }

    /// Splits off about `fraction` of the images (at least one when `fraction > 0` and
    /// there are two or more) for validation: an image is held out when a draw from the seed
    /// and its name falls under `fraction`, so the split does not move when images are
    /// added. Returns (training, held out); the held-out set is `None` when `fraction` is 0.
    /// An error when `fraction` is outside [0, 1).
    pub fn split(mut self, fraction: f64) -> Result<(Dataset, Option<Dataset>)> {
        if !(0.0..1.0).contains(&fraction) {
            return Err(crate::Error::invalid(
                "Dataset::split",
                format!("fraction {fraction} is not in [0, 1)"),
                &crate::Shape::from(vec![self.items.len()]),
            ));
        }
        if fraction == 0.0 {
            return Ok((self, None));
        }
        let seed = self.options.seed;
        let score = |it: &Item| unit(draw(seed, &[key_hash(&it.name), purpose("validation")]));
        let mut held: Vec<bool> = self.items.iter().map(|it| score(it) < fraction).collect();
        if !held.iter().any(|&h| h) && self.items.len() >= 2 {
            // The image with the lowest draw, so tiny datasets still get a validation image.
            let lowest = (0..self.items.len())
                .min_by(|&a, &b| score(&self.items[a]).total_cmp(&score(&self.items[b])));
            if let Some(i) = lowest {
                held[i] = true;
            }
        }
        if !held.iter().any(|&h| h) {
            return Ok((self, None));
        }
        if held.iter().all(|&h| h) {
            return Err(data_err(
                &self.items[0].path,
                format!(
                    "validation split {fraction} holds out every one of the {} images",
                    self.items.len()
                ),
            ));
        }
        let mut val = self.clone();
        let items = std::mem::take(&mut self.items);
        let (mut keep, mut out) = (vec![], vec![]);
        for (it, h) in items.into_iter().zip(&held) {
            if *h {
                out.push(it);
            } else {
                keep.push(it);
            }
        }
        self.items = keep;
        self.place()?;
        val.items = out;
        val.skipped.clear();
        val.notes.clear();
        val.place()?;
        Ok((self, Some(val)))
    }

    /// Adds regularisation images (`data.reg_dirs`, scanned as `reg`): each marked
    /// [`Item::reg`], named `reg:<name>` (so its draws differ from a training image's of
    /// the same name), with its repeats set by [`reg_repeats`] against the training samples
    /// there are now; those given 0 repeats are left out. Returns how many were used.
    pub fn add_regularisation(&mut self, reg: source::Scan) -> Result<usize> {
        let train: usize = self.items.iter().map(|it| it.repeats).sum();
        let given: Vec<usize> = reg.items.iter().map(|it| it.repeats).collect();
        let repeats = reg_repeats(train, &given);
        let mut used = 0;
        for (mut it, r) in reg.items.into_iter().zip(repeats) {
            if r == 0 {
                continue;
            }
            it.repeats = r;
            it.reg = true;
            it.name = format!("reg:{}", it.name);
            self.items.push(it);
            used += 1;
        }
        self.skipped.extend(reg.skipped);
        self.notes.extend(reg.notes);
        self.place()?;
        Ok(used)
    }

    /// Whether any sample is a regularisation image's.
    pub fn has_reg(&self) -> bool {
        self.items.iter().any(|it| it.reg)
    }

    /// The number of samples (items times their repeats).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there are no samples (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The item of sample `i`. An error when `i` is out of range.
    pub fn item(&self, i: usize) -> Result<&Item> {
        let s = self.sample(i)?;
        self.items.get(s.item).ok_or_else(|| {
            data_err(
                std::path::Path::new("."),
                format!("item {} missing", s.item),
            )
        })
    }

    /// Sample `i`. An error when `i` is out of range.
    pub fn sample(&self, i: usize) -> Result<&Sample> {
        self.samples.get(i).ok_or_else(|| {
            crate::Error::invalid(
                "Dataset::sample",
                format!("sample {i} of {}", self.samples.len()),
                &crate::Shape::from(vec![self.samples.len()]),
            )
        })
    }

    /// Whether any image has reference images (edit training).
    pub fn has_references(&self) -> bool {
        self.items.iter().any(|it| !it.references.is_empty())
    }

    /// The way of reference `j` of item `item` into the model ([`reference::geometry`] with
    /// `options.references`). Errors name the image and the reference.
    pub fn reference_geometry(&self, item: usize, j: usize) -> Result<super::Geometry> {
        let it = self
            .items
            .get(item)
            .ok_or_else(|| data_err(std::path::Path::new("."), format!("item {item} missing")))?;
        let r = it.references.get(j).ok_or_else(|| {
            data_err(
                &it.path,
                format!("no reference {j} ({} references)", it.references.len()),
            )
        })?;
        reference::geometry(r.width, r.height, &self.options.references).map_err(|why| {
            data_err(
                &it.path,
                format!("its reference {}: {why}", r.path.display()),
            )
        })
    }

    /// The sizes (width, height) in pixels of item `item`'s references as the model sees
    /// them, in order; pictures that cannot be references are left out (the scan and the
    /// cache fill report them).
    pub fn reference_sizes(&self, item: usize) -> Vec<(usize, usize)> {
        let Some(it) = self.items.get(item) else {
            return vec![];
        };
        (0..it.references.len())
            .filter_map(|j| self.reference_geometry(item, j).ok())
            .map(|g| (g.bucket.width, g.bucket.height))
            .collect()
    }

    /// Whether sample `i` is mirrored in `epoch`.
    pub fn flip(&self, i: usize, epoch: u64) -> Result<bool> {
        let s = self.sample(i)?;
        Ok(self.options.flip
            && unit(draw(self.options.seed, &[epoch, s.id, purpose("flip")])) < 0.5)
    }

    /// The caption sample `i` trains on in `epoch` (after dropout and tag shuffling).
    pub fn caption(&self, i: usize, epoch: u64) -> Result<String> {
        let s = self.sample(i)?;
        let item = self.item(i)?;
        Ok(self
            .options
            .captions
            .apply(&item.caption, self.options.seed, epoch, s.id))
    }

    /// SDXL's micro-conditioning of sample `i` in `epoch` ([`Geometry::time_ids`]).
    pub fn time_ids(&self, i: usize, epoch: u64) -> Result<[usize; 6]> {
        Ok(self.sample(i)?.geometry.time_ids(self.flip(i, epoch)?))
    }

    /// Decodes every item's pixels and its references' (in parallel) and returns the items
    /// that fail, in item order, as [`BadFile`]s: what a cache fill would meet, found
    /// without encoding (a truncated file passes the scan, which reads headers only).
    pub fn check_pixels(&self) -> Vec<BadFile> {
        use rayon::prelude::*;
        self.items
            .par_iter()
            .filter_map(|it| {
                let image = bucket::decode(&it.path).err();
                let reason = image.or_else(|| {
                    it.references.iter().find_map(|r| {
                        bucket::decode(&r.path)
                            .err()
                            .map(|why| format!("its reference {}: {why}", r.path.display()))
                    })
                })?;
                Some(BadFile {
                    path: it.path.clone(),
                    reason,
                })
            })
            .collect()
    }

    /// Sample `i`'s image in `epoch`: decoded, resized, cropped and maybe mirrored, a
    /// (3, H, W) f32 tensor in [-1, 1] on `device`. Errors name the file.
    pub fn image(&self, i: usize, epoch: u64, device: &crate::Device) -> Result<Tensor> {
        let s = *self.sample(i)?;
        let item = self.item(i)?;
        let img = bucket::decode(&item.path).map_err(|m| data_err(&item.path, m))?;
        bucket::to_tensor(
            &img,
            &s.geometry,
            self.options.resample,
            self.flip(i, epoch)?,
            &item.path,
            device,
        )
    }

    /// A batch sampler over these samples: batches of `batch_size` from one bucket each; a
    /// bucket's last, smaller batch is dropped when `drop_incomplete`.
    pub fn sampler(&self, batch_size: usize, drop_incomplete: bool) -> Result<BatchSampler> {
        BatchSampler::new(self, batch_size, drop_incomplete)
    }
}

/// The repeats of regularisation images given `given` repeats each (in scan order)
/// against `train` training samples (images times repeats), as kohya's DreamBoothDataset
/// sets them (library/train_util.py, `while n < num_train_images`): a first pass takes each
/// image with its repeats, adding them up, and stops once the sum reaches `train`; while
/// the sum is still under `train` after a whole pass, further passes add one repeat to each
/// image in turn, stopping when it does. Images the first pass did not reach get 0 (left
/// out); with `train` = 0, or no reg images, none is used.
pub fn reg_repeats(train: usize, given: &[usize]) -> Vec<usize> {
    let mut out = vec![0; given.len()];
    if given.is_empty() || given.iter().all(|&r| r == 0) {
        return out;
    }
    let mut n = 0;
    let mut first = true;
    while n < train {
        for (o, &r) in out.iter_mut().zip(given) {
            if first {
                *o = r;
                n += r;
            } else {
                *o += 1;
                n += 1;
            }
            if n >= train {
                break;
            }
        }
        first = false;
    }
    out
}

/// Batches drawn from one bucket at a time. An epoch's batches are a function of
/// (seed, epoch) alone: each bucket's samples in a seeded order, cut into batches, and the
/// batches of all buckets in a seeded order; every epoch has the same number of batches, so
/// a global batch position maps to (epoch, batch) and a resumed run repeats its data.
///
/// With reference images (edit training) a bucket's samples are grouped further by the
/// sizes of their references (count and each one's size, as the model sees them), so that
/// every batch stacks: a group is the target's bucket and one such list (musubi-tuner's
/// buckets of target and control resolution).
#[derive(Clone, Debug)]
pub struct BatchSampler {
    /// (bucket, its sample indices ascending), buckets in the dataset's order.
    groups: Vec<(Bucket, Vec<usize>)>,
    /// Each group's reference sizes (empty lists without references).
    reference_sizes: Vec<Vec<(usize, usize)>>,
    batch_size: usize,
    drop_incomplete: bool,
    seed: u64,
}

impl BatchSampler {
    /// The sampler of `ds` (see [`Dataset::sampler`]). An error when `batch_size` is 0 or
    /// no full batch exists with `drop_incomplete`.
    pub fn new(ds: &Dataset, batch_size: usize, drop_incomplete: bool) -> Result<Self> {
        let shape = crate::Shape::from(vec![ds.len()]);
        if batch_size == 0 {
            return Err(crate::Error::invalid(
                "BatchSampler",
                "batch_size 0",
                &shape,
            ));
        }
        // The reference sizes of each item, once (none without references).
        let sizes: Vec<Vec<(usize, usize)>> =
            (0..ds.items.len()).map(|i| ds.reference_sizes(i)).collect();
        let mut groups: Vec<(Bucket, Vec<usize>)> = vec![];
        let mut reference_sizes = vec![];
        for &b in &ds.buckets {
            let idx: Vec<usize> = (0..ds.samples.len())
                .filter(|&i| ds.samples[i].geometry.bucket == b)
                .collect();
            // Within a bucket, one group per list of reference sizes, in order of first
            // appearance (a single group without references).
            let mut lists: Vec<&Vec<(usize, usize)>> = vec![];
            for &i in &idx {
                let l = &sizes[ds.samples[i].item];
                if !lists.contains(&l) {
                    lists.push(l);
                }
            }
            for l in lists {
                let these: Vec<usize> = idx
                    .iter()
                    .copied()
                    .filter(|&i| &sizes[ds.samples[i].item] == l)
                    .collect();
                groups.push((b, these));
                reference_sizes.push(l.clone());
            }
        }
        let s = BatchSampler {
            groups,
            reference_sizes,
            batch_size,
            drop_incomplete,
            seed: ds.options.seed,
        };
        if s.batches_per_epoch() == 0 {
            return Err(crate::Error::invalid(
                "BatchSampler",
                format!("no bucket holds a full batch of {batch_size}"),
                &shape,
            ));
        }
        Ok(s)
    }

    /// The buckets in use with their sample counts (a bucket once per list of reference
    /// sizes, [`BatchSampler::reference_sizes`]).
    pub fn bucket_sizes(&self) -> Vec<(Bucket, usize)> {
        self.groups.iter().map(|(b, v)| (*b, v.len())).collect()
    }

    /// The reference sizes (width, height) of each group, in the order of
    /// [`BatchSampler::bucket_sizes`] (empty lists without references).
    pub fn reference_sizes(&self) -> &[Vec<(usize, usize)>] {
        &self.reference_sizes
    }

    /// Batches in every epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.groups
            .iter()
            .map(|(_, v)| match self.drop_incomplete {
                true => v.len() / self.batch_size,
                false => v.len().div_ceil(self.batch_size),
            })
            .sum()
    }

    /// The batches of `epoch`, in order: sample indices, all of one bucket per batch.
    pub fn epoch(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut batches = vec![];
        for ((b, idx), refs) in self.groups.iter().zip(&self.reference_sizes) {
            let mut parts = vec![
                epoch,
                purpose("bucket-order"),
                b.width as u64,
                b.height as u64,
            ];
            // Groups of one bucket apart by their references (none: the draw as before).
            for &(w, h) in refs {
                parts.extend([w as u64, h as u64]);
            }
            let bucket_seed = draw(self.seed, &parts);
            let order: Vec<usize> = permutation(idx.len(), bucket_seed)
                .into_iter()
                .map(|k| idx[k])
                .collect();
            for chunk in order.chunks(self.batch_size) {
                if chunk.len() == self.batch_size || !self.drop_incomplete {
                    batches.push(chunk.to_vec());
                }
            }
        }
        let p = permutation(
            batches.len(),
            draw(self.seed, &[epoch, purpose("batch-order")]),
        );
        p.into_iter().map(|k| batches[k].clone()).collect()
    }

    /// The batch at global position `pos` (from 0, across epochs) with its epoch.
    pub fn batch_at(&self, pos: usize) -> (u64, Vec<usize>) {
        let n = self.batches_per_epoch().max(1);
        let epoch = (pos / n) as u64;
        let batch = self
            .epoch(epoch)
            .into_iter()
            .nth(pos % n)
            .unwrap_or_default();
        (epoch, batch)
    }
}
