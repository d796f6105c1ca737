//! The T5 v1.1 encoder (transformers' `T5EncoderModel`), the text encoder of Flux and SD3.5:
//! a shared token embedding, then per layer RMSNorm -> self-attention with a learned
//! relative position bias -> residual, RMSNorm -> gated-GELU MLP -> residual, and a final
//! RMSNorm. Keys are transformers' (`encoder.block.N.layer.0.SelfAttention.q.weight`).
//! Shape letters: B batch, L tokens, D `d_model`, H heads, K `d_kv` (head width), F `d_ff`.

use super::{detect_prefix, open_files, prefixes_with, BlockStream, EncoderPatch};
use crate::memory::BlockExec;
use crate::nn::merge_heads;
use crate::nn::{Embedding, KeySource, Linear, RmsNorm, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The prefix of T5-XXL in ComfyUI's all-in-one SD3 / SD3.5 files.
pub const SD3_T5: &str = "text_encoders.t5xxl.transformer.";

/// The encoder's sizes (transformers `T5Config` fields).
#[derive(Clone, Debug, PartialEq)]
pub struct T5Config {
    /// Rows of the shared embedding (32128 for T5's vocabulary).
    pub vocab_size: usize,
    /// Width D.
    pub d_model: usize,
    /// Head width K.
    pub d_kv: usize,
    /// Width of the gated MLP's hidden layer F.
    pub d_ff: usize,
    /// Number of encoder layers.
    pub num_layers: usize,
    /// Attention heads H.
    pub num_heads: usize,
    /// Buckets of the relative position bias (32, transformers `T5Config` default).
    pub relative_attention_num_buckets: usize,
    /// Distance from which all positions share the last bucket (128, `T5Config` default).
    pub relative_attention_max_distance: usize,
    /// RMSNorm epsilon (1e-6, `T5Config` default).
    pub layer_norm_epsilon: f64,
}

impl T5Config {
    /// T5 v1.1 XXL's encoder (`google/t5-v1_1-xxl` config.json), Flux's `text_encoder_2/`
    /// and SD3.5's `text_encoder_3/`.
    pub fn xxl() -> Self {
        T5Config {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
        }
    }

    /// From a transformers `config.json`. Only the gated-GELU MLP of T5 v1.1
    /// (`feed_forward_proj` "gated-gelu") is supported; other values are an error.
    pub fn from_json(v: &Value, path: Option<&Path>) -> Result<Self> {
        let fields = super::JsonFields::new(v, path);
        let err = |msg: String| fields.err(msg);
        let int = |name: &str, default: Option<usize>| fields.int(name, default);
        let ff = v
            .get("feed_forward_proj")
            .and_then(Value::as_str)
            .unwrap_or("relu");
        if ff != "gated-gelu" {
            return Err(err(format!(
                "feed_forward_proj \"{ff}\": only T5 v1.1's \"gated-gelu\" is supported"
            )));
        }
        // Defaults: transformers T5Config.__init__ (d_kv 64, buckets 32, distance 128, eps 1e-6).
        let cfg = T5Config {
            vocab_size: int("vocab_size", None)?,
            d_model: int("d_model", None)?,
            d_kv: int("d_kv", Some(64))?,
            d_ff: int("d_ff", None)?,
            num_layers: int("num_layers", None)?,
            num_heads: int("num_heads", None)?,
            relative_attention_num_buckets: int("relative_attention_num_buckets", Some(32))?,
            relative_attention_max_distance: int("relative_attention_max_distance", Some(128))?,
            layer_norm_epsilon: v
                .get("layer_norm_epsilon")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
        };
        cfg.validate().map_err(err)?;
        Ok(cfg)
    }

    /// Inferred from the shapes of a checkpoint (`vb` at the model's root): D and the vocabulary
    /// from the embedding, H and the bucket count from block 0's relative bias, K from q, F
    /// from `wi_0`, the depth from the blocks present. Assumed: max distance 128, eps 1e-6.
    pub fn from_shapes(vb: &VarBuilder) -> Result<Self> {
        let shape = |key: &str| {
            vb.shape_of(key).ok_or_else(|| Error::Param {
                key: vb.key(key),
                file: None,
                msg: "missing: cannot infer the T5 config".into(),
            })
        };
        let emb = shape("shared.weight")?;
        let b0 = "encoder.block.0.layer.0.SelfAttention";
        let bias = shape(&format!("{b0}.relative_attention_bias.weight"))?;
        let q = shape(&format!("{b0}.q.weight"))?;
        let wi = shape("encoder.block.0.layer.1.DenseReluDense.wi_0.weight")?;
        let depth = (0..)
            .take_while(|i| vb.contains(&format!("encoder.block.{i}.layer.0.layer_norm.weight")))
            .count();
        let heads = bias[1].max(1);
        let cfg = T5Config {
            vocab_size: emb[0],
            d_model: emb[1],
            d_kv: q[0] / heads,
            d_ff: wi[0],
            num_layers: depth,
            num_heads: bias[1],
            relative_attention_num_buckets: bias[0],
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
        };
        cfg.validate()
            .map_err(|msg| Error::Config { path: None, msg })?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.num_heads == 0 || self.d_kv == 0 || self.num_layers == 0 {
            return Err(format!(
                "T5: heads, head width and depth must be > 0 ({self:?})"
            ));
        }
        if self.relative_attention_num_buckets < 4 || self.relative_attention_max_distance < 2 {
            return Err(format!(
                "T5: too few buckets or too short a distance ({self:?})"
            ));
        }
        Ok(())
    }
}

/// The bucket of relative position `rel = key - query` (transformers
/// `T5Attention._relative_position_bucket`, bidirectional): half the buckets per direction;
/// in each, distances below a quarter of all buckets get their own, longer ones share
/// logarithmically wider buckets up to `max_distance`. Computed in f32 as PyTorch does.
pub fn relative_bucket(rel: i64, num_buckets: usize, max_distance: usize) -> usize {
    let half = num_buckets / 2;
    let exact = half / 2;
    let side = if rel > 0 { half } else { 0 };
    let n = rel.unsigned_abs() as usize;
    if n < exact {
        return side + n;
    }
    // PyTorch: log of an f32 tensor over a Python float (f64, rounded to f32 for the op).
    let denom = (max_distance as f64 / exact as f64).ln() as f32;
    let ratio = (n as f32 / exact as f32).ln() / denom;
    let large = exact + (ratio * (half - exact) as f32) as usize;
    side + large.min(half - 1)
}

/// One encoder layer: attention (`layer.0`) and the gated MLP (`layer.1`).
#[derive(Clone, Debug)]
struct T5Block {
    ln_attn: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln_ff: RmsNorm,
    wi_0: Linear,
    wi_1: Linear,
    wo: Linear,
    heads: usize,
}

impl T5Block {
    fn new(vb: &VarBuilder, cfg: &T5Config) -> Result<Self> {
        let (d, inner, eps) = (
            cfg.d_model,
            cfg.num_heads * cfg.d_kv,
            cfg.layer_norm_epsilon,
        );
        let (l0, l1) = (vb.pp("layer").pp(0), vb.pp("layer").pp(1));
        let sa = l0.pp("SelfAttention");
        let ff = l1.pp("DenseReluDense");
        Ok(T5Block {
            ln_attn: RmsNorm::new(&l0.pp("layer_norm"), d, eps)?,
            q: Linear::new(&sa.pp("q"), d, inner, false)?,
            k: Linear::new(&sa.pp("k"), d, inner, false)?,
            v: Linear::new(&sa.pp("v"), d, inner, false)?,
            o: Linear::new(&sa.pp("o"), inner, d, false)?,
            ln_ff: RmsNorm::new(&l1.pp("layer_norm"), d, eps)?,
            wi_0: Linear::new(&ff.pp("wi_0"), d, cfg.d_ff, false)?,
            wi_1: Linear::new(&ff.pp("wi_1"), d, cfg.d_ff, false)?,
            wo: Linear::new(&ff.pp("wo"), cfg.d_ff, d, false)?,
            heads: cfg.num_heads,
        })
    }

    /// x (B, L, D), bias (B or 1, H, L, L) added to the scores -> (B, L, D).
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (b, l) = (x.dims()[0], x.dims()[1]);
        let h = self.ln_attn.forward(x)?;
        let split = |t: Tensor| -> Result<Tensor> {
            let k = t.dims()[2] / self.heads;
            t.reshape(vec![b, l, self.heads, k])?.transpose(1, 2) // (B, H, L, K)
        };
        let (q, k, v) = (
            split(self.q.forward(&h)?)?,
            split(self.k.forward(&h)?)?,
            split(self.v.forward(&h)?)?,
        );
        // T5 does not scale the scores by 1 / sqrt(K) (it is folded into the weights' init).
        let s = q.matmul(&k.transpose(2, 3)?)?.add(bias)?; // (B, H, L, L)
        let a = merge_heads(&s.softmax(3)?.matmul(&v)?)?; // (B, L, H K)
        let x = x.add(&self.o.forward(&a)?)?;
        let h = self.ln_ff.forward(&x)?;
        // gelu_new (tanh approximation) on wi_0, times wi_1 (T5DenseGatedActDense).
        let g = self
            .wi_0
            .forward(&h)?
            .gelu_tanh()?
            .mul(&self.wi_1.forward(&h)?)?;
        x.add(&self.wo.forward(&g)?)
    }
}

