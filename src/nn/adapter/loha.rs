//! LoHa (LyCORIS; Hyeon-Woo et al. 2022, "FedPara: Low-Rank Hadamard Product for
//! Communication-Efficient Federated Learning"): ΔW = s · (w1_a w1_b) ⊙ (w2_a w2_b), with
//! w1_a, w2_a (out, r) and w1_b, w2_b (r, in·kh·kw), reshaped to the weight's shape;
//! s = alpha / r. w2_b starts at zero and the rest Kaiming-uniform (PEFT's initialisation), so
//! a fresh adapter leaves the model unchanged. The forward adds x ⊛ ΔW to the frozen output.
//!
//! Files: kohya / LyCORIS and PEFT name the tensors alike (`hada_w1_a`, `hada_w1_b`,
//! `hada_w2_a`, `hada_w2_b`); the kohya file has `alpha` (ComfyUI scales by alpha / r), the
//! PEFT file carries s inside w1_a (meaning the same under alpha = r). A fused layer (one
//! that diffusers splits into modules) is refused in the PEFT layout.

use super::io::{single_part, PeftFile, Reader};
use super::merge::MergeLayer;
use super::{cast, kaiming, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart, Plan};
use crate::{Error, Result, Tensor};
use std::sync::Arc;

pub(super) const KIND: Kind = Kind {
    name: "loha",
    merge_bias: super::no_bias,
    peft: true,
    ranked: true,
    dropout: false,
    module_dropout: true,
    rank_dropout: true,
    tucker: false,
    reads_weight: false,
    lycoris_algo: "loha",
    plain_kohya: false,
    make: |p| Ok(Arc::new(Loha::new(p)?)),
    merge,
};

/// A LoHa's change s · (w1_a w1_b) ⊙ (w2_a w2_b) as the matrix (out, cols), the `_b`
/// factors as matrices (r, cols).
pub(super) fn hadamard(w: [&Tensor; 4], scale: f64) -> Result<Tensor> {
    let [a1, b1, a2, b2] = w;
    a1.matmul(b1)?.mul(&a2.matmul(b2)?)?.affine(scale, 0.0)
}

/// The change a file's LoHa of one layer stands for (`hada_w1_a` ... `hada_w2_b`, a
/// convolution's kernel in the `_b` factors' columns, or LyCORIS's Tucker form with cores
/// `hada_t1`, `hada_t2`), as the matrix (out, cols); scaled by
/// alpha / r where the file stores alpha, as ComfyUI reads it.
pub(super) fn merge(l: &MergeLayer) -> Result<Option<Tensor>> {
    let Some(a1) = l.take(NAMES[0])? else {
        return Ok(None);
    };
    if let Some(t1) = l.take("hada_t1")? {
        // LyCORIS's Tucker LoHa: each half t (r, r, kh, kw) with w_a (r, out), w_b (r, in).
        let t2 = l.need("hada_t2", "Tucker LoHa")?;
        let (b1, a2, b2) = (
            l.need(NAMES[1], "LoHa")?,
            l.need(NAMES[2], "LoHa")?,
            l.need(NAMES[3], "LoHa")?,
        );
        let half = |t: &Tensor, a: &Tensor, b: &Tensor, name: &str| {
            super::tucker(t, a, b).map_err(|e| l.error(name, e.to_string()))
        };
        let d = half(&t1, &a1, &b1, "hada_t1")?.mul(&half(&t2, &a2, &b2, "hada_t2")?)?;
        if d.dims() != [l.out(), l.cols()] {
            return Err(l.bad(
                "hada_t1",
                &t1,
                &format!("a core of ({}, {})", l.out(), l.cols()),
            ));
        }
        let s = l.scale(b1.dims()[0])?;
        return super::dora::decompose(l, d.affine(s, 0.0)?).map(Some);
    }
    let b1 = l.matrix(NAMES[1], l.need(NAMES[1], "LoHa")?)?;
    let a2 = l.need(NAMES[2], "LoHa")?;
    let b2 = l.matrix(NAMES[3], l.need(NAMES[3], "LoHa")?)?;
    let (out, cols) = (l.out(), l.cols());
    let r = b1.dims()[0];
    let fits = a1.dims() == [out, r]
        && a2.dims() == [out, r]
        && b1.dims() == [r, cols]
        && b2.dims() == [r, cols];
    if !fits {
        return Err(l.bad(NAMES[0], &a1, &format!("factors of ({out}, {cols})")));
    }
    let s = l.scale(r)?;
    super::dora::decompose(l, hadamard([&a1, &b1, &a2, &b2], s)?).map(Some)
}

