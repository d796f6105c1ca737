//! Qwen3 (transformers' `Qwen3Model`, the body of `Qwen3ForCausalLM`) as the text encoder of
//! FLUX.2 \[klein\] and Z-Image: a token embedding, then per layer RMSNorm -> grouped-query
//! self-attention (each head's q and k RMS-normalized, rotated by RoPE; causal, padding keys
//! hidden) -> residual, RMSNorm -> SwiGLU MLP -> residual, and a final RMSNorm that only the
//! last hidden state goes through. The pipelines condition on intermediate hidden states
//! (`output_hidden_states`), so the encoder returns `hidden_states[i]` for the indices asked:
//! 0 is the embedding output, i the output of layer i (0-based layer i - 1), and the last
//! (`num_hidden_layers`) the final-normed output (transformers 5 `capture_outputs` replaces
//! the last layer's output by `last_hidden_state`). Only the layers the asked states need run.
//!
//! Keys are transformers' (`layers.N.self_attn.q_proj.weight`), under `model.` as
//! `Qwen3ForCausalLM` saves them (ComfyUI's `qwen_3_4b.safetensors` too), bare as a
//! `Qwen3Model` saves them, or under any prefix a file gives them; `lm_head.weight` is not
//! read. Shape letters: B batch, L tokens, D hidden, H query heads, G key/value heads,
//! E head width, F MLP width.

use super::{detect_prefix, open_files, prefixes_with, BlockStream, EncoderPatch};
use crate::memory::BlockExec;
use crate::nn::{merge_heads, rope, scaled_dot_product_attention};
use crate::nn::{Embedding, KeySource, Linear, RmsNorm, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The model's sizes (transformers `Qwen3Config` fields).
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    /// Rows of the token embedding (151936 for Qwen's vocabulary).
    pub vocab_size: usize,
    /// Width D.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's hidden layer F.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads H.
    pub num_attention_heads: usize,
    /// Key / value heads G (H is a multiple of G; each serves H / G query heads).
    pub num_key_value_heads: usize,
    /// Head width E (not D / H in general: Qwen3-4B has 32 heads of 128 over D = 2560).
    pub head_dim: usize,
    /// Every RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base wavelength.
    pub rope_theta: f64,
    /// Whether q, k, v and o have biases (false for every released Qwen3).
    pub attention_bias: bool,
}

/// RoPE base and RMSNorm epsilon of every released dense Qwen3 (Qwen/Qwen3-4B and
/// Qwen/Qwen3-8B config.json: `rope_theta` 1000000, `rms_norm_eps` 1e-6; ComfyUI's
/// comfy/text_encoders/llama.py `Qwen3_4BConfig` / `Qwen3_8BConfig` take the same): what a
/// single file without a config is assumed to have.
const QWEN3_ROPE_THETA: f64 = 1_000_000.0;
const QWEN3_EPS: f64 = 1e-6;

impl Qwen3Config {
    /// Qwen3-4B (Qwen/Qwen3-4B config.json): the text encoder of Z-Image and of FLUX.2
    /// \[klein\] 4B.
    pub fn qwen3_4b() -> Self {
        Qwen3Config {
            vocab_size: 151936,
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: QWEN3_EPS,
            rope_theta: QWEN3_ROPE_THETA,
            attention_bias: false,
        }
    }

    /// Qwen3-8B (Qwen/Qwen3-8B config.json): the text encoder of FLUX.2 \[klein\] 9B.
    pub fn qwen3_8b() -> Self {
        Qwen3Config {
            hidden_size: 4096,
            intermediate_size: 12288,
            ..Self::qwen3_4b()
        }
    }

