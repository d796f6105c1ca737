//! LoRA files made anywhere, merged into a model's weights as it loads: W + s · B A for every
//! layer the file adapts (inference: sampling with a trained LoRA costs nothing extra).
//!
//! Layouts, recognized per tensor:
//! - kohya / ComfyUI: `lora_unet_<layer path, dots as underscores>.lora_down.weight` (r, in),
//!   `.lora_up.weight` (out, r), optional `.alpha`; s = alpha / r (1 without alpha).
//! - diffusers / PEFT: `<prefix>.<diffusers module>.lora_A.weight` (r, in) and
//!   `.lora_B.weight` (rows, r), `<prefix>` the family's pipeline folder (`transformer`,
//!   `unet`); fused layers (Flux's qkv, linear1) take each diffusers part's rows; s = 1
//!   (PEFT's alpha = r), or alpha / r where an `.alpha` tensor is stored.
//! - PEFT names on the original keys (ai-toolkit, ComfyUI): `diffusion_model.<layer
//!   path>.lora_A.weight` / `.lora_B.weight`, or the same without the prefix.
//!
//! Every tensor of the file must be taken by some layer: a file for another model, or an
//! adapter kind FLAME does not merge (LoKr, LoHa), is an error naming a tensor left over.

use super::adapter::kohya_name;
use super::params::{KeyMap, KeySource};
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A LoRA file to merge into the weights a [`super::VarBuilder`] loads.
pub struct LoraMerge {
    path: PathBuf,
    file: SafeTensorsFile,
    /// The strength multiplying every update.
    pub strength: f64,
    /// Key prefixes of the diffusers layout (`transformer`, `unet`).
    prefixes: Vec<String>,
    /// The model's diffusers key map (model key -> diffusers keys), set by the loader.
    diffusers: Mutex<Option<KeyMap>>,
    used: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for LoraMerge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoraMerge({}, x{})", self.path.display(), self.strength)
    }
}

