//! Flux's blocks, by BFL key path. Shape letters: B batch, L image tokens, T text tokens,
//! D hidden, H heads, E head dim (D = H E).

use super::FluxConfig;
use crate::memory::BlockExec;
use crate::models::common::{
    outputs, rope_attention_heads, stream_rows, FinalLayer, MlpEmbedder, QkNorm, EPS,
};
use crate::nn::{timestep_embedding, EmbedNd, Linear, Modulation, VarBuilder};
use crate::{DType, Error, Result, Tensor};

/// Timestep and guidance embeddings: 256 sinusoidal channels (BFL `timestep_embedding`,
/// `time_factor` 1000, cos first).
const TIME_DIM: usize = 256;
const TIME_FACTOR: f64 = 1000.0;

/// One stream of a double block: `{img,txt}_mod`, `_norm1/2` (no affine), `_attn.{qkv,norm,
/// proj}`, `_mlp.{0,2}` with tanh GELU.
#[derive(Clone, Debug)]
struct Stream {
    modulation: Modulation,
    qkv: Linear,
    norm: QkNorm,
    proj: Linear,
    mlp0: Linear,
    mlp2: Linear,
}

impl Stream {
    fn new(vb: &VarBuilder, p: &str, cfg: &FluxConfig) -> Result<Self> {
        let (d, m) = (cfg.hidden_size, cfg.mlp_hidden());
        let attn = vb.pp(format!("{p}_attn"));
        let mlp = vb.pp(format!("{p}_mlp"));
        Ok(Stream {
            modulation: Modulation::new(&vb.pp(format!("{p}_mod")), d, true)?,
            qkv: Linear::new(&attn.pp("qkv"), d, 3 * d, cfg.qkv_bias)?,
            norm: QkNorm::new(&attn.pp("norm"), cfg.head_dim(), EPS)?,
            proj: Linear::new(&attn.pp("proj"), d, d, true)?,
            mlp0: Linear::new(&mlp.pp("0"), d, m, true)?,
            mlp2: Linear::new(&mlp.pp("2"), m, d, true)?,
        })
    }
}

/// Image and text streams with their own weights, joined in one attention (BFL
/// `DoubleStreamBlock`). Text tokens come first in the joint sequence.
#[derive(Clone, Debug)]
pub struct DoubleStreamBlock {
    img: Stream,
    txt: Stream,
    heads: usize,
}

impl DoubleStreamBlock {
    /// The block's weights under `vb` (a `double_blocks.N` prefix).
    pub fn new(vb: &VarBuilder, cfg: &FluxConfig) -> Result<Self> {
        Ok(DoubleStreamBlock {
            img: Stream::new(vb, "img", cfg)?,
            txt: Stream::new(vb, "txt", cfg)?,
            heads: cfg.num_heads,
        })
    }

    /// img (B, L, D), txt (B, T, D), vec_act = silu(vec) (B, D), pe (B|1, 1, T+L, E/2, 2,
    /// 2) -> the new (img, txt), shapes unchanged.
    pub fn forward(
        &self,
        img: &Tensor,
        txt: &Tensor,
        vec_act: &Tensor,
        pe: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let im = self.img.modulation.forward_activated(vec_act)?;
        let tm = self.txt.modulation.forward_activated(vec_act)?;
        let norm = |x: &Tensor| x.layer_norm(None, None, EPS);
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
        type Rows = (Tensor, Option<crate::Rows8>);
        let stream = |s: &Stream, x: &Tensor, (a, r8): &Rows, m: &[crate::nn::ModulationOut]| {
            let x = x.add(&m[0].gate.mul(&s.proj.forward_rows8(a, r8.as_ref())?)?)?;
            let h = m[1].modulate_into(&norm(&x)?, &s.mlp0)?;
            x.add(&m[1].gate.mul(&s.mlp2.forward_gelu_tanh(&h)?)?)
        };
        Ok((
            stream(&self.img, img, &i_attn, &im)?,
            stream(&self.txt, txt, &t_attn, &tm)?,
        ))
    }
}

/// Attention and MLP in parallel from one fused projection (BFL `SingleStreamBlock`):
/// `linear1` -> (qkv, mlp), `linear2` over cat(attention, gelu_tanh(mlp)).
#[derive(Clone, Debug)]
pub struct SingleStreamBlock {
    modulation: Modulation,
    linear1: Linear,
    linear2: Linear,
    norm: QkNorm,
    hidden: usize,
    heads: usize,
}

