//! One model trait and one loader for every diffusion model.
//!
//! A model family is a folder under `src/models` that implements two traits and adds one
//! line to [`crate::models::FAMILIES`]:
//! - [`ModelSpec`]: how its config is read (a diffusers `config.json` or a single file's
//!   shapes), its diffusers key map, its block names, and its constructor. From these the
//!   one loader, [`load_as`], goes from a path to a model with adapters attached and blocks
//!   planned (checkpointed, streamed) in one place for every family.
//! - [`DiffusionModel`]: what a training step or a sampler needs from the loaded model,
//!   object-safe: the per-sample inputs it takes (names and shapes, checked against data
//!   before anything runs), its noise objective, and one prediction call.

use super::checkpoint::{Checkpoint, Format};
use super::spec::PipelineSpec;
use crate::diffusion::Ddpm;
use crate::memory::{BlockCost, BlockExec, BlockShape, BlockStreamer, MemoryProfile, Plan};
use crate::nn::adapter::ToolNames;
use crate::nn::ProductRows;
use crate::nn::{Adapters, KeyMap, LoraMerge, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;
use std::sync::Arc;

/// One size rule of a per-sample input tensor. Every size must also be at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// Exactly this many.
    Exactly(usize),
    /// Any positive multiple of this (1: any positive size).
    MultipleOf(usize),
}

impl Size {
    /// Whether `n` obeys the rule.
    pub fn admits(self, n: usize) -> bool {
        match self {
            Size::Exactly(m) => n == m,
            Size::MultipleOf(m) => n > 0 && n % m.max(1) == 0,
        }
    }
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Size::Exactly(m) => write!(f, "{m}"),
            Size::MultipleOf(1) => write!(f, "_"),
            Size::MultipleOf(m) => write!(f, "{m}k"),
        }
    }
}

/// A tensor every training sample holds, without the batch dim: its name in the sample file
/// and a size rule per dim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Input {
    /// The tensor's name in a sample file (`latents`, `context`, ...).
    pub name: &'static str,
    /// One rule per dim.
    pub dims: Vec<Size>,
}

impl Input {
    /// An input of `name` with the given dim rules.
    pub fn new(name: &'static str, dims: Vec<Size>) -> Self {
        Input { name, dims }
    }

    /// `None` when `shape` obeys every rule, else why not ("shape [..], the model needs [..]").
    pub fn mismatch(&self, shape: &[usize]) -> Option<String> {
        let ok = shape.len() == self.dims.len()
            && shape.iter().zip(&self.dims).all(|(&n, r)| r.admits(n));
        if ok {
            return None;
        }
        let want: Vec<String> = self.dims.iter().map(|r| r.to_string()).collect();
        Some(format!(
            "shape {shape:?}, the model needs [{}] (_: any positive size, 2k: a positive \
             multiple of 2)",
            want.join(", ")
        ))
    }
}

/// How a family is trained: the noise process and what its prediction means.
#[derive(Clone, Debug)]
pub enum Objective {
    /// Rectified flow (Flux, SD3.5): x_t = (1 - t) x0 + t ε with t ∈ (0, 1), and the model
    /// predicts the velocity ε - x0 from (x_t, t).
    FlowMatching,
    /// DDPM (SDXL) with this noise schedule; the model takes integer timesteps.
    Ddpm(Ddpm),
}

/// What training and sampling need from a loaded diffusion model (object-safe).
pub trait DiffusionModel: Send + Sync {
    /// The family it belongs to.
    fn family(&self) -> &'static Family;
    /// The per-sample inputs in the order `predict` takes them; the first is `latents`
    /// (C, H, W).
    fn inputs(&self) -> Vec<Input>;
    /// Limits beyond the per-dim rules of `inputs` (e.g. a largest latent size), checked on
    /// the shapes of a sample in `inputs` order; `Err` says what is wrong.
    fn check_shapes(&self, shapes: &[Vec<usize>]) -> std::result::Result<(), String> {
        let _ = shapes;
        Ok(())
    }
    /// The noise objective.
    fn objective(&self) -> Objective;
    /// The prediction for noisy latents `xt` (B, C, H, W) at `t` (B,) (flow matching: in
    /// (0, 1); DDPM: timesteps as f32), given the batch's other inputs `cond` in `inputs`
    /// order (each (B, ...)) and the guidance scale of guidance-distilled models (others
    /// ignore it). Returns (B, C, H, W).
    fn predict(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], guidance: f64) -> Result<Tensor>;
    /// [`predict`](Self::predict) conditioned on reference images as well (FLUX.2 \[klein\]'s
    /// editing): `refs` are their latents, each (B, C, h_i, w_i) in the latent space of `xt`,
    /// any count and sizes. With none this is `predict`; a model of a family that takes no
    /// references ([`Family::references`]) refuses any.
    fn predict_with_references(
        &self,
        xt: &Tensor,
        t: &Tensor,
        cond: &[Tensor],
        refs: &[Tensor],
        guidance: f64,
    ) -> Result<Tensor> {
        if refs.is_empty() {
            return self.predict(xt, t, cond, guidance);
        }
        Err(Error::Config {
            path: None,
            msg: format!(
                "{} takes no reference images ({} given; FLUX.2 [klein] does)",
                self.family().name,
                refs.len()
            ),
        })
    }
    /// Announces the inputs of a coming `predict` (`xt` may be any latents of its shape and
    /// dtype: the conditioning depends on `t`, `cond` and `guidance` only). A model whose
    /// streamed blocks compute their conditioning products on the host
    /// (`memory.host_products`) starts them now, so the forward finds them done (a trainer
    /// calls this between one step's forward and its backward, which leaves the host idle);
    /// that forward compares its conditioning with the announced one bit for bit, so a
    /// wrong announcement costs time, never values. Nothing by default.
    fn prepare(&self, xt: &Tensor, t: &Tensor, cond: &[Tensor], guidance: f64) -> Result<()> {
        let _ = (xt, t, cond, guidance);
        Ok(())
    }
    /// Whether `predict` reads its `guidance` argument (guidance-distilled models: Flux dev).
    fn guidance_input(&self) -> bool {
        false
    }
    /// The image tokens the transformer sees for latents of height `h` and width `w`, as
    /// Flux's resolution-dependent timestep shift counts them: 2x2 patches of the latents by
    /// default (Flux, SD3); a model whose latents are the patches already (FLUX.2) counts
    /// each position.
    fn image_tokens(&self, h: usize, w: usize) -> usize {
        (h / 2) * (w / 2)
    }
    /// Sets how its blocks run (the loader applies `LoadOptions::memory` through it; the
    /// block names are `ModelSpec::block_prefixes_of` of the config).
    fn set_exec(&mut self, exec: BlockExec);
    /// How its blocks run (`set_exec`'s).
    fn exec(&self) -> &BlockExec;
}

