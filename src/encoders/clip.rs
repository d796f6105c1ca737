//! The CLIP text encoder (transformers' `CLIPTextModel` / `CLIPTextModelWithProjection`):
//! token + position embeddings, pre-LN layers with causal self-attention, a final LayerNorm,
//! the pooled state at the EOS position and, for bigG, its projection.
//!
//! Model keys are transformers' (`text_model.encoder.layers.N.mlp.fc1.weight`), except that
//! the attention's q, k and v projections are one fused `self_attn.qkv` read through a key
//! map: concatenated from `q_proj`, `k_proj`, `v_proj` in the transformers layout, read as is
//! from OpenCLIP's `attn.in_proj_weight`. Shape letters: B batch, L tokens, D width, H heads,
//! E head width, P projection width.

use super::{detect_prefix, open_files, prefixes_with, EncoderPatch};
use crate::nn::{merge_heads, split_qkv, Adapters, LayerShape};
use crate::nn::{
    scaled_dot_product_attention, Embedding, KeyMap, KeySource, LayerNorm, Linear, VarBuilder,
};
use crate::{DType, Device, Error, Result, Tensor};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The prefix of CLIP-L in SDXL's single file (transformers layout under it).
pub const SDXL_CLIP_L: &str = "conditioner.embedders.0.transformer.";
/// The prefix of OpenCLIP bigG in SDXL's single file (OpenCLIP layout under it).
pub const SDXL_CLIP_G: &str = "conditioner.embedders.1.model.";
/// The prefix of CLIP-L in ComfyUI's all-in-one SD3 / SD3.5 files (transformers layout).
pub const SD3_CLIP_L: &str = "text_encoders.clip_l.transformer.";
/// The prefix of bigG in ComfyUI's all-in-one SD3 / SD3.5 files (transformers layout).
pub const SD3_CLIP_G: &str = "text_encoders.clip_g.transformer.";

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipAct {
    /// `x * sigmoid(1.702 x)` (OpenAI's CLIP-L, transformers `"quick_gelu"`).
    QuickGelu,
    /// Exact (erf) GELU (OpenCLIP's bigG and H, transformers `"gelu"`).
    Gelu,
}

/// How the checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipLayout {
    /// transformers / diffusers / ComfyUI: `text_model.encoder.layers.N.self_attn.q_proj`.
    Transformers,
    /// The same without `text_model.`, as transformers 5 saves a `CLIPTextModel`
    /// (`encoder.layers.N.self_attn.q_proj`).
    TransformersBare,
    /// OpenCLIP (SDXL single file's bigG): `transformer.resblocks.N.attn.in_proj_weight`,
    /// `text_projection` stored (D, P) and applied as `x @ P`.
    OpenClip,
}

/// The text encoder's sizes (transformers `CLIPTextConfig` fields).
#[derive(Clone, Debug, PartialEq)]
pub struct ClipConfig {
    /// Rows of the token embedding (49408 for OpenAI's vocabulary).
    pub vocab_size: usize,
    /// Width D.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of layers.
    pub num_hidden_layers: usize,
    /// Attention heads H.
    pub num_attention_heads: usize,
    /// Rows of the position embedding: the longest input (77).
    pub max_position_embeddings: usize,
    /// LayerNorm epsilon (transformers `CLIPTextConfig` default 1e-5).
    pub layer_norm_eps: f64,
    /// The MLP's activation.
    pub hidden_act: ClipAct,
    /// Decides the pooled position: 2 (the legacy configs of CLIP-L and SDXL's bigG) takes
    /// the position of the largest id (the EOS of OpenAI's vocabulary); any other value the
    /// first position holding this id (transformers' rule).
    pub eos_token_id: u32,
}

impl ClipConfig {
    /// OpenAI CLIP ViT-L/14's text tower (`openai/clip-vit-large-patch14` config.json), the
    /// `text_encoder/` of SD 1.x, SDXL, SD3.5 and Flux.
    pub fn clip_l() -> Self {
        ClipConfig {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            layer_norm_eps: 1e-5,
            hidden_act: ClipAct::QuickGelu,
            eos_token_id: 2,
        }
    }

