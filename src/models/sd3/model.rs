//! The MMDiT's blocks, by Stability key path. Shape letters: B batch, C channels, L image
//! tokens, T text tokens, D hidden, H heads, E head dim.

use super::Sd3Config;
use crate::memory::BlockExec;
use crate::models::common::{merge_heads, split_qkv, FinalLayer, EPS};
use crate::nn::{
    modulate_into, scaled_dot_product_attention, timestep_embedding, Conv2d, Conv2dConfig, Linear,
    RmsNorm, VarBuilder,
};
use crate::{DType, Error, Result, Tensor};

/// Sinusoidal timestep channels (Stability `TimestepEmbedder`, frequency_embedding_size 256,
/// cos first, max period 10000).
const TIME_DIM: usize = 256;

/// `mlp.0` -> SiLU -> `mlp.2` (the t and y embedders).
#[derive(Clone, Debug)]
struct Embedder {
    l0: Linear,
    l2: Linear,
}

impl Embedder {
    fn new(vb: &VarBuilder, in_dim: usize, hidden: usize) -> Result<Self> {
        let vb = vb.pp("mlp");
        Ok(Embedder {
            l0: Linear::new(&vb.pp("0"), in_dim, hidden, true)?,
            l2: Linear::new(&vb.pp("2"), hidden, hidden, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.l2.forward(&self.l0.forward(x)?.silu()?)
    }
}

/// `qkv`, optional `ln_q` / `ln_k` (RMSNorm, eps 1e-6), optional `proj` (absent in the
/// pre-only context stream).
#[derive(Clone, Debug)]
struct Attention {
    qkv: Linear,
    ln: Option<(RmsNorm, RmsNorm)>,
    proj: Option<Linear>,
    heads: usize,
}

impl Attention {
    fn new(vb: &VarBuilder, cfg: &Sd3Config, proj: bool) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(Attention {
            qkv: Linear::new(&vb.pp("qkv"), d, 3 * d, true)?,
            ln: if cfg.qk_norm {
                let e = cfg.head_dim();
                Some((
                    RmsNorm::new(&vb.pp("ln_q"), e, EPS)?,
                    RmsNorm::new(&vb.pp("ln_k"), e, EPS)?,
                ))
            } else {
                None
            },
            proj: if proj {
                Some(Linear::new(&vb.pp("proj"), d, d, true)?)
            } else {
                None
            },
            heads: cfg.num_heads,
        })
    }

    /// modulate(x, shift, scale) (x (B, N, D)) -> q, k, v (B, H, N, E).
    fn qkv(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = split_qkv(&modulate_into(x, shift, scale, &self.qkv)?, self.heads)?;
        match &self.ln {
            Some((lq, lk)) => Ok((lq.forward(&q)?, lk.forward(&k)?, v)),
            None => Ok((q, k, v)),
        }
    }

    fn proj(&self, x: &Tensor) -> Result<Tensor> {
        match &self.proj {
            Some(p) => p.forward(x),
            None => Ok(x.clone()),
        }
    }
}

fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    merge_heads(&scaled_dot_product_attention(q, k, v, None, false, None)?)
}

/// `mlp.fc1` -> tanh GELU -> `mlp.fc2`.
#[derive(Clone, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(vb: &VarBuilder, cfg: &Sd3Config) -> Result<Self> {
        let (d, m) = (cfg.hidden_size, cfg.mlp_hidden());
        Ok(Mlp {
            fc1: Linear::new(&vb.pp("fc1"), d, m, true)?,
            fc2: Linear::new(&vb.pp("fc2"), m, d, true)?,
        })
    }

    /// fc2(gelu_tanh(fc1(modulate(x, shift, scale)))).
    fn forward_modulated(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        self.fc2
            .forward_gelu_tanh(&modulate_into(x, shift, scale, &self.fc1)?)
    }
}

/// One stream of a joint block (Stability `DismantledBlock`): `adaLN_modulation.1` gives 6
/// (shift, scale, gate for attention and MLP), 9 with the dual attention `attn2`, or 2
/// (shift, scale) in the pre-only last context stream, which has no proj and no MLP.
#[derive(Clone, Debug)]
struct Stream {
    ada: Linear,
    attn: Attention,
    attn2: Option<Attention>,
    mlp: Option<Mlp>,
}

impl Stream {
    fn new(vb: &VarBuilder, cfg: &Sd3Config, pre_only: bool, dual: bool) -> Result<Self> {
        let d = cfg.hidden_size;
        let n = if pre_only {
            2
        } else if dual {
            9
        } else {
            6
        };
        Ok(Stream {
            ada: Linear::new(&vb.pp("adaLN_modulation").pp("1"), d, n * d, true)?,
            attn: Attention::new(&vb.pp("attn"), cfg, !pre_only)?,
            attn2: if dual {
                Some(Attention::new(&vb.pp("attn2"), cfg, true)?)
            } else {
                None
            },
            mlp: if pre_only {
                None
            } else {
                Some(Mlp::new(&vb.pp("mlp"), cfg)?)
            },
        })
    }

