//! FP8 checkpoints whose Linear weights are float8_e4m3fn codes with a scale beside them,
//! as released and as ComfyUI writes them, read into the weights they stand for:
//! `w = decode(code) * scale`, the scale one value for the tensor or one per output row.
//!
//! The conventions (the weight is `<layer>.weight`, dtype `F8_E4M3`):
//! - `<layer>.weight_scale`, with `<layer>.input_scale` beside it: BFL's FP8 FLUX.2 files,
//!   diffusers / ModelOpt exports, and ComfyUI's current quantized files, which also hold a
//!   `<layer>.comfy_quant` record (a `U8` tensor of JSON, `{"format": "float8_e4m3fn", ...}`;
//!   or the same records under the metadata key `_quantization_metadata`);
//! - `<layer>.scale_weight`, with `<layer>.scale_input`, and one `scaled_fp8` marker tensor
//!   under the model's prefix: ComfyUI's older "scaled fp8" files.
//!
//! ComfyUI reads both (Comfy-Org/ComfyUI `comfy/utils.py` `convert_old_quants` renames
//! `scale_weight` to `weight_scale` and `scale_input` to `input_scale`, and `comfy/ops.py`
//! multiplies the weight by `weight_scale`). The input scales quantize activations for 8-bit
//! products at inference; FLAME quantizes its own activations a token at a time
//! (`model.compute = "fp8"`), so they are read past, never applied. A weight without a scale
//! is taken as its codes' values (scale 1). A scale beside a weight of another dtype, a scale
//! that is neither one value nor one a row (block-wise scales), and a `comfy_quant` record of
//! another format are refused, naming the tensor.

use crate::backend::fp8;
use crate::safetensors::SafeTensorsFile;
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::HashMap;

/// The safetensors dtype of float8_e4m3fn.
const F8_E4M3: &str = "F8_E4M3";

/// The format name of a `comfy_quant` record for float8_e4m3fn weights.
const COMFY_FP8: &str = "float8_e4m3fn";

/// The metadata key of ComfyUI's per-layer records (`convert_old_quants`).
const QUANT_METADATA: &str = "_quantization_metadata";

/// One FP8 weight of a file and how it is scaled.
pub(crate) struct ScaledFp8 {
    /// The weight's key.
    key: String,
    /// Its file, an index into the builder's files.
    file: usize,
    /// One value, or one per row (dim 0 of the weight).
    scale: Vec<f32>,
    /// The keys read beside the weight (scales, records), to count as used.
    pub(crate) beside: Vec<String>,
}

fn bad(files: &[SafeTensorsFile], i: usize, key: &str, msg: String) -> Error {
    Error::Param {
        key: key.to_string(),
        file: Some(files[i].path().to_path_buf()),
        msg,
    }
}

/// The FP8 weight at source key `key` with its scale, `None` for a tensor of another dtype
/// (an error where a weight scale sits beside it).
pub(crate) fn scaled_fp8(
    files: &[SafeTensorsFile],
    index: &HashMap<String, usize>,
    key: &str,
) -> Result<Option<ScaledFp8>> {
    let Some(&i) = index.get(key) else {
        return Ok(None);
    };
    let Some(stem) = key.strip_suffix("weight") else {
        return Ok(None);
    };
    let info = files[i]
        .info(key)
        .ok_or_else(|| bad(files, i, key, "missing from its file's header".into()))?;
    let scales: Vec<String> = ["weight_scale", "scale_weight"]
        .iter()
        .map(|s| format!("{stem}{s}"))
        .filter(|k| index.contains_key(k))
        .collect();
    if info.dtype != F8_E4M3 {
        return match scales.first() {
            Some(s) => Err(bad(
                files,
                i,
                key,
                format!(
                    "a weight scale ('{s}') beside a {} weight: FLAME applies weight scales to \
                     F8_E4M3 (float8_e4m3fn) weights",
                    info.dtype
                ),
            )),
            None => Ok(None),
        };
    }
    let rows = info.shape.first().copied().unwrap_or(1);
    let mut beside = vec![];
    let scale = match scales.as_slice() {
        [] => vec![1.0],
        [s] => {
            let j = index[s];
            let shape = files[j]
                .info(s)
                .map(|t| t.shape.clone())
                .unwrap_or_default();
            let n: usize = shape.iter().product();
            // One value ((), (1,)), or one a row ((rows,), (rows, 1)).
            let per_row = n == rows && shape.first() == Some(&rows) && shape.len() <= 2;
            if n != 1 && !per_row {
                return Err(bad(
                    files,
                    i,
                    key,
                    format!(
                        "its scale '{s}' has shape {shape:?}: FLAME reads one scale for the \
                         tensor or one a row ({rows}), not block-wise scales"
                    ),
                ));
            }
            let v: Vec<f32> = files[j]
                .host(s)?
                .to_f64_vec()
                .into_iter()
                .map(|x| x as f32)
                .collect();
            if let Some(x) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(bad(
                    files,
                    i,
                    key,
                    format!("its scale '{s}' holds {x}: scales must be finite and positive"),
                ));
            }
            beside.push(s.clone());
            v
        }
        _ => {
            return Err(bad(
                files,
                i,
                key,
                format!(
                    "two weight scales beside it ({}): one convention a file",
                    scales.join(", ")
                ),
            ))
        }
    };
    // The activation scales of 8-bit inference, read past (module docs).
    for s in ["input_scale", "scale_input"] {
        let k = format!("{stem}{s}");
        if index.contains_key(&k) {
            beside.push(k);
        }
    }
    let record = format!("{stem}comfy_quant");
    if let Some(&j) = index.get(&record) {
        check_record(
            files,
            i,
            key,
            &String::from_utf8_lossy(files[j].bytes(&record)?),
        )?;
        beside.push(record);
    }
    if let Some(meta) = files[i].metadata().get(QUANT_METADATA) {
        check_metadata(files, i, key, stem, meta)?;
    }
    Ok(Some(ScaledFp8 {
        key: key.to_string(),
        file: i,
        scale,
        beside,
    }))
}

