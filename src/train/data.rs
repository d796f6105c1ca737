//! Pre-encoded training data: one safetensors file per sample in a folder, holding the
//! tensors the model family asks for ([`crate::models::DiffusionModel::inputs`]; Flux:
//! `latents` (C, H, W), `context` (T, D) text token embeddings, `pooled` (P); SDXL adds
//! `time_ids` (6)). Every file is checked before training starts: names, shapes, dtypes and
//! that every value is finite; a bad sample is an error naming the file and the tensor.

use crate::models::Input;
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Tensor};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// A model's limits on a sample's shapes beyond the per-dim rules: `Err` says what is wrong
/// ([`crate::models::DiffusionModel::check_shapes`]).
pub type ShapeCheck<'a> = dyn Fn(&[Vec<usize>]) -> std::result::Result<(), String> + Sync + 'a;

/// The samples of a training run, checked.
#[derive(Debug)]
pub struct Dataset {
    /// The sample files, sorted by name.
    pub files: Vec<PathBuf>,
    /// The shapes every sample shares, by input in the model's order.
    pub shapes: Vec<Vec<usize>>,
    names: Vec<&'static str>,
}

fn bad(path: &Path, tensor: Option<&str>, msg: impl Into<String>) -> Error {
    Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

/// File dtypes that can hold latents and embeddings.
const FLOAT_DTYPES: [&str; 4] = ["F16", "BF16", "F32", "F64"];

/// Checks one sample against `inputs`: present, float (`time_ids` may be integers), the
/// right shape, every value finite. Returns its shapes in `inputs` order.
fn check_sample(f: &Path, inputs: &[Input]) -> Result<Vec<Vec<usize>>> {
    let file = SafeTensorsFile::open(f)?;
    let mut shapes = vec![];
    for input in inputs {
        let name = input.name;
        let info = file
            .info(name)
            .ok_or_else(|| bad(f, Some(name), "missing from the sample"))?;
        let ids = name == "time_ids" && info.dtype == "U32";
        if !FLOAT_DTYPES.contains(&info.dtype.as_str()) && !ids {
            return Err(bad(
                f,
                Some(name),
                format!(
                    "dtype {}: expected a float dtype ({})",
                    info.dtype,
                    FLOAT_DTYPES.join(", ")
                ),
            ));
        }
        if let Some(why) = input.mismatch(&info.shape) {
            return Err(bad(f, Some(name), why));
        }
        let values = file.host(name)?.to_f64_vec();
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(bad(
                f,
                Some(name),
                format!("holds a non-finite value ({} at flat index {i})", values[i]),
            ));
        }
        shapes.push(info.shape.clone());
    }
    Ok(shapes)
}

impl Dataset {
    /// Opens every `*.safetensors` in `dir` (sorted by name) and checks each against
    /// `inputs` (in parallel) and `extra` (the model's further limits); all samples must
    /// share their shapes (they are batched).
    pub fn open(dir: &Path, inputs: &[Input], extra: &ShapeCheck<'_>) -> Result<Dataset> {
        let entries = std::fs::read_dir(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(bad(dir, None, "no .safetensors samples in the data folder"));
        }
        // The first bad file in name order is the one reported, whatever the thread timing.
        let all: Vec<Result<Vec<Vec<usize>>>> =
            files.par_iter().map(|f| check_sample(f, inputs)).collect();
        let mut shapes: Option<Vec<Vec<usize>>> = None;
        for (f, these) in files.iter().zip(all) {
            let these = these?;
            match &shapes {
                Some(s) if *s != these => {
                    return Err(bad(
                        f,
                        None,
                        format!("shapes {these:?} differ from the first sample's {s:?}"),
                    ))
                }
                Some(_) => {}
                None => {
                    extra(&these).map_err(|msg| bad(f, None, msg))?;
                    shapes = Some(these)
                }
            }
        }
        Ok(Dataset {
            files,
            shapes: shapes.unwrap_or_default(),
            names: inputs.iter().map(|i| i.name).collect(),
        })
    }

    /// The number of samples.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether there are no samples (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The samples at `idx` stacked into a batch: one tensor per input, (B, ...), in
    /// `dtype` on `device`.
    pub fn batch(&self, idx: &[usize], dtype: DType, device: &Device) -> Result<Vec<Tensor>> {
        let mut cols: Vec<Vec<Tensor>> = vec![vec![]; self.names.len()];
        for &i in idx {
            let f = SafeTensorsFile::open(&self.files[i])?;
            for (c, name) in cols.iter_mut().zip(&self.names) {
                c.push(f.load_as(name, device, dtype)?);
            }
        }
        cols.iter()
            .map(|c| Tensor::stack(&c.iter().collect::<Vec<_>>(), 0))
            .collect()
    }
}

