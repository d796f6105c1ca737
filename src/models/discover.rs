//! One path to a model: a ComfyUI `models/` folder, a Hugging Face hub cache folder
//! (`models--org--name/` with `snapshots/<hash>/` and `refs/main`) or one of its snapshots, a
//! diffusers pipeline folder, or a single file. In a folder that is not a diffusers pipeline,
//! the diffusion model, the text encoders and the autoencoder are found by their keys and
//! shapes (each `.safetensors` / `.gguf` header read, no weight), never by file names: a
//! family's model by [`Family::holds_model`] (its signature, or the diffusers model's names
//! in one file, as BFL's FP8 FLUX.2 \[klein\] files have them), the encoders by the keys their
//! loaders look for
//! ([`crate::encoders::recognise`]). Of several autoencoders (a ComfyUI `vae/` folder holding
//! FLUX.1's, FLUX.2's, SDXL's and SD3.5's), the one whose structure is the family's kind and
//! whose latent channels are the model's input's is picked, then one whose config has the
//! kind's `scaling_factor`; the log names it and each one passed over, with why. Two
//! candidates for one role that fit equally are refused, naming both and the config key that
//! settles it; a role with none is refused, naming it.

use super::checkpoint::LDM_PREFIX;
use super::family::Family;
use super::spec::TextEncoderKind;
use crate::encoders::{recognise, Recognised, VaeKind};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The config keys (or flags) errors name: the model's path, its family, the text
/// encoders' and the autoencoder's paths.
#[derive(Clone, Copy, Debug)]
pub struct Keys<'a> {
    /// The model's path (`model.path`, `--model`).
    pub model: &'a str,
    /// The family (`model.arch`, `--arch`).
    pub arch: &'a str,
    /// The text encoders (`encoders.text`, `--text-encoder`).
    pub text: &'a str,
    /// The autoencoder (`encoders.vae`, `--vae`).
    pub vae: &'a str,
}

/// What was found at a model path.
#[derive(Clone, Debug)]
pub struct Discovery {
    /// The model's family.
    pub family: &'static Family,
    /// The diffusion model's file or diffusers folder (what `Family::load` takes).
    pub model: PathBuf,
    /// The text encoders' files, one per slot of the family (the model's own file for a slot
    /// it holds); empty where the pipeline folder or the single file supplies them
    /// (`Sources::locate`'s defaults) or they were given.
    pub text: Vec<PathBuf>,
    /// The autoencoder's file; `None` where the defaults supply it or it was given.
    pub vae: Option<PathBuf>,
    /// What was picked for each role and why, one line each, for the log.
    pub lines: Vec<String>,
}

/// A weight file's header: its keys with their shapes, what its tensors are stored as, and
/// the `scaling_factor` of the diffusers config in its metadata, if any.
struct Header {
    path: PathBuf,
    shapes: BTreeMap<String, Vec<usize>>,
    format: String,
    gguf: bool,
    scaling: Option<f64>,
}

impl Header {
    fn read(path: &Path) -> Result<Header> {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut shapes = BTreeMap::new();
        let gguf = crate::gguf::is_gguf(path);
        let mut scaling = None;
        if gguf {
            let f = crate::gguf::GgufFile::open(path)?;
            for n in f.names() {
                if let Some(i) = f.info(n) {
                    *counts.entry(format!("{:?}", i.ty)).or_default() += 1;
                    shapes.insert(n.to_string(), i.shape.clone());
                }
            }
        } else {
            let f = crate::safetensors::SafeTensorsFile::open(path)?;
            scaling = f
                .metadata()
                .get(crate::safetensors::CONFIG_METADATA)
                .and_then(|c| serde_json::from_str::<serde_json::Value>(c).ok())
                .and_then(|c| c.get("scaling_factor").and_then(|v| v.as_f64()));
            for n in f.names() {
                if let Some(i) = f.info(n) {
                    *counts.entry(i.dtype.clone()).or_default() += 1;
                    shapes.insert(n.to_string(), i.shape.clone());
                }
            }
        }
        let mut by_count: Vec<(&String, &usize)> = counts.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let types: Vec<String> = by_count.iter().map(|(t, n)| format!("{n} {t}")).collect();
        let format = format!(
            "{}, {} tensors: {}",
            if gguf { "GGUF" } else { "safetensors" },
            shapes.len(),
            types.join(", ")
        );
        Ok(Header {
            path: path.to_path_buf(),
            shapes,
            format,
            gguf,
            scaling,
        })
    }

