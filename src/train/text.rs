//! Text encoders trained with the model (`adapter.text_encoders`): adapters on the named
//! encoders' Linears, those encoders kept loaded on the training device, and the model's text
//! inputs made from them encoded from the captions every step, with gradients through the
//! adapters. Inputs made only from frozen encoders still come from the text cache (Flux's T5
//! `context` when only CLIP-L trains); a frozen encoder whose output joins a trained one's in
//! an input (SDXL's bigG beside a trained CLIP-L in `context`) runs every step too, without
//! adapters.

use super::config::{Toggle, TrainConfig};
use crate::models::pipeline::{
    input_sources, Located, Named, SlotUse, TextConditioner, TextOptions, TokenizerSource,
};
use crate::models::{EncoderSlot, Family, TextEncoderKind};
use crate::nn::adapter::FileSet;
use crate::nn::{Adapters, BatchPart, KeyMap, KeySource};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::Arc;

/// The trained text encoders of a run and the conditioner that runs them.
pub struct TextTraining {
    /// Each trained encoder's slot and adapters, in the family's slot order.
    pub sets: Vec<(&'static EncoderSlot, Arc<Adapters>)>,
    cond: TextConditioner,
    /// The model's text inputs encoded every step (the others come from the cache).
    pub live: Vec<String>,
    /// What is encoded every step and what is cached, for the log.
    pub summary: String,
    /// The encoders' own key paths are their PEFT module names (transformers' names).
    identity: KeyMap,
}

fn cfg_err(msg: String) -> Error {
    Error::Config { path: None, msg }
}

impl TextTraining {
    /// The trained encoders of `config` for `family` on `device` in `dtype`, from
    /// `text_at` set up as `opts` says (`images::locate`, `images::text_options`), or `None`
    /// when `adapter.text_encoders` names none.
    pub fn open(
        config: &TrainConfig,
        family: &'static Family,
        text_at: &[(Located, TokenizerSource)],
        opts: &TextOptions,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Arc<TextTraining>>> {
        let names = &config.adapter.text_encoders;
        if names.is_empty() {
            return Ok(None);
        }
        let slots = family.pipeline.text;
        let slot_names = || slots.iter().map(|s| s.name).collect::<Vec<_>>().join(", ");
        let mut trained = vec![false; slots.len()];
        for n in names {
            let i = slots.iter().position(|s| s.name == n).ok_or_else(|| {
                cfg_err(format!(
                    "adapter.text_encoders: {n:?} is not a text encoder of {} ({})",
                    family.name,
                    slot_names()
                ))
            })?;
            if slots[i].kind != TextEncoderKind::Clip {
                return Err(cfg_err(format!(
                    "adapter.text_encoders: {n:?} is not a CLIP; only CLIP encoders train"
                )));
            }
            trained[i] = true;
        }
        // The inputs made from a trained encoder, and every encoder they are made from.
        let sources = input_sources(family, device)?;
        let live: Vec<(String, Vec<usize>)> = sources
            .into_iter()
            .filter(|(_, from)| from.iter().any(|&i| trained[i]))
            .collect();
        let mut runs = vec![false; slots.len()];
        for (_, from) in &live {
            for &i in from {
                runs[i] = true;
            }
        }
        for (i, slot) in slots.iter().enumerate() {
            if runs[i] && slot.kind == TextEncoderKind::T5 && opts.stream_t5 {
                return Err(cfg_err(format!(
                    "encoders.stream_t5: T5 runs every step with adapter.text_encoders = \
                     {names:?} (its output joins theirs in the model's inputs) and does not \
                     stream while training; set encoders.stream_t5 = \"off\"{}",
                    match config.encoders.stream_t5 {
                        Toggle::Auto => " (\"auto\" chose to stream it under memory.budget_gb)",
                        _ => "",
                    }
                )));
            }
        }
        let mut sets = vec![];
        let mut uses = vec![];
        for (i, slot) in slots.iter().enumerate() {
            uses.push(match (trained[i], runs[i]) {
                (true, _) => {
                    let a = Adapters::new(config.text_adapter_config())?;
                    sets.push((slot, a.clone()));
                    SlotUse::Adapted(a)
                }
                (false, true) => SlotUse::Frozen,
                (false, false) => SlotUse::Skip,
            });
        }
        let cond =
            TextConditioner::load_slots(family, text_at, opts, dtype, device, "encoders", &uses)?;
        for (slot, a) in &sets {
            if a.layers()?.is_empty() {
                return Err(cfg_err(format!(
                    "adapter.text_encoder_targets: {:?} match no layer of {}",
                    a.config.targets, slot.name
                )));
            }
        }
        let live_names: Vec<String> = live.iter().map(|(n, _)| n.clone()).collect();
        let mut said = vec![];
        for (i, s) in slots.iter().enumerate() {
            said.push(match (trained[i], runs[i]) {
                (true, _) => {
                    let n = match sets.iter().find(|(t, _)| t.name == s.name) {
                        Some((_, a)) => a.layers()?.len(),
                        None => 0,
                    };
                    format!("{} trained ({n} adapters)", s.name)
                }
                (false, true) => format!("{} frozen, run every step", s.name),
                (false, false) => format!("{} cached", s.name),
            });
        }
        let summary = format!(
            "text encoders: {}; the inputs {:?} are encoded from the captions every step, the \
             others read from the text cache",
            said.join(", "),
            live_names
        );
        Ok(Some(Arc::new(TextTraining {
            sets,
            cond,
            live: live_names,
            summary,
            identity: Arc::new(|k: &str| Some(KeySource::Key(k.to_string()))),
        })))
    }

    /// The trainable tensors, named `<kohya prefix>.<layer path>.<tensor>`
    /// (`lora_te1.text_model.encoder.layers.0.self_attn.q_proj.lora_down.weight`).
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        let mut v = vec![];
        for (slot, a) in &self.sets {
            v.extend(
                a.params()?
                    .into_iter()
                    .map(|(n, t)| (format!("{}.{n}", slot.kohya), t)),
            );
        }
        Ok(v)
    }

