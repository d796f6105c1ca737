//! Layers with parameters loaded by key path. Shape letters: N batch, L tokens, C channels,
//! H x W spatial. Weights keep the checkpoint's layout (Linear: (out, in)).

use super::adapter::{Adapter, BaseLayer, LayerShape};
use super::{Packing, VarBuilder};
use crate::autograd::{
    hooked_computes, hooked_product, kept_or_replayed, note_forward_only, take_unread_product,
    unread_product, KeptKind, FEW_ROWS,
};
use crate::{Error, Result, Tensor};
use std::cell::Cell;
use std::sync::Arc;

/// `y = x W^T + b` over the last dim; `weight` (out, in), `bias` (out); with an adapter
/// (`crate::nn::adapter`) when the builder planned one for this path. With a packed base
/// (`crate::nn::Packing`: FP8 codes from `VarBuilder::with_fp8`, GGML blocks from a GGUF
/// file) `weight` holds the packed words and `packing` says how to decode them: each call
/// decodes the weight into a transient buffer of the activation's dtype, and the backward
/// decodes it again instead of keeping the decoded copy (`PackedMatmul`).
#[derive(Clone, Debug)]
pub struct Linear {
    /// (out, in), or the packed words when `packing` is set.
    pub weight: Tensor,
    /// (out), if the layer has one.
    pub bias: Option<Tensor>,
    /// The adapter (LoRA, DoRA, ...), if one was planned for this path.
    pub adapter: Option<Arc<dyn Adapter>>,
    /// How a packed `weight` decodes (`None`: a dense weight).
    pub packing: Option<Packing>,
}