    fn keys(&self) -> Vec<String> {
        self.shapes.keys().cloned().collect()
    }

    /// Whether the file holds `family`'s model, bare or under [`LDM_PREFIX`], or under the
    /// diffusers model's names ([`Family::holds_model`]).
    fn holds_model(&self, family: &Family) -> bool {
        family.holds_model(&|k| self.shapes.contains_key(k))
    }

    /// The encoders the file holds.
    fn encoders(&self) -> Vec<Recognised> {
        let keys = self.keys();
        recognise(&keys, &|k| self.shapes.get(k).cloned())
    }
}

/// Where a family's diffusion model takes its latents: the key whose shape at `dim`, over
/// `div`, is the latent channels (Flux, FLUX.2 and Z-Image read 2x2 patches of them as one
/// token: BFL's `img_in` of 64 = 16 x 4, FLUX.2's of 128 = 32 x 4, Z-Image's `x_embedder` of
/// 64; SD3's patch embedding and SDXL's first conv take the channels as they are), under the
/// original names and the diffusers model's.
fn latent_input(family: &str) -> &'static [(&'static str, usize, usize)] {
    match family {
        "flux" | "flux2" => &[("img_in.weight", 1, 4), ("x_embedder.weight", 1, 4)],
        "zimage" => &[
            ("x_embedder.weight", 1, 4),
            ("all_x_embedder.2-1.weight", 1, 4),
        ],
        "sd3" => &[
            ("x_embedder.proj.weight", 1, 1),
            ("pos_embed.proj.weight", 1, 1),
        ],
        "sdxl" => &[("input_blocks.0.0.weight", 1, 1), ("conv_in.weight", 1, 1)],
        _ => &[],
    }
}

/// The latent channels the model in `h` takes, if its family's input key is there.
fn model_latents(family: &Family, h: &Header) -> Option<usize> {
    latent_input(family.name)
        .iter()
        .find_map(|(key, dim, div)| {
            ["", LDM_PREFIX].iter().find_map(|p| {
                let s = h.shapes.get(&format!("{p}{key}"))?;
                s.get(*dim).map(|c| c / div)
            })
        })
}

/// What an autoencoder file is, from its keys: its latent channels (the decoder's first
/// conv's input), whether it has quant convs and FLUX.2's batch-norm statistics (`bn.`).
struct VaeFacts {
    latents: Option<usize>,
    quant: bool,
    bn: bool,
}

impl VaeFacts {
    fn of(h: &Header, prefix: &str) -> VaeFacts {
        let has = |k: &str| h.shapes.contains_key(&format!("{prefix}{k}"));
        VaeFacts {
            latents: h
                .shapes
                .get(&format!("{prefix}decoder.conv_in.weight"))
                .and_then(|s| s.get(1).copied()),
            quant: has("quant_conv.weight"),
            bn: has("bn.running_mean"),
        }
    }

    /// Whether its structure is that of `kind`'s autoencoder (encoders::VaeConfig: SDXL's
    /// has quant convs, SD3's and Flux's none, FLUX.2's both and `bn.`).
    fn fits(&self, kind: VaeKind) -> bool {
        match kind {
            VaeKind::Flux2 => self.bn,
            VaeKind::Sdxl => self.quant && !self.bn,
            VaeKind::Sd3 | VaeKind::Flux => !self.quant && !self.bn,
        }
    }

    fn describe(&self) -> String {
        let kind = match (self.bn, self.quant) {
            (true, _) => "FLUX.2's kind, with bn.",
            (false, true) => "with quant convs (SDXL's kind)",
            (false, false) => "without quant convs (SD3's and Flux's kind)",
        };
        match self.latents {
            Some(c) => format!("{c} latent channels, {kind}"),
            None => format!("no decoder.conv_in, {kind}"),
        }
    }
}

fn err(msg: String) -> Error {
    Error::Config { path: None, msg }
}

