//! Parameters by checkpoint key path. A `VarBuilder` walks dotted keys
//! (`double_blocks.0.img_attn.qkv.weight`) with `pp` pushing one segment, so model code mirrors
//! the checkpoint's layout. Loading is strict and lazy: a key is read only when a layer asks
//! for it (its shape is checked from the header first), converted to the builder's dtype, and
//! cached, so asking twice gives the same tensor (tied weights stay tied). Every loaded
//! parameter is remembered under its key: frozen by default, trainable by `set_trainable`,
//! and listed for optimizers and saving.

use super::adapter::{Adapter, Adapters, LayerShape};
use super::packed::{words_for, Packing};
use super::seed::key_hash;
use crate::backend::ggml::GgmlType;
use crate::gguf::GgufFile;
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Shape, Tensor};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use super::keys::{KeyMap, KeySource};

enum Source {
    Files {
        files: Vec<SafeTensorsFile>,
        /// key -> index into `files`
        index: HashMap<String, usize>,
    },
    /// One GGUF file: quantized Linear weights stay packed (`get_linear_weight`), every other
    /// tensor is dequantized to the builder's dtype as it loads.
    Gguf(GgufFile),
    Tensors(HashMap<String, Tensor>),
    /// Keys and shapes without values (`from_shapes`): loading checks them as a file's header,
    /// and hands out zero-stride views of one zero.
    Shapes(HashMap<String, Vec<usize>>),
    /// Fresh N(0, std²) values of whatever shape a layer asks for, seeded per key.
    Random {
        seed: u64,
        std: f64,
    },
}

/// A keeper of some weights away from the device they are used on, which hands the model a
/// handle of its own for each (`VarBuilder::with_host_weights`): a block streamer
/// (`crate::memory::BlockStreamer`) keeps streamed blocks' weights in host memory and brings
/// them to the device around the blocks' runs.
pub trait HostWeights: Send + Sync {
    /// The device the weights are used on.
    fn device(&self) -> &Device;
    /// Takes `t`, loaded as parameter `key` on the device, when it keeps that key: the
    /// handle the model keeps instead (`None`: not one of its keys, `t` stays as it is).
    fn place(&self, key: &str, t: &Tensor) -> Result<Option<Tensor>>;
}

struct Shared {
    source: Source,
    /// Model key -> source key(s); `None` reads every key as is.
    map: Option<KeyMap>,
    /// LoRA adapters planned for the layers built from this builder.
    adapters: Option<Arc<Adapters>>,
    /// Where the weights it owns live instead of the device (host memory for a streamed
    /// block's weights: `crate::memory::BlockStreamer`).
    host: Option<Arc<dyn HostWeights>>,
    /// Linear weights load as FP8 E4M3 codes with per-row scales (`get_linear_weight`).
    fp8: bool,
    /// The Linears' products run in 8 bits, in this code (`with_products`; their weights load
    /// as its codes).
    products: Option<crate::backend::fp8::Code8>,
    /// Int8 products rotate their inner axis (`with_int8_rotation`).
    int8_rotation: bool,
    /// Weights that stay on the device keep their transposed codes for the 8-bit backward
    /// (`with_kept_transposes`).
    kept_transposes: bool,
    /// The rows each Linear's products see in the run: 8-bit products only where they pay
    /// (`with_product_rows`).
    product_rows: Option<super::ProductRows>,
    /// The GGML types of a GGUF checkpoint's quantized tensors by model key, for a
    /// shapes-only build that sizes them packed (`with_ggml_types`).
    ggml_types: Option<Arc<HashMap<String, GgmlType>>>,
    /// The (out, in) of every packed Linear weight handed out, by full key.
    packed: Mutex<BTreeMap<String, (usize, usize)>>,
    /// What the 8-bit backward keeps of each FP8 weight (`Packing::Fp8`'s `kept`), by full
    /// key: the Linears built on one key share it.
    fp8_kept: Mutex<BTreeMap<String, super::Fp8Kept>>,
    /// A LoRA file merged into the weights as they load.
    merge: Option<Arc<super::LoraMerge>>,
    /// Every tensor is a zero-stride view of one zero (`shapes_only`): a build that only
    /// learns the model's parameter shapes.
    shapes_only: bool,
    dtype: DType,
    device: Device,
    /// Every tensor handed out, by full key.
    loaded: Mutex<BTreeMap<String, Tensor>>,
    /// Every source key read.
    used: Mutex<BTreeSet<String>>,
}

/// A view of a parameter source under a key prefix. Cheap to clone.
#[derive(Clone)]
pub struct VarBuilder {
    shared: Arc<Shared>,
    prefix: Vec<String>,
}

impl std::fmt::Debug for VarBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match &self.shared.source {
            Source::Files { files, .. } => files
                .iter()
                .map(|f| f.path().display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            Source::Gguf(f) => f.path().display().to_string(),
            Source::Tensors(t) => format!("{} tensors", t.len()),
            Source::Shapes(s) => format!("{} shapes without values", s.len()),
            Source::Random { seed, std } => format!("random N(0, {std}^2), seed {seed}"),
        };
        write!(
            f,
            "VarBuilder({source}, prefix '{}', {:?}, {}{})",
            self.prefix.join("."),
            self.shared.dtype,
            self.shared.device,
            if self.shared.map.is_some() {
                ", key map"
            } else {
                ""
            }
        )
    }
}