    /// OpenCLIP ViT-bigG/14's text tower (SDXL's `text_encoder_2/config.json`), with a
    /// 1280 x 1280 `text_projection`.
    pub fn bigg() -> Self {
        ClipConfig {
            hidden_size: 1280,
            intermediate_size: 5120,
            num_hidden_layers: 32,
            num_attention_heads: 20,
            hidden_act: ClipAct::Gelu,
            ..Self::clip_l()
        }
    }

    /// From a transformers `config.json` (`CLIPTextConfig`, or a `CLIPConfig` with a
    /// `text_config`); absent fields take `CLIPTextConfig`'s defaults.
    pub fn from_json(v: &Value, path: Option<&Path>) -> Result<Self> {
        let v = v.get("text_config").unwrap_or(v);
        let fields = crate::encoders::JsonFields::new(v, path);
        let err = |msg: String| fields.err(msg);
        // Defaults: transformers CLIPTextConfig.__init__.
        let int = |name: &str, default: usize| fields.int(name, Some(default));
        let act = match v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("quick_gelu")
        {
            "quick_gelu" => ClipAct::QuickGelu,
            "gelu" => ClipAct::Gelu,
            other => {
                return Err(err(format!(
                    "hidden_act \"{other}\" is not quick_gelu or gelu"
                )))
            }
        };
        let cfg = ClipConfig {
            vocab_size: int("vocab_size", 49408)?,
            hidden_size: int("hidden_size", 512)?,
            intermediate_size: int("intermediate_size", 2048)?,
            num_hidden_layers: int("num_hidden_layers", 12)?,
            num_attention_heads: int("num_attention_heads", 8)?,
            max_position_embeddings: int("max_position_embeddings", 77)?,
            layer_norm_eps: v
                .get("layer_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            hidden_act: act,
            eos_token_id: int("eos_token_id", 49407)? as u32,
        };
        cfg.validate().map_err(err)?;
        Ok(cfg)
    }

    /// Inferred from the shapes of a checkpoint read through [`clip_key_map`] (`vb` at the
    /// model's root): widths from the embeddings and the first MLP, depth from the layers
    /// present. Not in the keys, so assumed: head width 64 (every OpenAI and OpenCLIP text
    /// tower), quick GELU up to width 768 (OpenAI's towers) and GELU above (OpenCLIP's H and
    /// bigG), the legacy EOS rule (`eos_token_id` 2) and eps 1e-5.
    pub fn from_shapes(vb: &VarBuilder) -> Result<Self> {
        let tm = vb.pp("text_model");
        let shape = |vb: &VarBuilder, name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: vb.key(name),
                file: None,
                msg: "missing: cannot infer the CLIP config".into(),
            })
        };
        let tok = shape(&tm.pp("embeddings").pp("token_embedding"), "weight")?;
        let pos = shape(&tm.pp("embeddings").pp("position_embedding"), "weight")?;
        let layers = tm.pp("encoder").pp("layers");
        let depth = (0..)
            .take_while(|i| layers.pp(i).pp("layer_norm1").contains("weight"))
            .count();
        let fc1 = shape(&layers.pp(0).pp("mlp").pp("fc1"), "weight")?;
        let (vocab, d) = (tok[0], tok[1]);
        if d % 64 != 0 {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "CLIP width {d} is not a multiple of 64: the head count cannot be inferred, \
                     give a config"
                ),
            });
        }
        let cfg = ClipConfig {
            vocab_size: vocab,
            hidden_size: d,
            intermediate_size: fc1[0],
            num_hidden_layers: depth,
            num_attention_heads: d / 64,
            max_position_embeddings: pos[0],
            layer_norm_eps: 1e-5,
            hidden_act: if d <= 768 {
                ClipAct::QuickGelu
            } else {
                ClipAct::Gelu
            },
            eos_token_id: 2,
        };
        cfg.validate()
            .map_err(|msg| Error::Config { path: None, msg })?;
        Ok(cfg)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let h = self.num_attention_heads;
        if h == 0 || self.hidden_size % h != 0 || self.num_hidden_layers == 0 {
            return Err(format!(
                "CLIP: width {} must split into {h} heads, with at least one layer (have {})",
                self.hidden_size, self.num_hidden_layers
            ));
        }
        Ok(())
    }
}

