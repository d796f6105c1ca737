//! Adapters: small trainable additions to the frozen Linear and Conv2d layers of a model.
//!
//! A layer built from a `VarBuilder` with adapters planned (`VarBuilder::with_adapters`) asks
//! the set ([`Adapters`]) for an adapter by its key path and shape; the set's config picks the
//! kind and which paths match. The layer then runs its frozen op and hands the result to the
//! adapter ([`Adapter::forward`]); the adapter knows its own parameters, its weight change
//! (merging), and its file names in the kohya / LyCORIS layout that ComfyUI reads and in the
//! PEFT layout that diffusers and PEFT read.
//!
//! A kind is one file implementing [`Adapter`] and one entry in [`KINDS`]:
//! - `lora`: low-rank B·A (Hu et al. 2021), on Linear and (LoCon) Conv2d;
//! - `dora`: LoRA with a learned magnitude per output channel (Liu et al. 2024, "DoRA");
//! - `lokr`: a Kronecker product w1 ⊗ w2 (LyCORIS);
//! - `loha`: a Hadamard product of two low-rank products (LyCORIS);
//! - `full`: the layer's weight itself trained (as a change to it).
//!
//! LoKr and LoHa also train with LyCORIS's weight decomposition
//! ([`AdapterConfig::weight_decompose`], DoRA's learned magnitude per output channel on their
//! change, LyCORIS's `weight_decompose` / `dora_wd`): a kind opts in through
//! [`Kind::weight_decompose`] by giving its weight change ([`Adapter::change_with`]), and the
//! set wraps each of its adapters in the one wrapper that rescales that change (dora.rs,
//! `Decomposed`), which adds the magnitude `dora_scale` to its parameters and files.
//!
//! Parameters are f32 whatever the model's dtype (the optimizer updates f32 values; the
//! forward casts to the activations' dtype).

mod copies;
mod dora;
mod full;
mod io;
mod loha;
mod lokr;
mod lora;
mod merge;
mod split;
mod tools;

pub use copies::{ComputeCopies, CopiesGuard};
pub(crate) use io::PeftScales;
pub use io::{
    kohya_name, kohya_name_in, load_kohya_sets, load_peft_sets, save_kohya_sets, save_peft_sets,
    FileSet, PeftFile, KOHYA_MODEL, PEFT_CONFIG,
};
pub use lokr::{factorization, LokrSplit};
pub use lora::Lora;
pub use merge::MergeLayer;
pub(crate) use merge::{rows_in_place, MERGE_CHUNK_VALUES};
pub(crate) use split::lycoris_name;
pub use tools::{ModuleNames, Tool, ToolNames, AI_TOOLKIT_PREFIX};

use super::dropout::BatchPart;
use super::seed::key_hash;
use crate::{DType, Device, Error, Result, Setting, Tensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The frozen op an adapter sits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerShape {
    /// y = x W^T, W (out, in).
    Linear {
        /// Input features.
        in_dim: usize,
        /// Output features.
        out_dim: usize,
    },
    /// y = conv2d(x, W), W (cout, cin, kh, kw) (one group).
    Conv2d {
        /// Input channels.
        cin: usize,
        /// Output channels.
        cout: usize,
        /// (kh, kw).
        kernel: (usize, usize),
        /// Step between windows.
        stride: (usize, usize),
        /// Zeros added on each side.
        padding: (usize, usize),
        /// Spacing between kernel taps.
        dilation: (usize, usize),
    },
}

impl LayerShape {
    /// Output features or channels.
    pub fn out_dim(&self) -> usize {
        match *self {
            LayerShape::Linear { out_dim, .. } => out_dim,
            LayerShape::Conv2d { cout, .. } => cout,
        }
    }

    /// Input features or channels.
    pub fn in_dim(&self) -> usize {
        match *self {
            LayerShape::Linear { in_dim, .. } => in_dim,
            LayerShape::Conv2d { cin, .. } => cin,
        }
    }

    /// The kernel, (1, 1) for a Linear.
    pub fn kernel(&self) -> (usize, usize) {
        match *self {
            LayerShape::Linear { .. } => (1, 1),
            LayerShape::Conv2d { kernel, .. } => kernel,
        }
    }

    /// Whether this is a convolution.
    pub fn is_conv(&self) -> bool {
        matches!(self, LayerShape::Conv2d { .. })
    }

    /// The weight's shape: (out, in) or (cout, cin, kh, kw).
    pub fn weight_dims(&self) -> Vec<usize> {
        match *self {
            LayerShape::Linear { in_dim, out_dim } => vec![out_dim, in_dim],
            LayerShape::Conv2d {
                cin, cout, kernel, ..
            } => vec![cout, cin, kernel.0, kernel.1],
        }
    }

    /// The weight's columns as a matrix: in, or cin · kh · kw.
    pub fn cols(&self) -> usize {
        let (kh, kw) = self.kernel();
        self.in_dim() * kh * kw
    }

    /// `x ⊛ w` without bias, for a weight `w` of any number of output rows in this layer's
    /// geometry: x (rows, in) -> (rows, w rows), or x (N, cin, H, W) -> (N, w rows, H', W').
    pub fn apply(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match *self {
            LayerShape::Linear { .. } => x.matmul(&w.t()?),
            LayerShape::Conv2d {
                stride,
                padding,
                dilation,
                ..
            } => super::functional::conv2d(x, w, None, stride, padding, dilation, 1),
        }
    }

    /// `x ⊛ w` for a 1×1 `w` (out, r[, 1, 1]): a Linear's matmul, a pointwise convolution.
    pub fn apply_pointwise(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match self {
            LayerShape::Linear { .. } => x.matmul(&w.t()?),
            LayerShape::Conv2d { .. } => {
                super::functional::conv2d(x, w, None, (1, 1), (0, 0), (1, 1), 1)
            }
        }
    }

    /// `y + x ⊛ w`: on a Linear the product is added into `y`'s buffer by the GEMM itself
    /// when nothing else holds it (`Tensor::add_matmul`), so an adapter's term costs no
    /// separate pass over the layer's output.
    pub fn add_apply(&self, y: Tensor, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match self {
            LayerShape::Linear { .. } => y.add_matmul(x, &w.t()?),
            LayerShape::Conv2d { .. } => y.add(&self.apply(x, w)?),
        }
    }

    /// `y + x ⊛ change` (the change cast to x's dtype), plus `bias` on a Linear in the same
    /// GEMM (`Tensor::add_matmul_bias`): what the kinds whose forward adds a weight change
    /// to the layer's output do (LoHa, LoKr, a split layer's stacked changes). Also whether
    /// the bias went in: not for a convolution, nor where `change` is `None` (module dropout
    /// skipped the adapter).
    pub fn add_change(
        &self,
        y: Tensor,
        x: &Tensor,
        change: Option<Tensor>,
        bias: Option<&Tensor>,
    ) -> Result<(Tensor, bool)> {
        let Some(dw) = change else {
            return Ok((y, false));
        };
        let dw = cast(&dw, x)?;
        match (self, bias) {
            (LayerShape::Linear { .. }, Some(b)) => {
                Ok((y.add_matmul_bias(x, &dw.t()?, Some(b))?, true))
            }
            _ => Ok((self.add_apply(y, x, &dw)?, false)),
        }
    }

    /// `y + x ⊛ w` for a 1×1 `w`, as [`LayerShape::add_apply`].
    pub fn add_apply_pointwise(&self, y: Tensor, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.add_apply_pointwise_bias(y, x, w, None)
    }

    /// [`LayerShape::add_apply_pointwise`] plus `bias` (out) on a Linear, in the same GEMM
    /// (`Tensor::add_matmul_bias`); a convolution's bias is left to its layer (`None` here
    /// is an error for a convolution given one).
    pub fn add_apply_pointwise_bias(
        &self,
        y: Tensor,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        match (self, bias) {
            (LayerShape::Linear { .. }, _) => y.add_matmul_bias(x, &w.t()?, bias),
            (LayerShape::Conv2d { .. }, None) => y.add(&self.apply_pointwise(x, w)?),
            (LayerShape::Conv2d { .. }, Some(_)) => Err(Error::Autograd(
                "a convolution's adapter was given its layer's bias to add".into(),
            )),
        }
    }

    /// `v` (out) shaped to scale an output along its channels: (out) for a Linear's (rows,
    /// out), (1, out, 1, 1) for a convolution's (N, out, H, W).
    pub fn per_channel(&self, v: &Tensor) -> Result<Tensor> {
        match self {
            LayerShape::Linear { .. } => Ok(v.clone()),
            LayerShape::Conv2d { .. } => v.reshape((1, v.elem_count(), 1, 1)),
        }
    }
}

/// What an adapter sees of its layer: the shape and the frozen weight.
pub struct BaseLayer<'a> {
    /// The layer's op.
    pub shape: LayerShape,
    weight: &'a (dyn Fn(DType) -> Result<Tensor> + 'a),
}