impl Linear {
    /// `weight` (out_dim, in_dim) and, when `bias`, `bias` (out_dim) from `vb`, plus the
    /// adapter the builder plans for this path, if any.
    pub fn new(vb: &VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Self> {
        let (weight, packing) = vb.get_linear_weight(out_dim, in_dim, "weight")?;
        let has_bias = bias;
        let bias = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            adapter: vb.adapter(LayerShape::Linear { in_dim, out_dim }, has_bias)?,
            packing,
        })
    }

    /// (in, out) widths.
    pub fn dims(&self) -> (usize, usize) {
        match &self.packing {
            Some(p) => {
                let (out, inp) = p.dims(&self.weight);
                (inp, out)
            }
            None => {
                let d = self.weight.dims();
                (d[1], d[0])
            }
        }
    }

    /// The weight (out, in) in `dtype`, a packed weight decoded.
    pub fn dense_weight(&self, dtype: crate::DType) -> Result<Tensor> {
        match &self.packing {
            Some(p) => p.decode(&self.weight, dtype),
            None => self.weight.to_dtype(dtype),
        }
    }

    /// (..., in) -> (..., out): one 2D GEMM over all leading dims, W^T passed as a view.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, None, false)
    }

    /// [`Linear::forward`] for a checkpointed block's last layer whose output, in the
    /// block's re-run, no gradient reads when `unread` (the caller knows: say, a block that
    /// ends `x + gate * layer(h)` with a gate that needs no gradient, so the backward needs
    /// the gate and `h`, never the layer's output). Then a checkpoint neither keeps the base
    /// product (`Keep::down_projections` or not) nor runs it again in the re-run: the re-run
    /// takes zeros in its place and records its backward as usual; the adapter's own
    /// products still run (their down-projection is read by its gradient). Gradients are
    /// the same bit for bit. Outside a checkpoint, and with `unread` false, `forward`.
    pub fn forward_tail(&self, x: &Tensor, unread: bool) -> Result<Tensor> {
        self.forward_with(x, None, unread)
    }

    /// `self.forward(h.gelu_tanh())`, GELU quantizing its output's rows for 8-bit products in
    /// its own pass where this layer has them (`Linear::input_code`).
    pub fn forward_gelu_tanh(&self, h: &Tensor) -> Result<Tensor> {
        match self.input_code() {
            Some(code) => {
                let (y, rows) = h.gelu_tanh_quant8(code)?;
                self.forward_rows8(&y, Some(&rows))
            }
            None => self.forward(&h.gelu_tanh()?),
        }
    }

    /// `self.forward(&Tensor::cat(&[a, &h.gelu_tanh()?], last)?)` (Flux's single blocks'
    /// `linear2`), the concatenation in one pass (`Tensor::cat_gelu_tanh`) that also
    /// quantizes its rows for 8-bit products where this layer has them.
    pub fn forward_cat_gelu_tanh(&self, a: &Tensor, h: &Tensor) -> Result<Tensor> {
        match self.input_code() {
            Some(code) => {
                let (y, rows) = a.cat_gelu_tanh_quant8(h, code)?;
                self.forward_rows8(&y, Some(&rows))
            }
            None => self.forward(&a.cat_gelu_tanh(h)?),
        }
    }

    /// The code this Linear's 8-bit products quantize their input rows into, where the
    /// producer of the input may do it in its own pass (`Tensor::modulate_quant8`,
    /// `Tensor::gelu_tanh_quant8`, then [`Linear::forward_rows8`]): a packed weight whose
    /// products run in 8 bits unrotated, at widths the tensor cores take. Otherwise None.
    pub fn input_code(&self) -> Option<crate::backend::fp8::Code8> {
        let (_, _, code, rotation) = eight_bit(self.packing.as_ref()?, &self.weight)?;
        (rotation == 0).then_some(code)
    }

    /// [`Linear::forward`] with the rows of `x` (flattened to (rows, in)) already in 8-bit
    /// codes, made by the op that produced `x`: an 8-bit product in the same code takes them
    /// instead of quantizing `x` again; any other form of the layer ignores them.
    pub fn forward_rows8(&self, x: &Tensor, rows8: Option<&crate::Rows8>) -> Result<Tensor> {
        self.forward_with(x, rows8, false)
    }

    /// `forward_rows8`, and `forward_tail`'s `unread`.
    fn forward_with(
        &self,
        x: &Tensor,
        rows8: Option<&crate::Rows8>,
        unread: bool,
    ) -> Result<Tensor> {
        // An adapter that does more than add to the base output may read it.
        let unread = unread && self.adapter.as_ref().is_none_or(|a| a.adds_to_output());
        let d = x.dims();
        let (in_dim, out_dim) = self.dims();
        if d.last() != Some(&in_dim) {
            return Err(Error::ShapeMismatch {
                op: "linear",
                lhs: x.shape().clone(),
                rhs: (out_dim, in_dim).into(),
            });
        }
        let rows: usize = d[..d.len() - 1].iter().product();
        let x = x.reshape((rows, in_dim))?;
        // The bias goes into the base GEMM's epilogue unless an adapter rescales the base
        // output (DoRA), which must then see it without the bias.
        let early_bias = match (&self.bias, &self.adapter) {
            (Some(b), None) => Some(b),
            (Some(b), Some(a)) if a.adds_to_output() => Some(b),
            _ => None,
        };
        // The base output of a layer that sees few rows, or of a down-projection, is one a
        // checkpoint may keep (`Keep`).
        // A tail's (`unread`) is never kept: a re-run takes zeros for it.
        let few = rows * FEW_ROWS <= in_dim;
        let keep: &[KeptKind] = match (unread, few, in_dim > out_dim) {
            (true, ..) => &[],
            (false, true, true) => &[KeptKind::FewRows, KeptKind::DownProjection],
            (false, true, false) => &[KeptKind::FewRows],
            (false, false, true) => &[KeptKind::DownProjection],
            (false, false, false) => &[],
        };
        // A streamed weight held in host memory for its products (the Linears over the
        // conditioning vector, `BlockStreamer::set_host_products`): the product comes from
        // the host (or a re-run's log), the bias is added after.
        let host = self.packing.is_none() && hooked_computes(&self.weight, &x)?;
        let early_bias = early_bias.filter(|b| !host && b.dtype() == x.dtype());
        let (y, unread, bias_done) = unread_product(unread, || -> Result<_> {
            Ok(match &self.packing {
                // An int8 product adds a frozen bias where it scales its sums (the scaled FP8
                // GEMM scales its own and leaves the bias to an add after).
                Some(p) => packed_matmul(
                    &x,
                    &self.weight,
                    p,
                    out_dim,
                    early_bias.filter(|b| !b.requires_grad() && p.fuses_bias()),
                    rows8,
                    keep,
                )?,
                None if host => (host_matmul(&x, &self.weight, keep)?, false, false),
                None => {
                    let (y, unread) = x.linear_product(&self.weight.t()?, early_bias, keep)?;
                    (y, unread, early_bias.is_some())
                }
            })
        })?;
        // Whether the adapter read the frozen weight (DoRA's norms do).
        let read = Cell::new(false);
        // A bias the base product left out goes into the adapter's last GEMM where the
        // adapter only adds to the output (LoRA's up-projection accumulates into it).
        let pending = self
            .bias
            .as_ref()
            .filter(|b| !bias_done && b.dtype() == x.dtype());
        let (y, bias_done) = match &self.adapter {
            Some(a) => {
                let weight = |dtype| {
                    read.set(true);
                    self.dense_weight(dtype)
                };
                let base = BaseLayer::new(LayerShape::Linear { in_dim, out_dim }, &weight);
                match pending.filter(|_| a.adds_to_output()) {
                    Some(b) => a.forward_biased(&base, &x, y, b)?,
                    None => (a.forward(&base, &x, y)?, bias_done),
                }
            }
            None => (y, bias_done),
        };
        // A re-run that took the base output from the log and recorded nothing of the GEMM
        // (nothing of it needs a gradient), whose adapter read no weight: only the forward
        // read the weight (and its FP8 scales; a bias added after the GEMM is read again).
        if unread && !read.get() {
            let side = self.packing.as_ref().and_then(Packing::side_tensors);
            note_forward_only(std::iter::once(&self.weight).chain(side));
        }
        let y = match (&self.bias, bias_done) {
            (Some(b), false) => y.add(b)?,
            _ => y,
        };
        let mut out = d.to_vec();
        if let Some(last) = out.last_mut() {
            *last = out_dim;
        }
        y.reshape(out)
    }
}