/// The key map of a CLIP checkpoint whose tensors sit under `prefix` in `layout`: model key
/// (transformers names with a fused `self_attn.qkv`) -> source key(s). `hidden` is D, the
/// row count of each of q, k and v.
pub fn clip_key_map(layout: ClipLayout, prefix: &str, hidden: usize) -> KeyMap {
    let prefix = prefix.to_string();
    Arc::new(move |key: &str| {
        let src = |k: String| Some(KeySource::Key(format!("{prefix}{k}")));
        let key = match layout {
            ClipLayout::TransformersBare => key.strip_prefix("text_model.").unwrap_or(key),
            _ => key,
        };
        match layout {
            ClipLayout::Transformers | ClipLayout::TransformersBare => {
                match key.split_once(".self_attn.qkv.") {
                    Some((layer, leaf)) => Some(KeySource::Cat(
                        ["q", "k", "v"]
                            .iter()
                            .map(|p| (format!("{prefix}{layer}.self_attn.{p}_proj.{leaf}"), hidden))
                            .collect(),
                    )),
                    None => src(key.to_string()),
                }
            }
            ClipLayout::OpenClip => src(open_clip_key(key)?),
        }
    })
}

/// A model key in OpenCLIP's names (after the prefix), `None` for keys OpenCLIP lacks.
fn open_clip_key(key: &str) -> Option<String> {
    let fixed = [
        (
            "text_model.embeddings.token_embedding.weight",
            "token_embedding.weight",
        ),
        (
            "text_model.embeddings.position_embedding.weight",
            "positional_embedding",
        ),
        ("text_model.final_layer_norm.weight", "ln_final.weight"),
        ("text_model.final_layer_norm.bias", "ln_final.bias"),
        ("text_projection.weight", "text_projection"),
    ];
    if let Some((_, k)) = fixed.iter().find(|(m, _)| *m == key) {
        return Some(k.to_string());
    }
    let rest = key.strip_prefix("text_model.encoder.layers.")?;
    let (n, rest) = rest.split_once('.')?;
    let (module, leaf) = rest.rsplit_once('.')?;
    let m = match module {
        "self_attn.qkv" => return Some(format!("transformer.resblocks.{n}.attn.in_proj_{leaf}")),
        "self_attn.out_proj" => "attn.out_proj",
        "layer_norm1" => "ln_1",
        "layer_norm2" => "ln_2",
        "mlp.fc1" => "mlp.c_fc",
        "mlp.fc2" => "mlp.c_proj",
        _ => return None,
    };
    Some(format!("transformer.resblocks.{n}.{m}.{leaf}"))
}

/// The attention's input projections.
#[derive(Clone, Debug)]
enum Qkv {
    /// One (3D, D) projection: the frozen encoder.
    Fused(Linear),
    /// `q_proj`, `k_proj` and `v_proj` apart, rows of the fused weight: an encoder with
    /// adapters planned, each projection asking for its own under transformers' name (as
    /// PEFT and kohya adapt CLIP).
    Split([Linear; 3]),
}

impl Qkv {
    /// `attn` the layer's `self_attn` builder, `d` the width.
    fn new(attn: &VarBuilder, d: usize) -> Result<Self> {
        let fused = attn.pp("qkv");
        if attn.adapters().is_none() {
            return Ok(Qkv::Fused(Linear::new(&fused, d, 3 * d, true)?));
        }
        let (w, packing) = fused.get_linear_weight(3 * d, d, "weight")?;
        let w = match packing {
            Some(p) => p.decode(&w, attn.dtype())?,
            None => w,
        };
        let b = fused.get(3 * d, "bias")?;
        let part = |i: usize, name: &str| -> Result<Linear> {
            Ok(Linear {
                weight: w.narrow(0, i * d, d)?.contiguous()?,
                bias: Some(b.narrow(0, i * d, d)?.contiguous()?),
                adapter: attn.pp(name).adapter(
                    LayerShape::Linear {
                        in_dim: d,
                        out_dim: d,
                    },
                    true,
                )?,
                packing: None,
            })
        };
        Ok(Qkv::Split([
            part(0, "q_proj")?,
            part(1, "k_proj")?,
            part(2, "v_proj")?,
        ]))
    }