impl<'a> BaseLayer<'a> {
    /// A layer of `shape` whose dense weight in a dtype `weight` gives (an FP8 weight decoded).
    pub fn new(shape: LayerShape, weight: &'a (dyn Fn(DType) -> Result<Tensor> + 'a)) -> Self {
        BaseLayer { shape, weight }
    }

    /// The frozen weight (`LayerShape::weight_dims`) in `dtype`.
    pub fn weight(&self, dtype: DType) -> Result<Tensor> {
        (self.weight)(dtype)
    }
}

/// One diffusers module an adapted layer maps to (a fused layer maps to several): the
/// module name, its first row in the layer's output, its rows, and whether diffusers stores
/// its two halves swapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeftPart {
    /// The diffusers module (`transformer_blocks.0.attn.to_q`).
    pub module: String,
    /// Its first row in the layer's output.
    pub start: usize,
    /// Its rows.
    pub rows: usize,
    /// Whether diffusers stores its two halves swapped.
    pub swapped: bool,
}

/// One layer's adapter (see the module docs).
pub trait Adapter: Send + Sync + std::fmt::Debug {
    /// The kind's name in `[adapter] kind`.
    fn kind(&self) -> &'static str;

    /// The adapted layer's key path.
    fn path(&self) -> &str;

    /// The adapted layer's op.
    fn shape(&self) -> LayerShape;

    /// The trainable tensors, with their names in the kohya / LyCORIS layout (the part after
    /// `<layer name>.`), in a fixed order.
    fn params(&self) -> Vec<(&'static str, Tensor)>;

    /// The trainable tensors under their names in the set, `<path>.<name>` (what an optimizer
    /// and a checkpoint key them by), in `params` order.
    fn named_params(&self) -> Vec<(String, Tensor)> {
        self.params()
            .into_iter()
            .map(|(n, t)| (format!("{}.{n}", self.path()), t))
            .collect()
    }

    /// The trainable tensors the forward casts to the activations' dtype, each with the
    /// factor it scales it by first (`cast_scaled`): what a step's compute copies hold
    /// (`Adapters::compute_copies`). None by default: a kind that casts only values it
    /// computes (its weight change) reads no copies.
    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        vec![]
    }

    /// The adapters this one is made of, each under its own name in the kohya layout (one
    /// per diffusers projection of a fused layer, `AdapterConfig::per_projection`), or `None`:
    /// this adapter is one, under `kohya_name(path)`.
    fn kohya_members(&self) -> Option<Vec<(String, Arc<dyn Adapter>)>> {
        None
    }

    /// The adapted output from the layer's input `x` and its frozen output `y` (without
    /// bias), computed with `params` in place of the adapter's own (same order and shapes as
    /// `params()`): what gradchecks and the forward share.
    fn forward_with(
        &self,
        base: &BaseLayer,
        x: &Tensor,
        y: Tensor,
        params: &[Tensor],
    ) -> Result<Tensor>;

    /// Whether the adapted output is `y + f(x)`, with `y` entering only as a summand (LoRA,
    /// LoHa, LoKr, a full delta; not DoRA, which rescales it): the layer may then add its
    /// bias to `y` first, inside its GEMM.
    fn adds_to_output(&self) -> bool {
        false
    }

    /// The adapted output with the adapter's own parameters.
    fn forward(&self, base: &BaseLayer, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let params: Vec<Tensor> = self.params().into_iter().map(|(_, t)| t).collect();
        self.forward_with(base, x, y, &params)
    }