/// Everything a load needs besides the path.
#[derive(Clone)]
pub struct LoadOptions {
    /// The dtype of the weights on the device.
    pub dtype: DType,
    /// Where the model runs.
    pub device: Device,
    /// Adapters to attach to the Linear layers they target; `None` loads the bare model.
    pub adapters: Option<Arc<Adapters>>,
    /// A diffusers `config.json` (parsed) that replaces the checkpoint's own or the one a
    /// single file's shapes give (for single files whose shapes do not pin the config down).
    pub config: Option<serde_json::Value>,
    /// Block checkpointing and streaming: a plan settled for this model
    /// (`MemoryProfile::settle`; the default runs every block resident).
    pub memory: Plan,
    /// Store the Linear weights as FP8 E4M3 with per-row scales (`VarBuilder::with_fp8`);
    /// the rest stays in `dtype`, the compute dtype.
    pub fp8: bool,
    /// The Linears' products in 8 bits, in this code (`VarBuilder::with_products`: FP8 E4M3
    /// or int8): their weights load as its codes whatever `fp8` says. `None`: in `dtype`.
    pub products: Option<crate::backend::fp8::Code8>,
    /// With int8 products, their inner axis rotated (`VarBuilder::with_int8_rotation`, the
    /// outlier treatment); off by default.
    pub int8_rotation: bool,
    /// A LoRA file merged into the weights as they load (sampling with a trained LoRA);
    /// every tensor of it must find its layer.
    pub merge: Option<Arc<LoraMerge>>,
    /// The run's shapes (its largest sample and its batch): with `products`, only the block
    /// Linears whose products pay in 8 bits at these rows take them ([`with_run_rows`],
    /// `nn::products_pay`; a training run's largest bucket). `None`: every Linear whose
    /// widths the tensor cores take.
    pub run: Option<RunShape>,
}

/// Why FP8 products cannot run for the model at `path` on `device` ([`products_refusal`] for
/// E4M3), or `None` when they can.
pub fn fp8_products_refusal(path: &Path, device: &Device) -> Option<String> {
    products_refusal(crate::backend::fp8::Code8::E4m3, path, device)
}

/// Why 8-bit products in `code` (`LoadOptions::products`) cannot run for the model at `path`
/// on `device`, or `None` when they can: they need float or FP8 weights (a GGUF file's packed
/// blocks are decoded for each product) and, on a GPU, tensor cores for the code (FP8:
/// compute capability 8.9 or later, Ada and Hopper; int8: 7.5 or later, Turing on). The CPU
/// reference computes them on any machine.
pub fn products_refusal(
    code: crate::backend::fp8::Code8,
    path: &Path,
    device: &Device,
) -> Option<String> {
    if path.is_file() && crate::gguf::is_gguf(path) {
        return Some(format!(
            "needs float or FP8 weights, and {} is a GGUF file (its blocks are decoded for \
             each product)",
            path.display()
        ));
    }
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)] // the only variant in builds without cpu-ref
    if let Device::Cuda(d) = device {
        let cc = (d.compute_capability_major(), d.compute_capability_minor());
        let need = code.min_compute_capability();
        if cc < need {
            let which = match code {
                crate::backend::fp8::Code8::E4m3 => "FP8 tensor cores (Ada, Hopper)",
                crate::backend::fp8::Code8::Int8 => "int8 tensor cores (Turing on)",
            };
            return Some(format!(
                "needs {which}: compute capability {}.{} or later; cuda:{} is {}.{}",
                need.0,
                need.1,
                d.ordinal(),
                cc.0,
                cc.1
            ));
        }
    }
    let _ = (device, code);
    None
}

