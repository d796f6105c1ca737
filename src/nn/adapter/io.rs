//! Adapter files: the kohya / LyCORIS layout that ComfyUI loads
//! (`lora_unet_<layer path, dots as underscores>.<tensor>`: `lora_down.weight`,
//! `lokr_w1`, `hada_w1_a`, `dora_scale`, `diff`, `alpha`, ...) and the diffusers / PEFT
//! layout (`<prefix>.<diffusers module>.<PEFT tensor>`: `lora_A.weight`,
//! `lora_magnitude_vector`, `lokr_w1`, `hada_w1_a`, ...), which diffusers' `load_lora_weights`
//! / `load_lora_adapter` and PEFT load; and the kohya layout written for ComfyUI's reading
//! (`Adapters::save_comfyui`, metadata `flame_layout = "comfyui"`), where a kind's tensors
//! mean something else to ComfyUI (DoRA). Each kind names its own tensors
//! (`Adapter::to_kohya`, `to_comfyui`, `to_peft`); this file owns the files: atomic writes,
//! the shape checks, and that every tensor of a file finds its adapter.

use super::{Adapters, BaseLayer, PeftPart};
use crate::nn::keys::{KeyMap, KeySource};
use crate::safetensors::{save_with_hashes, save_with_metadata, SafeTensorsFile};
use crate::{DType, Device, Error, Result, Setting, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The metadata key a kohya-layout file written for ComfyUI's reading carries
/// (`Adapters::save_comfyui`), with the value `COMFYUI_LAYOUT`.
pub const LAYOUT_KEY: &str = "flame_layout";

/// `LAYOUT_KEY`'s value in a file written for ComfyUI's reading.
pub const COMFYUI_LAYOUT: &str = "comfyui";

/// The frozen weight of the layer at a path (any device, any float dtype).
pub type WeightOf<'a> = dyn Fn(&str) -> Result<Tensor> + 'a;

/// The name of PEFT's config of a PEFT-layout file, in the file's folder
/// (`PeftModel.from_pretrained` reads `adapter_config.json` beside `adapter_model.safetensors`).
pub const PEFT_CONFIG: &str = "adapter_config.json";

/// kohya's prefix of the diffusion model's adapters (`lora_unet`, for every family).
pub const KOHYA_MODEL: &str = "lora_unet";

/// kohya's name of the adapter on the diffusion model's layer at `path`.
pub fn kohya_name(path: &str) -> String {
    kohya_name_in(KOHYA_MODEL, path)
}

/// kohya's name of the adapter on the layer at `path` of the network whose names start with
/// `prefix` (`lora_unet`, or a text encoder's `lora_te1`, `lora_te2`, ...).
pub fn kohya_name_in(prefix: &str, path: &str) -> String {
    format!("{prefix}_{}", path.replace('.', "_"))
}

/// One set of adapters among those a file holds: the diffusion model's or a text encoder's,
/// with the names it takes in each layout.
#[derive(Clone)]
pub struct FileSet<'a> {
    /// The adapters.
    pub adapters: &'a Adapters,
    /// Its kohya prefix ([`KOHYA_MODEL`], `lora_te1`, ...).
    pub kohya: &'a str,
    /// Its module prefix in the PEFT layout (`unet`, `transformer`, `text_encoder`, ...).
    pub peft: &'a str,
    /// Its layers' key paths to the diffusers / transformers modules of the PEFT layout.
    pub map: &'a KeyMap,
}

pub(super) fn err(path: &Path, tensor: Option<&str>, msg: impl Into<String>) -> Error {
    Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

/// The tensors of one adapter in a kohya-layout file (names after `<layer name>.`), as the
/// kind asks for them; what it takes is crossed off the file's list.
pub struct Reader<'a> {
    file: &'a SafeTensorsFile,
    path: &'a Path,
    name: String,
    layer: &'a str,
    device: &'a Device,
    unused: &'a mut BTreeSet<String>,
}

impl Reader<'_> {
    /// Whether the file has tensor `t` for this adapter.
    pub fn has(&self, t: &str) -> bool {
        self.file.contains(&format!("{}.{t}", self.name))
    }

    /// The shape of tensor `t` of this adapter, if the file has it.
    pub fn shape(&self, t: &str) -> Option<Vec<usize>> {
        self.file
            .info(&format!("{}.{t}", self.name))
            .map(|i| i.shape.clone())
    }

    /// Tensor `t` as f32, which must have shape `dims`.
    pub fn take(&mut self, t: &str, dims: &[usize]) -> Result<Tensor> {
        let key = format!("{}.{t}", self.name);
        let info = self.file.info(&key).ok_or_else(|| {
            err(
                self.path,
                Some(&key),
                format!("missing (adapter of layer {})", self.layer),
            )
        })?;
        if info.shape.as_slice() != dims {
            return Err(err(
                self.path,
                Some(&key),
                format!("shape {:?}, the adapter has {dims:?}", info.shape),
            ));
        }
        self.unused.remove(&key);
        self.file.load_as(&key, self.device, DType::F32)
    }

    /// The adapter's `alpha` (a scalar), if the file has one.
    pub fn alpha(&mut self) -> Result<Option<f64>> {
        let key = format!("{}.alpha", self.name);
        if !self.file.contains(&key) {
            return Ok(None);
        }
        let a = self
            .file
            .load_as(&key, self.device, DType::F64)?
            .to_vec_f64()?;
        self.unused.remove(&key);
        match a.as_slice() {
            [a] if a.is_finite() => Ok(Some(*a)),
            _ => Err(err(
                self.path,
                Some(&key),
                format!("alpha {a:?} is not one number"),
            )),
        }
    }

    /// An error about tensor `t` of this adapter.
    pub fn error(&self, t: &str, msg: impl Into<String>) -> Error {
        err(self.path, Some(&format!("{}.{t}", self.name)), msg)
    }
}

