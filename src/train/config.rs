//! The `train` binary's TOML config.
//!
//! Each section is declared once, with the `section!` macro: a field's doc comment, type
//! and default make the struct, its reader and its entry in the generated reference
//! ([`TrainConfig::reference`], printed by `train --print-config` and kept in docs/CONFIG.md).
//! Unknown keys are errors naming the key and its line (the toml crate's spans). A value of
//! the wrong type or not one of its key's choices, a missing required key and every failed
//! value check ([`TrainConfig::problems`]) are problems, all reported in one error, each
//! naming its key and, read from a file, its line. Paths are relative to the config file's folder. Nothing is written before every
//! check has passed.

use super::objectives::{Prediction, TimestepSampling};
use crate::config::{in_list, problem_lines, section, show};
pub use crate::config::{line_of, KeyDoc, Problem, Section};
pub use crate::data::config::DataSection;
use crate::data::config::RawData;
pub use crate::device::DeviceChoice;
pub use crate::diffusion::loss::{HuberSchedule, LossType};
use crate::memory::{Checkpointing, Switches};
use crate::models::TextEncoderKind;
use crate::nn::{AdapterBlock, AdapterConfig, LokrSplit, LoraConfig};
pub use crate::optim::OptimizerKind;
use crate::optim::{
    AdafactorConfig, AdamConfig, AdamW8bitConfig, AdamWScheduleFreeConfig, Lion8bitConfig,
    LionConfig, OptimizerConfig, ProdigyConfig, ProdigyScheduleFreeConfig,
};
use crate::{Error, Result, Setting};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The most samples a run may draw (train.steps × grad_accum × batch_size): counts up to
/// this stay exact in the f64 figures (epochs, schedules) a run computes from them.
pub const MAX_SAMPLES_DRAWN: usize = 1 << 50;

/// `train.gpus`: the GPUs data-parallel training runs on, one process each: a list of GPU
/// numbers, `"all"`, or empty (one process on `train.device`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Gpus {
    /// These GPUs (empty: no data-parallel training).
    List(Vec<usize>),
    /// `"all"`: every GPU of the machine.
    Named(String),
}

impl Gpus {
    /// From the `train --gpus` argument: "all" or numbers separated by commas.
    pub fn parse(s: &str) -> std::result::Result<Gpus, String> {
        if s.trim() == "all" {
            return Ok(Gpus::Named("all".into()));
        }
        s.split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                p.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("--gpus {s:?}: expected \"all\" or GPU numbers like 0,1"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Gpus::List)
    }

    /// The GPU numbers, given how many the machine has (`"all"`: every one); an error for
    /// a duplicate or a GPU the machine lacks.
    pub fn resolve(&self, count: usize) -> std::result::Result<Vec<usize>, String> {
        let list = match self {
            Gpus::Named(n) if n == "all" => (0..count).collect(),
            Gpus::Named(n) => {
                return Err(format!(
                    "\"{n}\": expected a list of GPU numbers or \"all\""
                ))
            }
            Gpus::List(l) => l.clone(),
        };
        for (i, g) in list.iter().enumerate() {
            if list[..i].contains(g) {
                return Err(format!("GPU {g} is listed twice"));
            }
            if *g >= count {
                return Err(format!(
                    "GPU {g}: this machine has {count} GPUs (0 to {})",
                    count.max(1) - 1
                ));
            }
        }
        Ok(list)
    }
}

impl From<Vec<usize>> for Gpus {
    fn from(v: Vec<usize>) -> Gpus {
        Gpus::List(v)
    }
}

/// The dtype of the base model's weights on the device.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelDType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision, for GPUs without bf16: the loss is scaled (`train.loss_scale`)
    /// so that small gradients survive f16's range.
    F16,
    /// Linear weights in FP8 E4M3 with a per-output-channel scale (half of bf16's memory and
    /// streamed bytes), decoded to bf16 for each matmul; everything else in bf16.
    Fp8,
}

impl ModelDType {
    /// The dtype the model computes in: bf16 for FP8 weights (decoded at each use).
    pub fn compute_dtype(self) -> crate::DType {
        match self {
            ModelDType::F32 => crate::DType::F32,
            ModelDType::F16 => crate::DType::F16,
            ModelDType::Bf16 | ModelDType::Fp8 => crate::DType::BF16,
        }
    }
}

/// What the frozen Linears compute in (`model.compute`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelCompute {
    /// The weights' dtype (bf16 for FP8 weights, decoded at each use).
    Bf16,
    /// 8-bit products: FP8 E4M3 weights and activations on FP8 tensor cores.
    Fp8,
    /// 8-bit products: symmetric int8 weights and activations on integer tensor cores.
    Int8,
}

impl ModelCompute {
    /// The code the frozen Linears' products run in, `None` for the weights' dtype.
    pub fn code(self) -> Option<crate::backend::fp8::Code8> {
        match self {
            ModelCompute::Bf16 => None,
            ModelCompute::Fp8 => Some(crate::backend::fp8::Code8::E4m3),
            ModelCompute::Int8 => Some(crate::backend::fp8::Code8::Int8),
        }
    }
}

/// The learning-rate schedule after the warm-up (`schedule.kind`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// The peak rate to the end.
    Constant,
    /// Half a cosine from the peak to zero at the last step.
    Cosine,
}

/// How flow matching draws t (`train.timesteps`); the distributions' parameters are keys of
/// their own ([`TrainConfig::sampling`]).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TimestepKind {
    /// Uniform on (0, 1).
    Uniform,
    /// sigmoid of a normal draw (SD3's).
    LogitNormal,
    /// Uniform, then shifted by `train.timestep_shift`.
    Shift,
    /// Logit-normal, shifted by the image size as Flux's pipeline shifts its schedule.
    FluxShift,
}

/// What a step with a non-finite loss or gradient does (`train.on_nonfinite`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// End the run with an error naming the step and the tensor.
    Stop,
    /// Skip the update (at most `train.max_skipped` steps in a row).
    Skip,
}

/// How much a saved adapter's metadata says of the run (`train.metadata`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MetadataLevel {
    /// Everything kohya records, the dataset's folders, tag counts and output name included.
    Full,
    /// Without what could identify the training data (`train::metadata::IDENTIFYING_KEYS`).
    Minimal,
}

/// Where the EMA of the adapter's weights is kept (`ema.device`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EmaDevice {
    /// On the training device (the GPU), updated there with tensor ops.
    Gpu,
    /// In host memory, updated on the CPU.
    Cpu,
}

/// Dynamic loss scaling (`train.loss_scale`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LossScale {
    /// On for f16 weights, off otherwise.
    Auto,
    /// Always on.
    Dynamic,
    /// Never.
    Off,
}

/// A switch whose default the run works out (`encoders.stream_t5`, `encoders.stream_qwen3`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Toggle {
    /// As the run's sizes say.
    Auto,
    /// Always.
    On,
    /// Never.
    Off,
}

/// `memory.checkpointing`: the planner's choice, or checkpointing as given ("auto", "off",
/// "all", "every:N" or "all-but:N", every block but the first N).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum CheckpointSetting {
    /// The planner chooses with `memory.budget_gb`.
    Auto,
    /// Checkpointing as given.
    Fixed(Checkpointing),
}

impl TryFrom<String> for CheckpointSetting {
    type Error = String;
    fn try_from(c: String) -> std::result::Result<Self, String> {
        match c.as_str() {
            "auto" => Ok(CheckpointSetting::Auto),
            _ => c
                .parse()
                .map(CheckpointSetting::Fixed)
                .map_err(|e| format!("expected auto, {e}")),
        }
    }
}

impl From<CheckpointSetting> for String {
    fn from(c: CheckpointSetting) -> String {
        match c {
            CheckpointSetting::Auto => "auto".into(),
            CheckpointSetting::Fixed(c) => c.to_string(),
        }
    }
}

/// The key layout of saved adapter files.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AdapterFormat {
    /// `lora_unet_*.lora_down/lora_up/alpha` (ComfyUI, kohya, LyCORIS).
    Kohya,
    /// `transformer.*.lora_A/lora_B` (diffusers, PEFT).
    Peft,
    /// The kohya layout written for ComfyUI's reading (`Adapters::save_comfyui`): the same
    /// file but for DoRA, whose magnitudes ComfyUI divides by the norm of the frozen weight.
    Comfyui,
    /// ai-toolkit's LoRA files (FLUX.2 klein, Z-Image): `diffusion_model.*.lora_A/lora_B`
    /// over the module names it trains (`nn::adapter::Tool::AiToolkit`).
    #[serde(rename = "ai-toolkit")]
    AiToolkit,
    /// musubi-tuner's LoRA files (FLUX.2 klein: the kohya layout; Z-Image: kohya's names of
    /// diffusers' modules; `nn::adapter::Tool::Musubi`).
    Musubi,
}

impl AdapterFormat {
    /// The other trainer whose files this layout is, if it is one.
    pub fn tool(self) -> Option<crate::nn::adapter::Tool> {
        match self {
            AdapterFormat::AiToolkit => Some(crate::nn::adapter::Tool::AiToolkit),
            AdapterFormat::Musubi => Some(crate::nn::adapter::Tool::Musubi),
            AdapterFormat::Kohya | AdapterFormat::Peft | AdapterFormat::Comfyui => None,
        }
    }
}

section! {
    /// `[model]`: the base model.
    ModelSection / RawModel = "model" {
        /// The model family: "flux", "sd3", "sdxl", "flux2" (FLUX.2 klein) or "zimage" (Z-Image; `flame::models::FAMILIES`).
        arch: String,
        /// The weights: a single .safetensors file, a single .gguf file (city96's quantized
        /// Flux, FLUX.2 klein, Z-Image, SD3.5 or SDXL: Q4_0 to Q8_0 and Q2_K to Q6_K Linear
        /// weights stay packed and are decoded per matmul, everything else loads in `dtype`),
        /// a diffusers model folder or a pipeline
        /// folder, a Hugging Face cache folder (`models--org--name`: the snapshot refs/main
        /// names) or snapshot, or a ComfyUI `models/` folder or any folder of loose files, in
        /// which the diffusion model of `arch`, the text encoders and the autoencoder are found
        /// by their keys (the log says what was picked; of two candidates for one text encoder
        /// role, the one in that role's diffusers folder, `text_encoder/`, `text_encoder_2/`...,
        /// is taken; otherwise two candidates for one role are refused, naming them: set this
        /// key to the model's file, or `encoders.text` / `encoders.vae`). A diffusers model's
        /// own `diffusion_pytorch_model.safetensors`, given or found, opens as its folder
        /// (config.json, every shard).
        path: PathBuf,
        /// The dtype of the frozen weights on the device: "bf16", "f16" (for GPUs without
        /// bf16; with dynamic loss scaling), "f32", or "fp8" (Linear weights in E4M3 with
        /// per-channel scales, computed in bf16).
        dtype: ModelDType = ModelDType::Bf16,
        /// What the frozen Linears compute in: "bf16" (the weights' dtype; FP8 weights are
        /// decoded for each product), "fp8" (8-bit products on FP8 tensor cores, Hopper and
        /// Ada: the weights stored as with dtype "fp8", the activations and, in the backward,
        /// the output gradients quantized to E4M3 a token at a time) or "int8" (the same on
        /// integer tensor cores, Turing, Ampere and later: the weights stored as int8 codes
        /// with a scale an output channel, quantized at load, FP8 files' weights quantized
        /// again; activations and output gradients quantized to int8 a token at a time);
        /// adapters and everything trained stay in bf16 / f32. 8-bit products pay on large
        /// products (Flux, FLUX.2, Z-Image, SD3.5: 0.79x to 0.95x of the bf16 step on an
        /// H200), so a run puts in 8 bits only the Linears whose products pay at its largest
        /// bucket's rows (at least 12 G multiply-adds a product for FP8, 35 G for int8, or
        /// over few rows) and keeps the others in the model's dtype; most of SDXL's stay in
        /// bf16.
        compute: ModelCompute = ModelCompute::Bf16,
        /// With compute "int8": rotate each product's inner axis by a block Hadamard matrix
        /// (up to 256 values a block) before quantizing, the outlier treatment of QuaRot and
        /// musubi-tuner's ConvRot: the weights rotated once at load, each Linear's input (and
        /// its input gradient back) at a pass of its own; a token's few massive channels then
        /// spread over the block instead of taking its int8 scale. Off by default: its passes
        /// cost more than int8 saves for now (docs/TRAINING.md).
        int8_rotation: bool = false,
        /// A diffusers config.json for a single file whose shapes do not pin its config down.
        config: Option<PathBuf> = None,
        /// The guidance input of guidance-distilled models (Flux dev) during training.
        guidance: f64 = 1.0,
        /// DDPM models (SDXL): what the model predicts, "epsilon" or "v".
        prediction: Prediction = Prediction::Epsilon,
    }
}

