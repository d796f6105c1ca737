//! Full fine-tuning of chosen layers: the layer's weight itself is trained, held as a change
//! to the frozen weight, `diff` (f32, the weight's shape, starting at zero), so the frozen
//! weight can stay in its own dtype (bf16, FP8) or in host memory while the trained values
//! keep f32 precision. The forward adds x ⊛ diff to the frozen output. It costs what
//! training a weight costs: the f32 change, its gradient and the optimizer's moments (8-bit
//! AdamW and the memory planner apply).
//!
//! Files: the kohya / LyCORIS full-weight difference, `diff` (ComfyUI adds it to the weight);
//! PEFT has no such kind, so there is no PEFT layout.

use super::io::{PeftFile, Reader};
use super::merge::MergeLayer;
use super::{cast, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart};
use crate::{Error, Result, Tensor};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "full",
    peft: false,
    ranked: false,
    dropout: false,
    module_dropout: false,
    rank_dropout: false,
    reads_weight: false,
    lycoris_algo: "full",
    plain_kohya: false,
    merge,
    merge_bias,
    make: |p| {
        Ok(Arc::new(Full {
            path: p.path.to_string(),
            shape: p.shape,
            diff: zeros(&p.shape.weight_dims(), p.device)?,
        }))
    },
};

/// The change a file's full-weight difference of one layer stands for (`diff`, the weight's
/// shape), as the matrix (out, cols).
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    let Some(d) = l.take("diff")? else {
        return Ok(None);
    };
    if d.dims() != l.dims() {
        return Err(l.bad("diff", &d, &format!("{:?}", l.dims())));
    }
    d.reshape((l.out(), l.cols())).map(Some)
}

/// The change to the layer's bias in a file of full fine-tuning (`diff_b`, the bias's
/// shape; `l`'s weight is the bias).
pub(super) fn merge_bias(l: &MergeLayer) -> Result<Option<Tensor>> {
    let Some(d) = l.take("diff_b")? else {
        return Ok(None);
    };
    if d.dims() != l.dims() {
        return Err(l.bad("diff_b", &d, &format!("{:?}", l.dims())));
    }
    Ok(Some(d))
}

/// One fully trained layer.
#[derive(Debug)]
pub struct Full {
    path: String,
    shape: LayerShape,
    /// The trained change to the weight: f32, trainable.
    diff: Tensor,
}

impl Full {
    fn no_peft(&self) -> Error {
        Error::Config {
            path: None,
            msg: format!(
                "layer {} is fully trained: PEFT has no layout for that; use adapter.format = \
                 \"kohya\" (its `diff` tensors)",
                self.path
            ),
        }
    }
}

impl Adapter for Full {
    fn kind(&self) -> &'static str {
        "full"
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn shape(&self) -> LayerShape {
        self.shape
    }

    fn params(&self) -> Vec<(&'static str, Tensor)> {
        vec![("diff", self.diff.clone())]
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn forward_with(&self, _: &BaseLayer, x: &Tensor, y: Tensor, p: &[Tensor]) -> Result<Tensor> {
        let [diff] = p else {
            return Err(Error::Autograd("full: expected 1 parameter".into()));
        };
        self.shape.add_apply(y, x, &cast(diff, x)?)
    }

    fn delta_weight(&self, _: &BaseLayer) -> Result<Tensor> {
        Ok(self.diff.clone())
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(vec![("diff".into(), self.diff.clone())])
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        let d = file.take("diff", self.diff.dims())?;
        self.diff.assign(&d)
    }

    fn to_peft(&self, _: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        Err(self.no_peft())
    }

    fn load_peft(&self, _: &[PeftPart], _: &mut PeftFile, _: f64) -> Result<()> {
        Err(self.no_peft())
    }
}
