//! Parameter groups, as PyTorch's optimizers have them (`param_groups`,
//! <https://pytorch.org/docs/stable/optim.html#per-parameter-options>): each group its own
//! learning rate (here a multiplier of the run's rate, so a schedule scales every group's
//! rate together, as PyTorch's schedulers scale each group's `initial_lr`) and optionally its
//! own weight decay.
//!
//! [`Grouped`] holds one optimizer per group, each built by [`OptimizerConfig::build`] over
//! the group's parameters, so state an optimizer keeps per parameter group stays per group:
//! a grouped [`Prodigy`](super::Prodigy) has one step-size estimate d per group. (prodigyopt
//! itself shares one d over its groups and refuses groups of different nonzero rates; with
//! one group the two agree.) A step hands the same gradients and the same gradient scale (the
//! run's global clipping factor and loss-scale unscaling) to every group; each takes the
//! gradients of its own parameters only.
//!
//! State file: with one group, exactly the file of that group's optimizer (so a run without
//! groups writes and reads the files it always did). With more, one file holding every
//! group's tensors and metadata under the prefix `group.<i>.`, and `"optimizer" = "groups"`,
//! `"groups"` (the count) and each group's `group.<i>.name` and `group.<i>.lr_scale`. A
//! load checks the groups' names and count against the file. A failed load may leave some
//! groups loaded; a following successful load replaces every group's state.

use super::{opt_err, Optimizer, OptimizerConfig, StateMap, StateSource};
use crate::{Grads, Result, Tensor};
use std::collections::HashMap;

const NAME: &str = "Grouped";
const KIND: &str = "groups";

/// One parameter group: a name (in messages and state files), its learning rate as a
/// multiplier of the run's, its weight decay (`None`: the optimizer's), and its parameters.
#[derive(Clone, Debug)]
pub struct ParamGroup {
    /// The group's name, unique among the groups.
    pub name: String,
    /// The group's learning rate over the run's, finite and >= 0.
    pub lr_scale: f64,
    /// The group's weight decay, or the optimizer's.
    pub weight_decay: Option<f64>,
    /// The group's parameters (none of them in another group).
    pub params: Vec<(String, Tensor)>,
}

/// The optimizer of `config` over `groups`: with one group at the config's own rate and
/// weight decay, that optimizer itself; otherwise a [`Grouped`].
pub fn build_groups(
    config: OptimizerConfig,
    groups: Vec<ParamGroup>,
) -> Result<Box<dyn Optimizer>> {
    match &groups[..] {
        [g] if g.lr_scale == 1.0 && g.weight_decay.is_none() => {
            let g = groups
                .into_iter()
                .next()
                .map(|g| g.params)
                .unwrap_or_default();
            config.build(g)
        }
        _ => Ok(Box::new(Grouped::new(config, groups)?)),
    }
}

struct Group {
    name: String,
    lr_scale: f64,
    opt: Box<dyn Optimizer>,
}

/// One optimizer per parameter group (see the module docs).
pub struct Grouped {
    groups: Vec<Group>,
    lr: f64,
}

impl std::fmt::Debug for Grouped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<(&str, f64)> = self
            .groups
            .iter()
            .map(|g| (g.name.as_str(), g.lr_scale))
            .collect();
        f.debug_struct(NAME)
            .field("lr", &self.lr)
            .field("groups", &groups)
            .finish()
    }
}

impl Grouped {
    /// Checks the groups (at least one; unique non-empty names; finite multipliers >= 0;
    /// no parameter in two groups) and builds each group's optimizer at `config`'s rate times
    /// its multiplier.
    pub fn new(config: OptimizerConfig, groups: Vec<ParamGroup>) -> Result<Self> {
        if groups.is_empty() {
            return Err(opt_err(NAME, "no parameter groups"));
        }
        let mut names = HashMap::new();
        let mut owner = HashMap::new();
        for g in &groups {
            if g.name.is_empty() || names.insert(g.name.clone(), ()).is_some() {
                return Err(opt_err(
                    NAME,
                    format!("group name {:?} is empty or given twice", g.name),
                ));
            }
            if !(g.lr_scale.is_finite() && g.lr_scale >= 0.0) {
                return Err(opt_err(
                    NAME,
                    format!(
                        "group {:?}: learning-rate multiplier {} is not finite and >= 0",
                        g.name, g.lr_scale
                    ),
                ));
            }
            for (n, p) in &g.params {
                if let Some(other) = owner.insert(p.id(), g.name.clone()) {
                    return Err(opt_err(
                        NAME,
                        format!("parameter '{n}' is in groups {other:?} and {:?}", g.name),
                    ));
                }
            }
        }
        let base = config.lr();
        let mut built = Vec::with_capacity(groups.len());
        for g in groups {
            let mut c = config.with_lr(base * g.lr_scale);
            if let Some(wd) = g.weight_decay {
                c = c.with_weight_decay(wd);
            }
            let opt = c
                .build(g.params)
                .map_err(|e| opt_err(NAME, format!("group {:?}: {e}", g.name)))?;
            built.push(Group {
                name: g.name,
                lr_scale: g.lr_scale,
                opt,
            });
        }
        Ok(Grouped {
            groups: built,
            lr: base,
        })
    }

