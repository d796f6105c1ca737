//! One adapter per diffusers projection of a fused layer ([`AdapterConfig::per_projection`]):
//! Flux's `linear1` (to_q, to_k, to_v, proj_mlp), its attention's `qkv`, SD3's `qkv`. Each
//! projection's rows of the fused weight get an adapter of their own, of the kind's own
//! factorisation over (rows, in), as PEFT builds it on diffusers' separate Linears; the fused
//! layer's change is theirs stacked by rows (halves swapped back where diffusers swaps them):
//!
//! ΔW = [ΔW_1; ΔW_2; ...], ΔW_i (rows_i, in) the change of projection i's adapter.
//!
//! Files: the PEFT layout holds each projection's tensors under its diffusers module
//! (`transformer.single_transformer_blocks.0.attn.to_q.lokr_w1`), what PEFT holds on the
//! diffusers model. The kohya layout holds them under LyCORIS's name of the diffusers module
//! (`lycoris_single_transformer_blocks_0_attn_to_q.lokr_w1`, LyCORIS's own prefix on the
//! module path, dots as underscores), which ComfyUI's Flux and SD3 key maps
//! (`comfy.lora.model_lora_keys_unet`: `"lycoris_{}".format(key_lora.replace(".", "_"))` over
//! `comfy.utils.flux_to_diffusers`) point at the projection's rows of the fused weight; the
//! fused layer's own kohya name (`lora_unet_single_blocks_0_linear1`) then names no tensor.

use super::io::{swap_halves, PeftFile, Reader};
use super::{Adapter, BaseLayer, LayerShape, PeftPart, Plan};
use crate::nn::dropout::BatchPart;
use crate::{Error, Result, Tensor};
use std::sync::Arc;

/// The kohya / LyCORIS name of the adapter on diffusers module `module`: LyCORIS's prefix.
pub(crate) fn lycoris_name(module: &str) -> String {
    format!("lycoris_{}", module.replace('.', "_"))
}

/// A fused layer's adapters, one per diffusers projection.
#[derive(Debug)]
pub struct PerProjection {
    path: String,
    shape: LayerShape,
    /// The projections, in the layer's row order.
    parts: Vec<PeftPart>,
    /// Each projection's adapter, on (rows, in).
    subs: Vec<Arc<dyn Adapter>>,
    /// Each projection's short name (the module's last component): its parameters are
    /// `<path>.<short>.<tensor>`.
    shorts: Vec<String>,
}

impl PerProjection {
    /// One adapter of `plan`'s kind per part, made by `make` with the part's rows.
    pub(super) fn new(
        p: &Plan,
        parts: Vec<PeftPart>,
        make: fn(&Plan) -> Result<Arc<dyn Adapter>>,
    ) -> Result<Self> {
        let LayerShape::Linear { in_dim, .. } = p.shape else {
            return Err(Error::Setting {
                setting: crate::Setting::AdapterPerProjection,
                msg: format!(
                    "= true: layer {} is a convolution; only Linear layers are fused",
                    p.path
                ),
            });
        };
        let mut subs = vec![];
        let mut shorts: Vec<String> = vec![];
        for part in &parts {
            let short = part.module.rsplit('.').next().unwrap_or(&part.module);
            if shorts.iter().any(|s| s == short) {
                return Err(Error::Setting {
                    setting: crate::Setting::AdapterPerProjection,
                    msg: format!(
                        "= true: two projections of layer {} end in {short:?}",
                        p.path
                    ),
                });
            }
            let path = format!("{}.{short}", p.path);
            let plan = Plan {
                path: &path,
                shape: LayerShape::Linear {
                    in_dim,
                    out_dim: part.rows,
                },
                bias: false,
                rank: p.rank,
                alpha: p.alpha,
                config: p.config,
                device: p.device,
                seed: p.config.seed ^ super::key_hash(&path),
                train: p.train.clone(),
            };
            subs.push(make(&plan)?);
            shorts.push(short.to_string());
        }
        Ok(PerProjection {
            path: p.path.to_string(),
            shape: p.shape,
            parts,
            subs,
            shorts,
        })
    }