impl LoadOptions {
    /// Weights in `dtype` on `device`, no adapters, every block resident.
    pub fn new(dtype: DType, device: &Device) -> Self {
        LoadOptions {
            dtype,
            device: device.clone(),
            adapters: None,
            config: None,
            memory: Plan::default(),
            fp8: false,
            products: None,
            int8_rotation: false,
            merge: None,
            run: None,
        }
    }

    /// With adapters attached.
    pub fn with_adapters(mut self, adapters: Arc<Adapters>) -> Self {
        self.adapters = Some(adapters);
        self
    }
}

/// The build side of a family: config reading, key names, construction. [`load_as`] turns
/// these into the one loader.
pub trait ModelSpec: DiffusionModel + Sized + 'static {
    /// The family's config type.
    type Config: Clone;
    /// Key endings of the blocks' Linear weights whose input is the conditioning vector
    /// (`BlockShape::conditioned`; none by default).
    const CONDITIONED: &'static [&'static str] = &[];
    /// Keys every single file of the family holds (after its prefix, bare or
    /// [`LDM_PREFIX`](super::checkpoint::LDM_PREFIX)): how a file is recognised as this family's
    /// model among others in a folder (`models::discover`).
    const SIGNATURE: &'static [&'static str];
    /// The `_class_name` of the model's diffusers `config.json`.
    const DIFFUSERS_CLASS: &'static str;
    /// The module names other trainers' LoRA files give the model's layers (ai-toolkit's,
    /// musubi-tuner's: `adapter.format`); none by default.
    const TOOL_NAMES: ToolNames = ToolNames::NONE;
    /// Whether its models condition on reference images
    /// ([`DiffusionModel::predict_with_references`]).
    const REFERENCES: bool = false;
    /// The family's registry entry.
    fn entry() -> &'static Family;
    /// From a diffusers `config.json`.
    fn config_from_diffusers(json: &serde_json::Value) -> Result<Self::Config>;
    /// From a single file's shapes (`vb` reads the file's keys after its prefix).
    fn config_from_single_file(vb: &VarBuilder) -> Result<Self::Config>;
    /// The config whose key map reads a single file before its config is known.
    fn reference_config() -> Self::Config;
    /// Checks a config.
    fn validate(config: &Self::Config) -> Result<()>;
    /// Model key -> diffusers key(s).
    fn diffusers_map(config: &Self::Config) -> KeyMap;
    /// Block prefixes in execution order.
    fn block_prefixes_of(config: &Self::Config) -> Vec<String>;
    /// Refuses a single file this family cannot read (wrong key prefix...).
    fn check_single_file(ckpt: &Checkpoint) -> Result<()> {
        let _ = ckpt;
        Ok(())
    }
    /// Builds the model from a builder over its weights.
    fn build(vb: &VarBuilder, config: &Self::Config) -> Result<Self>;
    /// The activation shape of each block (in `block_prefixes_of` order) for one sample
    /// whose inputs have the shapes `sample` (in `DiffusionModel::inputs` order, batch
    /// excluded): what the memory planner sizes activations from.
    fn block_shapes(config: &Self::Config, sample: &[Vec<usize>]) -> Result<Vec<BlockShape>>;
}

/// A model, its weight builder (for parameter lists and unused-key checks) and the key map
/// that names its weights in diffusers (for PEFT adapter files).
pub struct Loaded<M: ?Sized> {
    /// The model.
    pub model: Box<M>,
    /// The builder its weights came through.
    pub vb: VarBuilder,
    /// Model key -> diffusers key(s); for single files too (adapter files in PEFT layout use
    /// it).
    pub key_map: KeyMap,
}

/// The rows each block Linear of a model of `config` multiplies in a run of `run`'s shapes,
/// by weight key (`BlockShape::rows_of` of the block holding it; `None` outside the blocks):
/// what `nn::products_pay` decides 8-bit products by.
fn product_rows<M: ModelSpec>(config: &M::Config, run: &RunShape) -> Result<ProductRows> {
    let prefixes = M::block_prefixes_of(config);
    let shapes = M::block_shapes(config, &run.sample)?;
    let blocks: Vec<(String, BlockShape)> = prefixes.into_iter().zip(shapes).collect();
    let batch = run.batch.max(1);
    Ok(Arc::new(move |key: &str| {
        blocks
            .iter()
            .find(|(p, _)| crate::memory::under(key, p))
            .map(|(_, sh)| sh.rows_of(key, batch))
    }))
}

/// The rows of `opts.run` where `opts` asks for 8-bit products (`product_rows`): the rule
/// a model of `config` loads by.
fn run_rows<M: ModelSpec>(config: &M::Config, opts: &LoadOptions) -> Result<Option<ProductRows>> {
    match (&opts.products, &opts.run) {
        (Some(_), Some(run)) => product_rows::<M>(config, run).map(Some),
        _ => Ok(None),
    }
}