    /// [`Adapter::forward`] of a layer whose `bias` (out, in `x`'s dtype) is still to be
    /// added (its base product left it out: an 8-bit or decoded FP8 product): a kind whose
    /// output is `y` plus a product it accumulates into `y`'s buffer (LoRA's up-projection on
    /// a Linear) adds the bias in that GEMM's epilogue and answers true, sparing the layer a
    /// pass over its output; the others answer false and the layer adds it.
    fn forward_biased(
        &self,
        base: &BaseLayer,
        x: &Tensor,
        y: Tensor,
        bias: &Tensor,
    ) -> Result<(Tensor, bool)> {
        if self.adds_change() {
            let p: Vec<Tensor> = self.params().into_iter().map(|(_, t)| t).collect();
            return self
                .shape()
                .add_change(y, x, self.change_with(&p)?, Some(bias));
        }
        Ok((self.forward(base, x, y)?, false))
    }

    /// Whether the forward is `y + x ⊛ change_with(params)` (LoHa, LoKr, a split layer's
    /// stacked changes: `LayerShape::add_change`): `forward_biased` then adds the layer's
    /// bias in that product's GEMM.
    fn adds_change(&self) -> bool {
        false
    }

    /// The change to the frozen weight that the adapter stands for (f32, the weight's shape):
    /// merged, `W + delta` computes what the adapted layer does.
    fn delta_weight(&self, base: &BaseLayer) -> Result<Tensor>;

    /// The change to the frozen weight this forward makes, from `params` (as in
    /// `forward_with`), in the weight's shape and the parameters' dtype, with this forward's
    /// dropout drawn: `None` where module dropout skips the adapter. What LyCORIS's weight
    /// decomposition rescales ([`AdapterConfig::weight_decompose`]); the kinds that opt into
    /// it ([`Kind::weight_decompose`]: LoKr, LoHa, whose forward adds `x ⊛ ΔW`) give it, the
    /// others refuse.
    fn change_with(&self, _params: &[Tensor]) -> Result<Option<Tensor>> {
        Err(Error::Setting {
            setting: Setting::AdapterWeightDecompose,
            msg: format!(
                "= true: the {} adapter of layer {} does not build its weight change; it \
                 applies to {}",
                self.kind(),
                self.path(),
                weight_decompose_kinds()
            ),
        })
    }

    /// The tensors of the kohya / LyCORIS file (names after `<layer name>.`), `alpha`
    /// included, as ComfyUI reads them.
    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>>;

    /// Reads what `to_kohya` writes.
    fn load_kohya(&self, file: &mut io::Reader) -> Result<()>;

    /// The tensors of the kohya layout written so that ComfyUI computes this adapter's
    /// change from them (`Adapters::save_comfyui`), given the layer's frozen weight: the
    /// kohya tensors, unless ComfyUI reads the kind's tensors differently from the kind's
    /// own definition (DoRA).
    fn to_comfyui(&self, _base: &BaseLayer) -> Result<Vec<(String, Tensor)>> {
        self.to_kohya()
    }

    /// Reads what `to_comfyui` writes.
    fn load_comfyui(&self, file: &mut io::Reader, _base: &BaseLayer) -> Result<()> {
        self.load_kohya(file)
    }

    /// The tensors of the PEFT layout for the diffusers modules `parts` (full names
    /// `<module>.<PEFT name>`), meaning the same under `peft_alpha(rank)`.
    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>>;

    /// Whether `to_peft(parts)` can be written, before training (the values may not be
    /// set yet): by default a trial of it.
    fn check_peft(&self, parts: &[PeftPart]) -> Result<()> {
        self.to_peft(parts).map(|_| ())
    }

    /// Reads a PEFT-layout file whose adapters PEFT scales by `file_scale` (its alpha / r).
    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()>;

    /// Puts the adapter's dropout at the start of micro-batch `micro` of training step
    /// `step`, whose inputs hold `part` of the global batch.
    fn set_batch(&self, _step: u64, _micro: u64, _part: BatchPart) {}
}

/// Everything a kind needs to make a fresh adapter for one layer.
pub struct Plan<'a> {
    /// The layer's key path.
    pub path: &'a str,
    /// The layer's op.
    pub shape: LayerShape,
    /// Whether the layer has a bias (full fine-tuning trains its change too).
    pub bias: bool,
    /// The rank for this layer (`conv_rank` for a convolution).
    pub rank: usize,
    /// The alpha for this layer (`conv_alpha` for a convolution).
    pub alpha: f64,
    /// The set's config (kind-specific settings).
    pub config: &'a AdapterConfig,
    /// Where the parameters live.
    pub device: &'a Device,
    /// The layer's seed (the config's seed mixed with the path).
    pub seed: u64,
    /// Shared with the set: dropout only while training.
    pub train: Arc<AtomicBool>,
}

/// A kind of adapter: its name and how to make one.
pub struct Kind {
    /// The name in `[adapter] kind`.
    pub name: &'static str,
    /// Whether the kind has a PEFT layout (PEFT implements it).
    pub peft: bool,
    /// Whether the kind uses `rank` (full fine-tuning does not).
    pub ranked: bool,
    /// Whether the kind takes input dropout (`AdapterConfig::dropout`).
    pub dropout: bool,
    /// Whether the kind takes module dropout (`AdapterConfig::module_dropout`).
    pub module_dropout: bool,
    /// Whether the kind takes rank dropout (`AdapterConfig::rank_dropout`).
    pub rank_dropout: bool,
    /// Whether the kind trains LyCORIS's Tucker form on convolutions
    /// (`AdapterConfig::tucker`).
    pub tucker: bool,
    /// Whether the kind trains one adapter per diffusers projection of a fused layer
    /// (`AdapterConfig::per_projection`): LoKr and LoHa, whose factorisations do not split
    /// by rows (LoRA's and DoRA's do: their PEFT files split B and the magnitude).
    pub per_projection: bool,
    /// Whether PEFT has the kind's Tucker form (its `use_effective_conv2d`: LoKr's and
    /// LoHa's), so that it is written in the PEFT layout too.
    pub peft_tucker: bool,
    /// Whether its adapters read the frozen weight in the forward (DoRA's norm): the weights
    /// they sit on are then not forward-only (with `AdapterConfig::weight_decompose` the
    /// adapters of any kind do: [`Adapters::reads_weight`]).
    pub reads_weight: bool,
    /// Whether the kind trains with LyCORIS's weight decomposition
    /// ([`AdapterConfig::weight_decompose`]): its adapters give their weight change
    /// ([`Adapter::change_with`]), which one shared wrapper rescales by a learned magnitude
    /// per output channel.
    pub weight_decompose: bool,
    /// The algorithm's name in LyCORIS's kohya network args (`ss_network_args`).
    pub lycoris_algo: &'static str,
    /// Whether kohya's own `networks.lora` writes the kind where no convolution is adapted
    /// (the file's `ss_network_module`; else LyCORIS's `lycoris.kohya`).
    pub plain_kohya: bool,
    /// Whether the trainers' own layouts (`AdapterFormat::tool`: ai-toolkit's, musubi-tuner's)
    /// hold the kind: they write plain LoRAs only.
    pub tool_layouts: bool,
    /// The tensors LoRA+ (Hayou et al. 2024) trains at the higher rate
    /// (`loraplus_lr_ratio`): the factor that starts at zero, LoRA's B. kohya's
    /// `networks.lora` takes every parameter whose name holds `lora_up` (LoRA and DoRA here:
    /// DoRA's magnitude stays at the base rate); for LoHa the zero factor `hada_w2_b`, for
    /// LoKr `lokr_w1` (or `lokr_w1_a` when w1 is low-rank); Tucker cores at the base rate;
    /// none for full fine-tuning.
    pub loraplus_up: &'static [&'static str],
    /// A fresh adapter for one layer.
    pub make: fn(&Plan) -> Result<Arc<dyn Adapter>>,
    /// The change a file's tensors of this kind for one layer stand for, at strength 1 (the
    /// matrix (out, in · kh · kw)), by the kind's own definition of its change, the one its
    /// `Adapter::delta_weight` uses; `None` when the file holds none of this kind there.
    pub merge: fn(&MergeLayer) -> Result<Option<Tensor>>,
    /// The change to the layer's bias a file's tensors of this kind stand for (the
    /// `MergeLayer`'s weight is then the bias), or `None` (`no_bias`: most kinds leave it).
    pub merge_bias: fn(&MergeLayer) -> Result<Option<Tensor>>,
}

