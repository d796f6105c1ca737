//! FLUX.2's blocks and model, by BFL key path. Shape letters: B batch, L image tokens, T text
//! tokens, D hidden, H heads, E head dim (D = H E), M MLP width.

use super::Flux2Config;
use crate::memory::BlockExec;
use crate::models::common::{
    outputs, rope_attention as attention, rope_attention_heads, stream_rows, MlpEmbedder, QkNorm,
};
use crate::nn::{timestep_embedding, EmbedNd, Linear, ModulationOut, VarBuilder};
use crate::{DType, Error, Result, Tensor};

/// Timesteps (and guidance) in [0, 1] are scaled by 1000 before their sinusoidal embedding
/// (diffusers `Flux2Transformer2DModel.forward`: `timestep * 1000`; BFL `timestep_embedding`'s
/// `time_factor`).
const TIME_FACTOR: f64 = 1000.0;

/// The sinusoidal embedding's max period (diffusers `Timesteps` through
/// `get_timestep_embedding`'s default; BFL `timestep_embedding(max_period=10000)`).
const MAX_PERIOD: f64 = 10_000.0;

/// One shared modulation's output (B, 3 k D) as its k (shift, scale, gate) triples, each
/// (B, 1, D) (diffusers `Flux2Modulation.split`, BFL `Modulation.forward`).
fn triples(m: &Tensor, k: usize) -> Result<Vec<ModulationOut>> {
    let chunks = m.unsqueeze(1)?.chunk(3 * k, 2)?;
    Ok(chunks
        .chunks(3)
        .map(|c| ModulationOut {
            shift: c[0].clone(),
            scale: c[1].clone(),
            gate: c[2].clone(),
        })
        .collect())
}

/// One stream of a double block: `{img,txt}_attn.{qkv,norm,proj}`, `{img,txt}_mlp.{0,2}`
/// (a SwiGLU MLP: `mlp.0` D -> 2 M, `mlp.2` M -> D); no biases, norms without affine.
#[derive(Clone, Debug)]
struct Stream {
    qkv: Linear,
    norm: QkNorm,
    proj: Linear,
    mlp0: Linear,
    mlp2: Linear,
}

impl Stream {
    fn new(vb: &VarBuilder, p: &str, cfg: &Flux2Config) -> Result<Self> {
        let (d, m) = (cfg.hidden_size, cfg.mlp_hidden());
        let attn = vb.pp(format!("{p}_attn"));
        let mlp = vb.pp(format!("{p}_mlp"));
        Ok(Stream {
            qkv: Linear::new(&attn.pp("qkv"), d, 3 * d, false)?,
            norm: QkNorm::new(&attn.pp("norm"), cfg.head_dim(), cfg.eps)?,
            proj: Linear::new(&attn.pp("proj"), d, d, false)?,
            mlp0: Linear::new(&mlp.pp("0"), d, 2 * m, false)?,
            mlp2: Linear::new(&mlp.pp("2"), m, d, false)?,
        })
    }

    /// After attention: x + gate1 proj(a), then x + gate2 mlp(modulate2(norm(x))). With
    /// `frozen_gates` (the modulation needs no gradient), the MLP's output is read by no
    /// gradient of a checkpoint's re-run (`Linear::forward_tail`).
    fn finish(
        &self,
        x: &Tensor,
        (a, rows8): &(Tensor, Option<crate::Rows8>),
        m: &[ModulationOut],
        eps: f64,
        frozen_gates: bool,
    ) -> Result<Tensor> {
        let x = x.add(
            &m[0]
                .gate
                .mul(&self.proj.forward_rows8(a, rows8.as_ref())?)?,
        )?;
        let h = m[1].modulate_into(&x.layer_norm(None, None, eps)?, &self.mlp0)?;
        // SwiGLU: silu(first half) * second half (diffusers `Flux2SwiGLU`, BFL
        // `SiLUActivation`), one fused kernel each way.
        let h = self.mlp2.forward_tail(&h.swiglu()?, frozen_gates)?;
        x.add(&m[1].gate.mul(&h)?)
    }
}

/// Image and text streams with their own weights, joined in one attention (BFL
/// `DoubleStreamBlock`, diffusers `Flux2TransformerBlock`); their modulations are the
/// model's shared ones. Text tokens come first in the joint sequence.
#[derive(Clone, Debug)]
pub struct DoubleStreamBlock {
    img: Stream,
    txt: Stream,
    heads: usize,
    eps: f64,
}