fn show(paths: &[&Path]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The snapshot a Hugging Face hub cache folder (`models--org--name/`) stands for: the one
/// `refs/main` names, else its only snapshot; `path` itself when it is no such folder.
/// (The hub's cache layout: `huggingface_hub`'s `file_download.py`, `snapshots/` and
/// `refs/`.)
fn hub_snapshot(path: &Path, keys: Keys, lines: &mut Vec<String>) -> Result<PathBuf> {
    let snapshots = path.join("snapshots");
    if !path.is_dir() || !snapshots.is_dir() {
        return Ok(path.to_path_buf());
    }
    let main = path.join("refs").join("main");
    if main.is_file() {
        let hash = std::fs::read_to_string(&main).map_err(|source| Error::Io {
            path: main.clone(),
            source,
        })?;
        let snap = snapshots.join(hash.trim());
        if !snap.is_dir() {
            return Err(err(format!(
                "{} = {}: refs/main names snapshot {}, which is not in snapshots/",
                keys.model,
                path.display(),
                hash.trim()
            )));
        }
        lines.push(format!(
            "Hugging Face cache {}: snapshot {} (refs/main)",
            path.display(),
            hash.trim()
        ));
        return Ok(snap);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .map_err(|source| Error::Io {
            path: snapshots.clone(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    match found.as_slice() {
        [one] => {
            lines.push(format!(
                "Hugging Face cache {}: its only snapshot {}",
                path.display(),
                one.display()
            ));
            Ok(one.clone())
        }
        [] => Err(err(format!(
            "{} = {}: a Hugging Face cache folder with no snapshot",
            keys.model,
            path.display()
        ))),
        many => Err(err(format!(
            "{} = {}: several snapshots and no refs/main to choose: {}; set {} to one of them",
            keys.model,
            path.display(),
            show(&many.iter().map(PathBuf::as_path).collect::<Vec<_>>()),
            keys.model
        ))),
    }
}

/// The `_class_name` of a diffusers config or model index, if any.
fn class_name(path: &Path) -> Result<Option<String>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: Some(path.to_path_buf()),
        msg: format!("invalid JSON: {e}"),
    })?;
    Ok(v.get("_class_name")
        .and_then(|c| c.as_str())
        .map(str::to_string))
}

/// The family of the diffusers folder `dir` (a pipeline, or a model folder), from its
/// model's `config.json` class; `None` when `dir` is no diffusers folder.
fn diffusers_family(dir: &Path) -> Result<Option<(&'static Family, String)>> {
    let pipeline = dir.join("model_index.json").is_file();
    let model_dir = dir.join("config.json").is_file()
        && std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok()).any(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("diffusion_pytorch_model")
                })
            })
            .unwrap_or(false);
    if !pipeline && !model_dir {
        return Ok(None);
    }
    for f in super::FAMILIES {
        for cfg in [
            dir.join(f.subfolder).join("config.json"),
            dir.join("config.json"),
        ] {
            if class_name(&cfg)?.as_deref() == Some(f.diffusers_class) {
                return Ok(Some((f, f.diffusers_class.to_string())));
            }
        }
    }
    let what = class_name(&dir.join("model_index.json"))?
        .or(class_name(&dir.join("config.json"))?)
        .unwrap_or_else(|| "no _class_name".into());
    Err(err(format!(
        "{}: a diffusers folder ({what}) whose model FLAME does not train; known are {}",
        dir.display(),
        super::FAMILIES
            .iter()
            .map(|f| format!("{} ({})", f.diffusers_class, f.name))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// The weight files under `dir` (`.safetensors`, `.sft`, `.gguf`), four folders deep at
/// most, hidden folders left out, in path order.
fn weight_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.filter_map(|e| e.ok()) {
            let p = e.path();
            let hidden = e.file_name().to_string_lossy().starts_with('.');
            if p.is_dir() && !hidden && depth < 4 {
                walk(&p, depth + 1, out);
            } else if p.is_file()
                && p.extension()
                    .is_some_and(|x| x == "safetensors" || x == "sft" || x == "gguf")
            {
                out.push(p);
            }
        }
    }
    let mut out = vec![];
    walk(dir, 0, &mut out);
    out.sort();
    out
}

/// The family named `arch`, or the one found.
fn named(arch: Option<&str>) -> Result<Option<&'static Family>> {
    arch.map(super::family).transpose()
}