    /// From a transformers `config.json` (`Qwen3Config`). RoPE's base comes from
    /// `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4.x); only the default
    /// RoPE (no scaling), SiLU and full attention (no sliding window) are supported, other
    /// values are an error naming them. Absent fields take `Qwen3Config`'s defaults
    /// (transformers models/qwen3/configuration_qwen3.py: G = H, E 128, eps 1e-6; RoPE base
    /// 10000, `RotaryEmbeddingConfigMixin.default_theta`).
    pub fn from_json(v: &Value, path: Option<&Path>) -> Result<Self> {
        let fields = super::JsonFields::new(v, path);
        let err = |msg: String| fields.err(msg);
        let int = |name: &str, default: Option<usize>| fields.int(name, default);
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(err(format!(
                "hidden_act \"{act}\": Qwen3's MLP is SwiGLU (\"silu\")"
            )));
        }
        if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(err(
                "use_sliding_window true: only full attention is supported".into(),
            ));
        }
        if let Some(kinds) = v.get("layer_types").and_then(Value::as_array) {
            if let Some(k) = kinds.iter().find(|k| k.as_str() != Some("full_attention")) {
                return Err(err(format!(
                    "layer_types holds {k}: only full attention is supported"
                )));
            }
        }
        let rope = v.get("rope_parameters").filter(|r| !r.is_null());
        let scaling = v.get("rope_scaling").filter(|r| !r.is_null());
        for r in [rope, scaling].into_iter().flatten() {
            let kind = r
                .get("rope_type")
                .or_else(|| r.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if kind != "default" {
                return Err(err(format!(
                    "rope type \"{kind}\": only the default RoPE (no scaling) is supported"
                )));
            }
        }
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|t| {
                t.as_f64()
                    .filter(|t| *t > 1.0)
                    .ok_or_else(|| err(format!("rope_theta {t} is not a number above 1")))
            })
            .transpose()?
            .unwrap_or(10_000.0);
        let heads = int("num_attention_heads", None)?;
        let cfg = Qwen3Config {
            vocab_size: int("vocab_size", None)?,
            hidden_size: int("hidden_size", None)?,
            intermediate_size: int("intermediate_size", None)?,
            num_hidden_layers: int("num_hidden_layers", None)?,
            num_attention_heads: heads,
            num_key_value_heads: int("num_key_value_heads", Some(heads))?,
            head_dim: int("head_dim", Some(128))?,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(QWEN3_EPS),
            rope_theta: theta,
            attention_bias: v
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        };
        cfg.validate().map_err(err)?;
        Ok(cfg)
    }

    /// Inferred from the shapes of a checkpoint (`vb` at the model's root, `layers.N...`):
    /// the vocabulary and D from the embedding, E from layer 0's `q_norm`, H and G from the q
    /// and k projections' rows over E, F from `gate_proj`, the depth from the layers present,
    /// the biases from `q_proj.bias`. Not in the shapes, so assumed: RoPE base 1e6 and eps
    /// 1e-6 (every released dense Qwen3; give a config for another).
    pub fn from_shapes(vb: &VarBuilder) -> Result<Self> {
        let shape = |key: &str| {
            vb.shape_of(key).ok_or_else(|| Error::Param {
                key: vb.key(key),
                file: None,
                msg: "missing: cannot infer the Qwen3 config".into(),
            })
        };
        let emb = shape("embed_tokens.weight")?;
        let attn = "layers.0.self_attn";
        let e = shape(&format!("{attn}.q_norm.weight"))?[0];
        let q = shape(&format!("{attn}.q_proj.weight"))?;
        let k = shape(&format!("{attn}.k_proj.weight"))?;
        let gate = shape("layers.0.mlp.gate_proj.weight")?;
        let depth = (0..)
            .take_while(|i| vb.contains(&format!("layers.{i}.input_layernorm.weight")))
            .count();
        let cfg = Qwen3Config {
            vocab_size: emb[0],
            hidden_size: emb[1],
            intermediate_size: gate[0],
            num_hidden_layers: depth,
            num_attention_heads: q[0] / e.max(1),
            num_key_value_heads: k[0] / e.max(1),
            head_dim: e,
            rms_norm_eps: QWEN3_EPS,
            rope_theta: QWEN3_ROPE_THETA,
            attention_bias: vb.contains(&format!("{attn}.q_proj.bias")),
        };
        if q[0] % e.max(1) != 0 || k[0] % e.max(1) != 0 {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "Qwen3: q_proj rows {} and k_proj rows {} are not multiples of the head \
                     width {e} (q_norm)",
                    q[0], k[0]
                ),
            });
        }
        cfg.validate()
            .map_err(|msg| Error::Config { path: None, msg })?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let (h, g, e) = (
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        );
        if h == 0 || g == 0 || h % g != 0 || e == 0 || e % 2 != 0 || self.num_hidden_layers == 0 {
            return Err(format!(
                "Qwen3: needs heads > 0 in whole groups over the key/value heads, an even head \
                 width and at least one layer ({self:?})"
            ));
        }
        Ok(())
    }

    /// `hidden_states` index `i` (Python's: negative counts from the end of the
    /// `num_hidden_layers + 1` states) as a position in 0..=num_hidden_layers, or an error.
    pub fn hidden_index(&self, i: isize) -> Result<usize> {
        let n = self.num_hidden_layers as isize + 1;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "hidden state {i}: a Qwen3 of {} layers has hidden states 0..={} (or \
                     -{n}..=-1 from the end)",
                    self.num_hidden_layers,
                    n - 1
                ),
            });
        }
        Ok(j as usize)
    }
}

