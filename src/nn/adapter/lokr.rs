//! LoKr (LyCORIS; Yeh et al. 2024, "Navigating Text-To-Image Customization: From LyCORIS
//! Fine-Tuning to Model Evaluation"): the weight change is a Kronecker product,
//! ΔW = s · w1 ⊗ w2, with out = out_l · out_k and in = in_m · in_n split by `factorization`;
//! w1 (out_l, in_m) and w2 (out_k, in_n[, kh, kw]) (a convolution's kernel lives in w2). Where
//! the rank is small against a factor's sides (r < max(sides) / 2, PEFT's and LyCORIS's rule)
//! w2 is low-rank, w2_a (out_k, r) · w2_b (r, in_n·kh·kw), and with `decompose_both` w1 too,
//! w1_a (out_l, r) · w1_b (r, in_m). s = alpha / r (PEFT's rule, also when both factors are
//! full). w1 (or w1_a) starts at zero, the rest Kaiming-uniform (PEFT's initialisation), so a
//! fresh adapter leaves the model unchanged. The forward adds x ⊛ ΔW to the frozen output.
//!
//! Files: kohya / LyCORIS and PEFT name the tensors alike (`lokr_w1`, `lokr_w1_a`,
//! `lokr_w1_b`, `lokr_w2`, `lokr_w2_a`, `lokr_w2_b`, and the Tucker form's `lokr_t2`, which is
//! PEFT's `use_effective_conv2d`: t2 (r, r, kh, kw), w2_a (r, out_k), w2_b (r, in_n), rebuilt
//! as peft 0.21's `make_weight_cp`, "i j k l, i p, j r -> p r k l"). ComfyUI scales a LoKr by alpha / r when
//! a factor is low-rank and by 1 when both are full (LyCORIS too), so with both full the
//! kohya file carries s inside w1 (and the alpha they then ignore, which LyCORIS needs to
//! load the file). PEFT files carry s inside w1 (or w1_a) too, meaning the
//! same under alpha = r. A fused layer has no PEFT form (w1 ⊗ w2 does not split by rows).
//!
//! With `AdapterConfig::weight_decompose` the change is LyCORIS's weight decomposition of
//! s · w1 ⊗ w2 (dora.rs, `Decomposed`: a learned magnitude per output channel, `dora_scale`),
//! in the kohya layout only.

use super::io::{single_part, PeftFile, Reader};
use super::merge::MergeLayer;
use super::{kaiming, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart, Plan};
use crate::{Error, Result, Tensor};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "lokr",
    merge_bias: super::no_bias,
    peft: true,
    ranked: true,
    dropout: false,
    module_dropout: true,
    rank_dropout: true,
    tucker: true,
    peft_tucker: true,
    per_projection: true,
    reads_weight: false,
    weight_decompose: true,
    lycoris_algo: "lokr",
    plain_kohya: false,
    tool_layouts: false,
    loraplus_up: &["lokr_w1", "lokr_w1_a"],
    make: |p| Ok(Arc::new(Lokr::new(p)?)),
    merge,
};

/// A LoKr's change s · w1 ⊗ w2 as the matrix (out, cols) from w1 (l, m) and w2 (k, n), l·k =
/// out, m·n = cols (a convolution's kernel in w2's columns): ΔW[a·k + b, c·n + d] =
/// s · w1[a, c] · w2[b, d].
pub(super) fn kron(w1: &Tensor, w2: &Tensor, scale: f64) -> Result<Tensor> {
    let (&[l, m], &[k, n]) = (w1.dims(), w2.dims()) else {
        return Err(Error::InvalidArgument {
            op: "lokr",
            msg: format!("factor w2 {:?}: w1 and w2 must be matrices", w2.dims()),
            shape: w1.shape().clone(),
        });
    };
    w1.reshape((l, 1, m, 1))?
        .mul(&w2.reshape((1, k, 1, n))?)?
        .reshape((l * k, m * n))?
        .affine(scale, 0.0)
}