/// `Kind::merge_bias` of the kinds that leave the bias alone.
pub(super) fn no_bias(_: &MergeLayer) -> Result<Option<Tensor>> {
    Ok(None)
}

/// Every kind, by name: adding one is a file and a line here. A merge takes the first kind
/// that finds its tensors, so a kind whose tensors extend another's (DoRA's magnitudes
/// beside a LoRA's) comes before it.
pub const KINDS: &[Kind] = &[dora::KIND, lora::KIND, lokr::KIND, loha::KIND, full::KIND];

/// A Tucker core's rebuild (LyCORIS 4.1's `rebuild_tucker`, ComfyUI's einsum
/// "i j k l, j r, i p -> p r k l"): ΔW[p, c, h, w] = Σ_ij t[i, j, h, w] · a[i, p] · b[j, c],
/// from the core `t` (r1, r2, kh, kw) and the factors `a` (r1, P) and `b` (r2, C), as the
/// matrix (P, C · kh · kw), a weight (P, C, kh, kw) flattened.
pub(super) fn tucker(t: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let bad = |msg: String| Error::InvalidArgument {
        op: "tucker",
        msg,
        shape: t.shape().clone(),
    };
    let (&[r1, r2, kh, kw], &[ra, p], &[rb, c]) = (t.dims(), a.dims(), b.dims()) else {
        return Err(bad(format!(
            "core (r1, r2, kh, kw) with factors (r1, P) and (r2, C): got {:?} and {:?}",
            a.dims(),
            b.dims()
        )));
    };
    if ra != r1 || rb != r2 {
        return Err(bad(format!(
            "factors {:?} and {:?} for a core of ranks ({r1}, {r2})",
            a.dims(),
            b.dims()
        )));
    }
    let k = kh * kw;
    // Σ_j t[i, j, k] b[j, c] -> (r1, k, c), then Σ_i a[i, p] · that -> (p, k, c).
    let tb = t
        .reshape((r1, r2, k))?
        .permute(&[0, 2, 1])?
        .contiguous()?
        .reshape((r1 * k, r2))?
        .matmul(b)?
        .reshape((r1, k * c))?;
    a.t()?
        .matmul(&tb)?
        .reshape((p, k, c))?
        .permute(&[0, 2, 1])?
        .contiguous()?
        .reshape((p, c * k))
}

/// The dropout counter of micro-batch `micro` of training step `step`: every dropout of an
/// adapter starts there, so a re-run, a resume and every data-parallel rank draw alike.
pub(super) fn batch_calls(step: u64, micro: u64) -> u64 {
    (step << 24) | ((micro & 0xFFF) << 12)
}

/// Module and rank dropout as LyCORIS applies them to a kind whose change is a weight (LoKr,
/// LoHa): a layer's whole adapter skipped for a micro-batch (`AdapterConfig::module_dropout`,
/// kohya's and LyCORIS's), and each output row of the change zeroed with probability p, the
/// rest left as they are (`rank_dropout`; LyCORIS 4.1.3 `get_weight`, whose scaling of the
/// kept rows, `rank_dropout_scale`, is off by default). While training only; both drawn
/// for the whole global batch, so data-parallel ranks drop alike.
#[derive(Debug)]
pub(super) struct WeightDropout {
    module: crate::nn::dropout::Dropout,
    rows: crate::nn::dropout::Dropout,
    train: Arc<AtomicBool>,
}

impl WeightDropout {
    pub(super) fn new(p: &Plan) -> Result<Self> {
        use crate::nn::dropout::Dropout;
        Ok(WeightDropout {
            module: Dropout::new(p.config.module_dropout, p.seed.rotate_left(29))?,
            rows: Dropout::new(p.config.rank_dropout, p.seed.rotate_left(41))?,
            train: p.train.clone(),
        })
    }

    fn training(&self) -> bool {
        self.train.load(Ordering::Relaxed)
    }

    /// Whether the adapter is skipped in this forward.
    pub(super) fn skips(&self) -> bool {
        self.module.drops(self.training())
    }

    /// The change `dw` (out, ...) with this forward's rows dropped.
    pub(super) fn rows(&self, dw: Tensor) -> Result<Tensor> {
        let out = dw.dims()[0];
        match self
            .rows
            .mask(out.into(), dw.dtype(), dw.device(), self.training())?
        {
            Some(m) => {
                let mut dims = vec![1; dw.dims().len()];
                dims[0] = out;
                // The mask keeps rows at 1 / (1 - p); LyCORIS keeps them at 1.
                dw.mul(&m.sign()?.reshape(dims)?)
            }
            None => Ok(dw),
        }
    }