fn err(path: &Path, tensor: Option<&str>, msg: impl Into<String>) -> Error {
    Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

impl LoraMerge {
    /// Opens the LoRA file at `path`, to be merged at `strength` (1: as trained);
    /// `diffusers_prefix` is the family's pipeline folder (`Family::subfolder`).
    pub fn open(path: impl AsRef<Path>, strength: f64, diffusers_prefix: &str) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if !strength.is_finite() {
            return Err(err(&path, None, format!("LoRA strength {strength}")));
        }
        let file = SafeTensorsFile::open(&path)?;
        if file.is_empty() {
            return Err(err(&path, None, "holds no tensor"));
        }
        Ok(LoraMerge {
            path,
            file,
            strength,
            prefixes: vec![diffusers_prefix.to_string()],
            diffusers: Mutex::new(None),
            used: Mutex::new(BTreeSet::new()),
        })
    }

    /// Sets the model's diffusers key map (model key -> diffusers keys), which the diffusers
    /// layout is read through; the model loader sets it before the weights load.
    pub fn set_diffusers_map(&self, map: KeyMap) -> Result<()> {
        *self
            .diffusers
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))? = Some(map);
        Ok(())
    }

    /// One (A, B, alpha key) lookup of the file: `Some` when both A and B are present.
    fn pair(&self, a: String, b: String, alpha: String) -> Option<(String, String, String)> {
        (self.file.contains(&a) && self.file.contains(&b)).then_some((a, b, alpha))
    }

    /// The update s · B A (rows, in) in f32 on `device` from the tensors `a` (r, in) and `b`
    /// (rows, r), checked against the layer's shape.
    fn update(
        &self,
        (a, b, alpha): &(String, String, String),
        rows: usize,
        in_dim: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = |k: &str| {
            self.file
                .info(k)
                .map(|i| i.shape.clone())
                .unwrap_or_default()
        };
        let (sa, sb) = (shape(a), shape(b));
        let r = sa.first().copied().unwrap_or(0);
        if sa.len() != 2 || sa[1] != in_dim || r == 0 {
            return Err(err(
                &self.path,
                Some(a),
                format!("shape {sa:?}: expected (rank, {in_dim}) for this layer"),
            ));
        }
        if sb.as_slice() != [rows, r] {
            return Err(err(
                &self.path,
                Some(b),
                format!("shape {sb:?}: expected ({rows}, {r}) for this layer"),
            ));
        }
        let mut used = self
            .used
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?;
        let scale = if self.file.contains(alpha) {
            used.insert(alpha.clone());
            let v = self.file.load_as(alpha, device, DType::F64)?.to_vec_f64()?;
            match v.as_slice() {
                [x] if x.is_finite() => x / r as f64,
                _ => return Err(err(&self.path, Some(alpha), format!("alpha {v:?}"))),
            }
        } else {
            1.0
        };
        used.insert(a.clone());
        used.insert(b.clone());
        drop(used);
        let a = self.file.load_as(a, device, DType::F32)?;
        let b = self.file.load_as(b, device, DType::F32)?;
        b.matmul(&a)?.affine(scale * self.strength, 0.0)
    }

    /// The update of the weight at model key `key` (out, in) when the file adapts its layer,
    /// in f32 on `device`; the diffusers layout is read through the map of
    /// [`set_diffusers_map`](Self::set_diffusers_map) (without one, model keys are taken as
    /// diffusers keys).
    pub fn delta(
        &self,
        key: &str,
        out: usize,
        in_dim: usize,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let map = self
            .diffusers
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?
            .clone();
        let Some(path) = key.strip_suffix(".weight") else {
            return Ok(None);
        };
        // kohya names, then PEFT names on the original keys.
        let k = kohya_name(path);
        let whole = [
            self.pair(
                format!("{k}.lora_down.weight"),
                format!("{k}.lora_up.weight"),
                format!("{k}.alpha"),
            ),
            self.pair(
                format!("diffusion_model.{path}.lora_A.weight"),
                format!("diffusion_model.{path}.lora_B.weight"),
                format!("diffusion_model.{path}.alpha"),
            ),
            self.pair(
                format!("{path}.lora_A.weight"),
                format!("{path}.lora_B.weight"),
                format!("{path}.alpha"),
            ),
        ];
        if let Some(p) = whole.into_iter().flatten().next() {
            return self.update(&p, out, in_dim, device).map(Some);
        }
        // The diffusers layout: one pair per diffusers part of the layer.
        let parts: Vec<(String, usize, bool)> = match map.as_ref().and_then(|m| m(key)) {
            Some(KeySource::Key(k)) => vec![(k, out, false)],
            Some(KeySource::SwapHalves(k)) => vec![(k, out, true)],
            Some(KeySource::Cat(ps)) => ps.into_iter().map(|(k, r)| (k, r, false)).collect(),
            None => vec![(key.to_string(), out, false)],
        };
        let mut pieces = vec![];
        let mut any = false;
        for (k, rows, swapped) in &parts {
            let module = k.strip_suffix(".weight").unwrap_or(k);
            let found = self.prefixes.iter().find_map(|p| {
                self.pair(
                    format!("{p}.{module}.lora_A.weight"),
                    format!("{p}.{module}.lora_B.weight"),
                    format!("{p}.{module}.alpha"),
                )
            });
            pieces.push(match found {
                Some(pair) => {
                    any = true;
                    let u = self.update(&pair, *rows, in_dim, device)?;
                    if *swapped {
                        let h = rows / 2;
                        Tensor::cat(&[&u.narrow(0, h, h)?, &u.narrow(0, 0, h)?], 0)?
                    } else {
                        u
                    }
                }
                None => Tensor::zeros((*rows, in_dim), DType::F32, device)?,
            });
        }
        if !any {
            return Ok(None);
        }
        Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0).map(Some)
    }

    /// The file's text-encoder tensors (kohya's `lora_te*`), which are not merged: FLAME
    /// merges into the diffusion model only.
    pub fn text_encoder_tensors(&self) -> usize {
        self.file
            .names()
            .filter(|n| n.starts_with("lora_te"))
            .count()
    }

    /// An error naming a tensor of the file no layer took (another model's file, or an
    /// adapter kind FLAME does not merge); `Ok` when every tensor but the text encoders'
    /// ([`text_encoder_tensors`](Self::text_encoder_tensors)) was merged.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self
            .used
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?;
        let left: Vec<&str> = self
            .file
            .names()
            .filter(|n| !used.contains(*n) && !n.starts_with("lora_te"))
            .collect();
        match left.first() {
            None => Ok(()),
            Some(k) => Err(err(
                &self.path,
                Some(k),
                format!(
                    "no layer of the model takes it ({} of {} tensors left over): a LoRA for \
                     another model, or a layout or adapter kind FLAME does not merge (kohya \
                     lora_down/lora_up, diffusers/PEFT lora_A/lora_B)",
                    left.len(),
                    self.file.names().count()
                ),
            )),
        }
    }
}
