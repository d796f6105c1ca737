//! DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"), with PEFT's
//! semantics: V = W + s·B A (a LoRA's change), and the layer computes
//! y = (m / ‖V‖) · (W x + s·B A x) + bias, where ‖V‖ is the norm of each output channel's row
//! of V (over the inputs and the kernel) and m a learned magnitude per output channel,
//! initialised to ‖W‖. As in PEFT, the norm is detached in the backward (the paper's
//! section 4.3): gradients flow through m, A and B, not through ‖V‖.
//!
//! The magnitude starts as ‖W‖ at the layer's first use (a streamed weight is only on the
//! device then), unless a file set it before.
//!
//! Files: kohya / LyCORIS `lora_down.weight`, `lora_up.weight`, `alpha` and `dora_scale`
//! (out, 1[, 1, 1]), the output-channel form LyCORIS writes (`wd_on_out`); PEFT
//! `lora_A.weight`, `lora_B.weight` (s folded in) and `lora_magnitude_vector` ((out) for a
//! Linear, (1, out, 1, 1) for a convolution). ComfyUI reads the kohya form against the
//! frozen weight's norm: the "comfyui" layout writes m (‖W‖ + ε) / ‖W + ΔW‖ for it
//! (`Adapter::to_comfyui`).

use super::io::{join_rows, part_rows, PeftFile, Reader};
use super::lora::Lora;
use super::merge::MergeLayer;
use super::{cast, Adapter, BaseLayer, Kind, LayerShape, PeftPart};
use crate::nn::dropout::BatchPart;
use crate::{DType, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "dora",
    merge_bias: super::no_bias,
    peft: true,
    ranked: true,
    dropout: true,
    module_dropout: true,
    rank_dropout: true,
    tucker: false,
    reads_weight: true,
    lycoris_algo: "locon",
    plain_kohya: false,
    merge,
    make: |p| {
        let lora = Lora::new(p)?;
        let magnitude = super::zeros(&[p.shape.out_dim()], p.device)?;
        Ok(Arc::new(Dora {
            lora,
            magnitude,
            ready: AtomicBool::new(false),
        }))
    },
};

/// W' - W of a DoRA, W' = m (W + ΔW) / ‖W + ΔW‖, from `w` and the LoRA's change `lora`
/// (out, cols): the norm per output row (`per_row`, `m` (out, 1)), or per input column for a
/// Linear's `m` (1, cols) (the form LyCORIS writes without `wd_on_out`).
pub(super) fn rescale(w: &Tensor, lora: &Tensor, m: &Tensor, per_row: bool) -> Result<Tensor> {
    let v = w.add(lora)?;
    let axis = if per_row { 1 } else { 0 };
    v.mul(&m.div(&v.sqr()?.sum_keepdim(&[axis])?.sqrt()?)?)?
        .sub(w)
}

/// The change a file's DoRA of one layer stands for, as the matrix (out, cols): a LoRA's
/// tensors (`lora::merge`) and its magnitudes (`decompose`); `None` without a LoRA's tensors
/// (LyCORIS's LoKr and LoHa with magnitudes are theirs).
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    if !MAGNITUDES.iter().any(|t| l.has(t)) {
        return Ok(None);
    }
    match super::lora::merge(l)? {
        Some(lora) => decompose(l, lora).map(Some),
        None => Ok(None),
    }
}

/// The names a file's DoRA magnitudes go by: kohya's and LyCORIS's, PEFT's.
const MAGNITUDES: [&str; 2] = ["dora_scale", "lora_magnitude_vector"];

/// W' - W for a layer whose file holds magnitudes beside a change `change` (out, cols) of any
/// kind (LyCORIS decomposes LoRA, LoKr and LoHa alike, `weight_decompose`): kohya's
/// `dora_scale` ((out, 1[, 1, 1]) per output row, or a Linear's (1, in) per input column) or
/// PEFT's `lora_magnitude_vector` ((out), or (1, out, 1, 1) for a convolution); `change`
/// itself without them.
pub(super) fn decompose(l: &MergeLayer, change: Tensor) -> Result<Tensor> {
    let Some(name) = MAGNITUDES.into_iter().find(|t| l.has(t)) else {
        return Ok(change);
    };
    let m = l.need(name, "DoRA")?;
    let (out, cols) = (l.out(), l.cols());
    let per_row = m.elem_count() == out
        && (name == "lora_magnitude_vector" || m.dims().first() == Some(&out));
    let m = if per_row {
        m.reshape((out, 1))?
    } else if name == "dora_scale" && m.dims() == [1, cols] && l.dims().len() == 2 {
        m
    } else {
        return Err(l.bad(
            name,
            &m,
            &format!("{out} magnitudes, (out, 1) or (1, {cols})"),
        ));
    };
    if per_row && l.for_comfyui() {
        // Written for ComfyUI's reading (`Dora::comfyui_ratio`): m / (‖W‖ + ε).
        let w = l.weight()?;
        let norm = comfyui_norms(&w)?.reshape((out, 1))?;
        return w.add(&change)?.mul(&m.div(&norm)?)?.sub(&w);
    }
    rescale(&l.weight()?, &change, &m, per_row)
}