/// x (rows, in) @ weight^T computed by the hooks of the block's run (`hooked_product`: a
/// weight held in host memory), or taken from a checkpoint's log in its re-run. The input
/// needs no gradient (the host products refuse one that does) and the weight is frozen:
/// nothing is recorded.
fn host_matmul(x: &Tensor, weight: &Tensor, keep: &[KeptKind]) -> Result<Tensor> {
    let compute = || -> Result<Vec<Tensor>> {
        match hooked_product(weight, x)? {
            Some(y) => Ok(vec![y]),
            None => Err(Error::Stream(format!(
                "the host-held weight of shape {} was asked for a product outside its \
                 block's run",
                weight.shape()
            ))),
        }
    };
    let (y, _) = kept_or_replayed(keep, compute)?;
    one_output(y, x, weight.dims()[0], "host product")
}

/// The one (rows, out) output in `x`'s dtype that a Linear's GEMM computed or its
/// checkpoint's log gave back; anything else means the re-run differs from its forward.
fn one_output(y: Vec<Tensor>, x: &Tensor, out: usize, what: &str) -> Result<Tensor> {
    let rows = x.dims()[0];
    match <[Tensor; 1]>::try_from(y) {
        Ok([y]) if y.dims() == [rows, out] && y.dtype() == x.dtype() => Ok(y),
        _ => Err(Error::Autograd(format!(
            "kept {what} does not fit this call ({rows}, {out}) {}: the checkpoint's re-run \
             differs from its forward",
            x.dtype()
        ))),
    }
}

/// x (rows, in) @ decode(packed)^T: the weight decoded into x's dtype for the GEMM and
/// dropped after it. The backward (dx = dy W) decodes it again, so the tape keeps only the
/// packed words (a frozen weight gets no gradient). With `keep`, a checkpoint may keep the
/// output (see `Tensor::linear_product`); its re-run then neither decodes nor multiplies.
/// With 8-bit products, `bias` (frozen, in x's dtype) is added in the product's own pass, and
/// `rows8`, x's rows in the product's code made by x's producer, stand for its quantization.
/// Also returns whether the weight went unread (as `linear_product`) and whether the bias
/// was added.
fn packed_matmul(
    x: &Tensor,
    packed: &Tensor,
    packing: &Packing,
    out_dim: usize,
    bias: Option<&Tensor>,
    rows8: Option<&crate::Rows8>,
    keep: &[KeptKind],
) -> Result<(Tensor, bool, bool)> {
    let eight = fp8_products(packing, packed, x);
    let bias = bias.filter(|_| eight.is_some());
    let compute = || -> Result<Vec<Tensor>> {
        let _g = crate::no_grad();
        if let Some((scale, _, code, rotation)) = eight {
            let (rows, cols) = (x.dims()[0], x.dims()[1]);
            let (qx, sx) = match rows8.filter(|r| rotation == 0 && r.fits(code, rows, cols)) {
                Some(r) => (r.codes.clone(), r.scales.clone()),
                None => {
                    // The input rotated as the weight's codes were (x H), where they were.
                    let rotated = match rotation {
                        0 => None,
                        b => Some(x.hadamard_rows(b)?),
                    };
                    rotated.as_ref().unwrap_or(x).quant_rows8(code, None)?
                }
            };
            return Ok(vec![crate::product8_bias(
                code,
                [&qx, &sx, packed, scale],
                bias,
                x.dtype(),
            )?]);
        }
        let w = packing.decode(packed, x.dtype())?;
        Ok(vec![x.matmul(&w.t()?)?])
    };
    // A tail's product in a re-run (`autograd::unread_product`): zeros in its place.
    let (y, replayed) = if take_unread_product() {
        let zeros = Tensor::zeros((x.dims()[0], out_dim), x.dtype(), x.device())?;
        (vec![zeros], true)
    } else {
        kept_or_replayed(keep, compute)?
    };
    let y = one_output(y, x, out_dim, "packed linear output")?;
    let node = Arc::new(PackedMatmul {
        packed: packed.clone(),
        packing: packing.clone(),
    });
    let mut out =
        crate::autograd::custom_op(std::slice::from_ref(x), vec![y], node, x.requires_grad())?;
    let y = out
        .pop()
        .ok_or_else(|| Error::Autograd("packed matmul: no output".into()))?;
    // From the log, and no backward recorded: the packed words were not read.
    Ok((y, replayed && !x.requires_grad(), bias.is_some()))
}