/// `vb` told the rows of `opts.run` where `opts` asks for 8-bit products (`run_rows`), as
/// every load of a model of `config` with `opts` is.
pub fn with_run_rows<M: ModelSpec>(
    vb: VarBuilder,
    config: &M::Config,
    opts: &LoadOptions,
) -> Result<VarBuilder> {
    match run_rows::<M>(config, opts)? {
        Some(rows) => vb.with_product_rows(rows),
        None => Ok(vb),
    }
}

/// The one loader: locates the checkpoint at `path` (a single file, a diffusers folder or a
/// pipeline folder), reads its config (or `config` / `opts.config`), builds the model with
/// `opts.adapters` attached and `opts.memory` applied.
pub fn load_as<M: ModelSpec>(
    path: impl AsRef<Path>,
    opts: &LoadOptions,
    config: Option<M::Config>,
) -> Result<Loaded<M>> {
    let family = M::entry();
    let (ckpt, config) = resolve::<M>(path.as_ref(), opts, config)?;
    let key_map = M::diffusers_map(&config);
    if let Some(a) = &opts.adapters {
        a.use_key_map(key_map.clone())?;
    }
    let vb = ckpt
        .var_builder(opts.dtype, &opts.device, key_map.clone())?
        .with_fp8(opts.fp8)?
        .with_products(opts.products)?
        .with_int8_rotation(opts.int8_rotation)?
        .with_kept_transposes(!opts.memory.remake_transposes)?;
    let mut vb = with_run_rows::<M>(vb, &config, opts)?;
    if let Some(a) = &opts.adapters {
        vb = vb.with_adapters(a.clone())?;
    }
    if let Some(m) = &opts.merge {
        m.set_diffusers_map(key_map.clone())?;
        vb = vb.with_merge(m.clone())?;
    }
    let prefixes = M::block_prefixes_of(&config);
    let plan = &opts.memory;
    if let Some(bad) = plan.streamed.iter().find(|p| !prefixes.contains(p)) {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "memory plan: \"{bad}\" is not a block of this {} model",
                family.name
            ),
        });
    }
    // The streamed blocks in execution order, whatever order the plan lists them in (the
    // planner's own lists are smallest first; `MemoryProfile::settle` orders them).
    let plan = Plan {
        streamed: prefixes
            .iter()
            .filter(|p| plan.streamed.contains(p))
            .cloned()
            .collect(),
        ..plan.clone()
    };
    let plan = &plan;
    let streamer = BlockStreamer::for_plan(&opts.device, plan, M::CONDITIONED)?;
    if let Some(s) = &streamer {
        vb = vb.with_host_weights(s.clone())?;
    }
    let mut model = M::build(&vb, &config)?;
    if let Some(m) = &opts.merge {
        m.check_all_used()?;
    }
    model.set_exec(BlockExec::for_plan(plan, streamer, &opts.device));
    Ok(Loaded {
        model: Box::new(model),
        vb,
        key_map,
    })
}

/// Opens the checkpoint of `M` at `path`: a single .safetensors file whose bare keys are the
/// diffusers model's (BFL's FP8 FLUX.2 [klein] files name their tensors so, and so does a
/// diffusers model's own file given alone) reads as a diffusers checkpoint, through the key
/// map; any other single file must pass the family's check.
fn open_as<M: ModelSpec>(path: &Path) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint::open(path, M::entry().subfolder)?;
    if ckpt.format == Format::SingleFile {
        if diffusers_named::<M>(&ckpt)? {
            ckpt.format = Format::Diffusers;
        } else {
            M::check_single_file(&ckpt)?;
        }
    }
    Ok(ckpt)
}

/// Whether a single .safetensors file holds `M`'s model under diffusers' names: bare keys,
/// not all of [`ModelSpec::SIGNATURE`] (some of its keys are named alike in both layouts:
/// SD3's `context_embedder.weight`), and every key the diffusers map reads for them.
fn diffusers_named<M: ModelSpec>(ckpt: &Checkpoint) -> Result<bool> {
    let [file] = ckpt.files.as_slice() else {
        return Ok(false);
    };
    if !ckpt.prefix.is_empty() || crate::gguf::is_gguf(file) {
        return Ok(false);
    }
    let f = crate::safetensors::SafeTensorsFile::open(file)?;
    Ok(!M::SIGNATURE.iter().all(|k| f.contains(k)) && diffusers_signature::<M>(&|k| f.contains(k)))
}

/// Whether a file holds a key (by name).
type HasKey<'a> = dyn Fn(&str) -> bool + 'a;

/// Whether keys `has` holds every key the diffusers map of `M` reads for its signature.
fn diffusers_signature<M: ModelSpec>(has: &HasKey<'_>) -> bool {
    let map = M::diffusers_map(&M::reference_config());
    M::SIGNATURE
        .iter()
        .all(|k| map(k).is_some_and(|src| src.keys().iter().all(|s| has(s))))
}