impl VarBuilder {
    /// Parameters from one or more safetensors files (e.g. the shards of a checkpoint), or
    /// from one GGUF file (`.gguf`: its quantized Linear weights stay packed,
    /// `get_linear_weight`). A key found in two files is an error.
    pub fn from_files<P: AsRef<Path>>(paths: &[P], dtype: DType, device: &Device) -> Result<Self> {
        if let [p] = paths {
            if crate::gguf::is_gguf(p.as_ref()) {
                let f = GgufFile::open(p)?;
                return Ok(Self::new(Source::Gguf(f), dtype, device));
            }
        }
        if let Some(p) = paths.iter().find(|p| crate::gguf::is_gguf(p.as_ref())) {
            return Err(Error::Param {
                key: String::new(),
                file: Some(p.as_ref().to_path_buf()),
                msg: "a GGUF file is read alone, not beside other weight files".into(),
            });
        }
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

    /// A source of keys and shapes without values (e.g. the key list of a checkpoint too large
    /// to keep in the tests): loading is checked as from files, key by key and shape by shape
    /// through any key map, and the keys read are recorded (`unused_keys`), but every tensor
    /// handed out is a zero-stride view of one zero in the asked shape (one element of memory
    /// on `device`). Values computed from them are meaningless; for checking layouts.
    pub fn from_shapes(
        shapes: impl IntoIterator<Item = (String, Vec<usize>)>,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Self::new(Source::Shapes(shapes.into_iter().collect()), dtype, device)
    }

    /// Random parameters: each key asked for gets N(0, std²) values of the asked shape, from
    /// a seed mixed from `seed` and the key (so a model's weights do not depend on the order
    /// its layers are built in). For benchmarks and for made-up tiny models; `contains` is
    /// false for every key (nothing is stored), and there are no unused keys.
    pub fn random(seed: u64, std: f64, dtype: DType, device: &Device) -> Self {
        Self::new(Source::Random { seed, std }, dtype, device)
    }

    /// A builder that hands out zero-stride views of a single zero in the asked shape (no
    /// memory per tensor): building a model from it lists its parameters' keys, shapes and
    /// bytes (`params`) without reading or allocating weights. The memory planner sizes
    /// models this way before loading them.
    /// The one element behind the views lives on `device`; adapters planned on the builder are
    /// made there too.
    pub fn shapes_only(dtype: DType, device: &Device) -> Self {
        let mut vb = Self::new(Source::Random { seed: 0, std: 0.0 }, dtype, device);
        if let Some(shared) = Arc::get_mut(&mut vb.shared) {
            shared.shapes_only = true;
        }
        vb
    }

    fn new(source: Source, dtype: DType, device: &Device) -> Self {
        VarBuilder {
            shared: Arc::new(Shared {
                source,
                map: None,
                adapters: None,
                host: None,
                fp8: false,
                products: None,
                int8_rotation: false,
                kept_transposes: true,
                product_rows: None,
                ggml_types: None,
                packed: Mutex::new(BTreeMap::new()),
                fp8_kept: Mutex::new(BTreeMap::new()),
                merge: None,
                shapes_only: false,
                dtype,
                device: device.clone(),
                loaded: Mutex::new(BTreeMap::new()),
                used: Mutex::new(BTreeSet::new()),
            }),
            prefix: vec![],
        }
    }

    /// The builder with its shared part changed by `f`, allowed only while no clone of it
    /// exists (`what` names the setting in the error).
    fn with_shared(self, what: &str, f: impl FnOnce(Shared) -> Result<Shared>) -> Result<Self> {
        let prefix = self.prefix;
        let shared = Arc::try_unwrap(self.shared).map_err(|_| Error::Param {
            key: String::new(),
            file: None,
            msg: format!("{what} must be set before the builder is shared"),
        })?;
        Ok(VarBuilder {
            shared: Arc::new(f(shared)?),
            prefix,
        })
    }

    /// The same source read through a key map (model key -> source keys), with nothing loaded
    /// yet. Model code keeps one set of key paths; each checkpoint layout brings its map.
    pub fn with_key_map(self, map: KeyMap) -> Result<Self> {
        let vb = self.with_shared("a key map", |shared| {
            Ok(Shared {
                map: Some(map),
                ..shared
            })
        })?;
        Ok(VarBuilder {
            prefix: vec![],
            ..vb
        })
    }

    /// The same source with Linear weights stored as FP8 E4M3 (`backend::fp8`: per-row f32
    /// scales, codes packed four to a u32) when `fp8`: `get_linear_weight` quantizes them at
    /// load (in-widths not a multiple of 4 stay in the builder's dtype); every other tensor
    /// (norms, embeddings, biases) keeps the builder's dtype. Set before the builder is
    /// shared.
    pub fn with_fp8(self, fp8: bool) -> Result<Self> {
        self.with_shared("fp8 weights", |shared| Ok(Shared { fp8, ..shared }))
    }

    /// The same source with the Linears' products in 8 bits when `on` (`model.compute =
    /// "fp8"`): their weights load as FP8 as `with_fp8` stores them, and each product
    /// quantizes its activations instead of decoding the weight (`nn::Packing::Fp8`'s
    /// `products`). Set before the builder is shared.
    pub fn with_fp8_products(self, on: bool) -> Result<Self> {
        self.with_products(on.then_some(crate::backend::fp8::Code8::E4m3))
    }

    /// The same source with int8 products rotating their inner axis when `on` (the outlier
    /// treatment, `backend::int8`: the weights of the Linears whose products run in int8
    /// load as the codes of W H, H a block Hadamard matrix along the input axis, and each
    /// product rotates its input alike). Set before the builder is shared.
    pub fn with_int8_rotation(self, on: bool) -> Result<Self> {
        self.with_shared("int8 rotation", |shared| {
            Ok(Shared {
                int8_rotation: on,
                ..shared
            })
        })
    }

    /// The same source with the Linears' products in 8 bits in `code` (`model.compute =
    /// "fp8"` or "int8"; `None`: in the weights' dtype): their weights load as that code's
    /// values (int8 codes replace FP8 storage, and an FP8 file's weights are decoded and
    /// quantized to int8 again), and each product quantizes its activations instead of
    /// decoding the weight. Set before the builder is shared.
    pub fn with_products(self, code: Option<crate::backend::fp8::Code8>) -> Result<Self> {
        self.with_shared("8-bit products", |shared| {
            Ok(Shared {
                products: code,
                ..shared
            })
        })
    }

    /// The same builder with the 8-bit backward of weights that stay on the device keeping
    /// their transposed codes (the default) or transposing them at each backward as a
    /// streamed weight's does (`false`: `memory::Plan::remake_transposes`). Set before the
    /// builder is shared.
    pub fn with_kept_transposes(self, kept: bool) -> Result<Self> {
        self.with_shared("the kept transposes", |shared| {
            Ok(Shared {
                kept_transposes: kept,
                ..shared
            })
        })
    }

    /// The same builder with 8-bit products (`with_products`) only on the Linears where
    /// they pay at the rows `rows` gives (`nn::products_pay`); the others load as without
    /// them (FP8 codes decoded at each use where `with_fp8`, else the model's dtype). Set
    /// before the builder is shared.
    pub fn with_product_rows(self, rows: super::ProductRows) -> Result<Self> {
        self.with_shared("the products' rows", |shared| {
            Ok(Shared {
                product_rows: Some(rows),
                ..shared
            })
        })
    }

    /// Whether Linear weights load as FP8 (`with_fp8`).
    pub fn fp8(&self) -> bool {
        self.shared.fp8
    }

    /// The same builder told the GGML types of a GGUF checkpoint's quantized tensors, by
    /// model key (`models::Checkpoint::ggml_types`): a shapes-only build then hands out their
    /// Linear weights packed, at their packed size, as a load from the file would. Set
    /// before the builder is shared.
    pub fn with_ggml_types(self, types: Arc<HashMap<String, GgmlType>>) -> Result<Self> {
        self.with_shared("the GGML types", |shared| {
            Ok(Shared {
                ggml_types: Some(types),
                ..shared
            })
        })
    }

    /// The (out, in) a packed Linear weight handed out under `key` stands for (its tensor
    /// holds the packed words); `None` for a dense tensor.
    pub fn packed_dims(&self, key: &str) -> Result<Option<(usize, usize)>> {
        Ok(self
            .shared
            .packed
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?
            .get(key)
            .copied())
    }

    /// The same source with the LoRA file `merge` merged into the weights it adapts as they
    /// load (W + s · B A, in f32, then the builder's dtype). Set before the builder is shared.
    pub fn with_merge(self, merge: Arc<super::LoraMerge>) -> Result<Self> {
        self.with_shared("a LoRA merge", |shared| {
            Ok(Shared {
                merge: Some(merge),
                ..shared
            })
        })
    }

    /// The same source with LoRA adapters planned: each `Linear` built from it whose key
    /// path matches the adapters' targets gets one. Set before the builder is shared.
    pub fn with_adapters(self, adapters: Arc<Adapters>) -> Result<Self> {
        self.with_shared("adapters", |shared| {
            Ok(Shared {
                adapters: Some(adapters),
                ..shared
            })
        })
    }

    /// The same source with the weights `host` owns kept where it keeps them: each such key
    /// is loaded, handed to `host` and handed out as the handle it returns (a block
    /// streamer keeps a streamed block's weights in host memory and returns a released
    /// handle that it fetches around the block's runs). Set before the builder is shared.
    pub fn with_host_weights(self, host: Arc<dyn HostWeights>) -> Result<Self> {
        self.with_shared("the host weights", |shared| {
            if host.device() != &shared.device {
                return Err(Error::DeviceMismatch {
                    op: "VarBuilder::with_host_weights",
                    lhs: shared.device.location(),
                    rhs: host.device().location(),
                });
            }
            Ok(Shared {
                host: Some(host),
                ..shared
            })
        })
    }

    /// The adapter file merged into the weights this builder loads, if any.
    pub fn merge(&self) -> Option<&Arc<super::LoraMerge>> {
        self.shared.merge.as_ref()
    }

    /// The adapters planned on this builder.
    pub fn adapters(&self) -> Option<&Arc<Adapters>> {
        self.shared.adapters.as_ref()
    }

    /// The adapter for the layer of `shape` (with a bias or not) at this prefix, if one is
    /// planned for it.
    pub fn adapter(&self, shape: LayerShape, bias: bool) -> Result<Option<Arc<dyn Adapter>>> {
        match &self.shared.adapters {
            Some(a) => a.for_layer(&self.prefix.join("."), shape, bias, self.device()),
            None => Ok(None),
        }
    }

    /// The source key(s) of model key `key`.
    pub fn source_of(&self, key: &str) -> Option<KeySource> {
        match &self.shared.map {
            Some(map) => map(key),
            None => Some(KeySource::Key(key.to_string())),
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

    /// The dtype parameters are returned in.
    pub fn dtype(&self) -> DType {
        self.shared.dtype
    }

    /// The device parameters are placed on.
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
                let src = self.source_of(key)?;
                let first = *src.keys().first()?;
                index.get(first).map(|&i| files[i].path().to_path_buf())
            }
            Source::Gguf(f) => Some(f.path().to_path_buf()),
            Source::Tensors(_) | Source::Shapes(_) | Source::Random { .. } => None,
        }
    }