impl SingleStreamBlock {
    /// The block's weights under `vb` (a `single_blocks.N` prefix).
    pub fn new(vb: &VarBuilder, cfg: &FluxConfig) -> Result<Self> {
        let (d, m) = (cfg.hidden_size, cfg.mlp_hidden());
        Ok(SingleStreamBlock {
            modulation: Modulation::new(&vb.pp("modulation"), d, false)?,
            linear1: Linear::new(&vb.pp("linear1"), d, 3 * d + m, true)?,
            linear2: Linear::new(&vb.pp("linear2"), d + m, d, true)?,
            norm: QkNorm::new(&vb.pp("norm"), cfg.head_dim(), EPS)?,
            hidden: d,
            heads: cfg.num_heads,
        })
    }

    /// x (B, T+L, D) joint tokens, vec_act = silu(vec) (B, D), pe as for
    /// [`DoubleStreamBlock::forward`] -> (B, T+L, D).
    pub fn forward(&self, x: &Tensor, vec_act: &Tensor, pe: &Tensor) -> Result<Tensor> {
        let m = self.modulation.forward_activated(vec_act)?;
        let h = m[0].modulate_into(&x.layer_norm(None, None, EPS)?, &self.linear1)?;
        let (q, k, v, mlp) = self.norm.qkv_rest(&h, self.heads, self.hidden)?;
        // Attention's heads merged as linear2's input is written (with GELU of the MLP part).
        let o = rope_attention_heads(&q, &k, &v, pe)?;
        let out = self
            .linear2
            .forward_cat_gelu_tanh(&o.transpose(1, 2)?, &mlp)?;
        x.add(&m[0].gate.mul(&out)?)
    }
}

/// The Flux transformer (BFL `Flux`).
#[derive(Clone, Debug)]
pub struct Flux {
    /// The hyperparameters it was built with.
    pub config: FluxConfig,
    /// Packed latents `in_channels -> D`.
    pub img_in: Linear,
    /// Timestep embedding: 256 sinusoidal channels -> D.
    pub time_in: MlpEmbedder,
    /// Pooled text `vec_in_dim -> D`.
    pub vector_in: MlpEmbedder,
    /// Guidance embedding, 256 sinusoidal channels -> D (dev only).
    pub guidance_in: Option<MlpEmbedder>,
    /// Text tokens `context_in_dim -> D`.
    pub txt_in: Linear,
    /// The `depth` double-stream blocks.
    pub double_blocks: Vec<DoubleStreamBlock>,
    /// The `depth_single_blocks` single-stream blocks.
    pub single_blocks: Vec<SingleStreamBlock>,
    /// adaLN-modulated norm and projection `D -> out_channels`.
    pub final_layer: FinalLayer,
    pe_embedder: EmbedNd,
    /// How the blocks run: resident, checkpointed or streamed (`FluxConfig::block_prefixes`
    /// names them).
    pub exec: BlockExec,
}

