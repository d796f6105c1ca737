//! LoHa (LyCORIS; Hyeon-Woo et al. 2022, "FedPara: Low-Rank Hadamard Product for
//! Communication-Efficient Federated Learning"): ΔW = s · (w1_a w1_b) ⊙ (w2_a w2_b), with
//! w1_a, w2_a (out, r) and w1_b, w2_b (r, in·kh·kw), reshaped to the weight's shape;
//! s = alpha / r. w2_b starts at zero and the rest Kaiming-uniform (PEFT's initialisation), so
//! a fresh adapter leaves the model unchanged. The forward adds x ⊛ ΔW to the frozen output.
//!
//! With `AdapterConfig::tucker` a convolution of a kernel larger than 1×1 takes LyCORIS's
//! Tucker form: each half is a core t (r, r, kh, kw) rebuilt with w_a (r, out) and w_b
//! (r, in) (`tucker`), the cores `hada_t1` / `hada_t2`; w2_b starts at zero there too.
//!
//! Files: kohya / LyCORIS and PEFT name the tensors alike (`hada_w1_a`, `hada_w1_b`,
//! `hada_w2_a`, `hada_w2_b`, and the Tucker form's `hada_t1`, `hada_t2`, which is PEFT's
//! `use_effective_conv2d`: the same shapes and the same rebuild, peft 0.21's
//! `make_weight_cp` einsum "i j k l, j r, i p -> p r k l" of t, w_b, w_a); the kohya file has `alpha` (ComfyUI scales by alpha / r), the
//! PEFT file carries s inside w1_a (meaning the same under alpha = r). A fused layer (one
//! that diffusers splits into modules) is refused in the PEFT layout.
//!
//! With `AdapterConfig::weight_decompose` the change is LyCORIS's weight decomposition of
//! the Hadamard product (dora.rs, `Decomposed`: a learned magnitude per output channel,
//! `dora_scale`), in the kohya layout only.

use super::io::{single_part, PeftFile, Reader};
use super::merge::MergeLayer;
use super::{kaiming, zeros, Adapter, BaseLayer, Kind, LayerShape, PeftPart, Plan};
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
    tucker: true,
    peft_tucker: true,
    per_projection: true,
    reads_weight: false,
    weight_decompose: true,
    lycoris_algo: "loha",
    plain_kohya: false,
    tool_layouts: false,
    loraplus_up: &["hada_w2_b"],
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
        return super::dora::decompose(l, d.affine(s, 0.0)?, super::dora::Norm::Lycoris).map(Some);
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
    let change = hadamard([&a1, &b1, &a2, &b2], s)?;
    super::dora::decompose(l, change, super::dora::Norm::Lycoris).map(Some)
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
    /// w1_a, w1_b, w2_a, w2_b (in the Tucker form (r, out), (r, in), (r, out), (r, in)).
    w: [Tensor; 4],
    /// The Tucker form's cores t1, t2 (r, r, kh, kw) (`AdapterConfig::tucker`).
    cores: Option<[Tensor; 2]>,
}

impl Loha {
    fn new(p: &Plan) -> Result<Self> {
        let (shape, r, dev, seed) = (p.shape, p.rank, p.device, p.seed);
        let (out, cols) = (shape.out_dim(), shape.cols());
        let (w, cores) = match shape {
            LayerShape::Conv2d { cin, kernel, .. } if p.config.tucker && kernel != (1, 1) => {
                let (kh, kw) = kernel;
                let core =
                    |salt: u32| kaiming(&[r, r, kh, kw], r * kh * kw, dev, seed.rotate_left(salt));
                (
                    [
                        kaiming(&[r, out], out, dev, seed)?,
                        kaiming(&[r, cin], cin, dev, seed.rotate_left(7))?,
                        kaiming(&[r, out], out, dev, seed.rotate_left(13))?,
                        zeros(&[r, cin], dev)?,
                    ],
                    Some([core(19)?, core(23)?]),
                )
            }
            _ => (
                [
                    kaiming(&[out, r], r, dev, seed)?,
                    kaiming(&[r, cols], cols, dev, seed.rotate_left(7))?,
                    kaiming(&[out, r], r, dev, seed.rotate_left(13))?,
                    zeros(&[r, cols], dev)?,
                ],
                None,
            ),
        };
        Ok(Loha {
            path: p.path.to_string(),
            drops: super::WeightDropout::new(p)?,
            shape,
            alpha: p.alpha,
            w,
            cores,
        })
    }

    fn rank(&self) -> usize {
        self.w[1].dims()[0]
    }

    /// alpha / r.
    fn scale(&self) -> f64 {
        self.alpha / self.rank() as f64
    }

    /// s · (w1_a w1_b) ⊙ (w2_a w2_b) (the Tucker form: each half its core rebuilt) in f32,
    /// the weight's shape, from the parameters in `params` order.
    fn delta_of(&self, p: &[Tensor]) -> Result<Tensor> {
        let d = match p {
            [a1, b1, a2, b2] if self.cores.is_none() => hadamard([a1, b1, a2, b2], self.scale())?,
            [a1, b1, a2, b2, t1, t2] if self.cores.is_some() => super::tucker(t1, a1, b1)?
                .mul(&super::tucker(t2, a2, b2)?)?
                .affine(self.scale(), 0.0)?,
            _ => {
                return Err(Error::Autograd(format!(
                    "loha: {} parameters, expected {}",
                    p.len(),
                    if self.cores.is_some() { 6 } else { 4 }
                )))
            }
        };
        d.reshape(self.shape.weight_dims())
    }

    /// Assigns tensors read in `params` order, w1_a rescaled by `ratio`.
    fn assign(&self, read: Vec<Tensor>, ratio: f64) -> Result<()> {
        let dsts: Vec<Tensor> = self.params().into_iter().map(|(_, t)| t).collect();
        for (i, (dst, src)) in dsts.iter().zip(read).enumerate() {
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
        let mut v: Vec<(&'static str, Tensor)> =
            NAMES.into_iter().zip(self.w.iter().cloned()).collect();
        if let Some([t1, t2]) = &self.cores {
            v.push(("hada_t1", t1.clone()));
            v.push(("hada_t2", t2.clone()));
        }
        v
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
        let p: Vec<Tensor> = self.params().into_iter().map(|(_, t)| t).collect();
        self.delta_of(&p)
    }

    /// The Hadamard change with this forward's rank dropout, `None` where module dropout
    /// skips it.
    fn change_with(&self, p: &[Tensor]) -> Result<Option<Tensor>> {
        if self.drops.skips() {
            return Ok(None);
        }
        self.drops.rows(self.delta_of(p)?).map(Some)
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