/// A diffusers / PEFT-layout file being read into the adapters: its tensors by
/// `<prefix>.<module>.<PEFT name>`, what each adapter takes crossed off.
pub struct PeftFile {
    pub(super) file: SafeTensorsFile,
    pub(super) path: std::path::PathBuf,
    pub(super) prefix: String,
    pub(super) unused: BTreeSet<String>,
    /// The file names a module's tensors as PEFT does, or as kohya does (musubi-tuner's
    /// files: `tools.rs`).
    pub(super) naming: Naming,
}

/// How a file of one adapter per diffusers module names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Naming {
    /// `<prefix>.<module>.lora_A.weight`.
    Peft,
    /// `lora_unet_<module, dots as underscores>.lora_down.weight` (PEFT's `lora_A` is kohya's
    /// `lora_down`, `lora_B` its `lora_up`).
    Kohya,
}

impl PeftFile {
    /// Whether the file has `<module>.<t>`.
    pub fn has(&self, module: &str, t: &str) -> bool {
        self.file.contains(&self.key(module, t))
    }

    /// The shape of `<module>.<t>`, if the file has it.
    pub fn shape(&self, module: &str, t: &str) -> Option<Vec<usize>> {
        self.file
            .info(&self.key(module, t))
            .map(|i| i.shape.clone())
    }

    fn key(&self, module: &str, t: &str) -> String {
        if self.naming == Naming::Kohya {
            let t = match t {
                "lora_A.weight" => "lora_down.weight",
                "lora_B.weight" => "lora_up.weight",
                other => other,
            };
            return format!("{}.{t}", kohya_name(module));
        }
        if self.prefix.is_empty() {
            format!("{module}.{t}")
        } else {
            format!("{}.{module}.{t}", self.prefix)
        }
    }

    /// Tensor `<module>.<t>` as f32 on `device`, which must have shape `dims`.
    pub fn take(
        &mut self,
        module: &str,
        t: &str,
        dims: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        let key = self.key(module, t);
        let info = self
            .file
            .info(&key)
            .ok_or_else(|| err(&self.path, Some(&key), "missing"))?;
        if info.shape.as_slice() != dims {
            return Err(err(
                &self.path,
                Some(&key),
                format!("shape {:?}, the adapter needs {dims:?}", info.shape),
            ));
        }
        self.unused.remove(&key);
        self.file.load_as(&key, device, DType::F32)
    }

    /// An error about tensor `<module>.<t>`.
    pub fn error(&self, module: &str, t: &str, msg: impl Into<String>) -> Error {
        err(&self.path, Some(&self.key(module, t)), msg)
    }
}

/// Where one adapted layer's rows go in the diffusers layout.
pub(crate) fn peft_parts(map: &KeyMap, layer: &str, out: usize) -> Result<Vec<PeftPart>> {
    let key = format!("{layer}.weight");
    let module = |k: &str| k.strip_suffix(".weight").unwrap_or(k).to_string();
    let whole = |k: &str, swapped| PeftPart {
        module: module(k),
        start: 0,
        rows: out,
        swapped,
    };
    Ok(match map(&key) {
        Some(KeySource::Key(k)) => vec![whole(&k, false)],
        Some(KeySource::SwapHalves(k)) => vec![whole(&k, true)],
        Some(KeySource::Cat(parts)) => {
            let mut start = 0;
            let mut v = vec![];
            for (k, rows) in parts {
                v.push(PeftPart {
                    module: module(&k),
                    start,
                    rows,
                    swapped: false,
                });
                start += rows;
            }
            if start != out {
                return Err(Error::Param {
                    key: key.clone(),
                    file: None,
                    msg: format!("its diffusers parts have {start} rows, the layer {out}"),
                });
            }
            v
        }
        None => {
            return Err(Error::Param {
                key,
                file: None,
                msg: "the adapted layer has no diffusers counterpart".into(),
            })
        }
    })
}

/// The two halves of rows swapped (dim 0).
pub(crate) fn swap_halves(t: &Tensor) -> Result<Tensor> {
    let n = t.dims()[0] / 2;
    Tensor::cat(&[&t.narrow(0, n, n)?, &t.narrow(0, 0, n)?], 0)
}

/// `t`'s rows of diffusers part `p` (dim 0), halves swapped where diffusers swaps them.
pub(crate) fn part_rows(t: &Tensor, p: &PeftPart) -> Result<Tensor> {
    let rows = t.narrow(0, p.start, p.rows)?;
    if p.swapped {
        swap_halves(&rows)
    } else {
        Ok(rows)
    }
}

/// The rows of every part joined back into the layer's order (inverse of `part_rows`).
pub(crate) fn join_rows(parts: &[PeftPart], pieces: Vec<Tensor>) -> Result<Tensor> {
    let pieces = parts
        .iter()
        .zip(pieces)
        .map(|(p, t)| if p.swapped { swap_halves(&t) } else { Ok(t) })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&pieces.iter().collect::<Vec<_>>(), 0)
}