/// Whether a file whose keys `has` answers holds `M`'s model: its signature bare or under
/// [`LDM_PREFIX`](super::checkpoint::LDM_PREFIX), or under the diffusers model's bare names.
fn holds_as<M: ModelSpec>(has: &HasKey<'_>) -> bool {
    ["", super::checkpoint::LDM_PREFIX]
        .iter()
        .any(|p| M::SIGNATURE.iter().all(|k| has(&format!("{p}{k}"))))
        || diffusers_signature::<M>(has)
}

/// Opens the checkpoint at `path` and works out its config (given, `opts.config`, the
/// checkpoint's config.json, or its shapes), validated.
fn resolve<M: ModelSpec>(
    path: &Path,
    opts: &LoadOptions,
    config: Option<M::Config>,
) -> Result<(Checkpoint, M::Config)> {
    let ckpt = open_as::<M>(path)?;
    let config = match (config, &opts.config, &ckpt.config) {
        (Some(c), _, _) => c,
        (None, Some(json), _) | (None, None, Some(json)) => M::config_from_diffusers(json)?,
        (None, None, None) => {
            let map = M::diffusers_map(&M::reference_config());
            let vb = ckpt.var_builder(opts.dtype, &opts.device, map)?;
            M::config_from_single_file(&vb)?
        }
    };
    M::validate(&config)?;
    Ok((ckpt, config))
}

/// What the memory planner needs to know of a training run besides the model.
#[derive(Clone, Debug, PartialEq)]
pub struct RunShape {
    /// The shapes of one sample's inputs (`DiffusionModel::inputs` order, batch excluded).
    pub sample: Vec<Vec<usize>>,
    /// Samples per micro-batch.
    pub batch: usize,
    /// Optimizer state bytes per trainable value (AdamW 8, AdamW8bit about 2.03).
    pub optimizer_bytes_per_value: f64,
}

/// The memory profile of training a model of family `M` from `path` with `opts` (dtype,
/// FP8, adapters): every block's weight bytes from a build on a shapes-only builder (no
/// weight is read), its activation bytes from `ModelSpec::block_shapes`. Reads only the
/// checkpoint's header and config.
pub fn profile_as<M: ModelSpec>(
    path: &Path,
    opts: &LoadOptions,
    run: &RunShape,
) -> Result<MemoryProfile> {
    let (ckpt, config) = resolve::<M>(path, opts, None)?;
    profile_with::<M>(&config, opts, run, ckpt.ggml_types()?)
}

/// [`profile_as`] for a config in hand (no checkpoint: a model of that config with its
/// weights as `opts` would store them).
pub fn profile_config<M: ModelSpec>(
    config: &M::Config,
    opts: &LoadOptions,
    run: &RunShape,
) -> Result<MemoryProfile> {
    profile_with::<M>(config, opts, run, None)
}