/// One layer's DoRA: a LoRA and the magnitude vector.
#[derive(Debug)]
pub struct Dora {
    lora: Lora,
    /// m: (out), f32, trainable.
    magnitude: Tensor,
    /// Whether m holds values (‖W‖ at first use, or a file's).
    ready: AtomicBool,
}

/// The norm of each output channel's row of `w` (out, ...) in f32: (out).
fn row_norms(w: &Tensor) -> Result<Tensor> {
    let out = w.dims()[0];
    w.to_dtype(DType::F32)?
        .reshape((out, w.elem_count() / out.max(1)))?
        .sqr()?
        .sum(&[1])?
        .sqrt()
}

/// The norm ComfyUI divides a per-row `dora_scale` by: ‖W‖ of each output row of the frozen
/// weight, plus float32's epsilon (comfy/weight_adapter/base.py `weight_decompose`): (out).
fn comfyui_norms(w: &Tensor) -> Result<Tensor> {
    row_norms(w)?.affine(1.0, f32::EPSILON as f64)
}

impl Dora {
    /// m = ‖W‖ unless it holds values already.
    fn ensure_magnitude(&self, base: &BaseLayer) -> Result<()> {
        if self.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let _g = crate::no_grad();
        self.magnitude
            .assign(&row_norms(&base.weight(DType::F32)?)?)?;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// m / ‖W + s B A‖ (out), the norm detached.
    fn scale(&self, base: &BaseLayer, down: &Tensor, up: &Tensor, m: &Tensor) -> Result<Tensor> {
        let norm = {
            let _g = crate::no_grad();
            let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
            let v = base.weight(DType::F32)?.add(&self.lora.delta_of(
                &f32(down)?,
                None,
                &f32(up)?,
            )?)?;
            row_norms(&v)?
        };
        m.div(&norm.to_dtype(m.dtype())?)
    }

    /// (‖W‖ + ε) / ‖W + s B A‖ (out), ε float32's epsilon: what ComfyUI's magnitudes are
    /// to FLAME's. ComfyUI (0.3.64, comfy/weight_adapter/base.py `weight_decompose`) reads
    /// a `dora_scale` of one value a row as W' = (W + ΔW) · m / (‖W‖ + ε), the norm of the
    /// frozen W, where PEFT, LyCORIS (`wd_on_out`) and this adapter divide by ‖W + ΔW‖; it
    /// computes in float32 and adds that type's epsilon.
    fn comfyui_ratio(&self, base: &BaseLayer) -> Result<Tensor> {
        let _g = crate::no_grad();
        let w = base
            .weight(DType::F32)?
            .to_device(self.magnitude.device())?;
        let v = w.add(&self.lora.delta_of(&self.lora.down, None, &self.lora.up)?)?;
        comfyui_norms(&w)?.div(&row_norms(&v)?)
    }

    fn magnitude_ready(&self) -> Result<()> {
        if self.ready.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(Error::Config {
                path: None,
                msg: format!(
                    "the DoRA magnitude of layer {} has no values yet (it is set from the \
                     weight at the layer's first use, or read from a file)",
                    self.lora.path
                ),
            })
        }
    }

    /// m shaped as PEFT stores it.
    fn peft_shape(&self, rows: usize) -> Vec<usize> {
        match self.lora.shape {
            LayerShape::Linear { .. } => vec![rows],
            LayerShape::Conv2d { .. } => vec![1, rows, 1, 1],
        }
    }