/// The change a file's LoKr of one layer stands for (`lokr_w1` or `lokr_w1_a`/`_b`,
/// `lokr_w2` or `lokr_w2_a`/`_b`, or LyCORIS's Tucker form, the core `lokr_t2` between
/// `lokr_w2_a` and `lokr_w2_b`; either split, read from the shapes), as the matrix (out,
/// cols). Scaled as ComfyUI reads it: alpha / r where a factor is low-rank (w2's rank first),
/// else 1; the default scale (PEFT's) where the file stores no alpha.
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    let factor = |w: &str| -> Result<Option<(Tensor, Option<usize>)>> {
        if let Some(t) = l.take(w)? {
            return Ok(Some((l.matrix(w, t)?, None)));
        }
        let (an, bn) = (format!("{w}_a"), format!("{w}_b"));
        match (l.take(&an)?, l.take(&bn)?) {
            (Some(a), Some(b)) => {
                let b = l.matrix(&bn, b)?;
                let r = b.dims()[0];
                if a.dims().len() != 2 || a.dims()[1] != r {
                    return Err(l.bad(&an, &a, &format!("(rows, {r})")));
                }
                Ok(Some((a.matmul(&b)?, Some(r))))
            }
            (None, None) => Ok(None),
            _ => Err(l.error(w, "half of a low-rank factor")),
        }
    };
    let Some((w1, r1)) = factor("lokr_w1")? else {
        return Ok(None);
    };
    let (w2, r2) = match l.take("lokr_t2")? {
        // LyCORIS's Tucker w2: the core t2 (r, r, kh, kw), w2_a (r, out_k), w2_b (r, in_n).
        Some(t2) => {
            let (a, b) = (l.need("lokr_w2_a", "LoKr")?, l.need("lokr_w2_b", "LoKr")?);
            let w2 = super::tucker(&t2, &a, &b).map_err(|e| l.error("lokr_t2", e.to_string()))?;
            (w2, Some(b.dims()[0]))
        }
        None => {
            factor("lokr_w2")?.ok_or_else(|| l.error("lokr_w2", "missing (a LoKr needs it)"))?
        }
    };
    let (out, cols) = (l.out(), l.cols());
    let ((a, m), (k, n)) = ((w1.dims()[0], w1.dims()[1]), (w2.dims()[0], w2.dims()[1]));
    if a * k != out || m * n != cols {
        return Err(l.bad(
            "lokr_w2",
            &w2,
            &format!("factors of ({out}, {cols}) with lokr_w1 {:?}", w1.dims()),
        ));
    }
    let s = match (l.alpha()?, r2.or(r1)) {
        (Some(alpha), Some(r)) => alpha / r as f64,
        (Some(_), None) => 1.0,
        (None, _) => l.default_scale(),
    };
    super::dora::decompose(l, kron(&w1, &w2, s)?, super::dora::Norm::Lycoris).map(Some)
}

/// How a LoKr splits a layer's sides when `factor` divides them: the two libraries differ
/// there and only there. The split shows in a file's shapes (`lokr_w1` is (out_l, in_m)), and
/// w1 ⊗ w2 under one split is not a Kronecker product under the other, so a file is read
/// with the split it was written with ([`LokrSplit::of_file`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LokrSplit {
    /// PEFT 0.21's `factorization`: (factor, dim / factor) as it comes (12 by 4 is (4, 3)).
    Peft,
    /// LyCORIS 4.1's: the smaller side first (12 by 4 is (3, 4)); kohya-layout files, and
    /// the default.
    #[default]
    Lycoris,
}

impl LokrSplit {
    /// The split of `dim` into (m, n), m · n = dim, by this library's rule ([`factorization`]
    /// for PEFT's, that pair smaller side first for LyCORIS's).
    pub fn split(self, dim: usize, factor: i64) -> (usize, usize) {
        let (m, n) = factorization(dim, factor);
        match self {
            LokrSplit::Lycoris if m > n => (n, m),
            _ => (m, n),
        }
    }

