//! LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"):
//! y = base(x) + s · B(A(dropout(x))), s = alpha / rank, with A = `down` and B = `up`. On a
//! Linear A is (rank, in) and B (out, rank); on a Conv2d (LyCORIS's LoCon, PEFT's conv LoRA)
//! A is a convolution (rank, cin, kh, kw) with the layer's stride, padding and dilation and B
//! a 1×1 convolution (out, rank, 1, 1). A starts Kaiming-uniform, B at zero, so a fresh
//! adapter leaves the model unchanged.
//!
//! With `AdapterConfig::tucker` a convolution of a kernel larger than 1×1 takes LyCORIS's
//! Tucker form (`use_tucker`): A a 1×1 convolution (rank, cin, 1, 1), then a core M
//! (rank, rank, kh, kw) with the layer's stride, padding and dilation, then B; ΔW is the core
//! rebuilt with A and B (`tucker`). A and M start Kaiming-uniform, B at zero, as LyCORIS.
//!
//! Files: kohya `lora_down.weight` / `lora_up.weight` / `alpha` (and `lora_mid.weight`, the
//! core); PEFT `lora_A.weight` / `lora_B.weight` (same shapes), with s folded into B. PEFT has
//! no Tucker form.

use super::io::{join_rows, part_rows, PeftFile, Reader};
use super::merge::MergeLayer;
use super::{
    cast, cast_scaled, kaiming, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart, Plan,
};
use crate::nn::dropout::{BatchPart, Dropout};
use crate::{Error, Result, Setting, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "lora",
    merge_bias: super::no_bias,
    peft: true,
    ranked: true,
    dropout: true,
    module_dropout: true,
    rank_dropout: true,
    tucker: true,
    peft_tucker: false,
    per_projection: false,
    reads_weight: false,
    weight_decompose: false,
    lycoris_algo: "locon",
    plain_kohya: true,
    tool_layouts: true,
    loraplus_up: &["lora_up.weight"],
    make: |p| Ok(Arc::new(Lora::new(p)?)),
    merge,
};

/// A LoRA's change s · B A as the matrix (out, cols), from A (r, cols) and B (out, r).
pub(super) fn product(down: &Tensor, up: &Tensor, scale: f64) -> Result<Tensor> {
    up.matmul(down)?.affine(scale, 0.0)
}

/// The change a file's LoRA of one layer stands for, as the matrix (out, cols): kohya's
/// `lora_down` / `lora_up` or PEFT's `lora_A` / `lora_B` (a convolution's down holding its
/// kernel, its up 1×1; or LyCORIS's Tucker form, `lora_mid` (r, r, kh, kw) between a 1×1
/// down and up), scaled by alpha / r where the file stores alpha.
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    let names = [
        ("lora_down.weight", "lora_up.weight"),
        ("lora_A.weight", "lora_B.weight"),
    ];
    let Some((a, b)) = names.into_iter().find(|(a, b)| l.has(a) && l.has(b)) else {
        return Ok(None);
    };
    let (out, cols) = (l.out(), l.cols());
    let (down, up) = (l.need(a, "LoRA")?, l.need(b, "LoRA")?);
    let r = down.dims().first().copied().unwrap_or(0);
    if let Some(mid) = l.take("lora_mid.weight")? {
        // LyCORIS's Tucker LoCon: down (r, in, 1, 1), mid (r, r, kh, kw), up (out, r, 1, 1).
        let k: usize = l.dims().iter().skip(2).product();
        let in_dim = cols / k.max(1);
        if mid.dims().len() != 4 || mid.dims()[2..].iter().product::<usize>() != k {
            return Err(l.bad(
                "lora_mid.weight",
                &mid,
                &format!("(r, r, {:?})", &l.dims()[2..]),
            ));
        }
        let (rm, rd) = (mid.dims()[0], mid.dims()[1]);
        if down.elem_count() != rd * in_dim || down.dims().first() != Some(&rd) {
            return Err(l.bad(a, &down, &format!("({rd}, {in_dim}, 1, 1)")));
        }
        if up.elem_count() != out * rm || up.dims().first() != Some(&out) {
            return Err(l.bad(b, &up, &format!("({out}, {rm}, 1, 1)")));
        }
        let s = l.scale(rd)?;
        let up_t = up.reshape((out, rm))?.t()?.contiguous()?;
        return super::tucker(&mid, &up_t, &down.reshape((rd, in_dim))?)?
            .affine(s, 0.0)
            .map(Some);
    }
    let (sa, sb) = (down.dims(), up.dims());
    if sa.len() < 2 || sa[1..].iter().product::<usize>() != cols || r == 0 {
        return Err(l.bad(a, &down, &format!("(rank, {cols})")));
    }
    if sb.len() < 2 || sb[..2] != [out, r] || sb[2..].iter().any(|&d| d != 1) {
        return Err(l.bad(b, &up, &format!("({out}, {r})")));
    }
    let s = l.scale(r)?;
    // `product`'s values, the product scaled in place: one matrix of the layer's size.
    let change = up.reshape((out, r))?.matmul(&down.reshape((r, cols))?)?;
    super::merge::rows_in_place(&change, |_, rows| rows.affine(s, 0.0))?;
    Ok(Some(change))
}

