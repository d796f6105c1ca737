//! Parameters by checkpoint key path. A `VarBuilder` walks dotted keys
//! (`double_blocks.0.img_attn.qkv.weight`) with `pp` pushing one segment, so model code mirrors
//! the checkpoint's layout. Loading is strict and lazy: a key is read only when a layer asks
//! for it (its shape is checked from the header first), converted to the builder's dtype, and
//! cached, so asking twice gives the same tensor (tied weights stay tied). Every loaded
//! parameter is remembered under its key: frozen by default, trainable by `set_trainable`,
//! and listed for optimizers and saving.

use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Shape, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

enum Source {
    Files {
        files: Vec<SafeTensorsFile>,
        /// key -> index into `files`
        index: HashMap<String, usize>,
    },
    Tensors(HashMap<String, Tensor>),
}

struct Shared {
    source: Source,
    dtype: DType,
    device: Device,
    /// Every tensor handed out, by full key.
    loaded: Mutex<BTreeMap<String, Tensor>>,
}

/// A view of a parameter source under a key prefix. Cheap to clone.
#[derive(Clone)]
pub struct VarBuilder {
    shared: Arc<Shared>,
    prefix: Vec<String>,
}

impl VarBuilder {
    /// Parameters from one or more safetensors files (e.g. the shards of a checkpoint). A key
    /// found in two files is an error.
    pub fn from_files<P: AsRef<Path>>(paths: &[P], dtype: DType, device: &Device) -> Result<Self> {
        let mut files = vec![];
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            let f = SafeTensorsFile::open(p)?;
            for name in f.names() {
                if let Some(j) = index.insert(name.to_string(), i) {
                    let first: &SafeTensorsFile = &files[j];
                    return Err(Error::Param {
                        key: name.to_string(),
                        file: Some(p.as_ref().to_path_buf()),
                        msg: format!("also present in {}", first.path().display()),
                    });
                }
            }
            files.push(f);
        }
        Ok(Self::new(Source::Files { files, index }, dtype, device))
    }

    /// Parameters from tensors in memory (tests, freshly initialised models).
    pub fn from_tensors(tensors: HashMap<String, Tensor>, dtype: DType, device: &Device) -> Self {
        Self::new(Source::Tensors(tensors), dtype, device)
    }

    fn new(source: Source, dtype: DType, device: &Device) -> Self {
        VarBuilder {
            shared: Arc::new(Shared {
                source,
                dtype,
                device: device.clone(),
                loaded: Mutex::new(BTreeMap::new()),
            }),
            prefix: vec![],
        }
    }

    /// The builder one level down: `vb.pp("img_attn").pp("qkv")`.
    pub fn pp(&self, segment: impl ToString) -> VarBuilder {
        let mut prefix = self.prefix.clone();
        prefix.push(segment.to_string());
        VarBuilder {
            shared: self.shared.clone(),
            prefix,
        }
    }

    pub fn dtype(&self) -> DType {
        self.shared.dtype
    }

    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The full key of `name` under this prefix.
    pub fn key(&self, name: &str) -> String {
        let mut parts = self.prefix.clone();
        parts.push(name.to_string());
        parts.join(".")
    }

    fn file_of(&self, key: &str) -> Option<PathBuf> {
        match &self.shared.source {
            Source::Files { files, index } => {
                index.get(key).map(|&i| files[i].path().to_path_buf())
            }
            Source::Tensors(_) => None,
        }
    }

    /// Whether the source has `name` under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        let key = self.key(name);
        match &self.shared.source {
            Source::Files { index, .. } => index.contains_key(&key),
            Source::Tensors(t) => t.contains_key(&key),
        }
    }

    fn err(&self, key: &str, msg: String) -> Error {
        Error::Param {
            key: key.to_string(),
            file: self.file_of(key),
            msg,
        }
    }

    /// The parameter `name` with the given shape, in the builder's dtype and on its device.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor> {
        let shape = shape.into();
        let key = self.key(name);
        let mut loaded = self
            .shared
            .loaded
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        if let Some(t) = loaded.get(&key) {
            if t.shape() != &shape {
                return Err(self.err(
                    &key,
                    format!("asked for shape {shape}, loaded earlier as {}", t.shape()),
                ));
            }
            return Ok(t.clone());
        }
        let (dtype, device) = (self.shared.dtype, &self.shared.device);
        let t = match &self.shared.source {
            Source::Files { files, index } => {
                let i = *index.get(&key).ok_or_else(|| {
                    let names: Vec<String> = files
                        .iter()
                        .map(|f| f.path().display().to_string())
                        .collect();
                    Error::Param {
                        key: key.clone(),
                        file: None,
                        msg: format!("missing from {}", names.join(", ")),
                    }
                })?;
                let info = files[i]
                    .info(&key)
                    .ok_or_else(|| self.err(&key, "missing".into()))?;
                if info.shape.as_slice() != shape.dims() {
                    return Err(self.err(
                        &key,
                        format!(
                            "expected shape {shape}, the file has {:?} ({})",
                            info.shape, info.dtype
                        ),
                    ));
                }
                files[i].load_as(&key, device, dtype)?
            }
            Source::Tensors(map) => {
                let t = map
                    .get(&key)
                    .ok_or_else(|| self.err(&key, "missing".into()))?;
                if t.shape() != &shape {
                    return Err(
                        self.err(&key, format!("expected shape {shape}, found {}", t.shape()))
                    );
                }
                let _g = crate::no_grad();
                t.to_dtype(dtype)?.to_device(device)?.detach()
            }
        };
        loaded.insert(key, t.clone());
        Ok(t)
    }

    /// Every key of the source that no layer asked for, sorted.
    pub fn unused_keys(&self) -> Result<Vec<String>> {
        let loaded = self
            .shared
            .loaded
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        let mut keys: Vec<String> = match &self.shared.source {
            Source::Files { index, .. } => index
                .keys()
                .filter(|k| !loaded.contains_key(*k))
                .cloned()
                .collect(),
            Source::Tensors(t) => t
                .keys()
                .filter(|k| !loaded.contains_key(*k))
                .cloned()
                .collect(),
        };
        keys.sort();
        Ok(keys)
    }

    /// Marks each loaded parameter trainable or frozen by its full key.
    pub fn set_trainable(&self, trainable: impl Fn(&str) -> bool) -> Result<()> {
        let loaded = self
            .shared
            .loaded
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        for (k, t) in loaded.iter() {
            t.set_requires_grad(trainable(k))?;
        }
        Ok(())
    }

    /// Every loaded parameter with its key, sorted by key.
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        let loaded = self
            .shared
            .loaded
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        Ok(loaded.iter().map(|(k, t)| (k.clone(), t.clone())).collect())
    }

    /// The trainable parameters with their keys: what an optimizer takes.
    pub fn trainable_params(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .params()?
            .into_iter()
            .filter(|(_, t)| t.is_var())
            .collect())
    }
}