/// [`profile_config`] with the GGML types of a GGUF checkpoint's quantized tensors by model
/// key (`Checkpoint::ggml_types`): those Linear weights are counted packed.
fn profile_with<M: ModelSpec>(
    config: &M::Config,
    opts: &LoadOptions,
    run: &RunShape,
    ggml_types: Option<Arc<std::collections::HashMap<String, crate::backend::ggml::GgmlType>>>,
) -> Result<MemoryProfile> {
    let config = config.clone();
    let vb = VarBuilder::shapes_only(opts.dtype, &opts.device)
        .with_fp8(opts.fp8)?
        .with_products(opts.products)?
        .with_int8_rotation(opts.int8_rotation)?;
    // The loader's rule for where 8-bit products pay, from the load's run (not `run`: the
    // model a profile sizes is the one loaded, whatever shapes the profile is for).
    let rows_rule = run_rows::<M>(&config, opts)?;
    let mut vb = match &rows_rule {
        Some(rows) => vb.with_product_rows(rows.clone())?,
        None => vb,
    };
    let ggml_keys = ggml_types.clone();
    if let Some(types) = ggml_types {
        vb = vb.with_ggml_types(types)?;
    }
    // The FP8 weights multiplied in 8 bits (`nn::layers`): 8-bit products on, widths the FP8
    // products take (`eight_bit_widths`). Their backward keeps their transposed codes while
    // they stay on the device (`nn::Fp8Kept`), the codes' bytes again.
    let eight_bit = |key: &str, t: &Tensor, packed: Option<(usize, usize)>| -> bool {
        let fp8 =
            t.dtype() == DType::U32 && !ggml_keys.as_ref().is_some_and(|m| m.contains_key(key));
        matches!((packed, opts.products), (Some((out, inp)), Some(code)) if fp8
            && crate::nn::eight_bit_widths(out, inp)
            && crate::nn::products_pay(rows_rule.as_ref(), key, code, (out, inp)))
    };
    let kept_bytes = |key: &str, t: &Tensor, packed: Option<(usize, usize)>| -> u64 {
        match eight_bit(key, t, packed) {
            true => (t.elem_count() * t.dtype().size_in_bytes()) as u64,
            false => 0,
        }
    };
    let probe_adapters = match &opts.adapters {
        Some(a) => {
            let fresh = Adapters::new(a.config.clone())?;
            // Per-projection adapters need the map before the layers are built, as the
            // loader gives it.
            fresh.use_key_map(M::diffusers_map(&config))?;
            vb = vb.with_adapters(fresh.clone())?;
            Some(fresh)
        }
        None => None,
    };
    M::build(&vb, &config)?;
    let prefixes = M::block_prefixes_of(&config);
    let shapes = M::block_shapes(&config, &run.sample)?;
    if shapes.len() != prefixes.len() {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "{}: {} block shapes for {} blocks",
                M::entry().name,
                shapes.len(),
                prefixes.len()
            ),
        });
    }
    let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    let params = vb.params()?;
    let in_block = |key: &str| prefixes.iter().any(|p| crate::memory::under(key, p));
    // The conditioned weights are forward-only (`Keep::few_rows`) unless the conditioning
    // vector needs a gradient (an adapter outside the blocks, on the embedders it comes
    // from) or the adapters read the frozen weights (DoRA, LyCORIS's weight decomposition).
    let reads_weight = match &probe_adapters {
        Some(a) => a.reads_weight()?,
        None => false,
    };
    let forward_only = match &probe_adapters {
        Some(a) => !reads_weight && a.params()?.iter().all(|(k, _)| in_block(k)),
        None => true,
    };
    // The adapted layers: a block's tails are read by no re-run's gradient unless one of
    // them is among its `tail_gates` (each kind of adapter adds to its layer's output).
    let adapted: Vec<String> = match &probe_adapters {
        Some(a) => a.params()?.into_iter().map(|(k, _)| k).collect(),
        None => Vec::new(),
    };
    let tails_unread = |sh: &BlockShape| {
        !adapted
            .iter()
            .any(|k| sh.tail_gates.iter().any(|g| k.contains(g)))
    };
    let elem = opts.dtype.size_in_bytes();
    let mut blocks: Vec<BlockCost> = prefixes
        .iter()
        .zip(&shapes)
        .map(|(p, sh)| {
            let (input_bytes, saved_bytes, attention_bytes) = sh.bytes(run.batch.max(1), elem);
            // The weights' sizes and work are added below, key by key.
            BlockCost {
                prefix: p.clone(),
                input_bytes,
                saved_bytes,
                attention_bytes,
                attention_flops: sh.attention_flops(run.batch.max(1)),
                head_dim: sh.head_dim(),
                ops: sh.ops as f64,
                views: sh.views as f64,
                ..BlockCost::default()
            }
        })
        .collect();
    let (mut other, mut other_kept) = (0u64, 0u64);
    for (key, t) in &params {
        match blocks
            .iter_mut()
            .zip(&shapes)
            .find(|(b, _)| crate::memory::under(key, &b.prefix))
        {
            Some((b, sh)) => {
                b.weight_bytes += bytes(t);
                // The link's lossless code takes bf16 tensors of a few chunks or more at a
                // byte and about 2.7 bits a value (`wire::Layout::expected`).
                let n = t.elem_count();
                let (wire, coded) =
                    if t.dtype() == DType::BF16 && n >= 2 * crate::backend::wire::CHUNK {
                        let coded = crate::backend::wire::Layout::expected(n).bytes as u64;
                        (coded, coded)
                    } else {
                        (bytes(t), 0)
                    };
                b.wire_bytes += wire;
                b.coded_bytes += coded;
                b.largest_coded = b.largest_coded.max(coded);
                // A packed weight (FP8 codes, GGML blocks) holds words standing for a
                // (out, in) weight, decoded at each use.
                let packed = vb.packed_dims(key)?;
                let dims = match packed {
                    Some((out, inp)) => vec![out, inp],
                    None => t.dims().to_vec(),
                };
                // A Linear over the conditioning vector that sees few rows (`Keep::few_rows`).
                if let (true, &[_, cols]) = (forward_only, dims.as_slice()) {
                    if sh.conditioned.iter().any(|c| key.contains(c))
                        && run.batch.max(1) * crate::autograd::FEW_ROWS <= cols
                    {
                        b.forward_only_bytes += bytes(t);
                        b.forward_only_wire += wire;
                        b.forward_only_coded += coded;
                    }
                }
                // A Linear over the model's context that sees few rows (SDXL's
                // cross-attention keys and values): the context is the model's input, so
                // only an adapter reading the frozen weight needs it in the backward.
                // Not a packed weight (FP8 codes): its Linear multiplies the codes itself.
                if let (false, None, &[out, cols]) = (reads_weight, packed, dims.as_slice()) {
                    let rows = sh.positions(key, run.batch.max(1));
                    if sh.context_keys.iter().any(|c| key.contains(c))
                        && rows * crate::autograd::FEW_ROWS <= cols
                    {
                        b.context_bytes += bytes(t);
                        b.context_wire += wire;
                        b.context_coded += coded;
                        b.context_product_bytes += (rows * out * elem) as u64;
                    }
                }
                let eight = eight_bit(key, t, packed);
                match (packed.is_some(), eight) {
                    (true, true) => b.product_bytes += bytes(t),
                    (true, false) => b.decode_bytes += bytes(t),
                    _ => {}
                }
                b.kept_bytes += kept_bytes(key, t, packed);
                b.tensors += 1;
                // A weight of two or more dimensions multiplies its positions (a Linear's
                // rows, a convolution's output positions): twice its values a position;
                // the conditioning vector's Linears see a row a sample.
                let flops = if dims.len() >= 2 {
                    let values: usize = dims.iter().product();
                    let rows = sh.rows_of(key, run.batch.max(1));
                    // An adapted layer's adapter reads its input (rows, in) and adds into its
                    // output (rows, out); its backward reads the input and the output's
                    // gradient and adds into the input's gradient.
                    let layer = key.strip_suffix(".weight").unwrap_or(key);
                    if probe_adapters
                        .as_ref()
                        .is_some_and(|a| a.config.matches(layer))
                    {
                        let out = dims[0];
                        let inp = values / out.max(1);
                        let at = |n: usize| (rows * n * elem) as u64;
                        b.adapter_forward_bytes += at(inp + 2 * out);
                        b.adapter_backward_bytes += at(2 * inp + out);
                    }
                    2.0 * rows as f64 * values as f64
                } else {
                    0.0
                };
                if dims.len() == 4 {
                    b.conv_flops += flops;
                } else {
                    b.gemm_flops += flops;
                    if eight {
                        b.product_flops += flops;
                    }
                }
                // A tail (`BlockShape::tails`): no re-run runs it, nothing keeps it.
                let tail = tails_unread(sh)
                    && key.ends_with(".weight")
                    && sh.tails.iter().any(|t| key.contains(t));
                if tail {
                    match dims.len() {
                        2 => b.tail_flops += flops,
                        _ => b.tail_conv_flops += flops,
                    }
                    b.tail_weight_bytes += bytes(t);
                }
                // A Linear's weight (out, in) narrower out than in: a down-projection, whose
                // output (positions, out) `Keep { down_projections }` keeps.
                if let (false, true, &[out, cols]) =
                    (tail, key.ends_with(".weight"), dims.as_slice())
                {
                    if cols > out {
                        b.down_weight_bytes += bytes(t);
                        b.down_bytes += (run.batch.max(1) * sh.weight_tokens * out * elem) as u64;
                        b.down_flops += flops;
                    }
                }
            }
            None => {
                other += bytes(t);
                other_kept += kept_bytes(key, t, vb.packed_dims(key)?);
            }
        }
    }
    let trainable_values: usize = match &probe_adapters {
        Some(a) => a.params()?.iter().map(|(_, t)| t.elem_count()).sum(),
        None => 0,
    };
    // The sample (latents, noise, target, prediction) and the loss, in f32, plus 256 MiB
    // for transient buffers (a decoded FP8 weight, cuBLAS workspace, matmul outputs).
    // A step's compute copies of the weights the adapters' forwards cast
    // (`nn::adapter::ComputeCopies`), in the model's dtype, live through the step.
    let copy_values: usize = match &probe_adapters {
        Some(a) => a.cast_params()?.iter().map(|(t, _)| t.elem_count()).sum(),
        None => 0,
    };
    let sample_values: usize = run.sample.iter().map(|s| s.iter().product::<usize>()).sum();
    let fixed = (4 * sample_values * run.batch.max(1) * 4) as u64
        + (256 << 20)
        + (copy_values * opts.dtype.size_in_bytes()) as u64
        + deterministic_dq_bytes(&opts.device, &shapes, run.batch.max(1));
    Ok(MemoryProfile {
        blocks,
        other_weight_bytes: other,
        other_kept_bytes: other_kept,
        trainable_bytes: (trainable_values * 4) as u64,
        optimizer_bytes: (trainable_values as f64 * run.optimizer_bytes_per_value) as u64,
        fixed_bytes: fixed,
        machine: crate::memory::Machine::REFERENCE,
        product_code: opts.products.unwrap_or_default(),
    })
}

