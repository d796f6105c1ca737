//! Caption augmentation: dropout (the sample trains on the empty caption, which teaches the
//! unconditional prediction classifier-free guidance needs) and shuffling of comma-separated
//! tags with the first `keep_tokens` tags kept in place (kohya's `shuffle_caption` and
//! `keep_tokens`). Both are drawn from (seed, epoch, sample id), so they are reproducible and
//! change from epoch to epoch.

use super::{draw, purpose, unit};

/// How captions are changed per epoch.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct CaptionOptions {
    /// The probability, in [0, 1], that a sample's caption is replaced by "".
    pub dropout: f64,
    /// Shuffle the comma-separated tags (joined back with ", ").
    pub shuffle_tags: bool,
    /// With `shuffle_tags`, this many leading tags keep their place.
    pub keep_tokens: usize,
}

impl CaptionOptions {
    /// The caption sample `id` trains on in `epoch`: "" with probability `dropout`, else
    /// `caption` with its tags shuffled (when `shuffle_tags`; tags trimmed, empty tags
    /// dropped) or unchanged.
    pub fn apply(&self, caption: &str, seed: u64, epoch: u64, id: u64) -> String {
        if self.dropout > 0.0
            && unit(draw(seed, &[epoch, id, purpose("caption-dropout")])) < self.dropout
        {
            return String::new();
        }
        if !self.shuffle_tags {
            return caption.to_string();
        }
        let mut tags: Vec<&str> = caption
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .collect();
        let keep = self.keep_tokens.min(tags.len());
        let rest = &mut tags[keep..];
        // Fisher-Yates, one draw per position.
        for i in (1..rest.len()).rev() {
            let r = draw(seed, &[epoch, id, purpose("tag-shuffle"), i as u64]);
            let j = (r % (i as u64 + 1)) as usize;
            rest.swap(i, j);
        }
        tags.join(", ")
    }
}