impl Flux {
    /// The model with weights from `vb` (BFL key names at its root); blocks run resident.
    pub fn new(vb: &VarBuilder, cfg: &FluxConfig) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.hidden_size;
        Ok(Flux {
            config: cfg.clone(),
            img_in: Linear::new(&vb.pp("img_in"), cfg.in_channels, d, true)?,
            time_in: MlpEmbedder::new(&vb.pp("time_in"), TIME_DIM, d, true)?,
            vector_in: MlpEmbedder::new(&vb.pp("vector_in"), cfg.vec_in_dim, d, true)?,
            guidance_in: if cfg.guidance_embed {
                Some(MlpEmbedder::new(&vb.pp("guidance_in"), TIME_DIM, d, true)?)
            } else {
                None
            },
            txt_in: Linear::new(&vb.pp("txt_in"), cfg.context_in_dim, d, true)?,
            double_blocks: (0..cfg.depth)
                .map(|i| DoubleStreamBlock::new(&vb.pp("double_blocks").pp(i), cfg))
                .collect::<Result<_>>()?,
            single_blocks: (0..cfg.depth_single_blocks)
                .map(|i| SingleStreamBlock::new(&vb.pp("single_blocks").pp(i), cfg))
                .collect::<Result<_>>()?,
            final_layer: FinalLayer::new(&vb.pp("final_layer"), d, cfg.out_channels)?,
            pe_embedder: EmbedNd {
                theta: cfg.theta,
                axes_dim: cfg.axes_dim.clone(),
            },
            exec: BlockExec::default(),
        })
    }

    /// The conditioning vector `vec` (B, D) in `dtype`: the embeddings of `timesteps` (B,)
    /// in [0, 1], of `guidance` (B,) for dev, and of the pooled text `y` (B, vec), summed.
    /// The blocks' modulations take `silu(vec)`.
    pub fn conditioning(
        &self,
        dtype: DType,
        timesteps: &Tensor,
        y: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        let time = |t: &Tensor| -> Result<Tensor> {
            timestep_embedding(t, TIME_DIM, 10_000.0, true, 0.0, TIME_FACTOR)?.to_dtype(dtype)
        };
        let mut vec = self.time_in.forward(&time(timesteps)?)?;
        match (&self.guidance_in, guidance) {
            (Some(g_in), Some(g)) => vec = vec.add(&g_in.forward(&time(g)?)?)?,
            (Some(_), None) => {
                return Err(Error::invalid(
                    "flux",
                    "this Flux (dev) needs a guidance input",
                    timesteps.shape(),
                ))
            }
            (None, _) => {}
        }
        vec.add(&self.vector_in.forward(y)?)
    }

    /// img (B, L, in) packed latents, img_ids (L, 3) or (B, L, 3), txt (B, T, context),
    /// txt_ids (T, 3) or (B, T, 3), timesteps (B,) in [0, 1], y (B, vec) pooled text,
    /// guidance (B,) for dev -> (B, L, out).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        img: &Tensor,
        img_ids: &Tensor,
        txt: &Tensor,
        txt_ids: &Tensor,
        timesteps: &Tensor,
        y: &Tensor,
        guidance: Option<&Tensor>,
    ) -> Result<Tensor> {
        let bad = |msg: String, t: &Tensor| Err(Error::invalid("flux", msg, t.shape()));
        if img.rank() != 3 || txt.rank() != 3 {
            return bad("img and txt must be (B, N, C)".into(), img);
        }
        let vec = self.conditioning(img.dtype(), timesteps, y, guidance)?;
        let ids = |t: &Tensor| {
            if t.rank() == 2 {
                t.unsqueeze(0)
            } else {
                Ok(t.clone())
            }
        };
        let (img_ids, txt_ids) = (ids(img_ids)?, ids(txt_ids)?);
        let ids = if img_ids.dims()[0] == txt_ids.dims()[0] {
            Tensor::cat(&[&txt_ids, &img_ids], 1)?
        } else {
            let b = img.dims()[0];
            let expand = |t: &Tensor| {
                let d = t.dims();
                t.broadcast_as(vec![b, d[1], d[2]])
            };
            Tensor::cat(&[&expand(&txt_ids)?, &expand(&img_ids)?], 1)?
        };
        let pe = self.pe_embedder.forward(&ids)?;
        let mut img = self.img_in.forward(img)?;
        let mut txt = self.txt_in.forward(txt)?;
        let depth = self.double_blocks.len();
        // Once for every block's modulation (one input for their host-held products).
        let vec_act = vec.silu()?;
        for (i, block) in self.double_blocks.iter().enumerate() {
            let b = block.clone();
            let out = self.exec.run(
                &format!("double_blocks.{i}"),
                i,
                &[img, txt, vec_act.clone(), pe.clone()],
                move |xs| {
                    let (img, txt) = b.forward(&xs[0], &xs[1], &xs[2], &xs[3])?;
                    Ok(vec![img, txt])
                },
            )?;
            [img, txt] = outputs::<2>(out, "flux double block")?;
        }
        let t_len = txt.dims()[1];
        let mut x = Tensor::cat(&[&txt, &img], 1)?;
        for (i, block) in self.single_blocks.iter().enumerate() {
            let b = block.clone();
            let out = self.exec.run(
                &format!("single_blocks.{i}"),
                depth + i,
                &[x, vec_act.clone(), pe.clone()],
                move |xs| Ok(vec![b.forward(&xs[0], &xs[1], &xs[2])?]),
            )?;
            [x] = outputs::<1>(out, "flux single block")?;
        }
        let img = x.narrow(1, t_len, img.dims()[1])?;
        self.final_layer.forward(&img, &vec)
    }
}