    /// Dropout on (training) or off, for every trained encoder.
    pub fn set_train(&self, on: bool) {
        for (_, a) in &self.sets {
            a.set_train(on);
        }
    }

    /// Puts every trained encoder's dropout at micro-batch `micro` of step `step`.
    pub fn set_batch(&self, step: u64, micro: u64, part: BatchPart) -> Result<()> {
        for (_, a) in &self.sets {
            a.set_batch(step, micro, part)?;
        }
        Ok(())
    }

    /// The live inputs ([`TextTraining::live`]) of `captions`, (B, ...) in `dtype` on
    /// `device`, recording gradients unless under `no_grad`.
    pub fn encode(&self, captions: &[String], dtype: DType, device: &Device) -> Result<Named> {
        let refs: Vec<&str> = captions.iter().map(String::as_str).collect();
        self.cond
            .encode_tracked(&refs)?
            .into_iter()
            .filter(|(n, _)| self.live.contains(n))
            .map(|(n, t)| Ok((n, t.to_device(device)?.to_dtype(dtype)?)))
            .collect()
    }

    /// `cached` (the text cache's inputs) with the live ones encoded now in their place.
    pub fn replace(
        &self,
        cached: Named,
        captions: &[String],
        dtype: DType,
        device: &Device,
    ) -> Result<Named> {
        let live = self.encode(captions, dtype, device)?;
        Ok(cached
            .into_iter()
            .map(|(n, t)| match live.iter().find(|(l, _)| *l == n) {
                Some((_, l)) => (n, l.clone()),
                None => (n, t),
            })
            .collect())
    }

    /// The trained encoders' sets in an adapter file: kohya's `lora_te*` names, the PEFT
    /// layout under the encoders' pipeline folders (`text_encoder`, `text_encoder_2`).
    pub fn file_sets(&self) -> Vec<FileSet<'_>> {
        self.sets
            .iter()
            .map(|(slot, a)| FileSet {
                adapters: a.as_ref(),
                kohya: slot.kohya,
                peft: slot.folder,
                map: &self.identity,
            })
            .collect()
    }
}
