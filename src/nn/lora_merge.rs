//! Adapter files made anywhere, merged into a model's weights as it loads: W + strength · ΔW
//! for every layer the file adapts (inference: sampling with a trained adapter costs nothing
//! extra).
//!
//! This file knows the layouts, which names a layer's tensors take; each adapter kind knows
//! its change (`Kind::merge` in `nn::adapter`, the same definition as its
//! `Adapter::delta_weight`), and the first kind that finds its tensors under a name takes
//! them. The names, tried in turn for each weight:
//! - kohya / LyCORIS / ComfyUI: `lora_unet_<layer path, dots as underscores>.<tensor>`
//!   (`lora_down`/`lora_up`/`alpha`, `dora_scale`, `lokr_*`, `hada_*`, `diff`), scaled as
//!   ComfyUI reads them;
//! - PEFT names on the original keys (ai-toolkit, ComfyUI): `diffusion_model.<layer
//!   path>.<tensor>`, or the same without the prefix;
//! - diffusers / PEFT: `<prefix>.<diffusers module>.<tensor>` (`lora_A`/`lora_B`,
//!   `lora_magnitude_vector`, `lokr_*`, `hada_*`), `<prefix>` the family's pipeline folder
//!   (`transformer`, `unet`); fused layers (Flux's qkv, linear1) take each diffusers part's
//!   rows, halves swapped where diffusers swaps them. Where the file stores no alpha, PEFT's
//!   scale of the module from the `adapter_config.json` beside the file (its `rank_pattern`,
//!   `alpha_pattern` and `use_rslora` too), else 1 (diffusers' alpha = r).
//!
//! - LyCORIS's names of the diffusers parts of a fused layer (what FLAME's kohya files hold
//!   with `adapter.per_projection`, and SimpleTuner's): `lycoris_<diffusers module, dots as
//!   underscores>.<tensor>`, each part's change on its rows as in the diffusers layout, scaled
//!   as the kohya names are; and kohya's names of the diffusers parts (musubi-tuner's Z-Image
//!   files: `lora_unet_layers_0_attention_to_q`, `..._to_out_0`), likewise.
//! - ai-toolkit's: PEFT names under `diffusion_model.` and diffusers' modules (its Z-Image
//!   files, `diffusion_model.layers.0.attention.to_q.lora_A.weight`), as the diffusers layout
//!   with that prefix; its FLUX.2 files use BFL's names under `diffusion_model.`, the PEFT
//!   names on the original keys above.
//!
//! Convolutions in each: a factor's kernel joins its columns, the change made as the matrix
//! (out, in · kh · kw) and shaped as the weight.
//!
//! LyCORIS's Tucker forms (`lora_mid`, `hada_t1`/`hada_t2`, `lokr_t2`), its DoRA magnitudes on
//! LoKr and LoHa, and full fine-tuning's bias changes (`diff_b`) merge too.
//!
//! Every tensor of the file must be taken by some layer: a file for another model, or an
//! adapter form FLAME does not merge (LyCORIS's other algorithms), is an error naming a
//! tensor left over.

use super::adapter::{
    kohya_name_in, lycoris_name, rows_in_place, MergeLayer, PeftScales, KINDS, KOHYA_MODEL,
    MERGE_CHUNK_VALUES,
};
use super::keys::{KeyMap, KeySource};
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Error, Result, Tensor};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A LoRA file to merge into the weights a [`super::VarBuilder`] loads.
pub struct LoraMerge {
    path: PathBuf,
    file: SafeTensorsFile,
    /// The strength multiplying every update.
    pub strength: f64,
    /// Key prefixes of the diffusers layout (`transformer`, `unet`; ai-toolkit's
    /// `diffusion_model`).
    prefixes: Vec<String>,
    /// The model's diffusers key map (model key -> diffusers keys), set by the loader.
    diffusers: Mutex<Option<KeyMap>>,
    used: Mutex<BTreeSet<String>>,
    /// PEFT's scales from the `adapter_config.json` beside the file, if there is one.
    peft: Option<PeftScales>,
    /// The kohya prefix of the network merged (`lora_unet`, or a text encoder's `lora_te1`,
    /// ...).
    kohya: String,
    /// Whether it merges into a text encoder: only the kohya names under its prefix and the
    /// PEFT layout under its folder are read (not the diffusion model's other names).
    text: bool,
}