    /// The split a LoKr file's shapes show, for `factor`: the first of its layers whose
    /// sides the two rules split differently says which rule made it; `None` when no layer
    /// tells them apart (both rules read it alike). Reads the header only; kohya and PEFT
    /// names alike (`<layer>.lokr_w1`, or `lokr_w1_a` and `lokr_w1_b`).
    pub fn of_file(path: impl AsRef<std::path::Path>, factor: i64) -> Result<Option<LokrSplit>> {
        let file = crate::safetensors::SafeTensorsFile::open(path.as_ref())?;
        let shape = |k: &str| file.info(k).map(|i| i.shape.clone());
        let mut layers = vec![];
        for name in file.names() {
            let Some(base) = name
                .strip_suffix(".lokr_w1")
                .or(name.strip_suffix(".lokr_w1_a"))
            else {
                continue;
            };
            let named = |t: &str| shape(&format!("{base}.{t}"));
            let Some(w1) = factor_sides(named, "lokr_w1") else {
                continue;
            };
            // w2's rows and its columns: a Linear's inputs; a low-rank convolution's
            // columns hold its kernel too, which rarely matches either rule and is then
            // passed over.
            let Some((rows, cols)) = factor_sides(named, "lokr_w2") else {
                continue;
            };
            layers.push((w1, w1.0 * rows, Some(w1.1 * cols)));
        }
        Ok(Self::of_shapes(layers, factor))
    }

    /// [`LokrSplit::of_file`] over each layer's (w1's rows and columns, the layer's out, the
    /// layer's in where known).
    pub fn of_shapes(
        layers: impl IntoIterator<Item = ((usize, usize), usize, Option<usize>)>,
        factor: i64,
    ) -> Option<LokrSplit> {
        let rules = [LokrSplit::Peft, LokrSplit::Lycoris];
        for ((rows, cols), out, inn) in layers {
            let mut sides = vec![(rows, out)];
            sides.extend(inn.map(|i| (cols, i)));
            for (got, dim) in sides {
                let [peft, lycoris] = rules.map(|r| r.split(dim, factor).0);
                if peft != lycoris {
                    if got == peft {
                        return Some(LokrSplit::Peft);
                    }
                    if got == lycoris {
                        return Some(LokrSplit::Lycoris);
                    }
                }
            }
        }
        None
    }
}

/// The (rows, columns) of factor `w` (`lokr_w1` or `lokr_w2`) in a file, from `shape` (a
/// tensor's shape by name): the full tensor's first two sides, or the low-rank pair's
/// (`_a`'s rows, `_b`'s columns).
fn factor_sides(shape: impl Fn(&str) -> Option<Vec<usize>>, w: &str) -> Option<(usize, usize)> {
    match (shape(w), shape(&format!("{w}_a")), shape(&format!("{w}_b"))) {
        (Some(t), _, _) if t.len() >= 2 => Some((t[0], t[1])),
        (None, Some(a), Some(b)) if a.len() == 2 && b.len() == 2 => Some((a[0], b[1])),
        _ => None,
    }
}

/// The split of `dim` into (m, n), m · n = dim, as PEFT's `factorization` (LyCORIS's
/// differs only in ordering the first case's pair, [`LokrSplit`]): with `factor` = -1 the
/// most balanced split, m the largest divisor at most sqrt(dim) (3072 -> (48, 64)); with a
/// positive factor that divides `dim`, (factor, dim / factor); otherwise the most balanced
/// split with m at most `factor`.
pub fn factorization(dim: usize, factor: i64) -> (usize, usize) {
    if factor > 0 && dim % factor as usize == 0 {
        return (factor as usize, dim / factor as usize);
    }
    let cap = if factor < 0 { dim } else { factor as usize };
    let (mut m, mut n) = (1usize, dim);
    let length = m + n;
    while m < n {
        let mut next = m + 1;
        while dim % next != 0 {
            next += 1;
        }
        let nn = dim / next;
        if next + nn > length || next > cap {
            break;
        }
        (m, n) = (next, nn);
    }
    if m > n {
        (n, m)
    } else {
        (m, n)
    }
}

