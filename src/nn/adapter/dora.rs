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
//!
//! LyCORIS's weight decomposition of LoKr and LoHa (`AdapterConfig::weight_decompose`,
//! `Decomposed`) lives here too: one wrapper around any kind that gives its weight change
//! (`Kind::weight_decompose`, `Adapter::change_with`), with LyCORIS's semantics where they
//! differ from PEFT's: the norm is not detached and has ε added.

use super::io::{join_rows, part_rows, PeftFile, Reader};
use super::lora::Lora;
use super::merge::MergeLayer;
use super::{cast, Adapter, BaseLayer, Kind, LayerShape, PeftPart, Plan};
use crate::nn::dropout::BatchPart;
use crate::{DType, Device, Error, Result, Setting, Tensor};
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
    peft_tucker: false,
    per_projection: false,
    reads_weight: true,
    weight_decompose: false,
    lycoris_algo: "locon",
    plain_kohya: false,
    tool_layouts: false,
    loraplus_up: &["lora_up.weight"],
    merge,
    make: |p| {
        Ok(Arc::new(Dora {
            lora: Lora::new(p)?,
            magnitude: Magnitude::new(p.shape.out_dim(), p.device)?,
        }))
    },
};

/// What a decomposition divides by: PEFT's ‖W + ΔW‖ (the kind "dora"), or LyCORIS's
/// ‖W + ΔW‖ + ε (LoKr and LoHa with `AdapterConfig::weight_decompose`), ε the machine
/// epsilon of the dtype it computes in (LyCORIS 4.1.3, lycoris/functional/general.py
/// `_weight_decompose`: `+ torch.finfo(weight.dtype).eps`, the weight cast to `dora_scale`'s
/// dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Norm {
    /// ‖W + ΔW‖.
    Peft,
    /// ‖W + ΔW‖ + ε.
    Lycoris,
}

impl Norm {
    /// What is added to the norm computed in `dtype` (torch.finfo's eps of each).
    fn eps(self, dtype: DType) -> f64 {
        match (self, dtype) {
            (Norm::Peft, _) => 0.0,
            (Norm::Lycoris, DType::F64) => f64::EPSILON,
            (Norm::Lycoris, DType::BF16) => 2f64.powi(-7),
            (Norm::Lycoris, DType::F16) => 2f64.powi(-10),
            (Norm::Lycoris, _) => f32::EPSILON as f64,
        }
    }
}

/// W' - W of a decomposition, W' = m (W + ΔW) / (‖W + ΔW‖ + `eps`), from `w` and a change
/// `change` (out, cols): the norm per output row (`per_row`, `m` (out, 1)), or per input
/// column for a Linear's `m` (1, cols) (the form LyCORIS writes without `wd_on_out`).
pub(super) fn rescale(
    w: &Tensor,
    change: &Tensor,
    m: &Tensor,
    per_row: bool,
    eps: f64,
) -> Result<Tensor> {
    let v = w.add(change)?;
    let axis = if per_row { 1 } else { 0 };
    let norm = v.sqr()?.sum_keepdim(&[axis])?.sqrt()?;
    let norm = if eps > 0.0 {
        norm.affine(1.0, eps)?
    } else {
        norm
    };
    v.mul(&m.div(&norm)?)?.sub(w)
}

/// W' - W of a decomposition, W' = m (W + ΔW) / (‖W + ΔW‖ + `eps`), from `w` and a change
/// `change` (out, in, taps): the norm per output row (m (out) values), or, `per_in`, per input
/// channel over every output and tap (m (in) values; LyCORIS's `wd_on_out=False`, its
/// `_weight_decompose` in lycoris/functional/general.py). Result (out, in, taps).
pub(super) fn rescale_channels(
    w: &Tensor,
    change: &Tensor,
    m: &Tensor,
    per_in: bool,
    eps: f64,
) -> Result<Tensor> {
    let (out, cin) = (w.dims()[0], w.dims()[1]);
    let v = w.add(change)?;
    let (over, m) = if per_in {
        ([0, 2], m.reshape((1, cin, 1))?)
    } else {
        ([1, 2], m.reshape((out, 1, 1))?)
    };
    let norm = v.sqr()?.sum_keepdim(&over)?.sqrt()?;
    let norm = if eps > 0.0 {
        norm.affine(1.0, eps)?
    } else {
        norm
    };
    v.mul(&m.div(&norm)?)?.sub(w)
}

