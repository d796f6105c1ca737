//! Text encoders trained with the model (`adapter.text_encoders`): adapters on the named
//! encoders' Linears, those encoders kept loaded on the training device, and the model's text
//! inputs made from them encoded from the captions every step, with gradients through the
//! adapters. Inputs made only from frozen encoders still come from the text cache (Flux's T5
//! `context` when only CLIP-L trains); a frozen encoder whose output joins a trained one's in
//! an input (SDXL's bigG beside a trained CLIP-L in `context`) runs every step too, without
//! adapters.

use super::config::TrainConfig;
use crate::memory::MemoryProfile;
use crate::models::pipeline::{
    encoder_device_bytes, input_sources, peft_map, EncoderDims, Located, Named, SlotUse,
    TextConditioner, TextOptions, TokenizerSource,
};
use crate::models::{EncoderSlot, Family, TextEncoderKind};
use crate::nn::adapter::FileSet;
use crate::nn::{Adapters, BatchPart, KeyMap};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::Arc;

/// The trained text encoders of a run and the conditioner that runs them.
pub struct TextTraining {
    /// Each trained encoder's slot, adapters and the map of their key paths to the PEFT
    /// layout's module names ([`peft_map`]), in the family's slot order.
    pub sets: Vec<(&'static EncoderSlot, Arc<Adapters>, KeyMap)>,
    cond: TextConditioner,
    /// The model's text inputs encoded every step (the others come from the cache).
    pub live: Vec<String>,
    /// What is encoded every step and what is cached, for the log.
    pub summary: String,
    /// The encoders run every step, for the memory plan ([`TextTraining::step_bytes`]).
    running: Vec<Running>,
}

/// An encoder run every step: its device bytes and, when trained, its sizes, tokens per
/// caption and whether it streams.
struct Running {
    name: &'static str,
    weight_bytes: u64,
    trained: Option<(EncoderDims, usize, bool)>,
}

/// What the trained text encoders hold on the device during a training step, in bytes: the
/// memory plan counts each beside the diffusion model's ([`TextStepBytes::add_to`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextStepBytes {
    /// The weights of every encoder run every step (trained, or frozen beside a trained
    /// one), about: their files, the share on the device where one streams.
    pub weights: u64,
    /// The adapters' values (their gradients take as much again).
    pub trainable: u64,
    /// The optimizer's state of the adapters (and the moving average's where it is on the
    /// device).
    pub optimizer: u64,
    /// The activations the trained encoders keep for their backward, about.
    pub activations: u64,
    /// Per encoder: (slot name, weight bytes), for the plan's words.
    pub encoders: Vec<(&'static str, u64)>,
}

impl TextStepBytes {
    /// Everything at once: the weights, the adapters and their gradients, the optimizer's
    /// state and the activations.
    pub fn total(&self) -> u64 {
        self.weights + 2 * self.trainable + self.optimizer + self.activations
    }

    /// `prof` with these bytes added where a step holds them: the weights beside the
    /// model's always-resident ones, the adapters beside its trainable values (the profile
    /// counts their gradients), the optimizer's state beside its, the activations with
    /// the step's fixed bytes.
    pub fn add_to(&self, prof: &mut MemoryProfile) {
        prof.other_weight_bytes += self.weights;
        prof.trainable_bytes += self.trainable;
        prof.optimizer_bytes += self.optimizer;
        prof.fixed_bytes += self.activations;
    }

    /// The bytes in words, for the plan.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "trained text encoders {:.3} GiB in the step ({}; adapters {:.3} GiB and their \
             gradients as much, optimizer state {:.3} GiB, activations kept for the backward \
             {:.3} GiB)",
            gib(self.total()),
            self.encoders
                .iter()
                .map(|(n, b)| format!("{n} weights {:.3} GiB", gib(*b)))
                .collect::<Vec<_>>()
                .join(", "),
            gib(self.trainable),
            gib(self.optimizer),
            gib(self.activations)
        )
    }
}