    pub(super) fn set_batch(&self, step: u64, micro: u64) {
        let calls = batch_calls(step, micro);
        self.module.set_calls(calls);
        self.rows.set_calls(calls);
    }
}

/// The kinds that take input dropout, by name ("lora and dora").
pub fn dropout_kinds() -> String {
    kinds_where(|k| k.dropout)
}

/// The kinds that take module dropout, by name.
pub fn module_dropout_kinds() -> String {
    kinds_where(|k| k.module_dropout)
}

/// The kinds that take rank dropout, by name.
pub fn rank_dropout_kinds() -> String {
    kinds_where(|k| k.rank_dropout)
}

/// The kinds that train one adapter per projection of a fused layer, by name.
pub fn per_projection_kinds() -> String {
    kinds_where(|k| k.per_projection)
}

/// The kinds that train the Tucker form, by name.
pub fn tucker_kinds() -> String {
    kinds_where(|k| k.tucker)
}

/// The kinds that train with LyCORIS's weight decomposition, by name.
pub fn weight_decompose_kinds() -> String {
    kinds_where(|k| k.weight_decompose)
}

/// The kinds the trainers' own layouts hold, by name.
pub fn tool_layout_kinds() -> String {
    kinds_where(|k| k.tool_layouts)
}

fn kinds_where(f: impl Fn(&Kind) -> bool) -> String {
    let v: Vec<&str> = KINDS.iter().filter(|k| f(k)).map(|k| k.name).collect();
    match v.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        Some((last, _)) => last.to_string(),
        None => "no kind".into(),
    }
}

/// The kind named `name`.
pub fn kind(name: &str) -> Result<&'static Kind> {
    KINDS
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| Error::Setting {
            setting: Setting::AdapterKind,
            msg: format!(
                "= {name:?}: not a kind; one of {:?}",
                KINDS.iter().map(|k| k.name).collect::<Vec<_>>()
            ),
        })
}

/// The hyperparameters of a LoRA on the Linear layers (the original adapter config; it is
/// an `AdapterConfig` of kind "lora" with convolutions left alone).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Inner dimension r of A (r, in) and B (out, r); positive.
    pub rank: usize,
    /// Scale alpha / rank (kohya and PEFT convention).
    pub alpha: f64,
    /// Dropout on the adapter's input during training.
    pub dropout: f64,
    /// Module path patterns; `*` matches any run of characters (dots included), e.g.
    /// `double_blocks.*.img_attn.qkv` or `*attn*`. A layer matching any pattern is adapted.
    pub targets: Vec<String>,
    /// Seed of the initial values (mixed with each layer's path) and of the dropout.
    pub seed: u64,
}

/// Which layers get adapters, of which kind, with which hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    /// "lora", "dora", "lokr", "loha" or "full" (`KINDS`).
    pub kind: String,
    /// The rank of the Linear layers' adapters (LoRA/DoRA's r, LoKr's and LoHa's inner
    /// dimension); unused by "full".
    pub rank: usize,
    /// Their scale is alpha / rank (LoKr with both factors full: 1, as LyCORIS).
    pub alpha: f64,
    /// Dropout on the adapter's input while training (LoRA and DoRA).
    pub dropout: f64,
    /// The probability of skipping a layer's adapter for a whole micro-batch while training
    /// (kohya's and LyCORIS's `module_dropout`), in [0, 1); the kinds that take dropout.
    pub module_dropout: f64,
    /// The probability of zeroing each rank component of a sample's down-projection while
    /// training, the rest scaled by 1 / (1 - p) (kohya's `rank_dropout`), in [0, 1); the kinds
    /// that take dropout.
    pub rank_dropout: f64,
    /// Key path patterns (`*` matches any run of characters, dots included).
    pub targets: Vec<String>,
    /// Seed of the initial values (mixed with each layer's path) and of the dropout.
    pub seed: u64,
    /// The rank of adapters on the convolutions the targets match; 0 leaves convolutions
    /// alone (LyCORIS's `conv_dim`). "full" trains matched convolutions whatever this is.
    pub conv_rank: usize,
    /// The convolutions' alpha (LyCORIS's `conv_alpha`).
    pub conv_alpha: f64,
    /// LoKr: the factor of the Kronecker split, -1 for the most balanced (LyCORIS's and
    /// PEFT's `factor` / `decompose_factor`).
    pub factor: i64,
    /// LoKr: w1 low-rank too where the rank allows (PEFT's `decompose_both`).
    pub decompose_both: bool,
    /// LoKr: whose rule splits a side that `factor` divides (PEFT's or LyCORIS's; they
    /// order the pair differently). A file is read with the split it was written with.
    pub lokr_split: LokrSplit,
    /// LoKr and LoHa: a fused layer (one diffusers splits into projections: Flux's `linear1`
    /// and `qkv`, SD3's `qkv`) trains one adapter per projection, each the kind's
    /// factorisation of the projection's rows, as PEFT builds them on diffusers' separate
    /// Linears (split.rs); the layers get their projections from the key map given to
    /// [`Adapters::use_key_map`]. Files name each projection: its diffusers module in the
    /// PEFT layout, LyCORIS's `lycoris_<module>` in the kohya layout (which ComfyUI maps to
    /// the projection's rows). Not with `weight_decompose`.
    pub per_projection: bool,
    /// LoRA, LoHa and LoKr: convolutions of a kernel larger than 1×1 take LyCORIS's Tucker
    /// form (`use_tucker`: LoRA a 1×1 down, a (rank, rank, kh, kw) core, a 1×1 up, kohya's
    /// `lora_mid`; LoHa a core a half, `hada_t1` / `hada_t2`; LoKr a core in its low-rank
    /// w2, `lokr_t2`). LoHa's and LoKr's are PEFT's `use_effective_conv2d` too (the same
    /// tensors, names and shapes) and are written in both layouts; LoRA's in the kohya layout
    /// only (PEFT's LoRA has none).
    pub tucker: bool,
    /// LoKr and LoHa: LyCORIS's weight decomposition (`weight_decompose` in its modules,
    /// `dora_wd` in its kohya network args; DoRA on LoKr / LoHa): the layer's weight becomes
    /// W' = m · (W + ΔW) / (‖W + ΔW‖ + ε), ΔW the kind's change, the norm over each output
    /// channel's row (LyCORIS's `wd_on_out`), not detached, ε the epsilon of m's dtype, and m
    /// a learned magnitude per output channel (`dora_scale`) that starts at ‖W‖. Written in
    /// the kohya layout only (PEFT's LoKr and LoHa have none). For a LoRA with magnitudes use
    /// the kind "dora" (PEFT's DoRA).
    pub weight_decompose: bool,
    /// With [`AdapterConfig::weight_decompose`]: the axis of the magnitudes, LyCORIS's
    /// `wd_on_out` (default true, as LyCORIS's): true one per output channel, the norm over
    /// each output row; false one per input channel (LyCORIS 4.1.3's `wd_on_out=False`), the
    /// norm over each input channel's column (of every output and kernel tap), `dora_scale`
    /// (1, in) for a Linear and (1, cin, 1, 1) for a convolution.
    pub wd_on_out: bool,
}