/// The change a file's DoRA of one layer stands for, as the matrix (out, cols): a LoRA's
/// tensors (`lora::merge`) and its magnitudes (`decompose`, PEFT's norm); `None` without a
/// LoRA's tensors (LyCORIS's LoKr and LoHa with magnitudes are theirs).
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    if !MAGNITUDES.iter().any(|t| l.has(t)) {
        return Ok(None);
    }
    match super::lora::merge(l)? {
        Some(lora) => decompose(l, lora, Norm::Peft).map(Some),
        None => Ok(None),
    }
}

/// The names a file's DoRA magnitudes go by: kohya's and LyCORIS's, PEFT's.
const MAGNITUDES: [&str; 2] = ["dora_scale", "lora_magnitude_vector"];

/// W' - W for a layer whose file holds magnitudes beside a change `change` (out, cols) of any
/// kind (LyCORIS decomposes LoRA, LoKr and LoHa alike, `weight_decompose`): kohya's
/// `dora_scale` ((out, 1[, 1, 1]) per output row, or a Linear's (1, in) per input column) or
/// PEFT's `lora_magnitude_vector` ((out), or (1, out, 1, 1) for a convolution), divided by
/// the kind's `norm` (in f32, where the merge computes); `change` itself without them.
pub(super) fn decompose(l: &MergeLayer, change: Tensor, norm: Norm) -> Result<Tensor> {
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
    } else if let (true, &[_, cin, _, _]) = (name == "dora_scale", l.dims()) {
        // A convolution's magnitudes per input channel (1, cin, 1, 1) (LyCORIS's
        // `wd_on_out=False`): the norm of each input channel over the outputs and taps.
        if m.dims() != [1, cin, 1, 1] {
            return Err(l.bad(
                name,
                &m,
                &format!("{out} magnitudes (out, 1, 1, 1) or {cin} (1, {cin}, 1, 1)"),
            ));
        }
        let taps = cols / cin.max(1);
        let w = l.weight()?.reshape((out, cin, taps))?;
        let change = change.reshape((out, cin, taps))?;
        let eps = norm.eps(DType::F32);
        return rescale_channels(&w, &change, &m, true, eps)?.reshape((out, cols));
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
    rescale(&l.weight()?, &change, &m, per_row, norm.eps(DType::F32))
}

/// A learned magnitude per output channel (DoRA's m, LyCORIS's `dora_scale`): (out), f32,
/// trainable; ‖W‖ of each output row at the layer's first use (a streamed weight is only on
/// the device then), unless a file set it before.
#[derive(Debug)]
struct Magnitude {
    m: Tensor,
    /// Whether m holds one value per input channel (LyCORIS's `wd_on_out=False`), not per
    /// output channel.
    per_in: bool,
    /// Whether m holds values (‖W‖ at first use, or a file's).
    ready: AtomicBool,
}

impl Magnitude {
    fn new(out: usize, device: &Device) -> Result<Self> {
        Ok(Magnitude {
            m: super::zeros(&[out], device)?,
            per_in: false,
            ready: AtomicBool::new(false),
        })
    }

    /// m of one value per input channel of a layer of `cin` input channels, the norm of each
    /// input channel's column at first use.
    fn per_input(cin: usize, device: &Device) -> Result<Self> {
        Ok(Magnitude {
            per_in: true,
            ..Magnitude::new(cin, device)?
        })
    }