/// A factor: full, or the product of two low-rank matrices.
#[derive(Debug)]
enum Factor {
    Full(Tensor),
    LowRank(Tensor, Tensor),
    /// LyCORIS's Tucker w2 (`AdapterConfig::tucker`): a (r, out_k), b (r, in_n) and the core
    /// t (r, r, kh, kw), rebuilt by `tucker`.
    Tucker(Tensor, Tensor, Tensor),
}

impl Factor {
    fn tensors(&self) -> Vec<Tensor> {
        match self {
            Factor::Full(w) => vec![w.clone()],
            Factor::LowRank(a, b) => vec![a.clone(), b.clone()],
            Factor::Tucker(a, b, t) => vec![a.clone(), b.clone(), t.clone()],
        }
    }
    fn low_rank(&self) -> bool {
        matches!(self, Factor::LowRank(..) | Factor::Tucker(..))
    }
}

/// One layer's LoKr.
#[derive(Debug)]
pub struct Lokr {
    path: String,
    /// Module and rank dropout.
    drops: super::WeightDropout,
    shape: LayerShape,
    rank: usize,
    alpha: f64,
    /// The rule and factor that split the sides.
    split: LokrSplit,
    factor: i64,
    /// (out_l, out_k), (in_m, in_n).
    out_split: (usize, usize),
    in_split: (usize, usize),
    w1: Factor,
    w2: Factor,
}

impl Lokr {
    fn new(p: &Plan) -> Result<Self> {
        let (shape, r) = (p.shape, p.rank);
        let (factor, split) = (p.config.factor, p.config.lokr_split);
        let (out_l, out_k) = split.split(shape.out_dim(), factor);
        let (in_m, in_n) = split.split(shape.in_dim(), factor);
        let (kh, kw) = shape.kernel();
        let dev = p.device;
        let seed = p.seed;
        // PEFT: a factor is low-rank when r < max(its sides) / 2 (w1 only with decompose_both).
        let w1 = if p.config.decompose_both && (r as f64) < out_l.max(in_m) as f64 / 2.0 {
            Factor::LowRank(
                zeros(&[out_l, r], dev)?,
                kaiming(&[r, in_m], in_m, dev, seed)?,
            )
        } else {
            Factor::Full(zeros(&[out_l, in_m], dev)?)
        };
        let w2_cols = in_n * kh * kw;
        let low_rank_w2 = (r as f64) < out_k.max(in_n) as f64 / 2.0;
        let w2 = if low_rank_w2 && p.config.tucker && shape.is_conv() && (kh, kw) != (1, 1) {
            // LyCORIS's `use_tucker`, which applies where w2 is low-rank.
            Factor::Tucker(
                kaiming(&[r, out_k], out_k, dev, seed.rotate_left(7))?,
                kaiming(&[r, in_n], in_n, dev, seed.rotate_left(13))?,
                kaiming(&[r, r, kh, kw], r * kh * kw, dev, seed.rotate_left(19))?,
            )
        } else if low_rank_w2 {
            Factor::LowRank(
                kaiming(&[out_k, r], r, dev, seed.rotate_left(7))?,
                kaiming(&[r, w2_cols], w2_cols, dev, seed.rotate_left(13))?,
            )
        } else {
            let dims = if shape.is_conv() {
                vec![out_k, in_n, kh, kw]
            } else {
                vec![out_k, in_n]
            };
            Factor::Full(kaiming(&dims, w2_cols, dev, seed.rotate_left(7))?)
        };
        Ok(Lokr {
            path: p.path.to_string(),
            drops: super::WeightDropout::new(p)?,
            shape,
            rank: r,
            alpha: p.alpha,
            split,
            factor,
            out_split: (out_l, out_k),
            in_split: (in_m, in_n),
            w1,
            w2,
        })
    }