impl LoraConfig {
    /// Checks rank > 0, dropout in `[0, 1)`, alpha finite and positive, and some target.
    pub fn validate(&self) -> Result<()> {
        AdapterConfig::from(self.clone()).validate()
    }

    /// Whether the layer at key path `path` matches any target pattern.
    pub fn matches(&self, path: &str) -> bool {
        self.targets
            .iter()
            .any(|p| glob(p.as_bytes(), path.as_bytes()))
    }
}

impl From<LoraConfig> for AdapterConfig {
    fn from(c: LoraConfig) -> Self {
        AdapterConfig {
            kind: "lora".into(),
            rank: c.rank,
            alpha: c.alpha,
            dropout: c.dropout,
            module_dropout: 0.0,
            rank_dropout: 0.0,
            targets: c.targets,
            seed: c.seed,
            conv_rank: 0,
            conv_alpha: 1.0,
            factor: -1,
            decompose_both: false,
            lokr_split: LokrSplit::default(),
            tucker: false,
            weight_decompose: false,
            wd_on_out: true,
            per_projection: false,
        }
    }
}

impl AdapterConfig {
    /// For LoKr adapters not built with PEFT's split: PEFT's split of `dim` and this
    /// config's, where they differ (the PEFT layout cannot hold such adapters).
    pub(crate) fn peft_split_differs(
        &self,
        dim: usize,
    ) -> Option<((usize, usize), (usize, usize))> {
        if self.kind != "lokr" || self.lokr_split == LokrSplit::Peft {
            return None;
        }
        let (peft, own) = (
            LokrSplit::Peft.split(dim, self.factor),
            self.lokr_split.split(dim, self.factor),
        );
        (peft != own).then_some((peft, own))
    }

    /// Checks the kind, rank > 0 (where it is used), dropout in `[0, 1)` (and only for LoRA
    /// and DoRA), alphas finite and positive, the LoKr factor, some target, and the Tucker
    /// form and the weight decomposition only for the kinds that have them.
    pub fn validate(&self) -> Result<()> {
        let bad = |setting: Setting, msg: String| Err(Error::Setting { setting, msg });
        let kind = kind(&self.kind)?;
        if kind.ranked && self.rank == 0 {
            return bad(Setting::AdapterRank, "= 0: must be positive".into());
        }
        for (setting, p, takes, kinds) in [
            (
                Setting::AdapterDropout,
                self.dropout,
                kind.dropout,
                dropout_kinds(),
            ),
            (
                Setting::AdapterModuleDropout,
                self.module_dropout,
                kind.module_dropout,
                module_dropout_kinds(),
            ),
            (
                Setting::AdapterRankDropout,
                self.rank_dropout,
                kind.rank_dropout,
                rank_dropout_kinds(),
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                return bad(setting, format!("= {p}: not in [0, 1)"));
            }
            if p > 0.0 && !takes {
                return bad(
                    setting,
                    format!("= {p}: it applies to {kinds}, not {}", kind.name),
                );
            }
        }
        for (setting, a) in [
            (Setting::AdapterAlpha, self.alpha),
            (Setting::AdapterConvAlpha, self.conv_alpha),
        ] {
            if !a.is_finite() || a <= 0.0 {
                return bad(setting, format!("= {a}: must be positive"));
            }
        }
        if self.factor == 0 || self.factor < -1 {
            return bad(
                Setting::AdapterFactor,
                format!("= {}: -1 (balanced) or a positive divisor", self.factor),
            );
        }
        if self.targets.is_empty() {
            return bad(Setting::AdapterTargets, "= []: no target patterns".into());
        }
        if self.tucker && !kind.tucker {
            return bad(
                Setting::AdapterTucker,
                format!(
                    "= true: it applies to {}, not {}",
                    tucker_kinds(),
                    kind.name
                ),
            );
        }
        if self.per_projection && !kind.per_projection {
            return bad(
                Setting::AdapterPerProjection,
                format!(
                    "= true: it applies to {}, not {} (whose diffusers / PEFT files split a \
                     fused layer by rows already)",
                    per_projection_kinds(),
                    kind.name
                ),
            );
        }
        if self.per_projection && self.weight_decompose {
            return bad(
                Setting::AdapterPerProjection,
                "= true with weight_decompose = true: the magnitudes and norms of LyCORIS's \
                 weight decomposition are the fused layer's, which projections of their own \
                 do not have (PEFT's LoKr and LoHa have no weight decomposition either); \
                 leave one of them out"
                    .to_string(),
            );
        }
        if !self.wd_on_out && !self.weight_decompose {
            return bad(
                Setting::AdapterWeightDecompose,
                "= false with wd_on_out = false: the magnitudes' axis (wd_on_out) applies \
                 only to the weight decomposition"
                    .to_string(),
            );
        }
        if self.weight_decompose && !kind.weight_decompose {
            return bad(
                Setting::AdapterWeightDecompose,
                format!(
                    "= true: it applies to {}, not {}; a LoRA with a learned magnitude per \
                     output channel is the kind \"dora\"",
                    weight_decompose_kinds(),
                    kind.name
                ),
            );
        }
        Ok(())
    }

    /// Whether the layer at key path `path` matches any target pattern.
    pub fn matches(&self, path: &str) -> bool {
        self.targets
            .iter()
            .any(|p| glob(p.as_bytes(), path.as_bytes()))
    }
}