    /// m = ‖W‖ (of each output row, or of each input channel's column) unless it holds values
    /// already.
    fn ensure(&self, base: &BaseLayer) -> Result<()> {
        if self.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let _g = crate::no_grad();
        let w = base.weight(DType::F32)?;
        let norms = if self.per_in {
            column_norms(&w)?
        } else {
            row_norms(&w)?
        };
        self.m.assign(&norms)?;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// m from a file's values (any shape of `out` values).
    fn set(&self, m: &Tensor) -> Result<()> {
        self.m.assign(&m.flatten_all()?)?;
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// An error unless m holds values, for the adapter of layer `path`.
    fn check(&self, path: &str) -> Result<()> {
        if self.ready.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(Error::Config {
                path: None,
                msg: format!(
                    "the magnitude (dora_scale) of layer {path} has no values yet (it is set \
                     from the weight at the layer's first use, or read from a file)"
                ),
            })
        }
    }
}

/// m's shape in the kohya / LyCORIS layout, `dora_scale` per output channel (LyCORIS's
/// `wd_on_out`: (out, 1) for a Linear, (out, 1, 1, 1) for a convolution).
fn kohya_shape(shape: LayerShape) -> Vec<usize> {
    let out = shape.out_dim();
    match shape {
        LayerShape::Linear { .. } => vec![out, 1],
        LayerShape::Conv2d { .. } => vec![out, 1, 1, 1],
    }
}

/// One layer's DoRA: a LoRA and the magnitude vector.
#[derive(Debug)]
pub struct Dora {
    lora: Lora,
    /// m: (out), f32, trainable.
    magnitude: Magnitude,
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

/// The norm of each input channel's column of `w` (out, in, ...) in f32, over every output
/// and kernel tap (LyCORIS 4.1.3's initial `dora_scale` with `wd_on_out=False`,
/// lycoris/modules/lokr.py and loha.py `__init__`): (in).
fn column_norms(w: &Tensor) -> Result<Tensor> {
    let (out, cin) = match w.dims() {
        [out, cin, ..] => (*out, *cin),
        d => {
            return Err(Error::InvalidArgument {
                op: "column_norms",
                msg: format!("a weight of at least two dims, got {d:?}"),
                shape: w.shape().clone(),
            })
        }
    };
    let taps = w.elem_count() / (out * cin).max(1);
    w.to_dtype(DType::F32)?
        .reshape((out, cin, taps))?
        .sqr()?
        .sum(&[0, 2])?
        .sqrt()
}

/// The norm ComfyUI divides a per-row `dora_scale` by: ‖W‖ of each output row of the frozen
/// weight, plus float32's epsilon (comfy/weight_adapter/base.py `weight_decompose`): (out).
fn comfyui_norms(w: &Tensor) -> Result<Tensor> {
    row_norms(w)?.affine(1.0, f32::EPSILON as f64)
}

impl Dora {
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
            .to_device(self.magnitude.m.device())?;
        let v = w.add(&self.lora.delta_of(&self.lora.down, None, &self.lora.up)?)?;
        comfyui_norms(&w)?.div(&row_norms(&v)?)
    }

    fn magnitude_ready(&self) -> Result<()> {
        self.magnitude.check(&self.lora.path)
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
        kohya_shape(self.lora.shape)
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
        p.push(("dora_scale", self.magnitude.m.clone()));
        p
    }

    /// The LoRA term's (the magnitude enters in f32, through the rescaling).
    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        self.lora.casts()
    }