/// Finds the pieces of a model at `path` (module docs). `arch`, when given, is the family
/// wanted (other families' files are passed over); `text_given` and `vae_given` say that the
/// config names those, so they are not searched for. Errors name the keys of `keys`.
pub fn discover(
    path: &Path,
    arch: Option<&str>,
    text_given: bool,
    vae_given: bool,
    keys: Keys,
) -> Result<Discovery> {
    let mut lines = vec![];
    let root = hub_snapshot(path, keys, &mut lines)?;
    let wanted = named(arch)?;
    if root.is_file() {
        let h = Header::read(&root)?;
        let family = match wanted {
            Some(f) => f,
            None => {
                let found: Vec<&'static Family> = super::FAMILIES
                    .iter()
                    .copied()
                    .filter(|f| h.holds_model(f))
                    .collect();
                match found.as_slice() {
                    [f] => *f,
                    [] => {
                        return Err(err(format!(
                            "{} = {}: its keys are those of no model family FLAME trains \
                             ({}); set {}",
                            keys.model,
                            root.display(),
                            h.format,
                            keys.arch
                        )))
                    }
                    many => {
                        return Err(err(format!(
                            "{} = {}: its keys are those of several model families ({}); set \
                             {} to one of them",
                            keys.model,
                            root.display(),
                            many.iter().map(|f| f.name).collect::<Vec<_>>().join(", "),
                            keys.arch
                        )))
                    }
                }
            }
        };
        lines.push(format!(
            "diffusion model ({}): {} ({})",
            family.name,
            root.display(),
            h.format
        ));
        return Ok(Discovery {
            family,
            model: root,
            text: vec![],
            vae: None,
            lines,
        });
    }
    if !root.is_dir() {
        return Err(err(format!(
            "{} = {}: no such file or folder",
            keys.model,
            root.display()
        )));
    }
    if let Some((found, class)) = diffusers_family(&root)? {
        let family = match wanted {
            Some(f) if f.name != found.name => {
                return Err(err(format!(
                    "{} = {}: a diffusers {class} ({}), not {}",
                    keys.model,
                    root.display(),
                    found.name,
                    f.name
                )))
            }
            _ => found,
        };
        lines.push(format!(
            "diffusers folder ({}): {} ({class}; its text encoders, tokenizers and \
             autoencoder from its own folders)",
            family.name,
            root.display()
        ));
        return Ok(Discovery {
            family,
            model: root,
            text: vec![],
            vae: None,
            lines,
        });
    }
    from_folder(&root, wanted, text_given, vae_given, keys, lines)
}