/// One layer's LoRA.
#[derive(Debug)]
pub struct Lora {
    /// The adapted layer's key path.
    pub path: String,
    /// The adapted layer's op.
    pub shape: LayerShape,
    /// A: (rank, in) or (rank, cin, kh, kw), f32, trainable.
    pub down: Tensor,
    /// B: (out, rank) or (out, rank, 1, 1), f32, trainable.
    pub up: Tensor,
    /// The Tucker core (rank, rank, kh, kw) between a 1×1 A and B, f32, trainable
    /// (`AdapterConfig::tucker`); `None`: A holds the kernel.
    pub mid: Option<Tensor>,
    /// The term is scaled by alpha / rank.
    pub alpha: f64,
    dropout: Dropout,
    /// Skips the whole term for a micro-batch (`AdapterConfig::module_dropout`).
    module: Dropout,
    /// Drops rank components per sample (`AdapterConfig::rank_dropout`).
    rank_drop: Dropout,
    train: Arc<AtomicBool>,
}

impl Lora {
    /// A fresh adapter: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's
    /// `kaiming_uniform_(a=sqrt(5))`, as PEFT initialises lora_A), B = 0.
    pub(super) fn new(p: &Plan) -> Result<Self> {
        let (rank, shape) = (p.rank, p.shape);
        if rank > shape.in_dim().min(shape.out_dim()) && !shape.is_conv() {
            return Err(Error::Setting {
                setting: Setting::AdapterRank,
                msg: format!(
                    "= {rank}: layer {} maps {} -> {}; a LoRA rank must be at most the \
                     smaller width, {}",
                    p.path,
                    shape.in_dim(),
                    shape.out_dim(),
                    shape.in_dim().min(shape.out_dim())
                ),
            });
        }
        let (down_dims, up_dims) = dims(shape, rank);
        let (down, mid) = match tucker_kernel(shape, p.config.tucker) {
            // LyCORIS's init: down and the core Kaiming-uniform over their own fan-in.
            Some((cin, kh, kw)) => (
                kaiming(&[rank, cin, 1, 1], cin, p.device, p.seed)?,
                Some(kaiming(
                    &[rank, rank, kh, kw],
                    rank * kh * kw,
                    p.device,
                    p.seed.rotate_left(7),
                )?),
            ),
            None => (kaiming(&down_dims, shape.cols(), p.device, p.seed)?, None),
        };
        Ok(Lora {
            path: p.path.to_string(),
            shape,
            down,
            mid,
            up: zeros(&up_dims, p.device)?,
            alpha: p.alpha,
            dropout: Dropout::new(p.config.dropout, p.seed.rotate_left(17))?,
            module: Dropout::new(p.config.module_dropout, p.seed.rotate_left(29))?,
            rank_drop: Dropout::new(p.config.rank_dropout, p.seed.rotate_left(41))?,
            train: p.train.clone(),
        })
    }

    /// The adapter's rank r.
    pub fn rank(&self) -> usize {
        self.down.dims()[0]
    }