    /// The groups' names and learning-rate multipliers, in order.
    pub fn groups(&self) -> Vec<(&str, f64)> {
        self.groups
            .iter()
            .map(|g| (g.name.as_str(), g.lr_scale))
            .collect()
    }

    fn prefix(i: usize) -> String {
        format!("group.{i}.")
    }
}

impl Optimizer for Grouped {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        for g in &mut self.groups {
            g.opt.step_scaled(grads, grad_scale)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
        for g in &mut self.groups {
            g.opt.set_learning_rate(lr * g.lr_scale);
        }
    }

    fn eval_mode(&mut self) -> Result<()> {
        for g in &mut self.groups {
            g.opt.eval_mode()?;
        }
        Ok(())
    }

    fn train_mode(&mut self) -> Result<()> {
        for g in &mut self.groups {
            g.opt.train_mode()?;
        }
        Ok(())
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        if let [g] = &self.groups[..] {
            return g.opt.save_state_to(out);
        }
        out.meta("optimizer".into(), KIND.into());
        out.meta("groups".into(), self.groups.len().to_string());
        for (i, g) in self.groups.iter().enumerate() {
            let mut part = StateMap::default();
            g.opt.save_state_to(&mut part)?;
            part.meta("name".into(), g.name.clone());
            part.meta("lr_scale".into(), g.lr_scale.to_string());
            out.absorb(&Self::prefix(i), part);
        }
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        if self.groups.len() == 1 {
            return match self.groups.first_mut() {
                Some(g) => g.opt.load_state_from(src),
                None => Ok(()),
            };
        }
        let bad = |msg: String| opt_err(NAME, format!("state file {}: {msg}", src.shown()));
        let meta = src.metadata();
        match meta.get("optimizer") {
            Some(k) if k == KIND => {}
            k => {
                return Err(bad(format!(
                    "holds the state of optimizer kind {k:?}, not of {} parameter groups",
                    self.groups.len()
                )))
            }
        }
        let n = self.groups.len();
        if meta.get("groups") != Some(&n.to_string()) {
            return Err(bad(format!(
                "holds {:?} parameter groups, this optimizer has {n}",
                meta.get("groups")
            )));
        }
        let prefixes: Vec<String> = (0..n).map(Self::prefix).collect();
        let ours = |k: &str| prefixes.iter().any(|p| k.starts_with(p.as_str()));
        if let Some(k) = meta
            .keys()
            .find(|k| !ours(k) && *k != "optimizer" && *k != "groups")
        {
            return Err(bad(format!("unexpected metadata key '{k}'")));
        }
        if let Some(t) = src.names().find(|t| !ours(t)) {
            return Err(bad(format!("tensor '{t}' belongs to no parameter group")));
        }
        for (g, prefix) in self.groups.iter().zip(&prefixes) {
            let name = meta.get(&format!("{prefix}name"));
            if name != Some(&g.name) {
                return Err(bad(format!(
                    "group {prefix}* is {name:?}, this optimizer's is {:?}",
                    g.name
                )));
            }
        }
        let file = src.file();
        for (g, prefix) in self.groups.iter_mut().zip(&prefixes) {
            // The group's own keys besides its optimizer's: its name and multiplier (the
            // multiplier is the config's, the rate set by the schedule each step).
            let part = StateSource::under_except(
                file,
                &format!("{}{prefix}", src.prefix()),
                &["name", "lr_scale"],
            );
            g.opt.load_state_from(&part)?;
        }
        Ok(())
    }
}