section! {
    /// `[adapter]`: what is trained on the frozen model.
    AdapterSection / RawAdapter = "adapter" {
        /// The kind: "lora", "dora", "lokr", "loha" or "full" (`flame::nn::adapter::KINDS`).
        kind: String = "lora",
        /// The rank (LoRA/DoRA's r, LoKr's and LoHa's inner dimension; unused by "full"); a
        /// LoRA's at most the smaller width of every targeted layer.
        rank: usize = 16usize,
        /// The alpha; the update is scaled by alpha / rank.
        alpha: f64 = 16.0,
        /// Dropout on the adapter's input while training, in [0, 1) (lora and dora).
        dropout: f64 = 0.0,
        /// The probability of skipping a layer's adapter for a whole micro-batch while
        /// training (kohya's and LyCORIS's module_dropout), in [0, 1) (lora, dora, lokr and
        /// loha).
        module_dropout: f64 = 0.0,
        /// Rank dropout while training, in [0, 1): for lora and dora each rank component of
        /// a sample's down-projection zeroed with this probability, the rest scaled by
        /// 1 / (1 - p) (kohya's rank_dropout); for lokr and loha each output row of the
        /// weight change zeroed, the rest left as they are (LyCORIS's).
        rank_dropout: f64 = 0.0,
        /// Layer path patterns (`*` matches any run of characters), in the model's original
        /// key names, e.g. "double_blocks.*.img_attn.qkv".
        targets: Vec<String>,
        /// The rank of adapters on the convolutions the targets match (SDXL's ResNets:
        /// LyCORIS's conv_dim); 0 leaves convolutions alone. "full" ignores it.
        conv_rank: usize = 0usize,
        /// The convolutions' alpha (LyCORIS's conv_alpha).
        conv_alpha: f64 = 1.0,
        /// LoKr: the Kronecker split's factor, -1 for the most balanced. Where it divides a
        /// side, the pair is ordered as LyCORIS does (smaller first) for "kohya" files and
        /// as PEFT does ((factor, side / factor)) for "peft" files.
        factor: i64 = -1,
        /// LoKr: make w1 low-rank too where the rank allows.
        decompose_both: bool = false,
        /// LoRA, LoHa and LoKr on convolutions of a kernel larger than 1×1 (with conv_rank):
        /// LyCORIS's Tucker form (its use_tucker: LoRA a 1×1 down, a rank x rank core of the
        /// layer's kernel, a 1×1 up, kohya's lora_mid; LoHa a core a half, hada_t1 and
        /// hada_t2; LoKr a core in its low-rank w2, lokr_t2), fewer values than a full kernel
        /// for the same rank. LoHa's and LoKr's are PEFT's use_effective_conv2d and are written in
        /// every layout; LoRA's as "kohya" or "comfyui" only.
        tucker: bool = false,
        /// LoKr and LoHa: a layer diffusers splits into projections (Flux's linear1 and qkv,
        /// SD3's qkv) trains one adapter per projection, each over the projection's rows, as
        /// PEFT builds them on diffusers' separate Linears: the "peft" file holds one set of
        /// tensors per diffusers module, the "kohya" file names them "lycoris_" and the
        /// diffusers module's path, dots as underscores (which ComfyUI maps to the
        /// projection's rows). Not with weight_decompose.
        per_projection: bool = false,
        /// LoKr and LoHa: LyCORIS's weight decomposition (its modules' weight_decompose,
        /// dora_wd in its kohya network args; DoRA on LoKr / LoHa): the layer's weight becomes
        /// m · (W + ΔW) / (‖W + ΔW‖ + ε), ΔW the kind's change, the norm over each output
        /// channel (LyCORIS's wd_on_out) and not detached, m a learned magnitude per output
        /// channel from ‖W‖ (written as dora_scale). For LoRA use kind = "dora" (PEFT's DoRA).
        /// Written as "kohya" or "comfyui" only.
        weight_decompose: bool = false,
        /// With weight_decompose: the magnitudes' axis, LyCORIS's wd_on_out (wd_on_output in
        /// its kohya network args; true by default, as LyCORIS's): true one magnitude per
        /// output channel, the norm over each output row; false one per input channel, the
        /// norm over each input channel's column (dora_scale (1, in), or (1, cin, 1, 1) for a
        /// convolution). false is written as "kohya" only.
        wd_on_out: bool = true,
        /// The saved file's layout: "kohya" (ComfyUI, kohya, LyCORIS), "peft" (diffusers,
        /// PEFT; not for "full", nor for LoKr/LoHa on layers diffusers splits unless
        /// per_projection, or with weight_decompose), "comfyui" (the kohya layout with the magnitudes of DoRA and of
        /// weight_decompose written for ComfyUI, which divides them by the norm of the frozen
        /// weight, not of the adapted one; the other tensors as "kohya" writes them, in a file
        /// FLAME reads back as "comfyui"), or, for kind "lora" on flux2 and zimage, the files
        /// of two other trainers: "ai-toolkit" (ostris' ai-toolkit: PEFT's lora_A / lora_B
        /// under diffusion_model. and its module names, BFL's for FLUX.2, diffusers' for
        /// Z-Image) or "musubi" (kohya's musubi-tuner: for FLUX.2 the kohya layout itself, for
        /// Z-Image kohya's names of diffusers' modules, lora_unet_layers_0_attention_to_q).
        /// Checkpoints keep the kohya layout.
        format: AdapterFormat = AdapterFormat::Kohya,
        /// The text encoders trained with the model, by their slot names: "clip_l" (SDXL,
        /// SD3.5, Flux), "clip_g" (SDXL, SD3.5), "t5" (Flux, SD3.5) and "qwen3" (flux2,
        /// zimage) (kohya: training the CLIPs is the default without
        /// --network_train_unet_only, T5 with train_t5xxl; diffusers' scripts:
        /// --train_text_encoder). Each gets adapters of this kind, rank and alpha on the layers
        /// text_encoder_targets matches, saved beside the model's (kohya's lora_te1_ /
        /// lora_te2_ / lora_te3_ names, lora_te_model_ for Qwen3; diffusers' text_encoder. /
        /// text_encoder_2. / text_encoder_3. prefixes); their captions are then encoded every
        /// step instead of cached.
        text_encoders: Vec<String> = Vec::<String>::new(),
        /// Layer path patterns in the text encoders, in transformers' names
        /// ("*.self_attn.q_proj"; Qwen3's without the model. prefix, "layers.0.mlp.up_proj");
        /// [] for each encoder's default: kohya's for CLIP and T5
        /// (TEXT_ENCODER_TARGET_REPLACE_MODULE: the Linears of CLIPAttention and CLIPMLP,
        /// q_proj, k_proj, v_proj, out_proj, fc1, fc2; of T5Attention and
        /// T5DenseGatedActDense, q, k, v, o, wi_0, wi_1, wo), and for Qwen3 every Linear of its
        /// attention and MLP (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
        text_encoder_targets: Vec<String> = Vec::<String>::new(),
        /// LoRA+ (Hayou et al. 2024; kohya's network_args loraplus_lr_ratio, or
        /// loraplus_unet_lr_ratio for the model alone): the factor that starts at zero trains at
        /// this times the learning rate (LoRA and DoRA lora_up, as kohya; LoHa hada_w2_b;
        /// LoKr lokr_w1 or lokr_w1_a; magnitudes and Tucker cores at the base rate; not for
        /// "full"), in a parameter group of its own. 1: off (the paper suggests 16).
        loraplus_lr_ratio: f64 = 1.0,
        /// Per-block settings, `[[adapter.blocks]]` tables of `pattern` (a layer path pattern,
        /// as in targets; the first table whose pattern matches a layer wins) and optionally
        /// `lr` (the peak learning rate of its adapters, scaled by the schedule as optimizer.lr
        /// is; kohya's block_lr_weight times the lr), `rank` (its Linear layers' rank; 0: no
        /// adapter there; kohya's block_dims) and `alpha` (their alpha; kohya's block_alphas).
        /// The run's log says how many layers each pattern matched.
        blocks: Vec<AdapterBlock> = Vec::<AdapterBlock>::new(),
    }
}

/// kohya's text-encoder targets (sd-scripts networks/lora.py
/// `TEXT_ENCODER_TARGET_REPLACE_MODULE = ["CLIPAttention", "CLIPSdpaAttention", "CLIPMLP"]`):
/// every Linear of CLIP's attention and MLP, in transformers' names.
pub const TEXT_ENCODER_TARGETS: [&str; 6] = [
    "*.self_attn.q_proj",
    "*.self_attn.k_proj",
    "*.self_attn.v_proj",
    "*.self_attn.out_proj",
    "*.mlp.fc1",
    "*.mlp.fc2",
];

/// kohya's T5 targets (sd-scripts networks/lora_flux.py and lora_sd3.py
/// `TEXT_ENCODER_TARGET_REPLACE_MODULE`: "T5Attention", "T5DenseGatedActDense"): the
/// Linears of T5's attention and gated MLP, in transformers' names.
pub const T5_TARGETS: [&str; 7] = [
    "*.SelfAttention.q",
    "*.SelfAttention.k",
    "*.SelfAttention.v",
    "*.SelfAttention.o",
    "*.DenseReluDense.wi_0",
    "*.DenseReluDense.wi_1",
    "*.DenseReluDense.wo",
];

/// Qwen3's targets: every Linear of transformers' `Qwen3Attention` and `Qwen3MLP` (no trainer
/// of FLUX.2 \[klein\] or Z-Image adapts Qwen3 to copy a default from).
pub const QWEN3_TARGETS: [&str; 7] = [
    "*.self_attn.q_proj",
    "*.self_attn.k_proj",
    "*.self_attn.v_proj",
    "*.self_attn.o_proj",
    "*.mlp.gate_proj",
    "*.mlp.up_proj",
    "*.mlp.down_proj",
];

/// The text encoders whose adapters train (`adapter.text_encoders`), by slot name.
pub const TRAINABLE_TEXT_ENCODERS: [&str; 4] = ["clip_l", "clip_g", "t5", "qwen3"];

section! {
    /// `[optimizer]`: AdamW, AdamW8bit, Prodigy, Lion, Lion8bit, the schedule-free kinds or
    /// Adafactor.
    OptimizerSection / RawOptimizer = "optimizer" {
        /// "adamw" (f32 moments, 8 bytes a parameter), "adamw8bit" (both moments
        /// block-wise 8-bit, about 2 bytes a parameter; parameters under 4096 values keep f32),
        /// "prodigy" (the prodigyopt package's Prodigy, kohya's optimizer_type "Prodigy":
        /// Adam whose step size d is estimated from the run, 16 bytes a parameter; lr then
        /// multiplies d and is normally 1.0), "lion" (lion-pytorch's Lion, kohya's
        /// optimizer_type "Lion": the sign of a momentum step, 4 bytes a parameter; an lr 3-10
        /// times smaller than AdamW's), "lion8bit" (bitsandbytes' Lion8bit, kohya's
        /// "Lion8bit": the momentum block-wise 8-bit, about 1 byte a parameter),
        /// "adamw_schedulefree" (the schedulefree
        /// package's AdamWScheduleFree, kohya's "AdamWScheduleFree": no schedule, validation,
        /// samples and saved adapters use the averaged weights x; 8 bytes a parameter),
        /// "prodigy_schedulefree" (the prodigy-plus-schedule-free package's
        /// ProdigyPlusScheduleFree with factored = false, use_stableadamw = false and
        /// stochastic_rounding = false, kohya's "prodigyplus.ProdigyPlusScheduleFree"; about
        /// 8.4 bytes a parameter) or "adafactor" (transformers' Adafactor, kohya's
        /// optimizer_type "Adafactor": factored second moments, about 0 to 8 bytes a
        /// parameter; relative steps by default, or kohya's scale_parameter = false,
        /// relative_step = false, warmup_init = false with a given lr). The schedule-free
        /// kinds, and adafactor with relative_step, take schedule.kind = "constant" and
        /// schedule.warmup_steps = 0.
        kind: OptimizerKind = OptimizerKind::AdamW,
        /// The peak learning rate, > 0. Default: 1e-4, or 1.0 for "prodigy" and
        /// "prodigy_schedulefree". Not given for "adafactor" with relative_step (its own
        /// step size; transformers refuses lr there).
        lr: Option<f64> = None,
        /// Adam's beta1 and beta2, each in [0, 1) (Prodigy's too; beta1 = 0 keeps no first
        /// moment); Lion's beta1 (the interpolation whose sign is the update) and beta2 (the
        /// momentum's decay). Default: [0.9, 0.999], or [0.9, 0.99] for "lion" and "lion8bit"
        /// (lion-pytorch's and bitsandbytes').
        betas: Option<[f64; 2]> = None,
        /// Weight decay, >= 0: decoupled (AdamW's) for every kind unless prodigy's decouple =
        /// false makes it an L2 penalty on the gradient.
        weight_decay: f64 = 0.01,
        /// Adam's epsilon, > 0 (0 divides zero by zero where a gradient is zero). Prodigy
        /// adds d * eps.
        eps: f64 = 1e-8,
        /// Prodigy (and prodigy_schedulefree) only: the decay of the step-size estimate's
        /// running sums, in [0, 1) (prodigyopt's and ProdigyPlusScheduleFree's beta3). Default:
        /// the square root of beta2 (the second of betas).
        beta3: Option<f64> = None,
        /// Prodigy (and prodigy_schedulefree) only: the multiplier of the estimate d, > 0
        /// (prodigyopt's d_coef; default 1.0; 0.5 to 2 are the usual tuning).
        d_coef: Option<f64> = None,
        /// Prodigy (and prodigy_schedulefree) only: the first estimate of d, > 0
        /// (prodigyopt's d0; default 1e-6).
        d0: Option<f64> = None,
        /// Prodigy only: the most d may grow in one step, a factor > 0 (prodigyopt's
        /// growth_rate; default inf, unbounded; 1.02 gives a kind of warm-up).
        growth_rate: Option<f64> = None,
        /// Prodigy only: AdamW-style decoupled weight decay (default true) rather than an L2
        /// penalty added to the gradient (prodigyopt's decouple).
        decouple: Option<bool> = None,
        /// Prodigy only: Adam's bias correction in the step size (prodigyopt's
        /// use_bias_correction; default false).
        use_bias_correction: Option<bool> = None,
        /// Prodigy only: leave lr out of the estimate's denominator (prodigyopt's
        /// safeguard_warmup; default false). Required with schedule.warmup_steps > 0.
        safeguard_warmup: Option<bool> = None,
        /// The peak learning rate of the text encoders' adapters (adapter.text_encoders;
        /// kohya's text_encoder_lr), in a parameter group of its own where it differs from lr
        /// (the schedule scales it as lr). Default: lr.
        text_encoder_lr: Option<f64> = None,
        /// adamw_schedulefree only: steps of the optimizer's own linear warm-up of lr
        /// (schedulefree's warmup_steps; default 0), at most train.steps.
        warmup_steps: Option<usize> = None,
        /// adamw_schedulefree only: the average's polynomial weighting power, >= 0
        /// (schedulefree's r; default 0).
        r: Option<f64> = None,
        /// adamw_schedulefree only: the average weights steps by lr_max to this power, >= 0
        /// (schedulefree's weight_lr_power; default 2).
        weight_lr_power: Option<f64> = None,
        /// prodigy_schedulefree only: limit the growth of the raw estimate to 2^0.25 a step
        /// (ProdigyPlusScheduleFree's d_limiter; default true).
        d_limiter: Option<bool> = None,
        /// prodigy_schedulefree only: Refined SF-Adam's averaging strength, >= 0 (0: the
        /// original schedule-free average; ProdigyPlusScheduleFree's schedulefree_c; default 0).
        schedulefree_c: Option<f64> = None,
        /// adafactor only: the step is min(1e-2, 1/sqrt(t)) (scaled by the parameter's RMS
        /// with scale_parameter) instead of lr (transformers' relative_step; default true).
        relative_step: Option<bool> = None,
        /// adafactor only: multiply the step by max(eps2, the parameter's RMS)
        /// (transformers' scale_parameter; default true).
        scale_parameter: Option<bool> = None,
        /// adafactor only: with relative_step, a relative step of min(1e-6 t, 1/sqrt(t))
        /// (transformers' warmup_init; default false).
        warmup_init: Option<bool> = None,
        /// adafactor only: the update's RMS is clipped to this, > 0 (transformers'
        /// clip_threshold; default 1.0).
        clip_threshold: Option<f64> = None,
        /// adafactor only: the second moments decay by 1 - t^decay_rate, <= 0
        /// (transformers' decay_rate; default -0.8).
        decay_rate: Option<f64> = None,
        /// adafactor only: the first moment's decay, in [0, 1) (transformers' beta1;
        /// default none: no first moment).
        beta1: Option<f64> = None,
        /// adafactor only: [eps1, eps2], the term added to the squared gradient and the
        /// least parameter scale, each >= 0 (transformers' eps; default [1e-30, 1e-3]).
        adafactor_eps: Option<[f64; 2]> = None,
    }
}

