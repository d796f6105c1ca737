//! Z-Image's blocks and model, by original key path. Shape letters: B batch, L image tokens
//! (Lp padded), T caption tokens (Tp padded), D hidden, H heads, E head dim, A adaLN width.
//!
//! The sequences, as diffusers' `patchify_and_embed`, `_pad_with_ids`, `_prepare_sequence`
//! and `_build_unified_sequence` make them for one sample whose caption has `n` tokens:
//! - caption: the `n` embedded tokens, then `cap_pad_token` up to `np = ceil32(n)`; token j
//!   at position (1 + j, 0, 0) (pad tokens too);
//! - image: the L patch tokens, then `x_pad_token` up to `Lp = ceil32(L)`; patch (r, c) at
//!   position (np + 1, r, c), pad tokens at (0, 0, 0). The image's pad tokens are attended
//!   to like the others (diffusers masks only the batch's padding);
//! - the main layers run over [image (Lp), caption (np)].
//!
//! A FLAME batch holds B samples of one latent size with captions right-padded to T tokens
//! and a mask. Every sample's caption sequence is laid out over `Tp = ceil32(T)` slots: its
//! `np` tokens as above, then slots that no query sees (a key padding mask), which is what
//! diffusers' `pad_sequence` plus attention mask does for the shorter captions of a batch.
//! Attention sums over the same keys at the same positions for every kept token, so each
//! sample's output equals diffusers' for that sample; the hidden slots' outputs are dropped.

use super::{ZImageConfig, SEQ_MULTI_OF, T_FREQ, T_MID};
use crate::memory::BlockExec;
use crate::models::common::{merge_heads, outputs, split_qkv};
use crate::nn::{
    scaled_dot_product_attention, timestep_embedding, EmbedNd, Linear, RmsNorm, VarBuilder,
};
use crate::{DType, Device, Error, Result, Tensor, TensorId};
use std::sync::{Arc, Mutex};

/// Epsilon of the attention's QK RMSNorms: diffusers builds them with `Attention(...,
/// qk_norm="rms_norm", eps=1e-5)` whatever `norm_eps` is (`ZImageTransformerBlock`).
const QK_EPS: f64 = 1e-5;
/// Epsilon of the final layer's LayerNorm (`FinalLayer`: `nn.LayerNorm(hidden_size,
/// elementwise_affine=False, eps=1e-6)`).
const FINAL_EPS: f64 = 1e-6;