    /// The modulation chunks, each (B, 1, D), from c_act = silu(c).
    fn mods(&self, c: &Tensor) -> Result<Vec<Tensor>> {
        let out = self.ada.forward(c)?.unsqueeze(1)?;
        let n = out.dims()[2] / c.dims()[1];
        out.chunk(n, 2)
    }

    /// After the joint attention: x + gate * proj(a), the dual attention, then the MLP.
    fn post(&self, x: &Tensor, xn: &Tensor, a: &Tensor, m: &[Tensor]) -> Result<Tensor> {
        let mut x = x.add(&m[2].mul(&self.attn.proj(a)?)?)?;
        if let Some(attn2) = &self.attn2 {
            let (q, k, v) = attn2.qkv(xn, &m[6], &m[7])?;
            x = x.add(&m[8].mul(&attn2.proj(&sdpa(&q, &k, &v)?)?)?)?;
        }
        let Some(mlp) = &self.mlp else {
            return Ok(x);
        };
        let h = mlp.forward_modulated(&x.layer_norm(None, None, EPS)?, &m[3], &m[4])?;
        x.add(&m[5].mul(&h)?)
    }
}

/// Image (`x_block`) and text (`context_block`) streams attending jointly (Stability
/// `JointBlock`).
#[derive(Clone, Debug)]
pub struct JointBlock {
    x_block: Stream,
    context_block: Stream,
    pre_only: bool,
}

impl JointBlock {
    /// Block `index` of the model, weights under `vb` (a `joint_blocks.N` prefix); the last
    /// block's context stream is pre-only, and `dual_attention_layers` get a second attention.
    pub fn new(vb: &VarBuilder, cfg: &Sd3Config, index: usize) -> Result<Self> {
        let pre_only = index + 1 == cfg.depth;
        let dual = cfg.dual_attention_layers.contains(&index);
        Ok(JointBlock {
            x_block: Stream::new(&vb.pp("x_block"), cfg, false, dual)?,
            context_block: Stream::new(&vb.pp("context_block"), cfg, pre_only, false)?,
            pre_only,
        })
    }

    /// context (B, T, D), x (B, L, D), c_act = silu(c) (B, D) -> (context or None after
    /// the last, x).
    pub fn forward(
        &self,
        context: &Tensor,
        x: &Tensor,
        c_act: &Tensor,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let xm = self.x_block.mods(c_act)?;
        let cm = self.context_block.mods(c_act)?;
        let xn = x.layer_norm(None, None, EPS)?;
        let cn = context.layer_norm(None, None, EPS)?;
        let (xq, xk, xv) = self.x_block.attn.qkv(&xn, &xm[0], &xm[1])?;
        let (cq, ck, cv) = self.context_block.attn.qkv(&cn, &cm[0], &cm[1])?;
        let q = Tensor::cat(&[&cq, &xq], 2)?;
        let k = Tensor::cat(&[&ck, &xk], 2)?;
        let v = Tensor::cat(&[&cv, &xv], 2)?;
        let a = sdpa(&q, &k, &v)?;
        let t = context.dims()[1];
        let (ca, xa) = (a.narrow(1, 0, t)?, a.narrow(1, t, x.dims()[1])?);
        let x = self.x_block.post(x, &xn, &xa, &xm)?;
        if self.pre_only {
            return Ok((None, x));
        }
        let context = self.context_block.post(context, &cn, &ca, &cm)?;
        Ok((Some(context), x))
    }
}

/// The SD3 / SD3.5 MMDiT (Stability `MMDiTX`).
#[derive(Clone, Debug)]
pub struct Sd3 {
    /// The hyperparameters it was built with.
    pub config: Sd3Config,
    x_embedder: Conv2d,
    pos_embed: Tensor,
    t_embedder: Embedder,
    y_embedder: Embedder,
    context_embedder: Linear,
    /// The `depth` joint blocks.
    pub joint_blocks: Vec<JointBlock>,
    final_layer: FinalLayer,
    /// How the joint blocks run (`Sd3Config::block_prefixes` names them).
    pub exec: BlockExec,
}