/// Settings of the adapters on the layers a pattern matches (kohya's `block_dims`,
/// `block_alphas` and `block_lr_weight`, ai-toolkit's per-layer network settings), in the
/// pattern language of [`AdapterConfig::targets`], matched against a layer's key path; of
/// several blocks the first that matches wins.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterBlock {
    /// The layers' key path pattern (`*` matches any run of characters).
    pub pattern: String,
    /// The peak learning rate of the matched layers' adapters (instead of the optimizer's;
    /// a schedule scales it alike). Read by the trainer, not by the adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// The rank of the matched Linear layers' adapters (0: no adapter on any matched layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The alpha of the matched Linear layers' adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
}

/// `*` matches any run of bytes; everything else matches itself.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// The adapters of one model, planned by a config and filled as its layers are built.
#[derive(Debug)]
pub struct Adapters {
    /// The (validated) config every adapter is made from.
    pub config: AdapterConfig,
    /// Per-block ranks and alphas ([`Adapters::with_blocks`]).
    blocks: Vec<AdapterBlock>,
    /// Targeted layers a block of rank 0 left without an adapter.
    left_out: Mutex<std::collections::BTreeSet<String>>,
    layers: Mutex<BTreeMap<String, Arc<dyn Adapter>>>,
    train: Arc<AtomicBool>,
    /// The model's diffusers key map, which gives fused layers their projections
    /// (`AdapterConfig::per_projection`).
    projections: Mutex<Option<Projections>>,
}

/// A model's diffusers key map, held by the set.
#[derive(Clone)]
struct Projections(crate::nn::keys::KeyMap);

impl std::fmt::Debug for Projections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Projections(<key map>)")
    }
}

impl Adapters {
    /// An empty set for `config` (validated first; a `LoraConfig` is a LoRA config), in
    /// training mode.
    pub fn new(config: impl Into<AdapterConfig>) -> Result<Arc<Self>> {
        Self::with_blocks(config, vec![])
    }

    /// An empty set for `config` whose layers matching a block's pattern take that block's
    /// rank and alpha (the first block that matches; [`AdapterBlock`]). A block's rank 0
    /// leaves the layers it matches without an adapter; its rank and alpha are those of the
    /// Linear layers (convolutions keep `conv_rank` and `conv_alpha`).
    pub fn with_blocks(
        config: impl Into<AdapterConfig>,
        blocks: Vec<AdapterBlock>,
    ) -> Result<Arc<Self>> {
        let config = config.into();
        config.validate()?;
        let kind = kind(&config.kind)?;
        for (i, b) in blocks.iter().enumerate() {
            let bad = |msg: String| Error::Setting {
                setting: Setting::AdapterBlocks,
                msg: format!("entry {} (pattern {:?}): {msg}", i + 1, b.pattern),
            };
            if b.pattern.trim().is_empty() {
                return Err(bad("an empty pattern".into()));
            }
            if let Some(a) = b.alpha.filter(|a| !(a.is_finite() && *a > 0.0)) {
                return Err(bad(format!("alpha = {a}: must be positive")));
            }
            if let Some(lr) = b.lr.filter(|l| !(l.is_finite() && *l >= 0.0)) {
                return Err(bad(format!("lr = {lr}: must be finite and >= 0")));
            }
            if !kind.ranked && b.rank.is_some_and(|r| r > 0) {
                return Err(bad(format!(
                    "rank = {}: the {:?} kind has no rank (0 leaves the layers out)",
                    b.rank.unwrap_or(0),
                    kind.name
                )));
            }
        }
        Ok(Arc::new(Adapters {
            config,
            blocks,
            left_out: Mutex::new(Default::default()),
            layers: Mutex::new(BTreeMap::new()),
            train: Arc::new(AtomicBool::new(true)),
            projections: Mutex::new(None),
        }))
    }

