//! Saving and loading LoRA adapters in the kohya / ComfyUI layout:
//! `lora_unet_<layer path, dots as underscores>.lora_down.weight` (rank, in),
//! `.lora_up.weight` (out, rank) and `.alpha` (a 0-dim tensor), the names kohya's sd-scripts
//! write for the original checkpoint key paths (`lora_unet_double_blocks_0_img_attn_qkv`,
//! `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`), which ComfyUI loads; and in
//! the diffusers / PEFT layout (`transformer.<diffusers module>.lora_A.weight` /
//! `.lora_B.weight`), which diffusers' `load_lora_weights` / `load_lora_adapter` load.

use super::lora::Adapters;
use super::params::{KeyMap, KeySource};
use crate::safetensors::{save_with_metadata, SafeTensorsFile};
use crate::{DType, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// kohya's name of the adapter on the layer at `path`.
pub fn kohya_name(path: &str) -> String {
    format!("lora_unet_{}", path.replace('.', "_"))
}

fn err(path: &Path, tensor: Option<&str>, msg: impl Into<String>) -> Error {
    Error::SafeTensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

impl Adapters {
    /// Writes every adapter to `path` in the kohya layout, A and B in `dtype`, alpha in f32,
    /// atomically (a temporary file renamed into place). Metadata records rank, alpha and
    /// targets (`ss_network_dim` / `ss_network_alpha`, as kohya writes them).
    pub fn save_kohya(&self, path: impl AsRef<Path>, dtype: DType) -> Result<()> {
        let _g = crate::no_grad();
        let mut tensors: Vec<(String, Tensor)> = vec![];
        for l in self.layers()? {
            let name = kohya_name(&l.path);
            let alpha = Tensor::from_vec(vec![l.alpha as f32], (), l.down.device())?;
            tensors.push((format!("{name}.lora_down.weight"), l.down.to_dtype(dtype)?));
            tensors.push((format!("{name}.lora_up.weight"), l.up.to_dtype(dtype)?));
            tensors.push((format!("{name}.alpha"), alpha));
        }
        let meta = BTreeMap::from([
            ("ss_network_module".to_string(), "networks.lora".to_string()),
            ("ss_network_dim".to_string(), self.config.rank.to_string()),
            (
                "ss_network_alpha".to_string(),
                self.config.alpha.to_string(),
            ),
            ("flame_targets".to_string(), self.config.targets.join(",")),
        ]);
        save_with_metadata(tensors.iter().map(|(k, t)| (k.as_str(), t)), &meta, path)
    }

    /// Reads a kohya-layout file into the planned adapters (built with the model). Every
    /// planned adapter must be in the file with its shapes, and the file may hold nothing
    /// else: a missing, misshapen or unexpected tensor is an error naming it.
    pub fn load_kohya(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file = SafeTensorsFile::open(path)?;
        let mut unused: BTreeSet<String> = file.names().map(str::to_string).collect();
        let _g = crate::no_grad();
        for l in self.layers()? {
            let name = kohya_name(&l.path);
            for (suffix, dst) in [(".lora_down.weight", &l.down), (".lora_up.weight", &l.up)] {
                let key = format!("{name}{suffix}");
                let info = file.info(&key).ok_or_else(|| {
                    err(
                        path,
                        Some(&key),
                        format!("missing (adapter of layer {})", l.path),
                    )
                })?;
                if info.shape.as_slice() != dst.dims() {
                    return Err(err(
                        path,
                        Some(&key),
                        format!("shape {:?}, the adapter has {}", info.shape, dst.shape()),
                    ));
                }
                dst.assign(&file.load_as(&key, dst.device(), dst.dtype())?)?;
                unused.remove(&key);
            }
            let key = format!("{name}.alpha");
            if file.contains(&key) {
                let a = file
                    .load_as(&key, l.down.device(), DType::F64)?
                    .to_vec_f64()?;
                if a.len() != 1 || (a[0] - l.alpha).abs() > 1e-6 * l.alpha.abs().max(1.0) {
                    return Err(err(
                        path,
                        Some(&key),
                        format!("alpha {a:?}, the adapters are configured with {}", l.alpha),
                    ));
                }
                unused.remove(&key);
            }
        }
        if let Some(k) = unused.iter().next() {
            return Err(err(
                path,
                Some(k),
                format!(
                    "no planned adapter takes it ({} such tensors); the adapter targets are {:?}",
                    unused.len(),
                    self.config.targets
                ),
            ));
        }
        Ok(())
    }
}

/// Where one adapter's rows go in the diffusers layout: (module, first row, rows, swapped
/// halves).
fn peft_parts(map: &KeyMap, layer: &str, out: usize) -> Result<Vec<(String, usize, usize, bool)>> {
    let key = format!("{layer}.weight");
    let module = |k: &str| k.strip_suffix(".weight").unwrap_or(k).to_string();
    Ok(match map(&key) {
        Some(KeySource::Key(k)) => vec![(module(&k), 0, out, false)],
        Some(KeySource::SwapHalves(k)) => vec![(module(&k), 0, out, true)],
        Some(KeySource::Cat(parts)) => {
            let mut start = 0;
            let mut v = vec![];
            for (k, rows) in parts {
                v.push((module(&k), start, rows, false));
                start += rows;
            }
            if start != out {
                return Err(Error::Param {
                    key: key.clone(),
                    file: None,
                    msg: format!("its diffusers parts have {start} rows, the layer {out}"),
                });
            }
            v
        }
        None => {
            return Err(Error::Param {
                key,
                file: None,
                msg: "the adapted layer has no diffusers counterpart".into(),
            })
        }
    })
}

/// The two halves of rows swapped.
fn swap_halves(t: &Tensor) -> Result<Tensor> {
    let n = t.dims()[0] / 2;
    Tensor::cat(&[&t.narrow(0, n, n)?, &t.narrow(0, 0, n)?], 0)
}

impl Adapters {
    /// Writes every adapter in the diffusers / PEFT layout: `<prefix>.<module>.lora_A.weight`
    /// (rank, in) and `.lora_B.weight` (rows, rank) under diffusers module names, which
    /// `map` (the model's diffusers key map) gives. alpha / rank is folded into B, so the
    /// file means the same under PEFT's default alpha = rank. A fused layer (Flux's qkv and
    /// linear1, SD3's qkv) becomes one pair per diffusers module, all sharing A, with B split
    /// by rows; an adaLN projection whose halves diffusers swaps gets B's halves swapped.
    /// `prefix` is `transformer` (Flux, SD3) or `unet` (SDXL), as diffusers pipelines expect.
    pub fn save_peft(
        &self,
        path: impl AsRef<Path>,
        map: &KeyMap,
        prefix: &str,
        dtype: DType,
    ) -> Result<()> {
        let _g = crate::no_grad();
        let mut tensors: Vec<(String, Tensor)> = vec![];
        for l in self.layers()? {
            let up = l.up.affine(l.scale(), 0.0)?;
            for (module, start, rows, swapped) in peft_parts(map, &l.path, up.dims()[0])? {
                let mut b = up.narrow(0, start, rows)?;
                if swapped {
                    b = swap_halves(&b)?;
                }
                let name = format!("{prefix}.{module}");
                tensors.push((format!("{name}.lora_A.weight"), l.down.to_dtype(dtype)?));
                tensors.push((format!("{name}.lora_B.weight"), b.to_dtype(dtype)?));
            }
        }
        let meta = BTreeMap::from([
            ("format".to_string(), "pt".to_string()),
            ("flame_rank".to_string(), self.config.rank.to_string()),
        ]);
        save_with_metadata(tensors.iter().map(|(k, t)| (k.as_str(), t)), &meta, path)
    }

    /// Reads a diffusers / PEFT-layout file (as `save_peft` writes it) into the planned
    /// adapters. The parts of a fused layer must share one A (a rank-r fused adapter cannot
    /// hold separate ones); a missing, misshapen or unexpected tensor is an error naming it.
    pub fn load_peft(&self, path: impl AsRef<Path>, map: &KeyMap, prefix: &str) -> Result<()> {
        let path = path.as_ref();
        let file = SafeTensorsFile::open(path)?;
        let mut unused: BTreeSet<String> = file.names().map(str::to_string).collect();
        let _g = crate::no_grad();
        let mut read = |key: String, shape: &[usize], dev: &crate::Device| -> Result<Tensor> {
            let info = file
                .info(&key)
                .ok_or_else(|| err(path, Some(&key), "missing"))?;
            if info.shape.as_slice() != shape {
                return Err(err(
                    path,
                    Some(&key),
                    format!("shape {:?}, the adapter needs {shape:?}", info.shape),
                ));
            }
            unused.remove(&key);
            file.load_as(&key, dev, DType::F32)
        };
        for l in self.layers()? {
            let (rank, out) = (l.rank(), l.up.dims()[0]);
            let mut down: Option<Tensor> = None;
            let mut ups = vec![];
            for (module, _, rows, swapped) in peft_parts(map, &l.path, out)? {
                let name = format!("{prefix}.{module}");
                let dev = l.down.device();
                let a = read(format!("{name}.lora_A.weight"), l.down.dims(), dev)?;
                let b = read(format!("{name}.lora_B.weight"), &[rows, rank], dev)?;
                match &down {
                    Some(d) if d.to_vec_f64()? != a.to_vec_f64()? => {
                        return Err(err(
                            path,
                            Some(&format!("{name}.lora_A.weight")),
                            format!(
                                "differs from the lora_A of the other parts of fused layer {}",
                                l.path
                            ),
                        ))
                    }
                    Some(_) => {}
                    None => down = Some(a),
                }
                ups.push(if swapped { swap_halves(&b)? } else { b });
            }
            let up =
                Tensor::cat(&ups.iter().collect::<Vec<_>>(), 0)?.affine(1.0 / l.scale(), 0.0)?;
            if let Some(d) = down {
                l.down.assign(&d)?;
            }
            l.up.assign(&up)?;
        }
        if let Some(k) = unused.iter().next() {
            return Err(err(
                path,
                Some(k),
                format!(
                    "no planned adapter takes it ({} such tensors)",
                    unused.len()
                ),
            ));
        }
        Ok(())
    }
}