fn ceil_to(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// Latents (B, C, H, W) -> patch tokens (B, H/p * W/p, p p C), row-major over the patch grid,
/// channel-last inside a token (diffusers `_patchify_image` with one frame: `(C, F, pF, H,
/// pH, W, pW) -> (F, H, W, pF, pH, pW, C)`).
pub fn patchify(latents: &Tensor, p: usize) -> Result<Tensor> {
    let d = latents.dims();
    if d.len() != 4 || p == 0 || d[2] % p != 0 || d[3] % p != 0 {
        return Err(Error::invalid(
            "zimage patchify",
            format!("needs (B, C, H, W) with H and W multiples of {p}"),
            latents.shape(),
        ));
    }
    let (b, c, h, w) = (d[0], d[1], d[2] / p, d[3] / p);
    latents
        .reshape(vec![b, c, h, p, w, p])?
        .permute(&[0, 2, 4, 3, 5, 1])?
        .reshape((b, h * w, p * p * c))
}

/// The inverse of [`patchify`]: tokens (B, h*w, p p C) -> latents (B, C, h p, w p)
/// (diffusers `unpatchify`).
pub fn unpatchify(tokens: &Tensor, h: usize, w: usize, p: usize) -> Result<Tensor> {
    let d = tokens.dims();
    if d.len() != 3 || d[1] != h * w || p == 0 || d[2] % (p * p) != 0 {
        return Err(Error::invalid(
            "zimage unpatchify",
            format!("needs (B, {h}*{w}, {p}*{p}*C) tokens"),
            tokens.shape(),
        ));
    }
    let (b, c) = (d[0], d[2] / (p * p));
    tokens
        .reshape(vec![b, h, w, p, p, c])?
        .permute(&[0, 5, 1, 3, 2, 4])?
        .reshape((b, c, h * p, w * p))
}

/// Self-attention with QK RMSNorm and RoPE (diffusers `Attention` run by
/// `ZSingleStreamAttnProcessor`): `qkv` (no bias), `q_norm` / `k_norm` over E, `out` (no
/// bias).
#[derive(Clone, Debug)]
struct Attention {
    qkv: Linear,
    out: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: usize,
}

impl Attention {
    fn new(vb: &VarBuilder, cfg: &ZImageConfig) -> Result<Self> {
        let (d, e) = (cfg.dim, cfg.head_dim());
        let norm = |name: &str| -> Result<Option<RmsNorm>> {
            cfg.qk_norm
                .then(|| RmsNorm::new(&vb.pp(name), e, QK_EPS))
                .transpose()
        };
        Ok(Attention {
            qkv: Linear::new(&vb.pp("qkv"), d, 3 * d, false)?,
            out: Linear::new(&vb.pp("out"), d, d, false)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            heads: cfg.n_heads,
        })
    }

    /// x (B, N, D), pe (B, 1, N, E/2, 2, 2), mask (B, N) of keys to see -> (B, N, D).
    fn forward(&self, x: &Tensor, pe: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (q, k, v) = split_qkv(&self.qkv.forward(x)?, self.heads)?;
        let norm = |n: &Option<RmsNorm>, t: Tensor| match n {
            Some(n) => n.forward(&t),
            None => Ok(t),
        };
        let q = norm(&self.q_norm, q)?.apply_rope(pe)?;
        let k = norm(&self.k_norm, k)?.apply_rope(pe)?;
        let o = scaled_dot_product_attention(&q, &k, &v, mask, false, None)?;
        self.out.forward(&merge_heads(&o)?)
    }
}

/// SwiGLU: `w2(silu(w1 x) * w3 x)`, no biases (diffusers `FeedForward`).
#[derive(Clone, Debug)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl FeedForward {
    fn new(vb: &VarBuilder, cfg: &ZImageConfig) -> Result<Self> {
        let (d, h) = (cfg.dim, cfg.ffn_hidden());
        Ok(FeedForward {
            w1: Linear::new(&vb.pp("w1"), d, h, false)?,
            w2: Linear::new(&vb.pp("w2"), h, d, false)?,
            w3: Linear::new(&vb.pp("w3"), d, h, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.w1.forward(x)?.silu()?.mul(&self.w3.forward(x)?)?;
        self.w2.forward(&h)
    }
}

/// One transformer block (diffusers `ZImageTransformerBlock`): pre- and post-RMSNorms around
/// attention and the SwiGLU, modulated by `adaLN_modulation.0` (the noise refiner and the main
/// layers) or not (the context refiner).
#[derive(Clone, Debug)]
pub struct ZImageBlock {
    attention: Attention,
    feed_forward: FeedForward,
    attention_norm1: RmsNorm,
    attention_norm2: RmsNorm,
    ffn_norm1: RmsNorm,
    ffn_norm2: RmsNorm,
    /// `adaLN_modulation.0`: A -> 4 D (scale_msa, gate_msa, scale_mlp, gate_mlp), no
    /// activation before it.
    modulation: Option<Linear>,
}

impl ZImageBlock {
    /// The block's weights under `vb` (`layers.N`, `noise_refiner.N`: `modulated`;
    /// `context_refiner.N`: not).
    pub fn new(vb: &VarBuilder, cfg: &ZImageConfig, modulated: bool) -> Result<Self> {
        let (d, eps) = (cfg.dim, cfg.norm_eps);
        let norm = |name: &str| RmsNorm::new(&vb.pp(name), d, eps);
        Ok(ZImageBlock {
            attention: Attention::new(&vb.pp("attention"), cfg)?,
            feed_forward: FeedForward::new(&vb.pp("feed_forward"), cfg)?,
            attention_norm1: norm("attention_norm1")?,
            attention_norm2: norm("attention_norm2")?,
            ffn_norm1: norm("ffn_norm1")?,
            ffn_norm2: norm("ffn_norm2")?,
            modulation: modulated
                .then(|| {
                    Linear::new(
                        &vb.pp("adaLN_modulation").pp("0"),
                        cfg.adaln_dim(),
                        4 * d,
                        true,
                    )
                })
                .transpose()?,
        })
    }

    /// x (B, N, D), c (B, A) the timestep embedding (modulated blocks only), pe (B, 1, N,
    /// E/2, 2, 2), mask (B, N) of keys to see (none: all) -> (B, N, D):
    /// `x += gate_msa * norm2(attn(norm1(x) * (1 + scale_msa)))`, then
    /// `x += gate_mlp * ffn_norm2(ffn(ffn_norm1(x) * (1 + scale_mlp)))`, gates through tanh.
    pub fn forward(
        &self,
        x: &Tensor,
        c: Option<&Tensor>,
        pe: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let m = match (&self.modulation, c) {
            (Some(lin), Some(c)) => Some(lin.forward(c)?.unsqueeze(1)?.chunk(4, 2)?),
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::invalid(
                    "zimage block",
                    "a modulated block needs the timestep embedding",
                    x.shape(),
                ))
            }
        };
        let scaled = |h: Tensor, i: usize| match &m {
            Some(m) => h.mul(&m[i].affine(1.0, 1.0)?),
            None => Ok(h),
        };
        let gated = |h: Tensor, i: usize| match &m {
            Some(m) => m[i].tanh()?.mul(&h),
            None => Ok(h),
        };
        let a = self
            .attention
            .forward(&scaled(self.attention_norm1.forward(x)?, 0)?, pe, mask)?;
        let x = x.add(&gated(self.attention_norm2.forward(&a)?, 1)?)?;
        let f = self
            .feed_forward
            .forward(&scaled(self.ffn_norm1.forward(&x)?, 2)?)?;
        x.add(&gated(self.ffn_norm2.forward(&f)?, 3)?)
    }
}

/// How one batch's sequences are laid out (module docs).
struct Layout {
    /// Caption tokens per sample (the mask's ones).
    n: Vec<usize>,
    /// Those rounded up to a multiple of 32.
    np: Vec<usize>,
    /// Caption slots of every sample: ceil32(T).
    tp: usize,
    /// Patch grid (rows, columns), image tokens and their padded count.
    grid: (usize, usize),
    l: usize,
    lp: usize,
}

impl Layout {
    /// The caption tokens of each row of the mask (B, T): 1s (at least one) then 0s.
    fn lengths(mask: &Tensor) -> Result<Vec<usize>> {
        let t = mask.dims()[1];
        let v = mask.to_vec_f64()?;
        let mut n = Vec::with_capacity(mask.dims()[0]);
        for row in v.chunks(t.max(1)) {
            let k = row.iter().take_while(|&&x| x != 0.0).count();
            if k == 0 || row[k..].iter().any(|&x| x != 0.0) {
                return Err(Error::invalid(
                    "zimage",
                    "each row of the caption mask must be ones (at least one) then zeros",
                    mask.shape(),
                ));
            }
            n.push(k);
        }
        Ok(n)
    }

    /// From the caption lengths `n` of a mask (B, T) and the patch grid.
    fn new(n: Vec<usize>, mask: &Tensor, grid: (usize, usize), cfg: &ZImageConfig) -> Result<Self> {
        let t = mask.dims()[1];
        let np: Vec<usize> = n.iter().map(|&k| ceil_to(k, SEQ_MULTI_OF)).collect();
        let tp = ceil_to(t, SEQ_MULTI_OF);
        let l = grid.0 * grid.1;
        // diffusers looks positions up in tables of `axes_lens` rows: the image's frame
        // position np + 1 and its rows and columns must lie inside them.
        let lens = &cfg.axes_lens;
        let frame = np.iter().max().copied().unwrap_or(0) + 1;
        if frame >= lens[0] || grid.0 >= lens[1] || grid.1 >= lens[2] {
            return Err(Error::invalid(
                "zimage",
                format!(
                    "positions (caption {frame}, grid {}x{}) exceed axes_lens {lens:?}",
                    grid.0, grid.1
                ),
                mask.shape(),
            ));
        }
        Ok(Layout {
            n,
            np,
            tp,
            grid,
            l,
            lp: ceil_to(l, SEQ_MULTI_OF),
        })
    }

    fn batch(&self) -> usize {
        self.n.len()
    }

    /// Position ids of the image tokens (B, Lp, 3) and of the caption slots (B, Tp, 3).
    fn ids(&self, dev: &Device) -> Result<(Tensor, Tensor)> {
        let (b, w) = (self.batch(), self.grid.1);
        let mut img = Vec::with_capacity(b * self.lp * 3);
        let mut cap = Vec::with_capacity(b * self.tp * 3);
        for &np in &self.np {
            for j in 0..self.lp {
                if j < self.l {
                    img.extend([(np + 1) as f32, (j / w) as f32, (j % w) as f32]);
                } else {
                    img.extend([0.0, 0.0, 0.0]);
                }
            }
            for j in 0..self.tp {
                cap.extend([(j + 1) as f32, 0.0, 0.0]);
            }
        }
        Ok((
            Tensor::from_vec(img, (b, self.lp, 3), dev)?,
            Tensor::from_vec(cap, (b, self.tp, 3), dev)?,
        ))
    }

    /// 1 where a caption slot holds a caption token, 0 where it holds the pad token
    /// (B, Tp, 1).
    fn tokens(&self, dtype: DType, dev: &Device) -> Result<Tensor> {
        let v: Vec<f32> = self
            .n
            .iter()
            .flat_map(|&k| (0..self.tp).map(move |j| f32::from(u8::from(j < k))))
            .collect();
        Tensor::from_vec(v, (self.batch(), self.tp, 1), dev)?.to_dtype(dtype)
    }

    /// The caption slots' key mask (B, Tp) and the main layers' (B, Lp + Tp), or none when
    /// every sample's caption fills the slots.
    fn masks(&self, dev: &Device) -> Result<Option<(Tensor, Tensor)>> {
        if self.np.iter().all(|&np| np == self.tp) {
            return Ok(None);
        }
        let b = self.batch();
        let cap: Vec<f32> = self
            .np
            .iter()
            .flat_map(|&np| (0..self.tp).map(move |j| f32::from(u8::from(j < np))))
            .collect();
        let joint: Vec<f32> = cap
            .chunks(self.tp)
            .flat_map(|row| std::iter::repeat_n(1.0, self.lp).chain(row.iter().copied()))
            .collect();
        Ok(Some((
            Tensor::from_vec(cap, (b, self.tp), dev)?,
            Tensor::from_vec(joint, (b, self.lp + self.tp), dev)?,
        )))
    }
}

/// A caption mask's identity and its rows' lengths.
type MaskLengths = (TensorId, Vec<usize>);

/// The Z-Image transformer (diffusers `ZImageTransformer2DModel`, text-to-image).
#[derive(Clone, Debug)]
pub struct ZImage {
    /// The hyperparameters it was built with.
    pub config: ZImageConfig,
    /// Patch tokens `p p C -> D` (`x_embedder`).
    pub x_embedder: Linear,
    /// Timestep MLP `t_embedder.mlp.{0,2}`: 256 sinusoidal channels -> 1024 -> A.
    pub t_mlp0: Linear,
    /// See `t_mlp0`.
    pub t_mlp2: Linear,
    /// Caption embedder: RMSNorm over `cap_feat_dim` (`cap_embedder.0`), then `cap_feat_dim
    /// -> D` (`cap_embedder.1`).
    pub cap_norm: RmsNorm,
    /// See `cap_norm`.
    pub cap_linear: Linear,
    /// The image's pad token (1, D).
    pub x_pad_token: Tensor,
    /// The caption's pad token (1, D).
    pub cap_pad_token: Tensor,
    /// The image tokens' refiner blocks (modulated).
    pub noise_refiner: Vec<ZImageBlock>,
    /// The caption tokens' refiner blocks (unmodulated).
    pub context_refiner: Vec<ZImageBlock>,
    /// The main blocks over [image, caption].
    pub layers: Vec<ZImageBlock>,
    /// `final_layer.adaLN_modulation.1`: A -> D, over silu(c), a scale only.
    pub final_ada: Linear,
    /// `final_layer.linear`: D -> p p C.
    pub final_linear: Linear,
    rope: EmbedNd,
    /// The last caption mask read back from the device (its identity) and its rows'
    /// lengths. Every denoising step of a sample hands the model the same mask, and reading
    /// it again would wait for all the work queued before it. A mask is never written in
    /// place.
    lengths: Arc<Mutex<Option<MaskLengths>>>,
    /// How the blocks run: resident, checkpointed or streamed
    /// (`ZImageConfig::block_prefixes` names them).
    pub exec: BlockExec,
}

impl ZImage {
    /// The model with weights from `vb` (original key names at its root); blocks run resident.
    pub fn new(vb: &VarBuilder, cfg: &ZImageConfig) -> Result<Self> {
        cfg.validate()?;
        let (d, a) = (cfg.dim, cfg.adaln_dim());
        let blocks = |name: &str, modulated: bool, n: usize| -> Result<Vec<ZImageBlock>> {
            (0..n)
                .map(|i| ZImageBlock::new(&vb.pp(name).pp(i), cfg, modulated))
                .collect()
        };
        let t = vb.pp("t_embedder").pp("mlp");
        let cap = vb.pp("cap_embedder");
        let fl = vb.pp("final_layer");
        Ok(ZImage {
            config: cfg.clone(),
            x_embedder: Linear::new(&vb.pp("x_embedder"), cfg.patch_channels(), d, true)?,
            t_mlp0: Linear::new(&t.pp("0"), T_FREQ, T_MID, true)?,
            t_mlp2: Linear::new(&t.pp("2"), T_MID, a, true)?,
            cap_norm: RmsNorm::new(&cap.pp("0"), cfg.cap_feat_dim, cfg.norm_eps)?,
            cap_linear: Linear::new(&cap.pp("1"), cfg.cap_feat_dim, d, true)?,
            x_pad_token: vb.get((1, d), "x_pad_token")?,
            cap_pad_token: vb.get((1, d), "cap_pad_token")?,
            noise_refiner: blocks("noise_refiner", true, cfg.n_refiner_layers)?,
            context_refiner: blocks("context_refiner", false, cfg.n_refiner_layers)?,
            layers: blocks("layers", true, cfg.n_layers)?,
            final_ada: Linear::new(&fl.pp("adaLN_modulation").pp("1"), a, d, true)?,
            final_linear: Linear::new(&fl.pp("linear"), d, cfg.patch_channels(), true)?,
            rope: EmbedNd {
                theta: cfg.rope_theta,
                axes_dim: cfg.axes_dims.clone(),
            },
            lengths: Arc::default(),
            exec: BlockExec::default(),
        })
    }

    /// The caption lengths of `mask` (B, T), read from the device once per mask.
    fn caption_lengths(&self, mask: &Tensor) -> Result<Vec<usize>> {
        let mut memo = self.lengths.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((id, n)) = memo.as_ref() {
            if *id == mask.id() {
                return Ok(n.clone());
            }
        }
        let n = Layout::lengths(mask)?;
        *memo = Some((mask.id(), n.clone()));
        Ok(n)
    }

    /// The adaLN input c (B, A) in `dtype` for the model's timesteps `t` (B,): the MLP over
    /// the sinusoidal embedding of `t * t_scale` (cos first; `TimestepEmbedder`), no
    /// activation after it. The model's t runs from 0 (noise) to 1 (data): the pipeline
    /// passes `(1000 - scheduler_t) / 1000 = 1 - sigma`.
    pub fn conditioning(&self, dtype: DType, t: &Tensor) -> Result<Tensor> {
        let f = timestep_embedding(t, T_FREQ, 10_000.0, true, 0.0, self.config.t_scale)?
            .to_dtype(dtype)?;
        self.t_mlp2.forward(&self.t_mlp0.forward(&f)?.silu()?)
    }

    /// latents (B, C, H, W), t (B,) the model's timesteps (1 - sigma), cap (B, T,
    /// cap_feat_dim) the text encoder's hidden states right-padded to T, cap_mask (B, T) 1
    /// for a caption's tokens -> the model's raw output (B, C, H, W), which points from
    /// the noise to the data (the pipeline negates it for the scheduler).
    pub fn forward(
        &self,
        latents: &Tensor,
        t: &Tensor,
        cap: &Tensor,
        cap_mask: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (ld, cd, md) = (latents.dims(), cap.dims(), cap_mask.dims());
        let ok = ld.len() == 4
            && ld[1] == cfg.in_channels
            && cd.len() == 3
            && cd[2] == cfg.cap_feat_dim
            && md.len() == 2
            && md[..] == cd[..2]
            && cd[0] == ld[0]
            && t.dims() == [ld[0]];
        if !ok {
            return Err(Error::invalid(
                "zimage",
                format!(
                    "takes latents (B, {}, H, W), t (B,), captions (B, T, {}) and a mask \
                     (B, T); captions are {cd:?}, the mask {md:?}, t {:?}",
                    cfg.in_channels,
                    cfg.cap_feat_dim,
                    t.dims()
                ),
                latents.shape(),
            ));
        }
        let (dtype, dev, p) = (latents.dtype(), latents.device(), cfg.patch_size);
        let grid = (ld[2] / p, ld[3] / p);
        let lay = Layout::new(self.caption_lengths(cap_mask)?, cap_mask, grid, cfg)?;
        let (b, d) = (ld[0], cfg.dim);
        let c = self.conditioning(dtype, t)?;
        let (img_ids, cap_ids) = lay.ids(dev)?;
        let (pe_x, pe_cap) = (self.rope.forward(&img_ids)?, self.rope.forward(&cap_ids)?);
        let pe_joint = Tensor::cat(&[&pe_x, &pe_cap], 2)?;
        let masks = lay.masks(dev)?;

        // Image tokens, then `x_pad_token` up to Lp.
        let mut x = self.x_embedder.forward(&patchify(latents, p)?)?;
        if lay.lp > lay.l {
            let pad = self
                .x_pad_token
                .reshape((1, 1, d))?
                .broadcast_as((b, lay.lp - lay.l, d))?;
            x = Tensor::cat(&[&x, &pad], 1)?;
        }
        let n = cfg.n_refiner_layers;
        for (i, block) in self.noise_refiner.iter().enumerate() {
            let blk = block.clone();
            let out = self.exec.run(
                &format!("noise_refiner.{i}"),
                i,
                &[x, c.clone(), pe_x.clone()],
                move |xs| Ok(vec![blk.forward(&xs[0], Some(&xs[1]), &xs[2], None)?]),
            )?;
            [x] = outputs::<1>(out, "zimage noise refiner block")?;
        }

        // Caption tokens over Tp slots: a caption's tokens, then `cap_pad_token`.
        let mut txt = self.cap_linear.forward(&self.cap_norm.forward(cap)?)?;
        let t_len = cd[1];
        if lay.tp > t_len {
            let zeros = Tensor::zeros((b, lay.tp - t_len, d), txt.dtype(), dev)?;
            txt = Tensor::cat(&[&txt, &zeros], 1)?;
        }
        let keep = lay.tokens(txt.dtype(), dev)?;
        let pad = self
            .cap_pad_token
            .reshape((1, 1, d))?
            .mul(&keep.affine(-1.0, 1.0)?)?;
        txt = txt.mul(&keep)?.add(&pad)?;
        for (i, block) in self.context_refiner.iter().enumerate() {
            let blk = block.clone();
            let mut inputs = vec![txt, pe_cap.clone()];
            inputs.extend(masks.as_ref().map(|m| m.0.clone()));
            let out =
                self.exec
                    .run(&format!("context_refiner.{i}"), n + i, &inputs, move |xs| {
                        Ok(vec![blk.forward(&xs[0], None, &xs[1], xs.get(2))?])
                    })?;
            [txt] = outputs::<1>(out, "zimage context refiner block")?;
        }

        let mut u = Tensor::cat(&[&x, &txt], 1)?;
        for (i, block) in self.layers.iter().enumerate() {
            let blk = block.clone();
            let mut inputs = vec![u, c.clone(), pe_joint.clone()];
            inputs.extend(masks.as_ref().map(|m| m.1.clone()));
            let out = self
                .exec
                .run(&format!("layers.{i}"), 2 * n + i, &inputs, move |xs| {
                    Ok(vec![blk.forward(
                        &xs[0],
                        Some(&xs[1]),
                        &xs[2],
                        xs.get(3),
                    )?])
                })?;
            [u] = outputs::<1>(out, "zimage layer")?;
        }

        // The final layer is per token: only the image's own tokens are needed.
        let img = u.narrow(1, 0, lay.l)?;
        let scale = self.final_ada.forward(&c.silu()?)?.affine(1.0, 1.0)?;
        let img = img
            .layer_norm(None, None, FINAL_EPS)?
            .mul(&scale.unsqueeze(1)?)?;
        unpatchify(&self.final_linear.forward(&img)?, grid.0, grid.1, p)
    }
}