fn profile_boxed<M: ModelSpec>(
    path: &Path,
    opts: &LoadOptions,
    run: &RunShape,
) -> Result<MemoryProfile> {
    profile_as::<M>(path, opts, run)
}

fn probe_boxed<M: ModelSpec>(
    path: &Path,
    opts: &LoadOptions,
) -> Result<Loaded<dyn DiffusionModel>> {
    let (_, config) = resolve::<M>(path, opts, None)?;
    let vb = VarBuilder::shapes_only(opts.dtype, &opts.device)
        .with_fp8(opts.fp8)?
        .with_products(opts.products)?
        .with_int8_rotation(opts.int8_rotation)?;
    let mut vb = with_run_rows::<M>(vb, &config, opts)?;
    if let Some(a) = &opts.adapters {
        a.use_key_map(M::diffusers_map(&config))?;
        vb = vb.with_adapters(a.clone())?;
    }
    Ok(Loaded {
        model: Box::new(M::build(&vb, &config)?),
        vb,
        key_map: M::diffusers_map(&config),
    })
}

fn load_boxed<M: ModelSpec>(path: &Path, opts: &LoadOptions) -> Result<Loaded<dyn DiffusionModel>> {
    let l = load_as::<M>(path, opts, None)?;
    Ok(Loaded {
        model: l.model,
        vb: l.vb,
        key_map: l.key_map,
    })
}