/// A `comfy_quant` record's format must be float8_e4m3fn.
fn check_record(files: &[SafeTensorsFile], i: usize, key: &str, json: &str) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| {
        bad(
            files,
            i,
            key,
            format!("its comfy_quant record is not JSON ({e}): {json:?}"),
        )
    })?;
    match v.get("format").and_then(|f| f.as_str()) {
        Some(COMFY_FP8) | None => Ok(()),
        Some(other) => Err(bad(
            files,
            i,
            key,
            format!(
                "its comfy_quant record says format {other:?}: FLAME reads \"{COMFY_FP8}\" \
                 weights"
            ),
        )),
    }
}

/// The layer's entry in `_quantization_metadata` (its layers keyed by the module path, with
/// or without the file's prefix), where there is one, must be float8_e4m3fn.
fn check_metadata(
    files: &[SafeTensorsFile],
    i: usize,
    key: &str,
    stem: &str,
    meta: &str,
) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(meta).map_err(|e| {
        bad(
            files,
            i,
            key,
            format!("the file's {QUANT_METADATA} is not JSON: {e}"),
        )
    })?;
    let Some(layers) = v.get("layers").and_then(|l| l.as_object()) else {
        return Ok(());
    };
    let layer = stem.trim_end_matches('.');
    let entry = layers.iter().find(|(k, _)| {
        layer == k.as_str()
            || layer
                .strip_suffix(k.as_str())
                .is_some_and(|p| p.ends_with('.'))
    });
    match entry {
        Some((_, conf)) => check_record(files, i, key, &conf.to_string()),
        None => Ok(()),
    }
}

impl ScaledFp8 {
    /// The weight as the values it stands for, `decode(code) * scale` in f32 (each product
    /// rounded once, as PyTorch's `weight.float() * weight_scale`), then in `dtype`.
    pub(crate) fn dense(
        &self,
        files: &[SafeTensorsFile],
        device: &Device,
        dtype: DType,
    ) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.no_nan(files)?;
        let w = files[self.file].load_as(&self.key, device, DType::F32)?;
        let w = match self.scale.as_slice() {
            [s] if *s == 1.0 => w,
            [s] => w.affine(f64::from(*s), 0.0)?,
            rows => {
                let mut dims = vec![1; w.rank().max(1)];
                dims[0] = rows.len();
                w.mul(&Tensor::from_vec(rows.to_vec(), dims, device)?)?
            }
        };
        w.to_dtype(dtype)
    }

    /// An error naming the first NaN code of the weight (E4M3's S.1111.111), which no scale
    /// turns into a weight.
    fn no_nan(&self, files: &[SafeTensorsFile]) -> Result<()> {
        let bytes = files[self.file].bytes(&self.key)?;
        match bytes.iter().position(|&c| c & 0x7F == 0x7F) {
            None => Ok(()),
            Some(p) => {
                let cols = files[self.file]
                    .info(&self.key)
                    .map_or(1, |i| i.shape.iter().skip(1).product::<usize>().max(1));
                Err(bad(
                    files,
                    self.file,
                    &self.key,
                    format!("code at row {}, column {} is NaN", p / cols, p % cols),
                ))
            }
        }
    }

    /// The weight as FLAME's FP8 storage (`backend::fp8`): the file's codes, four a u32 word
    /// ((rows, cols / 4)), and one scale a row, for a (rows, cols) weight with cols a multiple
    /// of 4; decoding them gives [`ScaledFp8::dense`]'s f32 values bit for bit. A NaN code is
    /// an error naming the weight.
    pub(crate) fn codes(
        &self,
        files: &[SafeTensorsFile],
        rows: usize,
        cols: usize,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let bytes = files[self.file].bytes(&self.key)?;
        if cols % fp8::CODES_PER_WORD != 0 || bytes.len() != rows * cols {
            return Err(bad(
                files,
                self.file,
                &self.key,
                format!(
                    "{} codes as ({rows}, {cols}): FP8 storage needs the weight's shape with \
                     a width that is a multiple of {}",
                    bytes.len(),
                    fp8::CODES_PER_WORD
                ),
            ));
        }
        self.no_nan(files)?;
        let words = bytes
            .chunks_exact(fp8::CODES_PER_WORD)
            .map(|c| fp8::pack(c.iter().copied()))
            .collect();
        let scales = match self.scale.as_slice() {
            [s] => vec![*s; rows],
            each => each.to_vec(),
        };
        Ok((words, scales))
    }
}
