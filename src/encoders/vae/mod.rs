//! The KL autoencoder (diffusers `AutoencoderKL`, and `AutoencoderKLFlux2`) of SDXL, SD3 /
//! SD3.5, Flux and FLUX.2: images in
//! [-1, 1] to latents and back. [`AutoencoderKl::encode`] gives the posterior (mean and
//! clamped log-variance), [`AutoencoderKl::encode_latents`] the scaled latents the diffusion
//! model trains on (FLUX.2's patched 2x2 and normalized by the autoencoder's batch-norm
//! statistics, [`PatchNorm`]), [`AutoencoderKl::decode_latents`] the image from them. Large images can
//! be encoded and decoded in overlapping tiles blended as diffusers' `tiled_encode` /
//! `tiled_decode` do ([`VaeTiling`]).
//!
//! Weights load from a diffusers `vae/` folder (config.json beside
//! `diffusion_pytorch_model.safetensors`) or a single `.safetensors` file in either layout
//! ([`VaeLayout`]): BFL's `ae.safetensors`, or a full SDXL / SD3.5 checkpoint whose
//! autoencoder sits under `first_stage_model.`.
//!
//! ```no_run
//! use flame::encoders::{AutoencoderKl, VaeKind};
//! use flame::{DType, Device, Tensor};
//!
//! let dev = Device::Cpu;
//! // BFL's file has no config: the family fixes the latent scaling.
//! let (vae, _) = AutoencoderKl::load("ae.safetensors", None, Some(VaeKind::Flux),
//!                                     DType::BF16, &dev, None)?;
//! let image = Tensor::zeros((1, 3, 1024, 1024), DType::BF16, &dev)?; // in [-1, 1]
//! let latents = vae.encode_latents(&image)?; // (1, 16, 128, 128)
//! let back = vae.decode_latents(&latents)?; // (1, 3, 1024, 1024)
//! # Ok::<(), flame::Error>(())
//! ```

mod blocks;
mod config;

pub use config::{vae_key_map, LatentScaling, PatchNorm, VaeConfig, VaeKind, VaeLayout};

use super::{ck_err, detect_prefix, prefixes_with, read_json};
use crate::nn::{Conv2d, Conv2dConfig, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use blocks::{Decoder, Encoder};
use std::path::{Path, PathBuf};

/// The encoder's posterior: a diagonal Gaussian per latent element.
#[derive(Clone, Debug)]
pub struct LatentDist {
    /// (B, latent, h, w).
    pub mean: Tensor,
    /// (B, latent, h, w), clamped to [-30, 20] (diffusers `DiagonalGaussianDistribution`).
    pub logvar: Tensor,
}

impl LatentDist {
    /// From moments (B, 2 * latent, h, w): the mean's channels first, then the log-variance's.
    fn from_moments(m: &Tensor) -> Result<Self> {
        let c = m.dims()[1] / 2;
        Ok(LatentDist {
            mean: m.narrow(1, 0, c)?,
            logvar: m.narrow(1, c, c)?.clamp(-30.0, 20.0)?,
        })
    }

    /// The standard deviation `exp(logvar / 2)`.
    pub fn std(&self) -> Result<Tensor> {
        self.logvar.affine(0.5, 0.0)?.exp()
    }

    /// `mean + std * eps` with eps ~ N(0, 1) drawn from `seed` (the same seed gives the same
    /// draw on the same device).
    pub fn sample(&self, seed: u64) -> Result<Tensor> {
        let m = &self.mean;
        let eps = Tensor::randn_normal(0.0, 1.0, m.shape().clone(), m.dtype(), m.device(), seed)?;
        m.add(&self.std()?.mul(&eps)?)
    }
}

/// Tiled encoding and decoding (diffusers' `tiled_encode` / `tiled_decode`): the image is
/// cut into `tile` x `tile` pixel tiles (the latent into `tile / 2^(levels - 1)` tiles),
/// starting every `tile * (1 - overlap)`; each is encoded (decoded) alone, each output tile
/// is blended linearly with the one above and the one to its left over `overlap` of its
/// size, and the first `(1 - overlap)` of each is kept. Peak memory then follows the tile,
/// not the image; the result differs from the untiled one near tile borders and wherever
/// the mid-block attention (global over the image) would have seen other tiles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VaeTiling {
    /// Tile side in image pixels (diffusers `tile_sample_min_size`, the config's
    /// `sample_size`: 1024 for SDXL, SD3.5 and Flux). Images no larger than a tile on both
    /// sides run untiled.
    pub tile: usize,
    /// The fraction of a tile shared with its neighbour (diffusers `tile_overlap_factor`).
    pub overlap: f64,
}