/// Values an encoder of `d` keeps for its backward for one caption of `tokens` tokens with
/// adapters on its Linears, about: per layer and token the norms' inputs and outputs and the
/// residual (6 widths), q, k, v and the attention's output (4 inner widths), the MLP's
/// input projections, activation and product (4 hidden widths gated, 2 plain), and per head
/// the scores and their softmax (2 L). Streamed (its layers checkpointed), each layer's input
/// and one layer's worth recomputed at a time.
pub fn kept_values(d: &EncoderDims, tokens: usize, streamed: bool) -> usize {
    let mlp = if d.gated { 4 } else { 2 } * d.mlp;
    let layer = tokens * (6 * d.width + 4 * d.attention + mlp) + 2 * d.heads * tokens * tokens;
    match streamed {
        true => d.layers * tokens * d.width + layer,
        false => d.layers * layer,
    }
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
            trained[i] = true;
        }
        // The inputs made from a trained encoder, and every encoder they are made from (a
        // Qwen3 family's one encoder makes all its inputs: found once it is loaded).
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
        let qwen3 = slots
            .iter()
            .any(|s| matches!(s.kind, TextEncoderKind::Qwen3(_)));
        if qwen3 {
            runs = trained.clone();
        }
        let mut sets = vec![];
        let mut uses = vec![];
        for (i, slot) in slots.iter().enumerate() {
            uses.push(match (trained[i], runs[i]) {
                (true, _) => {
                    let a = Adapters::new(config.text_adapter_config(slot.kind))?;
                    sets.push((slot, a.clone(), peft_map(slot)));
                    SlotUse::Adapted(a)
                }
                (false, true) => SlotUse::Frozen,
                (false, false) => SlotUse::Skip,
            });
        }
        let cond =
            TextConditioner::load_slots(family, text_at, opts, dtype, device, "encoders", &uses)?;
        for (slot, a, _) in &sets {
            if a.layers()?.is_empty() {
                return Err(cfg_err(format!(
                    "adapter.text_encoder_targets: {:?} match no layer of {}",
                    a.config.targets, slot.name
                )));
            }
        }
        let mut running = vec![];
        for (i, slot) in slots.iter().enumerate() {
            if !runs[i] {
                continue;
            }
            let path = &text_at
                .get(i)
                .ok_or_else(|| cfg_err(format!("{}: not located", slot.name)))?
                .0
                .path;
            let streamed = match slot.kind {
                TextEncoderKind::T5 => opts.stream_t5,
                TextEncoderKind::Qwen3(_) => opts.stream_qwen3,
                TextEncoderKind::Clip => false,
            };
            running.push(Running {
                name: slot.name,
                weight_bytes: encoder_device_bytes(slot.kind, path, opts),
                trained: match (trained[i], cond.dims(i)) {
                    (true, Some(d)) => Some((d, slot.len(opts.guided, opts.t5_tokens), streamed)),
                    _ => None,
                },
            });
        }
        let live_names: Vec<String> = match qwen3 {
            true => cond.encode(&[""])?.into_iter().map(|(n, _)| n).collect(),
            false => live.iter().map(|(n, _)| n.clone()).collect(),
        };
        let mut said = vec![];
        for (i, s) in slots.iter().enumerate() {
            said.push(match (trained[i], runs[i]) {
                (true, _) => {
                    let n = match sets.iter().find(|(t, _, _)| t.name == s.name) {
                        Some((_, a, _)) => a.layers()?.len(),
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
            running,
        })))
    }

    /// The trainable tensors, named `<kohya prefix>.<layer path>.<tensor>`
    /// (`lora_te1.text_model.encoder.layers.0.self_attn.q_proj.lora_down.weight`).
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        let mut v = vec![];
        for (slot, a, _) in &self.sets {
            v.extend(
                a.params()?
                    .into_iter()
                    .map(|(n, t)| (format!("{}.{n}", slot.kohya), t)),
            );
        }
        Ok(v)
    }

    /// What the trained encoders hold on the device in a step of `batch` captions, with
    /// `state_per_value` bytes of optimizer state per adapter value
    /// ([`TextStepBytes`]), activations in `dtype`.
    pub fn step_bytes(
        &self,
        batch: usize,
        state_per_value: f64,
        dtype: DType,
    ) -> Result<TextStepBytes> {
        let mut values = 0usize;
        let mut trainable = 0u64;
        for (_, t) in self.params()? {
            values += t.elem_count();
            trainable += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        }
        let mut out = TextStepBytes {
            trainable,
            optimizer: (values as f64 * state_per_value) as u64,
            ..TextStepBytes::default()
        };
        for r in &self.running {
            out.weights += r.weight_bytes;
            out.encoders.push((r.name, r.weight_bytes));
            if let Some((d, tokens, streamed)) = &r.trained {
                out.activations += (kept_values(d, *tokens, *streamed)
                    * batch.max(1)
                    * dtype.size_in_bytes()) as u64;
            }
        }
        Ok(out)
    }

    /// Dropout on (training) or off, for every trained encoder.
    pub fn set_train(&self, on: bool) {
        for (_, a, _) in &self.sets {
            a.set_train(on);
        }
    }

    /// Puts every trained encoder's dropout at micro-batch `micro` of step `step`.
    pub fn set_batch(&self, step: u64, micro: u64, part: BatchPart) -> Result<()> {
        for (_, a, _) in &self.sets {
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
            .map(|(slot, a, map)| FileSet {
                adapters: a.as_ref(),
                kohya: slot.kohya,
                peft: slot.folder,
                map,
            })
            .collect()
    }
}