    fn forward(&self, base: &BaseLayer, x: &Tensor, y: Tensor) -> Result<Tensor> {
        self.magnitude.ensure(base)?;
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
        self.magnitude.ensure(base)?;
        let w = base.weight(DType::F32)?;
        let (out, cols) = (self.lora.shape.out_dim(), self.lora.shape.cols());
        let lora = self.lora.delta_of(&self.lora.down, None, &self.lora.up)?;
        rescale(
            &w.reshape((out, cols))?,
            &lora.reshape((out, cols))?,
            &self.magnitude.m.reshape((out, 1))?,
            true,
            Norm::Peft.eps(DType::F32),
        )?
        .reshape(w.dims())
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.to_kohya()?;
        v.push((
            "dora_scale".into(),
            self.magnitude.m.reshape(self.kohya_shape())?,
        ));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        self.lora.read_kohya(file)?;
        let m = file.take("dora_scale", &self.kohya_shape())?;
        self.magnitude.set(&m)
    }

    /// The kohya tensors with `dora_scale` = m (‖W‖ + ε) / ‖W + ΔW‖, which ComfyUI's
    /// reading (`comfyui_ratio`) turns into this layer's W'.
    fn to_comfyui(&self, base: &BaseLayer) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.to_kohya()?;
        let m = self.magnitude.m.mul(&self.comfyui_ratio(base)?)?;
        v.push(("dora_scale".into(), m.reshape(self.kohya_shape())?));
        Ok(v)
    }

    fn load_comfyui(&self, file: &mut Reader, base: &BaseLayer) -> Result<()> {
        self.load_kohya(file)?;
        let _g = crate::no_grad();
        let m = self.magnitude.m.div(&self.comfyui_ratio(base)?)?;
        self.magnitude.m.assign(&m)
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        self.magnitude_ready()?;
        let mut v = self.lora.write_peft(parts)?;
        for p in parts {
            let m = part_rows(&self.magnitude.m, p)?.reshape(self.peft_shape(p.rows))?;
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
        let dev = self.magnitude.m.device().clone();
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
        self.magnitude.set(&join_rows(parts, ms)?)
    }

    fn set_batch(&self, step: u64, micro: u64, part: BatchPart) {
        self.lora.set_batch(step, micro, part);
    }
}

/// LyCORIS's weight decomposition of a kind's change (`AdapterConfig::weight_decompose`, the
/// kinds with `Kind::weight_decompose`: LoKr, LoHa), as LyCORIS 4.1.3 computes it with
/// `weight_decompose=True` (lycoris/modules/lokr.py `_rebuild_forward`,
/// loha.py `forward`, both through `apply_weight_decompose` and
/// lycoris/functional/general.py `_weight_decompose`): with ΔW the kind's change (its
/// dropout drawn, `Adapter::change_with`),
///
/// W' = m · (W + ΔW) / (‖W + ΔW‖ + ε),
///
/// the norm over each output channel's row (`wd_on_out=True`, LyCORIS's default,
/// `AdapterConfig::wd_on_out`) or over each input channel's column, every output and kernel
/// tap of it (`wd_on_out=False`: `_weight_decompose` transposes W to (in, out, ...) and takes
/// the norm of each of its rows), ε the machine epsilon of m's dtype (`Norm`), and the layer
/// computes y + x ⊛ (W' - W). The norm is not detached: LyCORIS differentiates
/// through it (its eager `_weight_decompose` and the backward of its fused kernel,
/// lycoris/kernels/autograd/dora.py, alike), so m and every factor get the gradient through
/// the norm too, where the kind "dora" follows PEFT and detaches it. m starts at ‖W‖ of each
/// row or column (LyCORIS's initial `dora_scale`, without ε), so a fresh adapter's change is
/// W (‖W‖ / (‖W‖ + ε) - 1), float32's epsilon relative to W: nothing at the weights'
/// precision.
///
/// Files: the kind's kohya tensors and `dora_scale` (out, 1) for a Linear, (out, 1, 1, 1) for
/// a convolution, or per input channel (1, in) and (1, cin, 1, 1), as LyCORIS writes and
/// reads them (the shape tells the axis); for ComfyUI's reading of per-row magnitudes (which
/// divides by ‖W‖ + ε32, the frozen weight's norm) the "comfyui" layout writes
/// m (‖W‖ + ε32) / (‖W + ΔW‖ + ε), and refuses per-input-channel ones. No PEFT layout:
/// PEFT's LoKr and LoHa have no magnitudes.
#[derive(Debug)]
pub struct Decomposed {
    inner: Arc<dyn Adapter>,
    /// m: (out), or (in) without `wd_on_out`; f32, trainable.
    magnitude: Magnitude,
}