    /// x (B, L, D) -> (B, L, 3D).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Qkv::Fused(l) => l.forward(x),
            Qkv::Split([q, k, v]) => {
                let (q, k, v) = (q.forward(x)?, k.forward(x)?, v.forward(x)?);
                Tensor::cat(&[&q, &k, &v], 2)
            }
        }
    }
}

/// One pre-LN layer: `x + attn(ln1 x)`, then `x + mlp(ln2 x)`.
#[derive(Clone, Debug)]
struct ClipLayer {
    ln1: LayerNorm,
    qkv: Qkv,
    out: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    heads: usize,
    act: ClipAct,
}

impl ClipLayer {
    fn new(vb: &VarBuilder, cfg: &ClipConfig) -> Result<Self> {
        let (d, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        let attn = vb.pp("self_attn");
        Ok(ClipLayer {
            ln1: LayerNorm::new(&vb.pp("layer_norm1"), d, eps, true)?,
            qkv: Qkv::new(&attn, d)?,
            out: Linear::new(&attn.pp("out_proj"), d, d, true)?,
            ln2: LayerNorm::new(&vb.pp("layer_norm2"), d, eps, true)?,
            fc1: Linear::new(&vb.pp("mlp").pp("fc1"), d, cfg.intermediate_size, true)?,
            fc2: Linear::new(&vb.pp("mlp").pp("fc2"), cfg.intermediate_size, d, true)?,
            heads: cfg.num_attention_heads,
            act: cfg.hidden_act,
        })
    }

    /// x (B, L, D), mask (B, L) or none -> (B, L, D).
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (q, k, v) = split_qkv(&self.qkv.forward(&self.ln1.forward(x)?)?, self.heads)?;
        // Causal, scaled by 1 / sqrt(E) (transformers CLIPAttention).
        let a = scaled_dot_product_attention(&q, &k, &v, mask, true, None)?;
        let x = x.add(&self.out.forward(&merge_heads(&a)?)?)?;
        let h = self.fc1.forward(&self.ln2.forward(&x)?)?;
        let h = match self.act {
            // quick_gelu(x) = x * sigmoid(1.702 x) (transformers QuickGELUActivation).
            ClipAct::QuickGelu => h.mul(&h.affine(1.702, 0.0)?.sigmoid()?)?,
            ClipAct::Gelu => h.gelu()?,
        };
        x.add(&self.fc2.forward(&h)?)
    }
}

/// What the encoder returns for a batch of ids.
#[derive(Clone, Debug)]
pub struct ClipOutput {
    /// The last layer's output after the final LayerNorm (B, L, D): `last_hidden_state`.
    pub last_hidden: Tensor,
    /// The input of the last layer, not normalized (B, L, D): `hidden_states[-2]`, what SDXL
    /// and SD3 condition on.
    pub penultimate: Tensor,
    /// `last_hidden` at each row's EOS position (B, D): `pooler_output`.
    pub pooled: Tensor,
    /// `pooled` through `text_projection` (B, P), when the checkpoint has one (bigG; CLIP-L
    /// in SD3's `text_encoder/`, not in SD3's single files, whose pipelines use the identity,
    /// i.e. `pooled`): `text_embeds`.
    pub projected: Option<Tensor>,
}

/// The CLIP text encoder with its weights.
#[derive(Clone, Debug)]
pub struct ClipTextModel {
    /// The sizes it was built with.
    pub config: ClipConfig,
    token_embedding: Embedding,
    /// (max_position_embeddings, D).
    position_embedding: Tensor,
    layers: Vec<ClipLayer>,
    final_ln: LayerNorm,
    /// `text_projection` as a Linear (P, D), when present.
    projection: Option<Linear>,
}

/// Every CLIP text encoder among `keys` (a file's keys as stored): its prefix and layout.
pub(crate) fn clip_candidates(keys: &[String]) -> Vec<(String, ClipLayout)> {
    prefixes_with(keys, "embeddings.token_embedding.weight")
        .into_iter()
        .map(|p| match p.strip_suffix("text_model.") {
            Some(outer) => (outer.to_string(), ClipLayout::Transformers),
            None => (p, ClipLayout::TransformersBare),
        })
        .chain(
            prefixes_with(keys, "positional_embedding")
                .into_iter()
                .filter(|p| keys.contains(&format!("{p}token_embedding.weight")))
                .map(|p| (p, ClipLayout::OpenClip)),
        )
        .collect()
}