    /// Gives the set the model's diffusers key map (model key -> diffusers keys), before the
    /// model's layers are built: with `AdapterConfig::per_projection` a fused layer's adapter
    /// is one per projection the map gives it. The model loader sets it.
    pub fn use_key_map(&self, map: crate::nn::keys::KeyMap) -> Result<()> {
        *self
            .projections
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))? = Some(Projections(map));
        Ok(())
    }

    /// The projections of the layer at `path` with `out` rows where it is fused (or its
    /// halves swapped) and adapted per projection; `None` otherwise.
    fn projections_of(&self, path: &str, shape: LayerShape) -> Result<Option<Vec<PeftPart>>> {
        if !self.config.per_projection || shape.is_conv() {
            return Ok(None);
        }
        let map = self
            .projections
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?
            .clone();
        let Some(Projections(map)) = map else {
            return Err(Error::Setting {
                setting: Setting::AdapterPerProjection,
                msg: format!(
                    "= true: layer {path} was built before the set had the model's key map \
                     (Adapters::use_key_map)"
                ),
            });
        };
        if map(&format!("{path}.weight")).is_none() {
            return Ok(None);
        }
        let parts = io::peft_parts(&map, path, shape.out_dim())?;
        Ok(match parts.as_slice() {
            [p] if !p.swapped => None,
            _ => Some(parts),
        })
    }

    /// The per-block settings, in order.
    pub fn blocks(&self) -> &[AdapterBlock] {
        &self.blocks
    }

    /// The targeted layers a block of rank 0 left without an adapter, sorted.
    pub fn left_out(&self) -> Result<Vec<String>> {
        let l = self
            .left_out
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?;
        Ok(l.iter().cloned().collect())
    }

    /// The index of the first block whose pattern matches the layer at `path`.
    pub fn block_of(&self, path: &str) -> Option<usize> {
        self.blocks
            .iter()
            .position(|b| glob(b.pattern.as_bytes(), path.as_bytes()))
    }

    /// The config's kind.
    pub fn kind(&self) -> Result<&'static Kind> {
        kind(&self.config.kind)
    }

    /// Whether the adapters read the frozen weights in their forward (DoRA's norms, LyCORIS's
    /// weight decomposition): the weights they sit on are then not forward-only.
    pub fn reads_weight(&self) -> Result<bool> {
        Ok(self.kind()?.reads_weight || self.config.weight_decompose)
    }

    /// The adapter of the layer at `path`, made on first request when the path matches a
    /// target (convolutions only with `conv_rank` > 0, or for "full"); `None` for layers not
    /// targeted.
    pub fn for_layer(
        &self,
        path: &str,
        shape: LayerShape,
        bias: bool,
        device: &Device,
    ) -> Result<Option<Arc<dyn Adapter>>> {
        if !self.config.matches(path) {
            return Ok(None);
        }
        let kind = self.kind()?;
        let block = self.block_of(path).and_then(|i| self.blocks.get(i));
        if block.is_some_and(|b| b.rank == Some(0)) {
            self.left_out
                .lock()
                .map_err(|_| Error::Poisoned("adapters"))?
                .insert(path.to_string());
            return Ok(None);
        }
        let (rank, alpha) = match shape {
            LayerShape::Linear { .. } => (
                block.and_then(|b| b.rank).unwrap_or(self.config.rank),
                block.and_then(|b| b.alpha).unwrap_or(self.config.alpha),
            ),
            LayerShape::Conv2d { .. } if kind.ranked && self.config.conv_rank == 0 => {
                return Ok(None)
            }
            LayerShape::Conv2d { .. } => (self.config.conv_rank, self.config.conv_alpha),
        };
        let mut layers = self
            .layers
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?;
        if let Some(l) = layers.get(path) {
            if l.shape() != shape {
                return Err(Error::Config {
                    path: None,
                    msg: format!(
                        "layer {path} was adapted as {:?} and is asked for as {shape:?}",
                        l.shape()
                    ),
                });
            }
            return Ok(Some(l.clone()));
        }
        let plan = Plan {
            path,
            shape,
            bias,
            rank,
            alpha,
            config: &self.config,
            device,
            seed: self.config.seed ^ key_hash(path),
            train: self.train.clone(),
        };
        let mut l = match self.projections_of(path, shape)? {
            Some(parts) => Arc::new(split::PerProjection::new(&plan, parts, kind.make)?),
            None => (kind.make)(&plan)?,
        };
        if self.config.weight_decompose {
            l = dora::decomposed(&plan, l)?;
        }
        layers.insert(path.to_string(), l.clone());
        Ok(Some(l))
    }

    /// Every adapter by layer path, sorted.
    pub fn layers(&self) -> Result<Vec<Arc<dyn Adapter>>> {
        let layers = self
            .layers
            .lock()
            .map_err(|_| Error::Poisoned("adapters"))?;
        Ok(layers.values().cloned().collect())
    }

    /// The trainable tensors named `<path>.<kohya name>` (`<path>.lora_down.weight`, ...):
    /// what an optimizer takes.
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .layers()?
            .iter()
            .flat_map(|l| l.named_params())
            .collect())
    }

    /// The compute copies (in `dtype`) of every adapter's weights its forward casts
    /// ([`Adapter::cast_params`]), made by one grouped launch: a training step makes them
    /// after the previous optimizer step and enters them around each micro-batch's forward
    /// and backward, then folds their gradients (see `ComputeCopies`).
    pub fn compute_copies(&self, dtype: DType) -> Result<Arc<ComputeCopies>> {
        ComputeCopies::new(self.cast_params()?, dtype)
    }

    /// Every adapter's [`Adapter::cast_params`], in layer order.
    pub fn cast_params(&self) -> Result<Vec<(Tensor, f64)>> {
        Ok(self
            .layers()?
            .iter()
            .flat_map(|l| l.cast_params())
            .collect())
    }

    /// Puts every adapter's dropout at the start of training step `step` (its masks are then
    /// a function of the seed, the step and the call order within the step, so a resumed run
    /// repeats them).
    pub fn set_step(&self, step: u64) -> Result<()> {
        self.set_batch(step, 0, BatchPart::default())
    }

    /// As [`Adapters::set_step`], at micro-batch `micro` of the step, whose inputs are
    /// `part` of the global batch (data-parallel training).
    pub fn set_batch(&self, step: u64, micro: u64, part: BatchPart) -> Result<()> {
        for l in self.layers()? {
            l.set_batch(step, micro, part);
        }
        Ok(())
    }

    /// Dropout on (training) or off (inference).
    pub fn set_train(&self, on: bool) {
        self.train.store(on, Ordering::Relaxed)
    }

    /// Whether dropout is on (training mode).
    pub fn training(&self) -> bool {
        self.train.load(Ordering::Relaxed)
    }
}

/// The refusal of the PEFT layout for an adapter of kind `kind` at layer `path` in LyCORIS's
/// Tucker form (`tucker`: `AdapterConfig::tucker`), for the kinds PEFT has no Tucker form of
/// (`Kind::peft_tucker`: LoRA), which FLAME writes and reads in the kohya layout only.
pub(crate) fn kohya_only_tucker(tucker: bool, kind: &str, path: &str) -> Result<()> {
    if tucker {
        return Err(Error::Setting {
            setting: crate::Setting::AdapterLayout,
            msg: format!(
                " {kind}'s Tucker form (layer {path}, AdapterConfig::tucker) is written in the \
                 kohya layout only"
            ),
        });
    }
    Ok(())
}

/// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) of `dims` in f32, trainable: PyTorch's
/// `kaiming_uniform_(a=sqrt(5))`, how PEFT initialises its nonzero factors.
pub(crate) fn kaiming(dims: &[usize], fan_in: usize, device: &Device, seed: u64) -> Result<Tensor> {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    Tensor::rand_uniform(-bound, bound, dims.to_vec(), DType::F32, device, seed)?.requires_grad_()
}

/// Zeros of `dims` in f32, trainable.
pub(crate) fn zeros(dims: &[usize], device: &Device) -> Result<Tensor> {
    Tensor::zeros(dims.to_vec(), DType::F32, device)?.requires_grad_()
}

/// `t` in the dtype of `like`: the step's compute copy where one is entered
/// (`ComputeCopies`), else cast here.
pub(crate) fn cast(t: &Tensor, like: &Tensor) -> Result<Tensor> {
    cast_scaled(t, 1.0, like)
}

/// `scale · t` in the dtype of `like`: the step's compute copy of `t` with factor `scale`
/// where one is entered (`ComputeCopies`), else `t` scaled (in its dtype) and cast here.
pub(crate) fn cast_scaled(t: &Tensor, scale: f64, like: &Tensor) -> Result<Tensor> {
    if let Some(c) = copies::copy_of(t, scale, like.dtype()) {
        return Ok(c);
    }
    match scale == 1.0 {
        true => t.to_dtype(like.dtype()),
        false => t.affine(scale, 0.0)?.to_dtype(like.dtype()),
    }
}

/// The alpha written beside a kind's tensors: 0-dim f32.
pub(crate) fn alpha_tensor(alpha: f64, device: &Device) -> Result<Tensor> {
    Tensor::from_vec(vec![alpha as f32], (), device)
}