/// Whether a tensor name of an adapter file belongs to a text encoder: kohya's `lora_te*`
/// (`lora_te1_`, `lora_te3_`, `lora_te_`), the PEFT layout's `text_encoder*` (`text_encoder.`,
/// `text_encoder_2.`, ...), which the diffusion model's merge leaves to the encoders'.
pub fn is_text_encoder_name(name: &str) -> bool {
    name.starts_with("lora_te") || name.starts_with("text_encoder")
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
            // The family's pipeline folder, and ai-toolkit's prefix of diffusers' modules.
            prefixes: vec![
                diffusers_prefix.to_string(),
                super::adapter::AI_TOOLKIT_PREFIX.to_string(),
            ],
            diffusers: Mutex::new(None),
            used: Mutex::new(BTreeSet::new()),
            peft,
            kohya: KOHYA_MODEL.to_string(),
            text: false,
        })
    }

    /// Opens the adapter file at `path` to merge at `strength` into a text encoder whose
    /// adapters are named `kohya` in kohya's layout (`lora_te1`, `lora_te3`, ...) and sit
    /// under `peft` in the PEFT layout (`text_encoder`, `text_encoder_2`, ...); the map of
    /// [`set_diffusers_map`](Self::set_diffusers_map) then gives the encoder's module names
    /// in that layout.
    pub fn for_text_encoder(
        path: impl AsRef<Path>,
        strength: f64,
        kohya: &str,
        peft: &str,
    ) -> Result<Self> {
        let mut m = Self::open(path, strength, peft)?;
        m.prefixes = vec![peft.to_string()];
        m.kohya = kohya.to_string();
        m.text = true;
        Ok(m)
    }

    /// The file this merges.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's tensors merged so far.
    pub fn used(&self) -> Result<BTreeSet<String>> {
        Ok(self
            .used
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?
            .clone())
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

    /// The change the file's tensors under `name` stand for, by the first kind that finds
    /// its tensors there (`KINDS`; `Kind::merge_bias` for a bias), at strength 1: the matrix
    /// (out, in · kh · kw), or the bias's shape.
    fn by_kind(
        &self,
        name: String,
        w: &Tensor,
        default_scale: f64,
        bias: bool,
    ) -> Result<Option<Tensor>> {
        let layer = MergeLayer::new(&self.file, &self.used, name, w, default_scale);
        for kind in KINDS {
            let merge = if bias { kind.merge_bias } else { kind.merge };
            if let Some(d) = merge(&layer)? {
                return Ok(Some(d));
            }
        }
        Ok(None)
    }

    /// PEFT's scale of `module` from the `adapter_config.json` beside the file, else 1
    /// (diffusers' alpha = r): what scales a change whose alpha the file does not store.
    fn peft_scale(&self, module: &str) -> f64 {
        self.peft.as_ref().map_or(1.0, |p| p.of(module))
    }

    /// The update at strength to add to the tensor `w` at model key `key` when the file
    /// changes it, f32, on `w`'s device: a weight (out, in) or (out, in, kh, kw) of a layer
    /// the file adapts, every kind computing its change as it does for its own adapters
    /// (`Kind::merge`), or a bias (`<layer>.bias`) the file changes (`Kind::merge_bias`: full
    /// fine-tuning's `diff_b`). The file's names are tried in turn: kohya's (`lora_unet_…`),
    /// PEFT names on the original keys (with or without `diffusion_model.`), then, for
    /// weights, one set of tensors per diffusers part of the layer under LyCORIS's or kohya's
    /// name of the part (`lycoris_…`, `lora_unet_…`) or in the diffusers layout (under the
    /// family's prefix or ai-toolkit's `diffusion_model`),
    /// read through the map of [`set_diffusers_map`](Self::set_diffusers_map) (without one,
    /// model keys are taken as diffusers keys). A part the file leaves out is left unchanged.
    pub fn delta_for(&self, key: &str, w: &Tensor) -> Result<Option<Tensor>> {
        let dims = w.dims().to_vec();
        let out = dims.first().copied().unwrap_or(0);
        let cols = dims.iter().skip(1).product::<usize>();
        let mut pieces: Vec<(usize, Tensor)> = vec![];
        if !self.each_change(key, w, |start, d| {
            pieces.push((start, d));
            Ok(())
        })? {
            return Ok(None);
        }
        // The rows no part of the file changes, as zeros.
        let mut whole = vec![];
        let mut at = 0;
        for (start, d) in pieces {
            if start > at {
                whole.push(Tensor::zeros((start - at, cols), DType::F32, w.device())?);
            }
            at = start + d.dims().first().copied().unwrap_or(0);
            whole.push(d);
        }
        if dims.len() > 1 && at < out {
            whole.push(Tensor::zeros((out - at, cols), DType::F32, w.device())?);
        }
        let d = match whole.len() {
            1 => whole.remove(0),
            _ => Tensor::cat(&whole.iter().collect::<Vec<_>>(), 0)?,
        };
        d.affine(self.strength, 0.0)?.reshape(dims).map(Some)
    }

    /// Device bytes the merge takes beside the weights at its heaviest, from the file's
    /// shapes ([`merge_into`](Self::merge_into)): the largest change one set of the file's
    /// tensors stands for, in f32, as many times as its kind holds such a matrix at once (a
    /// LoRA's product one, scaled in place; a Tucker LoCon's two, LoKr's three, LoHa's four,
    /// a full change's two; magnitudes (DoRA) four more), and the rows added a few at a
    /// time. What a plan for the merged model leaves free while it loads. (A diffusers part
    /// whose halves are swapped holds its change twice: Flux's and SD3's final modulation,
    /// smaller than their blocks' largest change.)
    pub fn merge_bytes(&self) -> u64 {
        let shape = |n: &str| self.file.info(n).map(|i| i.shape.clone());
        let rows = |s: &[usize]| s.first().copied().unwrap_or(0) as u64;
        let cols = |s: &[usize]| s.iter().skip(1).product::<usize>() as u64;
        // A Tucker core's kernel (r, r, kh, kw).
        let kernel = |s: &[usize]| s.iter().skip(2).product::<usize>() as u64;
        // The change's (rows, cols) from a pair of factors `a` (rows, r) and `b` (r, cols…),
        // or in LyCORIS's Tucker form, with the core `t` (r, r, kh, kw), `a` (r, rows) and
        // `b` (r, in): cols = in · kh · kw (`adapter::tucker`).
        let pair = |a: &str, b: &str, t: &str| -> (u64, u64) {
            let (sa, sb) = (shape(a).unwrap_or_default(), shape(b).unwrap_or_default());
            match shape(t) {
                Some(core) => (cols(&sa), cols(&sb) * kernel(&core)),
                None => (rows(&sa), cols(&sb)),
            }
        };
        let mut largest = 0u64;
        for name in self.file.names() {
            // Each branch: the layer's name in the file, the change's values, the matrices of
            // its size the kind holds at once.
            let (layer, values, copies) = if let Some(b) = [".lora_up.weight", ".lora_B.weight"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
            {
                // Scaled in place (one matrix); LyCORIS's Tucker LoCon (a `lora_mid` between
                // a 1x1 down and up) rebuilds, then scales (two).
                let down = [".lora_down.weight", ".lora_A.weight"]
                    .iter()
                    .find_map(|s| shape(&format!("{b}{s}")))
                    .unwrap_or_default();
                let out = shape(name).map_or(0, |s| rows(&s));
                match shape(&format!("{b}.lora_mid.weight")) {
                    Some(mid) => (b, out * cols(&down) * kernel(&mid), 2),
                    None => (b, out * cols(&down), 1),
                }
            } else if let Some(b) = name.strip_suffix(".hada_w1_a") {
                // Two products, their elementwise product and its scaled copy.
                let (o, c) = pair(name, &format!("{b}.hada_w1_b"), &format!("{b}.hada_t1"));
                (b, o * c, 4)
            } else if let Some(b) = name
                .strip_suffix(".lokr_w1")
                .or_else(|| name.strip_suffix(".lokr_w1_a"))
            {
                // kron(w1, w2): w1 (a, b) or w1_a (a, r) w1_b (r, b); w2 (c, d…), w2_a w2_b,
                // or the Tucker form's w2_a w2_b around lokr_t2. The product, its scaled
                // copy and a reshape's.
                let whole = |w: &str| -> (u64, u64) {
                    match shape(&format!("{b}.{w}")) {
                        Some(s) => (rows(&s), cols(&s)),
                        None => pair(
                            &format!("{b}.{w}_a"),
                            &format!("{b}.{w}_b"),
                            &format!("{b}.lokr_t2"),
                        ),
                    }
                };
                let ((a, bc), (c, d)) = (whole("lokr_w1"), whole("lokr_w2"));
                (b, a * c * bc * d, 3)
            } else if let Some(b) = name.strip_suffix(".diff") {
                (
                    b,
                    shape(name).map_or(0, |s| s.iter().product::<usize>() as u64),
                    2,
                )
            } else {
                continue;
            };
            // DoRA's and LyCORIS's magnitudes: the weight in f32, W + ΔW, its norm's operands
            // and the result beside the change.
            let magnitudes = ["dora_scale", "lora_magnitude_vector"]
                .iter()
                .any(|t| self.file.info(&format!("{layer}.{t}")).is_some());
            largest = largest.max(values * 4 * (copies + 4 * magnitudes as u64));
        }
        // The rows being added: the weight's rows in f32, the change's scaled, their sum and
        // the sum in the weight's dtype.
        largest + 4 * 4 * MERGE_CHUNK_VALUES as u64
    }

    /// Adds the file's change of the tensor `w` at model key `key` (as [`delta_for`]
    /// defines it) into `w` itself, in its storage: false where the file does not change it.
    /// The change of each part is made at once (the file's factors' product, f32), then added
    /// a few rows at a time, so the merge takes no more device memory than one part's change
    /// and a few megabytes, and allocates nothing that outlives it: a model merged as it
    /// loads is laid out as one loaded without a merge (no pieces of freed copies between
    /// its weights). `w` must own its storage alone (`Tensor::assign` writes every view).
    ///
    /// [`delta_for`]: Self::delta_for
    pub fn merge_into(&self, key: &str, w: &Tensor) -> Result<bool> {
        let dims = w.dims().to_vec();
        let strength = self.strength;
        self.each_change(key, w, |start, d| {
            let rows = d.dims().first().copied().unwrap_or(1);
            // A weight seen as the matrix (out, in · kh · kw); a bias's elements are its rows.
            let flat = match dims.len() {
                1 => w.clone(),
                _ => w.reshape((dims[0], d.elem_count() / rows.max(1)))?,
            };
            rows_in_place(&flat.narrow(0, start, rows)?, |r, dst| {
                let add = d
                    .narrow(0, r, dst.dims()[0])?
                    .reshape(dst.dims())?
                    .affine(strength, 0.0)?;
                dst.to_dtype(DType::F32)?.add(&add)?.to_dtype(w.dtype())
            })
        })
    }

    /// Calls `f(first row, change)` for each part of `w` (model key `key`) the file changes,
    /// in row order, the change at strength 1 (f32: a weight's part as the matrix (rows,
    /// in · kh · kw), a bias as its shape), one part's change alive at a time: the whole
    /// layer's under one of its names, else each diffusers part's (`delta_for`'s names).
    /// False where no part is changed.
    fn each_change(
        &self,
        key: &str,
        w: &Tensor,
        mut f: impl FnMut(usize, Tensor) -> Result<()>,
    ) -> Result<bool> {
        let dims = w.dims().to_vec();
        let (path, bias) = match (key.strip_suffix(".weight"), key.strip_suffix(".bias")) {
            (Some(p), _) if matches!(dims.len(), 2 | 4) => (p, false),
            (_, Some(p)) if dims.len() == 1 => (p, true),
            _ => return Ok(false),
        };
        let mut whole = vec![(kohya_name_in(&self.kohya, path), 1.0)];
        if !self.text {
            whole.extend([
                (
                    format!("diffusion_model.{path}"),
                    self.peft_scale(&format!("diffusion_model.{path}")),
                ),
                (path.to_string(), self.peft_scale(path)),
            ]);
        }
        for (name, scale) in whole {
            if let Some(d) = self.by_kind(name, w, scale, bias)? {
                f(0, d)?;
                return Ok(true);
            }
        }
        if bias {
            return Ok(false);
        }
        let out = dims[0];
        // Halves swapped between FLAME's rows and diffusers' (an even count of rows).
        let swap = |t: Tensor| -> Result<Tensor> {
            let h = t.dims()[0] / 2;
            Tensor::cat(&[&t.narrow(0, h, h)?, &t.narrow(0, 0, h)?], 0)
        };
        let (mut start, mut any) = (0, false);
        for (module, rows, swapped) in self.parts(key, out)? {
            if start + rows > out {
                return Err(err(
                    &self.path,
                    None,
                    format!("{key}: its diffusers parts hold more than its {out} rows"),
                ));
            }
            let part = w.narrow(0, start, rows)?;
            let part = if swapped { swap(part)? } else { part };
            // LyCORIS's and kohya's names of the part (their alpha in the file), then the
            // diffusers layout's.
            let lycoris = (!self.text).then(|| (lycoris_name(&module), 1.0));
            let names = lycoris
                .into_iter()
                .chain([(kohya_name_in(&self.kohya, &module), 1.0)])
                .chain(self.prefixes.iter().map(|p| {
                    let name = format!("{p}.{module}");
                    let scale = self.peft_scale(&name);
                    (name, scale)
                }));
            let mut found = None;
            for (name, scale) in names {
                if let Some(d) = self.by_kind(name, &part, scale, false)? {
                    found = Some(d);
                    break;
                }
            }
            drop(part);
            if let Some(d) = found {
                any = true;
                f(start, if swapped { swap(d)? } else { d })?;
            }
            start += rows;
        }
        Ok(any)
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

    /// The file's text-encoder tensors ([`is_text_encoder_name`]), which the diffusion
    /// model's merge leaves to the encoders' ([`for_text_encoder`](Self::for_text_encoder)).
    pub fn text_encoder_tensors(&self) -> Vec<String> {
        self.file
            .names()
            .filter(|n| is_text_encoder_name(n))
            .map(str::to_string)
            .collect()
    }

    /// An error naming a tensor of the file no layer took (another model's file, or an
    /// adapter kind FLAME does not merge); `Ok` when every tensor but the text encoders'
    /// ([`text_encoder_tensors`](Self::text_encoder_tensors)) was merged. A text encoder's
    /// merge leaves the tensors of the other encoders and of the model alike: the caller
    /// checks the union of the merges' [`used`](Self::used) sets.
    pub fn check_all_used(&self) -> Result<()> {
        let used = self
            .used
            .lock()
            .map_err(|_| Error::Poisoned("LoRA merge"))?;
        let left: Vec<&str> = self
            .file
            .names()
            .filter(|n| !used.contains(*n) && !is_text_encoder_name(n))
            .collect();
        match left.first() {
            None => Ok(()),
            Some(k) => Err(err(
                &self.path,
                Some(k),
                format!(
                    "no layer of the model takes it ({} of {} tensors left over): a LoRA for \
                     another model, or a layout or adapter kind FLAME does not merge (kohya \
                     lora_down/lora_up/lora_mid, dora_scale, lokr_*, hada_*, diff, diff_b; \
                     diffusers/PEFT lora_A/lora_B, lora_magnitude_vector, lokr_*, hada_*)",
                    left.len(),
                    self.file.names().count()
                ),
            )),
        }
    }
}