    /// alpha / r.
    fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The names of the tensors in `params` order.
    fn names(&self) -> Vec<&'static str> {
        let mut v = match self.w1 {
            Factor::Full(_) => vec!["lokr_w1"],
            Factor::LowRank(..) | Factor::Tucker(..) => vec!["lokr_w1_a", "lokr_w1_b"],
        };
        v.extend(match self.w2 {
            Factor::Full(_) => vec!["lokr_w2"],
            Factor::LowRank(..) => vec!["lokr_w2_a", "lokr_w2_b"],
            Factor::Tucker(..) => vec!["lokr_w2_a", "lokr_w2_b", "lokr_t2"],
        });
        v
    }

    fn own(&self) -> Vec<Tensor> {
        let mut v = self.w1.tensors();
        v.extend(self.w2.tensors());
        v
    }

    /// s · w1 ⊗ w2 in f32, the weight's shape, from the tensors in `params` order.
    fn delta_of(&self, p: &[Tensor]) -> Result<Tensor> {
        let (out_l, out_k) = self.out_split;
        let (in_m, in_n) = self.in_split;
        let (kh, kw) = self.shape.kernel();
        let (w1, rest) = match self.w1 {
            Factor::Full(_) => (p[0].clone(), &p[1..]),
            Factor::LowRank(..) | Factor::Tucker(..) => (p[0].matmul(&p[1])?, &p[2..]),
        };
        let w2 = match self.w2 {
            Factor::Full(_) => rest[0].clone(),
            Factor::LowRank(..) => rest[0].matmul(&rest[1])?,
            Factor::Tucker(..) => super::tucker(&rest[2], &rest[0], &rest[1])?,
        };
        // ΔW[a·out_k + b, c·in_n + d, h, w] = w1[a, c] · w2[b, d, h, w]: w2's kernel joins
        // its columns.
        let w1 = w1.reshape((out_l, in_m))?;
        let w2 = w2.reshape((out_k, in_n * kh * kw))?;
        kron(&w1, &w2, self.scale())?.reshape(self.shape.weight_dims())
    }

    fn check(&self, p: &[Tensor]) -> Result<()> {
        if p.len() == self.names().len() {
            Ok(())
        } else {
            Err(Error::Autograd(format!(
                "lokr: expected {} parameters, got {}",
                self.names().len(),
                p.len()
            )))
        }
    }

    /// Where a file's w1 (rows, columns), from `shape` (a tensor's shape by name), is the
    /// other rule's split of this layer: an error saying so and how to read it.
    fn split_mismatch(&self, shape: impl Fn(&str) -> Option<Vec<usize>>) -> Option<String> {
        let w1 = factor_sides(shape, "lokr_w1")?;
        let ours = (self.out_split.0, self.in_split.0);
        let other = match self.split {
            LokrSplit::Peft => LokrSplit::Lycoris,
            LokrSplit::Lycoris => LokrSplit::Peft,
        };
        let (out, inn) = (self.shape.out_dim(), self.shape.in_dim());
        let theirs = (
            other.split(out, self.factor).0,
            other.split(inn, self.factor).0,
        );
        (w1 != ours && w1 == theirs).then(|| {
            format!(
                "w1 is {w1:?}: {other:?}'s split of ({out}, {inn}) by factor {}, where these \
                 adapters take {:?}'s {ours:?}; build them with AdapterConfig::lokr_split = \
                 {other:?} (LokrSplit::of_file tells which a file holds)",
                self.factor, self.split
            )
        })
    }

    /// Both factors full: ComfyUI applies the product unscaled.
    fn both_full(&self) -> bool {
        !self.w1.low_rank() && !self.w2.low_rank()
    }

    /// The tensors with s folded into w1 (or w1_a), by name.
    fn scaled(&self) -> Result<Vec<(&'static str, Tensor)>> {
        let s = self.scale();
        self.names()
            .into_iter()
            .zip(self.own())
            .enumerate()
            .map(|(i, (n, t))| Ok((n, if i == 0 { t.affine(s, 0.0)? } else { t })))
            .collect()
    }

    /// Assigns tensors read under their names, w1 (or w1_a) rescaled by `ratio`.
    fn assign(&self, read: Vec<Tensor>, ratio: f64) -> Result<()> {
        for (i, (dst, src)) in self.own().iter().zip(read).enumerate() {
            let src = if i == 0 && ratio != 1.0 {
                src.affine(ratio, 0.0)?
            } else {
                src
            };
            dst.assign(&src)?;
        }
        Ok(())
    }
}

