//! Pre-encoded training data: one safetensors file per sample in a folder, holding `latents`
//! (C, H, W), `context` (T, D) text token embeddings, `pooled` (P) pooled text embedding and,
//! for SDXL, `time_ids` (6). Every file is checked against the model before training starts;
//! a wrong or missing tensor is an error naming the file.

use crate::nn::{mix64, GOLDEN};
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Tensor};
use std::path::{Path, PathBuf};

/// What each sample must hold: (name, expected dims with `None` for free sizes).
pub type Spec = Vec<(&'static str, Vec<Option<usize>>)>;

#[derive(Debug)]
pub struct Dataset {
    pub files: Vec<PathBuf>,
    /// The shapes every sample shares, by tensor name in `Spec` order.
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

impl Dataset {
    /// Opens every `*.safetensors` in `dir` (sorted by name) and checks it against `spec`;
    /// all samples must share their shapes (they are batched).
    pub fn open(dir: &Path, spec: &Spec) -> Result<Dataset> {
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
        let mut shapes: Option<Vec<Vec<usize>>> = None;
        for f in &files {
            let file = SafeTensorsFile::open(f)?;
            let mut these = vec![];
            for (name, want) in spec {
                let info = file
                    .info(name)
                    .ok_or_else(|| bad(f, Some(name), "missing from the sample"))?;
                let ok = info.shape.len() == want.len()
                    && info
                        .shape
                        .iter()
                        .zip(want)
                        .all(|(h, w)| w.is_none_or(|w| w == *h));
                if !ok {
                    let want: Vec<String> = want
                        .iter()
                        .map(|w| w.map_or("_".into(), |w| w.to_string()))
                        .collect();
                    return Err(bad(
                        f,
                        Some(name),
                        format!(
                            "shape {:?}, the model needs [{}]",
                            info.shape,
                            want.join(", ")
                        ),
                    ));
                }
                these.push(info.shape.clone());
            }
            match &shapes {
                Some(s) if *s != these => {
                    return Err(bad(
                        f,
                        None,
                        format!("shapes {these:?} differ from the first sample's {s:?}"),
                    ))
                }
                Some(_) => {}
                None => shapes = Some(these),
            }
        }
        Ok(Dataset {
            files,
            shapes: shapes.unwrap_or_default(),
            names: spec.iter().map(|(n, _)| *n).collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The samples at `idx` stacked into a batch: one tensor per spec name, (B, ...), in
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

/// A permutation of 0..n from `seed` (Fisher-Yates over splitmix64).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(GOLDEN);
        mix64(state)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

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