    /// `params` split by projection.
    fn split<'p>(&self, params: &'p [Tensor]) -> Result<Vec<&'p [Tensor]>> {
        let mut rest = params;
        let mut v = vec![];
        for s in &self.subs {
            let n = s.params().len();
            if rest.len() < n {
                break;
            }
            let (mine, more) = rest.split_at(n);
            v.push(mine);
            rest = more;
        }
        if v.len() != self.subs.len() || !rest.is_empty() {
            return Err(Error::Autograd(format!(
                "{}: {} parameters for {} projections",
                self.path,
                params.len(),
                self.subs.len()
            )));
        }
        Ok(v)
    }

    /// The projections' changes stacked into the layer's rows, halves swapped back where
    /// diffusers swaps them; a projection module dropout skips adds zeros. `None` when every
    /// projection is skipped.
    fn stack(&self, changes: Vec<Option<Tensor>>) -> Result<Option<Tensor>> {
        let Some(like) = changes.iter().flatten().next().cloned() else {
            return Ok(None);
        };
        let in_dim = self.shape.in_dim();
        let rows = self
            .parts
            .iter()
            .zip(changes)
            .map(|(p, c)| match c {
                Some(c) if p.swapped => swap_halves(&c),
                Some(c) => Ok(c),
                None => Tensor::zeros(vec![p.rows, in_dim], like.dtype(), like.device()),
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&rows.iter().collect::<Vec<_>>(), 0).map(Some)
    }

    /// The projection's part as PEFT sees it on its own Linear.
    fn own_part(p: &PeftPart) -> [PeftPart; 1] {
        [PeftPart {
            module: p.module.clone(),
            start: 0,
            rows: p.rows,
            swapped: false,
        }]
    }

    /// Whether `parts` are this adapter's projections.
    fn same_parts(&self, parts: &[PeftPart]) -> Result<()> {
        if parts == self.parts.as_slice() {
            return Ok(());
        }
        Err(Error::Setting {
            setting: crate::Setting::AdapterLayout,
            msg: format!(
                " layer {} was adapted per projection ({}), the file's map gives {}",
                self.path,
                self.parts
                    .iter()
                    .map(|p| p.module.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                parts
                    .iter()
                    .map(|p| p.module.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }
}

impl Adapter for PerProjection {
    fn kind(&self) -> &'static str {
        self.subs.first().map_or("lokr", |s| s.kind())
    }

    fn path(&self) -> &str {
        &self.path
    }

    fn shape(&self) -> LayerShape {
        self.shape
    }

    /// Every projection's tensors in turn (the names repeat: [`Adapter::named_params`] tells
    /// them apart).
    fn params(&self) -> Vec<(&'static str, Tensor)> {
        self.subs.iter().flat_map(|s| s.params()).collect()
    }

    fn cast_params(&self) -> Vec<(Tensor, f64)> {
        self.subs.iter().flat_map(|s| s.cast_params()).collect()
    }

    fn named_params(&self) -> Vec<(String, Tensor)> {
        self.subs
            .iter()
            .zip(&self.shorts)
            .flat_map(|(s, short)| {
                s.params()
                    .into_iter()
                    .map(move |(n, t)| (format!("{}.{short}.{n}", self.path), t))
            })
            .collect()
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

    fn delta_weight(&self, base: &BaseLayer) -> Result<Tensor> {
        let changes = self
            .subs
            .iter()
            .zip(&self.parts)
            .map(|(s, p)| {
                let rows = |dt| -> Result<Tensor> {
                    let w = base.weight(dt)?.narrow(0, p.start, p.rows)?;
                    if p.swapped {
                        swap_halves(&w)
                    } else {
                        Ok(w)
                    }
                };
                s.delta_weight(&BaseLayer::new(s.shape(), &rows)).map(Some)
            })
            .collect::<Result<Vec<_>>>()?;
        self.stack(changes)?
            .ok_or_else(|| Error::Autograd(format!("{}: no projections", self.path)))
    }

    fn change_with(&self, p: &[Tensor]) -> Result<Option<Tensor>> {
        let changes = self
            .subs
            .iter()
            .zip(self.split(p)?)
            .map(|(s, mine)| s.change_with(mine))
            .collect::<Result<Vec<_>>>()?;
        self.stack(changes)
    }

    fn kohya_members(&self) -> Option<Vec<(String, Arc<dyn Adapter>)>> {
        Some(
            self.parts
                .iter()
                .zip(&self.subs)
                .map(|(p, s)| (lycoris_name(&p.module), s.clone()))
                .collect(),
        )
    }

    fn to_kohya(&self) -> Result<Vec<(String, Tensor)>> {
        Err(self.kohya_by_members())
    }

    fn load_kohya(&self, _: &mut Reader) -> Result<()> {
        Err(self.kohya_by_members())
    }

    fn to_peft(&self, parts: &[PeftPart]) -> Result<Vec<(String, Tensor)>> {
        self.same_parts(parts)?;
        let mut v = vec![];
        for (p, s) in self.parts.iter().zip(&self.subs) {
            v.extend(s.to_peft(&Self::own_part(p))?);
        }
        Ok(v)
    }

    fn load_peft(&self, parts: &[PeftPart], file: &mut PeftFile, file_scale: f64) -> Result<()> {
        self.same_parts(parts)?;
        for (p, s) in self.parts.iter().zip(&self.subs) {
            s.load_peft(&Self::own_part(p), file, file_scale)?;
        }
        Ok(())
    }

    fn set_batch(&self, step: u64, micro: u64, part: BatchPart) {
        for s in &self.subs {
            s.set_batch(step, micro, part);
        }
    }
}

impl PerProjection {
    fn kohya_by_members(&self) -> Error {
        Error::Setting {
            setting: crate::Setting::AdapterLayout,
            msg: format!(
                " layer {} is adapted per projection: its kohya tensors are its projections' \
                 (Adapter::kohya_members)",
                self.path
            ),
        }
    }
}