/// How [`Qwen3Encoder::load`] reads and places the model.
#[derive(Clone, Debug, Default)]
pub struct Qwen3Options {
    /// The model's key prefix in a file holding more than one model (found by its keys
    /// otherwise).
    pub prefix: Option<String>,
    /// The config; `None` takes the folder's config.json, else infers it from the shapes
    /// ([`Qwen3Config::from_shapes`]).
    pub config: Option<Qwen3Config>,
    /// The hidden states the encoder will be asked for (`hidden_states` indices, negative
    /// from the end): when not empty, only the layers they need are built and read (FLUX.2
    /// \[klein\]'s 9, 18, 27 need 27 of Qwen3-4B's 36 layers, Z-Image's -2 35 of them) and
    /// the final norm only when the last state is among them. Empty: the whole model.
    pub hidden_states: Vec<isize>,
    /// Linear weights stored as FP8 E4M3 with per-row scales (`VarBuilder::with_fp8`),
    /// decoded per matmul; the embedding and norms keep the load dtype.
    pub fp8: bool,
    /// The layers stream from host memory (page-locked on a GPU), copied this many layers
    /// ahead of the one running on the copy stream, as T5's blocks do
    /// (`T5Encoder::load_streamed`); `None` keeps them on the device.
    pub stream: Option<usize>,
    /// What goes onto the Linears of the layers built: adapters planned on them (key paths
    /// `layers.N.self_attn.q_proj`, `layers.N.mlp.down_proj`, ...: transformers' module names
    /// under the decoder, whose `model.` they leave out), an adapter file merged into their
    /// weights. Adapters stay on the device when the layers stream; gradients reach them
    /// through the streamed layers' recomputation.
    pub patch: EncoderPatch,
}

