//! How a model's parameter keys map to the tensors of a checkpoint laid out otherwise.

use std::sync::Arc;

/// Where a parameter's values live in a source whose layout differs from the model's key
/// paths (a diffusers folder read by a model named after the original checkpoint's keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// The tensor under another key.
    Key(String),
    /// Tensors concatenated along dim 0, each with its row count, e.g. a fused qkv
    /// projection stored as separate q, k and v. The counts let adapters be split back.
    Cat(Vec<(String, usize)>),
    /// One tensor with its two halves along dim 0 swapped: diffusers stores the final adaLN
    /// projection as (scale, shift) where the original checkpoints have (shift, scale).
    SwapHalves(String),
}

impl KeySource {
    /// The source keys this parameter reads.
    pub fn keys(&self) -> Vec<&str> {
        match self {
            KeySource::Key(k) | KeySource::SwapHalves(k) => vec![k.as_str()],
            KeySource::Cat(ks) => ks.iter().map(|(k, _)| k.as_str()).collect(),
        }
    }
}

/// Maps a model key to its source, or `None` where the layout has no such tensor.
pub type KeyMap = Arc<dyn Fn(&str) -> Option<KeySource> + Send + Sync>;