impl DoubleStreamBlock {
    /// The block's weights under `vb` (a `double_blocks.N` prefix).
    pub fn new(vb: &VarBuilder, cfg: &Flux2Config) -> Result<Self> {
        Ok(DoubleStreamBlock {
            img: Stream::new(vb, "img", cfg)?,
            txt: Stream::new(vb, "txt", cfg)?,
            heads: cfg.num_heads,
            eps: cfg.eps,
        })
    }

    /// img (B, L, D), txt (B, T, D), the shared modulations `mod_img`, `mod_txt` (B, 6 D),
    /// pe (B|1, 1, T+L, E/2, 2, 2) -> the new (img, txt), shapes unchanged.
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        mod_img: &Tensor,
        mod_txt: &Tensor,
        pe: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.forward_as(img, txt, mod_img, mod_txt, pe, false)
    }

    /// `forward` as a checkpointed unit of its own (the model's `BlockExec`): where a
    /// stream's modulation needs no gradient, its MLP's output is read by no gradient of
    /// the block's re-run (`Linear::forward_tail`). Only for a call whose outputs are the
    /// checkpoint's.
    pub fn forward_unit(
        &self,
        img: &Tensor,
        txt: &Tensor,
        mod_img: &Tensor,
        mod_txt: &Tensor,
        pe: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.forward_as(img, txt, mod_img, mod_txt, pe, true)
    }

    fn forward_as(
        &self,
        img: &Tensor,
        txt: &Tensor,
        mod_img: &Tensor,
        mod_txt: &Tensor,
        pe: &Tensor,
        unit: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (im, tm) = (triples(mod_img, 2)?, triples(mod_txt, 2)?);
        let norm = |x: &Tensor| x.layer_norm(None, None, self.eps);
        let (iq, ik, iv) = self.img.norm.qkv(
            &im[0].modulate_into(&norm(img)?, &self.img.qkv)?,
            self.heads,
        )?;
        let (tq, tk, tv) = self.txt.norm.qkv(
            &tm[0].modulate_into(&norm(txt)?, &self.txt.qkv)?,
            self.heads,
        )?;
        let q = Tensor::cat(&[&tq, &iq], 2)?;
        let k = Tensor::cat(&[&tk, &ik], 2)?;
        let v = Tensor::cat(&[&tv, &iv], 2)?;
        let o = rope_attention_heads(&q, &k, &v, pe)?;
        let [t_attn, i_attn] = stream_rows(&o, txt.dims()[1], &self.txt.proj, &self.img.proj)?;
        // Each stream's gates are its modulation's: read as given (a checkpoint's forward
        // and its re-run see the same inputs, whatever they compute from them).
        Ok((
            self.img.finish(
                img,
                &i_attn,
                &im,
                self.eps,
                unit && !mod_img.requires_grad(),
            )?,
            self.txt.finish(
                txt,
                &t_attn,
                &tm,
                self.eps,
                unit && !mod_txt.requires_grad(),
            )?,
        ))
    }
}

/// Attention and a SwiGLU MLP in parallel from one fused projection (BFL
/// `SingleStreamBlock`, diffusers `Flux2SingleTransformerBlock`): `linear1` D -> (3 D qkv,
/// 2 M mlp), `linear2` over cat(attention, swiglu(mlp)) (D + M -> D).
#[derive(Clone, Debug)]
pub struct SingleStreamBlock {
    linear1: Linear,
    linear2: Linear,
    norm: QkNorm,
    hidden: usize,
    heads: usize,
    eps: f64,
}

impl SingleStreamBlock {
    /// The block's weights under `vb` (a `single_blocks.N` prefix).
    pub fn new(vb: &VarBuilder, cfg: &Flux2Config) -> Result<Self> {
        let (d, m) = (cfg.hidden_size, cfg.mlp_hidden());
        Ok(SingleStreamBlock {
            linear1: Linear::new(&vb.pp("linear1"), d, 3 * d + 2 * m, false)?,
            linear2: Linear::new(&vb.pp("linear2"), d + m, d, false)?,
            norm: QkNorm::new(&vb.pp("norm"), cfg.head_dim(), cfg.eps)?,
            hidden: d,
            heads: cfg.num_heads,
            eps: cfg.eps,
        })
    }