impl Sd3 {
    /// The model with weights from `vb` (Stability key names at its root, prefix stripped);
    /// blocks run resident.
    pub fn new(vb: &VarBuilder, cfg: &Sd3Config) -> Result<Self> {
        cfg.validate()?;
        let (d, p) = (cfg.hidden_size, cfg.patch_size);
        let m = cfg.pos_embed_max_size;
        Ok(Sd3 {
            config: cfg.clone(),
            x_embedder: Conv2d::new(
                &vb.pp("x_embedder").pp("proj"),
                cfg.in_channels,
                d,
                p,
                Conv2dConfig {
                    stride: p,
                    ..Default::default()
                },
            )?,
            pos_embed: vb.get((1, m * m, d), "pos_embed")?,
            t_embedder: Embedder::new(&vb.pp("t_embedder"), TIME_DIM, d)?,
            y_embedder: Embedder::new(&vb.pp("y_embedder"), cfg.pooled_dim, d)?,
            context_embedder: Linear::new(&vb.pp("context_embedder"), cfg.context_dim, d, true)?,
            joint_blocks: (0..cfg.depth)
                .map(|i| JointBlock::new(&vb.pp("joint_blocks").pp(i), cfg, i))
                .collect::<Result<_>>()?,
            final_layer: FinalLayer::new(&vb.pp("final_layer"), d, p * p * cfg.out_channels)?,
            exec: BlockExec::default(),
        })
    }

    /// The centre h x w crop of the position table (Stability `cropped_pos_embed`):
    /// (1, h w, D).
    fn cropped_pos_embed(&self, h: usize, w: usize) -> Result<Tensor> {
        let m = self.config.pos_embed_max_size;
        if h > m || w > m {
            return Err(Error::invalid(
                "sd3",
                format!("a {h} x {w} patch grid exceeds pos_embed_max_size {m}"),
                self.pos_embed.shape(),
            ));
        }
        let d = self.config.hidden_size;
        self.pos_embed
            .reshape(vec![1, m, m, d])?
            .narrow(1, (m - h) / 2, h)?
            .narrow(2, (m - w) / 2, w)?
            .reshape((1, h * w, d))
    }

    /// The conditioning `c` (B, D) in `dtype`: the embeddings of `timesteps` (B,) in [0,
    /// 1000) and of the pooled text `y` (B, pooled), summed. The blocks' modulations take
    /// `silu(c)`.
    pub fn conditioning(&self, dtype: DType, timesteps: &Tensor, y: &Tensor) -> Result<Tensor> {
        let t =
            timestep_embedding(timesteps, TIME_DIM, 10_000.0, true, 0.0, 1.0)?.to_dtype(dtype)?;
        self.t_embedder
            .forward(&t)?
            .add(&self.y_embedder.forward(y)?)
    }

    /// x (B, C, H, W) latents, timesteps (B,) in [0, 1000), context (B, T, context_dim),
    /// y (B, pooled_dim) -> (B, out, H, W).
    pub fn forward(
        &self,
        x: &Tensor,
        timesteps: &Tensor,
        context: &Tensor,
        y: &Tensor,
    ) -> Result<Tensor> {
        let p = self.config.patch_size;
        let dims = x.dims().to_vec();
        if dims.len() != 4 || dims[2] % p != 0 || dims[3] % p != 0 {
            return Err(Error::invalid(
                "sd3",
                format!("latents must be (B, C, H, W) with H and W multiples of {p}"),
                x.shape(),
            ));
        }
        let (b, h, w) = (dims[0], dims[2] / p, dims[3] / p);
        let tokens = self
            .x_embedder
            .forward(x)?
            .flatten(2, 3)?
            .transpose(1, 2)?
            .add(&self.cropped_pos_embed(h, w)?.to_dtype(x.dtype())?)?;
        let c = self.conditioning(x.dtype(), timesteps, y)?;
        let mut context = Some(self.context_embedder.forward(context)?);
        let mut x = tokens;
        // Once for every block's modulation (one input for their host-held products).
        let c_act = c.silu()?;
        for (i, block) in self.joint_blocks.iter().enumerate() {
            let ctx = context
                .ok_or_else(|| Error::invalid("sd3", "a pre-only block is not last", x.shape()))?;
            let b = block.clone();
            let out = self.exec.run(
                &format!("joint_blocks.{i}"),
                i,
                &[ctx, x, c_act.clone()],
                move |xs| {
                    let (context, x) = b.forward(&xs[0], &xs[1], &xs[2])?;
                    Ok(match context {
                        Some(context) => vec![x, context],
                        None => vec![x],
                    })
                },
            )?;
            let mut out = out.into_iter();
            x = out
                .next()
                .ok_or_else(|| Error::Autograd("sd3 joint block gave no output".into()))?;
            context = out.next();
        }
        let out = self.final_layer.forward(&x, &c)?;
        let co = self.config.out_channels;
        out.reshape(vec![b, h, w, p, p, co])?
            .permute(&[0, 5, 1, 3, 2, 4])?
            .reshape((b, co, h * p, w * p))
    }
}