/// `inner`, a fresh adapter of a kind with `Kind::weight_decompose` planned by `p`, with
/// LyCORIS's weight decomposition.
pub(super) fn decomposed(p: &Plan, inner: Arc<dyn Adapter>) -> Result<Arc<dyn Adapter>> {
    let magnitude = if p.config.wd_on_out {
        Magnitude::new(p.shape.out_dim(), p.device)?
    } else {
        Magnitude::per_input(p.shape.in_dim(), p.device)?
    };
    Ok(Arc::new(Decomposed { magnitude, inner }))
}

impl Decomposed {
    /// W' - W (the weight's shape, m's dtype) from the kind's change `dw` (the weight's
    /// shape) and m (out), or (in) per input channel.
    fn change(&self, base: &BaseLayer, dw: &Tensor, m: &Tensor) -> Result<Tensor> {
        let shape = self.inner.shape();
        let (out, cin) = (shape.out_dim(), shape.in_dim());
        let taps = shape.cols() / cin.max(1);
        let w = base
            .weight(m.dtype())?
            .to_device(m.device())?
            .reshape((out, cin, taps))?;
        let dw = dw.to_dtype(m.dtype())?.reshape((out, cin, taps))?;
        let eps = Norm::Lycoris.eps(m.dtype());
        rescale_channels(&w, &dw, m, self.magnitude.per_in, eps)?.reshape(shape.weight_dims())
    }

    /// `dora_scale`'s shape in the kohya / LyCORIS layout: per output channel (`kohya_shape`),
    /// or per input channel (1, in) for a Linear, (1, cin, 1, 1) for a convolution
    /// (LyCORIS 4.1.3's `wd_on_out=False`: the norms of W transposed, transposed back).
    fn dora_shape(&self) -> Vec<usize> {
        let shape = self.shape();
        match (self.magnitude.per_in, shape) {
            (false, _) => kohya_shape(shape),
            (true, LayerShape::Linear { in_dim, .. }) => vec![1, in_dim],
            (true, LayerShape::Conv2d { cin, .. }) => vec![1, cin, 1, 1],
        }
    }

    /// The refusal of the "comfyui" layout for magnitudes per input channel: its rescaling
    /// (`comfyui_ratio`) is of per-row magnitudes.
    fn comfyui_per_row(&self) -> Result<()> {
        if !self.magnitude.per_in {
            return Ok(());
        }
        Err(Error::Setting {
            setting: Setting::AdapterLayout,
            msg: format!(
                "the {} adapter of layer {} has magnitudes per input channel (wd_on_out = \
                 false), which the \"comfyui\" layout, written for ComfyUI's division by the \
                 frozen weight's norm of each output row, does not rescale: write the kohya \
                 layout (format \"kohya\")",
                self.inner.kind(),
                self.inner.path()
            ),
        })
    }

    /// (‖W‖ + ε32) / (‖W + ΔW‖ + ε) (out): what ComfyUI's magnitudes are to these. ComfyUI
    /// (0.3.64, comfy/weight_adapter/base.py `weight_decompose`, which its LoKr and LoHa
    /// call with a file's `dora_scale`) divides by the frozen weight's norm plus float32's
    /// epsilon.
    fn comfyui_ratio(&self, base: &BaseLayer) -> Result<Tensor> {
        let _g = crate::no_grad();
        let dev = self.magnitude.m.device();
        let w = base.weight(DType::F32)?.to_device(dev)?;
        let dw = self.inner.delta_weight(base)?.to_device(dev)?;
        let eps = Norm::Lycoris.eps(DType::F32);
        comfyui_norms(&w)?.div(&row_norms(&w.add(&dw)?)?.affine(1.0, eps)?)
    }