impl OptimizerSection {
    /// The peak learning rate: `lr`, or the kind's default (1e-4; Prodigy's 1.0, prodigyopt's
    /// default, a multiplier of the estimated step size).
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(match self.kind {
            OptimizerKind::Prodigy | OptimizerKind::ProdigyScheduleFree => 1.0,
            // The multiplier of Adafactor's relative step (1: transformers' own).
            OptimizerKind::Adafactor if self.adafactor().relative_step => 1.0,
            OptimizerKind::AdamW
            | OptimizerKind::AdamW8bit
            | OptimizerKind::AdamWScheduleFree
            | OptimizerKind::Lion
            | OptimizerKind::Lion8bit
            | OptimizerKind::Adafactor => 1e-4,
        })
    }

    /// beta1 and beta2: `betas`, or the kind's default ([0.9, 0.999]; Lion's [0.9, 0.99]).
    pub fn betas(&self) -> [f64; 2] {
        self.betas.unwrap_or(match self.kind {
            OptimizerKind::Lion | OptimizerKind::Lion8bit => [0.9, 0.99],
            OptimizerKind::AdamW
            | OptimizerKind::AdamW8bit
            | OptimizerKind::Prodigy
            | OptimizerKind::AdamWScheduleFree
            | OptimizerKind::ProdigyScheduleFree
            | OptimizerKind::Adafactor => [0.9, 0.999],
        })
    }

    /// The keys only some kinds read, with whether each is set: (key, kinds, set).
    fn kind_keys(&self) -> [(&'static str, &'static [OptimizerKind], bool); 19] {
        use OptimizerKind::{
            Adafactor as Af, AdamWScheduleFree as Asf, Prodigy as P, ProdigyScheduleFree as Psf,
        };
        const BOTH: &[OptimizerKind] = &[P, Psf];
        [
            ("optimizer.beta3", BOTH, self.beta3.is_some()),
            ("optimizer.d_coef", BOTH, self.d_coef.is_some()),
            ("optimizer.d0", BOTH, self.d0.is_some()),
            ("optimizer.growth_rate", &[P], self.growth_rate.is_some()),
            ("optimizer.decouple", &[P], self.decouple.is_some()),
            (
                "optimizer.use_bias_correction",
                &[P],
                self.use_bias_correction.is_some(),
            ),
            (
                "optimizer.safeguard_warmup",
                &[P],
                self.safeguard_warmup.is_some(),
            ),
            (
                "optimizer.warmup_steps",
                &[Asf],
                self.warmup_steps.is_some(),
            ),
            ("optimizer.r", &[Asf], self.r.is_some()),
            (
                "optimizer.weight_lr_power",
                &[Asf],
                self.weight_lr_power.is_some(),
            ),
            ("optimizer.d_limiter", &[Psf], self.d_limiter.is_some()),
            (
                "optimizer.schedulefree_c",
                &[Psf],
                self.schedulefree_c.is_some(),
            ),
            (
                "optimizer.relative_step",
                &[Af],
                self.relative_step.is_some(),
            ),
            (
                "optimizer.scale_parameter",
                &[Af],
                self.scale_parameter.is_some(),
            ),
            ("optimizer.warmup_init", &[Af], self.warmup_init.is_some()),
            (
                "optimizer.clip_threshold",
                &[Af],
                self.clip_threshold.is_some(),
            ),
            ("optimizer.decay_rate", &[Af], self.decay_rate.is_some()),
            ("optimizer.beta1", &[Af], self.beta1.is_some()),
            (
                "optimizer.adafactor_eps",
                &[Af],
                self.adafactor_eps.is_some(),
            ),
        ]
    }

    /// Adafactor's settings from the section: its keys where set, transformers' defaults
    /// elsewhere; `lr` as [`OptimizerSection::lr`] gives it.
    fn adafactor(&self) -> AdafactorConfig {
        let d = AdafactorConfig::default();
        let [eps1, eps2] = self.adafactor_eps.unwrap_or([d.eps1, d.eps2]);
        AdafactorConfig {
            lr: self.lr.unwrap_or(d.lr),
            eps1,
            eps2,
            clip_threshold: self.clip_threshold.unwrap_or(d.clip_threshold),
            decay_rate: self.decay_rate.unwrap_or(d.decay_rate),
            beta1: self.beta1,
            weight_decay: self.weight_decay,
            scale_parameter: self.scale_parameter.unwrap_or(d.scale_parameter),
            relative_step: self.relative_step.unwrap_or(d.relative_step),
            warmup_init: self.warmup_init.unwrap_or(d.warmup_init),
        }
    }

    /// The optimizer this section describes.
    pub fn optimizer_config(&self) -> OptimizerConfig {
        let adam = AdamConfig {
            lr: self.lr(),
            beta1: self.betas()[0],
            beta2: self.betas()[1],
            eps: self.eps,
            weight_decay: self.weight_decay,
        };
        let lion = LionConfig {
            lr: self.lr(),
            beta1: self.betas()[0],
            beta2: self.betas()[1],
            weight_decay: self.weight_decay,
        };
        match self.kind {
            OptimizerKind::AdamW => OptimizerConfig::AdamW(adam),
            OptimizerKind::AdamW8bit => OptimizerConfig::AdamW8bit(AdamW8bitConfig {
                adam,
                ..Default::default()
            }),
            OptimizerKind::Prodigy => {
                let d = ProdigyConfig::default();
                OptimizerConfig::Prodigy(ProdigyConfig {
                    lr: self.lr(),
                    beta1: self.betas()[0],
                    beta2: self.betas()[1],
                    beta3: self.beta3,
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    decouple: self.decouple.unwrap_or(d.decouple),
                    use_bias_correction: self.use_bias_correction.unwrap_or(d.use_bias_correction),
                    safeguard_warmup: self.safeguard_warmup.unwrap_or(d.safeguard_warmup),
                    d0: self.d0.unwrap_or(d.d0),
                    d_coef: self.d_coef.unwrap_or(d.d_coef),
                    growth_rate: self.growth_rate.unwrap_or(d.growth_rate),
                })
            }
            OptimizerKind::AdamWScheduleFree => {
                let d = AdamWScheduleFreeConfig::default();
                OptimizerConfig::AdamWScheduleFree(AdamWScheduleFreeConfig {
                    lr: self.lr(),
                    beta1: self.betas()[0],
                    beta2: self.betas()[1],
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    warmup_steps: self.warmup_steps.map_or(d.warmup_steps, |w| w as u64),
                    r: self.r.unwrap_or(d.r),
                    weight_lr_power: self.weight_lr_power.unwrap_or(d.weight_lr_power),
                })
            }
            OptimizerKind::ProdigyScheduleFree => {
                let d = ProdigyScheduleFreeConfig::default();
                OptimizerConfig::ProdigyScheduleFree(ProdigyScheduleFreeConfig {
                    lr: self.lr(),
                    beta1: self.betas()[0],
                    beta2: self.betas()[1],
                    beta3: self.beta3,
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    d0: self.d0.unwrap_or(d.d0),
                    d_coef: self.d_coef.unwrap_or(d.d_coef),
                    d_limiter: self.d_limiter.unwrap_or(d.d_limiter),
                    schedulefree_c: self.schedulefree_c.unwrap_or(d.schedulefree_c),
                })
            }
            OptimizerKind::Adafactor => OptimizerConfig::Adafactor(AdafactorConfig {
                lr: self.lr(),
                ..self.adafactor()
            }),
            OptimizerKind::Lion => OptimizerConfig::Lion(lion),
            OptimizerKind::Lion8bit => OptimizerConfig::Lion8bit(Lion8bitConfig {
                lion,
                ..Default::default()
            }),
        }
    }
}

section! {
    /// `[schedule]`: the learning-rate schedule.
    ScheduleSection / RawSchedule = "schedule" {
        /// "constant", or "cosine" (to zero at the last step), after the warm-up.
        kind: ScheduleKind = ScheduleKind::Constant,
        /// Steps of linear warm-up from lr / warmup_steps to lr; at most train.steps.
        warmup_steps: usize = 0_usize,
    }
}

