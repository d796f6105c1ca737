//! Full fine-tuning of chosen layers: the layer's weight itself is trained, held as a change
//! to the frozen weight, `diff` (f32, the weight's shape, starting at zero), so the frozen
//! weight can stay in its own dtype (bf16, FP8) or in host memory while the trained values
//! keep f32 precision; where the layer has a bias, its change `diff_b` (f32, starting at
//! zero) is trained too, as LyCORIS's full module trains the bias. The forward adds
//! x ⊛ diff + diff_b to the frozen output. It costs what training a weight costs: the f32
//! change, its gradient and the optimizer's moments (8-bit AdamW and the memory planner
//! apply).
//!
//! Files: the kohya / LyCORIS full-weight difference, `diff` and `diff_b` (ComfyUI adds them
//! to the weight and the bias); PEFT has no such kind, so there is no PEFT layout.

use super::io::{PeftFile, Reader};
use super::merge::MergeLayer;
use super::{cast, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart};
use crate::{Error, Result, Setting, Tensor};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "full",
    peft: false,
    ranked: false,
    dropout: false,
    module_dropout: false,
    rank_dropout: false,
    tucker: false,
    peft_tucker: false,
    per_projection: false,
    reads_weight: false,
    weight_decompose: false,
    lycoris_algo: "full",
    plain_kohya: false,
    tool_layouts: false,
    loraplus_up: &[],
    merge,
    merge_bias,
    make: |p| {
        Ok(Arc::new(Full {
            path: p.path.to_string(),
            shape: p.shape,
            diff: zeros(&p.shape.weight_dims(), p.device)?,
            diff_b: if p.bias {
                Some(zeros(&[p.shape.out_dim()], p.device)?)
            } else {
                None
            },
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
    /// The trained change to the bias, where the layer has one: (out), f32, trainable.
    diff_b: Option<Tensor>,
}

impl Full {
    fn no_peft(&self) -> Error {
        Error::Setting {
            setting: Setting::AdapterLayout,
            msg: format!(
                "layer {} is fully trained: PEFT has no layout for that; write the kohya \
                 layout, which has (its `diff` tensors)",
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
        let mut p = vec![("diff", self.diff.clone())];
        if let Some(b) = &self.diff_b {
            p.push(("diff_b", b.clone()));
        }
        p
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        self.params().into_iter().map(|(_, t)| (t, 1.0)).collect()
    }

    fn forward_with(&self, _: &BaseLayer, x: &Tensor, y: Tensor, p: &[Tensor]) -> Result<Tensor> {
        let (diff, diff_b) = match p {
            [diff] => (diff, None),
            [diff, b] => (diff, Some(b)),
            _ => return Err(Error::Autograd("full: expected 1 or 2 parameters".into())),
        };
        let y = self.shape.add_apply(y, x, &cast(diff, x)?)?;
        match diff_b {
            Some(b) => y.add(&self.shape.per_channel(&cast(b, x)?)?),
            None => Ok(y),
        }
    }

    fn delta_weight(&self, _: &BaseLayer) -> Result<Tensor> {
        Ok(self.diff.clone())
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .params()
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect())
    }

    /// `diff`, and `diff_b` where the layer has a bias (a file without it, written before
    /// biases were trained, leaves the bias as it is).
    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        let d = file.take("diff", self.diff.dims())?;
        self.diff.assign(&d)?;
        match &self.diff_b {
            Some(b) if file.has("diff_b") => b.assign(&file.take("diff_b", b.dims())?),
            _ => Ok(()),
        }
    }

    fn to_peft(&self, _: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        Err(self.no_peft())
    }

    fn load_peft(&self, _: &[PeftPart], _: &mut PeftFile, _: f64) -> Result<()> {
        Err(self.no_peft())
    }
}