/// An error for kinds whose factors cannot be split by rows: a fused layer (or one whose
/// halves diffusers swaps) has no PEFT form.
pub(crate) fn single_part<'p>(
    kind: &str,
    layer: &str,
    parts: &'p [PeftPart],
) -> Result<&'p PeftPart> {
    match parts {
        [p] if !p.swapped => Ok(p),
        _ => Err(Error::Setting {
            setting: Setting::AdapterLayout,
            msg: format!(
                "a {kind} adapter on layer {layer} cannot be written in the diffusers / PEFT \
                 layout: diffusers splits that layer into {} modules ({}), and a {kind} \
                 factorisation does not split by rows; train one adapter per projection \
                 (adapter.per_projection = true, AdapterConfig::per_projection), write the \
                 kohya layout or leave the layer out of the targets",
                parts.len(),
                parts
                    .iter()
                    .map(|p| p.module.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// How PEFT scales each module of a file, from the `adapter_config.json` beside it (PEFT's
/// `save_pretrained` writes one): alpha / r, where `rank_pattern` and `alpha_pattern` give
/// the modules they match their own r and alpha, and `use_rslora` makes it alpha / √r
/// (PEFT's `LoraConfig`; LoKr's and LoHa's alpha is `alpha`). A pattern matches a module
/// name whole or a dot-separated suffix of it, as a regular expression, the first in the
/// file's order winning (PEFT's `get_pattern_key`: `(.*\.)?(pattern)$`). PEFT's default
/// alpha is 8. Without the file, every module's scale is 1 (diffusers' default alpha = r,
/// what FLAME's own PEFT files assume).
#[derive(Clone, Debug)]
pub(crate) struct PeftScales {
    r: f64,
    alpha: f64,
    rank_pattern: Vec<(regex::Regex, f64)>,
    alpha_pattern: Vec<(regex::Regex, f64)>,
    rslora: bool,
    /// LoKr's and LoHa's `use_effective_conv2d` (their Tucker form), where the file says.
    effective_conv2d: Option<bool>,
}

/// A JSON object's entries in the file's order (serde_json's maps sort their keys).
#[derive(Default)]
struct Ordered(Vec<(String, f64)>);

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of module patterns to numbers")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Ordered, A::Error> {
                let mut v = vec![];
                while let Some((k, x)) = m.next_entry::<String, f64>()? {
                    v.push((k, x));
                }
                Ok(Ordered(v))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(serde::Deserialize)]
struct PeftConfigFile {
    r: Option<f64>,
    lora_alpha: Option<f64>,
    alpha: Option<f64>,
    #[serde(default)]
    rank_pattern: Ordered,
    #[serde(default)]
    alpha_pattern: Ordered,
    #[serde(default)]
    use_rslora: bool,
    use_effective_conv2d: Option<bool>,
}

impl PeftScales {
    /// The scales of the PEFT file at `path` (`None`: no `adapter_config.json` beside it).
    pub(crate) fn beside(path: &Path) -> Result<Option<PeftScales>> {
        let Some(cfg) = path.parent().map(|d| d.join(PEFT_CONFIG)) else {
            return Ok(None);
        };
        if !cfg.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&cfg).map_err(|source| Error::Io {
            path: cfg.clone(),
            source,
        })?;
        let bad = |msg: String| Error::Config {
            path: Some(cfg.clone()),
            msg,
        };
        let c: PeftConfigFile =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a PEFT config: {e}")))?;
        let r =
            c.r.filter(|r| *r > 0.0)
                .ok_or_else(|| bad("no positive \"r\"".into()))?;
        let patterns = |name: &str, o: Ordered| -> Result<Vec<(regex::Regex, f64)>> {
            o.0.into_iter()
                .map(|(p, x)| {
                    let re = regex::Regex::new(&format!("^(?:.*\\.)?(?:{p})$"))
                        .map_err(|e| bad(format!("{name} key {p:?}: not a pattern ({e})")))?;
                    if !(x.is_finite() && (name == "alpha_pattern" || x > 0.0)) {
                        return Err(bad(format!("{name}[{p:?}] = {x}")));
                    }
                    Ok((re, x))
                })
                .collect()
        };
        Ok(Some(PeftScales {
            r,
            // LoRA's key is lora_alpha, LoKr's and LoHa's alpha; PEFT's default alpha is 8.
            alpha: c.lora_alpha.or(c.alpha).unwrap_or(8.0),
            rank_pattern: patterns("rank_pattern", c.rank_pattern)?,
            alpha_pattern: patterns("alpha_pattern", c.alpha_pattern)?,
            rslora: c.use_rslora,
            effective_conv2d: c.use_effective_conv2d,
        }))
    }

    /// The scale PEFT gives the adapter of `module` (its name in the model, any prefix).
    pub(crate) fn of(&self, module: &str) -> f64 {
        let find = |ps: &[(regex::Regex, f64)], default: f64| {
            ps.iter()
                .find(|(re, _)| re.is_match(module))
                .map_or(default, |(_, x)| *x)
        };
        let (r, alpha) = (
            find(&self.rank_pattern, self.r),
            find(&self.alpha_pattern, self.alpha),
        );
        match self.rslora {
            true => alpha / r.sqrt(),
            false => alpha / r,
        }
    }
}

impl Adapters {
    /// Writes every adapter to `path` in the kohya / LyCORIS layout (the kind's tensors in
    /// `dtype`, alpha in f32), atomically (a temporary file renamed into place). Metadata
    /// records the network module (`networks.lora`, or `lycoris.kohya` with the algorithm),
    /// rank, alpha and targets, as kohya and LyCORIS write them.
    pub fn save_kohya(&self, path: impl AsRef<Path>, dtype: DType) -> Result<()> {
        self.save_kohya_layout(path.as_ref(), dtype, None, None)
    }

    /// [`Adapters::save_kohya`] with `extra` metadata beside the adapters' own (which win
    /// where a key is in both) and kohya's `sshs_*` hashes of the file
    /// (`crate::safetensors::save_with_hashes`): how a training run saves.
    pub fn save_kohya_with(
        &self,
        path: impl AsRef<Path>,
        dtype: DType,
        extra: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.save_kohya_layout(path.as_ref(), dtype, None, Some(extra))
    }

    /// [`Adapters::save_comfyui`] with `extra` metadata and hashes, as
    /// [`Adapters::save_kohya_with`].
    pub fn save_comfyui_with(
        &self,
        path: impl AsRef<Path>,
        dtype: DType,
        weight: &WeightOf<'_>,
        extra: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.save_kohya_layout(path.as_ref(), dtype, Some(weight), Some(extra))
    }

    /// The metadata kohya and LyCORIS record of the network: `ss_network_module`
    /// (`networks.lora`, or `lycoris.kohya` with the algorithm in the args),
    /// `ss_network_dim`, `ss_network_alpha`, `ss_network_args` (strings by name, as kohya's
    /// scripts record them), and FLAME's kind and targets.
    pub fn network_metadata(&self) -> Result<BTreeMap<String, String>> {
        let c = &self.config;
        let mut meta = BTreeMap::from([
            ("ss_network_dim".to_string(), c.rank.to_string()),
            ("ss_network_alpha".to_string(), c.alpha.to_string()),
            ("flame_kind".to_string(), c.kind.clone()),
            ("flame_targets".to_string(), c.targets.join(",")),
        ]);
        let kind = super::kind(&c.kind)?;
        let mut args = vec![];
        if kind.plain_kohya && c.conv_rank == 0 {
            meta.insert("ss_network_module".into(), "networks.lora".into());
        } else {
            // LyCORIS's kohya wrapper records its algorithm in the network args.
            meta.insert("ss_network_module".into(), "lycoris.kohya".into());
            args.push(("algo", kind.lycoris_algo.to_string()));
            args.push(("conv_dim", c.conv_rank.to_string()));
            args.push(("conv_alpha", c.conv_alpha.to_string()));
            if c.tucker {
                args.push(("use_tucker", "True".to_string()));
            }
            if c.weight_decompose {
                // LyCORIS's kohya wrapper (lycoris/kohya.py `create_network`) reads the
                // decomposition from `dora_wd`, its axis from `wd_on_output` (default True).
                args.push(("dora_wd", "True".to_string()));
                if !c.wd_on_out {
                    args.push(("wd_on_output", "False".to_string()));
                }
            }
        }
        if c.module_dropout > 0.0 {
            args.push(("module_dropout", c.module_dropout.to_string()));
        }
        if c.rank_dropout > 0.0 {
            args.push(("rank_dropout", c.rank_dropout.to_string()));
        }
        if !self.blocks.is_empty() {
            // The per-block settings as written (`[[adapter.blocks]]`): kohya's `block_dims` /
            // `block_alphas` count the SD U-Net's 25 blocks by position and have no pattern
            // form, so they are FLAME's own key; readers take each layer's rank from its
            // tensors' shapes and its alpha from its own `.alpha`.
            let blocks = serde_json::to_string(&self.blocks).map_err(|e| Error::Config {
                path: None,
                msg: format!("adapter.blocks: {e}"),
            })?;
            meta.insert("flame_blocks".into(), blocks);
        }
        if !args.is_empty() {
            let body: Vec<String> = args
                .iter()
                .map(|(k, v)| format!("\"{k}\": \"{v}\""))
                .collect();
            meta.insert("ss_network_args".into(), format!("{{{}}}", body.join(", ")));
        }
        Ok(meta)
    }

    /// Writes every adapter in the kohya layout so that ComfyUI computes the changes FLAME's
    /// adapters make: the kohya file, except that the kinds ComfyUI reads differently from
    /// their definition write their tensors for ComfyUI's reading (`Adapter::to_comfyui`:
    /// DoRA's magnitudes, which ComfyUI divides by the norm of the frozen weight).
    /// `weight(path)` gives the frozen weight of the layer at `path` (any device, any float
    /// dtype). The file records `flame_layout = "comfyui"`; `load_comfyui` and the `sample`
    /// binary's merge read it back (DoRA's magnitudes to float32's rounding, through the same
    /// weights). ComfyUI computes the trained layer where its weight is the one given here
    /// and the file is the first change applied to it (not over an FP8 copy of the weight,
    /// nor stacked after another adapter on the same layer).
    pub fn save_comfyui(
        &self,
        path: impl AsRef<Path>,
        dtype: DType,
        weight: &WeightOf<'_>,
    ) -> Result<()> {
        self.save_kohya_layout(path.as_ref(), dtype, Some(weight), None)
    }

    /// The kohya layout, each adapter's tensors for ComfyUI's reading given the weights, or
    /// as kohya and LyCORIS read them.
    pub(super) fn save_kohya_layout(
        &self,
        path: &Path,
        dtype: DType,
        weight: Option<&WeightOf<'_>>,
        extra: Option<&BTreeMap<String, String>>,
    ) -> Result<()> {
        let tensors = self.kohya_tensors(KOHYA_MODEL, dtype, weight)?;
        let mut meta = extra.cloned().unwrap_or_default();
        meta.extend(self.network_metadata()?);
        if weight.is_some() {
            meta.insert(LAYOUT_KEY.into(), COMFYUI_LAYOUT.into());
        }
        let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
        match extra {
            Some(_) => save_with_hashes(named, &meta, path),
            None => save_with_metadata(named, &meta, path),
        }
    }

    /// Every adapter's tensors in the kohya layout under `prefix` (for ComfyUI's reading
    /// given the weights), the kind's tensors in `dtype`, alpha in f32.
    fn kohya_tensors(
        &self,
        prefix: &str,
        dtype: DType,
        weight: Option<&WeightOf<'_>>,
    ) -> Result<Vec<(String, Tensor)>> {
        let _g = crate::no_grad();
        let mut tensors: Vec<(String, Tensor)> = vec![];
        for (name, l) in self.kohya_adapters(prefix)? {
            let layer = match weight {
                Some(w) => {
                    let get = |dt: DType| w(l.path())?.to_dtype(dt);
                    l.to_comfyui(&BaseLayer::new(l.shape(), &get))?
                }
                None => l.to_kohya()?,
            };
            for (t, v) in layer {
                let v = if t == "alpha" { v } else { v.to_dtype(dtype)? };
                tensors.push((format!("{name}.{t}"), v));
            }
        }
        Ok(tensors)
    }

    /// Every adapter by its name in the kohya layout under `prefix`: `kohya_name_in(prefix,
    /// path)`, or each member of
    /// one adapted per projection under its own (`Adapter::kohya_members`).
    fn kohya_adapters(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, std::sync::Arc<dyn super::Adapter>)>> {
        let mut v = vec![];
        for l in self.layers()? {
            match l.kohya_members() {
                Some(members) => v.extend(members),
                None => v.push((kohya_name_in(prefix, l.path()), l)),
            }
        }
        Ok(v)
    }

    /// Reads a kohya / LyCORIS-layout file into the planned adapters (built with the model).
    /// Every planned adapter must be in the file with its kind's tensors and shapes, and the
    /// file may hold nothing else: a missing, misshapen or unexpected tensor (one of another
    /// kind included) is an error naming it.
    pub fn load_kohya(&self, path: impl AsRef<Path>) -> Result<()> {
        self.load_kohya_layout(path.as_ref(), None)
    }

    /// Reads a file `save_comfyui` wrote (it must say so in its metadata) into the planned
    /// adapters, as `load_kohya` does; `weight(path)` gives the frozen weight of the layer
    /// at `path`, which DoRA's magnitudes are read back through.
    pub fn load_comfyui(&self, path: impl AsRef<Path>, weight: &WeightOf) -> Result<()> {
        self.load_kohya_layout(path.as_ref(), Some(weight))
    }

    pub(super) fn load_kohya_layout(&self, path: &Path, weight: Option<&WeightOf>) -> Result<()> {
        let file = SafeTensorsFile::open(path)?;
        let layout = file.metadata().get(LAYOUT_KEY).map(String::as_str);
        match (weight.is_some(), layout) {
            (true, Some(COMFYUI_LAYOUT)) | (false, None) => {}
            (true, None) => {
                return Err(err(
                    path,
                    None,
                    format!(
                        "not written in the \"comfyui\" layout (its metadata has no \
                         {LAYOUT_KEY} = \"{COMFYUI_LAYOUT}\"): read it as \"kohya\""
                    ),
                ))
            }
            (true, Some(other)) => {
                return Err(err(
                    path,
                    None,
                    format!("written in a layout FLAME does not know ({LAYOUT_KEY} = {other:?})"),
                ))
            }
            (false, Some(other)) => {
                return Err(err(
                    path,
                    None,
                    format!("written in the {other:?} layout: read it as {other:?}"),
                ))
            }
        }
        let mut unused: BTreeSet<String> = file.names().map(str::to_string).collect();
        self.load_kohya_into(&file, path, KOHYA_MODEL, weight, &mut unused)?;
        if let Some(k) = unused.iter().next() {
            return Err(err(
                path,
                Some(k),
                format!(
                    "no planned adapter takes it ({} such tensors); the {} adapter targets are \
                     {:?}",
                    unused.len(),
                    self.config.kind,
                    self.config.targets
                ),
            ));
        }
        Ok(())
    }

    /// Reads this set's adapters, named under `prefix`, from a kohya-layout `file`; what
    /// they take is crossed off `unused`.
    fn load_kohya_into(
        &self,
        file: &SafeTensorsFile,
        path: &Path,
        prefix: &str,
        weight: Option<&WeightOf>,
        unused: &mut BTreeSet<String>,
    ) -> Result<()> {
        let _g = crate::no_grad();
        for (name, l) in self.kohya_adapters(prefix)? {
            let Some(device) = l.params().first().map(|(_, t)| t.device().clone()) else {
                continue;
            };
            let mut reader = Reader {
                file,
                path,
                name,
                layer: l.path(),
                device: &device,
                unused,
            };
            match weight {
                Some(w) => {
                    let get = |dt: DType| w(l.path())?.to_dtype(dt);
                    l.load_comfyui(&mut reader, &BaseLayer::new(l.shape(), &get))?
                }
                None => l.load_kohya(&mut reader)?,
            }
        }
        Ok(())
    }

    /// Writes every adapter in the diffusers / PEFT layout under diffusers module names,
    /// which `map` (the model's diffusers key map) gives: `<prefix>.<module>.<PEFT name>`.
    /// Each kind folds its scale into its tensors, so the file means the same under PEFT's
    /// alpha = r (diffusers' default when a file has no config). A fused layer (Flux's qkv
    /// and linear1, SD3's qkv) becomes one module per diffusers part where the kind splits by
    /// rows (LoRA and DoRA: A shared, B and the magnitude split), and an error otherwise.
    /// `prefix` is `transformer` (Flux, SD3) or `unet` (SDXL), as diffusers pipelines expect.
    pub fn save_peft(
        &self,
        path: impl AsRef<Path>,
        map: &KeyMap,
        prefix: &str,
        dtype: DType,
    ) -> Result<()> {
        self.save_peft_layout(path.as_ref(), map, prefix, dtype, None)
    }

    /// [`Adapters::save_peft`] with `extra` metadata, the network's keys as kohya records
    /// them ([`Adapters::network_metadata`]) and kohya's `sshs_*` hashes; the layout's own
    /// keys (`format`, ...) win where a key is in both.
    pub fn save_peft_with(
        &self,
        path: impl AsRef<Path>,
        map: &KeyMap,
        prefix: &str,
        dtype: DType,
        extra: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.save_peft_layout(path.as_ref(), map, prefix, dtype, Some(extra))
    }

    pub(super) fn save_peft_layout(
        &self,
        path: &Path,
        map: &KeyMap,
        prefix: &str,
        dtype: DType,
        extra: Option<&BTreeMap<String, String>>,
    ) -> Result<()> {
        let tensors = self.peft_tensors(map, prefix, dtype)?;
        let meta = BTreeMap::from([
            ("format".to_string(), "pt".to_string()),
            ("flame_kind".to_string(), self.config.kind.clone()),
            ("flame_rank".to_string(), self.config.rank.to_string()),
        ]);
        let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
        match extra {
            // The training metadata, the network's as kohya records it (the values it was
            // trained with: the file's tensors have the scale folded in), then this
            // layout's own keys.
            Some(extra) => {
                let mut all = extra.clone();
                all.extend(self.network_metadata()?);
                all.extend(meta);
                save_with_hashes(named, &all, path)
            }
            None => save_with_metadata(named, &meta, path),
        }
    }

    /// Every adapter's tensors in the PEFT layout, `<prefix>.<module>.<PEFT name>`, in
    /// `dtype`.
    pub(super) fn peft_tensors(
        &self,
        map: &KeyMap,
        prefix: &str,
        dtype: DType,
    ) -> Result<Vec<(String, Tensor)>> {
        let _g = crate::no_grad();
        let mut tensors: Vec<(String, Tensor)> = vec![];
        for l in self.layers()? {
            let parts = peft_parts(map, l.path(), l.shape().out_dim())?;
            for (name, t) in l.to_peft(&parts)? {
                tensors.push((format!("{prefix}.{name}"), t.to_dtype(dtype)?));
            }
        }
        Ok(tensors)
    }

    /// Checks that every planned adapter has a PEFT form under `map` (before training, so a
    /// run does not fail at its first save): a fused layer's parts, and LyCORIS's weight
    /// decomposition (`AdapterConfig::weight_decompose`), which has none, are asked of the
    /// adapter (`Adapter::check_peft`).
    pub fn check_peft(&self, map: &KeyMap) -> Result<()> {
        let _g = crate::no_grad();
        for l in self.layers()? {
            let parts = peft_parts(map, l.path(), l.shape().out_dim())?;
            if !self.kind()?.peft {
                return Err(Error::Setting {
                    setting: Setting::AdapterLayout,
                    msg: format!(
                        "the {:?} kind has no diffusers / PEFT layout; write the kohya layout",
                        self.config.kind
                    ),
                });
            }
            if parts.len() > 1 || parts.iter().any(|p| p.swapped) || self.config.weight_decompose {
                l.check_peft(&parts)?;
            }
        }
        Ok(())
    }

    /// PEFT's `adapter_config.json` for the file [`Adapters::save_peft`] writes under `map`:
    /// the kind's PEFT type, r and alpha (alpha = r: the file's tensors carry the scale),
    /// `rank_pattern` / `alpha_pattern` giving the convolutions their own rank (`conv_rank`),
    /// every diffusers module adapted as `target_modules`, and the kind's settings (LoKr's
    /// `decompose_both` and `decompose_factor`, LoKr's and LoHa's `use_effective_conv2d`,
    /// DoRA's `use_dora`). PEFT's `PeftModel.from_pretrained` builds from it the adapters
    /// whose tensors the file holds (peft 0.21's config classes and fields).
    pub fn peft_config(&self, map: &KeyMap) -> Result<serde_json::Value> {
        use serde_json::{json, Map, Value};
        let c = &self.config;
        let kind = self.kind()?;
        let layout = |msg: String| Error::Setting {
            setting: Setting::AdapterLayout,
            msg,
        };
        if !kind.peft {
            return Err(layout(format!(
                "the {:?} kind has no diffusers / PEFT layout",
                c.kind
            )));
        }
        let mut targets = BTreeSet::new();
        let (mut ranks, mut alphas) = (Map::new(), Map::new());
        for l in self.layers()? {
            let shape = l.shape();
            let rank = if shape.is_conv() { c.conv_rank } else { c.rank };
            for dim in [shape.out_dim(), shape.in_dim()] {
                if let Some((peft, own)) = c.peft_split_differs(dim) {
                    return Err(layout(format!(
                        "layer {}: PEFT splits {dim} by factor {} as {peft:?}, these LoKr \
                         adapters as {own:?}; build them with AdapterConfig::lokr_split = Peft",
                        l.path(),
                        c.factor,
                    )));
                }
            }
            for p in peft_parts(map, l.path(), shape.out_dim())? {
                if rank != c.rank {
                    // PEFT's patterns are regular expressions matched at a name's end.
                    let key = regex::escape(&p.module);
                    ranks.insert(key.clone(), json!(rank));
                    alphas.insert(key, json!(rank));
                }
                targets.insert(p.module);
            }
        }
        let mut v = Map::new();
        let (peft_type, alpha_key) = match c.kind.as_str() {
            "lokr" => ("LOKR", "alpha"),
            "loha" => ("LOHA", "alpha"),
            _ => ("LORA", "lora_alpha"),
        };
        v.insert("peft_type".into(), json!(peft_type));
        v.insert("r".into(), json!(c.rank));
        v.insert(alpha_key.into(), json!(c.rank));
        v.insert("rank_pattern".into(), Value::Object(ranks));
        v.insert("alpha_pattern".into(), Value::Object(alphas));
        v.insert("target_modules".into(), json!(targets));
        match c.kind.as_str() {
            "lokr" | "loha" => {
                v.insert("use_effective_conv2d".into(), json!(c.tucker));
                v.insert("rank_dropout".into(), json!(c.rank_dropout));
                v.insert("module_dropout".into(), json!(c.module_dropout));
                if c.kind == "lokr" {
                    v.insert("decompose_both".into(), json!(c.decompose_both));
                    v.insert("decompose_factor".into(), json!(c.factor));
                }
            }
            k => {
                v.insert("use_dora".into(), json!(k == "dora"));
                v.insert("lora_dropout".into(), json!(c.dropout));
            }
        }
        Ok(Value::Object(v))
    }

    /// Writes [`Adapters::peft_config`] to `path` (PEFT's `adapter_config.json`, beside the
    /// file `save_peft` writes as `adapter_model.safetensors`), atomically.
    pub fn save_peft_config(&self, path: impl AsRef<Path>, map: &KeyMap) -> Result<()> {
        let path = path.as_ref();
        let text =
            serde_json::to_string_pretty(&self.peft_config(map)?).map_err(|e| Error::Config {
                path: Some(path.to_path_buf()),
                msg: format!("cannot write the PEFT config: {e}"),
            })?;
        let tmp = path.with_extension("json.tmp");
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| Error::Io { path: p, source }
        };
        std::fs::write(&tmp, text.as_bytes()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    }

    /// Where the file's `adapter_config.json` says `use_effective_conv2d` = `effective` (PEFT's
    /// Tucker form of LoKr and LoHa) and these adapters differ on a convolution it concerns
    /// (a kernel larger than 1×1): an error naming `AdapterConfig::tucker`.
    fn check_effective_conv2d(&self, path: &Path, effective: bool) -> Result<()> {
        if !self.kind()?.peft_tucker || effective == self.config.tucker {
            return Ok(());
        }
        let concerned = self.layers()?.into_iter().find(|l| {
            let s = l.shape();
            s.is_conv() && s.kernel() != (1, 1)
        });
        match concerned {
            None => Ok(()),
            Some(l) => Err(Error::Setting {
                setting: Setting::AdapterTucker,
                msg: format!(
                    "= {}: the file {} was written with use_effective_conv2d = {effective} \
                     (PEFT's Tucker form), which concerns convolution {}; build the adapters \
                     with AdapterConfig::tucker = {effective}",
                    self.config.tucker,
                    path.display(),
                    l.path()
                ),
            }),
        }
    }

    /// Reads a diffusers / PEFT-layout file into the planned adapters. PEFT scales a file's
    /// adapters by alpha / r from the `adapter_config.json` beside it, per module where its
    /// `rank_pattern` / `alpha_pattern` say so, alpha / √r with `use_rslora` (`PeftScales`;
    /// 1 without the file, as FLAME writes them); the values are rescaled to this set's alpha. A missing, misshapen or
    /// unexpected tensor is an error naming it.
    pub fn load_peft(&self, path: impl AsRef<Path>, map: &KeyMap, prefix: &str) -> Result<()> {
        let path = path.as_ref();
        let scales = PeftScales::beside(path)?;
        let file = SafeTensorsFile::open(path)?;
        let unused: BTreeSet<String> = file.names().map(str::to_string).collect();
        let mut file = PeftFile {
            file,
            path: path.to_path_buf(),
            prefix: prefix.to_string(),
            unused,
            naming: Naming::Peft,
        };
        self.load_peft_into(&mut file, map, scales.as_ref())?;
        if let Some(k) = file.unused.iter().next() {
            return Err(err(
                path,
                Some(k),
                format!(
                    "no planned adapter takes it ({} such tensors; the adapters are {})",
                    file.unused.len(),
                    self.config.kind
                ),
            ));
        }
        Ok(())
    }

    /// Reads this set's adapters from a PEFT-layout `file` (under its prefix), scaled as
    /// `scales` says (1 without them).
    fn load_peft_into(
        &self,
        file: &mut PeftFile,
        map: &KeyMap,
        scales: Option<&PeftScales>,
    ) -> Result<()> {
        let path = file.path.clone();
        let path = path.as_path();
        let _g = crate::no_grad();
        if let Some(e) = scales.as_ref().and_then(|s| s.effective_conv2d) {
            self.check_effective_conv2d(path, e)?;
        }
        for l in self.layers()? {
            let parts = peft_parts(map, l.path(), l.shape().out_dim())?;
            // One scale a layer: its parts' (PEFT may give the parts of a split layer
            // different ones through its patterns, which one adapter cannot hold).
            let each: Vec<f64> = parts
                .iter()
                .map(|p| scales.as_ref().map_or(1.0, |s| s.of(&p.module)))
                .collect();
            let file_scale = each.first().copied().unwrap_or(1.0);
            if each.iter().any(|x| *x != file_scale) {
                return Err(err(
                    path,
                    None,
                    format!(
                        "adapter_config.json's rank_pattern / alpha_pattern scale the parts of \
                         layer {} differently ({}): one adapter on that layer cannot hold them",
                        l.path(),
                        parts
                            .iter()
                            .zip(&each)
                            .map(|(p, x)| format!("{} {x}", p.module))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            l.load_peft(&parts, file, file_scale)?;
        }
        Ok(())
    }
}

/// Writes several sets of adapters into one kohya-layout file (the diffusion model's
/// `lora_unet_*` beside the text encoders' `lora_te1_*`, ...), atomically, with the first
/// set's network metadata over `extra` and kohya's `sshs_*` hashes.
pub fn save_kohya_sets(
    sets: &[FileSet<'_>],
    path: impl AsRef<Path>,
    dtype: DType,
    extra: &BTreeMap<String, String>,
) -> Result<()> {
    let mut tensors = vec![];
    for s in sets {
        tensors.extend(s.adapters.kohya_tensors(s.kohya, dtype, None)?);
    }
    let mut meta = extra.clone();
    if let Some(first) = sets.first() {
        meta.extend(first.adapters.network_metadata()?);
    }
    let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
    save_with_hashes(named, &meta, path.as_ref())
}

/// Reads a kohya-layout file into several sets (as [`save_kohya_sets`] writes them): every
/// planned adapter must be in it, and it may hold nothing else.
pub fn load_kohya_sets(sets: &[FileSet<'_>], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let file = SafeTensorsFile::open(path)?;
    if let Some(layout) = file.metadata().get(LAYOUT_KEY) {
        return Err(err(
            path,
            None,
            format!("written in the {layout:?} layout: read it as {layout:?}"),
        ));
    }
    let mut unused: BTreeSet<String> = file.names().map(str::to_string).collect();
    for s in sets {
        s.adapters
            .load_kohya_into(&file, path, s.kohya, None, &mut unused)?;
    }
    left_over(path, &unused, sets.iter().map(|s| s.kohya).collect())
}

/// Writes several sets of adapters into one diffusers / PEFT-layout file, each under its
/// prefix (`unet.*` beside `text_encoder.*`, `text_encoder_2.*`, as diffusers'
/// `load_lora_weights` reads them), with `extra` metadata, the first set's network
/// metadata and kohya's `sshs_*` hashes.
pub fn save_peft_sets(
    sets: &[FileSet<'_>],
    path: impl AsRef<Path>,
    dtype: DType,
    extra: &BTreeMap<String, String>,
) -> Result<()> {
    let mut tensors = vec![];
    for s in sets {
        tensors.extend(s.adapters.peft_tensors(s.map, s.peft, dtype)?);
    }
    let mut meta = extra.clone();
    if let Some(first) = sets.first() {
        let c = &first.adapters.config;
        meta.extend(first.adapters.network_metadata()?);
        meta.insert("format".into(), "pt".into());
        meta.insert("flame_kind".into(), c.kind.clone());
        meta.insert("flame_rank".into(), c.rank.to_string());
    }
    let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
    save_with_hashes(named, &meta, path.as_ref())
}

/// Reads a PEFT-layout file into several sets (as [`save_peft_sets`] writes them), scaled
/// as the `adapter_config.json` beside it says (1 without one).
pub fn load_peft_sets(sets: &[FileSet<'_>], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let scales = PeftScales::beside(path)?;
    let file = SafeTensorsFile::open(path)?;
    let unused: BTreeSet<String> = file.names().map(str::to_string).collect();
    let mut file = PeftFile {
        file,
        path: path.to_path_buf(),
        prefix: String::new(),
        unused,
        naming: Naming::Peft,
    };
    for s in sets {
        file.prefix = s.peft.to_string();
        s.adapters
            .load_peft_into(&mut file, s.map, scales.as_ref())?;
    }
    left_over(path, &file.unused, sets.iter().map(|s| s.peft).collect())
}

/// An error naming a tensor of the file at `path` no set took.
pub(super) fn left_over(path: &Path, unused: &BTreeSet<String>, names: Vec<&str>) -> Result<()> {
    match unused.iter().next() {
        None => Ok(()),
        Some(k) => Err(err(
            path,
            Some(k),
            format!(
                "no planned adapter takes it ({} such tensors; the file's adapters are under \
                 {})",
                unused.len(),
                names.join(", ")
            ),
        )),
    }
}