section! {
    /// `[train]`: the loop.
    TrainSection / RawTrain = "train" {
        /// Optimizer steps to run, > 0.
        steps: usize,
        /// Samples per micro-batch, > 0.
        batch_size: usize = 1_usize,
        /// Micro-batches per optimizer step, > 0.
        grad_accum: usize = 1_usize,
        /// Clip the global gradient norm to this (0: no clipping).
        max_grad_norm: f64 = 0.0,
        /// The seed of every random draw (data order, noise, timesteps, dropout, LoRA init).
        seed: u64 = 0_u64,
        /// Save a checkpoint every this many steps (0: only at the end).
        save_every: usize = 0_usize,
        /// Checkpoints kept; older ones of this run are deleted. At least 1.
        keep_last: usize = 2_usize,
        /// The run's folder: checkpoints, loss.jsonl, lora.safetensors, run.json.
        output_dir: PathBuf,
        /// "auto" (the GPU if one opens), "cuda" or "cpu".
        device: DeviceChoice = DeviceChoice::Auto,
        /// Data-parallel training on several GPUs of this machine, one process each (`train
        /// --gpus` overrides it): a list like [0, 1], or "all"; empty: one process.
        /// batch_size is then per GPU (the global batch is batch_size x GPUs x grad_accum).
        /// Across machines, start `train` on each with torchrun's variables instead
        /// (docs/TRAINING.md, "Several GPUs").
        gpus: Gpus = Vec::<usize>::new(),
        /// Flow matching: how t is drawn, "uniform", "logit_normal", "shift" or "flux_shift".
        timesteps: TimestepKind = TimestepKind::LogitNormal,
        /// logit_normal / flux_shift: the mean of the normal.
        timestep_mean: f64 = 0.0,
        /// logit_normal / flux_shift: the standard deviation of the normal, > 0.
        timestep_std: f64 = 1.0,
        /// shift: the fixed shift s, > 0.
        timestep_shift: f64 = 3.0,
        /// DDPM models: min-SNR-gamma loss weighting (0: off).
        min_snr_gamma: f64 = 0.0,
        /// The per-element loss (kohya's loss_type): "l2" (squared error), "l1" (absolute
        /// error), "huber"
        /// (pseudo-Huber 2c(sqrt(d² + c²) - c)) or "smooth_l1" (2(sqrt(d² + c²) - c)), d the
        /// prediction's error, c the threshold of train.huber_schedule.
        loss_type: LossType = LossType::L2,
        /// Huber and smooth L1: how c follows the timestep (kohya's huber_schedule):
        /// "constant" (huber_c · huber_scale), "exponential" (exp(-αt) · huber_scale,
        /// α = -ln(huber_c) / 1000, t on 0..1000; flow matching's t · 1000) or "snr"
        /// ((1 - huber_c) / (1 + σ)² + huber_c, σ = sqrt((1 - ᾱ) / ᾱ); DDPM models only).
        huber_schedule: HuberSchedule = HuberSchedule::Snr,
        /// Huber and smooth L1: kohya's huber_c, in (0, 1].
        huber_c: f64 = 0.1,
        /// Huber and smooth L1: kohya's huber_scale, > 0 (unused by "snr").
        huber_scale: f64 = 1.0,
        /// Noise offset (kohya's noise_offset, crosslabs' offset noise): each (sample,
        /// channel) of the noise gets noise_offset times a unit normal added; 0: off
        /// (around 0.1 when on).
        noise_offset: f64 = 0.0,
        /// With noise_offset: kohya's adaptive_noise_scale a, the offset of a channel
        /// becoming max(0, noise_offset + a · |mean of that channel's latents|); 0: off.
        adaptive_noise_scale: f64 = 0.0,
        /// With noise_offset: kohya's noise_offset_random_strength, the offset of each
        /// micro-batch drawn uniformly from [0, noise_offset) (one draw per micro-batch,
        /// seeded) instead of noise_offset.
        noise_offset_random_strength: bool = false,
        /// Input perturbation noise (kohya's ip_noise_gamma, Ning et al. 2023): the model's
        /// input is noised with noise + ip_noise_gamma · ξ (ξ a second unit normal, seeded)
        /// while the target is made from the noise alone; 0: off (0.1 when on, as the
        /// paper's).
        ip_noise_gamma: f64 = 0.0,
        /// With ip_noise_gamma: kohya's ip_noise_gamma_random_strength, the strength of each
        /// micro-batch drawn uniformly from [0, ip_noise_gamma) (one draw per micro-batch,
        /// seeded).
        ip_noise_gamma_random_strength: bool = false,
        /// Multi-resolution (pyramid) noise (kohya's multires_noise_iterations): levels of
        /// normals at 1/r^i of the latent size (r drawn in [2, 4) per level, seeded),
        /// upsampled bilinearly, added times discount^i, the sum divided by its standard
        /// deviation (over the process's micro-batch, as kohya's); 0: off (6 to 10 when on).
        multires_noise_iterations: usize = 0_usize,
        /// Pyramid noise: kohya's multires_noise_discount, in (0, 1].
        multires_noise_discount: f64 = 0.3,
        /// The smallest timestep trained on, 0..999 (kohya's min_timestep). DDPM models draw
        /// integer timesteps uniformly from min_timestep..max_timestep (max excluded, as
        /// kohya's randint; equal ends give that timestep); flow matching draws t as
        /// train.timesteps says and maps it into [min_timestep / 1000, max_timestep / 1000]
        /// (t' = min/1000 + (max - min)/1000 · t).
        min_timestep: usize = 0_usize,
        /// The largest timestep, 1..=1000, >= min_timestep (kohya's max_timestep).
        max_timestep: usize = 1000_usize,
        /// A non-finite loss or gradient norm: "stop" the run (naming the step, the batch's
        /// files and the tensor) or "skip" the step (the optimizer does not step).
        on_nonfinite: OnNonFinite = OnNonFinite::Stop,
        /// With on_nonfinite = "skip": stop after this many skipped steps in a row.
        max_skipped: usize = 10_usize,
        /// Loss scaling: "auto" (dynamic when model.dtype = "f16"), "dynamic" or "off".
        /// Dynamic: the loss is multiplied by a scale before the backward and the gradients
        /// divided by it in the optimizer step; a step whose gradients overflow is skipped
        /// and the scale halved, and the scale doubles after loss_scale_growth_interval
        /// clean steps (torch.cuda.amp.GradScaler's rule). Saved in checkpoints.
        loss_scale: LossScale = LossScale::Auto,
        /// Dynamic loss scaling: the first scale (GradScaler's init_scale, 2^16), >= 1.
        loss_scale_init: f64 = 65536.0,
        /// Dynamic loss scaling: clean steps before the scale doubles (GradScaler's
        /// growth_interval), >= 1.
        loss_scale_growth_interval: usize = 2000_usize,
        /// Without a terminal: print a progress line every this many steps (0: never).
        log_every: usize = 10_usize,
        /// Write TensorBoard event files to `tensorboard/` in the output folder: the loss,
        /// learning rate and gradient norm of every step, the validation loss and the
        /// sample images (kohya: --logging_dir / --log_with tensorboard; diffusers' scripts:
        /// --report_to tensorboard, their default).
        tensorboard: bool = true,
        /// What saved adapters' metadata says of the run: "full" (what kohya's sd-scripts
        /// records, with the dataset's folders, caption tag counts and output name) or
        /// "minimal" (without those and the base model's file name: nothing that could
        /// identify the data; kohya: --no_metadata leaves out everything).
        metadata: MetadataLevel = MetadataLevel::Full,
        /// Compute the validation loss every this many steps (0: at each checkpoint and at the
        /// end), when data.validation_split or data.validation_dir is set.
        validate_every: usize = 0_usize,
        /// Deterministic CUDA kernels: attention's dQ summed over key blocks in a fixed order
        /// instead of with atomic adds, so every step gives the same bits and a run resumes
        /// bit for bit on CUDA too; costs speed and memory (Flux-dev at 1024² on an H100:
        /// 459 ms a step against 418, 0.45 GiB more at the peak: the dQ slabs, which the
        /// memory planner counts). Also FLAME_DETERMINISTIC=1.
        deterministic: bool = false,
    }
}

section! {
    /// `[ema]`: an exponential moving average of the adapter's weights, updated after each
    /// optimizer step with diffusers' `EMAModel` decay (`training_utils.py`), saved beside
    /// the adapter as `lora_ema.safetensors` and in checkpoints.
    EmaSection / RawEma = "ema" {
        /// Keep the average (diffusers' scripts: --use_ema).
        enabled: bool = false,
        /// The largest decay, in [0, 1] (EMAModel's decay; --ema_decay).
        decay: f64 = 0.9999,
        /// The smallest decay, in [0, decay] (EMAModel's min_decay).
        min_decay: f64 = 0.0,
        /// Optimizer steps before the average moves: it copies the weights until then
        /// (EMAModel's update_after_step).
        update_after_step: usize = 0_usize,
        /// The decay 1 - (1 + n / inv_gamma)^-power instead of (1 + n) / (10 + n), n the
        /// steps past update_after_step less one (EMAModel's use_ema_warmup).
        warmup: bool = false,
        /// With warmup: the warm-up's inverse multiplicative factor, > 0 (EMAModel's
        /// inv_gamma).
        inv_gamma: f64 = 1.0,
        /// With warmup: its exponent, > 0 (EMAModel's power; 2/3 suits runs of about a
        /// million steps, 3/4 about a hundred thousand).
        power: f64 = 0.6666666666666666,
        /// Where the average is kept: "gpu" (the training device: counted in the memory
        /// plan) or "cpu" (host memory, updated on the CPU; diffusers' scripts: --offload_ema).
        device: EmaDevice = EmaDevice::Gpu,
        /// The validation loss and sample images with the averaged weights instead of the
        /// trained ones (swapped in for them and back out exactly).
        for_outputs: bool = false,
    }
}

section! {
    /// `[encoders]`: the text encoders, tokenizers and autoencoder that turn images and
    /// captions into training inputs and latents into sample images.
    EncodersSection / RawEncoders = "encoders" {
        /// The text encoders' weights (files or folders), in the family's order: flux
        /// clip_l, t5; sd3 clip_l, clip_g, t5; sdxl clip_l, clip_g. Default: the pipeline
        /// folder's text_encoder*/ when model.path is one, the files found by their keys when
        /// it is a folder of loose files, else the model's single file when it holds them
        /// (SDXL, SD3.5 all-in-one files).
        text: Vec<PathBuf> = Vec::<PathBuf>::new(),
        /// The tokenizers' folders (or T5 tokenizer.json / spiece.model files), in the same
        /// order. Default: the pipeline folder's tokenizer*/, else the tokenizers built into
        /// FLAME (feature `vocab`).
        tokenizers: Vec<PathBuf> = Vec::<PathBuf>::new(),
        /// The autoencoder's weights (BFL ae.safetensors, a diffusers vae/ folder, or the
        /// model's single file). Default: the pipeline's vae/, the file found by its keys in a
        /// folder of loose files, or the model's single file.
        vae: Option<PathBuf> = None,
        /// Where the encoders run: "auto" (the training device), "cuda" or "cpu".
        device: DeviceChoice = DeviceChoice::Auto,
        /// T5's tokens per caption (0: the pipeline's, Flux dev 512, schnell and SD3.5 256);
        /// fewer is faster and lighter when captions are short.
        t5_tokens: usize = 0_usize,
        /// Stream T5's blocks from host memory while encoding captions: "on", "off", or
        /// "auto" (on when the text encoders' weights and 2 GiB for the CUDA context and the
        /// work do not fit the run's budget: memory.budget_gb, or without one the GPU's memory
        /// free at start; trained beside the model, when T5 takes more than half of it; T5-XXL
        /// then encodes in about 1.5 GiB instead of 9).
        stream_t5: Toggle = Toggle::Auto,
        /// Stream Qwen3's layers from host memory while encoding captions (FLUX.2 klein,
        /// Z-Image): "on", "off", or "auto" (on when the text encoders' weights and 2 GiB for
        /// the CUDA context and the work do not fit the run's budget: memory.budget_gb, or
        /// without one the GPU's memory free at start; trained beside the model, when Qwen3
        /// takes more than half of it; Qwen3-4B then encodes in about 1.4 GiB instead of 8).
        stream_qwen3: Toggle = Toggle::Auto,
        /// Hold Qwen3's Linear weights as FP8 E4M3 with a scale per row, decoded per matmul
        /// (FLUX.2 klein, Z-Image; ComfyUI's fp8 text encoders): "on", "off", or "auto" (on
        /// when model.dtype is "fp8" or Qwen3's file stores FP8 weights, whose codes are then
        /// kept as they are; half of bf16's memory and streamed bytes).
        fp8_qwen3: Toggle = Toggle::Auto,
        /// Encode and decode in tiles of this many pixels (0: whole images, except where a
        /// whole one does not fit the run's budget, and sample images decode in 512-pixel
        /// tiles under a memory.budget_gb); less memory, slightly different latents near tile
        /// borders.
        vae_tile: usize = 0_usize,
    }
}

/// One `[sample]` prompt: its text, or a table of its text and its reference images (edit
/// sampling).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SamplePrompt {
    /// The prompt alone.
    Text(String),
    /// `{ prompt = "...", references = [...] }`.
    Table(PromptTable),
}

/// A `[sample]` prompt with reference images.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTable {
    /// The prompt.
    pub prompt: String,
    /// Its reference images, in order (relative to the config file).
    #[serde(default)]
    pub references: Vec<PathBuf>,
}

impl SamplePrompt {
    /// The prompt's text.
    pub fn text(&self) -> &str {
        match self {
            SamplePrompt::Text(t) => t,
            SamplePrompt::Table(t) => &t.prompt,
        }
    }

    /// Its reference images (none for a plain prompt).
    pub fn references(&self) -> &[PathBuf] {
        match self {
            SamplePrompt::Text(_) => &[],
            SamplePrompt::Table(t) => &t.references,
        }
    }
}

impl From<&str> for SamplePrompt {
    fn from(t: &str) -> Self {
        SamplePrompt::Text(t.to_string())
    }
}

section! {
    /// `[sample]`: images made with the model being trained, written to `samples/` in the
    /// output folder, the same prompts and seeds each time.
    SampleSection / RawSample = "sample" {
        /// Sample every this many steps (0: only at the end of the run); nothing without
        /// prompts.
        every: usize = 0_usize,
        /// The prompts, one image each: strings, or tables `{ prompt = "...", references =
        /// ["a.png", ...] }` whose reference images (edit sampling, FLUX.2 klein only) the
        /// image is conditioned on, sized as data.reference_resolution says and encoded with
        /// the training data.
        prompts: Vec<SamplePrompt> = Vec::<SamplePrompt>::new(),
        /// The negative prompt of classifier-free guidance (SD3, SDXL).
        negative_prompt: String = "",
        /// The initial noise of prompt i is drawn from seed + i.
        seed: u64 = 0_u64,
        /// Denoising steps, > 0.
        steps: usize = 20_usize,
        /// Flux dev: the distilled guidance input; SD3 and SDXL: the classifier-free
        /// guidance scale (1: none).
        guidance: f64 = 3.5,
        /// [width, height] in pixels, multiples of 16 ([0, 0]: data.resolution square).
        size: [usize; 2] = [0_usize, 0_usize],
        /// Classifier-free guidance's renormalization (diffusers' ZImagePipeline
        /// cfg_normalization): a guided prediction whose norm is above this times the
        /// conditional prediction's is scaled down to it; 0: off (diffusers' True is 1), >= 0.
        cfg_normalization: f64 = 0.0,
        /// Classifier-free guidance's truncation (diffusers' ZImagePipeline cfg_truncation):
        /// steps whose normalized time (1000 - timestep) / 1000 is above this run unguided;
        /// 1: every step guided, >= 0.
        cfg_truncation: f64 = 1.0,
    }
}

