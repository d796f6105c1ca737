//! LoRA files made anywhere, merged into a model's weights as it loads: W + s · B A for every
//! layer the file adapts (inference: sampling with a trained LoRA costs nothing extra).
//!
//! Layouts, recognized per tensor:
//! - kohya / ComfyUI: `lora_unet_<layer path, dots as underscores>.lora_down.weight` (r, in),
//!   `.lora_up.weight` (out, r), optional `.alpha`; s = alpha / r (1 without alpha).
//! - diffusers / PEFT: `<prefix>.<diffusers module>.lora_A.weight` (r, in) and
//!   `.lora_B.weight` (rows, r), `<prefix>` the family's pipeline folder (`transformer`,
//!   `unet`); fused layers (Flux's qkv, linear1) take each diffusers part's rows; s = alpha /
//!   r where an `.alpha` tensor is stored, else PEFT's scale of the module from the
//!   `adapter_config.json` beside the file (its `rank_pattern`, `alpha_pattern` and
//!   `use_rslora` too), else 1 (diffusers' alpha = r).
//! - PEFT names on the original keys (ai-toolkit, ComfyUI): `diffusion_model.<layer
//!   path>.lora_A.weight` / `.lora_B.weight`, or the same without the prefix.
//!
//! - kohya / LyCORIS kinds on Linear layers, read as ComfyUI reads them: DoRA
//!   (`lora_down`/`lora_up`/`alpha` + `dora_scale`, (out, 1) per output row or (1, in) per
//!   input column: W' = m (W + ΔW) / ‖W + ΔW‖), LoKr (`lokr_w1` or `lokr_w1_a/_b`, `lokr_w2`
//!   or `lokr_w2_a/_b`: ΔW = s w1 ⊗ w2, s = alpha / r with a low-rank factor, else 1), LoHa
//!   (`hada_w1_a/_b`, `hada_w2_a/_b`: ΔW = alpha / r (w1_a w1_b) ⊙ (w2_a w2_b)) and full
//!   (`diff`: ΔW = diff).
//!
//! - The PEFT layout's DoRA (`lora_A`/`lora_B` + `lora_magnitude_vector` of each diffusers
//!   part: W' = m (W + ΔW) / ‖W + ΔW‖ per output row), LoKr and LoHa (`lokr_*`, `hada_*` on
//!   a whole layer, s = PEFT's scale of the module from `adapter_config.json`, else 1: FLAME
//!   folds s into them), as FLAME writes them.
//! - Convolutions in each of these (LoCon, DoRA, LoKr, LoHa, full): a factor's kernel joins
//!   its columns (`lora_down` (r, in, kh, kw), `lora_up` (out, r, 1, 1), `lokr_w2` (out_k,
//!   in_n, kh, kw), `hada_w1_b` (r, in · kh · kw)), the update made as the matrix (out, in ·
//!   kh · kw) and shaped as the weight.
//!
//! Every tensor of the file must be taken by some layer: a file for another model, or an
//! adapter kind FLAME does not merge (LyCORIS's Tucker forms), is an error naming a tensor
//! left over.