impl VaeTiling {
    /// `tile`-pixel tiles with diffusers' overlap of 0.25.
    pub fn new(tile: usize) -> Self {
        VaeTiling {
            tile,
            overlap: 0.25,
        }
    }
}

/// The autoencoder with its weights.
#[derive(Clone, Debug)]
pub struct AutoencoderKl {
    /// The sizes and scaling it was built with.
    pub config: VaeConfig,
    /// When set, [`encode`](Self::encode) and [`decode`](Self::decode) tile inputs larger
    /// than a tile.
    pub tiling: Option<VaeTiling>,
    encoder: Encoder,
    decoder: Decoder,
    quant_conv: Option<Conv2d>,
    post_quant_conv: Option<Conv2d>,
    /// FLUX.2's batch-norm statistics of the patched latents: the mean and
    /// `sqrt(var + eps)`, (1, C * patch², 1, 1) f32.
    patch_stats: Option<(Tensor, Tensor)>,
}

/// The weight file of a VAE and its parsed config.json, if it has one.
fn locate(path: &Path, prefixed: bool) -> Result<(PathBuf, Option<(serde_json::Value, PathBuf)>)> {
    if path.is_file() {
        let config = match prefixed {
            true => None,
            false => super::file_config(path)?,
        };
        return Ok((path.to_path_buf(), config.map(|c| (c, path.to_path_buf()))));
    }
    if !path.is_dir() {
        return Err(ck_err(path, "no such file or folder"));
    }
    let config = path.join("config.json");
    let config = if config.is_file() {
        Some((read_json(&config)?, config))
    } else {
        None
    };
    for name in [
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.fp16.safetensors",
    ] {
        let f = path.join(name);
        if f.is_file() {
            return Ok((f, config));
        }
    }
    Err(ck_err(
        path,
        "holds no diffusion_pytorch_model.safetensors (a pipeline's vae/ folder, or give a \
         .safetensors file)",
    ))
}

/// Every autoencoder among `keys` (a file's keys as stored, sorted): its prefix and layout.
pub(crate) fn vae_candidates(keys: &[String]) -> Vec<(String, VaeLayout)> {
    prefixes_with(keys, "encoder.conv_in.weight")
        .into_iter()
        .filter_map(|p| {
            let has = |k: &str| keys.binary_search(&format!("{p}{k}")).is_ok();
            let layout = if has("encoder.down_blocks.0.resnets.0.conv1.weight") {
                VaeLayout::Diffusers
            } else if has("encoder.down.0.block.0.conv1.weight") {
                VaeLayout::Ldm
            } else {
                return None;
            };
            Some((p, layout))
        })
        .collect()
}

impl AutoencoderKl {
    /// The model from `vb` at its root (diffusers' key paths, through [`vae_key_map`]).
    pub fn new(vb: &VarBuilder, cfg: &VaeConfig) -> Result<Self> {
        let two = 2 * cfg.latent_channels;
        let one_by_one =
            |name: &str, c: usize| Conv2d::new(&vb.pp(name), c, c, 1, Conv2dConfig::default());
        Ok(AutoencoderKl {
            encoder: Encoder::new(&vb.pp("encoder"), cfg)?,
            decoder: Decoder::new(&vb.pp("decoder"), cfg)?,
            quant_conv: match cfg.use_quant_conv {
                true => Some(one_by_one("quant_conv", two)?),
                false => None,
            },
            post_quant_conv: match cfg.use_post_quant_conv {
                true => Some(one_by_one("post_quant_conv", cfg.latent_channels)?),
                false => None,
            },
            patch_stats: match cfg.patch_norm {
                Some(p) => {
                    let c = cfg.diffusion_channels();
                    let bn = vb.pp("bn");
                    let stat = |name: &str| -> Result<Tensor> {
                        bn.get(c, name)?.to_dtype(DType::F32)?.reshape((1, c, 1, 1))
                    };
                    let std = stat("running_var")?.affine(1.0, p.eps)?.sqrt()?;
                    Some((stat("running_mean")?, std))
                }
                None => None,
            },
            config: cfg.clone(),
            tiling: None,
        })
    }