impl ClipLayout {
    /// The token embedding's key under the encoder's prefix: a (vocab, width) matrix.
    pub fn token_embedding(self) -> &'static str {
        match self {
            ClipLayout::Transformers => "text_model.embeddings.token_embedding.weight",
            ClipLayout::TransformersBare => "embeddings.token_embedding.weight",
            ClipLayout::OpenClip => "token_embedding.weight",
        }
    }
}

impl ClipTextModel {
    /// The model from `vb` at its root, read through [`clip_key_map`] for `layout` (which
    /// says how `text_projection` is stored). The projection is loaded when the source has it.
    pub fn new(vb: &VarBuilder, cfg: &ClipConfig, layout: ClipLayout) -> Result<Self> {
        let d = cfg.hidden_size;
        let tm = vb.pp("text_model");
        let emb = tm.pp("embeddings");
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| ClipLayer::new(&tm.pp("encoder").pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let proj = vb.pp("text_projection");
        let projection = match proj.shape_of("weight") {
            None => None,
            Some(s) => {
                let weight = match layout {
                    // (P, D), applied as x W^T.
                    ClipLayout::Transformers | ClipLayout::TransformersBare => {
                        proj.get((s[0], d), "weight")?
                    }
                    // (D, P), applied as x P: the Linear weight is its transpose.
                    ClipLayout::OpenClip => proj.get((d, s[1]), "weight")?.t()?.contiguous()?,
                };
                Some(Linear {
                    packing: None,
                    weight,
                    bias: None,
                    adapter: None,
                })
            }
        };
        Ok(ClipTextModel {
            token_embedding: Embedding::new(&emb.pp("token_embedding"), cfg.vocab_size, d)?,
            position_embedding: emb
                .pp("position_embedding")
                .get((cfg.max_position_embeddings, d), "weight")?,
            layers,
            final_ln: LayerNorm::new(&tm.pp("final_layer_norm"), d, cfg.layer_norm_eps, true)?,
            projection,
            config: cfg.clone(),
        })
    }

    /// Loads a CLIP text encoder from `path`: a transformers / diffusers folder
    /// (`text_encoder/`: config.json beside model.safetensors or its shards) or a single
    /// .safetensors file. In a file holding several encoders (SDXL's, SD3.5's) `prefix` picks
    /// one (e.g. [`SDXL_CLIP_G`]); without it the file must hold exactly one CLIP, found by
    /// its keys in either layout. `config` overrides config.json or the shape inference of
    /// [`ClipConfig::from_shapes`].
    pub fn load(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<ClipConfig>,
    ) -> Result<(Self, VarBuilder)> {
        Self::load_adapted(path, prefix, dtype, device, config, None)
    }

    /// [`load`](Self::load) with `adapters` planned on its Linears (key paths in
    /// transformers' names: `text_model.encoder.layers.N.self_attn.q_proj`, `...mlp.fc1`),
    /// the attention's q, k and v projections then apart.
    pub fn load_adapted(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<ClipConfig>,
        adapters: Option<Arc<Adapters>>,
    ) -> Result<(Self, VarBuilder)> {
        let patch = EncoderPatch {
            adapters,
            merge: None,
        };
        Self::load_patched(path, prefix, dtype, device, config, patch)
    }

    /// [`load`](Self::load) with `patch` on its Linears: adapters planned (as
    /// [`load_adapted`](Self::load_adapted)), and or an adapter file merged into the weights,
    /// read in transformers' names (q, k and v apart: `self_attn.q_proj`, ...).
    pub fn load_patched(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        dtype: DType,
        device: &Device,
        config: Option<ClipConfig>,
        patch: EncoderPatch,
    ) -> Result<(Self, VarBuilder)> {
        let (raw, config) = open_files(
            path.as_ref(),
            prefix.is_some(),
            dtype,
            device,
            config,
            ClipConfig::from_json,
        )?;
        let raw = patch.apply(raw)?;
        Self::load_from(raw, path.as_ref(), prefix, config)
    }

    /// What [`load`](Self::load) does once the files are open: `raw` is a builder over the
    /// checkpoint's keys as stored (no key map), `origin` the file or folder they came from
    /// (named in errors). Finds the encoder's prefix and layout by its keys, maps them, takes
    /// `config` or infers one from the shapes, and builds the model. Any source works: tensors
    /// in memory, or [`VarBuilder::from_shapes`] to check a layout without its weights.
    pub fn load_from(
        raw: VarBuilder,
        origin: &Path,
        prefix: Option<&str>,
        config: Option<ClipConfig>,
    ) -> Result<(Self, VarBuilder)> {
        let keys = raw.source_keys();
        let candidates = clip_candidates(&keys);
        let (prefix, layout) = detect_prefix(origin, "CLIP text encoder", candidates, prefix)?;
        let tok_key = layout.token_embedding();
        let d = raw
            .shape_of(&format!("{prefix}{tok_key}"))
            .and_then(|s| s.get(1).copied())
            .ok_or_else(|| Error::Param {
                key: format!("{prefix}{tok_key}"),
                file: Some(origin.to_path_buf()),
                msg: "is not a (vocab, width) matrix".into(),
            })?;
        // A merged file names the layers in transformers' words, q, k and v apart.
        if let Some(m) = raw.merge() {
            m.set_diffusers_map(clip_key_map(ClipLayout::Transformers, "", d))?;
        }
        let vb = raw.with_key_map(clip_key_map(layout, &prefix, d))?;
        let cfg = match config {
            Some(c) => c,
            None => ClipConfig::from_shapes(&vb)?,
        };
        let model = Self::new(&vb, &cfg, layout)?;
        Ok((model, vb))
    }

    /// ids (B, L) u32 with L <= max_position_embeddings, and an optional key padding mask
    /// (B, L) (0 hides a key; diffusers' pipelines pass none) -> the hidden states, pooled
    /// and projected outputs.
    pub fn forward(&self, ids: &Tensor, mask: Option<&Tensor>) -> Result<ClipOutput> {
        let (b, l) = match ids.dims() {
            &[b, l]
                if ids.dtype() == DType::U32
                    && l > 0
                    && l <= self.config.max_position_embeddings =>
            {
                (b, l)
            }
            _ => {
                return Err(Error::invalid(
                    "ClipTextModel::forward",
                    format!(
                        "ids must be (B, L) u32 with 0 < L <= {}, got {:?}",
                        self.config.max_position_embeddings,
                        ids.dtype()
                    ),
                    ids.shape(),
                ))
            }
        };
        let d = self.config.hidden_size;
        let pos = self.position_embedding.narrow(0, 0, l)?.unsqueeze(0)?;
        let mut x = self.token_embedding.forward(ids)?.add(&pos)?; // (B, L, D)
        let mut penultimate = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            if i + 1 == self.layers.len() {
                penultimate = x.clone();
            }
            x = layer.forward(&x, mask)?;
        }
        let last_hidden = self.final_ln.forward(&x)?;
        let rows = self
            .eos_positions(ids)?
            .iter()
            .enumerate()
            .map(|(i, &p)| (i * l + p) as u32)
            .collect::<Vec<_>>();
        let rows = Tensor::from_vec(rows, b, ids.device())?;
        let pooled = last_hidden.reshape((b * l, d))?.index_select(&rows, 0)?; // (B, D)
        let projected = match &self.projection {
            Some(p) => Some(p.forward(&pooled)?),
            None => None,
        };
        Ok(ClipOutput {
            last_hidden,
            penultimate,
            pooled,
            projected,
        })
    }

    /// Each row's pooled position (transformers `CLIPTextTransformer`): with the legacy
    /// `eos_token_id` 2, the first position of the row's largest id; otherwise the first
    /// position holding `eos_token_id` (0 when none does, as `argmax` of all-false gives).
    pub fn eos_positions(&self, ids: &Tensor) -> Result<Vec<usize>> {
        let l = ids.dims().get(1).copied().unwrap_or(0);
        let host = ids.to_vec::<u32>()?;
        let eos = self.config.eos_token_id;
        Ok(host
            .chunks(l.max(1))
            .map(|row| {
                if eos == 2 {
                    let max = row.iter().copied().max().unwrap_or(0);
                    row.iter().position(|&t| t == max).unwrap_or(0)
                } else {
                    row.iter().position(|&t| t == eos).unwrap_or(0)
                }
            })
            .collect())
    }
}