use super::adapter::{kohya_name, PeftScales};
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
    /// PEFT's scales from the `adapter_config.json` beside the file, if there is one.
    peft: Option<PeftScales>,
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
        let peft = PeftScales::beside(&path)?;
        Ok(LoraMerge {
            path,
            file,
            strength,
            prefixes: vec![diffusers_prefix.to_string()],
            diffusers: Mutex::new(None),
            used: Mutex::new(BTreeSet::new()),
            peft,
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
        strength: f64,
    ) -> Result<Tensor> {
        let shape = |k: &str| {
            self.file
                .info(k)
                .map(|i| i.shape.clone())
                .unwrap_or_default()
        };
        // A convolution's down holds its kernel (r, in, kh, kw) and its up is 1x1
        // (rows, r, 1, 1): both read as matrices, in_dim counting the kernel.
        let (sa, sb) = (shape(a), shape(b));
        let r = sa.first().copied().unwrap_or(0);
        if sa.len() < 2 || sa[1..].iter().product::<usize>() != in_dim || r == 0 {
            return Err(err(
                &self.path,
                Some(a),
                format!("shape {sa:?}: expected (rank, {in_dim}) for this layer"),
            ));
        }
        if sb.len() < 2 || sb[..2] != [rows, r] || sb[2..].iter().any(|&d| d != 1) {
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
            // The PEFT layout without alpha tensors: PEFT's scale of the module (its
            // adapter_config.json beside the file), else 1 (diffusers' alpha = r).
            match (&self.peft, a.strip_suffix(".lora_A.weight")) {
                (Some(p), Some(module)) => p.of(module),
                _ => 1.0,
            }
        };
        used.insert(a.clone());
        used.insert(b.clone());
        drop(used);
        let a = self
            .file
            .load_as(a, device, DType::F32)?
            .reshape((r, in_dim))?;
        let b = self
            .file
            .load_as(b, device, DType::F32)?
            .reshape((rows, r))?;
        b.matmul(&a)?.affine(scale * strength, 0.0)
    }

    /// Tensor `k` of the file as f32 on `device`, marked used; `None` when absent.
    fn take(&self, k: &str, device: &Device) -> Result<Option<Tensor>> {
        if !self.file.contains(k) {
            return Ok(None);
        }
        self.used
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?
            .insert(k.to_string());
        self.file.load_as(k, device, DType::F32).map(Some)
    }

    /// The (rows, cols) of `t`, read from tensor `k`: an error naming it unless a matrix.
    fn matrix(&self, k: &str, t: &Tensor) -> Result<(usize, usize)> {
        match t.dims() {
            &[r, c] => Ok((r, c)),
            _ => Err(self.bad(k, t, "a matrix")),
        }
    }

    /// `t` (rows, ...) as the matrix (rows, the rest): a convolution factor's kernel joins its
    /// columns.
    fn flat(&self, k: &str, t: Tensor) -> Result<Tensor> {
        match t.dims() {
            [r, rest @ ..] if !rest.is_empty() => {
                let cols = rest.iter().product::<usize>();
                let r = *r;
                t.reshape((r, cols))
            }
            _ => Err(self.bad(k, &t, "a matrix")),
        }
    }

    /// A shape error for tensor `k`.
    fn bad(&self, k: &str, t: &Tensor, want: &str) -> Error {
        err(
            &self.path,
            Some(k),
            format!("shape {:?}: expected {want} for this layer", t.dims()),
        )
    }

    /// The LyCORIS kinds of the kohya layout (LoKr, LoHa, full) for the layer named `k`,
    /// whose weight has `dims` ((out, in), or (out, in, kh, kw) for a convolution, whose
    /// kernel the factors' columns hold): s · ΔW in f32 as the matrix (out, in · kh · kw), or
    /// `None` when the file has none of them for it.
    fn lycoris(&self, k: &str, dims: &[usize], device: &Device) -> Result<Option<Tensor>> {
        let out = dims.first().copied().unwrap_or(0);
        let in_dim = dims.iter().skip(1).product::<usize>();
        let name = |t: &str| format!("{k}.{t}");
        let alpha = || -> Result<Option<f64>> {
            Ok(match self.take(&name("alpha"), device)? {
                Some(a) => match a.to_vec_f64()?.as_slice() {
                    [x] if x.is_finite() => Some(*x),
                    v => {
                        return Err(err(
                            &self.path,
                            Some(&name("alpha")),
                            format!("alpha {v:?}"),
                        ))
                    }
                },
                None => None,
            })
        };
        if let Some(d) = self.take(&name("diff"), device)? {
            if d.dims() != dims {
                return Err(self.bad(&name("diff"), &d, &format!("{dims:?}")));
            }
            return d.reshape((out, in_dim)).map(Some);
        }
        if let Some(a1) = self.take(&name("hada_w1_a"), device)? {
            let get = |t: &str| {
                self.take(&name(t), device)?
                    .ok_or_else(|| err(&self.path, Some(&name(t)), "missing (a LoHa needs it)"))
            };
            let (b1, a2, b2) = (
                self.flat(&name("hada_w1_b"), get("hada_w1_b")?)?,
                get("hada_w2_a")?,
                self.flat(&name("hada_w2_b"), get("hada_w2_b")?)?,
            );
            let r = self.matrix(&name("hada_w1_b"), &b1)?.0;
            let s = alpha()?.map_or(1.0, |a| a / r as f64);
            let d = a1.matmul(&b1)?.mul(&a2.matmul(&b2)?)?;
            if d.dims() != [out, in_dim] {
                return Err(self.bad(
                    &name("hada_w1_a"),
                    &a1,
                    &format!("a product of ({out}, {in_dim})"),
                ));
            }
            return d.affine(s, 0.0).map(Some);
        }
        let factor = |w: &str| -> Result<Option<(Tensor, Option<usize>)>> {
            if let Some(t) = self.take(&name(w), device)? {
                return Ok(Some((self.flat(&name(w), t)?, None)));
            }
            match (
                self.take(&name(&format!("{w}_a")), device)?,
                self.take(&name(&format!("{w}_b")), device)?,
            ) {
                (Some(a), Some(b)) => {
                    let b = self.flat(&name(&format!("{w}_b")), b)?;
                    let r = self.matrix(&name(&format!("{w}_b")), &b)?.0;
                    Ok(Some((a.matmul(&b)?, Some(r))))
                }
                (None, None) => Ok(None),
                _ => Err(err(&self.path, Some(&name(w)), "half of a low-rank factor")),
            }
        };
        let Some((w1, r1)) = factor("lokr_w1")? else {
            return Ok(None);
        };
        let (w2, r2) = factor("lokr_w2")?.ok_or_else(|| {
            err(
                &self.path,
                Some(&name("lokr_w2")),
                "missing (a LoKr needs it)",
            )
        })?;
        let ((l, m), (kk, n)) = (
            self.matrix(&name("lokr_w1"), &w1)?,
            self.matrix(&name("lokr_w2"), &w2)?,
        );
        if l * kk != out || m * n != in_dim {
            return Err(self.bad(
                &name("lokr_w2"),
                &w2,
                &format!("factors of ({out}, {in_dim}) with lokr_w1 {:?}", w1.dims()),
            ));
        }
        // ComfyUI: alpha / r where a factor is low-rank (r of w2 first), else 1.
        let s = match (alpha()?, r2.or(r1)) {
            (Some(a), Some(r)) => a / r as f64,
            _ => 1.0,
        };
        w1.reshape((l, 1, m, 1))?
            .mul(&w2.reshape((1, kk, 1, n))?)?
            .reshape((out, in_dim))?
            .affine(s, 0.0)
            .map(Some)
    }

    /// `delta`, with the kohya / LyCORIS kinds too (DoRA needs the weight `w` (out, in) it
    /// rescales): the update at strength to add to `w`.
    pub fn delta_for(&self, key: &str, w: &Tensor, device: &Device) -> Result<Option<Tensor>> {
        let dims = w.dims().to_vec();
        // A convolution's update is made as the matrix (out, in · kh · kw), then shaped.
        let (out, in_dim) = match *dims.as_slice() {
            [o, i] => (o, i),
            [o, i, kh, kw] => (o, i * kh * kw),
            _ => return Ok(None),
        };
        let Some(path) = key.strip_suffix(".weight") else {
            return Ok(None);
        };
        let shaped = |d: Option<Tensor>| d.map(|d| d.reshape(dims.clone())).transpose();
        let k = kohya_name(path);
        if let Some(d) = self.lycoris(&k, &dims, device)? {
            return shaped(Some(d.affine(self.strength, 0.0)?));
        }
        if let Some(d) = self.peft_lycoris(key, &dims, device)? {
            return shaped(Some(d.affine(self.strength, 0.0)?));
        }
        // PEFT's DoRA: lora_A / lora_B and the magnitudes.
        if let Some(m) = self.peft_magnitude(key, out, device)? {
            let Some(lora) = self.delta_at(key, out, in_dim, device, 1.0)? else {
                return Err(err(
                    &self.path,
                    None,
                    format!("{key}: DoRA magnitudes without lora_A/lora_B"),
                ));
            };
            let w = w.to_dtype(DType::F32)?.reshape((out, in_dim))?;
            let d = self.dora("lora_magnitude_vector", &w, &lora, &m)?;
            return shaped(Some(d.affine(self.strength, 0.0)?));
        }
        let dora = format!("{k}.dora_scale");
        if !self.file.contains(&dora) {
            return shaped(self.delta(key, out, in_dim, device)?);
        }
        // DoRA: the LoRA's update at strength 1, then W' = m (W + ΔW) / ‖W + ΔW‖ over the
        // axis `dora_scale` names; the update is strength · (W' - W), as ComfyUI applies it.
        let Some(lora) = self.delta_at(key, out, in_dim, device, 1.0)? else {
            return Err(err(
                &self.path,
                Some(&dora),
                "a DoRA scale without lora_down/lora_up",
            ));
        };
        let m = self
            .take(&dora, device)?
            .ok_or_else(|| err(&self.path, Some(&dora), "unreadable"))?;
        // Per output row ((out, 1), a convolution's (out, 1, 1, 1)), or per input column of
        // a Linear ((1, in)).
        let w = w.to_dtype(DType::F32)?.reshape((out, in_dim))?;
        let d = self.dora(&dora, &w, &lora, &m)?;
        shaped(Some(d.affine(self.strength, 0.0)?))
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
        self.delta_at(key, out, in_dim, device, self.strength)
    }

    fn delta_at(
        &self,
        key: &str,
        out: usize,
        in_dim: usize,
        device: &Device,
        strength: f64,
    ) -> Result<Option<Tensor>> {
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
            return self.update(&p, out, in_dim, device, strength).map(Some);
        }
        // The diffusers layout: one pair per diffusers part of the layer.
        let parts = self.parts(key, out)?;
        let mut pieces = vec![];
        let mut any = false;
        for (module, rows, swapped) in &parts {
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
                    let u = self.update(&pair, *rows, in_dim, device, strength)?;
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

    /// The diffusers parts of the layer at model key `key` with `out` rows, by the map of
    /// [`set_diffusers_map`](Self::set_diffusers_map) (without one, the key is its own):
    /// (module name, rows, halves swapped).
    fn parts(&self, key: &str, out: usize) -> Result<Vec<(String, usize, bool)>> {
        let map = self
            .diffusers
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?
            .clone();
        let module = |k: &str| k.strip_suffix(".weight").unwrap_or(k).to_string();
        Ok(match map.and_then(|m| m(key)) {
            Some(KeySource::Key(k)) => vec![(module(&k), out, false)],
            Some(KeySource::SwapHalves(k)) => vec![(module(&k), out, true)],
            Some(KeySource::Cat(ps)) => ps.iter().map(|(k, r)| (module(k), *r, false)).collect(),
            None => vec![(module(key), out, false)],
        })
    }

    /// The PEFT layout's DoRA magnitudes of the layer at `key` (`<prefix>.<module>.
    /// lora_magnitude_vector` of each diffusers part, in the layer's row order) as (out,
    /// 1), or `None` when the file has none for it.
    fn peft_magnitude(&self, key: &str, out: usize, device: &Device) -> Result<Option<Tensor>> {
        let mut pieces = vec![];
        for (module, rows, swapped) in self.parts(key, out)? {
            let name = self
                .prefixes
                .iter()
                .map(|p| format!("{p}.{module}.lora_magnitude_vector"))
                .find(|n| self.file.contains(n));
            let Some(name) = name else {
                if pieces.is_empty() {
                    continue;
                }
                return Err(err(
                    &self.path,
                    None,
                    format!("{module}: a DoRA part without its lora_magnitude_vector"),
                ));
            };
            let m = self
                .take(&name, device)?
                .ok_or_else(|| err(&self.path, Some(&name), "unreadable"))?;
            if m.elem_count() != rows {
                return Err(self.bad(&name, &m, &format!("{rows} magnitudes")));
            }
            let m = m.reshape((rows, 1))?;
            pieces.push(if swapped {
                let h = rows / 2;
                Tensor::cat(&[&m.narrow(0, h, h)?, &m.narrow(0, 0, h)?], 0)?
            } else {
                m
            });
        }
        if pieces.is_empty() {
            return Ok(None);
        }
        if pieces.iter().map(|p| p.dims()[0]).sum::<usize>() != out {
            return Err(err(
                &self.path,
                None,
                format!("{key}: DoRA magnitudes for some of its parts only"),
            ));
        }
        Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0).map(Some)
    }

    /// The PEFT layout's LoKr and LoHa on a whole layer at `key` (`<prefix>.<module>.lokr_*`,
    /// `.hada_*`): s · ΔW as the matrix (out, in · kh · kw), s PEFT's scale of the module
    /// from the `adapter_config.json` beside the file, else 1 (FLAME's own files fold s into
    /// the tensors).
    fn peft_lycoris(&self, key: &str, dims: &[usize], device: &Device) -> Result<Option<Tensor>> {
        let out = dims.first().copied().unwrap_or(0);
        let parts = self.parts(key, out)?;
        let [(module, _, false)] = parts.as_slice() else {
            return Ok(None);
        };
        for p in &self.prefixes {
            let name = format!("{p}.{module}");
            let kinds = ["lokr_w1", "lokr_w1_a", "hada_w1_a"];
            if kinds
                .iter()
                .any(|t| self.file.contains(&format!("{name}.{t}")))
            {
                let scale = self.peft.as_ref().map_or(1.0, |c| c.of(module));
                return self
                    .lycoris(&name, dims, device)?
                    .map(|d| d.affine(scale, 0.0))
                    .transpose();
            }
        }
        Ok(None)
    }

    /// W' - W of a DoRA: W' = m (W + ΔW) / ‖W + ΔW‖, the norm per output row (`m` (out, 1),
    /// or a convolution's (out, 1, 1, 1)) or, for a Linear's (1, in), per input column; `w`
    /// and `lora` (out, in · kh · kw). `name` names `m` in an error.
    fn dora(&self, name: &str, w: &Tensor, lora: &Tensor, m: &Tensor) -> Result<Tensor> {
        let (out, in_dim) = (w.dims()[0], w.dims()[1]);
        let v = w.add(lora)?;
        let per_row = m.dims().first() == Some(&out) && m.elem_count() == out;
        let norm = match m.dims() {
            _ if per_row => v.sqr()?.sum_keepdim(&[1])?.sqrt()?,
            [1, i] if *i == in_dim => v.sqr()?.sum_keepdim(&[0])?.sqrt()?,
            _ => return Err(self.bad(name, m, &format!("({out}, 1) or (1, {in_dim})"))),
        };
        let m = if per_row {
            m.reshape((out, 1))?
        } else {
            m.clone()
        };
        v.mul(&m.div(&norm)?)?.sub(w)
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
                     lora_down/lora_up, dora_scale, lokr_*, hada_*, diff; diffusers/PEFT \
                     lora_A/lora_B)",
                    left.len(),
                    self.file.names().count()
                ),
            )),
        }
    }
}