    /// Loads an autoencoder from `path`: a diffusers `vae/` folder or a single .safetensors
    /// file in either layout (found by its keys). In a file holding several, `prefix` picks
    /// one (e.g. `"first_stage_model."`). `kind`, when given, sets the latent scaling
    /// (over config.json's); `config` overrides config.json and the shape inference of
    /// [`VaeConfig::from_shapes`], which needs `kind` for 16-channel files.
    pub fn load(
        path: impl AsRef<Path>,
        prefix: Option<&str>,
        kind: Option<VaeKind>,
        dtype: DType,
        device: &Device,
        config: Option<VaeConfig>,
    ) -> Result<(Self, VarBuilder)> {
        let path = path.as_ref();
        let (file, json) = locate(path, prefix.is_some())?;
        let raw = VarBuilder::from_files(&[&file], dtype, device)?;
        let config = match (config, json) {
            (Some(c), _) => Some(c),
            (None, Some((j, p))) => Some(VaeConfig::from_json(&j, Some(&p))?),
            (None, None) => None,
        };
        Self::load_from(raw, path, prefix, kind, config)
    }

    /// What [`load`](Self::load) does once the file is open: `raw` is a builder over the
    /// checkpoint's keys as stored (no key map), `origin` the file or folder they came from
    /// (named in errors). Finds the autoencoder's prefix and layout by its keys, maps them,
    /// takes `config` or infers one from the shapes, applies `kind`'s scaling, and builds the
    /// model. Any source works: tensors in memory, or [`VarBuilder::from_shapes`] to check a
    /// layout without its weights.
    pub fn load_from(
        raw: VarBuilder,
        origin: &Path,
        prefix: Option<&str>,
        kind: Option<VaeKind>,
        config: Option<VaeConfig>,
    ) -> Result<(Self, VarBuilder)> {
        let keys = raw.source_keys();
        let candidates = vae_candidates(&keys);
        let (prefix, layout) = detect_prefix(origin, "VAE", candidates, prefix)?;
        let level = |i: usize| match layout {
            VaeLayout::Diffusers => {
                format!("{prefix}encoder.down_blocks.{i}.resnets.0.conv1.weight")
            }
            VaeLayout::Ldm => format!("{prefix}encoder.down.{i}.block.0.conv1.weight"),
        };
        let levels = (0..)
            .take_while(|&i| keys.binary_search(&level(i)).is_ok())
            .count();
        let vb = raw.with_key_map(vae_key_map(layout, &prefix, levels))?;
        let cfg = match config {
            Some(c) => c,
            None => VaeConfig::from_shapes(&vb, kind)?,
        };
        let cfg = match kind {
            Some(k) => VaeConfig {
                scaling: k.scaling(),
                ..cfg
            },
            None => cfg,
        };
        if cfg.block_out_channels.len() != levels {
            return Err(ck_err(
                origin,
                format!(
                    "holds {levels} encoder levels under '{prefix}', the config has {}",
                    cfg.block_out_channels.len()
                ),
            ));
        }
        let model = Self::new(&vb, &cfg)?;
        Ok((model, vb))
    }

    fn check(&self, what: &'static str, x: &Tensor, channels: usize) -> Result<()> {
        match x.dims() {
            &[_, c, h, w] if c == channels && h > 0 && w > 0 => Ok(()),
            _ => Err(Error::invalid(
                what,
                format!("needs (B, {channels}, H, W)"),
                x.shape(),
            )),
        }
    }

    /// The encoder and `quant_conv` on one image (or tile): moments (B, 2 * latent, h, w).
    fn moments(&self, x: &Tensor) -> Result<Tensor> {
        let m = self.encoder.forward(x)?;
        match &self.quant_conv {
            Some(q) => q.forward(&m),
            None => Ok(m),
        }
    }

    fn decode_one(&self, z: &Tensor) -> Result<Tensor> {
        match &self.post_quant_conv {
            Some(p) => self.decoder.forward(&p.forward(z)?),
            None => self.decoder.forward(z),
        }
    }

    /// Image (B, 3, H, W) in [-1, 1] -> the posterior over latents (B, latent, h, w), with
    /// h = H / f rounded as the stride-2 convs do (exact for multiples of f =
    /// 2^(levels - 1), 8 in the released VAEs). Tiled when [`tiling`](Self::tiling) is set
    /// and the image is larger than a tile.
    pub fn encode(&self, x: &Tensor) -> Result<LatentDist> {
        self.check("AutoencoderKl::encode", x, self.config.in_channels)?;
        let (h, w) = (x.dims()[2], x.dims()[3]);
        let moments = match self.tiling {
            Some(t) if h > t.tile || w > t.tile => {
                let f = self.config.downscale();
                self.tiled(x, t.tile, t.tile / f, t.overlap, |t| self.moments(t))?
            }
            _ => self.moments(x)?,
        };
        LatentDist::from_moments(&moments)
    }