/// A registered model family.
pub struct Family {
    /// Its name in configs (`model.arch`).
    pub name: &'static str,
    /// Its folder in a diffusers pipeline, which is also the key prefix diffusers expects in
    /// a PEFT adapter file (`transformer`, `unet`).
    pub subfolder: &'static str,
    /// One line for listings.
    pub about: &'static str,
    /// Its text encoders, autoencoder and sampler.
    pub pipeline: &'static PipelineSpec,
    /// Keys its single files hold ([`ModelSpec::SIGNATURE`]).
    pub signature: &'static [&'static str],
    /// Its diffusers model class ([`ModelSpec::DIFFUSERS_CLASS`]).
    pub diffusers_class: &'static str,
    /// The module names of other trainers' LoRA files ([`ModelSpec::TOOL_NAMES`]).
    pub tool_names: ToolNames,
    /// Whether its models condition on reference images ([`ModelSpec::REFERENCES`]: edit
    /// training and sampling).
    pub references: bool,
    load: fn(&Path, &LoadOptions) -> Result<Loaded<dyn DiffusionModel>>,
    open: fn(&Path) -> Result<Checkpoint>,
    holds: fn(&HasKey<'_>) -> bool,
    profile: fn(&Path, &LoadOptions, &RunShape) -> Result<MemoryProfile>,
    probe: fn(&Path, &LoadOptions) -> Result<Loaded<dyn DiffusionModel>>,
}

impl Family {
    /// A family entry whose loader is `load_as::<M>`.
    pub const fn of<M: ModelSpec>(
        name: &'static str,
        subfolder: &'static str,
        about: &'static str,
        pipeline: &'static PipelineSpec,
    ) -> Family {
        Family {
            name,
            subfolder,
            about,
            pipeline,
            signature: M::SIGNATURE,
            diffusers_class: M::DIFFUSERS_CLASS,
            tool_names: M::TOOL_NAMES,
            references: M::REFERENCES,
            load: load_boxed::<M>,
            open: open_as::<M>,
            holds: holds_as::<M>,
            profile: profile_boxed::<M>,
            probe: probe_boxed::<M>,
        }
    }

    /// Whether a file whose keys `has` answers holds this family's model: its signature
    /// bare or under ComfyUI's prefix, or under the diffusers model's bare names (as
    /// [`open_checkpoint`](Self::open_checkpoint) reads such a file).
    pub fn holds_model(&self, has: &dyn Fn(&str) -> bool) -> bool {
        (self.holds)(has)
    }

    /// The checkpoint of this family's model at `path`, as its loader reads it (a single file
    /// with the diffusers model's names reads through the key map).
    pub fn open_checkpoint(&self, path: &Path) -> Result<Checkpoint> {
        (self.open)(path)
    }

    /// The model at `path` built without its weights (every parameter a zero-stride view),
    /// with `opts.adapters` attached when given (made on `opts.device`: give a set of its
    /// own, not the one the run loads with): its inputs, shape checks, adapter shapes and key
    /// map before anything is loaded.
    pub fn probe(
        &self,
        path: impl AsRef<Path>,
        opts: &LoadOptions,
    ) -> Result<Loaded<dyn DiffusionModel>> {
        (self.probe)(path.as_ref(), opts)
    }

    /// The memory profile of training a model of this family (see [`profile_as`]).
    pub fn profile(
        &self,
        path: impl AsRef<Path>,
        opts: &LoadOptions,
        run: &RunShape,
    ) -> Result<MemoryProfile> {
        (self.profile)(path.as_ref(), opts, run)
    }

    /// Loads a model of this family from `path` (see [`load_as`]).
    pub fn load(
        &self,
        path: impl AsRef<Path>,
        opts: &LoadOptions,
    ) -> Result<Loaded<dyn DiffusionModel>> {
        (self.load)(path.as_ref(), opts)
    }
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// What the deterministic mode's attention backward holds beyond the atomic one's on a GPU
/// where it is on (`cuda::deterministic`): the largest over `shapes`' attention calls, for
/// `batch` samples (`cuda::deterministic_dq_bytes`: one call's backward runs at a time); 0
/// elsewhere.
fn deterministic_dq_bytes(device: &Device, shapes: &[BlockShape], batch: usize) -> u64 {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let (Device::Cuda(c), true) = (device, crate::cuda::deterministic()) {
        return shapes
            .iter()
            .flat_map(|sh| {
                let own = (sh.attention_calls > sh.cross_calls).then_some(sh.tokens);
                let cross = (sh.cross_calls > 0).then_some(sh.context_tokens);
                [own, cross].into_iter().flatten().map(move |keys| {
                    crate::cuda::deterministic_dq_bytes(
                        batch * sh.heads,
                        sh.tokens,
                        keys,
                        sh.head_dim(),
                        c.sm_count(),
                    )
                })
            })
            .max()
            .unwrap_or(0);
    }
    let _ = (device, shapes, batch);
    0
}
