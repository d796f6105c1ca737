//! Saving and loading LoRA adapters in the kohya / ComfyUI layout:
//! `lora_unet_<layer path, dots as underscores>.lora_down.weight` (rank, in),
//! `.lora_up.weight` (out, rank) and `.alpha` (a 0-dim tensor), the names kohya's sd-scripts
//! write for the original checkpoint key paths (`lora_unet_double_blocks_0_img_attn_qkv`,
//! `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`), which ComfyUI loads.

use super::lora::Adapters;
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
                    .load_as(&key, &crate::Device::Cpu, DType::F64)?
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
