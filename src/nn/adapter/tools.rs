//! The LoRA files two other trainers write for FLUX.2 \[klein\] and Z-Image, written and read
//! by FLAME (`adapter.format = "ai-toolkit"` / `"musubi"`).
//!
//! - **ai-toolkit** (ostris/ai-toolkit at 27a03a91): PEFT's tensor names, `lora_A.weight` /
//!   `lora_B.weight` with no `alpha` (`toolkit/network_mixins.py` `get_state_dict` with
//!   `peft_format`: alpha = rank, so the scale is 1), under `diffusion_model.` and the module
//!   names of the model it builds (`convert_lora_weights_before_save` in
//!   `extensions_built_in/diffusion_models/flux2/flux2_model.py` and
//!   `z_image/z_image.py` replaces its `transformer.` by `diffusion_model.`): for FLUX.2 its
//!   port of BFL's model (`flux2/src/model.py`), so BFL's names with the fused
//!   `img_attn.qkv`; for Z-Image diffusers' `ZImageTransformer2DModel`, whose attention has
//!   `to_q`, `to_k`, `to_v` and `to_out.0`. FLAME writes that: its PEFT layout under the
//!   prefix `diffusion_model` and the tool's module names, each module's scale folded into
//!   its `lora_B`.
//! - **musubi-tuner** (kohya-ss/musubi-tuner at 30c658c4): kohya's names, `lora_unet_` and
//!   the module path with dots as underscores, `lora_down.weight` / `lora_up.weight` /
//!   `alpha` (`src/musubi_tuner/networks/lora.py`, `create_modules`), over the module names
//!   of its own models: for FLUX.2 BFL's (`flux_2/flux2_models.py`), so the file is FLAME's
//!   kohya layout exactly; for Z-Image `zimage/zimage_model.py`'s `ZImageAttention`, whose
//!   projections are `to_q`, `to_k`, `to_v` and `to_out.0` as diffusers names them (its own
//!   `networks/convert_z_image_lora_to_comfy.py` fuses them into ComfyUI's `qkv` and renames
//!   `to_out_0` to `out`). FLAME writes each diffusers module of a fused layer as a LoRA of
//!   its own: the layer's down-projection, its rows of the up-projection, and its alpha, so
//!   musubi computes the trained change.
//!
//! Both are written for LoRA (the kinds these files hold in the tools' default
//! configurations); a file of separate q, k and v LoRAs, as both tools train them on
//! Z-Image, reads into FLAME's fused adapter only where their down-projections are one (the
//! files FLAME writes); others merge into the weights (`crate::nn::LoraMerge`, the `sample`
//! binary).

use super::io::{err, left_over, part_rows, peft_parts, Naming, PeftFile, KOHYA_MODEL};
use super::{kohya_name, Adapters};
use crate::nn::keys::{KeyMap, KeySource};
use crate::safetensors::{save_with_hashes, save_with_metadata, SafeTensorsFile};
use crate::{DType, Error, Result, Setting, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

/// A trainer whose LoRA files FLAME writes and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tool {
    /// ostris' ai-toolkit.
    AiToolkit,
    /// kohya's musubi-tuner.
    Musubi,
}

impl Tool {
    /// Its name in `adapter.format`.
    pub fn name(self) -> &'static str {
        match self {
            Tool::AiToolkit => "ai-toolkit",
            Tool::Musubi => "musubi",
        }
    }
}

/// The module names a trainer's files give a family's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleNames {
    /// The model's own keys (BFL's FLUX.2), a fused layer one module.
    Original,
    /// diffusers' modules, a fused layer one module per projection.
    Diffusers,
}

impl ModuleNames {
    /// Model key -> the tool's module key, given the model's diffusers map.
    pub fn map(self, diffusers: &KeyMap) -> KeyMap {
        match self {
            ModuleNames::Original => Arc::new(|k: &str| Some(KeySource::Key(k.to_string()))),
            ModuleNames::Diffusers => diffusers.clone(),
        }
    }
}