    /// The refusal of the PEFT layout, which has no weight decomposition of these kinds.
    fn no_peft(&self) -> Error {
        Error::Setting {
            setting: Setting::AdapterLayout,
            msg: format!(
                "the {} adapter of layer {} has LyCORIS's weight decomposition \
                 (AdapterConfig::weight_decompose), which the diffusers / PEFT layout cannot \
                 hold (PEFT's LoKr and LoHa have no magnitudes): write the kohya layout \
                 (format \"kohya\" or \"comfyui\"), or train without weight_decompose",
                self.inner.kind(),
                self.inner.path()
            ),
        }
    }
}

impl Adapter for Decomposed {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn path(&self) -> &str {
        self.inner.path()
    }

    fn shape(&self) -> LayerShape {
        self.inner.shape()
    }

    /// The kind's tensors, then `dora_scale`.
    fn params(&self) -> Vec<(&'static str, Tensor)> {
        let mut p = self.inner.params();
        p.push(("dora_scale", self.magnitude.m.clone()));
        p
    }

    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        self.inner.cast_params()
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn forward(&self, base: &BaseLayer, x: &Tensor, y: Tensor) -> Result<Tensor> {
        self.magnitude.ensure(base)?;
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
        let Some((m, inner)) = p.split_last() else {
            return Err(Error::Autograd(format!(
                "{}: no parameters for its weight decomposition",
                self.inner.kind()
            )));
        };
        let Some(dw) = self.inner.change_with(inner)? else {
            return Ok(y);
        };
        let change = self.change(base, &dw, m)?;
        self.shape().add_apply(y, x, &cast(&change, x)?)
    }

    fn delta_weight(&self, base: &BaseLayer) -> Result<Tensor> {
        self.magnitude.ensure(base)?;
        let dw = self.inner.delta_weight(base)?;
        self.change(base, &dw, &self.magnitude.m)
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        self.magnitude.check(self.path())?;
        let mut v = self.inner.to_kohya()?;
        let m = self.magnitude.m.reshape(self.dora_shape())?;
        v.push(("dora_scale".into(), m));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        self.inner.load_kohya(file)?;
        self.magnitude
            .set(&file.take("dora_scale", &self.dora_shape())?)
    }

    /// The kind's tensors for ComfyUI and `dora_scale` = m (‖W‖ + ε32) / (‖W + ΔW‖ + ε),
    /// which ComfyUI's reading (`comfyui_ratio`) turns into this layer's W'.
    fn to_comfyui(&self, base: &BaseLayer) -> Result<Vec<(String, Tensor)>> {
        self.magnitude.check(self.path())?;
        self.comfyui_per_row()?;
        let mut v = self.inner.to_comfyui(base)?;
        let m = self.magnitude.m.mul(&self.comfyui_ratio(base)?)?;
        v.push(("dora_scale".into(), m.reshape(kohya_shape(self.shape()))?));
        Ok(v)
    }

    fn load_comfyui(&self, file: &mut Reader, base: &BaseLayer) -> Result<()> {
        self.comfyui_per_row()?;
        self.inner.load_comfyui(file, base)?;
        let read = file.take("dora_scale", &kohya_shape(self.shape()))?;
        let _g = crate::no_grad();
        self.magnitude
            .set(&read.flatten_all()?.div(&self.comfyui_ratio(base)?)?)
    }

    fn to_peft(&self, _: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        Err(self.no_peft())
    }

    fn check_peft(&self, _: &[PeftPart]) -> Result<()> {
        Err(self.no_peft())
    }

    fn load_peft(&self, _: &[PeftPart], _: &mut PeftFile, _: f64) -> Result<()> {
        Err(self.no_peft())
    }

    fn set_batch(&self, step: u64, micro: u64, part: BatchPart) {
        self.inner.set_batch(step, micro, part);
    }
}