/// What an 8-bit product of a packed weight (`Packing::Fp8` with `products`) reads: the
/// weight's per-row scales, what its backward keeps, its codes' format and its rotation,
/// where the weight (out, in) has widths the tensor cores take in both directions (multiples
/// of 16). Otherwise None: the weight is decoded for its products.
type EightBit<'a> = (
    &'a Tensor,
    &'a super::Fp8Kept,
    crate::backend::fp8::Code8,
    usize,
);

fn eight_bit<'a>(packing: &'a Packing, packed: &Tensor) -> Option<EightBit<'a>> {
    let Packing::Fp8 {
        scale,
        code,
        rotation,
        products: true,
        kept,
    } = packing
    else {
        return None;
    };
    let (out_dim, in_dim) = packing.dims(packed);
    super::eight_bit_widths(out_dim, in_dim).then_some((scale, kept, *code, *rotation))
}

/// [`eight_bit`] where the activations `x` (rows, width) allow it too: a float dtype the
/// quantization reads (f32, bf16, f16).
fn fp8_products<'a>(packing: &'a Packing, packed: &Tensor, x: &Tensor) -> Option<EightBit<'a>> {
    let float = matches!(
        x.dtype(),
        crate::DType::F32 | crate::DType::BF16 | crate::DType::F16
    );
    eight_bit(packing, packed).filter(|_| float && x.rank() == 2)
}

/// The backward of `packed_matmul`: dx = dy decode(W).
struct PackedMatmul {
    packed: Tensor,
    packing: Packing,
}

impl crate::autograd::CustomBackward for PackedMatmul {
    fn name(&self) -> &'static str {
        "packed_matmul"
    }

    fn backward(
        &self,
        out_grads: &[Option<Tensor>],
        _grads: &mut crate::Grads,
    ) -> Result<Vec<Option<Tensor>>> {
        let Some(Some(dy)) = out_grads.first() else {
            return Ok(vec![None]);
        };
        if let Some((scale, kept, code, rotation)) = fp8_products(&self.packing, &self.packed, dy) {
            // dx = dy diag(s) Q: the weight's row scales fold into dy's columns before dy
            // is quantized a row at a time; the product runs over the codes transposed
            // (kept from the first backward where the weight stays on the device) with a
            // column scale of ones (made once).
            let (qg, sg) = dy.quant_rows8(code, Some(scale))?;
            let qt = kept.transposed(&self.packed)?;
            let in_dim = qt.dims()[0];
            let ones = kept.ones(in_dim, dy.device())?;
            let dx = crate::product8(code, &qg, &sg, &qt, &ones, dy.dtype())?;
            // dy (W H) is dx H: rotated back (the rotation is its own inverse).
            return Ok(vec![Some(match rotation {
                0 => dx,
                b => dx.hadamard_rows(b)?,
            })]);
        }
        let w = self.packing.decode(&self.packed, dy.dtype())?;
        Ok(vec![Some(dy.matmul(&w)?)])
    }
}