    /// [`encode`](Self::encode) with explicit tiling (even when the image fits one tile).
    pub fn encode_tiled(&self, x: &Tensor, tiling: VaeTiling) -> Result<LatentDist> {
        self.check("AutoencoderKl::encode_tiled", x, self.config.in_channels)?;
        let f = self.config.downscale();
        let moments = self.tiled(x, tiling.tile, tiling.tile / f, tiling.overlap, |t| {
            self.moments(t)
        })?;
        LatentDist::from_moments(&moments)
    }

    /// Latents (B, latent, h, w) as the encoder gives them (unscaled) -> image
    /// (B, 3, h * f, w * f). Tiled when [`tiling`](Self::tiling) is set and the latent is
    /// larger than a tile's.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check("AutoencoderKl::decode", z, self.config.latent_channels)?;
        let (h, w) = (z.dims()[2], z.dims()[3]);
        match self.tiling {
            Some(t)
                if h > t.tile / self.config.downscale() || w > t.tile / self.config.downscale() =>
            {
                self.decode_tiled(z, t)
            }
            _ => self.decode_one(z),
        }
    }

    /// [`decode`](Self::decode) with explicit tiling (even when the latent fits one tile).
    pub fn decode_tiled(&self, z: &Tensor, tiling: VaeTiling) -> Result<Tensor> {
        self.check(
            "AutoencoderKl::decode_tiled",
            z,
            self.config.latent_channels,
        )?;
        let f = self.config.downscale();
        self.tiled(z, tiling.tile / f, tiling.tile, tiling.overlap, |t| {
            self.decode_one(t)
        })
    }

    /// Encoder latents -> diffusion latents: `(z - shift) * scale`; FLUX.2's are patched
    /// and normalized instead ([`PatchNorm`]): (B, C, h, w) -> (B, C * p², h / p, w / p).
    pub fn scale_latents(&self, z: &Tensor) -> Result<Tensor> {
        if let (Some(p), Some((mean, std))) = (self.config.patch_norm, &self.patch_stats) {
            self.check(
                "AutoencoderKl::scale_latents",
                z,
                self.config.latent_channels,
            )?;
            let x = patchify(z, p.patch)?;
            let dt = x.dtype();
            return x.sub(&mean.to_dtype(dt)?)?.div(&std.to_dtype(dt)?);
        }
        let LatentScaling { scale, shift } = self.config.scaling;
        z.affine(scale, -shift * scale)
    }

    /// Diffusion latents -> encoder latents: `latents / scale + shift`; FLUX.2's are
    /// denormalized and unpatched.
    pub fn unscale_latents(&self, latents: &Tensor) -> Result<Tensor> {
        if let (Some(p), Some((mean, std))) = (self.config.patch_norm, &self.patch_stats) {
            let c = self.config.diffusion_channels();
            self.check("AutoencoderKl::unscale_latents", latents, c)?;
            let dt = latents.dtype();
            let x = latents.mul(&std.to_dtype(dt)?)?.add(&mean.to_dtype(dt)?)?;
            return unpatchify(&x, p.patch);
        }
        let LatentScaling { scale, shift } = self.config.scaling;
        latents.affine(1.0 / scale, shift)
    }

    /// Image -> diffusion latents from the posterior's mean (its mode, deterministic).
    pub fn encode_latents(&self, x: &Tensor) -> Result<Tensor> {
        self.scale_latents(&self.encode(x)?.mean)
    }

    /// Image -> diffusion latents from a sample of the posterior drawn from `seed`.
    pub fn encode_latents_sampled(&self, x: &Tensor, seed: u64) -> Result<Tensor> {
        self.scale_latents(&self.encode(x)?.sample(seed)?)
    }

    /// Diffusion latents -> image in [-1, 1] (not clamped).
    pub fn decode_latents(&self, latents: &Tensor) -> Result<Tensor> {
        self.decode(&self.unscale_latents(latents)?)
    }

    /// `f` on overlapping `tile_in` tiles of x (B, C, H, W), whose `tile_out`-sized outputs
    /// are blended and cropped as diffusers' tiled_encode / tiled_decode do. Tiles start every
    /// `floor(tile_in (1 - overlap))`; each output is blended in place with the (already
    /// blended) one above, then the one to its left, over `floor(tile_out overlap)` rows /
    /// columns, and its first `tile_out - blend` rows and columns are kept.
    fn tiled(
        &self,
        x: &Tensor,
        tile_in: usize,
        tile_out: usize,
        overlap: f64,
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let step = (tile_in as f64 * (1.0 - overlap)) as usize;
        let blend = (tile_out as f64 * overlap) as usize;
        if !(0.0..1.0).contains(&overlap) || step == 0 || tile_out <= blend {
            return Err(Error::invalid(
                "AutoencoderKl tiling",
                format!(
                    "tile {tile_in} -> {tile_out} with overlap {overlap} leaves no tile to \
                     keep (the image tile must be at least 2 * 2^(levels - 1))"
                ),
                x.shape(),
            ));
        }
        let keep = tile_out - blend;
        let (h, w) = (x.dims()[2], x.dims()[3]);
        let mut rows: Vec<Vec<Tensor>> = vec![];
        for i in (0..h).step_by(step) {
            let mut row = vec![];
            for j in (0..w).step_by(step) {
                let t = x
                    .narrow(2, i, tile_in.min(h - i))?
                    .narrow(3, j, tile_in.min(w - j))?;
                row.push(f(&t)?);
            }
            rows.push(row);
        }
        for i in 0..rows.len() {
            for j in 0..rows[i].len() {
                let mut t = rows[i][j].clone();
                if i > 0 {
                    t = blend_edge(&rows[i - 1][j], &t, blend, 2)?;
                }
                if j > 0 {
                    t = blend_edge(&rows[i][j - 1], &t, blend, 3)?;
                }
                rows[i][j] = t;
            }
        }
        let mut out_rows = vec![];
        for row in &rows {
            let cropped = row
                .iter()
                .map(|t| {
                    let d = t.dims();
                    t.narrow(2, 0, keep.min(d[2]))?.narrow(3, 0, keep.min(d[3]))
                })
                .collect::<Result<Vec<_>>>()?;
            out_rows.push(Tensor::cat(&cropped.iter().collect::<Vec<_>>(), 3)?);
        }
        Tensor::cat(&out_rows.iter().collect::<Vec<_>>(), 2)
    }
}