/// One micro-batch: the model's inputs in its order ([`crate::models::DiffusionModel::inputs`]),
/// each (B, ...), and the files its samples came from (named in errors).
#[derive(Clone, Debug)]
pub struct Batch {
    /// The inputs, latents first (none when this process's part of the batch is empty).
    pub inputs: Vec<Tensor>,
    /// The sample files (pre-encoded samples or images).
    pub files: Vec<String>,
    /// This process's rows of the global batch.
    pub rows: std::ops::Range<usize>,
    /// The samples in the global batch (every process's part together).
    pub global: usize,
    /// Each row's loss mask on the latent grid (B, 1, H, W), with `data.masked_loss` or
    /// `data.alpha_mask`.
    pub loss_mask: Option<Tensor>,
    /// Each row's loss weight (B,) f32 where a row is a regularisation image's
    /// (`data.prior_loss_weight`; 1 for the others).
    pub loss_weight: Option<Tensor>,
    /// The rows' reference images (edit training): each reference's latents (B, C, h, w),
    /// in order, as [`crate::models::DiffusionModel::predict_with_references`] takes them;
    /// empty without references.
    pub references: Vec<Tensor>,
}

/// Which part of every global batch a process takes in data-parallel training: the rows
/// [`crate::dist::shard`] gives rank `rank` of `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// The process's rank.
    pub rank: usize,
    /// The number of processes.
    pub world: usize,
}

impl Part {
    /// The whole batch (a single process).
    pub const WHOLE: Part = Part { rank: 0, world: 1 };
}

/// Where a run's batches come from: pre-encoded samples ([`Dataset`]) or images with
/// captions through the caches ([`super::images::ImageSamples`]).
pub trait Samples: Send + Sync {
    /// Samples in an epoch.
    fn len(&self) -> usize;
    /// Whether there are none (never, once opened).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The per-sample shapes, in the model's input order, of the largest samples a batch
    /// can hold, then those of their reference images' latents (edit training): what the
    /// memory plan is made for.
    fn largest(&self) -> Vec<Vec<usize>>;
    /// `part` of micro-batch number `micro` of the run (from 0, across epochs) of `batch`
    /// samples (all processes together), in `dtype` on `device`: a function of (`seed`,
    /// `micro`, `part`) alone, so a resumed run sees the batches the uninterrupted one
    /// would have, and the parts of all processes make the batch one process would take.
    fn batch(
        &self,
        micro: usize,
        batch: usize,
        seed: u64,
        part: Part,
        dtype: DType,
        device: &Device,
    ) -> Result<Batch>;
    /// One line for the run's summary.
    fn describe(&self) -> String;
}

impl Samples for Dataset {
    fn len(&self) -> usize {
        self.files.len()
    }
    fn largest(&self) -> Vec<Vec<usize>> {
        self.shapes.clone()
    }
    fn batch(
        &self,
        micro: usize,
        batch: usize,
        seed: u64,
        part: Part,
        dtype: DType,
        device: &Device,
    ) -> Result<Batch> {
        let all = indices(self.files.len(), seed, micro * batch, batch);
        let rows = crate::dist::shard(all.len(), part.rank, part.world);
        let idx = &all[rows.clone()];
        Ok(Batch {
            inputs: match idx.is_empty() {
                true => vec![],
                false => Dataset::batch(self, idx, dtype, device)?,
            },
            files: idx
                .iter()
                .map(|&i| self.files[i].display().to_string())
                .collect(),
            rows,
            global: all.len(),
            loss_mask: None,
            loss_weight: None,
            references: vec![],
        })
    }
    fn describe(&self) -> String {
        format!(
            "{} pre-encoded samples of shapes {:?}",
            self.files.len(),
            self.shapes
        )
    }
}

/// Refuses a batch larger than the `samples` the run draws from (`what` they are), naming
/// the key: each optimizer step takes `train.batch_size` samples on each of `world` ranks.
pub fn check_batch_size(
    config: &super::config::TrainConfig,
    world: usize,
    samples: usize,
    what: &str,
) -> Result<()> {
    let b = config.train.batch_size;
    if b.saturating_mul(world) > samples {
        let ranks = match world {
            1 => String::new(),
            w => format!(" x {w} ranks"),
        };
        return Err(Error::Config {
            path: None,
            msg: format!(
                "train.batch_size = {b}{ranks} is more than the {samples} {what}: lower \
                 train.batch_size (or raise train.grad_accum for a larger effective batch), or \
                 add data"
            ),
        });
    }
    Ok(())
}

pub use crate::nn::permutation;

/// Sample indices of global position `pos` onwards (`b` of them), epoch by epoch, each epoch
/// in its own order from (seed, epoch): data order is a function of the position alone, so
/// a resumed run sees what the uninterrupted one would have.
pub fn indices(n: usize, seed: u64, pos: usize, b: usize) -> Vec<usize> {
    (pos..pos + b)
        .map(|p| {
            let epoch = (p / n) as u64;
            permutation(n, seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407))[p % n]
        })
        .collect()
}
