//! The Conv2d layer: its weights, its adapter, and the convolution of `functional.rs`.

use super::adapter::{Adapter, BaseLayer, LayerShape};
use super::functional::conv2d;
use super::VarBuilder;
use crate::{Error, Result, Tensor};
use std::sync::Arc;

/// A Conv2d layer; keys `weight` (Cout, Cin / groups, kh, kw) and `bias` (Cout).
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// (Cout, Cin / groups, kh, kw).
    pub weight: Tensor,
    /// (Cout), if the layer has one.
    pub bias: Option<Tensor>,
    /// Step between windows (sh, sw).
    pub stride: (usize, usize),
    /// Zeros added on each side (ph, pw).
    pub padding: (usize, usize),
    /// Spacing between kernel taps (dh, dw).
    pub dilation: (usize, usize),
    /// Channel groups: each output channel sees Cin / groups input channels.
    pub groups: usize,
    /// The adapter (LoCon, DoRA, ...), if one was planned for this path (one group only).
    pub adapter: Option<Arc<dyn Adapter>>,
}

/// Hyperparameters of a Conv2d.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dConfig {
    /// Step between windows, both axes (default 1).
    pub stride: usize,
    /// Zeros added on every side (default 0).
    pub padding: usize,
    /// Spacing between kernel taps, both axes (default 1).
    pub dilation: usize,
    /// Channel groups; must divide Cin and Cout (default 1).
    pub groups: usize,
    /// Whether the layer has a bias (default true).
    pub bias: bool,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Conv2dConfig {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
        }
    }
}

impl Conv2d {
    /// A square `kernel` x `kernel` convolution `cin` -> `cout` with `weight` (and `bias`)
    /// from `vb`; errors when `cfg.groups` does not divide `cin`.
    pub fn new(
        vb: &VarBuilder,
        cin: usize,
        cout: usize,
        kernel: usize,
        cfg: Conv2dConfig,
    ) -> Result<Self> {
        if cfg.groups == 0 || cin % cfg.groups != 0 {
            return Err(Error::Param {
                key: vb.key("weight"),
                file: None,
                msg: format!(
                    "{cin} input channels are not divisible into {} groups",
                    cfg.groups
                ),
            });
        }
        let weight = vb.get((cout, cin / cfg.groups, kernel, kernel), "weight")?;
        let bias = if cfg.bias {
            Some(vb.get(cout, "bias")?)
        } else {
            None
        };
        let mut conv = Conv2d {
            weight,
            bias,
            stride: (cfg.stride, cfg.stride),
            padding: (cfg.padding, cfg.padding),
            dilation: (cfg.dilation, cfg.dilation),
            groups: cfg.groups,
            adapter: None,
        };
        let shape = conv.layer_shape();
        conv.adapter = match vb.adapter(shape, conv.bias.is_some())? {
            Some(_) if cfg.groups != 1 => {
                return Err(Error::Param {
                    key: vb.key("weight"),
                    file: None,
                    msg: format!(
                        "an adapter targets a convolution of {} groups; adapters take                          one-group convolutions only",
                        cfg.groups
                    ),
                })
            }
            a => a,
        };
        Ok(conv)
    }

    /// The op as an adapter sees it.
    pub fn layer_shape(&self) -> LayerShape {
        let d = self.weight.dims();
        LayerShape::Conv2d {
            cin: d[1] * self.groups,
            cout: d[0],
            kernel: (d[2], d[3]),
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
        }
    }

    /// x (N, Cin, H, W) -> (N, Cout, Ho, Wo), sizes as [`crate::Window2d::out_size`] gives them.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_tail(x, false)
    }

    /// [`Conv2d::forward`] for a checkpointed block's last layer whose output, in the
    /// block's re-run, no gradient reads when `unread` (an SDXL ResBlock ends `skip(x) +
    /// conv2(h)`: the backward needs `h`, never the sum's terms): the re-run then takes
    /// zeros for the base convolution's product and records its backward as usual
    /// (`autograd::unread_product`; the adapter's products still run). Gradients are the same
    /// bit for bit. Outside a checkpoint, and with `unread` false, `forward`.
    pub fn forward_tail(&self, x: &Tensor, unread: bool) -> Result<Tensor> {
        // An adapter that does more than add to the base output may read it.
        let unread = unread && self.adapter.as_ref().is_none_or(|a| a.adds_to_output());
        let base = |bias: Option<&Tensor>| {
            crate::autograd::unread_product(unread, || {
                conv2d(
                    x,
                    &self.weight,
                    bias,
                    self.stride,
                    self.padding,
                    self.dilation,
                    self.groups,
                )
            })
        };
        let Some(a) = &self.adapter else {
            return base(self.bias.as_ref());
        };
        let y = base(None)?;
        let weight = |dtype| self.weight.to_dtype(dtype);
        let y = a.forward(&BaseLayer::new(self.layer_shape(), &weight), x, y)?;
        match &self.bias {
            Some(b) => y.add(&b.reshape((1, b.elem_count(), 1, 1))?),
            None => Ok(y),
        }
    }
}
