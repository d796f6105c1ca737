//! Finding a model's weights in what users download: a single `.safetensors` file (the
//! original layout: BFL's Flux, Stability's SD3.5 and SDXL, the latter two under
//! `model.diffusion_model.`), or a diffusers folder (`config.json` beside
//! `diffusion_pytorch_model.safetensors`, or shards listed by
//! `diffusion_pytorch_model.safetensors.index.json`), given directly or as a pipeline folder
//! holding it under `transformer/` or `unet/`; or a single `.gguf` file (city96's quantized
//! models of every family: the single file's key names, bare or under `model.diffusion_model.`,
//! its quantized Linear weights kept packed; `crate::gguf` reads SDXL's reshaped tensors in
//! their recorded shapes).

use crate::backend::ggml::GgmlType;
use crate::nn::{KeyMap, KeySource, VarBuilder};
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The prefix of the diffusion model's tensors in Stability's single-file checkpoints.
pub const LDM_PREFIX: &str = "model.diffusion_model.";

/// The two layouts a checkpoint comes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The original single file: model code reads its keys as they are (after the prefix).
    SingleFile,
    /// A diffusers folder: keys go through the model's diffusers key map.
    Diffusers,
}

pub use crate::safetensors::CONFIG_METADATA;

/// A located checkpoint: its files and, for diffusers folders, the parsed config.json.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Which of the two layouts it is.
    pub format: Format,
    /// The path the user gave.
    pub path: PathBuf,
    /// The `.safetensors` files holding the weights (one, or every shard of the index).
    pub files: Vec<PathBuf>,
    /// `config.json` of a diffusers folder, or a single file's [`CONFIG_METADATA`].
    pub config: Option<serde_json::Value>,
    /// The key prefix of a single file's model tensors ("" or [`LDM_PREFIX`]).
    pub prefix: String,
}

fn ck_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ck_err(path, format!("invalid JSON: {e}")))
}