section! {
    /// `[memory]`: block checkpointing and streaming.
    MemorySection / RawMemory = "memory" {
        /// GiB of GPU memory the run may hold, as the driver counts it (0: on a GPU, the
        /// memory free at start; on the CPU, no limit). A budget, given or the default, caps
        /// FLAME's allocator; with checkpointing = "auto" the planner picks
        /// the fastest plan predicted to fit, and caching and samples plan within it too
        /// (without one, within the memory free at start: the least of the ranks').
        budget_gb: f64 = 0.0,
        /// Gradient checkpointing of blocks: "auto" (the planner chooses checkpointing,
        /// streamed blocks and what checkpointed blocks keep for memory.budget_gb), "off", "all",
        /// "every:N" (every N-th block) or "all-but:N" (every block but the first N); then
        /// stream_blocks, keep_attention and keep_down_projections apply as given.
        checkpointing: CheckpointSetting = CheckpointSetting::Auto,
        /// Blocks whose frozen weights stay in host memory and are streamed to the GPU when
        /// used (spread over the model; implies their checkpointing).
        stream_blocks: usize = 0_usize,
        /// Streamed blocks copied ahead of the one running, >= 1.
        prefetch: usize = 2_usize,
        /// Checkpointed blocks keep their attention outputs (o and log-sum-exp, ~1% of a
        /// block's activations) instead of recomputing them: a faster backward for a little
        /// memory (flash attention on CUDA only).
        keep_attention: bool = false,
        /// Checkpointed blocks keep the outputs of their down-projections' base GEMMs
        /// (Linears narrower out than in: the MLPs' second layers, 28 MiB a Flux block at
        /// 1024²) instead of recomputing them: a third less re-run work for a little more
        /// memory.
        keep_down_projections: bool = false,
        /// Checkpointed blocks keep their inputs (the activations passed from block to block,
        /// 28 MiB a Flux block at 1024²) in page-locked host memory between the forward and
        /// the backward, copied out and back on the copy stream beside the compute.
        offload_inputs: bool = false,
        /// With hand-set checkpointing, checkpointed blocks also keep the outputs
        /// `keep_attention` and `keep_down_projections` keep in page-locked host memory,
        /// copied out in the forward on the link's idle direction and back in the backward
        /// (it implies `offload_inputs`): the memory of selective recompute without its
        /// device cost. With `checkpointing = "auto"` the planner weighs it only under the
        /// switch `offload_kept=on` (`FLAME_PLANNER`).
        offload_kept: bool = false,
        /// With checkpointing = "auto" under a budget: steps to time each of the planner's
        /// pick and the plans of other kinds its time model puts near it (at most three
        /// more: resident blocks beside streamed ones or not, re-runs issued ahead or not)
        /// before the first step, on the run's first batches, after one untimed step each.
        /// Nothing is trained (the gradients are dropped). The run keeps the plan whose
        /// median step was shortest: the pick unless another was over 2% faster. The time
        /// model can rank those kinds wrongly on a given host; each plan timed that holds
        /// other weights than the loaded model loads it again. A resume keeps the plan the
        /// run kept. 0: off.
        trial_steps: usize = 5_usize,
        /// The most of the run's training time (its steps at the pick's step) that timing
        /// plans (`trial_steps`) may take, their loads included (each at the longest load
        /// seen, and one more to load the kept plan back): the rivals that would pass it are
        /// not timed, the cheapest (those on the loaded weights) going first; where not even
        /// the pick and one rival fit, nothing is timed. >= 0.
        trial_share: f64 = 0.05,
    }
}

/// A whole config: one struct per section.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainConfig {
    /// `[model]`.
    pub model: ModelSection,
    /// `[adapter]`.
    pub adapter: AdapterSection,
    /// `[optimizer]`.
    pub optimizer: OptimizerSection,
    /// `[schedule]`.
    pub schedule: ScheduleSection,
    /// `[train]`.
    pub train: TrainSection,
    /// `[data]`.
    pub data: DataSection,
    /// `[encoders]`.
    pub encoders: EncodersSection,
    /// `[sample]`.
    pub sample: SampleSection,
    /// `[memory]`.
    pub memory: MemorySection,
    /// `[ema]`.
    pub ema: EmaSection,
    /// The planner's switches (developer settings, not config keys: the binaries read them
    /// from `FLAME_PLANNER`, see [`Switches`]); a config written when some of them were
    /// `[memory]` keys sets them through those keys.
    #[serde(skip)]
    pub planner: Switches,
    /// What the reading noticed beside the problems it refuses (keys of an older config read
    /// another way), for the run to say.
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// `[memory]` keys of older configs that are now the planner's switches ([`Switches`]): read
/// into them, with a note (the switches that were keys once; later ones never were).
const RETIRED_MEMORY_KEYS: [&str; 6] = [
    "keep_few_rows",
    "wire_code",
    "uncoded_carry",
    "deep_prefetch",
    "host_products",
    "measure_machine",
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    model: RawModel,
    #[serde(default)]
    adapter: RawAdapter,
    #[serde(default)]
    optimizer: RawOptimizer,
    #[serde(default)]
    schedule: RawSchedule,
    #[serde(default)]
    train: RawTrain,
    #[serde(default)]
    data: RawData,
    #[serde(default)]
    encoders: RawEncoders,
    #[serde(default)]
    sample: RawSample,
    #[serde(default)]
    memory: RawMemory,
    #[serde(default)]
    ema: RawEma,
}

/// The raw sections of `text`, with the planner's switches its retired `[memory]` keys set
/// and a note for each. A text without such keys is read as it is, so that TOML's own errors
/// keep their lines.
fn read_raw(text: &str) -> std::result::Result<(RawConfig, Switches, Vec<String>), String> {
    let mut planner = Switches::default();
    let mut notes = vec![];
    let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let retired = table
        .get("memory")
        .and_then(toml::Value::as_table)
        .is_some_and(|m| RETIRED_MEMORY_KEYS.iter().any(|k| m.contains_key(*k)));
    if !retired {
        let raw = toml::from_str(text).map_err(|e| e.to_string())?;
        return Ok((raw, planner, notes));
    }
    let mut table = table;
    if let Some(toml::Value::Table(m)) = table.get_mut("memory") {
        let mut bad = vec![];
        for key in RETIRED_MEMORY_KEYS {
            let Some(v) = m.remove(key) else {
                continue;
            };
            let line = crate::config::line_of(text, &format!("memory.{key}"))
                .map(|n| format!("line {n}: "))
                .unwrap_or_default();
            match v.as_bool() {
                Some(on) => {
                    if let Some(s) = planner.get_mut(key) {
                        *s = on;
                    }
                    notes.push(format!(
                        "{line}memory.{key} = {on} is no longer a config key: the planner \
                         decides; read as the developer switch {}=\"{key}={}\"",
                        Switches::VAR,
                        if on { "on" } else { "off" }
                    ));
                }
                None => bad.push(format!("{line}memory.{key} = {v}: expected true or false")),
            }
        }
        if !bad.is_empty() {
            return Err(bad.join("\n"));
        }
    }
    let raw = RawConfig::deserialize(toml::Value::Table(table)).map_err(|e| e.to_string())?;
    Ok((raw, planner, notes))
}

/// The problems found so far, with the checks that recur.
struct Checks<'a>(&'a mut Vec<Problem>);

impl Checks<'_> {
    fn check(&mut self, ok: bool, key: &'static str, msg: String) {
        if !ok {
            self.0.push(Problem { key, msg });
        }
    }
    fn positive_f(&mut self, key: &'static str, x: f64) {
        self.check(
            x.is_finite() && x > 0.0,
            key,
            format!("{x}: must be finite and > 0"),
        );
    }
    fn non_negative_f(&mut self, key: &'static str, x: f64) {
        self.check(
            x.is_finite() && x >= 0.0,
            key,
            format!("{x}: must be finite and >= 0"),
        );
    }
    fn positive_n(&mut self, key: &'static str, n: usize) {
        self.check(n > 0, key, "0: must be positive".into());
    }
}

impl TrainConfig {
    /// Parses a config from TOML text; relative paths stay as written. Runs every check of
    /// [`TrainConfig::problems`]; errors name the key (and the line in `text`).
    pub fn from_toml(text: &str) -> Result<Self> {
        Self::parse(text, None)
    }