    /// alpha / rank.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank() as f64
    }

    /// `h` (the down-projection's output: (samples, ..., r), or a convolution's (N, r, H, W))
    /// with rank dropout applied while training: each sample's rank components zeroed with
    /// probability p and the rest scaled by 1 / (1 - p) (kohya's `rank_dropout`), the mask
    /// drawn for the global batch (`Dropout::mask`, broadcast over the other axes).
    fn rank_mask(&self, h: Tensor) -> Result<Tensor> {
        let d = h.dims();
        let mut dims = vec![1; d.len()];
        dims[0] = d[0];
        match self.shape {
            LayerShape::Linear { .. } => dims[d.len() - 1] = self.rank(),
            LayerShape::Conv2d { .. } => dims[1] = self.rank(),
        }
        let train = self.train.load(Ordering::Relaxed);
        match self
            .rank_drop
            .mask(dims.into(), h.dtype(), h.device(), train)?
        {
            Some(m) => h.mul(&m),
            None => Ok(h),
        }
    }

    /// Whether module dropout skips the adapter in this forward (training only).
    pub(super) fn dropped(&self) -> bool {
        self.module.drops(self.train.load(Ordering::Relaxed))
    }

    /// `y` plus the adapter's term s · B(M(A(dropout(x)))) with `down`, `mid`, `up` in place
    /// of its own (M only in the Tucker form), in x's dtype; on a Linear the up-projection's GEMM adds into `y`'s buffer.
    pub(super) fn add_term(
        &self,
        y: Tensor,
        x: &Tensor,
        parts: (&Tensor, Option<&Tensor>, &Tensor),
    ) -> Result<Tensor> {
        self.add_term_bias(y, x, parts, None)
    }

    /// [`Lora::add_term`] plus the layer's `bias` (a Linear's) in the up-projection's GEMM.
    fn add_term_bias(
        &self,
        y: Tensor,
        x: &Tensor,
        (down, mid, up): (&Tensor, Option<&Tensor>, &Tensor),
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("lora");
        let x = self
            .dropout
            .forward(x, self.train.load(Ordering::Relaxed))?;
        let h = match mid {
            Some(m) => {
                let h = self.shape.apply_pointwise(&x, &cast(down, &x)?)?;
                self.shape.apply(&h, &cast(m, &x)?)?
            }
            None => self.shape.apply(&x, &cast(down, &x)?)?,
        };
        let h = self.rank_mask(h)?;
        // s folded into B (out x r) rather than applied to the product (rows x out): one
        // pass over the layer's output fewer, forward and backward.
        let up = cast_scaled(up, self.scale(), &x)?;
        self.shape.add_apply_pointwise_bias(y, &h, &up, bias)
    }

    /// s · B A (the Tucker form: the core rebuilt with A and B) in f32 with the weight's
    /// shape.
    pub(super) fn delta_of(
        &self,
        down: &Tensor,
        mid: Option<&Tensor>,
        up: &Tensor,
    ) -> Result<Tensor> {
        let r = self.rank();
        if let Some(m) = mid {
            let (out, cin) = (self.shape.out_dim(), self.shape.in_dim());
            let up_t = up.reshape((out, r))?.t()?.contiguous()?;
            return super::tucker(m, &up_t, &down.reshape((r, cin))?)?
                .affine(self.scale(), 0.0)?
                .reshape(self.shape.weight_dims());
        }
        let a = down.reshape((r, self.shape.cols()))?;
        let b = up.reshape((self.shape.out_dim(), r))?;
        product(&a, &b, self.scale())?.reshape(self.shape.weight_dims())
    }

    /// What `add_term` casts: A, the core, and B with s folded in.
    pub(super) fn casts(&self) -> Vec<(Tensor, f64)> {
        let mut v = vec![(self.down.clone(), 1.0)];
        v.extend(self.mid.iter().map(|m| (m.clone(), 1.0)));
        v.push((self.up.clone(), self.scale()));
        v
    }

    /// Reads A and B in the kohya layout and checks alpha against the config.
    pub(super) fn read_kohya(&self, file: &mut Reader) -> Result<()> {
        let down = file.take("lora_down.weight", self.down.dims())?;
        let up = file.take("lora_up.weight", self.up.dims())?;
        let mid = match &self.mid {
            Some(m) => Some(file.take("lora_mid.weight", m.dims())?),
            None => None,
        };
        if let Some(a) = file.alpha()? {
            if (a - self.alpha).abs() > 1e-6 * self.alpha.abs().max(1.0) {
                return Err(file.error(
                    "alpha",
                    format!("alpha {a}, the adapters are configured with {}", self.alpha),
                ));
            }
        }
        if let (Some(m), Some(read)) = (&self.mid, mid) {
            m.assign(&read)?;
        }
        self.down.assign(&down)?;
        self.up.assign(&up)
    }

    /// A (shared by every part) and s·B split by the parts' rows, under PEFT names.
    pub(super) fn write_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        self.no_peft_tucker()?;
        let up = self.up.affine(self.scale(), 0.0)?;
        let mut v = vec![];
        for p in parts {
            v.push((format!("{}.lora_A.weight", p.module), self.down.clone()));
            v.push((format!("{}.lora_B.weight", p.module), part_rows(&up, p)?));
        }
        Ok(v)
    }

    /// Reads A (one for every part: a fused layer cannot hold separate ones) and B of a PEFT
    /// file PEFT scales by `file_scale`.
    pub(super) fn read_peft(
        &self,
        parts: &[PeftPart],
        file: &mut PeftFile,
        file_scale: f64,
    ) -> Result<()> {
        self.no_peft_tucker()?;
        let (dev, rank) = (self.down.device().clone(), self.rank());
        let mut down: Option<Tensor> = None;
        let mut ups = vec![];
        let up_tail = &self.up.dims()[1..];
        for p in parts {
            let a = file.take(&p.module, "lora_A.weight", self.down.dims(), &dev)?;
            let b_dims = [&[p.rows][..], up_tail].concat();
            let b = file.take(&p.module, "lora_B.weight", &b_dims, &dev)?;
            match &down {
                Some(d) if d.to_vec_f64()? != a.to_vec_f64()? => {
                    return Err(file.error(
                        &p.module,
                        "lora_A.weight",
                        format!(
                            "differs from the lora_A of the other parts of fused layer {}",
                            self.path
                        ),
                    ))
                }
                Some(_) => {}
                None => down = Some(a),
            }
            ups.push(b);
        }
        debug_assert_eq!(rank, self.up.dims()[1]);
        let up = join_rows(parts, ups)?;
        let ratio = file_scale / self.scale();
        let up = if ratio == 1.0 {
            up
        } else {
            up.affine(ratio, 0.0)?
        };
        if let Some(d) = down {
            self.down.assign(&d)?;
        }
        self.up.assign(&up)
    }
}