impl Adapter for Lokr {
    fn kind(&self) -> &'static str {
        "lokr"
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn shape(&self) -> LayerShape {
        self.shape
    }

    fn params(&self) -> Vec<(&'static str, Tensor)> {
        self.names().into_iter().zip(self.own()).collect()
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn forward_with(&self, _: &BaseLayer, x: &Tensor, y: Tensor, p: &[Tensor]) -> Result<Tensor> {
        Ok(self.shape.add_change(y, x, self.change_with(p)?, None)?.0)
    }

    fn adds_change(&self) -> bool {
        true
    }

    fn delta_weight(&self, _: &BaseLayer) -> Result<Tensor> {
        self.delta_of(&self.own())
    }

    /// s · w1 ⊗ w2 with this forward's rank dropout, `None` where module dropout skips it.
    fn change_with(&self, p: &[Tensor]) -> Result<Option<Tensor>> {
        self.check(p)?;
        if self.drops.skips() {
            return Ok(None);
        }
        self.drops.rows(self.delta_of(p)?).map(Some)
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        let tensors = if self.both_full() {
            self.scaled()?
        } else {
            self.params()
        };
        let mut v: Vec<(String, Tensor)> = tensors
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect();
        // With both factors full, LyCORIS and ComfyUI apply the product unscaled whatever
        // alpha says, but LyCORIS 4.1.3 cannot build the module without one.
        let dev = self.own()[0].device().clone();
        v.push(("alpha".into(), super::alpha_tensor(self.alpha, &dev)?));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        if let Some(msg) = self.split_mismatch(|t| file.shape(t)) {
            return Err(file.error("lokr_w1", msg));
        }
        let read = self
            .params()
            .into_iter()
            .map(|(n, t)| file.take(n, t.dims()))
            .collect::<Result<Vec<_>>>()?;
        // ComfyUI's scale of the file: alpha / r with a low-rank factor, else 1.
        let file_scale = match file.alpha()? {
            Some(a) if !self.both_full() => a / self.rank as f64,
            _ => 1.0,
        };
        self.assign(read, file_scale / self.scale())
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        let p = single_part("LoKr", &self.path, parts)?;
        Ok(self
            .scaled()?
            .into_iter()
            .map(|(n, t)| (format!("{}.{n}", p.module), t))
            .collect())
    }

    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()> {
        let part = single_part("LoKr", &self.path, parts)?;
        if let Some(msg) = self.split_mismatch(|t| file.shape(&part.module, t)) {
            return Err(file.error(&part.module, "lokr_w1", msg));
        }
        let read = self
            .params()
            .into_iter()
            .map(|(n, t)| file.take(&part.module, n, t.dims(), t.device()))
            .collect::<Result<Vec<_>>>()?;
        self.assign(read, file_scale / self.scale())
    }

    fn set_batch(&self, step: u64, micro: u64, _: crate::nn::dropout::BatchPart) {
        self.drops.set_batch(step, micro);
    }
}