/// The T5 encoder with its weights.
#[derive(Clone, Debug)]
pub struct T5Encoder {
    /// The sizes it was built with.
    pub config: T5Config,
    embed: Embedding,
    /// Block 0's `relative_attention_bias` (buckets, H), shared by every block.
    rel_bias: Tensor,
    blocks: Vec<T5Block>,
    final_ln: RmsNorm,
    /// How the blocks run: resident, or streamed from host memory
    /// ([`load_streamed`](Self::load_streamed)).
    exec: BlockExec,
}

/// The prefix of every T5 encoder among `keys` (a file's keys as stored).
pub(crate) fn t5_candidates(keys: &[String]) -> Vec<String> {
    prefixes_with(keys, "encoder.final_layer_norm.weight")
}

impl T5Encoder {
    /// The encoder from `vb` at its root (`shared.weight`, `encoder.block.N...`). f16 is
    /// refused: T5's activations overflow it (use bf16 or f32; f16 files load into either).
    pub fn new(vb: &VarBuilder, cfg: &T5Config) -> Result<Self> {
        if vb.dtype() == DType::F16 {
            return Err(Error::UnsupportedDType {
                op: "T5Encoder (activations overflow f16; load in bf16 or f32)",
                dtype: DType::F16,
            });
        }
        let enc = vb.pp("encoder");
        let blocks = (0..cfg.num_layers)
            .map(|i| T5Block::new(&enc.pp("block").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(T5Encoder {
            embed: Embedding::new(&vb.pp("shared"), cfg.vocab_size, cfg.d_model)?,
            rel_bias: enc
                .pp("block.0.layer.0.SelfAttention.relative_attention_bias")
                .get(
                    (cfg.relative_attention_num_buckets, cfg.num_heads),
                    "weight",
                )?,
            blocks,
            final_ln: RmsNorm::new(
                &enc.pp("final_layer_norm"),
                cfg.d_model,
                cfg.layer_norm_epsilon,
            )?,
            config: cfg.clone(),
            exec: BlockExec::default(),
        })
    }

    /// How the blocks run: resident, or streamed (its streamer's counters:
    /// `exec().streamer`'s `report`).
    pub fn exec(&self) -> &BlockExec {
        &self.exec
    }

    /// How the blocks run (the streamer of [`load_streamed`](Self::load_streamed)).
    pub fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }

    /// As [`load`](Self::load), with every block's weights in host memory (page-locked on a
    /// GPU) and copied to the device `prefetch` blocks ahead of the one running, on the copy
    /// stream: the device holds the embedding, the final norm and about `prefetch + 1`
    /// blocks (T5-XXL: 0.5 GiB a block against 8.9 GiB resident), as the diffusion models
    /// stream theirs (`crate::memory`). Outputs equal the resident encoder's.
    pub fn load_streamed(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<T5Config>,
        prefetch: usize,
    ) -> Result<(Self, VarBuilder)> {
        Self::load_adapted(
            path,
            prefix,
            dtype,
            device,
            config,
            Some(prefetch.max(1)),
            EncoderPatch::default(),
        )
    }

    /// [`load`](Self::load) (or, with `stream`, [`load_streamed`](Self::load_streamed) that
    /// many blocks ahead) with `patch` on its Linears: adapters planned on them, key paths in
    /// transformers' names (`encoder.block.N.layer.0.SelfAttention.q`,
    /// `...layer.1.DenseReluDense.wi_0`), and or an adapter file merged into their weights.
    /// Streamed, the adapters stay on the device while the base weights stream; the blocks
    /// recompute in the backward, so gradients reach the adapters as they do resident.
    pub fn load_adapted(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<T5Config>,
        stream: Option<usize>,
        patch: EncoderPatch,
    ) -> Result<(Self, VarBuilder)> {
        let (raw, config) = open_files(
            path.as_ref(),
            prefix.is_some(),
            dtype,
            device,
            config,
            T5Config::from_json,
        )?;
        let raw = patch.apply(raw)?;
        let stream = stream.map(|prefetch| BlockStream {
            prefetch,
            trains: patch.adapters.is_some(),
        });
        Self::build(raw, path.as_ref(), prefix, config, stream)
    }

    /// Loads the encoder from `path`: a transformers / diffusers folder (`text_encoder_2/`
    /// of Flux, `text_encoder_3/` of SD3: config.json beside model.safetensors or its
    /// shards) or a single .safetensors file (e.g. ComfyUI's `t5xxl_fp16.safetensors`, or a
    /// file holding several encoders, where `prefix` picks this one). The embedding is read
    /// from `shared.weight`, else `encoder.embed_tokens.weight`. `dtype` is bf16 or f32.
    pub fn load(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<T5Config>,
    ) -> Result<(Self, VarBuilder)> {
        Self::load_adapted(
            path,
            prefix,
            dtype,
            device,
            config,
            None,
            EncoderPatch::default(),
        )
    }

    /// What [`load`](Self::load) does once the files are open: `raw` is a builder over the
    /// checkpoint's keys as stored (no key map), `origin` the file or folder they came from
    /// (named in errors). Finds the encoder's prefix by its keys, maps them, takes `config` or
    /// infers one from the shapes, and builds the model. Any source works: tensors in memory,
    /// or [`VarBuilder::from_shapes`] to check a layout without its weights.
    pub fn load_from(
        raw: VarBuilder,
        origin: &Path,
        prefix: Option<&str>,
        config: Option<T5Config>,
    ) -> Result<(Self, VarBuilder)> {
        Self::build(raw, origin, prefix, config, None)
    }

    /// [`load_from`](Self::load_from), the blocks streamed as `stream` says when given.
    fn build(
        raw: VarBuilder,
        origin: &Path,
        prefix: Option<&str>,
        config: Option<T5Config>,
        stream: Option<BlockStream>,
    ) -> Result<(Self, VarBuilder)> {
        let keys = raw.source_keys();
        let candidates = t5_candidates(&keys).into_iter().map(|p| (p, ())).collect();
        let (prefix, ()) = detect_prefix(origin, "T5 encoder", candidates, prefix)?;
        let shared = if keys.contains(&format!("{prefix}shared.weight")) {
            format!("{prefix}shared.weight")
        } else {
            format!("{prefix}encoder.embed_tokens.weight")
        };
        let vb = raw.with_key_map(Arc::new(move |k: &str| {
            Some(KeySource::Key(if k == "shared.weight" {
                shared.clone()
            } else {
                format!("{prefix}{k}")
            }))
        }))?;
        let cfg = match config {
            Some(c) => c,
            None => T5Config::from_shapes(&vb)?,
        };
        let Some(stream) = stream else {
            return Ok((Self::new(&vb, &cfg)?, vb));
        };
        let device = vb.device().clone();
        let prefixes = (0..cfg.num_layers)
            .map(|i| format!("encoder.block.{i}"))
            .collect();
        let streamer = stream.streamer(&device, prefixes)?;
        let vb = vb.with_host_weights(streamer.clone())?;
        let mut model = Self::new(&vb, &cfg)?;
        model.set_exec(BlockExec {
            streamer: Some(streamer),
            ..BlockExec::default()
        });
        Ok((model, vb))
    }

    /// The relative position bias (1, H, L, L): bias\[h, i, j\] = table\[bucket(j - i), h\]
    /// from `table` (buckets, H).
    fn position_bias(cfg: &T5Config, table: &Tensor, l: usize) -> Result<Tensor> {
        let (nb, md) = (
            cfg.relative_attention_num_buckets,
            cfg.relative_attention_max_distance,
        );
        let mut ids = Vec::with_capacity(l * l);
        for i in 0..l as i64 {
            for j in 0..l as i64 {
                ids.push(relative_bucket(j - i, nb, md) as u32);
            }
        }
        let ids = Tensor::from_vec(ids, l * l, table.device())?;
        let h = cfg.num_heads;
        table
            .index_select(&ids, 0)? // (L L, H)
            .reshape((l, l, h))?
            .permute(&[2, 0, 1])?
            .unsqueeze(0)
    }

    /// ids (B, L) u32 and an optional mask (B, L) (0 hides a key; Flux's and SD3's pipelines
    /// pass none, so padding is attended) -> the last hidden state (B, L, D) after the final
    /// RMSNorm.
    pub fn forward(&self, ids: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, l) = match ids.dims() {
            &[b, l] if ids.dtype() == DType::U32 && l > 0 => (b, l),
            _ => {
                return Err(Error::invalid(
                    "T5Encoder::forward",
                    format!("ids must be (B, L) u32 with L > 0, got {:?}", ids.dtype()),
                    ids.shape(),
                ))
            }
        };
        let x = self.embed.forward(ids)?; // (B, L, D)
                                          // The padding mask as an additive (B, 1, 1, L) term, or a zero.
        let mut hidden = Tensor::zeros((1, 1, 1, 1), x.dtype(), x.device())?;
        if let Some(m) = mask {
            if m.dims() != [b, l] {
                return Err(Error::ShapeMismatch {
                    op: "T5Encoder::forward mask",
                    lhs: ids.shape().clone(),
                    rhs: m.shape().clone(),
                });
            }
            // A hidden key gets a large negative score (transformers adds the dtype's
            // minimum; -1e9 gives the same zero weight without overflowing a sum).
            let off = m.eq(&m.zeros_like()?)?.to_dtype(x.dtype())?;
            hidden = off.affine(-1e9, 0.0)?.reshape((b, 1, 1, l))?;
        }
        // Block 0 owns the position table (`relative_attention_bias`): it makes the bias
        // (1, H, L, L) + mask inside its own run, where its weights are on the device when
        // streamed, and hands it on to the blocks after it.
        let mut xs = vec![x, hidden];
        for (i, block) in self.blocks.iter().enumerate() {
            let blk = block.clone();
            let first = (i == 0).then(|| (self.config.clone(), self.rel_bias.clone()));
            xs = self
                .exec
                .run(&format!("encoder.block.{i}"), i, &xs, move |ins| {
                    let bias = match &first {
                        Some((cfg, table)) => Self::position_bias(cfg, table, l)?
                            .to_dtype(ins[0].dtype())?
                            .add(&ins[1])?,
                        None => ins[1].clone(),
                    };
                    Ok(vec![blk.forward(&ins[0], &bias)?, bias])
                })?;
        }
        self.final_ln.forward(&xs[0])
    }
}