/// Which module names each trainer uses for a family (`None`: FLAME does not write that
/// trainer's files for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolNames {
    /// ai-toolkit's.
    pub ai_toolkit: Option<ModuleNames>,
    /// musubi-tuner's.
    pub musubi: Option<ModuleNames>,
}

impl ToolNames {
    /// Neither trainer's files.
    pub const NONE: ToolNames = ToolNames {
        ai_toolkit: None,
        musubi: None,
    };

    /// `tool`'s names.
    pub fn of(&self, tool: Tool) -> Option<ModuleNames> {
        match tool {
            Tool::AiToolkit => self.ai_toolkit,
            Tool::Musubi => self.musubi,
        }
    }
}

/// The prefix of ai-toolkit's keys (its `convert_lora_weights_before_save`).
pub const AI_TOOLKIT_PREFIX: &str = "diffusion_model";

impl Adapters {
    /// Writes every adapter in `tool`'s layout (module docs) with `names` the tool's module
    /// names of this model (`diffusers`: its diffusers map), the tensors in `dtype`, alpha in
    /// f32, atomically; with `extra` metadata and kohya's `sshs_*` hashes where given. LoRA
    /// only.
    pub fn save_tool(
        &self,
        tool: Tool,
        names: ModuleNames,
        diffusers: &KeyMap,
        path: impl AsRef<Path>,
        dtype: DType,
        extra: Option<&BTreeMap<String, String>>,
    ) -> Result<()> {
        let path = path.as_ref();
        self.lora_only(tool)?;
        let map = names.map(diffusers);
        match (tool, names) {
            (Tool::AiToolkit, _) => {
                self.save_peft_layout(path, &map, AI_TOOLKIT_PREFIX, dtype, extra)
            }
            (Tool::Musubi, ModuleNames::Original) => {
                self.save_kohya_layout(path, dtype, None, extra)
            }
            (Tool::Musubi, ModuleNames::Diffusers) => {
                let tensors = self.kohya_by_module(&map, dtype)?;
                let mut meta = extra.cloned().unwrap_or_default();
                meta.extend(self.network_metadata()?);
                let named = tensors.iter().map(|(k, t)| (k.as_str(), t));
                match extra {
                    Some(_) => save_with_hashes(named, &meta, path),
                    None => save_with_metadata(named, &meta, path),
                }
            }
        }
    }

    /// Reads a file in `tool`'s layout (as [`Adapters::save_tool`] writes it) into the
    /// planned adapters. Every planned adapter must be in it, and it may hold nothing else: a
    /// missing, misshapen or unexpected tensor is an error naming it, as are the parts of a
    /// fused layer whose down-projections (or scales) differ.
    pub fn load_tool(
        &self,
        tool: Tool,
        names: ModuleNames,
        diffusers: &KeyMap,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let path = path.as_ref();
        self.lora_only(tool)?;
        let map = names.map(diffusers);
        match (tool, names) {
            (Tool::AiToolkit, _) => self.load_peft(path, &map, AI_TOOLKIT_PREFIX),
            (Tool::Musubi, ModuleNames::Original) => self.load_kohya_layout(path, None),
            (Tool::Musubi, ModuleNames::Diffusers) => self.load_kohya_by_module(path, &map),
        }
    }

    /// These files hold LoRAs (module docs): the kinds `Kind::tool_layouts` names.
    fn lora_only(&self, tool: Tool) -> Result<()> {
        if self.kind()?.tool_layouts {
            return Ok(());
        }
        Err(Error::Setting {
            setting: Setting::AdapterLayout,
            msg: format!(
                " \"{}\" is written for {}, not {:?}: write \"kohya\" or \"peft\"",
                tool.name(),
                super::tool_layout_kinds(),
                self.config.kind
            ),
        })
    }