    /// x (B, T+L, D) joint tokens, the shared modulation `m` (B, 3 D), pe as for
    /// [`DoubleStreamBlock::forward`] -> (B, T+L, D).
    pub fn forward(&self, x: &Tensor, m: &Tensor, pe: &Tensor) -> Result<Tensor> {
        self.forward_as(x, m, pe, false)
    }

    /// `forward` as a checkpointed unit of its own (the model's `BlockExec`): where the
    /// modulation needs no gradient, `linear2`'s output is read by no gradient of the
    /// block's re-run (`Linear::forward_tail`). Only for a call whose output is the
    /// checkpoint's.
    pub fn forward_unit(&self, x: &Tensor, m: &Tensor, pe: &Tensor) -> Result<Tensor> {
        self.forward_as(x, m, pe, true)
    }

    fn forward_as(&self, x: &Tensor, m: &Tensor, pe: &Tensor, unit: bool) -> Result<Tensor> {
        // A gate that needs no gradient reads nothing of `out` in a checkpoint's re-run.
        let frozen_gate = unit && !m.requires_grad();
        let m = triples(m, 1)?;
        let h = m[0].modulate_into(&x.layer_norm(None, None, self.eps)?, &self.linear1)?;
        let (q, k, v, mlp) = self.norm.qkv_rest(&h, self.heads, self.hidden)?;
        let attn = attention(&q, &k, &v, pe)?;
        let out = self
            .linear2
            .forward_tail(&Tensor::cat(&[&attn, &mlp.swiglu()?], 2)?, frozen_gate)?;
        x.add(&m[0].gate.mul(&out)?)
    }
}

/// The final layer (BFL `LastLayer`): `adaLN_modulation.1` -> (shift, scale) of a LayerNorm
/// without affine, then `linear`; no biases.
#[derive(Clone, Debug)]
pub struct FinalLayer {
    /// `D -> 2 D`: (shift, scale) from `silu(vec)`.
    pub ada: Linear,
    /// `D -> out_channels`.
    pub linear: Linear,
    eps: f64,
}

impl FinalLayer {
    fn new(vb: &VarBuilder, cfg: &Flux2Config) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(FinalLayer {
            ada: Linear::new(&vb.pp("adaLN_modulation").pp("1"), d, 2 * d, false)?,
            linear: Linear::new(&vb.pp("linear"), d, cfg.out_channels, false)?,
            eps: cfg.eps,
        })
    }

    /// x (B, L, D), vec_act = silu(vec) (B, D) -> (B, L, out).
    fn forward(&self, x: &Tensor, vec_act: &Tensor) -> Result<Tensor> {
        let m = self.ada.forward(vec_act)?.unsqueeze(1)?.chunk(2, 2)?;
        let x = x.layer_norm(None, None, self.eps)?.modulate(&m[0], &m[1])?;
        self.linear.forward(&x)
    }
}

/// The FLUX.2 transformer (BFL `Flux2`, diffusers `Flux2Transformer2DModel`).
#[derive(Clone, Debug)]
pub struct Flux2 {
    /// The hyperparameters it was built with.
    pub config: Flux2Config,
    /// Packed latents `in_channels -> D`.
    pub img_in: Linear,
    /// Text hidden states `context_in_dim -> D`.
    pub txt_in: Linear,
    /// Timestep embedding: `time_channels` sinusoidal channels -> D.
    pub time_in: MlpEmbedder,
    /// Guidance embedding (FLUX.2 \[dev\]; Klein has none).
    pub guidance_in: Option<MlpEmbedder>,
    /// `lin`: D -> 6 D, every double block's image-stream (shift, scale, gate) x 2.
    pub double_stream_modulation_img: Linear,
    /// `lin`: D -> 6 D, every double block's text stream.
    pub double_stream_modulation_txt: Linear,
    /// `lin`: D -> 3 D, every single block's.
    pub single_stream_modulation: Linear,
    /// The `depth` double-stream blocks.
    pub double_blocks: Vec<DoubleStreamBlock>,
    /// The `depth_single_blocks` single-stream blocks.
    pub single_blocks: Vec<SingleStreamBlock>,
    /// adaLN-modulated norm and projection `D -> out_channels`.
    pub final_layer: FinalLayer,
    pe_embedder: EmbedNd,
    /// How the blocks run: resident, checkpointed or streamed (`Flux2Config::block_prefixes`
    /// names them).
    pub exec: BlockExec,
}

