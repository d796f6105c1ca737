#!/usr/bin/env python3
"""Optimizer fixtures: 50 steps of the reference packages' optimizers (tests/prodigy.rs,
tests/schedulefree.rs, tests/lion.rs), 30 of transformers' Adafactor (tests/adafactor.rs).

Usage:  python scripts/make_optimizer_fixtures.py [OUT_DIR]      (default OUT_DIR: tests/fixtures/optim)

Needs torch, safetensors, numpy, prodigyopt (1.1.2), schedulefree (1.4.1) and
prodigy-plus-schedule-free (2.0.1),
lion-pytorch (0.2), bitsandbytes (0.50, its CPU path) and transformers (5.x, its
optimization.Adafactor); no network. Runs on the CPU in float32,
one thread. Random values: numpy's PCG64 (`numpy.random.default_rng(SEED + k)`), standard
normals rounded to float32; deterministic (two runs write the same bytes).

Files written, one per case, float32 unless said:

  prodigy_<case>.safetensors
    init.<p>         the parameters before the first step: p_a (3, 5) and p_b (7,) random,
                     p_zero (4, 3) zeros (a LoRA up matrix: prodigyopt keeps no p0 copy)
    target.<p>       a point the gradients pull towards (k = 200 + i)
    noise.<p>        (50, *shape) 0.3 times normals (lion8bit: (5, *shape), step k takes k % 5) (k = 100 + i), rounded to float32: the
                     gradient of step k is (p - target) + noise[k], each operation in float32
    lr               (50,) float64, the lr set before step k (a linear warm-up in `warmup`)
    final.<p>        the parameters after 50 steps
    d                (50,) float64, the group's d after step k
    metadata: the case's hyperparameters, as Prodigy(...) was called (json).

  sf_<case>.safetensors (schedule-free)
    as above with a fourth parameter p_c (6, 9) random (k = 3); the gradient is taken at the
    parameters (y) after opt.train(); no lr key (a constant rate)
    final.<p>        y after 50 steps
    final_x.<p>      x after 50 steps (opt.eval())
    d                (50,) float64, the group's d after step k (prodigy cases only)

Cases:
  lion_<case>.safetensors, lion8bit_<case>.safetensors
    the same tensors for their parameters, without d; lion8bit's parameters are p_big
    (80, 64), 5120 values, so 8-bit (at least bitsandbytes' min_8bit_size, 4096), and p_a,
    f32 state.

  adafactor_<case>.safetensors
    init, target, noise ((30, *shape)) and final of p_b (7,), p_a (3, 5), p_zero (4, 3)
    zeros and p_conv (2, 3, 4, 5); lr (30,) float64 the lr set before step k (0 where lr is
    None: relative steps); traj.<p> (30, *shape), the parameters after each step.

Prodigy cases:
  default   Prodigy(lr=1.0): prodigyopt's defaults
  warmup    weight_decay=0.1 (decoupled), use_bias_correction, safeguard_warmup, d_coef=2,
            growth_rate=1.5, lr warming up linearly over 10 steps
  coupled   decouple=False, weight_decay=0.05, betas=(0, 0.99) (no first moment), beta3=0.9,
            d0=1e-5
Adafactor cases (transformers.optimization.Adafactor):
  adafactor_kohya     lr=1e-3 on a cosine schedule, scale_parameter=False,
                      relative_step=False, warmup_init=False (kohya's usual settings)
  adafactor_default   lr=None: relative steps, parameter scale, the defaults
  adafactor_momentum  as kohya with beta1=0.9, weight_decay=0.01
  adafactor_warmup    lr=None, warmup_init=True, beta1=0.9, weight_decay=0.01,
                      clip_threshold=0.5, decay_rate=-0.7
Schedule-free cases:
  sf_adamw_default    AdamWScheduleFree(lr=0.0025): schedulefree's defaults
  sf_adamw_warmup     lr=0.01, betas=(0.95, 0.99), eps=1e-6, weight_decay=0.05,
                      warmup_steps=10, r=0.5, weight_lr_power=1.0
  sf_prodigy_default  ProdigyPlusScheduleFree(lr=1.0, factored=False, use_stableadamw=False,
                      stochastic_rounding=False): the core update, other options default
  sf_prodigy_decay    as sf_prodigy_default with weight_decay=0.1, d_limiter=False,
                      schedulefree_c=10, betas=(0.95, 0.999), beta3=0.98, d_coef=2, d0=1e-5
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from prodigyopt import Prodigy
from prodigyplus import ProdigyPlusScheduleFree
from schedulefree import AdamWScheduleFree

SEED = 20261129
STEPS = 50
SHAPES = {"p_a": (3, 5), "p_b": (7,), "p_zero": (4, 3)}

CASES = {
    "default": dict(lr=1.0),
    "warmup": dict(
        lr=1.0,
        weight_decay=0.1,
        use_bias_correction=True,
        safeguard_warmup=True,
        d_coef=2.0,
        growth_rate=1.5,
    ),
    "coupled": dict(
        lr=1.0, decouple=False, weight_decay=0.05, betas=(0.0, 0.99), beta3=0.9, d0=1e-5
    ),
}

# lion_pytorch.Lion and bitsandbytes.optim.Lion8bit (same keywords); lr follows `schedule`.
LION_CASES = {
    "default": dict(lr=1e-3),
    "decay": dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1),
}
LION_SHAPES = {"p_a": (3, 5), "p_b": (7,)}
LION8_SHAPES = {"p_big": (80, 64), "p_a": (3, 5)}


def normals(k, shape):
    rng = np.random.default_rng(SEED + k)
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def run(name, kwargs, out):
    params = {}
    for i, (p, shape) in enumerate(SHAPES.items()):
        t = torch.zeros(shape) if p == "p_zero" else normals(i, shape)
        params[p] = torch.nn.Parameter(t)
    tensors = {f"init.{p}": t.detach().clone() for p, t in params.items()}
    # The gradient of a quadratic pull towards a target plus noise, so that the parameters
    # travel, d grows as in training and the run stays bounded:
    # grad = (p - target) + noise[k], in float32.
    targets = {p: normals(200 + i, SHAPES[p]) for i, p in enumerate(SHAPES)}
    noise = {
        p: (0.3 * normals(100 + i, (STEPS, *SHAPES[p]))).to(torch.float32)
        for i, p in enumerate(SHAPES)
    }
    opt = Prodigy(list(params.values()), **kwargs)
    lrs, ds = [], []
    for k in range(STEPS):
        lr = kwargs["lr"] * min(1.0, (k + 1) / 10) if name == "warmup" else kwargs["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        lrs.append(lr)
        for p, t in params.items():
            t.grad = (t.detach() - targets[p]) + noise[p][k]
        opt.step()
        ds.append(opt.param_groups[0]["d"])
    for p in SHAPES:
        tensors[f"target.{p}"] = targets[p]
        tensors[f"noise.{p}"] = noise[p]
        tensors[f"final.{p}"] = params[p].detach().clone()
    tensors["lr"] = torch.tensor(lrs, dtype=torch.float64)
    tensors["d"] = torch.tensor(ds, dtype=torch.float64)
    meta = {"format": "pt", "kwargs": json.dumps(kwargs)}
    path = out / f"prodigy_{name}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    path.chmod(0o644)


SF_SHAPES = {**SHAPES, "p_c": (6, 9)}
PRODIGY_SF_CORE = dict(factored=False, use_stableadamw=False, stochastic_rounding=False)
SF_CASES = {
    "sf_adamw_default": (AdamWScheduleFree, dict(lr=0.0025)),
    "sf_adamw_warmup": (
        AdamWScheduleFree,
        dict(
            lr=0.01,
            betas=(0.95, 0.99),
            eps=1e-6,
            weight_decay=0.05,
            warmup_steps=10,
            r=0.5,
            weight_lr_power=1.0,
        ),
    ),
    "sf_prodigy_default": (ProdigyPlusScheduleFree, dict(lr=1.0, **PRODIGY_SF_CORE)),
    "sf_prodigy_decay": (
        ProdigyPlusScheduleFree,
        dict(
            lr=1.0,
            weight_decay=0.1,
            d_limiter=False,
            schedulefree_c=10.0,
            betas=(0.95, 0.999),
            beta3=0.98,
            d_coef=2.0,
            d0=1e-5,
            **PRODIGY_SF_CORE,
        ),
    ),
}


def run_sf(name, cls, kwargs, out):
    params = {}
    for i, (p, shape) in enumerate(SF_SHAPES.items()):
        t = torch.zeros(shape) if p == "p_zero" else normals(i, shape)
        params[p] = torch.nn.Parameter(t)
    tensors = {f"init.{p}": t.detach().clone() for p, t in params.items()}
    targets = {p: normals(200 + i, SF_SHAPES[p]) for i, p in enumerate(SF_SHAPES)}
    noise = {
        p: (0.3 * normals(100 + i, (STEPS, *SF_SHAPES[p]))).to(torch.float32)
        for i, p in enumerate(SF_SHAPES)
    }
    opt = cls(list(params.values()), **kwargs)
    opt.train()
    ds = []
    for k in range(STEPS):
        for p, t in params.items():
            t.grad = (t.detach() - targets[p]) + noise[p][k]
        opt.step()
        if "d" in opt.param_groups[0]:
            ds.append(opt.param_groups[0]["d"])
    for p in SF_SHAPES:
        tensors[f"target.{p}"] = targets[p]
        tensors[f"noise.{p}"] = noise[p]
        tensors[f"final.{p}"] = params[p].detach().clone()
    opt.eval()
    for p in SF_SHAPES:
        tensors[f"final_x.{p}"] = params[p].detach().clone()
    if ds:
        tensors["d"] = torch.tensor(ds, dtype=torch.float64)
    meta = {"format": "pt", "kwargs": json.dumps(kwargs)}
    path = out / f"{name}.safetensors"
    save_file(tensors, str(path), metadata=meta)
def lion_run(prefix, make, shapes, name, kwargs, out, period=STEPS):
    """50 steps of `make(params, **kwargs)` on the quadratic pull plus noise (step k takes
    noise[k % period]: lion8bit's files keep 5 draws, to stay small); the "decay" case takes
    a cosine schedule of lr over the 50 steps."""
    params = {p: torch.nn.Parameter(normals(i, shape)) for i, (p, shape) in enumerate(shapes.items())}
    tensors = {f"init.{p}": t.detach().clone() for p, t in params.items()}
    targets = {p: normals(200 + i, shapes[p]) for i, p in enumerate(shapes)}
    noise = {p: (0.3 * normals(100 + i, (period, *shapes[p]))).to(torch.float32) for i, p in enumerate(shapes)}
    opt = make(list(params.values()), **kwargs)
    lrs = []
    for k in range(STEPS):
        lr = kwargs["lr"]
        if name == "decay":
            lr = kwargs["lr"] * 0.5 * (1.0 + np.cos(np.pi * k / STEPS))
        for g in opt.param_groups:
            g["lr"] = float(lr)
        lrs.append(float(lr))
        for p, t in params.items():
            t.grad = (t.detach() - targets[p]) + noise[p][k % period]
        opt.step()
    for p in shapes:
        tensors[f"target.{p}"] = targets[p]
        tensors[f"noise.{p}"] = noise[p]
        tensors[f"final.{p}"] = params[p].detach().clone()
    tensors["lr"] = torch.tensor(lrs, dtype=torch.float64)
    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    path = out / f"{prefix}_{name}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "kwargs": json.dumps(kw)})
    path.chmod(0o644)


ADAFACTOR_STEPS = 30
ADAFACTOR_SHAPES = {"p_b": (7,), "p_a": (3, 5), "p_zero": (4, 3), "p_conv": (2, 3, 4, 5)}
KOHYA = dict(lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
ADAFACTOR_CASES = {
    "kohya": KOHYA,
    "default": dict(lr=None),
    "momentum": dict(KOHYA, beta1=0.9, weight_decay=0.01),
    "warmup": dict(
        lr=None, warmup_init=True, beta1=0.9, weight_decay=0.01, clip_threshold=0.5, decay_rate=-0.7
    ),
}


def adafactor_run(name, kwargs, out):
    """30 steps of transformers' Adafactor on the quadratic pull plus noise; a given lr
    follows a cosine schedule over the steps."""
    from transformers.optimization import Adafactor

    shapes = ADAFACTOR_SHAPES
    params = {}
    for i, (p, shape) in enumerate(shapes.items()):
        t = torch.zeros(shape) if p == "p_zero" else normals(300 + i, shape)
        params[p] = torch.nn.Parameter(t)
    tensors = {f"init.{p}": t.detach().clone() for p, t in params.items()}
    targets = {p: normals(400 + i, shapes[p]) for i, p in enumerate(shapes)}
    noise = {
        p: (0.3 * normals(500 + i, (ADAFACTOR_STEPS, *shapes[p]))).to(torch.float32)
        for i, p in enumerate(shapes)
    }
    opt = Adafactor(list(params.values()), **kwargs)
    lrs, traj = [], {p: [] for p in shapes}
    for k in range(ADAFACTOR_STEPS):
        lr = kwargs["lr"]
        if lr is not None:
            lr = float(lr * 0.5 * (1.0 + np.cos(np.pi * k / ADAFACTOR_STEPS)))
            for g in opt.param_groups:
                g["lr"] = lr
        lrs.append(0.0 if lr is None else lr)
        for p, t in params.items():
            t.grad = (t.detach() - targets[p]) + noise[p][k]
        opt.step()
        for p, t in params.items():
            traj[p].append(t.detach().clone())
    for p in shapes:
        tensors[f"target.{p}"] = targets[p]
        tensors[f"noise.{p}"] = noise[p]
        tensors[f"final.{p}"] = params[p].detach().clone()
        tensors[f"traj.{p}"] = torch.stack(traj[p])
    tensors["lr"] = torch.tensor(lrs, dtype=torch.float64)
    path = out / f"adafactor_{name}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "kwargs": json.dumps(kwargs)})
    path.chmod(0o644)


def main():
    torch.set_num_threads(1)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures/optim"
    out.mkdir(parents=True, exist_ok=True)
    for name, kwargs in CASES.items():
        run(name, kwargs, out)
    for name, (cls, kwargs) in SF_CASES.items():
        run_sf(name, cls, kwargs, out)
    from lion_pytorch import Lion
    import bitsandbytes as bnb

    for name, kwargs in LION_CASES.items():
        lion_run("lion", Lion, LION_SHAPES, name, kwargs, out)
        lion_run("lion8bit", bnb.optim.Lion8bit, LION8_SHAPES, name, kwargs, out, period=5)
    for name, kwargs in ADAFACTOR_CASES.items():
        adafactor_run(name, kwargs, out)
    n = len(CASES) + len(SF_CASES) + 2 * len(LION_CASES) + len(ADAFACTOR_CASES)
    print(f"wrote {n} files to {out}")


if __name__ == "__main__":
    main()