/// One decoder layer (transformers `Qwen3DecoderLayer`).
#[derive(Clone, Debug)]
struct Qwen3Layer {
    ln_attn: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    ln_mlp: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Qwen3Layer {
    fn new(vb: &VarBuilder, cfg: &Qwen3Config) -> Result<Self> {
        let (d, e, eps, bias) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.rms_norm_eps,
            cfg.attention_bias,
        );
        let (hq, hkv) = (cfg.num_attention_heads * e, cfg.num_key_value_heads * e);
        let (sa, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
        let f = cfg.intermediate_size;
        Ok(Qwen3Layer {
            ln_attn: RmsNorm::new(&vb.pp("input_layernorm"), d, eps)?,
            q: Linear::new(&sa.pp("q_proj"), d, hq, bias)?,
            k: Linear::new(&sa.pp("k_proj"), d, hkv, bias)?,
            v: Linear::new(&sa.pp("v_proj"), d, hkv, bias)?,
            o: Linear::new(&sa.pp("o_proj"), hq, d, bias)?,
            q_norm: RmsNorm::new(&sa.pp("q_norm"), e, eps)?,
            k_norm: RmsNorm::new(&sa.pp("k_norm"), e, eps)?,
            ln_mlp: RmsNorm::new(&vb.pp("post_attention_layernorm"), d, eps)?,
            gate: Linear::new(&mlp.pp("gate_proj"), d, f, false)?,
            up: Linear::new(&mlp.pp("up_proj"), d, f, false)?,
            down: Linear::new(&mlp.pp("down_proj"), f, d, false)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: e,
        })
    }

    /// Projection output (B, L, n E) -> (B, n, L, E), RMS-normalized per head when `norm`
    /// is given and then rotated by `rot` with its halves interleaved (see [`rotate`]).
    fn heads_of(
        &self,
        t: Tensor,
        n: usize,
        norm: Option<&RmsNorm>,
        rot: &Tensor,
    ) -> Result<Tensor> {
        let (b, l) = (t.dims()[0], t.dims()[1]);
        let t = t.reshape((b, l, n, self.head_dim))?;
        match norm {
            Some(norm) => rotate(&norm.forward(&t)?.transpose(1, 2)?, rot),
            None => t.transpose(1, 2),
        }
    }

    /// x (B, L, D), rot (1, 1, L, E/2, 2, 2), mask (B, L) or none -> (B, L, D).
    fn forward(&self, x: &Tensor, rot: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let h = self.ln_attn.forward(x)?;
        let q = self.heads_of(self.q.forward(&h)?, self.heads, Some(&self.q_norm), rot)?;
        let k = self.heads_of(self.k.forward(&h)?, self.kv_heads, Some(&self.k_norm), rot)?;
        let v = self.heads_of(self.v.forward(&h)?, self.kv_heads, None, rot)?;
        // Grouped-query attention: key/value head j serves query heads j r .. j r + r - 1
        // (transformers `repeat_kv`).
        let (k, v) = (self.repeat_kv(k)?, self.repeat_kv(v)?);
        // Causal over the positions, padding keys hidden, scaled by 1 / sqrt(E)
        // (transformers `Qwen3Attention.scaling`).
        let a = scaled_dot_product_attention(&q, &k, &v, mask, true, None)?;
        let x = x.add(&self.o.forward(&merge_heads(&a)?)?)?;
        let h = self.ln_mlp.forward(&x)?;
        // SwiGLU: down(silu(gate h) * up h) (transformers `Qwen3MLP`).
        let g = self.gate.forward(&h)?.silu()?.mul(&self.up.forward(&h)?)?;
        x.add(&self.down.forward(&g)?)
    }

    /// (B, G, L, E) -> (B, H, L, E), each key/value head repeated H / G times in place.
    fn repeat_kv(&self, t: Tensor) -> Result<Tensor> {
        let r = self.heads / self.kv_heads;
        if r == 1 {
            return Ok(t);
        }
        let d = t.dims().to_vec();
        t.unsqueeze(2)?
            .broadcast_as(vec![d[0], d[1], r, d[2], d[3]])?
            .reshape((d[0], d[1] * r, d[2], d[3]))
    }
}

/// RoPE as Qwen applies it (transformers `apply_rotary_pos_emb` with `rotate_half`): the
/// pair of component i is (x\[i\], x\[i + E/2\]), rotated by position * theta^(-2i/E).
/// FLAME's fused kernel rotates adjacent pairs (x\[2i\], x\[2i+1\]) (BFL Flux's layout), so
/// the halves are interleaved first: x (B, n, L, E) -> the rotated x with component i at
/// 2i and i + E/2 at 2i + 1. q and k go through the same permutation, which leaves their
/// dot products, and so the attention, unchanged.
fn rotate(x: &Tensor, rot: &Tensor) -> Result<Tensor> {
    let d = x.dims().to_vec();
    x.reshape(vec![d[0], d[1], d[2], 2, d[3] / 2])?
        .transpose(3, 4)?
        .reshape(d)?
        .apply_rope(rot)
}

/// Qwen3 with its weights, for conditioning: hidden states, no language-model head.
#[derive(Clone, Debug)]
pub struct Qwen3Encoder {
    /// The sizes of the checkpoint it was built from (all its layers, built or not).
    pub config: Qwen3Config,
    embed: Embedding,
    /// The first `layers.len()` decoder layers (all, unless
    /// [`Qwen3Options::hidden_states`] asked for fewer).
    layers: Vec<Qwen3Layer>,
    /// The final RMSNorm, when every layer is built.
    norm: Option<RmsNorm>,
    /// How the layers run: resident, or streamed from host memory.
    exec: BlockExec,
}

/// The prefix of every Qwen3 model among `keys` (a file's keys as stored):
/// `embed_tokens.weight` beside layer 0's `q_norm`, which Llama and Qwen2 lack.
pub(crate) fn qwen3_candidates(keys: &[String]) -> Vec<String> {
    prefixes_with(keys, "embed_tokens.weight")
        .into_iter()
        .filter(|p| keys.contains(&format!("{p}layers.0.self_attn.q_norm.weight")))
        .collect()
}

impl Qwen3Encoder {
    /// The encoder from `vb` at its root (`embed_tokens.weight`, `layers.N...`,
    /// `norm.weight`) with its first `depth` layers (at most `num_hidden_layers`), and the
    /// final norm when that is all of them. f16 is refused: Qwen3 is released in bf16 and
    /// its activations are not known to stay inside f16's range (load bf16 or f32; f16
    /// files load into either).
    pub fn new(vb: &VarBuilder, cfg: &Qwen3Config, depth: usize) -> Result<Self> {
        if vb.dtype() == DType::F16 {
            return Err(Error::UnsupportedDType {
                op: "Qwen3Encoder (load in bf16 or f32)",
                dtype: DType::F16,
            });
        }
        cfg.validate()
            .map_err(|msg| Error::Config { path: None, msg })?;
        let depth = depth.min(cfg.num_hidden_layers);
        let layers = (0..depth)
            .map(|i| Qwen3Layer::new(&vb.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = match depth == cfg.num_hidden_layers {
            true => Some(RmsNorm::new(
                &vb.pp("norm"),
                cfg.hidden_size,
                cfg.rms_norm_eps,
            )?),
            false => None,
        };
        Ok(Qwen3Encoder {
            embed: Embedding::new(&vb.pp("embed_tokens"), cfg.vocab_size, cfg.hidden_size)?,
            layers,
            norm,
            config: cfg.clone(),
            exec: BlockExec::default(),
        })
    }

    /// How the layers run: resident, or streamed (its streamer's counters:
    /// `exec().streamer`'s `report`).
    pub fn exec(&self) -> &BlockExec {
        &self.exec
    }

    /// How the layers run (the streamer of [`Qwen3Options::stream`]).
    pub fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    /// Decoder layers built (those the hidden states asked at load need).
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    /// Loads the encoder from `path`: a transformers folder (a pipeline's `text_encoder/`:
    /// config.json beside model.safetensors or its shards) or a single .safetensors file
    /// (ComfyUI's `qwen_3_4b.safetensors`, `qwen_3_8b.safetensors`, in bf16 or ComfyUI's
    /// scaled FP8), in `dtype` (bf16 or f32) on `device`, as `opts` says.
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        opts: &Qwen3Options,
    ) -> Result<(Self, VarBuilder)> {
        let path = path.as_ref();
        let (raw, config) = open_files(
            path,
            opts.prefix.is_some(),
            dtype,
            device,
            opts.config.clone(),
            Qwen3Config::from_json,
        )?;
        let raw = raw.with_fp8(opts.fp8)?;
        Self::load_from(
            raw,
            path,
            &Qwen3Options {
                config,
                ..opts.clone()
            },
        )
    }

    /// What [`load`](Self::load) does once the files are open: `raw` is a builder over the
    /// checkpoint's keys as stored (no key map), `origin` the file or folder they came from
    /// (named in errors). Finds the model's prefix by its keys (`embed_tokens.weight` beside
    /// layer 0's `q_norm`, which Llama and Qwen2 lack), maps them, takes the config of `opts`
    /// or infers one from the shapes, and builds the layers `opts` asks for. Any source
    /// works: tensors in memory, or [`VarBuilder::from_shapes`] to check a layout without its
    /// weights.
    pub fn load_from(
        raw: VarBuilder,
        origin: &Path,
        opts: &Qwen3Options,
    ) -> Result<(Self, VarBuilder)> {
        let raw = opts.patch.apply(raw)?;
        let keys = raw.source_keys();
        let candidates = qwen3_candidates(&keys)
            .into_iter()
            .map(|p| (p, ()))
            .collect();
        let (prefix, ()) = detect_prefix(
            origin,
            "Qwen3 text encoder",
            candidates,
            opts.prefix.as_deref(),
        )?;
        let map_prefix = prefix.clone();
        let vb = raw.with_key_map(Arc::new(move |k: &str| {
            Some(KeySource::Key(format!("{map_prefix}{k}")))
        }))?;
        let in_file = |e: Error| match e {
            Error::Param {
                key,
                file: None,
                msg,
            } => Error::Param {
                key: format!("{prefix}{key}"),
                file: Some(origin.to_path_buf()),
                msg,
            },
            Error::Config { path: None, msg } => Error::Config {
                path: Some(origin.to_path_buf()),
                msg,
            },
            e => e,
        };
        let cfg = match &opts.config {
            Some(c) => c.clone(),
            None => Qwen3Config::from_shapes(&vb).map_err(in_file)?,
        };
        let depth = match opts.hidden_states.is_empty() {
            true => cfg.num_hidden_layers,
            false => opts
                .hidden_states
                .iter()
                .map(|&i| cfg.hidden_index(i))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .max()
                .unwrap_or(0),
        };
        let Some(prefetch) = opts.stream else {
            return Ok((Self::new(&vb, &cfg, depth)?, vb));
        };
        let device = vb.device().clone();
        let prefixes = (0..depth.min(cfg.num_hidden_layers))
            .map(|i| format!("layers.{i}"))
            .collect();
        let streamer = BlockStream {
            prefetch,
            trains: opts.patch.adapters.is_some(),
        }
        .streamer(&device, prefixes)?;
        let vb = vb.with_host_weights(streamer.clone())?;
        let mut model = Self::new(&vb, &cfg, depth)?;
        model.set_exec(BlockExec {
            streamer: Some(streamer),
            ..BlockExec::default()
        });
        Ok((model, vb))
    }

    /// `hidden_states[i]` for each `i` of `which` (0 the embedding output, i the output of
    /// layer i, `num_hidden_layers` the final-normed last output; negative from the end, as
    /// Python indexes the tuple), each (B, L, D), for ids (B, L) u32 and a padding mask
    /// (B, L) (1 a token, 0 padding: hidden as a key; the pipelines pass the tokenizer's).
    /// Attention is causal, positions are 0..L whatever the padding (transformers'
    /// `position_ids` default), so right-padded rows give their tokens the states of the
    /// unpadded text. Runs the layers up to the deepest state asked for.
    pub fn hidden_states(
        &self,
        ids: &Tensor,
        mask: Option<&Tensor>,
        which: &[isize],
    ) -> Result<Vec<Tensor>> {
        let (b, l) = match ids.dims() {
            &[b, l] if ids.dtype() == DType::U32 && l > 0 => (b, l),
            _ => {
                return Err(Error::invalid(
                    "Qwen3Encoder::hidden_states",
                    format!("ids must be (B, L) u32 with L > 0, got {:?}", ids.dtype()),
                    ids.shape(),
                ))
            }
        };
        if let Some(m) = mask {
            if m.dims() != [b, l] {
                return Err(Error::ShapeMismatch {
                    op: "Qwen3Encoder::hidden_states mask",
                    lhs: ids.shape().clone(),
                    rhs: m.shape().clone(),
                });
            }
        }
        let n = self.config.num_hidden_layers;
        let idx = which
            .iter()
            .map(|&i| self.config.hidden_index(i))
            .collect::<Result<Vec<_>>>()?;
        let deepest = idx.iter().copied().max().unwrap_or(0);
        if deepest > self.layers.len() || (deepest == n && self.norm.is_none()) {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "hidden state {deepest} needs layers 0..{deepest}{}, but this Qwen3 \
                     encoder was loaded with {} of its {n} layers (Qwen3Options::hidden_states)",
                    if deepest == n {
                        " and the final norm"
                    } else {
                        ""
                    },
                    self.layers.len()
                ),
            });
        }
        let dev = ids.device();
        let pos = Tensor::arange(0.0, l as f64, DType::F32, dev)?.reshape((1, l))?;
        // (1, 1, L, E/2, 2, 2) rotations by position * theta^(-2i/E), computed in f64
        // (transformers computes the angles in f32).
        let rot = rope(&pos, self.config.head_dim, self.config.rope_theta)?.unsqueeze(1)?;
        let mask = mask.cloned();
        let mut x = self.embed.forward(ids)?; // (B, L, D)
        let mut states = vec![None; n + 1];
        let keep = |states: &mut Vec<Option<Tensor>>, j: usize, x: &Tensor| {
            if idx.contains(&j) {
                states[j] = Some(x.clone());
            }
        };
        keep(&mut states, 0, &x);
        for (i, layer) in self.layers.iter().enumerate().take(deepest) {
            let (lay, rot, mask) = (layer.clone(), rot.clone(), mask.clone());
            x = self
                .exec
                .run(&format!("layers.{i}"), i, &[x], move |ins| {
                    Ok(vec![lay.forward(&ins[0], &rot, mask.as_ref())?])
                })?
                .remove(0);
            if i + 1 < n {
                keep(&mut states, i + 1, &x);
            }
        }
        if deepest == n {
            if let Some(norm) = &self.norm {
                let y = norm.forward(&x)?;
                keep(&mut states, n, &y);
            }
        }
        idx.iter()
            .map(|&j| {
                states[j].clone().ok_or_else(|| Error::Config {
                    path: None,
                    msg: format!("Qwen3 hidden state {j} was not computed"),
                })
            })
            .collect()
    }
}