    /// Each adapter as one LoRA a module of `map` (a fused layer's parts: the layer's
    /// down-projection, the part's rows of its up-projection, its alpha), under kohya's name
    /// of the module.
    fn kohya_by_module(&self, map: &KeyMap, dtype: DType) -> Result<Vec<(String, Tensor)>> {
        let _g = crate::no_grad();
        let mut v = vec![];
        for l in self.layers()? {
            let parts = peft_parts(map, l.path(), l.shape().out_dim())?;
            let t = l.to_kohya()?;
            let get = |name: &str| {
                t.iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, x)| x.clone())
                    .ok_or_else(|| Error::Setting {
                        setting: Setting::AdapterLayout,
                        msg: format!(
                            " the adapter of layer {} has no {name} to write as a LoRA",
                            l.path()
                        ),
                    })
            };
            if t.len() != 3 {
                return Err(Error::Setting {
                    setting: Setting::AdapterLayout,
                    msg: format!(
                        " the adapter of layer {} holds {} tensors, a LoRA's are lora_down, \
                         lora_up and alpha",
                        l.path(),
                        t.len()
                    ),
                });
            }
            let (down, up, alpha) = (
                get("lora_down.weight")?,
                get("lora_up.weight")?,
                get("alpha")?,
            );
            for p in &parts {
                let name = kohya_name(&p.module);
                v.push((format!("{name}.lora_down.weight"), down.to_dtype(dtype)?));
                v.push((
                    format!("{name}.lora_up.weight"),
                    part_rows(&up, p)?.to_dtype(dtype)?,
                ));
                v.push((format!("{name}.alpha"), alpha.clone()));
            }
        }
        Ok(v)
    }

    /// Reads what `kohya_by_module` writes: each module's LoRA scaled by its alpha / rank
    /// (1 without an alpha, kohya's rule), a fused layer's parts one adapter.
    fn load_kohya_by_module(&self, path: &Path, map: &KeyMap) -> Result<()> {
        let file = SafeTensorsFile::open(path)?;
        let unused: BTreeSet<String> = file.names().map(str::to_string).collect();
        let mut pf = PeftFile {
            file,
            path: path.to_path_buf(),
            prefix: String::new(),
            unused,
            naming: Naming::Kohya,
        };
        let _g = crate::no_grad();
        for l in self.layers()? {
            let parts = peft_parts(map, l.path(), l.shape().out_dim())?;
            let mut scale: Option<(f64, String)> = None;
            for p in &parts {
                let name = kohya_name(&p.module);
                let down = format!("{name}.lora_down.weight");
                let rank = pf
                    .file
                    .info(&down)
                    .and_then(|i| i.shape.first().copied())
                    .filter(|r| *r > 0)
                    .ok_or_else(|| {
                        err(
                            path,
                            Some(&down),
                            format!("missing (adapter of layer {})", l.path()),
                        )
                    })?;
                let key = format!("{name}.alpha");
                let s = match pf.file.contains(&key) {
                    true => {
                        let a = pf.file.host(&key)?.to_f64_vec();
                        pf.unused.remove(&key);
                        match a.as_slice() {
                            [a] if a.is_finite() => a / rank as f64,
                            _ => {
                                return Err(err(
                                    path,
                                    Some(&key),
                                    format!("alpha {a:?} is not one number"),
                                ))
                            }
                        }
                    }
                    false => 1.0,
                };
                match &scale {
                    Some((x, other)) if *x != s => {
                        return Err(err(
                            path,
                            Some(&key),
                            format!(
                                "scales its LoRA by {s}, {other} by {x}: the parts of layer {} \
                                 are one adapter in FLAME",
                                l.path()
                            ),
                        ))
                    }
                    Some(_) => {}
                    None => scale = Some((s, key)),
                }
            }
            l.load_peft(&parts, &mut pf, scale.map_or(1.0, |(s, _)| s))?;
        }
        left_over(path, &pf.unused, vec![KOHYA_MODEL])
    }
}
