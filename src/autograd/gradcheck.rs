//! Gradient checking by central differences in f64 on the CPU backend (PyTorch's gradcheck
//! defaults: eps 1e-6, atol 1e-5, rtol 1e-3). For a function f and inputs x, the analytic
//! gradient of `sum(f(x) * r)` (r random, so every output element counts differently) is
//! compared with `(L(x + eps e_j) - L(x - eps e_j)) / 2 eps` for every input element j.

use crate::{DType, Error, Result, Tensor};
use std::collections::BTreeSet;

/// Tolerances of [`gradcheck`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy)]
pub struct GradcheckConfig {
    /// Half the step of the central difference (default 1e-6).
    pub eps: f64,
    /// Absolute tolerance on |analytic - numeric| (default 1e-5).
    pub atol: f64,
    /// Tolerance relative to |numeric|, added to `atol` (default 1e-3).
    pub rtol: f64,
    /// Seed of the random output weights r.
    pub seed: u64,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        GradcheckConfig {
            eps: 1e-6,
            atol: 1e-5,
            rtol: 1e-3,
            seed: 0x5eed,
        }
    }
}

/// What a passing [`gradcheck`] compared.
#[derive(Debug, Clone)]
pub struct GradcheckReport {
    /// The recorded ops of f's graph, by name (see `differentiable_ops`).
    pub ops: BTreeSet<&'static str>,
    /// The largest |analytic - numeric| seen.
    pub max_abs_err: f64,
    /// The number of gradient elements compared.
    pub checked: usize,
}

/// The kinds of the recorded ops reachable from `root`.
pub fn graph_ops(root: &Tensor) -> Result<BTreeSet<&'static str>> {
    Ok(graph_op_counts(root)?.into_keys().collect())
}

/// How many recorded ops of each kind are reachable from `root`: what a backward from it
/// will run (each kind's VJP launches one or a few kernels on a GPU), where a model's graph
/// spends its ops.
pub fn graph_op_counts(root: &Tensor) -> Result<std::collections::BTreeMap<&'static str, usize>> {
    let mut counts = std::collections::BTreeMap::new();
    for t in super::backward::tape(root)? {
        if let Some(m) = t.grad_fn() {
            let guard = m.lock().map_err(|_| Error::Poisoned("autograd node"))?;
            if let Some(op) = guard.as_ref() {
                *counts.entry(op.kind()).or_insert(0) += 1;
            }
        }
    }
    Ok(counts)
}

fn weighted_sum(y: &Tensor, r: &Tensor) -> Result<Tensor> {
    y.mul(r)?.sum_all()
}

/// Checks the gradients of `f` at `inputs` (f64 tensors); Err names the first input element
/// whose analytic and numeric gradients disagree.
pub fn gradcheck(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    cfg: GradcheckConfig,
) -> Result<GradcheckReport> {
    for (i, x) in inputs.iter().enumerate() {
        if x.dtype() != DType::F64 {
            return Err(Error::Autograd(format!(
                "gradcheck input {i} is {}, not f64",
                x.dtype()
            )));
        }
    }
    // Fresh leaves, so the caller's tensors are untouched.
    let leaves = inputs
        .iter()
        .map(|x| {
            let v = Tensor::from_host(x.to_host()?, x.shape().clone(), x.device())?;
            v.set_requires_grad(true)?;
            Ok(v)
        })
        .collect::<Result<Vec<_>>>()?;
    let y = f(&leaves)?;
    if y.dtype() != DType::F64 {
        return Err(Error::Autograd(format!(
            "gradcheck output is {}, not f64",
            y.dtype()
        )));
    }
    let r = Tensor::rand_uniform(
        0.5,
        1.5,
        y.shape().clone(),
        DType::F64,
        y.device(),
        cfg.seed,
    )?;
    let loss = weighted_sum(&y, &r)?;
    let ops = if loss.requires_grad() {
        graph_ops(&loss)?
    } else {
        BTreeSet::new()
    };
    let grads = if loss.requires_grad() {
        loss.backward()?
    } else {
        Default::default()
    };

    let _g = crate::no_grad();
    let mut report = GradcheckReport {
        ops,
        max_abs_err: 0.0,
        checked: 0,
    };
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = match grads.get(leaf) {
            Some(g) => g.to_vec_f64()?,
            None => vec![0.0; leaf.elem_count()],
        };
        let base = leaf.to_vec::<f64>()?;
        let eval = |j: usize, delta: f64| -> Result<f64> {
            let mut v = base.clone();
            v[j] += delta;
            let mut args = leaves.clone();
            args[i] = Tensor::from_vec(v, leaf.shape().clone(), leaf.device())?;
            weighted_sum(&f(&args)?, &r)?.to_scalar_f64()
        };
        for (j, &a) in analytic.iter().enumerate() {
            let numeric = (eval(j, cfg.eps)? - eval(j, -cfg.eps)?) / (2.0 * cfg.eps);
            let err = (a - numeric).abs();
            report.max_abs_err = report.max_abs_err.max(err);
            report.checked += 1;
            if err.is_nan() || err > cfg.atol + cfg.rtol * numeric.abs() {
                return Err(Error::Autograd(format!(
                    "gradcheck: input {i} (shape {}), element {j}: analytic {a:.8e} vs numeric {numeric:.8e}",
                    leaf.shape()
                )));
            }
        }
    }
    Ok(report)
}