/// The autoencoders among `lone` that fit `family`'s model best, each with why it fits (one,
/// or several that fit equally), and a line for each one passed over. An autoencoder fits
/// when its structure is that of the family's kind ([`VaeFacts::fits`]); among those, the
/// ones whose latent channels are the model's input's come first, then those whose config
/// (in the file's metadata) has the kind's `scaling_factor`.
fn pick_vae<'h>(
    family: &Family,
    model: &Header,
    lone: &[(&'h Header, Recognised)],
) -> (Vec<(&'h Header, String)>, Vec<String>) {
    let kind = family.pipeline.vae;
    let want = model_latents(family, model);
    let scale = kind.scaling().scale;
    let mut passed = vec![];
    let mut fit: Vec<((bool, bool), &'h Header, String)> = vec![];
    for (h, r) in lone {
        let Recognised::Vae { prefix } = r else {
            continue;
        };
        let facts = VaeFacts::of(h, prefix);
        let what = facts.describe();
        if !facts.fits(kind) {
            passed.push(format!(
                "passed over {}: an autoencoder of {what}, not the {} model's ({kind:?})",
                h.path.display(),
                family.name
            ));
            continue;
        }
        let latents_match = match (want, facts.latents) {
            (Some(w), Some(c)) => w == c,
            (None, _) => true,
            (Some(_), None) => false,
        };
        let scale_match = h.scaling.is_some_and(|s| (s - scale).abs() < 1e-6);
        let mut why = what;
        if let (true, Some(w)) = (latents_match, want) {
            why.push_str(&format!(", the model takes {w}"));
        }
        if scale_match {
            why.push_str(&format!(", scaling_factor {scale} in its config"));
        }
        fit.push(((latents_match, scale_match), h, why));
    }
    let Some(best) = fit.iter().map(|f| f.0).max() else {
        return (vec![], passed);
    };
    let mut pick = vec![];
    for (score, h, why) in fit {
        if score == best {
            pick.push((h, why));
        } else {
            passed.push(format!(
                "passed over {}: an autoencoder of {why}, which fits the {} model less",
                h.path.display(),
                family.name
            ));
        }
    }
    if !best.0 {
        // None takes the model's latent channels: none fits.
        for (h, why) in pick.drain(..) {
            passed.push(format!(
                "passed over {}: an autoencoder of {why}, but the {} model takes {} latent \
                 channels",
                h.path.display(),
                family.name,
                want.unwrap_or(0)
            ));
        }
    }
    if let ([(_, why)], false) = (pick.as_mut_slice(), passed.is_empty()) {
        why.push_str("; picked among the folder's autoencoders");
    }
    (pick, passed)
}

/// [`discover`] in a folder of loose files (ComfyUI's `models/`, a download folder).
fn from_folder(
    root: &Path,
    wanted: Option<&'static Family>,
    text_given: bool,
    vae_given: bool,
    keys: Keys,
    mut lines: Vec<String>,
) -> Result<Discovery> {
    let mut headers = vec![];
    for f in weight_files(root) {
        match Header::read(&f) {
            Ok(h) => headers.push(h),
            Err(e) => lines.push(format!("passed over {}: {e}", f.display())),
        }
    }
    // The diffusion model: a file holding a family's signature (a `.safetensors` or `.gguf`
    // single file).
    let mut models: Vec<(&'static Family, &Header)> = vec![];
    for h in &headers {
        for f in super::FAMILIES.iter().copied() {
            if !h.holds_model(f) || wanted.is_some_and(|w| w.name != f.name) {
                continue;
            }
            models.push((f, h));
        }
    }
    let (family, model) = match models.as_slice() {
        [one] => *one,
        [] => {
            return Err(err(format!(
                "{} = {}: no {} diffusion model among its {} weight files (found by their \
                 keys); set {} to the model's file",
                keys.model,
                root.display(),
                wanted.map_or("known".to_string(), |f| f.name.to_string()),
                headers.len(),
                keys.model
            )))
        }
        many => {
            let families: Vec<&str> = many.iter().map(|(f, _)| f.name).collect();
            let how = match families.iter().all(|n| *n == families[0]) {
                true => format!("set {} to one of them", keys.model),
                false => format!(
                    "set {} to the family ({}), or {} to one file",
                    keys.arch,
                    families.join(", "),
                    keys.model
                ),
            };
            return Err(err(format!(
                "{} = {}: several diffusion models: {}; {how}",
                keys.model,
                root.display(),
                many.iter()
                    .map(|(f, h)| format!("{} ({})", h.path.display(), f.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    lines.push(format!(
        "diffusion model ({}): {} ({})",
        family.name,
        model.path.display(),
        model.format
    ));
    let spec = family.pipeline;
    let inside = model.encoders();
    let in_model =
        |prefix: Option<&str>| prefix.is_some_and(|p| inside.iter().any(|r| r.prefix() == p));
    // Lone encoders: files other than the model's, holding one at the top level (a Qwen3
    // under `model.` too: transformers' causal-LM layout, as ComfyUI's qwen_3_4b.safetensors
    // and the diffusers pipelines' text_encoder/ hold it).
    let lone: Vec<(&Header, Recognised)> = headers
        .iter()
        .filter(|h| !std::ptr::eq(*h, model) && !h.gguf)
        .flat_map(|h| {
            h.encoders()
                .into_iter()
                .filter(|r| match r {
                    Recognised::Qwen3 { prefix } => prefix.is_empty() || prefix == "model.",
                    _ => r.prefix().is_empty(),
                })
                .map(move |r| (h, r))
        })
        .collect();
    let mut missing = vec![];
    let mut text = vec![];
    if !text_given {
        // CLIP slots in the family's order take the CLIPs found, narrowest first (CLIP-L 768
        // before bigG 1280).
        let mut clips: Vec<(&Header, usize, String)> = lone
            .iter()
            .filter_map(|(h, r)| match r {
                Recognised::Clip { width, .. } => Some((*h, *width, r.to_string())),
                _ => None,
            })
            .collect();
        clips.sort_by_key(|(_, w, _)| *w);
        let clip_slots: Vec<usize> = spec
            .text
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == TextEncoderKind::Clip && !in_model(s.single_file_prefix))
            .map(|(i, _)| i)
            .collect();
        for (i, slot) in spec.text.iter().enumerate() {
            if in_model(slot.single_file_prefix) {
                lines.push(format!(
                    "{} text encoder: in the model's file {}",
                    slot.name,
                    model.path.display()
                ));
                text.push(model.path.clone());
                continue;
            }
            let pick: Vec<(&Header, String)> = match slot.kind {
                TextEncoderKind::Clip => {
                    let widths: Vec<usize> = clips.iter().map(|c| c.1).collect();
                    let distinct = widths.windows(2).all(|w| w[0] < w[1]);
                    let nth = clip_slots.iter().position(|&j| j == i).unwrap_or(0);
                    match (clips.len() == clip_slots.len() && distinct, clips.len()) {
                        (true, _) => vec![(clips[nth].0, clips[nth].2.clone())],
                        (false, _) => clips.iter().map(|c| (c.0, c.2.clone())).collect(),
                    }
                }
                TextEncoderKind::T5 => lone
                    .iter()
                    .filter(|(_, r)| matches!(r, Recognised::T5 { .. }))
                    .map(|(h, r)| (*h, r.to_string()))
                    .collect(),
                TextEncoderKind::Qwen3(_) => lone
                    .iter()
                    .filter(|(_, r)| matches!(r, Recognised::Qwen3 { .. }))
                    .map(|(h, r)| (*h, r.to_string()))
                    .collect(),
            };
            // Of several, the one in the slot's diffusers folder (`text_encoder/` for the
            // first CLIP) when exactly one is: a pipeline's components without its
            // model_index.json.
            let slot_folder = root.join(slot.folder);
            let in_folder: Vec<(&Header, String)> = pick
                .iter()
                .filter(|(h, _)| h.path.starts_with(&slot_folder))
                .map(|(h, what)| (*h, format!("{what}, in {}/", slot.folder)))
                .collect();
            let pick = match (pick.len(), in_folder.len()) {
                (2.., 1) => in_folder,
                _ => pick,
            };
            match pick.as_slice() {
                [(h, what)] => {
                    lines.push(format!(
                        "{} text encoder: {} ({what}; {})",
                        slot.name,
                        h.path.display(),
                        h.format
                    ));
                    text.push(h.path.clone());
                }
                [] => missing.push(format!("the {} text encoder ({})", slot.name, keys.text)),
                many => {
                    return Err(err(format!(
                        "{} = {}: several candidates for the {} text encoder: {}; set {} \
                         (the {} files: {})",
                        keys.model,
                        root.display(),
                        slot.name,
                        show(
                            &many
                                .iter()
                                .map(|(h, _)| h.path.as_path())
                                .collect::<Vec<_>>()
                        ),
                        keys.text,
                        spec.text.len(),
                        spec.text
                            .iter()
                            .map(|s| s.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )))
                }
            }
        }
    }
    let mut vae = None;
    if !vae_given {
        if in_model(spec.vae_single_file_prefix) {
            lines.push(format!(
                "autoencoder: in the model's file {}",
                model.path.display()
            ));
            vae = Some(model.path.clone());
        } else {
            let (pick, passed) = pick_vae(family, model, &lone);
            let why_none = passed.join("; ");
            lines.extend(passed);
            match pick.as_slice() {
                [(h, why)] => {
                    lines.push(format!(
                        "autoencoder: {} ({why}; {})",
                        h.path.display(),
                        h.format
                    ));
                    vae = Some(h.path.clone());
                }
                [] if why_none.is_empty() => {
                    missing.push(format!("the autoencoder ({})", keys.vae))
                }
                [] => missing.push(format!(
                    "an autoencoder that fits ({}; {why_none})",
                    keys.vae
                )),
                many => {
                    return Err(err(format!(
                        "{} = {}: several autoencoders fit the {} model equally: {}; set {}",
                        keys.model,
                        root.display(),
                        family.name,
                        many.iter()
                            .map(|(h, why)| format!("{} ({why})", h.path.display()))
                            .collect::<Vec<_>>()
                            .join(", "),
                        keys.vae
                    )))
                }
            }
        }
    }
    if !missing.is_empty() {
        return Err(err(format!(
            "{} = {}: found the {} model {}, but not {} among its weight files (found by \
             their keys); set the keys named",
            keys.model,
            root.display(),
            family.name,
            model.path.display(),
            missing.join(", ")
        )));
    }
    Ok(Discovery {
        family,
        model: model.path.clone(),
        text,
        vae,
        lines,
    })
}
