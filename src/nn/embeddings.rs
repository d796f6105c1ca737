//! Timestep and position embeddings, and adaLN modulation, as Flux, SD3 and SDXL use them.

use super::layers::Linear;
use super::VarBuilder;
use crate::{DType, Error, Result, Tensor};

/// The dtype positions and frequencies are computed in: f64 (as BFL's Flux code does), then
/// cast to the activations' dtype.
const POSITION_DTYPE: DType = DType::F64;

/// Sinusoidal embedding of timesteps (N,) -> (N, dim), diffusers' `get_timestep_embedding`:
/// freq_i = exp(-ln(max_period) * i / (half - downscale_freq_shift)), i < half = dim / 2;
/// emb = scale * t * freq; output [sin, cos] ([cos, sin] when `flip_sin_to_cos`), zero padded
/// to an odd `dim`. Flux multiplies t by 1000 first and uses flip = true, shift = 0.
pub fn timestep_embedding(
    t: &Tensor,
    dim: usize,
    max_period: f64,
    flip_sin_to_cos: bool,
    downscale_freq_shift: f64,
    scale: f64,
) -> Result<Tensor> {
    if t.rank() != 1 || dim < 2 {
        return Err(Error::invalid(
            "timestep_embedding",
            format!("needs (N,) timesteps and dim >= 2, got dim {dim}"),
            t.shape(),
        ));
    }
    let half = dim / 2;
    let dev = t.device();
    let exponent = Tensor::arange(0.0, half as f64, POSITION_DTYPE, dev)?
        .affine(-max_period.ln() / (half as f64 - downscale_freq_shift), 0.0)?;
    let freqs = exponent.exp()?;
    let args = t
        .to_dtype(POSITION_DTYPE)?
        .unsqueeze(1)?
        .mul(&freqs.unsqueeze(0)?)?
        .affine(scale, 0.0)?;
    let (sin, cos) = (args.sin()?, args.cos()?);
    let mut emb = if flip_sin_to_cos {
        Tensor::cat(&[&cos, &sin], 1)?
    } else {
        Tensor::cat(&[&sin, &cos], 1)?
    };
    if dim % 2 == 1 {
        let pad = Tensor::zeros((t.dims()[0], 1), POSITION_DTYPE, dev)?;
        emb = Tensor::cat(&[&emb, &pad], 1)?;
    }
    emb.to_dtype(if t.dtype().is_float() {
        t.dtype()
    } else {
        DType::F32
    })
}

/// Rotation matrices of one position axis (BFL Flux `rope`): pos (N, L), even `dim` ->
/// (N, L, dim/2, 2, 2) holding [[cos, -sin], [sin, cos]] of pos * theta^(-2i/dim).
pub fn rope(pos: &Tensor, dim: usize, theta: f64) -> Result<Tensor> {
    if dim % 2 != 0 || pos.rank() != 2 {
        return Err(Error::invalid(
            "rope",
            format!("needs (N, L) positions and an even dim, got dim {dim}"),
            pos.shape(),
        ));
    }
    let dev = pos.device();
    let omega = Tensor::arange_step(0.0, dim as f64, 2.0, POSITION_DTYPE, dev)?
        .affine(-theta.ln() / dim as f64, 0.0)?
        .exp()?;
    let (n, l) = (pos.dims()[0], pos.dims()[1]);
    let angles = pos
        .to_dtype(POSITION_DTYPE)?
        .unsqueeze(2)?
        .mul(&omega.reshape((1, 1, dim / 2))?)?;
    let (c, s) = (angles.cos()?, angles.sin()?);
    Tensor::stack(&[&c, &s.neg()?, &s, &c], 3)?
        .reshape(vec![n, l, dim / 2, 2, 2])?
        .to_dtype(DType::F32)
}

/// Flux's `EmbedND`: positions ids (N, L, axes) -> rotations (N, 1, L, D/2, 2, 2), one block
/// of `axes_dim[i]` per axis (Flux: theta 10000, axes_dim [16, 56, 56]).
#[derive(Clone, Debug)]
pub struct EmbedNd {
    /// RoPE base frequency.
    pub theta: f64,
    /// Rotary dims per position axis (each even; they sum to the head dim D).
    pub axes_dim: Vec<usize>,
}