    /// m shaped as LyCORIS stores `dora_scale`.
    fn kohya_shape(&self) -> Vec<usize> {
        let out = self.lora.shape.out_dim();
        match self.lora.shape {
            LayerShape::Linear { .. } => vec![out, 1],
            LayerShape::Conv2d { .. } => vec![out, 1, 1, 1],
        }
    }
}

impl Adapter for Dora {
    fn kind(&self) -> &'static str {
        "dora"
    }

    fn path(&self) -> &str {
        &self.lora.path
    }

    fn shape(&self) -> LayerShape {
        self.lora.shape
    }

    fn params(&self) -> Vec<(&'static str, Tensor)> {
        let mut p = self.lora.params();
        p.push(("dora_scale", self.magnitude.clone()));
        p
    }

    fn forward(&self, base: &BaseLayer, x: &Tensor, y: Tensor) -> Result<Tensor> {
        self.ensure_magnitude(base)?;
        let params: Vec<Tensor> = self.params().into_iter().map(|(_, t)| t).collect();
        self.forward_with(base, x, y, &params)
    }

    fn forward_with(
        &self,
        base: &BaseLayer,
        x: &Tensor,
        y: Tensor,
        p: &[Tensor],
    ) -> Result<Tensor> {
        let [down, up, m] = p else {
            return Err(Error::Autograd("dora: expected 3 parameters".into()));
        };
        if self.lora.dropped() {
            return Ok(y);
        }
        let scale = self.scale(base, down, up, m)?;
        let scale = self.lora.shape.per_channel(&cast(&scale, &y)?)?;
        self.lora.add_term(y, x, (down, None, up))?.mul(&scale)
    }

    fn delta_weight(&self, base: &BaseLayer) -> Result<Tensor> {
        self.ensure_magnitude(base)?;
        let w = base.weight(DType::F32)?;
        let (out, cols) = (self.lora.shape.out_dim(), self.lora.shape.cols());
        let lora = self.lora.delta_of(&self.lora.down, None, &self.lora.up)?;
        rescale(
            &w.reshape((out, cols))?,
            &lora.reshape((out, cols))?,
            &self.magnitude.reshape((out, 1))?,
            true,
        )?
        .reshape(w.dims())
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.to_kohya()?;
        v.push((
            "dora_scale".into(),
            self.magnitude.reshape(self.kohya_shape())?,
        ));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        self.lora.read_kohya(file)?;
        let m = file.take("dora_scale", &self.kohya_shape())?;
        self.magnitude.assign(&m.flatten_all()?)?;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// The kohya tensors with `dora_scale` = m (‖W‖ + ε) / ‖W + ΔW‖, which ComfyUI's
    /// reading (`comfyui_ratio`) turns into this layer's W'.
    fn to_comfyui(&self, base: &BaseLayer) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.to_kohya()?;
        let m = self.magnitude.mul(&self.comfyui_ratio(base)?)?;
        v.push(("dora_scale".into(), m.reshape(self.kohya_shape())?));
        Ok(v)
    }

    fn load_comfyui(&self, file: &mut Reader, base: &BaseLayer) -> Result<()> {
        self.load_kohya(file)?;
        let _g = crate::no_grad();
        let m = self.magnitude.div(&self.comfyui_ratio(base)?)?;
        self.magnitude.assign(&m)
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.write_peft(parts)?;
        for p in parts {
            let m = part_rows(&self.magnitude, p)?.reshape(self.peft_shape(p.rows))?;
            v.push((format!("{}.lora_magnitude_vector", p.module), m));
        }
        Ok(v)
    }

    /// The magnitude is split by rows as the LoRA's up matrix is: the LoRA part decides
    /// (the magnitude is set from the weight only at the layer's first use).
    fn check_peft(&self, parts: &[PeftPart]) -> Result<()> {
        self.lora.write_peft(parts).map(|_| ())
    }

    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()> {
        self.lora.read_peft(parts, file, file_scale)?;
        let dev = self.magnitude.device().clone();
        let ms = parts
            .iter()
            .map(|p| {
                file.take(
                    &p.module,
                    "lora_magnitude_vector",
                    &self.peft_shape(p.rows),
                    &dev,
                )?
                .flatten_all()
            })
            .collect::<Result<Vec<_>>>()?;
        self.magnitude.assign(&join_rows(parts, ms)?)?;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    fn set_batch(&self, step: u64, micro: u64, part: BatchPart) {
        self.lora.set_batch(step, micro, part);
    }
}