/// (B, C, h, w) -> (B, C * p², h / p, w / p), channel `c * p² + dy * p + dx` holding pixel
/// (dy, dx) of each patch (diffusers `Flux2Pipeline._patchify_latents`).
fn patchify(z: &Tensor, p: usize) -> Result<Tensor> {
    let &[b, c, h, w] = z.dims() else {
        return Err(Error::invalid("patchify", "needs (B, C, H, W)", z.shape()));
    };
    if h % p != 0 || w % p != 0 {
        return Err(Error::invalid(
            "patchify",
            format!("latent height and width must be multiples of the patch {p}"),
            z.shape(),
        ));
    }
    z.reshape(vec![b, c, h / p, p, w / p, p])?
        .permute(&[0, 1, 3, 5, 2, 4])?
        .reshape((b, c * p * p, h / p, w / p))
}

/// The inverse of [`patchify`] (diffusers `Flux2Pipeline._unpatchify_latents`).
fn unpatchify(x: &Tensor, p: usize) -> Result<Tensor> {
    let &[b, c, h, w] = x.dims() else {
        return Err(Error::invalid(
            "unpatchify",
            "needs (B, C, H, W)",
            x.shape(),
        ));
    };
    x.reshape(vec![b, c / (p * p), p, p, h, w])?
        .permute(&[0, 1, 4, 2, 5, 3])?
        .reshape((b, c / (p * p), h * p, w * p))
}

/// b with its first `extent` rows (dim 2) or columns (dim 3) replaced by a linear blend from
/// the last `extent` of a: row y gets `a[-extent + y] (1 - y / extent) + b[y] y / extent`
/// (diffusers `blend_v` / `blend_h`), with extent capped by both sizes.
fn blend_edge(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let (na, nb) = (a.dims()[dim], b.dims()[dim]);
    let e = extent.min(na).min(nb);
    if e == 0 {
        return Ok(b.clone());
    }
    let mut shape = vec![1usize; 4];
    shape[dim] = e;
    let ramp = |f: fn(f64) -> f64| {
        let v: Vec<f64> = (0..e).map(|y| f(y as f64 / e as f64)).collect();
        Tensor::from_vec(v, shape.clone(), b.device())?.to_dtype(b.dtype())
    };
    let (keep_a, keep_b) = (ramp(|r| 1.0 - r)?, ramp(|r| r)?);
    let mixed = a
        .narrow(dim, na - e, e)?
        .mul(&keep_a)?
        .add(&b.narrow(dim, 0, e)?.mul(&keep_b)?)?;
    Tensor::cat(&[&mixed, &b.narrow(dim, e, nb - e)?], dim)
}