impl EmbedNd {
    /// ids (N, L, axes) -> rotations (N, 1, L, D/2, 2, 2) in f32.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.rank() != 3 || ids.dims()[2] != self.axes_dim.len() {
            return Err(Error::invalid(
                "embed_nd",
                format!("ids must be (N, L, {})", self.axes_dim.len()),
                ids.shape(),
            ));
        }
        let parts = self
            .axes_dim
            .iter()
            .enumerate()
            .map(|(i, &d)| rope(&ids.narrow(2, i, 1)?.squeeze(2)?, d, self.theta))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), 2)?.unsqueeze(1)
    }
}

/// Rotates pairs of the last dim of x (N, H, L, D) by `freqs` (N, 1, L, D/2, 2, 2): each pair
/// (a, b) becomes (f00 a + f01 b, f10 a + f11 b), in f32, through the fused kernel
/// (`Tensor::apply_rope`; `Tensor::apply_rope_composite` is its reference).
pub fn apply_rope(x: &Tensor, freqs: &Tensor) -> Result<Tensor> {
    x.apply_rope(freqs)
}

/// adaLN modulation `x * (1 + scale) + shift`, through the fused kernel (`Tensor::modulate`).
pub fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    x.modulate(shift, scale)
}

/// `lin.forward(modulate(x, shift, scale))`, where `lin`'s products run in 8 bits with the
/// modulation quantizing its output's rows in its own pass (`Linear::input_code`,
/// `Tensor::modulate_quant8`).
pub fn modulate_into(x: &Tensor, shift: &Tensor, scale: &Tensor, lin: &Linear) -> Result<Tensor> {
    match lin.input_code() {
        Some(code) => {
            let (y, rows) = x.modulate_quant8(shift, scale, code)?;
            lin.forward_rows8(&y, Some(&rows))
        }
        None => lin.forward(&modulate(x, shift, scale)?),
    }
}

/// Flux's `Modulation`: `lin(silu(vec))` split into (shift, scale, gate) triples, one triple
/// for a single-stream block, two for a double-stream one. Keys: `lin.weight`, `lin.bias`.
#[derive(Clone, Debug)]
pub struct Modulation {
    /// `lin`: dim -> 3 x triples x dim.
    pub lin: Linear,
    /// Number of (shift, scale, gate) triples: 1 or 2.
    pub triples: usize,
}

/// One (shift, scale, gate), each (N, 1, dim).
#[derive(Clone, Debug)]
pub struct ModulationOut {
    /// Added after scaling.
    pub shift: Tensor,
    /// Multiplies as `1 + scale`.
    pub scale: Tensor,
    /// Multiplies the branch output before the residual add.
    pub gate: Tensor,
}

impl Modulation {
    /// `lin` under `vb` for width `dim`: two triples when `double`, else one.
    pub fn new(vb: &VarBuilder, dim: usize, double: bool) -> Result<Self> {
        let triples = if double { 2 } else { 1 };
        Ok(Modulation {
            lin: Linear::new(&vb.pp("lin"), dim, 3 * triples * dim, true)?,
            triples,
        })
    }

    /// vec (N, dim) -> one ModulationOut per triple.
    pub fn forward(&self, vec: &Tensor) -> Result<Vec<ModulationOut>> {
        self.forward_activated(&vec.silu()?)
    }

    /// As `forward`, from `silu(vec)` (a model computes it once for all its blocks, so their
    /// modulations see one input: `BlockStreamer::set_host_products` computes their products
    /// from one copy of it).
    pub fn forward_activated(&self, vec_act: &Tensor) -> Result<Vec<ModulationOut>> {
        let out = self.lin.forward(vec_act)?.unsqueeze(1)?;
        let chunks = out.chunk(3 * self.triples, 2)?;
        Ok(chunks
            .chunks(3)
            .map(|c| ModulationOut {
                shift: c[0].clone(),
                scale: c[1].clone(),
                gate: c[2].clone(),
            })
            .collect())
    }
}

impl ModulationOut {
    /// `x * (1 + scale) + shift`
    pub fn modulate(&self, x: &Tensor) -> Result<Tensor> {
        modulate(x, &self.shift, &self.scale)
    }

    /// `lin.forward(self.modulate(x))`, where `lin`'s products run in 8 bits with the
    /// modulation quantizing its output's rows in its own pass (`Linear::input_code`).
    pub fn modulate_into(&self, x: &Tensor, lin: &Linear) -> Result<Tensor> {
        modulate_into(x, &self.shift, &self.scale, lin)
    }
}