/// Rows of `weight` (num, dim) picked by u32 ids of any shape: ids.shape + (dim,).
#[derive(Clone, Debug)]
pub struct Embedding {
    /// The table, (num, dim).
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num` rows of width `dim` under key `weight` of `vb`.
    pub fn new(vb: &VarBuilder, num: usize, dim: usize) -> Result<Self> {
        Ok(Embedding {
            weight: vb.get((num, dim), "weight")?,
        })
    }

    /// ids (u32, any shape S) -> (S..., dim).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut shape = ids.dims().to_vec();
        shape.push(self.weight.dims()[1]);
        self.weight
            .index_select(&ids.flatten_all()?, 0)?
            .reshape(shape)
    }
}

/// LayerNorm over the last dim, with or without (weight, bias).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Per-feature scale (dim), when affine.
    pub weight: Option<Tensor>,
    /// Per-feature offset (dim), when affine.
    pub bias: Option<Tensor>,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl LayerNorm {
    /// A norm over `dim` features; when `affine`, `weight` and `bias` (dim) from `vb`.
    pub fn new(vb: &VarBuilder, dim: usize, eps: f64, affine: bool) -> Result<Self> {
        let (weight, bias) = if affine {
            (Some(vb.get(dim, "weight")?), Some(vb.get(dim, "bias")?))
        } else {
            (None, None)
        };
        Ok(LayerNorm { weight, bias, eps })
    }

    /// x (..., dim) -> same shape, each last-dim row normalized.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }
}

/// RMSNorm over the last dim with a learned scale.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// Per-feature scale (dim).
    pub weight: Tensor,
    /// Added to the mean square before the square root.
    pub eps: f64,
}

impl RmsNorm {
    /// The scale under key `weight` (diffusers, SD3).
    pub fn new(vb: &VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        Self::with_key(vb, dim, eps, "weight")
    }

    /// The scale under another key (BFL's Flux checkpoints call it `scale`).
    pub fn with_key(vb: &VarBuilder, dim: usize, eps: f64, key: &str) -> Result<Self> {
        Ok(RmsNorm {
            weight: vb.get(dim, key)?,
            eps,
        })
    }

    /// x (..., dim) -> same shape, `x / sqrt(mean(x^2) + eps) * weight` per last-dim row.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(Some(&self.weight), self.eps)
    }
}

/// GroupNorm of (N, C, ...) with per-channel (weight, bias).
#[derive(Clone, Debug)]
pub struct GroupNorm {
    /// Number of channel groups (divides C).
    pub groups: usize,
    /// Per-channel scale (C), when affine.
    pub weight: Option<Tensor>,
    /// Per-channel offset (C), when affine.
    pub bias: Option<Tensor>,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl GroupNorm {
    /// `groups` groups over `channels` channels; when `affine`, `weight` and `bias`
    /// (channels) from `vb`.
    pub fn new(
        vb: &VarBuilder,
        groups: usize,
        channels: usize,
        eps: f64,
        affine: bool,
    ) -> Result<Self> {
        let (weight, bias) = if affine {
            (
                Some(vb.get(channels, "weight")?),
                Some(vb.get(channels, "bias")?),
            )
        } else {
            (None, None)
        };
        Ok(GroupNorm {
            groups,
            weight,
            bias,
            eps,
        })
    }

    /// x (N, C, ...) -> same shape, normalized over each group of C / groups channels and
    /// all positions.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.group_norm(
            self.groups,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }
}

/// Activations by name, as configs spell them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Exact (erf) GELU.
    Gelu,
    /// GELU with the tanh approximation.
    GeluTanh,
    /// `x * sigmoid(x)`.
    Silu,
    /// `max(x, 0)`.
    Relu,
}

impl Activation {
    /// The activation applied elementwise.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        }
    }
}

/// Nearest-neighbour upsampling of (N, C, H, W) by an integer factor: each pixel becomes an
/// s x s block (a broadcast view, one copy).
pub fn upsample_nearest2d(x: &Tensor, scale: usize) -> Result<Tensor> {
    let d = x.dims();
    if d.len() != 4 || scale == 0 {
        return Err(Error::invalid(
            "upsample_nearest2d",
            format!("needs (N, C, H, W) and a scale > 0, got scale {scale}"),
            x.shape(),
        ));
    }
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    x.reshape(vec![n, c, h, 1, w, 1])?
        .broadcast_as(vec![n, c, h, scale, w, scale])?
        .reshape((n, c, h * scale, w * scale))
}