impl Flux2 {
    /// The model with weights from `vb` (BFL key names at its root); blocks run resident.
    pub fn new(vb: &VarBuilder, cfg: &Flux2Config) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        let modulation = |name: &str, triples: usize| {
            Linear::new(&vb.pp(name).pp("lin"), d, 3 * triples * d, false)
        };
        Ok(Flux2 {
            config: cfg.clone(),
            img_in: Linear::new(&vb.pp("img_in"), cfg.in_channels, d, false)?,
            txt_in: Linear::new(&vb.pp("txt_in"), cfg.context_in_dim, d, false)?,
            time_in: MlpEmbedder::new(&vb.pp("time_in"), cfg.time_channels, d, false)?,
            guidance_in: if cfg.guidance_embed {
                Some(MlpEmbedder::new(
                    &vb.pp("guidance_in"),
                    cfg.time_channels,
                    d,
                    false,
                )?)
            } else {
                None
            },
            double_stream_modulation_img: modulation("double_stream_modulation_img", 2)?,
            double_stream_modulation_txt: modulation("double_stream_modulation_txt", 2)?,
            single_stream_modulation: modulation("single_stream_modulation", 1)?,
            double_blocks: (0..cfg.depth)
                .map(|i| DoubleStreamBlock::new(&vb.pp("double_blocks").pp(i), cfg))
                .collect::<Result<_>>()?,
            single_blocks: (0..cfg.depth_single_blocks)
                .map(|i| SingleStreamBlock::new(&vb.pp("single_blocks").pp(i), cfg))
                .collect::<Result<_>>()?,
            final_layer: FinalLayer::new(&vb.pp("final_layer"), cfg)?,
            pe_embedder: EmbedNd {
                theta: cfg.theta,
                axes_dim: cfg.axes_dim.clone(),
            },
            exec: BlockExec::default(),
        })
    }

    /// The conditioning vector `vec` (B, D) in `dtype`: the embedding of `timesteps` (B,) in
    /// [0, 1], plus that of `guidance` (B,) where the model has a guidance embedding (which
    /// then needs it). The modulations and the final layer take `silu(vec)`.
    pub fn conditioning(
        &self,
        dtype: DType,
        timesteps: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = self.config.time_channels;
        let time = |t: &Tensor| -> Result<Tensor> {
            timestep_embedding(t, c, MAX_PERIOD, true, 0.0, TIME_FACTOR)?.to_dtype(dtype)
        };
        let vec = self.time_in.forward(&time(timesteps)?)?;
        match (&self.guidance_in, guidance) {
            (Some(g_in), Some(g)) => vec.add(&g_in.forward(&time(g)?)?),
            (Some(_), None) => Err(Error::invalid(
                "flux2",
                "this FLUX.2 has a guidance embedding and needs a guidance input",
                timesteps.shape(),
            )),
            (None, _) => Ok(vec),
        }
    }

    /// img (B, L, in) packed latents, img_ids (L, 4) or (B, L, 4), txt (B, T, context),
    /// txt_ids (T, 4) or (B, T, 4), timesteps (B,) in [0, 1], guidance (B,) where the model
    /// has a guidance embedding -> (B, L, out).
    pub fn forward(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        timesteps: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.forward_with_references(img, img_ids, None, txt, txt_ids, timesteps, guidance)
    }

    /// [`Flux2::forward`] conditioned on reference tokens `refs` = (tokens (B, N, in), their
    /// position ids (N, 4) or (B, N, 4)), e.g. from [`super::reference_tokens`]: appended
    /// after the image tokens in the joint sequence, they pass through every block as image
    /// tokens do (the image stream's weights, the same timestep), and the prediction is the
    /// image tokens' alone, (B, L, out) (diffusers 0.42.1 `Flux2KleinPipeline.__call__`:
    /// `torch.cat([latents, image_latents], dim=1)`, `torch.cat([latent_ids,
    /// image_latent_ids], dim=1)`, `noise_pred[:, : latents.size(1)]`). Gradients reach the
    /// reference tokens and every weight they pass through.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with_references(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        refs: Option<(&Tensor, &Tensor)>,
        txt: &Tensor,
        txt_ids: &Tensor,
        timesteps: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        if img.rank() != 3 || txt.rank() != 3 || txt.dims()[0] != img.dims()[0] {
            return Err(Error::invalid(
                "flux2",
                format!(
                    "img and txt must be (B, N, C) of one batch, txt is {}",
                    txt.shape()
                ),
                img.shape(),
            ));
        }
        // The image tokens the prediction is made for; the references follow them.
        let (b, l_img) = (img.dims()[0], img.dims()[1]);
        let (img, ids) = match refs {
            None => (img.clone(), cat_ids(b, &[txt_ids, img_ids])?),
            Some((r, r_ids)) => {
                let d = r.dims();
                if d.len() != 3 || d[0] != b || d[2] != img.dims()[2] {
                    return Err(Error::ShapeMismatch {
                        op: "flux2: reference tokens (B, N, in) vs the image tokens",
                        lhs: r.shape().clone(),
                        rhs: img.shape().clone(),
                    });
                }
                (
                    Tensor::cat(&[img, &r.to_dtype(img.dtype())?], 1)?,
                    cat_ids(b, &[txt_ids, img_ids, r_ids])?,
                )
            }
        };
        let img = &img;
        let vec = self.conditioning(img.dtype(), timesteps, guidance)?;
        let pe = self.pe_embedder.forward(&ids)?;
        let mut img = self.img_in.forward(img)?;
        let mut txt = self.txt_in.forward(txt)?;
        // The shared modulations, once for every block.
        let vec_act = vec.silu()?;
        let mod_img = self.double_stream_modulation_img.forward(&vec_act)?;
        let mod_txt = self.double_stream_modulation_txt.forward(&vec_act)?;
        let mod_single = self.single_stream_modulation.forward(&vec_act)?;
        let depth = self.double_blocks.len();
        for (i, block) in self.double_blocks.iter().enumerate() {
            let b = block.clone();
            let out = self.exec.run(
                &format!("double_blocks.{i}"),
                i,
                &[img, txt, mod_img.clone(), mod_txt.clone(), pe.clone()],
                move |xs| {
                    let (img, txt) = b.forward_unit(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4])?;
                    Ok(vec![img, txt])
                },
            )?;
            [img, txt] = outputs::<2>(out, "flux2 double block")?;
        }
        let t_len = txt.dims()[1];
        let mut x = Tensor::cat(&[&txt, &img], 1)?;
        for (i, block) in self.single_blocks.iter().enumerate() {
            let b = block.clone();
            let out = self.exec.run(
                &format!("single_blocks.{i}"),
                depth + i,
                &[x, mod_single.clone(), pe.clone()],
                move |xs| Ok(vec![b.forward_unit(&xs[0], &xs[1], &xs[2])?]),
            )?;
            [x] = outputs::<1>(out, "flux2 single block")?;
        }
        // The final layer works token by token: the image tokens alone.
        let img = x.narrow(1, t_len, l_img)?;
        self.final_layer.forward(&img, &vec_act)
    }
}

/// Position ids laid end to end along the joint sequence (text, image, references), each
/// (N, 4) or (B|1, N, 4): (B|1, sum N, 4), broadcast over the batch of `b` where they differ.
fn cat_ids(b: usize, parts: &[&Tensor]) -> Result<Tensor> {
    let ids = parts
        .iter()
        .map(|&t| {
            let t = if t.rank() == 2 {
                t.unsqueeze(0)?
            } else {
                t.clone()
            };
            let d = t.dims();
            if d.len() != 3 || d[2] != super::AXES || (d[0] != 1 && d[0] != b) {
                return Err(Error::invalid(
                    "flux2",
                    format!("position ids must be (N, 4) or ({b}, N, 4)"),
                    t.shape(),
                ));
            }
            Ok(t)
        })
        .collect::<Result<Vec<_>>>()?;
    let rows = ids[0].dims()[0];
    if ids.iter().all(|t| t.dims()[0] == rows) {
        return Tensor::cat(&ids.iter().collect::<Vec<_>>(), 1);
    }
    let wide = ids
        .iter()
        .map(|t| t.broadcast_as(vec![b, t.dims()[1], t.dims()[2]]))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&wide.iter().collect::<Vec<_>>(), 1)
}
