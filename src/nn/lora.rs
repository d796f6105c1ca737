//! LoRA adapters on Linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
//! Language Models"): y = x W^T + b + (alpha / rank) · dropout(x) A^T B^T, with A = `down`
//! (rank, in) and B = `up` (out, rank). A starts Kaiming-uniform, B at zero, so a fresh
//! adapter leaves the model unchanged. The base weights stay frozen: only A and B need
//! gradients (and, through the autograd's saving rules, the activations feeding frozen
//! weights are not kept for them).
//!
//! Adapters are planned on a `VarBuilder` (`with_adapters`) before the model is built: every
//! `Linear` whose key path matches a pattern gets one, named by that path
//! (`double_blocks.0.img_attn.qkv`). Parameters are f32 whatever the model's dtype (the
//! optimizer updates f32 values; the forward casts to the activations' dtype).

use super::layers::Dropout;
use super::seed::key_hash;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Which layers get adapters and their hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Inner dimension r of A (r, in) and B (out, r); positive.
    pub rank: usize,
    /// Scale alpha / rank (kohya and PEFT convention).
    pub alpha: f64,
    /// Dropout on the adapter's input during training.
    pub dropout: f64,
    /// Module path patterns; `*` matches any run of characters (dots included), e.g.
    /// `double_blocks.*.img_attn.qkv` or `*attn*`. A layer matching any pattern is adapted.
    pub targets: Vec<String>,
    /// Seed of the initial A matrices (mixed with each layer's path) and of the dropout.
    pub seed: u64,
}

impl LoraConfig {
    /// Checks rank > 0, dropout in `[0, 1)`, alpha finite and positive, and some target.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        if self.rank == 0 {
            return bad("lora: rank must be positive".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("lora: dropout {} is not in [0, 1)", self.dropout));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad(format!("lora: alpha {} must be positive", self.alpha));
        }
        if self.targets.is_empty() {
            return bad("lora: no target patterns".into());
        }
        Ok(())
    }

    /// Whether the layer at key path `path` matches any target pattern.
    pub fn matches(&self, path: &str) -> bool {
        self.targets
            .iter()
            .any(|p| glob(p.as_bytes(), path.as_bytes()))
    }
}

/// `*` matches any run of bytes; everything else matches itself.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// One layer's adapter.
#[derive(Debug)]
pub struct Lora {
    /// The adapted layer's key path.
    pub path: String,
    /// A: (rank, in), f32, trainable.
    pub down: Tensor,
    /// B: (out, rank), f32, trainable.
    pub up: Tensor,
    /// The config's alpha; the term is scaled by alpha / rank.
    pub alpha: f64,
    dropout: Dropout,
    /// Shared with the model's `Adapters`: dropout only while training.
    train: Arc<AtomicBool>,
}

impl Lora {
    /// A fresh adapter for a layer (in -> out): A ~ U(-1/sqrt(in), 1/sqrt(in)) (PyTorch's
    /// `kaiming_uniform_(a=sqrt(5))`, as PEFT initialises lora_A), B = 0.
    pub fn new(
        path: &str,
        in_dim: usize,
        out_dim: usize,
        cfg: &LoraConfig,
        device: &Device,
        train: Arc<AtomicBool>,
    ) -> Result<Self> {
        if cfg.rank > in_dim.min(out_dim) {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "adapter.rank = {}: layer {path} maps {in_dim} -> {out_dim}; a LoRA rank \
                     must be at most the smaller width, {}",
                    cfg.rank,
                    in_dim.min(out_dim)
                ),
            });
        }
        let bound = 1.0 / (in_dim as f64).sqrt();
        let seed = cfg.seed ^ key_hash(path);
        let down =
            Tensor::rand_uniform(-bound, bound, (cfg.rank, in_dim), DType::F32, device, seed)?
                .requires_grad_()?;
        let up = Tensor::zeros((out_dim, cfg.rank), DType::F32, device)?.requires_grad_()?;
        Ok(Lora {
            path: path.to_string(),
            down,
            up,
            alpha: cfg.alpha,
            dropout: Dropout::new(cfg.dropout, seed.rotate_left(17))?,
            train,
        })
    }

    /// The adapter's rank r.
    pub fn rank(&self) -> usize {
        self.down.dims()[0]
    }

    /// alpha / rank.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank() as f64
    }

    /// The adapter's term for x (rows, in) -> (rows, out), in x's dtype.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let x = self
            .dropout
            .forward(x, self.train.load(Ordering::Relaxed))?;
        let (a, b) = (self.down.to_dtype(x.dtype())?, self.up.to_dtype(x.dtype())?);
        x.matmul(&a.t()?)?
            .matmul(&b.t()?)?
            .affine(self.scale(), 0.0)
    }

    /// B A · scale (out, in) in f32: the weight change the adapter stands for.
    pub fn merged_delta(&self) -> Result<Tensor> {
        self.up.matmul(&self.down)?.affine(self.scale(), 0.0)
    }
}

/// The adapters of one model, planned by a config and filled as its layers are built.
#[derive(Debug)]
pub struct Adapters {
    /// The (validated) config every adapter is made from.
    pub config: LoraConfig,
    layers: Mutex<BTreeMap<String, Arc<Lora>>>,
    train: Arc<AtomicBool>,
}

impl Adapters {
    /// An empty set for `config` (validated first), in training mode.
    pub fn new(config: LoraConfig) -> Result<Arc<Self>> {
        config.validate()?;
        Ok(Arc::new(Adapters {
            config,
            layers: Mutex::new(BTreeMap::new()),
            train: Arc::new(AtomicBool::new(true)),
        }))
    }

    /// The adapter of the layer at `path` (in -> out), made on first request when the path
    /// matches a target; `None` for layers not targeted.
    pub fn for_layer(
        &self,
        path: &str,
        in_dim: usize,
        out_dim: usize,
        device: &Device,
    ) -> Result<Option<Arc<Lora>>> {
        if !self.config.matches(path) {
            return Ok(None);
        }
        let mut layers = self
            .layers
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?;
        if let Some(l) = layers.get(path) {
            return Ok(Some(l.clone()));
        }
        let l = Arc::new(Lora::new(
            path,
            in_dim,
            out_dim,
            &self.config,
            device,
            self.train.clone(),
        )?);
        layers.insert(path.to_string(), l.clone());
        Ok(Some(l))
    }

    /// Every adapter by layer path, sorted.
    pub fn layers(&self) -> Result<Vec<Arc<Lora>>> {
        let layers = self
            .layers
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?;
        Ok(layers.values().cloned().collect())
    }

    /// The trainable tensors with names `<path>.lora_down.weight` / `.lora_up.weight`: what
    /// an optimizer takes.
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .layers()?
            .iter()
            .flat_map(|l| {
                [
                    (format!("{}.lora_down.weight", l.path), l.down.clone()),
                    (format!("{}.lora_up.weight", l.path), l.up.clone()),
                ]
            })
            .collect())
    }

    /// Puts every adapter's dropout at the start of training step `step` (its masks are then
    /// a function of the seed, the step and the call order within the step, so a resumed run
    /// repeats them).
    pub fn set_step(&self, step: u64) -> Result<()> {
        for l in self.layers()? {
            l.dropout.set_calls(step << 24);
        }
        Ok(())
    }

    /// Dropout on (training) or off (inference).
    pub fn set_train(&self, on: bool) {
        self.train.store(on, Ordering::Relaxed)
    }

    /// Whether dropout is on (training mode).
    pub fn training(&self) -> bool {
        self.train.load(Ordering::Relaxed)
    }
}