    fn source_has(&self, key: &str) -> bool {
        match &self.shared.source {
            Source::Files { index, .. } => index.contains_key(key),
            Source::Gguf(f) => f.info(key).is_some(),
            Source::Tensors(t) => t.contains_key(key),
            Source::Shapes(s) => s.contains_key(key),
            Source::Random { .. } => false,
        }
    }

    /// Whether the source has `name` under this prefix (every source key it maps to).
    pub fn contains(&self, name: &str) -> bool {
        self.source_of(&self.key(name))
            .is_some_and(|s| s.keys().iter().all(|k| self.source_has(k)))
    }

    /// The source's shape of `name` under this prefix, read from the header, without loading.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.shape_of_key(&self.source_of(&self.key(name))?)
    }

    fn raw_shape(&self, key: &str) -> Option<Vec<usize>> {
        match &self.shared.source {
            Source::Files { files, index } => index
                .get(key)
                .and_then(|&i| files[i].info(key))
                .map(|i| i.shape.clone()),
            Source::Gguf(f) => f.info(key).map(|i| i.shape.clone()),
            Source::Tensors(t) => t.get(key).map(|t| t.dims().to_vec()),
            Source::Shapes(s) => s.get(key).cloned(),
            Source::Random { .. } => None,
        }
    }

    /// Every key of the source, sorted (the raw layout, before any key map).
    pub fn source_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = match &self.shared.source {
            Source::Files { index, .. } => index.keys().cloned().collect(),
            Source::Gguf(f) => f.names().map(str::to_string).collect(),
            Source::Tensors(t) => t.keys().cloned().collect(),
            Source::Shapes(s) => s.keys().cloned().collect(),
            Source::Random { .. } => vec![],
        };
        keys.sort();
        keys
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
        let mut loaded = self.loaded()?;
        if let Some(t) = loaded.get(&key) {
            return self.same_shape(&key, t, &shape);
        }
        let t = self.assemble(&key, &shape)?;
        let t = self.place(&key, t)?;
        loaded.insert(key, t.clone());
        Ok(t)
    }

    /// The weight `name` of a Linear layer, (out, in): as `get` gives it, or packed
    /// (`nn::Packing`, decoded at each use): a quantized tensor of a GGUF file as its blocks
    /// (`ggml_type_of`), else, when the builder stores FP8 (`with_fp8`) and `in_dim` is a
    /// multiple of 4, its FP8 E4M3 codes (out, in / 4) u32 and per-row scales (out) f32
    /// (`backend::fp8`), quantized here on the host, or the file's own codes and scales where
    /// it holds the weight in FP8 with a scale for the tensor or a row (`nn::scaled_fp8`). FP8
    /// scales are kept under the key `<name>.fp8_scale`. Every packed weight's (out, in) is
    /// recorded (`packed_dims`).
    pub fn get_linear_weight(
        &self,
        out_dim: usize,
        in_dim: usize,
        name: &str,
    ) -> Result<(Tensor, Option<Packing>)> {
        use crate::backend::fp8;
        let key = self.key(name);
        if let Some(ty) = self.ggml_type_of(&key, out_dim, in_dim) {
            return self.get_ggml_weight(&key, ty, out_dim, in_dim);
        }
        // 8-bit products where they pay at the run's rows (`with_product_rows`).
        let products = self.shared.products.filter(|&code| {
            super::products_pay(
                self.shared.product_rows.as_ref(),
                &key,
                code,
                (out_dim, in_dim),
            )
        });
        let stored8 = self.shared.fp8 || products.is_some();
        let code = products.unwrap_or_default();
        let products = products.is_some();
        // Int8 products' rotation, where the products run (widths the tensor cores take).
        let rotation = match (code, products && self.shared.int8_rotation) {
            (crate::backend::fp8::Code8::Int8, true)
                if super::eight_bit_widths(out_dim, in_dim) =>
            {
                crate::backend::int8::rotation_block(in_dim).unwrap_or(0)
            }
            _ => 0,
        };
        if !stored8 || in_dim % fp8::CODES_PER_WORD != 0 {
            return Ok((self.get((out_dim, in_dim), name)?, None));
        }
        self.note_packed(&key, (out_dim, in_dim))?;
        let scale_key = format!("{key}.fp8_scale");
        let (codes_shape, scale_shape) = (
            Shape::from((out_dim, in_dim / fp8::CODES_PER_WORD)),
            Shape::from(out_dim),
        );
        let mut loaded = self.loaded()?;
        if let (Some(c), Some(sc)) = (loaded.get(&key), loaded.get(&scale_key)) {
            return Ok((
                self.same_shape(&key, c, &codes_shape)?,
                Some(Packing::Fp8 {
                    scale: self.same_shape(&scale_key, sc, &scale_shape)?,
                    code,
                    rotation,
                    products,
                    kept: self.fp8_kept(&key, None)?,
                }),
            ));
        }
        if self.shared.shapes_only {
            let (c, sc) = (
                placeholder(DType::U32, &codes_shape, &self.shared.device)?,
                placeholder(DType::F32, &scale_shape, &self.shared.device)?,
            );
            loaded.insert(key, c.clone());
            loaded.insert(scale_key, sc.clone());
            return Ok((
                c,
                Some(Packing::Fp8 {
                    scale: sc,
                    code,
                    rotation,
                    products,
                    kept: super::Fp8Kept::streamed(),
                }),
            ));
        }
        if let Some((codes, scales)) = self.stored_fp8(&key, out_dim, in_dim)? {
            // The file's own FP8 values, as they are for FP8; for int8 decoded and quantized
            // again (a second rounding).
            let (codes, scales) = match code {
                crate::backend::fp8::Code8::E4m3 => (codes, scales),
                crate::backend::fp8::Code8::Int8 => {
                    let mut values = fp8::dequantize_rows_as(
                        crate::backend::fp8::Code8::E4m3,
                        &codes,
                        &scales,
                        in_dim,
                    );
                    if rotation > 0 {
                        crate::backend::int8::rotate_blocks(&mut values, rotation);
                    }
                    fp8::quantize_rows_as(code, &values, out_dim, in_dim)
                        .map_err(|msg| self.err(&key, format!("int8 quantization: {msg}")))?
                }
            };
            let dev = &self.shared.device;
            let (codes, resident) =
                self.place_resident(&key, Tensor::from_vec(codes, codes_shape, dev)?)?;
            let scales = self.place(&scale_key, Tensor::from_vec(scales, scale_shape, dev)?)?;
            let kept = self.fp8_kept(&key, Some(resident))?;
            loaded.insert(key, codes.clone());
            loaded.insert(scale_key, scales.clone());
            return Ok((
                codes,
                Some(Packing::Fp8 {
                    scale: scales,
                    code,
                    rotation,
                    products,
                    kept,
                }),
            ));
        }
        let shape = Shape::from((out_dim, in_dim));
        // Read on the host where the files hold it as plain floats; else assembled on the
        // device and brought back in its own dtype (half the bytes of f32 for bf16).
        let mut host: Vec<f32> = match self.host_values(&key, &shape)? {
            Some(v) => v,
            None => {
                use rayon::prelude::*;
                let w = self.assemble(&key, &shape)?;
                match w.to_host()? {
                    crate::CpuStorage::F32(v) => v,
                    crate::CpuStorage::BF16(v) => v.par_iter().map(|x| x.to_f32()).collect(),
                    crate::CpuStorage::F16(v) => v.par_iter().map(|x| x.to_f32()).collect(),
                    other => other.to_f64_vec().into_iter().map(|x| x as f32).collect(),
                }
            }
        };
        if rotation > 0 {
            // W H, a row (an output channel) at a time.
            use rayon::prelude::*;
            host.par_chunks_mut(in_dim.max(1))
                .for_each(|r| crate::backend::int8::rotate_blocks(r, rotation));
        }
        let (codes, scales) = fp8::quantize_rows_as(code, &host, out_dim, in_dim)
            .map_err(|msg| self.err(&key, format!("{} quantization: {msg}", code.name())))?;
        let dev = &self.shared.device;
        let codes = Tensor::from_vec(codes, codes_shape, dev)?;
        let scales = Tensor::from_vec(scales, scale_shape, dev)?;
        let (codes, resident) = self.place_resident(&key, codes)?;
        let scales = self.place(&scale_key, scales)?;
        let kept = self.fp8_kept(&key, Some(resident))?;
        loaded.insert(key, codes.clone());
        loaded.insert(scale_key, scales.clone());
        Ok((
            codes,
            Some(Packing::Fp8 {
                scale: scales,
                code,
                rotation,
                products,
                kept,
            }),
        ))
    }

    /// The GGML type in which the Linear weight of model key `key`, (out, in), stays packed:
    /// a quantized tensor of a GGUF source read under one key, of that shape, with rows of
    /// whole blocks, and no LoRA file merged into the weights (a merge needs them dense); in
    /// a shapes-only build, the type `with_ggml_types` gave for the key.
    fn ggml_type_of(&self, key: &str, out_dim: usize, in_dim: usize) -> Option<GgmlType> {
        if self.shared.merge.is_some() {
            return None;
        }
        let ty = match (&self.shared.source, &self.shared.ggml_types) {
            (_, Some(types)) if self.shared.shapes_only => *types.get(key)?,
            (Source::Gguf(f), _) => {
                let KeySource::Key(k) = self.source_of(key)? else {
                    return None;
                };
                let info = f.info(&k)?;
                if info.shape != [out_dim, in_dim] {
                    return None;
                }
                info.ty
            }
            _ => return None,
        };
        (ty.is_quantized() && in_dim % ty.block_values() == 0).then_some(ty)
    }

    /// A Linear weight kept as its GGUF blocks (`ggml_type_of` chose `ty`): the blocks packed
    /// into (words) u32, placed like any weight (a streamed block's in host memory).
    fn get_ggml_weight(
        &self,
        key: &str,
        ty: GgmlType,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<(Tensor, Option<Packing>)> {
        let packing = Packing::Ggml {
            ty,
            dims: (out_dim, in_dim),
        };
        let bytes = ty
            .bytes_of(out_dim * in_dim)
            .ok_or_else(|| self.err(key, format!("({out_dim}, {in_dim}) overflows")))?;
        let shape = Shape::from(words_for(bytes));
        self.note_packed(key, (out_dim, in_dim))?;
        let mut loaded = self.loaded()?;
        if let Some(t) = loaded.get(key) {
            return Ok((self.same_shape(key, t, &shape)?, Some(packing)));
        }
        let t = match &self.shared.source {
            _ if self.shared.shapes_only => placeholder(DType::U32, &shape, &self.shared.device)?,
            Source::Gguf(f) => {
                let src = match self.source_of(key) {
                    Some(KeySource::Key(k)) => k,
                    _ => return Err(self.err(key, "has no single source key".into())),
                };
                let (_, words) = f.packed_words(&src)?;
                self.shared
                    .used
                    .lock()
                    .map_err(|_| Error::Poisoned("parameter table"))?
                    .insert(src);
                let t = Tensor::from_vec(words, shape, &self.shared.device)?;
                self.place(key, t)?
            }
            _ => return Err(self.err(key, "is not read from a GGUF file".into())),
        };
        loaded.insert(key.to_string(), t.clone());
        Ok((t, Some(packing)))
    }

    /// What the 8-bit backward keeps of FP8 weight `key`: the one made for the key before,
    /// else a new one, which keeps the transposed codes when `resident` says the weight stays
    /// on the device, the products run in 8 bits and the builder keeps transposes
    /// (`with_kept_transposes`; `None`: not known, nothing kept).
    fn fp8_kept(&self, key: &str, resident: Option<bool>) -> Result<super::Fp8Kept> {
        let mut map = self
            .shared
            .fp8_kept
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        Ok(map
            .entry(key.to_string())
            .or_insert_with(|| match resident {
                Some(true) if self.shared.products.is_some() && self.shared.kept_transposes => {
                    super::Fp8Kept::resident()
                }
                _ => super::Fp8Kept::streamed(),
            })
            .clone())
    }

    /// `t` placed as `place` does, and whether it stays on the device (no host keeper, such
    /// as a block streamer, took it).
    fn place_resident(&self, key: &str, t: Tensor) -> Result<(Tensor, bool)> {
        match &self.shared.host {
            Some(host) => match host.place(key, &t)? {
                Some(handle) => Ok((handle, false)),
                None => Ok((t, true)),
            },
            None => Ok((t, true)),
        }
    }

    fn note_packed(&self, key: &str, dims: (usize, usize)) -> Result<()> {
        self.shared
            .packed
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?
            .insert(key.to_string(), dims);
        Ok(())
    }

    fn loaded(&self) -> Result<std::sync::MutexGuard<'_, BTreeMap<String, Tensor>>> {
        self.shared
            .loaded
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))
    }

    /// `t` (loaded earlier under `key`) if it has `shape`.
    fn same_shape(&self, key: &str, t: &Tensor, shape: &Shape) -> Result<Tensor> {
        if t.shape() != shape {
            return Err(self.err(
                key,
                format!("asked for shape {shape}, loaded earlier as {}", t.shape()),
            ));
        }
        Ok(t.clone())
    }

    /// The source of parameter `key` (shape `shape`) in this builder's checkpoint, its keys
    /// present, their shapes concatenating to `shape` (an error naming the key otherwise),
    /// and whether the source holds it without its leading size-1 dims (a GGUF file's).
    fn checked_source(&self, key: &str, shape: &Shape) -> Result<(KeySource, bool)> {
        let src = self
            .source_of(key)
            .ok_or_else(|| self.err(key, "has no source in this checkpoint layout".into()))?;
        for k in src.keys() {
            if !self.source_has(k) {
                return Err(self.missing(key, k));
            }
        }
        let found = self.shape_of_key(&src).ok_or_else(|| {
            self.err(
                key,
                format!(
                    "its sources {:?} do not concatenate along dim 0",
                    src.keys()
                ),
            )
        })?;
        if let KeySource::Cat(parts) = &src {
            for (k, rows) in parts {
                let have = self.raw_shape(k).and_then(|s| s.first().copied());
                if have != Some(*rows) {
                    return Err(self.err(
                        key,
                        format!("part '{k}' has {have:?} rows, the layout says {rows}"),
                    ));
                }
            }
        }
        // ggml writes a tensor without its outermost size-1 dims (its `ne` ends there):
        // quantized GGUF files hold Z-Image's (1, dim) pad tokens as (dim); the values are
        // the same, reshaped below.
        let squeezed = matches!(self.shared.source, Source::Gguf(_))
            && matches!(src, KeySource::Key(_))
            && found.as_slice() != shape.dims()
            && drop_leading_ones(&found) == drop_leading_ones(shape.dims());
        if found.as_slice() != shape.dims() && !squeezed {
            let from = match &src {
                KeySource::Key(k) if k == key => String::new(),
                _ => format!(" (from {:?})", src.keys()),
            };
            return Err(self.err(
                key,
                format!("expected shape {shape}, the source has {found:?}{from}"),
            ));
        }
        Ok((src, squeezed))
    }

    /// The values of model key `key` (`shape`) as `assemble` gives them (in the builder's
    /// dtype), widened to f32, read on the host straight from the files: what a weight's
    /// FP8 quantization takes, without a round trip through the device (Flux-dev's 12B
    /// values crossed the link to the device and back). `None` where the weight is read
    /// otherwise (`assemble` then): a source other than safetensors files, a LoRA to merge
    /// into it, a part held as FP8 with its scales or in a dtype other than f32, bf16 or f16.
    fn host_values(&self, key: &str, shape: &Shape) -> Result<Option<Vec<f32>>> {
        use rayon::prelude::*;
        let Source::Files { files, index } = &self.shared.source else {
            return Ok(None);
        };
        if self.shared.merge.is_some() || self.shared.shapes_only {
            return Ok(None);
        }
        // Each value rounded to the builder's dtype, as the device's read casts it; a float
        // dtype only.
        let dtype = self.shared.dtype;
        let round: fn(f32) -> f32 = match dtype {
            DType::BF16 => |x| half::bf16::from_f32(x).to_f32(),
            DType::F16 => |x| half::f16::from_f32(x).to_f32(),
            DType::F32 | DType::F64 => |x| x,
            DType::U32 => return Ok(None),
        };
        // (A tensor held squeezed is a GGUF file's: never here.)
        let (src, _) = self.checked_source(key, shape)?;
        let mut parts = Vec::new();
        for k in src.keys() {
            let i = *index.get(k).ok_or_else(|| self.missing(key, k))?;
            let plain = files[i]
                .info(k)
                .is_some_and(|info| matches!(info.dtype.as_str(), "F32" | "BF16" | "F16"));
            if !plain || super::scaled_fp8::scaled_fp8(files, index, k)?.is_some() {
                return Ok(None);
            }
            parts.push((i, k));
        }
        let mut values: Vec<f32> = Vec::with_capacity(shape.elem_count());
        for (i, k) in parts {
            crate::progress::tick();
            match files[i].host(k)? {
                crate::CpuStorage::F32(v) => values.par_extend(v.into_par_iter().map(round)),
                crate::CpuStorage::BF16(v) => {
                    values.par_extend(v.into_par_iter().map(|x| round(x.to_f32())))
                }
                crate::CpuStorage::F16(v) => {
                    values.par_extend(v.into_par_iter().map(|x| round(x.to_f32())))
                }
                _ => return Ok(None),
            }
        }
        if values.len() != shape.elem_count() {
            return Err(self.err(
                key,
                format!("{} values read for shape {shape}", values.len()),
            ));
        }
        if let KeySource::SwapHalves(_) = &src {
            let n = shape.dims().first().copied().unwrap_or(0);
            if n % 2 != 0 {
                return Err(self.err(key, format!("cannot swap halves of {n} rows")));
            }
            let half = values.len() / 2;
            values.rotate_left(half);
        }
        self.mark_used(&src.keys())?;
        Ok(Some(values))
    }

    /// The tensor of model key `key` read from the source (through the key map), checked
    /// against `shape`, in the builder's dtype on its device; nothing recorded as loaded.
    fn assemble(&self, key: &str, shape: &Shape) -> Result<Tensor> {
        let key = key.to_string();
        let shape = shape.clone();
        if self.shared.shapes_only {
            return placeholder(self.shared.dtype, &shape, &self.shared.device);
        }
        if let Source::Random { seed, std } = self.shared.source {
            let h = key_hash(&key);
            return Tensor::randn_normal(
                0.0,
                std,
                shape,
                self.shared.dtype,
                &self.shared.device,
                h ^ seed,
            );
        }
        let (src, squeezed) = self.checked_source(&key, &shape)?;
        if let Source::Shapes(_) = self.shared.source {
            // Checked like a file; nothing to read (`from_shapes`).
            self.mark_used(&src.keys())?;
            return placeholder(self.shared.dtype, &shape, &self.shared.device);
        }
        let parts = src
            .keys()
            .iter()
            .map(|k| self.read(k))
            .collect::<Result<Vec<_>>>()?;
        let t = {
            let _g = crate::no_grad();
            match &src {
                KeySource::Key(_) => parts[0].clone(),
                KeySource::Cat(_) => Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?,
                KeySource::SwapHalves(_) => {
                    let n = parts[0].dims()[0];
                    if n % 2 != 0 {
                        return Err(self.err(&key, format!("cannot swap halves of {n} rows")));
                    }
                    let (lo, hi) = (
                        parts[0].narrow(0, 0, n / 2)?,
                        parts[0].narrow(0, n / 2, n / 2)?,
                    );
                    Tensor::cat(&[&hi, &lo], 0)?
                }
            }
            .contiguous()?
            .detach()
        };
        // The parts read go here, so that a merge below finds the tensor alone on its
        // storage and changes it in place.
        drop(parts);
        let t = match squeezed {
            true => {
                let r = t.reshape(shape.clone())?;
                drop(t);
                r
            }
            false => t,
        };
        // Linear weights and convolutions' (out, in, kh, kw), and biases (full fine-tuning's
        // `diff_b`), changed in place: the merge's copies are freed before the next weight
        // is read, so the weights lie in device memory as an unmerged load leaves them.
        let t = match &self.shared.merge {
            Some(m) => {
                let t = t.owned()?;
                m.merge_into(&key, &t)?;
                t
            }
            None => t,
        };
        self.mark_used(&src.keys())?;
        Ok(t)
    }

    /// A loaded tensor where it lives: where `with_host_weights`' owner keeps it (the device
    /// copy is dropped here), else as loaded.
    fn place(&self, key: &str, t: Tensor) -> Result<Tensor> {
        match &self.shared.host {
            Some(host) => Ok(host.place(key, &t)?.unwrap_or(t)),
            None => Ok(t),
        }
    }

    fn missing(&self, key: &str, source_key: &str) -> Error {
        let what = if key == source_key {
            String::new()
        } else {
            format!(" (looked up as '{source_key}')")
        };
        let file = match &self.shared.source {
            Source::Files { files, .. } => files
                .iter()
                .map(|f| f.path().display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            Source::Gguf(f) => f.path().display().to_string(),
            Source::Tensors(_) => "the tensors given".into(),
            Source::Shapes(_) => "the shapes given".into(),
            Source::Random { .. } => "a random source".into(),
        };
        Error::Param {
            key: key.to_string(),
            file: None,
            msg: format!("missing{what} from {file}"),
        }
    }

    fn shape_of_key(&self, src: &KeySource) -> Option<Vec<usize>> {
        let mut shapes = src
            .keys()
            .iter()
            .map(|k| self.raw_shape(k))
            .collect::<Option<Vec<_>>>()?;
        let mut out = shapes.remove(0);
        for s in shapes {
            if s.len() != out.len() || s.is_empty() || s[1..] != out[1..] {
                return None;
            }
            out[0] += s[0];
        }
        Some(out)
    }

    /// One source tensor in the builder's dtype, on its device.
    fn read(&self, key: &str) -> Result<Tensor> {
        let (dtype, device) = (self.shared.dtype, &self.shared.device);
        match &self.shared.source {
            Source::Files { files, index } => {
                let i = *index.get(key).ok_or_else(|| self.missing(key, key))?;
                // FP8 weights with their scales (`nn::scaled_fp8`: BFL's and ComfyUI's
                // conventions) decode to the values they stand for.
                match super::scaled_fp8::scaled_fp8(files, index, key)? {
                    Some(w) => {
                        self.mark_used(&w.beside)?;
                        w.dense(files, device, dtype)
                    }
                    None => files[i].load_as(key, device, dtype),
                }
            }
            Source::Gguf(f) => f.load_as(key, device, dtype),
            Source::Shapes(s) => {
                let shape = s.get(key).ok_or_else(|| self.missing(key, key))?;
                placeholder(dtype, &Shape::from(shape.clone()), device)
            }
            Source::Random { .. } => Err(self.missing(key, key)),
            Source::Tensors(map) => {
                let t = map.get(key).ok_or_else(|| self.missing(key, key))?;
                let _g = crate::no_grad();
                Ok(t.to_dtype(dtype)?.to_device(device)?.detach())
            }
        }
    }

    /// Counts `keys` of the source as read.
    fn mark_used<S: AsRef<str>>(&self, keys: &[S]) -> Result<()> {
        self.shared
            .used
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?
            .extend(keys.iter().map(|k| k.as_ref().to_string()));
        Ok(())
    }

    /// A Linear weight of a file that holds it as FP8 codes with a scale for the tensor or
    /// for each row (`nn::scaled_fp8`), as FLAME's FP8 storage: the file's codes and scales,
    /// read as they are (no second rounding). `None` where the weight is read otherwise: a
    /// tensor of another dtype, one assembled from several (a diffusers split), or with a
    /// LoRA to merge into it.
    fn stored_fp8(
        &self,
        key: &str,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        let Source::Files { files, index } = &self.shared.source else {
            return Ok(None);
        };
        if self.shared.merge.is_some() {
            return Ok(None);
        }
        let Some(KeySource::Key(k)) = self.source_of(key) else {
            return Ok(None);
        };
        if self.raw_shape(&k).as_deref() != Some(&[out_dim, in_dim][..]) {
            return Ok(None);
        }
        let Some(w) = super::scaled_fp8::scaled_fp8(files, index, &k)? else {
            return Ok(None);
        };
        let stored = w.codes(files, out_dim, in_dim)?;
        self.mark_used(&w.beside)?;
        self.mark_used(&[k])?;
        Ok(Some(stored))
    }

    /// Every key of the source that no layer read, sorted.
    pub fn unused_keys(&self) -> Result<Vec<String>> {
        let used = self
            .shared
            .used
            .lock()
            .map_err(|_| Error::Poisoned("parameter table"))?;
        Ok(self
            .source_keys()
            .into_iter()
            .filter(|k| !used.contains(k))
            .collect())
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

/// A zero-stride view of one zero of `dtype` on `device` with `shape` (one element of
/// memory).
fn placeholder(dtype: DType, shape: &Shape, device: &Device) -> Result<Tensor> {
    Tensor::zeros((), dtype, device)?.broadcast_as(shape.clone())
}

/// `dims` without its outermost size-1 dims.
fn drop_leading_ones(dims: &[usize]) -> &[usize] {
    let n = dims.iter().take_while(|&&d| d == 1).count();
    &dims[n..]
}