impl Checkpoint {
    /// Locates the weights at `path`: a `.safetensors` file, a diffusers model folder, or a
    /// pipeline folder with the model under `subfolder` (`transformer` or `unet`). A
    /// diffusers model's own `diffusion_pytorch_model*.safetensors` beside its config.json
    /// opens as its folder (that config, every shard).
    pub fn open(path: impl AsRef<Path>, subfolder: &str) -> Result<Checkpoint> {
        let path = path.as_ref();
        if path.is_file() && crate::gguf::is_gguf(path) {
            let file = crate::gguf::GgufFile::open(path)?;
            let prefix = if file.names().any(|n| n.starts_with(LDM_PREFIX)) {
                LDM_PREFIX.to_string()
            } else {
                String::new()
            };
            // A string under the same metadata key as a .safetensors file's config.
            let config = match file.metadata().get(CONFIG_METADATA) {
                Some(v) => {
                    let text = v.as_str().ok_or_else(|| {
                        ck_err(
                            path,
                            format!("metadata \"{CONFIG_METADATA}\" is not a string"),
                        )
                    })?;
                    Some(serde_json::from_str(text).map_err(|e| {
                        ck_err(
                            path,
                            format!("metadata \"{CONFIG_METADATA}\": invalid JSON: {e}"),
                        )
                    })?)
                }
                None => None,
            };
            return Ok(Checkpoint {
                format: Format::SingleFile,
                path: path.to_path_buf(),
                files: vec![path.to_path_buf()],
                config,
                prefix,
            });
        }
        // A diffusers model's own weight file (or one of its shards) beside the model's
        // config.json: the model folder it belongs to, with that config and every shard.
        let model_folder = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| n.starts_with("diffusion_pytorch_model") && n.ends_with(".safetensors"))
            .filter(|_| path.is_file())
            .and(path.parent())
            .filter(|dir| dir.join("config.json").is_file());
        if let Some(dir) = model_folder {
            let mut ckpt = Checkpoint::open(dir, subfolder)?;
            ckpt.path = path.to_path_buf();
            return Ok(ckpt);
        }
        if path.is_file() {
            let file = SafeTensorsFile::open(path)?;
            let prefix = if file.names().any(|n| n.starts_with(LDM_PREFIX)) {
                LDM_PREFIX.to_string()
            } else {
                String::new()
            };
            let config = match file.metadata().get(CONFIG_METADATA) {
                Some(text) => Some(serde_json::from_str(text).map_err(|e| {
                    ck_err(
                        path,
                        format!("metadata \"{CONFIG_METADATA}\": invalid JSON: {e}"),
                    )
                })?),
                None => None,
            };
            return Ok(Checkpoint {
                format: Format::SingleFile,
                path: path.to_path_buf(),
                files: vec![path.to_path_buf()],
                config,
                prefix,
            });
        }
        if !path.is_dir() {
            return Err(ck_err(path, "no such file or folder"));
        }
        let dir = if path.join(subfolder).join("config.json").is_file() {
            path.join(subfolder)
        } else {
            path.to_path_buf()
        };
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(ck_err(
                path,
                format!(
                    "not a diffusers folder: no config.json here or under {subfolder}/ \
                     (give a .safetensors file for a single-file checkpoint)"
                ),
            ));
        }
        let config = read_json(&config_path)?;
        let index = dir.join("diffusion_pytorch_model.safetensors.index.json");
        let files = if index.is_file() {
            let json = read_json(&index)?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ck_err(&index, "no \"weight_map\" object"))?;
            let mut names = BTreeSet::new();
            for (key, file) in map {
                let f = file.as_str().ok_or_else(|| {
                    ck_err(&index, format!("weight_map[\"{key}\"] is not a file name"))
                })?;
                names.insert(f.to_string());
            }
            let files: Vec<PathBuf> = names.into_iter().map(|n| dir.join(n)).collect();
            for f in &files {
                if !f.is_file() {
                    return Err(ck_err(
                        &index,
                        format!("lists {}, which does not exist", f.display()),
                    ));
                }
            }
            files
        } else {
            let single = dir.join("diffusion_pytorch_model.safetensors");
            if !single.is_file() {
                return Err(ck_err(
                    &dir,
                    "has config.json but neither diffusion_pytorch_model.safetensors nor its \
                     .index.json",
                ));
            }
            vec![single]
        };
        Ok(Checkpoint {
            format: Format::Diffusers,
            path: path.to_path_buf(),
            files,
            config: Some(config),
            prefix: String::new(),
        })
    }

    /// A builder over the checkpoint's files reading model keys: single files through the
    /// prefix, diffusers folders through `diffusers_map` (model key -> diffusers key(s)).
    pub fn var_builder(
        &self,
        dtype: DType,
        device: &Device,
        diffusers_map: KeyMap,
    ) -> Result<VarBuilder> {
        let vb = VarBuilder::from_files(&self.files, dtype, device)?;
        match self.format {
            Format::Diffusers => vb.with_key_map(diffusers_map),
            Format::SingleFile if self.prefix.is_empty() => Ok(vb),
            Format::SingleFile => {
                let prefix = self.prefix.clone();
                vb.with_key_map(Arc::new(move |k: &str| {
                    Some(KeySource::Key(format!("{prefix}{k}")))
                }))
            }
        }
    }

    /// The GGML types of a GGUF single file's quantized tensors, by model key (the file's
    /// keys after the prefix); `None` for other checkpoints. A shapes-only build sizes those
    /// Linear weights packed from them (`VarBuilder::with_ggml_types`).
    pub fn ggml_types(&self) -> Result<Option<Arc<HashMap<String, GgmlType>>>> {
        let [file] = self.files.as_slice() else {
            return Ok(None);
        };
        if self.format != Format::SingleFile || !crate::gguf::is_gguf(file) {
            return Ok(None);
        }
        let f = crate::gguf::GgufFile::open(file)?;
        let types = f
            .names()
            .filter_map(|n| {
                let ty = f.info(n)?.ty;
                let key = n.strip_prefix(self.prefix.as_str())?;
                ty.is_quantized().then(|| (key.to_string(), ty))
            })
            .collect();
        Ok(Some(Arc::new(types)))
    }

    /// An error about this checkpoint.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        ck_err(&self.path, msg)
    }
}

/// Reads field `name` of a diffusers config, with the config's path in the error.
pub(crate) fn cfg_usize(cfg: &serde_json::Value, name: &str) -> Result<usize> {
    cfg.get(name)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| Error::Config {
            path: None,
            msg: format!("config.json: \"{name}\" is missing or not a non-negative integer"),
        })
}

/// A field that may be absent or null (then `None`).
pub(crate) fn cfg_opt<'a>(cfg: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    cfg.get(name).filter(|v| !v.is_null())
}

/// A list of non-negative integers, `None` when absent or null.
pub(crate) fn cfg_usize_list(cfg: &serde_json::Value, name: &str) -> Result<Option<Vec<usize>>> {
    let Some(v) = cfg_opt(cfg, name) else {
        return Ok(None);
    };
    v.as_array()
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
        })
        .map(Some)
        .ok_or_else(|| Error::Config {
            path: None,
            msg: format!("config.json: \"{name}\" = {v} is not a list of integers"),
        })
}