    /// Reads and checks `path`; relative paths inside become relative to its folder.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, Some(path))
    }

    fn parse(text: &str, path: Option<&Path>) -> Result<Self> {
        let bad = |msg: String| Error::Config {
            path: path.map(Path::to_path_buf),
            msg,
        };
        let (raw, planner, notes) = read_raw(text).map_err(bad)?;
        let missing = [
            raw.model.missing(),
            raw.adapter.missing(),
            raw.optimizer.missing(),
            raw.schedule.missing(),
            raw.train.missing(),
            raw.data.missing(),
            raw.encoders.missing(),
            raw.sample.missing(),
            raw.memory.missing(),
            raw.ema.missing(),
        ]
        .concat();
        if missing.len() > 1 {
            let keys: Vec<String> = missing.iter().map(|k| format!("`{k}`")).collect();
            return Err(bad(format!(
                "missing keys {} (see examples/flux.toml, or train --print-config for every \
                 key)",
                keys.join(", ")
            )));
        }
        let mut problems = vec![];
        let finish = || -> std::result::Result<Option<TrainConfig>, String> {
            let p = &mut problems;
            let sections = (
                raw.model.finish(p)?,
                raw.adapter.finish(p)?,
                raw.optimizer.finish(p)?,
                raw.schedule.finish(p)?,
                raw.train.finish(p)?,
                raw.data.finish(p)?,
                raw.encoders.finish(p)?,
                raw.sample.finish(p)?,
                raw.memory.finish(p)?,
                raw.ema.finish(p)?,
            );
            let (
                Some(model),
                Some(adapter),
                Some(optimizer),
                Some(schedule),
                Some(train),
                Some(data),
                Some(encoders),
                Some(sample),
                Some(memory),
                Some(ema),
            ) = sections
            else {
                return Ok(None);
            };
            Ok(Some(TrainConfig {
                model,
                adapter,
                optimizer,
                schedule,
                train,
                data,
                encoders,
                sample,
                memory,
                ema,
                planner,
                notes,
            }))
        };
        let finished = finish().map_err(bad)?;
        let report = |problems: &[Problem]| bad(problem_lines(text, problems));
        let Some(mut c) = finished else {
            return Err(report(&problems));
        };
        if let Some(base) = path.and_then(Path::parent) {
            let d = &mut c.data;
            let mut paths: Vec<&mut PathBuf> = vec![&mut c.model.path, &mut c.train.output_dir];
            for e in d.dirs.iter_mut().chain(d.reg_dirs.iter_mut()) {
                paths.push(&mut e.path);
                paths.extend(e.references.iter_mut());
            }
            paths.extend(d.validation_references.iter_mut());
            for p in c.sample.prompts.iter_mut() {
                if let SamplePrompt::Table(t) = p {
                    paths.extend(t.references.iter_mut());
                }
            }
            paths.extend(
                [
                    &mut c.model.config,
                    &mut d.dir,
                    &mut d.manifest,
                    &mut d.cache_dir,
                    &mut d.validation_dir,
                    &mut c.encoders.vae,
                ]
                .into_iter()
                .flatten(),
            );
            paths.extend(c.encoders.text.iter_mut());
            paths.extend(c.encoders.tokenizers.iter_mut());
            for p in paths {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        problems.extend(c.problems());
        if problems.is_empty() {
            return Ok(c);
        }
        Err(report(&problems))
    }

    /// Every check that needs no files, as (key, problem) pairs; empty when all pass.
    pub fn problems(&self) -> Vec<Problem> {
        let (m, a, o, s, t, mem) = (
            &self.model,
            &self.adapter,
            &self.optimizer,
            &self.schedule,
            &self.train,
            &self.memory,
        );
        let families: Vec<&str> = crate::models::FAMILIES.iter().map(|f| f.name).collect();
        let mut v: Vec<Problem> = [
            in_list("model.arch", &m.arch, &families),
            match &t.gpus {
                Gpus::Named(n) if n != "all" => Some(Problem {
                    key: "train.gpus",
                    msg: format!("\"{n}\": expected a list of GPU numbers or \"all\""),
                }),
                _ => None,
            },
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut c = Checks(&mut v);
        c.check(
            m.guidance.is_finite(),
            "model.guidance",
            format!("{}: must be finite", m.guidance),
        );
        let kind = crate::nn::adapter::kind(&a.kind);
        c.check(
            kind.is_ok(),
            "adapter.kind",
            format!(
                "{:?}: one of {:?}",
                a.kind,
                crate::nn::adapter::KINDS
                    .iter()
                    .map(|k| k.name)
                    .collect::<Vec<_>>()
            ),
        );
        c.positive_n("adapter.rank", a.rank);
        c.positive_f("adapter.alpha", a.alpha);
        c.positive_f("adapter.conv_alpha", a.conv_alpha);
        c.check(
            (0.0..1.0).contains(&a.dropout),
            "adapter.dropout",
            format!("{}: must be in [0, 1)", a.dropout),
        );
        c.check(
            a.dropout == 0.0 || crate::nn::adapter::kind(&a.kind).map_or(true, |k| k.dropout),
            "adapter.dropout",
            format!(
                "{}: input dropout applies to {}",
                a.dropout,
                crate::nn::adapter::dropout_kinds()
            ),
        );
        use crate::nn::adapter::{module_dropout_kinds, rank_dropout_kinds, Kind};
        let module = |k: &Kind| k.module_dropout;
        let rank = |k: &Kind| k.rank_dropout;
        for (key, p, takes, kinds) in [
            (
                "adapter.module_dropout",
                a.module_dropout,
                &module as &dyn Fn(&Kind) -> bool,
                module_dropout_kinds(),
            ),
            (
                "adapter.rank_dropout",
                a.rank_dropout,
                &rank,
                rank_dropout_kinds(),
            ),
        ] {
            c.check(
                (0.0..1.0).contains(&p),
                key,
                format!("{p}: must be in [0, 1)"),
            );
            c.check(
                p == 0.0 || kind.as_ref().map_or(true, |k| takes(k)),
                key,
                format!("{p}: applies to {kinds}"),
            );
        }
        c.check(
            a.factor == -1 || a.factor > 0,
            "adapter.factor",
            format!("{}: -1 (balanced) or a positive divisor", a.factor),
        );
        c.check(
            !(a.format == AdapterFormat::Peft && kind.as_ref().is_ok_and(|k| !k.peft)),
            "adapter.format",
            format!(
                "\"peft\": PEFT has no layout for kind {:?}; use \"kohya\"",
                a.kind
            ),
        );
        if let Some(tool) = a.format.tool() {
            c.check(
                kind.as_ref().map_or(true, |k| k.tool_layouts),
                "adapter.format",
                format!(
                    "\"{}\": written for {}, not {:?}; use \"kohya\" or \"peft\"",
                    tool.name(),
                    crate::nn::adapter::tool_layout_kinds(),
                    a.kind
                ),
            );
            let family = crate::models::family(&m.arch).ok();
            c.check(
                family.is_none_or(|f| f.tool_names.of(tool).is_some()),
                "adapter.format",
                format!(
                    "\"{}\": written for {} models, not {:?}; use \"kohya\" or \"peft\"",
                    tool.name(),
                    crate::models::FAMILIES
                        .iter()
                        .filter(|f| f.tool_names.of(tool).is_some())
                        .map(|f| f.name)
                        .collect::<Vec<_>>()
                        .join(" and "),
                    m.arch
                ),
            );
        }
        c.check(
            !(a.tucker && kind.as_ref().is_ok_and(|k| !k.tucker)),
            "adapter.tucker",
            format!(
                "true: applies to {}, not {:?}",
                crate::nn::adapter::tucker_kinds(),
                a.kind
            ),
        );
        c.check(
            !(a.weight_decompose && kind.as_ref().is_ok_and(|k| !k.weight_decompose)),
            "adapter.weight_decompose",
            format!(
                "true: applies to {}, not {:?}; a LoRA with a learned magnitude per output \
                 channel is kind = \"dora\"",
                crate::nn::adapter::weight_decompose_kinds(),
                a.kind
            ),
        );
        c.check(
            a.wd_on_out || a.weight_decompose,
            "adapter.wd_on_out",
            "false: the magnitudes' axis applies to the weight decomposition only; set \
             weight_decompose = true too"
                .into(),
        );
        c.check(
            a.wd_on_out || a.format != AdapterFormat::Comfyui,
            "adapter.wd_on_out",
            "false: the \"comfyui\" layout rescales magnitudes per output channel for \
             ComfyUI's reading, not per input channel; use format = \"kohya\""
                .into(),
        );
        c.check(
            !(a.per_projection && kind.as_ref().is_ok_and(|k| !k.per_projection)),
            "adapter.per_projection",
            format!(
                "true: applies to {}, not {:?} (whose \"peft\" files split a fused layer by \
                 rows already)",
                crate::nn::adapter::per_projection_kinds(),
                a.kind
            ),
        );
        c.check(
            !(a.per_projection && a.weight_decompose),
            "adapter.per_projection",
            "true with weight_decompose = true: the weight decomposition's magnitudes and norms \
             are the fused layer's; leave one of them out"
                .into(),
        );
        c.check(
            !(a.weight_decompose && a.format == AdapterFormat::Peft),
            "adapter.weight_decompose",
            "true: PEFT's LoKr and LoHa have no weight decomposition, so it is written in the \
             kohya layout only; use format = \"kohya\" or \"comfyui\""
                .into(),
        );
        c.check(
            !(a.tucker
                && a.format == AdapterFormat::Peft
                && kind.as_ref().is_ok_and(|k| !k.peft_tucker)),
            "adapter.tucker",
            format!(
                "true: PEFT has no Tucker form of {:?} (it has LoKr's and LoHa's, its \
                 use_effective_conv2d), so it is written in the kohya layout only; use format = \
                 \"kohya\"",
                a.kind
            ),
        );
        c.check(
            !a.targets.is_empty() && a.targets.iter().all(|t| !t.trim().is_empty()),
            "adapter.targets",
            format!("{:?}: must be non-empty patterns", a.targets),
        );
        c.positive_f("adapter.loraplus_lr_ratio", a.loraplus_lr_ratio);
        c.check(
            a.loraplus_lr_ratio == 1.0
                || crate::nn::adapter::kind(&a.kind).map_or(true, |k| !k.loraplus_up.is_empty()),
            "adapter.loraplus_lr_ratio",
            format!(
                "{}: the {:?} kind has no zero-initialized factor to train faster",
                a.loraplus_lr_ratio, a.kind
            ),
        );
        for (i, b) in a.blocks.iter().enumerate() {
            let ok = !b.pattern.trim().is_empty()
                && b.lr.is_none_or(|l| l.is_finite() && l >= 0.0)
                && b.alpha.is_none_or(|x| x.is_finite() && x > 0.0);
            c.check(
                ok,
                "adapter.blocks",
                format!(
                    "entry {} {}: needs a non-empty pattern, lr >= 0 and alpha > 0",
                    i + 1,
                    show(b)
                ),
            );
        }
        c.positive_f("optimizer.lr", o.lr());
        for name in &a.text_encoders {
            c.check(
                TRAINABLE_TEXT_ENCODERS.contains(&name.as_str()),
                "adapter.text_encoders",
                format!("{name:?}: the text encoders that train are {TRAINABLE_TEXT_ENCODERS:?}"),
            );
        }
        c.check(
            a.text_encoder_targets.iter().all(|t| !t.trim().is_empty()),
            "adapter.text_encoder_targets",
            format!("{:?}: must be non-empty patterns", a.text_encoder_targets),
        );
        c.check(
            a.text_encoders.is_empty() || a.format != AdapterFormat::Comfyui,
            "adapter.text_encoders",
            "trained with format = \"comfyui\": that layout is written for the diffusion \
             model only; use \"kohya\" (ComfyUI reads the text encoders' lora_te* names from it)"
                .into(),
        );
        c.check(
            a.text_encoders.is_empty() || a.format.tool().is_none(),
            "adapter.text_encoders",
            format!(
                "trained with format = {:?}: that trainer's files hold the diffusion model's \
                 adapters only; use \"peft\" or \"kohya\"",
                a.format
            ),
        );
        if let Some(x) = o.text_encoder_lr {
            c.check(
                x.is_finite() && x >= 0.0,
                "optimizer.text_encoder_lr",
                format!("{x}: must be finite and >= 0"),
            );
        }
        for (key, kinds, set) in o.kind_keys() {
            c.check(
                !set || kinds.contains(&o.kind),
                key,
                format!(
                    "is read by kind = {} only, and kind = {}",
                    kinds.iter().map(show).collect::<Vec<_>>().join(" or "),
                    show(&o.kind)
                ),
            );
        }
        if o.kind.is_schedule_free() {
            c.check(
                s.kind == ScheduleKind::Constant && s.warmup_steps == 0,
                "schedule.kind",
                format!(
                    "{} with schedule.warmup_steps = {}: kind = {} is schedule-free, it runs at \
                     a constant rate (the schedulefree and prodigy-plus-schedule-free packages' \
                     advice: its average replaces the schedule); use schedule.kind = \
                     \"constant\" and schedule.warmup_steps = 0{}",
                    show(&s.kind),
                    s.warmup_steps,
                    show(&o.kind),
                    match o.kind {
                        OptimizerKind::AdamWScheduleFree => {
                            ", and optimizer.warmup_steps for a warm-up"
                        }
                        _ => " (Prodigy adapts its own step size)",
                    }
                ),
            );
            c.check(
                o.betas()[0] > 0.0,
                "optimizer.betas",
                format!(
                    "{:?}: a schedule-free kind needs beta1 > 0 (its evaluation point divides \
                     by it)",
                    o.betas()
                ),
            );
        }
        if o.kind == OptimizerKind::Adafactor {
            let af = o.adafactor();
            if af.relative_step {
                c.check(
                    o.lr.is_none(),
                    "optimizer.lr",
                    "is given with kind = \"adafactor\" and relative_step = true: Adafactor then \
                     sets its own step size (transformers refuses lr with relative_step=True); \
                     leave lr out, or set relative_step = false (kohya's usual \
                     scale_parameter = false, relative_step = false, warmup_init = false)"
                        .into(),
                );
                c.check(
                    s.kind == ScheduleKind::Constant && s.warmup_steps == 0,
                    "schedule.kind",
                    format!(
                        "{} with schedule.warmup_steps = {}: kind = \"adafactor\" with \
                         relative_step = true sets its own step size at every step; use \
                         schedule.kind = \"constant\" and schedule.warmup_steps = 0, or \
                         relative_step = false",
                        show(&s.kind),
                        s.warmup_steps
                    ),
                );
            }
            c.check(
                !af.warmup_init || af.relative_step,
                "optimizer.warmup_init",
                "true requires relative_step = true (transformers: `warmup_init=True` \
                 requires `relative_step=True`)"
                    .into(),
            );
            c.check(
                af.clip_threshold.is_finite() && af.clip_threshold > 0.0,
                "optimizer.clip_threshold",
                format!("{}: must be finite and > 0", af.clip_threshold),
            );
            c.check(
                af.decay_rate.is_finite() && af.decay_rate <= 0.0,
                "optimizer.decay_rate",
                format!(
                    "{}: must be finite and <= 0 (the second moments decay by 1 - t^decay_rate)",
                    af.decay_rate
                ),
            );
            if let Some(b) = af.beta1 {
                c.check(
                    (0.0..1.0).contains(&b),
                    "optimizer.beta1",
                    format!("{b}: must be in [0, 1)"),
                );
            }
            c.check(
                [af.eps1, af.eps2]
                    .iter()
                    .all(|e| e.is_finite() && *e >= 0.0),
                "optimizer.adafactor_eps",
                format!("{:?}: each must be finite and >= 0", [af.eps1, af.eps2]),
            );
        }
        if let Some(w) = o.warmup_steps {
            c.check(
                w <= t.steps,
                "optimizer.warmup_steps",
                format!("{w}: longer than the run (train.steps = {})", t.steps),
            );
        }
        for (key, v) in [
            ("optimizer.r", o.r),
            ("optimizer.weight_lr_power", o.weight_lr_power),
            ("optimizer.schedulefree_c", o.schedulefree_c),
        ] {
            if let Some(x) = v {
                c.non_negative_f(key, x);
            }
        }
        if let Some(b) = o.beta3 {
            c.check(
                (0.0..1.0).contains(&b),
                "optimizer.beta3",
                format!("{b}: must be in [0, 1)"),
            );
        }
        if let Some(x) = o.d_coef {
            c.positive_f("optimizer.d_coef", x);
        }
        if let Some(x) = o.d0 {
            c.positive_f("optimizer.d0", x);
        }
        if let Some(x) = o.growth_rate {
            c.check(
                x > 0.0,
                "optimizer.growth_rate",
                format!("{x}: must be > 0 (inf: unbounded)"),
            );
        }
        c.check(
            !(o.kind == OptimizerKind::Prodigy
                && s.warmup_steps > 0
                && o.safeguard_warmup != Some(true)),
            "optimizer.safeguard_warmup",
            format!(
                "must be true with kind = \"prodigy\" and schedule.warmup_steps = {}: Prodigy's \
                 estimate divides by a sum that grows with lr, so the small rates of a warm-up \
                 inflate d unless safeguard_warmup leaves lr out of it (prodigyopt's advice); \
                 or set schedule.warmup_steps = 0 (Prodigy adapts its own step size)",
                s.warmup_steps
            ),
        );
        c.check(
            o.betas().iter().all(|b| (0.0..1.0).contains(b)),
            "optimizer.betas",
            format!("{:?}: each must be in [0, 1)", o.betas()),
        );
        c.non_negative_f("optimizer.weight_decay", o.weight_decay);
        c.check(
            o.eps.is_finite() && o.eps > 0.0,
            "optimizer.eps",
            format!(
                "{}: must be finite and > 0 (Adam divides by sqrt(v) + eps, and v is 0 where \
                 a gradient is 0)",
                o.eps
            ),
        );
        c.positive_n("train.steps", t.steps);
        c.positive_n("train.batch_size", t.batch_size);
        c.positive_n("train.grad_accum", t.grad_accum);
        c.check(
            t.steps
                .checked_mul(t.grad_accum)
                .and_then(|n| n.checked_mul(t.batch_size))
                .is_some_and(|n| n <= MAX_SAMPLES_DRAWN),
            "train.steps",
            format!(
                "{} x train.grad_accum = {} x train.batch_size = {}: more than {MAX_SAMPLES_DRAWN} \
                 samples drawn in the run",
                t.steps, t.grad_accum, t.batch_size
            ),
        );
        c.check(
            s.warmup_steps <= t.steps,
            "schedule.warmup_steps",
            format!(
                "{}: longer than the run (train.steps = {})",
                s.warmup_steps, t.steps
            ),
        );
        c.non_negative_f("train.max_grad_norm", t.max_grad_norm);
        c.non_negative_f("train.min_snr_gamma", t.min_snr_gamma);
        c.check(
            t.huber_c > 0.0 && t.huber_c <= 1.0,
            "train.huber_c",
            format!("{}: must be in (0, 1]", t.huber_c),
        );
        c.positive_f("train.huber_scale", t.huber_scale);
        c.non_negative_f("train.noise_offset", t.noise_offset);
        c.check(
            t.adaptive_noise_scale.is_finite()
                && (t.adaptive_noise_scale == 0.0 || t.noise_offset > 0.0),
            "train.adaptive_noise_scale",
            format!(
                "{}: must be finite, and needs train.noise_offset > 0 (it scales the offset)",
                t.adaptive_noise_scale
            ),
        );
        c.check(
            !t.noise_offset_random_strength || t.noise_offset > 0.0,
            "train.noise_offset_random_strength",
            "true: needs train.noise_offset > 0 (its strength is drawn up to it)".into(),
        );
        c.non_negative_f("train.ip_noise_gamma", t.ip_noise_gamma);
        c.check(
            !t.ip_noise_gamma_random_strength || t.ip_noise_gamma > 0.0,
            "train.ip_noise_gamma_random_strength",
            "true: needs train.ip_noise_gamma > 0 (its strength is drawn up to it)".into(),
        );
        c.check(
            t.multires_noise_discount > 0.0 && t.multires_noise_discount <= 1.0,
            "train.multires_noise_discount",
            format!("{}: must be in (0, 1]", t.multires_noise_discount),
        );
        c.check(
            t.multires_noise_iterations <= 64,
            "train.multires_noise_iterations",
            format!("{}: at most 64", t.multires_noise_iterations),
        );
        c.check(
            t.min_timestep < 1000,
            "train.min_timestep",
            format!("{}: must be in 0..999", t.min_timestep),
        );
        c.check(
            (1..=1000).contains(&t.max_timestep) && t.max_timestep >= t.min_timestep,
            "train.max_timestep",
            format!(
                "{}: must be in 1..=1000 and at least train.min_timestep ({})",
                t.max_timestep, t.min_timestep
            ),
        );
        c.check(
            t.keep_last > 0,
            "train.keep_last",
            "0: at least the latest checkpoint is kept".into(),
        );
        c.check(
            t.timestep_mean.is_finite(),
            "train.timestep_mean",
            format!("{}: must be finite", t.timestep_mean),
        );
        c.positive_f("train.timestep_std", t.timestep_std);
        c.positive_f("train.timestep_shift", t.timestep_shift);
        c.check(
            t.on_nonfinite != OnNonFinite::Skip || t.max_skipped > 0,
            "train.max_skipped",
            "0: with on_nonfinite = \"skip\", at least 1".into(),
        );
        c.check(
            t.loss_scale_init.is_finite() && t.loss_scale_init >= 1.0,
            "train.loss_scale_init",
            format!("{}: must be finite and >= 1", t.loss_scale_init),
        );
        c.check(
            t.loss_scale_growth_interval > 0,
            "train.loss_scale_growth_interval",
            "0: at least 1".into(),
        );
        c.check(mem.prefetch > 0, "memory.prefetch", "0: at least 1".into());
        let ema = &self.ema;
        c.check(
            (0.0..=1.0).contains(&ema.decay),
            "ema.decay",
            format!("{}: must be in [0, 1]", ema.decay),
        );
        c.check(
            ema.min_decay >= 0.0 && ema.min_decay <= ema.decay,
            "ema.min_decay",
            format!("{}: must be in [0, ema.decay]", ema.min_decay),
        );
        c.positive_f("ema.inv_gamma", ema.inv_gamma);
        c.positive_f("ema.power", ema.power);
        c.check(
            !ema.for_outputs || ema.enabled,
            "ema.for_outputs",
            "true: needs ema.enabled = true".into(),
        );
        let e = &self.encoders;
        let sm = &self.sample;
        c.positive_n("sample.steps", sm.steps);
        let max_t5 = crate::models::pipeline::T5_MAX_TOKENS;
        c.check(
            e.t5_tokens <= max_t5,
            "encoders.t5_tokens",
            format!(
                "{}: T5 takes at most {max_t5} tokens a caption",
                e.t5_tokens
            ),
        );
        // Reference images (edit training and sampling) for a family whose models take them.
        let references = crate::models::family(&self.model.arch).is_ok_and(|f| f.references);
        if !references {
            let named = self.data.reference_key().or_else(|| {
                sm.prompts
                    .iter()
                    .any(|p| !p.references().is_empty())
                    .then_some("sample.prompts")
            });
            if let Some(key) = named {
                c.check(
                    false,
                    key,
                    format!(
                        "reference images (edit training) for model.arch = {:?}, whose models \
                         take none: only \"flux2\" (FLUX.2 [klein]) is conditioned on reference \
                         images",
                        self.model.arch
                    ),
                );
            }
        }
        c.check(
            sm.prompts.is_empty() || self.data.dir.is_none(),
            "sample.prompts",
            "sample images need image data (data.dirs or data.manifest, which bring the text \
             encoders and the autoencoder), not pre-encoded samples (data.dir): remove \
             [sample]'s prompts or train from images"
                .into(),
        );
        c.check(
            sm.guidance.is_finite() && sm.guidance >= 0.0,
            "sample.guidance",
            format!("{}: must be finite and >= 0", sm.guidance),
        );
        c.non_negative_f("sample.cfg_normalization", sm.cfg_normalization);
        c.non_negative_f("sample.cfg_truncation", sm.cfg_truncation);
        c.check(
            sm.size.iter().all(|&x| x % 16 == 0) && (sm.size[0] == 0) == (sm.size[1] == 0),
            "sample.size",
            format!(
                "{:?}: width and height must be multiples of 16 (or both 0: data.resolution)",
                sm.size
            ),
        );
        c.check(
            e.vae_tile == 0 || e.vae_tile >= 64,
            "encoders.vae_tile",
            format!("{}: 0 (untiled) or at least 64 pixels", e.vae_tile),
        );
        c.non_negative_f("memory.trial_share", mem.trial_share);
        c.check(
            mem.budget_gb.is_finite() && mem.budget_gb >= 0.0,
            "memory.budget_gb",
            format!("{}: must be >= 0 (0: the GPU's free memory)", mem.budget_gb),
        );
        v.extend(self.data.problems());
        v
    }

    /// The dynamic loss scaler `train.loss_scale` asks for (None: no scaling).
    pub fn loss_scaler(&self) -> Option<super::scaler::LossScaler> {
        let t = &self.train;
        let on = match t.loss_scale {
            LossScale::Dynamic => true,
            LossScale::Auto => self.model.dtype == ModelDType::F16,
            LossScale::Off => false,
        };
        on.then(|| super::scaler::LossScaler::new(t.loss_scale_init, t.loss_scale_growth_interval))
    }

    /// The first problem as an error (no file, no line); Ok when every check passes.
    pub fn validate(&self) -> Result<()> {
        let problems = self.problems();
        if problems.is_empty() {
            return Ok(());
        }
        let all: Vec<String> = problems
            .iter()
            .map(|p| format!("{} = {}", p.key, p.msg))
            .collect();
        Err(Error::Config {
            path: None,
            msg: all.join("; "),
        })
    }

    /// The config with its model's pieces found from `model.path` (`models::discover`): a
    /// ComfyUI `models/` folder or another folder of loose files gives the diffusion model's
    /// file as `model.path` and, where `[encoders]` does not name them, the text encoders
    /// and the autoencoder found by their keys; a Hugging Face cache folder gives its
    /// snapshot. A single file or a diffusers folder stays as it is. With the log's lines
    /// saying what was picked for each role.
    pub fn discovered(&self) -> Result<(TrainConfig, Vec<String>)> {
        let keys = crate::models::discover::Keys {
            model: "model.path",
            arch: "model.arch",
            text: "encoders.text",
            vae: "encoders.vae",
        };
        let e = &self.encoders;
        let d = crate::models::discover(
            &self.model.path,
            Some(&self.model.arch),
            !e.text.is_empty(),
            e.vae.is_some(),
            keys,
        )?;
        let mut c = self.clone();
        c.model.path = d.model;
        if c.encoders.text.is_empty() {
            c.encoders.text = d.text;
        }
        if c.encoders.vae.is_none() {
            c.encoders.vae = d.vae;
        }
        Ok((c, d.lines))
    }

    /// Every path the config reads from exists, as the kind of thing its key takes (a file
    /// or a folder), and the output and cache folders are folders where they exist: one
    /// error naming each key that is not so.
    pub fn check_paths(&self) -> Result<()> {
        #[derive(Clone, Copy)]
        enum Want {
            Any,
            File,
            Dir,
        }
        let mut wanted: Vec<(String, &Path, Want, bool)> = vec![
            ("model.path".into(), &self.model.path, Want::Any, true),
            (
                "train.output_dir".into(),
                &self.train.output_dir,
                Want::Dir,
                false,
            ),
        ];
        let d = &self.data;
        let optional = [
            ("model.config", &self.model.config, Want::File, true),
            ("data.dir", &d.dir, Want::Dir, true),
            ("data.manifest", &d.manifest, Want::File, true),
            ("data.validation_dir", &d.validation_dir, Want::Dir, true),
            ("data.cache_dir", &d.cache_dir, Want::Dir, false),
            ("encoders.vae", &self.encoders.vae, Want::Any, true),
        ];
        for (key, p, want, must) in optional {
            if let Some(p) = p {
                wanted.push((key.into(), p, want, must));
            }
        }
        for (i, e) in d.dirs.iter().enumerate() {
            wanted.push((format!("data.dirs[{i}].path"), &e.path, Want::Dir, true));
        }
        for (i, e) in d.reg_dirs.iter().enumerate() {
            wanted.push((format!("data.reg_dirs[{i}].path"), &e.path, Want::Dir, true));
        }
        for (key, list) in d
            .dirs
            .iter()
            .enumerate()
            .map(|(i, e)| (format!("data.dirs[{i}].references"), &e.references))
            .chain(
                d.reg_dirs
                    .iter()
                    .enumerate()
                    .map(|(i, e)| (format!("data.reg_dirs[{i}].references"), &e.references)),
            )
        {
            for (j, p) in list.iter().enumerate() {
                wanted.push((format!("{key}[{j}]"), p, Want::Dir, true));
            }
        }
        for (j, p) in d.validation_references.iter().enumerate() {
            wanted.push((
                format!("data.validation_references[{j}]"),
                p,
                Want::Dir,
                true,
            ));
        }
        for (i, sp) in self.sample.prompts.iter().enumerate() {
            for (j, p) in sp.references().iter().enumerate() {
                wanted.push((
                    format!("sample.prompts[{i}].references[{j}]"),
                    p,
                    Want::File,
                    true,
                ));
            }
        }
        for (i, p) in self.encoders.text.iter().enumerate() {
            wanted.push((format!("encoders.text[{i}]"), p, Want::Any, true));
        }
        for (i, p) in self.encoders.tokenizers.iter().enumerate() {
            wanted.push((format!("encoders.tokenizers[{i}]"), p, Want::Any, true));
        }
        let mut bad = vec![];
        for (key, p, want, must) in wanted {
            let why = match (std::fs::metadata(p), want) {
                (Err(_), _) if !must => None,
                (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => {
                    Some("no such file or folder".to_string())
                }
                (Err(e), _) => Some(format!("cannot be read: {e}")),
                (Ok(m), Want::File) if m.is_dir() => Some("is a folder, not a file".into()),
                (Ok(m), Want::Dir) if !m.is_dir() => Some("is a file, not a folder".into()),
                (Ok(_), _) => None,
            };
            if let Some(why) = why {
                bad.push(format!("{key} = {}: {why}", p.display()));
            }
        }
        match bad.is_empty() {
            true => Ok(()),
            false => Err(Error::Config {
                path: None,
                msg: bad.join("; "),
            }),
        }
    }

    /// The config's key for a library setting.
    pub fn key_of(setting: Setting) -> &'static str {
        match setting {
            Setting::AdapterKind => "adapter.kind",
            Setting::AdapterRank => "adapter.rank",
            Setting::AdapterAlpha => "adapter.alpha",
            Setting::AdapterConvAlpha => "adapter.conv_alpha",
            Setting::AdapterDropout => "adapter.dropout",
            Setting::AdapterModuleDropout => "adapter.module_dropout",
            Setting::AdapterRankDropout => "adapter.rank_dropout",
            Setting::AdapterFactor => "adapter.factor",
            Setting::AdapterTargets => "adapter.targets",
            Setting::AdapterTucker => "adapter.tucker",
            Setting::AdapterPerProjection => "adapter.per_projection",
            Setting::AdapterWeightDecompose => "adapter.weight_decompose",
            Setting::AdapterLayout => "adapter.format",
            Setting::AdapterBlocks => "adapter.blocks",
        }
    }

    /// `e` in the config's terms: an [`Error::Setting`] becomes a config error naming the
    /// setting's key ([`TrainConfig::key_of`]); other errors pass as they are.
    pub fn named(e: Error) -> Error {
        match e {
            Error::Setting { setting, msg } => {
                let key = Self::key_of(setting);
                let sep = if msg.starts_with('=') { " " } else { ": " };
                Error::Config {
                    path: None,
                    msg: format!("{key}{sep}{msg}"),
                }
            }
            e => e,
        }
    }

    /// The adapter config.
    pub fn adapter_config(&self) -> AdapterConfig {
        let a = &self.adapter;
        AdapterConfig {
            kind: a.kind.clone(),
            rank: a.rank,
            alpha: a.alpha,
            dropout: a.dropout,
            module_dropout: a.module_dropout,
            rank_dropout: a.rank_dropout,
            targets: a.targets.clone(),
            seed: self.train.seed,
            conv_rank: a.conv_rank,
            conv_alpha: a.conv_alpha,
            factor: a.factor,
            decompose_both: a.decompose_both,
            tucker: a.tucker,
            per_projection: a.per_projection,
            weight_decompose: a.weight_decompose,
            wd_on_out: a.wd_on_out,
            // LoKr's split follows the library of the layout written: LyCORIS's for kohya
            // files, PEFT's for PEFT files.
            lokr_split: match a.format {
                AdapterFormat::Kohya
                | AdapterFormat::Comfyui
                | AdapterFormat::AiToolkit
                | AdapterFormat::Musubi => LokrSplit::Lycoris,
                AdapterFormat::Peft => LokrSplit::Peft,
            },
        }
    }

    /// The adapter config of the adapters of a text encoder of `kind`
    /// (`adapter.text_encoders`): the model's, on `adapter.text_encoder_targets` (the
    /// encoder's default when empty: [`TEXT_ENCODER_TARGETS`], [`T5_TARGETS`],
    /// [`QWEN3_TARGETS`]).
    pub fn text_adapter_config(&self, kind: TextEncoderKind) -> AdapterConfig {
        let a = &self.adapter;
        let default: &[&str] = match kind {
            TextEncoderKind::Clip => &TEXT_ENCODER_TARGETS,
            TextEncoderKind::T5 => &T5_TARGETS,
            TextEncoderKind::Qwen3(_) => &QWEN3_TARGETS,
        };
        AdapterConfig {
            targets: match a.text_encoder_targets.is_empty() {
                true => default.iter().map(|t| t.to_string()).collect(),
                false => a.text_encoder_targets.clone(),
            },
            ..self.adapter_config()
        }
    }

    /// An empty adapter set of the adapter config with its per-block settings
    /// (`adapter.blocks`).
    pub fn adapters(&self) -> Result<std::sync::Arc<crate::nn::Adapters>> {
        crate::nn::Adapters::with_blocks(self.adapter_config(), self.adapter.blocks.clone())
    }

    /// The LoRA hyperparameters of the adapter config (kind and LyCORIS settings aside).
    pub fn lora(&self) -> LoraConfig {
        LoraConfig {
            rank: self.adapter.rank,
            alpha: self.adapter.alpha,
            dropout: self.adapter.dropout,
            targets: self.adapter.targets.clone(),
            seed: self.train.seed,
        }
    }

    /// `memory.checkpointing` as given: `None` for "auto" (the planner decides).
    pub fn checkpointing(&self) -> Option<Checkpointing> {
        match self.memory.checkpointing {
            CheckpointSetting::Auto => None,
            CheckpointSetting::Fixed(c) => Some(c),
        }
    }

    /// The flow-matching timestep sampler of `train.timesteps`.
    pub fn sampling(&self) -> TimestepSampling {
        let t = &self.train;
        let (mean, std) = (t.timestep_mean, t.timestep_std);
        match t.timesteps {
            TimestepKind::Uniform => TimestepSampling::Uniform,
            TimestepKind::LogitNormal => TimestepSampling::LogitNormal { mean, std },
            TimestepKind::Shift => TimestepSampling::Shift {
                shift: t.timestep_shift,
            },
            TimestepKind::FluxShift => TimestepSampling::FluxShift { mean, std },
        }
    }

    /// The learning rate at `step` (0-based): linear warm-up, then constant or cosine to 0.
    pub fn lr_at(&self, step: usize) -> f64 {
        let (lr, w, n) = (
            self.optimizer.lr(),
            self.schedule.warmup_steps,
            self.train.steps,
        );
        if step < w {
            return lr * (step + 1) as f64 / w as f64;
        }
        match self.schedule.kind {
            ScheduleKind::Cosine if n > w => {
                let p = (step - w) as f64 / (n - w) as f64;
                lr * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            _ => lr,
        }
    }

    /// Every key of every section.
    pub fn reference() -> Vec<KeyDoc> {
        [
            ModelSection::reference(),
            AdapterSection::reference(),
            OptimizerSection::reference(),
            ScheduleSection::reference(),
            TrainSection::reference(),
            DataSection::reference(),
            EncodersSection::reference(),
            SampleSection::reference(),
            MemorySection::reference(),
            EmaSection::reference(),
        ]
        .concat()
    }

    /// The reference as a Markdown table (`train --print-config`, docs/CONFIG.md).
    pub fn reference_markdown() -> String {
        let mut s = String::from("| key | type | default | meaning |\n|---|---|---|---|\n");
        for k in Self::reference() {
            let default = k.default.unwrap_or_else(|| "required".into());
            s += &format!(
                "| `{}` | {} | {} | {} |\n",
                k.key,
                k.ty,
                if default == "required" {
                    default
                } else {
                    format!("`{default}`")
                },
                k.doc.replace('|', "\\|")
            );
        }
        s
    }

    /// The values a resumed run must share with the run that wrote its checkpoints, by key:
    /// everything that changes what a step computes or what saved state means. Paths, the
    /// device, checkpoint cadence, logging and the memory plan may change between a run and
    /// its resume.
    pub fn resume_keys(&self) -> Vec<(&'static str, String)> {
        let mut v = self.resume_keys_base();
        // The adapter kind and its LyCORIS settings, where they differ from a plain LoRA's
        // (so a LoRA run written before they existed resumes).
        let a = &self.adapter;
        let extra = [
            ("adapter.kind", a.kind != "lora", show(&a.kind)),
            ("adapter.conv_rank", a.conv_rank != 0, show(&a.conv_rank)),
            (
                "adapter.module_dropout",
                a.module_dropout != 0.0,
                show(&a.module_dropout),
            ),
            (
                "adapter.rank_dropout",
                a.rank_dropout != 0.0,
                show(&a.rank_dropout),
            ),
            (
                "adapter.conv_alpha",
                a.conv_alpha != 1.0,
                show(&a.conv_alpha),
            ),
            ("adapter.factor", a.factor != -1, show(&a.factor)),
            (
                "adapter.decompose_both",
                a.decompose_both,
                show(&a.decompose_both),
            ),
            ("adapter.tucker", a.tucker, show(&a.tucker)),
            (
                "adapter.per_projection",
                a.per_projection,
                show(&a.per_projection),
            ),
            (
                "adapter.weight_decompose",
                a.weight_decompose,
                show(&a.weight_decompose),
            ),
            ("adapter.wd_on_out", !a.wd_on_out, show(&a.wd_on_out)),
            (
                "adapter.loraplus_lr_ratio",
                a.loraplus_lr_ratio != 1.0,
                show(&a.loraplus_lr_ratio),
            ),
            ("adapter.blocks", !a.blocks.is_empty(), show(&a.blocks)),
        ];
        // The loss, noise and data options (keys of runs written before them stay out
        // at their defaults, so those runs resume).
        let t = &self.train;
        let d = &self.data;
        let huber = t.loss_type.thresholded();
        let loss_keys = [
            (
                "train.loss_type",
                t.loss_type != LossType::L2,
                show(&t.loss_type),
            ),
            ("train.huber_schedule", huber, show(&t.huber_schedule)),
            ("train.huber_c", huber, show(&t.huber_c)),
            ("train.huber_scale", huber, show(&t.huber_scale)),
            (
                "train.noise_offset",
                t.noise_offset != 0.0,
                show(&t.noise_offset),
            ),
            (
                "train.adaptive_noise_scale",
                t.adaptive_noise_scale != 0.0,
                show(&t.adaptive_noise_scale),
            ),
            (
                "train.noise_offset_random_strength",
                t.noise_offset_random_strength,
                show(&t.noise_offset_random_strength),
            ),
            (
                "train.ip_noise_gamma",
                t.ip_noise_gamma != 0.0,
                show(&t.ip_noise_gamma),
            ),
            (
                "train.ip_noise_gamma_random_strength",
                t.ip_noise_gamma_random_strength,
                show(&t.ip_noise_gamma_random_strength),
            ),
            (
                "train.multires_noise_iterations",
                t.multires_noise_iterations != 0,
                show(&t.multires_noise_iterations),
            ),
            (
                "train.multires_noise_discount",
                t.multires_noise_iterations != 0,
                show(&t.multires_noise_discount),
            ),
            (
                "train.min_timestep",
                t.min_timestep != 0,
                show(&t.min_timestep),
            ),
            (
                "train.max_timestep",
                t.max_timestep != 1000,
                show(&t.max_timestep),
            ),
            ("data.masked_loss", d.masked_loss, show(&d.masked_loss)),
            ("data.alpha_mask", d.alpha_mask, show(&d.alpha_mask)),
            (
                "data.reg_dirs",
                !d.reg_dirs.is_empty(),
                show(&d.reg_dirs.iter().map(|e| e.repeats).collect::<Vec<_>>()),
            ),
            (
                "data.prior_loss_weight",
                !d.reg_dirs.is_empty(),
                show(&d.prior_loss_weight),
            ),
            // The references' size decides what a step of an edit run sees.
            (
                "data.reference_resolution",
                d.reference_resolution != 1024,
                show(&d.reference_resolution),
            ),
        ];
        // The average and its decay, where one is kept (so a run without resumes as before).
        let e = &self.ema;
        let ema_keys = [
            ("ema.enabled", show(&e.enabled)),
            ("ema.decay", show(&e.decay)),
            ("ema.min_decay", show(&e.min_decay)),
            ("ema.update_after_step", show(&e.update_after_step)),
            ("ema.warmup", show(&e.warmup)),
            ("ema.inv_gamma", show(&e.inv_gamma)),
            ("ema.power", show(&e.power)),
        ]
        .map(|(k, s)| (k, e.enabled, s));
        v.extend(
            extra
                .into_iter()
                .chain(loss_keys)
                .chain(ema_keys)
                .filter(|e| e.1)
                .map(|(k, _, s)| (k, s)),
        );
        // The keys of one optimizer kind, where set.
        let o = &self.optimizer;
        let kind_values = [
            show(&o.beta3),
            show(&o.d_coef),
            show(&o.d0),
            show(&o.growth_rate),
            show(&o.decouple),
            show(&o.use_bias_correction),
            show(&o.safeguard_warmup),
            show(&o.warmup_steps),
            show(&o.r),
            show(&o.weight_lr_power),
            show(&o.d_limiter),
            show(&o.schedulefree_c),
            show(&o.relative_step),
            show(&o.scale_parameter),
            show(&o.warmup_init),
            show(&o.clip_threshold),
            show(&o.decay_rate),
            show(&o.beta1),
            show(&o.adafactor_eps),
        ];
        for ((key, _, set), value) in o.kind_keys().into_iter().zip(kind_values) {
            if set {
                v.push((key, value));
            }
        }
        v
    }

    fn resume_keys_base(&self) -> Vec<(&'static str, String)> {
        let (m, a, o, s, t) = (
            &self.model,
            &self.adapter,
            &self.optimizer,
            &self.schedule,
            &self.train,
        );
        let mut v = vec![
            ("model.arch", show(&m.arch)),
            ("model.dtype", show(&m.dtype)),
            ("model.guidance", show(&m.guidance)),
            ("model.prediction", show(&m.prediction)),
            ("adapter.rank", show(&a.rank)),
            ("adapter.alpha", show(&a.alpha)),
            ("adapter.dropout", show(&a.dropout)),
            ("adapter.targets", show(&a.targets)),
            ("adapter.format", show(&a.format)),
            ("optimizer.kind", show(&o.kind)),
            ("optimizer.lr", show(&o.lr())),
            ("optimizer.betas", show(&o.betas())),
            ("optimizer.weight_decay", show(&o.weight_decay)),
            ("optimizer.eps", show(&o.eps)),
            ("schedule.kind", show(&s.kind)),
            ("schedule.warmup_steps", show(&s.warmup_steps)),
            ("train.batch_size", show(&t.batch_size)),
            ("train.grad_accum", show(&t.grad_accum)),
            ("train.max_grad_norm", show(&t.max_grad_norm)),
            ("train.seed", show(&t.seed)),
            ("train.timesteps", show(&t.timesteps)),
            ("train.timestep_mean", show(&t.timestep_mean)),
            ("train.timestep_std", show(&t.timestep_std)),
            ("train.timestep_shift", show(&t.timestep_shift)),
            ("train.min_snr_gamma", show(&t.min_snr_gamma)),
            ("train.loss_scale", show(&t.loss_scale)),
        ];
        // Trained text encoders, where there are any (a run without resumes as before).
        if !a.text_encoders.is_empty() {
            v.push(("adapter.text_encoders", show(&a.text_encoders)));
            v.push((
                "adapter.text_encoder_targets",
                show(&a.text_encoder_targets),
            ));
        }
        // A cosine schedule runs to zero at the last step: its length is part of every lr.
        if s.kind == ScheduleKind::Cosine {
            v.push(("train.steps", show(&t.steps)));
        }
        // Images: what decides the batches a step sees.
        let d = &self.data;
        if d.dir.is_none() {
            v.extend([
                ("data.resolution", show(&d.resolution)),
                ("data.bucket_step", show(&d.bucket_step)),
                ("data.max_aspect", show(&d.max_aspect)),
                ("data.crop", show(&d.crop)),
                ("data.flip", show(&d.flip)),
                ("data.resample", show(&d.resample)),
                ("data.caption_dropout", show(&d.caption_dropout)),
                ("data.shuffle_tags", show(&d.shuffle_tags)),
                ("data.keep_tokens", show(&d.keep_tokens)),
                ("data.validation_split", show(&d.validation_split)),
                ("encoders.t5_tokens", show(&self.encoders.t5_tokens)),
            ]);
        }
        v
    }
}