impl Lora {
    /// PEFT's LoRA has no Tucker form (`kohya_only_tucker`).
    fn no_peft_tucker(&self) -> Result<()> {
        super::kohya_only_tucker(self.mid.is_some(), "LoRA", &self.path)
    }
}

/// (cin, kh, kw) of a convolution that takes the Tucker form under `tucker`: a kernel larger
/// than 1×1 (as LyCORIS's `use_tucker`).
fn tucker_kernel(shape: LayerShape, tucker: bool) -> Option<(usize, usize, usize)> {
    match shape {
        LayerShape::Conv2d { cin, kernel, .. } if tucker && kernel != (1, 1) => {
            Some((cin, kernel.0, kernel.1))
        }
        _ => None,
    }
}

/// (A, B) shapes for `shape` at `rank`.
fn dims(shape: LayerShape, rank: usize) -> (Vec<usize>, Vec<usize>) {
    match shape {
        LayerShape::Linear { in_dim, out_dim } => (vec![rank, in_dim], vec![out_dim, rank]),
        LayerShape::Conv2d {
            cin, cout, kernel, ..
        } => (vec![rank, cin, kernel.0, kernel.1], vec![cout, rank, 1, 1]),
    }
}

impl Adapter for Lora {
    fn kind(&self) -> &'static str {
        "lora"
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn shape(&self) -> LayerShape {
        self.shape
    }

    fn params(&self) -> Vec<(&'static str, Tensor)> {
        let mut v = vec![("lora_down.weight", self.down.clone())];
        v.extend(self.mid.iter().map(|m| ("lora_mid.weight", m.clone())));
        v.push(("lora_up.weight", self.up.clone()));
        v
    }

    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        self.casts()
    }

    fn forward_with(&self, _: &BaseLayer, x: &Tensor, y: Tensor, p: &[Tensor]) -> Result<Tensor> {
        let (down, mid, up) = match (p, &self.mid) {
            ([down, up], None) => (down, None, up),
            ([down, mid, up], Some(_)) => (down, Some(mid), up),
            _ => {
                return Err(Error::Autograd(format!(
                    "lora: {} parameters, expected {}",
                    p.len(),
                    2 + usize::from(self.mid.is_some())
                )))
            }
        };
        if self.dropped() {
            return Ok(y);
        }
        self.add_term(y, x, (down, mid, up))
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn forward_biased(
        &self,
        base: &BaseLayer,
        x: &Tensor,
        y: Tensor,
        bias: &Tensor,
    ) -> Result<(Tensor, bool)> {
        // A convolution's output takes its bias by channel, not by a GEMM's epilogue.
        if !matches!(self.shape, LayerShape::Linear { .. }) {
            return Ok((self.forward(base, x, y)?, false));
        }
        // A dropped module adds nothing (drawn once, as `forward_with` draws it).
        if self.dropped() {
            return Ok((y, false));
        }
        let parts = (&self.down, self.mid.as_ref(), &self.up);
        Ok((self.add_term_bias(y, x, parts, Some(bias))?, true))
    }

    fn delta_weight(&self, _: &BaseLayer) -> Result<Tensor> {
        self.delta_of(&self.down, self.mid.as_ref(), &self.up)
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        let mut v: Vec<(String, Tensor)> = vec![("lora_down.weight".into(), self.down.clone())];
        v.extend(
            self.mid
                .iter()
                .map(|m| ("lora_mid.weight".into(), m.clone())),
        );
        v.push(("lora_up.weight".into(), self.up.clone()));
        v.push((
            "alpha".into(),
            super::alpha_tensor(self.alpha, self.down.device())?,
        ));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        self.read_kohya(file)
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        self.write_peft(parts)
    }

    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()> {
        self.read_peft(parts, file, file_scale)
    }

    fn set_batch(&self, step: u64, micro: u64, part: BatchPart) {
        let calls = super::batch_calls(step, micro);
        self.dropout.set_calls(calls);
        self.module.set_calls(calls);
        self.rank_drop.set_calls(calls);
        self.dropout.set_part(part);
        self.rank_drop.set_part(part);
    }
}