const NAMES: [&str; 4] = ["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"];

/// One layer's LoHa.
#[derive(Debug)]
pub struct Loha {
    path: String,
    /// Module and rank dropout.
    drops: super::WeightDropout,
    shape: LayerShape,
    alpha: f64,
    /// w1_a, w1_b, w2_a, w2_b.
    w: [Tensor; 4],
}

impl Loha {
    fn new(p: &Plan) -> Result<Self> {
        let (shape, r, dev, seed) = (p.shape, p.rank, p.device, p.seed);
        let (out, cols) = (shape.out_dim(), shape.cols());
        Ok(Loha {
            path: p.path.to_string(),
            drops: super::WeightDropout::new(p)?,
            shape,
            alpha: p.alpha,
            w: [
                kaiming(&[out, r], r, dev, seed)?,
                kaiming(&[r, cols], cols, dev, seed.rotate_left(7))?,
                kaiming(&[out, r], r, dev, seed.rotate_left(13))?,
                zeros(&[r, cols], dev)?,
            ],
        })
    }

    fn rank(&self) -> usize {
        self.w[0].dims()[1]
    }

    /// alpha / r.
    fn scale(&self) -> f64 {
        self.alpha / self.rank() as f64
    }

    /// s · (w1_a w1_b) ⊙ (w2_a w2_b) in f32, the weight's shape.
    fn delta_of(&self, p: &[Tensor]) -> Result<Tensor> {
        let [a1, b1, a2, b2] = p else {
            return Err(Error::Autograd("loha: expected 4 parameters".into()));
        };
        hadamard([a1, b1, a2, b2], self.scale())?.reshape(self.shape.weight_dims())
    }

    /// Assigns tensors read in `NAMES` order, w1_a rescaled by `ratio`.
    fn assign(&self, read: Vec<Tensor>, ratio: f64) -> Result<()> {
        for (i, (dst, src)) in self.w.iter().zip(read).enumerate() {
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

impl Adapter for Loha {
    fn kind(&self) -> &'static str {
        "loha"
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn shape(&self) -> LayerShape {
        self.shape
    }

    fn params(&self) -> Vec<(&'static str, Tensor)> {
        NAMES.into_iter().zip(self.w.iter().cloned()).collect()
    }

    fn adds_to_output(&self) -> bool {
        true
    }

    fn forward_with(&self, _: &BaseLayer, x: &Tensor, y: Tensor, p: &[Tensor]) -> Result<Tensor> {
        if self.drops.skips() {
            return Ok(y);
        }
        let dw = cast(&self.drops.rows(self.delta_of(p)?)?, x)?;
        self.shape.add_apply(y, x, &dw)
    }

    fn delta_weight(&self, _: &BaseLayer) -> Result<Tensor> {
        self.delta_of(&self.w)
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        let mut v: Vec<(String, Tensor)> = self
            .params()
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect();
        v.push((
            "alpha".into(),
            super::alpha_tensor(self.alpha, self.w[0].device())?,
        ));
        Ok(v)
    }

    fn load_kohya(&self, file: &mut Reader) -> Result<()> {
        let read = self
            .params()
            .into_iter()
            .map(|(n, t)| file.take(n, t.dims()))
            .collect::<Result<Vec<_>>>()?;
        // ComfyUI's scale of the file: alpha / r, or 1 without alpha.
        let file_scale = file.alpha()?.map_or(1.0, |a| a / self.rank() as f64);
        self.assign(read, file_scale / self.scale())
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        let p = single_part("LoHa", &self.path, parts)?;
        self.params()
            .into_iter()
            .enumerate()
            .map(|(i, (n, t))| {
                let t = if i == 0 {
                    t.affine(self.scale(), 0.0)?
                } else {
                    t
                };
                Ok((format!("{}.{n}", p.module), t))
            })
            .collect()
    }

    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()> {
        let part = single_part("LoHa", &self.path, parts)?;
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
